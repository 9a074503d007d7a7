//! Federation: one member's trouble stays its own. Two lower clusters joined by one
//! virtual-node process; member A's lower API server is frozen (SIGSTOP): only A's node
//! goes NotReady, its pods are evicted upstairs by taint-based eviction and run again on
//! member B, which never stops reflecting; A, back, is Ready again, cleans up below what
//! was evicted meanwhile, and takes new pods. Its own test binary: it freezes its
//! clusters' components and shortens the upper node monitor's grace period.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::Duration;

use common::{TIMEOUT, ready_status};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, PostParams};
use nix::sys::signal::Signal;
use serde_json::json;
use tensile_harness::fixtures::{bound_pod, deployment, virtual_node_toleration};
use tensile_harness::{Component, TestNamespace, invariant, node_is_ready, wait_for};

const A: &str = "vk-iso-a";
const B: &str = "vk-iso-b";

/// Running pods of `app` by node.
async fn running_by_node(pods: &Api<Pod>, app: &str) -> BTreeMap<String, usize> {
    let mut by_node = BTreeMap::new();
    let listed = pods
        .list(&ListParams::default().labels(&format!("app={app}")))
        .await
        .unwrap();
    for pod in listed.items {
        let running = pod.metadata.deletion_timestamp.is_none()
            && pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        if running {
            let node = pod.spec.and_then(|s| s.node_name).unwrap_or_default();
            *by_node.entry(node).or_default() += 1;
        }
    }
    by_node
}

#[tokio::test]
async fn a_frozen_member_goes_not_ready_alone_and_its_pods_move_to_the_other() {
    let (pair, b) =
        common::fast_pair_and_second_lower(Ipv4Addr::new(10, 97, 0, 0), "10.247.0.0/16").await;
    let upper = pair.upper.client().await.unwrap();
    let (lower_a, lower_b) = (
        pair.lower.client().await.unwrap(),
        b.client().await.unwrap(),
    );
    let mut vn = pair
        .start_members(
            env!("CARGO_BIN_EXE_virtual-node").as_ref(),
            "tensile-members",
            &[(A, &pair.lower.kubeconfig), (B, &b.kubeconfig)],
            &[],
        )
        .await
        .unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());

    // Four replicas, each leaving an unreachable node 5 s after it is tainted.
    let ns = TestNamespace::create(&upper, "iso").await.unwrap();
    let spec = json!({
        "tolerations": [
            virtual_node_toleration(),
            {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 5},
            {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 5},
        ],
        // Either member may take them; A is preferred, so that A's outage has pods to
        // move.
        "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{
                    "key": "kubernetes.io/hostname", "operator": "In", "values": [A, B]}]}]},
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": {
                "matchExpressions": [{
                    "key": "kubernetes.io/hostname", "operator": "In", "values": [A]}]}}]}},
        "containers": [{"name": "app", "image": "nginx",
            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}],
    });
    let deployments: Api<Deployment> = Api::namespaced(upper.clone(), &ns.name);
    deployments
        .create(&PostParams::default(), &deployment("spread", 4, spec))
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let seen = std::sync::Mutex::new(BTreeMap::new());
    let spread = wait_for("4 pods Running, some on member A", TIMEOUT, || async {
        let by_node = running_by_node(&pods, "spread").await;
        let on_a = by_node.get(A).is_some_and(|n| *n > 0);
        let done = on_a && by_node.values().sum::<usize>() == 4;
        *seen.lock().unwrap() = by_node;
        Ok(done.then_some(()))
    })
    .await;
    if let Err(error) = spread {
        panic!(
            "{error:#}; Running by node: {:?}\n{}",
            seen.lock().unwrap(),
            tensile_harness::process::tail(vn.log(), 40)
        );
    }

    pair.lower
        .signal(Component::ApiServer, Signal::SIGSTOP)
        .unwrap();
    let outage = async {
        wait_for("node A not Ready", Duration::from_secs(90), || async {
            let status = ready_status(&nodes.get(A).await?);
            Ok((status.as_deref() != Some("True")).then_some(()))
        })
        .await?;
        assert_eq!(
            ready_status(&nodes.get(B).await.unwrap()).as_deref(),
            Some("True"),
            "member B stays Ready while A is frozen"
        );
        // Evicted from A, re-created by the ReplicaSet, placed on B and reflected Running
        // there: B's reflection goes on.
        wait_for(
            "the 4 replicas Running on member B",
            Duration::from_secs(120),
            || async {
                let by_node = running_by_node(&pods, "spread").await;
                Ok((by_node.get(B).copied() == Some(4)).then_some(by_node))
            },
        )
        .await
    }
    .await;
    pair.lower
        .signal(Component::ApiServer, Signal::SIGCONT)
        .unwrap();
    if let Err(error) = outage {
        let _ = vn.check_running();
        panic!(
            "{error:#}\n{}",
            tensile_harness::process::tail(vn.log(), 40)
        );
    }

    // A is back: Ready, what was evicted meanwhile is cleaned up below, new pods run.
    wait_for("node A Ready again", Duration::from_secs(90), || async {
        Ok(nodes.get_opt(A).await?.filter(node_is_ready).map(|_| ()))
    })
    .await
    .unwrap();
    for (node, lower) in [(A, &lower_a), (B, &lower_b)] {
        let (report, _) = invariant::converge(&upper, lower, node, Some(&ns.name), TIMEOUT)
            .await
            .unwrap();
        assert!(report.holds(), "{node}: {report}");
    }
    pods.create(&PostParams::default(), &bound_pod("after", A))
        .await
        .unwrap();
    wait_for("a new pod Running on member A", TIMEOUT, || async {
        let pod = pods.get("after").await?;
        Ok((pod.status.and_then(|s| s.phase).as_deref() == Some("Running")).then_some(()))
    })
    .await
    .unwrap();
    vn.check_running().unwrap();
}
