//! PURE: which burst pods come home this round. A pod Running and Ready on a virtual node
//! is evicted when its replacement would land on a regular node, judged by the fit the
//! upper scheduler applies (requests, taints and tolerations, node selector and required
//! node affinity, the topology spread it declares), after the pods already Pending
//! upstairs and this round's other moves have taken their room; and only once that room
//! has held for the window. No client, no async; table-tested.
//!
//! [`Memory`] is what a round remembers for the next: since when each pod has had room,
//! and, per owner, the moves whose replacements are not settled yet (one at a time for
//! owners no PodDisruptionBudget covers) and the back-off after a replacement that burst
//! again.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod, PodSpec, Taint};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::jiff::Timestamp;

use super::select::{VIRTUAL_NODE_LABEL, bound_at, is_static, is_system_critical};
use crate::node::burst::{BURST_ANNOTATION, BURST_EAGER, BURST_PRIORITY_LABEL};
use crate::node::placement::{label_selector_matches, selector_matches, tolerates};
use crate::node::resources::{
    ONE_POD, PODS, Resources, add, effect_repels, node_cordoned, node_ready, phase_is_terminal,
    pod_footprint, shortfall, to_resources,
};

/// The return-home strategy's limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReturnHome {
    /// How long a pod's room must have held before it moves.
    pub after: Duration,
    /// At most this many moves a round (`None`: no limit).
    pub max_per_round: Option<usize>,
    /// At most this many moves per owner a round; for an owner no PodDisruptionBudget
    /// covers, also at most this many replacements not yet Ready at home.
    pub max_per_owner: usize,
}

impl Default for ReturnHome {
    fn default() -> Self {
        Self {
            after: Duration::from_secs(60),
            max_per_round: Some(10),
            max_per_owner: 1,
        }
    }
}

/// A move whose replacement has shown neither at home nor on a virtual node after this
/// long is forgotten (the owner scaled in, say), so that it blocks its owner no longer.
const FORGET_AFTER: Duration = Duration::from_secs(300);
/// A replacement that burst again backs its owner off for the window times 2^n (n the
/// replacements in a row that did), at most this power.
const MAX_BACKOFF_DOUBLINGS: u32 = 5;

/// Why a pod on a virtual node stays there this round.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum HomeSkip {
    /// Being deleted.
    Deleting,
    /// In kube-system, a mirror or static pod, or of a system-critical priority.
    System,
    /// Owned by a DaemonSet.
    DaemonSet,
    /// No controller would make a replacement.
    NotControlled,
    /// A Job's: evicting it costs its progress (and a retry).
    Job,
    /// Annotated `tensile.dev/burst: eager`: it bursts by choice.
    Eager,
    /// Not Running and Ready below.
    NotReady,
    /// A claim it mounts was provisioned on the virtual node.
    PinnedByClaim,
    /// No regular node has room for it now.
    NoRoom,
    /// There is room, but not for the whole window yet.
    RoomNotHeld,
    /// A replacement of its owner burst again: backing off.
    BackedOff,
    /// Its owner has no PodDisruptionBudget and a replacement not yet Ready at home.
    InFlight,
    /// Its owner's moves for this round are made.
    OwnerLimit,
    /// This round's moves are made.
    RoundLimit,
}

impl HomeSkip {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Deleting => "deleting",
            Self::System => "system",
            Self::DaemonSet => "daemonset",
            Self::NotControlled => "not_controlled",
            Self::Job => "job",
            Self::Eager => "eager",
            Self::NotReady => "not_ready",
            Self::PinnedByClaim => "pinned_by_claim",
            Self::NoRoom => "no_room",
            Self::RoomNotHeld => "room_not_held",
            Self::BackedOff => "backed_off",
            Self::InFlight => "in_flight",
            Self::OwnerLimit => "owner_limit",
            Self::RoundLimit => "round_limit",
        }
    }

    /// Every reason, for metrics.
    pub const ALL: [HomeSkip; 14] = [
        Self::Deleting,
        Self::System,
        Self::DaemonSet,
        Self::NotControlled,
        Self::Job,
        Self::Eager,
        Self::NotReady,
        Self::PinnedByClaim,
        Self::NoRoom,
        Self::RoomNotHeld,
        Self::BackedOff,
        Self::InFlight,
        Self::OwnerLimit,
        Self::RoundLimit,
    ];
}

/// The verdict on one pod on a virtual node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HomeVerdict {
    /// Evict it: its replacement fits on regular node `to`.
    Move {
        /// The regular node whose room it is counted against.
        to: String,
        /// How long it has been on the virtual node.
        on_virtual: Duration,
    },
    /// Leave it.
    Skip(HomeSkip),
}

/// One pod's verdict.
#[derive(Clone, Debug)]
pub struct Judged<'a> {
    /// The pod.
    pub pod: &'a Pod,
    /// Its virtual node.
    pub node: String,
    /// What to do.
    pub verdict: HomeVerdict,
}

/// What a round sees of the upper cluster.
#[derive(Clone, Copy, Debug)]
pub struct Cluster<'a> {
    /// Every node.
    pub nodes: &'a [Node],
    /// Every pod.
    pub pods: &'a [Pod],
    /// Every PodDisruptionBudget (empty when they cannot be read: every owner is then
    /// moved one at a time, as if none had one).
    pub budgets: &'a [PodDisruptionBudget],
}

/// A round's plan.
#[derive(Clone, Debug, Default)]
pub struct Plan<'a> {
    /// The pods on the virtual nodes looked at, in the order they were judged (highest
    /// burst priority first, then newest).
    pub verdicts: Vec<Judged<'a>>,
    /// Replacements of earlier moves found on a virtual node this round.
    pub rebursts: Vec<&'a Pod>,
}

