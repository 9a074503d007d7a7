//! The pod stores: every upper pod bound to this node, or every lower pod it owns, by
//! namespace and name. In place of kube-runtime's reflector store, which keeps a second
//! copy of each object it is handed and a key of four copied strings (name, namespace,
//! UID, resourceVersion) beside it, where this table keeps one pointer, to the same
//! [`StoredPod`] the controllers are handed. Fed by watch events. A relisted pod is stored
//! as it is listed, so that a controller handed it finds it; the pods the relist did not
//! list leave once it completes.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use hashbrown::HashTable;
use kube::runtime::watcher;

use super::shrink::shrunk_capacity;
use crate::translate::stored::StoredPod;

/// Below this many slots a table is never shrunk: not worth rebuilding.
const KEEP: usize = 1024;

/// How long a [`Departed`] pod is kept for a step that never comes (its upper pod gone
/// meanwhile).
const DEPARTED_FOR: Duration = Duration::from_secs(120);

/// The last version of each lower pod deleted while its upper pod was being deleted: the
/// final status the pod controller writes upstairs before it finishes the deletion (as a
/// kubelet does), which the status reflector, keyed by the lower pods in the store, can no
/// longer write. Each is taken once; one never taken is dropped after [`DEPARTED_FOR`].
/// Clones share the table.
#[derive(Clone, Default)]
pub struct Departed {
    pods: Arc<Mutex<DepartedPods>>,
}

/// Each departed pod by namespace and name, with when it was kept.
type DepartedPods = HashMap<(Box<str>, Box<str>), (Instant, Arc<StoredPod>)>;

impl Departed {
    fn lock(&self) -> std::sync::MutexGuard<'_, DepartedPods> {
        self.pods.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `pod`, just deleted, in place of any earlier one of its namespace and name.
    pub fn keep(&self, pod: Arc<StoredPod>) {
        let now = Instant::now();
        let mut pods = self.lock();
        pods.retain(|_, (since, _)| now.duration_since(*since) < DEPARTED_FOR);
        let key = (pod.meta.namespace.clone(), pod.meta.name.clone());
        pods.insert(key, (now, pod));
        if let Some(to) = shrunk_capacity(pods.capacity(), pods.len(), KEEP) {
            pods.shrink_to(to);
        }
    }

    /// The lower pod of `namespace/name` kept since its deletion, once.
    pub fn take(&self, namespace: &str, name: &str) -> Option<Arc<StoredPod>> {
        let key: (Box<str>, Box<str>) = (namespace.into(), name.into());
        self.lock().remove(&key).map(|(_, pod)| pod)
    }
}

/// Pods by namespace and name; clones share the table.
#[derive(Clone, Default)]
pub struct PodStore {
    inner: Arc<RwLock<Table>>,
}

#[derive(Default)]
struct Table {
    pods: HashTable<Arc<StoredPod>>,
    hasher: RandomState,
}

/// A pod's namespace and name, as the table is keyed.
fn key(pod: &StoredPod) -> (&str, &str) {
    (&pod.meta.namespace, &pod.meta.name)
}

impl Table {
    fn hash(&self, namespace: &str, name: &str) -> u64 {
        self.hasher.hash_one((namespace, name))
    }

    /// How the table rehashes a pod it holds (when it grows or shrinks).
    fn rehash(hasher: &RandomState) -> impl Fn(&Arc<StoredPod>) -> u64 + '_ {
        |pod| hasher.hash_one(key(pod))
    }

    fn get(&self, namespace: &str, name: &str) -> Option<&Arc<StoredPod>> {
        let hash = self.hash(namespace, name);
        self.pods.find(hash, |p| key(p) == (namespace, name))
    }

    /// Stores `pod`; the one of its namespace and name it replaced, if any.
    fn insert(&mut self, pod: Arc<StoredPod>) -> Option<Arc<StoredPod>> {
        let (namespace, name) = key(&pod);
        let hash = self.hash(namespace, name);
        match self.pods.entry(
            hash,
            |p| key(p) == (namespace, name),
            Self::rehash(&self.hasher),
        ) {
            hashbrown::hash_table::Entry::Occupied(mut entry) => {
                Some(std::mem::replace(entry.get_mut(), pod))
            }
            hashbrown::hash_table::Entry::Vacant(entry) => {
                entry.insert(pod);
                None
            }
        }
    }

    fn remove(&mut self, namespace: &str, name: &str) {
        let hash = self.hash(namespace, name);
        if let Ok(entry) = self.pods.find_entry(hash, |p| key(p) == (namespace, name)) {
            entry.remove();
        }
        // Hand back what a mass deletion left.
        if let Some(to) = shrunk_capacity(self.pods.capacity(), self.pods.len(), KEEP) {
            self.pods.shrink_to(to, Self::rehash(&self.hasher));
        }
    }
}

