//! One local Kubernetes cluster on loopback: etcd, kube-apiserver (RBAC, admission
//! webhooks), kube-controller-manager, kube-scheduler, and kwok simulating its nodes.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Node, ServiceAccount};
use kube::api::{Api, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use nix::sys::signal::Signal;
use tokio::net::TcpStream;

use crate::binaries::Binaries;
use crate::pki::{Pki, write_kubeconfig};
use crate::ports::free_port;
use crate::process::{Process, Reaper};
use crate::wait::wait_for;

/// The annotation kwok selects the nodes it simulates by.
pub const KWOK_NODE_ANNOTATION: &str = "kwok.x-k8s.io/node";

/// Resources of one simulated node.
#[derive(Clone, Debug)]
pub struct NodeShape {
    /// CPU quantity, e.g. `8`.
    pub cpu: String,
    /// Memory quantity, e.g. `32Gi`.
    pub memory: String,
    /// Pod count, e.g. `110`.
    pub pods: String,
}

impl Default for NodeShape {
    fn default() -> Self {
        Self {
            cpu: "8".into(),
            memory: "32Gi".into(),
            pods: "110".into(),
        }
    }
}

/// How to start one cluster.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// `upper` or `lower`: names the directory, the kubeconfig and the nodes.
    pub name: String,
    /// Simulated (kwok) nodes to create.
    pub nodes: usize,
    /// Their resources.
    pub node_shape: NodeShape,
    /// Extra labels on every simulated node.
    pub node_labels: BTreeMap<String, String>,
    /// Service range; its first address is the `kubernetes` Service.
    pub service_cidr: (Ipv4Addr, u8),
    /// Range kwok hands pod IPs out of.
    pub pod_cidr: String,
    /// Extra kube-apiserver flags (later ones win).
    pub apiserver_args: Vec<String>,
    /// Extra kube-controller-manager flags.
    pub controller_manager_args: Vec<String>,
    /// Extra top-level fields merged into the KubeSchedulerConfiguration (e.g. `extenders`).
    pub scheduler_config: serde_json::Map<String, serde_json::Value>,
    /// Resource metrics: the API server gets the aggregation layer, kwok simulates each
    /// node's `/metrics/resource` (usage set by annotations, see [`crate::metrics_server`]),
    /// and metrics-server serves `metrics.k8s.io` (`kubectl top`, the HPA).
    pub metrics: bool,
    /// Controllers run as pods on the cluster's real nodes (tensile installed by its chart,
    /// `tests/install.rs`): the API server listens on every address and its certificate
    /// names the machine's ([`crate::ports::host_ip`]), where pods on a real node reach it
    /// ([`Cluster::server_for_pods`]); it routes webhooks and aggregated APIs to a
    /// Service's endpoints (`--enable-aggregator-routing`: no kube-proxy here, so a
    /// ClusterIP leads nowhere, while a pod's IP is reachable from the machine); and it
    /// does not verify kubelets' serving certificates (no `--kubelet-certificate-authority`,
    /// as kubeadm sets it up), since an in-cluster virtual-node serves a self-signed one for
    /// its pod IP.
    pub in_cluster: bool,
}

impl ClusterOptions {
    /// Defaults for the cluster `name`, with `nodes` simulated nodes.
    pub fn new(name: &str, nodes: usize, service_cidr: (Ipv4Addr, u8), pod_cidr: &str) -> Self {
        Self {
            name: name.to_owned(),
            nodes,
            node_shape: NodeShape::default(),
            node_labels: BTreeMap::new(),
            service_cidr,
            pod_cidr: pod_cidr.to_owned(),
            apiserver_args: Vec::new(),
            controller_manager_args: Vec::new(),
            scheduler_config: serde_json::Map::new(),
            metrics: false,
            in_cluster: false,
        }
    }
}

