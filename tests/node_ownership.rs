//! One owner per upper Node (issue 48): a virtual node is the member's that registered it
//! (recorded on it, `tensile.dev/registered-by`), and no other process, member or lower
//! cluster writes, adopts, drains or deletes it. A lower cluster's node label that names
//! another installation's Node is refused (`MemberNodeNameClash` on that Node) and removing
//! it drains nothing; a member Secret naming another process's node is refused
//! (`MemberNodeNameTaken`) and deleting it drains nothing; a group admitted late (its Node
//! unreadable at start) keeps its lower pods and is served within a backoff. Also the
//! per-node duties of a group's virtual node: its own cordon holds its pods back, its
//! labels follow what its lower nodes agree on, and none a kubelet may not set on itself
//! comes from below. Its own test binary.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{TIMEOUT, kubectl, member_secret, or_log, running};
use k8s_openapi::api::core::v1::{Event, Node, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tensile::member::spec::GRANULARITY_ANNOTATION;
use tensile::node::groups::{Granularity, virtual_node_name};
use tensile::node::owner::NODE_OWNER_ANNOTATION;
use tensile_harness::fault_proxy::FaultProxy;
use tensile_harness::fixtures::bound_pod;
use tensile_harness::{
    ClusterPair, TestNamespace, VirtualNode, VirtualNodeOptions, node_is_ready, wait_for,
};

/// The lower node label the groups of these tests are made by.
const POOL: &str = "example.com/own-pool";
/// How long a Node and its pods are watched for a change that must not come.
const QUIET: Duration = Duration::from_secs(8);

/// Starts `virtual-node --nodename node` with `args` on the pair; waits until the Node
/// `ready` is Ready.
async fn start(pair: &ClusterPair, node: &str, args: &[&str], ready: &str) -> VirtualNode {
    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), node);
    options.args = args.iter().map(|a| (*a).to_owned()).collect();
    let mut vn = pair.start_virtual_node(&options).unwrap();
    wait_ready(pair, &mut vn, ready).await;
    vn
}

/// Waits until the upper Node `name` is Ready; panics with `vn`'s log if it never is.
async fn wait_ready(pair: &ClusterPair, vn: &mut VirtualNode, name: &str) -> Node {
    let nodes: Api<Node> = Api::all(pair.upper.client().await.unwrap());
    let ready = wait_for(&format!("node {name} Ready"), TIMEOUT, || async {
        Ok(nodes.get_opt(name).await?.filter(node_is_ready))
    })
    .await;
    or_log(ready, vn)
}

/// Adds kwok nodes `names` to the pair's lower cluster, each labelled `labels`.
async fn add_lower_nodes(pair: &ClusterPair, names: &[&str], labels: serde_json::Value) {
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    pair.lower.add_nodes(&names).await.unwrap();
    label_lower(pair, &names, labels).await;
}

/// Merges `labels` (null removes) into the lower nodes `names`.
async fn label_lower(pair: &ClusterPair, names: &[String], labels: serde_json::Value) {
    let nodes: Api<Node> = Api::all(pair.lower.client().await.unwrap());
    for name in names {
        nodes
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": labels}})),
            )
            .await
            .unwrap();
    }
}

/// Creates the pod `name` bound to `node` in `ns` and waits until its lower copy runs;
/// the lower pod's UID.
async fn running_below(pair: &ClusterPair, ns: &str, name: &str, node: &str) -> String {
    let upper: Api<Pod> = Api::namespaced(pair.upper.client().await.unwrap(), ns);
    upper
        .create(&PostParams::default(), &bound_pod(name, node))
        .await
        .unwrap();
    lower_running(pair, ns, name).await
}

/// Waits until the lower pod `ns/name` runs; its UID.
async fn lower_running(pair: &ClusterPair, ns: &str, name: &str) -> String {
    let lower: Api<Pod> = Api::namespaced(pair.lower.client().await.unwrap(), ns);
    wait_for(&format!("{ns}/{name} running below"), TIMEOUT, || async {
        Ok(lower
            .get_opt(name)
            .await?
            .filter(running)
            .and_then(|p| p.metadata.uid))
    })
    .await
    .unwrap()
}

