//! The scaling rule, as KEDA and the HPA apply it, as one pure function: readings in, a desired
//! size out. No clock and no I/O: the caller passes the time and keeps the [`RuleState`].
//!
//! - desired = ceil(depth / target), clamped to [min, max]; several triggers combine by maximum;
//! - the pool is *active* only while depth is strictly above `activation`; an active pool has
//!   at least one agent;
//! - after the last active reading, the pool keeps at least one agent for `cooldown_ms`, then
//!   goes to `min` (zero when `min` is 0);
//! - a trigger that fails keeps the pool at its size (never scales in on missing data); after
//!   `fallback.failure_threshold` consecutive failures of any trigger the pool goes to
//!   `fallback.replicas`.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fallback {
    /// Consecutive failed readings of one trigger before the fallback applies.
    pub failure_threshold: u32,
    /// The size the pool takes while its triggers fail.
    pub replicas: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScalePolicy {
    pub min: u32,
    pub max: u32,
    /// Work per agent (messages); at least 1.
    pub target: u64,
    pub activation: u64,
    pub cooldown_ms: u64,
    pub fallback: Option<Fallback>,
}

/// What the rule remembers between readings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuleState {
    pub last_active_ms: Option<u64>,
    /// Consecutive failures, one counter per trigger.
    pub consecutive_errors: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Decision {
    pub desired: u32,
    /// Depth strictly above the activation threshold.
    pub active: bool,
    /// The maximum depth over the triggers that answered; `None` when none did.
    pub depth: Option<u64>,
    /// The fallback size applies.
    pub fallback: bool,
}

fn clamp(v: u64, lo: u32, hi: u32) -> u32 {
    v.max(u64::from(lo)).min(u64::from(hi)) as u32
}

