//! Placement benchmark: time per `place` + `release` as the fleet grows from 10 to 100,000
//! workers, the index ([`torpor_cluster::placement::Placement`]) beside a linear scan over a
//! `Vec` of the same workers with the same rules, in the same run. Both must pick the same worker
//! for every need (checked on every call; the bench panics otherwise).
//!
//!   cargo bench -p torpor-cluster --bench placement
//!   cargo bench -p torpor-cluster --bench placement -- full      (one scenario)
//!
//! Scenarios (simulated workers: 16–64 slots, 64–512 GiB, 0–4 cores idle, one in 8 with an H200,
//! zones z0–z2):
//! - spread: every worker up to half busy; needs: 70% plain (1–8 GiB), 15% H200, 15% one zone.
//! - full: the same with 90% of workers full (every slot busy).
//! - rare-label: 1% of workers carry `pool=rare`, every need asks for it (the label's own set
//!   is walked; at 10 workers none has it and every need is refused).
//!
//! Prints a table and one JSON line (`{"bench":"placement",...}`).

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::Instant;

use serde_json::json;
use torpor_cluster::placement::{Capacity, Load, Need, Placement, WorkerState, CPU_STEP_MILLI};

const GIB: u64 = 1 << 30;
const SIZES: [usize; 5] = [10, 100, 1_000, 10_000, 100_000];
/// Worker visits the scan may spend per (scenario, size); bounds its run time at large fleets.
const SCAN_VISITS: usize = 300_000_000;
const INDEX_CALLS: usize = 200_000;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Scenario {
    Spread,
    Full,
    RareLabel,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Spread => "spread",
            Scenario::Full => "full",
            Scenario::RareLabel => "rare-label",
        }
    }
}

struct Worker {
    name: String,
    cap: Capacity,
    load: Load,
    state: WorkerState,
}

fn fleet(n: usize, scenario: Scenario, rng: &mut Rng) -> Vec<Worker> {
    (0..n)
        .map(|i| {
            let slots = 16 + rng.below(49) as u32;
            let memory_budget = (64 + rng.below(449)) * GIB;
            let mut labels = BTreeMap::from([("zone".to_owned(), format!("z{}", i % 3))]);
            if scenario == Scenario::RareLabel && rng.below(100) == 0 {
                labels.insert("pool".into(), "rare".into());
            }
            let full = scenario == Scenario::Full && rng.below(10) != 0;
            let busy = if full {
                slots
            } else {
                rng.below(u64::from(slots / 2) + 1) as u32
            };
            Worker {
                name: format!("w{i:06}"),
                load: Load {
                    busy,
                    reserved_memory: memory_budget / u64::from(slots) * u64::from(busy),
                    cpu_idle_milli: Some(rng.below(4001) as u32),
                },
                cap: Capacity {
                    slots,
                    memory_budget,
                    cores: 4,
                    gpu_models: if rng.below(8) == 0 {
                        vec!["NVIDIA H200".into()]
                    } else {
                        Vec::new()
                    },
                    labels,
                },
                state: if rng.below(50) == 0 {
                    WorkerState::Draining
                } else {
                    WorkerState::Ready
                },
            }
        })
        .collect()
}

fn needs(scenario: Scenario, rng: &mut Rng) -> Vec<Need> {
    (0..1024)
        .map(|_| {
            let memory = (1 + rng.below(8)) * GIB;
            if scenario == Scenario::RareLabel {
                return Need {
                    memory,
                    labels: BTreeMap::from([("pool".into(), "rare".into())]),
                    ..Need::default()
                };
            }
            match rng.below(20) {
                0..=13 => Need {
                    memory,
                    ..Need::default()
                },
                14..=16 => Need {
                    memory,
                    gpu_model: Some("NVIDIA H200".into()),
                    ..Need::default()
                },
                _ => Need {
                    memory,
                    labels: BTreeMap::from([("zone".into(), format!("z{}", rng.below(3)))]),
                    ..Need::default()
                },
            }
        })
        .collect()
}

/// A candidate's rank: idle CPU steps, free slots, free memory, then the smaller name.
type Rank<'a> = (u32, u32, u64, Reverse<&'a str>);

