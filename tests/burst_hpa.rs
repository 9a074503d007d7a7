//! Issue #35's loop, end to end: an HPA on CPU over a Deployment that may burst. Load
//! rises, it scales out: the regular nodes fill, then member 1, then member 2; load falls,
//! it scales in: member 2's pods go first, then member 1's, the regular nodes' last; and
//! nothing is lost, orphaned or duplicated. Real API servers, the upper kube-scheduler with
//! the extender as shipped, metrics-servers upstairs and below (usage simulated by kwok,
//! see `tensile_harness::metrics_server`), a fast HPA controller. Its own test binary.
//!
//! Deterministic steps: the simulated usage is per pod (a node annotation), not a total
//! spread over the replicas, so at high usage the HPA would scale to its maximum and at low
//! usage to its minimum whatever the step. The load gives the direction; the HPA's bounds
//! (`maxReplicas` on the way out, `minReplicas` on the way in) give each step its exact
//! count. The HPA still makes every decision: the test never writes `spec.replicas`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::time::Duration;

use common::{TIMEOUT, start_node_with};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tensile_harness::fixtures::{deployment, virtual_node_toleration};
use tensile_harness::metrics_server::set_node_usage;
use tensile_harness::ports::free_port;
use tensile_harness::scheduler_extender::{hpa_bursting, start_extender};
use tensile_harness::{
    ClusterPair, PairOptions, TestNamespace, VirtualNodeOptions, invariant, wait_for,
};

const VK_1: &str = "vk-hpa-1";
const VK_2: &str = "vk-hpa-2";
const APP: &str = "web";
/// Usage goes through two metrics-servers (10 s resolution each) and a virtual node.
const METRICS_TIMEOUT: Duration = Duration::from_secs(240);
/// 90 % of the 1-CPU request against a 50 % target: the HPA scales out.
const HIGH: &str = "900m";
/// 10 %: it scales in.
const LOW: &str = "100m";
const DELETION_COST: &str = "controller.kubernetes.io/pod-deletion-cost";

/// Pods per node class: (regular, vk priority 1, vk priority 2).
type Placement = (usize, usize, usize);

/// Where the app's live pods are bound, and whether every one of them is bound.
fn placement(pods: &[Pod]) -> (Placement, usize) {
    let mut placement = (0, 0, 0);
    let mut live = 0;
    for pod in pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
    {
        live += 1;
        match pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
            Some(VK_1) => placement.1 += 1,
            Some(VK_2) => placement.2 += 1,
            Some(_) => placement.0 += 1,
            None => {}
        }
    }
    (placement, live)
}

/// The expected deletion cost of a pod on `node`: `-(1 + priority)` on virtual nodes.
fn expected_cost(node: &str) -> Option<&'static str> {
    match node {
        VK_1 => Some("-2"),
        VK_2 => Some("-3"),
        _ => None,
    }
}

/// Waits until the HPA has scaled the Deployment to `want`'s total, every pod is Ready,
/// none is terminating, pods sit as `want` says and the virtual nodes' pods carry their
/// deletion cost (so the next scale-in is decided by it).
async fn settled(client: &Client, ns: &str, want: Placement, why: &str) {
    let total = want.0 + want.1 + want.2;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(client.clone(), ns);
    let last = std::sync::Mutex::new(String::new());
    let result = wait_for(
        &format!("{why}: {total} replicas placed {want:?}"),
        METRICS_TIMEOUT,
        || async {
            let d = deployments.get(APP).await?;
            let replicas = d.spec.and_then(|s| s.replicas).unwrap_or(0);
            let ready = d.status.and_then(|s| s.ready_replicas).unwrap_or(0);
            let list = pods
                .list(&ListParams::default().labels(&format!("app={APP}")))
                .await?
                .items;
            let (placed, live) = placement(&list);
            let costs = list.iter().all(|p| {
                let node = p.spec.as_ref().and_then(|s| s.node_name.as_deref());
                let cost = p
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(DELETION_COST))
                    .map(String::as_str);
                node.and_then(expected_cost).is_none_or(|c| cost == Some(c))
            });
            let utilization = hpas
                .get(APP)
                .await?
                .status
                .and_then(|s| s.current_metrics)
                .and_then(|m| m.into_iter().next())
                .and_then(|m| m.resource)
                .and_then(|r| r.current.average_utilization);
            *last.lock().unwrap() = format!(
                "spec.replicas {replicas}, ready {ready}, pods {} ({live} live) placed {placed:?}, \
                 costs set {costs}, HPA utilization {utilization:?}",
                list.len()
            );
            let done = usize::try_from(replicas) == Ok(total)
                && usize::try_from(ready) == Ok(total)
                && list.len() == total
                && live == total
                && placed == want
                && costs;
            Ok(done.then_some(()))
        },
    )
    .await;
    let last = last.lock().unwrap().clone();
    if let Err(error) = result {
        panic!("{error:#}; last: {last}");
    }
    println!("{why}: {last}");
}

