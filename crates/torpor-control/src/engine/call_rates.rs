//! Call rates (cluster mode): how many calls a second each sandbox a controller holds takes,
//! and the rule by which a controller passes its busiest sandboxes to the least loaded one.
//!
//! A controller's load is the calls it serves for the sandboxes it holds (it relays every agent
//! call, exec, file and proxied request of them, whichever controller the caller reached). Each
//! sandbox's rate is measured at every balancing period from the calls that borrowed it
//! ([`CallRates::sample`]: its calls over the last [`WINDOW`]); the controller says its total
//! in its row at each heartbeat (`controllers.call_rate`), and [`RateBalance`] decides, from
//! those totals, which of its sandboxes to pass and to whom:
//!
//! - only a controller above its share (the cluster's calls a second over the live
//!   controllers) by more than the slack (a tenth of its share, at least
//!   [`SLACK_MIN`] calls a second: a burst of a few calls, which the others say a heartbeat
//!   late, is not a load to move) passes anything;
//! - its busiest sandboxes first, each to the least loaded controller, and only when the pass
//!   narrows the gap between the two: the sandbox's rate at most [`GAP_FRACTION`] of it. A
//!   sandbox that takes more than that stays (passing it would only move the imbalance); two
//!   equal halves can form despite the noise of a measurement, and the slack keeps the
//!   receiver from passing it straight back;
//! - a pass counts on its receiver's load until the receiver has had time to measure it and
//!   say so (a window and [`SETTLE_PERIODS`]), so a sender does not pass the same room twice.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use torpor_core::SandboxId;

/// The span over which a sandbox's calls make its rate (or two balancing periods, if longer).
pub(super) const WINDOW: Duration = Duration::from_secs(5);
/// The least a controller must be over its share, in calls a second, before it passes any: a
/// few calls in a burst (the others say theirs a heartbeat late) are not a load to move.
pub(super) const SLACK_MIN: f64 = 2.0;
/// ... and as a fraction of its share.
pub(super) const SLACK_FRACTION: f64 = 0.1;
/// A sandbox is passed only if its rate is at most this fraction of the gap between its
/// holder's load and its receiver's (a half would stop exactly at equal halves, which the
/// noise of a measurement then decides).
pub(super) const GAP_FRACTION: f64 = 0.6;
/// Balancing periods, beyond the [`WINDOW`], during which a pass is added to its receiver's
/// reported load: the receiver counts a sandbox's calls over a whole window from its first
/// sample of it, and says the total at its next heartbeat.
pub(super) const SETTLE_PERIODS: u32 = 2;

/// The calls that had borrowed one sandbox at each sample of the window (oldest first).
type Samples = VecDeque<(Instant, u64)>;

/// The call rates of the sandboxes this controller holds.
#[derive(Debug, Default)]
pub(super) struct CallRates {
    sampled: bool,
    window: Duration,
    by_id: HashMap<SandboxId, Samples>,
    /// Passes made lately: to whom, the rate that went, when.
    passed: Vec<(String, f64, Instant)>,
}

impl CallRates {
    /// Samples each held sandbox's count of calls at `now`; sandboxes not in `counts` are
    /// forgotten (no longer held here). A sandbox's rate is its calls over the last `window`:
    /// one first seen here less than a window ago counts its calls since as if over a whole
    /// window (a couple of calls just after it arrived are not a high rate).
    pub fn sample(
        &mut self,
        counts: impl IntoIterator<Item = (SandboxId, u64)>,
        window: Duration,
        now: Instant,
    ) {
        let mut next = HashMap::new();
        for (id, calls) in counts {
            let mut samples = self.by_id.remove(&id).unwrap_or_default();
            samples.push_back((now, calls));
            // Keep one sample at or before the window's start: the base of the rate.
            while samples
                .get(1)
                .is_some_and(|(at, _)| now.saturating_duration_since(*at) >= window)
            {
                samples.pop_front();
            }
            next.insert(id, samples);
        }
        self.by_id = next;
        self.window = window;
        self.sampled = true;
    }