impl PodStore {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Table> {
        // No code panics while holding the lock; a poisoned table is still consistent.
        self.inner.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Table> {
        self.inner.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// The pod `namespace/name`.
    pub fn get(&self, namespace: &str, name: &str) -> Option<Arc<StoredPod>> {
        self.read().get(namespace, name).cloned()
    }

    /// Every pod (a snapshot).
    pub fn state(&self) -> Vec<Arc<StoredPod>> {
        self.read().pods.iter().cloned().collect()
    }

    /// How many pods.
    pub fn len(&self) -> usize {
        self.read().pods.len()
    }

    /// The heap bytes it holds, its pods included: for `tensile_memory_bytes`.
    pub fn heap_bytes(&self) -> usize {
        let table = self.read();
        let slots = table.pods.capacity() * (size_of::<Arc<StoredPod>>() + 1);
        slots + table.pods.iter().map(|pod| pod.heap_bytes()).sum::<usize>()
    }

    /// Whether it holds no pod.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stores `pod` in place of an earlier one of its namespace and name, which it
    /// answers.
    pub fn apply(&self, pod: Arc<StoredPod>) -> Option<Arc<StoredPod>> {
        self.write().insert(pod)
    }

    /// Forgets `pod`'s namespace and name.
    pub fn delete(&self, pod: &StoredPod) {
        let (namespace, name) = key(pod);
        self.write().remove(namespace, name);
    }

    /// Replaces every pod with `pods` (a completed relist).
    fn replace(&self, pods: Vec<Arc<StoredPod>>) {
        let mut table = Table {
            pods: HashTable::with_capacity(pods.len()),
            hasher: RandomState::new(),
        };
        for pod in pods {
            table.insert(pod);
        }
        *self.write() = table;
    }
}

/// A pod a watch event touched, as stored.
pub struct Touched {
    pub pod: Arc<StoredPod>,
    /// It replaced a stored version that differs from it in its status at most
    /// ([`StoredPod::same_but_status`]).
    pub status_only: bool,
}

/// Applies one watch event to a [`PodStore`]; answers the pod the event touched.
#[derive(Default)]
pub struct Writer {
    store: PodStore,
    /// The pods a relist under way has listed so far.
    relist: Option<Vec<Arc<StoredPod>>>,
}

impl Writer {
    /// A writer of `store`.
    pub fn new(store: PodStore) -> Self {
        Self {
            store,
            relist: None,
        }
    }

