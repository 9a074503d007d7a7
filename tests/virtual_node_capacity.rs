//! The virtual Node: registered Ready with tensile-kube's labels and taint, reporting the
//! lower cluster's capacity, shrinking when lower pods not its own take room, never
//! negative. Its own test binary, so its pair has no other tests' pods in it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use common::{TIMEOUT, start_node};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use std::collections::BTreeMap;

use tensile::translate::meta::{OWNER_NODE_LABEL, UPPER_CLUSTER_LABEL};
use tensile_harness::fixtures::pod;
use tensile_harness::{ClusterPair, TestNamespace, wait_for};

async fn capacity(nodes: &Api<Node>, name: &str) -> anyhow::Result<(String, String, String)> {
    let node = nodes.get(name).await?;
    let status = node.status.unwrap_or_default();
    let capacity = status.capacity.unwrap_or_default();
    let allocatable = status.allocatable.unwrap_or_default();
    anyhow::ensure!(
        capacity == allocatable,
        "capacity {capacity:?} != allocatable {allocatable:?}"
    );
    let get = |k: &str| capacity.get(k).map(|q| q.0.clone()).unwrap_or_default();
    Ok((get("cpu"), get("memory"), get("pods")))
}

async fn wait_capacity(nodes: &Api<Node>, name: &str, want: (&str, &str, &str)) {
    let what = format!("capacity of {name} to be {want:?}");
    let result = wait_for(&what, TIMEOUT, || async {
        let got = capacity(nodes, name).await?;
        Ok((got.0 == want.0 && got.1 == want.1 && got.2 == want.2).then_some(()))
    })
    .await;
    if let Err(error) = result {
        panic!("{error:#}; last seen {:?}", capacity(nodes, name).await);
    }
}

/// A lower pod that is not mirrored, bound to `lower-node-0`, requesting `cpu`.
fn lower_pod(name: &str, cpu: &str) -> Pod {
    pod(
        name,
        json!({
            "nodeName": "lower-node-0",
            "containers": [{"name": "app", "image": "nginx",
                "resources": {"requests": {"cpu": cpu, "memory": "1Gi"}}}],
        }),
    )
}

#[tokio::test]
async fn node_is_ready_with_tensile_kube_labels_taint_and_the_lower_capacity() {
    let pair = ClusterPair::shared().await.unwrap();
    let vn = start_node(pair, "vk-cap", &[]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let nodes: Api<Node> = Api::all(upper.clone());
    let node = nodes.get("vk-cap").await.unwrap();

    let labels = node.metadata.labels.clone().unwrap();
    for (k, v) in [
        ("type", "virtual-kubelet"),
        ("kubernetes.io/role", "agent"),
        ("kubernetes.io/hostname", "vk-cap"),
        ("kubernetes.io/os", "linux"),
        ("kubernetes.io/arch", "amd64"),
    ] {
        assert_eq!(labels.get(k).map(String::as_str), Some(v), "label {k}");
    }
    let taints = node.spec.clone().unwrap().taints.unwrap();
    assert!(taints.iter().any(|t| t.key == "virtual-kubelet.io/provider"
        && t.value.as_deref() == Some("k8s")
        && t.effect == "NoSchedule"));
    let status = node.status.clone().unwrap();
    let lower_version = lower.apiserver_version().await.unwrap().git_version;
    assert_eq!(status.node_info.unwrap().kubelet_version, lower_version);
    let port = status
        .daemon_endpoints
        .unwrap()
        .kubelet_endpoint
        .unwrap()
        .port;
    assert_eq!(port, i32::from(vn.kubelet_port));
    let leases = Api::<Lease>::namespaced(upper.clone(), "kube-node-lease");
    let lease = wait_for("the node lease", TIMEOUT, || async {
        Ok(leases.get_opt("vk-cap").await?)
    })
    .await
    .unwrap();
    assert_eq!(lease.spec.unwrap().lease_duration_seconds, Some(40));

    // Three lower nodes of 8 CPU, 32Gi, 110 pods: their allocatable, summed.
    let full = ("24", "103079215104", "330");
    wait_capacity(&nodes, "vk-cap", full).await;

    // A lower pod that is not ours takes its requests out of the offer.
    let ns = TestNamespace::create(&lower, "capacity").await.unwrap();
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    lower_pods
        .create(&PostParams::default(), &lower_pod("other", "2"))
        .await
        .unwrap();
    wait_capacity(&nodes, "vk-cap", ("22", "102005473280", "329")).await;

    // More than there is: clamped at zero, and the node still registers its status.
    lower_pods
        .create(&PostParams::default(), &lower_pod("huge", "100"))
        .await
        .unwrap();
    wait_capacity(&nodes, "vk-cap", ("0", "100931731456", "328")).await;

    for name in ["other", "huge"] {
        lower_pods
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
    wait_capacity(&nodes, "vk-cap", full).await;

    // A pod of another upper cluster's node of the same name takes room too (it comes
    // through the capacity's second pod watch); the orphan collection leaves it alone.
    let mut foreign = lower_pod("foreign", "2");
    foreign.metadata.labels = Some(BTreeMap::from([
        (OWNER_NODE_LABEL.to_owned(), "vk-cap".to_owned()),
        (UPPER_CLUSTER_LABEL.to_owned(), "another-cluster".to_owned()),
    ]));
    lower_pods
        .create(&PostParams::default(), &foreign)
        .await
        .unwrap();
    wait_capacity(&nodes, "vk-cap", ("22", "102005473280", "329")).await;
    lower_pods
        .delete("foreign", &DeleteParams::default())
        .await
        .unwrap();
    wait_capacity(&nodes, "vk-cap", full).await;

    // A lower node joins, is cordoned, leaves: the offer follows.
    pair.lower
        .add_nodes(&["lower-extra".to_owned()])
        .await
        .unwrap();
    wait_capacity(&nodes, "vk-cap", ("32", "137438953472", "440")).await;
    let lower_nodes: Api<Node> = Api::all(lower.clone());
    let cordon = json!({"spec": {"unschedulable": true}});
    lower_nodes
        .patch(
            "lower-extra",
            &PatchParams::default(),
            &Patch::Merge(&cordon),
        )
        .await
        .unwrap();
    wait_capacity(&nodes, "vk-cap", full).await;
    lower_nodes
        .delete("lower-extra", &DeleteParams::default())
        .await
        .unwrap();
    wait_capacity(&nodes, "vk-cap", full).await;
    ns.delete().await.unwrap();
}
