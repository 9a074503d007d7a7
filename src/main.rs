//! virtual-node: joins the lower cluster to the upper one as a virtual node. Wiring only.

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use clap::Parser;
use k8s_openapi::api::core::v1::{ConfigMap, Taint};
use kube::runtime::events::{Recorder, Reporter};
use tensile::cli::Args;
use tensile::clusters::{
    self, LOWER_PERMISSIONS, LOWER_PV_PERMISSIONS, LOWER_SERVICE_PERMISSIONS, RateLimit,
    StartupError, UPPER_PERMISSIONS, UPPER_PV_PERMISSIONS, UPPER_SERVICE_PERMISSIONS,
};
use tensile::controllers::{self, Context};
use tensile::kubelet_api;
use tensile::metrics::{self, Metrics};
use tensile::node::{self, spec::NodeConfig};
use tensile::side::Side;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&args.log_level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).init();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("virtual-node: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    validate_node_name(&args.nodename)?;
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
    let metrics = Arc::new(Metrics::default());
    let (upper, lower) = tokio::try_join!(
        clusters::connect(Side::Upper, upper_config, upper_limit, metrics.clone()),
        clusters::connect(Side::Lower, lower_config, lower_limit, metrics.clone()),
    )
    .map_err(|e: StartupError| e.to_string())?;
    let optional = args.optional_controllers();
    for unknown in &optional.unknown {
        warn!(controller = %unknown, "--enable-controllers: unknown controller skipped");
    }
    let (mut upper_needs, mut lower_needs) =
        (UPPER_PERMISSIONS.to_vec(), LOWER_PERMISSIONS.to_vec());
    if optional.services {
        upper_needs.extend_from_slice(UPPER_SERVICE_PERMISSIONS);
        lower_needs.extend_from_slice(LOWER_SERVICE_PERMISSIONS);
    }
    if optional.volumes {
        upper_needs.extend_from_slice(UPPER_PV_PERMISSIONS);
        lower_needs.extend_from_slice(LOWER_PV_PERMISSIONS);
    }
    tokio::try_join!(
        clusters::check_permissions(&upper, &upper_needs),
        clusters::check_permissions(&lower, &lower_needs),
    )
    .map_err(|e| e.to_string())?;
    let listener = metrics::bind(args.metrics_addr).await?;
    let (kubelet_listener, kubelet_tls, kubelet_api) =
        kubelet_api_setup(&args, &upper.client, &lower.client).await?;
    info!(
        node = %args.nodename, upper = %upper.server, lower = %lower.server,
        lower_version = %lower.version, pv_controllers = optional.volumes,
        service_controllers = optional.services, "starting"
    );

    let shutdown = CancellationToken::new();
    tokio::spawn(tensile::shutdown::on_signals(shutdown.clone()));

    let node_config = NodeConfig {
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
    };
    let reporter = Reporter {
        controller: "tensile-virtual-node".into(),
        instance: Some(args.nodename.clone()),
    };
    let ctx = Arc::new(Context::new(
        upper.client.clone(),
        lower.client.clone(),
        args.nodename.clone(),
        args.ignore_labels
            .iter()
            .filter(|l| !l.is_empty())
            .cloned()
            .collect(),
        args.enable_serviceaccount,
        args.namespace.clone(),
        Recorder::new(upper.client.clone(), reporter),
        metrics.clone(),
    ));

    let (capacity_tx, mut capacity_rx) = tokio::sync::watch::channel(None);
    let capacity_watch = node::watch_capacity(
        lower.client.clone(),
        args.nodename.clone(),
        capacity_tx,
        shutdown.clone(),
    );
    let serve = metrics::serve(listener, metrics.clone(), shutdown.clone());
    let kubelet_serve = on_own_task(
        "kubelet API",
        shutdown.clone(),
        kubelet_api::serve(kubelet_listener, kubelet_tls, kubelet_api, shutdown.clone()),
    );

    let main = async {
        // Register only once capacity is known, so the node never offers room it lacks.
        let capacity = tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            c = capacity_rx.wait_for(Option::is_some) => c
                .map_err(|_| "lower cluster: capacity watch ended".to_owned())?
                .clone()
                .unwrap_or_default(),
        };
        let registered = node::register(&upper.client, &node_config, &capacity)
            .await
            .map_err(|e| e.to_string())?;
        info!(node = %args.nodename, "node registered");

        let controllers::pod_watch::PodWatches {
            stores,
            pump,
            pods: pod_triggers,
            status: status_triggers,
        } = controllers::pod_watch::watches(&ctx);
        let synced = stores.synced.clone();
        let config_watches = controllers::config::watches(&ctx);
        let service_watches = optional
            .services
            .then(|| controllers::service::watches(&ctx));
        let volume_watches = optional.volumes.then(|| controllers::volume::watches(&ctx));
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
        let config = controllers::config::run(
            ctx.clone(),
            config_watches,
            stores.clone(),
            args.full_resync_period,
            shutdown.clone(),
        );
        let events = controllers::events::run(ctx.clone(), stores.clone(), shutdown.clone());
        let services = async {
            if let Some(watches) = service_watches {
                controllers::service::run(
                    ctx.clone(),
                    watches,
                    args.full_resync_period,
                    shutdown.clone(),
                )
                .await;
            }
        };
        let volumes = async {
            if let Some(watches) = volume_watches {
                controllers::volume::run(
                    ctx.clone(),
                    watches,
                    args.full_resync_period,
                    shutdown.clone(),
                )
                .await;
            }
        };
        let workers = args.pod_sync_workers.max(1);
        let pods = on_own_task(
            "pod controller",
            shutdown.clone(),
            controllers::pod::run(
                ctx.clone(),
                pod_triggers,
                stores.clone(),
                workers,
                args.full_resync_period,
                shutdown.clone(),
            ),
        );
        let status_workers = match args.status_sync_workers {
            0 => workers.saturating_mul(3),
            n => n,
        };
        let status = on_own_task(
            "status reflector",
            shutdown.clone(),
            controllers::status::run(
                ctx.clone(),
                status_triggers,
                stores.clone(),
                status_workers,
                args.full_resync_period,
                shutdown.clone(),
            ),
        );
        // The watches run until shutdown; the controllers stop on it by themselves.
        let stop = shutdown.clone();
        let pump = on_own_task("pod watches", shutdown.clone(), async move {
            tokio::select! {
                () = stop.cancelled() => {}
                () = pump => {}
            }
        });
        let gc = async {
            let ready = async {
                if synced.wait().await.is_ok() && watches_ready.wait().await.is_ok() {
                    metrics.ready.store(true, Ordering::Relaxed);
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = ready => {}
            }
            controllers::gc::run(ctx.clone(), stores.clone(), shutdown.clone()).await;
        };
        let keep_alive = node::keep_alive(
            upper.client.clone(),
            lower.client.clone(),
            node_config.clone(),
            args.enable_node_lease,
            capacity_rx.clone(),
            registered,
            shutdown.clone(),
        );
        tokio::join!(
            pump, pods, status, gc, keep_alive, config, events, services, volumes
        );
        Ok::<(), String>(())
    };
    let (result, (), served, ()) = tokio::join!(
        async {
            let result = main.await;
            shutdown.cancel();
            result
        },
        capacity_watch,
        serve,
        kubelet_serve,
    );
    if let Err(e) = served {
        error!(error = %e, "metrics server");
    }
    info!("stopped");
    result
}