/// Waits for an Event `reason` on the object `name` of `uid` (any, when `None`) in
/// `namespace` whose message says `says`.
async fn event_on(
    upper: &kube::Client,
    namespace: &str,
    (name, uid): (&str, Option<&str>),
    reason: &str,
    says: &str,
) -> Event {
    let events: Api<Event> = Api::namespaced(upper.clone(), namespace);
    wait_for(
        &format!("a {reason} Event on {name} saying {says:?}"),
        TIMEOUT,
        || async {
            let found = events.list(&ListParams::default()).await?.items;
            Ok(found.into_iter().find(|e| {
                e.involved_object.name.as_deref() == Some(name)
                    && uid.is_none_or(|uid| e.involved_object.uid.as_deref() == Some(uid))
                    && e.reason.as_deref() == Some(reason)
                    && e.message.as_deref().is_some_and(|m| m.contains(says))
            }))
        },
    )
    .await
    .unwrap()
}

/// What must not change of a Node: its UID, labels, owner, readiness and cordon.
type Fingerprint = (
    Option<String>,
    BTreeMap<String, String>,
    Option<String>,
    bool,
    Option<bool>,
);

/// [`Fingerprint`] of `node`.
fn fingerprint(node: &Node) -> Fingerprint {
    (
        node.metadata.uid.clone(),
        node.metadata.labels.clone().unwrap_or_default(),
        node.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(NODE_OWNER_ANNOTATION))
            .cloned(),
        node_is_ready(node),
        node.spec.as_ref().and_then(|s| s.unschedulable),
    )
}

