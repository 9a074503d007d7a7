//! `--kueue-quota CLUSTERQUEUE/FLAVOR`: the burst flavor's quota in a Kueue ClusterQueue
//! follows the virtual node's allocatable. Kueue's CRDs only, no manager: what is tested is
//! what virtual-node writes, not what Kueue admits (tests/kueue.rs). Its own test binary,
//! so that the lower cluster's free room is only what this test takes.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use common::{TIMEOUT, start_node};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tensile_harness::fixtures::pod;
use tensile_harness::{ClusterPair, TestNamespace, kueue, wait_for};

const NODE: &str = "vk-kueue";
const QUEUE: &str = "cluster-queue";

/// The `nominalQuota`s of `flavor` in `queue`, as `resource=quantity` (sorted).
fn quotas(queue: &DynamicObject, flavor: &str) -> Vec<String> {
    let mut out: Vec<String> = queue.data["spec"]["resourceGroups"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|g| g["flavors"].as_array())
        .flatten()
        .filter(|f| f["name"] == flavor)
        .filter_map(|f| f["resources"].as_array())
        .flatten()
        .map(|r| match &r["nominalQuota"] {
            Value::String(s) => format!("{}={s}", r["name"].as_str().unwrap()),
            other => format!("{}={other}", r["name"].as_str().unwrap()),
        })
        .collect();
    out.sort();
    out
}

/// One resource group over cpu, memory and pods with `flavors` (name, [cpu, memory, pods]).
fn resource_groups(flavors: &[(&str, [&str; 3])]) -> Value {
    let flavors: Vec<Value> = flavors
        .iter()
        .map(|(name, [cpu, memory, pods])| {
            json!({"name": name, "resources": [
                {"name": "cpu", "nominalQuota": cpu},
                {"name": "memory", "nominalQuota": memory},
                {"name": "pods", "nominalQuota": pods},
            ]})
        })
        .collect();
    json!([{"coveredResources": ["cpu", "memory", "pods"], "flavors": flavors}])
}

/// Waits until `flavor`'s quotas in the ClusterQueue are `want` (sorted `resource=quantity`).
async fn wait_quotas(queues: &Api<DynamicObject>, flavor: &str, want: &[&str]) {
    let what = format!("{QUEUE}'s {flavor} quota to be {want:?}");
    let result = wait_for(&what, TIMEOUT, || async {
        let queue = queues.get(QUEUE).await?;
        Ok((quotas(&queue, flavor) == want).then_some(()))
    })
    .await;
    if let Err(error) = result {
        let now = queues.get(QUEUE).await.map(|q| quotas(&q, flavor));
        panic!("{error:#}; last seen {now:?}");
    }
}

/// The notes of the Events of `reason` about the object `kind`/`name`.
async fn notes(events: &Api<Event>, kind: &str, name: &str, reason: &str) -> Vec<String> {
    events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some(reason)
                && e.involved_object.kind.as_deref() == Some(kind)
                && e.involved_object.name.as_deref() == Some(name)
        })
        .filter_map(|e| e.message)
        .collect()
}

/// Waits for an Event of `reason` on `kind`/`name` whose note has each of `parts`.
async fn wait_event(events: &Api<Event>, kind: &str, name: &str, reason: &str, parts: &[&str]) {
    let what = format!("a {reason} Event on {kind} {name} saying {parts:?}");
    let result = wait_for(&what, TIMEOUT, || async {
        let found = notes(events, kind, name, reason).await;
        Ok(found
            .into_iter()
            .find(|n| parts.iter().all(|p| n.contains(p))))
    })
    .await;
    if let Err(error) = result {
        panic!(
            "{error:#}; seen: {:?}",
            notes(events, kind, name, reason).await
        );
    }
}

