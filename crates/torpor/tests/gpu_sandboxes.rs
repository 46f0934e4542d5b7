//! GPU shares of real runsc sandboxes through the real daemon (`torpor up --gpu-inventory`):
//! the share is taken at create, injected into every exec, given back when the sandbox is
//! Parked or Suspended, taken again on wake (or refused with `gpu_unavailable`), and charged to
//! the tenant's GPU quota. The inventory is declared (no GPU on this machine).

mod common;

use std::path::PathBuf;

use common::{sh, Daemon};
use serde_json::{json, Value};
use torpor_api::types::CreateSandboxBody;
use torpor_api::Client;
use torpor_core::Tier;

fn local(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/gpu")
        .join(name)
        .display()
        .to_string()
}

async fn create_with_gpu(c: &Client, gpu: Value) -> Result<String, torpor_api::ClientError> {
    c.create_sandbox(&CreateSandboxBody {
        template: "host".into(),
        gpu: Some(gpu),
        ..Default::default()
    })
    .await
    .map(|s| s.id)
}

/// The sandbox's environment as its processes see it.
async fn env_of(c: &Client, id: &str) -> std::collections::BTreeMap<String, String> {
    let r = c.exec(id, &sh("env")).await.unwrap();
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    r.stdout
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn held_by<'a>(status: &'a Value, id: &str) -> Option<&'a Value> {
    status["allocations"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["sandbox"] == id)
}

async fn suspend(c: &Client, id: &str, tier: Tier) {
    c.suspend(id, Some(tier))
        .await
        .unwrap_or_else(|e| panic!("suspend {id} to {tier:?}: {e}"));
}

