//! A tenant's GPU quota across controllers.
//!
//! Each worker's ledger enforces what a start may take there; the controller hands it the
//! tenant's quota less what the tenant holds on the other workers ([`crate::Fleet`]). What a
//! controller knows of the other workers is their last report: a heartbeat, or the reply to a
//! GPU start it made itself. Within one controller a tenant's GPU starts take turns, so each
//! sees the one before it. Two controllers would not: each could pass one start of the same
//! tenant on a different worker within a heartbeat, and the tenant would hold twice its quota.
//!
//! So, under quotas, with a shared book ([`GpuTurnBook`], the state store's):
//! - a tenant's GPU starts take turns across controllers: a lease named after the tenant
//!   ([`TURN_TTL`], renewed while the start runs, so a controller that dies mid-start holds it
//!   up at most that long);
//! - the start that holds the turn reads the holdings the book keeps (the newest report of each
//!   worker that a start reply brought to any controller) and counts, per worker, whichever of
//!   that and its own last report is newer ([`held_elsewhere`]);
//! - once started, it writes the report its worker answered with for the next turn; a
//!   checkpoint or destroy of a GPU sandbox writes the report its answer carried (the share
//!   went back), so no controller counts that share until its next heartbeat of the worker.
//!
//! A worker numbers its reports from its boot time in microseconds, so that its numbers grow
//! across its restarts and "newer" means the same to every controller.
//!
//! The lease is a row written with a compare-and-set, never a lock held across the call to the
//! worker. A book that cannot be reached refuses the start (a quota that cannot be checked is
//! not passed).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use torpor_gpu::quota::Amount;

/// How long a tenant's GPU turn lasts without renewal: a controller that dies mid-start holds
/// the tenant's other GPU starts up at most this long.
pub const TURN_TTL: Duration = Duration::from_secs(10);
/// How often the holder renews its turn while the start runs.
const RENEW_EVERY: Duration = Duration::from_secs(3);
/// How long a start waits for the turn before it is refused.
pub const TURN_WAIT: Duration = Duration::from_secs(30);
/// How often a waiting start tries for the turn.
const TRY_EVERY: Duration = Duration::from_millis(20);

/// The shared book: one lease per tenant and the holdings the starts reported.
pub trait GpuTurnBook: Send + Sync {
    /// Takes (or renews) `tenant`'s turn for `holder` until `ttl` from now; false while
    /// another holder's has not expired.
    fn take(&self, tenant: &str, holder: &str, ttl: Duration) -> Result<bool, String>;
    /// Gives `tenant`'s turn up if `holder` has it.
    fn give(&self, tenant: &str, holder: &str) -> Result<(), String>;
    /// What `tenant` holds per worker, as the newest reports kept: `(worker, seq, held)`.
    fn holdings(&self, tenant: &str) -> Result<Vec<(String, u64, Amount)>, String>;
    /// Keeps report `seq` of `worker`: `tenant` holds `held` there.
    fn record(&self, tenant: &str, worker: &str, seq: u64, held: Amount) -> Result<(), String>;
}

/// A tenant's turn, held until dropped (renewed meanwhile).
pub struct Turn {
    book: Arc<dyn GpuTurnBook>,
    tenant: String,
    holder: String,
    renew: tokio::task::JoinHandle<()>,
    /// What the book kept when the turn was taken.
    pub stored: Vec<(String, u64, Amount)>,
}

/// Runs a (blocking) call of the book off the runtime's threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| format!("the state store's call did not finish: {e}"))?
}

