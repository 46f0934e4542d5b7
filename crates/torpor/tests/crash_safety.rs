//! Crash safety: the daemon is SIGKILLed during checkpoints and during restores, again and
//! again. After every restart each sandbox is usable, holds its last committed state, and no
//! sandbox is left in a transitional state.

mod common;

use std::time::Duration;

use common::*;
use torpor_core::Tier;

const ROUNDS: usize = 20;

/// The two tests kill and restart daemons; they run one at a time so that one's kills and
/// restarts do not share the machine's two cores with the other's timing-sensitive rounds.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_during_checkpoint_and_restore_loses_nothing_committed() {
    let _serial = SERIAL.lock().await;
    let mut d = Daemon::start().await;
    let c = d.client();
    c.create_template(&agent_template("crashy", no_idle()))
        .await
        .unwrap();
    let id = create(&c, "crashy").await;
    assert_eq!(call_agent(&c, &id, "init").await, (1, 1));
    c.suspend(&id, Some(Tier::Parked)).await.unwrap();
    // The counter held by the last committed snapshot.
    let mut committed = 1u64;

    for round in 0..ROUNDS {
        let c = d.client();
        let during_checkpoint = round % 2 == 0;
        // Spread the kill over the whole operation (restore or checkpoint take ~0.2-0.5 s).
        let delay = Duration::from_millis(((round * 37) % 450) as u64 + 20);
        let mut allowed = vec![committed];
        if during_checkpoint {
            // Running with one uncommitted call, then a checkpoint that may or may not finish.
            let (n, _) = call_agent(&c, &id, &format!("r{round}")).await;
            assert_eq!(n, committed + 1);
            allowed.push(n);
            let bg = c.clone();
            let bid = id.clone();
            tokio::spawn(async move {
                let _ = bg.suspend(&bid, Some(Tier::Parked)).await;
            });
        } else {
            // Parked: a call wakes it (a restore), killed somewhere along the way. A wake that
            // finished before the kill leaves the sandbox running with the call's effect, and
            // live restore takes it back as it is.
            allowed.push(committed + 1);
            let bg = c.clone();
            let bid = id.clone();
            tokio::spawn(async move {
                let _ = bg
                    .exec(&bid, &sh("echo wake > /tmp/in && cat /tmp/out"))
                    .await;
            });
        }
        tokio::time::sleep(delay).await;
        d.kill();
        d.spawn().await;
        let c = d.client();

        for s in c.sandboxes(None).await.unwrap() {
            assert!(
                ["parked", "suspended", "running"].contains(&s.state.as_str()),
                "round {round}: {} stuck in {}",
                s.id,
                s.state
            );
        }
        let (n, logged) = call_agent(&c, &id, &format!("check{round}")).await;
        assert_eq!(n, logged, "round {round}: memory and files disagree");
        assert!(
            allowed.contains(&(n - 1)),
            "round {round} (kill during {}): woke with counter {}, committed states {allowed:?}",
            if during_checkpoint {
                "checkpoint"
            } else {
                "restore"
            },
            n - 1
        );
        c.suspend(&id, Some(Tier::Parked)).await.unwrap();
        committed = n;
    }
    // Nothing leaked: no container of ours is left running, no half-written checkpoint kept.
    let images = d.dir.join("sandboxes").join(&id).join("images");
    let tmp: Vec<_> = std::fs::read_dir(&images)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp"))
        .collect();
    assert!(tmp.is_empty(), "uncommitted checkpoints left: {tmp:?}");
    let committed_images = std::fs::read_dir(&images).unwrap().count();
    assert_eq!(
        committed_images, 1,
        "old checkpoints are removed once superseded"
    );
}

/// A sandbox whose last snapshot holds one call (it was parked after it) and which is frozen
/// with a second, uncommitted call in its memory.
async fn frozen_after_two_calls(d: &Daemon) -> String {
    let c = d.client();
    c.create_template(&agent_template("frosty", no_idle()))
        .await
        .unwrap();
    let id = create(&c, "frosty").await;
    assert_eq!(call_agent(&c, &id, "a").await, (1, 1));
    c.suspend(&id, Some(Tier::Parked)).await.unwrap();
    assert_eq!(call_agent(&c, &id, "b").await, (2, 2));
    c.suspend(&id, Some(Tier::Frozen)).await.unwrap();
    id
}

/// A frozen sandbox outlives a SIGKILLed daemon under its shim and is taken back as it is.
#[tokio::test(flavor = "multi_thread")]
async fn a_crash_while_frozen_loses_nothing() {
    let _serial = SERIAL.lock().await;
    let mut d = Daemon::start().await;
    let id = frozen_after_two_calls(&d).await;
    d.kill();
    d.spawn().await;
    let c = d.client();
    assert_eq!(c.sandbox(&id).await.unwrap().state, "frozen");
    // The uncommitted call is still there, in memory and on disk.
    assert_eq!(call_agent(&c, &id, "c").await, (3, 3));
}

/// Without live restore, a crash while frozen sends the sandbox back to its last snapshot and
/// leaves no process of the frozen container behind.
#[tokio::test(flavor = "multi_thread")]
async fn a_crash_while_frozen_leaves_nothing_stuck() {
    let _serial = SERIAL.lock().await;
    let mut d = Daemon::start_with(&["--live-restore=false"]).await;
    let id = frozen_after_two_calls(&d).await;
    let old_container = d.dir.join("runsc");
    d.kill();
    d.spawn().await;
    let c = d.client();
    // Back to the last committed snapshot (counter 1), and the frozen container is gone.
    assert_eq!(call_agent(&c, &id, "c").await, (2, 2));
    let leftovers: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|p| std::fs::read(p.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| {
            c.contains(&format!("{id}-g")) && c.contains(&old_container.display().to_string())
        })
        .filter(|c| !c.contains(&format!("{id}-g3")))
        .collect();
    assert!(
        leftovers.is_empty(),
        "processes of the frozen container survived: {leftovers:?}"
    );
}