#[tokio::test]
async fn gpu_share_follows_the_sleep_ladder() {
    let d = Daemon::start_with(&[
        "--gpu-inventory",
        &local("node-h200-l4.toml"),
        "--gpu-quotas",
        &local("quotas-admin.toml"),
    ])
    .await;
    let c = d.client();

    // A MIG 3g instance on the H200: the exec environment names its MIG device.
    let mig = create_with_gpu(&c, json!({"mode": "mig", "profile": "3g.71gb"}))
        .await
        .unwrap();
    let env = env_of(&c, &mig).await;
    let visible = env["NVIDIA_VISIBLE_DEVICES"].clone();
    assert!(visible.starts_with("MIG-"), "{env:?}");
    assert_eq!(env["CUDA_VISIBLE_DEVICES"], visible);
    let status = c.gpus().await.unwrap();
    assert_eq!(status["node"], "test-gpu-node");
    let share = held_by(&status, &mig).expect("the MIG sandbox holds a share");
    assert_eq!(
        share["devices"][0],
        json!({"gpu_index": 0, "gpu_uuid": "GPU-0e200000-0000-4000-8000-000000000000",
               "mode": "mig", "profile": "3g.71gb", "start": 4})
    );
    assert_eq!(status["gpus"][0]["mode"], "mig");
    assert_eq!(status["gpus"][0]["free"]["mig_memory_slices"], 4);

    // A whole GPU: the L4 (the H200 is in MIG mode with a share).
    let whole = create_with_gpu(&c, json!({"mode": "whole"})).await.unwrap();
    let env = env_of(&c, &whole).await;
    assert_eq!(
        env["NVIDIA_VISIBLE_DEVICES"],
        "GPU-14000000-0000-4000-8000-0000000000aa"
    );
    assert!(!env.contains_key("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"));
    // The caller's own variables still come on top.
    let mut body = sh("echo $CUDA_VISIBLE_DEVICES $MINE");
    body.env = [("MINE".to_owned(), "x".to_owned())].into();
    let r = c.exec(&whole, &body).await.unwrap();
    assert_eq!(
        r.stdout.trim(),
        "GPU-14000000-0000-4000-8000-0000000000aa x"
    );

    // Quota: the admin tenant may hold 100,000 MiB; 3g (71,885) + L4 (23,034) + 1g (17,971)
    // would be 112,890.
    let err = create_with_gpu(&c, json!({"mode": "mig", "profile": "1g.18gb"}))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("gpu_quota_exceeded"), "{err}");
    assert!(err.to_string().contains("100000"), "{err}");

    // Parked: the share is given back and shows as free capacity.
    suspend(&c, &mig, Tier::Parked).await;
    let status = c.gpus().await.unwrap();
    assert!(held_by(&status, &mig).is_none());
    assert_eq!(status["gpus"][0]["free"]["mig_memory_slices"], 8);
    assert_eq!(status["gpus"][0]["shares"], 0);
    assert!(status["sleeping"].as_array().unwrap().contains(&json!(mig)));
    let metrics = d.client().metrics().await.unwrap();
    assert!(
        metrics.contains("torpor_gpu_free{node=\"test-gpu-node\",gpu=\"0\",UUID=\"GPU-0e200000-0000-4000-8000-000000000000\",mode=\"mig\",resource=\"mig_memory_slices\"} 8"),
        "{metrics}"
    );
    assert!(
        metrics.contains("torpor_gpu_quota_used{tenant=\"admin\",resource=\"memory_mib\"} 23034")
    );

    // Wake (an exec): the same MIG placement is free, so it comes back unchanged.
    let env = env_of(&c, &mig).await;
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], visible);
    let status = c.gpus().await.unwrap();
    assert!(held_by(&status, &mig).is_some());
    assert_eq!(status["gpus"][0]["free"]["mig_memory_slices"], 4);

    // Suspended (snapshot store): free again; a new whole sandbox takes the L4 meanwhile, so
    // the sleeping one cannot wake: gpu_unavailable, and it stays asleep.
    suspend(&c, &whole, Tier::Suspended).await;
    let status = c.gpus().await.unwrap();
    assert!(held_by(&status, &whole).is_none());
    assert_eq!(status["gpus"][1]["free"]["whole_gpus"], 1);
    let thief = create_with_gpu(&c, json!({"mode": "whole"})).await.unwrap();
    let err = c.exec(&whole, &sh("true")).await.unwrap_err();
    assert_eq!(err.code(), Some("gpu_unavailable"), "{err}");
    if let torpor_api::ClientError::Api { status, .. } = &err {
        assert_eq!(*status, 503);
    }
    let s = c.sandbox(&whole).await.unwrap();
    assert_eq!(s.tier, "suspended", "{s:?}");
    // Once the L4 is free again the wake works, with its state and the L4.
    c.delete_sandbox(&thief).await.unwrap();
    let env = env_of(&c, &whole).await;
    assert_eq!(
        env["NVIDIA_VISIBLE_DEVICES"],
        "GPU-14000000-0000-4000-8000-0000000000aa"
    );

    // Deleting gives everything back.
    c.delete_sandbox(&whole).await.unwrap();
    c.delete_sandbox(&mig).await.unwrap();
    let status = c.gpus().await.unwrap();
    assert!(status["allocations"].as_array().unwrap().is_empty());
    assert!(status["sleeping"].as_array().unwrap().is_empty());
    assert_eq!(status["gpus"][1]["free"]["whole_gpus"], 1);

    // MPS: the thread percentage and pinned memory limit reach the sandbox.
    let mps = create_with_gpu(
        &c,
        json!({"mode": "mps", "compute_pct": 25, "memory_mib": 4096}),
    )
    .await
    .unwrap();
    let env = env_of(&c, &mps).await;
    assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
    assert_eq!(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=4096M");
    assert!(env["NVIDIA_VISIBLE_DEVICES"].starts_with("GPU-"));

    // Bad requests are refused before anything is created.
    for (gpu, code) in [
        (
            json!({"mode": "mig", "profile": "9g.1tb"}),
            "gpu_request_invalid",
        ),
        (
            json!({"mode": "mps", "compute_pct": 400}),
            "gpu_request_invalid",
        ),
        (json!({"mode": "whole", "count": 3}), "gpu_request_invalid"),
        (
            json!({"mode": "whole", "colour": "red"}),
            "gpu_request_invalid",
        ),
        (json!({"mode": "teleport"}), "gpu_request_invalid"),
    ] {
        let err = create_with_gpu(&c, gpu.clone()).await.unwrap_err();
        assert_eq!(err.code(), Some(code), "{gpu}: {err}");
    }
    let all = c.sandboxes(None).await.unwrap();
    assert_eq!(all.len(), 1, "only the MPS sandbox exists: {all:?}");
}

