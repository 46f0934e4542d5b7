//! Pools over sandbox networking, with real runsc agents and a real Redis:
//! - HTTP dispatch: torpor POSTs each message to a server in the agent (through the ingress
//!   path, waking a suspended agent), acknowledging only a 2xx answer; retries and dead letter.
//! - Self-consume: agents read the queue themselves over their egress network (a tiny client
//!   speaking the Redis protocol over TCP to the host's Redis); torpor only scales, 0 -> k -> 0.

#[path = "common/brokers.rs"]
mod brokers;
mod common;

use std::time::Duration;

use brokers::{exactly_once, free_port, handled, wait_pool, Redis};
use common::*;
use torpor_api::ClientError;
use torpor_core::NetworkPolicy;

async fn redis_cmd<T: redis::FromRedisValue>(
    con: &mut redis::aio::MultiplexedConnection,
    args: &[&str],
) -> T {
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query_async(con).await.unwrap()
}

/// The agent's main process: an HTTP/1.1 server on 8080 that appends each POSTed body to
/// /tmp/done.log (500 for a body starting with `poison`), and records the attempt header.
const HTTP_AGENT: &str = r#"
import http.server
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        m = self.rfile.read(n).decode()
        if self.path != "/jobs" or self.headers.get("x-torpor-pool") != "web":
            code = 404
        elif m.startswith("poison"):
            code = 500
        else:
            open("/tmp/done.log", "a").write(m + "\n")
            code = 200
        body = b"ok" if code == 200 else b"no"
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8080), H).serve_forever()
"#;

#[tokio::test(flavor = "multi_thread")]
async fn http_dispatch_posts_each_message_to_the_agent_and_acks_only_2xx() {
    let redis = Redis::start();
    let d = Daemon::start_with(&["--workers", "8"]).await;
    let c = d.client();
    let mut tpl = agent_template("web-agent", no_idle());
    tpl.command = vec![
        "python3".into(),
        "-u".into(),
        "-c".into(),
        HTTP_AGENT.into(),
    ];
    tpl.warmup_ms = 500;
    // Ingress only: torpor reaches the port, the agent reaches nothing.
    tpl.network = Some(serde_json::from_value(serde_json::json!({"allow": []})).unwrap());
    c.create_template(&tpl).await.unwrap();
    // A template without a network cannot serve HTTP dispatch.
    let mut plain = agent_template("plain-agent", no_idle());
    plain.command = Vec::new();
    c.create_template(&plain).await.unwrap();

    let http = serde_json::json!({"http": {"port": 8080, "path": "/jobs"},
        "max_attempts": 2, "retry_backoff_ms": 50, "timeout_s": 30});
    let spec = |name: &str, template: &str, dispatch: serde_json::Value| {
        serde_json::json!({
            "name": name, "template": template, "min": 0, "max": 2, "target": 3,
            "cooldown_s": 2, "poll_interval_ms": 300,
            "triggers": [{"type": "redis-list", "url": redis.url(), "key": "web"}],
            "dispatch": dispatch,
        })
    };
    for (body, field) in [
        (spec("x", "plain-agent", http.clone()), "dispatch.http"),
        (
            spec(
                "x",
                "web-agent",
                serde_json::json!({"http": {"port": 8080}, "command": ["true"]}),
            ),
            "dispatch",
        ),
        (
            spec("x", "web-agent", serde_json::json!({"http": {"port": 0}})),
            "dispatch.http.port",
        ),
        (
            spec(
                "x",
                "web-agent",
                serde_json::json!({"http": {"port": 80, "path": "jobs"}}),
            ),
            "dispatch.http.path",
        ),
        (
            spec(
                "x",
                "web-agent",
                serde_json::json!({"http": {"port": 80, "headers": {"bad name": "v"}}}),
            ),
            "dispatch.http.headers",
        ),
    ] {
        match c.create_pool(&body).await.unwrap_err() {
            ClientError::Api {
                status, message, ..
            } => {
                assert_eq!(status, 400, "{message}");
                assert!(
                    message.contains(&format!("{field}:")),
                    "{message} names {field}"
                );
            }
            e => panic!("{e}"),
        }
    }

    let p = c
        .create_pool(&spec("web", "web-agent", http))
        .await
        .unwrap();
    assert_eq!((p.desired, p.mode.as_str()), (0, "dispatch"));
    let mut con = redis.conn().await;
    let sent: Vec<String> = (0..8).map(|i| format!("web-{i}")).collect();
    let mut args = vec!["LPUSH", "web"];
    args.extend(sent.iter().map(String::as_str));
    args.push("poison-web");
    let _: i64 = redis_cmd(&mut con, &args).await;

    let p = wait_pool(&c, "web", "all settled", Duration::from_secs(120), |p| {
        p.processed == 8 && p.dead_lettered == 1
    })
    .await;
    assert_eq!(p.failed_attempts, 2, "a 500 answer is retried, then dead");
    assert_eq!(p.sandboxes.len(), 2, "9 messages at target 3 ask for max=2");
    let len: i64 = redis_cmd(&mut con, &["LLEN", "web"]).await;
    assert_eq!(len, 0);
    let dead: Vec<String> = redis_cmd(&mut con, &["LRANGE", "web:dead", "0", "-1"]).await;
    assert_eq!(dead, vec!["poison-web".to_string()]);

    let p = wait_pool(&c, "web", "zero agents", Duration::from_secs(60), |p| {
        p.running == 0 && p.desired == 0 && p.starting == 0 && p.draining == 0
    })
    .await;
    for id in &p.sandboxes {
        assert_eq!(c.sandbox(id.as_str()).await.unwrap().state, "suspended");
    }
    exactly_once(&handled(&c, &p).await, &sent);

    // A message for a pool at zero: the POST wakes a suspended agent, whose server (a process
    // of its snapshot) answers it.
    let _: i64 = redis_cmd(&mut con, &["LPUSH", "web", "late-web"]).await;
    let p = wait_pool(
        &c,
        "web",
        "the late message",
        Duration::from_secs(60),
        |p| p.processed == 9,
    )
    .await;
    assert_eq!(p.sandboxes.len(), 2, "woke an existing agent");
    let mut all = sent.clone();
    all.push("late-web".into());
    exactly_once(&handled(&c, &p).await, &all);
    c.delete_pool("web").await.unwrap();
}

