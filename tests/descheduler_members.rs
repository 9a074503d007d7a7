//! The descheduler across the members of one federated virtual-node process: a pod that
//! member A's lower scheduler cannot place is evicted from A's node and its replacement
//! runs on member B. Its own test binary: it needs its own pair and a second lower cluster.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::net::Ipv4Addr;

use common::descheduler::{
    annotation, big_spec, events, node_of, not_in_hostnames, refused_below, set_unschedulable,
    shipped_rbac_kubeconfig, start_descheduler, start_webhook, watch_for_mark,
};
use common::{TIMEOUT, running};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, PostParams};
use tensile_harness::fixtures::{deployment, with_template_label};
use tensile_harness::{
    ClusterOptions, ClusterPair, NodeShape, PairOptions, TestNamespace, invariant, wait_for,
};

const A: &str = "vk-a";
const B: &str = "vk-b";

#[tokio::test]
async fn a_pod_stuck_pending_in_member_a_is_moved_to_member_b() {
    let mut options = PairOptions::default();
    // No regular upper node: the virtual nodes are the only places.
    options.upper.nodes = 0;
    // A advertises 8 CPU (the sum) but no node of it fits 6; B's one node does.
    options.lower.nodes = 2;
    options.lower.node_shape = NodeShape {
        cpu: "4".into(),
        ..NodeShape::default()
    };
    let pair = ClusterPair::start(options).await.unwrap();
    let mut lower_b = ClusterOptions::new(
        "lower-b",
        1,
        (Ipv4Addr::new(10, 98, 0, 0), 16),
        "10.245.0.0/16",
    );
    lower_b.node_shape = NodeShape {
        cpu: "16".into(),
        ..NodeShape::default()
    };
    let b = pair.start_cluster(lower_b).await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let (below_a, below_b) = (
        pair.lower.client().await.unwrap(),
        b.client().await.unwrap(),
    );

    let _webhook = start_webhook(&pair).await;
    let kubeconfig = shipped_rbac_kubeconfig(&pair).await;
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
    // The first placement must be A's, where the pod cannot run: keep B closed until then.
    set_unschedulable(&nodes, B, true).await;

    let ns = TestNamespace::create(&upper, "desched-members")
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let deployments: Api<Deployment> = Api::namespaced(upper.clone(), &ns.name);
    deployments
        .create(
            &PostParams::default(),
            &with_template_label(deployment("big", 1, big_spec("6")), "virtual-pod", "true"),
        )
        .await
        .unwrap();
    let stuck = wait_for("big refused below in member A", TIMEOUT, || async {
        let list = pods
            .list(&ListParams::default().labels("app=big"))
            .await?
            .items;
        Ok(list
            .into_iter()
            .find(|p| node_of(p) == Some(A) && refused_below(p)))
    })
    .await
    .unwrap();
    let stuck_name = stuck.metadata.name.clone().unwrap();

    let marked = watch_for_mark(&pods, &stuck_name);
    set_unschedulable(&nodes, B, false).await;
    let desched = start_descheduler(&pair, &kubeconfig, "desched", &[]);
    let moved = wait_for("big Running on member B", TIMEOUT, || async {
        let list = pods
            .list(&ListParams::default().labels("app=big"))
            .await?
            .items;
        Ok(list
            .into_iter()
            .find(|p| node_of(p) == Some(B) && running(p)))
    })
    .await;
    let replacement = moved.unwrap_or_else(|error| {
        panic!(
            "{error:#}\n--- descheduler:\n{}\n--- virtual-node:\n{}",
            desched.log_text(),
            tensile_harness::process::tail(vn.log(), 40)
        )
    });
    assert_ne!(replacement.metadata.uid, stuck.metadata.uid);
    assert_eq!(
        not_in_hostnames(&replacement),
        [vec![A.to_owned()]],
        "the webhook keeps the replacement off member A's node"
    );
    let marked = tokio::time::timeout(TIMEOUT, marked)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(annotation(&marked, "unschedulable-node"), Some(A));
    let event_api: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    let rescheduled = events(&event_api, "Rescheduled").await;
    assert!(
        rescheduled.iter().any(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(stuck_name.as_str())
                && e.note
                    .as_deref()
                    .is_some_and(|n| n.contains(A) && n.contains("Unschedulable"))
        }),
        "{rescheduled:?}"
    );

    // Member A let go of it: nothing of it left below, Pending or otherwise.
    for (node, lower) in [(A, &below_a), (B, &below_b)] {
        let (report, _) = invariant::converge(&upper, lower, node, Some(&ns.name), TIMEOUT)
            .await
            .unwrap();
        assert!(report.holds(), "{node}: {report}");
    }
    let below_in_a: Api<Pod> = Api::namespaced(below_a.clone(), &ns.name);
    wait_for("nothing of big left below in member A", TIMEOUT, || async {
        Ok(below_in_a
            .list(&ListParams::default())
            .await?
            .items
            .is_empty()
            .then_some(()))
    })
    .await
    .unwrap();
    let in_b = Api::<Pod>::namespaced(below_b.clone(), &ns.name)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    assert_eq!(in_b.len(), 1, "{:?}", common::names(&in_b));
    assert_eq!(
        in_b[0].status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Running")
    );
    vn.check_running().unwrap();
    ns.delete().await.unwrap();
}
