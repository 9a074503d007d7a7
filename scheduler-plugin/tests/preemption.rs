//! The extender and the upper kube-scheduler's preemption. kube-scheduler dry-runs
//! preemption with its in-tree plugins only: they see the virtual node's summed capacity,
//! never the lower nodes, so a virtual node the extender refused must not be offered to
//! preemption. A high-priority pod that fits a regular node once a low-priority pod is
//! gone preempts there; one that only the virtual node could take is told preemption does
//! not help, and no mirrored pod is preempted for it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use common::{
    ServedExtender, TIMEOUT, VK, cpu_pod, failed_scheduling, scheduled_to, scheduler_extenders,
    start_virtual_node, to_vk, virtual_node_binary, wait_phase_running,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;
use tensile_harness::fixtures::merge;
use tensile_harness::ports::free_port;
use tensile_harness::{ClusterPair, NodeShape, PairOptions, TestNamespace, wait_for};

const LOW: &str = "extender-test-low";
const HIGH: &str = "extender-test-high";

fn priority_class(name: &str, value: i32) -> PriorityClass {
    serde_json::from_value(json!({"metadata": {"name": name}, "value": value})).unwrap()
}

#[tokio::test]
async fn preemption_happens_on_regular_nodes_never_for_the_virtual_node() {
    let port = free_port().unwrap();
    let mut options = PairOptions::default();
    options.upper.nodes = 1; // upper-node-0, 8 CPU
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
    let binary = binary.await.unwrap();
    let served = ServedExtender::start(&pair, pair.lower_kubeconfig().to_owned(), port).await;
    let upper = pair.upper.client().await.unwrap();
    let _vn = start_virtual_node(&pair, &binary, &upper).await;

    // virtual-node keeps priorityClassName: the lower copies need the classes too.
    let lower = pair.lower.client().await.unwrap();
    let classes = [Api::<PriorityClass>::all(upper.clone()), Api::all(lower)];
    let pp = PostParams::default();
    for api in &classes {
        for (name, value) in [(LOW, 100), (HIGH, 1_000_000)] {
            api.create(&pp, &priority_class(name, value)).await.unwrap();
        }
    }
    let ns = TestNamespace::create(&upper, "preemption").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let events: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    let low = |extra: serde_json::Value| {
        let mut extra = extra;
        merge(
            &mut extra,
            json!({"priorityClassName": LOW, "terminationGracePeriodSeconds": 0}),
        );
        extra
    };

    // upper-node-0 has 1 CPU left; the virtual node advertises 7 of its 8 (two 4-CPU lower
    // nodes, one with a 1-CPU mirrored pod), so in-tree plugins find room for 6 CPU there,
    // but no lower node has it.
    let filler = json!({"nodeSelector": {"kubernetes.io/hostname": "upper-node-0"}});
    pods.create(&pp, &cpu_pod("filler", "7", low(filler)))
        .await
        .unwrap();
    pods.create(&pp, &cpu_pod("mirrored", "1", low(to_vk())))
        .await
        .unwrap();
    wait_phase_running(&pods, "filler").await;
    wait_phase_running(&pods, "mirrored").await;
    assert_eq!(scheduled_to(&pods, "mirrored").await, VK);

    // Fits upper-node-0 once the filler is gone: it preempts there.
    let high = json!({"priorityClassName": HIGH});
    pods.create(&pp, &cpu_pod("vip", "6", high.clone()))
        .await
        .unwrap();
    assert_eq!(
        scheduled_to(&pods, "vip").await,
        "upper-node-0",
        "FailedScheduling of vip: {:?}",
        failed_scheduling(&events, "vip").await
    );
    wait_for("the filler preempted", TIMEOUT, || async {
        Ok(pods.get_opt("filler").await?.is_none().then_some(()))
    })
    .await
    .unwrap();

    // Only the virtual node could take it, and no preemption there can make a lower node
    // take it: preemption is not attempted there, the mirrored pod stays.
    let mut pinned = high;
    merge(&mut pinned, to_vk());
    pods.create(&pp, &cpu_pod("pinned", "6", pinned))
        .await
        .unwrap();
    let note = wait_for(
        "FailedScheduling of pinned after preemption",
        TIMEOUT,
        || async {
            Ok(failed_scheduling(&events, "pinned")
                .await
                .into_iter()
                .find(|n| n.contains("preemption:")))
        },
    )
    .await
    .unwrap();
    assert!(
        note.contains("lower cluster of vk-node: no node fits cpu 6 (largest free 4)"),
        "{note}"
    );
    assert!(
        note.contains("Preemption is not helpful for scheduling")
            && !note.contains("expected at least one victim"),
        "the virtual node is not a preemption candidate: {note}"
    );
    let pinned = pods.get("pinned").await.unwrap();
    assert!(pinned.spec.unwrap().node_name.is_none());
    assert!(
        pinned
            .status
            .and_then(|s| s.nominated_node_name)
            .is_none_or(|n| n.is_empty()),
        "not nominated to the virtual node"
    );
    let mirrored = pods.get("mirrored").await.unwrap();
    assert!(
        mirrored.metadata.deletion_timestamp.is_none(),
        "the mirrored pod is no victim"
    );

    ns.delete().await.unwrap();
    for api in &classes {
        for name in [LOW, HIGH] {
            api.delete(name, &DeleteParams::default()).await.unwrap();
        }
    }
    served.stop().await;
}
