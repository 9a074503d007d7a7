//! Federation: a member whose lower API server answers 429 or 500 to everything, or whose
//! credentials are revoked, goes NotReady alone; the other member's node stays Ready and
//! goes on reflecting pods Running; the faulted member is Ready again once the fault ends
//! (for revoked credentials: once `virtual-node join` has made it a new token, picked up
//! from the rotated member Secret without restarting the process). Member A reaches its
//! lower cluster through the harness's fault proxy; member B was joined by
//! `virtual-node join`, with an identity of its own below. Its own test binary: it
//! shortens the upper node monitor's grace period.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use common::{TIMEOUT, member_secret, ready_status};
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::api::{Api, DeleteParams, PostParams};
use tensile::member::join::{LOWER_NAMESPACE, LowerIdentity};
use tensile_harness::fault_proxy::{Fault, FaultProxy};
use tensile_harness::fixtures::bound_pod;
use tensile_harness::virtual_node::join_member;
use tensile_harness::{TestNamespace, VirtualNode, invariant, node_is_ready, wait_for};

const A: &str = "vk-fault-a";
const B: &str = "vk-fault-b";
/// Long enough for the lease path: the lease is renewed every 10 s, the upper node
/// monitor's grace period is 20 s here.
const NOT_READY_WITHIN: Duration = Duration::from_secs(90);

/// Creates a pod bound to `node` and returns how long it took to be Running upstairs.
async fn runs_on(pods: &Api<Pod>, name: &str, node: &str, vn: &mut VirtualNode) -> Duration {
    let created = Instant::now();
    pods.create(&PostParams::default(), &bound_pod(name, node))
        .await
        .unwrap();
    let running = wait_for(
        &format!("pod {name} Running on {node}"),
        TIMEOUT,
        || async {
            let pod = pods.get(name).await?;
            Ok((pod.status.and_then(|s| s.phase).as_deref() == Some("Running")).then_some(()))
        },
    )
    .await;
    if let Err(error) = running {
        let _ = vn.check_running();
        panic!(
            "{error:#}\n{}",
            tensile_harness::process::tail(vn.log(), 40)
        );
    }
    created.elapsed()
}

/// Waits until `node`'s Ready condition is (`ready`) or is not (`!ready`) True.
async fn until_ready(nodes: &Api<Node>, node: &str, ready: bool, vn: &mut VirtualNode) {
    let what = format!("node {node} {}", if ready { "Ready" } else { "not Ready" });
    let reached = wait_for(&what, NOT_READY_WITHIN, || async {
        let is_ready = nodes
            .get_opt(node)
            .await?
            .is_some_and(|n| node_is_ready(&n));
        Ok((is_ready == ready).then_some(()))
    })
    .await;
    if let Err(error) = reached {
        let _ = vn.check_running();
        panic!(
            "{error:#}\n{}",
            tensile_harness::process::tail(vn.log(), 40)
        );
    }
}

/// Waits until `faulted` is not Ready, and checks that `other` still is.
async fn not_ready_alone(nodes: &Api<Node>, faulted: &str, other: &str, vn: &mut VirtualNode) {
    until_ready(nodes, faulted, false, vn).await;
    assert_eq!(
        ready_status(&nodes.get(other).await.unwrap()).as_deref(),
        Some("True"),
        "{other} stays Ready while {faulted} is faulted"
    );
}

#[tokio::test]
async fn a_member_answered_429_or_500_or_with_revoked_credentials_goes_not_ready_alone() {
    let (pair, b) =
        common::fast_pair_and_second_lower(Ipv4Addr::new(10, 95, 0, 0), "10.248.0.0/16").await;
    let upper = pair.upper.client().await.unwrap();
    let (lower_a, lower_b) = (
        pair.lower.client().await.unwrap(),
        b.client().await.unwrap(),
    );
    let proxy = FaultProxy::start(lower_a.clone()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxied = proxy
        .write_kubeconfig(&dir.path().join("proxy.kubeconfig"))
        .unwrap();

    let members = TestNamespace::create(&upper, "members").await.unwrap();
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    secrets
        .create(
            &PostParams::default(),
            &member_secret("lower-a", A, &proxied),
        )
        .await
        .unwrap();
    let binary = std::path::Path::new(env!("CARGO_BIN_EXE_virtual-node"));
    // `virtual-node join` of member B (again: a new token).
    let join_b = || {
        join_member(
            binary,
            &pair.upper.kubeconfig,
            &b.kubeconfig,
            B,
            &members.name,
        )
    };
    join_b().await.unwrap();
    let mut vn = pair
        .serve_members(binary, "vk-faults", &members.name, &[A, B], &[])
        .await
        .unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    let ns = TestNamespace::create(&upper, "faults").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let calm = runs_on(&pods, "b-calm", B, &mut vn).await;
    println!("member B, no fault: a pod Running upstairs in {calm:?}");

    for (fault, label) in [
        (Fault::TooManyRequests, "429"),
        (Fault::InternalError, "500"),
    ] {
        proxy.set(fault, 100);
        not_ready_alone(&nodes, A, B, &mut vn).await;
        let during = runs_on(&pods, &format!("b-during-{label}"), B, &mut vn).await;
        println!("member B while A is answered {label}: a pod Running upstairs in {during:?}");
        proxy.set(Fault::None, 0);
        until_ready(&nodes, A, true, &mut vn).await;
        runs_on(&pods, &format!("a-after-{label}"), A, &mut vn).await;
    }

    // B's credentials revoked: its token Secret below deleted, so the lower API server
    // refuses the token (401) from then on.
    let upper_id = Api::<k8s_openapi::api::core::v1::Namespace>::all(upper.clone())
        .get("kube-system")
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    let identity = LowerIdentity::of(B, &upper_id);
    let tokens: Api<Secret> = Api::namespaced(lower_b.clone(), LOWER_NAMESPACE);
    tokens
        .delete(&identity.token_secret, &DeleteParams::default())
        .await
        .unwrap();
    not_ready_alone(&nodes, B, A, &mut vn).await;
    let during = runs_on(&pods, "a-during-revoked", A, &mut vn).await;
    println!("member A while B's credentials are revoked: a pod Running upstairs in {during:?}");
    // Joined again: a new token, the member Secret rotated, picked up in place.
    join_b().await.unwrap();
    until_ready(&nodes, B, true, &mut vn).await;
    runs_on(&pods, "b-after-revoked", B, &mut vn).await;

    for (node, lower) in [(A, &lower_a), (B, &lower_b)] {
        let (report, _) = invariant::converge(&upper, lower, node, Some(&ns.name), TIMEOUT)
            .await
            .unwrap();
        assert!(report.holds(), "{node}: {report}");
    }
    vn.check_running().unwrap();
    vn.stop().unwrap();
}
