//! The cluster's placement index: which worker a new or waking sandbox goes to.
//!
//! A pure planner (no I/O, no clock, no locks): the controller feeds it what workers register
//! ([`Placement::upsert`]), their heartbeats ([`Placement::report`]) and their lifecycle
//! ([`Placement::set_state`]), and asks it for a worker ([`Placement::choose`] /
//! [`Placement::place`]). It owns nothing else: the durable record of workers, the sandboxes on
//! them and the network calls that move a sandbox are the fleet node's.
//!
//! ```text
//!   upsert ──▶ Ready ──set_state──▶ Draining ──set_state──▶ Lost
//!                ▲                      │                     │
//!                └──────set_state───────┴─────────────────────┘   (remove: forgotten)
//!   only Ready workers receive new sandboxes
//! ```
//!
//! # Rules
//!
//! - A worker fits a [`Need`] when it is [`WorkerState::Ready`], has a free slot
//!   (`busy < slots`), at least `need.memory` bytes of free memory
//!   (`memory_budget - reserved_memory`), the GPU model `need.gpu_model` names (if any) among its
//!   `gpu_models`, and every `need.labels` pair among its labels.
//! - `prefer` (the worker that still holds the sandbox's local image) wins when it fits.
//! - Otherwise the fitting worker with the most idle CPU wins, counted in steps of
//!   [`CPU_STEP_MILLI`] (a quarter core) so that the noise between two heartbeats does not
//!   reorder workers; ties go to the most free slots, then the most free memory, then the
//!   smallest name. The choice is fully determined, so a linear scan with the same order picks
//!   the same worker (the tests check exactly that).
//!
//! # Load
//!
//! A slot counts a resident sandbox whether it burns its cores or sleeps frozen, so free
//! slots alone send new sandboxes to a worker whose few sandboxes keep every core busy. Idle
//! CPU is what a wake needs first (a restore is CPU-bound) and what the woken agent runs on:
//! each worker says in its heartbeats how many thousandths of a core were idle over the last
//! interval ([`Load::cpu_idle_milli`], the whole machine's, from `/proc/stat`). Between two
//! heartbeats every placement on a worker takes [`START_CPU_MILLI`] off it, so a burst of
//! starts spreads over the workers of equal headroom instead of all landing on the one that
//! looked idlest at the last report; the next report replaces the estimate with the truth. A
//! worker that reports no CPU figure (an older version) counts as every core idle, and its
//! placements take nothing off: among such workers free slots decide, as before.
//!
//! # Cost
//!
//! Ready workers with a free slot sit in ordered sets keyed by
//! `(idle CPU steps desc, free slots desc, free memory desc, name)`: one for the whole fleet, one per GPU model and
//! one per label (`key=value`). A choice walks the smallest set the need names (the fleet's when
//! it names none) from its best end and stops at the first fit, so it examines only the
//! candidates it skips (those short of memory or lacking the need's other labels or GPU), never
//! the full or draining part of the fleet; a GPU model or label no candidate has answers at once.
//! Within a run of equal CPU steps and free slots memory is descending, so one worker short of
//! memory skips the rest of its run with one seek. [`Choice::considered`] reports how many workers were examined.
//! Every mutation takes a worker's keys out, changes it and puts the new keys back.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::ops::Bound;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// A worker's lifecycle, as the controller sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerState {
    /// Registered and heartbeating: receives new sandboxes.
    Ready,
    /// Finishing what it holds: receives no new sandboxes.
    Draining,
    /// Silent past the controller's limit: receives nothing; its sandboxes resume elsewhere.
    Lost,
}

impl WorkerState {
    /// The wire and display name: `ready`, `draining`, `lost`.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerState::Ready => "ready",
            WorkerState::Draining => "draining",
            WorkerState::Lost => "lost",
        }
    }
}

impl fmt::Display for WorkerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A name that is not `ready`, `draining` or `lost`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown worker state (expected ready, draining or lost)")]
pub struct UnknownWorkerState;

impl FromStr for WorkerState {
    type Err = UnknownWorkerState;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ready" => Ok(WorkerState::Ready),
            "draining" => Ok(WorkerState::Draining),
            "lost" => Ok(WorkerState::Lost),
            _ => Err(UnknownWorkerState),
        }
    }
}

/// What a worker registered with.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Capacity {
    /// Sandboxes it runs at once (`--workers`).
    pub slots: u32,
    /// Bytes of memory its sandboxes may hold (`--memory-budget`).
    pub memory_budget: u64,
    /// Starts and checkpoints it runs at once: its cores (0: not said, counted as 1).
    #[serde(default)]
    pub cores: u32,
    /// The GPU models it has (e.g. `NVIDIA H200`), one entry per model.
    pub gpu_models: Vec<String>,
    /// Operator labels (`zone=eu-1`); a need's labels must all be among them.
    pub labels: BTreeMap<String, String>,
}

/// What a worker is using: what placement reserved, replaced by what the worker last reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Load {
    /// Slots in use.
    pub busy: u32,
    /// Bytes of memory reserved by its sandboxes.
    pub reserved_memory: u64,
    /// Thousandths of a core idle over its last heartbeat interval, less [`START_CPU_MILLI`]
    /// for each placement on it since; `None`: not reported (counted as every core idle).
    #[serde(default)]
    pub cpu_idle_milli: Option<u32>,
}

/// Idle CPU is ranked in steps of this many thousandths of a core (see the module doc).
pub const CPU_STEP_MILLI: u32 = 250;

/// What a placement takes off a worker's idle CPU until its next report: a start keeps about
/// one core busy for a few hundred milliseconds (a restore), then its agent runs.
pub const START_CPU_MILLI: u32 = 500;

