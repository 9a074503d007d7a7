//! tensile-soak: the fault suite's long cases, on a cluster pair of its own, printed as a
//! table. Each case injects a fault while pods come or go, lets virtual-node recover (a
//! killed one is started again, as its Deployment would), and ends with the invariant
//! checker (`tensile_harness::invariant`): lost, orphans, duplicates, stale.
//!
//! Columns: injected (faults), survived (rounds whose invariant held after recovery),
//! lost / orphans / duplicates / stale (summed over rounds), converge (the slowest round:
//! from the end of the fault to the invariant holding), requests (virtual-node's API
//! requests, both clusters, from the fault to convergence: its metrics).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use nix::sys::signal::Signal;
use tensile_harness::fixtures::bound_pod;
use tensile_harness::invariant::{self, Report};
use tensile_harness::measure::scrape;
use tensile_harness::{
    ClusterPair, Component, PairOptions, TestNamespace, VirtualNode, VirtualNodeOptions,
    node_is_ready, wait_for,
};

#[derive(Parser)]
#[command(about = "Injects faults into virtual-node and its clusters; prints what survived")]
struct Args {
    /// Pods in each burst and deletion.
    #[arg(long, default_value_t = 300)]
    pods: usize,
    /// Rounds of each SIGKILL case.
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// How long the lower API server stays silent (seconds).
    #[arg(long, default_value_t = 60)]
    outage: u64,
    /// The virtual-node binary (default: beside this one).
    #[arg(long)]
    virtual_node: Option<PathBuf>,
}

const NODE: &str = "vk-soak";
const WAIT: Duration = Duration::from_secs(600);
const CONCURRENCY: usize = 32;

/// One line of the table.
#[derive(Default)]
struct Row {
    case: String,
    injected: u32,
    survived: u32,
    lost: usize,
    orphans: usize,
    duplicates: usize,
    stale: usize,
    converge: Duration,
    requests: f64,
}

impl Row {
    fn new(case: String) -> Self {
        Self {
            case,
            ..Self::default()
        }
    }

