//! The state store: everything the control plane keeps across restarts, behind one trait.
//!
//! [`StateStore`] owns all persistence of the control plane: templates, sandboxes (and their
//! network policies), tenants and their token hashes, pools, GPU shares, GPU requests and
//! `cuda-checkpoint` toggles, what each stored snapshot holds, and usage intervals. No other
//! module writes SQL or keeps state in files of its own; they call the store through a
//! [`Store`] handle, which is cheap to clone and shared by the engine, the GPU ledger, pools
//! and usage accounting.
//!
//! Two implementations: [`SqliteStore`] (embedded mode: one SQLite file, `torpor.db`, one
//! connection; [`Store::open`]) and [`PostgresStore`] (cluster mode: one PostgreSQL database
//! shared by every controller; [`Store::connect`]). Signatures hold the records of [`records`]
//! and typed ids, never a driver's types; an error is a [`StoreError`] whose
//! [`StoreErrorKind`] (not found, conflict, unavailable, corrupt) is all a caller decides on;
//! and no method relies on one backend's behaviour (each call is one atomic write or one
//! consistent read). The same test suite runs over both (`tests.rs`).
//!
//! Several controllers may act on one sandbox. [`StateStore::compare_and_set_sandbox`] writes
//! a sandbox only if its row is still at the [`Version`] the caller read (every write of the
//! row bumps it), and answers [`StoreErrorKind::Conflict`] otherwise; on PostgreSQL it is one
//! `UPDATE … WHERE id=$1 AND version=$2`. Embedded mode serialises a sandbox's transitions in
//! the engine and does not call it yet.
//!
//! The trait is synchronous: each call is one short statement or transaction (tens of
//! microseconds on SQLite, a round trip on PostgreSQL, which runs its calls on a runtime of its
//! own), made from the engine without an `.await` between read and write.

use std::collections::{BTreeMap, HashMap};
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use torpor_core::{
    NetworkPolicy, PoolName, SandboxId, SandboxState, TemplateName, TenantId, Tier, UnixMillis,
};
use torpor_gpu::cuda_checkpoint::Toggled;
use torpor_gpu::request::GpuRequest;

mod gpu_files;
mod pg_schema;
/// A real PostgreSQL server for tests (this crate's, and others' with the `testing` feature).
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub mod pg_testing;
mod postgres;
pub mod records;
mod schema;
mod sqlite;
#[cfg(test)]
mod tests;

pub use postgres::PostgresStore;
pub use records::{
    ImageRef, MigRecord, PoolRow, Quotas, SandboxRecord, ShareRecord, TemplateRecord,
    TemplateStatus, TenantRecord, Usage, UsageInterval, Version,
};
pub use sqlite::SqliteStore;

/// A sandbox's place in creation order: where a page of [`StateStore::sandboxes_page`]
/// resumes (the last sandbox of the previous page).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SandboxCursor {
    pub created_at: UnixMillis,
    pub id: SandboxId,
}

impl SandboxCursor {
    /// The cursor just past `s`.
    pub fn of(s: &SandboxRecord) -> SandboxCursor {
        SandboxCursor {
            created_at: s.created_at,
            id: s.id.clone(),
        }
    }
}

