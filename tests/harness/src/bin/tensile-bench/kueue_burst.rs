//! `tensile-bench --kueue N` (issue 52): N one-pod Jobs of 1 CPU through real Kueue upstairs,
//! with the flavors and queues of `deploy/examples/kueue` (flavor `local`: the one regular
//! upper node of 8 CPU; flavor `burst`: the virtual node over three 8-CPU lower nodes, its
//! quota kept equal to the node's allocatable by virtual-node's `--kueue-quota`), against
//! the same Jobs with the burst flavor removed, in the same run on the same pair.
//!
//! Phase A submits the N Jobs to the example's LocalQueue (`user-queue` → `cluster-queue`,
//! `[local, burst]`); phase B to a LocalQueue of a second ClusterQueue, `local-only`: the
//! example's ClusterQueue with its burst flavor removed (the same local quota). A second
//! ClusterQueue rather than an edit of the first: virtual-node keeps `cluster-queue/burst`'s
//! quota and would warn about a flavor gone. Each phase: the Jobs created as fast as
//! `--concurrency` allows (one create each, as `kubectl create` does), then timed from the
//! first create to every Workload admitted (quota reserved, its flavor noted) and to every
//! Job Complete, each seen by the bench's watches; the CPU seconds by component over that
//! time; each Job completed once (one pod, Succeeded, at most one lower copy) and the
//! invariant; then all deleted and gone from both clusters. Every Job's pod carries kwok's
//! pod-complete delay (`--kueue-jobs-delay`), so a pod takes as long upstairs (kwok) as
//! below (kwok, the lower copy completed by the harness's Stage). Figures, not assertions.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams, PropagationPolicy};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use tensile_harness::cluster::KWOK_POD_COMPLETE_DELAY_ANNOTATION;
use tensile_harness::invariant::{self, OWNER_NODE_LABEL, UPPER_UID_ANNOTATION};
use tensile_harness::kueue::{
    self, BURST_FLAVOR, CLUSTER_QUEUE, Kueue, KueueOptions, LOCAL_FLAVOR, LOCAL_QUEUE,
    QUEUE_NAME_LABEL,
};
use tensile_harness::measure::{cpu_by_component, cpu_profile, footprint, percentile};
use tensile_harness::{ClusterPair, PairOptions, VirtualNode, node_is_ready, wait_for};

use super::{Args, NODE, Report, WAIT, lock, node_options, secs};

/// Where the Jobs go: the example's LocalQueue is in `default`.
const NAMESPACE: &str = "default";
/// The second ClusterQueue (local only) and its LocalQueue.
const LOCAL_ONLY: &str = "local-only";
/// The label on each phase's Jobs and their pods (the phase's letter).
const PHASE_LABEL: &str = "bench-kueue";
/// The Kubernetes label on a Job's pods naming it.
const JOB_NAME_LABEL: &str = "batch.kubernetes.io/job-name";
/// Lower kwok nodes (8 CPU each, the harness's shape): the virtual node's allocatable.
const LOWER_NODES: usize = 3;

/// One phase: its name in the table and the LocalQueue it submits to.
struct Phase {
    letter: &'static str,
    name: &'static str,
    queue: &'static str,
}

const PHASES: [Phase; 2] = [
    Phase {
        letter: "a",
        name: "A: local, then burst",
        queue: LOCAL_QUEUE,
    },
    Phase {
        letter: "b",
        name: "B: local only",
        queue: LOCAL_ONLY,
    },
];

/// What the bench's watches have seen of one phase's Jobs, by Job name.
#[derive(Default)]
struct Progress {
    /// When each Job's Workload was first seen with its quota reserved, and its flavor.
    admitted: HashMap<String, (Instant, String)>,
    /// When each Job was first seen Complete.
    complete: HashMap<String, Instant>,
    /// When each Job was first seen unsuspended (Kueue's doing once it is admitted).
    unsuspended: HashMap<String, Instant>,
    /// Jobs seen Failed.
    failed: Vec<String>,
}

type Shared = Arc<Mutex<Progress>>;

/// One phase's figures.
struct Figures {
    submitted: Duration,
    admitted: Duration,
    finished: Duration,
    local: usize,
    burst: usize,
    /// By flavor, each Job's time from admitted to unsuspended (by Kueue) and to Complete
    /// (the pod's run and what it waits for around it), each sorted.
    turnaround: BTreeMap<String, Turnaround>,
}

