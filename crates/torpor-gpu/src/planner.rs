//! The allocator: a pure planner over a snapshot of one node.
//!
//! `(inventory, ledger, request, policy, quotas) -> Plan | Refusal`. The planner never
//! changes the ledger; [`commit`] applies a plan, all or nothing. Decisions are deterministic:
//! GPUs are visited in index order and ties keep the first candidate.
//!
//! It is one file of about 1,000 lines on purpose: every placement rule (MIG geometry, MPS and
//! time-slice shares, topology, quotas) meets in one ordered search that reads top to bottom;
//! splitting it would scatter that order across modules.
//!
//! How a placement is chosen:
//! 1. The request's shape is checked, then what no GPU of the node could ever satisfy
//!    (unknown profile, MIG on a node without MIG, more memory than any GPU, ...).
//! 2. A depth-first search places the members of a gang one after the other on a tentative
//!    copy of the per-GPU usage, rolling back each tentative placement when it backtracks.
//!    The objective is the sum of pairwise topology scores of every device of the gang,
//!    then the policy's preference (binpack: fuller GPUs and no mode change first; spread:
//!    emptier GPUs first), then, for MIG, the layout that keeps larger profiles placeable.
//!    The search is bounded by [`Policy::search_budget`] and prunes branches that cannot
//!    beat the best score found.
//! 3. Quotas are checked on the chosen shares. When nothing fits and the requester is
//!    within its guarantee, allocations of tenants above theirs are evicted (newest first,
//!    fewest needed) and the search runs again.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ids::{AllocationId, GpuIndex, TenantId};
use crate::inventory::{Gpu, Inventory};
use crate::ledger::{resolve_profile, GpuReason, GpuUsage, Ledger, LedgerError, Share, ShareKind};
use crate::mig::MigInstance;
use crate::partition::PartitionMode;
use crate::quota::{share_charge, Amount, QuotaBook, QuotaError, Standing};
use crate::request::{GangRequest, GpuRequest, RequestError};
use crate::topology::SCORE_SAME_GPU;

/// How to choose between GPUs that fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// Fill partly used GPUs first, keeping whole GPUs free.
    #[default]
    Binpack,
    /// Use the emptiest GPU first, spreading load.
    Spread,
}

/// Where on a GPU a MIG instance goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MigPacking {
    /// The start that keeps the largest profiles placeable.
    #[default]
    FragmentationAware,
    /// The lowest allowed start: the baseline for density comparisons.
    FirstFit,
}

/// Knobs of the planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Policy {
    pub strategy: Strategy,
    pub mig_packing: MigPacking,
    /// Whether an empty GPU may be switched to the mode a request needs.
    pub allow_mode_change: bool,
    /// Search nodes visited at most per decision.
    pub search_budget: u32,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            strategy: Strategy::Binpack,
            mig_packing: MigPacking::FragmentationAware,
            allow_mode_change: true,
            search_budget: 50_000,
        }
    }
}

impl Policy {
    pub fn spread() -> Self {
        Policy {
            strategy: Strategy::Spread,
            ..Policy::default()
        }
    }
}

/// Why one GPU cannot take a share.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuRefusal {
    pub gpu: GpuIndex,
    pub code: &'static str,
    pub message: String,
}

impl GpuRefusal {
    fn new(gpu: GpuIndex, reason: &GpuReason) -> Self {
        GpuRefusal {
            gpu,
            code: reason.code(),
            message: reason.to_string(),
        }
    }
}

fn list_gpus(gpus: &[GpuRefusal]) -> String {
    gpus.iter()
        .map(|g| format!("{}: {}", g.gpu, g.message))
        .collect::<Vec<_>>()
        .join("; ")
}