/// What rounds remember.
#[derive(Clone, Debug, Default)]
pub struct Memory {
    /// Pod UID → since when it has had room at home, round after round.
    room_since: BTreeMap<String, Timestamp>,
    /// Owner UID → its moves' follow-up.
    owners: BTreeMap<String, OwnerMemory>,
}

#[derive(Clone, Debug, Default)]
struct OwnerMemory {
    /// The owner's pods when it was last moved, and the replacements seen since.
    known: BTreeSet<String>,
    /// When each move whose replacement is not settled yet was made, oldest first.
    in_flight: Vec<Timestamp>,
    /// Replacements in a row that burst again.
    rebursts: u32,
    /// No move before this.
    backoff_until: Option<Timestamp>,
}

/// The pod's controller.
pub fn controller(pod: &Pod) -> Option<&OwnerReference> {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
}

/// Whether the pod is Running and its Ready condition True.
pub fn running_and_ready(pod: &Pod) -> bool {
    let Some(status) = &pod.status else {
        return false;
    };
    status.phase.as_deref() == Some("Running")
        && status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// Whether a pod on a virtual node may come home at all, and its controller if so (before
/// the claims it mounts are looked at, and the room).
pub fn eligible(pod: &Pod) -> Result<&OwnerReference, HomeSkip> {
    let meta = &pod.metadata;
    if meta.deletion_timestamp.is_some() {
        return Err(HomeSkip::Deleting);
    }
    if meta.namespace.as_deref() == Some("kube-system") || is_static(pod) || is_system_critical(pod)
    {
        return Err(HomeSkip::System);
    }
    let owner = controller(pod);
    match owner.map(|o| o.kind.as_str()) {
        Some("DaemonSet") => return Err(HomeSkip::DaemonSet),
        Some("Job") => return Err(HomeSkip::Job),
        None => return Err(HomeSkip::NotControlled),
        Some(_) => {}
    }
    let eager = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(BURST_ANNOTATION))
        .is_some_and(|v| v.trim() == BURST_EAGER);
    if eager {
        return Err(HomeSkip::Eager);
    }
    if !running_and_ready(pod) {
        return Err(HomeSkip::NotReady);
    }
    owner.ok_or(HomeSkip::NotControlled)
}

fn elapsed(now: Timestamp, since: Timestamp) -> Duration {
    Duration::try_from(now.duration_since(since)).unwrap_or_default()
}

fn later(now: Timestamp, by: Duration) -> Timestamp {
    now.checked_add(by).unwrap_or(now)
}

fn node_name(pod: &Pod) -> Option<&str> {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .filter(|n| !n.is_empty())
}

fn uid(pod: &Pod) -> &str {
    pod.metadata.uid.as_deref().unwrap_or_default()
}

/// Whether a pod holds room: not finished (one being deleted holds its node's room until
/// it is gone).
fn takes_room(pod: &Pod) -> bool {
    !phase_is_terminal(pod.status.as_ref().and_then(|s| s.phase.as_deref()))
}

/// A node as the fit sees it.
struct NodeView<'a> {
    name: &'a str,
    labels: BTreeMap<String, String>,
    virtual_: bool,
    schedulable: bool,
    taints: Vec<&'a Taint>,
    allocatable: Resources,
    used: Resources,
}

/// Where each pod that counts for topology spread is (or will be, after this round's
/// moves and the Pending pods' placement).
struct Placed<'a> {
    uid: &'a str,
    namespace: &'a str,
    labels: Option<&'a BTreeMap<String, String>>,
    node: usize,
}

struct World<'a> {
    nodes: Vec<NodeView<'a>>,
    placed: Vec<Placed<'a>>,
}

impl<'a> World<'a> {
    fn new(cluster: &Cluster<'a>) -> Self {
        let mut nodes: Vec<NodeView<'a>> = cluster
            .nodes
            .iter()
            .map(|n| {
                let labels = n.metadata.labels.clone().unwrap_or_default();
                let virtual_ = labels.get(VIRTUAL_NODE_LABEL.0).map(String::as_str)
                    == Some(VIRTUAL_NODE_LABEL.1);
                NodeView {
                    name: n.metadata.name.as_deref().unwrap_or_default(),
                    labels,
                    virtual_,
                    schedulable: node_ready(n) && !node_cordoned(n),
                    taints: n
                        .spec
                        .as_ref()
                        .and_then(|s| s.taints.as_ref())
                        .into_iter()
                        .flatten()
                        .filter(|t| effect_repels(&t.effect))
                        .collect(),
                    allocatable: n
                        .status
                        .as_ref()
                        .and_then(|s| s.allocatable.as_ref())
                        .map(to_resources)
                        .unwrap_or_default(),
                    used: Resources::new(),
                }
            })
            .collect();
        let index: BTreeMap<&str, usize> =
            nodes.iter().enumerate().map(|(i, n)| (n.name, i)).collect();
        let mut placed = Vec::new();
        for pod in cluster.pods.iter().filter(|p| takes_room(p)) {
            let Some(&i) = node_name(pod).and_then(|n| index.get(n)) else {
                continue;
            };
            if let Some(spec) = &pod.spec {
                add(&mut nodes[i].used, &pod_footprint(spec));
            }
            // Topology spread does not count pods being deleted.
            if pod.metadata.deletion_timestamp.is_none() {
                placed.push(Placed {
                    uid: uid(pod),
                    namespace: pod.metadata.namespace.as_deref().unwrap_or_default(),
                    labels: pod.metadata.labels.as_ref(),
                    node: i,
                });
            }
        }
        Self { nodes, placed }
    }

