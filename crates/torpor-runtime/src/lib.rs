//! Sandboxes on gVisor. This crate owns everything that touches runsc, cgroups and the bundle
//! directories, plus the agent that runs inside each sandbox and the protocol between the two.
//! It knows nothing about tenants, the state store or the HTTP API.

pub mod agent;
pub mod cgroup;
pub mod conn;
pub mod dns;
pub mod gpu;
pub mod net;
pub mod node;
pub mod ports;
pub mod proto;
pub mod relay;
pub mod rootfs;
pub mod runsc;
pub mod shim;
pub mod spec;
pub mod warm;

pub use node::{
    Launch, LaunchGpu, Node, NodeEvent, NodeInfo, Resident, RunscNode, RunscNodeConfig,
};
pub use runsc::{Container, ExitHandle, ExitInfo, Runsc, RuntimeError};
pub use spec::{ContainerSpec, Mount};
pub use warm::{WarmPool, WarmStats, Worker};
