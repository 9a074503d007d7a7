//! `tensile-bench --burst-hpa --pods 100`: issue #35's loop timed. An HPA on CPU over a
//! Deployment of 1-CPU pods that may burst; two regular upper nodes of 4 CPU hold 8; two
//! virtual nodes (burst priorities 1 and 2, each sharing half of `--pods` CPUs) over one
//! lower cluster take the rest. The upper kube-scheduler runs the extender as shipped;
//! metrics-servers upstairs and below, kwok's simulated usage, a fast HPA controller.
//!
//! Out: the usage rises far enough that the HPA's first decision is its maximum (8 +
//! `--pods`); timed from that decision (the Deployment's `spec.replicas` changing, seen by
//! a watch) to the last burst pod Running upstairs. In: the usage falls to nearly nothing,
//! the HPA goes back to its minimum (8); timed from that decision to the last lower pod
//! gone. The HPA's `behavior` lets either step go in one decision. Figures, not
//! assertions; the time from the usage change to the decision (the metrics pipeline: two
//! metrics-servers of 10 s resolution and the virtual node) is printed apart.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;
use tensile_harness::fixtures::{deployment, virtual_node_toleration};
use tensile_harness::metrics_server::set_node_usage;
use tensile_harness::ports::free_port;
use tensile_harness::scheduler_extender::{hpa_bursting, start_extender};
use tensile_harness::{ClusterPair, TestNamespace, VirtualNodeOptions, node_is_ready, wait_for};

use super::{Args, WAIT, lock, lower_for, secs};

const VK_1: &str = "vk-hpa-1";
const VK_2: &str = "vk-hpa-2";
const APP: &str = "web";
/// Pods the two regular upper nodes hold (4 CPU each, 1-CPU pods).
const LOCAL: usize = 8;
/// Per pod: 8 cores against a 1-CPU request and a 50 % target, so that the HPA's first
/// decision from 8 replicas (8 × 800 % / 50 % = 128) is its maximum (up to 120 burst pods;
/// beyond, a second decision follows).
const HIGH: &str = "8";
/// 0.1 %: the HPA's first decision is its minimum.
const LOW: &str = "1m";

/// Each change of the Deployment's `spec.replicas`, seen by a watch.
type Decisions = Arc<Mutex<Vec<(Instant, i32)>>>;

fn watch_decisions(api: Api<Deployment>, decisions: Decisions) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let config = watcher::Config::default().fields(&format!("metadata.name={APP}"));
        let mut events = std::pin::pin!(
            watcher::watcher(api, config)
                .default_backoff()
                .applied_objects()
        );
        while let Some(event) = events.next().await {
            let Ok(d) = event else { continue };
            let Some(replicas) = d.spec.and_then(|s| s.replicas) else {
                continue;
            };
            let mut decisions = lock(&decisions);
            if decisions.last().is_none_or(|(_, r)| *r != replicas) {
                decisions.push((Instant::now(), replicas));
            }
        }
    })
}

/// When each upper pod on a virtual node was first seen Running, by name.
type Running = Arc<Mutex<std::collections::HashMap<String, Instant>>>;

fn watch_burst_running(api: Api<Pod>, running: Running) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let config = watcher::Config::default().labels(&format!("app={APP}"));
        let mut events = std::pin::pin!(
            watcher::watcher(api, config)
                .default_backoff()
                .applied_objects()
        );
        while let Some(event) = events.next().await {
            let Ok(pod) = event else { continue };
            let burst = pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_deref())
                .is_some_and(|n| n == VK_1 || n == VK_2);
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            if let (true, Some("Running"), Some(name)) = (burst, phase, pod.metadata.name) {
                lock(&running).entry(name).or_insert_with(Instant::now);
            }
        }
    })
}

/// The first decision after `since` that is `replicas`.
async fn decided(decisions: &Decisions, since: Instant, replicas: i32) -> Result<Instant> {
    wait_for(
        &format!("the HPA to scale the Deployment to {replicas}"),
        WAIT,
        || async {
            Ok(lock(decisions)
                .iter()
                .find(|(at, r)| *at >= since && *r == replicas)
                .map(|(at, _)| *at))
        },
    )
    .await
}

