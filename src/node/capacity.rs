//! What the lower cluster can still offer: the allocatable resources of its Ready,
//! schedulable, untainted nodes, minus what lower pods *not* mirrored by this virtual node
//! request there (the upper scheduler already accounts for our own pods). Never negative
//! (tensile-kube #91).
//!
//! Watch events are folded in through `apply_* / delete_* / relist_*`, so the whole
//! computation is synchronous and tested without an API server. The sums are kept
//! incrementally (per node, and over usable nodes), so an event costs O(resources) and
//! reading the capacity never walks the pods: at tens of thousands of lower pods a walk
//! per pod event would cost more than the events themselves.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::quantity::{format_milli, parse_milli};
pub use super::resources::{Resources, node_usable, pod_requests};
use super::resources::{add, phase_is_terminal, pod_footprint, subtract, to_resources};
use crate::translate::meta::{Claim, OWNER_NODE_LABEL, Owner, UPPER_CLUSTER_LABEL};

/// What a lower node offers, as last seen.
#[derive(Clone, Debug, PartialEq)]
struct NodeOffer {
    usable: bool,
    allocatable: Resources,
}

/// A lower node and the pods bound to it. Lives while the node exists or a pod that takes
/// room is bound to it (pods may be seen before their node).
#[derive(Clone, Debug, Default)]
struct NodeRoom {
    /// `None` until the node is seen, and again once it is deleted.
    offer: Option<NodeOffer>,
    /// Relist generation in which the node was last seen.
    seen: u64,
    /// Sum of the footprints of `pods` pods that take room here.
    requested: Resources,
    pods: usize,
}

impl NodeRoom {
    fn usable(&self) -> bool {
        self.offer.as_ref().is_some_and(|o| o.usable)
    }
}

/// What a pod that takes room takes, and where.
#[derive(Clone, Debug, PartialEq)]
struct PodUsage {
    node: String,
    requests: Resources,
}

/// A resource summed over the usable nodes that list it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Listed {
    amount: i128,
    /// How many usable nodes list it: a resource listed as `0` is still reported.
    nodes: usize,
}

/// A relist in progress is a generation: what it did not touch is from an older one.
#[derive(Clone, Copy, Debug, Default)]
struct Relist {
    generation: u64,
    running: bool,
}

impl Relist {
    fn start(&mut self) {
        self.generation += 1;
        self.running = true;
    }

    /// The generation whose leftovers are now gone, if a relist was running.
    fn finish(&mut self) -> Option<u64> {
        std::mem::take(&mut self.running).then_some(self.generation)
    }
}

/// One of the two label-selected watches whose union is every lower pod that is not
/// ours: the capacity never lists or decodes this node's own pods, which at scale are
/// nearly all of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodFeed {
    /// Pods without this node's mark: other nodes', and nobody's.
    OtherNodes,
    /// Pods with this node's mark and not this upper cluster's (another upper cluster's
    /// node of the same name, or made before cluster marks).
    OtherClusters,
}

impl PodFeed {
    pub const ALL: [PodFeed; 2] = [PodFeed::OtherNodes, PodFeed::OtherClusters];

    /// The label selector of this feed's pods, to `owner`.
    pub fn selector(self, owner: &Owner) -> String {
        match self {
            PodFeed::OtherNodes => format!("{OWNER_NODE_LABEL}!={}", owner.node),
            PodFeed::OtherClusters => format!(
                "{OWNER_NODE_LABEL}={},{UPPER_CLUSTER_LABEL}!={}",
                owner.node, owner.cluster
            ),
        }
    }

    /// The feed that sees a pod with these labels, `None` for `owner`'s own: what
    /// [`PodFeed::selector`] selects, evaluated here.
    pub fn of(owner: &Owner, labels: Option<&BTreeMap<String, String>>) -> Option<PodFeed> {
        match owner.claim_labels(labels) {
            Claim::NotOurs => Some(PodFeed::OtherNodes),
            Claim::Unclaimed | Claim::Foreign => Some(PodFeed::OtherClusters),
            Claim::Ours => None,
        }
    }

