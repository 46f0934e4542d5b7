//! Usage accounting: what each sandbox, and so each tenant, consumed over time, durable in the
//! engine's SQLite file (`torpor.db`, table `usage_intervals`) and summed into fixed hourly
//! intervals, so a year of history is one row per sandbox, measure and hour at most.
//!
//! A [`Sampler`] runs every `TORPOR_USAGE_SAMPLE_MS` (default 15 s). Each sample reads the
//! sandboxes (state store), the resident ones' cgroups and network counters
//! ([`Engine::usage_probe`]) and the GPU allocations, and adds what happened since the last
//! sample to the current interval:
//!
//! | measure | unit | dimension | how |
//! |---|---|---|---|
//! | `memory_gib_hours` | GiB-hours | tier (`running`, `frozen`) | resident memory (RSS + shmem) × time |
//! | `tier_hours` | hours | tier (`running`, `frozen`, `parked`, `suspended`) | time in that tier (their sum: the agent-hours) |
//! | `cpu_seconds` | seconds | | the worker cgroup's `cpuacct.usage` delta (read again as a sandbox leaves its worker, so nothing since the last sample is lost) |
//! | `gpu_hours` | GPU-hours | share and model (`mig:3g.71gb@NVIDIA H200`; shares `whole`, `mig:<profile>`, `mps:<pct>`, `timeslice`) | fraction of one GPU × time |
//! | `snapshot_gib_hours` | GiB-hours | | a sleeping sandbox's checkpoint × time: its local image (Parked), or its deduplication-fair share of the snapshot store (Suspended: each chunk split among the sandboxes whose images hold it) |
//! | `wakes` | count | tier woken from (`golden`, `frozen`, `parked`, `suspended`) | generation bumps and thaws seen between samples |
//! | `egress_bytes` | bytes | | its interface's tx counter delta |
//! | `gpu_util_sampled_hours` | GPU-hours | as `gpu_hours` | the part of `gpu_hours` held while the device's utilisation was read |
//! | `gpu_busy_hours` | GPU-hours | as `gpu_hours` | that part × the device's utilisation (`DCGM_FI_DEV_GPU_UTIL` / 100) |
//! | `gpu_fb_sampled_hours` | hours | as `gpu_hours` | time held while the device's framebuffer use was read |
//! | `gpu_fb_used_gib_hours` | GiB-hours | as `gpu_hours` | framebuffer used (`DCGM_FI_DEV_FB_USED`) × that time |
//!
//! GPU readings come from the DCGM families torpor exports on `/metrics` (the same figures the
//! GPU dashboard shows), and only for a device one sandbox holds alone (a whole GPU, a MIG
//! instance, the only client of a shared GPU): a shared GPU's utilisation cannot be split among
//! its clients. NVML gives no utilisation for a MIG instance (its framebuffer use it does), and
//! a declared inventory has no telemetry at all: those shares have GPU-hours and no reading,
//! which the report shows as not measured, never as idle.
//!
//! Time between two samples is capped at twice the period: while the daemon is down nothing
//! runs (it checkpoints at shutdown), so a restart bills no gap, and what was recorded before it
//! is in SQLite already. The sampler also sets the Prometheus usage counters, the lot and
//! memory gauges and the pool gauges ([`crate::metrics`]).
//!
//! The intervals are kept by the state store ([`crate::store::StateStore::add_usage`]); this
//! module owns what the measures are and how rows are grouped.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use torpor_core::{now_millis, SandboxId, TenantId, Tier, UnixMillis};

use crate::engine::usage_probe::ResidentProbe;
use crate::engine::Engine;
use crate::store::{Store, StoreError, UsageInterval};

/// Length of one accounting interval.
pub const INTERVAL_S: i64 = 3600;
/// The sampling period, in milliseconds.
pub const SAMPLE_MS_ENV: &str = "TORPOR_USAGE_SAMPLE_MS";
pub const DEFAULT_SAMPLE: Duration = Duration::from_secs(15);
const GIB: f64 = (1u64 << 30) as f64;

#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    #[error("usage store")]
    Store(#[from] StoreError),
    #[error("cannot read the sandboxes")]
    Sandboxes(#[source] crate::store::StoreError),
    #[error("`from` ({from}) must be before `to` ({to})")]
    BadRange { from: i64, to: i64 },
    #[error("unknown group_by {0:?}: use tenant, sandbox or interval, comma-separated")]
    BadGroupBy(String),
}

/// What one row of usage measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Measure {
    MemoryGibHours,
    TierHours,
    CpuSeconds,
    GpuHours,
    SnapshotGibHours,
    Wakes,
    EgressBytes,
    GpuUtilSampledHours,
    GpuBusyHours,
    GpuFbSampledHours,
    GpuFbUsedGibHours,
}

impl Measure {
    pub const ALL: [Measure; 11] = [
        Measure::MemoryGibHours,
        Measure::TierHours,
        Measure::CpuSeconds,
        Measure::GpuHours,
        Measure::SnapshotGibHours,
        Measure::Wakes,
        Measure::EgressBytes,
        Measure::GpuUtilSampledHours,
        Measure::GpuBusyHours,
        Measure::GpuFbSampledHours,
        Measure::GpuFbUsedGibHours,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Measure::MemoryGibHours => "memory_gib_hours",
            Measure::TierHours => "tier_hours",
            Measure::CpuSeconds => "cpu_seconds",
            Measure::GpuHours => "gpu_hours",
            Measure::SnapshotGibHours => "snapshot_gib_hours",
            Measure::Wakes => "wakes",
            Measure::EgressBytes => "egress_bytes",
            Measure::GpuUtilSampledHours => "gpu_util_sampled_hours",
            Measure::GpuBusyHours => "gpu_busy_hours",
            Measure::GpuFbSampledHours => "gpu_fb_sampled_hours",
            Measure::GpuFbUsedGibHours => "gpu_fb_used_gib_hours",
        }
    }

    fn parse(s: &str) -> Option<Measure> {
        Measure::ALL.into_iter().find(|m| m.as_str() == s)
    }
}

