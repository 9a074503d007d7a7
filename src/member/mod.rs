//! A member: one lower cluster joined to the upper one as one virtual node (or, of `node`
//! or `label=<key>` granularity, one per group of lower nodes: [`fleet`]), with its lower
//! client, watches, controllers, node keep-alive and kubelet API. [`run`] is its one entry
//! point: `main` runs the member of the single-cluster flags (`--nodename`,
//! `--client-kubeconfig`), and the [`membership`] controller those of member Secrets
//! (`--members-namespace`), each as many times as it is (re)started. What every member
//! shares — the upper client, the upper cluster's identity, the flags, the metrics and the
//! leader election — is built once, in [`Shared`].

pub mod fleet;
pub mod join;
pub mod leave;
pub mod membership;
pub mod names;
pub mod spec;
pub mod uninstall;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use k8s_openapi::api::core::v1::{Node, ObjectReference, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, ListParams};
use kube::runtime::events::{Recorder, Reporter};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

use crate::cli::{Args, OptionalControllers};
use crate::clusters::{self, Cluster, RateLimit};
use crate::controllers::{self, Context};
use crate::kubelet_api;
use crate::lower_view::NamespaceView;
use crate::metrics::Metrics;
use crate::node::burst::Burst;
use crate::node::groups::{Granularity, LabelPatterns};
use crate::node::owner::NodeOwner;
use crate::node::{self, spec::NodeConfig};
use crate::shutdown::Tasks;
use crate::side::Side;
use crate::translate::meta::Owner;
use crate::translate::namespace::{Mapping, Mode, Reserved, cluster_suffix};
use crate::upper_watches::UpperWatches;

/// The lower capacity as last computed; `None` until the lower watches have listed.
type Capacity = Option<BTreeMap<String, Quantity>>;

/// What every member of the process shares, built once.
pub struct Shared {
    /// The flags; a member reads those that are not its own (workers, resync, controllers,
    /// kubelet API certificates and caches, ...).
    pub args: Args,
    /// The upper cluster.
    pub upper: Cluster,
    /// The upper cluster's identity, marked on every lower object with the node's name.
    pub cluster_id: String,
    /// Counters of the process (every member's together).
    pub metrics: Arc<Metrics>,
    /// The CA kubelet API client certificates must chain to (`None`: any, with
    /// `--no-verify-clients`).
    pub client_ca: Option<Vec<u8>>,
    /// With `--leader-elect`, whether this process holds the Lease (every member writes
    /// only while it does); `None` without: it always writes.
    pub leading: Option<watch::Receiver<bool>>,
    /// `--enable-controllers`.
    pub optional: OptionalControllers,
    /// With `--members-namespace`, the upper watches every member reads (one of each kind,
    /// however many members); `None`: the one member watches for itself.
    pub upper_watches: Option<Arc<UpperWatches>>,
    /// The virtual node names the members claimed: each is one member's.
    pub node_names: Arc<names::NodeNames>,
}

/// What is a member's own: its lower cluster, its node, and the options that may differ
/// between members.
#[derive(Clone)]
pub struct MemberSpec {
    /// The virtual node's name in the upper cluster.
    pub node: String,
    /// How to reach the lower cluster.
    pub lower: kube::Config,
    /// Requests per second and burst to the lower cluster.
    pub lower_limit: RateLimit,
    /// The node's taint, if any.
    pub taint: Option<Taint>,
    /// Labels moved into `tripped-labels` before mirroring.
    pub ignore_labels: Vec<String>,
    /// The kubelet API's port; 0 for any free one (the Node says which).
    pub kubelet_port: u16,
    /// Burst priority and share, changed in place on a running member (its node's label
    /// and capacity, its pods' deletion costs follow).
    pub bursting: Arc<watch::Sender<Burst>>,
    /// One virtual node for the cluster, per lower node, or per value of a lower node
    /// label (`--node-granularity`, `tensile.dev/node-granularity`).
    pub granularity: Granularity,
    /// Lower node labels a group's virtual node shows beside the documented ones.
    pub lower_node_labels: LabelPatterns,
    /// The member Secret it comes from (`None`: the flags' member): where what concerns
    /// the member alone is said (a virtual node name another member has).
    pub secret: Option<ObjectReference>,
    /// When that Secret was made: it adopts no unrecorded Node older than itself
    /// ([`NodeOwner::made_at`]).
    pub secret_created: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// A kubelet port per virtual node, from this range (`--kubelet-port-range`, the
    /// member annotation `tensile.dev/kubelet-port-range`).
    pub kubelet_port_range: Option<kubelet_api::node_ports::PortRange>,
}

