//! Prometheus metrics of the control plane. Gauges that describe the fleet (sandboxes by state
//! and tier, workers) are computed when scraped; events (wakes, checkpoints, execs, crashes) are
//! recorded as they happen; usage and pool gauges are set by the usage sampler
//! ([`crate::usage`]).
//!
//! Naming: counters end in `_total`, durations in `_seconds`, sizes in `_bytes`, byte-time
//! integrals in `_byte_seconds_total`; a gauge that counts things names them (`_calls`,
//! `torpor_workers`). Labels take values from fixed sets (tiers, outcomes, reasons), except
//! `tenant` and `pool` (as many as the operator made) and `sandbox` on the network gauges (only
//! resident sandboxes: at most `--workers`). Every label value a metric is known to take is
//! initialised to zero here, so a query names a series before its first event.

use prometheus::{
    exponential_buckets, CounterVec, Encoder, Gauge, HistogramOpts, HistogramVec, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// The tiers a wake starts from (`golden`: a create, restored from the template's snapshot).
pub const WAKE_FROM_TIERS: [&str; 4] = ["golden", "frozen", "parked", "suspended"];
/// The tiers a transition goes down to.
pub const SLEEP_TIERS: [&str; 3] = ["frozen", "parked", "suspended"];
/// Why a sandbox went down the ladder.
pub const TRANSITION_CAUSES: [&str; 6] = [
    "idle",
    "api",
    "evicted",
    "shutdown",
    "fork",
    "gpu_reclaimed",
];
/// Why a resident sandbox was parked to make room.
pub const EVICTION_REASONS: [&str; 3] = ["memory_pressure", "parked_calls", "worker_full"];
/// The stores whose failures `torpor_store_errors_total` counts.
pub const STORES: [&str; 3] = ["state", "usage", "snapshots"];

/// The results of a parked image's re-encoding (`torpor_parked_reencodes_total`).
pub const REENCODE_RESULTS: [&str; 5] = [
    "done",
    "nothing_to_gain",
    "superseded",
    "low_disk",
    "failed",
];

pub struct Metrics {
    registry: Registry,
    pub sandboxes: IntGaugeVec,
    pub workers_total: IntGauge,
    pub workers_busy: IntGauge,
    pub warm_ready: IntGauge,
    pub warm_takes: IntCounterVec,
    pub wake_seconds: HistogramVec,
    pub checkpoint_seconds: HistogramVec,
    pub checkpoint_bytes: IntCounterVec,
    pub reencodes: IntCounterVec,
    pub exec_seconds: HistogramVec,
    pub crashes: IntCounterVec,
    pub transitions: IntCounterVec,
    pub lot_parked: IntGauge,
    pub lot_wait_seconds: HistogramVec,
    pub lot_rejections: IntCounterVec,
    pub evictions: IntCounterVec,
    pub quota_rejections: IntCounterVec,
    /// Calls the parking lot holds at most (`--lot-size`).
    pub lot_capacity: IntGauge,
    /// Calls a second the sandboxes this controller holds take (cluster mode, balancing).
    pub call_rate: Gauge,
    /// Memory charged to resident sandboxes, and the budget it is kept under.
    pub resident_memory_bytes: IntGauge,
    pub memory_budget_bytes: IntGauge,
    /// Failed reads and writes of a store, by store (`state`, `usage`).
    pub store_errors: IntCounterVec,
    /// Usage as the sampler measures it, by tenant (see [`crate::usage`]).
    pub usage: UsageMetrics,
    /// Event-driven pools, set by the sampler.
    pub pools: PoolMetrics,
}

/// What tenants consumed, integrated by the usage sampler; the cost dashboard prices these.
pub struct UsageMetrics {
    pub memory_byte_seconds: CounterVec,
    pub cpu_seconds: CounterVec,
    pub gpu_share_seconds: CounterVec,
    pub snapshot_byte_seconds: CounterVec,
    pub wakes: IntCounterVec,
    pub egress_bytes: IntCounterVec,
    pub samples: IntCounterVec,
}

/// Pools: demand, agents, desired size and work done.
pub struct PoolMetrics {
    pub queue_depth: IntGaugeVec,
    pub agents: IntGaugeVec,
    pub desired_agents: IntGaugeVec,
    pub processed: IntCounterVec,
    pub dead_lettered: IntCounterVec,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn counter(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
}

fn float_counter(name: &str, help: &str, labels: &[&str]) -> CounterVec {
    CounterVec::new(Opts::new(name, help), labels).expect("valid metric")
}

fn gauge_vec(name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric")
}

fn gauge(name: &str, help: &str) -> IntGauge {
    IntGauge::new(name, help).expect("valid metric")
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        // 0.5 ms to 65 s: parked waits and cold wakes under load reach tens of seconds.
        let latency = exponential_buckets(0.0005, 2.0, 18).expect("valid buckets");
        let histogram = |name: &str, help: &str, buckets: Vec<f64>, label: &str| {
            HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), &[label])
                .expect("valid metric")
        };
        let sandboxes = gauge_vec(
            "torpor_sandboxes",
            "Sandboxes by state and tier.",
            &["state", "tier"],
        );
        let workers_total = gauge(
            "torpor_workers",
            "Workers (sandboxes that may be resident at once).",
        );
        let workers_busy = gauge("torpor_workers_busy", "Workers holding a resident sandbox.");
        let warm_ready = gauge(
            "torpor_warm_pool_ready",
            "Free workers prepared ahead (cgroups, bundle) and waiting for a wake.",
        );
        let warm_takes = counter(
            "torpor_warm_pool_takes_total",
            "Workers handed to wakes: prepared ahead (warm) or prepared inline (cold).",
            &["kind"],
        );
        let wake_seconds = histogram(
            "torpor_wake_seconds",
            "Time to bring a sandbox back to Running, by the tier it was woken from.",
            latency.clone(),
            "from_tier",
        );
        let checkpoint_seconds = histogram(
            "torpor_checkpoint_seconds",
            "Time to checkpoint a sandbox, by outcome (golden: a template's snapshot).",
            latency.clone(),
            "outcome",
        );
        let checkpoint_bytes = counter(
            "torpor_checkpoint_bytes_total",
            "Bytes of checkpoint images written (store_new: new to the snapshot store after deduplication).",
            &["kind"],
        );
        let reencodes = counter(
            "torpor_parked_reencodes_total",
            "Parked images rewritten with stored frames for faster wakes, by result (done, nothing_to_gain, superseded, low_disk, failed).",
            &["result"],
        );
        let exec_seconds = histogram(
            "torpor_exec_seconds",
            "Exec round trip inside a running sandbox.",
            latency,
            "outcome",
        );
        let crashes = counter(
            "torpor_sandbox_crashes_total",
            "Sandboxes that died on their own, or whose controller was lost (cluster mode), by reason.",
            &["reason"],
        );
        let transitions = counter(
            "torpor_transitions_total",
            "Sleep-ladder transitions, by target tier and cause.",
            &["to_tier", "cause"],
        );
        let lot_parked = gauge(
            "torpor_lot_parked_calls",
            "Calls waiting in the parking lot for a worker.",
        );
        let lot_wait_seconds = histogram(
            "torpor_lot_wait_seconds",
            "Time calls waited in the parking lot, by outcome.",
            exponential_buckets(0.001, 2.0, 17).expect("valid buckets"),
            "outcome",
        );
        let lot_rejections = counter(
            "torpor_lot_rejections_total",
            "Calls refused for want of a worker, by reason.",
            &["reason"],
        );
        let evictions = counter(
            "torpor_evictions_total",
            "Resident sandboxes parked to make room, by reason.",
            &["reason"],
        );
        let quota_rejections = counter(
            "torpor_quota_rejections_total",
            "Calls refused by a tenant quota.",
            &["tenant", "quota"],
        );
        let lot_capacity = gauge(
            "torpor_lot_capacity_calls",
            "Calls the parking lot holds at most (--lot-size).",
        );
        let call_rate = Gauge::new(
            "torpor_controller_calls_per_second",
            "Calls a second the sandboxes this controller holds take, over the last 5 s (cluster mode; what balancing evens out).",
        )
        .expect("valid metric");
        let resident_memory_bytes = gauge(
            "torpor_resident_memory_bytes",
            "Memory charged to the cgroups of resident sandboxes (RSS and shared memory).",
        );
        let memory_budget_bytes = gauge(
            "torpor_memory_budget_bytes",
            "The memory budget resident sandboxes are kept under (--memory-budget).",
        );
        let store_errors = counter(
            "torpor_store_errors_total",
            "Failed reads or writes of a store, by store (state: the state store, SQLite or, in cluster mode, PostgreSQL, each failed lease renewal counted; usage: usage records; snapshots: the snapshot store as usage reads it).",
            &["store"],
        );
        let usage = UsageMetrics {
            memory_byte_seconds: float_counter(
                "torpor_usage_memory_byte_seconds_total",
                "Resident memory integrated over time, by tenant and tier (running, frozen).",
                &["tenant", "tier"],
            ),
            cpu_seconds: float_counter(
                "torpor_usage_cpu_seconds_total",
                "CPU time used by sandboxes, by tenant.",
                &["tenant"],
            ),
            gpu_share_seconds: float_counter(
                "torpor_usage_gpu_share_seconds_total",
                "GPU held, in GPUs (a share counts its fraction of one GPU) times seconds, by tenant and mode.",
                &["tenant", "mode"],
            ),
            snapshot_byte_seconds: float_counter(
                "torpor_usage_snapshot_byte_seconds_total",
                "Checkpoint bytes kept for sleeping sandboxes, integrated over time, by tenant.",
                &["tenant"],
            ),
            wakes: counter(
                "torpor_usage_wakes_total",
                "Wakes seen by the usage sampler, by tenant and the tier woken from.",
                &["tenant", "from_tier"],
            ),
            egress_bytes: counter(
                "torpor_usage_egress_bytes_total",
                "Bytes sent by sandboxes over their network, by tenant.",
                &["tenant"],
            ),
            samples: counter(
                "torpor_usage_samples_total",
                "Usage samples taken, by outcome (ok, failed).",
                &["outcome"],
            ),
        };
        let pools = PoolMetrics {
            queue_depth: gauge_vec(
                "torpor_pool_queue_depth_messages",
                "A pool's demand: the deepest of its triggers' queues.",
                &["tenant", "pool"],
            ),
            agents: gauge_vec(
                "torpor_pool_agents",
                "A pool's agents by state (running, starting, draining, asleep).",
                &["tenant", "pool", "state"],
            ),
            desired_agents: gauge_vec(
                "torpor_pool_desired_agents",
                "The number of active agents a pool's scaler wants.",
                &["tenant", "pool"],
            ),
            processed: counter(
                "torpor_pool_messages_processed_total",
                "Messages a pool's agents finished.",
                &["tenant", "pool"],
            ),
            dead_lettered: counter(
                "torpor_pool_messages_dead_lettered_total",
                "Messages a pool gave up on.",
                &["tenant", "pool"],
            ),
        };

        for (vec, values) in [
            (&warm_takes, &["warm", "cold"][..]),
            (&checkpoint_bytes, &["golden", "sandbox", "store_new"][..]),
            (&reencodes, &REENCODE_RESULTS[..]),
            (&crashes, &["exited", "oom_killed", "controller_lost"][..]),
            (&lot_rejections, &["lot_full", "no_worker_available"][..]),
            (&evictions, &EVICTION_REASONS[..]),
            (&store_errors, &STORES[..]),
            (&usage.samples, &["ok", "failed"][..]),
        ] {
            for v in values {
                vec.with_label_values(&[v]);
            }
        }
        for tier in SLEEP_TIERS {
            for cause in TRANSITION_CAUSES {
                transitions.with_label_values(&[tier, cause]);
            }
        }
        for (h, values) in [
            (&wake_seconds, &WAKE_FROM_TIERS[..]),
            (&checkpoint_seconds, &["golden", "ok", "failed"][..]),
            (&exec_seconds, &["ok", "error"][..]),
            (&lot_wait_seconds, &["worker", "timeout"][..]),
        ] {
            for v in values {
                h.with_label_values(&[v]);
            }
        }

        let collectors: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(lot_parked.clone()),
            Box::new(lot_wait_seconds.clone()),
            Box::new(lot_rejections.clone()),
            Box::new(evictions.clone()),
            Box::new(quota_rejections.clone()),
            Box::new(sandboxes.clone()),
            Box::new(workers_total.clone()),
            Box::new(workers_busy.clone()),
            Box::new(warm_ready.clone()),
            Box::new(warm_takes.clone()),
            Box::new(wake_seconds.clone()),
            Box::new(checkpoint_seconds.clone()),
            Box::new(checkpoint_bytes.clone()),
            Box::new(reencodes.clone()),
            Box::new(exec_seconds.clone()),
            Box::new(crashes.clone()),
            Box::new(transitions.clone()),
            Box::new(lot_capacity.clone()),
            Box::new(call_rate.clone()),
            Box::new(resident_memory_bytes.clone()),
            Box::new(memory_budget_bytes.clone()),
            Box::new(store_errors.clone()),
            Box::new(usage.memory_byte_seconds.clone()),
            Box::new(usage.cpu_seconds.clone()),
            Box::new(usage.gpu_share_seconds.clone()),
            Box::new(usage.snapshot_byte_seconds.clone()),
            Box::new(usage.wakes.clone()),
            Box::new(usage.egress_bytes.clone()),
            Box::new(usage.samples.clone()),
            Box::new(pools.queue_depth.clone()),
            Box::new(pools.agents.clone()),
            Box::new(pools.desired_agents.clone()),
            Box::new(pools.processed.clone()),
            Box::new(pools.dead_lettered.clone()),
        ];
        for c in collectors {
            registry.register(c).expect("metric names are unique");
        }
        Metrics {
            registry,
            sandboxes,
            workers_total,
            workers_busy,
            warm_ready,
            warm_takes,
            wake_seconds,
            checkpoint_seconds,
            checkpoint_bytes,
            reencodes,
            exec_seconds,
            crashes,
            transitions,
            lot_parked,
            lot_wait_seconds,
            lot_rejections,
            evictions,
            quota_rejections,
            lot_capacity,
            call_rate,
            resident_memory_bytes,
            memory_budget_bytes,
            store_errors,
            usage,
            pools,
        }
    }

    /// Counts a failed read or write of `store` (one of [`STORES`]).
    pub fn store_error(&self, store: &str) {
        self.store_errors.with_label_values(&[store]).inc();
    }

    /// Adds a collector owned by another component (the snapshot store's counters).
    pub fn register(&self, c: Box<dyn prometheus::core::Collector>) {
        self.registry.register(c).expect("metric names are unique");
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is UTF-8")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_has_help_and_a_known_series_before_any_event() {
        let m = Metrics::new();
        let text = m.render();
        for family in m.registry.gather() {
            assert!(
                !family.get_help().is_empty(),
                "{} has no HELP",
                family.get_name()
            );
        }
        for series in [
            "torpor_wake_seconds_count{from_tier=\"parked\"} 0",
            "torpor_transitions_total{cause=\"idle\",to_tier=\"suspended\"} 0",
            "torpor_lot_rejections_total{reason=\"lot_full\"} 0",
            "torpor_store_errors_total{store=\"state\"} 0",
            "torpor_sandbox_crashes_total{reason=\"oom_killed\"} 0",
        ] {
            assert!(text.contains(series), "missing {series} in\n{text}");
        }
    }

    #[test]
    fn counters_end_in_total_and_histograms_in_a_unit() {
        for family in Metrics::new().registry.gather() {
            let name = family.get_name();
            match family.get_field_type() {
                prometheus::proto::MetricType::COUNTER => {
                    assert!(name.ends_with("_total"), "counter {name}")
                }
                prometheus::proto::MetricType::HISTOGRAM => {
                    assert!(name.ends_with("_seconds"), "histogram {name}")
                }
                _ => {}
            }
        }
    }
}