impl Turn {
    /// Waits (up to [`TURN_WAIT`]) for `tenant`'s turn; `Err` says why it was not had.
    pub async fn take(
        book: Arc<dyn GpuTurnBook>,
        tenant: &str,
        holder: &str,
    ) -> Result<Turn, String> {
        // Each turn holds the lease under a name of its own: the give of this controller's
        // previous turn, sent in the background, never removes the next one's lease.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let holder = format!("{holder}@{nanos}");
        let holder = holder.as_str();
        let started = Instant::now();
        loop {
            let (b, t, h) = (book.clone(), tenant.to_string(), holder.to_string());
            if blocking(move || b.take(&t, &h, TURN_TTL)).await? {
                break;
            }
            if started.elapsed() >= TURN_WAIT {
                return Err(format!(
                    "another controller's GPU start for tenant {tenant} has held its turn for {}s",
                    TURN_WAIT.as_secs()
                ));
            }
            tokio::time::sleep(TRY_EVERY).await;
        }
        let renew = {
            let (b, t, h) = (book.clone(), tenant.to_string(), holder.to_string());
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(RENEW_EVERY).await;
                    let (b2, t2, h2) = (b.clone(), t.clone(), h.clone());
                    match blocking(move || b2.take(&t2, &h2, TURN_TTL)).await {
                        Ok(true) => {}
                        Ok(false) => {
                            tracing::warn!(tenant = %t, "a GPU start's turn was taken by another controller (it expired)");
                            return;
                        }
                        Err(e) => {
                            tracing::warn!(tenant = %t, error = %e, "cannot renew a GPU start's turn")
                        }
                    }
                }
            })
        };
        // Given back if the holdings cannot be read.
        let mut turn = Turn {
            book: book.clone(),
            tenant: tenant.to_string(),
            holder: holder.to_string(),
            renew,
            stored: Vec::new(),
        };
        let (b, t) = (book, tenant.to_string());
        turn.stored = blocking(move || b.holdings(&t)).await?;
        Ok(turn)
    }

    /// Keeps the report `seq` of `worker` for the next turn, whoever takes it.
    pub async fn record(&self, worker: &str, seq: u64, held: Amount) {
        record(self.book.clone(), &self.tenant, worker, seq, held).await
    }
}

/// Keeps the report `seq` of `worker` (`tenant` holds `held` there) for the next turn: a
/// start's answer, or a checkpoint's or destroy's that gave a share back (written without the
/// turn: the book keeps the newest report whoever writes it, and a share given back only lets
/// later starts count less). On failure the next turn counts the worker's heartbeat report
/// instead, a heartbeat later.
pub async fn record(
    book: Arc<dyn GpuTurnBook>,
    tenant: &str,
    worker: &str,
    seq: u64,
    held: Amount,
) {
    let (t, w) = (tenant.to_string(), worker.to_string());
    if let Err(e) = blocking(move || book.record(&t, &w, seq, held)).await {
        tracing::warn!(%tenant, %worker, error = %e, "cannot keep a worker's GPU report");
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.renew.abort();
        let (b, t, h) = (self.book.clone(), self.tenant.clone(), self.holder.clone());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn_blocking(move || {
                if let Err(e) = b.give(&t, &h) {
                    tracing::warn!(tenant = %t, error = %e, "cannot give a GPU start's turn back (it expires)");
                }
            });
        }
    }
}