/// The components of a cluster, for [`Cluster::signal`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Component {
    /// etcd
    Etcd,
    /// kube-apiserver
    ApiServer,
    /// kube-controller-manager
    ControllerManager,
    /// kube-scheduler
    Scheduler,
    /// kwok
    Kwok,
    /// metrics-server (with [`ClusterOptions::metrics`])
    MetricsServer,
}

impl Component {
    fn binary(self) -> &'static str {
        match self {
            Self::Etcd => "etcd",
            Self::ApiServer => "kube-apiserver",
            Self::ControllerManager => "kube-controller-manager",
            Self::Scheduler => "kube-scheduler",
            Self::Kwok => "kwok",
            Self::MetricsServer => "metrics-server",
        }
    }
}

/// A running cluster. Its processes die with it.
pub struct Cluster {
    /// `upper` or `lower`.
    pub name: String,
    /// Its state directory (logs, PKI, etcd data).
    pub dir: PathBuf,
    /// Admin kubeconfig.
    pub kubeconfig: PathBuf,
    /// `https://127.0.0.1:<port>`.
    pub server: String,
    /// `https://<the machine's address>:<port>` with [`ClusterOptions::in_cluster`].
    server_for_pods: Option<String>,
    /// Every certificate and key.
    pub pki: Pki,
    pub(crate) options: ClusterOptions,
    processes: Mutex<Vec<(Component, Process)>>,
}

