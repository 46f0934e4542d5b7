//! Tests of the state store (a test file, long because one suite runs on both backends). The trait's behaviour is tested on both backends (SQLite, and a
//! real PostgreSQL server started by [`super::pg_testing`]): every record kind, reopening,
//! env sealing, compare-and-set, a newer schema. Then each backend's own: SQLite's migrations
//! from databases built with the SQL older versions wrote and the move of GPU state files;
//! PostgreSQL's controllers migrating together, racing compare-and-sets across controllers, a
//! torn connection, and a controller with another env key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};

use rusqlite::{params, Connection};
use torpor_core::{
    Limits, NetworkPolicy, PoolName, SandboxId, SandboxState, TemplateName, TenantId, Tier,
};
use torpor_gpu::cuda_checkpoint::{Toggled, Tool};
use torpor_gpu::ids::NodeName;
use torpor_gpu::partition::PartitionMode;
use torpor_gpu::request::GpuRequest;
use torpor_gpu::sleep::SleepTicket;

use super::pg_testing::{self, Admin};
use super::*;

/// One backend under test: opens (and reopens) one store, and reaches its rows beside it.
trait Backend {
    fn open(&self) -> Result<Box<dyn StateStore>, StoreError>;
    /// Runs `sql` (text parameters `$1…`) on the store's database directly.
    fn exec(&self, sql: &str, args: &[&str]);
    /// The first column of each row of `sql`, as text.
    fn texts(&self, sql: &str, args: &[&str]) -> Vec<String>;
}

struct Sqlite {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl Sqlite {
    fn new() -> Sqlite {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.db");
        Sqlite { _dir: dir, path }
    }
}

impl Backend for Sqlite {
    fn open(&self) -> Result<Box<dyn StateStore>, StoreError> {
        Ok(Box::new(SqliteStore::open(&self.path)?))
    }

    fn exec(&self, sql: &str, args: &[&str]) {
        Connection::open(&self.path)
            .unwrap()
            .execute(&sqlite_sql(sql), rusqlite::params_from_iter(args))
            .unwrap();
    }

    fn texts(&self, sql: &str, args: &[&str]) -> Vec<String> {
        let c = Connection::open(&self.path).unwrap();
        let mut st = c.prepare(&sqlite_sql(sql)).unwrap();
        let rows = st
            .query_map(rusqlite::params_from_iter(args), |r| r.get::<_, String>(0))
            .unwrap();
        rows.map(Result::unwrap).collect()
    }
}

/// `sql` with PostgreSQL's parameters (`$1`) as SQLite's numbered ones (`?1`): SQLite reads
/// `$1` as a named parameter, numbered by first appearance.
fn sqlite_sql(sql: &str) -> String {
    sql.replace('$', "?")
}

/// A database of its own on the test process's PostgreSQL server.
struct Postgres {
    dir: tempfile::TempDir,
    db: String,
    server: &'static pg_testing::Server,
    admin: Admin,
}

impl Postgres {
    /// `None` (the server's message said why) when PostgreSQL is not installed here.
    fn new() -> Option<Postgres> {
        let server = pg_testing::server()?;
        let db = pg_testing::new_database(server);
        Some(Postgres {
            dir: tempfile::tempdir().unwrap(),
            admin: Admin::connect(&server.url(&db)),
            db,
            server,
        })
    }

    fn url(&self) -> String {
        self.server.url(&self.db)
    }

    fn key(&self) -> PathBuf {
        self.dir.path().join("env.key")
    }

    fn connect(&self) -> PostgresStore {
        PostgresStore::connect(&self.url(), &self.key()).unwrap()
    }
}

impl Backend for Postgres {
    fn open(&self) -> Result<Box<dyn StateStore>, StoreError> {
        Ok(Box::new(PostgresStore::connect(&self.url(), &self.key())?))
    }

    fn exec(&self, sql: &str, args: &[&str]) {
        self.admin.exec(sql, args);
    }

    fn texts(&self, sql: &str, args: &[&str]) -> Vec<String> {
        self.admin.texts(sql, args)
    }
}

/// Runs each named test (a `fn(&dyn Backend)`) on SQLite and on PostgreSQL.
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod on_sqlite {
            $( #[test] fn $name() { super::$name(&super::Sqlite::new()) } )*
        }
        mod on_postgres {
            $( #[test] fn $name() {
                if let Some(b) = super::Postgres::new() { super::$name(&b) }
            } )*
        }
    };
}

on_both_backends!(
    templates_are_per_tenant_with_the_operators_as_fallback,
    sandboxes_survive_reopen_and_each_write_lands_where_it_should,
    env_values_are_sealed_at_rest,
    network_policies_are_set_replaced_and_read,
    tenants_tokens_and_holdings,
    snapshot_sizes_are_recorded_replaced_and_forgotten,
    pools_are_keyed_by_tenant_and_name,
    gpu_shares_requests_and_toggles_are_kept_per_sandbox,
    usage_intervals_add_up_per_key_and_filter_by_tenant_and_range,
    metric_samples_are_kept_read_by_time_and_pruned,
    compare_and_set_writes_only_over_the_version_it_read,
    the_policy_reads_awake_and_due_sandboxes_and_counts_the_rest,
    a_newer_schema_is_refused_as_unavailable,
    sandboxes_are_read_in_keyset_pages,
    sandboxes_are_found_by_metadata_key,
    sandboxes_are_read_by_id_in_one_call,
);

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
        controller: None,
        version: Version(0),
    }
}

