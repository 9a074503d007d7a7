//! Node granularity (issue 36), as far as it runs: `--node-granularity` and the member
//! annotation `tensile.dev/node-granularity` are read and checked per member; `node` and
//! `label=<key>` are refused (an error for the flags, a `MemberInvalid` Event on a Secret)
//! until one Node per group is wired, and a running member's granularity change is refused
//! with a `MemberGranularityChanged` Event while the member keeps running as it was. Its
//! own test binary.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use common::{TIMEOUT, member_secret, metric};
use k8s_openapi::api::core::v1::{Event, Node, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tensile::member::spec::GRANULARITY_ANNOTATION;
use tensile_harness::{ClusterPair, TestNamespace, VirtualNodeOptions, node_is_ready, wait_for};

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

/// The flags: a malformed granularity is a usage error, `node` an error that says it is not
/// supported yet; neither registers a Node.
#[tokio::test]
async fn flags_refuse_what_does_not_run() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let nodes: Api<Node> = Api::all(upper);
    for (node, granularity, says) in [
        ("vk-gran-bad", "label=no such key", "is not a label key"),
        (
            "vk-gran-node",
            "node",
            "node granularity node is not supported yet",
        ),
    ] {
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

/// Member Secrets: one joined as `cluster` runs; one asking `label=<zone>` is refused with
/// an Event; changing the running member's annotation to `node` is refused with an Event
/// and the member keeps its node (the same Node, Ready) and its place.
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
    let mut zoned = member_secret("lower-zoned", "vk-gran-zoned", &pair.lower.kubeconfig);
    zoned.metadata.annotations.get_or_insert_default().insert(
        GRANULARITY_ANNOTATION.into(),
        "label=topology.kubernetes.io/zone".into(),
    );
    secrets
        .create(&PostParams::default(), &zoned)
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
    event_on(
        &events,
        "lower-zoned",
        "MemberInvalid",
        "node granularity label=topology.kubernetes.io/zone is not supported yet",
    )
    .await;
    assert!(
        nodes.get_opt("vk-gran-zoned").await.unwrap().is_none(),
        "a refused member registers no Node"
    );

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