impl Cluster {
    /// Starts every component and waits until the API serves, the controllers work (the
    /// `default` ServiceAccount exists) and every simulated node is Ready.
    pub async fn start(
        bins: &Binaries,
        options: ClusterOptions,
        root: &Path,
        reaper: &Reaper,
    ) -> Result<Self> {
        let name = options.name.clone();
        let dir = root.join(&name);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let (service_net, service_bits) = options.service_cidr;
        let service_ip = Ipv4Addr::from(u32::from(service_net) + 1);
        let host_ip = if options.in_cluster {
            Some(crate::ports::host_ip()?)
        } else {
            None
        };
        let pki = Pki::generate(&dir.join("pki"), &name, service_ip, host_ip.as_slice())?;
        let api_port = free_port()?;
        let server = format!("https://127.0.0.1:{api_port}");
        let server_for_pods = host_ip.map(|ip| format!("https://{ip}:{api_port}"));
        let kubeconfig = root.join(format!("{name}.kubeconfig"));
        write_kubeconfig(&kubeconfig, &name, &server, &pki.ca_cert, &pki.admin)?;
        let kcm_kubeconfig = dir.join("controller-manager.kubeconfig");
        write_kubeconfig(
            &kcm_kubeconfig,
            &name,
            &server,
            &pki.ca_cert,
            &pki.controller_manager,
        )?;
        let scheduler_kubeconfig = dir.join("scheduler.kubeconfig");
        write_kubeconfig(
            &scheduler_kubeconfig,
            &name,
            &server,
            &pki.ca_cert,
            &pki.scheduler,
        )?;

        let cluster = Self {
            name: name.clone(),
            dir: dir.clone(),
            kubeconfig,
            server,
            server_for_pods,
            pki,
            options,
            processes: Mutex::new(Vec::new()),
        };
        let p = |path: &Path| path.display().to_string();

        // etcd
        let (etcd_client, etcd_peer) = (free_port()?, free_port()?);
        let etcd_url = format!("http://127.0.0.1:{etcd_client}");
        let peer_url = format!("http://127.0.0.1:{etcd_peer}");
        cluster.spawn(
            bins,
            reaper,
            Component::Etcd,
            vec![
                format!("--name={name}"),
                format!("--data-dir={}", p(&dir.join("etcd-data"))),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster={name}={peer_url}"),
                "--unsafe-no-fsync=true".into(),
                "--quota-backend-bytes=8589934592".into(),
                "--auto-compaction-mode=periodic".into(),
                "--auto-compaction-retention=5m".into(),
                "--log-level=warn".into(),
            ],
        )?;
        cluster
            .wait_running(Component::Etcd, "etcd to accept connections", || async {
                Ok(TcpStream::connect(("127.0.0.1", etcd_client))
                    .await
                    .ok()
                    .map(|_| ()))
            })
            .await?;

        // kube-apiserver
        let pki = &cluster.pki;
        let mut args = vec![
            format!("--etcd-servers={etcd_url}"),
            "--bind-address=127.0.0.1".into(),
            "--advertise-address=127.0.0.1".into(),
            format!("--secure-port={api_port}"),
            // The `kubernetes` Endpoints would be a loopback address, which validation rejects.
            "--endpoint-reconciler-type=none".into(),
            format!("--cert-dir={}", p(&dir.join("apiserver-certs"))),
            format!("--tls-cert-file={}", p(&pki.apiserver.cert)),
            format!("--tls-private-key-file={}", p(&pki.apiserver.key)),
            format!("--client-ca-file={}", p(&pki.ca_cert)),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", p(&pki.service_account_pub)),
            format!(
                "--service-account-signing-key-file={}",
                p(&pki.service_account_key)
            ),
            format!("--service-cluster-ip-range={service_net}/{service_bits}"),
            "--authorization-mode=Node,RBAC".into(),
            "--allow-privileged=true".into(),
            format!(
                "--kubelet-client-certificate={}",
                p(&pki.apiserver_kubelet_client.cert)
            ),
            format!(
                "--kubelet-client-key={}",
                p(&pki.apiserver_kubelet_client.key)
            ),
            "--kubelet-preferred-address-types=InternalIP,Hostname".into(),
            "--profiling=false".into(),
        ];
        if cluster.options.in_cluster {
            args.extend([
                "--bind-address=0.0.0.0".into(),
                "--enable-aggregator-routing=true".into(),
            ]);
        } else {
            args.push(format!(
                "--kubelet-certificate-authority={}",
                p(&pki.ca_cert)
            ));
        }
        if cluster.options.metrics {
            args.extend(crate::metrics_server::aggregation_args(pki)?);
        }
        args.extend(cluster.options.apiserver_args.iter().cloned());
        cluster.spawn(bins, reaper, Component::ApiServer, args)?;
        cluster
            .wait_running(Component::ApiServer, "kube-apiserver to serve", || async {
                // /readyz includes the RBAC bootstrap hook the other components depend on.
                let client = cluster.client().await?;
                let readyz = http::Request::get("/readyz").body(Vec::new())?;
                Ok(client.request_text(readyz).await.is_ok().then_some(()))
            })
            .await?;

        // kube-controller-manager and kube-scheduler
        let kcm_kc = p(&kcm_kubeconfig);
        let mut args = vec![
            format!("--kubeconfig={kcm_kc}"),
            format!("--authentication-kubeconfig={kcm_kc}"),
            format!("--authorization-kubeconfig={kcm_kc}"),
            "--bind-address=127.0.0.1".into(),
            format!("--secure-port={}", free_port()?),
            "--leader-elect=false".into(),
            "--use-service-account-credentials=true".into(),
            format!(
                "--service-account-private-key-file={}",
                p(&pki.service_account_key)
            ),
            format!("--root-ca-file={}", p(&pki.ca_cert)),
            format!("--cluster-signing-cert-file={}", p(&pki.ca_cert)),
            format!("--cluster-signing-key-file={}", p(&pki.ca_key)),
            format!("--cluster-name={name}"),
            "--kube-api-qps=500".into(),
            "--kube-api-burst=1000".into(),
        ];
        args.extend(cluster.options.controller_manager_args.iter().cloned());
        cluster.spawn(bins, reaper, Component::ControllerManager, args)?;

        let mut scheduler_config = serde_json::json!({
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": scheduler_kubeconfig, "qps": 500, "burst": 1000},
            "leaderElection": {"leaderElect": false},
        });
        if let Some(config) = scheduler_config.as_object_mut() {
            config.extend(cluster.options.scheduler_config.clone());
        }
        let scheduler_config_path = dir.join("scheduler-config.json");
        std::fs::write(
            &scheduler_config_path,
            serde_json::to_string_pretty(&scheduler_config)?,
        )?;
        let sched_kc = p(&scheduler_kubeconfig);
        cluster.spawn(
            bins,
            reaper,
            Component::Scheduler,
            vec![
                format!("--config={}", p(&scheduler_config_path)),
                format!("--authentication-kubeconfig={sched_kc}"),
                format!("--authorization-kubeconfig={sched_kc}"),
                "--bind-address=127.0.0.1".into(),
                format!("--secure-port={}", free_port()?),
            ],
        )?;

        // kwok simulates the nodes annotated for it (and the pods bound to them).
        {
            let kwok_config = dir.join("kwok-stages.yaml");
            let stages = [
                "node-initialize.yaml",
                "node-heartbeat-with-lease.yaml",
                "pod-ready.yaml",
                "pod-complete.yaml",
                "pod-delete.yaml",
            ]
            .iter()
            .map(|stage| {
                let path = bins.stage(stage);
                let yaml = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading kwok stage {}", path.display()))?;
                if *stage == "pod-complete.yaml" {
                    pod_complete_unless_delayed(&yaml)
                        .with_context(|| format!("kwok stage {}", path.display()))
                } else {
                    Ok(yaml)
                }
            })
            .collect::<Result<Vec<_>>>()?;
            let mut documents = stages;
            documents.push(job_pod_complete_stage());
            documents.push(kwok_debugging_config(&dir.join("kwok"))?);
            if cluster.options.metrics {
                documents.extend(crate::metrics_server::kwok_metrics_config(bins)?);
            }
            std::fs::write(&kwok_config, documents.join("\n---\n"))?;
            let kwok_port = free_port()?;
            cluster.spawn(
                bins,
                reaper,
                Component::Kwok,
                vec![
                    format!("--kubeconfig={}", p(&cluster.kubeconfig)),
                    format!("--config={}", p(&kwok_config)),
                    "--manage-all-nodes=false".into(),
                    format!("--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake"),
                    format!("--cidr={}", cluster.options.pod_cidr),
                    "--node-ip=127.0.0.1".into(),
                    format!("--node-port={kwok_port}"),
                    format!("--server-address=127.0.0.1:{kwok_port}"),
                    "--node-lease-duration-seconds=40".into(),
                    // The API server reaches kwok's kubelet API (logs, exec, attach,
                    // port-forward) over TLS and verifies it against the cluster CA.
                    format!("--tls-cert-file={}", p(&cluster.pki.kubelet_serving.cert)),
                    format!(
                        "--tls-private-key-file={}",
                        p(&cluster.pki.kubelet_serving.key)
                    ),
                ],
            )?;
        }
        let names: Vec<String> = (0..cluster.options.nodes)
            .map(|i| format!("{name}-node-{i}"))
            .collect();
        if !names.is_empty() {
            cluster.add_nodes(&names).await?;
        }

        cluster
            .wait_running(
                Component::ControllerManager,
                "the default ServiceAccount (controller-manager)",
                || async {
                    let client = cluster.client().await?;
                    let sa = Api::<ServiceAccount>::namespaced(client, "default")
                        .get_opt("default")
                        .await?;
                    Ok(sa.map(|_| ()))
                },
            )
            .await?;
        if cluster.options.metrics {
            cluster.start_metrics_server(bins, reaper).await?;
        }
        Ok(cluster)
    }