/// A reasoned refusal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("no GPU of model {model:?} on this node")]
    ModelNotPresent { model: String },
    #[error("no GPU on this node has MIG with known geometry")]
    NoMigGpu,
    #[error("profile {profile:?} is unknown for every MIG model on this node ({models})")]
    UnknownProfile { profile: String, models: String },
    #[error("{what} of {wanted} is larger than any GPU on this node (largest {largest})")]
    LargerThanAnyGpu {
        what: &'static str,
        wanted: u64,
        largest: u64,
    },
    #[error("{wanted} devices asked but the node has {gpus} GPUs")]
    NotEnoughGpus { wanted: u32, gpus: usize },
    #[error(transparent)]
    Quota(#[from] QuotaError),
    #[error("only {fit} of the {wanted} GPUs needed can take the share: {}", list_gpus(.gpus))]
    NoCapacity {
        wanted: u32,
        fit: usize,
        gpus: Vec<GpuRefusal>,
    },
    #[error("{fit} GPUs can take the share but no {wanted} of them satisfy {constraint}")]
    Topology {
        constraint: &'static str,
        wanted: u32,
        fit: usize,
    },
    #[error("gang of {members}: only {placed} members could be placed together; member {placed}: {blocking}")]
    Gang {
        members: usize,
        placed: usize,
        blocking: Box<Refusal>,
    },
    #[error("the search budget ran out before any placement was found")]
    BudgetExhausted,
    #[error("the plan could not be committed: {0}")]
    Commit(#[from] LedgerError),
    #[error("the ledger tracks {ledger} GPUs but the inventory has {inventory}")]
    LedgerMismatch { ledger: usize, inventory: usize },
}

impl Refusal {
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::Request(e) => e.code(),
            Refusal::ModelNotPresent { .. } => "model_not_present",
            Refusal::NoMigGpu => "no_mig_gpu",
            Refusal::UnknownProfile { .. } => "unknown_profile",
            Refusal::LargerThanAnyGpu { .. } => "larger_than_any_gpu",
            Refusal::NotEnoughGpus { .. } => "not_enough_gpus",
            Refusal::Quota(e) => e.code(),
            Refusal::NoCapacity { .. } => "no_capacity",
            Refusal::Topology { .. } => "topology_unsatisfiable",
            Refusal::Gang { .. } => "gang_unplaceable",
            Refusal::BudgetExhausted => "search_budget_exhausted",
            Refusal::Commit(_) => "commit_failed",
            Refusal::LedgerMismatch { .. } => "ledger_mismatch",
        }
    }

    /// `{code, message}` as the CLI and APIs print it.
    pub fn report(&self) -> RefusalReport {
        RefusalReport {
            code: self.code(),
            message: self.to_string(),
        }
    }
}

/// A refusal as it goes on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RefusalReport {
    pub code: &'static str,
    pub message: String,
}

/// A GPU switched to another mode by a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ModeChange {
    pub gpu: GpuIndex,
    pub from: PartitionMode,
    pub to: PartitionMode,
}

/// The shares planned for one member of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberPlan {
    pub request: GpuRequest,
    pub shares: Vec<Share>,
    pub standing: Standing,
}

/// A placement: what to allocate, what to evict first, which GPUs change mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub members: Vec<MemberPlan>,
    pub evictions: Vec<AllocationId>,
    pub mode_changes: Vec<ModeChange>,
    /// Sum of pairwise topology scores of every device of the plan.
    pub topology_score: u64,
}

impl Plan {
    /// Every share of the plan, member after member.
    pub fn shares(&self) -> impl Iterator<Item = &Share> {
        self.members.iter().flat_map(|m| m.shares.iter())
    }
}

/// Plans one request.
pub fn plan(
    inventory: &Inventory,
    ledger: &Ledger,
    request: &GpuRequest,
    policy: &Policy,
    quotas: &QuotaBook,
) -> Result<Plan, Refusal> {
    let gang = GangRequest {
        members: vec![request.clone()],
    };
    plan_gang(inventory, ledger, &gang, policy, quotas).map_err(|refusal| match refusal {
        Refusal::Gang { blocking, .. } => *blocking,
        Refusal::Request(RequestError::Member { source, .. }) => Refusal::Request(*source),
        other => other,
    })
}

