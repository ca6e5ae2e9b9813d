//! The polling schedule of `bounded_wait` (see the module docs of `bounded_wait` for
//! the whole story): each `what` remembers its last 16 waits that found the event
//! pending at first, as brackets of when the event completed ([`Sample`]); their
//! estimates give the next wait's [`Plan`] — sleep until shortly before the earliest,
//! poll finely across to the latest, then back off geometrically. Without history a
//! wait backs off from the start ([`Plan::COLD`]). At most 256 names are remembered;
//! beyond that the least recently used is forgotten.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use parking_lot::Mutex;

/// The first poll of a wait without history (after the immediate query).
const COLD_FIRST: Duration = Duration::from_micros(20);
/// Back-off: the next poll at this multiple of the time waited so far...
const GROWTH: u32 = 4;
/// ...but at most this long after the last one.
const POLL_MAX: Duration = Duration::from_millis(400);
/// Queries spent across the window of recent completions.
const FINE_POLLS: u32 = 6;
/// The shortest interval between fine polls.
const FINE_STEP_MIN: Duration = Duration::from_micros(40);
/// Waits remembered per `what`.
const HISTORY: usize = 16;
/// `what` names remembered (a bound on the table; beyond it the oldest is forgotten).
const MAX_NAMES: usize = 256;

/// When the event of one past wait completed: after `lower` (the last query that saw it
/// pending) and by `upper` (the query that saw it complete), from the wait's start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Sample {
    pub(super) lower: Duration,
    pub(super) upper: Duration,
    /// The first poll, at the plan's horizon, already saw it complete: the sleep
    /// overshot, and all the wait knows is that it completed by `upper`.
    pub(super) overshot: bool,
}

impl Sample {
    fn width(&self) -> Duration {
        self.upper.saturating_sub(self.lower)
    }

    /// When the event is taken to have completed: the middle of the bracket, or, after
    /// an overshot sleep, an eighth before `upper` (the next horizon steps back by that
    /// much each time it overshoots, so it closes in on the completion from above
    /// instead of jumping to the middle of [0, upper]).
    fn estimate(&self) -> Duration {
        if self.overshot {
            self.upper - self.upper / 8
        } else {
            self.lower + self.width() / 2
        }
    }
}

/// The recent waits of one `what` that were pending when they began.
#[derive(Default)]
struct History {
    recent: [Sample; HISTORY],
    len: usize,
    next: usize,
    /// Use stamp, for forgetting the least recently used name.
    used: u64,
}

impl History {
    fn record(&mut self, sample: Sample) {
        self.recent[self.next] = sample;
        self.next = (self.next + 1) % HISTORY;
        self.len = (self.len + 1).min(HISTORY);
    }

    /// The plan its samples give. Each sample's completion is estimated (the middle of
    /// its bracket, see [`Sample::estimate`]); sleep until shortly before the earliest
    /// estimate and poll [`FINE_POLLS`] times across to the latest (leaving out the
    /// most extreme one on each side once there are 6 samples: a step delayed by a
    /// busy host), and at least to the earliest bracket end (by then one of the recent
    /// events had completed: a lone cold bracket's 20–80 ms is polled across, not
    /// only at its middle).
    fn plan(&self) -> Plan {
        let recent = &self.recent[..self.len];
        if recent.is_empty() {
            return Plan::COLD;
        }
        // A bracket that holds a narrower one tells nothing the narrower one does not
        // (a cold wait's [20 ms, 80 ms], or one sleep stalled by a busy host: pending at
        // 0, complete at 61 ms); its middle would pull the horizon far too early.
        let informative = |s: &&Sample| {
            !recent.iter().any(|n| {
                n.width() * 2 <= s.width() && n.width() < s.width() && s.lower <= n.lower && n.upper <= s.upper
            })
        };
        let kept: Vec<&Sample> = recent.iter().filter(informative).collect();
        let mut estimates: Vec<Duration> = kept.iter().map(|s| s.estimate()).collect();
        estimates.sort();
        let trim = usize::from(kept.len() >= 6);
        let first_end = kept.iter().map(|s| s.upper).min().unwrap_or_default();
        let (lo, hi) = (estimates[trim], estimates[estimates.len() - 1 - trim].max(first_end));
        // A margin of 1/32 of it, between 20 µs and 500 µs, before the earliest.
        let margin = (lo / 32).clamp(Duration::from_micros(20), Duration::from_micros(500));
        let horizon = lo.saturating_sub(margin);
        let window = hi.saturating_sub(horizon);
        let step = (window / FINE_POLLS).max(FINE_STEP_MIN);
        Plan {
            horizon,
            fine_end: horizon + step * FINE_POLLS,
            step,
        }
    }
}

