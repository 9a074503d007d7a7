//! Batch bursting with Kueue (issue 52): real Kueue (`tensile_harness::kueue`) in the upper
//! cluster, a virtual node whose lower cluster runs a real node (kubelet, containerd, runc).
//! - Kueue's own behaviour in a harness cluster: a ClusterQueue admits Jobs within its quota.
//! - Bursting: a ClusterQueue with a `local` flavor (regular nodes) and a `burst` flavor
//!   (the virtual node: its label, a toleration of its taint), as
//!   `deploy/examples/kueue/` writes them. Jobs beyond the local quota run on the virtual
//!   node and below on the real node; a higher-priority Job preempts a burst one (its pods
//!   go upstairs and below); when the local quota frees, the next Jobs run locally.
//!
//! Its own test binary: Kueue's webhooks fail closed on every Job of the cluster it runs in.
//! One pair, Kueue, real node and virtual node serve both tests; each test has its own
//! namespace, ClusterQueue and nodes.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use common::{TIMEOUT, kubectl, start_node};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
};
use kube::core::GroupVersionKind;
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tensile::translate::meta::{
    VIRTUAL_NODE_TAINT_EFFECT, VIRTUAL_NODE_TAINT_KEY, VIRTUAL_NODE_TAINT_VALUE,
};
use tensile_harness::cluster::KWOK_NODE_ANNOTATION;
use tensile_harness::invariant;
use tensile_harness::kueue::{self, API_VERSION, Kueue, QUEUE_NAME_LABEL};
use tensile_harness::real_node::BUSYBOX_IMAGE;
use tensile_harness::{
    ClusterPair, NodeShape, PairOptions, RealNode, TestNamespace, VirtualNode, node_is_ready,
    real_node_placement, wait_for,
};
use tokio::sync::OnceCell;

/// The virtual node.
const NODE: &str = "vk-kueue";
/// The real node below, where the burst Jobs' lower copies run.
const REAL_NODE: &str = "lower-real-0";
/// The bursting test's regular node upstairs (added once the test frees the local quota).
const REGULAR: &str = "upper-regular-0";
/// The label naming a Job's WorkloadPriorityClass.
const PRIORITY_CLASS_LABEL: &str = "kueue.x-k8s.io/priority-class";
/// The LocalQueue of each test's namespace.
const LOCAL_QUEUE: &str = "user-queue";

/// The pair, Kueue upstairs, the real node below and the virtual node, shared by this
/// binary's tests.
struct Setup {
    pair: ClusterPair,
    kueue: Kueue,
    real: RealNode,
    vk: VirtualNode,
}

static SETUP: OnceCell<Setup> = OnceCell::const_new();

async fn setup() -> &'static Setup {
    SETUP
        .get_or_init(|| async {
            let mut options = PairOptions::default();
            // No regular node upstairs yet: each test adds its own when it means its pods
            // to run. Below, one kwok node gives the virtual node its capacity (the real
            // node is tainted, so it does not count) and the real node runs the burst.
            options.upper.nodes = 0;
            options.upper.node_shape = NodeShape {
                cpu: "2".into(),
                memory: "8Gi".into(),
                ..NodeShape::default()
            };
            options.lower.nodes = 1;
            let pair = ClusterPair::start(options).await.unwrap();
            let real = pair.start_real_node(REAL_NODE).await.unwrap_or_else(|error| {
                panic!("the real node did not start (see tests/harness/src/real_node.rs): {error:#}")
            });
            let kueue = Kueue::start(&pair, &pair.upper).await.unwrap();
            let vk = start_node(&pair, NODE, &[]).await;
            Setup {
                pair,
                kueue,
                real,
                vk,
            }
        })
        .await
}

/// Applies Kueue's `kind` `object` (server-side), in `namespace` when namespaced.
async fn apply(client: &Client, kind: &str, namespace: Option<&str>, mut object: Value) {
    object["apiVersion"] = API_VERSION.into();
    object["kind"] = kind.into();
    let name = object["metadata"]["name"].as_str().unwrap().to_owned();
    kueue::api(client, kind, namespace)
        .patch(
            &name,
            &PatchParams::apply("kueue-test").force(),
            &Patch::Apply(&object),
        )
        .await
        .unwrap_or_else(|e| panic!("applying the {kind} {name}: {e}"));
}

