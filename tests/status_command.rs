//! `virtual-node status`, as an operator runs it with the upper kubeconfig only: two
//! members served by one `--leader-elect` process and a member Secret that cannot join,
//! each shown with its node, readiness, lower API server and version, pods, share and
//! last warning, and the Lease's holder; `-o json` for scripts. Its own test binary.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use common::TIMEOUT;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tensile::member::spec::{KUBECONFIG_KEY, MEMBER_LABEL, NODE_NAME_ANNOTATION};
use tensile_harness::fixtures::bound_pod;
use tensile_harness::virtual_node::join_member;
use tensile_harness::{ClusterPair, TestNamespace, wait_for};

const A: &str = "vk-st-a";
const B: &str = "vk-st-b";
const BROKEN: &str = "vk-st-broken";

/// `virtual-node status <args>` with the upper kubeconfig only.
fn status(pair: &ClusterPair, args: &[&str]) -> Result<String, String> {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_virtual-node"))
        .arg("status")
        .arg("--kubeconfig")
        .arg(&pair.upper.kubeconfig)
        .args(args)
        .env_remove("KUBECONFIG")
        .output()
        .map_err(|e| e.to_string())?;
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).into_owned());
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The server of the current context of the kubeconfig at `path`.
fn server_of(path: &std::path::Path) -> String {
    let config = kube::config::Kubeconfig::read_from(path).unwrap();
    config.clusters[0]
        .cluster
        .as_ref()
        .unwrap()
        .server
        .clone()
        .unwrap()
}

fn row<'a>(status: &'a Value, node: &str) -> Option<&'a Value> {
    status["nodes"]
        .as_array()?
        .iter()
        .find(|n| n["node"] == node)
}

#[tokio::test]
async fn status_shows_each_member_its_lower_cluster_and_the_lease_holder() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let binary = std::path::Path::new(env!("CARGO_BIN_EXE_virtual-node"));
    let members = TestNamespace::create(&upper, "st-members").await.unwrap();
    for node in [A, B] {
        join_member(
            binary,
            &pair.upper.kubeconfig,
            &pair.lower.kubeconfig,
            node,
            &members.name,
        )
        .await
        .unwrap();
    }
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    secrets
        .patch(
            B,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"annotations": {"tensile.dev/share": "cpu=4,pods=20"}}}),
            ),
        )
        .await
        .unwrap();
    let args: Vec<String> = [
        "--leader-elect",
        "--leader-elect-identity=holder-1",
        "--leader-elect-resource-namespace",
        &members.name,
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    let _vn = pair
        .serve_members(binary, "vk-st", &members.name, &[A, B], &args)
        .await
        .unwrap();
    // A member Secret whose kubeconfig cannot be read: refused with a Warning.
    let mut broken = Secret::default();
    broken.metadata.name = Some("broken".into());
    broken.metadata.labels = Some([(MEMBER_LABEL.to_owned(), "true".to_owned())].into());
    broken.metadata.annotations =
        Some([(NODE_NAME_ANNOTATION.to_owned(), BROKEN.to_owned())].into());
    broken.data = Some(
        [(
            KUBECONFIG_KEY.to_owned(),
            ByteString(b"not: [a kubeconfig".to_vec()),
        )]
        .into(),
    );
    secrets
        .create(&PostParams::default(), &broken)
        .await
        .unwrap();
    // One pod on A.
    let ns = TestNamespace::create(&upper, "st").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    pods.create(&PostParams::default(), &bound_pod("p", A))
        .await
        .unwrap();
    common::wait_running(&pods, "", 1).await;

    let lower_server = server_of(&pair.lower.kubeconfig);
    let last = std::sync::Mutex::new(Value::Null);
    let shown = wait_for(
        "status -o json to show both members, the broken one and the lease",
        TIMEOUT,
        || async {
            let text = status(pair, &["--members-namespace", &members.name, "-o", "json"])
                .map_err(anyhow::Error::msg)?;
            let value: Value = serde_json::from_str(&text)?;
            *last.lock().unwrap() = value.clone();
            let (Some(a), Some(b), Some(broken)) =
                (row(&value, A), row(&value, B), row(&value, BROKEN))
            else {
                return Ok(None);
            };
            let done = a["ready"] == "True"
                && a["pods"] == 1
                && a["member"] == format!("{}/{A}", members.name)
                && a["lowerServer"] == lower_server.as_str()
                && a["lowerVersion"]
                    .as_str()
                    .is_some_and(|v| v.starts_with("v1."))
                && a["allocatable"]["cpu"].is_string()
                && b["ready"] == "True"
                && b["pods"] == 0
                && b["share"] == "cpu=4,pods=20"
                && broken["registered"] == false
                && broken["lastError"]["reason"].is_string()
                && value["leases"]
                    .as_array()
                    .is_some_and(|l| l.iter().any(|l| l["holder"] == "holder-1"));
            Ok(done.then_some(()))
        },
    )
    .await;
    assert!(
        shown.is_ok(),
        "{shown:?}; last:\n{}",
        serde_json::to_string_pretty(&*last.lock().unwrap()).unwrap()
    );
    let text = status(pair, &["--members-namespace", &members.name]).unwrap();
    println!("{text}");
    for needle in [
        format!("{A}  Ready=True since "),
        format!("member: {}/{A}   lower: {lower_server}", members.name),
        format!("{BROKEN}  not registered"),
        "share: cpu=4,pods=20".to_owned(),
        "held by holder-1".to_owned(),
    ] {
        assert!(text.contains(&needle), "{needle:?} not in:\n{text}");
    }
    // Only the node asked for.
    let one: Value = serde_json::from_str(
        &status(
            pair,
            &[
                "--members-namespace",
                &members.name,
                "--nodename",
                B,
                "-o",
                "json",
            ],
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(one["nodes"].as_array().map(Vec::len), Some(1), "{one}");
    // Nothing of a credential is printed.
    let token = std::fs::read_to_string(&pair.lower.kubeconfig).unwrap();
    for secret_line in token
        .lines()
        .filter(|l| l.contains("token:") || l.contains("-data:"))
    {
        let value = secret_line.split(':').nth(1).unwrap_or_default().trim();
        if value.len() > 8 {
            assert!(!text.contains(value), "a credential was printed");
        }
    }
    ns.delete().await.unwrap();
}
