//! The life of a federated member (`--members-namespace`) through restarts, stuck lower
//! clusters, standbys and renames:
//! - a member restarted after a panic counts its pods once (the first run's stores are
//!   not kept alive in the gauges);
//! - a member whose lower API server answers `/version` and then nothing holds up no
//!   other membership change;
//! - a federated standby with `--startup-timeout` stays up and is ready;
//! - renaming a member's node is refused: the member keeps its Node and runs on.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::ha::{FAST_LEASE, LEASE_NAMESPACE, holder, lease_name, reachable};
use common::{TIMEOUT, metric, metrics_text};
use k8s_openapi::ByteString;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Node, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tensile::member::INJECT_PANIC_ENV;
use tensile::member::spec::{KUBECONFIG_KEY, MEMBER_LABEL, NODE_NAME_ANNOTATION};
use tensile_harness::virtual_node::join_member;
use tensile_harness::{
    ClusterPair, TestNamespace, VirtualNode, VirtualNodeOptions, node_is_ready, wait_for,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_virtual-node"))
}

/// Waits for an Event of `reason` on the member Secret `secret` whose note says `says`.
async fn event_on(events: &Api<Event>, secret: &str, reason: &str, says: &str) -> String {
    wait_for(
        &format!("a {reason} event on {secret}"),
        TIMEOUT,
        || async {
            let found = events.list(&ListParams::default()).await?.items;
            Ok(found
                .into_iter()
                .find(|e| {
                    e.involved_object.name.as_deref() == Some(secret)
                        && e.reason.as_deref() == Some(reason)
                        && e.message.as_deref().is_some_and(|m| m.contains(says))
                })
                .and_then(|e| e.message))
        },
    )
    .await
    .unwrap()
}

/// Waits until Node `node` is Ready, with the process's log tail on failure.
async fn node_ready(nodes: &Api<Node>, node: &str, vn: &mut VirtualNode, within: Duration) {
    let ready = wait_for(&format!("node {node} Ready"), within, || async {
        Ok(nodes.get_opt(node).await?.filter(node_is_ready).map(|_| ()))
    })
    .await;
    if let Err(error) = ready {
        let _ = vn.check_running();
        panic!(
            "{error:#}\n{}",
            tensile_harness::process::tail(vn.log(), 60)
        );
    }
}

/// A process serving the members of `namespace` (no member of its flags).
fn serve_members(
    pair: &ClusterPair,
    process: &str,
    namespace: &str,
    args: &[String],
    envs: &[(&str, &str)],
) -> VirtualNode {
    let mut options = VirtualNodeOptions::new(binary(), process);
    options.flags_member = false;
    options.args = ["--members-namespace".to_owned(), namespace.to_owned()]
        .into_iter()
        .chain(args.iter().cloned())
        .collect();
    options.envs = envs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    pair.start_virtual_node(&options).unwrap()
}

/// Deletes the member Secrets `names` (their members leave) and waits for `nodes` to go.
async fn leave(upper: &Client, namespace: &str, names: &[&str], nodes: &[&str]) {
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), namespace);
    for name in names {
        let _ = secrets.delete(name, &DeleteParams::default()).await;
    }
    let api: Api<Node> = Api::all(upper.clone());
    wait_for("the members left", Duration::from_secs(180), || async {
        let mut left = true;
        for node in nodes {
            left &= api.get_opt(node).await?.is_none();
        }
        Ok(left.then_some(()))
    })
    .await
    .unwrap();
}

