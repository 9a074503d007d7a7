//! What each pod of this node references (ConfigMaps, Secrets, …), kept apart from the
//! pod stores, which may keep only what the pod controller needs. Imports nothing from the
//! controllers: the shared `Context` holds it.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;

use crate::translate::config::{Reference, referenced};

/// What each pod references, by pod `namespace/name`: recorded from the full pod when its
/// dependencies are ensured (and from lower pods listed when unknown, e.g. after a
/// restart), because the pod stores may keep only what the pod controller needs.
/// A pod's references cannot change (volumes and env are immutable). Each pod's are kept
/// as a slice of their exact size (a `BTreeSet` node reserves room for eleven).
#[derive(Default)]
pub struct References(Mutex<ByPod>);

/// Each pod's references, by pod `(namespace, name)`.
type ByPod = HashMap<(String, String), Box<[Reference]>>;

impl References {
    /// Records what `pod` (a full pod) references.
    pub(crate) fn record(&self, pod: &Pod, with_service_account: bool) {
        let (Some(namespace), Some(name)) = (pod.namespace(), pod.metadata.name.clone()) else {
            return;
        };
        let found = referenced(std::iter::once(pod), with_service_account);
        self.lock()
            .insert((namespace, name), found.into_iter().collect());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ByPod> {
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
        map.retain(|(namespace, name), _| is_present(namespace, name));
        let present = map.len();
        if map.capacity() > 1024 && map.capacity() > 4 * present {
            // Hand back what pods gone since left.
            map.shrink_to(2 * present);
        }
        let known = map.values().flatten().cloned().collect();
        let mut unknown = BTreeSet::new();
        for (namespace, name) in pods {
            if !unknown.contains(namespace)
                && !map.contains_key(&(namespace.to_owned(), name.to_owned()))
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
}
