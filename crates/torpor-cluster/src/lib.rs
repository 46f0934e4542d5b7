//! Cluster mode's first pieces: the trust domain's CA ([`ca`]), mutual TLS between controllers
//! and workers ([`tls`]), and the controller-worker protocol (`proto/node.proto`): a worker
//! serves its machine's node ([`server`]), a controller drives it as a [`client::RemoteNode`],
//! a second implementation of the node seam (`torpor_runtime::node`).
//!
//! ```text
//!   controller: Engine ── Arc<dyn Node> = RemoteNode ══ gRPC over mTLS ══▶ worker: NodeService ── RunscNode
//!               (state, API, policy)        (client.rs)                    (server.rs)     (runsc, cgroups)
//! ```
//!
//! Image paths in the protocol are paths on the worker's disk.

// gRPC handlers answer `tonic::Status` (the generated traits' signature); helpers that build
// one return it too, boxing it would only be undone at the boundary.
#![allow(clippy::result_large_err)]

pub mod ca;
pub mod client;
mod convert;
pub mod cpu;
pub mod drains;
pub mod fence;
pub mod fleet;
pub mod fleet_metrics;
pub mod gpu_turn;
pub mod images;
pub mod join;
pub mod peer;
pub mod placement;
pub mod reclaim;
pub mod server;
pub mod tickets;
pub mod tls;
mod tunnel;

/// The protocol's generated messages and services.
#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("torpor.node.v1");
}

pub use ca::{Ca, CaError, Identity, MemberName, Role, TrustDomain};
pub use client::{Deadlines, RemoteConfig, RemoteError, RemoteNode};
pub use drains::DrainBook;
pub use fence::{FenceBook, FenceOrder, Fenced, Fencer};
pub use fleet::{serve_cluster, Fleet, FleetCapacity, FleetConfig, FleetError, NodeStatus};
pub use fleet_metrics::FleetMetrics;
pub use gpu_turn::GpuTurnBook;
pub use images::{OpenBackend, WorkerImages};
pub use join::{join, JoinConfig};
pub use peer::{PeerAcceptor, PeerClients};
pub use server::{serve, GpuUsage, NodeService, ServeError, WorkerGpus};
pub use tickets::TicketBook;
pub use tls::{Side, TlsFiles, TlsMetrics, TlsSource};

/// The protocol version this build speaks (the `torpor-node-protocol` header; the package
/// `torpor.node.v1` carries its major version).
pub const PROTOCOL_VERSION: u32 = 2;
/// The metadata entry every call carries its protocol version in.
pub const PROTOCOL_HEADER: &str = "torpor-node-protocol";
/// The largest message either side accepts: an agent frame's header and body limits.
pub const MAX_MESSAGE: usize =
    torpor_runtime::proto::MAX_HEADER + torpor_runtime::proto::MAX_BODY + 4096;
