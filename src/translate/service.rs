//! Services, EndpointSlices and Endpoints on their way down, so that a pod in the lower
//! cluster resolves and reaches an upper Service on a flat network.
//!
//! A lower Service has no selector (it lives in the `labelSelector` annotation), so no
//! lower controller computes its endpoints: tensile mirrors the upper ones, marked with
//! its own `endpointslice.kubernetes.io/managed-by` value (the lower EndpointSlice
//! controller leaves foreign slices alone) and, on Endpoints,
//! `endpointslice.kubernetes.io/skip-mirror` (so the lower mirroring controller does not
//! make a second set of slices from them). NodePort and LoadBalancer Services are
//! mirrored as ClusterIP: node ports and load balancers belong to the upper cluster.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    EndpointAddress, EndpointSubset, Endpoints, ObjectReference, Service, ServicePort, ServiceSpec,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::config::{SYSTEM_NAMESPACE, carry_server_fields};
use super::meta::{ENDPOINT_SLICE_MANAGER, LABEL_SELECTOR_ANNOTATION, Owner};
use super::{TranslateError, copy_meta, object_ref};

/// Label naming the Service an EndpointSlice belongs to.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// Label naming the controller that manages an EndpointSlice.
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// Label telling the EndpointSlice mirroring controller to leave an Endpoints alone.
pub const SKIP_MIRROR_LABEL: &str = "endpointslice.kubernetes.io/skip-mirror";

/// Whether the Service `namespace/name` is mirrored at all: not in kube-system, and not
/// the API server's own `default/kubernetes` (the lower cluster has its own).
pub fn is_mirrored_service(namespace: &str, name: &str) -> bool {
    namespace != SYSTEM_NAMESPACE && !(namespace == "default" && name == "kubernetes")
}

/// What to do with an existing lower copy.
#[derive(Clone, Debug, PartialEq)]
pub enum Update<K> {
    /// It already says what the upper object says.
    InStep,
    /// Replace it with this (carries the copy's resourceVersion: the replace is optimistic).
    Replace(K),
    /// A field that cannot change in place differs: delete it and create it anew.
    Recreate,
}

/// The lower copy of a Service: selector moved to the `labelSelector` annotation, cluster
/// IP left to the lower cluster (a headless Service stays headless), NodePort and
/// LoadBalancer become ClusterIP without node ports, ExternalName stays ExternalName.
/// Fields naming upper addresses or upper load balancers are dropped.
pub fn lower_service(upper: &Service, owner: &Owner) -> Result<Service, TranslateError> {
    let object = object_ref(&upper.metadata);
    let mut metadata = copy_meta("Service", &upper.metadata, owner)?;
    let spec = upper.spec.clone().unwrap_or_default();
    let external_name = match spec.type_.as_deref().unwrap_or("ClusterIP") {
        "ClusterIP" | "NodePort" | "LoadBalancer" => false,
        "ExternalName" => true,
        _ => {
            return Err(TranslateError::NotMirrored {
                kind: "Service",
                object,
                reason: "its type is none of ClusterIP, NodePort, LoadBalancer, ExternalName",
            });
        }
    };
    if let Some(selector) = spec.selector.as_ref().filter(|s| !s.is_empty()) {
        let encoded = serde_json::to_string(selector).map_err(|source| TranslateError::Encode {
            object: format!("Service {object}"),
            what: "spec.selector",
            source,
        })?;
        metadata
            .annotations
            .get_or_insert_default()
            .insert(LABEL_SELECTOR_ANNOTATION.to_owned(), encoded);
    }
    let ports = spec.ports.as_ref().map(|ports| {
        ports
            .iter()
            .map(|p| ServicePort {
                node_port: None,
                ..p.clone()
            })
            .collect()
    });
    let headless = !external_name && spec.cluster_ip.as_deref() == Some("None");
    Ok(Service {
        metadata,
        spec: Some(ServiceSpec {
            type_: Some(
                if external_name {
                    "ExternalName"
                } else {
                    "ClusterIP"
                }
                .to_owned(),
            ),
            cluster_ip: headless.then(|| "None".to_owned()),
            external_name: spec.external_name.clone().filter(|_| external_name),
            ports,
            session_affinity: spec.session_affinity.clone(),
            session_affinity_config: spec.session_affinity_config.clone(),
            publish_not_ready_addresses: spec.publish_not_ready_addresses,
            internal_traffic_policy: spec
                .internal_traffic_policy
                .clone()
                .filter(|_| !external_name),
            traffic_distribution: spec.traffic_distribution.clone(),
            ..ServiceSpec::default()
        }),
        status: None,
    })
}