/// One addition to an interval.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageDelta {
    pub tenant: TenantId,
    pub sandbox: SandboxId,
    pub measure: Measure,
    pub dim: String,
    pub value: f64,
}

/// How `GET /v1/usage` groups its rows: always by tenant, optionally by sandbox and interval.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct GroupBy {
    pub sandbox: bool,
    pub interval: bool,
}

impl GroupBy {
    /// `tenant`, `sandbox`, `interval` (also `hour`), comma-separated; empty: by tenant.
    pub fn parse(s: &str) -> Result<GroupBy, UsageError> {
        let mut g = GroupBy::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part {
                "tenant" => {}
                "sandbox" => g.sandbox = true,
                "interval" | "hour" => g.interval = true,
                other => return Err(UsageError::BadGroupBy(other.chars().take(40).collect())),
            }
        }
        Ok(g)
    }
}

/// A usage query: `[from_s, to_s)` in Unix seconds, whole intervals that start inside it.
#[derive(Debug, Clone)]
pub struct UsageQuery {
    /// `None`: every tenant (the operator).
    pub tenant: Option<TenantId>,
    pub from_s: i64,
    pub to_s: i64,
    pub group_by: GroupBy,
}

/// Usage of one group (a tenant, a sandbox, an interval) in the units of [`Measure`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UsageRow {
    pub tenant: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    /// The interval's start (Unix seconds) when grouped by interval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval_start_s: Option<i64>,
    /// By tier: `running`, `frozen`.
    pub memory_gib_hours: BTreeMap<String, f64>,
    /// Hours in each tier (`running`, `frozen`, `parked`, `suspended`); their sum is the
    /// agent-hours.
    #[serde(default)]
    pub tier_hours: BTreeMap<String, f64>,
    pub cpu_seconds: f64,
    /// By share and GPU model (`mig:3g.71gb@NVIDIA H200`; shares `whole`, `mig:<profile>`,
    /// `mps:<compute %>`, `timeslice`), in GPUs × hours.
    pub gpu_hours: BTreeMap<String, f64>,
    pub snapshot_gib_hours: f64,
    /// By the tier woken from.
    pub wakes: BTreeMap<String, u64>,
    pub egress_bytes: u64,
    /// By share and model as `gpu_hours`: the GPU-hours held while the device's utilisation
    /// was read (absent: never read, e.g. a declared inventory or a MIG instance).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gpu_util_sampled_hours: BTreeMap<String, f64>,
    /// Those GPU-hours × the utilisation read: `gpu_busy_hours / gpu_util_sampled_hours` is the
    /// share's mean utilisation.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gpu_busy_hours: BTreeMap<String, f64>,
    /// Hours held while the device's framebuffer use was read.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gpu_fb_sampled_hours: BTreeMap<String, f64>,
    /// Framebuffer used (GiB) × those hours.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gpu_fb_used_gib_hours: BTreeMap<String, f64>,
}

impl UsageRow {
    fn add(&mut self, measure: Measure, dim: &str, value: f64) {
        match measure {
            Measure::MemoryGibHours => {
                *self.memory_gib_hours.entry(dim.into()).or_default() += value
            }
            Measure::TierHours => *self.tier_hours.entry(dim.into()).or_default() += value,
            Measure::CpuSeconds => self.cpu_seconds += value,
            Measure::GpuHours => *self.gpu_hours.entry(dim.into()).or_default() += value,
            Measure::SnapshotGibHours => self.snapshot_gib_hours += value,
            Measure::Wakes => *self.wakes.entry(dim.into()).or_default() += value.round() as u64,
            Measure::EgressBytes => self.egress_bytes += value.round() as u64,
            Measure::GpuUtilSampledHours => {
                *self.gpu_util_sampled_hours.entry(dim.into()).or_default() += value
            }
            Measure::GpuBusyHours => *self.gpu_busy_hours.entry(dim.into()).or_default() += value,
            Measure::GpuFbSampledHours => {
                *self.gpu_fb_sampled_hours.entry(dim.into()).or_default() += value
            }
            Measure::GpuFbUsedGibHours => {
                *self.gpu_fb_used_gib_hours.entry(dim.into()).or_default() += value
            }
        }
    }
}

/// `GET /v1/usage`'s answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UsageReport {
    pub from_s: i64,
    pub to_s: i64,
    pub interval_s: i64,
    pub rows: Vec<UsageRow>,
}

/// Usage intervals in the state store of the engine's database file.
pub struct UsageStore {
    store: Store,
}

impl UsageStore {
    /// The usage store in `engine`'s database file.
    pub fn of(engine: &Engine) -> Result<UsageStore, UsageError> {
        UsageStore::open(&engine.usage_db_path())
    }

    /// The usage store in the database file `path` (the same store as the engine's when it
    /// has the file open).
    pub fn open(path: &Path) -> Result<UsageStore, UsageError> {
        Ok(UsageStore {
            store: Store::open(path)?,
        })
    }

