//! Node granularity (issue 36): `--node-granularity` and the member annotation
//! `tensile.dev/node-granularity` are read and checked per member. The flags' member runs
//! `node` and `label=<key>` (one virtual node per group of lower nodes: the upper scheduler
//! sees zones and hosts, and capacity per group); member Secrets run them too
//! (`tests/node_granularity_federation.rs`), and a running member's granularity change is
//! refused with a
//! `MemberGranularityChanged` Event while the member keeps running as it was. Its own test
//! binary.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use common::granularity::{labelled_lower, ready_virtual_nodes};
use common::{TIMEOUT, kubectl, member_secret, metric};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Node, Pod, Secret};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tensile::member::spec::GRANULARITY_ANNOTATION;
use tensile::node::groups::{Granularity, virtual_node_name};
use tensile_harness::cluster::KWOK_NODE_ANNOTATION;
use tensile_harness::fixtures::{bound_pod, virtual_node_toleration};
use tensile_harness::invariant;
use tensile_harness::{
    ClusterPair, TestNamespace, VirtualNode, VirtualNodeOptions, node_is_ready, wait_for,
};

/// Waits for an Event of `reason` on the member Secret `secret` whose message says `says`.
async fn event_on(events: &Api<Event>, secret: &str, reason: &str, says: &str) {
    wait_for(
        &format!("a {reason} Event on the member Secret {secret} saying {says:?}"),
        TIMEOUT,
        || async {
            let found = events.list(&ListParams::default()).await?.items;
            Ok(found
                .iter()
                .any(|e| {
                    e.involved_object.name.as_deref() == Some(secret)
                        && e.reason.as_deref() == Some(reason)
                        && e.message.as_deref().is_some_and(|m| m.contains(says))
                })
                .then_some(()))
        },
    )
    .await
    .unwrap();
}

/// The flags: a malformed granularity is a usage error; it registers no Node.
#[tokio::test]
async fn flags_refuse_what_does_not_run() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let nodes: Api<Node> = Api::all(upper);
    for (node, granularity, says) in [("vk-gran-bad", "label=no such key", "is not a label key")] {
        let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), node);
        options.args = vec!["--node-granularity".into(), granularity.into()];
        let mut vn = pair.start_virtual_node(&options).unwrap();
        let deadline = tokio::time::Instant::now() + TIMEOUT;
        let mut poll = tokio::time::interval(std::time::Duration::from_millis(200));
        while vn.check_running().is_ok() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "virtual-node {node} still runs after {TIMEOUT:?}"
            );
            poll.tick().await;
        }
        let log = std::fs::read_to_string(vn.log()).unwrap();
        assert!(log.contains(says), "{node}: log says {says:?}:\n{log}");
        assert!(
            nodes.get_opt(node).await.unwrap().is_none(),
            "{node} registered"
        );
    }
}

/// Member Secrets: one joined as `cluster` runs; changing the running member's annotation
/// to `node` is refused with an Event and the member keeps its node (the same Node, Ready)
/// and its place.
#[tokio::test]
async fn a_member_keeps_its_granularity() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let members = TestNamespace::create(&upper, "gran-members").await.unwrap();
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    let events: Api<Event> = Api::namespaced(upper.clone(), &members.name);
    let nodes: Api<Node> = Api::all(upper.clone());
    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), "vk-gran");
    options.flags_member = false;
    options.args = vec!["--members-namespace".into(), members.name.clone()];
    let mut vn = pair.start_virtual_node(&options).unwrap();

    secrets
        .create(
            &PostParams::default(),
            &member_secret("lower-whole", "vk-gran-whole", &pair.lower.kubeconfig),
        )
        .await
        .unwrap();

    let ready = wait_for("node vk-gran-whole Ready", TIMEOUT, || async {
        Ok(nodes.get_opt("vk-gran-whole").await?.filter(node_is_ready))
    })
    .await;
    let whole = match ready {
        Ok(node) => node,
        Err(error) => {
            let _ = vn.check_running();
            panic!(
                "{error:#}\n{}",
                tensile_harness::process::tail(vn.log(), 40)
            );
        }
    };

    secrets
        .patch(
            "lower-whole",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {GRANULARITY_ANNOTATION: "node"}}})),
        )
        .await
        .unwrap();
    event_on(
        &events,
        "lower-whole",
        "MemberGranularityChanged",
        "from cluster to node on a running member: refused, the member keeps running as cluster",
    )
    .await;
    let after = nodes.get("vk-gran-whole").await.unwrap();
    assert_eq!(after.metadata.uid, whole.metadata.uid, "the same Node");
    assert!(node_is_ready(&after), "still Ready");
    assert_eq!(
        metric(&vn, r#"tensile_member_up{node="vk-gran-whole"}"#).await,
        1,
        "the member still runs"
    );
    vn.check_running().unwrap();
}