/// Item 4 of issue 33: each run of a member registers gauges that hold its stores; a
/// restart (here after a panic) must replace them, not add to them. With N pods mirrored,
/// `tensile_mirrored_objects{kind="pods"}` reads N after the restart (2N when the first
/// run's stores were kept), and the stores' estimated memory is not doubled.
#[tokio::test]
async fn a_member_restarted_after_a_panic_counts_its_pods_once() {
    const PODS: usize = 8;
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let node = "vk-life-panic";
    let members = TestNamespace::create(&upper, "life-panic").await.unwrap();
    join_member(
        binary(),
        &pair.upper.kubeconfig,
        &pair.lower.kubeconfig,
        node,
        &members.name,
    )
    .await
    .unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    let mut first = serve_members(pair, "vk-life-panic-1", &members.name, &[], &[]);
    node_ready(&nodes, node, &mut first, TIMEOUT).await;
    let ns = TestNamespace::create(&upper, "life-panic-pods")
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    common::ha::create_pods(&pods, node, (0..PODS).map(|i| format!("p{i}"))).await;
    common::wait_running(&pods, "", PODS).await;
    let pods_series = r#"tensile_mirrored_objects{kind="pods"}"#;
    let memory_series = r#"tensile_memory_bytes{owner="lower pods"}"#;
    wait_for("the first process counting every pod", TIMEOUT, || async {
        Ok((metric(&first, pods_series).await == PODS as u64).then_some(()))
    })
    .await
    .unwrap();
    let memory_before = metric(&first, memory_series).await;
    first.stop().unwrap();

    // The same member in a new process, where a task of it panics a moment after it
    // started: its pods are in its stores by then.
    let mut vn = serve_members(
        pair,
        "vk-life-panic-2",
        &members.name,
        &[],
        &[(INJECT_PANIC_ENV, node)],
    );
    let events: Api<Event> = Api::namespaced(upper.clone(), &members.name);
    event_on(&events, node, "MemberFailed", "panicked").await;
    let up = format!(r#"tensile_member_up{{node="{node}"}}"#);
    wait_for("the member up again after its panic", TIMEOUT, || async {
        let up = metric(&vn, &up).await == 1;
        Ok((up && metric(&vn, pods_series).await >= PODS as u64).then_some(()))
    })
    .await
    .unwrap();
    vn.check_running().unwrap();
    // Steady: every look over a few seconds reads N, never 2N.
    let steady = Instant::now();
    while steady.elapsed() < Duration::from_secs(3) {
        let text = metrics_text(&vn).await;
        let counted = metric(&vn, pods_series).await;
        assert_eq!(
            counted, PODS as u64,
            "{pods_series} after the restart (the first run's store kept: 2N)\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let memory_after = metric(&vn, memory_series).await;
    assert!(
        memory_after * 10 <= memory_before * 11,
        "{memory_series}: {memory_before} before the restart, {memory_after} after"
    );

    ns.delete().await.unwrap();
    leave(&upper, &members.name, &[node], &[node]).await;
    vn.stop().unwrap();
    members.delete().await.unwrap();
}

/// A lower API server that answers `/version` and then nothing: every other request is
/// held open, never answered. Counts the requests it holds.
struct HangingApiServer {
    url: String,
    held: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for HangingApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl HangingApiServer {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let held = Arc::new(AtomicU64::new(0));
        let counter = held.clone();
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((stream, _)) = listener.accept().await {
                connections.spawn(Self::serve(stream, counter.clone()));
            }
        });
        Self { url, held, task }
    }

    /// Answers each `/version` on `stream`; holds the first other request forever.
    async fn serve(mut stream: tokio::net::TcpStream, held: Arc<AtomicU64>) {
        let version = json!({
            "major": "1", "minor": "31", "gitVersion": "v1.31.0", "gitCommit": "hang",
            "gitTreeState": "clean", "buildDate": "2024-01-01T00:00:00Z",
            "goVersion": "go1.22", "compiler": "gc", "platform": "linux/amd64",
        })
        .to_string();
        let mut buffer = Vec::new();
        loop {
            let mut chunk = [0u8; 4096];
            let Ok(n) = stream.read(&mut chunk).await else {
                return;
            };
            if n == 0 {
                return;
            }
            buffer.extend_from_slice(&chunk[..n]);
            let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") else {
                continue;
            };
            let head = String::from_utf8_lossy(&buffer[..end]).into_owned();
            buffer.drain(..end + 4);
            if head.starts_with("GET /version") {
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{version}",
                    version.len()
                );
                if stream.write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
                continue;
            }
            held.fetch_add(1, Ordering::Relaxed);
            // Held open, never answered (until the client gives up on it).
            let mut rest = [0u8; 4096];
            while let Ok(n) = stream.read(&mut rest).await {
                if n == 0 {
                    return;
                }
            }
            return;
        }
    }

    /// A kubeconfig of this server, with an inline token (as `join` writes).
    fn kubeconfig(&self) -> String {
        json!({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "hang", "cluster": {"server": self.url}}],
            "users": [{"name": "hang", "user": {"token": "not-a-real-token"}}],
            "contexts": [{"name": "hang", "context": {"cluster": "hang", "user": "hang"}}],
            "current-context": "hang",
        })
        .to_string()
    }
}

