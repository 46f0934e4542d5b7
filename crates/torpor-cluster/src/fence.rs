//! Fencing a worker that one controller cannot hear while another can (a partial partition).
//!
//! A worker cut off from *every* controller fences itself (`join::fence`, `--fence-after-ms`,
//! below the controllers' `--worker-lost-after-ms`). A worker that controller B cannot hear but
//! controller A still hears would run B's containers on after B counted it lost and resumed
//! their sandboxes elsewhere: one sandbox, two copies. So B ends them through A first:
//!
//! ```text
//!   B: worker lost ──order──▶ fence_orders (PostgreSQL) ◀──read every heartbeat period── A
//!   A ──HeartbeatReply.fence──▶ worker: ends each container B still owns
//!   worker ──HeartbeatRequest.fenced──▶ A ──done──▶ fence_orders (the rows go)
//!   B: its rows are gone ──▶ reports the containers lost: the sandboxes resume elsewhere
//! ```
//!
//! - B waits for its orders before it reports the containers lost, so the stale copy is gone
//!   before the new one starts. When no controller relays them within [`Fencer::relay_window`]
//!   (a few heartbeats), no controller hears the worker: it fenced itself already. One relayed
//!   but not confirmed within [`Fencer::confirm_window`] is given up on, and logged.
//! - The worker ends a container only while the ordering controller still owns it (one that
//!   adopted it since keeps it), and confirms orders for containers it does not hold.
//! - Orders live in the shared database ([`FenceBook`], the controllers' PostgreSQL), so they
//!   reach the worker through whichever controller hears it; each controller reads them once
//!   per heartbeat period whatever the fleet's size, and an order unconfirmed for an hour is
//!   dropped (its worker was reached by no controller, or registered again: its leftovers were
//!   removed then).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::pb;

/// One open order, as the book keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceOrder {
    pub worker: String,
    pub container: String,
    /// The controller that held the container when it ordered it ended.
    pub owner: String,
    /// Whether a controller that hears the worker handed it over.
    pub relayed: bool,
}

/// Where the controllers of one database keep fence orders (the state store, in the binary).
/// Calls block (a database round trip): they are made off the RPC path.
pub trait FenceBook: Send + Sync {
    /// Orders `containers` of `owner` on `worker` ended.
    fn order(&self, worker: &str, owner: &str, containers: &[String]) -> Result<(), String>;
    /// Every open order.
    fn open(&self) -> Result<Vec<FenceOrder>, String>;
    /// Marks `worker`'s orders for `containers` as handed over.
    fn relayed(&self, worker: &str, containers: &[String]) -> Result<(), String>;
    /// Removes `worker`'s orders for `containers` (they no longer run there).
    fn done(&self, worker: &str, containers: &[String]) -> Result<(), String>;
    /// Whether a controller other than `me` is alive (none: no other can hear a worker).
    fn others_alive(&self, me: &str) -> Result<bool, String>;
}

/// A controller's side of fencing: the book, the open orders as last read, and what its
/// workers' heartbeats relayed and confirmed since.
pub struct Fencer {
    book: Arc<dyn FenceBook>,
    /// This controller's name (the owner its orders name).
    me: String,
    heartbeat: Duration,
    open: Mutex<OpenOrders>,
}

/// Open orders by worker, as last read: `(container, owner, relayed)`.
type OpenOrders = HashMap<String, Vec<(String, String, bool)>>;

