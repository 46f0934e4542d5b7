//! Workers and memory: who may be resident. A call that needs a worker takes a free one or
//! waits in the parking lot while the evictor parks the least recently active idle sandbox
//! (frozen ones first); the memory budget is kept the same way before each wake.

use super::*;

impl Engine {
    /// Refuses a call at once when the lot expects to serve it only after its budget, before
    /// the caller does any work for it (quota lock, store writes): refusals stay cheap however
    /// many arrive.
    pub(super) fn refuse_early(&self, tenant: &TenantId) -> Result<()> {
        match self.workers.refuse_early(tenant, self.cfg.worker_wait) {
            None => Ok(()),
            Some(wait) => Err(self.refused_on_arrival(wait)),
        }
    }

    /// [`Engine::refuse_early`] for a call that sets out for a worker now: admitted, it counts
    /// in the lot's queue ahead of later calls from here until it reaches the lot (given to
    /// [`Engine::acquire_worker`]) or gives up, so a burst's later calls are refused at once
    /// against the whole burst, while its earlier ones still do their store work.
    pub(super) fn arrive(&self, tenant: &TenantId) -> Result<Arrival> {
        self.workers
            .arrive(tenant, self.cfg.worker_wait)
            .map_err(|wait| self.refused_on_arrival(wait))
    }

    fn refused_on_arrival(&self, wait: Duration) -> ControlError {
        self.metrics
            .lot_rejections
            .with_label_values(&["would_wait"])
            .inc();
        ControlError::NoWorker {
            budget_ms: self.cfg.worker_wait.as_millis() as u64,
            expected_ms: Some(ceil_ms(wait)),
        }
    }

    /// A worker for `tenant`'s sandbox. When none is free, the least recently active idle
    /// sandbox is parked to free one, and the call waits in the lot (fair across tenants) up to
    /// the configured budget.
    pub(super) async fn acquire_worker(
        &self,
        tenant: &TenantId,
        memory: u64,
        arrival: Option<Arrival>,
    ) -> Result<WorkerPermit> {
        self.make_room(memory).await;
        if let Some(p) = self.workers.try_acquire(tenant) {
            return Ok(p);
        }
        self.metrics.lot_parked.inc();
        self.evictor.wanting.fetch_add(1, Ordering::SeqCst);
        self.evictor.poke();
        let result = self
            .workers
            .acquire_arrived(tenant, self.cfg.worker_wait, arrival)
            .await;
        self.evictor.wanting.fetch_sub(1, Ordering::SeqCst);
        self.metrics.lot_parked.dec();
        match result {
            Ok((permit, parked)) => {
                if let Parked::Waited(d) = parked {
                    self.metrics
                        .lot_wait_seconds
                        .with_label_values(&["worker"])
                        .observe(d.as_secs_f64());
                }
                Ok(permit)
            }
            Err(LotError::Full) => {
                self.metrics
                    .lot_rejections
                    .with_label_values(&["lot_full"])
                    .inc();
                Err(ControlError::LotFull(self.workers.capacity()))
            }
            Err(LotError::Timeout) => {
                self.metrics
                    .lot_rejections
                    .with_label_values(&["no_worker_available"])
                    .inc();
                self.metrics
                    .lot_wait_seconds
                    .with_label_values(&["timeout"])
                    .observe(self.cfg.worker_wait.as_secs_f64());
                Err(ControlError::NoWorker {
                    budget_ms: self.cfg.worker_wait.as_millis() as u64,
                    expected_ms: None,
                })
            }
            Err(LotError::WouldWait(expected)) => {
                self.metrics
                    .lot_rejections
                    .with_label_values(&["would_wait"])
                    .inc();
                Err(ControlError::NoWorker {
                    budget_ms: self.cfg.worker_wait.as_millis() as u64,
                    expected_ms: Some(ceil_ms(expected)),
                })
            }
        }
    }

