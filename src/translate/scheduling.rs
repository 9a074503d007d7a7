//! The `clusterSelector` stash: the scheduling constraints the webhook takes off a pod so
//! the upper scheduler can place it on a virtual node, and gives back below.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{
    Affinity, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PodSpec,
    Toleration,
};
use serde::{Deserialize, Serialize};

use super::TranslateError;
use super::meta::{CLUSTER_SELECTOR_ANNOTATION, VIRTUAL_NODE_LABEL};
use super::volume::HOSTNAME_LABEL;

/// A pod's original constraints, as JSON `{"nodeSelector":…,"affinity":…,"tolerations":…}`
/// (tensile-kube's `ClustersNodeSelection`).
#[derive(Serialize, Deserialize, Default, Clone, Debug, PartialEq)]
pub struct ClusterSelector {
    /// The pod's original `spec.nodeSelector`.
    #[serde(
        rename = "nodeSelector",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// The pod's original affinity (tensile-kube's webhook stashes only the required node
    /// affinity).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// The pod's original tolerations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tolerations: Option<Vec<Toleration>>,
}

/// Reads the `clusterSelector` annotation: `Ok(None)` when absent or empty (tensile-kube
/// treats an empty value as absent), an error when it is not valid JSON.
pub fn parse_cluster_selector(
    annotations: Option<&BTreeMap<String, String>>,
) -> Result<Option<ClusterSelector>, TranslateError> {
    let Some(raw) = annotations.and_then(|a| a.get(CLUSTER_SELECTOR_ANNOTATION)) else {
        return Ok(None);
    };
    if raw.is_empty() {
        return Ok(None);
    }
    serde_json::from_str(raw)
        .map(Some)
        .map_err(|source| TranslateError::BadAnnotation {
            object: String::from("pod"),
            key: CLUSTER_SELECTOR_ANNOTATION,
            source,
        })
}

/// Takes the constraints meant for the lower cluster off an upper pod, as tensile-kube's
/// webhook does, and returns them for the `clusterSelector` annotation; the inverse of
/// [`restore_constraints`].
///
/// - `nodeSelector`: entries whose key is in `keep` stay in `spec`; the others move.
/// - required node affinity: in each term, requirements (`matchExpressions` and
///   `matchFields`) on a key in `keep` stay, the others move.
/// - what selects the virtual node itself ([`VIRTUAL_NODE_LABEL`]: a nodeSelector entry
///   `type: virtual-kubelet`, a required `type In [virtual-kubelet]`) stays, whatever
///   `keep` holds: it is for the upper scheduler, and no lower node carries it. Another
///   value of `type`, `NotIn`, or more values move as any other. Terms are alternatives, so a
///   term left with nothing on one side leaves that side unconstrained (no required
///   affinity at all), rather than narrowing it to the other terms.
/// - tolerations are copied, not moved: the upper pod still needs them (what it should
///   tolerate up there is the caller's policy).
///
/// Preferred node affinity and pod (anti-)affinity stay in `spec` and are not stashed.
/// Empty results are absent (`None`), in `spec` and in the stash alike.
pub fn stash_constraints(spec: &mut PodSpec, keep: &BTreeSet<String>) -> ClusterSelector {
    let mut stash = ClusterSelector::default();

    if let Some(selector) = spec.node_selector.take() {
        let (kept, moved): (BTreeMap<_, _>, BTreeMap<_, _>) = selector
            .into_iter()
            .partition(|(k, v)| keep.contains(k) || (k.as_str(), v.as_str()) == VIRTUAL_NODE_LABEL);
        spec.node_selector = (!kept.is_empty()).then_some(kept);
        stash.node_selector = (!moved.is_empty()).then_some(moved);
    }

    let required = spec
        .affinity
        .as_mut()
        .and_then(|a| a.node_affinity.as_mut())
        .and_then(|n| n.required_during_scheduling_ignored_during_execution.take());
    if let Some(required) = required {
        let (kept, moved) = split_required(required, keep);
        if let Some(node_affinity) = spec
            .affinity
            .as_mut()
            .and_then(|a| a.node_affinity.as_mut())
        {
            node_affinity.required_during_scheduling_ignored_during_execution = kept;
        }
        stash.affinity = moved.map(|required| Affinity {
            node_affinity: Some(NodeAffinity {
                required_during_scheduling_ignored_during_execution: Some(required),
                ..NodeAffinity::default()
            }),
            ..Affinity::default()
        });
    }

    stash.tolerations = spec.tolerations.clone().filter(|t| !t.is_empty());
    normalise(spec);
    stash
}

