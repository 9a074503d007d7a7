//! tensile-bench: measures virtual-node on its own cluster pair and prints a table.
//!
//! Scenarios (DESIGN.md targets): burst vs. the same pods straight in the lower cluster
//! and vs. its floor (the same pods in both clusters at once, nothing of tensile involved),
//! status reflection delay (during the burst, and for pods already mirrored and Running
//! whose lower Ready condition the bench flips as a kubelet would), deletion, footprint
//! (memory, CPU, API requests per pod), and restart catch-up with the writes it made.
//! Figures, not assertions.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::{Value, json};
use tensile_harness::fixtures::{bound_pod, pinned_spec, pod};
use tensile_harness::measure::{
    cpu_by_component, cpu_profile, footprint, percentile, resident_split, scrape, settle_resident,
    slope,
};
use tensile_harness::{
    ClusterPair, NodeShape, PairOptions, TestNamespace, VirtualNode, VirtualNodeOptions,
    node_is_ready, wait_for,
};
use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;

mod burst_hpa;
mod federation;
mod granularity;
mod kueue_burst;
mod member_footprint;
mod return_home;
mod scrape;

#[derive(Parser)]
#[command(about = "Benchmarks virtual-node against a local cluster pair")]
struct Args {
    /// Pods in the burst, status and deletion scenarios.
    #[arg(long, default_value_t = 1000)]
    pods: usize,
    /// Mirrored-pod counts at which to measure footprint (the largest is also restarted).
    /// Empty to skip.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    footprint: Vec<usize>,
    /// Pods the bench creates at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// virtual-node's `--client-qps` / `--kube-api-qps` (burst = 2×).
    #[arg(long, default_value_t = 2000)]
    qps: u32,
    /// Lower pods a second whose Ready condition the bench flips when measuring status
    /// reflection for pods already mirrored (paced, so the figure is a latency).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    flip_rate: u32,
    /// The virtual-node binary (default: beside this one).
    #[arg(long)]
    virtual_node: Option<PathBuf>,
    /// virtual-node's tokio worker threads (`TOKIO_WORKER_THREADS`); default: one per core
    /// (a federated process: at least `tensile::runtime::FEDERATED_MIN_WORKERS`).
    /// With `--lower-clusters`, the one process's (serving every member).
    /// `--runtime-workers 16` on a small machine gives it the runtime a 16-core box gets
    /// by default, and the allocator arenas its threads bring.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    runtime_workers: Option<u16>,
    /// Leave the footprint's pods in place after the restart instead of deleting them
    /// from both clusters and timing that (the pair is torn down either way): the
    /// deletion of 50 000 pods takes longer than creating them on a small machine.
    #[arg(long)]
    skip_deletion: bool,
    /// Instead of the single-cluster scenarios: N lower clusters served by one process
    /// (members joined by `virtual-node join`) against N single-cluster processes, at
    /// `--pods` pods in all.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=20))]
    lower_clusters: Option<u16>,
    /// With `--lower-clusters N`, instead of the comparison: the one process's memory with
    /// this many pods mirrored on each member (N times as many in all) at each size, and
    /// its projection to 1 000 000 pods over the N members.
    #[arg(long, value_delimiter = ',', requires = "lower_clusters")]
    member_footprint: Vec<usize>,
    /// With `--lower-clusters N`: the N processes are measured first, the one process
    /// after (to tell the order's share in a gap).
    #[arg(long, requires = "lower_clusters")]
    separate_first: bool,
    /// With `--lower-clusters N`: the bench creates the burst's pods at this many a second
    /// (each way the same arrivals), instead of as fast as `--concurrency` allows: as fast
    /// as possible, the way that loads the upper API server less is handed its pods
    /// sooner, more of them at once, and its latency per pod measures that too.
    #[arg(long, requires = "lower_clusters")]
    create_rate: Option<f64>,
    /// With `--lower-clusters N`: both ways run side by side on the same clusters, and two
    /// bursts each take `--pods` pods for each way at once, created alternately (the same
    /// arrivals, moment and API servers for both; one after the other, the way measured
    /// second was slower whichever it was); no isolation scenario.
    #[arg(long, requires = "lower_clusters", conflicts_with = "separate_first")]
    side_by_side: bool,
    /// Instead of the other scenarios: the cost of one scrape of the virtual node's kubelet
    /// `/metrics/resource` (time, bytes, lower API requests) at each of these pod counts,
    /// its lower cluster running metrics-server.
    #[arg(long, value_delimiter = ',')]
    scrape: Vec<usize>,
    /// Instead of the other scenarios: an HPA on CPU scales a Deployment from 8 local pods
    /// out by `--pods` burst pods over two virtual nodes (burst priorities 1 and 2) and back;
    /// times each way from the HPA's decision (issue #35).
    #[arg(long)]
    burst_hpa: bool,
    /// Instead of the other scenarios: one member whose lower cluster has this many kwok
    /// nodes, joined as one virtual node and then as one virtual node per lower node
    /// (`--node-granularity node`): time to Ready, memory per virtual node, upper writes at
    /// rest, and a burst of `--pods` pods over them (issue #36).
    #[arg(long, value_parser = clap::value_parser!(u32).range(2..))]
    lower_nodes: Option<u32>,
    /// Instead of the other scenarios: this many burst pods of one Deployment on the
    /// virtual node (a filler holds the two regular upper nodes) come home once the filler
    /// scales in, moved by `tensile-descheduler --return-home` (issue #51): the time from
    /// the room returned to the last burst pod home, evictions per pod moved, the CPU
    /// seconds by component, then `--return-home-steady` of steady state.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    return_home: Option<u32>,
    /// With `--return-home`: the descheduler's `--return-home-after`, in seconds (its
    /// default).
    #[arg(long, default_value_t = 60)]
    return_home_after: u64,
    /// With `--return-home`: the descheduler's `--descheduling-interval`, in seconds (its
    /// default).
    #[arg(long, default_value_t = 10)]
    return_home_interval: u64,
    /// With `--return-home`: the descheduler's moves per round and per owner, and the
    /// PodDisruptionBudget's `maxUnavailable`.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    return_home_batch: u32,
    /// With `--return-home`: seconds of steady state watched after the last pod came home.
    #[arg(long, default_value_t = 300)]
    return_home_steady: u64,
    /// Instead of the other scenarios: this many one-pod Jobs of 1 CPU (200 without a
    /// number) through Kueue upstairs (deploy/examples/kueue: flavor local one 8-CPU regular
    /// node, flavor burst the virtual node over three 8-CPU lower nodes, virtual-node
    /// `--kueue-quota`), then the same Jobs with the burst flavor removed (issue 52): submit
    /// -> all admitted -> all finished, Jobs per flavor, CPU seconds by component.
    #[arg(long, num_args = 0..=1, default_missing_value = "200",
        value_parser = clap::value_parser!(u32).range(1..))]
    kueue: Option<u32>,
    /// With `--kueue`: seconds each Job's pod runs (kwok's pod-complete delay, upstairs and
    /// below alike).
    #[arg(long, default_value_t = 10, requires = "kueue",
        value_parser = clap::value_parser!(u64).range(1..))]
    kueue_jobs_delay: u64,
    /// With `--kueue`: Kueue's client rate to the upper API server, requests a second
    /// (burst twice that); default its manifests' 50 (burst 100).
    #[arg(long, requires = "kueue", value_parser = clap::value_parser!(u32).range(1..))]
    kueue_client_qps: Option<u32>,
    /// A further flag for the single-cluster scenarios' virtual-node (repeatable), e.g.
    /// `--node-arg=--lower-namespace=prefixed` to measure a mode's cost.
    #[arg(long, allow_hyphen_values = true)]
    node_arg: Vec<String>,
}

