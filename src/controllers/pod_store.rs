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
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;

use super::shrink::shrunk_capacity;
use crate::translate::pod::was_mirrored;
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
        let key = (pod.meta.namespace.as_ref().into(), pod.meta.name().into());
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

/// The most bytes of pod JSON a [`WholePods`] keeps: a burst queued faster than its copies
/// are made holds this much at most; the pods past it are read from the API when their
/// copy is made, as all were before. Kept as JSON (a few KB a pod, where a decoded `Pod`
/// is ~14 KB), so the bound holds several thousand pods at the peak 1024 decoded ones
/// raised it.
const WHOLE_BYTES_AT_MOST: usize = 16 << 20;

/// Upper pods kept whole, as their watch last delivered them, while their lower copy is
/// being made: the store keeps pods pruned ([`StoredPod`]), and the lower pod is made
/// from the whole upper one, which would otherwise be read again (one upper GET per pod
/// created). A pod is kept from its watch event until its lower copy is made (the pod
/// controller forgets it), appears in the lower store, or the pod no longer needs one
/// ([`wants_lower_copy`]); only pods waiting for their copy are held, never the
/// mirrored ones. Clones share the table.
#[derive(Clone, Default)]
pub struct WholePods {
    inner: Arc<Mutex<WholeTable>>,
}

#[derive(Default)]
struct WholeTable {
    pods: HashTable<WholePod>,
    hasher: RandomState,
    /// The JSON bytes the pods hold.
    bytes: usize,
}

/// One pod kept whole: its identity, and the pod as JSON (without its managedFields).
struct WholePod {
    namespace: Box<str>,
    name: Box<str>,
    uid: Option<Box<str>>,
    json: Box<[u8]>,
}

impl WholePod {
    /// `pod` as kept; `None` if it cannot be written as JSON (then read when its copy is
    /// made).
    fn new(pod: &Pod) -> Option<Self> {
        let (namespace, name) = whole_key(pod);
        // Never read for the copy, and a good part of a pod's size: written without it.
        let json = json_without_managed_fields(pod);
        Some(Self {
            namespace: namespace.into(),
            name: name.into(),
            uid: pod.metadata.uid.as_deref().map(Box::from),
            json: json.ok()?.into_boxed_slice(),
        })
    }

    fn key(&self) -> (&str, &str) {
        (&self.namespace, &self.name)
    }
}

/// `pod` as JSON, without its `managedFields`.
fn json_without_managed_fields(pod: &Pod) -> serde_json::Result<Vec<u8>> {
    if pod.metadata.managed_fields.is_some() {
        let mut pruned = pod.clone();
        pruned.metadata.managed_fields = None;
        serde_json::to_vec(&pruned)
    } else {
        serde_json::to_vec(pod)
    }
}

/// A whole pod's namespace and name, as [`WholePods`] is keyed.
fn whole_key(pod: &Pod) -> (&str, &str) {
    (
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default(),
    )
}

/// Whether the upper pod `pod` may yet need a lower copy made from it: not being deleted,
/// not finished, and not shown as having run below ([`was_mirrored`]). Pure.
pub fn wants_lower_copy(pod: &Pod) -> bool {
    let finished = matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    );
    pod.metadata.deletion_timestamp.is_none() && !finished && !was_mirrored(pod)
}

impl WholeTable {
    fn find(&self, namespace: &str, name: &str) -> Option<&WholePod> {
        let hash = self.hasher.hash_one((namespace, name));
        self.pods.find(hash, |p| p.key() == (namespace, name))
    }

    fn remove(&mut self, namespace: &str, name: &str) {
        let hash = self.hasher.hash_one((namespace, name));
        if let Ok(entry) = self.pods.find_entry(hash, |p| p.key() == (namespace, name)) {
            let (removed, _) = entry.remove();
            self.bytes -= removed.json.len();
        }
        self.shrink();
    }

    fn shrink(&mut self) {
        if let Some(to) = shrunk_capacity(self.pods.capacity(), self.pods.len(), KEEP) {
            let hasher = &self.hasher;
            self.pods.shrink_to(to, |p| hasher.hash_one(p.key()));
        }
    }

