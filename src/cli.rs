//! Command line of `virtual-node`, with tensile-kube's flag and environment names.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{ArgAction, Parser, value_parser};

use crate::clusters::Features;
use crate::duration::{format_duration, parse_duration};
use crate::logging::LogFormat;
use crate::translate::meta::{
    VIRTUAL_NODE_TAINT_EFFECT, VIRTUAL_NODE_TAINT_KEY, VIRTUAL_NODE_TAINT_VALUE,
};

/// Joins a lower Kubernetes cluster to an upper one as a virtual node.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "virtual-node",
    version,
    about,
    long_about = None,
    args_override_self = true,
    after_help = "Commands: `virtual-node version` prints the version, `virtual-node providers` the provider (k8s), `virtual-node check <flags>` verifies both clusters, permissions and ports without changing anything (exit 1 if something is missing), `virtual-node uninstall <flags> [--deployment [NAMESPACE/]NAME]` removes the node of the flags as a member leaves (drained, virtual-node stopped, what it made below deleted, then its Node and Lease).\n\
                  klog's flags (`--klog.v=5`, `-v=5`, `--logtostderr`, ...) are accepted and ignored: use --log-level."
)]
pub struct Args {
    /// Name of the virtual node in the upper cluster (a DNS label-like name: it is also a
    /// label value on every lower object).
    #[arg(
        long,
        env = "DEFAULTNODE_NAME",
        value_parser = parse_node_name,
        default_value = "virtual-kubelet"
    )]
    pub nodename: String,

    /// The upper cluster's identity, marked on every lower object with the node name, so
    /// that upper clusters whose virtual nodes share a name and a lower cluster never take
    /// each other's objects (default: the UID of the upper `kube-system` namespace).
    #[arg(long, env = "TENSILE_CLUSTER_ID", value_parser = parse_label_value)]
    pub cluster_id: Option<String>,

    /// Kubeconfig of the upper cluster (default: $KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Kubeconfig of the lower cluster: the member of the single-cluster flags, joined as
    /// `--nodename`. Optional with `--members-namespace`.
    #[arg(long, required_unless_present = "members_namespace")]
    pub client_kubeconfig: Option<PathBuf>,

    /// Join, besides or instead of `--client-kubeconfig`, every lower cluster whose member
    /// Secret (label `tensile.dev/lower-cluster: "true"`, kubeconfig under `kubeconfig`)
    /// is in this upper namespace, each as a virtual node of its own, joined and left at
    /// run time (`virtual-node join` writes such Secrets).
    #[arg(long, env = "TENSILE_MEMBERS_NAMESPACE", value_parser = parse_node_name)]
    pub members_namespace: Option<String>,

    /// How long a member's leave may take from its Secret's deletion: past it, pods the
    /// member could not end (its lower cluster gone) are deleted upstairs with no grace
    /// period, as Kubernetes does for pods of a lost node, and what stays below is said in
    /// an Event. Long enough for pods' grace periods and PodDisruptionBudgets.
    #[arg(long, value_parser = parse_period, default_value = "10m")]
    pub leave_timeout: Duration,

    /// Only read by `virtual-node uninstall`: the Deployment that runs this virtual-node,
    /// `NAME` (in the upper kubeconfig's namespace; in a pod, its own) or `NAMESPACE/NAME`,
    /// scaled to 0 once the node is drained, so that nothing re-creates what uninstall
    /// deletes next. Without it, virtual-node must be stopped before `uninstall` is run:
    /// the pods it evicts then end only when --leave-timeout has passed.
    #[arg(long, value_name = "[NAMESPACE/]NAME")]
    pub deployment: Option<String>,

    /// Requests per second to the lower cluster, as client-go reads it: 0 is client-go's
    /// default (5), a negative number no limit, a positive one at least 0.01.
    #[arg(long, value_parser = parse_qps, default_value_t = 500.0, allow_negative_numbers = true)]
    pub client_qps: f64,

    /// Burst of requests to the lower cluster (0: client-go's default, 10).
    #[arg(long, value_parser = parse_burst, default_value_t = 1000, allow_negative_numbers = true)]
    pub client_burst: u32,

    /// Requests per second to the upper cluster, as `--client-qps`.
    #[arg(long, value_parser = parse_qps, default_value_t = 500.0, allow_negative_numbers = true)]
    pub kube_api_qps: f64,

    /// Burst of requests to the upper cluster, as `--client-burst`.
    #[arg(long, value_parser = parse_burst, default_value_t = 1000, allow_negative_numbers = true)]
    pub kube_api_burst: u32,

    /// Pod labels removed before mirroring (kept in the `tripped-labels` annotation).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "pod-group.scheduling.sigs.k8s.io"
    )]
    pub ignore_labels: Vec<String>,

    /// Optional controllers, comma-separated: `PVControllers` (claims bound below, their
    /// volumes reflected up), `ServiceControllers` (Services, EndpointSlices and Endpoints
    /// mirrored down). `--enable-controllers=` runs neither. ConfigMap/Secret sync and
    /// event reflection always run. Unknown names are logged and skipped (tensile-kube).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "PVControllers,ServiceControllers"
    )]
    pub enable_controllers: Vec<String>,

    /// Mirror the ServiceAccounts pods use into the lower cluster.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = true, default_missing_value = "true")]
    pub enable_serviceaccount: bool,

    /// Only mirror pods of this namespace (empty: all).
    #[arg(long, default_value = "")]
    pub namespace: String,

    /// Operating system the node reports.
    #[arg(long, default_value = "Linux")]
    pub os: String,

    /// Register the node without the virtual-kubelet taint.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true")]
    pub disable_taint: bool,

    /// Key of the node's taint (`--taint` is virtual-kubelet's deprecated name for it).
    #[arg(long, alias = "taint", env = "VKUBELET_TAINT_KEY", default_value = VIRTUAL_NODE_TAINT_KEY)]
    pub taint_key: String,

    /// Value of the node's taint.
    #[arg(long, env = "VKUBELET_TAINT_VALUE", default_value = VIRTUAL_NODE_TAINT_VALUE)]
    pub taint_value: String,

    /// Effect of the node's taint.
    #[arg(long, env = "VKUBELET_TAINT_EFFECT", default_value = VIRTUAL_NODE_TAINT_EFFECT)]
    pub taint_effect: String,

    /// Pods reconciled at once.
    #[arg(long, value_parser = value_parser!(u16).range(1..), default_value_t = 10)]
    pub pod_sync_workers: u16,

    /// Pod statuses reflected at once (each is one write to the upper cluster); 0 for
    /// three times `--pod-sync-workers`. Reflection has a queue of its own, so this bounds
    /// only how many status writes may wait on a busy upper API server together.
    #[arg(long, default_value_t = 0)]
    pub status_sync_workers: u16,

    /// Heartbeat through a Lease in kube-node-lease (otherwise through node status).
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = true, default_missing_value = "true")]
    pub enable_node_lease: bool,

    /// How often every mirrored pod is reconciled even without a change (1s to a year).
    #[arg(long, value_parser = parse_period, default_value = "1m")]
    pub full_resync_period: Duration,

    /// Log filter (`info`, `debug`, or a tracing directive such as `tensile=debug`).
    #[arg(long, default_value = "info")]
    pub log_level: String,

    /// Log lines as `text` or `json`.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Accepted for tensile-kube compatibility; ignored (tensile is always the `k8s` provider).
    #[arg(long)]
    pub provider: Option<String>,

    /// Accepted for tensile-kube compatibility; ignored (tensile-kube's k8s provider reads none).
    #[arg(long)]
    pub provider_config: Option<PathBuf>,

    /// Accepted for tensile-kube compatibility; ignored (the lower cluster's kubelets set
    /// up the pods' DNS).
    #[arg(long)]
    pub cluster_domain: Option<String>,

    /// Give up, exit status 1, if the node is not registered and serving within this long
    /// (0: wait as long as it takes).
    #[arg(long, value_parser = parse_ttl, default_value = "0s")]
    pub startup_timeout: Duration,

    /// Address of the health and metrics endpoint (`/healthz`, `/readyz`, `/metrics`).
    #[arg(long, value_parser = parse_addr, default_value = ":10255")]
    pub metrics_addr: SocketAddr,

    /// Port of the kubelet API, reported as the node's daemon endpoint.
    #[arg(long, env = "KUBELET_PORT", default_value_t = 10250)]
    pub kubelet_port: u16,

    /// The node's burst priority (label `tensile.dev/burst-priority`): virtual nodes fill
    /// lowest first, and their pods leave highest first on scale-in. Member Secrets set
    /// theirs with the annotation of that name.
    #[arg(long, value_parser = crate::node::burst::parse_priority, default_value_t = 0)]
    pub burst_priority: u32,

    /// Caps on what the node offers, `resource=quantity,...` (`cpu=64,memory=256Gi,
    /// pods=500,nvidia.com/gpu=4`); resources not named are not capped. Member Secrets set
    /// theirs with the annotation `tensile.dev/share`.
    #[arg(long, value_parser = crate::node::burst::parse_share, default_value = "")]
    pub share: crate::node::burst::Share,

    /// Keep the `nominalQuota`s of FLAVOR in the Kueue ClusterQueue CLUSTERQUEUE
    /// (`kueue.x-k8s.io/v1beta2`) equal to the allocatable of the node `--nodename`, one per
    /// resource the flavor lists (a resource the node lacks is left alone), so that Kueue
    /// admits to that flavor only what the lower cluster can run. For the node of the
    /// single-cluster flags (`--client-kubeconfig`, `cluster` granularity) only, not for
    /// member Secrets' nodes. Its RBAC is deploy/virtual-node/kueue-rbac.yaml.
    #[arg(long, value_name = "CLUSTERQUEUE/FLAVOR", value_parser = crate::translate::kueue_quota::parse_target)]
    pub kueue_quota: Option<crate::translate::kueue_quota::QuotaTarget>,

    /// How the lower cluster is shown upstairs: `cluster` (one virtual node, `--nodename`),
    /// `node` (one per lower node) or `label=<key>` (one per value of that lower node label,
    /// e.g. `label=topology.kubernetes.io/zone`). Member Secrets set theirs with the
    /// annotation `tensile.dev/node-granularity`.
    #[arg(long, value_parser = crate::node::groups::parse_granularity, default_value = "cluster")]
    pub node_granularity: crate::node::groups::Granularity,

    /// Lower node labels (keys, `*` matches any run of characters, comma-separated) that a
    /// group's virtual node shows when its lower nodes agree on the value, beside
    /// `topology.kubernetes.io/{zone,region}`, `node.kubernetes.io/instance-type`,
    /// `kubernetes.io/{arch,os}`. Member Secrets: `tensile.dev/lower-node-labels`. A bare
    /// `*` is refused, and so is any label a kubelet may not set on its own Node
    /// (NodeRestriction: `node-restriction.kubernetes.io/`, `kubernetes.io` and `k8s.io`
    /// keys beyond the kubelet's own) or tensile's (`tensile.dev/`), whatever matches it.
    #[arg(long, value_parser = crate::node::groups::parse_label_patterns, default_value = "")]
    pub lower_node_labels: crate::node::groups::LabelPatterns,

    /// With `--node-granularity node` or `label=<key>`: a kubelet port of its own for each
    /// virtual node, from this range (`FROM-TO`, `FROM+N` or one port; e.g. 10300-10399),
    /// advertised in its Node's `status.daemonEndpoints` and kept across restarts, so that
    /// `kubectl top node` (metrics-server with `--kubelet-use-node-status-port`) and node-wide
    /// kubelet calls reach each virtual node apart. Virtual nodes past the range's size keep
    /// `--kubelet-port` (a Warning Event on their Node). Default: all on `--kubelet-port`.
    #[arg(long, env = "KUBELET_PORT_RANGE", value_parser = crate::kubelet_api::node_ports::parse_port_range)]
    pub kubelet_port_range: Option<crate::kubelet_api::node_ports::PortRange>,

    /// The node's InternalIP (default: the first non-loopback address, else 127.0.0.1).
    #[arg(long, env = "VKUBELET_POD_IP")]
    pub node_ip: Option<String>,

    /// Kubelet API serving certificate, PEM (default: a self-signed one generated at start).
    #[arg(long, env = "APISERVER_CERT_LOCATION")]
    pub apiserver_cert: Option<PathBuf>,

    /// Kubelet API serving key, PEM.
    #[arg(long, env = "APISERVER_KEY_LOCATION")]
    pub apiserver_key: Option<PathBuf>,

    /// CA that kubelet API client certificates must chain to (default: the upper cluster's
    /// CA from the `kube-root-ca.crt` ConfigMap in kube-system).
    #[arg(
        long = "client-verify-ca",
        alias = "apiserver-ca-cert",
        env = "APISERVER_CA_CERT_LOCATION"
    )]
    pub apiserver_ca_cert: Option<PathBuf>,

    /// Accept bearer tokens on the kubelet API, checked with a TokenReview in the upper cluster.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true")]
    pub authentication_token_webhook: bool,

    /// How long a kubelet API TokenReview answer, either way, is reused (0: not at all).
    #[arg(long, value_parser = parse_ttl, default_value = "2m")]
    pub authentication_token_webhook_cache_ttl: Duration,

    /// How long an allowed kubelet API authorization is reused (0: not at all).
    #[arg(long, value_parser = parse_ttl, default_value = "5m")]
    pub authorization_webhook_cache_authorized_ttl: Duration,

    /// How long a denied kubelet API authorization is reused (0: not at all).
    #[arg(long, value_parser = parse_ttl, default_value = "30s")]
    pub authorization_webhook_cache_unauthorized_ttl: Duration,

    /// Serve the kubelet API to anyone, unauthenticated: a remote shell for all. Labs only.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true")]
    pub no_verify_clients: bool,

    /// Run as one of several replicas of this node: only the holder of a Lease in the
    /// upper cluster writes anything; the others keep their pod watches warm and take over
    /// when it stops renewing (off: this process always acts).
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true")]
    pub leader_elect: bool,

    /// Name of the leader-election Lease (default: `tensile-virtual-node-<nodename>`).
    #[arg(long)]
    pub leader_elect_resource_name: Option<String>,

    /// Namespace of the leader-election Lease (default: $POD_NAMESPACE, else the in-cluster
    /// service account's namespace, else kube-system).
    #[arg(long, env = "POD_NAMESPACE")]
    pub leader_elect_resource_namespace: Option<String>,

    /// This replica's identity in the Lease (default: $POD_NAME, else the host name and a
    /// random suffix).
    #[arg(long, env = "POD_NAME")]
    pub leader_elect_identity: Option<String>,

    /// How long a leader that stopped renewing keeps the Lease; a dead leader is replaced
    /// about this long after its last renewal (longer than the renew deadline; whole
    /// seconds in the Lease, so at least 1s).
    #[arg(long, value_parser = duration_in(crate::leader::MIN_LEASE_DURATION, MAX_DURATION), default_value = "10s")]
    pub leader_elect_lease_duration: Duration,

    /// The leader stops writing, and exits, when it could not renew for this long (longer
    /// than the retry period).
    #[arg(long, value_parser = duration_in(MIN_LEASE_TIMING, MAX_DURATION), default_value = "7s")]
    pub leader_elect_renew_deadline: Duration,

    /// How often the Lease is renewed, or tried by a standby.
    #[arg(long, value_parser = duration_in(MIN_LEASE_TIMING, MAX_DURATION), default_value = "2s")]
    pub leader_elect_retry_period: Duration,

    /// Offloaded pods keep their upper identity: each projected service-account token they
    /// mount is issued by the upper API server for the pod's upper ServiceAccount, bound to
    /// the upper pod, and kept current in a lower Secret; the pods reach the upper API
    /// server at --upper-api-address as `kubernetes.default`. Off (tensile-kube's
    /// behaviour): they get the lower cluster's ServiceAccount token.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true")]
    pub upper_identity: bool,

    /// With --upper-identity (required then): IP:PORT at which pods in the lower cluster
    /// reach the upper API server (its serving certificate must name the IP).
    #[arg(long)]
    pub upper_api_address: Option<String>,

    /// With --upper-identity: renew the tokens at least this often, besides at 70-80 % of
    /// their lifetime as the kubelet does (e.g. `10m`).
    #[arg(long, value_parser = duration_in(MIN_PERIOD, MAX_DURATION))]
    pub upper_token_max_age: Option<Duration>,

    /// Where each upper namespace's objects go below: `same` (its own name, tensile-kube's
    /// behaviour), `prefixed` (`<namespace>-<upper cluster, short>`, so that upper clusters
    /// sharing a lower one never meet in a namespace), or `annotation` (its own name). With
    /// `prefixed` and `annotation`, an upper Namespace annotated
    /// `tensile.dev/lower-namespace: NAME` maps to NAME.
    #[arg(long, value_parser = parse_lower_namespace, default_value = "same")]
    pub lower_namespace: crate::translate::namespace::Mode,

    /// Lower namespaces that `--lower-namespace=prefixed` or `annotation` never maps an
    /// upper namespace to (comma-separated), besides `kube-*` and `tensile-system` (where
    /// `virtual-node join` keeps member identities).
    #[arg(long, value_delimiter = ',', value_parser = parse_reserved_namespace)]
    pub reserved_lower_namespaces: Vec<String>,
}