/// A self-consuming agent: takes one message per connection with `LPOP` + `QUIT` over plain
/// TCP to the host's Redis (through torpor's egress relay), reading until Redis closes, while
/// the drain notice
/// is absent. It writes the notice itself at boot, so its template's golden snapshot holds no
/// connection: torpor clears it when it makes the agent active.
const SELF_AGENT: &str = r#"
import os, socket, time
HOST, PORT, KEY = os.environ["BROKER_HOST"], int(os.environ["BROKER_PORT"]), os.environ["KEY"].encode()
DRAIN = "/tmp/torpor-drain"
open(DRAIN, "w").write("boot\n")
def cmd(*a):
    return b"*%d\r\n" % len(a) + b"".join(b"$%d\r\n%s\r\n" % (len(x), x) for x in a)
while True:
    if os.path.exists(DRAIN):
        time.sleep(0.1)
        continue
    try:
        s = socket.create_connection((HOST, PORT), timeout=5)
        s.sendall(cmd(b"LPOP", KEY) + cmd(b"QUIT"))
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        s.close()
    except OSError as e:
        open("/tmp/errors.log", "a").write(repr(e) + "\n")
        time.sleep(0.5)
        continue
    if not data.startswith(b"$") or data.startswith(b"$-1"):
        time.sleep(0.2)
        continue
    head, rest = data.split(b"\r\n", 1)
    body = rest[: int(head[1:])]
    time.sleep(0.5)
    open("/tmp/done.log", "a").write(body.decode() + "\n")
"#;

