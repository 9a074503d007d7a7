//! `virtual-node check` against two real clusters: all ✓ with enough rights, and each
//! missing permission or busy port named on a ✗ line with exit 1, changing nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::path::Path;
use std::process::Output;
use std::time::Duration;

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

/// Runs `virtual-node <verb>` for node `node` of members namespace `namespace`, with the
/// pair's admin kubeconfigs; its exit status and stdout, stderr.
async fn member_command(
    pair: &ClusterPair,
    verb: &str,
    node: &str,
    namespace: &str,
) -> (Output, String) {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_virtual-node"))
        .arg(verb)
        .args(["--nodename", node, "--members-namespace", namespace])
        .arg("--kubeconfig")
        .arg(pair.upper_kubeconfig())
        .arg("--client-kubeconfig")
        .arg(pair.lower_kubeconfig())
        .arg(format!("--metrics-addr=127.0.0.1:{}", free_port().unwrap()))
        .output()
        .await
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output, said)
}

/// `join` makes the lower cluster a member with an identity of its own that passes
/// `check`; a virtual-node joins it; `leave` waits for the member to leave and removes
/// that identity. Both are idempotent.
#[tokio::test]
async fn join_then_leave_a_member_cluster() {
    use k8s_openapi::api::core::v1::{Node, Secret, ServiceAccount};
    use kube::Api;
    use tensile::member::join::{LOWER_NAMESPACE, LowerIdentity};
    use tensile_harness::{TestNamespace, VirtualNodeOptions, node_is_ready, wait_for};

    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let members = TestNamespace::create(&upper, "joined").await.unwrap();
    let node = "vk-joined";
    let upper_id = Api::<k8s_openapi::api::core::v1::Namespace>::all(upper.clone())
        .get("kube-system")
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    let identity = LowerIdentity::of(node, &upper_id);
    let bound_line = format!(
        "ServiceAccount tensile-system/{} bound to ClusterRole tensile-virtual-node-lower",
        identity.service_account
    );
    for _ in 0..2 {
        let (output, said) = member_command(pair, "join", node, &members.name).await;
        assert!(output.status.success(), "{said}");
        for line in [
            &bound_line,
            &format!("member Secret {}/{node}", members.name),
            "next: virtual-node check",
        ] {
            assert!(said.contains(line), "{line:?} missing from:\n{said}");
        }
    }
    // The joined identity, not the admin's, is what the member Secret holds, and it has
    // every permission a member needs below.
    let secret = Api::<Secret>::namespaced(upper.clone(), &members.name)
        .get(node)
        .await
        .unwrap();
    let kubeconfig = String::from_utf8(secret.data.unwrap()["kubeconfig"].0.clone()).unwrap();
    assert!(kubeconfig.contains("tensile-vk-joined"), "{kubeconfig}");
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
    assert!(output.status.success(), "{report}");
    assert!(
        report.contains(&format!("✓ node {node}: lower cluster: all")),
        "{report}"
    );

    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), node);
    options.flags_member = false;
    options.args = vec!["--members-namespace".into(), members.name.clone()];
    let mut vn = pair.start_virtual_node(&options).unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    let ready = wait_for(
        "the joined node Ready",
        Duration::from_secs(120),
        || async { Ok(nodes.get_opt(node).await?.filter(node_is_ready).map(|_| ())) },
    )
    .await;
    if let Err(error) = ready {
        let _ = vn.check_running();
        panic!(
            "{error:#}\n{}",
            tensile_harness::process::tail(vn.log(), 40)
        );
    }

    let (output, said) = member_command(pair, "leave", node, &members.name).await;
    assert!(output.status.success(), "{said}");
    assert!(said.contains("member vk-joined left"), "{said}");
    assert!(
        nodes.get_opt(node).await.unwrap().is_none(),
        "the node is gone once leave returns"
    );
    assert!(
        Api::<ServiceAccount>::namespaced(lower.clone(), LOWER_NAMESPACE)
            .get_opt(&identity.service_account)
            .await
            .unwrap()
            .is_none(),
        "the lower identity is gone"
    );
    let (output, said) = member_command(pair, "leave", node, &members.name).await;
    assert!(output.status.success(), "a second leave: {said}");
    assert!(
        said.contains("no member Secret for node vk-joined"),
        "{said}"
    );
    vn.check_running().unwrap();
}