async fn start_node(
    pair: &ClusterPair,
    binary: &Path,
    node: &str,
    priority: &str,
    share: usize,
) -> Result<tensile_harness::VirtualNode> {
    let mut options = VirtualNodeOptions::new(binary, node);
    options.args = [
        "--burst-priority",
        priority,
        "--share",
        &format!("cpu={share}"),
        "--pod-sync-workers",
        "32",
        "--log-level",
        "warn",
    ]
    .map(String::from)
    .to_vec();
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

pub(crate) async fn run(binary: &Path, args: &Args) -> Result<()> {
    let extender = binary.with_file_name("tensile-scheduler-extender");
    if !extender.exists() {
        bail!(
            "{} not found: build the workspace's binaries first",
            extender.display()
        );
    }
    let burst = args.pods;
    let (share_1, share_2) = (burst / 2, burst - burst / 2);
    let port = free_port()?;
    let mut options = lower_for(burst);
    hpa_bursting(&mut options, port)?;
    eprintln!("starting the cluster pair (metrics-servers, the extender) ...");
    let pair = ClusterPair::start(options).await?;
    let _extender = start_extender(
        &pair,
        &extender,
        "bench-extender",
        port,
        &[
            (VK_1.to_owned(), pair.lower_kubeconfig()),
            (VK_2.to_owned(), pair.lower_kubeconfig()),
        ],
    )
    .await?;
    let (upper, lower) = (pair.upper.client().await?, pair.lower.client().await?);
    let _vk1 = start_node(&pair, binary, VK_1, "1", share_1).await?;
    let _vk2 = start_node(&pair, binary, VK_2, "2", share_2).await?;
    println!(
        "\ntensile-bench --burst-hpa: {}; \
         {LOCAL} local pods (2 regular nodes of 4 CPU), {burst} burst pods: {VK_1} \
         (priority 1, share cpu={share_1}), {VK_2} (priority 2, share cpu={share_2}); \
         HPA sync 5 s, metrics-servers at 10 s resolution\n",
        super::machine(&pair),
    );

    let ns = TestNamespace::create(&upper, "bench-hpa").await?;
    let set_usage = async |cpu: &str| -> Result<Instant> {
        set_node_usage(&upper, cpu).await?;
        set_node_usage(&lower, cpu).await?;
        Ok(Instant::now())
    };
    set_usage(LOW).await?;
    let spec = json!({
        "tolerations": [virtual_node_toleration()],
        "containers": [{"name": "app", "image": "nginx",
            "resources": {"requests": {"cpu": "1", "memory": "64Mi"}}}],
    });
    let deployments: Api<Deployment> = Api::namespaced(upper.clone(), &ns.name);
    deployments
        .create(&PostParams::default(), &deployment(APP, LOCAL as i32, spec))
        .await
        .context("creating the Deployment")?;
    let max = (LOCAL + burst) as i32;
    // Either way in one decision: no rate limit but the pod count.
    let hpa: HorizontalPodAutoscaler = serde_json::from_value(json!({
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": APP},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": APP},
            "minReplicas": LOCAL, "maxReplicas": max,
            "metrics": [{"type": "Resource", "resource": {"name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": 50}}}],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": 0,
                    "policies": [{"type": "Pods", "value": max, "periodSeconds": 15}]},
                "scaleDown": {"stabilizationWindowSeconds": 0,
                    "policies": [{"type": "Pods", "value": max, "periodSeconds": 15}]},
            },
        },
    }))?;
    let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(upper.clone(), &ns.name);
    hpas.create(&PostParams::default(), &hpa)
        .await
        .context("creating the HPA")?;
    let utilization = async || -> Result<Option<i32>> {
        Ok(hpas
            .get(APP)
            .await?
            .status
            .and_then(|s| s.current_metrics)
            .and_then(|m| m.into_iter().next())
            .and_then(|m| m.resource)
            .and_then(|r| r.current.average_utilization))
    };
    wait_for("the HPA to see the local pods' usage", WAIT, || async {
        Ok(utilization().await?.filter(|u| *u <= 5).map(|_| ()))
    })
    .await?;

    let decisions = Decisions::default();
    let decision_watch = watch_decisions(deployments.clone(), decisions.clone());
    let running = Running::default();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let running_watch = watch_burst_running(pods.clone(), running.clone());

    // Out.
    let load_up = set_usage(HIGH).await?;
    let decision = decided(&decisions, load_up, max).await?;
    wait_for(
        &format!("{burst} burst pods Running upstairs"),
        WAIT,
        || async { Ok((lock(&running).len() >= burst).then_some(())) },
    )
    .await?;
    let last_running = lock(&running).values().max().copied().unwrap_or(decision);
    let placed = pods
        .list(&ListParams::default().labels(&format!("app={APP}")))
        .await?
        .items;
    let on = |node: &str| {
        placed
            .iter()
            .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node))
            .count()
    };
    let (on_1, on_2) = (on(VK_1), on(VK_2));
    let out_steps: Vec<i32> = lock(&decisions)
        .iter()
        .filter(|(at, _)| *at >= load_up)
        .map(|(_, r)| *r)
        .collect();
    println!(
        "  scale-out {LOCAL} → {max} (HPA steps {out_steps:?}; {} local, {on_1} on {VK_1}, {on_2} on {VK_2})",
        placed.len() - on_1 - on_2
    );
    println!(
        "    usage raised → HPA decision                    {}",
        secs(decision.saturating_duration_since(load_up))
    );
    println!(
        "    HPA decision → last burst pod Running upstairs {}",
        secs(last_running.saturating_duration_since(decision))
    );

    // Wait for every pod's metrics upstairs, so the scale-in is one decision (the HPA
    // counts a pod without metrics at 100 % on the way in).
    let metrics_path = format!("/apis/metrics.k8s.io/v1beta1/namespaces/{}/pods", ns.name);
    wait_for("metrics upstairs for every pod", WAIT, || async {
        let request = http::Request::get(&metrics_path).body(Vec::new())?;
        let list: serde_json::Value = upper.request(request).await?;
        let n = list["items"].as_array().map_or(0, Vec::len);
        Ok((n >= LOCAL + burst).then_some(()))
    })
    .await?;
    let lower_pods: Api<Pod> = Api::all(lower.clone());
    let below = lower_pods
        .list(&ListParams::default().labels(&format!("app={APP}")))
        .await?
        .items
        .len();
    if below != on_1 + on_2 {
        bail!(
            "{below} lower pods labelled app={APP}, {} burst pods upstairs",
            on_1 + on_2
        );
    }

    // In.
    let load_down = set_usage(LOW).await?;
    let decision = decided(&decisions, load_down, LOCAL as i32).await?;
    let gone = wait_for("every lower pod gone", WAIT, || async {
        let left = lower_pods
            .list(&ListParams::default().labels(&format!("app={APP}")))
            .await?
            .items
            .len();
        Ok((left == 0).then(Instant::now))
    })
    .await?;
    let in_steps: Vec<i32> = lock(&decisions)
        .iter()
        .filter(|(at, _)| *at >= load_down)
        .map(|(_, r)| *r)
        .collect();
    let left: Vec<Pod> = pods
        .list(&ListParams::default().labels(&format!("app={APP}")))
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    let left_burst = left
        .iter()
        .filter(|p| {
            p.spec
                .as_ref()
                .and_then(|s| s.node_name.as_deref())
                .is_some_and(|n| n == VK_1 || n == VK_2)
        })
        .count();
    println!(
        "  scale-in {max} → {LOCAL} (HPA steps {in_steps:?}; {} upper pods left, {left_burst} of them on virtual nodes)",
        left.len()
    );
    println!(
        "    usage lowered → HPA decision                   {}",
        secs(decision.saturating_duration_since(load_down))
    );
    println!(
        "    HPA decision → last lower pod gone (±0.5 s)    {}",
        secs(gone.saturating_duration_since(decision))
    );
    decision_watch.abort();
    running_watch.abort();
    ns.delete().await?;
    Ok(())
}
