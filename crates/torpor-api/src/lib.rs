//! torpor's HTTP API v1: the server (routes onto the engine, authentication, the error
//! contract) and the Rust client the CLI uses. Both sides share [`types`].
//!
//! Modules by layer: leaf modules hold what every handler shares ([`state`], [`errors`],
//! [`body`], [`params`], [`auth`], [`request_id`], [`ratelimit`], [`domain`]); handler modules
//! ([`tenants`], [`templates`], [`sandboxes`], [`exec`], [`files`], [`health`], [`nodes`], [`snapshots`],
//! `pools`, [`uploads`], [`proxy`], [`e2b`]) import those; [`server`] holds the one routes
//! table and imports the handlers. No handler imports [`server`] (crate::e2b still names its
//! re-exports of the leaf modules' items, to be moved to the leaf paths).

pub mod audit;
pub mod auth;
pub mod body;
pub mod client;
pub mod domain;
pub mod e2b;
pub mod errors;
pub mod exec;
pub mod files;
pub mod forward;
#[doc(hidden)]
pub mod fuzzing;
pub mod health;
pub mod nodes;
pub mod params;
mod pools;
pub mod proxy;
pub mod rate_share;
pub mod ratelimit;
pub mod request_id;
pub mod sandboxes;
pub mod server;
pub mod snapshots;
pub mod state;
pub mod templates;
pub mod tenants;
pub mod types;
pub mod uploads;
pub mod usage;

pub use client::{Client, ClientError};
pub use errors::{wire, ApiError, ConnectCode, Wire};
pub use health::OPENAPI;
pub use server::{metrics_router, router};
pub use state::ApiState;