fn template(tenant: &str, name: &str) -> TemplateRecord {
    TemplateRecord {
        name: TemplateName::new(name).unwrap(),
        tenant: TenantId::new(tenant).unwrap(),
        spec: serde_json::from_value(serde_json::json!({"name": name, "source": {"kind": "host"}}))
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

fn tenant(id: &str) -> TenantId {
    TenantId::new(id).unwrap()
}

fn pool(t: &str, name: &str) -> PoolRow {
    PoolRow {
        name: PoolName::new(name).unwrap(),
        tenant: tenant(t),
        spec_json: format!("{{\"name\":\"{name}\"}}"),
        created_at: 1,
    }
}

fn schema_version(path: &Path) -> String {
    Connection::open(path)
        .unwrap()
        .query_row("SELECT value FROM meta WHERE key='schema'", [], |r| {
            r.get(0)
        })
        .unwrap()
}

fn sqlite(path: &Path) -> SqliteStore {
    SqliteStore::open(path).unwrap()
}

fn templates_are_per_tenant_with_the_operators_as_fallback(b: &dyn Backend) {
    let store = b.open().unwrap();
    let (a, b) = (tenant("a"), tenant("b"));
    let app = TemplateName::new("app").unwrap();
    assert!(store.insert_template(&template("a", "app")).unwrap());
    assert!(store.insert_template(&template("b", "app")).unwrap());
    assert!(!store.insert_template(&template("b", "app")).unwrap());
    assert!(store.insert_template(&template("admin", "host")).unwrap());
    assert_eq!(store.template(&a, &app).unwrap().unwrap().tenant, a);
    assert_eq!(store.template(&b, &app).unwrap().unwrap().tenant, b);
    assert_eq!(
        store
            .template_for(&a, &TemplateName::host())
            .unwrap()
            .unwrap()
            .tenant,
        TenantId::admin()
    );
    assert!(store.template(&a, &TemplateName::host()).unwrap().is_none());

    let mut t = template("a", "app");
    t.status = TemplateStatus::Building;
    t.golden_bytes = 4096;
    t.agent_dir = "/agent2".into();
    store.update_template(&t).unwrap();
    assert_eq!(store.template(&a, &app).unwrap(), Some(t));
    assert_eq!(
        store.template(&b, &app).unwrap().unwrap().status,
        TemplateStatus::Ready,
        "another tenant's template of the same name is untouched"
    );
    assert_eq!(store.templates().unwrap().len(), 3);

    let mut sb = sandbox();
    sb.tenant = a.clone();
    sb.template = app.clone();
    store.insert_sandbox(&sb).unwrap();
    assert_eq!(store.count_sandboxes_of_template(&a, &app).unwrap(), 1);
    assert_eq!(store.count_sandboxes_of_template(&b, &app).unwrap(), 0);
    store.delete_template(&b, &app).unwrap();
    assert!(store.template(&b, &app).unwrap().is_none());
    assert!(store.template(&a, &app).unwrap().is_some());
}

fn sandboxes_survive_reopen_and_each_write_lands_where_it_should(b: &dyn Backend) {
    let mut s = sandbox();
    {
        let store = b.open().unwrap();
        store.insert_sandbox(&s).unwrap();
        let again = store.insert_sandbox(&s).unwrap_err();
        assert_eq!(again.kind(), StoreErrorKind::Conflict);
        s.state = SandboxState::Parked;
        s.tier = Tier::Parked;
        s.image = ImageRef::Local("/x".into());
        s.generation = 2;
        s.last_error = Some("restored to its last snapshot".into());
        s.oom_killed = true;
        store.update_sandbox(&s).unwrap();
        s.version = Version(1); // the write moved it on
    }
    let store = b.open().unwrap();
    assert_eq!(store.sandbox(&s.id).unwrap(), Some(s.clone()));
    store.touch_sandboxes(&[(s.id.clone(), 50)]).unwrap();
    store.touch_sandboxes(&[(s.id.clone(), 20)]).unwrap();
    assert_eq!(
        store.sandbox(&s.id).unwrap().unwrap().last_active_at,
        50,
        "activity only moves forward"
    );
    // One batch naming a sandbox twice keeps the later time.
    store
        .touch_sandboxes(&[(s.id.clone(), 70), (s.id.clone(), 60)])
        .unwrap();
    assert_eq!(store.sandbox(&s.id).unwrap().unwrap().last_active_at, 70);
    let meta: BTreeMap<String, String> =
        [("e2b.lifecycle".to_string(), "pause".to_string())].into();
    store.set_sandbox_metadata(&s.id, &meta).unwrap();
    let read = store.sandbox(&s.id).unwrap().unwrap();
    assert_eq!(read.metadata, meta);
    assert_eq!(
        read.state,
        SandboxState::Parked,
        "metadata writes nothing else"
    );

    let other = sandbox();
    store.insert_sandbox(&other).unwrap();
    assert_eq!(store.sandboxes().unwrap().len(), 2);
    store.set_network(&s.id, &NetworkPolicy::full()).unwrap();
    store.delete_sandbox(&s.id).unwrap();
    assert!(store.sandbox(&s.id).unwrap().is_none());
    assert!(
        store.network(&s.id).unwrap().is_none(),
        "the policy goes with its sandbox"
    );
    assert_eq!(store.sandboxes().unwrap(), vec![other]);
    // An update of a deleted sandbox leaves it deleted.
    store.update_sandbox(&s).unwrap();
    assert!(store.sandbox(&s.id).unwrap().is_none());
}

fn env_values_are_sealed_at_rest(b: &dyn Backend) {
    let mut s = sandbox();
    s.env.insert("API_KEY".into(), "sk-live-hunter2".into());
    {
        let store = b.open().unwrap();
        store.insert_sandbox(&s).unwrap();
    }
    let stored = b.texts("SELECT env FROM sandboxes WHERE id=$1", &[s.id.as_str()]);
    assert_eq!(stored.len(), 1);
    assert!(
        crate::secrets::EnvSeal::is_sealed(&stored[0]),
        "{}",
        stored[0]
    );
    assert!(!stored[0].contains("hunter2"));
    let store = b.open().unwrap();
    assert_eq!(store.sandbox(&s.id).unwrap().unwrap().env, s.env);
    // A sealed env moved onto another sandbox's row does not open there.
    let other = sandbox();
    store.insert_sandbox(&other).unwrap();
    b.exec(
        "UPDATE sandboxes SET env=$2 WHERE id=$1",
        &[other.id.as_str(), &stored[0]],
    );
    assert_eq!(
        store.sandbox(&other.id).unwrap_err().kind(),
        StoreErrorKind::Corrupt
    );
}

#[test]
fn old_plain_env_rows_are_sealed_on_open_and_no_file_holds_a_secret() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let mut s = sandbox();
    s.env.insert("API_KEY".into(), "sk-live-hunter2".into());
    let mut old = sandbox();
    old.env.insert("OLD".into(), "plain-secret-7".into());
    {
        let store = sqlite(&path);
        store.insert_sandbox(&s).unwrap();
        store.insert_sandbox(&old).unwrap();
        // As an older torpor wrote it: plain JSON.
        store.raw(|c| {
            c.execute(
                "UPDATE sandboxes SET env=?2 WHERE id=?1",
                params![old.id.as_str(), r#"{"OLD":"plain-secret-7"}"#],
            )
        });
    }
    let store = sqlite(&path);
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

fn network_policies_are_set_replaced_and_read(b: &dyn Backend) {
    let store = b.open().unwrap();
    let s = sandbox();
    store.insert_sandbox(&s).unwrap();
    assert!(store.network(&s.id).unwrap().is_none());
    store.set_network(&s.id, &NetworkPolicy::full()).unwrap();
    assert_eq!(store.network(&s.id).unwrap(), Some(NetworkPolicy::full()));
    store.set_network(&s.id, &NetworkPolicy::none()).unwrap();
    assert_eq!(store.network(&s.id).unwrap(), Some(NetworkPolicy::none()));
    // A row this build cannot read is reported as corrupt, not taken for "no network".
    b.exec(
        "UPDATE sandbox_network SET policy='{' WHERE id=$1",
        &[s.id.as_str()],
    );
    assert_eq!(
        store.network(&s.id).unwrap_err().kind(),
        StoreErrorKind::Corrupt
    );
}

fn tenants_tokens_and_holdings(b: &dyn Backend) {
    let store = b.open().unwrap();
    let a = TenantRecord {
        id: tenant("team-a"),
        created_at: 5,
        quotas: Quotas {
            max_sandboxes: Some(3),
            ..Quotas::default()
        },
    };
    assert!(store.insert_tenant(&a, "hash-a").unwrap());
    assert!(!store.insert_tenant(&a, "hash-other").unwrap());
    let b = TenantRecord {
        id: tenant("team-b"),
        created_at: 6,
        quotas: Quotas::default(),
    };
    assert!(
        !store.insert_tenant(&b, "hash-a").unwrap(),
        "two tenants never share a token"
    );
    assert!(store.tenant(&b.id).unwrap().is_none());
    assert!(store.insert_tenant(&b, "hash-b").unwrap());
    assert_eq!(
        store.tenant_by_token_hash("hash-a").unwrap(),
        Some(a.id.clone())
    );
    assert_eq!(store.tenant_by_token_hash("nope").unwrap(), None);
    assert_eq!(store.tenant(&a.id).unwrap(), Some(a.clone()));
    assert_eq!(store.tenants().unwrap(), vec![a.clone(), b.clone()]);

    let mut running = sandbox();
    running.tenant = a.id.clone();
    running.state = SandboxState::Running;
    running.limits.memory_mib = 512;
    running.limits.cpus = 1.5;
    store.insert_sandbox(&running).unwrap();
    let mut parked = sandbox();
    parked.tenant = a.id.clone();
    parked.state = SandboxState::Parked;
    store.insert_sandbox(&parked).unwrap();
    assert_eq!(
        store.usage(&a.id).unwrap(),
        Usage {
            sandboxes: 2,
            resident: 1,
            resident_memory_mib: 512,
            resident_millicpus: 1500,
        }
    );
    assert_eq!(store.usage(&b.id).unwrap(), Usage::default());

    assert!(store.delete_tenant(&a.id).unwrap());
    assert!(!store.delete_tenant(&a.id).unwrap());
    assert!(store.tenant(&a.id).unwrap().is_none());
    assert_eq!(store.tenant_by_token_hash("hash-a").unwrap(), None);
}

fn snapshot_sizes_are_recorded_replaced_and_forgotten(b: &dyn Backend) {
    let store = b.open().unwrap();
    assert_eq!(store.snapshot_bytes("snap-1").unwrap(), 0);
    store.set_snapshot_bytes("snap-1", 10).unwrap();
    store.set_snapshot_bytes("snap-1", 1 << 40).unwrap();
    store.set_snapshot_bytes("snap-2", 7).unwrap();
    assert_eq!(store.snapshot_bytes("snap-1").unwrap(), 1 << 40);
    store.forget_snapshot_bytes("snap-1").unwrap();
    assert_eq!(store.snapshot_bytes("snap-1").unwrap(), 0);
    assert_eq!(store.snapshot_bytes("snap-2").unwrap(), 7);
}

fn pools_are_keyed_by_tenant_and_name(b: &dyn Backend) {
    let store = b.open().unwrap();
    assert!(store.insert_pool(&pool("team-a", "jobs")).unwrap());
    assert!(store.insert_pool(&pool("team-b", "jobs")).unwrap());
    assert!(!store.insert_pool(&pool("team-b", "jobs")).unwrap());
    assert!(store.insert_pool(&pool("team-b", "mail")).unwrap());
    assert_eq!(store.count_pools(&tenant("team-b")).unwrap(), 2);
    assert_eq!(store.count_pools(&tenant("team-c")).unwrap(), 0);
    let jobs = PoolName::new("jobs").unwrap();
    assert!(store.delete_pool(&tenant("team-b"), &jobs).unwrap());
    assert!(!store.delete_pool(&tenant("team-b"), &jobs).unwrap());
    assert_eq!(
        store.pools().unwrap(),
        vec![pool("team-a", "jobs"), pool("team-b", "mail")]
    );
    assert_eq!(
        store.pool_names().unwrap(),
        vec![
            (tenant("team-a"), PoolName::new("jobs").unwrap()),
            (tenant("team-b"), PoolName::new("mail").unwrap())
        ]
    );
}

fn gpu_request() -> GpuRequest {
    GpuRequest::new(PartitionMode::Mps, 1)
}

fn toggled() -> Toggled {
    Toggled {
        tool: Tool {
            in_sandbox: "/usr/bin/cuda-checkpoint".into(),
            host_mount: None,
        },
        pids: vec![3, 9],
    }
}

fn gpu_shares_requests_and_toggles_are_kept_per_sandbox(b: &dyn Backend) {
    let backend = b;
    let (a, b) = (SandboxId::generate(), SandboxId::generate());
    let sleeping = ShareRecord::Sleeping {
        ticket: SleepTicket {
            node: NodeName::new("node-1").unwrap(),
            request: gpu_request(),
            shares: Vec::new(),
            model: Some("NVIDIA H100".into()),
        },
    };
    {
        let store = backend.open().unwrap();
        store.put_gpu_share(&a, &sleeping).unwrap();
        store.put_gpu_share(&b, &sleeping).unwrap();
        store.put_gpu_request(&a, &gpu_request()).unwrap();
        store.put_gpu_toggled(&a, &toggled()).unwrap();
        // A row that no longer parses is left out of the list, not fatal.
        backend.exec(
            "INSERT INTO gpu_shares(sandbox, state, data) VALUES ('sb-bad', 'held', '{')",
            &[],
        );
    }
    let store = backend.open().unwrap();
    let shares = store.gpu_shares().unwrap();
    assert_eq!(shares.len(), 2);
    assert!(shares.iter().all(|(_, r)| *r == sleeping));
    store.delete_gpu_share(&b).unwrap();
    assert_eq!(store.gpu_shares().unwrap().len(), 1);

    assert_eq!(store.gpu_request(&a).unwrap(), Some(gpu_request()));
    assert_eq!(store.gpu_request(&b).unwrap(), None);
    let mut whole = gpu_request();
    whole.mode = PartitionMode::Whole;
    store.put_gpu_request(&a, &whole).unwrap();
    assert_eq!(store.gpu_request(&a).unwrap(), Some(whole));
    assert!(store.delete_gpu_request(&a).unwrap(), "it had one");
    assert_eq!(store.gpu_request(&a).unwrap(), None);
    assert!(!store.delete_gpu_request(&a).unwrap(), "none left");

    assert_eq!(store.gpu_toggled(&a).unwrap(), Some(toggled()));
    store.delete_gpu_toggled(&a).unwrap();
    assert_eq!(store.gpu_toggled(&a).unwrap(), None);
}

fn metric_samples_are_kept_read_by_time_and_pruned(b: &dyn Backend) {
    let store = b.open().unwrap();
    let kept = sandbox();
    store.insert_sandbox(&kept).unwrap();
    let gone = SandboxId::generate();
    let s = |v: i64| format!("{{\"v\":{v}}}");
    store
        .put_metric_samples(&[
            (kept.id.clone(), 1_000, s(1)),
            (kept.id.clone(), 2_000, s(2)),
            (kept.id.clone(), 3_000, s(3)),
            (gone.clone(), 2_000, s(9)),
        ])
        .unwrap();
    // The same millisecond again keeps the first sample; an empty batch writes nothing.
    store
        .put_metric_samples(&[(kept.id.clone(), 2_000, s(7))])
        .unwrap();
    store.put_metric_samples(&[]).unwrap();
    let all = store.metric_samples(&kept.id, 0, i64::MAX, 100).unwrap();
    assert_eq!(all, vec![(1_000, s(1)), (2_000, s(2)), (3_000, s(3))]);
    // A range, inclusive, oldest first; a limit keeps the newest.
    assert_eq!(
        store.metric_samples(&kept.id, 2_000, 3_000, 100).unwrap(),
        vec![(2_000, s(2)), (3_000, s(3))]
    );
    assert_eq!(
        store.metric_samples(&kept.id, 0, i64::MAX, 2).unwrap(),
        vec![(2_000, s(2)), (3_000, s(3))]
    );
    // Pruning drops what is too old and what belongs to no sandbox.
    assert_eq!(store.prune_metric_samples(1_500).unwrap(), 2);
    assert_eq!(
        store.metric_samples(&kept.id, 0, i64::MAX, 100).unwrap(),
        vec![(2_000, s(2)), (3_000, s(3))]
    );
    assert!(store
        .metric_samples(&gone, 0, i64::MAX, 100)
        .unwrap()
        .is_empty());
}

fn usage_intervals_add_up_per_key_and_filter_by_tenant_and_range(b: &dyn Backend) {
    let store = b.open().unwrap();
    let s = SandboxId::generate();
    let row = |start_s: i64, t: &str, measure: &str, dim: &str, value: f64| UsageInterval {
        start_s,
        tenant: tenant(t),
        sandbox: s.clone(),
        measure: measure.into(),
        dim: dim.into(),
        value,
    };
    store
        .add_usage(&[
            row(3600, "a", "cpu_seconds", "", 1.5),
            row(3600, "a", "memory_gib_hours", "running", 0.25),
            row(3600, "b", "wakes", "parked", 1.0),
            row(3600, "a", "egress_bytes", "", 0.0),
        ])
        .unwrap();
    // One batch naming a key twice adds both.
    store
        .add_usage(&[
            row(3600, "a", "cpu_seconds", "", 1.25),
            row(3600, "a", "cpu_seconds", "", 0.75),
        ])
        .unwrap();
    store
        .add_usage(&[row(7200, "a", "cpu_seconds", "", 4.0)])
        .unwrap();
    let mut a = store.usage_intervals(0, 7200, Some(&tenant("a"))).unwrap();
    a.sort_by(|x, y| x.measure.cmp(&y.measure));
    assert_eq!(
        a.len(),
        2,
        "zero deltas are not stored; 7200 is out of range"
    );
    assert_eq!(a[0].measure, "cpu_seconds");
    assert_eq!(a[0].value, 3.5);
    assert_eq!(a[0].sandbox, s);
    assert_eq!(a[1].measure, "memory_gib_hours");
    assert_eq!(store.usage_intervals(0, 1 << 40, None).unwrap().len(), 4);
    assert_eq!(
        store.usage_intervals(7200, 7201, None).unwrap()[0].value,
        4.0
    );
}

fn the_policy_reads_awake_and_due_sandboxes_and_counts_the_rest(b: &dyn Backend) {
    let store = b.open().unwrap();
    let other = TenantId::new("team-b").unwrap();
    let mut made = Vec::new();
    for (i, (state, tier, active, tenant)) in [
        (SandboxState::Running, Tier::Running, 10, TenantId::admin()),
        (SandboxState::Frozen, Tier::Frozen, 10, other.clone()),
        (
            SandboxState::Checkpointing,
            Tier::Running,
            10,
            other.clone(),
        ),
        (SandboxState::Parked, Tier::Parked, 100, TenantId::admin()), // idle long: due
        (SandboxState::Parked, Tier::Parked, 900, other.clone()),     // recent: not due
        (SandboxState::Suspended, Tier::Suspended, 1, other.clone()),
    ]
    .into_iter()
    .enumerate()
    {
        let mut s = sandbox();
        s.created_at = i as i64;
        s.state = state;
        s.tier = tier;
        s.last_active_at = active;
        s.tenant = tenant;
        store.insert_sandbox(&s).unwrap();
        made.push(s.id);
    }
    let tend: Vec<SandboxId> = store
        .sandboxes_to_tend(500)
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(
        tend,
        made[..4].to_vec(),
        "awake ones and the due parked one, oldest first"
    );
    let mut counts = store.sandbox_counts().unwrap();
    counts.sort_by_key(|(s, t, _)| (s.as_str(), t.as_str()));
    assert_eq!(
        counts,
        vec![
            (SandboxState::Checkpointing, Tier::Running, 1),
            (SandboxState::Frozen, Tier::Frozen, 1),
            (SandboxState::Parked, Tier::Parked, 2),
            (SandboxState::Running, Tier::Running, 1),
            (SandboxState::Suspended, Tier::Suspended, 1),
        ]
    );
    let theirs: Vec<SandboxId> = store
        .sandboxes_of(&other)
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(
        theirs,
        vec![
            made[1].clone(),
            made[2].clone(),
            made[4].clone(),
            made[5].clone()
        ]
    );
}

fn compare_and_set_writes_only_over_the_version_it_read(b: &dyn Backend) {
    let store = b.open().unwrap();
    let mut s = sandbox();
    store.insert_sandbox(&s).unwrap();
    let (read, v0) = store.sandbox_versioned(&s.id).unwrap().unwrap();
    assert_eq!(read, s);
    assert_eq!(v0, Version(0));

    s.state = SandboxState::Running;
    let v1 = store.compare_and_set_sandbox(&s, v0).unwrap();
    assert!(v1 > v0);
    assert_eq!(
        store.sandbox(&s.id).unwrap().unwrap().state,
        SandboxState::Running
    );

    // A second writer that read v0 loses, and writes nothing.
    let mut stale = s.clone();
    stale.state = SandboxState::Deleting;
    let err = store.compare_and_set_sandbox(&stale, v0).unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Conflict);
    assert_eq!(
        store.sandbox(&s.id).unwrap().unwrap().state,
        SandboxState::Running
    );

    // Every other write of the row moves the version on too.
    store.update_sandbox(&s).unwrap();
    assert_eq!(
        store.compare_and_set_sandbox(&s, v1).unwrap_err().kind(),
        StoreErrorKind::Conflict
    );
    // Metadata and activity writes cannot undo a state change: they leave the version be, so
    // a transition that read it before them still lands.
    let (_, v2) = store.sandbox_versioned(&s.id).unwrap().unwrap();
    store.set_sandbox_metadata(&s.id, &BTreeMap::new()).unwrap();
    store.touch_sandboxes(&[(s.id.clone(), 99)]).unwrap();
    assert_eq!(store.sandbox_versioned(&s.id).unwrap().unwrap().1, v2);
    s.state = SandboxState::Frozen;
    let v3 = store.compare_and_set_sandbox(&s, v2).unwrap();
    assert!(v3 > v2);
    s.state = SandboxState::Parked;
    assert!(store.compare_and_set_sandbox(&s, v3).unwrap() > v3);

    store.delete_sandbox(&s.id).unwrap();
    assert_eq!(
        store.compare_and_set_sandbox(&s, v3).unwrap_err().kind(),
        StoreErrorKind::NotFound
    );
}

/// The tables as torpor wrote them at schema version 1 (templates keyed by name alone), with
/// the pools and GPU tables as the pools module and GPU ledger of then created them.
const V1_SQL: &str = r#"
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta(key, value) VALUES ('schema', '1');
CREATE TABLE templates (
    name TEXT PRIMARY KEY, tenant TEXT NOT NULL, spec TEXT NOT NULL, status TEXT NOT NULL,
    rootfs TEXT NOT NULL, mounts TEXT NOT NULL, agent_dir TEXT NOT NULL,
    golden_dir TEXT NOT NULL, golden_bytes INTEGER NOT NULL, created_at INTEGER NOT NULL
);
CREATE TABLE sandboxes (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, template TEXT NOT NULL, state TEXT NOT NULL,
    tier TEXT NOT NULL, limits TEXT NOT NULL, env TEXT NOT NULL, metadata TEXT NOT NULL,
    created_at INTEGER NOT NULL, last_active_at INTEGER NOT NULL, generation INTEGER NOT NULL,
    image TEXT NOT NULL, last_error TEXT, oom_killed INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE sandbox_network (id TEXT PRIMARY KEY, policy TEXT NOT NULL);
CREATE TABLE tenants (
    id TEXT PRIMARY KEY, token_hash TEXT NOT NULL UNIQUE, created_at INTEGER NOT NULL,
    quotas TEXT NOT NULL DEFAULT '{}'
);
"#;

/// Version 2: templates keyed by (tenant, name); pools still keyed by name (as the store's
/// schema made them), and the GPU and usage tables their own modules had added.
const V2_SQL: &str = r#"
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta(key, value) VALUES ('schema', '2');
CREATE TABLE templates (
    name TEXT NOT NULL, tenant TEXT NOT NULL, spec TEXT NOT NULL, status TEXT NOT NULL,
    rootfs TEXT NOT NULL, mounts TEXT NOT NULL, agent_dir TEXT NOT NULL,
    golden_dir TEXT NOT NULL, golden_bytes INTEGER NOT NULL, created_at INTEGER NOT NULL,
    PRIMARY KEY (tenant, name)
);
CREATE TABLE sandboxes (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, template TEXT NOT NULL, state TEXT NOT NULL,
    tier TEXT NOT NULL, limits TEXT NOT NULL, env TEXT NOT NULL, metadata TEXT NOT NULL,
    created_at INTEGER NOT NULL, last_active_at INTEGER NOT NULL, generation INTEGER NOT NULL,
    image TEXT NOT NULL, last_error TEXT, oom_killed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX sandboxes_tenant ON sandboxes(tenant);
CREATE INDEX sandboxes_template ON sandboxes(template);
CREATE TABLE sandbox_network (id TEXT PRIMARY KEY, policy TEXT NOT NULL);
CREATE TABLE tenants (
    id TEXT PRIMARY KEY, token_hash TEXT NOT NULL UNIQUE, created_at INTEGER NOT NULL,
    quotas TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE snapshot_bytes (snapshot TEXT PRIMARY KEY, bytes INTEGER NOT NULL);
CREATE TABLE pools (
    name TEXT PRIMARY KEY, tenant TEXT NOT NULL, spec TEXT NOT NULL, created_at INTEGER NOT NULL
);
CREATE TABLE gpu_shares (sandbox TEXT PRIMARY KEY, state TEXT NOT NULL, data TEXT NOT NULL);
CREATE TABLE usage_intervals (
    start_s INTEGER NOT NULL, tenant TEXT NOT NULL, sandbox TEXT NOT NULL,
    measure TEXT NOT NULL, dim TEXT NOT NULL, value REAL NOT NULL,
    PRIMARY KEY (start_s, tenant, sandbox, measure, dim)
) WITHOUT ROWID;
"#;

/// A sandbox row as versions 1 and 2 wrote it (plain env, no version column).
fn insert_old_sandbox(c: &Connection, id: &SandboxId, tenant: &str) {
    c.execute(
        "INSERT INTO sandboxes (id, tenant, template, state, tier, limits, env, metadata,
         created_at, last_active_at, generation, image, last_error, oom_killed)
         VALUES (?1, ?2, 'host', 'parked', 'parked', ?3, '{\"K\":\"v\"}', '{}', 1, 2, 3,
                 '{\"kind\":\"golden\"}', NULL, 0)",
        params![
            id.as_str(),
            tenant,
            serde_json::to_string(&Limits::default()).unwrap()
        ],
    )
    .unwrap();
}

fn insert_old_template(c: &Connection, tenant: &str, name: &str) {
    let t = template(tenant, name);
    c.execute(
        "INSERT INTO templates (name, tenant, spec, status, rootfs, mounts, agent_dir,
         golden_dir, golden_bytes, created_at) VALUES (?1, ?2, ?3, '\"ready\"', '/r', '[]',
         '/a', '/g', 0, 1)",
        params![name, tenant, serde_json::to_string(&t.spec).unwrap()],
    )
    .unwrap();
}

/// What a migrated old database must answer: its rows, the new keys, compare-and-set.
fn check_migrated(path: &Path, id: &SandboxId) {
    let store = sqlite(path);
    assert_eq!(schema_version(path), "5");
    // Version 5's table is there too.
    store
        .put_metric_samples(&[(id.clone(), 1, "{}".into())])
        .unwrap();
    assert_eq!(store.metric_samples(id, 0, 2, 10).unwrap().len(), 1);
    let (s, v) = store.sandbox_versioned(id).unwrap().unwrap();
    assert_eq!(s.state, SandboxState::Parked);
    assert_eq!(s.generation, 3);
    assert_eq!(s.env, [("K".to_string(), "v".to_string())].into());
    assert_eq!(v, Version(0));
    let mut moved = s.clone();
    moved.state = SandboxState::Resuming;
    assert!(store.compare_and_set_sandbox(&moved, v).is_ok());
    // Templates per tenant.
    let app = TemplateName::new("app").unwrap();
    assert!(store.template(&tenant("a"), &app).unwrap().is_some());
    assert!(store.insert_template(&template("b", "app")).unwrap());
    // Pools per tenant, and the tables version 3 added.
    assert!(store.insert_pool(&pool("team-a", "jobs")).unwrap());
    assert!(store.insert_pool(&pool("team-b", "jobs")).unwrap());
    store.put_gpu_request(id, &gpu_request()).unwrap();
    store.put_gpu_toggled(id, &toggled()).unwrap();
    store.add_usage(&[]).unwrap();
    drop(store);
    // Opening again migrates nothing more and keeps everything.
    let store = sqlite(path);
    assert_eq!(
        store.sandbox(id).unwrap().unwrap().state,
        SandboxState::Resuming
    );
    let jobs = store
        .pools()
        .unwrap()
        .into_iter()
        .filter(|p| p.name.as_str() == "jobs")
        .count();
    assert_eq!(jobs, 2);
}

#[test]
fn a_version_1_database_is_migrated_to_the_current_schema() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let id = SandboxId::generate();
    {
        let c = Connection::open(&path).unwrap();
        c.execute_batch(V1_SQL).unwrap();
        insert_old_template(&c, "a", "app");
        insert_old_sandbox(&c, &id, "a");
    }
    check_migrated(&path, &id);
}

#[test]
fn a_version_2_database_is_migrated_with_its_pools_gpu_shares_and_usage() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let id = SandboxId::generate();
    {
        let c = Connection::open(&path).unwrap();
        c.execute_batch(V2_SQL).unwrap();
        insert_old_template(&c, "a", "app");
        insert_old_sandbox(&c, &id, "a");
        c.execute(
            "INSERT INTO pools (name, tenant, spec, created_at) VALUES ('old', 'team-a', '{}', 1)",
            [],
        )
        .unwrap();
        c.execute(
            "INSERT INTO gpu_shares (sandbox, state, data) VALUES (?1, 'sleeping', ?2)",
            params![
                id.as_str(),
                r#"{"state":"sleeping","ticket":{"node":"n1","request":{"mode":"whole"},"shares":[],"model":null}}"#
            ],
        )
        .unwrap();
        c.execute(
            "INSERT INTO usage_intervals VALUES (3600, 'a', ?1, 'cpu_seconds', '', 2.5)",
            params![id.as_str()],
        )
        .unwrap();
    }
    check_migrated(&path, &id);
    let store = sqlite(&path);
    let pools = store.pools().unwrap();
    assert!(pools
        .iter()
        .any(|p| p.name.as_str() == "old" && p.tenant == tenant("team-a")));
    assert_eq!(store.gpu_shares().unwrap().len(), 1);
    assert_eq!(store.usage_intervals(0, 7200, None).unwrap()[0].value, 2.5);
}

#[test]
fn a_version_2_database_whose_pools_were_already_rekeyed_keeps_them() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    {
        let c = Connection::open(&path).unwrap();
        // Version 2 as it was after a torpor of then had started its pools: the pools table
        // rebuilt keyed by (tenant, name).
        let rekeyed = V2_SQL.replace(
            "CREATE TABLE pools (\n    name TEXT PRIMARY KEY, tenant TEXT NOT NULL, spec TEXT NOT NULL, created_at INTEGER NOT NULL\n);",
            "CREATE TABLE pools (tenant TEXT NOT NULL, name TEXT NOT NULL, spec TEXT NOT NULL,\n    created_at INTEGER NOT NULL, PRIMARY KEY (tenant, name));",
        );
        assert_ne!(rekeyed, V2_SQL);
        c.execute_batch(&rekeyed).unwrap();
        for t in ["team-a", "team-b"] {
            c.execute(
                "INSERT INTO pools (tenant, name, spec, created_at) VALUES (?1, 'jobs', '{}', 1)",
                params![t],
            )
            .unwrap();
        }
    }
    let store = sqlite(&path);
    assert_eq!(store.pools().unwrap().len(), 2);
    assert_eq!(schema_version(&path), "5");
}

