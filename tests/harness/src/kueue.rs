//! Kueue (`sigs.k8s.io/kueue`, the release pinned in `tests/k8s/kueue/go.mod`) beside a
//! harness cluster, for batch bursting: its manager (built by `tests/k8s/kueue/build.sh`)
//! runs as a host process against the cluster's API server with the admin identity, and
//! the release's CRDs and webhooks are installed in that cluster, wired by URL.
//!
//! How it differs from a Kueue installed by its manifests, and why:
//! - No internal certificate management: the harness issues the webhook server's
//!   certificate (for 127.0.0.1) from the cluster's CA, and the webhook configurations
//!   (the release's `config/components/webhook/manifests.yaml` with the namespace selectors
//!   of its kustomization, named as the release names them, `kueue-` first) and the CRDs'
//!   conversion webhooks (the patches its CRD kustomization applies) call
//!   `https://127.0.0.1:<port><path>` with that CA, instead of a Service.
//! - v0.17.0 reads its metrics certificate from a fixed directory (a Secret mounted in its
//!   pod, `/etc/kueue/metrics/certs`); the build changes that one line so that
//!   `TENSILE_KUEUE_METRICS_CERT_DIR` names it (see the build script), and the harness
//!   gives it the webhook's certificate there.
//! - The visibility server (an aggregated API, `VisibilityOnDemand`) is off: it would need
//!   its own certificate at a fixed `/visibility` and an APIService.
//! - One replica, no leader election; the frameworks are [`FRAMEWORKS`], and only jobs
//!   labelled with a queue ([`QUEUE_NAME_LABEL`]) are Kueue's.
//!
//! Like its manifests (and Helm chart), the manager's client is limited to 50 requests a
//! second, bursts of 100 ([`KueueOptions`]); without a `clientConnection` the binary
//! would take 20 and 30, which holds up admitted Jobs for tens of seconds when a couple
//! of hundred arrive at once (`tensile-bench --kueue`).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use serde_json::{Value, json};

use crate::cluster::{Cluster, client_for};
use crate::pair::{ClusterPair, ensure_namespace};
use crate::ports::free_port;
use crate::process::Process;
use crate::wait::wait_for;

/// Kueue's API group.
pub const GROUP: &str = "kueue.x-k8s.io";
/// The version of Kueue's API the harness speaks (v0.17.0 stores v1beta2 and still serves
/// v1beta1, converting by its webhook).
pub const VERSION: &str = "v1beta2";
/// `apiVersion` of Kueue's objects.
pub const API_VERSION: &str = "kueue.x-k8s.io/v1beta2";
/// The label that puts a job into a LocalQueue.
pub const QUEUE_NAME_LABEL: &str = "kueue.x-k8s.io/queue-name";
/// Kueue's own namespace (its Configuration's `namespace`).
pub const NAMESPACE: &str = "kueue-system";
/// The integrations the manager runs.
pub const FRAMEWORKS: [&str; 2] = ["batch/job", "pod"];
/// How long the manager may take to serve (its caches sync, its webhook server starts).
const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long Kueue may take to make a LocalQueue Active once applied.
const QUEUE_TIMEOUT: Duration = Duration::from_secs(120);

/// The directory `tests/k8s/kueue/build.sh` printed (`bin/kueue`, `crds.yaml`,
/// `webhooks.yaml`, `webhook-kustomization.yaml`, `conversion.yaml`).
#[derive(Clone, Debug)]
pub struct KueueBinaries {
    dir: PathBuf,
}

static LOCATED: OnceLock<PathBuf> = OnceLock::new();

impl KueueBinaries {
    /// Finds them (`TENSILE_KUEUE_DIR`), else builds them (once; later calls reuse it).
    pub fn locate() -> Result<Self> {
        if let Some(dir) = LOCATED.get() {
            return Ok(Self { dir: dir.clone() });
        }
        let dir = match std::env::var_os("TENSILE_KUEUE_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => crate::binaries::run_build_script(&build_script())?,
        };
        if !dir.join(".complete").exists() {
            bail!(
                "{} is not a directory built by tests/k8s/kueue/build.sh",
                dir.display()
            );
        }
        Ok(Self {
            dir: LOCATED.get_or_init(|| dir).clone(),
        })
    }

    /// The manager.
    pub fn manager(&self) -> PathBuf {
        self.dir.join("bin").join("kueue")
    }

    /// The release's CRDs, one YAML stream.
    pub fn crds(&self) -> PathBuf {
        self.dir.join("crds.yaml")
    }

    /// The release's webhook configurations (clients by Service).
    pub fn webhooks(&self) -> PathBuf {
        self.dir.join("webhooks.yaml")
    }

    /// The kustomization of the webhooks (its patches: namespace selectors).
    pub fn webhook_kustomization(&self) -> PathBuf {
        self.dir.join("webhook-kustomization.yaml")
    }

