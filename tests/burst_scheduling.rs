//! Bursting, local first: the upper kube-scheduler configured with the scheduler extender
//! exactly as deploy/scheduler-extender/kube-scheduler-config.yaml ships it. Pods that
//! tolerate the virtual nodes' taint fill the regular nodes first, then the virtual nodes
//! in the order of their `tensile.dev/burst-priority` label; an eager pod goes by room.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams};
use serde_json::json;
use tensile_harness::fixtures::virtual_node_toleration;
use tensile_harness::ports::free_port;
use tensile_harness::scheduler_extender::{shipped_scheduler_config, start_extender};
use tensile_harness::{
    ClusterOptions, ClusterPair, NodeShape, PairOptions, TestNamespace, VirtualNodeOptions,
    node_is_schedulable, wait_for,
};

use common::{TIMEOUT, kubectl, start_node_with};

const VK_1: &str = "vk-burst-1";
const VK_2: &str = "vk-burst-2";
const REGULAR: &str = "regular";
const APP: &str = "burst";

/// Where the app's pods are bound: node (regular nodes counted together) → count, once
/// all `replicas` are bound.
async fn placement(pods: &Api<Pod>, replicas: usize) -> BTreeMap<String, usize> {
    wait_for(&format!("{replicas} pods bound"), TIMEOUT, || async {
        let list = pods
            .list(&ListParams::default().labels("app=burst"))
            .await?;
        let bound: Vec<String> = list
            .items
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| p.spec.as_ref()?.node_name.clone())
            .collect();
        if bound.len() != replicas {
            return Ok(None);
        }
        let mut counts = BTreeMap::new();
        for node in bound {
            let node = if node.starts_with("vk-") {
                node
            } else {
                REGULAR.to_owned()
            };
            *counts.entry(node).or_insert(0) += 1;
        }
        Ok(Some(counts))
    })
    .await
    .unwrap()
}

fn counts(regular: usize, vk1: usize, vk2: usize) -> BTreeMap<String, usize> {
    [(REGULAR, regular), (VK_1, vk1), (VK_2, vk2)]
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(k, n)| (k.to_owned(), n))
        .collect()
}

/// Two regular upper nodes of 8 CPU; vk-burst-1 (burst priority 1) over a lower cluster
/// with one 6-CPU node, vk-burst-2 (priority 2) over one with an 8-CPU node. One-CPU pods
/// that tolerate the virtual nodes: 8 stay on the regular nodes although both virtual
/// nodes look emptier; at 20, the regular nodes are full (16) and 4 go to priority 1; at
/// 26, priority 1 is full (6) and the rest go to priority 2. An eager pod, meanwhile,
/// goes where kube-scheduler's own scoring puts it: the emptiest node, a virtual one.
#[tokio::test]
async fn regular_nodes_first_then_members_by_burst_priority() {
    let port = free_port().unwrap();
    let mut options = PairOptions::default();
    options.upper.nodes = 2;
    options
        .upper
        .scheduler_config
        .extend(shipped_scheduler_config(&format!("http://127.0.0.1:{port}")).unwrap());
    options.lower.nodes = 1;
    options.lower.node_shape = NodeShape {
        cpu: "6".into(),
        ..NodeShape::default()
    };
    let pair = ClusterPair::start(options).await.unwrap();
    let lower_b = pair
        .start_cluster(ClusterOptions::new(
            "lower-b",
            1,
            (Ipv4Addr::new(10, 131, 0, 0), 16),
            "10.231.0.0/16",
        ))
        .await
        .unwrap();
    let _extender = start_extender(
        &pair,
        &common::workspace_binary("tensile-scheduler-extender"),
        "burst-extender",
        port,
        &[
            (VK_1.to_owned(), pair.lower_kubeconfig()),
            (VK_2.to_owned(), &lower_b.kubeconfig),
        ],
    )
    .await
    .unwrap();
    let upper = pair.upper.client().await.unwrap();
    let binary = env!("CARGO_BIN_EXE_virtual-node");
    let upper_kubeconfig = pair.upper_kubeconfig();
    // Each node's burst priority from its flag: virtual-node writes the node label.
    let mut options = VirtualNodeOptions::new(binary, VK_1);
    options.args = vec!["--burst-priority".into(), "1".into()];
    let _vk1 = start_node_with(&pair, &options, &upper).await;
    let mut options = VirtualNodeOptions::new(binary, VK_2);
    options.lower_kubeconfig = Some(lower_b.kubeconfig.clone());
    options.args = vec!["--burst-priority".into(), "2".into()];
    let _vk2 = start_node_with(&pair, &options, &upper).await;
    let nodes: Api<Node> = Api::all(upper.clone());
    wait_for("both virtual nodes schedulable", TIMEOUT, || async {
        let mut ready = true;
        for node in [VK_1, VK_2] {
            ready &= nodes
                .get_opt(node)
                .await?
                .is_some_and(|n| node_is_schedulable(&n));
        }
        Ok(ready.then_some(()))
    })
    .await
    .unwrap();

    let ns = TestNamespace::create(&upper, "burst").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let deployment = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": APP, "namespace": ns.name},
        "spec": {
            "replicas": 8,
            "selector": {"matchLabels": {"app": APP}},
            "template": {
                "metadata": {"labels": {"app": APP}},
                "spec": {
                    "tolerations": [virtual_node_toleration()],
                    "containers": [{"name": "app", "image": "nginx",
                                    "resources": {"requests": {"cpu": "1"}}}],
                },
            },
        },
    });
    let out = kubectl(
        &pair,
        upper_kubeconfig,
        &["apply", "-f", "-"],
        deployment.to_string().as_bytes(),
    )
    .await;
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        placement(&pods, 8).await,
        counts(8, 0, 0),
        "room on the regular nodes: nothing bursts"
    );

    // An eager pod goes by room: both virtual nodes are emptier than the regular ones.
    let eager: Pod = serde_json::from_value(json!({
        "metadata": {"name": "eager", "annotations": {"tensile.dev/burst": "eager"}},
        "spec": {
            "tolerations": [virtual_node_toleration()],
            "containers": [{"name": "app", "image": "nginx",
                            "resources": {"requests": {"cpu": "1"}}}],
        },
    }))
    .unwrap();
    pods.create(&Default::default(), &eager).await.unwrap();
    let node = wait_for("the eager pod bound", TIMEOUT, || async {
        let pod = pods.get("eager").await?;
        Ok(common::descheduler::node_of(&pod).map(str::to_owned))
    })
    .await
    .unwrap();
    assert_eq!(node, VK_2, "the emptiest node");
    pods.delete("eager", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    wait_for("the eager pod gone", TIMEOUT, || async {
        Ok(pods.get_opt("eager").await?.is_none().then_some(()))
    })
    .await
    .unwrap();

    for (replicas, want, why) in [
        (20, counts(16, 4, 0), "regular nodes full, then priority 1"),
        (26, counts(16, 6, 4), "priority 1 full, then priority 2"),
    ] {
        let out = kubectl(
            &pair,
            upper_kubeconfig,
            &[
                "scale",
                "-n",
                &ns.name,
                "deployment",
                APP,
                &format!("--replicas={replicas}"),
            ],
            b"",
        )
        .await;
        assert!(out.status.success(), "{out:?}");
        assert_eq!(placement(&pods, replicas).await, want, "{why}");
    }
    ns.delete().await.unwrap();
}
