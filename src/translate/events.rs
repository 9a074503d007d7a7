//! Events the lower cluster records about a mirrored pod (FailedScheduling, Pulled,
//! BackOff, …), reflected onto the upper pod so that `kubectl describe pod` in the upper
//! cluster tells why a pod is Pending below: what is reflected, a gate that drops
//! repeats and rate-limits each pod, and the bounded queue between the watch and the
//! publisher.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Event;
use k8s_openapi::jiff::Timestamp;

use super::hash::fnv1a;

/// Longest note an events.k8s.io Event accepts.
const MAX_NOTE: usize = 1024;

/// What is published on the upper pod for one lower event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reflection {
    /// `Warning` rather than `Normal`.
    pub warning: bool,
    /// The lower reason, verbatim.
    pub reason: String,
    /// The lower message (cut to what an event note holds).
    pub note: String,
    /// Event action: derived from the note, so that two messages with one reason stay two
    /// events (the recorder folds events of one reason and action into one series, keeping
    /// the first note).
    pub action: String,
    /// The part of the pod the event is about (`spec.containers{app}`), if any.
    pub field_path: Option<String>,
}

/// What to publish for `lower`, if anything: it must name a reason. The lower
/// scheduler's Normal `Scheduled` is not reflected: it names a lower node where the upper
/// pod shows the virtual node (whose own `Scheduled` the upper scheduler recorded), and it
/// would cost an upper write for every pod of a burst.
pub fn reflection(lower: &Event) -> Option<Reflection> {
    let reason = lower.reason.clone().filter(|r| !r.is_empty())?;
    let warning = lower.type_.as_deref() == Some("Warning");
    if !warning && reason == "Scheduled" {
        return None;
    }
    let mut note = lower.message.clone().unwrap_or_default();
    if note.len() > MAX_NOTE {
        let mut cut = MAX_NOTE;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
    }
    let action = format!("Lower{reason}-{:08x}", fnv1a(note.as_bytes()) as u32);
    Some(Reflection {
        warning,
        reason,
        note,
        action,
        field_path: lower.involved_object.field_path.clone(),
    })
}

/// How many times the lower cluster has seen this event (a series or a count; at least 1).
pub fn occurrences(lower: &Event) -> i32 {
    lower
        .series
        .as_ref()
        .and_then(|s| s.count)
        .or(lower.count)
        .unwrap_or(1)
        .max(1)
}

/// When the lower cluster last saw this event, as far as it says.
pub fn last_seen(lower: &Event) -> Option<Timestamp> {
    lower
        .series
        .as_ref()
        .and_then(|s| s.last_observed_time.as_ref())
        .map(|t| t.0)
        .or_else(|| lower.last_timestamp.as_ref().map(|t| t.0))
        .or_else(|| lower.event_time.as_ref().map(|t| t.0))
        .or_else(|| lower.metadata.creation_timestamp.as_ref().map(|t| t.0))
}

/// Whether the gate lets an event through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Publish it.
    Publish,
    /// Already published at this count (a relist, or an update that is not a repeat).
    Duplicate,
    /// The pod has used up its budget for now.
    RateLimited,
}

/// Drops lower events already reflected and limits each pod to `burst` events at once,
/// refilled at one per `refill`. Pure: the caller passes the time.
#[derive(Debug)]
pub struct EventGate {
    burst: f64,
    refill: Duration,
    /// Per lower event UID: the occurrence count last published, and when it was seen.
    seen: HashMap<String, (i32, Instant)>,
    /// Per pod: tokens left and when they were counted.
    budgets: HashMap<String, (f64, Instant)>,
}

impl EventGate {
    /// A gate allowing `burst` events per pod at once, one more per `refill`.
    pub fn new(burst: u32, refill: Duration) -> Self {
        Self {
            burst: f64::from(burst.max(1)),
            refill,
            seen: HashMap::new(),
            budgets: HashMap::new(),
        }
    }

