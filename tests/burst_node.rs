//! Bursting, the virtual node's side (issue 35): the burst priority as a node label and as
//! the deletion cost of the node's pods (a ReplicaSet's scale-in takes them before a
//! regular node's, the last-filled member's first), the share capping what a node offers,
//! and a user's cordon kept, with nothing new mirrored while it holds. Its own test
//! binary, so its pair has no other tests' pods in it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::path::Path;

use common::descheduler::events;
use common::{TIMEOUT, kubectl, member_secret, running, start_node};
use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tensile::member::spec::{BURST_PRIORITY_ANNOTATION, SHARE_ANNOTATION};
use tensile::node::burst::{BURST_PRIORITY_LABEL, DELETION_COST_ANNOTATION, DELETION_COST_MARK};
use tensile_harness::fixtures::{bound_pod, merge, pinned_spec, pod};
use tensile_harness::{ClusterPair, TestNamespace, wait_for};

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_virtual-node"))
}

async fn annotate(secrets: &Api<Secret>, name: &str, key: &str, value: &str) {
    secrets
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {key: value}}})),
        )
        .await
        .unwrap();
}

async fn wait_label(nodes: &Api<Node>, node: &str, want: &str) {
    wait_for(
        &format!("{node} labelled {BURST_PRIORITY_LABEL}={want}"),
        TIMEOUT,
        || async {
            let node = nodes.get(node).await?;
            Ok((node
                .metadata
                .labels
                .unwrap_or_default()
                .get(BURST_PRIORITY_LABEL)
                == Some(&want.to_owned()))
            .then_some(()))
        },
    )
    .await
    .unwrap();
}

fn annotation(pod: &Pod, key: &str) -> Option<String> {
    pod.metadata.annotations.as_ref()?.get(key).cloned()
}

async fn wait_cost(pods: &Api<Pod>, name: &str, want: &str) {
    wait_for(
        &format!("pod {name} deletion cost {want}"),
        TIMEOUT,
        || async {
            let pod = pods.get(name).await?;
            Ok(
                (annotation(&pod, DELETION_COST_ANNOTATION).as_deref() == Some(want)
                    && annotation(&pod, DELETION_COST_MARK).as_deref() == Some(want))
                .then_some(()),
            )
        },
    )
    .await
    .unwrap();
}

