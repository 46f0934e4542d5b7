//! PostgreSQL state at 10^6 sandboxes: what the cluster's state store costs when the table is
//! large, beside the same operations on a table of 1,000 sandboxes (the baseline), on one real
//! PostgreSQL server (`store::pg_testing`) in the same run.
//!
//!   cargo bench -p torpor-control --features testing --bench pg_state
//!   TORPOR_PG_ROWS=100000 cargo bench -p torpor-control --features testing --bench pg_state
//!
//! Both tables are filled through the `StateStore` API. It has no batch insert for sandboxes, so
//! the rows go in one `insert_sandbox` call at a time, from `INSERT_THREADS` threads over two
//! stores (two pools of 8 connections, as two controllers would hold); rows per second are
//! printed. The data: 1,000 tenants (plus `probe`, which holds exactly `PROBE_ROWS` sandboxes
//! in both tables), each with a template `agent`; 80% of sandboxes from the operator's template
//! `base`, 20% from their tenant's `agent`; 5% Running, 60% Parked, 35% Suspended; three env
//! values and two metadata keys each. Then `VACUUM ANALYZE` (autovacuum's steady state).
//!
//! Measured one call at a time, from one thread: `sandbox_versioned` and
//! `compare_and_set_sandbox` of random sandboxes, `usage` of `probe` (same 100 rows in both
//! tables) and of an ordinary tenant, `count_sandboxes_of_template` for `probe`'s own template
//! and for the operator's `base`, and `sandboxes()` (every row: the list the policy tick, the
//! list API and usage accounting read). Then the size of the table and its indexes, and the
//! template counts again after adding the index this bench proposes (`(template, tenant)`), in
//! the bench's own databases only.
//!
//! The server is the tests' (fsync, synchronous_commit and full_page_writes off): commit latency
//! here is lower than on a durable server; what grows with the table is what this measures.
//!
//! Prints a table and one JSON line (`{"bench":"pg_state",...}`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use torpor_control::store::pg_testing::{self, Admin};
use torpor_control::store::{
    ImageRef, Quotas, SandboxRecord, Store, TemplateRecord, TemplateStatus, TenantRecord, Version,
};
use torpor_core::{Limits, SandboxId, SandboxState, TemplateName, TenantId, Tier};

const SMALL_ROWS: usize = 1_000;
const TENANTS: usize = 1_000;
const PROBE_ROWS: usize = 100;
const INSERT_THREADS: usize = 16;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn tenant_name(i: usize) -> TenantId {
    TenantId::new(format!("t{i:04}")).unwrap()
}

fn probe() -> TenantId {
    TenantId::new("probe").unwrap()
}

fn agent() -> TemplateName {
    TemplateName::new("agent").unwrap()
}

fn base() -> TemplateName {
    TemplateName::new("base").unwrap()
}

fn template(tenant: TenantId, name: TemplateName) -> TemplateRecord {
    TemplateRecord {
        spec: serde_json::from_value(json!({"name": name.to_string(), "source": {"kind": "host"}}))
            .unwrap(),
        name,
        tenant,
        status: TemplateStatus::Ready,
        rootfs: "/var/lib/torpor/templates/x/rootfs".into(),
        mounts: Vec::new(),
        agent_dir: "/var/lib/torpor/templates/x/agent".into(),
        golden_dir: "/var/lib/torpor/templates/x/golden".into(),
        golden_bytes: 64 << 20,
        created_at: 1_764_000_000_000,
    }
}

