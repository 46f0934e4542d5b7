//! The local boundary (docs/SECURITY.md): another local user, a second daemon on the same data
//! directory, and callers that hold connections open to exhaust the daemon's descriptors. Also
//! the CLI paths that keep tenants off host paths (image upload) and set their quotas.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use torpor_api::types::{CreateTenantBody, Quotas};
use torpor_api::Client;
use torpor_core::Tier;

use crate::common::*;

/// A hang guard for what must end on its own (never a measure of how fast it ends).
const GUARD: Duration = Duration::from_secs(120);

/// A loopback port for a child process to listen on (outside the ephemeral range: see
/// `torpor_runtime::ports`).
fn free_port() -> u16 {
    torpor_runtime::ports::loopback_port().expect("a free loopback port")
}

/// Runs the CLI to completion (under [`GUARD`]); returns (exit code, stdout, stderr).
fn torpor(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (mut out, mut err) = (String::new(), String::new());
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let _ = se.read_to_string(&mut err);
        err
    });
    let pid = child.id() as i32;
    let guard = std::thread::spawn(move || {
        std::thread::sleep(GUARD);
        // SAFETY: kill(2) on this test's own child; harmless if it has already been reaped
        // and its pid is free (the test has failed by then anyway).
        unsafe { libc::kill(pid, libc::SIGKILL) };
    });
    let _ = so.read_to_string(&mut out);
    let err = reader.join().unwrap();
    let status = child.wait().unwrap();
    drop(guard);
    (status.code().unwrap_or(-1), out, err)
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_daemon_on_a_data_directory_in_use_is_refused_and_the_first_keeps_its_sandboxes() {
    let d = Daemon::start().await;
    let c = d.client();
    c.create_template(&agent_template("keeper", no_idle()))
        .await
        .unwrap();
    let id = create(&c, "keeper").await;
    call_agent(&c, &id, "one").await;
    let (n, _) = call_agent(&c, &id, "two").await;

    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let dir = d.dir.to_str().unwrap();
    let (code, _, err) = torpor(
        &[
            "up",
            "--listen",
            &listen,
            "--data-dir",
            dir,
            "--workers",
            "2",
        ],
        &[],
    );
    assert_ne!(code, 0, "a second daemon on the same directory is refused");
    assert!(
        err.contains(dir) && err.contains(&format!("pid {}", d.pid())),
        "the refusal names the directory and the running daemon's pid: {err}"
    );
    assert!(
        std::net::TcpStream::connect(&listen).is_err(),
        "the refused daemon never served"
    );
    // The same process goes on: its in-memory counter continues (a sandbox killed by the second
    // daemon's reconcile would come back from its snapshot, or not at all).
    let (after, logged) = call_agent(&c, &id, "three").await;
    assert_eq!(after, n + 1, "the first daemon's sandbox kept its process");
    assert_eq!(logged, after);
    let lock = std::fs::read_to_string(d.dir.join("torpor.lock")).unwrap();
    assert_eq!(lock.trim(), d.pid().to_string());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_daemon_does_not_keep_its_data_directory_locked() {
    let mut d = Daemon::start().await;
    let first = d.pid();
    d.kill();
    // spawn() waits until the new daemon answers: the lock died with the killed process.
    d.spawn().await;
    assert_ne!(d.pid(), first);
    let lock = std::fs::read_to_string(d.dir.join("torpor.lock")).unwrap();
    assert_eq!(lock.trim(), d.pid().to_string());
    assert!(d.client().health().await.is_ok());
}

/// Every entry under `dir` (not following links), with its path relative to `dir`.
fn walk(dir: &Path, rel: &Path, out: &mut Vec<(PathBuf, std::fs::Metadata)>) {
    let Ok(entries) = std::fs::read_dir(dir.join(rel)) else {
        return;
    };
    for e in entries.flatten() {
        let rel = rel.join(e.file_name());
        let Ok(meta) = std::fs::symlink_metadata(dir.join(&rel)) else {
            continue;
        };
        let is_dir = meta.is_dir();
        out.push((rel.clone(), meta));
        if is_dir {
            walk(dir, &rel, out);
        }
    }
}

/// What a sandbox sees as its own files, with the modes its image (or torpor's host layout)
/// gives them: template root filesystems and the agent binary. They stay as they are (a
/// non-root user inside an image needs its files' modes); other local users cannot reach them
/// because every directory above them is private.
fn is_sandbox_content(rel: &Path) -> bool {
    let parts: Vec<_> = rel.components().map(|c| c.as_os_str()).collect();
    let in_template_rootfs =
        parts.first().is_some_and(|p| *p == "templates") && parts.iter().any(|p| *p == "rootfs");
    // `agent/<hash>/` is mounted read-only at /.torpor in every sandbox and must be readable
    // by the sandbox's non-root users (E2B's `user` runs its sudo client from it); the 0700
    // data directory above it keeps other host users out.
    let agent_binary = parts.first().is_some_and(|p| *p == "agent") && parts.len() >= 2;
    in_template_rootfs || agent_binary
}

#[tokio::test(flavor = "multi_thread")]
async fn another_local_user_cannot_read_the_data_directory() {
    let mut d = Daemon::start().await;
    let c = d.client();
    let id = create(&c, "host").await;
    let r = c.exec(&id, &sh("echo secret > /root/s")).await.unwrap();
    assert_eq!(r.exit_code, Some(0));
    // A checkpoint on disk: the sandbox's whole memory.
    c.suspend(&id, Some(Tier::Parked)).await.unwrap();
    d.stop();
    // As an older torpor left it: a world-readable directory and files.
    for (p, m) in [
        (d.dir.clone(), 0o755),
        (d.dir.join("admin-token"), 0o644),
        (d.dir.join("torpor.db"), 0o644),
        (d.dir.join("metrics-token"), 0o644),
    ] {
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(m)).unwrap();
    }
    d.spawn().await;
    let c = d.client();
    // Sandboxes still work with private files: a wake from the parked checkpoint, a new
    // sandbox from the golden snapshot, and a template built now.
    let r = c.exec(&id, &sh("cat /root/s")).await.unwrap();
    assert_eq!(r.stdout.trim(), "secret", "{r:?}");
    c.create_template(&agent_template("private", no_idle()))
        .await
        .unwrap();
    let fresh = create(&c, "private").await;
    call_agent(&c, &fresh, "x").await;
    c.suspend(&fresh, Some(Tier::Parked)).await.unwrap();

    assert_eq!(mode(&d.dir), 0o700, "the data directory is private");
    let mut entries = Vec::new();
    walk(&d.dir, Path::new(""), &mut entries);
    assert!(entries.len() > 20, "the walk saw the daemon's files");
    let mut open = Vec::new();
    for (rel, meta) in &entries {
        let ft = meta.file_type();
        if is_sandbox_content(rel) || ft.is_symlink() || {
            use std::os::unix::fs::FileTypeExt;
            ft.is_socket() || ft.is_fifo()
        } {
            continue;
        }
        let m = meta.permissions().mode() & 0o777;
        if m & 0o077 != 0 {
            open.push(format!("{} {m:o}", rel.display()));
        }
    }
    assert!(
        open.is_empty(),
        "readable by group or other users:\n{}",
        open.join("\n")
    );
    for f in ["admin-token", "metrics-token", "torpor.db", "torpor.lock"] {
        assert_eq!(mode(&d.dir.join(f)), 0o600, "{f}");
    }
    // Inside, the sandbox's layout keeps a root filesystem's modes (not the daemon's umask):
    // a non-root process reaches /etc/passwd.
    let r = c
        .exec(
            &fresh,
            &sh(
                "python3 -c \"import os; os.setgid(65534); os.setuid(65534); \
                 print(open('/etc/passwd').readline().split(':')[0])\"",
            ),
        )
        .await
        .unwrap();
    assert_eq!(r.stdout.trim(), "root", "{r:?}");
}

