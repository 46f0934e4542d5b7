//! Pools: agents of one template, scaled from queue depth (to zero and back).
//!
//! A pool has one controller task (an actor: it alone owns the pool's agents and decides; the
//! API reads the [`PoolStatus`] it publishes). The controller reads every trigger's depth at
//! `poll_interval_ms`, and at once when a push watcher sees new work (Redis blocking move,
//! Redis stream blocking read, a NATS subscription on the stream's subjects), applies
//! [`torpor_triggers::rule::decide`], and moves agents:
//!
//! ```text
//!   sleeping (Suspended/Parked) --wake--> active --drain notice--> draining --in-flight done--> suspend
//!   (none)                      --create-->  |
//! ```
//!
//! In *dispatch* mode each active agent has a lane: a task with its own broker consumer that
//! takes one message and hands it to the agent — `dispatch.command` run in it with the message
//! on stdin (success: exit 0), or `dispatch.http`: a POST of the message body to a port of the
//! agent through the ingress path (the agent is woken if it sleeps and stays borrowed until the
//! answer is read; success: 2xx) — and acknowledges it only after success (retries, then the
//! dead-letter destination). A draining lane finishes its message before the agent is
//! suspended, so scale-in loses nothing. In *self-consume* mode (no `dispatch`) torpor only
//! scales; the agents read the broker themselves over their egress network (the template's
//! `network` policy must allow the broker). They take work while [`DRAIN_FILE`] is absent:
//! torpor writes it as the drain notice and removes it when it makes an agent active.
//!
//! Pool names are per tenant: the `pools` table is keyed by (tenant, name), two tenants may each
//! have a pool `jobs`, and another tenant's pool answers like one that does not exist. A tenant's
//! pool may name only the brokers of the operator's allow-list (`--broker-allow`; checked at
//! create and again when the daemon starts), and what a tenant sees of a broker it cannot reach
//! is one generic text after one fixed time, whatever the cause (refused, filtered, reset):
//! the details go to the log.
//!
//! This module uses only the [`Engine`]'s public calls (create, resume, exec, suspend, delete).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch, Notify};
use torpor_core::{now_millis, PoolName, SandboxId, SandboxState, TemplateName, TenantId, Tier};
use torpor_runtime::proto::ExecRequest;
use torpor_triggers::consume::{self, Consumer};
use torpor_triggers::keda::{Demand, PoolDemand};
use torpor_triggers::rule::{decide, Fallback, RuleState, ScalePolicy};
use torpor_triggers::{BrokerAllowList, DepthReader, TriggerError, TriggerSpec};

use crate::engine::{CreateSandbox, Engine};
use crate::error::{ControlError, Result};
use crate::store::{PoolRow, Store};

/// The metadata key that marks a sandbox as an agent of a pool.
pub const POOL_METADATA_KEY: &str = "torpor.pool";
/// The file a self-consuming agent finds when it is asked to stop taking work.
pub const DRAIN_FILE: &str = "/tmp/torpor-drain";
const MAX_TRIGGERS: usize = 8;
const MAX_AGENTS: u32 = 1000;
/// How long a lane waits on the broker before it looks at its drain flag again.
const LANE_WAIT: Duration = Duration::from_millis(500);
/// What a tenant's pool status says of a broker it cannot reach, whatever the cause.
pub const BROKER_UNREACHABLE_CODE: &str = "broker_unreachable";
const BROKER_UNREACHABLE_MESSAGE: &str =
    "the broker did not answer or refused the connection (details are in the daemon's log)";

fn default_target() -> u64 {
    1
}
fn default_cooldown() -> u64 {
    30
}
fn default_poll() -> u64 {
    1000
}
fn default_true() -> bool {
    true
}
fn default_timeout() -> u64 {
    300
}
fn default_attempts() -> u32 {
    3
}
fn default_backoff() -> u64 {
    200
}
fn default_grace() -> u64 {
    10
}

/// What `POST /v1/pools` takes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    pub name: PoolName,
    pub template: TemplateName,
    #[serde(default)]
    pub min: u32,
    pub max: u32,
    /// Work (messages) per agent.
    #[serde(default = "default_target")]
    pub target: u64,
    /// The pool is active only while depth is strictly above this.
    #[serde(default)]
    pub activation: u64,
    /// How long the pool keeps an agent after its last active reading before going to `min`.
    #[serde(default = "default_cooldown")]
    pub cooldown_s: u64,
    /// How often depth is read when no push arrives.
    #[serde(default = "default_poll")]
    pub poll_interval_ms: u64,
    /// Watch the broker for new work (where it allows it) instead of only polling.
    #[serde(default = "default_true")]
    pub push: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<Fallback>,
    /// Self-consume mode: how long an agent has between its drain notice and its suspension.
    #[serde(default = "default_grace")]
    pub drain_grace_s: u64,
    pub triggers: Vec<TriggerSpec>,
    /// Dispatch mode when present: torpor takes each message from `triggers[0]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatch: Option<DispatchSpec>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DispatchSpec {
    /// Run in an agent of the pool with the message on stdin; exit 0 acknowledges it.
    /// Exactly one of `command` and `http`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    /// POST the message body to a port of the agent (woken first when it sleeps); a 2xx answer
    /// acknowledges it. The pool's template needs a network (ingress).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpDispatch>,
    /// `command` only: extra environment of the command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default = "default_timeout")]
    pub timeout_s: u64,
    /// Attempts per message before it goes to the dead-letter destination.
    #[serde(default = "default_attempts")]
    pub max_attempts: u32,
    #[serde(default = "default_backoff")]
    pub retry_backoff_ms: u64,
    /// Dead-letter list, stream, subject or queue; a default per trigger when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<String>,
}

