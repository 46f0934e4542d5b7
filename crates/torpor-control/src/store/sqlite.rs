//! [`SqliteStore`]: the state store in one embedded SQLite file (embedded mode).
//!
//! SQLite runs in WAL mode with `synchronous=FULL`: the WAL is fsynced at every commit, so a
//! committed transition survives a power loss as well as a daemon crash. Checkpoint images are
//! fsynced before a record points at them and the image a record left is removed only after
//! the record moved on, so a record never points at a missing or half-written image. Each
//! statement is a few tens of microseconds, so the store is called directly under a mutex on
//! its one connection rather than through a thread. Sandboxes' env values are sealed at rest
//! ([`crate::secrets`]). Records with a nested shape (limits, specs, images, GPU records) are
//! kept as JSON text; keys and what queries filter on are columns.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

use rusqlite::{params, Connection, OptionalExtension, Row};
use serde::de::DeserializeOwned;
use serde::Serialize;
use torpor_core::{
    Limits, NetworkPolicy, PoolName, SandboxId, SandboxState, TemplateName, TenantId, Tier,
    UnixMillis,
};
use torpor_gpu::cuda_checkpoint::Toggled;
use torpor_gpu::request::GpuRequest;

use super::records::*;
use super::{schema, SandboxCursor, StateStore, StoreError};

pub struct SqliteStore {
    conn: Mutex<Connection>,
    /// Seals sandboxes' env at rest (crate::secrets).
    env_seal: crate::secrets::EnvSeal,
}

fn json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("store values serialise")
}

fn unavailable(op: &'static str) -> impl FnOnce(rusqlite::Error) -> StoreError {
    move |e| StoreError::Unavailable {
        op,
        source: e.into(),
    }
}

impl SqliteStore {
    /// Opens (creating or migrating) the store in `path`; its env key lives beside it
    /// (`env.key`). Prefer [`super::Store::open`], which shares one store per file.
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        let open_err = |source: rusqlite::Error| StoreError::Open {
            path: path.to_path_buf(),
            source: source.into(),
        };
        let mut conn = Connection::open(path).map_err(open_err)?;
        conn.execute_batch(
            "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; PRAGMA busy_timeout=5000;",
        )
        .map_err(open_err)?;
        schema::migrate(&mut conn, path)?;
        let key = path.with_file_name("env.key");
        let env_seal = crate::secrets::EnvSeal::load_or_create(&key)?;
        let store = SqliteStore {
            conn: Mutex::new(conn),
            env_seal,
        };
        store.seal_plain_envs()?;
        if let Some(dir) = path.parent() {
            super::gpu_files::migrate(&store, dir)?;
        }
        Ok(store)
    }

    /// Runs `f` on the connection; its errors are [`StoreError::Unavailable`] for `op`.
    fn with<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut Connection) -> rusqlite::Result<T>,
    ) -> Result<T, StoreError> {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut conn).map_err(unavailable(op))
    }

    #[cfg(test)]
    pub(super) fn raw<T>(&self, f: impl FnOnce(&Connection) -> rusqlite::Result<T>) -> T {
        self.with("test", |c| f(c)).unwrap()
    }

    /// Seals env values written in plain text by an older torpor.
    fn seal_plain_envs(&self) -> Result<(), StoreError> {
        let plain: Vec<(String, String)> = self.with("read plain envs", |c| {
            let mut st = c.prepare("SELECT id, env FROM sandboxes WHERE env NOT LIKE 'enc1:%'")?;
            let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect()
        })?;
        for (id, env) in plain {
            let sealed = self.env_seal.seal(&id, &env);
            self.with("seal env", |c| {
                c.execute(
                    "UPDATE sandboxes SET env=?2 WHERE id=?1",
                    params![id, sealed],
                )
            })?;
        }
        Ok(())
    }

    fn parse_sandbox(&self, raw: RawSandbox) -> Result<(SandboxRecord, Version), StoreError> {
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

    /// A JSON value kept under a sandbox key in `table` (`gpu_requests`, `gpu_toggled`).
    fn sandbox_json<T: DeserializeOwned>(
        &self,
        what: &'static str,
        sql: &'static str,
        id: &SandboxId,
    ) -> Result<Option<T>, StoreError> {
        let text: Option<String> = self.with(what, |c| {
            c.query_row(sql, params![id.as_str()], |r| r.get(0))
                .optional()
        })?;
        text.map(|t| {
            serde_json::from_str(&t).map_err(|_| StoreError::Corrupt {
                what,
                key: id.to_string(),
            })
        })
        .transpose()
    }

    fn execute(
        &self,
        op: &'static str,
        sql: &'static str,
        params: impl rusqlite::Params,
    ) -> Result<usize, StoreError> {
        self.with(op, |c| c.execute(sql, params))
    }
}