/// Follows `sandboxes_page` from the start, `limit` at a time, until a short page.
fn all_pages(
    store: &dyn StateStore,
    tenant: Option<&TenantId>,
    state: Option<&str>,
    limit: usize,
) -> Vec<Vec<SandboxId>> {
    let mut pages = Vec::new();
    let mut after: Option<SandboxCursor> = None;
    loop {
        let page = store
            .sandboxes_page(tenant, state, after.as_ref(), limit)
            .unwrap();
        assert!(page.len() <= limit, "a page holds at most its limit");
        after = page.last().map(SandboxCursor::of);
        let short = page.len() < limit;
        pages.push(page.into_iter().map(|s| s.id).collect());
        if short {
            return pages;
        }
        assert!(pages.len() < 100, "paging does not end: {pages:?}");
    }
}

fn sandboxes_are_read_in_keyset_pages(b: &dyn Backend) {
    let store = b.open().unwrap();
    let other = tenant("team-b");
    // Seven sandboxes, two by two created in the same millisecond (the id breaks the tie),
    // alternating tenants; the third and sixth parked.
    let mut made = Vec::new();
    for i in 0..7i64 {
        let mut s = sandbox();
        s.created_at = 1_000 + i / 2;
        s.tenant = if i % 2 == 0 {
            TenantId::admin()
        } else {
            other.clone()
        };
        if i % 3 == 2 {
            s.state = SandboxState::Parked;
            s.tier = Tier::Parked;
        }
        store.insert_sandbox(&s).unwrap();
        made.push(s);
    }
    made.sort_by_key(SandboxCursor::of);
    let ids = |f: &dyn Fn(&SandboxRecord) -> bool| -> Vec<SandboxId> {
        made.iter().filter(|s| f(s)).map(|s| s.id.clone()).collect()
    };

    // Every sandbox once, in creation order, whatever the page size.
    for limit in [1, 2, 3, 7, 50] {
        let pages = all_pages(&*store, None, None, limit);
        assert_eq!(pages.concat(), ids(&|_| true), "limit {limit}: {pages:?}");
        assert!(pages[..pages.len() - 1].iter().all(|p| p.len() == limit));
    }
    assert_eq!(
        store.sandboxes_page(None, None, None, 7).unwrap().len(),
        7,
        "a page of exactly what there is"
    );
    assert!(store
        .sandboxes_page(None, None, None, 0)
        .unwrap()
        .is_empty());
    // One tenant's pages hold its own only.
    let pages = all_pages(&*store, Some(&other), None, 2);
    assert_eq!(pages.concat(), ids(&|s| s.tenant == other));
    assert_eq!(
        all_pages(&*store, Some(&TenantId::admin()), None, 2).concat(),
        ids(&|s| s.tenant == TenantId::admin())
    );
    assert!(store
        .sandboxes_page(Some(&tenant("nobody")), None, None, 10)
        .unwrap()
        .is_empty());
    // A state (or tier) narrows the pages, not their order.
    let parked = ids(&|s| s.state == SandboxState::Parked);
    assert_eq!(parked.len(), 2);
    assert_eq!(all_pages(&*store, None, Some("parked"), 1).concat(), parked);
    assert_eq!(
        all_pages(&*store, Some(&other), Some("parked"), 1).concat(),
        ids(&|s| s.state == SandboxState::Parked && s.tenant == other)
    );
    assert_eq!(
        all_pages(&*store, None, Some("creating"), 2).concat(),
        ids(&|s| s.state == SandboxState::Creating)
    );
    // A cursor past the end, or of a deleted sandbox, still pages on from where it points.
    let last = SandboxCursor::of(made.last().unwrap());
    assert!(store
        .sandboxes_page(None, None, Some(&last), 10)
        .unwrap()
        .is_empty());
    let third = SandboxCursor::of(&made[2]);
    store.delete_sandbox(&made[2].id).unwrap();
    let rest: Vec<SandboxId> = store
        .sandboxes_page(None, None, Some(&third), 10)
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(rest, ids(&|_| true)[3..].to_vec());
}

