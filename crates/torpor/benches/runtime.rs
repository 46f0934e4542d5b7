//! Runtime benchmark: torpor against bare runsc, in the same run, on the same machine.
//!
//!   cargo bench -p torpor --bench runtime            (as root, runsc installed)
//!   TORPOR_BENCH_N=50 cargo bench -p torpor --bench runtime
//!
//! Rows, each beside its baseline:
//!
//! | torpor | baseline |
//! |---|---|
//! | exec `true` in a running sandbox, through the API | `runsc exec` of `true` |
//! | exec `true` in a running sandbox, through the API | the floor: the same spawn inside the sandbox, torpor off the path |
//! | the same exec through a bare HTTP/1.1 client (no library) | the floor |
//! | the agent's own spawn → exit of that exec (its `duration_ms`) | the floor |
//! | the floor (the agent's clone-vfork spawn) | the same through std's `posix_spawn` (before) |
//! | floor of `true` as uid 1000 the way a `Spawn` starts it (clone-vfork) | the same through std's fork fallback |
//! | all of an exec but the agent's spawn → exit (per exec) | 0 |
//! | the same, the agent's thread keeping the channel through the exec (now) | the same in a sandbox whose agent lets go of it at once (before; `TORPOR_AGENT_BENCH_EAGER_HANDOFF`) |
//! | `GET` of the sandbox through the bare client (the daemon without the agent) | 0 |
//! | a read of a missing file through the bare client (the agent channel's round trip: one failed `open` in the sandbox) | 0 |
//! | wake from Frozen: API call to first exec result | exec in a running sandbox |
//! | wake from Frozen: the resume call | `runsc resume` of a paused container |
//! | wake from Parked, 64 MiB resident: API call to first exec result | bare `runsc restore --detach` of the same image |
//! | create from the golden snapshot + exec | `runsc run` of the same template until ready |
//!
//! The floor is `torpor sandbox-agent -- --torpor-spawn-floor` (`torpor_runtime::agent::floor`)
//! run inside the sandbox by one exec: it starts `/bin/true` as the agent starts an exec's
//! command, back to back, and times each start to its reaped exit. Torpor's execs and floor
//! batches alternate, so that load drift on a shared machine hits both alike.
//!
//! `TORPOR_BENCH_ROWS=exec` stops after the exec rows (for iterating on the exec path);
//! `TORPOR_BENCH_ROWS=parked` runs only the compressible agents' wakes from Parked (a Python
//! agent's objects, and 64 MiB of text);
//! `TORPOR_BENCH_REENCODE=false` runs the daemon with `--reencode-images false`;
//! `TORPOR_BENCH_LIVE_RESTORE=false` with `--live-restore false` (no shims).
//!
//! Prints a table (with each row's p50 difference to its baseline) and one JSON line
//! (`{"bench":"runtime",...}`, with `exec_overhead_over_floor_p50_ms` and
//! `exec_overhead_over_floor_bare_client_p50_ms`).
//!
//! The client runs on a current-thread runtime: nothing else runs in the bench while it waits.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use torpor_api::types::{CreateSandboxBody, ExecBody};
use torpor_core::{IdlePolicy, Limits, TemplateName, TemplateSource, TemplateSpec, Tier};

mod support;
use support::pct;

/// A main process with 64 MiB of incompressible memory resident.
/// It writes /tmp/ready once its memory is filled: the point where an agent can serve.
const AGENT_64M: &str = "import os, time\nblob = os.urandom(64 << 20)\nopen('/tmp/ready', 'w').write('1')\nwhile True: time.sleep(3600)\n";
/// A main process with 64 MiB of text resident: base64 of random bytes, 6 bits of entropy a
/// byte (deflate takes it to ~3/4, and inflating it costs what text-like state costs).
const AGENT_64M_TEXT: &str = "import os, base64, time\nblob = base64.b64encode(os.urandom(48 << 20))\nopen('/tmp/ready', 'w').write('1')\nwhile True: time.sleep(3600)\n";

