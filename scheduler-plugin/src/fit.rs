//! PURE: does a pod fit in a lower cluster, and how well. No client, no async.
//!
//! A pod's [`Demand`] is what the lower pod will ask of the lower scheduler: its
//! effective requests (the arithmetic shared with virtual-node's capacity,
//! [`tensile::node::resources`]) and the node constraints virtual-node's translation gives
//! it ([`tensile::translate::scheduling::restore_constraints`]: the `clusterSelector` stash
//! when the webhook made one). A cluster fits when one Ready, schedulable lower node
//! passes every check; otherwise [`ClusterFit::NoFit`] says why in words a person can act on.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Affinity, Node, NodeAffinity, NodeSelector, Pod, PodSpec, Taint, Toleration,
};
pub use tensile::node::placement::{requirement_matches, selector_matches, tolerates};
use tensile::node::quantity::format_readable;
use tensile::node::resources::{
    Resources, effect_repels, node_cordoned, node_ready, pod_footprint, to_resources,
};
use tensile::translate::TranslateError;
use tensile::translate::scheduling::{
    Confinement, Placement, parse_cluster_selector, restore_constraints,
};

/// Highest score prioritize gives (kube-scheduler's `MaxExtenderPriority`).
pub const MAX_SCORE: i64 = 10;

/// What the fit needs of a lower node: pruned from the Node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LowerNode {
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its allocatable resources, in milli-units.
    pub allocatable: Resources,
    /// Its taints that repel (NoSchedule, NoExecute).
    pub taints: Vec<Taint>,
    /// Ready condition True.
    pub ready: bool,
    /// `spec.unschedulable`.
    pub cordoned: bool,
}

impl LowerNode {
    /// The pruned view of `node`.
    pub fn from_node(node: &Node) -> Self {
        Self {
            labels: node.metadata.labels.clone().unwrap_or_default(),
            allocatable: node
                .status
                .as_ref()
                .and_then(|s| s.allocatable.as_ref())
                .map(to_resources)
                .unwrap_or_default(),
            taints: node
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .map(|ts| {
                    ts.iter()
                        .filter(|t| effect_repels(&t.effect))
                        .map(|t| Taint {
                            time_added: None,
                            ..t.clone()
                        })
                        .collect()
                })
                .unwrap_or_default(),
            ready: node_ready(node),
            cordoned: node_cordoned(node),
        }
    }
}

/// What a pod will ask of the lower cluster.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Demand {
    /// Effective requests plus one `pods`, in milli-units.
    pub requests: Resources,
    /// The lower pod's nodeSelector.
    pub node_selector: BTreeMap<String, String>,
    /// The lower pod's required node affinity.
    pub required: Option<NodeSelector>,
    /// The lower pod's tolerations.
    pub tolerations: Vec<Toleration>,
}

impl Demand {
    /// What `pod` will ask of the lower cluster once virtual-node has translated it.
    /// Errors when its `clusterSelector` annotation is not valid JSON.
    pub fn of(pod: &Pod) -> Result<Self, TranslateError> {
        let stash = parse_cluster_selector(pod.metadata.annotations.as_ref())?;
        let spec = pod.spec.as_ref();
        // Only the constraint fields are copied: restore_constraints reads nothing else.
        let mut constraints = PodSpec {
            node_selector: spec.and_then(|s| s.node_selector.clone()),
            affinity: spec.and_then(|s| s.affinity.clone()),
            tolerations: spec.and_then(|s| s.tolerations.clone()),
            ..PodSpec::default()
        };
        restore_constraints(&mut constraints, stash.as_ref());
        Ok(Self::with_constraints(
            spec.map(pod_footprint).unwrap_or_default(),
            constraints,
        ))
    }

    /// What a lower pod asks of its scheduler: its spec as it is.
    pub fn of_lower(spec: &PodSpec) -> Self {
        let constraints = PodSpec {
            node_selector: spec.node_selector.clone(),
            affinity: spec.affinity.clone(),
            tolerations: spec.tolerations.clone(),
            ..PodSpec::default()
        };
        Self::with_constraints(pod_footprint(spec), constraints)
    }