/// A worker's idle CPU in [`CPU_STEP_MILLI`] steps; every core (at least one) when it reported
/// none.
fn cpu_steps(cap: &Capacity, load: &Load) -> u32 {
    let idle = load
        .cpu_idle_milli
        .unwrap_or_else(|| cap.cores.max(1).saturating_mul(1000));
    idle / CPU_STEP_MILLI
}

/// A [`Need::gpu_model`] that any worker with at least one GPU meets.
pub const ANY_GPU: &str = "*";

/// The GPU index keys of a worker: each of its models, and [`ANY_GPU`] when it has any.
fn gpu_keys(cap: &Capacity) -> impl Iterator<Item = &str> {
    cap.gpu_models
        .iter()
        .map(String::as_str)
        .chain((!cap.gpu_models.is_empty()).then_some(ANY_GPU))
}

/// What a sandbox needs from a worker.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Need {
    /// Bytes of memory (its memory limit); 0 for none.
    pub memory: u64,
    /// A GPU model the worker must have ([`ANY_GPU`]: any model, but some GPU); `None` for
    /// any worker, with or without GPUs.
    pub gpu_model: Option<String>,
    /// Labels the worker must carry, every one with the same value.
    pub labels: BTreeMap<String, String>,
}

/// The worker placement chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// Its name.
    pub worker: String,
    /// Workers examined to reach it (the preferred one counts when it was looked at).
    pub considered: usize,
}

/// An index entry: sorts the best candidate first (most idle CPU steps, most free slots, most
/// free memory, name). The name is shared with the worker's record, so a key costs no
/// allocation.
type Key = (Reverse<u32>, Reverse<u32>, Reverse<u64>, Arc<str>);

#[derive(Debug, Clone)]
struct Worker {
    name: Arc<str>,
    cap: Capacity,
    load: Load,
    state: WorkerState,
}

impl Worker {
    fn free_slots(&self) -> u32 {
        self.cap.slots.saturating_sub(self.load.busy)
    }

    fn free_memory(&self) -> u64 {
        self.cap
            .memory_budget
            .saturating_sub(self.load.reserved_memory)
    }

    /// Its idle CPU in [`CPU_STEP_MILLI`] steps; every core when it reported none.
    fn cpu_steps(&self) -> u32 {
        cpu_steps(&self.cap, &self.load)
    }

    /// Its index key, when it can take a sandbox at all.
    fn key(&self) -> Option<Key> {
        let slots = self.free_slots();
        (self.state == WorkerState::Ready && slots > 0).then(|| {
            (
                Reverse(self.cpu_steps()),
                Reverse(slots),
                Reverse(self.free_memory()),
                self.name.clone(),
            )
        })
    }

    fn has_labels(&self, need: &Need) -> bool {
        need.labels
            .iter()
            .all(|(k, v)| self.cap.labels.get(k) == Some(v))
    }

    fn has_gpu(&self, need: &Need) -> bool {
        need.gpu_model
            .as_ref()
            .is_none_or(|m| gpu_keys(&self.cap).any(|k| k == m))
    }

    fn fits(&self, need: &Need) -> bool {
        self.state == WorkerState::Ready
            && self.free_slots() > 0
            && self.free_memory() >= need.memory
            && self.has_gpu(need)
            && self.has_labels(need)
    }
}

/// The ordered sets of Ready workers with a free slot (no empty sets or maps).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Index {
    /// The whole fleet.
    all: BTreeSet<Key>,
    /// Per GPU model.
    by_gpu: HashMap<String, BTreeSet<Key>>,
    /// Per label key, then value.
    by_label: HashMap<String, HashMap<String, BTreeSet<Key>>>,
}

impl Index {
    fn insert(&mut self, w: &Worker) {
        let Some(key) = w.key() else {
            return;
        };
        for model in gpu_keys(&w.cap) {
            match self.by_gpu.get_mut(model) {
                Some(set) => {
                    set.insert(key.clone());
                }
                None => {
                    self.by_gpu
                        .insert(model.to_owned(), BTreeSet::from([key.clone()]));
                }
            }
        }
        for (k, v) in &w.cap.labels {
            let values = match self.by_label.get_mut(k) {
                Some(values) => values,
                None => self.by_label.entry(k.clone()).or_default(),
            };
            match values.get_mut(v) {
                Some(set) => {
                    set.insert(key.clone());
                }
                None => {
                    values.insert(v.clone(), BTreeSet::from([key.clone()]));
                }
            }
        }
        self.all.insert(key);
    }

    fn remove(&mut self, w: &Worker) {
        let Some(key) = w.key() else {
            return;
        };
        for model in gpu_keys(&w.cap) {
            if let Some(set) = self.by_gpu.get_mut(model) {
                set.remove(&key);
                if set.is_empty() {
                    self.by_gpu.remove(model);
                }
            }
        }
        for (k, v) in &w.cap.labels {
            if let Some(values) = self.by_label.get_mut(k) {
                if let Some(set) = values.get_mut(v) {
                    set.remove(&key);
                    if set.is_empty() {
                        values.remove(v);
                    }
                }
                if values.is_empty() {
                    self.by_label.remove(k);
                }
            }
        }
        self.all.remove(&key);
    }

    /// The smallest set that holds every worker fitting `need`'s GPU model and labels; `None`
    /// when one of them is on no candidate at all.
    fn candidates(&self, need: &Need) -> Option<&BTreeSet<Key>> {
        let mut set = &self.all;
        if let Some(model) = &need.gpu_model {
            set = smaller(set, self.by_gpu.get(model)?);
        }
        for (k, v) in &need.labels {
            set = smaller(set, self.by_label.get(k)?.get(v)?);
        }
        Some(set)
    }
}

