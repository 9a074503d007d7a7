//! PersistentVolumeClaims and PersistentVolumes on the way up: the lower cluster binds or
//! provisions a mirrored claim; the volume it binds is reflected into the upper cluster,
//! pinned to the virtual node and pre-bound to the upper claim, so that the upper
//! cluster's own PV controller binds the upper claim to it.

use k8s_openapi::api::core::v1::{
    NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, ObjectReference, PersistentVolume,
    PersistentVolumeClaim, PersistentVolumeSpec, Pod, VolumeNodeAffinity,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{Value, json};

use super::meta::{LOWER_UID_ANNOTATION, OWNER_NODE_LABEL, SELECTED_NODE_ANNOTATION};
use super::{TranslateError, object_ref};

/// The node label a volume's node affinity names hosts by.
pub const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";
/// Prefix of the PV controller's own annotations (`pv.kubernetes.io/provisioned-by`, …):
/// they describe the lower cluster's binding and are not carried up.
const PV_CONTROLLER_ANNOTATION_PREFIX: &str = "pv.kubernetes.io/";

/// The name of the lower volume a lower claim is bound to, once it is Bound.
pub fn bound_volume(claim: &PersistentVolumeClaim) -> Option<&str> {
    let bound = claim
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|phase| phase == "Bound");
    claim
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .filter(|name| bound && !name.is_empty())
}

/// The upper reflection of `lower`, the lower volume bound to the lower copy of `claim`:
/// same name, source, capacity, access modes and volume mode; node affinity replaced by
/// the virtual node's hostname (the volume is reachable only through it, whatever lower
/// node holds it); pre-bound to `claim` with the claim's storage and volume-attributes
/// classes, so the upper PV controller binds them; reclaim policy Retain (tensile, not
/// the upper cluster, ends the reflection when the lower volume goes). Marked with the
/// owner label and the lower volume's UID.
pub fn upper_pv(
    lower: &PersistentVolume,
    claim: &PersistentVolumeClaim,
    node_name: &str,
) -> Result<PersistentVolume, TranslateError> {
    let missing = |kind, object: String, field| TranslateError::MissingField {
        kind,
        object,
        field,
    };
    let name = lower.metadata.name.clone().ok_or_else(|| {
        missing(
            "PersistentVolume",
            object_ref(&lower.metadata),
            "metadata.name",
        )
    })?;
    let lower_uid = lower.metadata.uid.clone().ok_or_else(|| {
        missing(
            "PersistentVolume",
            object_ref(&lower.metadata),
            "metadata.uid",
        )
    })?;
    let claim_missing =
        |field| missing("PersistentVolumeClaim", object_ref(&claim.metadata), field);
    let claim_ref = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("PersistentVolumeClaim".into()),
        namespace: Some(
            claim
                .metadata
                .namespace
                .clone()
                .ok_or_else(|| claim_missing("metadata.namespace"))?,
        ),
        name: Some(
            claim
                .metadata
                .name
                .clone()
                .ok_or_else(|| claim_missing("metadata.name"))?,
        ),
        uid: Some(
            claim
                .metadata
                .uid
                .clone()
                .ok_or_else(|| claim_missing("metadata.uid"))?,
        ),
        ..ObjectReference::default()
    };

    let mut labels = lower.metadata.labels.clone().unwrap_or_default();
    labels.insert(OWNER_NODE_LABEL.to_owned(), node_name.to_owned());
    let mut annotations = lower.metadata.annotations.clone().unwrap_or_default();
    annotations.retain(|key, _| !key.starts_with(PV_CONTROLLER_ANNOTATION_PREFIX));
    annotations.insert(LOWER_UID_ANNOTATION.to_owned(), lower_uid);

    let claim_spec = claim.spec.clone().unwrap_or_default();
    let spec = lower.spec.clone().unwrap_or_default();
    Ok(PersistentVolume {
        metadata: ObjectMeta {
            name: Some(name),
            labels: Some(labels),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        spec: Some(PersistentVolumeSpec {
            claim_ref: Some(claim_ref),
            node_affinity: Some(pinned_to(node_name)),
            persistent_volume_reclaim_policy: Some("Retain".into()),
            storage_class_name: claim_spec.storage_class_name,
            volume_attributes_class_name: claim_spec.volume_attributes_class_name,
            ..spec
        }),
        status: None,
    })
}

