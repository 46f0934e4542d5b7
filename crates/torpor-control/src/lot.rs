//! Workers and the parking lot.
//!
//! A [`WorkerPool`] hands out [`WorkerPermit`]s, one per resident sandbox. When none is free, a
//! call that needs one parks in the lot: a bounded set of per-tenant FIFO queues. A released
//! permit goes straight to a parked call, taking tenants in round-robin order, so one tenant's
//! burst cannot starve another's trickle. Parked calls are woken by the release itself (a oneshot
//! channel), not by polling. A call whose client goes away leaves the lot at once (its future is
//! dropped, and the guard removes its place), and a permit sent to a call that just gave up is
//! passed on to the next one.
//!
//! One tenant may hold at most half of the lot's places ([`WorkerPool::tenant_share`]); beyond
//! it that tenant's calls are refused `lot_full` while the other half stays open to everyone
//! else, so one tenant's burst cannot give every other tenant `lot_full`.
//!
//! Admission: the lot measures how fast it serves parked calls (the interval between hand-offs
//! while calls wait, an exponential average). A call that would be served, at that rate and at
//! its place in the tenants' round-robin, only after its budget is refused at once
//! ([`LotError::WouldWait`], with the expected wait for `Retry-After`) instead of waiting the
//! budget out and failing anyway; every call that can be served in time is admitted.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use torpor_core::TenantId;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LotError {
    /// The lot holds as many parked calls as it may.
    Full,
    /// No worker became free within the budget.
    Timeout,
    /// At the measured service rate this call would wait about this long, past its budget.
    WouldWait(Duration),
}

/// How fast the lot serves parked calls, measured.
#[derive(Debug, Default)]
struct Service {
    /// Exponential average of the seconds between hand-offs to parked calls while calls wait.
    interval_s: f64,
    samples: u32,
    /// The last hand-off (or the moment the lot stopped being empty), while calls wait.
    since: Option<Instant>,
}

/// Hand-offs measured before admission trusts the rate.
const MIN_SAMPLES: u32 = 3;
/// Weight of the newest interval in the average.
const ALPHA: f64 = 0.2;

impl Service {
    fn record(&mut self, now: Instant, still_waiting: bool) {
        if let Some(since) = self.since {
            let dt = now.duration_since(since).as_secs_f64();
            self.interval_s = if self.samples == 0 {
                dt
            } else {
                ALPHA * dt + (1.0 - ALPHA) * self.interval_s
            };
            self.samples = self.samples.saturating_add(1);
        }
        self.since = still_waiting.then_some(now);
    }

    /// The expected wait of a call served after `position` hand-offs; `None` until measured.
    fn expected_wait(&self, position: usize) -> Option<Duration> {
        (self.samples >= MIN_SAMPLES)
            .then(|| Duration::from_secs_f64(self.interval_s * position as f64))
    }
}

pub struct WorkerPool {
    /// Changes in cluster mode as workers join and leave ([`WorkerPool::set_total`]).
    total: std::sync::atomic::AtomicUsize,
    capacity: usize,
    state: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    free: usize,
    /// Permits to swallow as they come back: the pool shrank below what is held.
    owed: usize,
    queues: HashMap<TenantId, VecDeque<(u64, oneshot::Sender<WorkerPermit>)>>,
    /// Tenants with parked calls, in the order they are served next.
    order: VecDeque<TenantId>,
    parked: usize,
    next_ticket: u64,
    service: Service,
}

/// A worker held by a resident sandbox; dropping it frees the worker for the next parked call.
pub struct WorkerPermit {
    pool: Option<Arc<WorkerPool>>,
}

impl Drop for WorkerPermit {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            WorkerPool::release(&pool);
        }
    }
}

/// How a call left the lot, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parked {
    /// A worker was free at once.
    NotParked,
    /// It waited this long.
    Waited(Duration),
}