/// Splits required node affinity into the part on `keep` keys and the rest.
fn split_required(
    required: NodeSelector,
    keep: &BTreeSet<String>,
) -> (Option<NodeSelector>, Option<NodeSelector>) {
    // An empty term matches no node, so it adds no alternative: leave it out of the split.
    // If every term is empty the pod fits nowhere, and stays so below.
    let terms: Vec<&NodeSelectorTerm> = required
        .node_selector_terms
        .iter()
        .filter(|t| !term_is_empty(t))
        .collect();
    if terms.is_empty() {
        return (None, Some(required));
    }
    let side = |kept: bool| -> Option<NodeSelector> {
        let pick = |reqs: &Option<Vec<NodeSelectorRequirement>>| {
            let picked: Vec<_> = reqs
                .iter()
                .flatten()
                .filter(|r| (keep.contains(&r.key) || selects_virtual_node(r)) == kept)
                .cloned()
                .collect();
            (!picked.is_empty()).then_some(picked)
        };
        let parts: Vec<NodeSelectorTerm> = terms
            .iter()
            .map(|t| NodeSelectorTerm {
                match_expressions: pick(&t.match_expressions),
                match_fields: pick(&t.match_fields),
            })
            .collect();
        // An alternative with no constraint on this side leaves the side unconstrained.
        (!parts.iter().any(term_is_empty)).then_some(NodeSelector {
            node_selector_terms: parts,
        })
    };
    (side(true), side(false))
}

/// A required `type In [virtual-kubelet]`: the virtual node itself ([`VIRTUAL_NODE_LABEL`]).
fn selects_virtual_node(requirement: &NodeSelectorRequirement) -> bool {
    let (key, value) = VIRTUAL_NODE_LABEL;
    requirement.key == key
        && requirement.operator == "In"
        && requirement
            .values
            .as_deref()
            .is_some_and(|values| values.len() == 1 && values[0] == value)
}

fn term_is_empty(term: &NodeSelectorTerm) -> bool {
    term.match_expressions.as_ref().is_none_or(Vec::is_empty)
        && term.match_fields.as_ref().is_none_or(Vec::is_empty)
}

/// Gives a pod back the constraints stashed in `clusterSelector`, as tensile-kube's
/// `recoverSelectors` does. What the spec still holds was written for the upper cluster's
/// nodes (the virtual node), so without a stash the node constraints are dropped; pod
/// (anti-)affinity and preferred node affinity are soft or cluster-neutral and stay.
pub fn restore_constraints(spec: &mut PodSpec, stash: Option<&ClusterSelector>) {
    match stash {
        Some(stash) => {
            spec.node_selector = stash.node_selector.clone();
            spec.tolerations = stash.tolerations.clone();
            let stashed_node_affinity = stash
                .affinity
                .as_ref()
                .and_then(|a| a.node_affinity.as_ref());
            match (spec.affinity.as_mut(), stashed_node_affinity) {
                (None, _) => spec.affinity = stash.affinity.clone(),
                (Some(affinity), Some(stashed)) => match affinity.node_affinity.as_mut() {
                    Some(node_affinity) => {
                        node_affinity.required_during_scheduling_ignored_during_execution = stashed
                            .required_during_scheduling_ignored_during_execution
                            .clone();
                    }
                    None => affinity.node_affinity = Some(stashed.clone()),
                },
                // Required terms were written for upper nodes; preferred ones are soft and
                // stay, as they do without a stash.
                (Some(affinity), None) => {
                    if let Some(node_affinity) = affinity.node_affinity.as_mut() {
                        node_affinity.required_during_scheduling_ignored_during_execution = None;
                    }
                }
            }
        }
        None => {
            spec.node_selector = None;
            spec.tolerations = None;
            if let Some(node_affinity) = spec
                .affinity
                .as_mut()
                .and_then(|a| a.node_affinity.as_mut())
            {
                node_affinity.required_during_scheduling_ignored_during_execution = None;
            }
        }
    }
    normalise(spec);
}

