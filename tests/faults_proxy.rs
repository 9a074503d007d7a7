//! An error storm between virtual-node and an API server (the harness's fault-injecting
//! proxy: 429 with Retry-After, 500, 503 and connection resets for half the requests):
//! virtual-node backs off — its request rate during the storm stays bounded — and once the
//! storm ends everything converges, nothing lost, duplicated or orphaned.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::time::{Duration, Instant};

use common::{TIMEOUT, wait_running};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use tensile_harness::fault_proxy::{Fault, FaultProxy};
use tensile_harness::fixtures::bound_pod;
use tensile_harness::{ClusterPair, TestNamespace, VirtualNodeOptions, invariant};

/// How long the storm lasts.
const STORM: Duration = Duration::from_secs(15);
/// Requests a second virtual-node may send through the storm: far below a hot loop (a
/// retry without backoff reaches thousands a second on loopback).
const BOUNDED_RATE: f64 = 100.0;

/// Runs one storm against the lower (`lower = true`) or upper API server.
async fn storm(lower: bool, node: &str) {
    let pair = ClusterPair::shared().await.unwrap();
    let (upper_client, lower_client) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let target = if lower { &lower_client } else { &upper_client };
    let proxy = FaultProxy::start(target.clone()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = proxy
        .write_kubeconfig(&dir.path().join("proxy.kubeconfig"))
        .unwrap();
    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), node);
    options.args = vec!["--enable-controllers=".into()];
    if lower {
        options.lower_kubeconfig = Some(kubeconfig);
    } else {
        options.upper_kubeconfig = Some(kubeconfig);
    }
    let _vn = common::start_node_with(pair, &options, &upper_client).await;

    let ns = TestNamespace::create(&upper_client, "storm").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper_client.clone(), &ns.name);
    for i in 0..10 {
        let mut pod = bound_pod(&format!("before-{i}"), node);
        pod.metadata.labels = Some([("app".to_owned(), "storm".to_owned())].into());
        upper_pods
            .create(&PostParams::default(), &pod)
            .await
            .unwrap();
    }
    wait_running(&upper_pods, "app=storm", 10).await;

    proxy.set(Fault::Mixed, 50);
    let (received, faulted) = (proxy.received(), proxy.faulted());
    let started = Instant::now();
    for i in 0..20 {
        let mut pod = bound_pod(&format!("during-{i}"), node);
        pod.metadata.labels = Some([("app".to_owned(), "storm".to_owned())].into());
        upper_pods
            .create(&PostParams::default(), &pod)
            .await
            .unwrap();
    }
    tokio::time::sleep(STORM.saturating_sub(started.elapsed())).await;
    proxy.set(Fault::None, 0);
    let seconds = started.elapsed().as_secs_f64();
    let sent = proxy.received() - received;
    let hit = proxy.faulted() - faulted;
    let rate = sent as f64 / seconds;
    let side = if lower { "lower" } else { "upper" };
    println!(
        "{side} storm: {sent} requests in {seconds:.1} s ({rate:.1}/s), {hit} answered with a fault"
    );
    assert!(hit > 0, "the storm hit something");
    assert!(rate < BOUNDED_RATE, "{rate:.1} requests/s during the storm");

    let healed = Instant::now();
    wait_running(&upper_pods, "app=storm", 30).await;
    let (report, _) =
        invariant::converge(&upper_client, &lower_client, node, Some(&ns.name), TIMEOUT)
            .await
            .unwrap();
    println!(
        "after the {side} storm: {report}, converged {:.1} s after it ended",
        healed.elapsed().as_secs_f64()
    );
    assert!(report.holds(), "{report}");
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn an_error_storm_from_the_lower_api_server_is_backed_off_and_survived() {
    storm(true, "vk-storm-lower").await;
}

#[tokio::test]
async fn an_error_storm_from_the_upper_api_server_is_backed_off_and_survived() {
    storm(false, "vk-storm-upper").await;
}
