//! The pure core: what the webhook does to an admission request, as a JSON patch. No
//! client, no I/O; the PVC lookup and the descheduler memory are passed in.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation, RemoveOperation};
use k8s_openapi::api::core::v1::{
    Affinity, NodeAffinity, NodeSelectorRequirement, NodeSelectorTerm, Pod, PodSpec,
    PreferredSchedulingTerm, Toleration,
};
use serde::Deserialize;
use serde_json::Value;
use tensile::translate::meta::{
    CLUSTER_SELECTOR_ANNOTATION, VIRTUAL_NODE_TAINT_EFFECT, VIRTUAL_POD_LABEL,
};
use tensile::translate::scheduling::{avoid_nodes, parse_cluster_selector, stash_constraints};

use crate::memory::DeschedulerMemory;
use crate::review::AdmissionRequest;

/// Pod label the descheduler puts on pods it re-creates (tensile-kube); they are already
/// mutated and left alone.
pub const CREATED_BY_DESCHEDULER_LABEL: &str = "create-by-descheduler";
/// Pod annotation the descheduler sets, naming the node it moves the pod off.
pub const UNSCHEDULABLE_NODE_ANNOTATION: &str = "unschedulable-node";
/// Pod annotation `tensile.dev/burst: eager`: the pod bursts as soon as a virtual node
/// scores best by room (the scheduler extender reads it).
pub use tensile::node::burst::{BURST_ANNOTATION, BURST_EAGER};
/// Key of the virtual node's taint (tensile-kube's default), the one virtual-node uses.
pub use tensile::translate::meta::VIRTUAL_NODE_TAINT_KEY;
/// Node label matched to keep a descheduled pod's sibling off the node it left.
pub use tensile::translate::volume::HOSTNAME_LABEL;
/// Weight of the preference for regular nodes that the webhook adds to pods it lets burst
/// (the most a preferred term may weigh).
pub const LOCAL_FIRST_WEIGHT: i32 = 100;
/// The label every virtual node carries: what selects it stays in the upper spec, never
/// stashed ([`stash_constraints`]).
pub use tensile::translate::meta::VIRTUAL_NODE_LABEL;
const NOT_READY: &str = "node.kubernetes.io/not-ready";
const UNREACHABLE: &str = "node.kubernetes.io/unreachable";

/// What the webhook does, from its flags.
#[derive(Debug, Clone)]
pub struct MutateConfig {
    /// nodeSelector and required node-affinity keys that stay in the upper spec
    /// (`--ignore-selector-keys`; default `clusterID`, the virtual node's cluster label).
    pub ignore_selector_keys: BTreeSet<String>,
    /// Namespaces whose pods are never mutated (default `kube-system`).
    pub excluded_namespaces: BTreeSet<String>,
    /// Namespaces whose pods burst eagerly (`--eager-namespaces`): annotated
    /// `tensile.dev/burst: eager`, and not given the preference for regular nodes.
    pub eager_namespaces: BTreeSet<String>,
    /// Add [`local_first_term`] to pods that are not eager (`--prefer-regular-nodes`).
    pub prefer_regular_nodes: bool,
    /// Toleration added to the upper pod so it can land on a virtual node; `None` adds none.
    pub virtual_node_toleration: Option<Toleration>,
}

impl Default for MutateConfig {
    fn default() -> Self {
        Self {
            ignore_selector_keys: BTreeSet::from(["clusterID".to_owned()]),
            excluded_namespaces: BTreeSet::from(["kube-system".to_owned()]),
            eager_namespaces: BTreeSet::new(),
            prefer_regular_nodes: true,
            virtual_node_toleration: Some(virtual_node_toleration(
                VIRTUAL_NODE_TAINT_KEY,
                VIRTUAL_NODE_TAINT_EFFECT,
            )),
        }
    }
}

/// A toleration of the virtual node's taint, whatever its value.
pub fn virtual_node_toleration(key: &str, effect: &str) -> Toleration {
    Toleration {
        key: Some(key.to_owned()),
        operator: Some("Exists".to_owned()),
        effect: (!effect.is_empty()).then(|| effect.to_owned()),
        ..Toleration::default()
    }
}

/// The preferred node-affinity term that keeps a pod on regular nodes while they have
/// room (`type NotIn [virtual-kubelet]`, weight 100): local first for clusters whose
/// kube-scheduler does not call the scheduler extender.
pub fn local_first_term() -> PreferredSchedulingTerm {
    PreferredSchedulingTerm {
        weight: LOCAL_FIRST_WEIGHT,
        preference: NodeSelectorTerm {
            match_expressions: Some(vec![NodeSelectorRequirement {
                key: "type".to_owned(),
                operator: "NotIn".to_owned(),
                values: Some(vec!["virtual-kubelet".to_owned()]),
            }]),
            match_fields: None,
        },
    }
}