    /// Applies `event`; the pod it touched, if any (a relisted pod is touched when listed).
    pub fn apply(&mut self, event: watcher::Event<StoredPod>) -> Option<Touched> {
        let touched = |pod| Touched {
            pod,
            status_only: false,
        };
        match event {
            watcher::Event::Apply(pod) => {
                let pod = Arc::new(pod);
                let replaced = self.store.apply(pod.clone());
                let status_only = replaced.is_some_and(|old| old.same_but_status(&pod));
                Some(Touched { pod, status_only })
            }
            watcher::Event::Delete(pod) => {
                self.store.delete(&pod);
                Some(touched(Arc::new(pod)))
            }
            watcher::Event::Init => {
                self.relist = Some(Vec::new());
                None
            }
            watcher::Event::InitApply(pod) => {
                let pod = Arc::new(pod);
                self.store.apply(pod.clone());
                self.relist.get_or_insert_default().push(pod.clone());
                Some(touched(pod))
            }
            watcher::Event::InitDone => {
                self.store.replace(self.relist.take().unwrap_or_default());
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Pod;

    use super::*;

    /// A pod; `uid` tells one of a name from another.
    fn pod(namespace: &str, name: &str, uid: &str) -> StoredPod {
        let mut pod = Pod::default();
        pod.metadata.namespace = Some(namespace.into());
        pod.metadata.name = Some(name.into());
        pod.metadata.uid = Some(uid.into());
        StoredPod::from(pod)
    }

    fn contents(store: &PodStore) -> Vec<(String, String, String)> {
        let mut pods: Vec<_> = store
            .state()
            .iter()
            .map(|p| {
                let (ns, name) = key(p);
                let uid = p.meta.uid.as_deref().unwrap_or_default();
                (ns.to_owned(), name.to_owned(), uid.to_owned())
            })
            .collect();
        pods.sort();
        pods
    }

    #[test]
    fn a_departed_pod_is_taken_once() {
        let departed = Departed::default();
        departed.keep(Arc::new(pod("ns", "a", "u1")));
        departed.keep(Arc::new(pod("ns", "a", "u2")));
        departed.keep(Arc::new(pod("ns", "b", "u3")));
        let uid =
            |p: Option<Arc<StoredPod>>| p.and_then(|p| p.meta.uid.as_deref().map(str::to_owned));
        assert_eq!(
            uid(departed.take("ns", "a")).as_deref(),
            Some("u2"),
            "the latest"
        );
        assert_eq!(uid(departed.take("ns", "a")), None, "once");
        assert_eq!(
            uid(departed.take("other", "b")),
            None,
            "by namespace and name"
        );
        assert_eq!(uid(departed.take("ns", "b")).as_deref(), Some("u3"));
    }

    #[test]
    fn events_update_the_store_as_a_reflector_would() {
        use watcher::Event::{Apply, Delete, Init, InitApply, InitDone};
        type Case = (
            &'static str,
            Vec<watcher::Event<StoredPod>>,
            Vec<(&'static str, &'static str, &'static str)>,
        );
        let cases: Vec<Case> = vec![
            (
                "applies, by namespace and name",
                vec![
                    Apply(pod("a", "p", "1")),
                    Apply(pod("b", "p", "1")),
                    Apply(pod("a", "p", "2")),
                ],
                vec![("a", "p", "2"), ("b", "p", "1")],
            ),
            (
                "deletes",
                vec![
                    Apply(pod("a", "p", "1")),
                    Apply(pod("a", "q", "1")),
                    Delete(pod("a", "p", "2")),
                ],
                vec![("a", "q", "1")],
            ),
            (
                "a relist replaces the pods once complete",
                vec![
                    Apply(pod("a", "gone", "1")),
                    Init,
                    InitApply(pod("a", "kept", "3")),
                    InitDone,
                ],
                vec![("a", "kept", "3")],
            ),
        ];
        for (name, events, want) in cases {
            let store = PodStore::default();
            let mut writer = Writer::new(store.clone());
            for event in events {
                writer.apply(event);
            }
            let want: Vec<_> = want
                .into_iter()
                .map(|(a, b, c)| (a.to_owned(), b.to_owned(), c.to_owned()))
                .collect();
            assert_eq!(contents(&store), want, "{name}");
        }
    }

    /// A controller handed a pod the relist listed finds it in the store (at start, the
    /// first list is a relist of an empty store); what the relist did not list stays
    /// until the relist completes.
    #[test]
    fn a_pod_relisted_is_found_at_once() {
        let store = PodStore::default();
        let mut writer = Writer::new(store.clone());
        writer.apply(watcher::Event::Apply(pod("a", "old", "1")));
        writer.apply(watcher::Event::Init);
        let touched = writer.apply(watcher::Event::InitApply(pod("a", "new", "2")));
        let stored = store
            .get("a", "new")
            .expect("found while the relist goes on");
        assert!(Arc::ptr_eq(&stored, &touched.unwrap().pod));
        assert!(store.get("a", "old").is_some());
        writer.apply(watcher::Event::InitDone);
        assert!(store.get("a", "old").is_none());
    }

    #[test]
    fn the_pod_handed_on_is_the_one_stored() {
        let store = PodStore::default();
        let mut writer = Writer::new(store.clone());
        let touched = writer
            .apply(watcher::Event::Apply(pod("a", "p", "1")))
            .unwrap();
        assert!(Arc::ptr_eq(&touched.pod, &store.get("a", "p").unwrap()));
    }

    #[test]
    fn a_replacement_says_whether_only_the_status_changed() {
        let mut writer = Writer::new(PodStore::default());
        let mut apply = |pod: StoredPod| writer.apply(watcher::Event::Apply(pod)).unwrap();
        assert!(!apply(pod("a", "p", "1")).status_only, "nothing replaced");
        assert!(apply(pod("a", "p", "1")).status_only, "the same again");
        assert!(!apply(pod("a", "p", "2")).status_only, "another UID");
    }

    #[test]
    fn a_mass_deletion_hands_the_table_back() {
        let store = PodStore::default();
        let mut writer = Writer::new(store.clone());
        for i in 0..10_000 {
            writer.apply(watcher::Event::Apply(pod("a", &format!("p{i}"), "1")));
        }
        let full = store.read().pods.capacity();
        for i in 0..9_990 {
            writer.apply(watcher::Event::Delete(pod("a", &format!("p{i}"), "1")));
        }
        assert_eq!(store.len(), 10);
        let after = store.read().pods.capacity();
        assert!(
            after <= 1024,
            "{after} slots after deleting down from {full}"
        );
    }
}
