//! Planner benchmarks: decisions per second, gang optimality against brute force, and MIG/MPS
//! density against a first-fit baseline. Prints a table and one JSON line per benchmark.
//! Run: `cargo bench --bench planner` (figures in BENCHMARKS.md).

use std::path::PathBuf;
use std::time::Instant;

use torpor_gpu::ids::GpuIndex;
use torpor_gpu::inventory::Inventory;
use torpor_gpu::ledger::{resolve_profile, Ledger, Share, ShareKind};
use torpor_gpu::mig::{MigInstance, MigLayout};
use torpor_gpu::partition::PartitionMode;
use torpor_gpu::planner::{commit, plan, plan_gang, Policy};
use torpor_gpu::quota::QuotaBook;
use torpor_gpu::request::{GangRequest, GpuRequest};

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

fn fixture(name: &str) -> Inventory {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|d| d.join("fixtures/gpu"))
        .find(|d| d.is_dir())
        .expect("fixtures/gpu of the repository above the crate")
        .join(name);
    Inventory::load(&path).unwrap_or_else(|e| panic!("{e}"))
}

const MIG_PROFILES: [&str; 5] = ["19", "15", "14", "9", "5"];

fn mixed_request(rng: &mut Rng) -> GpuRequest {
    if rng.below(3) == 0 {
        GpuRequest::mps(
            10 * (1 + rng.below(5) as u32),
            Some(4096 * (1 + rng.below(4))),
        )
    } else {
        GpuRequest::mig(MIG_PROFILES[rng.below(MIG_PROFILES.len() as u64) as usize])
    }
}

/// Fills a node to about half its capacity with mixed shares.
fn half_full(inv: &Inventory, rng: &mut Rng, policy: &Policy) -> Ledger {
    let mut ledger = Ledger::new(inv);
    let quotas = QuotaBook::unlimited();
    for _ in 0..200 {
        let fill: u32 = inv
            .gpus()
            .iter()
            .zip(ledger.usage())
            .map(|(g, u)| u.fill_permille(g))
            .sum();
        if fill >= 500 * inv.gpus().len() as u32 {
            break;
        }
        let request = mixed_request(rng);
        if let Ok(p) = plan(inv, &ledger, &request, policy, &quotas) {
            let _ = commit(inv, &mut ledger, &p, policy);
        }
    }
    ledger
}