/// The schedule of one wait (times from its start): sleep until `horizon`, poll every
/// `step` until `fine_end`, then back off (see [`Plan::next_poll`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    pub(super) horizon: Duration,
    fine_end: Duration,
    step: Duration,
}

impl Plan {
    /// Without history: back off from the start.
    const COLD: Plan = Plan {
        horizon: Duration::ZERO,
        fine_end: Duration::ZERO,
        step: FINE_STEP_MIN,
    };

    /// When to poll next, given the time of the last poll.
    pub(super) fn next_poll(&self, last: Duration) -> Duration {
        if last < self.horizon {
            return self.horizon;
        }
        if last < self.fine_end {
            return last + self.step;
        }
        if self.fine_end > Duration::ZERO && last < self.fine_end * 2 - self.horizon {
            // Just past the window (a step a little later than the recent ones): one
            // more poll a window later before backing off.
            return (self.fine_end * 2 - self.horizon).max(last + self.step);
        }
        (last * GROWTH).max(last + COLD_FIRST).min(last + POLL_MAX)
    }
}

struct Histories {
    by_name: HashMap<String, History>,
    clock: u64,
}

fn histories() -> &'static Mutex<Histories> {
    static H: OnceLock<Mutex<Histories>> = OnceLock::new();
    H.get_or_init(|| {
        Mutex::new(Histories {
            by_name: HashMap::new(),
            clock: 0,
        })
    })
}

/// The plan of a wait for `what` (see [`History::plan`]); without history, cold.
pub(super) fn plan(what: &str) -> Plan {
    let mut h = histories().lock();
    h.clock += 1;
    let clock = h.clock;
    match h.by_name.get_mut(what) {
        None => Plan::COLD,
        Some(hist) => {
            hist.used = clock;
            hist.plan()
        }
    }
}

