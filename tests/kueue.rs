//! Real Kueue in a harness cluster (issue 52 item 1): the pinned release's manager, CRDs and
//! webhooks (`tensile_harness::kueue`) admit Jobs within a ClusterQueue's quota. Its own
//! test binary: Kueue's webhooks fail closed on every Job of the cluster it runs in.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::GroupVersionKind;
use serde_json::{Value, json};
use tensile_harness::kueue::{self, API_VERSION, Kueue, QUEUE_NAME_LABEL};
use tensile_harness::{ClusterPair, PairOptions, TestNamespace, wait_for};

/// Two clusters and Kueue share 2 cores.
const TIMEOUT: Duration = Duration::from_secs(90);
const FLAVOR: &str = "default-flavor";
const CLUSTER_QUEUE: &str = "cluster-queue";
const LOCAL_QUEUE: &str = "user-queue";
const JOBS: [&str; 3] = ["job-0", "job-1", "job-2"];

/// One pod asking 1 CPU, in `LOCAL_QUEUE`; created without `suspend`, which Kueue's
/// webhook sets.
fn job(name: &str) -> Job {
    serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {QUEUE_NAME_LABEL: LOCAL_QUEUE}},
        "spec": {
            "parallelism": 1,
            "completions": 1,
            "backoffLimit": 0,
            "template": {"spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 0,
                "containers": [{
                    "name": "work",
                    "image": "work",
                    "resources": {"requests": {"cpu": "1", "memory": "64Mi"}},
                }],
            }},
        },
    }))
    .unwrap()
}

fn condition_true(object: &Value, type_: &str) -> bool {
    object["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == type_ && c["status"] == "True")
}

/// The Workload Kueue made for the Job `uid`, if any yet.
fn workload_of<'a>(workloads: &'a [DynamicObject], uid: &str) -> Option<&'a DynamicObject> {
    workloads.iter().find(|w| {
        w.metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.uid == uid)
    })
}

/// Admitted, with `FLAVOR` for its CPU.
fn admitted_with_flavor(workload: &DynamicObject) -> bool {
    let value = serde_json::to_value(workload).unwrap();
    condition_true(&value, "Admitted")
        && value["status"]["admission"]["podSetAssignments"][0]["flavors"]["cpu"] == FLAVOR
}

fn suspended(job: &Job) -> bool {
    job.spec.as_ref().and_then(|s| s.suspend).unwrap_or(false)
}

fn complete(job: &Job) -> bool {
    job.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| c.type_ == "Complete" && c.status == "True")
}

