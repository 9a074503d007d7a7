//! Counters and a latency histogram (prometheus-client), served as text on `/metrics`.

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::mutate::Decision;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 10] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25, 1.0,
];

/// Label of the request counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// What the webhook decided (`Decision::label`).
    pub decision: &'static str,
}

/// Everything counted.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    decisions: Family<DecisionLabels, Counter>,
    /// Requests answered with HTTP 400.
    pub bad_requests: Counter,
    /// Warnings returned to users.
    pub warnings: Counter,
    /// Serving certificates loaded after the first.
    pub cert_reloads: Counter,
    /// Certificate reloads that failed (the previous certificate stays in use).
    pub cert_reload_errors: Counter,
    /// TLS handshakes that failed or timed out.
    pub tls_handshake_errors: Counter,
    review_seconds: Histogram,
    /// Whether the PVC cache has synced (readiness).
    pub ready: AtomicBool,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tensile_webhook");
        let decisions = Family::<DecisionLabels, Counter>::default();
        let review_seconds = Histogram::new(BUCKETS);
        let counters: [(&str, &str, Counter); 5] = [
            (
                "bad_requests",
                "Requests answered with HTTP 400",
                Counter::default(),
            ),
            (
                "warnings",
                "Warnings returned in admission responses",
                Counter::default(),
            ),
            (
                "cert_reloads",
                "Serving certificates reloaded from disk",
                Counter::default(),
            ),
            (
                "cert_reload_errors",
                "Certificate reloads that failed (the previous one stays in use)",
                Counter::default(),
            ),
            (
                "tls_handshake_errors",
                "TLS handshakes that failed or timed out",
                Counter::default(),
            ),
        ];
        registry.register(
            "requests",
            "Admission reviews answered, by decision",
            decisions.clone(),
        );
        for (name, help, counter) in &counters {
            registry.register(*name, *help, counter.clone());
        }
        registry.register(
            "review_duration_seconds",
            "Time to answer an admission review",
            review_seconds.clone(),
        );
        // Every decision shows from the start, at zero.
        for decision in Decision::ALL {
            decisions
                .get_or_create(&DecisionLabels {
                    decision: decision.label(),
                })
                .get();
        }
        let [
            bad_requests,
            warnings,
            cert_reloads,
            cert_reload_errors,
            tls_handshake_errors,
        ] = counters.map(|(_, _, counter)| counter);
        Self {
            registry,
            decisions,
            bad_requests,
            warnings,
            cert_reloads,
            cert_reload_errors,
            tls_handshake_errors,
            review_seconds,
            ready: AtomicBool::new(false),
        }
    }
}

impl Metrics {
    /// Counts a request's decision.
    pub fn decided(&self, decision: Decision) {
        self.decisions
            .get_or_create(&DecisionLabels {
                decision: decision.label(),
            })
            .inc();
    }

    /// Requests that ended in `decision` so far.
    pub fn decisions(&self, decision: Decision) -> u64 {
        self.decisions
            .get(&DecisionLabels {
                decision: decision.label(),
            })
            .map_or(0, |c| c.get())
    }

    /// Records how long a review took to answer.
    pub fn observe(&self, elapsed: Duration) {
        self.review_seconds.observe(elapsed.as_secs_f64());
    }

    /// OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_a_cumulative_histogram() {
        let m = Metrics::default();
        m.decided(Decision::Mutated);
        m.decided(Decision::Mutated);
        m.decided(Decision::Ignored);
        m.bad_requests.inc();
        m.observe(Duration::from_micros(300));
        m.observe(Duration::from_millis(3));
        let text = m.render();
        for line in [
            "tensile_webhook_requests_total{decision=\"mutated\"} 2",
            "tensile_webhook_requests_total{decision=\"ignored\"} 1",
            "tensile_webhook_requests_total{decision=\"unchanged\"} 0",
            "tensile_webhook_bad_requests_total 1",
            "tensile_webhook_warnings_total 0",
            "tensile_webhook_cert_reloads_total 0",
            "tensile_webhook_cert_reload_errors_total 0",
            "tensile_webhook_tls_handshake_errors_total 0",
            "tensile_webhook_review_duration_seconds_bucket{le=\"0.00025\"} 0",
            "tensile_webhook_review_duration_seconds_bucket{le=\"0.0005\"} 1",
            "tensile_webhook_review_duration_seconds_bucket{le=\"0.005\"} 2",
            "tensile_webhook_review_duration_seconds_bucket{le=\"+Inf\"} 2",
            "tensile_webhook_review_duration_seconds_count 2",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
        assert_eq!(m.decisions(Decision::Mutated), 2);
    }
}