/// A backend's own failure (driver error, I/O), kept as the source of a [`StoreError`].
pub type BackendError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What sort of store failure an error is; callers decide on this, never on the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoreErrorKind {
    /// The record an operation needs does not exist.
    NotFound,
    /// The record changed since it was read (a compare-and-set lost).
    Conflict,
    /// The store cannot be reached or used now (I/O, locked, a schema this build cannot read).
    Unavailable,
    /// The store holds something this build cannot parse.
    Corrupt,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state store {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: BackendError,
    },
    #[error("state store {path}: schema version {found} is newer than this torpor understands ({supported})")]
    NewerSchema {
        path: PathBuf,
        found: i64,
        supported: i64,
    },
    #[error("state store {target}: cannot connect or migrate")]
    Connect {
        /// The database, without its password.
        target: String,
        #[source]
        source: BackendError,
    },
    #[error("state store {target}: schema version {found} is newer than this torpor understands ({supported})")]
    NewerSchemaAt {
        target: String,
        found: i64,
        supported: i64,
    },
    #[error("state store: {op}")]
    Unavailable {
        op: &'static str,
        #[source]
        source: BackendError,
    },
    #[error("state store has no {what} {key}")]
    NotFound { what: &'static str, key: String },
    #[error("state store: {what} {key} changed since version {expected} was read")]
    Conflict {
        what: &'static str,
        key: String,
        expected: Version,
    },
    #[error("state store holds a malformed {what} row {key}")]
    Corrupt { what: &'static str, key: String },
    #[error("state store env key")]
    EnvKey(#[from] crate::secrets::SealError),
}

impl StoreError {
    pub fn kind(&self) -> StoreErrorKind {
        match self {
            StoreError::Open { .. }
            | StoreError::Connect { .. }
            | StoreError::NewerSchema { .. }
            | StoreError::NewerSchemaAt { .. }
            | StoreError::Unavailable { .. }
            | StoreError::EnvKey(_) => StoreErrorKind::Unavailable,
            StoreError::NotFound { .. } => StoreErrorKind::NotFound,
            StoreError::Conflict { .. } => StoreErrorKind::Conflict,
            StoreError::Corrupt { .. } => StoreErrorKind::Corrupt,
        }
    }
}

/// Everything the control plane persists. See the module doc for what a backend must keep.
///
/// Writes that take a whole record (`update_*`) write every mutable field and leave a missing
/// row missing (a concurrent delete wins). Lookups answer `None` for a missing record.
pub trait StateStore: Send + Sync {
    // --- templates, keyed by (owner, name) ---

    /// Inserts a template; false when its owner already has one of that name.
    fn insert_template(&self, t: &TemplateRecord) -> Result<bool, StoreError>;
    /// Writes a template's status, mounts, agent dir, golden size and spec.
    fn update_template(&self, t: &TemplateRecord) -> Result<(), StoreError>;
    fn delete_template(&self, owner: &TenantId, name: &TemplateName) -> Result<(), StoreError>;
    /// The template `owner` has under `name`.
    fn template(
        &self,
        owner: &TenantId,
        name: &TemplateName,
    ) -> Result<Option<TemplateRecord>, StoreError>;
    /// Every template, by name.
    fn templates(&self) -> Result<Vec<TemplateRecord>, StoreError>;

    /// The template `name` means for `tenant`: its own, else the operator's.
    fn template_for(
        &self,
        tenant: &TenantId,
        name: &TemplateName,
    ) -> Result<Option<TemplateRecord>, StoreError> {
        match self.template(tenant, name)? {
            Some(t) => Ok(Some(t)),
            None => self.template(&TenantId::admin(), name),
        }
    }

    // --- sandboxes ---

    /// Inserts a new sandbox (at version 0); a taken id is an error.
    fn insert_sandbox(&self, s: &SandboxRecord) -> Result<(), StoreError>;
    /// Writes every mutable field of a sandbox (state, tier, activity, generation, image,
    /// error, OOM flag) and bumps its version.
    fn update_sandbox(&self, s: &SandboxRecord) -> Result<(), StoreError>;
    /// Writes what [`StateStore::update_sandbox`] writes only if the row is still at
    /// `expected`; answers the new version, [`StoreErrorKind::Conflict`] when the row moved on,
    /// [`StoreErrorKind::NotFound`] when it is gone.
    fn compare_and_set_sandbox(
        &self,
        s: &SandboxRecord,
        expected: Version,
    ) -> Result<Version, StoreError>;
    /// A sandbox and the version of its row.
    fn sandbox_versioned(
        &self,
        id: &SandboxId,
    ) -> Result<Option<(SandboxRecord, Version)>, StoreError>;
    /// Replaces a sandbox's metadata (and nothing else, so it cannot undo a concurrent state
    /// change). Used by the E2B adapter for its lifecycle keys.
    fn set_sandbox_metadata(
        &self,
        id: &SandboxId,
        metadata: &BTreeMap<String, String>,
    ) -> Result<(), StoreError>;
    /// Moves `last_active_at` forward (never back), all in one write.
    fn touch_sandboxes(&self, touched: &[(SandboxId, UnixMillis)]) -> Result<(), StoreError>;
    /// [`StateStore::compare_and_set_sandbox`] that also records the worker process the
    /// sandbox's container now runs on (cluster mode), in the same write: no other writer sees
    /// the state without the node, and a write that lost the race records neither. A store
    /// that does not keep nodes (SQLite: one machine) writes the record alone.
    fn compare_and_set_sandbox_on(
        &self,
        s: &SandboxRecord,
        expected: Version,
        node: &str,
    ) -> Result<Version, StoreError> {
        let v = self.compare_and_set_sandbox(s, expected)?;
        self.set_sandbox_node(&s.id, Some(node))?;
        Ok(v)
    }
    /// Cluster mode: the worker process a resident sandbox's container runs on, without a
    /// version bump (tests and repairs; a transition writes it with its state,
    /// [`StateStore::compare_and_set_sandbox_on`]). A store that does not keep it (SQLite: one
    /// machine) keeps nothing.
    fn set_sandbox_node(&self, _id: &SandboxId, _node: Option<&str>) -> Result<(), StoreError> {
        Ok(())
    }
    /// Every sandbox with a recorded worker, in one read (a restarted controller's start).
    fn sandbox_nodes(&self) -> Result<HashMap<SandboxId, String>, StoreError> {
        Ok(HashMap::new())
    }
    /// The worker recorded for sandbox `id`, if any.
    fn sandbox_node(&self, id: &SandboxId) -> Result<Option<String>, StoreError> {
        Ok(self.sandbox_nodes()?.remove(id))
    }
    /// Deletes a sandbox and its network policy.
    fn delete_sandbox(&self, id: &SandboxId) -> Result<(), StoreError>;
    /// Every sandbox, oldest first.
    fn sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError>;
    /// Sandboxes made from `owner`'s template `name`: the owner's own, or for an operator
    /// template, every tenant's that has no template of that name itself.
    fn count_sandboxes_of_template(
        &self,
        owner: &TenantId,
        name: &TemplateName,
    ) -> Result<u64, StoreError>;

    fn sandbox(&self, id: &SandboxId) -> Result<Option<SandboxRecord>, StoreError> {
        Ok(self.sandbox_versioned(id)?.map(|(s, _)| s))
    }
    /// The records of those of `ids` that exist, in one read where the store can.
    fn sandboxes_by_id(&self, ids: &[SandboxId]) -> Result<Vec<SandboxRecord>, StoreError> {
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            out.extend(self.sandbox(id)?);
        }
        Ok(out)
    }

    /// Every sandbox whose metadata has `key`, oldest first (E2B's deadline sweep, every
    /// second, reads only those). The stores match the key's JSON text before parsing a row.
    fn sandboxes_with_metadata(&self, key: &str) -> Result<Vec<SandboxRecord>, StoreError> {
        let mut all = self.sandboxes()?;
        all.retain(|s| s.metadata.contains_key(key));
        Ok(all)
    }

    /// A tenant's sandboxes, oldest first (a store of many tenants answers from an index).
    fn sandboxes_of(&self, tenant: &TenantId) -> Result<Vec<SandboxRecord>, StoreError> {
        let mut all = self.sandboxes()?;
        all.retain(|s| s.tenant == *tenant);
        Ok(all)
    }

    /// One page of sandboxes in creation order (`created_at`, then `id`): those after `after`
    /// (exclusive; from the first when `None`), at most `limit`, only `tenant`'s when given,
    /// and only those whose state or tier is `state` when given. A keyset page: each backend
    /// answers it from an index on `(created_at, id)` (or `(tenant, created_at, id)`), so a
    /// page costs the same at the millionth row as at the first; never an `OFFSET`.
    fn sandboxes_page(
        &self,
        tenant: Option<&TenantId>,
        state: Option<&str>,
        after: Option<&SandboxCursor>,
        limit: usize,
    ) -> Result<Vec<SandboxRecord>, StoreError> {
        let mut all = match tenant {
            Some(t) => self.sandboxes_of(t)?,
            None => self.sandboxes()?,
        };
        all.retain(|s| {
            after.is_none_or(|a| SandboxCursor::of(s) > *a)
                && state.is_none_or(|w| s.state.as_str() == w || s.tier.as_str() == w)
        });
        all.sort_by_key(SandboxCursor::of);
        all.truncate(limit);
        Ok(all)
    }

    /// What the idle policy tends on each tick: every sandbox that is not asleep (resident or
    /// moving, whichever controller holds it), and Parked ones last active before
    /// `parked_before` (due for the snapshot store); oldest first. Sleeping sandboxes, usually
    /// nearly all of them, are not read.
    fn sandboxes_to_tend(
        &self,
        parked_before: UnixMillis,
    ) -> Result<Vec<SandboxRecord>, StoreError> {
        let mut all = self.sandboxes()?;
        all.retain(|s| match s.state {
            SandboxState::Suspended => false,
            SandboxState::Parked => s.last_active_at < parked_before,
            _ => true,
        });
        Ok(all)
    }

    /// How many sandboxes are in each (state, tier).
    fn sandbox_counts(&self) -> Result<Vec<(SandboxState, Tier, u64)>, StoreError> {
        let mut counts: std::collections::HashMap<(SandboxState, Tier), u64> = Default::default();
        for s in self.sandboxes()? {
            *counts.entry((s.state, s.tier)).or_default() += 1;
        }
        Ok(counts.into_iter().map(|((s, t), n)| (s, t, n)).collect())
    }

    // --- network policies of networked sandboxes ---

    fn set_network(&self, id: &SandboxId, policy: &NetworkPolicy) -> Result<(), StoreError>;
    /// The policy of a networked sandbox; `None` for one without network.
    fn network(&self, id: &SandboxId) -> Result<Option<NetworkPolicy>, StoreError>;

    // --- tenants and their tokens (stored as hashes only) ---

    /// Inserts a tenant; false when the name is taken.
    fn insert_tenant(&self, t: &TenantRecord, token_hash: &str) -> Result<bool, StoreError>;
    fn tenant_by_token_hash(&self, token_hash: &str) -> Result<Option<TenantId>, StoreError>;
    /// Every tenant, by id.
    fn tenants(&self) -> Result<Vec<TenantRecord>, StoreError>;
    fn tenant(&self, id: &TenantId) -> Result<Option<TenantRecord>, StoreError>;
    /// False when there was no such tenant.
    fn delete_tenant(&self, id: &TenantId) -> Result<bool, StoreError>;
    /// What a tenant holds: all its sandboxes, and those resident or becoming resident.
    fn usage(&self, tenant: &TenantId) -> Result<Usage, StoreError>;

    // --- what stored snapshots hold, for disk quotas (by snapshot id) ---

    /// Records a snapshot's checkpoint size on disk before deduplication.
    fn set_snapshot_bytes(&self, snapshot: &str, bytes: u64) -> Result<(), StoreError>;
    /// 0 for a snapshot never recorded.
    fn snapshot_bytes(&self, snapshot: &str) -> Result<u64, StoreError>;
    fn forget_snapshot_bytes(&self, snapshot: &str) -> Result<(), StoreError>;

    // --- pools, keyed by (tenant, name) ---

    /// Inserts a pool; false when its tenant already has one of that name.
    fn insert_pool(&self, p: &PoolRow) -> Result<bool, StoreError>;
    /// False when there was no such pool.
    fn delete_pool(&self, tenant: &TenantId, name: &PoolName) -> Result<bool, StoreError>;
    fn count_pools(&self, tenant: &TenantId) -> Result<u64, StoreError>;
    /// Every pool, by tenant and name.
    fn pools(&self) -> Result<Vec<PoolRow>, StoreError>;
    /// Every pool's tenant and name (without its spec), by tenant and name.
    fn pool_names(&self) -> Result<Vec<(TenantId, PoolName)>, StoreError> {
        Ok(self
            .pools()?
            .into_iter()
            .map(|p| (p.tenant, p.name))
            .collect())
    }

    // --- this node's GPU state, by sandbox ---

    /// Every stored GPU share; records that do not parse are logged and left out.
    fn gpu_shares(&self) -> Result<Vec<(SandboxId, ShareRecord)>, StoreError>;
    /// Records what `id` has now (replacing what it had).
    fn put_gpu_share(&self, id: &SandboxId, record: &ShareRecord) -> Result<(), StoreError>;
    fn delete_gpu_share(&self, id: &SandboxId) -> Result<(), StoreError>;
    /// Records a sandbox's GPU request (replacing an earlier one).
    fn put_gpu_request(&self, id: &SandboxId, request: &GpuRequest) -> Result<(), StoreError>;
    fn gpu_request(&self, id: &SandboxId) -> Result<Option<GpuRequest>, StoreError>;
    /// Removes a sandbox's GPU request; true when it had one.
    fn delete_gpu_request(&self, id: &SandboxId) -> Result<bool, StoreError>;
    /// Records that `id`'s checkpoint holds GPU state moved to host memory by `cuda-checkpoint`.
    fn put_gpu_toggled(&self, id: &SandboxId, toggled: &Toggled) -> Result<(), StoreError>;
    fn gpu_toggled(&self, id: &SandboxId) -> Result<Option<Toggled>, StoreError>;
    fn delete_gpu_toggled(&self, id: &SandboxId) -> Result<(), StoreError>;

    // --- controllers and leases (cluster mode; a store one process uses keeps the defaults) ---

    /// Records that controller `me`, in its run `run`, is alive and answers where it says
    /// until `ttl` from now (the store's clock), if its name is not held by another run:
    /// the row is taken when it is this run's, expired, or (`starting`) a previous run's that
    /// advertised the same addresses. False when another live run holds the name.
    fn claim_controller(
        &self,
        _me: &LiveController,
        _run: &str,
        _starting: bool,
        _ttl: Duration,
    ) -> Result<bool, StoreError> {
        Ok(true)
    }
    /// The controllers whose heartbeat has not expired, by name.
    fn live_controllers(&self) -> Result<Vec<LiveController>, StoreError> {
        Ok(Vec::new())
    }
    /// Appends what controller `me` let through since its last report (rate limits across
    /// controllers; rows with a zero count are not sent).
    fn put_rate_usage(&self, _me: &str, _usage: &[RateUsage]) -> Result<(), StoreError> {
        Ok(())
    }
    /// The other controllers' reports of the last `within` (the store's clock), oldest first.
    fn rate_usage_of_others(
        &self,
        _me: &str,
        _within: Duration,
    ) -> Result<Vec<RateReport>, StoreError> {
        Ok(Vec::new())
    }
    /// Removes reports older than `age`; how many went.
    fn prune_rate_usage(&self, _age: Duration) -> Result<u64, StoreError> {
        Ok(0)
    }
    /// Removes a controller's row if run `run` holds it (a clean stop: its sandboxes are
    /// taken over at once).
    fn forget_controller(&self, _name: &str, _run: &str) -> Result<(), StoreError> {
        Ok(())
    }
    /// Takes or renews lease `lease` for `holder` until `ttl` from now; false while another
    /// holder's lease has not expired.
    fn try_lease(&self, _lease: &str, _holder: &str, _ttl: Duration) -> Result<bool, StoreError> {
        Ok(true)
    }
    /// Gives a lease up if `holder` has it.
    fn release_lease(&self, _lease: &str, _holder: &str) -> Result<(), StoreError> {
        Ok(())
    }
    /// Passes lease `lease` from `from` to `to` until `ttl` from now, if `from` holds it (not
    /// expired); false otherwise (then nothing changed).
    fn pass_lease(
        &self,
        _lease: &str,
        _from: &str,
        _to: &str,
        _ttl: Duration,
    ) -> Result<bool, StoreError> {
        Ok(false)
    }
    /// The leases whose names start with `prefix` and that have not expired: `(name, holder)`.
    fn live_leases(&self, _prefix: &str) -> Result<Vec<(String, String)>, StoreError> {
        Ok(Vec::new())
    }
    /// [`StateStore::try_lease`] for each of `leases` in one statement: the names `holder`
    /// holds afterwards (taken when free or expired, renewed when its own).
    fn take_leases(
        &self,
        leases: &[String],
        _holder: &str,
        _ttl: Duration,
    ) -> Result<Vec<String>, StoreError> {
        Ok(leases.to_vec())
    }
    /// Holds `key` against every other process of this store until the guard drops (a
    /// PostgreSQL advisory lock: two controllers checking one tenant's quota take turns). Hold
    /// it only across store reads and writes, never across a call to a worker. A store one
    /// process uses answers a guard that holds nothing (the engine's own mutex serialises).
    fn lock(&self, _key: &str) -> Result<StoreLock, StoreError> {
        Ok(StoreLock::default())
    }

    // --- fence orders (cluster mode: a worker one controller cannot hear, another can) ---

    /// Orders `containers`, held by controller `owner` on `worker`, ended (replacing earlier
    /// orders for them); orders older than [`FENCE_ORDER_TTL`] are dropped meanwhile.
    fn put_fence_orders(
        &self,
        _worker: &str,
        _owner: &str,
        _containers: &[String],
    ) -> Result<(), StoreError> {
        Ok(())
    }
    /// Every open order younger than [`FENCE_ORDER_TTL`], by worker and container.
    fn fence_orders(&self) -> Result<Vec<FenceOrderRecord>, StoreError> {
        Ok(Vec::new())
    }
    /// Marks `worker`'s orders for `containers` as handed to it.
    fn fence_orders_relayed(
        &self,
        _worker: &str,
        _containers: &[String],
    ) -> Result<(), StoreError> {
        Ok(())
    }
    /// Removes `worker`'s orders for `containers`: it says they no longer run there.
    fn fence_orders_done(&self, _worker: &str, _containers: &[String]) -> Result<(), StoreError> {
        Ok(())
    }

    // --- wake tickets to drop (cluster mode: a worker that missed a `ForgetGpuTickets`) ---

    /// Keeps that `worker` still has to be told to drop `sandbox`'s wake ticket (the first
    /// time kept stays).
    fn put_ticket_forget(&self, _worker: &str, _sandbox: &str) -> Result<(), StoreError> {
        Ok(())
    }
    /// The oldest `limit` tickets still to drop: `(worker, sandbox, milliseconds since it was
    /// first kept)`, oldest first. A store one process uses keeps none (that process retries
    /// in memory).
    fn ticket_forgets(&self, _limit: usize) -> Result<Vec<(String, String, u64)>, StoreError> {
        Ok(Vec::new())
    }
    /// The worker dropped it (or it is given up on).
    fn ticket_forget_done(&self, _worker: &str, _sandbox: &str) -> Result<(), StoreError> {
        Ok(())
    }

    // --- drained workers (cluster mode: a drain through one controller holds on all) ---

    /// Drains `worker` (`true`: it gets no new sandboxes) or lifts its drain, for every
    /// controller of the store. A store one process uses keeps none (there are no workers).
    fn set_worker_drain(&self, _worker: &str, _drain: bool) -> Result<(), StoreError> {
        Ok(())
    }
    /// The drained workers, by name.
    fn worker_drains(&self) -> Result<Vec<String>, StoreError> {
        Ok(Vec::new())
    }

    // --- GPU holdings (cluster mode: a tenant's GPU quota across controllers) ---

    /// Keeps what `tenant` holds of `worker`'s GPUs as report `seq` of that worker said,
    /// unless a report at least as new is kept.
    fn put_gpu_holding(
        &self,
        _tenant: &str,
        _worker: &str,
        _seq: u64,
        _held: torpor_gpu::quota::Amount,
    ) -> Result<(), StoreError> {
        Ok(())
    }
    /// What `tenant` holds per worker, as the newest reports kept said: `(worker, seq, held)`,
    /// by worker. A store one process uses keeps none (its controller saw every start).
    fn gpu_holdings(
        &self,
        _tenant: &str,
    ) -> Result<Vec<(String, u64, torpor_gpu::quota::Amount)>, StoreError> {
        Ok(Vec::new())
    }

    // --- metric samples (E2B `get_metrics`) ---

    /// Keeps samples: (sandbox, Unix milliseconds, the sample as JSON), in one write; a sample
    /// already kept for that sandbox at that millisecond stays.
    fn put_metric_samples(&self, rows: &[(SandboxId, i64, String)]) -> Result<(), StoreError>;
    /// `id`'s samples taken in `[from_ms, to_ms]`, oldest first: the newest `limit` of them.
    fn metric_samples(
        &self,
        id: &SandboxId,
        from_ms: i64,
        to_ms: i64,
        limit: usize,
    ) -> Result<Vec<(i64, String)>, StoreError>;
    /// Drops the samples taken before `before_ms` and those of sandboxes that no longer
    /// exist; how many went.
    fn prune_metric_samples(&self, before_ms: i64) -> Result<u64, StoreError>;

    // --- usage intervals ---

    /// Adds each row's value (those that are positive) to its interval's row of the same key
    /// (start, tenant, sandbox, measure, dimension), all in one write.
    fn add_usage(&self, rows: &[UsageInterval]) -> Result<(), StoreError>;
    /// The rows of intervals starting in `[from_s, to_s)`, of `tenant` or of every tenant.
    fn usage_intervals(
        &self,
        from_s: i64,
        to_s: i64,
        tenant: Option<&TenantId>,
    ) -> Result<Vec<UsageInterval>, StoreError>;
}

/// How long a fence order stays open: past it, its worker was either reached by no controller
/// (it fenced itself) or registered again (its leftovers were removed then).
pub const FENCE_ORDER_TTL: Duration = Duration::from_secs(3600);

/// Requests one controller let through for one tenant and route class (`rate_usage`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateUsage {
    pub tenant: String,
    /// The route class (`lifecycle`, `exec`, `files`, `proxy`).
    pub class: String,
    pub count: u64,
}

/// Another controller's report: its id (each is taken once) and what it says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateReport {
    pub id: i64,
    pub usage: RateUsage,
}