fn smaller<'a>(a: &'a BTreeSet<Key>, b: &'a BTreeSet<Key>) -> &'a BTreeSet<Key> {
    if b.len() < a.len() {
        b
    } else {
        a
    }
}

/// The placement index. See the module documentation for the rules.
#[derive(Debug, Clone, Default)]
pub struct Placement {
    workers: HashMap<Arc<str>, Worker>,
    index: Index,
}

impl Placement {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a worker (Ready, no load) or updates its capacity, keeping its load and state.
    pub fn upsert(&mut self, name: &str, cap: Capacity) {
        if self.update(name, |w| w.cap = cap.clone()).is_none() {
            let name: Arc<str> = Arc::from(name);
            let worker = Worker {
                name: name.clone(),
                cap,
                load: Load::default(),
                state: WorkerState::Ready,
            };
            self.index.insert(&worker);
            self.workers.insert(name, worker);
        }
    }

    /// Sets a worker's state; false when the name is unknown.
    pub fn set_state(&mut self, name: &str, state: WorkerState) -> bool {
        self.update(name, |w| w.state = state).is_some()
    }

    /// Forgets a worker (no-op for an unknown name).
    pub fn remove(&mut self, name: &str) {
        if let Some(w) = self.workers.remove(name) {
            self.index.remove(&w);
        }
    }

    /// Replaces a worker's load with what it reported (no-op for an unknown name). A report may
    /// say more than its capacity (it is the truth); the worker then has no free slot or memory.
    /// Its idle CPU is held to the cores it registered (at least one): a worker cannot draw
    /// every new sandbox to itself by claiming more.
    pub fn report(&mut self, name: &str, load: Load) {
        self.update(name, |w| {
            let most = w.cap.cores.max(1).saturating_mul(1000);
            w.load = Load {
                cpu_idle_milli: load.cpu_idle_milli.map(|idle| idle.min(most)),
                ..load
            };
        });
    }

