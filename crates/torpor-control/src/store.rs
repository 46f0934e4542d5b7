//! The state store: templates, sandboxes and tenants in embedded SQLite.
//!
//! SQLite runs in WAL mode with `synchronous=FULL`: the WAL is fsynced at every commit, so a
//! committed transition survives a power loss as well as a daemon crash. Checkpoint images are
//! fsynced before a record points at them and the image a record left is removed only after
//! the record moved on, so a record never points at a missing or half-written image. Each statement is a few tens of
//! microseconds, so the store is called directly under a mutex rather than through a thread.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rusqlite::{params, Connection, OptionalExtension, Row};
use serde::{Deserialize, Serialize};
use torpor_core::{
    Limits, SandboxId, SandboxState, TemplateName, TemplateSpec, TenantId, Tier, UnixMillis,
};
use torpor_runtime::Mount;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state store {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("state store")]
    Sql(#[from] rusqlite::Error),
    #[error("state store holds a malformed {what} row {key}")]
    Corrupt { what: &'static str, key: String },
    #[error("state store env key")]
    EnvKey(#[from] crate::secrets::SealError),
}

/// Where the checkpoint a sandbox would wake from lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "path", rename_all = "snake_case")]
pub enum ImageRef {
    /// Its template's golden snapshot (a sandbox that has never been checkpointed).
    Golden,
    /// A checkpoint on this node's disk (Parked).
    Local(PathBuf),
    /// A checkpoint in the snapshot store (Suspended), by snapshot id.
    Store(String),
}

impl ImageRef {
    /// The tier a sandbox asleep on this image is in.
    pub fn sleeping_tier(&self) -> Tier {
        match self {
            ImageRef::Golden | ImageRef::Local(_) => Tier::Parked,
            ImageRef::Store(_) => Tier::Suspended,
        }
    }

    pub fn sleeping_state(&self) -> SandboxState {
        match self.sleeping_tier() {
            Tier::Suspended => SandboxState::Suspended,
            _ => SandboxState::Parked,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TemplateStatus {
    Building,
    Ready,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TemplateRecord {
    pub name: TemplateName,
    pub tenant: TenantId,
    pub spec: TemplateSpec,
    pub status: TemplateStatus,
    pub rootfs: PathBuf,
    pub mounts: Vec<Mount>,
    pub agent_dir: PathBuf,
    pub golden_dir: PathBuf,
    pub golden_bytes: u64,
    pub created_at: UnixMillis,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SandboxRecord {
    pub id: SandboxId,
    pub tenant: TenantId,
    pub template: TemplateName,
    pub state: SandboxState,
    pub tier: Tier,
    pub limits: Limits,
    pub env: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub created_at: UnixMillis,
    pub last_active_at: UnixMillis,
    /// Bumped on every boot or restore; the runsc container id is `<id>-g<generation>`.
    pub generation: u32,
    pub image: ImageRef,
    pub last_error: Option<String>,
    pub oom_killed: bool,
}

impl SandboxRecord {
    pub fn container_id(&self) -> String {
        format!("{}-g{}", self.id, self.generation)
    }
}

pub struct Store {
    conn: Mutex<Connection>,
    /// Seals sandboxes' env at rest (crate::secrets).
    env_seal: crate::secrets::EnvSeal,
}

const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS templates (
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
CREATE TABLE IF NOT EXISTS sandboxes (
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
    oom_killed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS sandboxes_tenant ON sandboxes(tenant);
CREATE INDEX IF NOT EXISTS sandboxes_template ON sandboxes(template);
CREATE TABLE IF NOT EXISTS sandbox_network (
    id TEXT PRIMARY KEY,
    policy TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tenants (
    id TEXT PRIMARY KEY,
    token_hash TEXT NOT NULL UNIQUE,
    created_at INTEGER NOT NULL,
    quotas TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS snapshot_bytes (
    snapshot TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS pools (
    name TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    spec TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
"#;

/// Schema version written to `meta`; a newer database is refused rather than misread.
/// 2: templates are keyed by (tenant, name), so tenants' template names do not collide.
const SCHEMA_VERSION: i64 = 2;

/// Version 1 keyed templates by name alone.
const MIGRATE_1_TO_2: &str = r#"
BEGIN;
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
UPDATE meta SET value='2' WHERE key='schema';
COMMIT;
"#;

fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("store values serialise")
}

impl Store {
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let open_err = |source| StoreError::Open {
            path: path.to_path_buf(),
            source,
        };
        let conn = Connection::open(path).map_err(open_err)?;
        conn.execute_batch(
            "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; PRAGMA busy_timeout=5000;",
        )
        .map_err(open_err)?;
        conn.execute_batch(SCHEMA).map_err(open_err)?;
        let version: Option<i64> = conn
            .query_row("SELECT value FROM meta WHERE key='schema'", [], |r| {
                r.get::<_, String>(0)
            })
            .optional()
            .map_err(open_err)?
            .and_then(|v| v.parse().ok());
        match version {
            None => {
                conn.execute(
                    "INSERT INTO meta(key, value) VALUES ('schema', ?1)",
                    params![SCHEMA_VERSION.to_string()],
                )
                .map_err(open_err)?;
            }
            Some(v) if v > SCHEMA_VERSION => {
                return Err(open_err(rusqlite::Error::InvalidParameterName(format!(
                    "schema version {v} is newer than this torpor understands ({SCHEMA_VERSION})"
                ))));
            }
            Some(1) => conn.execute_batch(MIGRATE_1_TO_2).map_err(open_err)?,
            Some(_) => {}
        }
        let key = path.with_file_name("env.key");
        let env_seal = crate::secrets::EnvSeal::load_or_create(&key)?;
        let store = Store {
            conn: Mutex::new(conn),
            env_seal,
        };
        store.seal_plain_envs()?;
        Ok(store)
    }

    /// Seals env values written in plain text by an older torpor.
    fn seal_plain_envs(&self) -> Result<(), StoreError> {
        let plain: Vec<(String, String)> = self.with(|c| {
            let mut st = c.prepare("SELECT id, env FROM sandboxes WHERE env NOT LIKE 'enc1:%'")?;
            let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect()
        })?;
        for (id, env) in plain {
            let sealed = self.env_seal.seal(&id, &env);
            self.with(|c| {
                c.execute(
                    "UPDATE sandboxes SET env=?2 WHERE id=?1",
                    params![id, sealed],
                )
            })?;
        }
        Ok(())
    }

    pub(crate) fn with<T>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<T>,
    ) -> Result<T, StoreError> {
        let conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        Ok(f(&conn)?)
    }

    // --- templates ---

    /// Inserts a template; false when the name is taken.
    pub fn insert_template(&self, t: &TemplateRecord) -> Result<bool, StoreError> {
        self.with(|c| {
            let n = c.execute(
                "INSERT OR IGNORE INTO templates
                 (name, tenant, spec, status, rootfs, mounts, agent_dir, golden_dir, golden_bytes, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
                params![
                    t.name.as_str(),
                    t.tenant.as_str(),
                    json(&t.spec),
                    json(&t.status),
                    t.rootfs.to_string_lossy(),
                    json(&t.mounts),
                    t.agent_dir.to_string_lossy(),
                    t.golden_dir.to_string_lossy(),
                    t.golden_bytes as i64,
                    t.created_at,
                ],
            )?;
            Ok(n == 1)
        })
    }

    pub fn update_template(&self, t: &TemplateRecord) -> Result<(), StoreError> {
        self.with(|c| {
            c.execute(
                "UPDATE templates SET status=?2, mounts=?3, agent_dir=?4, golden_bytes=?5, spec=?6
                 WHERE name=?1 AND tenant=?7",
                params![
                    t.name.as_str(),
                    json(&t.status),
                    json(&t.mounts),
                    t.agent_dir.to_string_lossy(),
                    t.golden_bytes as i64,
                    json(&t.spec),
                    t.tenant.as_str(),
                ],
            )
            .map(|_| ())
        })
    }

    pub fn delete_template(&self, owner: &TenantId, name: &TemplateName) -> Result<(), StoreError> {
        self.with(|c| {
            c.execute(
                "DELETE FROM templates WHERE name=?1 AND tenant=?2",
                params![name.as_str(), owner.as_str()],
            )
            .map(|_| ())
        })
    }

    /// The template `owner` has under `name`.
    pub fn template(
        &self,
        owner: &TenantId,
        name: &TemplateName,
    ) -> Result<Option<TemplateRecord>, StoreError> {
        let row = self.with(|c| {
            c.query_row(
                "SELECT name, tenant, spec, status, rootfs, mounts, agent_dir, golden_dir, golden_bytes, created_at
                 FROM templates WHERE name=?1 AND tenant=?2",
                params![name.as_str(), owner.as_str()],
                raw_template,
            )
            .optional()
        })?;
        row.map(parse_template).transpose()
    }

    /// The template `name` means for `tenant`: its own, else the operator's.
    pub fn template_for(
        &self,
        tenant: &TenantId,
        name: &TemplateName,
    ) -> Result<Option<TemplateRecord>, StoreError> {
        match self.template(tenant, name)? {
            Some(t) => Ok(Some(t)),
            None => self.template(&TenantId::admin(), name),
        }
    }

    pub fn templates(&self) -> Result<Vec<TemplateRecord>, StoreError> {
        let rows = self.with(|c| {
            let mut st = c.prepare(
                "SELECT name, tenant, spec, status, rootfs, mounts, agent_dir, golden_dir, golden_bytes, created_at
                 FROM templates ORDER BY name",
            )?;
            let rows = st.query_map([], raw_template)?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
        })?;
        rows.into_iter().map(parse_template).collect()
    }

    // --- sandboxes ---

    pub fn insert_sandbox(&self, s: &SandboxRecord) -> Result<(), StoreError> {
        self.with(|c| {
            c.execute(
                "INSERT INTO sandboxes
                 (id, tenant, template, state, tier, limits, env, metadata, created_at, last_active_at,
                  generation, image, last_error, oom_killed)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
                params![
                    s.id.as_str(),
                    s.tenant.as_str(),
                    s.template.as_str(),
                    s.state.as_str(),
                    s.tier.as_str(),
                    json(&s.limits),
                    self.env_seal.seal(s.id.as_str(), &json(&s.env)),
                    json(&s.metadata),
                    s.created_at,
                    s.last_active_at,
                    s.generation,
                    json(&s.image),
                    s.last_error,
                    s.oom_killed,
                ],
            )
            .map(|_| ())
        })
    }

    /// Writes every mutable field of a sandbox.
    pub fn update_sandbox(&self, s: &SandboxRecord) -> Result<(), StoreError> {
        self.with(|c| {
            c.execute(
                "UPDATE sandboxes SET state=?2, tier=?3, last_active_at=?4, generation=?5, image=?6,
                 last_error=?7, oom_killed=?8 WHERE id=?1",
                params![
                    s.id.as_str(),
                    s.state.as_str(),
                    s.tier.as_str(),
                    s.last_active_at,
                    s.generation,
                    json(&s.image),
                    s.last_error,
                    s.oom_killed,
                ],
            )
            .map(|_| ())
        })
    }

    /// Replaces a sandbox's metadata (and nothing else, so it cannot undo a concurrent state
    /// change). Used by the E2B adapter for its lifecycle keys.
    pub fn set_sandbox_metadata(
        &self,
        id: &SandboxId,
        metadata: &BTreeMap<String, String>,
    ) -> Result<(), StoreError> {
        self.with(|c| {
            c.execute(
                "UPDATE sandboxes SET metadata=?2 WHERE id=?1",
                params![id.as_str(), json(metadata)],
            )
            .map(|_| ())
        })
    }

    pub fn touch_sandboxes(&self, touched: &[(SandboxId, UnixMillis)]) -> Result<(), StoreError> {
        if touched.is_empty() {
            return Ok(());
        }
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let tx = conn.transaction()?;
        {
            let mut st = tx.prepare(
                "UPDATE sandboxes SET last_active_at=?2 WHERE id=?1 AND last_active_at < ?2",
            )?;
            for (id, at) in touched {
                st.execute(params![id.as_str(), at])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    pub fn delete_sandbox(&self, id: &SandboxId) -> Result<(), StoreError> {
        self.with(|c| {
            c.execute(
                "DELETE FROM sandbox_network WHERE id=?1",
                params![id.as_str()],
            )?;
            c.execute("DELETE FROM sandboxes WHERE id=?1", params![id.as_str()])
                .map(|_| ())
        })
    }

    pub fn sandbox(&self, id: &SandboxId) -> Result<Option<SandboxRecord>, StoreError> {
        let row = self.with(|c| {
            c.query_row(
                &format!("{SANDBOX_COLUMNS} WHERE id=?1"),
                params![id.as_str()],
                raw_sandbox,
            )
            .optional()
        })?;
        row.map(|r| self.parse_sandbox(r)).transpose()
    }

    pub fn sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        let rows = self.with(|c| {
            let mut st = c.prepare(&format!("{SANDBOX_COLUMNS} ORDER BY created_at, id"))?;
            let rows = st.query_map([], raw_sandbox)?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
        })?;
        rows.into_iter().map(|r| self.parse_sandbox(r)).collect()
    }

    /// Sandboxes made from `owner`'s template `name`: the owner's own, or for an operator
    /// template, every tenant's that has no template of that name itself.
    pub fn count_sandboxes_of_template(
        &self,
        owner: &TenantId,
        name: &TemplateName,
    ) -> Result<u64, StoreError> {
        self.with(|c| {
            c.query_row(
                "SELECT COUNT(*) FROM sandboxes s WHERE s.template=?1 AND (s.tenant=?2 OR (?2=?3
                   AND NOT EXISTS (SELECT 1 FROM templates t
                                   WHERE t.name=?1 AND t.tenant=s.tenant AND t.tenant<>?3)))",
                params![name.as_str(), owner.as_str(), TenantId::admin().as_str()],
                |r| r.get::<_, i64>(0),
            )
            .map(|n| n as u64)
        })
    }
}

/// Limits on what one tenant may hold. `None`: unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quotas {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sandboxes: Option<u64>,
    /// Resident (Running or Frozen) sandboxes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_running: Option<u64>,
    /// Memory limits of resident sandboxes, summed, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_memory_mib: Option<u64>,
    /// CPU limits of resident sandboxes (template builds included), summed, in CPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cpus: Option<u64>,
    /// Templates the tenant owns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_templates: Option<u64>,
    /// Event-driven pools the tenant owns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pools: Option<u64>,
    /// Disk the tenant's checkpoints, golden snapshots and uploads take, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_disk_mib: Option<u64>,
    /// API requests per second (token bucket; bursts up to twice this). `None`: the daemon's
    /// `--default-requests-per-s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_s: Option<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TenantRecord {
    pub id: TenantId,
    pub created_at: UnixMillis,
    pub quotas: Quotas,
}

/// What a tenant holds now, for quota checks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub sandboxes: u64,
    pub resident: u64,
    pub resident_memory_mib: u64,
    /// CPU limits of resident sandboxes, summed, in thousandths of a CPU.
    pub resident_millicpus: u64,
}

impl Store {
    /// Inserts a tenant; false when the name is taken.
    pub fn insert_tenant(&self, t: &TenantRecord, token_hash: &str) -> Result<bool, StoreError> {
        self.with(|c| {
            let n = c.execute(
                "INSERT OR IGNORE INTO tenants (id, token_hash, created_at, quotas) VALUES (?1, ?2, ?3, ?4)",
                params![t.id.as_str(), token_hash, t.created_at, json(&t.quotas)],
            )?;
            Ok(n == 1)
        })
    }

    pub fn tenant_by_token_hash(&self, token_hash: &str) -> Result<Option<TenantId>, StoreError> {
        let id: Option<String> = self.with(|c| {
            c.query_row(
                "SELECT id FROM tenants WHERE token_hash=?1",
                params![token_hash],
                |r| r.get(0),
            )
            .optional()
        })?;
        id.map(|id| {
            TenantId::new(&id).map_err(|_| StoreError::Corrupt {
                what: "tenant",
                key: id.clone(),
            })
        })
        .transpose()
    }

    pub fn tenants(&self) -> Result<Vec<TenantRecord>, StoreError> {
        let rows: Vec<(String, i64, String)> = self.with(|c| {
            let mut st = c.prepare("SELECT id, created_at, quotas FROM tenants ORDER BY id")?;
            let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
            rows.collect()
        })?;
        rows.into_iter()
            .map(|(id, created_at, quotas)| {
                let corrupt = || StoreError::Corrupt {
                    what: "tenant",
                    key: id.clone(),
                };
                Ok(TenantRecord {
                    id: TenantId::new(&id).map_err(|_| corrupt())?,
                    created_at,
                    quotas: serde_json::from_str(&quotas).map_err(|_| corrupt())?,
                })
            })
            .collect()
    }

    pub fn tenant(&self, id: &TenantId) -> Result<Option<TenantRecord>, StoreError> {
        Ok(self.tenants()?.into_iter().find(|t| t.id == *id))
    }

    pub fn delete_tenant(&self, id: &TenantId) -> Result<bool, StoreError> {
        self.with(|c| {
            c.execute("DELETE FROM tenants WHERE id=?1", params![id.as_str()])
                .map(|n| n == 1)
        })
    }

    /// What a tenant holds: all its sandboxes, and those resident or becoming resident.
    pub fn usage(&self, tenant: &TenantId) -> Result<Usage, StoreError> {
        let mut u = Usage::default();
        let rows: Vec<(String, String)> = self.with(|c| {
            let mut st = c.prepare("SELECT state, limits FROM sandboxes WHERE tenant=?1")?;
            let rows = st.query_map(params![tenant.as_str()], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect()
        })?;
        for (state, limits) in rows {
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
}

const SANDBOX_COLUMNS: &str =
    "SELECT id, tenant, template, state, tier, limits, env, metadata, created_at,
    last_active_at, generation, image, last_error, oom_killed FROM sandboxes";

type RawTemplate = (
    String,
    String,
    String,
    String,
    String,
    String,
    String,
    String,
    i64,
    i64,
);

fn raw_template(r: &Row) -> rusqlite::Result<RawTemplate> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        r.get(6)?,
        r.get(7)?,
        r.get(8)?,
        r.get(9)?,
    ))
}

fn parse_template(raw: RawTemplate) -> Result<TemplateRecord, StoreError> {
    let (name, tenant, spec, status, rootfs, mounts, agent_dir, golden_dir, golden_bytes, created) =
        raw;
    let corrupt = || StoreError::Corrupt {
        what: "template",
        key: name.clone(),
    };
    Ok(TemplateRecord {
        name: TemplateName::new(&name).map_err(|_| corrupt())?,
        tenant: TenantId::new(tenant).map_err(|_| corrupt())?,
        spec: serde_json::from_str(&spec).map_err(|_| corrupt())?,
        status: serde_json::from_str(&status).map_err(|_| corrupt())?,
        rootfs: rootfs.into(),
        mounts: serde_json::from_str(&mounts).map_err(|_| corrupt())?,
        agent_dir: agent_dir.into(),
        golden_dir: golden_dir.into(),
        golden_bytes: golden_bytes as u64,
        created_at: created,
    })
}

type RawSandbox = (
    String,
    String,
    String,
    String,
    String,
    String,
    String,
    String,
    i64,
    i64,
    u32,
    String,
    Option<String>,
    bool,
);

fn raw_sandbox(r: &Row) -> rusqlite::Result<RawSandbox> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        r.get(6)?,
        r.get(7)?,
        r.get(8)?,
        r.get(9)?,
        r.get(10)?,
        r.get(11)?,
        r.get(12)?,
        r.get(13)?,
    ))
}

impl Store {
    fn parse_sandbox(&self, raw: RawSandbox) -> Result<SandboxRecord, StoreError> {
        let mut raw = raw;
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

fn parse_sandbox(raw: RawSandbox) -> Result<SandboxRecord, StoreError> {
    let (
        id,
        tenant,
        template,
        state,
        tier,
        limits,
        env,
        metadata,
        created_at,
        last_active_at,
        generation,
        image,
        last_error,
        oom_killed,
    ) = raw;
    let corrupt = || StoreError::Corrupt {
        what: "sandbox",
        key: id.clone(),
    };
    Ok(SandboxRecord {
        id: SandboxId::new(&id).map_err(|_| corrupt())?,
        tenant: TenantId::new(tenant).map_err(|_| corrupt())?,
        template: TemplateName::new(template).map_err(|_| corrupt())?,
        state: SandboxState::parse(&state).ok_or_else(corrupt)?,
        tier: Tier::parse(&tier).ok_or_else(corrupt)?,
        limits: serde_json::from_str(&limits).map_err(|_| corrupt())?,
        env: serde_json::from_str(&env).map_err(|_| corrupt())?,
        metadata: serde_json::from_str(&metadata).map_err(|_| corrupt())?,
        created_at,
        last_active_at,
        generation,
        image: serde_json::from_str(&image).map_err(|_| corrupt())?,
        last_error,
        oom_killed,
    })
}

/// A pool as stored: its owner and its spec as JSON (the control plane's `pools` module owns the
/// spec's type; the store keeps it opaque).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRow {
    pub name: String,
    pub tenant: TenantId,
    pub spec_json: String,
    pub created_at: UnixMillis,
}

impl Store {
    /// Records what a snapshot in the store holds for quota purposes: the checkpoint's size on
    /// disk before deduplication.
    pub fn set_snapshot_bytes(&self, snapshot: &str, bytes: u64) -> Result<(), StoreError> {
        self.with(|c| {
            c.execute(
                "INSERT OR REPLACE INTO snapshot_bytes(snapshot, bytes) VALUES (?1, ?2)",
                params![snapshot, bytes as i64],
            )
            .map(|_| ())
        })
    }

    pub fn snapshot_bytes(&self, snapshot: &str) -> Result<u64, StoreError> {
        self.with(|c| {
            c.query_row(
                "SELECT bytes FROM snapshot_bytes WHERE snapshot=?1",
                params![snapshot],
                |r| r.get::<_, i64>(0),
            )
            .optional()
            .map(|b| b.unwrap_or(0) as u64)
        })
    }

    pub fn forget_snapshot_bytes(&self, snapshot: &str) -> Result<(), StoreError> {
        self.with(|c| {
            c.execute(
                "DELETE FROM snapshot_bytes WHERE snapshot=?1",
                params![snapshot],
            )
            .map(|_| ())
        })
    }
}

impl Store {
    /// Pools `tenant` owns (the pools module owns the table's other SQL).
    pub fn count_pools(&self, tenant: &TenantId) -> Result<u64, StoreError> {
        self.with(|c| {
            c.query_row(
                "SELECT COUNT(*) FROM pools WHERE tenant=?1",
                params![tenant.as_str()],
                |r| r.get::<_, i64>(0),
            )
            .map(|n| n as u64)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox() -> SandboxRecord {
        SandboxRecord {
            id: SandboxId::generate(),
            tenant: TenantId::admin(),
            template: TemplateName::host(),
            state: SandboxState::Creating,
            tier: Tier::Running,
            limits: Limits::default(),
            env: BTreeMap::new(),
            metadata: [("k".to_string(), "v".to_string())].into(),
            created_at: 1,
            last_active_at: 1,
            generation: 1,
            image: ImageRef::Golden,
            last_error: None,
            oom_killed: false,
        }
    }

    #[test]
    fn env_values_are_sealed_at_rest_and_old_plain_rows_are_sealed_on_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let mut s = sandbox();
        s.env.insert("API_KEY".into(), "sk-live-hunter2".into());
        let mut old = sandbox();
        old.env.insert("OLD".into(), "plain-secret-7".into());
        {
            let store = Store::open(&path).unwrap();
            store.insert_sandbox(&s).unwrap();
            store.insert_sandbox(&old).unwrap();
            // As an older torpor wrote it: plain JSON.
            store
                .with(|c| {
                    c.execute(
                        "UPDATE sandboxes SET env=?2 WHERE id=?1",
                        params![old.id.as_str(), r#"{"OLD":"plain-secret-7"}"#],
                    )
                })
                .unwrap();
        }
        let store = Store::open(&path).unwrap();
        assert_eq!(store.sandbox(&s.id).unwrap().unwrap().env, s.env);
        assert_eq!(store.sandbox(&old.id).unwrap().unwrap().env, old.env);
        drop(store);
        // Checkpoint the WAL into the main file, then no file holds either secret.
        let c = Connection::open(&path).unwrap();
        c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE); VACUUM;")
            .unwrap();
        drop(c);
        for f in std::fs::read_dir(dir.path()).unwrap() {
            let bytes = std::fs::read(f.unwrap().path()).unwrap();
            let text = String::from_utf8_lossy(&bytes);
            assert!(!text.contains("hunter2"));
            assert!(!text.contains("plain-secret-7"));
        }
    }

    #[test]
    fn sandboxes_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        let mut s = sandbox();
        {
            let store = Store::open(&path).unwrap();
            store.insert_sandbox(&s).unwrap();
            s.state = SandboxState::Parked;
            s.image = ImageRef::Local("/x".into());
            s.generation = 2;
            store.update_sandbox(&s).unwrap();
        }
        let store = Store::open(&path).unwrap();
        assert_eq!(store.sandbox(&s.id).unwrap(), Some(s.clone()));
        store.touch_sandboxes(&[(s.id.clone(), 50)]).unwrap();
        assert_eq!(store.sandbox(&s.id).unwrap().unwrap().last_active_at, 50);
        store.delete_sandbox(&s.id).unwrap();
        assert!(store.sandboxes().unwrap().is_empty());
    }

    fn template(tenant: &str, name: &str) -> TemplateRecord {
        TemplateRecord {
            name: TemplateName::new(name).unwrap(),
            tenant: TenantId::new(tenant).unwrap(),
            spec: serde_json::from_value(
                serde_json::json!({"name": name, "source": {"kind": "host"}}),
            )
            .unwrap(),
            status: TemplateStatus::Ready,
            rootfs: "/r".into(),
            mounts: Vec::new(),
            agent_dir: "/a".into(),
            golden_dir: "/g".into(),
            golden_bytes: 0,
            created_at: 1,
        }
    }

    #[test]
    fn template_names_are_per_tenant_and_a_version_1_store_is_migrated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        {
            // A version-1 store: templates keyed by name alone.
            let c = Connection::open(&path).unwrap();
            let v1 = SCHEMA.replace(
                "    created_at INTEGER NOT NULL,\n    PRIMARY KEY (tenant, name)\n);",
                "    created_at INTEGER NOT NULL,\n    UNIQUE (name)\n);",
            );
            assert_ne!(v1, SCHEMA);
            c.execute_batch(&v1).unwrap();
            c.execute("INSERT INTO meta(key, value) VALUES ('schema', '1')", [])
                .unwrap();
        }
        {
            let store = Store::open(&path).unwrap();
            assert!(store.insert_template(&template("admin", "host")).unwrap());
        }
        let store = Store::open(&path).unwrap();
        let a = TenantId::new("a").unwrap();
        let b = TenantId::new("b").unwrap();
        let app = TemplateName::new("app").unwrap();
        assert!(store.insert_template(&template("a", "app")).unwrap());
        assert!(store.insert_template(&template("b", "app")).unwrap());
        assert!(!store.insert_template(&template("b", "app")).unwrap());
        assert_eq!(store.template(&a, &app).unwrap().unwrap().tenant, a);
        assert_eq!(store.template(&b, &app).unwrap().unwrap().tenant, b);
        let host = TemplateName::host();
        assert_eq!(
            store.template_for(&a, &host).unwrap().unwrap().tenant,
            TenantId::admin()
        );
        let mut sb = sandbox();
        sb.tenant = a.clone();
        sb.template = app.clone();
        store.insert_sandbox(&sb).unwrap();
        assert_eq!(store.count_sandboxes_of_template(&a, &app).unwrap(), 1);
        assert_eq!(store.count_sandboxes_of_template(&b, &app).unwrap(), 0);
        store.delete_template(&b, &app).unwrap();
        assert!(store.template(&b, &app).unwrap().is_none());
        assert!(store.template(&a, &app).unwrap().is_some());
        let v: String = store
            .with(|c| {
                c.query_row("SELECT value FROM meta WHERE key='schema'", [], |r| {
                    r.get(0)
                })
            })
            .unwrap();
        assert_eq!(v, "2");
    }

    #[test]
    fn newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        drop(Store::open(&path).unwrap());
        let c = Connection::open(&path).unwrap();
        c.execute("UPDATE meta SET value='99' WHERE key='schema'", [])
            .unwrap();
        drop(c);
        let err = Store::open(&path).err().unwrap();
        assert!(format!("{:?}", err).contains("newer"));
    }
}