/// A live controller (a row of `controllers`): its name and where the others reach it.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveController {
    /// Its certificate's name: what `SandboxRecord::controller` holds.
    pub name: String,
    /// Its public API (`host:port`, plain HTTP): where a controller built before the peer
    /// listener forwards calls.
    pub api_addr: String,
    /// Its peer listener (`host:port`, HTTP/2 over mutual TLS, controller certificates only),
    /// where calls for the sandboxes it holds are forwarded; `None` for a controller built
    /// before it (forwarded to over plain HTTP at `api_addr`, during a rolling upgrade).
    pub peer_addr: Option<String>,
    /// The calls a second the sandboxes it holds take, as of its last heartbeat; `None` for a
    /// controller that does not say (built before it, or not balancing).
    pub call_rate: Option<f64>,
}

/// One open fence order ([`StateStore::fence_orders`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceOrderRecord {
    pub worker: String,
    pub container: String,
    /// The controller that held the container when it ordered it ended.
    pub owner: String,
    /// Whether a controller that hears the worker has handed it over.
    pub relayed: bool,
}

/// A lock held in the store ([`StateStore::lock`]); released when dropped.
#[derive(Default)]
#[must_use = "the lock is released when the guard drops"]
pub struct StoreLock(Option<Box<dyn FnOnce() + Send>>);