    /// Adds `deltas` to the interval holding `at_ms`, in one transaction.
    pub fn record(&self, at_ms: UnixMillis, deltas: &[UsageDelta]) -> Result<(), UsageError> {
        let start_s = interval_start(at_ms / 1000);
        let rows: Vec<UsageInterval> = deltas
            .iter()
            .map(|d| UsageInterval {
                start_s,
                tenant: d.tenant.clone(),
                sandbox: d.sandbox.clone(),
                measure: d.measure.as_str().to_owned(),
                dim: d.dim.clone(),
                value: d.value,
            })
            .collect();
        Ok(self.store.add_usage(&rows)?)
    }

    /// The rows of `q`, sorted by tenant, sandbox and interval.
    pub fn query(&self, q: &UsageQuery) -> Result<UsageReport, UsageError> {
        if q.from_s >= q.to_s {
            return Err(UsageError::BadRange {
                from: q.from_s,
                to: q.to_s,
            });
        }
        let from = interval_start(q.from_s);
        let rows = self
            .store
            .usage_intervals(from, q.to_s, q.tenant.as_ref())?;
        let mut groups: BTreeMap<(String, Option<String>, Option<i64>), UsageRow> = BTreeMap::new();
        for row in rows {
            let Some(measure) = Measure::parse(&row.measure) else {
                continue;
            };
            let (dim, value) = (row.dim, row.value);
            let key = (
                row.tenant.to_string(),
                q.group_by.sandbox.then(|| row.sandbox.to_string()),
                q.group_by.interval.then_some(row.start_s),
            );
            groups
                .entry(key.clone())
                .or_insert_with(|| UsageRow {
                    tenant: key.0.clone(),
                    sandbox: key.1.clone(),
                    interval_start_s: key.2,
                    ..Default::default()
                })
                .add(measure, &dim, value);
        }
        Ok(UsageReport {
            from_s: from,
            to_s: q.to_s,
            interval_s: INTERVAL_S,
            rows: groups.into_values().collect(),
        })
    }
}

/// The start of the interval holding `t_s`.
pub fn interval_start(t_s: i64) -> i64 {
    t_s.div_euclid(INTERVAL_S) * INTERVAL_S
}

/// What the sampler remembers between samples.
#[derive(Default)]
struct Seen {
    last_ms: Option<UnixMillis>,
    /// `cpuacct.usage` (ns) of every worker cgroup at the last sample.
    cpu_ns: HashMap<String, u64>,
    /// Transmitted bytes since a wake, by sandbox and generation.
    tx_bytes: HashMap<(SandboxId, u32), u64>,
    /// Generation and tier of every sandbox at the last sample.
    sandboxes: HashMap<SandboxId, (u32, Tier)>,
    /// Local checkpoint bytes of a sleeping sandbox, by generation (an image does not change
    /// while it sleeps).
    image_bytes: HashMap<SandboxId, (u32, u64)>,
    /// Pools' processed and dead-lettered counts.
    pool_counts: HashMap<(String, String), (u64, u64)>,
}

/// Samples the engine into the usage store and the usage metrics.
pub struct Sampler {
    engine: Arc<Engine>,
    pools: Option<Arc<crate::pools::Pools>>,
    store: UsageStore,
    period: Duration,
    seen: Mutex<Seen>,
    /// Deduplication-fair snapshot-store bytes of each Suspended sandbox
    /// ([`Engine::usage_store_shares`]), refreshed every [`STORE_SHARES_EVERY`] samples.
    store_shares: Mutex<HashMap<SandboxId, f64>>,
}

/// Samples between two readings of the snapshot store's manifests (they cost a read of every
/// current image's manifest).
pub const STORE_SHARES_EVERY: u64 = 20;

impl Sampler {
    pub fn new(
        engine: Arc<Engine>,
        pools: Option<Arc<crate::pools::Pools>>,
        period: Duration,
    ) -> Result<Sampler, UsageError> {
        Ok(Sampler {
            store: UsageStore::of(&engine)?,
            engine,
            pools,
            period,
            seen: Mutex::new(Seen::default()),
            store_shares: Mutex::new(HashMap::new()),
        })
    }