pub(super) fn record(what: &str, sample: Sample) {
    let mut h = histories().lock();
    h.clock += 1;
    let clock = h.clock;
    if !h.by_name.contains_key(what) && h.by_name.len() >= MAX_NAMES {
        if let Some(oldest) = h.by_name.iter().min_by_key(|(_, v)| v.used).map(|(k, _)| k.clone()) {
            h.by_name.remove(&oldest);
        }
    }
    let hist = h.by_name.entry(what.to_string()).or_default();
    hist.used = clock;
    hist.record(sample);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn sample(lower: Duration, upper: Duration) -> Sample {
        Sample {
            lower,
            upper,
            overshot: false,
        }
    }

    /// The poll times of a wait of `plan` that never completes within `timeout`.
    fn polls(plan: Plan, timeout: Duration) -> Vec<Duration> {
        let mut at = Duration::ZERO;
        let mut out = vec![];
        while at < timeout {
            at = plan.next_poll(at).min(timeout);
            out.push(at);
        }
        out
    }

    #[test]
    fn without_history_the_wait_backs_off_from_20_us() {
        let p = polls(Plan::COLD, Duration::from_secs(1));
        assert_eq!(&p[..4], &[us(20), us(80), us(320), us(1280)]);
        // Intervals never exceed POLL_MAX; a second costs ten wake-ups.
        assert!(p.windows(2).all(|w| w[1] - w[0] <= POLL_MAX));
        assert_eq!(p.len(), 10, "{p:?}");
    }

    #[test]
    fn history_forgets_all_but_the_recent_waits() {
        let mut h = History::default();
        assert_eq!(h.plan(), Plan::COLD);
        h.record(sample(ms(3), ms(3)));
        for _ in 0..HISTORY {
            h.record(sample(ms(7), ms(7)));
        }
        // The 3 ms wait fell out of the window.
        assert_eq!(h.plan().horizon, ms(7) - Duration::from_nanos(218_750));
    }

    #[test]
    fn a_steady_history_sleeps_until_just_before_and_polls_finely() {
        let mut h = History::default();
        for _ in 0..4 {
            h.record(sample(us(2000), us(2040)));
        }
        let p = h.plan();
        let margin = Duration::from_nanos(63_125); // 2.02 ms / 32
        assert_eq!(p.horizon, us(2020) - margin);
        assert_eq!(p.step, FINE_STEP_MIN);
        let at = polls(p, Duration::from_secs(1));
        assert_eq!(at[0], p.horizon);
        assert_eq!(at[1], p.horizon + FINE_STEP_MIN);
        // Never completing after that history: about a dozen wake-ups a second.
        assert!(at.len() <= 14, "{}: {at:?}", at.len());
    }

    #[test]
    fn one_delayed_step_does_not_coarsen_the_plan() {
        let mut h = History::default();
        for i in 0..10 {
            let lo = us(2000 + 10 * i);
            h.record(sample(lo, lo + us(40)));
        }
        h.record(sample(ms(15), ms(20)));
        let p = h.plan();
        assert_eq!(p.step, FINE_STEP_MIN);
        assert!(p.fine_end < ms(3), "{p:?}");
    }

    #[test]
    fn rough_brackets_give_way_to_finer_ones() {
        let mut h = History::default();
        // A cold wait: the event completed between 20.48 and 81.92 ms (middle 51.2).
        h.record(sample(us(20_480), us(81_920)));
        let p = h.plan();
        assert_eq!(p.horizon, us(51_200) - us(500));
        // Polled across to the bracket's end, not only around its middle.
        assert!(p.fine_end >= us(81_900) && p.step < ms(6), "{p:?}");
        // The next wait polls from just before 51.2 ms; one that sees the completion at
        // 60 ms brackets it within a step, and the plan follows.
        h.record(sample(ms(60), ms(60) + FINE_STEP_MIN));
        let q = h.plan();
        // The rough bracket holds the fine one, so only the fine one counts.
        assert_eq!(q.horizon, ms(60) + us(20) - us(500));
        assert!(q.fine_end >= ms(60), "{q:?}");
        assert!(q.step < ms(2), "{q:?}");
    }

    #[test]
    fn a_sleep_stalled_by_a_busy_host_does_not_pull_the_horizon_early() {
        // CI, loaded: the first query saw the event pending at 0, the 20 µs sleep
        // overran to 61 ms (middle 30.5 ms); three waits after it bracketed 60 ms.
        let mut h = History::default();
        h.record(sample(Duration::ZERO, ms(61)));
        for _ in 0..3 {
            h.record(sample(ms(59), ms(60)));
        }
        let p = h.plan();
        assert!(p.horizon > ms(58), "{p:?}");
        // Completions that differ (no bracket holds another) all count.
        let mut v = History::default();
        v.record(sample(ms(40), ms(160)));
        v.record(sample(ms(9), ms(11)));
        let q = v.plan();
        assert!(q.horizon < ms(10) && q.fine_end > ms(99), "{q:?}");
    }

    #[test]
    fn an_overshot_horizon_steps_back_instead_of_halving() {
        // Completions at 60 ms, then one wait whose sleep to the horizon (62 ms, a
        // slower step before) found it already complete: pending at 0, done by 62 ms.
        let mut h = History::default();
        h.record(sample(ms(61), ms(63)));
        h.record(Sample {
            lower: us(50),
            upper: ms(62),
            overshot: true,
        });
        let p = h.plan();
        // 62 ms less an eighth, less the margin: before 60 ms, nowhere near 31 ms.
        assert!(p.horizon > ms(50) && p.horizon < ms(60), "{p:?}");
    }

    #[test]
    fn varied_completions_spread_the_six_fine_polls() {
        let mut h = History::default();
        for lo in [500, 1700, 2900, 4100, 5000] {
            h.record(sample(us(lo), us(lo + 100)));
        }
        let p = h.plan();
        assert_eq!(p.horizon, us(530));
        assert_eq!(p.step, (us(5050) - us(530)) / FINE_POLLS);
        assert_eq!(p.fine_end, p.horizon + p.step * FINE_POLLS);
    }
}
