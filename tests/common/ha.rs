//! Helpers of the high-availability tests (`--leader-elect`).
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use tensile_harness::fixtures::bound_pod;

use super::TIMEOUT;

/// Where the Lease is when neither POD_NAMESPACE nor a service account says otherwise.
pub const LEASE_NAMESPACE: &str = "kube-system";

/// Short timings so a dead leader is replaced in seconds: lease 4 s, renew 3 s, retry 500 ms.
pub const FAST_LEASE: [&str; 3] = [
    "--leader-elect-lease-duration=4s",
    "--leader-elect-renew-deadline=3s",
    "--leader-elect-retry-period=500ms",
];

pub fn lease_name(node: &str) -> String {
    format!("tensile-virtual-node-{node}")
}

/// The holder of the node's Lease, if any.
pub async fn holder(leases: &Api<Lease>, node: &str) -> Option<String> {
    leases
        .get_opt(&lease_name(node))
        .await
        .ok()
        .flatten()?
        .spec?
        .holder_identity
        .filter(|h| !h.is_empty())
}

pub fn leader_series(node: &str) -> String {
    format!(
        "tensile_leader{{lease=\"{LEASE_NAMESPACE}/{}\"}}",
        lease_name(node)
    )
}

/// Whether GET `path` on the metrics port answers 200.
pub async fn reachable(port: u16, path: &str) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    let request = format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer).await;
    answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200")
}

/// Polls `check` every 20 ms until it returns `Some`, for at most [`TIMEOUT`]. A figure
/// needs this resolution: `wait_for` backs off to 500 ms between polls.
pub async fn poll_finely<T, Fut: Future<Output = Option<T>>>(
    what: &str,
    mut check: impl FnMut() -> Fut,
) -> T {
    let mut every = tokio::time::interval(Duration::from_millis(20));
    let polled = tokio::time::timeout(TIMEOUT, async {
        loop {
            every.tick().await;
            if let Some(value) = check().await {
                return value;
            }
        }
    });
    polled
        .await
        .unwrap_or_else(|_| panic!("timed out after {TIMEOUT:?} waiting for {what}"))
}

/// How long after `from` the Lease is held by `identity`.
pub async fn until_held_by(
    leases: &Api<Lease>,
    node: &str,
    identity: &str,
    from: Instant,
) -> Duration {
    poll_finely(&format!("the lease held by {identity}"), || async {
        let held = holder(leases, node).await.as_deref() == Some(identity);
        held.then(|| from.elapsed())
    })
    .await
}

/// Creates the bound pods `names` in `pods`, 20 at a time.
pub async fn create_pods(pods: &Api<Pod>, node: &str, names: impl Iterator<Item = String>) {
    futures::stream::iter(names)
        .map(|name| async move {
            pods.create(&PostParams::default(), &bound_pod(&name, node))
                .await
                .map(|_| ())
        })
        .buffer_unordered(20)
        .try_collect::<()>()
        .await
        .unwrap();
}