/// Adds [`local_first_term`] to the pod's preferred node affinity, unless already there.
fn prefer_regular_nodes(spec: &mut PodSpec) {
    let term = local_first_term();
    let preferred = spec
        .affinity
        .get_or_insert_with(Affinity::default)
        .node_affinity
        .get_or_insert_with(NodeAffinity::default)
        .preferred_during_scheduling_ignored_during_execution
        .get_or_insert_with(Vec::new);
    if !preferred.contains(&term) {
        preferred.push(term);
    }
}

/// Where the `volume.kubernetes.io/selected-node` annotation of the upper PVCs is looked up.
pub trait SelectedNodes {
    /// The node PVC `namespace/claim` is bound to, if it carries the annotation.
    fn selected_node(&self, namespace: &str, claim: &str) -> Option<String>;
}

/// No PVC carries the annotation (for tests and the benchmark).
#[derive(Debug, Default, Clone, Copy)]
pub struct NoSelectedNodes;

impl SelectedNodes for NoSelectedNodes {
    fn selected_node(&self, _: &str, _: &str) -> Option<String> {
        None
    }
}

/// `(namespace, claim) → node`, for tests.
impl SelectedNodes for BTreeMap<(String, String), String> {
    fn selected_node(&self, namespace: &str, claim: &str) -> Option<String> {
        self.get(&(namespace.to_owned(), claim.to_owned())).cloned()
    }
}

/// What became of a request (a metrics label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Not the webhook's business: another kind or operation, an unlabelled pod, an
    /// excluded namespace, a pod the descheduler re-created.
    Ignored,
    /// A targeted pod that needed no change.
    Unchanged,
    /// A targeted pod, patched.
    Mutated,
    /// An update whose descheduled node was remembered.
    Remembered,
    /// A targeted pod that could not be read: allowed unchanged, with a warning.
    Unreadable,
}

impl Decision {
    /// Every decision, in a fixed order.
    pub const ALL: [Decision; 5] = [
        Decision::Ignored,
        Decision::Unchanged,
        Decision::Mutated,
        Decision::Remembered,
        Decision::Unreadable,
    ];

    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Decision::Ignored => "ignored",
            Decision::Unchanged => "unchanged",
            Decision::Mutated => "mutated",
            Decision::Remembered => "remembered",
            Decision::Unreadable => "unreadable",
        }
    }
}

/// The answer to one request: always allowed, with a patch (possibly empty) and warnings.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// What became of it.
    pub decision: Decision,
    /// Why, in a few words (for the log).
    pub reason: &'static str,
    /// The JSON patch; empty when nothing changes.
    pub patch: Patch,
    /// Warnings for the user who made the request.
    pub warnings: Vec<String>,
}

impl Outcome {
    fn unchanged(decision: Decision, reason: &'static str) -> Self {
        Self {
            decision,
            reason,
            patch: Patch(Vec::new()),
            warnings: Vec::new(),
        }
    }
}

