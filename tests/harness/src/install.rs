//! tensile installed as a platform team installs it: its images (`tests/k8s/images`) on a
//! real node of the upper cluster, the chart `deploy/helm/tensile` installed with the pinned
//! helm, the lower cluster prepared with `deploy/virtual-node-lower`, and the upper
//! kube-scheduler given the extender as `deploy/scheduler-extender` ships it. Used by
//! `tests/install.rs` and `tensile-playground up --install`.
//!
//! What differs from a production cluster, and why (README, "Installing with Helm"):
//! - no kube-proxy (two clusters share one machine's network): tensile's pods reach the
//!   upper API server at the machine's address (the chart's `apiServer.host`/`port`), the
//!   API server reaches the webhook's Service at its endpoints
//!   (`--enable-aggregator-routing`), and kube-scheduler, a process on the machine, reaches
//!   the extender's Service through the API server's `services/proxy` (HTTPS, the admin
//!   certificate) where a cluster would name `tensile-scheduler-extender.<ns>.svc`;
//! - the images are imported into the real node's containerd, never pulled
//!   (`image.pullPolicy: Never`);
//! - tensile's pods run on the upper real node, which is tainted for what asks for it
//!   (`tensile.dev/real-node`), so they get its nodeSelector and toleration: the workload
//!   stays on the kwok nodes (the regular nodes) and the virtual node.
//!
//! The kube-scheduler gets the extender once the chart's pods run: the shipped
//! configuration is `ignorable: false`, under which no pod is scheduled while no extender
//! replica answers, tensile's own pods included.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::Client;
use kube::api::{Api, ListParams, PostParams};
use serde_json::{Map, Value, json};

use crate::cluster::{Cluster, node_is_ready};
use crate::pair::{ClusterPair, PairOptions, ensure_namespace};
use crate::real_node::{REAL_NODE_LABEL, RealNode};
use crate::wait::wait_for;

/// The release's name.
pub const RELEASE: &str = "tensile";
/// The release namespace (the chart's documented one).
pub const NAMESPACE: &str = "tensile-system";
/// The chart, relative to the repository.
pub const CHART: &str = "deploy/helm/tensile";
/// The virtual node the chart registers (`virtualNode.nodeName`'s default).
pub const VIRTUAL_NODE: &str = "vk-node";
/// The real node of the upper cluster that runs tensile's pods.
pub const UPPER_REAL_NODE: &str = "upper-real-0";
/// The real node of the lower cluster where burst pods run.
pub const LOWER_REAL_NODE: &str = "lower-real-0";
/// The lower identity `deploy/virtual-node-lower` binds.
pub const LOWER_USER: &str = "tensile-virtual-node";
/// The Secret with the lower kubeconfig (`virtualNode.lowerKubeconfig.secretName`).
pub const LOWER_SECRET: &str = "lower-kubeconfig";
/// The chart's Deployments, one per binary.
pub const DEPLOYMENTS: [&str; 4] = [
    "virtual-node",
    "tensile-webhook",
    "tensile-descheduler",
    "tensile-scheduler-extender",
];
/// How long the chart's pods may take to run and the virtual node to turn Ready.
pub const INSTALL_TIMEOUT: Duration = Duration::from_secs(300);

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The pair for an install: both API servers reachable from pods
/// ([`crate::ClusterOptions::in_cluster`]), one regular (kwok) node upstairs of `cpu`,
/// metrics in both clusters (`kubectl top` through the virtual node).
pub fn pair_options(cpu: &str) -> PairOptions {
    let mut options = PairOptions::default();
    options.upper.in_cluster = true;
    options.lower.in_cluster = true;
    options.upper.nodes = 1;
    options.upper.node_shape.cpu = cpu.to_owned();
    options.upper.metrics = true;
    options.lower.metrics = true;
    options
}