#[tokio::test]
async fn templates_carry_a_gpu_request_and_nodes_without_gpus_refuse_it() {
    let d = Daemon::start_with(&["--gpu-inventory", &local("node-h200-l4.toml")]).await;
    let c = d.client();
    let mut spec = common::agent_template("gpu-agent", common::no_idle());
    spec.gpu = Some(json!({"mode": "timeslice"}));
    c.create_template(&spec).await.unwrap();
    let id = common::create(&c, "gpu-agent").await;
    let env = env_of(&c, &id).await;
    assert!(env["NVIDIA_VISIBLE_DEVICES"].starts_with("GPU-"), "{env:?}");
    let (n, _) = common::call_agent(&c, &id, "a").await;
    suspend(&c, &id, Tier::Parked).await;
    assert!(held_by(&c.gpus().await.unwrap(), &id).is_none());
    // After the wake: the agent's memory is intact and the share is back.
    let (m, _) = common::call_agent(&c, &id, "b").await;
    assert_eq!(m, n + 1);
    assert!(held_by(&c.gpus().await.unwrap(), &id).is_some());
    // A fork asks for the same share when it wakes.
    let forks = c.fork(&id, 1).await.unwrap();
    let env = env_of(&c, &forks[0].id).await;
    assert!(env["NVIDIA_VISIBLE_DEVICES"].starts_with("GPU-"), "{env:?}");

    let mut bad = common::agent_template("bad-gpu", common::no_idle());
    bad.gpu = Some(json!({"mode": "mig", "profile": "7g.999gb"}));
    let err = c.create_template(&bad).await.unwrap_err();
    assert_eq!(err.code(), Some("gpu_request_invalid"), "{err}");

    // A node without GPUs: a GPU request is refused, GET /v1/gpus says why.
    let plain = Daemon::start().await;
    let p = plain.client();
    let err = create_with_gpu(&p, json!({"mode": "whole"}))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("gpu_not_configured"), "{err}");
    let err = p.gpus().await.unwrap_err();
    assert_eq!(err.code(), Some("gpu_not_configured"));
    // And a sandbox without a GPU request is untouched by any of this.
    let id = common::create(&p, "host").await;
    let env = env_of(&p, &id).await;
    assert!(!env.contains_key("NVIDIA_VISIBLE_DEVICES"));
}

#[tokio::test]
async fn up_refuses_a_bad_gpu_inventory() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "node = \"x\"\n[[gpu]]\nindex = 0\nuuid = 7\n").unwrap();
    let out = std::process::Command::new(common::BIN)
        .args(["up", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("data"))
        .arg("--gpu-inventory")
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("bad.toml:4:8"), "{text}");
    assert!(text.contains("inventory_parse"), "{text}");
}

/// The parts of `GET /v1/gpus` that a restart must keep: per-GPU usage and free capacity,
/// every held share (devices and exec environment) and the sleeping sandboxes.
fn shares_view(status: &Value) -> Value {
    json!({
        "gpus": status["gpus"],
        "allocations": status["allocations"],
        "sleeping": status["sleeping"],
    })
}

