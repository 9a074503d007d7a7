//! `tensile-bench --return-home N` (issue 51): burst pods come home. Two regular upper
//! nodes, each held whole by one pod of a filler Deployment; one Deployment of N 1-CPU pods
//! that may burst, all of them on the virtual node (the kube-scheduler with the extender as
//! shipped: local first), a PodDisruptionBudget over it; tensile-descheduler with
//! `--return-home`. The filler scales in ("room returned"); timed from there to the last
//! burst pod home (every pod of the Deployment Running and Ready on a regular node, none
//! left on the virtual node), with the evictions per pod moved (the bench's own watch,
//! and the descheduler's count) and the CPU seconds by component; then a steady period
//! (`--return-home-steady`, 5 minutes) in which nothing should move. Figures, not
//! assertions: most of the time is the configuration's (the window, then the rounds).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;
use tensile_harness::fixtures::{deployment, virtual_node_toleration};
use tensile_harness::measure::{cpu_by_component, cpu_profile, footprint, scrape};
use tensile_harness::ports::free_port;
use tensile_harness::process::Process;
use tensile_harness::scheduler_extender::{shipped_scheduler_config, start_extender};
use tensile_harness::{ClusterPair, NodeShape, TestNamespace, VirtualNode, invariant, wait_for};

use super::{Args, NODE, Report, WAIT, lock, lower_for, secs, start_node};

const APP: &str = "web";
const FILLER: &str = "filler";
const MOVES: &str = "tensile_descheduler_return_home_moves_total";
const REFUSALS: &str = "tensile_descheduler_return_home_refusals_total";
const REBURSTS: &str = "tensile_descheduler_return_home_rebursts_total";
const NO_ROOM: &str = "tensile_descheduler_return_home_skipped_total{reason=\"no_room\"}";

/// One pod of the Deployment as the bench's watch last saw it.
struct Seen {
    node: Option<String>,
    ready: bool,
    deleting: bool,
}

/// What the bench's watch on the Deployment's pods has seen.
#[derive(Default)]
struct Sightings {
    pods: HashMap<String, Seen>,
    /// When the room returned: deletions and new pods from then on are the return's.
    since: Option<Instant>,
    /// Pods deleted since then (by UID), and where they were.
    deleted_on_virtual: HashSet<String>,
    deleted_at_home: HashSet<String>,
    first_deletion: Option<Instant>,
    /// Pods first seen since then, and those of them bound to the virtual node.
    new: HashSet<String>,
    burst_again: HashSet<String>,
    /// The fewest pods Ready (and not being deleted) at once since then.
    fewest_ready: Option<usize>,
    /// When every one of the `n` pods was first seen at home since then.
    home_at: Option<Instant>,
    n: usize,
}

impl Sightings {
    fn live(&self) -> impl Iterator<Item = &Seen> {
        self.pods.values().filter(|s| !s.deleting)
    }

    fn on_virtual(&self) -> usize {
        self.pods
            .values()
            .filter(|s| s.node.as_deref() == Some(NODE))
            .count()
    }

    fn ready(&self) -> usize {
        self.live().filter(|s| s.ready).count()
    }

    /// Every pod of the Deployment Running and Ready on a regular node, none left on the
    /// virtual node (not even one being deleted).
    fn all_home(&self) -> bool {
        self.live().count() == self.n
            && self
                .live()
                .all(|s| s.ready && s.node.as_deref().is_some_and(|n| n != NODE))
            && self.on_virtual() == 0
    }

    fn deleted(&mut self, uid: &str, at: Instant) {
        let Some(_) = self.since else { return };
        let on_virtual = self
            .pods
            .get(uid)
            .is_some_and(|s| s.node.as_deref() == Some(NODE));
        let first = !self.deleted_on_virtual.contains(uid) && !self.deleted_at_home.contains(uid);
        if first {
            self.first_deletion.get_or_insert(at);
            if on_virtual {
                self.deleted_on_virtual.insert(uid.to_owned());
            } else {
                self.deleted_at_home.insert(uid.to_owned());
            }
        }
    }

