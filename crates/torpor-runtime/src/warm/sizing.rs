//! How many prepared workers, and how many prepared networks, the warm pool keeps: a pure
//! function of the takes it has seen and the preparation times it has measured, at a given
//! instant (the clock is the caller's, so tests are deterministic). The design is in the
//! module doc of `crate::warm`.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// The windows the take rate is measured over; the rate used is the highest of them, so a
/// burst raises it within the short window and a steady rate holds it in the long one.
const WINDOWS: [Duration; 3] = [
    Duration::from_secs(2),
    Duration::from_secs(10),
    Duration::from_secs(60),
];
/// Takes older than this are forgotten (the longest window).
const HORIZON: Duration = Duration::from_secs(60);
/// The stock covers the takes expected during this many preparation times...
const SAFETY: f64 = 2.0;
/// ...and never less than this (a preparation measured fast on a quiet machine is not a
/// promise under load).
const MIN_LEAD: Duration = Duration::from_secs(1);
/// Before a network preparation has been measured.
const DEFAULT_NET_PREP: Duration = Duration::from_millis(300);
/// Weight of the newest preparation time in the moving average.
const EWMA_NEW: f64 = 0.3;
/// The pool gives back workers above its target only after this long without a take.
pub const IDLE_SHRINK: Duration = Duration::from_secs(30);
/// The default ceiling: the stock may grow to this many ready workers (or to the floor when
/// that is higher)...
pub const DEFAULT_CEILING: usize = 16;
/// ...and never beyond this: half of one daemon's 256 uplink subnets (crate::net), the other
/// half left to workers that hold sandboxes.
pub const MAX_CEILING: usize = 128;

/// Bounds and mode of the sizing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizingConfig {
    /// Ready workers always kept (`--warm-pool`).
    pub floor: usize,
    /// Ready workers never exceeded.
    pub ceiling: usize,
    /// Sized from the take rate (else the behaviour before sizing: `floor` ready workers,
    /// every one of them networked once a networked sandbox has run).
    pub adaptive: bool,
}

impl SizingConfig {
    /// The adaptive sizing for `--warm-pool floor`: a floor of 0 keeps the pool off (every
    /// worker prepared at wake time, as the flag documents); else the ceiling is
    /// [`DEFAULT_CEILING`] or the floor, whichever is higher, at most [`MAX_CEILING`] (unless
    /// the floor itself is higher).
    pub fn adaptive(floor: usize) -> SizingConfig {
        let ceiling = if floor == 0 {
            0
        } else {
            floor.max(DEFAULT_CEILING.min(MAX_CEILING))
        };
        SizingConfig {
            floor,
            ceiling,
            adaptive: true,
        }
    }

    /// The size fixed at `floor`, as before sizing existed (a benchmark's baseline).
    pub fn fixed(floor: usize) -> SizingConfig {
        SizingConfig {
            floor,
            ceiling: floor,
            adaptive: false,
        }
    }
}

/// What the pool aims for now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Targets {
    /// Ready workers (prepared groups and bundles), `floor..=ceiling`.
    pub ready: usize,
    /// Of them, ready workers with a prepared network; never more than `ready`.
    pub net: usize,
}

#[derive(Debug)]
pub struct Sizer {
    cfg: SizingConfig,
    /// Every take in the last [`HORIZON`], oldest first.
    takes: VecDeque<Instant>,
    /// The networked ones among them.
    net_takes: VecDeque<Instant>,
    last_take: Option<Instant>,
    /// Moving average of one network's preparation time.
    net_prep: Option<Duration>,
    /// A networked sandbox has run since start.
    net_seen: bool,
}

impl Sizer {
    pub fn new(cfg: SizingConfig) -> Sizer {
        Sizer {
            cfg,
            takes: VecDeque::new(),
            net_takes: VecDeque::new(),
            last_take: None,
            net_prep: None,
            net_seen: false,
        }
    }

    pub fn config(&self) -> SizingConfig {
        self.cfg
    }

    /// A worker was taken at `now`.
    pub fn record_take(&mut self, now: Instant) {
        push(&mut self.takes, now);
        self.last_take = Some(now);
    }

    /// The worker taken at `now` is for a networked sandbox (recorded besides the take).
    pub fn record_net_take(&mut self, now: Instant) {
        push(&mut self.net_takes, now);
        self.net_seen = true;
    }

