//! `GET /sandboxes/{id}/metrics?start=&end=` (E2B's `get_metrics`): CPU, memory and disk
//! samples of a sandbox, read inside it as envd reads them (`/proc/stat`, `/proc/meminfo`,
//! `df /`), which under gVisor are the sandbox's own figures.
//!
//! As E2B does, a sandbox is sampled every [`SAMPLE_EVERY`] while it runs ([`sampler_task`]):
//! the engine's resident sandboxes are looked at in memory (a sleeping sandbox costs the
//! sampler nothing: no store read, no call, nothing woken), and each running E2B sandbox runs
//! [`SAMPLE_SCRIPT`] through a call that is not activity (the idle policy still freezes and
//! parks it as if unsampled). A sample is also taken when metrics are asked for and the sandbox
//! is running. Samples are kept in the state store (SQLite, or PostgreSQL in cluster mode, so
//! any controller answers and a restart keeps them; one write per sampler tick) for
//! [`KEEP_FOR`]; every minute older ones and those of deleted sandboxes go. The answer is the
//! kept samples within `start..=end` (Unix seconds), oldest first: the newest [`MAX_SAMPLES`]
//! of them.

use std::sync::{Arc, Mutex};

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::Json;
use serde::{Deserialize, Serialize};
use torpor_core::SandboxId;

use super::control::authenticate;
use super::envd::{run, Ctx};
use super::{E2b, E2bError};

/// Samples one answer gives at most: the newest within the range (an hour at 5 s).
pub const MAX_SAMPLES: usize = 720;
/// How long samples are kept.
pub const KEEP_FOR: std::time::Duration = std::time::Duration::from_secs(3600);
/// How often a running sandbox is sampled (E2B's cadence).
pub const SAMPLE_EVERY: std::time::Duration = std::time::Duration::from_secs(5);
/// Sandboxes sampled at once.
const SAMPLE_CONCURRENCY: usize = 4;

/// One E2B `SandboxMetric`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Sample {
    pub timestamp: String,
    pub timestamp_unix: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// Samples as the state store keeps them: (sandbox, Unix ms, JSON).
fn stored(samples: Vec<(SandboxId, i64, Sample)>) -> Vec<(SandboxId, i64, String)> {
    samples
        .into_iter()
        .filter_map(|(id, ms, s)| serde_json::to_string(&s).ok().map(|j| (id, ms, j)))
        .collect()
}

/// Keeps samples in the state store (every controller of a cluster reads them there).
fn keep(st: &E2b, samples: Vec<(SandboxId, i64, Sample)>) {
    if let Err(e) = st
        .api
        .engine
        .state_store()
        .put_metric_samples(&stored(samples))
    {
        tracing::warn!(error = %e, "cannot keep metrics samples");
    }
}

/// `id`'s kept samples within `start..=end` (Unix seconds), oldest first: the newest
/// [`MAX_SAMPLES`] of them.
fn within(
    st: &E2b,
    id: &SandboxId,
    start: Option<i64>,
    end: Option<i64>,
) -> Result<Vec<Sample>, E2bError> {
    let from_ms = start.map_or(0, |s| s.saturating_mul(1000));
    // The whole last second of `end`.
    let to_ms = end.map_or(i64::MAX, |e| e.saturating_mul(1000).saturating_add(999));
    let rows = st
        .api
        .engine
        .state_store()
        .metric_samples(id, from_ms, to_ms, MAX_SAMPLES)
        .map_err(|e| {
            tracing::error!(sandbox = %id, error = %e, "cannot read metrics samples");
            E2bError::new(
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                "the metrics samples cannot be read now",
            )
        })?;
    Ok(rows
        .into_iter()
        .filter_map(|(_, json)| serde_json::from_str(&json).ok())
        .collect())
}

