//! PURE: which upper pods on virtual nodes get another chance, and what a moved pod looks
//! like. No client, no async; table-tested.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, PodCondition};
use k8s_openapi::jiff::Timestamp;
use serde::Deserialize;

use crate::translate::pod::MIRRORED_CONDITION;
use crate::translate::scheduling::avoid_nodes;

/// Label of virtual nodes (tensile-kube's).
pub use crate::translate::meta::VIRTUAL_NODE_LABEL;
/// Annotation naming the virtual node(s) a pod was moved off, comma-separated.
pub const UNSCHEDULABLE_NODE_ANNOTATION: &str = "unschedulable-node";
/// Annotation counting how often a pod (or its predecessors) was moved.
pub const DESCHEDULE_COUNT_ANNOTATION: &str = "sigs.k8s.io/deschedule-count";
/// Label of bare pods the descheduler re-created.
pub const CREATED_BY_DESCHEDULER_LABEL: &str = "create-by-descheduler";
/// Annotation of mirror (static) pods.
const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";
/// Annotation naming where a kubelet got a pod from; anything but `api` is a static pod.
const CONFIG_SOURCE_ANNOTATION: &str = "kubernetes.io/config.source";
/// `scheduling.k8s.io`'s `SystemCriticalPriority`: `system-cluster-critical` has it,
/// `system-node-critical` more.
const SYSTEM_CRITICAL_PRIORITY: i32 = 2_000_000_000;
/// The built-in system-critical classes, for a pod whose priority was not resolved (the
/// Priority admission plugin off).
const SYSTEM_CRITICAL_CLASSES: [&str; 2] = ["system-cluster-critical", "system-node-critical"];
/// Annotation on a re-created pod: the UID of the pod it replaces, so that a pod of that
/// name made for another predecessor is never taken for this one's replacement.
pub const REPLACES_UID_ANNOTATION: &str = "tensile.dev/replaces-uid";

/// What a round acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// A pod still Pending this long after it was bound to the virtual node, and not placed
    /// below, is moved even without a verdict from below.
    pub max_pod_lifetime: Duration,
    /// At most this many pods per node per round (`None`: no limit).
    pub max_pods_per_node: Option<usize>,
    /// Move pods with local storage (hostPath, any emptyDir) too.
    pub evict_local_storage_pods: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            max_pod_lifetime: Duration::from_secs(180),
            max_pods_per_node: None,
            evict_local_storage_pods: false,
        }
    }
}

/// Why a pod is moved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MoveReason {
    /// The lower scheduler's verdict, reflected up (`Unschedulable`, `SchedulerError`).
    Refused {
        /// The condition's reason.
        reason: String,
        /// The condition's message.
        message: String,
    },
    /// Bound to the node longer than the lifetime ago, and neither placed nor refused below.
    PendingTooLong(Duration),
}

impl std::fmt::Display for MoveReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Refused { reason, message } if message.is_empty() => {
                write!(f, "the lower cluster reported {reason}")
            }
            Self::Refused { reason, message } => {
                write!(f, "the lower cluster reported {reason}: {message}")
            }
            Self::PendingTooLong(waited) => {
                write!(
                    f,
                    "Pending for {}s since bound to the node",
                    waited.as_secs()
                )
            }
        }
    }
}

/// Why a pod on a virtual node is left alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Skip {
    /// Not Pending (Running, or finished).
    NotPending,
    /// Pending, neither placed nor refused below, and bound less than the lifetime ago.
    TooYoung,
    /// In kube-system.
    KubeSystem,
    /// A mirror or static pod.
    Mirror,
    /// Of a system-critical priority (`system-cluster-critical`, `system-node-critical`).
    SystemCritical,
    /// The lower cluster placed it: it is starting there (pulling images, running init
    /// containers, attaching volumes).
    PlacedBelow,
    /// Owned by a DaemonSet.
    DaemonSet,
    /// Uses local storage (hostPath, emptyDir) and `--evict-local-storage-pods` is off.
    LocalStorage,
    /// Being deleted.
    Deleting,
    /// The node's limit for this round is reached.
    NodeLimit,
}

impl Skip {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::NotPending => "not_pending",
            Self::TooYoung => "too_young",
            Self::KubeSystem => "kube_system",
            Self::Mirror => "mirror",
            Self::SystemCritical => "system_critical",
            Self::PlacedBelow => "placed_below",
            Self::DaemonSet => "daemonset",
            Self::LocalStorage => "local_storage",
            Self::Deleting => "deleting",
            Self::NodeLimit => "node_limit",
        }
    }

    /// Every reason, for metrics.
    pub const ALL: [Skip; 10] = [
        Self::NotPending,
        Self::TooYoung,
        Self::KubeSystem,
        Self::Mirror,
        Self::SystemCritical,
        Self::PlacedBelow,
        Self::DaemonSet,
        Self::LocalStorage,
        Self::Deleting,
        Self::NodeLimit,
    ];
}

/// The verdict on one pod bound to a virtual node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Move it.
    Move(MoveReason),
    /// Leave it.
    Skip(Skip),
}

/// Judges one pod bound to a virtual node at `now`, ignoring per-node limits. The pods the
/// upstream descheduler never evicts (mirror and static, system-critical, DaemonSet, local
/// storage unless allowed, terminating) are left alone, and so is a pod the lower cluster
/// placed: starting there (pulling images, running init containers, attaching volumes)
/// takes what it takes, however long.
pub fn judge(pod: &Pod, policy: &Policy, now: Timestamp) -> Verdict {
    let meta = &pod.metadata;
    if meta.deletion_timestamp.is_some() {
        return Verdict::Skip(Skip::Deleting);
    }
    if meta.namespace.as_deref() == Some("kube-system") {
        return Verdict::Skip(Skip::KubeSystem);
    }
    if is_static(pod) {
        return Verdict::Skip(Skip::Mirror);
    }
    if is_system_critical(pod) {
        return Verdict::Skip(Skip::SystemCritical);
    }
    if meta
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.kind == "DaemonSet")
    {
        return Verdict::Skip(Skip::DaemonSet);
    }
    let status = pod.status.as_ref();
    if !matches!(
        status.and_then(|s| s.phase.as_deref()),
        None | Some("Pending")
    ) {
        return Verdict::Skip(Skip::NotPending);
    }
    if !policy.evict_local_storage_pods && has_local_storage(pod) {
        return Verdict::Skip(Skip::LocalStorage);
    }
    if placed_below(pod) {
        return Verdict::Skip(Skip::PlacedBelow);
    }
    if let Some(condition) = refused(pod) {
        return Verdict::Move(MoveReason::Refused {
            reason: condition.reason.clone().unwrap_or_default(),
            message: condition.message.clone().unwrap_or_default(),
        });
    }
    let waited = bound_at(pod)
        .map(|t| now.duration_since(t))
        .and_then(|d| Duration::try_from(d).ok())
        .unwrap_or_default();
    if waited > policy.max_pod_lifetime {
        Verdict::Move(MoveReason::PendingTooLong(waited))
    } else {
        Verdict::Skip(Skip::TooYoung)
    }
}