/// The Job owning a Workload.
fn owner_job(workload: &DynamicObject) -> Option<String> {
    workload
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.kind == "Job")
        .map(|o| o.name.clone())
}

fn condition_true(conditions: &Value, kind: &str) -> bool {
    conditions
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == kind && c["status"] == "True")
}

/// The flavor of a Workload whose quota is reserved (its only pod set's CPU), else `None`.
fn admitted_flavor(workload: &DynamicObject) -> Option<String> {
    let status = workload.data.get("status")?;
    let reserved = condition_true(&status["conditions"], "QuotaReserved")
        || condition_true(&status["conditions"], "Admitted");
    let flavor = status["admission"]["podSetAssignments"][0]["flavors"]["cpu"].as_str();
    match (reserved, flavor) {
        (true, Some(flavor)) => Some(flavor.to_owned()),
        (true, None) => Some("?".into()),
        _ => None,
    }
}

/// Follows the Workloads of the phase's Jobs (named `prefix*`) into `progress`.
fn watch_workloads(api: Api<DynamicObject>, prefix: String, progress: Shared) -> WatchTask {
    WatchTask(tokio::spawn(async move {
        let mut events = std::pin::pin!(
            watcher::watcher(api, watcher::Config::default())
                .default_backoff()
                .applied_objects()
        );
        while let Some(event) = events.next().await {
            let at = Instant::now();
            let Ok(workload) = event else { continue };
            let Some(job) = owner_job(&workload).filter(|j| j.starts_with(&prefix)) else {
                continue;
            };
            if let Some(flavor) = admitted_flavor(&workload) {
                lock(&progress).admitted.entry(job).or_insert((at, flavor));
            }
        }
    }))
}

/// Follows the phase's Jobs (labelled with its letter) into `progress`.
fn watch_jobs(api: Api<Job>, letter: &str, progress: Shared) -> WatchTask {
    let config = watcher::Config::default().labels(&format!("{PHASE_LABEL}={letter}"));
    WatchTask(tokio::spawn(async move {
        let mut events = std::pin::pin!(
            watcher::watcher(api, config)
                .default_backoff()
                .applied_objects()
        );
        while let Some(event) = events.next().await {
            let at = Instant::now();
            let Ok(job) = event else { continue };
            let conditions = job.status.as_ref().and_then(|s| s.conditions.as_ref());
            let has = |kind: &str| {
                conditions
                    .into_iter()
                    .flatten()
                    .any(|c| c.type_ == kind && c.status == "True")
            };
            let name = job.name_any();
            let mut progress = lock(&progress);
            if job.spec.as_ref().and_then(|s| s.suspend) == Some(false) {
                progress.unsuspended.entry(name.clone()).or_insert(at);
            }
            if has("Complete") {
                progress.complete.entry(name).or_insert(at);
            } else if has("Failed") && !progress.failed.contains(&name) {
                progress.failed.push(name);
            }
        }
    }))
}

/// A spawned watch, ended when dropped.
struct WatchTask(tokio::task::JoinHandle<()>);

impl Drop for WatchTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Job `name` of phase `letter` in `queue`: one pod of 1 CPU that runs `delay` seconds, as
/// `deploy/examples/kueue/job.yaml`.
fn job(name: &str, letter: &str, queue: &str, delay: u64) -> Result<Job> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "labels": {QUEUE_NAME_LABEL: queue, PHASE_LABEL: letter},
        },
        "spec": {
            "parallelism": 1,
            "completions": 1,
            "backoffLimit": 0,
            "template": {
                "metadata": {
                    "labels": {PHASE_LABEL: letter},
                    "annotations": {KWOK_POD_COMPLETE_DELAY_ANNOTATION: format!("{delay}s")},
                },
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{
                        "name": "work",
                        "image": "busybox:1.36",
                        "command": ["sh", "-c", format!("sleep {delay}")],
                        "resources": {"requests": {"cpu": "1", "memory": "200Mi"}},
                    }],
                },
            },
        },
    }))?)
}

/// The CPU seconds so far of the pair, virtual-node, the bench and Kueue's manager, by name.
fn cpu(pair: &ClusterPair, vn: &VirtualNode, kueue: &Kueue) -> BTreeMap<String, f64> {
    let mut by = cpu_by_component(pair, vn, "tensile-bench");
    if let Ok((_, _, seconds)) = footprint(kueue.pid()) {
        by.insert("upper/kueue".into(), seconds);
    }
    by
}

