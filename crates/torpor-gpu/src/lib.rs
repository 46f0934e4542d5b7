//! Fractional GPU engine for torpor.
//!
//! Owns the GPU inventory of a node (declared TOML, or NVML behind the `nvml` feature), MIG
//! geometry, partition modes, a pure allocator over a snapshot of the inventory, tenant
//! quotas, and what a sandbox must be given to use its share. It performs no I/O except
//! reading an inventory file (and, with `nvml`, asking the driver).
//!
//! Unsafe code exists only in `nvml::driver` (two raw NVML calls that `nvml-wrapper` does not
//! wrap); without the `nvml` feature the crate forbids it.
#![cfg_attr(not(feature = "nvml"), forbid(unsafe_code))]

pub mod cuda_checkpoint;
pub mod extender;
pub mod ids;
pub mod inject;
pub mod inventory;
pub mod ledger;
pub mod mig;
pub mod nvml;
pub mod partition;
pub mod planner;
pub mod pod_watch;
pub mod quota;
pub mod realize;
pub mod report;
pub mod request;
pub mod sleep;
pub mod topology;
