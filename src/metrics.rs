//! Counters of what virtual-node did, served as Prometheus text on `--metrics-addr`,
//! with `/healthz` and `/readyz`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio_util::sync::CancellationToken;

use crate::side::Side;

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

/// Upper bounds of the [`Histogram`] buckets, in seconds.
pub const LATENCY_BUCKETS: [f64; 11] =
    [0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0];

/// A latency histogram over [`LATENCY_BUCKETS`].
#[derive(Debug, Default)]
pub struct Histogram {
    /// Observations per bucket (not cumulative); the last is above every bound.
    buckets: [Counter; LATENCY_BUCKETS.len() + 1],
    sum_micros: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, took: std::time::Duration) {
        let secs = took.as_secs_f64();
        let bucket = LATENCY_BUCKETS
            .iter()
            .position(|bound| secs <= *bound)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[bucket].inc();
        let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }

    /// Prometheus text for the histogram `name`.
    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, bucket) in self.buckets.iter().enumerate() {
            cumulative += bucket.get();
            match LATENCY_BUCKETS.get(i) {
                Some(bound) => {
                    let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
                }
                None => {
                    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
                }
            }
        }
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {cumulative}");
    }
}

/// API requests sent, by cluster and verb (to tell what each mirrored pod costs).
#[derive(Debug, Default)]
pub struct ApiRequests {
    counts: [[Counter; VERBS.len()]; 2],
}

/// The verbs counted, from the HTTP method (a GET with `watch=` is a watch).
pub const VERBS: [&str; 6] = ["get", "watch", "create", "update", "patch", "delete"];

impl ApiRequests {
    /// Counts one request to `side`.
    pub fn record<B>(&self, side: Side, request: &http::Request<B>) {
        let watch = request
            .uri()
            .query()
            .is_some_and(|q| q.split('&').any(|p| p.starts_with("watch=")));
        let verb = match *request.method() {
            http::Method::GET if watch => 1,
            http::Method::GET => 0,
            http::Method::POST => 2,
            http::Method::PUT => 3,
            http::Method::PATCH => 4,
            http::Method::DELETE => 5,
            _ => return,
        };
        self.counts[side as usize][verb].inc();
    }

    /// Requests of `verb` sent to `side`.
    pub fn get(&self, side: Side, verb: &str) -> u64 {
        VERBS
            .iter()
            .position(|v| *v == verb)
            .map_or(0, |i| self.counts[side as usize][i].get())
    }
}

/// Everything counted.
#[derive(Debug, Default)]
pub struct Metrics {
    /// API requests sent.
    pub api_requests: ApiRequests,
    /// Pod reconciles run.
    pub reconciles: Counter,
    /// Pod reconciles that failed (every kind of error; see [`Metrics::reconcile_failed`]).
    pub errors: Counter,
    /// Pod reconciles that failed, by the error's kind (`Error::metric_label`).
    reconcile_errors: Mutex<BTreeMap<&'static str, u64>>,
    /// Upper pod status writes.
    pub status_writes: Counter,
    /// How long the upper API server took to answer each status write.
    pub status_write_seconds: Histogram,
    /// Lower pods created.
    pub lower_creates: Counter,
    /// Lower pods updated.
    pub lower_updates: Counter,
    /// Orphaned lower pods deleted.
    pub orphans_deleted: Counter,
    /// Rewrites of lower copies put off by their write budget (a lower controller keeps
    /// editing them).
    pub copy_rewrites_deferred: Counter,
    /// Lower events not reflected up because the publish queue was full.
    pub events_dropped: Counter,
    /// Orphan collection rounds completed.
    pub gc_rounds: Counter,
    /// Whether every watch has synced and the node is registered.
    pub ready: AtomicBool,
}