/// The `i`th sandbox of a table (deterministic but for its random id).
fn sandbox(i: usize, rng: &mut Rng) -> SandboxRecord {
    let id = SandboxId::generate();
    let (tenant, template) = if i < PROBE_ROWS {
        (probe(), agent())
    } else if rng.below(5) == 0 {
        (tenant_name(i % TENANTS), agent())
    } else {
        (tenant_name(i % TENANTS), base())
    };
    let (state, tier, image) = match rng.below(100) {
        0..=4 => (SandboxState::Running, Tier::Running, ImageRef::Golden),
        5..=64 => (
            SandboxState::Parked,
            Tier::Parked,
            ImageRef::Local(format!("/var/lib/torpor/images/{id}/g3").into()),
        ),
        _ => (
            SandboxState::Suspended,
            Tier::Suspended,
            ImageRef::Store(format!("snap-{:016x}", rng.next())),
        ),
    };
    let env: BTreeMap<String, String> = [
        (
            "API_URL",
            "https://api.internal.example:8443/v2".to_string(),
        ),
        ("LOG_LEVEL", "info".to_string()),
        ("TOKEN", format!("{:032x}", rng.next() as u128 * 7919)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let metadata: BTreeMap<String, String> = [
        ("owner".to_string(), format!("user-{}", rng.below(50_000))),
        ("purpose".to_string(), "bench".to_string()),
    ]
    .into();
    let created_at = 1_764_000_000_000 + i as i64;
    SandboxRecord {
        id,
        tenant,
        template,
        state,
        tier,
        limits: Limits::default(),
        env,
        metadata,
        created_at,
        last_active_at: created_at,
        generation: 3,
        image,
        last_error: None,
        oom_killed: false,
        controller: None,
        version: Version(0),
    }
}

/// One filled database.
struct Table {
    label: String,
    rows: usize,
    url: String,
    store: Store,
    ids: Vec<SandboxId>,
    insert_s: f64,
    _key_dir: tempfile::TempDir,
}

fn fill(server: &pg_testing::Server, rows: usize, label: &str) -> Table {
    let db = pg_testing::new_database(server);
    let url = server.url(&db);
    let key_dir = tempfile::tempdir().unwrap();
    let key = key_dir.path().join("env.key");
    let stores: Vec<Store> = (0..2)
        .map(|_| Store::connect(&url, &key).expect("connect the store"))
        .collect();
    let store = stores[0].clone();

    store
        .insert_template(&template(TenantId::admin(), base()))
        .unwrap();
    for t in (0..TENANTS).map(tenant_name).chain([probe()]) {
        store
            .insert_template(&template(t.clone(), agent()))
            .unwrap();
        let rec = TenantRecord {
            id: t.clone(),
            created_at: 1_764_000_000_000,
            quotas: Quotas::default(),
        };
        assert!(store.insert_tenant(&rec, &format!("hash-{t}")).unwrap());
    }

    let started = Instant::now();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let threads: Vec<_> = (0..INSERT_THREADS)
        .map(|k| {
            let store = stores[k % stores.len()].clone();
            let next = next.clone();
            let label = label.to_string();
            std::thread::spawn(move || {
                let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (k as u64 + 1));
                let mut ids = Vec::with_capacity(rows / INSERT_THREADS + 1);
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= rows {
                        return ids;
                    }
                    let s = sandbox(i, &mut rng);
                    store.insert_sandbox(&s).expect("insert a sandbox");
                    ids.push(s.id);
                    if i > 0 && i.is_multiple_of(100_000) {
                        eprintln!(
                            "  {label}: {i} rows in {:.0} s",
                            started.elapsed().as_secs_f64()
                        );
                    }
                }
            })
        })
        .collect();
    let mut ids: Vec<SandboxId> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    let insert_s = started.elapsed().as_secs_f64();
    ids.sort_by(|a, b| a.as_str().cmp(b.as_str()));
    assert_eq!(ids.len(), rows);
    // Schema 3 indexes (template, tenant); the template-count rows measure without it first,
    // as schema 2 had it, and again with it (the "+ index" rows).
    let admin = Admin::connect(&url);
    admin.batch(
        "DROP INDEX IF EXISTS sandboxes_template_tenant;
         CREATE INDEX IF NOT EXISTS sandboxes_template ON sandboxes (template)",
    );
    // Alone: VACUUM cannot run inside the implicit transaction of a multi-statement batch.
    admin.batch("VACUUM ANALYZE sandboxes");
    Table {
        label: label.to_string(),
        rows,
        url,
        store,
        ids,
        insert_s,
        _key_dir: key_dir,
    }
}

