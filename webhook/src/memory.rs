//! Descheduler cooperation: which nodes each owner's pods were just moved off.
//!
//! The descheduler marks a pod it is about to evict with `unschedulable-node: <node>`
//! (an UPDATE the webhook sees), then deletes it; its owner re-creates a sibling (a CREATE).
//! Remembering (owner UID → node) for a while lets the webhook keep the sibling off that
//! node. The memory is per process: with several replicas a sibling's CREATE may reach
//! another replica, which then adds nothing — the same as the pod not having been
//! descheduled, never worse.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long a node stays remembered for an owner (tensile-kube's descheduler freezes a
/// node for 5 minutes).
pub const DEFAULT_TTL: Duration = Duration::from_secs(5 * 60);
/// Owners remembered at once; beyond it new entries are dropped (after expired ones are
/// swept), so a flood of updates cannot grow memory without bound.
pub const DEFAULT_MAX_OWNERS: usize = 100_000;

/// Owner UID → nodes its pods were descheduled from, each with an expiry.
#[derive(Debug)]
pub struct DeschedulerMemory {
    ttl: Duration,
    max_owners: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    owners: HashMap<String, HashMap<String, Instant>>,
    last_sweep: Option<Instant>,
}

impl Default for DeschedulerMemory {
    fn default() -> Self {
        Self::new(DEFAULT_TTL, DEFAULT_MAX_OWNERS)
    }
}

impl DeschedulerMemory {
    /// A memory keeping nodes for `ttl`, for at most `max_owners` owners.
    pub fn new(ttl: Duration, max_owners: usize) -> Self {
        Self {
            ttl,
            max_owners,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// Remembers that `owner`'s pods should avoid `node` until `now + ttl` (a repeat
    /// extends it). False when the memory is full.
    pub fn remember(&self, owner: &str, node: &str, now: Instant) -> bool {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let sweep_due = inner
            .last_sweep
            .is_none_or(|last| now.saturating_duration_since(last) >= self.ttl);
        if sweep_due || inner.owners.len() >= self.max_owners {
            inner.sweep(now);
        }
        if !inner.owners.contains_key(owner) && inner.owners.len() >= self.max_owners {
            return false;
        }
        inner
            .owners
            .entry(owner.to_owned())
            .or_default()
            .insert(node.to_owned(), now + self.ttl);
        true
    }

    /// The nodes `owner`'s pods should avoid at `now`, sorted.
    pub fn nodes(&self, owner: &str, now: Instant) -> Vec<String> {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(nodes) = inner.owners.get_mut(owner) else {
            return Vec::new();
        };
        nodes.retain(|_, expires| *expires > now);
        let mut live: Vec<String> = nodes.keys().cloned().collect();
        if live.is_empty() {
            inner.owners.remove(owner);
        }
        live.sort();
        live
    }

    /// Owners remembered (expired ones included until swept).
    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .owners
            .len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Inner {
    fn sweep(&mut self, now: Instant) {
        self.owners.retain(|_, nodes| {
            nodes.retain(|_, expires| *expires > now);
            !nodes.is_empty()
        });
        self.last_sweep = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_nodes_per_owner_until_they_expire() {
        let memory = DeschedulerMemory::new(Duration::from_secs(300), 10);
        let t0 = Instant::now();
        assert!(memory.remember("rs-1", "vk-b", t0));
        assert!(memory.remember("rs-1", "vk-a", t0 + Duration::from_secs(100)));
        assert!(memory.remember("rs-2", "vk-c", t0));
        assert_eq!(
            memory.nodes("rs-1", t0 + Duration::from_secs(1)),
            ["vk-a", "vk-b"]
        );
        assert_eq!(memory.nodes("rs-2", t0), ["vk-c"]);
        assert!(memory.nodes("rs-3", t0).is_empty());
        // vk-b expires at 300 s, vk-a at 400 s.
        assert_eq!(
            memory.nodes("rs-1", t0 + Duration::from_secs(300)),
            ["vk-a"]
        );
        assert!(
            memory
                .nodes("rs-1", t0 + Duration::from_secs(400))
                .is_empty()
        );
        assert!(
            memory
                .nodes("rs-2", t0 + Duration::from_secs(301))
                .is_empty()
        );
        assert!(memory.is_empty());
    }

    #[test]
    fn a_repeat_extends_the_expiry() {
        let memory = DeschedulerMemory::new(Duration::from_secs(300), 10);
        let t0 = Instant::now();
        memory.remember("rs", "vk", t0);
        memory.remember("rs", "vk", t0 + Duration::from_secs(200));
        assert_eq!(memory.nodes("rs", t0 + Duration::from_secs(450)), ["vk"]);
    }

    #[test]
    fn is_bounded_and_sweeps_expired_owners() {
        let memory = DeschedulerMemory::new(Duration::from_secs(10), 2);
        let t0 = Instant::now();
        assert!(memory.remember("a", "n", t0));
        assert!(memory.remember("b", "n", t0));
        assert!(!memory.remember("c", "n", t0), "full");
        assert!(memory.remember("a", "m", t0), "known owners still update");
        assert!(
            memory.remember("c", "n", t0 + Duration::from_secs(11)),
            "swept"
        );
        assert_eq!(memory.len(), 1);
    }
}