    /// The CRD patches that turn on conversion webhooks.
    pub fn conversion(&self) -> PathBuf {
        self.dir.join("conversion.yaml")
    }
}

/// The build script of Kueue.
pub fn build_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../k8s/kueue/build.sh")
}

/// The API of Kueue's `kind` (v1beta2), cluster-wide (ResourceFlavor, ClusterQueue) or in
/// `namespace` (LocalQueue, Workload).
pub fn api(client: &Client, kind: &str, namespace: Option<&str>) -> Api<DynamicObject> {
    let lower = kind.to_ascii_lowercase();
    // English plurals as the CRDs spell them: workloadpriorityclass -> ...classes.
    let plural = if lower.ends_with('s') || lower.ends_with('x') || lower.ends_with("ch") {
        format!("{lower}es")
    } else {
        format!("{lower}s")
    };
    let resource =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, kind), &plural);
    match namespace {
        Some(namespace) => Api::namespaced_with(client.clone(), namespace, &resource),
        None => Api::all_with(client.clone(), &resource),
    }
}

/// `deploy/examples/kueue`, as its kustomization lists it (the sample Job apart): file name
/// and contents.
pub const EXAMPLES: [(&str, &str); 4] = [
    (
        "flavors.yaml",
        include_str!("../../../deploy/examples/kueue/flavors.yaml"),
    ),
    (
        "cluster-queue.yaml",
        include_str!("../../../deploy/examples/kueue/cluster-queue.yaml"),
    ),
    (
        "local-queue.yaml",
        include_str!("../../../deploy/examples/kueue/local-queue.yaml"),
    ),
    (
        "priority-classes.yaml",
        include_str!("../../../deploy/examples/kueue/priority-classes.yaml"),
    ),
];
/// The ClusterQueue of [`EXAMPLES`].
pub const CLUSTER_QUEUE: &str = "cluster-queue";
/// Its first flavor: the regular nodes.
pub const LOCAL_FLAVOR: &str = "local";
/// Its second flavor: the virtual nodes.
pub const BURST_FLAVOR: &str = "burst";
/// The LocalQueue of [`EXAMPLES`] (in `default`).
pub const LOCAL_QUEUE: &str = "user-queue";
/// The resources the ClusterQueue covers.
pub const QUEUED_RESOURCES: [&str; 3] = ["cpu", "memory", "pods"];

/// Each flavor's quota: resource → quantity.
pub type Quotas = Vec<(&'static str, Vec<(String, String)>)>;

/// What each flavor's nodes offer: [`LOCAL_FLAVOR`] the regular nodes' allocatable,
/// [`BURST_FLAVOR`] the virtual nodes' (labelled `type: virtual-kubelet`), summed per
/// resource.
pub fn flavor_quotas(nodes: &[Node]) -> Result<Quotas> {
    let is_virtual = |node: &Node| {
        node.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("type"))
            .is_some_and(|t| t == "virtual-kubelet")
    };
    let mut quotas = Vec::new();
    for (flavor, virtual_nodes) in [(LOCAL_FLAVOR, false), (BURST_FLAVOR, true)] {
        let mut resources = Vec::new();
        for resource in QUEUED_RESOURCES {
            let mut milli: u128 = 0;
            for node in nodes.iter().filter(|n| is_virtual(n) == virtual_nodes) {
                let name = node.metadata.name.as_deref().unwrap_or_default();
                let quantity = node
                    .status
                    .as_ref()
                    .and_then(|s| s.allocatable.as_ref())
                    .and_then(|a| a.get(resource));
                if let Some(quantity) = quantity {
                    milli += parse_milli(&quantity.0).with_context(|| {
                        format!("node {name}: allocatable {resource} {:?}", quantity.0)
                    })?;
                }
            }
            resources.push((resource.to_owned(), format_milli(resource, milli)));
        }
        quotas.push((flavor, resources));
    }
    Ok(quotas)
}

/// Sets each flavor's `nominalQuota`s in the ClusterQueue `object` to `quotas`.
pub fn set_quotas(object: &mut Value, quotas: &Quotas) -> Result<()> {
    for (flavor, resources) in quotas {
        let entry = object["spec"]["resourceGroups"]
            .as_array_mut()
            .into_iter()
            .flatten()
            .flat_map(|g| g["flavors"].as_array_mut().into_iter().flatten())
            .find(|f| f["name"] == *flavor)
            .with_context(|| format!("the ClusterQueue has no flavor {flavor}"))?;
        for (resource, quota) in resources {
            let slot = entry["resources"]
                .as_array_mut()
                .into_iter()
                .flatten()
                .find(|r| r["name"] == resource.as_str())
                .with_context(|| format!("flavor {flavor} has no {resource} quota"))?;
            slot["nominalQuota"] = Value::String(quota.clone());
        }
    }
    Ok(())
}

