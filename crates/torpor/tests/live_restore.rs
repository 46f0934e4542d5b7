//! Live restore: running sandboxes outlive the daemon. Each container's runsc process runs
//! under its own shim (`torpor shim`), which holds the agent channel; a daemon that is SIGKILLed
//! and started again takes every running and frozen sandbox back as it was (memory, processes,
//! files never checkpointed). Only a sandbox whose shim died goes back to its last snapshot.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use torpor_api::types::TemplateSpec;
use torpor_core::{Limits, TemplateName, TemplateSource, Tier};

/// The template's main process counts in memory (a shell variable) and shows the count in a
/// file; a reset (a restore from the template's snapshot) starts it again from where the
/// template build left it.
/// (Written aside and renamed: a reader never sees the file truncated mid-write.)
const COUNTER: &str =
    "n=0; while :; do n=$((n+1)); echo $n > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.5; done";
/// A second counter started by an exec and detached from it.
/// (Both tick twice a second: ten sandboxes ticking ten times a second, each tick two
/// fork+execs under ptrace, kept both cores busy and made this test take minutes.)
const DETACHED: &str =
    "nohup sh -c 'n=0; while :; do n=$((n+1)); echo $n > /tmp/dcount.new; mv /tmp/dcount.new /tmp/dcount; sleep 0.5; done' >/dev/null 2>&1 &";

fn counter_template(name: &str) -> TemplateSpec {
    TemplateSpec {
        name: TemplateName::new(name).unwrap(),
        source: TemplateSource::Host,
        command: vec!["sh".into(), "-c".into(), COUNTER.into()],
        env: Default::default(),
        cwd: None,
        limits: Limits {
            memory_mib: 128,
            cpus: 0.5,
            pids: 32,
        },
        idle: no_idle(),
        warmup_ms: 300,
        gpu: None,
        network: None,
    }
}

/// Both counters and the two marks written after create (a rootfs file and a tmpfs file):
/// `(count, dcount, "<note>|<mem>")`.
async fn probe(c: &torpor_api::Client, id: &str) -> (u64, u64, String) {
    let r = c
        .exec(
            id,
            &sh(
                "cat /tmp/count 2>/dev/null || echo 0; cat /tmp/dcount 2>/dev/null || echo 0; \
                 echo \"$(cat /root/note 2>/dev/null)|$(cat /dev/shm/mem 2>/dev/null)\"",
            ),
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(0), "probe of {id}: {r:?}");
    // Three lines, always (each `cat` has a fallback and the last `echo` always prints).
    assert_eq!(r.stdout.lines().count(), 3, "probe of {id}: {r:?}");
    let mut lines = r.stdout.lines();
    let mut num = || -> u64 { lines.next().unwrap_or("0").trim().parse().unwrap_or(0) };
    let (count, dcount) = (num(), num());
    let marks = r.stdout.lines().nth(2).unwrap_or("").trim().to_string();
    (count, dcount, marks)
}

