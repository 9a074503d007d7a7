//! Two upper clusters, one lower cluster: each upper cluster's virtual node marks what it
//! makes below with its cluster's identity as well as its node name, so nodes of the same
//! name in two upper clusters never take (or collect) each other's objects; an upgrade from
//! objects with the node mark only adopts them without re-creating anything.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use common::{TIMEOUT, gc_rounds, metric, start_node, wait_running};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tensile::node::capacity::PodFeed;
use tensile::translate::meta::{
    OWNER_NODE_LABEL, Owner, UPPER_CLUSTER_LABEL, UPPER_UID_ANNOTATION,
};
use tensile_harness::fixtures::bound_pod;
use tensile_harness::{ClusterOptions, ClusterPair, TestNamespace, wait_for};

/// No Service mirroring: the shared pair's other tests own their Services.
const NO_SERVICES: &str = "--enable-controllers=PVControllers";

/// The identity tensile gives an upper cluster by default: its kube-system namespace's UID.
async fn cluster_id(upper: &Client) -> String {
    Api::<Namespace>::all(upper.clone())
        .get("kube-system")
        .await
        .unwrap()
        .uid()
        .unwrap()
}

fn label(pod: &Pod, key: &str) -> Option<String> {
    pod.labels().get(key).cloned()
}

