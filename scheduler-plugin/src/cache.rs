//! PURE: one lower cluster as the fit sees it, folded from node and pod watch events
//! through `apply_* / delete_* / relist_*` (synchronous, tested without an API server).
//! Pruned: per node what [`LowerNode`] holds; per pod only its node and its footprint; per
//! node the sum of its pods' footprints, kept incrementally so a filter never sums pods.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Pod};
use tensile::node::resources::{Resources, add, phase_is_terminal, pod_footprint};

use crate::fit::{ClusterFit, Demand, LowerNode, Search, fit_cluster};

/// Per pod only what the sums need, with node and resource names shared (interned):
/// 20 000 pods hold a handful of distinct names.
#[derive(Clone, Debug, PartialEq)]
struct PodUsage {
    node: Arc<str>,
    footprint: Box<[(Arc<str>, i128)]>,
}

/// The nodes of one lower cluster and what its pods take on each.
#[derive(Clone, Debug, Default)]
pub struct ClusterCache {
    nodes: HashMap<String, LowerNode>,
    /// Bound, non-terminal pods. Key `namespace/name`.
    pods: HashMap<String, PodUsage>,
    /// Node name → sum of the footprints of its pods.
    used: HashMap<String, Resources>,
    relisted_nodes: Option<HashSet<String>>,
    relisted_pods: Option<HashSet<String>>,
    names: HashSet<Arc<str>>,
}

impl ClusterCache {
    /// A node was added or changed.
    pub fn apply_node(&mut self, node: &Node) {
        let Some(name) = node.metadata.name.clone() else {
            return;
        };
        if let Some(seen) = &mut self.relisted_nodes {
            seen.insert(name.clone());
        }
        self.nodes.insert(name, LowerNode::from_node(node));
    }

    /// A node was deleted.
    pub fn delete_node(&mut self, name: &str) {
        self.nodes.remove(name);
    }

    /// A relist of nodes begins.
    pub fn relist_nodes_start(&mut self) {
        self.relisted_nodes = Some(HashSet::new());
    }

    /// A relist of nodes is complete: nodes it did not contain are gone.
    pub fn relist_nodes_done(&mut self) {
        if let Some(seen) = self.relisted_nodes.take() {
            self.nodes.retain(|name, _| seen.contains(name));
        }
    }

    /// A pod was added or changed.
    pub fn apply_pod(&mut self, pod: &Pod) {
        let key = pod_key(pod);
        if let Some(seen) = &mut self.relisted_pods {
            seen.insert(key.clone());
        }
        self.forget(&key);
        if let Some((node, footprint)) = usage(pod) {
            let usage = PodUsage {
                node: self.intern(&node),
                footprint: footprint
                    .iter()
                    .map(|(resource, amount)| (self.intern(resource), *amount))
                    .collect(),
            };
            self.add_used(&node, &footprint);
            self.pods.insert(key, usage);
        }
    }

    /// A pod was deleted.
    pub fn delete_pod(&mut self, pod: &Pod) {
        self.forget(&pod_key(pod));
    }

    fn intern(&mut self, name: &str) -> Arc<str> {
        if let Some(known) = self.names.get(name) {
            return known.clone();
        }
        let name: Arc<str> = Arc::from(name);
        self.names.insert(name.clone());
        name
    }

    fn add_used(&mut self, node: &str, footprint: &Resources) {
        match self.used.get_mut(node) {
            Some(used) => add(used, footprint),
            None => {
                self.used.insert(node.to_owned(), footprint.clone());
            }
        }
    }

    fn forget(&mut self, key: &str) {
        if let Some(old) = self.pods.remove(key)
            && let Some(used) = self.used.get_mut(&*old.node)
        {
            for (resource, amount) in &old.footprint {
                if let Some(slot) = used.get_mut(&**resource) {
                    *slot -= amount;
                    if *slot == 0 {
                        used.remove(&**resource);
                    }
                }
            }
            if used.is_empty() {
                self.used.remove(&*old.node);
            }
        }
    }

    /// A relist of pods begins.
    pub fn relist_pods_start(&mut self) {
        self.relisted_pods = Some(HashSet::new());
    }

    /// A relist of pods is complete: pods it did not contain are gone.
    pub fn relist_pods_done(&mut self) {
        if let Some(seen) = self.relisted_pods.take() {
            let gone: Vec<String> = self
                .pods
                .keys()
                .filter(|k| !seen.contains(*k))
                .cloned()
                .collect();
            for key in gone {
                self.forget(&key);
            }
        }
    }