/// Admits one request. Never denies: anything the webhook does not handle, or cannot read,
/// is allowed as it came.
///
/// On CREATE of a pod labelled `virtual-pod: "true"` outside the excluded namespaces:
/// stashes its constraints in `clusterSelector` ([`stash_constraints`]; what selects the
/// virtual node itself, [`VIRTUAL_NODE_LABEL`], stays), normalises its
/// tolerations and adds the virtual node's, binds it to the node a PVC it mounts was
/// provisioned on, and keeps it off nodes a sibling was just descheduled from. On UPDATE
/// of such a pod annotated `unschedulable-node`, remembers that node for its owner.
pub fn admit(
    request: &AdmissionRequest,
    config: &MutateConfig,
    memory: &DeschedulerMemory,
    volumes: &dyn SelectedNodes,
    now: Instant,
) -> Outcome {
    use Decision::{Ignored, Unchanged};
    if !(request.kind.group.is_empty() && request.kind.kind == "Pod") {
        return Outcome::unchanged(Ignored, "not a pod");
    }
    if request
        .sub_resource
        .as_deref()
        .is_some_and(|s| !s.is_empty())
    {
        return Outcome::unchanged(Ignored, "a subresource");
    }
    let create = match request.operation.as_str() {
        "CREATE" => true,
        "UPDATE" => false,
        _ => return Outcome::unchanged(Ignored, "neither CREATE nor UPDATE"),
    };
    let Some(object) = request.object.as_ref() else {
        return Outcome::unchanged(Ignored, "no object");
    };
    // Cheap checks on the raw object first: most pods are not ours.
    let label = |key: &str| {
        object
            .get("metadata")
            .and_then(|m| m.get("labels"))
            .and_then(|l| l.get(key))
            .and_then(Value::as_str)
    };
    if label(VIRTUAL_POD_LABEL) != Some("true") {
        return Outcome::unchanged(Ignored, "not labelled virtual-pod=true");
    }
    if label(CREATED_BY_DESCHEDULER_LABEL) == Some("true") {
        return Outcome::unchanged(Ignored, "re-created by the descheduler");
    }
    let namespace = request
        .namespace
        .clone()
        .filter(|ns| !ns.is_empty())
        .or_else(|| {
            let ns = object.get("metadata")?.get("namespace")?.as_str()?;
            Some(ns.to_owned())
        })
        .unwrap_or_default();
    if config.excluded_namespaces.contains(&namespace) {
        return Outcome::unchanged(Ignored, "excluded namespace");
    }

    if !object.get("spec").is_some_and(Value::is_object) {
        // The API server rejects such a pod anyway; there is nothing to patch into.
        return Outcome::unchanged(Ignored, "no spec");
    }
    let pod = match Pod::deserialize(object) {
        Ok(pod) => pod,
        Err(error) => return unreadable(request, "the pod", &error),
    };
    if !create {
        return remember_descheduled(&pod, request.dry_run == Some(true), memory, now);
    }
    let annotations = pod.metadata.annotations.as_ref();
    let already_stashed = match parse_cluster_selector(annotations) {
        Ok(stash) => stash.is_some(),
        Err(error) => return unreadable(request, CLUSTER_SELECTOR_ANNOTATION, &error),
    };
    let annotated_eager = annotations
        .and_then(|a| a.get(BURST_ANNOTATION))
        .map(|v| v.trim())
        == Some(BURST_EAGER);
    let namespace_eager = config.eager_namespaces.contains(&namespace);
    let old = pod.spec.unwrap_or_default();
    let mut new = old.clone();

    // Re-stashing an already mutated pod (re-created from a dump of one, or reinvoked)
    // would replace the original constraints with the upper ones. So the annotation is
    // written even when there is nothing to stash (`{}`, which virtual-node reads like
    // no annotation): it marks the pod as done.
    let stash =
        (!already_stashed).then(|| stash_constraints(&mut new, &config.ignore_selector_keys));
    new.tolerations = Some(upper_tolerations(
        new.tolerations.as_deref(),
        config.virtual_node_toleration.as_ref(),
    ));
    if new.node_name.as_deref().is_none_or(str::is_empty) {
        new.node_name = new
            .volumes
            .iter()
            .flatten()
            .filter_map(|v| v.persistent_volume_claim.as_ref())
            .find_map(|claim| volumes.selected_node(&namespace, &claim.claim_name))
            .filter(|node| !node.is_empty());
    }
    if new.node_name.as_deref().is_none_or(str::is_empty)
        && let Some(owner) = owner_uid(&pod.metadata)
    {
        let avoid = memory.nodes(owner, now);
        if !avoid.is_empty() {
            avoid_nodes(&mut new, &avoid);
        }
    }

    // After the stash: the preference is for the upper cluster's nodes only (the lower
    // copy keeps preferred terms, where it means local first again, or nothing).
    if config.prefer_regular_nodes && !(annotated_eager || namespace_eager) {
        prefer_regular_nodes(&mut new);
    }

    let mut patch = PatchBuilder::new(object);
    if namespace_eager && !annotated_eager {
        patch.set_annotation(BURST_ANNOTATION, BURST_EAGER.to_owned());
    }
    if let Some(stash) = &stash {
        match serde_json::to_string(stash) {
            Ok(json) => patch.set_annotation(CLUSTER_SELECTOR_ANNOTATION, json),
            // A typed value always encodes; should it not, leave the pod as it came.
            Err(error) => return unreadable(request, "the stash", &error),
        }
    }
    patch.spec_field(
        "nodeSelector",
        old.node_selector.as_ref(),
        new.node_selector.as_ref(),
    );
    patch.spec_field(
        "tolerations",
        old.tolerations.as_ref(),
        new.tolerations.as_ref(),
    );
    patch.spec_field("nodeName", old.node_name.as_ref(), new.node_name.as_ref());
    patch.affinity(old.affinity.as_ref(), new.affinity.as_ref());
    let ops = patch.finish();
    if ops.0.is_empty() {
        return Outcome::unchanged(Unchanged, "nothing to change");
    }
    Outcome {
        decision: Decision::Mutated,
        reason: "mutated",
        patch: ops,
        warnings: Vec::new(),
    }
}

