//! A Job's pods run below on a real node (kubelet, containerd, runc) and finish; a pod
//! that Succeeded is never run again: not after virtual-node is killed and started again,
//! not after the lower cluster garbage-collects the finished copies while it was away.
//! The upper Job controller counts each completion once and creates no pod beyond its
//! completions. Its own test binary: its pair runs a real node.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{TIMEOUT, start_node};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use tensile_harness::fixtures::{bound_pod, virtual_node_toleration};
use tensile_harness::invariant::{self, OWNER_NODE_LABEL};
use tensile_harness::real_node::BUSYBOX_IMAGE;
use tensile_harness::{ClusterPair, PairOptions, TestNamespace, real_node_placement, wait_for};

const NODE: &str = "vk-job";
const REAL_NODE: &str = "lower-real-0";
const COMPLETIONS: i32 = 4;
/// How long the test watches for a re-created pod once the restarted node has shown it
/// is working (it mirrored a new pod and ran its orphan collection).
const WATCH: Duration = Duration::from_secs(15);

/// The upper Job's pods, name → (UID, phase).
async fn job_pods(api: &Api<Pod>) -> BTreeMap<String, (String, String)> {
    api.list(&ListParams::default().labels("job-name=finishes"))
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|p| {
            let phase = p
                .status
                .as_ref()
                .and_then(|s| s.phase.clone())
                .unwrap_or_default();
            (
                p.metadata.name.unwrap_or_default(),
                (p.metadata.uid.unwrap_or_default(), phase),
            )
        })
        .collect()
}

/// The lower copies of the Job's pods owned by the node.
async fn lower_job_pods(api: &Api<Pod>) -> Vec<String> {
    api.list(&ListParams::default().labels(&format!("job-name=finishes,{OWNER_NODE_LABEL}={NODE}")))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|p| p.metadata.name)
        .collect()
}

#[tokio::test]
async fn a_jobs_finished_pods_are_never_run_again_after_a_restart_or_a_lower_gc() {
    let pair = ClusterPair::start(PairOptions::default()).await.unwrap();
    let real = pair
        .start_real_node(REAL_NODE)
        .await
        .unwrap_or_else(|error| panic!("the real node did not start: {error:#}"));
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let mut vk = start_node(&pair, NODE, &[]).await;
    let ns = TestNamespace::create(&upper, "job").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let jobs: Api<Job> = Api::namespaced(upper.clone(), &ns.name);

    // Four completions, two at a time, on the virtual node; below on the real node.
    let job: Job = serde_json::from_value(json!({
        "metadata": {"name": "finishes"},
        "spec": {
            "completions": COMPLETIONS,
            "parallelism": 2,
            "backoffLimit": 0,
            "template": {
                "metadata": {"annotations": {"clusterSelector": real_node_placement().to_string()}},
                "spec": {
                    "nodeName": NODE,
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": false,
                    "terminationGracePeriodSeconds": 1,
                    "tolerations": [virtual_node_toleration()],
                    "containers": [{
                        "name": "work",
                        "image": BUSYBOX_IMAGE,
                        "command": ["sh", "-c", "echo done"],
                    }],
                },
            },
        },
    }))
    .unwrap();
    jobs.create(&PostParams::default(), &job).await.unwrap();
    let complete = wait_for("the Job Complete upstairs", TIMEOUT * 2, || async {
        let job = jobs.get("finishes").await?;
        let status = job.status.unwrap_or_default();
        let done = status.conditions.unwrap_or_default().iter().any(|c| {
            (c.type_ == "Complete" || c.type_ == "SuccessCriteriaMet") && c.status == "True"
        });
        Ok((done && status.succeeded == Some(COMPLETIONS)).then_some(()))
    })
    .await;
    if let Err(error) = complete {
        panic!(
            "{error:#}\nupper pods: {:?}\n{}\n{}",
            job_pods(&upper_pods).await,
            real.logs_tail(20),
            tensile_harness::process::tail(vk.log(), 30)
        );
    }
    let finished = job_pods(&upper_pods).await;
    assert_eq!(finished.len(), COMPLETIONS as usize, "{finished:?}");
    assert!(
        finished.values().all(|(_, phase)| phase == "Succeeded"),
        "{finished:?}"
    );
    // The finished copies ran below (on the real node).
    let ran_below = lower_job_pods(&lower_pods).await;
    println!(
        "{} pods Succeeded upstairs; lower copies: {ran_below:?}",
        finished.len()
    );

    // virtual-node dies; while it is away the lower cluster collects the finished copies.
    vk.kill().unwrap();
    for name in &ran_below {
        let _ = lower_pods
            .delete(name, &DeleteParams::default().grace_period(0))
            .await;
    }
    wait_for("the finished lower copies collected", TIMEOUT, || async {
        Ok(lower_job_pods(&lower_pods).await.is_empty().then_some(()))
    })
    .await
    .unwrap();
    let vk = start_node(&pair, NODE, &[]).await;

    // The restarted node works: it mirrors a new pod and runs its orphan collection.
    let mut sentinel = bound_pod("sentinel", NODE);
    if let Some(spec) = sentinel.spec.as_mut() {
        spec.tolerations = Some(vec![
            serde_json::from_value(virtual_node_toleration()).unwrap(),
        ]);
    }
    upper_pods
        .create(&PostParams::default(), &sentinel)
        .await
        .unwrap();
    wait_for("the sentinel pod mirrored below", TIMEOUT, || async {
        Ok(lower_pods.get_opt("sentinel").await?.map(|_| ()))
    })
    .await
    .unwrap();
    common::gc_rounds(&vk, 2).await;

    // For a while: no finished pod is run again below, none is re-created upstairs, and the
    // Job still counts four.
    let started = Instant::now();
    while started.elapsed() < WATCH {
        let below = lower_job_pods(&lower_pods).await;
        assert!(
            below.is_empty(),
            "finished pods were run again below after the restart: {below:?}\n{}",
            tensile_harness::process::tail(vk.log(), 30)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let after = job_pods(&upper_pods).await;
    assert_eq!(
        after, finished,
        "the Job's upper pods changed after the restart"
    );
    let status = jobs.get("finishes").await.unwrap().status.unwrap();
    assert_eq!(status.succeeded, Some(COMPLETIONS), "{status:?}");
    assert_eq!(status.failed.unwrap_or(0), 0, "{status:?}");
    let report = invariant::check(&upper, &lower, NODE, Some(&ns.name))
        .await
        .unwrap();
    assert!(report.holds(), "{report}");

    jobs.delete("finishes", &DeleteParams::background())
        .await
        .unwrap();
    ns.delete().await.unwrap();
}
