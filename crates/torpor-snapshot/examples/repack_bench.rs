//! Repacking benchmark: what a store of packs holds after a sandbox parks again and again, with
//! the collector repacking sparse packs and, as the baseline in the same run, without.
//!
//! ```text
//! cargo run --release --example repack_bench -- [--mib 64] [--parks 20] [--change 0.1] [--below 0.5]
//! ```
//!
//! One synthetic agent memory (`--mib` MiB of memory-like pages in a gVisor image) is parked
//! `--parks` times into two packed stores (4 MiB packs, a local directory); before each park
//! `--change` of its pages are rewritten in 16-page runs at pseudo-random places. After each
//! park the previous snapshot is deleted (the daemon keeps a sandbox's newest only) and the
//! collector runs: in one store with `repack_below = --below`, in the other without. Measured:
//! pack bytes stored and used at the end (and the most stored at any point), the collector's
//! time per run (it holds the store's exclusive lock: puts wait that long), and a restore of
//! the last snapshot from each store.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use torpor_snapshot::gvisor::encode_compressed_image;
use torpor_snapshot::{GcOptions, LocalBackend, SnapshotId, Store, StoreConfig};

#[path = "support/synthetic.rs"]
mod synthetic;
use synthetic::{flag, memory_like, touch_pages};

/// One store under test and what it measured.
struct Run {
    store: Store,
    repack_below: Option<f64>,
    last: Option<SnapshotId>,
    gc_ms: Vec<f64>,
    most_stored: u64,
    stored: u64,
    used: u64,
    repacked: u64,
    rewritten: u64,
}

impl Run {
    fn new(root: &Path, repack_below: Option<f64>) -> Run {
        let store = Store::new(
            Arc::new(LocalBackend::open(root).unwrap()),
            StoreConfig {
                pack_bytes: Some(torpor_snapshot::DEFAULT_PACK_BYTES),
                ..StoreConfig::default()
            },
        )
        .unwrap();
        Run {
            store,
            repack_below,
            last: None,
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
        let t = Instant::now();
        let r = self
            .store
            .gc(&GcOptions {
                repack_below: self.repack_below,
                ..GcOptions::default()
            })
            .await
            .unwrap();
        self.gc_ms.push(t.elapsed().as_secs_f64() * 1e3);
        self.stored = r.pack_bytes_live;
        self.used = r.pack_bytes_used;
        self.most_stored = self.most_stored.max(r.pack_bytes_live);
        self.repacked += r.packs_repacked;
        self.rewritten += r.repack_bytes_written;
    }

    async fn restore_ms(&self, dest: &Path) -> f64 {
        let t = Instant::now();
        self.store
            .get_dir(self.last.as_ref().unwrap(), dest)
            .await
            .unwrap();
        t.elapsed().as_secs_f64() * 1e3
    }
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
    let mut with = Run::new(&tmp.path().join("repack"), Some(below));
    let mut without = Run::new(&tmp.path().join("whole"), None);
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
        // Alternate which store goes first, so neither always meets a warmer page cache.
        if park % 2 == 0 {
            with.park(&dir).await;
            without.park(&dir).await;
        } else {
            without.park(&dir).await;
            with.park(&dir).await;
        }
    }
    let restore_with = with.restore_ms(&tmp.path().join("out-repack")).await;
    let restore_without = without.restore_ms(&tmp.path().join("out-whole")).await;

    let mb = |b: u64| b as f64 / 1e6;
    println!(
        "{parks} parks of {mib} MiB, {:.0}% of pages changed before each (16-page runs), newest snapshot kept, gc after each park; 4 MiB packs",
        change * 100.0
    );
    println!(
        "{:<42} | {:>22} | {:>22} | ratio",
        "measure",
        format!("repack below {below}"),
        "no repack (baseline)"
    );
    println!("{}", "-".repeat(100));
    let rows = [
        (
            "pack bytes stored at the end (MB)",
            mb(with.stored),
            mb(without.stored),
        ),
        (
            "of which the snapshot uses (MB)",
            mb(with.used),
            mb(without.used),
        ),
        (
            "most pack bytes stored (MB)",
            mb(with.most_stored),
            mb(without.most_stored),
        ),
        (
            "gc per park, p50 (ms)",
            percentile(&with.gc_ms, 0.5),
            percentile(&without.gc_ms, 0.5),
        ),
        (
            "gc per park, max (ms)",
            percentile(&with.gc_ms, 1.0),
            percentile(&without.gc_ms, 1.0),
        ),
        (
            "restore of the last snapshot (ms)",
            restore_with,
            restore_without,
        ),
    ];
    for (name, a, b) in rows {
        println!("{name:<42} | {a:>22.1} | {b:>22.1} | {:.2}", a / b);
    }
    println!(
        "repacked: {} sparse packs, {:.1} MB copied over {parks} collections",
        with.repacked,
        mb(with.rewritten)
    );
    println!(
        "{{\"bench\":\"repack\",\"mib\":{mib},\"parks\":{parks},\"change\":{change},\"repack_below\":{below},\
\"stored_bytes\":{},\"stored_bytes_baseline\":{},\"used_bytes\":{},\"used_bytes_baseline\":{},\
\"most_stored_bytes\":{},\"most_stored_bytes_baseline\":{},\"stored_ratio\":{:.4},\
\"gc_p50_ms\":{:.1},\"gc_max_ms\":{:.1},\"gc_p50_ms_baseline\":{:.1},\"gc_max_ms_baseline\":{:.1},\
\"restore_ms\":{:.1},\"restore_ms_baseline\":{:.1},\"packs_repacked\":{},\"repack_bytes_written\":{}}}",
        with.stored,
        without.stored,
        with.used,
        without.used,
        with.most_stored,
        without.most_stored,
        with.stored as f64 / without.stored as f64,
        percentile(&with.gc_ms, 0.5),
        percentile(&with.gc_ms, 1.0),
        percentile(&without.gc_ms, 0.5),
        percentile(&without.gc_ms, 1.0),
        restore_with,
        restore_without,
        with.repacked,
        with.rewritten
    );
}
