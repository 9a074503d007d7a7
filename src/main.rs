//! virtual-node: joins the lower cluster to the upper one as a virtual node. Wiring only.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use clap::CommandFactory;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Taint};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::runtime::events::{Recorder, Reporter};
use tensile::cli::{self, Args, CompatCommand, OptionalControllers};
use tensile::clusters::{self, Cluster, RateLimit, StartupError};
use tensile::controllers::{self, Context};
use tensile::kubelet_api;
use tensile::leader;
use tensile::logging;
use tensile::metrics::{self, Metrics};
use tensile::node::{self, spec::NodeConfig};
use tensile::shutdown::Tasks;
use tensile::side::Side;
use tensile::translate::meta::Owner;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// The lower capacity as last computed; `None` until the lower watches have listed.
type Capacity = Option<BTreeMap<String, Quantity>>;

/// jemalloc, not glibc's malloc: glibc gives each busy thread its own arena and keeps
/// what a burst freed in each. With 16 tokio workers (a 16-core box's default) virtual-node
/// held 100 MiB at 10 000 pods under glibc and 63 MiB under jemalloc (`tensile-bench`,
/// docs/benchmarks.md); mimalloc held 86 MiB with 2 workers.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let argv: Vec<_> = std::env::args_os().collect();
    match cli::compat_command(&argv, true) {
        Some(CompatCommand::Version) => {
            println!("virtual-node {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Some(CompatCommand::Providers) => {
            println!("k8s");
            return ExitCode::SUCCESS;
        }
        None => {}
    }
    // `virtual-node check <flags>`: verify, change nothing.
    let checking = argv.get(1).is_some_and(|a| a == "check");
    let argv = if checking {
        argv.into_iter()
            .enumerate()
            .filter_map(|(i, a)| (i != 1).then_some(a))
            .collect()
    } else {
        argv
    };
    let (argv, klog_flags) = cli::strip_klog_flags(argv);
    let args = match cli::parse_args::<Args>("virtual-node", argv) {
        Ok(args) => args,
        Err(status) => return status,
    };
    if let Err(message) = args.lease_config() {
        let error = Args::command().error(clap::error::ErrorKind::ValueValidation, message);
        return cli::usage_exit("virtual-node", &error);
    }
    if checking {
        let report = tensile::check::check(&args).await;
        print!("{}", report.render());
        return if report.passed() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    logging::init(&args.log_level, args.log_format);
    let mut ignored = args.ignored_flags();
    ignored.extend(klog_flags);
    logging::log_ignored_flags(&ignored);
    let startup_timeout = args.startup_timeout;
    let started = CancellationToken::new();
    let outcome = tokio::select! {
        outcome = run(args, started.clone()) => outcome,
        () = startup_deadline(startup_timeout, &started) => Err(format!(
            "not registered and serving within --startup-timeout={}",
            tensile::duration::format_duration(startup_timeout)
        )),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("virtual-node: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Checks everything that can be checked before starting, then runs every part on a task
/// of its own until shutdown. `Err` is the one line to print: what stopped it, by name.
/// With `--leader-elect` the parts that only read (watches, metrics, kubelet API) run at
/// once, and those that write once this process holds the Lease.
async fn run(args: Args, started: CancellationToken) -> Result<(), String> {
    let lease = args.lease_config()?;
    let metrics = Arc::new(Metrics::default());
    let (upper, lower) = connect(&args, &metrics).await?;
    let optional = args.optional_controllers();
    for unknown in &optional.unknown {
        warn!(controller = %unknown, "--enable-controllers: unknown controller skipped");
    }
    check_permissions(&args, &upper, &lower).await?;
    let owner = owner(&args, &upper).await?;
    if lease.is_none() {
        adopt(&upper, &lower, &owner, &optional).await?;
    }
    let metrics_listener = metrics::bind(args.metrics_addr).await?;
    let (kubelet_listener, kubelet_tls, kubelet_api) =
        kubelet_api_setup(&args, &owner, &upper.client, &lower.client).await?;
    info!(
        node = %args.nodename, upper = %upper.server, lower = %lower.server,
        lower_version = %lower.version, pv_controllers = optional.volumes,
        service_controllers = optional.services, "starting"
    );

    let shutdown = CancellationToken::new();
    tokio::spawn(tensile::shutdown::on_signals(shutdown.clone()));
    let mut tasks = Tasks::new(shutdown.clone());
    tasks.spawn_fallible(
        "metrics server",
        metrics::serve(metrics_listener, metrics.clone(), shutdown.clone()),
    );
    // Standbys serve the kubelet API too: it only proxies reads and streams to lower pods,
    // and the upper API server calls the address on the Node, which only the leader writes.
    tasks.spawn(
        "kubelet API server",
        kubelet_api::serve(kubelet_listener, kubelet_tls, kubelet_api, shutdown.clone()),
    );
    let (capacity_tx, capacity_rx) = watch::channel(None);
    tasks.spawn(
        "capacity watch",
        node::watch_capacity(
            lower.client.clone(),
            owner.clone(),
            capacity_tx,
            shutdown.clone(),
        ),
    );
    let ctx = context(&args, owner.clone(), &upper, &lower, metrics.clone());
    let controllers::pod_watch::PodWatches {
        stores,
        pump,
        pods: pod_triggers,
        status: status_triggers,
    } = controllers::pod_watch::watches(&ctx);
    // The watches run until shutdown; the controllers stop on it by themselves.
    let stop = shutdown.clone();
    tasks.spawn("pod watches", async move {
        tokio::select! {
            () = stop.cancelled() => {}
            () = pump => {}
        }
    });

    // The election outlives the controllers' draining: it stops on `election_stop`, once
    // they have stopped, and then gives the Lease up so a standby takes over at once.
    let election_stop = CancellationToken::new();
    let lease_label = lease
        .as_ref()
        .map(|l| format!("{}/{}", l.namespace, l.name))
        .unwrap_or_default();
    metrics.set_leader(&lease_label, lease.is_none());
    let (triggers, election) = match lease {
        None => ((pod_triggers, status_triggers), None),
        Some(config) => {
            info!(lease = %lease_label, identity = %config.identity, cluster = "upper",
                "standing by until this process holds the lease");
            let (leading, election) =
                leader::elect(upper.client.clone(), config, election_stop.clone());
            let election = tokio::spawn(election);
            let guard = tokio::spawn(exit_on_lost_lease(
                leading.clone(),
                lease_label.clone(),
                metrics.clone(),
                election_stop.clone(),
            ));
            let (metrics, synced, stop) =
                (metrics.clone(), stores.synced.clone(), shutdown.clone());
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
                    let mut leading = leading;
                    let leads = tokio::select! {
                        () = shutdown.cancelled() => false,
                        leads = leading.wait_for(|l| *l) => leads.is_ok(),
                    };
                    took_lead.cancel();
                    leads
                },
            );
            if leads {
                adopt(&upper, &lower, &owner, &optional).await?;
            }
            ((pods, status), Some((election, guard)))
        }
    };

    let node_config = node_config(&args, &lower);
    let registered = if shutdown.is_cancelled() {
        None
    } else {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => None,
            registered = register_node(&upper, &node_config, capacity_rx.clone()) => Some(registered),
        }
    };
    let outcome = match registered {
        None => tasks.supervise().await.map_err(|f| f.to_string()),
        Some(Ok(node)) => {
            let watched = PodWatched {
                stores,
                pods: triggers.0,
                status: triggers.1,
            };
            spawn_controllers(&mut tasks, &ctx, &args, &optional, watched, &shutdown);
            started.cancel();
            tasks.spawn(
                "node keep-alive",
                node::keep_alive(
                    upper.client.clone(),
                    lower.client.clone(),
                    node_config,
                    args.enable_node_lease,
                    capacity_rx,
                    node,
                    shutdown.clone(),
                ),
            );
            tasks.supervise().await.map_err(|f| f.to_string())
        }
        Some(Err(error)) => {
            shutdown.cancel();
            // A task that failed meanwhile (the capacity watch) is the cause.
            match tasks.supervise().await {
                Err(failure) => Err(failure.to_string()),
                Ok(()) => Err(error),
            }
        }
    };
    if let Some((election, guard)) = election {
        // Every writer has stopped: only now may another replica take over.
        election_stop.cancel();
        let _ = election.await;
        let _ = guard.await;
    }
    info!("stopped");
    outcome
}

/// Exits the process, status 1, the moment `leading` turns from true to false before
/// `election_stop`: the Lease was lost (not renewed within the renew deadline), and every
/// writer must stop before another replica takes over; the restarted pod stands by.
/// Keeps the leader gauge current meanwhile.
async fn exit_on_lost_lease(
    mut leading: watch::Receiver<bool>,
    lease: String,
    metrics: Arc<Metrics>,
    election_stop: CancellationToken,
) {
    let mut was_leading = false;
    loop {
        tokio::select! {
            () = election_stop.cancelled() => break,
            changed = leading.changed() => if changed.is_err() { break },
        }
        let leads = *leading.borrow_and_update();
        if was_leading && !leads && !election_stop.is_cancelled() {
            error!(%lease, cluster = "upper",
                "leader election lost: the lease was not renewed within the renew deadline; exiting so that nothing is written while another replica may lead");
            std::process::exit(1);
        }
        was_leading = leads;
        metrics.set_leader(&lease, leads);
    }
    metrics.set_leader(&lease, false);
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

/// Ends when `timeout` (unless zero) has passed before `started`; never otherwise.
async fn startup_deadline(timeout: std::time::Duration, started: &CancellationToken) {
    if !timeout.is_zero() {
        tokio::select! {
            () = started.cancelled() => {}
            () = tokio::time::sleep(timeout) => return,
        }
    }
    std::future::pending::<()>().await;
}

/// This node of this upper cluster: `--cluster-id`, or the UID of the upper `kube-system`
/// namespace, which lives as long as the cluster.
async fn owner(args: &Args, upper: &Cluster) -> Result<Owner, String> {
    let cluster = match &args.cluster_id {
        Some(id) => id.clone(),
        None => kube::Api::<Namespace>::all(upper.client.clone())
            .get("kube-system")
            .await
            .map_err(|e| {
                format!(
                    "upper cluster: reading namespace kube-system, whose UID is the cluster's \
                     identity on lower objects (or set --cluster-id): {e}"
                )
            })?
            .metadata
            .uid
            .ok_or("upper cluster: namespace kube-system has no UID; set --cluster-id")?,
    };
    Ok(Owner::new(args.nodename.clone(), cluster))
}

/// Reads both kubeconfigs, then connects to both API servers.
async fn connect(args: &Args, metrics: &Arc<Metrics>) -> Result<(Cluster, Cluster), String> {
    // Both kubeconfigs are read before either server is contacted, so a bad file is
    // reported as such, never raced by the other cluster's connection error.
    let upper_config = clusters::load_config(Side::Upper, args.kubeconfig.as_deref())
        .await
        .map_err(|e| e.to_string())?;
    let lower_config = clusters::load_config(Side::Lower, Some(&args.client_kubeconfig))
        .await
        .map_err(|e| e.to_string())?;
    let upper_limit = RateLimit {
        qps: args.kube_api_qps,
        burst: args.kube_api_burst,
    };
    let lower_limit = RateLimit {
        qps: args.client_qps,
        burst: args.client_burst,
    };
    tokio::try_join!(
        clusters::connect(Side::Upper, upper_config, upper_limit, metrics.clone()),
        clusters::connect(Side::Lower, lower_config, lower_limit, metrics.clone()),
    )
    .map_err(|e: StartupError| e.to_string())
}

/// Fails, naming the cluster and every missing permission, unless virtual-node may do in
/// both clusters everything the parts it runs will do.
async fn check_permissions(args: &Args, upper: &Cluster, lower: &Cluster) -> Result<(), String> {
    let features = args.features();
    let upper_needs = clusters::needed_permissions(Side::Upper, features);
    let lower_needs = clusters::needed_permissions(Side::Lower, features);
    tokio::try_join!(
        clusters::check_permissions(upper, &upper_needs),
        clusters::check_permissions(lower, &lower_needs),
    )
    .map_err(|e| e.to_string())?;
    Ok(())
}

/// What the Node says of itself.
fn node_config(args: &Args, lower: &Cluster) -> NodeConfig {
    NodeConfig {
        name: args.nodename.clone(),
        os: args.os.clone(),
        cluster_id: args.nodename.clone(),
        taint: (!args.disable_taint).then(|| Taint {
            key: args.taint_key.clone(),
            value: Some(args.taint_value.clone()),
            effect: args.taint_effect.clone(),
            time_added: None,
        }),
        address: args.node_ip.clone().unwrap_or_else(|| "127.0.0.1".into()),
        kubelet_port: i32::from(args.kubelet_port),
        lower_version: lower.version.clone(),
    }
}

/// Registers the Node once the lower capacity is known, so it never offers room it lacks.
async fn register_node(
    upper: &Cluster,
    config: &NodeConfig,
    mut capacity: watch::Receiver<Capacity>,
) -> Result<Node, String> {
    let capacity = capacity
        .wait_for(Option::is_some)
        .await
        .map_err(|_| "lower cluster: the capacity watch ended before capacity was known")?
        .clone()
        .unwrap_or_default();
    let node = node::register(&upper.client, config, &capacity)
        .await
        .map_err(|e| e.to_string())?;
    info!(node = %config.name, "node registered");
    Ok(node)
}

/// What every controller shares.
fn context(
    args: &Args,
    owner: Owner,
    upper: &Cluster,
    lower: &Cluster,
    metrics: Arc<Metrics>,
) -> Arc<Context> {
    let reporter = Reporter {
        controller: "tensile-virtual-node".into(),
        instance: Some(args.nodename.clone()),
    };
    Arc::new(Context::new(
        upper.client.clone(),
        lower.client.clone(),
        owner,
        args.ignore_labels
            .iter()
            .filter(|l| !l.is_empty())
            .cloned()
            .collect(),
        args.enable_serviceaccount,
        args.namespace.clone(),
        Recorder::new(upper.client.clone(), reporter),
        metrics,
    ))
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

/// The kubelet API's port, TLS and authenticator. The client CA defaults to the upper
/// cluster's (the `kube-root-ca.crt` ConfigMap), which signs kube-apiserver's kubelet
/// client certificate in a standard cluster.
async fn kubelet_api_setup(
    args: &Args,
    owner: &Owner,
    upper: &kube::Client,
    lower: &kube::Client,
) -> Result<
    (
        tokio::net::TcpListener,
        rustls::ServerConfig,
        Arc<kubelet_api::KubeletApi>,
    ),
    String,
> {
    let ca_pem = match &args.apiserver_ca_cert {
        Some(path) => Some(
            tokio::fs::read(path)
                .await
                .map_err(|e| format!("--client-verify-ca {}: {e}", path.display()))?,
        ),
        None if args.no_verify_clients => None,
        None => {
            let config_maps: kube::Api<ConfigMap> =
                kube::Api::namespaced(upper.clone(), "kube-system");
            let found = config_maps.get_opt("kube-root-ca.crt").await.map_err(|e| {
                format!("upper cluster: reading kube-system/kube-root-ca.crt for the kubelet API's client CA: {e}")
            })?;
            let pem = found
                .and_then(|cm| cm.data)
                .and_then(|mut data| data.remove("ca.crt"))
                .ok_or_else(|| {
                    "upper cluster: no kube-system/kube-root-ca.crt with ca.crt: set APISERVER_CA_CERT_LOCATION (--client-verify-ca) for the kubelet API"
                        .to_owned()
                })?;
            Some(pem.into_bytes())
        }
    };
    if args.no_verify_clients {
        warn!(
            "--no-verify-clients: the kubelet API (logs, exec, port-forward) is open to ANYONE who reaches port {}: never do this outside a lab",
            args.kubelet_port
        );
    }
    let auth = kubelet_api::auth::Authenticator::new(
        ca_pem.as_deref(),
        upper.clone(),
        args.nodename.clone(),
        kubelet_api::auth::AuthConfig {
            token_webhook: args.authentication_token_webhook,
            token_ttl: args.authentication_token_webhook_cache_ttl,
            authorized_ttl: args.authorization_webhook_cache_authorized_ttl,
            unauthorized_ttl: args.authorization_webhook_cache_unauthorized_ttl,
            no_verify: args.no_verify_clients,
        },
    )?;
    let address = args.node_ip.clone().unwrap_or_else(|| "127.0.0.1".into());
    let cert = kubelet_api::ServingCert {
        cert: args.apiserver_cert.clone(),
        key: args.apiserver_key.clone(),
        sans: vec![address, args.nodename.clone(), "localhost".into()],
    };
    let tls = kubelet_api::tls_config(&cert, &auth).map_err(|e| e.to_string())?;
    let addr = std::net::SocketAddr::from(([0, 0, 0, 0], args.kubelet_port));
    let listener = kubelet_api::bind(addr).await.map_err(|e| e.to_string())?;
    let api = Arc::new(kubelet_api::KubeletApi {
        lower: lower.clone(),
        owner: owner.clone(),
        auth,
    });
    Ok((listener, tls, api))
}
