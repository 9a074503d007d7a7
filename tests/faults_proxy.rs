//! Faults between virtual-node and its API servers, injected by the harness's proxy:
//! - an error storm (429 with Retry-After, 500, 503 and connection resets for half the
//!   requests): virtual-node backs off — its request rate during the storm stays bounded —
//!   and once the storm ends everything converges, nothing lost, duplicated or orphaned;
//! - watches that expire (410 Gone, `Expired`): virtual-node relists, and pods already in
//!   sync cost no write.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::time::{Duration, Instant};

use common::{TIMEOUT, lower_writes, metric, wait_running};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use tensile_harness::fault_proxy::{Fault, FaultProxy, Requests};
use tensile_harness::fixtures::bound_pod;
use tensile_harness::{
    ClusterPair, TestNamespace, VirtualNode, VirtualNodeOptions, invariant, wait_for,
};

/// How long the storm lasts.
const STORM: Duration = Duration::from_secs(15);
/// Requests a second virtual-node may send through the storm: far below a hot loop (a
/// retry without backoff reaches thousands a second on loopback).
const BOUNDED_RATE: f64 = 100.0;

/// Runs one storm against the lower (`lower = true`) or upper API server.
async fn storm(lower: bool, node: &str) {
    let pair = ClusterPair::shared().await.unwrap();
    let (upper_client, lower_client) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let target = if lower { &lower_client } else { &upper_client };
    let proxy = FaultProxy::start(target.clone()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = proxy
        .write_kubeconfig(&dir.path().join("proxy.kubeconfig"))
        .unwrap();
    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), node);
    options.args = vec!["--enable-controllers=".into()];
    if lower {
        options.lower_kubeconfig = Some(kubeconfig);
    } else {
        options.upper_kubeconfig = Some(kubeconfig);
    }
    let _vn = common::start_node_with(pair, &options, &upper_client).await;

    let ns = TestNamespace::create(&upper_client, "storm").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper_client.clone(), &ns.name);
    for i in 0..10 {
        let mut pod = bound_pod(&format!("before-{i}"), node);
        pod.metadata.labels = Some([("app".to_owned(), "storm".to_owned())].into());
        upper_pods
            .create(&PostParams::default(), &pod)
            .await
            .unwrap();
    }
    wait_running(&upper_pods, "app=storm", 10).await;

    proxy.set(Fault::Mixed, 50);
    let (received, faulted) = (proxy.received(), proxy.faulted());
    let started = Instant::now();
    for i in 0..20 {
        let mut pod = bound_pod(&format!("during-{i}"), node);
        pod.metadata.labels = Some([("app".to_owned(), "storm".to_owned())].into());
        upper_pods
            .create(&PostParams::default(), &pod)
            .await
            .unwrap();
    }
    tokio::time::sleep(STORM.saturating_sub(started.elapsed())).await;
    proxy.set(Fault::None, 0);
    let seconds = started.elapsed().as_secs_f64();
    let sent = proxy.received() - received;
    let hit = proxy.faulted() - faulted;
    let rate = sent as f64 / seconds;
    let side = if lower { "lower" } else { "upper" };
    println!(
        "{side} storm: {sent} requests in {seconds:.1} s ({rate:.1}/s), {hit} answered with a fault"
    );
    assert!(hit > 0, "the storm hit something");
    assert!(rate < BOUNDED_RATE, "{rate:.1} requests/s during the storm");

    let healed = Instant::now();
    wait_running(&upper_pods, "app=storm", 30).await;
    let (report, _) =
        invariant::converge(&upper_client, &lower_client, node, Some(&ns.name), TIMEOUT)
            .await
            .unwrap();
    println!(
        "after the {side} storm: {report}, converged {:.1} s after it ended",
        healed.elapsed().as_secs_f64()
    );
    assert!(report.holds(), "{report}");
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn an_error_storm_from_the_lower_api_server_is_backed_off_and_survived() {
    storm(true, "vk-storm-lower").await;
}

#[tokio::test]
async fn an_error_storm_from_the_upper_api_server_is_backed_off_and_survived() {
    storm(false, "vk-storm-upper").await;
}

