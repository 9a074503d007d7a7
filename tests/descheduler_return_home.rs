//! tensile-descheduler `--return-home`, end to end (issue 51): two regular upper nodes of
//! 4 CPU held by a filler, the upper kube-scheduler with the shipped extender (local
//! first), one virtual node. A Deployment bursts; the filler scales in; every burst pod
//! comes home within the window plus a few rounds, one eviction per pod, Ready never
//! under `replicas − maxUnavailable`, and nothing moves after. Then room that appears is
//! taken by another pod before the replacement is scheduled: the replacement bursts
//! again, is counted, and nothing ping-pongs. And issue 51's HPA scene: an HPA bursts a
//! Deployment that a PodDisruptionBudget covers over two virtual nodes, another workload
//! scales in, every burst pod comes home as the budget allows.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::descheduler::{Child, INTERVAL_SECS, shipped_rbac_kubeconfig, start_descheduler};
use common::{TIMEOUT, start_node};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use nix::sys::signal::Signal;
use serde_json::json;
use tensile_harness::fixtures::{deployment, virtual_node_toleration};
use tensile_harness::metrics_server::fast_hpa_controller_args;
use tensile_harness::ports::free_port;
use tensile_harness::scheduler_extender::{shipped_scheduler_config, start_extender};
use tensile_harness::{
    ClusterPair, Component, NodeShape, PairOptions, TestNamespace, invariant, wait_for,
};

const VK: &str = "vk-home";
const APP: &str = "web";
const FILLER: &str = "filler";
/// `--return-home-after`.
const WINDOW_SECS: u64 = 5;
/// The window plus a few rounds, with room for a busy machine.
const HOME_WITHIN: Duration = Duration::from_secs(60);

fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
}

/// Whether the pod is bound to one of this file's virtual nodes (all named `vk-…`).
fn on_virtual_node(pod: &Pod) -> bool {
    node_of(pod).is_some_and(|n| n.starts_with("vk-"))
}

fn ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod.status.as_ref().is_some_and(|s| {
            s.phase.as_deref() == Some("Running")
                && s.conditions
                    .iter()
                    .flatten()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
        })
}

/// The value of one series in the descheduler's OpenMetrics text (0 when absent).
async fn metric(descheduler: &Child, series: &str) -> u64 {
    let (_, text) = descheduler.get("/metrics").await;
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

const MOVES: &str = "tensile_descheduler_return_home_moves_total";
const REBURSTS: &str = "tensile_descheduler_return_home_rebursts_total";
const NO_ROOM: &str = "tensile_descheduler_return_home_skipped_total{reason=\"no_room\"}";

/// `n` pods of `app`, every one Running and Ready and none terminating, `on_virtual` of
/// them on virtual nodes and the rest on regular nodes.
async fn placed(pods: &Api<Pod>, app: &str, n: usize, on_virtual: usize, why: &str) {
    let last = std::sync::Mutex::new(String::new());
    let result = wait_for(why, HOME_WITHIN, || async {
        let list = pods
            .list(&ListParams::default().labels(&format!("app={app}")))
            .await?
            .items;
        let virtual_ = list.iter().filter(|p| on_virtual_node(p)).count();
        let all_ready = list.iter().filter(|p| ready(p)).count();
        *last.lock().unwrap() = format!(
            "{} pods, {all_ready} Ready, {virtual_} on virtual nodes",
            list.len()
        );
        Ok((list.len() == n && all_ready == n && virtual_ == on_virtual).then_some(()))
    })
    .await;
    if let Err(error) = result {
        panic!("{error:#}; last: {}", last.lock().unwrap());
    }
}

/// A pod spec requesting one CPU, tolerating the virtual nodes if it may `burst`.
fn one_cpu(burst: bool) -> serde_json::Value {
    let mut spec = json!({"containers": [{"name": "app", "image": "nginx",
        "resources": {"requests": {"cpu": "1", "memory": "64Mi"}}}]});
    if burst {
        spec["tolerations"] = json!([virtual_node_toleration()]);
    }
    spec
}

async fn scale(deployments: &Api<Deployment>, name: &str, replicas: i32) {
    deployments
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": replicas}})),
        )
        .await
        .unwrap();
}