    /// Its place in [`PodFeed::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// The lower cluster's nodes and the pods that take their room.
#[derive(Clone, Debug)]
pub struct LowerCapacity {
    owner: Owner,
    nodes: HashMap<String, NodeRoom>,
    /// Per feed, only pods that take room: bound, not terminal, not ours. Key
    /// `namespace/name`; beside each, its feed's relist generation in which it was last
    /// seen. Each feed's map is what its watch holds, so a pod whose labels move it from
    /// one feed to the other is dropped by the one and added by the other, in either order.
    pods: [HashMap<String, (PodUsage, u64)>; PodFeed::ALL.len()],
    /// Allocatable summed over usable nodes.
    allocatable: BTreeMap<String, Listed>,
    /// Footprints summed over the pods bound to usable nodes.
    requested: Resources,
    node_relist: Relist,
    pod_relists: [Relist; PodFeed::ALL.len()],
    /// The sums changed since [`LowerCapacity::capacity_if_changed`] last answered.
    changed: bool,
}

impl LowerCapacity {
    /// Capacity as seen by the virtual node `owner`.
    pub fn new(owner: &Owner) -> Self {
        Self {
            owner: owner.clone(),
            nodes: HashMap::new(),
            pods: Default::default(),
            allocatable: BTreeMap::new(),
            requested: Resources::new(),
            node_relist: Relist::default(),
            pod_relists: Default::default(),
            // Even an empty lower cluster has a capacity to publish once.
            changed: true,
        }
    }

    /// A node was added or changed.
    pub fn apply_node(&mut self, node: &Node) {
        let Some(name) = node.metadata.name.as_deref() else {
            return;
        };
        let allocatable = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .map(to_resources)
            .unwrap_or_default();
        let offer = NodeOffer {
            usable: node_usable(node),
            allocatable,
        };
        let generation = self.node_relist.generation;
        if let Some(room) = self.nodes.get_mut(name) {
            room.seen = generation;
            if room.offer.as_ref() == Some(&offer) {
                return;
            }
        }
        // Once per change of the node's offer, not on every event of it.
        let listed = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
        for (resource, quantity) in listed.into_iter().flatten() {
            if parse_milli(&quantity.0).is_none() {
                tracing::warn!(
                    node = name,
                    cluster = "lower",
                    resource = %resource,
                    quantity = %quantity.0,
                    "lower node allocatable: not a quantity, or past any real one; counted as none"
                );
            }
        }
        self.set_offer(name, Some(offer));
    }

    /// A node was deleted.
    pub fn delete_node(&mut self, name: &str) {
        self.set_offer(name, None);
    }

    /// A relist of nodes begins.
    pub fn relist_nodes_start(&mut self) {
        self.node_relist.start();
    }