fn parse_reserved_namespace(text: &str) -> Result<String, String> {
    let name = text.trim();
    if name.is_empty() || crate::translate::namespace::is_namespace_name(name) {
        Ok(name.to_owned())
    } else {
        Err(format!("{name:?} is not a namespace name"))
    }
}

fn parse_lower_namespace(text: &str) -> Result<crate::translate::namespace::Mode, String> {
    text.parse()
}

/// Which optional controllers `--enable-controllers` turns on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OptionalControllers {
    /// `PVControllers`.
    pub volumes: bool,
    /// `ServiceControllers`.
    pub services: bool,
    /// Names given that are neither (skipped with a warning, as tensile-kube does).
    pub unknown: Vec<String>,
}

impl Args {
    /// The flags given that only tensile-kube's command lines use, as given.
    pub fn ignored_flags(&self) -> Vec<String> {
        let mut ignored = Vec::new();
        if let Some(provider) = &self.provider {
            ignored.push(format!("--provider={provider}"));
        }
        if let Some(path) = &self.provider_config {
            ignored.push(format!("--provider-config={}", path.display()));
        }
        if let Some(domain) = &self.cluster_domain {
            ignored.push(format!("--cluster-domain={domain}"));
        }
        ignored
    }

    /// The optional controllers to run. Names match without regard to case.
    pub fn optional_controllers(&self) -> OptionalControllers {
        let mut enabled = OptionalControllers::default();
        for name in self.enable_controllers.iter().map(|n| n.trim()) {
            if name.eq_ignore_ascii_case("PVControllers") {
                enabled.volumes = true;
            } else if name.eq_ignore_ascii_case("ServiceControllers") {
                enabled.services = true;
            } else if !name.is_empty() {
                enabled.unknown.push(name.to_owned());
            }
        }
        enabled
    }

