//! torpor's HTTP API v1: the server (routes onto the engine, authentication, the error
//! contract) and the Rust client the CLI uses. Both sides share [`types`].

pub mod client;
pub mod e2b;
mod pools;
pub mod proxy;
pub mod server;
pub mod snapshots;
pub mod types;

pub use client::{Client, ClientError};
pub use server::{router, ApiState, OPENAPI};
