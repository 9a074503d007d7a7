//! What the extender's cluster tests share: the extender served in process on the port the
//! upper kube-scheduler calls, a virtual node, pods and the waits on them.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)] // test code

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::Client;
use kube::api::{Api, ListParams};
use serde_json::{Value, json};
use tensile::clusters::Trust;
use tensile_harness::fixtures::{merge, pod, virtual_node_toleration};
use tensile_harness::{
    ClusterPair, VirtualNode, VirtualNodeOptions, node_is_schedulable, wait_for,
};
use tensile_scheduler_extender::cli::LowerCluster;
use tensile_scheduler_extender::extender::Extender;
use tensile_scheduler_extender::metrics::Metrics;
use tensile_scheduler_extender::server::{self, App};
use tensile_scheduler_extender::watch;
use tensile_scheduler_extender::wire::ExtenderArgs;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Generous: two clusters, a virtual node and the build share 2 cores.
pub const TIMEOUT: Duration = Duration::from_secs(120);
/// The virtual node's name.
pub const VK: &str = "vk-node";

/// `virtual-node`, built by cargo if needed (a binary of another package of the
/// workspace, so `CARGO_BIN_EXE_` does not name it). Built as `cargo test --workspace`
/// builds it (every target's features unified), so that under it, as in CI, this is
/// no work; `-p tensile` alone would build it, and half its dependencies, again.
pub fn virtual_node_binary() -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut command = std::process::Command::new(cargo);
    command
        .args(["build", "--workspace", "--all-targets"])
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    // What cargo set for running this test (CARGO_PKG_NAME, CARGO_MANIFEST_DIR, OUT_DIR,
    // ...) would reach the build scripts that watch those names (ring's does), and make
    // them, and everything above them, build again.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let set_for_the_test = [
            "CARGO_PKG_",
            "CARGO_MANIFEST_",
            "CARGO_CRATE_",
            "CARGO_BIN_",
        ]
        .iter()
        .any(|prefix| name.starts_with(prefix))
            || ["CARGO_PRIMARY_PACKAGE", "CARGO_TARGET_TMPDIR", "OUT_DIR"].contains(&&*name);
        if set_for_the_test {
            command.env_remove(&*name);
        }
    }
    let status = command
        .status()
        .expect("running cargo build for virtual-node");
    assert!(
        status.success(),
        "cargo build --workspace --all-targets (for virtual-node)"
    );
    // target/debug/deps/<this test> → target/debug/virtual-node
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("virtual-node")
}

/// The `extenders` entry of a KubeSchedulerConfiguration calling the extender on `port`,
/// as `deploy/scheduler-extender/kube-scheduler-config.yaml` configures it.
pub fn scheduler_extenders(port: u16) -> Value {
    tensile_harness::scheduler_extender::shipped_scheduler_config(&format!(
        "http://127.0.0.1:{port}"
    ))
    .unwrap()["extenders"]
        .clone()
}

/// The extender served in process.
pub struct ServedExtender {
    /// Its state, to call filter directly.
    pub app: Arc<App>,
    /// Where it listens.
    pub port: u16,
    shutdown: CancellationToken,
    served: JoinHandle<()>,
    watching: JoinHandle<()>,
}

impl ServedExtender {
    /// Serves the extender of `VK` over the lower cluster of `lower_kubeconfig` on `port`
    /// and waits until its caches have synced.
    pub async fn start(pair: &ClusterPair, lower_kubeconfig: PathBuf, port: u16) -> Self {
        Self::start_clusters(pair, &[(VK.to_owned(), lower_kubeconfig)], port).await
    }