impl std::fmt::Debug for MemberSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The config holds credentials: only where it points is shown.
        f.debug_struct("MemberSpec")
            .field("node", &self.node)
            .field("lower", &self.lower.cluster_url.to_string())
            .field("taint", &self.taint)
            .field("ignore_labels", &self.ignore_labels)
            .field("kubelet_port", &self.kubelet_port)
            .field("bursting", &*self.bursting.borrow())
            .field("granularity", &self.granularity)
            .finish_non_exhaustive()
    }
}

impl MemberSpec {
    /// The member of the single-cluster flags, with the lower cluster's `config`.
    pub fn from_flags(args: &Args, lower: kube::Config) -> Self {
        Self {
            node: args.nodename.clone(),
            lower,
            lower_limit: RateLimit {
                qps: args.client_qps,
                burst: args.client_burst,
            },
            taint: flag_taint(args),
            ignore_labels: args
                .ignore_labels
                .iter()
                .filter(|l| !l.is_empty())
                .cloned()
                .collect(),
            kubelet_port: args.kubelet_port,
            bursting: Arc::new(watch::Sender::new(Burst {
                priority: args.burst_priority,
                share: args.share.clone(),
            })),
            granularity: args.node_granularity.clone(),
            lower_node_labels: args.lower_node_labels.clone(),
            secret: None,
            secret_created: None,
            kubelet_port_range: args.kubelet_port_range,
        }
    }
}

/// The member a Secret describes, its kubeconfig read (not yet contacted). A kubeconfig
/// that would run a command or read a file is refused ([`spec::lower_kubeconfig`]); no
/// error quotes the kubeconfig's text.
pub async fn member_spec(member: &spec::MemberSecret) -> Result<MemberSpec, String> {
    let kubeconfig = spec::lower_kubeconfig(&member.kubeconfig).map_err(|e| e.to_string())?;
    let config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    // What fails here names a field or a context, never the text (parsed already): a
    // base64 error shows at most the one byte it stopped at.
    .map_err(|e| format!("its kubeconfig cannot be used: {e}"))?;
    Ok(MemberSpec {
        node: member.node.clone(),
        lower: config,
        lower_limit: RateLimit {
            qps: member.qps,
            burst: member.burst,
        },
        taint: member.taint.clone(),
        ignore_labels: member.ignore_labels.clone(),
        kubelet_port: member.kubelet_port,
        bursting: Arc::new(watch::Sender::new(member.bursting.clone())),
        granularity: member.granularity.clone(),
        lower_node_labels: member.lower_node_labels.clone(),
        // The membership controller names it.
        secret: None,
        secret_created: None,
        kubelet_port_range: member.kubelet_port_range,
    })
}

/// The taint the flags give every node (none with `--disable-taint`).
pub fn flag_taint(args: &Args) -> Option<Taint> {
    (!args.disable_taint).then(|| Taint {
        key: args.taint_key.clone(),
        value: Some(args.taint_value.clone()),
        effect: args.taint_effect.clone(),
        time_added: None,
    })
}

/// Runs the member `spec` until `shutdown`, or until one of its parts fails: `Err` is the
/// one line saying what stopped it, naming the node and the cluster. `started` is
/// cancelled once its node is registered and its controllers run (a standby: once it
/// stands by). Nothing here ends the process: the caller decides.
pub async fn run(
    shared: Arc<Shared>,
    spec: MemberSpec,
    started: CancellationToken,
    shutdown: CancellationToken,
) -> Result<(), String> {
    run_checked(shared, spec, None, started, shutdown).await
}

/// What the member of a member Secret checks of its lower cluster as it starts: that it is
/// the one it joined, by its identity (the UID of its `kube-system` Namespace).
#[derive(Clone, Debug, Default)]
pub struct LowerCheck {
    /// The identity of the lower cluster the member joined, if known: a kubeconfig that
    /// now reaches another cluster is refused (every pod would be `LowerPodGone`, and the
    /// copies in the old cluster leaked).
    pub joined: Option<String>,
    /// The identity found, once the member reached its lower cluster.
    pub found: Arc<std::sync::Mutex<Option<String>>>,
}

/// [`run`], checking the lower cluster with `check` first.
pub async fn run_checked(
    shared: Arc<Shared>,
    spec: MemberSpec,
    check: Option<LowerCheck>,
    started: CancellationToken,
    shutdown: CancellationToken,
) -> Result<(), String> {
    let span = info_span!("member", node = %spec.node);
    run_member(shared, spec, check, started, shutdown)
        .instrument(span)
        .await
}