/// Spec fields of a lower Service that tensile sets from the upper one and removes when
/// the upper one lacks them.
const CLEARED_SERVICE_FIELDS: &[&str] = &[
    "selector",
    "externalName",
    "externalIPs",
    "externalTrafficPolicy",
    "healthCheckNodePort",
    "loadBalancerIP",
    "loadBalancerSourceRanges",
    "loadBalancerClass",
    "allocateLoadBalancerNodePorts",
    "sessionAffinityConfig",
    "publishNotReadyAddresses",
    "trafficDistribution",
];
/// Spec fields tensile sets when the upper Service has them and otherwise leaves to the
/// lower API server's defaults (so a default tensile does not know never starts a
/// tug-of-war).
const DEFAULTED_SERVICE_FIELDS: &[&str] =
    &["type", "ports", "sessionAffinity", "internalTrafficPolicy"];

/// How to bring the lower Service `current` to `desired` (a [`lower_service`]).
pub fn service_update(desired: &Service, current: &Service) -> Update<Service> {
    let (want, have) = (spec_json(desired), spec_json(current));
    let is_external = |spec: &Map<String, Value>| {
        spec.get("type").and_then(Value::as_str) == Some("ExternalName")
    };
    let is_headless =
        |spec: &Map<String, Value>| spec.get("clusterIP").and_then(Value::as_str) == Some("None");
    // The cluster IP cannot change in place, and switching to or from ExternalName means
    // allocating or releasing one.
    if is_external(&want) != is_external(&have) || is_headless(&want) != is_headless(&have) {
        return Update::Recreate;
    }
    let spec_in_step = CLEARED_SERVICE_FIELDS
        .iter()
        .all(|f| want.get(*f) == have.get(*f))
        && DEFAULTED_SERVICE_FIELDS
            .iter()
            .all(|f| want.get(*f).is_none_or(|w| contains(have.get(*f), w)));
    if spec_in_step && same_marks(&desired.metadata, &current.metadata) {
        return Update::InStep;
    }
    let mut spec = have;
    for field in CLEARED_SERVICE_FIELDS
        .iter()
        .chain(DEFAULTED_SERVICE_FIELDS)
    {
        match want.get(*field) {
            Some(value) => {
                spec.insert((*field).to_owned(), value.clone());
            }
            None if CLEARED_SERVICE_FIELDS.contains(field) => {
                spec.remove(*field);
            }
            None => {}
        }
    }
    let mut replaced = current.clone();
    replaced
        .metadata
        .labels
        .clone_from(&desired.metadata.labels);
    replaced
        .metadata
        .annotations
        .clone_from(&desired.metadata.annotations);
    replaced.spec = serde_json::from_value(Value::Object(spec)).ok();
    if replaced.spec.is_none() {
        // Not expected: both halves came from valid specs. Start over rather than guess.
        return Update::Recreate;
    }
    Update::Replace(replaced)
}

fn spec_json(service: &Service) -> Map<String, Value> {
    match serde_json::to_value(&service.spec) {
        Ok(Value::Object(map)) => map,
        _ => Map::new(),
    }
}

/// Whether `have` holds everything `want` says: objects may have more keys, arrays must
/// be as long, and each element must hold its counterpart.
fn contains(have: Option<&Value>, want: &Value) -> bool {
    match (want, have) {
        (Value::Null, _) => true,
        (_, None) => false,
        (Value::Object(want), Some(Value::Object(have))) => want
            .iter()
            .all(|(key, value)| contains(have.get(key), value)),
        (Value::Array(want), Some(Value::Array(have))) => {
            want.len() == have.len() && want.iter().zip(have).all(|(w, h)| contains(Some(h), w))
        }
        (want, Some(have)) => want == have,
    }
}