struct Row {
    name: &'static str,
    torpor: Vec<f64>,
    baseline_name: &'static str,
    baseline: Vec<f64>,
}

fn runsc_global(root: &Path) -> Vec<String> {
    vec![
        format!("--root={}", root.display()),
        "--platform=ptrace".into(),
        "--network=none".into(),
        "--overlay2=root:memory".into(),
    ]
}

fn timed(cmd: &mut Command) -> f64 {
    let t = Instant::now();
    let out = cmd.stdin(Stdio::null()).output().expect("runsc runs");
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    ms
}

/// A copy of a live sandbox's bundle, for a baseline container with its own id and cgroup.
fn copy_bundle(src: &Path, dest: &Path, cid: &str) {
    std::fs::create_dir_all(dest).unwrap();
    let mut spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    spec["linux"]["cgroupsPath"] = serde_json::json!(format!("/torpor-bench/{cid}"));
    std::fs::write(dest.join("config.json"), serde_json::to_vec(&spec).unwrap()).unwrap();
}

/// The bundle directory of a live container (a warm-pool worker's), from `runsc state`.
fn bundle_of(data: &Path, cid: &str) -> PathBuf {
    let mut args = runsc_global(&data.join("runsc"));
    args.extend(["state".into(), cid.into()]);
    let out = Command::new("runsc")
        .args(&args)
        .output()
        .expect("runsc runs");
    let state: serde_json::Value = serde_json::from_slice(&out.stdout).expect("runsc state JSON");
    PathBuf::from(state["bundle"].as_str().expect("a bundle path"))
}

fn latest_image(data: &Path, id: &str) -> PathBuf {
    let dir = data.join("sandboxes").join(id).join("images");
    std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'))
        .expect("a committed image")
}

/// A Python agent whose state compresses as an agent's usually does (interpreter, modules,
/// ~150,000 small objects: tens of MB), ready once built.
const AGENT_OBJECTS: &str = "import json, time, email.parser, http.client, decimal, collections\ndata = [{'id': i, 'name': 'item %d' % i, 'tags': ['a', 'b']} for i in range(150000)]\nopen('/tmp/ready', 'w').write('1')\nwhile True: time.sleep(3600)\n";

/// `--reencode-images` for the bench's daemon: `TORPOR_BENCH_REENCODE=false` turns it off (to
/// compare), else on (the default).
fn reencode_flag() -> &'static str {
    match std::env::var("TORPOR_BENCH_REENCODE").as_deref() {
        Ok("false") => "false",
        _ => "true",
    }
}

/// `--live-restore` for the bench's daemon: `TORPOR_BENCH_LIVE_RESTORE=false` runs runsc as the
/// daemon's own child (no shim), to see what the shims cost on each row.
fn live_restore_flag() -> &'static str {
    match std::env::var("TORPOR_BENCH_LIVE_RESTORE").as_deref() {
        Ok("false") => "false",
        _ => "true",
    }
}

/// The daemon's count of finished re-encodes of parked images, whatever their result.
/// A sandbox of `template`, running.
async fn sandbox_of(c: &torpor_api::client::Client, template: &str) -> String {
    c.create_sandbox(&CreateSandboxBody {
        template: template.into(),
        ..Default::default()
    })
    .await
    .unwrap()
    .id
}

