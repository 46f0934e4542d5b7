//! End-to-end: the real `torpor up` with real runsc sandboxes, driven through the API client.

mod common;

use std::time::Duration;

use common::*;
use torpor_api::types::ExecBody;
use torpor_core::{IdlePolicy, Tier};

#[tokio::test(flavor = "multi_thread")]
async fn agent_state_survives_every_tier_and_background_processes_keep_running() {
    let d = Daemon::start().await;
    let c = d.client();
    c.create_template(&agent_template("agent", no_idle()))
        .await
        .unwrap();
    let id = create(&c, "agent").await;
    assert_eq!(call_agent(&c, &id, "one").await, (1, 1));

    // A background process started with detach keeps counting across sleeps.
    let r = c
        .exec(
            &id,
            &ExecBody {
                detach: true,
                ..sh("i=0; while true; do i=$((i+1)); echo $i > /tmp/ticks.new; mv /tmp/ticks.new /tmp/ticks; sleep 0.1; done")
            },
        )
        .await
        .unwrap();
    assert!(
        r.stdout.parse::<u32>().is_ok(),
        "detach returns a pid: {r:?}"
    );
    // The detached loop has written its first tick (a hang guard, not a measure).
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while c.read_file(&id, "/tmp/ticks").await.is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the detached loop never ticked"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let mut expected = 1;
    for tier in [Tier::Frozen, Tier::Parked, Tier::Suspended] {
        let ticks_before: u64 = c
            .read_file(&id, "/tmp/ticks")
            .await
            .map(|b| String::from_utf8_lossy(&b).trim().parse().unwrap_or(0))
            .unwrap();
        let s = c.suspend(&id, Some(tier)).await.unwrap();
        assert_eq!(s.tier, tier.as_str(), "{s:?}");
        assert_eq!(c.sandbox(&id).await.unwrap().state, tier.as_str());
        expected += 1;
        assert_eq!(
            call_agent(&c, &id, tier.as_str()).await,
            (expected, expected),
            "state after waking from {tier}"
        );
        assert_eq!(c.sandbox(&id).await.unwrap().tier, "running");
        // The loop ticks again (a hang guard: a loaded machine may take a while).
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let ticks_after: u64 =
                String::from_utf8_lossy(&c.read_file(&id, "/tmp/ticks").await.unwrap())
                    .trim()
                    .parse()
                    .unwrap();
            if ticks_after > ticks_before {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "background process stopped after {tier}: {ticks_before} -> {ticks_after}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // Explicit resume of a parked sandbox.
    c.suspend(&id, Some(Tier::Parked)).await.unwrap();
    assert_eq!(c.resume(&id).await.unwrap().state, "running");

    let metrics = c.metrics().await.unwrap();
    for name in [
        "torpor_wake_seconds_bucket{from_tier=\"parked\"",
        "torpor_wake_seconds_bucket{from_tier=\"frozen\"",
        "torpor_wake_seconds_bucket{from_tier=\"suspended\"",
        "torpor_checkpoint_seconds",
        "torpor_checkpoint_bytes_total",
        // Suspended goes through the deduplicating snapshot store.
        "torpor_checkpoint_bytes_total{kind=\"store_new\"}",
        "torpor_exec_seconds",
        "torpor_sandboxes{",
    ] {
        assert!(metrics.contains(name), "metrics lack {name}:\n{metrics}");
    }
    c.delete_sandbox(&id).await.unwrap();
    assert_eq!(c.sandbox(&id).await.unwrap_err().code(), Some("not_found"));
    c.delete_template("agent").await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_and_files() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = create(&c, "host").await;

    let r = c
        .exec(&id, &sh("echo out; echo err >&2; exit 3"))
        .await
        .unwrap();
    assert_eq!(
        (r.exit_code, r.stdout.as_str(), r.stderr.as_str()),
        (Some(3), "out\n", "err\n")
    );

    let r = c
        .exec(
            &id,
            &ExecBody {
                cmd: vec!["python3".into(), "-c".into(), "import sys,os; print(sys.stdin.read().upper(), os.environ['GREETING'], os.getcwd())".into()],
                stdin: Some("hello".into()),
                env: [("GREETING".to_string(), "hi".to_string())].into(),
                cwd: Some("/tmp".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(r.stdout, "HELLO hi /tmp\n");

    // Streaming: output arrives as events, then the exit.
    let mut chunks = Vec::new();
    let r = c
        .exec_stream(
            &id,
            &sh("for i in 1 2 3; do echo $i; sleep 0.1; done"),
            |ev| chunks.push(format!("{ev:?}")),
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(0));
    assert!(chunks.len() >= 3, "expected several events, got {chunks:?}");

    // Files: write, read, list, remove; binary-safe.
    let data: Vec<u8> = (0..=255u8).cycle().take(100_000).collect();
    c.write_file(&id, "/work/dir/blob.bin", data.clone(), Some(0o600))
        .await
        .unwrap();
    assert_eq!(c.read_file(&id, "/work/dir/blob.bin").await.unwrap(), data);
    let entries = c.list_files(&id, "/work/dir").await.unwrap();
    assert_eq!(entries.len(), 1);
    assert_eq!(
        (entries[0].name.as_str(), entries[0].size, entries[0].mode),
        ("blob.bin", 100_000, 0o600)
    );
    // Files written anywhere are part of the checkpoint.
    c.suspend(&id, Some(Tier::Parked)).await.unwrap();
    assert_eq!(c.read_file(&id, "/work/dir/blob.bin").await.unwrap(), data);
    c.remove_file(&id, "/work", true).await.unwrap();
    assert_eq!(
        c.read_file(&id, "/work/dir/blob.bin")
            .await
            .unwrap_err()
            .code(),
        Some("file_not_found")
    );
    // The template's /etc is torpor's, never the host's.
    let passwd = String::from_utf8(c.read_file(&id, "/etc/passwd").await.unwrap()).unwrap();
    assert!(
        passwd.starts_with("root:x:0:0:root:/root:/bin/sh"),
        "{passwd}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_bomb_kills_only_its_own_sandbox_and_reports_oom() {
    let d = Daemon::start().await;
    let c = d.client();
    let neighbour = create(&c, "host").await;
    c.write_file(&neighbour, "/keep", b"me".to_vec(), None)
        .await
        .unwrap();
    let bomb = c
        .create_sandbox(&torpor_api::types::CreateSandboxBody {
            template: "host".into(),
            limits: Some(torpor_core::LimitsPatch {
                memory_mib: Some(128),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .id;
    let r = c
        .exec(
            &bomb,
            &ExecBody {
                cmd: vec![
                    "python3".into(),
                    "-c".into(),
                    "x=[]\nwhile True: x.append(bytearray(16 << 20))".into(),
                ],
                timeout_ms: Some(60_000),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(r.oom_killed, "{r:?}");
    let s = c.sandbox(&bomb).await.unwrap();
    assert!(s.oom_killed, "{s:?}");
    assert!(
        s.last_error.as_deref().unwrap_or("").contains("oom"),
        "{s:?}"
    );
    // It went back to its last snapshot and works again.
    let r = c.exec(&bomb, &sh("echo back")).await.unwrap();
    assert_eq!(r.stdout, "back\n");
    // The neighbour never noticed.
    assert_eq!(c.read_file(&neighbour, "/keep").await.unwrap(), b"me");
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_policy_walks_down_the_ladder_and_a_call_wakes() {
    let d = Daemon::start().await;
    let c = d.client();
    c.create_template(&agent_template(
        "sleepy",
        IdlePolicy {
            freeze_after_s: Some(0.5),
            park_after_s: Some(2.0),
            suspend_after_s: Some(4.0),
        },
    ))
    .await
    .unwrap();
    let id = create(&c, "sleepy").await;
    assert_eq!(call_agent(&c, &id, "a").await, (1, 1));
    let mut seen = Vec::new();
    for _ in 0..100 {
        let s = c.sandbox(&id).await.unwrap();
        if seen.last() != Some(&s.tier) {
            seen.push(s.tier.clone());
        }
        if s.tier == "suspended" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(seen, ["running", "frozen", "parked", "suspended"]);
    assert_eq!(call_agent(&c, &id, "b").await, (2, 2));
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_checkpoints_and_the_next_start_resumes() {
    let mut d = Daemon::start().await;
    let c = d.client();
    c.create_template(&agent_template("keep", no_idle()))
        .await
        .unwrap();
    let id = create(&c, "keep").await;
    assert_eq!(call_agent(&c, &id, "a").await, (1, 1));
    assert_eq!(call_agent(&c, &id, "b").await, (2, 2));
    d.stop();
    assert!(d.log().contains("checkpointing"), "{}", d.log());
    d.spawn().await;
    let c = d.client();
    assert_eq!(c.sandbox(&id).await.unwrap().tier, "parked");
    assert_eq!(
        call_agent(&c, &id, "c").await,
        (3, 3),
        "nothing lost across a restart"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_calls_to_a_sleeping_sandbox_share_one_wake() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = create(&c, "host").await;
    c.suspend(&id, Some(Tier::Parked)).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..8 {
        let c = c.clone();
        let id = id.clone();
        tasks.push(tokio::spawn(async move {
            c.exec(&id, &sh(&format!("echo {i}"))).await.unwrap().stdout
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap(), format!("{i}\n"));
    }
    let metrics = c.metrics().await.unwrap();
    let wakes: f64 = metrics
        .lines()
        .find(|l| l.starts_with("torpor_wake_seconds_count{from_tier=\"parked\"}"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert_eq!(wakes, 1.0, "one wake for eight calls");
}

#[tokio::test(flavor = "multi_thread")]
async fn forks_continue_independently_from_the_same_state() {
    let d = Daemon::start().await;
    let c = d.client();
    c.create_template(&agent_template("forky", no_idle()))
        .await
        .unwrap();
    let id = create(&c, "forky").await;
    assert_eq!(call_agent(&c, &id, "a").await, (1, 1));
    assert_eq!(call_agent(&c, &id, "b").await, (2, 2));
    let forks = c.fork(&id, 3).await.unwrap();
    assert_eq!(forks.len(), 3);
    for f in &forks {
        assert_eq!(f.state, "suspended");
        assert_eq!(f.metadata.get("forked_from"), Some(&id));
    }
    // Each fork wakes with the source's memory and files, then goes its own way.
    assert_eq!(call_agent(&c, &forks[0].id, "x").await, (3, 3));
    assert_eq!(call_agent(&c, &forks[0].id, "y").await, (4, 4));
    assert_eq!(call_agent(&c, &forks[1].id, "z").await, (3, 3));
    assert_eq!(
        call_agent(&c, &id, "c").await,
        (3, 3),
        "the source is unchanged"
    );
    assert_eq!(
        c.fork(&id, 0).await.unwrap_err().code(),
        Some("invalid_request")
    );
    for f in &forks {
        c.delete_sandbox(&f.id).await.unwrap();
    }
}

/// Issue 17's cheaper wakes: once parked, a sandbox's image is rewritten in the background with
/// stored frames (counted in `torpor_parked_reencodes_total`), and the next wake restores that
/// image with the sandbox's memory and files intact; a template's golden snapshot is stored
/// that way from its build, and sandboxes are created from it. With `--reencode-images false`
/// both stay as runsc wrote them.
#[tokio::test(flavor = "multi_thread")]
async fn a_parked_image_is_reencoded_with_stored_frames_and_wakes_intact() {
    for reencode in [true, false] {
        let flag = if reencode { "true" } else { "false" };
        let d = Daemon::start_with(&["--reencode-images", flag]).await;
        let c = d.client();
        c.create_template(&agent_template("agent", no_idle()))
            .await
            .unwrap();
        let golden = d.dir.join("templates/agent/golden/checkpoint.img");
        assert_eq!(
            stored_frames(&golden),
            reencode,
            "golden, --reencode-images {flag}"
        );
        let id = create(&c, "agent").await;
        assert_eq!(call_agent(&c, &id, "one").await, (1, 1));
        c.write_file(&id, "/tmp/kept", b"written before the park".to_vec(), None)
            .await
            .unwrap();
        c.suspend(&id, Some(Tier::Parked)).await.unwrap();
        let done = "torpor_parked_reencodes_total{result=\"done\"}";
        if reencode {
            // A hang guard, not a measure.
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            loop {
                let m = c.metrics().await.unwrap();
                if metric(&m, done) >= 1 {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the parked image was never re-encoded:\n{}",
                    m.lines()
                        .filter(|l| l.contains("reencode"))
                        .collect::<Vec<_>>()
                        .join("\n")
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        // The image on disk: every frame stored once re-encoded, compressed otherwise.
        let images = d.dir.join("sandboxes").join(&id).join("images");
        let dir = std::fs::read_dir(&images)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .find(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'))
            .expect("a committed image");
        assert_eq!(
            stored_frames(&dir.join("checkpoint.img")),
            reencode,
            "parked, {flag}"
        );
        // No temporary file left beside it.
        let left: Vec<_> = std::fs::read_dir(&images)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".tmp-reencode"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
        // The wake restores it: the same process (its counter) and files.
        assert_eq!(
            call_agent(&c, &id, "two").await,
            (2, 2),
            "--reencode-images {flag}"
        );
        assert_eq!(
            c.read_file(&id, "/tmp/kept").await.unwrap(),
            b"written before the park"
        );
        let m = c.metrics().await.unwrap();
        assert_eq!(metric(&m, done), u64::from(reencode), "{flag}");
    }
}

/// Whether the gVisor image at `path` has stored (uncompressed) frames: its first frame takes
/// exactly the stored length of a whole frame.
fn stored_frames(path: &std::path::Path) -> bool {
    use torpor_snapshot::gvisor;
    let img = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let layout = gvisor::probe(std::io::Cursor::new(&img)).unwrap().unwrap();
    let first = u32::from_be_bytes(img[layout.header.len()..][..4].try_into().unwrap());
    first as usize == gvisor::stored_deflate_len(layout.frame_size as usize)
}