    /// Serves the extender of every (virtual node, lower kubeconfig) of `clusters` on
    /// `port`, with `pair`'s upper Node labels, and waits until its caches have synced.
    pub async fn start_clusters(
        pair: &ClusterPair,
        clusters: &[(String, PathBuf)],
        port: u16,
    ) -> Self {
        let shutdown = CancellationToken::new();
        // Read as the chart gives them (mounted from Secrets): the harness writes them inline.
        let clusters: Vec<LowerCluster> = clusters
            .iter()
            .map(|(node, kubeconfig)| LowerCluster {
                node: node.clone(),
                kubeconfig: kubeconfig.clone(),
                trust: Trust::FromSecret,
            })
            .collect();
        let (extender, watches) = watch::connect(&clusters, Extender::default(), shutdown.clone())
            .await
            .unwrap();
        let upper = watch::upper_client(Some(pair.upper_kubeconfig()))
            .await
            .unwrap();
        let upper_nodes = watch::run_upper(upper, extender.upper.clone(), shutdown.clone());
        let watches = async move {
            futures::join!(watches, upper_nodes);
        };
        let app = Arc::new(App {
            extender,
            metrics: Metrics::default(),
        });
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        let served = tokio::spawn(server::serve(
            listener,
            None,
            server::router(app.clone()),
            shutdown.clone(),
        ));
        let watching = tokio::spawn(watches);
        wait_for("the extender's caches synced", TIMEOUT, || async {
            Ok(app.extender.ready().is_ok().then_some(()))
        })
        .await
        .unwrap();
        Self {
            app,
            port,
            shutdown,
            served,
            watching,
        }
    }

    /// Stops serving and watching.
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.served.await.unwrap();
        self.watching.await.unwrap();
    }
}

/// Starts `virtual-node` as `VK` and waits until its Node is Ready in the upper cluster.
pub async fn start_virtual_node(
    pair: &ClusterPair,
    binary: &PathBuf,
    upper: &Client,
) -> VirtualNode {
    let vn = pair
        .start_virtual_node(&VirtualNodeOptions::new(binary, VK))
        .unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    // Schedulable too: a burst created while the not-ready taint is still on would meet
    // it (FailedScheduling "untolerated taint"), not the extender.
    wait_for("vk-node Ready and schedulable", TIMEOUT, || async {
        Ok(nodes
            .get_opt(VK)
            .await?
            .filter(node_is_schedulable)
            .map(|_| ()))
    })
    .await
    .unwrap();
    vn
}

/// filter's arguments for `pod` and the nodes `nodes`, by name.
pub fn args(pod: &Pod, nodes: &[&str]) -> ExtenderArgs {
    ExtenderArgs {
        pod: Some(pod.clone()),
        nodes: None,
        node_names: Some(nodes.iter().map(ToString::to_string).collect()),
    }
}

/// One HTTP/1.1 request over a fresh connection: (status, body).
pub async fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    tensile_harness::http::request(port, method, path, body)
        .await
        .unwrap()
}

/// A pod that tolerates the virtual node and requests `cpu`, with `extra` merged into
/// its spec.
pub fn cpu_pod(name: &str, cpu: &str, extra: Value) -> Pod {
    let mut spec = json!({
        "tolerations": [virtual_node_toleration()],
        "containers": [{"name": "app", "image": "nginx", "resources": {"requests": {"cpu": cpu}}}],
    });
    merge(&mut spec, extra);
    pod(name, spec)
}

/// The spec fields that keep a pod to the virtual node.
pub fn to_vk() -> Value {
    json!({"nodeSelector": {"kubernetes.io/hostname": VK}})
}

/// Waits until pod `name` is bound; its node.
pub async fn scheduled_to(api: &Api<Pod>, name: &str) -> String {
    wait_for(&format!("pod {name} scheduled"), TIMEOUT, || async {
        let pod = api.get(name).await?;
        Ok(pod.spec.and_then(|s| s.node_name).filter(|n| !n.is_empty()))
    })
    .await
    .unwrap()
}

/// Waits until pod `name` is Running.
pub async fn wait_phase_running(api: &Api<Pod>, name: &str) {
    wait_for(&format!("pod {name} Running"), TIMEOUT, || async {
        let pod = api.get(name).await?;
        Ok((pod.status.and_then(|s| s.phase).as_deref() == Some("Running")).then_some(()))
    })
    .await
    .unwrap();
}

/// The notes of the FailedScheduling events of pod `name`, oldest first.
pub async fn failed_scheduling(events: &Api<Event>, name: &str) -> Vec<String> {
    let mut list: Vec<Event> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                && e.reason.as_deref() == Some("FailedScheduling")
        })
        .collect();
    list.sort_by_key(|e| e.metadata.creation_timestamp.clone().map(|t| t.0));
    list.into_iter().filter_map(|e| e.note).collect()
}
