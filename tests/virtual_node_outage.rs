//! When the lower API server stops answering, the virtual node stops renewing its Lease
//! and goes NotReady through the node lifecycle controller; when it answers again, the
//! node is Ready again. Its own test binary: it freezes its lower cluster.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::time::Duration;

use common::start_node;
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use nix::sys::signal::Signal;
use tensile_harness::{ClusterPair, Component, PairOptions, wait_for};

fn ready_status(node: &Node) -> Option<String> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.status.clone())
}

#[tokio::test]
async fn node_goes_not_ready_while_the_lower_cluster_is_silent_and_recovers() {
    let mut options = PairOptions::default();
    // A short grace period so the test takes seconds, not minutes; the lease is renewed
    // every 10 s, so 20 s still leaves a missed renewal or two of slack.
    options.upper.controller_manager_args = vec![
        "--node-monitor-grace-period=20s".into(),
        "--node-monitor-period=1s".into(),
    ];
    let pair = ClusterPair::start(options).await.unwrap();
    let _vn = start_node(&pair, "vk-outage", &[]).await;
    let nodes: Api<Node> = Api::all(pair.upper.client().await.unwrap());

    pair.lower
        .signal(Component::ApiServer, Signal::SIGSTOP)
        .unwrap();
    let went = wait_for(
        "the node to leave Ready",
        Duration::from_secs(90),
        || async {
            let status = ready_status(&nodes.get("vk-outage").await?);
            Ok((status.as_deref() != Some("True")).then_some(status))
        },
    )
    .await;
    pair.lower
        .signal(Component::ApiServer, Signal::SIGCONT)
        .unwrap();
    assert_eq!(went.unwrap().as_deref(), Some("Unknown"));

    wait_for(
        "the node to be Ready again",
        Duration::from_secs(90),
        || async {
            let status = ready_status(&nodes.get("vk-outage").await?);
            Ok((status.as_deref() == Some("True")).then_some(()))
        },
    )
    .await
    .unwrap();
}
