//! The webhook registered in a real upper API server through its
//! MutatingWebhookConfiguration, with a real virtual node: labelled pods that select
//! lower-only node labels burst onto the virtual node and run below on a matching node;
//! unlabelled pods and kube-system are untouched.
//!
//! Needs the `virtual-node` binary beside `tensile-webhook` in the target directory:
//! `cargo test --workspace` builds both (or `cargo build --bin virtual-node` first).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use base64::Engine;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::{Value, json};
use tensile::translate::meta::CLUSTER_SELECTOR_ANNOTATION;
use tensile::translate::scheduling::parse_cluster_selector;
use tensile_harness::fixtures::{deployment, pod, with_template_label};
use tensile_harness::{
    ClusterPair, PairOptions, TestNamespace, VirtualNodeOptions, node_is_ready, wait_for,
};
use tensile_webhook::loopback::Client;

/// Generous: two clusters, a virtual node and the webhook share 2 cores.
const TIMEOUT: Duration = Duration::from_secs(120);
const NODE: &str = "vk-webhook";
const WEBHOOK_CONFIG: &str = "tensile-webhook-test";

fn virtual_node_binary() -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_tensile-webhook")).with_file_name("virtual-node");
    assert!(
        path.exists(),
        "{} is missing: this test runs the virtual node too; build it with \
         `cargo test --workspace` or `cargo build --bin virtual-node`",
        path.display()
    );
    path
}

/// The running webhook process; killed on drop.
struct Webhook {
    _child: tokio::process::Child,
    log: PathBuf,
}

impl Webhook {
    fn log_tail(&self) -> String {
        tensile_harness::process::tail(&self.log, 40)
    }
}

async fn start_webhook(pair: &ClusterPair, dir: &Path) -> (Webhook, Client, String, u16) {
    let bin = env!("CARGO_BIN_EXE_tensile-webhook");
    // The certificate comes from the generator the project ships.
    let ca_bundle = tensile_harness::pki::webhook_serving_certs(Path::new(bin), dir).unwrap();
    let ca = std::fs::read(dir.join("ca.crt")).unwrap();
    assert_eq!(
        base64::engine::general_purpose::STANDARD
            .decode(&ca_bundle)
            .unwrap(),
        ca
    );

    let port = tensile_harness::ports::free_port().unwrap();
    let log = pair.dir.join("tensile-webhook.log");
    let out = std::fs::File::create(&log).unwrap();
    let child = tokio::process::Command::new(bin)
        .args(["--address", "127.0.0.1", "--port", &port.to_string()])
        .arg("--tlscert")
        .arg(dir.join("tls.crt"))
        .arg("--tlskey")
        .arg(dir.join("tls.key"))
        .arg("--kubeconfig")
        .arg(pair.upper_kubeconfig())
        .args(["--log-level", "debug"])
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let child = std::cell::RefCell::new(child);
    let client = Client::new(([127, 0, 0, 1], port).into(), &ca, "127.0.0.1").unwrap();
    let ready = wait_for("tensile-webhook ready", TIMEOUT, || async {
        let exited = child.borrow_mut().try_wait()?;
        if let Some(status) = exited {
            anyhow::bail!("tensile-webhook exited: {status}");
        }
        let Ok(mut conn) = client.connect().await else {
            return Ok(None);
        };
        let reply = conn.send("GET", "/readyz", Vec::new()).await;
        Ok(reply.ok().filter(|r| r.status == 200).map(|_| ()))
    })
    .await;
    let webhook = Webhook {
        _child: child.into_inner(),
        log,
    };
    if let Err(error) = ready {
        panic!(
            "{error:#}\n--- tensile-webhook log:\n{}",
            webhook.log_tail()
        );
    }
    (webhook, client, ca_bundle, port)
}

/// The configuration deploy/webhook ships, pointed at the process by URL.
fn webhook_configuration(url: &str, ca_bundle: &str) -> MutatingWebhookConfiguration {
    tensile_harness::fixtures::webhook_configuration(
        WEBHOOK_CONFIG,
        url,
        ca_bundle,
        tensile_harness::fixtures::all_but_kube_system(),
    )
}