    /// What the pod asks when its lower copy is confined to one group of lower nodes (a
    /// virtual node of a member of `node` or `label=<key>` granularity): the requirement
    /// virtual-node adds, ANDed into its required node affinity.
    pub fn confined(&self, confinement: &Confinement) -> Self {
        let mut constraints = PodSpec {
            affinity: Some(Affinity {
                node_affinity: Some(NodeAffinity {
                    required_during_scheduling_ignored_during_execution: self.required.clone(),
                    ..NodeAffinity::default()
                }),
                ..Affinity::default()
            }),
            ..PodSpec::default()
        };
        confinement.apply(&mut constraints);
        Self {
            required: constraints
                .affinity
                .and_then(|a| a.node_affinity)
                .and_then(|n| n.required_during_scheduling_ignored_during_execution),
            ..self.clone()
        }
    }

    fn with_constraints(requests: Resources, constraints: PodSpec) -> Self {
        Self {
            requests,
            node_selector: constraints.node_selector.unwrap_or_default(),
            required: constraints
                .affinity
                .and_then(|a| a.node_affinity)
                .and_then(|n| n.required_during_scheduling_ignored_during_execution),
            tolerations: constraints.tolerations.unwrap_or_default(),
        }
    }
}

/// Why one lower node does not take the pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Misfit {
    /// Ready is not True.
    NotReady,
    /// Cordoned.
    Cordoned,
    /// A NoSchedule/NoExecute taint the pod does not tolerate (`key=value:Effect`).
    Taint(String),
    /// The nodeSelector does not match its labels.
    NodeSelector,
    /// The required node affinity does not match it.
    NodeAffinity,
    /// Not enough free of these resources.
    Insufficient(Vec<String>),
}

impl Misfit {
    fn words(&self) -> String {
        match self {
            Self::NotReady => "not ready".into(),
            Self::Cordoned => "cordoned".into(),
            Self::Taint(taint) => format!("untolerated taint {taint}"),
            Self::NodeSelector => "nodeSelector mismatch".into(),
            Self::NodeAffinity => "node affinity mismatch".into(),
            Self::Insufficient(resources) => format!("insufficient {}", resources.join(", ")),
        }
    }
}

/// Checks one lower node, with `used` the requests of the pods bound there. `Ok` carries
/// the node's score for the pod (0–[`MAX_SCORE`]).
pub fn check_node(
    name: &str,
    node: &LowerNode,
    used: Option<&Resources>,
    demand: &Demand,
) -> Result<i64, Misfit> {
    if !node.ready {
        return Err(Misfit::NotReady);
    }
    if node.cordoned {
        return Err(Misfit::Cordoned);
    }
    if let Some(taint) = node
        .taints
        .iter()
        .find(|t| !demand.tolerations.iter().any(|tol| tolerates(tol, t)))
    {
        let value = taint.value.as_deref().unwrap_or_default();
        let taint = if value.is_empty() {
            format!("{}:{}", taint.key, taint.effect)
        } else {
            format!("{}={value}:{}", taint.key, taint.effect)
        };
        return Err(Misfit::Taint(taint));
    }
    if !demand
        .node_selector
        .iter()
        .all(|(k, v)| node.labels.get(k) == Some(v))
    {
        return Err(Misfit::NodeSelector);
    }
    if let Some(required) = &demand.required
        && !selector_matches(required, name, &node.labels)
    {
        return Err(Misfit::NodeAffinity);
    }
    let short: Vec<String> = demand
        .requests
        .iter()
        .filter(|(resource, need)| **need > 0 && **need > free(node, used, resource))
        .map(|(resource, _)| resource.clone())
        .collect();
    if !short.is_empty() {
        return Err(Misfit::Insufficient(short));
    }
    Ok(score(node, used, demand))
}

/// What is left of `resource` on a node (never negative).
pub fn free(node: &LowerNode, used: Option<&Resources>, resource: &str) -> i128 {
    let allocatable = node.allocatable.get(resource).copied().unwrap_or(0);
    let taken = used.and_then(|u| u.get(resource)).copied().unwrap_or(0);
    (allocatable - taken).max(0)
}

/// Room left after placing the pod: the mean over cpu and memory of the free fraction,
/// scaled to 0–10 (kube-scheduler's LeastAllocated, on the lower node).
fn score(node: &LowerNode, used: Option<&Resources>, demand: &Demand) -> i64 {
    let mut fractions = Vec::with_capacity(2);
    for resource in ["cpu", "memory"] {
        let allocatable = node.allocatable.get(resource).copied().unwrap_or(0);
        if allocatable <= 0 {
            continue;
        }
        let need = demand.requests.get(resource).copied().unwrap_or(0);
        let left = (free(node, used, resource) - need).max(0);
        fractions.push(left as f64 / allocatable as f64);
    }
    if fractions.is_empty() {
        return 0;
    }
    let mean = fractions.iter().sum::<f64>() / fractions.len() as f64;
    ((mean * MAX_SCORE as f64).round() as i64).clamp(0, MAX_SCORE)
}