/// When the pod was bound to its node, as its status tells: the PodScheduled condition's
/// lastTransitionTime (the binding sets it; a condition reflected from below replaces it
/// with a later one, so the time is never earlier than the binding), else its creation (a
/// pod created with its nodeName is bound from the start). Not the creation alone: a pod
/// may wait upstairs for a long time before it is bound.
pub fn bound_at(pod: &Pod) -> Option<Timestamp> {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled")
        .and_then(|c| c.last_transition_time.as_ref())
        .or(pod.metadata.creation_timestamp.as_ref())
        .map(|t| t.0)
}

/// Whether the status reflected from below shows the lower cluster placed the pod: what
/// a kubelet writes as it starts a pod (host, start time, container statuses), or the
/// lower PodScheduled=True itself (a reflected condition replaces the upper one of its
/// type, and tensile's Mirrored condition says it was reflected).
pub fn placed_below(pod: &Pod) -> bool {
    let Some(status) = &pod.status else {
        return false;
    };
    let conditions = status.conditions.as_deref().unwrap_or_default();
    let holds = |type_: &str| {
        conditions
            .iter()
            .any(|c| c.type_ == type_ && c.status == "True")
    };
    status.host_ip.as_deref().is_some_and(|ip| !ip.is_empty())
        || status.host_ips.as_ref().is_some_and(|ips| !ips.is_empty())
        || status.start_time.is_some()
        || status
            .container_statuses
            .as_ref()
            .is_some_and(|c| !c.is_empty())
        || status
            .init_container_statuses
            .as_ref()
            .is_some_and(|c| !c.is_empty())
        || (holds(MIRRORED_CONDITION) && holds("PodScheduled"))
}

/// A mirror pod, or a static one by its config source (as the upstream descheduler tells).
pub(crate) fn is_static(pod: &Pod) -> bool {
    pod.metadata.annotations.as_ref().is_some_and(|a| {
        a.contains_key(MIRROR_ANNOTATION)
            || a.get(CONFIG_SOURCE_ANNOTATION)
                .is_some_and(|source| source != "api")
    })
}

/// Of a system-critical priority, in whatever namespace: the upstream descheduler's
/// `IsCriticalPriorityPod`, and the built-in class names for an unresolved priority.
pub fn is_system_critical(pod: &Pod) -> bool {
    let Some(spec) = &pod.spec else {
        return false;
    };
    spec.priority.is_some_and(|p| p >= SYSTEM_CRITICAL_PRIORITY)
        || spec
            .priority_class_name
            .as_deref()
            .is_some_and(|class| SYSTEM_CRITICAL_CLASSES.contains(&class))
}

/// The reflected `PodScheduled=False` condition with reason `Unschedulable` or
/// `SchedulerError`: the lower scheduler's verdict.
pub fn refused(pod: &Pod) -> Option<&PodCondition> {
    pod.status.as_ref()?.conditions.as_ref()?.iter().find(|c| {
        c.type_ == "PodScheduled"
            && c.status == "False"
            && matches!(
                c.reason.as_deref(),
                Some("Unschedulable" | "SchedulerError")
            )
    })
}

/// Whether the pod uses storage that dies with its node, as the upstream descheduler (and
/// so tensile-kube's) counts it: any hostPath or emptyDir volume.
pub fn has_local_storage(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .into_iter()
        .flatten()
        .any(|v| v.host_path.is_some() || v.empty_dir.is_some())
}

/// Up to how many virtual nodes a round lists the Pending pods of each node apart (the
/// API server's watch cache indexes pods by node); beyond, it lists every Pending pod
/// bound to a node once and [`select`] keeps those on virtual nodes (node granularity: a
/// member may show a thousand lower nodes as a thousand virtual nodes).
pub const LIST_PER_NODE_UP_TO: usize = 16;

/// The field selectors of the pod lists one round makes over `virtual_nodes`. Pure.
pub fn pending_lists(virtual_nodes: &BTreeSet<String>) -> Vec<String> {
    if virtual_nodes.len() <= LIST_PER_NODE_UP_TO {
        virtual_nodes
            .iter()
            .map(|node| format!("spec.nodeName={node},status.phase=Pending"))
            .collect()
    } else {
        vec!["spec.nodeName!=,status.phase=Pending".to_owned()]
    }
}

/// One round's verdicts over `pods` (those bound to a node in `virtual_nodes`; others are
/// not returned), longest bound first, with the per-node limit applied.
pub fn select<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    virtual_nodes: &BTreeSet<String>,
    policy: &Policy,
    now: Timestamp,
) -> Vec<(&'a Pod, String, Verdict)> {
    let mut bound: Vec<(&Pod, String)> = pods
        .into_iter()
        .filter_map(|p| {
            let node = p.spec.as_ref()?.node_name.as_ref()?;
            virtual_nodes.contains(node).then(|| (p, node.clone()))
        })
        .collect();
    // Oldest first, so a limit per node never starves the pods that waited longest.
    bound.sort_by(|(a, _), (b, _)| {
        let key = |p: &Pod| {
            (
                bound_at(p),
                p.metadata.namespace.clone(),
                p.metadata.name.clone(),
            )
        };
        key(a).cmp(&key(b))
    });
    let mut moved: BTreeMap<String, usize> = BTreeMap::new();
    bound
        .into_iter()
        .map(|(pod, node)| {
            let mut verdict = judge(pod, policy, now);
            if matches!(verdict, Verdict::Move(_)) {
                let count = moved.entry(node.clone()).or_default();
                if policy.max_pods_per_node.is_some_and(|max| *count >= max) {
                    verdict = Verdict::Skip(Skip::NodeLimit);
                } else {
                    *count += 1;
                }
            }
            (pod, node, verdict)
        })
        .collect()
}