#[test]
fn sqlite_pages_are_range_scans_of_an_index() {
    let b = Sqlite::new();
    drop(b.open().unwrap());
    let c = Connection::open(&b.path).unwrap();
    let plan = |sql: &str, args: &[&dyn rusqlite::ToSql]| -> String {
        let mut st = c.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        let rows = st.query_map(args, |r| r.get::<_, String>(3)).unwrap();
        rows.map(Result::unwrap).collect::<Vec<_>>().join("; ")
    };
    let all = plan(super::sqlite::PAGE, &[&0i64, &"", &None::<String>, &10i64]);
    assert!(
        all.contains("USING INDEX sandboxes_created") && !all.contains("TEMP B-TREE"),
        "{all}"
    );
    let one = plan(
        super::sqlite::PAGE_OF_TENANT,
        &[&0i64, &"", &None::<String>, &10i64, &"team-b"],
    );
    assert!(
        one.contains("USING INDEX sandboxes_tenant_created") && !one.contains("TEMP B-TREE"),
        "{one}"
    );
}

fn a_newer_schema_is_refused_as_unavailable(b: &dyn Backend) {
    drop(b.open().unwrap());
    b.exec("UPDATE meta SET value='99' WHERE key='schema'", &[]);
    let err = b.open().err().unwrap();
    assert!(
        matches!(
            err,
            StoreError::NewerSchema { found: 99, .. } | StoreError::NewerSchemaAt { found: 99, .. }
        ),
        "{err:?}"
    );
    assert_eq!(err.kind(), StoreErrorKind::Unavailable);
}