    fn index(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == name)
    }

    /// The regular node with the most room that `pod` fits on now, as the upper
    /// scheduler's filters decide.
    fn best_home(&self, pod: &Pod) -> Option<usize> {
        let spec = pod.spec.as_ref()?;
        let footprint = pod_footprint(spec);
        let free = |i: usize, resource: &str| {
            let n = &self.nodes[i];
            n.allocatable.get(resource).copied().unwrap_or_default()
                - n.used.get(resource).copied().unwrap_or_default()
        };
        (0..self.nodes.len())
            .filter(|&i| !self.nodes[i].virtual_ && self.fits(pod, spec, &footprint, i))
            .max_by(|&a, &b| {
                (
                    free(a, "cpu"),
                    free(a, "memory"),
                    std::cmp::Reverse(self.nodes[a].name),
                )
                    .cmp(&(
                        free(b, "cpu"),
                        free(b, "memory"),
                        std::cmp::Reverse(self.nodes[b].name),
                    ))
            })
    }

    fn fits(&self, pod: &Pod, spec: &PodSpec, footprint: &Resources, i: usize) -> bool {
        let node = &self.nodes[i];
        if !node.schedulable {
            return false;
        }
        let tolerations = spec.tolerations.as_deref().unwrap_or_default();
        let tolerated = node
            .taints
            .iter()
            .all(|taint| tolerations.iter().any(|t| tolerates(t, taint)));
        if !tolerated || !node_affinity_matches(spec, node.name, &node.labels) {
            return false;
        }
        if shortfall(&node.allocatable, &node.used, footprint).is_some() {
            return false;
        }
        if let Some(pods) = node.allocatable.get(PODS)
            && node.used.get(PODS).copied().unwrap_or_default() + ONE_POD > *pods
        {
            return false;
        }
        self.spread_allows(pod, spec, i)
    }

    /// The `DoNotSchedule` topology spread constraints, as the scheduler's PodTopologySpread
    /// filter reads them (its default policies: node affinity honoured, taints ignored).
    fn spread_allows(&self, pod: &Pod, spec: &PodSpec, target: usize) -> bool {
        let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
        let own_labels = pod.metadata.labels.as_ref();
        for constraint in spec.topology_spread_constraints.iter().flatten() {
            if constraint.when_unsatisfiable != "DoNotSchedule" {
                continue;
            }
            let key = &constraint.topology_key;
            let Some(target_domain) = self.nodes[target].labels.get(key) else {
                return false;
            };
            let Some(selector) = &constraint.label_selector else {
                continue;
            };
            // matchLabelKeys: the pod's own values of those keys narrow the selector.
            let mut own = BTreeMap::new();
            for k in constraint.match_label_keys.iter().flatten() {
                if let Some(v) = own_labels.and_then(|l| l.get(k)) {
                    own.insert(k.clone(), v.clone());
                }
            }
            let matches = |labels: Option<&BTreeMap<String, String>>| {
                label_selector_matches(selector, labels)
                    && own
                        .iter()
                        .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
            };
            let mut counts: BTreeMap<&str, i64> = self
                .nodes
                .iter()
                .filter(|n| node_affinity_matches(spec, n.name, &n.labels))
                .filter_map(|n| n.labels.get(key).map(|d| (d.as_str(), 0)))
                .collect();
            for p in &self.placed {
                if p.uid != uid(pod) && p.namespace == namespace && matches(p.labels) {
                    let node = &self.nodes[p.node];
                    if let Some(count) = node
                        .labels
                        .get(key)
                        .and_then(|d| counts.get_mut(d.as_str()))
                    {
                        *count += 1;
                    }
                }
            }
            let min_domains = constraint.min_domains.unwrap_or(1).max(1);
            let min = if counts.len() < usize::try_from(min_domains).unwrap_or(usize::MAX) {
                0
            } else {
                counts.values().copied().min().unwrap_or(0)
            };
            let here = counts.get(target_domain.as_str()).copied().unwrap_or(0);
            let own_match = i64::from(matches(own_labels));
            if here + own_match - min > i64::from(constraint.max_skew) {
                return false;
            }
        }
        true
    }

    /// Counts `pod` on node `to` from now on (moved there, or Pending and placed there).
    fn reserve(&mut self, pod: &'a Pod, to: usize) {
        if let Some(spec) = &pod.spec {
            add(&mut self.nodes[to].used, &pod_footprint(spec));
        }
        let id = uid(pod);
        match self
            .placed
            .iter_mut()
            .find(|p| p.uid == id && !id.is_empty())
        {
            Some(placed) => placed.node = to,
            None => self.placed.push(Placed {
                uid: id,
                namespace: pod.metadata.namespace.as_deref().unwrap_or_default(),
                labels: pod.metadata.labels.as_ref(),
                node: to,
            }),
        }
    }
}

/// The pod's node selector and required node affinity against a node.
fn node_affinity_matches(spec: &PodSpec, name: &str, labels: &BTreeMap<String, String>) -> bool {
    let selector_ok = spec
        .node_selector
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    selector_ok && required.is_none_or(|r| selector_matches(r, name, labels))
}

/// Whether a PodDisruptionBudget in the pod's namespace selects it.
pub fn has_budget(pod: &Pod, budgets: &[PodDisruptionBudget]) -> bool {
    budgets.iter().any(|b| {
        b.metadata.namespace == pod.metadata.namespace
            && b.spec
                .as_ref()
                .and_then(|s| s.selector.as_ref())
                .is_some_and(|s| label_selector_matches(s, pod.metadata.labels.as_ref()))
    })
}

