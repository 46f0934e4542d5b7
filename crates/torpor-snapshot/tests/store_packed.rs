//! A packed store (`StoreConfig::pack_bytes`) end to end on the local-directory backend: few
//! objects written and few reads per restore, deduplication (parent, other snapshots, another
//! process's packs, loose chunks of an older store), garbage collection of packs, a catalog
//! gone stale under another process's collector, corruption, encryption.

mod common;

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use common::*;
use torpor_snapshot::backend::{Backend, BackendError, LocalBackend, ObjectInfo, ObjectKey};
use torpor_snapshot::gvisor::encode_compressed_image;
use torpor_snapshot::store::LABEL_SANDBOX;
use torpor_snapshot::{GcOptions, PutOptions, Store, StoreConfig, TenantKey};

/// Counts what a store asks of its backend; while `held`, ranged reads wait (`entered`
/// says one does) until `gate` is closed.
#[derive(Debug)]
struct Counting {
    inner: Arc<dyn Backend>,
    puts: AtomicUsize,
    reads: AtomicUsize,
    manifest_reads: AtomicUsize,
    held: std::sync::atomic::AtomicBool,
    entered: tokio::sync::Notify,
    gate: tokio::sync::Semaphore,
}

impl Counting {
    fn new(dir: &Path) -> Arc<Counting> {
        Arc::new(Counting {
            inner: Arc::new(LocalBackend::open(dir).unwrap()),
            puts: AtomicUsize::new(0),
            reads: AtomicUsize::new(0),
            manifest_reads: AtomicUsize::new(0),
            held: false.into(),
            entered: tokio::sync::Notify::new(),
            gate: tokio::sync::Semaphore::new(0),
        })
    }

    fn take(&self) -> (usize, usize) {
        (
            self.puts.swap(0, Ordering::SeqCst),
            self.reads.swap(0, Ordering::SeqCst),
        )
    }
}

#[async_trait]
impl Backend for Counting {
    async fn put(&self, key: &ObjectKey, data: Bytes) -> Result<(), BackendError> {
        self.puts.fetch_add(1, Ordering::SeqCst);
        self.inner.put(key, data).await
    }
    async fn put_many(&self, objects: Vec<(ObjectKey, Bytes)>) -> Result<(), BackendError> {
        self.puts.fetch_add(objects.len(), Ordering::SeqCst);
        self.inner.put_many(objects).await
    }
    async fn get(&self, key: &ObjectKey) -> Result<Option<Bytes>, BackendError> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        if key.as_str().contains("manifests/") {
            self.manifest_reads.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.get(key).await
    }
    async fn get_many(&self, keys: &[ObjectKey]) -> Result<Vec<Option<Bytes>>, BackendError> {
        self.reads.fetch_add(keys.len(), Ordering::SeqCst);
        self.inner.get_many(keys).await
    }
    async fn get_ranges(
        &self,
        key: &ObjectKey,
        ranges: &[Range<u64>],
    ) -> Result<Option<Vec<Bytes>>, BackendError> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        if self.held.load(Ordering::SeqCst) {
            self.entered.notify_one();
            // Closed when released: every held read goes on.
            let _ = self.gate.acquire().await;
        }
        self.inner.get_ranges(key, ranges).await
    }
    async fn exists_many(&self, keys: &[ObjectKey]) -> Result<Vec<bool>, BackendError> {
        self.inner.exists_many(keys).await
    }
    async fn delete(&self, key: &ObjectKey) -> Result<(), BackendError> {
        self.inner.delete(key).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, BackendError> {
        self.inner.list(prefix).await
    }
}

fn packed_cfg() -> StoreConfig {
    StoreConfig {
        pack_bytes: Some(1 << 20),
        ..StoreConfig::default()
    }
}

fn packed(dir: &Path) -> Store {
    Store::new(Arc::new(LocalBackend::open(dir).unwrap()), packed_cfg()).unwrap()
}

/// A 16 MiB memory-like gVisor image and a small text file.
fn checkpoint(dir: &Path, mem: &[u8]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("checkpoint.img"),
        encode_compressed_image(b"{}", mem, 1 << 20),
    )
    .unwrap();
    std::fs::write(dir.join("notes.txt"), b"hello\n").unwrap();
}

