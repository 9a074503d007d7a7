//! Node granularity for federated members (issue 36): a member Secret asking for
//! `label=<key>` runs one virtual node per value beside a `cluster` member, the pods of
//! all its virtual nodes routed to it from the one shared upper pod watch; a later member
//! whose virtual node would take one of its names is refused that one group
//! (`MemberNodeNameClash` on its Secret) and runs the others. Its own test binary.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use common::granularity::{labelled_lower, ready_virtual_nodes};
use common::{TIMEOUT, kubectl, member_secret, metric};
use k8s_openapi::api::core::v1::{Event, Node, Pod, Secret};
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;
use tensile::member::spec::GRANULARITY_ANNOTATION;
use tensile_harness::fixtures::virtual_node_toleration;
use tensile_harness::{
    ClusterPair, TestNamespace, VirtualNode, VirtualNodeOptions, node_is_ready, wait_for,
};

/// The zone label member A groups by.
const ZONE: &str = "topology.kubernetes.io/zone";
/// The pool label member C groups by.
const POOL: &str = "example.com/pool";

/// A lower cluster beside the shared pair: 6 kwok nodes of 4 CPU, two in each of the zones
/// `zone-a`, `zone-b`, `zone-c`; those of `zone-a` in pool `a`, the others in pool `x`.
async fn zoned_lower(pair: &ClusterPair) -> tensile_harness::Cluster {
    let labels = |i: usize| {
        let (zone, pool) = (
            ["zone-a", "zone-b", "zone-c"][i / 2],
            if i / 2 == 0 { "a" } else { "x" },
        );
        json!({ZONE: zone, POOL: pool})
    };
    let (lower, _) = labelled_lower(
        pair,
        "lower-fedgran",
        6,
        (Ipv4Addr::new(10, 93, 0, 0), 16),
        "10.243.0.0/16",
        labels,
    )
    .await;
    lower
}

/// A member Secret `name` for node `node` on the cluster of `kubeconfig`, of `granularity`
/// (none: `cluster`).
fn member(
    name: &str,
    node: &str,
    kubeconfig: &std::path::Path,
    granularity: Option<&str>,
) -> Secret {
    let mut secret = member_secret(name, node, kubeconfig);
    if let Some(granularity) = granularity {
        secret
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(GRANULARITY_ANNOTATION.into(), granularity.into());
    }
    secret
}

/// Waits until the upper cluster shows the Ready nodes labelled `clusterID=<base>` named
/// `want`; them, by name. Panics with the tail of `vn`'s log if they do not show.
async fn ready_nodes(
    vn: &mut VirtualNode,
    nodes: &Api<Node>,
    base: &str,
    want: &[&str],
) -> BTreeMap<String, Node> {
    let what = format!("the Ready virtual nodes {want:?}");
    ready_virtual_nodes(vn, nodes, base, &what, |r| {
        r.keys().eq(want.iter().copied())
    })
    .await
}

/// Waits until `n` pods labelled `app=<app>` run below (in `lower`) and their upper pods
/// (in `upper`) are Running, the lower status reflected; each upper pod's node beside its
/// lower pod's node, by pod name.
async fn running_both(
    upper: &Api<Pod>,
    lower: &Api<Pod>,
    app: &str,
    n: usize,
) -> BTreeMap<String, (String, String)> {
    wait_for(
        &format!("{n} pods of {app} running below and above"),
        TIMEOUT,
        || async {
            let selector = ListParams::default().labels(&format!("app={app}"));
            let on_nodes = |pods: Vec<Pod>| -> BTreeMap<String, String> {
                pods.iter()
                    .filter(|p| common::running(p))
                    .filter_map(|p| {
                        Some((
                            p.metadata.name.clone()?,
                            p.spec.as_ref()?.node_name.clone()?,
                        ))
                    })
                    .collect()
            };
            let below = on_nodes(lower.list(&selector).await?.items);
            let above = on_nodes(upper.list(&selector).await?.items);
            let both: BTreeMap<String, (String, String)> = above
                .into_iter()
                .filter_map(|(name, up)| Some((name.clone(), (up, below.get(&name)?.clone()))))
                .collect();
            Ok((both.len() == n).then_some(both))
        },
    )
    .await
    .unwrap()
}

/// Applies `object` to the upper cluster with the pinned kubectl.
async fn apply(pair: &ClusterPair, object: &serde_json::Value) {
    let out = kubectl(
        pair,
        pair.upper_kubeconfig(),
        &["apply", "-f", "-"],
        object.to_string().as_bytes(),
    )
    .await;
    assert!(out.status.success(), "{out:?}");
}

