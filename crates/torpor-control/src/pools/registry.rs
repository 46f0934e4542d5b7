//! [`Pools`]: every pool of this node. It reads the pools from the state store, starts one
//! controller per stored pool, checks brokers against the operator's allow-list and the
//! tenant's quota at create, and answers who may see which pool (another tenant's pool is a
//! 404).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use torpor_core::{now_millis, PoolName, TenantId};
use torpor_triggers::keda::{Demand, PoolDemand};
use torpor_triggers::BrokerAllowList;

use super::controller::Controller;
use super::spec::{invalid, PoolSpec};
use super::status::{initial_status, PoolStatus};
use super::POOL_METADATA_KEY;
use crate::engine::Engine;
use crate::error::{ControlError, Result};
use crate::store::{PoolRow, Store};

#[derive(Default)]
pub(super) struct Counters {
    pub(super) in_flight: AtomicU64,
    pub(super) processed: AtomicU64,
    pub(super) failed_attempts: AtomicU64,
    pub(super) dead_lettered: AtomicU64,
}

pub(super) struct PoolHandle {
    pub(super) spec: PoolSpec,
    pub(super) tenant: TenantId,
    pub(super) status: Mutex<PoolStatus>,
    pub(super) counters: Arc<Counters>,
    pub(super) poke: Arc<Notify>,
    pub(super) stop: watch::Sender<bool>,
    pub(super) task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl PoolHandle {
    /// Whether what the pool's status shows of broker failures is kept generic.
    pub(super) fn tenant_owned(&self) -> bool {
        self.tenant != TenantId::admin()
    }
}

/// What the operator configures for pools.
#[derive(Debug, Clone, Default)]
pub struct PoolsConfig {
    /// `--broker-allow` entries (`HOST[:PORT]`): the brokers tenants' pools may name.
    pub broker_allow: Vec<String>,
}

/// How often the pools are read back from the store (pools made through other controllers).
const SYNC_EVERY: Duration = Duration::from_secs(2);

/// A pool's key: names are per tenant.
type PoolKey = (TenantId, PoolName);

/// Every pool of this node.
pub struct Pools {
    engine: Arc<Engine>,
    store: Store,
    allow: BrokerAllowList,
    /// Serialises the quota check with the insert it allows.
    create_lock: tokio::sync::Mutex<()>,
    pools: Mutex<BTreeMap<PoolKey, Arc<PoolHandle>>>,
}

impl Pools {
    /// Opens the pools table beside the engine's state and starts every stored pool.
    pub async fn start(
        engine: Arc<Engine>,
        data_dir: &Path,
        config: PoolsConfig,
    ) -> Result<Arc<Pools>> {
        let allow = BrokerAllowList::parse(&config.broker_allow)
            .map_err(|e| ControlError::Invalid(e.to_string()))?;
        // The engine's store (SQLite in the data directory, or the cluster's PostgreSQL).
        let _ = data_dir;
        let store = engine.state_store();
        let rows = store.pools()?;
        let pools = Arc::new(Pools {
            engine,
            store,
            allow,
            create_lock: tokio::sync::Mutex::new(()),
            pools: Mutex::new(BTreeMap::new()),
        });
        for row in rows {
            match serde_json::from_str::<PoolSpec>(&row.spec_json) {
                // The list may have narrowed since the pool was made: such a pool is kept but
                // not run, and its status says why.
                Ok(spec) => match pools.check_brokers(&row.tenant, &spec) {
                    Ok(()) => pools.launch(row.tenant, spec),
                    Err(e) => {
                        tracing::warn!(pool = %row.name, tenant = %row.tenant, error = %e, "pool not started: its broker is not in --broker-allow");
                        pools.hold(row.tenant, spec, e.to_string());
                    }
                },
                Err(e) => {
                    tracing::error!(pool = %row.name, tenant = %row.tenant, error = %e, "stored pool spec unreadable")
                }
            }
        }
        pools.spawn_sync();
        Ok(pools)
    }