/// Plans a gang: every member lands, or none does.
pub fn plan_gang(
    inventory: &Inventory,
    ledger: &Ledger,
    gang: &GangRequest,
    policy: &Policy,
    quotas: &QuotaBook,
) -> Result<Plan, Refusal> {
    gang.validate()?;
    if ledger.usage().len() != inventory.gpus().len() {
        return Err(Refusal::LedgerMismatch {
            ledger: ledger.usage().len(),
            inventory: inventory.gpus().len(),
        });
    }
    for request in &gang.members {
        check_node_can_ever_fit(inventory, request)?;
    }
    let first = search(inventory, ledger.usage(), &gang.members, policy);
    let refusal = match first {
        Ok(found) => return finish(inventory, ledger, gang, found, Vec::new(), quotas),
        Err(refusal) => refusal,
    };
    if !quotas.enforced() {
        return Err(refusal);
    }
    // Reclaim: only a requester that stays within its guarantee may evict borrowers.
    let tenants: Vec<&TenantId> = gang
        .members
        .iter()
        .filter_map(|m| m.tenant.as_ref())
        .collect();
    if tenants.len() != gang.members.len() {
        return Err(refusal);
    }
    let victims = quotas.reclaimable(inventory, ledger, &tenants);
    let mut scratch = ledger.clone();
    let mut evicted = Vec::new();
    let mut found = None;
    for victim in victims {
        if scratch.release(victim).is_err() {
            continue;
        }
        evicted.push(victim);
        if let Ok(f) = search(inventory, scratch.usage(), &gang.members, policy) {
            found = Some(f);
            break;
        }
    }
    let Some(mut found) = found else {
        return Err(refusal);
    };
    // Keep only the evictions the placement needs.
    let mut needed = evicted.clone();
    for candidate in evicted {
        let trial: Vec<AllocationId> = needed.iter().copied().filter(|v| *v != candidate).collect();
        let mut trial_ledger = ledger.clone();
        if trial.iter().any(|v| trial_ledger.release(*v).is_err()) {
            continue;
        }
        if let Ok(f) = search(inventory, trial_ledger.usage(), &gang.members, policy) {
            needed = trial;
            found = f;
        }
    }
    match finish(inventory, ledger, gang, found, needed, quotas) {
        Ok(plan)
            if plan
                .members
                .iter()
                .all(|m| m.standing == Standing::Guaranteed) =>
        {
            Ok(plan)
        }
        // A borrower may not evict other borrowers; nor may a request its quota refuses.
        _ => Err(refusal),
    }
}

/// Applies a plan to the ledger: evictions, then every member. All or nothing.
pub fn commit(
    inventory: &Inventory,
    ledger: &mut Ledger,
    plan: &Plan,
    policy: &Policy,
) -> Result<Vec<AllocationId>, LedgerError> {
    let mut next = ledger.clone();
    for victim in &plan.evictions {
        next.release(*victim)?;
    }
    let mut ids = Vec::with_capacity(plan.members.len());
    for member in &plan.members {
        ids.push(next.insert(
            inventory,
            member.request.clone(),
            member.shares.clone(),
            policy.allow_mode_change,
        )?);
    }
    *ledger = next;
    Ok(ids)
}