/// Before Kueue is installed the process runs and says so on its Node; once the
/// ClusterQueue exists its burst flavor's quota is the Node's allocatable (the local
/// flavor untouched), and follows it when a lower pod that is not ours takes room; a
/// ClusterQueue without the flavor is said in a Warning Event naming both, and the process
/// stays Ready.
#[tokio::test]
async fn the_burst_flavor_quota_follows_the_virtual_node() {
    let pair = ClusterPair::shared().await.unwrap();
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let events: Api<Event> = Api::all(upper.clone());
    let mut vn = start_node(pair, NODE, &[&format!("--kueue-quota={QUEUE}/burst")]).await;
    wait_event(
        &events,
        "Node",
        NODE,
        "QuotaNotUpdated",
        &["serves no ClusterQueues", "is Kueue installed?"],
    )
    .await;

    kueue::install_crds_only(&upper).await.unwrap();
    let queues = kueue::api(&upper, "ClusterQueue", None);
    let queue: DynamicObject = serde_json::from_value(json!({
        "apiVersion": kueue::API_VERSION,
        "kind": "ClusterQueue",
        "metadata": {"name": QUEUE},
        "spec": {
            "namespaceSelector": {},
            "resourceGroups": resource_groups(&[
                ("local", ["8", "32Gi", "110"]),
                ("burst", ["1", "1Gi", "10"]),
            ]),
        },
    }))
    .unwrap();
    queues.create(&PostParams::default(), &queue).await.unwrap();

    // Three lower nodes of 8 CPU, 32Gi, 110 pods: their allocatable, summed.
    let nodes: Api<Node> = Api::all(upper.clone());
    let allocatable = nodes.get(NODE).await.unwrap().status.unwrap().allocatable;
    assert_eq!(
        allocatable.unwrap()["cpu"].0,
        "24",
        "the lower cluster as tests/virtual_node_capacity.rs sees it"
    );
    wait_quotas(
        &queues,
        "burst",
        &["cpu=24", "memory=103079215104", "pods=330"],
    )
    .await;
    assert_eq!(
        quotas(&queues.get(QUEUE).await.unwrap(), "local"),
        ["cpu=8", "memory=32Gi", "pods=110"]
    );
    wait_event(
        &events,
        "ClusterQueue",
        QUEUE,
        "QuotaUpdated",
        &["flavor burst", "cpu 1 → 24", "pods 10 → 330", NODE],
    )
    .await;

    // A lower pod that is not ours takes 2 CPU, 1Gi and a pod slot: the quota follows.
    let ns = TestNamespace::create(&lower, "kueue-quota").await.unwrap();
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let other = pod(
        "other",
        json!({
            "nodeName": "lower-node-0",
            "containers": [{"name": "app", "image": "nginx",
                "resources": {"requests": {"cpu": "2", "memory": "1Gi"}}}],
        }),
    );
    lower_pods
        .create(&PostParams::default(), &other)
        .await
        .unwrap();
    wait_quotas(
        &queues,
        "burst",
        &["cpu=22", "memory=102005473280", "pods=329"],
    )
    .await;

    // The flavor removed: said on the ClusterQueue, naming it and the flavor.
    let only_local = json!({"spec": {"resourceGroups": resource_groups(&[
        ("local", ["8", "32Gi", "110"]),
    ])}});
    queues
        .patch(QUEUE, &PatchParams::default(), &Patch::Merge(&only_local))
        .await
        .unwrap();
    wait_event(
        &events,
        "ClusterQueue",
        QUEUE,
        "QuotaNotUpdated",
        &[
            "ClusterQueue cluster-queue has no flavor burst",
            "its flavors: local",
        ],
    )
    .await;
    vn.check_running().unwrap();
    assert!(
        common::ha::reachable(vn.metrics_port, "/readyz").await,
        "virtual-node Ready"
    );
    assert_eq!(
        quotas(&queues.get(QUEUE).await.unwrap(), "local"),
        ["cpu=8", "memory=32Gi", "pods=110"]
    );
}
