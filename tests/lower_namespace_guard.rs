//! `tensile.dev/lower-namespace` cannot reach a namespace that is not this upper
//! cluster's: an upper Namespace annotated with `kube-system`, with `tensile-system`
//! (where `virtual-node join` keeps member identities), with a lower namespace a user made,
//! or with one tensile made for another upper cluster is refused with a Warning on the
//! Namespace and keeps its default lower namespace; no pod is made in the named one, and a
//! pod that would mount the member token it holds is never made at all.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;

use common::{TIMEOUT, gc_rounds, start_node, wait_running};
use k8s_openapi::api::core::v1::{Event, Namespace, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tensile::translate::meta::{OWNER_NODE_LABEL, UPPER_CLUSTER_LABEL};
use tensile::translate::namespace::{JOIN_NAMESPACE, LOWER_NAMESPACE_ANNOTATION};
use tensile_harness::fixtures::{bound_pod, secret};
use tensile_harness::{ClusterPair, TestNamespace, wait_for};

const NODE: &str = "vk-ns-guard";
/// No Service mirroring: the shared pair's other tests own their Services.
const NO_SERVICES: &str = "--enable-controllers=PVControllers";

/// Creates the lower Namespace `name` with `labels`, unless it exists.
async fn lower_namespace(lower: &Client, name: &str, labels: BTreeMap<String, String>) {
    let mut namespace = Namespace::default();
    namespace.metadata.name = Some(name.to_owned());
    namespace.metadata.labels = Some(labels);
    match Api::<Namespace>::all(lower.clone())
        .create(&PostParams::default(), &namespace)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(error) => panic!("creating lower namespace {name}: {error}"),
    }
}

/// The Warning of `reason` on the upper Namespace `name`.
async fn refusal(upper: &Client, name: &str, reason: &str) -> Event {
    let events: Api<Event> = Api::all(upper.clone());
    wait_for(
        &format!("{reason} on namespace {name}"),
        TIMEOUT,
        || async {
            let list = events
                .list(&ListParams::default().fields(&format!(
                    "involvedObject.kind=Namespace,involvedObject.name={name}"
                )))
                .await?;
            Ok(list
                .items
                .into_iter()
                .find(|e| e.reason.as_deref() == Some(reason)))
        },
    )
    .await
    .unwrap()
}

/// A pod bound to the node that mounts the Secret `secret`.
fn pod_mounting(name: &str, secret: &str) -> Pod {
    let mut pod = bound_pod(name, NODE);
    let spec = pod.spec.as_mut().unwrap();
    spec.volumes = Some(vec![
        serde_json::from_value(json!({"name": "token", "secret": {"secretName": secret}})).unwrap(),
    ]);
    spec.containers[0].volume_mounts = Some(vec![
        serde_json::from_value(json!({"name": "token", "mountPath": "/var/run/member"})).unwrap(),
    ]);
    pod
}