/// The identity of the lower cluster of `lower`: the UID of its `kube-system` Namespace,
/// which lives as long as the cluster.
async fn lower_identity(node: &str, lower: &kube::Client) -> Result<String, String> {
    let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> =
        kube::Api::all(lower.clone());
    namespaces
        .get("kube-system")
        .await
        .map_err(|e| format!("node {node}: lower cluster: reading namespace kube-system (the cluster's identity): {e}"))?
        .metadata
        .uid
        .ok_or_else(|| format!("node {node}: lower cluster: namespace kube-system has no UID"))
}

/// What a member's start-up prepared: its lower cluster and, under `--lower-namespace`,
/// the namespace mapping with a lower client without it.
struct Prepared {
    namespaces: Option<(Arc<NamespaceView>, String)>,
    raw_lower: Option<kube::Client>,
    lower: Cluster,
}

async fn run_member(
    shared: Arc<Shared>,
    spec: MemberSpec,
    check: Option<LowerCheck>,
    started: CancellationToken,
    shutdown: CancellationToken,
) -> Result<(), String> {
    let args = &shared.args;
    let upper = &shared.upper;
    // Node granularity: the member's virtual nodes, known before any is registered.
    let group_nodes = (spec.granularity != Granularity::Cluster)
        .then(|| Arc::new(node::groups::GroupNodes::default()));
    let owner = Owner::new(spec.node.clone(), shared.cluster_id.clone());
    // The start-up's calls to the lower cluster may hang (a lower API server that answers
    // `/version` and then nothing): a stop must not wait for them, or a restart of this
    // member (and with it every membership change) would hang too.
    let prepared = tokio::select! {
        biased;
        () = shutdown.cancelled() => {
            info!(node = %spec.node, "stopped during start-up");
            return Ok(());
        }
        prepared = start_up(&shared, &spec, &owner, check.as_ref()) => prepared?,
    };
    let Prepared {
        namespaces,
        raw_lower,
        lower,
    } = prepared;
    // The cordons of the member's virtual nodes: known from each Node once registered
    // (before its pods are looked at), then watched (one watch of every virtual node,
    // shared by the members of a federated process).
    let cordons = match &shared.upper_watches {
        Some(watches) => watches.cordons.clone(),
        None => Arc::new(node::Cordons::default()),
    };
    let ctx = context(
        &shared,
        &spec,
        owner.clone(),
        &lower,
        namespaces.as_ref().map(|(view, _)| view.clone()),
        cordons.clone(),
        group_nodes.clone(),
    );
    // Node granularity: a virtual node with pods that joins the member late is listed.
    let (replay, replay_rx) = watch::channel(0_u64);
    let controllers::pod_watch::PodWatches {
        stores,
        pump,
        pods: pod_triggers,
        status: status_triggers,
    } = controllers::pod_watch::watches(&ctx, replay_rx);
    let lower_pods = kubelet_api::resource_scrape::LowerPods {
        store: stores.lower.clone(),
        upper: stores.upper.clone(),
        synced: stores.synced.clone(),
    };
    let setup = kubelet_api_setup(
        &shared,
        &spec,
        &owner,
        &lower.client,
        namespaces.as_ref(),
        lower_pods,
    );
    let (kubelet_listener, kubelet_tls, kubelet_api) = tokio::select! {
        biased;
        () = shutdown.cancelled() => {
            info!(node = %spec.node, "stopped during start-up");
            return Ok(());
        }
        setup = setup => setup?,
    };
    let kubelet_port = kubelet_listener
        .local_addr()
        .map(|a| a.port())
        .unwrap_or(spec.kubelet_port);
    info!(
        node = %spec.node, lower = %lower.server, lower_version = %lower.version,
        kubelet_port, pv_controllers = shared.optional.volumes,
        service_controllers = shared.optional.services, "starting"
    );

    let mut tasks = Tasks::new(shutdown.clone());
    if shared.upper_watches.is_none() {
        tasks.spawn(
            "cordon watch",
            cordons
                .clone()
                .watch(upper.client.clone(), shutdown.clone()),
        );
    }
    // Standbys serve the kubelet API too: it only proxies reads and streams to lower pods,
    // and the upper API server calls the address on the Node, which only the leader writes.
    if let (Some(range), None) = (spec.kubelet_port_range, &group_nodes) {
        warn!(node = %spec.node, %range,
            "--kubelet-port-range is for node or label= granularity: ignored (one virtual node, on --kubelet-port)");
    }
    let group_ports = spec
        .kubelet_port_range
        .filter(|_| group_nodes.is_some())
        .map(|range| kubelet_api::node_ports::GroupPorts {
            range,
            tls: kubelet_tls.clone(),
            api: kubelet_api.clone(),
            recorder: ctx.recorder.clone(),
        });
    tasks.spawn(
        "kubelet API server",
        kubelet_api::serve(kubelet_listener, kubelet_tls, kubelet_api, shutdown.clone()),
    );
    let (capacity_tx, capacity_rx) = watch::channel(None);
    // Every group below (`offers`), and those whose name is the member's (`admitted`, what
    // its fleet registers): a name another member has is refused.
    let (offers_tx, mut offers) = watch::channel(BTreeMap::new());
    let (admitted_tx, offers_rx) = watch::channel(BTreeMap::new());
    let mut admission = names::Admission::new(
        shared.node_names.clone(),
        names::Claimant::new(&spec.node, spec.secret.as_ref()),
        node_owner(&spec),
        upper.client.clone(),
        (ctx.recorder.clone(), spec.secret.clone()),
        group_nodes.clone(),
    );
    let grouped = group_nodes.as_ref().map(|_| node::GroupWatch {
        groups: node::groups::Groups::new(
            &spec.node,
            spec.granularity.clone(),
            spec.lower_node_labels.clone(),
        ),
        tx: offers_tx,
    });
    tasks.spawn(
        "capacity watch",
        node::watch_capacity(
            lower.client.clone(),
            owner.clone(),
            capacity_tx,
            grouped,
            shutdown.clone(),
        ),
    );
    let mut left_behind = Vec::new();
    if let Some(nodes) = &group_nodes {
        // The groups are published with the first capacity: their names are known before
        // the upper pod watch lists, so the pods already bound to them are the member's.
        let mut known = capacity_rx.clone();
        tokio::select! {
            biased;
            () = shutdown.cancelled() => {}
            _ = known.wait_for(Option::is_some) => {}
        }
        let below = offers.borrow_and_update().clone();
        tokio::select! {
            biased;
            () = shutdown.cancelled() => {}
            admitted = admission.admit(below.clone()) => {
                admitted_tx.send_replace(admitted);
            }
        }
        fleet::know(nodes, &spec.granularity, &offers_rx.borrow());
        // Left behind: a Node whose group is not below any more. One offered below but not
        // admitted yet (its Node unreadable for now) is not gone: it is admitted later.
        let offered = below;
        left_behind = fleet::find_left_behind(
            &upper.client,
            (&spec.node, &node_owner(&spec)),
            &spec.granularity,
            &offered,
            nodes,
        )
        .await;
        tasks.spawn(
            "virtual node names",
            admission.follow(offers, admitted_tx, shutdown.clone()),
        );
    } else if let Err(clash) = admission.claim_node(&spec.node).await {
        shutdown.cancel();
        tasks.supervise().await.map_err(|f| f.to_string())?;
        return Err(clash);
    }
    if let (Some((view, suffix)), Some(raw_lower)) = (namespaces, raw_lower) {
        tasks.spawn(
            "namespace mapping",
            controllers::namespace::run(
                ctx.clone(),
                raw_lower,
                view,
                suffix,
                stores.lower.clone(),
                stores.synced.clone(),
                shutdown.clone(),
            ),
        );
    }
    // The watches run until shutdown; the controllers stop on it by themselves.
    let stop = shutdown.clone();
    tasks.spawn("pod watches", async move {
        tokio::select! {
            () = stop.cancelled() => {}
            () = pump => {}
        }
    });

    let triggers = match shared.leading.clone() {
        None => (pod_triggers, status_triggers),
        Some(mut leading) => {
            let (metrics, synced, stop) = (
                shared.metrics.clone(),
                stores.synced.clone(),
                shutdown.clone(),
            );
            tasks.spawn("standby readiness", async move {
                // A standby is ready to take over once its pod stores are current.
                let ready = async {
                    if synced.wait().await.is_ok() {
                        metrics.ready.store(true, Ordering::Relaxed);
                    }
                    stop.cancelled().await;
                };
                tokio::select! {
                    () = stop.cancelled() => {}
                    () = ready => {}
                }
            });
            started.cancel();
            let took_lead = CancellationToken::new();
            let (pods, status, leads) = tokio::join!(
                pod_triggers.drop_until(&stores.upper, took_lead.cancelled()),
                status_triggers.drop_until(&stores.upper, took_lead.cancelled()),
                async {
                    let leads = tokio::select! {
                        () = shutdown.cancelled() => false,
                        leads = leading.wait_for(|l| *l) => leads.is_ok(),
                    };
                    took_lead.cancel();
                    leads
                },
            );
            if leads {
                tokio::select! {
                    biased;
                    () = shutdown.cancelled() => {}
                    adopted = adopt(upper, &lower, &owner, &shared.optional) => adopted?,
                }
            }
            (pods, status)
        }
    };

    // The member's virtual nodes, each registered before its pods are looked at: one per
    // group of lower nodes (node granularity, its fleet), or the one Node `--nodename`.
    let features = lower_declared_features(&lower, &spec.node).await;
    let node_config = node_config(&shared, &spec, &lower, kubelet_port, features);
    let registered = match group_nodes {
        Some(nodes) => {
            let fleet = fleet::Fleet {
                upper: upper.client.clone(),
                upper_heartbeat: upper.heartbeat.clone(),
                lower_heartbeat: lower.heartbeat.clone(),
                base: node_config,
                granularity: spec.granularity.clone(),
                use_lease: args.enable_node_lease,
                bursting: spec.bursting.subscribe(),
                nodes,
                drain_timeout: args.leave_timeout,
                ports: group_ports,
                left_behind,
                cordons: cordons.clone(),
                replay,
            };
            tasks.spawn_fallible("virtual nodes", fleet.run(offers_rx, shutdown.clone()));
            Ok(true)
        }
        None => {
            let node = NodeTask {
                upper,
                lower: &lower,
                config: node_config,
                capacity: capacity_rx,
                cordons: &cordons,
            };
            node.start(&mut tasks, &spec, args.enable_node_lease, &shutdown)
                .await
        }
    };
    match registered {
        Ok(true) => {}
        Ok(false) => return tasks.supervise().await.map_err(|f| f.to_string()),
        Err(error) => {
            shutdown.cancel();
            // A task that failed meanwhile (the capacity watch) is the cause.
            return match tasks.supervise().await {
                Err(failure) => Err(failure.to_string()),
                Ok(()) => Err(error),
            };
        }
    }
    // Every virtual node's cordon known (a node of an earlier run being drained among
    // them) before a pod is looked at.
    tokio::select! {
        biased;
        () = shutdown.cancelled() => return tasks.supervise().await.map_err(|f| f.to_string()),
        () = cordons.listed() => {}
    }
    let watched = PodWatched {
        stores,
        pods: triggers.0,
        status: triggers.1,
    };
    spawn_controllers(&mut tasks, &ctx, args, &shared.optional, watched, &shutdown);
    if let Some(panic) = injected_panic(&spec.node) {
        tasks.spawn("injected panic", panic);
    }
    started.cancel();
    tasks.supervise().await.map_err(|f| f.to_string())
}