    /// The worker for `need`, without reserving anything. `prefer` wins when it fits; else the
    /// fitting worker with the most idle CPU steps, then the most free slots, then the most free
    /// memory, then the smallest name.
    pub fn choose(&self, need: &Need, prefer: Option<&str>) -> Option<Choice> {
        let mut considered = 0;
        if let Some(w) = prefer.and_then(|p| self.workers.get(p)) {
            considered += 1;
            if w.fits(need) {
                return Some(Choice {
                    worker: w.name.to_string(),
                    considered,
                });
            }
        }
        let set = self.index.candidates(need)?;
        let mut from = Bound::Unbounded;
        'seek: loop {
            for (Reverse(cpu), Reverse(slots), Reverse(memory), name) in
                set.range((from, Bound::Unbounded))
            {
                considered += 1;
                if *memory < need.memory {
                    // The rest of this run of equal CPU steps and free slots has no more
                    // memory: skip to the next run.
                    let (cpu, slots) = match (*cpu, *slots) {
                        (cpu, slots) if slots > 1 => (cpu, slots - 1),
                        (cpu, _) if cpu > 0 => (cpu - 1, u32::MAX),
                        _ => return None,
                    };
                    from = Bound::Included((
                        Reverse(cpu),
                        Reverse(slots),
                        Reverse(u64::MAX),
                        Arc::from(""),
                    ));
                    continue 'seek;
                }
                // Indexed means Ready with a free slot; the set covers one label or the model.
                let w = &self.workers[name];
                if w.has_gpu(need) && w.has_labels(need) {
                    return Some(Choice {
                        worker: name.to_string(),
                        considered,
                    });
                }
            }
            return None;
        }
    }

    /// Takes one slot and `memory` bytes on a Ready worker if both are free, and
    /// [`START_CPU_MILLI`] off its reported idle CPU until its next report; false (and nothing
    /// taken) otherwise, or for an unknown name.
    pub fn reserve(&mut self, name: &str, memory: u64) -> bool {
        self.update(name, |w| {
            let fits =
                w.state == WorkerState::Ready && w.free_slots() > 0 && w.free_memory() >= memory;
            if fits {
                w.load.busy += 1;
                w.load.reserved_memory += memory;
                w.load.cpu_idle_milli = w
                    .load
                    .cpu_idle_milli
                    .map(|idle| idle.saturating_sub(START_CPU_MILLI));
            }
            fits
        })
        .unwrap_or(false)
    }

    /// Gives back one slot and `memory` bytes (saturating at zero; no-op for an unknown name).
    pub fn release(&mut self, name: &str, memory: u64) {
        self.update(name, |w| {
            w.load.busy = w.load.busy.saturating_sub(1);
            w.load.reserved_memory = w.load.reserved_memory.saturating_sub(memory);
        });
    }

    /// [`choose`](Self::choose), then [`reserve`](Self::reserve) `need.memory` on the choice.
    pub fn place(&mut self, need: &Need, prefer: Option<&str>) -> Option<Choice> {
        let choice = self.choose(need, prefer)?;
        let reserved = self.reserve(&choice.worker, need.memory);
        debug_assert!(reserved, "a chosen worker fits its need");
        reserved.then_some(choice)
    }

    /// A worker's capacity, load and state.
    pub fn get(&self, name: &str) -> Option<(Capacity, Load, WorkerState)> {
        self.workers
            .get(name)
            .map(|w| (w.cap.clone(), w.load, w.state))
    }

    /// Every worker (any state), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Capacity, &Load, WorkerState)> {
        self.workers
            .values()
            .map(|w| (&*w.name, &w.cap, &w.load, w.state))
    }

    /// Registered workers, in any state.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// No worker registered.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// Checks that the index is exactly the one built from scratch from the workers' current
    /// records: every Ready worker with a free slot, under its current key, in the fleet set and
    /// in the set of each of its GPU models and labels; nothing else, no empty set. For tests
    /// and debugging: it rebuilds the whole index.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut want = Index::default();
        for (name, w) in &self.workers {
            if *name != w.name {
                return Err(format!("worker {:?} is filed as {name:?}", w.name));
            }
            want.insert(w);
        }
        if self.index != want {
            return Err(format!(
                "index holds {:?}, the workers' records say {:?}",
                self.index, want
            ));
        }
        Ok(())
    }

    /// Applies `change` to a worker, moving its index entries from its old key to its new one.
    fn update<R>(&mut self, name: &str, change: impl FnOnce(&mut Worker) -> R) -> Option<R> {
        let w = self.workers.get_mut(name)?;
        self.index.remove(w);
        let result = change(w);
        self.index.insert(w);
        Some(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GIB: u64 = 1 << 30;

    fn cap(slots: u32, memory_gib: u64) -> Capacity {
        Capacity {
            slots,
            memory_budget: memory_gib * GIB,
            ..Capacity::default()
        }
    }

    fn gpu_cap(slots: u32, memory_gib: u64, model: &str) -> Capacity {
        Capacity {
            gpu_models: vec![model.to_owned()],
            ..cap(slots, memory_gib)
        }
    }

    fn labelled(slots: u32, memory_gib: u64, labels: &[(&str, &str)]) -> Capacity {
        Capacity {
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..cap(slots, memory_gib)
        }
    }

    fn need(memory_gib: u64) -> Need {
        Need {
            memory: memory_gib * GIB,
            ..Need::default()
        }
    }

    fn chosen(p: &Placement, need: &Need, prefer: Option<&str>) -> Option<String> {
        p.check_invariants().unwrap();
        p.choose(need, prefer).map(|c| c.worker)
    }

    #[test]
    fn draining_and_lost_workers_receive_no_sandbox() {
        let mut p = Placement::new();
        p.upsert("a", cap(8, 16));
        p.upsert("b", cap(4, 16));
        assert!(p.set_state("a", WorkerState::Draining));
        assert_eq!(chosen(&p, &need(1), None).as_deref(), Some("b"));
        assert!(p.set_state("b", WorkerState::Lost));
        assert_eq!(chosen(&p, &need(1), None), None);
        // Not even as the preferred worker, nor by a direct reservation.
        assert_eq!(chosen(&p, &need(1), Some("a")), None);
        assert!(!p.reserve("a", 0));
        assert!(!p.reserve("b", 0));
        assert_eq!(p.place(&need(1), Some("b")), None);
        assert_eq!(p.get("a").unwrap().1, Load::default());
        assert!(p.set_state("a", WorkerState::Ready));
        assert_eq!(chosen(&p, &need(1), Some("b")).as_deref(), Some("a"));
    }

    #[test]
    fn the_preferred_worker_wins_only_when_it_is_ready_and_fits() {
        let mut p = Placement::new();
        p.upsert("big", gpu_cap(16, 64, "h200"));
        p.upsert("small", labelled(2, 4, &[("zone", "a")]));
        // Fits: wins over the roomier worker, looking at nothing else.
        let c = p.choose(&need(1), Some("small")).unwrap();
        assert_eq!(
            c,
            Choice {
                worker: "small".into(),
                considered: 1
            }
        );
        // Short of memory, lacking the GPU, lacking a label: spread instead.
        assert_eq!(chosen(&p, &need(8), Some("small")).as_deref(), Some("big"));
        let gpu = Need {
            gpu_model: Some("h200".into()),
            ..need(1)
        };
        assert_eq!(chosen(&p, &gpu, Some("small")).as_deref(), Some("big"));
        let any_gpu = Need {
            gpu_model: Some(ANY_GPU.into()),
            ..need(1)
        };
        assert_eq!(chosen(&p, &any_gpu, Some("small")).as_deref(), Some("big"));
        let other_model = Need {
            gpu_model: Some("a100".into()),
            ..need(1)
        };
        assert_eq!(chosen(&p, &other_model, None), None);
        let zone_b = Need {
            labels: BTreeMap::from([("zone".into(), "b".into())]),
            ..need(0)
        };
        p.upsert("other", labelled(1, 4, &[("zone", "b")]));
        assert_eq!(chosen(&p, &zone_b, Some("small")).as_deref(), Some("other"));
        // Full: spread.
        p.report(
            "small",
            Load {
                busy: 2,
                reserved_memory: 0,
                ..Load::default()
            },
        );
        assert_eq!(chosen(&p, &need(1), Some("small")).as_deref(), Some("big"));
        // Draining: spread.
        p.report("small", Load::default());
        p.set_state("small", WorkerState::Draining);
        assert_eq!(chosen(&p, &need(1), Some("small")).as_deref(), Some("big"));
        // Unknown: spread, and it was not examined.
        let c = p.choose(&need(1), Some("gone")).unwrap();
        assert_eq!((c.worker.as_str(), c.considered), ("big", 1));
    }

    fn cores(slots: u32, memory_gib: u64, cores: u32) -> Capacity {
        Capacity {
            cores,
            ..cap(slots, memory_gib)
        }
    }

    fn idle(busy: u32, cpu_idle_milli: u32) -> Load {
        Load {
            busy,
            reserved_memory: 0,
            cpu_idle_milli: Some(cpu_idle_milli),
        }
    }

    #[test]
    fn a_worker_with_idle_cores_wins_over_one_with_more_free_slots_and_busy_cores() {
        let mut p = Placement::new();
        p.upsert("busy", cores(16, 64, 4));
        p.upsert("calm", cores(4, 16, 4));
        // busy: 2 sandboxes keep 3.5 of its 4 cores busy; calm: 3 frozen ones, every core idle.
        p.report("busy", idle(2, 500));
        p.report("calm", idle(3, 4000));
        assert_eq!(chosen(&p, &need(1), None).as_deref(), Some("calm"));
        // Within the same quarter core, free slots decide again.
        p.report("busy", idle(2, 3750));
        p.report("calm", idle(3, 3999));
        assert_eq!(chosen(&p, &need(1), None).as_deref(), Some("busy"));
        p.report("busy", idle(2, 3749));
        assert_eq!(chosen(&p, &need(1), None).as_deref(), Some("calm"));
        // A worker that says nothing of its CPU counts as every core idle.
        p.report(
            "busy",
            Load {
                busy: 2,
                ..Load::default()
            },
        );
        assert_eq!(chosen(&p, &need(1), None).as_deref(), Some("busy"));
        // The memory a need asks for still rules out the idlest worker.
        p.report("busy", idle(2, 500));
        assert_eq!(chosen(&p, &need(20), None).as_deref(), Some("busy"));
        // Idle CPU is held to the cores a worker registered: claiming more draws nothing.
        p.report("busy", idle(2, 4000));
        p.report("calm", idle(3, 40_000));
        assert_eq!(p.get("calm").unwrap().1.cpu_idle_milli, Some(4000));
        assert_eq!(chosen(&p, &need(1), None).as_deref(), Some("busy"));
        // And a worker with no free slot is not a candidate however idle.
        p.report("calm", idle(4, 4000));
        assert_eq!(chosen(&p, &need(1), None).as_deref(), Some("busy"));
    }

    #[test]
    fn placements_between_two_heartbeats_spread_over_workers_of_equal_headroom() {
        let mut p = Placement::new();
        p.upsert("a", cores(8, 64, 2));
        p.upsert("b", cores(4, 64, 2));
        p.report("a", idle(0, 2000));
        p.report("b", idle(0, 2000));
        // Each start takes half a core off its worker until the next report, so a burst
        // alternates instead of filling the worker with the most free slots first.
        let order: Vec<String> = (0..4)
            .map(|_| p.place(&need(1), None).unwrap().worker)
            .collect();
        assert_eq!(order, ["a", "b", "a", "b"]);
        assert_eq!(p.get("a").unwrap().1.cpu_idle_milli, Some(1000));
        // The next report is the truth again.
        p.report("a", idle(2, 1900));
        p.report("b", idle(2, 600));
        assert_eq!(p.place(&need(1), None).unwrap().worker, "a");
        // Without CPU reports, free slots decide as before: a has 6 free, b 2.
        p.report(
            "a",
            Load {
                busy: 3,
                ..Load::default()
            },
        );
        p.report(
            "b",
            Load {
                busy: 2,
                ..Load::default()
            },
        );
        let order: Vec<String> = (0..3)
            .map(|_| p.place(&need(1), None).unwrap().worker)
            .collect();
        assert_eq!(order, ["a", "a", "a"]);
        assert_eq!(p.get("a").unwrap().1.cpu_idle_milli, None);
        p.check_invariants().unwrap();
    }

    #[test]
    fn spreading_picks_most_free_slots_then_most_free_memory_then_the_smallest_name() {
        let mut p = Placement::new();
        p.upsert("c", cap(4, 8));
        p.upsert("b", cap(4, 16));
        p.upsert("a", cap(4, 16));
        p.upsert("d", cap(3, 64));
        assert_eq!(chosen(&p, &need(1), None).as_deref(), Some("a"));
        assert_eq!(p.place(&need(1), None).unwrap().worker, "a");
        // a has 3 free slots now: b (4 free, 16 GiB) beats c (4 free, 8 GiB).
        assert_eq!(p.place(&need(1), None).unwrap().worker, "b");
        assert_eq!(p.place(&need(1), None).unwrap().worker, "c");
        // All at 3 free: d has the most free memory.
        assert_eq!(p.place(&need(1), None).unwrap().worker, "d");
        let order: Vec<String> = (0..4)
            .map(|_| p.place(&need(0), None).unwrap().worker)
            .collect();
        // a, b, c have 3 free (15, 15, 7 GiB), d 2: then all 2 free and d has 62 GiB.
        assert_eq!(order, ["a", "b", "c", "d"]);
        p.check_invariants().unwrap();
    }

    #[test]
    fn memory_gpu_model_and_labels_filter_candidates() {
        let mut p = Placement::new();
        p.upsert("cpu", labelled(32, 256, &[("zone", "a"), ("tier", "gold")]));
        p.upsert("h200", gpu_cap(8, 64, "h200"));
        p.upsert(
            "mixed",
            Capacity {
                gpu_models: vec!["a100".into(), "h200".into()],
                ..labelled(4, 32, &[("zone", "b")])
            },
        );
        // Memory: only cpu has 100 GiB.
        assert_eq!(chosen(&p, &need(100), None).as_deref(), Some("cpu"));
        assert_eq!(chosen(&p, &need(300), None), None);
        // GPU model: only workers with that model, best among them.
        let want = |m: &str, mem| Need {
            gpu_model: Some(m.into()),
            ..need(mem)
        };
        assert_eq!(chosen(&p, &want("h200", 1), None).as_deref(), Some("h200"));
        assert_eq!(chosen(&p, &want("a100", 1), None).as_deref(), Some("mixed"));
        assert_eq!(chosen(&p, &want("h200", 40), None).as_deref(), Some("h200"));
        assert_eq!(chosen(&p, &want("a100", 40), None), None);
        assert_eq!(chosen(&p, &want("b200", 0), None), None);
        // Labels: every pair must match.
        let with = |labels: &[(&str, &str)]| Need {
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..need(0)
        };
        assert_eq!(
            chosen(&p, &with(&[("zone", "b")]), None).as_deref(),
            Some("mixed")
        );
        assert_eq!(
            chosen(&p, &with(&[("zone", "a"), ("tier", "gold")]), None).as_deref(),
            Some("cpu")
        );
        assert_eq!(
            chosen(&p, &with(&[("zone", "a"), ("tier", "silver")]), None),
            None
        );
        assert_eq!(chosen(&p, &with(&[("tier", "")]), None), None);
        // All three at once.
        let all = Need {
            labels: BTreeMap::from([("zone".into(), "b".into())]),
            ..want("h200", 32)
        };
        assert_eq!(chosen(&p, &all, None).as_deref(), Some("mixed"));
    }

    #[test]
    fn reserve_never_overcommits_slots_or_memory() {
        let mut p = Placement::new();
        p.upsert("w", cap(3, 10));
        // Memory runs out before slots.
        assert!(p.reserve("w", 6 * GIB));
        assert!(!p.reserve("w", 5 * GIB));
        assert_eq!(
            p.get("w").unwrap().1,
            Load {
                busy: 1,
                reserved_memory: 6 * GIB,
                ..Load::default()
            },
            "a refused reservation takes nothing"
        );
        assert!(p.reserve("w", 4 * GIB));
        assert!(!p.reserve("w", 1));
        // Slots run out before memory.
        assert!(p.reserve("w", 0));
        assert!(!p.reserve("w", 0));
        assert_eq!(
            p.get("w").unwrap().1,
            Load {
                busy: 3,
                reserved_memory: 10 * GIB,
                ..Load::default()
            }
        );
        assert_eq!(p.place(&need(0), None), None);
        p.check_invariants().unwrap();
        // Placing until refusal never exceeds capacity either.
        let mut q = Placement::new();
        q.upsert("x", cap(5, 3));
        q.upsert("y", cap(2, 100));
        let mut placed = 0;
        while q.place(&need(1), None).is_some() {
            placed += 1;
            q.check_invariants().unwrap();
        }
        assert_eq!(placed, 5, "x holds 3 (memory), y holds 2 (slots)");
        for name in ["x", "y"] {
            let (c, l, _) = q.get(name).unwrap();
            assert!(l.busy <= c.slots && l.reserved_memory <= c.memory_budget);
        }
    }

    #[test]
    fn release_saturates_at_zero_and_makes_room_again() {
        let mut p = Placement::new();
        p.upsert("w", cap(1, 4));
        assert!(p.reserve("w", 2 * GIB));
        assert_eq!(p.place(&need(0), None), None);
        p.release("w", 2 * GIB);
        assert_eq!(p.get("w").unwrap().1, Load::default());
        assert_eq!(chosen(&p, &need(4), None).as_deref(), Some("w"));
        p.release("w", 100 * GIB);
        p.release("w", u64::MAX);
        assert_eq!(p.get("w").unwrap().1, Load::default());
        p.check_invariants().unwrap();
        // Release on a draining worker still counts (its sandboxes finish there).
        assert!(p.reserve("w", GIB));
        p.set_state("w", WorkerState::Draining);
        p.release("w", GIB);
        assert_eq!(p.get("w").unwrap().1, Load::default());
        p.check_invariants().unwrap();
    }

    #[test]
    fn unknown_names_change_nothing() {
        let mut p = Placement::new();
        assert!(p.is_empty());
        assert!(!p.set_state("ghost", WorkerState::Ready));
        assert!(!p.reserve("ghost", 0));
        p.release("ghost", 1);
        p.report(
            "ghost",
            Load {
                busy: 1,
                reserved_memory: 1,
                ..Load::default()
            },
        );
        p.remove("ghost");
        assert_eq!(p.get("ghost"), None);
        assert!(p.is_empty());
        assert_eq!(p.choose(&need(0), Some("ghost")), None);
        p.check_invariants().unwrap();
    }

    #[test]
    fn upsert_keeps_load_and_state_and_remove_forgets() {
        let mut p = Placement::new();
        p.upsert("w", gpu_cap(4, 8, "a100"));
        assert!(p.reserve("w", 3 * GIB));
        p.set_state("w", WorkerState::Draining);
        p.upsert("w", gpu_cap(6, 16, "h200"));
        let (c, l, s) = p.get("w").unwrap();
        assert_eq!(
            (c.slots, l.busy, l.reserved_memory, s),
            (6, 1, 3 * GIB, WorkerState::Draining)
        );
        p.set_state("w", WorkerState::Ready);
        let a100 = Need {
            gpu_model: Some("a100".into()),
            ..need(0)
        };
        let h200 = Need {
            gpu_model: Some("h200".into()),
            ..need(0)
        };
        assert_eq!(chosen(&p, &a100, None), None, "the old GPU model is gone");
        assert_eq!(chosen(&p, &h200, None).as_deref(), Some("w"));
        assert_eq!(p.len(), 1);
        p.remove("w");
        assert!(p.is_empty());
        assert_eq!(chosen(&p, &h200, None), None);
    }

    #[test]
    fn a_report_over_capacity_leaves_no_room() {
        let mut p = Placement::new();
        p.upsert("w", cap(2, 4));
        p.report(
            "w",
            Load {
                busy: 5,
                reserved_memory: 9 * GIB,
                ..Load::default()
            },
        );
        assert_eq!(chosen(&p, &need(0), None), None);
        assert!(!p.reserve("w", 0));
        p.release("w", 8 * GIB);
        assert_eq!(chosen(&p, &need(0), None), None, "4 busy of 2 slots");
        p.report("w", Load::default());
        assert_eq!(chosen(&p, &need(4), None).as_deref(), Some("w"));
    }

    #[test]
    fn considered_counts_candidates_examined_not_the_fleet() {
        let mut p = Placement::new();
        for i in 0..10_000 {
            p.upsert(&format!("w{i:05}"), cap(8, 16));
        }
        // 9,990 full, 10 draining: the index holds neither.
        for i in 0..9_990 {
            p.report(
                &format!("w{i:05}"),
                Load {
                    busy: 8,
                    reserved_memory: 0,
                    ..Load::default()
                },
            );
        }
        for i in 9_990..10_000 {
            p.set_state(&format!("w{i:05}"), WorkerState::Draining);
        }
        p.set_state("w09999", WorkerState::Ready);
        let c = p.choose(&need(1), None).unwrap();
        assert_eq!((c.worker.as_str(), c.considered), ("w09999", 1));
        // 1,000 workers with room, same free slots, all short of memory but one with less
        // free slots: one seek skips the whole run.
        let mut q = Placement::new();
        for i in 0..1_000 {
            q.upsert(&format!("s{i:04}"), cap(8, 2));
        }
        q.upsert("roomy", cap(4, 64));
        let c = q.choose(&need(8), None).unwrap();
        assert_eq!((c.worker.as_str(), c.considered), ("roomy", 2));
        assert_eq!(q.choose(&need(100), None), None);
        // A rare label: its own set, one look.
        q.upsert("zoned", labelled(1, 1, &[("zone", "z")]));
        let with = |labels: &[(&str, &str)]| Need {
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..need(0)
        };
        let c = q.choose(&with(&[("zone", "z")]), None).unwrap();
        assert_eq!((c.worker.as_str(), c.considered), ("zoned", 1));
        // A label or GPU model nobody has (no set for it): refused, even past a preferred worker.
        assert_eq!(q.choose(&with(&[("zone", "nowhere")]), None), None);
        let b200 = Need {
            gpu_model: Some("b200".into()),
            ..need(0)
        };
        assert_eq!(q.choose(&b200, Some("roomy")).map(|c| c.considered), None);
        // Two common labels that meet on one worker, last in order: the smaller set is walked
        // and every worker skipped in it counts.
        let mut r = Placement::new();
        for i in 0..300 {
            r.upsert(&format!("r{i:03}"), labelled(8, 8, &[("rack", "1")]));
        }
        for i in 0..200 {
            r.upsert(&format!("z{i:03}"), labelled(8, 8, &[("zone", "a")]));
        }
        r.upsert("both", labelled(1, 1, &[("rack", "1"), ("zone", "a")]));
        let c = r
            .choose(&with(&[("rack", "1"), ("zone", "a")]), None)
            .unwrap();
        assert_eq!((c.worker.as_str(), c.considered), ("both", 201));
        r.check_invariants().unwrap();
        q.check_invariants().unwrap();
    }

    #[test]
    fn worker_state_names() {
        for (state, name) in [
            (WorkerState::Ready, "ready"),
            (WorkerState::Draining, "draining"),
            (WorkerState::Lost, "lost"),
        ] {
            assert_eq!(state.to_string(), name);
            assert_eq!(
                serde_json::to_string(&state).unwrap(),
                format!("\"{name}\"")
            );
            assert_eq!(
                serde_json::from_str::<WorkerState>(&format!("\"{name}\"")).unwrap(),
                state
            );
            assert_eq!(name.parse::<WorkerState>(), Ok(state));
        }
        assert_eq!("Ready".parse::<WorkerState>(), Err(UnknownWorkerState));
    }

    // ---- The index against a linear scan of a naive model. ----

    const NAMES: [&str; 6] = ["a", "b", "c", "d", "e", "f"];
    const MODELS: [&str; 2] = ["h200", "a100"];

    #[derive(Debug, Clone)]
    enum Op {
        Upsert(usize, Capacity),
        Report(usize, Load),
        State(usize, WorkerState),
        Remove(usize),
        Reserve(usize, u64),
        Release(usize, u64),
        Place(Need, Option<usize>),
    }

    fn labels(zone: Option<String>, rack: Option<String>) -> BTreeMap<String, String> {
        let zone = zone.map(|z| ("zone".to_owned(), z));
        let rack = rack.map(|r| ("rack".to_owned(), r));
        zone.into_iter().chain(rack).collect()
    }

    fn capacity() -> impl Strategy<Value = Capacity> {
        (
            0u32..5,
            0u64..12,
            0u32..4,
            proptest::sample::subsequence(MODELS.to_vec(), 0..=2),
            proptest::option::of(prop_oneof!["x", "y"]),
            proptest::option::of(prop_oneof!["1", "2"]),
        )
            .prop_map(
                |(slots, memory_budget, cores, models, zone, rack)| Capacity {
                    slots,
                    memory_budget,
                    cores,
                    gpu_models: models.into_iter().map(String::from).collect(),
                    labels: labels(zone, rack),
                },
            )
    }

    fn op() -> impl Strategy<Value = Op> {
        let name = 0..NAMES.len();
        let state = prop_oneof![
            3 => Just(WorkerState::Ready),
            1 => Just(WorkerState::Draining),
            1 => Just(WorkerState::Lost),
        ];
        let need = (
            0u64..8,
            proptest::option::of(proptest::sample::select(MODELS.to_vec())),
            proptest::option::weighted(0.3, prop_oneof!["x", "y", "w"]),
            proptest::option::weighted(0.3, prop_oneof!["1", "2"]),
        )
            .prop_map(|(memory, model, zone, rack)| Need {
                memory,
                gpu_model: model.map(String::from),
                labels: labels(zone, rack),
            });
        prop_oneof![
            3 => (name.clone(), capacity()).prop_map(|(n, c)| Op::Upsert(n, c)),
            1 => (name.clone(), 0u32..6, 0u64..14, proptest::option::of(0u32..2600)).prop_map(
                |(n, busy, reserved_memory, cpu_idle_milli)| {
                    Op::Report(n, Load { busy, reserved_memory, cpu_idle_milli })
                }
            ),
            1 => (name.clone(), state).prop_map(|(n, s)| Op::State(n, s)),
            1 => name.clone().prop_map(Op::Remove),
            2 => (name.clone(), 0u64..6).prop_map(|(n, m)| Op::Reserve(n, m)),
            2 => (name.clone(), 0u64..6).prop_map(|(n, m)| Op::Release(n, m)),
            5 => (need, proptest::option::of(name)).prop_map(|(n, p)| Op::Place(n, p)),
        ]
    }

    /// The rules written as plainly as possible.
    #[derive(Default)]
    struct Model(BTreeMap<String, (Capacity, Load, WorkerState)>);

    impl Model {
        fn fits(&self, name: &str, need: &Need) -> bool {
            let Some((c, l, s)) = self.0.get(name) else {
                return false;
            };
            *s == WorkerState::Ready
                && l.busy < c.slots
                && c.memory_budget.saturating_sub(l.reserved_memory) >= need.memory
                && need
                    .gpu_model
                    .as_ref()
                    .is_none_or(|m| c.gpu_models.contains(m))
                && need.labels.iter().all(|(k, v)| c.labels.get(k) == Some(v))
        }

        fn choose(&self, need: &Need, prefer: Option<&str>) -> Option<String> {
            if let Some(p) = prefer.filter(|p| self.fits(p, need)) {
                return Some(p.to_owned());
            }
            self.0
                .iter()
                .filter(|(n, _)| self.fits(n, need))
                .max_by_key(|(n, (c, l, _))| {
                    let idle = l.cpu_idle_milli.unwrap_or(c.cores.max(1) * 1000);
                    (
                        idle / CPU_STEP_MILLI,
                        c.slots - l.busy,
                        c.memory_budget.saturating_sub(l.reserved_memory),
                        Reverse(n.as_str()),
                    )
                })
                .map(|(n, _)| n.clone())
        }

        fn reserve(&mut self, name: &str, memory: u64) -> bool {
            let fits = self.fits(
                name,
                &Need {
                    memory,
                    ..Need::default()
                },
            );
            if fits {
                let l = &mut self.0.get_mut(name).unwrap().1;
                l.busy += 1;
                l.reserved_memory += memory;
                l.cpu_idle_milli = l.cpu_idle_milli.map(|c| c.saturating_sub(START_CPU_MILLI));
            }
            fits
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn the_index_chooses_what_a_linear_scan_chooses(ops in proptest::collection::vec(op(), 1..80)) {
            let mut p = Placement::new();
            let mut m = Model::default();
            for op in ops {
                match op {
                    Op::Upsert(n, c) => {
                        p.upsert(NAMES[n], c.clone());
                        let e = m.0.entry(NAMES[n].to_owned())
                            .or_insert((c.clone(), Load::default(), WorkerState::Ready));
                        e.0 = c;
                    }
                    Op::Report(n, l) => {
                        p.report(NAMES[n], l);
                        if let Some(e) = m.0.get_mut(NAMES[n]) {
                            let most = e.0.cores.max(1) * 1000;
                            e.1 = Load { cpu_idle_milli: l.cpu_idle_milli.map(|c| c.min(most)), ..l };
                        }
                    }
                    Op::State(n, s) => {
                        let known = m.0.contains_key(NAMES[n]);
                        prop_assert_eq!(p.set_state(NAMES[n], s), known);
                        if let Some(e) = m.0.get_mut(NAMES[n]) {
                            e.2 = s;
                        }
                    }
                    Op::Remove(n) => {
                        p.remove(NAMES[n]);
                        m.0.remove(NAMES[n]);
                    }
                    Op::Reserve(n, mem) => {
                        let before = p.get(NAMES[n]);
                        let took = p.reserve(NAMES[n], mem);
                        prop_assert_eq!(took, m.reserve(NAMES[n], mem));
                        if !took {
                            prop_assert_eq!(p.get(NAMES[n]), before, "a refused reserve takes nothing");
                        }
                    }
                    Op::Release(n, mem) => {
                        p.release(NAMES[n], mem);
                        if let Some(e) = m.0.get_mut(NAMES[n]) {
                            e.1.busy = e.1.busy.saturating_sub(1);
                            e.1.reserved_memory = e.1.reserved_memory.saturating_sub(mem);
                        }
                    }
                    Op::Place(need, prefer) => {
                        let prefer = prefer.map(|i| NAMES[i]);
                        let want = m.choose(&need, prefer);
                        let got = p.choose(&need, prefer);
                        prop_assert_eq!(got.as_ref().map(|c| c.worker.clone()), want.clone());
                        if let Some(c) = &got {
                            let ready = m.0.values().filter(|w| w.2 == WorkerState::Ready).count();
                            prop_assert!(c.considered >= 1);
                            prop_assert!(c.considered <= ready + usize::from(prefer.is_some()));
                        }
                        let placed = p.place(&need, prefer);
                        prop_assert_eq!(placed, got);
                        if let Some(w) = &want {
                            prop_assert!(m.reserve(w, need.memory));
                        }
                    }
                }
                p.check_invariants().map_err(TestCaseError::fail)?;
                prop_assert_eq!(p.len(), m.0.len());
                for name in NAMES {
                    prop_assert_eq!(p.get(name), m.0.get(name).cloned());
                }
            }
        }
    }
}
