//! virtual-node refuses to start with one clear line naming the cluster and what is
//! wrong, and a non-zero exit: no panic, no stack trace.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

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

/// Runs `kubectl apply` of a manifest file of this repository against `kubeconfig`.
fn kubectl_apply(pair: &ClusterPair, kubeconfig: &Path, namespace: Option<&str>, file: &str) {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    let mut command = Command::new(pair.bin("kubectl"));
    command
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["apply", "-f"])
        .arg(manifest);
    if let Some(ns) = namespace {
        command.args(["-n", ns]);
    }
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test]
async fn the_shipped_rbac_is_enough_to_run() {
    use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Secret};
    use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
    use kube::api::{Api, PostParams};
    use serde_json::json;
    use tensile_harness::fixtures::{config_map, merge, pinned_spec, pod, secret};
    use tensile_harness::{TestNamespace, VirtualNodeOptions, node_is_ready, wait_for};

    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let pp = PostParams::default();
    let ns: Namespace =
        serde_json::from_value(json!({"metadata": {"name": "tensile-system"}})).unwrap();
    Api::<Namespace>::all(upper.clone())
        .create(&pp, &ns)
        .await
        .unwrap();
    kubectl_apply(
        pair,
        pair.upper_kubeconfig(),
        Some("tensile-system"),
        "deploy/virtual-node/rbac.yaml",
    );
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "tensile-virtual-node-test-user"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "tensile-virtual-node"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "vk-rbac"}],
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(upper.clone())
        .create(&pp, &binding)
        .await
        .unwrap();
    kubectl_apply(
        pair,
        pair.lower_kubeconfig(),
        None,
        "deploy/virtual-node-lower/rbac.yaml",
    );

    let node = "vk-rbac";
    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), node);
    options.upper_kubeconfig = Some(pair.upper.kubeconfig_for("vk-rbac", &[]).unwrap());
    options.lower_kubeconfig = Some(
        pair.lower
            .kubeconfig_for("tensile-virtual-node", &[])
            .unwrap(),
    );
    let mut vn = pair.start_virtual_node(&options).unwrap();
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(upper.clone());
    let ready = wait_for("the node Ready", Duration::from_secs(60), || async {
        Ok(nodes.get_opt(node).await?.filter(node_is_ready).map(|_| ()))
    })
    .await;
    if let Err(error) = ready {
        let _ = vn.check_running();
        panic!(
            "{error:#}\n{}",
            tensile_harness::process::tail(vn.log(), 20)
        );
    }

    let test_ns = TestNamespace::create(&upper, "rbac").await.unwrap();
    Api::<ConfigMap>::namespaced(upper.clone(), &test_ns.name)
        .create(&pp, &config_map("c", json!({"k": "v"})))
        .await
        .unwrap();
    Api::<Secret>::namespaced(upper.clone(), &test_ns.name)
        .create(&pp, &secret("s", json!({"k": "v"})))
        .await
        .unwrap();
    let mut spec = pinned_spec(node);
    merge(
        &mut spec,
        json!({"nodeName": node, "volumes": [
            {"name": "c", "configMap": {"name": "c"}}, {"name": "s", "secret": {"secretName": "s"}}]}),
    );
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &test_ns.name);
    upper_pods.create(&pp, &pod("app", spec)).await.unwrap();
    wait_for(
        "the pod Running through the least-privileged identities",
        Duration::from_secs(60),
        || async {
            let phase = upper_pods.get("app").await?.status.and_then(|s| s.phase);
            Ok((phase.as_deref() == Some("Running")).then_some(()))
        },
    )
    .await
    .unwrap();
    vn.stop().unwrap();
    test_ns.delete().await.unwrap();
}