fn check_node_can_ever_fit(inventory: &Inventory, request: &GpuRequest) -> Result<(), Refusal> {
    let gpus: Vec<&Gpu> = inventory
        .gpus()
        .iter()
        .filter(|g| request.model.as_ref().is_none_or(|m| &g.model == m))
        .collect();
    if gpus.is_empty() {
        return Err(Refusal::ModelNotPresent {
            model: request.model.clone().unwrap_or_default(),
        });
    }
    if request.count as usize > gpus.len() {
        return Err(Refusal::NotEnoughGpus {
            wanted: request.count,
            gpus: gpus.len(),
        });
    }
    let largest = gpus.iter().map(|g| g.memory_mib).max().unwrap_or(0);
    match request.mode {
        PartitionMode::Mig => {
            let mig: Vec<&&Gpu> = gpus.iter().filter(|g| g.mig_ready()).collect();
            if mig.is_empty() {
                return Err(Refusal::NoMigGpu);
            }
            let resolvable = mig.iter().any(|g| {
                g.mig_geometry.as_deref().is_some_and(|geometry| {
                    resolve_profile(
                        geometry,
                        request.profile.as_deref(),
                        request.memory_mib,
                        g.memory_mib,
                    )
                    .is_ok()
                })
            });
            if !resolvable {
                if let Some(profile) = &request.profile {
                    let mut models: Vec<&str> = mig
                        .iter()
                        .filter_map(|g| g.mig_geometry.as_deref().map(|m| m.label()))
                        .collect();
                    models.dedup();
                    return Err(Refusal::UnknownProfile {
                        profile: profile.clone(),
                        models: models.join(", "),
                    });
                }
                let largest_instance = mig.iter().map(|g| g.memory_mib).max().unwrap_or(0);
                return Err(Refusal::LargerThanAnyGpu {
                    what: "MIG memory_mib",
                    wanted: request.memory_mib.unwrap_or(0),
                    largest: largest_instance,
                });
            }
        }
        PartitionMode::Mps => {
            if let Some(wanted) = request.memory_mib {
                if wanted > largest {
                    return Err(Refusal::LargerThanAnyGpu {
                        what: "memory_mib",
                        wanted,
                        largest,
                    });
                }
            }
        }
        PartitionMode::Whole | PartitionMode::Timeslice => {}
    }
    Ok(())
}

/// Tentative per-GPU usage with an undo log: checkpoint, try, roll back.
struct Tentative {
    usage: Vec<GpuUsage>,
    undo: Vec<(usize, GpuUsage)>,
}

impl Tentative {
    fn new(usage: &[GpuUsage]) -> Self {
        Tentative {
            usage: usage.to_vec(),
            undo: Vec::new(),
        }
    }

    fn checkpoint(&self) -> usize {
        self.undo.len()
    }

    fn place(&mut self, gpu: &Gpu, kind: &ShareKind, allow_change: bool) -> Result<(), GpuReason> {
        let i = gpu.index.0 as usize;
        let before = self.usage[i].clone();
        self.usage[i].add(gpu, kind, allow_change)?;
        self.undo.push((i, before));
        Ok(())
    }

    fn rollback(&mut self, checkpoint: usize) {
        while self.undo.len() > checkpoint {
            if let Some((i, before)) = self.undo.pop() {
                self.usage[i] = before;
            }
        }
    }
}