fn decisions_per_second() {
    let inv = fixture("hgx-h200-8.toml");
    let policy = Policy::default();
    let quotas = QuotaBook::unlimited();
    let mut rng = Rng(0x9e3779b97f4a7c15);
    let nodes: Vec<Ledger> = (0..1000)
        .map(|_| half_full(&inv, &mut rng, &policy))
        .collect();
    let requests: Vec<GpuRequest> = (0..20_000).map(|_| mixed_request(&mut rng)).collect();
    let start = Instant::now();
    let mut placed = 0u64;
    for (i, request) in requests.iter().enumerate() {
        if plan(&inv, &nodes[i % nodes.len()], request, &policy, &quotas).is_ok() {
            placed += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let rate = requests.len() as f64 / secs;
    println!("decisions: 1000 nodes x 8 H200 at ~50% occupancy, one core");
    println!("  decisions  placed  seconds  decisions/s  goal");
    println!(
        "  {:>9}  {:>6}  {:>7.3}  {:>11.0}  50000",
        requests.len(),
        placed,
        secs,
        rate
    );
    println!(
        "{{\"bench\":\"decisions_per_second\",\"nodes\":1000,\"gpus_per_node\":8,\"decisions\":{},\"placed\":{placed},\"seconds\":{secs:.4},\"per_second\":{rate:.0},\"goal\":50000}}",
        requests.len()
    );
}

/// Best pairwise score over every multiset of GPUs that can hold one share per member.
fn brute_force_gang(inv: &Inventory, ledger: &Ledger, member: &GpuRequest, size: usize) -> u64 {
    fn go(
        inv: &Inventory,
        ledger: &Ledger,
        member: &GpuRequest,
        size: usize,
        from: u32,
        chosen: &mut Vec<GpuIndex>,
        best: &mut u64,
    ) {
        if chosen.len() == size {
            *best = (*best).max(inv.set_score(chosen));
            return;
        }
        for g in from..inv.gpus().len() as u32 {
            let gpu = &inv.gpus()[g as usize];
            let usage = ledger.usage()[g as usize].clone();
            let kind = match member.mode {
                PartitionMode::Whole => ShareKind::Whole,
                PartitionMode::Mig => {
                    let Some(geometry) = gpu.mig_geometry.clone() else {
                        continue;
                    };
                    let Ok(p) =
                        resolve_profile(&geometry, member.profile.as_deref(), None, gpu.memory_mib)
                    else {
                        continue;
                    };
                    let layout = if usage.mode == PartitionMode::Mig {
                        usage
                            .mig
                            .clone()
                            .unwrap_or(MigLayout::empty(geometry.clone()))
                    } else {
                        MigLayout::empty(geometry.clone())
                    };
                    let Some(start) = layout.best_start(p) else {
                        continue;
                    };
                    ShareKind::Mig {
                        instance: MigInstance {
                            profile_id: p.id,
                            start,
                        },
                    }
                }
                _ => continue,
            };
            let mut next = ledger.clone();
            if next
                .insert(
                    inv,
                    member.clone(),
                    vec![Share {
                        gpu: GpuIndex(g),
                        kind,
                    }],
                    true,
                )
                .is_err()
            {
                continue;
            }
            chosen.push(GpuIndex(g));
            go(inv, &next, member, size, g, chosen, best);
            chosen.pop();
        }
    }
    let mut best = 0;
    go(inv, ledger, member, size, 0, &mut Vec::new(), &mut best);
    best
}

fn gang_optimality() {
    println!("gangs of 8: chosen pairwise score vs brute force");
    println!("  inventory        member      chosen     best  match  ms");
    let cases = [
        ("hgx-h200-8.toml", GpuRequest::whole(1), 0usize),
        ("hgx-h200-8.toml", GpuRequest::mig("9"), 5),
        ("pcie-a100-4.toml", GpuRequest::mig("14"), 0),
        ("pcie-a100-4.toml", GpuRequest::mig("9"), 0),
    ];
    for (name, member, occupy) in cases {
        let inv = fixture(name);
        let policy = Policy::default();
        let mut ledger = Ledger::new(&inv);
        let mut rng = Rng(42);
        for _ in 0..occupy {
            if let Ok(p) = plan(
                &inv,
                &ledger,
                &mixed_request(&mut rng),
                &policy,
                &QuotaBook::unlimited(),
            ) {
                let _ = commit(&inv, &mut ledger, &p, &policy);
            }
        }
        let gang = GangRequest {
            members: vec![member.clone(); 8],
        };
        let start = Instant::now();
        let chosen = plan_gang(&inv, &ledger, &gang, &policy, &QuotaBook::unlimited())
            .map(|p| p.topology_score);
        let ms = start.elapsed().as_secs_f64() * 1000.0;
        let best = brute_force_gang(&inv, &ledger, &member, 8);
        let chosen = chosen.unwrap_or(0);
        let label = member
            .profile
            .clone()
            .map_or("whole".to_owned(), |p| format!("mig id {p}"));
        println!(
            "  {name:<16} {label:<10} {chosen:>8} {best:>8}  {:<5}  {ms:.2}",
            chosen == best
        );
        println!(
            "{{\"bench\":\"gang_of_8\",\"inventory\":\"{name}\",\"member\":\"{label}\",\"chosen\":{chosen},\"brute_force\":{best},\"match\":{},\"ms\":{ms:.3}}}",
            chosen == best
        );
    }
}

/// The baseline: first GPU in index order that takes the share, lowest MIG start.
fn first_fit(inv: &Inventory, ledger: &mut Ledger, request: &GpuRequest) -> bool {
    for gpu in inv.gpus() {
        let usage = ledger.usage()[gpu.index.0 as usize].clone();
        let kind = match request.mode {
            PartitionMode::Mig => {
                let Some(geometry) = gpu.mig_geometry.clone() else {
                    continue;
                };
                let Ok(p) =
                    resolve_profile(&geometry, request.profile.as_deref(), None, gpu.memory_mib)
                else {
                    continue;
                };
                let layout = if usage.mode == PartitionMode::Mig {
                    usage
                        .mig
                        .clone()
                        .unwrap_or(MigLayout::empty(geometry.clone()))
                } else {
                    MigLayout::empty(geometry.clone())
                };
                let Some(start) = layout.first_fit_start(p) else {
                    continue;
                };
                ShareKind::Mig {
                    instance: MigInstance {
                        profile_id: p.id,
                        start,
                    },
                }
            }
            PartitionMode::Mps => ShareKind::Mps {
                compute_pct: request.compute_pct.unwrap_or(100),
                memory_mib: request.memory_mib.unwrap_or(0),
            },
            PartitionMode::Whole => ShareKind::Whole,
            PartitionMode::Timeslice => ShareKind::Timeslice,
        };
        if ledger
            .insert(
                inv,
                request.clone(),
                vec![Share {
                    gpu: gpu.index,
                    kind,
                }],
                true,
            )
            .is_ok()
        {
            return true;
        }
    }
    false
}

/// A stream mix: one MPS request in `mps_one_in`, MIG profiles (ids) drawn from `profiles`.
struct Mix {
    name: &'static str,
    mps_one_in: u64,
    profiles: &'static [&'static str],
}

const MIXES: [Mix; 3] = [
    Mix {
        name: "mixed",
        mps_one_in: 3,
        profiles: &MIG_PROFILES,
    },
    Mix {
        name: "mig-heavy",
        mps_one_in: 6,
        profiles: &["19", "19", "15", "14", "9", "5", "0"],
    },
    Mix {
        name: "small-first",
        mps_one_in: 4,
        profiles: &["19", "19", "19", "15", "14", "9", "0"],
    },
];

fn mix_request(rng: &mut Rng, mix: &Mix) -> GpuRequest {
    if rng.below(mix.mps_one_in) == 0 {
        GpuRequest::mps(
            10 * (1 + rng.below(5) as u32),
            Some(4096 * (1 + rng.below(4))),
        )
    } else {
        GpuRequest::mig(mix.profiles[rng.below(mix.profiles.len() as u64) as usize])
    }
}

/// An upper bound for any online policy: the longest prefix of the stream that can be placed
/// at all when the whole prefix is known in advance (every GPU's mode and every MIG start chosen
/// freely). `None` when the search ran out of budget before deciding.
struct Offline<'a> {
    inv: &'a Inventory,
    mig_fits: std::collections::HashMap<Vec<u32>, bool>,
    /// States proven infeasible: (items left, sorted bin states).
    failed: std::collections::HashSet<FailedKey>,
    budget: u64,
}