/// Required node affinity to one host.
fn pinned_to(node_name: &str) -> VolumeNodeAffinity {
    VolumeNodeAffinity {
        required: Some(NodeSelector {
            node_selector_terms: vec![NodeSelectorTerm {
                match_expressions: Some(vec![NodeSelectorRequirement {
                    key: HOSTNAME_LABEL.into(),
                    operator: "In".into(),
                    values: Some(vec![node_name.to_owned()]),
                }]),
                match_fields: None,
            }],
        }),
    }
}

/// The label selector of the upper PersistentVolumes reflected by the virtual node `node`
/// (they live in the upper cluster, so its node mark alone tells).
pub fn reflections_selector(node: &str) -> String {
    format!("{OWNER_NODE_LABEL}={node}")
}

/// Whether an upper PersistentVolume is a reflection made by the virtual node `node` (it
/// lives in the upper cluster, so its node mark alone tells).
pub fn is_reflected_by(meta: &ObjectMeta, node: &str) -> bool {
    meta.labels
        .as_ref()
        .and_then(|l| l.get(OWNER_NODE_LABEL))
        .is_some_and(|owner| owner == node)
}

/// The lower volume's UID an upper reflection was made from.
pub fn reflected_from(pv: &PersistentVolume) -> Option<&str> {
    pv.metadata
        .annotations
        .as_ref()?
        .get(LOWER_UID_ANNOTATION)
        .map(String::as_str)
}

/// A merge patch that brings the upper reflection `current` to `desired` ([`upper_pv`])
/// on what can change in place (labels and annotations tensile sets, capacity, the claim
/// it is bound to, the reclaim policy); `None` when it already agrees. Keys others add
/// (the upper PV controller's annotations) are left alone.
pub fn pv_patch(desired: &PersistentVolume, current: &PersistentVolume) -> Option<Value> {
    let subset = |want: &Option<std::collections::BTreeMap<String, String>>,
                  have: &Option<std::collections::BTreeMap<String, String>>| {
        want.iter()
            .flatten()
            .all(|(k, v)| have.as_ref().and_then(|h| h.get(k)) == Some(v))
    };
    let (want, have) = (
        desired.spec.clone().unwrap_or_default(),
        current.spec.clone().unwrap_or_default(),
    );
    let claim = |r: &Option<ObjectReference>| {
        r.as_ref()
            .map(|r| (r.namespace.clone(), r.name.clone(), r.uid.clone()))
    };
    let agrees = subset(&desired.metadata.labels, &current.metadata.labels)
        && subset(&desired.metadata.annotations, &current.metadata.annotations)
        && want.capacity == have.capacity
        && claim(&want.claim_ref) == claim(&have.claim_ref)
        && want.persistent_volume_reclaim_policy == have.persistent_volume_reclaim_policy;
    (!agrees).then(|| {
        json!({
            "metadata": {
                "labels": desired.metadata.labels,
                "annotations": desired.metadata.annotations,
            },
            "spec": {
                "capacity": want.capacity,
                "claimRef": want.claim_ref,
                "persistentVolumeReclaimPolicy": want.persistent_volume_reclaim_policy,
            },
        })
    })
}