impl StateStore for SqliteStore {
    // --- templates ---

    fn insert_template(&self, t: &TemplateRecord) -> Result<bool, StoreError> {
        let n = self.execute(
            "insert template",
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
    }

    fn update_template(&self, t: &TemplateRecord) -> Result<(), StoreError> {
        self.execute(
            "update template",
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
        .map(drop)
    }

    fn delete_template(&self, owner: &TenantId, name: &TemplateName) -> Result<(), StoreError> {
        self.execute(
            "delete template",
            "DELETE FROM templates WHERE name=?1 AND tenant=?2",
            params![name.as_str(), owner.as_str()],
        )
        .map(drop)
    }

    fn template(
        &self,
        owner: &TenantId,
        name: &TemplateName,
    ) -> Result<Option<TemplateRecord>, StoreError> {
        let row = self.with("read template", |c| {
            c.query_row(
                &format!("{TEMPLATE_COLUMNS} WHERE name=?1 AND tenant=?2"),
                params![name.as_str(), owner.as_str()],
                raw_template,
            )
            .optional()
        })?;
        row.map(parse_template).transpose()
    }

    fn templates(&self) -> Result<Vec<TemplateRecord>, StoreError> {
        let rows = self.with("read templates", |c| {
            let mut st = c.prepare(&format!("{TEMPLATE_COLUMNS} ORDER BY name, tenant"))?;
            let rows = st.query_map([], raw_template)?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
        })?;
        rows.into_iter().map(parse_template).collect()
    }

    // --- sandboxes ---

    fn insert_sandbox(&self, s: &SandboxRecord) -> Result<(), StoreError> {
        let result = self.with("insert sandbox", |c| {
            c.execute(
                "INSERT INTO sandboxes
                 (id, tenant, template, state, tier, limits, env, metadata, created_at, last_active_at,
                  generation, image, last_error, oom_killed, version)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, 0)",
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
        });
        match result {
            Ok(_) => Ok(()),
            Err(StoreError::Unavailable { source, .. })
                if source
                    .downcast_ref::<rusqlite::Error>()
                    .and_then(rusqlite::Error::sqlite_error_code)
                    == Some(rusqlite::ErrorCode::ConstraintViolation) =>
            {
                Err(StoreError::Conflict {
                    what: "sandbox",
                    key: s.id.to_string(),
                    expected: Version(0),
                })
            }
            Err(e) => Err(e),
        }
    }

    fn update_sandbox(&self, s: &SandboxRecord) -> Result<(), StoreError> {
        self.execute(
            "update sandbox",
            "UPDATE sandboxes SET state=?2, tier=?3, last_active_at=?4, generation=?5, image=?6,
             last_error=?7, oom_killed=?8, version=version+1 WHERE id=?1",
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
        .map(drop)
    }

    fn compare_and_set_sandbox(
        &self,
        s: &SandboxRecord,
        expected: Version,
    ) -> Result<Version, StoreError> {
        let (written, found) = self.with("compare and set sandbox", |c| {
            let tx = c.transaction()?;
            let n = tx.execute(
                "UPDATE sandboxes SET state=?2, tier=?3, last_active_at=?4, generation=?5, image=?6,
                 last_error=?7, oom_killed=?8, version=version+1 WHERE id=?1 AND version=?9",
                params![
                    s.id.as_str(),
                    s.state.as_str(),
                    s.tier.as_str(),
                    s.last_active_at,
                    s.generation,
                    json(&s.image),
                    s.last_error,
                    s.oom_killed,
                    expected.0 as i64,
                ],
            )?;
            let found: Option<i64> = tx
                .query_row(
                    "SELECT version FROM sandboxes WHERE id=?1",
                    params![s.id.as_str()],
                    |r| r.get(0),
                )
                .optional()?;
            tx.commit()?;
            Ok((n == 1, found))
        })?;
        match (written, found) {
            (true, Some(v)) => Ok(Version(v as u64)),
            (_, None) => Err(StoreError::NotFound {
                what: "sandbox",
                key: s.id.to_string(),
            }),
            (false, Some(_)) => Err(StoreError::Conflict {
                what: "sandbox",
                key: s.id.to_string(),
                expected,
            }),
        }
    }

    fn sandbox_versioned(
        &self,
        id: &SandboxId,
    ) -> Result<Option<(SandboxRecord, Version)>, StoreError> {
        // Cached: every call into a sandbox reads it, and parsing the statement each time was
        // a visible share of a call's time in the daemon.
        let row = self.with("read sandbox", |c| {
            c.prepare_cached(&format!("{SANDBOX_COLUMNS} WHERE id=?1"))?
                .query_row(params![id.as_str()], raw_sandbox)
                .optional()
        })?;
        row.map(|r| self.parse_sandbox(r)).transpose()
    }

    fn set_sandbox_metadata(
        &self,
        id: &SandboxId,
        metadata: &BTreeMap<String, String>,
    ) -> Result<(), StoreError> {
        self.execute(
            "set sandbox metadata",
            "UPDATE sandboxes SET metadata=?2 WHERE id=?1",
            params![id.as_str(), json(metadata)],
        )
        .map(drop)
    }

    fn touch_sandboxes(&self, touched: &[(SandboxId, UnixMillis)]) -> Result<(), StoreError> {
        if touched.is_empty() {
            return Ok(());
        }
        self.with("touch sandboxes", |c| {
            let tx = c.transaction()?;
            {
                let mut st = tx.prepare(
                    "UPDATE sandboxes SET last_active_at=?2 WHERE id=?1 AND last_active_at < ?2",
                )?;
                for (id, at) in touched {
                    st.execute(params![id.as_str(), at])?;
                }
            }
            tx.commit()
        })
    }

    fn delete_sandbox(&self, id: &SandboxId) -> Result<(), StoreError> {
        self.with("delete sandbox", |c| {
            let tx = c.transaction()?;
            tx.execute(
                "DELETE FROM sandbox_network WHERE id=?1",
                params![id.as_str()],
            )?;
            tx.execute("DELETE FROM sandboxes WHERE id=?1", params![id.as_str()])?;
            tx.commit()
        })
    }

    fn sandboxes(&self) -> Result<Vec<SandboxRecord>, StoreError> {
        let rows = self.with("read sandboxes", |c| {
            let mut st = c.prepare(&format!("{SANDBOX_COLUMNS} ORDER BY created_at, id"))?;
            let rows = st.query_map([], raw_sandbox)?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
        })?;
        rows.into_iter()
            .map(|r| self.parse_sandbox(r).map(|(s, _)| s))
            .collect()
    }

    fn sandboxes_with_metadata(&self, key: &str) -> Result<Vec<SandboxRecord>, StoreError> {
        let needle = super::metadata_key_text(key);
        let rows = self.with("read sandboxes by metadata key", |c| {
            let mut st = c.prepare_cached(&format!(
                "{SANDBOX_COLUMNS} WHERE instr(metadata, ?1) > 0 ORDER BY created_at, id"
            ))?;
            let rows = st.query_map(params![needle], raw_sandbox)?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
        })?;
        let mut out = rows
            .into_iter()
            .map(|r| self.parse_sandbox(r).map(|(s, _)| s))
            .collect::<Result<Vec<_>, _>>()?;
        out.retain(|s| s.metadata.contains_key(key));
        Ok(out)
    }

    fn sandboxes_to_tend(
        &self,
        parked_before: UnixMillis,
    ) -> Result<Vec<SandboxRecord>, StoreError> {
        // Two partial indexes (schema 4): the awake few, and the parked by age.
        let rows = self.with("read the sandboxes to tend", |c| {
            let mut st = c.prepare_cached(&format!(
                "{SANDBOX_COLUMNS} WHERE state NOT IN ('parked', 'suspended') \
                 UNION ALL {SANDBOX_COLUMNS} WHERE state = 'parked' AND last_active_at < ?1 \
                 ORDER BY created_at, id"
            ))?;
            let rows = st.query_map(params![parked_before], raw_sandbox)?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
        })?;
        rows.into_iter()
            .map(|r| self.parse_sandbox(r).map(|(s, _)| s))
            .collect()
    }

    fn sandbox_counts(&self) -> Result<Vec<(SandboxState, Tier, u64)>, StoreError> {
        // A count over the `(state, tier)` index; no record is read or decrypted.
        let rows = self.with("count sandboxes", |c| {
            let mut st = c.prepare_cached(
                "SELECT state, tier, COUNT(*) FROM sandboxes GROUP BY state, tier",
            )?;
            let rows = st.query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            })?;
            rows.collect::<rusqlite::Result<Vec<_>>>()
        })?;
        rows.into_iter()
            .map(|(state, tier, n)| super::state_count(&state, &tier, n))
            .collect()
    }

    fn sandboxes_page(
        &self,
        tenant: Option<&TenantId>,
        state: Option<&str>,
        after: Option<&SandboxCursor>,
        limit: usize,
    ) -> Result<Vec<SandboxRecord>, StoreError> {
        // A range scan of `sandboxes_created` or `sandboxes_tenant_created` (schema 4) from the
        // cursor on; the first page starts below every key.
        let (at, id) = after.map_or((UnixMillis::MIN, ""), |a| (a.created_at, a.id.as_str()));
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self.with("read a page of sandboxes", |c| {
            let mut st = c.prepare_cached(if tenant.is_some() {
                PAGE_OF_TENANT
            } else {
                PAGE
            })?;
            let rows = match tenant {
                Some(t) => st.query_map(params![at, id, state, limit, t.as_str()], raw_sandbox)?,
                None => st.query_map(params![at, id, state, limit], raw_sandbox)?,
            };
            rows.collect::<rusqlite::Result<Vec<_>>>()
        })?;
        rows.into_iter()
            .map(|r| self.parse_sandbox(r).map(|(s, _)| s))
            .collect()
    }

    fn count_sandboxes_of_template(
        &self,
        owner: &TenantId,
        name: &TemplateName,
    ) -> Result<u64, StoreError> {
        self.with("count sandboxes of a template", |c| {
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

    // --- network ---

    fn set_network(&self, id: &SandboxId, policy: &NetworkPolicy) -> Result<(), StoreError> {
        self.execute(
            "set network policy",
            "INSERT INTO sandbox_network (id, policy) VALUES (?1, ?2)
             ON CONFLICT(id) DO UPDATE SET policy=excluded.policy",
            params![id.as_str(), json(policy)],
        )
        .map(drop)
    }

    fn network(&self, id: &SandboxId) -> Result<Option<NetworkPolicy>, StoreError> {
        self.sandbox_json(
            "sandbox network policy",
            "SELECT policy FROM sandbox_network WHERE id=?1",
            id,
        )
    }

    // --- tenants ---

    fn insert_tenant(&self, t: &TenantRecord, token_hash: &str) -> Result<bool, StoreError> {
        let n = self.execute(
            "insert tenant",
            "INSERT OR IGNORE INTO tenants (id, token_hash, created_at, quotas) VALUES (?1, ?2, ?3, ?4)",
            params![t.id.as_str(), token_hash, t.created_at, json(&t.quotas)],
        )?;
        Ok(n == 1)
    }

    fn tenant_by_token_hash(&self, token_hash: &str) -> Result<Option<TenantId>, StoreError> {
        let id: Option<String> = self.with("find tenant by token", |c| {
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

    fn tenants(&self) -> Result<Vec<TenantRecord>, StoreError> {
        let rows: Vec<(String, i64, String)> = self.with("read tenants", |c| {
            let mut st = c.prepare("SELECT id, created_at, quotas FROM tenants ORDER BY id")?;
            let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
            rows.collect()
        })?;
        rows.into_iter().map(parse_tenant).collect()
    }

    fn tenant(&self, id: &TenantId) -> Result<Option<TenantRecord>, StoreError> {
        let row: Option<(String, i64, String)> = self.with("read tenant", |c| {
            c.query_row(
                "SELECT id, created_at, quotas FROM tenants WHERE id=?1",
                params![id.as_str()],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()
        })?;
        row.map(parse_tenant).transpose()
    }

    fn delete_tenant(&self, id: &TenantId) -> Result<bool, StoreError> {
        self.execute(
            "delete tenant",
            "DELETE FROM tenants WHERE id=?1",
            params![id.as_str()],
        )
        .map(|n| n == 1)
    }

    fn usage(&self, tenant: &TenantId) -> Result<Usage, StoreError> {
        let mut u = Usage::default();
        let rows: Vec<(String, String)> = self.with("read a tenant's holdings", |c| {
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

    // --- snapshot sizes ---

    fn set_snapshot_bytes(&self, snapshot: &str, bytes: u64) -> Result<(), StoreError> {
        self.execute(
            "set snapshot size",
            "INSERT INTO snapshot_bytes(snapshot, bytes) VALUES (?1, ?2)
             ON CONFLICT(snapshot) DO UPDATE SET bytes=excluded.bytes",
            params![snapshot, bytes as i64],
        )
        .map(drop)
    }

    fn snapshot_bytes(&self, snapshot: &str) -> Result<u64, StoreError> {
        self.with("read snapshot size", |c| {
            c.query_row(
                "SELECT bytes FROM snapshot_bytes WHERE snapshot=?1",
                params![snapshot],
                |r| r.get::<_, i64>(0),
            )
            .optional()
            .map(|b| b.unwrap_or(0).max(0) as u64)
        })
    }

    fn forget_snapshot_bytes(&self, snapshot: &str) -> Result<(), StoreError> {
        self.execute(
            "forget snapshot size",
            "DELETE FROM snapshot_bytes WHERE snapshot=?1",
            params![snapshot],
        )
        .map(drop)
    }

    // --- pools ---

    fn insert_pool(&self, p: &PoolRow) -> Result<bool, StoreError> {
        self.execute(
            "insert pool",
            "INSERT OR IGNORE INTO pools(tenant, name, spec, created_at) VALUES (?1, ?2, ?3, ?4)",
            params![
                p.tenant.as_str(),
                p.name.as_str(),
                p.spec_json,
                p.created_at
            ],
        )
        .map(|n| n == 1)
    }

    fn delete_pool(&self, tenant: &TenantId, name: &PoolName) -> Result<bool, StoreError> {
        self.execute(
            "delete pool",
            "DELETE FROM pools WHERE tenant=?1 AND name=?2",
            params![tenant.as_str(), name.as_str()],
        )
        .map(|n| n == 1)
    }

    fn count_pools(&self, tenant: &TenantId) -> Result<u64, StoreError> {
        self.with("count pools", |c| {
            c.query_row(
                "SELECT COUNT(*) FROM pools WHERE tenant=?1",
                params![tenant.as_str()],
                |r| r.get::<_, i64>(0),
            )
            .map(|n| n.max(0) as u64)
        })
    }

    fn pools(&self) -> Result<Vec<PoolRow>, StoreError> {
        let rows: Vec<(String, String, String, i64)> = self.with("read pools", |c| {
            let mut st = c.prepare(
                "SELECT tenant, name, spec, created_at FROM pools ORDER BY tenant, name",
            )?;
            let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?;
            rows.collect()
        })?;
        rows.into_iter()
            .map(|(tenant, name, spec_json, created_at)| {
                let corrupt = || StoreError::Corrupt {
                    what: "pool",
                    key: format!("{tenant}/{name}"),
                };
                Ok(PoolRow {
                    tenant: TenantId::new(&tenant).map_err(|_| corrupt())?,
                    name: PoolName::new(&name).map_err(|_| corrupt())?,
                    spec_json,
                    created_at,
                })
            })
            .collect()
    }

    // --- GPU ---

    fn gpu_shares(&self) -> Result<Vec<(SandboxId, ShareRecord)>, StoreError> {
        let rows: Vec<(String, String)> = self.with("read GPU shares", |c| {
            let mut st = c.prepare("SELECT sandbox, data FROM gpu_shares ORDER BY sandbox")?;
            let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
            rows.collect()
        })?;
        let mut out = Vec::with_capacity(rows.len());
        for (sandbox, data) in rows {
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
            "INSERT INTO gpu_shares(sandbox, state, data) VALUES (?1, ?2, ?3)
             ON CONFLICT(sandbox) DO UPDATE SET state=excluded.state, data=excluded.data",
            params![id.as_str(), record.state(), json(record)],
        )
        .map(drop)
    }

    fn delete_gpu_share(&self, id: &SandboxId) -> Result<(), StoreError> {
        self.execute(
            "delete GPU share",
            "DELETE FROM gpu_shares WHERE sandbox=?1",
            params![id.as_str()],
        )
        .map(drop)
    }

    fn put_gpu_request(&self, id: &SandboxId, request: &GpuRequest) -> Result<(), StoreError> {
        self.execute(
            "write GPU request",
            "INSERT INTO gpu_requests(sandbox, request) VALUES (?1, ?2)
             ON CONFLICT(sandbox) DO UPDATE SET request=excluded.request",
            params![id.as_str(), json(request)],
        )
        .map(drop)
    }

    fn gpu_request(&self, id: &SandboxId) -> Result<Option<GpuRequest>, StoreError> {
        self.sandbox_json(
            "GPU request",
            "SELECT request FROM gpu_requests WHERE sandbox=?1",
            id,
        )
    }

    fn delete_gpu_request(&self, id: &SandboxId) -> Result<bool, StoreError> {
        self.execute(
            "delete GPU request",
            "DELETE FROM gpu_requests WHERE sandbox=?1",
            params![id.as_str()],
        )
        .map(|n| n > 0)
    }

    fn put_gpu_toggled(&self, id: &SandboxId, toggled: &Toggled) -> Result<(), StoreError> {
        self.execute(
            "write cuda-checkpoint record",
            "INSERT INTO gpu_toggled(sandbox, toggled) VALUES (?1, ?2)
             ON CONFLICT(sandbox) DO UPDATE SET toggled=excluded.toggled",
            params![id.as_str(), json(toggled)],
        )
        .map(drop)
    }

    fn gpu_toggled(&self, id: &SandboxId) -> Result<Option<Toggled>, StoreError> {
        self.sandbox_json(
            "cuda-checkpoint record",
            "SELECT toggled FROM gpu_toggled WHERE sandbox=?1",
            id,
        )
    }

    fn delete_gpu_toggled(&self, id: &SandboxId) -> Result<(), StoreError> {
        self.execute(
            "delete cuda-checkpoint record",
            "DELETE FROM gpu_toggled WHERE sandbox=?1",
            params![id.as_str()],
        )
        .map(drop)
    }

    // --- metric samples ---

    fn put_metric_samples(&self, rows: &[(SandboxId, i64, String)]) -> Result<(), StoreError> {
        if rows.is_empty() {
            return Ok(());
        }
        self.with("keep metric samples", |c| {
            let tx = c.transaction()?;
            {
                let mut st = tx.prepare_cached(
                    "INSERT INTO metric_samples (sandbox, ts_ms, sample) VALUES (?1, ?2, ?3)
                     ON CONFLICT (sandbox, ts_ms) DO NOTHING",
                )?;
                for (id, ts, sample) in rows {
                    st.execute(params![id.as_str(), ts, sample])?;
                }
            }
            tx.commit()
        })
    }

    fn metric_samples(
        &self,
        id: &SandboxId,
        from_ms: i64,
        to_ms: i64,
        limit: usize,
    ) -> Result<Vec<(i64, String)>, StoreError> {
        self.with("read metric samples", |c| {
            let mut st = c.prepare_cached(
                "SELECT ts_ms, sample FROM (
                     SELECT ts_ms, sample FROM metric_samples
                     WHERE sandbox = ?1 AND ts_ms >= ?2 AND ts_ms <= ?3
                     ORDER BY ts_ms DESC LIMIT ?4)
                 ORDER BY ts_ms",
            )?;
            let rows = st.query_map(
                params![
                    id.as_str(),
                    from_ms,
                    to_ms,
                    limit.min(i64::MAX as usize) as i64
                ],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?;
            rows.collect()
        })
    }

    fn prune_metric_samples(&self, before_ms: i64) -> Result<u64, StoreError> {
        self.with("prune metric samples", |c| {
            let old = c.execute(
                "DELETE FROM metric_samples WHERE ts_ms < ?1",
                params![before_ms],
            )?;
            let gone = c.execute(
                "DELETE FROM metric_samples WHERE sandbox NOT IN (SELECT id FROM sandboxes)",
                [],
            )?;
            Ok((old + gone) as u64)
        })
    }

    // --- usage intervals ---

    fn add_usage(&self, rows: &[UsageInterval]) -> Result<(), StoreError> {
        self.with("record usage", |c| {
            let tx = c.transaction()?;
            {
                let mut st = tx.prepare_cached(
                    "INSERT INTO usage_intervals (start_s, tenant, sandbox, measure, dim, value)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                     ON CONFLICT (start_s, tenant, sandbox, measure, dim)
                     DO UPDATE SET value = value + excluded.value",
                )?;
                for r in rows.iter().filter(|r| r.value > 0.0) {
                    st.execute(params![
                        r.start_s,
                        r.tenant.as_str(),
                        r.sandbox.as_str(),
                        r.measure,
                        r.dim,
                        r.value
                    ])?;
                }
            }
            tx.commit()
        })
    }

    fn usage_intervals(
        &self,
        from_s: i64,
        to_s: i64,
        tenant: Option<&TenantId>,
    ) -> Result<Vec<UsageInterval>, StoreError> {
        type Raw = (String, String, i64, String, String, f64);
        let rows: Vec<Raw> = self.with("read usage", |c| {
            let mut st = c.prepare_cached(
                "SELECT tenant, sandbox, start_s, measure, dim, value FROM usage_intervals
                 WHERE start_s >= ?1 AND start_s < ?2 AND (?3 IS NULL OR tenant = ?3)",
            )?;
            let rows = st.query_map(params![from_s, to_s, tenant.map(|t| t.as_str())], |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                ))
            })?;
            rows.collect()
        })?;
        let mut out = Vec::with_capacity(rows.len());
        for (tenant, sandbox, start_s, measure, dim, value) in rows {
            let (Ok(t), Ok(s)) = (TenantId::new(&tenant), SandboxId::new(&sandbox)) else {
                tracing::warn!(%tenant, %sandbox, %measure, "unreadable usage row; ignored");
                continue;
            };
            out.push(UsageInterval {
                start_s,
                tenant: t,
                sandbox: s,
                measure,
                dim,
                value,
            });
        }
        Ok(out)
    }
}

pub(super) fn parse_tenant(
    (id, created_at, quotas): (String, i64, String),
) -> Result<TenantRecord, StoreError> {
    let corrupt = || StoreError::Corrupt {
        what: "tenant",
        key: id.clone(),
    };
    Ok(TenantRecord {
        id: TenantId::new(&id).map_err(|_| corrupt())?,
        created_at,
        quotas: serde_json::from_str(&quotas).map_err(|_| corrupt())?,
    })
}

const TEMPLATE_COLUMNS: &str = "SELECT name, tenant, spec, status, rootfs, mounts, agent_dir,
    golden_dir, golden_bytes, created_at FROM templates";

const SANDBOX_COLUMNS: &str =
    "SELECT id, tenant, template, state, tier, limits, env, metadata, created_at,
    last_active_at, generation, image, last_error, oom_killed, version FROM sandboxes";

/// A page of every tenant's sandboxes.
pub(super) const PAGE: &str =
    "SELECT id, tenant, template, state, tier, limits, env, metadata, created_at,
    last_active_at, generation, image, last_error, oom_killed, version FROM sandboxes
    WHERE (created_at, id) > (?1, ?2) AND (?3 IS NULL OR state = ?3 OR tier = ?3)
    ORDER BY created_at, id LIMIT ?4";
/// A page of one tenant's sandboxes.
pub(super) const PAGE_OF_TENANT: &str =
    "SELECT id, tenant, template, state, tier, limits, env, metadata,
    created_at, last_active_at, generation, image, last_error, oom_killed, version FROM sandboxes
    WHERE tenant = ?5 AND (created_at, id) > (?1, ?2) AND (?3 IS NULL OR state = ?3 OR tier = ?3)
    ORDER BY created_at, id LIMIT ?4";

pub(super) type RawTemplate = (
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

pub(super) fn parse_template(raw: RawTemplate) -> Result<TemplateRecord, StoreError> {
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

pub(super) type RawSandbox = (
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
    i64,
    Option<String>,
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
        r.get(14)?,
        None,
    ))
}

pub(super) fn parse_sandbox(raw: RawSandbox) -> Result<(SandboxRecord, Version), StoreError> {
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
        version,
        controller,
    ) = raw;
    let corrupt = || StoreError::Corrupt {
        what: "sandbox",
        key: id.clone(),
    };
    let record = SandboxRecord {
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
        controller,
        version: Version(version.max(0) as u64),
    };
    let version = record.version;
    Ok((record, version))
}
