//! Counters of what virtual-node did, served as Prometheus text on `--metrics-addr`,
//! with `/healthz` and `/readyz`.

use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio_util::sync::CancellationToken;

/// A monotonically increasing counter.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds one.
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    /// The current value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Everything counted.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Pod reconciles run.
    pub reconciles: Counter,
    /// Pod reconciles that failed.
    pub errors: Counter,
    /// Upper pod status writes.
    pub status_writes: Counter,
    /// Lower pods created.
    pub lower_creates: Counter,
    /// Lower pods updated.
    pub lower_updates: Counter,
    /// Orphaned lower pods deleted.
    pub orphans_deleted: Counter,
    /// Whether every watch has synced and the node is registered.
    pub ready: AtomicBool,
}

impl Metrics {
    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (name, help, counter) in [
            (
                "tensile_pod_reconciles_total",
                "Pod reconciles run.",
                &self.reconciles,
            ),
            (
                "tensile_pod_reconcile_errors_total",
                "Pod reconciles that failed.",
                &self.errors,
            ),
            (
                "tensile_upper_status_writes_total",
                "Upper pod status writes.",
                &self.status_writes,
            ),
            (
                "tensile_lower_pod_creates_total",
                "Lower pods created.",
                &self.lower_creates,
            ),
            (
                "tensile_lower_pod_updates_total",
                "Lower pods updated.",
                &self.lower_updates,
            ),
            (
                "tensile_orphans_deleted_total",
                "Orphaned lower pods deleted.",
                &self.orphans_deleted,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                counter.get()
            );
        }
        out
    }
}

/// Serves `/healthz`, `/readyz` and `/metrics` on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(m): State<Arc<Metrics>>| async move {
                if m.ready.load(Ordering::Relaxed) {
                    (StatusCode::OK, "ok")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "starting")
                }
            }),
        )
        .route(
            "/metrics",
            get(|State(m): State<Arc<Metrics>>| async move { m.render() }),
        )
        .with_state(metrics);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

/// Binds the metrics address, naming it on failure.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, String> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on --metrics-addr {addr}: {e}"))
}
