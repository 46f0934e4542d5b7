//! The fleet as a controller's `/metrics` shows it, computed when scraped:
//!
//! - `torpor_nodes{state}`: the workers this controller knows, by state (`ready`,
//!   `draining`, `lost`; every state named, zero included), as `GET /v1/nodes` says them;
//! - `torpor_nodes_unreachable`: those not lost that this controller counts out of reach
//!   (`unreachable_since` set: their heartbeats arrive, its calls do not reach them): a
//!   one-way partition, on its way to a loss.
//!
//! `torpor up` serves the same names for its one node ([`FleetMetrics::single`]: `local`,
//! always ready).

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
    /// `None`: a single machine's one node.
    fleet: Option<Weak<Fleet>>,
    nodes: IntGaugeVec,
    unreachable: IntGauge,
}

impl FleetMetrics {
    pub fn new(fleet: &Arc<Fleet>) -> FleetMetrics {
        FleetMetrics {
            fleet: Some(Arc::downgrade(fleet)),
            ..FleetMetrics::single()
        }
    }

    /// The gauges of a single machine (`torpor up`): its one node, always ready.
    pub fn single() -> FleetMetrics {
        let nodes = IntGaugeVec::new(
            Opts::new(
                "torpor_nodes",
                "Nodes (cluster mode: workers) this controller knows, by state (ready, draining, lost).",
            ),
            &["state"],
        )
        .expect("a valid metric");
        let unreachable = IntGauge::new(
            "torpor_nodes_unreachable",
            "Workers not lost that this controller cannot call while their heartbeats arrive (a one-way partition, before it is counted a loss).",
        )
        .expect("a valid metric");
        FleetMetrics {
            fleet: None,
            nodes,
            unreachable,
        }
    }

    /// Sets the gauges from the fleet as it is now.
    fn refresh(&self) {
        let Some(fleet) = &self.fleet else {
            for state in STATES {
                let n = i64::from(state == WorkerState::Ready);
                self.nodes.with_label_values(&[state.as_str()]).set(n);
            }
            return;
        };
        let nodes = fleet.upgrade().map(|f| f.nodes()).unwrap_or_default();
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