    pub(crate) fn spawn(
        &self,
        bins: &Binaries,
        reaper: &Reaper,
        component: Component,
        args: Vec<String>,
    ) -> Result<()> {
        let binary = component.binary();
        let process = Process::spawn(
            &format!("{}/{binary}", self.name),
            &bins.bin(binary),
            &args,
            &[],
            &self.dir.join(format!("{binary}.log")),
            reaper,
        )?;
        self.lock().push((component, process));
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(Component, Process)>> {
        self.processes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for `check`, failing early (with its log) if `component` exits.
    pub(crate) async fn wait_running<F, Fut>(
        &self,
        component: Component,
        what: &str,
        check: F,
    ) -> Result<()>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<Option<()>>>,
    {
        let what = format!("{}: {what}", self.name);
        // A component that exited fails the wait at once instead of at the deadline.
        wait_for(&what, Duration::from_secs(90), || async {
            if let Err(exited) = self.check_running(component) {
                return Ok(Some(Err(exited)));
            }
            Ok(check().await?.map(Ok))
        })
        .await?
    }

    /// Fails (with the log's tail) if a component has exited.
    pub fn check_running(&self, component: Component) -> Result<()> {
        let mut processes = self.lock();
        for (c, process) in processes.iter_mut() {
            if *c == component {
                process.check_running()?;
            }
        }
        Ok(())
    }

    /// Sends a signal to a component: SIGSTOP makes it stop answering, SIGCONT resumes it.
    pub fn signal(&self, component: Component, signal: Signal) -> Result<()> {
        let processes = self.lock();
        let Some((_, process)) = processes.iter().find(|(c, _)| *c == component) else {
            bail!("{}: {} is not running", self.name, component.binary());
        };
        process.signal(signal)
    }

    /// SIGKILLs a component and starts it again (same flags, same data): a crash and a
    /// restart. Does not wait for it to serve.
    pub fn restart(&self, component: Component, reaper: &Reaper) -> Result<()> {
        let mut processes = self.lock();
        let Some((_, process)) = processes.iter_mut().find(|(c, _)| *c == component) else {
            bail!("{}: {} is not running", self.name, component.binary());
        };
        process.restart(reaper)
    }

    /// Where pods on this cluster's real nodes reach its API server (with
    /// [`ClusterOptions::in_cluster`]).
    pub fn server_for_pods(&self) -> Result<&str> {
        self.server_for_pods.as_deref().with_context(|| {
            format!(
                "{}: its API server is not reachable from pods (ClusterOptions::in_cluster)",
                self.name
            )
        })
    }

    /// The API server's proxy to a Service's port (`services/proxy`): the way a process of
    /// the harness reaches a Service whose pods run on a real node (no kube-proxy here).
    pub fn service_proxy_url(&self, namespace: &str, service: &str, port: &str) -> String {
        format!(
            "{}/api/v1/namespaces/{namespace}/services/{service}:{port}/proxy",
            self.server
        )
    }

    /// Merges `fields` into the kube-scheduler's configuration and restarts it with them (a
    /// platform team adding the extender once it runs). Does not wait for it to serve.
    pub fn reconfigure_scheduler(
        &self,
        fields: serde_json::Map<String, serde_json::Value>,
        reaper: &Reaper,
    ) -> Result<()> {
        let path = self.dir.join("scheduler-config.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let mut config: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let Some(object) = config.as_object_mut() else {
            bail!("{} is not a JSON object", path.display());
        };
        object.extend(fields);
        std::fs::write(&path, serde_json::to_string_pretty(&config)?)
            .with_context(|| format!("writing {}", path.display()))?;
        self.restart(Component::Scheduler, reaper)
    }

    /// A kubeconfig for `user` in `groups` (for RBAC tests), written beside the admin one.
    pub fn kubeconfig_for(&self, user: &str, groups: &[&str]) -> Result<PathBuf> {
        let cert = self.pki.issue_client(user, groups)?;
        let path = self.dir.join(format!(
            "{}.kubeconfig",
            cert.cert
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("user")
        ));
        write_kubeconfig(&path, &self.name, &self.server, &self.pki.ca_cert, &cert)?;
        Ok(path)
    }

    /// A kubeconfig for `user` in `groups` at [`Cluster::server_for_pods`], credentials
    /// inline: what a pod on a real node (a Secret's contents) uses to reach this cluster.
    pub fn kubeconfig_for_pods(&self, user: &str, groups: &[&str]) -> Result<PathBuf> {
        let server = self.server_for_pods()?.to_owned();
        let cert = self.pki.issue_client(user, groups)?;
        let path = self.dir.join(format!("{user}-for-pods.kubeconfig"));
        write_kubeconfig(&path, &self.name, &server, &self.pki.ca_cert, &cert)?;
        Ok(path)
    }

    /// A kubeconfig for `user` with a client certificate that has expired.
    pub fn kubeconfig_expired_for(&self, user: &str) -> Result<PathBuf> {
        let cert = self.pki.issue_expired_client(user)?;
        let path = self.dir.join(format!("expired-{user}.kubeconfig"));
        write_kubeconfig(&path, &self.name, &self.server, &self.pki.ca_cert, &cert)?;
        Ok(path)
    }

    /// A client with the admin identity.
    pub async fn client(&self) -> Result<Client> {
        client_for(&self.kubeconfig)
            .await
            .with_context(|| format!("{} cluster client", self.name))
    }

    /// Creates simulated nodes (shape and labels from the options) and waits until kwok
    /// reports them Ready.
    pub async fn add_nodes(&self, names: &[String]) -> Result<()> {
        let client = self.client().await?;
        let nodes: Api<Node> = Api::all(client);
        let shape = &self.options.node_shape;
        for node in names {
            let mut labels = serde_json::json!({
                "kubernetes.io/hostname": node,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
            });
            if let Some(map) = labels.as_object_mut() {
                for (k, v) in &self.options.node_labels {
                    map.insert(k.clone(), v.clone().into());
                }
            }
            let resources = serde_json::json!({
                "cpu": shape.cpu, "memory": shape.memory, "pods": shape.pods,
            });
            let mut annotations = serde_json::json!({KWOK_NODE_ANNOTATION: "fake"});
            if self.options.metrics
                && let Some(map) = annotations.as_object_mut()
            {
                // Where metrics-server reads the node's resource metrics: kwok's path.
                map.insert(
                    crate::metrics_server::RESOURCE_METRICS_PATH_ANNOTATION.into(),
                    format!("/metrics/nodes/{node}/metrics/resource").into(),
                );
            }
            let object: Node = serde_json::from_value(serde_json::json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": node,
                    "labels": labels,
                    "annotations": annotations,
                },
                "status": {
                    "capacity": resources,
                    "allocatable": resources,
                    "nodeInfo": {
                        "architecture": "amd64",
                        "operatingSystem": "linux",
                        "kubeletVersion": "kwok",
                    },
                },
            }))?;
            nodes
                .create(&PostParams::default(), &object)
                .await
                .with_context(|| format!("{}: creating node {node}", self.name))?;
        }
        let what = format!("kwok to report {} node(s) Ready", names.len());
        self.wait_running(Component::Kwok, &what, || async {
            let list = nodes.list(&ListParams::default()).await?;
            let ready = list
                .items
                .iter()
                .filter(|n| {
                    names
                        .iter()
                        .any(|name| Some(name) == n.metadata.name.as_ref())
                })
                .filter(|n| node_is_ready(n))
                .count();
            Ok((ready == names.len()).then_some(()))
        })
        .await
    }

    /// Stops every component (SIGTERM, then SIGKILL) in reverse start order.
    pub fn stop(&self) {
        let mut processes = self.lock();
        while let Some((_, mut process)) = processes.pop() {
            if let Err(error) = process.stop(Duration::from_secs(5)) {
                tracing::warn!(%error, component = process.name(), "stopping");
            }
        }
    }

    /// The log file of kwok's [`KWOK_FOLLOW_CONTAINER`] containers; append
    /// [`cri_log_line`]s to it to make `kubectl logs -f` print more.
    pub fn kwok_follow_log(&self) -> PathBuf {
        self.dir.join("kwok").join("follow.log")
    }

    /// Every component's PID and log, for the playground's output.
    pub fn components(&self) -> Vec<(String, u32, PathBuf)> {
        self.lock()
            .iter()
            .map(|(_, p)| (p.name().to_owned(), p.pid(), p.log().to_owned()))
            .collect()
    }
}

