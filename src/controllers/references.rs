//! What each pod of this node references (ConfigMaps, Secrets, …), kept apart from the
//! pod stores, which may keep only what the pod controller needs. Imports nothing from the
//! controllers but the [`super::shrink`] rule: the shared `Context` holds it.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};

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

/// The pods of one namespace and their references.
#[derive(Default)]
struct Namespace {
    /// Each pod's references, by pod name.
    pods: HashMap<Box<str>, Arc<[Reference]>>,
    /// The distinct lists `pods` holds, each once.
    lists: HashSet<Arc<[Reference]>>,
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
        let mut map = self.lock();
        let pods = map.entry(namespace).or_default();
        let list = match pods.lists.get(found.as_slice()) {
            Some(list) => list.clone(),
            None => {
                let list: Arc<[Reference]> = found.into();
                pods.lists.insert(list.clone());
                list
            }
        };
        pods.pods.insert(name.into(), list);
    }

    /// Whether a pod recorded in `reference`'s namespace references it: one recorded since
    /// the last [`References::resolve`] too (and one gone since, until that forgets it).
    pub(crate) fn references(&self, reference: &Reference) -> bool {
        self.lock().get(&reference.1).is_some_and(|known| {
            known
                .lists
                .iter()
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
            known.pods.retain(|name, _| is_present(namespace, name));
            // Held only by the set: no present pod has this list any more.
            known.lists.retain(|list| Arc::strong_count(list) > 1);
            // Hand back what pods gone since left.
            if let Some(to) = shrunk_capacity(known.pods.capacity(), known.pods.len(), KEEP) {
                known.pods.shrink_to(to);
            }
            !known.pods.is_empty()
        });
        let known = map
            .values()
            .flat_map(|known| known.lists.iter())
            .flat_map(|list| list.iter())
            .cloned()
            .collect();
        let mut unknown = BTreeSet::new();
        for (namespace, name) in pods {
            if !unknown.contains(namespace)
                && !map
                    .get(namespace)
                    .is_some_and(|known| known.pods.contains_key(name))
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
            let mut counts: Vec<usize> = known.lists.iter().map(Arc::strong_count).collect();
            counts.sort_unstable();
            counts
        };
        assert_eq!(
            lists(&references),
            [2, 4],
            "one list for p1..p3, one for p4"
        );
        let present = [("a", "p1"), ("a", "p2")];
        let (known, unknown) = references.resolve(present.iter().copied(), |ns, name| {
            present.contains(&(ns, name))
        });
        assert_eq!(lists(&references), [3], "p4's list went with p4");
        assert!(unknown.is_empty());
        assert!(known.iter().all(|(_, _, name)| name == "settings"));
        let (known, _) = references.resolve(std::iter::empty(), |_, _| false);
        assert!(known.is_empty());
        assert!(
            references.lock().is_empty(),
            "no pods left, no namespace kept"
        );
    }
}
