//! What operators watch: the shipped Grafana dashboard queries only metrics that
//! virtual-node exports (the webhook's are checked in `webhook/tests/dashboard.rs`), and
//! every JSON log line about a pod names it (`object`) and the cluster (`cluster`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::path::Path;

use common::{TIMEOUT, start_node, wait_gone, wait_running};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};
use tensile_harness::fixtures::{bound_pod, merge};
use tensile_harness::{ClusterPair, TestNamespace, VirtualNode, dashboard, wait_for};

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
        dashboard::missing(&exprs, &exported, exported_by_virtual_node, &[])
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

/// Why a JSON log line does not name its object and cluster in top-level (flattened)
/// fields: `object` as the pod's `namespace/name`, or another object with its `kind` (what
/// a line is about while working on the pod, such as a dependency), and `cluster` as
/// `upper` or `lower`; `None` when it does.
fn unnamed(event: &Value, pod: &str) -> Option<String> {
    let object = event.get("object").and_then(Value::as_str);
    let kind = event.get("kind").and_then(Value::as_str);
    let cluster = event.get("cluster").and_then(Value::as_str);
    match (object, kind, cluster) {
        (Some(object), _, Some("upper" | "lower")) if object == pod => None,
        (Some(_), Some(_), Some("upper" | "lower")) => None,
        _ => Some(format!(
            "object={object:?} kind={kind:?} cluster={cluster:?}"
        )),
    }
}

#[test]
fn log_lines_without_object_or_cluster_are_told() {
    let cases = [
        (r#"{"object":"ns/web","cluster":"lower"}"#, true),
        (
            r#"{"object":"ns/web","kind":"Pod","cluster":"upper"}"#,
            true,
        ),
        (
            r#"{"object":"ns","kind":"Namespace","cluster":"lower"}"#,
            true,
        ),
        (r#"{"object":"ns/web-config","cluster":"upper"}"#, false),
        (r#"{"object":"ns/web","cluster":"middle"}"#, false),
        (r#"{"object":"ns/web"}"#, false),
        (r#"{"cluster":"upper","spans":[{"pod":"ns/web"}]}"#, false),
        (r#"{"pod":"ns/web","cluster":"upper"}"#, false),
    ];
    for (line, named) in cases {
        let event: Value = serde_json::from_str(line).unwrap();
        assert_eq!(unnamed(&event, "ns/web").is_none(), named, "{line}");
    }
}

/// One pod through its life (mirrored, Running, deleted) on a node logging JSON at debug:
/// every line that mentions the pod's `namespace/name` anywhere (message, fields, spans)
/// carries `object` and `cluster` as top-level fields, so a log collector can select a
/// pod's lines without parsing messages.
#[tokio::test]
async fn json_log_lines_about_a_pod_name_it_and_the_cluster() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-json-logs";
    let vn = start_node(
        pair,
        node,
        &["--log-format=json", "--log-level=info,tensile=debug"],
    )
    .await;
    let upper = pair.upper.client().await.unwrap();
    let ns = TestNamespace::create(&upper, "json-logs").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    pods.create(&PostParams::default(), &bound_pod("web", node))
        .await
        .unwrap();
    wait_running(&pods, "app=web", 1).await;
    pods.delete("web", &DeleteParams::default()).await.unwrap();
    wait_gone(&pods, "app=web").await;
    let key = format!("{}/web", ns.name);
    // The line after the last write may trail the pod's disappearance.
    let log = wait_for("the finished deletion logged", TIMEOUT, || async {
        let log = std::fs::read_to_string(vn.log())?;
        Ok(log.contains("finished the deletion").then_some(log))
    })
    .await
    .unwrap();
    let mut about_pod = 0;
    let mut faults = Vec::new();
    for line in log.lines().filter(|l| l.contains(&key)) {
        let event: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not one JSON object ({e}): {line}"));
        about_pod += 1;
        if let Some(why) = unnamed(&event, &key) {
            faults.push(format!("{why}: {line}"));
        }
    }
    assert!(about_pod >= 3, "{about_pod} lines mention {key}:\n{log}");
    assert!(
        faults.is_empty(),
        "{} of {about_pod} lines about {key} lack `object` or `cluster`:\n{}",
        faults.len(),
        faults.join("\n")
    );
    ns.delete().await.unwrap();
}