    /// Sandbox `id`'s calls a second (0 until measured).
    pub fn rate(&self, id: &SandboxId) -> f64 {
        self.by_id
            .get(id)
            .map_or(0.0, |samples| rate_of(samples, self.window))
    }

    /// The calls a second of every sandbox held here; `None` before the first sample.
    pub fn total(&self) -> Option<f64> {
        self.sampled.then(|| {
            self.by_id
                .values()
                .fold(0.0, |sum, s| sum + rate_of(s, self.window))
        })
    }

    /// Notes that a sandbox taking `rate` calls a second was passed to `to` at `now`.
    pub fn note_pass(&mut self, to: &str, rate: f64, now: Instant) {
        self.passed.push((to.to_string(), rate, now));
    }

    /// The rates passed to each controller within `settle` of `now` (older passes are
    /// forgotten): what their reported loads may not show yet.
    pub fn in_transit(&mut self, settle: Duration, now: Instant) -> HashMap<String, f64> {
        self.passed
            .retain(|(_, _, at)| now.saturating_duration_since(*at) < settle);
        let mut by_to = HashMap::new();
        for (to, rate, _) in &self.passed {
            *by_to.entry(to.clone()).or_insert(0.0) += rate;
        }
        by_to
    }
}

/// Calls a second between the first and the last of `samples`, over at least `window`.
fn rate_of(samples: &Samples, window: Duration) -> f64 {
    match (samples.front(), samples.back()) {
        (Some((t0, c0)), Some((t1, c1))) => {
            let span = t1.duration_since(*t0).max(window).as_secs_f64();
            if span > 0.0 {
                c1.saturating_sub(*c0) as f64 / span
            } else {
                0.0
            }
        }
        _ => 0.0,
    }
}

/// A rate as another controller said it in its row: a negative, infinite or NaN one (a
/// controller gone wrong) counts as no calls, so it cannot draw every pass to itself nor
/// poison the cluster's total.
pub(super) fn said(rate: f64) -> f64 {
    if rate.is_finite() {
        rate.max(0.0)
    } else {
        0.0
    }
}

/// One balancing decision over call rates, from this controller's side.
#[derive(Debug, Clone)]
pub(super) struct RateBalance {
    mine: f64,
    /// The controllers that may receive (alive long enough), and their loads.
    others: BTreeMap<String, f64>,
    share: f64,
    slack: f64,
}

impl RateBalance {
    /// `mine`: this controller's calls a second; `receivers`: the loads of the controllers it
    /// may pass to; `total` over `controllers`: the cluster's calls a second and the live
    /// controllers (those that may not receive included).
    pub fn new(
        mine: f64,
        receivers: BTreeMap<String, f64>,
        total: f64,
        controllers: usize,
    ) -> Self {
        let share = total / controllers.max(1) as f64;
        RateBalance {
            mine,
            others: receivers,
            share,
            slack: (share * SLACK_FRACTION).max(SLACK_MIN),
        }
    }

    /// Whether this controller is over its share by more than the slack.
    pub fn over(&self) -> bool {
        self.mine > self.share + self.slack
    }

    /// Where a sandbox taking `rate` calls a second goes: the least loaded receiver (among
    /// equals the first name), if this controller is over its share and the pass narrows
    /// the gap between the two.
    pub fn receiver(&self, rate: f64) -> Option<&str> {
        if !self.over() || rate <= 0.0 {
            return None;
        }
        let (to, load) = self.others.iter().min_by(|a, b| a.1.total_cmp(b.1))?;
        (rate <= GAP_FRACTION * (self.mine - load)).then_some(to.as_str())
    }