impl Metrics {
    /// Counts a failed pod reconcile (pod controller or status reflector) whose error is of
    /// the kind `label` (`api`, `conflict`, ...).
    pub fn reconcile_failed(&self, label: &'static str) {
        self.errors.inc();
        let mut by_label = self
            .reconcile_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *by_label.entry(label).or_default() += 1;
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let name = "tensile_pod_reconcile_errors_total";
        let _ = writeln!(
            out,
            "# HELP {name} Pod reconciles that failed, by kind of error.\n# TYPE {name} counter"
        );
        {
            let by_label = self
                .reconcile_errors
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            for (label, n) in by_label.iter() {
                let _ = writeln!(out, "{name}{{error=\"{label}\"}} {n}");
            }
        }
        for (name, help, counter) in [
            (
                "tensile_pod_reconciles_total",
                "Pod reconciles run.",
                &self.reconciles,
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
            (
                "tensile_lower_copy_rewrites_deferred_total",
                "Rewrites of lower copies put off because something below keeps editing them.",
                &self.copy_rewrites_deferred,
            ),
            (
                "tensile_upper_events_dropped_total",
                "Lower events not reflected up because the publish queue was full.",
                &self.events_dropped,
            ),
            (
                "tensile_gc_rounds_total",
                "Orphan collection rounds completed.",
                &self.gc_rounds,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                counter.get()
            );
        }
        self.status_write_seconds.render(
            &mut out,
            "tensile_upper_status_write_seconds",
            "How long the upper API server took to answer a pod status write.",
        );
        let name = "tensile_api_requests_total";
        let _ = writeln!(
            out,
            "# HELP {name} API requests sent.\n# TYPE {name} counter"
        );
        for side in [Side::Upper, Side::Lower] {
            for verb in VERBS {
                let n = self.api_requests.get(side, verb);
                let _ = writeln!(out, "{name}{{cluster=\"{side}\",verb=\"{verb}\"}} {n}");
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn reconcile_errors_are_counted_by_kind() {
        let metrics = Metrics::default();
        for label in ["api", "conflict", "api", "missing_dependency", "api"] {
            metrics.reconcile_failed(label);
        }
        let out = metrics.render();
        let cases = [
            (
                "tensile_pod_reconcile_errors_total{error=\"api\"}",
                Some("3"),
            ),
            (
                "tensile_pod_reconcile_errors_total{error=\"conflict\"}",
                Some("1"),
            ),
            (
                "tensile_pod_reconcile_errors_total{error=\"missing_dependency\"}",
                Some("1"),
            ),
            (
                "tensile_pod_reconcile_errors_total{error=\"translate\"}",
                None,
            ),
        ];
        for (series, want) in cases {
            let got = out
                .lines()
                .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '));
            assert_eq!(got, want, "{series} in\n{out}");
        }
        assert_eq!(metrics.errors.get(), 5, "the total follows");
        assert_eq!(
            out.matches("# TYPE tensile_pod_reconcile_errors_total counter")
                .count(),
            1
        );
    }

    #[test]
    fn histogram_renders_cumulative_buckets() {
        let h = Histogram::default();
        for ms in [1, 5, 7, 150, 9000] {
            h.observe(Duration::from_millis(ms));
        }
        let mut out = String::new();
        h.render(&mut out, "t", "help");
        let value = |key: &str| -> String {
            out.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
                .unwrap_or_else(|| panic!("{key} missing in\n{out}"))
                .to_owned()
        };
        let cases = [
            ("t_bucket{le=\"0.005\"}", "2"), // 1 ms and exactly 5 ms
            ("t_bucket{le=\"0.01\"}", "3"),
            ("t_bucket{le=\"0.1\"}", "3"),
            ("t_bucket{le=\"0.2\"}", "4"),
            ("t_bucket{le=\"5\"}", "4"),
            ("t_bucket{le=\"+Inf\"}", "5"),
            ("t_count", "5"),
            ("t_sum", "9.163"),
        ];
        for (key, want) in cases {
            assert_eq!(value(key), want, "{key}");
        }
        assert!(out.contains("# TYPE t histogram"));
    }
}
