//! Helpers of the node granularity tests (issue 36): a lower cluster of labelled kwok
//! nodes, and a member's Ready virtual nodes.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams, Patch, PatchParams};
use tensile_harness::{ClusterOptions, ClusterPair, VirtualNode, node_is_ready, wait_for};

use super::TIMEOUT;

/// A lower cluster `name` beside the shared pair (kwok nodes on `nodes`, pods on
/// `pod_cidr`) of `count` kwok nodes of 4 CPU, the `i`th (by name) labelled
/// `labels(i)` (a JSON object; nothing when empty); it and its node names, sorted.
pub async fn labelled_lower(
    pair: &ClusterPair,
    name: &str,
    count: usize,
    nodes: (Ipv4Addr, u8),
    pod_cidr: &str,
    labels: impl Fn(usize) -> serde_json::Value,
) -> (tensile_harness::Cluster, Vec<String>) {
    let mut options = ClusterOptions::new(name, count, nodes, pod_cidr);
    options.node_shape.cpu = "4".into();
    let lower = pair.start_cluster(options).await.unwrap();
    let names = label_nodes(&lower.client().await.unwrap(), count, labels).await;
    (lower, names)
}

/// Labels the `count` nodes of the cluster of `client`, the `i`th (by name) `labels(i)` (a
/// JSON object; nothing when empty); their names, sorted.
pub async fn label_nodes(
    client: &kube::Client,
    count: usize,
    labels: impl Fn(usize) -> serde_json::Value,
) -> Vec<String> {
    let api: Api<Node> = Api::all(client.clone());
    let mut names: Vec<String> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    names.sort();
    assert_eq!(names.len(), count, "{names:?}");
    for (i, node) in names.iter().enumerate() {
        let labels = labels(i);
        if labels.as_object().is_some_and(|l| !l.is_empty()) {
            api.patch(
                node,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"metadata": {"labels": labels}})),
            )
            .await
            .unwrap();
        }
    }
    names
}

/// Waits until the upper cluster's Ready nodes labelled `clusterID=<base>` are `done`;
/// them, by name. Panics with the tail of `vn`'s log if they never are.
pub async fn ready_virtual_nodes(
    vn: &mut VirtualNode,
    nodes: &Api<Node>,
    base: &str,
    what: &str,
    done: impl Fn(&BTreeMap<String, Node>) -> bool,
) -> BTreeMap<String, Node> {
    let listed = wait_for(&format!("{what} of {base}"), TIMEOUT, || async {
        let list = nodes
            .list(&ListParams::default().labels(&format!("clusterID={base}")))
            .await?;
        let ready: BTreeMap<String, Node> = list
            .items
            .into_iter()
            .filter(node_is_ready)
            .map(|n| (n.metadata.name.clone().unwrap_or_default(), n))
            .collect();
        Ok(done(&ready).then_some(ready))
    })
    .await;
    super::or_log(listed, vn)
}