/// The one virtual node of a member of `cluster` granularity, to register.
struct NodeTask<'a> {
    upper: &'a Cluster,
    lower: &'a Cluster,
    config: NodeConfig,
    capacity: watch::Receiver<Capacity>,
    cordons: &'a node::Cordons,
}

impl NodeTask<'_> {
    /// Registers the Node once the lower capacity is known (its cordon recorded), then
    /// keeps it alive among `tasks`; false if `shutdown` came first.
    async fn start(
        self,
        tasks: &mut Tasks,
        spec: &MemberSpec,
        use_lease: bool,
        shutdown: &CancellationToken,
    ) -> Result<bool, String> {
        let bursting = spec.bursting.borrow().clone();
        if shutdown.is_cancelled() {
            return Ok(false);
        }
        let registered = tokio::select! {
            biased;
            () = shutdown.cancelled() => return Ok(false),
            registered = register_node(self.upper, &self.config, self.capacity.clone(), &bursting) => registered?,
        };
        self.cordons
            .set(&spec.node, node::resources::node_cordoned(&registered));
        tasks.spawn(
            "node keep-alive",
            node::keep_alive(
                self.upper.heartbeat.clone(),
                self.lower.heartbeat.clone(),
                self.config,
                use_lease,
                node::Offer {
                    capacity: self.capacity,
                    bursting: spec.bursting.subscribe(),
                },
                registered,
                shutdown.clone(),
            ),
        );
        Ok(true)
    }
}

