//! The shipped Grafana dashboard queries only webhook metrics that the webhook exports
//! (virtual-node's are checked against a running node in the root `tests/monitoring.rs`).
//! Every webhook family exists from the start, so the registry as served is enough.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::path::Path;

use tensile_harness::dashboard;
use tensile_webhook::metrics::Metrics;

#[test]
fn every_webhook_metric_the_dashboard_queries_is_exported() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let exprs = dashboard::exprs(&dashboard::path(&repo)).unwrap();
    let webhook = |name: &str| name.starts_with("tensile_webhook_");
    let queried = exprs
        .iter()
        .flat_map(|e| dashboard::metric_names(e))
        .filter(|name| webhook(name))
        .count();
    assert!(queried > 0, "the dashboard queries no webhook metric");
    let text = Metrics::default().render();
    let missing = dashboard::missing(&exprs, &dashboard::exported_names(&text), webhook, &[]);
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics tensile-webhook does not export: {missing:?}\n{text}"
    );
}
