//! A full disk, for real: small tmpfs mounts (so this test needs root) as the restore target
//! and as the store itself. A restore that runs out of space fails with `output_no_space` and
//! leaves nothing behind; a put that runs out fails with `backend_no_space` and the previous
//! snapshot stays valid.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::noise;
use torpor_snapshot::Store;

struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "mounting a tmpfs needs root");
        Tmpfs(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[tokio::test]
async fn full_disks_fail_cleanly() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("ckpt");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("mem"), noise(1, 4 << 20)).unwrap();

    // Restore into a 2 MiB filesystem.
    let store = Store::local(t.path().join("store")).unwrap();
    let put = store.put_dir(&src, None).await.unwrap();
    let small = Tmpfs::mount(&t.path().join("small"), "2m");
    let err = store
        .get_dir(&put.id, &small.0.join("restore"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "output_no_space", "{err}");
    assert_eq!(
        std::fs::read_dir(&small.0).unwrap().count(),
        0,
        "nothing left behind"
    );

    // A store on a 3 MiB filesystem.
    let tiny = Tmpfs::mount(&t.path().join("tiny"), "3m");
    let store = Store::local(tiny.0.join("store")).unwrap();
    let first_src = t.path().join("first");
    std::fs::create_dir_all(&first_src).unwrap();
    std::fs::write(first_src.join("mem"), noise(2, 1 << 20)).unwrap();
    let first = store.put_dir(&first_src, None).await.unwrap();
    let err = store.put_dir(&src, Some(&first.id)).await.unwrap_err();
    assert_eq!(err.code(), "backend_no_space", "{err}");
    assert_eq!(
        store.list_snapshots().await.unwrap(),
        vec![first.id.clone()]
    );
    let out = t.path().join("out");
    store.get_dir(&first.id, &out).await.unwrap();
    assert_eq!(std::fs::read(out.join("mem")).unwrap(), noise(2, 1 << 20));
    // GC reclaims the failed put's orphan chunks.
    let report = store.gc(&Default::default()).await.unwrap();
    assert!(report.chunks_removed > 0);
    assert!(store.verify(&first.id).await.unwrap().problems.is_empty());
}