type FailedKey = (usize, Vec<(u8, u32, u64, u32, Vec<u32>)>);

#[derive(Clone)]
enum Item {
    Mps { pct: u32, mib: u64 },
    Mig { id: u32, slices: u8 },
}

#[derive(Clone, Default)]
struct Bin {
    /// 0 empty, 1 MPS, 2 MIG.
    mode: u8,
    pct: u32,
    mib: u64,
    clients: u32,
    profiles: Vec<u32>,
}

impl Offline<'_> {
    fn layout_exists(&mut self, profiles: &[u32]) -> bool {
        let mut key = profiles.to_vec();
        key.sort_unstable();
        if let Some(&known) = self.mig_fits.get(&key) {
            return known;
        }
        let Some(geometry) = self.inv.gpus()[0].mig_geometry.clone() else {
            return false;
        };
        let mut by_size: Vec<&torpor_gpu::mig::MigProfile> = key
            .iter()
            .filter_map(|id| geometry.profile_by_id(*id))
            .collect();
        by_size.sort_by_key(|p| std::cmp::Reverse(p.memory_slices));
        fn place(layout: &mut MigLayout, rest: &[&torpor_gpu::mig::MigProfile]) -> bool {
            let Some((first, rest)) = rest.split_first() else {
                return true;
            };
            for start in layout.valid_starts(first) {
                let instance = MigInstance {
                    profile_id: first.id,
                    start,
                };
                if layout.place(instance).is_ok() {
                    if place(layout, rest) {
                        return true;
                    }
                    layout.remove(instance);
                }
            }
            false
        }
        let ok =
            by_size.len() == key.len() && place(&mut MigLayout::empty(geometry.clone()), &by_size);
        self.mig_fits.insert(key, ok);
        ok
    }

    fn assign(&mut self, items: &[Item], bins: &mut Vec<Bin>) -> Option<bool> {
        let Some((item, rest)) = items.split_first() else {
            return Some(true);
        };
        if self.budget == 0 {
            return None;
        }
        self.budget -= 1;
        let gpu = &self.inv.gpus()[0];
        // The same remaining items on the same multiset of bins fail the same way.
        let mut key: Vec<(u8, u32, u64, u32, Vec<u32>)> = bins
            .iter()
            .map(|b| {
                let mut p = b.profiles.clone();
                p.sort_unstable();
                (b.mode, b.pct, b.mib, b.clients, p)
            })
            .collect();
        key.sort();
        let key = (rest.len(), key);
        if self.failed.contains(&key) {
            return Some(false);
        }
        let mut undecided = false;
        for b in 0..bins.len() {
            // Bins in the same state are interchangeable: try the first of them only.
            let same_as_earlier = (0..b).any(|e| {
                bins[e].mode == bins[b].mode
                    && bins[e].pct == bins[b].pct
                    && bins[e].mib == bins[b].mib
                    && bins[e].clients == bins[b].clients
                    && {
                        let (mut x, mut y) = (bins[e].profiles.clone(), bins[b].profiles.clone());
                        x.sort_unstable();
                        y.sort_unstable();
                        x == y
                    }
            });
            if same_as_earlier {
                continue;
            }
            let saved = bins[b].clone();
            let fits = match item {
                Item::Mps { pct, mib } => {
                    let bin = &mut bins[b];
                    if bin.mode == 2
                        || bin.pct + pct > 100
                        || bin.mib + mib > gpu.memory_mib
                        || bin.clients + 1 > gpu.mps_max_clients
                    {
                        false
                    } else {
                        bin.mode = 1;
                        bin.pct += pct;
                        bin.mib += mib;
                        bin.clients += 1;
                        true
                    }
                }
                Item::Mig { id, .. } => {
                    if bins[b].mode == 1 {
                        false
                    } else {
                        let mut profiles = bins[b].profiles.clone();
                        profiles.push(*id);
                        if self.layout_exists(&profiles) {
                            bins[b].mode = 2;
                            bins[b].profiles = profiles;
                            true
                        } else {
                            false
                        }
                    }
                }
            };
            if fits {
                match self.assign(rest, bins) {
                    Some(true) => return Some(true),
                    None => undecided = true,
                    Some(false) => {}
                }
            }
            bins[b] = saved;
        }
        if undecided {
            None
        } else {
            self.failed.insert(key);
            Some(false)
        }
    }

    fn feasible(&mut self, stream: &[GpuRequest]) -> Option<bool> {
        let geometry = self.inv.gpus()[0].mig_geometry.clone()?;
        let mut items: Vec<Item> = stream
            .iter()
            .map(|r| match r.mode {
                PartitionMode::Mps => Item::Mps {
                    pct: r.compute_pct.unwrap_or(100),
                    mib: r.memory_mib.unwrap_or(0),
                },
                _ => {
                    let p = geometry
                        .profile(r.profile.as_deref().unwrap_or(""))
                        .expect("stream profiles are in the table");
                    Item::Mig {
                        id: p.id,
                        slices: p.memory_slices,
                    }
                }
            })
            .collect();
        // Largest first: MIG by memory slices, then MPS by compute.
        items.sort_by_key(|i| match i {
            Item::Mig { slices, .. } => (0, u32::MAX - u32::from(*slices)),
            Item::Mps { pct, .. } => (1, u32::MAX - pct),
        });
        let mut bins = vec![Bin::default(); self.inv.gpus().len()];
        self.budget = 2_000_000;
        self.failed.clear();
        self.assign(&items, &mut bins)
    }

    /// The longest placeable prefix, starting from one known to be placeable.
    fn best_prefix(&mut self, stream: &[GpuRequest], known: usize) -> (usize, bool) {
        let mut k = known;
        while k < stream.len() {
            match self.feasible(&stream[..k + 1]) {
                Some(true) => k += 1,
                Some(false) => return (k, true),
                // Undecided: k is proven placeable; the bound is then only "at least k".
                None => return (k, false),
            }
        }
        (k, true)
    }
}