/// Two `/proc/stat` readings 0.2 s apart, the CPU count, `/proc/meminfo` and `df` of `/`:
/// `busy_delta total_delta cpus mem_total_kb mem_available_kb cached_kb disk_total_kb
/// disk_used_kb`.
pub const SAMPLE_SCRIPT: &str = r#"read _ a b c d e f g h _ < /proc/stat
t1=$((a+b+c+d+e+f+g+h)); i1=$((d+e))
sleep 0.2
read _ a b c d e f g h _ < /proc/stat
t2=$((a+b+c+d+e+f+g+h)); i2=$((d+e))
n=$(grep -c '^processor' /proc/cpuinfo 2>/dev/null || echo 1)
m() { while read k v _; do [ "$k" = "$1:" ] && { echo "$v"; return; }; done < /proc/meminfo; echo 0; }
set -- $(df -Pk / 2>/dev/null | tail -n 1)
echo "$((t2-t1-(i2-i1))) $((t2-t1)) $n $(m MemTotal) $(m MemAvailable) $(m Cached) ${2:-0} ${3:-0}"
"#;

/// Parses [`SAMPLE_SCRIPT`]'s line into a sample taken at `now_ms`.
pub fn parse_sample(line: &str, now_ms: i64) -> Option<Sample> {
    let v: Vec<u64> = line
        .split_whitespace()
        .map(|f| f.parse::<i64>().map(|x| x.max(0) as u64))
        .collect::<Result<_, _>>()
        .ok()?;
    let [busy, total, cpus, mem_total, mem_avail, cached, disk_total, disk_used] = v[..] else {
        return None;
    };
    let pct = if total == 0 {
        0.0
    } else {
        (busy as f64 * 100.0 / total as f64).clamp(0.0, 100.0)
    };
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(now_ms.max(0) as u64);
    Some(Sample {
        timestamp: humantime::format_rfc3339_millis(t).to_string(),
        timestamp_unix: now_ms / 1000,
        cpu_count: cpus.max(1) as u32,
        cpu_used_pct: (pct * 100.0).round() / 100.0,
        mem_used: mem_total.saturating_sub(mem_avail) * 1024,
        mem_total: mem_total * 1024,
        mem_cache: cached * 1024,
        disk_used: disk_used * 1024,
        disk_total: disk_total * 1024,
    })
}

/// Samples every running E2B sandbox each [`SAMPLE_EVERY`] (see the module's doc); every
/// minute, drops the series of sandboxes that are gone. Stops when the adapter is dropped.
pub async fn sampler_task(st: std::sync::Weak<E2b>) {
    use futures::StreamExt;
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut ticks: u64 = 0;
    loop {
        tick.tick().await;
        let Some(st) = st.upgrade() else { return };
        ticks += 1;
        if ticks.is_multiple_of(12) {
            prune(&st);
        }
        let taken: Mutex<Vec<(SandboxId, i64, Sample)>> = Mutex::default();
        let running: Vec<SandboxId> = st
            .api
            .engine
            .usage_probe()
            .into_iter()
            .filter(|p| !p.frozen)
            .map(|p| p.sandbox)
            .collect();
        futures::stream::iter(running)
            .for_each_concurrent(SAMPLE_CONCURRENCY, |id| {
                let st = st.clone();
                let taken = &taken;
                async move {
                    if let Some(s) = sample_quietly(&st, &id).await {
                        taken.lock().unwrap_or_else(|p| p.into_inner()).push(s);
                    }
                }
            })
            .await;
        // One write for the tick's samples.
        keep(&st, taken.into_inner().unwrap_or_else(|p| p.into_inner()));
    }
}

/// Drops the samples older than [`KEEP_FOR`] and those of sandboxes that are gone.
fn prune(st: &E2b) {
    let before = torpor_core::now_millis() - KEEP_FOR.as_millis() as i64;
    match st.api.engine.state_store().prune_metric_samples(before) {
        Ok(n) if n > 0 => tracing::debug!(samples = n, "old metrics samples dropped"),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot drop old metrics samples"),
    }
}

