//! The SQLite store's schema and its migrations. The version is kept in `meta` (`schema`); a
//! database at an older version is migrated forward step by step at open, each step in one
//! transaction, and a newer one is refused rather than misread.
//!
//! | version | change |
//! |---|---|
//! | 1 | templates keyed by name |
//! | 2 | templates keyed by (tenant, name), so tenants' template names do not collide |
//! | 3 | the store owns every table: `sandboxes.version` (compare-and-set), pools keyed by (tenant, name), `gpu_shares`, `gpu_requests`, `gpu_toggled`, `usage_intervals` |
//! | 4 | indexes in creation order, `(created_at, id)` and `(tenant, created_at, id)` (replacing `(tenant)`), for paged lists |
//! | 5 | `metric_samples`: E2B metric samples of each sandbox, kept an hour |

use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension};

use super::StoreError;

pub(super) const SCHEMA_VERSION: i64 = 5;

/// A new database, at [`SCHEMA_VERSION`].
const SCHEMA: &str = r#"
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE templates (
    name TEXT NOT NULL,
    tenant TEXT NOT NULL,
    spec TEXT NOT NULL,
    status TEXT NOT NULL,
    rootfs TEXT NOT NULL,
    mounts TEXT NOT NULL,
    agent_dir TEXT NOT NULL,
    golden_dir TEXT NOT NULL,
    golden_bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, name)
);
CREATE TABLE sandboxes (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    template TEXT NOT NULL,
    state TEXT NOT NULL,
    tier TEXT NOT NULL,
    limits TEXT NOT NULL,
    env TEXT NOT NULL,
    metadata TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    last_active_at INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    image TEXT NOT NULL,
    last_error TEXT,
    oom_killed INTEGER NOT NULL DEFAULT 0,
    version INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX sandboxes_tenant ON sandboxes(tenant);
CREATE INDEX sandboxes_template ON sandboxes(template);
CREATE TABLE sandbox_network (
    id TEXT PRIMARY KEY,
    policy TEXT NOT NULL
);
CREATE TABLE tenants (
    id TEXT PRIMARY KEY,
    token_hash TEXT NOT NULL UNIQUE,
    created_at INTEGER NOT NULL,
    quotas TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE snapshot_bytes (
    snapshot TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL
);
CREATE TABLE pools (
    tenant TEXT NOT NULL,
    name TEXT NOT NULL,
    spec TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, name)
);
"#;

/// The tables version 3 added that an older torpor may have made already (outside the
/// versioned schema), hence `IF NOT EXISTS`; part of a new database too.
const V3_TABLES: &str = r#"
CREATE TABLE IF NOT EXISTS gpu_shares (
    sandbox TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS gpu_requests (
    sandbox TEXT PRIMARY KEY,
    request TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS gpu_toggled (
    sandbox TEXT PRIMARY KEY,
    toggled TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS usage_intervals (
    start_s INTEGER NOT NULL,
    tenant TEXT NOT NULL,
    sandbox TEXT NOT NULL,
    measure TEXT NOT NULL,
    dim TEXT NOT NULL,
    value REAL NOT NULL,
    PRIMARY KEY (start_s, tenant, sandbox, measure, dim)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS usage_by_tenant ON usage_intervals (tenant, start_s);
"#;

/// Version 4: the sandboxes in creation order, for keyset pages of every tenant's and of one
/// tenant's (the `(tenant)` index is a prefix of the second); and, as PostgreSQL's schema 3,
/// the awake few and the parked by age, so the idle policy's read every tick does not grow
/// with the sleeping sandboxes (10,000 of them kept a daemon's core busy).
const V4_INDEXES: &str = r#"
CREATE INDEX IF NOT EXISTS sandboxes_created ON sandboxes(created_at, id);
CREATE INDEX IF NOT EXISTS sandboxes_tenant_created ON sandboxes(tenant, created_at, id);
DROP INDEX IF EXISTS sandboxes_tenant;
CREATE INDEX IF NOT EXISTS sandboxes_awake ON sandboxes(created_at, id)
    WHERE state NOT IN ('parked', 'suspended');
CREATE INDEX IF NOT EXISTS sandboxes_parked_by_age ON sandboxes(last_active_at)
    WHERE state = 'parked';
CREATE INDEX IF NOT EXISTS sandboxes_state_tier ON sandboxes(state, tier);
"#;

/// Version 5: E2B metric samples, by sandbox and time (and by time alone, for pruning).
const V5_METRIC_SAMPLES: &str = r#"
CREATE TABLE IF NOT EXISTS metric_samples (
    sandbox TEXT NOT NULL,
    ts_ms INTEGER NOT NULL,
    sample TEXT NOT NULL,
    PRIMARY KEY (sandbox, ts_ms)
);
CREATE INDEX IF NOT EXISTS metric_samples_ts ON metric_samples(ts_ms);
"#;

/// Tables version 2 had beside `templates` that a version-1 database may lack.
const V2_SIDE_TABLES: &str = r#"
CREATE TABLE IF NOT EXISTS sandbox_network (id TEXT PRIMARY KEY, policy TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS tenants (
    id TEXT PRIMARY KEY,
    token_hash TEXT NOT NULL UNIQUE,
    created_at INTEGER NOT NULL,
    quotas TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS snapshot_bytes (snapshot TEXT PRIMARY KEY, bytes INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS pools (
    name TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    spec TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
"#;

/// Version 1 keyed templates by name alone.
const MIGRATE_1_TO_2: &str = r#"
CREATE TABLE templates_v2 (
    name TEXT NOT NULL,
    tenant TEXT NOT NULL,
    spec TEXT NOT NULL,
    status TEXT NOT NULL,
    rootfs TEXT NOT NULL,
    mounts TEXT NOT NULL,
    agent_dir TEXT NOT NULL,
    golden_dir TEXT NOT NULL,
    golden_bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, name)
);
INSERT INTO templates_v2 SELECT name, tenant, spec, status, rootfs, mounts, agent_dir,
    golden_dir, golden_bytes, created_at FROM templates;
DROP TABLE templates;
ALTER TABLE templates_v2 RENAME TO templates;
"#;

/// Creates or migrates the schema of the database `conn` has open (at `path`).
pub(super) fn migrate(conn: &mut Connection, path: &Path) -> Result<(), StoreError> {
    let open_err = |source: rusqlite::Error| StoreError::Open {
        path: path.to_path_buf(),
        source: source.into(),
    };
    let version = stored_version(conn).map_err(open_err)?;
    match version {
        None => {
            let tx = conn.transaction().map_err(open_err)?;
            tx.execute_batch(SCHEMA).map_err(open_err)?;
            tx.execute_batch(V3_TABLES).map_err(open_err)?;
            tx.execute_batch(V4_INDEXES).map_err(open_err)?;
            tx.execute_batch(V5_METRIC_SAMPLES).map_err(open_err)?;
            set_version(&tx, SCHEMA_VERSION).map_err(open_err)?;
            tx.commit().map_err(open_err)?;
        }
        Some(v) if v > SCHEMA_VERSION => {
            return Err(StoreError::NewerSchema {
                path: path.to_path_buf(),
                found: v,
                supported: SCHEMA_VERSION,
            })
        }
        Some(v) => {
            if v < 2 {
                let tx = conn.transaction().map_err(open_err)?;
                tx.execute_batch(V2_SIDE_TABLES).map_err(open_err)?;
                tx.execute_batch(MIGRATE_1_TO_2).map_err(open_err)?;
                set_version(&tx, 2).map_err(open_err)?;
                tx.commit().map_err(open_err)?;
                tracing::info!(path = %path.display(), "state store migrated to schema 2");
            }
            if v < 3 {
                let tx = conn.transaction().map_err(open_err)?;
                migrate_2_to_3(&tx).map_err(open_err)?;
                set_version(&tx, 3).map_err(open_err)?;
                tx.commit().map_err(open_err)?;
                tracing::info!(path = %path.display(), "state store migrated to schema 3");
            }
            if v < 4 {
                let tx = conn.transaction().map_err(open_err)?;
                tx.execute_batch(V4_INDEXES).map_err(open_err)?;
                set_version(&tx, 4).map_err(open_err)?;
                tx.commit().map_err(open_err)?;
                tracing::info!(path = %path.display(), "state store migrated to schema 4");
            }
            if v < 5 {
                let tx = conn.transaction().map_err(open_err)?;
                tx.execute_batch(V5_METRIC_SAMPLES).map_err(open_err)?;
                set_version(&tx, 5).map_err(open_err)?;
                tx.commit().map_err(open_err)?;
                tracing::info!(path = %path.display(), "state store migrated to schema 5");
            }
        }
    }
    Ok(())
}

/// The stored schema version; `None` for a new database. A database made before versions
/// were recorded (tables but no version) is read as version 2, as the torpor of then did.
fn stored_version(conn: &Connection) -> rusqlite::Result<Option<i64>> {
    let has_table = |name: &str| -> rusqlite::Result<bool> {
        conn.query_row(
            "SELECT COUNT(*) FROM sqlite_master WHERE type='table' AND name=?1",
            params![name],
            |r| r.get::<_, i64>(0),
        )
        .map(|n| n > 0)
    };
    let recorded: Option<String> = if has_table("meta")? {
        conn.query_row("SELECT value FROM meta WHERE key='schema'", [], |r| {
            r.get(0)
        })
        .optional()?
    } else {
        None
    };
    match recorded {
        Some(v) => Ok(Some(v.parse().unwrap_or(SCHEMA_VERSION + 1))),
        None if has_table("sandboxes")? => Ok(Some(2)),
        None => Ok(None),
    }
}

fn set_version(conn: &Connection, version: i64) -> rusqlite::Result<()> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    )?;
    conn.execute(
        "INSERT INTO meta(key, value) VALUES ('schema', ?1)
         ON CONFLICT(key) DO UPDATE SET value=excluded.value",
        params![version.to_string()],
    )?;
    Ok(())
}

/// Version 3: a version column on sandboxes, pools keyed by (tenant, name) (a torpor of
/// version 2 rebuilt the table itself at pool start; either shape is moved here), and the
/// tables GPU shares and usage accounting had made on their own.
fn migrate_2_to_3(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(V2_SIDE_TABLES)?;
    let has_version: bool = conn
        .prepare("SELECT version FROM sandboxes LIMIT 0")
        .is_ok();
    if !has_version {
        conn.execute_batch("ALTER TABLE sandboxes ADD COLUMN version INTEGER NOT NULL DEFAULT 0")?;
    }
    let pools_sql: Option<String> = conn
        .query_row(
            "SELECT sql FROM sqlite_master WHERE type='table' AND name='pools'",
            [],
            |r| r.get(0),
        )
        .optional()?;
    let keyed_by_tenant = pools_sql.as_deref().is_some_and(|s| {
        s.replace(char::is_whitespace, "")
            .contains("PRIMARYKEY(tenant,name)")
    });
    if !keyed_by_tenant {
        conn.execute_batch(
            "CREATE TABLE pools_by_tenant (
                tenant TEXT NOT NULL,
                name TEXT NOT NULL,
                spec TEXT NOT NULL,
                created_at INTEGER NOT NULL,
                PRIMARY KEY (tenant, name)
            )",
        )?;
        if pools_sql.is_some() {
            conn.execute_batch(
                "INSERT INTO pools_by_tenant(tenant, name, spec, created_at)
                     SELECT tenant, name, spec, created_at FROM pools;
                 DROP TABLE pools;",
            )?;
        }
        conn.execute_batch("ALTER TABLE pools_by_tenant RENAME TO pools")?;
    }
    conn.execute_batch(V3_TABLES)
}
