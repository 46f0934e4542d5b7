//! [`PostgresStore`]: the state store in PostgreSQL (cluster mode), shared by every controller.
//! Just over 1,000 lines because it implements every method of the `StateStore` trait, one
//! statement each, beside its SQLite twin; splitting it by record kind would split the trait.
//!
//! **Driver.** `tokio-postgres` (the async half of rust-postgres) with a small `deadpool`
//! connection pool, driven on a runtime of its own (two threads, `torpor-pg`). The
//! [`StateStore`] trait is synchronous and is called from inside the engine's tokio tasks:
//! the sync `postgres` crate blocks on a runtime of its own per connection and panics when
//! called from inside another runtime, so each call is instead spawned on the store's runtime
//! and the caller waits for its answer on a channel (as it waits on SQLite's mutex; on a
//! multi-threaded runtime inside `block_in_place`, so a slow database stalls only its callers).
//! Each call is one statement (or one short transaction) with a deadline ([`CALL_TIMEOUT`], and
//! the server's `statement_timeout`), and answers [`StoreErrorKind::Unavailable`] when it passes.
//!
//! **Concurrency.** Several controllers write the same rows. Every write of a sandbox row bumps
//! its `version`; [`StateStore::compare_and_set_sandbox`] is one
//! `UPDATE … WHERE id=$1 AND version=$9`, so of two controllers that read the same version
//! exactly one writes and the other gets [`StoreErrorKind::Conflict`] (the second `UPDATE`
//! waits for the first's row lock, then finds the version moved). Row locks last one statement:
//! no transaction is ever open across a network call or an `.await` outside the store.
//! Batch writes (activity, usage) are single statements over `unnest`ed arrays, their rows
//! taken in key order, so two controllers' batches cannot deadlock.
//!
//! **Connections.** A call on a connection that the server or the network closed answers
//! Unavailable and the connection leaves the pool; the next call opens a fresh one. No call is
//! retried by the store: a write whose answer was lost may have committed.
//!
//! **Env at rest.** Sandboxes' env values are sealed as in SQLite ([`crate::secrets`]), under a
//! key file every controller of one database must share (like the admin token file). The first
//! controller records a value sealed with its key in `meta`; a controller whose key does not
//! open it is refused at connect, so no controller ever seals envs the others cannot read.
//!
//! Schema and migrations: [`super::pg_schema`].

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::Path;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod};
use futures::future::BoxFuture;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{NoTls, Row};
use torpor_core::{
    Limits, NetworkPolicy, PoolName, SandboxId, SandboxState, TemplateName, TenantId, Tier,
    UnixMillis,
};
use torpor_gpu::cuda_checkpoint::Toggled;
use torpor_gpu::request::GpuRequest;

use super::pg_schema::{self, MigrateError};
use super::records::*;
use super::sqlite::{parse_sandbox, parse_template, parse_tenant, RawSandbox, RawTemplate};
use super::{
    FenceOrderRecord, LiveController, RateReport, RateUsage, SandboxCursor, StateStore, StoreError,
    FENCE_ORDER_TTL,
};

/// The most one call waits for a connection and its statement.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// The most opening one connection takes.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The most a store lock ([`StateStore::lock`]) is waited for.
const LOCK_WAIT: Duration = Duration::from_secs(20);
/// The server-side limit on one statement (set unless the URL sets `options`).
const STATEMENT_TIMEOUT_MS: u64 = 20_000;
/// Connections per controller.
const POOL_SIZE: usize = 8;

/// What the env-key check value in `meta` is sealed for (its associated data).
const ENV_KEY_CHECK_AAD: &str = "torpor-env-key-check";

type Param = Box<dyn ToSql + Sync + Send>;

fn p<T: ToSql + Sync + Send + 'static>(v: T) -> Param {
    Box::new(v)
}

fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("store values serialise")
}

pub struct PostgresStore {
    pool: Pool,
    /// The runtime the pool's connections and every call run on; `None` once dropped.
    runtime: Option<tokio::runtime::Runtime>,
    handle: tokio::runtime::Handle,
    env_seal: crate::secrets::EnvSeal,
}

impl Drop for PostgresStore {
    fn drop(&mut self) {
        // Dropping a runtime blocks, which panics inside another runtime's task.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// `url` without its password: what error messages and logs name.
pub fn describe(config: &tokio_postgres::Config) -> String {
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .zip(config.get_ports().iter().chain(std::iter::repeat(&5432)))
        .map(|(h, port)| match h {
            tokio_postgres::config::Host::Tcp(h) => format!("{h}:{port}"),
            tokio_postgres::config::Host::Unix(p) => format!("{}:{port}", p.display()),
        })
        .collect();
    format!(
        "postgres://{}@{}/{}",
        config.get_user().unwrap_or(""),
        hosts.join(","),
        config.get_dbname().unwrap_or("")
    )
}

impl PostgresStore {
    /// Connects to the database at `url` (`postgres://user:password@host:port/db`), creating
    /// or migrating its schema, with sandboxes' env sealed under the key in `env_key` (created
    /// when missing; every controller of one database needs the same file). Prefer
    /// [`super::Store::connect`].
    pub fn connect(url: &str, env_key: &Path) -> Result<PostgresStore, StoreError> {
        let mut config: tokio_postgres::Config = url.parse().map_err(|e| StoreError::Connect {
            target: "postgres URL".into(),
            source: Box::new(e),
        })?;
        let target = describe(&config);
        let connect_err = |source: crate::store::BackendError| StoreError::Connect {
            target: target.clone(),
            source,
        };
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("torpor");
        }
        if config.get_options().is_none() {
            config.options(format!(
                "-c statement_timeout={STATEMENT_TIMEOUT_MS} -c idle_in_transaction_session_timeout={STATEMENT_TIMEOUT_MS}"
            ));
        }
        config.keepalives(true);
        config.keepalives_idle(Duration::from_secs(30));
        let env_seal = crate::secrets::EnvSeal::load_or_create(env_key)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("torpor-pg")
            .enable_all()
            .build()
            .map_err(|e| connect_err(e.into()))?;
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .wait_timeout(Some(CALL_TIMEOUT))
            .create_timeout(Some(CONNECT_TIMEOUT))
            .recycle_timeout(Some(CONNECT_TIMEOUT))
            .build()
            .map_err(|e| connect_err(e.into()))?;
        let store = PostgresStore {
            pool,
            handle: runtime.handle().clone(),
            runtime: Some(runtime),
            env_seal,
        };
        let check = store.env_seal.seal(ENV_KEY_CHECK_AAD, "ok");
        let pool = store.pool.clone();
        let migrated = store.spawn_wait("migrate", async move {
            let mut client = pool.get().await.map_err(|e| StoreError::Connect {
                target: String::new(),
                source: e.into(),
            })?;
            Ok(pg_schema::migrate(&mut client, &check).await)
        });
        let migrated = match migrated {
            Ok(Ok(m)) => m,
            Ok(Err(MigrateError::Newer(found))) => {
                return Err(StoreError::NewerSchemaAt {
                    target,
                    found,
                    supported: pg_schema::SCHEMA_VERSION,
                })
            }
            Ok(Err(MigrateError::Db(e))) => return Err(connect_err(e.into())),
            Err(StoreError::Connect { source, .. }) => return Err(connect_err(source)),
            Err(e) => return Err(e),
        };
        store
            .env_seal
            .open(ENV_KEY_CHECK_AAD, &migrated.env_key_check)?;
        tracing::info!(
            database = %target,
            from = migrated.from,
            schema = pg_schema::SCHEMA_VERSION,
            "PostgreSQL state store connected"
        );
        Ok(store)
    }

    /// Runs `fut` on the store's runtime and waits for its answer (the caller's thread blocks,
    /// as on SQLite's mutex; it may be a thread of another runtime).
    /// A compare-and-set of sandbox `s` over `expected`, with the worker its container now runs
    /// on when `node` is given (the same statement: both or neither).
    fn cas_sandbox(
        &self,
        s: &SandboxRecord,
        expected: Version,
        node: Option<&str>,
    ) -> Result<Version, StoreError> {
        let mut params = sandbox_params(s);
        params.push(p(expected.0 as i64));
        params.push(p(node.is_some()));
        params.push(p(node.map(str::to_string)));
        // One statement: the UPDATE writes only over `expected` (a concurrent writer's UPDATE
        // waits for the row lock, then finds the version moved and writes nothing); the second
        // column, read from the statement's snapshot, tells a moved row from a missing one.
        let row = self
            .query_opt(
                "compare and set sandbox",
                "WITH written AS (
                     UPDATE sandboxes SET state=$2, tier=$3, last_active_at=$4, generation=$5,
                         image=$6, last_error=$7, oom_killed=$8, controller=$9, version=version+1,
                         node = CASE WHEN $11 THEN $12 ELSE node END
                     WHERE id=$1 AND version=$10 RETURNING version)
                 SELECT (SELECT version FROM written),
                        (SELECT version FROM sandboxes WHERE id=$1)",
                params,
            )?
            .ok_or_else(|| StoreError::Unavailable {
                op: "compare and set sandbox",
                source: "no result row".into(),
            })?;
        let written: Option<i64> = get(&row, 0, "sandbox version")?;
        let found: Option<i64> = get(&row, 1, "sandbox version")?;
        match (written, found) {
            (Some(v), _) => Ok(Version(v.max(0) as u64)),
            (None, None) => Err(StoreError::NotFound {
                what: "sandbox",
                key: s.id.to_string(),
            }),
            (None, Some(_)) => Err(StoreError::Conflict {
                what: "sandbox",
                key: s.id.to_string(),
                expected,
            }),
        }
    }