fn density() {
    for mix in &MIXES {
        density_for(mix);
    }
}

fn density_for(mix: &Mix) {
    println!(
        "density ({}): MIG+MPS stream, requests placed before the first refusal",
        mix.name
    );
    println!("  inventory        seed  torpor  first-fit  gain    offline bound");
    let mut totals = (0u64, 0u64);
    let mut bound_total = 0u64;
    let mut bound_exact = 0u32;
    for name in ["hgx-h200-8.toml", "pcie-a100-4.toml"] {
        let inv = fixture(name);
        for seed in 1..=20u64 {
            let mut rng = Rng(seed.wrapping_mul(0x2545f4914f6cdd1d));
            let stream: Vec<GpuRequest> = (0..2000).map(|_| mix_request(&mut rng, mix)).collect();
            let policy = Policy::default();
            let mut ledger = Ledger::new(&inv);
            let mut ours = 0u64;
            for request in &stream {
                match plan(&inv, &ledger, request, &policy, &QuotaBook::unlimited()) {
                    Ok(p) if commit(&inv, &mut ledger, &p, &policy).is_ok() => ours += 1,
                    _ => break,
                }
            }
            let mut base_ledger = Ledger::new(&inv);
            let mut base = 0u64;
            for request in &stream {
                if !first_fit(&inv, &mut base_ledger, request) {
                    break;
                }
                base += 1;
            }
            totals.0 += ours;
            totals.1 += base;
            let mut offline = Offline {
                inv: &inv,
                mig_fits: Default::default(),
                failed: Default::default(),
                budget: 0,
            };
            let (bound, exact) = offline.best_prefix(&stream, ours.max(base) as usize);
            bound_total += bound as u64;
            bound_exact += u32::from(exact);
            if seed <= 3 {
                println!(
                    "  {name:<16} {seed:>4}  {ours:>6}  {base:>9}  {:+.1}%  {bound:>6}{}",
                    100.0 * (ours as f64 / base.max(1) as f64 - 1.0),
                    if exact { "" } else { " (budget)" }
                );
            }
        }
    }
    let gain = 100.0 * (totals.0 as f64 / totals.1.max(1) as f64 - 1.0);
    let bound_gain = 100.0 * (bound_total as f64 / totals.1.max(1) as f64 - 1.0);
    println!(
        "  all 40 streams    total  {:>6}  {:>9}  {gain:+.1}%  {bound_total:>6} ({bound_gain:+.1}% over first-fit; exact in {bound_exact}/40)  (goal +15%)",
        totals.0, totals.1
    );
    println!(
        "{{\"bench\":\"density\",\"mix\":\"{}\",\"streams\":40,\"torpor\":{},\"first_fit\":{},\"gain_pct\":{gain:.2},\"goal_pct\":15,\"offline_bound\":{bound_total},\"offline_bound_gain_pct\":{bound_gain:.2},\"offline_bound_exact\":{bound_exact}}}",
        mix.name, totals.0, totals.1
    );
}

fn main() {
    let only = std::env::args().nth(1).filter(|a| !a.starts_with('-'));
    let run = |name: &str| only.as_deref().is_none_or(|o| name.contains(o));
    if run("decisions") {
        decisions_per_second();
    }
    if run("gang") {
        gang_optimality();
    }
    if run("density") {
        density();
    }
}