    /// Decides on the lower event `event` (its UID), seen `count` times, about `pod`.
    pub fn admit(&mut self, now: Instant, pod: &str, event: &str, count: i32) -> Verdict {
        if self.seen.get(event).is_some_and(|(seen, _)| *seen >= count) {
            return Verdict::Duplicate;
        }
        let (tokens, since) = self
            .budgets
            .entry(pod.to_owned())
            .or_insert((self.burst, now));
        let refilled = now.saturating_duration_since(*since).as_secs_f64()
            / self.refill.as_secs_f64().max(f64::EPSILON);
        *tokens = (*tokens + refilled).min(self.burst);
        *since = now;
        if *tokens < 1.0 {
            return Verdict::RateLimited;
        }
        *tokens -= 1.0;
        self.seen.insert(event.to_owned(), (count, now));
        Verdict::Publish
    }

    /// Records an event as already reflected without publishing it (one from before this
    /// process started, which the upper pod already shows or no longer needs).
    pub fn remember(&mut self, now: Instant, event: &str, count: i32) {
        let entry = self.seen.entry(event.to_owned()).or_insert((count, now));
        entry.0 = entry.0.max(count);
        entry.1 = now;
    }

    /// Forgets events not seen for `age` and pods whose budget has been full that long,
    /// so memory follows the live events.
    pub fn forget_older_than(&mut self, now: Instant, age: Duration) {
        self.seen
            .retain(|_, (_, at)| now.saturating_duration_since(*at) < age);
        self.budgets
            .retain(|_, (_, at)| now.saturating_duration_since(*at) < age);
    }

    /// How many lower events are remembered (for tests and metrics).
    pub fn remembered(&self) -> usize {
        self.seen.len()
    }
}

/// Reflections waiting to be published, oldest first, at most `capacity`: the watch adds
/// without waiting on the upper API server, and when the publisher falls behind the oldest
/// is dropped for the newest (the latest event about a pod tells its current state).
#[derive(Debug)]
pub struct PendingEvents<T> {
    queue: VecDeque<T>,
    capacity: usize,
}