#[test]
fn gpu_state_files_of_an_older_torpor_move_into_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path();
    let requests = data.join(gpu_files::REQUESTS_DIR);
    let toggles = data.join(gpu_files::TOGGLED_DIR);
    let (a, b, kept) = (
        SandboxId::generate(),
        SandboxId::generate(),
        SandboxId::generate(),
    );
    // `kept` already has a newer request in the store: its file does not overwrite it.
    let mut newer = gpu_request();
    newer.mode = PartitionMode::Whole;
    {
        let store = sqlite(&data.join("torpor.db"));
        store.put_gpu_request(&kept, &newer).unwrap();
    }
    std::fs::create_dir_all(&requests).unwrap();
    std::fs::create_dir_all(&toggles).unwrap();
    let write =
        |dir: &Path, name: String, value: &[u8]| std::fs::write(dir.join(name), value).unwrap();
    let request_json = serde_json::to_vec(&gpu_request()).unwrap();
    write(&requests, format!("{a}.json"), &request_json);
    write(&requests, format!("{kept}.json"), &request_json);
    write(&requests, format!("{b}.json.tmp"), b"{\"half");
    write(&requests, format!("{b}.json"), b"not json");
    write(
        &toggles,
        format!("{a}.json"),
        &serde_json::to_vec(&toggled()).unwrap(),
    );

    let store = sqlite(&data.join("torpor.db"));
    assert_eq!(store.gpu_request(&a).unwrap(), Some(gpu_request()));
    assert_eq!(store.gpu_request(&kept).unwrap(), Some(newer));
    assert_eq!(store.gpu_request(&b).unwrap(), None);
    assert_eq!(store.gpu_toggled(&a).unwrap(), Some(toggled()));
    let left: Vec<String> = std::fs::read_dir(&requests)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        left,
        vec![format!("{b}.json")],
        "migrated and half-written files are removed; the unreadable one stays"
    );
    assert!(!toggles.exists(), "an emptied directory is removed");
}

#[test]
fn one_file_opened_twice_in_a_process_is_one_store() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("torpor.db");
    let a = Store::open(&path).unwrap();
    let b = Store::open(&dir.path().join(".").join("torpor.db")).unwrap();
    assert!(Arc::ptr_eq(&a.0, &b.0));
    let other = Store::open(&dir.path().join("other.db")).unwrap();
    assert!(!Arc::ptr_eq(&a.0, &other.0));
    let s = sandbox();
    a.insert_sandbox(&s).unwrap();
    assert_eq!(b.sandbox(&s.id).unwrap(), Some(s));
    // Once every handle is gone the file is opened afresh.
    drop((a, b));
    let c = Store::open(&path).unwrap();
    assert_eq!(c.sandboxes().unwrap().len(), 1);
}

// --- PostgreSQL: several controllers on one database ---

/// The store's sessions of `db` (application name `torpor`) waiting on a lock.
fn waiting_on_a_lock(admin: &Admin, db: &str) -> Vec<String> {
    admin.texts(
        "SELECT pid::text FROM pg_stat_activity
         WHERE datname=$1 AND application_name='torpor' AND wait_event_type='Lock'",
        &[db],
    )
}

