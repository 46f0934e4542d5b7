//! A real gVisor checkpoint through the store: run a Python agent holding state in a runsc
//! sandbox, checkpoint it, put the image into the store, get it back (frames re-encoded as
//! stored deflate), restore it under a new id, and check that the process carried on with its
//! memory. Then checkpoint the restored sandbox and measure how much of it deduplicates.
//!
//! Needs root and `runsc` (Debian's 0.0~20221219 build): it fails, rather than passing
//! silently, when either is missing. Containers are named `snaptest-*`, live under
//! `--root /run/snaptest-runsc`, and are force-deleted with their cgroups at the end.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use torpor_snapshot::{Store, StoreConfig};

const STATE_ROOT: &str = "/run/snaptest-runsc";

struct Sandboxes {
    ids: Vec<String>,
    logs: PathBuf,
}

impl Sandboxes {
    fn runsc(&self, args: &[&str], log_name: &str) -> std::process::Output {
        let out = std::fs::File::create(self.logs.join(format!("{log_name}.out"))).unwrap();
        let err = std::fs::File::create(self.logs.join(format!("{log_name}.err"))).unwrap();
        let status = Command::new("runsc")
            .args(["--root", STATE_ROOT, "--platform=ptrace"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .status()
            .expect("runsc is installed");
        let stdout = std::fs::read(self.logs.join(format!("{log_name}.out"))).unwrap();
        let stderr = std::fs::read(self.logs.join(format!("{log_name}.err"))).unwrap();
        std::process::Output {
            status,
            stdout,
            stderr,
        }
    }

    fn must(&self, args: &[&str], log_name: &str) -> String {
        let out = self.runsc(args, log_name);
        assert!(
            out.status.success(),
            "runsc {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn exec_cat(&self, id: &str, file: &str) -> Option<String> {
        let out = self.runsc(&["exec", id, "cat", file], "exec");
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
            .filter(|s| !s.is_empty())
    }

    fn wait_for(&self, id: &str, file: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(v) = self.exec_cat(id, file) {
                return v;
            }
            assert!(Instant::now() < deadline, "{id}: {file} never appeared");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Sandboxes {
    fn drop(&mut self) {
        for id in &self.ids {
            let _ = self.runsc(&["delete", "-force", id], "cleanup");
            for ctl in std::fs::read_dir("/sys/fs/cgroup")
                .into_iter()
                .flatten()
                .flatten()
            {
                let _ = std::fs::remove_dir(ctl.path().join(id));
            }
        }
    }
}

fn bundle(dir: &Path) -> PathBuf {
    let b = dir.join("bundle");
    let rootfs = b.join("rootfs");
    for d in [
        "usr", "bin", "lib", "lib64", "tmp", "proc", "dev", "sys", "etc",
    ] {
        std::fs::create_dir_all(rootfs.join(d)).unwrap();
    }
    let agent = r#"
import os, time, hashlib
state = bytearray(os.urandom(8 << 20))      # 8 MiB of private memory
token = hashlib.sha256(state).hexdigest()
open('/tmp/token', 'w').write(token)
i = 0
while True:
    i += 1
    state[i % len(state)] = i & 0xff
    open('/tmp/counter.new', 'w').write(str(i))
    os.rename('/tmp/counter.new', '/tmp/counter')
    time.sleep(0.05)
"#;
    let mut mounts = vec![
        serde_json::json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        serde_json::json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs"}),
        serde_json::json!({"destination": "/sys", "type": "sysfs", "source": "sysfs",
            "options": ["nosuid", "noexec", "nodev", "ro"]}),
    ];
    for d in ["usr", "bin", "lib", "lib64"] {
        mounts.push(
            serde_json::json!({"destination": format!("/{d}"), "type": "bind",
            "source": format!("/{d}"), "options": ["rbind", "ro"]}),
        );
    }
    let spec = serde_json::json!({
        "ociVersion": "1.0.2-dev",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": ["/usr/bin/python3", "-u", "-c", agent],
            "env": ["PATH=/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE=1"],
            "cwd": "/"
        },
        "root": {"path": "rootfs", "readonly": true},
        "hostname": "snaptest",
        "mounts": mounts,
        "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}]}
    });
    std::fs::write(
        b.join("config.json"),
        serde_json::to_vec_pretty(&spec).unwrap(),
    )
    .unwrap();
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_runsc_checkpoint_survives_the_store() {
    // SAFETY: geteuid has no preconditions and touches no memory.
    assert_eq!(
        unsafe { libc_geteuid() },
        0,
        "this test needs root (it runs runsc)"
    );
    assert!(
        Command::new("runsc")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success()),
        "this test needs runsc on PATH"
    );
    let t = tempfile::tempdir().unwrap();
    let logs = t.path().join("logs");
    std::fs::create_dir_all(&logs).unwrap();
    let tag = format!(
        "{:x}",
        std::process::id() as u64 * 1_000_003 + Instant::now().elapsed().subsec_nanos() as u64
    );
    let (a, b, c) = (
        format!("snaptest-{tag}-a"),
        format!("snaptest-{tag}-b"),
        format!("snaptest-{tag}-c"),
    );
    let base = format!("snaptest-{tag}-base");
    let sb = Sandboxes {
        ids: vec![a.clone(), b.clone(), c.clone(), base.clone()],
        logs,
    };
    let bundle = bundle(t.path());
    let bundle_s = bundle.to_str().unwrap();
    let flags = ["--network=none", "--overlay2=root:memory"];

    sb.must(
        &[&flags[..], &["run", "-detach", "--bundle", bundle_s, &a]].concat(),
        "run",
    );
    let token = sb.wait_for(&a, "/tmp/token");
    std::thread::sleep(Duration::from_millis(300));
    let before: u64 = sb.wait_for(&a, "/tmp/counter").parse().unwrap();

    let img1 = t.path().join("img1");
    std::fs::create_dir_all(&img1).unwrap();
    let started = Instant::now();
    sb.must(
        &["checkpoint", "--image-path", img1.to_str().unwrap(), &a],
        "checkpoint",
    );
    let checkpoint_ms = started.elapsed().as_millis();
    let _ = sb.runsc(&["delete", "-force", &a], "delete");
    let original = std::fs::metadata(img1.join("checkpoint.img"))
        .unwrap()
        .len();

    let store = Store::new(
        std::sync::Arc::new(torpor_snapshot::LocalBackend::open(t.path().join("store")).unwrap()),
        StoreConfig::default(),
    )
    .unwrap();
    let put = store.put_dir(&img1, None).await.unwrap();
    assert_eq!(put.stats.images, 1, "runsc's image format was recognised");
    assert_eq!(put.stats.image_fallbacks, 0);
    assert!(
        put.stats.logical_bytes > original,
        "the inflated stream is what was chunked"
    );

    let img2 = t.path().join("img2");
    let got = store.get_dir(&put.id, &img2).await.unwrap();
    let restored = std::fs::metadata(img2.join("checkpoint.img"))
        .unwrap()
        .len();
    assert!(restored > original, "frames came back as stored deflate");

    let started = Instant::now();
    sb.must(
        &[
            &flags[..],
            &[
                "restore",
                "--image-path",
                img2.to_str().unwrap(),
                "--bundle",
                bundle_s,
                "-detach",
                &b,
            ],
        ]
        .concat(),
        "restore",
    );
    let restore_ms = started.elapsed().as_millis();
    // Baseline in the same run: restore runsc's own (compressed) image.
    let started = Instant::now();
    sb.must(
        &[
            &flags[..],
            &[
                "restore",
                "--image-path",
                img1.to_str().unwrap(),
                "--bundle",
                bundle_s,
                "-detach",
                &base,
            ],
        ]
        .concat(),
        "restore-baseline",
    );
    let baseline_ms = started.elapsed().as_millis();
    assert_eq!(sb.wait_for(&base, "/tmp/token"), token);
    let _ = sb.runsc(&["delete", "-force", &base], "delete-baseline");
    assert_eq!(
        sb.wait_for(&b, "/tmp/token"),
        token,
        "memory-derived token survived"
    );
    let after: u64 = sb.wait_for(&b, "/tmp/counter").parse().unwrap();
    assert!(
        after >= before,
        "counter continued ({before} -> {after}), not restarted"
    );
    std::thread::sleep(Duration::from_millis(400));
    let later: u64 = sb.wait_for(&b, "/tmp/counter").parse().unwrap();
    assert!(later > after, "the restored process is running");

    // Checkpoint the restored sandbox and store it as a child: most chunks are shared.
    let img3 = t.path().join("img3");
    std::fs::create_dir_all(&img3).unwrap();
    sb.must(
        &["checkpoint", "--image-path", img3.to_str().unwrap(), &b],
        "checkpoint2",
    );
    let _ = sb.runsc(&["delete", "-force", &b], "delete2");
    let child = store.put_dir(&img3, Some(&put.id)).await.unwrap();
    let reuse = child.stats.chunks_reused as f64 / child.stats.chunks_total as f64;
    let written = child.stats.bytes_written as f64 / put.stats.bytes_written as f64;

    // For benchmarks on real images: TORPOR_SNAPSHOT_KEEP_IMAGES=/dir keeps both checkpoints.
    if let Ok(keep) = std::env::var("TORPOR_SNAPSHOT_KEEP_IMAGES") {
        let keep = PathBuf::from(keep);
        std::fs::create_dir_all(&keep).unwrap();
        std::fs::copy(img1.join("checkpoint.img"), keep.join("first.img")).unwrap();
        std::fs::copy(img3.join("checkpoint.img"), keep.join("recheckpoint.img")).unwrap();
    }

    // And it restores again, from the child snapshot.
    let img4 = t.path().join("img4");
    store.get_dir(&child.id, &img4).await.unwrap();
    sb.must(
        &[
            &flags[..],
            &[
                "restore",
                "--image-path",
                img4.to_str().unwrap(),
                "--bundle",
                bundle_s,
                "-detach",
                &c,
            ],
        ]
        .concat(),
        "restore2",
    );
    assert_eq!(sb.wait_for(&c, "/tmp/token"), token);
    let last: u64 = sb.wait_for(&c, "/tmp/counter").parse().unwrap();
    assert!(last >= later);
    assert!(
        reuse >= 0.5,
        "re-checkpoint of a restored sandbox reused only {reuse:.3} of chunks"
    );

    eprintln!(
        "runsc image {original} B (inflated {} B), checkpoint {checkpoint_ms} ms; put {} ms, \
         {} chunks, {} B written; get {} ms, stored-deflate image {restored} B; restore {restore_ms} ms (runsc's own image: {baseline_ms} ms); \
         re-checkpoint: {:.1}% chunks reused, wrote {:.1}% of the first put",
        put.stats.logical_bytes,
        put.stats.duration_ms,
        put.stats.chunks_total,
        put.stats.bytes_written,
        got.duration_ms,
        reuse * 100.0,
        written * 100.0
    );
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}
