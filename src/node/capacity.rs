//! What the lower cluster can still offer: the allocatable resources of its Ready,
//! schedulable, untainted nodes, minus what lower pods *not* mirrored by this virtual node
//! request there (the upper scheduler already accounts for our own pods). Never negative
//! (tensile-kube #91).
//!
//! Watch events are folded in through `apply_* / delete_* / reset_*`, so the whole
//! computation is synchronous and tested without an API server.

use std::collections::{BTreeMap, HashMap, HashSet};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::quantity::format_milli;
pub use super::resources::{Resources, node_usable, pod_requests};
use super::resources::{add, phase_is_terminal, pod_footprint, to_resources};
use crate::translate::meta::OWNER_NODE_LABEL;

#[derive(Clone, Debug, PartialEq)]
struct NodeUsage {
    usable: bool,
    allocatable: Resources,
}

#[derive(Clone, Debug, PartialEq)]
struct PodUsage {
    node: String,
    requests: Resources,
}

/// The lower cluster's nodes and the pods that take their room.
#[derive(Clone, Debug, Default)]
pub struct LowerCapacity {
    our_node: String,
    nodes: HashMap<String, NodeUsage>,
    /// Only pods that take room: bound, not terminal, not ours. Key `namespace/name`.
    pods: HashMap<String, PodUsage>,
    /// During a relist, the nodes and pods seen so far; what was not seen is dropped at
    /// the end. (Folding in as they come keeps memory flat: no list is buffered.)
    relisted_nodes: Option<HashSet<String>>,
    relisted_pods: Option<HashSet<String>>,
}

impl LowerCapacity {
    /// Capacity as seen by the virtual node `our_node`.
    pub fn new(our_node: &str) -> Self {
        Self {
            our_node: our_node.to_owned(),
            ..Self::default()
        }
    }

    /// A node was added or changed.
    pub fn apply_node(&mut self, node: &Node) {
        let Some(name) = node.metadata.name.clone() else {
            return;
        };
        if let Some(seen) = &mut self.relisted_nodes {
            seen.insert(name.clone());
        }
        let allocatable = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .map(to_resources)
            .unwrap_or_default();
        self.nodes.insert(
            name,
            NodeUsage {
                usable: node_usable(node),
                allocatable,
            },
        );
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

    /// The full list of nodes at once.
    pub fn reset_nodes<'a>(&mut self, nodes: impl IntoIterator<Item = &'a Node>) {
        self.relist_nodes_start();
        for node in nodes {
            self.apply_node(node);
        }
        self.relist_nodes_done();
    }

    /// A pod was added or changed.
    pub fn apply_pod(&mut self, pod: &Pod) {
        let key = pod_key(pod);
        if let Some(seen) = &mut self.relisted_pods {
            seen.insert(key.clone());
        }
        match self.usage(pod) {
            Some(usage) => self.pods.insert(key, usage),
            None => self.pods.remove(&key),
        };
    }

    /// A pod was deleted.
    pub fn delete_pod(&mut self, pod: &Pod) {
        self.pods.remove(&pod_key(pod));
    }

    /// A relist of pods begins.
    pub fn relist_pods_start(&mut self) {
        self.relisted_pods = Some(HashSet::new());
    }

    /// A relist of pods is complete: pods it did not contain are gone.
    pub fn relist_pods_done(&mut self) {
        if let Some(seen) = self.relisted_pods.take() {
            self.pods.retain(|key, _| seen.contains(key));
        }
    }

    /// The full list of pods at once.
    pub fn reset_pods<'a>(&mut self, pods: impl IntoIterator<Item = &'a Pod>) {
        self.relist_pods_start();
        for pod in pods {
            self.apply_pod(pod);
        }
        self.relist_pods_done();
    }

    fn usage(&self, pod: &Pod) -> Option<PodUsage> {
        let ours = pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(OWNER_NODE_LABEL))
            .is_some_and(|owner| *owner == self.our_node);
        let terminal = phase_is_terminal(pod.status.as_ref().and_then(|s| s.phase.as_deref()));
        let spec = pod.spec.as_ref()?;
        let node = spec.node_name.clone().filter(|n| !n.is_empty())?;
        if ours || terminal {
            return None;
        }
        Some(PodUsage {
            node,
            requests: pod_footprint(spec),
        })
    }

    /// What the virtual node offers: per resource, the sum over usable nodes of their
    /// allocatable minus the requests of other pods bound there, clamped at zero.
    pub fn capacity(&self) -> BTreeMap<String, Quantity> {
        let mut total = Resources::new();
        for usage in self.nodes.values().filter(|n| n.usable) {
            add(&mut total, &usage.allocatable);
        }
        for pod in self.pods.values() {
            if !self.nodes.get(&pod.node).is_some_and(|n| n.usable) {
                continue;
            }
            for (resource, amount) in &pod.requests {
                if let Some(left) = total.get_mut(resource) {
                    *left -= amount;
                }
            }
        }
        total
            .into_iter()
            .map(|(resource, amount)| (resource, format_milli(amount.max(0))))
            .collect()
    }
}

fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodSpec;
    use serde_json::json;

    fn node(name: &str, cpu: &str, ready: bool) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "status": {
                "allocatable": {"cpu": cpu, "memory": "32Gi", "pods": "110"},
                "capacity": {"cpu": "64", "memory": "64Gi", "pods": "110"},
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
            },
        }))
        .unwrap()
    }

    fn pod(name: &str, node: &str, cpu: &str, owner: Option<&str>, phase: &str) -> Pod {
        let labels = owner
            .map(|o| json!({OWNER_NODE_LABEL: o}))
            .unwrap_or(json!({}));
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "labels": labels},
            "spec": {
                "nodeName": node,
                "containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}],
            },
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    fn cpu(capacity: &LowerCapacity) -> String {
        capacity
            .capacity()
            .get("cpu")
            .map(|q| q.0.clone())
            .unwrap_or_default()
    }

    // tensile-kube's ConfigureNode cases, as behaviour, plus what it got wrong.
    #[test]
    fn capacity_table() {
        struct Case {
            name: &'static str,
            nodes: Vec<Node>,
            pods: Vec<Pod>,
            cpu: &'static str,
        }
        let mut cordoned = node("n3", "10", true);
        cordoned.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
            unschedulable: Some(true),
            ..Default::default()
        });
        let mut tainted = node("n4", "10", true);
        tainted.spec = serde_json::from_value(
            json!({"taints": [{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}]}),
        )
        .unwrap();
        let cases = vec![
            Case {
                name: "one node, not ready",
                nodes: vec![node("n1", "10", false)],
                pods: vec![],
                cpu: "",
            },
            Case {
                name: "one node, ready: its allocatable, not capacity",
                nodes: vec![node("n1", "10", true)],
                pods: vec![],
                cpu: "10",
            },
            Case {
                name: "two nodes",
                nodes: vec![node("n1", "10", true), node("n2", "10", true)],
                pods: vec![],
                cpu: "20",
            },
            Case {
                name: "a running pod not ours takes its requests",
                nodes: vec![node("n1", "10", true), node("n2", "10", true)],
                pods: vec![pod("p", "n1", "3", None, "Running")],
                cpu: "17",
            },
            Case {
                name: "a pending pod bound to a node takes room too",
                nodes: vec![node("n1", "10", true)],
                pods: vec![pod("p", "n1", "500m", None, "Pending")],
                cpu: "9500m",
            },
            Case {
                name: "our own mirrored pods are not subtracted (tensile-kube double-counted them)",
                nodes: vec![node("n1", "10", true)],
                pods: vec![pod("p", "n1", "3", Some("vk"), "Running")],
                cpu: "10",
            },
            Case {
                name: "another virtual node's pods are subtracted",
                nodes: vec![node("n1", "10", true)],
                pods: vec![pod("p", "n1", "3", Some("vk-other"), "Running")],
                cpu: "7",
            },
            Case {
                name: "terminal pods free their room",
                nodes: vec![node("n1", "10", true)],
                pods: vec![
                    pod("a", "n1", "3", None, "Succeeded"),
                    pod("b", "n1", "3", None, "Failed"),
                ],
                cpu: "10",
            },
            Case {
                name: "pods on unusable nodes are not subtracted",
                nodes: vec![node("n1", "10", true), node("n2", "10", false)],
                pods: vec![pod("p", "n2", "3", None, "Running")],
                cpu: "10",
            },
            Case {
                name: "never negative (tensile-kube #91)",
                nodes: vec![node("n1", "2", true)],
                pods: vec![pod("p", "n1", "5", None, "Running")],
                cpu: "0",
            },
            Case {
                name: "cordoned nodes do not count",
                nodes: vec![node("n1", "10", true), cordoned],
                pods: vec![],
                cpu: "10",
            },
            Case {
                name: "NoSchedule-tainted nodes do not count",
                nodes: vec![node("n1", "10", true), tainted],
                pods: vec![],
                cpu: "10",
            },
        ];
        for case in cases {
            let mut capacity = LowerCapacity::new("vk");
            capacity.reset_nodes(&case.nodes);
            capacity.reset_pods(&case.pods);
            assert_eq!(cpu(&capacity), case.cpu, "{}", case.name);
        }
    }

    #[test]
    fn pods_resource_counts_pods_not_ours() {
        let mut capacity = LowerCapacity::new("vk");
        capacity.apply_node(&node("n1", "10", true));
        capacity.apply_pod(&pod("a", "n1", "1", None, "Running"));
        capacity.apply_pod(&pod("b", "n1", "1", Some("vk"), "Running"));
        assert_eq!(capacity.capacity()["pods"].0, "109");
        assert_eq!(capacity.capacity()["memory"].0, "34359738368");
    }

    #[test]
    fn events_fold_in() {
        let mut capacity = LowerCapacity::new("vk");
        capacity.apply_node(&node("n1", "10", true));
        let p = pod("p", "n1", "4", None, "Running");
        capacity.apply_pod(&p);
        assert_eq!(cpu(&capacity), "6");
        capacity.apply_pod(&pod("p", "n1", "4", None, "Succeeded"));
        assert_eq!(cpu(&capacity), "10");
        capacity.apply_pod(&p);
        capacity.delete_pod(&p);
        assert_eq!(cpu(&capacity), "10");
        capacity.apply_node(&node("n2", "6", true));
        assert_eq!(cpu(&capacity), "16");
        capacity.delete_node("n1");
        assert_eq!(cpu(&capacity), "6");
    }

    #[test]
    fn a_relist_drops_what_it_did_not_contain() {
        let mut capacity = LowerCapacity::new("vk");
        capacity.reset_nodes(&[node("n1", "10", true), node("n2", "10", true)]);
        capacity.reset_pods(&[
            pod("a", "n1", "1", None, "Running"),
            pod("b", "n1", "2", None, "Running"),
        ]);
        assert_eq!(cpu(&capacity), "17");
        capacity.relist_nodes_start();
        capacity.apply_node(&node("n1", "10", true));
        capacity.relist_nodes_done();
        capacity.relist_pods_start();
        capacity.apply_pod(&pod("a", "n1", "1", None, "Running"));
        capacity.relist_pods_done();
        assert_eq!(cpu(&capacity), "9");
    }

    #[test]
    fn effective_requests() {
        let spec = |v: serde_json::Value| -> PodSpec { serde_json::from_value(v).unwrap() };
        let req = |cpu: &str| json!({"requests": {"cpu": cpu}});
        let cases = vec![
            (
                "containers add up",
                spec(json!({"containers": [
                {"name": "a", "resources": req("1")}, {"name": "b", "resources": req("2")}]})),
                3000,
            ),
            (
                "a large init container wins",
                spec(json!({
                "initContainers": [{"name": "i", "resources": req("5")}],
                "containers": [{"name": "a", "resources": req("1")}]})),
                5000,
            ),
            (
                "sidecars add to the containers",
                spec(json!({
                "initContainers": [{"name": "s", "restartPolicy": "Always", "resources": req("1")}],
                "containers": [{"name": "a", "resources": req("1")}]})),
                2000,
            ),
            (
                "an init container after a sidecar runs beside it",
                spec(json!({
                "initContainers": [
                    {"name": "s", "restartPolicy": "Always", "resources": req("1")},
                    {"name": "i", "resources": req("3")}],
                "containers": [{"name": "a", "resources": req("1")}]})),
                4000,
            ),
            (
                "overhead is added",
                spec(json!({
                "overhead": {"cpu": "250m"},
                "containers": [{"name": "a", "resources": req("1")}]})),
                1250,
            ),
            (
                "pod-level requests win",
                spec(json!({
                "resources": {"requests": {"cpu": "2"}},
                "containers": [{"name": "a", "resources": req("1")}]})),
                2000,
            ),
            (
                "no requests",
                spec(json!({"containers": [{"name": "a"}]})),
                0,
            ),
        ];
        for (name, spec, want) in cases {
            let got = pod_requests(&spec).get("cpu").copied().unwrap_or(0);
            assert_eq!(got, want, "{name}");
        }
    }
}