/// Item 9 of issue 33: a member whose lower API server answers `/version` and then hangs
/// sits in its start-up; its Secret patched (which restarts it), a new member Secret still
/// joins within 30 s: the stuck member's stop does not wait on its hung calls.
#[tokio::test]
async fn a_stuck_member_holds_up_no_other_join() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let hanging = HangingApiServer::start().await;
    let members = TestNamespace::create(&upper, "life-stuck").await.unwrap();
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    let mut stuck = Secret::default();
    stuck.metadata.name = Some("stuck".into());
    stuck.metadata.labels = Some([(MEMBER_LABEL.to_owned(), "true".to_owned())].into());
    stuck.metadata.annotations =
        Some([(NODE_NAME_ANNOTATION.to_owned(), "vk-life-stuck".to_owned())].into());
    stuck.data = Some(
        [(
            KUBECONFIG_KEY.to_owned(),
            ByteString(hanging.kubeconfig().into_bytes()),
        )]
        .into(),
    );
    secrets
        .create(&PostParams::default(), &stuck)
        .await
        .unwrap();
    let mut vn = serve_members(pair, "vk-life-stuck-p", &members.name, &[], &[]);
    wait_for("the stuck member's start-up hanging", TIMEOUT, || async {
        Ok((hanging.held.load(Ordering::Relaxed) > 0).then_some(()))
    })
    .await
    .unwrap();
    // A change to its Secret restarts the stuck member.
    let patch = json!({"metadata": {"annotations": {"tensile.dev/client-qps": "50"}}});
    secrets
        .patch("stuck", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let node = "vk-life-joins";
    let joined = Instant::now();
    join_member(
        binary(),
        &pair.upper.kubeconfig,
        &pair.lower.kubeconfig,
        node,
        &members.name,
    )
    .await
    .unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    node_ready(&nodes, node, &mut vn, Duration::from_secs(30)).await;
    println!(
        "a new member joined beside a stuck one in {} ms",
        joined.elapsed().as_millis()
    );
    vn.check_running().unwrap();

    // The stuck member's leave would hang on its lower cluster like its start-up: its
    // finalizer is taken off by hand once the process is gone.
    leave(&upper, &members.name, &[node], &[node]).await;
    let _ = secrets.delete("stuck", &DeleteParams::default()).await;
    vn.stop().unwrap();
    let finalizers = json!({"metadata": {"finalizers": null}});
    let _ = secrets
        .patch("stuck", &PatchParams::default(), &Patch::Merge(&finalizers))
        .await;
    members.delete().await.unwrap();
}