/// The fewest of an app's pods Ready at once (polled every 100 ms), until stopped.
struct ReadyFloor {
    lowest: Arc<AtomicUsize>,
    watching: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl ReadyFloor {
    fn watch(pods: &Api<Pod>, app: &str) -> Self {
        let lowest = Arc::new(AtomicUsize::new(usize::MAX));
        let watching = Arc::new(AtomicBool::new(true));
        let task = {
            let (pods, lowest, watching) = (pods.clone(), lowest.clone(), watching.clone());
            let selector = format!("app={app}");
            tokio::spawn(async move {
                while watching.load(Ordering::Relaxed) {
                    if let Ok(list) = pods.list(&ListParams::default().labels(&selector)).await {
                        let n = list.items.iter().filter(|p| ready(p)).count();
                        lowest.fetch_min(n, Ordering::Relaxed);
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };
        Self {
            lowest,
            watching,
            task,
        }
    }

    /// Stops watching; the fewest seen Ready.
    async fn stop(self) -> usize {
        self.watching.store(false, Ordering::Relaxed);
        self.task.await.unwrap();
        self.lowest.load(Ordering::Relaxed)
    }
}

/// Polls for `period` that `check` holds throughout (a steady state, not a sleep).
/// Starts the descheduler with `--return-home` (the test's window) and `extra` flags, and
/// waits until it has judged burst pods `no_room` times without room, moving none.
async fn start_without_room(
    pair: &ClusterPair,
    kubeconfig: &std::path::Path,
    name: &str,
    extra: &[&str],
    no_room: u64,
) -> Child {
    let window = format!("--return-home-after={WINDOW_SECS}s");
    let mut args = vec!["--leader-elect=false", "--return-home", &window];
    args.extend_from_slice(extra);
    let descheduler = start_descheduler(pair, kubeconfig, name, &args);
    // It binds its metrics address before it logs that it starts.
    wait_for("the descheduler started", TIMEOUT, || async {
        Ok(descheduler.log_text().contains("starting").then_some(()))
    })
    .await
    .unwrap();
    wait_for("rounds without room", TIMEOUT, || async {
        Ok((metric(&descheduler, NO_ROOM).await >= no_room).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(metric(&descheduler, MOVES).await, 0);
    descheduler
}

async fn steady<F, Fut>(period: Duration, why: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let end = Instant::now() + period;
    while Instant::now() < end {
        if let Err(broken) = check().await {
            panic!("{why}: {broken}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test]
async fn burst_pods_come_home_without_thrash() {
    let port = free_port().unwrap();
    let mut options = PairOptions::default();
    options.upper.nodes = 2;
    options.upper.node_shape = NodeShape {
        cpu: "4".into(),
        ..NodeShape::default()
    };
    options
        .upper
        .scheduler_config
        .extend(shipped_scheduler_config(&format!("http://127.0.0.1:{port}")).unwrap());
    let pair = ClusterPair::start(options).await.unwrap();
    let _extender = start_extender(
        &pair,
        &common::workspace_binary("tensile-scheduler-extender"),
        "home-extender",
        port,
        &[(VK.to_owned(), pair.lower_kubeconfig())],
    )
    .await
    .unwrap();
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let _vk = start_node(&pair, VK, &[]).await;
    let ns = TestNamespace::create(&upper, "home").await.unwrap();
    let deployments: Api<Deployment> = Api::namespaced(upper.clone(), &ns.name);
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);

    // The filler holds every regular CPU; the app bursts whole.
    deployments
        .create(
            &PostParams::default(),
            &deployment(FILLER, 8, one_cpu(false)),
        )
        .await
        .unwrap();
    placed(&pods, FILLER, 8, 0, "the filler on the regular nodes").await;
    deployments
        .create(&PostParams::default(), &deployment(APP, 4, one_cpu(true)))
        .await
        .unwrap();
    placed(&pods, APP, 4, 4, "the app burst to the virtual node").await;

    let kubeconfig = shipped_rbac_kubeconfig(&pair).await;
    // No room: rounds go by (every burst pod judged twice), nothing moves.
    let descheduler = start_without_room(&pair, &kubeconfig, "home", &[], 8).await;

    // Ready is watched throughout: never under replicas − maxUnavailable (4 − 1).
    let floor = ReadyFloor::watch(&pods, APP);

    // Room returns: every burst pod comes home, one eviction each.
    let started = Instant::now();
    scale(&deployments, FILLER, 4).await;
    placed(&pods, APP, 4, 0, "every burst pod home").await;
    let took = started.elapsed();
    println!("room returned -> last burst pod home: {took:?}");
    assert!(
        took >= Duration::from_secs(WINDOW_SECS),
        "moved before the window: {took:?}"
    );
    let lowest = floor.stop().await;
    assert!(lowest >= 3, "Ready dropped to {lowest}");
    assert_eq!(metric(&descheduler, MOVES).await, 4, "one eviction per pod");
    // Steady: nothing moves any more.
    steady(
        Duration::from_secs(3 * INTERVAL_SECS),
        "steady after coming home",
        || async {
            let moves = metric(&descheduler, MOVES).await;
            (moves == 4).then_some(()).ok_or(format!("{moves} moves"))
        },
    )
    .await;

    // Room appears and is taken before the replacement is scheduled: with the
    // controller-manager paused, the replacement is made only once another pod holds it.
    scale(&deployments, APP, 6).await;
    placed(&pods, APP, 6, 2, "two more burst").await;
    scale(&deployments, FILLER, 3).await;
    placed(&pods, FILLER, 3, 0, "the filler scaled in").await;
    pair.upper
        .signal(Component::ControllerManager, Signal::SIGSTOP)
        .unwrap();
    let resumed = wait_for("one move once the room held", HOME_WITHIN, || async {
        Ok((metric(&descheduler, MOVES).await == 5).then_some(()))
    })
    .await;
    let taker: Pod = serde_json::from_value(json!({
        "metadata": {"name": "taker", "labels": {"app": "taker"}},
        "spec": {"containers": [{"name": "app", "image": "nginx",
            "resources": {"requests": {"cpu": "1", "memory": "64Mi"}}}]},
    }))
    .unwrap();
    let created = match resumed {
        Ok(()) => Some(pods.create(&PostParams::default(), &taker).await),
        Err(_) => None,
    };
    let taken = wait_for("the taker on a regular node", TIMEOUT, || async {
        Ok(pods.get("taker").await?).map(|p| ready(&p).then_some(()))
    });
    let taken = match created {
        Some(Ok(_)) => taken.await.map_err(|e| e.to_string()),
        Some(Err(e)) => Err(e.to_string()),
        None => Err("no move".to_owned()),
    };
    pair.upper
        .signal(Component::ControllerManager, Signal::SIGCONT)
        .unwrap();
    taken.unwrap();
    placed(&pods, APP, 6, 2, "the replacement burst again").await;
    wait_for("the re-burst counted", TIMEOUT, || async {
        Ok((metric(&descheduler, REBURSTS).await == 1).then_some(()))
    })
    .await
    .unwrap();
    // Nothing ping-pongs: no room, and the owner backs off.
    steady(
        Duration::from_secs(4 * INTERVAL_SECS),
        "no ping-pong",
        || async {
            let moves = metric(&descheduler, MOVES).await;
            let list = pods
                .list(&ListParams::default().labels(&format!("app={APP}")))
                .await
                .map_err(|e| e.to_string())?
                .items;
            let terminating = list
                .iter()
                .filter(|p| p.metadata.deletion_timestamp.is_some())
                .count();
            (moves == 5 && terminating == 0)
                .then_some(())
                .ok_or(format!("{moves} moves, {terminating} terminating"))
        },
    )
    .await;

    let (report, _) = invariant::converge(&upper, &lower, VK, Some(&ns.name), TIMEOUT)
        .await
        .unwrap();
    assert!(report.holds(), "{report}");
    let log = descheduler.log_text();
    assert!(
        !log.contains("cannot list PodDisruptionBudgets"),
        "the shipped RBAC lists PodDisruptionBudgets"
    );
    ns.delete().await.unwrap();
}

const VK_1: &str = "vk-hpa-1";
const VK_2: &str = "vk-hpa-2";
/// The other workload of the regular nodes in the HPA scene.
const BATCH: &str = "batch";
const REFUSALS: &str = "tensile_descheduler_return_home_refusals_total";

/// Issue 51's HPA scene, the shape of tests/burst_hpa.rs in about a minute: two regular
/// upper nodes of 4 CPU, the kube-scheduler with the extender as shipped, vk-hpa-1 (burst
/// priority 1) and vk-hpa-2 (priority 2) of 3 CPU each over one lower cluster. A batch
/// workload holds 6 of the 8 regular CPUs; the HPA scales the app 2 → 8: 2 at home, 3 on
/// each member; a PodDisruptionBudget (maxUnavailable 2) covers the app. The batch scales
/// in; with `--return-home` (window 5 s, up to 3 moves per owner a round: more than the
/// budget allows) the budget stops the moves at 2 while the replacements are slow to come
/// (its path end to end: the Eviction API's refusal, counted and retried), then every
/// burst pod comes home, one eviction each, Ready never under 8 − 2; nothing lost or
/// duplicated on either member; then 20 s with no eviction and the HPA still at 8.
///
/// The HPA makes the decision (the test never writes the app's `spec.replicas`), through
/// its `minReplicas`: the HPA raises a target under its minimum without reading metrics,
/// so the scene runs without the metrics-servers, whose pipeline takes up to minutes per
/// decision on this machine (tests/burst_hpa.rs allows 240 s).
#[tokio::test]
async fn an_hpa_burst_comes_home_as_its_budget_allows() {
    let port = free_port().unwrap();
    let mut options = PairOptions::default();
    options.upper.nodes = 2;
    options.upper.node_shape = NodeShape {
        cpu: "4".into(),
        ..NodeShape::default()
    };
    options
        .upper
        .scheduler_config
        .extend(shipped_scheduler_config(&format!("http://127.0.0.1:{port}")).unwrap());
    options.upper.controller_manager_args = fast_hpa_controller_args();
    let pair = ClusterPair::start(options).await.unwrap();
    let _extender = start_extender(
        &pair,
        &common::workspace_binary("tensile-scheduler-extender"),
        "hpa-home-extender",
        port,
        &[
            (VK_1.to_owned(), pair.lower_kubeconfig()),
            (VK_2.to_owned(), pair.lower_kubeconfig()),
        ],
    )
    .await
    .unwrap();
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let mut vks = Vec::new();
    for (node, priority) in [(VK_1, "1"), (VK_2, "2")] {
        let args = ["--burst-priority", priority, "--share", "cpu=3"];
        vks.push(start_node(&pair, node, &args).await);
    }
    let ns = TestNamespace::create(&upper, "hpa-home").await.unwrap();
    let deployments: Api<Deployment> = Api::namespaced(upper.clone(), &ns.name);
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let post = PostParams::default();

    deployments
        .create(&post, &deployment(BATCH, 6, one_cpu(false)))
        .await
        .unwrap();
    placed(&pods, BATCH, 6, 0, "the batch on the regular nodes").await;
    deployments
        .create(&post, &deployment(APP, 2, one_cpu(true)))
        .await
        .unwrap();
    placed(&pods, APP, 2, 0, "the app at home").await;
    let budget: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": APP},
        "spec": {"maxUnavailable": 2, "selector": {"matchLabels": {"app": APP}}},
    }))
    .unwrap();
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(upper.clone(), &ns.name);
    budgets.create(&post, &budget).await.unwrap();
    let hpa: HorizontalPodAutoscaler = serde_json::from_value(json!({
        "metadata": {"name": APP},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": APP},
            "minReplicas": 2, "maxReplicas": 8,
            "metrics": [{"type": "Resource", "resource": {"name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": 50}}}],
        },
    }))
    .unwrap();
    let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(upper.clone(), &ns.name);
    hpas.create(&post, &hpa).await.unwrap();

    // Load rises: the HPA scales out to 8; the regular nodes are full, both members take 3.
    hpas.patch(
        APP,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"minReplicas": 8}})),
    )
    .await
    .unwrap();
    placed(&pods, APP, 8, 6, "the HPA's scale-out burst").await;
    let list = pods
        .list(&ListParams::default().labels(&format!("app={APP}")))
        .await
        .unwrap()
        .items;
    for vk in [VK_1, VK_2] {
        let on = list.iter().filter(|p| node_of(p) == Some(vk)).count();
        assert_eq!(on, 3, "pods on {vk}");
    }
    // The budget allows 2 before the first move, so that it refuses the third.
    wait_for("the budget allows 2 disruptions", TIMEOUT, || async {
        let b = budgets.get(APP).await?;
        let generation = b.metadata.generation;
        Ok(b.status
            .filter(|s| {
                s.observed_generation == generation
                    && s.current_healthy == Some(8)
                    && s.disruptions_allowed == Some(2)
            })
            .map(|_| ()))
    })
    .await
    .unwrap();

    let kubeconfig = shipped_rbac_kubeconfig(&pair).await;
    let descheduler = start_without_room(
        &pair,
        &kubeconfig,
        "hpa-home",
        &["--return-home-max-per-owner=3"],
        6,
    )
    .await;

    // The batch scales in. The replacements are slow to come, as after an image pull (the
    // controller-manager paused: no replacement, and the budget's status is what the
    // evictions left of it): the budget, not the per-owner limit of 3, stops the moves at 2.
    let floor = ReadyFloor::watch(&pods, APP);
    let started = Instant::now();
    scale(&deployments, BATCH, 0).await;
    placed(&pods, BATCH, 0, 0, "the batch gone").await;
    pair.upper
        .signal(Component::ControllerManager, Signal::SIGSTOP)
        .unwrap();
    let refused = wait_for("the budget to refuse a move", HOME_WITHIN, || async {
        let moves = metric(&descheduler, MOVES).await;
        Ok((metric(&descheduler, REFUSALS).await >= 1).then_some(moves))
    })
    .await;
    pair.upper
        .signal(Component::ControllerManager, Signal::SIGCONT)
        .unwrap();
    assert_eq!(refused.unwrap(), 2, "moves before the budget refused");
    // The replacements come: every burst pod comes home, as the budget allows.
    placed(&pods, APP, 8, 0, "every burst pod home").await;
    println!(
        "room returned -> last burst pod home: {:?}",
        started.elapsed()
    );
    let lowest = floor.stop().await;
    assert!(lowest >= 6, "Ready dropped to {lowest} (budget: 8 - 2)");
    assert_eq!(metric(&descheduler, MOVES).await, 6, "one eviction per pod");
    assert_eq!(metric(&descheduler, REBURSTS).await, 0);
    let refusals = metric(&descheduler, REFUSALS).await;

    // Steady: the same 8 pods at home, no eviction, the HPA still at 8.
    let uids = |list: &[Pod]| -> std::collections::BTreeSet<String> {
        list.iter().filter_map(|p| p.metadata.uid.clone()).collect()
    };
    let selector = ListParams::default().labels(&format!("app={APP}"));
    let home = uids(&pods.list(&selector).await.unwrap().items);
    steady(Duration::from_secs(20), "steady at home", || async {
        let moves = metric(&descheduler, MOVES).await;
        let list = pods.list(&selector).await.map_err(|e| e.to_string())?.items;
        let replicas = deployments
            .get(APP)
            .await
            .map_err(|e| e.to_string())?
            .spec
            .and_then(|s| s.replicas);
        let same = uids(&list) == home && !list.iter().any(on_virtual_node);
        (moves == 6 && same && replicas == Some(8))
            .then_some(())
            .ok_or(format!(
                "{moves} moves, replicas {replicas:?}, the same pods at home: {same}"
            ))
    })
    .await;

    for vk in [VK_1, VK_2] {
        let (report, _) = invariant::converge(&upper, &lower, vk, Some(&ns.name), TIMEOUT)
            .await
            .unwrap();
        assert!(report.holds(), "{vk}: {report}");
    }
    for vk in &mut vks {
        vk.check_running().unwrap();
    }
    println!("budget refusals: {refusals}");
    ns.delete().await.unwrap();
}