/// Creates the LocalQueue [`LOCAL_QUEUE`] of `cluster_queue` in `namespace` and waits until
/// it is Active (its ClusterQueue and flavors exist).
async fn local_queue(client: &Client, namespace: &str, cluster_queue: &str) {
    apply(
        client,
        "LocalQueue",
        Some(namespace),
        json!({"metadata": {"name": LOCAL_QUEUE}, "spec": {"clusterQueue": cluster_queue}}),
    )
    .await;
    let local_queues = kueue::api(client, "LocalQueue", Some(namespace));
    wait_for("the LocalQueue to be Active", TIMEOUT, || async {
        let queue = serde_json::to_value(local_queues.get(LOCAL_QUEUE).await?)?;
        Ok(condition_true(&queue, "Active").then_some(()))
    })
    .await
    .unwrap();
}

fn condition<'a>(object: &'a Value, type_: &str) -> Option<&'a Value> {
    object["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == type_)
}

fn condition_true(object: &Value, type_: &str) -> bool {
    condition(object, type_).is_some_and(|c| c["status"] == "True")
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

/// The flavor a Workload was admitted with for its CPU, while Admitted.
fn admitted_flavor(workload: &Value) -> Option<&str> {
    if !condition_true(workload, "Admitted") {
        return None;
    }
    workload["status"]["admission"]["podSetAssignments"][0]["flavors"]["cpu"].as_str()
}

/// Whether Kueue keeps the Workload waiting for quota.
fn pending_for_quota(workload: &Value) -> bool {
    condition(workload, "QuotaReserved").is_some_and(|c| {
        c["status"] == "False"
            && c["reason"] == "Pending"
            && c["message"]
                .as_str()
                .is_some_and(|m| m.contains("insufficient unused quota"))
    })
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

fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or_default()
}

fn node_of(pod: &Pod) -> &str {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .unwrap_or_default()
}

/// A kwok node like the harness's, labelled and tainted `label=true` (`NoSchedule`), so that
/// only pods that ask for it (the smoke test's flavor) run there.
async fn add_dedicated_node(client: &Client, name: &str, label: &str) {
    let nodes: Api<Node> = Api::all(client.clone());
    let resources = json!({"cpu": "4", "memory": "8Gi", "pods": "110"});
    let node: Node = serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                label: "true",
            },
            "annotations": {KWOK_NODE_ANNOTATION: "fake"},
        },
        "spec": {"taints": [{"key": label, "value": "true", "effect": "NoSchedule"}]},
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "kwok",
            },
        },
    }))
    .unwrap();
    nodes.create(&PostParams::default(), &node).await.unwrap();
    wait_for(&format!("kwok to report {name} Ready"), TIMEOUT, || async {
        Ok(node_is_ready(&nodes.get(name).await?).then_some(()))
    })
    .await
    .unwrap();
}

