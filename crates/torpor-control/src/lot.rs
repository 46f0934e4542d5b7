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
//!
//! Before the lot has measured a hand-off (a cold burst: every call arrives in the same
//! instant), the rate is seeded from the node's turnaround ([`WorkerPool::note_turnaround`]):
//! freeing a worker costs a checkpoint and serving the call a restore, as many at once as the
//! node has cores. Whenever the rate changes (a seed, a hand-off) the calls already parked are
//! checked again in the order they would be served: one that can no longer be served before its
//! deadline leaves the lot at once with [`LotError::WouldWait`], the others keep their places.

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
    /// Seconds between hand-offs predicted from the node's turnaround (checkpoint + restore
    /// over the cores), an exponential average; used until hand-offs are measured.
    seed_s: Option<f64>,
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
                // The seed, if any, is the prior: one early outlier (a cold pipeline filling)
                // does not decide the rate alone.
                self.seed_s
                    .map_or(dt, |seed| ALPHA * dt + (1.0 - ALPHA) * seed)
            } else {
                ALPHA * dt + (1.0 - ALPHA) * self.interval_s
            };
            self.samples = self.samples.saturating_add(1);
        }
        self.since = still_waiting.then_some(now);
    }

    fn seed(&mut self, interval_s: f64) {
        self.seed_s = Some(match self.seed_s {
            None => interval_s,
            Some(old) => ALPHA * interval_s + (1.0 - ALPHA) * old,
        });
    }

    /// Seconds between hand-offs: measured once trusted, else the seed; `None` when neither.
    fn interval(&self) -> Option<f64> {
        if self.samples >= MIN_SAMPLES {
            Some(self.interval_s)
        } else {
            self.seed_s
        }
    }

    /// The expected wait of a call served after `position` hand-offs; `None` until measured
    /// or seeded.
    fn expected_wait(&self, position: usize) -> Option<Duration> {
        self.interval()
            .map(|i| Duration::from_secs_f64(i * position as f64))
    }
}

/// What a parked call is sent: a worker, or its refusal when a re-check finds that at the
/// current rate it would be served only after its deadline (about this long from now).
enum Handoff {
    Worker(WorkerPermit),
    Refused(Duration),
}

/// A parked call: its ticket, when its budget runs out, where to send its outcome.
struct Waiter {
    ticket: u64,
    deadline: Instant,
    tx: oneshot::Sender<Handoff>,
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
    queues: HashMap<TenantId, VecDeque<Waiter>>,
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

    /// The interval between hand-offs to parked calls, measured or seeded; `None` before both.
    pub fn service_interval(&self) -> Option<Duration> {
        self.lock().service.expected_wait(1)
    }

    /// The node's turnaround for one parked call measured: `turnaround` (the time a worker
    /// takes to change hands: the slower of the checkpoint freeing it and the restore serving
    /// the call, which overlap) with `parallel` of them running at once.
    /// Seeds the service rate until hand-offs are measured, and re-checks the parked calls.
    pub fn note_turnaround(&self, turnaround: Duration, parallel: usize) {
        self.note_turnaround_at(turnaround, parallel, Instant::now());
    }