    /// Restores a container (the caller holds a restore turn) and feeds the lot what a wake
    /// costs on this node: this restore and the checkpoints finished so far, with how many
    /// checkpoints and restores shared each core meanwhile. Both are CPU-bound and share the
    /// cores with the other checkpoints and restores under way (at most one of each per core),
    /// so a duration measured while k of them ran on n cores is k/n times its cost alone (the
    /// lot scales the checkpoints that finished since its last feed by the same sharing). The
    /// lot seeds its service rate with it, so a burst is admitted against a real rate from its
    /// first call.
    pub(super) async fn timed_restore(
        &self,
        launch: Launch,
        image: &Path,
    ) -> Result<Box<dyn Resident>> {
        let cores = self.parallel();
        let before = self.heavy_in_flight();
        let t = Instant::now();
        let container = self.node.restore(launch, image).await?;
        let restore = t.elapsed();
        let sharing = ((before + self.heavy_in_flight()) as f64 / 2.0 / cores as f64).max(1.0);
        let checkpoints = self.metrics.checkpoint_seconds.with_label_values(&["ok"]);
        self.workers.note_turnaround(crate::lot::Turnaround {
            checkpoints: (checkpoints.get_sample_count(), checkpoints.get_sample_sum()),
            restore,
            sharing,
            parallel: cores,
        });
        Ok(container)
    }

    /// Checkpoints and restores running now (each holds a turn of its semaphore).
    fn heavy_in_flight(&self) -> usize {
        self.checkpoints.busy() + self.restores.busy()
    }

    /// Bytes charged to the memory cgroups of every resident sandbox.
    pub fn resident_memory(&self) -> u64 {
        let slots: Vec<Arc<Slot>> = {
            let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            slots.values().cloned().collect()
        };
        slots
            .iter()
            .filter_map(|slot| {
                let guard = slot.state.try_read().ok()?;
                guard.live.as_ref()?.resident.memory()
            })
            .sum()
    }

    /// Parks least recently active sandboxes (Frozen first, then idle Running) until resident
    /// memory plus `incoming` bytes fits the node's memory budget. A burst never overcommits
    /// the node: a wake makes room before it restores.
    pub(super) async fn make_room(&self, incoming: u64) {
        let Some(budget) = self.cfg.memory_budget else {
            return;
        };
        for _ in 0..self.workers.total() {
            if self.resident_memory() + incoming <= budget {
                return;
            }
            if !self.evict_one("memory_pressure").await {
                return;
            }
        }
    }

    /// Workers: how many, how many hold a sandbox, how many calls wait.
    pub fn worker_stats(&self) -> WorkerStats {
        let warm = self.node.warm_stats();
        WorkerStats {
            memory_budget_bytes: self.cfg.memory_budget,
            resident_memory_bytes: self.resident_memory(),
            total: self.workers.total(),
            busy: self.workers.busy(),
            free: self.workers.free(),
            parked_calls: self.workers.parked(),
            lot_capacity: self.workers.capacity(),
            reserved_workers: self.workers.reserved(),
            park_budget_ms: self.cfg.worker_wait.as_millis() as u64,
            warm_pool_size: warm.target,
            warm_ready: warm.ready,
            warm_takes: warm.warm_takes,
            cold_takes: warm.cold_takes,
        }
    }

    /// Parks the least recently active resident sandbox that no call is using. Frozen ones go
    /// first, then idle running ones.
    pub(super) async fn evict_one(&self, reason: &str) -> bool {
        self.evict_one_on(None, reason).await
    }

    /// [`Engine::evict_one`] among the sandboxes on worker `node` only (cluster mode), or
    /// among all with `None`.
    pub(super) async fn evict_one_on(&self, node: Option<&str>, reason: &str) -> bool {
        let Some((id, mut guard)) = self.pick_victim_on(node) else {
            return false;
        };
        self.evict(&id, &mut guard, reason).await
    }