/// The objects of [`EXAMPLES`], in order, the ClusterQueue's quotas set to `quotas`.
pub fn example_objects(quotas: &Quotas) -> Result<Vec<Value>> {
    let mut objects = Vec::new();
    for (file, yaml) in EXAMPLES {
        for mut object in documents(yaml, &format!("deploy/examples/kueue/{file}"))? {
            if object["kind"] == "ClusterQueue" {
                set_quotas(&mut object, quotas)
                    .with_context(|| format!("deploy/examples/kueue/{file}"))?;
            }
            objects.push(object);
        }
    }
    Ok(objects)
}

/// Applies Kueue's `object` (server-side, as `manager`) in the cluster of `client`.
pub async fn apply(client: &Client, object: &Value, manager: &str) -> Result<()> {
    let kind = object["kind"].as_str().unwrap_or_default();
    let name = object["metadata"]["name"]
        .as_str()
        .context("a Kueue object without a name")?;
    let namespace = object["metadata"]["namespace"].as_str();
    api(client, kind, namespace)
        .patch(
            name,
            &PatchParams::apply(manager).force(),
            &Patch::Apply(object),
        )
        .await
        .with_context(|| format!("applying the {kind} {name}"))?;
    Ok(())
}

/// Applies [`EXAMPLES`] with the ClusterQueue's quotas `quotas` (typically
/// [`flavor_quotas`] of the cluster's nodes; a virtual node's `--kueue-quota` keeps its
/// flavor's afterwards) in the cluster of `client`; returns when the LocalQueue is Active.
pub async fn apply_examples(client: &Client, quotas: &Quotas) -> Result<()> {
    for object in example_objects(quotas)? {
        apply(client, &object, "tensile-harness").await?;
    }
    wait_for_local_queue(client, "default", LOCAL_QUEUE).await
}

/// Waits until the LocalQueue `namespace/name` is Active (its ClusterQueue and flavors
/// exist and Kueue took them in).
pub async fn wait_for_local_queue(client: &Client, namespace: &str, name: &str) -> Result<()> {
    let queues = api(client, "LocalQueue", Some(namespace));
    wait_for(
        &format!("LocalQueue {namespace}/{name} Active"),
        QUEUE_TIMEOUT,
        || async {
            let queue = serde_json::to_value(queues.get(name).await?)?;
            let active = queue["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Active" && c["status"] == "True");
            Ok(active.then_some(()))
        },
    )
    .await
}

/// A non-negative quantity (`8`, `7500m`, `32Gi`, `1.5k`) in milli-units; `None` if it is
/// not one.
pub fn parse_milli(text: &str) -> Option<u128> {
    let end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(end);
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    let mantissa: u128 = format!("{int}{frac}").parse().ok()?;
    let scale = 10u128.checked_pow(u32::try_from(frac.len()).ok()?)?;
    // The suffix's value in milli-units, as a fraction.
    let (num, den): (u128, u128) = match suffix {
        "" => (1000, 1),
        "n" => (1, 1_000_000),
        "u" => (1, 1000),
        "m" => (1, 1),
        "k" => (1000 * 1000, 1),
        "M" => (1000 * 1_000_000, 1),
        "G" => (1000 * 1_000_000_000, 1),
        "T" => (1000 * 1_000_000_000_000, 1),
        "P" => (1000 * 1_000_000_000_000_000, 1),
        "E" => (1000 * 1_000_000_000_000_000_000, 1),
        "Ki" => (1000 << 10, 1),
        "Mi" => (1000 << 20, 1),
        "Gi" => (1000 << 30, 1),
        "Ti" => (1000 << 40, 1),
        "Pi" => (1000 << 50, 1),
        "Ei" => (1000 << 60, 1),
        _ => return None,
    };
    Some(mantissa.checked_mul(num)?.div_ceil(scale.checked_mul(den)?))
}

/// `milli` milli-units of `resource` as a quantity: whole units where it is whole (pods
/// always), else milli (`7500m`); memory in `Mi` or `Gi` where exact.
fn format_milli(resource: &str, milli: u128) -> String {
    let units = milli / 1000;
    if resource == "pods" || milli.is_multiple_of(1000) {
        if resource == "memory" {
            for (suffix, bytes) in [("Gi", 1u128 << 30), ("Mi", 1 << 20)] {
                if units > 0 && units.is_multiple_of(bytes) {
                    return format!("{}{suffix}", units / bytes);
                }
            }
        }
        return units.to_string();
    }
    format!("{milli}m")
}