    /// The parts that run, by what they need of each cluster.
    pub fn features(&self) -> Features {
        let optional = self.optional_controllers();
        Features {
            services: optional.services,
            volumes: optional.volumes,
            node_lease: self.enable_node_lease,
            access_reviews: !self.no_verify_clients,
            token_reviews: self.authentication_token_webhook,
            leader_election: self.leader_elect.then(|| {
                // Leaked: computed a few times per process, at start only.
                &*crate::leader::lease_namespace(self.leader_elect_resource_namespace.as_deref())
                    .leak()
            }),
            members: self
                .members_namespace
                .as_ref()
                .map(|ns| &*ns.clone().leak()),
            upper_identity: self.upper_identity,
            namespaces: self.lower_namespace != crate::translate::namespace::Mode::Same,
            kueue_quota: self.kueue_quota.is_some(),
        }
    }

    /// `--kueue-quota`, if given; `Err` when there is no node it could follow: it keeps the
    /// quota of the single-cluster flags' one node (`--client-kubeconfig`, `cluster`
    /// granularity).
    pub fn kueue_quota_target(
        &self,
    ) -> Result<Option<&crate::translate::kueue_quota::QuotaTarget>, String> {
        let Some(target) = &self.kueue_quota else {
            return Ok(None);
        };
        if self.client_kubeconfig.is_none() {
            return Err(format!(
                "--kueue-quota={target} follows the node of --nodename and \
                 --client-kubeconfig (not member Secrets' nodes): give --client-kubeconfig"
            ));
        }
        if self.node_granularity != crate::node::groups::Granularity::Cluster {
            return Err(format!(
                "--kueue-quota={target} follows the one node of --node-granularity=cluster, \
                 not a node per lower node or label"
            ));
        }
        Ok(Some(target))
    }

    /// `--upper-identity` with its address and renewal bound; `Err` when the mode is on
    /// without a usable `--upper-api-address` (never guessed).
    pub fn upper_identity(
        &self,
    ) -> Result<Option<crate::controllers::token::UpperIdentity>, String> {
        if !self.upper_identity {
            return Ok(None);
        }
        let address = self.upper_api_address.as_deref().ok_or(
            "--upper-identity needs --upper-api-address: the IP:PORT at which pods in the \
             lower cluster reach the upper API server",
        )?;
        let api = address
            .parse()
            .map_err(|e| format!("--upper-api-address: {e}"))?;
        Ok(Some(crate::controllers::token::UpperIdentity {
            api,
            max_age: self.upper_token_max_age,
        }))
    }