/// A ClusterQueue of 2 CPUs admits two of three 1-CPU Jobs and keeps the third suspended,
/// its Workload pending for quota; when the first two complete (kwok completes Job pods
/// once a node runs them), the third is admitted and completes too. The flavor's node
/// (labelled and tainted for it) comes after the Jobs, so nothing finishes before.
#[tokio::test]
async fn kueue_admits_jobs_within_the_cluster_queue_quota() {
    const FLAVOR: &str = "smoke-flavor";
    const CLUSTER_QUEUE: &str = "smoke-queue";
    const NODE_LABEL: &str = "tensile.test/kueue-smoke";
    const SMOKE_NODE: &str = "upper-smoke-0";
    const JOBS: [&str; 3] = ["job-0", "job-1", "job-2"];

    let setup = setup().await;
    let client = setup.pair.upper.client().await.unwrap();
    let ns = TestNamespace::create(&client, "kueue").await.unwrap();

    apply(
        &client,
        "ResourceFlavor",
        None,
        json!({"metadata": {"name": FLAVOR}, "spec": {
            "nodeLabels": {NODE_LABEL: "true"},
            "tolerations": [{"key": NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}],
        }}),
    )
    .await;
    apply(
        &client,
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
    )
    .await;
    local_queue(&client, &ns.name, CLUSTER_QUEUE).await;

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

    // One pod asking 1 CPU each; created without `suspend`, which Kueue's webhook sets.
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns.name);
    let mut uids = Vec::new();
    for name in JOBS {
        let job: Job = serde_json::from_value(json!({
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
        .unwrap();
        let created = jobs.create(&PostParams::default(), &job).await.unwrap();
        assert!(suspended(&created), "Kueue's webhook suspends {name}");
        uids.push(created.metadata.uid.unwrap());
    }

    // Two admitted and started, the third pending for quota (the Jobs' pods stay Pending:
    // no node of the flavor yet, so nothing finishes and frees quota).
    let workloads = kueue::api(&client, "Workload", Some(&ns.name));
    let waiting = wait_for(
        "two Jobs admitted (flavor smoke-flavor) and running, the third pending for quota",
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
                if admitted_flavor(&value) == Some(FLAVOR) && !suspended(&job) {
                    admitted += 1;
                } else if suspended(&job) && pending_for_quota(&value) {
                    waiting.push(*name);
                }
            }
            Ok((admitted == 2 && waiting.len() == 1).then(|| waiting[0]))
        },
    )
    .await
    .unwrap();

    // The flavor's node: kwok runs the admitted Jobs' pods and completes them, Kueue
    // releases their quota and admits the third.
    add_dedicated_node(&client, SMOKE_NODE, NODE_LABEL).await;
    wait_for(
        &format!("every Job complete, {waiting} admitted after the others"),
        TIMEOUT,
        || async {
            let listed = workloads.list(&ListParams::default()).await?.items;
            for (name, uid) in JOBS.iter().zip(&uids) {
                let job = jobs.get(name).await?;
                let finished = workload_of(&listed, uid).is_some_and(|w| {
                    let value = serde_json::to_value(w).unwrap();
                    value["status"]["admission"]["podSetAssignments"][0]["flavors"]["cpu"] == FLAVOR
                        && condition_true(&value, "Finished")
                });
                if !(finished && complete(&job)) {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        },
    )
    .await
    .unwrap();

    ns.delete().await.unwrap();
}

/// The bursting ClusterQueue: `local` (regular nodes: no node labels, and no toleration
/// of the virtual node's taint) first, then `burst` (the virtual node's label and a
/// toleration of its taint), 200m CPU each; a higher priority preempts a lower one within
/// it; WorkloadPriorityClasses `low` and `high`. The design of `deploy/examples/kueue/`.
async fn apply_burst_queue(client: &Client) {
    apply(
        client,
        "ResourceFlavor",
        None,
        json!({"metadata": {"name": "local"}, "spec": {}}),
    )
    .await;
    apply(
        client,
        "ResourceFlavor",
        None,
        json!({"metadata": {"name": "burst"}, "spec": {
            "nodeLabels": {"type": "virtual-kubelet"},
            "tolerations": [{
                "key": VIRTUAL_NODE_TAINT_KEY,
                "operator": "Equal",
                "value": VIRTUAL_NODE_TAINT_VALUE,
                "effect": VIRTUAL_NODE_TAINT_EFFECT,
            }],
        }}),
    )
    .await;
    let quota = |flavor: &str| {
        json!({"name": flavor, "resources": [
            {"name": "cpu", "nominalQuota": "200m"},
            {"name": "memory", "nominalQuota": "1Gi"},
        ]})
    };
    apply(
        client,
        "ClusterQueue",
        None,
        json!({
            "metadata": {"name": "cluster-queue"},
            "spec": {
                "namespaceSelector": {},
                "preemption": {"withinClusterQueue": "LowerPriority"},
                "resourceGroups": [{
                    "coveredResources": ["cpu", "memory"],
                    "flavors": [quota("local"), quota("burst")],
                }],
            },
        }),
    )
    .await;
    for (name, value) in [("low", 100), ("high", 1000)] {
        apply(
            client,
            "WorkloadPriorityClass",
            None,
            json!({"metadata": {"name": name}, "value": value}),
        )
        .await;
    }
}

/// A container that runs until `kubectl exec` touches `/tmp/release`.
const UNTIL_RELEASED: &str =
    "echo started; until [ -e /tmp/release ]; do sleep 1; done; echo released";

/// A Job of the bursting test: one pod of busybox running `script`, asking `cpu`, in
/// [`LOCAL_QUEUE`] at `priority`. Its template carries the placement its lower copy takes
/// below (the real node), stashed in `clusterSelector` as the webhook would: every Job of
/// the queue carries it, wherever Kueue sends it. `backoffLimit: 0`: a pod that fails fails
/// its Job (the pod the Job controller deletes when Kueue suspends it does not count).
fn burst_job(name: &str, priority: &str, cpu: &str, script: &str) -> Job {
    serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "labels": {QUEUE_NAME_LABEL: LOCAL_QUEUE, PRIORITY_CLASS_LABEL: priority},
        },
        "spec": {
            "parallelism": 1,
            "completions": 1,
            "backoffLimit": 0,
            "template": {
                "metadata": {
                    "annotations": {"clusterSelector": real_node_placement().to_string()},
                },
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": false,
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{
                        "name": "work",
                        "image": BUSYBOX_IMAGE,
                        "command": ["sh", "-c", script],
                        "resources": {"requests": {"cpu": cpu, "memory": "64Mi"}},
                    }],
                },
            },
        },
    }))
    .unwrap()
}

