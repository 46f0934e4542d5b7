//! What a tenant's GPU turn costs in PostgreSQL: the statements a GPU start makes under quotas in
//! cluster mode (`torpor_cluster::gpu_turn`, `StoreGpuTurns` in the `torpor` crate), beside one
//! indexed read of a row, on one real PostgreSQL server (`store::pg_testing`) in the same run.
//!
//!   cargo bench -p torpor-control --features testing --bench gpu_turn
//!   TORPOR_TURN_N=2000 cargo bench -p torpor-control --features testing --bench gpu_turn
//!
//! Rows, each `TORPOR_TURN_N` (1,000) times, one call at a time, interleaved with the baseline:
//!
//! | row | what | baseline |
//! |---|---|---|
//! | turn, on the start's path | take the turn (`try_lease`, one compare-and-set), read the tenant's holdings (`gpu_holdings`), keep the worker's report (`put_gpu_holding`) | one read of a sandbox row by id |
//! | give back, off the path | `release_lease` (the controller sends it in the background) | the same read |
//! | turn, two controllers at once | two threads on two stores (two controllers' pools) take turns for the same tenant as fast as they can, each retrying every 20 ms as the controller does, each turn given back at once; the time from asking to holding the turn, and how many turns waited | an uncontended turn |
//!
//! A real start holds its turn while its worker starts the sandbox (hundreds of ms): a second
//! start of the same tenant waits that long whatever the database costs. What this measures is
//! the database's part.
//!
//! The server is the tests' (fsync, synchronous_commit and full_page_writes off): commit latency
//! here is lower than on a durable server.
//!
//! Prints a table and one JSON line (`{"bench":"gpu_turn",...}`).

use std::time::{Duration, Instant};

use serde_json::json;
use torpor_control::store::pg_testing;
use torpor_control::store::Store;
use torpor_core::SandboxId;
use torpor_gpu::quota::Amount;

/// As `torpor_cluster::gpu_turn`.
const TURN_TTL: Duration = Duration::from_secs(10);
const TRY_EVERY: Duration = Duration::from_millis(20);

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

/// (p50, p95, p99) of `v`, nearest rank.
fn pcts(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let at = |p: f64| v[((p / 100.0) * (v.len() - 1) as f64).round() as usize];
    (at(50.0), at(95.0), at(99.0))
}

/// One GPU start's statements on its request path; `holder` names the turn.
fn turn(store: &Store, tenant: &str, holder: &str, seq: u64) -> bool {
    if !store
        .try_lease(&format!("gpu-start:{tenant}"), holder, TURN_TTL)
        .unwrap()
    {
        return false;
    }
    let _held = store.gpu_holdings(tenant).unwrap();
    let amount = Amount {
        memory_mib: 23034,
        compute: 1000,
    };
    store.put_gpu_holding(tenant, "w1", seq, amount).unwrap();
    true
}

fn main() {
    let n = env_usize("TORPOR_TURN_N", 1_000);
    let Some(server) = pg_testing::server() else {
        eprintln!(
            "gpu_turn: no PostgreSQL binaries (scripts/deps.sh installs them); nothing measured"
        );
        return;
    };
    let url = server.url(&pg_testing::new_database(server));
    let key_dir = tempfile::tempdir().unwrap();
    let key = key_dir.path().join("env.key");
    let stores: Vec<Store> = (0..2)
        .map(|_| Store::connect(&url, &key).expect("connect the store"))
        .collect();
    let store = &stores[0];
    let missing = SandboxId::generate();
    // Warm-up: connections, statement caches.
    for k in 0..50 {
        assert!(turn(store, "warm", &format!("c1@{k}"), k));
        store
            .release_lease("gpu-start:warm", &format!("c1@{k}"))
            .unwrap();
        store.sandbox(&missing).unwrap();
    }

    let (mut turns, mut gives, mut reads) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..n {
        let holder = format!("c1@{k}");
        let t = Instant::now();
        assert!(
            turn(store, "t1", &holder, k as u64),
            "an uncontended turn is had"
        );
        turns.push(ms(t));
        let t = Instant::now();
        store.release_lease("gpu-start:t1", &holder).unwrap();
        gives.push(ms(t));
        let t = Instant::now();
        store.sandbox(&missing).unwrap();
        reads.push(ms(t));
    }

    // Two controllers at once, for one tenant.
    let contended_n = n / 2;
    let runs: Vec<_> = (0..2)
        .map(|c| {
            let store = stores[c].clone();
            std::thread::spawn(move || {
                let (mut waits, mut waited) = (Vec::new(), 0usize);
                for k in 0..contended_n {
                    let holder = format!("c{c}@{k}");
                    let t = Instant::now();
                    let mut tries = 0;
                    while !turn(&store, "t2", &holder, k as u64) {
                        tries += 1;
                        std::thread::sleep(TRY_EVERY);
                    }
                    waits.push(ms(t));
                    waited += usize::from(tries > 0);
                    store.release_lease("gpu-start:t2", &holder).unwrap();
                }
                (waits, waited)
            })
        })
        .collect();
    let mut contended = Vec::new();
    let mut waited = 0;
    for r in runs {
        let (w, k) = r.join().unwrap();
        contended.extend(w);
        waited += k;
    }

    let (r50, r95, _) = pcts(&mut reads);
    let mut rows = Vec::new();
    println!(
        "\n{:<34} {:>6} {:>8} {:>8} {:>8} | {:<30} {:>8} {:>8} | {:>7}",
        "row", "n", "p50 ms", "p95 ms", "p99 ms", "baseline", "p50 ms", "p95 ms", "p50 x"
    );
    let (t50, t95, _) = {
        let mut t = turns.clone();
        pcts(&mut t)
    };
    for (name, v, base, b50, b95) in [
        (
            "turn, on the start's path",
            &mut turns,
            "one indexed read",
            r50,
            r95,
        ),
        (
            "give back, off the path",
            &mut gives,
            "one indexed read",
            r50,
            r95,
        ),
        (
            "turn, two controllers at once",
            &mut contended,
            "uncontended turn",
            t50,
            t95,
        ),
    ] {
        let len = v.len();
        let (p50, p95, p99) = pcts(v);
        println!(
            "{name:<34} {len:>6} {p50:>8.3} {p95:>8.3} {p99:>8.3} | {base:<30} {b50:>8.3} {b95:>8.3} | {:>7.2}",
            p50 / b50
        );
        rows.push(json!({"row": name, "n": len, "p50_ms": p50, "p95_ms": p95, "p99_ms": p99,
            "baseline": base, "baseline_p50_ms": b50, "baseline_p95_ms": b95, "ratio_p50": p50 / b50}));
    }
    println!(
        "two controllers at once: {waited} of {} turns waited for the other's (retry every {} ms)",
        contended.len(),
        TRY_EVERY.as_millis()
    );
    println!(
        "{}",
        json!({"bench": "gpu_turn", "n": n, "rows": rows,
            "contended_turns_waited": waited, "contended_turns": contended.len()})
    );
}