    fn note_turnaround_at(&self, turnaround: Duration, parallel: usize, now: Instant) {
        let mut st = self.lock();
        st.service
            .seed(turnaround.as_secs_f64() / parallel.max(1) as f64);
        recheck(&mut st, now);
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
                .push_back(Waiter {
                    ticket,
                    deadline: Instant::now() + budget,
                    tx,
                });
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
        let outcome = match tokio::time::timeout(budget, rx).await {
            Ok(Ok(handoff)) => {
                place.rx = None;
                Some(handoff)
            }
            // Leave the lot; a permit sent in the meantime is taken rather than lost.
            _ => place.leave(),
        };
        match outcome {
            Some(Handoff::Worker(permit)) => Ok((permit, Parked::Waited(started.elapsed()))),
            Some(Handoff::Refused(wait)) => Err(LotError::WouldWait(wait)),
            None => Err(LotError::Timeout),
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
            let Some(Waiter { tx, .. }) = queue.pop_front() else {
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
            match tx.send(Handoff::Worker(permit)) {
                Ok(()) => {
                    let now = Instant::now();
                    let waiting = st.parked > 0;
                    st.service.record(now, waiting);
                    recheck(&mut st, now);
                    return;
                }
                // That call gave up; its permit came back here. Forget it (no release loop)
                // and try the next waiter.
                Err(returned) => {
                    if let Handoff::Worker(mut permit) = returned {
                        permit.pool = None;
                    }
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

/// Checks the parked calls again at the current rate, in the order [`WorkerPool::release`]
/// serves them (tenants in turn, each tenant's calls in order): a call whose expected wait at
/// its place passes its deadline is refused at once and leaves, and the calls behind it move
/// up. The calls that stay keep their order; no permit is involved, so none can be lost.
fn recheck(st: &mut PoolState, now: Instant) {
    let Some(interval) = st.service.interval() else {
        return;
    };
    if st.parked == 0 {
        return;
    }
    let mut refused: Vec<(TenantId, u64, Duration)> = Vec::new();
    {
        let mut turns: VecDeque<&TenantId> = st.order.iter().collect();
        let mut next: HashMap<&TenantId, usize> = HashMap::new();
        let mut served = 0usize;
        while let Some(tenant) = turns.pop_front() {
            let Some(queue) = st.queues.get(tenant) else {
                continue;
            };
            let i = next.entry(tenant).or_default();
            // This turn goes to the tenant's first call that can still make it.
            while let Some(w) = queue.get(*i) {
                *i += 1;
                let wait = Duration::from_secs_f64(interval * (served + 1) as f64);
                if now + wait > w.deadline {
                    refused.push((tenant.clone(), w.ticket, wait));
                } else {
                    served += 1;
                    break;
                }
            }
            if *i < queue.len() {
                turns.push_back(tenant);
            }
        }
    }
    for (tenant, ticket, wait) in refused {
        let Some(queue) = st.queues.get_mut(&tenant) else {
            continue;
        };
        let Some(pos) = queue.iter().position(|w| w.ticket == ticket) else {
            continue;
        };
        let waiter = queue.remove(pos).expect("found above");
        if queue.is_empty() {
            st.queues.remove(&tenant);
            st.order.retain(|t| *t != tenant);
        }
        st.parked -= 1;
        // A call that went away meanwhile cannot be told; it is out of the lot either way.
        let _ = waiter.tx.send(Handoff::Refused(wait));
    }
    if st.parked == 0 {
        st.service.since = None;
    }
}

/// A call's place in the lot; dropping it (the client went away) gives the place up.
struct Place<'a> {
    pool: &'a Arc<WorkerPool>,
    tenant: &'a TenantId,
    ticket: u64,
    rx: Option<oneshot::Receiver<Handoff>>,
}

impl Place<'_> {
    /// Removes this call from the lot. Returns what was sent to it meanwhile (a permit, or its
    /// refusal by a re-check).
    fn leave(&mut self) -> Option<Handoff> {
        let mut rx = self.rx.take()?;
        {
            let mut st = self.pool.lock();
            if let Some(queue) = st.queues.get_mut(self.tenant) {
                if let Some(pos) = queue.iter().position(|w| w.ticket == self.ticket) {
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
        // Not queued any more: release() already sent us a permit, or a re-check our refusal.
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

    type Call = tokio::task::JoinHandle<Result<WorkerPermit, LotError>>;

    /// Starts a call of `tenant` and waits until it is parked (`None`) or answered at once.
    async fn arrive(pool: &Arc<WorkerPool>, tenant: &str, budget: Duration) -> Call {
        let before = pool.parked();
        let (p, tn) = (pool.clone(), t(tenant));
        let call = tokio::spawn(async move { p.acquire(&tn, budget).await.map(|x| x.0) });
        while pool.parked() == before && !call.is_finished() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        call
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[tokio::test]
    async fn a_cold_burst_is_refused_at_once_once_the_rate_is_seeded() {
        // Seeded before the burst: a turnaround of 20 s, two at once, is a hand-off every
        // 10 s. With a 25 s budget the first two calls in line can be served, the rest not.
        let pool = WorkerPool::new(1, 64);
        let held = pool.try_acquire().unwrap();
        pool.note_turnaround(secs(20), 2);
        assert_eq!(pool.service_interval(), Some(secs(10)));
        let mut burst = Vec::new();
        for _ in 0..6 {
            burst.push(arrive(&pool, "a", secs(25)).await);
        }
        assert_eq!(pool.parked(), 2);
        let admitted: Vec<Call> = burst.drain(..2).collect();
        for refused in burst {
            assert!(refused.is_finished(), "refused without waiting");
            assert_eq!(
                refused.await.unwrap().err(),
                Some(LotError::WouldWait(secs(30)))
            );
        }
        drop(held);
        for call in admitted {
            drop(call.await.unwrap().unwrap());
        }
        assert_eq!((pool.free(), pool.busy(), pool.parked()), (1, 0, 0));
    }

    #[tokio::test]
    async fn a_burst_parked_before_the_rate_is_known_is_checked_again_when_it_is() {
        let pool = WorkerPool::new(1, 64);
        let held = pool.try_acquire().unwrap();
        let t0 = Instant::now();
        let mut burst = Vec::new();
        for _ in 0..6 {
            burst.push(arrive(&pool, "a", secs(25)).await);
        }
        // No rate yet: all six park.
        assert_eq!(pool.parked(), 6);
        pool.note_turnaround_at(secs(20), 2, t0);
        // The four that cannot be served in time leave at once; two keep their places.
        assert_eq!(pool.parked(), 2);
        let admitted: Vec<Call> = burst.drain(..2).collect();
        for refused in burst {
            assert_eq!(
                refused.await.unwrap().err(),
                Some(LotError::WouldWait(secs(30)))
            );
        }
        assert!(admitted.iter().all(|c| !c.is_finished()));
        // A new call now would be third in line: refused at once as well.
        assert_eq!(
            pool.acquire(&t("a"), secs(25)).await.err(),
            Some(LotError::WouldWait(secs(30)))
        );
        drop(held);
        for call in admitted {
            drop(call.await.unwrap().unwrap());
        }
        assert_eq!((pool.free(), pool.busy(), pool.parked()), (1, 0, 0));
    }

    #[tokio::test]
    async fn a_recheck_refuses_exactly_the_calls_that_cannot_make_it_and_keeps_the_rest_in_order() {
        let pool = WorkerPool::new(1, 64);
        let held = pool.try_acquire().unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let t0 = Instant::now();
        let mut calls = HashMap::new();
        // Served in turn a1, b1, a2, b2, a3, b3; one hand-off every 10 s once seeded.
        for (name, budget) in [
            ("a1", 100),
            ("a2", 25),
            ("a3", 100),
            ("b1", 5),
            ("b2", 100),
            ("b3", 35),
        ] {
            let before = pool.parked();
            let (p, tn, tx) = (pool.clone(), t(&name[..1]), tx.clone());
            calls.insert(
                name,
                tokio::spawn(async move {
                    let permit = p.acquire(&tn, secs(budget)).await?.0;
                    let _ = tx.send((name, permit));
                    Ok::<(), LotError>(())
                }),
            );
            while pool.parked() == before {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        pool.note_turnaround_at(secs(20), 2, t0);
        // a1 at 10 s stays; b1 (5 s) cannot, b2 takes its turn at 20 s; a2 (25 s) cannot,
        // a3 takes its turn at 30 s; b3 (35 s) would be fourth, at 40 s: refused.
        assert_eq!(pool.parked(), 3);
        for (name, wait) in [("b1", 20), ("a2", 30), ("b3", 40)] {
            let call = calls.remove(name).unwrap();
            assert_eq!(
                call.await.unwrap(),
                Err(LotError::WouldWait(secs(wait))),
                "{name}"
            );
        }
        drop(held);
        let mut order = Vec::new();
        for _ in 0..3 {
            let (name, permit) = rx.recv().await.unwrap();
            order.push(name);
            drop(permit);
        }
        assert_eq!(order, ["a1", "b2", "a3"]);
        for (_, call) in calls {
            assert_eq!(call.await.unwrap(), Ok(()));
        }
        assert_eq!((pool.free(), pool.busy(), pool.parked()), (1, 0, 0));
    }

    #[tokio::test]
    async fn rechecks_racing_releases_resizes_and_departures_lose_no_worker() {
        let pool = WorkerPool::new(2, 64);
        let held = [pool.try_acquire().unwrap(), pool.try_acquire().unwrap()];
        let t0 = Instant::now();
        let mut calls = Vec::new();
        for i in 0..12u64 {
            let tenant = ["a", "b", "c"][i as usize % 3];
            let budget = if i % 4 == 3 { secs(15) } else { secs(200) };
            let before = pool.parked();
            let (p, tn) = (pool.clone(), t(tenant));
            calls.push(tokio::spawn(async move {
                let permit = p.acquire(&tn, budget).await?.0;
                tokio::task::yield_now().await;
                drop(permit);
                Ok::<(), LotError>(())
            }));
            while pool.parked() == before {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        // One hand-off every 10 s: the 15 s calls past the first place are refused.
        pool.note_turnaround_at(secs(20), 2, t0);
        let left = calls.remove(5);
        left.abort();
        let _ = left.await;
        pool.set_total(3);
        drop(held);
        pool.note_turnaround(secs(20), 2);
        pool.set_total(2);
        let (mut served, mut refused) = (0, 0);
        for call in calls {
            match call.await.unwrap() {
                Ok(()) => served += 1,
                Err(LotError::WouldWait(_)) => refused += 1,
                Err(e) => panic!("{e:?}"),
            }
        }
        assert_eq!(served + refused, 11);
        assert!(refused > 0);
        assert_eq!(pool.parked(), 0);
        assert_eq!(pool.free() + pool.busy(), pool.total());
        assert_eq!((pool.total(), pool.free()), (2, 2));
    }

    #[test]
    fn a_new_tenant_waits_one_round_not_the_whole_line() {
        let pool = WorkerPool::new(1, 64);
        let mut st = pool.lock();
        for i in 0..10 {
            let (tx, _rx) = oneshot::channel();
            st.queues.entry(t("a")).or_default().push_back(Waiter {
                ticket: i,
                deadline: Instant::now(),
                tx,
            });
        }
        st.order.push_back(t("a"));
        st.parked = 10;
        assert_eq!(position(&st, &t("a")), 11);
        assert_eq!(position(&st, &t("b")), 2);
    }
}
