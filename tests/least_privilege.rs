//! Least privilege for the components beside virtual-node: each binary runs against the
//! harness's API servers as the identity its kustomization in `deploy/` binds, granted
//! exactly the RBAC that kustomization renders (with the pinned kubectl), and does its
//! job. virtual-node has its own (`virtual_node_startup.rs`,
//! `exactly_the_checked_permissions_run_every_scenario`); the descheduler moves pods as its
//! ServiceAccount with `deploy/descheduler`'s RBAC in `descheduler.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::path::{Path, PathBuf};

use common::TIMEOUT;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};
use tensile::translate::meta::{CLUSTER_SELECTOR_ANNOTATION, SELECTED_NODE_ANNOTATION};
use tensile_harness::fixtures::virtual_node_toleration;
use tensile_harness::ports::free_port;
use tensile_harness::process::{Process, tail};
use tensile_harness::rbac::ShippedRbac;
use tensile_harness::{ClusterPair, TestNamespace, wait_for};

/// The namespace the upper-cluster kustomizations install into.
const NAMESPACE: &str = "tensile-system";

/// Renders and applies the RBAC of `kustomization` to the cluster of `kubeconfig`.
fn apply_rbac(pair: &ClusterPair, kubeconfig: &Path, kustomization: &str) -> ShippedRbac {
    ShippedRbac::apply(
        &pair.bin("kubectl"),
        kubeconfig,
        Path::new(env!("CARGO_MANIFEST_DIR")),
        kustomization,
        &pair.dir,
    )
    .unwrap()
}

/// The lines of a component's log that tell of a refusal by RBAC.
fn refusals(log: &Path) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            let lower = l.to_ascii_lowercase();
            lower.contains("forbidden") || lower.contains("code: 403")
        })
        .map(str::to_owned)
        .collect()
}

/// One HTTP/1.1 request over a fresh connection: (status, body).
async fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    tensile_harness::http::request(port, method, path, body)
        .await
        .unwrap()
}

/// Fails if the component's log tells of a refusal by RBAC.
fn assert_no_refusal(process: &Process) {
    let refused = refusals(process.log());
    assert!(
        refused.is_empty(),
        "{} was refused:\n{}",
        process.name(),
        refused.join("\n")
    );
}

/// tensile-webhook runs as its ServiceAccount with `deploy/webhook`'s RBAC (PVC metadata,
/// read-only) and binds a pod through the API server's admission to the node its PVC was
/// provisioned on, which it knows only through its PVC watch.
#[tokio::test]
async fn the_webhook_binds_a_pod_to_its_volume_node_with_the_shipped_rbac() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    tensile_harness::pair::ensure_namespace(&upper, NAMESPACE)
        .await
        .unwrap();
    let rbac = apply_rbac(pair, pair.upper_kubeconfig(), "deploy/webhook");
    let identity = format!("system:serviceaccount:{NAMESPACE}:tensile-webhook");
    let groups = [
        "system:serviceaccounts".to_owned(),
        format!("system:serviceaccounts:{NAMESPACE}"),
    ];
    let groups: Vec<&str> = groups.iter().map(String::as_str).collect();
    let kubeconfig = pair.upper.kubeconfig_for(&identity, &groups).unwrap();

    let bin = common::workspace_binary("tensile-webhook");
    let certs = pair.dir.join("least-webhook-certs");
    let ca_bundle = tensile_harness::pki::webhook_serving_certs(&bin, &certs).unwrap();
    let port = free_port().unwrap();
    let path = |p: PathBuf| p.display().to_string();
    let webhook = pair
        .spawn(
            "least-webhook",
            &bin,
            &[
                "--address=127.0.0.1".into(),
                format!("--port={port}"),
                format!("--tlscert={}", path(certs.join("tls.crt"))),
                format!("--tlskey={}", path(certs.join("tls.key"))),
                format!("--kubeconfig={}", path(kubeconfig)),
                "--log-level=tensile=debug,tensile_webhook=debug,info".into(),
            ],
        )
        .unwrap();

    let ns = TestNamespace::create(&upper, "least-webhook")
        .await
        .unwrap();
    let node = "vk-least-webhook";
    let claim: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "data", "annotations": {SELECTED_NODE_ANNOTATION: node}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Mi"}}},
    }))
    .unwrap();
    Api::<PersistentVolumeClaim>::namespaced(upper.clone(), &ns.name)
        .create(&PostParams::default(), &claim)
        .await
        .unwrap();
    // Only this test's namespace: other tests of this process share the upper cluster.
    let config_name = format!("tensile-webhook-{}", ns.name);
    let config = tensile_harness::fixtures::webhook_configuration(
        &config_name,
        &format!("https://127.0.0.1:{port}/mutate"),
        &ca_bundle,
        json!({"matchLabels": {"kubernetes.io/metadata.name": ns.name}}),
    );
    let configs: Api<MutatingWebhookConfiguration> = Api::all(upper.clone());
    configs
        .create(&PostParams::default(), &config)
        .await
        .unwrap();

    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "app", "labels": {"virtual-pod": "true"}},
        "spec": {
            "containers": [{"name": "app", "image": "nginx",
                            "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
        },
    }))
    .unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    // A dry run goes through admission and creates nothing, so it can be asked until the
    // webhook serves and its PVC watch has listed.
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let admitted = wait_for(
        "the webhook to bind the pod to its volume's node",
        TIMEOUT,
        || async {
            let Ok(admitted) = pods.create(&dry_run, &pod).await else {
                return Ok(None);
            };
            let bound = admitted.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node);
            Ok(bound.then_some(admitted))
        },
    )
    .await;
    let admitted = admitted.unwrap_or_else(|e| panic!("{e:#}\n{}", tail(webhook.log(), 40)));
    let annotations = admitted.metadata.annotations.unwrap_or_default();
    assert!(
        annotations.contains_key(CLUSTER_SELECTOR_ANNOTATION),
        "mutated by the webhook: {annotations:?}"
    );
    assert_no_refusal(&webhook);

    configs
        .delete(&config_name, &DeleteParams::default())
        .await
        .unwrap();
    ns.delete().await.unwrap();
    rbac.remove().unwrap();
}