/// Item 11 of issue 33: a federated standby (`--leader-elect`, another process holding
/// the Lease) with `--startup-timeout=5s` has started once it has listed the member
/// Secrets: it stays up past the timeout, and `/readyz` answers 200, so a rollout with
/// `maxUnavailable: 0` and a PodDisruptionBudget can go on.
#[tokio::test]
async fn a_federated_standby_is_started_and_ready() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let members = TestNamespace::create(&upper, "life-standby").await.unwrap();
    let lease = "vk-life-standby";
    let args = |identity: &str| -> Vec<String> {
        let mut args = vec![
            "--leader-elect".to_owned(),
            format!("--leader-elect-identity={identity}"),
            format!("--leader-elect-resource-name={}", lease_name(lease)),
            "--startup-timeout=5s".to_owned(),
        ];
        args.extend(FAST_LEASE.iter().map(ToString::to_string));
        args
    };
    let mut leader = serve_members(pair, "vk-life-standby-1", &members.name, &args("a"), &[]);
    let leases: Api<Lease> = Api::namespaced(upper.clone(), LEASE_NAMESPACE);
    wait_for("the first process leading", TIMEOUT, || async {
        Ok((holder(&leases, lease).await.as_deref() == Some("a")).then_some(()))
    })
    .await
    .unwrap();
    let mut standby = serve_members(pair, "vk-life-standby-2", &members.name, &args("b"), &[]);
    let ready = wait_for("the standby ready", Duration::from_secs(30), || async {
        Ok(reachable(standby.metrics_port, "/readyz")
            .await
            .then_some(()))
    })
    .await;
    if let Err(error) = ready {
        let _ = standby.check_running();
        panic!(
            "{error:#}\n{}",
            tensile_harness::process::tail(standby.log(), 40)
        );
    }
    // Past --startup-timeout, and then some: still up, still ready, still standing by.
    tokio::time::sleep(Duration::from_secs(8)).await;
    standby.check_running().unwrap();
    assert!(reachable(standby.metrics_port, "/readyz").await);
    assert_eq!(holder(&leases, lease).await.as_deref(), Some("a"));
    leader.check_running().unwrap();
    standby.stop().unwrap();
    leader.stop().unwrap();
    members.delete().await.unwrap();
}

/// Item 12 of issue 33: renaming a member's node (`tensile.dev/node-name`) would abandon
/// its Node, its pods and their lower copies. It is refused with an Event on the Secret;
/// the member keeps its node, which stays Ready with its pods running, and no Node of the
/// new name appears.
#[tokio::test]
async fn a_renamed_member_is_refused_and_keeps_its_node() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let node = "vk-life-named";
    let renamed = "vk-life-renamed";
    let members = TestNamespace::create(&upper, "life-rename").await.unwrap();
    join_member(
        binary(),
        &pair.upper.kubeconfig,
        &pair.lower.kubeconfig,
        node,
        &members.name,
    )
    .await
    .unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    let mut vn = serve_members(pair, "vk-life-rename-p", &members.name, &[], &[]);
    node_ready(&nodes, node, &mut vn, TIMEOUT).await;
    let uid = nodes.get(node).await.unwrap().uid();
    let ns = TestNamespace::create(&upper, "life-rename-pods")
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    common::ha::create_pods(&pods, node, (0..2).map(|i| format!("p{i}"))).await;
    common::wait_running(&pods, "", 2).await;

    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    let patch = json!({"metadata": {"annotations": {NODE_NAME_ANNOTATION: renamed}}});
    secrets
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let events: Api<Event> = Api::namespaced(upper.clone(), &members.name);
    let said = event_on(&events, node, "MemberRenameRefused", renamed).await;
    println!("refused: {said}");
    // Given time to act on the rename, the member still runs as its node.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        nodes.get_opt(renamed).await.unwrap().is_none(),
        "no Node {renamed} registered"
    );
    let kept = nodes.get(node).await.unwrap();
    assert_eq!(kept.uid(), uid, "node {node} kept");
    assert!(node_is_ready(&kept), "node {node} still Ready");
    assert_eq!(
        metric(&vn, &format!(r#"tensile_member_up{{node="{node}"}}"#)).await,
        1
    );
    let still = pods.list(&ListParams::default()).await.unwrap().items;
    assert!(
        still.len() == 2
            && still.iter().all(common::running)
            && still
                .iter()
                .all(|p| p.metadata.deletion_timestamp.is_none()),
        "the pods run on"
    );
    vn.check_running().unwrap();

    ns.delete().await.unwrap();
    leave(&upper, &members.name, &[node], &[node, renamed]).await;
    vn.stop().unwrap();
    members.delete().await.unwrap();
}

/// Removing the member label from a joined member's Secret is a leave, as deleting it is:
/// the node drained and deleted, the finalizer taken off (before, the member stopped, its
/// Node stayed and the finalizer stranded the Secret).
#[tokio::test]
async fn an_unlabelled_member_leaves() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let node = "vk-life-unlabelled";
    let members = TestNamespace::create(&upper, "life-unlabel").await.unwrap();
    join_member(
        binary(),
        &pair.upper.kubeconfig,
        &pair.lower.kubeconfig,
        node,
        &members.name,
    )
    .await
    .unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    let mut vn = serve_members(pair, "vk-life-unlabel-p", &members.name, &[], &[]);
    node_ready(&nodes, node, &mut vn, TIMEOUT).await;
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    let unlabel = json!({"metadata": {"labels": {MEMBER_LABEL: null}}});
    secrets
        .patch(node, &PatchParams::default(), &Patch::Merge(&unlabel))
        .await
        .unwrap();
    let left = wait_for(
        "the unlabelled member left",
        Duration::from_secs(120),
        || async {
            let gone = nodes.get_opt(node).await?.is_none();
            let released = secrets
                .get(node)
                .await?
                .finalizers()
                .iter()
                .all(|f| f != tensile::member::spec::MEMBER_FINALIZER);
            Ok((gone && released).then_some(()))
        },
    )
    .await;
    if let Err(error) = left {
        panic!(
            "{error:#}\n{}",
            tensile_harness::process::tail(vn.log(), 40)
        );
    }
    vn.check_running().unwrap();
    vn.stop().unwrap();
    members.delete().await.unwrap();
}