const NODE: &str = "vk-bench";
/// The kwok node of the upper cluster the both-clusters floor binds its upper pods to
/// (type `kwok`, untainted: the virtual node's pinned pods cannot select it). It exists
/// only during that scenario.
const UPPER_FLOOR_NODE: &str = "upper-kwok-floor";
const PODS_PER_LOWER_NODE: usize = 1000;
const WAIT: Duration = Duration::from_secs(1800);

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,kube_client=off".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("tensile-bench: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// When each pod was created, first seen by the bench's watch and first seen Running, by
/// name.
#[derive(Default)]
struct Timeline {
    created: HashMap<String, Instant>,
    seen: HashMap<String, Instant>,
    running: HashMap<String, Instant>,
}

impl Timeline {
    /// The pods whose names `keep` keeps.
    fn only(&self, keep: impl Fn(&str) -> bool) -> Timeline {
        let only = |times: &HashMap<String, Instant>| {
            times
                .iter()
                .filter(|(name, _)| keep(name))
                .map(|(name, at)| (name.clone(), *at))
                .collect()
        };
        Timeline {
            created: only(&self.created),
            seen: only(&self.seen),
            running: only(&self.running),
        }
    }
}

type Shared = Arc<Mutex<Timeline>>;

fn lock<T>(t: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    t.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records, from a watch, when each pod of `api` matching `labels` is first seen and first
/// Running.
fn track_running(api: Api<Pod>, labels: &str, timeline: Shared) -> tokio::task::JoinHandle<()> {
    let config = watcher::Config::default().labels(labels);
    tokio::spawn(async move {
        let mut events = std::pin::pin!(
            watcher::watcher(api, config)
                .default_backoff()
                .applied_objects()
        );
        while let Some(event) = events.next().await {
            let Ok(pod) = event else { continue };
            let now = Instant::now();
            let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            let Some(name) = pod.metadata.name else {
                continue;
            };
            let mut timeline = lock(&timeline);
            if running {
                timeline.running.entry(name.clone()).or_insert(now);
            }
            timeline.seen.entry(name).or_insert(now);
        }
    })
}

/// How the bench creates a burst's pods: at most `concurrency` creates at once, and, with
/// `per_second`, each pod not before its turn at that rate.
#[derive(Clone, Copy)]
struct Pace {
    concurrency: usize,
    per_second: Option<f64>,
}

impl From<usize> for Pace {
    fn from(concurrency: usize) -> Self {
        Self {
            concurrency,
            per_second: None,
        }
    }
}

/// Creates `pods` at `pace`, recording each creation time.
async fn create_all(
    api: &Api<Pod>,
    pods: Vec<Pod>,
    pace: impl Into<Pace>,
    timeline: &Shared,
) -> Result<()> {
    let pace = pace.into();
    let start = tokio::time::Instant::now();
    futures::stream::iter(pods.into_iter().enumerate())
        .map(|(i, p)| async move {
            if let Some(rate) = pace.per_second.filter(|r| *r > 0.0) {
                tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate)).await;
            }
            let name = p.metadata.name.clone().unwrap_or_default();
            lock(timeline).created.insert(name.clone(), Instant::now());
            api.create(&PostParams::default(), &p)
                .await
                .with_context(|| format!("creating pod {name}"))
        })
        .buffer_unordered(pace.concurrency)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

async fn wait_all_running(timeline: &Shared, n: usize, what: &str) -> Result<()> {
    wait_for(what, WAIT, || async {
        Ok((lock(timeline).running.len() >= n).then_some(()))
    })
    .await
}

struct Latencies {
    total: Duration,
    p50: Duration,
    p90: Duration,
    p99: Duration,
    max: Duration,
}

