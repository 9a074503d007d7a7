//! When the lower API server stops answering, the virtual node stops renewing its Lease
//! and goes NotReady through the node lifecycle controller; when it answers again, the
//! node is Ready again. When either API server or the lower etcd crashes and restarts,
//! nothing is lost and pods running below are not disturbed. Its own test binary: it
//! freezes and restarts its clusters' components.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::time::{Duration, Instant};

use common::{TIMEOUT, ready_status, start_node, wait_running};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, PostParams};
use nix::sys::signal::Signal;
use tensile_harness::fixtures::bound_pod;
use tensile_harness::{ClusterPair, Component, PairOptions, TestNamespace, invariant, wait_for};

#[tokio::test]
async fn node_goes_not_ready_while_the_lower_cluster_is_silent_and_recovers() {
    let pair = common::pair_with_fast_node_monitor().await;
    let _vn = start_node(&pair, "vk-outage", &[]).await;
    let nodes: Api<Node> = Api::all(pair.upper.client().await.unwrap());

    pair.lower
        .signal(Component::ApiServer, Signal::SIGSTOP)
        .unwrap();
    let went = wait_for(
        "the node to leave Ready",
        Duration::from_secs(90),
        || async {
            let status = ready_status(&nodes.get("vk-outage").await?);
            Ok((status.as_deref() != Some("True")).then_some(status))
        },
    )
    .await;
    pair.lower
        .signal(Component::ApiServer, Signal::SIGCONT)
        .unwrap();
    assert_eq!(went.unwrap().as_deref(), Some("Unknown"));

    wait_for(
        "the node to be Ready again",
        Duration::from_secs(90),
        || async {
            let status = ready_status(&nodes.get("vk-outage").await?);
            Ok((status.as_deref() == Some("True")).then_some(()))
        },
    )
    .await
    .unwrap();
}

/// The upper API server, the lower etcd and the lower API server each crash (SIGKILL) and
/// restart while pods come and go: afterwards the invariant holds, and the lower pods that
/// ran before each crash still run with the same UIDs (not re-created).
#[tokio::test]
async fn crashed_and_restarted_api_servers_and_etcd_lose_nothing() {
    let pair = ClusterPair::start(PairOptions::default()).await.unwrap();
    let node = "vk-restarts";
    let _vn = start_node(&pair, node, &[]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "restarts").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let create = |from: usize, to: usize| {
        let api = upper_pods.clone();
        async move {
            for i in from..to {
                let mut pod = bound_pod(&format!("p-{i:03}"), node);
                pod.metadata.labels = Some([("app".to_owned(), "restarts".to_owned())].into());
                // The upper API server may still be starting: retry until it takes it.
                wait_for("the pod created", TIMEOUT, || async {
                    match api.create(&PostParams::default(), &pod).await {
                        Ok(_) => Ok(Some(())),
                        Err(kube::Error::Api(s)) if s.code == 409 => Ok(Some(())),
                        Err(_) => Ok(None),
                    }
                })
                .await
                .unwrap();
            }
        }
    };
    create(0, 20).await;
    let mut expected = 20;
    wait_running(&lower_pods, "app=restarts", expected).await;

    let faults = [
        ("upper kube-apiserver", &pair.upper, Component::ApiServer),
        ("lower etcd", &pair.lower, Component::Etcd),
        ("lower kube-apiserver", &pair.lower, Component::ApiServer),
    ];
    for (round, (what, cluster, component)) in faults.into_iter().enumerate() {
        let before = invariant::uids_by_name(&lower_pods).await.unwrap();
        let started = Instant::now();
        pair.restart(cluster, component).unwrap();
        // Activity across the restart: new pods, and one deleted.
        let from = 20 + round * 5;
        create(from, from + 5).await;
        expected += 5;
        let doomed = format!("p-{:03}", round);
        wait_for("the pod deleted", TIMEOUT, || async {
            match upper_pods.delete(&doomed, &DeleteParams::default()).await {
                Ok(_) => Ok(Some(())),
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(Some(())),
                Err(_) => Ok(None),
            }
        })
        .await
        .unwrap();
        expected -= 1;
        wait_running(&upper_pods, "app=restarts", expected).await;
        wait_running(&lower_pods, "app=restarts", expected).await;
        let (report, _) = invariant::converge(&upper, &lower, node, None, TIMEOUT)
            .await
            .unwrap();
        println!(
            "{what} SIGKILLed and restarted: {report}, converged {:.1} s after the kill",
            started.elapsed().as_secs_f64()
        );
        assert!(report.holds(), "after the {what} restart: {report}");
        let after = invariant::uids_by_name(&lower_pods).await.unwrap();
        for (name, uid) in &before {
            if *name != doomed {
                assert_eq!(after.get(name), Some(uid), "{name} not re-created ({what})");
            }
        }
    }
    ns.delete().await.unwrap();
}