    /// Keeps `pod` in place of its earlier version; a new one only while the pods kept
    /// and it hold at most `at_most` bytes.
    fn insert(&mut self, pod: &Pod, at_most: usize) {
        let (namespace, name) = whole_key(pod);
        let Some(kept) = WholePod::new(pod) else {
            self.remove(namespace, name);
            return;
        };
        let hash = self.hasher.hash_one((namespace, name));
        let hasher = &self.hasher;
        match self.pods.entry(
            hash,
            |p| p.key() == (namespace, name),
            |p| hasher.hash_one(p.key()),
        ) {
            hashbrown::hash_table::Entry::Occupied(mut entry) => {
                self.bytes = self.bytes - entry.get().json.len() + kept.json.len();
                *entry.get_mut() = kept;
            }
            hashbrown::hash_table::Entry::Vacant(entry)
                if self.bytes + kept.json.len() <= at_most =>
            {
                self.bytes += kept.json.len();
                entry.insert(kept);
            }
            hashbrown::hash_table::Entry::Vacant(_) => {}
        }
    }
}

impl WholePods {
    fn lock(&self) -> std::sync::MutexGuard<'_, WholeTable> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes in the upper pod `pod` as its watch delivered it: kept whole while it
    /// [`wants_lower_copy`] and `lower` (the lower store) holds no pod of its name,
    /// forgotten otherwise. Judged and kept under the table's lock, which
    /// [`WholePods::forget`] takes after the lower store took the copy in, so a pod is never
    /// kept after its copy was seen.
    pub fn offer(&self, pod: &Pod, lower: &PodStore) {
        let (namespace, name) = whole_key(pod);
        let mut table = self.lock();
        if wants_lower_copy(pod) && lower.get(namespace, name).is_none() {
            table.insert(pod, WHOLE_BYTES_AT_MOST);
        } else if !table.pods.is_empty() {
            table.remove(namespace, name);
        }
    }

    /// Forgets the pod `namespace/name`: its copy is made, or it is gone.
    pub fn forget(&self, namespace: &str, name: &str) {
        let mut table = self.lock();
        if !table.pods.is_empty() {
            table.remove(namespace, name);
        }
    }

    /// The whole pod `namespace/name` of UID `uid`, if kept (decoded from its JSON).
    pub fn get(&self, namespace: &str, name: &str, uid: Option<&str>) -> Option<Pod> {
        let table = self.lock();
        let kept = table
            .find(namespace, name)
            .filter(|p| uid.is_some() && p.uid.as_deref() == uid)?;
        serde_json::from_slice(&kept.json).ok()
    }

    /// Keeps only the pods `store` (the upper store, after a relist) still holds.
    pub fn retain_stored(&self, store: &PodStore) {
        let mut table = self.lock();
        if table.pods.is_empty() {
            return;
        }
        let mut dropped = 0;
        table.pods.retain(|p| {
            let stored = store.get(&p.namespace, &p.name).is_some();
            if !stored {
                dropped += p.json.len();
            }
            stored
        });
        table.bytes -= dropped;
        table.shrink();
    }

    /// How many pods it keeps.
    pub fn len(&self) -> usize {
        self.lock().pods.len()
    }

