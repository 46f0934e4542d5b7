//! The idle policy: on every tick, idle sandboxes move down the ladder (freeze, park, suspend)
//! as their template says, activity clocks are persisted and the fleet gauges refreshed.

use super::*;

/// How often the idle policy refreshes the fleet gauges between scrapes.
const GAUGES_EVERY_MS: i64 = 10_000;

impl Engine {
    pub(super) async fn run_policy(self: Arc<Self>) {
        let mut interval = tokio::time::interval(self.cfg.tick);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            if self.shutting_down.load(Ordering::SeqCst) {
                return;
            }
            if let Err(e) = self.policy_tick().await {
                if matches!(e, ControlError::Store(_)) {
                    self.metrics.store_error("state");
                }
                tracing::warn!(error = %e, "idle policy tick failed");
            }
        }
    }

    /// Moves idle sandboxes down the ladder and persists activity clocks.
    pub async fn policy_tick(self: &Arc<Self>) -> Result<()> {
        let templates: HashMap<TemplateName, TemplateRecord> = self
            .store
            .templates()?
            .into_iter()
            .map(|t| (t.name.clone(), t))
            .collect();
        let now = now_millis();
        // Parked sandboxes are read only once the soonest suspend of any template is due.
        let soonest_suspend_s = templates
            .values()
            .filter_map(|t| t.spec.idle.suspend_after_s)
            .fold(f64::INFINITY, f64::min);
        let parked_before = if soonest_suspend_s.is_finite() {
            now - (soonest_suspend_s * 1000.0) as i64
        } else {
            i64::MIN
        };
        let records = self.store.sandboxes_to_tend(parked_before)?;
        // Cluster mode: sandboxes whose controller is gone are taken over first.
        self.sweep_lost_controllers(&records).await;
        // Containers run here for sandboxes another controller took over meanwhile: let go.
        self.let_go_of_stale_holds(&records).await;
        // And those another controller passed here as they run, not yet used by a call.
        self.adopt_passed(&records).await;
        // Then this controller's surplus goes to those under their share.
        self.balance_holds(&records).await;
        let me = self.controller_name();
        for mut rec in records {
            if rec.controller.as_deref().is_some_and(|c| Some(c) != me) {
                continue; // another controller's to move down the ladder
            }
            let slot = self
                .slots
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&rec.id)
                .cloned();
            if let Some(slot) = &slot {
                let active = slot.last_active.load(Ordering::Relaxed);
                rec.last_active_at = rec.last_active_at.max(active);
            }
            let Some(tpl) = templates.get(&rec.template) else {
                continue;
            };
            let idle_s = (now - rec.last_active_at) as f64 / 1000.0;
            let next = next_tier(rec.state, idle_s, &tpl.spec.idle);
            let (Some(next), Some(slot)) = (next, slot.or_else(|| Some(self.slot(&rec.id)))) else {
                continue;
            };
            let Ok(mut guard) = slot.state.clone().try_write_owned() else {
                continue; // in use right now: not idle after all
            };
            let engine = self.clone();
            let id = rec.id.clone();
            match next {
                Tier::Frozen => {
                    if let Err(e) = self.freeze_locked(&mut guard, &id, "idle").await {
                        tracing::warn!(sandbox = %id, error = %e, "idle freeze failed");
                    }
                }
                Tier::Parked => {
                    tokio::spawn(async move {
                        if let Err(e) = engine.park_locked(&mut guard, &id, "idle").await {
                            tracing::warn!(sandbox = %id, error = %e, "idle park failed");
                        }
                    });
                }
                Tier::Suspended => {
                    tokio::spawn(async move {
                        if let Err(e) = engine.upload_locked(&id, "idle").await {
                            tracing::warn!(sandbox = %id, error = %e, "idle suspend failed");
                        }
                        drop(guard);
                    });
                }
                Tier::Running => {}
            }
        }
        // Activity clocks that moved since the last tick, each written once (also of sandboxes
        // not read above: parked since).
        let touched: Vec<(SandboxId, i64)> = self
            .slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter_map(|(id, slot)| {
                let active = slot.last_active.load(Ordering::Relaxed);
                (active > slot.persisted.swap(active, Ordering::Relaxed))
                    .then(|| (id.clone(), active))
            })
            .collect();
        self.store.touch_sandboxes(&touched)?;
        // Counting every sandbox costs a scan of the table (190 ms at 10^6 rows, docs/
        // BENCHMARKS.md): between scrapes, which refresh the gauges themselves, every 10 s.
        if now - self.gauges_at.load(Ordering::Relaxed) >= GAUGES_EVERY_MS {
            self.gauges_at.store(now, Ordering::Relaxed);
            self.policy_tick_gauges()?;
        }
        self.make_room(0).await;
        // Calls wait in the lot: a sandbox may have gone idle without a call ending (a freeze).
        self.evictor.poke();
        Ok(())
    }

    pub(super) fn set_sandbox_gauges(&self, counts: HashMap<(SandboxState, Tier), i64>) {
        // Every (state, tier) pair is written, zero when empty, so a series never vanishes
        // between events (dashboards and alerts find it; 9 x 4 series, bounded).
        for state in SandboxState::ALL {
            for tier in [Tier::Running, Tier::Frozen, Tier::Parked, Tier::Suspended] {
                if !counts.contains_key(&(state, tier)) {
                    self.metrics
                        .sandboxes
                        .with_label_values(&[state.as_str(), tier.as_str()])
                        .set(0);
                }
            }
        }
        for ((state, tier), n) in counts {
            self.metrics
                .sandboxes
                .with_label_values(&[state.as_str(), tier.as_str()])
                .set(n);
        }
        self.metrics.workers_busy.set(self.workers.busy() as i64);
    }

    /// Refreshes the fleet gauges (for a scrape between ticks).
    pub fn policy_tick_gauges(&self) -> Result<()> {
        let counts: HashMap<(SandboxState, Tier), i64> = self
            .store
            .sandbox_counts()?
            .into_iter()
            .map(|(s, t, n)| ((s, t), n as i64))
            .collect();
        self.set_sandbox_gauges(counts);
        self.metrics
            .warm_ready
            .set(self.node.warm_stats().ready as i64);
        Ok(())
    }
}