impl StoreLock {
    /// A guard that runs `release` when dropped.
    pub fn new(release: impl FnOnce() + Send + 'static) -> StoreLock {
        StoreLock(Some(Box::new(release)))
    }
}

impl Drop for StoreLock {
    fn drop(&mut self) {
        if let Some(release) = self.0.take() {
            release();
        }
    }
}

/// A shared handle on the state store: what the engine, the GPU ledger, pools and usage
/// accounting hold. It derefs to the [`StateStore`], so `store.sandbox(id)` calls the backend.
#[derive(Clone)]
pub struct Store(Arc<dyn StateStore>);

impl Store {
    /// The SQLite store in `path` (created and migrated as needed). A file already open in
    /// this process answers the same store, so every part of the daemon shares one connection.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        static OPEN: Mutex<Vec<(PathBuf, Weak<SqliteStore>)>> = Mutex::new(Vec::new());
        let key = canonical(path);
        let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
        open.retain(|(_, s)| s.strong_count() > 0);
        if let Some(store) = open
            .iter()
            .find(|(p, _)| *p == key)
            .and_then(|(_, s)| s.upgrade())
        {
            return Ok(Store(store));
        }
        let store = Arc::new(SqliteStore::open(path)?);
        open.push((key, Arc::downgrade(&store)));
        Ok(Store(store))
    }

    /// The PostgreSQL store at `url` (`postgres://user:password@host:port/db`; cluster mode),
    /// its schema created or migrated under an advisory lock, with sandboxes' env sealed under
    /// the key file `env_key` (created when missing; every controller of one database must be
    /// given the same file, and one whose key does not match the database's is refused).
    /// Each call makes a new connection pool: call it once per process.
    pub fn connect(url: &str, env_key: &Path) -> Result<Store, StoreError> {
        Ok(Store(Arc::new(PostgresStore::connect(url, env_key)?)))
    }

    /// A handle on another backend.
    pub fn new(backend: Arc<dyn StateStore>) -> Store {
        Store(backend)
    }
}