/// The bursting test's namespace, seen from both clusters.
struct Scene {
    setup: &'static Setup,
    ns: String,
    upper: Client,
    lower: Client,
    jobs: Api<Job>,
    upper_pods: Api<Pod>,
    lower_pods: Api<Pod>,
    workloads: Api<DynamicObject>,
}

impl Scene {
    async fn create(&self, name: &str, priority: &str, cpu: &str, script: &str) {
        let created = self
            .jobs
            .create(
                &PostParams::default(),
                &burst_job(name, priority, cpu, script),
            )
            .await
            .unwrap();
        assert!(suspended(&created), "Kueue's webhook suspends {name}");
    }

    /// The Workload of the Job `name`, if any yet.
    async fn workload(&self, name: &str) -> anyhow::Result<Option<Value>> {
        let uid = self.jobs.get(name).await?.metadata.uid.unwrap_or_default();
        let listed = self.workloads.list(&ListParams::default()).await?.items;
        Ok(workload_of(&listed, &uid)
            .map(serde_json::to_value)
            .transpose()?)
    }

    /// The Job `name`'s pods in `api` (upper or lower).
    async fn pods(&self, api: &Api<Pod>, name: &str) -> anyhow::Result<Vec<Pod>> {
        Ok(api
            .list(&ListParams::default().labels(&format!("job-name={name}")))
            .await?
            .items)
    }

    /// The Job's upper pod bound to `node` and Running, with its lower copy Running on the
    /// real node; the upper pod.
    async fn running_below(&self, name: &str) -> anyhow::Result<Option<Pod>> {
        let above = self.pods(&self.upper_pods, name).await?;
        let [pod] = above.as_slice() else {
            return Ok(None);
        };
        if node_of(pod) != NODE || !common::running(pod) {
            return Ok(None);
        }
        let copy = self.lower_pods.get_opt(&pod.name_any()).await?;
        let on_real = copy.is_some_and(|c| node_of(&c) == REAL_NODE && common::running(&c));
        Ok(on_real.then(|| pod.clone()))
    }