    pub(super) async fn evict(
        &self,
        id: &SandboxId,
        guard: &mut OwnedRwLockWriteGuard<SlotState>,
        reason: &str,
    ) -> bool {
        tracing::info!(sandbox = %id, reason, "parking to make room");
        match self.park_locked(guard, id, "evicted").await {
            Ok(()) => {
                self.metrics.evictions.with_label_values(&[reason]).inc();
                true
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "eviction failed");
                false
            }
        }
    }

    /// The least recently active resident sandbox that no call is using, locked: Frozen ones
    /// first, then idle running ones.
    pub(super) fn pick_victim(&self) -> Option<(SandboxId, OwnedRwLockWriteGuard<SlotState>)> {
        self.pick_victim_on(None)
    }

    /// [`Engine::pick_victim`] among the sandboxes on worker `node` only, or among all.
    fn pick_victim_on(
        &self,
        node: Option<&str>,
    ) -> Option<(SandboxId, OwnedRwLockWriteGuard<SlotState>)> {
        let candidates: Vec<(SandboxId, Arc<Slot>)> = {
            let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            slots.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        // Only sandboxes no call holds can be taken: their write lock is free.
        let mut idle: Vec<(SandboxId, OwnedRwLockWriteGuard<SlotState>, IdleResident)> = Vec::new();
        for (id, slot) in candidates {
            let Ok(guard) = slot.state.clone().try_write_owned() else {
                continue;
            };
            let Some(live) = &guard.live else { continue };
            if node.is_some_and(|n| live.resident.node() != Some(n)) {
                continue;
            }
            let seen = IdleResident {
                frozen: live.frozen,
                last_active: slot.last_active.load(Ordering::Relaxed),
            };
            idle.push((id, guard, seen));
        }
        let chosen = choose_victim(idle.iter().map(|(_, _, r)| *r))?;
        let (id, guard, _) = idle.swap_remove(chosen);
        Some((id, guard))
    }

    /// The eviction task (see [`Evictor`]).
    pub(super) async fn run_evictor(self: Arc<Self>) {
        loop {
            self.evictor.wake.notified().await;
            if self.shutting_down.load(Ordering::SeqCst) {
                return;
            }
            while self.evictor.needed() {
                let Some((id, mut guard)) = self.pick_victim() else {
                    break; // every resident sandbox is in a call: the next call's end pokes us
                };
                self.evictor.in_flight.fetch_add(1, Ordering::SeqCst);
                let engine = self.clone();
                tokio::spawn(async move {
                    engine.evict(&id, &mut guard, "parked_calls").await;
                    drop(guard);
                    engine.evictor.in_flight.fetch_sub(1, Ordering::SeqCst);
                    engine.evictor.wake.notify_one();
                });
            }
        }
    }
}

/// What eviction knows of an idle resident sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IdleResident {
    pub frozen: bool,
    /// Last activity (ms since the epoch).
    pub last_active: i64,
}

/// Which idle resident sandbox an eviction parks: a frozen one before a running one (it holds
/// memory but does no work), and within each the least recently active. A pure function,
/// property-tested; ties go to the first.
pub(crate) fn choose_victim(idle: impl IntoIterator<Item = IdleResident>) -> Option<usize> {
    idle.into_iter()
        .enumerate()
        .min_by_key(|(i, r)| (!r.frozen, r.last_active, *i))
        .map(|(i, _)| i)
}

/// `d` in whole milliseconds, rounded up: a refusal's expected wait, always over the budget it
/// was refused for (rounded down, 4000.4 ms read as "about 4000 ms" against a 4000 ms budget).
fn ceil_ms(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_refusals_expected_wait_is_rounded_up_so_it_always_exceeds_the_budget() {
        assert_eq!(ceil_ms(Duration::from_micros(4_000_400)), 4001);
        assert_eq!(ceil_ms(Duration::from_nanos(4_000_000_001)), 4001);
        assert_eq!(ceil_ms(Duration::from_millis(4000)), 4000);
        assert_eq!(ceil_ms(Duration::ZERO), 0);
        assert_eq!(ceil_ms(Duration::MAX), u64::MAX);
    }

    fn resident() -> impl Strategy<Value = IdleResident> {
        (any::<bool>(), 0i64..1000).prop_map(|(frozen, last_active)| IdleResident {
            frozen,
            last_active,
        })
    }

    proptest! {
        #[test]
        fn eviction_takes_frozen_first_then_the_least_recently_active(
            idle in proptest::collection::vec(resident(), 0..20)
        ) {
            match choose_victim(idle.iter().copied()) {
                None => prop_assert!(idle.is_empty()),
                Some(i) => {
                    let v = idle[i];
                    if idle.iter().any(|r| r.frozen) {
                        prop_assert!(v.frozen, "a running sandbox went before a frozen one");
                    }
                    for r in idle.iter().filter(|r| r.frozen == v.frozen) {
                        prop_assert!(v.last_active <= r.last_active);
                    }
                }
            }
        }
    }
}
