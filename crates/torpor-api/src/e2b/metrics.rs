//! `GET /sandboxes/{id}/metrics?start=&end=` (E2B's `get_metrics`): CPU, memory and disk
//! samples of a sandbox, read inside it as envd reads them (`/proc/stat`, `/proc/meminfo`,
//! `df /`), which under gVisor are the sandbox's own figures.
//!
//! As E2B does, a sandbox is sampled every [`SAMPLE_EVERY`] while it runs ([`sampler_task`]):
//! the engine's resident sandboxes are looked at in memory (a sleeping sandbox costs the
//! sampler nothing: no store read, no call, nothing woken), and each running E2B sandbox runs
//! [`SAMPLE_SCRIPT`] through a call that is not activity (the idle policy still freezes and
//! parks it as if unsampled). A sample is also taken when metrics are asked for and the sandbox
//! is running. Samples are kept per sandbox (at most [`MAX_SAMPLES`], an hour at 5 s; at most
//! [`MAX_TOTAL_SAMPLES`] in all, the series sampled least recently going first past that, and
//! a deleted sandbox's series with it); the answer is the kept samples within `start..=end`
//! (Unix seconds), oldest first.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::Json;
use serde::{Deserialize, Serialize};
use torpor_core::SandboxId;

use super::control::authenticate;
use super::envd::{run, Ctx};
use super::{E2b, E2bError};

/// Samples kept per sandbox.
pub const MAX_SAMPLES: usize = 720;
/// Samples kept for all sandboxes together (about 30 MB).
pub const MAX_TOTAL_SAMPLES: usize = 200_000;
/// How often a running sandbox is sampled (E2B's cadence).
pub const SAMPLE_EVERY: std::time::Duration = std::time::Duration::from_secs(5);
/// Sandboxes sampled at once.
const SAMPLE_CONCURRENCY: usize = 4;

/// One E2B `SandboxMetric`.
#[derive(Debug, Clone, PartialEq, Serialize)]
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

/// Kept samples, by sandbox, and how many in all.
#[derive(Default)]
pub struct Samples(Mutex<(HashMap<SandboxId, VecDeque<Sample>>, usize)>);

impl Samples {
    fn push(&self, id: &SandboxId, s: Sample) {
        self.push_within(id, s, MAX_TOTAL_SAMPLES)
    }

    fn push_within(&self, id: &SandboxId, s: Sample, max_total: usize) {
        let mut guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let (all, total) = &mut *guard;
        let q = all.entry(id.clone()).or_default();
        if q.len() >= MAX_SAMPLES {
            q.pop_front();
            *total -= 1;
        }
        q.push_back(s);
        *total += 1;
        // Past the overall bound, the series sampled least recently goes whole (one scan of
        // the series, only then).
        while *total > max_total {
            let Some(stalest) = all
                .iter()
                .filter(|(k, _)| *k != id)
                .min_by_key(|(_, q)| q.back().map(|s| s.timestamp_unix))
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            *total -= all.remove(&stalest).map_or(0, |q| q.len());
        }
    }

    /// Drops the series of sandboxes not in `keep`.
    fn retain(&self, keep: impl Fn(&SandboxId) -> bool) {
        let mut guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let (all, total) = &mut *guard;
        all.retain(|k, _| keep(k));
        *total = all.values().map(VecDeque::len).sum();
    }

    /// The sandboxes that have a series.
    fn sandboxes(&self) -> Vec<SandboxId> {
        let guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
        guard.0.keys().cloned().collect()
    }

    fn within(&self, id: &SandboxId, start: Option<i64>, end: Option<i64>) -> Vec<Sample> {
        let guard = self.0.lock().unwrap_or_else(|p| p.into_inner());
        guard
            .0
            .get(id)
            .map(|q| {
                q.iter()
                    .filter(|s| start.is_none_or(|t| s.timestamp_unix >= t))
                    .filter(|s| end.is_none_or(|t| s.timestamp_unix <= t))
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }
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
                async move { sample_quietly(&st, &id).await }
            })
            .await;
    }
}

