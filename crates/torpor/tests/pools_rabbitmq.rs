//! RabbitMQ pools against a real broker (with its management plugin), started once for this
//! test binary (~7 s): dispatch from zero and back, exactly once; depth from the management API
//! and from an AMQP passive declare; a missing queue and wrong credentials are reported.

#[path = "common/brokers.rs"]
mod brokers;
mod common;

use std::time::Duration;

use brokers::{exactly_once, handled, wait_pool, Rabbit, HANDLER};
use common::*;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};

async fn publish(ch: &lapin::Channel, queue: &str, msgs: &[String]) {
    for m in msgs {
        ch.basic_publish(
            "",
            queue,
            BasicPublishOptions::default(),
            m.as_bytes(),
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
}

async fn declare(ch: &lapin::Channel, queue: &str) {
    ch.queue_declare(
        queue,
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
}

async fn ready(ch: &lapin::Channel, queue: &str) -> u32 {
    ch.queue_declare(
        queue,
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap()
    .message_count()
}

#[tokio::test(flavor = "multi_thread")]
async fn rabbitmq_pools_dispatch_once_read_depth_both_ways_and_report_faults() {
    let rabbit = Rabbit::start();
    let d = Daemon::start_with(&["--workers", "8"]).await;
    let c = d.client();
    let conn = Connection::connect(&rabbit.url(), ConnectionProperties::default())
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    declare(&ch, "rjobs").await;
    declare(&ch, "rdepth").await;

    // Dispatch from zero.
    c.create_pool(&serde_json::json!({
        "name": "rjobs", "template": "host", "max": 2, "target": 3, "cooldown_s": 2,
        "poll_interval_ms": 300,
        "triggers": [{"type": "rabbitmq", "url": rabbit.url(),
                      "management_url": rabbit.management_url(), "queue": "rjobs"}],
        "dispatch": {"command": ["python3", "-c", HANDLER], "max_attempts": 2,
                     "retry_backoff_ms": 50, "dead_letter": "rjobs-dead"},
    }))
    .await
    .unwrap();
    let sent: Vec<String> = (0..9).map(|i| format!("r-{i}")).collect();
    publish(&ch, "rjobs", &sent).await;
    publish(&ch, "rjobs", &["poison-r".to_string()]).await;
    let p = wait_pool(&c, "rjobs", "all settled", Duration::from_secs(120), |p| {
        p.processed == 9 && p.dead_lettered == 1
    })
    .await;
    assert!(!p.sandboxes.is_empty());
    assert_eq!(ready(&ch, "rjobs").await, 0, "the queue drained");
    assert_eq!(
        ready(&ch, "rjobs-dead").await,
        1,
        "the poison message is dead-lettered"
    );
    let p = wait_pool(&c, "rjobs", "zero agents", Duration::from_secs(60), |p| {
        p.running == 0 && p.desired == 0 && p.draining == 0
    })
    .await;
    exactly_once(&handled(&c, &p).await, &sent);

    // Depth without the management API: a passive declare (self-consume pool, max 1).
    publish(&ch, "rdepth", &["1".into(), "2".into(), "3".into()]).await;
    c.create_pool(&serde_json::json!({
        "name": "rdepth", "template": "host", "max": 1, "poll_interval_ms": 200,
        "triggers": [{"type": "rabbitmq", "url": rabbit.url(), "queue": "rdepth"}],
    }))
    .await
    .unwrap();
    wait_pool(&c, "rdepth", "depth 3", Duration::from_secs(20), |p| {
        p.depth == Some(3)
    })
    .await;

    // A missing queue, and wrong credentials, are reported with their codes.
    c.create_pool(&serde_json::json!({
        "name": "rmissing", "template": "host", "max": 1, "poll_interval_ms": 200,
        "triggers": [{"type": "rabbitmq", "url": rabbit.url(),
                      "management_url": rabbit.management_url(), "queue": "nope"}],
    }))
    .await
    .unwrap();
    let p = wait_pool(&c, "rmissing", "an error", Duration::from_secs(20), |p| {
        p.triggers[0].error.is_some()
    })
    .await;
    assert_eq!(
        p.triggers[0].error.as_ref().unwrap().code,
        "broker_missing",
        "{p:?}"
    );
    let bad = rabbit.url().replace("guest:guest", "guest:wrong");
    c.create_pool(&serde_json::json!({
        "name": "rcreds", "template": "host", "max": 1, "poll_interval_ms": 200,
        "triggers": [{"type": "rabbitmq", "url": bad, "queue": "rdepth"}],
    }))
    .await
    .unwrap();
    let p = wait_pool(&c, "rcreds", "an error", Duration::from_secs(20), |p| {
        p.triggers[0].error.is_some()
    })
    .await;
    assert_eq!((p.running, p.desired), (0, 0), "{p:?}");
    for name in ["rjobs", "rdepth", "rmissing", "rcreds"] {
        c.delete_pool(name).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn rabbitmq_restart_the_trigger_and_lanes_reconnect_and_nothing_is_lost() {
    let mut rabbit = Rabbit::start();
    let d = Daemon::start_with(&["--workers", "8"]).await;
    let c = d.client();
    let channel = |url: String| async move {
        let conn = Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        (conn, ch)
    };
    let (_conn, ch) = channel(rabbit.url()).await;
    declare(&ch, "rr").await;
    // A long cooldown: the agents and their lanes stay up across the restart.
    c.create_pool(&serde_json::json!({
        "name": "rr", "template": "host", "max": 2, "target": 2, "cooldown_s": 120,
        "poll_interval_ms": 200,
        "triggers": [{"type": "rabbitmq", "url": rabbit.url(), "queue": "rr"}],
        "dispatch": {"command": ["python3", "-c", HANDLER], "max_attempts": 2,
                     "retry_backoff_ms": 50},
    }))
    .await
    .unwrap();
    let before: Vec<String> = (0..4).map(|i| format!("before-{i}")).collect();
    publish(&ch, "rr", &before).await;
    let p = wait_pool(&c, "rr", "before", Duration::from_secs(120), |p| {
        p.processed == 4
    })
    .await;
    assert!(!p.sandboxes.is_empty());
    // Settled: nothing queued, nothing starting or draining; the agents kept by the cooldown.
    let p = wait_pool(&c, "rr", "settled", Duration::from_secs(60), |p| {
        p.depth == Some(0) && p.starting == 0 && p.draining == 0
    })
    .await;
    let agents = p.running as usize;
    assert!(agents >= 1);

    // Down: the trigger reports it and the pool keeps its agents.
    rabbit.stop();
    let p = wait_pool(&c, "rr", "an error", Duration::from_secs(60), |p| {
        p.triggers[0].error.is_some()
    })
    .await;
    assert_eq!(p.running as usize, agents, "the pool keeps its size: {p:?}");
    // Back (same data directory: the durable queue is there): new work flows.
    rabbit.restart();
    let (_conn, ch) = channel(rabbit.url()).await;
    let after: Vec<String> = (0..4).map(|i| format!("after-{i}")).collect();
    publish(&ch, "rr", &after).await;
    let p = wait_pool(&c, "rr", "after", Duration::from_secs(120), |p| {
        p.processed == 8 && p.triggers[0].error.is_none()
    })
    .await;
    assert_eq!(ready(&ch, "rr").await, 0, "the queue drained");
    let mut all = before.clone();
    all.extend(after);
    exactly_once(&handled(&c, &p).await, &all);
    c.delete_pool("rr").await.unwrap();
}