/// A Deployment `name` of `replicas` in `namespace` on the virtual nodes labelled
/// `clusterID=<cluster_id>`, spread over zones (maxSkew 1, DoNotSchedule) if `spread`.
fn deployment(
    namespace: &str,
    name: &str,
    replicas: u32,
    cluster_id: &str,
    spread: bool,
) -> serde_json::Value {
    let mut spec = json!({
        "nodeSelector": {"type": "virtual-kubelet", "clusterID": cluster_id},
        "tolerations": [virtual_node_toleration()],
        "containers": [{"name": "app", "image": "nginx"}],
    });
    if spread {
        spec["topologySpreadConstraints"] = json!([{
            "maxSkew": 1, "topologyKey": ZONE,
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"app": name}},
        }]);
    }
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": spec},
        },
    })
}

/// One federated process, two members: A (`label=topology.kubernetes.io/zone`, 6 lower
/// nodes in 3 zones) shows 3 Ready virtual nodes, and a Deployment spread over zones
/// (maxSkew 1, DoNotSchedule) goes 2/2/2, each lower copy in its virtual node's zone, its
/// status reflected up; B (`cluster`) runs its pod as before. Then member C
/// (`label=example.com/pool` on the same lower nodes, named so that its pool `a` makes
/// A's `vk-fz-zone-a`) is refused that one virtual node with a `MemberNodeNameClash`
/// Event on its Secret naming both members, registers its other one, and leaves A's
/// Node, its UID and its pods as they were.
#[tokio::test]
async fn federated_members_run_one_virtual_node_per_zone() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let zoned = zoned_lower(pair).await;
    let zoned_client = zoned.client().await.unwrap();
    let zoned_nodes: Api<Node> = Api::all(zoned_client.clone());
    let members = TestNamespace::create(&upper, "fedgran-members")
        .await
        .unwrap();
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    let events: Api<Event> = Api::namespaced(upper.clone(), &members.name);
    let nodes: Api<Node> = Api::all(upper.clone());
    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), "vk-fz-proc");
    options.flags_member = false;
    options.args = vec!["--members-namespace".into(), members.name.clone()];
    let mut vn = pair.start_virtual_node(&options).unwrap();

    for secret in [
        member(
            "fz-a",
            "vk-fz",
            &zoned.kubeconfig,
            Some(&format!("label={ZONE}")),
        ),
        member("fz-b", "vk-fz-whole", &pair.lower.kubeconfig, None),
    ] {
        secrets
            .create(&PostParams::default(), &secret)
            .await
            .unwrap();
    }
    let zones = ready_nodes(
        &mut vn,
        &nodes,
        "vk-fz",
        &["vk-fz-zone-a", "vk-fz-zone-b", "vk-fz-zone-c"],
    )
    .await;
    ready_nodes(&mut vn, &nodes, "vk-fz-whole", &["vk-fz-whole"]).await;
    let zone_of = |node: &Node| {
        node.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(ZONE))
            .cloned()
    };
    let shown: Vec<Option<String>> = zones.values().map(zone_of).collect();
    assert_eq!(
        shown,
        ["zone-a", "zone-b", "zone-c"].map(|z| Some(z.to_owned())),
        "each zone's virtual node shows its zone"
    );

    // A: spread over its zones, each copy below in its zone.
    let ns = TestNamespace::create(&upper, "fedgran").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    apply(pair, &deployment(&ns.name, "spread", 6, "vk-fz", true)).await;
    let zoned_pods: Api<Pod> = Api::namespaced(zoned_client.clone(), &ns.name);
    let spread = running_both(&upper_pods, &zoned_pods, "spread", 6).await;
    let mut per_zone: BTreeMap<String, usize> = BTreeMap::new();
    for (pod, (up, down)) in &spread {
        let up_zone = zone_of(&zones[up]);
        let down_zone = zone_of(&zoned_nodes.get(down).await.unwrap());
        assert_eq!(
            up_zone, down_zone,
            "{pod}: on {up} upstairs, on {down} below"
        );
        *per_zone.entry(up_zone.unwrap_or_default()).or_default() += 1;
    }
    assert_eq!(
        per_zone.values().copied().collect::<Vec<_>>(),
        [2, 2, 2],
        "spread 2/2/2 over the zones: {per_zone:?}"
    );

    // B: its pod runs below in its own lower cluster, as before.
    apply(
        pair,
        &deployment(&ns.name, "whole", 1, "vk-fz-whole", false),
    )
    .await;
    let pair_lower_pods: Api<Pod> = Api::namespaced(pair.lower.client().await.unwrap(), &ns.name);
    let whole = running_both(&upper_pods, &pair_lower_pods, "whole", 1).await;
    assert!(
        whole.values().all(|(up, _)| up == "vk-fz-whole"),
        "{whole:?}"
    );
    assert!(
        zoned_pods
            .list(&ListParams::default().labels("app=whole"))
            .await
            .unwrap()
            .items
            .is_empty(),
        "B's pod is not A's"
    );

    // C: its pool `a` would be A's vk-fz-zone-a.
    secrets
        .create(
            &PostParams::default(),
            &member(
                "fz-c",
                "vk-fz-zone",
                &zoned.kubeconfig,
                Some(&format!("label={POOL}")),
            ),
        )
        .await
        .unwrap();
    ready_nodes(&mut vn, &nodes, "vk-fz-zone", &["vk-fz-zone-x"]).await;
    let found = wait_for(
        "a MemberNodeNameClash Event on the member Secret fz-c",
        TIMEOUT,
        || async {
            let found = events.list(&ListParams::default()).await?.items;
            Ok(found.into_iter().find(|e| {
                e.involved_object.name.as_deref() == Some("fz-c")
                    && e.reason.as_deref() == Some("MemberNodeNameClash")
            }))
        },
    )
    .await
    .unwrap();
    let says = found.message.unwrap_or_default();
    for named in [
        "vk-fz-zone-a",
        &format!("member Secret {}/fz-c", members.name),
        &format!("member Secret {}/fz-a", members.name),
    ] {
        assert!(says.contains(named), "the Event names {named}: {says}");
    }
    let kept = nodes.get("vk-fz-zone-a").await.unwrap();
    assert_eq!(
        kept.metadata.uid, zones["vk-fz-zone-a"].metadata.uid,
        "A's Node is the same"
    );
    assert!(node_is_ready(&kept), "A's Node is still Ready");
    assert_eq!(
        kept.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("clusterID"))
            .map(String::as_str),
        Some("vk-fz"),
        "A's Node is still A's"
    );
    for member in ["vk-fz", "vk-fz-whole", "vk-fz-zone"] {
        assert_eq!(
            metric(&vn, &format!("tensile_member_up{{node=\"{member}\"}}")).await,
            1,
            "member {member} runs"
        );
    }
    // A's pods stay, each once below, and C made no copy of them.
    let again = running_both(&upper_pods, &zoned_pods, "spread", 6).await;
    assert_eq!(again, spread, "A's pods are where they were");
    let marked_by_c = zoned_pods
        .list(&ListParams::default().labels(&format!(
            "{}=vk-fz-zone",
            tensile::translate::meta::OWNER_NODE_LABEL
        )))
        .await
        .unwrap()
        .items;
    assert!(marked_by_c.is_empty(), "C copied none of A's pods");

    // A leaves: every one of its virtual nodes is drained and deleted (not only a Node
    // named `vk-fz`, which a member of zones never had), and its lower copies go; the name
    // C was refused is then C's.
    let a_uid = kept.metadata.uid.clone();
    secrets.delete("fz-a", &Default::default()).await.unwrap();
    wait_for(
        "member A's zone Nodes deleted, C's pool a registered",
        TIMEOUT,
        || async {
            for name in ["vk-fz-zone-b", "vk-fz-zone-c"] {
                if nodes.get_opt(name).await?.is_some() {
                    return Ok(None);
                }
            }
            let taken = nodes.get_opt("vk-fz-zone-a").await?;
            Ok(taken
                .filter(|n| {
                    n.metadata.uid != a_uid
                        && n.metadata
                            .labels
                            .as_ref()
                            .and_then(|l| l.get(tensile::node::groups::MEMBER_NODE_LABEL))
                            .is_some_and(|m| m == "vk-fz-zone")
                })
                .map(|_| ()))
        },
    )
    .await
    .unwrap();
    let a_marks = ListParams::default().labels(&format!(
        "{}=vk-fz",
        tensile::translate::meta::OWNER_NODE_LABEL
    ));
    wait_for("member A's lower pods deleted", TIMEOUT, || async {
        Ok(zoned_pods
            .list(&a_marks)
            .await?
            .items
            .is_empty()
            .then_some(()))
    })
    .await
    .unwrap();
    let b = nodes.get("vk-fz-whole").await.unwrap();
    assert!(node_is_ready(&b), "B is untouched by A's leave");
    vn.check_running().unwrap();
    ns.delete().await.unwrap();
}