fn unreadable(request: &AdmissionRequest, what: &str, error: &dyn std::fmt::Display) -> Outcome {
    let warning = crate::review::short_warning(format!(
        "tensile-webhook left pod {} unchanged: cannot read {what}: {error}",
        request.object_ref()
    ));
    Outcome {
        decision: Decision::Unreadable,
        reason: "unreadable pod",
        patch: Patch(Vec::new()),
        warnings: vec![warning],
    }
}

fn remember_descheduled(
    pod: &Pod,
    dry_run: bool,
    memory: &DeschedulerMemory,
    now: Instant,
) -> Outcome {
    let nodes = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(UNSCHEDULABLE_NODE_ANNOTATION))
        .map(|v| v.split(',').map(str::trim).filter(|n| !n.is_empty()));
    let (Some(nodes), Some(owner)) = (nodes, owner_uid(&pod.metadata)) else {
        return Outcome::unchanged(Decision::Unchanged, "update without a descheduled node");
    };
    if dry_run {
        return Outcome::unchanged(Decision::Unchanged, "dry run");
    }
    let mut remembered = false;
    for node in nodes {
        remembered |= memory.remember(owner, node, now);
    }
    if remembered {
        Outcome::unchanged(Decision::Remembered, "descheduled node remembered")
    } else {
        Outcome::unchanged(Decision::Unchanged, "descheduler memory full")
    }
}

/// The UID of the pod's controller, else of its first owner.
fn owner_uid(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Option<&str> {
    let owners = meta.owner_references.as_deref()?;
    owners
        .iter()
        .find(|o| o.controller == Some(true))
        .or_else(|| owners.first())
        .map(|o| o.uid.as_str())
        .filter(|uid| !uid.is_empty())
}

/// The upper pod's tolerations, as tensile-kube normalises them: not-ready and unreachable
/// tolerated forever (a virtual node that stops reporting must not get its pods evicted
/// while they run below), plus a toleration of the virtual node's taint unless one
/// already covers it. Duplicates are dropped; order is kept.
pub fn upper_tolerations(
    tolerations: Option<&[Toleration]>,
    virtual_node: Option<&Toleration>,
) -> Vec<Toleration> {
    let forever = |key: &str| Toleration {
        key: Some(key.to_owned()),
        operator: Some("Exists".to_owned()),
        effect: Some("NoExecute".to_owned()),
        ..Toleration::default()
    };
    let mut out: Vec<Toleration> = Vec::new();
    let push = |out: &mut Vec<Toleration>, t: Toleration| {
        if !out.contains(&t) {
            out.push(t);
        }
    };
    for t in tolerations.into_iter().flatten() {
        match t.key.as_deref() {
            Some(key @ (NOT_READY | UNREACHABLE)) => push(&mut out, forever(key)),
            _ => push(&mut out, t.clone()),
        }
    }
    for key in [NOT_READY, UNREACHABLE] {
        if !out.iter().any(|t| t.key.as_deref() == Some(key)) {
            push(&mut out, forever(key));
        }
    }
    if let Some(wanted) = virtual_node
        && !out.iter().any(|t| covers(t, wanted))
    {
        push(&mut out, wanted.clone());
    }
    out
}

/// Whether `t` tolerates at least what `wanted` (an `Exists` toleration) does.
fn covers(t: &Toleration, wanted: &Toleration) -> bool {
    if t == wanted {
        return true;
    }
    let exists = t.operator.as_deref() == Some("Exists");
    let key = t.key.as_deref().is_none_or(str::is_empty) || t.key == wanted.key;
    let effect = t.effect.as_deref().is_none_or(str::is_empty) || t.effect == wanted.effect;
    exists && key && effect
}

/// Builds the smallest JSON patch that turns the raw object into the mutated one, one
/// field at a time, addressing only paths that exist in the raw object.
struct PatchBuilder<'a> {
    object: &'a Value,
    ops: Vec<PatchOperation>,
}

impl<'a> PatchBuilder<'a> {
    fn new(object: &'a Value) -> Self {
        Self {
            object,
            ops: Vec::new(),
        }
    }

    fn finish(self) -> Patch {
        Patch(self.ops)
    }