/// Waits until `n` of the store's sessions wait on a lock (each test call below blocks on a
/// lock the test holds; this is the moment they all do).
fn wait_for_waiters(admin: &Admin, db: &str, n: usize) -> Vec<String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let waiting = waiting_on_a_lock(admin, db);
        if waiting.len() >= n {
            return waiting;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {n} store calls ever waited on the test's lock",
            waiting.len()
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[test]
fn controllers_starting_together_on_a_new_database_all_migrate() {
    let Some(pg) = Postgres::new() else { return };
    const CONTROLLERS: usize = 6;
    let start = Arc::new(Barrier::new(CONTROLLERS));
    let (url, key) = (pg.url(), pg.key());
    // The key exists before they start, as the file every controller is given does.
    crate::secrets::EnvSeal::load_or_create(&key).unwrap();
    let threads: Vec<_> = (0..CONTROLLERS)
        .map(|_| {
            let (start, url, key) = (start.clone(), url.clone(), key.clone());
            std::thread::spawn(move || {
                start.wait();
                let store = PostgresStore::connect(&url, &key)?;
                let s = sandbox();
                store.insert_sandbox(&s)?;
                Ok::<_, StoreError>((store, s))
            })
        })
        .collect();
    let opened: Vec<(PostgresStore, SandboxRecord)> = threads
        .into_iter()
        .map(|t| {
            t.join()
                .unwrap()
                .expect("every controller migrates and writes")
        })
        .collect();
    assert_eq!(
        pg.texts("SELECT value FROM meta WHERE key='schema'", &[]),
        vec![pg_schema::SCHEMA_VERSION.to_string()]
    );
    // Each controller reads what every other wrote.
    for (store, _) in &opened {
        let mut ids: Vec<SandboxId> = store
            .sandboxes()
            .unwrap()
            .into_iter()
            .map(|s| s.id)
            .collect();
        ids.sort();
        let mut want: Vec<SandboxId> = opened.iter().map(|(_, s)| s.id.clone()).collect();
        want.sort();
        assert_eq!(ids, want);
    }
    // A controller started later finds the schema current and changes nothing.
    drop(pg.connect());
    assert_eq!(
        pg.texts("SELECT count(*)::text FROM sandboxes", &[]),
        vec![CONTROLLERS.to_string()]
    );
}

#[test]
fn the_holding_controller_is_written_with_the_state_and_read_back() {
    let Some(pg) = Postgres::new() else { return };
    let store = pg.connect();
    let mut s = sandbox();
    s.controller = Some("c1".into());
    store.insert_sandbox(&s).unwrap();
    let read = store.sandbox(&s.id).unwrap().unwrap();
    assert_eq!(read.controller.as_deref(), Some("c1"));
    assert_eq!(read.version, Version(0));
    let mut next = read.clone();
    next.state = SandboxState::Parked;
    next.controller = None;
    let v = store.compare_and_set_sandbox(&next, read.version).unwrap();
    let again = store.sandbox(&s.id).unwrap().unwrap();
    assert_eq!((again.controller, again.version), (None, v));
}

#[test]
fn the_worker_a_sandbox_runs_on_is_kept_without_a_version_bump() {
    let Some(pg) = Postgres::new() else { return };
    let store = pg.connect();
    let (s, other) = (sandbox(), sandbox());
    store.insert_sandbox(&s).unwrap();
    store.insert_sandbox(&other).unwrap();
    assert!(store.sandbox_nodes().unwrap().is_empty());
    store.set_sandbox_node(&s.id, Some("w2")).unwrap();
    assert_eq!(
        store.sandbox_nodes().unwrap(),
        [(s.id.clone(), "w2".to_string())].into()
    );
    // Not a state change: a compare-and-set over the version read before still lands.
    let read = store.sandbox(&s.id).unwrap().unwrap();
    assert_eq!(read.version, Version(0));
    store.set_sandbox_node(&other.id, Some("w1")).unwrap();
    store.set_sandbox_node(&s.id, None).unwrap();
    assert_eq!(
        store.sandbox_nodes().unwrap(),
        [(other.id.clone(), "w1".to_string())].into()
    );
    // SQLite (one machine) keeps none.
    let tmp = tempfile::tempdir().unwrap();
    let lite = sqlite(&tmp.path().join("t.db"));
    lite.insert_sandbox(&s).unwrap();
    lite.set_sandbox_node(&s.id, Some("w2")).unwrap();
    assert!(lite.sandbox_nodes().unwrap().is_empty());
    let read = lite.sandbox(&s.id).unwrap().unwrap();
    lite.compare_and_set_sandbox_on(&read, read.version, "w2")
        .unwrap();
    assert!(lite.sandbox_nodes().unwrap().is_empty());
}

#[test]
fn a_transition_records_the_worker_in_its_own_compare_and_set() {
    let Some(pg) = Postgres::new() else { return };
    let (c1, c2) = (pg.connect(), pg.connect());
    let s = sandbox();
    c1.insert_sandbox(&s).unwrap();
    let read = c1.sandbox(&s.id).unwrap().unwrap();
    // c2 moves it first; c1's wake over the version it read records neither state nor node.
    let mut theirs = read.clone();
    theirs.state = SandboxState::Running;
    theirs.controller = Some("c2".into());
    let v = c2
        .compare_and_set_sandbox_on(&theirs, read.version, "w2")
        .unwrap();
    let mut mine = read.clone();
    mine.state = SandboxState::Running;
    mine.controller = Some("c1".into());
    let err = c1
        .compare_and_set_sandbox_on(&mine, read.version, "w1")
        .unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Conflict);
    assert_eq!(
        c1.sandbox_nodes().unwrap(),
        [(s.id.clone(), "w2".to_string())].into()
    );
    // A plain compare-and-set keeps the node; one with a node replaces it.
    let mut parked = theirs.clone();
    parked.state = SandboxState::Parked;
    let v = c2.compare_and_set_sandbox(&parked, v).unwrap();
    assert_eq!(c1.sandbox_nodes().unwrap()[&s.id], "w2");
    let mut woken = parked.clone();
    woken.state = SandboxState::Running;
    c1.compare_and_set_sandbox_on(&woken, v, "w1").unwrap();
    let back = c2.sandbox(&s.id).unwrap().unwrap();
    assert_eq!(
        (back.state, back.version),
        (SandboxState::Running, Version(v.0 + 1))
    );
    assert_eq!(c2.sandbox_nodes().unwrap()[&s.id], "w1");
}

#[test]
fn controllers_are_live_until_their_heartbeat_expires_and_leases_pass_on_expiry() {
    let Some(pg) = Postgres::new() else { return };
    let (a, b) = (pg.connect(), pg.connect());
    let long = Duration::from_secs(60);
    let c1 = LiveController {
        name: "c1".into(),
        api_addr: "10.0.0.1:7077".into(),
        peer_addr: Some("10.0.0.1:7444".into()),
        call_rate: Some(2.5),
    };
    // A controller built before the peer listener (and the call rate) names none.
    let c2 = LiveController {
        name: "c2".into(),
        api_addr: "10.0.0.2:7077".into(),
        peer_addr: None,
        call_rate: None,
    };
    assert!(a.claim_controller(&c1, "run-a", true, long).unwrap());
    assert!(b
        .claim_controller(&c2, "run-c2", true, Duration::from_millis(200))
        .unwrap());
    let names = |s: &PostgresStore| -> Vec<String> {
        s.live_controllers()
            .unwrap()
            .into_iter()
            .map(|c| c.name)
            .collect()
    };
    assert_eq!(a.live_controllers().unwrap(), vec![c1.clone(), c2]);
    // Each renewal says the rate anew.
    let busier = LiveController {
        call_rate: Some(40.0),
        ..c1.clone()
    };
    assert!(a.claim_controller(&busier, "run-a", false, long).unwrap());
    assert_eq!(b.live_controllers().unwrap()[0].call_rate, Some(40.0));
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(names(&a), vec!["c1"], "c2 stopped renewing");

    // One name, one run: another process given c1's name is refused while run-a lives, at
    // other addresses even at its start; at the same addresses at its start it is run-a
    // restarted, and takes the row (run-a is then refused).
    let elsewhere = LiveController {
        api_addr: "10.0.0.9:7077".into(),
        peer_addr: Some("10.0.0.9:7444".into()),
        ..c1.clone()
    };
    assert!(!b.claim_controller(&elsewhere, "run-b", true, long).unwrap());
    assert!(!b.claim_controller(&c1, "run-b", false, long).unwrap());
    assert!(a.claim_controller(&c1, "run-a", false, long).unwrap());
    assert!(b.claim_controller(&c1, "run-b", true, long).unwrap());
    assert!(!a.claim_controller(&c1, "run-a", false, long).unwrap());
    // A stop removes the row only for the run that holds it.
    a.forget_controller("c1", "run-a").unwrap();
    assert_eq!(names(&b), vec!["c1"]);
    // Once the row expires, any run takes the name.
    assert!(b
        .claim_controller(&c1, "run-b", false, Duration::from_millis(100))
        .unwrap());
    std::thread::sleep(Duration::from_millis(300));
    assert!(a
        .claim_controller(&elsewhere, "run-c", false, long)
        .unwrap());
    b.forget_controller("c1", "run-c").unwrap();
    assert!(names(&b).is_empty());

    // One holder at a time; renewals keep it; expiry or release passes it on.
    assert!(a
        .try_lease("pools", "c1", Duration::from_millis(300))
        .unwrap());
    assert!(!b.try_lease("pools", "c2", long).unwrap());
    assert!(a
        .try_lease("pools", "c1", Duration::from_millis(300))
        .unwrap());
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        b.try_lease("pools", "c2", long).unwrap(),
        "expired: taken over"
    );
    assert!(!a.try_lease("pools", "c1", long).unwrap());
    a.release_lease("pools", "c1").unwrap(); // not c1's: changes nothing
    assert!(!a.try_lease("pools", "c1", long).unwrap());
    b.release_lease("pools", "c2").unwrap();
    assert!(a.try_lease("pools", "c1", long).unwrap());

    // A holder passes its lease on (a pool handed over with its agents): only its own, only
    // while it holds it; the new holder renews it, the old one no longer can.
    assert!(
        !b.pass_lease("pools", "c2", "c3", long).unwrap(),
        "not c2's"
    );
    assert!(a.pass_lease("pools", "c1", "c2", long).unwrap());
    assert_eq!(
        a.live_leases("pools").unwrap(),
        vec![("pools".to_string(), "c2".to_string())]
    );
    assert!(!a.try_lease("pools", "c1", long).unwrap());
    assert!(b.try_lease("pools", "c2", long).unwrap());
    assert!(!a.pass_lease("pools", "c1", "c3", long).unwrap());
    assert!(b
        .try_lease("pools", "c2", Duration::from_millis(100))
        .unwrap());
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !b.pass_lease("pools", "c2", "c1", long).unwrap(),
        "an expired lease is nobody's to pass"
    );
    assert!(a.live_leases("pools").unwrap().is_empty());
}

#[test]
fn rate_usage_reports_are_read_by_the_other_controllers_once_each_and_pruned() {
    let Some(pg) = Postgres::new() else { return };
    let (a, b) = (pg.connect(), pg.connect());
    let use_ = |t: &str, c: &str, n| RateUsage {
        tenant: t.into(),
        class: c.into(),
        count: n,
    };
    a.put_rate_usage("c1", &[use_("team", "exec", 3), use_("team", "files", 0)])
        .unwrap();
    a.put_rate_usage("c1", &[use_("other", "lifecycle", 1)])
        .unwrap();
    b.put_rate_usage("c2", &[use_("team", "exec", 5)]).unwrap();
    a.put_rate_usage("c1", &[]).unwrap();
    let window = Duration::from_secs(5);
    let seen_by_c2 = b.rate_usage_of_others("c2", window).unwrap();
    let usage: Vec<RateUsage> = seen_by_c2.iter().map(|r| r.usage.clone()).collect();
    assert_eq!(
        usage,
        vec![use_("team", "exec", 3), use_("other", "lifecycle", 1)],
        "c1's reports in order, zero counts not sent, c2's own left out"
    );
    assert!(seen_by_c2[0].id < seen_by_c2[1].id);
    let seen_by_c1 = a.rate_usage_of_others("c1", window).unwrap();
    assert_eq!(seen_by_c1.len(), 1);
    assert_eq!(seen_by_c1[0].usage, use_("team", "exec", 5));

    std::thread::sleep(Duration::from_millis(300));
    assert!(b
        .rate_usage_of_others("c2", Duration::from_millis(200))
        .unwrap()
        .is_empty());
    assert_eq!(a.prune_rate_usage(Duration::from_millis(200)).unwrap(), 3);
    assert!(b.rate_usage_of_others("c2", window).unwrap().is_empty());
}