/// Drops the series of sandboxes that no longer exist (one store read per series).
fn prune(st: &E2b) {
    let admin = torpor_core::TenantId::admin();
    let gone: std::collections::HashSet<SandboxId> = st
        .metrics
        .sandboxes()
        .into_iter()
        .filter(|id| {
            matches!(
                st.api.engine.sandbox(&admin, id),
                Err(torpor_control::ControlError::NotFound { .. })
            )
        })
        .collect();
    if !gone.is_empty() {
        st.metrics.retain(|id| !gone.contains(id));
    }
}

/// One background sample of a resident sandbox, if it is an E2B sandbox (not a snapshot's
/// holder) and still running: not activity, nothing woken.
async fn sample_quietly(st: &E2b, id: &SandboxId) {
    let admin = torpor_core::TenantId::admin();
    match st.api.engine.sandbox(&admin, id) {
        Ok(rec) if rec.metadata.contains_key(super::META_TIMEOUT) && !super::is_snapshot(&rec) => {}
        _ => return,
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
            match parse_sample(r.stdout.trim(), torpor_core::now_millis()) {
                Some(s) => st.metrics.push(id, s),
                None => tracing::debug!(sandbox = %id, out = r.stdout, "unreadable metrics sample"),
            }
        }
        Ok(Some(r)) => {
            tracing::debug!(sandbox = %id, code = ?r.exit_code, err = r.stderr, "metrics sample failed")
        }
        Ok(None) => {}
        Err(e) => tracing::debug!(sandbox = %id, error = %e, "metrics sample failed"),
    }
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
            Ok((0, out, _)) => match parse_sample(out.trim(), torpor_core::now_millis()) {
                Some(s) => st.metrics.push(&sid, s),
                None => tracing::debug!(sandbox = %sid, out, "unreadable metrics sample"),
            },
            Ok((code, _, err)) => {
                tracing::debug!(sandbox = %sid, code, err, "metrics sample failed")
            }
            Err(e) => tracing::debug!(sandbox = %sid, error = %e.message, "metrics sample failed"),
        }
    }
    Ok(Json(st.metrics.within(&sid, q.start, q.end)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_parse_and_filter_by_time() {
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
        let kept = Samples::default();
        for t in 0..(MAX_SAMPLES as i64 + 5) {
            let mut s = s.clone();
            s.timestamp_unix = t;
            kept.push(&id, s);
        }
        let all = kept.within(&id, None, None);
        assert_eq!(all.len(), MAX_SAMPLES);
        assert_eq!(all[0].timestamp_unix, 5);
        let some = kept.within(&id, Some(10), Some(12));
        assert_eq!(
            some.iter().map(|s| s.timestamp_unix).collect::<Vec<_>>(),
            [10, 11, 12]
        );
    }

    #[test]
    fn the_series_sampled_least_recently_goes_past_the_overall_bound() {
        let s = parse_sample("25 100 2 1000 400 100 2000 500", 0).unwrap();
        let at = |t: i64| Sample {
            timestamp_unix: t,
            ..s.clone()
        };
        let (a, b, c) = (
            SandboxId::new("sb-aaaaaaaaaaaaaaaa").unwrap(),
            SandboxId::new("sb-bbbbbbbbbbbbbbbb").unwrap(),
            SandboxId::new("sb-cccccccccccccccc").unwrap(),
        );
        let kept = Samples::default();
        kept.push_within(&a, at(1), 4);
        kept.push_within(&b, at(2), 4);
        kept.push_within(&a, at(3), 4);
        kept.push_within(&b, at(4), 4);
        // Five samples: `a` (last sampled at 3) goes whole, `c`'s new one stays.
        kept.push_within(&c, at(5), 4);
        assert!(kept.within(&a, None, None).is_empty());
        assert_eq!(kept.within(&b, None, None).len(), 2);
        assert_eq!(kept.within(&c, None, None).len(), 1);
        kept.retain(|id| *id != b);
        assert!(kept.within(&b, None, None).is_empty());
        assert_eq!(kept.0.lock().unwrap().1, 1);
    }
}