    /// The period from [`SAMPLE_MS_ENV`], or [`DEFAULT_SAMPLE`].
    pub fn period_from_env() -> Duration {
        std::env::var(SAMPLE_MS_ENV)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|ms| *ms >= 100)
            .map(Duration::from_millis)
            .unwrap_or(DEFAULT_SAMPLE)
    }

    /// Starts sampling every period until the runtime stops.
    pub fn spawn(
        engine: Arc<Engine>,
        pools: Option<Arc<crate::pools::Pools>>,
    ) -> Result<tokio::task::JoinHandle<()>, UsageError> {
        let sampler = Arc::new(Sampler::new(engine, pools, Self::period_from_env())?);
        Ok(tokio::spawn(async move {
            let mut tick = tokio::time::interval(sampler.period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut samples: u64 = 0;
            loop {
                tick.tick().await;
                if samples.is_multiple_of(STORE_SHARES_EVERY) {
                    match sampler.engine.usage_store_shares().await {
                        Ok(shares) => {
                            *sampler
                                .store_shares
                                .lock()
                                .unwrap_or_else(|p| p.into_inner()) = shares
                        }
                        Err(e) => {
                            sampler.engine.metrics.store_error("snapshots");
                            tracing::warn!(error = %e, "cannot read the snapshot store for usage");
                        }
                    }
                }
                samples += 1;
                let s = sampler.clone();
                let outcome = tokio::task::spawn_blocking(move || s.sample(now_millis())).await;
                let ok = matches!(outcome, Ok(Ok(())));
                if let Ok(Err(e)) = &outcome {
                    tracing::warn!(error = %e, "usage sample failed");
                }
                sampler
                    .engine
                    .metrics
                    .usage
                    .samples
                    .with_label_values(&[if ok { "ok" } else { "failed" }])
                    .inc();
            }
        }))
    }

    /// One sample at `now_ms`: measures, records and exports what happened since the last.
    pub fn sample(&self, now_ms: UnixMillis) -> Result<(), UsageError> {
        let metrics = &self.engine.metrics;
        let stats = self.engine.worker_stats();
        metrics.lot_capacity.set(stats.lot_capacity as i64);
        metrics
            .resident_memory_bytes
            .set(stats.resident_memory_bytes as i64);
        metrics
            .memory_budget_bytes
            .set(stats.memory_budget_bytes.unwrap_or(0) as i64);
        self.sample_pools();

        let records = self.engine.store.sandboxes().map_err(|e| {
            metrics.store_error("state");
            UsageError::Sandboxes(e)
        })?;
        let probes: HashMap<SandboxId, ResidentProbe> = self
            .engine
            .usage_probe()
            .into_iter()
            .map(|p| (p.sandbox.clone(), p))
            .collect();
        let gpu = self.gpu_fractions();
        let gpu_readings = self.gpu_readings();
        let cpu_now = read_cpuacct();

        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let first = seen.last_ms.is_none();
        let cap = self.period.as_millis() as i64 * 2;
        let dt_h = seen
            .last_ms
            .map(|last| (now_ms - last).clamp(0, cap) as f64 / 3_600_000.0)
            .unwrap_or(0.0);
        let mut deltas = Vec::new();
        let mut push = |tenant: &TenantId, sandbox: &SandboxId, m: Measure, dim: &str, v: f64| {
            if v > 0.0 {
                deltas.push(UsageDelta {
                    tenant: tenant.clone(),
                    sandbox: sandbox.clone(),
                    measure: m,
                    dim: dim.to_string(),
                    value: v,
                });
            }
        };
        // CPU used since the last sample by sandboxes that left their worker in between (a
        // park or a delete), read as they left; the group's next holder counts from there.
        for r in self.engine.take_cpu_at_release() {
            let used = match seen.cpu_ns.get(&r.cgroup).copied() {
                Some(b) => r.cpu_ns.saturating_sub(b),
                None if !first => r.cpu_ns,
                None => 0,
            };
            push(
                &r.tenant,
                &r.sandbox,
                Measure::CpuSeconds,
                "",
                used as f64 / 1e9,
            );
            seen.cpu_ns.insert(r.cgroup, r.cpu_ns);
        }
        let mut live = std::collections::HashSet::new();
        for rec in &records {
            let (id, tenant) = (&rec.id, &rec.tenant);
            live.insert(id.clone());
            // Wakes: a new generation is a restore (or a create); a thaw keeps it.
            let prev = seen
                .sandboxes
                .insert(id.clone(), (rec.generation, rec.tier));
            if !first {
                let from = match prev {
                    None if rec.tier.is_resident() => Some("golden"),
                    Some((g, t)) if rec.generation > g => Some(if t.is_resident() {
                        "parked"
                    } else {
                        t.as_str()
                    }),
                    Some((_, Tier::Frozen)) if rec.tier == Tier::Running => Some("frozen"),
                    _ => None,
                };
                if let Some(from) = from {
                    push(tenant, id, Measure::Wakes, from, 1.0);
                }
            }
            if let Some(p) = probes.get(id) {
                let tier = if p.frozen { "frozen" } else { "running" };
                let gib = p.memory_bytes.unwrap_or(0) as f64 / GIB;
                push(tenant, id, Measure::MemoryGibHours, tier, gib * dt_h);
                push(tenant, id, Measure::TierHours, tier, dt_h);
                if let Some(now) = cpu_now.get(&p.cgroup) {
                    // A group seen before: its delta; one made since the last sample started
                    // at zero; at the first sample nothing is known yet.
                    let before = seen.cpu_ns.get(&p.cgroup).copied();
                    let used = match before {
                        Some(b) => now.saturating_sub(b),
                        None if !first => *now,
                        None => 0,
                    };
                    push(tenant, id, Measure::CpuSeconds, "", used as f64 / 1e9);
                }
                if let Some(tx) = p.tx_bytes {
                    let key = (id.clone(), rec.generation);
                    let before = seen.tx_bytes.insert(key, tx);
                    let sent = match before {
                        Some(b) => tx.saturating_sub(b),
                        None if !first => tx,
                        None => 0,
                    };
                    push(tenant, id, Measure::EgressBytes, "", sent as f64);
                }
                let readings = gpu_readings
                    .get(id.as_str())
                    .map(Vec::as_slice)
                    .unwrap_or_default();
                for share in gpu.get(id.as_str()).into_iter().flatten() {
                    push(
                        tenant,
                        id,
                        Measure::GpuHours,
                        &share.dim,
                        share.fraction * dt_h,
                    );
                    for (m, v) in share_reading_deltas(share, readings, dt_h) {
                        push(tenant, id, m, &share.dim, v);
                    }
                }
            } else if rec.tier.is_resident() {
                // Mid-transition (its lock was held): its time counts, its memory is unknown.
                push(tenant, id, Measure::TierHours, rec.tier.as_str(), dt_h);
            } else {
                push(tenant, id, Measure::TierHours, rec.tier.as_str(), dt_h);
                let bytes = match (&rec.image, seen.image_bytes.get(id)) {
                    (crate::store::ImageRef::Store(_), _) => {
                        self.store_shares
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get(id)
                            .copied()
                            .unwrap_or(0.0) as u64
                    }
                    (_, Some((g, b))) if *g == rec.generation => *b,
                    _ => {
                        let b = dir_bytes(&self.engine.usage_image_dir(id));
                        seen.image_bytes.insert(id.clone(), (rec.generation, b));
                        b
                    }
                };
                push(
                    tenant,
                    id,
                    Measure::SnapshotGibHours,
                    "",
                    bytes as f64 / GIB * dt_h,
                );
            }
        }
        seen.cpu_ns = cpu_now;
        seen.sandboxes.retain(|id, _| live.contains(id));
        seen.image_bytes.retain(|id, _| live.contains(id));
        seen.tx_bytes.retain(|(id, _), _| probes.contains_key(id));
        seen.last_ms = Some(now_ms);
        drop(seen);

        if let Err(e) = self.store.record(now_ms, &deltas) {
            metrics.store_error("usage");
            return Err(e);
        }
        let u = &metrics.usage;
        for d in &deltas {
            let t = d.tenant.as_str();
            match d.measure {
                Measure::MemoryGibHours => u
                    .memory_byte_seconds
                    .with_label_values(&[t, &d.dim])
                    .inc_by(d.value * GIB * 3600.0),
                Measure::CpuSeconds => u.cpu_seconds.with_label_values(&[t]).inc_by(d.value),
                Measure::TierHours => {}
                Measure::GpuHours => {
                    let mode = d.dim.split([':', '@']).next().unwrap_or("");
                    u.gpu_share_seconds
                        .with_label_values(&[t, mode])
                        .inc_by(d.value * 3600.0)
                }
                Measure::SnapshotGibHours => u
                    .snapshot_byte_seconds
                    .with_label_values(&[t])
                    .inc_by(d.value * GIB * 3600.0),
                Measure::Wakes => u
                    .wakes
                    .with_label_values(&[t, &d.dim])
                    .inc_by(d.value as u64),
                Measure::EgressBytes => u
                    .egress_bytes
                    .with_label_values(&[t])
                    .inc_by(d.value as u64),
                // Prometheus has the DCGM gauges themselves.
                Measure::GpuUtilSampledHours
                | Measure::GpuBusyHours
                | Measure::GpuFbSampledHours
                | Measure::GpuFbUsedGibHours => {}
            }
        }
        Ok(())
    }

    /// GPU held by each sandbox: its shares, each with its fraction of one GPU.
    fn gpu_fractions(&self) -> HashMap<String, Vec<HeldShare>> {
        let mut out: HashMap<String, Vec<HeldShare>> = HashMap::new();
        let Some(gpus) = self.engine.gpus() else {
            return out;
        };
        let status = gpus.status(&TenantId::admin());
        let models: HashMap<&str, &str> = status
            .gpus
            .iter()
            .map(|g| (g.uuid.as_str(), g.model.as_str()))
            .collect();
        let mut timesliced: HashMap<String, usize> = HashMap::new();
        for a in &status.allocations {
            for d in &a.devices {
                if d.mode.as_str() == "timeslice" {
                    *timesliced.entry(d.gpu_uuid.clone()).or_default() += 1;
                }
            }
        }
        for a in &status.allocations {
            for d in &a.devices {
                let (dim, fraction) = match (d.mode.as_str(), &d.profile, d.compute_pct) {
                    ("mig", Some(profile), _) => (format!("mig:{profile}"), mig_fraction(profile)),
                    ("mps", _, Some(pct)) => (format!("mps:{pct}"), f64::from(pct) / 100.0),
                    ("timeslice", _, _) => (
                        "timeslice".to_string(),
                        1.0 / timesliced.get(&d.gpu_uuid).copied().unwrap_or(1).max(1) as f64,
                    ),
                    (mode, _, _) => (mode.to_string(), 1.0),
                };
                let model = models
                    .get(d.gpu_uuid.as_str())
                    .copied()
                    .unwrap_or("unknown");
                out.entry(a.sandbox.clone()).or_default().push(HeldShare {
                    dim: format!("{dim}@{model}"),
                    fraction,
                    gpu_index: d.gpu_index,
                    mig_profile: if d.mode.as_str() == "mig" {
                        d.profile.clone()
                    } else {
                        None
                    },
                });
            }
        }
        out
    }

    /// What the GPU telemetry says of the devices each sandbox holds alone: the DCGM
    /// families of `/metrics` (empty without telemetry, e.g. a declared inventory).
    fn gpu_readings(&self) -> HashMap<String, Vec<DeviceReading>> {
        match self.engine.gpus() {
            Some(gpus) => dcgm_readings(&gpus.metrics()),
            None => HashMap::new(),
        }
    }

    fn sample_pools(&self) {
        let Some(pools) = &self.pools else {
            return;
        };
        let m = &self.engine.metrics.pools;
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        for p in pools.list(&TenantId::admin()) {
            let (t, n) = (p.tenant.to_string(), p.name.to_string());
            m.queue_depth
                .with_label_values(&[&t, &n])
                .set(p.depth.unwrap_or(0) as i64);
            m.desired_agents
                .with_label_values(&[&t, &n])
                .set(i64::from(p.desired));
            let asleep = p.sandboxes.len() as i64
                - i64::from(p.running)
                - i64::from(p.starting)
                - i64::from(p.draining);
            for (state, v) in [
                ("running", i64::from(p.running)),
                ("starting", i64::from(p.starting)),
                ("draining", i64::from(p.draining)),
                ("asleep", asleep.max(0)),
            ] {
                m.agents.with_label_values(&[&t, &n, state]).set(v);
            }
            let before = seen
                .pool_counts
                .insert((t.clone(), n.clone()), (p.processed, p.dead_lettered))
                .unwrap_or((0, 0));
            m.processed
                .with_label_values(&[&t, &n])
                .inc_by(p.processed.saturating_sub(before.0));
            m.dead_lettered
                .with_label_values(&[&t, &n])
                .inc_by(p.dead_lettered.saturating_sub(before.1));
        }
    }
}