#[tokio::test]
async fn two_upper_clusters_with_nodes_of_one_name_share_a_lower_cluster() {
    let pair = ClusterPair::shared().await.unwrap();
    let second = pair
        .start_cluster(ClusterOptions::new(
            "upper-2",
            0,
            (Ipv4Addr::new(10, 98, 0, 0), 16),
            "10.225.0.0/16",
        ))
        .await
        .unwrap();
    let node = "vk-shared";
    let (upper, upper_2, lower) = (
        pair.upper.client().await.unwrap(),
        second.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let (id, id_2) = (cluster_id(&upper).await, cluster_id(&upper_2).await);
    assert_ne!(id, id_2);
    let first_vn = start_node(pair, node, &[NO_SERVICES]).await;
    let second_vn =
        common::start_node_on(pair, &upper_2, &second.kubeconfig, node, &[NO_SERVICES]).await;

    // The same namespace in both upper clusters, so both nodes mirror into one below.
    let ns = TestNamespace::create(&upper, "shared").await.unwrap();
    common::create_namespace(&upper_2, &ns.name, BTreeMap::new()).await;

    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let mut lower_uids = BTreeMap::new();
    for (client, name, want_cluster) in [(&upper, "one", &id), (&upper_2, "two", &id_2)] {
        let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
        let mut pod = bound_pod(name, node);
        pod.metadata.labels = Some([("app".to_owned(), name.to_owned())].into());
        pods.create(&PostParams::default(), &pod).await.unwrap();
        wait_running(&pods, &format!("app={name}"), 1).await;
        let below = wait_running(&lower_pods, &format!("app={name}"), 1).await;
        assert_eq!(label(&below[0], OWNER_NODE_LABEL).as_deref(), Some(node));
        assert_eq!(
            label(&below[0], UPPER_CLUSTER_LABEL).as_ref(),
            Some(want_cluster),
            "{name} carries its upper cluster's mark"
        );
        lower_uids.insert(name, below[0].uid().unwrap());
    }

    // Before cluster marks, each node's orphan collection deleted the other's pod within
    // a round (same node name, upper pod not found in its own cluster).
    gc_rounds(&first_vn, 2).await;
    gc_rounds(&second_vn, 2).await;
    for (name, uid) in &lower_uids {
        let below = lower_pods.get_opt(name).await.unwrap();
        assert_eq!(
            below.and_then(|p| p.uid()).as_ref(),
            Some(uid),
            "lower pod {name} kept, not re-created"
        );
    }
    for vn in [&first_vn, &second_vn] {
        assert_eq!(metric(vn, "tensile_orphans_deleted_total").await, 0);
    }

    // Deleting one upper pod removes its lower pod only.
    Api::<Pod>::namespaced(upper.clone(), &ns.name)
        .delete("one", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("lower pod one gone", TIMEOUT, || async {
        Ok(lower_pods.get_opt("one").await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(
        lower_pods
            .get_opt("two")
            .await
            .unwrap()
            .and_then(|p| p.uid())
            .as_ref(),
        lower_uids.get("two")
    );
    Api::<Pod>::namespaced(upper_2.clone(), &ns.name)
        .delete("two", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("lower pod two gone", TIMEOUT, || async {
        Ok(lower_pods.get_opt("two").await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    drop((first_vn, second_vn));
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn an_upgrade_adopts_node_marked_objects_and_leaves_another_clusters_alone() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-adopt";
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "adopt").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let mut vn = start_node(pair, node, &[NO_SERVICES]).await;
    let mut pod = bound_pod("legacy", node);
    pod.metadata.labels = Some([("app".to_owned(), "legacy".to_owned())].into());
    upper_pods
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();
    wait_running(&upper_pods, "app=legacy", 1).await;
    let below = wait_running(&lower_pods, "app=legacy", 1).await;
    let legacy_uid = below[0].uid().unwrap();
    vn.stop().unwrap();

    // As an earlier version left it: the node mark only.
    let unmark = json!({"metadata": {"labels": {UPPER_CLUSTER_LABEL: null}}});
    lower_pods
        .patch("legacy", &PatchParams::default(), &Patch::Merge(&unmark))
        .await
        .unwrap();
    // Another upper cluster's pod of a node of the same name.
    let mut foreign = bound_pod("foreign", "elsewhere");
    foreign.spec.as_mut().unwrap().node_name = None;
    foreign.metadata.labels = Some(
        [
            (OWNER_NODE_LABEL.to_owned(), node.to_owned()),
            (UPPER_CLUSTER_LABEL.to_owned(), "another-cluster".to_owned()),
        ]
        .into(),
    );
    foreign.metadata.annotations =
        Some([(UPPER_UID_ANNOTATION.to_owned(), "not-here".to_owned())].into());
    let foreign = lower_pods
        .create(&PostParams::default(), &foreign)
        .await
        .unwrap();

    let vn = start_node(pair, node, &[NO_SERVICES]).await;
    let id = cluster_id(&upper).await;
    wait_for("the legacy pod adopted", TIMEOUT, || async {
        let pod = lower_pods.get("legacy").await?;
        Ok((label(&pod, UPPER_CLUSTER_LABEL).as_ref() == Some(&id)).then_some(pod))
    })
    .await
    .unwrap();
    gc_rounds(&vn, 2).await;
    let legacy = lower_pods.get("legacy").await.unwrap();
    assert_eq!(legacy.uid(), Some(legacy_uid), "adopted, not re-created");
    wait_running(&upper_pods, "app=legacy", 1).await;
    let still = lower_pods.get("foreign").await.unwrap();
    assert_eq!(
        still.uid(),
        foreign.uid(),
        "another cluster's pod left alone"
    );
    assert_eq!(
        label(&still, UPPER_CLUSTER_LABEL).as_deref(),
        Some("another-cluster")
    );
    let log = std::fs::read_to_string(vn.log()).unwrap();
    assert!(
        log.contains("carry virtual node vk-adopt of another upper cluster (another-cluster)"),
        "one line names the other cluster:\n{}",
        tensile_harness::process::tail(vn.log(), 30)
    );
    lower_pods
        .delete("foreign", &DeleteParams::default())
        .await
        .unwrap();
    drop(vn);
    ns.delete().await.unwrap();
}

/// The capacity's two pod watches, as the lower API server evaluates their selectors:
/// together every pod that is not the owner's, each pod in exactly the feed that
/// `PodFeed::of` names. No virtual node of this name runs, so nothing collects the pods.
#[tokio::test]
async fn the_capacity_pod_feeds_select_every_pod_not_ours_once() {
    let pair = ClusterPair::shared().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let ns = TestNamespace::create(&lower, "feeds").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let owner = Owner::new("vk-feeds", "cluster-a");
    let marks: [(&str, &[(&str, &str)]); 6] = [
        ("nobodys", &[]),
        ("unrelated", &[("app", "x")]),
        (
            "other-node",
            &[
                (OWNER_NODE_LABEL, "vk-other"),
                (UPPER_CLUSTER_LABEL, "cluster-a"),
            ],
        ),
        ("unclaimed", &[(OWNER_NODE_LABEL, "vk-feeds")]),
        (
            "foreign",
            &[
                (OWNER_NODE_LABEL, "vk-feeds"),
                (UPPER_CLUSTER_LABEL, "cluster-b"),
            ],
        ),
        (
            "ours",
            &[
                (OWNER_NODE_LABEL, "vk-feeds"),
                (UPPER_CLUSTER_LABEL, "cluster-a"),
            ],
        ),
    ];
    let mut want: BTreeMap<Option<usize>, BTreeSet<String>> = BTreeMap::new();
    for (name, labels) in marks {
        let mut p = bound_pod(name, "lower-node-0");
        let labels: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let feed = PodFeed::of(&owner, Some(&labels)).map(PodFeed::index);
        want.entry(feed).or_default().insert(name.to_owned());
        p.metadata.labels = Some(labels);
        pods.create(&PostParams::default(), &p).await.unwrap();
    }
    assert_eq!(
        want.get(&None).map(BTreeSet::len),
        Some(1),
        "only one pod is ours"
    );
    for feed in PodFeed::ALL {
        let selector = feed.selector(&owner);
        let listed: BTreeSet<String> = pods
            .list(&ListParams::default().labels(&selector))
            .await
            .unwrap()
            .items
            .into_iter()
            .filter_map(|p| p.metadata.name)
            .collect();
        assert_eq!(
            Some(&listed),
            want.get(&Some(feed.index())),
            "{feed:?} selects {selector}"
        );
    }
    ns.delete().await.unwrap();
}
