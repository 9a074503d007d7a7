//! filter and prioritize over the cached lower clusters: plain functions of the request
//! and the caches, no API call.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use tensile::translate::scheduling::Confinement;

use crate::cache::ClusterCache;
use crate::fit::{ClusterFit, Demand, Search};
use crate::upper::{
    BURST_ANNOTATION, BURST_EAGER, MAX_EXTENDER_PRIORITY, SharedUpperNodes, UpperNode, UpperNodes,
    burst_scores,
};
use crate::wire::{ExtenderArgs, ExtenderFilterResult, HostPriority, NodeList, node_name};

/// What to do with a virtual node whose lower cluster is not known (not synced yet,
/// unreachable).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OnUnknown {
    /// The virtual node fails filter, with the reason.
    #[default]
    Fail,
    /// The virtual node passes filter (the lower scheduler decides).
    Pass,
}

/// One of a lower cluster's two watches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Watched {
    /// Its nodes.
    Nodes,
    /// Its pods.
    Pods,
}

impl Watched {
    /// For messages and log fields.
    pub fn name(self) -> &'static str {
        match self {
            Self::Nodes => "nodes",
            Self::Pods => "pods",
        }
    }
}

/// One lower cluster: its cache and whether it can be trusted.
#[derive(Debug, Default)]
pub struct ClusterState {
    /// Nodes and pods.
    pub cache: ClusterCache,
    /// The node watch has listed everything and not failed since.
    pub nodes_synced: bool,
    /// The pod watch has listed everything and not failed since.
    pub pods_synced: bool,
    /// Why the node watch failed, until it has listed everything again.
    pub nodes_failing: Option<String>,
    /// Why the pod watch failed, until it has listed everything again.
    pub pods_failing: Option<String>,
    /// Why the lower API server is not answering, while it is not.
    pub unreachable: Option<String>,
}

impl ClusterState {
    /// `Err(why)` when the cache cannot be trusted.
    pub fn known(&self) -> Result<(), String> {
        if let Some(error) = &self.unreachable {
            return Err(format!("unreachable ({error})"));
        }
        for (watched, failing) in [
            (Watched::Nodes, &self.nodes_failing),
            (Watched::Pods, &self.pods_failing),
        ] {
            if let Some(error) = failing {
                return Err(format!(
                    "watch of {} failing ({error}); waiting for a complete list",
                    watched.name()
                ));
            }
        }
        if !(self.nodes_synced && self.pods_synced) {
            return Err("not synced yet".into());
        }
        Ok(())
    }

    /// A watch failed: what it holds may be stale (events missed, or access revoked)
    /// until it has listed everything again.
    pub fn watch_failed(&mut self, watched: Watched, error: String) {
        let (synced, failing) = self.watch(watched);
        *synced = false;
        *failing = Some(error);
    }

    /// A watch has listed everything: what it holds is current. Returns the watch if this
    /// ended a failure.
    pub fn listed(&mut self, watched: Watched) -> Option<Watched> {
        let (synced, failing) = self.watch(watched);
        *synced = true;
        failing.take().map(|_| watched)
    }

    fn watch(&mut self, watched: Watched) -> (&mut bool, &mut Option<String>) {
        match watched {
            Watched::Nodes => (&mut self.nodes_synced, &mut self.nodes_failing),
            Watched::Pods => (&mut self.pods_synced, &mut self.pods_failing),
        }
    }
}

/// A lower cluster's state, shared between its watch (writer) and requests (readers).
#[derive(Debug, Default, Clone)]
pub struct SharedCluster(Arc<RwLock<ClusterState>>);

impl SharedCluster {
    /// Reads it.
    pub fn read(&self) -> RwLockReadGuard<'_, ClusterState> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Changes it.
    pub fn write(&self) -> RwLockWriteGuard<'_, ClusterState> {
        self.0.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// How one node fared in one filter call (for metrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// A regular node, passed untouched.
    NotVirtual,
    /// A virtual node whose lower cluster takes the pod.
    Fits,
    /// A virtual node whose lower cluster does not.
    NoFit,
    /// A virtual node whose lower cluster is not known.
    Unknown,
    /// The pod's `clusterSelector` is unreadable.
    BadPod,
}

impl Outcome {
    /// Metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::NotVirtual => "not_virtual",
            Self::Fits => "fits",
            Self::NoFit => "no_fit",
            Self::Unknown => "unknown",
            Self::BadPod => "bad_pod",
        }
    }
}