    fn add(&mut self, report: &Report, converge: Duration, requests: f64) {
        self.injected += 1;
        self.survived += u32::from(report.holds());
        self.lost += report.lost.len();
        self.orphans += report.orphans.len();
        self.duplicates += report.duplicates.len();
        self.stale += report.stale.len();
        self.converge = self.converge.max(converge);
        self.requests += requests;
        if !report.holds() {
            eprintln!("  {}: {report}", self.case);
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("tensile-soak: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// The virtual node of the soak, with the pair it runs on.
struct Soak {
    pair: ClusterPair,
    binary: PathBuf,
    upper: Client,
    lower: Client,
    node: Option<VirtualNode>,
}

impl Soak {
    async fn start_node(&mut self) -> Result<()> {
        let mut options = VirtualNodeOptions::new(&self.binary, NODE);
        options.args = vec!["--log-level".into(), "warn".into()];
        let node = self.pair.start_virtual_node(&options)?;
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(self.upper.clone());
        wait_for(&format!("node {NODE} Ready"), WAIT, || async {
            Ok(nodes.get_opt(NODE).await?.filter(node_is_ready).map(|_| ()))
        })
        .await?;
        // Its metrics endpoint answers once it serves.
        let port = node.metrics_port;
        wait_for("its metrics", WAIT, || async {
            Ok(scrape(port).await.ok().map(|_| ()))
        })
        .await?;
        self.node = Some(node);
        Ok(())
    }

    fn kill(&mut self) -> Result<()> {
        if let Some(mut node) = self.node.take() {
            node.kill()?;
        }
        Ok(())
    }

    /// virtual-node's API requests so far (both clusters).
    async fn requests(&self) -> f64 {
        let Some(node) = &self.node else { return 0.0 };
        scrape(node.metrics_port)
            .await
            .map(|m| {
                m.iter()
                    .filter(|(k, _)| k.starts_with("tensile_api_requests_total{"))
                    .map(|(_, v)| v)
                    .sum()
            })
            .unwrap_or_default()
    }

    async fn converge(&self) -> Result<(Report, Duration)> {
        invariant::converge(&self.upper, &self.lower, NODE, None, WAIT).await
    }

    /// SIGKILLs virtual-node and starts it again; returns when it was killed and the
    /// new process's request count.
    async fn kill_and_restart(&mut self) -> Result<(Instant, f64)> {
        self.kill()?;
        let killed = Instant::now();
        self.start_node().await?;
        Ok((killed, self.requests().await))
    }

    /// Waits for the invariant, then adds the round to `row`: `report` (from
    /// [`Soak::converge`], plus anything the case found) as of `since` (the fault), with
    /// the requests made since the count `before`.
    async fn record(&self, row: &mut Row, what: &str, report: Report, since: Instant, before: f64) {
        let took = since.elapsed();
        row.add(&report, took, self.requests().await - before);
        eprintln!("  {what}: {report} in {took:.1?}");
    }
}

/// A pseudo-random delay in `[from, to)` (the clock's nanoseconds: no seed to keep).
fn random_delay(from: Duration, to: Duration) -> Duration {
    let nanos = u64::from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .subsec_nanos(),
    );
    let span = u64::try_from((to - from).as_millis()).unwrap_or(1).max(1);
    from + Duration::from_millis(nanos % span)
}

async fn create_pods(api: &Api<Pod>, prefix: &str, count: usize) -> Result<()> {
    let results: Vec<Result<()>> = futures::stream::iter(0..count)
        .map(|i| {
            let api = api.clone();
            let name = format!("{prefix}-{i:04}");
            async move {
                let pod = bound_pod(&name, NODE);
                // An API server restarting (another case) is waited out.
                wait_for(&format!("pod {name} created"), WAIT, || async {
                    match api.create(&PostParams::default(), &pod).await {
                        Ok(_) => Ok(Some(())),
                        Err(kube::Error::Api(s)) if s.code == 409 => Ok(Some(())),
                        Err(_) => Ok(None),
                    }
                })
                .await
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    results.into_iter().collect()
}

async fn count(api: &Api<Pod>) -> Result<usize> {
    Ok(api.list(&ListParams::default()).await?.items.len())
}

async fn run(args: Args) -> Result<bool> {
    let binary = match &args.virtual_node {
        Some(path) => path.clone(),
        None => std::env::current_exe()?.with_file_name("virtual-node"),
    };
    if !binary.exists() {
        bail!(
            "{} not found: build it first (`cargo build --workspace --bins`)",
            binary.display()
        );
    }
    eprintln!("tensile-soak: starting a cluster pair");
    let pair = ClusterPair::start(PairOptions::default()).await?;
    let upper = pair.upper.client().await?;
    let lower = pair.lower.client().await?;
    let mut soak = Soak {
        pair,
        binary,
        upper,
        lower,
        node: None,
    };
    soak.start_node().await?;
    let mut rows = Vec::new();
    rows.push(kill_during_burst(&mut soak, &args).await?);
    rows.push(kill_during_deletion(&mut soak, &args).await?);
    rows.push(silent_lower(&mut soak, &args).await?);
    for (what, component, upper) in [
        (
            "upper kube-apiserver SIGKILLed, restarted",
            Component::ApiServer,
            true,
        ),
        ("lower etcd SIGKILLed, restarted", Component::Etcd, false),
        (
            "lower kube-apiserver SIGKILLed, restarted",
            Component::ApiServer,
            false,
        ),
    ] {
        rows.push(restart(&mut soak, &args, what, component, upper).await?);
    }
    print_table(&args, &rows);
    Ok(rows.iter().all(|r| r.survived == r.injected))
}

async fn kill_during_burst(soak: &mut Soak, args: &Args) -> Result<Row> {
    let mut row = Row::new(format!(
        "virtual-node SIGKILLed during a {}-pod burst",
        args.pods
    ));
    for round in 0..args.rounds {
        let ns = TestNamespace::create(&soak.upper, "soak-burst").await?;
        let api: Api<Pod> = Api::namespaced(soak.upper.clone(), &ns.name);
        let creating = tokio::spawn({
            let api = api.clone();
            let pods = args.pods;
            async move { create_pods(&api, "p", pods).await }
        });
        tokio::time::sleep(random_delay(
            Duration::from_millis(200),
            Duration::from_secs(4),
        ))
        .await;
        let (killed, before) = soak.kill_and_restart().await?;
        creating.await.context("creating pods")??;
        let (report, _) = soak.converge().await?;
        let what = format!("burst round {round}");
        soak.record(&mut row, &what, report, killed, before).await;
        ns.delete().await?;
    }
    Ok(row)
}

async fn kill_during_deletion(soak: &mut Soak, args: &Args) -> Result<Row> {
    let mut row = Row::new(format!(
        "virtual-node SIGKILLed during a {}-pod deletion",
        args.pods
    ));
    for round in 0..args.rounds {
        let ns = TestNamespace::create(&soak.upper, "soak-delete").await?;
        let api: Api<Pod> = Api::namespaced(soak.upper.clone(), &ns.name);
        let below: Api<Pod> = Api::namespaced(soak.lower.clone(), &ns.name);
        create_pods(&api, "p", args.pods).await?;
        let (report, _) = soak.converge().await?;
        if !report.holds() {
            bail!("before the deletion: {report}");
        }
        api.delete_collection(&DeleteParams::default(), &ListParams::default())
            .await?;
        tokio::time::sleep(random_delay(
            Duration::from_millis(100),
            Duration::from_secs(2),
        ))
        .await;
        let (killed, before) = soak.kill_and_restart().await?;
        wait_for("every pod gone above and below", WAIT, || async {
            Ok((count(&api).await? == 0 && count(&below).await? == 0).then_some(()))
        })
        .await?;
        let (report, _) = soak.converge().await?;
        let what = format!("deletion round {round}");
        soak.record(&mut row, &what, report, killed, before).await;
        ns.delete().await?;
    }
    Ok(row)
}

/// A namespace of its own with 20 pods running below, and their lower UIDs.
struct Running {
    ns: TestNamespace,
    api: Api<Pod>,
    below: Api<Pod>,
    uids: BTreeMap<String, String>,
}

impl Running {
    async fn start(soak: &Soak, prefix: &str) -> Result<Self> {
        let ns = TestNamespace::create(&soak.upper, prefix).await?;
        let api: Api<Pod> = Api::namespaced(soak.upper.clone(), &ns.name);
        let below: Api<Pod> = Api::namespaced(soak.lower.clone(), &ns.name);
        create_pods(&api, "before", 20).await?;
        soak.converge().await?;
        let uids = invariant::uids_by_name(&below).await?;
        Ok(Self {
            ns,
            api,
            below,
            uids,
        })
    }

    /// Adds to `report` every pod that ran before, is not `deleted`, and was re-created
    /// below (another UID) or is gone.
    async fn check_undisturbed(&self, deleted: Option<&str>, report: &mut Report) -> Result<()> {
        let after = invariant::uids_by_name(&self.below).await?;
        for (name, uid) in &self.uids {
            if Some(name.as_str()) != deleted && after.get(name) != Some(uid) {
                report.stale.push(format!("{name} re-created below"));
            }
        }
        Ok(())
    }
}

/// The lower API server frozen (SIGSTOP) for `--outage` seconds while pods come and go
/// above; the pods running below must not be disturbed (same UIDs afterwards).
async fn silent_lower(soak: &mut Soak, args: &Args) -> Result<Row> {
    let mut row = Row::new(format!("lower kube-apiserver silent {} s", args.outage));
    let running = Running::start(soak, "soak-silent").await?;
    let before = soak.requests().await;
    soak.pair
        .lower
        .signal(Component::ApiServer, Signal::SIGSTOP)?;
    create_pods(&running.api, "during", 20).await?;
    running
        .api
        .delete("before-0000", &DeleteParams::default())
        .await?;
    tokio::time::sleep(Duration::from_secs(args.outage)).await;
    soak.pair
        .lower
        .signal(Component::ApiServer, Signal::SIGCONT)?;
    let resumed = Instant::now();
    let (mut report, _) = soak.converge().await?;
    running
        .check_undisturbed(Some("before-0000"), &mut report)
        .await?;
    soak.record(&mut row, "silent lower", report, resumed, before)
        .await;
    running.ns.delete().await?;
    Ok(row)
}

async fn restart(
    soak: &mut Soak,
    args: &Args,
    what: &str,
    component: Component,
    upper: bool,
) -> Result<Row> {
    let mut row = Row::new(what.to_owned());
    let running = Running::start(soak, "soak-restart").await?;
    let before = soak.requests().await;
    let cluster = if upper {
        &soak.pair.upper
    } else {
        &soak.pair.lower
    };
    soak.pair.restart(cluster, component)?;
    let restarted = Instant::now();
    create_pods(&running.api, "during", args.pods.min(50)).await?;
    let (mut report, _) = soak.converge().await?;
    running.check_undisturbed(None, &mut report).await?;
    soak.record(&mut row, what, report, restarted, before).await;
    running.ns.delete().await?;
    Ok(row)
}

fn print_table(args: &Args, rows: &[Row]) {
    println!(
        "\ntensile-soak: {} cores, {} pods a burst, {} rounds per SIGKILL case",
        std::thread::available_parallelism().map_or(0, std::num::NonZero::get),
        args.pods,
        args.rounds
    );
    println!(
        "{:<52} {:>8} {:>8} {:>5} {:>7} {:>10} {:>5} {:>9} {:>8}",
        "case",
        "injected",
        "survived",
        "lost",
        "orphans",
        "duplicates",
        "stale",
        "converge",
        "requests"
    );
    for r in rows {
        println!(
            "{:<52} {:>8} {:>8} {:>5} {:>7} {:>10} {:>5} {:>8.1}s {:>8.0}",
            r.case,
            r.injected,
            r.survived,
            r.lost,
            r.orphans,
            r.duplicates,
            r.stale,
            r.converge.as_secs_f64(),
            r.requests
        );
    }
}