fn ready(pod: &Pod) -> bool {
    running(pod)
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// A pod labelled `app: mix` bound to `node` (a ReplicaSet of that selector adopts it).
fn mix_pod(name: &str, node: &str) -> Pod {
    let mut pod = pod(
        name,
        json!({
            "nodeName": node,
            "tolerations": [tensile_harness::fixtures::virtual_node_toleration()],
            "containers": [{"name": "app", "image": "nginx"}],
        }),
    );
    pod.metadata.labels = Some([("app".to_owned(), "mix".to_owned())].into());
    pod
}

/// Two members on one lower cluster, priorities 1 and 2: labels, deletion costs -2 and -3
/// (a user's cost kept); a priority changed on the running member follows within seconds;
/// a ReplicaSet's scale-in removes the virtual nodes' pods, the higher priority's first,
/// before the pod on a regular node.
#[tokio::test]
async fn burst_priority_labels_nodes_and_burst_pods_leave_first() {
    let pair = ClusterPair::shared().await.unwrap();
    let (a, b, local) = ("vk-burst-a", "vk-burst-b", "burst-local");
    let upper = pair.upper.client().await.unwrap();
    pair.upper.add_nodes(&[local.to_owned()]).await.unwrap();
    let members = TestNamespace::create(&upper, "burst-members")
        .await
        .unwrap();
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    for (node, priority) in [(a, "1"), (b, "2")] {
        let mut secret = member_secret(node, node, &pair.lower.kubeconfig);
        secret
            .metadata
            .annotations
            .get_or_insert_default()
            .insert(BURST_PRIORITY_ANNOTATION.into(), priority.into());
        secrets
            .create(&PostParams::default(), &secret)
            .await
            .unwrap();
    }
    let _vn = pair
        .serve_members(binary(), "vk-burst", &members.name, &[a, b], &[])
        .await
        .unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    wait_label(&nodes, a, "1").await;
    wait_label(&nodes, b, "2").await;

    let ns = TestNamespace::create(&upper, "burst").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    for (name, node) in [("on-local", local), ("on-a", a), ("on-b", b)] {
        pods.create(&PostParams::default(), &mix_pod(name, node))
            .await
            .unwrap();
    }
    let mut users = bound_pod("users-cost", b);
    users
        .metadata
        .annotations
        .get_or_insert_default()
        .insert(DELETION_COST_ANNOTATION.into(), "5".into());
    pods.create(&PostParams::default(), &users).await.unwrap();
    wait_cost(&pods, "on-a", "-2").await;
    wait_cost(&pods, "on-b", "-3").await;
    let local_pod = pods.get("on-local").await.unwrap();
    assert_eq!(annotation(&local_pod, DELETION_COST_ANNOTATION), None);
    wait_for("users-cost running", TIMEOUT, || async {
        Ok(running(&pods.get("users-cost").await?).then_some(()))
    })
    .await
    .unwrap();
    let users = pods.get("users-cost").await.unwrap();
    assert_eq!(
        (
            annotation(&users, DELETION_COST_ANNOTATION).as_deref(),
            annotation(&users, DELETION_COST_MARK)
        ),
        (Some("5"), None),
        "the user's cost is kept"
    );

    // A's priority raised on the running member: label and costs follow, no restart.
    annotate(&secrets, a, BURST_PRIORITY_ANNOTATION, "5").await;
    wait_label(&nodes, a, "5").await;
    wait_cost(&pods, "on-a", "-6").await;

    // Every pod Running and Ready, so the deletion cost decides the scale-in order.
    wait_for("the three pods Ready", TIMEOUT, || async {
        let list = pods.list(&ListParams::default().labels("app=mix")).await?;
        Ok((list.items.len() == 3 && list.items.iter().all(ready)).then_some(()))
    })
    .await
    .unwrap();
    let replica_sets: Api<ReplicaSet> = Api::namespaced(upper.clone(), &ns.name);
    let template = mix_pod("template", local).spec;
    let rs: ReplicaSet = serde_json::from_value(json!({
        "metadata": {"name": "mix"},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "mix"}},
            "template": {"metadata": {"labels": {"app": "mix"}}, "spec": template},
        },
    }))
    .unwrap();
    replica_sets
        .create(&PostParams::default(), &rs)
        .await
        .unwrap();
    wait_for("the ReplicaSet adopts the three pods", TIMEOUT, || async {
        let list = pods.list(&ListParams::default().labels("app=mix")).await?;
        let owned = list
            .items
            .iter()
            .filter(|p| {
                p.metadata
                    .owner_references
                    .as_ref()
                    .is_some_and(|o| !o.is_empty())
            })
            .count();
        Ok((list.items.len() == 3 && owned == 3).then_some(()))
    })
    .await
    .unwrap();
    for (replicas, leaves) in [(2, "on-a"), (1, "on-b")] {
        replica_sets
            .patch(
                "mix",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": replicas}})),
            )
            .await
            .unwrap();
        let left = wait_for(&format!("{replicas} mix pods left"), TIMEOUT, || async {
            let list = pods.list(&ListParams::default().labels("app=mix")).await?;
            let active: Vec<String> = list
                .items
                .iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .filter_map(|p| p.metadata.name.clone())
                .collect();
            Ok((active.len() == replicas).then_some(active))
        })
        .await
        .unwrap();
        assert!(
            !left.contains(&leaves.to_owned()),
            "scaled to {replicas}: {leaves} should have gone first, left {left:?}"
        );
    }
    let left = pods.get_opt("on-local").await.unwrap();
    assert!(
        left.is_some_and(|p| p.metadata.deletion_timestamp.is_none()),
        "the pod on the regular node stays"
    );
}

async fn node_resource(nodes: &Api<Node>, node: &str, resource: &str) -> (String, String) {
    let status = nodes.get(node).await.unwrap().status.unwrap_or_default();
    let get = |list: Option<
        std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    >| {
        list.unwrap_or_default()
            .get(resource)
            .map(|q| q.0.clone())
            .unwrap_or_default()
    };
    (get(status.capacity), get(status.allocatable))
}

async fn wait_resource(nodes: &Api<Node>, node: &str, resource: &str, want: &str) {
    let what = format!("{node} to offer {resource}={want}");
    let result = wait_for(&what, TIMEOUT, || async {
        let (capacity, allocatable) = node_resource(nodes, node, resource).await;
        Ok((capacity == want && allocatable == want).then_some(()))
    })
    .await;
    if let Err(error) = result {
        panic!(
            "{error:#}; last seen {:?}",
            node_resource(nodes, node, resource).await
        );
    }
}

