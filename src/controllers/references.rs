//! What each pod of this node references (ConfigMaps, Secrets, …), kept apart from the
//! pod stores, which may keep only what the pod controller needs. Imports nothing from the
//! controllers but the [`super::shrink`] rule: the shared `Context` holds it.

use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};

use hashbrown::HashTable;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use super::shrink::shrunk_capacity;
use crate::translate::config::{Reference, referenced};

/// Below this many slots a namespace's table is never shrunk: not worth rebuilding.
const KEEP: usize = 1024;

/// What each pod references, by pod `namespace/name`: recorded from the full pod when its
/// dependencies are ensured (and from lower pods listed when unknown, e.g. after a
/// restart), because the pod stores may keep only what the pod controller needs.
/// A pod's references cannot change (volumes and env are immutable). The pods of a
/// namespace mostly reference the same few objects, so equal lists are kept once.
#[derive(Default)]
pub struct References(Mutex<ByNamespace>);

/// Each namespace's pods and their references.
type ByNamespace = HashMap<String, Namespace>;

/// The pods of one namespace and their references: per pod, 12 bytes in a table and its
/// name in one buffer shared by all (where a map of names to lists takes a 32-byte slot
/// and an allocation for the name).
#[derive(Default)]
struct Namespace {
    pods: HashTable<Recorded>,
    /// The recorded pods' names, one after the other.
    names: String,
    /// The distinct lists the pods reference (`None`: a free place), each with how many
    /// pods reference it.
    lists: Vec<Option<(Arc<[Reference]>, usize)>>,
    /// The free places in `lists` (a pod of its own list each, a StatefulSet's claims,
    /// must not cost a scan of every list).
    free: Vec<u32>,
    /// Where each list is in `lists`.
    list_at: HashMap<Arc<[Reference]>, u32>,
    hasher: RandomState,
}

/// One recorded pod: its name (`names[at..at + len]`) and the place of its list in
/// `lists`.
#[derive(Clone, Copy, Debug)]
struct Recorded {
    at: u32,
    len: u32,
    list: u32,
}

impl Namespace {
    fn name<'a>(names: &'a str, pod: &Recorded) -> &'a str {
        names
            .get(pod.at as usize..(pod.at as usize).saturating_add(pod.len as usize))
            .unwrap_or_default()
    }

    /// Records that pod `name` references `found`.
    fn record(&mut self, name: &str, found: Vec<Reference>) {
        let Some(list) = self.list(found) else {
            return;
        };
        let hash = self.hasher.hash_one(name);
        let Self {
            pods,
            names,
            hasher,
            ..
        } = self;
        if let Some(pod) = pods.find_mut(hash, |p| Self::name(names, p) == name) {
            let before = std::mem::replace(&mut pod.list, list);
            self.release(before);
            return;
        }
        let (Ok(at), Ok(len)) = (u32::try_from(names.len()), u32::try_from(name.len())) else {
            // Four GiB of names: left unrecorded (read as unknown).
            self.release(list);
            return;
        };
        names.push_str(name);
        let rehash = |p: &Recorded| hasher.hash_one(Self::name(names, p));
        pods.insert_unique(hash, Recorded { at, len, list }, rehash);
    }

    /// The place of `found` in `lists`, counting one more pod referencing it.
    fn list(&mut self, found: Vec<Reference>) -> Option<u32> {
        if let Some(&at) = self.list_at.get(found.as_slice()) {
            if let Some(Some((_, pods))) = self.lists.get_mut(at as usize) {
                *pods += 1;
            }
            return Some(at);
        }
        let list: Arc<[Reference]> = found.into();
        let at = match self.free.pop() {
            Some(free) => free,
            None => {
                let at = u32::try_from(self.lists.len()).ok()?;
                self.lists.push(None);
                at
            }
        };
        let place = self.lists.get_mut(at as usize)?;
        *place = Some((list.clone(), 1));
        self.list_at.insert(list, at);
        Some(at)
    }

    /// One pod fewer references the list at `at`: forgotten once none does.
    fn release(&mut self, at: u32) {
        let Some(place) = self.lists.get_mut(at as usize) else {
            return;
        };
        if let Some((list, pods)) = place {
            *pods -= 1;
            if *pods == 0 {
                self.list_at.remove(list);
                *place = None;
                self.free.push(at);
            }
        }
    }

    /// The lists the pods reference.
    fn lists(&self) -> impl Iterator<Item = &Arc<[Reference]>> {
        self.lists.iter().flatten().map(|(list, _)| list)
    }

    /// Whether pod `name` is recorded.
    fn has(&self, name: &str) -> bool {
        let hash = self.hasher.hash_one(name);
        self.pods
            .find(hash, |p| Self::name(&self.names, p) == name)
            .is_some()
    }

    /// Forgets the pods `is_present` does not answer for.
    fn retain(&mut self, is_present: impl Fn(&str) -> bool) {
        let mut released = Vec::new();
        let names = &self.names;
        self.pods.retain(|p| {
            let keep = is_present(Self::name(names, p));
            if !keep {
                released.push(p.list);
            }
            keep
        });
        for list in released {
            self.release(list);
        }
        if self.pods.is_empty() {
            *self = Self::default();
            return;
        }
        // Write the names left again, without the departed ones'.
        let live: usize = self.pods.iter().map(|p| p.len as usize).sum();
        if live < self.names.len() {
            let mut names = String::with_capacity(live);
            for pod in self.pods.iter_mut() {
                let name = Self::name(&self.names, pod);
                // Within `live` bytes, which fit a u32 as `names` did.
                pod.at = u32::try_from(names.len()).unwrap_or(u32::MAX);
                names.push_str(name);
            }
            self.names = names;
        } else if self.names.capacity() > 2 * self.names.len() {
            // Room a burst left.
            self.names.shrink_to_fit();
        }
        if let Some(to) = shrunk_capacity(self.pods.capacity(), self.pods.len(), KEEP) {
            let (names, hasher) = (&self.names, &self.hasher);
            self.pods
                .shrink_to(to, |p| hasher.hash_one(Self::name(names, p)));
        }
    }
}