    /// The leader-election Lease and timings, when `--leader-elect`; `Err` names the flags
    /// whose timings do not nest (lease duration > renew deadline > retry period), which
    /// would let a leader lose the Lease while still writing.
    pub fn lease_config(&self) -> Result<Option<crate::leader::LeaseConfig>, String> {
        if !self.leader_elect {
            return Ok(None);
        }
        let name = self
            .leader_elect_resource_name
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| format!("tensile-virtual-node-{}", self.nodename));
        let namespace =
            crate::leader::lease_namespace(self.leader_elect_resource_namespace.as_deref());
        let identity = crate::leader::identity(self.leader_elect_identity.as_deref());
        let config = crate::leader::LeaseConfig {
            lease_duration: self.leader_elect_lease_duration,
            renew_deadline: self.leader_elect_renew_deadline,
            retry_period: self.leader_elect_retry_period,
            ..crate::leader::LeaseConfig::new(&namespace, &name, &identity)
        };
        config.check_timings()?;
        Ok(Some(config))
    }
}

/// The longest duration any flag accepts (a year): a longer one is a typo, and would
/// overflow the clock arithmetic of the timers it sets.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

/// The shortest period of anything repeated (a resync, a renewal, a reload): a shorter
/// one would only spin.
pub const MIN_PERIOD: Duration = Duration::from_secs(1);

/// The shortest leader-election timing accepted: client-go's are seconds, and tests run
/// elections in fractions of one.
const MIN_LEASE_TIMING: Duration = Duration::from_millis(100);

/// A value parser for a duration flag that must lie within `min..=max`.
pub fn duration_in(
    min: Duration,
    max: Duration,
) -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync + 'static {
    move |text| {
        let duration = parse_duration(text)?;
        if duration < min {
            Err(format!("must be at least {}", format_duration(min)))
        } else if duration > max {
            Err(format!("must be at most {}", format_duration(max)))
        } else {
            Ok(duration)
        }
    }
}

/// A period: how often something is repeated, [`MIN_PERIOD`] to [`MAX_DURATION`].
pub fn parse_period(text: &str) -> Result<Duration, String> {
    duration_in(MIN_PERIOD, MAX_DURATION)(text)
}

/// A cache lifetime: 0 (no caching) to [`MAX_DURATION`].
pub fn parse_ttl(text: &str) -> Result<Duration, String> {
    duration_in(Duration::ZERO, MAX_DURATION)(text)
}

/// client-go's requests per second where a client's is 0 (`rest.DefaultQPS`).
pub const CLIENT_GO_DEFAULT_QPS: f64 = 5.0;
/// client-go's burst where a client's is 0 (`rest.DefaultBurst`).
pub const CLIENT_GO_DEFAULT_BURST: u32 = 10;
/// The fewest requests per second a limit may allow (one every 100 s): fewer would leave
/// the node unable to keep its Lease, and the limiter's window (burst / qps) beyond what a
/// timer can be set to.
pub const MIN_QPS: f64 = 0.01;

/// Requests per second (`--client-qps`, `--kube-api-qps`), read as client-go reads
/// `rest.Config.QPS` so that tensile-kube's values keep their meaning: 0 is client-go's
/// default ([`CLIENT_GO_DEFAULT_QPS`]), a negative number means no limit (answered as
/// infinity), a positive one must be at least [`MIN_QPS`]; not a number, or not finite, is
/// refused.
pub fn parse_qps(text: &str) -> Result<f64, String> {
    let qps: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("invalid number {text:?}"))?;
    if !qps.is_finite() {
        return Err(format!(
            "{text:?}: must be a finite number (0: client-go's default {CLIENT_GO_DEFAULT_QPS}, \
             negative: no limit, else at least {MIN_QPS})"
        ));
    }
    if qps == 0.0 {
        Ok(CLIENT_GO_DEFAULT_QPS)
    } else if qps < 0.0 {
        Ok(f64::INFINITY)
    } else if qps < MIN_QPS {
        Err(format!(
            "{text}: must be at least {MIN_QPS} requests per second (0: client-go's default \
             {CLIENT_GO_DEFAULT_QPS}, negative: no limit)"
        ))
    } else {
        Ok(qps)
    }
}

/// A burst (`--client-burst`, `--kube-api-burst`), read as client-go reads
/// `rest.Config.Burst`: 0 is client-go's default ([`CLIENT_GO_DEFAULT_BURST`]); negative,
/// which makes client-go fail every request, is refused.
pub fn parse_burst(text: &str) -> Result<u32, String> {
    let burst: i64 = text
        .trim()
        .parse()
        .map_err(|_| format!("invalid whole number {text:?}"))?;
    match burst {
        0 => Ok(CLIENT_GO_DEFAULT_BURST),
        b if b < 0 => Err(format!(
            "{text}: must be 0 (client-go's default {CLIENT_GO_DEFAULT_BURST}) or more"
        )),
        b => u32::try_from(b).map_err(|_| format!("{text}: must be at most {}", u32::MAX)),
    }
}

/// Parses `P` from `argv`. Bad usage is reported as Go's flag package does: one line on
/// stderr naming the flag, exit status 2, so that a supervisor's log shows exactly what is
/// wrong. `--help` and `--version` print and exit 0. `Err` is the status to exit with now.
pub fn parse_args<P: Parser>(
    program: &str,
    argv: impl IntoIterator<Item = impl Into<OsString> + Clone>,
) -> Result<P, ExitCode> {
    P::try_parse_from(argv).map_err(|error| usage_exit(program, &error))
}

/// Reports `error` (from clap) as [`parse_args`] does and returns the status to exit with.
pub fn usage_exit(program: &str, error: &clap::Error) -> ExitCode {
    if !error.use_stderr() {
        let _ = error.print();
        return ExitCode::SUCCESS;
    }
    eprintln!("{program}: {}", one_line(error));
    ExitCode::from(USAGE_ERROR)
}

/// The exit status of bad usage (Go's `flag` package, and clap's own).
pub const USAGE_ERROR: u8 = 2;

/// clap's message on one line: without the usage, the hints and the `error:` prefix.
pub fn one_line(error: &clap::Error) -> String {
    let rendered = error.to_string();
    let line = rendered
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty() && !l.starts_with("tip:"))
        .collect::<Vec<_>>()
        .join(" ");
    line.trim_start_matches("error: ").to_owned()
}

/// klog's flags that take a value (`--v=5`, `-v 5`, `--klog.v=5`), in Go's spelling;
/// `-` and `_` are the same (descheduler normalises them), and
/// `log-flush-frequency` comes from Kubernetes' component-base.
const KLOG_WITH_VALUE: [&str; 8] = [
    "v",
    "vmodule",
    "log_dir",
    "log_file",
    "log_file_max_size",
    "stderrthreshold",
    "log_backtrace_at",
    "log_flush_frequency",
];

/// klog's boolean flags: `--flag`, `--flag=true`, `--flag=false` (Go never takes a
/// boolean from the next argument).
const KLOG_SWITCHES: [&str; 6] = [
    "logtostderr",
    "alsologtostderr",
    "skip_headers",
    "skip_log_headers",
    "add_dir_header",
    "one_output",
];