/// One GPU share a sandbox holds, as the sampler prices and reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldShare {
    /// `share@model`, the dimension of its GPU measures.
    pub dim: String,
    /// Of one GPU.
    pub fraction: f64,
    pub gpu_index: u32,
    /// The MIG profile of a MIG instance (its telemetry is the instance's).
    pub mig_profile: Option<String>,
}

/// The DCGM readings of one device (a GPU or a MIG instance) held by one sandbox alone.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceReading {
    pub uuid: String,
    pub gpu_index: u32,
    pub mig_profile: Option<String>,
    pub util_pct: Option<f64>,
    pub fb_used_mib: Option<f64>,
}

const DCGM_UTIL: &str = "DCGM_FI_DEV_GPU_UTIL";
const DCGM_FB_USED: &str = "DCGM_FI_DEV_FB_USED";

/// The utilisation and framebuffer readings of `/metrics`' DCGM families, by the sandbox
/// label (present only on a device one sandbox holds alone, see `gpu::label_samples`).
pub fn dcgm_readings(exposition: &str) -> HashMap<String, Vec<DeviceReading>> {
    let mut by_device: BTreeMap<(String, String), DeviceReading> = BTreeMap::new();
    for line in exposition.lines() {
        let Some((name, rest)) = line.split_once('{') else {
            continue;
        };
        if name != DCGM_UTIL && name != DCGM_FB_USED {
            continue;
        }
        let Some((labels, value)) = rest.rsplit_once('}') else {
            continue;
        };
        let Ok(value) = value.trim().parse::<f64>() else {
            continue;
        };
        if !value.is_finite() || value < 0.0 {
            continue;
        }
        let labels = parse_labels(labels);
        let (Some(sandbox), Some(uuid), Some(gpu)) = (
            labels.get("sandbox"),
            labels.get("UUID"),
            labels.get("gpu").and_then(|g| g.parse::<u32>().ok()),
        ) else {
            continue;
        };
        let r = by_device
            .entry((sandbox.clone(), uuid.clone()))
            .or_insert_with(|| DeviceReading {
                uuid: uuid.clone(),
                gpu_index: gpu,
                mig_profile: labels.get("GPU_I_PROFILE").cloned(),
                ..Default::default()
            });
        if name == DCGM_UTIL {
            r.util_pct = Some(value.min(100.0));
        } else {
            r.fb_used_mib = Some(value);
        }
    }
    let mut out: HashMap<String, Vec<DeviceReading>> = HashMap::new();
    for ((sandbox, _), r) in by_device {
        out.entry(sandbox).or_default().push(r);
    }
    out
}