    /// Counts a pass of `rate` calls a second to `to`.
    pub fn moved(&mut self, to: &str, rate: f64) {
        self.mine -= rate;
        if let Some(load) = self.others.get_mut(to) {
            *load += rate;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: &str) -> SandboxId {
        format!("sb-{n}").parse().expect("a sandbox id")
    }

    /// Runs the rule to its end: the passes made (sandbox, to), busiest first.
    fn passes(
        mine: &[(&str, f64)],
        others: &[(&str, f64)],
        unsettled: f64,
    ) -> (Vec<(String, String)>, RateBalance) {
        let own: f64 = mine.iter().map(|(_, r)| r).sum();
        let total = own + others.iter().map(|(_, l)| l).sum::<f64>() + unsettled;
        let n = 1 + others.len() + usize::from(unsettled > 0.0);
        let mut bal = RateBalance::new(
            own,
            others.iter().map(|(n, l)| (n.to_string(), *l)).collect(),
            total,
            n,
        );
        let mut by_rate = mine.to_vec();
        by_rate.sort_by(|a, b| b.1.total_cmp(&a.1));
        let mut made = Vec::new();
        for (name, rate) in by_rate {
            let Some(to) = bal.receiver(rate).map(str::to_string) else {
                continue;
            };
            bal.moved(&to, rate);
            made.push((name.to_string(), to));
        }
        (made, bal)
    }

    #[test]
    fn rates_are_the_calls_over_the_window() {
        let mut r = CallRates::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let w = Duration::from_secs(4);
        assert_eq!(r.total(), None, "nothing said before a sample");
        r.sample([(id("a"), 0), (id("b"), 5)], w, at(0));
        assert_eq!(r.total(), Some(0.0));
        assert_eq!(r.rate(&id("a")), 0.0, "one sample: not measured yet");
        // Less than a window seen: its calls so far over a whole window.
        r.sample([(id("a"), 10), (id("b"), 5)], w, at(2));
        assert_eq!(r.rate(&id("a")), 2.5);
        assert_eq!(r.rate(&id("b")), 0.0);
        r.sample([(id("a"), 10), (id("b"), 9)], w, at(4));
        assert_eq!(r.rate(&id("a")), 2.5);
        assert_eq!(r.rate(&id("b")), 1.0);
        assert_eq!(r.total(), Some(3.5));
        // Calls older than the window no longer count.
        r.sample([(id("a"), 12), (id("b"), 9)], w, at(6));
        assert_eq!(r.rate(&id("a")), 0.5, "2 calls in the last 4 s");
        assert_eq!(r.rate(&id("b")), 1.0, "4 calls in the last 4 s");
        // Samples further apart than the window: over the time between them.
        r.sample([(id("a"), 22), (id("b"), 9)], w, at(11));
        assert_eq!(r.rate(&id("a")), 2.0, "10 calls in 5 s");
        // A sandbox no longer held is forgotten, and comes back unmeasured.
        r.sample([(id("b"), 9)], w, at(12));
        assert_eq!(r.rate(&id("a")), 0.0);
        assert_eq!(r.rate(&id("b")), 0.0);
        r.sample([(id("a"), 50), (id("b"), 9)], w, at(13));
        assert_eq!(
            r.rate(&id("a")),
            0.0,
            "its calls before it left do not count"
        );
        r.sample([(id("a"), 58), (id("b"), 9)], w, at(14));
        assert_eq!(r.rate(&id("a")), 2.0);
    }

    #[test]
    fn passes_settle_on_their_receiver_for_a_while() {
        let mut r = CallRates::default();
        let t0 = Instant::now();
        r.note_pass("c2", 3.0, t0);
        r.note_pass("c2", 1.0, t0 + Duration::from_secs(1));
        r.note_pass("c3", 2.0, t0 + Duration::from_secs(1));
        let settle = Duration::from_secs(3);
        let now = r.in_transit(settle, t0 + Duration::from_secs(2));
        assert_eq!((now["c2"], now["c3"]), (4.0, 2.0));
        let later = r.in_transit(settle, t0 + Duration::from_millis(3500));
        assert_eq!((later["c2"], later["c3"]), (1.0, 2.0));
        assert!(r.in_transit(settle, t0 + Duration::from_secs(5)).is_empty());
    }

    #[test]
    fn the_busiest_pass_first_and_only_while_they_narrow_the_gap() {
        // Two hot sandboxes and four light ones on c1, nothing on c2: one hot one goes, and
        // light ones even out what is left; the second hot one would only move the gap.
        let mine = [
            ("hot1", 7.2),
            ("hot2", 6.9),
            ("w1", 1.8),
            ("w2", 1.8),
            ("w3", 1.8),
            ("w4", 1.8),
        ];
        let (made, bal) = passes(&mine, &[("c2", 0.0)], 0.0);
        assert_eq!(made[0], ("hot1".to_string(), "c2".to_string()));
        assert!(made.iter().all(|(n, _)| n != "hot2"), "{made:?}");
        assert!(made.len() >= 2, "a light one evens out the rest: {made:?}");
        assert!(!bal.over(), "{bal:?}");
        assert!(
            (bal.mine - bal.others["c2"]).abs() <= 2.0 * bal.slack,
            "{bal:?}"
        );
    }

    #[test]
    fn equal_sandboxes_split_in_halves_and_stay() {
        let (made, bal) = passes(
            &[("a", 5.0), ("b", 5.0), ("c", 5.0), ("d", 5.0)],
            &[("c2", 0.0)],
            0.0,
        );
        assert_eq!(made.len(), 2, "{made:?}");
        assert_eq!(bal.mine, 10.0);
        // From the receiver's side nothing goes back.
        let (back, _) = passes(&[("a", 5.0), ("b", 5.0)], &[("c1", 10.0)], 0.0);
        assert!(back.is_empty(), "{back:?}");
        // Nor with a measurement a little off.
        let (back, _) = passes(&[("a", 5.5), ("b", 5.4)], &[("c1", 9.1)], 0.0);
        assert!(back.is_empty(), "{back:?}");
    }

    #[test]
    fn a_rate_said_wrong_counts_as_no_calls() {
        assert_eq!(said(2.5), 2.5);
        for wrong in [-1e9, f64::NEG_INFINITY, f64::INFINITY, f64::NAN] {
            assert_eq!(said(wrong), 0.0, "{wrong}");
        }
        // A controller saying a huge negative load draws nothing more than an idle one would:
        // passes stop at even halves.
        let (made, bal) = passes(
            &[("a", 5.0), ("b", 5.0), ("c", 5.0), ("d", 5.0)],
            &[("liar", said(-1e9))],
            0.0,
        );
        assert_eq!(made.len(), 2, "{made:?}");
        assert_eq!(bal.mine, 10.0);
    }

    #[test]
    fn one_hot_sandbox_stays_where_it_is() {
        let (made, _) = passes(&[("hot", 10.0), ("idle", 0.0)], &[("c2", 0.0)], 0.0);
        assert!(
            made.is_empty(),
            "passing it would only move the imbalance: {made:?}"
        );
        // Three equal ones over two controllers: one moves, two stay.
        let (made, _) = passes(
            &[("a", 10.0), ("b", 10.0), ("c", 10.0)],
            &[("c2", 0.0)],
            0.0,
        );
        assert_eq!(made.len(), 1, "{made:?}");
    }

    #[test]
    fn under_the_slack_nothing_moves_and_the_least_loaded_receives() {
        // A burst of a few calls (1.5 a second over an even split): under the slack.
        let (made, _) = passes(&[("a", 1.0), ("b", 1.0)], &[("c2", 0.5)], 0.0);
        assert!(made.is_empty(), "{made:?}");
        // Three controllers: the least loaded takes the first, then the next least.
        let (made, _) = passes(
            &[("a", 3.0), ("b", 3.0), ("c", 3.0)],
            &[("c2", 0.5), ("c3", 0.0)],
            0.0,
        );
        assert_eq!(made[0].1, "c3", "{made:?}");
        assert_eq!(made[1].1, "c2", "{made:?}");
        // A controller that may not receive yet counts in the share, takes nothing.
        let (made, bal) = passes(&[("a", 5.0), ("b", 5.0)], &[("c2", 0.0)], 10.0);
        assert_eq!(made.len(), 1, "{made:?} {bal:?}");
        // Nobody to pass to: nothing moves.
        let (made, _) = passes(&[("a", 3.0), ("b", 3.0)], &[], 0.0);
        assert!(made.is_empty());
    }
}