/// The example's ClusterQueue (its quotas as applied) with the burst flavor removed, named
/// [`LOCAL_ONLY`], and a LocalQueue [`LOCAL_ONLY`] in [`NAMESPACE`] for it.
fn local_only(quotas: &kueue::Quotas) -> Result<[Value; 2]> {
    let mut queue = kueue::example_objects(quotas)?
        .into_iter()
        .find(|o| o["kind"] == "ClusterQueue" && o["metadata"]["name"] == CLUSTER_QUEUE)
        .with_context(|| format!("deploy/examples/kueue has no ClusterQueue {CLUSTER_QUEUE}"))?;
    queue["metadata"] = json!({"name": LOCAL_ONLY});
    for group in queue["spec"]["resourceGroups"]
        .as_array_mut()
        .into_iter()
        .flatten()
    {
        if let Some(flavors) = group["flavors"].as_array_mut() {
            flavors.retain(|f| f["name"] != BURST_FLAVOR);
        }
    }
    let local_queue = json!({
        "apiVersion": kueue::API_VERSION,
        "kind": "LocalQueue",
        "metadata": {"name": LOCAL_ONLY, "namespace": NAMESPACE},
        "spec": {"clusterQueue": LOCAL_ONLY},
    });
    Ok([queue, local_queue])
}

/// Each of the phase's Jobs completed once: one pod upstairs, Succeeded, at most one lower
/// copy (the burst pods' exactly one), and the invariant for the virtual node's pods;
/// "holds" or what broke.
async fn completed_once(
    upper: &Client,
    lower: &Client,
    letter: &str,
    n: usize,
    burst: usize,
) -> Result<String> {
    let selector = ListParams::default().labels(&format!("{PHASE_LABEL}={letter}"));
    let jobs = Api::<Job>::namespaced(upper.clone(), NAMESPACE)
        .list(&selector)
        .await?
        .items;
    let mut broken = Vec::new();
    let once = jobs
        .iter()
        .filter(|j| {
            j.status.as_ref().is_some_and(|s| {
                s.succeeded == Some(1) && s.failed.unwrap_or(0) == 0 && s.active.unwrap_or(0) == 0
            })
        })
        .count();
    if jobs.len() != n || once != n {
        broken.push(format!(
            "{once} of {} Jobs succeeded once with no failure ({n} submitted)",
            jobs.len()
        ));
    }
    let pods = Api::<Pod>::namespaced(upper.clone(), NAMESPACE)
        .list(&selector)
        .await?
        .items;
    let mut per_job: BTreeMap<String, usize> = BTreeMap::new();
    for pod in &pods {
        *per_job
            .entry(
                pod.labels()
                    .get(JOB_NAME_LABEL)
                    .cloned()
                    .unwrap_or_default(),
            )
            .or_default() += 1;
    }
    let succeeded = pods
        .iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded"))
        .count();
    if per_job.len() != n || per_job.values().any(|c| *c != 1) || succeeded != n {
        broken.push(format!(
            "{} upper pods for {} Jobs ({succeeded} Succeeded)",
            pods.len(),
            per_job.len()
        ));
    }
    let copies = Api::<Pod>::namespaced(lower.clone(), NAMESPACE)
        .list(
            &ListParams::default()
                .labels(&format!("{PHASE_LABEL}={letter},{OWNER_NODE_LABEL}={NODE}")),
        )
        .await?
        .items;
    let mut per_uid: BTreeMap<String, usize> = BTreeMap::new();
    for copy in &copies {
        let uid = copy.annotations().get(UPPER_UID_ANNOTATION).cloned();
        *per_uid.entry(uid.unwrap_or_default()).or_default() += 1;
    }
    let on_node = pods
        .iter()
        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(NODE))
        .count();
    if per_uid.values().any(|c| *c != 1) || per_uid.len() != on_node || on_node != burst {
        broken.push(format!(
            "{} lower copies of {} upper pods ({on_node} of them on {NODE}, {burst} Jobs \
             admitted to {BURST_FLAVOR})",
            copies.len(),
            per_uid.len()
        ));
    }
    let (report, took) =
        invariant::converge(upper, lower, NODE, Some(NAMESPACE), Duration::from_secs(60)).await?;
    if !report.holds() {
        broken.push(format!("invariant: {report}"));
    }
    Ok(if broken.is_empty() {
        format!(
            "holds: {n} Jobs, one Succeeded pod each, {on_node} lower copies one each \
             (invariant after {})",
            secs(took)
        )
    } else {
        format!("BROKEN: {}", broken.join("; "))
    })
}