    fn spawn_wait<T: Send + 'static>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T, StoreError>> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.handle.spawn(async move {
            let answer = match tokio::time::timeout(CALL_TIMEOUT, fut).await {
                Ok(a) => a,
                Err(_) => Err(StoreError::Unavailable {
                    op,
                    source: "no answer from PostgreSQL within the call deadline".into(),
                }),
            };
            let _ = tx.send(answer);
        });
        let wait = move || {
            rx.recv().unwrap_or_else(|_| {
                Err(StoreError::Unavailable {
                    op,
                    source: "the state store's runtime stopped".into(),
                })
            })
        };
        // Waiting on an async runtime's worker thread: the runtime moves its other tasks off
        // this thread meanwhile. Otherwise a database whose packets vanish (a partition) holds
        // every worker thread for up to the call deadline, and the whole controller (its
        // health, calls that need no database) stalls with it.
        match tokio::runtime::Handle::try_current() {
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(wait)
            }
            _ => wait(),
        }
    }

    /// Runs `f` with a pooled connection; its errors are [`StoreError::Unavailable`] for `op`,
    /// and a connection that broke leaves the pool.
    fn with<T, F>(&self, op: &'static str, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: for<'c> FnOnce(&'c mut Object) -> BoxFuture<'c, Result<T, tokio_postgres::Error>>
            + Send
            + 'static,
    {
        let pool = self.pool.clone();
        self.spawn_wait(op, async move {
            let mut client = pool.get().await.map_err(|e| StoreError::Unavailable {
                op,
                source: e.into(),
            })?;
            match f(&mut client).await {
                Ok(v) => Ok(v),
                Err(e) => {
                    if client.is_closed() || connection_lost(&e) {
                        tracing::warn!(op, error = %e, "PostgreSQL connection lost; dropped from the pool");
                        drop(Object::take(client));
                    }
                    Err(StoreError::Unavailable {
                        op,
                        source: e.into(),
                    })
                }
            }
        })
    }

    /// One statement's rows.
    fn query(
        &self,
        op: &'static str,
        sql: &'static str,
        params: Vec<Param>,
    ) -> Result<Vec<Row>, StoreError> {
        self.with(op, move |c| {
            Box::pin(async move {
                let st = c.prepare_cached(sql).await?;
                c.query(&st, &refs(&params)).await
            })
        })
    }

    /// One statement; the number of rows it wrote.
    fn execute(
        &self,
        op: &'static str,
        sql: &'static str,
        params: Vec<Param>,
    ) -> Result<u64, StoreError> {
        self.with(op, move |c| {
            Box::pin(async move {
                let st = c.prepare_cached(sql).await?;
                c.execute(&st, &refs(&params)).await
            })
        })
    }

    fn query_opt(
        &self,
        op: &'static str,
        sql: &'static str,
        params: Vec<Param>,
    ) -> Result<Option<Row>, StoreError> {
        Ok(self.query(op, sql, params)?.into_iter().next())
    }

    /// A JSON value kept under a sandbox key (`gpu_requests`, `gpu_toggled`, network).
    fn sandbox_json<T: DeserializeOwned>(
        &self,
        what: &'static str,
        sql: &'static str,
        id: &SandboxId,
    ) -> Result<Option<T>, StoreError> {
        let corrupt = || StoreError::Corrupt {
            what,
            key: id.to_string(),
        };
        let Some(row) = self.query_opt(what, sql, vec![p(id.to_string())])? else {
            return Ok(None);
        };
        let text: String = row.try_get(0).map_err(|_| corrupt())?;
        serde_json::from_str(&text).map(Some).map_err(|_| corrupt())
    }

    fn parse_sandbox(&self, row: &Row) -> Result<(SandboxRecord, Version), StoreError> {
        let mut raw = raw_sandbox(row)?;
        raw.6 = self
            .env_seal
            .open(&raw.0, &raw.6)
            .map_err(|_| StoreError::Corrupt {
                what: "sandbox env",
                key: raw.0.clone(),
            })?;
        parse_sandbox(raw)
    }
}

fn refs(params: &[Param]) -> Vec<&(dyn ToSql + Sync)> {
    params.iter().map(|p| &**p as &(dyn ToSql + Sync)).collect()
}

/// Whether `e` means the connection is gone (closed, reset, or ended by the server), so it
/// must not be reused.
fn connection_lost(e: &tokio_postgres::Error) -> bool {
    match e.code() {
        // Not an error the server reported on a live session: I/O, closed, protocol.
        None => true,
        // Class 08: connection exception; class 57: operator intervention
        // (pg_terminate_backend, shutdown).
        Some(code) => code.code().starts_with("08") || code.code().starts_with("57"),
    }
}

fn is_unique_violation(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable { source, .. }
        if source
            .downcast_ref::<tokio_postgres::Error>()
            .and_then(tokio_postgres::Error::code)
            == Some(&SqlState::UNIQUE_VIOLATION))
}

fn get<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a Row,
    i: usize,
    what: &'static str,
) -> Result<T, StoreError> {
    row.try_get(i).map_err(|_| StoreError::Corrupt {
        what,
        key: row
            .try_get::<_, String>(0)
            .unwrap_or_else(|_| "?".to_string()),
    })
}

macro_rules! template_columns {
    () => {
        "SELECT name, tenant, spec, status, rootfs, mounts, agent_dir, golden_dir, golden_bytes,
         created_at FROM templates"
    };
}

macro_rules! sandbox_columns {
    () => {
        "SELECT id, tenant, template, state, tier, limits, env, metadata, created_at,
         last_active_at, generation, image, last_error, oom_killed, version, controller FROM sandboxes"
    };
}