    /// A relist of nodes is complete: nodes it did not contain are gone.
    pub fn relist_nodes_done(&mut self) {
        let Some(generation) = self.node_relist.finish() else {
            return;
        };
        let gone: Vec<String> = self
            .nodes
            .iter()
            .filter(|(_, room)| room.offer.is_some() && room.seen < generation)
            .map(|(name, _)| name.clone())
            .collect();
        for name in gone {
            self.delete_node(&name);
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

    /// A pod was added or changed, as `feed` saw it.
    pub fn apply_pod(&mut self, feed: PodFeed, pod: &Pod) {
        let key = pod_key(pod);
        let Some(usage) = self.usage(pod) else {
            self.remove_pod(feed, &key);
            return;
        };
        let generation = self.pod_relists[feed.index()].generation;
        if let Some((known, seen)) = self.pods[feed.index()].get_mut(&key) {
            *seen = generation;
            if *known == usage {
                return;
            }
        }
        self.remove_pod(feed, &key);
        self.insert_pod(feed, key, usage, generation);
    }

    /// A pod was deleted, or left `feed` (its labels changed).
    pub fn delete_pod(&mut self, feed: PodFeed, pod: &Pod) {
        self.remove_pod(feed, &pod_key(pod));
    }

    /// A relist of `feed`'s pods begins.
    pub fn relist_pods_start(&mut self, feed: PodFeed) {
        self.pod_relists[feed.index()].start();
    }

    /// A relist of `feed`'s pods is complete: its pods that the relist did not contain
    /// are gone.
    pub fn relist_pods_done(&mut self, feed: PodFeed) {
        let Some(generation) = self.pod_relists[feed.index()].finish() else {
            return;
        };
        let gone: Vec<String> = self.pods[feed.index()]
            .iter()
            .filter(|(_, (_, seen))| *seen < generation)
            .map(|(key, _)| key.clone())
            .collect();
        for key in gone {
            self.remove_pod(feed, &key);
        }
    }

    /// The full list of `feed`'s pods at once.
    pub fn reset_pods<'a>(&mut self, feed: PodFeed, pods: impl IntoIterator<Item = &'a Pod>) {
        self.relist_pods_start(feed);
        for pod in pods {
            self.apply_pod(feed, pod);
        }
        self.relist_pods_done(feed);
    }

    /// What the virtual node offers: per resource, the sum over usable nodes of their
    /// allocatable minus the requests of other pods bound there, clamped at zero.
    pub fn capacity(&self) -> BTreeMap<String, Quantity> {
        self.allocatable
            .iter()
            .map(|(resource, listed)| {
                let requested = self.requested.get(resource).copied().unwrap_or(0);
                let left = listed.amount - requested;
                (resource.clone(), format_milli(left.max(0)))
            })
            .collect()
    }

    /// What the lower nodes `nodes` offer (a group's virtual node, [`super::groups`]): the
    /// rules of [`LowerCapacity::capacity`] over those nodes only. Walks them, not the pods.
    pub fn capacity_of<'a>(
        &self,
        nodes: impl IntoIterator<Item = &'a str>,
    ) -> BTreeMap<String, Quantity> {
        let mut allocatable: BTreeMap<String, Listed> = BTreeMap::new();
        let mut requested = Resources::new();
        for room in nodes.into_iter().filter_map(|name| self.nodes.get(name)) {
            if let Some(offer) = room.offer.as_ref().filter(|o| o.usable) {
                list(&mut allocatable, &offer.allocatable);
                add(&mut requested, &room.requested);
            }
        }
        allocatable
            .into_iter()
            .map(|(resource, listed)| {
                let left = listed.amount - requested.get(&resource).copied().unwrap_or(0);
                (resource, format_milli(left.max(0)))
            })
            .collect()
    }

    /// The capacity, if the sums changed since the last call (the first call always
    /// answers), so a watch event that changes nothing costs no output.
    pub fn capacity_if_changed(&mut self) -> Option<BTreeMap<String, Quantity>> {
        std::mem::take(&mut self.changed).then(|| self.capacity())
    }

