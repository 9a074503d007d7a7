//! The descheduler's counters (prometheus-client), served with `/healthz` on
//! `--metrics-addr`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use super::select::Skip;

/// Label of the skipped counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SkipLabels {
    /// Why the pod was left alone.
    pub reason: String,
}

/// Everything the descheduler counts.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Pods on virtual nodes looked at.
    pub considered: Counter,
    /// Pods moved (evicted or re-created).
    pub moved: Counter,
    /// Pods a dry run would have moved.
    pub would_move: Counter,
    /// Pods left alone, by reason.
    pub skipped: Family<SkipLabels, Counter>,
    /// Failed rounds and failed moves.
    pub errors: Counter,
    /// 1 while this replica is the leader.
    pub leader: Gauge,
    /// Set once the first connection to the API server succeeded.
    pub healthy: AtomicBool,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tensile_descheduler");
        let considered = Counter::default();
        let moved = Counter::default();
        let would_move = Counter::default();
        let skipped = Family::<SkipLabels, Counter>::default();
        let errors = Counter::default();
        let leader = Gauge::default();
        registry.register(
            "pods_considered",
            "Pods on virtual nodes looked at",
            considered.clone(),
        );
        registry.register("pods_moved", "Pods evicted or re-created", moved.clone());
        registry.register(
            "pods_would_move",
            "Pods a dry run would have moved",
            would_move.clone(),
        );
        registry.register(
            "pods_skipped",
            "Pods left alone, by reason",
            skipped.clone(),
        );
        registry.register("errors", "Failed rounds and moves", errors.clone());
        registry.register("leader", "1 while this replica leads", leader.clone());
        // Every reason shows from the start, at zero.
        for reason in Skip::ALL
            .iter()
            .map(|s| s.label())
            .chain(super::Acted::SKIP_LABELS)
        {
            skipped
                .get_or_create(&SkipLabels {
                    reason: reason.into(),
                })
                .get();
        }
        Self {
            registry,
            considered,
            moved,
            would_move,
            skipped,
            errors,
            leader,
            healthy: AtomicBool::new(true),
        }
    }
}

impl Metrics {
    /// Counts one pod skipped for `reason`.
    pub fn skip(&self, reason: &str) {
        self.skipped
            .get_or_create(&SkipLabels {
                reason: reason.into(),
            })
            .inc();
    }

    /// OpenMetrics text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Serves `/healthz` and `/metrics` on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = Router::new()
        .route(
            "/healthz",
            get(|State(m): State<Arc<Metrics>>| async move {
                if m.healthy.load(Ordering::Relaxed) {
                    (StatusCode::OK, "ok")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "unhealthy")
                }
            }),
        )
        .route(
            "/metrics",
            get(|State(m): State<Arc<Metrics>>| async move {
                (
                    [(
                        header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    m.render(),
                )
                    .into_response()
            }),
        )
        .with_state(metrics);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_counter() {
        let metrics = Metrics::default();
        metrics.considered.inc();
        metrics.moved.inc();
        metrics.skip("too_young");
        let text = metrics.render();
        for line in [
            "tensile_descheduler_pods_considered_total 1",
            "tensile_descheduler_pods_moved_total 1",
            "tensile_descheduler_pods_skipped_total{reason=\"too_young\"} 1",
            "tensile_descheduler_pods_skipped_total{reason=\"node_limit\"} 0",
            "tensile_descheduler_pods_skipped_total{reason=\"placed_below\"} 0",
            "tensile_descheduler_pods_skipped_total{reason=\"pinned_by_claim\"} 0",
            "tensile_descheduler_errors_total 0",
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
    }
}