/// How a pod is moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// A controller owns it: evict it, the controller makes a replacement.
    Evict,
    /// A bare pod: re-create it, then delete the old one.
    Recreate,
}

/// Evict what a controller re-creates; re-create the rest.
pub fn method(pod: &Pod) -> Method {
    let controlled = pod
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true));
    if controlled {
        Method::Evict
    } else {
        Method::Recreate
    }
}

/// The pod's `sigs.k8s.io/deschedule-count` plus one (an unreadable count restarts at 1).
pub fn next_count(pod: &Pod) -> u32 {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(DESCHEDULE_COUNT_ANNOTATION))
        .and_then(|c| c.trim().parse::<u32>().ok())
        .unwrap_or(0)
        .saturating_add(1)
}

/// The nodes already named in `unschedulable-node`, plus `node`, sorted and unique.
pub fn unschedulable_nodes(pod: &Pod, node: &str) -> Vec<String> {
    let mut nodes: BTreeSet<String> = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(UNSCHEDULABLE_NODE_ANNOTATION))
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    nodes.insert(node.to_owned());
    nodes.into_iter().collect()
}

/// The merge patch that marks a pod before its eviction: `unschedulable-node` and the
/// counter (tensile-kube's strings; the webhook remembers the node for the owner). A pod
/// already marked for `node` (its eviction was refused, e.g. by a PodDisruptionBudget) is
/// marked again, which refreshes the webhook's memory, but not counted again.
pub fn mark_patch(pod: &Pod, node: &str) -> serde_json::Value {
    let annotations = pod.metadata.annotations.as_ref();
    let marked = annotations
        .and_then(|a| a.get(UNSCHEDULABLE_NODE_ANNOTATION))
        .is_some_and(|v| v.split(',').any(|n| n.trim() == node));
    let count = match annotations.and_then(|a| a.get(DESCHEDULE_COUNT_ANNOTATION)) {
        Some(count) if marked => count.clone(),
        _ => next_count(pod).to_string(),
    };
    serde_json::json!({
        "metadata": {
            "annotations": {
                UNSCHEDULABLE_NODE_ANNOTATION: unschedulable_nodes(pod, node).join(","),
                DESCHEDULE_COUNT_ANNOTATION: count,
            }
        }
    })
}

/// The replacement of a bare pod that failed on `node`: the same pod, unbound, with
/// identity and status cleared, every annotation kept, the counter incremented, labelled
/// `create-by-descheduler=true`, and required to avoid every virtual node it failed on.
pub fn replacement(pod: &Pod, node: &str) -> Pod {
    let avoid = unschedulable_nodes(pod, node);
    let count = next_count(pod);
    let mut new = pod.clone();
    let meta = &mut new.metadata;
    meta.name = Some(replacement_name(pod, count));
    meta.uid = None;
    meta.resource_version = None;
    meta.creation_timestamp = None;
    meta.deletion_timestamp = None;
    meta.deletion_grace_period_seconds = None;
    meta.generation = None;
    meta.managed_fields = None;
    meta.self_link = None;
    meta.labels
        .get_or_insert_with(Default::default)
        .insert(CREATED_BY_DESCHEDULER_LABEL.into(), "true".into());
    let annotations = meta.annotations.get_or_insert_with(Default::default);
    annotations.insert(DESCHEDULE_COUNT_ANNOTATION.into(), count.to_string());
    annotations.insert(UNSCHEDULABLE_NODE_ANNOTATION.into(), avoid.join(","));
    // A replacement's replacement inherits the mark naming the pod before: overwrite it.
    match pod.metadata.uid.as_ref() {
        Some(uid) => annotations.insert(REPLACES_UID_ANNOTATION.into(), uid.clone()),
        None => annotations.remove(REPLACES_UID_ANNOTATION),
    };
    new.status = None;
    if let Some(spec) = new.spec.as_mut() {
        spec.node_name = None;
        avoid_nodes(spec, &avoid);
    }
    new
}

/// Whether `existing` is the replacement the descheduler made for `predecessor`: labelled
/// as re-created, and recording `predecessor`'s UID. The label alone is not enough: the
/// name `<name>-<n>` may hold the replacement of an earlier pod of the same name.
pub fn is_replacement_of(existing: &Pod, predecessor: &Pod) -> bool {
    let labelled = existing
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(CREATED_BY_DESCHEDULER_LABEL))
        .is_some_and(|v| v == "true");
    let recorded = existing
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(REPLACES_UID_ANNOTATION));
    let uid = predecessor.metadata.uid.as_ref().filter(|u| !u.is_empty());
    labelled && uid.is_some() && recorded == uid
}

/// The claims the pod mounts (`persistentVolumeClaim` volumes), in volume order.
pub fn claim_names(pod: &Pod) -> impl Iterator<Item = &str> {
    pod.spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|v| v.persistent_volume_claim.as_ref())
        .map(|c| c.claim_name.as_str())
}

/// The first claim of the pod provisioned on `node`, by `selected_node` (claim name →
/// its `volume.kubernetes.io/selected-node`). Such a pod cannot run anywhere else: the
/// webhook binds every new pod mounting the claim straight back to `node`, so moving it
/// would only go round refused → moved → bound back.
pub fn pinning_claim(
    pod: &Pod,
    node: &str,
    selected_node: impl Fn(&str) -> Option<String>,
) -> Option<String> {
    claim_names(pod)
        .find(|claim| selected_node(claim).as_deref() == Some(node))
        .map(str::to_owned)
}

