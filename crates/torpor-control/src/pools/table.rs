//! The `pools` table, keyed by (tenant, name). This module owns it; a table from before pool
//! names were per tenant (keyed by name alone) is rebuilt in place, rows kept.

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
        let mut st =
            c.prepare("SELECT tenant, name, spec, created_at FROM pools ORDER BY tenant, name")?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use torpor_core::TenantId;

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
        migrate(&store).unwrap();
        migrate(&store).unwrap();
        let rows = all(&store).unwrap();
        assert_eq!(
            rows,
            vec![row("team-a", "jobs")],
            "rows survive the migration"
        );
        assert!(insert(&store, &row("team-b", "jobs")).unwrap());
        assert!(!insert(&store, &row("team-b", "jobs")).unwrap());
        assert_eq!(count(&store, &TenantId::new("team-a").unwrap()).unwrap(), 1);
        assert!(delete(&store, &TenantId::new("team-b").unwrap(), "jobs").unwrap());
        assert_eq!(all(&store).unwrap(), vec![row("team-a", "jobs")]);
        // Opening the store again (its schema's CREATE IF NOT EXISTS) keeps the new table.
        drop(store);
        let store = Store::open(&dir.path().join("torpor.db")).unwrap();
        migrate(&store).unwrap();
        assert!(insert(&store, &row("team-b", "jobs")).unwrap());
        assert_eq!(all(&store).unwrap().len(), 2);
    }
}