/// How long a pod that passed filter counts in a lower cluster while its lower copy has
/// not appeared: long enough for kube-scheduler to bind it and virtual-node to mirror it
/// in a large burst (seconds), short enough that a pod bound to another node does not hold
/// room for long.
pub const DEFAULT_ASSUME_TTL: Duration = Duration::from_secs(30);

/// The extender: virtual node name → its lower cluster.
#[derive(Debug, Clone)]
pub struct Extender {
    /// Virtual node name → lower cluster.
    pub clusters: BTreeMap<String, SharedCluster>,
    /// Unknown clusters fail or pass.
    pub on_unknown: OnUnknown,
    /// How long a pod that passed filter counts in a lower cluster while its lower copy
    /// has not appeared.
    pub assume_ttl: Duration,
    /// The upper nodes' labels: which are virtual, and their burst priority.
    pub upper: SharedUpperNodes,
}

impl Default for Extender {
    fn default() -> Self {
        Self {
            clusters: BTreeMap::new(),
            on_unknown: OnUnknown::default(),
            assume_ttl: DEFAULT_ASSUME_TTL,
            upper: SharedUpperNodes::default(),
        }
    }
}

/// The pod a call is about.
struct Candidate<'a> {
    demand: Result<Demand, String>,
    /// Its UID: a pod that passes is assumed under it. kube-scheduler's pods have one.
    uid: Option<&'a str>,
    now: Instant,
}

impl<'a> Candidate<'a> {
    fn of(pod: Option<&'a Pod>, now: Instant) -> Self {
        Self {
            demand: demand_of(pod),
            uid: pod
                .and_then(|p| p.metadata.uid.as_deref())
                .filter(|uid| !uid.is_empty()),
            now,
        }
    }
}

/// One virtual node's verdict. A failure is always unresolvable for kube-scheduler: its
/// preemption dry-runs in-tree plugins only, which see the virtual node's summed capacity
/// and not the lower nodes, so no victim it picks there makes a lower node take the pod
/// (and no `preempt` verb is served to tell it better).
enum Verdict {
    Pass,
    Fail(String),
}

impl Extender {
    /// Whether every lower cluster's cache and the upper nodes have synced (for
    /// `/readyz`), else which not.
    pub fn ready(&self) -> Result<(), String> {
        let mut waiting: Vec<String> = self
            .clusters
            .iter()
            .filter_map(|(node, c)| c.read().known().err().map(|e| format!("{node}: {e}")))
            .collect();
        let upper = self.upper.read();
        if !upper.synced {
            let why = upper.failing.as_deref().unwrap_or("not synced yet");
            waiting.push(format!("upper nodes: {why}"));
        }
        if waiting.is_empty() {
            Ok(())
        } else {
            Err(waiting.join("; "))
        }
    }

    /// Judges one lower cluster for `pod`, which does not count against itself (a pod
    /// judged again was not bound after all); a pod that passes is assumed there, counted
    /// until its lower copy appears or [`Extender::assume_ttl`] has passed.
    ///
    /// `within` a group of lower nodes (a virtual node of a member of `node` or
    /// `label=<key>` granularity), only those are looked at, and the pod is assumed
    /// confined to them, as its lower copy will be.
    fn verdict(
        &self,
        cluster: &SharedCluster,
        pod: &Candidate<'_>,
        within: Option<&Confinement>,
        search: Search,
    ) -> (Verdict, Outcome) {
        let mut state = cluster.write();
        state.cache.expire(pod.now);
        if let Err(why) = state.known() {
            return match self.on_unknown {
                OnUnknown::Pass => (Verdict::Pass, Outcome::Unknown),
                OnUnknown::Fail => (Verdict::Fail(why), Outcome::Unknown),
            };
        }
        let confined;
        let demand = match (&pod.demand, within) {
            (Ok(demand), None) => demand,
            (Ok(demand), Some(within)) => {
                confined = demand.confined(within);
                &confined
            }
            (Err(why), _) => return (Verdict::Fail(why.clone()), Outcome::BadPod),
        };
        match state.cache.fit_within(demand, within, search) {
            ClusterFit::Fits { .. } => {
                if let Some(uid) = pod.uid {
                    state.cache.assume(uid, demand, pod.now + self.assume_ttl);
                }
                (Verdict::Pass, Outcome::Fits)
            }
            ClusterFit::NoFit { reason } => (Verdict::Fail(reason), Outcome::NoFit),
        }
    }