/// Splits klog's flags off `argv`, in every form tensile-kube's binaries take them:
/// virtual-node's `--klog.v=5` (klog under a `klog.` prefix), the webhook's and
/// descheduler's `--v=6`, `-v 6`, `--logtostderr`, `--log_dir=/x` or `--log-dir /x`.
/// tensile logs through tracing (`--log-level`), so they are returned as given, to be
/// reported as ignored. Arguments after `--` are kept as they are.
pub fn strip_klog_flags(
    argv: impl IntoIterator<Item = impl Into<OsString>>,
) -> (Vec<OsString>, Vec<String>) {
    let mut kept = Vec::new();
    let mut ignored: Vec<String> = Vec::new();
    let mut iter = argv.into_iter().map(Into::into).peekable();
    kept.extend(iter.next());
    while let Some(arg) = iter.next() {
        let Some(text) = arg.to_str() else {
            kept.push(arg);
            continue;
        };
        if text == "--" {
            kept.push(arg);
            kept.extend(iter);
            break;
        }
        let Some(flag) = text.strip_prefix("--").or_else(|| text.strip_prefix('-')) else {
            kept.push(arg);
            continue;
        };
        let (name, has_value) = match flag.split_once('=') {
            Some((name, _)) => (name, true),
            None => (flag, false),
        };
        let name = name.strip_prefix("klog.").unwrap_or(name).replace('-', "_");
        if KLOG_SWITCHES.contains(&name.as_str()) {
            ignored.push(text.to_owned());
        } else if KLOG_WITH_VALUE.contains(&name.as_str()) {
            let mut given = text.to_owned();
            if !has_value
                && let Some(value) = iter.next_if(|next| {
                    next.to_str()
                        .is_some_and(|v| !v.starts_with("--") && v != "-")
                })
            {
                given.push(' ');
                given.push_str(&value.to_string_lossy());
            }
            ignored.push(given);
        } else if flag.starts_with("klog.") {
            // A klog flag of a later klog than tensile-kube's: ignored all the same.
            ignored.push(text.to_owned());
        } else {
            kept.push(arg);
        }
    }
    (kept, ignored)
}

/// A command that Go's cobra binaries of tensile-kube take as the first argument
/// (`virtual-node version`, `descheduler version`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompatCommand {
    /// Print the version and exit.
    Version,
    /// Print the providers (virtual-node: `k8s`) and exit.
    Providers,
}

/// The command `argv` asks for instead of running, if any: `version`, or, where
/// `providers` is true, `providers`.
pub fn compat_command(argv: &[OsString], providers: bool) -> Option<CompatCommand> {
    match argv.get(1).and_then(|a| a.to_str()) {
        Some("version") => Some(CompatCommand::Version),
        Some("providers") if providers => Some(CompatCommand::Providers),
        _ => None,
    }
}

/// A node name that is also a valid label value (ownership marks carry it): at most 63
/// characters of `a-z`, `0-9`, `-` and `.`, starting and ending alphanumeric.
pub fn parse_node_name(name: &str) -> Result<String, String> {
    let valid = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    if valid {
        Ok(name.to_owned())
    } else {
        Err("must be a DNS name of at most 63 characters (it is also a label value)".into())
    }
}

/// A label value: at most 63 characters, alphanumerics, `-`, `_` and `.`, beginning and
/// ending with an alphanumeric.
pub fn parse_label_value(value: &str) -> Result<String, String> {
    let valid = !value.is_empty()
        && value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && value.starts_with(|c: char| c.is_ascii_alphanumeric())
        && value.ends_with(|c: char| c.is_ascii_alphanumeric());
    if valid {
        Ok(value.to_owned())
    } else {
        Err("must be a label value: at most 63 alphanumerics, '-', '_' or '.', alphanumeric at both ends".into())
    }
}

