//! A lower cluster whose watches fail is not trusted: while the extender's lists and
//! watches are refused (its RBAC revoked: 403, while `/version` still answers), its
//! virtual node fails filter with the reason and `/readyz` says so; once a complete list
//! succeeds again, the virtual node passes again.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use common::{ServedExtender, TIMEOUT, VK, args, cpu_pod, http};
use serde_json::json;
use tensile_harness::fault_proxy::{Fault, FaultProxy};
use tensile_harness::ports::free_port;
use tensile_harness::{ClusterPair, wait_for};

#[tokio::test]
async fn a_failing_lower_watch_fails_the_virtual_node_until_it_relists() {
    let pair = ClusterPair::shared().await.unwrap();
    let proxy = FaultProxy::start(pair.lower.client().await.unwrap())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = proxy
        .write_kubeconfig(&dir.path().join("lower-through-proxy"))
        .unwrap();
    let port = free_port().unwrap();
    let served = ServedExtender::start(pair, kubeconfig, port).await;
    let extender = &served.app.extender;
    let probe = cpu_pod("probe", "1", json!({}));
    let judge = || extender.filter(&args(&probe, &[VK])).0;
    let passes = || judge().node_names.as_deref() == Some(&[VK.to_owned()][..]);
    // Synced, the pod fits (on a loaded machine the first probe may be late: wait).
    let first = judge();
    if first.node_names.as_deref() != Some(&[VK.to_owned()][..]) {
        eprintln!(
            "not passing right after the sync: {:?}",
            first.failed_and_unresolvable_nodes
        );
    }
    wait_for("the virtual node passing", TIMEOUT, || async {
        Ok(passes().then_some(()))
    })
    .await
    .unwrap();

    // Revoked: every list and watch is refused from now on; the open watches end (as
    // they do within minutes on their own) and the relist is refused.
    proxy.set(Fault::Forbidden, 100);
    proxy.expire_watches();
    // The expiry fails it first, or the refused watch (one that was starting when access
    // was revoked), then the refused relist.
    let reason = wait_for(
        "the virtual node failing filter for the 403",
        TIMEOUT,
        || async {
            let reason = judge().failed_and_unresolvable_nodes.get(VK).cloned();
            Ok(reason.filter(|r| r.contains("403")))
        },
    )
    .await
    .unwrap();
    assert!(
        reason.starts_with("lower cluster of vk-node: watch of ")
            && reason.ends_with(
                "403 Forbidden: forbidden (injected by the fault proxy)); \
                 waiting for a complete list"
            ),
        "{reason}"
    );
    let (status, body) = http(port, "GET", "/readyz", "").await;
    assert_eq!(status, 503, "{body}");
    let (_, metrics) = http(port, "GET", "/metrics", "").await;
    assert!(
        metrics.contains("tensile_extender_lower_cluster_known{node=\"vk-node\"} 0"),
        "{metrics}"
    );

    // Restored: the next complete list makes the cluster known again.
    proxy.set(Fault::None, 0);
    wait_for("the virtual node passing again", TIMEOUT, || async {
        Ok(passes().then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(http(port, "GET", "/readyz", "").await.0, 200);
    served.stop().await;
}
