//! Inventory and telemetry from NVML.
//!
//! Split in two so that everything but the driver calls is tested on machines without a GPU:
//! the pure half (always compiled) turns plain facts into an [`Inventory`] and samples into
//! DCGM-exporter-compatible metrics; the driver half (feature `nvml`, module `driver`) only
//! gathers those facts with `nvml-wrapper`, which loads `libnvidia-ml.so` at run time, so a
//! binary built with the feature still starts, and reports a clear error, without a driver.
//!
//! By concern:
//! - `facts`: what NVML says about GPUs and their pairs, made into an [`Inventory`](crate::inventory::Inventory);
//! - `profiles`: the driver's MIG profiles and placements, compared with the table, and NVML's
//!   return and compute-profile codes;
//! - `metrics`: samples as DCGM-exporter-compatible metrics;
//! - [`driver`] (feature `nvml`): the calls into `libnvidia-ml.so`.

#[cfg(feature = "nvml")]
pub mod driver;
mod facts;
mod metrics;
mod profiles;

pub use facts::{inventory_from_facts, link_of, Ancestor, DeviceFacts, PairFacts};
pub use metrics::{dcgm_metrics, tensor_ratio, GpuSample};
pub use profiles::{
    driver_geometry, full_compute_profile, mig_profile_from_name, nvml_return_code,
    placements_match_table, DriverProfile,
};

/// Label used as the "file" of inventory errors from NVML.
pub const SOURCE: &str = "nvml";