/// Deletes the phase's Jobs (their pods with them) and their Workloads; answers how long
/// until no Job and no pod of the phase was left in either cluster, and until no Workload
/// of it was left either.
async fn delete_phase(
    upper: &Client,
    lower: &Client,
    letter: &str,
) -> Result<(Duration, Duration)> {
    let started = Instant::now();
    let selector = ListParams::default().labels(&format!("{PHASE_LABEL}={letter}"));
    let jobs: Api<Job> = Api::namespaced(upper.clone(), NAMESPACE);
    let delete = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Background),
        ..DeleteParams::default()
    };
    jobs.delete_collection(&delete, &selector)
        .await
        .with_context(|| format!("deleting phase {letter}'s Jobs"))?;
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), NAMESPACE);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), NAMESPACE);
    let pods_gone = wait_for(
        &format!("phase {letter}'s Jobs and pods gone from both clusters"),
        WAIT,
        || async {
            let left = jobs.list(&selector).await?.items.len()
                + upper_pods.list(&selector).await?.items.len()
                + lower_pods.list(&selector).await?.items.len();
            Ok((left == 0).then(|| started.elapsed()))
        },
    )
    .await?;
    // The garbage collector deletes a Job's Workload only once it watches Workloads: the
    // first time, up to its discovery period (30 s) after Kueue's CRDs were installed. The
    // bench deletes what is left itself, as the collector would.
    let workloads = kueue::api(upper, "Workload", Some(NAMESPACE));
    let prefix = format!("{letter}-");
    let phase_workloads = || async {
        anyhow::Ok(
            workloads
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .filter(|w| owner_job(w).is_some_and(|j| j.starts_with(&prefix)))
                .collect::<Vec<_>>(),
        )
    };
    for workload in phase_workloads().await? {
        let name = workload.name_any();
        match workloads.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(error) => {
                return Err(error).with_context(|| format!("deleting Workload {NAMESPACE}/{name}"));
            }
        }
    }
    let workloads_gone = wait_for(
        &format!("phase {letter}'s Workloads gone"),
        WAIT,
        || async {
            Ok(phase_workloads()
                .await?
                .is_empty()
                .then(|| started.elapsed()))
        },
    )
    .await?;
    Ok((pods_gone, workloads_gone))
}

/// Runs one phase: submits `n` Jobs to its queue and waits for each to be admitted and
/// Complete.
async fn run_phase(
    upper: &Client,
    phase: &Phase,
    n: usize,
    args: &Args,
    progress: &Shared,
) -> Result<Figures> {
    let jobs: Api<Job> = Api::namespaced(upper.clone(), NAMESPACE);
    let workloads = kueue::api(upper, "Workload", Some(NAMESPACE));
    let _workloads = watch_workloads(workloads, format!("{}-", phase.letter), progress.clone());
    let _jobs = watch_jobs(jobs.clone(), phase.letter, progress.clone());
    let manifests: Vec<Job> = (0..n)
        .map(|i| {
            job(
                &format!("{}-{i:04}", phase.letter),
                phase.letter,
                phase.queue,
                args.kueue_jobs_delay,
            )
        })
        .collect::<Result<_>>()?;
    let start = Instant::now();
    let post = PostParams::default();
    futures::stream::iter(manifests)
        .map(|job| {
            let (jobs, post) = (&jobs, &post);
            async move {
                let name = job.name_any();
                jobs.create(post, &job)
                    .await
                    .with_context(|| format!("creating Job {NAMESPACE}/{name}"))
            }
        })
        .buffer_unordered(args.concurrency.max(1))
        .try_collect::<Vec<_>>()
        .await?;
    let submitted = start.elapsed();
    // A failed Job ends the wait at once instead of at the deadline.
    wait_for(
        &format!("{n} Jobs of phase {} Complete", phase.name),
        WAIT,
        || async {
            let progress = lock(progress);
            if let Some(job) = progress.failed.first() {
                return Ok(Some(Err(anyhow::anyhow!("Job {NAMESPACE}/{job} failed"))));
            }
            let done = progress.complete.len() >= n && progress.admitted.len() >= n;
            Ok(done.then_some(Ok(())))
        },
    )
    .await??;
    let progress = lock(progress);
    let last = |at: &mut dyn Iterator<Item = Instant>| {
        at.max()
            .map_or(Duration::ZERO, |at| at.saturating_duration_since(start))
    };
    let count = |flavor: &str| {
        progress
            .admitted
            .values()
            .filter(|(_, f)| f == flavor)
            .count()
    };
    Ok(Figures {
        submitted,
        admitted: last(&mut progress.admitted.values().map(|(at, _)| *at)),
        finished: last(&mut progress.complete.values().copied()),
        local: count(LOCAL_FLAVOR),
        burst: count(BURST_FLAVOR),
        turnaround: turnaround(&progress),
    })
}