impl References {
    /// Records what `pod` (a full pod) references.
    pub(crate) fn record(&self, pod: &Pod, with_service_account: bool) {
        let (Some(namespace), Some(name)) = (pod.namespace(), pod.metadata.name.as_deref()) else {
            return;
        };
        let found: Vec<Reference> = referenced(std::iter::once(pod), with_service_account)
            .into_iter()
            .collect();
        self.lock()
            .entry(namespace)
            .or_default()
            .record(name, found);
    }

    /// Whether a pod recorded in `reference`'s namespace references it: one recorded since
    /// the last [`References::resolve`] too (and one gone since, until that forgets it).
    pub(crate) fn references(&self, reference: &Reference) -> bool {
        self.lock().get(&reference.1).is_some_and(|known| {
            known
                .lists()
                .any(|list| list.iter().any(|r| r == reference))
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ByNamespace> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What the present pods reference as far as known, and the namespaces holding a
    /// pod whose references are unknown. Forgets pods no longer present. `pods` lists the
    /// present pods (`namespace`, `name`), `is_present` answers for one; neither builds a
    /// copy of ten thousand names.
    pub(crate) fn resolve<'a>(
        &self,
        pods: impl Iterator<Item = (&'a str, &'a str)>,
        is_present: impl Fn(&str, &str) -> bool,
    ) -> (BTreeSet<Reference>, BTreeSet<String>) {
        let mut map = self.lock();
        map.retain(|namespace, known| {
            known.retain(|name| is_present(namespace, name));
            !known.pods.is_empty()
        });
        let known = map
            .values()
            .flat_map(Namespace::lists)
            .flat_map(|list| list.iter())
            .cloned()
            .collect();
        let mut unknown = BTreeSet::new();
        for (namespace, name) in pods {
            if !unknown.contains(namespace)
                && !map.get(namespace).is_some_and(|known| known.has(name))
            {
                unknown.insert(namespace.to_owned());
            }
        }
        (known, unknown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::translate::deps::DependencyKind;
    use serde_json::json;

    fn pod(namespace: &str, name: &str, config_map: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"containers": [{"name": "c"}],
                     "volumes": [{"name": "v", "configMap": {"name": config_map}}]},
        }))
        .unwrap()
    }

    #[test]
    fn references_survive_pruned_stores_and_forget_departed_pods() {
        let references = References::default();
        references.record(&pod("a", "p1", "settings"), true);
        references.record(&pod("a", "p2", "other"), true);
        let resolve = |present: &[(&'static str, &'static str)]| {
            references.resolve(present.iter().copied(), |ns, name| {
                present.contains(&(ns, name))
            })
        };
        let (known, unknown) = resolve(&[("a", "p1"), ("b", "unknown")]);
        assert_eq!(
            known,
            [(
                DependencyKind::ConfigMap,
                "a".to_owned(),
                "settings".to_owned()
            )]
            .into()
        );
        assert_eq!(unknown, ["b".to_owned()].into(), "nothing goes there yet");
        // p2 was not present: forgotten, so once listed again its references are unknown.
        let (known, unknown) = resolve(&[("a", "p1"), ("a", "p2")]);
        assert_eq!(
            unknown,
            ["a".to_owned()].into(),
            "p2's references are unknown now"
        );
        assert_eq!(known.len(), 1);
        assert!(known.iter().all(|(_, _, name)| name == "settings"));
    }