impl Memory {
    /// This round's plan over `cluster`, for the pods on `virtual_nodes` (those in
    /// `pinned`, by UID, mount a claim provisioned on their node). Updates what rounds
    /// remember: room held, replacements settled or burst again.
    pub fn plan<'a>(
        &mut self,
        cluster: &Cluster<'a>,
        virtual_nodes: &BTreeSet<String>,
        pinned: &BTreeSet<String>,
        limits: &ReturnHome,
        now: Timestamp,
    ) -> Plan<'a> {
        let mut world = World::new(cluster);
        let mut plan = Plan {
            rebursts: self.follow_up(cluster, &world, limits, now),
            ..Plan::default()
        };

        // Pods Pending upstairs take their room first: the scheduler places them before any
        // replacement made now. Higher priority first, then older, as its queue does.
        let mut pending: Vec<&Pod> = cluster
            .pods
            .iter()
            .filter(|p| {
                node_name(p).is_none()
                    && p.metadata.deletion_timestamp.is_none()
                    && takes_room(p)
                    && p.spec
                        .as_ref()
                        .is_some_and(|s| s.scheduling_gates.as_ref().is_none_or(Vec::is_empty))
            })
            .collect();
        pending.sort_by_key(|p| {
            (
                std::cmp::Reverse(p.spec.as_ref().and_then(|s| s.priority).unwrap_or(0)),
                p.metadata.creation_timestamp.as_ref().map(|t| t.0),
                uid(p).to_owned(),
            )
        });
        for pod in pending {
            if let Some(home) = world.best_home(pod) {
                world.reserve(pod, home);
            }
        }

        // The candidates: highest burst priority first (the most expensive capacity),
        // then newest.
        let priority = |node: &str| {
            world
                .index(node)
                .and_then(|i| world.nodes[i].labels.get(BURST_PRIORITY_LABEL))
                .and_then(|p| p.trim().parse::<u32>().ok())
                .unwrap_or(0)
        };
        let mut candidates: Vec<(&'a Pod, String, u32)> = cluster
            .pods
            .iter()
            .filter_map(|p| {
                let node = node_name(p)?;
                virtual_nodes
                    .contains(node)
                    .then(|| (p, node.to_owned(), priority(node)))
            })
            .collect();
        candidates.sort_by(|(a, _, pa), (b, _, pb)| {
            let key = |p: &Pod| {
                (
                    p.metadata.creation_timestamp.as_ref().map(|t| t.0),
                    p.metadata.namespace.clone(),
                    p.metadata.name.clone(),
                )
            };
            pb.cmp(pa).then_with(|| key(b).cmp(&key(a)))
        });
        let seen: BTreeSet<&str> = candidates.iter().map(|(p, _, _)| uid(p)).collect();
        self.room_since.retain(|id, _| seen.contains(id.as_str()));

        let mut moves = 0usize;
        let mut owner_moves: BTreeMap<&str, usize> = BTreeMap::new();
        for (pod, node, _) in candidates {
            let verdict = self.judge(
                &mut world,
                cluster,
                pod,
                pinned,
                limits,
                now,
                &mut moves,
                &mut owner_moves,
            );
            plan.verdicts.push(Judged { pod, node, verdict });
        }
        plan
    }

    #[allow(clippy::too_many_arguments)] // one round's running state, threaded through
    fn judge<'a>(
        &mut self,
        world: &mut World<'a>,
        cluster: &Cluster<'a>,
        pod: &'a Pod,
        pinned: &BTreeSet<String>,
        limits: &ReturnHome,
        now: Timestamp,
        moves: &mut usize,
        owner_moves: &mut BTreeMap<&'a str, usize>,
    ) -> HomeVerdict {
        let id = uid(pod);
        let owner = match eligible(pod) {
            Ok(_) if pinned.contains(id) => Err(HomeSkip::PinnedByClaim),
            other => other,
        };
        let owner = match owner {
            Ok(owner) => owner,
            Err(skip) => {
                self.room_since.remove(id);
                return HomeVerdict::Skip(skip);
            }
        };
        let memory = self.owners.get(&owner.uid);
        // Backed off: its room is not spoken for, and must hold a whole window again after.
        if memory
            .and_then(|m| m.backoff_until)
            .is_some_and(|until| until > now)
        {
            self.room_since.remove(id);
            return HomeVerdict::Skip(HomeSkip::BackedOff);
        }
        let Some(home) = world.best_home(pod) else {
            self.room_since.remove(id);
            return HomeVerdict::Skip(HomeSkip::NoRoom);
        };
        // Spoken for in priority order, whether it moves this round or a later one: a pod
        // further down does not take the room of one waiting for its window or its turn.
        world.reserve(pod, home);
        let since = *self.room_since.entry(id.to_owned()).or_insert(now);
        if elapsed(now, since) < limits.after {
            return HomeVerdict::Skip(HomeSkip::RoomNotHeld);
        }
        let in_flight = memory.map_or(0, |m| m.in_flight.len());
        if in_flight >= limits.max_per_owner && !has_budget(pod, cluster.budgets) {
            return HomeVerdict::Skip(HomeSkip::InFlight);
        }
        let owned = owner_moves.entry(owner.uid.as_str()).or_default();
        if *owned >= limits.max_per_owner {
            return HomeVerdict::Skip(HomeSkip::OwnerLimit);
        }
        if limits.max_per_round.is_some_and(|max| *moves >= max) {
            return HomeVerdict::Skip(HomeSkip::RoundLimit);
        }
        *owned += 1;
        *moves += 1;
        HomeVerdict::Move {
            to: world.nodes[home].name.to_owned(),
            on_virtual: bound_at(pod).map(|t| elapsed(now, t)).unwrap_or_default(),
        }
    }

    /// Looks at the replacements of earlier moves: settled (Ready on a regular node), or
    /// burst again (bound to a virtual node: counted, and the owner backs off).
    fn follow_up<'a>(
        &mut self,
        cluster: &Cluster<'a>,
        world: &World<'a>,
        limits: &ReturnHome,
        now: Timestamp,
    ) -> Vec<&'a Pod> {
        let mut rebursts = Vec::new();
        let virtual_node = |name: &str| world.index(name).is_some_and(|i| world.nodes[i].virtual_);
        for (owner, memory) in &mut self.owners {
            memory
                .in_flight
                .retain(|at| elapsed(now, *at) < FORGET_AFTER);
            let mut fresh: Vec<&'a Pod> = cluster
                .pods
                .iter()
                .filter(|p| {
                    controller(p).is_some_and(|o| &o.uid == owner)
                        && !memory.known.contains(uid(p))
                        && p.metadata.deletion_timestamp.is_none()
                })
                .collect();
            fresh.sort_by_key(|p| p.metadata.creation_timestamp.as_ref().map(|t| t.0));
            for pod in fresh {
                if memory.in_flight.is_empty() {
                    // Nothing of ours is awaited: a new pod is the owner's own doing.
                    memory.known.insert(uid(pod).to_owned());
                    continue;
                }
                match node_name(pod) {
                    Some(node) if virtual_node(node) => {
                        memory.known.insert(uid(pod).to_owned());
                        memory.in_flight.remove(0);
                        memory.rebursts = memory.rebursts.saturating_add(1);
                        let doublings = memory.rebursts.min(MAX_BACKOFF_DOUBLINGS);
                        let backoff = limits.after.saturating_mul(1 << doublings);
                        memory.backoff_until = Some(later(now, backoff));
                        rebursts.push(pod);
                    }
                    Some(_) if running_and_ready(pod) => {
                        memory.known.insert(uid(pod).to_owned());
                        memory.in_flight.remove(0);
                        memory.rebursts = 0;
                    }
                    _ => {}
                }
            }
        }
        self.owners.retain(|_, m| {
            !m.in_flight.is_empty() || m.backoff_until.is_some_and(|until| until > now)
        });
        rebursts
    }

    /// Records that `pod` was evicted at `now` to come home: its owner's pods now are
    /// known, so that the replacement is the one that is not.
    pub fn moved(&mut self, pods: &[Pod], pod: &Pod, now: Timestamp) {
        let Some(owner) = controller(pod) else {
            return;
        };
        let memory = self.owners.entry(owner.uid.clone()).or_default();
        memory.known.extend(
            pods.iter()
                .filter(|p| controller(p).is_some_and(|o| o.uid == owner.uid))
                .map(|p| uid(p).to_owned()),
        );
        memory.in_flight.push(now);
        self.room_since.remove(uid(pod));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    use serde_json::{Value, json};

    const T0: i64 = 1_000_000;
    const WINDOW: u64 = 60;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(T0 + secs).unwrap()
    }

    fn merge(base: &mut Value, extra: Value) {
        match (base, extra) {
            (Value::Object(b), Value::Object(e)) => {
                for (k, v) in e {
                    merge(b.entry(k).or_insert(Value::Null), v);
                }
            }
            (b, e) => *b = e,
        }
    }

    /// A Ready node of `cpu` CPUs (and 110 pods), merged with `extra`.
    fn node(name: &str, cpu: &str, extra: Value) -> Node {
        let mut base = json!({
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "spec": {},
            "status": {"allocatable": {"cpu": cpu, "memory": "32Gi", "pods": "110"},
                       "conditions": [{"type": "Ready", "status": "True"}]},
        });
        merge(&mut base, extra);
        serde_json::from_value(base).unwrap()
    }

    /// A virtual node of burst priority `priority`.
    fn vk(name: &str, priority: u32) -> Node {
        node(
            name,
            "100",
            json!({"metadata": {"labels": {"type": "virtual-kubelet",
                "tensile.dev/burst-priority": priority.to_string()}},
                "spec": {"taints": [{"key": "virtual-kubelet.io/provider", "value": "k8s",
                    "effect": "NoSchedule"}]}}),
        )
    }

    /// A pod of ReplicaSet `owner` (app=`owner`) asking 1 CPU, created `age` seconds before
    /// T0, on `node` (None: Pending upstairs), Running and Ready when bound; merged with
    /// `extra`.
    fn pod(name: &str, owner: &str, node: Option<&str>, age: i64, extra: Value) -> Pod {
        let mut base = json!({
            "metadata": {"name": name, "namespace": "app", "uid": format!("uid-{name}"),
                "labels": {"app": owner},
                "creationTimestamp": Timestamp::from_second(T0 - age).unwrap().to_string(),
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                    "name": owner, "uid": format!("uid-{owner}"), "controller": true}]},
            "spec": {"containers": [{"name": "c", "image": "i",
                "resources": {"requests": {"cpu": "1"}}}],
                "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}]},
            "status": {"phase": "Pending"},
        });
        if let Some(node) = node {
            merge(
                &mut base,
                json!({"spec": {"nodeName": node}, "status": {"phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True"},
                        {"type": "PodScheduled", "status": "True",
                         "lastTransitionTime": Timestamp::from_second(T0 - age).unwrap().to_string()}]}}),
            );
        }
        merge(&mut base, extra);
        serde_json::from_value(base).unwrap()
    }

    fn budget(app: &str) -> PodDisruptionBudget {
        serde_json::from_value(json!({"metadata": {"name": app, "namespace": "app"},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": app}}}}))
        .unwrap()
    }

    fn virtual_nodes() -> BTreeSet<String> {
        ["vk".to_owned(), "vk2".to_owned()].into()
    }

    fn limits() -> ReturnHome {
        ReturnHome {
            after: Duration::from_secs(WINDOW),
            max_per_round: Some(10),
            max_per_owner: 1,
        }
    }

    /// Each pod's verdict: `move:<node>` or the skip's label.
    fn verdicts(plan: &Plan) -> Vec<(String, String)> {
        plan.verdicts
            .iter()
            .map(|j| {
                let v = match &j.verdict {
                    HomeVerdict::Move { to, .. } => format!("move:{to}"),
                    HomeVerdict::Skip(s) => s.label().to_owned(),
                };
                (j.pod.metadata.name.clone().unwrap(), v)
            })
            .collect()
    }

    /// Two rounds a window apart over the same cluster: the second's verdicts.
    fn after_window(
        nodes: &[Node],
        pods: &[Pod],
        budgets: &[PodDisruptionBudget],
        pinned: &[&str],
        limits: &ReturnHome,
    ) -> Vec<(String, String)> {
        let cluster = Cluster {
            nodes,
            pods,
            budgets,
        };
        let pinned: BTreeSet<String> = pinned.iter().map(|p| format!("uid-{p}")).collect();
        let mut memory = Memory::default();
        memory.plan(&cluster, &virtual_nodes(), &pinned, limits, at(0));
        let plan = memory.plan(
            &cluster,
            &virtual_nodes(),
            &pinned,
            limits,
            at(WINDOW as i64),
        );
        verdicts(&plan)
    }

    fn want(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
            .collect()
    }

    /// 4 CPUs on `w1`, of which `used` taken by a filler pod.
    fn one_regular(used: u32) -> Vec<Pod> {
        (0..used)
            .map(|i| pod(&format!("filler-{i}"), "filler", Some("w1"), 500, json!({})))
            .collect()
    }

    #[test]
    fn which_pods_come_home() {
        let regular = || vec![node("w1", "4", json!({})), vk("vk", 1), vk("vk2", 2)];
        let web = |name: &str, age: i64| pod(name, "web", Some("vk"), age, json!({}));
        let with = |mut pods: Vec<Pod>, more: Vec<Pod>| {
            pods.extend(more);
            pods
        };
        let unlimited = ReturnHome {
            max_per_owner: 10,
            max_per_round: None,
            ..limits()
        };
        #[allow(clippy::type_complexity)]
        let cases: Vec<(&str, Vec<Node>, Vec<Pod>, Vec<PodDisruptionBudget>, &[&str], ReturnHome, Vec<(String, String)>)> = vec![
            (
                "room: it moves",
                regular(),
                with(one_regular(3), vec![web("a", 100)]),
                vec![],
                &[],
                limits(),
                want(&[("a", "move:w1")]),
            ),
            (
                "no room",
                regular(),
                with(one_regular(4), vec![web("a", 100)]),
                vec![],
                &[],
                limits(),
                want(&[("a", "no_room")]),
            ),
            (
                "the room goes to a pod Pending upstairs first",
                regular(),
                with(
                    one_regular(3),
                    vec![web("a", 100), pod("other", "other", None, 10, json!({}))],
                ),
                vec![],
                &[],
                limits(),
                want(&[("a", "no_room")]),
            ),
            (
                "a gated Pending pod takes nothing",
                regular(),
                with(
                    one_regular(3),
                    vec![
                        web("a", 100),
                        pod("gated", "other", None, 10,
                            json!({"spec": {"schedulingGates": [{"name": "g"}]}})),
                    ],
                ),
                vec![],
                &[],
                limits(),
                want(&[("a", "move:w1")]),
            ),
            (
                "room for one of two owners: the most expensive node's first",
                regular(),
                with(
                    one_regular(3),
                    vec![web("a", 10), pod("b", "api", Some("vk2"), 100, json!({}))],
                ),
                vec![],
                &[],
                limits(),
                want(&[("b", "move:w1"), ("a", "no_room")]),
            ),
            (
                "same priority: newest first",
                regular(),
                with(
                    one_regular(3),
                    vec![web("old", 100), pod("new", "api", Some("vk"), 10, json!({}))],
                ),
                vec![],
                &[],
                limits(),
                want(&[("new", "move:w1"), ("old", "no_room")]),
            ),
            (
                "a taint it does not tolerate",
                vec![
                    node("w1", "4", json!({"spec": {"taints": [{"key": "gpu", "effect": "NoSchedule"}]}})),
                    vk("vk", 1),
                ],
                vec![web("a", 100)],
                vec![],
                &[],
                limits(),
                want(&[("a", "no_room")]),
            ),
            (
                "a PreferNoSchedule taint does not keep it away",
                vec![
                    node("w1", "4", json!({"spec": {"taints": [{"key": "gpu", "effect": "PreferNoSchedule"}]}})),
                    vk("vk", 1),
                ],
                vec![web("a", 100)],
                vec![],
                &[],
                limits(),
                want(&[("a", "move:w1")]),
            ),
            (
                "a taint it tolerates",
                vec![
                    node("w1", "4", json!({"spec": {"taints": [{"key": "gpu", "value": "a", "effect": "NoSchedule"}]}})),
                    vk("vk", 1),
                ],
                vec![pod("a", "web", Some("vk"), 100, json!({"spec": {"tolerations": [
                    {"key": "gpu", "operator": "Equal", "value": "a", "effect": "NoSchedule"}]}}))],
                vec![],
                &[],
                limits(),
                want(&[("a", "move:w1")]),
            ),
            (
                "a cordoned or NotReady node",
                vec![
                    node("w1", "4", json!({"spec": {"unschedulable": true}})),
                    node("w2", "4", json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}})),
                    vk("vk", 1),
                ],
                vec![web("a", 100)],
                vec![],
                &[],
                limits(),
                want(&[("a", "no_room")]),
            ),
            (
                "its node selector",
                vec![node("w1", "4", json!({})), node("w2", "2", json!({"metadata": {"labels": {"disk": "ssd"}}})), vk("vk", 1)],
                vec![pod("a", "web", Some("vk"), 100, json!({"spec": {"nodeSelector": {"disk": "ssd"}}}))],
                vec![],
                &[],
                limits(),
                want(&[("a", "move:w2")]),
            ),
            (
                "its required node affinity",
                vec![node("w1", "4", json!({})), vk("vk", 1)],
                vec![pod("a", "web", Some("vk"), 100, json!({"spec": {"affinity": {"nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}}}))],
                vec![],
                &[],
                limits(),
                want(&[("a", "no_room")]),
            ),
            (
                "the pods count",
                vec![node("w1", "4", json!({"status": {"allocatable": {"pods": "3"}}})), vk("vk", 1)],
                with(one_regular(3), vec![web("a", 100)]),
                vec![],
                &[],
                limits(),
                want(&[("a", "no_room")]),
            ),
            (
                "topology spread over hostnames: w1 would hold too many",
                vec![node("w1", "4", json!({})), node("w2", "0", json!({})), vk("vk", 1)],
                vec![
                    web("w-1", 500), web("a", 100),
                ]
                .into_iter()
                .map(|mut p| {
                    p.spec.as_mut().unwrap().topology_spread_constraints = Some(vec![
                        serde_json::from_value(json!({"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "DoNotSchedule", "labelSelector": {"matchLabels": {"app": "web"}}})).unwrap()]);
                    p
                })
                .map(|mut p| {
                    if p.metadata.name.as_deref() == Some("w-1") {
                        p.spec.as_mut().unwrap().node_name = Some("w1".into());
                    }
                    p
                })
                .collect(),
                vec![],
                &[],
                limits(),
                // w1 would hold 2, w2 none: skew 2.
                want(&[("a", "no_room")]),
            ),
            (
                "topology spread that allows it",
                vec![node("w1", "4", json!({})), vk("vk", 1)],
                vec![pod("a", "web", Some("vk"), 100, json!({"spec": {"topologySpreadConstraints": [
                    {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                     "whenUnsatisfiable": "DoNotSchedule", "labelSelector": {"matchLabels": {"app": "web"}}}]}}))],
                vec![],
                &[],
                limits(),
                want(&[("a", "move:w1")]),
            ),
            (
                "left alone: eager, bare, DaemonSet, Job, critical, terminating, not Ready, pinned",
                regular(),
                vec![
                    pod("eager", "web", Some("vk"), 1, json!({"metadata": {"annotations": {"tensile.dev/burst": "eager"}}})),
                    pod("bare", "web", Some("vk"), 2, json!({"metadata": {"ownerReferences": []}})),
                    pod("ds", "web", Some("vk"), 3, json!({"metadata": {"ownerReferences": [{"apiVersion": "apps/v1",
                        "kind": "DaemonSet", "name": "d", "uid": "u", "controller": true}]}})),
                    pod("job", "web", Some("vk"), 4, json!({"metadata": {"ownerReferences": [{"apiVersion": "batch/v1",
                        "kind": "Job", "name": "j", "uid": "u", "controller": true}]}})),
                    pod("critical", "web", Some("vk"), 5, json!({"spec": {"priorityClassName": "system-cluster-critical"}})),
                    pod("going", "web", Some("vk"), 6, json!({"metadata": {"deletionTimestamp": at(0).to_string()}})),
                    pod("starting", "web", Some("vk"), 7, json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}})),
                    pod("pending", "web", Some("vk"), 8, json!({"status": {"phase": "Pending"}})),
                    pod("pinned", "web", Some("vk"), 9, json!({})),
                ],
                vec![],
                &["pinned"],
                limits(),
                want(&[
                    ("eager", "eager"),
                    ("bare", "not_controlled"),
                    ("ds", "daemonset"),
                    ("job", "job"),
                    ("critical", "system"),
                    ("going", "deleting"),
                    ("starting", "not_ready"),
                    ("pending", "not_ready"),
                    ("pinned", "pinned_by_claim"),
                ]),
            ),
            (
                "pods on regular nodes are not candidates",
                regular(),
                with(one_regular(1), vec![web("a", 100)]),
                vec![],
                &[],
                limits(),
                want(&[("a", "move:w1")]),
            ),
            (
                "one move per owner a round",
                regular(),
                vec![web("a", 10), web("b", 20)],
                vec![budget("web")],
                &[],
                limits(),
                want(&[("a", "move:w1"), ("b", "owner_limit")]),
            ),
            (
                "more per owner when allowed, and the room is shared out",
                regular(),
                with(one_regular(1), vec![web("a", 10), web("b", 20), web("c", 30), web("d", 40)]),
                vec![],
                &[],
                unlimited.clone(),
                want(&[("a", "move:w1"), ("b", "move:w1"), ("c", "move:w1"), ("d", "no_room")]),
            ),
            (
                "the round's limit",
                regular(),
                vec![web("a", 10), pod("b", "api", Some("vk"), 20, json!({})), pod("c", "db", Some("vk"), 30, json!({}))],
                vec![],
                &[],
                ReturnHome {
                    max_per_round: Some(2),
                    ..limits()
                },
                want(&[("a", "move:w1"), ("b", "move:w1"), ("c", "round_limit")]),
            ),
        ];
        for (name, nodes, pods, budgets, pinned, limits, want) in cases {
            assert_eq!(
                after_window(&nodes, &pods, &budgets, pinned, &limits),
                want,
                "{name}"
            );
        }
    }

    /// Room must hold for the window, round after round; a node that fills again resets it.
    #[test]
    fn room_must_hold_for_the_window() {
        let nodes = [node("w1", "4", json!({})), vk("vk", 1)];
        let web = pod("a", "web", Some("vk"), 100, json!({}));
        let mut room = one_regular(3);
        room.push(web.clone());
        let mut full = one_regular(4);
        full.push(web);
        let virtual_nodes = virtual_nodes();
        let mut memory = Memory::default();
        let rounds: [(i64, &[Pod], &str); 6] = [
            (0, &room, "room_not_held"),
            (WINDOW as i64 - 1, &room, "room_not_held"),
            (WINDOW as i64, &full, "no_room"),
            (WINDOW as i64 + 1, &room, "room_not_held"),
            (2 * WINDOW as i64, &room, "room_not_held"),
            (2 * WINDOW as i64 + 1, &room, "move:w1"),
        ];
        for (t, pods, want) in rounds {
            let cluster = Cluster {
                nodes: &nodes,
                pods,
                budgets: &[],
            };
            let plan = memory.plan(&cluster, &virtual_nodes, &BTreeSet::new(), &limits(), at(t));
            assert_eq!(verdicts(&plan)[0].1, want, "at {t}");
        }
    }

    /// An owner without a PodDisruptionBudget moves one pod at a time: the next once the
    /// replacement is Ready at home. One with a budget leaves it to the Eviction API.
    #[test]
    fn one_at_a_time_without_a_budget() {
        let nodes = [node("w1", "4", json!({})), vk("vk", 1)];
        let a = pod("a", "web", Some("vk"), 10, json!({}));
        let b = pod("b", "web", Some("vk"), 20, json!({}));
        for (budgets, want_while_pending) in
            [(vec![], "in_flight"), (vec![budget("web")], "move:w1")]
        {
            let mut memory = Memory::default();
            let round = |memory: &mut Memory, pods: &[Pod], t: i64| {
                let cluster = Cluster {
                    nodes: &nodes,
                    pods,
                    budgets: &budgets,
                };
                verdicts(&memory.plan(
                    &cluster,
                    &virtual_nodes(),
                    &BTreeSet::new(),
                    &limits(),
                    at(t),
                ))
            };
            let pods = [a.clone(), b.clone()];
            round(&mut memory, &pods, 0);
            let w = WINDOW as i64;
            assert_eq!(
                round(&mut memory, &pods, w),
                want(&[("a", "move:w1"), ("b", "owner_limit")])
            );
            memory.moved(&pods, &a, at(w));
            // The replacement Pending upstairs: its room is counted, and b waits its turn.
            let replacement = pod("a2", "web", None, -w, json!({}));
            let pods = [b.clone(), replacement.clone()];
            assert_eq!(
                round(&mut memory, &pods, w + 2),
                want(&[("b", want_while_pending)]),
                "budgets {budgets:?}"
            );
            // Ready at home: b goes.
            let home = pod("a2", "web", Some("w1"), -w, json!({}));
            let pods = [b.clone(), home];
            let got = round(&mut memory, &pods, w + 4);
            if budgets.is_empty() {
                assert_eq!(got, want(&[("b", "move:w1")]));
            }
        }
    }

    /// One round at `t`: the verdicts, and the replacements found burst again.
    fn round(
        memory: &mut Memory,
        nodes: &[Node],
        pods: &[Pod],
        t: i64,
    ) -> (Vec<(String, String)>, Vec<String>) {
        let cluster = Cluster {
            nodes,
            pods,
            budgets: &[],
        };
        let plan = memory.plan(
            &cluster,
            &virtual_nodes(),
            &BTreeSet::new(),
            &limits(),
            at(t),
        );
        let rebursts = plan
            .rebursts
            .iter()
            .map(|p| p.metadata.name.clone().unwrap())
            .collect();
        (verdicts(&plan), rebursts)
    }

    /// A replacement that bursts anyway (someone took the room first) is counted once and
    /// backs its owner off; the room must then hold a whole window again.
    #[test]
    fn a_replacement_that_bursts_again_backs_the_owner_off() {
        let nodes = [node("w1", "4", json!({})), vk("vk", 1)];
        let a = pod("a", "web", Some("vk"), 10, json!({}));
        let b = pod("b", "web", Some("vk"), 20, json!({}));
        let w = WINDOW as i64;
        let mut memory = Memory::default();
        let pods = [a.clone(), b.clone()];
        round(&mut memory, &nodes, &pods, 0);
        assert_eq!(
            round(&mut memory, &nodes, &pods, w).0[0],
            ("a".to_owned(), "move:w1".to_owned())
        );
        memory.moved(&pods, &a, at(w));
        let pods = [b.clone(), pod("a2", "web", Some("vk"), -w, json!({}))];
        // Counted once; the owner backs off (2 windows), its pods' room not spoken for.
        assert_eq!(
            round(&mut memory, &nodes, &pods, w + 2),
            (
                want(&[("a2", "backed_off"), ("b", "backed_off")]),
                vec!["a2".to_owned()]
            )
        );
        assert!(round(&mut memory, &nodes, &pods, w + 4).1.is_empty());
        // Backed off until w + 2 + 2w; then a whole window again.
        let end = 3 * w + 2;
        assert_eq!(
            round(&mut memory, &nodes, &pods, end - 1).0[0].1,
            "backed_off"
        );
        assert_eq!(
            round(&mut memory, &nodes, &pods, end).0[0].1,
            "room_not_held"
        );
        assert_eq!(
            round(&mut memory, &nodes, &pods, end + w).0,
            want(&[("a2", "move:w1"), ("b", "owner_limit")])
        );
        // A pod the owner adds later, bursting, is not ours to count.
        let pods = [b.clone(), pod("a3", "web", Some("vk"), -end, json!({}))];
        assert!(round(&mut memory, &nodes, &pods, end + w + 2).1.is_empty());
    }

    #[test]
    fn label_selectors() {
        let labels: BTreeMap<String, String> = [("app".to_owned(), "web".to_owned())].into();
        let cases = [
            (json!({}), true),
            (json!({"matchLabels": {"app": "web"}}), true),
            (json!({"matchLabels": {"app": "api"}}), false),
            (
                json!({"matchExpressions": [{"key": "app", "operator": "In", "values": ["web", "x"]}]}),
                true,
            ),
            (
                json!({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["web"]}]}),
                false,
            ),
            (
                json!({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}),
                true,
            ),
            (
                json!({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}),
                false,
            ),
            (
                json!({"matchExpressions": [{"key": "app", "operator": "Bogus"}]}),
                false,
            ),
        ];
        for (selector, want) in cases {
            let selector: LabelSelector = serde_json::from_value(selector.clone()).unwrap();
            assert_eq!(
                label_selector_matches(&selector, Some(&labels)),
                want,
                "{selector:?}"
            );
        }
        let p = pod("a", "web", Some("vk"), 1, json!({}));
        assert!(has_budget(&p, &[budget("web")]));
        assert!(!has_budget(&p, &[budget("api")]));
        let mut elsewhere = budget("web");
        elsewhere.metadata.namespace = Some("other".into());
        assert!(!has_budget(&p, &[elsewhere]));
    }
}
