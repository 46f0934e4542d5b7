//! Pools: agents of one template, scaled from queue depth (to zero and back).
//!
//! A pool has one controller task (an actor: it alone owns the pool's agents and decides; the
//! API reads the [`PoolStatus`] it publishes). The controller reads every trigger's depth at
//! `poll_interval_ms`, and at once when a push watcher sees new work (Redis blocking move,
//! Redis stream blocking read, a NATS subscription on the stream's subjects), applies
//! [`torpor_triggers::rule::decide`], and moves agents:
//!
//! ```text
//!   sleeping (Suspended/Parked) --wake--> active --drain notice--> draining --in-flight done--> suspend
//!   (none)                      --create-->  |
//! ```
//!
//! In *dispatch* mode each active agent has a lane: a task with its own broker consumer that
//! takes one message and hands it to the agent — `dispatch.command` run in it with the message
//! on stdin (success: exit 0), or `dispatch.http`: a POST of the message body to a port of the
//! agent through the ingress path (the agent is woken if it sleeps and stays borrowed until the
//! answer is read; success: 2xx) — and acknowledges it only after success (retries, then the
//! dead-letter destination). A draining lane finishes its message before the agent is
//! suspended, so scale-in loses nothing. In *self-consume* mode (no `dispatch`) torpor only
//! scales; the agents read the broker themselves over their egress network (the template's
//! `network` policy must allow the broker). They take work while [`DRAIN_FILE`] is absent:
//! torpor writes it as the drain notice and removes it when it makes an agent active.
//!
//! Pool names are per tenant: the state store keys pools by (tenant, name), two tenants may each
//! have a pool `jobs`, and another tenant's pool answers like one that does not exist. A tenant's
//! pool may name only the brokers of the operator's allow-list (`--broker-allow`; checked at
//! create and again when the daemon starts), and what a tenant sees of a broker it cannot reach
//! is one generic text after one fixed time, whatever the cause (refused, filtered, reset):
//! the details go to the log.
//!
//! The module, by concern:
//! - `spec`: what a pool is asked to be ([`PoolSpec`]) and its validation;
//! - `status`: what a pool answers ([`PoolStatus`]) and what a tenant may see of broker errors;
//! - `registry`: [`Pools`], every pool of the node, its quota and who may address which pool;
//! - `controller`: one pool's actor, which reads depth and moves agents;
//! - `lane`: dispatch mode's per-agent consumer, which hands each message to its agent.
//!
//! This module uses only the [`crate::Engine`]'s public calls (create, resume, exec, suspend, delete).

mod controller;
mod lane;
mod registry;
mod spec;
mod status;

pub use registry::{Pools, PoolsConfig};
pub use spec::{DispatchSpec, HttpDispatch, PoolSpec};
pub use status::{PoolStatus, TriggerErrorStatus, TriggerStatus, BROKER_UNREACHABLE_CODE};

/// The metadata key that marks a sandbox as an agent of a pool.
pub const POOL_METADATA_KEY: &str = "torpor.pool";
/// The file a self-consuming agent finds when it is asked to stop taking work.
pub const DRAIN_FILE: &str = "/tmp/torpor-drain";
