//! How long a controller waits before retrying an object whose reconcile failed: 250 ms
//! doubling up to 30 s per consecutive failure. Pure (the caller passes the time) and
//! bounded: an object that stopped failing without a success (it was deleted, or its
//! controller stopped) is forgotten once it has been quiet for [`FORGET_AFTER`], so the
//! map holds only objects that failed recently. Imports nothing from the controllers: the
//! shared `Context` holds it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The first retry delay.
const FIRST: Duration = Duration::from_millis(250);
/// The longest retry delay.
const LONGEST: Duration = Duration::from_secs(30);
/// An object with no failure for this long is forgotten: well past [`LONGEST`], so an
/// object still failing (retried at least every 30 s) keeps its count.
pub const FORGET_AFTER: Duration = Duration::from_secs(300);

/// Consecutive failures per object key, with the time of the last one.
#[derive(Debug, Default)]
pub struct FailureBackoff {
    failures: HashMap<String, (u32, Instant)>,
    /// When entries idle past [`FORGET_AFTER`] were last dropped.
    pruned: Option<Instant>,
}

impl FailureBackoff {
    /// Records a failure of `key` at `now` and returns how long to wait before the next
    /// try. Drops forgotten objects at most once every [`FORGET_AFTER`].
    pub fn failed(&mut self, now: Instant, key: &str) -> Duration {
        if self
            .pruned
            .is_none_or(|at| now.saturating_duration_since(at) >= FORGET_AFTER)
        {
            self.forget_idle(now);
            self.pruned = Some(now);
        }
        let (count, last) = self.failures.entry(key.to_owned()).or_insert((0, now));
        if now.saturating_duration_since(*last) >= FORGET_AFTER {
            *count = 0;
        }
        *count = count.saturating_add(1);
        *last = now;
        let exponent = (*count - 1).min(7);
        (FIRST * (1 << exponent)).min(LONGEST)
    }

    /// Forgets the failures of `key` after a success.
    pub fn succeeded(&mut self, key: &str) {
        self.failures.remove(key);
    }

    /// Drops every object whose last failure is [`FORGET_AFTER`] old or more.
    pub fn forget_idle(&mut self, now: Instant) {
        self.failures
            .retain(|_, (_, last)| now.saturating_duration_since(*last) < FORGET_AFTER);
    }

    /// How many objects it remembers.
    pub fn len(&self) -> usize {
        self.failures.len()
    }

    /// Whether it remembers none.
    pub fn is_empty(&self) -> bool {
        self.failures.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    /// One step: at `at` ms, `key` fails (`Some(expected delay)`) or succeeds (`None`).
    type Step = (u64, &'static str, Option<u64>);

    #[test]
    fn delays_double_reset_on_success_and_idle_objects_are_forgotten() {
        let cases: &[(&str, &[Step])] = &[
            (
                "doubles from 250 ms up to 30 s",
                &[
                    (0, "a", Some(250)),
                    (1, "a", Some(500)),
                    (2, "a", Some(1_000)),
                    (3, "a", Some(2_000)),
                    (4, "a", Some(4_000)),
                    (5, "a", Some(8_000)),
                    (6, "a", Some(16_000)),
                    (7, "a", Some(30_000)),
                    (8, "a", Some(30_000)),
                ],
            ),
            (
                "a success starts over; other keys are apart",
                &[
                    (0, "a", Some(250)),
                    (1, "b", Some(250)),
                    (2, "a", Some(500)),
                    (3, "a", None),
                    (4, "a", Some(250)),
                    (5, "b", Some(500)),
                ],
            ),
            (
                "still failing every 30 s: the count is kept",
                &[
                    (0, "a", Some(250)),
                    (30_000, "a", Some(500)),
                    (60_000, "a", Some(1_000)),
                    (299_000, "a", Some(2_000)),
                ],
            ),
            (
                "quiet for FORGET_AFTER: starts over",
                &[
                    (0, "a", Some(250)),
                    (1, "a", Some(500)),
                    (301_001, "a", Some(250)),
                ],
            ),
        ];
        for (name, steps) in cases {
            let start = Instant::now();
            let mut backoff = FailureBackoff::default();
            for (i, (at, key, expected)) in steps.iter().enumerate() {
                let now = start + MS(*at);
                match expected {
                    Some(delay) => {
                        assert_eq!(backoff.failed(now, key), MS(*delay), "{name}: step {i}");
                    }
                    None => backoff.succeeded(key),
                }
            }
        }
    }

    #[test]
    fn objects_gone_without_a_success_are_pruned() {
        let start = Instant::now();
        let mut backoff = FailureBackoff::default();
        for i in 0..1000 {
            backoff.failed(start, &format!("gone-{i}"));
        }
        assert_eq!(backoff.len(), 1000);
        backoff.failed(start + FORGET_AFTER - MS(1), "recent");
        assert_eq!(backoff.len(), 1001, "not yet idle long enough");
        // A failure of any object once FORGET_AFTER has passed drops the idle ones.
        backoff.failed(start + FORGET_AFTER, "other");
        assert_eq!(backoff.len(), 2, "only `recent` and `other` remain");
        backoff.forget_idle(start + FORGET_AFTER * 3);
        assert!(backoff.is_empty());
    }
}