/// `k="v",k2="v2"` of an exposition line, unescaping `\\`, `\"` and `\n`.
fn parse_labels(s: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut chars = s.chars().peekable();
    loop {
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        let key = key.trim_start_matches(',').trim().to_string();
        if key.is_empty() || chars.next() != Some('"') {
            return out;
        }
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(other) => value.push(other),
                    None => return out,
                },
                '"' => break,
                c => value.push(c),
            }
        }
        out.insert(key, value);
    }
}

/// What one sample adds for `share` from the readings of its sandbox's devices over `dt_h`
/// hours: the devices that are this share's (same GPU, same MIG profile or none), their mean
/// utilisation and framebuffer use.
pub fn share_reading_deltas(
    share: &HeldShare,
    readings: &[DeviceReading],
    dt_h: f64,
) -> Vec<(Measure, f64)> {
    let mine: Vec<&DeviceReading> = readings
        .iter()
        .filter(|r| r.gpu_index == share.gpu_index && r.mig_profile == share.mig_profile)
        .collect();
    let mean = |v: Vec<f64>| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    let mut out = Vec::new();
    if let Some(util) = mean(mine.iter().filter_map(|r| r.util_pct).collect()) {
        let held = share.fraction * dt_h;
        out.push((Measure::GpuUtilSampledHours, held));
        out.push((Measure::GpuBusyHours, held * util / 100.0));
    }
    if let Some(mib) = mean(mine.iter().filter_map(|r| r.fb_used_mib).collect()) {
        out.push((Measure::GpuFbSampledHours, dt_h));
        out.push((Measure::GpuFbUsedGibHours, mib / 1024.0 * dt_h));
    }
    out
}

/// A MIG profile's share of its GPU: `<g>g.<mem>` is g of 7 compute slices.
fn mig_fraction(profile: &str) -> f64 {
    profile
        .split_once('g')
        .and_then(|(g, _)| g.parse::<u32>().ok())
        .map(|g| f64::from(g.min(7)) / 7.0)
        .unwrap_or(1.0)
}

