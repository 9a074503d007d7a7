//! virtual-node refuses to start with one clear line naming the cluster and what is
//! wrong, and a non-zero exit: no panic, no stack trace.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::path::Path;
use std::process::{Command, Output};

use tensile_harness::ClusterPair;

fn virtual_node(upper: &Path, lower: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_virtual-node"))
        .args(["--nodename", "vk-startup", "--metrics-addr", "127.0.0.1:0"])
        .arg("--kubeconfig")
        .arg(upper)
        .arg("--client-kubeconfig")
        .arg(lower)
        .env("KUBELET_PORT", "0")
        .output()
        .unwrap()
}

fn assert_one_clear_line(output: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "must fail; stderr: {stderr}");
    assert_eq!(output.status.code(), Some(1), "stderr: {stderr}");
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("virtual-node:"))
        .collect();
    assert_eq!(lines.len(), 1, "one error line; stderr: {stderr}");
    for needle in needles {
        assert!(lines[0].contains(needle), "{needle:?} in {:?}", lines[0]);
    }
    assert!(!stderr.contains("panicked"), "no panic: {stderr}");
}

fn write_kubeconfig(dir: &Path, name: &str, server: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    let config = serde_json::json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server, "insecure-skip-tls-verify": true}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    });
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

#[test]
fn a_missing_kubeconfig_names_the_cluster_and_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let upper = write_kubeconfig(dir.path(), "upper", "https://127.0.0.1:1");
    let output = virtual_node(&upper, &dir.path().join("no-such-file"));
    assert_one_clear_line(&output, &["lower cluster", "kubeconfig", "no-such-file"]);
}

#[test]
fn an_unreachable_api_server_names_the_cluster_and_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let port = tensile_harness::ports::free_port().unwrap();
    let server = format!("https://127.0.0.1:{port}");
    let upper = write_kubeconfig(dir.path(), "upper", &server);
    let lower = write_kubeconfig(dir.path(), "lower", &server);
    let output = virtual_node(&upper, &lower);
    assert_one_clear_line(&output, &["cluster", "unreachable", &server]);
}

#[tokio::test]
async fn insufficient_rbac_names_the_cluster_and_what_is_missing() {
    let pair = ClusterPair::shared().await.unwrap();
    let nobody = pair.upper.kubeconfig_for("nobody", &[]).unwrap();
    let output = virtual_node(&nobody, pair.lower_kubeconfig());
    assert_one_clear_line(
        &output,
        &["upper cluster", "not allowed to", "create nodes", "RBAC"],
    );
}