#[test]
fn fence_orders_are_shared_relayed_and_removed_once_done() {
    let Some(pg) = Postgres::new() else { return };
    // c2 orders; c1 (another connection, as another controller) relays and confirms.
    let (c1, c2) = (pg.connect(), pg.connect());
    let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    c2.put_fence_orders("w1", "c2", &ids(&["sb1-g1", "sb2-g1"]))
        .unwrap();
    c2.put_fence_orders("w2", "c2", &ids(&["sb3-g2"])).unwrap();
    let order = |w: &str, c: &str, relayed| FenceOrderRecord {
        worker: w.into(),
        container: c.into(),
        owner: "c2".into(),
        relayed,
    };
    assert_eq!(
        c1.fence_orders().unwrap(),
        vec![
            order("w1", "sb1-g1", false),
            order("w1", "sb2-g1", false),
            order("w2", "sb3-g2", false)
        ]
    );
    // Marks touch only the worker named.
    c1.fence_orders_relayed("w1", &ids(&["sb1-g1", "sb3-g2"]))
        .unwrap();
    c1.fence_orders_done("w1", &ids(&["sb2-g1", "sb3-g2"]))
        .unwrap();
    assert_eq!(
        c2.fence_orders().unwrap(),
        vec![order("w1", "sb1-g1", true), order("w2", "sb3-g2", false)]
    );
    // Ordered again (the worker was lost again): open and not relayed.
    c2.put_fence_orders("w1", "c2", &ids(&["sb1-g1"])).unwrap();
    assert_eq!(c1.fence_orders().unwrap()[0], order("w1", "sb1-g1", false));
    c1.fence_orders_done("w1", &ids(&["sb1-g1"])).unwrap();
    c1.fence_orders_done("w2", &ids(&["sb3-g2"])).unwrap();
    assert!(c2.fence_orders().unwrap().is_empty());
    // A store one process uses has no other controller to relay through.
    let tmp = tempfile::tempdir().unwrap();
    let lite = sqlite(&tmp.path().join("t.db"));
    lite.put_fence_orders("w1", "c2", &ids(&["sb1-g1"]))
        .unwrap();
    assert!(lite.fence_orders().unwrap().is_empty());
}

#[test]
fn gpu_holdings_keep_each_workers_newest_report_per_tenant() {
    let Some(pg) = Postgres::new() else { return };
    let (c1, c2) = (pg.connect(), pg.connect());
    let held = |memory_mib, compute| torpor_gpu::quota::Amount {
        memory_mib,
        compute,
    };
    c1.put_gpu_holding("t1", "ga", 10, held(23034, 700))
        .unwrap();
    c1.put_gpu_holding("t1", "gb", 4, held(0, 0)).unwrap();
    c1.put_gpu_holding("t2", "ga", 10, held(100, 50)).unwrap();
    // Another controller reads them; an older report of a worker replaces nothing.
    c2.put_gpu_holding("t1", "ga", 9, held(0, 0)).unwrap();
    assert_eq!(
        c2.gpu_holdings("t1").unwrap(),
        vec![
            ("ga".to_string(), 10, held(23034, 700)),
            ("gb".to_string(), 4, held(0, 0))
        ]
    );
    // A newer one does.
    c2.put_gpu_holding("t1", "ga", 11, held(0, 0)).unwrap();
    assert_eq!(
        c1.gpu_holdings("t1").unwrap()[0],
        ("ga".to_string(), 11, held(0, 0))
    );
    assert_eq!(
        c1.gpu_holdings("t2").unwrap(),
        vec![("ga".to_string(), 10, held(100, 50))]
    );
    assert!(c1.gpu_holdings("t3").unwrap().is_empty());
    // A store one process uses keeps none: its one controller saw every start.
    let tmp = tempfile::tempdir().unwrap();
    let lite = sqlite(&tmp.path().join("t.db"));
    lite.put_gpu_holding("t1", "ga", 1, held(1, 1)).unwrap();
    assert!(lite.gpu_holdings("t1").unwrap().is_empty());
}

#[test]
fn tickets_to_drop_are_kept_for_every_controller_until_done() {
    let Some(pg) = Postgres::new() else { return };
    let (c1, c2) = (pg.connect(), pg.connect());
    c1.put_ticket_forget("ga", "sb-1").unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    c1.put_ticket_forget("gb", "sb-1").unwrap();
    // Kept again: the first time stays.
    c2.put_ticket_forget("ga", "sb-1").unwrap();
    let kept = c2.ticket_forgets(10).unwrap();
    let names: Vec<_> = kept
        .iter()
        .map(|(w, s, _)| (w.as_str(), s.as_str()))
        .collect();
    assert_eq!(names, [("ga", "sb-1"), ("gb", "sb-1")], "oldest first");
    assert!(kept[0].2 >= kept[1].2, "ages: {kept:?}");
    assert_eq!(c1.ticket_forgets(1).unwrap().len(), 1, "at most the limit");
    c2.ticket_forget_done("ga", "sb-1").unwrap();
    let left: Vec<_> = c1
        .ticket_forgets(10)
        .unwrap()
        .into_iter()
        .map(|(w, s, _)| (w, s))
        .collect();
    assert_eq!(left, [("gb".to_string(), "sb-1".to_string())]);
    // A store one process uses keeps none.
    let tmp = tempfile::tempdir().unwrap();
    let lite = sqlite(&tmp.path().join("t.db"));
    lite.put_ticket_forget("ga", "sb-1").unwrap();
    assert!(lite.ticket_forgets(10).unwrap().is_empty());
}

#[test]
fn a_drain_through_one_controller_is_read_by_every_other_until_lifted() {
    let Some(pg) = Postgres::new() else { return };
    let (c1, c2) = (pg.connect(), pg.connect());
    assert!(c2.worker_drains().unwrap().is_empty());
    c1.set_worker_drain("wb", true).unwrap();
    c1.set_worker_drain("wa", true).unwrap();
    // Drained again: still one row.
    c2.set_worker_drain("wa", true).unwrap();
    assert_eq!(c2.worker_drains().unwrap(), ["wa", "wb"]);
    c2.set_worker_drain("wa", false).unwrap();
    // Lifting a drain that is not there changes nothing.
    c1.set_worker_drain("wc", false).unwrap();
    assert_eq!(c1.worker_drains().unwrap(), ["wb"]);
    // A store one process uses keeps none.
    let tmp = tempfile::tempdir().unwrap();
    let lite = sqlite(&tmp.path().join("t.db"));
    lite.set_worker_drain("wa", true).unwrap();
    assert!(lite.worker_drains().unwrap().is_empty());
}