async fn quota_used(d: &Daemon) -> String {
    let text = reqwest::Client::new()
        .get(format!("{}/metrics", d.url()))
        .bearer_auth(d.token())
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with("torpor_gpu_quota_used{"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test]
async fn a_tenant_within_its_guarantee_takes_a_borrowed_gpu_back() {
    // One L4; the admin is guaranteed none and borrows it, `team` is guaranteed it.
    let d = Daemon::start_with(&[
        "--gpu-inventory",
        &local("worker-l4-a.toml"),
        "--gpu-quotas",
        &local("quotas-reclaim.toml"),
    ])
    .await;
    let admin = d.client();
    let borrowed = create_with_gpu(&admin, json!({"mode": "whole"}))
        .await
        .unwrap();
    let r = admin
        .exec(
            &borrowed,
            &sh("echo kept > /tmp/state; sleep 1000 & echo $!"),
        )
        .await
        .unwrap();
    let pid = r.stdout.trim().to_string();
    // A second borrower finds no free share and may not reclaim from the first.
    let err = create_with_gpu(&admin, json!({"mode": "whole"}))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("gpu_unavailable"), "{err}");

    let team = admin
        .create_tenant(&torpor_api::types::CreateTenantBody {
            name: "team".into(),
            quotas: None,
        })
        .await
        .unwrap();
    let team_token = team.token;
    let team = Client::new(&d.url(), &team_token);
    // Attack: a tenant may not give a suspend's cause (it is the controllers' word).
    let (status, body) = {
        let r = reqwest::Client::new()
            .post(format!("{}/v1/sandboxes/{borrowed}/suspend", d.url()))
            .bearer_auth(&team_token)
            .json(&json!({"tier": "parked", "cause": "gpu_reclaimed"}))
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().await.unwrap())
    };
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (403, Some("forbidden")),
        "{body}"
    );
    let owned = create_with_gpu(&team, json!({"mode": "whole"}))
        .await
        .unwrap();
    let env = env_of(&team, &owned).await;
    assert_eq!(
        env["NVIDIA_VISIBLE_DEVICES"],
        "GPU-14000000-0000-4000-8000-0000000000a1"
    );
    // The borrower is parked in the background, its state kept.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let s = admin.sandbox(&borrowed).await.unwrap();
        if s.tier == "parked" || s.tier == "suspended" {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the borrower was not parked: {s:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        d.client()
            .metrics()
            .await
            .unwrap()
            .contains("torpor_transitions_total{cause=\"gpu_reclaimed\",to_tier=\"parked\"} 1"),
        "the park counted under its cause"
    );
    let status = admin.gpus().await.unwrap();
    assert!(held_by(&status, &borrowed).is_none());
    assert!(held_by(&status, &owned).is_some());
    // While the owner holds it the borrower cannot wake, and stays asleep.
    let err = admin.exec(&borrowed, &sh("true")).await.unwrap_err();
    assert_eq!(err.code(), Some("gpu_unavailable"), "{err}");
    // Once it is given back the borrower wakes with its files and processes.
    team.delete_sandbox(&owned).await.unwrap();
    let r = admin
        .exec(
            &borrowed,
            &sh(&format!("cat /tmp/state; kill -0 {pid} && echo alive")),
        )
        .await
        .unwrap();
    assert_eq!(r.stdout, "kept\nalive\n", "{r:?}");
}