/// Log lines every simulated container prints (`kubectl logs`), in order.
pub const KWOK_LOG_LINES: [&str; 3] = ["hello from kwok", "second line", "third line"];
/// The log of a simulated container's previous instance (`kubectl logs --previous`).
pub const KWOK_PREVIOUS_LOG_LINE: &str = "previous instance";
/// The container name whose log is [`Cluster::kwok_follow_log`], which a test may append
/// to (`kubectl logs -f`); every other container's log never changes.
pub const KWOK_FOLLOW_CONTAINER: &str = "follow";

/// The annotation (kwok's own, read by its general `pod-complete` stage) that sets how long
/// a Job's pod runs on a kwok node before it succeeds: a duration (`10s`) or a time.
pub const KWOK_POD_COMPLETE_DELAY_ANNOTATION: &str = "pod-complete.stage.kwok.x-k8s.io/delay";

/// How long [`job_pod_complete_stage`] runs a pod without
/// [`KWOK_POD_COMPLETE_DELAY_ANNOTATION`].
pub const KWOK_JOB_POD_SECONDS: u64 = 5;

/// A kwok Stage that completes a Job's pod (labelled `batch.kubernetes.io/job-name`) that
/// kwok's `pod-complete` leaves running: one without owner references (the lower copy of
/// an upper Job's pod: the translation drops owners, so nothing below finishes it), or one
/// annotated [`KWOK_POD_COMPLETE_DELAY_ANNOTATION`], after that long, else
/// [`KWOK_JOB_POD_SECONDS`]. kwok's `pod-complete` (owned by a Job) is given the
/// annotation's absence as a condition ([`pod_complete_unless_delayed`]), so at most one
/// of the two matches a pod.
pub fn job_pod_complete_stage() -> String {
    let delay = KWOK_POD_COMPLETE_DELAY_ANNOTATION;
    let milliseconds = KWOK_JOB_POD_SECONDS * 1000;
    format!(
        r#"apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: tensile-job-pod-complete
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values:
      - 'Running'
    - key: '.metadata.labels["batch.kubernetes.io/job-name"]'
      operator: 'Exists'
    - key: '((.metadata.ownerReferences // []) | length == 0) or (.metadata.annotations["{delay}"] != null)'
      operator: 'In'
      values:
      - 'true'
  delay:
    durationMilliseconds: {milliseconds}
    durationFrom:
      expressionFrom: '.metadata.annotations["{delay}"]'
  next:
    statusTemplate: |
      {{{{ $now := Now }}}}
      containerStatuses:
      {{{{ range .spec.containers }}}}
      - image: {{{{ .image | Quote }}}}
        name: {{{{ .name | Quote }}}}
        ready: false
        restartCount: 0
        started: false
        state:
          terminated:
            exitCode: 0
            finishedAt: {{{{ $now | Quote }}}}
            reason: Completed
            startedAt: {{{{ $now | Quote }}}}
      {{{{ end }}}}
      phase: Succeeded
"#
    )
}