    /// Keeps this controller's pools in step with the store's (cluster mode: pools created or
    /// deleted through another controller), every [`SYNC_EVERY`].
    fn spawn_sync(self: &Arc<Self>) {
        let pools = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(SYNC_EVERY).await;
                let Some(pools) = pools.upgrade() else { return };
                if let Err(e) = pools.sync() {
                    tracing::warn!(error = %e, "cannot read the stored pools");
                }
            }
        });
    }

    fn sync(&self) -> Result<()> {
        let rows = self.store.pools()?;
        let stored: std::collections::BTreeSet<PoolKey> = rows
            .iter()
            .map(|r| (r.tenant.clone(), r.name.clone()))
            .collect();
        let gone: Vec<Arc<PoolHandle>> = {
            let mut map = self.map();
            let keys: Vec<PoolKey> = map
                .keys()
                .filter(|k| !stored.contains(*k))
                .cloned()
                .collect();
            keys.iter().filter_map(|k| map.remove(k)).collect()
        };
        for h in gone {
            tracing::info!(pool = %h.spec.name, tenant = %h.tenant, "pool deleted elsewhere; its controller stops here");
            let _ = h.stop.send(true);
        }
        for row in rows {
            if self
                .map()
                .contains_key(&(row.tenant.clone(), row.name.clone()))
            {
                continue;
            }
            match serde_json::from_str::<PoolSpec>(&row.spec_json) {
                Ok(spec) if self.check_brokers(&row.tenant, &spec).is_ok() => {
                    tracing::info!(pool = %row.name, tenant = %row.tenant, "pool created elsewhere; its controller starts here");
                    self.launch(row.tenant, spec);
                }
                Ok(spec) => self.hold(
                    row.tenant,
                    spec,
                    "its broker is not in --broker-allow".into(),
                ),
                Err(e) => {
                    tracing::error!(pool = %row.name, tenant = %row.tenant, error = %e, "stored pool spec unreadable")
                }
            }
        }
        Ok(())
    }

    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<PoolKey, Arc<PoolHandle>>> {
        self.pools.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A tenant's pool may name only the operator's brokers; the admin's may name any.
    fn check_brokers(&self, tenant: &TenantId, spec: &PoolSpec) -> Result<()> {
        if *tenant == TenantId::admin() {
            return Ok(());
        }
        for (i, t) in spec.triggers.iter().enumerate() {
            self.allow
                .check(t, &format!("triggers[{i}]"))
                .map_err(|e| ControlError::Invalid(e.to_string()))?;
        }
        Ok(())
    }

    pub async fn create(&self, tenant: &TenantId, spec: PoolSpec) -> Result<PoolStatus> {
        spec.validate()?;
        self.check_brokers(tenant, &spec)?;
        // The template must exist for this tenant.
        let tpl = self.engine.template(tenant, &spec.template)?;
        if let Some(h) = spec.dispatch.as_ref().and_then(|d| d.http.as_ref()) {
            if tpl.spec.network.as_ref().is_none_or(|n| n.is_none()) {
                return Err(invalid(
                    "dispatch.http",
                    format!(
                        "template {} has no network: give it one (e.g. {{\"allow\": []}} for ingress only) so torpor can reach port {}",
                        spec.template, h.port
                    ),
                ));
            }
        }
        let row = PoolRow {
            name: spec.name.clone(),
            tenant: tenant.clone(),
            spec_json: serde_json::to_string(&spec).expect("pool specs serialise"),
            created_at: now_millis(),
        };
        {
            let _quota = self.create_lock.lock().await;
            self.check_quota(tenant)?;
            if !self.store.insert_pool(&row)? {
                return Err(ControlError::AlreadyExists {
                    kind: "pool",
                    id: spec.name.to_string(),
                });
            }
        }
        let name = spec.name.clone();
        self.launch(tenant.clone(), spec);
        self.status(tenant, None, &name)
    }

    /// `max_pools`: refuses one more pool over the tenant's quota. Call under `create_lock`.
    fn check_quota(&self, tenant: &TenantId) -> Result<()> {
        if *tenant == TenantId::admin() {
            return Ok(());
        }
        let Some(limit) = self.store.tenant(tenant)?.and_then(|t| t.quotas.max_pools) else {
            return Ok(());
        };
        let used = self.store.count_pools(tenant)?;
        if used >= limit {
            return Err(ControlError::QuotaExceeded {
                what: "pools",
                limit,
                used,
            });
        }
        Ok(())
    }

    fn new_handle(tenant: TenantId, spec: &PoolSpec) -> (Arc<PoolHandle>, watch::Receiver<bool>) {
        let (stop, stop_rx) = watch::channel(false);
        let handle = Arc::new(PoolHandle {
            status: Mutex::new(initial_status(&tenant, spec)),
            spec: spec.clone(),
            tenant,
            counters: Arc::new(Counters::default()),
            poke: Arc::new(Notify::new()),
            stop,
            task: Mutex::new(None),
        });
        (handle, stop_rx)
    }

    /// Starts the pool's controller, unless it runs already (a create and the store sync may
    /// both find a new pool).
    fn launch(self: &Pools, tenant: TenantId, spec: PoolSpec) {
        let mut map = self.map();
        if map.contains_key(&(tenant.clone(), spec.name.clone())) {
            return;
        }
        let (handle, stop_rx) = Self::new_handle(tenant.clone(), &spec);
        let controller = Controller::new(self.engine.clone(), handle.clone(), stop_rx);
        let span = tracing::info_span!("pool", pool = %spec.name, tenant = %tenant);
        let task = tokio::spawn(tracing::Instrument::instrument(controller.run(), span));
        *handle.task.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
        map.insert((tenant, spec.name.clone()), handle);
    }

    /// Keeps a pool that may not run (its status says why) so that it can be seen and deleted.
    fn hold(&self, tenant: TenantId, spec: PoolSpec, why: String) {
        let (handle, _) = Self::new_handle(tenant.clone(), &spec);
        handle
            .status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .last_error = Some(why);
        self.map().insert((tenant, spec.name.clone()), handle);
    }

    /// The pool `name` of `owner` as `caller` may see it. A tenant sees only its own pools
    /// (`owner` naming another tenant is the same 404 as no such pool); the admin addresses its
    /// own pools, or a tenant's with `owner`.
    fn handle(
        &self,
        caller: &TenantId,
        owner: Option<&TenantId>,
        name: &PoolName,
    ) -> Result<Arc<PoolHandle>> {
        let not_found = || ControlError::NotFound {
            kind: "pool",
            id: name.to_string(),
        };
        let owner = match owner {
            Some(o) if caller == o || *caller == TenantId::admin() => o.clone(),
            Some(_) => return Err(not_found()),
            None => caller.clone(),
        };
        self.map()
            .get(&(owner, name.clone()))
            .cloned()
            .ok_or_else(not_found)
    }

    /// `owner`: whose pool (the admin only; see [`Pools::list`] for what each caller sees).
    pub fn status(
        &self,
        caller: &TenantId,
        owner: Option<&TenantId>,
        name: &PoolName,
    ) -> Result<PoolStatus> {
        let h = self.handle(caller, owner, name)?;
        let s = h.status.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Ok(s)
    }

    /// The caller's own pools; the admin sees every tenant's.
    pub fn list(&self, caller: &TenantId) -> Vec<PoolStatus> {
        self.map()
            .values()
            .filter(|h| &h.tenant == caller || *caller == TenantId::admin())
            .map(|h| h.status.lock().unwrap_or_else(|p| p.into_inner()).clone())
            .collect()
    }

    /// Stops the pool (in-flight messages finish first) and deletes its sandboxes.
    pub async fn delete(
        &self,
        caller: &TenantId,
        owner: Option<&TenantId>,
        name: &PoolName,
    ) -> Result<()> {
        let h = self.handle(caller, owner, name)?;
        self.store.delete_pool(&h.tenant, name)?;
        self.map().remove(&(h.tenant.clone(), name.clone()));
        let _ = h.stop.send(true);
        let task = h.task.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = task {
            let _ = t.await;
        }
        for s in pool_agents(&self.engine, &h.tenant, name.as_str()) {
            if let Err(e) = self.engine.delete_sandbox(&h.tenant, &s.id).await {
                tracing::warn!(pool = %name, sandbox = %s.id, error = %e, "cannot delete a pool agent");
            }
        }
        Ok(())
    }

    /// Stops every controller; lanes finish their in-flight messages first.
    pub async fn shutdown(&self) {
        let handles: Vec<_> = self.map().values().cloned().collect();
        for h in &handles {
            let _ = h.stop.send(true);
        }
        for h in handles {
            let task = h.task.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(t) = task {
                let _ = t.await;
            }
        }
    }
}

