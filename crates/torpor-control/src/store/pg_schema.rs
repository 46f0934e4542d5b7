//! The PostgreSQL store's schema: migrations versioned in the repo (`store/pg/NNNN_*.sql`,
//! compiled in), applied at connect in one transaction under a PostgreSQL advisory lock, so
//! several controllers started together migrate one after the other (the first applies the
//! steps, the others find the schema current). The version is kept in `meta` (`schema`), as in
//! the SQLite store; a database at a version newer than this build is refused rather than
//! misread.
//!
//! The lock is `pg_advisory_xact_lock`: the transaction-scoped form of `pg_advisory_lock`,
//! released by the commit or rollback (or by the server when the connection dies), so a
//! controller that fails mid-migration never leaves the lock held.
//!
//! | version | file | change |
//! |---|---|---|
//! | 1 | `0001_initial.sql` | the tables of the SQLite store's schema 3 |
//! | 2 | `0002_controllers.sql` | `sandboxes.controller`, `controllers` (liveness), `leases` |
//! | 3 | `0003_scale_indexes.sql` | partial indexes for the idle policy, `(template, tenant)`, `(tenant, created_at, id)` |
//! | 4 | `0004_sandbox_node.sql` | `sandboxes.node`: the worker a resident sandbox runs on |
//! | 5 | `0005_metric_samples.sql` | `metric_samples`: E2B metric samples, kept an hour |
//! | 6 | `0006_fence_orders.sql` | `fence_orders`: containers of a worker one controller lost, to end through another |
//! | 7 | `0007_gpu_holdings.sql` | `gpu_holdings`: a tenant's GPU holdings per worker, as the newest start reply said |
//! | 8 | `0008_gpu_ticket_forgets.sql` | `gpu_ticket_forgets`: wake tickets a worker could not be told to drop, asked again by any controller |
//! | 9 | `0009_controller_peer_addr.sql` | `controllers.peer_addr`: the peer listener other controllers forward to (mutual TLS) |
//! | 10 | `0010_rate_usage.sql` | `rate_usage`: requests each controller let through per tenant and route class, for rate limits across controllers |
//! | 11 | `0011_controller_run.sql` | `controllers.run_id`: the run of a controller that holds its name (one name, one process) |
//! | 12 | `0012_worker_drains.sql` | `worker_drains`: workers the operator drained, for every controller |
//! | 13 | `0013_controller_call_rate.sql` | `controllers.call_rate`: the calls a second each controller's sandboxes take, for balancing |
//!
//! To change the schema, add the next file and its line to [`MIGRATIONS`]; never edit a file
//! that has shipped.

use tokio_postgres::Client;

/// Every migration, in order: `MIGRATIONS[i]` moves a database from version `i` to `i + 1`.
pub(super) const MIGRATIONS: &[&str] = &[
    include_str!("pg/0001_initial.sql"),
    include_str!("pg/0002_controllers.sql"),
    include_str!("pg/0003_scale_indexes.sql"),
    include_str!("pg/0004_sandbox_node.sql"),
    include_str!("pg/0005_metric_samples.sql"),
    include_str!("pg/0006_fence_orders.sql"),
    include_str!("pg/0007_gpu_holdings.sql"),
    include_str!("pg/0008_gpu_ticket_forgets.sql"),
    include_str!("pg/0009_controller_peer_addr.sql"),
    include_str!("pg/0010_rate_usage.sql"),
    include_str!("pg/0011_controller_run.sql"),
    include_str!("pg/0012_worker_drains.sql"),
    include_str!("pg/0013_controller_call_rate.sql"),
];

/// The schema version this build writes and reads.
pub(super) const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// The advisory-lock key every torpor controller takes to migrate ("torpor" in ASCII).
pub(super) const MIGRATION_LOCK: i64 = 0x746f_7270_6f72;

/// Why the schema could not be made current.
#[derive(Debug)]
pub(super) enum MigrateError {
    Db(tokio_postgres::Error),
    /// The database is at a version this build does not know.
    Newer(i64),
}

impl From<tokio_postgres::Error> for MigrateError {
    fn from(e: tokio_postgres::Error) -> Self {
        MigrateError::Db(e)
    }
}

/// What the database holds after migration.
pub(super) struct Migrated {
    /// The version the database was at before (0: a new database).
    pub from: i64,
    /// The env-key check value stored in `meta` (the one given, when this call stored it).
    pub env_key_check: String,
}

/// Creates or migrates the schema, and records `env_key_check` (a value sealed with this
/// controller's env key) unless an earlier controller recorded its own.
pub(super) async fn migrate(
    client: &mut Client,
    env_key_check: &str,
) -> Result<Migrated, MigrateError> {
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    tx.batch_execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        .await?;
    let recorded = tx
        .query_opt("SELECT value FROM meta WHERE key='schema'", &[])
        .await?
        .map(|r| r.try_get::<_, String>(0))
        .transpose()?;
    let from = match recorded {
        None => 0,
        // A value this build cannot read was written by a build it does not know.
        Some(v) => v.parse::<i64>().unwrap_or(SCHEMA_VERSION + 1),
    };
    if from > SCHEMA_VERSION {
        tx.rollback().await?;
        return Err(MigrateError::Newer(from));
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(from.max(0) as usize) {
        tx.batch_execute(sql).await?;
        tracing::info!(version = i + 1, "PostgreSQL state store migrated");
    }
    tx.execute(
        "INSERT INTO meta(key, value) VALUES ('schema', $1)
         ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        &[&SCHEMA_VERSION.to_string()],
    )
    .await?;
    tx.execute(
        "INSERT INTO meta(key, value) VALUES ('env_key_check', $1) ON CONFLICT (key) DO NOTHING",
        &[&env_key_check],
    )
    .await?;
    let check: String = tx
        .query_one("SELECT value FROM meta WHERE key='env_key_check'", &[])
        .await?
        .try_get(0)?;
    tx.commit().await?;
    Ok(Migrated {
        from,
        env_key_check: check,
    })
}