/// A flavor's Jobs' times from admitted, each sorted.
#[derive(Default)]
struct Turnaround {
    unsuspended: Vec<Duration>,
    complete: Vec<Duration>,
}

/// By flavor, each Job's time from admitted to unsuspended and to Complete.
fn turnaround(progress: &Progress) -> BTreeMap<String, Turnaround> {
    let mut by: BTreeMap<String, Turnaround> = BTreeMap::new();
    for (job, (admitted, flavor)) in &progress.admitted {
        let since = |at: Option<&Instant>| at.map(|at| at.saturating_duration_since(*admitted));
        let times = by.entry(flavor.clone()).or_default();
        times
            .unsuspended
            .extend(since(progress.unsuspended.get(job)));
        times.complete.extend(since(progress.complete.get(job)));
    }
    for times in by.values_mut() {
        times.unsuspended.sort();
        times.complete.sort();
    }
    by
}

/// `flavor p50 / p99 / max` of each flavor's `times`.
fn by_flavor(
    turnaround: &BTreeMap<String, Turnaround>,
    times: impl Fn(&Turnaround) -> &[Duration],
) -> String {
    let shown: Vec<String> = turnaround
        .iter()
        .map(|(flavor, t)| {
            let each = times(t);
            format!(
                "{flavor} {} / {} / {}",
                secs(percentile(each, 50.0)),
                secs(percentile(each, 99.0)),
                secs(each.last().copied().unwrap_or_default())
            )
        })
        .collect();
    shown.join("; ")
}

