//! virtual-node: joins lower clusters to the upper one, each as a virtual node (a
//! member, `tensile::member`). Wiring only.

use std::process::ExitCode;
use std::sync::Arc;

use clap::CommandFactory;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use tensile::cli::{self, Args, CompatCommand};
use tensile::clusters::{self, Cluster, RateLimit, StartupError};
use tensile::leader;
use tensile::logging;
use tensile::member::{self, MemberSpec, Shared};
use tensile::metrics::{self, Metrics};
use tensile::shutdown::Tasks;
use tensile::side::Side;
use tensile::upper_watches::UpperWatches;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// jemalloc, not glibc's malloc: glibc gives each busy thread its own arena and keeps
/// what a burst freed in each. With 16 tokio workers (a 16-core box's default) virtual-node
/// held 100 MiB at 10 000 pods under glibc and 63 MiB under jemalloc (`tensile-bench`,
/// docs/benchmarks.md); mimalloc held 86 MiB with 2 workers. Its background threads alone
/// did not lower the resident memory after a burst beyond the runs' spread (1.2–2.0
/// against 1.6–2.0 KB a further pod, release, 2 cores): with its default 10 s decay they
/// purge after the footprint is sampled. `main` sets a 1 s decay and starts them
/// ([`tensile::allocator::return_freed_pages_sooner`]).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    // Before any other thread (and its arena) exists.
    if let Err(error) = tensile::allocator::return_freed_pages_sooner() {
        eprintln!("virtual-node: jemalloc's page decay left at its defaults: {error}");
    }
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let argv: Vec<_> = std::env::args_os().collect();
    let env = |name| std::env::var_os(name);
    if let Some(workers) = tensile::runtime::workers(
        cores,
        &argv,
        env(tensile::runtime::WORKERS_ENV).as_ref(),
        env(tensile::runtime::MEMBERS_NAMESPACE_ENV).as_ref(),
    ) {
        runtime.worker_threads(workers);
    }
    match runtime.build() {
        Ok(runtime) => runtime.block_on(start(argv)),
        Err(error) => {
            eprintln!("virtual-node: cannot start the async runtime: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Everything `main` does, on the runtime it built.
async fn start(argv: Vec<std::ffi::OsString>) -> ExitCode {
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
    // `virtual-node status`: the federation as the upper cluster shows it (its own flags).
    if argv.get(1).and_then(|a| a.to_str()) == Some("status") {
        let rest = std::iter::once(argv[0].clone()).chain(argv.into_iter().skip(2));
        let args = match cli::parse_args::<tensile::status::StatusArgs>("virtual-node status", rest)
        {
            Ok(args) => args,
            Err(status) => return status,
        };
        return match tensile::status::run(&args).await {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("virtual-node status: {error}");
                ExitCode::FAILURE
            }
        };
    }
    // `virtual-node check <flags>`: verify, change nothing. `join` / `leave`: make the
    // lower cluster of `--client-kubeconfig` a member, or unmake it. `uninstall`: remove
    // the node of the flags as a member leaves (helm uninstall's pre-delete hook).
    let command = argv
        .get(1)
        .and_then(|a| a.to_str())
        .filter(|a| ["check", "join", "leave", "uninstall"].contains(a))
        .map(str::to_owned);
    let argv = if command.is_some() {
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
    let checked = args
        .lease_config()
        .and(args.upper_identity().map(drop))
        .and(args.kueue_quota_target().map(drop));
    if let Err(message) = checked {
        let error = Args::command().error(clap::error::ErrorKind::ValueValidation, message);
        return cli::usage_exit("virtual-node", &error);
    }
    match command.as_deref() {
        Some("check") => {
            let report = tensile::check::check(&args).await;
            print!("{}", report.render());
            return if report.passed() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            };
        }
        Some("uninstall") => {
            // Its steps on stdout, one line each as done; what the drain meets meanwhile
            // (evictions failing, pods forced) logged on stderr.
            tracing_subscriber::fmt()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_new(&args.log_level)
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
                )
                .init();
            let mut say = |line: String| println!("{line}");
            return match member::uninstall::uninstall(&args, &mut say).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(message) => {
                    eprintln!("virtual-node uninstall: {message}");
                    ExitCode::FAILURE
                }
            };
        }
        Some(verb) => {
            let done = if verb == "join" {
                member::join::join(&args).await
            } else {
                member::join::leave(&args).await
            };
            return match done {
                Ok(lines) => {
                    for line in lines {
                        println!("{line}");
                    }
                    ExitCode::SUCCESS
                }
                Err(message) => {
                    eprintln!("virtual-node {verb}: {message}");
                    ExitCode::FAILURE
                }
            };
        }
        None => {}
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
/// of its own until shutdown: the members (the lower cluster of the single-cluster flags,
/// and those of the member Secrets of `--members-namespace`), each a lower cluster joined
/// as a virtual node, and what they share. `Err` is the one line to print: what stopped
/// it, by name. With `--leader-elect` the parts that only read (watches, metrics, kubelet
/// API) run at once, and those that write once this process holds the Lease.
async fn run(args: Args, started: CancellationToken) -> Result<(), String> {
    let lease = args.lease_config()?;
    let metrics = Arc::new(Metrics::default());
    metrics.read_allocator(tensile::allocator::jemalloc_stats);
    let (upper, lower_config) = connect(&args, &metrics).await?;
    let optional = args.optional_controllers();
    for unknown in &optional.unknown {
        warn!(controller = %unknown, "--enable-controllers: unknown controller skipped");
    }
    let upper_needs = clusters::needed_permissions(Side::Upper, args.features());
    clusters::check_permissions(&upper, &upper_needs)
        .await
        .map_err(|e| e.to_string())?;
    let cluster_id = cluster_id(&args, &upper).await?;
    let metrics_listener = metrics::bind(args.metrics_addr).await?;
    let client_ca = kubelet_client_ca(&args, &upper.client).await?;
    info!(upper = %upper.server, members_namespace = ?args.members_namespace, "starting");

    let shutdown = CancellationToken::new();
    tokio::spawn(tensile::shutdown::on_signals(shutdown.clone()));
    let mut tasks = Tasks::new(shutdown.clone());
    tasks.spawn_fallible(
        "metrics server",
        metrics::serve(metrics_listener, metrics.clone(), shutdown.clone()),
    );

    // The election outlives the members' draining: it stops on `election_stop`, once they
    // have stopped, and then gives the Lease up so a standby takes over at once.
    let election_stop = CancellationToken::new();
    let lease_label = lease
        .as_ref()
        .map(|l| format!("{}/{}", l.namespace, l.name))
        .unwrap_or_default();
    metrics.set_leader(&lease_label, lease.is_none());
    let (leading, election) = match lease {
        None => (None, None),
        Some(config) => {
            info!(lease = %lease_label, identity = %config.identity, cluster = "upper",
                "standing by until this process holds the lease");
            let (leading, election) =
                leader::elect(upper.unthrottled.clone(), config, election_stop.clone());
            let election = tokio::spawn(election);
            let guard = tokio::spawn(exit_on_lost_lease(
                leading.clone(),
                lease_label.clone(),
                metrics.clone(),
                election_stop.clone(),
            ));
            (Some(leading), Some((election, guard)))
        }
    };

    // Federated, the members share one watch of each upper kind.
    let upper_watches = args.members_namespace.as_ref().map(|_| {
        let (watches, run) = UpperWatches::new(
            &upper.client,
            &args.namespace,
            &optional,
            &metrics,
            shutdown.clone(),
        );
        tasks.spawn("shared upper watches", run);
        watches
    });
    let shared = Arc::new(Shared {
        args: args.clone(),
        upper,
        cluster_id,
        metrics,
        client_ca,
        leading,
        optional,
        upper_watches,
        node_names: Default::default(),
    });
    if let Some(namespace) = args.members_namespace.clone() {
        // Without a member of the flags, the process has started once the members of the
        // Secrets have been started (each then joins at its own pace).
        let listed = if lower_config.is_some() {
            CancellationToken::new()
        } else {
            started.clone()
        };
        let static_node = lower_config.as_ref().map(|_| args.nodename.clone());
        tasks.spawn(
            "membership",
            member::membership::run(
                shared.clone(),
                namespace,
                static_node,
                listed,
                shutdown.clone(),
            ),
        );
    }
    // --kueue-quota: the flags' node's allocatable as a Kueue flavor's quota.
    if let (Some(target), Some(_)) = (args.kueue_quota.clone(), &lower_config) {
        tasks.spawn(
            "kueue quota",
            tensile::controllers::kueue_quota::run(
                shared.upper.client.clone(),
                args.nodename.clone(),
                target,
                shared.leading.clone(),
                shutdown.clone(),
            ),
        );
    }
    // The member of the flags: its failure is the process's, as with one lower cluster.
    let flags_member = async {
        let Some(lower) = lower_config else {
            return Ok(());
        };
        let spec = MemberSpec::from_flags(&args, lower);
        let outcome = member::run(shared.clone(), spec, started.clone(), shutdown.clone()).await;
        shutdown.cancel();
        outcome
    };
    let (member_outcome, tasks_outcome) = tokio::join!(flags_member, tasks.supervise());
    let outcome = member_outcome.and(tasks_outcome.map_err(|f| f.to_string()));
    if let Some((election, guard)) = election {
        // Every writer has stopped: only now may another replica take over.
        election_stop.cancel();
        let _ = election.await;
        let _ = guard.await;
    }
    info!("stopped");
    outcome
}

/// Exits the process, status 1, the moment the Lease lapses before `election_stop`: it was
/// lost (not renewed within the renew deadline), or the election task ended. Every writer
/// must stop before another replica takes over; the restarted pod stands by. Keeps the
/// leader gauge current meanwhile.
async fn exit_on_lost_lease(
    leading: watch::Receiver<bool>,
    lease: String,
    metrics: Arc<Metrics>,
    election_stop: CancellationToken,
) {
    let outcome = leader::follow(leading, &election_stop, |leads| {
        metrics.set_leader(&lease, leads);
    })
    .await;
    if let Err(lapse) = outcome {
        error!(%lease, cluster = "upper", %lapse,
            "leader election lost: exiting so that nothing is written while another replica may lead");
        std::process::exit(1);
    }
    metrics.set_leader(&lease, false);
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

/// The upper cluster's identity on every lower object: `--cluster-id`, or the UID of the
/// upper `kube-system` namespace, which lives as long as the cluster.
async fn cluster_id(args: &Args, upper: &Cluster) -> Result<String, String> {
    match &args.cluster_id {
        Some(id) => Ok(id.clone()),
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
            .ok_or_else(|| {
                "upper cluster: namespace kube-system has no UID; set --cluster-id".into()
            }),
    }
}

/// Reads both kubeconfigs (the lower one if given), then connects to the upper API server.
async fn connect(
    args: &Args,
    metrics: &Arc<Metrics>,
) -> Result<(Cluster, Option<kube::Config>), String> {
    // Both kubeconfigs are read before either server is contacted, so a bad file is
    // reported as such, never raced by the other cluster's connection error.
    let upper_config = clusters::load_config(Side::Upper, args.kubeconfig.as_deref())
        .await
        .map_err(|e| e.to_string())?;
    let lower_config = match &args.client_kubeconfig {
        Some(path) => Some(
            clusters::load_config(Side::Lower, Some(path))
                .await
                .map_err(|e| e.to_string())?,
        ),
        None => None,
    };
    let upper_limit = RateLimit {
        qps: args.kube_api_qps,
        burst: args.kube_api_burst,
    };
    let upper = clusters::connect(
        Side::Upper,
        upper_config,
        upper_limit,
        metrics.clone(),
        None,
    )
    .await
    .map_err(|e: StartupError| e.to_string())?;
    Ok((upper, lower_config))
}

/// The CA kubelet API client certificates must chain to: `--client-verify-ca`, else the
/// upper cluster's (the `kube-root-ca.crt` ConfigMap), which signs kube-apiserver's kubelet
/// client certificate in a standard cluster; `None` with `--no-verify-clients`.
async fn kubelet_client_ca(args: &Args, upper: &kube::Client) -> Result<Option<Vec<u8>>, String> {
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
    Ok(ca_pem)
}