/// The kubelet API's port, TLS and authenticator. The client CA defaults to the upper
/// cluster's (the `kube-root-ca.crt` ConfigMap), which signs kube-apiserver's kubelet
/// client certificate in a standard cluster.
async fn kubelet_api_setup(
    args: &Args,
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
                    "upper cluster: no kube-system/kube-root-ca.crt with ca.crt: set                      APISERVER_CA_CERT_LOCATION (--client-verify-ca) for the kubelet API"
                        .to_owned()
                })?;
            Some(pem.into_bytes())
        }
    };
    if args.no_verify_clients {
        warn!(
            "--no-verify-clients: the kubelet API (logs, exec, port-forward) is open to              ANYONE who reaches port {}: never do this outside a lab",
            args.kubelet_port
        );
    }
    let auth = kubelet_api::auth::Authenticator::new(
        ca_pem.as_deref(),
        upper.clone(),
        args.nodename.clone(),
        kubelet_api::auth::AuthConfig {
            token_webhook: args.authentication_token_webhook,
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
        node: args.nodename.clone(),
        auth,
    });
    Ok((listener, tls, api))
}

/// Runs `task` as a task of its own, so that the busiest parts (pod watches, pod
/// controller, status reflector) use every core and one's work never waits for another's
/// turn. Should it panic, everything shuts down rather than run on half-working.
async fn on_own_task(
    name: &'static str,
    shutdown: CancellationToken,
    task: impl Future<Output = ()> + Send + 'static,
) {
    if let Err(error) = tokio::spawn(task).await {
        error!(task = name, %error, "task failed; shutting down");
        shutdown.cancel();
    }
}

/// The node name is also a label value on every lower object (ownership), so it must be
/// a valid one.
fn validate_node_name(name: &str) -> Result<(), String> {
    let valid = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name.ends_with(|c: char| c.is_ascii_alphanumeric());
    if valid {
        Ok(())
    } else {
        Err(format!(
            "--nodename {name:?} must be a DNS name of at most 63 characters (it is also a label value)"
        ))
    }
}
