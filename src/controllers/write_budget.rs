//! A write budget per lower copy (ConfigMap, Secret, Service, EndpointSlice, Endpoints),
//! so that a lower controller that keeps editing a copy (a "fighter") cannot draw tensile
//! into an endless write loop that drains the shared rate limit.
//!
//! A rewrite of a copy from the same upper version (undoing a lower edit, or retrying
//! after a conflict) spends the budget: [`FREE_REWRITES`] go at once, then each waits
//! twice as long as the one before, from [`FIRST_DELAY`] up to [`LONGEST_DELAY`]. A
//! success does not restore it; only an object that stays quiet for [`QUIET`] after a
//! write does (a new episode). A write for a new upper version (a legitimate update) goes
//! at once, fight or not. The first rewrite put off in an episode asks for one Warning.
//! Pure: the caller passes the time. Imports nothing from the controllers.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// Rewrites from one upper version that go at once in an episode.
pub const FREE_REWRITES: u32 = 3;
/// The wait before the first rewrite past the free ones.
pub const FIRST_DELAY: Duration = Duration::from_secs(1);
/// The longest wait between two rewrites.
pub const LONGEST_DELAY: Duration = Duration::from_secs(60);
/// A copy that stays in step this long after a write ends its episode.
pub const QUIET: Duration = Duration::from_secs(30);

/// Whether a copy may be written now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Write it (the write is counted).
    Write,
    /// Not before `after`; `warn` is true once per episode, the first time.
    Wait {
        /// How long until it may be written.
        after: Duration,
        /// Publish the Warning that the copy is contested.
        warn: bool,
    },
}

/// The write history of one copy.
#[derive(Debug)]
struct Rewrites {
    /// The upper version the last write was made from.
    source: String,
    /// Rewrites from one upper version in this episode.
    count: u32,
    last_write: Instant,
    /// When a write was first found needed since the last one.
    diverged: Option<Instant>,
    /// Whether this episode's Warning was asked for.
    warned: bool,
}

/// The write budgets of the copies of one controller, by object key.
#[derive(Debug, Default)]
pub struct WriteBudget {
    copies: HashMap<String, Rewrites>,
    /// When copies quiet past any use were last dropped.
    pruned: Option<Instant>,
}

/// The identity and version (`uid/resourceVersion`) of an upper object: what a copy made
/// from it follows, and what [`WriteBudget::admit`] tells legitimate updates by.
pub fn upper_version(meta: &ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.uid.as_deref().unwrap_or_default(),
        meta.resource_version.as_deref().unwrap_or_default()
    )
}

/// The wait before the rewrite that follows `count` rewrites.
fn delay_after(count: u32) -> Duration {
    match count.checked_sub(FREE_REWRITES) {
        None => Duration::ZERO,
        Some(over) => FIRST_DELAY
            .saturating_mul(1 << over.min(16))
            .min(LONGEST_DELAY),
    }
}

impl WriteBudget {
    /// Decides whether the copy `key` may be written now from the upper version `source`
    /// (anything that changes when the upper original does: UID and resourceVersion). Call
    /// it only when a write is needed; a [`Admission::Write`] is counted as done.
    pub fn admit(&mut self, now: Instant, key: &str, source: &str) -> Admission {
        self.prune(now);
        let Some(copy) = self.copies.get_mut(key) else {
            self.copies.insert(
                key.to_owned(),
                Rewrites {
                    source: source.to_owned(),
                    count: 0,
                    last_write: now,
                    diverged: None,
                    warned: false,
                },
            );
            return Admission::Write;
        };
        if copy.source != source {
            // The upper original changed: a legitimate update, which the fight (if any)
            // does not hold up. It does not end the episode either.
            copy.source = source.to_owned();
            copy.last_write = now;
            copy.diverged = None;
            return Admission::Write;
        }
        let diverged = *copy.diverged.get_or_insert(now);
        if diverged.saturating_duration_since(copy.last_write) >= QUIET {
            copy.count = 0;
            copy.warned = false;
        }
        let due = copy.last_write + delay_after(copy.count);
        if now >= due {
            copy.count = copy.count.saturating_add(1);
            copy.last_write = now;
            copy.diverged = None;
            return Admission::Write;
        }
        let warn = !copy.warned;
        copy.warned = true;
        Admission::Wait {
            after: due - now,
            warn,
        }
    }

    /// Drops copies not written for longer than any wait and a quiet period (their next
    /// write would start a new episode anyway), at most once every [`QUIET`].
    fn prune(&mut self, now: Instant) {
        if self
            .pruned
            .is_some_and(|at| now.saturating_duration_since(at) < QUIET)
        {
            return;
        }
        self.pruned = Some(now);
        self.copies.retain(|_, copy| {
            now.saturating_duration_since(copy.last_write) < LONGEST_DELAY + QUIET
        });
    }

    /// How many copies it remembers.
    pub fn len(&self) -> usize {
        self.copies.len()
    }

