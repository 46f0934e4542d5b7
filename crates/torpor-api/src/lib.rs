//! torpor's HTTP API v1: the server (routes onto the engine, authentication, the error
//! contract) and the Rust client the CLI uses. Both sides share [`types`].

pub mod audit;
pub mod client;
pub mod e2b;
#[doc(hidden)]
pub mod fuzzing;
mod pools;
pub mod proxy;
pub mod ratelimit;
pub mod request_id;
pub mod server;
pub mod snapshots;
pub mod types;
pub mod uploads;

pub use client::{Client, ClientError};
pub use server::{metrics_router, router, ApiState, OPENAPI};