/// The sandboxes of `tenant`'s pool `name`: those it owns (the admin's `engine.sandboxes` lists
/// every tenant's, and a tenant's pool of the same name is not the admin's) with the pool's
/// metadata.
pub(super) fn pool_agents(
    engine: &Engine,
    tenant: &TenantId,
    name: &str,
) -> Vec<crate::store::SandboxRecord> {
    match engine.sandboxes(tenant) {
        Ok(all) => all
            .into_iter()
            .filter(|s| {
                s.tenant == *tenant
                    && s.metadata.get(POOL_METADATA_KEY).map(String::as_str) == Some(name)
            })
            .collect(),
        Err(e) => {
            tracing::warn!(pool = %name, error = %e, "cannot list the pool's agents");
            Vec::new()
        }
    }
}

impl Demand for Pools {
    fn demand(&self, tenant: Option<&str>, pool: &str) -> Option<PoolDemand> {
        let name = PoolName::new(pool).ok()?;
        let tenant = match tenant {
            Some(t) => TenantId::new(t).ok()?,
            None => TenantId::admin(),
        };
        let h = self.map().get(&(tenant, name)).cloned()?;
        let s = h.status.lock().unwrap_or_else(|p| p.into_inner());
        Some(PoolDemand {
            depth: s.depth.unwrap_or(0),
            target: h.spec.target,
            active: s.active,
        })
    }
}