    /// Whether it remembers none.
    pub fn is_empty(&self) -> bool {
        self.copies.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    const WRITE: Admission = Admission::Write;
    const fn wait(after: Duration, warn: bool) -> Admission {
        Admission::Wait { after, warn }
    }

    #[test]
    fn rewrites_from_one_version_wait_longer_and_longer() {
        // (at, upper version, expected), one copy.
        type Step = (Duration, &'static str, Admission);
        let s = Duration::from_secs;
        let cases: &[(&str, &[Step])] = &[
            (
                "the first write and three rewrites go at once, then 1 s, 2 s, 4 s…",
                &[
                    (ms(0), "v1", WRITE),
                    (ms(10), "v1", WRITE),
                    (ms(20), "v1", WRITE),
                    (ms(30), "v1", WRITE),
                    (ms(40), "v1", wait(ms(990), true)),
                    (ms(500), "v1", wait(ms(530), false)),
                    (ms(1030), "v1", WRITE),
                    (ms(1040), "v1", wait(ms(1990), false)),
                    (ms(3030), "v1", WRITE),
                    (ms(3031), "v1", wait(s(4) - ms(1), false)),
                ],
            ),
            (
                "a success does not restore the budget; a new upper version goes at once",
                &[
                    (ms(0), "v1", WRITE),
                    (ms(1), "v1", WRITE),
                    (ms(2), "v1", WRITE),
                    (ms(3), "v1", WRITE),
                    (ms(4), "v1", wait(ms(999), true)),
                    (ms(5), "v2", WRITE),
                    // Still fought: the next rewrite of v2 waits from that write.
                    (ms(6), "v2", wait(ms(999), false)),
                    (ms(1005), "v2", WRITE),
                    (ms(1006), "v2", wait(s(2) - ms(1), false)),
                ],
            ),
            (
                "quiet for QUIET after a write: a new episode, free again and warned again",
                &[
                    (ms(0), "v1", WRITE),
                    (ms(1), "v1", WRITE),
                    (ms(2), "v1", WRITE),
                    (ms(3), "v1", WRITE),
                    (ms(4), "v1", wait(ms(999), true)),
                    (ms(1003), "v1", WRITE),
                    (ms(1003) + QUIET, "v1", WRITE),
                    (ms(1004) + QUIET, "v1", WRITE),
                    (ms(1005) + QUIET, "v1", WRITE),
                    (ms(1006) + QUIET, "v1", wait(ms(999), true)),
                ],
            ),
            (
                "not quiet: an edit seen just before QUIET keeps the episode",
                &[
                    (ms(0), "v1", WRITE),
                    (ms(1), "v1", WRITE),
                    (ms(2), "v1", WRITE),
                    (ms(3), "v1", WRITE),
                    (QUIET + ms(2), "v1", WRITE),
                    (QUIET + ms(3), "v1", wait(s(2) - ms(1), true)),
                ],
            ),
        ];
        for (name, steps) in cases {
            let start = Instant::now();
            let mut budget = WriteBudget::default();
            for (i, (at, source, expected)) in steps.iter().enumerate() {
                assert_eq!(
                    budget.admit(start + *at, "ConfigMap/ns/cm", source),
                    *expected,
                    "{name}: step {i}"
                );
            }
        }
    }

    #[test]
    fn delays_double_up_to_the_longest() {
        let cases = [
            (0, ms(0)),
            (2, ms(0)),
            (3, ms(1_000)),
            (4, ms(2_000)),
            (8, ms(32_000)),
            (9, LONGEST_DELAY),
            (1_000, LONGEST_DELAY),
        ];
        for (count, expected) in cases {
            assert_eq!(delay_after(count), expected, "after {count} rewrites");
        }
    }

    /// A fighter that undoes every write 5 ms after it, polled every 10 ms for 30 s: a
    /// handful of writes instead of thousands, one Warning.
    #[test]
    fn a_fighter_gets_a_handful_of_writes() {
        let start = Instant::now();
        let mut budget = WriteBudget::default();
        let (mut writes, mut warnings) = (0, 0);
        let mut now = ms(0);
        while now < Duration::from_secs(30) {
            match budget.admit(start + now, "Service/ns/web", "uid/1") {
                Admission::Write => writes += 1,
                Admission::Wait { warn, .. } => warnings += u32::from(warn),
            }
            now += ms(10);
        }
        // 1 + 3 free, then at 1, 3, 7, 15 s (the next would be at 31 s).
        assert_eq!((writes, warnings), (8, 1));
    }

    #[test]
    fn copies_are_apart_and_quiet_ones_forgotten() {
        let start = Instant::now();
        let mut budget = WriteBudget::default();
        for i in 0..4 {
            assert_eq!(budget.admit(start, "a", "v1"), WRITE, "rewrite {i} of a");
        }
        assert!(matches!(
            budget.admit(start, "a", "v1"),
            Admission::Wait { .. }
        ));
        assert_eq!(
            budget.admit(start, "b", "v1"),
            WRITE,
            "b has its own budget"
        );

        // Copies not written for a wait and a quiet period are dropped.
        let later = start + LONGEST_DELAY + QUIET;
        budget.admit(later, "c", "v1");
        assert_eq!(budget.len(), 1, "only c is left");
    }
}