/// Labels, annotations and owner references equal: the whole of a copy's metadata that
/// tensile decides.
fn same_marks(desired: &ObjectMeta, current: &ObjectMeta) -> bool {
    let or_empty = |m: &Option<BTreeMap<String, String>>| m.clone().unwrap_or_default();
    or_empty(&desired.labels) == or_empty(&current.labels)
        && or_empty(&desired.annotations) == or_empty(&current.annotations)
        && desired.owner_references.clone().unwrap_or_default()
            == current.owner_references.clone().unwrap_or_default()
}

/// An owner reference to the lower Service, so the lower garbage collector removes the
/// endpoints of a Service that is gone. `None` until the Service has a UID.
fn owned_by(service: &Service) -> Option<Vec<OwnerReference>> {
    Some(vec![OwnerReference {
        api_version: "v1".into(),
        kind: "Service".into(),
        name: service.metadata.name.clone()?,
        uid: service.metadata.uid.clone()?,
        controller: Some(true),
        block_owner_deletion: None,
    }])
}

/// A reference kept on a lower endpoint: the lower object of the same name (a mirrored
/// pod has its upper pod's namespace and name), without the upper UID and version.
fn lower_target(target: &ObjectReference) -> ObjectReference {
    ObjectReference {
        api_version: target.api_version.clone(),
        kind: target.kind.clone(),
        namespace: target.namespace.clone(),
        name: target.name.clone(),
        ..ObjectReference::default()
    }
}

/// The lower copy of an upper EndpointSlice of a mirrored Service, owned by `service` (the
/// lower copy of that Service): addresses, readiness, hostnames and ports kept; node
/// names, zones and hints, which describe the upper topology, dropped.
pub fn lower_endpoint_slice(
    upper: &EndpointSlice,
    owner: &Owner,
    service: &Service,
) -> Result<EndpointSlice, TranslateError> {
    let mut metadata = copy_meta("EndpointSlice", &upper.metadata, owner)?;
    metadata.labels.get_or_insert_default().insert(
        MANAGED_BY_LABEL.to_owned(),
        ENDPOINT_SLICE_MANAGER.to_owned(),
    );
    metadata.owner_references = owned_by(service);
    let endpoints = upper.endpoints.as_ref().map(|endpoints| {
        endpoints
            .iter()
            .map(|e| Endpoint {
                addresses: e.addresses.clone(),
                conditions: e.conditions.clone(),
                hostname: e.hostname.clone(),
                target_ref: e.target_ref.as_ref().map(lower_target),
                ..Endpoint::default()
            })
            .collect()
    });
    Ok(EndpointSlice {
        metadata,
        address_type: upper.address_type.clone(),
        endpoints,
        ports: upper.ports.clone(),
    })
}

/// How to bring a lower EndpointSlice to `desired`.
pub fn endpoint_slice_update(
    desired: &EndpointSlice,
    current: &EndpointSlice,
) -> Update<EndpointSlice> {
    if desired.address_type != current.address_type {
        return Update::Recreate;
    }
    let in_step = same_marks(&desired.metadata, &current.metadata)
        && holds(&desired.endpoints, &current.endpoints)
        && holds(&desired.ports, &current.ports);
    replace_unless(in_step, current, desired)
}

/// The lower copy of an upper Endpoints of a mirrored Service, owned by `service`, with
/// `endpointslice.kubernetes.io/skip-mirror`.
pub fn lower_endpoints(
    upper: &Endpoints,
    owner: &Owner,
    service: &Service,
) -> Result<Endpoints, TranslateError> {
    let mut metadata = copy_meta("Endpoints", &upper.metadata, owner)?;
    metadata
        .labels
        .get_or_insert_default()
        .insert(SKIP_MIRROR_LABEL.to_owned(), "true".to_owned());
    metadata.owner_references = owned_by(service);
    let addresses = |list: &Option<Vec<EndpointAddress>>| {
        list.as_ref().map(|list| {
            list.iter()
                .map(|a| EndpointAddress {
                    ip: a.ip.clone(),
                    hostname: a.hostname.clone(),
                    target_ref: a.target_ref.as_ref().map(lower_target),
                    node_name: None,
                })
                .collect()
        })
    };
    let subsets = upper.subsets.as_ref().map(|subsets| {
        subsets
            .iter()
            .map(|s| EndpointSubset {
                addresses: addresses(&s.addresses),
                not_ready_addresses: addresses(&s.not_ready_addresses),
                ports: s.ports.clone(),
            })
            .collect()
    });
    Ok(Endpoints { metadata, subsets })
}

