//! Kafka pools (cargo feature `kafka`) against a real Kafka-compatible broker (tansu, started
//! by this test; scripts/test-kafka.sh installs it and runs this file):
//! - the consumer-group lag as KEDA reads it (no committed offset: 1 per partition with
//!   `latest`, the whole log with `earliest`);
//! - dispatch from zero over two partitions: every record processed once, the poison one
//!   produced to the dead-letter topic, offsets committed so the lag is 0, back to zero.

#![cfg(feature = "kafka")]

#[path = "common/brokers.rs"]
mod brokers;
mod common;

use std::time::Duration;

use brokers::{exactly_once, handled, wait_pool, Tansu, HANDLER};
use common::*;
use torpor_triggers::kafka::{admin, LagReader, Reset};

#[tokio::test(flavor = "multi_thread")]
async fn kafka_lag_reads_like_keda_and_a_pool_dispatches_each_record_once() {
    let tansu = Tansu::start();
    let brokers = tansu.brokers();
    admin::create_topic(&brokers, "kjobs", 2).await.unwrap();
    admin::create_topic(&brokers, "kjobs.dead", 1)
        .await
        .unwrap();

    // No committed offset: KEDA's default counts 1 per partition; `earliest` counts the log.
    let mut latest = LagReader::new(&brokers, "kjobs", "nobody", Reset::Latest);
    assert_eq!(latest.lag().await.unwrap(), 2);
    let sent: Vec<String> = (0..8).map(|i| format!("k-{i}")).collect();
    let mut values: Vec<Vec<u8>> = sent.iter().map(|s| s.as_bytes().to_vec()).collect();
    values.push(b"poison-k".to_vec());
    admin::produce(&brokers, "kjobs", &values).await.unwrap();
    let mut earliest = LagReader::new(&brokers, "kjobs", "nobody", Reset::Earliest);
    assert_eq!(earliest.lag().await.unwrap(), 9);
    assert_eq!(latest.lag().await.unwrap(), 2);
    // A topic that does not exist.
    let mut missing = LagReader::new(&brokers, "nope", "g", Reset::Latest);
    let e = missing.lag().await.unwrap_err();
    assert_eq!(e.code(), "broker_missing", "{e}");

    let d = Daemon::start_with(&["--workers", "8"]).await;
    let c = d.client();
    c.create_pool(&serde_json::json!({
        "name": "kjobs", "template": "host", "max": 2, "target": 3, "cooldown_s": 2,
        "poll_interval_ms": 300,
        "triggers": [{"type": "kafka", "brokers": brokers, "topic": "kjobs",
                      "group": "workers", "offset_reset": "earliest"}],
        "dispatch": {"command": ["python3", "-c", HANDLER], "max_attempts": 2,
                     "retry_backoff_ms": 50},
    }))
    .await
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let p = loop {
        let p = c.pool("kjobs").await.unwrap();
        if p.processed == 8 && p.dead_lettered == 1 {
            break p;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not all settled: {p:?}\ndaemon log:\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(p.failed_attempts, 2);
    assert_eq!(p.sandboxes.len(), 2, "lag 9 at target 3 asks for max=2");
    let p = wait_pool(&c, "kjobs", "zero agents", Duration::from_secs(60), |p| {
        p.running == 0 && p.desired == 0 && p.draining == 0 && p.starting == 0
    })
    .await;
    assert_eq!(p.depth, Some(0), "offsets committed: no lag left");
    exactly_once(&handled(&c, &p).await, &sent);
    let mut dead = LagReader::new(&brokers, "kjobs.dead", "check", Reset::Earliest);
    assert_eq!(
        dead.lag().await.unwrap(),
        1,
        "the poison record is dead-lettered"
    );
    let mut group = LagReader::new(&brokers, "kjobs", "workers", Reset::Latest);
    assert_eq!(group.lag().await.unwrap(), 0);

    // More records wake an agent again.
    admin::produce(&brokers, "kjobs", &[b"k-late".to_vec()])
        .await
        .unwrap();
    let p = wait_pool(
        &c,
        "kjobs",
        "the late record",
        Duration::from_secs(60),
        |p| p.processed == 9,
    )
    .await;
    let mut all = sent.clone();
    all.push("k-late".into());
    exactly_once(&handled(&c, &p).await, &all);
    c.delete_pool("kjobs").await.unwrap();
}
