//! Event triggers for torpor's pools.
//!
//! - [`allow`]: the operator's broker allow-list (`--broker-allow`) for tenants' pools.
//! - [`spec`]: the trigger settings a pool is created with (`redis-list`, `redis-stream`,
//!   `nats-jetstream`, `rabbitmq`, `kafka`), checked strictly at create time.
//! - [`rule`]: the scaling rule (KEDA / HPA semantics) as a pure function, property-tested.
//! - [`depth`]: readers of real queue depth, one per broker, the way KEDA's scalers read it.
//! - [`consume`]: consumers for dispatch mode (take a message, acknowledge it only after the
//!   agent succeeded, dead-letter it after N failures).
//! - [`keda`]: KEDA's external-scaler gRPC service (`externalscaler.proto`) over any
//!   [`keda::Demand`] source.
//!
//! This crate knows nothing about sandboxes; `torpor-control` drives it.

pub mod allow;
pub mod consume;
pub mod depth;
#[doc(hidden)]
pub mod fuzzing;
#[cfg(feature = "kafka")]
pub mod kafka;
pub mod keda;
pub mod rule;
pub mod spec;

pub use allow::{AllowListError, BrokerAllowList};
pub use consume::{Consumer, Message};
pub use depth::DepthReader;
pub use rule::{decide, Decision, RuleState, ScalePolicy};
pub use spec::{TriggerError, TriggerSpec};

/// Code generated from `proto/externalscaler.proto` (server and client).
pub mod externalscaler {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("externalscaler");
}