/// A ClusterQueue of 2 CPUs admits two of three 1-CPU Jobs and keeps the third suspended,
/// its Workload pending for quota; when the first two complete (kwok completes Job pods
/// once a node runs them), the third is admitted and completes too.
#[tokio::test]
async fn kueue_admits_jobs_within_the_cluster_queue_quota() {
    let mut options = PairOptions::default();
    // Kueue runs in the upper cluster, whose node comes later (the lower one is not used).
    options.lower.nodes = 0;
    let pair = ClusterPair::start(options).await.unwrap();
    let kueue = Kueue::start(&pair, &pair.upper).await.unwrap();
    let client = pair.upper.client().await.unwrap();
    let ns = TestNamespace::create(&client, "kueue").await.unwrap();
    let apply = PatchParams::apply("kueue-test").force();

    let objects = [
        (
            "ResourceFlavor",
            None,
            json!({"metadata": {"name": FLAVOR}, "spec": {}}),
        ),
        (
            "ClusterQueue",
            None,
            json!({
                "metadata": {"name": CLUSTER_QUEUE},
                "spec": {
                    "namespaceSelector": {},
                    "resourceGroups": [{
                        "coveredResources": ["cpu", "memory"],
                        "flavors": [{"name": FLAVOR, "resources": [
                            {"name": "cpu", "nominalQuota": "2"},
                            {"name": "memory", "nominalQuota": "4Gi"},
                        ]}],
                    }],
                },
            }),
        ),
        (
            "LocalQueue",
            Some(ns.name.as_str()),
            json!({
                "metadata": {"name": LOCAL_QUEUE},
                "spec": {"clusterQueue": CLUSTER_QUEUE},
            }),
        ),
    ];
    for (kind, namespace, mut object) in objects {
        object["apiVersion"] = API_VERSION.into();
        object["kind"] = kind.into();
        let name = object["metadata"]["name"].as_str().unwrap().to_owned();
        kueue::api(&client, kind, namespace)
            .patch(&name, &apply, &Patch::Apply(&object))
            .await
            .unwrap_or_else(|e| panic!("applying the {kind} {name}: {e}"));
    }
    let local_queues = kueue::api(&client, "LocalQueue", Some(&ns.name));
    wait_for("the LocalQueue to be Active", TIMEOUT, || async {
        let queue = serde_json::to_value(local_queues.get(LOCAL_QUEUE).await?)?;
        Ok(condition_true(&queue, "Active").then_some(()))
    })
    .await
    .unwrap();
    // The ClusterQueue read in v1beta1, which v0.17.0 still serves: the API server converts
    // it through Kueue's conversion webhook (by URL, with the cluster CA).
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(kueue::GROUP, "v1beta1", "ClusterQueue"),
        "clusterqueues",
    );
    let old: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
    let converted = old.get(CLUSTER_QUEUE).await.unwrap();
    assert_eq!(
        converted.types.map(|t| t.api_version).as_deref(),
        Some("kueue.x-k8s.io/v1beta1")
    );
    assert_eq!(
        converted.data["spec"]["resourceGroups"][0]["flavors"][0]["name"],
        FLAVOR
    );

    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns.name);
    let mut uids = Vec::new();
    for name in JOBS {
        let created = jobs
            .create(&PostParams::default(), &job(name))
            .await
            .unwrap();
        assert!(suspended(&created), "Kueue's webhook suspends {name}");
        uids.push(created.metadata.uid.unwrap());
    }

    // Two admitted and started, the third pending for quota (the Jobs' pods stay Pending:
    // no node yet, so nothing finishes and frees quota).
    let workloads = kueue::api(&client, "Workload", Some(&ns.name));
    let waiting = wait_for(
        "two Jobs admitted (flavor default-flavor) and running, the third pending for quota",
        TIMEOUT,
        || async {
            let listed = workloads.list(&ListParams::default()).await?.items;
            let (mut admitted, mut waiting) = (0, Vec::new());
            for (name, uid) in JOBS.iter().zip(&uids) {
                let Some(workload) = workload_of(&listed, uid) else {
                    return Ok(None);
                };
                let job = jobs.get(name).await?;
                let value = serde_json::to_value(workload)?;
                if admitted_with_flavor(workload) && !suspended(&job) {
                    admitted += 1;
                } else if suspended(&job)
                    && value["status"]["conditions"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|c| {
                            c["type"] == "QuotaReserved"
                                && c["status"] == "False"
                                && c["reason"] == "Pending"
                                && c["message"]
                                    .as_str()
                                    .is_some_and(|m| m.contains("insufficient unused quota"))
                        })
                {
                    waiting.push(*name);
                }
            }
            Ok((admitted == 2 && waiting.len() == 1).then(|| waiting[0]))
        },
    )
    .await
    .unwrap();

    // A node: kwok runs the admitted Jobs' pods and completes them, Kueue releases their
    // quota and admits the third.
    pair.upper
        .add_nodes(&["upper-node-0".to_owned()])
        .await
        .unwrap();
    wait_for(
        &format!("every Job complete, {waiting} admitted after the others"),
        TIMEOUT,
        || async {
            let listed = workloads.list(&ListParams::default()).await?.items;
            for (name, uid) in JOBS.iter().zip(&uids) {
                let job = jobs.get(name).await?;
                let admitted = workload_of(&listed, uid).is_some_and(|w| {
                    let value = serde_json::to_value(w).unwrap();
                    value["status"]["admission"]["podSetAssignments"][0]["flavors"]["cpu"] == FLAVOR
                        && condition_true(&value, "Finished")
                });
                if !(admitted && complete(&job)) {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        },
    )
    .await
    .unwrap();

    ns.delete().await.unwrap();
    kueue.stop().await.unwrap();
}