impl<T> PendingEvents<T> {
    /// An empty queue holding at most `capacity` (at least one).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            queue: VecDeque::with_capacity(capacity),
            capacity,
        }
    }

    /// Adds `item` last; returns the oldest, dropped to make room, if the queue was full.
    pub fn push(&mut self, item: T) -> Option<T> {
        let dropped = if self.queue.len() >= self.capacity {
            self.queue.pop_front()
        } else {
            None
        };
        self.queue.push_back(item);
        dropped
    }

    /// Takes the oldest.
    pub fn pop(&mut self) -> Option<T> {
        self.queue.pop_front()
    }

    /// How many wait.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn event(value: serde_json::Value) -> Event {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn reflections() {
        let scheduling = event(json!({
            "metadata": {"name": "p.1", "namespace": "ns"},
            "involvedObject": {"kind": "Pod", "name": "p", "namespace": "ns"},
            "type": "Warning", "reason": "FailedScheduling",
            "message": "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector.",
            "series": {"count": 4, "lastObservedTime": "2026-01-01T00:00:05.000000Z"},
            "lastTimestamp": "2026-01-01T00:00:01Z",
        }));
        let got = reflection(&scheduling).unwrap();
        assert!(got.warning);
        assert_eq!(got.reason, "FailedScheduling");
        assert!(got.note.starts_with("0/3 nodes are available"));
        assert!(got.action.starts_with("LowerFailedScheduling-"));
        assert_eq!(occurrences(&scheduling), 4);
        assert_eq!(
            last_seen(&scheduling).unwrap().to_string(),
            "2026-01-01T00:00:05Z"
        );

        let pulled = event(json!({
            "metadata": {"name": "p.2", "namespace": "ns", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "involvedObject": {"kind": "Pod", "name": "p", "namespace": "ns", "fieldPath": "spec.containers{app}"},
            "type": "Normal", "reason": "Pulled", "message": "Container image \"nginx\" already present",
            "count": 2,
        }));
        let got = reflection(&pulled).unwrap();
        assert!(!got.warning);
        assert_eq!(got.field_path.as_deref(), Some("spec.containers{app}"));
        assert_eq!(occurrences(&pulled), 2);
        assert_eq!(
            last_seen(&pulled).unwrap().to_string(),
            "2026-01-01T00:00:00Z"
        );

        let other_message = event(json!({
            "metadata": {"name": "p.3"}, "involvedObject": {},
            "type": "Warning", "reason": "FailedScheduling", "message": "0/3 nodes: insufficient cpu",
        }));
        assert_ne!(
            reflection(&other_message).unwrap().action,
            reflection(&scheduling).unwrap().action,
            "one reason, two messages: two events"
        );
        assert_eq!(occurrences(&other_message), 1);

        let no_reason =
            event(json!({"metadata": {"name": "x"}, "involvedObject": {}, "message": "m"}));
        assert_eq!(reflection(&no_reason), None);

        let long = event(json!({
            "metadata": {"name": "x"}, "involvedObject": {}, "reason": "R", "message": "é".repeat(1000),
        }));
        let note = reflection(&long).unwrap().note;
        assert!(note.len() <= MAX_NOTE && note.chars().all(|c| c == 'é'));
    }

    #[test]
    fn the_lower_schedulers_normal_scheduled_is_not_reflected() {
        let scheduled = |type_: &str| {
            event(json!({
                "metadata": {"name": "p.2", "namespace": "ns"},
                "involvedObject": {"kind": "Pod", "name": "p", "namespace": "ns"},
                "type": type_, "reason": "Scheduled",
                "message": "Successfully assigned ns/p to lower-node-0",
            }))
        };
        assert!(reflection(&scheduled("Normal")).is_none());
        assert!(
            reflection(&scheduled("Warning")).is_some(),
            "a warning always comes up"
        );
    }

    #[test]
    fn the_gate_drops_repeats_and_limits_each_pod() {
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let mut gate = EventGate::new(3, Duration::from_secs(10));
        assert_eq!(gate.admit(at(0), "ns/a", "e1", 1), Verdict::Publish);
        assert_eq!(gate.admit(at(0), "ns/a", "e1", 1), Verdict::Duplicate);
        assert_eq!(
            gate.admit(at(0), "ns/a", "e1", 2),
            Verdict::Publish,
            "a repeat"
        );
        assert_eq!(gate.admit(at(0), "ns/a", "e2", 1), Verdict::Publish);
        assert_eq!(gate.admit(at(0), "ns/a", "e3", 1), Verdict::RateLimited);
        assert_eq!(
            gate.admit(at(0), "ns/b", "e4", 1),
            Verdict::Publish,
            "per pod"
        );
        assert_eq!(
            gate.admit(at(10), "ns/a", "e3", 1),
            Verdict::Publish,
            "refilled"
        );
        assert_eq!(gate.admit(at(10), "ns/a", "e5", 1), Verdict::RateLimited);

        gate.remember(at(10), "old", 7);
        assert_eq!(gate.admit(at(100), "ns/c", "old", 7), Verdict::Duplicate);
        assert_eq!(gate.admit(at(100), "ns/c", "old", 8), Verdict::Publish);

        gate.forget_older_than(at(200), Duration::from_secs(60));
        assert_eq!(gate.remembered(), 0);
        assert_eq!(gate.admit(at(200), "ns/a", "e9", 1), Verdict::Publish);
    }

    #[test]
    fn a_full_queue_drops_the_oldest() {
        /// Capacity, pushed, expected dropped, expected left (in order).
        type Case = (usize, &'static [u32], &'static [u32], &'static [u32]);
        let cases: &[Case] = &[
            (3, &[], &[], &[]),
            (3, &[1, 2], &[], &[1, 2]),
            (3, &[1, 2, 3], &[], &[1, 2, 3]),
            (3, &[1, 2, 3, 4], &[1], &[2, 3, 4]),
            (3, &[1, 2, 3, 4, 5, 6, 7], &[1, 2, 3, 4], &[5, 6, 7]),
            (0, &[1, 2], &[1], &[2]),
        ];
        for (capacity, pushed, dropped, left) in cases {
            let mut queue = PendingEvents::new(*capacity);
            let got: Vec<u32> = pushed.iter().filter_map(|i| queue.push(*i)).collect();
            assert_eq!(
                got, *dropped,
                "dropped, capacity {capacity}, pushed {pushed:?}"
            );
            assert_eq!(queue.len(), left.len());
            let rest: Vec<u32> = std::iter::from_fn(|| queue.pop()).collect();
            assert_eq!(rest, *left, "left, capacity {capacity}, pushed {pushed:?}");
            assert!(queue.is_empty());
        }
    }
}
