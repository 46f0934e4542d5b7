//! The attack suite: each test starts the real daemon (two tenants where it matters) and tries
//! to cross one trust boundary of docs/SECURITY.md, asserting the precise refusal (status and
//! code) and that nothing leaked and nothing else broke. Tests are named after what they try.
//!
//! One module per boundary, so they can be read beside the threat model:
//! - `tenants`: host paths, other tenants' objects, quotas, lists and names;
//! - `edge`: unauthenticated callers and HTTP resource exhaustion, rate limits, errors, metrics;
//! - `network`: what a sandbox can reach and what reaches a sandbox;
//! - `pools`: broker URLs, the GPU extender;
//! - `local`: the data directory, the lock, durability;
//! - `audit`: the tamper-evident log;
//! - `e2b_metadata`: E2B's file metadata (attribute namespaces, sizes, read bounds);
//! - `e2b`: E2B's `base` template (its operator-set egress ceiling);
//! - `e2b_reserved`: E2B's own metadata (`torpor.e2b.*`), which no tenant sets through torpor's API;
//! - `tls_hosts`: host names over HTTPS (`--tls-listen`): another tenant's envd and ports;
//! - `shim`: the containers' supervisors (live restore): another local user, sandboxed code.

#[path = "../common/mod.rs"]
mod common;

mod audit;
mod cluster;
mod cluster_join;
mod e2b;
mod e2b_metadata;
mod e2b_reserved;
mod edge;
mod local;
mod network;
mod pools;
mod shim;
mod tenants;
mod tls_hosts;
