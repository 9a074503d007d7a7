//! Lower objects recently seen to exist, so that creating many pods that share one
//! ConfigMap does not read it each time. Imports nothing from the controllers: the shared
//! `Context` holds it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a lower object seen to exist is trusted without reading it again.
const PRESENCE_TTL: Duration = Duration::from_secs(30);
/// Past this many entries, expired ones are dropped on insert.
const PRUNE_ABOVE: usize = 10_000;

/// Lower objects recently seen to exist, by `kind/namespace/name`.
#[derive(Default)]
pub struct PresenceCache(Mutex<HashMap<String, Instant>>);

impl PresenceCache {
    /// Whether `key` was seen to exist less than [`PRESENCE_TTL`] ago.
    pub(crate) fn contains(&self, key: &str) -> bool {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.get(key)
            .is_some_and(|seen| seen.elapsed() < PRESENCE_TTL)
    }

    /// Drops `kind/namespace/name`, so the next pod needing it checks the lower cluster
    /// again (called when tensile deletes a lower copy).
    pub(crate) fn forget(&self, kind: &str, namespace: &str, name: &str) {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(&format!("{kind}/{namespace}/{name}"));
    }

    /// Records that `key` exists now.
    pub(crate) fn insert(&self, key: String) {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() > PRUNE_ABOVE {
            map.retain(|_, seen| seen.elapsed() < PRESENCE_TTL);
        }
        map.insert(key, Instant::now());
    }
}
