//! The store end to end on the local-directory backend: round trips, deduplication,
//! incremental puts, corruption, faults, forks, garbage collection, encryption and the cache.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use torpor_snapshot::backend::{Backend, LocalBackend};
use torpor_snapshot::gvisor::encode_compressed_image;
use torpor_snapshot::store::LABEL_SANDBOX;
use torpor_snapshot::{
    ChunkCache, GcOptions, PutOptions, SnapshotId, Store, StoreConfig, StoreError, TenantKey,
};

fn local(dir: &Path) -> Arc<dyn Backend> {
    Arc::new(LocalBackend::open(dir).unwrap())
}

fn store(dir: &Path) -> Store {
    Store::new(local(dir), StoreConfig::default()).unwrap()
}

/// A checkpoint-like directory: a gVisor image, a sparse file, text, a symlink, a subdir.
fn make_checkpoint(dir: &Path, seed: u64) -> Vec<u8> {
    std::fs::create_dir_all(dir.join("fs/etc")).unwrap();
    let stream = memory_like(seed, 1024); // 4 MiB inflated
    let img = encode_compressed_image(b"{\"k\":\"v\"}", &stream, 1 << 20);
    std::fs::write(dir.join("checkpoint.img"), &img).unwrap();
    let f = std::fs::File::create(dir.join("fs/sparse.bin")).unwrap();
    f.set_len(8 << 20).unwrap();
    use std::io::{Seek, SeekFrom, Write};
    let mut f = f;
    f.seek(SeekFrom::Start(3 << 20)).unwrap();
    f.write_all(&noise(seed, 100_000)).unwrap();
    std::fs::write(dir.join("fs/etc/hosts"), b"127.0.0.1 localhost\n").unwrap();
    std::fs::write(dir.join("fs/empty"), b"").unwrap();
    std::fs::set_permissions(
        dir.join("fs/etc/hosts"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    std::os::unix::fs::symlink("etc/hosts", dir.join("fs/hosts-link")).unwrap();
    stream
}

fn inflated(img_path: &Path) -> Vec<u8> {
    use std::io::Read;
    let mut f = std::fs::File::open(img_path).unwrap();
    let layout = torpor_snapshot::gvisor::probe(&mut f).unwrap().unwrap();
    let bytes = std::fs::read(img_path).unwrap();
    let mut r = torpor_snapshot::gvisor::InflatingReader::new(
        &bytes[layout.header.len()..],
        layout.frame_size,
    );
    let mut out = Vec::new();
    r.read_to_end(&mut out).unwrap();
    out
}

#[tokio::test]
async fn round_trip_restores_every_file_and_reencodes_the_image_stored() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("ckpt");
    let stream = make_checkpoint(&src, 1);
    let s = store(&t.path().join("store"));
    let put = s.put_dir(&src, None).await.unwrap();
    assert_eq!(put.stats.images, 1);
    assert_eq!(put.stats.image_fallbacks, 0);
    assert!(
        put.stats.zero_bytes >= 7 << 20,
        "sparse file's zeros not stored"
    );
    assert_eq!(
        put.stats.chunks_total,
        put.stats.chunks_new + put.stats.chunks_reused
    );

    let dest = t.path().join("restored");
    let got = s.get_dir(&put.id, &dest).await.unwrap();
    assert_eq!(got.logical_bytes, put.stats.logical_bytes);

    let before = tree(&src);
    let after = tree(&dest);
    assert_eq!(before.len(), after.len());
    for (b, a) in before.iter().zip(&after) {
        assert_eq!((&b.0, &b.1), (&a.0, &a.1));
        if b.0 != "checkpoint.img" {
            assert!(b.2 == a.2, "content of {} differs", b.0);
        }
    }
    // The image comes back as stored deflate: same header, same inflated stream.
    assert_eq!(inflated(&dest.join("checkpoint.img")), stream);
    let orig = std::fs::read(src.join("checkpoint.img")).unwrap();
    let back = std::fs::read(dest.join("checkpoint.img")).unwrap();
    let hdr = 8 + 8 + 9 + 32 + 4;
    assert_eq!(orig[..hdr], back[..hdr]);
    // Holes stay holes.
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(dest.join("fs/sparse.bin")).unwrap();
    assert!(m.blocks() * 512 < 1 << 20, "zero runs restored as holes");

    let again = s.put_dir(&src, None).await.unwrap();
    assert_eq!(
        again.stats.chunks_new, 0,
        "identical content stores nothing new"
    );
    assert_eq!(
        again.stats.bytes_written, again.stats.manifest_bytes,
        "only the manifest is written"
    );
}

#[tokio::test]
async fn unknown_image_versions_fall_back_to_opaque() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("ckpt");
    std::fs::create_dir_all(&src).unwrap();
    let mut img = encode_compressed_image(b"{}", &memory_like(3, 300), 1 << 20);
    // Frame structure intact, deflate payload garbled: probe accepts it, inflation fails.
    let at = 8 + 8 + 2 + 32 + 4 + 4;
    img[at] = 0xff;
    img[at + 1] = 0xff;
    std::fs::write(src.join("checkpoint.img"), &img).unwrap();
    std::fs::write(src.join("other.bin"), b"gVisorSF but not really").unwrap();
    let s = store(&t.path().join("store"));
    let put = s.put_dir(&src, None).await.unwrap();
    assert_eq!(put.stats.images, 0);
    assert_eq!(put.stats.image_fallbacks, 1);
    let dest = t.path().join("out");
    s.get_dir(&put.id, &dest).await.unwrap();
    assert_eq!(std::fs::read(dest.join("checkpoint.img")).unwrap(), img);
    assert_eq!(
        std::fs::read(dest.join("other.bin")).unwrap(),
        b"gVisorSF but not really"
    );
}

