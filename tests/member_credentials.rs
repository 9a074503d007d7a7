//! Credentials that must not cross from one cluster to another:
//! - a lower pod that copies the ownership marks of a mirrored pod and names the UID of an
//!   upper pod on another node gets none of that pod's upper ServiceAccount tokens
//!   (`--upper-identity` issues tokens only for upper pods bound to its own node, as
//!   NodeRestriction lets a kubelet ask only for its own pods);
//! - a member Secret whose kubeconfig would have virtual-node run a command (`exec`) or read
//!   one of its files (`tokenFile`) is refused with a `MemberInvalid` Event naming the field,
//!   by the members controller and by `virtual-node check` alike: the command never runs,
//!   and nothing is sent to the kubeconfig's server; a kubeconfig with inline credentials is
//!   served beside them.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{TIMEOUT, start_node, wait_running};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Event, Node, Pod, Secret, ServiceAccount};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tensile::member::spec::{KUBECONFIG_KEY, MEMBER_LABEL, NODE_NAME_ANNOTATION};
use tensile::translate::meta::UPPER_UID_ANNOTATION;
use tensile_harness::ports::free_port;
use tensile_harness::{ClusterPair, TestNamespace, VirtualNodeOptions, wait_for};

/// No Service mirroring: the shared pair's other tests own their Services.
const NO_SERVICES: &str = "--enable-controllers=PVControllers";

/// Creates the ServiceAccount `robot` in `namespace`.
async fn create_robot(upper: &Client, namespace: &str) {
    let mut robot = ServiceAccount::default();
    robot.metadata.name = Some("robot".into());
    Api::<ServiceAccount>::namespaced(upper.clone(), namespace)
        .create(&PostParams::default(), &robot)
        .await
        .unwrap();
}

/// A pod `name` bound to `node`, running as `robot` (the upper admission adds its token
/// volume).
fn robot_pod(name: &str, node: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeName": node,
            "serviceAccountName": "robot",
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "app", "image": "busybox"}],
        },
    }))
    .unwrap()
}

