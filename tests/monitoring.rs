//! What operators watch: the shipped Grafana dashboard queries only metrics that
//! virtual-node exports (the webhook's are checked in `webhook/tests/dashboard.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::path::Path;

use common::{TIMEOUT, start_node};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use tensile_harness::fixtures::{bound_pod, merge};
use tensile_harness::{ClusterPair, TestNamespace, VirtualNode, dashboard, wait_for};

/// Metrics the dashboard queries that a change in flight adds (the HA engineer's
/// `tensile_leader{lease}`): absent until it merges, then exported like the rest. Empty
/// this once they are all exported.
const METRICS_PENDING_MERGE: &[&str] = &["tensile_leader"];

/// Whether virtual-node (rather than the webhook) exports `name`.
fn exported_by_virtual_node(name: &str) -> bool {
    !name.starts_with("tensile_webhook_")
}

/// The metrics exposition of `vn`, without the HTTP head.
async fn exposition(vn: &VirtualNode) -> String {
    let answer = common::metrics_text(vn).await;
    match answer.split_once("\r\n\r\n") {
        Some((_, body)) => body.to_owned(),
        None => answer,
    }
}

/// The dashboard's names are read from a running node. A labelled family appears at its
/// first sample, so the node first reconciles a pod that fails (its ConfigMap is missing)
/// to bring out the error counter.
#[tokio::test]
async fn every_metric_the_dashboard_queries_is_exported() {
    let exprs = dashboard::exprs(&dashboard::path(Path::new(env!("CARGO_MANIFEST_DIR")))).unwrap();
    assert!(!exprs.is_empty(), "the dashboard has no queries");
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-dashboard";
    let vn = start_node(pair, node, &[]).await;
    let upper = pair.upper.client().await.unwrap();
    let ns = TestNamespace::create(&upper, "dashboard").await.unwrap();
    let mut pod = bound_pod("needs-config", node);
    merge_into(
        &mut pod,
        json!({"spec": {"containers": [{"name": "app", "image": "app",
            "envFrom": [{"configMapRef": {"name": "not-there"}}]}]}}),
    );
    Api::<Pod>::namespaced(upper.clone(), &ns.name)
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    let missing = |text: &str| {
        let exported = dashboard::exported_names(text);
        dashboard::missing(
            &exprs,
            &exported,
            exported_by_virtual_node,
            METRICS_PENDING_MERGE,
        )
    };
    let found = wait_for("every dashboard metric exported", TIMEOUT, || async {
        Ok(missing(&exposition(&vn).await).is_empty().then_some(()))
    })
    .await;
    if found.is_err() {
        let text = exposition(&vn).await;
        panic!(
            "the dashboard queries metrics virtual-node does not export: {:?}\n{text}",
            missing(&text)
        );
    }
    ns.delete().await.unwrap();
}

/// `pod` with `patch` merged into it (JSON merge, arrays replaced).
fn merge_into(pod: &mut Pod, patch: Value) {
    let mut value = serde_json::to_value(&*pod).unwrap();
    merge(&mut value, patch);
    *pod = serde_json::from_value(value).unwrap();
}