/// The baseline: look at every worker, keep the best that fits (same order as the index).
fn scan_choose(workers: &[Worker], need: &Need) -> Option<usize> {
    let mut best: Option<(usize, Rank<'_>)> = None;
    for (i, w) in workers.iter().enumerate() {
        let free_slots = w.cap.slots.saturating_sub(w.load.busy);
        let free_memory = w.cap.memory_budget.saturating_sub(w.load.reserved_memory);
        if w.state != WorkerState::Ready
            || free_slots == 0
            || free_memory < need.memory
            || need
                .gpu_model
                .as_ref()
                .is_some_and(|m| !w.cap.gpu_models.contains(m))
            || !need
                .labels
                .iter()
                .all(|(k, v)| w.cap.labels.get(k) == Some(v))
        {
            continue;
        }
        let idle = w.load.cpu_idle_milli.unwrap_or(w.cap.cores.max(1) * 1000);
        let key = (
            idle / CPU_STEP_MILLI,
            free_slots,
            free_memory,
            Reverse(w.name.as_str()),
        );
        if best.as_ref().is_none_or(|(_, b)| key > *b) {
            best = Some((i, key));
        }
    }
    best.map(|(i, _)| i)
}

/// A worker's place in the fleet, from its name (`w000042`).
fn worker_at(name: &str) -> usize {
    name[1..].parse().expect("a fleet name")
}

struct Row {
    scenario: Scenario,
    workers: usize,
    index_ns: f64,
    scan_ns: f64,
    considered: f64,
    build_ms: f64,
}

fn run(scenario: Scenario, n: usize) -> Row {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ n as u64);
    let mut workers = fleet(n, scenario, &mut rng);
    let needs = needs(scenario, &mut rng);

    let start = Instant::now();
    let mut index = Placement::new();
    for w in &workers {
        index.upsert(&w.name, w.cap.clone());
        index.report(&w.name, w.load);
        if w.state != WorkerState::Ready {
            index.set_state(&w.name, w.state);
        }
    }
    let build_ms = start.elapsed().as_secs_f64() * 1e3;

    // Same choice for every need, before timing anything.
    for need in &needs {
        let ours = index.choose(need, None).map(|c| c.worker);
        let scan = scan_choose(&workers, need).map(|i| workers[i].name.clone());
        assert_eq!(ours, scan, "index and scan disagree at {n} workers");
    }

    let (mut considered, mut placed) = (0usize, 0usize);
    let start = Instant::now();
    for i in 0..INDEX_CALLS {
        let need = &needs[i % needs.len()];
        if let Some(c) = index.place(need, None) {
            considered += c.considered;
            placed += 1;
            index.release(black_box(&c.worker), need.memory);
            // A placement takes CPU off its worker until its next report (which the scan has
            // no need of): report it back, so every call sees the same fleet.
            index.report(&c.worker, workers[worker_at(&c.worker)].load);
        }
    }
    let index_ns = start.elapsed().as_nanos() as f64 / INDEX_CALLS as f64;

    let scan_calls = (SCAN_VISITS / n).clamp(200, INDEX_CALLS);
    let start = Instant::now();
    for i in 0..scan_calls {
        let need = &needs[i % needs.len()];
        if let Some(w) = scan_choose(&workers, need) {
            let load = &mut workers[w].load;
            load.busy += 1;
            load.reserved_memory += need.memory;
            black_box(&workers[w]);
            let load = &mut workers[w].load;
            load.busy -= 1;
            load.reserved_memory -= need.memory;
        }
    }
    let scan_ns = start.elapsed().as_nanos() as f64 / scan_calls as f64;
    index
        .check_invariants()
        .expect("index consistent after the run");

    Row {
        scenario,
        workers: n,
        index_ns,
        scan_ns,
        considered: considered as f64 / placed.max(1) as f64,
        build_ms,
    }
}

fn main() {
    let only = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let mut rows = Vec::new();
    println!("placement: ns per place + release, index vs linear scan (same rules, same choices)");
    println!("  considered: workers the index examined per placement (mean)");
    println!("  scenario     workers   index ns   scan ns   scan/index  considered  build ms");
    for scenario in [Scenario::Spread, Scenario::Full, Scenario::RareLabel] {
        if only
            .as_deref()
            .is_some_and(|o| !scenario.name().contains(o))
        {
            continue;
        }
        for n in SIZES {
            let r = run(scenario, n);
            println!(
                "  {:<11} {:>8}  {:>9.0}  {:>8.0}  {:>10.1}  {:>10.1}  {:>8.1}",
                r.scenario.name(),
                r.workers,
                r.index_ns,
                r.scan_ns,
                r.scan_ns / r.index_ns,
                r.considered,
                r.build_ms
            );
            rows.push(r);
        }
    }
    let rows: Vec<_> = rows
        .iter()
        .map(|r| {
            json!({
                "scenario": r.scenario.name(),
                "workers": r.workers,
                "index_ns": (r.index_ns * 10.0).round() / 10.0,
                "scan_ns": (r.scan_ns * 10.0).round() / 10.0,
                "considered": (r.considered * 100.0).round() / 100.0,
                "build_ms": (r.build_ms * 100.0).round() / 100.0,
            })
        })
        .collect();
    println!("{}", json!({"bench": "placement", "rows": rows}));
}