/// Pods mirrored and Running before the watches expire.
const IN_SYNC: usize = 100;
/// How many times each side's watches are ended with a 410.
const EXPIRIES: u32 = 3;
/// How long virtual-node may take to reopen every expired watch: each retries after its
/// own backoff (0.8 s, then 1.6 s, … with jitter).
const RELISTED: Duration = Duration::from_secs(30);
/// How long every resumed watch is refused with a 410 (relist after relist).
const REFUSED: Duration = Duration::from_secs(5);

/// The two proxies, one in front of each API server, and what went through them.
struct Proxied {
    upper: FaultProxy,
    lower: FaultProxy,
}

impl Proxied {
    fn requests(&self) -> (Requests, Requests) {
        (self.upper.requests(), self.lower.requests())
    }

    fn expired(&self) -> u64 {
        self.upper.expired() + self.lower.expired()
    }
}

/// What one expiry window cost, as counted at the proxies and by virtual-node.
struct Window {
    what: &'static str,
    upper: Requests,
    lower: Requests,
    /// Watches ended or refused with a 410.
    expired: u64,
    /// virtual-node's lower writes (its `tensile_api_requests_total`).
    lower_writes: u64,
    /// From the first expiry (the end of the refusal) to every pod reconciled again and the
    /// invariant holding.
    converged: Duration,
}

impl Window {
    fn print(&self) {
        println!(
            "{}: {} watches expired; relists: upper {} pods ({} in all), lower {} pods ({} in all); \
             writes: upper {} (pods {}), lower {} (pods {}; virtual-node counts {}); \
             converged in {:.1} s\n  upper: {}\n  lower: {}",
            self.what,
            self.expired,
            self.upper.count("list", "pods"),
            self.upper.of_verb("list"),
            self.lower.count("list", "pods"),
            self.lower.of_verb("list"),
            self.upper.writes(),
            self.upper.writes_to("pods"),
            self.lower.writes(),
            self.lower.writes_to("pods"),
            self.lower_writes,
            self.converged.as_secs_f64(),
            self.upper,
            self.lower,
        );
    }

    /// Pods in sync cost no write, on either side: the relists caused no write storm.
    fn assert_no_pod_writes(&self) {
        assert_eq!(
            self.upper.writes_to("pods"),
            0,
            "{}: upper pod writes",
            self.what
        );
        assert_eq!(
            self.lower.writes_to("pods"),
            0,
            "{}: lower pod writes",
            self.what
        );
        assert_eq!(self.lower_writes, 0, "{}: lower writes", self.what);
    }
}

/// Waits until every watch the proxy ended since `expired_before` was opened again (each
/// after a relist) and the pod controller reconciled every pod again (each relist of pods
/// hands it every pod).
async fn relisted(
    proxy: &FaultProxy,
    vn: &VirtualNode,
    expired_before: u64,
    watches_before: &Requests,
    reconciles_before: u64,
) {
    let seen = std::sync::Mutex::new(String::new());
    let result = wait_for(
        "the expired watches relisted and watching again",
        RELISTED,
        || async {
            let expired = proxy.expired() - expired_before;
            let since = proxy.requests().since(watches_before);
            let reconciles = metric(vn, "tensile_pod_reconciles_total").await - reconciles_before;
            let now =
                format!("{expired} expired, {reconciles} pod reconciles, requests since: {since}");
            *seen.lock().unwrap() = now;
            Ok(
                (expired > 0 && since.of_verb("watch") >= expired && reconciles >= IN_SYNC as u64)
                    .then_some(()),
            )
        },
    )
    .await;
    if let Err(error) = result {
        panic!("{error:#}: {}", seen.lock().unwrap());
    }
    println!("  relisted: {}", seen.lock().unwrap());
}

/// Ends the watches of `proxy` [`EXPIRIES`] times, each once they were open again, then
/// waits for the invariant; returns what went through both proxies meanwhile.
async fn expire(
    what: &'static str,
    proxy: &FaultProxy,
    proxied: &Proxied,
    vn: &VirtualNode,
    check: &impl AsyncFn() -> Duration,
) -> Window {
    let (upper_before, lower_before) = proxied.requests();
    let (expired_before, writes_before) = (proxied.expired(), lower_writes(vn).await);
    let started = Instant::now();
    for _ in 0..EXPIRIES {
        let (expired, watches) = (proxy.expired(), proxy.requests());
        let reconciles = metric(vn, "tensile_pod_reconciles_total").await;
        proxy.expire_watches();
        relisted(proxy, vn, expired, &watches, reconciles).await;
    }
    check().await;
    let (upper, lower) = proxied.requests();
    Window {
        what,
        upper: upper.since(&upper_before),
        lower: lower.since(&lower_before),
        expired: proxied.expired() - expired_before,
        lower_writes: lower_writes(vn).await - writes_before,
        converged: started.elapsed(),
    }
}