#[tokio::test]
async fn an_annotation_cannot_map_onto_a_namespace_that_is_not_this_upper_clusters() {
    let pair = ClusterPair::shared().await.unwrap();
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let base = TestNamespace::create(&upper, "guard").await.unwrap();
    let name = |what: &str| format!("{}-{what}", base.name);

    // Below: join's namespace with a member token, a user's namespace, and one tensile
    // made for another upper cluster.
    let token = name("member-token");
    lower_namespace(&lower, JOIN_NAMESPACE, BTreeMap::new()).await;
    Api::<Secret>::namespaced(lower.clone(), JOIN_NAMESPACE)
        .create(
            &PostParams::default(),
            &secret(&token, json!({"token": "a member's lower token"})),
        )
        .await
        .unwrap();
    let theirs = name("theirs");
    lower_namespace(&lower, &theirs, BTreeMap::new()).await;
    let foreign = name("foreign");
    lower_namespace(
        &lower,
        &foreign,
        [
            (OWNER_NODE_LABEL.to_owned(), NODE.to_owned()),
            (
                UPPER_CLUSTER_LABEL.to_owned(),
                "another-upper-cluster".to_owned(),
            ),
        ]
        .into(),
    )
    .await;

    let mut vn = start_node(pair, NODE, &[NO_SERVICES, "--lower-namespace=annotation"]).await;

    // (upper namespace, annotation, the Warning, the pod)
    let cases = [
        (
            name("k"),
            "kube-system".to_owned(),
            "LowerNamespaceReserved",
            bound_pod("k", NODE),
        ),
        (
            name("t"),
            JOIN_NAMESPACE.to_owned(),
            "LowerNamespaceReserved",
            pod_mounting("t", &token),
        ),
        (
            name("u"),
            theirs.clone(),
            "LowerNamespaceNotOurs",
            bound_pod("u", NODE),
        ),
        (
            name("f"),
            foreign.clone(),
            "LowerNamespaceNotOurs",
            bound_pod("f", NODE),
        ),
    ];
    for (namespace, annotation, _, pod) in &cases {
        common::create_namespace(
            &upper,
            namespace,
            [(LOWER_NAMESPACE_ANNOTATION.to_owned(), annotation.clone())].into(),
        )
        .await;
        Api::<Pod>::namespaced(upper.clone(), namespace)
            .create(&PostParams::default(), pod)
            .await
            .unwrap();
    }
    for (namespace, _, reason, _) in &cases {
        let event = refusal(&upper, namespace, reason).await;
        assert_eq!(event.type_.as_deref(), Some("Warning"), "{event:?}");
    }
    // Refused, each keeps its default (its own name under `annotation`): the pods that
    // need nothing below run there.
    for (namespace, _, _, pod) in &cases {
        if pod.name_any() == "t" {
            continue;
        }
        let app = format!("app={}", pod.name_any());
        wait_running(&Api::namespaced(upper.clone(), namespace), &app, 1).await;
        let below = wait_running(&Api::namespaced(lower.clone(), namespace), &app, 1).await;
        assert_eq!(below[0].namespace().as_deref(), Some(namespace.as_str()));
    }
    // The pod mounting the member token: its Secret is not in the upper namespace, and the
    // one below is never reached.
    gc_rounds(&vn, 2).await;
    for (namespace, annotation, _, pod) in &cases {
        for below in [namespace, annotation] {
            let found = Api::<Pod>::namespaced(lower.clone(), below)
                .get_opt(&pod.name_any())
                .await
                .unwrap();
            let expected_there = below == namespace && pod.name_any() != "t";
            assert_eq!(
                found.is_some(),
                expected_there,
                "pod {} in lower namespace {below}",
                pod.name_any()
            );
        }
    }
    let t_pods: Api<Pod> = Api::namespaced(lower.clone(), JOIN_NAMESPACE);
    let mounting: Vec<Pod> = t_pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|p| {
            p.spec
                .iter()
                .flat_map(|s| s.volumes.iter().flatten())
                .any(|v| {
                    v.secret.as_ref().and_then(|s| s.secret_name.as_deref()) == Some(token.as_str())
                })
        })
        .collect();
    assert!(mounting.is_empty(), "{mounting:?}");

    vn.stop().unwrap();
    for (namespace, _, _, _) in &cases {
        let _ = Api::<Namespace>::all(upper.clone())
            .delete(namespace, &DeleteParams::default())
            .await;
        let _ = Api::<Namespace>::all(lower.clone())
            .delete(namespace, &DeleteParams::default())
            .await;
    }
    for below in [&theirs, &foreign] {
        let _ = Api::<Namespace>::all(lower.clone())
            .delete(below, &DeleteParams::default())
            .await;
    }
    let _ = Api::<Secret>::namespaced(lower.clone(), JOIN_NAMESPACE)
        .delete(&token, &DeleteParams::default())
        .await;
    base.delete().await.unwrap();
}