    fn apply(&mut self, pod: &Pod, at: Instant) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        let seen = Seen {
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            ready: ready(pod),
            deleting: pod.metadata.deletion_timestamp.is_some(),
        };
        if self.since.is_some() && !self.pods.contains_key(&uid) {
            self.new.insert(uid.clone());
        }
        if self.new.contains(&uid) && seen.node.as_deref() == Some(NODE) {
            self.burst_again.insert(uid.clone());
        }
        let deleting = seen.deleting;
        self.pods.insert(uid.clone(), seen);
        if deleting {
            self.deleted(&uid, at);
        }
        self.settle(at);
    }

    fn remove(&mut self, pod: &Pod, at: Instant) {
        let Some(uid) = pod.metadata.uid.as_deref() else {
            return;
        };
        self.deleted(uid, at);
        self.pods.remove(uid);
        self.settle(at);
    }

    fn settle(&mut self, at: Instant) {
        if self.since.is_none() {
            return;
        }
        let ready = self.ready();
        self.fewest_ready = Some(self.fewest_ready.map_or(ready, |f| f.min(ready)));
        if self.home_at.is_none() && self.all_home() {
            self.home_at = Some(at);
        }
    }
}

type Shared = Arc<Mutex<Sightings>>;

fn ready(pod: &Pod) -> bool {
    pod.status.as_ref().is_some_and(|s| {
        s.phase.as_deref() == Some("Running")
            && s.conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == "Ready" && c.status == "True")
    })
}

/// Follows the Deployment's pods in `api` into `sightings`.
fn watch_app(api: Api<Pod>, sightings: Shared) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let config = watcher::Config::default().labels(&format!("app={APP}"));
        let mut events = std::pin::pin!(watcher::watcher(api, config).default_backoff());
        while let Some(event) = events.next().await {
            let at = Instant::now();
            let mut seen = lock(&sightings);
            match event {
                Ok(watcher::Event::Apply(pod) | watcher::Event::InitApply(pod)) => {
                    seen.apply(&pod, at);
                }
                Ok(watcher::Event::Delete(pod)) => seen.remove(&pod, at),
                Ok(watcher::Event::Init | watcher::Event::InitDone) | Err(_) => {}
            }
        }
    })
}

/// The CPU seconds so far of the pair, virtual-node, the bench, the descheduler and the
/// extender, by name.
fn cpu(
    pair: &ClusterPair,
    vn: &VirtualNode,
    others: &[&Process],
) -> std::collections::BTreeMap<String, f64> {
    let mut by = cpu_by_component(pair, vn, "tensile-bench");
    for process in others {
        if let Ok((_, _, seconds)) = footprint(process.pid()) {
            by.insert(process.name().to_owned(), seconds);
        }
    }
    by
}

/// One series of a metrics scrape (0 when absent).
async fn metric(port: u16, series: &str) -> Result<f64> {
    Ok(scrape(port).await?.get(series).copied().unwrap_or(0.0))
}

async fn scale(deployments: &Api<Deployment>, name: &str, replicas: i32) -> Result<()> {
    deployments
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": replicas}})),
        )
        .await
        .with_context(|| format!("scaling Deployment {name} to {replicas}"))?;
    Ok(())
}

