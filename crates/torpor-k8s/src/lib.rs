//! torpor on Kubernetes: the custom resources (`crd`), the bodies they become in torpor's API
//! (`body`), the reconcile functions (`reconcile`) and the operator that runs them
//! (`operator`). The operator is a client of torpor's HTTP API like the CLI: it never touches
//! torpor's state directly, and nothing on torpor's request path goes through the Kubernetes
//! API server.

pub mod body;
pub mod crd;
pub mod operator;
pub mod reconcile;
pub mod status;
#[cfg(feature = "testing")]
pub mod testing;