fn default_http_path() -> String {
    "/".into()
}

/// `dispatch.http`: where in the agent each message is POSTed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpDispatch {
    pub port: u16,
    /// Absolute path, query string allowed; default `/`.
    #[serde(default = "default_http_path")]
    pub path: String,
    /// Extra request headers (e.g. `content-type`; default `application/octet-stream`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
}

impl HttpDispatch {
    fn validate(&self) -> Result<()> {
        if self.port == 0 {
            return Err(invalid("dispatch.http.port", "must be between 1 and 65535"));
        }
        let p = &self.path;
        if !p.starts_with('/') || p.len() > 2048 || p.chars().any(|c| c.is_control() || c == ' ') {
            return Err(invalid(
                "dispatch.http.path",
                format!("{p:?} must start with '/', be at most 2048 bytes and hold no spaces or control characters"),
            ));
        }
        if p.split(['/', '?']).any(|s| s == ".." || s == ".") {
            return Err(invalid(
                "dispatch.http.path",
                format!("{p:?} may not contain '.' or '..' segments"),
            ));
        }
        if self.headers.len() > 32 {
            return Err(invalid("dispatch.http.headers", "at most 32 headers"));
        }
        for (k, v) in &self.headers {
            let name = hyper::header::HeaderName::from_bytes(k.as_bytes()).map_err(|_| {
                invalid(
                    "dispatch.http.headers",
                    format!("{k:?} is not a header name"),
                )
            })?;
            if matches!(
                name.as_str(),
                "host" | "content-length" | "transfer-encoding" | "connection" | "upgrade"
            ) {
                return Err(invalid(
                    "dispatch.http.headers",
                    format!("{k:?} is set by torpor"),
                ));
            }
            hyper::header::HeaderValue::from_str(v).map_err(|_| {
                invalid(
                    "dispatch.http.headers",
                    format!("the value of {k:?} is not a valid header value"),
                )
            })?;
        }
        Ok(())
    }
}

fn invalid(field: &str, reason: impl std::fmt::Display) -> ControlError {
    ControlError::Invalid(format!("{field}: {reason}"))
}

impl PoolSpec {
    /// Checks every setting, naming the field that is wrong.
    pub fn validate(&self) -> Result<()> {
        if self.max == 0 || self.max > MAX_AGENTS {
            return Err(invalid(
                "max",
                format!("must be between 1 and {MAX_AGENTS}"),
            ));
        }
        if self.min > self.max {
            return Err(invalid(
                "min",
                format!("{} is above max {}", self.min, self.max),
            ));
        }
        if self.target == 0 {
            return Err(invalid("target", "must be at least 1"));
        }
        if self.cooldown_s > 86_400 {
            return Err(invalid("cooldown_s", "must be at most 86400"));
        }
        if !(50..=3_600_000).contains(&self.poll_interval_ms) {
            return Err(invalid(
                "poll_interval_ms",
                "must be between 50 and 3600000",
            ));
        }
        if self.drain_grace_s > 3600 {
            return Err(invalid("drain_grace_s", "must be at most 3600"));
        }
        if let Some(fb) = &self.fallback {
            if fb.failure_threshold == 0 {
                return Err(invalid("fallback.failure_threshold", "must be at least 1"));
            }
            if fb.replicas > self.max {
                return Err(invalid(
                    "fallback.replicas",
                    format!("{} is above max {}", fb.replicas, self.max),
                ));
            }
        }
        if self.triggers.is_empty() || self.triggers.len() > MAX_TRIGGERS {
            return Err(invalid(
                "triggers",
                format!("needs between 1 and {MAX_TRIGGERS} triggers"),
            ));
        }
        for (i, t) in self.triggers.iter().enumerate() {
            t.validate(&format!("triggers[{i}]")).map_err(|e| match e {
                TriggerError::FeatureDisabled { .. } => {
                    ControlError::FeatureDisabled(e.to_string())
                }
                e => ControlError::Invalid(e.to_string()),
            })?;
        }
        if let Some(d) = &self.dispatch {
            match (&d.command, &d.http) {
                (Some(cmd), None) => {
                    if cmd.is_empty() || cmd[0].is_empty() {
                        return Err(invalid("dispatch.command", "must name a program"));
                    }
                    if cmd.iter().any(|a| a.contains('\0')) {
                        return Err(invalid("dispatch.command", "contains a NUL byte"));
                    }
                }
                (None, Some(h)) => {
                    h.validate()?;
                    if !d.env.is_empty() {
                        return Err(invalid(
                            "dispatch.env",
                            "applies to `command` only; an HTTP agent has its template's env",
                        ));
                    }
                }
                _ => {
                    return Err(invalid(
                        "dispatch",
                        "needs exactly one of `command` and `http`",
                    ))
                }
            }
            torpor_core::validate_env(&d.env)
                .map_err(|e| invalid("dispatch.env", e.to_string()))?;
            if !(1..=86_400).contains(&d.timeout_s) {
                return Err(invalid("dispatch.timeout_s", "must be between 1 and 86400"));
            }
            if !(1..=100).contains(&d.max_attempts) {
                return Err(invalid(
                    "dispatch.max_attempts",
                    "must be between 1 and 100",
                ));
            }
            if d.retry_backoff_ms > 60_000 {
                return Err(invalid(
                    "dispatch.retry_backoff_ms",
                    "must be at most 60000",
                ));
            }
            if let Some(dl) = &d.dead_letter {
                if dl.is_empty() || dl.len() > 256 || dl.chars().any(char::is_control) {
                    return Err(invalid(
                        "dispatch.dead_letter",
                        "must be 1 to 256 printable characters",
                    ));
                }
            }
            if !consume::can_dispatch(&self.triggers[0]) {
                return Err(invalid(
                    "dispatch",
                    format!(
                        "torpor cannot dispatch from a {} trigger (triggers[0]); leave dispatch out",
                        self.triggers[0].kind()
                    ),
                ));
            }
        }
        Ok(())
    }