/// The share `request` would get on `gpu` as it is now, and the preference for it.
fn fit(
    gpu: &Gpu,
    usage: &GpuUsage,
    request: &GpuRequest,
    policy: &Policy,
) -> Result<(ShareKind, (i64, i64)), GpuReason> {
    if let Some(model) = &request.model {
        if &gpu.model != model {
            return Err(GpuReason::ModelMismatch {
                wanted: model.clone(),
                found: gpu.model.clone(),
            });
        }
    }
    usage.check_mode(gpu, request.mode, policy.allow_mode_change)?;
    let same_mode = usage.mode == request.mode;
    let mut secondary = 0i64;
    let kind = match request.mode {
        PartitionMode::Whole => ShareKind::Whole,
        PartitionMode::Timeslice => ShareKind::Timeslice,
        PartitionMode::Mps => {
            let compute_pct = request.compute_pct.unwrap_or(100);
            let memory_mib = request
                .memory_mib
                .unwrap_or(gpu.memory_mib * u64::from(compute_pct) / 100);
            if memory_mib > gpu.memory_mib {
                return Err(GpuReason::MemoryTooLarge {
                    total: gpu.memory_mib,
                    wanted: memory_mib,
                });
            }
            ShareKind::Mps {
                compute_pct,
                memory_mib,
            }
        }
        PartitionMode::Mig => {
            let geometry = gpu.mig_geometry.as_ref().ok_or(GpuReason::NoMig)?;
            let profile = resolve_profile(
                geometry,
                request.profile.as_deref(),
                request.memory_mib,
                gpu.memory_mib,
            )?;
            let empty;
            let layout = match (&usage.mig, same_mode) {
                (Some(layout), true) => layout,
                _ => {
                    empty = crate::mig::MigLayout::empty(std::sync::Arc::clone(geometry));
                    &empty
                }
            };
            let start = match policy.mig_packing {
                MigPacking::FragmentationAware => layout.best_start(profile),
                MigPacking::FirstFit => layout.first_fit_start(profile),
            }
            .ok_or_else(|| GpuReason::MigNoPlacement {
                profile: profile.name.clone(),
            })?;
            let instance = MigInstance {
                profile_id: profile.id,
                start,
            };
            let after =
                layout
                    .capability_after(instance)
                    .ok_or_else(|| GpuReason::MigNoPlacement {
                        profile: profile.name.clone(),
                    })?;
            // At most 8 starts per profile and 16 profiles: base 9 keeps the order in an i64.
            secondary = after[..geometry.profiles().len().min(after.len())]
                .iter()
                .fold(0i64, |acc, n| acc * 9 + i64::from(*n));
            ShareKind::Mig { instance }
        }
    };
    usage.check_share(gpu, &kind)?;
    let fill = i64::from(if same_mode {
        usage.fill_permille(gpu)
    } else {
        0
    });
    let keeps_mode = i64::from(same_mode);
    let main = match policy.strategy {
        Strategy::Binpack => fill * 2 + keeps_mode,
        Strategy::Spread => -fill * 2 + keeps_mode,
    };
    Ok((kind, (main, secondary)))
}

struct Candidate {
    shares: Vec<Share>,
    topology_gain: u64,
    preference: (i64, i64),
}

struct Found {
    members: Vec<Vec<Share>>,
    topology_score: u64,
    final_usage: Vec<GpuUsage>,
}

/// The best complete placement so far: score, preference, shares per member, final usage.
type Best = (u64, (i64, i64), Vec<Vec<Share>>, Vec<GpuUsage>);

struct Search<'a> {
    inventory: &'a Inventory,
    members: &'a [GpuRequest],
    policy: &'a Policy,
    state: Tentative,
    chosen: Vec<Vec<Share>>,
    budget: u32,
    max_link_score: u64,
    best: Option<Best>,
    deepest: Option<(usize, Refusal)>,
}

/// Largest number of device sets considered for one member with `count > 1`.
const MAX_SETS_PER_MEMBER: usize = 256;
/// Enumerate all combinations up to this many; above it, grow sets greedily from each seed.
const MAX_COMBINATIONS: u64 = 5_000;

fn binomial(n: usize, k: usize) -> u64 {
    let mut result = 1u64;
    for i in 0..k.min(n) {
        result = result.saturating_mul((n - i) as u64) / (i as u64 + 1);
    }
    result
}

fn combinations(n: usize, k: usize, out: &mut Vec<Vec<usize>>) {
    fn go(start: usize, n: usize, k: usize, current: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if current.len() == k {
            out.push(current.clone());
            return;
        }
        for i in start..n {
            if n - i < k - current.len() {
                break;
            }
            current.push(i);
            go(i + 1, n, k, current, out);
            current.pop();
        }
    }
    go(0, n, k, &mut Vec::with_capacity(k), out);
}

