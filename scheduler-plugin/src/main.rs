//! tensile-scheduler-extender: wiring only.

use std::process::ExitCode;
use std::sync::Arc;

use tensile::cli::parse_args;
use tensile::shutdown::Tasks;
use tensile_scheduler_extender::cli::Cli;
use tensile_scheduler_extender::extender::Extender;
use tensile_scheduler_extender::metrics::Metrics;
use tensile_scheduler_extender::server::{self, App};
use tensile_scheduler_extender::watch;
use tokio_util::sync::CancellationToken;
use tracing::info;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = match parse_args::<Cli>("tensile-scheduler-extender", std::env::args_os()) {
        Ok(cli) => cli,
        Err(status) => return status,
    };
    tensile::logging::init(&cli.log_level, cli.log_format);
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("tensile-scheduler-extender: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<(), String> {
    let clusters = cli.clusters().map_err(|e| e.to_string())?;
    let tls = match (&cli.tls_cert, &cli.tls_key) {
        (Some(cert), Some(key)) => {
            Some(server::tls_acceptor(cert, key).map_err(|e| e.to_string())?)
        }
        _ => None,
    };
    let listener = tokio::net::TcpListener::bind(cli.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", cli.listen))?;
    let shutdown = CancellationToken::new();
    tokio::spawn(tensile::shutdown::on_signals(shutdown.clone()));
    let settings = Extender {
        on_unknown: cli.on_unknown,
        assume_ttl: cli.assume_ttl,
        ..Extender::default()
    };
    let upper = watch::upper_client(cli.kubeconfig.as_deref())
        .await
        .map_err(|e| e.to_string())?;
    let (extender, watches) = watch::connect(&clusters, settings, shutdown.clone())
        .await
        .map_err(|e| e.to_string())?;
    let upper_nodes = watch::run_upper(upper, extender.upper.clone(), shutdown.clone());
    let nodes: Vec<&str> = clusters.iter().map(|c| c.node.as_str()).collect();
    info!(listen = %cli.listen, tls = tls.is_some(), virtual_nodes = ?nodes, "serving");
    let app = Arc::new(App {
        extender,
        metrics: Metrics::default(),
    });
    let mut tasks = Tasks::new(shutdown.clone());
    tasks.spawn("lower cluster watches", watches);
    tasks.spawn("upper node watch", upper_nodes);
    tasks.spawn(
        "HTTP server",
        server::serve(listener, tls, server::router(app), shutdown.clone()),
    );
    let outcome = tasks.supervise().await;
    info!("stopped");
    outcome.map_err(|failure| failure.to_string())
}