/// Empty constraints become absent ones, so a spec compares equal to what the API server
/// returns for it.
fn normalise(spec: &mut PodSpec) {
    if spec.node_selector.as_ref().is_some_and(BTreeMap::is_empty) {
        spec.node_selector = None;
    }
    if spec.tolerations.as_ref().is_some_and(Vec::is_empty) {
        spec.tolerations = None;
    }
    if let Some(affinity) = spec.affinity.as_mut() {
        if affinity.node_affinity.as_ref().is_some_and(|n| {
            n.required_during_scheduling_ignored_during_execution
                .is_none()
                && n.preferred_during_scheduling_ignored_during_execution
                    .is_none()
        }) {
            affinity.node_affinity = None;
        }
        if affinity.node_affinity.is_none()
            && affinity.pod_affinity.is_none()
            && affinity.pod_anti_affinity.is_none()
        {
            spec.affinity = None;
        }
    }
}

/// Adds `kubernetes.io/hostname NotIn [nodes]` to every alternative of the required node
/// affinity (merging into an existing such requirement), so the pod avoids `nodes`
/// whichever alternative it matches. tensile-kube added it only to alternatives that
/// already had one. The webhook (descheduler memory) and the descheduler (bare pods) both
/// keep pods off nodes with it.
pub fn avoid_nodes(spec: &mut PodSpec, nodes: &[String]) {
    let requirement = || NodeSelectorRequirement {
        key: HOSTNAME_LABEL.to_owned(),
        operator: "NotIn".to_owned(),
        values: Some(nodes.to_vec()),
    };
    for term in required_terms(spec) {
        let expressions = term.match_expressions.get_or_insert_with(Vec::new);
        match expressions
            .iter_mut()
            .find(|e| e.key == HOSTNAME_LABEL && e.operator == "NotIn")
        {
            Some(existing) => {
                let values = existing.values.get_or_insert_with(Vec::new);
                for node in nodes {
                    if !values.contains(node) {
                        values.push(node.clone());
                    }
                }
            }
            None => expressions.push(requirement()),
        }
    }
}

/// Where a [`Confinement`]'s requirement goes in a node selector term.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// `matchFields`.
    Field,
    /// `matchExpressions`.
    Expression,
}

/// A requirement that keeps a pod's lower copy within a group of lower nodes (one virtual
/// node of a member of `node` or `label=<key>` granularity, `crate::node::groups`).
#[derive(Clone, Debug, PartialEq)]
pub struct Confinement {
    /// Field or expression.
    pub placement: Placement,
    /// `metadata.name In [node]`, or `<key> In [value]`.
    pub requirement: NodeSelectorRequirement,
}

impl Confinement {
    /// Adds the requirement to every alternative of the pod's required node affinity (what
    /// `clusterSelector` restored), or as its one alternative when it has none: the lower
    /// scheduler then places the pod within the group, whichever alternative it matches,
    /// and still by the lower taints. Applying it twice changes nothing.
    pub fn apply(&self, spec: &mut PodSpec) {
        for term in required_terms(spec) {
            let list = match self.placement {
                Placement::Field => term.match_fields.get_or_insert_with(Vec::new),
                Placement::Expression => term.match_expressions.get_or_insert_with(Vec::new),
            };
            if !list.contains(&self.requirement) {
                list.push(self.requirement.clone());
            }
        }
    }
}