    #[test]
    fn what_a_recorded_pod_references_is_known_by_name() {
        let references = References::default();
        references.record(&pod("a", "p1", "settings"), true);
        let config_map = |namespace: &str, name: &str| {
            (
                DependencyKind::ConfigMap,
                namespace.to_owned(),
                name.to_owned(),
            )
        };
        // (case, reference, referenced)
        let cases = [
            ("the pod's ConfigMap", config_map("a", "settings"), true),
            ("another name", config_map("a", "other"), false),
            ("another namespace", config_map("b", "settings"), false),
            (
                "a Secret of that name",
                (
                    DependencyKind::Secret,
                    "a".to_owned(),
                    "settings".to_owned(),
                ),
                false,
            ),
        ];
        for (name, reference, want) in cases {
            assert_eq!(references.references(&reference), want, "{name}");
        }
        // Once the pod is gone, its references are forgotten.
        references.resolve(std::iter::empty(), |_, _| false);
        assert!(!references.references(&config_map("a", "settings")));
    }

    #[test]
    fn equal_lists_are_kept_once_and_dropped_with_their_pods() {
        let references = References::default();
        for name in ["p1", "p2", "p3"] {
            references.record(&pod("a", name, "settings"), true);
        }
        references.record(&pod("a", "p4", "other"), true);
        let lists = |references: &References| -> Vec<usize> {
            let map = references.lock();
            let known = &map["a"];
            let mut counts: Vec<usize> = known.lists.iter().flatten().map(|(_, n)| *n).collect();
            counts.sort_unstable();
            counts
        };
        assert_eq!(
            lists(&references),
            [1, 3],
            "one list for p1..p3, one for p4"
        );
        let present = [("a", "p1"), ("a", "p2")];
        let (known, unknown) = references.resolve(present.iter().copied(), |ns, name| {
            present.contains(&(ns, name))
        });
        assert_eq!(lists(&references), [2], "p4's list went with p4");
        assert!(unknown.is_empty());
        assert!(known.iter().all(|(_, _, name)| name == "settings"));
        let (known, _) = references.resolve(std::iter::empty(), |_, _| false);
        assert!(known.is_empty());
        assert!(
            references.lock().is_empty(),
            "no pods left, no namespace kept"
        );
    }

    #[test]
    fn names_are_kept_in_one_buffer_that_forgets_departed_pods() {
        let references = References::default();
        let names: Vec<String> = (0..50).map(|i| format!("p-{i:05}")).collect();
        for (i, name) in names.iter().enumerate() {
            let config_map = if i % 2 == 0 { "even" } else { "odd" };
            references.record(&pod("a", name, config_map), true);
        }
        // Recorded again with another list: still one entry, its old list released.
        references.record(&pod("a", "p-00000", "odd"), true);
        let state = |references: &References| {
            let map = references.lock();
            let known = &map["a"];
            let mut counts: Vec<usize> = known.lists.iter().flatten().map(|(_, n)| *n).collect();
            counts.sort_unstable();
            (known.pods.len(), known.names.len(), counts)
        };
        assert_eq!(state(&references), (50, 50 * 7, vec![24, 26]));
        // (case, present pods, entries left, names' bytes left)
        type Case = (&'static str, fn(usize) -> bool, usize);
        let cases: [Case; 3] = [
            ("all present", |_| true, 50),
            ("every third present", |i| i % 3 == 0, 17),
            ("one left", |i| i == 3, 1),
        ];
        for (case, present, left) in cases {
            let present: Vec<(&str, &str)> = names
                .iter()
                .enumerate()
                .filter(|(i, _)| present(*i))
                .map(|(_, n)| ("a", n.as_str()))
                .collect();
            let (_, unknown) = references.resolve(present.iter().copied(), |ns, name| {
                present.contains(&(ns, name))
            });
            assert!(unknown.is_empty(), "{case}: every present pod is known");
            let (pods, bytes, counts) = state(&references);
            assert_eq!((pods, bytes), (left, left * 7), "{case}");
            assert_eq!(counts.iter().sum::<usize>(), left, "{case}");
            let map = references.lock();
            for (_, name) in &present {
                assert!(map["a"].has(name), "{case}: {name}");
            }
        }
        // p-00003 references "odd"; the even list went with its last pod.
        assert!(references.references(&(
            crate::translate::deps::DependencyKind::ConfigMap,
            "a".to_owned(),
            "odd".to_owned()
        )));
        assert!(!references.references(&(
            crate::translate::deps::DependencyKind::ConfigMap,
            "a".to_owned(),
            "even".to_owned()
        )));
        // A pod recorded after the names were written again is found too.
        references.record(&pod("a", "late", "even"), true);
        assert!(references.lock()["a"].has("late"));
        assert!(references.lock()["a"].has("p-00003"));
        assert!(!references.lock()["a"].has("p-00004"));
    }
}