/// `cpuacct.usage` (ns) of one group under torpor's cgroup parent.
pub(crate) fn cpuacct_of(group: &str) -> Option<u64> {
    let path = Path::new(torpor_runtime::cgroup::CGROUP_ROOT)
        .join("cpuacct")
        .join(torpor_runtime::cgroup::PARENT)
        .join(group)
        .join("cpuacct.usage");
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// `cpuacct.usage` (ns) of every group under torpor's cgroup parent.
fn read_cpuacct() -> HashMap<String, u64> {
    let dir = Path::new(torpor_runtime::cgroup::CGROUP_ROOT)
        .join("cpuacct")
        .join(torpor_runtime::cgroup::PARENT);
    let mut out = HashMap::new();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return out;
    };
    for e in entries.flatten() {
        let Ok(name) = e.file_name().into_string() else {
            continue;
        };
        if let Some(ns) = std::fs::read_to_string(e.path().join("cpuacct.usage"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            out.insert(name, ns);
        }
    }
    out
}

/// Bytes of the regular files under `dir` (a parked sandbox's checkpoint image).
fn dir_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => total += e.metadata().map(|m| m.len()).unwrap_or(0),
                _ => {}
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delta(tenant: &str, sandbox: &str, m: Measure, dim: &str, v: f64) -> UsageDelta {
        UsageDelta {
            tenant: TenantId::new(tenant).unwrap(),
            sandbox: SandboxId::new(sandbox).unwrap(),
            measure: m,
            dim: dim.into(),
            value: v,
        }
    }

    #[test]
    fn records_add_up_in_hourly_intervals_and_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("torpor.db");
        let h = 3_600_000;
        {
            let s = UsageStore::open(&db).unwrap();
            let a = "sb-aaaaaaaaaaaaaaaa";
            s.record(
                10 * h + 5,
                &[delta("team-a", a, Measure::MemoryGibHours, "running", 0.5)],
            )
            .unwrap();
            s.record(
                10 * h + 90_000,
                &[
                    delta("team-a", a, Measure::MemoryGibHours, "running", 0.25),
                    delta("team-a", a, Measure::Wakes, "parked", 1.0),
                ],
            )
            .unwrap();
            s.record(
                11 * h,
                &[delta(
                    "team-b",
                    "sb-bbbbbbbbbbbbbbbb",
                    Measure::CpuSeconds,
                    "",
                    3.0,
                )],
            )
            .unwrap();
        }
        let s = UsageStore::open(&db).unwrap();
        let all = s
            .query(&UsageQuery {
                tenant: None,
                from_s: 0,
                to_s: 12 * 3600,
                group_by: GroupBy::parse("tenant,interval").unwrap(),
            })
            .unwrap();
        assert_eq!(all.rows.len(), 2, "{all:?}");
        assert_eq!(all.rows[0].tenant, "team-a");
        assert_eq!(all.rows[0].interval_start_s, Some(36_000));
        assert_eq!(all.rows[0].memory_gib_hours["running"], 0.75);
        assert_eq!(all.rows[0].wakes["parked"], 1);
        assert_eq!(all.rows[1].cpu_seconds, 3.0);
        let own = s
            .query(&UsageQuery {
                tenant: Some(TenantId::new("team-b").unwrap()),
                from_s: 0,
                to_s: 12 * 3600,
                group_by: GroupBy::default(),
            })
            .unwrap();
        assert_eq!(own.rows.len(), 1);
        assert_eq!(own.rows[0].tenant, "team-b");
        // An interval outside the range is left out.
        let early = s
            .query(&UsageQuery {
                tenant: None,
                from_s: 0,
                to_s: 10 * 3600,
                group_by: GroupBy::default(),
            })
            .unwrap();
        assert!(early.rows.is_empty(), "{early:?}");
    }

    #[test]
    fn bad_queries_are_refused() {
        assert!(matches!(
            GroupBy::parse("tenant,colour"),
            Err(UsageError::BadGroupBy(_))
        ));
        let dir = tempfile::tempdir().unwrap();
        let s = UsageStore::open(&dir.path().join("t.db")).unwrap();
        let err = s
            .query(&UsageQuery {
                tenant: None,
                from_s: 10,
                to_s: 10,
                group_by: GroupBy::default(),
            })
            .unwrap_err();
        assert!(matches!(err, UsageError::BadRange { .. }));
    }

    fn gpu_sample(gpu: u32, uuid: &str, mig: Option<&str>) -> torpor_gpu::nvml::GpuSample {
        torpor_gpu::nvml::GpuSample {
            gpu,
            uuid: uuid.into(),
            model_name: "NVIDIA H200".into(),
            mig: mig.map(|p| (p.to_string(), 2)),
            tenant: None,
            sandbox: None,
            util_pct: None,
            fb_used_mib: None,
            temp_c: Some(40),
            power_w: None,
            tensor_active: None,
            xid_last: None,
            ecc_dbe_volatile: None,
        }
    }

    /// `/metrics`' DCGM families as the daemon writes them (torpor-gpu's renderer, labelled
    /// by holder as `NodeGpus::metrics` does).
    fn exposition() -> String {
        let mut whole = gpu_sample(0, "GPU-0", None);
        whole.util_pct = Some(37);
        whole.fb_used_mib = Some(2048);
        let mut mig = gpu_sample(1, "MIG-a\"x", Some("3g.71gb"));
        mig.fb_used_mib = Some(512);
        let mut shared = gpu_sample(2, "GPU-2", None);
        shared.util_pct = Some(90);
        let mut samples = vec![whole, mig, shared];
        crate::gpu::label_samples(
            &mut samples,
            &BTreeMap::from([
                (
                    "GPU-0".to_string(),
                    vec![(Some("team-a".to_string()), "sb-w".to_string())],
                ),
                ("MIG-a\"x".to_string(), vec![(None, "sb-m".to_string())]),
                (
                    "GPU-2".to_string(),
                    vec![(None, "sb-1".to_string()), (None, "sb-2".to_string())],
                ),
            ]),
        );
        torpor_gpu::nvml::dcgm_metrics("node-1", &samples)
    }

    #[test]
    fn dcgm_families_give_the_readings_of_devices_one_sandbox_holds_alone() {
        let r = dcgm_readings(&exposition());
        assert_eq!(
            r["sb-w"],
            vec![DeviceReading {
                uuid: "GPU-0".into(),
                gpu_index: 0,
                mig_profile: None,
                util_pct: Some(37.0),
                fb_used_mib: Some(2048.0),
            }]
        );
        assert_eq!(
            r["sb-m"][0].uuid, "MIG-a\"x",
            "escaped label values come back"
        );
        assert_eq!(r["sb-m"][0].mig_profile.as_deref(), Some("3g.71gb"));
        assert_eq!(r["sb-m"][0].util_pct, None, "NVML reads no MIG utilisation");
        assert_eq!(r["sb-m"][0].fb_used_mib, Some(512.0));
        // Two clients of one GPU: nobody's.
        assert!(!r.contains_key("sb-1") && !r.contains_key("sb-2"));
        assert_eq!(r.len(), 2);
    }

    #[test]
    fn a_share_gets_its_own_devices_readings_and_nothing_when_unread() {
        let r = dcgm_readings(&exposition());
        let close = |x: f64, y: f64| assert!((x - y).abs() < 1e-12, "{x} != {y}");
        let whole = HeldShare {
            dim: "whole@NVIDIA H200".into(),
            fraction: 1.0,
            gpu_index: 0,
            mig_profile: None,
        };
        let d = share_reading_deltas(&whole, &r["sb-w"], 0.5);
        assert_eq!(d.len(), 4, "{d:?}");
        assert_eq!(d[0].0, Measure::GpuUtilSampledHours);
        close(d[0].1, 0.5);
        assert_eq!(d[1].0, Measure::GpuBusyHours);
        close(d[1].1, 0.5 * 0.37);
        assert_eq!(d[2].0, Measure::GpuFbSampledHours);
        close(d[2].1, 0.5);
        assert_eq!(d[3].0, Measure::GpuFbUsedGibHours);
        close(d[3].1, 2.0 * 0.5);
        // A 3g MIG slice: framebuffer only; the share's other device does not count.
        let mig = HeldShare {
            dim: "mig:3g.71gb@NVIDIA H200".into(),
            fraction: 3.0 / 7.0,
            gpu_index: 1,
            mig_profile: Some("3g.71gb".into()),
        };
        let d = share_reading_deltas(&mig, &r["sb-m"], 1.0);
        assert_eq!(
            d.iter().map(|x| x.0).collect::<Vec<_>>(),
            [Measure::GpuFbSampledHours, Measure::GpuFbUsedGibHours]
        );
        close(d[1].1, 0.5);
        let elsewhere = HeldShare {
            gpu_index: 3,
            ..whole.clone()
        };
        assert!(share_reading_deltas(&elsewhere, &r["sb-w"], 1.0).is_empty());
        assert!(share_reading_deltas(&whole, &[], 1.0).is_empty());
    }

    #[test]
    fn readings_add_up_per_share_in_the_rows() {
        let dir = tempfile::tempdir().unwrap();
        let s = UsageStore::open(&dir.path().join("torpor.db")).unwrap();
        let dim = "whole@NVIDIA H200";
        s.record(
            0,
            &[
                delta("team-a", "sb-aaaaaaaaaaaaaaaa", Measure::GpuHours, dim, 1.0),
                delta(
                    "team-a",
                    "sb-aaaaaaaaaaaaaaaa",
                    Measure::GpuUtilSampledHours,
                    dim,
                    0.5,
                ),
                delta(
                    "team-a",
                    "sb-aaaaaaaaaaaaaaaa",
                    Measure::GpuBusyHours,
                    dim,
                    0.1,
                ),
                delta(
                    "team-a",
                    "sb-aaaaaaaaaaaaaaaa",
                    Measure::GpuFbSampledHours,
                    dim,
                    0.5,
                ),
                delta(
                    "team-a",
                    "sb-aaaaaaaaaaaaaaaa",
                    Measure::GpuFbUsedGibHours,
                    dim,
                    2.0,
                ),
            ],
        )
        .unwrap();
        let q = s
            .query(&UsageQuery {
                tenant: None,
                from_s: 0,
                to_s: 3600,
                group_by: GroupBy::default(),
            })
            .unwrap();
        let row = &q.rows[0];
        assert_eq!(row.gpu_util_sampled_hours[dim], 0.5);
        assert_eq!(row.gpu_busy_hours[dim], 0.1);
        assert_eq!(row.gpu_fb_sampled_hours[dim], 0.5);
        assert_eq!(row.gpu_fb_used_gib_hours[dim], 2.0);
        // Rows without readings keep their old JSON shape.
        let json = serde_json::to_value(UsageRow::default()).unwrap();
        assert!(json.get("gpu_busy_hours").is_none(), "{json}");
    }

    #[test]
    fn mig_profiles_are_priced_by_their_compute_slices() {
        assert_eq!(mig_fraction("7g.141gb"), 1.0);
        assert!((mig_fraction("3g.71gb") - 3.0 / 7.0).abs() < 1e-9);
        assert!((mig_fraction("1g.18gb") - 1.0 / 7.0).abs() < 1e-9);
    }
}