/// A merge patch setting `volume.kubernetes.io/selected-node` on the upper claim to the
/// virtual node when the lower scheduler has selected a node for the lower copy.
pub fn selected_node_patch(
    upper: &PersistentVolumeClaim,
    lower: &PersistentVolumeClaim,
    node_name: &str,
) -> Option<Value> {
    let selected = |claim: &PersistentVolumeClaim| {
        claim
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(SELECTED_NODE_ANNOTATION))
            .cloned()
    };
    let selected_below = selected(lower).is_some_and(|node| !node.is_empty());
    (selected_below && selected(upper).as_deref() != Some(node_name))
        .then(|| json!({"metadata": {"annotations": {SELECTED_NODE_ANNOTATION: node_name}}}))
}

/// Why the virtual node `node` must not reflect anything onto the upper claim
/// `namespace/name` (`None`: it may). A lower claim's marks (owner labels, upper UID) are
/// anyone's to copy who may create claims below, so they prove nothing: `node` acts only on
/// an upper claim within `scope` (`--namespace`; empty: all) that an upper pod bound to
/// `node` references through a `persistentVolumeClaim` volume: the very pods, and the
/// very references, it copies claims down for (`deps::pod_dependencies`; an ephemeral
/// volume's claim is made below, not copied).
/// `pods`: upper pods (any node, any namespace; the others do not count).
pub fn refused_claim<'a>(
    namespace: &str,
    name: &str,
    pods: impl IntoIterator<Item = &'a Pod>,
    node: &str,
    scope: &str,
) -> Option<String> {
    if !scope.is_empty() && namespace != scope {
        return Some(format!("is outside --namespace {scope}"));
    }
    let uses = |pod: &Pod| {
        pod.metadata.namespace.as_deref() == Some(namespace)
            && pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
            && pod
                .spec
                .iter()
                .flat_map(|s| s.volumes.iter().flatten())
                .filter_map(|v| v.persistent_volume_claim.as_ref())
                .any(|claim| claim.claim_name == name)
    };
    (!pods.into_iter().any(uses)).then(|| format!("is used by no pod bound to node {node}"))
}

