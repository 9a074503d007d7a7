//! A Secret's contents never appear in virtual-node's log (at trace level), in events of
//! either cluster, or in its metrics, while it is mirrored, updated and removed.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use common::{TIMEOUT, metrics_text, start_node, wait_gone, wait_running};
use k8s_openapi::api::core::v1::{Event, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tensile_harness::fixtures::{bound_pod, merge, secret};
use tensile_harness::{ClusterPair, TestNamespace, wait_for};

#[tokio::test]
async fn secret_contents_appear_in_no_log_event_or_metric() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-secret";
    let vn = start_node(
        pair,
        node,
        &["--log-level=trace", "--full-resync-period=1s"],
    )
    .await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "secret").await.unwrap();
    let markers = ["tensile-marker-7f3a9c1e", "tensile-marker-b81d44e0"];
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &ns.name);
    secrets
        .create(
            &PostParams::default(),
            &secret("db", json!({"password": markers[0]})),
        )
        .await
        .unwrap();
    let mut pod = bound_pod("app", node);
    let mut spec = serde_json::to_value(pod.spec.take().unwrap()).unwrap();
    merge(
        &mut spec,
        json!({
            "containers": [{"name": "c", "image": "nginx",
                "env": [{"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}}}],
                "volumeMounts": [{"name": "db", "mountPath": "/db"}]}],
            "volumes": [{"name": "db", "secret": {"secretName": "db"}}],
        }),
    );
    pod.spec = Some(serde_json::from_value(spec).unwrap());
    pod.metadata.labels = Some([("app".to_owned(), "secret".to_owned())].into());
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    upper_pods
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    wait_running(&upper_pods, "app=secret", 1).await;

    // An upper edit reaches the copy; an edit below is undone.
    let lower_secrets: Api<Secret> = Api::namespaced(lower.clone(), &ns.name);
    let patch = json!({"stringData": {"password": markers[1]}});
    secrets
        .patch("db", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let holds = |secret: &Secret, marker: &str| {
        secret
            .data
            .as_ref()
            .and_then(|d| d.get("password"))
            .is_some_and(|v| v.0 == marker.as_bytes())
    };
    let copy_holds = |what: &'static str, marker: &'static str| {
        let lower_secrets = lower_secrets.clone();
        async move {
            wait_for(what, TIMEOUT, || async {
                Ok(lower_secrets
                    .get_opt("db")
                    .await?
                    .filter(|s| holds(s, marker))
                    .map(|_| ()))
            })
            .await
            .unwrap();
        }
    };
    copy_holds("the copy updated", markers[1]).await;
    let below = json!({"stringData": {"password": "edited-below"}});
    lower_secrets
        .patch("db", &PatchParams::default(), &Patch::Merge(&below))
        .await
        .unwrap();
    copy_holds("the edit below undone", markers[1]).await;
    upper_pods
        .delete("app", &DeleteParams::default())
        .await
        .unwrap();
    wait_gone(&lower_pods, "app=secret").await;

    let log = std::fs::read_to_string(vn.log()).unwrap();
    let metrics = metrics_text(&vn).await;
    let mut events = String::new();
    for client in [&upper, &lower] {
        let list = Api::<Event>::namespaced(client.clone(), &ns.name)
            .list(&ListParams::default())
            .await
            .unwrap();
        events.push_str(&serde_json::to_string(&list.items).unwrap());
    }
    for marker in markers.iter().chain(&["edited-below"]) {
        // As a Secret's data travels in JSON: base64.
        let encoded = serde_json::to_value(k8s_openapi::ByteString(marker.as_bytes().to_vec()))
            .unwrap()
            .as_str()
            .unwrap()
            .to_owned();
        for (what, text) in [("log", &log), ("events", &events), ("metrics", &metrics)] {
            assert!(
                !text.contains(marker) && !text.contains(&encoded),
                "{marker} (or its base64) appears in the {what}"
            );
        }
    }
    assert!(
        log.len() > 10_000,
        "the trace log is there ({} bytes)",
        log.len()
    );
    drop(vn);
    ns.delete().await.unwrap();
}