    /// One network took `took` to prepare.
    pub fn record_net_prep(&mut self, took: Duration) {
        self.net_prep = Some(match self.net_prep {
            None => took,
            Some(avg) => avg.mul_f64(1.0 - EWMA_NEW) + took.mul_f64(EWMA_NEW),
        });
    }

    /// The measured (or assumed) time to prepare one network.
    pub fn net_prep(&self) -> Duration {
        self.net_prep.unwrap_or(DEFAULT_NET_PREP)
    }

    /// How far ahead the stock must cover takes: [`SAFETY`] preparation times, at least
    /// [`MIN_LEAD`].
    pub fn lead(&self) -> Duration {
        self.net_prep().mul_f64(SAFETY).max(MIN_LEAD)
    }

    /// Takes per second at `now` (the highest over [`WINDOWS`]).
    pub fn take_rate(&self, now: Instant) -> f64 {
        rate(&self.takes, now)
    }

    /// Networked takes per second at `now`.
    pub fn net_take_rate(&self, now: Instant) -> f64 {
        rate(&self.net_takes, now)
    }

    /// The targets at `now`: the takes expected during the lead time, plus one, bounded by
    /// the floor and the ceiling; networks likewise from the networked takes, at least one
    /// once a networked sandbox has run, at most the ready target.
    pub fn targets(&self, now: Instant) -> Targets {
        let SizingConfig {
            floor,
            ceiling,
            adaptive,
        } = self.cfg;
        let ceiling = ceiling.max(floor);
        if !adaptive {
            return Targets {
                ready: floor,
                net: if self.net_seen { floor } else { 0 },
            };
        }
        let lead = self.lead().as_secs_f64();
        let stock = |r: f64| {
            if r > 0.0 {
                (r * lead).ceil() as usize + 1
            } else {
                0
            }
        };
        let ready = stock(self.take_rate(now)).clamp(floor, ceiling);
        // Once networked sandboxes are in use, one network is always kept ready.
        let net = stock(self.net_take_rate(now))
            .max(usize::from(self.net_seen))
            .min(ready);
        Targets { ready, net }
    }

    /// Whether the pool may give back workers above its target: no take for [`IDLE_SHRINK`].
    pub fn may_shrink(&self, now: Instant) -> bool {
        self.last_take
            .is_none_or(|t| now.saturating_duration_since(t) >= IDLE_SHRINK)
    }
}

fn push(q: &mut VecDeque<Instant>, now: Instant) {
    q.push_back(now);
    while q
        .front()
        .is_some_and(|t| now.saturating_duration_since(*t) > HORIZON)
    {
        q.pop_front();
    }
}

fn rate(q: &VecDeque<Instant>, now: Instant) -> f64 {
    WINDOWS
        .iter()
        .map(|w| {
            let n = q
                .iter()
                .rev()
                .take_while(|t| now.saturating_duration_since(**t) < *w)
                .count();
            n as f64 / w.as_secs_f64()
        })
        .fold(0.0, f64::max)
}

