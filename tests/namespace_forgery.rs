//! A lower pod's marks prove nothing: whoever may create pods in a lower namespace can copy
//! the owner labels of any mirrored pod and name the UID of any upper pod. Under
//! `--lower-namespace=prefixed`, virtual-node reads at start where the pods of each upper
//! namespace run below; a forged pod in another upper namespace's lower namespace, named
//! like a pod of the victim namespace and carrying its UID, must not pin the victim
//! namespace there, or its new pods and their Secrets would be copied where the forger
//! reads them.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use common::{TIMEOUT, start_node, wait_running};
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tensile::translate::meta::{PREFIX, UPPER_UID_ANNOTATION};
use tensile::translate::namespace::{cluster_suffix, prefixed};
use tensile_harness::fixtures::{bound_pod, secret};
use tensile_harness::{ClusterPair, TestNamespace, wait_for};

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

#[tokio::test]
async fn a_forged_lower_pod_does_not_pin_an_upper_namespace_to_its_lower_namespace() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-ns-forgery";
    let flags = [NO_SERVICES, "--lower-namespace=prefixed"];
    let mut vn = start_node(pair, node, &flags).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let suffix = cluster_suffix(&cluster_id(&upper).await);
    // The victim's namespace sorts before the forger's, and so do their lower namespaces:
    // the forged pod is listed after the real copy.
    let base = TestNamespace::create(&upper, "nsforge").await.unwrap();
    let (victim, forger) = (format!("{}-a", base.name), format!("{}-b", base.name));
    let (victim_below, forger_below) = (prefixed(&victim, &suffix), prefixed(&forger, &suffix));
    for namespace in [&victim, &forger] {
        common::create_namespace(&upper, namespace, Default::default()).await;
    }
    let pp = PostParams::default();
    let victim_pods: Api<Pod> = Api::namespaced(upper.clone(), &victim);
    victim_pods
        .create(&pp, &bound_pod("app", node))
        .await
        .unwrap();
    Api::<Pod>::namespaced(upper.clone(), &forger)
        .create(&pp, &bound_pod("mine", node))
        .await
        .unwrap();
    let copy = wait_running(&Api::namespaced(lower.clone(), &victim_below), "app=app", 1)
        .await
        .remove(0);
    wait_running(
        &Api::namespaced(lower.clone(), &forger_below),
        "app=mine",
        1,
    )
    .await;
    let victim_uid = victim_pods.get("app").await.unwrap().uid().unwrap();
    let marks: serde_json::Map<String, Value> = copy
        .labels()
        .iter()
        .filter(|(key, _)| key.starts_with(PREFIX))
        .map(|(key, value)| (key.clone(), json!(value)))
        .collect();
    assert!(!marks.is_empty(), "the copy carries the node's marks");

    // While virtual-node is down (an upgrade, a restart), the user of the forger's lower
    // namespace forges a pod named like the victim's, with the node's marks and its UID.
    vn.stop().unwrap();
    let forged_pods: Api<Pod> = Api::namespaced(lower.clone(), &forger_below);
    let forged: Pod = serde_json::from_value(json!({
        "metadata": {
            "name": "app",
            "labels": marks,
            "annotations": {UPPER_UID_ANNOTATION: victim_uid},
            // Kept even if the orphan collector deletes it.
            "finalizers": ["example.com/keep"],
        },
        "spec": {"containers": [{"name": "app", "image": "busybox"}]},
    }))
    .unwrap();
    forged_pods.create(&pp, &forged).await.unwrap();

    let vn = start_node(pair, node, &flags).await;
    // A new pod of the victim namespace with a Secret.
    Api::<Secret>::namespaced(upper.clone(), &victim)
        .create(&pp, &secret("token", json!({"password": "victim's"})))
        .await
        .unwrap();
    let mut fresh = bound_pod("fresh", node);
    fresh.spec.as_mut().unwrap().containers[0].env_from = Some(vec![
        serde_json::from_value(json!({"secretRef": {"name": "token"}})).unwrap(),
    ]);
    victim_pods.create(&pp, &fresh).await.unwrap();

    // Made below: where? In the forger's lower namespace is the failure.
    let tail = || tensile_harness::process::tail(vn.log(), 40);
    let made_in = wait_for("the new pod made below", TIMEOUT, || async {
        for below in [&victim_below, &forger_below] {
            let pods: Api<Pod> = Api::namespaced(lower.clone(), below);
            if pods.get_opt("fresh").await?.is_some() {
                return Ok(Some(below.clone()));
            }
        }
        Ok(None)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", tail()));
    assert_eq!(
        made_in,
        victim_below,
        "the victim namespace's new pod was made in the forger's lower namespace; log:\n{}",
        tail()
    );
    let leaked = Api::<Secret>::namespaced(lower.clone(), &forger_below)
        .get_opt("token")
        .await
        .unwrap();
    assert!(
        leaked.is_none(),
        "the victim's Secret was copied into the forger's lower namespace"
    );
    assert!(
        Api::<Secret>::namespaced(lower.clone(), &victim_below)
            .get_opt("token")
            .await
            .unwrap()
            .is_some(),
        "the Secret is copied beside its pod"
    );
    // The forged pod is named in a warning.
    let log = std::fs::read_to_string(vn.log()).unwrap();
    assert!(
        log.contains("is not believed") && log.contains(&format!("{forger_below}/app")),
        "a warning names the forged pod; log:\n{}",
        tail()
    );

    // Clean up: the forged pod's finalizer, the lower namespaces, the upper ones.
    forged_pods
        .patch(
            "app",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    let _ = forged_pods.delete("app", &DeleteParams::default()).await;
    for namespace in [&victim, &forger] {
        let _ = Api::<Namespace>::all(upper.clone())
            .delete(namespace, &DeleteParams::default())
            .await;
    }
    for namespace in [&victim_below, &forger_below] {
        let _ = Api::<Namespace>::all(lower.clone())
            .delete(namespace, &DeleteParams::default())
            .await;
    }
    base.delete().await.unwrap();
}