/// The memory a restored checkpoint holds (its text file checked on the way).
fn restored(dest: &Path) -> Vec<u8> {
    use std::io::Read;
    assert_eq!(std::fs::read(dest.join("notes.txt")).unwrap(), b"hello\n");
    let bytes = std::fs::read(dest.join("checkpoint.img")).unwrap();
    let layout = torpor_snapshot::gvisor::probe(&mut std::io::Cursor::new(&bytes))
        .unwrap()
        .unwrap();
    let mut out = Vec::new();
    torpor_snapshot::gvisor::InflatingReader::new(&bytes[layout.header.len()..], layout.frame_size)
        .read_to_end(&mut out)
        .unwrap();
    out
}

/// Objects under `area` of a local store (recursively).
fn objects(root: &Path, area: &str) -> Vec<std::path::PathBuf> {
    fn go(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd {
            let p = e.unwrap().path();
            if p.is_dir() {
                go(&p, out);
            } else {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    go(&root.join(area), &mut out);
    out.sort();
    out
}

#[tokio::test]
async fn a_packed_put_writes_a_few_objects_and_a_restore_reads_a_few_ranges() {
    let t = tempfile::tempdir().unwrap();
    let (src, root) = (t.path().join("ckpt"), t.path().join("store"));
    let mem = memory_like(11, 4096);
    checkpoint(&src, &mem);
    let backend = Counting::new(&root);
    let s = Store::new(backend.clone(), packed_cfg()).unwrap();
    let put = s.put_dir(&src, None).await.unwrap();
    let (puts, _) = backend.take();
    assert!(put.stats.chunks_new > 300, "{:?}", put.stats);
    assert!(
        objects(&root, "chunks").is_empty(),
        "no chunk is its own object"
    );
    let packs = objects(&root, "packs");
    assert_eq!(packs.len(), objects(&root, "packidx").len());
    let stored: u64 = packs
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    // Packs of ~1 MiB: as many as the stored bytes need, give or take the last one.
    assert!(
        packs.len() as u64 <= stored / (1 << 20) + 1,
        "{} packs for {stored} bytes",
        packs.len()
    );
    // Pack + index each, the manifest and the lock objects: not one per chunk.
    assert!(puts <= 2 * packs.len() + 4, "{puts} puts");

    let m = s.load_manifest(&put.id).await.unwrap();
    assert_eq!(m.packs.len() as u64, put.stats.chunks_new);
    let dest = t.path().join("out");
    let got = s.get_dir(&put.id, &dest).await.unwrap();
    let (_, reads) = backend.take();
    assert!(restored(&dest) == mem);
    // A ranged read per run of 64 chunks (two where a run crosses into the next pack), and
    // the manifest: not one per chunk.
    assert!(
        reads as u64 <= 2 * (got.chunks_fetched / 64 + 2) + 1,
        "{reads} reads for {} chunks",
        got.chunks_fetched
    );
    assert!(s.verify(&put.id).await.unwrap().problems.is_empty());

    let stats = s.stats().await.unwrap();
    assert_eq!(stats.chunks, put.stats.chunks_new);
    assert_eq!(stats.stored_bytes, stored);
}

#[tokio::test]
async fn packed_puts_deduplicate_against_parents_other_snapshots_other_processes_and_loose_chunks()
{
    let t = tempfile::tempdir().unwrap();
    let (src, root) = (t.path().join("ckpt"), t.path().join("store"));
    let mut mem = memory_like(12, 2048);
    checkpoint(&src, &mem);
    let s = packed(&root);
    let first = s
        .put_dir_with(
            &src,
            PutOptions {
                labels: vec![(LABEL_SANDBOX.into(), "sb-1".into())],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let packs = objects(&root, "packs").len();

    // The same content without a parent: found through this process's catalog.
    let again = s.put_dir(&src, None).await.unwrap();
    assert_eq!(again.stats.chunks_new, 0, "{:?}", again.stats);
    // And through another process's (a store opened afresh reads the indexes).
    let other = packed(&root).put_dir(&src, None).await.unwrap();
    assert_eq!(other.stats.chunks_new, 0, "{:?}", other.stats);
    assert_eq!(objects(&root, "packs").len(), packs, "no new pack");

    // A small change with the parent: little written, restored exactly.
    for i in 0..20 {
        let off = i * mem.len() / 20 + 99;
        let patch = noise(200 + i as u64, mem.len() / 400);
        mem[off..off + patch.len()].copy_from_slice(&patch);
    }
    checkpoint(&src, &mem);
    let second = s.put_dir(&src, Some(&first.id)).await.unwrap();
    // As little as a store of loose chunks writes for the same change (plus an index).
    let t_loose = tempfile::tempdir().unwrap();
    let loose = Store::new(
        Arc::new(LocalBackend::open(t_loose.path()).unwrap()),
        StoreConfig::default(),
    )
    .unwrap();
    let src0 = t_loose.path().join("ckpt0");
    checkpoint(&src0, &memory_like(12, 2048));
    let loose_first = loose.put_dir(&src0, None).await.unwrap();
    let loose_second = loose.put_dir(&src, Some(&loose_first.id)).await.unwrap();
    assert_eq!(second.stats.chunks_new, loose_second.stats.chunks_new);
    let blobs = |p: &torpor_snapshot::PutStats| p.bytes_written - p.manifest_bytes;
    assert!(
        blobs(&second.stats) <= blobs(&loose_second.stats) + 44 * second.stats.chunks_new + 64,
        "packed {:?} vs loose {:?}",
        second.stats,
        loose_second.stats
    );
    let ratio = second.stats.bytes_written as f64 / first.stats.bytes_written as f64;
    assert!(ratio <= 0.25, "incremental wrote {ratio:.3} of a full put");
    let dest = t.path().join("out");
    s.get_dir(&second.id, &dest).await.unwrap();
    assert!(restored(&dest) == mem);

    // A store that held loose chunks, now packed: its parent's loose chunks are reused.
    let t2 = tempfile::tempdir().unwrap();
    let root2 = t2.path().join("store");
    let loose = Store::new(
        Arc::new(LocalBackend::open(&root2).unwrap()),
        StoreConfig::default(),
    )
    .unwrap();
    let old = loose.put_dir(&src, None).await.unwrap();
    let now = packed(&root2).put_dir(&src, Some(&old.id)).await.unwrap();
    assert_eq!(now.stats.chunks_new, 0, "{:?}", now.stats);
    let m = loose.load_manifest(&now.id).await.unwrap();
    assert!(m.packs.is_empty(), "loose chunks stay loose");
    let dest2 = t2.path().join("out");
    packed(&root2).get_dir(&now.id, &dest2).await.unwrap();
    assert!(restored(&dest2) == mem);
}

#[tokio::test]
async fn gc_keeps_the_packs_a_snapshot_uses_and_removes_the_rest() {
    let t = tempfile::tempdir().unwrap();
    let (src, root) = (t.path().join("ckpt"), t.path().join("store"));
    let mut mem = memory_like(13, 2048);
    checkpoint(&src, &mem);
    let s = packed(&root);
    let a = s.put_dir(&src, None).await.unwrap();
    mem[..65536].copy_from_slice(&noise(5, 65536));
    checkpoint(&src, &mem);
    let b = s.put_dir(&src, Some(&a.id)).await.unwrap();
    // An orphan: a pack (and index) of a put that never wrote its manifest.
    let orphan = root.join("packs/00").join("00".repeat(32));
    std::fs::create_dir_all(orphan.parent().unwrap()).unwrap();
    std::fs::write(&orphan, b"junk").unwrap();

    s.delete_snapshot(&a.id).await.unwrap();
    let report = s.gc(&GcOptions::default()).await.unwrap();
    assert_eq!(report.packs_removed, 1, "{report:?}");
    assert!(!orphan.exists());
    assert!(report.packs_live >= 1);
    assert!(report.pack_bytes_used <= report.pack_bytes_live);
    // b still restores: every pack it locates a chunk in was kept.
    let dest = t.path().join("out");
    s.get_dir(&b.id, &dest).await.unwrap();
    assert!(restored(&dest) == mem);

    s.delete_snapshot(&b.id).await.unwrap();
    let report = s.gc(&GcOptions::default()).await.unwrap();
    assert_eq!(report.packs_live, 0);
    assert!(report.packs_removed >= 1);
    assert!(objects(&root, "packs").is_empty());
    assert!(objects(&root, "packidx").is_empty());
}

#[tokio::test]
async fn a_catalog_gone_stale_under_another_collector_never_loses_a_chunk() {
    let t = tempfile::tempdir().unwrap();
    let (src, root) = (t.path().join("ckpt"), t.path().join("store"));
    let mem = memory_like(14, 1024);
    checkpoint(&src, &mem);
    let mine = packed(&root);
    let a = mine.put_dir(&src, None).await.unwrap();
    // Another process deletes the snapshot and collects: every pack goes.
    let theirs = packed(&root);
    theirs.delete_snapshot(&a.id).await.unwrap();
    theirs.gc(&GcOptions::default()).await.unwrap();
    assert!(objects(&root, "packs").is_empty());
    // This process's catalog still lists those packs; the put checks before it trusts them.
    let b = mine.put_dir(&src, None).await.unwrap();
    assert_eq!(b.stats.chunks_new, a.stats.chunks_new, "{:?}", b.stats);
    assert!(mine.verify(&b.id).await.unwrap().problems.is_empty());
    let dest = t.path().join("out");
    mine.get_dir(&b.id, &dest).await.unwrap();
    assert!(restored(&dest) == mem);
}

#[tokio::test]
async fn a_corrupt_truncated_or_missing_pack_fails_the_restore_by_name() {
    let t = tempfile::tempdir().unwrap();
    let (src, root) = (t.path().join("ckpt"), t.path().join("store"));
    checkpoint(&src, &memory_like(15, 1024));
    let s = packed(&root);
    let put = s.put_dir(&src, None).await.unwrap();
    let pack = objects(&root, "packs")[0].clone();
    let good = std::fs::read(&pack).unwrap();
    let dest = t.path().join("out");

    let mut bad = good.clone();
    bad[good.len() / 2] ^= 0x40;
    std::fs::write(&pack, &bad).unwrap();
    let err = s.get_dir(&put.id, &dest).await.unwrap_err();
    assert_eq!(err.code(), "chunk_corrupt", "{err}");
    assert!(err.to_string().contains(put.id.as_str()), "{err}");
    assert!(!dest.exists());
    let report = s.verify(&put.id).await.unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);

    std::fs::write(&pack, &good[..good.len() / 2]).unwrap();
    let err = s.get_dir(&put.id, &dest).await.unwrap_err();
    assert_eq!(err.code(), "chunk_corrupt", "{err}");

    std::fs::remove_file(&pack).unwrap();
    let err = s.get_dir(&put.id, &dest).await.unwrap_err();
    assert_eq!(err.code(), "chunk_missing", "{err}");
    assert!(!dest.exists());
}

#[tokio::test]
async fn encrypted_tenants_pack_under_their_namespace() {
    let t = tempfile::tempdir().unwrap();
    let (src, root) = (t.path().join("ckpt"), t.path().join("store"));
    let mem = memory_like(16, 512);
    checkpoint(&src, &mem);
    let backend: Arc<dyn Backend> = Arc::new(LocalBackend::open(&root).unwrap());
    let tenant = |name: &str, key: u8| {
        Store::new(
            backend.clone(),
            StoreConfig {
                key: Some(TenantKey::from_bytes([key; 32])),
                namespace: Some(name.into()),
                ..packed_cfg()
            },
        )
        .unwrap()
    };
    let (a, b) = (tenant("a", 1), tenant("b", 2));
    let pa = a.put_dir(&src, None).await.unwrap();
    let pb = b.put_dir(&src, None).await.unwrap();
    // Same content, different keys: nothing shared, each in its own namespace.
    assert_eq!(pb.stats.chunks_new, pa.stats.chunks_new);
    assert!(!objects(&root, "tenants/a/packs").is_empty());
    assert!(!objects(&root, "tenants/b/packs").is_empty());
    assert!(objects(&root, "packs").is_empty());
    let pack = std::fs::read(&objects(&root, "tenants/a/packs")[0]).unwrap();
    assert!(
        !pack.windows(6).any(|w| w == b"hello\n"),
        "plaintext in a pack"
    );
    let dest = t.path().join("out");
    a.get_dir(&pa.id, &dest).await.unwrap();
    assert!(restored(&dest) == mem);
    // b's manifest does not open with a's key.
    assert!(a.get_dir(&pb.id, &t.path().join("x")).await.is_err());
}

#[tokio::test]
async fn a_forged_index_can_make_a_snapshot_unrestorable_but_never_wrong() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("store");
    let (a_src, b_src) = (t.path().join("a"), t.path().join("b"));
    checkpoint(&a_src, &memory_like(17, 512));
    let b_mem = memory_like(18, 512);
    checkpoint(&b_src, &b_mem);
    packed(&root).put_dir(&a_src, None).await.unwrap();
    // Whoever else writes the store claims b's chunks lie in a's pack.
    let scratch = packed(&t.path().join("scratch"));
    let b_chunks = scratch
        .load_manifest(&scratch.put_dir(&b_src, None).await.unwrap().id)
        .await
        .unwrap()
        .packs;
    let pack = objects(&root, "packs")[0].clone();
    let pack_hex = pack.file_name().unwrap().to_str().unwrap().to_string();
    let forged: Vec<_> = b_chunks
        .iter()
        .map(|(c, l)| (*c, 0, l.len.min(100)))
        .collect();
    let forged_pack = torpor_snapshot::PackId::of(b"forged");
    let index = root
        .join("packidx")
        .join(&forged_pack.to_hex()[..2])
        .join(forged_pack.to_hex());
    std::fs::create_dir_all(index.parent().unwrap()).unwrap();
    std::fs::write(&index, torpor_snapshot::pack::encode_index(&forged)).unwrap();
    // Pointing at a pack that is there: a copy of a's, under the forged id.
    let forged_path = root
        .join("packs")
        .join(&forged_pack.to_hex()[..2])
        .join(forged_pack.to_hex());
    std::fs::create_dir_all(forged_path.parent().unwrap()).unwrap();
    std::fs::copy(
        root.join("packs").join(&pack_hex[..2]).join(&pack_hex),
        &forged_path,
    )
    .unwrap();

    // A fresh process reads the indexes and deduplicates against the forgery...
    let s = packed(&root);
    let b = s.put_dir(&b_src, None).await.unwrap();
    assert!(b.stats.chunks_reused > 0, "{:?}", b.stats);
    // ...and the restore refuses the wrong bytes by name, leaving nothing behind.
    let dest = t.path().join("out");
    let err = s.get_dir(&b.id, &dest).await.unwrap_err();
    assert_eq!(err.code(), "chunk_corrupt", "{err}");
    assert!(!dest.exists());
    assert!(!s.verify(&b.id).await.unwrap().problems.is_empty());
}

#[tokio::test]
async fn a_restore_teaches_the_catalog_so_the_next_put_of_that_sandbox_stores_only_what_changed() {
    let t = tempfile::tempdir().unwrap();
    let (src, root) = (t.path().join("ckpt"), t.path().join("store"));
    let mut mem = memory_like(19, 1024);
    checkpoint(&src, &mem);
    let first = packed(&root).put_dir(&src, None).await.unwrap();
    // Another process (a worker the sandbox wakes on) whose catalog has just listed the store
    // and found nothing, so only what it restores can teach it.
    let catalog = Arc::new(torpor_snapshot::PackCatalog::default());
    catalog.listed(&Default::default());
    let other = packed(&root).with_catalog(catalog.clone());
    other
        .get_dir(&first.id, &t.path().join("woken"))
        .await
        .unwrap();
    // The sandbox changes a little and parks again there, without naming a parent.
    mem[..65536].copy_from_slice(&noise(9, 65536));
    checkpoint(&src, &mem);
    let second = other.put_dir(&src, None).await.unwrap();
    assert!(
        second.stats.chunks_new * 10 < first.stats.chunks_new,
        "{:?} after {:?}",
        second.stats,
        first.stats
    );
    let dest = t.path().join("out");
    other.get_dir(&second.id, &dest).await.unwrap();
    assert!(restored(&dest) == mem);
}

/// A packed store where snapshot `a` was deleted after `b` reused about half of its chunks,
/// scattered (every other 32 KiB of memory changed): `a`'s packs are left half used. Returns
/// `b`'s id and memory.
async fn half_used_packs(s: &Store, src: &Path) -> (torpor_snapshot::SnapshotId, Vec<u8>) {
    let mut mem = memory_like(20, 2048);
    checkpoint(src, &mem);
    let a = s.put_dir(src, None).await.unwrap();
    for (i, block) in mem
        .chunks_mut(32 << 10)
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
    {
        block.copy_from_slice(&noise(100 + i as u64, block.len()));
    }
    checkpoint(src, &mem);
    let b = s.put_dir(src, Some(&a.id)).await.unwrap();
    assert!(
        b.stats.chunks_reused > 0 && b.stats.chunks_new > 0,
        "{:?}",
        b.stats
    );
    s.delete_snapshot(&a.id).await.unwrap();
    (b.id, mem)
}

fn repack(below: f64, dry_run: bool) -> GcOptions {
    GcOptions {
        repack_below: Some(below),
        dry_run,
        ..GcOptions::default()
    }
}

#[tokio::test]
async fn gc_repacks_sparse_packs_and_every_snapshot_still_restores_plain_or_encrypted() {
    for key in [None, Some(TenantKey::from_bytes([3; 32]))] {
        let t = tempfile::tempdir().unwrap();
        let (src, root) = (t.path().join("ckpt"), t.path().join("store"));
        let cfg = || StoreConfig {
            key: key.clone(),
            ..packed_cfg()
        };
        let s = Store::new(Arc::new(LocalBackend::open(&root).unwrap()), cfg()).unwrap();
        let (b, mem) = half_used_packs(&s, &src).await;

        // A dry run says what it would do and changes nothing.
        let before = (objects(&root, "packs"), objects(&root, "manifests"));
        let dry = s.gc(&repack(0.75, true)).await.unwrap();
        assert!(dry.packs_repacked > 0, "{dry:?}");
        assert!(dry.repack_bytes_written > 0, "{dry:?}");
        assert_eq!(dry.manifests_rewritten, 0, "{dry:?}");
        assert!(
            dry.pack_bytes_used * 4 < dry.pack_bytes_live * 3,
            "half-used packs: {dry:?}"
        );
        assert_eq!(
            (objects(&root, "packs"), objects(&root, "manifests")),
            before
        );
        let manifest_before = std::fs::read(&before.1[0]).unwrap();

        let report = s.gc(&repack(0.75, false)).await.unwrap();
        assert_eq!(report.packs_repacked, dry.packs_repacked, "{report:?}");
        assert!(report.repack_packs_written > 0, "{report:?}");
        assert_eq!(report.manifests_rewritten, 1, "{report:?}");
        assert!(report.packs_removed >= report.packs_repacked, "{report:?}");
        assert!(
            report.bytes_freed > report.repack_bytes_written,
            "space reclaimed: {report:?}"
        );
        // Every live pack is now used whole, and the manifest moved to the new packs.
        assert_eq!(report.pack_bytes_used, report.pack_bytes_live, "{report:?}");
        assert_ne!(std::fs::read(&before.1[0]).unwrap(), manifest_before);
        assert!(s.verify(&b).await.unwrap().problems.is_empty());
        for (name, store) in [
            ("this process", s.clone()),
            (
                "a fresh process",
                Store::new(Arc::new(LocalBackend::open(&root).unwrap()), cfg()).unwrap(),
            ),
        ] {
            let dest = t.path().join(format!("out-{}", name.len()));
            store.get_dir(&b, &dest).await.unwrap();
            assert!(restored(&dest) == mem, "{name}");
        }
        // Nothing sparse is left, and a put after the repack still deduplicates against it.
        let again = s.gc(&repack(0.75, false)).await.unwrap();
        assert_eq!(again.packs_repacked, 0, "{again:?}");
        let c = s.put_dir(&src, None).await.unwrap();
        assert_eq!(c.stats.chunks_new, 0, "{:?}", c.stats);
    }
}

/// Puts that change a page or two each leave one small pack apiece (their new chunks are
/// well under a quarter of the 1 MiB pack size). A collection that merges small packs copies
/// them into one; every snapshot still verifies and restores, in this process and in a fresh
/// one, the store holds fewer packs, and the next collection finds nothing to merge.
#[tokio::test]
async fn gc_merges_small_packs_and_every_snapshot_still_restores() {
    let t = tempfile::tempdir().unwrap();
    let (src, root) = (t.path().join("ckpt"), t.path().join("store"));
    let s = packed(&root);
    let mut mem = memory_like(21, 1024);
    let mut snaps = Vec::new();
    let mut parent: Option<torpor_snapshot::SnapshotId> = None;
    for round in 0..6u64 {
        let page = (round as usize * 131 + 7) % 1024;
        mem[page * 4096..(page + 1) * 4096].copy_from_slice(&noise(700 + round, 4096));
        checkpoint(&src, &mem);
        let put = s.put_dir(&src, parent.as_ref()).await.unwrap();
        parent = Some(put.id.clone());
        snaps.push((put.id, mem.clone()));
    }
    let merge = GcOptions {
        merge_small: true,
        ..GcOptions::default()
    };
    let dry = s
        .gc(&GcOptions {
            dry_run: true,
            ..merge.clone()
        })
        .await
        .unwrap();
    assert!(
        dry.packs_repacked >= 5,
        "one small pack per later put: {dry:?}"
    );
    let packs_before = objects(&root, "packs").len();
    let report = s.gc(&merge).await.unwrap();
    assert_eq!(report.packs_repacked, dry.packs_repacked, "{report:?}");
    assert_eq!(
        report.repack_packs_written, 1,
        "merged into one: {report:?}"
    );
    assert_eq!(
        report.packs_live,
        dry.packs_live - report.packs_repacked + 1,
        "{report:?}"
    );
    assert!(objects(&root, "packs").len() < packs_before);
    let fresh = packed(&root);
    for (i, (id, want)) in snaps.iter().enumerate() {
        assert!(s.verify(id).await.unwrap().problems.is_empty(), "{i}");
        let dest = t.path().join(format!("out-{i}"));
        fresh.get_dir(id, &dest).await.unwrap();
        assert!(restored(&dest) == *want, "snapshot {i}");
    }
    let again = s.gc(&merge).await.unwrap();
    assert_eq!(again.packs_repacked, 0, "{again:?}");
}

#[tokio::test]
async fn a_restore_that_read_its_manifest_before_a_repack_reads_it_again_and_restores() {
    let t = tempfile::tempdir().unwrap();
    let (src, root) = (t.path().join("ckpt"), t.path().join("store"));
    let s = packed(&root);
    let (b, mem) = half_used_packs(&s, &src).await;
    let held = Counting::new(&root);
    held.held.store(true, Ordering::SeqCst);
    let reader = Store::new(held.clone(), packed_cfg()).unwrap();
    let dest = t.path().join("out");
    let restore = tokio::spawn({
        let (b, dest) = (b.clone(), dest.clone());
        async move { reader.get_dir(&b, &dest).await }
    });
    // The restore has its manifest and is about to read packs: another process repacks.
    held.entered.notified().await;
    let report = s.gc(&repack(0.75, false)).await.unwrap();
    assert!(report.packs_repacked > 0, "{report:?}");
    held.held.store(false, Ordering::SeqCst);
    held.gate.close();
    restore.await.unwrap().unwrap();
    assert!(restored(&dest) == mem);
    assert_eq!(
        held.manifest_reads.load(Ordering::SeqCst),
        2,
        "the manifest was read again after the old packs were gone"
    );
}

#[tokio::test]
async fn a_sparse_pack_with_a_corrupt_chunk_is_left_as_it_is_and_named_by_verify() {
    let t = tempfile::tempdir().unwrap();
    let (src, root) = (t.path().join("ckpt"), t.path().join("store"));
    let s = packed(&root);
    let (b, _) = half_used_packs(&s, &src).await;
    let dry = s.gc(&repack(0.75, true)).await.unwrap();
    assert!(dry.packs_repacked >= 2, "{dry:?}");
    // Corrupt a chunk of b's in the first of its packs (the deleted snapshot's).
    let m = s.load_manifest(&b).await.unwrap();
    let first_pack = objects(&root, "packs")
        .into_iter()
        .find(|p| {
            let hex = p.file_name().unwrap().to_str().unwrap();
            m.packs.values().filter(|l| l.pack.to_hex() == hex).count() > 1
                && std::fs::metadata(p).unwrap().len()
                    > m.packs
                        .values()
                        .filter(|l| l.pack.to_hex() == hex)
                        .map(|l| u64::from(l.len))
                        .sum::<u64>()
                        * 4
                        / 3
        })
        .expect("a half-used pack");
    let hex = first_pack
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let loc = m.packs.values().find(|l| l.pack.to_hex() == hex).unwrap();
    let mut bytes = std::fs::read(&first_pack).unwrap();
    bytes[(loc.offset + u64::from(loc.len) / 2) as usize] ^= 0x10;
    std::fs::write(&first_pack, &bytes).unwrap();

    let report = s.gc(&repack(0.75, false)).await.unwrap();
    assert_eq!(report.packs_repacked, dry.packs_repacked - 1, "{report:?}");
    assert!(
        first_pack.exists(),
        "the corrupt pack is kept for verify to name"
    );
    let problems = s.verify(&b).await.unwrap().problems;
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].code(), "chunk_corrupt");
}