fn raw_template(r: &Row) -> Result<RawTemplate, StoreError> {
    let w = "template";
    Ok((
        get(r, 0, w)?,
        get(r, 1, w)?,
        get(r, 2, w)?,
        get(r, 3, w)?,
        get(r, 4, w)?,
        get(r, 5, w)?,
        get(r, 6, w)?,
        get(r, 7, w)?,
        get(r, 8, w)?,
        get(r, 9, w)?,
    ))
}

fn raw_sandbox(r: &Row) -> Result<RawSandbox, StoreError> {
    let w = "sandbox";
    let generation: i64 = get(r, 10, w)?;
    Ok((
        get(r, 0, w)?,
        get(r, 1, w)?,
        get(r, 2, w)?,
        get(r, 3, w)?,
        get(r, 4, w)?,
        get(r, 5, w)?,
        get(r, 6, w)?,
        get(r, 7, w)?,
        get(r, 8, w)?,
        get(r, 9, w)?,
        u32::try_from(generation).map_err(|_| StoreError::Corrupt {
            what: w,
            key: get::<String>(r, 0, w).unwrap_or_default(),
        })?,
        get(r, 11, w)?,
        get(r, 12, w)?,
        get(r, 13, w)?,
        get(r, 14, w)?,
        get(r, 15, w)?,
    ))
}

fn sandbox_params(s: &SandboxRecord) -> Vec<Param> {
    vec![
        p(s.id.to_string()),
        p(s.state.as_str()),
        p(s.tier.as_str()),
        p(s.last_active_at),
        p(i64::from(s.generation)),
        p(json(&s.image)),
        p(s.last_error.clone()),
        p(s.oom_killed),
        p(s.controller.clone()),
    ]
}

impl StateStore for PostgresStore {
    // --- templates ---

    fn insert_template(&self, t: &TemplateRecord) -> Result<bool, StoreError> {
        let n = self.execute(
            "insert template",
            "INSERT INTO templates
             (name, tenant, spec, status, rootfs, mounts, agent_dir, golden_dir, golden_bytes, created_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) ON CONFLICT DO NOTHING",
            vec![
                p(t.name.to_string()),
                p(t.tenant.to_string()),
                p(json(&t.spec)),
                p(json(&t.status)),
                p(t.rootfs.to_string_lossy().into_owned()),
                p(json(&t.mounts)),
                p(t.agent_dir.to_string_lossy().into_owned()),
                p(t.golden_dir.to_string_lossy().into_owned()),
                p(t.golden_bytes as i64),
                p(t.created_at),
            ],
        )?;
        Ok(n == 1)
    }

    fn update_template(&self, t: &TemplateRecord) -> Result<(), StoreError> {
        self.execute(
            "update template",
            "UPDATE templates SET status=$2, mounts=$3, agent_dir=$4, golden_bytes=$5, spec=$6
             WHERE name=$1 AND tenant=$7",
            vec![
                p(t.name.to_string()),
                p(json(&t.status)),
                p(json(&t.mounts)),
                p(t.agent_dir.to_string_lossy().into_owned()),
                p(t.golden_bytes as i64),
                p(json(&t.spec)),
                p(t.tenant.to_string()),
            ],
        )
        .map(drop)
    }

    fn delete_template(&self, owner: &TenantId, name: &TemplateName) -> Result<(), StoreError> {
        self.execute(
            "delete template",
            "DELETE FROM templates WHERE name=$1 AND tenant=$2",
            vec![p(name.to_string()), p(owner.to_string())],
        )
        .map(drop)
    }

    fn template(
        &self,
        owner: &TenantId,
        name: &TemplateName,
    ) -> Result<Option<TemplateRecord>, StoreError> {
        const SQL: &str = concat!(template_columns!(), " WHERE name=$1 AND tenant=$2");
        self.query_opt(
            "read template",
            SQL,
            vec![p(name.to_string()), p(owner.to_string())],
        )?
        .map(|r| raw_template(&r).and_then(parse_template))
        .transpose()
    }

    fn templates(&self) -> Result<Vec<TemplateRecord>, StoreError> {
        const SQL: &str = concat!(template_columns!(), " ORDER BY name, tenant");
        self.query("read templates", SQL, Vec::new())?
            .iter()
            .map(|r| raw_template(r).and_then(parse_template))
            .collect()
    }

    // --- sandboxes ---