    /// The lower cluster behind upper node `name`, and which of its nodes: a configured
    /// cluster's virtual node (all of them), or one of the virtual nodes of a member of
    /// `node` or `label=<key>` granularity configured under its `--nodename` (the lower
    /// nodes its annotation names, all when it names none). `None` for any other node.
    fn lower_of(
        &self,
        upper: &UpperNodes,
        name: &str,
    ) -> Option<(&SharedCluster, Option<Confinement>)> {
        if let Some(cluster) = self.clusters.get(name) {
            return Some((cluster, None));
        }
        let Some(UpperNode::Virtual {
            group: Some(group), ..
        }) = upper.get(name)
        else {
            return None;
        };
        let cluster = self.clusters.get(&group.member)?;
        Some((cluster, group.within.clone()))
    }

    /// `filter`: regular nodes pass untouched; a virtual node passes when its lower
    /// cluster takes the pod (within its group of lower nodes, for a member shown as
    /// several), counting the pods in flight there. Returns the answer and each node's
    /// outcome.
    pub fn filter(&self, args: &ExtenderArgs) -> (ExtenderFilterResult, Vec<Outcome>) {
        self.filter_at(args, Instant::now())
    }

    /// [`Extender::filter`] at `now`.
    pub fn filter_at(
        &self,
        args: &ExtenderArgs,
        now: Instant,
    ) -> (ExtenderFilterResult, Vec<Outcome>) {
        let pod = Candidate::of(args.pod.as_ref(), now);
        if let Some(uid) = pod.uid {
            // Filtered again, it was not bound: nowhere does it hold room, not even in
            // clusters that its in-tree filters leave out this time.
            for cluster in self.clusters.values() {
                cluster.write().cache.release(uid);
            }
        }
        let mut result = ExtenderFilterResult::default();
        let mut outcomes = Vec::new();
        // Read once for the call (never taken while a cluster's lock is held).
        let upper = self.upper.read();
        let mut judge = |name: &str, result: &mut ExtenderFilterResult| -> bool {
            let Some((cluster, within)) = self.lower_of(&upper, name) else {
                outcomes.push(Outcome::NotVirtual);
                return true;
            };
            let (verdict, outcome) = self.verdict(cluster, &pod, within.as_ref(), Search::First);
            outcomes.push(outcome);
            match verdict {
                Verdict::Pass => true,
                Verdict::Fail(reason) => {
                    result.failed_and_unresolvable_nodes.insert(
                        name.to_owned(),
                        format!("lower cluster of {name}: {reason}"),
                    );
                    false
                }
            }
        };
        if let Some(names) = &args.node_names {
            let passed = names
                .iter()
                .filter(|name| judge(name, &mut result))
                .cloned()
                .collect();
            result.node_names = Some(passed);
        } else if let Some(nodes) = &args.nodes {
            let items = nodes
                .items
                .iter()
                .filter(|node| judge(node_name(node).unwrap_or_default(), &mut result))
                .cloned()
                .collect();
            result.nodes = Some(NodeList {
                items,
                rest: nodes.rest.clone(),
            });
        } else {
            result.error = "ExtenderArgs without Nodes or NodeNames".into();
        }
        (result, outcomes)
    }

