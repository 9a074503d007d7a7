//! tensile-webhook: wiring only.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use tensile::cli::{parse_args, strip_klog_flags};
use tensile::clusters;
use tensile::logging;
use tensile::shutdown::Tasks;
use tensile::side::Side;
use tensile_webhook::cli::{Cli, Command, GenCertsArgs, ServeArgs};
use tensile_webhook::memory::DeschedulerMemory;
use tensile_webhook::metrics::Metrics;
use tensile_webhook::mutate::{MutateConfig, virtual_node_toleration};
use tensile_webhook::server::{self, App};
use tensile_webhook::{certs, pvc, tls};
use tokio_util::sync::CancellationToken;
use tracing::info;

#[tokio::main]
async fn main() -> ExitCode {
    let (argv, klog_flags) = strip_klog_flags(std::env::args_os());
    let cli = match parse_args::<Cli>("tensile-webhook", argv) {
        Ok(cli) => cli,
        Err(status) => return status,
    };
    if cli.version {
        println!("tensile-webhook {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    let result = match cli.command {
        Some(Command::GenCerts(args)) => gen_certs(&args),
        None => {
            logging::init(&cli.serve.log_level, cli.serve.log_format);
            let mut ignored = cli.serve.ignored_flags();
            ignored.extend(klog_flags);
            logging::log_ignored_flags(&ignored);
            serve(cli.serve).await
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("tensile-webhook: {message}");
            ExitCode::FAILURE
        }
    }
}

fn gen_certs(args: &GenCertsArgs) -> Result<(), String> {
    let mut names = certs::service_names(&args.service, &args.namespace);
    names.extend(args.host.iter().filter(|h| !h.is_empty()).cloned());
    let generated = certs::generate(&args.service, &names, args.days).map_err(|e| e.to_string())?;
    generated.write(&args.out).map_err(|e| e.to_string())?;
    eprintln!(
        "wrote ca.crt, tls.crt, tls.key to {} (valid for {})",
        args.out.display(),
        names.join(", ")
    );
    println!("{}", generated.ca_bundle());
    Ok(())
}

async fn serve(args: ServeArgs) -> Result<(), String> {
    let (Some(cert), Some(key)) = (args.tlscert.clone(), args.tlskey.clone()) else {
        return Err("--tlscert and --tlskey are required (see `tensile-webhook gen-certs`)".into());
    };
    let (loaded, bytes) = tls::load(&cert, &key).map_err(|e| e.to_string())?;
    let resolver = Arc::new(tls::ReloadingCert::new(loaded));
    let tls_config = tls::server_config(resolver.clone()).map_err(|e| e.to_string())?;

    let config = clusters::load_config(Side::Upper, args.kubeconfig.as_deref())
        .await
        .map_err(|e| e.to_string())?;
    let server_url = config.cluster_url.to_string();
    let client = kube::Client::try_from(config).map_err(|e| format!("upper cluster: {e}"))?;

    let addr = SocketAddr::new(args.address, args.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;

    let shutdown = CancellationToken::new();
    tokio::spawn(tensile::shutdown::on_signals(shutdown.clone()));
    let mut tasks = Tasks::new(shutdown.clone());
    let metrics = Arc::new(Metrics::default());
    let (pvcs, pvc_watch) = pvc::watch(client, metrics.clone(), shutdown.clone());
    tasks.spawn("PVC watch", pvc_watch);
    let app = Arc::new(App {
        config: MutateConfig {
            ignore_selector_keys: nonempty(&args.ignore_selector_keys),
            excluded_namespaces: nonempty(&args.excluded_namespaces),
            eager_namespaces: nonempty(&args.eager_namespaces),
            prefer_regular_nodes: args.prefer_regular_nodes,
            virtual_node_toleration: args
                .virtual_node_toleration
                .then(|| virtual_node_toleration(&args.taint_key, &args.taint_effect)),
        },
        memory: DeschedulerMemory::default(),
        volumes: Arc::new(pvcs),
        metrics: metrics.clone(),
        max_body_bytes: args.max_body_bytes,
    });
    info!(%addr, upper = %server_url, cert = %cert.display(), "serving");
    tasks.spawn(
        "certificate reload",
        tls::watch(
            cert,
            key,
            bytes,
            resolver,
            metrics.clone(),
            args.cert_reload_interval,
            shutdown.clone(),
        ),
    );
    tasks.spawn(
        "HTTPS server",
        server::serve_tls(
            listener,
            tls_config,
            server::router(app),
            metrics,
            shutdown.clone(),
        ),
    );
    let outcome = tasks.supervise().await;
    info!("stopped");
    outcome.map_err(|failure| failure.to_string())
}

fn nonempty(values: &[String]) -> BTreeSet<String> {
    values
        .iter()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
        .collect()
}