#[tokio::test]
async fn gpu_shares_survive_daemon_restarts() {
    let mut d = Daemon::start_with(&[
        "--gpu-inventory",
        &local("node-h200-l4.toml"),
        "--gpu-quotas",
        &local("quotas-admin.toml"),
    ])
    .await;
    let c = d.client();
    let big = create_with_gpu(&c, json!({"mode": "mig", "profile": "3g.71gb"}))
        .await
        .unwrap();
    let small = create_with_gpu(&c, json!({"mode": "mig", "profile": "1g.18gb"}))
        .await
        .unwrap();
    let mps = create_with_gpu(
        &c,
        json!({"mode": "mps", "compute_pct": 25, "memory_mib": 4096}),
    )
    .await
    .unwrap();
    suspend(&c, &small, Tier::Parked).await;
    let before = c.gpus().await.unwrap();
    assert!(held_by(&before, &big).is_some() && held_by(&before, &mps).is_some());
    assert_eq!(before["sleeping"], json!([small]));
    let quota_before = quota_used(&d).await;
    assert!(
        quota_before
            .contains("torpor_gpu_quota_used{tenant=\"admin\",resource=\"memory_mib\"} 75981"),
        "{quota_before}"
    );

    // A crash: the running sandboxes go back to their snapshots, so after the restart all
    // three sleep, each keeping its ticket, and no share is held (none leaked, none doubled).
    d.kill();
    d.spawn().await;
    let c = d.client();
    let after = c.gpus().await.unwrap();
    let mut sleeping: Vec<String> = vec![big.clone(), small.clone(), mps.clone()];
    sleeping.sort();
    assert_eq!(after["sleeping"], json!(sleeping), "{after}");
    assert_eq!(after["allocations"], json!([]), "{after}");
    for gpu in after["gpus"].as_array().unwrap() {
        assert_eq!(gpu["shares"], 0, "{after}");
    }
    // Waking gives each the very same devices: GET /v1/gpus is what it was before the crash.
    env_of(&c, &big).await;
    env_of(&c, &mps).await;
    let woken = c.gpus().await.unwrap();
    assert_eq!(shares_view(&woken), shares_view(&before));
    assert_eq!(quota_used(&d).await, quota_before);

    // A graceful restart (resident sandboxes are parked on the way down) keeps them too.
    d.stop();
    d.spawn().await;
    let c = d.client();
    assert_eq!(c.gpus().await.unwrap()["sleeping"], json!(sleeping));
    env_of(&c, &big).await;
    env_of(&c, &mps).await;
    assert_eq!(shares_view(&c.gpus().await.unwrap()), shares_view(&before));
    // The sleeping one wakes on its old placement, and the quota still counts every share once.
    env_of(&c, &small).await;
    let all = c.gpus().await.unwrap();
    assert_eq!(all["sleeping"], json!([]));
    assert_eq!(all["allocations"].as_array().unwrap().len(), 3);
    assert_eq!(all["gpus"][0]["shares"], 2, "{all}");
    // 93,952 MiB held: 8,000 more would fit the L4 but not the 100,000 MiB quota.
    let err = create_with_gpu(
        &c,
        json!({"mode": "mps", "compute_pct": 10, "memory_mib": 8000}),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Some("gpu_quota_exceeded"), "{err}");
    // A deleted sandbox's stored share goes with it.
    c.delete_sandbox(&small).await.unwrap();
    d.stop();
    d.spawn().await;
    let c = d.client();
    let status = c.gpus().await.unwrap();
    assert!(!status["sleeping"]
        .as_array()
        .unwrap()
        .contains(&json!(small)));
}

/// The scan that finds which processes to hand to `cuda-checkpoint`, run inside a real gVisor
/// sandbox: a process holding a file named like an NVIDIA device (here a plain file on the
/// sandbox's own /dev tmpfs, as there is no GPU) is found, the others are not; and the toggle
/// command runs through the same exec path.
#[tokio::test]
async fn the_cuda_checkpoint_holder_scan_works_inside_gvisor() {
    use torpor_gpu::cuda_checkpoint::{holders_command, parse_holders, toggle_command, Tool};
    let d = Daemon::start().await;
    let c = d.client();
    let id = common::create(&c, "host").await;
    let r = c
        .exec(
            &id,
            &sh("touch /dev/nvidia0 && (exec sleep 300 </dev/nvidia0 &) && sleep 0.5 && pgrep -x sleep"),
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let holder: u32 = r.stdout.lines().last().unwrap().trim().parse().unwrap();
    let mut scan = sh("");
    scan.cmd = holders_command();
    let r = c.exec(&id, &scan).await.unwrap();
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    assert_eq!(parse_holders(&r.stdout).unwrap(), vec![holder], "{r:?}");
    // A stand-in cuda-checkpoint in the sandbox's rootfs sees exactly the toggle arguments.
    let r = c
        .exec(
            &id,
            &sh("printf '#!/bin/sh\\necho \"$@\" >> /tmp/toggles\\n' > /tmp/cuda-checkpoint && chmod +x /tmp/cuda-checkpoint"),
        )
        .await
        .unwrap();
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let tool = Tool {
        in_sandbox: "/tmp/cuda-checkpoint".into(),
        host_mount: None,
    };
    let mut toggle = sh("");
    toggle.cmd = toggle_command(&tool, holder);
    let r = c.exec(&id, &toggle).await.unwrap();
    assert_eq!(r.exit_code, Some(0), "{r:?}");
    let r = c.exec(&id, &sh("cat /tmp/toggles")).await.unwrap();
    assert_eq!(r.stdout.trim(), format!("--toggle --pid {holder}"));
}
