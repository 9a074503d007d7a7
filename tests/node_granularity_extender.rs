//! Node granularity (issue 36) and the scheduler extender: a member shown as one virtual
//! node per zone advertises each zone's summed room upstairs, which a pod can fit without
//! any one lower node of the zone taking it. The extender reads which lower nodes are
//! behind each virtual node (`tensile.dev/lower-node-selector`) and checks the pod against
//! those only: such a pod stays Pending upstairs (kube-scheduler's message says why), where
//! it used to be bound and wait Pending below. Its own test binary (its own pair: the
//! upper kube-scheduler is configured with the extender).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, PostParams};
use serde_json::json;
use tensile::node::groups::{LOWER_SELECTOR_ANNOTATION, MEMBER_NODE_LABEL};
use tensile_harness::fixtures::virtual_node_toleration;
use tensile_harness::ports::free_port;
use tensile_harness::scheduler_extender::{shipped_scheduler_config, start_extender};
use tensile_harness::{
    ClusterPair, NodeShape, PairOptions, TestNamespace, VirtualNodeOptions, wait_for,
};

use common::granularity::{label_nodes, ready_virtual_nodes};
use common::{TIMEOUT, workspace_binary};

/// The member's name (`--nodename`).
const BASE: &str = "vk-gext";
const ZONE: &str = "topology.kubernetes.io/zone";

/// A pod asking `cpu`, for the member's virtual nodes only.
fn pod(name: &str, cpu: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {MEMBER_NODE_LABEL: BASE},
            "tolerations": [virtual_node_toleration()],
            "containers": [{"name": "app", "image": "nginx",
                            "resources": {"requests": {"cpu": cpu}}}],
        },
    }))
    .unwrap()
}

/// Three lower kwok nodes of 4 CPU, two in zone `a`, one in `b`; the member by zone:
/// `vk-gext-a` offers 8 CPU, `vk-gext-b` 4, each annotated with its lower nodes. A 5-CPU
/// pod fits `vk-gext-a`'s sum but no lower node: it stays unbound, kube-scheduler's
/// message naming the extender's reason (largest free 4); a 3-CPU pod is bound and runs.
#[tokio::test]
async fn a_pod_no_lower_node_of_a_zone_takes_stays_pending_upstairs() {
    let port = free_port().unwrap();
    let mut options = PairOptions::default();
    options
        .upper
        .scheduler_config
        .extend(shipped_scheduler_config(&format!("http://127.0.0.1:{port}")).unwrap());
    options.lower.nodes = 3;
    options.lower.node_shape = NodeShape {
        cpu: "4".into(),
        ..NodeShape::default()
    };
    let pair = ClusterPair::start(options).await.unwrap();
    label_nodes(
        &pair.lower.client().await.unwrap(),
        3,
        |i| json!({ZONE: if i < 2 { "a" } else { "b" }}),
    )
    .await;
    let upper = pair.upper.client().await.unwrap();
    let mut vn_options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), BASE);
    vn_options.args = vec!["--node-granularity".into(), format!("label={ZONE}")];
    let mut vn = pair.start_virtual_node(&vn_options).unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    let zones = ready_virtual_nodes(&mut vn, &nodes, BASE, "2 Ready virtual nodes", |r| {
        r.len() == 2
    })
    .await;
    let selector = |name: &str| {
        zones[name]
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(LOWER_SELECTOR_ANNOTATION))
            .cloned()
    };
    assert_eq!(
        selector("vk-gext-a").as_deref(),
        Some("topology.kubernetes.io/zone=a")
    );
    assert_eq!(
        selector("vk-gext-b").as_deref(),
        Some("topology.kubernetes.io/zone=b")
    );
    let _extender = start_extender(
        &pair,
        &workspace_binary("tensile-scheduler-extender"),
        "gran-extender",
        port,
        &[(BASE.to_owned(), pair.lower_kubeconfig())],
    )
    .await
    .unwrap();

    let ns = TestNamespace::create(&upper, "gext").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    pods.create(&PostParams::default(), &pod("wide", "5"))
        .await
        .unwrap();
    // kube-scheduler's first attempt may meet a virtual node still tainted not-ready by
    // the node lifecycle controller: wait for the attempt that reaches the extender.
    let reason = "lower cluster of vk-gext-a: no node fits cpu 5 (largest free 4)";
    let last = std::sync::Mutex::new(String::new());
    let refused = wait_for("the 5-CPU pod refused by the extender", TIMEOUT, || async {
        let pod = pods.get("wide").await?;
        let bound = pod.spec.as_ref().and_then(|s| s.node_name.clone());
        assert_eq!(
            bound, None,
            "bound to a zone none of whose lower nodes takes it"
        );
        let message = pod
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .into_iter()
            .find(|c| c.type_ == "PodScheduled" && c.status == "False")
            .and_then(|c| c.message)
            .unwrap_or_default();
        let found = message.contains(reason).then_some(());
        *last.lock().unwrap() = message;
        Ok(found)
    })
    .await;
    assert!(
        refused.is_ok(),
        "{refused:?}; last message: {}",
        last.lock().unwrap()
    );

    pods.create(&PostParams::default(), &pod("fits", "3"))
        .await
        .unwrap();
    wait_for("the 3-CPU pod Running", TIMEOUT, || async {
        let pod = pods.get("fits").await?;
        let phase = pod.status.and_then(|s| s.phase);
        Ok((phase.as_deref() == Some("Running")).then_some(()))
    })
    .await
    .unwrap();
    let wide = pods.get("wide").await.unwrap();
    assert_eq!(wide.spec.and_then(|s| s.node_name), None, "still unbound");
    ns.delete().await.unwrap();
}