    /// Number of nodes and of pods taking room.
    pub fn len(&self) -> (usize, usize) {
        (self.nodes.len(), self.pods.len())
    }

    /// Whether the cache holds nothing.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty() && self.pods.is_empty()
    }

    /// The requests of the pods bound to `node`.
    pub fn used(&self, node: &str) -> Option<&Resources> {
        self.used.get(node)
    }

    /// A node as the fit sees it.
    pub fn node(&self, name: &str) -> Option<&LowerNode> {
        self.nodes.get(name)
    }

    /// Whether any node of this cluster takes a pod with `demand`.
    pub fn fit(&self, demand: &Demand, search: Search) -> ClusterFit {
        fit_cluster(
            self.nodes
                .iter()
                .map(|(name, node)| (name.as_str(), node, self.used.get(name))),
            demand,
            search,
        )
    }
}

fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

/// What a pod takes, if it takes room: bound and not terminal. Every such pod counts,
/// mirrored ones included: the question is what is free below, not what the virtual node
/// advertises.
fn usage(pod: &Pod) -> Option<(String, Resources)> {
    if phase_is_terminal(pod.status.as_ref().and_then(|s| s.phase.as_deref())) {
        return None;
    }
    let spec = pod.spec.as_ref()?;
    let node = spec.node_name.clone().filter(|n| !n.is_empty())?;
    Some((node, pod_footprint(spec)))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn node(name: &str, cpu: &str) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "status": {"allocatable": {"cpu": cpu, "memory": "8Gi", "pods": "110"},
                       "conditions": [{"type": "Ready", "status": "True"}]},
        }))
        .unwrap()
    }

    fn pod(name: &str, node: &str, cpu: &str, phase: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}]},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    fn cpu_used(cache: &ClusterCache, node: &str) -> i128 {
        cache
            .used(node)
            .and_then(|u| u.get("cpu"))
            .copied()
            .unwrap_or(0)
    }

    #[test]
    fn pod_events_keep_per_node_sums() {
        let mut cache = ClusterCache::default();
        cache.apply_node(&node("n1", "4"));
        cache.apply_pod(&pod("a", "n1", "1", "Running"));
        cache.apply_pod(&pod("b", "n1", "2", "Pending"));
        assert_eq!(cpu_used(&cache, "n1"), 3000);
        // An update replaces, never adds twice.
        cache.apply_pod(&pod("b", "n1", "500m", "Running"));
        assert_eq!(cpu_used(&cache, "n1"), 1500);
        // Moves with the pod (a re-created pod of the same name on another node).
        cache.apply_pod(&pod("b", "n2", "500m", "Running"));
        assert_eq!(cpu_used(&cache, "n1"), 1000);
        assert_eq!(cpu_used(&cache, "n2"), 500);
        // Terminal pods free their room.
        cache.apply_pod(&pod("a", "n1", "1", "Succeeded"));
        assert_eq!(cpu_used(&cache, "n1"), 0);
        assert!(cache.used("n1").is_none());
        cache.delete_pod(&pod("b", "n2", "500m", "Running"));
        assert!(cache.used("n2").is_none());
        assert_eq!(cache.len(), (1, 0));
    }

    #[test]
    fn relists_drop_what_they_did_not_contain() {
        let mut cache = ClusterCache::default();
        cache.apply_node(&node("n1", "4"));
        cache.apply_node(&node("n2", "4"));
        cache.apply_pod(&pod("a", "n1", "1", "Running"));
        cache.apply_pod(&pod("b", "n1", "1", "Running"));
        cache.relist_nodes_start();
        cache.apply_node(&node("n1", "4"));
        cache.relist_nodes_done();
        cache.relist_pods_start();
        cache.apply_pod(&pod("a", "n1", "1", "Running"));
        cache.relist_pods_done();
        assert_eq!(cache.len(), (1, 1));
        assert_eq!(cpu_used(&cache, "n1"), 1000);
        assert!(cache.node("n2").is_none());
    }

    #[test]
    fn unbound_pods_take_no_room() {
        let mut cache = ClusterCache::default();
        cache.apply_pod(&pod("a", "", "1", "Pending"));
        assert!(cache.is_empty());
    }
}
