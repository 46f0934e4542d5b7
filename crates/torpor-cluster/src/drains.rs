//! Drains that hold on every controller. `POST /v1/nodes/{name}/drain` reaches one controller;
//! the drain is kept in the book the controllers share (PostgreSQL's `worker_drains`), applied
//! at once by that controller, and read by every other one every [`SYNC_EVERY`] and at its
//! start, so no controller keeps sending the worker new sandboxes and a drain outlives the
//! controller that took it. Lifting it (`DELETE …/drain`) travels the same way.

use std::time::Duration;

/// How often a controller reads the book (and so how long another controller may still place
/// on a worker drained elsewhere).
pub const SYNC_EVERY: Duration = Duration::from_secs(1);

/// Where drains are kept for every controller.
pub trait DrainBook: Send + Sync {
    /// Drains `worker` (`true`) or lifts its drain.
    fn set(&self, worker: &str, drain: bool) -> Result<(), String>;
    /// Every drained worker's name.
    fn drained(&self) -> Result<Vec<String>, String>;
}