fn latencies(timeline: &Timeline, from: Instant) -> Latencies {
    let mut each: Vec<Duration> = timeline
        .running
        .iter()
        .filter_map(|(name, at)| Some(at.saturating_duration_since(*timeline.created.get(name)?)))
        .collect();
    each.sort();
    let last = timeline.running.values().max().copied().unwrap_or(from);
    Latencies {
        total: last.saturating_duration_since(from),
        p50: percentile(&each, 50.0),
        p90: percentile(&each, 90.0),
        p99: percentile(&each, 99.0),
        max: each.last().copied().unwrap_or_default(),
    }
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

struct Report {
    rows: Vec<(String, String, String)>,
}

impl Report {
    fn row(&mut self, scenario: &str, measure: &str, value: String) {
        println!("  {scenario:<34} {measure:<44} {value}");
        self.rows.push((scenario.into(), measure.into(), value));
    }

    /// jemalloc's account at the latest of `allocator` (and per further pod since the
    /// first), and the CPU seconds virtual-node used since the first pod.
    fn allocator_and_cpu(&mut self, label: &str, allocator: &[(f64, Vec<f64>)], cpu: f64) {
        self.row(
            label,
            "jemalloc allocated / active / metadata / resident / retained",
            allocator_row(allocator),
        );
        self.row(
            label,
            "CPU seconds since the first pod",
            format!("{cpu:.1} s"),
        );
    }
}

/// One scenario's pods in a namespace of their own.
async fn burst(
    client: &Client,
    prefix: &str,
    pods: Vec<Pod>,
    pace: impl Into<Pace>,
) -> Result<(TestNamespace, Latencies, Shared)> {
    let ns = TestNamespace::create(client, prefix).await?;
    let api: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let timeline = Shared::default();
    let n = pods.len();
    let tracker = track_running(api.clone(), "bench=1", timeline.clone());
    let start = Instant::now();
    create_all(&api, pods, pace, &timeline).await?;
    wait_all_running(&timeline, n, &format!("{n} pods Running ({prefix})")).await?;
    tracker.abort();
    let result = latencies(&lock(&timeline), start);
    Ok((ns, result, timeline))
}

/// The floor under a burst onto the virtual node, with nothing of tensile involved: `n`
/// pods straight in the lower cluster (as the baseline) and, at the same time, `n` pods in
/// the upper cluster bound to its kwok node `upper_node`, each side `concurrency` at a
/// time. Latencies are over all 2`n` pods; the total ends when the last of them is Running.
async fn both_clusters(
    upper: &Client,
    lower: &Client,
    upper_node: &str,
    n: usize,
    concurrency: usize,
) -> Result<(TestNamespace, TestNamespace, Latencies)> {
    let prefix = "bench-floor";
    let upper_ns = TestNamespace::create(upper, prefix).await?;
    let lower_ns = TestNamespace::create(lower, prefix).await?;
    let upper_api: Api<Pod> = Api::namespaced(upper.clone(), &upper_ns.name);
    let lower_api: Api<Pod> = Api::namespaced(lower.clone(), &lower_ns.name);
    let upper_spec =
        json!({"nodeName": upper_node, "containers": [{"name": "app", "image": "nginx"}]});
    let lower_spec = json!({"containers": [{"name": "app", "image": "nginx"}]});
    let upper_pods: Vec<Pod> = (0..n)
        .map(|i| labelled(pod(&format!("p-{i:05}"), upper_spec.clone())))
        .collect();
    let lower_pods: Vec<Pod> = (0..n)
        .map(|i| labelled(pod(&format!("p-{i:05}"), lower_spec.clone())))
        .collect();
    let (upper_timeline, lower_timeline) = (Shared::default(), Shared::default());
    let upper_tracker = track_running(upper_api.clone(), "bench=1", upper_timeline.clone());
    let lower_tracker = track_running(lower_api.clone(), "bench=1", lower_timeline.clone());
    let start = Instant::now();
    let upper_what = format!("{n} upper pods Running on {upper_node} ({prefix})");
    let lower_what = format!("{n} lower pods Running ({prefix})");
    let outcome = async {
        tokio::try_join!(
            create_all(&upper_api, upper_pods, concurrency, &upper_timeline),
            create_all(&lower_api, lower_pods, concurrency, &lower_timeline),
        )?;
        tokio::try_join!(
            wait_all_running(&upper_timeline, n, &upper_what),
            wait_all_running(&lower_timeline, n, &lower_what),
        )?;
        anyhow::Ok(())
    }
    .await;
    upper_tracker.abort();
    lower_tracker.abort();
    outcome.with_context(|| {
        format!(
            "both-clusters floor in upper {} and lower {}",
            upper_ns.name, lower_ns.name
        )
    })?;
    // One timeline of all 2n pods, the names told apart by cluster.
    let mut all = Timeline::default();
    for (side, timeline) in [("upper", &upper_timeline), ("lower", &lower_timeline)] {
        let timeline = lock(timeline);
        for (name, at) in &timeline.created {
            all.created.insert(format!("{side}/{name}"), *at);
        }
        for (name, at) in &timeline.running {
            all.running.insert(format!("{side}/{name}"), *at);
        }
    }
    let result = latencies(&all, start);
    Ok((upper_ns, lower_ns, result))
}

/// Adds the upper cluster's kwok node for the floor, after checking that the scheduler
/// burst's pods could not select it.
async fn add_upper_floor_node(pair: &ClusterPair, upper: &Client) -> Result<()> {
    pair.upper
        .add_nodes(&[UPPER_FLOOR_NODE.to_owned()])
        .await
        .with_context(|| format!("adding the upper kwok node {UPPER_FLOOR_NODE}"))?;
    let nodes: Api<Node> = Api::all(upper.clone());
    let node = nodes
        .get(UPPER_FLOOR_NODE)
        .await
        .with_context(|| format!("reading node {UPPER_FLOOR_NODE}"))?;
    let labels = node.metadata.labels.unwrap_or_default();
    let pinned = pinned_spec(NODE);
    if let Some(selector) = pinned.get("nodeSelector").and_then(Value::as_object) {
        let matches = selector
            .iter()
            .all(|(k, v)| labels.get(k).map(String::as_str) == v.as_str());
        if matches {
            bail!("node {UPPER_FLOOR_NODE} matches the nodeSelector of the virtual node's pods");
        }
    }
    Ok(())
}

/// Deletes the upper kwok node of the floor and waits until it is gone.
async fn delete_upper_floor_node(upper: &Client) -> Result<()> {
    let nodes: Api<Node> = Api::all(upper.clone());
    nodes
        .delete(UPPER_FLOOR_NODE, &DeleteParams::default())
        .await
        .with_context(|| format!("deleting node {UPPER_FLOOR_NODE}"))?;
    wait_for(
        &format!("node {UPPER_FLOOR_NODE} gone"),
        Duration::from_secs(60),
        || async {
            Ok(nodes
                .get_opt(UPPER_FLOOR_NODE)
                .await?
                .is_none()
                .then_some(()))
        },
    )
    .await
}

fn labelled(mut p: Pod) -> Pod {
    p.metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert("bench".into(), "1".into());
    p
}

async fn delete_and_wait(upper: &Client, lower: &Client, ns: &str, n: usize) -> Result<Duration> {
    let start = Instant::now();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), ns);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), ns);
    let lp = ListParams::default().labels("bench=1");
    // A collection of thousands can outlast the API server's request timeout; what it
    // deleted stays deleted, so the call is repeated until it completes.
    let mut deleted = false;
    for _ in 0..10 {
        match upper_pods
            .delete_collection(&DeleteParams::default(), &lp)
            .await
        {
            Ok(_) => {
                deleted = true;
                break;
            }
            Err(error) => eprintln!("tensile-bench: deleting {n} pods, retrying: {error}"),
        }
    }
    if !deleted {
        bail!("could not delete the pods of {ns}");
    }
    wait_for(
        &format!("{n} pods gone from both clusters"),
        WAIT,
        || async {
            let left = upper_pods.list_metadata(&lp).await?.items.len()
                + lower_pods.list_metadata(&lp).await?.items.len();
            Ok((left == 0).then_some(()))
        },
    )
    .await?;
    Ok(start.elapsed())
}

