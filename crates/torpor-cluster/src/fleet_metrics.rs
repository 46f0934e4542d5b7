//! The fleet as a controller's `/metrics` shows it, computed when scraped:
//!
//! - `torpor_cluster_nodes{state}`: the workers this controller knows, by state (`ready`,
//!   `draining`, `lost`; every state named, zero included), as `GET /v1/nodes` says them;
//! - `torpor_cluster_nodes_unreachable`: those not lost whose probes from this controller fail
//!   now (`unreachable_since` set): a one-way partition on its way to a loss, worth an alert
//!   before the loss.

use std::sync::{Arc, Weak};

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntGauge, IntGaugeVec, Opts};

use crate::fleet::Fleet;
use crate::placement::WorkerState;

const STATES: [WorkerState; 3] = [WorkerState::Ready, WorkerState::Draining, WorkerState::Lost];

/// A Prometheus collector over a [`Fleet`] (it holds the fleet weakly: a stopped one reads as
/// no workers).
pub struct FleetMetrics {
    fleet: Weak<Fleet>,
    nodes: IntGaugeVec,
    unreachable: IntGauge,
}

impl FleetMetrics {
    pub fn new(fleet: &Arc<Fleet>) -> FleetMetrics {
        let nodes = IntGaugeVec::new(
            Opts::new(
                "torpor_cluster_nodes",
                "Workers this controller knows, by state (ready, draining, lost).",
            ),
            &["state"],
        )
        .expect("a valid metric");
        let unreachable = IntGauge::new(
            "torpor_cluster_nodes_unreachable",
            "Workers not lost whose probes from this controller fail now (a one-way partition before it is counted a loss).",
        )
        .expect("a valid metric");
        FleetMetrics {
            fleet: Arc::downgrade(fleet),
            nodes,
            unreachable,
        }
    }

    /// Sets the gauges from the fleet as it is now.
    fn refresh(&self) {
        let nodes = self.fleet.upgrade().map(|f| f.nodes()).unwrap_or_default();
        for state in STATES {
            let n = nodes.iter().filter(|n| n.state == state).count();
            self.nodes
                .with_label_values(&[state.as_str()])
                .set(n as i64);
        }
        let unreachable = nodes
            .iter()
            .filter(|n| n.state != WorkerState::Lost && n.unreachable_since.is_some())
            .count();
        self.unreachable.set(unreachable as i64);
    }
}

impl Collector for FleetMetrics {
    fn desc(&self) -> Vec<&Desc> {
        let mut d = self.nodes.desc();
        d.extend(self.unreachable.desc());
        d
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.refresh();
        let mut families = self.nodes.collect();
        families.extend(self.unreachable.collect());
        families
    }
}