    /// Whether it keeps none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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
    (&pod.meta.namespace, pod.meta.name())
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
                let uid = p.meta.uid().map(|uid| uid.to_string());
                (ns.to_owned(), name.to_owned(), uid.unwrap_or_default())
            })
            .collect();
        pods.sort();
        pods
    }

    /// A whole upper pod is kept only while it waits for its lower copy, and always in its
    /// latest version.
    #[test]
    fn whole_pods_are_kept_only_until_their_copy_is_made() {
        use serde_json::json;
        let whole_pod = |uid: &str, extra: serde_json::Value| -> Pod {
            let mut pod = json!({
                "metadata": {"namespace": "ns", "name": "p", "uid": uid},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            });
            if let (Some(p), Some(e)) = (pod.as_object_mut(), extra.as_object()) {
                for (k, v) in e {
                    match (p.get_mut(k).and_then(|x| x.as_object_mut()), v.as_object()) {
                        (Some(into), Some(v)) => into.extend(v.clone()),
                        _ => {
                            p.insert(k.clone(), v.clone());
                        }
                    }
                }
            }
            serde_json::from_value(pod).unwrap()
        };
        // (case, pod offered, lower copy stored, kept)
        let cases = [
            ("new pod", whole_pod("u1", json!({})), false, true),
            (
                "its copy is stored",
                whole_pod("u1", json!({})),
                true,
                false,
            ),
            (
                "being deleted",
                whole_pod(
                    "u1",
                    json!({"metadata": {"deletionTimestamp": "2026-01-01T00:00:00Z"}}),
                ),
                false,
                false,
            ),
            (
                "finished",
                whole_pod("u1", json!({"status": {"phase": "Succeeded"}})),
                false,
                false,
            ),
            (
                "ran below",
                whole_pod(
                    "u1",
                    json!({"status": {"phase": "Running", "startTime": "2026-01-01T00:00:00Z"}}),
                ),
                false,
                false,
            ),
            (
                "pending with a reason of ours",
                whole_pod(
                    "u1",
                    json!({"status": {"phase": "Pending", "reason": "MissingDependency"}}),
                ),
                false,
                true,
            ),
        ];
        for (case, offered, copy, kept) in cases {
            let (whole, lower) = (WholePods::default(), PodStore::default());
            if copy {
                lower.apply(Arc::new(pod("ns", "p", "l1")));
            }
            // Kept before: an offer that does not keep forgets the earlier version.
            whole.offer(&whole_pod("u1", json!({})), &PodStore::default());
            whole.offer(&offered, &lower);
            assert_eq!(whole.get("ns", "p", Some("u1")).is_some(), kept, "{case}");
            assert_eq!(whole.len(), usize::from(kept), "{case}: nothing else kept");
        }
        let (whole, lower) = (WholePods::default(), PodStore::default());
        whole.offer(&whole_pod("u1", json!({})), &lower);
        assert!(whole.get("ns", "p", Some("u2")).is_none(), "another UID");
        assert!(whole.get("ns", "p", None).is_none(), "no UID");
        assert!(
            whole.get("other", "p", Some("u1")).is_none(),
            "another namespace"
        );
        whole.forget("ns", "p");
        assert!(whole.is_empty(), "forgotten once its copy is made");
    }

    #[test]
    fn whole_pods_are_kept_up_to_a_bound_without_managed_fields() {
        let mut table = WholeTable::default();
        let pod = |name: &str| {
            let mut pod = Pod::default();
            pod.metadata.namespace = Some("ns".into());
            pod.metadata.name = Some(name.into());
            pod.metadata.managed_fields = Some(vec![Default::default()]);
            pod
        };
        let one = WholePod::new(&pod("a")).unwrap().json.len();
        let bound = 2 * one + one / 2;
        for name in ["a", "b", "c"] {
            table.insert(&pod(name), bound);
        }
        assert_eq!(table.pods.len(), 2, "no third pod");
        assert_eq!(table.bytes, 2 * one, "the bytes kept");
        assert!(table.find("ns", "c").is_none());
        let mut newer = pod("a");
        newer.metadata.uid = Some("u2".into());
        table.insert(&newer, bound);
        let kept = table.find("ns", "a").unwrap();
        assert_eq!(
            kept.uid.as_deref(),
            Some("u2"),
            "a newer version, at the bound"
        );
        let decoded: Pod = serde_json::from_slice(&kept.json).unwrap();
        assert_eq!(decoded.metadata.managed_fields, None);
        assert_eq!(decoded.metadata.uid.as_deref(), Some("u2"));
        table.remove("ns", "a");
        table.remove("ns", "b");
        assert_eq!((table.pods.len(), table.bytes), (0, 0), "nothing left");
    }

    #[test]
    fn a_departed_pod_is_taken_once() {
        let departed = Departed::default();
        departed.keep(Arc::new(pod("ns", "a", "u1")));
        departed.keep(Arc::new(pod("ns", "a", "u2")));
        departed.keep(Arc::new(pod("ns", "b", "u3")));
        let uid =
            |p: Option<Arc<StoredPod>>| p.and_then(|p| p.meta.uid().map(|uid| uid.to_string()));
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
