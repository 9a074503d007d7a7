//! The harness itself: two real clusters come up, schedule and run pods, and are isolated.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Pod};
use kube::Client;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;
use tensile_harness::{ClusterPair, TestNamespace, node_is_ready, wait_for};

const TIMEOUT: Duration = Duration::from_secs(60);

fn pod(name: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "app", "image": "nginx"}]},
    }))
    .unwrap()
}

async fn running_pod_ip(pods: &Api<Pod>, name: &str) -> anyhow::Result<Option<(String, String)>> {
    let pod = pods.get(name).await?;
    let status = pod.status.unwrap_or_default();
    let node = pod.spec.and_then(|s| s.node_name);
    Ok(match (status.phase.as_deref(), status.pod_ip, node) {
        (Some("Running"), Some(ip), Some(node)) => Some((node, ip)),
        _ => None,
    })
}

#[tokio::test]
async fn both_clusters_serve_the_pinned_release_with_their_nodes() {
    let pair = ClusterPair::shared().await.unwrap();
    for (cluster, nodes) in [(&pair.upper, 0), (&pair.lower, 3)] {
        let client = cluster.client().await.unwrap();
        let version = client.apiserver_version().await.unwrap();
        assert_eq!(version.git_version, pair.binaries.kubernetes_version());
        let list = Api::<Node>::all(client)
            .list(&ListParams::default())
            .await
            .unwrap();
        assert_eq!(list.items.len(), nodes, "{} nodes", cluster.name);
        assert!(
            list.items.iter().all(node_is_ready),
            "{} nodes Ready",
            cluster.name
        );
    }
}

#[tokio::test]
async fn lower_pod_is_scheduled_onto_a_kwok_node_and_runs_with_an_ip() {
    let pair = ClusterPair::shared().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let ns = TestNamespace::create(&lower, "smoke-pod").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    pods.create(&PostParams::default(), &pod("web"))
        .await
        .unwrap();

    let (node, ip) = wait_for("pod web Running with an IP", TIMEOUT, || {
        running_pod_ip(&pods, "web")
    })
    .await
    .unwrap();
    assert!(node.starts_with("lower-node-"), "scheduled onto {node}");
    assert!(
        ip.starts_with("10.244."),
        "pod IP {ip} from the lower pod range"
    );
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn lower_deployment_gets_all_replicas_running() {
    let pair = ClusterPair::shared().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let ns = TestNamespace::create(&lower, "smoke-deploy").await.unwrap();
    let deployments: Api<Deployment> = Api::namespaced(lower.clone(), &ns.name);
    let deployment: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 5,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "app", "image": "nginx"}]},
            },
        },
    }))
    .unwrap();
    deployments
        .create(&PostParams::default(), &deployment)
        .await
        .unwrap();

    wait_for("5 available replicas", TIMEOUT, || async {
        let d = deployments.get("web").await?;
        let available = d.status.and_then(|s| s.available_replicas).unwrap_or(0);
        Ok((available == 5).then_some(()))
    })
    .await
    .unwrap();
    let pods: Api<Pod> = Api::namespaced(lower, &ns.name);
    let running = pods
        .list(&ListParams::default().labels("app=web"))
        .await
        .unwrap();
    assert_eq!(running.items.len(), 5);
    ns.delete().await.unwrap();
}

async fn config_map_exists(client: Client, ns: &str, name: &str) -> bool {
    Api::<ConfigMap>::namespaced(client, ns)
        .get_opt(name)
        .await
        .unwrap()
        .is_some()
}

#[tokio::test]
async fn clusters_are_isolated() {
    let pair = ClusterPair::shared().await.unwrap();
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "smoke-isolation")
        .await
        .unwrap();
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "only-upper"}})).unwrap();
    Api::<ConfigMap>::namespaced(upper.clone(), &ns.name)
        .create(&PostParams::default(), &cm)
        .await
        .unwrap();

    assert!(config_map_exists(upper, &ns.name, "only-upper").await);
    let lower_ns = Api::<k8s_openapi::api::core::v1::Namespace>::all(lower.clone())
        .get_opt(&ns.name)
        .await
        .unwrap();
    assert!(
        lower_ns.is_none(),
        "namespace {} leaked into lower",
        ns.name
    );
    assert!(!config_map_exists(lower, &ns.name, "only-upper").await);
    assert_ne!(pair.upper.server, pair.lower.server);
    ns.delete().await.unwrap();
}