    /// The capacity by walking every node and pod, as `capacity()` did before the sums
    /// were kept: the reference that the capacity benchmark measures against.
    #[doc(hidden)]
    pub fn capacity_by_walk(&self) -> BTreeMap<String, Quantity> {
        let mut total = Resources::new();
        for offer in self.nodes.values().filter_map(|room| room.offer.as_ref()) {
            if offer.usable {
                add(&mut total, &offer.allocatable);
            }
        }
        for (pod, _) in self.pods.iter().flat_map(HashMap::values) {
            if !self.nodes.get(&pod.node).is_some_and(NodeRoom::usable) {
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

    /// What `pod` takes, if it takes room: bound, not terminal, not ours.
    fn usage(&self, pod: &Pod) -> Option<PodUsage> {
        if mirrored_by(pod, &self.owner) {
            return None;
        }
        if phase_is_terminal(pod.status.as_ref().and_then(|s| s.phase.as_deref())) {
            return None;
        }
        let spec = pod.spec.as_ref()?;
        let node = spec.node_name.as_deref().filter(|n| !n.is_empty())?;
        Some(PodUsage {
            node: node.to_owned(),
            requests: pod_footprint(spec),
        })
    }

    fn insert_pod(&mut self, feed: PodFeed, key: String, usage: PodUsage, generation: u64) {
        let room = self.nodes.entry(usage.node.clone()).or_default();
        add(&mut room.requested, &usage.requests);
        room.pods += 1;
        if room.usable() {
            add(&mut self.requested, &usage.requests);
            self.changed = true;
        }
        self.pods[feed.index()].insert(key, (usage, generation));
    }

    fn remove_pod(&mut self, feed: PodFeed, key: &str) {
        let Some((usage, _)) = self.pods[feed.index()].remove(key) else {
            return;
        };
        let Some(room) = self.nodes.get_mut(&usage.node) else {
            return;
        };
        subtract(&mut room.requested, &usage.requests);
        room.pods -= 1;
        if room.usable() {
            subtract(&mut self.requested, &usage.requests);
            self.changed = true;
        }
        if room.offer.is_none() && room.pods == 0 {
            self.nodes.remove(&usage.node);
        }
    }

    /// Replaces what node `name` offers, moving its allocatable and its pods' requests
    /// in or out of the sums as it turns usable or not.
    fn set_offer(&mut self, name: &str, offer: Option<NodeOffer>) {
        if offer.is_none() && !self.nodes.contains_key(name) {
            return;
        }
        let generation = self.node_relist.generation;
        let room = self.nodes.entry(name.to_owned()).or_default();
        let was_usable = room.usable();
        if let Some(old) = room.offer.as_ref().filter(|o| o.usable) {
            unlist(&mut self.allocatable, &old.allocatable);
        }
        room.offer = offer;
        room.seen = generation;
        if let Some(new) = room.offer.as_ref().filter(|o| o.usable) {
            list(&mut self.allocatable, &new.allocatable);
        }
        match (was_usable, room.usable()) {
            (true, false) => subtract(&mut self.requested, &room.requested),
            (false, true) => add(&mut self.requested, &room.requested),
            _ => {}
        }
        self.changed |= was_usable || room.usable();
        if room.offer.is_none() && room.pods == 0 {
            self.nodes.remove(name);
        }
    }
}

/// Whether `pod` is a mirror that the virtual node `owner` created (the upper scheduler
/// already counts it, so it must not be subtracted again). Another upper cluster's pods,
/// even of a node of the same name, take room like any other.
fn mirrored_by(pod: &Pod, owner: &Owner) -> bool {
    owner.owns(pod.metadata.labels.as_ref())
}

fn list(totals: &mut BTreeMap<String, Listed>, allocatable: &Resources) {
    for (resource, amount) in allocatable {
        let listed = totals.entry(resource.clone()).or_default();
        listed.amount += amount;
        listed.nodes += 1;
    }
}

fn unlist(totals: &mut BTreeMap<String, Listed>, allocatable: &Resources) {
    for (resource, amount) in allocatable {
        if let Some(listed) = totals.get_mut(resource) {
            listed.amount -= amount;
            listed.nodes -= 1;
            if listed.nodes == 0 {
                totals.remove(resource);
            }
        }
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
    use proptest::prelude::*;
    use serde_json::json;

    const CLUSTER: &str = "cluster-1";

    fn owner(node: &str) -> Owner {
        Owner::new(node, CLUSTER)
    }
    use std::collections::{BTreeSet, HashSet};

    /// The oracle: capacity computed from scratch from the nodes and pods that exist, by
    /// walking every pod, as `capacity()` did before the sums were kept incrementally.
    fn from_scratch<'a>(
        our_node: &str,
        nodes: impl IntoIterator<Item = &'a Node>,
        pods: impl IntoIterator<Item = &'a Pod>,
    ) -> BTreeMap<String, Quantity> {
        let mut usable = HashSet::new();
        let mut total = Resources::new();
        for node in nodes.into_iter().filter(|n| node_usable(n)) {
            usable.insert(node.metadata.name.clone().unwrap_or_default());
            if let Some(allocatable) = node.status.as_ref().and_then(|s| s.allocatable.as_ref()) {
                add(&mut total, &to_resources(allocatable));
            }
        }
        for pod in pods {
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            if mirrored_by(pod, &owner(our_node)) || phase_is_terminal(phase) {
                continue;
            }
            let Some(spec) = &pod.spec else { continue };
            if !spec.node_name.as_ref().is_some_and(|n| usable.contains(n)) {
                continue;
            }
            for (resource, amount) in pod_footprint(spec) {
                if let Some(left) = total.get_mut(&resource) {
                    *left -= amount;
                }
            }
        }
        total
            .into_iter()
            .map(|(resource, amount)| (resource, format_milli(amount.max(0))))
            .collect()
    }

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
            .map(|o| json!({OWNER_NODE_LABEL: o, UPPER_CLUSTER_LABEL: CLUSTER}))
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
            let mut capacity = LowerCapacity::new(&owner("vk"));
            capacity.reset_nodes(&case.nodes);
            capacity.reset_pods(PodFeed::OtherNodes, &case.pods);
            assert_eq!(cpu(&capacity), case.cpu, "{}", case.name);
            let oracle = from_scratch("vk", &case.nodes, &case.pods);
            assert_eq!(capacity.capacity(), oracle, "{}", case.name);
        }
    }

    #[test]
    fn pods_resource_counts_pods_not_ours() {
        let mut capacity = LowerCapacity::new(&owner("vk"));
        capacity.apply_node(&node("n1", "10", true));
        capacity.apply_pod(PodFeed::OtherNodes, &pod("a", "n1", "1", None, "Running"));
        // Not in either feed's selection; were one to pass it on, it is still not counted.
        capacity.apply_pod(
            PodFeed::OtherNodes,
            &pod("b", "n1", "1", Some("vk"), "Running"),
        );
        assert_eq!(capacity.capacity()["pods"].0, "109");
        assert_eq!(capacity.capacity()["memory"].0, "34359738368");
    }

    #[test]
    fn events_fold_in() {
        let mut capacity = LowerCapacity::new(&owner("vk"));
        capacity.apply_node(&node("n1", "10", true));
        let p = pod("p", "n1", "4", None, "Running");
        let feed = PodFeed::OtherNodes;
        capacity.apply_pod(feed, &p);
        assert_eq!(cpu(&capacity), "6");
        capacity.apply_pod(feed, &pod("p", "n1", "4", None, "Succeeded"));
        assert_eq!(cpu(&capacity), "10");
        capacity.apply_pod(feed, &p);
        capacity.delete_pod(feed, &p);
        assert_eq!(cpu(&capacity), "10");
        capacity.apply_node(&node("n2", "6", true));
        assert_eq!(cpu(&capacity), "16");
        capacity.delete_node("n1");
        assert_eq!(cpu(&capacity), "6");
    }

    #[test]
    fn a_relist_drops_what_it_did_not_contain() {
        let mut capacity = LowerCapacity::new(&owner("vk"));
        capacity.reset_nodes(&[node("n1", "10", true), node("n2", "10", true)]);
        capacity.reset_pods(
            PodFeed::OtherNodes,
            &[
                pod("a", "n1", "1", None, "Running"),
                pod("b", "n1", "2", None, "Running"),
            ],
        );
        assert_eq!(cpu(&capacity), "17");
        capacity.relist_nodes_start();
        capacity.apply_node(&node("n1", "10", true));
        capacity.relist_nodes_done();
        capacity.relist_pods_start(PodFeed::OtherNodes);
        capacity.apply_pod(PodFeed::OtherNodes, &pod("a", "n1", "1", None, "Running"));
        capacity.relist_pods_done(PodFeed::OtherNodes);
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

    #[test]
    fn capacity_is_answered_once_per_change() {
        let mut capacity = LowerCapacity::new(&owner("vk"));
        assert_eq!(capacity.capacity_if_changed(), Some(BTreeMap::new()));
        assert_eq!(capacity.capacity_if_changed(), None);
        capacity.apply_node(&node("n1", "10", true));
        assert!(capacity.capacity_if_changed().is_some());
        capacity.apply_node(&node("n1", "10", true));
        capacity.apply_pod(
            PodFeed::OtherNodes,
            &pod("ours", "n1", "3", Some("vk"), "Running"),
        );
        capacity.apply_node(&node("n2", "10", false));
        capacity.apply_pod(
            PodFeed::OtherNodes,
            &pod("elsewhere", "n2", "3", None, "Running"),
        );
        assert_eq!(capacity.capacity_if_changed(), None, "nothing usable moved");
        capacity.apply_pod(PodFeed::OtherNodes, &pod("p", "n1", "3", None, "Running"));
        assert_eq!(
            capacity.capacity_if_changed().map(|c| c["cpu"].0.clone()),
            Some("7".into())
        );
    }

    #[test]
    fn a_resource_listed_as_zero_stays_listed_while_a_usable_node_lists_it() {
        let with_hugepages = |name: &str, amount: &str| -> Node {
            let mut n = node(name, "10", true);
            if let Some(a) = n.status.as_mut().and_then(|s| s.allocatable.as_mut()) {
                a.insert("hugepages-2Mi".into(), Quantity(amount.into()));
            }
            n
        };
        let mut capacity = LowerCapacity::new(&owner("vk"));
        capacity.apply_node(&with_hugepages("n1", "0"));
        capacity.apply_node(&with_hugepages("n2", "2Gi"));
        capacity.delete_node("n2");
        assert_eq!(capacity.capacity()["hugepages-2Mi"].0, "0");
        capacity.delete_node("n1");
        assert!(capacity.capacity().is_empty());
    }

    /// One watch event, on a small world so that events collide: four node names (one
    /// never applied but bound to), eight pod keys over two namespaces.
    #[derive(Clone, Debug)]
    enum Step {
        ApplyNode {
            node: usize,
            ready: bool,
            cordoned: bool,
            cpu_milli: u32,
            lists_hugepages: bool,
        },
        DeleteNode(usize),
        ApplyPod {
            pod: usize,
            node: Option<usize>,
            cpu_milli: u32,
            gpu: bool,
            owner: Owned,
            phase: &'static str,
            /// A pod whose labels move it to the other feed: the new feed's event comes
            /// before the old feed's delete.
            late_delete: bool,
        },
        DeletePod(usize),
        RelistNodesStart,
        RelistNodesDone,
        RelistPodsStart(PodFeed),
        RelistPodsDone(PodFeed),
    }

    fn feed() -> impl Strategy<Value = PodFeed> {
        prop_oneof![Just(PodFeed::OtherNodes), Just(PodFeed::OtherClusters)]
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0..4usize, any::<bool>(), any::<bool>(), 0..4000u32, any::<bool>()).prop_map(
                |(node, ready, cordoned, cpu_milli, lists_hugepages)| Step::ApplyNode {
                    node,
                    ready: ready || cordoned, // mostly ready
                    cordoned: cordoned && !ready,
                    cpu_milli,
                    lists_hugepages,
                }
            ),
            1 => (0..4usize).prop_map(Step::DeleteNode),
            8 => (
                0..8usize,
                proptest::option::weighted(0.9, 0..5usize),
                0..1500u32,
                any::<bool>(),
                prop_oneof![
                    Just(Owned::Nobody),
                    Just(Owned::By("vk", CLUSTER)),
                    Just(Owned::By("vk", "another-cluster")),
                    Just(Owned::Unclaimed("vk")),
                    Just(Owned::By("vk-other", CLUSTER)),
                ],
                prop_oneof![
                    Just("Pending"),
                    Just("Running"),
                    Just("Succeeded"),
                    Just("Failed")
                ],
                any::<bool>(),
            )
                .prop_map(|(pod, node, cpu_milli, gpu, owner, phase, late_delete)| {
                    Step::ApplyPod {
                        pod,
                        node,
                        cpu_milli,
                        gpu,
                        owner,
                        phase,
                        late_delete,
                    }
                }),
            2 => (0..8usize).prop_map(Step::DeletePod),
            1 => Just(Step::RelistNodesStart),
            1 => Just(Step::RelistNodesDone),
            1 => feed().prop_map(Step::RelistPodsStart),
            1 => feed().prop_map(Step::RelistPodsDone),
        ]
    }