pub(crate) async fn run(binary: &Path, n: usize, args: &Args) -> Result<()> {
    let descheduler_bin = binary.with_file_name("tensile-descheduler");
    let extender_bin = binary.with_file_name("tensile-scheduler-extender");
    for bin in [&descheduler_bin, &extender_bin] {
        if !bin.exists() {
            bail!(
                "{} not found: build the workspace's binaries first",
                bin.display()
            );
        }
    }
    if n == 0 {
        bail!("--return-home needs at least one pod");
    }
    let (after, interval, batch, steady) = (
        args.return_home_after,
        args.return_home_interval,
        args.return_home_batch,
        args.return_home_steady,
    );
    // Two regular nodes of ⌈n/2⌉ CPU: room for the n 1-CPU pods once the filler is gone.
    let half = n.div_ceil(2);
    let port = free_port()?;
    let mut options = lower_for(n);
    options.upper.nodes = 2;
    options.upper.node_shape = NodeShape {
        cpu: half.to_string(),
        memory: "4Ti".into(),
        pods: (half + 10).max(110).to_string(),
    };
    options
        .upper
        .scheduler_config
        .extend(shipped_scheduler_config(&format!(
            "http://127.0.0.1:{port}"
        ))?);
    eprintln!("starting the cluster pair (the extender, one virtual node) ...");
    let pair = ClusterPair::start(options).await?;
    let extender = start_extender(
        &pair,
        &extender_bin,
        "tensile-scheduler-extender",
        port,
        &[(NODE.to_owned(), pair.lower_kubeconfig())],
    )
    .await?;
    let (upper, lower) = (pair.upper.client().await?, pair.lower.client().await?);
    let mut vn = start_node(&pair, binary, args, NODE).await?;
    println!(
        "\ntensile-bench --return-home {n}: {}; 2 regular \
         nodes of {half} CPU held by a filler, {n} burst pods of 1 CPU on {NODE}; \
         tensile-descheduler --return-home --descheduling-interval={interval}s \
         --return-home-after={after}s --return-home-max-per-round={batch} \
         --return-home-max-per-owner={batch}; PodDisruptionBudget maxUnavailable {batch}\n",
        super::machine(&pair),
    );
    let mut report = Report { rows: Vec::new() };
    let label = format!("return home ({n} pods)");

    let ns = TestNamespace::create(&upper, "bench-home").await?;
    let deployments: Api<Deployment> = Api::namespaced(upper.clone(), &ns.name);
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let post = PostParams::default();
    let filler_spec = json!({"containers": [{"name": "app", "image": "nginx",
        "resources": {"requests": {"cpu": half.to_string(), "memory": "64Mi"}}}]});
    deployments
        .create(&post, &deployment(FILLER, 2, filler_spec))
        .await
        .context("creating the filler")?;
    wait_for("the filler Running", WAIT, || async {
        let list = pods
            .list(&kube::api::ListParams::default().labels(&format!("app={FILLER}")))
            .await?
            .items;
        Ok((list.len() == 2 && list.iter().all(ready)).then_some(()))
    })
    .await?;

    let sightings = Shared::default();
    lock(&sightings).n = n;
    let watch = watch_app(pods.clone(), sightings.clone());
    let app_spec = json!({
        "tolerations": [virtual_node_toleration()],
        "containers": [{"name": "app", "image": "nginx",
            "resources": {"requests": {"cpu": "1", "memory": "64Mi"}}}],
    });
    let created = Instant::now();
    deployments
        .create(&post, &deployment(APP, i32::try_from(n)?, app_spec))
        .await
        .context("creating the Deployment")?;
    let budget: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": APP},
        "spec": {"maxUnavailable": batch, "selector": {"matchLabels": {"app": APP}}},
    }))?;
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(upper.clone(), &ns.name);
    budgets
        .create(&post, &budget)
        .await
        .context("creating the PodDisruptionBudget")?;
    let burst = wait_for(&format!("{n} pods Running on {NODE}"), WAIT, || async {
        let seen = lock(&sightings);
        let burst = seen.on_virtual() == n && seen.ready() == n;
        Ok(burst.then(|| created.elapsed()))
    })
    .await?;
    report.row(
        &label,
        "burst: Deployment created -> all Running on the virtual node",
        secs(burst),
    );
    wait_for("the budget's status", WAIT, || async {
        let b = budgets.get(APP).await?;
        let generation = b.metadata.generation;
        Ok(b.status
            .filter(|s| {
                s.observed_generation == generation
                    && s.current_healthy == Some(i32::try_from(n).unwrap_or(i32::MAX))
            })
            .map(|_| ()))
    })
    .await?;

    let metrics_port = free_port()?;
    let descheduler = pair.spawn(
        "tensile-descheduler",
        &descheduler_bin,
        &[
            format!("--kubeconfig={}", pair.upper_kubeconfig().display()),
            format!("--metrics-addr=127.0.0.1:{metrics_port}"),
            format!("--descheduling-interval={interval}s"),
            "--leader-elect=false".into(),
            "--return-home".into(),
            format!("--return-home-after={after}s"),
            format!("--return-home-max-per-round={batch}"),
            format!("--return-home-max-per-owner={batch}"),
            "--log-level=info".into(),
        ],
    )?;
    // One round without room first: the descheduler runs as it would before the room
    // returns.
    wait_for("a return-home round without room", WAIT, || async {
        let skipped = metric(metrics_port, NO_ROOM).await.unwrap_or(0.0);
        Ok((skipped >= n as f64).then_some(()))
    })
    .await?;

    // Room returns.
    let before = cpu(&pair, &vn, &[&descheduler, &extender]);
    let moves_before = metric(metrics_port, MOVES).await?;
    let since = Instant::now();
    lock(&sightings).since = Some(since);
    scale(&deployments, FILLER, 0).await?;
    let home = wait_for("every burst pod home", WAIT, || async {
        Ok(lock(&sightings).home_at)
    })
    .await?;
    let after_cpu = cpu(&pair, &vn, &[&descheduler, &extender]);
    let moves = metric(metrics_port, MOVES).await? - moves_before;
    let refusals = metric(metrics_port, REFUSALS).await?;
    let rebursts = metric(metrics_port, REBURSTS).await?;
    let (first, evictions, at_home, burst_again, fewest) = {
        let seen = lock(&sightings);
        (
            seen.first_deletion,
            seen.deleted_on_virtual.len(),
            seen.deleted_at_home.len(),
            seen.burst_again.len(),
            seen.fewest_ready.unwrap_or(0),
        )
    };
    if let Some(first) = first {
        report.row(
            &label,
            &format!("room returned -> first eviction (window {after} s)"),
            secs(first.saturating_duration_since(since)),
        );
    }
    report.row(
        &label,
        "room returned -> last burst pod home",
        secs(home.saturating_duration_since(since)),
    );
    // The configuration's share: the window, then a round for each batch after the first.
    let rounds = u64::try_from(n.div_ceil(usize::try_from(batch)?))?;
    report.row(
        &label,
        "of it the configuration's: window + (rounds - 1) x interval",
        secs(Duration::from_secs(
            after + rounds.saturating_sub(1) * interval,
        )),
    );
    report.row(
        &label,
        "evictions per pod moved (target 1.0)",
        format!(
            "{:.2} ({evictions} pods evicted off {NODE} for {n} moved; the descheduler's \
             moves {moves:.0}, budget refusals {refusals:.0}, replacements that burst again \
             {burst_again} (counted by it {rebursts:.0}), pods deleted at home {at_home})",
            evictions as f64 / n as f64
        ),
    );
    report.row(
        &label,
        &format!(
            "fewest Ready at once (budget: {})",
            n.saturating_sub(usize::try_from(batch)?)
        ),
        fewest.to_string(),
    );
    report.row(
        &label,
        "CPU seconds by component",
        cpu_profile(&before, &after_cpu),
    );

    // Steady: nothing moves.
    let steady_label = format!("steady ({steady} s after)");
    let moves_home = metric(metrics_port, MOVES).await?;
    let deleted_home = {
        let seen = lock(&sightings);
        seen.deleted_on_virtual.len() + seen.deleted_at_home.len()
    };
    let before = cpu(&pair, &vn, &[&descheduler, &extender]);
    tokio::time::sleep(Duration::from_secs(steady)).await;
    let after_cpu = cpu(&pair, &vn, &[&descheduler, &extender]);
    let steady_moves = metric(metrics_port, MOVES).await? - moves_home;
    let (deleted, still_home) = {
        let seen = lock(&sightings);
        (
            seen.deleted_on_virtual.len() + seen.deleted_at_home.len() - deleted_home,
            seen.all_home(),
        )
    };
    report.row(
        &steady_label,
        "evictions (target 0)",
        format!(
            "{steady_moves:.0} (pods of the Deployment deleted {deleted}; all {n} still home: \
             {still_home})"
        ),
    );
    report.row(
        &steady_label,
        "CPU seconds by component",
        cpu_profile(&before, &after_cpu),
    );
    watch.abort();

    let (check, took) = invariant::converge(
        &upper,
        &lower,
        NODE,
        Some(&ns.name),
        Duration::from_secs(60),
    )
    .await?;
    report.row(
        &label,
        "invariant (nothing lost or duplicated)",
        if check.holds() {
            format!("holds (after {})", secs(took))
        } else {
            format!("BROKEN: {check}")
        },
    );
    ns.delete().await?;
    vn.stop()?;
    println!("\n{} figures.", report.rows.len());
    Ok(())
}