impl WorkerPool {
    pub fn new(total: usize, capacity: usize) -> Arc<Self> {
        Arc::new(WorkerPool {
            total: std::sync::atomic::AtomicUsize::new(total),
            capacity,
            state: Mutex::new(PoolState {
                free: total,
                ..Default::default()
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn total(&self) -> usize {
        self.total.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Resizes the pool (cluster mode: the ready workers' slots). Growing hands the new
    /// permits to parked calls first; shrinking takes free permits, then swallows held ones
    /// as they come back, so no more than `total` are ever out afterwards.
    pub fn set_total(self: &Arc<Self>, total: usize) {
        let old = self.total.swap(total, std::sync::atomic::Ordering::SeqCst);
        if total > old {
            let mut grow = total - old;
            {
                let mut st = self.lock();
                let paid = grow.min(st.owed);
                st.owed -= paid;
                grow -= paid;
            }
            for _ in 0..grow {
                // A new permit, released at once: a parked call takes it, else it is free.
                drop(WorkerPermit {
                    pool: Some(self.clone()),
                });
            }
        } else if total < old {
            let mut st = self.lock();
            let shrink = old - total;
            let from_free = shrink.min(st.free);
            st.free -= from_free;
            st.owed += shrink - from_free;
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Places one tenant may hold: half the lot (at least one).
    pub fn tenant_share(&self) -> usize {
        self.capacity.div_ceil(2).max(1)
    }

    pub fn free(&self) -> usize {
        self.lock().free
    }

    pub fn busy(&self) -> usize {
        let st = self.lock();
        (self.total() + st.owed).saturating_sub(st.free)
    }

    pub fn parked(&self) -> usize {
        self.lock().parked
    }

    /// The measured interval between hand-offs to parked calls; `None` until measured.
    pub fn service_interval(&self) -> Option<Duration> {
        self.lock().service.expected_wait(1)
    }

    /// How long a new call of `tenant` would wait now, if it had to park (`None`: not measured
    /// yet). Its place: behind every parked call, or behind one round of the tenants' queues
    /// per call of its own already waiting, whichever comes first.
    pub fn expected_wait(&self, tenant: &TenantId) -> Option<Duration> {
        let st = self.lock();
        st.service.expected_wait(position(&st, tenant))
    }

    /// A worker now, without parking; None when all are taken or calls are already waiting.
    pub fn try_acquire(self: &Arc<Self>) -> Option<WorkerPermit> {
        let mut st = self.lock();
        if st.free > 0 && st.parked == 0 {
            st.free -= 1;
            return Some(WorkerPermit {
                pool: Some(self.clone()),
            });
        }
        None
    }

    /// A worker, parking up to `budget` when none is free.
    pub async fn acquire(
        self: &Arc<Self>,
        tenant: &TenantId,
        budget: Duration,
    ) -> Result<(WorkerPermit, Parked), LotError> {
        let (ticket, rx) = {
            let mut st = self.lock();
            if st.free > 0 && st.parked == 0 {
                st.free -= 1;
                return Ok((
                    WorkerPermit {
                        pool: Some(self.clone()),
                    },
                    Parked::NotParked,
                ));
            }
            if st.parked >= self.capacity {
                return Err(LotError::Full);
            }
            let held = st.queues.get(tenant).map_or(0, VecDeque::len);
            if held >= self.tenant_share() {
                return Err(LotError::Full);
            }
            if let Some(wait) = st.service.expected_wait(position(&st, tenant)) {
                if wait > budget {
                    return Err(LotError::WouldWait(wait));
                }
            }
            let (tx, rx) = oneshot::channel();
            st.next_ticket += 1;
            let ticket = st.next_ticket;
            let queue = st.queues.entry(tenant.clone()).or_default();
            if queue.is_empty() {
                st.order.push_back(tenant.clone());
            }
            st.queues
                .get_mut(tenant)
                .expect("just inserted")
                .push_back((ticket, tx));
            st.parked += 1;
            if st.parked == 1 {
                st.service.since = Some(Instant::now());
            }
            (ticket, rx)
        };
        let started = Instant::now();
        let mut place = Place {
            pool: self,
            tenant,
            ticket,
            rx: Some(rx),
        };
        let rx = place.rx.as_mut().expect("set above");
        match tokio::time::timeout(budget, rx).await {
            Ok(Ok(permit)) => {
                place.rx = None;
                Ok((permit, Parked::Waited(started.elapsed())))
            }
            _ => {
                // Leave the lot; a permit sent in the meantime is taken rather than lost.
                if let Some(permit) = place.leave() {
                    return Ok((permit, Parked::Waited(started.elapsed())));
                }
                Err(LotError::Timeout)
            }
        }
    }

    /// A permit came back: hand it to the next parked call, tenants in turn.
    fn release(self: &Arc<Self>) {
        let mut st = self.lock();
        if st.owed > 0 {
            st.owed -= 1;
            return;
        }
        while let Some(tenant) = st.order.pop_front() {
            let Some(queue) = st.queues.get_mut(&tenant) else {
                continue;
            };
            let Some((_, tx)) = queue.pop_front() else {
                st.queues.remove(&tenant);
                continue;
            };
            let more = !queue.is_empty();
            if more {
                st.order.push_back(tenant.clone());
            } else {
                st.queues.remove(&tenant);
            }
            st.parked -= 1;
            let permit = WorkerPermit {
                pool: Some(self.clone()),
            };
            match tx.send(permit) {
                Ok(()) => {
                    let waiting = st.parked > 0;
                    st.service.record(Instant::now(), waiting);
                    return;
                }
                // That call gave up; its permit came back here. Forget it (no release loop)
                // and try the next waiter.
                Err(mut returned) => {
                    returned.pool = None;
                }
            }
        }
        st.free += 1;
        st.service.since = None;
    }
}

/// Hand-offs before a new call of `tenant` is served: every parked call at most; with the
/// tenants served in turn, one round per call of its own already queued.
fn position(st: &PoolState, tenant: &TenantId) -> usize {
    let own = st.queues.get(tenant).map_or(0, VecDeque::len);
    let tenants = st.order.len() + usize::from(own == 0);
    (st.parked + 1).min((own + 1) * tenants.max(1))
}

/// A call's place in the lot; dropping it (the client went away) gives the place up.
struct Place<'a> {
    pool: &'a Arc<WorkerPool>,
    tenant: &'a TenantId,
    ticket: u64,
    rx: Option<oneshot::Receiver<WorkerPermit>>,
}

impl Place<'_> {
    /// Removes this call from the lot. Returns a permit that was sent to it meanwhile.
    fn leave(&mut self) -> Option<WorkerPermit> {
        let mut rx = self.rx.take()?;
        {
            let mut st = self.pool.lock();
            if let Some(queue) = st.queues.get_mut(self.tenant) {
                if let Some(pos) = queue.iter().position(|(t, _)| *t == self.ticket) {
                    queue.remove(pos);
                    if queue.is_empty() {
                        st.queues.remove(self.tenant);
                        st.order.retain(|t| t != self.tenant);
                    }
                    st.parked -= 1;
                    if st.parked == 0 {
                        st.service.since = None;
                    }
                    return None;
                }
            }
        }
        // Not queued any more: release() already sent us a permit.
        rx.try_recv().ok()
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        // A permit that reached a call that went away goes back to the pool (and so to the
        // next parked call).
        drop(self.leave());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> TenantId {
        TenantId::new(s).unwrap()
    }

    #[tokio::test]
    async fn free_workers_are_taken_at_once_and_come_back() {
        let pool = WorkerPool::new(2, 10);
        let a = pool.acquire(&t("a"), Duration::ZERO).await.unwrap();
        let b = pool.try_acquire().unwrap();
        assert_eq!(a.1, Parked::NotParked);
        assert!(pool.try_acquire().is_none());
        drop(a);
        drop(b);
        assert_eq!(pool.free(), 2);
    }

    #[tokio::test]
    async fn a_pool_grown_serves_parked_calls_and_a_pool_shrunk_never_has_more_out() {
        let pool = WorkerPool::new(0, 10);
        let waiting = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.acquire(&t("a"), Duration::from_secs(30)).await })
        };
        while pool.parked() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // A worker joins: the parked call gets its slot.
        pool.set_total(2);
        let (first, parked) = waiting.await.unwrap().unwrap();
        assert!(matches!(parked, Parked::Waited(_)));
        assert_eq!((pool.total(), pool.free(), pool.busy()), (2, 1, 1));
        let second = pool.try_acquire().unwrap();
        // Shrunk to one while two are held: the first one back is swallowed.
        pool.set_total(1);
        assert_eq!(pool.busy(), 2);
        drop(first);
        assert_eq!((pool.free(), pool.busy()), (0, 1));
        assert!(pool.try_acquire().is_none());
        drop(second);
        assert_eq!((pool.free(), pool.busy()), (1, 0));
        // Growing pays what is owed first.
        let held = pool.try_acquire().unwrap();
        pool.set_total(0);
        pool.set_total(3);
        assert_eq!((pool.free(), pool.busy()), (2, 1));
        drop(held);
        assert_eq!(pool.free(), 3);
    }

    #[tokio::test]
    async fn full_lot_and_spent_budget_are_refused() {
        let pool = WorkerPool::new(1, 1);
        let _held = pool.try_acquire().unwrap();
        let waiting = {
            let pool = pool.clone();
            tokio::spawn(async move {
                pool.acquire(&t("a"), Duration::from_millis(300))
                    .await
                    .map(|_| ())
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(pool.parked(), 1);
        assert_eq!(
            pool.acquire(&t("b"), Duration::from_secs(1)).await.err(),
            Some(LotError::Full)
        );
        assert_eq!(waiting.await.unwrap(), Err(LotError::Timeout));
        assert_eq!(pool.parked(), 0);
    }

    #[tokio::test]
    async fn one_tenant_cannot_take_every_place_in_the_lot() {
        let pool = WorkerPool::new(1, 4);
        let _held = pool.try_acquire().unwrap();
        let park = |tenant: &'static str| {
            let pool = pool.clone();
            tokio::spawn(async move {
                pool.acquire(&t(tenant), Duration::from_millis(400))
                    .await
                    .map(|_| ())
            })
        };
        let a1 = park("a");
        let a2 = park("a");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(pool.parked(), 2);
        // a holds its half: its next call is refused at once, b still gets a place.
        assert_eq!(
            pool.acquire(&t("a"), Duration::from_secs(1)).await.err(),
            Some(LotError::Full)
        );
        let b = park("b");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(pool.parked(), 3);
        for w in [a1, a2, b] {
            assert_eq!(w.await.unwrap(), Err(LotError::Timeout));
        }
    }

    #[tokio::test]
    async fn released_workers_go_round_robin_across_tenants() {
        let pool = WorkerPool::new(1, 100);
        let held = pool.try_acquire().unwrap();
        let served = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        // Tenant a floods with 6 calls, then b sends 2.
        for (i, name) in ["a", "a", "a", "a", "a", "a", "b", "b"].iter().enumerate() {
            let pool = pool.clone();
            let served = served.clone();
            let name = name.to_string();
            tasks.push(tokio::spawn(async move {
                let (permit, _) = pool
                    .acquire(&t(&name), Duration::from_secs(5))
                    .await
                    .unwrap();
                served.lock().unwrap().push(name);
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(permit);
            }));
            tokio::time::sleep(Duration::from_millis(2 + i as u64 % 2)).await;
        }
        drop(held);
        for task in tasks {
            task.await.unwrap();
        }
        let served = served.lock().unwrap().clone();
        let b_positions: Vec<_> = served
            .iter()
            .enumerate()
            .filter(|(_, n)| *n == "b")
            .map(|(i, _)| i)
            .collect();
        // b is served within the first four turns, not after a's whole burst.
        assert!(b_positions[0] <= 1 && b_positions[1] <= 3, "{served:?}");
        assert_eq!(pool.free(), 1);
    }

    #[tokio::test]
    async fn a_call_that_goes_away_frees_its_place_and_loses_no_worker() {
        let pool = WorkerPool::new(1, 10);
        let held = pool.try_acquire().unwrap();
        let gone = {
            let pool = pool.clone();
            tokio::spawn(async move {
                pool.acquire(&t("a"), Duration::from_secs(10))
                    .await
                    .map(|_| ())
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(pool.parked(), 1);
        gone.abort();
        let _ = gone.await;
        assert_eq!(pool.parked(), 0);
        drop(held);
        assert_eq!(pool.free(), 1, "the worker came back to the pool");
    }

    #[tokio::test]
    async fn a_call_that_cannot_be_served_in_its_budget_is_refused_at_once() {
        let pool = WorkerPool::new(1, 64);
        let a = t("a");
        let mut current = pool.acquire(&a, Duration::from_secs(1)).await.unwrap().0;
        // Serve parked calls one every 50 ms: the lot measures that rate.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..6 {
            let (p, a, tx) = (pool.clone(), a.clone(), tx.clone());
            tokio::spawn(async move {
                let permit = p.acquire(&a, Duration::from_secs(5)).await.unwrap().0;
                let _ = tx.send(permit);
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        for _ in 0..6 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(current);
            current = rx.recv().await.unwrap();
        }
        let interval = pool.service_interval().expect("measured");
        assert!(interval >= Duration::from_millis(40), "{interval:?}");
        // One worker held, calls queue: the tenth in line would wait about 10 intervals.
        let hold = current;
        let mut queued = Vec::new();
        for _ in 0..9 {
            let p = pool.clone();
            let a = a.clone();
            queued.push(tokio::spawn(async move {
                p.acquire(&a, Duration::from_secs(5)).await.map(|x| x.0)
            }));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        let start = Instant::now();
        match pool.acquire(&a, interval * 5).await {
            Err(LotError::WouldWait(w)) => {
                assert!(w > interval * 5, "{w:?}");
                assert!(start.elapsed() < interval, "refused at once");
            }
            other => panic!("expected WouldWait, got {:?}", other.map(|_| ())),
        }
        // A budget that covers the line is admitted (and served).
        let p = pool.clone();
        let b = a.clone();
        let admitted =
            tokio::spawn(async move { p.acquire(&b, Duration::from_secs(30)).await.map(|x| x.0) });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(pool.parked(), 10);
        drop(hold);
        for q in queued {
            drop(q.await.unwrap().unwrap());
        }
        assert!(admitted.await.unwrap().is_ok());
    }

    #[test]
    fn a_new_tenant_waits_one_round_not_the_whole_line() {
        let pool = WorkerPool::new(1, 64);
        let mut st = pool.lock();
        for i in 0..10 {
            let (tx, _rx) = oneshot::channel();
            st.queues.entry(t("a")).or_default().push_back((i, tx));
        }
        st.order.push_back(t("a"));
        st.parked = 10;
        assert_eq!(position(&st, &t("a")), 11);
        assert_eq!(position(&st, &t("b")), 2);
    }
}
