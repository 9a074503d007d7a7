//! The scheduler's node filters a pod's spec asks for: tolerations against taints, required
//! node affinity (node selector terms and their requirements), and metav1 label selectors.
//! Pure; one copy for the scheduler extender's fit (which lower nodes a pod may go to) and
//! the descheduler's return-home fit (which regular nodes a burst pod may come back to).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Taint, Toleration,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

/// Whether `toleration` tolerates `taint` (kube's `Toleration.ToleratesTaint`).
pub fn tolerates(toleration: &Toleration, taint: &Taint) -> bool {
    let effect = toleration.effect.as_deref().unwrap_or_default();
    if !effect.is_empty() && effect != taint.effect {
        return false;
    }
    let key = toleration.key.as_deref().unwrap_or_default();
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match toleration.operator.as_deref().unwrap_or_default() {
        "" | "Equal" => {
            toleration.value.as_deref().unwrap_or_default()
                == taint.value.as_deref().unwrap_or_default()
        }
        "Exists" => true,
        _ => false,
    }
}

/// Whether required node affinity matches a node: any term, each term all of its
/// requirements; a term with no requirement matches nothing (as in kube).
pub fn selector_matches(
    selector: &NodeSelector,
    name: &str,
    labels: &BTreeMap<String, String>,
) -> bool {
    selector
        .node_selector_terms
        .iter()
        .any(|term| term_matches(term, name, labels))
}

fn term_matches(term: &NodeSelectorTerm, name: &str, labels: &BTreeMap<String, String>) -> bool {
    let expressions = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if expressions.is_empty() && fields.is_empty() {
        return false;
    }
    expressions
        .iter()
        .all(|r| requirement_matches(r, labels.get(&r.key).map(String::as_str)))
        && fields.iter().all(|r| {
            // metadata.name is the only node field selectors support, with In / NotIn.
            r.key == "metadata.name"
                && matches!(r.operator.as_str(), "In" | "NotIn")
                && requirement_matches(r, Some(name))
        })
}

/// One requirement against the value of its key (`None`: the key is absent).
pub fn requirement_matches(requirement: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = requirement.values.as_deref().unwrap_or_default();
    let number = |v: &str| v.parse::<i64>().ok();
    match requirement.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|x| x == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        op @ ("Gt" | "Lt") => {
            let [bound] = values else { return false };
            match (value.and_then(number), number(bound)) {
                (Some(v), Some(bound)) if op == "Gt" => v > bound,
                (Some(v), Some(bound)) => v < bound,
                _ => false,
            }
        }
        _ => false,
    }
}

/// A metav1 label selector against labels (an empty selector matches everything).
pub fn label_selector_matches(
    selector: &LabelSelector,
    labels: Option<&BTreeMap<String, String>>,
) -> bool {
    let get = |k: &str| labels.and_then(|l| l.get(k));
    selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| get(k) == Some(v))
        && selector.match_expressions.iter().flatten().all(|r| {
            let values = r.values.as_deref().unwrap_or_default();
            match r.operator.as_str() {
                "In" => get(&r.key).is_some_and(|v| values.contains(v)),
                "NotIn" => get(&r.key).is_none_or(|v| !values.contains(v)),
                "Exists" => get(&r.key).is_some(),
                "DoesNotExist" => get(&r.key).is_none(),
                _ => false,
            }
        })
}
