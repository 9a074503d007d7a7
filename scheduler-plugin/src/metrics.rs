//! Prometheus metrics (`/metrics`): request latency per verb, decisions per outcome,
//! bad requests, and per lower cluster whether it is known and how many pods are in
//! flight there.

use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::extender::{Extender, Outcome};

type Labels = [(&'static str, &'static str); 1];
type NodeLabels = [(&'static str, String); 1];

/// The extender's metrics and their registry.
pub struct Metrics {
    registry: Registry,
    latency: Family<Labels, Histogram, fn() -> Histogram>,
    decisions: Family<[(&'static str, &'static str); 2], Counter>,
    bad_requests: Family<Labels, Counter>,
    known: Family<NodeLabels, Gauge>,
    in_flight: Family<NodeLabels, Gauge>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

fn latency_histogram() -> Histogram {
    // 50 µs … ~0.8 s.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 15))
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tensile_extender");
        let latency = Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        let decisions = Family::default();
        let bad_requests = Family::default();
        let known = Family::default();
        let in_flight = Family::default();
        registry.register(
            "request_duration_seconds",
            "Time to answer a filter or prioritize call, by verb",
            latency.clone(),
        );
        registry.register(
            "decisions",
            "Nodes judged by filter, by outcome (fits, no_fit, unknown, not_virtual, bad_pod)",
            decisions.clone(),
        );
        registry.register(
            "bad_requests",
            "Requests answered with HTTP 400, by verb",
            bad_requests.clone(),
        );
        registry.register(
            "lower_cluster_known",
            "1 when the virtual node's lower cluster is synced and reachable",
            known.clone(),
        );
        registry.register(
            "pods_in_flight",
            "Pods counted in the virtual node's lower cluster but not bound there yet: lower \
             pods not scheduled, upper pods that passed filter and have no lower copy yet",
            in_flight.clone(),
        );
        Self {
            registry,
            latency,
            decisions,
            bad_requests,
            known,
            in_flight,
        }
    }
}

impl Metrics {
    /// One call of `verb` took `elapsed`.
    pub fn observe(&self, verb: &'static str, elapsed: Duration) {
        self.latency
            .get_or_create(&[("verb", verb)])
            .observe(elapsed.as_secs_f64());
    }

    /// Filter judged nodes with these outcomes.
    pub fn decided(&self, outcomes: &[Outcome]) {
        for outcome in outcomes {
            self.decisions
                .get_or_create(&[("verb", "filter"), ("outcome", outcome.label())])
                .inc();
        }
    }

    /// A call of `verb` was answered with 400.
    pub fn bad_request(&self, verb: &'static str) {
        self.bad_requests.get_or_create(&[("verb", verb)]).inc();
    }

    /// The text exposition, with each lower cluster's state read now.
    pub fn render(&self, extender: &Extender) -> String {
        for (node, cluster) in &extender.clusters {
            let state = cluster.read();
            let labels = [("node", node.clone())];
            self.known
                .get_or_create(&labels)
                .set(i64::from(state.known().is_ok()));
            self.in_flight
                .get_or_create(&labels)
                .set(i64::try_from(state.cache.in_flight()).unwrap_or(i64::MAX));
        }
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