#[tokio::test]
async fn a_lower_pod_with_the_marks_of_a_pod_on_another_node_gets_no_upper_tokens() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-cred-tokens";
    let address = pair.upper.server.trim_start_matches("https://").to_owned();
    let vn = start_node(
        pair,
        node,
        &[
            NO_SERVICES,
            "--upper-identity",
            &format!("--upper-api-address={address}"),
            // The token controller looks at every lower pod of the node on each resync.
            "--full-resync-period=2s",
        ],
    )
    .await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "cred-tokens").await.unwrap();
    create_robot(&upper, &ns.name).await;
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let lower_secrets: Api<Secret> = Api::namespaced(lower.clone(), &ns.name);

    // A pod of this node: mirrored below with its tokens, and marks anyone below can read.
    upper_pods
        .create(&PostParams::default(), &robot_pod("worker", node))
        .await
        .unwrap();
    let copy = wait_running(&lower_pods, "app=worker", 1).await.remove(0);
    wait_for("the worker's token Secret", TIMEOUT, || async {
        Ok(lower_secrets.get_opt("worker-upper-token").await?)
    })
    .await
    .unwrap();

    // The victim: an upper pod on a real node, not this one.
    let real = format!("real-{}", ns.name);
    let nodes: Api<Node> = Api::all(upper.clone());
    let mut real_node = Node::default();
    real_node.metadata.name = Some(real.clone());
    nodes
        .create(&PostParams::default(), &real_node)
        .await
        .unwrap();
    let victim = upper_pods
        .create(&PostParams::default(), &robot_pod("victim", &real))
        .await
        .unwrap();
    let victim_uid = victim.uid().unwrap();

    // A lower user forges a pod with the worker's marks naming the victim's UID, and holds
    // it with a finalizer so the orphan collector cannot remove it.
    let mut annotations = copy.annotations().clone();
    annotations.insert(UPPER_UID_ANNOTATION.to_owned(), victim_uid.clone());
    let forged: Pod = serde_json::from_value(json!({
        "metadata": {
            "name": "victim",
            "labels": copy.labels(),
            "annotations": annotations,
            "finalizers": ["example.com/hold"],
        },
        "spec": {"containers": [{"name": "app", "image": "busybox"}]},
    }))
    .unwrap();
    lower_pods
        .create(&PostParams::default(), &forged)
        .await
        .unwrap();

    let refused = format!("refused the upper tokens lower pod {}/victim", ns.name);
    let outcome = wait_for("the forged pod refused", TIMEOUT, || async {
        if lower_secrets.get_opt("victim-upper-token").await?.is_some() {
            return Ok(Some(Err(())));
        }
        let log = std::fs::read_to_string(vn.log())?;
        Ok(log.contains(&refused).then_some(Ok(())))
    })
    .await;
    let tail = || tensile_harness::process::tail(vn.log(), 30);
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(())) => panic!(
            "the forged lower pod got the upper tokens of {}/victim (bound to {real}); log:\n{}",
            ns.name,
            tail()
        ),
        Err(error) => panic!("{error:#}\n{}", tail()),
    }
    // Later resyncs refuse it again; the Secret never appears.
    let again = wait_for("a second refusal", TIMEOUT, || async {
        let log = std::fs::read_to_string(vn.log())?;
        Ok((log.matches(&refused).count() >= 2).then_some(()))
    })
    .await;
    assert!(again.is_ok(), "{:?}\n{}", again.err(), tail());
    assert!(
        lower_secrets
            .get_opt("victim-upper-token")
            .await
            .unwrap()
            .is_none(),
        "no token Secret for the forged pod"
    );

    lower_pods
        .patch(
            "victim",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    let _ = lower_pods.delete("victim", &DeleteParams::default()).await;
    ns.delete().await.unwrap();
    nodes.delete(&real, &DeleteParams::default()).await.unwrap();
}

/// A member Secret `name` (node `name`) holding `kubeconfig`.
fn member_secret(name: &str, kubeconfig: &serde_json::Value) -> Secret {
    let mut secret = Secret::default();
    secret.metadata.name = Some(name.into());
    secret.metadata.labels = Some([(MEMBER_LABEL.to_owned(), "true".to_owned())].into());
    secret.metadata.annotations = Some([(NODE_NAME_ANNOTATION.to_owned(), name.to_owned())].into());
    secret.data = Some(
        [(
            KUBECONFIG_KEY.to_owned(),
            ByteString(kubeconfig.to_string().into_bytes()),
        )]
        .into(),
    );
    secret
}

/// A kubeconfig of one cluster at `server` (no CA: nothing is read) and one user `user`.
fn kubeconfig(server: &str, user: &serde_json::Value) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    })
}