/// Where an idle sandbox goes on this tick: from its state, how long it has been idle and its
/// template's idle policy. A pure function of its inputs, property-tested: it only ever moves a
/// sandbox down the ladder, to the deepest rung that is due among those one transition away
/// (a running sandbox due for parking is parked, not frozen first; suspension follows a park).
pub(crate) fn next_tier(
    state: SandboxState,
    idle_s: f64,
    idle: &torpor_core::IdlePolicy,
) -> Option<Tier> {
    let due = |after: Option<f64>| after.is_some_and(|a| idle_s >= a);
    match state {
        SandboxState::Running | SandboxState::Frozen if due(idle.park_after_s) => {
            Some(Tier::Parked)
        }
        SandboxState::Running if due(idle.freeze_after_s) => Some(Tier::Frozen),
        SandboxState::Parked if due(idle.suspend_after_s) => Some(Tier::Suspended),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use torpor_core::IdlePolicy;

    fn after() -> impl Strategy<Value = Option<f64>> {
        proptest::option::of(0.0f64..1000.0)
    }

    fn state() -> impl Strategy<Value = SandboxState> {
        proptest::sample::select(SandboxState::ALL.to_vec())
    }

    fn tier_of(s: SandboxState) -> Option<Tier> {
        match s {
            SandboxState::Running => Some(Tier::Running),
            SandboxState::Frozen => Some(Tier::Frozen),
            SandboxState::Parked => Some(Tier::Parked),
            SandboxState::Suspended => Some(Tier::Suspended),
            _ => None,
        }
    }

    proptest! {
        #[test]
        fn the_policy_only_moves_stable_sandboxes_down_and_only_when_due(
            st in state(), idle_s in 0.0f64..2000.0,
            f in after(), p in after(), s in after(),
        ) {
            let idle = IdlePolicy { freeze_after_s: f, park_after_s: p, suspend_after_s: s };
            if let Some(next) = next_tier(st, idle_s, &idle) {
                let from = tier_of(st).expect("only stable states move");
                prop_assert!(next > from, "{st} -> {next:?} is not down the ladder");
                let threshold = match next {
                    Tier::Frozen => f,
                    Tier::Parked => p,
                    Tier::Suspended => s,
                    Tier::Running => None,
                };
                prop_assert!(threshold.is_some_and(|t| idle_s >= t), "moved before it was due");
                let first_step = match next {
                    Tier::Frozen => SandboxState::Frozen,
                    Tier::Suspended if st == SandboxState::Parked => SandboxState::Uploading,
                    _ => SandboxState::Checkpointing,
                };
                prop_assert!(st.can_transition_to(first_step));
            }
        }

        #[test]
        fn idling_longer_never_moves_a_sandbox_less_far(
            st in state(), a in 0.0f64..2000.0, extra in 0.0f64..2000.0,
            f in after(), p in after(), s in after(),
        ) {
            let idle = IdlePolicy { freeze_after_s: f, park_after_s: p, suspend_after_s: s };
            if let Some(early) = next_tier(st, a, &idle) {
                let late = next_tier(st, a + extra, &idle);
                prop_assert!(late.is_some_and(|l| l >= early));
            }
        }
    }

    #[test]
    fn a_sandbox_with_no_policy_never_moves() {
        let none = IdlePolicy {
            freeze_after_s: None,
            park_after_s: None,
            suspend_after_s: None,
        };
        for st in SandboxState::ALL {
            assert_eq!(next_tier(st, 1e9, &none), None);
        }
    }
}