async fn reencodes(c: &torpor_api::client::Client) -> f64 {
    let m = c.metrics().await.unwrap();
    m.lines()
        .filter(|l| l.starts_with("torpor_parked_reencodes_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Whether the gVisor image at `path` has stored (uncompressed) frames.
fn stored_frames(path: &Path) -> bool {
    let img = std::fs::read(path).unwrap();
    let layout = torpor_snapshot::gvisor::probe(std::io::Cursor::new(&img))
        .unwrap()
        .expect("a gVisor image");
    let first = u32::from_be_bytes(img[layout.header.len()..][..4].try_into().unwrap());
    first as usize == torpor_snapshot::gvisor::stored_deflate_len(layout.frame_size as usize)
}

/// A bare `runsc restore --detach` of `image` into container `cid` (bundle `bundle`), timed
/// in ms; the container is deleted after.
fn bare_restore_of(root: &Path, image: &Path, bundle: &Path, cid: &str) -> f64 {
    let mut args = runsc_global(root);
    args.extend([
        "restore".into(),
        "--detach".into(),
        format!("--image-path={}", image.display()),
        format!("--bundle={}", bundle.display()),
        cid.to_string(),
    ]);
    let ms = timed(Command::new("runsc").args(&args).stdout(Stdio::null()));
    let mut del = runsc_global(root);
    del.extend(["delete".into(), "--force".into(), cid.to_string()]);
    let _ = Command::new("runsc").args(&del).output();
    ms
}

/// `n` wakes from Parked (+ exec) of sandbox `id`, each against a bare `runsc restore` of
/// runsc's own image of the same checkpoint: the image's files are hard-linked the moment the
/// park returns, so a later re-encoding (which renames a new file over them) leaves the
/// baseline's copy as runsc wrote it. With `reencoded > 0`, each wake first waits (up to
/// 60 s) for the daemon to finish re-encoding the new image (the count of finished
/// re-encodes passes `reencoded` more). Answers (torpor ms, bare restore ms).
async fn parked_wakes(
    c: &torpor_api::client::Client,
    data: &Path,
    tmp: &Path,
    baseline_root: &Path,
    id: &str,
    n: usize,
    reencoded: usize,
) -> (Vec<f64>, Vec<f64>) {
    let true_cmd = ExecBody {
        cmd: vec!["/bin/true".into()],
        ..Default::default()
    };
    let mut parked = Vec::new();
    let mut bare_restore = Vec::new();
    let mut stored_woken = 0;
    for i in 0..n {
        let gen = 1 + i as u32; // the generation now running
        let bundle = bundle_of(data, &format!("{id}-g{gen}"));
        let bcid = format!("bench-restore-{id}-{i}");
        let bbundle = tmp.join(&bcid);
        copy_bundle(&bundle, &bbundle, &bcid);
        let before = reencodes(c).await;
        c.suspend(id, Some(Tier::Parked)).await.unwrap();
        let committed = latest_image(data, id);
        let image = tmp.join(format!("img-{id}-{i}"));
        std::fs::create_dir_all(&image).unwrap();
        for e in std::fs::read_dir(&committed).unwrap().flatten() {
            std::fs::hard_link(e.path(), image.join(e.file_name())).unwrap();
        }
        assert!(
            reencoded == 0 || !stored_frames(&image.join("checkpoint.img")),
            "the baseline's image was re-encoded before it was linked"
        );
        if reencoded > 0 {
            let deadline = Instant::now() + std::time::Duration::from_secs(60);
            while reencodes(c).await < before + reencoded as f64 && Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            stored_woken += usize::from(stored_frames(&committed.join("checkpoint.img")));
        }
        // Baseline first, on runsc's own image of the checkpoint torpor restores next.
        bare_restore.push(bare_restore_of(baseline_root, &image, &bbundle, &bcid));
        let _ = std::fs::remove_dir_all(&image);

        let t = Instant::now();
        let r = c.exec(id, &true_cmd).await.unwrap();
        parked.push(t.elapsed().as_secs_f64() * 1000.0);
        assert_eq!(r.exit_code, Some(0));
    }
    if reencoded > 0 {
        println!("{stored_woken} of {n} wakes restored a re-encoded (stored-frame) image");
    }
    (parked, bare_restore)
}

/// An agent with compressible state: creates from its template's golden snapshot (+ exec)
/// against a bare `runsc restore` of that golden image as the daemon holds it (re-encoded
/// with `--reencode-images`, the default: compare runs with `TORPOR_BENCH_REENCODE=false` for
/// the gain), and wakes from Parked, where torpor re-encodes the parked image, against a bare
/// restore of runsc's own image.
async fn compressible_rows(
    c: &torpor_api::client::Client,
    data: &Path,
    tmp: &Path,
    baseline_root: &Path,
    spec: &dyn Fn(&str, Vec<String>) -> TemplateSpec,
    n: usize,
) -> Vec<Row> {
    c.create_template(&spec(
        "bench-objects",
        vec!["python3".into(), "-c".into(), AGENT_OBJECTS.into()],
    ))
    .await
    .unwrap();
    let id = sandbox_of(c, "bench-objects").await;
    let true_cmd = ExecBody {
        cmd: vec!["/bin/true".into()],
        ..Default::default()
    };
    let golden = data.join("templates/bench-objects/golden");
    let bundle = bundle_of(data, &format!("{id}-g1"));
    let (mut creates, mut golden_restores) = (Vec::new(), Vec::new());
    for i in 0..n.min(10) {
        let bcid = format!("bench-golden-{i}");
        let bbundle = tmp.join(&bcid);
        copy_bundle(&bundle, &bbundle, &bcid);
        golden_restores.push(bare_restore_of(baseline_root, &golden, &bbundle, &bcid));

        let t = Instant::now();
        let sid = sandbox_of(c, "bench-objects").await;
        c.exec(&sid, &true_cmd).await.unwrap();
        creates.push(t.elapsed().as_secs_f64() * 1000.0);
        c.delete_sandbox(&sid).await.unwrap();
    }
    let wait = usize::from(reencode_flag() == "true");
    let (torpor, baseline) = parked_wakes(c, data, tmp, baseline_root, &id, n, wait).await;
    c.create_template(&spec(
        "bench-text",
        vec!["python3".into(), "-c".into(), AGENT_64M_TEXT.into()],
    ))
    .await
    .unwrap();
    let text = sandbox_of(c, "bench-text").await;
    let (text_torpor, text_baseline) =
        parked_wakes(c, data, tmp, baseline_root, &text, n, wait).await;
    let _ = c.delete_sandbox(&text).await;
    vec![
        Row {
            name: "wake from Parked (64 MiB of text) + exec",
            torpor: text_torpor,
            baseline_name: "bare runsc restore of runsc's image",
            baseline: text_baseline,
        },
        Row {
            name: "create from golden (Python agent, compressible state) + exec",
            torpor: creates,
            baseline_name: "bare runsc restore of that golden image",
            baseline: golden_restores,
        },
        Row {
            name: "wake from Parked (Python agent, compressible state) + exec",
            torpor,
            baseline_name: "bare runsc restore of runsc's image",
            baseline,
        },
    ]
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let n: usize = std::env::var("TORPOR_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let d = support::Daemon::start(&[
        "--workers",
        "8",
        "--reencode-images",
        reencode_flag(),
        "--live-restore",
        live_restore_flag(),
    ])
    .await;
    let (c, data) = (d.client.clone(), d.data());
    let tmp = &d.dir;
    let baseline_root = tmp.path().join("baseline-runsc");
    std::fs::create_dir_all(&baseline_root).unwrap();
    let no_idle = IdlePolicy {
        freeze_after_s: None,
        park_after_s: None,
        suspend_after_s: None,
    };
    let spec = |name: &str, command: Vec<String>| TemplateSpec {
        name: TemplateName::new(name).unwrap(),
        source: TemplateSource::Host,
        command,
        env: Default::default(),
        cwd: None,
        limits: Limits {
            memory_mib: 512,
            cpus: 1.0,
            pids: 256,
        },
        idle: no_idle,
        warmup_ms: 1500,
        gpu: None,
        network: None,
    };
    let true_cmd = ExecBody {
        cmd: vec!["/bin/true".into()],
        ..Default::default()
    };
    let mut rows = Vec::new();
    if std::env::var("TORPOR_BENCH_ROWS").as_deref() == Ok("parked") {
        rows.extend(compressible_rows(&c, &data, tmp.path(), &baseline_root, &spec, n).await);
        report(rows, n);
        return;
    }

    // --- exec round trip
    c.create_template(&spec("bench-plain", vec![]))
        .await
        .unwrap();
    let id = sandbox_of(&c, "bench-plain").await;
    // The same agent letting go of its channel as soon as it reads an exec (as before the
    // thread running an exec kept it), for the paired row.
    let eager = TemplateSpec {
        env: [(
            torpor_runtime::agent::BENCH_EAGER_HANDOFF.to_string(),
            "1".to_string(),
        )]
        .into(),
        ..spec("bench-eager", vec![])
    };
    c.create_template(&eager).await.unwrap();
    let eager_id = sandbox_of(&c, "bench-eager").await;
    // The floor: the agent binary, mounted in every sandbox, in its spawn-floor mode.
    let mount = torpor_runtime::spec::AGENT_MOUNT;
    let floor_as = |k: usize, user: &[&str]| {
        let mut cmd = vec![
            format!("{mount}/ld.so"),
            "--library-path".into(),
            format!("{mount}/lib"),
            format!("{mount}/torpor"),
            "sandbox-agent".into(),
            "--".into(),
            torpor_runtime::agent::floor::FLAG.into(),
            k.to_string(),
        ];
        cmd.extend(user.iter().map(|s| s.to_string()));
        cmd.push("/bin/true".into());
        ExecBody {
            cmd,
            ..Default::default()
        }
    };
    let floor_cmd = |k: usize| floor_as(k, &[]);
    let floor_ms = |r: &torpor_control::ExecResult| -> Vec<f64> {
        assert_eq!(r.exit_code, Some(0), "spawn floor: {}", r.stderr);
        let v: serde_json::Value =
            serde_json::from_str(r.stdout.lines().next().unwrap_or_default()).expect("floor JSON");
        v["spawn_us"]
            .as_array()
            .expect("spawn_us")
            .iter()
            .map(|us| us.as_f64().unwrap() / 1000.0)
            .collect()
    };
    // A Spawn as another user (E2B's `base`): the agent's clone(CLONE_VM|CLONE_VFORK) start
    // against the standard library's fork fallback it used before, alternating.
    let (mut as_user_vfork, mut as_user_fork) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        c.exec(&id, &true_cmd).await.unwrap();
        c.exec(&eager_id, &true_cmd).await.unwrap();
    }
    let mut outside_eager = Vec::new();
    c.exec(&id, &floor_cmd(5)).await.unwrap();
    let mut torpor_exec = Vec::new();
    let mut agent_spawn = Vec::new();
    let mut outside = Vec::new();
    let mut floor = Vec::new();
    let mut floor_std = Vec::new();
    // The same exec and a call that does not reach the agent, through a bare HTTP/1.1 client:
    // how much of the figure above is the client's.
    let token = std::fs::read_to_string(data.join("admin-token")).unwrap();
    let mut raw = support::RawHttp::connect(&d.url, token.trim());
    let exec_path = format!("/v1/sandboxes/{id}/exec");
    let true_json = serde_json::to_vec(&true_cmd).unwrap();
    let (mut raw_exec, mut raw_get) = (Vec::new(), Vec::new());
    // A request the agent answers with one failed `open`: the channel's round trip.
    let (missing_path, mut raw_read) = (
        format!("/v1/sandboxes/{id}/files?path=/no-such-file"),
        Vec::new(),
    );
    const BATCH: usize = 10;
    for _ in 0..(n * 3).div_ceil(BATCH) {
        for _ in 0..BATCH {
            let t = Instant::now();
            let r = c.exec(&id, &true_cmd).await.unwrap();
            torpor_exec.push(t.elapsed().as_secs_f64() * 1000.0);
            assert_eq!(r.exit_code, Some(0));
            agent_spawn.push(r.duration_ms);
            outside.push(torpor_exec.last().unwrap() - r.duration_ms);
            let t = Instant::now();
            let (status, body) = raw.request("POST", &exec_path, Some(&true_json));
            raw_exec.push(t.elapsed().as_secs_f64() * 1000.0);
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
            let t = Instant::now();
            let (status, _) = raw.request("GET", &format!("/v1/sandboxes/{id}"), None);
            raw_get.push(t.elapsed().as_secs_f64() * 1000.0);
            assert_eq!(status, 200);
            let t = Instant::now();
            let (status, _) = raw.request("GET", &missing_path, None);
            raw_read.push(t.elapsed().as_secs_f64() * 1000.0);
            assert_eq!(status, 404);
        }
        floor.extend(floor_ms(&c.exec(&id, &floor_cmd(BATCH)).await.unwrap()));
        floor_std.extend(floor_ms(
            &c.exec(&id, &floor_as(BATCH, &["--std"])).await.unwrap(),
        ));
        let vfork = floor_as(BATCH, &["--uid", "1000:1000"]);
        as_user_vfork.extend(floor_ms(&c.exec(&id, &vfork).await.unwrap()));
        let fork = floor_as(BATCH, &["--uid-std", "1000:1000"]);
        as_user_fork.extend(floor_ms(&c.exec(&id, &fork).await.unwrap()));
        // In a batch of its own: what the other agent does after letting go of its channel
        // (its next reader's wake and read) stays out of the other rows.
        for _ in 0..BATCH {
            let t = Instant::now();
            let r = c.exec(&eager_id, &true_cmd).await.unwrap();
            assert_eq!(r.exit_code, Some(0));
            outside_eager.push(t.elapsed().as_secs_f64() * 1000.0 - r.duration_ms);
        }
    }
    rows.push(Row {
        name: "exec `true` (running) over its floor",
        torpor: torpor_exec.clone(),
        baseline_name: "exec `true` floor (in-sandbox spawn)",
        baseline: floor.clone(),
    });
    rows.push(Row {
        name: "exec `true` over floor, bare client",
        torpor: raw_exec,
        baseline_name: "exec `true` floor (in-sandbox spawn)",
        baseline: floor.clone(),
    });
    rows.push(Row {
        name: "exec `true`: agent's spawn→exit",
        torpor: agent_spawn,
        baseline_name: "exec `true` floor (in-sandbox spawn)",
        baseline: floor.clone(),
    });
    rows.push(Row {
        name: "spawn `true`: clone-vfork (now)",
        torpor: floor,
        baseline_name: "std's posix_spawn (before)",
        baseline: floor_std,
    });
    rows.push(Row {
        name: "spawn `true` as uid 1000: clone-vfork",
        torpor: as_user_vfork,
        baseline_name: "as uid 1000: std's fork (before)",
        baseline: as_user_fork,
    });
    // What an exec costs besides the agent's spawn → exit: HTTP, the engine, the agent channel
    // both ways, the agent's reading, dispatch and reply. Its baseline is nothing (0 ms).
    rows.push(Row {
        name: "exec `true`: all but the agent's spawn",
        torpor: outside.clone(),
        baseline_name: "(per exec: total − agent's spawn→exit)",
        baseline: vec![0.0],
    });
    // The agent's thread keeping the channel through an exec against it letting go at once.
    rows.push(Row {
        name: "exec `true`: all but the spawn, channel kept (now)",
        torpor: outside,
        baseline_name: "channel handed off at once (before)",
        baseline: outside_eager,
    });
    // The daemon's share without the agent: HTTP, auth, a store read, JSON.
    rows.push(Row {
        name: "GET sandbox, bare client (no agent)",
        torpor: raw_get,
        baseline_name: "(nothing)",
        baseline: vec![0.0],
    });
    rows.push(Row {
        name: "read of a missing file, bare client (agent round trip)",
        torpor: raw_read,
        baseline_name: "(nothing)",
        baseline: vec![0.0],
    });
    let cid = format!("{id}-g1");
    let mut runsc_exec = Vec::new();
    for _ in 0..n {
        let mut args = runsc_global(&data.join("runsc"));
        args.extend(["exec".into(), cid.clone(), "/bin/true".into()]);
        runsc_exec.push(timed(Command::new("runsc").args(&args)));
    }
    rows.insert(
        0,
        Row {
            name: "exec `true` (running)",
            torpor: torpor_exec.clone(),
            baseline_name: "runsc exec",
            baseline: runsc_exec,
        },
    );
    if std::env::var("TORPOR_BENCH_ROWS").as_deref() == Ok("exec") {
        report(rows, n);
        return;
    }

    // --- wake from Frozen
    let mut frozen = Vec::new();
    for _ in 0..n * 2 {
        c.suspend(&id, Some(Tier::Frozen)).await.unwrap();
        let t = Instant::now();
        c.exec(&id, &true_cmd).await.unwrap();
        frozen.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    rows.push(Row {
        name: "wake from Frozen + exec",
        torpor: frozen,
        baseline_name: "exec, running",
        baseline: torpor_exec,
    });
    let mut resume_api = Vec::new();
    let mut runsc_resume = Vec::new();
    for _ in 0..n * 2 {
        c.suspend(&id, Some(Tier::Frozen)).await.unwrap();
        let t = Instant::now();
        c.resume(&id).await.unwrap();
        resume_api.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    for _ in 0..n {
        let root = data.join("runsc");
        let mut pause = runsc_global(&root);
        pause.extend(["pause".into(), cid.clone()]);
        timed(Command::new("runsc").args(&pause));
        let mut resume = runsc_global(&root);
        resume.extend(["resume".into(), cid.clone()]);
        runsc_resume.push(timed(Command::new("runsc").args(&resume)));
    }
    rows.push(Row {
        name: "wake from Frozen (resume API)",
        torpor: resume_api,
        baseline_name: "runsc resume (paused)",
        baseline: runsc_resume,
    });

    // --- wake from Parked, 64 MiB resident
    c.create_template(&spec(
        "bench-64m",
        vec!["python3".into(), "-c".into(), AGENT_64M.into()],
    ))
    .await
    .unwrap();
    let id = sandbox_of(&c, "bench-64m").await;
    let (parked, bare_restore) =
        parked_wakes(&c, &data, tmp.path(), &baseline_root, &id, n, 0).await;
    rows.push(Row {
        name: "wake from Parked (64 MiB) + exec",
        torpor: parked,
        baseline_name: "bare runsc restore",
        baseline: bare_restore,
    });
    rows.extend(compressible_rows(&c, &data, tmp.path(), &baseline_root, &spec, n).await);

    // --- create from golden vs cold boot of the same template
    let mut create = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..n.min(20) {
        let t = Instant::now();
        let sid = sandbox_of(&c, "bench-64m").await;
        c.exec(&sid, &true_cmd).await.unwrap();
        create.push(t.elapsed().as_secs_f64() * 1000.0);
        c.suspend(&sid, Some(Tier::Parked)).await.unwrap();
        ids.push(sid);
    }
    let runsc = torpor_runtime::Runsc::detect(
        None,
        Some("ptrace".into()),
        baseline_root.clone(),
        tmp.path().join("baseline-logs"),
    )
    .unwrap();
    let live_bundle = bundle_of(&data, &format!("{id}-g{}", n + 1));
    let live: serde_json::Value =
        serde_json::from_slice(&std::fs::read(live_bundle.join("config.json")).unwrap()).unwrap();
    let mut boot = Vec::new();
    for i in 0..n.min(20) {
        let bcid = format!("bench-boot-{i}");
        let spec = torpor_runtime::ContainerSpec {
            rootfs: PathBuf::from(live["root"]["path"].as_str().unwrap()),
            // The template's own mounts: binds, but for the agent's (the runtime adds /proc,
            // the boot id's tmpfs, /dev, /sys and /tmp itself).
            mounts: live["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|m| {
                    m["type"] == "bind" && m["destination"] != torpor_runtime::spec::AGENT_MOUNT
                })
                .map(|m| serde_json::from_value(m.clone()).unwrap())
                .collect(),
            agent_dir: PathBuf::from(
                live["mounts"].as_array().unwrap().last().unwrap()["source"]
                    .as_str()
                    .unwrap(),
            ),
            argv: live["process"]["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap().to_string())
                .collect(),
            env: Default::default(),
            cwd: "/".into(),
            limits: Limits::default(),
            hostname: "bench".into(),
            netns: None,
            devices: Vec::new(),
        };
        let t = Instant::now();
        let container = runsc
            .boot(
                &bcid,
                &tmp.path().join(&bcid),
                &spec,
                Duration::from_secs(60),
            )
            .await
            .unwrap();
        // Ready means what it means for the golden snapshot: the agent has filled its memory.
        loop {
            let (reply, _) = container
                .conn
                .call(
                    &torpor_runtime::proto::Request::ReadFile {
                        path: "/tmp/ready".into(),
                        max_bytes: 16,
                    },
                    &[],
                )
                .await
                .unwrap();
            if matches!(reply, torpor_runtime::proto::Reply::Data { .. }) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        boot.push(t.elapsed().as_secs_f64() * 1000.0);
        container.expect_exit();
        runsc.destroy(&bcid).await;
    }
    rows.push(Row {
        name: "create (64 MiB agent) + exec",
        torpor: create,
        baseline_name: "runsc run until ready",
        baseline: boot,
    });
    for id in ids {
        let _ = c.delete_sandbox(&id).await;
    }

    report(rows, n);
    drop(d);
}

fn report(mut rows: Vec<Row>, n: usize) {
    println!(
        "\n{:<36} {:>9} {:>9} {:>9} | {:<36} {:>9} {:>9} | {:>7} {:>8}",
        "torpor", "p50 ms", "p95 ms", "p99 ms", "baseline", "p50 ms", "p95 ms", "p50 x", "Δp50 ms"
    );
    let mut json_rows = Vec::new();
    let (mut over_floor, mut over_floor_bare) = (None, None);
    for r in &mut rows {
        let (t50, t95, t99) = (
            pct(&mut r.torpor, 50.0),
            pct(&mut r.torpor, 95.0),
            pct(&mut r.torpor, 99.0),
        );
        let (b50, b95) = (pct(&mut r.baseline, 50.0), pct(&mut r.baseline, 95.0));
        println!(
            "{:<36} {:>9.2} {:>9.2} {:>9.2} | {:<36} {:>9.2} {:>9.2} | {:>7.2} {:>+8.2}",
            r.name,
            t50,
            t95,
            t99,
            r.baseline_name,
            b50,
            b95,
            t50 / b50,
            t50 - b50
        );
        if r.name == "exec `true` (running) over its floor" {
            over_floor = Some(t50 - b50);
        }
        if r.name == "exec `true` over floor, bare client" {
            over_floor_bare = Some(t50 - b50);
        }
        json_rows.push(serde_json::json!({
            "name": r.name, "n": r.torpor.len(), "p50_ms": t50, "p95_ms": t95, "p99_ms": t99,
            "baseline": r.baseline_name, "baseline_n": r.baseline.len(),
            "baseline_p50_ms": b50, "baseline_p95_ms": b95,
            "ratio_p50": t50 / b50, "ratio_p95": t95 / b95,
            "overhead_p50_ms": t50 - b50,
        }));
    }
    println!(
        "{}",
        serde_json::json!({"bench": "runtime", "n": n, "rows": json_rows,
            "exec_overhead_over_floor_p50_ms": over_floor,
            "exec_overhead_over_floor_bare_client_p50_ms": over_floor_bare})
    );
}
