//! Repacking benchmark: what a store of packs holds after a sandbox parks again and again, with
//! the collector repacking sparse packs and merging small ones, with sparse packs repacked
//! only, and, as the baseline, without either, all three in the same run.
//!
//! ```text
//! cargo run --release --example repack_bench -- [--mib 64] [--parks 20] [--change 0.1] [--below 0.5]
//! ```
//!
//! One synthetic agent memory (`--mib` MiB of memory-like pages in a gVisor image) is parked
//! `--parks` times into three packed stores (4 MiB packs, a local directory); before each park
//! `--change` of its pages are rewritten in 16-page runs at pseudo-random places. After each
//! park the previous snapshot is deleted (the daemon keeps a sandbox's newest only) and the
//! collector runs. Measured: pack bytes stored and used at the end (and the most stored at any
//! point), the live packs at the end (all the last snapshot's: the objects a restore reads
//! ranges of, a request each on S3), the collector's time per run (it holds the store's
//! exclusive lock: puts wait that long), and a restore of the last snapshot from each store.
//! The backend counts its requests (each one request to S3 per object): those of the puts, of
//! the collections (listings, manifest and pack reads, the new packs and rewritten manifests,
//! deletes) and of the last restore.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use torpor_snapshot::gvisor::encode_compressed_image;
use torpor_snapshot::{GcOptions, SnapshotId, Store, StoreConfig};

#[path = "support/synthetic.rs"]
mod synthetic;
use synthetic::{flag, memory_like, touch_pages};
#[path = "support/counting.rs"]
mod counting;
use counting::{Counting, Requests};

/// One store under test and what it measured.
struct Run {
    store: Store,
    backend: Arc<Counting>,
    /// Requests of the puts (with the previous snapshot's delete), of the collections, and of
    /// the last restore.
    put_requests: Requests,
    gc_requests: Requests,
    restore_requests: Requests,
    repack_below: Option<f64>,
    merge_small: bool,
    last: Option<SnapshotId>,
    packs_live: u64,
    gc_ms: Vec<f64>,
    most_stored: u64,
    stored: u64,
    used: u64,
    repacked: u64,
    rewritten: u64,
}

impl Run {
    fn new(root: &Path, repack_below: Option<f64>, merge_small: bool) -> Run {
        let backend = Arc::new(Counting::open(root));
        let store = Store::new(
            backend.clone(),
            StoreConfig {
                pack_bytes: Some(torpor_snapshot::DEFAULT_PACK_BYTES),
                ..StoreConfig::default()
            },
        )
        .unwrap();
        Run {
            store,
            backend,
            put_requests: Requests::default(),
            gc_requests: Requests::default(),
            restore_requests: Requests::default(),
            repack_below,
            merge_small,
            last: None,
            packs_live: 0,
            gc_ms: Vec::new(),
            most_stored: 0,
            stored: 0,
            used: 0,
            repacked: 0,
            rewritten: 0,
        }
    }

    /// Parks `dir` (its previous snapshot as the parent, then deleted) and collects.
    async fn park(&mut self, dir: &Path) {
        let put = self.store.put_dir(dir, self.last.as_ref()).await.unwrap();
        if let Some(old) = self.last.replace(put.id) {
            self.store.delete_snapshot(&old).await.unwrap();
        }
        add(&mut self.put_requests, self.backend.take_each());
        let t = Instant::now();
        let r = self
            .store
            .gc(&GcOptions {
                repack_below: self.repack_below,
                merge_small: self.merge_small,
                ..GcOptions::default()
            })
            .await
            .unwrap();
        self.gc_ms.push(t.elapsed().as_secs_f64() * 1e3);
        add(&mut self.gc_requests, self.backend.take_each());
        self.stored = r.pack_bytes_live;
        self.packs_live = r.packs_live;
        self.used = r.pack_bytes_used;
        self.most_stored = self.most_stored.max(r.pack_bytes_live);
        self.repacked += r.packs_repacked;
        self.rewritten += r.repack_bytes_written;
    }

    async fn restore_ms(&mut self, dest: &Path) -> f64 {
        let t = Instant::now();
        self.store
            .get_dir(self.last.as_ref().unwrap(), dest)
            .await
            .unwrap();
        let ms = t.elapsed().as_secs_f64() * 1e3;
        self.restore_requests = self.backend.take_each();
        ms
    }
}

fn add(into: &mut Requests, r: Requests) {
    into.lookups += r.lookups;
    into.reads += r.reads;
    into.writes += r.writes;
    into.deletes += r.deletes;
    into.lists += r.lists;
}

fn requests_json(r: &Requests) -> String {
    format!(
        "{{\"lookups\":{},\"reads\":{},\"writes\":{},\"deletes\":{},\"lists\":{}}}",
        r.lookups, r.reads, r.writes, r.deletes, r.lists
    )
}

fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * p).round() as usize]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let mib: usize = flag("--mib", 64);
    let parks: usize = flag("--parks", 20);
    let change: f64 = flag("--change", 0.1);
    let below: f64 = flag("--below", 0.5);

    let tmp = tempfile::tempdir().unwrap();
    let mut mem = memory_like(mib * 256);
    // [merge small + repack sparse, repack sparse only, neither (baseline)]
    let mut runs = [
        Run::new(&tmp.path().join("merge"), Some(below), true),
        Run::new(&tmp.path().join("repack"), Some(below), false),
        Run::new(&tmp.path().join("whole"), None, false),
    ];
    let dir = tmp.path().join("ckpt");
    std::fs::create_dir_all(&dir).unwrap();
    for park in 0..parks {
        if park > 0 {
            touch_pages(&mut mem, change, 16, park as u64);
        }
        std::fs::write(
            dir.join("checkpoint.img"),
            encode_compressed_image(b"{}", &mem, 1 << 20),
        )
        .unwrap();
        // Rotate which store goes first, so none always meets a warmer page cache.
        for i in 0..runs.len() {
            let n = runs.len();
            runs[(park + i) % n].park(&dir).await;
        }
    }
    let mut restores = Vec::new();
    for (i, r) in runs.iter_mut().enumerate() {
        restores.push(r.restore_ms(&tmp.path().join(format!("out-{i}"))).await);
    }

    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "{parks} parks of {mib} MiB, {:.0}% of pages changed before each (16-page runs), newest snapshot kept, gc after each park; 4 MiB packs",
        change * 100.0
    );
    println!(
        "{:<42} | {:>20} | {:>20} | {:>20}",
        "measure",
        format!("merge + repack {below}"),
        format!("repack {below} only"),
        "neither (baseline)"
    );
    println!("{}", "-".repeat(112));
    let each = |f: &dyn Fn(&Run) -> f64| -> [f64; 3] { [f(&runs[0]), f(&runs[1]), f(&runs[2])] };
    let rows: Vec<(&str, [f64; 3])> = vec![
        ("pack bytes stored at the end (MB)", each(&|r| mb(r.stored))),
        ("of which the snapshot uses (MB)", each(&|r| mb(r.used))),
        ("most pack bytes stored (MB)", each(&|r| mb(r.most_stored))),
        ("live packs at the end", each(&|r| r.packs_live as f64)),
        (
            "gc per park, p50 (ms)",
            each(&|r| percentile(&r.gc_ms, 0.5)),
        ),
        (
            "gc per park, max (ms)",
            each(&|r| percentile(&r.gc_ms, 1.0)),
        ),
        (
            "restore of the last snapshot (ms)",
            [restores[0], restores[1], restores[2]],
        ),
        (
            "requests per park: put + old delete",
            each(&|r| r.put_requests.total() as f64 / parks as f64),
        ),
        (
            "requests per gc: all",
            each(&|r| r.gc_requests.total() as f64 / parks as f64),
        ),
        (
            "  of which reads (GET, ranged GET)",
            each(&|r| r.gc_requests.reads as f64 / parks as f64),
        ),
        (
            "  of which writes (PUT)",
            each(&|r| r.gc_requests.writes as f64 / parks as f64),
        ),
        (
            "  of which deletes",
            each(&|r| r.gc_requests.deletes as f64 / parks as f64),
        ),
        (
            "  of which listings",
            each(&|r| r.gc_requests.lists as f64 / parks as f64),
        ),
        (
            "requests of the last restore",
            each(&|r| r.restore_requests.total() as f64),
        ),
    ];
    for (name, v) in &rows {
        println!(
            "{name:<42} | {:>20.1} | {:>20.1} | {:>20.1}",
            v[0], v[1], v[2]
        );
    }
    for (what, r) in [("merge + repack", &runs[0]), ("repack only", &runs[1])] {
        println!(
            "{what}: {} packs rewritten, {:.1} MB copied over {parks} collections",
            r.repacked,
            mb(r.rewritten)
        );
    }
    let json_of = |r: &Run, restore: f64| {
        format!(
            "{{\"stored_bytes\":{},\"used_bytes\":{},\"most_stored_bytes\":{},\"packs_live\":{},\
\"gc_p50_ms\":{:.1},\"gc_max_ms\":{:.1},\"restore_ms\":{restore:.1},\"packs_repacked\":{},\
\"repack_bytes_written\":{},\"put_requests\":{},\"gc_requests\":{},\"restore_requests\":{}}}",
            r.stored,
            r.used,
            r.most_stored,
            r.packs_live,
            percentile(&r.gc_ms, 0.5),
            percentile(&r.gc_ms, 1.0),
            r.repacked,
            r.rewritten,
            requests_json(&r.put_requests),
            requests_json(&r.gc_requests),
            requests_json(&r.restore_requests)
        )
    };
    println!(
        "{{\"bench\":\"repack\",\"mib\":{mib},\"parks\":{parks},\"change\":{change},\"repack_below\":{below},\
\"merge_and_repack\":{},\"repack_only\":{},\"baseline\":{}}}",
        json_of(&runs[0], restores[0]),
        json_of(&runs[1], restores[1]),
        json_of(&runs[2], restores[2])
    );
}