/// kwok's `pod-complete` Stage (`yaml`) with one more condition: no
/// [`KWOK_POD_COMPLETE_DELAY_ANNOTATION`] (such a pod is [`job_pod_complete_stage`]'s).
fn pod_complete_unless_delayed(yaml: &str) -> Result<String> {
    let mut stage: serde_json::Value =
        serde_saphyr::from_str(yaml).context("parsing the pod-complete Stage")?;
    let expressions = stage["spec"]["selector"]["matchExpressions"]
        .as_array_mut()
        .context("the pod-complete Stage has no spec.selector.matchExpressions")?;
    expressions.push(serde_json::json!({
        "key": format!(".metadata.annotations[\"{KWOK_POD_COMPLETE_DELAY_ANNOTATION}\"]"),
        "operator": "DoesNotExist",
    }));
    // JSON is YAML.
    Ok(stage.to_string())
}

/// A line in the CRI log format the kubelet (and kwok) reads.
pub fn cri_log_line(time: &str, text: &str) -> String {
    format!("{time} stdout F {text}\n")
}

/// kwok's answers to the kubelet API: every container logs [`KWOK_LOG_LINES`] (one
/// minute apart, ending an hour ago, so `--since` can tell them apart); `attach` prints
/// what is appended to [`Cluster::kwok_follow_log`] from then on; `exec` runs the command in kwok's own environment; port-forward on any port
/// runs `cat`, an echo.
fn kwok_debugging_config(dir: &Path) -> Result<String> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let app = dir.join("app.log");
    let previous = dir.join("previous.log");
    let follow = dir.join("follow.log");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let lines: String = KWOK_LOG_LINES
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let at = now - 3600 - 60 * (KWOK_LOG_LINES.len() - 1 - i) as u64;
            cri_log_line(&rfc3339(at), line)
        })
        .collect();
    std::fs::write(&app, lines)?;
    std::fs::write(
        &previous,
        cri_log_line(&rfc3339(now - 7200), KWOK_PREVIOUS_LOG_LINE),
    )?;
    std::fs::write(&follow, cri_log_line(&rfc3339(now), "following"))?;
    let p = |path: &Path| path.display().to_string();
    let documents = serde_json::json!([
        {
            "apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "ClusterLogs",
            "metadata": {"name": "tensile-logs"},
            "spec": {"logs": [
                {"containers": [KWOK_FOLLOW_CONTAINER], "logsFile": p(&follow), "follow": true},
                {"logsFile": p(&app), "previousLogsFile": p(&previous)},
            ]},
        },
        {
            "apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "ClusterAttach",
            "metadata": {"name": "tensile-attach"},
            "spec": {"attaches": [{"logsFile": p(&follow)}]},
        },
        {
            "apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "ClusterExec",
            "metadata": {"name": "tensile-exec"},
            "spec": {"execs": [{"local": {"envs": [{"name": "TENSILE_KWOK", "value": "1"}]}}]},
        },
        {
            "apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "ClusterPortForward",
            "metadata": {"name": "tensile-port-forward"},
            "spec": {"forwards": [{"command": ["cat"]}]},
        },
    ]);
    let documents = documents.as_array().cloned().unwrap_or_default();
    // JSON is YAML: each object one document.
    Ok(documents
        .iter()
        .map(serde_json::Value::to_string)
        .collect::<Vec<_>>()
        .join("\n---\n"))
}