/// How the harness runs Kueue's manager.
#[derive(Clone, Debug)]
pub struct KueueOptions {
    /// Its client's requests a second to the API server (`clientConnection.qps`).
    pub client_qps: f32,
    /// Its client's burst (`clientConnection.burst`).
    pub client_burst: u32,
}

impl Default for KueueOptions {
    /// The release's manifests' (`config/components/manager/controller_manager_config.yaml`).
    fn default() -> Self {
        Self {
            client_qps: 50.0,
            client_burst: 100,
        }
    }
}

/// A running Kueue manager and its installation in one cluster. Dropping it kills the
/// manager (the webhooks stay registered: see [`Kueue::stop`]).
pub struct Kueue {
    process: Process,
    kubeconfig: PathBuf,
    cluster: String,
    /// Its state: configuration and certificates (`<cluster dir>/kueue`).
    pub dir: PathBuf,
    /// The webhook server's port (HTTPS, the cluster CA's certificate for 127.0.0.1).
    pub webhook_port: u16,
    /// Health probes: `http://127.0.0.1:<port>/readyz`, `/healthz`.
    pub health_port: u16,
    /// Metrics: `https://127.0.0.1:<port>/metrics` (authenticated and authorized by the
    /// cluster).
    pub metrics_port: u16,
}

impl Kueue {
    /// Installs Kueue in `cluster` (one of `pair`'s: its namespace, CRDs and, once the
    /// manager serves, its webhooks) and starts the manager; returns when the manager is
    /// ready and the API server reaches its webhooks. Its log is
    /// `<cluster dir>/kueue.log`; it dies with the pair's processes.
    pub async fn start(pair: &ClusterPair, cluster: &Cluster) -> Result<Self> {
        Self::start_with(pair, cluster, &KueueOptions::default()).await
    }

    /// [`Kueue::start`] with `options`.
    pub async fn start_with(
        pair: &ClusterPair,
        cluster: &Cluster,
        options: &KueueOptions,
    ) -> Result<Self> {
        let started = Instant::now();
        let bins = tokio::task::spawn_blocking(KueueBinaries::locate).await??;
        let client = cluster.client().await?;
        let dir = cluster.dir.join("kueue");
        let (webhook_port, health_port, metrics_port) = (free_port()?, free_port()?, free_port()?);
        let base_url = format!("https://127.0.0.1:{webhook_port}");
        let ca_bundle = ca_bundle(&cluster.pki.ca_cert)?;

        let serving = cluster
            .pki
            .issue_serving("kueue-webhook", &["127.0.0.1", "localhost"])?;
        let webhook_certs = dir.join("webhook-certs");
        let metrics_certs = dir.join("metrics-certs");
        for certs in [&webhook_certs, &metrics_certs] {
            std::fs::create_dir_all(certs)
                .with_context(|| format!("creating {}", certs.display()))?;
            // controller-runtime's names.
            for (from, to) in [(&serving.cert, "tls.crt"), (&serving.key, "tls.key")] {
                std::fs::copy(from, certs.join(to)).with_context(|| {
                    format!("copying {} to {}", from.display(), certs.display())
                })?;
            }
        }

        ensure_namespace(&client, NAMESPACE).await?;
        install_crds(&client, &bins, &base_url, &ca_bundle)
            .await
            .with_context(|| format!("installing Kueue's CRDs in the {} cluster", cluster.name))?;

        let config = configuration(
            webhook_port,
            health_port,
            metrics_port,
            &webhook_certs,
            options,
        );
        let config_path = dir.join("config.yaml");
        std::fs::write(&config_path, serde_json::to_string_pretty(&config)?)
            .with_context(|| format!("writing {}", config_path.display()))?;
        let args = vec![
            format!("--config={}", config_path.display()),
            format!("--kubeconfig={}", cluster.kubeconfig.display()),
        ];
        let envs = [(
            "TENSILE_KUEUE_METRICS_CERT_DIR".to_owned(),
            metrics_certs.display().to_string(),
        )];
        let log = cluster.dir.join("kueue.log");
        let mut process = Process::spawn(
            &format!("{}-kueue", cluster.name),
            &bins.manager(),
            &args,
            &envs,
            &log,
            pair.reaper(),
        )?;

        // A manager that exited fails the wait at once instead of at the deadline.
        let ready = wait_for("Kueue's /readyz", READY_TIMEOUT, || {
            let running = process.check_running();
            async move {
                if let Err(exited) = running {
                    return Ok(Some(Err(exited)));
                }
                let (status, _) = crate::http::request(health_port, "GET", "/readyz", "").await?;
                Ok((status == 200).then_some(Ok(())))
            }
        })
        .await;
        ready
            .and_then(|ready| ready)
            .with_context(|| format!("starting Kueue in the {} cluster", cluster.name))?;

        let (mutating, validating) = webhook_configurations(
            &read(&bins.webhooks())?,
            &read(&bins.webhook_kustomization())?,
            &base_url,
            &ca_bundle,
        )?;
        let apply = PatchParams::apply("tensile-harness").force();
        let api: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
        for config in &mutating {
            let name = config.metadata.name.clone().unwrap_or_default();
            api.patch(&name, &apply, &Patch::Apply(config))
                .await
                .with_context(|| format!("applying the webhook configuration {name}"))?;
        }
        let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
        for config in &validating {
            let name = config.metadata.name.clone().unwrap_or_default();
            api.patch(&name, &apply, &Patch::Apply(config))
                .await
                .with_context(|| format!("applying the webhook configuration {name}"))?;
        }
        wait_for_job_webhook(&client)
            .await
            .with_context(|| format!("Kueue's webhooks (log {})", log.display()))?;
        tracing::info!(
            cluster = %cluster.name,
            webhook_port,
            elapsed = ?started.elapsed(),
            "Kueue ready"
        );
        Ok(Self {
            process,
            kubeconfig: cluster.kubeconfig.clone(),
            cluster: cluster.name.clone(),
            dir,
            webhook_port,
            health_port,
            metrics_port,
        })
    }