/// How many threads prepare workers at once: the cores, at most 4 (each preparation is a few
/// dozen short processes, `ip` and `nft`, that compete with wakes for the CPU).
pub fn preparers(cores: usize) -> usize {
    cores.clamp(1, 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// `n` takes, networked or not, one every `every`, from `t0`; returns the last instant.
    fn takes(s: &mut Sizer, t0: Instant, n: usize, every: Duration, networked: bool) -> Instant {
        let mut t = t0;
        for i in 0..n {
            t = t0 + every * i as u32;
            s.record_take(t);
            if networked {
                s.record_net_take(t);
            }
        }
        t
    }

    #[test]
    fn at_rest_the_pool_keeps_its_floor_and_no_network() {
        let s = Sizer::new(SizingConfig::adaptive(3));
        let t = s.targets(Instant::now());
        assert_eq!(t, Targets { ready: 3, net: 0 });
    }

    #[test]
    fn a_floor_of_zero_keeps_the_pool_off_whatever_the_rate() {
        let mut s = Sizer::new(SizingConfig::adaptive(0));
        let t0 = Instant::now();
        let last = takes(&mut s, t0, 20, ms(100), true);
        assert_eq!(s.targets(last), Targets { ready: 0, net: 0 });
    }

    #[test]
    fn networked_takes_raise_the_stock_by_the_rate_times_the_lead_time() {
        let mut s = Sizer::new(SizingConfig::adaptive(2));
        s.record_net_prep(ms(400)); // lead = 800 ms -> MIN_LEAD 1 s
        let t0 = Instant::now();
        // 5 per second for 2 s: 10 in the 2 s window.
        let last = takes(&mut s, t0, 10, ms(200), true);
        assert_eq!(s.net_take_rate(last), 5.0);
        // 5/s x 1 s + 1 = 6.
        assert_eq!(s.targets(last), Targets { ready: 6, net: 6 });

        // A slower preparation lengthens the lead time: 5/s x 2 x 1.2 s + 1 = 13.
        let mut slow = Sizer::new(SizingConfig::adaptive(2));
        slow.record_net_prep(ms(1200));
        let last = takes(&mut slow, t0, 10, ms(200), true);
        assert_eq!(slow.targets(last), Targets { ready: 13, net: 13 });
    }

    #[test]
    fn the_ceiling_bounds_the_stock_and_the_network_target_never_exceeds_it() {
        let mut s = Sizer::new(SizingConfig {
            floor: 1,
            ceiling: 4,
            adaptive: true,
        });
        let t0 = Instant::now();
        let last = takes(&mut s, t0, 40, ms(50), true); // 20/s
        assert_eq!(s.targets(last), Targets { ready: 4, net: 4 });
        // The default ceiling: 16, or the floor when higher, at most 128 above a lower floor.
        assert_eq!(SizingConfig::adaptive(2).ceiling, DEFAULT_CEILING);
        assert_eq!(SizingConfig::adaptive(40).ceiling, 40);
        assert_eq!(SizingConfig::adaptive(500).ceiling, 500);
    }

    #[test]
    fn plain_takes_grow_ready_workers_but_not_networks() {
        let mut s = Sizer::new(SizingConfig::adaptive(1));
        let t0 = Instant::now();
        let last = takes(&mut s, t0, 8, ms(250), false); // 4/s
        let t = s.targets(last);
        assert_eq!(t, Targets { ready: 5, net: 0 });
        // One networked take among them: a stock of networks of its own rate.
        s.record_take(last + ms(10));
        s.record_net_take(last + ms(10));
        let t = s.targets(last + ms(10));
        assert_eq!(t.net, 2, "{t:?}"); // 1 in 2 s = 0.5/s x 1 s -> 1, + 1
        assert!(t.ready >= 5, "{t:?}");
    }

    #[test]
    fn the_targets_fall_back_to_the_floor_after_the_takes_stop() {
        let mut s = Sizer::new(SizingConfig::adaptive(2));
        let t0 = Instant::now();
        let last = takes(&mut s, t0, 20, ms(100), true); // 10/s for 2 s
        assert_eq!(s.targets(last).ready, 11);
        // 5 s later: only the 10 s window holds them (20 in 10 s = 2/s): 3.
        assert_eq!(s.targets(last + Duration::from_secs(5)).ready, 3);
        assert!(!s.may_shrink(last + Duration::from_secs(5)));
        // After a minute without a take, the floor; and the pool may give workers back.
        // (One network stays ready once networked sandboxes are in use.)
        let later = last + Duration::from_secs(61);
        assert_eq!(s.targets(later), Targets { ready: 2, net: 1 });
        assert!(s.may_shrink(later));
        // The queue forgets old takes as new ones come.
        s.record_take(later);
        assert_eq!(s.takes.len(), 1);
    }

    #[test]
    fn the_preparation_time_is_a_moving_average() {
        let mut s = Sizer::new(SizingConfig::adaptive(1));
        assert_eq!(s.net_prep(), DEFAULT_NET_PREP);
        s.record_net_prep(ms(1000));
        assert_eq!(s.net_prep(), ms(1000));
        s.record_net_prep(ms(0));
        assert_eq!(s.net_prep(), ms(700));
        assert_eq!(s.lead(), ms(1400));
    }

    #[test]
    fn the_fixed_mode_keeps_the_floor_and_networks_all_of_it_once_wanted() {
        let mut s = Sizer::new(SizingConfig::fixed(3));
        let t0 = Instant::now();
        let last = takes(&mut s, t0, 30, ms(50), false);
        assert_eq!(s.targets(last), Targets { ready: 3, net: 0 });
        s.record_net_take(last);
        assert_eq!(s.targets(last), Targets { ready: 3, net: 3 });
    }

    #[test]
    fn preparers_follow_the_cores_within_one_to_four() {
        assert_eq!(preparers(0), 1);
        assert_eq!(preparers(2), 2);
        assert_eq!(preparers(64), 4);
    }
}
