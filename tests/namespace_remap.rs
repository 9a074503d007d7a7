//! `--lower-namespace`: two upper clusters with a namespace of one name share one lower
//! cluster without meeting (`prefixed`); an annotated namespace maps to the name it gives,
//! kubectl logs and exec reach its pods, and a change of its mapping under running pods is
//! refused with an Event, across a restart too; `same` (the default) leaves an existing node's pods untouched.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use common::{TIMEOUT, gc_rounds, start_node, wait_running};
use k8s_openapi::api::core::v1::{ConfigMap, Event, Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tensile::translate::namespace::{LOWER_NAMESPACE_ANNOTATION, cluster_suffix, prefixed};
use tensile_harness::fixtures::{bound_pod, config_map};
use tensile_harness::{ClusterOptions, ClusterPair, KWOK_LOG_LINES, TestNamespace, wait_for};

/// No Service mirroring: the shared pair's other tests own their Services.
const NO_SERVICES: &str = "--enable-controllers=PVControllers";

async fn cluster_id(upper: &Client) -> String {
    Api::<Namespace>::all(upper.clone())
        .get("kube-system")
        .await
        .unwrap()
        .uid()
        .unwrap()
}

/// A pod bound to `node` reading the ConfigMap `settings`.
fn pod_with_settings(name: &str, node: &str) -> Pod {
    let mut pod = bound_pod(name, node);
    let spec = pod.spec.as_mut().unwrap();
    spec.containers[0].env_from = Some(vec![
        serde_json::from_value(json!({"configMapRef": {"name": "settings"}})).unwrap(),
    ]);
    pod
}

#[tokio::test]
async fn two_upper_clusters_with_a_namespace_of_one_name_share_a_lower_cluster_under_prefixed() {
    let pair = ClusterPair::shared().await.unwrap();
    let second = pair
        .start_cluster(ClusterOptions::new(
            "upper-remap",
            0,
            (Ipv4Addr::new(10, 97, 0, 0), 16),
            "10.226.0.0/16",
        ))
        .await
        .unwrap();
    let node = "vk-prefixed";
    let (upper, upper_2, lower) = (
        pair.upper.client().await.unwrap(),
        second.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let flags = [NO_SERVICES, "--lower-namespace=prefixed"];
    let _first = start_node(pair, node, &flags).await;
    let _second = common::start_node_on(pair, &upper_2, &second.kubeconfig, node, &flags).await;

    // One namespace name in both upper clusters, each with its own ConfigMap and a pod of
    // one name.
    let ns = TestNamespace::create(&upper, "remap").await.unwrap();
    common::create_namespace(&upper_2, &ns.name, BTreeMap::new()).await;
    for (client, cluster) in [(&upper, "one"), (&upper_2, "two")] {
        Api::<ConfigMap>::namespaced(client.clone(), &ns.name)
            .create(
                &PostParams::default(),
                &config_map("settings", json!({"cluster": cluster})),
            )
            .await
            .unwrap();
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
        pods.create(&PostParams::default(), &pod_with_settings("app", node))
            .await
            .unwrap();
    }
    for client in [&upper, &upper_2] {
        // Status comes back up through the mapping.
        wait_running(&Api::namespaced(client.clone(), &ns.name), "app=app", 1).await;
    }

    for (client, cluster) in [(&upper, "one"), (&upper_2, "two")] {
        let below = prefixed(&ns.name, &cluster_suffix(&cluster_id(client).await));
        let upper_uid = Api::<Pod>::namespaced(client.clone(), &ns.name)
            .get("app")
            .await
            .unwrap()
            .uid();
        let pods = wait_running(&Api::namespaced(lower.clone(), &below), "app=app", 1).await;
        assert_eq!(
            pods[0].annotations().get("tensile.dev/upper-uid"),
            upper_uid.as_ref(),
            "{below} holds cluster {cluster}'s pod"
        );
        let settings = Api::<ConfigMap>::namespaced(lower.clone(), &below)
            .get("settings")
            .await
            .unwrap();
        assert_eq!(settings.data.unwrap()["cluster"], cluster, "{below}");
    }
    assert!(
        Api::<Namespace>::all(lower.clone())
            .get_opt(&ns.name)
            .await
            .unwrap()
            .is_none(),
        "nothing goes to the unmapped name"
    );

    // Deleting one cluster's pod deletes its copy only.
    Api::<Pod>::namespaced(upper.clone(), &ns.name)
        .delete("app", &DeleteParams::default())
        .await
        .unwrap();
    let first_below = prefixed(&ns.name, &cluster_suffix(&cluster_id(&upper).await));
    let second_below = prefixed(&ns.name, &cluster_suffix(&cluster_id(&upper_2).await));
    let first_pods: Api<Pod> = Api::namespaced(lower.clone(), &first_below);
    wait_for("the first cluster's lower pod gone", TIMEOUT, || async {
        Ok(first_pods.get_opt("app").await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    assert!(
        Api::<Pod>::namespaced(lower.clone(), &second_below)
            .get_opt("app")
            .await
            .unwrap()
            .is_some()
    );
    Api::<Namespace>::all(upper_2.clone())
        .delete(&ns.name, &DeleteParams::default())
        .await
        .unwrap();
    ns.delete().await.unwrap();
}

/// Runs kubectl of the pinned release against the upper cluster.
async fn kubectl(pair: &ClusterPair, args: &[&str]) -> std::process::Output {
    common::kubectl(pair, pair.upper_kubeconfig(), args, b"").await
}

#[tokio::test]
async fn an_annotated_namespace_maps_to_its_name_and_kubectl_reaches_its_pods() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-annotated";
    let mut vn = start_node(pair, node, &[NO_SERVICES, "--lower-namespace=annotation"]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    // A unique name from a test namespace; the mapped one is annotated from the start.
    let base = TestNamespace::create(&upper, "annotated").await.unwrap();
    let name = format!("{}-a", base.name);
    let below = format!("{}-below", base.name);
    let namespaces: Api<Namespace> = Api::all(upper.clone());
    let annotate =
        |name: String| json!({"metadata": {"annotations": {LOWER_NAMESPACE_ANNOTATION: name}}});
    common::create_namespace(
        &upper,
        &name,
        [(LOWER_NAMESPACE_ANNOTATION.to_owned(), below.clone())].into(),
    )
    .await;
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &name);
    let mut pod = bound_pod("two", node);
    pod.spec = Some(
        serde_json::from_value(json!({"nodeName": node, "containers": [
            {"name": "app", "image": "busybox"},
        ]}))
        .unwrap(),
    );
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &below);
    pods.create(&PostParams::default(), &pod).await.unwrap();
    wait_running(&pods, "app=two", 1).await;
    wait_running(&lower_pods, "app=two", 1).await;
    assert!(
        Api::<Pod>::namespaced(lower.clone(), &name)
            .get_opt("two")
            .await
            .unwrap()
            .is_none()
    );

    // The kubelet API maps the names: logs and exec reach the pod below.
    let logs = kubectl(pair, &["logs", "-n", &name, "two", "-c", "app"]).await;
    assert!(
        logs.status.success(),
        "logs: {}",
        String::from_utf8_lossy(&logs.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&logs.stdout),
        KWOK_LOG_LINES.join("\n") + "\n"
    );
    let hi = kubectl(
        pair,
        &["exec", "-n", &name, "two", "-c", "app", "--", "echo", "hi"],
    )
    .await;
    assert!(
        hi.status.success(),
        "exec: {}",
        String::from_utf8_lossy(&hi.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&hi.stdout), "hi\n");

    // Moving a namespace with running pods is refused, with an Event on the Namespace.
    namespaces
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(annotate(format!("{}-moved", base.name))),
        )
        .await
        .unwrap();
    let events: Api<Event> = Api::all(upper.clone());
    wait_for("the refusal Event", TIMEOUT, || async {
        let list = events
            .list(&ListParams::default().fields(&format!(
                "involvedObject.kind=Namespace,involvedObject.name={name}"
            )))
            .await?;
        Ok(list
            .items
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("LowerNamespaceChangeRefused")))
    })
    .await
    .unwrap();
    let still = lower_pods.get("two").await.unwrap();
    assert!(
        still.metadata.deletion_timestamp.is_none(),
        "the pod below stays"
    );

    // The same across a restart: the new process finds the pod in its lower namespace and
    // keeps the mapping there, rather than taking the pod for an orphan of another
    // namespace (deleted) and making it again under the annotation's name.
    vn.stop().unwrap();
    let vn = start_node(pair, node, &[NO_SERVICES, "--lower-namespace=annotation"]).await;
    gc_rounds(&vn, 2).await;
    let after = lower_pods.get("two").await.unwrap();
    assert_eq!(after.uid(), still.uid(), "the pod below is the same one");
    assert!(after.metadata.deletion_timestamp.is_none(), "and stays");
    let moved = format!("{}-moved", base.name);
    assert!(
        Api::<Pod>::namespaced(lower.clone(), &moved)
            .get_opt("two")
            .await
            .unwrap()
            .is_none(),
        "nothing was made under the refused name"
    );
    namespaces
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap();
    base.delete().await.unwrap();
}

/// Upgrading with `--lower-namespace=same` (the default) changes nothing below.
#[tokio::test]
async fn same_leaves_an_existing_nodes_pods_untouched() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-same";
    let mut before = start_node(pair, node, &[NO_SERVICES]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "same").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    pods.create(&PostParams::default(), &bound_pod("kept", node))
        .await
        .unwrap();
    wait_running(&pods, "app=kept", 1).await;
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let original = wait_running(&lower_pods, "app=kept", 1).await.remove(0);
    before.stop().unwrap();

    let after = start_node(pair, node, &[NO_SERVICES, "--lower-namespace=same"]).await;
    gc_rounds(&after, 2).await;
    let now = lower_pods.get("kept").await.unwrap();
    assert_eq!(now.uid(), original.uid(), "the lower pod is the same one");
    assert_eq!(
        now.metadata.resource_version, original.metadata.resource_version,
        "and was not written"
    );
    ns.delete().await.unwrap();
}