/// What `tenant` holds on the workers of `live` but `except` (`""`: on all of them): for each,
/// whichever is newer of its own last report (`(worker, seq, usage)`) and the one the book
/// kept. A worker not live here (lost, or not registered with this controller) counts nothing.
pub fn held_elsewhere<'a>(
    tenant: &str,
    except: &str,
    live: impl Iterator<Item = (&'a str, u64, &'a BTreeMap<String, Amount>)>,
    stored: &[(String, u64, Amount)],
) -> Amount {
    live.filter(|(name, _, _)| *name != except)
        .map(|(name, seq, usage)| {
            let own = usage.get(tenant).copied().unwrap_or_default();
            match stored.iter().find(|(w, _, _)| w == name) {
                Some((_, kept_seq, kept)) if *kept_seq > seq => *kept,
                _ => own,
            }
        })
        .fold(Amount::default(), Amount::plus)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    fn amount(memory_mib: u64, compute: u64) -> Amount {
        Amount {
            memory_mib,
            compute,
        }
    }

    #[test]
    fn the_newer_of_a_workers_own_report_and_the_kept_one_counts() {
        let usage = |compute| BTreeMap::from([("t1".to_string(), amount(compute * 10, compute))]);
        let (ga, gb, gc) = (usage(0), usage(700), usage(0));
        let live = || {
            [("ga", 5, &ga), ("gb", 9, &gb), ("gc", 3, &gc)]
                .into_iter()
                .map(|(n, s, u)| (n, s as u64, u))
        };
        // Another controller started on ga after ga's last report here; gb's kept report is
        // older than gb's own (the share it kept has been given back since); gone is not live.
        let stored = vec![
            ("ga".to_string(), 6, amount(7000, 700)),
            ("gb".to_string(), 8, amount(0, 0)),
            ("gone".to_string(), 99, amount(7000, 700)),
        ];
        assert_eq!(
            held_elsewhere("t1", "", live(), &stored),
            amount(14000, 1400)
        );
        // The worker the start goes to counts nothing (its own ledger knows).
        assert_eq!(
            held_elsewhere("t1", "ga", live(), &stored),
            amount(7000, 700)
        );
        // Nothing kept: each worker's own report.
        assert_eq!(held_elsewhere("t1", "", live(), &[]), amount(7000, 700));
        assert_eq!(held_elsewhere("t2", "", live(), &[]), Amount::default());
    }

    /// A book in memory, as two controllers would share one.
    #[derive(Default)]
    struct Book {
        leases: Mutex<BTreeMap<String, (String, Instant)>>,
        kept: Mutex<BTreeMap<(String, String), (u64, Amount)>>,
    }

    impl GpuTurnBook for Book {
        fn take(&self, tenant: &str, holder: &str, ttl: Duration) -> Result<bool, String> {
            let mut l = self.leases.lock().unwrap();
            match l.get(tenant) {
                Some((h, until)) if h != holder && *until > Instant::now() => Ok(false),
                _ => {
                    l.insert(tenant.into(), (holder.into(), Instant::now() + ttl));
                    Ok(true)
                }
            }
        }
        fn give(&self, tenant: &str, holder: &str) -> Result<(), String> {
            let mut l = self.leases.lock().unwrap();
            if l.get(tenant).is_some_and(|(h, _)| h == holder) {
                l.remove(tenant);
            }
            Ok(())
        }
        fn holdings(&self, tenant: &str) -> Result<Vec<(String, u64, Amount)>, String> {
            Ok(self
                .kept
                .lock()
                .unwrap()
                .iter()
                .filter(|((t, _), _)| t == tenant)
                .map(|((_, w), (s, a))| (w.clone(), *s, *a))
                .collect())
        }
        fn record(&self, tenant: &str, worker: &str, seq: u64, held: Amount) -> Result<(), String> {
            let mut k = self.kept.lock().unwrap();
            let e = k
                .entry((tenant.into(), worker.into()))
                .or_insert((0, Amount::default()));
            if seq > e.0 {
                *e = (seq, held);
            }
            Ok(())
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn turns_of_one_tenant_go_one_controller_at_a_time_and_pass_on_what_was_started() {
        let book: Arc<dyn GpuTurnBook> = Arc::new(Book::default());
        let first = Turn::take(book.clone(), "t1", "c1").await.unwrap();
        assert!(first.stored.is_empty());
        // c2 waits for t1's turn; t2's is free meanwhile.
        let waiting = tokio::spawn({
            let book = book.clone();
            async move { Turn::take(book, "t1", "c2").await }
        });
        let other = Turn::take(book.clone(), "t2", "c2").await.unwrap();
        drop(other);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!waiting.is_finished(), "c2 took t1's turn while c1 held it");
        first.record("ga", 7, amount(23034, 700)).await;
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("c2 never got the turn c1 gave back")
            .unwrap()
            .unwrap();
        // c2 reads what c1's start left, before ga's next heartbeat reaches it.
        assert_eq!(
            second.stored,
            vec![("ga".to_string(), 7, amount(23034, 700))]
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_late_give_of_a_turn_never_frees_the_next_turn_of_the_same_controller() {
        let book: Arc<dyn GpuTurnBook> = Arc::new(Book::default());
        for _ in 0..20 {
            drop(Turn::take(book.clone(), "t1", "c1").await.unwrap());
            let next = Turn::take(book.clone(), "t1", "c1").await.unwrap();
            // The first turn's give runs in the background meanwhile.
            tokio::time::sleep(Duration::from_millis(30)).await;
            let (b, t, h) = (book.clone(), "t1".to_string(), "c2@1".to_string());
            let other = blocking(move || b.take(&t, &h, TURN_TTL)).await.unwrap();
            assert!(!other, "c2 got the turn c1's next start holds");
            drop(next);
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }

    /// A book that cannot be reached.
    struct Down;

    impl GpuTurnBook for Down {
        fn take(&self, _: &str, _: &str, _: Duration) -> Result<bool, String> {
            Err("PostgreSQL does not answer".into())
        }
        fn give(&self, _: &str, _: &str) -> Result<(), String> {
            Err("PostgreSQL does not answer".into())
        }
        fn holdings(&self, _: &str) -> Result<Vec<(String, u64, Amount)>, String> {
            Err("PostgreSQL does not answer".into())
        }
        fn record(&self, _: &str, _: &str, _: u64, _: Amount) -> Result<(), String> {
            Err("PostgreSQL does not answer".into())
        }
    }

    #[tokio::test]
    async fn a_book_that_cannot_be_reached_gives_no_turn() {
        let err = Turn::take(Arc::new(Down), "t1", "c1").await.err().unwrap();
        assert!(err.contains("PostgreSQL does not answer"), "{err}");
    }
}
