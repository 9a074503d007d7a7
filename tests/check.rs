//! `virtual-node check` against two real clusters: all ✓ with enough rights, and each
//! missing permission or busy port named on a ✗ line with exit 1, changing nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::path::Path;
use std::process::Output;

use tensile_harness::ClusterPair;
use tensile_harness::ports::free_port;

/// Runs `virtual-node check` with these kubeconfigs on free ports (or `kubelet_port`).
async fn check(upper: &Path, lower: &Path, kubelet_port: Option<u16>) -> (Output, String) {
    let kubelet_port = kubelet_port.unwrap_or_else(|| free_port().unwrap());
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_virtual-node"))
        .arg("check")
        .args(["--nodename", "vk-check", "--kubeconfig"])
        .arg(upper)
        .arg("--client-kubeconfig")
        .arg(lower)
        .arg(format!("--metrics-addr=127.0.0.1:{}", free_port().unwrap()))
        .env("KUBELET_PORT", kubelet_port.to_string())
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    (output, stdout)
}

#[tokio::test]
async fn with_enough_rights_every_check_passes() {
    let pair = ClusterPair::shared().await.unwrap();
    let (output, stdout) = check(pair.upper_kubeconfig(), pair.lower_kubeconfig(), None).await;
    assert!(output.status.success(), "{stdout}");
    for line in [
        "✓ upper cluster reachable at",
        "✓ lower cluster reachable at",
        "✓ upper cluster: all",
        "✓ lower cluster: all",
        "✓ upper cluster identity (UID of kube-system)",
        "✓ kubelet API port",
    ] {
        assert!(stdout.contains(line), "{line:?} missing from:\n{stdout}");
    }
    assert!(!stdout.contains('✗'), "{stdout}");
}

#[tokio::test]
async fn a_missing_permission_and_a_busy_port_are_named() {
    let pair = ClusterPair::shared().await.unwrap();
    // A user the lower cluster knows but grants nothing.
    let nobody = pair
        .lower
        .kubeconfig_for("tensile-check-nobody", &[])
        .unwrap();
    let busy = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let busy_port = busy.local_addr().unwrap().port();
    let (output, stdout) = check(pair.upper_kubeconfig(), &nobody, Some(busy_port)).await;
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    for line in [
        "✓ upper cluster: all",
        "✓ lower cluster reachable at",
        "✗ lower cluster: may not create pods\n",
        "✗ lower cluster: may not watch nodes\n",
        &format!("✗ kubelet API port (KUBELET_PORT) 0.0.0.0:{busy_port}:"),
    ] {
        assert!(stdout.contains(line), "{line:?} missing from:\n{stdout}");
    }
    assert!(stdout.contains("checks failed"), "{stdout}");
    // Nothing was changed: no Node registered.
    let nodes: kube::Api<k8s_openapi::api::core::v1::Node> =
        kube::Api::all(pair.upper.client().await.unwrap());
    assert!(nodes.get_opt("vk-check").await.unwrap().is_none());
}