/// One background sample of a resident sandbox, if it is an E2B sandbox (not a snapshot's
/// holder) and still running: not activity, nothing woken.
async fn sample_quietly(st: &E2b, id: &SandboxId) -> Option<(SandboxId, i64, Sample)> {
    let admin = torpor_core::TenantId::admin();
    match st.api.engine.sandbox(&admin, id) {
        Ok(rec) if rec.metadata.contains_key(super::META_TIMEOUT) && !super::is_snapshot(&rec) => {}
        _ => return None,
    }
    let req = torpor_runtime::proto::ExecRequest {
        cmd: vec!["sh".into(), "-c".into(), SAMPLE_SCRIPT.into()],
        env: Default::default(),
        cwd: None,
        timeout_ms: Some(10_000),
        detach: false,
        stream: false,
    };
    match st.api.engine.quiet_exec_if_running(id, req).await {
        Ok(Some(r)) if r.exit_code == Some(0) => {
            let now = torpor_core::now_millis();
            match parse_sample(r.stdout.trim(), now) {
                Some(s) => return Some((id.clone(), now, s)),
                None => tracing::debug!(sandbox = %id, out = r.stdout, "unreadable metrics sample"),
            }
        }
        Ok(Some(r)) => {
            tracing::debug!(sandbox = %id, code = ?r.exit_code, err = r.stderr, "metrics sample failed")
        }
        Ok(None) => {}
        Err(e) => tracing::debug!(sandbox = %id, error = %e, "metrics sample failed"),
    }
    None
}

#[derive(Debug, Default, Deserialize)]
pub struct MetricsQuery {
    pub start: Option<i64>,
    pub end: Option<i64>,
}

/// GET /sandboxes/{id}/metrics → `[SandboxMetric]`.
pub async fn get_metrics(
    State(st): State<Arc<E2b>>,
    headers: HeaderMap,
    Path(id): Path<String>,
    q: Result<Query<MetricsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Vec<Sample>>, E2bError> {
    let tenant = authenticate(&st, &headers)?;
    let Query(q) = q.map_err(|e| E2bError::bad_request(e.body_text()))?;
    if let (Some(s), Some(e)) = (q.start, q.end) {
        if s > e {
            return Err(E2bError::bad_request("start must not be after end"));
        }
    }
    let sid =
        SandboxId::new(&id).map_err(|_| E2bError::not_found(format_args!("sandbox {id:?}")))?;
    let rec = super::control::e2b_sandbox(&st, &tenant, &sid)?;
    if rec.tier == torpor_core::Tier::Running {
        let c = Ctx {
            tenant: rec.tenant.clone(),
            id: sid.clone(),
            base: false,
        };
        match run(&st, &c, &["sh", "-c", SAMPLE_SCRIPT], Vec::new()).await {
            Ok((0, out, _)) => {
                let now = torpor_core::now_millis();
                match parse_sample(out.trim(), now) {
                    Some(s) => keep(&st, vec![(sid.clone(), now, s)]),
                    None => tracing::debug!(sandbox = %sid, out, "unreadable metrics sample"),
                }
            }
            Ok((code, _, err)) => {
                tracing::debug!(sandbox = %sid, code, err, "metrics sample failed")
            }
            Err(e) => tracing::debug!(sandbox = %sid, error = %e.message, "metrics sample failed"),
        }
    }
    Ok(Json(within(&st, &sid, q.start, q.end)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_parse_and_survive_the_store_round_trip() {
        let s = parse_sample("25 100 2 1000 400 100 2000 500", 1_700_000_000_500).unwrap();
        assert_eq!(s.cpu_used_pct, 25.0);
        assert_eq!(s.cpu_count, 2);
        assert_eq!(s.mem_total, 1000 * 1024);
        assert_eq!(s.mem_used, 600 * 1024);
        assert_eq!(s.mem_cache, 100 * 1024);
        assert_eq!((s.disk_total, s.disk_used), (2000 * 1024, 500 * 1024));
        assert_eq!(s.timestamp_unix, 1_700_000_000);
        assert!(parse_sample("1 2 3", 0).is_none());
        assert_eq!(
            parse_sample("0 0 0 0 0 0 0 0", 0).unwrap().cpu_used_pct,
            0.0
        );
        let id = SandboxId::new("sb-aaaaaaaaaaaaaaaa").unwrap();
        let rows = stored(vec![(id.clone(), 1_700_000_000_500, s.clone())]);
        assert_eq!(rows.len(), 1);
        assert_eq!((&rows[0].0, rows[0].1), (&id, 1_700_000_000_500));
        let back: Sample = serde_json::from_str(&rows[0].2).unwrap();
        assert_eq!(back, s);
    }
}