/// Waits for a `MemberInvalid` Event on the member Secret `secret` whose message contains
/// `says`, failing at once if `forbidden` says something happened that must not.
async fn refused(
    events: &Api<Event>,
    secret: &str,
    says: &str,
    forbidden: impl Fn() -> Option<String>,
) {
    let what = format!("a MemberInvalid Event on {secret} saying {says:?}");
    wait_for(&what, TIMEOUT, || async {
        if let Some(happened) = forbidden() {
            panic!("member Secret {secret}: {happened}");
        }
        let found = events.list(&ListParams::default()).await?.items;
        Ok(found
            .iter()
            .any(|e| {
                e.involved_object.name.as_deref() == Some(secret)
                    && e.reason.as_deref() == Some("MemberInvalid")
                    && e.message.as_deref().unwrap_or_default().contains(says)
            })
            .then_some(()))
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_member_kubeconfig_that_runs_a_command_or_reads_a_file_is_refused_and_nothing_runs() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let members = TestNamespace::create(&upper, "cred-members").await.unwrap();
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    let dir = tempfile::tempdir().unwrap();

    // exec: a command that would leave a file.
    let touched = dir.path().join("exec-ran");
    let exec = kubeconfig(
        &pair.lower.server,
        &json!({"exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": "sh",
            "args": ["-c", format!("touch {}; exit 1", touched.display())],
            "interactiveMode": "Never",
        }}),
    );
    // tokenFile: a file of virtual-node's (here a canary) sent to a server of the Secret's.
    let canary = dir.path().join("token");
    std::fs::write(&canary, "canary-token").unwrap();
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let connections = Arc::new(AtomicUsize::new(0));
    let counted = connections.clone();
    let server = tokio::spawn(async move {
        while let Ok((_stream, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
        }
    });
    let token_file = kubeconfig(
        &format!("https://127.0.0.1:{port}"),
        &json!({"tokenFile": canary}),
    );
    // Beside them, a member as the harness writes kubeconfigs (a client certificate and
    // the CA inline): accepted.
    let inline: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&pair.lower.kubeconfig).unwrap()).unwrap();
    for (name, config) in [
        ("vk-cred-exec", &exec),
        ("vk-cred-token-file", &token_file),
        ("vk-cred-ok", &inline),
    ] {
        secrets
            .create(&PostParams::default(), &member_secret(name, config))
            .await
            .unwrap();
    }

    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), "vk-cred");
    options.flags_member = false;
    options.args = vec![
        "--members-namespace".into(),
        members.name.clone(),
        NO_SERVICES.into(),
    ];
    let mut vn = pair.start_virtual_node(&options).unwrap();
    let events: Api<Event> = Api::namespaced(upper.clone(), &members.name);
    let forbidden = || {
        if touched.exists() {
            return Some("virtual-node ran the kubeconfig's exec command".to_owned());
        }
        let n = connections.load(Ordering::SeqCst);
        (n > 0).then(|| format!("virtual-node connected {n} times to the kubeconfig's server"))
    };
    refused(&events, "vk-cred-exec", "users[u].user.exec", forbidden).await;
    refused(
        &events,
        "vk-cred-token-file",
        "users[u].user.tokenFile",
        forbidden,
    )
    .await;
    let nodes: Api<Node> = Api::all(upper.clone());
    let ready = wait_for("node vk-cred-ok Ready", TIMEOUT, || async {
        Ok(nodes
            .get_opt("vk-cred-ok")
            .await?
            .filter(tensile_harness::node_is_ready)
            .map(|_| ()))
    })
    .await;
    if let Err(error) = ready {
        panic!(
            "{error:#}\n{}",
            tensile_harness::process::tail(vn.log(), 30)
        );
    }
    vn.check_running().unwrap();

    // `check` reads the same Secrets the same way.
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_virtual-node"))
        .args([
            "check",
            "--members-namespace",
            &members.name,
            "--kubeconfig",
        ])
        .arg(pair.upper_kubeconfig())
        .arg(format!("--metrics-addr=127.0.0.1:{}", free_port().unwrap()))
        .env("KUBELET_PORT", free_port().unwrap().to_string())
        .output()
        .await
        .unwrap();
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(!output.status.success(), "{report}");
    for (secret, field) in [
        ("vk-cred-exec", "users[u].user.exec"),
        ("vk-cred-token-file", "users[u].user.tokenFile"),
    ] {
        let line = format!("✗ member Secret {}/{secret}: ", members.name);
        assert!(
            report
                .lines()
                .any(|l| l.starts_with(&line) && l.contains(field)),
            "{line}… {field}: {report}"
        );
    }
    assert_eq!(forbidden(), None, "after check");

    server.abort();
    // The member leaves (its Node deleted) before the process stops.
    secrets
        .delete("vk-cred-ok", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("member vk-cred-ok left", TIMEOUT, || async {
        Ok(secrets.get_opt("vk-cred-ok").await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    drop(vn);
    members.delete().await.unwrap();
}