/// `<name>-<count>`, the previous round's `-<count-1>` replaced rather than stacked. The
/// name is deterministic so that a round that created the replacement but could not
/// delete the old pod finds it again instead of making a second one.
pub fn replacement_name(pod: &Pod, count: u32) -> String {
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let recreated = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(CREATED_BY_DESCHEDULER_LABEL))
        .is_some_and(|v| v == "true");
    let previous = format!("-{}", count.saturating_sub(1));
    let base = match name.strip_suffix(&previous) {
        Some(base) if recreated && !base.is_empty() => base,
        _ => name,
    };
    let suffix = format!("-{count}");
    let mut end = base.len().min(253 - suffix.len());
    while !base.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{suffix}", base[..end].trim_end_matches(['-', '.']))
}

/// A `DeschedulerPolicy` file as tensile-kube ships it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PolicyFile {
    /// `strategies.PodLifeTime.params.maxPodLifeTimeSeconds`, when PodLifeTime is enabled.
    pub max_pod_lifetime: Option<Duration>,
    /// Strategies named in the file that tensile does not run (reported as ignored).
    pub ignored_strategies: Vec<String>,
    /// `strategies.ReturnHome`, when named.
    pub return_home: Option<ReturnHomeFile>,
}

/// The `ReturnHome` strategy of a policy file: what it sets wins over the flags.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReturnHomeFile {
    /// `enabled` (default true, as for any strategy).
    pub enabled: bool,
    /// `params.returnHomeAfterSeconds`.
    pub after: Option<Duration>,
    /// `params.maxMovesPerRound` (0: no limit).
    pub max_per_round: Option<usize>,
    /// `params.maxMovesPerOwner` (at least 1).
    pub max_per_owner: Option<u32>,
}

/// Why a policy file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// Neither YAML nor JSON of the expected shape.
    #[error("policy file {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// What the parser said.
        message: String,
    },
    /// Not a `DeschedulerPolicy`.
    #[error("policy file {path}: kind is {kind:?}, expected DeschedulerPolicy")]
    Kind {
        /// The file.
        path: String,
        /// The kind found.
        kind: String,
    },
}

#[derive(Deserialize)]
struct RawPolicy {
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    strategies: BTreeMap<String, RawStrategy>,
}

#[derive(Deserialize)]
struct RawStrategy {
    #[serde(default = "enabled_default")]
    enabled: bool,
    #[serde(default)]
    params: Option<RawParams>,
}

fn enabled_default() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawParams {
    #[serde(default)]
    max_pod_life_time_seconds: Option<u64>,
    #[serde(default)]
    return_home_after_seconds: Option<u64>,
    #[serde(default)]
    max_moves_per_round: Option<usize>,
    #[serde(default)]
    max_moves_per_owner: Option<u32>,
}

