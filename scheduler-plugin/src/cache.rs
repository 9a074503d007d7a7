//! PURE: one lower cluster as the fit sees it, folded from node and pod watch events
//! through `apply_* / delete_* / relist_*` (synchronous, tested without an API server).
//! Pruned: per node what [`LowerNode`] holds; per pod only its node and its footprint; per
//! node the sum of its pods' footprints, kept incrementally so a filter never sums pods.
//!
//! Pods in flight take room too, or a burst passes filter pod after pod against the same
//! free node: a lower pod its scheduler has not placed yet counts on the node it will
//! most likely get (the one it leaves the most room on, as the default LeastAllocated
//! scoring picks), and an upper pod that passed filter counts, [`ClusterCache::assume`]d,
//! until its lower copy appears or its assumption expires.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::{Node, Pod};
use tensile::node::resources::{Resources, add, phase_is_terminal, pod_footprint};
use tensile::translate::meta::UPPER_UID_ANNOTATION;

use tensile::translate::scheduling::Confinement;

use crate::fit::{ClusterFit, Demand, LowerNode, Search, check_node, fit_cluster, in_group};

/// Per pod only what the sums need, with node and resource names shared (interned):
/// 20 000 pods hold a handful of distinct names.
#[derive(Clone, Debug, PartialEq)]
struct PodUsage {
    /// Where the footprint is counted: the pod's node, or for a pod not bound yet the node
    /// it will most likely get (none where no node takes it).
    node: Option<Arc<str>>,
    /// For a pod counted where it will most likely go (not bound yet), what it asks, to
    /// place it again; `None` for a bound pod.
    waiting: Option<Arc<Demand>>,
    footprint: Box<[(Arc<str>, i128)]>,
}

/// An upper pod that passed filter, counted until its lower copy appears: once per virtual
/// node of this cluster it passed on (a member of `node` or `label=<key>` granularity
/// has several, each confining the pod to its own lower nodes).
#[derive(Clone, Debug)]
struct Assumed {
    usages: Vec<PodUsage>,
    /// When it stops counting if no lower copy has appeared (the pod went elsewhere, or
    /// was never bound).
    deadline: Instant,
}

/// The nodes of one lower cluster and what its pods take on each.
#[derive(Clone, Debug, Default)]
pub struct ClusterCache {
    nodes: HashMap<String, LowerNode>,
    /// Non-terminal pods, bound or not. Key `namespace/name`.
    pods: HashMap<String, PodUsage>,
    /// Upper pods assumed here. Key: the upper pod's UID.
    assumed: HashMap<String, Assumed>,
    /// Assumptions in the order they were made (and expire); an entry whose assumption
    /// was since released or made again is skipped.
    deadlines: VecDeque<(Instant, String)>,
    /// Node → sum of the footprints counted there.
    used: HashMap<String, Resources>,
    relisted_nodes: Option<HashSet<String>>,
    relisted_pods: Option<HashSet<String>>,
    names: HashSet<Arc<str>>,
}

/// What a pod takes.
enum Takes {
    /// Room on its node.
    Bound(String, Resources),
    /// Room somewhere, once the lower scheduler has placed it.
    Waiting(Demand),
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

    /// A pod was added or changed. A lower copy replaces its upper pod's assumption:
    /// returns that pod's UID when it did, for the other clusters to drop theirs.
    pub fn apply_pod(&mut self, pod: &Pod) -> Option<String> {
        let key = pod_key(pod);
        if let Some(seen) = &mut self.relisted_pods {
            seen.insert(key.clone());
        }
        let guessed = self
            .pods
            .get(&key)
            .filter(|old| old.waiting.is_some())
            .and_then(|old| old.node.clone());
        self.forget(&key);
        let released = upper_uid(pod)
            .filter(|uid| self.release(uid))
            .map(str::to_owned);
        match takes(pod) {
            Some(Takes::Bound(node, footprint)) => {
                let usage = self.take(Some(&node), None, &footprint);
                self.pods.insert(key, usage);
                // The lower scheduler chose another node than the guess: what was guessed
                // onto this one may now be counted twice here and missing where it will
                // really go.
                if guessed.as_deref() != Some(node.as_str()) {
                    self.place_again_on(&node);
                }
            }
            Some(Takes::Waiting(demand)) => {
                let demand = Arc::new(demand);
                let node = self.place(&demand);
                let usage = self.take(node.as_deref(), Some(demand.clone()), &demand.requests);
                self.pods.insert(key, usage);
            }
            None => {}
        }
        released
    }