impl Search<'_> {
    fn placed_gpus(&self) -> impl Iterator<Item = GpuIndex> + '_ {
        self.chosen.iter().flatten().map(|s| s.gpu)
    }

    fn satisfies(&self, request: &GpuRequest, set: &[GpuIndex]) -> Result<(), &'static str> {
        let all: Vec<GpuIndex> = self.placed_gpus().chain(set.iter().copied()).collect();
        if request.same_nvlink_domain {
            for (i, a) in all.iter().enumerate() {
                if all[i + 1..]
                    .iter()
                    .any(|b| !self.inventory.nvlinked(*a, *b))
                {
                    return Err("same_nvlink_domain");
                }
            }
        }
        if request.numa_local {
            let mut numa = all
                .iter()
                .map(|g| self.inventory.gpu(*g).and_then(|g| g.numa_node));
            let first = numa.next().flatten();
            let distinct = all.iter().any(|g| *g != all[0]);
            if distinct && (first.is_none() || numa.any(|n| n != first)) {
                return Err("numa_local");
            }
        }
        Ok(())
    }

    fn gain(&self, set: &[GpuIndex]) -> u64 {
        let placed: Vec<GpuIndex> = self.placed_gpus().collect();
        let mut gain = 0u64;
        for (i, a) in set.iter().enumerate() {
            for b in placed.iter().chain(&set[i + 1..]) {
                gain += u64::from(self.inventory.pair_score(*a, *b));
            }
        }
        gain
    }

    /// Device sets member `index` could take now, best first.
    fn candidates(&self, index: usize) -> Result<Vec<Candidate>, Refusal> {
        let request = &self.members[index];
        let mut fits = Vec::new();
        let mut refused = Vec::new();
        for gpu in self.inventory.gpus() {
            match fit(
                gpu,
                &self.state.usage[gpu.index.0 as usize],
                request,
                self.policy,
            ) {
                Ok((kind, preference)) => fits.push((gpu.index, kind, preference)),
                Err(reason) => refused.push(GpuRefusal::new(gpu.index, &reason)),
            }
        }
        let count = request.count as usize;
        if fits.len() < count {
            return Err(Refusal::NoCapacity {
                wanted: request.count,
                fit: fits.len(),
                gpus: refused,
            });
        }
        let mut sets: Vec<Vec<usize>> = Vec::new();
        if binomial(fits.len(), count) <= MAX_COMBINATIONS {
            combinations(fits.len(), count, &mut sets);
        } else {
            // Greedy growth from each seed: add the GPU closest to the set so far.
            for seed in 0..fits.len() {
                let mut set = vec![seed];
                while set.len() < count {
                    let next = (0..fits.len())
                        .filter(|i| !set.contains(i))
                        .max_by_key(|i| {
                            let score: u64 = set
                                .iter()
                                .map(|s| {
                                    u64::from(self.inventory.pair_score(fits[*s].0, fits[*i].0))
                                })
                                .sum();
                            (score, std::cmp::Reverse(*i))
                        });
                    match next {
                        Some(i) => set.push(i),
                        None => break,
                    }
                }
                set.sort_unstable();
                if !sets.contains(&set) {
                    sets.push(set);
                }
            }
        }
        let mut constraint = None;
        let mut out: Vec<Candidate> = Vec::new();
        for set in sets {
            let gpus: Vec<GpuIndex> = set.iter().map(|i| fits[*i].0).collect();
            if let Err(c) = self.satisfies(request, &gpus) {
                constraint = Some(c);
                continue;
            }
            let preference = set.iter().fold((0i64, 0i64), |acc, i| {
                (acc.0 + fits[*i].2 .0, acc.1 + fits[*i].2 .1)
            });
            out.push(Candidate {
                topology_gain: self.gain(&gpus),
                shares: set
                    .iter()
                    .map(|i| Share {
                        gpu: fits[*i].0,
                        kind: fits[*i].1,
                    })
                    .collect(),
                preference,
            });
        }
        if out.is_empty() {
            return Err(Refusal::Topology {
                constraint: constraint.unwrap_or("topology"),
                wanted: request.count,
                fit: fits.len(),
            });
        }
        // Best first; the sort is stable, so equal candidates keep GPU-index order.
        out.sort_by_key(|c| std::cmp::Reverse((c.topology_gain, c.preference)));
        out.truncate(MAX_SETS_PER_MEMBER);
        Ok(out)
    }

    fn upper_bound(&self, from: usize) -> u64 {
        let placed = self.placed_gpus().count() as u64;
        let remaining: u64 = self.members[from..]
            .iter()
            .map(|m| u64::from(m.count))
            .sum();
        let fractional = self.members[from..]
            .iter()
            .any(|m| m.mode != PartitionMode::Whole);
        let per_pair = if fractional && remaining + placed > 1 {
            u64::from(SCORE_SAME_GPU)
        } else {
            self.max_link_score
        };
        let pairs = remaining * placed + remaining * remaining.saturating_sub(1) / 2;
        pairs * per_pair
    }

    fn run(&mut self, index: usize, score: u64, preference: (i64, i64)) {
        if self.budget == 0 {
            return;
        }
        self.budget -= 1;
        if index == self.members.len() {
            let better = match &self.best {
                None => true,
                Some((s, p, _, _)) => (score, preference) > (*s, *p),
            };
            if better {
                self.best = Some((
                    score,
                    preference,
                    self.chosen.clone(),
                    self.state.usage.clone(),
                ));
            }
            return;
        }
        if let Some((best, _, _, _)) = &self.best {
            if score + self.upper_bound(index) <= *best {
                return;
            }
        }
        let candidates = match self.candidates(index) {
            Ok(c) => c,
            Err(refusal) => {
                if self.deepest.as_ref().is_none_or(|(d, _)| index > *d) {
                    self.deepest = Some((index, refusal));
                }
                return;
            }
        };
        // Identical members are interchangeable: visit their GPUs in non-decreasing order
        // only, which removes permuted duplicates of the same placement from the search.
        let floor = match (index.checked_sub(1), self.chosen.last()) {
            (Some(prev), Some(shares)) if self.members[prev] == self.members[index] => {
                shares.first().map(|s| s.gpu)
            }
            _ => None,
        };
        for candidate in candidates {
            if let (Some(floor), Some(first)) = (floor, candidate.shares.first()) {
                if first.gpu < floor {
                    continue;
                }
            }
            let checkpoint = self.state.checkpoint();
            let mut placed = true;
            for share in &candidate.shares {
                let Some(gpu) = self.inventory.gpu(share.gpu) else {
                    placed = false;
                    break;
                };
                if self
                    .state
                    .place(gpu, &share.kind, self.policy.allow_mode_change)
                    .is_err()
                {
                    placed = false;
                    break;
                }
            }
            if placed {
                self.chosen.push(candidate.shares);
                self.run(
                    index + 1,
                    score + candidate.topology_gain,
                    (
                        preference.0 + candidate.preference.0,
                        preference.1 + candidate.preference.1,
                    ),
                );
                self.chosen.pop();
            }
            self.state.rollback(checkpoint);
            if self.budget == 0 {
                break;
            }
        }
    }
}

