//! DaemonSets stay off virtual nodes unless they opt in. A DaemonSet whose pods tolerate
//! every taint (log and metrics agents: `tolerations: [{operator: Exists}]`) would get a
//! pod on every virtual node, mirrored into the lower cluster where it watches nothing of
//! the node it was meant for (Liqo #1398, Admiralty #50). The webhook adds
//! `type NotIn [virtual-kubelet]` to the required node affinity of the DaemonSet's pod
//! template, so the DaemonSet controller itself does not target virtual nodes: no pod is
//! created there, so none is deleted, and nothing loops.
//!
//! Pure: an admission request in, a JSON patch out. The object is handled as raw JSON so
//! that every field this module does not touch comes back exactly as it came.

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation, RemoveOperation};
use serde_json::{Map, Value, json};

use crate::mutate::{Decision, Outcome};
use crate::review::AdmissionRequest;

/// DaemonSet label that lets its pods onto virtual nodes, with the value [`ALLOW`].
pub const VIRTUAL_NODES_LABEL: &str = "tensile.dev/virtual-nodes";
/// The value of [`VIRTUAL_NODES_LABEL`] that opts a DaemonSet in.
pub const ALLOW: &str = "allow";
/// The label every virtual node carries (tensile-kube's `type: virtual-kubelet`).
pub const NODE_TYPE_LABEL: &str = "type";
/// Its value on virtual nodes.
pub const VIRTUAL_KUBELET: &str = "virtual-kubelet";

const AFFINITY_PATH: [&str; 4] = ["spec", "template", "spec", "affinity"];

/// Whether a request is about an `apps` DaemonSet (the server routes these here).
pub fn is_daemonset(request: &AdmissionRequest) -> bool {
    request.kind.group == "apps" && request.kind.kind == "DaemonSet"
}

/// The requirement added to every required node-selector term.
pub fn off_virtual_nodes() -> Value {
    json!({"key": NODE_TYPE_LABEL, "operator": "NotIn", "values": [VIRTUAL_KUBELET]})
}

/// Admits one DaemonSet request. Never denies.
///
/// On CREATE and UPDATE, without the opt-in label: ANDs [`off_virtual_nodes`] into every
/// term of the template's required node affinity (an empty term, which matches no node,
/// is left so; no required affinity gets one term), unless every term already has it.
/// With `tensile.dev/virtual-nodes: allow`: takes exactly that requirement out again (and
/// the terms and fields it alone made), so a DaemonSet opted in later gets its pods there.
pub fn admit(request: &AdmissionRequest) -> Outcome {
    use Decision::{Ignored, Mutated, Unchanged};
    if !is_daemonset(request) {
        return outcome(Ignored, "not a DaemonSet", Patch(Vec::new()), Vec::new());
    }
    if request
        .sub_resource
        .as_deref()
        .is_some_and(|s| !s.is_empty())
    {
        return outcome(Ignored, "a subresource", Patch(Vec::new()), Vec::new());
    }
    if !matches!(request.operation.as_str(), "CREATE" | "UPDATE") {
        return outcome(
            Ignored,
            "neither CREATE nor UPDATE",
            Patch(Vec::new()),
            Vec::new(),
        );
    }
    let Some(object) = request.object.as_ref() else {
        return outcome(Ignored, "no object", Patch(Vec::new()), Vec::new());
    };
    let opt_in = object
        .get("metadata")
        .and_then(|m| m.get("labels"))
        .and_then(|l| l.get(VIRTUAL_NODES_LABEL));
    let mut warnings = Vec::new();
    let allow = match opt_in {
        None | Some(Value::Null) => false,
        Some(Value::String(value)) if value == ALLOW => true,
        Some(other) => {
            warnings.push(warning(
                request,
                &format!(
                    "label {VIRTUAL_NODES_LABEL}={other} is not {ALLOW:?}: its pods are kept \
                     off virtual nodes"
                ),
            ));
            false
        }
    };
    let Some(spec) = object
        .get("spec")
        .and_then(|s| s.get("template"))
        .and_then(|t| t.get("spec"))
        .and_then(Value::as_object)
    else {
        return unreadable(request, "spec.template.spec is missing or not an object");
    };
    let affinity = match spec.get("affinity") {
        None | Some(Value::Null) => None,
        Some(Value::Object(affinity)) => Some(affinity),
        Some(_) => return unreadable(request, "spec.template.spec.affinity is not an object"),
    };
    let planned = if allow {
        affinity.map_or(Ok(None), allow_virtual_nodes)
    } else {
        exclude_virtual_nodes(affinity)
    };
    let new = match planned {
        Ok(Some(new)) => new,
        Ok(None) => return outcome(Unchanged, "nothing to change", Patch(Vec::new()), warnings),
        Err(what) => return unreadable(request, &what),
    };
    let path = PointerBuf::from_tokens(AFFINITY_PATH);
    let op = if new.is_empty() {
        PatchOperation::Remove(RemoveOperation { path })
    } else {
        PatchOperation::Add(AddOperation {
            path,
            value: Value::Object(new),
        })
    };
    let reason = if allow {
        "opted in: virtual nodes allowed"
    } else {
        "kept off virtual nodes"
    };
    outcome(Mutated, reason, Patch(vec![op]), warnings)
}