#[tokio::test]
async fn incremental_put_after_small_change_writes_little() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("ckpt");
    std::fs::create_dir_all(&src).unwrap();
    let mut mem = memory_like(7, 8192); // 32 MiB
    let img = encode_compressed_image(b"{}", &mem, 1 << 20);
    std::fs::write(src.join("checkpoint.img"), &img).unwrap();
    let s = store(&t.path().join("store"));
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
    // Change ~5% of memory in 20 places.
    for i in 0..20 {
        let off = i * mem.len() / 20 + 1234;
        let patch = noise(100 + i as u64, mem.len() / 400);
        mem[off..off + patch.len()].copy_from_slice(&patch);
    }
    std::fs::write(
        src.join("checkpoint.img"),
        encode_compressed_image(b"{}", &mem, 1 << 20),
    )
    .unwrap();
    let second = s.put_dir(&src, Some(&first.id)).await.unwrap();
    let ratio = second.stats.bytes_written as f64 / first.stats.bytes_written as f64;
    assert!(
        ratio <= 0.15,
        "incremental wrote {ratio:.3} of a full put ({} vs {})",
        second.stats.bytes_written,
        first.stats.bytes_written
    );
    let m = s.load_manifest(&second.id).await.unwrap();
    assert_eq!(m.parent.as_ref(), Some(&first.id));
    let dest = t.path().join("out");
    s.get_dir(&second.id, &dest).await.unwrap();
    assert_eq!(inflated(&dest.join("checkpoint.img")), mem);

    let missing = SnapshotId::new("nope").unwrap();
    let err = s.put_dir(&src, Some(&missing)).await.unwrap_err();
    assert_eq!(err.code(), "parent_not_found");
}

fn chunk_files(root: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for d in std::fs::read_dir(root.join("chunks")).unwrap() {
        for f in std::fs::read_dir(d.unwrap().path()).unwrap() {
            out.push(f.unwrap().path());
        }
    }
    out.sort();
    out
}