    /// The manager's log.
    pub fn log(&self) -> &Path {
        self.process.log()
    }

    /// The manager's process id (its CPU time, `/proc/<pid>/stat`).
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Fails (with the end of its log) unless the manager still runs.
    pub fn check_running(&mut self) -> Result<()> {
        self.process.check_running()
    }

    /// Removes Kueue's webhook configurations (they fail closed: without the manager, the
    /// cluster would refuse the pods and jobs they cover), then stops the manager.
    pub async fn stop(mut self) -> Result<()> {
        let client = client_for(&self.kubeconfig).await?;
        let delete = DeleteParams::default();
        for name in webhook_configuration_names() {
            let mutating: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
            let validating: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
            for result in [
                mutating.delete(&name, &delete).await.map(|_| ()),
                validating.delete(&name, &delete).await.map(|_| ()),
            ] {
                match result {
                    Ok(()) => {}
                    Err(kube::Error::Api(status)) if status.code == 404 => {}
                    Err(error) => {
                        return Err(error).with_context(|| {
                            format!(
                                "{}: deleting the webhook configuration {name}",
                                self.cluster
                            )
                        });
                    }
                }
            }
        }
        self.process.stop(Duration::from_secs(5))
    }
}

/// The names [`webhook_configurations`] gives: the release's, `kueue-` first.
fn webhook_configuration_names() -> [String; 2] {
    [
        "kueue-mutating-webhook-configuration".into(),
        "kueue-validating-webhook-configuration".into(),
    ]
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

fn documents(yaml: &str, what: &str) -> Result<Vec<Value>> {
    Ok(serde_saphyr::from_multiple::<Value>(yaml)
        .with_context(|| format!("parsing {what}"))?
        .into_iter()
        .filter(|d| !d.is_null())
        .collect())
}

/// A PEM file as a `caBundle` (base64).
fn ca_bundle(ca: &Path) -> Result<Value> {
    let bytes = std::fs::read(ca).with_context(|| format!("reading {}", ca.display()))?;
    Ok(serde_json::to_value(ByteString(bytes))?)
}

/// Kueue's Configuration: webhooks, metrics and health on loopback ports, the webhook's
/// certificate (and the metrics', by the same name) from `cert_dir`, one replica, the
/// client's rates of `options`.
fn configuration(
    webhook_port: u16,
    health_port: u16,
    metrics_port: u16,
    cert_dir: &Path,
    options: &KueueOptions,
) -> Value {
    json!({
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "manageJobsWithoutQueueName": false,
        "managedJobsNamespaceSelector": {"matchExpressions": [{
            "key": "kubernetes.io/metadata.name",
            "operator": "NotIn",
            "values": ["kube-system", NAMESPACE],
        }]},
        "internalCertManagement": {"enable": false},
        "webhook": {
            "host": "127.0.0.1",
            "port": webhook_port,
            "certDir": cert_dir.display().to_string(),
        },
        "metrics": {"bindAddress": format!("127.0.0.1:{metrics_port}")},
        "health": {"healthProbeBindAddress": format!("127.0.0.1:{health_port}")},
        "leaderElection": {"leaderElect": false},
        "clientConnection": {"qps": options.client_qps, "burst": options.client_burst},
        "integrations": {"frameworks": FRAMEWORKS},
        "featureGates": {"VisibilityOnDemand": false},
    })
}

/// Points a `clientConfig` with a `service` at `base_url` + its path, trusting `ca_bundle`.
fn by_url(client_config: &mut Value, base_url: &str, ca_bundle: &Value) -> Result<()> {
    let path = client_config["service"]["path"]
        .as_str()
        .context("a webhook's clientConfig without service.path")?
        .to_owned();
    *client_config = json!({"url": format!("{base_url}{path}"), "caBundle": ca_bundle});
    Ok(())
}

/// The release's webhook configurations (`webhooks`, their `clientConfig` by Service), with
/// the patches of its kustomization (`kustomization`: namespace selectors, merged into the
/// webhooks they name), called at `base_url` with `ca_bundle`, named `kueue-<name>` as the
/// release's default kustomization names them.
fn webhook_configurations(
    webhooks: &str,
    kustomization: &str,
    base_url: &str,
    ca_bundle: &Value,
) -> Result<(
    Vec<MutatingWebhookConfiguration>,
    Vec<ValidatingWebhookConfiguration>,
)> {
    let mut patches = Vec::new();
    for kustomization in documents(kustomization, "the webhooks' kustomization")? {
        for patch in kustomization["patches"].as_array().into_iter().flatten() {
            if let Some(patch) = patch["patch"].as_str() {
                patches.extend(documents(patch, "a patch of the webhooks' kustomization")?);
            }
        }
    }
    let (mut mutating, mut validating) = (Vec::new(), Vec::new());
    for mut config in documents(webhooks, "the webhook manifests")? {
        let kind = config["kind"].as_str().unwrap_or_default().to_owned();
        let name = config["metadata"]["name"]
            .as_str()
            .context("a webhook configuration without a name")?
            .to_owned();
        for patch in patches
            .iter()
            .filter(|p| p["kind"] == kind.as_str() && p["metadata"]["name"] == name.as_str())
        {
            for patched in patch["webhooks"].as_array().into_iter().flatten() {
                let webhook = config["webhooks"]
                    .as_array_mut()
                    .into_iter()
                    .flatten()
                    .find(|w| w["name"] == patched["name"])
                    .with_context(|| format!("{name} has no webhook {}", patched["name"]))?;
                if let (Some(webhook), Some(patched)) =
                    (webhook.as_object_mut(), patched.as_object())
                {
                    webhook.extend(patched.clone());
                }
            }
        }
        for webhook in config["webhooks"].as_array_mut().into_iter().flatten() {
            by_url(&mut webhook["clientConfig"], base_url, ca_bundle)
                .with_context(|| format!("{name}: webhook {}", webhook["name"]))?;
        }
        config["metadata"] = json!({"name": format!("kueue-{name}")});
        match kind.as_str() {
            "MutatingWebhookConfiguration" => mutating.push(serde_json::from_value(config)?),
            "ValidatingWebhookConfiguration" => validating.push(serde_json::from_value(config)?),
            other => bail!("{name}: unexpected kind {other:?} in the webhook manifests"),
        }
    }
    Ok((mutating, validating))
}

/// Applies the release's CRDs, their conversion webhooks called at `base_url` with
/// `ca_bundle`, and waits until every one is Established.
async fn install_crds(
    client: &Client,
    bins: &KueueBinaries,
    base_url: &str,
    ca_bundle: &Value,
) -> Result<()> {
    let crds = documents(&read(&bins.crds())?, "Kueue's CRDs")?;
    let conversions = documents(&read(&bins.conversion())?, "Kueue's conversion patches")?;
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let apply = PatchParams::apply("tensile-harness").force();
    let mut names = Vec::new();
    for mut crd in crds {
        let name = crd["metadata"]["name"]
            .as_str()
            .context("a CRD without a name")?
            .to_owned();
        if let Some(patch) = conversions
            .iter()
            .find(|p| p["metadata"]["name"] == name.as_str())
        {
            let mut conversion = patch["spec"]["conversion"].clone();
            by_url(
                &mut conversion["webhook"]["clientConfig"],
                base_url,
                ca_bundle,
            )
            .with_context(|| format!("the conversion webhook of {name}"))?;
            crd["spec"]["conversion"] = conversion;
        }
        api.patch(&name, &apply, &Patch::Apply(&crd))
            .await
            .with_context(|| format!("applying the CRD {name}"))?;
        names.push(name);
    }
    for name in names {
        wait_for(
            &format!("CRD {name} Established"),
            Duration::from_secs(30),
            || async {
                let established = api.get(&name).await?.status.is_some_and(|s| {
                    s.conditions
                        .unwrap_or_default()
                        .iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                });
                Ok(established.then_some(()))
            },
        )
        .await?;
    }
    Ok(())
}

/// Installs the release's CRDs in the cluster of `client` without the manager, for tests of
/// what other controllers read and write in Kueue's objects (virtual-node's
/// `--kueue-quota`): without their conversion webhooks (no manager answers them), so only
/// v1beta2, the storage version, is for use; no webhook checks the objects. Returns once
/// every CRD is Established.
pub async fn install_crds_only(client: &Client) -> Result<()> {
    let bins = tokio::task::spawn_blocking(KueueBinaries::locate).await??;
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let apply = PatchParams::apply("tensile-harness").force();
    let mut names = Vec::new();
    for crd in documents(&read(&bins.crds())?, "Kueue's CRDs")? {
        let name = crd["metadata"]["name"]
            .as_str()
            .context("a CRD without a name")?
            .to_owned();
        api.patch(&name, &apply, &Patch::Apply(&crd))
            .await
            .with_context(|| format!("applying the CRD {name}"))?;
        names.push(name);
    }
    wait_for(
        "Kueue's CRDs Established",
        Duration::from_secs(30),
        || async {
            for name in &names {
                let established = api.get(name).await?.status.is_some_and(|s| {
                    s.conditions
                        .unwrap_or_default()
                        .iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                });
                if !established {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        },
    )
    .await
}

/// Waits until the API server calls Kueue's Job webhook: a Job with a queue, created in
/// dry run in `default`, comes back suspended (which only Kueue's defaulting does).
async fn wait_for_job_webhook(client: &Client) -> Result<()> {
    let jobs: Api<Job> = Api::namespaced(client.clone(), "default");
    let probe: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": "kueue-webhook-probe",
            "labels": {QUEUE_NAME_LABEL: "kueue-webhook-probe"},
        },
        "spec": {"template": {"spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "probe", "image": "probe"}],
        }}},
    }))?;
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    wait_for(
        "the API server to call Kueue's webhooks (a dry-run Job with a queue suspended)",
        READY_TIMEOUT,
        || async {
            let job = jobs.create(&dry_run, &probe).await?;
            Ok(job
                .spec
                .and_then(|s| s.suspend)
                .unwrap_or_default()
                .then_some(()))
        },
    )
    .await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use super::*;

    const WEBHOOKS: &str = r#"---
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata:
  name: mutating-webhook-configuration