#[tokio::test]
async fn expired_watches_are_relisted_without_writes_for_pods_in_sync() {
    let node = "vk-expiry";
    let pair = ClusterPair::shared().await.unwrap();
    let (upper_client, lower_client) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let proxied = Proxied {
        upper: FaultProxy::start(upper_client.clone()).await.unwrap(),
        lower: FaultProxy::start(lower_client.clone()).await.unwrap(),
    };
    let dir = tempfile::tempdir().unwrap();
    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), node);
    options.upper_kubeconfig = Some(
        proxied
            .upper
            .write_kubeconfig(&dir.path().join("upper.kubeconfig"))
            .unwrap(),
    );
    options.lower_kubeconfig = Some(
        proxied
            .lower
            .write_kubeconfig(&dir.path().join("lower.kubeconfig"))
            .unwrap(),
    );
    let vn = common::start_node_with(pair, &options, &upper_client).await;

    let ns = TestNamespace::create(&upper_client, "expiry")
        .await
        .unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper_client.clone(), &ns.name);
    futures::stream::iter(0..IN_SYNC)
        .for_each_concurrent(16, |i| {
            let upper_pods = upper_pods.clone();
            async move {
                let mut pod = bound_pod(&format!("p-{i:03}"), node);
                pod.metadata.labels = Some([("app".to_owned(), "expiry".to_owned())].into());
                upper_pods
                    .create(&PostParams::default(), &pod)
                    .await
                    .unwrap();
            }
        })
        .await;
    wait_running(&upper_pods, "app=expiry", IN_SYNC).await;
    let check = async || {
        let (report, took) =
            invariant::converge(&upper_client, &lower_client, node, Some(&ns.name), TIMEOUT)
                .await
                .unwrap();
        assert!(report.holds(), "{report}");
        took
    };
    check().await;

    let mut windows = Vec::new();
    for (what, proxy) in [
        ("lower watches expired", &proxied.lower),
        ("upper watches expired", &proxied.upper),
    ] {
        let window = expire(what, proxy, &proxied, &vn, &check).await;
        window.print();
        windows.push(window);
    }

    // Every watch ended, and every watch resuming from a list refused for a while: a relist
    // after each, with backoff, never a hot loop; still no write.
    let (upper_before, lower_before) = proxied.requests();
    let (expired_before, writes_before) = (proxied.expired(), lower_writes(&vn).await);
    let started = Instant::now();
    for proxy in [&proxied.upper, &proxied.lower] {
        proxy.set(Fault::Expired, 100);
        proxy.expire_watches();
    }
    wait_for("the refusal period", REFUSED * 2, || async {
        Ok((started.elapsed() >= REFUSED).then_some(()))
    })
    .await
    .unwrap();
    for proxy in [&proxied.upper, &proxied.lower] {
        proxy.set(Fault::None, 0);
    }
    let seconds = started.elapsed().as_secs_f64();
    let converged = check().await;
    let (upper, lower) = proxied.requests();
    let refused = Window {
        what: "every resumed watch refused with a 410",
        upper: upper.since(&upper_before),
        lower: lower.since(&lower_before),
        expired: proxied.expired() - expired_before,
        lower_writes: lower_writes(&vn).await - writes_before,
        converged,
    };
    refused.print();
    let rate = (refused.upper.total() + refused.lower.total()) as f64 / seconds;
    println!("  {rate:.1} requests/s while refused");
    assert!(refused.expired > 0, "the refusal hit some watch");
    assert!(
        rate < BOUNDED_RATE,
        "{rate:.1} requests/s while watches were refused"
    );
    windows.push(refused);

    for window in &windows {
        window.assert_no_pod_writes();
    }
    ns.delete().await.unwrap();
}