    fn step_node(
        node: usize,
        ready: bool,
        cordoned: bool,
        cpu_milli: u32,
        lists_hugepages: bool,
    ) -> Node {
        let mut allocatable = json!({"cpu": format!("{cpu_milli}m"), "memory": "1Gi", "pods": "3"});
        if lists_hugepages {
            allocatable["hugepages-2Mi"] = json!("0");
        }
        serde_json::from_value(json!({
            "metadata": {"name": format!("n{node}")},
            "spec": {"unschedulable": cordoned},
            "status": {
                "allocatable": allocatable,
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
            },
        }))
        .unwrap()
    }

    /// A lower pod's ownership marks.
    #[derive(Clone, Copy, Debug)]
    enum Owned {
        Nobody,
        By(&'static str, &'static str),
        /// A node mark and no cluster mark.
        Unclaimed(&'static str),
    }

    fn step_pod(
        pod: usize,
        node: Option<usize>,
        cpu_milli: u32,
        gpu: bool,
        owner: Owned,
        phase: &str,
    ) -> Pod {
        let mut requests = json!({"cpu": format!("{cpu_milli}m"), "memory": "100Mi"});
        if gpu {
            // Listed by no node: it must not appear in the capacity.
            requests["example.com/gpu"] = json!("1");
        }
        let labels = match owner {
            Owned::Nobody => json!({}),
            Owned::By(node, cluster) => {
                json!({OWNER_NODE_LABEL: node, UPPER_CLUSTER_LABEL: cluster})
            }
            Owned::Unclaimed(node) => json!({OWNER_NODE_LABEL: node}),
        };
        serde_json::from_value(json!({
            "metadata": {
                "name": format!("p{}", pod / 2),
                "namespace": if pod.is_multiple_of(2) { "a" } else { "b" },
                "labels": labels,
            },
            "spec": {
                "nodeName": node.map(|n| format!("n{n}")),
                "containers": [
                    {"name": "app", "resources": {"requests": requests}},
                    {"name": "sidecar", "resources": {"requests": {"cpu": "10m"}}},
                ],
            },
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    /// What exists in the lower cluster after the steps so far, as the watches would
    /// hold it, with the relists in progress: each pod beside the feed that sees it.
    #[derive(Default)]
    struct World {
        nodes: BTreeMap<String, Node>,
        pods: BTreeMap<String, (Option<PodFeed>, Pod)>,
        relisted_nodes: Option<BTreeSet<String>>,
        relisted_pods: [Option<BTreeSet<String>>; PodFeed::ALL.len()],
    }

    impl World {
        fn apply(&mut self, step: &Step, capacity: &mut LowerCapacity) {
            match *step {
                Step::ApplyNode {
                    node,
                    ready,
                    cordoned,
                    cpu_milli,
                    lists_hugepages,
                } => {
                    let node = step_node(node, ready, cordoned, cpu_milli, lists_hugepages);
                    let name = node.metadata.name.clone().unwrap();
                    if let Some(seen) = &mut self.relisted_nodes {
                        seen.insert(name.clone());
                    }
                    capacity.apply_node(&node);
                    self.nodes.insert(name, node);
                }
                Step::DeleteNode(node) => {
                    let name = format!("n{node}");
                    capacity.delete_node(&name);
                    self.nodes.remove(&name);
                }
                Step::ApplyPod {
                    pod,
                    node,
                    cpu_milli,
                    gpu,
                    owner,
                    phase,
                    late_delete,
                } => {
                    let pod = step_pod(pod, node, cpu_milli, gpu, owner, phase);
                    let key = pod_key(&pod);
                    let feed = PodFeed::of(&self::owner("vk"), pod.metadata.labels.as_ref());
                    let left = self
                        .pods
                        .get(&key)
                        .and_then(|(was, _)| *was)
                        .filter(|was| Some(*was) != feed);
                    if let Some(was) = left {
                        if let Some(seen) = &mut self.relisted_pods[was.index()] {
                            seen.remove(&key);
                        }
                        if !late_delete {
                            capacity.delete_pod(was, &pod);
                        }
                    }
                    if let Some(feed) = feed {
                        if let Some(seen) = &mut self.relisted_pods[feed.index()] {
                            seen.insert(key.clone());
                        }
                        capacity.apply_pod(feed, &pod);
                    }
                    if let Some(was) = left.filter(|_| late_delete) {
                        capacity.delete_pod(was, &pod);
                    }
                    self.pods.insert(key, (feed, pod));
                }
                Step::DeletePod(pod) => {
                    let key = pod_key(&step_pod(pod, None, 0, false, Owned::Nobody, "Running"));
                    if let Some((Some(feed), pod)) = self.pods.remove(&key) {
                        capacity.delete_pod(feed, &pod);
                    }
                }
                Step::RelistNodesStart => {
                    capacity.relist_nodes_start();
                    self.relisted_nodes = Some(BTreeSet::new());
                }
                Step::RelistNodesDone => {
                    capacity.relist_nodes_done();
                    if let Some(seen) = self.relisted_nodes.take() {
                        self.nodes.retain(|name, _| seen.contains(name));
                    }
                }
                Step::RelistPodsStart(feed) => {
                    capacity.relist_pods_start(feed);
                    self.relisted_pods[feed.index()] = Some(BTreeSet::new());
                }
                Step::RelistPodsDone(feed) => {
                    capacity.relist_pods_done(feed);
                    if let Some(seen) = self.relisted_pods[feed.index()].take() {
                        self.pods
                            .retain(|key, (was, _)| *was != Some(feed) || seen.contains(key));
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        // Any sequence of node and pod events, relists included, gives the capacity that
        // a walk over what exists gives; and the change flag never hides a change.
        #[test]
        fn incremental_capacity_matches_a_walk_from_scratch(
            steps in proptest::collection::vec(step(), 1..80)
        ) {
            let mut capacity = LowerCapacity::new(&owner("vk"));
            let mut world = World::default();
            let mut published = capacity.capacity_if_changed();
            for (i, step) in steps.iter().enumerate() {
                world.apply(step, &mut capacity);
                let pods = world.pods.values().map(|(_, pod)| pod);
                let oracle = from_scratch("vk", world.nodes.values(), pods);
                prop_assert_eq!(&capacity.capacity(), &oracle, "after step {}: {:?}", i, step);
                prop_assert_eq!(&capacity.capacity_by_walk(), &oracle, "walk, after step {}", i);
                if let Some(now) = capacity.capacity_if_changed() {
                    published = Some(now);
                }
                prop_assert_eq!(published.as_ref(), Some(&oracle), "published, after step {}", i);
            }
        }
    }

    #[test]
    fn capacity_of_a_group_counts_its_nodes_only() {
        let mut capacity = LowerCapacity::new(&owner("vk"));
        capacity.reset_nodes(&[
            node("n1", "10", true),
            node("n2", "8", true),
            node("n3", "6", false),
        ]);
        capacity.reset_pods(
            PodFeed::OtherNodes,
            &[
                pod("other-1", "n1", "3", None, "Running"),
                pod("other-2", "n2", "10", Some("vk-other"), "Running"),
                pod("other-3", "n3", "1", None, "Running"),
            ],
        );
        // Ours: the upper scheduler counts it already.
        capacity.reset_pods(
            PodFeed::OtherClusters,
            &[pod("ours", "n1", "2", Some("vk"), "Running")],
        );
        let cases: Vec<(&str, Vec<&str>, Option<&str>)> = vec![
            (
                "one node, others' pods subtracted, ours not",
                vec!["n1"],
                Some("7"),
            ),
            (
                "over-committed below: zero, never negative",
                vec!["n2"],
                Some("0"),
            ),
            ("not Ready: offers nothing", vec!["n3"], None),
            ("a group of two", vec!["n1", "n2"], Some("5")),
            ("unknown node", vec!["n9"], None),
        ];
        for (name, nodes, want) in cases {
            let got = capacity.capacity_of(nodes.iter().copied());
            assert_eq!(got.get("cpu").map(|q| q.0.as_str()), want, "{name}");
        }
        // Over every node, a group is the cluster.
        assert_eq!(
            capacity.capacity_of(["n1", "n2", "n3"]),
            capacity.capacity(),
            "whole cluster"
        );
    }
}