pub(crate) async fn run(binary: &Path, n: usize, args: &Args) -> Result<()> {
    if n == 0 {
        bail!("--kueue needs at least one Job");
    }
    let delay = args.kueue_jobs_delay;
    // One regular upper node (8 CPU: flavor local's quota), three 8-CPU lower nodes (the
    // virtual node's allocatable: flavor burst's), API servers without their default
    // in-flight limits (the Jobs arrive at once).
    let mut options = PairOptions::default();
    options.upper.nodes = 1;
    options.lower.nodes = LOWER_NODES;
    let inflight = vec![
        "--max-requests-inflight=1000".to_owned(),
        "--max-mutating-requests-inflight=500".to_owned(),
    ];
    options.upper.apiserver_args.clone_from(&inflight);
    options.lower.apiserver_args = inflight;
    eprintln!("starting the cluster pair (one virtual node, Kueue upstairs) ...");
    let pair = ClusterPair::start(options).await?;
    let (upper, lower) = (pair.upper.client().await?, pair.lower.client().await?);
    let quota_flag = format!("--kueue-quota={CLUSTER_QUEUE}/{BURST_FLAVOR}");
    let mut vn = pair.start_virtual_node(&node_options(binary, args, NODE, &[&quota_flag]))?;
    let nodes: Api<Node> = Api::all(upper.clone());
    wait_for(
        &format!("node {NODE} Ready"),
        Duration::from_secs(120),
        || async { Ok(nodes.get_opt(NODE).await?.filter(node_is_ready).map(|_| ())) },
    )
    .await?;
    let mut kueue_options = KueueOptions::default();
    if let Some(qps) = args.kueue_client_qps {
        kueue_options.client_qps = qps as f32;
        kueue_options.client_burst = 2 * qps;
    }
    let kueue = Kueue::start_with(&pair, &pair.upper, &kueue_options).await?;
    let quotas = kueue::flavor_quotas(&nodes.list(&ListParams::default()).await?.items)?;
    let log = || format!("Kueue's log: {}", kueue.log().display());
    kueue::apply_examples(&upper, &quotas)
        .await
        .with_context(log)?;
    for object in local_only(&quotas)? {
        kueue::apply(&upper, &object, "tensile-bench")
            .await
            .with_context(log)?;
    }
    kueue::wait_for_local_queue(&upper, NAMESPACE, LOCAL_ONLY)
        .await
        .with_context(log)?;
    let shown = |flavor: &str| {
        quotas
            .iter()
            .find(|(f, _)| *f == flavor)
            .map(|(_, resources)| {
                let parts: Vec<String> =
                    resources.iter().map(|(r, q)| format!("{r} {q}")).collect();
                parts.join(", ")
            })
            .unwrap_or_default()
    };
    println!(
        "\ntensile-bench --kueue {n}: {}; Kueue v0.17 upstairs (its client {} requests/s, \
         burst {}), deploy/examples/kueue: ClusterQueue {CLUSTER_QUEUE} [{LOCAL_FLAVOR} ({}), {BURST_FLAVOR} ({}, kept by \
         virtual-node {quota_flag})] against ClusterQueue {LOCAL_ONLY} [{LOCAL_FLAVOR}]; \
         {n} one-pod Jobs of 1 CPU, each pod {delay} s; {} creates at once\n",
        super::machine(&pair),
        kueue_options.client_qps,
        kueue_options.client_burst,
        shown(LOCAL_FLAVOR),
        shown(BURST_FLAVOR),
        args.concurrency,
    );
    let mut report = Report { rows: Vec::new() };
    let mut table = Vec::new();
    for phase in &PHASES {
        let label = format!("kueue {}", phase.name);
        let progress = Shared::default();
        let before = cpu(&pair, &vn, &kueue);
        let figures = run_phase(&upper, phase, n, args, &progress).await?;
        let after = cpu(&pair, &vn, &kueue);
        report.row(
            &label,
            &format!("{n} Jobs submitted (first create -> last)"),
            secs(figures.submitted),
        );
        report.row(
            &label,
            "first create -> every Workload admitted",
            secs(figures.admitted),
        );
        report.row(
            &label,
            "first create -> every Job Complete",
            secs(figures.finished),
        );
        report.row(
            &label,
            &format!("admitted to {LOCAL_FLAVOR} / {BURST_FLAVOR}"),
            format!("{} / {}", figures.local, figures.burst),
        );
        report.row(
            &label,
            "a Job admitted -> unsuspended by Kueue p50 / p99 / max",
            by_flavor(&figures.turnaround, |t| &t.unsuspended),
        );
        report.row(
            &label,
            &format!("a Job admitted -> Complete p50 / p99 / max (its pod {delay} s)"),
            by_flavor(&figures.turnaround, |t| &t.complete),
        );
        report.row(
            &label,
            "CPU seconds by component, first create -> all Complete",
            cpu_profile(&before, &after),
        );
        let once = completed_once(&upper, &lower, phase.letter, n, figures.burst).await?;
        report.row(&label, "each Job completed once (invariant)", once);
        let (pods_gone, workloads_gone) = delete_phase(&upper, &lower, phase.letter).await?;
        report.row(
            &label,
            "deleted: Jobs and pods gone from both clusters / Workloads gone",
            format!("{} / {}", secs(pods_gone), secs(workloads_gone)),
        );
        vn.check_running()?;
        table.push((phase.name, figures));
    }

    println!("\n| phase | Jobs | all submitted | all admitted | all finished | local | burst |");
    println!("|---|---|---|---|---|---|---|");
    for (name, f) in &table {
        println!(
            "| {name} | {n} | {} | {} | {} | {} | {} |",
            secs(f.submitted),
            secs(f.admitted),
            secs(f.finished),
            f.local,
            f.burst
        );
    }
    if let [(_, a), (_, b)] = &table[..] {
        println!(
            "\nfinished(B) / finished(A) = {:.2}: the queue drains {} sooner with the burst flavor",
            b.finished.as_secs_f64() / a.finished.as_secs_f64().max(1e-9),
            secs(b.finished.saturating_sub(a.finished)),
        );
    }
    kueue.stop().await?;
    vn.stop()?;
    println!("\n{} figures.", report.rows.len());
    Ok(())
}
