//! The extender beside a real upper kube-scheduler (configured by the harness, through its
//! config file, to call it) and a real virtual node: fragmentation never reaches the lower
//! cluster, what fits still goes there, the reason shows in FailedScheduling, and a lower
//! change is seen within a second. One pair for every case, to spare the CPU.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::time::{Duration, Instant};

use common::{
    ServedExtender, TIMEOUT, VK, args, cpu_pod, http, scheduled_to, scheduler_extenders,
    start_virtual_node, to_vk, virtual_node_binary, wait_phase_running,
};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tensile_harness::ports::free_port;
use tensile_harness::{ClusterPair, NodeShape, PairOptions, TestNamespace, wait_for};

#[tokio::test]
async fn upper_scheduler_sees_what_really_fits_below() {
    let port = free_port().unwrap();
    let mut options = PairOptions::default();
    options.upper.nodes = 1; // one regular node, 8 CPU
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

    // The extender, in process, on the port the upper scheduler calls.
    let served = ServedExtender::start(&pair, pair.lower_kubeconfig().to_owned(), port).await;
    let app = served.app.clone();
    assert_eq!(http(port, "GET", "/readyz", "").await.0, 200);

    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let _vn = start_virtual_node(&pair, &binary, &upper).await;
    let ns = TestNamespace::create(&upper, "extender").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let pp = PostParams::default();

    // Fragmentation: the virtual node advertises 8 CPU (two 4-CPU nodes), but no lower
    // node takes 6. The pod tolerates the virtual node and may go anywhere: it must run
    // on the regular node.
    pods.create(&pp, &cpu_pod("big", "6", json!({})))
        .await
        .unwrap();
    let node = scheduled_to(&pods, "big").await;
    assert_eq!(node, "upper-node-0", "the 6-CPU pod never lands on {VK}");
    wait_phase_running(&pods, "big").await;

    // What fits below still goes there.
    let to_vk = to_vk();
    pods.create(&pp, &cpu_pod("small", "2", to_vk.clone()))
        .await
        .unwrap();
    assert_eq!(scheduled_to(&pods, "small").await, VK);
    wait_phase_running(&pods, "small").await;

    // Nothing fits: the FailedScheduling event says why.
    pods.create(&pp, &cpu_pod("stuck", "6", to_vk.clone()))
        .await
        .unwrap();
    let events: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    let note = wait_for("FailedScheduling naming the reason", TIMEOUT, || async {
        let list = events.list(&ListParams::default()).await?.items;
        Ok(list
            .into_iter()
            .filter(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("stuck")
                    && e.reason.as_deref() == Some("FailedScheduling")
            })
            .filter_map(|e| e.note)
            .find(|n| n.contains("lower cluster of")))
    })
    .await
    .unwrap();
    assert!(
        note.contains("lower cluster of vk-node: no node fits cpu 6 (largest free 4)"),
        "{note}"
    );
    let stuck = pods.get("stuck").await.unwrap();
    assert!(stuck.spec.unwrap().node_name.is_none());

    // A lower node cordoned is seen within a second.
    let probe = cpu_pod("probe", "1", json!({}));
    let (result, _) = app.extender.filter(&args(&probe, &[VK]));
    assert_eq!(result.node_names.as_deref(), Some(&[VK.to_owned()][..]));
    let lower_nodes: Api<Node> = Api::all(lower.clone());
    let cordon = |on: bool| {
        let lower_nodes = lower_nodes.clone();
        async move {
            for name in ["lower-node-0", "lower-node-1"] {
                lower_nodes
                    .patch(
                        name,
                        &PatchParams::default(),
                        &Patch::Merge(json!({"spec": {"unschedulable": on}})),
                    )
                    .await
                    .unwrap();
            }
        }
    };
    cordon(true).await;
    let cordoned_at = Instant::now();
    let reason = wait_for("the cordon seen", Duration::from_secs(1), || async {
        let (result, _) = app.extender.filter(&args(&probe, &[VK]));
        Ok(result.failed_and_unresolvable_nodes.get(VK).cloned())
    })
    .await
    .unwrap();
    let seen_after = cordoned_at.elapsed();
    eprintln!("lower cordon seen by the extender after {seen_after:?}");
    assert_eq!(
        reason, "lower cluster of vk-node: 0/2 nodes fit: 2 cordoned",
        "seen after {seen_after:?}"
    );
    cordon(false).await;
    wait_for("the uncordon seen", Duration::from_secs(1), || async {
        let (result, _) = app.extender.filter(&args(&probe, &[VK]));
        Ok((result.node_names.as_deref() == Some(&[VK.to_owned()][..])).then_some(()))
    })
    .await
    .unwrap();

    // Over HTTP: a malformed body is a 400 with the Error field; prioritize scores.
    let (status, body) = http(port, "POST", "/filter", "{\"Pod\": {").await;
    assert_eq!(status, 400, "{body}");
    let error: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(
        error["Error"].as_str().unwrap().contains("not extender v1"),
        "{body}"
    );
    let request = serde_json::to_string(&args(&probe, &[VK, "upper-node-0"])).unwrap();
    let (status, body) = http(port, "POST", "/prioritize", &request).await;
    assert_eq!(status, 200, "{body}");
    let scores: serde_json::Value = serde_json::from_str(&body).unwrap();
    // Local first: the regular node scores the most, the virtual node (priority 0) next.
    assert_eq!(scores[1], json!({"Host": "upper-node-0", "Score": 10}));
    assert_eq!(scores[0], json!({"Host": VK, "Score": 9}), "{body}");
    let (status, metrics) = http(port, "GET", "/metrics", "").await;
    assert_eq!(status, 200);
    assert!(
        metrics.contains("tensile_extender_decisions_total{verb=\"filter\",outcome=\"no_fit\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("tensile_extender_request_duration_seconds_bucket"));

    // The 6-CPU pod stayed on the regular node throughout.
    let big = pods.get("big").await.unwrap();
    assert_eq!(big.spec.unwrap().node_name.as_deref(), Some("upper-node-0"));

    served.stop().await;
    ns.delete().await.unwrap();
}
