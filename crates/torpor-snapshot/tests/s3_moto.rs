//! The store on the S3 backend against a real S3-compatible server: this test starts
//! `moto_server` (PyPI `moto[server]`) on a free loopback port, creates a bucket, and stops the
//! server by its pid at the end. Set `MOTO_SERVER` to the executable if it is not on PATH.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use torpor_snapshot::backend::{Backend, ObjectKey, S3Backend, S3Config};
use torpor_snapshot::gvisor::encode_compressed_image;
use torpor_snapshot::{GcOptions, Store, StoreConfig};

struct Moto {
    child: Child,
    port: u16,
    _log_dir: tempfile::TempDir,
}

impl Moto {
    fn start() -> Moto {
        let exe = std::env::var("MOTO_SERVER").unwrap_or_else(|_| "moto_server".into());
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log_dir = tempfile::tempdir().unwrap();
        let log = std::fs::File::create(log_dir.path().join("moto.log")).unwrap();
        let child = Command::new(&exe)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start {exe} (pip install \"moto[server]\", or set MOTO_SERVER): {e}")
            });
        let mut moto = Moto {
            child,
            port,
            _log_dir: log_dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if http(port, "GET", "/").is_some_and(|s| s.starts_with("HTTP/1.1 200")) {
                break;
            }
            if let Ok(Some(status)) = moto.child.try_wait() {
                panic!("moto_server exited early: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "moto_server did not answer in 60 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        moto
    }

    fn create_bucket(&self, name: &str) {
        let resp = http(self.port, "PUT", &format!("/{name}")).expect("create bucket");
        assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn config(&self, bucket: &str) -> S3Config {
        S3Config {
            endpoint: Some(format!("http://127.0.0.1:{}", self.port)),
            access_key_id: "test".into(),
            secret_access_key: "test".into(),
            allow_http: true,
            max_retries: 2,
            retry_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(5),
            ..S3Config::new(bucket)
        }
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A minimal unsigned HTTP/1.1 request (moto accepts unsigned bucket creation).
fn http(port: u16, method: &str, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
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
    let backend = Arc::new(S3Backend::new(&moto.config("torpor-snapshots")).unwrap());
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
        ..moto.config("torpor-snapshots")
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

    // Server gone mid-life: a put fails with a clear remote error within the retry budget.
    moto.stop();
    let started = Instant::now();
    checkpoint(&src, 2);
    let err = store.put_dir(&src, Some(&put.id)).await.unwrap_err();
    assert_eq!(err.code(), "backend_remote", "{err}");
    assert!(started.elapsed() < Duration::from_secs(30));
}
