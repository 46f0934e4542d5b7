//! Event-driven pools against real brokers (Redis, NATS JetStream) and real runsc agents: a
//! pool at zero wakes on the first messages, grows to several agents, every message is processed
//! exactly once (each agent logs what it handled; the logs are read back from the sandboxes),
//! failures go to the dead letter, the queue drains and the pool goes back to zero after its
//! cooldown. Also: broker faults, bad settings, and the KEDA external scaler over gRPC.

#[path = "common/brokers.rs"]
mod brokers;
mod common;

use std::time::Duration;

use brokers::{exactly_once, free_port, handled, wait_pool, Nats, Redis, HANDLER};
use common::*;
use torpor_api::ClientError;

fn handler() -> serde_json::Value {
    serde_json::json!({
        "command": ["python3", "-c", HANDLER],
        "max_attempts": 2,
        "retry_backoff_ms": 50,
        "timeout_s": 60
    })
}

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

#[tokio::test(flavor = "multi_thread")]
async fn redis_list_pool_scales_from_zero_processes_each_message_once_and_returns_to_zero() {
    let redis = Redis::start();
    let d = Daemon::start_with(&["--workers", "8"]).await;
    let c = d.client();
    let mut con = redis.conn().await;
    let p = c
        .create_pool(&serde_json::json!({
            "name": "jobs", "template": "host", "min": 0, "max": 3, "target": 2,
            "cooldown_s": 3, "poll_interval_ms": 300,
            "triggers": [{"type": "redis-list", "url": redis.url(), "key": "jobs"}],
            "dispatch": handler(),
        }))
        .await
        .unwrap();
    assert_eq!((p.desired, p.running, p.mode.as_str()), (0, 0, "dispatch"));
    let p = wait_pool(
        &c,
        "jobs",
        "a first reading",
        Duration::from_secs(10),
        |p| p.depth == Some(0),
    )
    .await;
    assert_eq!(
        (p.desired, p.running),
        (0, 0),
        "an empty queue has no agents"
    );
    assert!(p.sandboxes.is_empty());

    // One LPUSH: depth goes 0 -> 13 in one step, so the first decision asks for max agents.
    let sent: Vec<String> = (0..12).map(|i| format!("job-{i}")).collect();
    let mut args = vec!["LPUSH", "jobs"];
    args.extend(sent.iter().map(String::as_str));
    args.push("poison-1");
    let _: i64 = redis_cmd(&mut con, &args).await;

    let p = wait_pool(
        &c,
        "jobs",
        "all messages settled",
        Duration::from_secs(120),
        |p| p.processed == 12 && p.dead_lettered == 1,
    )
    .await;
    assert_eq!(
        p.sandboxes.len(),
        3,
        "13 messages at target 2 ask for max=3 agents"
    );
    assert_eq!(
        p.failed_attempts, 2,
        "the poison message was tried max_attempts times"
    );
    let len: i64 = redis_cmd(&mut con, &["LLEN", "jobs"]).await;
    assert_eq!(len, 0, "the queue drained");
    let inflight: i64 = redis_cmd(&mut con, &["LLEN", "jobs:torpor:processing"]).await;
    assert_eq!(inflight, 0, "nothing left mid-processing");
    let dead: Vec<String> = redis_cmd(&mut con, &["LRANGE", "jobs:dead", "0", "-1"]).await;
    assert_eq!(dead, vec!["poison-1".to_string()]);

    // After the cooldown, back to zero: every agent suspended.
    let p = wait_pool(&c, "jobs", "zero agents", Duration::from_secs(60), |p| {
        p.running == 0 && p.desired == 0 && p.starting == 0 && p.draining == 0
    })
    .await;
    for id in &p.sandboxes {
        let s = c.sandbox(id.as_str()).await.unwrap();
        assert_eq!(s.state, "suspended", "{id} after scale-in: {s:?}");
    }
    exactly_once(&handled(&c, &p).await, &sent);

    // More work wakes suspended agents rather than making new ones.
    let _: i64 = redis_cmd(&mut con, &["LPUSH", "jobs", "late-1"]).await;
    let p = wait_pool(
        &c,
        "jobs",
        "the late message",
        Duration::from_secs(60),
        |p| p.processed == 13,
    )
    .await;
    assert_eq!(p.sandboxes.len(), 3, "woke an existing agent");

    c.delete_pool("jobs").await.unwrap();
    let e = c.pool("jobs").await.unwrap_err();
    assert!(matches!(e, ClientError::Api { status: 404, .. }), "{e}");
    for id in &p.sandboxes {
        assert!(
            c.sandbox(id.as_str()).await.is_err(),
            "{id} deleted with its pool"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn redis_stream_and_nats_jetstream_pools_dispatch_every_message_once() {
    let redis = Redis::start();
    let nats = Nats::start();
    let d = Daemon::start_with(&["--workers", "8"]).await;
    let c = d.client();

    // Redis stream with a consumer group.
    let mut con = redis.conn().await;
    let _: String = redis_cmd(
        &mut con,
        &["XGROUP", "CREATE", "events", "g", "$", "MKSTREAM"],
    )
    .await;
    c.create_pool(&serde_json::json!({
        "name": "events", "template": "host", "max": 2, "target": 3, "cooldown_s": 2,
        "poll_interval_ms": 300,
        "triggers": [{"type": "redis-stream", "url": redis.url(), "stream": "events", "group": "g"}],
        "dispatch": handler(),
    }))
    .await
    .unwrap();

    // NATS JetStream: stream JOBS on jobs.>, durable pull consumer w.
    let nc = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(nc);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "JOBS".into(),
        subjects: vec!["jobs.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    js.create_consumer_on_stream(
        async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("w".into()),
            ack_wait: Duration::from_secs(60),
            ..Default::default()
        },
        "JOBS",
    )
    .await
    .unwrap();
    c.create_pool(&serde_json::json!({
        "name": "natsjobs", "template": "host", "max": 2, "target": 3, "cooldown_s": 2,
        "poll_interval_ms": 300,
        "triggers": [{"type": "nats-jetstream", "url": nats.url(), "stream": "JOBS", "consumer": "w"}],
        "dispatch": handler(),
    }))
    .await
    .unwrap();

    let sent_s: Vec<String> = (0..8).map(|i| format!("ev-{i}")).collect();
    for m in &sent_s {
        let _: String = redis_cmd(&mut con, &["XADD", "events", "*", "body", m]).await;
    }
    let sent_n: Vec<String> = (0..8).map(|i| format!("nats-{i}")).collect();
    for m in &sent_n {
        js.publish("jobs.work", m.clone().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    let ps = wait_pool(
        &c,
        "events",
        "stream processed",
        Duration::from_secs(120),
        |p| p.processed == 8,
    )
    .await;
    let pn = wait_pool(
        &c,
        "natsjobs",
        "nats processed",
        Duration::from_secs(120),
        |p| p.processed == 8,
    )
    .await;
    assert!(!ps.sandboxes.is_empty() && !pn.sandboxes.is_empty());

    // The broker agrees: nothing pending, nothing unacknowledged.
    let groups: redis::Value = redis_cmd(&mut con, &["XINFO", "GROUPS", "events"]).await;
    let text = format!("{groups:?}");
    assert!(text.contains("pending"), "{text}");
    let pending: redis::Value = redis_cmd(&mut con, &["XPENDING", "events", "g"]).await;
    match pending {
        redis::Value::Array(a) if a[0] == redis::Value::Int(0) => {}
        v => {
            // Everything that tells why: each entry's consumer, idle time and deliveries, the
            // pool, and which messages each agent logged.
            let detail: redis::Value =
                redis_cmd(&mut con, &["XPENDING", "events", "g", "-", "+", "20"]).await;
            panic!(
                "left pending: {v:?}\nentries: {detail:?}\npool: {ps:?}\nhandled: {:?}",
                handled(&c, &ps).await
            );
        }
    }
    let mut consumer: async_nats::jetstream::consumer::PullConsumer =
        js.get_consumer_from_stream("w", "JOBS").await.unwrap();
    let info = consumer.info().await.unwrap();
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));

    let ps = wait_pool(&c, "events", "zero agents", Duration::from_secs(60), |p| {
        p.running == 0 && p.desired == 0 && p.draining == 0
    })
    .await;
    let pn = wait_pool(
        &c,
        "natsjobs",
        "zero agents",
        Duration::from_secs(60),
        |p| p.running == 0 && p.desired == 0 && p.draining == 0,
    )
    .await;
    exactly_once(&handled(&c, &ps).await, &sent_s);
    exactly_once(&handled(&c, &pn).await, &sent_n);
}

#[tokio::test(flavor = "multi_thread")]
async fn broker_faults_keep_the_size_apply_fallback_and_recover() {
    let mut redis = Redis::start();
    let d = Daemon::start_with(&["--workers", "8"]).await;
    let c = d.client();

    // A broker nobody listens on: errors are reported and, after 3 of them, the fallback size.
    let dead = format!("redis://127.0.0.1:{}", free_port());
    c.create_pool(&serde_json::json!({
        "name": "nobroker", "template": "host", "max": 2, "poll_interval_ms": 200,
        "fallback": {"failure_threshold": 3, "replicas": 1},
        "triggers": [{"type": "redis-list", "url": dead, "key": "q"}],
    }))
    .await
    .unwrap();
    let p = wait_pool(&c, "nobroker", "fallback", Duration::from_secs(30), |p| {
        p.fallback && p.running == 1
    })
    .await;
    let t = &p.triggers[0];
    let e = t.error.as_ref().expect("the trigger reports its error");
    assert_eq!(e.code, "broker_error", "{e:?}");
    assert!(t.consecutive_errors >= 3);
    assert_eq!((p.desired, p.mode.as_str()), (1, "self-consume"));

    // A live pool whose broker goes away keeps its agents, past the cooldown.
    let mut con = redis.conn().await;
    c.create_pool(&serde_json::json!({
        "name": "flaky", "template": "host", "max": 2, "target": 1, "cooldown_s": 1,
        "poll_interval_ms": 200,
        "triggers": [{"type": "redis-list", "url": redis.url(), "key": "q"}],
        "dispatch": handler(),
    }))
    .await
    .unwrap();
    let _: i64 = redis_cmd(&mut con, &["LPUSH", "q", "a-1", "a-2"]).await;
    wait_pool(
        &c,
        "flaky",
        "first messages",
        Duration::from_secs(60),
        |p| p.processed == 2,
    )
    .await;
    let before = c.pool("flaky").await.unwrap().running;
    assert!(before >= 1, "still in its cooldown with an agent");
    redis.stop();
    let p = wait_pool(&c, "flaky", "the error", Duration::from_secs(20), |p| {
        p.triggers[0].error.is_some()
    })
    .await;
    assert_eq!(p.depth, None);
    // Well past the 1 s cooldown, the pool still has its agents: no scale-in on missing data.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let p = c.pool("flaky").await.unwrap();
    assert_eq!(p.running, before, "{p:?}");
    assert!(p.desired >= before);

    // The broker comes back (empty): the trigger reconnects and new work is processed.
    redis.restart();
    let mut con = redis.conn().await;
    let _: i64 = redis_cmd(&mut con, &["LPUSH", "q", "b-1"]).await;
    let p = wait_pool(
        &c,
        "flaky",
        "work after the restart",
        Duration::from_secs(60),
        |p| p.processed == 3 && p.triggers[0].error.is_none(),
    )
    .await;
    wait_pool(&c, "flaky", "zero agents", Duration::from_secs(60), |p| {
        p.running == 0 && p.desired == 0 && p.draining == 0
    })
    .await;
    exactly_once(
        &handled(&c, &p).await,
        &["a-1".into(), "a-2".into(), "b-1".into()],
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_restart_the_trigger_and_lanes_reconnect_and_the_pool_keeps_going() {
    let mut nats = Nats::start();
    let d = Daemon::start_with(&["--workers", "8"]).await;
    let c = d.client();
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "RJOBS".into(),
        subjects: vec!["rjobs.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    js.create_consumer_on_stream(
        async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("w".into()),
            ack_wait: Duration::from_secs(10),
            ..Default::default()
        },
        "RJOBS",
    )
    .await
    .unwrap();
    // A long cooldown: the agents and their lanes stay up across the restart.
    c.create_pool(&serde_json::json!({
        "name": "nrestart", "template": "host", "max": 2, "target": 2, "cooldown_s": 120,
        "poll_interval_ms": 200,
        "triggers": [{"type": "nats-jetstream", "url": nats.url(), "stream": "RJOBS", "consumer": "w"}],
        "dispatch": handler(),
    }))
    .await
    .unwrap();
    let before: Vec<String> = (0..4).map(|i| format!("before-{i}")).collect();
    for m in &before {
        js.publish("rjobs.x", m.clone().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let p = wait_pool(&c, "nrestart", "before", Duration::from_secs(120), |p| {
        p.processed == 4
    })
    .await;
    assert!(!p.sandboxes.is_empty());
    // Settled: nothing queued, nothing starting or draining; the agents kept by the cooldown.
    let p = wait_pool(&c, "nrestart", "settled", Duration::from_secs(60), |p| {
        p.depth == Some(0) && p.starting == 0 && p.draining == 0
    })
    .await;
    let agents = p.running as usize;
    assert!(agents >= 1);

    // Down: the trigger reports it and the pool keeps its agents.
    nats.stop();
    let p = wait_pool(&c, "nrestart", "an error", Duration::from_secs(30), |p| {
        p.triggers[0].error.is_some()
    })
    .await;
    assert_eq!(p.running as usize, agents, "the pool keeps its size: {p:?}");
    // Back (same JetStream directory): new work flows through the same agents.
    nats.restart();
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let after: Vec<String> = (0..4).map(|i| format!("after-{i}")).collect();
    for m in &after {
        js.publish("rjobs.x", m.clone().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let p = wait_pool(&c, "nrestart", "after", Duration::from_secs(120), |p| {
        p.processed == 8 && p.triggers[0].error.is_none() && p.depth == Some(0)
    })
    .await;
    let mut all = before.clone();
    all.extend(after);
    exactly_once(&handled(&c, &p).await, &all);
    let mut consumer: async_nats::jetstream::consumer::PullConsumer =
        js.get_consumer_from_stream("w", "RJOBS").await.unwrap();
    let info = consumer.info().await.unwrap();
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
    c.delete_pool("nrestart").await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn gpu_shares_are_taken_by_agents_and_released_when_the_pool_goes_to_zero() {
    let gpu = |name: &str| {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/gpu")
            .join(name)
            .display()
            .to_string()
    };
    let redis = Redis::start();
    let d = Daemon::start_with(&[
        "--workers",
        "8",
        "--gpu-inventory",
        &gpu("node-h200-l4.toml"),
        "--gpu-quotas",
        &gpu("quotas-admin.toml"),
    ])
    .await;
    let c = d.client();
    // Every agent asks for a MIG 1g slice of the (declared) H200.
    let mut tpl = agent_template("gpu-worker", no_idle());
    tpl.command = Vec::new();
    tpl.warmup_ms = 0;
    tpl.gpu = Some(serde_json::json!({"mode": "mig", "profile": "1g.18gb"}));
    c.create_template(&tpl).await.unwrap();
    let mut con = redis.conn().await;
    c.create_pool(&serde_json::json!({
        "name": "gpujobs", "template": "gpu-worker", "max": 2, "target": 2, "cooldown_s": 2,
        "poll_interval_ms": 200,
        "triggers": [{"type": "redis-list", "url": redis.url(), "key": "g"}],
        // Each message takes a second: the work outlasts the second agent's start, so both
        // run (and hold shares) at once before the pool scales in.
        "dispatch": {
            "command": ["python3", "-c", format!("import time; time.sleep(1)\n{HANDLER}")],
            "max_attempts": 2, "retry_backoff_ms": 50, "timeout_s": 60
        },
    }))
    .await
    .unwrap();
    let held = |status: &serde_json::Value, ids: &[String]| {
        status["allocations"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| ids.iter().any(|id| a["sandbox"] == id.as_str()))
            .count()
    };
    assert_eq!(c.gpus().await.unwrap()["gpus"][0]["shares"], 0);

    let sent: Vec<String> = (0..6).map(|i| format!("g-{i}")).collect();
    let mut args = vec!["LPUSH", "g"];
    args.extend(sent.iter().map(String::as_str));
    let _: i64 = redis_cmd(&mut con, &args).await;
    let p = wait_pool(&c, "gpujobs", "two agents", Duration::from_secs(60), |p| {
        p.running == 2
    })
    .await;
    let ids: Vec<String> = p.sandboxes.iter().map(|s| s.to_string()).collect();
    assert_eq!(ids.len(), 2);
    let status = c.gpus().await.unwrap();
    assert_eq!(
        held(&status, &ids),
        2,
        "each running agent holds a share: {status}"
    );
    assert_eq!(status["gpus"][0]["shares"], 2, "{status}");

    wait_pool(&c, "gpujobs", "processed", Duration::from_secs(120), |p| {
        p.processed == 6
    })
    .await;
    let p = wait_pool(&c, "gpujobs", "zero agents", Duration::from_secs(60), |p| {
        p.running == 0 && p.desired == 0 && p.draining == 0 && p.starting == 0
    })
    .await;
    // At zero: every share is back (read before anything wakes the agents again).
    let status = c.gpus().await.unwrap();
    assert_eq!(held(&status, &ids), 0, "shares released at zero: {status}");
    assert_eq!(status["gpus"][0]["shares"], 0, "{status}");
    assert_eq!(
        status["gpus"][0]["free"]["mig_memory_slices"], 8,
        "{status}"
    );
    for id in &ids {
        assert!(
            status["sleeping"]
                .as_array()
                .unwrap()
                .contains(&serde_json::json!(id)),
            "{id} listed as sleeping: {status}"
        );
    }
    exactly_once(&handled(&c, &p).await, &sent);
    c.delete_pool("gpujobs").await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_pool_settings_are_refused_at_create_naming_the_field() {
    let d = Daemon::start().await;
    let c = d.client();
    let base = || {
        serde_json::json!({
            "name": "p", "template": "host", "max": 2,
            "triggers": [{"type": "redis-list", "url": "redis://127.0.0.1:1", "key": "q"}],
        })
    };
    let cases: Vec<(serde_json::Value, &str)> = vec![
        (
            serde_json::json!({"triggers": [{"type": "redis-list", "url": "http://h", "key": "q"}]}),
            "triggers[0].url",
        ),
        (
            serde_json::json!({"triggers": [{"type": "redis-list", "url": "redis://h", "key": ""}]}),
            "triggers[0].key",
        ),
        (
            serde_json::json!({"triggers": [{"type": "nats-jetstream", "url": "nats://h", "stream": "a b", "consumer": "c"}]}),
            "triggers[0].stream",
        ),
        (
            serde_json::json!({"triggers": [{"type": "rabbitmq", "url": "amqp://h", "management_url": "ftp://h", "queue": "q"}]}),
            "triggers[0].management_url",
        ),
        (serde_json::json!({"triggers": []}), "triggers"),
        (serde_json::json!({"min": 3}), "min"),
        (serde_json::json!({"max": 0}), "max"),
        (serde_json::json!({"target": 0}), "target"),
        (
            serde_json::json!({"poll_interval_ms": 1}),
            "poll_interval_ms",
        ),
        (
            serde_json::json!({"fallback": {"failure_threshold": 0, "replicas": 1}}),
            "fallback.failure_threshold",
        ),
        (
            serde_json::json!({"dispatch": {"command": []}}),
            "dispatch.command",
        ),
        (
            serde_json::json!({"dispatch": {"command": ["x"], "max_attempts": 0}}),
            "dispatch.max_attempts",
        ),
        (
            serde_json::json!({"triggers": [{"type": "sqs", "url": "x"}]}),
            "sqs",
        ),
        (serde_json::json!({"surprise": 1}), "surprise"),
    ];
    for (patch, needle) in cases {
        let mut body = base();
        for (k, v) in patch.as_object().unwrap() {
            body[k] = v.clone();
        }
        match c.create_pool(&body).await {
            Err(ClientError::Api {
                status, message, ..
            }) => {
                assert_eq!(status, 400, "{body}: {message}");
                assert!(
                    message.contains(needle),
                    "{body}: {message:?} does not name {needle}"
                );
            }
            other => panic!("{body} accepted or odd answer: {other:?}"),
        }
    }
    // Without the cargo feature `kafka`, a kafka trigger is refused with a code of its own.
    #[cfg(not(feature = "kafka"))]
    {
        let mut body = base();
        body["triggers"] = serde_json::json!([{"type": "kafka", "brokers": ["h:9092"], "topic": "t", "group": "g"}]);
        match c.create_pool(&body).await {
            Err(ClientError::Api {
                status,
                code,
                message,
                ..
            }) => {
                assert_eq!(
                    (status, code.as_str()),
                    (400, "feature_disabled"),
                    "{message}"
                );
                assert!(
                    message.contains("triggers[0]") && message.contains("`kafka`"),
                    "{message}"
                );
            }
            other => panic!("kafka accepted without the feature: {other:?}"),
        }
    }
    // An unknown template is 404, a second pool of one name 409.
    let mut body = base();
    body["template"] = "nope".into();
    let e = c.create_pool(&body).await.unwrap_err();
    assert!(matches!(e, ClientError::Api { status: 404, .. }), "{e}");
    c.create_pool(&base()).await.unwrap();
    let e = c.create_pool(&base()).await.unwrap_err();
    assert!(
        matches!(e, ClientError::Api { status: 409, ref code, .. } if code == "already_exists"),
        "{e}"
    );
    assert_eq!(c.pools().await.unwrap().len(), 1);
    // Pools survive a restart (SQLite).
    let mut d = d;
    d.stop();
    d.spawn().await;
    let c = d.client();
    assert_eq!(c.pool("p").await.unwrap().spec.max, 2);
    c.delete_pool("p").await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn keda_external_scaler_serves_the_pool_demand_over_grpc() {
    use torpor_triggers::externalscaler::external_scaler_client::ExternalScalerClient;
    use torpor_triggers::externalscaler::{GetMetricsRequest, ScaledObjectRef};

    let redis = Redis::start();
    let keda_port = free_port();
    let d = Daemon::start_with(&["--keda-listen", &format!("127.0.0.1:{keda_port}")]).await;
    let c = d.client();
    let mut con = redis.conn().await;
    // Self-consume: torpor only scales, so the queue keeps its 7 messages.
    let _: i64 = redis_cmd(
        &mut con,
        &["LPUSH", "kq", "1", "2", "3", "4", "5", "6", "7"],
    )
    .await;
    c.create_pool(&serde_json::json!({
        "name": "kpool", "template": "host", "max": 1, "target": 5, "activation": 2,
        "cooldown_s": 0, "poll_interval_ms": 100,
        "triggers": [{"type": "redis-list", "url": redis.url(), "key": "kq"}],
    }))
    .await
    .unwrap();
    wait_pool(&c, "kpool", "depth 7", Duration::from_secs(20), |p| {
        p.depth == Some(7)
    })
    .await;

    let mut g = ExternalScalerClient::connect(format!("http://127.0.0.1:{keda_port}"))
        .await
        .unwrap();
    let obj = |pool: Option<&str>| ScaledObjectRef {
        name: "workers".into(),
        namespace: "default".into(),
        scaler_metadata: pool
            .map(|p| [("pool".to_string(), p.to_string())].into())
            .unwrap_or_default(),
    };
    let spec = g
        .get_metric_spec(obj(Some("kpool")))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(spec.metric_specs.len(), 1);
    assert_eq!(spec.metric_specs[0].metric_name, "kpool");
    assert_eq!(spec.metric_specs[0].target_size, 5);
    let m = g
        .get_metrics(GetMetricsRequest {
            scaled_object_ref: Some(obj(Some("kpool"))),
            metric_name: "kpool".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(m.metric_values[0].metric_name, "kpool");
    assert_eq!(m.metric_values[0].metric_value, 7);
    assert!(
        g.is_active(obj(Some("kpool")))
            .await
            .unwrap()
            .into_inner()
            .result
    );
    let mut stream = g
        .stream_is_active(obj(Some("kpool")))
        .await
        .unwrap()
        .into_inner();
    assert!(stream.message().await.unwrap().unwrap().result);

    // Depth at the activation threshold (2, not strictly above): inactive, pushed on the stream.
    let _: String = redis_cmd(&mut con, &["LTRIM", "kq", "0", "1"]).await;
    let next = tokio::time::timeout(Duration::from_secs(20), stream.message())
        .await
        .expect("StreamIsActive sends the change")
        .unwrap()
        .unwrap();
    assert!(!next.result);
    assert!(
        !g.is_active(obj(Some("kpool")))
            .await
            .unwrap()
            .into_inner()
            .result
    );

    // Errors: no pool key, an unknown pool.
    let e = g.is_active(obj(None)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
    let e = g.get_metric_spec(obj(Some("nope"))).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e}");
}