/// How to bring a lower Endpoints to `desired`.
pub fn endpoints_update(desired: &Endpoints, current: &Endpoints) -> Update<Endpoints> {
    let in_step = same_marks(&desired.metadata, &current.metadata)
        && holds(&desired.subsets, &current.subsets);
    replace_unless(in_step, current, desired)
}

fn holds<T: Serialize>(want: &T, have: &T) -> bool {
    match (serde_json::to_value(want), serde_json::to_value(have)) {
        (Ok(want), Ok(have)) => contains(Some(&have), &want),
        _ => false,
    }
}

fn replace_unless<K>(in_step: bool, current: &K, desired: &K) -> Update<K>
where
    K: k8s_openapi::Metadata<Ty = ObjectMeta> + Clone + Serialize + DeserializeOwned,
{
    if in_step {
        return Update::InStep;
    }
    let mut replaced = desired.clone();
    carry_server_fields(current.metadata(), replaced.metadata_mut());
    Update::Replace(replaced)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::translate::meta::{GLOBAL_ANNOTATION, UPPER_UID_ANNOTATION};
    use crate::translate::meta::{OWNER_NODE_LABEL, UPPER_CLUSTER_LABEL};
    use serde_json::json;

    const NODE: &str = "vk";
    const CLUSTER: &str = "cluster-1";

    fn owner() -> Owner {
        Owner::new(NODE, CLUSTER)
    }

    fn from<T: DeserializeOwned>(value: Value) -> T {
        serde_json::from_value(value).unwrap()
    }

    fn upper_service(spec: Value) -> Service {
        from(json!({
            "metadata": {"name": "web", "namespace": "ns", "uid": "u-svc", "resourceVersion": "5",
                         "labels": {"app": "web"}},
            "spec": spec,
        }))
    }

    /// A lower Service as the lower API server would return `lower_service`'s output.
    fn stored(mut service: Service) -> Service {
        service.metadata.resource_version = Some("lower-1".into());
        service.metadata.uid = Some("lower-uid".into());
        let spec = service.spec.get_or_insert_default();
        if spec.cluster_ip.is_none() && spec.type_.as_deref() == Some("ClusterIP") {
            spec.cluster_ip = Some("10.97.0.10".into());
            spec.cluster_ips = Some(vec!["10.97.0.10".into()]);
        }
        spec.ip_families = Some(vec!["IPv4".into()]);
        spec.ip_family_policy = Some("SingleStack".into());
        service
    }

    #[test]
    fn lower_services() {
        let ports = json!([{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]);
        // (case, upper spec, expected lower spec)
        let cases = [
            (
                "ClusterIP: selector moved, cluster IP left to the lower cluster",
                json!({"type": "ClusterIP", "clusterIP": "10.96.0.7", "clusterIPs": ["10.96.0.7"],
                       "selector": {"app": "web"}, "ports": ports, "sessionAffinity": "None",
                       "internalTrafficPolicy": "Cluster", "ipFamilies": ["IPv4"],
                       "ipFamilyPolicy": "SingleStack"}),
                json!({"type": "ClusterIP", "ports": ports, "sessionAffinity": "None",
                       "internalTrafficPolicy": "Cluster"}),
            ),
            (
                "headless stays headless",
                json!({"type": "ClusterIP", "clusterIP": "None", "clusterIPs": ["None"],
                       "selector": {"app": "web"}, "ports": ports}),
                json!({"type": "ClusterIP", "clusterIP": "None", "ports": ports}),
            ),
            (
                "NodePort becomes ClusterIP without node ports",
                json!({"type": "NodePort", "clusterIP": "10.96.0.8", "externalTrafficPolicy": "Local",
                       "ports": [{"port": 80, "protocol": "TCP", "targetPort": 80, "nodePort": 30080}],
                       "selector": {"app": "web"}}),
                json!({"type": "ClusterIP",
                       "ports": [{"port": 80, "protocol": "TCP", "targetPort": 80}]}),
            ),
            (
                "LoadBalancer becomes ClusterIP",
                json!({"type": "LoadBalancer", "clusterIP": "10.96.0.9", "loadBalancerClass": "x",
                       "allocateLoadBalancerNodePorts": true, "healthCheckNodePort": 31000,
                       "loadBalancerSourceRanges": ["1.2.3.0/24"], "externalIPs": ["1.2.3.4"],
                       "ports": [{"port": 443, "protocol": "TCP", "targetPort": 443, "nodePort": 30443}],
                       "sessionAffinity": "ClientIP",
                       "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}}}),
                json!({"type": "ClusterIP",
                       "ports": [{"port": 443, "protocol": "TCP", "targetPort": 443}],
                       "sessionAffinity": "ClientIP",
                       "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 60}}}),
            ),
            (
                "ExternalName stays ExternalName",
                json!({"type": "ExternalName", "externalName": "db.example.com",
                       "sessionAffinity": "None", "internalTrafficPolicy": "Cluster"}),
                json!({"type": "ExternalName", "externalName": "db.example.com",
                       "sessionAffinity": "None"}),
            ),
            (
                "no type means ClusterIP",
                json!({"ports": ports, "publishNotReadyAddresses": true}),
                json!({"type": "ClusterIP", "ports": ports, "publishNotReadyAddresses": true}),
            ),
        ];
        for (name, upper, want) in cases {
            let lower = lower_service(&upper_service(upper.clone()), &owner()).unwrap();
            assert_eq!(serde_json::to_value(&lower.spec).unwrap(), want, "{name}");
            let annotations = lower.metadata.annotations.clone().unwrap();
            assert_eq!(annotations[UPPER_UID_ANNOTATION], "u-svc", "{name}");
            assert_eq!(annotations[GLOBAL_ANNOTATION], "true", "{name}");
            assert_eq!(
                annotations.get(LABEL_SELECTOR_ANNOTATION).cloned(),
                upper
                    .get("selector")
                    .map(|s| serde_json::to_string(s).unwrap()),
                "{name}"
            );
            let labels = lower.metadata.labels.clone().unwrap();
            assert_eq!(labels[OWNER_NODE_LABEL], NODE, "{name}");
            assert_eq!(labels[UPPER_CLUSTER_LABEL], CLUSTER, "{name}");
            assert_eq!(labels["app"], "web", "{name}");
            assert_eq!(lower.metadata.resource_version, None, "{name}");
        }
    }

    #[test]
    fn a_service_of_unknown_type_is_not_mirrored() {
        let err = lower_service(&upper_service(json!({"type": "Magic"})), &owner()).unwrap_err();
        assert!(matches!(err, TranslateError::NotMirrored { .. }), "{err:?}");
        assert!(err.to_string().contains("ns/web"), "{err}");
    }

    #[test]
    fn which_services_are_mirrored() {
        assert!(is_mirrored_service("default", "web"));
        assert!(is_mirrored_service("team", "kubernetes"));
        assert!(!is_mirrored_service("default", "kubernetes"));
        assert!(!is_mirrored_service("kube-system", "kube-dns"));
    }

    #[test]
    fn service_updates() {
        let base = json!({"type": "ClusterIP", "selector": {"app": "web"},
                          "ports": [{"port": 80, "protocol": "TCP", "targetPort": 80}],
                          "sessionAffinity": "None", "internalTrafficPolicy": "Cluster"});
        let desired = lower_service(&upper_service(base.clone()), &owner()).unwrap();
        let current = stored(desired.clone());
        assert_eq!(service_update(&desired, &current), Update::InStep);

        // A port added upstream: replaced in place, the allocated cluster IP kept.
        let mut more_ports = base.clone();
        more_ports["ports"] = json!([{"port": 80, "protocol": "TCP", "targetPort": 80},
                                     {"port": 81, "protocol": "TCP", "targetPort": 81}]);
        let desired2 = lower_service(&upper_service(more_ports), &owner()).unwrap();
        let Update::Replace(replaced) = service_update(&desired2, &current) else {
            panic!("expected a replace");
        };
        let spec = replaced.spec.clone().unwrap();
        assert_eq!(spec.ports.unwrap().len(), 2);
        assert_eq!(spec.cluster_ip.as_deref(), Some("10.97.0.10"));
        assert_eq!(spec.ip_family_policy.as_deref(), Some("SingleStack"));
        assert_eq!(
            replaced.metadata.resource_version.as_deref(),
            Some("lower-1")
        );
        assert_eq!(
            service_update(&desired2, &stored(desired2.clone())),
            Update::InStep
        );

        // Something set below that tensile owns is removed.
        let mut tampered = current.clone();
        tampered.spec.as_mut().unwrap().selector = Some([("app".into(), "x".into())].into());
        let Update::Replace(fixed) = service_update(&desired, &tampered) else {
            panic!("expected a replace");
        };
        assert_eq!(fixed.spec.unwrap().selector, None);

        // A label removed upstream is removed below.
        let mut relabelled = current.clone();
        relabelled
            .metadata
            .labels
            .get_or_insert_default()
            .insert("stale".into(), "x".into());
        assert!(matches!(
            service_update(&desired, &relabelled),
            Update::Replace(_)
        ));

        // Session affinity turned off upstream: its config goes too.
        let mut sticky = base.clone();
        sticky["sessionAffinity"] = json!("ClientIP");
        sticky["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": 10}});
        let sticky_below = stored(lower_service(&upper_service(sticky), &owner()).unwrap());
        let Update::Replace(unstuck) = service_update(&desired, &sticky_below) else {
            panic!("expected a replace");
        };
        let spec = unstuck.spec.unwrap();
        assert_eq!(spec.session_affinity.as_deref(), Some("None"));
        assert_eq!(spec.session_affinity_config, None);

        // A default the lower cluster adds that tensile does not set is no difference.
        let mut defaulted = current.clone();
        defaulted.spec.as_mut().unwrap().internal_traffic_policy = Some("Cluster".into());
        let mut no_policy = base.clone();
        no_policy
            .as_object_mut()
            .unwrap()
            .remove("internalTrafficPolicy");
        let desired3 = lower_service(&upper_service(no_policy), &owner()).unwrap();
        assert_eq!(service_update(&desired3, &defaulted), Update::InStep);

        // Headless-ness and ExternalName cannot change in place.
        let mut headless = base.clone();
        headless["clusterIP"] = json!("None");
        let desired4 = lower_service(&upper_service(headless), &owner()).unwrap();
        assert_eq!(service_update(&desired4, &current), Update::Recreate);
        let external = lower_service(
            &upper_service(json!({"type": "ExternalName", "externalName": "x.example"})),
            &owner(),
        )
        .unwrap();
        assert_eq!(service_update(&external, &current), Update::Recreate);
    }

    fn lower_svc() -> Service {
        stored(lower_service(&upper_service(json!({"ports": []})), &owner()).unwrap())
    }

    #[test]
    fn lower_endpoint_slices() {
        let upper: EndpointSlice = from(json!({
            "metadata": {"name": "web-abcde", "namespace": "ns", "uid": "u-slice", "resourceVersion": "9",
                         "labels": {SERVICE_NAME_LABEL: "web",
                                    MANAGED_BY_LABEL: "endpointslice-controller.k8s.io"},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": "web", "uid": "u-svc"}]},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.244.0.5"], "conditions": {"ready": true, "serving": true, "terminating": false},
                 "nodeName": "vk", "zone": "z1", "hints": {"forZones": [{"name": "z1"}]},
                 "targetRef": {"kind": "Pod", "namespace": "ns", "name": "web-1", "uid": "u-pod", "resourceVersion": "3"}},
                {"addresses": ["10.224.0.9"], "conditions": {"ready": false}, "hostname": "web-2"},
            ],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        }));
        let want: EndpointSlice = from(json!({
            "metadata": {"name": "web-abcde", "namespace": "ns",
                         "labels": {SERVICE_NAME_LABEL: "web", MANAGED_BY_LABEL: ENDPOINT_SLICE_MANAGER,
                                    OWNER_NODE_LABEL: NODE, UPPER_CLUSTER_LABEL: CLUSTER},
                         "annotations": {UPPER_UID_ANNOTATION: "u-slice", GLOBAL_ANNOTATION: "true"},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": "web",
                                              "uid": "lower-uid", "controller": true}]},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.244.0.5"], "conditions": {"ready": true, "serving": true, "terminating": false},
                 "targetRef": {"kind": "Pod", "namespace": "ns", "name": "web-1"}},
                {"addresses": ["10.224.0.9"], "conditions": {"ready": false}, "hostname": "web-2"},
            ],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        }));
        let got = lower_endpoint_slice(&upper, &owner(), &lower_svc()).unwrap();
        assert_eq!(got, want);

        let mut current = got.clone();
        current.metadata.resource_version = Some("lower-7".into());
        assert_eq!(endpoint_slice_update(&got, &current), Update::InStep);
        let mut not_ready = upper.clone();
        not_ready.endpoints.as_mut().unwrap()[0].conditions = Some(from(json!({"ready": false})));
        let desired = lower_endpoint_slice(&not_ready, &owner(), &lower_svc()).unwrap();
        let Update::Replace(replaced) = endpoint_slice_update(&desired, &current) else {
            panic!("expected a replace");
        };
        assert_eq!(
            replaced.metadata.resource_version.as_deref(),
            Some("lower-7")
        );
        assert_eq!(replaced.endpoints, desired.endpoints);
        let mut v6 = desired.clone();
        v6.address_type = "IPv6".into();
        assert_eq!(endpoint_slice_update(&v6, &current), Update::Recreate);
    }

    #[test]
    fn lower_endpoints_skip_mirroring() {
        let upper: Endpoints = from(json!({
            "metadata": {"name": "web", "namespace": "ns", "uid": "u-ep",
                         "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "t"}},
            "subsets": [{
                "addresses": [{"ip": "10.244.0.5", "nodeName": "vk",
                               "targetRef": {"kind": "Pod", "namespace": "ns", "name": "web-1", "uid": "u-pod"}}],
                "notReadyAddresses": [{"ip": "10.244.0.6", "hostname": "h"}],
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            }],
        }));
        let got = lower_endpoints(&upper, &owner(), &lower_svc()).unwrap();
        let want: Endpoints = from(json!({
            "metadata": {"name": "web", "namespace": "ns",
                         "labels": {SKIP_MIRROR_LABEL: "true", OWNER_NODE_LABEL: NODE, UPPER_CLUSTER_LABEL: CLUSTER},
                         "annotations": {"endpoints.kubernetes.io/last-change-trigger-time": "t",
                                         UPPER_UID_ANNOTATION: "u-ep", GLOBAL_ANNOTATION: "true"},
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": "web",
                                              "uid": "lower-uid", "controller": true}]},
            "subsets": [{
                "addresses": [{"ip": "10.244.0.5",
                               "targetRef": {"kind": "Pod", "namespace": "ns", "name": "web-1"}}],
                "notReadyAddresses": [{"ip": "10.244.0.6", "hostname": "h"}],
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            }],
        }));
        assert_eq!(got, want);
        assert_eq!(endpoints_update(&got, &got), Update::InStep);
        let mut emptied = got.clone();
        emptied.subsets = None;
        assert!(matches!(
            endpoints_update(&got, &emptied),
            Update::Replace(_)
        ));
    }

    #[test]
    fn containment() {
        let cases = [
            (json!({"a": 1}), json!({"a": 1, "b": 2}), true),
            (json!({"a": 1, "b": 2}), json!({"a": 1}), false),
            (json!([{"a": 1}]), json!([{"a": 1, "p": "TCP"}]), true),
            (json!([{"a": 1}]), json!([{"a": 1}, {"a": 2}]), false),
            (json!({"a": null}), json!({}), true),
            (json!("x"), json!("y"), false),
        ];
        for (want, have, expected) in cases {
            assert_eq!(contains(Some(&have), &want), expected, "{want} in {have}");
        }
    }
}