fn open_descriptors(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

/// (soft, hard) "Max open files" of a process.
fn nofile_limits(pid: i32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .to_string();
    let mut it = line["Max open files".len()..].split_whitespace();
    (it.next().unwrap().into(), it.next().unwrap().into())
}

/// This test process opens more sockets than a default soft limit allows.
fn raise_own_nofile() {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit on this process with a struct we own.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
        l.rlim_cur = l.rlim_max.min(1 << 16);
        libc::setrlimit(libc::RLIMIT_NOFILE, &l);
    }
}

/// Whether the daemon ended the connection (EOF or reset) instead of answering.
async fn closed_by_daemon(mut s: TcpStream) -> bool {
    let mut buf = [0u8; 64];
    match tokio::time::timeout(GUARD, s.read(&mut buf)).await {
        Ok(Ok(0)) | Ok(Err(_)) => true,
        Ok(Ok(_)) | Err(_) => false,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_slowloris_cannot_exhaust_the_daemons_descriptors() {
    raise_own_nofile();
    const CAP: usize = 256;
    let d = Daemon::start_with(&[
        "--max-connections",
        &CAP.to_string(),
        "--header-read-timeout-ms",
        "1000",
    ])
    .await;
    let c = d.client();
    let addr = format!("127.0.0.1:{}", d.port);
    // The daemon raised its descriptor limit at start (soft up to hard).
    let (soft, hard) = nofile_limits(d.pid());
    assert_eq!(
        soft, hard,
        "RLIMIT_NOFILE soft limit raised to the hard one"
    );
    c.workers().await.unwrap();
    let baseline = open_descriptors(d.pid());

    // Under the cap: connections that send nothing, half a request head, a head one byte at
    // a time, or that go idle after a request are all closed by the daemon's timeouts.
    let mut under = Vec::new();
    for i in 0..150 {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        match i % 3 {
            0 => {}
            1 => s
                .write_all(b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthor")
                .await
                .unwrap(),
            _ => {
                s.write_all(b"GET /v1/workers HTTP/1.1\r\n").await.unwrap();
                let (rd, mut wr) = s.into_split();
                tokio::spawn(async move {
                    // One byte every 100 ms until the daemon hangs up.
                    while wr.write_all(b"X").await.is_ok() {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                });
                under.push(tokio::spawn(async move {
                    let mut rd = rd;
                    let mut buf = [0u8; 64];
                    matches!(
                        tokio::time::timeout(GUARD, rd.read(&mut buf)).await,
                        Ok(Ok(0)) | Ok(Err(_))
                    )
                }));
                continue;
            }
        }
        under.push(tokio::spawn(closed_by_daemon(s)));
    }
    let mut kept = TcpStream::connect(&addr).await.unwrap();
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut head = [0u8; 12];
    kept.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    let kept = tokio::spawn(async move {
        let mut rest = Vec::new();
        tokio::time::timeout(GUARD, kept.read_to_end(&mut rest))
            .await
            .is_ok()
    });
    for (i, t) in under.into_iter().enumerate() {
        assert!(
            t.await.unwrap(),
            "slow connection {i} was closed by the daemon"
        );
    }
    assert!(
        kept.await.unwrap(),
        "the idle keep-alive connection was closed"
    );

    // Over the cap: 1500 idle connections at once. The daemon holds at most CAP of them; the
    // rest are closed at once, and its descriptors stay bounded.
    let mut held = Vec::new();
    let mut peak = 0;
    for i in 0..1500 {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        let _ = s
            .write_all(b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\n")
            .await;
        held.push(s);
        if i % 100 == 99 {
            peak = peak.max(open_descriptors(d.pid()));
        }
    }
    peak = peak.max(open_descriptors(d.pid()));
    assert!(
        peak <= baseline + CAP + 64,
        "descriptors bounded by the cap: {peak} open, {baseline} before, cap {CAP}"
    );
    let closed = futures::future::join_all(held.into_iter().map(closed_by_daemon)).await;
    assert!(
        closed.iter().all(|c| *c),
        "every idle connection was closed"
    );

    // Once they are gone an authenticated call answers, and the descriptors are given back.
    c.workers().await.unwrap();
    assert_eq!(
        c.sandboxes(None).await.unwrap().len(),
        0,
        "the daemon is whole"
    );
    let after = open_descriptors(d.pid());
    assert!(
        after <= baseline + 16,
        "descriptors given back: {after} now, {baseline} before"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_need_a_token_unless_served_on_the_operators_own_listener() {
    let metrics_port = free_port();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let d = Daemon::start_with(&["--metrics-listen", &metrics_addr]).await;
    let token_file = d.dir.join("metrics-token");
    assert_eq!(mode(&token_file), 0o600);
    let metrics_token = std::fs::read_to_string(&token_file).unwrap();
    assert!(metrics_token.trim().starts_with("tpr_metrics_"));
    let http = reqwest::Client::new();
    let url = format!("{}/metrics", d.url());
    let anon = http.get(&url).send().await.unwrap();
    assert_eq!(anon.status(), 401, "no token, no metrics");
    let body: serde_json::Value = anon.json().await.unwrap();
    assert_eq!(body["error"]["code"], "unauthorized");
    // The metrics token reads metrics and nothing else.
    let with = Client::new(&d.url(), metrics_token.trim());
    assert!(with.metrics().await.unwrap().contains("torpor_workers"));
    let v1 = with.sandboxes(None).await.unwrap_err();
    assert_eq!(v1.code(), Some("unauthorized"), "{v1}");
    // The operator's listener: metrics without a token, and no API.
    let own = http
        .get(format!("http://{metrics_addr}/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(own.status(), 200);
    assert!(own.text().await.unwrap().contains("torpor_workers"));
    let api = http
        .get(format!("http://{metrics_addr}/v1/sandboxes"))
        .bearer_auth(d.token())
        .send()
        .await
        .unwrap();
    assert_eq!(api.status(), 404, "the metrics listener serves no API");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_cli_uploads_its_image_instead_of_naming_a_host_path() {
    let d = Daemon::start().await;
    let admin = d.client();
    let tenant = admin
        .create_tenant(&CreateTenantBody {
            name: "team-a".into(),
            quotas: None,
        })
        .await
        .unwrap();
    let work = tempfile::tempdir().unwrap();
    let image = work.path().join("tiny.tar");
    make_image(&image, &[]);
    let url = d.url();
    let env = [
        ("TORPOR_URL", url.as_str()),
        ("TORPOR_TOKEN", tenant.token.as_str()),
    ];
    // The tenant's `--image FILE` is uploaded (a host path would be refused), with the other
    // flags sent as the template's spec.
    let (code, out, err) = torpor(
        &[
            "template",
            "add",
            "tiny",
            "--image",
            image.to_str().unwrap(),
            "--env",
            "EXTRA=yes",
            "--memory-mib",
            "128",
            "--json",
        ],
        &env,
    );
    assert_eq!(code, 0, "upload failed: {err}");
    let tpl: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(tpl["status"], "ready", "{out}");
    assert_eq!(tpl["tenant"], "team-a", "{out}");
    assert_eq!(tpl["limits"]["memory_mib"], 128, "{out}");
    assert!(
        !out.contains(image.to_str().unwrap()),
        "the caller's local path is not the template's source: {out}"
    );
    let c = Client::new(&url, &tenant.token);
    let id = create(&c, "tiny").await;
    let r = c
        .exec(
            &id,
            &sh("read l < hello.txt; echo $l; echo $GREETING $EXTRA"),
        )
        .await
        .unwrap();
    assert_eq!(r.stdout, "hi from image\nfrom-image yes\n", "{r:?}");

    // The other tenant still works and does not see the template.
    let other = admin
        .create_tenant(&CreateTenantBody {
            name: "team-b".into(),
            quotas: None,
        })
        .await
        .unwrap();
    let b = Client::new(&url, &other.token);
    assert_eq!(
        b.template("tiny").await.unwrap_err().code(),
        Some("not_found")
    );
    create(&b, "host").await;
}

/// Makes a tenant on `d` and the tiny image (as an oci-archive, or as a rootfs tarball) in `work`.
async fn tenant_and_image(d: &Daemon, work: &Path, rootfs: bool) -> (String, PathBuf) {
    let tenant = d
        .client()
        .create_tenant(&CreateTenantBody {
            name: "team-r".into(),
            quotas: None,
        })
        .await
        .unwrap();
    let file = work.join(if rootfs { "rootfs.tar" } else { "tiny.tar" });
    make_image(&file, if rootfs { &["rootfs"] } else { &[] });
    (tenant.token, file)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_cli_uploads_a_rootfs_tarball_instead_of_naming_a_host_directory() {
    let d = Daemon::start().await;
    let work = tempfile::tempdir().unwrap();
    let (token, tarball) = tenant_and_image(&d, work.path(), true).await;
    let url = d.url();
    let env = [
        ("TORPOR_URL", url.as_str()),
        ("TORPOR_TOKEN", token.as_str()),
    ];
    let (code, _, err) = torpor(
        &[
            "template",
            "add",
            "fromtar",
            "--rootfs-tar",
            tarball.to_str().unwrap(),
        ],
        &env,
    );
    assert_eq!(code, 0, "rootfs tarball upload failed: {err}");
    let c = Client::new(&url, &token);
    let id = create(&c, "fromtar").await;
    let r = c
        .exec(&id, &sh("read l < /app/hello.txt; echo $l"))
        .await
        .unwrap();
    assert_eq!(r.stdout, "hi from image\n", "{r:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn tenant_quotas_set_on_the_cli_are_kept_and_listed() {
    let d = Daemon::start().await;
    let url = d.url();
    let token = d.token();
    let env = [
        ("TORPOR_URL", url.as_str()),
        ("TORPOR_TOKEN", token.as_str()),
    ];
    let (code, out, err) = torpor(
        &[
            "tenant",
            "create",
            "team-q",
            "--requests-per-s",
            "7",
            "--max-templates",
            "2",
            "--max-pools",
            "3",
            "--max-disk-mib",
            "512",
            "--max-cpus",
            "4",
            "--json",
        ],
        &env,
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("tpr_"), "the token is printed once: {out}");
    let listed = d.client().tenants().await.unwrap();
    let t = listed.iter().find(|t| t.name == "team-q").unwrap();
    assert_eq!(
        t.quotas,
        Quotas {
            requests_per_s: Some(7),
            max_templates: Some(2),
            max_pools: Some(3),
            max_disk_mib: Some(512),
            max_cpus: Some(4),
            ..Default::default()
        }
    );
    let (code, table, err) = torpor(&["tenant", "ls"], &env);
    assert_eq!(code, 0, "{err}");
    let header = table.lines().next().unwrap();
    for col in ["CPUS", "TEMPLATES", "POOLS", "DISK MIB", "REQ/S"] {
        assert!(header.contains(col), "{header}");
    }
    let row: Vec<_> = table
        .lines()
        .find(|l| l.starts_with("team-q"))
        .unwrap()
        .split_whitespace()
        .collect();
    // NAME SANDBOXES RUNNING MEMORY CPUS TEMPLATES POOLS DISK REQ/S CREATED
    assert_eq!(
        &row[1..9],
        ["-", "-", "-", "4", "2", "3", "512", "7"],
        "{table}"
    );
}
