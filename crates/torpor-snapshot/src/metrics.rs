//! Prometheus metrics of a [`ChunkCache`], read from the cache when
//! scraped: what it holds on disk against its budget, what waits in memory for its writer
//! (not counted in the budget, at most 128 MiB), and inserts dropped because that queue was
//! full.

use std::sync::Arc;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntCounter, IntGauge};

use crate::cache::ChunkCache;

/// Registers as one collector; every family is computed at scrape time.
pub struct CacheMetrics {
    cache: Arc<ChunkCache>,
    bytes: IntGauge,
    capacity: IntGauge,
    queued: IntGauge,
    dropped: IntCounter,
}

impl CacheMetrics {
    pub fn new(cache: Arc<ChunkCache>) -> CacheMetrics {
        let gauge = |name: &str, help: &str| IntGauge::new(name, help).expect("a valid metric");
        CacheMetrics {
            cache,
            bytes: gauge(
                "torpor_snapshot_cache_bytes",
                "Bytes of chunks in this node's chunk cache directory.",
            ),
            capacity: gauge(
                "torpor_snapshot_cache_capacity_bytes",
                "The chunk cache's byte budget (--chunk-cache).",
            ),
            queued: gauge(
                "torpor_snapshot_cache_queued_bytes",
                "Bytes of chunks held in memory until the cache's writer puts them on disk.",
            ),
            dropped: IntCounter::new(
                "torpor_snapshot_cache_queue_dropped_total",
                "Chunks not cached because the writer's queue was full.",
            )
            .expect("a valid metric"),
        }
    }
}

impl Collector for CacheMetrics {
    fn desc(&self) -> Vec<&Desc> {
        [
            self.bytes.desc(),
            self.capacity.desc(),
            self.queued.desc(),
            self.dropped.desc(),
        ]
        .concat()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let u = self.cache.usage();
        let clamp = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        self.bytes.set(clamp(u.bytes));
        self.capacity.set(clamp(u.capacity_bytes));
        self.queued.set(clamp(u.queued_bytes));
        self.dropped
            .inc_by(u.dropped_total.saturating_sub(self.dropped.get()));
        [
            self.bytes.collect(),
            self.capacity.collect(),
            self.queued.collect(),
            self.dropped.collect(),
        ]
        .concat()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id::ChunkId;

    #[test]
    fn the_cache_is_read_at_scrape_time() {
        let t = tempfile::tempdir().unwrap();
        let cache = Arc::new(ChunkCache::open(t.path(), 1 << 20).unwrap());
        let registry = prometheus::Registry::new();
        registry
            .register(Box::new(CacheMetrics::new(cache.clone())))
            .unwrap();
        let value = |name: &str| -> f64 {
            registry
                .gather()
                .iter()
                .find(|f| f.get_name() == name)
                .map(|f| {
                    let m = &f.get_metric()[0];
                    if f.get_field_type() == prometheus::proto::MetricType::COUNTER {
                        m.get_counter().get_value()
                    } else {
                        m.get_gauge().get_value()
                    }
                })
                .unwrap_or(f64::NAN)
        };
        assert_eq!(
            value("torpor_snapshot_cache_capacity_bytes"),
            f64::from(1 << 20)
        );
        assert_eq!(value("torpor_snapshot_cache_bytes"), 0.0);
        let blob = vec![7u8; 1000];
        cache.insert_blocking(&ChunkId::of(&blob), &blob);
        assert_eq!(value("torpor_snapshot_cache_bytes"), 1000.0);
        assert_eq!(value("torpor_snapshot_cache_queued_bytes"), 0.0);
        assert_eq!(value("torpor_snapshot_cache_queue_dropped_total"), 0.0);
    }
}