/// Over [`QUIET`], the Node `name` stays as `before` (its heartbeat aside), the lower pod
/// `ns/pod` stays the one of `uid`, running, and its upper pod Running.
async fn untouched(
    pair: &ClusterPair,
    name: &str,
    before: &Node,
    (ns, pod, uid): (&str, &str, &str),
) {
    let nodes: Api<Node> = Api::all(pair.upper.client().await.unwrap());
    let upper: Api<Pod> = Api::namespaced(pair.upper.client().await.unwrap(), ns);
    let lower: Api<Pod> = Api::namespaced(pair.lower.client().await.unwrap(), ns);
    let until = tokio::time::Instant::now() + QUIET;
    while tokio::time::Instant::now() < until {
        let now = nodes.get(name).await.unwrap();
        assert_eq!(
            fingerprint(&now),
            fingerprint(before),
            "node {name} changed"
        );
        let below = lower.get(pod).await.unwrap();
        assert_eq!(
            below.metadata.uid.as_deref(),
            Some(uid),
            "{ns}/{pod} replaced"
        );
        assert!(running(&below), "{ns}/{pod} no longer runs");
        let above = upper.get(pod).await.unwrap();
        assert!(
            above.metadata.deletion_timestamp.is_none()
                && above.status.and_then(|s| s.phase).as_deref() == Some("Running"),
            "the upper pod {ns}/{pod} is Running, not being deleted"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// H1, with a group's own cordon (M5) and labels (M6): a process of `label=` granularity
/// whose lower cluster offers a group named like another process's virtual node refuses
/// it (`MemberNodeNameClash` on that Node), takes nothing of it, and drains nothing when
/// the group goes; its own group's node, cordoned with kubectl, takes no new pod
/// (`NodeCordoned` naming it) until uncordoned, and shows only the labels its lower nodes
/// agree on.
#[tokio::test]
async fn a_lower_cluster_never_takes_or_drains_another_installs_node() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    let ns = TestNamespace::create(&upper, "own-h1").await.unwrap();
    let granularity = Granularity::Label(POOL.into());
    let (gpu, cpu) = (
        virtual_node_name("vk-own", &granularity, "gpu"),
        virtual_node_name("vk-own", &granularity, "cpu"),
    );
    assert_eq!(gpu, "vk-own-gpu");
    // Another installation's virtual node, with a running pod.
    let mut other = start(pair, &gpu, &[], &gpu).await;
    let lower_uid = running_below(pair, &ns.name, "theirs", &gpu).await;
    let before = nodes.get(&gpu).await.unwrap();
    assert_eq!(
        fingerprint(&before).2.as_deref(),
        Some("nodename/vk-own-gpu"),
        "the owner is recorded"
    );

    add_lower_nodes(
        pair,
        &["own-gpu", "own-cpu"],
        json!({"topology.kubernetes.io/zone": "z1"}),
    )
    .await;
    label_lower(pair, &["own-gpu".into()], json!({POOL: "gpu"})).await;
    // M7: labels a kubelet may not set on itself, offered by the lower node and matched
    // by the patterns, never reach the virtual node; an allowed one does.
    label_lower(
        pair,
        &["own-cpu".into()],
        json!({
            POOL: "cpu",
            "node-role.kubernetes.io/control-plane": "",
            "node-restriction.kubernetes.io/x": "y",
            "example.com/team": "a",
        }),
    )
    .await;
    let label = format!("label={POOL}");
    let patterns = "node-role.kubernetes.io/*,node-restriction.kubernetes.io/*,example.com/team";
    let mut grouped = start(
        pair,
        "vk-own",
        &[
            "--node-granularity",
            &label,
            "--lower-node-labels",
            patterns,
        ],
        &cpu,
    )
    .await;
    let shown = nodes
        .get(&cpu)
        .await
        .unwrap()
        .metadata
        .labels
        .unwrap_or_default();
    assert_eq!(shown.get("example.com/team").map(String::as_str), Some("a"));
    for refused in [
        "node-role.kubernetes.io/control-plane",
        "node-restriction.kubernetes.io/x",
    ] {
        assert!(
            !shown.contains_key(refused),
            "{refused} on {cpu}: {shown:?}"
        );
    }
    let log = std::fs::read_to_string(grouped.log()).unwrap();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("lower node labels refused")
            && l.contains("node-role.kubernetes.io/control-plane")
            && l.contains("node-restriction.kubernetes.io/x")),
        "a warning names the refused labels:\n{}",
        tensile_harness::process::tail(grouped.log(), 40)
    );
    event_on(
        &upper,
        "default",
        (&gpu, before.metadata.uid.as_deref()),
        "MemberNodeNameClash",
        &format!("virtual node {gpu} (group \"gpu\") of --nodename vk-own is not registered"),
    )
    .await;
    untouched(pair, &gpu, &before, (&ns.name, "theirs", &lower_uid)).await;

    // M6: the group's node shows what its one lower node says; a node of another arch and
    // zone joining the group takes both off.
    let cpu_node = nodes.get(&cpu).await.unwrap();
    let labels = cpu_node.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels
            .get("topology.kubernetes.io/zone")
            .map(String::as_str),
        Some("z1")
    );
    assert_eq!(
        labels.get("kubernetes.io/arch").map(String::as_str),
        Some("amd64")
    );
    add_lower_nodes(
        pair,
        &["own-cpu-arm"],
        json!({POOL: "cpu", "kubernetes.io/arch": "arm64", "topology.kubernetes.io/zone": "z2"}),
    )
    .await;
    wait_for("arch and zone off the group's node", TIMEOUT, || async {
        let labels = nodes.get(&cpu).await?.metadata.labels.unwrap_or_default();
        Ok((!labels.contains_key("kubernetes.io/arch")
            && !labels.contains_key("beta.kubernetes.io/arch")
            && !labels.contains_key("topology.kubernetes.io/zone"))
        .then_some(()))
    })
    .await
    .unwrap();

    // M5: kubectl cordon on the group's node holds a pod bound to it by name.
    let out = kubectl(pair, pair.upper_kubeconfig(), &["cordon", &cpu], b"").await;
    assert!(out.status.success(), "{out:?}");
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let seen = format!("node=\"{cpu}\"");
    wait_for("the cordon seen", TIMEOUT, || async {
        let log = std::fs::read_to_string(grouped.log())?;
        Ok(log
            .lines()
            .any(|l| {
                l.contains("node cordon changed")
                    && l.contains(&seen)
                    && l.contains("cordoned=true")
            })
            .then_some(()))
    })
    .await
    .unwrap();
    upper_pods
        .create(&PostParams::default(), &bound_pod("held", &cpu))
        .await
        .unwrap();
    event_on(
        &upper,
        &ns.name,
        ("held", None),
        "NodeCordoned",
        &format!("virtual node {cpu} is cordoned"),
    )
    .await;
    let lower_pods: Api<Pod> = Api::namespaced(pair.lower.client().await.unwrap(), &ns.name);
    assert!(
        lower_pods.get_opt("held").await.unwrap().is_none(),
        "nothing is created below for a cordoned node"
    );
    let out = kubectl(pair, pair.upper_kubeconfig(), &["uncordon", &cpu], b"").await;
    assert!(out.status.success(), "{out:?}");
    lower_running(pair, &ns.name, "held").await;

    // The groups go below: the member's own node is drained and deleted; the other's is
    // not touched.
    let cpu_uid = nodes.get(&cpu).await.unwrap().metadata.uid;
    label_lower(
        pair,
        &["own-gpu".into(), "own-cpu".into(), "own-cpu-arm".into()],
        json!({POOL: null}),
    )
    .await;
    wait_for("the group's node drained and deleted", TIMEOUT, || async {
        Ok(nodes
            .get_opt(&cpu)
            .await?
            .is_none_or(|n| n.metadata.uid != cpu_uid)
            .then_some(()))
    })
    .await
    .unwrap();
    untouched(pair, &gpu, &before, (&ns.name, "theirs", &lower_uid)).await;
    grouped.check_running().unwrap();
    other.check_running().unwrap();
}