    /// Places again every pod counted on `node` by guess (lower pods not bound yet, upper
    /// pods assumed), each where it now leaves the most room.
    fn place_again_on(&mut self, node: &str) {
        let guessed_here =
            |usage: &PodUsage| usage.waiting.is_some() && usage.node.as_deref() == Some(node);
        let pods: Vec<String> = self
            .pods
            .iter()
            .filter(|(_, usage)| guessed_here(usage))
            .map(|(key, _)| key.clone())
            .collect();
        for key in pods {
            if let Some(usage) = self.pods.remove(&key) {
                let usage = self.placed_again(&usage);
                self.pods.insert(key, usage);
            }
        }
        let assumed: Vec<String> = self
            .assumed
            .iter()
            .filter(|(_, assumed)| assumed.usages.iter().any(guessed_here))
            .map(|(uid, _)| uid.clone())
            .collect();
        for uid in assumed {
            if let Some(mut assumed) = self.assumed.remove(&uid) {
                assumed.usages = std::mem::take(&mut assumed.usages)
                    .iter()
                    .map(|usage| {
                        if guessed_here(usage) {
                            self.placed_again(usage)
                        } else {
                            usage.clone()
                        }
                    })
                    .collect();
                self.assumed.insert(uid, assumed);
            }
        }
    }

    /// `usage` (a guess) given back and counted again where its pod now fits best.
    fn placed_again(&mut self, usage: &PodUsage) -> PodUsage {
        self.give_back(usage);
        let Some(demand) = usage.waiting.clone() else {
            return usage.clone();
        };
        let node = self.place(&demand);
        self.take(node.as_deref(), Some(demand.clone()), &demand.requests)
    }

    /// A pod was deleted.
    pub fn delete_pod(&mut self, pod: &Pod) {
        self.forget(&pod_key(pod));
    }

    /// Counts the upper pod `uid`, which passed filter with `demand`, on the node it will
    /// most likely get, until its lower copy appears or `deadline`. Made again (the pod
    /// passed on another virtual node of this cluster, with its own confinement), both
    /// count until then: [`ClusterCache::release`] first for a pod filtered anew.
    pub fn assume(&mut self, uid: &str, demand: &Demand, deadline: Instant) {
        let node = self.place(demand);
        let demand = Arc::new(demand.clone());
        let usage = self.take(node.as_deref(), Some(demand.clone()), &demand.requests);
        let assumed = self.assumed.entry(uid.to_owned()).or_insert(Assumed {
            usages: Vec::new(),
            deadline,
        });
        assumed.usages.push(usage);
        assumed.deadline = deadline;
        self.deadlines.push_back((deadline, uid.to_owned()));
    }

    /// Stops counting the upper pod `uid`; whether it was counted.
    pub fn release(&mut self, uid: &str) -> bool {
        match self.assumed.remove(uid) {
            Some(assumed) => {
                for usage in &assumed.usages {
                    self.give_back(usage);
                }
                true
            }
            None => false,
        }
    }

    /// Releases the assumptions whose deadline is `now` or earlier.
    pub fn expire(&mut self, now: Instant) {
        while let Some((deadline, _)) = self.deadlines.front()
            && *deadline <= now
        {
            let Some((deadline, uid)) = self.deadlines.pop_front() else {
                break;
            };
            if self
                .assumed
                .get(&uid)
                .is_some_and(|assumed| assumed.deadline == deadline)
            {
                self.release(&uid);
            }
        }
    }