/// A member's start-up, before its tasks run: the lower cluster reached (its namespaces
/// mapped with `--lower-namespace`), its permissions checked, what it made under older
/// marks adopted (unless a standby), its kubelet API bound.
async fn start_up(
    shared: &Shared,
    spec: &MemberSpec,
    owner: &Owner,
    check: Option<&LowerCheck>,
) -> Result<Prepared, String> {
    let args = &shared.args;
    let upper = &shared.upper;
    // --lower-namespace: the lower client speaks upper namespace names, mapped from the
    // upper Namespaces as they are before anything is read below.
    let mut raw_lower = None;
    let namespaces = match args.lower_namespace {
        Mode::Same => None,
        mode => {
            let suffix = cluster_suffix(&shared.cluster_id);
            let reserved = Reserved::new(args.reserved_lower_namespaces.iter().cloned());
            let view =
                NamespaceView::new(Mapping::new(mode, suffix.clone()).with_reserved(reserved));
            // Without the view: where this node's pods are below, in lower names.
            let raw = kube::Client::try_from(spec.lower.clone())
                .map_err(|e| format!("node {}: lower cluster client: {e}", spec.node))?;
            controllers::namespace::load(&upper.client, &raw, owner, &view, &suffix)
                .await
                .map_err(|e| format!("node {}: {e}", spec.node))?;
            raw_lower = Some(raw);
            Some((view, suffix))
        }
    };
    let lower = clusters::connect(
        Side::Lower,
        spec.lower.clone(),
        spec.lower_limit,
        shared.metrics.clone(),
        namespaces.as_ref().map(|(view, _)| view.clone()),
    )
    .await
    .map_err(|e| format!("node {}: {e}", spec.node))?;
    if let Some(check) = check {
        // Without the namespace view: kube-system is the lower cluster's own.
        let raw = kube::Client::try_from(spec.lower.clone())
            .map_err(|e| format!("node {}: lower cluster client: {e}", spec.node))?;
        let found = lower_identity(&spec.node, &raw).await?;
        if let Some(joined) = check.joined.as_ref().filter(|j| **j != found) {
            return Err(format!(
                "node {}: refused: its kubeconfig now reaches another lower cluster \
                 (kube-system UID {found}) than the one it joined ({joined}); its pods and \
                 their copies are there. To move the member, delete its Secret (it leaves) \
                 and join the other cluster under a Secret of its own",
                spec.node
            ));
        }
        *check
            .found
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(found);
    }
    let lower_needs = clusters::needed_permissions(Side::Lower, args.features());
    clusters::check_permissions(&lower, &lower_needs)
        .await
        .map_err(|e| format!("node {}: {e}", spec.node))?;
    if shared.leading.is_none() {
        adopt(upper, &lower, owner, &shared.optional).await?;
    }
    Ok(Prepared {
        namespaces,
        raw_lower,
        lower,
    })
}