/// Latencies of `n` calls of `f` (after `warm` untimed ones), in ms.
fn time_calls(n: usize, warm: usize, mut f: impl FnMut(bool) -> Option<Duration>) -> Vec<f64> {
    for _ in 0..warm {
        f(false);
    }
    let mut out: Vec<f64> = (0..n)
        .filter_map(|_| f(true))
        .map(|d| d.as_secs_f64() * 1e3)
        .collect();
    out.sort_by(|a, b| a.partial_cmp(b).unwrap());
    out
}

fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let v = f();
    (v, t.elapsed())
}

fn pct(sorted: &[f64], p: usize) -> f64 {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

struct Row {
    name: String,
    n: usize,
    p50: f64,
    p99: f64,
}

fn row(name: &str, ms: Vec<f64>) -> Row {
    Row {
        name: name.to_string(),
        n: ms.len(),
        p50: pct(&ms, 50),
        p99: pct(&ms, 99),
    }
}

/// Every measured operation on one table.
fn measure(t: &Table, point_n: usize, agg_n: usize, list_n: usize) -> Vec<Row> {
    let s = &t.store;
    let mut rng = Rng(0x5eed_0000 + t.rows as u64);
    let mut rows = Vec::new();

    let ids = &t.ids;
    rows.push(row(
        "sandbox_versioned (by id)",
        time_calls(point_n, 100, |_| {
            let id = &ids[rng.below(ids.len())];
            let (r, d) = timed(|| s.sandbox_versioned(id).unwrap());
            assert!(r.is_some());
            Some(d)
        }),
    ));

    let mut rng2 = Rng(0xca5 + t.rows as u64);
    rows.push(row(
        "compare_and_set_sandbox",
        time_calls(point_n, 100, |_| {
            let id = &ids[rng2.below(ids.len())];
            let (mut rec, v) = s.sandbox_versioned(id).unwrap().unwrap();
            rec.last_active_at += 1;
            let (r, d) = timed(|| s.compare_and_set_sandbox(&rec, v));
            assert_eq!(r.unwrap(), Version(v.0 + 1));
            Some(d)
        }),
    ));

    rows.push(row(
        &format!("usage(probe: {PROBE_ROWS} sandboxes)"),
        time_calls(agg_n, 10, |_| {
            let (u, d) = timed(|| s.usage(&probe()).unwrap());
            assert_eq!(u.sandboxes, PROBE_ROWS as u64);
            Some(d)
        }),
    ));
    let ordinary = tenant_name(TENANTS / 2);
    let held = s.usage(&ordinary).unwrap().sandboxes;
    rows.push(row(
        &format!("usage(ordinary tenant: {held} sandboxes)"),
        time_calls(agg_n, 10, |_| Some(timed(|| s.usage(&ordinary).unwrap()).1)),
    ));

    rows.extend(count_rows(t, agg_n, ""));

    // The idle policy's reads (schema 3): the awake sandboxes (5% of the rows here, far more
    // than a real fleet keeps resident) with no Parked one due, and the gauges' counts.
    let awake = t.rows.div_ceil(20);
    rows.push(row(
        "sandboxes_to_tend (awake only; the policy tick)",
        time_calls(list_n.max(5), 1, |_| {
            let (r, d) = timed(|| s.sandboxes_to_tend(0).unwrap());
            assert!(r.len() <= awake * 2, "{} awake", r.len());
            Some(d)
        }),
    ));
    rows.push(row(
        "sandbox_counts (the gauges)",
        time_calls(agg_n.min(50), 2, |_| {
            let (r, d) = timed(|| s.sandbox_counts().unwrap());
            assert_eq!(r.iter().map(|(_, _, n)| *n as usize).sum::<usize>(), t.rows);
            Some(d)
        }),
    ));

    rows.push(row(
        "sandboxes() (every row)",
        time_calls(list_n, 1, |_| {
            let (all, d) = timed(|| s.sandboxes());
            match all {
                Ok(all) => {
                    assert_eq!(all.len(), t.rows);
                    Some(d)
                }
                Err(e) => {
                    eprintln!("  {}: sandboxes() failed after {d:?}: {e}", t.label);
                    None
                }
            }
        }),
    ));
    rows
}

fn count_rows(t: &Table, agg_n: usize, suffix: &str) -> Vec<Row> {
    let s = &t.store;
    let own = row(
        &format!("count_sandboxes_of_template(probe, agent){suffix}"),
        time_calls(agg_n, 10, |_| {
            let (n, d) = timed(|| s.count_sandboxes_of_template(&probe(), &agent()).unwrap());
            assert_eq!(n, PROBE_ROWS as u64);
            Some(d)
        }),
    );
    let operator = row(
        &format!("count_sandboxes_of_template(admin, base){suffix}"),
        time_calls(agg_n.min(50), 2, |_| {
            Some(
                timed(|| {
                    s.count_sandboxes_of_template(&TenantId::admin(), &base())
                        .unwrap()
                })
                .1,
            )
        }),
    );
    vec![own, operator]
}

struct Sizes {
    table_bytes: i64,
    index_bytes: i64,
    total_bytes: i64,
}

fn sizes(t: &Table) -> Sizes {
    let admin = Admin::connect(&t.url);
    let v = |sql: &str| -> i64 { admin.texts(sql, &[])[0].parse().unwrap() };
    Sizes {
        table_bytes: v("SELECT pg_table_size('sandboxes')::text"),
        index_bytes: v("SELECT pg_indexes_size('sandboxes')::text"),
        total_bytes: v("SELECT pg_total_relation_size('sandboxes')::text"),
    }
}

/// The plan PostgreSQL picks for `probe`'s template count (first line, with the index used).
fn count_plan(t: &Table) -> String {
    let admin = Admin::connect(&t.url);
    admin
        .texts(
            "EXPLAIN SELECT COUNT(*) FROM sandboxes s WHERE s.template=$1 AND (s.tenant=$2 OR ($2=$3
               AND NOT EXISTS (SELECT 1 FROM templates t
                               WHERE t.name=$1 AND t.tenant=s.tenant AND t.tenant<>$3)))",
            &["agent", "probe", "admin"],
        )
        .into_iter()
        .map(|l| l.trim().to_string())
        .filter(|l| l.contains("Scan") || l.contains("Aggregate"))
        .collect::<Vec<_>>()
        .join(" / ")
}