#[tokio::test]
async fn corrupt_or_missing_chunks_fail_the_restore_by_name_and_leave_nothing() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("ckpt");
    make_checkpoint(&src, 2);
    let root = t.path().join("store");
    let s = store(&root);
    let put = s.put_dir(&src, None).await.unwrap();
    let chunks = chunk_files(&root);
    assert!(chunks.len() > 3);

    // Flip one byte in the middle of a chunk blob.
    let victim = &chunks[1];
    let mut blob = std::fs::read(victim).unwrap();
    let mid = blob.len() / 2;
    blob[mid] ^= 0x40;
    std::fs::write(victim, &blob).unwrap();
    let dest = t.path().join("out");
    let err = s.get_dir(&put.id, &dest).await.unwrap_err();
    assert_eq!(err.code(), "chunk_corrupt", "{err}");
    let msg = err.to_string();
    let victim_name = victim.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        msg.contains(put.id.as_str()) && msg.contains(&victim_name),
        "{msg}"
    );
    assert!(!dest.exists(), "nothing is left at the destination");
    assert_eq!(
        std::fs::read_dir(t.path())
            .unwrap()
            .filter(|e| e
                .as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .contains("restore"))
            .count(),
        0,
        "temporary restore directory removed"
    );
    let report = s.verify(&put.id).await.unwrap();
    assert_eq!(report.problems.len(), 1);
    assert_eq!(report.problems[0].code(), "chunk_corrupt");

    std::fs::remove_file(victim).unwrap();
    let err = s.get_dir(&put.id, &dest).await.unwrap_err();
    assert_eq!(err.code(), "chunk_missing", "{err}");
    assert!(err.to_string().contains(&victim_name));
    assert!(
        std::fs::read_dir(root.join("manifests")).unwrap().count() == 1,
        "nothing deleted"
    );

    // A garbled manifest is refused with its own code.
    let mpath = root.join("manifests").join(put.id.as_str());
    let mut m = std::fs::read(&mpath).unwrap();
    m[30] ^= 1;
    std::fs::write(&mpath, &m).unwrap();
    let err = s.get_dir(&put.id, &dest).await.unwrap_err();
    assert_eq!(err.code(), "manifest_invalid");
    std::fs::write(&mpath, &m[..m.len() / 2]).unwrap();
    assert_eq!(
        s.get_dir(&put.id, &dest).await.unwrap_err().code(),
        "manifest_invalid"
    );
}

#[tokio::test]
async fn failed_put_leaves_previous_snapshot_valid_and_commits_nothing() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("ckpt");
    make_checkpoint(&src, 4);
    let faulty = Arc::new(FaultyBackend::new(local(&t.path().join("store"))));
    let s = Store::new(faulty.clone(), StoreConfig::default()).unwrap();
    let good = s.put_dir(&src, None).await.unwrap();

    std::fs::write(src.join("fs/new.bin"), noise(99, 3 << 20)).unwrap();
    faulty.fail_chunk_puts_after.store(
        faulty.chunk_puts.load(Ordering::SeqCst) + 5,
        Ordering::SeqCst,
    );
    let err = s.put_dir(&src, Some(&good.id)).await.unwrap_err();
    assert_eq!(err.code(), "backend_no_space", "{err}");
    assert_eq!(s.list_snapshots().await.unwrap(), vec![good.id.clone()]);
    let dest = t.path().join("out");
    s.get_dir(&good.id, &dest).await.unwrap();
    assert!(!dest.join("fs/new.bin").exists());
    // The failed put released its lock: a collector can run, and the good snapshot survives it.
    s.gc(&GcOptions::default()).await.unwrap();
    assert!(s.verify(&good.id).await.unwrap().problems.is_empty());
}

#[tokio::test]
async fn forks_share_chunks_and_restore_independently() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("ckpt");
    make_checkpoint(&src, 5);
    let root = t.path().join("store");
    let s = store(&root);
    let put = s.put_dir(&src, None).await.unwrap();
    let before = chunk_files(&root).len();
    let forks = s.fork(&put.id, 3).await.unwrap();
    assert_eq!(forks.len(), 3);
    assert_eq!(chunk_files(&root).len(), before, "a fork copies no chunks");
    for (i, f) in forks.iter().enumerate() {
        let m = s.load_manifest(f).await.unwrap();
        assert_eq!(m.parent.as_ref(), Some(&put.id));
        assert_eq!(m.label("forked_from"), Some(put.id.as_str()));
        let dest = t.path().join(format!("fork{i}"));
        s.get_dir(f, &dest).await.unwrap();
        assert_eq!(
            std::fs::read(dest.join("fs/etc/hosts")).unwrap(),
            b"127.0.0.1 localhost\n"
        );
    }
    assert_eq!(s.stats().await.unwrap().snapshots, 4);
}