    fn get(&self, path: &[&str]) -> Option<&'a Value> {
        path.iter()
            .try_fold(self.object, |value, token| value.get(*token))
    }

    fn is_object(&self, path: &[&str]) -> bool {
        self.get(path).is_some_and(Value::is_object)
    }

    fn add(&mut self, path: &[&str], value: Value) {
        self.ops.push(PatchOperation::Add(AddOperation {
            path: PointerBuf::from_tokens(path.iter().copied()),
            value,
        }));
    }

    /// Removes `path` if the raw object has it.
    fn remove(&mut self, path: &[&str]) {
        if self.get(path).is_some() {
            self.ops.push(PatchOperation::Remove(RemoveOperation {
                path: PointerBuf::from_tokens(path.iter().copied()),
            }));
        }
    }

    /// Sets `path` (its parent must be an object), or removes it for `None`.
    fn put(&mut self, path: &[&str], value: Option<Value>) {
        match value {
            Some(value) => self.add(path, value),
            None => self.remove(path),
        }
    }

    fn set_annotation(&mut self, key: &str, value: String) {
        // A map this patch already adds takes the key: a second add would replace it.
        let annotations = PointerBuf::from_tokens(["metadata", "annotations"]);
        let metadata = PointerBuf::from_tokens(["metadata"]);
        for op in &mut self.ops {
            if let PatchOperation::Add(add) = op {
                let map = if add.path == annotations {
                    add.value.as_object_mut()
                } else if add.path == metadata {
                    add.value
                        .get_mut("annotations")
                        .and_then(Value::as_object_mut)
                } else {
                    None
                };
                if let Some(map) = map {
                    map.insert(key.to_owned(), Value::String(value));
                    return;
                }
            }
        }
        if self.is_object(&["metadata", "annotations"]) {
            self.add(&["metadata", "annotations", key], Value::String(value));
        } else if self.is_object(&["metadata"]) {
            let annotations = serde_json::Map::from_iter([(key.to_owned(), Value::String(value))]);
            self.add(&["metadata", "annotations"], Value::Object(annotations));
        } else {
            let annotations = serde_json::json!({ key: value });
            self.add(
                &["metadata"],
                serde_json::json!({ "annotations": annotations }),
            );
        }
    }

    /// Sets a top-level spec field when its meaning changed.
    fn spec_field<T: serde::Serialize>(&mut self, field: &str, old: Option<&T>, new: Option<&T>) {
        let (old, new) = (meaningful(old), meaningful(new));
        if old == new {
            return;
        }
        self.put(&["spec", field], new);
    }

    /// Sets the affinity at the deepest level that changed (only node affinity's required
    /// part ever does; the rest is written whole should anything else differ).
    fn affinity(&mut self, old: Option<&Affinity>, new: Option<&Affinity>) {
        if meaningful(old) == meaningful(new) {
            return;
        }
        let (Some(old), Some(new)) = (old, new) else {
            self.spec_field("affinity", old, new);
            return;
        };
        let rest = |a: &Affinity| Affinity {
            node_affinity: None,
            ..a.clone()
        };
        let preferred = |a: &Affinity| {
            a.node_affinity.as_ref().and_then(|n| {
                n.preferred_during_scheduling_ignored_during_execution
                    .clone()
            })
        };
        let path = ["spec", "affinity", "nodeAffinity"];
        if meaningful(Some(&rest(old))) != meaningful(Some(&rest(new)))
            || meaningful(preferred(old).as_ref()) != meaningful(preferred(new).as_ref())
            || !self.is_object(&["spec", "affinity"])
        {
            self.spec_field("affinity", Some(old), Some(new));
        } else if !self.is_object(&path) || new.node_affinity.is_none() {
            self.put(&path, meaningful(new.node_affinity.as_ref()));
        } else {
            let required = new.node_affinity.as_ref().and_then(|n| {
                n.required_during_scheduling_ignored_during_execution
                    .as_ref()
            });
            self.put(
                &[
                    "spec",
                    "affinity",
                    "nodeAffinity",
                    "requiredDuringSchedulingIgnoredDuringExecution",
                ],
                meaningful(required),
            );
        }
    }
}

/// A value as JSON with nulls and empty objects and arrays left out (`None` if nothing is
/// left): the API server treats them as absent, so they are no change worth a patch.
fn meaningful<T: serde::Serialize>(value: Option<&T>) -> Option<Value> {
    fn prune(value: Value) -> Option<Value> {
        match value {
            Value::Null => None,
            Value::Object(map) => {
                let map: serde_json::Map<_, _> = map
                    .into_iter()
                    .filter_map(|(k, v)| Some((k, prune(v)?)))
                    .collect();
                (!map.is_empty()).then_some(Value::Object(map))
            }
            Value::Array(items) if items.is_empty() => None,
            // Array items keep their place: an empty item still counts.
            other => Some(other),
        }
    }
    prune(serde_json::to_value(value?).ok()?)
}

#[cfg(test)]
#[path = "mutate_tests.rs"]
mod tests;