/// The terms of the pod's required node affinity, made (with one empty term) when it has
/// none: a requirement ANDed into each of them holds whichever term the scheduler takes.
fn required_terms(spec: &mut PodSpec) -> &mut Vec<NodeSelectorTerm> {
    let required = spec
        .affinity
        .get_or_insert_with(Affinity::default)
        .node_affinity
        .get_or_insert_with(NodeAffinity::default)
        .required_during_scheduling_ignored_during_execution
        .get_or_insert_with(|| NodeSelector {
            node_selector_terms: Vec::new(),
        });
    if required.node_selector_terms.is_empty() {
        required
            .node_selector_terms
            .push(NodeSelectorTerm::default());
    }
    &mut required.node_selector_terms
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(value: serde_json::Value) -> PodSpec {
        serde_json::from_value(value).unwrap()
    }

    fn stash(value: serde_json::Value) -> ClusterSelector {
        serde_json::from_value(value).unwrap()
    }

    fn required(key: &str) -> serde_json::Value {
        json!({"nodeSelectorTerms": [{"matchExpressions": [
            {"key": key, "operator": "In", "values": ["aa"]}
        ]}]})
    }

    fn preferred(key: &str) -> serde_json::Value {
        json!([{"weight": 1, "preference": {"matchExpressions": [
            {"key": key, "operator": "Exists"}
        ]}}])
    }

    fn anti_affinity() -> serde_json::Value {
        json!({"requiredDuringSchedulingIgnoredDuringExecution": [
            {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "web"}}}
        ]})
    }

    fn annotations(value: &str) -> BTreeMap<String, String> {
        BTreeMap::from([(CLUSTER_SELECTOR_ANNOTATION.to_owned(), value.to_owned())])
    }

    #[test]
    fn parses_the_annotation() {
        type Case = (
            &'static str,
            Option<BTreeMap<String, String>>,
            Option<ClusterSelector>,
        );
        let cases: Vec<Case> = vec![
            ("no annotations", None, None),
            ("other annotations", Some(BTreeMap::from([("a".into(), "b".into())])), None),
            ("empty value", Some(annotations("")), None),
            (
                "node selector only (tensile-kube's test value)",
                Some(annotations(r#"{"nodeSelector":{"test": "test"}}"#)),
                Some(ClusterSelector {
                    node_selector: Some(BTreeMap::from([("test".into(), "test".into())])),
                    ..ClusterSelector::default()
                }),
            ),
            (
                "explicit nulls",
                Some(annotations(r#"{"nodeSelector":null,"affinity":null,"tolerations":null}"#)),
                Some(ClusterSelector::default()),
            ),
            (
                "all three",
                Some(annotations(
                    &json!({
                        "nodeSelector": {"zone": "a"},
                        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required("disk")}},
                        "tolerations": [{"key": "gpu", "operator": "Exists"}],
                    })
                    .to_string(),
                )),
                Some(stash(json!({
                    "nodeSelector": {"zone": "a"},
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required("disk")}},
                    "tolerations": [{"key": "gpu", "operator": "Exists"}],
                }))),
            ),
        ];
        for (name, annotations, want) in cases {
            let got = parse_cluster_selector(annotations.as_ref()).unwrap();
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn malformed_annotation_is_an_error_naming_it() {
        for bad in [
            "{",
            r#""zone""#,
            r#"{"nodeSelector":"zone"}"#,
            r#"{"tolerations":{}}"#,
        ] {
            let err = parse_cluster_selector(Some(&annotations(bad))).unwrap_err();
            assert!(
                err.to_string().contains(CLUSTER_SELECTOR_ANNOTATION),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn serialises_in_tensile_kube_shape() {
        let value = serde_json::to_value(ClusterSelector {
            node_selector: Some(BTreeMap::from([("zone".into(), "a".into())])),
            affinity: None,
            tolerations: Some(vec![]),
        })
        .unwrap();
        assert_eq!(
            value,
            json!({"nodeSelector": {"zone": "a"}, "tolerations": []})
        );
        let round: ClusterSelector = serde_json::from_value(value.clone()).unwrap();
        assert_eq!(serde_json::to_value(round).unwrap(), value);
    }

    #[test]
    fn restores_constraints_like_recover_selectors() {
        let toleration = json!([{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]);
        let virtual_toleration =
            json!([{"key": "virtual-kubelet.io/provider", "operator": "Exists"}]);
        // (case, pod spec, stash, expected spec)
        let cases: Vec<(
            &str,
            serde_json::Value,
            Option<serde_json::Value>,
            serde_json::Value,
        )> = vec![
            (
                "no stash, nothing to clear",
                json!({"containers": []}),
                None,
                json!({"containers": []}),
            ),
            (
                "no stash: node selector and tolerations cleared",
                json!({"containers": [], "nodeSelector": {"testbase": "testbase"}, "tolerations": virtual_toleration}),
                None,
                json!({"containers": []}),
            ),
            (
                "no stash: required node affinity cleared, whole affinity goes when empty",
                json!({"containers": [], "nodeSelector": {"testbase": "testbase"},
                       "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required("testbase")}}}),
                None,
                json!({"containers": []}),
            ),
            (
                "no stash: preferred node affinity and pod anti-affinity stay",
                json!({"containers": [], "affinity": {
                    "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required("x"),
                                     "preferredDuringSchedulingIgnoredDuringExecution": preferred("ssd")},
                    "podAntiAffinity": anti_affinity()}}),
                None,
                json!({"containers": [], "affinity": {
                    "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred("ssd")},
                    "podAntiAffinity": anti_affinity()}}),
            ),
            (
                "stash node selector replaces the spec's",
                json!({"containers": [], "nodeSelector": {"type": "virtual-kubelet"}}),
                Some(json!({"nodeSelector": {"test": "test"}})),
                json!({"containers": [], "nodeSelector": {"test": "test"}}),
            ),
            (
                "stash tolerations replace the spec's",
                json!({"containers": [], "tolerations": virtual_toleration}),
                Some(json!({"tolerations": toleration})),
                json!({"containers": [], "tolerations": toleration}),
            ),
            (
                "spec without affinity takes the stash's",
                json!({"containers": []}),
                Some(
                    json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required("disk")}}}),
                ),
                json!({"containers": [], "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required("disk")}}}),
            ),
            (
                "stash required replaces only the spec's required, preferred stays",
                json!({"containers": [], "affinity": {"nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": required("virtual"),
                    "preferredDuringSchedulingIgnoredDuringExecution": preferred("ssd")}}}),
                Some(
                    json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required("disk")}}}),
                ),
                json!({"containers": [], "affinity": {"nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": required("disk"),
                    "preferredDuringSchedulingIgnoredDuringExecution": preferred("ssd")}}}),
            ),
            (
                "spec with only pod anti-affinity gains the stash's node affinity",
                json!({"containers": [], "affinity": {"podAntiAffinity": anti_affinity()}}),
                Some(
                    json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required("disk")}}}),
                ),
                json!({"containers": [], "affinity": {"podAntiAffinity": anti_affinity(),
                       "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required("disk")}}}),
            ),
            (
                "stash without node affinity drops the spec's, pod anti-affinity stays",
                json!({"containers": [], "affinity": {"podAntiAffinity": anti_affinity(),
                       "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required("virtual")}}}),
                Some(json!({"nodeSelector": {"zone": "a"}})),
                json!({"containers": [], "nodeSelector": {"zone": "a"}, "affinity": {"podAntiAffinity": anti_affinity()}}),
            ),
            (
                "stash without node affinity on a node-affinity-only spec leaves no affinity",
                json!({"containers": [], "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required("virtual")}}}),
                Some(json!({})),
                json!({"containers": []}),
            ),
            (
                "empty stashed selector and tolerations become absent",
                json!({"containers": [], "nodeSelector": {"a": "b"}}),
                Some(json!({"nodeSelector": {}, "tolerations": []})),
                json!({"containers": []}),
            ),
            (
                "empty stashed affinity becomes absent",
                json!({"containers": []}),
                Some(json!({"affinity": {}})),
                json!({"containers": []}),
            ),
        ];
        for (name, input, stashed, want) in cases {
            let mut got = spec(input);
            let stashed = stashed.map(stash);
            restore_constraints(&mut got, stashed.as_ref());
            assert_eq!(got, spec(want), "{name}");
        }
    }

    fn keys(keys: &[&str]) -> BTreeSet<String> {
        keys.iter().map(|k| (*k).to_owned()).collect()
    }

    fn term(exprs: &[&str]) -> serde_json::Value {
        let exprs: Vec<_> = exprs
            .iter()
            .map(|k| json!({"key": k, "operator": "In", "values": ["aa"]}))
            .collect();
        json!({"matchExpressions": exprs})
    }

    fn required_terms(terms: Vec<serde_json::Value>) -> serde_json::Value {
        json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}})
    }

    fn with(base: serde_json::Value, more: serde_json::Value) -> serde_json::Value {
        let (serde_json::Value::Object(mut base), serde_json::Value::Object(more)) = (base, more)
        else {
            panic!("objects expected")
        };
        base.extend(more);
        serde_json::Value::Object(base)
    }

    /// tensile-kube's `TestInject` table (pkg/webhook/hook_test.go), as behaviour: what is
    /// stashed, and what the upper spec keeps.
    #[test]
    fn stashes_like_tensile_kube_inject() {
        let four = || term(&["test0", "clusterID", "test", "test1"]);
        // (case, spec, keep keys, expected stash, expected upper spec)
        type Case = (
            &'static str,
            serde_json::Value,
            &'static [&'static str],
            serde_json::Value,
            serde_json::Value,
        );
        let cases: Vec<Case> = vec![
            (
                "node selector",
                json!({"containers": [], "nodeSelector": {"testbase": "testbase"}}),
                &[],
                json!({"nodeSelector": {"testbase": "testbase"}}),
                json!({"containers": []}),
            ),
            (
                "node selector with clusterID kept",
                json!({"containers": [], "nodeSelector": {"testbase": "testbase", "clusterID": "1"}}),
                &["clusterID"],
                json!({"nodeSelector": {"testbase": "testbase"}}),
                json!({"containers": [], "nodeSelector": {"clusterID": "1"}}),
            ),
            (
                "node selector and affinity with clusterID kept",
                with(
                    json!({"containers": [], "nodeSelector": {"testbase": "testbase", "clusterID": "1"}}),
                    required_terms(vec![four()]),
                ),
                &["clusterID"],
                with(
                    json!({"nodeSelector": {"testbase": "testbase"}}),
                    required_terms(vec![term(&["test0", "test", "test1"])]),
                ),
                with(
                    json!({"containers": [], "nodeSelector": {"clusterID": "1"}}),
                    required_terms(vec![term(&["clusterID"])]),
                ),
            ),
            (
                "node selector and affinity, no keys kept",
                with(
                    json!({"containers": [], "nodeSelector": {"testbase": "testbase", "clusterID": "1"}}),
                    required_terms(vec![four()]),
                ),
                &[],
                with(
                    json!({"nodeSelector": {"testbase": "testbase", "clusterID": "1"}}),
                    required_terms(vec![four()]),
                ),
                json!({"containers": []}),
            ),
            (
                "node selector and affinity, several keys kept",
                with(
                    json!({"containers": [], "nodeSelector": {"testbase": "testbase", "clusterID": "1"}}),
                    required_terms(vec![four()]),
                ),
                &["clusterID", "test0"],
                with(
                    json!({"nodeSelector": {"testbase": "testbase"}}),
                    required_terms(vec![term(&["test", "test1"])]),
                ),
                with(
                    json!({"containers": [], "nodeSelector": {"clusterID": "1"}}),
                    required_terms(vec![term(&["test0", "clusterID"])]),
                ),
            ),
            (
                "affinity",
                with(
                    json!({"containers": [], "nodeSelector": {"testbase": "testbase"}}),
                    required_terms(vec![term(&["testbase"])]),
                ),
                &[],
                with(
                    json!({"nodeSelector": {"testbase": "testbase"}}),
                    required_terms(vec![term(&["testbase"])]),
                ),
                json!({"containers": []}),
            ),
            (
                "what selects the virtual node itself stays (Kueue's flavor), another type moves",
                json!({"containers": [], "nodeSelector": {"type": "virtual-kubelet", "disk": "ssd"}}),
                &[],
                json!({"nodeSelector": {"disk": "ssd"}}),
                json!({"containers": [], "nodeSelector": {"type": "virtual-kubelet"}}),
            ),
            (
                "a selector on another type moves",
                json!({"containers": [], "nodeSelector": {"type": "kwok"}}),
                &[],
                json!({"nodeSelector": {"type": "kwok"}}),
                json!({"containers": []}),
            ),
        ];
        for (name, input, keep, want_stash, want_spec) in cases {
            let mut got = spec(input);
            let stashed = stash_constraints(&mut got, &keys(keep));
            assert_eq!(stashed, stash(want_stash), "{name}: stash");
            assert_eq!(got, spec(want_spec), "{name}: upper spec");
        }
    }

    #[test]
    fn stash_splits_required_affinity_by_term() {
        let mixed_fields = json!({
            "matchExpressions": [
                {"key": "clusterID", "operator": "In", "values": ["c1"]},
                {"key": "zone", "operator": "In", "values": ["z"]},
            ],
            "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["lower-1"]}],
        });
        type Case = (
            &'static str,
            serde_json::Value,
            &'static [&'static str],
            serde_json::Value,
            serde_json::Value,
        );
        let cases: Vec<Case> = vec![
            (
                // tensile-kube indexes matchFields with the matchExpressions count and
                // panics or removes the wrong entry here.
                "matchFields move with their term, kept expressions stay",
                with(
                    json!({"containers": []}),
                    required_terms(vec![mixed_fields]),
                ),
                &["clusterID"],
                required_terms(vec![json!({
                    "matchExpressions": [{"key": "zone", "operator": "In", "values": ["z"]}],
                    "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["lower-1"]}],
                })]),
                required_terms(vec![json!({
                    "matchExpressions": [{"key": "clusterID", "operator": "In", "values": ["c1"]}],
                })]),
            ),
            (
                "two alternatives split term by term",
                with(
                    json!({"containers": []}),
                    required_terms(vec![term(&["clusterID", "a"]), term(&["clusterID", "b"])]),
                ),
                &["clusterID"],
                required_terms(vec![term(&["a"]), term(&["b"])]),
                required_terms(vec![term(&["clusterID"]), term(&["clusterID"])]),
            ),
            (
                "an alternative with only kept keys leaves the lower side unconstrained",
                with(
                    json!({"containers": []}),
                    required_terms(vec![term(&["clusterID"]), term(&["clusterID", "b"])]),
                ),
                &["clusterID"],
                json!({}),
                required_terms(vec![term(&["clusterID"]), term(&["clusterID"])]),
            ),
            (
                "an alternative without kept keys leaves the upper side unconstrained",
                with(
                    json!({"containers": []}),
                    required_terms(vec![term(&["a"]), term(&["clusterID", "b"])]),
                ),
                &["clusterID"],
                required_terms(vec![term(&["a"]), term(&["b"])]),
                json!({"containers": []}),
            ),
            (
                "an empty term adds no alternative",
                with(
                    json!({"containers": []}),
                    required_terms(vec![json!({}), term(&["a"])]),
                ),
                &["clusterID"],
                required_terms(vec![term(&["a"])]),
                json!({"containers": []}),
            ),
            (
                "preferred node affinity and pod anti-affinity stay; tolerations are copied",
                json!({"containers": [], "tolerations": [{"key": "gpu", "operator": "Exists"}],
                       "affinity": {"podAntiAffinity": anti_affinity(), "nodeAffinity": {
                           "requiredDuringSchedulingIgnoredDuringExecution": required("disk"),
                           "preferredDuringSchedulingIgnoredDuringExecution": preferred("ssd")}}}),
                &["clusterID"],
                json!({"tolerations": [{"key": "gpu", "operator": "Exists"}],
                       "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required("disk")}}}),
                json!({"containers": [], "tolerations": [{"key": "gpu", "operator": "Exists"}],
                       "affinity": {"podAntiAffinity": anti_affinity(), "nodeAffinity": {
                           "preferredDuringSchedulingIgnoredDuringExecution": preferred("ssd")}}}),
            ),
            (
                "nothing to stash",
                json!({"containers": [], "nodeSelector": {}, "tolerations": []}),
                &["clusterID"],
                json!({}),
                json!({"containers": []}),
            ),
        ];
        for (name, input, keep, want_stash, want_spec) in cases {
            let mut got = spec(input);
            let stashed = stash_constraints(&mut got, &keys(keep));
            assert_eq!(stashed, stash(want_stash), "{name}: stash");
            assert_eq!(got, spec(want_spec), "{name}: upper spec");
        }
    }

    /// stash → annotation → parse → restore gives the lower pod the original constraints,
    /// less the kept keys (which only mean something in the upper cluster).
    #[test]
    fn stash_round_trips_through_the_annotation_and_restore() {
        let upper_tolerations = json!([
            {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
            {"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"},
        ]);
        let tolerations = json!([{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]);
        // (original spec, keep keys, what the lower pod must end up with)
        let cases: Vec<(serde_json::Value, &[&str], serde_json::Value)> = vec![
            (
                json!({"containers": []}),
                &["clusterID"],
                json!({"containers": []}),
            ),
            (
                json!({"containers": [], "nodeSelector": {"disktype": "ssd", "clusterID": "vk"},
                       "tolerations": tolerations}),
                &["clusterID"],
                json!({"containers": [], "nodeSelector": {"disktype": "ssd"}, "tolerations": tolerations}),
            ),
            (
                with(
                    json!({"containers": [], "nodeSelector": {"a": "b"}}),
                    required_terms(vec![term(&["clusterID", "x"]), term(&["y"])]),
                ),
                &["clusterID"],
                with(
                    json!({"containers": [], "nodeSelector": {"a": "b"}}),
                    required_terms(vec![term(&["x"]), term(&["y"])]),
                ),
            ),
            (
                with(
                    json!({"containers": []}),
                    required_terms(vec![term(&["clusterID"])]),
                ),
                &["clusterID"],
                json!({"containers": []}),
            ),
            (
                json!({"containers": [], "affinity": {"podAntiAffinity": anti_affinity(), "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": required("disk"),
                    "preferredDuringSchedulingIgnoredDuringExecution": preferred("ssd")}}}),
                &[],
                json!({"containers": [], "affinity": {"podAntiAffinity": anti_affinity(), "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": required("disk"),
                    "preferredDuringSchedulingIgnoredDuringExecution": preferred("ssd")}}}),
            ),
        ];
        for (original, keep, want) in cases {
            let mut pod = spec(original.clone());
            let stashed = stash_constraints(&mut pod, &keys(keep));
            // What the webhook does to the upper tolerations must not matter below.
            pod.tolerations = serde_json::from_value(upper_tolerations.clone()).unwrap();
            let annotation = serde_json::to_string(&stashed).unwrap();
            let parsed = parse_cluster_selector(Some(&annotations(&annotation))).unwrap();
            restore_constraints(&mut pod, parsed.as_ref());
            assert_eq!(pod, spec(want), "{original}");
        }
    }

    #[test]
    fn a_stash_without_affinity_keeps_preferred_node_affinity() {
        let mut spec: PodSpec = serde_json::from_value(serde_json::json!({
            "containers": [],
            "affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "type", "operator": "In", "values": ["virtual-kubelet"]}]}]},
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 1, "preference": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}}],
            }},
        }))
        .unwrap();
        let stash = ClusterSelector {
            node_selector: Some([("disktype".to_owned(), "ssd".to_owned())].into()),
            ..ClusterSelector::default()
        };
        restore_constraints(&mut spec, Some(&stash));
        let node_affinity = spec.affinity.unwrap().node_affinity.unwrap();
        assert!(
            node_affinity
                .required_during_scheduling_ignored_during_execution
                .is_none()
        );
        assert_eq!(
            node_affinity
                .preferred_during_scheduling_ignored_during_execution
                .unwrap()
                .len(),
            1
        );
        assert_eq!(spec.node_selector.unwrap()["disktype"], "ssd");
    }
}