/// The storage class a pending lower claim asks for that the lower cluster lacks.
pub fn missing_storage_class(
    claim: &PersistentVolumeClaim,
    class_exists: impl Fn(&str) -> bool,
) -> Option<String> {
    let pending = claim
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_none_or(|phase| phase == "Pending");
    let class = claim
        .spec
        .as_ref()?
        .storage_class_name
        .as_deref()
        .filter(|c| !c.is_empty())?;
    (pending && !class_exists(class)).then(|| class.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::de::DeserializeOwned;

    const NODE: &str = "vk";

    fn from<T: DeserializeOwned>(value: Value) -> T {
        serde_json::from_value(value).unwrap()
    }

    fn lower_pv() -> PersistentVolume {
        from(json!({
            "metadata": {"name": "vk-demo", "uid": "lower-pv-uid", "resourceVersion": "12",
                         "labels": {"tier": "local"},
                         "annotations": {"pv.kubernetes.io/bound-by-controller": "yes", "note": "x"},
                         "finalizers": ["kubernetes.io/pv-protection"]},
            "spec": {
                "capacity": {"storage": "100Gi"},
                "volumeMode": "Filesystem",
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Delete",
                "storageClassName": "",
                "local": {"path": "/tmp/example"},
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": ["lower-node-0"]},
                    {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1"]},
                ]}]}},
                "claimRef": {"kind": "PersistentVolumeClaim", "namespace": "ns", "name": "vk-demo",
                             "uid": "lower-pvc-uid", "resourceVersion": "11"},
            },
            "status": {"phase": "Bound"},
        }))
    }

    fn upper_claim(annotations: Value, volume: Option<&str>) -> PersistentVolumeClaim {
        from(json!({
            "metadata": {"name": "vk-demo", "namespace": "ns", "uid": "upper-pvc-uid",
                         "annotations": annotations},
            "spec": {"storageClassName": "", "accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": "50Mi"}}, "volumeName": volume},
        }))
    }

    #[test]
    fn reflects_the_bound_volume_up() {
        let got = upper_pv(&lower_pv(), &upper_claim(json!({}), None), NODE).unwrap();
        let want: PersistentVolume = from(json!({
            "metadata": {"name": "vk-demo",
                         "labels": {"tier": "local", OWNER_NODE_LABEL: NODE},
                         "annotations": {"note": "x", LOWER_UID_ANNOTATION: "lower-pv-uid"}},
            "spec": {
                "capacity": {"storage": "100Gi"},
                "volumeMode": "Filesystem",
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "local": {"path": "/tmp/example"},
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": [NODE]},
                ]}]}},
                "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": "ns",
                             "name": "vk-demo", "uid": "upper-pvc-uid"},
            },
        }));
        assert_eq!(got, want);
        assert_eq!(reflected_from(&got), Some("lower-pv-uid"));
    }

    #[test]
    fn a_volume_without_node_affinity_is_still_pinned_to_the_virtual_node() {
        let mut network = lower_pv();
        let spec = network.spec.as_mut().unwrap();
        spec.node_affinity = None;
        spec.local = None;
        spec.nfs = Some(from(json!({"server": "nfs.example", "path": "/export"})));
        let got = upper_pv(&network, &upper_claim(json!({}), None), NODE).unwrap();
        assert_eq!(got.spec.unwrap().node_affinity, Some(pinned_to(NODE)));
    }

    #[test]
    fn the_reflection_takes_the_upper_claims_classes() {
        let claim: PersistentVolumeClaim = from(json!({
            "metadata": {"name": "c", "namespace": "ns", "uid": "u"},
            "spec": {"storageClassName": "fast", "volumeAttributesClassName": "gold"},
        }));
        let spec = upper_pv(&lower_pv(), &claim, NODE).unwrap().spec.unwrap();
        assert_eq!(spec.storage_class_name.as_deref(), Some("fast"));
        assert_eq!(spec.volume_attributes_class_name.as_deref(), Some("gold"));
    }

    #[test]
    fn pv_patches() {
        let desired = upper_pv(&lower_pv(), &upper_claim(json!({}), None), NODE).unwrap();
        let mut current = desired.clone();
        current.metadata.resource_version = Some("3".into());
        current
            .metadata
            .annotations
            .get_or_insert_default()
            .insert("pv.kubernetes.io/bound-by-controller".into(), "yes".into());
        current
            .spec
            .as_mut()
            .unwrap()
            .claim_ref
            .as_mut()
            .unwrap()
            .resource_version = Some("77".into());
        assert_eq!(
            pv_patch(&desired, &current),
            None,
            "others' keys are no difference"
        );

        let mut grown = lower_pv();
        grown.spec.as_mut().unwrap().capacity =
            Some([("storage".into(), from(json!("200Gi")))].into());
        let desired = upper_pv(&grown, &upper_claim(json!({}), None), NODE).unwrap();
        let patch = pv_patch(&desired, &current).unwrap();
        assert_eq!(patch["spec"]["capacity"]["storage"], "200Gi");
        assert_eq!(patch["spec"]["claimRef"]["uid"], "upper-pvc-uid");
    }

    #[test]
    fn selected_node_is_rewritten_to_the_virtual_node() {
        let lower_selected = upper_claim(json!({SELECTED_NODE_ANNOTATION: "lower-node-1"}), None);
        let cases = [
            (
                "lower selected, upper not yet",
                upper_claim(json!({}), None),
                &lower_selected,
                true,
            ),
            (
                "upper names another node",
                upper_claim(json!({SELECTED_NODE_ANNOTATION: "lower-node-1"}), None),
                &lower_selected,
                true,
            ),
            (
                "already rewritten",
                upper_claim(json!({SELECTED_NODE_ANNOTATION: NODE}), None),
                &lower_selected,
                false,
            ),
        ];
        for (name, upper, lower, want) in cases {
            let patch = selected_node_patch(&upper, lower, NODE);
            assert_eq!(patch.is_some(), want, "{name}");
            if let Some(patch) = patch {
                assert_eq!(
                    patch["metadata"]["annotations"][SELECTED_NODE_ANNOTATION],
                    NODE
                );
            }
        }
        let not_selected = upper_claim(json!({}), None);
        assert_eq!(
            selected_node_patch(&not_selected, &not_selected, NODE),
            None
        );
    }

    #[test]
    fn only_claims_used_by_a_pod_of_this_node_are_reflected() {
        let pod = |namespace: &str, node: Option<&str>, claim: &str| -> Pod {
            from(json!({
                "metadata": {"name": "p", "namespace": namespace},
                "spec": {"nodeName": node, "containers": [{"name": "c"}],
                         "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": claim}}]},
            }))
        };
        let ephemeral: Pod = from(json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"nodeName": NODE, "containers": [{"name": "c"}],
                     "volumes": [{"name": "data", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}}]},
        }));
        let no_pod = "is used by no pod bound to node vk";
        // (case, upper pods, --namespace, refused because)
        let cases = [
            (
                "a pod of this node uses it",
                vec![pod("ns", Some(NODE), "data")],
                "",
                None,
            ),
            (
                "one of several pods",
                vec![
                    pod("ns", Some("worker-1"), "data"),
                    pod("ns", Some(NODE), "other"),
                    pod("ns", Some(NODE), "data"),
                ],
                "ns",
                None,
            ),
            ("no pod at all", vec![], "", Some(no_pod)),
            (
                "used by a pod on a real node",
                vec![pod("ns", Some("worker-1"), "data")],
                "",
                Some(no_pod),
            ),
            (
                "used by an unscheduled pod",
                vec![pod("ns", None, "data")],
                "",
                Some(no_pod),
            ),
            (
                "a pod of this node uses another claim",
                vec![pod("ns", Some(NODE), "other")],
                "",
                Some(no_pod),
            ),
            (
                "a pod of this node uses a claim of that name elsewhere",
                vec![pod("other-ns", Some(NODE), "data")],
                "",
                Some(no_pod),
            ),
            (
                "an ephemeral volume of the same name (not copied down)",
                vec![ephemeral],
                "",
                Some(no_pod),
            ),
            (
                "outside --namespace",
                vec![pod("ns", Some(NODE), "data")],
                "elsewhere",
                Some("is outside --namespace elsewhere"),
            ),
        ];
        for (case, pods, scope, want) in cases {
            assert_eq!(
                refused_claim("ns", "data", &pods, NODE, scope).as_deref(),
                want,
                "{case}"
            );
        }
    }

    #[test]
    fn bound_volumes_and_missing_classes() {
        let claim =
            |phase: &str, volume: Option<&str>, class: Option<&str>| -> PersistentVolumeClaim {
                from(json!({
                    "metadata": {"name": "c", "namespace": "ns"},
                    "spec": {"volumeName": volume, "storageClassName": class},
                    "status": {"phase": phase},
                }))
            };
        assert_eq!(
            bound_volume(&claim("Bound", Some("pv-1"), None)),
            Some("pv-1")
        );
        assert_eq!(bound_volume(&claim("Pending", Some("pv-1"), None)), None);
        assert_eq!(bound_volume(&claim("Bound", None, None)), None);

        let exists = |c: &str| c == "standard";
        assert_eq!(
            missing_storage_class(&claim("Pending", None, Some("fast")), exists).as_deref(),
            Some("fast")
        );
        assert_eq!(
            missing_storage_class(&claim("Pending", None, Some("standard")), exists),
            None
        );
        assert_eq!(
            missing_storage_class(&claim("Pending", None, Some("")), exists),
            None
        );
        assert_eq!(
            missing_storage_class(&claim("Pending", None, None), exists),
            None
        );
        assert_eq!(
            missing_storage_class(&claim("Bound", Some("v"), Some("fast")), exists),
            None
        );
    }
}