    /// `prioritize`: local first, then the members in order. Regular nodes score
    /// [`MAX_EXTENDER_PRIORITY`]; virtual nodes score less, by the dense rank of their
    /// burst priority among the candidates ([`burst_scores`]). A pod annotated
    /// `tensile.dev/burst: eager` scores the same everywhere, so kube-scheduler's own
    /// scoring (room) decides. A node is virtual when its upper labels say so
    /// (`type=virtual-kubelet`) or when it is one of the configured clusters.
    pub fn prioritize(&self, args: &ExtenderArgs) -> Vec<HostPriority> {
        let names: Vec<&str> = match (&args.node_names, &args.nodes) {
            (Some(names), _) => names.iter().map(String::as_str).collect(),
            (None, Some(nodes)) => nodes
                .items
                .iter()
                .map(|n| node_name(n).unwrap_or_default())
                .collect(),
            (None, None) => Vec::new(),
        };
        let upper = self.upper.read();
        let scores = if args.pod.as_ref().is_some_and(eager) {
            vec![MAX_EXTENDER_PRIORITY; names.len()]
        } else {
            let candidates: Vec<Option<u64>> = names
                .iter()
                .map(|name| match upper.get(name) {
                    Some(UpperNode::Virtual { burst_priority, .. }) => Some(*burst_priority),
                    _ if self.clusters.contains_key(*name) => Some(0),
                    _ => None,
                })
                .collect();
            burst_scores(&candidates)
        };
        // The extender's weight outweighs every other score: the pod goes to a node that
        // scores the most here. On a virtual node that scores less it is not going, so it
        // holds no room there (filter assumed it on every virtual node it passed; regular
        // nodes first would otherwise fill the lower clusters with pods bound upstairs).
        let top = scores.iter().copied().max().unwrap_or_default();
        if let Some(uid) = args
            .pod
            .as_ref()
            .and_then(|p| p.metadata.uid.as_deref())
            .filter(|uid| !uid.is_empty())
        {
            for (name, score) in names.iter().zip(&scores) {
                if *score < top
                    && let Some((cluster, _)) = self.lower_of(&upper, name)
                {
                    cluster.write().cache.release(uid);
                }
            }
        }
        names
            .into_iter()
            .zip(scores)
            .map(|(name, score)| HostPriority {
                host: name.to_owned(),
                score,
            })
            .collect()
    }
}

/// Whether the pod opted into eager bursting.
fn eager(pod: &Pod) -> bool {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(BURST_ANNOTATION))
        .is_some_and(|v| v.trim() == BURST_EAGER)
}

