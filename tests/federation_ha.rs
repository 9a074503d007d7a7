//! High availability of a federated process: two virtual-node processes with
//! `--leader-elect` serving one members namespace of two members. One Lease covers every
//! member of the process. Its own test binary, so that its two processes and their
//! members' drains do not load the shared pair under the single-node HA tests' timings.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::ha::{
    FAST_LEASE, LEASE_NAMESPACE, create_pods, holder, leader_series, lease_name, reachable,
    until_held_by,
};
use common::{TIMEOUT, lower_writes, metric, running};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams};
use tensile_harness::virtual_node::join_member;
use tensile_harness::{ClusterPair, TestNamespace, invariant, wait_for};

/// Federated (`--members-namespace`) with `--leader-elect`: one Lease covers every member.
/// The standby runs no member and writes nothing below; the leader SIGKILLed, the standby
/// takes the Lease and runs both members: both Nodes are kept, pods created after the kill
/// run on both, and every upper pod has exactly its one lower pod.
#[tokio::test]
async fn a_killed_leader_of_two_members_is_replaced_by_the_standby_for_both() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let binary = std::path::Path::new(env!("CARGO_BIN_EXE_virtual-node"));
    let members = TestNamespace::create(&upper, "ha-members").await.unwrap();
    let member_nodes = ["vk-ham-a", "vk-ham-b"];
    for node in member_nodes {
        join_member(
            binary,
            &pair.upper.kubeconfig,
            &pair.lower.kubeconfig,
            node,
            &members.name,
        )
        .await
        .unwrap();
    }
    // Both processes name the same Lease (by default each would name its own).
    let lease = "vk-ham";
    let args = |identity: &str| -> Vec<String> {
        let mut args = vec![
            "--leader-elect".to_owned(),
            format!("--leader-elect-identity={identity}"),
            format!("--leader-elect-resource-name={}", lease_name(lease)),
        ];
        args.extend(FAST_LEASE.iter().map(ToString::to_string));
        args
    };
    let mut leader = pair
        .serve_members(binary, "vk-ham-1", &members.name, &member_nodes, &args("a"))
        .await
        .unwrap();
    let leases: Api<Lease> = Api::namespaced(upper.clone(), LEASE_NAMESPACE);
    assert_eq!(holder(&leases, lease).await.as_deref(), Some("a"));
    let mut standby = pair
        .serve_members(binary, "vk-ham-2", &members.name, &member_nodes, &args("b"))
        .await
        .unwrap();
    // A federated standby starts no member until it leads: it is up once it serves.
    wait_for("the standby serving", TIMEOUT, || async {
        Ok(reachable(standby.metrics_port, "/healthz")
            .await
            .then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(metric(&standby, &leader_series(lease)).await, 0);
    let standby_writes = lower_writes(&standby).await;
    let nodes: Api<Node> = Api::all(upper.clone());
    let mut node_uids = BTreeMap::new();
    for node in member_nodes {
        node_uids.insert(node, nodes.get(node).await.unwrap().uid());
    }

    let ns = TestNamespace::create(&upper, "ha-members-pods")
        .await
        .unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let all_running = async |n: usize| {
        wait_for(&format!("{n} upper pods Running"), TIMEOUT, || async {
            let pods = upper_pods.list(&ListParams::default()).await?.items;
            Ok((pods.len() == n && pods.iter().all(running)).then_some(()))
        })
        .await
        .unwrap();
    };
    for node in member_nodes {
        create_pods(
            &upper_pods,
            node,
            (0..10).map(|i| format!("{node}-before-{i}")),
        )
        .await;
    }
    all_running(20).await;
    assert_eq!(
        lower_writes(&standby).await,
        standby_writes,
        "the standby wrote below"
    );

    let killed = Instant::now();
    leader.kill().unwrap();
    let took_over = until_held_by(&leases, lease, "b", killed).await;
    println!(
        "after SIGKILL of the leader of two members: lease taken in {} ms",
        took_over.as_millis()
    );
    for node in member_nodes {
        create_pods(
            &upper_pods,
            node,
            (0..10).map(|i| format!("{node}-after-{i}")),
        )
        .await;
    }
    all_running(40).await;
    for node in member_nodes {
        assert_eq!(
            nodes.get(node).await.unwrap().uid(),
            node_uids[node],
            "{node} is kept across the takeover"
        );
        let (report, _) = invariant::converge(&upper, &lower, node, Some(&ns.name), TIMEOUT)
            .await
            .unwrap();
        assert!(report.holds(), "{node}: {report}");
    }
    assert_eq!(metric(&standby, &leader_series(lease)).await, 1);

    // Clean up: the pods gone, the members leave (their Nodes deleted).
    ns.delete().await.unwrap();
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    for node in member_nodes {
        secrets
            .delete(node, &DeleteParams::default())
            .await
            .unwrap();
    }
    wait_for("both members left", Duration::from_secs(180), || async {
        let mut left = true;
        for node in member_nodes {
            left &= nodes.get_opt(node).await?.is_none();
        }
        Ok(left.then_some(()))
    })
    .await
    .unwrap();
    standby.stop().unwrap();
    members.delete().await.unwrap();
}
