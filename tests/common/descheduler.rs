//! The companions of virtual-node as the descheduler tests start them: the webhook, a
//! kubeconfig with the descheduler's shipped RBAC, descheduler replicas; and what those
//! tests read off pods and Events.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::{Value, json};
use tensile_harness::{ClusterPair, wait_for};

use super::TIMEOUT;

/// The descheduler's round, short so that a test waits seconds for a move.
pub const INTERVAL_SECS: u64 = 2;

/// A child process killed on drop, its output in `log`.
pub struct Child {
    child: tokio::process::Child,
    log: PathBuf,
    port: u16,
}

impl Child {
    /// Starts `program` with `args`, stdout and stderr to `log`; `port` is its HTTP port.
    pub fn spawn(program: &Path, args: &[String], log: PathBuf, port: u16) -> Self {
        let out = std::fs::File::create(&log).unwrap();
        let child = tokio::process::Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Self { child, log, port }
    }

    /// GET `path` from its HTTP port: (status, body).
    pub async fn get(&self, path: &str) -> (u16, String) {
        tensile_harness::http::request(self.port, "GET", path, "")
            .await
            .unwrap()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGKILL, and wait.
    pub async fn kill(mut self) {
        self.child.kill().await.unwrap();
    }

    /// SIGTERM, then the exit status.
    pub async fn terminate(mut self) -> std::process::ExitStatus {
        let pid = nix::unistd::Pid::from_raw(self.child.id().unwrap() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        tokio::time::timeout(TIMEOUT, self.child.wait())
            .await
            .unwrap()
            .unwrap()
    }
}

/// Starts tensile-webhook against the upper cluster and registers it there.
pub async fn start_webhook(pair: &ClusterPair) -> Child {
    let bin = super::workspace_binary("tensile-webhook");
    let certs = pair.dir.join("webhook-certs");
    let ca_bundle = tensile_harness::pki::webhook_serving_certs(&bin, &certs).unwrap();
    let port = tensile_harness::ports::free_port().unwrap();
    let p = |path: PathBuf| path.display().to_string();
    let webhook = Child::spawn(
        &bin,
        &[
            "--address".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string(),
            "--tlscert".into(),
            p(certs.join("tls.crt")),
            "--tlskey".into(),
            p(certs.join("tls.key")),
            "--kubeconfig".into(),
            p(pair.upper_kubeconfig().to_owned()),
            "--log-level".into(),
            "debug".into(),
        ],
        pair.dir.join("tensile-webhook.log"),
        port,
    );
    wait_for("tensile-webhook listening", TIMEOUT, || async {
        Ok(tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()
            .map(|_| ()))
    })
    .await
    .unwrap();
    let config = tensile_harness::fixtures::webhook_configuration(
        "tensile-webhook",
        &format!("https://127.0.0.1:{port}/mutate"),
        &ca_bundle,
        tensile_harness::fixtures::all_but_kube_system(),
    );
    let upper = pair.upper.client().await.unwrap();
    Api::<MutatingWebhookConfiguration>::all(upper)
        .create(&PostParams::default(), &config)
        .await
        .unwrap();
    webhook
}

/// The identity deploy/descheduler runs as, with exactly the RBAC it ships.
pub const SERVICE_ACCOUNT: &str = "system:serviceaccount:tensile-system:tensile-descheduler";

/// Applies deploy/descheduler/rbac.yaml upstairs; a kubeconfig for its service account.
pub async fn shipped_rbac_kubeconfig(pair: &ClusterPair) -> PathBuf {
    let upper = pair.upper.client().await.unwrap();
    let ns: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(json!({"metadata": {"name": "tensile-system"}})).unwrap();
    Api::all(upper)
        .create(&PostParams::default(), &ns)
        .await
        .unwrap();
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/descheduler/rbac.yaml");
    let output = std::process::Command::new(pair.bin("kubectl"))
        .arg("--kubeconfig")
        .arg(pair.upper_kubeconfig())
        .args(["apply", "-n", "tensile-system", "-f"])
        .arg(manifest)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    pair.upper
        .kubeconfig_for(SERVICE_ACCOUNT, &["system:serviceaccounts"])
        .unwrap()
}

/// Starts a descheduler replica `name` (leader election in tensile-system), `extra` flags last.
pub fn start_descheduler(
    pair: &ClusterPair,
    kubeconfig: &Path,
    name: &str,
    extra: &[&str],
) -> Child {
    let port = tensile_harness::ports::free_port().unwrap();
    let mut args: Vec<String> = vec![
        "--kubeconfig".into(),
        kubeconfig.display().to_string(),
        format!("--descheduling-interval={INTERVAL_SECS}s"),
        format!("--metrics-addr=127.0.0.1:{port}"),
        format!("--leader-elect-identity={name}"),
        "--leader-elect-resource-namespace=tensile-system".into(),
        "--leader-elect-retry-period=500ms".into(),
        "--log-level=tensile=debug,info".into(),
        "--v=4".into(),
    ];
    args.extend(extra.iter().map(ToString::to_string));
    Child::spawn(
        &super::workspace_binary("tensile-descheduler"),
        &args,
        pair.dir.join(format!("{name}.log")),
        port,
    )
}

/// Cordons (`true`) or uncordons node `name`.
pub async fn set_unschedulable(nodes: &Api<Node>, name: &str, cordoned: bool) {
    nodes
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"unschedulable": cordoned}})),
        )
        .await
        .unwrap();
}

/// Whether the lower scheduler refused the pod (reflected as PodScheduled=False, Unschedulable).
pub fn refused_below(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.reason.as_deref() == Some("Unschedulable")
        })
}

/// The node the pod is bound to.
pub fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref()?.node_name.as_deref()
}

/// The pod's annotation `key`.
pub fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

/// The `kubernetes.io/hostname NotIn` values of the pod's required node affinity.
pub fn not_in_hostnames(pod: &Pod) -> Vec<Vec<String>> {
    let value = serde_json::to_value(pod).unwrap();
    value["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|t| t["matchExpressions"].as_array().cloned().unwrap_or_default())
        .filter(|e| e["key"] == "kubernetes.io/hostname" && e["operator"] == "NotIn")
        .map(|e| serde_json::from_value(e["values"].clone()).unwrap())
        .collect()
}

/// Events of `api` with `reason`.
pub async fn events(api: &Api<Event>, reason: &str) -> Vec<Event> {
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .collect()
}

/// A one-container pod spec asking `cpu`: more than one 4-CPU lower node has.
pub fn big_spec(cpu: &str) -> Value {
    json!({"containers": [{"name": "app", "image": "nginx",
        "resources": {"requests": {"cpu": cpu, "memory": "1Gi"}}}]})
}

/// Watches pod `name` of `pods` until the descheduler marks it (`unschedulable-node`):
/// the evicted pod is gone by the time its replacement runs, so the mark is caught live.
pub fn watch_for_mark(pods: &Api<Pod>, name: &str) -> tokio::task::JoinHandle<Pod> {
    let fields = format!("metadata.name={name}");
    let watched = watcher(pods.clone(), watcher::Config::default().fields(&fields));
    tokio::spawn(async move {
        let mut watched = std::pin::pin!(watched.applied_objects());
        while let Some(pod) = watched.next().await {
            let pod = pod.unwrap();
            if annotation(&pod, "unschedulable-node").is_some() {
                return pod;
            }
        }
        panic!("watch ended");
    })
}