fn outcome(
    decision: Decision,
    reason: &'static str,
    patch: Patch,
    warnings: Vec<String>,
) -> Outcome {
    Outcome {
        decision,
        reason,
        patch,
        warnings,
    }
}

fn warning(request: &AdmissionRequest, what: &str) -> String {
    crate::review::short_warning(format!(
        "tensile-webhook: DaemonSet {}: {what}",
        request.object_ref()
    ))
}

fn unreadable(request: &AdmissionRequest, what: &str) -> Outcome {
    outcome(
        Decision::Unreadable,
        "unreadable DaemonSet",
        Patch(Vec::new()),
        vec![warning(
            request,
            &format!("left unchanged, its pods may land on virtual nodes: {what}"),
        )],
    )
}

/// An object field that may be absent or null (both read as absent).
fn object_at<'a>(
    map: &'a Map<String, Value>,
    key: &str,
    path: &str,
) -> Result<Option<&'a Map<String, Value>>, String> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(inner)) => Ok(Some(inner)),
        Some(_) => Err(format!("{path}.{key} is not an object")),
    }
}

/// An array field that may be absent or null (both read as empty).
fn array_at<'a>(map: &'a Map<String, Value>, key: &str, path: &str) -> Result<&'a [Value], String> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(items)) => Ok(items),
        Some(_) => Err(format!("{path}.{key} is not an array")),
    }
}

const REQUIRED: &str = "requiredDuringSchedulingIgnoredDuringExecution";
const AFFINITY: &str = "spec.template.spec.affinity";

/// Whether `requirement` keeps pods off virtual nodes (ours, or the same written by hand).
fn excludes_virtual_nodes(requirement: &Value) -> bool {
    requirement.get("key").and_then(Value::as_str) == Some(NODE_TYPE_LABEL)
        && requirement.get("operator").and_then(Value::as_str) == Some("NotIn")
        && requirement
            .get("values")
            .and_then(Value::as_array)
            .is_some_and(|values| values.iter().any(|v| v == VIRTUAL_KUBELET))
}