    /// Waits for `check`; on timeout, panics with the state of every Job, Workload and pod
    /// of the namespace and the ends of the logs.
    async fn wait<T, F, Fut>(&self, what: &str, check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = anyhow::Result<Option<T>>>,
    {
        match wait_for(what, TIMEOUT, check).await {
            Ok(value) => value,
            Err(error) => panic!("{error:#}\n{}", self.dump().await),
        }
    }

    /// Every Job's Workload (flavor and conditions) and pods (node, phase), upstairs and
    /// below, and the ends of virtual-node's, Kueue's and the real node's logs.
    async fn dump(&self) -> String {
        let tail = tensile_harness::process::tail;
        format!(
            "{}--- virtual-node:\n{}\n--- kueue:\n{}\n{}",
            self.state().await,
            tail(self.setup.vk.log(), 30),
            tail(self.setup.kueue.log(), 30),
            self.setup.real.logs_tail(10)
        )
    }

    /// Every Job's Workload (flavor and conditions) and pods (node, phase), upstairs and
    /// below.
    async fn state(&self) -> String {
        let mut out = String::new();
        for job in self.jobs.list(&ListParams::default()).await.unwrap().items {
            let name = job.name_any();
            let workload = self.workload(&name).await.ok().flatten();
            let conditions: Vec<String> = workload
                .as_ref()
                .and_then(|w| w["status"]["conditions"].as_array().cloned())
                .into_iter()
                .flatten()
                .map(|c| format!("{}={} ({})", c["type"], c["status"], c["reason"]))
                .collect();
            let flavor = workload.as_ref().map(|w| {
                w["status"]["admission"]["podSetAssignments"][0]["flavors"]["cpu"].clone()
            });
            out.push_str(&format!(
                "Job {name}: suspended {}, status {:?}\n  Workload flavor {flavor:?}: {}\n",
                suspended(&job),
                job.status.map(|s| (s.active, s.succeeded, s.failed)),
                conditions.join(", ")
            ));
            for (cluster, api) in [("upper", &self.upper_pods), ("lower", &self.lower_pods)] {
                for pod in self.pods(api, &name).await.unwrap_or_default() {
                    out.push_str(&format!(
                        "  {cluster} pod {} on {:?}: {}{}\n",
                        pod.name_any(),
                        node_of(&pod),
                        phase(&pod),
                        if pod.metadata.deletion_timestamp.is_some() {
                            " (deleting)"
                        } else {
                            ""
                        }
                    ));
                }
            }
        }
        out
    }

    /// `kubectl -n <ns> <args>` upstairs, as a user runs it.
    async fn kubectl(&self, args: &[&str]) -> std::process::Output {
        let mut all = vec!["-n", self.ns.as_str()];
        all.extend(args);
        kubectl(
            &self.setup.pair,
            self.setup.pair.upper_kubeconfig(),
            &all,
            b"",
        )
        .await
    }
}

/// Issue 52 item 4. Local quota 200m and burst quota 200m, Jobs of 100m:
/// 1. the first two Jobs (`high`) are admitted with `local` (their pods wait: no regular
///    node yet); the next two (`low`) with `burst`: their pods run on the virtual node and
///    below on the real node; `kubectl logs job/..` and `kubectl exec job/..` reach them;
/// 2. a `high` Job of 200m preempts the running burst Job: its Workload is evicted, its pod
///    goes upstairs and its lower copy below; the `high` one runs on the virtual node;
/// 3. a regular node comes: the local Jobs run and finish, the local quota frees, and the
///    preempted Job and one more, both waiting, are admitted with `local` and run there;
/// 4. every Job completed once (one pod Succeeded), every Workload Finished with its
///    flavor, the finished-pod invariant holds; once the Jobs go, nothing is left below.
#[tokio::test]
async fn jobs_beyond_the_local_quota_burst_to_the_virtual_node_and_come_home() {
    let setup = setup().await;
    let upper = setup.pair.upper.client().await.unwrap();
    let lower = setup.pair.lower.client().await.unwrap();
    let ns = TestNamespace::create(&upper, "kueue-burst").await.unwrap();
    apply_burst_queue(&upper).await;
    local_queue(&upper, &ns.name, "cluster-queue").await;
    let scene = Scene {
        setup,
        ns: ns.name.clone(),
        jobs: Api::namespaced(upper.clone(), &ns.name),
        upper_pods: Api::namespaced(upper.clone(), &ns.name),
        lower_pods: Api::namespaced(lower.clone(), &ns.name),
        workloads: kueue::api(&upper, "Workload", Some(&ns.name)),
        upper: upper.clone(),
        lower: lower.clone(),
    };

    // 1. The first Jobs take the local quota; their pods wait for a regular node.
    for name in ["local-0", "local-1"] {
        scene.create(name, "high", "100m", "echo local").await;
    }
    scene
        .wait("local-0 and local-1 admitted with flavor local", || async {
            for name in ["local-0", "local-1"] {
                let workload = scene.workload(name).await?;
                if workload.as_ref().and_then(admitted_flavor) != Some("local") {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        })
        .await;

    // Beyond the local quota: the virtual node, and below the real node.
    scene
        .create("burst-0", "low", "100m", "echo burst-0 ran below")
        .await;
    scene.create("burst-1", "low", "100m", UNTIL_RELEASED).await;
    let burst_1 = scene
        .wait(
            "burst-0 and burst-1 admitted with flavor burst; burst-0 complete, burst-1 Running \
             on the virtual node and on the real node below",
            || async {
                for name in ["burst-0", "burst-1"] {
                    let workload = scene.workload(name).await?;
                    if workload.as_ref().and_then(admitted_flavor) != Some("burst") {
                        return Ok(None);
                    }
                }
                if !complete(&scene.jobs.get("burst-0").await?) {
                    return Ok(None);
                }
                scene.running_below("burst-1").await
            },
        )
        .await;
    let burst_0 = scene.pods(&scene.upper_pods, "burst-0").await.unwrap();
    assert_eq!(burst_0.len(), 1, "{}", scene.dump().await);
    assert_eq!(node_of(&burst_0[0]), NODE, "{}", scene.dump().await);
    let copy = scene.lower_pods.get(&burst_0[0].name_any()).await.unwrap();
    assert_eq!(node_of(&copy), REAL_NODE);
    assert_eq!(phase(&copy), "Succeeded");
    // Upstairs the pod carries what Kueue's burst flavor injected; below, the placement
    // stashed in `clusterSelector` instead of it.
    let placement = |pod: &Pod| {
        let spec = pod.spec.as_ref().unwrap();
        json!({"nodeSelector": spec.node_selector, "tolerations": spec.tolerations})
    };
    let above = placement(&burst_0[0]);
    assert_eq!(above["nodeSelector"], json!({"type": "virtual-kubelet"}));
    assert!(
        above["tolerations"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["key"] == VIRTUAL_NODE_TAINT_KEY),
        "{above}"
    );
    let below = placement(&copy);
    assert_eq!(below["nodeSelector"], real_node_placement()["nodeSelector"]);
    let tolerations = below["tolerations"].as_array().unwrap();
    assert!(
        tolerations.contains(&real_node_placement()["tolerations"][0])
            && !tolerations
                .iter()
                .any(|t| t["key"] == VIRTUAL_NODE_TAINT_KEY),
        "{below}"
    );
    for pod in scene.pods(&scene.upper_pods, "local-0").await.unwrap() {
        assert_eq!(node_of(&pod), "", "no regular node yet: {}", pod.name_any());
    }

    // A user's view of a burst Job: its logs and a shell in it, through the virtual node.
    let logs = scene.kubectl(&["logs", "job/burst-0"]).await;
    assert!(logs.status.success(), "{logs:?}");
    assert_eq!(String::from_utf8_lossy(&logs.stdout), "burst-0 ran below\n");
    let exec = scene
        .kubectl(&["exec", "job/burst-1", "--", "hostname"])
        .await;
    assert!(exec.status.success(), "{exec:?}");
    assert_eq!(
        String::from_utf8_lossy(&exec.stdout).trim(),
        burst_1.name_any(),
        "the shell runs in burst-1's container below"
    );

    // 2. Preemption: `high` needs the whole burst quota; burst-1 is `low`, the local Jobs
    // are `high` too, so burst-1 goes: its pod upstairs, its copy below.
    scene.create("high", "high", "200m", UNTIL_RELEASED).await;
    let burst_1_uid = burst_1.uid().unwrap();
    let high = scene
        .wait(
            "burst-1 evicted (Preempted), its pod gone upstairs and below; high admitted with \
             flavor burst and Running on the real node below",
            || async {
                let Some(evicted) = scene.workload("burst-1").await? else {
                    return Ok(None);
                };
                let preempted = condition(&evicted, "Evicted")
                    .is_some_and(|c| c["status"] == "True" && c["reason"] == "Preempted");
                let above = scene.pods(&scene.upper_pods, "burst-1").await?;
                let below = scene.pods(&scene.lower_pods, "burst-1").await?;
                let gone = !above
                    .iter()
                    .any(|p| p.uid().as_deref() == Some(&burst_1_uid))
                    && below.is_empty();
                let workload = scene.workload("high").await?;
                if !(preempted
                    && gone
                    && workload.as_ref().and_then(admitted_flavor) == Some("burst"))
                {
                    return Ok(None);
                }
                scene.running_below("high").await
            },
        )
        .await;
    assert!(
        suspended(&scene.jobs.get("burst-1").await.unwrap()),
        "Kueue suspends the preempted Job"
    );

    // 3. A Job that finds both quotas taken waits; then a regular node: the local Jobs run
    // and finish, and the waiting ones (the preempted burst-1 first) come home.
    scene.create("after-0", "low", "100m", "echo after").await;
    scene
        .wait("after-0 and burst-1 pending for quota", || async {
            for name in ["after-0", "burst-1"] {
                let workload = scene.workload(name).await?;
                if !workload.as_ref().is_some_and(pending_for_quota) {
                    return Ok(None);
                }
            }
            Ok(Some(()))
        })
        .await;
    setup
        .pair
        .upper
        .add_nodes(&[REGULAR.to_owned()])
        .await
        .unwrap();
    scene
        .wait(
            "local-0, local-1, burst-1 and after-0 complete with flavor local on the regular node",
            || async {
                for name in ["local-0", "local-1", "burst-1", "after-0"] {
                    let workload = scene.workload(name).await?;
                    let local = workload.as_ref().is_some_and(|w| {
                        w["status"]["admission"]["podSetAssignments"][0]["flavors"]["cpu"]
                            == "local"
                            && condition_true(w, "Finished")
                    });
                    if !(local && complete(&scene.jobs.get(name).await?)) {
                        return Ok(None);
                    }
                }
                Ok(Some(()))
            },
        )
        .await;

    // `high` still runs below all along; a user releases it with a shell.
    assert!(
        scene.running_below("high").await.unwrap().is_some(),
        "{}",
        scene.dump().await
    );
    let release = scene
        .kubectl(&["exec", "job/high", "--", "touch", "/tmp/release"])
        .await;
    assert!(release.status.success(), "{release:?}");
    scene
        .wait("high complete, its Workload Finished", || async {
            let workload = scene.workload("high").await?;
            let finished = workload
                .as_ref()
                .is_some_and(|w| condition_true(w, "Finished"));
            Ok((finished && complete(&scene.jobs.get("high").await?)).then_some(()))
        })
        .await;
    let logs = scene.kubectl(&["logs", "job/high"]).await;
    assert_eq!(
        String::from_utf8_lossy(&logs.stdout),
        "started\nreleased\n",
        "{logs:?}"
    );
    assert_eq!(
        high.uid(),
        scene.pods(&scene.upper_pods, "high").await.unwrap()[0].uid(),
        "the pod that ran below all along is the one that finished"
    );

    // 4. Every Job completed once and failed never (the preempted pod, deleted by the Job
    // controller, is not a failure): one pod Succeeded, where its flavor sent it, and one
    // lower copy for a burst Job; the Workloads Finished with that flavor.
    let expected = [
        ("local-0", "local"),
        ("local-1", "local"),
        ("burst-0", "burst"),
        ("burst-1", "local"),
        ("high", "burst"),
        ("after-0", "local"),
    ];
    for (name, flavor) in expected {
        let job = scene.jobs.get(name).await.unwrap();
        let status = job.status.clone().unwrap_or_default();
        assert_eq!(status.succeeded, Some(1), "{name}: {status:?}");
        assert_eq!(status.failed.unwrap_or(0), 0, "{name}: {status:?}");
        let workload = scene.workload(name).await.unwrap().unwrap();
        assert!(condition_true(&workload, "Finished"), "{name}: {workload}");
        assert_eq!(
            workload["status"]["admission"]["podSetAssignments"][0]["flavors"]["cpu"], flavor,
            "{name}"
        );
        let pods = scene.pods(&scene.upper_pods, name).await.unwrap();
        let succeeded: Vec<&Pod> = pods.iter().filter(|p| phase(p) == "Succeeded").collect();
        assert_eq!(succeeded.len(), 1, "{name}: {}", scene.dump().await);
        let (node, copies) = if flavor == "local" {
            (REGULAR, 0)
        } else {
            (NODE, 1)
        };
        assert_eq!(node_of(succeeded[0]), node, "{name}");
        let below = scene.pods(&scene.lower_pods, name).await.unwrap();
        assert_eq!(below.len(), copies, "{name}: {}", scene.dump().await);
        if let Some(copy) = below.first() {
            assert_eq!(phase(copy), "Succeeded", "{name}");
            assert_eq!(copy.name_any(), succeeded[0].name_any(), "{name}");
        }
    }
    println!("{}", scene.state().await);
    let report = invariant::check(&scene.upper, &scene.lower, NODE, Some(&scene.ns))
        .await
        .unwrap();
    assert!(report.holds(), "{report}");

    // Nothing is left below once the Jobs go.
    for (name, _) in expected {
        scene
            .jobs
            .delete(name, &DeleteParams::background())
            .await
            .unwrap();
    }
    scene
        .wait("no pod of the namespace left upstairs or below", || async {
            let above = scene.upper_pods.list(&ListParams::default()).await?.items;
            let below = scene.lower_pods.list(&ListParams::default()).await?.items;
            Ok((above.is_empty() && below.is_empty()).then_some(()))
        })
        .await;
    ns.delete().await.unwrap();
}