/// The zone label the `label=` scene groups by.
const ZONE: &str = "topology.kubernetes.io/zone";

/// A lower cluster beside the shared pair: 6 kwok nodes of 4 CPU, two in each of the zones
/// `zone-a`, `zone-b`, `zone-c`; their names, sorted.
async fn zoned_lower(pair: &ClusterPair) -> (tensile_harness::Cluster, Vec<String>) {
    labelled_lower(
        pair,
        "lower-gran",
        6,
        (Ipv4Addr::new(10, 94, 0, 0), 16),
        "10.249.0.0/16",
        |i| {
            let zone = ["zone-a", "zone-b", "zone-c"][i / 2];
            json!({ZONE: zone})
        },
    )
    .await
}

/// Starts the flags' member `base` of `granularity` on the lower cluster `kubeconfig` and
/// waits until the upper cluster shows `want` Ready virtual nodes labelled `clusterID=base`;
/// them, by name.
async fn start_grouped(
    pair: &ClusterPair,
    upper: &kube::Client,
    kubeconfig: &std::path::Path,
    base: &str,
    granularity: &str,
    want: usize,
) -> (VirtualNode, BTreeMap<String, Node>) {
    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), base);
    options.lower_kubeconfig = Some(kubeconfig.to_owned());
    options.args = vec!["--node-granularity".into(), granularity.into()];
    let mut vn = pair.start_virtual_node(&options).unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    let what = format!("{want} Ready virtual nodes");
    let listed = ready_virtual_nodes(&mut vn, &nodes, base, &what, |r| r.len() == want).await;
    (vn, listed)
}

/// Waits for the `LowerGroupGone` Event on `node` (its name and UID) naming `group`.
async fn group_gone_event(upper: &kube::Client, node: &Node, group: &str) {
    let events: Api<Event> = Api::namespaced(upper.clone(), "default");
    let says = format!("every lower node of group {group} is gone");
    wait_for("a LowerGroupGone Event on the node", TIMEOUT, || async {
        let found = events.list(&ListParams::default()).await?.items;
        Ok(found
            .iter()
            .any(|e| {
                e.involved_object.name == node.metadata.name
                    && e.involved_object.uid == node.metadata.uid
                    && e.reason.as_deref() == Some("LowerGroupGone")
                    && e.message.as_deref().is_some_and(|m| m.contains(&says))
            })
            .then_some(()))
    })
    .await
    .unwrap();
}

/// A ValidatingAdmissionPolicy (and its binding) of the upper cluster that refuses to
/// create the Node `name`.
struct RefuseNode(String);

impl RefuseNode {
    /// Deletes the policy and its binding.
    async fn lift(self, pair: &ClusterPair) {
        for kind in [
            "validatingadmissionpolicybinding",
            "validatingadmissionpolicy",
        ] {
            let out = kubectl(
                pair,
                pair.upper_kubeconfig(),
                &["delete", kind, &self.0],
                b"",
            )
            .await;
            assert!(out.status.success(), "{out:?}");
        }
    }
}

/// Refuses the creation of the Node `name` in the upper cluster until lifted; returns once
/// the API server refuses it.
async fn refuse_node(pair: &ClusterPair, name: &str) -> RefuseNode {
    let policy = format!("refuse-{name}");
    apply(
        pair,
        &json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": policy},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [{
                    "apiGroups": [""], "apiVersions": ["v1"],
                    "operations": ["CREATE"], "resources": ["nodes"],
                }]},
                "validations": [{
                    "expression": format!("object.metadata.name != '{name}'"),
                    "message": "refused by the test",
                }],
            },
        }),
    )
    .await;
    apply(
        pair,
        &json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": policy},
            "spec": {"policyName": policy, "validationActions": ["Deny"]},
        }),
    )
    .await;
    let nodes: Api<Node> = Api::all(pair.upper.client().await.unwrap());
    let probe: Node = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    wait_for(&format!("Node {name} refused"), TIMEOUT, || async {
        Ok(nodes.create(&dry_run, &probe).await.is_err().then_some(()))
    })
    .await
    .unwrap();
    RefuseNode(policy)
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