/// Waits until both counters of `id` passed `past` (they keep counting).
async fn counting_past(c: &torpor_api::Client, id: &str, past: u64) -> (u64, u64, String) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let p = probe(c, id).await;
        if p.0 > past && p.1 > past {
            return p;
        }
        assert!(Instant::now() < deadline, "{id} stopped counting at {p:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The pid of the shim that holds `sandbox`'s container, from the shims' records.
fn shim_of(data_dir: &Path, sandbox: &str) -> i32 {
    for e in std::fs::read_dir(data_dir.join("shims")).unwrap().flatten() {
        let Ok(meta) = std::fs::read(e.path().join("meta.json")) else {
            continue;
        };
        let meta: serde_json::Value = serde_json::from_slice(&meta).unwrap();
        if meta["container_id"]
            .as_str()
            .is_some_and(|c| c.starts_with(&format!("{sandbox}-g")))
        {
            return meta["shim_pid"].as_i64().unwrap() as i32;
        }
    }
    panic!("no shim recorded for {sandbox}");
}

async fn start_counters(c: &torpor_api::Client, n: usize) -> Vec<String> {
    c.create_template(&counter_template("counter"))
        .await
        .unwrap();
    let mut ids = Vec::new();
    for i in 0..n {
        let id = create(c, "counter").await;
        let r = c
            .exec(
                &id,
                &sh(&format!(
                    "echo note-{i} > /root/note && echo mem-{i} > /dev/shm/mem && {DETACHED}"
                )),
            )
            .await
            .unwrap();
        assert_eq!(r.exit_code, Some(0), "{r:?}");
        ids.push(id);
    }
    ids
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkilled_daemon_takes_back_running_and_frozen_sandboxes_with_nothing_lost() {
    let mut d = Daemon::start_with(&["--workers", "12"]).await;
    let c = d.client();
    let ids = start_counters(&c, 10).await;
    // Each counts well past where a restore from the template's snapshot would start.
    let mut before = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let first = probe(&c, id).await;
        let p = counting_past(&c, id, first.0.max(first.1) + 4).await;
        assert_eq!(p.2, format!("note-{i}|mem-{i}"));
        before.push(p);
    }
    // Two are frozen when the daemon dies.
    for id in &ids[..2] {
        let s = c.suspend(id, Some(Tier::Frozen)).await.unwrap();
        assert_eq!(s.state, "frozen");
    }
    // Their counters advanced until the freeze: read them now, before the kill.
    for (i, id) in ids.iter().enumerate().skip(2) {
        before[i] = probe(&c, id).await;
    }

    d.kill();
    d.spawn().await;
    let c = d.client();

    for (i, id) in ids.iter().enumerate() {
        let s = c.sandbox(id).await.unwrap();
        let want = if i < 2 { "frozen" } else { "running" };
        assert_eq!(s.state, want, "{id} after the restart: {s:?}");
        assert_eq!(s.last_error, None, "{id} was not taken back as it was");
    }
    for (i, id) in ids.iter().enumerate() {
        // No reset: both counters go on from at least where they were, and the files written
        // after create (never checkpointed) are there.
        let (count, dcount, marks) = probe(&c, id).await;
        assert!(
            count >= before[i].0 && dcount >= before[i].1,
            "{id}: counters ({count}, {dcount}) went back from {:?}",
            before[i]
        );
        assert_eq!(marks, format!("note-{i}|mem-{i}"), "{id} lost its files");
        counting_past(&c, id, count.max(dcount)).await;
    }
    // The taken-back sandboxes still sleep and wake as usual.
    c.suspend(&ids[3], Some(Tier::Parked)).await.unwrap();
    let (_, _, marks) = probe(&c, &ids[3]).await;
    assert_eq!(marks, "note-3|mem-3");
    assert!(
        d.log().contains("taken back after a restart"),
        "the restart did not say what it took back:\n{}",
        d.log()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_shim_sends_only_its_own_sandbox_back_to_its_snapshot() {
    let mut d = Daemon::start_with(&["--workers", "4"]).await;
    let c = d.client();
    let ids = start_counters(&c, 2).await;
    let (victim, bystander) = (&ids[0], &ids[1]);
    let first = probe(&c, bystander).await;
    counting_past(&c, bystander, first.0.max(first.1) + 2).await;
    let shim = shim_of(&d.dir, victim);
    // SAFETY: kill(2) on the victim's shim, a process this test's daemon started.
    assert_eq!(unsafe { libc::kill(shim, libc::SIGKILL) }, 0);

    // The daemon sees the container go and sends the sandbox back to its snapshot.
    let deadline = Instant::now() + Duration::from_secs(30);
    let s = loop {
        let s = c.sandbox(victim).await.unwrap();
        if s.state != "running" {
            break s;
        }
        assert!(Instant::now() < deadline, "{victim} still running: {s:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        s.last_error.as_deref().is_some_and(|e| !e.is_empty()),
        "the crash is not reported: {s:?}"
    );
    // Its files written since its last snapshot are gone; the bystander lost nothing.
    let (_, _, marks) = probe(&c, victim).await;
    assert_eq!(marks, "|", "{victim} did not go back to its snapshot");
    let before = probe(&c, bystander).await;
    assert_eq!(before.2, "note-1|mem-1");
    counting_past(&c, bystander, before.0.max(before.1)).await;

    // The same with the daemon stopped for an upgrade (SIGQUIT: it leaves the sandboxes
    // running): only the sandbox whose shim died meanwhile goes back.
    let shim = shim_of(&d.dir, bystander);
    let (_, _, marks) = probe(&c, victim).await;
    assert_eq!(marks, "|");
    c.exec(victim, &sh("echo again > /root/note"))
        .await
        .unwrap();
    d.quit();
    assert!(d.log().contains("leaving resident sandboxes running"));
    // SAFETY: kill(2) on the bystander's shim, a process this test's daemon started.
    assert_eq!(unsafe { libc::kill(shim, libc::SIGKILL) }, 0);
    d.spawn().await;
    let c = d.client();
    let (_, _, marks) = probe(&c, victim).await;
    assert_eq!(marks, "again|", "{victim} was not taken back");
    let s = c.sandbox(bystander).await.unwrap();
    assert!(
        s.last_error
            .as_deref()
            .is_some_and(|e| e.contains("restored to its last snapshot")),
        "{s:?}"
    );
    let (_, _, marks) = probe(&c, bystander).await;
    assert_eq!(marks, "|", "{bystander} outlived its shim");
}

#[tokio::test(flavor = "multi_thread")]
async fn without_live_restore_a_restart_sends_running_sandboxes_back_to_their_snapshots() {
    let mut d = Daemon::start_with(&["--live-restore=false"]).await;
    let c = d.client();
    let ids = start_counters(&c, 1).await;
    assert_eq!(probe(&c, &ids[0]).await.2, "note-0|mem-0");
    assert!(
        !d.dir.join("shims").exists()
            || std::fs::read_dir(d.dir.join("shims")).unwrap().count() == 0,
        "a shim was started with live restore off"
    );
    d.kill();
    d.spawn().await;
    let c = d.client();
    assert_eq!(probe(&c, &ids[0]).await.2, "|");
}

/// A GET through the daemon's ingress proxy to `port` of sandbox `id`: (status, body).
async fn proxied(d: &Daemon, id: &str, rest: &str) -> (u16, String) {
    let r = reqwest::Client::new()
        .get(format!("{}/v1/sandboxes/{id}/ports/{rest}", d.url()))
        .bearer_auth(d.token())
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_networked_sandbox_is_taken_back_with_its_server_its_ingress_and_its_egress_policy() {
    let host = host_addr();
    let mut d = Daemon::start_with(&["--sandbox-reach-host", &host]).await;
    let c = d.client();
    let allowed = host_server("from-host").await;
    let other = host_server("not-for-you").await;
    let mut tpl = counter_template("netcounter");
    tpl.network = Some(torpor_core::NetworkPolicy::full());
    c.create_template(&tpl).await.unwrap();
    let id = c
        .create_sandbox(&torpor_api::types::CreateSandboxBody {
            template: "netcounter".into(),
            network: Some(
                serde_json::from_value(
                    serde_json::json!({"allow": [{"cidr": format!("{host}/32"), "ports": [allowed]}]}),
                )
                .unwrap(),
            ),
            ..Default::default()
        })
        .await
        .unwrap()
        .id;
    // A server started after create, on a file written after create: process and file alike
    // exist only in this run of the sandbox.
    let r = c
        .exec(
            &id,
            &torpor_api::types::ExecBody {
                detach: true,
                ..sh("echo served-$$ > /tmp/hello.txt && cd /tmp && exec python3 -m http.server 8080")
            },
        )
        .await
        .unwrap();
    assert!(
        r.stdout.parse::<u32>().is_ok(),
        "detach returns a pid: {r:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let served = loop {
        let (status, body) = proxied(&d, &id, "8080/hello.txt").await;
        if status == 200 {
            break body;
        }
        assert!(Instant::now() < deadline, "never served: {status} {body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let allowed_url = format!("http://{host}:{allowed}/");
    let other_url = format!("http://{host}:{other}/");
    assert_eq!(
        fetch(&c, &id, &allowed_url).await.as_deref(),
        Some("from-host")
    );
    assert_eq!(fetch(&c, &id, &other_url).await, None);

    d.kill();
    d.spawn().await;
    let c = d.client();
    let s = c.sandbox(&id).await.unwrap();
    assert_eq!(
        (s.state.as_str(), s.last_error),
        ("running", None),
        "not taken back"
    );
    // The same server process answers through the proxy, and the policy holds both ways.
    assert_eq!(proxied(&d, &id, "8080/hello.txt").await, (200, served));
    assert_eq!(
        fetch(&c, &id, &allowed_url).await.as_deref(),
        Some("from-host")
    );
    assert_eq!(
        fetch(&c, &id, &other_url).await,
        None,
        "the policy was lost"
    );
    // It still sleeps and wakes (a checkpoint needs the relay's connections settled).
    c.suspend(&id, Some(Tier::Parked)).await.unwrap();
    assert_eq!(
        fetch(&c, &id, &allowed_url).await.as_deref(),
        Some("from-host")
    );
}
