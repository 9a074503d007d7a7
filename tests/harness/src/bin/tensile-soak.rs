//! tensile-soak: the fault suite's long cases, on a cluster pair of its own, printed as a
//! table. Each case injects a fault while pods come or go, lets virtual-node recover (a
//! killed one is started again, as its Deployment would), and ends with the invariant
//! checker (`tensile_harness::invariant`): lost, orphans, duplicates, stale.
//!
//! The error-storm and watch-expiry cases run virtual-node through the harness's
//! fault-injecting proxies (`tensile_harness::fault_proxy`), one in front of each API server.
//!
//! Columns: injected (faults), survived (rounds whose invariant held after recovery),
//! lost / orphans / duplicates / stale (summed over rounds), converge (the slowest round:
//! from the end of the fault to the invariant holding), requests and writes (virtual-node's
//! API requests, and of them creates, updates, patches and deletes, both clusters, from the
//! fault to convergence: its metrics).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use nix::sys::signal::Signal;
use tensile_harness::fault_proxy::{Fault, FaultProxy};
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
    /// How long the error storm lasts (seconds).
    #[arg(long, default_value_t = 30)]
    storm: u64,
    /// The cases to run, comma-separated (default: all, in this order).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Case::value_variants().to_vec())]
    cases: Vec<Case>,
    /// The virtual-node binary (default: beside this one).
    #[arg(long)]
    virtual_node: Option<PathBuf>,
}

/// One fault case, a row of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Case {
    /// virtual-node SIGKILLed during a burst, `--rounds` times.
    Burst,
    /// virtual-node SIGKILLed during a deletion, `--rounds` times.
    Deletion,
    /// The lower API server frozen for `--outage` seconds.
    SilentLower,
    /// The upper API server SIGKILLed and restarted.
    UpperApiserver,
    /// The lower etcd SIGKILLed and restarted.
    LowerEtcd,
    /// The lower API server SIGKILLed and restarted.
    LowerApiserver,
    /// Half of virtual-node's requests to both API servers answered 429, 500, 503 or cut
    /// off, for `--storm` seconds.
    Storm,
    /// Every watch of virtual-node ended with a 410 (`Expired`), `--rounds` times, with
    /// `--pods` pods in sync; then every resumed watch refused with a 410 for 10 s.
    Expiry,
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
    writes: f64,
}

impl Row {
    fn new(case: String) -> Self {
        Self {
            case,
            ..Self::default()
        }
    }

    fn add(&mut self, report: &Report, converge: Duration, (requests, writes): (f64, f64)) {
        self.injected += 1;
        self.survived += u32::from(report.holds());
        self.lost += report.lost.len();
        self.orphans += report.orphans.len();
        self.duplicates += report.duplicates.len();
        self.stale += report.stale.len();
        self.converge = self.converge.max(converge);
        self.requests += requests;
        self.writes += writes;
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
    proxies: Proxies,
    /// Whether virtual-node talks to the API servers through [`Soak::proxies`].
    proxied: bool,
}

/// A fault proxy in front of each API server, and kubeconfigs pointing at them.
struct Proxies {
    upper: FaultProxy,
    lower: FaultProxy,
    upper_kubeconfig: PathBuf,
    lower_kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

impl Proxies {
    async fn start(upper: &Client, lower: &Client) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let upper = FaultProxy::start(upper.clone()).await?;
        let lower = FaultProxy::start(lower.clone()).await?;
        Ok(Self {
            upper_kubeconfig: upper.write_kubeconfig(&dir.path().join("upper.kubeconfig"))?,
            lower_kubeconfig: lower.write_kubeconfig(&dir.path().join("lower.kubeconfig"))?,
            upper,
            lower,
            _dir: dir,
        })
    }

    fn both(&self) -> [&FaultProxy; 2] {
        [&self.upper, &self.lower]
    }

    fn set(&self, fault: Fault, percent: u64) {
        for proxy in self.both() {
            proxy.set(fault, percent);
        }
    }

    fn expired(&self) -> u64 {
        self.upper.expired() + self.lower.expired()
    }

    fn watches(&self) -> u64 {
        self.both()
            .iter()
            .map(|p| p.requests().of_verb("watch"))
            .sum()
    }
}

impl Soak {
    /// Starts virtual-node again, through the proxies or not.
    async fn restart_node(&mut self, proxied: bool) -> Result<()> {
        if self.proxied != proxied || self.node.is_none() {
            self.kill()?;
            self.proxied = proxied;
            self.start_node().await?;
        }
        Ok(())
    }