fn search(
    inventory: &Inventory,
    usage: &[GpuUsage],
    members: &[GpuRequest],
    policy: &Policy,
) -> Result<Found, Refusal> {
    let mut max_link_score = 0u64;
    for a in inventory.gpus() {
        for b in inventory.gpus() {
            if a.index != b.index {
                max_link_score =
                    max_link_score.max(u64::from(inventory.pair_score(a.index, b.index)));
            }
        }
    }
    let mut search = Search {
        inventory,
        members,
        policy,
        state: Tentative::new(usage),
        chosen: Vec::with_capacity(members.len()),
        budget: policy.search_budget.max(1),
        max_link_score,
        best: None,
        deepest: None,
    };
    search.run(0, 0, (0, 0));
    match search.best {
        Some((topology_score, _, members, final_usage)) => Ok(Found {
            members,
            topology_score,
            final_usage,
        }),
        None => {
            let (placed, blocking) = search.deepest.unwrap_or((0, Refusal::BudgetExhausted));
            Err(Refusal::Gang {
                members: members.len(),
                placed,
                blocking: Box::new(blocking),
            })
        }
    }
}

fn finish(
    inventory: &Inventory,
    ledger: &Ledger,
    gang: &GangRequest,
    found: Found,
    evictions: Vec<AllocationId>,
    quotas: &QuotaBook,
) -> Result<Plan, Refusal> {
    let mut holds: BTreeMap<TenantId, Amount> = QuotaBook::usage(inventory, ledger);
    for victim in &evictions {
        if let Some(a) = ledger.allocation(*victim) {
            if let Some(t) = &a.tenant {
                let charge = a
                    .shares
                    .iter()
                    .filter_map(|s| inventory.gpu(s.gpu).map(|g| share_charge(g, &s.kind)))
                    .fold(Amount::default(), Amount::plus);
                if let Some(h) = holds.get_mut(t) {
                    *h = h.saturating_sub(charge);
                }
            }
        }
    }
    let mut members = Vec::with_capacity(gang.members.len());
    for (request, shares) in gang.members.iter().zip(found.members) {
        let charge = shares
            .iter()
            .filter_map(|s| inventory.gpu(s.gpu).map(|g| share_charge(g, &s.kind)))
            .fold(Amount::default(), Amount::plus);
        let current = request
            .tenant
            .as_ref()
            .and_then(|t| holds.get(t).copied())
            .unwrap_or_default();
        let standing = quotas.admit(request.tenant.as_ref(), current, charge)?;
        if let Some(t) = &request.tenant {
            holds.insert(t.clone(), current.plus(charge));
        }
        members.push(MemberPlan {
            request: request.clone(),
            shares,
            standing,
        });
    }
    let mode_changes = ledger
        .usage()
        .iter()
        .zip(&found.final_usage)
        .enumerate()
        .filter(|(_, (before, after))| before.mode != after.mode)
        .map(|(i, (before, after))| ModeChange {
            gpu: GpuIndex(i as u32),
            from: before.mode,
            to: after.mode,
        })
        .collect();
    Ok(Plan {
        members,
        evictions,
        mode_changes,
        topology_score: found.topology_score,
    })
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Strategy::Binpack => "binpack",
            Strategy::Spread => "spread",
        })
    }
}