/// The environment variable naming the members (nodes, comma-separated) in which a task
/// panics once per process, a moment after they started: for tests of what a member's
/// panic does (`tests/federation.rs`). Unset in production.
pub const INJECT_PANIC_ENV: &str = "TENSILE_INJECT_PANIC";

/// A task that panics, if [`INJECT_PANIC_ENV`] names `node` and it has not panicked yet.
fn injected_panic(node: &str) -> Option<impl Future<Output = ()> + Send + 'static> {
    static PANICKED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let named = std::env::var(INJECT_PANIC_ENV).ok()?;
    if !named.split(',').any(|n| n.trim() == node) {
        return None;
    }
    let mut panicked = PANICKED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if panicked.iter().any(|n| n == node) {
        return None;
    }
    panicked.push(node.to_owned());
    let node = node.to_owned();
    Some(async move {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        panic!("injected by {INJECT_PANIC_ENV} for node {node}");
    })
}

/// Adopts, at start, the lower objects this node created under older ownership marks.
async fn adopt(
    upper: &Cluster,
    lower: &Cluster,
    owner: &Owner,
    optional: &OptionalControllers,
) -> Result<(), String> {
    controllers::adopt::adopt(
        &upper.client,
        &lower.client,
        owner,
        optional.services,
        optional.volumes,
    )
    .await
    .map(|_| ())
    .map_err(|e| e.to_string())
}

/// Who the member's virtual nodes are ([`crate::node::owner`]).
fn node_owner(spec: &MemberSpec) -> NodeOwner {
    NodeOwner::new(&spec.node, spec.secret.as_ref()).made_at(spec.secret_created.as_ref())
}

/// What the Node says of itself.
fn node_config(
    shared: &Shared,
    spec: &MemberSpec,
    lower: &Cluster,
    kubelet_port: u16,
    declared_features: Vec<String>,
) -> NodeConfig {
    NodeConfig {
        name: spec.node.clone(),
        os: shared.args.os.clone(),
        cluster_id: spec.node.clone(),
        taint: spec.taint.clone(),
        address: node_address(&shared.args),
        kubelet_port: i32::from(kubelet_port),
        lower_version: lower.version.clone(),
        declared_features,
        group_labels: BTreeMap::new(),
        lower_selector: None,
        owner: node_owner(spec),
    }
}