    async fn start_node(&mut self) -> Result<()> {
        let mut options = VirtualNodeOptions::new(&self.binary, NODE);
        options.args = vec!["--log-level".into(), "warn".into()];
        if self.proxied {
            options.upper_kubeconfig = Some(self.proxies.upper_kubeconfig.clone());
            options.lower_kubeconfig = Some(self.proxies.lower_kubeconfig.clone());
        }
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

    /// virtual-node's API requests so far, and of them writes (both clusters).
    async fn requests(&self) -> (f64, f64) {
        let Some(node) = &self.node else {
            return (0.0, 0.0);
        };
        let Ok(metrics) = scrape(node.metrics_port).await else {
            return (0.0, 0.0);
        };
        let sent = metrics
            .iter()
            .filter(|(k, _)| k.starts_with("tensile_api_requests_total{"));
        let writes = sent
            .clone()
            .filter(|(k, _)| {
                ["create", "update", "patch", "delete"]
                    .iter()
                    .any(|verb| k.contains(&format!("verb=\"{verb}\"")))
            })
            .map(|(_, v)| v)
            .sum();
        (sent.map(|(_, v)| v).sum(), writes)
    }

    async fn converge(&self) -> Result<(Report, Duration)> {
        invariant::converge(&self.upper, &self.lower, NODE, None, WAIT).await
    }

    /// SIGKILLs virtual-node and starts it again; returns when it was killed and the
    /// new process's request count.
    async fn kill_and_restart(&mut self) -> Result<(Instant, (f64, f64))> {
        self.kill()?;
        let killed = Instant::now();
        self.start_node().await?;
        Ok((killed, self.requests().await))
    }

    /// Waits for the invariant, then adds the round to `row`: `report` (from
    /// [`Soak::converge`], plus anything the case found) as of `since` (the fault), with
    /// the requests made since the count `before`.
    async fn record(
        &self,
        row: &mut Row,
        what: &str,
        report: Report,
        since: Instant,
        before: (f64, f64),
    ) {
        let took = since.elapsed();
        let now = self.requests().await;
        row.add(&report, took, (now.0 - before.0, now.1 - before.1));
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
    let proxies = Proxies::start(&upper, &lower).await?;
    let mut soak = Soak {
        pair,
        binary,
        upper,
        lower,
        node: None,
        proxies,
        proxied: false,
    };
    let mut rows = Vec::new();
    for case in &args.cases {
        // The proxied cases start virtual-node through the proxies; the others without.
        let proxied = matches!(case, Case::Storm | Case::Expiry);
        soak.restart_node(proxied).await?;
        match case {
            Case::Burst => rows.push(kill_during_burst(&mut soak, &args).await?),
            Case::Deletion => rows.push(kill_during_deletion(&mut soak, &args).await?),
            Case::SilentLower => rows.push(silent_lower(&mut soak, &args).await?),
            Case::UpperApiserver => {
                let what = "upper kube-apiserver SIGKILLed, restarted";
                rows.push(restart(&mut soak, &args, what, Component::ApiServer, true).await?);
            }
            Case::LowerEtcd => {
                let what = "lower etcd SIGKILLed, restarted";
                rows.push(restart(&mut soak, &args, what, Component::Etcd, false).await?);
            }
            Case::LowerApiserver => {
                let what = "lower kube-apiserver SIGKILLed, restarted";
                rows.push(restart(&mut soak, &args, what, Component::ApiServer, false).await?);
            }
            Case::Storm => rows.push(storm(&mut soak, &args).await?),
            Case::Expiry => rows.extend(expiry(&mut soak, &args).await?),
        }
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

/// Half of virtual-node's requests to both API servers answered 429 (Retry-After), 500,
/// 503 or cut off for `--storm` seconds while 20 pods are created above; the pods running
/// before must not be disturbed.
async fn storm(soak: &mut Soak, args: &Args) -> Result<Row> {
    let mut row = Row::new(format!(
        "error storm: half of requests 429/500/503/reset, {} s",
        args.storm
    ));
    let running = Running::start(soak, "soak-storm").await?;
    let before = soak.requests().await;
    let received = soak.proxies.upper.received() + soak.proxies.lower.received();
    soak.proxies.set(Fault::Mixed, 50);
    let started = Instant::now();
    create_pods(&running.api, "during", 20).await?;
    wait_for("the end of the storm", WAIT, || async {
        Ok((started.elapsed() >= Duration::from_secs(args.storm)).then_some(()))
    })
    .await?;
    soak.proxies.set(Fault::None, 0);
    let ended = Instant::now();
    let sent = soak.proxies.upper.received() + soak.proxies.lower.received() - received;
    eprintln!(
        "  storm: {sent} requests in {:.1} s ({:.1}/s)",
        started.elapsed().as_secs_f64(),
        sent as f64 / started.elapsed().as_secs_f64()
    );
    let (mut report, _) = soak.converge().await?;
    running.check_undisturbed(None, &mut report).await?;
    soak.record(&mut row, "storm", report, ended, before).await;
    running.ns.delete().await?;
    Ok(row)
}

/// `--pods` pods in sync; every watch of virtual-node ended with a 410 `--rounds` times
/// (each once all were open again), then every watch resuming from a list refused with a
/// 410 for 10 s. Relists must not disturb (or write to) the pods in sync.
async fn expiry(soak: &mut Soak, args: &Args) -> Result<Vec<Row>> {
    const REFUSED: Duration = Duration::from_secs(10);
    let mut expired_row = Row::new(format!("watches expired (410), {} pods in sync", args.pods));
    let mut refused_row = Row::new(format!(
        "resumed watches refused (410) {} s, {} pods in sync",
        REFUSED.as_secs(),
        args.pods
    ));
    let ns = TestNamespace::create(&soak.upper, "soak-expiry").await?;
    let api: Api<Pod> = Api::namespaced(soak.upper.clone(), &ns.name);
    let below: Api<Pod> = Api::namespaced(soak.lower.clone(), &ns.name);
    create_pods(&api, "p", args.pods).await?;
    soak.converge().await?;
    let uids = invariant::uids_by_name(&below).await?;
    let undisturbed = async |report: &mut Report| -> Result<()> {
        let after = invariant::uids_by_name(&below).await?;
        for (name, uid) in &uids {
            if after.get(name) != Some(uid) {
                report.stale.push(format!("{name} re-created below"));
            }
        }
        Ok(())
    };
    for round in 0..args.rounds {
        let before = soak.requests().await;
        let (expired, watches) = (soak.proxies.expired(), soak.proxies.watches());
        for proxy in soak.proxies.both() {
            proxy.expire_watches();
        }
        let started = Instant::now();
        wait_for("every expired watch open again", WAIT, || async {
            let expired = soak.proxies.expired() - expired;
            Ok((expired > 0 && soak.proxies.watches() - watches >= expired).then_some(()))
        })
        .await?;
        let (mut report, _) = soak.converge().await?;
        undisturbed(&mut report).await?;
        let what = format!("expiry round {round}");
        soak.record(&mut expired_row, &what, report, started, before)
            .await;
    }
    let before = soak.requests().await;
    let expired = soak.proxies.expired();
    soak.proxies.set(Fault::Expired, 100);
    for proxy in soak.proxies.both() {
        proxy.expire_watches();
    }
    let started = Instant::now();
    wait_for("the end of the refusal", WAIT, || async {
        Ok((started.elapsed() >= REFUSED).then_some(()))
    })
    .await?;
    soak.proxies.set(Fault::None, 0);
    let ended = Instant::now();
    eprintln!(
        "  refusal: {} watches refused or ended",
        soak.proxies.expired() - expired
    );
    let (mut report, _) = soak.converge().await?;
    undisturbed(&mut report).await?;
    soak.record(&mut refused_row, "refusal", report, ended, before)
        .await;
    ns.delete().await?;
    Ok(vec![expired_row, refused_row])
}

fn print_table(args: &Args, rows: &[Row]) {
    println!(
        "\ntensile-soak: {} cores, {} pods a burst, {} rounds per SIGKILL case",
        std::thread::available_parallelism().map_or(0, std::num::NonZero::get),
        args.pods,
        args.rounds
    );
    println!(
        "{:<60} {:>8} {:>8} {:>5} {:>7} {:>10} {:>5} {:>9} {:>8} {:>6}",
        "case",
        "injected",
        "survived",
        "lost",
        "orphans",
        "duplicates",
        "stale",
        "converge",
        "requests",
        "writes"
    );
    for r in rows {
        println!(
            "{:<60} {:>8} {:>8} {:>5} {:>7} {:>10} {:>5} {:>8.1}s {:>8.0} {:>6.0}",
            r.case,
            r.injected,
            r.survived,
            r.lost,
            r.orphans,
            r.duplicates,
            r.stale,
            r.converge.as_secs_f64(),
            r.requests,
            r.writes
        );
    }
}