#[tokio::test(flavor = "multi_thread")]
async fn self_consuming_agents_read_the_broker_over_egress_and_scale_zero_k_zero() {
    let host = host_addr();
    let redis = Redis::start_bound(&host, free_port());
    // The broker is on a host address: closed to sandboxes unless listed.
    let d = Daemon::start_with(&["--workers", "8", "--sandbox-reach-host", &host]).await;
    let c = d.client();
    let mut tpl = agent_template("self-agent", no_idle());
    tpl.command = vec![
        "python3".into(),
        "-u".into(),
        "-c".into(),
        SELF_AGENT.into(),
    ];
    tpl.warmup_ms = 500;
    tpl.env = [
        ("BROKER_HOST".to_string(), host.clone()),
        ("BROKER_PORT".to_string(), redis.port.to_string()),
        ("KEY".to_string(), "selfq".to_string()),
    ]
    .into();
    // Egress to the broker only.
    tpl.network = Some(
        serde_json::from_value::<NetworkPolicy>(serde_json::json!({
            "allow": [{"cidr": format!("{host}/32"), "ports": [redis.port]}]
        }))
        .unwrap(),
    );
    c.create_template(&tpl).await.unwrap();

    let p = c
        .create_pool(&serde_json::json!({
            "name": "selfq", "template": "self-agent", "min": 0, "max": 2, "target": 4,
            "cooldown_s": 2, "poll_interval_ms": 200, "drain_grace_s": 2,
            "triggers": [{"type": "redis-list", "url": redis.url(), "key": "selfq"}],
        }))
        .await
        .unwrap();
    assert_eq!(p.mode, "self-consume");
    wait_pool(
        &c,
        "selfq",
        "a first reading",
        Duration::from_secs(10),
        |p| p.depth == Some(0),
    )
    .await;
    let p = c.pool("selfq").await.unwrap();
    assert!(p.sandboxes.is_empty(), "an empty queue has no agents");

    let mut con = redis.conn().await;
    let sent: Vec<String> = (0..24).map(|i| format!("self-{i}")).collect();
    let mut args = vec!["RPUSH", "selfq"];
    args.extend(sent.iter().map(String::as_str));
    let _: i64 = redis_cmd(&mut con, &args).await;

    // Depth 24 at target 4: max=2 agents, which empty the queue themselves.
    let p = wait_pool(&c, "selfq", "two agents", Duration::from_secs(60), |p| {
        p.running == 2
    })
    .await;
    assert_eq!(p.desired, 2);
    let p = wait_pool(
        &c,
        "selfq",
        "the queue drained",
        Duration::from_secs(120),
        |p| p.depth == Some(0),
    )
    .await;
    assert_eq!(p.processed, 0, "torpor itself took nothing");
    // Back to zero after the cooldown: drain notice, grace, suspension (a checkpoint that
    // succeeds: the agents hold no connection then).
    let p = wait_pool(&c, "selfq", "zero agents", Duration::from_secs(60), |p| {
        p.running == 0 && p.desired == 0 && p.draining == 0 && p.starting == 0
    })
    .await;
    assert_eq!(p.sandboxes.len(), 2);
    assert!(p.last_error.is_none(), "{:?}", p.last_error);
    for id in &p.sandboxes {
        let s = c.sandbox(id.as_str()).await.unwrap();
        assert_eq!(s.state, "suspended", "{id}: {s:?}");
    }
    // Every message was read from the broker by an agent, once (LPOP hands each out once; the
    // logs, read from the suspended agents, show no loss).
    exactly_once(&handled(&c, &p).await, &sent);

    // Work again: a sleeping agent is woken, its drain notice cleared, and it reads again
    // (its old connection did not survive the checkpoint; it makes a new one).
    let _: i64 = redis_cmd(&mut con, &["RPUSH", "selfq", "self-late"]).await;
    let p = wait_pool(
        &c,
        "selfq",
        "the late message",
        Duration::from_secs(60),
        |p| p.running >= 1,
    )
    .await;
    assert_eq!(p.sandboxes.len(), 2, "woke an existing agent");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let p = c.pool("selfq").await.unwrap();
        let seen = handled(&c, &p).await;
        if seen.contains_key("self-late") {
            let mut all = sent.clone();
            all.push("self-late".into());
            exactly_once(&seen, &all);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "late message not read: {p:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    c.delete_pool("selfq").await.unwrap();
}