/// When each pod was first seen, by a watch, with its Ready condition at one status.
#[derive(Default)]
struct ReadySightings {
    /// The watch's first list is complete: sightings from now on are changes.
    listed: bool,
    first: HashMap<String, Instant>,
    /// Pods seen at the status and later seen off it again.
    reverted: BTreeSet<String>,
}

type SharedSightings = Arc<Mutex<ReadySightings>>;

fn ready_status(pod: &Pod) -> Option<&str> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.status.as_str())
}

/// Watches the bench's pods of `api`, recording when each first shows Ready=`want`.
async fn track_ready(api: Api<Pod>, want: &'static str, sightings: SharedSightings) {
    let config = watcher::Config::default().labels("bench=1");
    let mut events = std::pin::pin!(watcher::watcher(api, config).default_backoff());
    while let Some(event) = events.next().await {
        let at = Instant::now();
        let pod = match event {
            Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => pod,
            Ok(watcher::Event::InitDone) => {
                lock(&sightings).listed = true;
                continue;
            }
            _ => continue,
        };
        let Some(name) = pod.metadata.name.as_deref() else {
            continue;
        };
        let mut seen = lock(&sightings);
        if ready_status(&pod) == Some(want) {
            seen.first.entry(name.to_owned()).or_insert(at);
        } else if seen.first.contains_key(name) {
            seen.reverted.insert(name.to_owned());
        }
    }
}

/// A strategic merge patch of a pod's status (conditions merge by type) that sets Ready
/// and ContainersReady as a kubelet does when a readiness probe changes, with a fresh
/// lastTransitionTime.
fn ready_patch(ready: bool) -> Value {
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let (status, reason, message) = if ready {
        ("True", Value::Null, Value::Null)
    } else {
        (
            "False",
            json!("ContainersNotReady"),
            json!("containers with unready status: [app]"),
        )
    };
    let condition = |kind: &str| {
        json!({
            "type": kind,
            "status": status,
            "lastTransitionTime": now,
            "reason": reason,
            "message": message,
        })
    };
    json!({"status": {"conditions": [condition("Ready"), condition("ContainersReady")]}})
}

/// Plays the lower kubelet: sets the Ready condition of each lower pod `names` in `ns`,
/// one pod every 1/`rate` s (the patches are not waited for one by one, so a slow one
/// does not hold back the pace).
async fn flip_ready(
    lower: &Api<Pod>,
    ns: &str,
    names: &[String],
    ready: bool,
    rate: u32,
) -> Result<()> {
    let mut ticks = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate)));
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut patches = JoinSet::new();
    let finish = |done: Result<Result<()>, tokio::task::JoinError>| -> Result<()> {
        done.context("status patch task")?
    };
    for name in names {
        ticks.tick().await;
        let (api, name, ns) = (lower.clone(), name.clone(), ns.to_owned());
        let body = ready_patch(ready);
        patches.spawn(async move {
            api.patch_status(&name, &PatchParams::default(), &Patch::Strategic(body))
                .await
                .map(|_| ())
                .with_context(|| format!("setting Ready={ready} on lower pod {ns}/{name}"))
        });
        while let Some(done) = patches.try_join_next() {
            finish(done)?;
        }
    }
    while let Some(done) = patches.join_next().await {
        finish(done)?;
    }
    Ok(())
}