fn demand_of(pod: Option<&Pod>) -> Result<Demand, String> {
    let pod = pod.ok_or_else(|| "ExtenderArgs without Pod".to_owned())?;
    Demand::of(pod).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::wire::decode;
    use k8s_openapi::api::core::v1::Node;
    use serde_json::json;

    fn cluster(cpu: &str, synced: bool) -> SharedCluster {
        let cluster = SharedCluster::default();
        {
            let mut state = cluster.write();
            state.nodes_synced = synced;
            state.pods_synced = synced;
            let node: Node = serde_json::from_value(json!({
                "metadata": {"name": "n1"},
                "status": {"allocatable": {"cpu": cpu, "memory": "8Gi", "pods": "110"},
                           "conditions": [{"type": "Ready", "status": "True"}]},
            }))
            .unwrap();
            state.cache.apply_node(&node);
        }
        cluster
    }

    fn extender(on_unknown: OnUnknown) -> Extender {
        Extender {
            clusters: [
                ("vk-small".to_owned(), cluster("4", true)),
                ("vk-big".to_owned(), cluster("16", true)),
                ("vk-new".to_owned(), cluster("16", false)),
            ]
            .into(),
            on_unknown,
            ..Extender::default()
        }
    }

    fn pod(cpu: &str) -> serde_json::Value {
        json!({"metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": [
            {"name": "c", "resources": {"requests": {"cpu": cpu}}}]}})
    }

    #[test]
    fn filter_by_names() {
        let args = decode(
            json!({"Pod": pod("6"), "NodeNames": ["regular", "vk-small", "vk-big", "vk-new"]})
                .to_string()
                .as_bytes(),
        )
        .unwrap();
        let (result, outcomes) = extender(OnUnknown::Fail).filter(&args);
        assert_eq!(result.node_names.unwrap(), ["regular", "vk-big"]);
        assert_eq!(
            result.failed_and_unresolvable_nodes["vk-small"],
            "lower cluster of vk-small: no node fits cpu 6 (largest free 4)"
        );
        assert_eq!(
            result.failed_and_unresolvable_nodes["vk-new"],
            "lower cluster of vk-new: not synced yet"
        );
        assert_eq!(
            outcomes,
            [
                Outcome::NotVirtual,
                Outcome::NoFit,
                Outcome::Fits,
                Outcome::Unknown
            ]
        );
        assert!(result.nodes.is_none());
    }

    /// kube-scheduler dry-runs preemption with its in-tree plugins only, which see the
    /// virtual node's summed capacity and never the lower nodes: no victim it could pick
    /// there makes a lower node take the pod. A no-fit is therefore never "resolvable".
    #[test]
    fn no_fit_is_unresolvable() {
        let args = decode(
            json!({"Pod": pod("6"), "NodeNames": ["vk-small"]})
                .to_string()
                .as_bytes(),
        )
        .unwrap();
        let (result, outcomes) = extender(OnUnknown::Fail).filter(&args);
        assert_eq!(outcomes, [Outcome::NoFit]);
        assert_eq!(result.failed_nodes, crate::wire::FailedNodesMap::new());
        assert_eq!(
            result.failed_and_unresolvable_nodes["vk-small"],
            "lower cluster of vk-small: no node fits cpu 6 (largest free 4)"
        );
    }

    /// A burst: kube-scheduler filters pod after pod before any lower copy appears.
    /// A pod that passed filter takes room until its lower copy does; the copy takes it
    /// from then on, scheduled below or not; a pod filtered again does not count against
    /// itself.
    #[test]
    fn pods_in_flight_take_room() {
        let e = Extender {
            clusters: [("vk".to_owned(), cluster("4", true))].into(),
            ..Extender::default()
        };
        let upper = |name: &str| {
            let mut pod = pod("3");
            pod["metadata"]["name"] = json!(name);
            pod["metadata"]["uid"] = json!(format!("uid-{name}"));
            pod
        };
        let filter = |name: &str| {
            let args = json!({"Pod": upper(name), "NodeNames": ["vk"]});
            e.filter(&decode(args.to_string().as_bytes()).unwrap()).0
        };
        let passes = |name: &str| filter(name).node_names.unwrap() == ["vk"];
        let refusal = |name: &str| filter(name).failed_and_unresolvable_nodes["vk"].clone();
        let full = "lower cluster of vk: no node fits cpu 3 (largest free 1)";
        assert!(passes("a"));
        assert_eq!(refusal("b"), full, "a is in flight");
        assert!(
            passes("a"),
            "filtered again, a does not count against itself"
        );
        let mut copy = upper("a");
        copy["metadata"]["annotations"] = json!({"tensile.dev/upper-uid": "uid-a"});
        copy["metadata"]["uid"] = json!("lower-uid-a");
        let copy: Pod = serde_json::from_value(copy).unwrap();
        e.clusters["vk"].write().cache.apply_pod(&copy);
        assert_eq!(
            refusal("b"),
            full,
            "a's copy, not scheduled yet, takes the room"
        );
        let mut bound = copy.clone();
        bound.spec.as_mut().unwrap().node_name = Some("n1".into());
        e.clusters["vk"].write().cache.apply_pod(&bound);
        assert_eq!(refusal("b"), full, "a's copy runs there");
        e.clusters["vk"].write().cache.delete_pod(&bound);
        assert!(passes("b"), "a is gone");
    }

    #[test]
    fn an_assumption_expires() {
        let e = Extender {
            clusters: [("vk".to_owned(), cluster("4", true))].into(),
            assume_ttl: Duration::from_secs(30),
            ..Extender::default()
        };
        let args = |name: &str| {
            let mut pod = pod("3");
            pod["metadata"]["name"] = json!(name);
            pod["metadata"]["uid"] = json!(format!("uid-{name}"));
            decode(
                json!({"Pod": pod, "NodeNames": ["vk"]})
                    .to_string()
                    .as_bytes(),
            )
            .unwrap()
        };
        let passes = |name: &str, now: Instant| {
            e.filter_at(&args(name), now).0.node_names.unwrap() == ["vk"]
        };
        let now = Instant::now();
        assert!(passes("a", now));
        assert!(!passes("b", now + Duration::from_secs(29)));
        assert!(
            passes("b", now + Duration::from_secs(31)),
            "a was never mirrored: 30 s after it was last judged, its assumption has expired"
        );
    }

    #[test]
    fn filter_whole_nodes_passes_them_back_untouched() {
        let node =
            |name: &str| json!({"metadata": {"name": name, "uid": "u"}, "status": {"extra": [1]}});
        let list = json!({"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                          "items": [node("regular"), node("vk-small"), node("vk-new")]});
        let args = decode(
            json!({"Pod": pod("1"), "Nodes": list})
                .to_string()
                .as_bytes(),
        )
        .unwrap();
        let (result, _) = extender(OnUnknown::Pass).filter(&args);
        let back = serde_json::to_value(result.nodes.unwrap()).unwrap();
        assert_eq!(
            back,
            json!({"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                   "items": [node("regular"), node("vk-small"), node("vk-new")]}),
            "--on-unknown=pass lets the unsynced cluster through"
        );
        assert!(result.node_names.is_none());
    }

    #[test]
    fn unreachable_and_bad_annotation_fail_unresolvable() {
        let e = extender(OnUnknown::Fail);
        e.clusters["vk-big"].write().unreachable = Some("connection refused".into());
        let mut bad = pod("1");
        bad["metadata"]["annotations"] = json!({"clusterSelector": "{"});
        let args = decode(
            json!({"Pod": bad, "NodeNames": ["vk-small", "vk-big"]})
                .to_string()
                .as_bytes(),
        )
        .unwrap();
        let (result, outcomes) = e.filter(&args);
        assert_eq!(result.node_names.unwrap(), Vec::<String>::new());
        assert_eq!(
            result.failed_and_unresolvable_nodes["vk-big"],
            "lower cluster of vk-big: unreachable (connection refused)"
        );
        assert!(
            result.failed_and_unresolvable_nodes["vk-small"].contains("clusterSelector"),
            "{:?}",
            result.failed_and_unresolvable_nodes
        );
        assert_eq!(outcomes, [Outcome::BadPod, Outcome::Unknown]);
        assert_eq!(
            e.ready().unwrap_err(),
            "vk-big: unreachable (connection refused); vk-new: not synced yet; upper nodes: not synced yet"
        );
    }

    #[test]
    fn a_failed_watch_is_not_trusted_until_it_lists_again() {
        let mut state = ClusterState::default();
        assert_eq!(state.known().unwrap_err(), "not synced yet");
        assert_eq!(state.listed(Watched::Nodes), None);
        assert_eq!(state.listed(Watched::Pods), None);
        assert_eq!(state.known(), Ok(()));
        state.watch_failed(Watched::Pods, "list: 403 Forbidden: no".into());
        let failing =
            "watch of pods failing (list: 403 Forbidden: no); waiting for a complete list";
        assert_eq!(state.known().unwrap_err(), failing);
        assert_eq!(state.listed(Watched::Nodes), None);
        assert_eq!(
            state.known().unwrap_err(),
            failing,
            "the node watch's list does not vouch for the pods"
        );
        assert_eq!(state.listed(Watched::Pods), Some(Watched::Pods));
        assert_eq!(state.known(), Ok(()));
        state.unreachable = Some("connection refused".into());
        state.watch_failed(Watched::Nodes, "watch: cut".into());
        assert_eq!(
            state.known().unwrap_err(),
            "unreachable (connection refused)",
            "unreachable says more than a failed watch"
        );
    }

    /// Local first, then the members in order: a table of candidates (name, upper
    /// labels or unknown upstairs) and the scores prioritize gives them.
    #[test]
    fn prioritize_orders_regular_then_members() {
        use crate::upper::BURST_PRIORITY_LABEL;
        let virt = |priority: Option<&str>| {
            let mut labels = json!({"type": "virtual-kubelet"});
            if let Some(p) = priority {
                labels[BURST_PRIORITY_LABEL] = json!(p);
            }
            Some(labels)
        };
        type Case<'a> = (
            &'a str,
            &'a [(&'a str, Option<serde_json::Value>)],
            bool,
            &'a [i64],
        );
        let cases: [Case<'_>; 7] = [
            (
                "a regular node beats any virtual one",
                &[("regular", Some(json!({}))), ("vk-a", virt(None))],
                false,
                &[10, 9],
            ),
            (
                "members by burst priority, lowest first",
                &[
                    ("vk-2", virt(Some("2"))),
                    ("regular", Some(json!({}))),
                    ("vk-1", virt(Some("1"))),
                ],
                false,
                &[8, 10, 9],
            ),
            (
                "equal priorities score equal (default scoring decides)",
                &[("vk-a", virt(Some("3"))), ("vk-b", virt(Some("3")))],
                false,
                &[9, 9],
            ),
            (
                "a configured cluster unknown upstairs is virtual, priority 0",
                &[("vk-big", None), ("vk-2", virt(Some("2"))), ("other", None)],
                false,
                &[9, 8, 10],
            ),
            (
                "a configured cluster takes its priority from its upper labels",
                &[("vk-big", virt(Some("5"))), ("vk-2", virt(Some("2")))],
                false,
                &[8, 9],
            ),
            (
                "a virtual node outside --cluster is still virtual",
                &[("vk-far", virt(Some("1"))), ("regular", Some(json!({})))],
                false,
                &[9, 10],
            ),
            (
                "an eager pod scores the same everywhere",
                &[
                    ("regular", Some(json!({}))),
                    ("vk-1", virt(Some("1"))),
                    ("vk-2", virt(Some("2"))),
                ],
                true,
                &[10, 10, 10],
            ),
        ];
        for (what, nodes, eager, want) in cases {
            let e = extender(OnUnknown::Fail);
            {
                let mut upper = e.upper.write();
                for (name, labels) in nodes {
                    if let Some(labels) = labels {
                        let meta = serde_json::from_value(json!({"name": name, "labels": labels}))
                            .unwrap();
                        upper.apply(&meta);
                    }
                }
            }
            let mut pod = pod("2");
            if eager {
                pod["metadata"]["annotations"] = json!({"tensile.dev/burst": "eager"});
            }
            let names: Vec<&str> = nodes.iter().map(|(n, _)| *n).collect();
            let args = decode(
                json!({"Pod": pod, "NodeNames": names})
                    .to_string()
                    .as_bytes(),
            )
            .unwrap();
            let scores: Vec<i64> = e.prioritize(&args).iter().map(|s| s.score).collect();
            assert_eq!(scores, want, "{what}");
        }
    }

    /// A pod that passed filter on two virtual nodes and a regular one goes to the regular
    /// node: prioritize says so, and its assumptions below end; between two members, it
    /// keeps only the one it goes to.
    #[test]
    fn prioritize_ends_assumptions_where_the_pod_is_not_going() {
        let e = Extender {
            clusters: [
                ("vk-1".to_owned(), cluster("4", true)),
                ("vk-2".to_owned(), cluster("4", true)),
            ]
            .into(),
            ..Extender::default()
        };
        for (name, priority) in [("vk-1", "1"), ("vk-2", "2")] {
            let meta = serde_json::from_value(json!({"name": name, "labels": {
                "type": "virtual-kubelet", "tensile.dev/burst-priority": priority}}))
            .unwrap();
            e.upper.write().apply(&meta);
        }
        let args = |name: &str, nodes: &[&str]| {
            let mut pod = pod("3");
            pod["metadata"]["name"] = json!(name);
            pod["metadata"]["uid"] = json!(format!("uid-{name}"));
            decode(
                json!({"Pod": pod, "NodeNames": nodes})
                    .to_string()
                    .as_bytes(),
            )
            .unwrap()
        };
        // Whether `name` passes filter on `node`; then filtered on a regular node alone, it
        // holds room nowhere.
        let passes = |name: &str, node: &str| {
            let passed = e.filter(&args(name, &[node])).0.node_names.unwrap() == [node];
            e.filter(&args(name, &["regular"]));
            passed
        };
        let all = ["regular", "vk-1", "vk-2"];
        e.filter(&args("a", &all));
        assert!(!passes("b", "vk-1"), "a is assumed on vk-1");
        e.prioritize(&args("a", &all));
        assert!(
            passes("b", "vk-1") && passes("b", "vk-2"),
            "a goes to regular"
        );
        e.filter(&args("c", &["vk-1", "vk-2"]));
        e.prioritize(&args("c", &["vk-1", "vk-2"]));
        assert!(!passes("d", "vk-1"), "c goes to vk-1 and holds its room");
        assert!(passes("d", "vk-2"), "not vk-2's");
    }

    /// Node granularity: a member shown as several virtual nodes (`vk-small-zone-a`, …,
    /// named `<nodename>-<group>`, not configured with `--cluster`) carries
    /// `type=virtual-kubelet` and the member's burst priority on each of them: prioritize
    /// ranks them by it, as it ranks the member's single node, and filter passes them
    /// untouched (the upper scheduler checks each against its own group's capacity, never
    /// the member's summed one, so a pod no group can hold is refused upstairs), even when
    /// unknown clusters fail.
    #[test]
    fn a_members_group_nodes_rank_by_its_burst_priority() {
        let e = extender(OnUnknown::Fail);
        for (name, priority) in [
            ("vk-small-zone-a", "1"),
            ("vk-small-zone-b", "1"),
            ("vk-big-zone-a", "2"),
        ] {
            let meta = serde_json::from_value(json!({"name": name, "labels": {
                "type": "virtual-kubelet", "tensile.dev/burst-priority": priority,
                "topology.kubernetes.io/zone": name.rsplit('-').next()}}))
            .unwrap();
            e.upper.write().apply(&meta);
        }
        let names = [
            "vk-big-zone-a",
            "regular",
            "vk-small-zone-a",
            "vk-small-zone-b",
        ];
        let args = decode(
            json!({"Pod": pod("64"), "NodeNames": names})
                .to_string()
                .as_bytes(),
        )
        .unwrap();
        let scores: Vec<i64> = e.prioritize(&args).iter().map(|s| s.score).collect();
        assert_eq!(scores, [8, 10, 9, 9]);
        let (passed, outcomes) = e.filter(&args);
        assert_eq!(passed.node_names.unwrap(), names);
        assert!(outcomes.iter().all(|o| *o == Outcome::NotVirtual));
    }

    /// `label=<key>` granularity: member `vk`'s zone `a` is two 2-CPU lower nodes (4 CPU
    /// summed, what its virtual node advertises), zone `b` one 4-CPU node. A 3-CPU pod
    /// passes on `vk-b` only (no lower node of zone `a` takes it), and holds that room:
    /// the next one passes nowhere. A group node whose member is not configured passes
    /// untouched; one without the annotation is judged on its member's whole cluster.
    #[test]
    fn a_group_node_is_judged_on_its_own_lower_nodes() {
        let member = SharedCluster::default();
        {
            let mut state = member.write();
            state.nodes_synced = true;
            state.pods_synced = true;
            for (name, zone, cpu) in [("a1", "a", "2"), ("a2", "a", "2"), ("b1", "b", "4")] {
                let node: Node = serde_json::from_value(json!({
                    "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}},
                    "status": {"allocatable": {"cpu": cpu, "memory": "8Gi", "pods": "110"},
                               "conditions": [{"type": "Ready", "status": "True"}]},
                }))
                .unwrap();
                state.cache.apply_node(&node);
            }
        }
        let e = Extender {
            clusters: [("vk".to_owned(), member)].into(),
            on_unknown: OnUnknown::Fail,
            ..Extender::default()
        };
        for (name, member, selector) in [
            ("vk-a", "vk", Some("topology.kubernetes.io/zone=a")),
            ("vk-b", "vk", Some("topology.kubernetes.io/zone=b")),
            ("vk-old", "vk", None),
            ("other-a", "other", Some("topology.kubernetes.io/zone=a")),
        ] {
            let meta = serde_json::from_value(json!({"name": name,
                "labels": {"type": "virtual-kubelet", "tensile.dev/member-node": member},
                "annotations": selector.map(|s| json!({"tensile.dev/lower-node-selector": s}))}))
            .unwrap();
            e.upper.write().apply(&meta);
        }
        let names = ["vk-a", "vk-b", "other-a", "regular"];
        let filter = |uid: &str, names: &[&str]| {
            let mut pod = pod("3");
            pod["metadata"]["uid"] = json!(uid);
            let args = decode(
                json!({"Pod": pod, "NodeNames": names})
                    .to_string()
                    .as_bytes(),
            )
            .unwrap();
            e.filter(&args)
        };
        let (first, outcomes) = filter("u1", &names);
        assert_eq!(first.node_names.unwrap(), ["vk-b", "other-a", "regular"]);
        assert_eq!(
            first.failed_and_unresolvable_nodes["vk-a"],
            "lower cluster of vk-a: no node fits cpu 3 (largest free 2)"
        );
        assert_eq!(
            outcomes,
            [
                Outcome::NoFit,
                Outcome::Fits,
                Outcome::NotVirtual,
                Outcome::NotVirtual
            ]
        );
        let (second, _) = filter("u2", &names);
        assert_eq!(
            second.failed_and_unresolvable_nodes["vk-b"],
            "lower cluster of vk-b: no node fits cpu 3 (largest free 1)",
            "u1 holds zone b's room"
        );
        let (old, _) = filter("u3", &["vk-old"]);
        assert_eq!(
            old.failed_and_unresolvable_nodes["vk-old"],
            "lower cluster of vk-old: no node fits cpu 3 (largest free 2)",
            "no annotation: every lower node, and u1's room is taken on b1"
        );
    }

    #[test]
    fn ready_waits_for_the_upper_nodes() {
        let e = Extender {
            clusters: [("vk".to_owned(), cluster("4", true))].into(),
            ..Extender::default()
        };
        assert_eq!(e.ready().unwrap_err(), "upper nodes: not synced yet");
        e.upper.write().relist_start();
        e.upper.write().relist_done();
        assert_eq!(e.ready(), Ok(()));
    }
}