/// tensile-scheduler-extender runs as the lower identity `deploy/scheduler-extender/lower`
/// binds (nodes and pods, read-only), syncs its lower watches, and filters by what they
/// hold: a pod a lower node takes passes the virtual node, one none takes does not.
#[tokio::test]
async fn the_extender_filters_through_its_lower_watch_with_the_shipped_rbac() {
    let pair = ClusterPair::shared().await.unwrap();
    let rbac = apply_rbac(
        pair,
        pair.lower_kubeconfig(),
        "deploy/scheduler-extender/lower",
    );
    let kubeconfig = pair
        .lower
        .kubeconfig_for("tensile-scheduler-extender", &[])
        .unwrap();
    let node = "vk-least-extender";
    let port = free_port().unwrap();
    let extender = pair
        .spawn(
            "least-extender",
            &common::workspace_binary("tensile-scheduler-extender"),
            &[
                format!("--cluster={node}={}", kubeconfig.display()),
                // Upstairs it reads Node labels only (deploy/scheduler-extender/rbac.yaml,
                // checked by tests/deploy.rs); here the admin's kubeconfig serves.
                format!("--kubeconfig={}", pair.upper_kubeconfig().display()),
                format!("--listen=127.0.0.1:{port}"),
                "--log-level=tensile=debug,tensile_scheduler_extender=debug,info".into(),
            ],
        )
        .unwrap();
    let ready = wait_for("the extender's lower watch synced", TIMEOUT, || async {
        let listening = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok();
        Ok((listening && http(port, "GET", "/readyz", "").await.0 == 200).then_some(()))
    })
    .await;
    if let Err(e) = ready {
        panic!("{e:#}\n{}", tail(extender.log(), 40));
    }

    let filter = |cpu: &str| {
        let pod = json!({
            "metadata": {"name": "app", "namespace": "default"},
            "spec": {"tolerations": [virtual_node_toleration()],
                     "containers": [{"name": "app", "image": "nginx",
                                     "resources": {"requests": {"cpu": cpu}}}]},
        });
        json!({"Pod": pod, "NodeNames": [node]}).to_string()
    };
    let passes = |answer: &Value| {
        answer["NodeNames"]
            .as_array()
            .is_some_and(|names| names.iter().any(|n| n == node))
    };
    let (status, body) = http(port, "POST", "/filter", &filter("100m")).await;
    let fits: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(passes(&fits), "a pod a lower node takes passes: {body}");
    let (status, body) = http(port, "POST", "/filter", &filter("100000")).await;
    let too_big: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(!passes(&too_big), "a pod no lower node takes fails: {body}");
    assert!(
        too_big["FailedAndUnresolvableNodes"][node].is_string(),
        "with the reason: {body}"
    );
    assert_no_refusal(&extender);
    drop(extender);
    rbac.remove().unwrap();
}