    /// The node that leaves the most room after taking a pod with `demand`, as the
    /// default scoring of the lower scheduler picks it; ties go to the first name.
    fn place(&self, demand: &Demand) -> Option<String> {
        self.nodes
            .iter()
            .filter_map(|(name, node)| {
                check_node(name, node, self.used.get(name), demand)
                    .ok()
                    .map(|score| (score, name))
            })
            .max_by(|(a, a_name), (b, b_name)| a.cmp(b).then_with(|| b_name.cmp(a_name)))
            .map(|(_, name)| name.clone())
    }

    fn intern(&mut self, name: &str) -> Arc<str> {
        if let Some(known) = self.names.get(name) {
            return known.clone();
        }
        let name: Arc<str> = Arc::from(name);
        self.names.insert(name.clone());
        name
    }

    /// Counts `footprint` on `node` (nowhere when `None`): the pod's own node, or, with
    /// `waiting`, a guess.
    fn take(
        &mut self,
        node: Option<&str>,
        waiting: Option<Arc<Demand>>,
        footprint: &Resources,
    ) -> PodUsage {
        if let Some(node) = node {
            match self.used.get_mut(node) {
                Some(used) => add(used, footprint),
                None => {
                    self.used.insert(node.to_owned(), footprint.clone());
                }
            }
        }
        PodUsage {
            node: node.map(|n| self.intern(n)),
            waiting,
            footprint: footprint
                .iter()
                .map(|(resource, amount)| (self.intern(resource), *amount))
                .collect(),
        }
    }

    fn give_back(&mut self, usage: &PodUsage) {
        let Some(node) = &usage.node else { return };
        if let Some(used) = self.used.get_mut(&**node) {
            for (resource, amount) in &usage.footprint {
                if let Some(slot) = used.get_mut(&**resource) {
                    *slot -= amount;
                    if *slot == 0 {
                        used.remove(&**resource);
                    }
                }
            }
            if used.is_empty() {
                self.used.remove(&**node);
            }
        }
    }