/// Runs the pinned helm with its state under `home` (never the user's) against `kubeconfig`,
/// in the repository; returns its stdout, or an error with its output.
pub fn helm(home: &Path, kubeconfig: &Path, args: &[&str]) -> Result<String> {
    let helm = crate::binaries::helm()?;
    let output = Command::new(&helm)
        .current_dir(repo())
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_DATA_HOME", home.join("data"))
        .env("KUBECONFIG", kubeconfig)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {}", helm.display()))?;
    if !output.status.success() {
        bail!(
            "helm {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Runs the pair's kubectl with `kubeconfig` and `args`; returns its stdout.
pub fn kubectl(pair: &ClusterPair, kubeconfig: &Path, args: &[&str]) -> Result<String> {
    let output = Command::new(pair.bin("kubectl"))
        .current_dir(repo())
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running kubectl")?;
    if !output.status.success() {
        bail!(
            "kubectl {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The chart's values for this install: the images' `tag`, never pulled; `virtual_nodes`
/// replicas of virtual-node (leader election from two); the API server's address for pods;
/// every component on the upper real node.
pub fn values(upper: &Cluster, tag: &str, virtual_nodes: u32) -> Result<Value> {
    let server = upper.server_for_pods()?;
    let address = server
        .strip_prefix("https://")
        .context("the API server's address for pods is not https://")?;
    let (host, port) = address
        .rsplit_once(':')
        .with_context(|| format!("no port in {server}"))?;
    let placement = json!({
        "nodeSelector": {REAL_NODE_LABEL: "true"},
        "tolerations": [{"key": REAL_NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
    });
    let mut values = json!({
        "image": {"tag": tag, "pullPolicy": "Never"},
        "apiServer": {"host": host, "port": port},
        "virtualNode": {"replicas": virtual_nodes, "leaderElect": virtual_nodes > 1},
        "webhook": {},
        "descheduler": {},
        "schedulerExtender": {},
    });
    for component in ["virtualNode", "webhook", "descheduler", "schedulerExtender"] {
        if let (Some(target), Some(source)) =
            (values[component].as_object_mut(), placement.as_object())
        {
            target.extend(source.clone());
        }
    }
    Ok(values)
}

/// The fields to merge into the upper kube-scheduler's configuration: the extender as
/// `deploy/scheduler-extender/kube-scheduler-config.yaml` ships it, reached through the API
/// server's proxy to its Service (see the module's documentation).
pub fn extender_scheduler_config(upper: &Cluster, namespace: &str) -> Result<Map<String, Value>> {
    let url = upper.service_proxy_url(namespace, "tensile-scheduler-extender", "http");
    let mut config = crate::scheduler_extender::shipped_scheduler_config(&url)?;
    let tls = json!({
        "certFile": upper.pki.admin.cert,
        "keyFile": upper.pki.admin.key,
        "caFile": upper.pki.ca_cert,
    });
    for extender in config
        .get_mut("extenders")
        .and_then(Value::as_array_mut)
        .context("no extenders in the shipped configuration")?
    {
        if let Some(extender) = extender.as_object_mut() {
            extender.insert("enableHTTPS".into(), Value::Bool(true));
            extender.insert("tlsConfig".into(), tls.clone());
        }
    }
    Ok(config)
}

/// What [`install`] did, and how long each part took.
pub struct Installed {
    /// The upper real node running tensile's pods.
    pub upper_node: RealNode,
    /// The lower real node for burst pods.
    pub lower_node: RealNode,
    /// helm's state directory.
    pub helm_home: PathBuf,
    /// From `helm install` to every Deployment available.
    pub install_to_running: Duration,
    /// From `helm install` to the virtual node Ready.
    pub install_to_node_ready: Duration,
}

/// Installs tensile into `pair` (made with [`pair_options`]): the real nodes (the upper one
/// with `images`, docker-archive tarballs of tag `tag`), `deploy/virtual-node-lower` and
/// the lower kubeconfig Secret, `helm install` with [`values`], then the extender in the
/// kube-scheduler's configuration; waits for every Deployment and the virtual node.
pub async fn install(
    pair: &ClusterPair,
    images: &[PathBuf],
    tag: &str,
    virtual_nodes: u32,
) -> Result<Installed> {
    let (upper_node, lower_node) = tokio::try_join!(
        pair.upper
            .start_real_node_with(UPPER_REAL_NODE, pair.reaper(), images),
        pair.start_real_node(LOWER_REAL_NODE),
    )
    .context("starting the real nodes")?;

    // Below: the lower identity's RBAC, and a kubeconfig for it that a pod can use.
    kubectl(
        pair,
        pair.lower_kubeconfig(),
        &["apply", "-k", "deploy/virtual-node-lower"],
    )?;
    let lower_kubeconfig = pair.lower.kubeconfig_for_pods(LOWER_USER, &[])?;
    let kubeconfig = std::fs::read(&lower_kubeconfig)
        .with_context(|| format!("reading {}", lower_kubeconfig.display()))?;
    let upper = pair.upper.client().await?;
    ensure_namespace(&upper, NAMESPACE).await?;
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": LOWER_SECRET, "namespace": NAMESPACE},
        "data": {"kubeconfig": k8s_openapi::ByteString(kubeconfig)},
    }))?;
    Api::<Secret>::namespaced(upper.clone(), NAMESPACE)
        .create(&PostParams::default(), &secret)
        .await
        .context("creating the lower kubeconfig Secret")?;

    let helm_home = pair.dir.join("helm");
    let values_file = pair.dir.join("install-values.json");
    std::fs::write(
        &values_file,
        serde_json::to_string_pretty(&values(&pair.upper, tag, virtual_nodes)?)?,
    )?;
    let started = Instant::now();
    helm(
        &helm_home,
        pair.upper_kubeconfig(),
        &[
            "install",
            RELEASE,
            CHART,
            "--namespace",
            NAMESPACE,
            "--values",
            path_str(&values_file)?,
        ],
    )?;
    wait_available(&upper, NAMESPACE, INSTALL_TIMEOUT)
        .await
        .map_err(|error| error.context(upper_node.logs_tail(20)))?;
    let install_to_running = started.elapsed();
    pair.upper.reconfigure_scheduler(
        extender_scheduler_config(&pair.upper, NAMESPACE)?,
        pair.reaper(),
    )?;
    wait_node_ready(&upper, VIRTUAL_NODE, INSTALL_TIMEOUT).await?;
    let install_to_node_ready = started.elapsed();
    tracing::info!(
        ?install_to_running,
        ?install_to_node_ready,
        "tensile installed by its chart"
    );
    Ok(Installed {
        upper_node,
        lower_node,
        helm_home,
        install_to_running,
        install_to_node_ready,
    })
}

fn path_str(path: &Path) -> Result<&str> {
    path.to_str()
        .with_context(|| format!("{} is not UTF-8", path.display()))
}

/// Waits until each of the chart's Deployments in `namespace` has every replica updated
/// and available, and no older pod is left.
pub async fn wait_available(client: &Client, namespace: &str, timeout: Duration) -> Result<()> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let waited = wait_for("the chart's Deployments available", timeout, || async {
        for name in DEPLOYMENTS {
            let Some(d) = deployments.get_opt(name).await? else {
                return Ok(None);
            };
            let wanted = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            let status = d.status.unwrap_or_default();
            let observed = status.observed_generation == d.metadata.generation;
            if !observed
                || status.updated_replicas.unwrap_or(0) != wanted
                || status.available_replicas.unwrap_or(0) != wanted
                || status.replicas.unwrap_or(0) != wanted
            {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .await;
    if let Err(error) = waited {
        let listed = pods.list(&ListParams::default()).await?;
        let states: Vec<String> = listed
            .items
            .iter()
            .map(|p| {
                format!(
                    "{}: {}",
                    p.metadata.name.as_deref().unwrap_or("?"),
                    serde_json::to_string(&p.status).unwrap_or_default()
                )
            })
            .collect();
        return Err(error.context(states.join("\n")));
    }
    Ok(())
}

/// Waits until Node `name` exists and is Ready.
pub async fn wait_node_ready(client: &Client, name: &str, timeout: Duration) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    wait_for(&format!("node {name} Ready"), timeout, || async {
        Ok(nodes.get_opt(name).await?.filter(node_is_ready).map(|_| ()))
    })
    .await
}