impl std::str::FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "binpack" => Ok(Strategy::Binpack),
            "spread" => Ok(Strategy::Spread),
            other => Err(format!(
                "unknown policy {other:?}; expected binpack or spread"
            )),
        }
    }
}

/// A plan's devices as `torpor gpu plan --json` prints them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacedDevice {
    pub gpu_index: u32,
    pub gpu_uuid: String,
    pub mode: PartitionMode,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compute_pct: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
}

/// Describes a share for output.
pub fn describe(inventory: &Inventory, share: &Share) -> PlacedDevice {
    let gpu = inventory.gpu(share.gpu);
    let mut device = PlacedDevice {
        gpu_index: share.gpu.0,
        gpu_uuid: gpu.map(|g| g.uuid.to_string()).unwrap_or_default(),
        mode: share.kind.mode(),
        profile: None,
        start: None,
        compute_pct: None,
        memory_mib: None,
    };
    match share.kind {
        ShareKind::Mig { instance } => {
            device.profile = gpu
                .and_then(|g| g.mig_geometry.as_deref())
                .and_then(|m| m.profile_by_id(instance.profile_id))
                .map(|p| p.name.clone());
            device.start = Some(instance.start);
        }
        ShareKind::Mps {
            compute_pct,
            memory_mib,
        } => {
            device.compute_pct = Some(compute_pct);
            device.memory_mib = Some(memory_mib);
        }
        ShareKind::Whole | ShareKind::Timeslice => {}
    }
    device
}