/// M4: a member Secret naming another process's virtual node is refused
/// (`MemberNodeNameTaken` on the Secret), the Node untouched; deleting the Secret drains
/// nothing.
#[tokio::test]
async fn a_member_secret_never_takes_another_processs_node() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    let ns = TestNamespace::create(&upper, "own-m4").await.unwrap();
    let mut prod = start(pair, "vk-own-prod", &[], "vk-own-prod").await;
    let lower_uid = running_below(pair, &ns.name, "prod", "vk-own-prod").await;
    let before = nodes.get("vk-own-prod").await.unwrap();

    let members = TestNamespace::create(&upper, "own-members").await.unwrap();
    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), "vk-own-fed");
    options.flags_member = false;
    options.args = vec!["--members-namespace".into(), members.name.clone()];
    let mut federated = pair.start_virtual_node(&options).unwrap();
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    let secret = secrets
        .create(
            &PostParams::default(),
            &member_secret("takes-prod", "vk-own-prod", &pair.lower.kubeconfig),
        )
        .await
        .unwrap();
    event_on(
        &upper,
        &members.name,
        ("takes-prod", secret.metadata.uid.as_deref()),
        "MemberNodeNameTaken",
        "node name vk-own-prod is taken",
    )
    .await;
    untouched(pair, "vk-own-prod", &before, (&ns.name, "prod", &lower_uid)).await;
    secrets
        .delete("takes-prod", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the Secret gone", TIMEOUT, || async {
        Ok(secrets.get_opt("takes-prod").await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    untouched(pair, "vk-own-prod", &before, (&ns.name, "prod", &lower_uid)).await;
    federated.check_running().unwrap();
    prod.check_running().unwrap();
}

/// H2: a member Secret of `label=` granularity whose process restarts while its group's
/// Node cannot be read (its first GETs fail) keeps its pods below (none deleted as an
/// orphan meanwhile: the pod is bound to a Node labelled as the member's) and serves the
/// group once the Node reads again (its pods handed to the member by the shared watch):
/// an upper change reaches the lower pod, still the first one.
#[tokio::test]
async fn a_group_admitted_late_keeps_and_serves_its_pods() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let ns = TestNamespace::create(&upper, "own-h2").await.unwrap();
    let key = "example.com/own-late";
    let group = virtual_node_name("vk-own-late", &Granularity::Label(key.into()), "x");
    add_lower_nodes(pair, &["own-late"], json!({key: "x"})).await;
    let members = TestNamespace::create(&upper, "own-late-members")
        .await
        .unwrap();
    let proxy = FaultProxy::start(upper.clone()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut options =
        VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), "vk-own-late-proc");
    options.flags_member = false;
    options.args = vec!["--members-namespace".into(), members.name.clone()];
    options.upper_kubeconfig = Some(
        proxy
            .write_kubeconfig(&dir.path().join("upper.kubeconfig"))
            .unwrap(),
    );
    let mut secret = member_secret("late", "vk-own-late", &pair.lower.kubeconfig);
    secret
        .metadata
        .annotations
        .get_or_insert_default()
        .insert(GRANULARITY_ANNOTATION.into(), format!("label={key}"));
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let mut vn = pair.start_virtual_node(&options).unwrap();
    wait_ready(pair, &mut vn, &group).await;
    let lower_uid = running_below(pair, &ns.name, "late", &group).await;
    let before = Api::<Node>::all(upper.clone()).get(&group).await.unwrap();

    // Restarted while every read of the group's Node fails, for two rounds of orphan
    // collection at least; then the Node reads again.
    vn.kill().unwrap();
    let path = format!("/api/v1/nodes/{group}");
    proxy.fail_gets(&path, u64::MAX);
    let mut vn = pair.start_virtual_node(&options).unwrap();
    wait_for("two orphan collection rounds", TIMEOUT, || async {
        let Ok(text) = tokio::time::timeout(Duration::from_secs(5), metrics_text(&vn)).await else {
            return Ok(None);
        };
        Ok(text
            .lines()
            .find_map(|l| l.strip_prefix("tensile_gc_rounds_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|rounds| *rounds >= 2.0))
    })
    .await
    .unwrap();
    assert!(proxy.gets_left_to_fail() < u64::MAX, "the Node was read");
    proxy.fail_gets(&path, 0);
    // Served: an upper label change reaches the lower pod, which is still the first one.
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    upper_pods
        .patch(
            "late",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"served": "yes"}}})),
        )
        .await
        .unwrap();
    let lower_pods: Api<Pod> = Api::namespaced(pair.lower.client().await.unwrap(), &ns.name);
    let below = wait_for("the label below", TIMEOUT, || async {
        Ok(lower_pods.get_opt("late").await?.filter(|p| {
            p.metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.get("served").is_some_and(|v| v == "yes"))
        }))
    })
    .await;
    let below = or_log(below, &mut vn);
    assert_eq!(
        below.metadata.uid.as_deref(),
        Some(lower_uid.as_str()),
        "the lower pod was never deleted"
    );
    // Its group is below all along: its Node is not taken for one left behind (drained).
    untouched(pair, &group, &before, (&ns.name, "late", &lower_uid)).await;
    let log = std::fs::read_to_string(vn.log()).unwrap();
    assert!(
        !log.contains("deleted an orphaned lower pod"),
        "no orphan collected:\n{}",
        tensile_harness::process::tail(vn.log(), 40)
    );
    vn.check_running().unwrap();
}

/// The metrics endpoint's answer, or `""` while it does not answer.
async fn metrics_text(vn: &VirtualNode) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(("127.0.0.1", vn.metrics_port)).await
    else {
        return String::new();
    };
    let mut text = String::new();
    if stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .is_ok()
    {
        let _ = stream.read_to_string(&mut text).await;
    }
    text
}