/// `host:port`, or `:port` for all interfaces (Go's form).
pub fn parse_addr(text: &str) -> Result<SocketAddr, String> {
    let full = match text.strip_prefix(':') {
        Some(port) => format!("0.0.0.0:{port}"),
        None => text.to_owned(),
    };
    full.parse()
        .map_err(|e| format!("invalid address {text:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leader_election_flags() {
        let base = [
            "virtual-node",
            "--nodename=vk-1",
            "--client-kubeconfig=lower",
            "--leader-elect-resource-namespace=tensile-system",
            "--leader-elect-identity=pod-a",
        ];
        // (extra flags, Ok((lease name, lease/renew/retry in ms)) or Err(part of the message))
        type Want = Result<Option<(&'static str, [u128; 3])>, &'static str>;
        let cases: [(&[&str], Want); 7] = [
            (&[], Ok(None)),
            (
                &["--leader-elect"],
                Ok(Some(("tensile-virtual-node-vk-1", [10_000, 7_000, 2_000]))),
            ),
            (
                &["--leader-elect=true", "--leader-elect-resource-name=mine"],
                Ok(Some(("mine", [10_000, 7_000, 2_000]))),
            ),
            (
                &[
                    "--leader-elect",
                    "--leader-elect-lease-duration=4s",
                    "--leader-elect-renew-deadline=3s",
                    "--leader-elect-retry-period=500ms",
                ],
                Ok(Some(("tensile-virtual-node-vk-1", [4_000, 3_000, 500]))),
            ),
            (
                &["--leader-elect", "--leader-elect-renew-deadline=10s"],
                Err("--leader-elect-lease-duration (10s) must be longer"),
            ),
            (
                &["--leader-elect", "--leader-elect-retry-period=7s"],
                Err("--leader-elect-renew-deadline (7s) must be longer"),
            ),
            (
                &[
                    "--leader-elect",
                    "--leader-elect-lease-duration=1s",
                    "--leader-elect-renew-deadline=600ms",
                    "--leader-elect-retry-period=200ms",
                ],
                Ok(Some(("tensile-virtual-node-vk-1", [1_000, 600, 200]))),
            ),
        ];
        for (extra, want) in cases {
            let argv = base.iter().chain(extra.iter());
            let args = Args::try_parse_from(argv).unwrap();
            let got = args.lease_config();
            match (got, want) {
                (Ok(None), Ok(None)) => {}
                (Ok(Some(config)), Ok(Some((name, timings)))) => {
                    assert_eq!(config.name, name, "{extra:?}");
                    assert_eq!(config.namespace, "tensile-system", "{extra:?}");
                    assert_eq!(config.identity, "pod-a", "{extra:?}");
                    let got = [
                        config.lease_duration,
                        config.renew_deadline,
                        config.retry_period,
                    ]
                    .map(|d| d.as_millis());
                    assert_eq!(got, timings, "{extra:?}");
                    assert_eq!(
                        args.features().leader_election,
                        Some("tensile-system"),
                        "{extra:?}"
                    );
                }
                (Err(got), Err(want)) => assert!(got.contains(want), "{extra:?}: {got}"),
                (got, want) => panic!("{extra:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn durations_in_range() {
        type Parse = fn(&str) -> Result<Duration, String>;
        let cases: [(&str, Parse, Result<u64, &str>); 8] = [
            ("0", parse_period, Err("at least 1s")),
            ("0s", parse_period, Err("at least 1s")),
            ("999ms", parse_period, Err("at least 1s")),
            ("1s", parse_period, Ok(1)),
            ("8760h", parse_period, Ok(31_536_000)),
            ("8761h", parse_period, Err("at most 8760h0m0s")),
            ("0", parse_ttl, Ok(0)),
            ("10000000h", parse_ttl, Err("at most 8760h0m0s")),
        ];
        for (text, parse, want) in cases {
            match (parse(text), want) {
                (Ok(got), Ok(secs)) => assert_eq!(got.as_secs(), secs, "{text:?}"),
                (Err(got), Err(want)) => assert!(got.contains(want), "{text:?}: {got}"),
                (got, want) => panic!("{text:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn qps() {
        let cases = [
            ("500", Some(500.0)),
            ("0.5", Some(0.5)),
            ("0.01", Some(0.01)),
            // tensile-kube's values, as client-go reads them: 0 its default, below 0 none.
            ("0", Some(CLIENT_GO_DEFAULT_QPS)),
            ("-1", Some(f64::INFINITY)),
            ("-0.5", Some(f64::INFINITY)),
            // A window of burst / qps seconds no timer can be set to (it panicked).
            ("1e-30", None),
            ("0.009", None),
            ("5e-324", None),
            ("NaN", None),
            ("inf", None),
            ("-inf", None),
            ("fast", None),
            ("", None),
        ];
        for (text, want) in cases {
            assert_eq!(parse_qps(text).ok(), want, "{text:?}");
        }
        let error = parse_qps("1e-30").unwrap_err();
        assert!(error.contains("at least 0.01"), "{error}");
    }

    #[test]
    fn reserved_lower_namespaces() {
        let args = Args::try_parse_from([
            "virtual-node",
            "--client-kubeconfig",
            "k",
            "--reserved-lower-namespaces=infra, vault,",
        ])
        .unwrap();
        let reserved =
            crate::translate::namespace::Reserved::new(args.reserved_lower_namespaces.clone());
        for name in ["infra", "vault", "kube-system", "tensile-system"] {
            assert!(reserved.contains(name), "{name}");
        }
        assert!(!reserved.contains("shop"));
        assert!(
            Args::try_parse_from([
                "virtual-node",
                "--client-kubeconfig",
                "k",
                "--reserved-lower-namespaces=Not_A_Name",
            ])
            .is_err()
        );
    }

    #[test]
    fn burst() {
        let cases = [
            ("1000", Some(1000)),
            ("1", Some(1)),
            ("0", Some(CLIENT_GO_DEFAULT_BURST)),
            ("4294967295", Some(u32::MAX)),
            ("4294967296", None),
            ("-1", None),
            ("1.5", None),
            ("many", None),
        ];
        for (text, want) in cases {
            assert_eq!(parse_burst(text).ok(), want, "{text:?}");
        }
    }

    /// Every value a flag accepts makes a rate limit that does not panic.
    #[test]
    fn accepted_rates_make_a_limiter() {
        for qps in ["0", "-1", "0.01", "1", "500", "1e300"] {
            for burst in ["0", "1", "1000", "4294967295"] {
                let args = Args::try_parse_from([
                    "virtual-node",
                    "--client-kubeconfig",
                    "k",
                    &format!("--client-qps={qps}"),
                    &format!("--client-burst={burst}"),
                    "--kube-api-qps",
                    qps,
                    "--kube-api-burst",
                    burst,
                ])
                .unwrap_or_else(|e| panic!("{qps} {burst}: {e}"));
                for (qps, burst) in [
                    (args.client_qps, args.client_burst),
                    (args.kube_api_qps, args.kube_api_burst),
                ] {
                    let _ = crate::clusters::RateLimit { qps, burst }.window();
                }
            }
        }
    }

    /// Flags whose value makes no sense are refused at parse time, naming the flag.
    #[test]
    fn nonsensical_values_are_refused_naming_the_flag() {
        let cases = [
            "--full-resync-period=0",
            "--full-resync-period=0s",
            "--full-resync-period=1ns",
            "--full-resync-period=100000h",
            "--full-resync-period=-1m",
            "--pod-sync-workers=0",
            "--pod-sync-workers=-1",
            "--client-qps=1e-30",
            "--client-qps=0.001",
            "--kube-api-qps=1e-30",
            "--kube-api-qps=NaN",
            "--client-burst=-1",
            "--kube-api-burst=-5",
            "--authorization-webhook-cache-authorized-ttl=-1s",
            "--authorization-webhook-cache-unauthorized-ttl=forever",
            // Written to the Lease in whole seconds.
            "--leader-elect-lease-duration=999ms",
            "--leader-elect-lease-duration=0",
        ];
        for case in cases {
            let flag = case.split('=').next().unwrap();
            let error = Args::try_parse_from(["virtual-node", "--client-kubeconfig", "k", case])
                .expect_err(case);
            let line = one_line(&error);
            assert!(line.contains(flag), "{case}: {line}");
            assert!(!line.contains('\n'), "{case}: {line}");
        }
        let fine = Args::try_parse_from([
            "virtual-node",
            "--client-kubeconfig",
            "k",
            "--full-resync-period=1m0s",
            "--status-sync-workers=0",
            "--authorization-webhook-cache-authorized-ttl=0",
            "--client-qps=0.5",
            // tensile-kube's int flags and node-cli's float ones, as client-go reads them.
            "--kube-api-qps=0",
            "--client-burst=0",
            "--kube-api-burst=-0",
        ])
        .unwrap();
        assert_eq!(fine.full_resync_period, Duration::from_secs(60));
        assert_eq!(fine.client_qps, 0.5);
        assert_eq!(fine.kube_api_qps, CLIENT_GO_DEFAULT_QPS);
        assert_eq!(fine.client_burst, CLIENT_GO_DEFAULT_BURST);
        assert_eq!(fine.kube_api_burst, CLIENT_GO_DEFAULT_BURST);
        let unlimited = Args::try_parse_from([
            "virtual-node",
            "--client-kubeconfig",
            "k",
            "--client-qps",
            "-1",
        ])
        .unwrap();
        assert!(unlimited.client_qps.is_infinite());
    }

    /// Every granularity runs, and its help says so; `--lower-node-labels` refuses a bare
    /// `*` at parsing with an error that says why.
    #[test]
    fn granularity_flags_parse_and_say_what_runs() {
        use crate::node::groups::Granularity;
        let parse = |extra: &[&str]| {
            let mut argv = vec!["virtual-node", "--client-kubeconfig", "k"];
            argv.extend_from_slice(extra);
            Args::try_parse_from(argv)
        };
        let cases: [(&[&str], Granularity); 3] = [
            (&[], Granularity::Cluster),
            (&["--node-granularity", "node"], Granularity::Node),
            (
                &["--node-granularity", "label=topology.kubernetes.io/zone"],
                Granularity::Label("topology.kubernetes.io/zone".into()),
            ),
        ];
        for (extra, want) in cases {
            assert_eq!(parse(extra).unwrap().node_granularity, want, "{extra:?}");
        }
        for every in ["*", "example.com/pool,*"] {
            let error = parse(&["--lower-node-labels", every]).expect_err(every);
            let line = one_line(&error);
            assert!(
                line.contains("--lower-node-labels") && line.contains("every lower node label"),
                "{every}: {line}"
            );
        }
        assert!(parse(&["--lower-node-labels", "example.com/*"]).is_ok());
        let help = <Args as clap::CommandFactory>::command()
            .render_long_help()
            .to_string();
        let granularity = help
            .split("--node-granularity")
            .nth(1)
            .and_then(|rest| rest.split("\n      --").next())
            .unwrap_or_default();
        assert!(granularity.contains("label=<key>"), "{granularity}");
        assert!(!granularity.contains("so far"), "{granularity}");
    }

    #[test]
    fn kueue_quota_follows_the_flags_node_only() {
        // (flags, Ok(Some("CLUSTERQUEUE/FLAVOR")) or Err(part of the message))
        type Want = Result<Option<&'static str>, &'static str>;
        let cases: [(&[&str], Want); 6] = [
            (&["--client-kubeconfig=k"], Ok(None)),
            (
                &["--client-kubeconfig=k", "--kueue-quota=cluster-queue/burst"],
                Ok(Some("cluster-queue/burst")),
            ),
            (
                &["--members-namespace=m", "--kueue-quota=cq/burst"],
                Err("give --client-kubeconfig"),
            ),
            (
                &[
                    "--client-kubeconfig=k",
                    "--node-granularity=node",
                    "--kueue-quota=cq/burst",
                ],
                Err("--node-granularity=cluster"),
            ),
            (
                &["--client-kubeconfig=k", "--kueue-quota=cq"],
                Err("must be CLUSTERQUEUE/FLAVOR"),
            ),
            (
                &["--client-kubeconfig=k", "--kueue-quota=cq/Burst"],
                Err("not a DNS subdomain name"),
            ),
        ];
        for (flags, want) in cases {
            let argv = std::iter::once("virtual-node").chain(flags.iter().copied());
            let got = Args::try_parse_from(argv)
                .map_err(|e| one_line(&e))
                .and_then(|args| {
                    let target = args.kueue_quota_target()?.map(ToString::to_string);
                    assert_eq!(args.features().kueue_quota, target.is_some(), "{flags:?}");
                    Ok(target)
                });
            match (got, want) {
                (Ok(got), Ok(want)) => assert_eq!(got.as_deref(), want, "{flags:?}"),
                (Err(got), Err(want)) => assert!(got.contains(want), "{flags:?}: {got}"),
                (got, want) => panic!("{flags:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn usage_errors_fit_on_one_line() {
        let cases = [
            (vec!["virtual-node"], "--client-kubeconfig"),
            (
                vec!["virtual-node", "--client-kubeconfig", "k", "--no-such-flag"],
                "--no-such-flag",
            ),
            (
                vec![
                    "virtual-node",
                    "--client-kubeconfig",
                    "k",
                    "--kubelet-port=x",
                ],
                "--kubelet-port",
            ),
        ];
        for (argv, flag) in cases {
            let error = Args::try_parse_from(&argv).expect_err(flag);
            let line = one_line(&error);
            assert!(line.contains(flag), "{argv:?}: {line}");
            assert!(!line.starts_with("error"), "{line}");
            assert!(
                !line.contains("Usage") && !line.contains("--help"),
                "{line}"
            );
        }
    }

    #[test]
    fn node_names() {
        let cases = [
            ("vk-node", true),
            ("vk.node-1", true),
            ("a", true),
            ("", false),
            ("VK", false),
            ("-vk", false),
            ("vk-", false),
            ("vk_node", false),
            (&"a".repeat(63), true),
            (&"a".repeat(64), false),
        ];
        for (name, valid) in cases {
            assert_eq!(parse_node_name(name).is_ok(), valid, "{name:?}");
        }
    }

    #[test]
    fn label_values() {
        let cases = [
            ("0a4b4d1e-5f3c-4b6e-9d1a-2c3b4d5e6f70", true),
            ("Prod_EU.1", true),
            ("", false),
            ("-a", false),
            ("a/b", false),
            (&"a".repeat(63), true),
            (&"a".repeat(64), false),
        ];
        for (value, valid) in cases {
            assert_eq!(parse_label_value(value).is_ok(), valid, "{value:?}");
        }
    }

    #[test]
    fn addresses() {
        assert_eq!(parse_addr(":10255").unwrap().to_string(), "0.0.0.0:10255");
        assert_eq!(
            parse_addr("127.0.0.1:9").unwrap().to_string(),
            "127.0.0.1:9"
        );
        assert!(parse_addr("nope").is_err());
    }

    #[test]
    fn tensile_kube_command_line_parses() {
        let args = Args::try_parse_from([
            "virtual-node",
            "--nodename",
            "vk-node",
            "--kubeconfig",
            "./config",
            "--client-kubeconfig",
            "/root/.kube/config",
            "--enable-serviceaccount=false",
            "--disable-taint",
            "--enable-controllers=",
            "--ignore-labels=a,b",
            "--full-resync-period=30s",
        ])
        .unwrap();
        assert_eq!(args.nodename, "vk-node");
        assert!(!args.enable_serviceaccount);
        assert!(args.disable_taint);
        assert_eq!(args.ignore_labels, ["a", "b"]);
        assert_eq!(args.full_resync_period, Duration::from_secs(30));
        assert_eq!(args.metrics_addr.port(), 10255);
        assert!(args.enable_node_lease);
        assert_eq!(args.optional_controllers(), OptionalControllers::default());
    }

    #[test]
    fn optional_controllers() {
        let parse = |flag: Option<&str>| {
            let mut argv = vec!["virtual-node", "--client-kubeconfig", "k"];
            argv.extend(flag);
            Args::try_parse_from(argv).unwrap().optional_controllers()
        };
        let both = OptionalControllers {
            volumes: true,
            services: true,
            unknown: vec![],
        };
        assert_eq!(parse(None), both, "both by default");
        assert_eq!(
            parse(Some("--enable-controllers=")),
            OptionalControllers::default()
        );
        assert_eq!(
            parse(Some("--enable-controllers=ServiceControllers")),
            OptionalControllers {
                services: true,
                ..OptionalControllers::default()
            }
        );
        assert_eq!(
            parse(Some("--enable-controllers=pvcontrollers, Nope")),
            OptionalControllers {
                volumes: true,
                services: false,
                unknown: vec!["Nope".into()],
            }
        );
    }

    /// Every flag tensile-kube's virtual-node takes (node-cli's root flags, its logrus
    /// `--log-level`, klog's under `klog.`, tensile-kube's own client flags), each with a
    /// value as its `--help` or manifests give it. A flag missing here, or refused, fails.
    const TENSILE_KUBE_NODE_FLAGS: &[&str] = &[
        "--kubeconfig=/root/.kube/config",
        "--namespace=default",
        "--cluster-domain=cluster.local",
        "--nodename=vk-node",
        "--os=Linux",
        "--provider=k8s",
        "--provider-config=/etc/vk/provider.toml",
        "--metrics-addr=:10255",
        "--taint=virtual-kubelet.io/provider",
        "--disable-taint",
        "--disable-taint=true",
        "--disable-taint=false",
        "--pod-sync-workers=10",
        "--enable-node-lease",
        "--enable-node-lease=false",
        "--full-resync-period=1m0s",
        "--full-resync-period=1h30m",
        "--startup-timeout=0s",
        "--startup-timeout=2m0s",
        "--kube-api-qps=500",
        "--kube-api-burst=1000",
        "--client-verify-ca=/ca.crt",
        "--no-verify-clients",
        "--no-verify-clients=false",
        "--authentication-token-webhook",
        "--authentication-token-webhook=true",
        "--authentication-token-webhook-cache-ttl=2m0s",
        "--authorization-webhook-cache-authorized-ttl=5m0s",
        "--authorization-webhook-cache-unauthorized-ttl=30s",
        "--log-level=debug",
        "--client-burst=1000",
        "--client-qps=500",
        "--client-kubeconfig=/root/kube.config",
        "--ignore-labels=pod-group.scheduling.sigs.k8s.io",
        "--enable-controllers=PVControllers,ServiceControllers",
        "--enable-serviceaccount",
        "--enable-serviceaccount=false",
        "--klog.add_dir_header",
        "--klog.alsologtostderr=true",
        "--klog.log_backtrace_at=main.go:10",
        "--klog.log_dir=/var/log",
        "--klog.log_file=/var/log/vk.log",
        "--klog.log_file_max_size=1800",
        "--klog.logtostderr=false",
        "--klog.skip_headers",
        "--klog.skip_log_headers=true",
        "--klog.stderrthreshold=2",
        "--klog.v=5",
        "--klog.vmodule=pod=4",
        "-v=5",
        "--log-format=json",
    ];

    /// The args of tensile-kube's `manifeasts/virtual-node.yaml`, `$(VAR)` expanded.
    const TENSILE_KUBE_NODE_MANIFEST: &[&str] = &[
        "--provider=k8s",
        "--nodename=vk-node",
        "--disable-taint=true",
        "--kube-api-qps=500",
        "--kube-api-burst=1000",
        "--client-qps=500",
        "--client-burst=1000",
        "--client-kubeconfig=/root/kube.config",
        "--klog.v=5",
        "--log-level=debug",
        "--metrics-addr=:10455",
    ];

    fn parse_node(flags: &[&str]) -> (Result<Args, clap::Error>, Vec<String>) {
        let argv = ["virtual-node", "--client-kubeconfig", "k"]
            .iter()
            .chain(flags)
            .copied();
        let (kept, klog) = strip_klog_flags(argv);
        (Args::try_parse_from(kept), klog)
    }

    #[test]
    fn every_tensile_kube_node_flag_is_accepted_alone() {
        for flag in TENSILE_KUBE_NODE_FLAGS {
            let (args, _) = parse_node(&[flag]);
            if let Err(error) = args {
                panic!("{flag}: {}", one_line(&error));
            }
        }
    }

    /// What tensile does not use is reported, as given; what it uses is not.
    #[test]
    fn ignored_node_flags_are_named() {
        let cases: [(&[&str], &[&str]); 6] = [
            (&["--provider=k8s"], &["--provider=k8s"]),
            (&["--provider", "k8s"], &["--provider=k8s"]),
            (&["--provider-config=/p"], &["--provider-config=/p"]),
            (
                &["--cluster-domain=cluster.local"],
                &["--cluster-domain=cluster.local"],
            ),
            (
                &["--klog.v=5", "-v", "4", "--klog.logtostderr"],
                &["--klog.v=5", "-v 4", "--klog.logtostderr"],
            ),
            (
                &["--nodename=vk", "--startup-timeout=1m0s", "--taint=k"],
                &[],
            ),
        ];
        for (flags, want) in cases {
            let (args, klog) = parse_node(flags);
            let mut ignored = args.unwrap().ignored_flags();
            ignored.extend(klog);
            assert_eq!(ignored, want, "{flags:?}");
        }
    }

    #[test]
    fn tensile_kube_node_manifest_parses() {
        let (args, klog) = parse_node(TENSILE_KUBE_NODE_MANIFEST);
        let args = args.unwrap();
        assert_eq!(args.nodename, "vk-node");
        assert!(args.disable_taint);
        assert_eq!(
            args.client_kubeconfig,
            Some(PathBuf::from("/root/kube.config"))
        );
        assert_eq!(args.metrics_addr.port(), 10455);
        assert_eq!(args.log_level, "debug");
        assert_eq!(args.ignored_flags(), ["--provider=k8s"]);
        assert_eq!(klog, ["--klog.v=5"]);
    }

    /// Go's flags: the last of a repeated flag wins; `--taint` is the taint key.
    #[test]
    fn go_flag_habits() {
        let (args, _) = parse_node(&["--nodename=a", "--nodename=b", "--taint=example.com/burst"]);
        let args = args.unwrap();
        assert_eq!(args.nodename, "b");
        assert_eq!(args.taint_key, "example.com/burst");
        let (args, _) = parse_node(&["--log-format=json"]);
        assert_eq!(args.unwrap().log_format, LogFormat::Json);
        let (args, _) = parse_node(&[]);
        assert_eq!(args.unwrap().log_format, LogFormat::Text);
        let (args, _) = parse_node(&["--log-format=xml"]);
        assert!(args.is_err());
    }

    #[test]
    fn klog_flags_are_split_off() {
        let cases: [(&[&str], &[&str], &[&str]); 8] = [
            (&["--v=6"], &[], &["--v=6"]),
            (&["-v", "6", "--port=1"], &["--port=1"], &["-v 6"]),
            (&["-v=6"], &[], &["-v=6"]),
            (
                &["--log_dir", "/x", "--log-dir=/y"],
                &[],
                &["--log_dir /x", "--log-dir=/y"],
            ),
            (
                &["--log-flush-frequency", "5s", "--a"],
                &["--a"],
                &["--log-flush-frequency 5s"],
            ),
            (&["--klog.future_flag=1"], &[], &["--klog.future_flag=1"]),
            (&["--logtostderr", "pos"], &["pos"], &["--logtostderr"]),
            (&["--", "-v=1"], &["--", "-v=1"], &[]),
        ];
        for (argv, kept, ignored) in cases {
            let (got_kept, got_ignored) =
                strip_klog_flags(std::iter::once("p").chain(argv.iter().copied()));
            let got_kept: Vec<_> = got_kept
                .iter()
                .skip(1)
                .map(|a| a.to_str().unwrap())
                .collect();
            assert_eq!(got_kept, kept, "{argv:?}");
            assert_eq!(got_ignored, ignored, "{argv:?}");
        }
    }

    #[test]
    fn compat_commands() {
        let argv = |args: &[&str]| -> Vec<OsString> {
            std::iter::once("p")
                .chain(args.iter().copied())
                .map(OsString::from)
                .collect()
        };
        let cases: [(&[&str], bool, Option<CompatCommand>); 5] = [
            (&["version"], true, Some(CompatCommand::Version)),
            (&["version"], false, Some(CompatCommand::Version)),
            (&["providers"], true, Some(CompatCommand::Providers)),
            (&["providers"], false, None),
            (&["--nodename", "version"], true, None),
        ];
        for (args, providers, want) in cases {
            assert_eq!(compat_command(&argv(args), providers), want, "{args:?}");
        }
    }
}