/// Waits until `n` pods labelled `app=<app>` run below (in `namespace`) and their upper
/// pods are bound; each upper pod's node beside its lower pod's node, by pod name.
async fn placed(
    upper: &Api<Pod>,
    lower: &Api<Pod>,
    app: &str,
    n: usize,
) -> BTreeMap<String, (String, String)> {
    wait_for(
        &format!("{n} pods of {app} running below"),
        TIMEOUT,
        || async {
            let selector = ListParams::default().labels(&format!("app={app}"));
            let below: BTreeMap<String, String> = lower
                .list(&selector)
                .await?
                .items
                .iter()
                .filter(|p| common::running(p))
                .filter_map(|p| {
                    Some((
                        p.metadata.name.clone()?,
                        p.spec.as_ref()?.node_name.clone()?,
                    ))
                })
                .collect();
            let above: BTreeMap<String, String> = upper
                .list(&selector)
                .await?
                .items
                .iter()
                .filter_map(|p| {
                    Some((
                        p.metadata.name.clone()?,
                        p.spec.as_ref()?.node_name.clone()?,
                    ))
                })
                .collect();
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

/// `label=topology.kubernetes.io/zone` over 6 lower nodes in 3 zones: 3 virtual nodes, each
/// with its zone; a Deployment spread over zones (maxSkew 1, DoNotSchedule) goes 2/2/2, and
/// each lower pod runs in the zone of its virtual node. `node` over the same nodes: 6
/// virtual nodes of 4 CPU each; required anti-affinity by hostname puts each replica on a
/// lower node of its own (its virtual node's), and a 6-CPU pod stays Pending upstairs
/// though the lower cluster has 24 CPU free; a lower node cordoned (uncordoned) cordons
/// (uncordons) its virtual node, one NotReady makes its virtual node NotReady (and Ready
/// again), one added makes a virtual node, and one removed drains its virtual node (its pod
/// evicted, the lower copy gone) and deletes it; the invariant holds after each step.
#[tokio::test]
async fn one_virtual_node_per_zone_and_per_lower_node() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let (lower, lower_names) = zoned_lower(pair).await;
    let lower_client = lower.client().await.unwrap();
    let lower_nodes: Api<Node> = Api::all(lower_client.clone());
    let zone_of = |node: &Node| {
        node.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(ZONE))
            .cloned()
    };

    // label=<zone>.
    let (mut by_zone, zones) = start_grouped(
        pair,
        &upper,
        &lower.kubeconfig,
        "vk-zg",
        "label=topology.kubernetes.io/zone",
        3,
    )
    .await;
    let shown: Vec<Option<String>> = zones.values().map(zone_of).collect();
    assert_eq!(
        shown,
        [
            Some("zone-a".into()),
            Some("zone-b".into()),
            Some("zone-c".into())
        ],
        "each zone's virtual node shows its zone: {:?}",
        zones.keys().collect::<Vec<_>>()
    );
    let ns = TestNamespace::create(&upper, "gran-zone").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower_client.clone(), &ns.name);
    apply(
        pair,
        &json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "spread", "namespace": ns.name},
            "spec": {
                "replicas": 6,
                "selector": {"matchLabels": {"app": "spread"}},
                "template": {
                    "metadata": {"labels": {"app": "spread"}},
                    "spec": {
                        "nodeSelector": {"type": "virtual-kubelet", "clusterID": "vk-zg"},
                        "tolerations": [virtual_node_toleration()],
                        "topologySpreadConstraints": [{
                            "maxSkew": 1, "topologyKey": ZONE,
                            "whenUnsatisfiable": "DoNotSchedule",
                            "labelSelector": {"matchLabels": {"app": "spread"}},
                        }],
                        "containers": [{"name": "app", "image": "nginx"}],
                    },
                },
            },
        }),
    )
    .await;
    let placed_zones = placed(&upper_pods, &lower_pods, "spread", 6).await;
    let mut per_zone: BTreeMap<String, usize> = BTreeMap::new();
    for (pod, (up, down)) in &placed_zones {
        let up_zone = zone_of(&zones[up]);
        let down_zone = zone_of(&lower_nodes.get(down).await.unwrap());
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
    kubectl(
        pair,
        pair.upper_kubeconfig(),
        &["delete", "deployment", "spread", "-n", &ns.name],
        b"",
    )
    .await;
    wait_for("the spread pods gone below", TIMEOUT, || async {
        Ok(lower_pods
            .list(&ListParams::default())
            .await?
            .items
            .is_empty()
            .then_some(()))
    })
    .await
    .unwrap();
    by_zone.check_running().unwrap();
    by_zone.stop().unwrap();

    // node.
    let (mut each, hosts) =
        start_grouped(pair, &upper, &lower.kubeconfig, "vk-ng", "node", 6).await;
    let want: Vec<String> = lower_names
        .iter()
        .map(|n| virtual_node_name("vk-ng", &Granularity::Node, n))
        .collect();
    assert_eq!(hosts.keys().cloned().collect::<Vec<_>>(), want);
    for (name, node) in &hosts {
        let cpu = node
            .status
            .as_ref()
            .and_then(|s| s.capacity.as_ref())
            .and_then(|c| c.get("cpu"));
        assert_eq!(
            cpu.map(|q| q.0.as_str()),
            Some("4"),
            "{name}: one lower node's CPU"
        );
    }
    apply(
        pair,
        &json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "apart", "namespace": ns.name},
            "spec": {
                "replicas": 4,
                "selector": {"matchLabels": {"app": "apart"}},
                "template": {
                    "metadata": {"labels": {"app": "apart"}},
                    "spec": {
                        "nodeSelector": {"type": "virtual-kubelet", "clusterID": "vk-ng"},
                        "tolerations": [virtual_node_toleration()],
                        "affinity": {"podAntiAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": [{
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": {"app": "apart"}},
                            }],
                        }},
                        "containers": [{"name": "app", "image": "nginx"}],
                    },
                },
            },
        }),
    )
    .await;
    let apart = placed(&upper_pods, &lower_pods, "apart", 4).await;
    let mut below: Vec<&String> = Vec::new();
    for (pod, (up, down)) in &apart {
        assert_eq!(
            *up,
            virtual_node_name("vk-ng", &Granularity::Node, down),
            "{pod}: runs below on its virtual node's lower node"
        );
        below.push(down);
    }
    below.sort();
    below.dedup();
    assert_eq!(
        below.len(),
        4,
        "each replica on its own lower node: {apart:?}"
    );

    let big: Pod = serde_json::from_value(json!({
        "metadata": {"name": "big"},
        "spec": {
            "nodeSelector": {"type": "virtual-kubelet", "clusterID": "vk-ng"},
            "tolerations": [virtual_node_toleration()],
            "containers": [{"name": "app", "image": "nginx",
                            "resources": {"requests": {"cpu": "6"}}}],
        },
    }))
    .unwrap();
    upper_pods
        .create(&PostParams::default(), &big)
        .await
        .unwrap();
    let pending = wait_for("the 6-CPU pod found unschedulable", TIMEOUT, || async {
        let pod = upper_pods.get("big").await?;
        let unschedulable = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| {
                c.iter().any(|c| {
                    c.type_ == "PodScheduled"
                        && c.status == "False"
                        && c.reason.as_deref() == Some("Unschedulable")
                })
            });
        Ok(unschedulable.then_some(pod))
    })
    .await
    .unwrap();
    assert!(
        pending
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none(),
        "the 6-CPU pod is bound to no node"
    );
    assert!(
        lower_pods.get_opt("big").await.unwrap().is_none(),
        "no copy of the 6-CPU pod below"
    );

    // Following the lower cluster, the invariant checked after each step: a lower node
    // added makes a virtual node; one cordoned cordons its virtual node (and uncordoned
    // lifts that cordon); one NotReady makes its virtual node NotReady (and Ready again);
    // one removed drains its virtual node (its pod evicted upstairs, the lower copy gone)
    // and deletes it and its Lease.
    let nodes: Api<Node> = Api::all(upper.clone());
    let mut all: BTreeSet<String> = want.iter().cloned().collect();
    let holds = |step: &'static str, all: BTreeSet<String>| {
        let (upper, lower_client, ns) = (upper.clone(), lower_client.clone(), ns.name.clone());
        async move {
            let report =
                invariant::converge_nodes(&upper, &lower_client, "vk-ng", &all, Some(&ns), TIMEOUT)
                    .await
                    .unwrap();
            assert!(report.holds(), "after {step}: {report}");
        }
    };
    holds("start", all.clone()).await;
    // The added lower node's virtual node cannot be registered at first (an admission
    // policy refuses its Node): tried again with backoff, the member's other virtual
    // nodes run on; registered once the policy is gone.
    let added = "lower-gran-added".to_owned();
    let added_vn = virtual_node_name("vk-ng", &Granularity::Node, &added);
    let refuse = refuse_node(pair, &added_vn).await;
    lower.add_nodes(std::slice::from_ref(&added)).await.unwrap();
    let retried = "registering the virtual node failed; trying again";
    wait_for("a registration tried again", TIMEOUT, || async {
        let log = std::fs::read_to_string(each.log())?;
        Ok(log
            .lines()
            .any(|l| l.contains(retried) && l.contains(&added_vn))
            .then_some(()))
    })
    .await
    .unwrap();
    each.check_running().unwrap();
    let log = std::fs::read_to_string(each.log()).unwrap();
    assert!(
        !log.contains("member failed; restarting it"),
        "the member runs on:\n{}",
        tensile_harness::process::tail(each.log(), 40)
    );
    for other in &want {
        assert!(
            node_is_ready(&nodes.get(other).await.unwrap()),
            "{other} stays Ready"
        );
    }
    refuse.lift(pair).await;
    wait_for(
        &format!("{added_vn} Ready for the added lower node"),
        TIMEOUT,
        || async { Ok(nodes.get_opt(&added_vn).await?.filter(node_is_ready)) },
    )
    .await
    .unwrap();
    all.insert(added_vn.clone());
    holds("a lower node added", all.clone()).await;

    let last = lower_names.last().unwrap();
    let its = virtual_node_name("vk-ng", &Granularity::Node, last);
    let cordon = |on: bool| json!({"spec": {"unschedulable": if on { Some(true) } else { None }}});
    for (step, cordoned) in [("cordoned", true), ("uncordoned", false)] {
        lower_nodes
            .patch(
                last,
                &PatchParams::default(),
                &Patch::Merge(cordon(cordoned)),
            )
            .await
            .unwrap();
        wait_for(
            &format!("{its} {step} as its lower node"),
            TIMEOUT,
            || async {
                let node = nodes.get(&its).await?;
                let now = node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true);
                Ok((now == cordoned).then_some(()))
            },
        )
        .await
        .unwrap();
        holds(step, all.clone()).await;
    }

    // NotReady below: kwok no longer manages the lower node, whose Ready turns False.
    lower_nodes
        .patch(
            last,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {KWOK_NODE_ANNOTATION: null}}})),
        )
        .await
        .unwrap();
    let mut below = lower_nodes.get_status(last).await.unwrap();
    for condition in below
        .status
        .as_mut()
        .and_then(|s| s.conditions.as_mut())
        .unwrap()
        .iter_mut()
        .filter(|c| c.type_ == "Ready")
    {
        condition.status = "False".into();
        condition.reason = Some("KubeletNotReady".into());
    }
    lower_nodes
        .replace_status(last, &PostParams::default(), &below)
        .await
        .unwrap();
    let not_ready = wait_for(
        &format!("{its} NotReady as its lower node"),
        TIMEOUT,
        || async { Ok(nodes.get(&its).await?).map(|n| (!node_is_ready(&n)).then_some(n)) },
    )
    .await
    .unwrap();
    let condition = not_ready
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(
        (condition.status.as_str(), condition.reason.as_deref()),
        ("False", Some("LowerNodesNotReady")),
        "{condition:?}"
    );
    assert!(
        condition
            .message
            .as_deref()
            .is_some_and(|m| m.contains(&format!("every lower node of group {last} is NotReady"))),
        "{condition:?}"
    );
    for other in &want[..5] {
        assert!(
            node_is_ready(&nodes.get(other).await.unwrap()),
            "{other} stays Ready"
        );
    }
    holds("a lower node NotReady", all.clone()).await;
    lower_nodes
        .patch(
            last,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {KWOK_NODE_ANNOTATION: "fake"}}})),
        )
        .await
        .unwrap();
    wait_for(&format!("{its} Ready again"), TIMEOUT, || async {
        Ok(nodes.get_opt(&its).await?.filter(node_is_ready))
    })
    .await
    .unwrap();
    holds("a lower node Ready again", all.clone()).await;

    // A pod on the virtual node whose lower node goes.
    let drained_uid = upper_pods
        .create(&PostParams::default(), &bound_pod("drained", &its))
        .await
        .unwrap()
        .metadata
        .uid;
    wait_for(
        "the pod on the leaving node running below",
        TIMEOUT,
        || async {
            let below = lower_pods.get_opt("drained").await?;
            Ok(below
                .filter(common::running)
                .and_then(|p| p.spec.and_then(|s| s.node_name))
                .filter(|n| n == last)
                .map(drop))
        },
    )
    .await
    .unwrap();
    holds("a pod on the leaving node", all.clone()).await;
    let leaving = nodes.get(&its).await.unwrap();
    lower_nodes
        .delete(last, &DeleteParams::default())
        .await
        .unwrap();
    wait_for(
        &format!("{its} drained and deleted once its lower node is gone"),
        TIMEOUT,
        || async {
            let gone = nodes.get_opt(&its).await?.is_none();
            let pod = upper_pods.get_opt("drained").await?;
            let evicted = pod.is_none_or(|p| p.metadata.uid != drained_uid);
            Ok((gone && evicted).then_some(()))
        },
    )
    .await
    .unwrap();
    let leases: Api<Lease> = Api::namespaced(upper.clone(), "kube-node-lease");
    assert!(
        leases.get_opt(&its).await.unwrap().is_none(),
        "{its}: the Lease goes with the Node"
    );
    wait_for("the drained pod's lower copy gone", TIMEOUT, || async {
        Ok(lower_pods.get_opt("drained").await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    group_gone_event(&upper, &leaving, last).await;
    holds("a lower node removed", all.clone()).await;

    // A group back while its virtual node drains: a PodDisruptionBudget holds the drain
    // (its one pod may not go); the lower node returns: the drain stops, the leave's
    // cordon is lifted, the same Node and pod stay.
    apply(
        pair,
        &json!({
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": "kept", "namespace": ns.name},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "kept"}}},
        }),
    )
    .await;
    let kept_uid = upper_pods
        .create(&PostParams::default(), &bound_pod("kept", &added_vn))
        .await
        .unwrap()
        .metadata
        .uid;
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(upper.clone(), &ns.name);
    wait_for("the budget allows no disruption", TIMEOUT, || async {
        let status = pdbs.get("kept").await?.status;
        Ok(status
            .filter(|s| s.current_healthy == Some(1) && s.disruptions_allowed.unwrap_or(0) == 0)
            .map(drop))
    })
    .await
    .unwrap();
    let before = nodes.get(&added_vn).await.unwrap();
    lower_nodes
        .delete(&added, &DeleteParams::default())
        .await
        .unwrap();
    let leave_cordon = |node: &Node| {
        !tensile_harness::node_is_schedulable(node)
            && node
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("tensile.dev/cordoned-by"))
                .is_some_and(|by| by == "leave")
    };
    wait_for(&format!("{added_vn} draining"), TIMEOUT, || async {
        Ok(nodes.get_opt(&added_vn).await?.filter(leave_cordon))
    })
    .await
    .unwrap();
    lower.add_nodes(std::slice::from_ref(&added)).await.unwrap();
    let back = wait_for(
        &format!("{added_vn} uncordoned and Ready once its lower node is back"),
        TIMEOUT,
        || async {
            Ok(nodes.get_opt(&added_vn).await?.filter(|n| {
                node_is_ready(n)
                    && tensile_harness::node_is_schedulable(n)
                    && n.metadata
                        .annotations
                        .as_ref()
                        .is_none_or(|a| !a.contains_key("tensile.dev/cordoned-by"))
            }))
        },
    )
    .await
    .unwrap();
    assert_eq!(back.metadata.uid, before.metadata.uid, "the same Node");
    let kept = upper_pods.get("kept").await.unwrap();
    assert_eq!(kept.metadata.uid, kept_uid, "the budget's pod stays");
    assert!(
        kept.metadata.deletion_timestamp.is_none(),
        "the budget's pod is not evicted"
    );
    holds("a lower node back during its drain", all.clone()).await;
    for other in &want[..5] {
        let node = nodes.get(other).await.unwrap();
        assert!(
            tensile_harness::node_is_schedulable(&node),
            "{other} untouched"
        );
    }

    upper_pods
        .delete("big", &DeleteParams::default())
        .await
        .unwrap();
    each.check_running().unwrap();
    each.stop().unwrap();
    ns.delete().await.unwrap();
}

/// High availability of a member of `node` granularity: two processes with
/// `--leader-elect`; the leader registers one virtual node per lower node and mirrors pods
/// bound to them; SIGKILLed, the standby takes the Lease, keeps every virtual node (the
/// same Node, Ready), re-creates no lower pod and mirrors the pods created after.
#[tokio::test]
async fn a_grouped_members_standby_takes_over_its_virtual_nodes() {
    use common::ha::{FAST_LEASE, LEASE_NAMESPACE, create_pods, until_held_by};

    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let (lower, _) = labelled_lower(
        pair,
        "lower-granha",
        2,
        (Ipv4Addr::new(10, 92, 0, 0), 16),
        "10.250.0.0/16",
        |_| json!({}),
    )
    .await;
    let lower_client = lower.client().await.unwrap();
    let base = "vk-granha";
    let process = |identity: &str| {
        let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), base);
        options.lower_kubeconfig = Some(lower.kubeconfig.clone());
        options.args = vec![
            "--node-granularity".into(),
            "node".into(),
            "--leader-elect".into(),
            format!("--leader-elect-identity={identity}"),
        ];
        options
            .args
            .extend(FAST_LEASE.iter().map(ToString::to_string));
        options
    };
    let nodes: Api<Node> = Api::all(upper.clone());
    let grouped = ListParams::default().labels(&format!(
        "{}={base}",
        tensile::node::groups::MEMBER_NODE_LABEL
    ));
    let ready_nodes = || async {
        wait_for("2 Ready virtual nodes of vk-granha", TIMEOUT, || async {
            let ready: BTreeMap<String, Option<String>> = nodes
                .list(&grouped)
                .await?
                .items
                .into_iter()
                .filter(node_is_ready)
                .map(|n| (n.metadata.name.clone().unwrap_or_default(), n.metadata.uid))
                .collect();
            Ok((ready.len() == 2).then_some(ready))
        })
        .await
        .unwrap()
    };
    let mut leader = pair.start_virtual_node(&process("a")).unwrap();
    let before = ready_nodes().await;
    let mut standby = pair.start_virtual_node(&process("b")).unwrap();
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(upper.clone(), LEASE_NAMESPACE);

    let ns = TestNamespace::create(&upper, "gran-ha").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower_client.clone(), &ns.name);
    let names: Vec<&String> = before.keys().collect();
    for (i, node) in names.iter().enumerate() {
        create_pods(&upper_pods, node, (0..3).map(|j| format!("before-{i}-{j}"))).await;
    }
    let mirrored = wait_for("6 lower pods", TIMEOUT, || async {
        let uids = invariant::uids_by_name(&lower_pods).await?;
        Ok((uids.len() == 6).then_some(uids))
    })
    .await
    .unwrap();
    let killed = std::time::Instant::now();
    leader.kill().unwrap();
    until_held_by(&leases, base, "b", killed).await;
    for (i, node) in names.iter().enumerate() {
        create_pods(&upper_pods, node, (0..3).map(|j| format!("after-{i}-{j}"))).await;
    }
    wait_for("12 upper pods Running, 12 lower pods", TIMEOUT, || async {
        let pods = upper_pods.list(&ListParams::default()).await?.items;
        let running = pods.len() == 12 && pods.iter().all(common::running);
        let below = lower_pods.list(&ListParams::default()).await?.items.len();
        Ok((running && below == 12).then_some(()))
    })
    .await
    .unwrap();
    let after = invariant::uids_by_name(&lower_pods).await.unwrap();
    for (name, uid) in &mirrored {
        assert_eq!(
            after.get(name),
            Some(uid),
            "lower pod {name} was re-created"
        );
    }
    assert_eq!(
        ready_nodes().await,
        before,
        "the same virtual nodes, Ready, after the takeover"
    );
    standby.check_running().unwrap();
    ns.delete().await.unwrap();
    standby.stop().unwrap();
}