#[tokio::test]
async fn gc_applies_retention_keeps_pins_and_sweeps_only_garbage() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("store");
    let s = store(&root);
    let mut ids = Vec::new();
    for gen in 0..4u64 {
        let src = t.path().join(format!("ckpt{gen}"));
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("mem"), noise(gen, 1 << 20)).unwrap();
        std::fs::write(src.join("shared"), noise(1000, 1 << 20)).unwrap();
        let put = s
            .put_dir_with(
                &src,
                PutOptions {
                    labels: vec![(LABEL_SANDBOX.into(), "sb-1".into())],
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        ids.push(put.id);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    s.pin(&ids[0]).await.unwrap(); // the golden one
    let stats_before = s.stats().await.unwrap();

    let dry = s
        .gc(&GcOptions {
            keep_last_per_sandbox: Some(1),
            dry_run: true,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(dry.snapshots_removed, {
        let mut v = vec![ids[1].clone(), ids[2].clone()];
        v.sort();
        v
    });
    // A snapshot a sandbox depends on is protected like a pin.
    let protected = s
        .gc(&GcOptions {
            keep_last_per_sandbox: Some(1),
            dry_run: true,
            protect: [ids[1].clone()].into_iter().collect(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(protected.snapshots_removed, vec![ids[2].clone()]);
    assert_eq!(
        s.stats().await.unwrap(),
        stats_before,
        "dry run changes nothing"
    );

    let report = s
        .gc(&GcOptions {
            keep_last_per_sandbox: Some(1),
            dry_run: false,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(report.snapshots_removed.len(), 2);
    assert!(report.chunks_removed >= 2 && report.bytes_freed >= 2 << 20);
    let mut left = s.list_snapshots().await.unwrap();
    left.sort();
    let mut expect = vec![ids[0].clone(), ids[3].clone()];
    expect.sort();
    assert_eq!(left, expect);
    for id in &expect {
        assert!(s.verify(id).await.unwrap().problems.is_empty());
    }
    assert_eq!(
        s.delete_snapshot(&ids[0]).await.unwrap_err().code(),
        "snapshot_pinned"
    );
    // Nothing left to collect.
    assert_eq!(s.gc(&GcOptions::default()).await.unwrap().chunks_removed, 0);
}

/// 2 MiB of noise to put from `t/ckpt`, and a store in `t/store` that takes 40 ms per chunk.
fn slow_put(t: &Path) -> (std::path::PathBuf, Arc<FaultyBackend>) {
    let src = t.join("ckpt");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("mem"), noise(8, 2 << 20)).unwrap();
    let mut slow = FaultyBackend::new(local(&t.join("store")));
    slow.put_delay = Duration::from_millis(40);
    (src, Arc::new(slow))
}

#[tokio::test]
async fn gc_never_collects_chunks_of_an_in_flight_put() {
    let t = tempfile::tempdir().unwrap();
    let (src, slow) = slow_put(t.path());
    let backend: Arc<dyn Backend> = slow;
    let cfg = StoreConfig {
        lock_wait: Duration::from_millis(50),
        ..StoreConfig::default()
    };
    let s = Store::new(backend, cfg).unwrap();
    let putter = {
        let s = s.clone();
        let src = src.clone();
        tokio::spawn(async move { s.put_dir(&src, None).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    // Chunks are on the backend but no manifest references them yet.
    let err = s.gc(&GcOptions::default()).await.unwrap_err();
    assert_eq!(err.code(), "store_locked", "{err}");
    let put = putter.await.unwrap().unwrap();
    let report = s.gc(&GcOptions::default()).await.unwrap();
    assert_eq!(report.chunks_removed, 0);
    assert!(s.verify(&put.id).await.unwrap().problems.is_empty());
}

/// A holder whose lock renewals fail for half the ttl commits nothing (a collector may have
/// taken it for dead), and a dead holder's lock holds collections back only until the ttl.
#[tokio::test]
async fn a_put_that_lost_its_lock_commits_nothing_and_a_dead_holder_blocks_gc_only_for_the_ttl() {
    let t = tempfile::tempdir().unwrap();
    let (src, slow) = slow_put(t.path());
    let ttl = Duration::from_millis(400);
    let cfg = StoreConfig {
        lock_ttl: ttl,
        lock_wait: Duration::from_millis(50),
        ..StoreConfig::default()
    };
    let s = Store::new(slow.clone(), cfg.clone()).unwrap();
    let putter = {
        let (s, src) = (s.clone(), src.clone());
        tokio::spawn(async move { s.put_dir(&src, None).await })
    };
    // The put holds its lock and writes chunks (40 ms each); then its renewals fail.
    while slow.list("locks").await.unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    slow.fail_lock_puts.store(true, Ordering::SeqCst);
    let err = putter.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "store_lock_lost", "{err}");
    assert!(s.list_snapshots().await.unwrap().is_empty(), "committed");
    slow.fail_lock_puts.store(false, Ordering::SeqCst);
    // Its chunks are orphans: the next collection removes them.
    let report = s.gc(&GcOptions::default()).await.unwrap();
    assert!(report.chunks_removed > 0, "{report:?}");

    // A holder killed mid-put leaves its lock object: a collection is refused while it is
    // younger than the ttl (3 s here: what a loaded machine's delays stay well under), then
    // goes ahead and removes it.
    let ttl = Duration::from_secs(3);
    let s = Store::new(
        slow.clone(),
        StoreConfig {
            lock_ttl: ttl,
            ..cfg
        },
    )
    .unwrap();
    let dead = torpor_snapshot::backend::ObjectKey::new("locks/shared-0123456789ab").unwrap();
    slow.put(&dead, bytes::Bytes::from_static(b"pid=1\n"))
        .await
        .unwrap();
    let err = s.gc(&GcOptions::default()).await.unwrap_err();
    assert_eq!(err.code(), "store_locked", "{err}");
    tokio::time::sleep(ttl + Duration::from_millis(200)).await;
    s.gc(&GcOptions::default()).await.unwrap();
    assert_eq!(
        slow.get(&dead).await.unwrap(),
        None,
        "the dead lock is removed"
    );
    // And a put that keeps renewing commits as before (the default ttl).
    let s = Store::new(slow.clone(), StoreConfig::default()).unwrap();
    let put = s.put_dir(&src, None).await.unwrap();
    assert!(s.verify(&put.id).await.unwrap().problems.is_empty());
}

#[tokio::test]
async fn encrypted_tenants_do_not_share_or_leak() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("ckpt");
    std::fs::create_dir_all(&src).unwrap();
    let secret = b"TOP-SECRET-AGENT-MEMORY ".repeat(10_000);
    std::fs::write(src.join("mem"), &secret).unwrap();
    let backend = local(&t.path().join("store"));
    let tenant = |ns: &str, k: u8| {
        Store::new(
            backend.clone(),
            StoreConfig {
                key: Some(TenantKey::from_bytes([k; 32])),
                namespace: Some(ns.into()),
                ..StoreConfig::default()
            },
        )
        .unwrap()
    };
    let a = tenant("a", 1);
    let b = tenant("b", 2);
    let pa = a.put_dir(&src, None).await.unwrap();
    let pb = b.put_dir(&src, None).await.unwrap();
    assert!(pb.stats.chunks_new > 0, "no deduplication across tenants");
    let again = a.put_dir(&src, None).await.unwrap();
    assert_eq!(again.stats.chunks_new, 0, "deduplication within a tenant");
    // No stored object holds the plaintext.
    let mut stack = vec![t.path().join("store")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let bytes = std::fs::read(&p).unwrap();
                assert!(!bytes.windows(10).any(|w| w == b"TOP-SECRET"), "{p:?}");
            }
        }
    }
    let dest = t.path().join("out");
    a.get_dir(&pa.id, &dest).await.unwrap();
    assert_eq!(std::fs::read(dest.join("mem")).unwrap(), secret);
    // Tenant b with a's namespace but its own key cannot open a's manifest.
    let intruder = tenant("a", 2);
    let err = intruder
        .get_dir(&pa.id, &t.path().join("x"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "manifest_sealed");
}

#[tokio::test]
async fn chunk_cache_serves_repeated_wakes() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("ckpt");
    make_checkpoint(&src, 6);
    // Puts write through: a wake on the node that suspended reads nothing remotely.
    let put_cache = Arc::new(ChunkCache::open(t.path().join("put-cache"), 64 << 20).unwrap());
    let writer = store(&t.path().join("store")).with_cache(put_cache.clone());
    let put = writer.put_dir(&src, None).await.unwrap();
    put_cache.wait_idle().await;
    let local = writer.get_dir(&put.id, &t.path().join("w")).await.unwrap();
    assert_eq!(local.cache_hits, local.chunks_fetched);
    assert_eq!(local.bytes_fetched, 0);
    // Another node: cold, then warm.
    let cache = Arc::new(ChunkCache::open(t.path().join("cache"), 64 << 20).unwrap());
    let s = store(&t.path().join("store")).with_cache(cache.clone());
    let cold = s.get_dir(&put.id, &t.path().join("a")).await.unwrap();
    assert_eq!(cold.cache_hits, 0);
    cache.wait_idle().await;
    assert!(cold.bytes_fetched > 0);
    let warm = s.get_dir(&put.id, &t.path().join("b")).await.unwrap();
    assert_eq!(warm.cache_hits, warm.chunks_fetched);
    assert_eq!(warm.bytes_fetched, 0);
    assert_eq!(tree(&t.path().join("a")), tree(&t.path().join("b")));
    // A corrupt cache entry is dropped and refetched, not trusted.
    let entry = std::fs::read_dir(cache.dir())
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut blob = std::fs::read(&entry).unwrap();
    let last = blob.len() - 1;
    blob[last] ^= 1;
    std::fs::write(&entry, blob).unwrap();
    cache.wait_idle().await;
    let third = s.get_dir(&put.id, &t.path().join("c")).await.unwrap();
    assert_eq!(third.cache_hits + 1, third.chunks_fetched);
    assert_eq!(tree(&t.path().join("a")), tree(&t.path().join("c")));
}

#[tokio::test]
async fn bad_inputs_and_destinations_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let s = store(&t.path().join("store"));
    let file = t.path().join("f");
    std::fs::write(&file, b"x").unwrap();
    let err = s.put_dir(&file, None).await.unwrap_err();
    assert_eq!(err.code(), "input_not_directory");
    let err = s
        .put_dir(&t.path().join("missing"), None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), "input_read");

    let src = t.path().join("ckpt");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("a"), b"hello").unwrap();
    let put = s.put_dir(&src, None).await.unwrap();
    let dest = t.path().join("dest");
    std::fs::create_dir_all(&dest).unwrap();
    std::fs::write(dest.join("keep"), b"mine").unwrap();
    let err = s.get_dir(&put.id, &dest).await.unwrap_err();
    assert!(matches!(err, StoreError::DestinationExists { .. }));
    assert_eq!(std::fs::read(dest.join("keep")).unwrap(), b"mine");
    let empty = t.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    s.get_dir(&put.id, &empty).await.unwrap();
    assert_eq!(std::fs::read(empty.join("a")).unwrap(), b"hello");
    let unknown = SnapshotId::new("snap-unknown").unwrap();
    assert_eq!(
        s.get_dir(&unknown, &t.path().join("z"))
            .await
            .unwrap_err()
            .code(),
        "snapshot_not_found"
    );
    let err = s
        .put_dir_with(
            &src,
            PutOptions {
                id: Some(put.id.clone()),
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), "snapshot_exists");
}

/// Every file and directory under `root` with its permission bits.
fn modes(root: &Path) -> Vec<(std::path::PathBuf, bool, u32)> {
    let mut out = Vec::new();
    let mut pending = vec![root.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let meta = e.metadata().unwrap();
            out.push((e.path(), meta.is_dir(), meta.permissions().mode() & 0o7777));
            if meta.is_dir() {
                pending.push(e.path());
            }
        }
    }
    out
}

#[tokio::test]
async fn store_objects_and_cache_entries_are_private_to_the_daemon_user() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("ckpt");
    make_checkpoint(&src, 11);
    // A store made by an older torpor: world-readable root and chunks.
    let root = t.path().join("store");
    std::fs::create_dir(&root).unwrap();
    std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cache = Arc::new(ChunkCache::open(t.path().join("cache"), 64 << 20).unwrap());
    let s = store(&root).with_cache(cache.clone());
    let put = s.put_dir(&src, None).await.unwrap();
    s.pin(&put.id).await.unwrap();
    cache.wait_idle().await;

    let root_mode = std::fs::metadata(&root).unwrap().permissions().mode() & 0o7777;
    assert_eq!(root_mode, 0o700, "the store root is restricted on open");
    for dir in [root.clone(), t.path().join("cache")] {
        let found = modes(&dir);
        assert!(found.iter().any(|(_, is_dir, _)| !is_dir), "{found:?}");
        for (path, is_dir, mode) in found {
            let want = if is_dir { 0o700 } else { 0o600 };
            assert_eq!(mode, want, "{} is {mode:o}", path.display());
        }
    }
    assert!(!chunk_files(&root).is_empty());
}