/// Parses a `DeschedulerPolicy` (YAML or JSON). `path` only names the file in errors.
pub fn parse_policy(path: &str, text: &str) -> Result<PolicyFile, PolicyError> {
    let raw: RawPolicy = serde_saphyr::from_str(text).map_err(|e| PolicyError::Parse {
        path: path.to_owned(),
        message: e.to_string(),
    })?;
    if let Some(kind) = raw.kind.filter(|k| k != "DeschedulerPolicy") {
        return Err(PolicyError::Kind {
            path: path.to_owned(),
            kind,
        });
    }
    let mut file = PolicyFile::default();
    for (name, strategy) in raw.strategies {
        if name == "PodLifeTime" {
            if strategy.enabled {
                file.max_pod_lifetime = strategy
                    .params
                    .and_then(|p| p.max_pod_life_time_seconds)
                    .map(Duration::from_secs);
            }
        } else if name == "ReturnHome" {
            let params = strategy.params;
            let bad = |message: &str| PolicyError::Parse {
                path: path.to_owned(),
                message: format!("strategies.ReturnHome.params.{message}"),
            };
            let after = params.as_ref().and_then(|p| p.return_home_after_seconds);
            if after == Some(0) {
                return Err(bad("returnHomeAfterSeconds must be at least 1"));
            }
            let max_per_owner = params.as_ref().and_then(|p| p.max_moves_per_owner);
            if max_per_owner == Some(0) {
                return Err(bad("maxMovesPerOwner must be at least 1"));
            }
            file.return_home = Some(ReturnHomeFile {
                enabled: strategy.enabled,
                after: after.map(Duration::from_secs),
                max_per_round: params.as_ref().and_then(|p| p.max_moves_per_round),
                max_per_owner,
            });
        } else {
            file.ignored_strategies.push(name);
        }
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use serde_json::{Value, json};

    const NOW: i64 = 1_000_000;

    fn now() -> Timestamp {
        Timestamp::from_second(NOW).unwrap()
    }

    /// A pod on `vk` created `age` seconds before NOW, merged with `extra`.
    fn pod(name: &str, age: i64, extra: Value) -> Pod {
        let created = Timestamp::from_second(NOW - age).unwrap().to_string();
        let mut base = json!({
            "metadata": {"name": name, "namespace": "app", "uid": format!("uid-{name}"),
                         "resourceVersion": "7", "creationTimestamp": created},
            "spec": {"nodeName": "vk", "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": "Pending"},
        });
        merge(&mut base, extra);
        serde_json::from_value(base).unwrap()
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

    /// NOW minus `secs`, as the API server writes times.
    fn ago(secs: i64) -> String {
        Timestamp::from_second(NOW - secs).unwrap().to_string()
    }

    /// Bound to the node by the upper scheduler `secs` ago (its PodScheduled condition).
    fn bound(secs: i64) -> Value {
        json!({"status": {"conditions": [{"type": "PodScheduled", "status": "True",
            "lastTransitionTime": ago(secs)}]}})
    }

    /// What the virtual node reflects of a pod the lower cluster placed, pulling its image.
    fn pulling_below() -> Value {
        json!({"status": {
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": ago(5000)},
                {"type": "Ready", "status": "False", "reason": "ContainersNotReady"},
                {"type": "tensile.dev/Mirrored", "status": "True"}],
            "hostIP": "10.0.0.1",
            "startTime": ago(5000),
            "containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": false,
                "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}]}})
    }

    fn unschedulable() -> Value {
        json!({"status": {"conditions": [{"type": "PodScheduled", "status": "False",
            "reason": "Unschedulable", "message": "0/3 nodes are available"}]}})
    }

    #[test]
    fn judges() {
        let policy = Policy::default();
        let refused = Verdict::Move(MoveReason::Refused {
            reason: "Unschedulable".into(),
            message: "0/3 nodes are available".into(),
        });
        let cases: Vec<(&str, Pod, Policy, Verdict)> = vec![
            (
                "refused below: at once",
                pod("a", 1, unschedulable()),
                policy.clone(),
                refused.clone(),
            ),
            (
                "scheduler error below",
                pod(
                    "a",
                    1,
                    json!({"status": {"conditions": [{"type": "PodScheduled",
                    "status": "False", "reason": "SchedulerError"}]}}),
                ),
                policy.clone(),
                Verdict::Move(MoveReason::Refused {
                    reason: "SchedulerError".into(),
                    message: String::new(),
                }),
            ),
            (
                "pending past the lifetime",
                pod("a", 181, json!({})),
                policy.clone(),
                Verdict::Move(MoveReason::PendingTooLong(Duration::from_secs(181))),
            ),
            (
                "pending within the lifetime",
                pod("a", 179, json!({})),
                policy.clone(),
                Verdict::Skip(Skip::TooYoung),
            ),
            (
                "scheduled below, still pulling, however old",
                pod("a", 100_000, pulling_below()),
                policy.clone(),
                Verdict::Skip(Skip::PlacedBelow),
            ),
            (
                "scheduled below, init containers running",
                pod(
                    "a",
                    100_000,
                    json!({"status": {"hostIP": "10.0.0.1", "startTime": ago(5000),
                        "initContainerStatuses": [{"name": "init", "image": "i", "imageID": "",
                            "ready": false, "restartCount": 0,
                            "state": {"running": {"startedAt": ago(4000)}}}]}}),
                ),
                policy.clone(),
                Verdict::Skip(Skip::PlacedBelow),
            ),
            (
                "scheduled below, volumes attaching (no container status yet)",
                pod(
                    "a",
                    100_000,
                    json!({"status": {"hostIP": "10.0.0.1", "hostIPs": [{"ip": "10.0.0.1"}]}}),
                ),
                policy.clone(),
                Verdict::Skip(Skip::PlacedBelow),
            ),
            (
                "scheduled below, only the lower PodScheduled reflected",
                pod(
                    "a",
                    100_000,
                    json!({"status": {"conditions": [
                        {"type": "PodScheduled", "status": "True", "lastTransitionTime": ago(5000)},
                        {"type": "tensile.dev/Mirrored", "status": "True"}]}}),
                ),
                policy.clone(),
                Verdict::Skip(Skip::PlacedBelow),
            ),
            (
                "waited upstairs, bound to the node 10s ago",
                pod("a", 100_000, bound(10)),
                policy.clone(),
                Verdict::Skip(Skip::TooYoung),
            ),
            (
                "bound past the lifetime, nothing below: counted from binding",
                pod("a", 100_000, bound(181)),
                policy.clone(),
                Verdict::Move(MoveReason::PendingTooLong(Duration::from_secs(181))),
            ),
            (
                "bound within the lifetime, nothing reflected yet",
                pod("a", 100, bound(100)),
                policy.clone(),
                Verdict::Skip(Skip::TooYoung),
            ),
            (
                "system-cluster-critical outside kube-system",
                pod(
                    "a",
                    1,
                    json!({"spec": {"priorityClassName": "system-cluster-critical"},
                           "status": unschedulable()["status"]}),
                ),
                policy.clone(),
                Verdict::Skip(Skip::SystemCritical),
            ),
            (
                "system-node-critical by its priority alone",
                pod(
                    "a",
                    1,
                    json!({"spec": {"priority": 2_000_001_000}, "status": unschedulable()["status"]}),
                ),
                policy.clone(),
                Verdict::Skip(Skip::SystemCritical),
            ),
            (
                "high priority, not system-critical",
                pod(
                    "a",
                    1,
                    json!({"spec": {"priority": 1_999_999_999, "priorityClassName": "high"},
                           "status": unschedulable()["status"]}),
                ),
                policy.clone(),
                refused.clone(),
            ),
            (
                "static pod by its config source",
                pod(
                    "a",
                    1000,
                    json!({"metadata": {"annotations": {"kubernetes.io/config.source": "file"}}}),
                ),
                policy.clone(),
                Verdict::Skip(Skip::Mirror),
            ),
            (
                "config source api is not static",
                pod(
                    "a",
                    1,
                    json!({"metadata": {"annotations": {"kubernetes.io/config.source": "api"}},
                           "status": unschedulable()["status"]}),
                ),
                policy.clone(),
                refused.clone(),
            ),
            (
                "running, however old",
                pod("a", 100_000, json!({"status": {"phase": "Running"}})),
                policy.clone(),
                Verdict::Skip(Skip::NotPending),
            ),
            (
                "failed",
                pod("a", 100_000, json!({"status": {"phase": "Failed"}})),
                policy.clone(),
                Verdict::Skip(Skip::NotPending),
            ),
            (
                "kube-system",
                pod(
                    "a",
                    1,
                    json!({"metadata": {"namespace": "kube-system"}, "status": unschedulable()["status"]}),
                ),
                policy.clone(),
                Verdict::Skip(Skip::KubeSystem),
            ),
            (
                "mirror pod",
                pod(
                    "a",
                    1000,
                    json!({"metadata": {"annotations": {"kubernetes.io/config.mirror": "x"}}}),
                ),
                policy.clone(),
                Verdict::Skip(Skip::Mirror),
            ),
            (
                "daemonset pod",
                pod(
                    "a",
                    1000,
                    json!({"metadata": {"ownerReferences": [{"apiVersion": "apps/v1",
                    "kind": "DaemonSet", "name": "d", "uid": "u", "controller": true}]}}),
                ),
                policy.clone(),
                Verdict::Skip(Skip::DaemonSet),
            ),
            (
                "being deleted",
                pod(
                    "a",
                    1000,
                    json!({"metadata": {"deletionTimestamp": "2020-01-01T00:00:00Z"}}),
                ),
                policy.clone(),
                Verdict::Skip(Skip::Deleting),
            ),
            (
                "hostPath",
                pod(
                    "a",
                    1000,
                    json!({"spec": {"volumes": [{"name": "h", "hostPath": {"path": "/x"}}]}}),
                ),
                policy.clone(),
                Verdict::Skip(Skip::LocalStorage),
            ),
            (
                "emptyDir in memory",
                pod(
                    "a",
                    1000,
                    json!({"spec": {"volumes": [{"name": "e", "emptyDir": {"medium": "Memory"}}]}}),
                ),
                policy.clone(),
                Verdict::Skip(Skip::LocalStorage),
            ),
            (
                "emptyDir with a size limit",
                pod(
                    "a",
                    1000,
                    json!({"spec": {"volumes": [{"name": "e", "emptyDir": {"sizeLimit": "1Gi"}}]}}),
                ),
                policy.clone(),
                Verdict::Skip(Skip::LocalStorage),
            ),
            (
                "plain emptyDir is local storage, as upstream counts it",
                pod(
                    "a",
                    1,
                    json!({"spec": {"volumes": [{"name": "e", "emptyDir": {}}]}, "status": unschedulable()["status"]}),
                ),
                policy.clone(),
                Verdict::Skip(Skip::LocalStorage),
            ),
            (
                "a claim, a ConfigMap, a projected token: not local storage",
                pod(
                    "a",
                    1,
                    json!({"spec": {"volumes": [
                        {"name": "d", "persistentVolumeClaim": {"claimName": "data"}},
                        {"name": "c", "configMap": {"name": "cm"}},
                        {"name": "t", "projected": {"sources": []}}]},
                      "status": unschedulable()["status"]}),
                ),
                policy.clone(),
                refused.clone(),
            ),
            (
                "local storage allowed by flag",
                pod(
                    "a",
                    1,
                    json!({"spec": {"volumes": [{"name": "h", "hostPath": {"path": "/x"}}]}, "status": unschedulable()["status"]}),
                ),
                Policy {
                    evict_local_storage_pods: true,
                    ..Policy::default()
                },
                refused.clone(),
            ),
            (
                "shorter lifetime",
                pod("a", 11, json!({})),
                Policy {
                    max_pod_lifetime: Duration::from_secs(10),
                    ..Policy::default()
                },
                Verdict::Move(MoveReason::PendingTooLong(Duration::from_secs(11))),
            ),
        ];
        let wrong: Vec<String> = cases
            .into_iter()
            .filter_map(|(name, pod, policy, want)| {
                let got = judge(&pod, &policy, now());
                (got != want).then(|| format!("{name}: got {got:?}, want {want:?}"))
            })
            .collect();
        assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
    }

    #[test]
    fn selects_per_node_with_limits() {
        let on = |name: &str, age: i64, node: &str| {
            pod(
                name,
                age,
                json!({"spec": {"nodeName": node}, "status": unschedulable()["status"]}),
            )
        };
        let pods = vec![
            on("young", 1, "vk"),
            on("old", 50, "vk"),
            on("middle", 20, "vk"),
            on("other", 5, "vk2"),
            on("regular", 5, "worker"),
            pod("unbound", 5, json!({"spec": {"nodeName": null}})),
        ];
        let virtual_nodes: BTreeSet<String> = ["vk".to_owned(), "vk2".to_owned()].into();
        let cases = [
            (
                None,
                vec![
                    ("old", true),
                    ("middle", true),
                    ("other", true),
                    ("young", true),
                ],
            ),
            (
                Some(1),
                vec![
                    ("old", true),
                    ("middle", false),
                    ("other", true),
                    ("young", false),
                ],
            ),
            (
                Some(2),
                vec![
                    ("old", true),
                    ("middle", true),
                    ("other", true),
                    ("young", false),
                ],
            ),
        ];
        for (limit, want) in cases {
            let policy = Policy {
                max_pods_per_node: limit,
                ..Policy::default()
            };
            let got: Vec<(String, bool)> = select(&pods, &virtual_nodes, &policy, now())
                .into_iter()
                .map(|(p, _, v)| {
                    if let Verdict::Skip(skip) = &v {
                        assert_eq!(*skip, Skip::NodeLimit);
                    }
                    (
                        p.metadata.name.clone().unwrap(),
                        matches!(v, Verdict::Move(_)),
                    )
                })
                .collect();
            let want: Vec<(String, bool)> =
                want.into_iter().map(|(n, m)| (n.to_owned(), m)).collect();
            assert_eq!(got, want, "limit {limit:?}");
        }
    }

    /// A member's virtual nodes, one per lower node or zone (`vk-zone-a`, …), are virtual
    /// nodes like any: listed by node while there are few, in one list beyond; and a pod
    /// refused below on a group node is moved off that group node (marked with its name),
    /// its member's other group nodes still open to it.
    #[test]
    fn group_nodes_are_virtual_nodes_like_any() {
        let few: BTreeSet<String> = ["vk", "vk-zone-a"].map(str::to_owned).into();
        assert_eq!(
            pending_lists(&few),
            [
                "spec.nodeName=vk,status.phase=Pending",
                "spec.nodeName=vk-zone-a,status.phase=Pending"
            ]
        );
        let many: BTreeSet<String> = (0..1000).map(|i| format!("vk-node-{i}")).collect();
        assert_eq!(
            pending_lists(&many),
            ["spec.nodeName!=,status.phase=Pending"]
        );
        let empty = BTreeSet::new();
        assert!(pending_lists(&empty).is_empty());

        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns",
                         "annotations": {UNSCHEDULABLE_NODE_ANNOTATION: "vk-zone-b"}},
            "spec": {"nodeName": "vk-zone-a", "containers": []},
        }))
        .unwrap();
        let patch = mark_patch(&pod, "vk-zone-a");
        assert_eq!(
            patch["metadata"]["annotations"][UNSCHEDULABLE_NODE_ANNOTATION],
            "vk-zone-a,vk-zone-b"
        );
        // Pods on regular nodes, listed with the rest beyond the limit, are not selected.
        let regular: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "r", "namespace": "ns"},
            "spec": {"nodeName": "worker-1", "containers": []},
        }))
        .unwrap();
        let selected = select(
            [&pod, &regular],
            &many
                .iter()
                .cloned()
                .chain(["vk-zone-a".to_owned()])
                .collect(),
            &Policy::default(),
            Timestamp::now(),
        );
        let on: Vec<&str> = selected.iter().map(|(_, node, _)| node.as_str()).collect();
        assert_eq!(on, ["vk-zone-a"]);
    }

    #[test]
    fn oldest_binding_first() {
        // Created long ago but refused (bound) only now, and the other way round: the one
        // that has waited longest on the node goes first.
        let refused_at = |name: &str, created: i64, refused: i64| {
            pod(
                name,
                created,
                json!({"status": {"conditions": [{"type": "PodScheduled", "status": "False",
                    "reason": "Unschedulable", "lastTransitionTime": ago(refused)}]}}),
            )
        };
        let pods = [
            refused_at("created-early-bound-late", 10_000, 5),
            refused_at("created-late-bound-early", 60, 50),
        ];
        let policy = Policy {
            max_pods_per_node: Some(1),
            ..Policy::default()
        };
        let got: Vec<(String, bool)> = select(&pods, &["vk".to_owned()].into(), &policy, now())
            .into_iter()
            .map(|(p, _, v)| {
                (
                    p.metadata.name.clone().unwrap(),
                    matches!(v, Verdict::Move(_)),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("created-late-bound-early".to_owned(), true),
                ("created-early-bound-late".to_owned(), false)
            ]
        );
    }

    #[test]
    fn replacements_are_recognised_by_their_predecessor() {
        let old = pod("web", 1, json!({}));
        let made = |labels: Value, annotations: Value| {
            pod(
                "web-1",
                1,
                json!({"metadata": {"labels": labels, "annotations": annotations}}),
            )
        };
        let ours = json!({"create-by-descheduler": "true"});
        let cases = [
            ("made for this pod", replacement(&old, "vk"), true),
            (
                "made for an earlier pod of the same name",
                made(
                    ours.clone(),
                    json!({"tensile.dev/replaces-uid": "uid-of-another"}),
                ),
                false,
            ),
            (
                "labelled, no predecessor recorded",
                made(ours.clone(), json!({})),
                false,
            ),
            (
                "the predecessor but not the label",
                made(json!({}), json!({"tensile.dev/replaces-uid": "uid-web"})),
                false,
            ),
            ("somebody else's pod", made(json!({}), json!({})), false),
        ];
        for (name, existing, want) in cases {
            assert_eq!(is_replacement_of(&existing, &old), want, "{name}");
        }
        let no_uid = Pod {
            metadata: ObjectMeta {
                uid: None,
                ..old.metadata.clone()
            },
            ..old.clone()
        };
        assert!(
            !is_replacement_of(
                &made(ours, json!({"tensile.dev/replaces-uid": ""})),
                &no_uid
            ),
            "an empty UID matches nothing"
        );
    }

    #[test]
    fn claims_that_pin_a_pod_to_its_node() {
        let with_claims = |claims: &[&str]| {
            let volumes: Vec<Value> = claims
                .iter()
                .map(|c| json!({"name": c, "persistentVolumeClaim": {"claimName": c}}))
                .chain([json!({"name": "scratch", "emptyDir": {}})])
                .collect();
            pod("a", 1, json!({"spec": {"volumes": volumes}}))
        };
        let selected: BTreeMap<&str, &str> = [
            ("on-vk", "vk"),
            ("on-vk2", "vk2"),
            ("on-a-regular-node", "worker"),
            ("not-yet", ""),
        ]
        .into();
        let lookup = |claim: &str| selected.get(claim).map(|n| (*n).to_owned());
        let cases: [(&[&str], Option<&str>); 6] = [
            (&[], None),
            (&["unknown"], None),
            (&["not-yet"], None),
            (&["on-vk2", "on-a-regular-node"], None),
            (&["on-vk"], Some("on-vk")),
            (&["unknown", "on-vk2", "on-vk"], Some("on-vk")),
        ];
        for (claims, want) in cases {
            assert_eq!(
                pinning_claim(&with_claims(claims), "vk", lookup).as_deref(),
                want,
                "{claims:?}"
            );
        }
        assert_eq!(
            claim_names(&with_claims(&["x", "y"])).collect::<Vec<_>>(),
            ["x", "y"]
        );
    }

    #[test]
    fn methods() {
        let owned = |controller: bool| {
            pod(
                "a",
                1,
                json!({"metadata": {"ownerReferences": [{"apiVersion": "apps/v1",
                "kind": "ReplicaSet", "name": "r", "uid": "u", "controller": controller}]}}),
            )
        };
        assert_eq!(method(&owned(true)), Method::Evict);
        assert_eq!(method(&owned(false)), Method::Recreate);
        assert_eq!(method(&pod("a", 1, json!({}))), Method::Recreate);
    }

    #[test]
    fn marks_before_eviction() {
        let cases = [
            (
                json!({}),
                json!({"unschedulable-node": "vk", "sigs.k8s.io/deschedule-count": "1"}),
            ),
            (
                json!({"unschedulable-node": "vk2", "sigs.k8s.io/deschedule-count": "3"}),
                json!({"unschedulable-node": "vk,vk2", "sigs.k8s.io/deschedule-count": "4"}),
            ),
            (
                json!({"unschedulable-node": "vk", "sigs.k8s.io/deschedule-count": "3"}),
                json!({"unschedulable-node": "vk", "sigs.k8s.io/deschedule-count": "3"}),
            ),
            (
                json!({"sigs.k8s.io/deschedule-count": "garbage"}),
                json!({"unschedulable-node": "vk", "sigs.k8s.io/deschedule-count": "1"}),
            ),
        ];
        for (annotations, want) in cases {
            let p = pod("a", 1, json!({"metadata": {"annotations": annotations}}));
            assert_eq!(mark_patch(&p, "vk")["metadata"]["annotations"], want);
        }
    }

    #[test]
    fn replacement_keeps_everything_but_identity() {
        let old = pod(
            "web",
            300,
            json!({
                "metadata": {"labels": {"app": "web"}, "annotations": {"keep": "me", "clusterSelector": "{}"},
                             "managedFields": [{"manager": "m"}]},
                "spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
                    {"nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}}}},
            }),
        );
        let first = replacement(&old, "vk");
        let v = serde_json::to_value(&first).unwrap();
        assert_eq!(v["metadata"]["name"], "web-1");
        for gone in [
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "managedFields",
        ] {
            assert!(v["metadata"].get(gone).is_none(), "{gone}");
        }
        assert!(v.get("status").is_none());
        assert!(v["spec"].get("nodeName").is_none());
        assert_eq!(
            v["metadata"]["labels"],
            json!({"app": "web", "create-by-descheduler": "true"})
        );
        assert_eq!(
            v["metadata"]["annotations"],
            json!({"keep": "me", "clusterSelector": "{}", "unschedulable-node": "vk",
                   "sigs.k8s.io/deschedule-count": "1", "tensile.dev/replaces-uid": "uid-web"})
        );
        let not_in =
            json!({"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["vk"]});
        let terms = &v["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"];
        assert_eq!(terms[0]["matchExpressions"][1], not_in);
        assert_eq!(terms[1]["matchExpressions"][1], not_in);

        // A second round: all annotations still there, counter 2, both nodes avoided once.
        let mut placed = first.clone();
        placed.spec.as_mut().unwrap().node_name = Some("vk2".into());
        let second = serde_json::to_value(replacement(&placed, "vk2")).unwrap();
        assert_eq!(second["metadata"]["name"], "web-2");
        assert_eq!(second["metadata"]["annotations"]["keep"], "me");
        placed.metadata.uid = Some("uid-web-1".into());
        let second = serde_json::to_value(replacement(&placed, "vk2")).unwrap();
        assert_eq!(
            second["metadata"]["annotations"]["tensile.dev/replaces-uid"],
            "uid-web-1"
        );
        assert_eq!(
            second["metadata"]["annotations"]["sigs.k8s.io/deschedule-count"],
            "2"
        );
        let terms = &second["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            ["nodeSelectorTerms"];
        assert_eq!(terms[0]["matchExpressions"].as_array().unwrap().len(), 2);
        assert_eq!(
            terms[0]["matchExpressions"][1]["values"],
            json!(["vk", "vk2"])
        );

        // No affinity at all: one term of its own.
        let bare = serde_json::to_value(replacement(&pod("b", 1, json!({})), "vk")).unwrap();
        assert_eq!(
            bare["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                ["nodeSelectorTerms"],
            json!([{"matchExpressions": [not_in]}])
        );
    }

    #[test]
    fn replacement_names() {
        let named = |name: &str, recreated: bool| {
            let labels = if recreated {
                json!({"create-by-descheduler": "true"})
            } else {
                json!({})
            };
            pod(
                name,
                1,
                json!({"metadata": {"name": name, "labels": labels}}),
            )
        };
        let cases = [
            (named("web", false), 1, "web-1"),
            (named("web-1", true), 2, "web-2"),
            (named("web-1", false), 2, "web-1-2"),
            (named("app-9", true), 10, "app-10"),
            (
                named(&"x".repeat(260), false),
                1,
                &*format!("{}-1", "x".repeat(251)),
            ),
        ];
        for (p, count, want) in cases {
            assert_eq!(replacement_name(&p, count), want);
        }
    }

    #[test]
    fn policy_files() {
        let tensile_kube = r#"
apiVersion: "descheduler/v1alpha1"
kind: "DeschedulerPolicy"
strategies:
  "PodLifeTime":
     enabled: true
     params:
        maxPodLifeTimeSeconds: 120
  "RemoveDuplicates":
     enabled: true
"#;
        let cases: Vec<(&str, Result<PolicyFile, &str>)> = vec![
            (
                tensile_kube,
                Ok(PolicyFile {
                    max_pod_lifetime: Some(Duration::from_secs(120)),
                    ignored_strategies: vec!["RemoveDuplicates".into()],
                    return_home: None,
                }),
            ),
            (
                r#"{"kind": "DeschedulerPolicy", "strategies": {"PodLifeTime": {"params": {"maxPodLifeTimeSeconds": 30}}}}"#,
                Ok(PolicyFile {
                    max_pod_lifetime: Some(Duration::from_secs(30)),
                    ignored_strategies: vec![],
                    return_home: None,
                }),
            ),
            (
                "kind: DeschedulerPolicy\nstrategies:\n  ReturnHome:\n    params:\n      returnHomeAfterSeconds: 30\n      maxMovesPerRound: 0\n      maxMovesPerOwner: 2\n",
                Ok(PolicyFile {
                    return_home: Some(ReturnHomeFile {
                        enabled: true,
                        after: Some(Duration::from_secs(30)),
                        max_per_round: Some(0),
                        max_per_owner: Some(2),
                    }),
                    ..PolicyFile::default()
                }),
            ),
            (
                "strategies:\n  ReturnHome:\n    enabled: false\n",
                Ok(PolicyFile {
                    return_home: Some(ReturnHomeFile::default()),
                    ..PolicyFile::default()
                }),
            ),
            (
                "strategies:\n  ReturnHome:\n    params:\n      maxMovesPerOwner: 0\n",
                Err("maxMovesPerOwner must be at least 1"),
            ),
            (
                "strategies:\n  ReturnHome:\n    params:\n      returnHomeAfterSeconds: 0\n",
                Err("returnHomeAfterSeconds must be at least 1"),
            ),
            (
                "kind: DeschedulerPolicy\nstrategies:\n  PodLifeTime:\n    enabled: false\n    params:\n      maxPodLifeTimeSeconds: 5\n",
                Ok(PolicyFile::default()),
            ),
            ("kind: DeschedulerPolicy\n", Ok(PolicyFile::default())),
            ("kind: ConfigMap\n", Err("kind is \"ConfigMap\"")),
            ("strategies: [1, 2", Err("policy file p.yaml")),
            (
                "strategies:\n  PodLifeTime:\n    params:\n      maxPodLifeTimeSeconds: soon\n",
                Err("policy file p.yaml"),
            ),
        ];
        for (text, want) in cases {
            match (parse_policy("p.yaml", text), want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{text}"),
                (Err(got), Err(want)) => assert!(got.to_string().contains(want), "{got} / {want}"),
                (got, want) => panic!("{text}: got {got:?}, want {want:?}"),
            }
        }
    }
}
