//! The node heartbeat never waits behind the controllers' requests: held to one request a
//! second on each side (`--kube-api-qps=1 --client-qps=1`, burst 1) while a hundred-odd
//! requests for the pods bound to it queue on each client, the node's Lease is still
//! renewed every 10 s (the kubelet heartbeats on a client of its own, kubernetes#48638).
//! On the shared, throttled clients the renewal and the lower health probe waited their
//! turn, minutes behind, and the node went NotReady (its pods evicted).
//! (A lower API server that accepts and never answers makes the node NotReady within the
//! lease time: tests/virtual_node_outage.rs.)
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::time::{Duration, Instant};

use common::ha::create_pods;
use common::running;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use tensile_harness::{ClusterPair, TestNamespace, VirtualNodeOptions, wait_for};

/// How long the Lease may go without a renewal: its duration (the kubelet's 40 s).
const LEASE_DURATION: Duration = Duration::from_secs(40);
/// Pods bound to the node while the Lease is watched: each costs several requests on each
/// throttled client (create below, its dependencies, status writes, events).
const PODS: usize = 60;
/// Renewals seen in a row, each within [`LEASE_DURATION`] of the one before.
const RENEWALS: usize = 3;

fn renew_time(lease: &Lease) -> Option<String> {
    let time = lease.spec.as_ref()?.renew_time.as_ref()?;
    Some(serde_json::to_string(time).unwrap())
}

#[tokio::test]
async fn the_lease_is_renewed_while_a_throttled_client_has_minutes_of_requests_queued() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-heartbeat-qps";
    let upper = pair.upper.client().await.unwrap();
    let leases: Api<Lease> = Api::namespaced(upper.clone(), "kube-node-lease");
    let ns = TestNamespace::create(&upper, "heartbeat").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);

    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), node);
    options.args = [
        "--kube-api-qps=1",
        "--kube-api-burst=1",
        "--client-qps=1",
        "--client-burst=1",
        "--enable-controllers=",
    ]
    .map(String::from)
    .to_vec();
    let mut vn = pair.start_virtual_node(&options).unwrap();
    // Start-up itself (the access reviews, the watches, registering the Node) is throttled:
    // a minute or two at one request a second.
    let first = wait_for("the node's Lease", Duration::from_secs(300), || async {
        Ok(leases.get_opt(node).await?.as_ref().and_then(renew_time))
    })
    .await;
    if let Err(error) = first {
        let _ = vn.check_running();
        panic!(
            "{error:#}\n{}",
            tensile_harness::process::tail(vn.log(), 40)
        );
    }
    let mut last = first.unwrap();

    create_pods(&upper_pods, node, (0..PODS).map(|i| format!("load-{i:02}"))).await;
    let watched = Instant::now();
    for renewal in 1..=RENEWALS {
        let since = Instant::now();
        let renewed = wait_for(
            &format!("renewal {renewal} of the Lease within {LEASE_DURATION:?}"),
            LEASE_DURATION,
            || async {
                let now = leases.get(node).await.ok().as_ref().and_then(renew_time);
                Ok(now.filter(|now| *now != last))
            },
        )
        .await;
        match renewed {
            Ok(now) => {
                eprintln!(
                    "renewal {renewal}: {} ms after the one before was seen",
                    since.elapsed().as_millis()
                );
                last = now;
            }
            Err(error) => {
                let _ = vn.check_running();
                panic!(
                    "{error:#} ({} s after {PODS} pods were bound)\n{}",
                    watched.elapsed().as_secs(),
                    tensile_harness::process::tail(vn.log(), 40)
                );
            }
        }
    }
    // The requests were queued meanwhile: the pods are not all Running yet.
    let pods = upper_pods.list(&ListParams::default()).await.unwrap().items;
    let started = pods.iter().filter(|p| running(p)).count();
    eprintln!(
        "{started} of {PODS} pods Running {} s after they were bound",
        watched.elapsed().as_secs()
    );
    assert!(
        started < PODS,
        "every pod ran within {} s: nothing was queued behind the renewals",
        watched.elapsed().as_secs()
    );
    vn.check_running().unwrap();

    ns.delete().await.unwrap();
    vn.stop().unwrap();
}