impl Fencer {
    pub fn new(book: Arc<dyn FenceBook>, me: String, heartbeat: Duration) -> Arc<Fencer> {
        Arc::new(Fencer {
            book,
            me,
            heartbeat,
            open: Mutex::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OpenOrders> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How long an order may wait for a controller that hears its worker to hand it over
    /// (that one reads orders once a heartbeat period and the worker heartbeats as often).
    pub fn relay_window(&self) -> Duration {
        self.heartbeat * 3 + Duration::from_secs(1)
    }

    /// How long a handed-over order may wait for its worker's confirmation.
    pub fn confirm_window(&self) -> Duration {
        self.heartbeat * 10 + Duration::from_secs(2)
    }

    /// A heartbeat from `worker` (its certificate's name): records which of its open orders
    /// it carried out (only its own: a worker cannot close another's), and answers the
    /// orders still open for it. What changed is written at once, off this thread.
    pub fn on_heartbeat(&self, worker: &str, fenced: Vec<String>) -> Vec<pb::FenceOrder> {
        let (orders, carried_out, handed) = {
            let mut all = self.lock();
            let Some(open) = all.get_mut(worker) else {
                return Vec::new();
            };
            let (carried_out, mut still): (Vec<_>, Vec<_>) = std::mem::take(open)
                .into_iter()
                .partition(|(c, _, _)| fenced.contains(c));
            let mut handed = Vec::new();
            for (container, _, relayed) in still.iter_mut() {
                if !*relayed {
                    *relayed = true;
                    handed.push(container.clone());
                }
            }
            let orders: Vec<pb::FenceOrder> = still
                .iter()
                .map(|(container, owner, _)| pb::FenceOrder {
                    container: container.clone(),
                    owner: owner.clone(),
                })
                .collect();
            *open = still;
            let carried_out: Vec<String> = carried_out.into_iter().map(|(c, _, _)| c).collect();
            (orders, carried_out, handed)
        };
        if !carried_out.is_empty() || !handed.is_empty() {
            let (book, worker) = (self.book.clone(), worker.to_string());
            tokio::task::spawn_blocking(move || {
                if let Err(e) = book
                    .done(&worker, &carried_out)
                    .and_then(|()| book.relayed(&worker, &handed))
                {
                    // The rows stay open: handed over (and confirmed) again next time.
                    tracing::warn!(%worker, error = %e, "cannot record fence orders");
                } else if !carried_out.is_empty() {
                    tracing::info!(%worker, containers = ?carried_out, "fence orders carried out");
                }
            });
        }
        orders
    }

    /// Reads the open orders again (blocking).
    fn sync(&self) -> Result<(), String> {
        let mut open = OpenOrders::new();
        for o in self.book.open()? {
            open.entry(o.worker)
                .or_default()
                .push((o.container, o.owner, o.relayed));
        }
        *self.lock() = open;
        Ok(())
    }

    /// Keeps the open orders current, once per heartbeat period, until the fencer is dropped.
    pub fn spawn_sync(self: &Arc<Self>) {
        let me = Arc::downgrade(self);
        let period = self.heartbeat;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(f) = me.upgrade() else { return };
                match tokio::task::spawn_blocking(move || f.sync()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::warn!(error = %e, "cannot read or write fence orders"),
                    Err(e) => tracing::warn!(error = %e, "fence order task failed"),
                }
            }
        });
    }

    /// `f` on the book, off the async threads (a database round trip).
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn FenceBook) -> Result<T, String> + Send + 'static,
    ) -> Result<T, String> {
        let book = self.book.clone();
        tokio::task::spawn_blocking(move || f(&*book))
            .await
            .map_err(|e| e.to_string())?
    }

    /// Orders `containers` on `worker` (lost to this controller) ended and waits until they
    /// are, or no controller hears the worker, or the confirmation window passes.
    pub async fn fence(&self, worker: &str, containers: &[String]) -> Fenced {
        if containers.is_empty() {
            return Fenced::Nothing;
        }
        let (me, w, c) = (self.me.clone(), worker.to_string(), containers.to_vec());
        let ordered = self
            .blocking(move |b| {
                if !b.others_alive(&me)? {
                    return Ok(false);
                }
                b.order(&w, &me, &c)?;
                Ok(true)
            })
            .await;
        match ordered {
            Ok(true) => {}
            Ok(false) => return Fenced::NoOneHearsIt,
            Err(e) => return Fenced::Failed(e),
        }
        let started = Instant::now();
        let poll = (self.heartbeat / 2).clamp(Duration::from_millis(50), Duration::from_secs(1));
        loop {
            tokio::time::sleep(poll).await;
            let (w, c) = (worker.to_string(), containers.to_vec());
            let mine = self
                .blocking(move |b| {
                    let open: Vec<FenceOrder> = b
                        .open()?
                        .into_iter()
                        .filter(|o| o.worker == w && c.contains(&o.container))
                        .collect();
                    Ok(match open.len() {
                        0 => Fenced::Confirmed,
                        _ if open.iter().any(|o| o.relayed) => Fenced::Unconfirmed,
                        _ => Fenced::NoOneHearsIt,
                    })
                })
                .await;
            match mine {
                Ok(Fenced::Confirmed) => return Fenced::Confirmed,
                Ok(Fenced::NoOneHearsIt) if started.elapsed() >= self.relay_window() => {
                    return Fenced::NoOneHearsIt
                }
                Ok(Fenced::Unconfirmed) if started.elapsed() >= self.confirm_window() => {
                    return Fenced::Unconfirmed
                }
                Ok(_) => {}
                Err(e) => return Fenced::Failed(e),
            }
        }
    }
}