/// The node features every usable lower node declares, read once as the member starts
/// (a lower node upgraded later shows its new features after a restart); none when the
/// lower nodes cannot be read (a warning: pods that need a feature are then refused the
/// virtual node, never placed on one that lacks it).
async fn lower_declared_features(lower: &Cluster, node: &str) -> Vec<String> {
    let nodes: Api<Node> = Api::all(lower.client.clone());
    match nodes.list(&ListParams::default()).await {
        Ok(list) => crate::node::resources::common_declared_features(&list.items),
        Err(error) => {
            warn!(%error, node, cluster = "lower", "could not read the lower nodes' declared features; declaring none");
            Vec::new()
        }
    }
}

/// The address the Node advertises and the kubelet API certificate names.
fn node_address(args: &Args) -> String {
    args.node_ip.clone().unwrap_or_else(|| "127.0.0.1".into())
}

/// Registers the Node once the lower capacity is known, so it never offers room it lacks.
async fn register_node(
    upper: &Cluster,
    config: &NodeConfig,
    mut capacity: watch::Receiver<Capacity>,
    bursting: &Burst,
) -> Result<Node, String> {
    let capacity = capacity
        .wait_for(Option::is_some)
        .await
        .map_err(|_| {
            format!(
                "node {}: lower cluster: the capacity watch ended before capacity was known",
                config.name
            )
        })?
        .clone()
        .unwrap_or_default();
    let offered = bursting.share.cap(&capacity);
    let node = node::register(&upper.client, config, &offered, bursting)
        .await
        .map_err(|e| e.to_string())?;
    info!(node = %config.name, "node registered");
    Ok(node)
}

/// What every controller of the member shares.
fn context(
    shared: &Shared,
    spec: &MemberSpec,
    owner: Owner,
    lower: &Cluster,
    namespaces: Option<Arc<NamespaceView>>,
    cordons: Arc<node::Cordons>,
    groups: Option<Arc<node::groups::GroupNodes>>,
) -> Arc<Context> {
    let reporter = Reporter {
        controller: "tensile-virtual-node".into(),
        instance: Some(spec.node.clone()),
    };
    let upper = member_upper_client(shared, &spec.node);
    Arc::new(
        Context::new(
            upper.clone(),
            lower.client.clone(),
            owner,
            spec.ignore_labels.clone(),
            shared.args.enable_serviceaccount,
            shared.args.namespace.clone(),
            Recorder::new(upper, reporter),
            shared.metrics.clone(),
        )
        .sharing(shared.upper_watches.clone())
        .viewing(namespaces)
        .bursting(spec.bursting.subscribe(), cordons)
        .grouping(groups)
        // Checked at start: a bad address never gets this far.
        .with_upper_identity(shared.args.upper_identity().ok().flatten()),
    )
}

/// The upper client of the member's controllers: in a federated process
/// (`--members-namespace`), one of its own, with its own `--kube-api-qps` budget and
/// connections, as a single-cluster process has (see [`clusters::MemberClients`]); else
/// the process's.
fn member_upper_client(shared: &Shared, node: &str) -> kube::Client {
    if shared.upper_watches.is_none() {
        return shared.upper.client.clone();
    }
    shared.upper.member_clients.build().unwrap_or_else(|error| {
        // The same configuration built the shared client at start: not expected.
        warn!(%node, %error, "upper cluster: no client of the member's own; sharing the process's");
        shared.upper.client.clone()
    })
}

/// The pod watches' stores and the changes that wake the two pod controllers.
struct PodWatched {
    stores: controllers::pod_watch::PodStores,
    pods: controllers::pod_watch::Triggers,
    status: controllers::pod_watch::Triggers,
}