/// Whether lower node `name` is one of the group `confinement` names: the node by name
/// (`metadata.name`, a field) or by a label's value.
pub fn in_group(confinement: &Confinement, name: &str, node: &LowerNode) -> bool {
    let requirement = &confinement.requirement;
    match confinement.placement {
        Placement::Field => requirement_matches(
            requirement,
            (requirement.key == "metadata.name").then_some(name),
        ),
        Placement::Expression => requirement_matches(
            requirement,
            node.labels.get(&requirement.key).map(String::as_str),
        ),
    }
}

/// The verdict on one lower cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterFit {
    /// At least one node takes the pod; the best node's score.
    Fits {
        /// 0–[`MAX_SCORE`].
        score: i64,
    },
    /// No node takes it.
    NoFit {
        /// Why, for the FailedScheduling event (without the cluster's name).
        reason: String,
    },
}

/// How far [`fit_cluster`] looks once a node takes the pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Search {
    /// Stop at the first node that takes it (filter: yes or no); its score is returned.
    First,
    /// Check every node, for the best score (prioritize).
    Best,
}

/// Checks the nodes of a cluster: `nodes` yields (name, node, requests of its pods).
pub fn fit_cluster<'a>(
    nodes: impl IntoIterator<Item = (&'a str, &'a LowerNode, Option<&'a Resources>)>,
    demand: &Demand,
    search: Search,
) -> ClusterFit {
    let mut best: Option<i64> = None;
    let mut total = 0usize;
    let mut others: BTreeMap<String, usize> = BTreeMap::new();
    // Per resource some candidate lacked: the largest free amount among candidates
    // (nodes passing every constraint).
    let mut largest_free: BTreeMap<&str, i128> = BTreeMap::new();
    let mut candidates: Vec<(&LowerNode, Option<&Resources>)> = Vec::new();
    let mut short_somewhere: std::collections::BTreeSet<String> = Default::default();
    for (name, node, used) in nodes {
        total += 1;
        match check_node(name, node, used, demand) {
            Ok(score) if search == Search::First => return ClusterFit::Fits { score },
            Ok(score) => best = Some(best.map_or(score, |b| b.max(score))),
            Err(Misfit::Insufficient(short)) => {
                short_somewhere.extend(short);
                candidates.push((node, used));
            }
            Err(misfit) => *others.entry(misfit.words()).or_default() += 1,
        }
    }
    if let Some(score) = best {
        return ClusterFit::Fits { score };
    }
    if total == 0 {
        return ClusterFit::NoFit {
            reason: "no nodes".into(),
        };
    }
    for (resource, need) in &demand.requests {
        if !short_somewhere.contains(resource) {
            continue;
        }
        let largest = candidates
            .iter()
            .map(|(node, used)| free(node, *used, resource))
            .max();
        if let Some(largest) = largest.filter(|l| l < need) {
            largest_free.insert(resource, largest);
        }
    }
    let mut parts = Vec::new();
    if !candidates.is_empty() {
        let lacking: Vec<String> = largest_free
            .iter()
            .map(|(resource, largest)| {
                let need = demand.requests.get(*resource).copied().unwrap_or(0);
                format!(
                    "{resource} {} (largest free {})",
                    format_readable(need),
                    format_readable(*largest)
                )
            })
            .collect();
        if lacking.is_empty() {
            // Each resource fits somewhere, never all on one node.
            let wanted: Vec<String> = demand
                .requests
                .iter()
                .filter(|(resource, _)| short_somewhere.contains(*resource))
                .map(|(resource, need)| format!("{resource} {}", format_readable(*need)))
                .collect();
            parts.push(format!("no node fits {} together", wanted.join(", ")));
        } else {
            parts.push(format!("no node fits {}", lacking.join(", ")));
        }
    }
    let counts: Vec<String> = others
        .iter()
        .map(|(words, n)| format!("{n} {words}"))
        .collect();
    if !counts.is_empty() {
        let lead = if candidates.is_empty() {
            format!("0/{total} nodes fit: ")
        } else {
            "other nodes: ".into()
        };
        parts.push(format!("{lead}{}", counts.join(", ")));
    }
    ClusterFit::NoFit {
        reason: parts.join("; "),
    }
}

#[cfg(test)]
#[path = "fit_tests.rs"]
mod tests;
