//! The `clusterSelector` stash: the scheduling constraints the webhook takes off a pod so
//! the upper scheduler can place it on a virtual node, and gives back below.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, PodSpec, Toleration};
use serde::{Deserialize, Serialize};

use super::TranslateError;
use super::meta::CLUSTER_SELECTOR_ANNOTATION;

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
                (Some(affinity), None) => affinity.node_affinity = None,
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
}