impl Deref for Store {
    type Target = dyn StateStore;

    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}

/// `path` with its directory resolved, so two spellings of one file name one store.
fn canonical(path: &Path) -> PathBuf {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    match (
        dir.map_or_else(std::env::current_dir, std::fs::canonicalize),
        path.file_name(),
    ) {
        (Ok(dir), Some(name)) => dir.join(name),
        _ => path.to_path_buf(),
    }
}

/// How `key` appears in a sandbox's stored metadata (compact JSON: `"key":`), for a text match
/// that skips every row without it before any row is parsed. A match inside a value is not
/// possible (quotes there are escaped), and callers check the parsed map anyway.
pub(crate) fn metadata_key_text(key: &str) -> String {
    format!("{}:", serde_json::Value::String(key.to_string()))
}

/// One row of a `GROUP BY state, tier` count, parsed.
pub(crate) fn state_count(
    state: &str,
    tier: &str,
    n: i64,
) -> Result<(SandboxState, Tier, u64), StoreError> {
    let corrupt = || StoreError::Corrupt {
        what: "sandbox count",
        key: format!("{state}/{tier}"),
    };
    Ok((
        SandboxState::parse(state).ok_or_else(corrupt)?,
        Tier::parse(tier).ok_or_else(corrupt)?,
        n.max(0) as u64,
    ))
}