/// Seconds since the epoch as RFC 3339 (UTC, nanoseconds), as CRI logs write time.
pub fn rfc3339(seconds: u64) -> String {
    let days = seconds / 86_400;
    let rem = seconds % 86_400;
    // Civil from days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.000000000Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Whether a node's Ready condition is True.
pub fn node_is_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Whether a node is Ready and the node lifecycle controller has taken its taints off
/// (`node.kubernetes.io/not-ready`, put on at registration, goes a moment after Ready):
/// until then the scheduler places nothing there that does not tolerate them.
pub fn node_is_schedulable(node: &Node) -> bool {
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|taints| {
            taints
                .iter()
                .any(|t| t.key.starts_with("node.kubernetes.io/"))
        });
    node_is_ready(node) && !tainted
}

/// A client from a kubeconfig file.
pub async fn client_for(kubeconfig: &Path) -> Result<Client> {
    let kc = Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("reading {}", kubeconfig.display()))?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(config)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_dates() {
        for (seconds, text) in [
            (0, "1970-01-01T00:00:00.000000000Z"),
            (951_782_400, "2000-02-29T00:00:00.000000000Z"),
            (1_795_434_245, "2026-11-23T11:44:05.000000000Z"),
        ] {
            assert_eq!(rfc3339(seconds), text, "{seconds}");
        }
    }
}