#[test]
fn a_store_lock_is_held_by_one_controller_at_a_time() {
    let Some(pg) = Postgres::new() else { return };
    let (a, b) = (Arc::new(pg.connect()), Arc::new(pg.connect()));
    let held = a.lock("quota:t1").unwrap();
    let inside = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (b2, inside2) = (b.clone(), inside.clone());
    let waiter = std::thread::spawn(move || {
        let _g = b2.lock("quota:t1").unwrap();
        inside2.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    // Another key is free meanwhile.
    drop(b.lock("quota:t2").unwrap());
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !inside.load(std::sync::atomic::Ordering::SeqCst),
        "b waits while a holds the lock"
    );
    drop(held);
    waiter.join().unwrap();
    assert!(inside.load(std::sync::atomic::Ordering::SeqCst));
}

#[test]
fn two_controllers_compare_and_set_one_sandbox_at_the_same_moment_and_exactly_one_wins() {
    let Some(pg) = Postgres::new() else { return };
    let (a, b) = (Arc::new(pg.connect()), Arc::new(pg.connect()));
    let s = sandbox();
    a.insert_sandbox(&s).unwrap();
    let (_, v0) = b.sandbox_versioned(&s.id).unwrap().unwrap();

    // The test holds the row's lock, so both controllers' writes are in flight at once and
    // queue on it; then it lets them go.
    let holder = Admin::connect(&pg.url());
    holder.batch("BEGIN");
    holder.exec(
        "SELECT 1 FROM sandboxes WHERE id=$1 FOR UPDATE",
        &[s.id.as_str()],
    );
    let race = |store: Arc<PostgresStore>, state: SandboxState| {
        let mut mine = s.clone();
        mine.state = state;
        std::thread::spawn(move || store.compare_and_set_sandbox(&mine, v0).map(|v| (v, state)))
    };
    let ta = race(a.clone(), SandboxState::Running);
    let tb = race(b.clone(), SandboxState::Deleting);
    wait_for_waiters(&pg.admin, &pg.db, 2);
    holder.batch("COMMIT");
    let results = [ta.join().unwrap(), tb.join().unwrap()];

    let won: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    assert_eq!(won.len(), 1, "exactly one write lands: {results:?}");
    let lost = results.iter().find_map(|r| r.as_ref().err()).unwrap();
    assert_eq!(lost.kind(), StoreErrorKind::Conflict, "{lost:?}");
    let (v, state) = *won[0];
    let (read, version) = a.sandbox_versioned(&s.id).unwrap().unwrap();
    assert_eq!(read.state, state, "the row holds the winner's write");
    assert_eq!(version, v);
    assert_eq!(version, Version(v0.0 + 1), "one transition, not two");
}

#[test]
fn many_controllers_racing_on_one_sandbox_make_one_transition_per_version() {
    let Some(pg) = Postgres::new() else { return };
    const CONTROLLERS: usize = 4;
    const ROUNDS: u64 = 25;
    let stores: Vec<Arc<PostgresStore>> =
        (0..CONTROLLERS).map(|_| Arc::new(pg.connect())).collect();
    let s = sandbox();
    stores[0].insert_sandbox(&s).unwrap();
    for round in 0..ROUNDS {
        let (_, v) = stores[0].sandbox_versioned(&s.id).unwrap().unwrap();
        assert_eq!(v, Version(round));
        let start = Arc::new(Barrier::new(CONTROLLERS));
        let threads: Vec<_> = stores
            .iter()
            .enumerate()
            .map(|(i, store)| {
                let (store, start, mut mine) = (store.clone(), start.clone(), s.clone());
                mine.last_error = Some(format!("controller {i}"));
                std::thread::spawn(move || {
                    start.wait();
                    store.compare_and_set_sandbox(&mine, v)
                })
            })
            .collect();
        let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert_eq!(
            results.iter().filter(|r| r.is_ok()).count(),
            1,
            "{results:?}"
        );
        assert!(results
            .iter()
            .filter_map(|r| r.as_ref().err())
            .all(|e| e.kind() == StoreErrorKind::Conflict));
    }
    let (_, v) = stores[1].sandbox_versioned(&s.id).unwrap().unwrap();
    assert_eq!(v, Version(ROUNDS));
}

#[test]
fn a_torn_connection_is_reported_unavailable_and_the_next_call_reconnects() {
    let Some(pg) = Postgres::new() else { return };
    let store = Arc::new(pg.connect());
    let s = sandbox();
    store.insert_sandbox(&s).unwrap();

    // A call in flight when the server ends its session.
    let holder = Admin::connect(&pg.url());
    holder.batch("BEGIN; LOCK TABLE sandboxes IN ACCESS EXCLUSIVE MODE");
    let reading = {
        let store = store.clone();
        std::thread::spawn(move || store.sandboxes())
    };
    let pids = wait_for_waiters(&pg.admin, &pg.db, 1);
    pg.admin.texts(
        "SELECT pg_terminate_backend($1::text::int)::text",
        &[pids[0].as_str()],
    );
    let err = reading.join().unwrap().unwrap_err();
    assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{err:?}");
    holder.batch("ROLLBACK");

    // The next call gets a new session and works.
    assert_eq!(store.sandboxes().unwrap().len(), 1);
    let mut moved = s.clone();
    moved.state = SandboxState::Running;
    store.update_sandbox(&moved).unwrap();
    assert_eq!(
        store.sandbox(&s.id).unwrap().unwrap().state,
        SandboxState::Running
    );
    let sessions = pg.texts(
        "SELECT pid::text FROM pg_stat_activity WHERE datname=$1 AND application_name='torpor'",
        &[&pg.db],
    );
    assert!(
        !sessions.contains(&pids[0]),
        "the ended session is not reused"
    );

    // Idle sessions ended under the pool: at most the first call notices, the next works.
    pg.admin.texts(
        "SELECT pg_terminate_backend(pid)::text FROM pg_stat_activity
         WHERE datname=$1 AND application_name='torpor'",
        &[&pg.db],
    );
    if let Err(e) = store.sandboxes() {
        assert_eq!(e.kind(), StoreErrorKind::Unavailable, "{e:?}");
    }
    assert_eq!(store.sandboxes().unwrap().len(), 1);
}

#[test]
fn an_unreachable_database_is_unavailable_and_its_password_is_not_in_the_error() {
    let Some(pg) = Postgres::new() else { return };
    let wrong = pg
        .url()
        .replace(pg_testing::PASSWORD, "not-the-password-42");
    let err = PostgresStore::connect(&wrong, &pg.key()).err().unwrap();
    assert_eq!(err.kind(), StoreErrorKind::Unavailable);
    let shown = format!("{err} {err:?}");
    assert!(!shown.contains("not-the-password-42"), "{shown}");
    assert!(shown.contains(&pg.db), "names the database: {shown}");
    // Nothing listens on this port.
    let port = torpor_runtime::ports::loopback_port().expect("a free loopback port");
    let err = PostgresStore::connect(
        &format!("postgres://postgres:secret-9@127.0.0.1:{port}/x"),
        &pg.key(),
    )
    .err()
    .unwrap();
    assert_eq!(err.kind(), StoreErrorKind::Unavailable);
    assert!(!format!("{err} {err:?}").contains("secret-9"));
}

#[test]
fn a_controller_with_another_env_key_is_refused_and_cannot_seal_envs_the_others_cannot_read() {
    let Some(pg) = Postgres::new() else { return };
    let first = pg.connect();
    let mut s = sandbox();
    s.env.insert("TOKEN".into(), "abc".into());
    first.insert_sandbox(&s).unwrap();
    let other_key = pg.dir.path().join("other.key");
    let err = PostgresStore::connect(&pg.url(), &other_key).err().unwrap();
    assert_eq!(err.kind(), StoreErrorKind::Unavailable, "{err:?}");
    // The right key still works, and reads the env.
    let again = pg.connect();
    assert_eq!(again.sandbox(&s.id).unwrap().unwrap().env, s.env);
}

#[test]
fn store_connect_answers_a_handle_over_postgres() {
    let Some(pg) = Postgres::new() else { return };
    let store = Store::connect(&pg.url(), &pg.key()).unwrap();
    let s = sandbox();
    store.insert_sandbox(&s).unwrap();
    assert_eq!(store.sandbox(&s.id).unwrap(), Some(s));
    assert_eq!(
        pg.texts("SELECT id FROM sandboxes", &[]),
        vec![store.sandboxes().unwrap()[0].id.to_string()]
    );
}

#[test]
fn the_postgres_store_is_opened_called_and_dropped_inside_another_runtime() {
    let Some(pg) = Postgres::new() else { return };
    // As the engine does: synchronous store calls from a task of the daemon's runtime (a
    // current-thread one, the strictest: the store must not need this thread to answer).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (url, key) = (pg.url(), pg.key());
    let id = rt.block_on(async move {
        let store = Store::connect(&url, &key).unwrap();
        let s = sandbox();
        store.insert_sandbox(&s).unwrap();
        tokio::task::yield_now().await;
        assert_eq!(store.sandbox(&s.id).unwrap(), Some(s.clone()));
        drop(store);
        s.id
    });
    assert_eq!(
        pg.texts("SELECT id FROM sandboxes", &[]),
        vec![id.to_string()]
    );
}

#[test]
fn controllers_adding_usage_to_the_same_intervals_at_once_lose_nothing() {
    let Some(pg) = Postgres::new() else { return };
    const CONTROLLERS: usize = 4;
    const BATCHES: usize = 20;
    let sandboxes: Vec<SandboxId> = (0..3).map(|_| SandboxId::generate()).collect();
    let start = Arc::new(Barrier::new(CONTROLLERS));
    let threads: Vec<_> = (0..CONTROLLERS)
        .map(|i| {
            let (store, start, mut sandboxes) = (pg.connect(), start.clone(), sandboxes.clone());
            // Each controller's batches name the same keys, in a different order.
            sandboxes.rotate_left(i % 3);
            std::thread::spawn(move || {
                start.wait();
                for _ in 0..BATCHES {
                    let rows: Vec<UsageInterval> = sandboxes
                        .iter()
                        .map(|s| UsageInterval {
                            start_s: 3600,
                            tenant: tenant("a"),
                            sandbox: s.clone(),
                            measure: "cpu_seconds".into(),
                            dim: String::new(),
                            value: 1.0,
                        })
                        .collect();
                    store.add_usage(&rows)?;
                }
                Ok::<_, StoreError>(())
            })
        })
        .collect();
    for t in threads {
        t.join()
            .unwrap()
            .expect("no batch fails (no deadlock, no lost update)");
    }
    let rows = pg.connect().usage_intervals(0, 7200, None).unwrap();
    assert_eq!(rows.len(), 3);
    for r in rows {
        assert_eq!(r.value, (CONTROLLERS * BATCHES) as f64, "{r:?}");
    }
}

/// Only the sandboxes whose metadata has the key, whatever the values hold (a value that
/// contains the key's text, quotes and colon included, does not count).
fn sandboxes_are_read_by_id_in_one_call(b: &dyn Backend) {
    let store = b.open().unwrap();
    let (mut parked, running) = (sandbox(), sandbox());
    parked.state = SandboxState::Parked;
    store.insert_sandbox(&parked).unwrap();
    store.insert_sandbox(&running).unwrap();
    let gone = SandboxId::generate();
    let mut found: Vec<(SandboxId, SandboxState)> = store
        .sandboxes_by_id(&[gone, parked.id.clone(), running.id.clone()])
        .unwrap()
        .into_iter()
        .map(|s| (s.id, s.state))
        .collect();
    found.sort_by(|a, b| a.0.cmp(&b.0));
    let mut want = vec![
        (parked.id.clone(), SandboxState::Parked),
        (running.id.clone(), SandboxState::Creating),
    ];
    want.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(found, want);
    assert!(store.sandboxes_by_id(&[]).unwrap().is_empty());
}

fn sandboxes_are_found_by_metadata_key(b: &dyn Backend) {
    let store = b.open().unwrap();
    let key = "torpor.e2b.end_at";
    let mut made = Vec::new();
    for (i, metadata) in [
        vec![(key, "100")],
        vec![("other", "x")],
        vec![("other", "\"torpor.e2b.end_at\":1")],
        vec![("a", "b"), (key, "200")],
        vec![],
    ]
    .into_iter()
    .enumerate()
    {
        let mut s = sandbox();
        s.created_at = i as i64;
        s.metadata = metadata
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        store.insert_sandbox(&s).unwrap();
        made.push(s.id);
    }
    let found: Vec<SandboxId> = store
        .sandboxes_with_metadata(key)
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(found, vec![made[0].clone(), made[3].clone()]);
    assert!(store.sandboxes_with_metadata("absent").unwrap().is_empty());
}
