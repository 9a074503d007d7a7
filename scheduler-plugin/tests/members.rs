//! The extender across the members of one federated virtual-node process: two lower
//! clusters, each its own virtual node, one extender knowing both. A pod that only
//! member B's lower cluster can take (its resources, or constraints stashed in
//! `clusterSelector` that only B's nodes meet) is filtered off member A's node and runs
//! on B.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::net::Ipv4Addr;

use common::{
    ServedExtender, cpu_pod, scheduled_to, scheduler_extenders, virtual_node_binary,
    wait_phase_running,
};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::json;
use tensile_harness::ports::free_port;
use tensile_harness::{ClusterOptions, ClusterPair, NodeShape, PairOptions, TestNamespace};

const A: &str = "vk-member-a";
const B: &str = "vk-member-b";

#[tokio::test]
async fn a_pod_only_member_b_can_take_is_filtered_off_member_a() {
    let port = free_port().unwrap();
    let mut options = PairOptions::default();
    // No regular node upstairs: the two virtual nodes are the only choices.
    options.upper.nodes = 0;
    options.lower.nodes = 2;
    options.lower.node_shape = NodeShape {
        cpu: "4".into(),
        ..NodeShape::default()
    };
    options
        .upper
        .scheduler_config
        .insert("extenders".into(), scheduler_extenders(port));
    let binary = tokio::task::spawn_blocking(virtual_node_binary);
    let pair = ClusterPair::start(options).await.unwrap();
    let mut b = ClusterOptions::new(
        "lower-b",
        1,
        (Ipv4Addr::new(10, 98, 0, 0), 16),
        "10.245.0.0/16",
    );
    b.node_shape = NodeShape {
        cpu: "16".into(),
        ..NodeShape::default()
    };
    b.node_labels = [("disk".to_owned(), "ssd".to_owned())].into();
    let b = pair.start_cluster(b).await.unwrap();
    let binary = binary.await.unwrap();

    let _served = ServedExtender::start_clusters(
        &pair,
        &[
            (A.to_owned(), pair.lower_kubeconfig().to_owned()),
            (B.to_owned(), b.kubeconfig.clone()),
        ],
        port,
    )
    .await;
    let upper = pair.upper.client().await.unwrap();
    let _vn = pair
        .start_members(
            &binary,
            "tensile-members",
            &[(A, pair.lower_kubeconfig()), (B, &b.kubeconfig)],
            &[],
        )
        .await
        .unwrap();

    let ns = TestNamespace::create(&upper, "members").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let either = json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{
            "key": "kubernetes.io/hostname", "operator": "In", "values": [A, B]}]}]}}}});
    // A advertises 8 CPU (two nodes of 4) but no node of it takes 6.
    pods.create(&PostParams::default(), &cpu_pod("big", "6", either.clone()))
        .await
        .unwrap();
    // Small enough for A, but its stashed constraints ask for a node only B has.
    let mut stashed = cpu_pod("ssd", "1", either);
    stashed.metadata.annotations = Some(
        [(
            "clusterSelector".to_owned(),
            json!({"nodeSelector": {"disk": "ssd"}}).to_string(),
        )]
        .into(),
    );
    pods.create(&PostParams::default(), &stashed).await.unwrap();
    for name in ["big", "ssd"] {
        assert_eq!(scheduled_to(&pods, name).await, B, "{name}");
        wait_phase_running(&pods, name).await;
    }
    // What A's nodes take still goes to A.
    pods.create(
        &PostParams::default(),
        &cpu_pod(
            "to-a",
            "1",
            json!({"nodeSelector": {"kubernetes.io/hostname": A}}),
        ),
    )
    .await
    .unwrap();
    assert_eq!(scheduled_to(&pods, "to-a").await, A);
    wait_phase_running(&pods, "to-a").await;
}