/// Status reflection for pods already mirrored and Running: flips the Ready condition of
/// the lower pods `names` in `ns` to `ready` at `rate` pods a second and returns, sorted,
/// each pod's delay from the bench's watch on the lower pods seeing the change to its
/// watch on the upper pods seeing it.
async fn ready_reflection(
    upper: &Client,
    lower: &Client,
    ns: &str,
    names: &[String],
    ready: bool,
    rate: u32,
) -> Result<Vec<Duration>> {
    let want = if ready { "True" } else { "False" };
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), ns);
    let below = SharedSightings::default();
    let above = SharedSightings::default();
    // Dropping the set (on return or error) stops both watches.
    let mut watches = JoinSet::new();
    watches.spawn(track_ready(lower_pods.clone(), want, below.clone()));
    watches.spawn(track_ready(
        Api::namespaced(upper.clone(), ns),
        want,
        above.clone(),
    ));
    wait_for(
        "the bench's watches on the upper and lower pods to list them",
        Duration::from_secs(60),
        || async { Ok((lock(&below).listed && lock(&above).listed).then_some(())) },
    )
    .await?;
    for (side, seen) in [("lower", &below), ("upper", &above)] {
        if let Some(name) = lock(seen).first.keys().next() {
            bail!(
                "{side} pod {ns}/{name} shows Ready={want} before the bench set it \
                 (something else rewrites the condition: kwok's stages?)"
            );
        }
    }
    flip_ready(&lower_pods, ns, names, ready, rate).await?;
    let n = names.len();
    let missing = |seen: &SharedSightings| -> String {
        let seen = lock(seen);
        let left: Vec<&str> = names
            .iter()
            .filter(|name| !seen.first.contains_key(*name))
            .map(String::as_str)
            .take(10)
            .collect();
        left.join(", ")
    };
    wait_for(
        &format!("{n} lower and upper pods to show Ready={want}"),
        Duration::from_secs(120),
        || async {
            let done = lock(&below).first.len() >= n && lock(&above).first.len() >= n;
            Ok(done.then_some(()))
        },
    )
    .await
    .with_context(|| {
        format!(
            "not seen with Ready={want} in {ns}: lower [{}], upper [{}]",
            missing(&below),
            missing(&above)
        )
    })?;
    watches.shutdown().await;
    for (side, seen) in [("lower", &below), ("upper", &above)] {
        if let Some(name) = lock(seen).reverted.iter().next() {
            bail!(
                "{side} pod {ns}/{name} went back from Ready={want} after the bench set it: \
                 something else rewrites the condition (kwok's stages?)"
            );
        }
    }
    let (below, above) = (lock(&below), lock(&above));
    let mut delays = names
        .iter()
        .map(|name| {
            let t0 = below.first.get(name);
            let t1 = above.first.get(name);
            match (t0, t1) {
                (Some(t0), Some(t1)) => Ok(t1.saturating_duration_since(*t0)),
                _ => Err(anyhow::anyhow!(
                    "pod {ns}/{name} not seen with Ready={want}"
                )),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    delays.sort();
    Ok(delays)
}

fn p50_p99_max(sorted: &[Duration]) -> String {
    format!(
        "{} / {} / {}",
        ms(percentile(sorted, 50.0)),
        ms(percentile(sorted, 99.0)),
        ms(sorted.last().copied().unwrap_or_default())
    )
}

/// p50 / p99 of the upper API server's answers to virtual-node's status writes between
/// two scrapes, from its `tensile_upper_status_write_seconds` histogram: the bucket bound
/// each falls under.
fn status_write_quantiles(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>) -> String {
    const PREFIX: &str = "tensile_upper_status_write_seconds_bucket{le=\"";
    let mut buckets: Vec<(f64, f64)> = after
        .iter()
        .filter_map(|(key, count)| {
            let bound = key.strip_prefix(PREFIX)?.strip_suffix("\"}")?;
            let bound = if bound == "+Inf" {
                f64::INFINITY
            } else {
                bound.parse().ok()?
            };
            Some((bound, count - before.get(key).copied().unwrap_or(0.0)))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let Some(&(_, total)) = buckets.last() else {
        return "no histogram (older virtual-node?)".to_owned();
    };
    let quantile = |q: f64| {
        buckets
            .iter()
            .find(|(_, cumulative)| *cumulative >= q * total)
            .map_or("-".to_owned(), |(bound, _)| {
                if bound.is_finite() {
                    format!("<= {} ms", bound * 1000.0)
                } else {
                    "> 5 s".to_owned()
                }
            })
    };
    format!("{} / {} ({total:.0} writes)", quantile(0.5), quantile(0.99))
}

/// Writes virtual-node made for pods: upper status writes, lower creates, updates and
/// orphan deletions (the lease and node status are not pod writes).
fn pod_writes(metrics: &BTreeMap<String, f64>) -> f64 {
    [
        "tensile_upper_status_writes_total",
        "tensile_lower_pod_creates_total",
        "tensile_lower_pod_updates_total",
        "tensile_orphans_deleted_total",
    ]
    .iter()
    .map(|k| metrics.get(*k).copied().unwrap_or(0.0))
    .sum()
}

/// `tensile_memory_bytes` by owner, in MiB, and what of the anonymous resident memory
/// none of them holds (HTTP connections, the runtime, the allocator's free lists). An
/// error if virtual-node exports no such series.
fn heap_by_owner(metrics: &BTreeMap<String, f64>, anonymous: f64) -> Result<String> {
    let prefix = "tensile_memory_bytes{owner=\"";
    let owners: Vec<(&str, f64)> = metrics
        .iter()
        .filter_map(|(series, bytes)| {
            let owner = series.strip_prefix(prefix)?.strip_suffix("\"}")?;
            Some((owner, *bytes))
        })
        .collect();
    anyhow::ensure!(
        !owners.is_empty(),
        "virtual-node exports no tensile_memory_bytes"
    );
    let mib = |bytes: f64| bytes / 1048576.0;
    let held: f64 = owners.iter().map(|(_, bytes)| bytes).sum();
    let mut parts: Vec<String> = owners
        .iter()
        .map(|(owner, bytes)| format!("{owner} {:.1}", mib(*bytes)))
        .collect();
    parts.push(format!("/ rest {:.1} MiB", mib(anonymous - held)));
    Ok(parts.join(", "))
}

/// jemalloc's statistics that [`allocator_row`] reports, in its order.
const ALLOCATOR_STATS: [&str; 5] = ["allocated", "active", "metadata", "resident", "retained"];

/// `tensile_allocator_bytes{stat}` of [`ALLOCATOR_STATS`], in bytes (0 where absent).
fn allocator_stats(metrics: &BTreeMap<String, f64>) -> Vec<f64> {
    ALLOCATOR_STATS
        .iter()
        .map(|stat| {
            metrics
                .get(&format!("tensile_allocator_bytes{{stat=\"{stat}\"}}"))
                .copied()
                .unwrap_or(0.0)
        })
        .collect()
}

/// The allocator's statistics at the latest of `samples` ((mirrored pods, the statistics
/// of [`ALLOCATOR_STATS`]) at each size) in MiB, and from the second size on what each
/// grew per further pod since the first.
fn allocator_row(samples: &[(f64, Vec<f64>)]) -> String {
    let Some((pods, last)) = samples.last() else {
        return "no sample".to_owned();
    };
    let now: Vec<String> = last
        .iter()
        .map(|bytes| format!("{:.1}", bytes / 1048576.0))
        .collect();
    let mut row = format!("{} MiB", now.join(" / "));
    if let Some((first, at_first)) = samples.first().filter(|(first, _)| pods > first) {
        let per_pod: Vec<String> = last
            .iter()
            .zip(at_first)
            .map(|(now, then)| format!("{:.0}", (now - then) / (pods - first)))
            .collect();
        row.push_str(&format!("; per further pod {} B", per_pod.join(" / ")));
    }
    row
}

/// Bytes per mirrored pod at the latest of `samples` ((pods, resident, anonymous) at each
/// size): what the two pod stores hold (their `tensile_memory_bytes`) per pod, and the
/// resident memory added per pod since the first size (from the second size on).
fn per_pod(metrics: &BTreeMap<String, f64>, samples: &[(f64, f64, f64)]) -> String {
    let stores: f64 = ["upper pods", "lower pods"]
        .iter()
        .map(|owner| {
            metrics
                .get(&format!("tensile_memory_bytes{{owner=\"{owner}\"}}"))
                .copied()
                .unwrap_or(0.0)
        })
        .sum();
    let Some(&(pods, resident, _)) = samples.last() else {
        return "no sample".to_owned();
    };
    let added = match samples.first() {
        Some(&(first, at_first, _)) if pods > first => {
            format!("{:.0} B", (resident - at_first) / (pods - first))
        }
        _ => "(one size)".to_owned(),
    };
    format!("{:.0} B / {added}", stores / pods.max(1.0))
}

fn requests_by_verb(
    metrics: &BTreeMap<String, f64>,
    base: &BTreeMap<String, f64>,
    pods: usize,
) -> String {
    let mut parts = Vec::new();
    for cluster in ["upper", "lower"] {
        for verb in ["get", "watch", "create", "update", "patch", "delete"] {
            let key =
                format!("tensile_api_requests_total{{cluster=\"{cluster}\",verb=\"{verb}\"}}");
            let delta = metrics.get(&key).unwrap_or(&0.0) - base.get(&key).unwrap_or(&0.0);
            if delta > 0.0 {
                parts.push(format!("{cluster} {verb} {:.2}", delta / pods as f64));
            }
        }
    }
    parts.join(", ")
}

async fn start_node(
    pair: &ClusterPair,
    binary: &std::path::Path,
    args: &Args,
    node: &str,
) -> Result<VirtualNode> {
    let options = node_options(binary, args, node, &[]);
    let vn = pair.start_virtual_node(&options)?;
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(pair.upper.client().await?);
    wait_for(
        &format!("node {node} Ready"),
        Duration::from_secs(120),
        || async { Ok(nodes.get_opt(node).await?.filter(node_is_ready).map(|_| ())) },
    )
    .await?;
    Ok(vn)
}

/// The single-cluster scenarios' virtual-node `node`: the bench's rate limits, 32 pod
/// workers, `first` and then `--node-arg`s, `--runtime-workers`.
fn node_options(
    binary: &std::path::Path,
    args: &Args,
    node: &str,
    first: &[&str],
) -> VirtualNodeOptions {
    let (qps, burst) = (args.qps.to_string(), (2 * args.qps).to_string());
    let mut options = VirtualNodeOptions::new(binary, node);
    if let Some(workers) = args.runtime_workers {
        options
            .envs
            .push(("TOKIO_WORKER_THREADS".into(), workers.to_string()));
    }
    let rates = [
        "--client-qps",
        &qps,
        "--client-burst",
        &burst,
        "--kube-api-qps",
        &qps,
        "--kube-api-burst",
        &burst,
        "--pod-sync-workers",
        "32",
        "--log-level",
        "warn",
    ];
    options.args = first
        .iter()
        .chain(&rates)
        .map(ToString::to_string)
        .chain(args.node_arg.iter().cloned())
        .collect();
    options
}

/// Pair options for a benchmark whose lower cluster has room for `pods` pods: nodes of
/// [`PODS_PER_LOWER_NODE`] pods (and CPU and memory to spare), one more than needed, and
/// API servers that take bursts without their default in-flight limits.
fn lower_for(pods: usize) -> PairOptions {
    let mut options = PairOptions::default();
    options.lower.nodes = pods.div_ceil(PODS_PER_LOWER_NODE) + 1;
    options.lower.node_shape = NodeShape {
        cpu: "1000".into(),
        memory: "4Ti".into(),
        pods: PODS_PER_LOWER_NODE.to_string(),
    };
    let inflight = vec![
        "--max-requests-inflight=1000".to_owned(),
        "--max-mutating-requests-inflight=500".to_owned(),
    ];
    options.upper.apiserver_args.clone_from(&inflight);
    options.lower.apiserver_args = inflight;
    options
}

async fn run(args: Args) -> Result<()> {
    let binary = match &args.virtual_node {
        Some(path) => path.clone(),
        None => std::env::current_exe()?.with_file_name("virtual-node"),
    };
    if !binary.exists() {
        bail!(
            "{} not found: build it first (`cargo build --release --workspace --bins`)",
            binary.display()
        );
    }
    if let Some(clusters) = args.lower_clusters
        && !args.member_footprint.is_empty()
    {
        let clusters = usize::from(clusters);
        return member_footprint::run(&binary, clusters, &args.member_footprint, &args).await;
    }
    if let Some(clusters) = args.lower_clusters {
        return federation::run(&binary, usize::from(clusters), &args).await;
    }
    if !args.scrape.is_empty() {
        return scrape::run(&binary, &args.scrape, &args).await;
    }
    if args.burst_hpa {
        return burst_hpa::run(&binary, &args).await;
    }
    if let Some(pods) = args.return_home {
        return return_home::run(&binary, usize::try_from(pods)?, &args).await;
    }
    if let Some(jobs) = args.kueue {
        return kueue_burst::run(&binary, usize::try_from(jobs)?, &args).await;
    }
    if let Some(nodes) = args.lower_nodes {
        return granularity::run(&binary, usize::try_from(nodes)?, &args).await;
    }
    let largest = args
        .footprint
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(args.pods);
    let mut options = lower_for(largest);
    // The upper cluster starts with no kwok node; the floor adds one of this shape.
    options.upper.node_shape = NodeShape {
        cpu: "1000".into(),
        memory: "4Ti".into(),
        pods: args.pods.max(110).to_string(),
    };
    eprintln!(
        "starting the cluster pair ({} lower kwok nodes of {PODS_PER_LOWER_NODE} pods) ...",
        options.lower.nodes
    );
    let pair = ClusterPair::start(options).await?;
    let (upper, lower) = (pair.upper.client().await?, pair.lower.client().await?);
    let mut vn = start_node(&pair, &binary, &args, NODE).await?;

    println!("\ntensile-bench: {}, {} pods", machine(&pair), args.pods,);
    println!(
        "limits: virtual-node --client-qps/--kube-api-qps {} (burst {}), 32 pod workers, tokio workers: {}; bench creates {} pods at a time; \
         apiservers --max-requests-inflight=1000 --max-mutating-requests-inflight=500; \
         kube-scheduler and controller-manager qps 500; kwok pods Running at once (fast stages); \
         bench flips mirrored lower pods' Ready at {} pods/s\n",
        args.qps,
        2 * args.qps,
        args.runtime_workers
            .map_or_else(|| "one per core".to_owned(), |w| w.to_string()),
        args.concurrency,
        args.flip_rate,
    );
    let mut report = Report { rows: Vec::new() };
    let n = args.pods;

    // 1. The ceiling: the same pods straight in the lower cluster.
    let spec = json!({"containers": [{"name": "app", "image": "nginx"}]});
    let pods: Vec<Pod> = (0..n)
        .map(|i| labelled(pod(&format!("p-{i:05}"), spec.clone())))
        .collect();
    let cpu = cpu_by_component(&pair, &vn, "tensile-bench");
    let (ns, baseline, _) = burst(&lower, "bench-baseline", pods, args.concurrency).await?;
    let profile = cpu_profile(&cpu, &cpu_by_component(&pair, &vn, "tensile-bench"));
    report.row("baseline (lower only)", "all Running", secs(baseline.total));
    report.row(
        "baseline (lower only)",
        "per pod p50 / p99",
        format!("{} / {}", ms(baseline.p50), ms(baseline.p99)),
    );
    report.row("baseline (lower only)", "CPU seconds by component", profile);
    let _ = delete_and_wait(&lower, &lower, &ns.name, n).await;
    ns.delete().await?;

    // 1b. The floor of a burst onto the virtual node: the same pods straight in the lower
    // cluster and, at the same time, in the upper cluster bound to a kwok node of its own
    // (the upper API server's work per pod, which a virtual node cannot avoid), nothing of
    // tensile involved. The node is deleted afterwards so the other scenarios run as without.
    let label = "both clusters (no virtual node)";
    add_upper_floor_node(&pair, &upper).await?;
    let cpu = cpu_by_component(&pair, &vn, "tensile-bench");
    let (upper_ns, lower_ns, floor) =
        both_clusters(&upper, &lower, UPPER_FLOOR_NODE, n, args.concurrency).await?;
    let profile = cpu_profile(&cpu, &cpu_by_component(&pair, &vn, "tensile-bench"));
    report.row(
        label,
        &format!("all {} Running (n in each)", 2 * n),
        secs(floor.total),
    );
    report.row(
        label,
        "per pod p50 / p99",
        format!("{} / {}", ms(floor.p50), ms(floor.p99)),
    );
    report.row(
        label,
        "ratio to baseline",
        format!(
            "{:.2}",
            floor.total.as_secs_f64() / baseline.total.as_secs_f64().max(1e-9)
        ),
    );
    report.row(label, "CPU seconds by component", profile);
    tokio::try_join!(
        delete_and_wait(&upper, &upper, &upper_ns.name, n),
        delete_and_wait(&lower, &lower, &lower_ns.name, n),
    )
    .context("deleting the both-clusters floor's pods")?;
    upper_ns.delete().await?;
    lower_ns.delete().await?;
    delete_upper_floor_node(&upper).await?;

    // 2. Burst onto the virtual node, bound directly; status reflection measured on it.
    let pods: Vec<Pod> = (0..n)
        .map(|i| labelled(bound_pod(&format!("p-{i:05}"), NODE)))
        .collect();
    // The lower namespace appears only once the first pod is mirrored: watch them all.
    let lower_timeline = Shared::default();
    let lower_tracker = track_running(
        Api::all(lower.clone()),
        &format!("bench=1,tensile.dev/virtual-node={NODE}"),
        lower_timeline.clone(),
    );
    let cpu = cpu_by_component(&pair, &vn, "tensile-bench");
    let writes_before = scrape(vn.metrics_port).await?;
    let (ns, direct, upper_timeline) =
        burst(&upper, "bench-direct", pods, args.concurrency).await?;
    let writes_after = scrape(vn.metrics_port).await?;
    let profile = cpu_profile(&cpu, &cpu_by_component(&pair, &vn, "tensile-bench"));
    let ratio = direct.total.as_secs_f64() / baseline.total.as_secs_f64().max(1e-9);
    report.row(
        "burst (nodeName)",
        "all Running in upper",
        secs(direct.total),
    );
    report.row(
        "burst (nodeName)",
        "per pod p50 / p90 / p99 / max",
        format!(
            "{} / {} / {} / {}",
            ms(direct.p50),
            ms(direct.p90),
            ms(direct.p99),
            ms(direct.max)
        ),
    );
    report.row(
        "burst (nodeName)",
        "ratio to baseline (target <= 1.2)",
        format!("{ratio:.2}"),
    );
    report.row(
        "burst (nodeName)",
        "ratio to both-clusters floor",
        format!(
            "{:.2}",
            direct.total.as_secs_f64() / floor.total.as_secs_f64().max(1e-9)
        ),
    );
    report.row("burst (nodeName)", "CPU seconds by component", profile);
    wait_for("lower Running times", Duration::from_secs(30), || async {
        Ok((lock(&lower_timeline).running.len() >= n).then_some(()))
    })
    .await?;
    lower_tracker.abort();
    let mut delays: Vec<Duration> = {
        let (up, low) = (lock(&upper_timeline), lock(&lower_timeline));
        up.running
            .iter()
            .filter_map(|(name, at)| Some(at.saturating_duration_since(*low.running.get(name)?)))
            .collect()
    };
    delays.sort();
    report.row(
        "status reflection (during burst)",
        "lower Running -> upper Running p50 / p99 (target p99 < 200 ms)",
        format!(
            "{} / {}",
            ms(percentile(&delays, 50.0)),
            ms(percentile(&delays, 99.0))
        ),
    );
    report.row(
        "status reflection (during burst)",
        "upper API answering virtual-node's status writes p50 / p99",
        status_write_quantiles(&writes_before, &writes_after),
    );

    // 2b. Status reflection for the pods now mirrored and Running: the bench flips each
    // lower pod's Ready condition, paced, and times its own lower watch -> upper watch.
    let names: Vec<String> = (0..n).map(|i| format!("p-{i:05}")).collect();
    for (ready, measure) in [
        (
            false,
            "lower Ready=False -> upper p50 / p99 / max (target p99 < 200 ms)",
        ),
        (true, "lower Ready=True -> upper p50 / p99 / max"),
    ] {
        let delays =
            ready_reflection(&upper, &lower, &ns.name, &names, ready, args.flip_rate).await?;
        report.row(
            "status reflection (mirrored pods)",
            measure,
            p50_p99_max(&delays),
        );
    }
    let deletion = delete_and_wait(&upper, &lower, &ns.name, n).await?;
    report.row(
        "deletion",
        &format!("{n} upper pods gone from both clusters"),
        secs(deletion),
    );
    ns.delete().await?;

    // 3. Burst through the real scheduler.
    let pods: Vec<Pod> = (0..n)
        .map(|i| labelled(pod(&format!("p-{i:05}"), pinned_spec(NODE))))
        .collect();
    let cpu = cpu_by_component(&pair, &vn, "tensile-bench");
    let (ns, scheduled, _) = burst(&upper, "bench-scheduled", pods, args.concurrency).await?;
    let profile = cpu_profile(&cpu, &cpu_by_component(&pair, &vn, "tensile-bench"));
    let ratio = scheduled.total.as_secs_f64() / baseline.total.as_secs_f64().max(1e-9);
    report.row(
        "burst (scheduler)",
        "all Running in upper",
        secs(scheduled.total),
    );
    report.row(
        "burst (scheduler)",
        "per pod p50 / p99",
        format!("{} / {}", ms(scheduled.p50), ms(scheduled.p99)),
    );
    report.row(
        "burst (scheduler)",
        "ratio to baseline (target <= 1.2)",
        format!("{ratio:.2}"),
    );
    report.row(
        "burst (scheduler)",
        "ratio to both-clusters floor",
        format!(
            "{:.2}",
            scheduled.total.as_secs_f64() / floor.total.as_secs_f64().max(1e-9)
        ),
    );
    report.row("burst (scheduler)", "CPU seconds by component", profile);
    let _ = delete_and_wait(&upper, &lower, &ns.name, n).await?;
    ns.delete().await?;

    // 4. Footprint at each size, and a restart at the largest.
    let mut sizes = args.footprint.clone();
    sizes.retain(|s| *s > 0);
    sizes.sort_unstable();
    if !sizes.is_empty() {
        let ns = TestNamespace::create(&upper, "bench-footprint").await?;
        let api: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
        let timeline = Shared::default();
        let tracker = track_running(api.clone(), "bench=1", timeline.clone());
        let base = scrape(vn.metrics_port).await?;
        let (_, _, cpu_before) = footprint(vn.pid())?;
        let mut made = 0;
        // (mirrored pods, resident bytes, anonymous resident bytes) at each size.
        let mut samples: Vec<(f64, f64, f64)> = Vec::new();
        // (mirrored pods, jemalloc's statistics) at each size.
        let mut allocator: Vec<(f64, Vec<f64>)> = Vec::new();
        for size in &sizes {
            let pods: Vec<Pod> = (made..*size)
                .map(|i| labelled(bound_pod(&format!("f-{i:05}"), NODE)))
                .collect();
            create_all(&api, pods, args.concurrency, &timeline).await?;
            made = *size;
            wait_all_running(&timeline, made, &format!("{made} mirrored pods Running")).await?;
            let settled = settle_resident(vn.pid()).await?;
            let (rss, peak, cpu) = footprint(vn.pid())?;
            let (anonymous, file_backed) = resident_split(vn.pid())?;
            samples.push((made as f64, rss as f64, anonymous as f64));
            let metrics = scrape(vn.metrics_port).await?;
            let label = format!("footprint at {size} pods");
            report.row(
                &label,
                "resident / peak memory (target < 64 MiB at 10000)",
                format!(
                    "{:.1} MiB / {:.1} MiB (settled after {:.0} s)",
                    rss as f64 / 1048576.0,
                    peak as f64 / 1048576.0,
                    settled.as_secs_f64()
                ),
            );
            report.row(
                &label,
                "resident: anonymous (heap, stacks) / file-backed (code)",
                format!(
                    "{:.1} MiB / {:.1} MiB",
                    anonymous as f64 / 1048576.0,
                    file_backed as f64 / 1048576.0
                ),
            );
            report.row(
                &label,
                "heap by owner (tensile_memory_bytes) / rest of anonymous",
                heap_by_owner(&metrics, anonymous as f64)?,
            );
            report.row(
                &label,
                "bytes per mirrored pod: the two pod stores / resident over the first size",
                per_pod(&metrics, &samples),
            );
            allocator.push((made as f64, allocator_stats(&metrics)));
            report.allocator_and_cpu(&label, &allocator, cpu - cpu_before);
            report.row(
                &label,
                "API requests per mirrored pod",
                requests_by_verb(&metrics, &base, made),
            );
        }
        tracker.abort();
        let resident: Vec<(f64, f64)> = samples.iter().map(|s| (s.0, s.1)).collect();
        let anonymous: Vec<(f64, f64)> = samples.iter().map(|s| (s.0, s.2)).collect();
        if let (Some(resident), Some(anonymous)) = (slope(&resident), slope(&anonymous)) {
            report.row(
                &format!("footprint, fit over {sizes:?} pods"),
                "resident per further mirrored pod (target <= 3 KB) / of it anonymous",
                format!("{:.2} KB / {:.2} KB", resident / 1000.0, anonymous / 1000.0),
            );
        }

        // Restart: caught up = every mirrored pod reconciled once; writes should be zero.
        // First let what the last pods set off finish (kwok's stages below, the
        // controllers' work), so that the restart's figures are its own.
        let label = format!("restart with {made} pods");
        report.row(
            &label,
            "cluster pair quiet before it (< 0.2 core over 5 s, 120 s at most)",
            quiet(&pair, &vn).await,
        );
        vn.stop()?;
        // The stopped process is left out of this sample: the restarted one counts whole.
        let cpu = cpu_by_component(&pair, &vn, "tensile-bench");
        let restart = Instant::now();
        vn = start_node(&pair, &binary, &args, NODE).await?;
        let caught_up = wait_for("restart caught up", WAIT, || async {
            let m = scrape(vn.metrics_port).await?;
            let reconciled = m
                .get("tensile_pod_reconciles_total")
                .copied()
                .unwrap_or(0.0);
            Ok((reconciled >= made as f64).then_some(restart.elapsed()))
        })
        .await?;
        let profile = cpu_profile(&cpu, &cpu_by_component(&pair, &vn, "tensile-bench"));
        tokio::time::sleep(Duration::from_secs(6)).await; // one orphan-collection round
        let m = scrape(vn.metrics_port).await?;
        report.row(
            &label,
            "caught up (target < 10 s at 10000, < 30 s at 100000)",
            secs(caught_up),
        );
        report.row(
            &label,
            "CPU seconds by component, start to caught up",
            profile,
        );
        report.row(
            &label,
            "pod writes for pods already in sync (target 0)",
            format!("{:.0}", pod_writes(&m)),
        );
        report.row(
            &label,
            "all requests of the restarted process",
            requests_by_verb(&m, &BTreeMap::new(), 1),
        );
        if !args.skip_deletion {
            let deletion = delete_and_wait(&upper, &lower, &ns.name, made).await?;
            report.row(&label, "then deleted from both clusters", secs(deletion));
            ns.delete().await?;
        }
    }
    vn.stop()?;
    println!("\n{} figures.", report.rows.len());
    Ok(())
}

/// Waits, 120 s at most, until the cluster pair's components (virtual-node and the bench
/// apart) use under a fifth of a core over 5 s; answers how long that took, and what they
/// used in the last 5 s.
async fn quiet(pair: &ClusterPair, vn: &VirtualNode) -> String {
    const WINDOW: Duration = Duration::from_secs(5);
    const AT_MOST: Duration = Duration::from_secs(120);
    let started = Instant::now();
    loop {
        let before = cpu_by_component(pair, vn, "tensile-bench");
        tokio::time::sleep(WINDOW).await;
        let mut after = cpu_by_component(pair, vn, "tensile-bench");
        after.retain(|name, _| name != "virtual-node" && name != "tensile-bench");
        let busy: f64 = after
            .iter()
            .map(|(name, s)| s - before.get(name).copied().unwrap_or(*s))
            .sum();
        let waited = started.elapsed();
        if busy < 0.2 * WINDOW.as_secs_f64() {
            return format!("after {} ({})", secs(waited), cpu_profile(&before, &after));
        }
        if waited >= AT_MOST {
            return format!(
                "not after {} ({})",
                secs(waited),
                cpu_profile(&before, &after)
            );
        }
    }
}

/// The machine and builds a run's figures come from: cores, the Kubernetes release,
/// tensile's version and the build profile (for each scenario's first line).
fn machine(pair: &ClusterPair) -> String {
    format!(
        "{} cores, Kubernetes {}, virtual-node {} ({})",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        pair.binaries.kubernetes_version(),
        env!("CARGO_PKG_VERSION"),
        if cfg!(debug_assertions) {
            "debug build"
        } else {
            "release build"
        },
    )
}
