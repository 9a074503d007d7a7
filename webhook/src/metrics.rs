//! Counters and a latency histogram, served as Prometheus text on `/metrics`.

use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::mutate::Decision;

/// Upper bounds of the latency buckets, in microseconds.
const BUCKETS_US: [u64; 10] = [
    100, 250, 500, 1_000, 2_000, 5_000, 10_000, 50_000, 250_000, 1_000_000,
];

/// Everything counted.
#[derive(Debug, Default)]
pub struct Metrics {
    decisions: [AtomicU64; Decision::ALL.len()],
    /// Requests answered with HTTP 400.
    pub bad_requests: AtomicU64,
    /// Warnings returned to users.
    pub warnings: AtomicU64,
    /// Serving certificates loaded after the first.
    pub cert_reloads: AtomicU64,
    /// Certificate reloads that failed (the previous certificate stays in use).
    pub cert_reload_errors: AtomicU64,
    /// TLS handshakes that failed or timed out.
    pub tls_handshake_errors: AtomicU64,
    latency_buckets: [AtomicU64; BUCKETS_US.len()],
    latency_count: AtomicU64,
    latency_sum_us: AtomicU64,
    /// Whether the PVC cache has synced (readiness).
    pub ready: AtomicBool,
}

impl Metrics {
    /// Counts a request's decision.
    pub fn decided(&self, decision: Decision) {
        if let Some(i) = Decision::ALL.iter().position(|d| *d == decision) {
            self.decisions[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Requests that ended in `decision` so far.
    pub fn decisions(&self, decision: Decision) -> u64 {
        Decision::ALL
            .iter()
            .position(|d| *d == decision)
            .map_or(0, |i| self.decisions[i].load(Ordering::Relaxed))
    }

    /// Records how long a review took to answer.
    pub fn observe(&self, elapsed: Duration) {
        let us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        for (bound, bucket) in BUCKETS_US.iter().zip(&self.latency_buckets) {
            if us <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.latency_count.fetch_add(1, Ordering::Relaxed);
        self.latency_sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP tensile_webhook_requests_total Admission reviews answered, by decision.\n\
             # TYPE tensile_webhook_requests_total counter"
        );
        for (decision, count) in Decision::ALL.iter().zip(&self.decisions) {
            let _ = writeln!(
                out,
                "tensile_webhook_requests_total{{decision=\"{}\"}} {}",
                decision.label(),
                load(count)
            );
        }
        for (name, help, counter) in [
            (
                "tensile_webhook_bad_requests_total",
                "Requests answered with HTTP 400.",
                &self.bad_requests,
            ),
            (
                "tensile_webhook_warnings_total",
                "Warnings returned in admission responses.",
                &self.warnings,
            ),
            (
                "tensile_webhook_cert_reloads_total",
                "Serving certificates reloaded from disk.",
                &self.cert_reloads,
            ),
            (
                "tensile_webhook_cert_reload_errors_total",
                "Certificate reloads that failed (the previous one stays in use).",
                &self.cert_reload_errors,
            ),
            (
                "tensile_webhook_tls_handshake_errors_total",
                "TLS handshakes that failed or timed out.",
                &self.tls_handshake_errors,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                load(counter)
            );
        }
        let name = "tensile_webhook_review_duration_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Time to answer an admission review.\n# TYPE {name} histogram"
        );
        for (bound, bucket) in BUCKETS_US.iter().zip(&self.latency_buckets) {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{}\"}} {}",
                *bound as f64 / 1e6,
                load(bucket)
            );
        }
        let count = load(&self.latency_count);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            load(&self.latency_sum_us) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {count}");
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
        m.observe(Duration::from_micros(300));
        m.observe(Duration::from_millis(3));
        let text = m.render();
        assert!(text.contains("tensile_webhook_requests_total{decision=\"mutated\"} 2"));
        assert!(text.contains("tensile_webhook_requests_total{decision=\"ignored\"} 1"));
        assert!(text.contains("tensile_webhook_review_duration_seconds_bucket{le=\"0.00025\"} 0"));
        assert!(text.contains("tensile_webhook_review_duration_seconds_bucket{le=\"0.0005\"} 1"));
        assert!(text.contains("tensile_webhook_review_duration_seconds_bucket{le=\"0.005\"} 2"));
        assert!(text.contains("tensile_webhook_review_duration_seconds_count 2"));
        assert_eq!(m.decisions(Decision::Mutated), 2);
    }
}