/// Spawns every controller, and the watches only they read, each as a task of its own.
fn spawn_controllers(
    tasks: &mut Tasks,
    ctx: &Arc<Context>,
    args: &Args,
    optional: &OptionalControllers,
    watched: PodWatched,
    shutdown: &CancellationToken,
) {
    let resync = args.full_resync_period;
    let PodWatched {
        stores,
        pods: pod_triggers,
        status: status_triggers,
    } = watched;
    let config_watches = controllers::config::watches(ctx);
    let service_watches = optional
        .services
        .then(|| controllers::service::watches(ctx));
    let volume_watches = optional.volumes.then(|| controllers::volume::watches(ctx));
    let mut watches_ready = config_watches.ready.clone();
    for ready in [
        service_watches.as_ref().map(|w| &w.ready),
        volume_watches.as_ref().map(|w| &w.ready),
    ]
    .into_iter()
    .flatten()
    {
        watches_ready = watches_ready.and(ready);
    }

    tasks.spawn(
        "pod controller",
        controllers::pod::run(
            ctx.clone(),
            pod_triggers,
            stores.clone(),
            args.pod_sync_workers,
            resync,
            shutdown.clone(),
        ),
    );
    let status_workers = match args.status_sync_workers {
        0 => args.pod_sync_workers.saturating_mul(3),
        n => n,
    };
    tasks.spawn(
        "status reflector",
        controllers::status::run(
            ctx.clone(),
            status_triggers,
            stores.clone(),
            status_workers,
            resync,
            shutdown.clone(),
        ),
    );
    tasks.spawn(
        "config/secret controller",
        controllers::config::run(
            ctx.clone(),
            config_watches,
            stores.clone(),
            resync,
            shutdown.clone(),
        ),
    );
    if ctx.tokens.is_some() {
        tasks.spawn(
            "token controller",
            controllers::token::run(ctx.clone(), stores.clone(), resync, shutdown.clone()),
        );
    }
    tasks.spawn(
        "events reflector",
        controllers::events::run(ctx.clone(), stores.clone(), shutdown.clone()),
    );
    if let Some(watches) = service_watches {
        tasks.spawn(
            "service controller",
            controllers::service::run(ctx.clone(), watches, resync, shutdown.clone()),
        );
    }
    if let Some(watches) = volume_watches {
        tasks.spawn(
            "volume controller",
            controllers::volume::run(ctx.clone(), watches, resync, shutdown.clone()),
        );
    }
    let (gc_ctx, stop) = (ctx.clone(), shutdown.clone());
    tasks.spawn("orphan collector", async move {
        // Ready once every watch has listed: the node is registered already.
        let synced = stores.synced.clone();
        let ready = async {
            if synced.wait().await.is_ok() && watches_ready.wait().await.is_ok() {
                gc_ctx.metrics.ready.store(true, Ordering::Relaxed);
            }
        };
        tokio::select! {
            () = stop.cancelled() => {}
            () = ready => {}
        }
        controllers::gc::run(gc_ctx, stores, stop).await;
    });
}

/// The member's kubelet API: its port, TLS and authenticator (the client CA is the
/// process's).
async fn kubelet_api_setup(
    shared: &Shared,
    spec: &MemberSpec,
    owner: &Owner,
    lower: &kube::Client,
    namespaces: Option<&(Arc<NamespaceView>, String)>,
    lower_pods: kubelet_api::resource_scrape::LowerPods,
) -> Result<
    (
        tokio::net::TcpListener,
        rustls::ServerConfig,
        Arc<kubelet_api::KubeletApi>,
    ),
    String,
> {
    let args = &shared.args;
    let auth = kubelet_api::auth::Authenticator::new(
        shared.client_ca.as_deref(),
        shared.upper.client.clone(),
        spec.node.clone(),
        kubelet_api::auth::AuthConfig {
            token_webhook: args.authentication_token_webhook,
            token_ttl: args.authentication_token_webhook_cache_ttl,
            authorized_ttl: args.authorization_webhook_cache_authorized_ttl,
            unauthorized_ttl: args.authorization_webhook_cache_unauthorized_ttl,
            no_verify: args.no_verify_clients,
        },
    )?;
    let cert = kubelet_api::ServingCert {
        cert: args.apiserver_cert.clone(),
        key: args.apiserver_key.clone(),
        sans: vec![node_address(args), spec.node.clone(), "localhost".into()],
    };
    let tls = kubelet_api::tls_config(&cert, &auth).map_err(|e| e.to_string())?;
    let addr = std::net::SocketAddr::from(([0, 0, 0, 0], spec.kubelet_port));
    let listener = kubelet_api::bind(addr)
        .await
        .map_err(|e| format!("node {}: {e}", spec.node))?;
    let api = Arc::new(kubelet_api::KubeletApi {
        lower: lower.clone(),
        owner: owner.clone(),
        auth,
        resource_metrics: match spec.granularity {
            crate::node::groups::Granularity::Cluster => Default::default(),
            _ => kubelet_api::resource_scrape::ResourceMetrics::for_group_nodes(),
        },
        namespaces: namespaces.map(|(view, _)| view.clone()),
        lower_pods,
    });
    Ok((listener, tls, api))
}