/// Two regular upper nodes of 4 CPU (8 one-CPU pods); vk-hpa-1 (burst priority 1, share
/// 3 CPU) and vk-hpa-2 (priority 2, share 3 CPU) over one lower cluster with room for
/// both. The HPA (CPU, 50 %) scales 2 → 10 → 13 as load rises: 8 regular + 2 on member
/// 1, then 8 + 3 + 2; and 13 → 11 → 8 → 2 as it falls: member 2's pods go first (8 + 3 +
/// 0), then member 1's (8 + 0 + 0), the regular nodes' last.
#[tokio::test]
async fn an_hpa_bursts_local_first_and_scales_in_burst_first() {
    let port = free_port().unwrap();
    let mut options = PairOptions::default();
    hpa_bursting(&mut options, port).unwrap();
    options.lower.nodes = 2;
    let pair = ClusterPair::start(options).await.unwrap();
    let _extender = start_extender(
        &pair,
        &common::workspace_binary("tensile-scheduler-extender"),
        "hpa-extender",
        port,
        &[
            (VK_1.to_owned(), pair.lower_kubeconfig()),
            (VK_2.to_owned(), pair.lower_kubeconfig()),
        ],
    )
    .await
    .unwrap();
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let binary = env!("CARGO_BIN_EXE_virtual-node");
    let mut vks = Vec::new();
    for (node, priority) in [(VK_1, "1"), (VK_2, "2")] {
        let mut options = VirtualNodeOptions::new(binary, node);
        options.args = ["--burst-priority", priority, "--share", "cpu=3"]
            .map(String::from)
            .to_vec();
        vks.push(start_node_with(&pair, &options, &upper).await);
    }

    let ns = TestNamespace::create(&upper, "hpa").await.unwrap();
    let set_usage = async |cpu: &str| {
        assert_eq!(
            set_node_usage(&upper, cpu).await.unwrap(),
            2,
            "upper kwok nodes"
        );
        assert_eq!(set_node_usage(&lower, cpu).await.unwrap(), 2, "lower nodes");
    };
    set_usage(LOW).await;
    let spec = json!({
        "tolerations": [virtual_node_toleration()],
        "containers": [{"name": "app", "image": "nginx",
            "resources": {"requests": {"cpu": "1", "memory": "64Mi"}}}],
    });
    let deployments: Api<Deployment> = Api::namespaced(upper.clone(), &ns.name);
    deployments
        .create(&PostParams::default(), &deployment(APP, 2, spec))
        .await
        .unwrap();
    let hpa: HorizontalPodAutoscaler = serde_json::from_value(json!({
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": APP},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": APP},
            "minReplicas": 2, "maxReplicas": 2,
            "metrics": [{"type": "Resource", "resource": {"name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": 50}}}],
        },
    }))
    .unwrap();
    let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(upper.clone(), &ns.name);
    hpas.create(&PostParams::default(), &hpa).await.unwrap();
    wait_for(
        "the HPA to see the pods' usage (10 %)",
        METRICS_TIMEOUT,
        || async {
            let utilization = hpas
                .get(APP)
                .await?
                .status
                .and_then(|s| s.current_metrics)
                .and_then(|m| m.into_iter().next())
                .and_then(|m| m.resource)
                .and_then(|r| r.current.average_utilization);
            Ok(utilization.filter(|u| *u <= 20).map(|_| ()))
        },
    )
    .await
    .unwrap();
    settled(&upper, &ns.name, (2, 0, 0), "low load").await;
    let bounds = async |min: i32, max: i32| {
        hpas.patch(
            APP,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"minReplicas": min, "maxReplicas": max}})),
        )
        .await
        .unwrap();
    };

    // Load rises.
    set_usage(HIGH).await;
    bounds(2, 10).await;
    settled(
        &upper,
        &ns.name,
        (8, 2, 0),
        "scale-out to 10: regular full, then member 1",
    )
    .await;
    bounds(2, 13).await;
    settled(
        &upper,
        &ns.name,
        (8, 3, 2),
        "scale-out to 13: member 1 full, then member 2",
    )
    .await;
    for vk in [VK_1, VK_2] {
        let (report, _) = invariant::converge(&upper, &lower, vk, Some(&ns.name), TIMEOUT)
            .await
            .unwrap();
        assert!(report.holds(), "{vk} after the scale-out: {report}");
    }

    // Load falls: the floor first (the HPA keeps 13 at high load), then the usage.
    bounds(11, 13).await;
    set_usage(LOW).await;
    settled(
        &upper,
        &ns.name,
        (8, 3, 0),
        "scale-in to 11: member 2's pods first",
    )
    .await;
    bounds(8, 13).await;
    settled(
        &upper,
        &ns.name,
        (8, 0, 0),
        "scale-in to 8: then member 1's",
    )
    .await;
    bounds(2, 13).await;
    settled(
        &upper,
        &ns.name,
        (2, 0, 0),
        "scale-in to 2: the regular nodes' last",
    )
    .await;

    // Nothing lost, orphaned or duplicated; no lower pod left behind.
    for vk in [VK_1, VK_2] {
        let (report, _) = invariant::converge(&upper, &lower, vk, Some(&ns.name), TIMEOUT)
            .await
            .unwrap();
        assert!(report.holds(), "{vk} after the scale-in: {report}");
    }
    let lower_pods: Api<Pod> = Api::all(lower.clone());
    wait_for("no lower pod left", TIMEOUT, || async {
        let left = lower_pods
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|p| p.metadata.namespace.as_deref() != Some("kube-system"))
            .count();
        Ok((left == 0).then_some(()))
    })
    .await
    .unwrap();
    for vk in &mut vks {
        vk.check_running().unwrap();
    }
    ns.delete().await.unwrap();
}