/// The affinity with [`off_virtual_nodes`] in every term that can take it; `None` when
/// every term has it already; `Err` when part of it cannot be read.
fn exclude_virtual_nodes(
    affinity: Option<&Map<String, Value>>,
) -> Result<Option<Map<String, Value>>, String> {
    let mut affinity = affinity.cloned().unwrap_or_default();
    let node_path = format!("{AFFINITY}.nodeAffinity");
    let required_path = format!("{node_path}.{REQUIRED}");
    let mut node_affinity = object_at(&affinity, "nodeAffinity", AFFINITY)?
        .cloned()
        .unwrap_or_default();
    let mut required = object_at(&node_affinity, REQUIRED, &node_path)?
        .cloned()
        .unwrap_or_default();
    let terms = array_at(&required, "nodeSelectorTerms", &required_path)?;
    let mut changed = false;
    let mut new_terms = Vec::with_capacity(terms.len().max(1));
    for (i, term) in terms.iter().enumerate() {
        let term_path = format!("{required_path}.nodeSelectorTerms[{i}]");
        let Value::Object(term) = term else {
            return Err(format!("{term_path} is not an object"));
        };
        let expressions = array_at(term, "matchExpressions", &term_path)?;
        let fields = array_at(term, "matchFields", &term_path)?;
        // An empty term matches no node; adding a requirement would make it match some.
        if (expressions.is_empty() && fields.is_empty())
            || expressions.iter().any(excludes_virtual_nodes)
        {
            new_terms.push(Value::Object(term.clone()));
            continue;
        }
        let mut expressions = expressions.to_vec();
        expressions.push(off_virtual_nodes());
        let mut term = term.clone();
        term.insert("matchExpressions".into(), Value::Array(expressions));
        new_terms.push(Value::Object(term));
        changed = true;
    }
    if terms.is_empty() {
        new_terms.push(json!({"matchExpressions": [off_virtual_nodes()]}));
        changed = true;
    }
    if !changed {
        return Ok(None);
    }
    required.insert("nodeSelectorTerms".into(), Value::Array(new_terms));
    node_affinity.insert(REQUIRED.into(), Value::Object(required));
    affinity.insert("nodeAffinity".into(), Value::Object(node_affinity));
    Ok(Some(affinity))
}

/// The affinity without the exact requirement [`off_virtual_nodes`] adds, dropping what it
/// alone made (a term, the required affinity, nodeAffinity, the affinity: an empty map
/// means remove it); `None` when it is not there.
fn allow_virtual_nodes(
    affinity: &Map<String, Value>,
) -> Result<Option<Map<String, Value>>, String> {
    let node_path = format!("{AFFINITY}.nodeAffinity");
    let required_path = format!("{node_path}.{REQUIRED}");
    let Some(node_affinity) = object_at(affinity, "nodeAffinity", AFFINITY)? else {
        return Ok(None);
    };
    let Some(required) = object_at(node_affinity, REQUIRED, &node_path)? else {
        return Ok(None);
    };
    let ours = off_virtual_nodes();
    let terms = array_at(required, "nodeSelectorTerms", &required_path)?;
    let mut changed = false;
    let mut new_terms = Vec::with_capacity(terms.len());
    for (i, term) in terms.iter().enumerate() {
        let term_path = format!("{required_path}.nodeSelectorTerms[{i}]");
        let Value::Object(term) = term else {
            return Err(format!("{term_path} is not an object"));
        };
        let expressions = array_at(term, "matchExpressions", &term_path)?;
        if !expressions.contains(&ours) {
            new_terms.push(Value::Object(term.clone()));
            continue;
        }
        changed = true;
        let kept: Vec<Value> = expressions
            .iter()
            .filter(|e| **e != ours)
            .cloned()
            .collect();
        let fields = array_at(term, "matchFields", &term_path)?;
        if kept.is_empty() && fields.is_empty() {
            // A term of ours alone: keeping it empty would match no node.
            continue;
        }
        let mut term = term.clone();
        if kept.is_empty() {
            term.remove("matchExpressions");
        } else {
            term.insert("matchExpressions".into(), Value::Array(kept));
        }
        new_terms.push(Value::Object(term));
    }
    if !changed {
        return Ok(None);
    }
    let mut affinity = affinity.clone();
    let mut node_affinity = node_affinity.clone();
    let mut required = required.clone();
    if new_terms.is_empty() {
        // No term left: no required affinity at all (an empty list is invalid).
        required.remove("nodeSelectorTerms");
    } else {
        required.insert("nodeSelectorTerms".into(), Value::Array(new_terms));
    }
    if required.is_empty() {
        node_affinity.remove(REQUIRED);
    } else {
        node_affinity.insert(REQUIRED.into(), Value::Object(required));
    }
    if node_affinity.is_empty() {
        affinity.remove("nodeAffinity");
    } else {
        affinity.insert("nodeAffinity".into(), Value::Object(node_affinity));
    }
    Ok(Some(affinity))
}

#[cfg(test)]
#[path = "daemonset_tests.rs"]
mod tests;