fn stash(pod: &Pod) -> Option<Value> {
    let raw = pod
        .metadata
        .annotations
        .as_ref()?
        .get(CLUSTER_SELECTOR_ANNOTATION)?;
    serde_json::from_str(raw).ok()
}

fn tolerates_virtual_node(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .unwrap()
        .tolerations
        .iter()
        .flatten()
        .any(|t| {
            t.key.as_deref() == Some("virtual-kubelet.io/provider")
                && t.operator.as_deref() == Some("Exists")
        })
}

fn app_spec(extra: Value) -> Value {
    let mut spec = json!({"containers": [{"name": "app", "image": "nginx"}]});
    tensile_harness::fixtures::merge(&mut spec, extra);
    spec
}

#[tokio::test]
async fn labelled_pods_burst_onto_the_virtual_node_with_their_selector_below() {
    let virtual_node = virtual_node_binary();
    let mut options = PairOptions::default();
    // Only the lower cluster's nodes have it; the upper one has no nodes but the virtual one.
    options
        .lower
        .node_labels
        .insert("disktype".into(), "ssd".into());
    let pair = ClusterPair::start(options).await.unwrap();
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let certs = tempfile::tempdir().unwrap();
    let (webhook, webhook_client, ca_bundle, port) = start_webhook(&pair, certs.path()).await;
    let url = format!("https://127.0.0.1:{port}/mutate");
    let configs: Api<MutatingWebhookConfiguration> = Api::all(upper.clone());
    configs
        .create(
            &PostParams::default(),
            &webhook_configuration(&url, &ca_bundle),
        )
        .await
        .unwrap();

    let mut vn = pair
        .start_virtual_node(&VirtualNodeOptions::new(&virtual_node, NODE))
        .unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    if let Err(error) = wait_for("the virtual node Ready", TIMEOUT, || async {
        Ok(nodes.get_opt(NODE).await?.filter(node_is_ready).map(|_| ()))
    })
    .await
    {
        let _ = vn.check_running();
        panic!(
            "{error:#}\n{}",
            tensile_harness::process::tail(vn.log(), 40)
        );
    }

    let ns = TestNamespace::create(&upper, "webhook").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    // The API server picks the configuration up asynchronously: probe with dry runs.
    let probe = {
        let mut p = pod(
            "probe",
            app_spec(json!({"nodeSelector": {"disktype": "ssd"}})),
        );
        p.metadata
            .labels
            .get_or_insert_default()
            .insert("virtual-pod".into(), "true".into());
        p
    };
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let active = wait_for("the webhook to be called", TIMEOUT, || async {
        Ok(stash(&upper_pods.create(&dry, &probe).await?).map(|_| ()))
    })
    .await;
    if let Err(error) = active {
        panic!(
            "{error:#}\n--- tensile-webhook log:\n{}",
            webhook.log_tail()
        );
    }

    // A labelled Deployment selecting a lower-only label, with no toleration.
    let web = with_template_label(
        deployment(
            "web",
            2,
            app_spec(json!({"nodeSelector": {"disktype": "ssd"}})),
        ),
        "virtual-pod",
        "true",
    );
    Api::<Deployment>::namespaced(upper.clone(), &ns.name)
        .create(&PostParams::default(), &web)
        .await
        .unwrap();

    let running = |pods: &[Pod]| {
        pods.iter()
            .all(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
    };
    let list = |api: Api<Pod>| async move {
        let pods = api
            .list(&ListParams::default().labels("app=web"))
            .await?
            .items;
        Ok::<_, anyhow::Error>(
            pods.into_iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .collect::<Vec<_>>(),
        )
    };
    let above = wait_for(
        "2 web pods Running on the virtual node",
        TIMEOUT,
        || async {
            let pods = list(upper_pods.clone()).await?;
            Ok((pods.len() == 2 && running(&pods)).then_some(pods))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n--- tensile-webhook log:\n{}", webhook.log_tail()));
    for p in &above {
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some(NODE));
        assert_eq!(
            spec.node_selector, None,
            "the selector moved into the stash"
        );
        assert!(tolerates_virtual_node(p));
        let stashed = parse_cluster_selector(p.metadata.annotations.as_ref())
            .unwrap()
            .unwrap();
        assert_eq!(
            stashed.node_selector,
            Some([("disktype".to_owned(), "ssd".to_owned())].into())
        );
    }

    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let below = wait_for("2 web pods Running below", TIMEOUT, || async {
        let pods = list(lower_pods.clone()).await?;
        Ok((pods.len() == 2 && running(&pods)).then_some(pods))
    })
    .await
    .unwrap();
    for p in &below {
        let spec = p.spec.as_ref().unwrap();
        assert_eq!(
            spec.node_selector,
            Some([("disktype".to_owned(), "ssd".to_owned())].into()),
            "the original selector is restored below"
        );
        assert!(
            !tolerates_virtual_node(p),
            "the upper toleration stays above"
        );
        let node = spec.node_name.as_deref().unwrap();
        let lower_node = Api::<Node>::all(lower.clone()).get(node).await.unwrap();
        assert_eq!(
            lower_node
                .metadata
                .labels
                .unwrap()
                .get("disktype")
                .map(String::as_str),
            Some("ssd")
        );
    }

    // An unlabelled pod is untouched (the objectSelector, and the webhook itself).
    let plain = upper_pods
        .create(
            &PostParams::default(),
            &pod(
                "plain",
                app_spec(json!({"nodeSelector": {"disktype": "ssd"}})),
            ),
        )
        .await
        .unwrap();
    assert_eq!(stash(&plain), None);
    assert_eq!(
        plain.spec.as_ref().unwrap().node_selector,
        Some([("disktype".to_owned(), "ssd".to_owned())].into())
    );
    assert!(!tolerates_virtual_node(&plain));

    // A labelled pod in kube-system is untouched.
    let system: Api<Pod> = Api::namespaced(upper.clone(), "kube-system");
    let mut labelled = pod(
        "tensile-webhook-test",
        app_spec(json!({"nodeSelector": {"disktype": "ssd"}})),
    );
    labelled
        .metadata
        .labels
        .get_or_insert_default()
        .insert("virtual-pod".into(), "true".into());
    let created = system
        .create(&PostParams::default(), &labelled)
        .await
        .unwrap();
    assert_eq!(stash(&created), None);
    assert!(!tolerates_virtual_node(&created));
    assert_eq!(
        created.spec.as_ref().unwrap().node_selector,
        Some([("disktype".to_owned(), "ssd".to_owned())].into())
    );

    // A pod mounting a PVC provisioned on a node is bound to that node (read from the
    // webhook's PVC cache, which may lag the create by a moment).
    let claim: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "data", "annotations": {"volume.kubernetes.io/selected-node": NODE}},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "none",
                 "resources": {"requests": {"storage": "1Gi"}}},
    }))
    .unwrap();
    Api::<PersistentVolumeClaim>::namespaced(upper.clone(), &ns.name)
        .create(&PostParams::default(), &claim)
        .await
        .unwrap();
    let mut with_volume = pod(
        "with-volume",
        app_spec(
            json!({"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]}),
        ),
    );
    with_volume
        .metadata
        .labels
        .get_or_insert_default()
        .insert("virtual-pod".into(), "true".into());
    let bound = wait_for("the pod bound to the PVC's node", TIMEOUT, || async {
        let created = upper_pods.create(&dry, &with_volume).await?;
        let node = created.spec.and_then(|s| s.node_name);
        Ok((node.as_deref() == Some(NODE)).then_some(()))
    })
    .await;
    if let Err(error) = bound {
        panic!(
            "{error:#}\n--- tensile-webhook log:\n{}",
            webhook.log_tail()
        );
    }

    // The webhook saw the pods it mutated and nothing it ignores by selector.
    let mut conn = webhook_client.connect().await.unwrap();
    let metrics =
        String::from_utf8(conn.send("GET", "/metrics", Vec::new()).await.unwrap().body).unwrap();
    assert!(!metrics.contains("decision=\"mutated\"} 0"), "{metrics}");

    // Clean up: the configuration first, so nothing waits on a stopped webhook.
    system
        .delete("tensile-webhook-test", &DeleteParams::default())
        .await
        .unwrap();
    configs
        .delete(WEBHOOK_CONFIG, &DeleteParams::default())
        .await
        .unwrap();
    ns.delete().await.unwrap();
    vn.stop().unwrap();
    drop(webhook);
    pair.stop();
}