webhooks:
- admissionReviewVersions: [v1]
  clientConfig:
    service: {name: webhook-service, namespace: system, path: /mutate--v1-pod}
  failurePolicy: Fail
  name: mpod.kb.io
  rules: [{apiGroups: [""], apiVersions: [v1], operations: [CREATE], resources: [pods]}]
  sideEffects: None
- admissionReviewVersions: [v1]
  clientConfig:
    service: {name: webhook-service, namespace: system, path: /mutate-batch-v1-job}
  failurePolicy: Fail
  name: mjob.kb.io
  rules: [{apiGroups: [batch], apiVersions: [v1], operations: [CREATE], resources: [jobs]}]
  sideEffects: None
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: validating-webhook-configuration
webhooks:
- admissionReviewVersions: [v1]
  clientConfig:
    service: {name: webhook-service, namespace: system, path: /validate--v1-pod}
  failurePolicy: Fail
  name: vpod.kb.io
  rules: [{apiGroups: [""], apiVersions: [v1], operations: [CREATE], resources: [pods]}]
  sideEffects: None
"#;

    const KUSTOMIZATION: &str = r#"resources:
- manifests.yaml
patches:
- patch: |-
    apiVersion: admissionregistration.k8s.io/v1
    kind: MutatingWebhookConfiguration
    metadata:
      name: mutating-webhook-configuration
    webhooks:
    - name: mpod.kb.io
      namespaceSelector:
        matchExpressions:
        - {key: kubernetes.io/metadata.name, operator: NotIn, values: [kube-system]}
