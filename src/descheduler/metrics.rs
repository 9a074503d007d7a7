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
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use super::home::HomeSkip;
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
    /// Burst pods evicted to come home.
    pub home_moves: Counter,
    /// Burst pods a dry run would have moved home.
    pub home_would_move: Counter,
    /// Evictions to come home refused (a PodDisruptionBudget): retried next round.
    pub home_refusals: Counter,
    /// Replacements of pods moved home that were placed on a virtual node again.
    pub home_rebursts: Counter,
    /// Burst pods left on their virtual node this round, by reason.
    pub home_skipped: Family<SkipLabels, Counter>,
    /// How long each pod moved home had been on its virtual node.
    pub home_time_on_virtual_node: Histogram,
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
        let home_moves = Counter::default();
        let home_would_move = Counter::default();
        let home_refusals = Counter::default();
        let home_rebursts = Counter::default();
        let home_skipped = Family::<SkipLabels, Counter>::default();
        // 10 s to about 45 h.
        let home_time_on_virtual_node = Histogram::new(exponential_buckets(10.0, 2.0, 15));
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
        registry.register(
            "return_home_moves",
            "Burst pods evicted to come home",
            home_moves.clone(),
        );
        registry.register(
            "return_home_would_move",
            "Burst pods a dry run would have moved home",
            home_would_move.clone(),
        );
        registry.register(
            "return_home_refusals",
            "Evictions to come home refused by a PodDisruptionBudget",
            home_refusals.clone(),
        );
        registry.register(
            "return_home_rebursts",
            "Replacements of pods moved home placed on a virtual node again",
            home_rebursts.clone(),
        );
        registry.register(
            "return_home_skipped",
            "Burst pods left on their virtual node, by reason",
            home_skipped.clone(),
        );
        registry.register_with_unit(
            "return_home_time_on_virtual_node",
            "How long each pod moved home had been on its virtual node",
            prometheus_client::registry::Unit::Seconds,
            home_time_on_virtual_node.clone(),
        );
        for reason in HomeSkip::ALL
            .iter()
            .map(|s| s.label())
            .chain([super::Acted::SKIP_LABELS[0]])
        {
            home_skipped
                .get_or_create(&SkipLabels {
                    reason: reason.into(),
                })
                .get();
        }
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
            home_moves,
            home_would_move,
            home_refusals,
            home_rebursts,
            home_skipped,
            home_time_on_virtual_node,
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

    /// Counts one burst pod left on its virtual node for `reason`.
    pub fn home_skip(&self, reason: &str) {
        self.home_skipped
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
            "tensile_descheduler_return_home_moves_total 0",
            "tensile_descheduler_return_home_refusals_total 0",
            "tensile_descheduler_return_home_rebursts_total 0",
            "tensile_descheduler_return_home_skipped_total{reason=\"room_not_held\"} 0",
            "tensile_descheduler_return_home_time_on_virtual_node_seconds_count 0",
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
    }
}
