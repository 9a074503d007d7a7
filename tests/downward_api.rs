//! The downward API of a pod on the virtual node reads the upper pod's values, as on a real
//! node of the upper cluster: under `--lower-namespace=prefixed` a pod whose environment,
//! downwardAPI volume and projected downwardAPI source read its UID, namespace, name, node,
//! host IP and labels resolves, below, to the upper pod's (kwok runs no containers, so the
//! lower pod object is resolved as the kubelet resolves it), and a label changed upstairs
//! reaches the volume's file.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;

use common::{TIMEOUT, start_node, wait_running};
use k8s_openapi::api::core::v1::{Namespace, ObjectFieldSelector, Pod};
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tensile::translate::namespace::{cluster_suffix, prefixed};
use tensile_harness::fixtures::{bound_pod, merge};
use tensile_harness::{ClusterPair, TestNamespace, wait_for};

/// No Service mirroring: the shared pair's other tests own their Services.
const NO_SERVICES: &str = "--enable-controllers=PVControllers";

async fn cluster_id(upper: &Client) -> String {
    Api::<Namespace>::all(upper.clone())
        .get("kube-system")
        .await
        .unwrap()
        .uid()
        .unwrap()
}

/// `fieldpath.FormatMap` for label maps (whose values need no escaping): `key="value"`
/// lines in key order.
fn kubelet_format(map: &BTreeMap<String, String>) -> String {
    map.iter()
        .map(|(k, v)| format!("{k}=\"{v}\""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// What the kubelet resolves `selector` to for `pod` (`fieldpath.ExtractFieldPathAsString`,
/// and the pod's host IP for `status.hostIP`, which the kubelet takes from its node).
fn resolve(pod: &Pod, selector: &ObjectFieldSelector) -> String {
    assert_eq!(selector.api_version.as_deref(), Some("v1"), "{selector:?}");
    let path = selector.field_path.as_str();
    let subscript = |prefix: &str| {
        path.strip_prefix(prefix)
            .and_then(|rest| rest.strip_suffix("']"))
            .map(ToOwned::to_owned)
    };
    if let Some(key) = subscript("metadata.annotations['") {
        return pod.annotations().get(&key).cloned().unwrap_or_default();
    }
    if let Some(key) = subscript("metadata.labels['") {
        return pod.labels().get(&key).cloned().unwrap_or_default();
    }
    let status = pod.status.clone().unwrap_or_default();
    match path {
        "metadata.uid" => pod.uid().unwrap(),
        "metadata.namespace" => pod.namespace().unwrap(),
        "metadata.name" => pod.name_any(),
        "metadata.labels" => kubelet_format(pod.labels()),
        "spec.nodeName" => pod.spec.as_ref().unwrap().node_name.clone().unwrap(),
        "status.hostIP" => status.host_ip.unwrap_or_default(),
        other => panic!("the test resolves no {other}"),
    }
}

/// Every `fieldRef` of `pod`'s containers and volumes, by env var name or file path.
fn field_refs(pod: &Pod) -> BTreeMap<String, ObjectFieldSelector> {
    let spec = pod.spec.as_ref().unwrap();
    let mut refs = BTreeMap::new();
    for var in spec.containers.iter().flat_map(|c| c.env.iter().flatten()) {
        if let Some(f) = var.value_from.as_ref().and_then(|v| v.field_ref.clone()) {
            refs.insert(format!("env {}", var.name), f);
        }
    }
    // Each cluster injects its own service-account volume (its namespace file is the lower
    // name below unless --upper-identity: a limit the README states).
    let injected = |name: &str| name.starts_with("kube-api-access-");
    for volume in spec.volumes.iter().flatten().filter(|v| !injected(&v.name)) {
        let mut items = Vec::new();
        if let Some(d) = &volume.downward_api {
            items.extend(d.items.iter().flatten());
        }
        if let Some(p) = &volume.projected {
            let sources = p.sources.iter().flatten();
            for d in sources.filter_map(|s| s.downward_api.as_ref()) {
                items.extend(d.items.iter().flatten());
            }
        }
        for item in items {
            if let Some(f) = item.field_ref.clone() {
                refs.insert(format!("{} {}", volume.name, item.path), f);
            }
        }
    }
    refs
}

/// A pod bound to `node` that reads itself through the downward API, with a label that
/// `--ignore-labels` moves off the lower pod.
fn reading_pod(node: &str) -> Pod {
    let mut value = serde_json::to_value(bound_pod("dapi", node)).unwrap();
    let field = |path: &str| json!({"fieldRef": {"fieldPath": path}});
    let item = |file: &str, path: &str| json!({"path": file, "fieldRef": {"fieldPath": path}});
    merge(
        &mut value,
        json!({
            "metadata": {"labels": {"tier": "front", "pod-group.scheduling.sigs.k8s.io": "g1"}},
            "spec": {"volumes": [
                {"name": "info", "downwardAPI": {"items": [
                    item("uid", "metadata.uid"),
                    item("namespace", "metadata.namespace"),
                    item("name", "metadata.name"),
                    item("labels", "metadata.labels"),
                ]}},
                {"name": "all", "projected": {"sources": [
                    {"downwardAPI": {"items": [item("namespace", "metadata.namespace")]}},
                ]}},
            ]},
        }),
    );
    let container = &mut value["spec"]["containers"][0];
    container["env"] = json!([
        {"name": "POD_UID", "valueFrom": field("metadata.uid")},
        {"name": "POD_NAMESPACE", "valueFrom": field("metadata.namespace")},
        {"name": "POD_NAME", "valueFrom": field("metadata.name")},
        {"name": "NODE_NAME", "valueFrom": field("spec.nodeName")},
        {"name": "HOST_IP", "valueFrom": field("status.hostIP")},
        {"name": "TIER", "valueFrom": field("metadata.labels['tier']")},
    ]);
    container["volumeMounts"] = json!([
        {"name": "info", "mountPath": "/etc/info"},
        {"name": "all", "mountPath": "/etc/all"},
    ]);
    serde_json::from_value(value).unwrap()
}

#[tokio::test]
async fn the_downward_api_below_reads_the_upper_pod() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-downward";
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let _vn = start_node(pair, node, &[NO_SERVICES, "--lower-namespace=prefixed"]).await;
    let ns = TestNamespace::create(&upper, "downward").await.unwrap();
    let below = prefixed(&ns.name, &cluster_suffix(&cluster_id(&upper).await));
    assert_ne!(below, ns.name, "the namespace is remapped");

    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &below);
    upper_pods
        .create(&PostParams::default(), &reading_pod(node))
        .await
        .unwrap();
    let lower_pod = wait_running(&lower_pods, "app=dapi", 1).await.remove(0);
    // Running upstairs, with the host IP reflected from below.
    let upper_pod = wait_for(
        "the upper pod Running with its host IP",
        TIMEOUT,
        || async {
            let pod = upper_pods.get("dapi").await?;
            let status = pod.status.clone().unwrap_or_default();
            Ok(
                (status.phase.as_deref() == Some("Running") && status.host_ip.is_some())
                    .then_some(pod),
            )
        },
    )
    .await
    .unwrap();
    let lower_pod = lower_pods.get(&lower_pod.name_any()).await.unwrap();

    // Every field read below resolves to what it resolves to upstairs.
    let upper_refs = field_refs(&upper_pod);
    let lower_refs = field_refs(&lower_pod);
    assert_eq!(
        upper_refs.keys().collect::<Vec<_>>(),
        lower_refs.keys().collect::<Vec<_>>(),
        "the lower pod reads the same variables and files"
    );
    let mut resolved = BTreeMap::new();
    let mut differ = Vec::new();
    for (what, selector) in &upper_refs {
        let want = resolve(&upper_pod, selector);
        let got = resolve(&lower_pod, &lower_refs[what]);
        println!("{what}: upper {want:?}, lower {got:?}");
        if got != want {
            differ.push(format!(
                "{what}: {got:?} below ({}), {want:?} upstairs",
                lower_refs[what].field_path
            ));
        }
        resolved.insert(what.clone(), got);
    }
    assert!(
        differ.is_empty(),
        "read below differently:\n{}",
        differ.join("\n")
    );
    // Spelled out, so the assertion above cannot pass by resolving nothing.
    assert_eq!(resolved["env POD_UID"], upper_pod.uid().unwrap());
    assert_ne!(resolved["env POD_UID"], lower_pod.uid().unwrap());
    assert_eq!(resolved["env POD_NAMESPACE"], ns.name);
    assert_eq!(resolved["all namespace"], ns.name);
    assert_eq!(resolved["info namespace"], ns.name);
    assert_eq!(resolved["env NODE_NAME"], node);
    assert_eq!(resolved["env POD_NAME"], "dapi");
    assert!(!resolved["env HOST_IP"].is_empty());
    assert_eq!(
        resolved["info labels"],
        "app=\"dapi\"\npod-group.scheduling.sigs.k8s.io=\"g1\"\ntier=\"front\""
    );
    // The annotations that carry the upper values stay below.
    assert!(
        upper_pod
            .annotations()
            .keys()
            .all(|k| !k.starts_with("tensile.dev/upper-")),
        "{:?}",
        upper_pod.annotations()
    );

    // A label changed upstairs reaches the labels file (the kubelet rewrites it).
    upper_pods
        .patch(
            "dapi",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"tier": "back"}}})),
        )
        .await
        .unwrap();
    let labels_ref = lower_refs["info labels"].clone();
    wait_for("the new label in the labels file", TIMEOUT, || async {
        let pod = lower_pods.get("dapi").await?;
        Ok((resolve(&pod, &labels_ref)
            == "app=\"dapi\"\npod-group.scheduling.sigs.k8s.io=\"g1\"\ntier=\"back\"")
            .then_some(()))
    })
    .await
    .unwrap();
    ns.delete().await.unwrap();
}