/// The server's own time for the full list (`EXPLAIN ANALYZE` of every row in the list's order:
/// no transfer to the client, no parsing), in ms.
fn list_server_ms(t: &Table) -> f64 {
    let admin = Admin::connect(&t.url);
    let plan = admin.texts(
        "EXPLAIN (ANALYZE, TIMING OFF) SELECT * FROM sandboxes ORDER BY created_at, id",
        &[],
    );
    plan.iter()
        .find_map(|l| l.trim().strip_prefix("Execution Time: "))
        .and_then(|v| v.trim_end_matches(" ms").parse().ok())
        .unwrap_or(f64::NAN)
}

fn mib(b: i64) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn main() {
    // `cargo bench` passes `--bench`; nothing else is taken.
    let big_rows = env_usize("TORPOR_PG_ROWS", 1_000_000);
    let point_n = env_usize("TORPOR_PG_N", 2_000);
    let agg_n = env_usize("TORPOR_PG_AGG_N", 200);
    let list_n = env_usize("TORPOR_PG_LIST_N", 5);
    let Some(server) = pg_testing::server() else {
        eprintln!(
            "pg_state: no PostgreSQL binaries (scripts/deps.sh installs them); nothing measured"
        );
        return;
    };
    let version = Admin::connect(&server.url("postgres")).texts("SHOW server_version", &[]);
    eprintln!(
        "pg_state: PostgreSQL {}, filling {SMALL_ROWS} and {big_rows} rows ({INSERT_THREADS} threads, per-row insert_sandbox)",
        version[0]
    );

    let small = fill(server, SMALL_ROWS, "baseline");
    let big = fill(server, big_rows, "large");
    let mut results = Vec::new();
    for (t, list_n) in [(&small, 50), (&big, list_n)] {
        eprintln!("  measuring {} ({} rows)", t.label, t.rows);
        let rows = measure(t, point_n, agg_n, list_n);
        let plan_before = count_plan(t);
        let list_server = list_server_ms(t);
        let sz = sizes(t);
        Admin::connect(&t.url)
            .batch("CREATE INDEX sandboxes_template_tenant ON sandboxes (template, tenant); ANALYZE sandboxes");
        let with_index = count_rows(t, agg_n, " + index (template, tenant)");
        let plan_after = count_plan(t);
        results.push((
            t,
            rows,
            with_index,
            sz,
            plan_before,
            plan_after,
            list_server,
        ));
    }

    let (s, sr, si, ssz, _, _, s_list) = &results[0];
    let (b, br, bi, bsz, plan_before, plan_after, b_list) = &results[1];
    println!(
        "pg_state: PostgreSQL state store, {} sandboxes vs {} (the baseline), one server, one run",
        b.rows, s.rows
    );
    println!(
        "  fill (per-row insert_sandbox, {INSERT_THREADS} threads, 2 pools of 8): {:.0} rows/s at {} rows, {:.0} rows/s at {} rows ({:.0} s)",
        s.rows as f64 / s.insert_s,
        s.rows,
        b.rows as f64 / b.insert_s,
        b.rows,
        b.insert_s
    );
    println!(
        "  {:<70} {:>9} {:>9} {:>10} {:>10} {:>8}",
        "operation (ms)", "base p50", "base p99", "large p50", "large p99", "p50 x"
    );
    let mut json_rows = Vec::new();
    for (x, y) in sr.iter().chain(si).zip(br.iter().chain(bi)) {
        println!(
            "  {:<70} {:>9.3} {:>9.3} {:>10.3} {:>10.3} {:>8.1}",
            y.name,
            x.p50,
            x.p99,
            y.p50,
            y.p99,
            y.p50 / x.p50
        );
        json_rows.push(json!({
            "name": y.name, "baseline_name": x.name,
            "baseline_n": x.n, "baseline_p50_ms": x.p50, "baseline_p99_ms": x.p99,
            "n": y.n, "p50_ms": y.p50, "p99_ms": y.p99, "ratio_p50": y.p50 / x.p50,
        }));
    }
    for (t, sz) in [(s, ssz), (b, bsz)] {
        println!(
            "  on disk at {} rows: table {:.1} MiB, indexes {:.1} MiB, total {:.1} MiB ({:.0} bytes/row)",
            t.rows,
            mib(sz.table_bytes),
            mib(sz.index_bytes),
            mib(sz.total_bytes),
            sz.total_bytes as f64 / t.rows as f64
        );
    }
    println!(
        "  sandboxes()'s SELECT on the server alone (EXPLAIN ANALYZE, no transfer): {s_list:.1} ms at {} rows, {b_list:.1} ms at {} rows",
        s.rows, b.rows
    );
    println!("  count plan at {} rows: {plan_before}", b.rows);
    println!("  with (template, tenant):  {plan_after}");
    println!(
        "{}",
        json!({
            "bench": "pg_state",
            "rows": b.rows, "baseline_rows": s.rows,
            "insert_rows_per_s": b.rows as f64 / b.insert_s,
            "baseline_insert_rows_per_s": s.rows as f64 / s.insert_s,
            "insert_threads": INSERT_THREADS,
            "list_server_ms": b_list, "baseline_list_server_ms": s_list,
            "bytes": {"table": bsz.table_bytes, "indexes": bsz.index_bytes, "total": bsz.total_bytes},
            "baseline_bytes": {"table": ssz.table_bytes, "indexes": ssz.index_bytes, "total": ssz.total_bytes},
            "ops": json_rows,
        })
    );
}