/// Whether the upper scheduler found no room for `pod`.
fn unschedulable(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter().any(|c| {
                c.type_ == "PodScheduled"
                    && c.status == "False"
                    && c.reason.as_deref() == Some("Unschedulable")
            })
        })
}

/// A share caps capacity and allocatable per resource (an extended one too, summed over
/// the lower nodes); lowered below what runs it evicts nothing, offers nothing more, never
/// less than zero; raised again, the room is back: each within seconds, no restart.
#[tokio::test]
async fn a_share_caps_what_a_member_offers() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-shared";
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    // Two lower nodes list an extended resource: the virtual node sums it.
    let lower_nodes: Api<Node> = Api::all(lower.clone());
    for name in ["lower-node-0", "lower-node-1"] {
        let foo = json!({"example.com/foo": "3"});
        lower_nodes
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"capacity": foo, "allocatable": foo}})),
            )
            .await
            .unwrap();
    }
    let members = TestNamespace::create(&upper, "share-members")
        .await
        .unwrap();
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    let mut secret = member_secret(node, node, &pair.lower.kubeconfig);
    secret
        .metadata
        .annotations
        .get_or_insert_default()
        .insert(SHARE_ANNOTATION.into(), "cpu=4".into());
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let _vn = pair
        .serve_members(binary(), "vk-shares", &members.name, &[node], &[])
        .await
        .unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    wait_resource(&nodes, node, "cpu", "4").await;
    wait_resource(&nodes, node, "example.com/foo", "6").await;
    wait_label(&nodes, node, "0").await;
    annotate(&secrets, node, SHARE_ANNOTATION, "cpu=4,example.com/foo=4").await;
    wait_resource(&nodes, node, "example.com/foo", "4").await;

    let ns = TestNamespace::create(&upper, "share").await.unwrap();
    let lower_ns_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let asking = |name: &str, cpu: &str| {
        let mut spec = pinned_spec(node);
        merge(
            &mut spec,
            json!({"containers": [{"name": "app", "image": "nginx",
                "resources": {"requests": {"cpu": cpu}}}]}),
        );
        pod(name, spec)
    };
    pods.create(&PostParams::default(), &asking("runs", "3"))
        .await
        .unwrap();
    wait_for("runs running", TIMEOUT, || async {
        Ok(running(&pods.get("runs").await?).then_some(()))
    })
    .await
    .unwrap();

    // Below what runs: nothing evicted, no room, never negative.
    annotate(&secrets, node, SHARE_ANNOTATION, "cpu=1,example.com/foo=4").await;
    wait_resource(&nodes, node, "cpu", "1").await;
    annotate(&secrets, node, SHARE_ANNOTATION, "cpu=0,example.com/foo=4").await;
    wait_resource(&nodes, node, "cpu", "0").await;
    pods.create(&PostParams::default(), &asking("waits", "1"))
        .await
        .unwrap();
    wait_for("waits found no room", TIMEOUT, || async {
        Ok(unschedulable(&pods.get("waits").await?).then_some(()))
    })
    .await
    .unwrap();
    assert!(
        running(&pods.get("runs").await.unwrap()),
        "nothing running is evicted"
    );
    assert!(
        lower_ns_pods.get_opt("runs").await.unwrap().is_some(),
        "the lower pod stays"
    );
    assert!(lower_ns_pods.get_opt("waits").await.unwrap().is_none());

    // Raised again: the room is back, and the waiting pod lands.
    annotate(&secrets, node, SHARE_ANNOTATION, "cpu=8").await;
    wait_resource(&nodes, node, "cpu", "8").await;
    wait_resource(&nodes, node, "example.com/foo", "6").await;
    wait_for("waits running", TIMEOUT, || async {
        Ok(running(&pods.get("waits").await?).then_some(()))
    })
    .await
    .unwrap();
}

async fn cordoned(nodes: &Api<Node>, node: &str) -> bool {
    nodes
        .get(node)
        .await
        .unwrap()
        .spec
        .and_then(|s| s.unschedulable)
        .unwrap_or(false)
}