/// How a [`Fencer::fence`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fenced {
    /// Nothing to fence.
    Nothing,
    /// The worker ended every container (or no longer held it).
    Confirmed,
    /// No controller hears the worker: it fenced itself (`--fence-after-ms`).
    NoOneHearsIt,
    /// A controller handed the orders over, the worker did not confirm in time.
    Unconfirmed,
    /// The orders could not be written or read.
    Failed(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A book in memory, as the database would keep it for several controllers.
    #[derive(Default)]
    struct Book {
        rows: Mutex<Vec<FenceOrder>>,
        others: bool,
    }

    impl FenceBook for Book {
        fn order(&self, worker: &str, owner: &str, containers: &[String]) -> Result<(), String> {
            let mut rows = self.rows.lock().unwrap();
            for c in containers {
                rows.retain(|o| !(o.worker == worker && &o.container == c));
                rows.push(FenceOrder {
                    worker: worker.into(),
                    container: c.clone(),
                    owner: owner.into(),
                    relayed: false,
                });
            }
            Ok(())
        }
        fn open(&self) -> Result<Vec<FenceOrder>, String> {
            Ok(self.rows.lock().unwrap().clone())
        }
        fn relayed(&self, worker: &str, containers: &[String]) -> Result<(), String> {
            for o in self.rows.lock().unwrap().iter_mut() {
                if o.worker == worker && containers.contains(&o.container) {
                    o.relayed = true;
                }
            }
            Ok(())
        }
        fn done(&self, worker: &str, containers: &[String]) -> Result<(), String> {
            self.rows
                .lock()
                .unwrap()
                .retain(|o| !(o.worker == worker && containers.contains(&o.container)));
            Ok(())
        }
        fn others_alive(&self, _me: &str) -> Result<bool, String> {
            Ok(self.others)
        }
    }

    const BEAT: Duration = Duration::from_millis(20);

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[tokio::test]
    async fn orders_reach_the_worker_through_a_controller_that_hears_it_and_end_the_wait() {
        let book = Arc::new(Book {
            others: true,
            ..Book::default()
        });
        let b = Fencer::new(book.clone(), "c2".into(), BEAT);
        let a = Fencer::new(book.clone(), "c1".into(), BEAT);
        let wait = tokio::spawn({
            let b = b.clone();
            async move { b.fence("w1", &ids(&["x-g1", "y-g1"])).await }
        });
        // c1 reads the orders and hands them to w1 in its heartbeat reply (not to w2).
        let orders = loop {
            tokio::time::sleep(BEAT).await;
            a.sync().unwrap();
            let orders = a.on_heartbeat("w1", Vec::new());
            if !orders.is_empty() {
                break orders;
            }
        };
        assert!(a.on_heartbeat("w2", Vec::new()).is_empty());
        // Another worker cannot close w1's orders.
        assert!(a.on_heartbeat("w2", ids(&["x-g1", "y-g1"])).is_empty());
        a.sync().unwrap();
        assert_eq!(book.open().unwrap().len(), 2);
        let mut got: Vec<(String, String)> =
            orders.into_iter().map(|o| (o.container, o.owner)).collect();
        got.sort();
        assert_eq!(
            got,
            [("x-g1".into(), "c2".into()), ("y-g1".into(), "c2".into())]
        );
        // Marked as handed over (written off the heartbeat's thread).
        let deadline = Instant::now() + Duration::from_secs(10);
        while !book.open().unwrap().iter().all(|o| o.relayed) {
            assert!(Instant::now() < deadline, "never marked relayed");
            tokio::time::sleep(BEAT).await;
        }
        assert!(!wait.is_finished(), "c2 waits for the worker's word");
        // The worker confirms one; it is no longer handed over, and c2 still waits.
        assert_eq!(a.on_heartbeat("w1", ids(&["x-g1"])).len(), 1);
        a.sync().unwrap();
        tokio::time::sleep(BEAT * 3).await;
        assert!(!wait.is_finished());
        a.on_heartbeat("w1", ids(&["y-g1"]));
        a.sync().unwrap();
        assert_eq!(wait.await.unwrap(), Fenced::Confirmed);
        assert!(book.open().unwrap().is_empty());
    }

    #[tokio::test]
    async fn an_order_no_controller_relays_ends_the_wait_after_the_relay_window() {
        let book = Arc::new(Book {
            others: true,
            ..Book::default()
        });
        let b = Fencer::new(book.clone(), "c2".into(), BEAT);
        let started = Instant::now();
        assert_eq!(b.fence("w1", &ids(&["x-g1"])).await, Fenced::NoOneHearsIt);
        assert!(started.elapsed() >= b.relay_window());
        assert!(started.elapsed() < b.confirm_window());
        // The order stays open: the worker ends the container if it reaches a controller.
        assert_eq!(book.open().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_relayed_order_never_confirmed_is_given_up_on_after_the_confirm_window() {
        let book = Arc::new(Book {
            others: true,
            ..Book::default()
        });
        let b = Fencer::new(book.clone(), "c2".into(), BEAT);
        let started = Instant::now();
        let wait = tokio::spawn({
            let b = b.clone();
            async move { b.fence("w1", &ids(&["x-g1"])).await }
        });
        tokio::time::sleep(BEAT).await;
        book.relayed("w1", &ids(&["x-g1"])).unwrap();
        assert_eq!(wait.await.unwrap(), Fenced::Unconfirmed);
        assert!(started.elapsed() >= b.confirm_window());
    }

    #[tokio::test]
    async fn alone_a_controller_orders_nothing_and_does_not_wait() {
        let book = Arc::new(Book::default());
        let b = Fencer::new(book.clone(), "c2".into(), Duration::from_secs(60));
        assert_eq!(b.fence("w1", &ids(&["x-g1"])).await, Fenced::NoOneHearsIt);
        assert!(book.open().unwrap().is_empty());
        assert_eq!(b.fence("w1", &[]).await, Fenced::Nothing);
    }
}