    fn forget(&mut self, key: &str) {
        if let Some(old) = self.pods.remove(key) {
            self.give_back(&old);
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

    /// Number of nodes and of pods taking room (bound or not; upper pods assumed aside).
    pub fn len(&self) -> (usize, usize) {
        (self.nodes.len(), self.pods.len())
    }

    /// Whether the cache holds nothing.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty() && self.pods.is_empty() && self.assumed.is_empty()
    }

    /// Pods counted but not bound yet: lower pods not scheduled, upper pods assumed.
    pub fn in_flight(&self) -> usize {
        self.pods.values().filter(|p| p.waiting.is_some()).count() + self.assumed.len()
    }

    /// What is counted on `node`: its pods' requests, and those of pods expected there.
    pub fn used(&self, node: &str) -> Option<&Resources> {
        self.used.get(node)
    }

    /// A node as the fit sees it.
    pub fn node(&self, name: &str) -> Option<&LowerNode> {
        self.nodes.get(name)
    }

    /// Whether any node of this cluster takes a pod with `demand`.
    pub fn fit(&self, demand: &Demand, search: Search) -> ClusterFit {
        self.fit_within(demand, None, search)
    }

    /// Whether any node of this cluster `within` a group (all, for `None`) takes a pod with
    /// `demand`; the others are not looked at (nor counted in the reason).
    pub fn fit_within(
        &self,
        demand: &Demand,
        within: Option<&Confinement>,
        search: Search,
    ) -> ClusterFit {
        fit_cluster(
            self.nodes
                .iter()
                .filter(|(name, node)| within.is_none_or(|w| in_group(w, name, node)))
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

/// The UID of the upper pod a lower pod mirrors (virtual-node's mark), if it does.
fn upper_uid(pod: &Pod) -> Option<&str> {
    pod.metadata
        .annotations
        .as_ref()?
        .get(UPPER_UID_ANNOTATION)
        .map(String::as_str)
}

/// What a pod takes, if it takes room: not terminal, and either bound or waiting for the
/// lower scheduler (not held back by scheduling gates). Every such pod counts, mirrored
/// ones included: the question is what is free below, not what the virtual node
/// advertises.
fn takes(pod: &Pod) -> Option<Takes> {
    if phase_is_terminal(pod.status.as_ref().and_then(|s| s.phase.as_deref())) {
        return None;
    }
    let spec = pod.spec.as_ref()?;
    match spec.node_name.as_deref().filter(|n| !n.is_empty()) {
        Some(node) => Some(Takes::Bound(node.to_owned(), pod_footprint(spec))),
        None if spec
            .scheduling_gates
            .as_ref()
            .is_some_and(|g| !g.is_empty()) =>
        {
            None
        }
        None => Some(Takes::Waiting(Demand::of_lower(spec))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;
    use tensile::node::groups::{Granularity, group_requirement};

    const ZONE: &str = "topology.kubernetes.io/zone";

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

    /// A pod the lower scheduler has not placed yet takes room on the node it will most
    /// likely get (the one it leaves the most room on), and where it fits nowhere, none.
    #[test]
    fn pods_not_scheduled_yet_take_room() {
        let mut cache = ClusterCache::default();
        cache.apply_node(&node("n1", "4"));
        cache.apply_node(&node("n2", "2"));
        cache.apply_pod(&pod("a", "", "3", "Pending"));
        assert_eq!(cpu_used(&cache, "n1"), 3000);
        let demand = |cpu: &str| Demand::of(&pod("x", "", cpu, "Pending")).unwrap();
        assert_eq!(
            cache.fit(&demand("3"), Search::First),
            ClusterFit::NoFit {
                reason: "no node fits cpu 3 (largest free 2)".into(),
            }
        );
        // Scheduled below: counted once, where it is.
        cache.apply_pod(&pod("a", "n2", "3", "Pending"));
        assert_eq!((cpu_used(&cache, "n1"), cpu_used(&cache, "n2")), (0, 3000));
        cache.apply_pod(&pod("huge", "", "64", "Pending"));
        assert!(
            matches!(
                cache.fit(&demand("4"), Search::First),
                ClusterFit::Fits { .. }
            ),
            "a pod no node takes takes no room"
        );
        assert_eq!(cache.in_flight(), 1);
        let mut gated = pod("gated", "", "4", "Pending");
        gated.spec.as_mut().unwrap().scheduling_gates = Some(vec![
            serde_json::from_value(json!({"name": "wait"})).unwrap(),
        ]);
        cache.apply_pod(&gated);
        assert_eq!(
            cpu_used(&cache, "n1"),
            0,
            "a gated pod is not scheduled yet"
        );
    }

    /// The lower scheduler binds a pod elsewhere than guessed: the guesses counted on that
    /// node move to where their pods will really go, so no node is counted twice while
    /// another looks free (a burst then passed filter once too often, refused below).
    #[test]
    fn a_pod_bound_elsewhere_than_guessed_moves_the_guesses_it_displaced() {
        let mut cache = ClusterCache::default();
        cache.apply_node(&node("n1", "4"));
        cache.apply_node(&node("n2", "4"));
        cache.apply_pod(&pod("a", "", "2500m", "Pending"));
        cache.apply_pod(&pod("b", "", "2500m", "Pending"));
        let demand = Demand::of(&pod("c", "", "2500m", "Pending")).unwrap();
        cache.assume(
            "uid-c",
            &demand,
            Instant::now() + std::time::Duration::from_secs(30),
        );
        let guessed_a = if cpu_used(&cache, "n1") == 2500 {
            "n1"
        } else {
            "n2"
        };
        let other = if guessed_a == "n1" { "n2" } else { "n1" };
        cache.apply_pod(&pod("a", other, "2500m", "Pending"));
        assert_eq!(
            (cpu_used(&cache, "n1"), cpu_used(&cache, "n2")),
            (2500, 2500),
            "b goes where a was guessed; c, which fits nowhere, counts nowhere"
        );
        assert_eq!(
            cache.fit(&demand, Search::First),
            ClusterFit::NoFit {
                reason: "no node fits cpu 2500m (largest free 1500m)".into(),
            }
        );
    }

    #[test]
    fn assumptions_count_until_the_lower_copy_or_the_deadline() {
        let mut cache = ClusterCache::default();
        cache.apply_node(&node("n1", "4"));
        let demand = Demand::of(&pod("a", "", "3", "Pending")).unwrap();
        let now = Instant::now();
        let at = |seconds: u64| now + std::time::Duration::from_secs(seconds);
        cache.assume("uid-a", &demand, at(10));
        assert_eq!((cpu_used(&cache, "n1"), cache.in_flight()), (3000, 1));
        assert!(cache.release("uid-a"));
        cache.assume("uid-a", &demand, at(20));
        assert_eq!(cpu_used(&cache, "n1"), 3000, "filtered anew, it replaces");
        cache.expire(at(10));
        assert_eq!(
            cpu_used(&cache, "n1"),
            3000,
            "the first deadline no longer holds"
        );
        // The lower copy appears: it takes the room from now on.
        let mut copy = pod("a", "", "3", "Pending");
        copy.metadata.annotations =
            Some([(UPPER_UID_ANNOTATION.to_owned(), "uid-a".to_owned())].into());
        assert_eq!(cache.apply_pod(&copy).as_deref(), Some("uid-a"));
        assert_eq!((cpu_used(&cache, "n1"), cache.in_flight()), (3000, 1));
        assert_eq!(cache.apply_pod(&copy), None, "released once");
        cache.expire(at(20));
        assert_eq!(cpu_used(&cache, "n1"), 3000);
        // Never bound anywhere: it stops counting at its deadline.
        cache.delete_pod(&copy);
        cache.assume("uid-b", &demand, at(30));
        assert_eq!(cpu_used(&cache, "n1"), 3000);
        cache.expire(at(29));
        assert_eq!(cpu_used(&cache, "n1"), 3000);
        cache.expire(at(30));
        assert_eq!((cpu_used(&cache, "n1"), cache.in_flight()), (0, 0));
        assert!(!cache.release("uid-b"));
        assert!(cache.deadlines.is_empty());
    }

    /// A member of `label=<key>` granularity: the pod passed on two of its virtual nodes
    /// (zones), each confining it to its own lower nodes; it counts in both zones until its
    /// lower copy appears, and is released from both at once.
    #[test]
    fn an_assumption_counts_once_per_group_it_passed() {
        let mut cache = ClusterCache::default();
        let zoned = |name: &str, zone: &str| {
            let mut n = node(name, "4");
            n.metadata.labels = Some([(ZONE.to_owned(), zone.to_owned())].into());
            n
        };
        cache.apply_node(&zoned("n1", "a"));
        cache.apply_node(&zoned("n2", "b"));
        let demand = Demand::of(&pod("a", "", "3", "Pending")).unwrap();
        let in_zone = |zone: &str| {
            demand.confined(&group_requirement(&Granularity::Label(ZONE.into()), zone).unwrap())
        };
        let deadline = Instant::now() + std::time::Duration::from_secs(30);
        cache.assume("uid-a", &in_zone("b"), deadline);
        cache.assume("uid-a", &in_zone("a"), deadline);
        assert_eq!(
            (
                cpu_used(&cache, "n1"),
                cpu_used(&cache, "n2"),
                cache.in_flight()
            ),
            (3000, 3000, 1)
        );
        let zone_a = group_requirement(&Granularity::Label(ZONE.into()), "a").unwrap();
        assert_eq!(
            cache.fit_within(&in_zone("a"), Some(&zone_a), Search::First),
            ClusterFit::NoFit {
                reason: "no node fits cpu 3 (largest free 1)".into(),
            }
        );
        let mut copy = pod("a", "n2", "3", "Running");
        copy.metadata.annotations =
            Some([(UPPER_UID_ANNOTATION.to_owned(), "uid-a".to_owned())].into());
        assert_eq!(cache.apply_pod(&copy).as_deref(), Some("uid-a"));
        assert_eq!(
            (
                cpu_used(&cache, "n1"),
                cpu_used(&cache, "n2"),
                cache.in_flight()
            ),
            (0, 3000, 0),
            "its copy counts where it runs, the zone it did not take is free"
        );
    }
}