/// `kubectl cordon` of a virtual node holds across a restart of virtual-node; a pod bound
/// to it by name is not created below while it does (Pending, with a `NodeCordoned` Event
/// naming the node), pods already below keep running; uncordoned, it is mirrored.
#[tokio::test]
async fn a_cordoned_virtual_node_stays_cordoned_and_takes_nothing_new() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-cordon";
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let mut vn = start_node(pair, node, &["--burst-priority", "3"]).await;
    let nodes: Api<Node> = Api::all(upper.clone());
    wait_label(&nodes, node, "3").await;
    let ns = TestNamespace::create(&upper, "cordon").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    pods.create(&PostParams::default(), &bound_pod("before", node))
        .await
        .unwrap();
    wait_for("before running", TIMEOUT, || async {
        Ok(running(&pods.get("before").await?).then_some(()))
    })
    .await
    .unwrap();
    wait_cost(&pods, "before", "-4").await;

    let out = kubectl(pair, &pair.upper.kubeconfig, &["cordon", node], b"").await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    vn.stop().unwrap();
    let _vn = start_node(pair, node, &["--burst-priority", "3"]).await;
    assert!(cordoned(&nodes, node).await, "cordon kept across a restart");

    pods.create(&PostParams::default(), &bound_pod("after", node))
        .await
        .unwrap();
    let event_api: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    let event = wait_for("a NodeCordoned Event on the pod", TIMEOUT, || async {
        let found = events(&event_api, "NodeCordoned").await;
        Ok(found
            .into_iter()
            .find(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("after")))
    })
    .await
    .unwrap();
    let note = event.note.unwrap_or_default();
    assert!(note.contains(node), "{note}");
    assert!(
        lower_pods.get_opt("after").await.unwrap().is_none(),
        "nothing new below"
    );
    let after = pods.get("after").await.unwrap();
    assert_eq!(
        after.status.and_then(|s| s.phase).as_deref(),
        Some("Pending")
    );
    assert!(
        running(&pods.get("before").await.unwrap()),
        "what runs is reflected"
    );
    assert!(cordoned(&nodes, node).await, "cordon kept");

    let out = kubectl(pair, &pair.upper.kubeconfig, &["uncordon", node], b"").await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for("after running once uncordoned", TIMEOUT, || async {
        Ok(running(&pods.get("after").await?).then_some(()))
    })
    .await
    .unwrap();
}

/// Members that share the upper watches read their cordon from the one watch of every
/// virtual node: a cordoned member's node takes nothing new below while the other member
/// goes on; uncordoned, the pod is mirrored.
#[tokio::test]
async fn a_cordoned_member_takes_nothing_new_while_the_other_goes_on() {
    let pair = ClusterPair::shared().await.unwrap();
    let (a, b) = ("vk-cordon-ma", "vk-cordon-mb");
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let members = TestNamespace::create(&upper, "cordon-members")
        .await
        .unwrap();
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    for node in [a, b] {
        secrets
            .create(
                &PostParams::default(),
                &member_secret(node, node, &pair.lower.kubeconfig),
            )
            .await
            .unwrap();
    }
    let _vn = pair
        .serve_members(binary(), "vk-cordon-m", &members.name, &[a, b], &[])
        .await
        .unwrap();
    let out = kubectl(pair, &pair.upper.kubeconfig, &["cordon", a], b"").await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ns = TestNamespace::create(&upper, "cordon-m").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower, &ns.name);
    let event_api: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    // The cordon reaches member A through the shared watch: from then on a pod bound to A
    // is held back. A pod that raced ahead of the cordon (mirrored below) is replaced by
    // the next one.
    let mut held = None;
    for attempt in 0..10 {
        let name = format!("on-a-{attempt}");
        pods.create(&PostParams::default(), &bound_pod(&name, a))
            .await
            .unwrap();
        let outcome = wait_for("the pod held back or mirrored", TIMEOUT, || async {
            if lower_pods.get_opt(&name).await?.is_some() {
                return Ok(Some(false));
            }
            let found = events(&event_api, "NodeCordoned").await;
            Ok(found
                .iter()
                .any(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(&name))
                .then_some(true))
        })
        .await
        .unwrap();
        if outcome {
            held = Some(name);
            break;
        }
    }
    let held = held.expect("no pod bound to A was held back by its cordon");
    assert!(
        lower_pods.get_opt(&held).await.unwrap().is_none(),
        "nothing new below A"
    );
    pods.create(&PostParams::default(), &bound_pod("on-b", b))
        .await
        .unwrap();
    wait_for("the pod bound to B Running", TIMEOUT, || async {
        Ok(running(&pods.get("on-b").await?).then_some(()))
    })
    .await
    .unwrap();
    let out = kubectl(pair, &pair.upper.kubeconfig, &["uncordon", a], b"").await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_for(
        "the pod bound to A Running once uncordoned",
        TIMEOUT,
        || async { Ok(running(&pods.get(&held).await?).then_some(())) },
    )
    .await
    .unwrap();
    ns.delete().await.unwrap();
}