    fn policy(&self) -> ScalePolicy {
        ScalePolicy {
            min: self.min,
            max: self.max,
            target: self.target,
            activation: self.activation,
            cooldown_ms: self.cooldown_s * 1000,
            fallback: self.fallback,
        }
    }

    fn dead_letter(&self) -> String {
        self.dispatch
            .as_ref()
            .and_then(|d| d.dead_letter.clone())
            .unwrap_or_else(|| consume::default_dead_letter(&self.triggers[0], self.name.as_str()))
    }
}

/// One trigger's last reading.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TriggerStatus {
    #[serde(rename = "type")]
    pub kind: String,
    pub depth: Option<u64>,
    /// The last error's stable code and message, while the trigger fails.
    pub error: Option<TriggerErrorStatus>,
    pub consecutive_errors: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TriggerErrorStatus {
    pub code: String,
    pub message: String,
}

/// What `GET /v1/pools/{name}` answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolStatus {
    pub name: PoolName,
    pub tenant: TenantId,
    pub template: TemplateName,
    /// `dispatch` or `self-consume`.
    pub mode: String,
    pub desired: u32,
    /// Active agents (awake and, in dispatch mode, taking work).
    pub running: u32,
    /// Agents being created or woken.
    pub starting: u32,
    /// Agents finishing their in-flight work before suspension.
    pub draining: u32,
    /// Demand: the maximum depth over the triggers (plus in-flight messages where the broker
    /// does not count them); `null` while no trigger answers.
    pub depth: Option<u64>,
    pub active: bool,
    pub fallback: bool,
    pub in_flight: u64,
    pub processed: u64,
    pub failed_attempts: u64,
    pub dead_lettered: u64,
    /// Every sandbox of the pool, awake or asleep.
    pub sandboxes: Vec<SandboxId>,
    pub triggers: Vec<TriggerStatus>,
    /// The last scaling error (creating, waking or suspending an agent), if any.
    pub last_error: Option<String>,
    pub spec: PoolSpec,
}

#[derive(Default)]
struct Counters {
    in_flight: AtomicU64,
    processed: AtomicU64,
    failed_attempts: AtomicU64,
    dead_lettered: AtomicU64,
}

struct PoolHandle {
    spec: PoolSpec,
    tenant: TenantId,
    status: Mutex<PoolStatus>,
    counters: Arc<Counters>,
    poke: Arc<Notify>,
    stop: watch::Sender<bool>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl PoolHandle {
    /// Whether what the pool's status shows of broker failures is kept generic.
    fn tenant_owned(&self) -> bool {
        self.tenant != TenantId::admin()
    }
}

/// What the operator configures for pools.
#[derive(Debug, Clone, Default)]
pub struct PoolsConfig {
    /// `--broker-allow` entries (`HOST[:PORT]`): the brokers tenants' pools may name.
    pub broker_allow: Vec<String>,
}

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

/// The `pools` table, keyed by (tenant, name). This module owns it; a table from before pool
/// names were per tenant (keyed by name alone) is rebuilt in place, rows kept.
mod table {
    use rusqlite::{params, OptionalExtension};
    use torpor_core::TenantId;

    use crate::store::{PoolRow, Store, StoreError};

    const CREATE: &str = "CREATE TABLE pools (
        tenant TEXT NOT NULL,
        name TEXT NOT NULL,
        spec TEXT NOT NULL,
        created_at INTEGER NOT NULL,
        PRIMARY KEY (tenant, name)
    )";

    /// Makes the table keyed by (tenant, name), moving the rows of an older one.
    pub(super) fn migrate(store: &Store) -> Result<(), StoreError> {
        store.with(|c| {
            let sql: Option<String> = c
                .query_row(
                    "SELECT sql FROM sqlite_master WHERE type='table' AND name='pools'",
                    [],
                    |r| r.get(0),
                )
                .optional()?;
            let keyed_by_tenant = sql.as_deref().is_some_and(|s| {
                s.replace(char::is_whitespace, "")
                    .contains("PRIMARYKEY(tenant,name)")
            });
            if keyed_by_tenant {
                return Ok(());
            }
            let tx = c.unchecked_transaction()?;
            tx.execute_batch(&CREATE.replacen("TABLE pools", "TABLE pools_by_tenant", 1))?;
            if sql.is_some() {
                tx.execute_batch(
                    "INSERT INTO pools_by_tenant(tenant, name, spec, created_at)
                         SELECT tenant, name, spec, created_at FROM pools;
                     DROP TABLE pools;",
                )?;
            }
            tx.execute_batch("ALTER TABLE pools_by_tenant RENAME TO pools")?;
            tx.commit()
        })
    }

    /// Inserts a pool; false when its tenant already has one of that name.
    pub(super) fn insert(store: &Store, p: &PoolRow) -> Result<bool, StoreError> {
        store
            .with(|c| {
                c.execute(
                    "INSERT OR IGNORE INTO pools(tenant, name, spec, created_at) VALUES (?1, ?2, ?3, ?4)",
                    params![p.tenant.as_str(), p.name, p.spec_json, p.created_at],
                )
            })
            .map(|n| n == 1)
    }

