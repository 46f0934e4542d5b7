//! `GET /sandboxes/{id}/metrics?start=&end=` (E2B's `get_metrics`): CPU, memory and disk
//! samples of a sandbox, read inside it as envd reads them (`/proc/stat`, `/proc/meminfo`,
//! `df /`), which under gVisor are the sandbox's own figures.
//!
//! A sample is taken when metrics are asked for and the sandbox is running (a sleeping one is
//! never woken for it), and kept (at most [`MAX_SAMPLES`] per sandbox, for the daemon's life);
//! the answer is the kept samples within `start..=end` (Unix seconds), oldest first.

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

/// Kept samples, by sandbox.
#[derive(Default)]
pub struct Samples(Mutex<HashMap<SandboxId, VecDeque<Sample>>>);

impl Samples {
    fn push(&self, id: &SandboxId, s: Sample) {
        let mut all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let q = all.entry(id.clone()).or_default();
        if q.len() >= MAX_SAMPLES {
            q.pop_front();
        }
        q.push_back(s);
    }

    fn within(&self, id: &SandboxId, start: Option<i64>, end: Option<i64>) -> Vec<Sample> {
        let all = self.0.lock().unwrap_or_else(|p| p.into_inner());
        all.get(id)
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
}
