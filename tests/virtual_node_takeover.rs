//! A takeover (`--leader-elect`) while the new leader's upper pod store lags: its lower
//! store already holds pods the old leader made whose upper pods its upper store has not
//! seen yet. Nothing the old leader mirrored may be taken for an orphan: the orphan
//! collector reads each candidate's upper pod live before deleting it, so running
//! workloads keep running, and a real orphan is still collected.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use common::{TIMEOUT, gc_rounds, metric, start_node_with, wait_running};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use nix::sys::signal::Signal;
use tensile_harness::fault_proxy::FaultProxy;
use tensile_harness::fixtures::bound_pod;
use tensile_harness::invariant::UPPER_UID_ANNOTATION;
use tensile_harness::{ClusterPair, TestNamespace, VirtualNodeOptions, invariant, wait_for};

/// Where the Lease is when neither POD_NAMESPACE nor a service account says otherwise.
const LEASE_NAMESPACE: &str = "kube-system";
/// Pods the old leader mirrors while the standby's upper pod watch is held back.
const PODS: usize = 5;

/// `virtual-node --leader-elect` for `node` as `identity`; a stopped leader hands its
/// Lease over at once, so the timings only bound a stuck test.
fn options(node: &str, identity: &str) -> VirtualNodeOptions {
    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), node);
    options.args = vec![
        "--leader-elect".into(),
        format!("--leader-elect-identity={identity}"),
        "--leader-elect-lease-duration=15s".into(),
        "--leader-elect-renew-deadline=10s".into(),
        "--leader-elect-retry-period=500ms".into(),
    ];
    options
}

/// Whether GET `/readyz` on the metrics port answers 200.
async fn ready(port: u16) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    let request = b"GET /readyz HTTP/1.0\r\nHost: localhost\r\n\r\n";
    if stream.write_all(request).await.is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer).await;
    answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200")
}

/// The old leader mirrors pods while the standby's upper pod watch is held back (the fault
/// proxy), then hands over. The new leader's orphan collector finds lower pods whose upper
/// pods its store lacks: it reads them live, keeps every one, and once the watch catches
/// up every pod is still Running on its first lower pod. A lower pod whose upper pod is
/// gone is still collected.
#[tokio::test]
async fn a_standby_with_a_lagging_upper_watch_takes_over_and_kills_nothing() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-takeover-lag";
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let leases: Api<Lease> = Api::namespaced(upper.clone(), LEASE_NAMESPACE);
    let lease = format!("tensile-virtual-node-{node}");
    let holder = || async {
        let lease = leases.get_opt(&lease).await?;
        anyhow::Ok(lease.and_then(|l| l.spec?.holder_identity))
    };

    let mut leader = start_node_with(pair, &options(node, "a"), &upper).await;
    assert_eq!(holder().await.unwrap().as_deref(), Some("a"));
    let proxy = FaultProxy::start(upper.clone()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut standby_options = options(node, "b");
    standby_options.upper_kubeconfig = Some(
        proxy
            .write_kubeconfig(&dir.path().join("upper.kubeconfig"))
            .unwrap(),
    );
    let mut standby = pair.start_virtual_node(&standby_options).unwrap();
    wait_for("the standby ready", TIMEOUT, || async {
        Ok(ready(standby.metrics_port).await.then_some(()))
    })
    .await
    .unwrap();

    let ns = TestNamespace::create(&upper, "takeover").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    proxy.hold_watches("pods");
    for i in 0..PODS {
        let mut pod = bound_pod(&format!("lagged-{i}"), node);
        pod.metadata.labels = Some([("app".to_owned(), "lagged".to_owned())].into());
        upper_pods
            .create(&PostParams::default(), &pod)
            .await
            .unwrap();
    }
    // Running upstream: the old leader mirrored them and reflected their status.
    wait_running(&upper_pods, "app=lagged", PODS).await;
    let before = invariant::uids_by_name(&lower_pods).await.unwrap();
    assert_eq!(before.len(), PODS, "{before:?}");
    // The standby's lower watch is not held: it holds the lower pods, not the upper ones.
    let mirrored = "tensile_mirrored_objects{kind=\"pods\"}";
    wait_for("the standby's lower store", TIMEOUT, || async {
        Ok((metric(&standby, mirrored).await >= PODS as u64).then_some(()))
    })
    .await
    .unwrap();

    leader.signal(Signal::SIGTERM).unwrap();
    wait_for("the lease held by the standby", TIMEOUT, || async {
        Ok((holder().await?.as_deref() == Some("b")).then_some(()))
    })
    .await
    .unwrap();
    let requests = proxy.requests();
    gc_rounds(&standby, 3).await;
    let read = proxy.requests().since(&requests).count("get", "pods");
    let collected = metric(&standby, "tensile_orphans_deleted_total").await;
    let after = invariant::uids_by_name(&lower_pods).await.unwrap();
    eprintln!(
        "after the takeover, upper pod watch held: {collected} lower pods collected, {read} upper pods read live"
    );
    assert_eq!(collected, 0, "lower pods collected as orphans");
    assert_eq!(after, before, "lower pods deleted or re-created");
    assert!(
        read >= PODS as u64,
        "each candidate is read live: {read} reads"
    );

    proxy.release_watches();
    let (report, _) = invariant::converge(&upper, &lower, node, Some(&ns.name), TIMEOUT)
        .await
        .unwrap();
    assert!(report.holds(), "{report}");
    gc_rounds(&standby, 2).await;
    wait_running(&upper_pods, "app=lagged", PODS).await;
    assert_eq!(
        invariant::uids_by_name(&lower_pods).await.unwrap(),
        before,
        "lower pods deleted or re-created once the watch caught up"
    );

    // A real orphan is still collected: a lower pod with this node's marks whose upper
    // pod never existed (as one force-deleted while the node was down).
    let mut orphan = lower_pods.get("lagged-1").await.unwrap();
    orphan.metadata = ObjectMeta {
        name: Some("orphan".into()),
        labels: orphan.metadata.labels.take(),
        annotations: Some([(UPPER_UID_ANNOTATION.to_owned(), "no-such-pod".to_owned())].into()),
        ..ObjectMeta::default()
    };
    orphan.status = None;
    lower_pods
        .create(&PostParams::default(), &orphan)
        .await
        .unwrap();
    wait_for("the orphan collected", TIMEOUT, || async {
        let going = lower_pods
            .get_opt("orphan")
            .await?
            .is_none_or(|p| p.metadata.deletion_timestamp.is_some());
        let collected = metric(&standby, "tensile_orphans_deleted_total").await;
        Ok((going && collected == 1).then_some(()))
    })
    .await
    .unwrap();
    let mut after = invariant::uids_by_name(&lower_pods).await.unwrap();
    after.remove("orphan");
    assert_eq!(after, before, "only the orphan was collected");

    ns.delete().await.unwrap();
    leader.stop().unwrap();
    standby.stop().unwrap();
}