    pub(super) fn delete(store: &Store, tenant: &TenantId, name: &str) -> Result<bool, StoreError> {
        store
            .with(|c| {
                c.execute(
                    "DELETE FROM pools WHERE tenant = ?1 AND name = ?2",
                    params![tenant.as_str(), name],
                )
            })
            .map(|n| n == 1)
    }

    pub(super) fn count(store: &Store, tenant: &TenantId) -> Result<u64, StoreError> {
        store.with(|c| {
            c.query_row(
                "SELECT COUNT(*) FROM pools WHERE tenant = ?1",
                params![tenant.as_str()],
                |r| r.get::<_, i64>(0),
            )
            .map(|n| n.max(0) as u64)
        })
    }

    pub(super) fn all(store: &Store) -> Result<Vec<PoolRow>, StoreError> {
        let rows = store.with(|c| {
            let mut st = c.prepare(
                "SELECT tenant, name, spec, created_at FROM pools ORDER BY tenant, name",
            )?;
            let rows = st
                .query_map([], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, String>(1)?,
                        r.get::<_, String>(2)?,
                        r.get::<_, i64>(3)?,
                    ))
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            Ok(rows)
        })?;
        rows.into_iter()
            .map(|(tenant, name, spec_json, created_at)| {
                let tenant = TenantId::new(tenant).map_err(|_| StoreError::Corrupt {
                    what: "pool",
                    key: name.clone(),
                })?;
                Ok(PoolRow {
                    name,
                    tenant,
                    spec_json,
                    created_at,
                })
            })
            .collect()
    }
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
        let store = Store::open(&data_dir.join("torpor.db"))?;
        table::migrate(&store)?;
        let rows = table::all(&store)?;
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
        Ok(pools)
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
            name: spec.name.to_string(),
            tenant: tenant.clone(),
            spec_json: serde_json::to_string(&spec).expect("pool specs serialise"),
            created_at: now_millis(),
        };
        {
            let _quota = self.create_lock.lock().await;
            self.check_quota(tenant)?;
            if !table::insert(&self.store, &row)? {
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
        let used = table::count(&self.store, tenant)?;
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

    fn launch(self: &Pools, tenant: TenantId, spec: PoolSpec) {
        let (handle, stop_rx) = Self::new_handle(tenant.clone(), &spec);
        let controller = Controller::new(self.engine.clone(), handle.clone(), stop_rx);
        let span = tracing::info_span!("pool", pool = %spec.name, tenant = %tenant);
        let task = tokio::spawn(tracing::Instrument::instrument(controller.run(), span));
        *handle.task.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
        self.map().insert((tenant, spec.name.clone()), handle);
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
        table::delete(&self.store, &h.tenant, name.as_str())?;
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
fn pool_agents(engine: &Engine, tenant: &TenantId, name: &str) -> Vec<crate::store::SandboxRecord> {
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

fn initial_status(tenant: &TenantId, spec: &PoolSpec) -> PoolStatus {
    PoolStatus {
        name: spec.name.clone(),
        tenant: tenant.clone(),
        template: spec.template.clone(),
        mode: if spec.dispatch.is_some() {
            "dispatch"
        } else {
            "self-consume"
        }
        .into(),
        desired: 0,
        running: 0,
        starting: 0,
        draining: 0,
        depth: None,
        active: false,
        fallback: false,
        in_flight: 0,
        processed: 0,
        failed_attempts: 0,
        dead_lettered: 0,
        sandboxes: Vec::new(),
        triggers: spec
            .triggers
            .iter()
            .map(|t| TriggerStatus {
                kind: t.kind().into(),
                depth: None,
                error: None,
                consecutive_errors: 0,
            })
            .collect(),
        last_error: None,
        spec: spec.clone(),
    }
}

// ------------------------------------------------------------------------------- controller

struct Lane {
    drain: Arc<AtomicBool>,
    busy: Arc<AtomicBool>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// What the controller's helper tasks report back.
enum Event {
    Started(SandboxId),
    StartFailed(Option<SandboxId>, String),
    Stopped(SandboxId, Option<String>),
}

struct Controller {
    engine: Arc<Engine>,
    pool: Arc<PoolHandle>,
    stop: watch::Receiver<bool>,
    readers: Vec<DepthReader>,
    rule: RuleState,
    /// Active agents (awake, with a lane in dispatch mode).
    active: BTreeMap<SandboxId, Lane>,
    /// Being created (counted by number) or woken (by id).
    starting: usize,
    waking: BTreeSet<SandboxId>,
    draining: BTreeSet<SandboxId>,
    events_tx: mpsc::Sender<Event>,
    events_rx: mpsc::Receiver<Event>,
    last_error: Option<String>,
}

impl Controller {
    fn new(engine: Arc<Engine>, pool: Arc<PoolHandle>, stop: watch::Receiver<bool>) -> Self {
        let (events_tx, events_rx) = mpsc::channel(256);
        Controller {
            readers: pool
                .spec
                .triggers
                .iter()
                .cloned()
                .map(DepthReader::new)
                .collect(),
            engine,
            pool,
            stop,
            rule: RuleState::default(),
            active: BTreeMap::new(),
            starting: 0,
            waking: BTreeSet::new(),
            draining: BTreeSet::new(),
            events_tx,
            events_rx,
            last_error: None,
        }
    }

    fn spec(&self) -> &PoolSpec {
        &self.pool.spec
    }

    async fn run(mut self) {
        let name = self.spec().name.clone();
        tracing::info!("pool controller started");
        if self.spec().dispatch.is_some() {
            // Messages a crashed torpor left mid-processing go back to the queue before any lane
            // takes work.
            match consume::recover_redis_list(&self.spec().triggers[0]).await {
                Ok(0) => {}
                Ok(n) => tracing::warn!(pool = %name, messages = n, "requeued unfinished messages"),
                Err(e) => {
                    tracing::warn!(pool = %name, error = %e, "cannot recover the processing list yet")
                }
            }
        }
        let watchers = if self.spec().push {
            self.spec()
                .triggers
                .iter()
                .cloned()
                .map(|t| tokio::spawn(watch_for_work(t, self.pool.poke.clone(), self.stop.clone())))
                .collect()
        } else {
            Vec::new()
        };
        let interval = Duration::from_millis(self.spec().poll_interval_ms);
        loop {
            if *self.stop.borrow() {
                break;
            }
            self.tick().await;
            let poke = self.pool.poke.clone();
            let mut stop = self.stop.clone();
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = poke.notified() => {}
                _ = stop.changed() => {}
                Some(ev) = self.events_rx.recv() => self.on_event(ev),
            }
            while let Ok(ev) = self.events_rx.try_recv() {
                self.on_event(ev);
            }
        }
        for w in watchers {
            w.abort();
        }
        self.stop_all().await;
        tracing::info!(pool = %name, "pool controller stopped");
    }

    fn on_event(&mut self, ev: Event) {
        match ev {
            Event::Started(id) => {
                // A woken agent was counted in `waking`, a created one in `starting`.
                if !self.waking.remove(&id) {
                    self.starting = self.starting.saturating_sub(1);
                }
                let lane = self.start_lane(&id);
                self.active.insert(id, lane);
            }
            Event::StartFailed(id, e) => {
                match id {
                    Some(id) => {
                        self.waking.remove(&id);
                    }
                    None => self.starting = self.starting.saturating_sub(1),
                }
                tracing::warn!(pool = %self.spec().name, error = %e, "cannot start an agent");
                self.last_error = Some(e);
            }
            Event::Stopped(id, err) => {
                self.draining.remove(&id);
                if let Some(e) = err {
                    tracing::warn!(pool = %self.spec().name, sandbox = %id, error = %e, "cannot suspend an agent");
                    self.last_error = Some(e);
                }
            }
        }
    }

    /// One reading and one decision.
    async fn tick(&mut self) {
        let generic = self.pool.tenant_owned();
        let readings = futures::future::join_all(self.readers.iter_mut().map(|r| async move {
            let started = Instant::now();
            let r = r.read().await;
            // A refused port fails at once, a filtered one after the timeout: for a tenant's
            // pool every unreachable broker fails after the same time, so the failures'
            // pace is no oracle either.
            if generic && matches!(&r, Err(e) if e.is_unreachable()) {
                tokio::time::sleep_until((started + torpor_triggers::depth::READ_TIMEOUT).into())
                    .await;
            }
            r
        }))
        .await;
        let in_flight = self.pool.counters.in_flight.load(Ordering::Relaxed);
        let dispatch = self.spec().dispatch.is_some();
        let mut depths = Vec::with_capacity(readings.len());
        let mut trig = Vec::with_capacity(readings.len());
        for (i, r) in readings.iter().enumerate() {
            let spec = &self.spec().triggers[i];
            let depth = match r {
                Ok(d) if dispatch && i == 0 && !spec.depth_counts_in_flight() => {
                    Some(d + in_flight)
                }
                // The broker's count may lag (RabbitMQ's management statistics): never below
                // what torpor itself holds.
                Ok(d) if dispatch && i == 0 => Some((*d).max(in_flight)),
                Ok(d) => Some(*d),
                Err(_) => None,
            };
            depths.push(depth);
            trig.push((
                spec.kind(),
                depth,
                r.as_ref().err().map(|e| err_status(e, generic)),
            ));
        }
        let current = (self.active.len() + self.starting + self.waking.len()) as u32;
        let d = decide(
            &self.spec().policy(),
            &depths,
            current,
            now_millis().max(0) as u64,
            &mut self.rule,
        );
        if readings.iter().any(Result::is_err) {
            for (i, r) in readings.iter().enumerate() {
                if let Err(e) = r {
                    tracing::warn!(pool = %self.spec().name, trigger = i, code = e.code(), error = %e, "trigger reading failed");
                }
            }
        }
        self.scale_to(d.desired).await;
        self.publish(d, trig).await;
    }

    async fn publish(
        &self,
        d: torpor_triggers::Decision,
        trig: Vec<(&'static str, Option<u64>, Option<TriggerErrorStatus>)>,
    ) {
        let sandboxes = pool_agents(&self.engine, &self.pool.tenant, self.spec().name.as_str())
            .into_iter()
            .map(|s| s.id)
            .collect();
        let c = &self.pool.counters;
        let mut s = self.pool.status.lock().unwrap_or_else(|p| p.into_inner());
        s.desired = d.desired;
        s.running = self.active.len() as u32;
        s.starting = (self.starting + self.waking.len()) as u32;
        s.draining = self.draining.len() as u32;
        s.depth = d.depth;
        s.active = d.active;
        s.fallback = d.fallback;
        s.in_flight = c.in_flight.load(Ordering::Relaxed);
        s.processed = c.processed.load(Ordering::Relaxed);
        s.failed_attempts = c.failed_attempts.load(Ordering::Relaxed);
        s.dead_lettered = c.dead_lettered.load(Ordering::Relaxed);
        s.sandboxes = sandboxes;
        s.triggers = trig
            .into_iter()
            .enumerate()
            .map(|(i, (kind, depth, error))| TriggerStatus {
                kind: kind.into(),
                depth,
                error,
                consecutive_errors: self.rule.consecutive_errors.get(i).copied().unwrap_or(0),
            })
            .collect();
        s.last_error = self.last_error.clone();
    }

    /// Pool agents that are asleep and not being handled, oldest first.
    fn sleeping_agents(&self) -> Vec<SandboxId> {
        let mut v: Vec<_> = pool_agents(&self.engine, &self.pool.tenant, self.spec().name.as_str())
            .into_iter()
            .filter(|s| {
                !self.active.contains_key(&s.id)
                    && !self.waking.contains(&s.id)
                    && !self.draining.contains(&s.id)
            })
            .filter(|s| !matches!(s.state, SandboxState::Creating | SandboxState::Deleting))
            .map(|s| (s.created_at, s.id))
            .collect();
        v.sort();
        v.into_iter().map(|(_, id)| id).collect()
    }

    async fn scale_to(&mut self, desired: u32) {
        let desired = desired as usize;
        let self_consume = self.spec().dispatch.is_none();
        let current = self.active.len() + self.starting + self.waking.len();
        if desired > current {
            let mut need = desired - current;
            let sleeping = self.sleeping_agents();
            let unused = sleeping.len().saturating_sub(need);
            for id in sleeping.into_iter().take(need) {
                need -= 1;
                self.waking.insert(id.clone());
                let engine = self.engine.clone();
                let tenant = self.pool.tenant.clone();
                let tx = self.events_tx.clone();
                tokio::spawn(async move {
                    let ev = match engine.resume(&tenant, &id).await {
                        Ok(_) => {
                            if self_consume {
                                clear_drain_notice(&engine, &tenant, &id).await;
                            }
                            Event::Started(id)
                        }
                        Err(e) => Event::StartFailed(Some(id), format!("wake: {e}")),
                    };
                    let _ = tx.send(ev).await;
                });
            }
            // Never more agents than max, counting those still draining and those asleep:
            // a draining agent is woken again once it sleeps, instead of a new one made now.
            let owned = self.active.len()
                + self.starting
                + self.waking.len()
                + self.draining.len()
                + unused;
            let room = (self.spec().max as usize).saturating_sub(owned);
            for _ in 0..need.min(room) {
                self.starting += 1;
                let engine = self.engine.clone();
                let tenant = self.pool.tenant.clone();
                let tx = self.events_tx.clone();
                let req = CreateSandbox {
                    template: self.spec().template.clone(),
                    env: Default::default(),
                    metadata: BTreeMap::from([(
                        POOL_METADATA_KEY.to_string(),
                        self.spec().name.to_string(),
                    )]),
                    limits: Default::default(),
                    gpu: None,
                    network: None,
                };
                tokio::spawn(async move {
                    let ev = match engine.create_sandbox(&tenant, req).await {
                        Ok(rec) => {
                            if self_consume {
                                clear_drain_notice(&engine, &tenant, &rec.id).await;
                            }
                            Event::Started(rec.id)
                        }
                        Err(e) => Event::StartFailed(None, format!("create: {e}")),
                    };
                    let _ = tx.send(ev).await;
                });
            }
        } else if desired < self.active.len() {
            // Idle agents first; a busy one finishes its message before it sleeps.
            let excess = self.active.len() - desired;
            let mut ids: Vec<_> = self
                .active
                .iter()
                .map(|(id, l)| (l.busy.load(Ordering::Relaxed), id.clone()))
                .collect();
            ids.sort();
            for (_, id) in ids.into_iter().take(excess) {
                if let Some(lane) = self.active.remove(&id) {
                    self.drain(id, lane);
                }
            }
        }
    }

    fn start_lane(&mut self, id: &SandboxId) -> Lane {
        let drain = Arc::new(AtomicBool::new(false));
        let busy = Arc::new(AtomicBool::new(false));
        let task = self.spec().dispatch.clone().map(|d| {
            let lane = LaneWorker {
                engine: self.engine.clone(),
                tenant: self.pool.tenant.clone(),
                sandbox: id.clone(),
                trigger: self.spec().triggers[0].clone(),
                dispatch: d,
                dead_letter: self.spec().dead_letter(),
                consumer_name: format!("torpor-{}-{}", self.spec().name, id),
                pool_name: self.spec().name.clone(),
                drain: drain.clone(),
                busy: busy.clone(),
                counters: self.pool.counters.clone(),
                poke: self.pool.poke.clone(),
            };
            tokio::spawn(lane.run())
        });
        Lane { drain, busy, task }
    }

    /// Drain notice, wait for in-flight work (dispatch) or the grace period (self-consume),
    /// then suspend.
    fn drain(&mut self, id: SandboxId, mut lane: Lane) {
        self.draining.insert(id.clone());
        lane.drain.store(true, Ordering::Relaxed);
        let engine = self.engine.clone();
        let tenant = self.pool.tenant.clone();
        let tx = self.events_tx.clone();
        let grace = Duration::from_secs(self.spec().drain_grace_s);
        let self_consume = self.spec().dispatch.is_none();
        tokio::spawn(async move {
            if let Some(task) = lane.task.take() {
                let _ = task.await;
            }
            if self_consume {
                if let Err(e) = engine
                    .write_file(&tenant, &id, DRAIN_FILE, None, b"drain\n")
                    .await
                {
                    tracing::warn!(sandbox = %id, error = %e, "cannot write the drain notice");
                }
                tokio::time::sleep(grace).await;
            }
            let err = engine
                .suspend(&tenant, &id, Tier::Suspended)
                .await
                .err()
                .map(|e| format!("suspend: {e}"));
            let _ = tx.send(Event::Stopped(id, err)).await;
        });
    }

    /// Shutdown or delete: every lane finishes its message; agents are left as they are (the
    /// engine checkpoints resident sandboxes on shutdown).
    async fn stop_all(&mut self) {
        for lane in self.active.values() {
            lane.drain.store(true, Ordering::Relaxed);
        }
        for (_, mut lane) in std::mem::take(&mut self.active) {
            if let Some(t) = lane.task.take() {
                let _ = t.await;
            }
        }
    }
}

/// A self-consuming agent takes work while [`DRAIN_FILE`] is absent: clear the notice its last
/// scale-in left (or its template's golden snapshot holds) before it counts as active.
async fn clear_drain_notice(engine: &Engine, tenant: &TenantId, id: &SandboxId) {
    if let Err(e) = engine.remove_file(tenant, id, DRAIN_FILE, false).await {
        let text = e.to_string();
        if !text.contains("not found") && !text.contains("No such file") {
            tracing::warn!(sandbox = %id, error = %text, "cannot clear the drain notice");
        }
    }
}

/// A trigger's error as its pool's status shows it: for a tenant's pool (`generic`), a broker
/// that cannot be reached reads the same whatever the cause; the details are logged.
fn err_status(e: &TriggerError, generic: bool) -> TriggerErrorStatus {
    if generic && e.is_unreachable() {
        return TriggerErrorStatus {
            code: BROKER_UNREACHABLE_CODE.into(),
            message: BROKER_UNREACHABLE_MESSAGE.into(),
        };
    }
    TriggerErrorStatus {
        code: e.code().into(),
        message: e.to_string(),
    }
}

// ------------------------------------------------------------------------------- lanes

struct LaneWorker {
    engine: Arc<Engine>,
    tenant: TenantId,
    sandbox: SandboxId,
    trigger: TriggerSpec,
    dispatch: DispatchSpec,
    dead_letter: String,
    consumer_name: String,
    pool_name: PoolName,
    drain: Arc<AtomicBool>,
    busy: Arc<AtomicBool>,
    counters: Arc<Counters>,
    poke: Arc<Notify>,
}

impl LaneWorker {
    async fn run(self) {
        let mut consumer: Option<Consumer> = None;
        while !self.drain.load(Ordering::Relaxed) {
            let c = match &mut consumer {
                Some(c) => c,
                None => {
                    match Consumer::connect(&self.trigger, &self.consumer_name, &self.dead_letter)
                        .await
                    {
                        Ok(c) => consumer.insert(c),
                        Err(e) => {
                            tracing::warn!(sandbox = %self.sandbox, code = e.code(), error = %e, "lane cannot reach the broker");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                            continue;
                        }
                    }
                }
            };
            match c.next(LANE_WAIT).await {
                Ok(None) => {}
                Ok(Some(msg)) => {
                    self.busy.store(true, Ordering::Relaxed);
                    self.counters.in_flight.fetch_add(1, Ordering::Relaxed);
                    self.process(c, msg).await;
                    self.counters.in_flight.fetch_sub(1, Ordering::Relaxed);
                    self.busy.store(false, Ordering::Relaxed);
                    self.poke.notify_one();
                }
                Err(e) => {
                    tracing::warn!(sandbox = %self.sandbox, code = e.code(), error = %e, "lane lost the broker; reconnecting");
                    if let Some(c) = consumer.take() {
                        c.close().await;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
        if let Some(c) = consumer.take() {
            c.close().await;
        }
    }

    /// Runs `dispatch.command` with the message on stdin; exit 0 is success.
    async fn run_command(&self, cmd: &[String], body: &[u8]) -> std::result::Result<(), String> {
        let d = &self.dispatch;
        let req = ExecRequest {
            cmd: cmd.to_vec(),
            env: d.env.clone(),
            cwd: None,
            timeout_ms: Some(d.timeout_s * 1000),
            detach: false,
            stream: false,
        };
        match self
            .engine
            .exec(&self.tenant, &self.sandbox, req, body.to_vec())
            .await
        {
            Ok(r) if r.exit_code == Some(0) => Ok(()),
            Ok(r) => Err(format!(
                "exit {:?} signal {:?}: {}",
                r.exit_code,
                r.signal,
                r.stderr.chars().take(500).collect::<String>()
            )),
            Err(e) => Err(e.to_string()),
        }
    }

    /// POSTs the message to `dispatch.http` in the agent through the same path as the ingress
    /// proxy (the agent is woken if it sleeps and stays borrowed, so not checkpointed, until
    /// the answer has been read); a 2xx answer is success.
    async fn post(
        &self,
        h: &HttpDispatch,
        body: &[u8],
        attempt: u32,
    ) -> std::result::Result<(), String> {
        let target = self
            .engine
            .proxy_target(&self.tenant, &self.sandbox, h.port)
            .await
            .map_err(|e| e.to_string())?;
        let mut req = hyper::Request::post(h.path.as_str())
            .header(hyper::header::HOST, target.addr.to_string())
            .header("x-torpor-pool", self.pool_name.as_str())
            .header("x-torpor-attempt", attempt.to_string());
        if !h
            .headers
            .keys()
            .any(|k| k.eq_ignore_ascii_case("content-type"))
        {
            req = req.header("content-type", "application/octet-stream");
        }
        for (k, v) in &h.headers {
            req = req.header(k.as_str(), v.as_str());
        }
        let req = req
            .body(http_body_util::Full::new(bytes::Bytes::copy_from_slice(
                body,
            )))
            .map_err(|e| format!("POST port {} {}: {e}", h.port, h.path))?;
        let (addr, woke) = (target.addr, target.woke);
        let exchange = async {
            // The borrow lives until the connection is closed: the whole answer is read
            // before the agent can be checkpointed.
            let resp = crate::engine::sandbox_http(addr, req, target.in_use)
                .await
                .map_err(|e| {
                    crate::engine::count_proxied("upstream_error");
                    format!("POST port {} {}: {e}", h.port, h.path)
                })?;
            crate::engine::count_proxied(if woke { "woke" } else { "served" });
            let status = resp.status();
            let text = http_body_util::BodyExt::collect(resp.into_body())
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            Ok::<_, String>((status, text))
        };
        let (status, text) =
            tokio::time::timeout(Duration::from_secs(self.dispatch.timeout_s), exchange)
                .await
                .map_err(|_| {
                    format!(
                        "POST port {} {}: no answer within {} s",
                        h.port, h.path, self.dispatch.timeout_s
                    )
                })??;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!(
                "HTTP {status}: {}",
                String::from_utf8_lossy(&text[..text.len().min(500)])
            ))
        }
    }

    async fn process(&self, c: &mut Consumer, msg: torpor_triggers::Message) {
        let d = &self.dispatch;
        let started = Instant::now();
        for attempt in 1..=d.max_attempts {
            let failure = match (&d.command, &d.http) {
                (_, Some(h)) => self.post(h, &msg.body, attempt).await.err(),
                (Some(cmd), None) => self.run_command(cmd, &msg.body).await.err(),
                (None, None) => Some("no dispatch target".to_string()),
            };
            match failure {
                None => {
                    if let Err(e) = c.ack(msg).await {
                        // Not acknowledged: the broker hands it out again (at least once).
                        tracing::warn!(sandbox = %self.sandbox, error = %e, "ack failed; the message will be redelivered");
                    }
                    self.counters.processed.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(sandbox = %self.sandbox, ms = started.elapsed().as_millis() as u64, attempt, "message processed");
                    return;
                }
                Some(why) => {
                    self.counters
                        .failed_attempts
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(sandbox = %self.sandbox, attempt, error = %why, "dispatch attempt failed");
                    if attempt < d.max_attempts {
                        tokio::time::sleep(Duration::from_millis(d.retry_backoff_ms)).await;
                    }
                }
            }
        }
        match c.dead_letter(msg).await {
            Ok(()) => {
                self.counters.dead_lettered.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::warn!(sandbox = %self.sandbox, error = %e, "dead-lettering failed; the message will be redelivered")
            }
        }
    }
}

// ------------------------------------------------------------------------------- push

/// Pokes the controller when the broker shows new work, without taking it: a Redis
/// `BLMOVE key key RIGHT RIGHT` (a blocking no-op rotation), a Redis stream `XREAD BLOCK`, a
/// NATS subscription on the stream's subjects. RabbitMQ and Kafka have no such watch: their
/// pools poll.
async fn watch_for_work(spec: TriggerSpec, poke: Arc<Notify>, stop: watch::Receiver<bool>) {
    let mut watcher = torpor_triggers::depth::Watcher::new(spec);
    loop {
        if *stop.borrow() {
            return;
        }
        match watcher.wait(Duration::from_secs(2)).await {
            Ok(true) => {
                poke.notify_one();
                // While work stays queued the watch answers at once; lanes take it from here,
                // and the controller's polling covers the rest.
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Ok(false) => {}
            Err(TriggerError::Unsupported { .. }) => return,
            Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(tenant: &str, name: &str) -> PoolRow {
        PoolRow {
            name: name.into(),
            tenant: TenantId::new(tenant).unwrap(),
            spec_json: format!("{{\"name\":\"{name}\"}}"),
            created_at: 1,
        }
    }

    #[test]
    fn the_name_keyed_table_is_migrated_and_names_become_per_tenant() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("torpor.db")).unwrap();
        // A table as older torpor made it (the store's schema still does, on a new database).
        let old_insert = |r: &PoolRow| {
            store
                .with(|c| {
                    c.execute(
                        "INSERT OR IGNORE INTO pools(name, tenant, spec, created_at) VALUES (?1, ?2, ?3, ?4)",
                        rusqlite::params![r.name, r.tenant.as_str(), r.spec_json, r.created_at],
                    )
                })
                .unwrap()
                == 1
        };
        assert!(old_insert(&row("team-a", "jobs")));
        assert!(!old_insert(&row("team-b", "jobs")));
        table::migrate(&store).unwrap();
        table::migrate(&store).unwrap();
        let all = table::all(&store).unwrap();
        assert_eq!(
            all,
            vec![row("team-a", "jobs")],
            "rows survive the migration"
        );
        assert!(table::insert(&store, &row("team-b", "jobs")).unwrap());
        assert!(!table::insert(&store, &row("team-b", "jobs")).unwrap());
        assert_eq!(
            table::count(&store, &TenantId::new("team-a").unwrap()).unwrap(),
            1
        );
        assert!(table::delete(&store, &TenantId::new("team-b").unwrap(), "jobs").unwrap());
        assert_eq!(table::all(&store).unwrap(), vec![row("team-a", "jobs")]);
        // Opening the store again (its schema's CREATE IF NOT EXISTS) keeps the new table.
        drop(store);
        let store = Store::open(&dir.path().join("torpor.db")).unwrap();
        table::migrate(&store).unwrap();
        assert!(table::insert(&store, &row("team-b", "jobs")).unwrap());
        assert_eq!(table::all(&store).unwrap().len(), 2);
    }
}
