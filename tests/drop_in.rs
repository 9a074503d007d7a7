//! tensile-kube's command lines run unchanged: the real `virtual-node` binary with the
//! args of tensile-kube's shipped manifest joins the harness's clusters, and its
//! `version` / `--version` print the version.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::process::Command;

use tensile_harness::{ClusterPair, VirtualNodeOptions, wait_for};

const BINARY: &str = env!("CARGO_BIN_EXE_virtual-node");

#[test]
fn version_is_printed() {
    for args in [&["version"][..], &["--version"]] {
        let output = Command::new(BINARY).args(args).output().unwrap();
        assert!(output.status.success(), "{args:?}: {output:?}");
        let stdout = String::from_utf8(output.stdout).unwrap();
        assert_eq!(
            stdout.trim(),
            format!("virtual-node {}", env!("CARGO_PKG_VERSION")),
            "{args:?}"
        );
    }
}

/// tensile-kube's `manifeasts/virtual-node.yaml` args, less the three the harness sets to
/// its own files and ports (`--nodename`, `--client-kubeconfig`, `--metrics-addr`).
#[tokio::test]
async fn tensile_kube_manifest_args_run() {
    let pair = ClusterPair::shared().await.unwrap();
    let mut options = VirtualNodeOptions::new(BINARY, "vk-drop-in");
    options.args = [
        "--provider=k8s",
        "--disable-taint=true",
        "--kube-api-qps=500",
        "--kube-api-burst=1000",
        "--client-qps=500",
        "--client-burst=1000",
        "--klog.v=5",
        "--log-level=debug",
        "--full-resync-period=1m0s",
        "--startup-timeout=2m0s",
        "--log-format=json",
    ]
    .map(String::from)
    .to_vec();
    let upper = pair.upper.client().await.unwrap();
    let node = common::start_node_with(pair, &options, &upper).await;
    // Logged once at start, naming each ignored flag, as one JSON object.
    wait_for("the ignored flags logged", common::TIMEOUT, || async {
        let log = std::fs::read_to_string(node.log())?;
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("accepted for tensile-kube compatibility"))
            .collect();
        Ok(lines.first().map(|line| {
            let event: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!(
                event["message"],
                "accepted for tensile-kube compatibility; ignored: --provider=k8s --klog.v=5"
            );
            assert_eq!(lines.len(), 1, "{lines:?}");
        }))
    })
    .await
    .unwrap();
}