/// A group gone while no process ran: the member's Node of zone `b` (a pod on it, running
/// below) outlives its process; its lower node is deleted meanwhile. Started again, the
/// member finds the Node by its `tensile.dev/member-node` label, drains it as it drains a
/// group gone at run time (the pod evicted, its lower copy deleted, `LowerGroupGone` on
/// the Node) and deletes it with its Lease; zone `a` keeps its Node, Ready.
#[tokio::test]
async fn a_group_gone_while_the_process_was_down_is_drained_at_start() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let (lower, lower_names) = labelled_lower(
        pair,
        "lower-gdown",
        2,
        (Ipv4Addr::new(10, 91, 0, 0), 16),
        "10.241.0.0/16",
        |i| json!({ZONE: if i == 0 { "zone-a" } else { "zone-b" }}),
    )
    .await;
    let lower_client = lower.client().await.unwrap();
    let base = "vk-gdown";
    let granularity = "label=topology.kubernetes.io/zone";
    let (mut vn, zones) =
        start_grouped(pair, &upper, &lower.kubeconfig, base, granularity, 2).await;
    let (kept, left) = ("vk-gdown-zone-a", "vk-gdown-zone-b");
    assert!(
        zones.contains_key(kept) && zones.contains_key(left),
        "{zones:?}"
    );
    let ns = TestNamespace::create(&upper, "gran-down").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower_client.clone(), &ns.name);
    let left_uid = upper_pods
        .create(&PostParams::default(), &bound_pod("left", left))
        .await
        .unwrap()
        .metadata
        .uid;
    wait_for("the pod of zone b running below", TIMEOUT, || async {
        Ok(lower_pods
            .get_opt("left")
            .await?
            .filter(common::running)
            .map(drop))
    })
    .await
    .unwrap();
    vn.stop().unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    let before = nodes.get(left).await.unwrap();
    Api::<Node>::all(lower_client.clone())
        .delete(&lower_names[1], &DeleteParams::default())
        .await
        .unwrap();

    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), base);
    options.lower_kubeconfig = Some(lower.kubeconfig.clone());
    options.args = vec!["--node-granularity".into(), granularity.into()];
    let mut again = pair.start_virtual_node(&options).unwrap();
    let drained = wait_for(
        &format!("{left} drained and deleted after the start"),
        TIMEOUT,
        || async {
            let gone = nodes.get_opt(left).await?.is_none();
            let pod = upper_pods.get_opt("left").await?;
            let evicted = pod.is_none_or(|p| p.metadata.uid != left_uid);
            let below = lower_pods.get_opt("left").await?.is_none();
            Ok((gone && evicted && below).then_some(()))
        },
    )
    .await;
    if let Err(error) = drained {
        let _ = again.check_running();
        panic!(
            "{error:#}\n{}",
            tensile_harness::process::tail(again.log(), 60)
        );
    }
    let leases: Api<Lease> = Api::namespaced(upper.clone(), "kube-node-lease");
    assert!(
        leases.get_opt(left).await.unwrap().is_none(),
        "the Lease goes with the Node"
    );
    group_gone_event(&upper, &before, "zone-b").await;
    let still = ready_virtual_nodes(&mut again, &nodes, base, "zone a's node", |r| {
        r.len() == 1 && r.contains_key(kept)
    })
    .await;
    assert_eq!(
        still[kept].metadata.uid, zones[kept].metadata.uid,
        "zone a keeps its Node"
    );
    again.check_running().unwrap();
    again.stop().unwrap();
    ns.delete().await.unwrap();
}
