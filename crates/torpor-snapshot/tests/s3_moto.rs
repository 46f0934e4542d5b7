//! The store on the S3 backend against a real S3-compatible server: this test starts
//! `moto_server` (PyPI `moto[server]`) on a free loopback port, creates a bucket, and stops the
//! server by its pid at the end. Set `MOTO_SERVER` to the executable if it is not on PATH.

mod common;
mod support {
    pub mod moto;
}

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use support::moto::Moto;
use torpor_snapshot::backend::{Backend, ObjectKey, S3Backend, S3Config};
use torpor_snapshot::gvisor::encode_compressed_image;
use torpor_snapshot::{GcOptions, Store, StoreConfig};

fn s3_config(moto: &Moto, bucket: &str) -> S3Config {
    S3Config {
        endpoint: Some(moto.endpoint()),
        access_key_id: "test".into(),
        secret_access_key: "test".into(),
        allow_http: true,
        max_retries: 2,
        retry_timeout: Duration::from_secs(3),
        request_timeout: Duration::from_secs(5),
        ..S3Config::new(bucket)
    }
}

fn checkpoint(dir: &Path, seed: u64) {
    std::fs::create_dir_all(dir.join("fs")).unwrap();
    let img = encode_compressed_image(b"{}", &memory_like(seed, 512), 1 << 20);
    std::fs::write(dir.join("checkpoint.img"), img).unwrap();
    std::fs::write(dir.join("fs/state.txt"), format!("agent {seed}\n")).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_backend_against_moto() {
    let mut moto = Moto::start();
    moto.create_bucket("torpor-snapshots");
    let t = tempfile::tempdir().unwrap();

    // Backend contract.
    let backend = Arc::new(S3Backend::new(&s3_config(&moto, "torpor-snapshots")).unwrap());
    let k = ObjectKey::new("probe/a/b").unwrap();
    assert_eq!(backend.get(&k).await.unwrap(), None);
    backend.put(&k, Bytes::from_static(b"hi")).await.unwrap();
    assert_eq!(
        backend.get(&k).await.unwrap().unwrap(),
        Bytes::from_static(b"hi")
    );
    let missing = ObjectKey::new("probe/none").unwrap();
    assert_eq!(
        backend.exists_many(&[k.clone(), missing]).await.unwrap(),
        vec![true, false]
    );
    assert_eq!(backend.list("probe").await.unwrap()[0].key, k);
    backend.delete(&k).await.unwrap();
    assert!(backend.list("probe").await.unwrap().is_empty());

    // Store round trip, with a prefix inside the bucket.
    let cfg = S3Config {
        prefix: Some("fleet-a".into()),
        ..s3_config(&moto, "torpor-snapshots")
    };
    let backend: Arc<dyn Backend> = Arc::new(S3Backend::new(&cfg).unwrap());
    let store = Store::new(backend.clone(), StoreConfig::default()).unwrap();
    let src = t.path().join("ckpt");
    checkpoint(&src, 1);
    let put = store.put_dir(&src, None).await.unwrap();
    assert_eq!(put.stats.images, 1);
    assert!(put.stats.chunks_new > 10);
    let dest = t.path().join("out");
    store.get_dir(&put.id, &dest).await.unwrap();
    assert_eq!(
        std::fs::read(dest.join("fs/state.txt")).unwrap(),
        b"agent 1\n"
    );
    let again = store.put_dir(&src, Some(&put.id)).await.unwrap();
    assert_eq!(again.stats.chunks_new, 0);
    let stats = store.stats().await.unwrap();
    assert_eq!(stats.snapshots, 2);
    assert!(stats.stored_bytes > 0 && stats.stored_bytes < stats.logical_bytes);

    // Corruption and loss are caught by name.
    let m = store.load_manifest(&put.id).await.unwrap();
    let (victim, _) = m.chunk_refs().next().unwrap();
    let victim = *victim;
    let key = ObjectKey::new(format!(
        "chunks/{}/{}",
        &victim.to_hex()[..2],
        victim.to_hex()
    ))
    .unwrap();
    let good = backend.get(&key).await.unwrap().unwrap();
    let mut bad = good.to_vec();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    backend.put(&key, Bytes::from(bad)).await.unwrap();
    let err = store
        .get_dir(&put.id, &t.path().join("bad"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "chunk_corrupt");
    assert!(err.to_string().contains(&victim.to_hex()));
    backend.delete(&key).await.unwrap();
    let err = store
        .get_dir(&put.id, &t.path().join("bad"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "chunk_missing");
    backend.put(&key, good).await.unwrap();

    // GC over S3 listing: drop one snapshot, the shared chunks stay.
    store.delete_snapshot(&again.id).await.unwrap();
    let report = store.gc(&GcOptions::default()).await.unwrap();
    assert_eq!(
        report.chunks_removed, 0,
        "the other snapshot still uses them"
    );
    assert!(store.verify(&put.id).await.unwrap().problems.is_empty());

    // Ranged reads (the backend contract), then a packed store on the same server.
    let r = ObjectKey::new("probe/ranges").unwrap();
    backend
        .put(&r, Bytes::from_static(b"0123456789"))
        .await
        .unwrap();
    let parts = backend
        .get_ranges(&r, &[2..5, 7..10, 0..1])
        .await
        .unwrap()
        .unwrap();
    assert_eq!(parts, vec![&b"234"[..], &b"789"[..], &b"0"[..]]);
    assert_eq!(
        backend
            .get_ranges(&ObjectKey::new("probe/none").unwrap(), &[0..1, 2..3])
            .await
            .unwrap(),
        None
    );
    backend.delete(&r).await.unwrap();
    let packed_backend: Arc<dyn Backend> = Arc::new(
        S3Backend::new(&S3Config {
            prefix: Some("fleet-p".into()),
            ..s3_config(&moto, "torpor-snapshots")
        })
        .unwrap(),
    );
    let packed = Store::new(
        packed_backend.clone(),
        StoreConfig {
            pack_bytes: Some(256 * 1024),
            ..StoreConfig::default()
        },
    )
    .unwrap();
    let p1 = packed.put_dir(&src, None).await.unwrap();
    assert!(packed_backend.list("chunks").await.unwrap().is_empty());
    let packs = packed_backend.list("packs").await.unwrap();
    assert!(!packs.is_empty() && packs.len() < p1.stats.chunks_new as usize / 4);
    assert_eq!(
        packed_backend.list("packidx").await.unwrap().len(),
        packs.len()
    );
    let dest = t.path().join("packed-out");
    packed.get_dir(&p1.id, &dest).await.unwrap();
    assert_eq!(
        std::fs::read(dest.join("fs/state.txt")).unwrap(),
        std::fs::read(src.join("fs/state.txt")).unwrap()
    );
    assert!(packed.verify(&p1.id).await.unwrap().problems.is_empty());
    // A second snapshot that reuses every other 32 KiB of the first's memory, the first
    // deleted: the collector repacks its half-used packs on the real S3 API too.
    let mut mem = memory_like(21, 1024);
    let image = |mem: &[u8]| encode_compressed_image(b"{}", mem, 1 << 20);
    let (src2, dest2) = (t.path().join("ckpt2"), t.path().join("packed-out2"));
    std::fs::create_dir_all(&src2).unwrap();
    std::fs::write(src2.join("checkpoint.img"), image(&mem)).unwrap();
    let q1 = packed.put_dir(&src2, None).await.unwrap();
    for (i, block) in mem
        .chunks_mut(32 << 10)
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
    {
        block.copy_from_slice(&noise(300 + i as u64, block.len()));
    }
    std::fs::write(src2.join("checkpoint.img"), image(&mem)).unwrap();
    let q2 = packed.put_dir(&src2, Some(&q1.id)).await.unwrap();
    packed.delete_snapshot(&q1.id).await.unwrap();
    let report = packed
        .gc(&GcOptions {
            repack_below: Some(0.75),
            ..GcOptions::default()
        })
        .await
        .unwrap();
    assert!(report.packs_repacked > 0, "{report:?}");
    assert_eq!(report.manifests_rewritten, 1, "{report:?}");
    packed.get_dir(&q2.id, &dest2).await.unwrap();
    let bytes = std::fs::read(dest2.join("checkpoint.img")).unwrap();
    let layout = torpor_snapshot::gvisor::probe(&mut std::io::Cursor::new(&bytes))
        .unwrap()
        .unwrap();
    let mut restored = Vec::new();
    std::io::Read::read_to_end(
        &mut torpor_snapshot::gvisor::InflatingReader::new(
            &bytes[layout.header.len()..],
            layout.frame_size,
        ),
        &mut restored,
    )
    .unwrap();
    assert!(restored == mem, "the repacked snapshot restores its memory");
    packed.delete_snapshot(&q2.id).await.unwrap();

    packed.delete_snapshot(&p1.id).await.unwrap();
    let report = packed.gc(&GcOptions::default()).await.unwrap();
    assert!(report.packs_removed as usize >= packs.len(), "{report:?}");
    assert!(packed_backend.list("packs").await.unwrap().is_empty());
    assert!(packed_backend.list("packidx").await.unwrap().is_empty());

    // Server gone mid-life: a put fails with a clear remote error within the retry budget.
    moto.stop();
    let started = Instant::now();
    checkpoint(&src, 2);
    let err = store.put_dir(&src, Some(&put.id)).await.unwrap_err();
    assert_eq!(err.code(), "backend_remote", "{err}");
    assert!(started.elapsed() < Duration::from_secs(30));
}