    fn insert_sandbox(&self, s: &SandboxRecord) -> Result<(), StoreError> {
        let result = self.execute(
            "insert sandbox",
            "INSERT INTO sandboxes
             (id, tenant, template, state, tier, limits, env, metadata, created_at, last_active_at,
              generation, image, last_error, oom_killed, controller, version)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, 0)",
            vec![
                p(s.id.to_string()),
                p(s.tenant.to_string()),
                p(s.template.to_string()),
                p(s.state.as_str()),
                p(s.tier.as_str()),
                p(json(&s.limits)),
                p(self.env_seal.seal(s.id.as_str(), &json(&s.env))),
                p(json(&s.metadata)),
                p(s.created_at),
                p(s.last_active_at),
                p(i64::from(s.generation)),
                p(json(&s.image)),
                p(s.last_error.clone()),
                p(s.oom_killed),
                p(s.controller.clone()),
            ],
        );
        match result {
            Ok(_) => Ok(()),
            Err(e) if is_unique_violation(&e) => Err(StoreError::Conflict {
                what: "sandbox",
                key: s.id.to_string(),
                expected: Version(0),
            }),
            Err(e) => Err(e),
        }
    }

    fn update_sandbox(&self, s: &SandboxRecord) -> Result<(), StoreError> {
        self.execute(
            "update sandbox",
            "UPDATE sandboxes SET state=$2, tier=$3, last_active_at=$4, generation=$5, image=$6,
             last_error=$7, oom_killed=$8, controller=$9, version=version+1 WHERE id=$1",
            sandbox_params(s),
        )
        .map(drop)
    }

    fn compare_and_set_sandbox(
        &self,
        s: &SandboxRecord,
        expected: Version,
    ) -> Result<Version, StoreError> {
        self.cas_sandbox(s, expected, None)
    }

    fn compare_and_set_sandbox_on(
        &self,
        s: &SandboxRecord,
        expected: Version,
        node: &str,
    ) -> Result<Version, StoreError> {
        self.cas_sandbox(s, expected, Some(node))
    }

    fn sandbox_versioned(
        &self,
        id: &SandboxId,
    ) -> Result<Option<(SandboxRecord, Version)>, StoreError> {
        const SQL: &str = concat!(sandbox_columns!(), " WHERE id=$1");
        self.query_opt("read sandbox", SQL, vec![p(id.to_string())])?
            .map(|r| self.parse_sandbox(&r))
            .transpose()
    }

    fn sandboxes_by_id(&self, ids: &[SandboxId]) -> Result<Vec<SandboxRecord>, StoreError> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        const SQL: &str = concat!(sandbox_columns!(), " WHERE id = ANY($1)");
        let ids: Vec<String> = ids.iter().map(|id| id.to_string()).collect();
        self.query("read sandboxes by id", SQL, vec![p(ids)])?
            .iter()
            .map(|r| self.parse_sandbox(r).map(|(s, _)| s))
            .collect()
    }

    fn set_sandbox_metadata(
        &self,
        id: &SandboxId,
        metadata: &BTreeMap<String, String>,
    ) -> Result<(), StoreError> {
        self.execute(
            "set sandbox metadata",
            "UPDATE sandboxes SET metadata=$2 WHERE id=$1",
            vec![p(id.to_string()), p(json(metadata))],
        )
        .map(drop)
    }

    fn set_sandbox_node(&self, id: &SandboxId, node: Option<&str>) -> Result<(), StoreError> {
        self.execute(
            "set sandbox node",
            "UPDATE sandboxes SET node=$2 WHERE id=$1",
            vec![p(id.to_string()), p(node.map(str::to_string))],
        )
        .map(drop)
    }

    fn sandbox_node(&self, id: &SandboxId) -> Result<Option<String>, StoreError> {
        match self.query_opt(
            "sandbox node",
            "SELECT node FROM sandboxes WHERE id = $1",
            vec![p(id.to_string())],
        )? {
            Some(row) => get(&row, 0, "sandbox node"),
            None => Ok(None),
        }
    }

    fn sandbox_nodes(&self) -> Result<HashMap<SandboxId, String>, StoreError> {
        self.query(
            "sandbox nodes",
            "SELECT id, node FROM sandboxes WHERE node IS NOT NULL",
            Vec::new(),
        )?
        .iter()
        .map(|row| {
            let id: String = get(row, 0, "sandbox node")?;
            let node: String = get(row, 1, "sandbox node")?;
            let id = SandboxId::new(&id).map_err(|_| StoreError::Corrupt {
                what: "sandbox node",
                key: id.clone(),
            })?;
            Ok((id, node))
        })
        .collect()
    }

    fn touch_sandboxes(&self, touched: &[(SandboxId, UnixMillis)]) -> Result<(), StoreError> {
        if touched.is_empty() {
            return Ok(());
        }
        let ids: Vec<String> = touched.iter().map(|(id, _)| id.to_string()).collect();
        let ats: Vec<i64> = touched.iter().map(|(_, at)| *at).collect();
        self.execute(
            "touch sandboxes",
            "UPDATE sandboxes s SET last_active_at = t.at
             FROM (SELECT id, max(at) AS at FROM unnest($1::text[], $2::bigint[]) AS u(id, at)
                   GROUP BY id ORDER BY id) t
             WHERE s.id = t.id AND s.last_active_at < t.at",
            vec![p(ids), p(ats)],
        )
        .map(drop)
    }

    fn delete_sandbox(&self, id: &SandboxId) -> Result<(), StoreError> {
        self.execute(
            "delete sandbox",
            "WITH network AS (DELETE FROM sandbox_network WHERE id=$1)
             DELETE FROM sandboxes WHERE id=$1",
            vec![p(id.to_string())],
        )
        .map(drop)
    }

    fn sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        const SQL: &str = concat!(sandbox_columns!(), " ORDER BY created_at, id");
        self.query("read sandboxes", SQL, Vec::new())?
            .iter()
            .map(|r| self.parse_sandbox(r).map(|(s, _)| s))
            .collect()
    }

    fn sandboxes_of(&self, tenant: &TenantId) -> Result<Vec<SandboxRecord>, StoreError> {
        const SQL: &str = concat!(
            sandbox_columns!(),
            " WHERE tenant=$1 ORDER BY created_at, id"
        );
        self.query(
            "read a tenant's sandboxes",
            SQL,
            vec![p(tenant.to_string())],
        )?
        .iter()
        .map(|r| self.parse_sandbox(r).map(|(s, _)| s))
        .collect()
    }

    fn sandboxes_page(
        &self,
        tenant: Option<&TenantId>,
        state: Option<&str>,
        after: Option<&SandboxCursor>,
        limit: usize,
    ) -> Result<Vec<SandboxRecord>, StoreError> {
        // Range scans of `sandboxes_created` and `sandboxes_tenant_created` (schemas 1 and 3)
        // from the cursor on; the first page starts below every key.
        const PAGE: &str = concat!(
            sandbox_columns!(),
            " WHERE (created_at, id) > ($1, $2)
              AND ($3::text IS NULL OR state = $3 OR tier = $3)
              ORDER BY created_at, id LIMIT $4"
        );
        const PAGE_OF_TENANT: &str = concat!(
            sandbox_columns!(),
            " WHERE tenant = $5 AND (created_at, id) > ($1, $2)
              AND ($3::text IS NULL OR state = $3 OR tier = $3)
              ORDER BY created_at, id LIMIT $4"
        );
        let (at, id) = after.map_or((UnixMillis::MIN, String::new()), |a| {
            (a.created_at, a.id.to_string())
        });
        let mut params = vec![
            p(at),
            p(id),
            p(state.map(str::to_string)),
            p(i64::try_from(limit).unwrap_or(i64::MAX)),
        ];
        let sql = match tenant {
            Some(t) => {
                params.push(p(t.to_string()));
                PAGE_OF_TENANT
            }
            None => PAGE,
        };
        self.query("read a page of sandboxes", sql, params)?
            .iter()
            .map(|r| self.parse_sandbox(r).map(|(s, _)| s))
            .collect()
    }

    fn sandboxes_with_metadata(&self, key: &str) -> Result<Vec<SandboxRecord>, StoreError> {
        const SQL: &str = concat!(
            sandbox_columns!(),
            " WHERE strpos(metadata, $1) > 0 ORDER BY created_at, id"
        );
        let mut out = self
            .query(
                "read sandboxes by metadata key",
                SQL,
                vec![p(super::metadata_key_text(key))],
            )?
            .iter()
            .map(|r| self.parse_sandbox(r).map(|(s, _)| s))
            .collect::<Result<Vec<_>, _>>()?;
        out.retain(|s| s.metadata.contains_key(key));
        Ok(out)
    }

    fn sandboxes_to_tend(
        &self,
        parked_before: UnixMillis,
    ) -> Result<Vec<SandboxRecord>, StoreError> {
        // Both halves are partial indexes (schema 3): the awake few and the parked by age.
        const SQL: &str = concat!(
            sandbox_columns!(),
            " WHERE state NOT IN ('parked', 'suspended')
              OR (state = 'parked' AND last_active_at < $1)
              ORDER BY created_at, id"
        );
        self.query("read the sandboxes to tend", SQL, vec![p(parked_before)])?
            .iter()
            .map(|r| self.parse_sandbox(r).map(|(s, _)| s))
            .collect()
    }

    fn sandbox_counts(&self) -> Result<Vec<(SandboxState, Tier, u64)>, StoreError> {
        self.query(
            "count sandboxes",
            "SELECT state, tier, count(*) FROM sandboxes GROUP BY state, tier",
            Vec::new(),
        )?
        .iter()
        .map(|r| {
            let state: String = get(r, 0, "sandbox count")?;
            let tier: String = get(r, 1, "sandbox count")?;
            let n: i64 = get(r, 2, "sandbox count")?;
            super::state_count(&state, &tier, n)
        })
        .collect()
    }

    fn count_sandboxes_of_template(
        &self,
        owner: &TenantId,
        name: &TemplateName,
    ) -> Result<u64, StoreError> {
        let row = self.query_opt(
            "count sandboxes of a template",
            "SELECT COUNT(*) FROM sandboxes s WHERE s.template=$1 AND (s.tenant=$2 OR ($2=$3
               AND NOT EXISTS (SELECT 1 FROM templates t
                               WHERE t.name=$1 AND t.tenant=s.tenant AND t.tenant<>$3)))",
            vec![
                p(name.to_string()),
                p(owner.to_string()),
                p(TenantId::admin().to_string()),
            ],
        )?;
        let n: i64 = row.map_or(Ok(0), |r| get(&r, 0, "sandbox count"))?;
        Ok(n.max(0) as u64)
    }

    // --- network ---

    fn set_network(&self, id: &SandboxId, policy: &NetworkPolicy) -> Result<(), StoreError> {
        self.execute(
            "set network policy",
            "INSERT INTO sandbox_network (id, policy) VALUES ($1, $2)
             ON CONFLICT (id) DO UPDATE SET policy=excluded.policy",
            vec![p(id.to_string()), p(json(policy))],
        )
        .map(drop)
    }

    fn network(&self, id: &SandboxId) -> Result<Option<NetworkPolicy>, StoreError> {
        self.sandbox_json(
            "sandbox network policy",
            "SELECT policy FROM sandbox_network WHERE id=$1",
            id,
        )
    }

    // --- tenants ---

    fn insert_tenant(&self, t: &TenantRecord, token_hash: &str) -> Result<bool, StoreError> {
        let n = self.execute(
            "insert tenant",
            "INSERT INTO tenants (id, token_hash, created_at, quotas) VALUES ($1, $2, $3, $4)
             ON CONFLICT DO NOTHING",
            vec![
                p(t.id.to_string()),
                p(token_hash.to_string()),
                p(t.created_at),
                p(json(&t.quotas)),
            ],
        )?;
        Ok(n == 1)
    }

    fn tenant_by_token_hash(&self, token_hash: &str) -> Result<Option<TenantId>, StoreError> {
        let Some(row) = self.query_opt(
            "find tenant by token",
            "SELECT id FROM tenants WHERE token_hash=$1",
            vec![p(token_hash.to_string())],
        )?
        else {
            return Ok(None);
        };
        let id: String = get(&row, 0, "tenant")?;
        TenantId::new(&id)
            .map(Some)
            .map_err(|_| StoreError::Corrupt {
                what: "tenant",
                key: id.clone(),
            })
    }

    fn tenants(&self) -> Result<Vec<TenantRecord>, StoreError> {
        self.query(
            "read tenants",
            "SELECT id, created_at, quotas FROM tenants ORDER BY id",
            Vec::new(),
        )?
        .iter()
        .map(raw_tenant)
        .collect()
    }

    fn tenant(&self, id: &TenantId) -> Result<Option<TenantRecord>, StoreError> {
        self.query_opt(
            "read tenant",
            "SELECT id, created_at, quotas FROM tenants WHERE id=$1",
            vec![p(id.to_string())],
        )?
        .as_ref()
        .map(raw_tenant)
        .transpose()
    }

    fn delete_tenant(&self, id: &TenantId) -> Result<bool, StoreError> {
        self.execute(
            "delete tenant",
            "DELETE FROM tenants WHERE id=$1",
            vec![p(id.to_string())],
        )
        .map(|n| n == 1)
    }

    fn usage(&self, tenant: &TenantId) -> Result<Usage, StoreError> {
        let mut u = Usage::default();
        let rows = self.query(
            "read a tenant's holdings",
            "SELECT state, limits FROM sandboxes WHERE tenant=$1",
            vec![p(tenant.to_string())],
        )?;
        for row in rows {
            let state: String = get(&row, 0, "sandbox")?;
            let limits: String = get(&row, 1, "sandbox")?;
            u.sandboxes += 1;
            if SandboxState::parse(&state).is_some_and(|s| s.may_have_container()) {
                u.resident += 1;
                if let Ok(l) = serde_json::from_str::<Limits>(&limits) {
                    u.resident_memory_mib += l.memory_mib;
                    u.resident_millicpus += (l.cpus * 1000.0).round() as u64;
                }
            }
        }
        Ok(u)
    }

    // --- snapshot sizes ---

    fn set_snapshot_bytes(&self, snapshot: &str, bytes: u64) -> Result<(), StoreError> {
        self.execute(
            "set snapshot size",
            "INSERT INTO snapshot_bytes(snapshot, bytes) VALUES ($1, $2)
             ON CONFLICT (snapshot) DO UPDATE SET bytes=excluded.bytes",
            vec![
                p(snapshot.to_string()),
                p(bytes.min(i64::MAX as u64) as i64),
            ],
        )
        .map(drop)
    }

    fn snapshot_bytes(&self, snapshot: &str) -> Result<u64, StoreError> {
        let row = self.query_opt(
            "read snapshot size",
            "SELECT bytes FROM snapshot_bytes WHERE snapshot=$1",
            vec![p(snapshot.to_string())],
        )?;
        let bytes: i64 = row.map_or(Ok(0), |r| get(&r, 0, "snapshot size"))?;
        Ok(bytes.max(0) as u64)
    }

    fn forget_snapshot_bytes(&self, snapshot: &str) -> Result<(), StoreError> {
        self.execute(
            "forget snapshot size",
            "DELETE FROM snapshot_bytes WHERE snapshot=$1",
            vec![p(snapshot.to_string())],
        )
        .map(drop)
    }

    // --- pools ---

    fn insert_pool(&self, pool: &PoolRow) -> Result<bool, StoreError> {
        self.execute(
            "insert pool",
            "INSERT INTO pools(tenant, name, spec, created_at) VALUES ($1, $2, $3, $4)
             ON CONFLICT DO NOTHING",
            vec![
                p(pool.tenant.to_string()),
                p(pool.name.to_string()),
                p(pool.spec_json.clone()),
                p(pool.created_at),
            ],
        )
        .map(|n| n == 1)
    }

    fn delete_pool(&self, tenant: &TenantId, name: &PoolName) -> Result<bool, StoreError> {
        self.execute(
            "delete pool",
            "DELETE FROM pools WHERE tenant=$1 AND name=$2",
            vec![p(tenant.to_string()), p(name.to_string())],
        )
        .map(|n| n == 1)
    }

    fn count_pools(&self, tenant: &TenantId) -> Result<u64, StoreError> {
        let row = self.query_opt(
            "count pools",
            "SELECT COUNT(*) FROM pools WHERE tenant=$1",
            vec![p(tenant.to_string())],
        )?;
        let n: i64 = row.map_or(Ok(0), |r| get(&r, 0, "pool count"))?;
        Ok(n.max(0) as u64)
    }

    fn pool_names(&self) -> Result<Vec<(TenantId, PoolName)>, StoreError> {
        self.query(
            "read pool names",
            "SELECT tenant, name FROM pools ORDER BY tenant, name",
            Vec::new(),
        )?
        .iter()
        .map(|r| pool_key(get(r, 0, "pool")?, get(r, 1, "pool")?))
        .collect()
    }

    fn pools(&self) -> Result<Vec<PoolRow>, StoreError> {
        self.query(
            "read pools",
            "SELECT tenant, name, spec, created_at FROM pools ORDER BY tenant, name",
            Vec::new(),
        )?
        .iter()
        .map(|r| {
            let (tenant, name) = pool_key(get(r, 0, "pool")?, get(r, 1, "pool")?)?;
            Ok(PoolRow {
                tenant,
                name,
                spec_json: get(r, 2, "pool")?,
                created_at: get(r, 3, "pool")?,
            })
        })
        .collect()
    }

    // --- GPU ---

    fn gpu_shares(&self) -> Result<Vec<(SandboxId, ShareRecord)>, StoreError> {
        let rows = self.query(
            "read GPU shares",
            "SELECT sandbox, data FROM gpu_shares ORDER BY sandbox",
            Vec::new(),
        )?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let sandbox: String = get(&row, 0, "GPU share")?;
            let data: String = get(&row, 1, "GPU share")?;
            let id = match SandboxId::new(sandbox.clone()) {
                Ok(id) => id,
                Err(e) => {
                    tracing::error!(%sandbox, error = %e, "GPU share row with a bad sandbox id; ignored");
                    continue;
                }
            };
            match serde_json::from_str::<ShareRecord>(&data) {
                Ok(r) => out.push((id, r)),
                Err(e) => {
                    tracing::error!(%sandbox, error = %e, "unreadable GPU share row; ignored")
                }
            }
        }
        Ok(out)
    }

    fn put_gpu_share(&self, id: &SandboxId, record: &ShareRecord) -> Result<(), StoreError> {
        self.execute(
            "write GPU share",
            "INSERT INTO gpu_shares(sandbox, state, data) VALUES ($1, $2, $3)
             ON CONFLICT (sandbox) DO UPDATE SET state=excluded.state, data=excluded.data",
            vec![p(id.to_string()), p(record.state()), p(json(record))],
        )
        .map(drop)
    }

    fn delete_gpu_share(&self, id: &SandboxId) -> Result<(), StoreError> {
        self.execute(
            "delete GPU share",
            "DELETE FROM gpu_shares WHERE sandbox=$1",
            vec![p(id.to_string())],
        )
        .map(drop)
    }

    fn put_gpu_request(&self, id: &SandboxId, request: &GpuRequest) -> Result<(), StoreError> {
        self.execute(
            "write GPU request",
            "INSERT INTO gpu_requests(sandbox, request) VALUES ($1, $2)
             ON CONFLICT (sandbox) DO UPDATE SET request=excluded.request",
            vec![p(id.to_string()), p(json(request))],
        )
        .map(drop)
    }

    fn gpu_request(&self, id: &SandboxId) -> Result<Option<GpuRequest>, StoreError> {
        self.sandbox_json(
            "GPU request",
            "SELECT request FROM gpu_requests WHERE sandbox=$1",
            id,
        )
    }

    fn delete_gpu_request(&self, id: &SandboxId) -> Result<bool, StoreError> {
        self.execute(
            "delete GPU request",
            "DELETE FROM gpu_requests WHERE sandbox=$1",
            vec![p(id.to_string())],
        )
        .map(|n| n > 0)
    }

    fn put_gpu_toggled(&self, id: &SandboxId, toggled: &Toggled) -> Result<(), StoreError> {
        self.execute(
            "write cuda-checkpoint record",
            "INSERT INTO gpu_toggled(sandbox, toggled) VALUES ($1, $2)
             ON CONFLICT (sandbox) DO UPDATE SET toggled=excluded.toggled",
            vec![p(id.to_string()), p(json(toggled))],
        )
        .map(drop)
    }

    fn gpu_toggled(&self, id: &SandboxId) -> Result<Option<Toggled>, StoreError> {
        self.sandbox_json(
            "cuda-checkpoint record",
            "SELECT toggled FROM gpu_toggled WHERE sandbox=$1",
            id,
        )
    }

    fn delete_gpu_toggled(&self, id: &SandboxId) -> Result<(), StoreError> {
        self.execute(
            "delete cuda-checkpoint record",
            "DELETE FROM gpu_toggled WHERE sandbox=$1",
            vec![p(id.to_string())],
        )
        .map(drop)
    }

    // --- controllers and leases ---

    fn claim_controller(
        &self,
        me: &LiveController,
        run: &str,
        starting: bool,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        // One statement: the row is written when free, expired, this run's, or (at the start)
        // a previous run's at the same addresses; otherwise nothing comes back.
        let row = self.query_opt(
            "claim controller",
            "INSERT INTO controllers (name, api_addr, peer_addr, run_id, expires_at, call_rate)
             VALUES ($1, $2, $3, $4, now() + $5 * interval '1 millisecond', $7)
             ON CONFLICT (name) DO UPDATE SET api_addr = excluded.api_addr,
                 peer_addr = excluded.peer_addr, run_id = excluded.run_id,
                 expires_at = excluded.expires_at, call_rate = excluded.call_rate
             WHERE controllers.run_id IS NOT DISTINCT FROM excluded.run_id
                OR controllers.expires_at <= now()
                OR ($6 AND controllers.api_addr = excluded.api_addr
                    AND controllers.peer_addr IS NOT DISTINCT FROM excluded.peer_addr)
             RETURNING name",
            vec![
                p(me.name.clone()),
                p(me.api_addr.clone()),
                p(me.peer_addr.clone()),
                p(run.to_string()),
                p(ttl.as_millis() as f64),
                p(starting),
                p(me.call_rate),
            ],
        )?;
        Ok(row.is_some())
    }

    fn live_controllers(&self) -> Result<Vec<LiveController>, StoreError> {
        self.query(
            "read controllers",
            "SELECT name, api_addr, peer_addr, call_rate FROM controllers
             WHERE expires_at > now() ORDER BY name",
            Vec::new(),
        )?
        .iter()
        .map(|r| {
            Ok(LiveController {
                name: get(r, 0, "controller")?,
                api_addr: get(r, 1, "controller")?,
                peer_addr: get(r, 2, "controller")?,
                call_rate: get(r, 3, "controller")?,
            })
        })
        .collect()
    }

    fn put_rate_usage(&self, me: &str, usage: &[RateUsage]) -> Result<(), StoreError> {
        let usage: Vec<&RateUsage> = usage.iter().filter(|u| u.count > 0).collect();
        if usage.is_empty() {
            return Ok(());
        }
        let tenants: Vec<String> = usage.iter().map(|u| u.tenant.clone()).collect();
        let classes: Vec<String> = usage.iter().map(|u| u.class.clone()).collect();
        let counts: Vec<i64> = usage
            .iter()
            .map(|u| i64::try_from(u.count).unwrap_or(i64::MAX))
            .collect();
        self.execute(
            "report rate usage",
            "INSERT INTO rate_usage (controller, tenant, class, count)
             SELECT $1, t, c, n FROM unnest($2::text[], $3::text[], $4::bigint[]) AS u(t, c, n)",
            vec![p(me.to_string()), p(tenants), p(classes), p(counts)],
        )
        .map(drop)
    }

    fn rate_usage_of_others(
        &self,
        me: &str,
        within: Duration,
    ) -> Result<Vec<RateReport>, StoreError> {
        self.query(
            "read rate usage",
            "SELECT id, tenant, class, count FROM rate_usage
             WHERE controller <> $1 AND at > now() - $2 * interval '1 millisecond'
             ORDER BY id",
            vec![p(me.to_string()), p(within.as_millis() as f64)],
        )?
        .iter()
        .map(|r| {
            let count: i64 = get(r, 3, "rate usage")?;
            Ok(RateReport {
                id: get(r, 0, "rate usage")?,
                usage: RateUsage {
                    tenant: get(r, 1, "rate usage")?,
                    class: get(r, 2, "rate usage")?,
                    count: count.max(0) as u64,
                },
            })
        })
        .collect()
    }

    fn prune_rate_usage(&self, age: Duration) -> Result<u64, StoreError> {
        self.execute(
            "prune rate usage",
            "DELETE FROM rate_usage WHERE at < now() - $1 * interval '1 millisecond'",
            vec![p(age.as_millis() as f64)],
        )
    }

    fn forget_controller(&self, name: &str, run: &str) -> Result<(), StoreError> {
        self.execute(
            "forget controller",
            "DELETE FROM controllers WHERE name=$1 AND run_id=$2",
            vec![p(name.to_string()), p(run.to_string())],
        )
        .map(drop)
    }

    fn try_lease(&self, lease: &str, holder: &str, ttl: Duration) -> Result<bool, StoreError> {
        // One statement: the row is taken when free, expired or already ours; otherwise the
        // conflicting UPDATE writes nothing and no row comes back.
        let row = self.query_opt(
            "take lease",
            "INSERT INTO leases (name, holder, expires_at)
             VALUES ($1, $2, now() + $3 * interval '1 millisecond')
             ON CONFLICT (name) DO UPDATE SET holder = excluded.holder,
                 expires_at = excluded.expires_at
             WHERE leases.holder = excluded.holder OR leases.expires_at <= now()
             RETURNING holder",
            vec![
                p(lease.to_string()),
                p(holder.to_string()),
                p(ttl.as_millis() as f64),
            ],
        )?;
        Ok(row.is_some())
    }

    fn live_leases(&self, prefix: &str) -> Result<Vec<(String, String)>, StoreError> {
        self.query(
            "read leases",
            "SELECT name, holder FROM leases
             WHERE starts_with(name, $1) AND expires_at > now() ORDER BY name",
            vec![p(prefix.to_string())],
        )?
        .iter()
        .map(|r| Ok((get(r, 0, "lease")?, get(r, 1, "lease")?)))
        .collect()
    }

    fn take_leases(
        &self,
        leases: &[String],
        holder: &str,
        ttl: Duration,
    ) -> Result<Vec<String>, StoreError> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        self.query(
            "take leases",
            "INSERT INTO leases (name, holder, expires_at)
             SELECT n, $2, now() + $3 * interval '1 millisecond' FROM unnest($1::text[]) AS u(n)
             ON CONFLICT (name) DO UPDATE SET holder = excluded.holder,
                 expires_at = excluded.expires_at
             WHERE leases.holder = excluded.holder OR leases.expires_at <= now()
             RETURNING name",
            vec![
                p(leases.to_vec()),
                p(holder.to_string()),
                p(ttl.as_millis() as f64),
            ],
        )?
        .iter()
        .map(|r| get(r, 0, "lease"))
        .collect()
    }

    fn lock(&self, key: &str) -> Result<super::StoreLock, StoreError> {
        // A session-level advisory lock on one pooled connection, kept out of the pool until
        // it is unlocked. `pg_try_advisory_lock` in a loop rather than `pg_advisory_lock`: a
        // wait that passes the call deadline leaves no lock request queued on the server.
        let key = key.to_string();
        let pool = self.pool.clone();
        let op = "take lock";
        let client = self.spawn_wait(op, async move {
            let client = pool.get().await.map_err(|e| StoreError::Unavailable {
                op,
                source: e.into(),
            })?;
            let deadline = tokio::time::Instant::now() + LOCK_WAIT;
            loop {
                let got: bool = client
                    .query_one(
                        "SELECT pg_try_advisory_lock(hashtextextended($1, 0))",
                        &[&key],
                    )
                    .await
                    .and_then(|r| r.try_get(0))
                    .map_err(|e| StoreError::Unavailable {
                        op,
                        source: e.into(),
                    })?;
                if got {
                    return Ok((client, key));
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(StoreError::Unavailable {
                        op,
                        source: format!("lock {key:?} still held after {LOCK_WAIT:?}").into(),
                    });
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })?;
        let handle = self.handle.clone();
        Ok(super::StoreLock::new(move || {
            let (client, key) = client;
            handle.spawn(async move {
                if let Err(e) = client
                    .execute("SELECT pg_advisory_unlock(hashtextextended($1, 0))", &[&key])
                    .await
                {
                    // The session keeps the lock: the connection must not go back to the pool.
                    tracing::warn!(error = %e, key, "cannot release a store lock; dropping its connection");
                    drop(Object::take(client));
                }
            });
        }))
    }

    fn pass_lease(
        &self,
        lease: &str,
        from: &str,
        to: &str,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let row = self.query_opt(
            "pass lease",
            "UPDATE leases SET holder = $3, expires_at = now() + $4 * interval '1 millisecond'
             WHERE name = $1 AND holder = $2 AND expires_at > now()
             RETURNING name",
            vec![
                p(lease.to_string()),
                p(from.to_string()),
                p(to.to_string()),
                p(ttl.as_millis() as f64),
            ],
        )?;
        Ok(row.is_some())
    }

    fn release_lease(&self, lease: &str, holder: &str) -> Result<(), StoreError> {
        self.execute(
            "release lease",
            "DELETE FROM leases WHERE name=$1 AND holder=$2",
            vec![p(lease.to_string()), p(holder.to_string())],
        )
        .map(drop)
    }

    // --- usage intervals ---

    fn put_fence_orders(
        &self,
        worker: &str,
        owner: &str,
        containers: &[String],
    ) -> Result<(), StoreError> {
        self.execute(
            "drop old fence orders",
            "DELETE FROM fence_orders WHERE ordered_at < now() - $1 * interval '1 millisecond'",
            vec![p(FENCE_ORDER_TTL.as_millis() as f64)],
        )?;
        if containers.is_empty() {
            return Ok(());
        }
        self.execute(
            "order containers fenced",
            "INSERT INTO fence_orders (worker, container, owner)
             SELECT $1, c, $2 FROM unnest($3::text[]) AS c
             ON CONFLICT (worker, container) DO UPDATE SET owner = excluded.owner,
                 ordered_at = now(), relayed = false",
            vec![
                p(worker.to_string()),
                p(owner.to_string()),
                p(containers.to_vec()),
            ],
        )
        .map(drop)
    }

    fn fence_orders(&self) -> Result<Vec<FenceOrderRecord>, StoreError> {
        self.query(
            "read fence orders",
            "SELECT worker, container, owner, relayed FROM fence_orders
             WHERE ordered_at >= now() - $1 * interval '1 millisecond'
             ORDER BY worker, container",
            vec![p(FENCE_ORDER_TTL.as_millis() as f64)],
        )?
        .iter()
        .map(|r| {
            Ok(FenceOrderRecord {
                worker: get(r, 0, "fence order")?,
                container: get(r, 1, "fence order")?,
                owner: get(r, 2, "fence order")?,
                relayed: get(r, 3, "fence order")?,
            })
        })
        .collect()
    }

    fn fence_orders_relayed(&self, worker: &str, containers: &[String]) -> Result<(), StoreError> {
        if containers.is_empty() {
            return Ok(());
        }
        self.execute(
            "mark fence orders relayed",
            "UPDATE fence_orders SET relayed = true WHERE worker = $1 AND container = ANY($2)",
            vec![p(worker.to_string()), p(containers.to_vec())],
        )
        .map(drop)
    }

    fn fence_orders_done(&self, worker: &str, containers: &[String]) -> Result<(), StoreError> {
        if containers.is_empty() {
            return Ok(());
        }
        self.execute(
            "remove fence orders",
            "DELETE FROM fence_orders WHERE worker = $1 AND container = ANY($2)",
            vec![p(worker.to_string()), p(containers.to_vec())],
        )
        .map(drop)
    }

    fn put_ticket_forget(&self, worker: &str, sandbox: &str) -> Result<(), StoreError> {
        self.execute(
            "keep a ticket to drop",
            "INSERT INTO gpu_ticket_forgets (worker, sandbox) VALUES ($1, $2)
             ON CONFLICT (worker, sandbox) DO NOTHING",
            vec![p(worker.to_string()), p(sandbox.to_string())],
        )
        .map(drop)
    }

    fn ticket_forgets(&self, limit: usize) -> Result<Vec<(String, String, u64)>, StoreError> {
        self.query(
            "read tickets to drop",
            "SELECT worker, sandbox,
                    (EXTRACT(EPOCH FROM (now() - since)) * 1000)::BIGINT
             FROM gpu_ticket_forgets ORDER BY since, worker, sandbox LIMIT $1",
            vec![p(i64::try_from(limit).unwrap_or(i64::MAX))],
        )?
        .iter()
        .map(|r| {
            let age: i64 = get(r, 2, "ticket to drop")?;
            Ok((
                get(r, 0, "ticket to drop")?,
                get(r, 1, "ticket to drop")?,
                u64::try_from(age).unwrap_or(0),
            ))
        })
        .collect()
    }

    fn ticket_forget_done(&self, worker: &str, sandbox: &str) -> Result<(), StoreError> {
        self.execute(
            "drop a ticket to drop",
            "DELETE FROM gpu_ticket_forgets WHERE worker = $1 AND sandbox = $2",
            vec![p(worker.to_string()), p(sandbox.to_string())],
        )
        .map(drop)
    }

    fn set_worker_drain(&self, worker: &str, drain: bool) -> Result<(), StoreError> {
        let sql = if drain {
            "INSERT INTO worker_drains (worker) VALUES ($1) ON CONFLICT (worker) DO NOTHING"
        } else {
            "DELETE FROM worker_drains WHERE worker = $1"
        };
        self.execute("keep a worker's drain", sql, vec![p(worker.to_string())])
            .map(drop)
    }

    fn worker_drains(&self) -> Result<Vec<String>, StoreError> {
        self.query(
            "read the drained workers",
            "SELECT worker FROM worker_drains ORDER BY worker",
            Vec::new(),
        )?
        .iter()
        .map(|r| get(r, 0, "drained worker"))
        .collect()
    }

    fn put_gpu_holding(
        &self,
        tenant: &str,
        worker: &str,
        seq: u64,
        held: torpor_gpu::quota::Amount,
    ) -> Result<(), StoreError> {
        let n = |v: u64| p(i64::try_from(v).unwrap_or(i64::MAX));
        self.execute(
            "keep a GPU holding",
            "INSERT INTO gpu_holdings (tenant, worker, seq, memory_mib, compute)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (tenant, worker) DO UPDATE SET seq = excluded.seq,
                 memory_mib = excluded.memory_mib, compute = excluded.compute,
                 reported_at = now()
             WHERE gpu_holdings.seq < excluded.seq",
            vec![
                p(tenant.to_string()),
                p(worker.to_string()),
                n(seq),
                n(held.memory_mib),
                n(held.compute),
            ],
        )
        .map(drop)
    }

    fn gpu_holdings(
        &self,
        tenant: &str,
    ) -> Result<Vec<(String, u64, torpor_gpu::quota::Amount)>, StoreError> {
        let n = |v: i64| u64::try_from(v).unwrap_or(0);
        self.query(
            "read GPU holdings",
            "SELECT worker, seq, memory_mib, compute FROM gpu_holdings
             WHERE tenant = $1 ORDER BY worker",
            vec![p(tenant.to_string())],
        )?
        .iter()
        .map(|r| {
            Ok((
                get(r, 0, "GPU holding")?,
                n(get(r, 1, "GPU holding")?),
                torpor_gpu::quota::Amount {
                    memory_mib: n(get(r, 2, "GPU holding")?),
                    compute: n(get(r, 3, "GPU holding")?),
                },
            ))
        })
        .collect()
    }

    fn put_metric_samples(&self, rows: &[(SandboxId, i64, String)]) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        self.execute(
            "keep metric samples",
            "INSERT INTO metric_samples (sandbox, ts_ms, sample)
             SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[])
             ON CONFLICT (sandbox, ts_ms) DO NOTHING",
            vec![
                p(rows.iter().map(|r| r.0.to_string()).collect::<Vec<_>>()),
                p(rows.iter().map(|r| r.1).collect::<Vec<_>>()),
                p(rows.iter().map(|r| r.2.clone()).collect::<Vec<_>>()),
            ],
        )
        .map(drop)
    }

    fn metric_samples(
        &self,
        id: &SandboxId,
        from_ms: i64,
        to_ms: i64,
        limit: usize,
    ) -> Result<Vec<(i64, String)>, StoreError> {
        let rows = self.query(
            "read metric samples",
            "SELECT ts_ms, sample FROM (
                 SELECT ts_ms, sample FROM metric_samples
                 WHERE sandbox = $1 AND ts_ms >= $2 AND ts_ms <= $3
                 ORDER BY ts_ms DESC LIMIT $4) AS newest
             ORDER BY ts_ms",
            vec![
                p(id.to_string()),
                p(from_ms),
                p(to_ms),
                p(limit.min(i64::MAX as usize) as i64),
            ],
        )?;
        rows.iter()
            .map(|row| Ok((get(row, 0, "metric sample")?, get(row, 1, "metric sample")?)))
            .collect()
    }

    fn prune_metric_samples(&self, before_ms: i64) -> Result<u64, StoreError> {
        let old = self.execute(
            "prune metric samples",
            "DELETE FROM metric_samples WHERE ts_ms < $1",
            vec![p(before_ms)],
        )?;
        let gone = self.execute(
            "prune metric samples",
            "DELETE FROM metric_samples m
             WHERE NOT EXISTS (SELECT 1 FROM sandboxes s WHERE s.id = m.sandbox)",
            Vec::new(),
        )?;
        Ok(old + gone)
    }

    fn add_usage(&self, rows: &[UsageInterval]) -> Result<(), StoreError> {
        let rows: Vec<&UsageInterval> = rows.iter().filter(|r| r.value > 0.0).collect();
        if rows.is_empty() {
            return Ok(());
        }
        let col = |f: fn(&UsageInterval) -> String| rows.iter().map(|r| f(r)).collect::<Vec<_>>();
        let starts: Vec<i64> = rows.iter().map(|r| r.start_s).collect();
        let values: Vec<f64> = rows.iter().map(|r| r.value).collect();
        // Rows of one key in the batch are summed first (one statement cannot update a row
        // twice), and taken in key order so concurrent batches lock rows in the same order.
        self.execute(
            "record usage",
            "INSERT INTO usage_intervals (start_s, tenant, sandbox, measure, dim, value)
             SELECT start_s, tenant, sandbox, measure, dim, sum(value)
             FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[],
                         $6::float8[]) AS u(start_s, tenant, sandbox, measure, dim, value)
             GROUP BY start_s, tenant, sandbox, measure, dim
             ORDER BY start_s, tenant, sandbox, measure, dim
             ON CONFLICT (start_s, tenant, sandbox, measure, dim)
             DO UPDATE SET value = usage_intervals.value + excluded.value",
            vec![
                p(starts),
                p(col(|r| r.tenant.to_string())),
                p(col(|r| r.sandbox.to_string())),
                p(col(|r| r.measure.clone())),
                p(col(|r| r.dim.clone())),
                p(values),
            ],
        )
        .map(drop)
    }

    fn usage_intervals(
        &self,
        from_s: i64,
        to_s: i64,
        tenant: Option<&TenantId>,
    ) -> Result<Vec<UsageInterval>, StoreError> {
        let rows = self.query(
            "read usage",
            "SELECT tenant, sandbox, start_s, measure, dim, value FROM usage_intervals
             WHERE start_s >= $1 AND start_s < $2 AND ($3::text IS NULL OR tenant = $3)",
            vec![p(from_s), p(to_s), p(tenant.map(|t| t.to_string()))],
        )?;
        let mut out = Vec::with_capacity(rows.len());
        for row in rows {
            let w = "usage interval";
            let tenant: String = get(&row, 0, w)?;
            let sandbox: String = get(&row, 1, w)?;
            let measure: String = get(&row, 3, w)?;
            let (Ok(t), Ok(s)) = (TenantId::new(&tenant), SandboxId::new(&sandbox)) else {
                tracing::warn!(%tenant, %sandbox, %measure, "unreadable usage row; ignored");
                continue;
            };
            out.push(UsageInterval {
                start_s: get(&row, 2, w)?,
                tenant: t,
                sandbox: s,
                measure,
                dim: get(&row, 4, w)?,
                value: get(&row, 5, w)?,
            });
        }
        Ok(out)
    }
}

fn raw_tenant(r: &Row) -> Result<TenantRecord, StoreError> {
    parse_tenant((
        get(r, 0, "tenant")?,
        get(r, 1, "tenant")?,
        get(r, 2, "tenant")?,
    ))
}

/// A pool's key as stored, checked.
fn pool_key(tenant: String, name: String) -> Result<(TenantId, PoolName), StoreError> {
    let corrupt = || StoreError::Corrupt {
        what: "pool",
        key: format!("{tenant}/{name}"),
    };
    Ok((
        TenantId::new(&tenant).map_err(|_| corrupt())?,
        PoolName::new(&name).map_err(|_| corrupt())?,
    ))
}
