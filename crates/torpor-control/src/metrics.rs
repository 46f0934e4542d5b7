//! Prometheus metrics of the control plane. Gauges that describe the fleet (sandboxes by state
//! and tier, workers) are computed when scraped; events (wakes, checkpoints, execs, crashes) are
//! recorded as they happen.

use prometheus::{
    exponential_buckets, Encoder, HistogramOpts, HistogramVec, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

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
    pub exec_seconds: HistogramVec,
    pub crashes: IntCounterVec,
    pub transitions: IntCounterVec,
    pub lot_parked: IntGauge,
    pub lot_wait_seconds: HistogramVec,
    pub lot_rejections: IntCounterVec,
    pub evictions: IntCounterVec,
    pub quota_rejections: IntCounterVec,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        // 0.5 ms to 65 s: parked waits and cold wakes under load reach tens of seconds.
        let latency = exponential_buckets(0.0005, 2.0, 18).expect("valid buckets");
        let sandboxes = IntGaugeVec::new(
            Opts::new("torpor_sandboxes", "Sandboxes by state and tier."),
            &["state", "tier"],
        )
        .expect("valid metric");
        let workers_total = IntGauge::new(
            "torpor_workers",
            "Workers (sandboxes that may be resident at once).",
        )
        .expect("valid metric");
        let workers_busy =
            IntGauge::new("torpor_workers_busy", "Workers holding a resident sandbox.")
                .expect("valid metric");
        let warm_ready = IntGauge::new(
            "torpor_warm_pool_ready",
            "Free workers prepared ahead (cgroups, bundle) and waiting for a wake.",
        )
        .expect("valid metric");
        let warm_takes = IntCounterVec::new(
            Opts::new(
                "torpor_warm_pool_takes_total",
                "Workers handed to wakes: prepared ahead (warm) or prepared inline (cold).",
            ),
            &["kind"],
        )
        .expect("valid metric");
        let wake_seconds = HistogramVec::new(
            HistogramOpts::new(
                "torpor_wake_seconds",
                "Time to bring a sandbox back to Running, by the tier it was woken from.",
            )
            .buckets(latency.clone()),
            &["from_tier"],
        )
        .expect("valid metric");
        let checkpoint_seconds = HistogramVec::new(
            HistogramOpts::new("torpor_checkpoint_seconds", "Time to checkpoint a sandbox.")
                .buckets(latency.clone()),
            &["outcome"],
        )
        .expect("valid metric");
        let checkpoint_bytes = IntCounterVec::new(
            Opts::new(
                "torpor_checkpoint_bytes_total",
                "Bytes of checkpoint images written.",
            ),
            &["kind"],
        )
        .expect("valid metric");
        let exec_seconds = HistogramVec::new(
            HistogramOpts::new(
                "torpor_exec_seconds",
                "Exec round trip inside a running sandbox.",
            )
            .buckets(latency),
            &["outcome"],
        )
        .expect("valid metric");
        let crashes = IntCounterVec::new(
            Opts::new(
                "torpor_sandbox_crashes_total",
                "Sandboxes that died on their own, by reason.",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let transitions = IntCounterVec::new(
            Opts::new(
                "torpor_transitions_total",
                "Sleep-ladder transitions, by target tier and cause.",
            ),
            &["to_tier", "cause"],
        )
        .expect("valid metric");
        let lot_parked = IntGauge::new(
            "torpor_lot_parked_calls",
            "Calls waiting in the parking lot for a worker.",
        )
        .expect("valid metric");
        let lot_wait_seconds = HistogramVec::new(
            HistogramOpts::new(
                "torpor_lot_wait_seconds",
                "Time calls waited in the parking lot, by outcome.",
            )
            .buckets(exponential_buckets(0.001, 2.0, 17).expect("valid buckets")),
            &["outcome"],
        )
        .expect("valid metric");
        let lot_rejections = IntCounterVec::new(
            Opts::new(
                "torpor_lot_rejections_total",
                "Calls refused for want of a worker, by reason.",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let evictions = IntCounterVec::new(
            Opts::new(
                "torpor_evictions_total",
                "Resident sandboxes parked to make room, by reason.",
            ),
            &["reason"],
        )
        .expect("valid metric");
        let quota_rejections = IntCounterVec::new(
            Opts::new(
                "torpor_quota_rejections_total",
                "Calls refused by a tenant quota.",
            ),
            &["tenant", "quota"],
        )
        .expect("valid metric");
        for c in [
            Box::new(lot_parked.clone()) as Box<dyn prometheus::core::Collector>,
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
            Box::new(exec_seconds.clone()),
            Box::new(crashes.clone()),
            Box::new(transitions.clone()),
        ] {
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
            exec_seconds,
            crashes,
            transitions,
            lot_parked,
            lot_wait_seconds,
            lot_rejections,
            evictions,
            quota_rejections,
        }
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
