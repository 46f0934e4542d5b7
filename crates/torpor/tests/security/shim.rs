//! The shims' boundary (docs/SECURITY.md, live restore): each container's supervisor listens on
//! an abstract Unix socket that carries the agent channel, i.e. root inside the sandbox. Only
//! processes of the daemon's own user may attach to it; sandboxed code cannot reach it at all.

use std::process::Command;

use crate::common::*;

/// Connects to the shim's abstract socket, announces a connection and sends a `hello`; prints
/// `closed` when the shim hung up without a word, `answered` when the agent replied, `timeout`
/// when the connection was kept (attached) but nothing came, `refused` when it could not connect.
const PROBE: &str = r#"
import json, socket, struct, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect("\0" + sys.argv[1])
except OSError:
    print("refused"); sys.exit(0)
first = time.time_ns()
header = json.dumps({"id": first, "op": "hello"}).encode()
try:
    s.sendall(struct.pack("<Q", first) + struct.pack("<II", len(header), 0) + header)
    data = s.recv(4096)
    print("answered" if data else "closed")
except socket.timeout:
    print("timeout")
except OSError:
    print("closed")
"#;

fn shim_socket(data_dir: &std::path::Path, sandbox: &str) -> String {
    for e in std::fs::read_dir(data_dir.join("shims")).unwrap().flatten() {
        let Ok(meta) = std::fs::read(e.path().join("meta.json")) else {
            continue;
        };
        let meta: serde_json::Value = serde_json::from_slice(&meta).unwrap();
        if meta["container_id"]
            .as_str()
            .is_some_and(|c| c.starts_with(&format!("{sandbox}-g")))
        {
            return meta["socket"].as_str().unwrap().to_string();
        }
    }
    panic!("no shim recorded for {sandbox}");
}

#[tokio::test(flavor = "multi_thread")]
async fn another_local_user_cannot_attach_to_a_sandboxs_shim() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = create(&c, "host").await;
    let r = c.exec(&id, &sh("echo before > /root/mark")).await.unwrap();
    assert_eq!(r.exit_code, Some(0));
    let socket = shim_socket(&d.dir, &id);

    let nogroup = String::from_utf8(
        Command::new("id")
            .args(["-gn", "nobody"])
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    let out = Command::new("setpriv")
        .args([
            "--reuid=nobody",
            &format!("--regid={}", nogroup.trim()),
            "--clear-groups",
        ])
        .args(["/usr/bin/python3", "-c", PROBE, &socket])
        .output()
        .unwrap();
    let verdict = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(
        verdict,
        "closed",
        "nobody's connection to the shim was not hung up: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The daemon's own connection was not displaced: the sandbox answers as before.
    let r = c.exec(&id, &sh("cat /root/mark")).await.unwrap();
    assert_eq!(r.stdout.trim(), "before");
    assert_eq!(c.sandbox(&id).await.unwrap().last_error, None);
}

#[tokio::test(flavor = "multi_thread")]
async fn sandboxed_code_cannot_reach_its_own_shim() {
    let d = Daemon::start().await;
    let c = d.client();
    let id = create(&c, "host").await;
    let socket = shim_socket(&d.dir, &id);
    // Root inside the sandbox, on gVisor's own Unix socket namespace.
    let r = c
        .exec(
            &id,
            &torpor_api::types::ExecBody {
                cmd: vec!["python3".into(), "-c".into(), PROBE.into(), socket],
                timeout_ms: Some(60_000),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(r.stdout.trim(), "refused", "{r:?}");
    let r = c.exec(&id, &sh("echo still")).await.unwrap();
    assert_eq!(r.stdout.trim(), "still");
}
