//! Rate limits across controllers (cluster mode): a tenant's `requests_per_s` holds for the
//! cluster, not for each controller behind the load balancer.
//!
//! Each controller keeps its own token buckets (crate::ratelimit), so the request path never
//! waits on the database. Every [`SHARE_EVERY`] it appends what it let through since its last
//! report, per (tenant, route class), to `rate_usage` in PostgreSQL, and reads the other
//! controllers' reports since its previous read (with a margin for late commits; at most the
//! last [`WINDOW`]); each report is taken once (by id) and its count
//! taken from the same bucket here ([`crate::ratelimit::Bucket::debit_at`]: down to one bucket
//! below empty at most). So every controller's bucket is a replica of one bucket that all of
//! them spend, and a tenant calling N controllers gets its rate once, not N times.
//!
//! What it costs and what it allows:
//! - Over its rate, a tenant can pass at most what the other controllers let through within
//!   one report interval (they had not heard of it yet), on top of the burst: the bound is the
//!   burst plus about `SHARE_EVERY × rate × (controllers − 1)`.
//! - A forwarded call is counted once, by the controller that serves it (the forwarding layer
//!   runs before the limiter).
//! - The database is written once per interval per controller (one row per active tenant and
//!   class) and read once; reports older than [`KEEP`] are removed by any controller. When the
//!   database cannot be reached, each controller goes on limiting with its own buckets (the
//!   unsent counts go with the next report) and says so in its log.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use torpor_control::store::{RateReport, RateUsage};
use torpor_core::TenantId;

use crate::ratelimit::RouteClass;
use crate::state::ApiState;

/// How often a controller reports and reads.
pub const SHARE_EVERY: Duration = Duration::from_millis(250);
/// How far back the other controllers' reports are read at most (a controller stalled longer
/// misses reports, and its tenants get more than their rate for that long).
pub const WINDOW: Duration = Duration::from_secs(5);
/// How much further back than its previous read a controller reads: a report whose insert
/// began before that read (its `at`) but committed after it is still found.
const LATE_COMMIT: Duration = Duration::from_secs(1);
/// Reports older than this are removed.
pub const KEEP: Duration = Duration::from_secs(60);
/// How often old reports are removed.
const PRUNE_EVERY: Duration = Duration::from_secs(10);

/// Reports and reads until the process ends (spawned by `torpor controller`; `me` is its
/// name).
pub async fn run(state: Arc<ApiState>, me: String) {
    let limiter = &state.limits.rate;
    limiter.count_for_sharing();
    let store = state.engine.state_store();
    // Ids of the reports already taken, with when they were first seen.
    let mut taken: HashMap<i64, Instant> = HashMap::new();
    let mut pruned = Instant::now();
    // When the last read that answered began: the next reads back from there (plus
    // LATE_COMMIT), not the whole WINDOW, so each report is read a few times, not ~20.
    let mut last_read: Option<Instant> = None;
    let mut failing = false;
    let mut tick = tokio::time::interval(SHARE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let mine = limiter.take_unreported();
        let rows: Vec<RateUsage> = mine
            .iter()
            .map(|(t, c, n)| RateUsage {
                tenant: t.to_string(),
                class: c.as_str().to_string(),
                count: *n,
            })
            .collect();
        let prune = pruned.elapsed() >= PRUNE_EVERY;
        let (store, name) = (store.clone(), me.clone());
        let reading = Instant::now();
        let within = last_read.map_or(WINDOW, |t| (t.elapsed() + LATE_COMMIT).min(WINDOW));
        let exchanged = tokio::task::spawn_blocking(move || {
            let sent = store.put_rate_usage(&name, &rows);
            let read = store.rate_usage_of_others(&name, within);
            if prune {
                if let Err(e) = store.prune_rate_usage(KEEP) {
                    tracing::debug!(error = %e, "cannot remove old rate reports");
                }
            }
            (sent, read)
        })
        .await;
        if prune {
            pruned = Instant::now();
        }
        let (sent, read) = match exchanged {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "the rate-report task failed");
                limiter.put_back_unreported(mine);
                continue;
            }
        };
        if read.is_ok() {
            last_read = Some(reading);
        }
        let ok = match (sent, read) {
            (Ok(()), Ok(reports)) => {
                take(&state, &mut taken, reports);
                true
            }
            (sent, read) => {
                if sent.is_err() {
                    limiter.put_back_unreported(mine);
                }
                if !failing {
                    let error = sent.err().or(read.err()).map(|e| e.to_string());
                    tracing::warn!(error = ?error, "cannot share rate limits with the other controllers; limiting with this controller's counts alone until the database answers");
                }
                false
            }
        };
        if ok && failing {
            tracing::info!("rate limits shared with the other controllers again");
        }
        failing = !ok;
        taken.retain(|_, seen| seen.elapsed() < 2 * WINDOW);
    }
}

/// Takes from the buckets here what the reports not yet taken say was spent elsewhere.
fn take(state: &ApiState, taken: &mut HashMap<i64, Instant>, reports: Vec<RateReport>) {
    let now = Instant::now();
    for r in reports {
        if taken.insert(r.id, now).is_some() {
            continue;
        }
        let (Ok(tenant), Some(class)) = (
            TenantId::new(&r.usage.tenant),
            RouteClass::parse(&r.usage.class),
        ) else {
            tracing::debug!(
                report = r.id,
                "a rate report names no tenant or class of this build"
            );
            continue;
        };
        state
            .limits
            .rate
            .debit(state, &tenant, class, r.usage.count);
    }
}