"#;

    /// Every webhook by URL with the CA, its configuration named as the release names it,
    /// and the kustomization's selector on the webhook it names only.
    #[test]
    fn webhooks_by_url_with_the_kustomization_patches() {
        let ca = json!("Q0E=");
        let (mutating, validating) =
            webhook_configurations(WEBHOOKS, KUSTOMIZATION, "https://127.0.0.1:9443", &ca).unwrap();
        let mutating = serde_json::to_value(&mutating).unwrap();
        let validating = serde_json::to_value(&validating).unwrap();
        let selector = json!({"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]},
        ]});
        let cases = [
            (
                &mutating[0],
                0,
                "kueue-mutating-webhook-configuration",
                "mpod.kb.io",
                "https://127.0.0.1:9443/mutate--v1-pod",
                selector.clone(),
            ),
            (
                &mutating[0],
                1,
                "kueue-mutating-webhook-configuration",
                "mjob.kb.io",
                "https://127.0.0.1:9443/mutate-batch-v1-job",
                Value::Null,
            ),
            (
                &validating[0],
                0,
                "kueue-validating-webhook-configuration",
                "vpod.kb.io",
                "https://127.0.0.1:9443/validate--v1-pod",
                Value::Null,
            ),
        ];
        for (config, index, config_name, name, url, namespace_selector) in cases {
            assert_eq!(config["metadata"]["name"], config_name);
            let webhook = &config["webhooks"][index];
            assert_eq!(webhook["name"], name);
            assert_eq!(
                webhook["clientConfig"],
                json!({"url": url, "caBundle": "Q0E="}),
                "{name}"
            );
            assert_eq!(webhook["namespaceSelector"], namespace_selector, "{name}");
            assert_eq!(webhook["failurePolicy"], "Fail", "{name}");
        }
        assert_eq!(mutating.as_array().unwrap().len(), 1);
        assert_eq!(validating.as_array().unwrap().len(), 1);
        assert_eq!(
            webhook_configuration_names(),
            [
                mutating[0]["metadata"]["name"].as_str().unwrap().to_owned(),
                validating[0]["metadata"]["name"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
            ]
        );
    }

    /// The quotas come from the nodes: regular ones summed for `local`, virtual ones for
    /// `burst`, and land in the ClusterQueue of `deploy/examples/kueue`, which its
    /// kustomization applies with the other files [`apply_examples`] applies.
    #[test]
    fn example_quotas_are_the_nodes_allocatable() {
        let node = |name: &str, virtual_node: bool, cpu: &str, memory: &str| -> Node {
            let labels = if virtual_node {
                json!({"type": "virtual-kubelet"})
            } else {
                json!({"type": "kwok"})
            };
            serde_json::from_value(json!({
                "metadata": {"name": name, "labels": labels},
                "status": {"allocatable": {"cpu": cpu, "memory": memory, "pods": "110"}},
            }))
            .unwrap()
        };
        let nodes = [
            node("upper-node-0", false, "8", "32Gi"),
            node("upper-node-1", false, "7500m", "1Gi"),
            node("vk-node", true, "23900m", "100663296Ki"),
        ];
        let quotas = flavor_quotas(&nodes).unwrap();
        let want = |pairs: [(&str, &str); 3]| {
            pairs
                .iter()
                .map(|(r, q)| ((*r).to_owned(), (*q).to_owned()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            quotas,
            vec![
                (
                    LOCAL_FLAVOR,
                    want([("cpu", "15500m"), ("memory", "33Gi"), ("pods", "220")])
                ),
                (
                    BURST_FLAVOR,
                    want([("cpu", "23900m"), ("memory", "96Gi"), ("pods", "110")])
                ),
            ]
        );
        let objects = example_objects(&quotas).unwrap();
        let queue = objects
            .iter()
            .find(|o| o["kind"] == "ClusterQueue")
            .unwrap();
        let flavors = &queue["spec"]["resourceGroups"][0]["flavors"];
        assert_eq!(flavors[0]["name"], LOCAL_FLAVOR);
        assert_eq!(flavors[0]["resources"][0]["nominalQuota"], "15500m");
        assert_eq!(flavors[1]["name"], BURST_FLAVOR);
        assert_eq!(flavors[1]["resources"][1]["nominalQuota"], "96Gi");
        assert_eq!(queue["metadata"]["name"], CLUSTER_QUEUE);
        let local_queue = objects.iter().find(|o| o["kind"] == "LocalQueue").unwrap();
        assert_eq!(local_queue["metadata"]["name"], LOCAL_QUEUE);
        assert_eq!(local_queue["metadata"]["namespace"], "default");

        let kustomization: Value = serde_saphyr::from_str(include_str!(
            "../../../deploy/examples/kueue/kustomization.yaml"
        ))
        .unwrap();
        let files: Vec<&str> = EXAMPLES.iter().map(|(f, _)| *f).collect();
        assert_eq!(kustomization["resources"], json!(files));
    }

    #[test]
    fn quantities_in_milli_units() {
        for (text, milli) in [
            ("8", Some(8000)),
            ("7500m", Some(7500)),
            ("1.5", Some(1500)),
            ("32Gi", Some(32_000 << 30)),
            ("1k", Some(1_000_000)),
            ("100n", Some(1)),
            ("", None),
            ("1e3", None),
            ("x", None),
        ] {
            assert_eq!(parse_milli(text), milli, "{text:?}");
        }
        assert_eq!(format_milli("memory", 1000 << 20), "1Mi");
        assert_eq!(format_milli("memory", 1500), "1500m");
        assert_eq!(format_milli("cpu", 24_000), "24");
    }

    /// A patch naming a webhook the manifests lack is an error, not silently dropped.
    #[test]
    fn a_patch_for_a_missing_webhook_is_an_error() {
        let kustomization = KUSTOMIZATION.replace("mpod.kb.io", "mgone.kb.io");
        let error =
            webhook_configurations(WEBHOOKS, &kustomization, "https://x", &json!("")).unwrap_err();
        assert!(format!("{error:#}").contains("mgone.kb.io"), "{error:#}");
    }
}