/// `readings[i]` is trigger i's depth, `None` when it failed. `current` is the pool's size now.
pub fn decide(
    policy: &ScalePolicy,
    readings: &[Option<u64>],
    current: u32,
    now_ms: u64,
    state: &mut RuleState,
) -> Decision {
    let target = policy.target.max(1);
    let min = policy.min.min(policy.max);
    state.consecutive_errors.resize(readings.len(), 0);
    for (count, reading) in state.consecutive_errors.iter_mut().zip(readings) {
        *count = if reading.is_some() {
            0
        } else {
            count.saturating_add(1)
        };
    }
    let depth = readings.iter().flatten().copied().max();
    let any_error = readings.iter().any(Option::is_none);
    if let Some(fb) = policy.fallback {
        let tripped = state
            .consecutive_errors
            .iter()
            .any(|&n| n >= fb.failure_threshold.max(1));
        if tripped {
            return Decision {
                desired: clamp(fb.replicas.into(), min, policy.max),
                active: fb.replicas > 0,
                depth,
                fallback: true,
            };
        }
    }
    let Some(d) = depth else {
        // Nothing answered: keep the size (the pool reports the errors).
        return Decision {
            desired: clamp(current.into(), min, policy.max),
            active: current > 0,
            depth: None,
            fallback: false,
        };
    };
    let active = d > policy.activation;
    let wanted = d.div_ceil(target);
    let in_cooldown = state
        .last_active_ms
        .is_some_and(|t| now_ms.saturating_sub(t) < policy.cooldown_ms);
    let mut desired = if active {
        state.last_active_ms = Some(now_ms);
        clamp(wanted, min.max(1), policy.max)
    } else if in_cooldown && current > 0 {
        clamp(wanted, min.max(1), policy.max)
    } else if min == 0 {
        0
    } else {
        clamp(wanted, min, policy.max)
    };
    if any_error {
        desired = desired.max(current.min(policy.max));
    }
    Decision {
        desired,
        active,
        depth: Some(d),
        fallback: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn policy() -> impl Strategy<Value = ScalePolicy> {
        (
            0u32..5,
            1u32..60,
            1u64..20,
            0u64..10,
            0u64..10_000,
            proptest::option::of((1u32..5, 0u32..10)),
        )
            .prop_map(
                |(min, max, target, activation, cooldown_ms, fb)| ScalePolicy {
                    min: min.min(max),
                    max,
                    target,
                    activation,
                    cooldown_ms,
                    fallback: fb.map(|(failure_threshold, replicas)| Fallback {
                        failure_threshold,
                        replicas,
                    }),
                },
            )
    }

    fn readings() -> impl Strategy<Value = Vec<Option<u64>>> {
        proptest::collection::vec(proptest::option::weighted(0.8, 0u64..1000), 1..4)
    }

    proptest! {
        #[test]
        fn desired_stays_within_min_and_max(p in policy(), r in readings(), current in 0u32..60, now in 0u64..100_000, last in proptest::option::of(0u64..100_000)) {
            let mut st = RuleState { last_active_ms: last, consecutive_errors: vec![] };
            let d = decide(&p, &r, current, now, &mut st);
            prop_assert!(d.desired >= p.min && d.desired <= p.max, "{d:?}");
        }

        #[test]
        fn active_depth_gives_ceil_over_target(p in policy(), depth in 0u64..10_000, current in 0u32..60) {
            let mut st = RuleState::default();
            let d = decide(&p, &[Some(depth)], current, 1_000, &mut st);
            prop_assert_eq!(d.active, depth > p.activation);
            if d.active {
                let want = depth.div_ceil(p.target).max(u64::from(p.min)).max(1).min(u64::from(p.max));
                prop_assert_eq!(u64::from(d.desired), want);
                prop_assert!(d.desired >= 1);
                prop_assert_eq!(st.last_active_ms, Some(1_000));
            }
        }

        #[test]
        fn triggers_combine_by_maximum(p in policy(), depths in proptest::collection::vec(0u64..1000, 1..5), current in 0u32..60) {
            let all: Vec<_> = depths.iter().map(|&d| Some(d)).collect();
            let max = *depths.iter().max().unwrap();
            let a = decide(&p, &all, current, 5, &mut RuleState::default());
            let b = decide(&p, &[Some(max)], current, 5, &mut RuleState::default());
            prop_assert_eq!(a, b);
        }

        #[test]
        fn more_depth_never_means_fewer_agents(p in policy(), a in 0u64..1000, b in 0u64..1000, current in 0u32..60) {
            let (lo, hi) = (a.min(b), a.max(b));
            let dl = decide(&p, &[Some(lo)], current, 5, &mut RuleState::default());
            let dh = decide(&p, &[Some(hi)], current, 5, &mut RuleState::default());
            prop_assert!(dh.desired >= dl.desired);
        }

        #[test]
        fn inactive_goes_to_min_only_after_cooldown(p in policy(), current in 1u32..60, elapsed in 0u64..20_000) {
            let p = ScalePolicy { min: 0, ..p };
            let mut st = RuleState { last_active_ms: Some(100_000), consecutive_errors: vec![] };
            let depth = p.activation; // not strictly above: inactive
            let d = decide(&p, &[Some(depth)], current, 100_000 + elapsed, &mut st);
            prop_assert!(!d.active);
            if elapsed >= p.cooldown_ms {
                prop_assert_eq!(d.desired, 0);
            } else {
                prop_assert!(d.desired >= 1);
            }
        }

        #[test]
        fn errors_keep_the_size_then_fallback(p in policy(), current in 0u32..60, n in 1u32..8) {
            let current = current.min(p.max);
            let mut st = RuleState::default();
            let mut last = None;
            for _ in 0..n {
                last = Some(decide(&p, &[None], current, 5, &mut st));
            }
            let d = last.unwrap();
            match p.fallback {
                Some(fb) if n >= fb.failure_threshold => {
                    prop_assert!(d.fallback);
                    prop_assert_eq!(d.desired, fb.replicas.max(p.min).min(p.max));
                }
                _ => {
                    prop_assert!(!d.fallback);
                    prop_assert_eq!(d.desired, current.max(p.min));
                }
            }
            // One good reading resets the count.
            let ok = decide(&p, &[Some(0)], current, 5, &mut st);
            prop_assert!(!ok.fallback);
            prop_assert_eq!(&st.consecutive_errors, &vec![0]);
        }

        #[test]
        fn a_failing_trigger_never_scales_in(p in policy(), depth in 0u64..1000, current in 0u32..60) {
            let current = current.min(p.max);
            let p = ScalePolicy { fallback: None, ..p };
            let d = decide(&p, &[Some(depth), None], current, 5, &mut RuleState::default());
            prop_assert!(d.desired >= current);
        }
    }

    #[test]
    fn examples() {
        let p = ScalePolicy {
            min: 0,
            max: 10,
            target: 5,
            activation: 0,
            cooldown_ms: 30_000,
            fallback: None,
        };
        let mut st = RuleState::default();
        assert_eq!(decide(&p, &[Some(0)], 0, 0, &mut st).desired, 0);
        assert_eq!(decide(&p, &[Some(1)], 0, 1, &mut st).desired, 1);
        assert_eq!(decide(&p, &[Some(11)], 1, 2, &mut st).desired, 3);
        assert_eq!(decide(&p, &[Some(1000)], 3, 3, &mut st).desired, 10);
        // Drained: stays at one through the cooldown, then zero.
        assert_eq!(decide(&p, &[Some(0)], 10, 1_000, &mut st).desired, 1);
        assert_eq!(decide(&p, &[Some(0)], 1, 30_003, &mut st).desired, 0);
    }
}