/// Item 12 of issue 33, its other half: a member's kubeconfig that now reaches another
/// lower cluster (here the upper cluster, joined as if it were a lower one) would fail
/// every pod as `LowerPodGone` and leak the copies in the first. The member refuses to
/// start there (a Warning Event says why) and creates nothing in the other cluster.
#[tokio::test]
async fn a_member_moved_to_another_lower_cluster_is_refused() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let node = "vk-life-moved";
    let members = TestNamespace::create(&upper, "life-moved").await.unwrap();
    let elsewhere = TestNamespace::create(&upper, "life-moved-other")
        .await
        .unwrap();
    for (namespace, lower) in [
        (&members.name, &pair.lower.kubeconfig),
        (&elsewhere.name, &pair.upper.kubeconfig),
    ] {
        join_member(binary(), &pair.upper.kubeconfig, lower, node, namespace)
            .await
            .unwrap();
    }
    let nodes: Api<Node> = Api::all(upper.clone());
    let mut vn = serve_members(pair, "vk-life-moved-p", &members.name, &[], &[]);
    node_ready(&nodes, node, &mut vn, TIMEOUT).await;
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    wait_for("the lower cluster recorded", TIMEOUT, || async {
        let secret = secrets.get(node).await?;
        Ok(secret
            .annotations()
            .contains_key("tensile.dev/joined-lower-cluster")
            .then_some(()))
    })
    .await
    .unwrap();
    // The kubeconfig `join` wrote for the other cluster, moved into the member's Secret.
    let other: Api<Secret> = Api::namespaced(upper.clone(), &elsewhere.name);
    let kubeconfig = other.get(node).await.unwrap().data.unwrap()[KUBECONFIG_KEY].clone();
    let patch = json!({"data": {KUBECONFIG_KEY: kubeconfig}});
    secrets
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let events: Api<Event> = Api::namespaced(upper.clone(), &members.name);
    let said = event_on(&events, node, "MemberFailed", "another lower cluster").await;
    println!("refused: {said}");
    vn.check_running().unwrap();

    // Its leave cleans what carries its marks (nothing, in the other cluster) and deletes
    // its Node.
    leave(&upper, &members.name, &[node], &[node]).await;
    vn.stop().unwrap();
    members.delete().await.unwrap();
    elsewhere.delete().await.unwrap();
}
