//! `tensile-bench --lower-clusters N`: one virtual-node process serving N lower clusters
//! (members joined by `virtual-node join`) against N single-cluster processes side by
//! side, in one run on the same clusters, at the same total of mirrored pods: memory, CPU,
//! what one more idle member costs, status reflection while every member bursts at once,
//! the upper API server's open watches, and isolation: the other members' reflection p99
//! with one member's lower API server frozen, against the same burst without.

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
use std::ops::Range;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::Api;
use nix::sys::signal::Signal;
use tensile_harness::fixtures::bound_pod;
use tensile_harness::measure::{footprint, percentile, scrape};
use tensile_harness::virtual_node::join_member;
use tensile_harness::{
    Cluster, ClusterOptions, ClusterPair, Component, VirtualNode, VirtualNodeOptions,
    node_is_ready, wait_for,
};

use super::{
    Args, Pace, Shared, Timeline, burst, delete_and_wait, labelled, latencies, lock, ms,
    track_running,
};

pub(super) const MEMBERS_NAMESPACE: &str = "tensile-bench-members";
const MIB: f64 = 1024.0 * 1024.0;

/// What one way of serving the N clusters measured.
struct Side {
    /// Resident memory once every node is Ready, before any pod (bytes).
    idle: u64,
    /// Resident memory with every pod mirrored and Running (bytes).
    loaded: u64,
    /// CPU seconds during the burst.
    cpu: f64,
    /// Pod created → Running upstairs: p50, p99.
    p50: Duration,
    p99: Duration,
    /// Time until the last pod was Running.
    total: Duration,
    /// Open upper watches (every client's) with every node Ready.
    watches: u64,
    /// Where the pods waited during the burst.
    waits: Waits,
    /// The processes' tokio threads (workers, blocking pool), together.
    workers: usize,
    /// The pod's way in stages, as the bench's own watches saw it.
    stages: Stages,
    /// How long the bench waited for the machine to quiet down before the burst, and the
    /// cores it was still busy on then.
    quiet: (Duration, f64),
}

/// The CPU time of this machine (every process's, `/proc/stat`'s first line): in all,
/// and idle (idle and iowait), in clock ticks.
fn cpu_ticks() -> Result<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    Ok(ticks(stat.lines().next().unwrap_or_default()))
}

/// The total and idle ticks of a `/proc/stat` `cpu` line.
fn ticks(line: &str) -> (u64, u64) {
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (fields.iter().sum(), idle)
}

/// The cores busy between two readings of [`cpu_ticks`] on a machine of `cores` cores.
fn busy_cores((total0, idle0): (u64, u64), (total, idle): (u64, u64), cores: usize) -> f64 {
    let (all, idle) = (total.saturating_sub(total0), idle.saturating_sub(idle0));
    if all == 0 {
        return 0.0;
    }
    (all - idle.min(all)) as f64 / all as f64 * cores as f64
}

/// Waits, 60 s at most, until the machine is busy on less than half a core over 5 s (what
/// a burst left behind, its deletions and namespaces, done), so that no burst starts in
/// another's leftovers. Answers how long it waited and the cores busy in the last 5 s
/// (printed: a busy machine shows).
async fn machine_quiet() -> Result<(Duration, f64)> {
    const WINDOW: Duration = Duration::from_secs(5);
    const AT_MOST: Duration = Duration::from_secs(60);
    let started = Instant::now();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut reading = cpu_ticks()?;
    loop {
        tokio::time::sleep(WINDOW).await;
        let now = cpu_ticks()?;
        let busy = busy_cores(reading, now, cores);
        reading = now;
        if busy < 0.5 || started.elapsed() >= AT_MOST {
            return Ok((started.elapsed(), busy));
        }
    }
}

/// A pod's way from created upstairs to Running upstairs in four stages, each from the
/// bench's own watches of the upper and every lower cluster (p50, p99): create called →
/// seen upstairs (the upper API server), → its copy seen below (the upper watch, the
/// member's queue, the lower create), → Running below (the lower cluster), → Running
/// upstairs (the lower watch, the status write).
#[derive(Default)]
struct Stages {
    created: (Duration, Duration),
    mirrored: (Duration, Duration),
    started_below: (Duration, Duration),
    reflected: (Duration, Duration),
}

impl Stages {
    fn of(upstairs: &Timeline, below: &Timeline) -> Self {
        let stage = |from: &HashMap<String, Instant>, to: &HashMap<String, Instant>| {
            let mut each: Vec<Duration> = to
                .iter()
                .filter_map(|(name, at)| Some(at.saturating_duration_since(*from.get(name)?)))
                .collect();
            each.sort();
            (percentile(&each, 50.0), percentile(&each, 99.0))
        };
        Self {
            created: stage(&upstairs.created, &upstairs.seen),
            mirrored: stage(&upstairs.seen, &below.seen),
            started_below: stage(&below.seen, &below.running),
            reflected: stage(&below.running, &upstairs.running),
        }
    }

    fn rows(&self) -> [(&'static str, (Duration, Duration)); 4] {
        [
            ("  create called -> seen upstairs, p50 / p99", self.created),
            ("  seen upstairs -> seen below", self.mirrored),
            ("  seen below -> Running below", self.started_below),
            ("  Running below -> Running upstairs", self.reflected),
        ]
    }
}

/// Runs the comparison for `clusters` lower clusters and `pods` pods in all.
pub async fn run(binary: &Path, clusters: usize, args: &Args) -> Result<()> {
    let pods = args.pods;
    let per_member = pods.div_ceil(clusters);
    // Room below for a burst (both ways' side by side) and the warm-up's pods still leaving.
    let room = if args.side_by_side { 3 } else { 2 } * per_member;
    let (pair, extra) = start_clusters(clusters, room).await?;
    let lowers: Vec<&Cluster> = std::iter::once(&pair.lower).chain(&extra).collect();
    let upper = pair.upper.client().await?;
    let rate = rate_args(args.qps);
    let watches_before = open_watches(&upper).await?;

    let ways = Ways {
        binary,
        pair: &pair,
        lowers: &lowers,
        upper: &upper,
        rate: &rate,
        args,
        per_member,
        watches_before,
    };
    let heading = format!(
        "\nfederation: {clusters} lower cluster(s), {} pods in all ({per_member} per cluster), {} cores, created {}",
        per_member * clusters,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        match args.create_rate {
            Some(rate) => format!("{rate} a second"),
            None => format!("{} at a time", args.concurrency),
        },
    );
    if args.side_by_side {
        let (bursts, one) = ways.side_by_side().await?;
        println!(
            "{heading}; both ways side by side, each burst over both ways' nodes at once ({} pods a way)",
            per_member * clusters
        );
        for (round, (federated, separate)) in bursts.iter().enumerate() {
            println!("  burst {}", round + 1);
            print_sides(federated, separate);
        }
        print_idle_member(
            clusters,
            one.idle_member(clusters),
            one.one_member,
            one.idle,
        );
    } else {
        // Each way in turn, on the same clusters: the one first unless `--separate-first`.
        let (federated, separate) = if args.separate_first {
            let separate = ways.separate().await?;
            (ways.federated().await?, separate)
        } else {
            let federated = ways.federated().await?;
            (federated, ways.separate().await?)
        };
        println!("{heading}");
        print_sides(&federated.side, &separate);
        print_idle_member(
            clusters,
            federated.idle_member,
            federated.one_member,
            federated.side.idle,
        );
        if let Some((calm, frozen)) = federated.isolation {
            println!(
                "  isolation: the other {} member(s)' p99 (created -> Running) with member 1's lower API server frozen: {} vs {} without ({:+.0} %)",
                clusters - 1,
                ms(frozen),
                ms(calm),
                (frozen.as_secs_f64() / calm.as_secs_f64().max(1e-9) - 1.0) * 100.0
            );
        }
    }
    for cluster in &extra {
        cluster.stop();
    }
    Ok(())
}

/// The table of one way against the other.
fn print_sides(federated: &Side, separate: &Side) {
    println!(
        "  {:<44} {:>24} {:>24}",
        "", "one process, N members", "N processes"
    );
    let mib = |bytes: u64| format!("{:.1} MiB", bytes as f64 / MIB);
    let quiet =
        |(waited, busy): (Duration, f64)| format!("{:.0} s, {busy:.2}", waited.as_secs_f64());
    let rows = [
        (
            "resident memory, idle (all nodes Ready)",
            mib(federated.idle),
            mib(separate.idle),
        ),
        (
            "resident memory, every pod Running",
            mib(federated.loaded),
            mib(separate.loaded),
        ),
        (
            "CPU during the burst",
            format!("{:.1} s", federated.cpu),
            format!("{:.1} s", separate.cpu),
        ),
        (
            "pod created -> Running upstairs, p50 / p99",
            format!("{} / {}", ms(federated.p50), ms(federated.p99)),
            format!("{} / {}", ms(separate.p50), ms(separate.p99)),
        ),
        (
            "machine before the burst: waited, cores busy",
            quiet(federated.quiet),
            quiet(separate.quiet),
        ),
        (
            "burst, until the last pod Running",
            ms(federated.total),
            ms(separate.total),
        ),
        (
            "tokio threads (workers, blocking pool)",
            federated.workers.to_string(),
            separate.workers.to_string(),
        ),
        (
            "upper watches opened (apiserver gauge)",
            federated.watches.to_string(),
            separate.watches.to_string(),
        ),
    ];
    for (what, federated, separate) in rows {
        println!("  {what:<44} {federated:>24} {separate:>24}");
    }
    for ((what, one), (_, many)) in federated
        .stages
        .rows()
        .into_iter()
        .zip(separate.stages.rows())
    {
        let cell = |(p50, p99)| format!("{} / {}", ms(p50), ms(p99));
        println!("  {what:<44} {:>24} {:>24}", cell(one), cell(many));
    }
    print_waits(&federated.waits, &separate.waits);
}

/// What one more idle member costs the one process (`idle_member`), from its resident
/// memory with one member and with all `clusters` (bytes).
fn print_idle_member(clusters: usize, idle_member: f64, one_member: u64, idle: u64) {
    if clusters > 1 {
        println!(
            "  one more idle member: {:.2} MiB resident (one member {:.1} MiB, {clusters} members {:.1} MiB)",
            idle_member / MIB,
            one_member as f64 / MIB,
            idle as f64 / MIB
        );
    }
}

/// What the two ways share: the clusters, the binary, the request budget.
struct Ways<'a> {
    binary: &'a Path,
    pair: &'a ClusterPair,
    lowers: &'a [&'a Cluster],
    upper: &'a Client,
    rate: &'a [String],
    args: &'a Args,
    per_member: usize,
    /// Open upper watches before either way started.
    watches_before: u64,
}

/// The one process's figures.
struct Federated {
    side: Side,
    /// The other members' p99 without and with member 1's lower API server frozen.
    isolation: Option<(Duration, Duration)>,
    /// Resident memory one more idle member adds (bytes).
    idle_member: f64,
    /// Resident memory with one member (bytes).
    one_member: u64,
}

impl Ways<'_> {
    /// How the measured bursts' pods are created (`--concurrency`, `--create-rate`).
    fn pace(&self) -> Pace {
        Pace {
            concurrency: self.args.concurrency,
            per_second: self.args.create_rate,
        }
    }

    /// Starts the one process: the first member, then the others (what one more idle
    /// member costs), every node Ready.
    async fn start_federated(&self) -> Result<OneProcess> {
        let (upper, lowers, binary) = (self.upper, self.lowers, self.binary);
        let members: Vec<String> = (1..=lowers.len()).map(|i| format!("vk-fed-{i}")).collect();
        join_all(binary, self.pair, &members[..1], &lowers[..1]).await?;
        let process = start_one_process(self.pair, binary, self.args, self.rate)?;
        all_ready(upper, &members[..1]).await?;
        let one_member = settled_rss(&[&process]).await?;
        join_all(binary, self.pair, &members[1..], &lowers[1..]).await?;
        all_ready(upper, &members).await?;
        let idle = settled_rss(&[&process]).await?;
        Ok(OneProcess {
            process,
            members,
            one_member,
            idle,
        })
    }

    /// Starts N processes, one per lower cluster, as tensile-kube runs, every node Ready;
    /// their resident memory then.
    async fn start_separate(&self) -> Result<(Vec<VirtualNode>, Vec<String>, u64)> {
        let solo: Vec<String> = (1..=self.lowers.len())
            .map(|i| format!("vk-solo-{i}"))
            .collect();
        let mut processes = Vec::new();
        for (node, lower) in solo.iter().zip(self.lowers) {
            let mut options = VirtualNodeOptions::new(self.binary, node);
            options.lower_kubeconfig = Some(lower.kubeconfig.clone());
            options.args = self.rate.to_vec();
            processes.push(self.pair.start_virtual_node(&options)?);
        }
        all_ready(self.upper, &solo).await?;
        let idle = settled_rss(&processes.iter().collect::<Vec<_>>()).await?;
        Ok((processes, solo, idle))
    }

    /// A measured burst on `nodes`, served by `processes`, its pods deleted after (they
    /// leave as users delete them, while their processes still run).
    async fn burst(
        &self,
        processes: &[&VirtualNode],
        nodes: &[String],
        prefix: &str,
    ) -> Result<Side> {
        let (side, ns) = measure(
            self.upper,
            self.lowers,
            processes,
            nodes,
            self.per_member,
            self.pace(),
            prefix,
        )
        .await?;
        clean(self.upper, self.lowers, &ns, self.per_member * nodes.len()).await?;
        Ok(Side {
            watches: side.watches.saturating_sub(self.watches_before),
            ..side
        })
    }

    /// One process: started, a warm-up, the burst, then the isolation scenario.
    async fn federated(&self) -> Result<Federated> {
        let (upper, lowers, per_member) = (self.upper, self.lowers, self.per_member);
        let clusters = lowers.len();
        let one = self.start_federated().await?;
        let members = &one.members;
        warm_up(
            upper,
            lowers,
            members,
            per_member,
            self.args.concurrency,
            "fed",
        )
        .await?;
        let federated = self.burst(&[&one.process], members, "fed").await?;
        let federated = Side {
            idle: one.idle,
            ..federated
        };
        // Isolation: the other members burst again, with the first member's lower API server
        // frozen (SIGSTOP) and without, in the same process.
        let isolation = if clusters > 1 {
            let others = &members[1..];
            let mut p99 = Vec::new();
            for frozen in [false, true] {
                if frozen {
                    lowers[0].signal(Component::ApiServer, Signal::SIGSTOP)?;
                }
                let prefix = if frozen { "frozen" } else { "calm" };
                let burst = measure(
                    upper,
                    &lowers[1..],
                    &[&one.process],
                    others,
                    per_member,
                    self.pace(),
                    prefix,
                )
                .await;
                if frozen {
                    lowers[0].signal(Component::ApiServer, Signal::SIGCONT)?;
                }
                let (side, ns) = burst?;
                clean(upper, &lowers[1..], &ns, per_member * others.len()).await?;
                p99.push(side.p99);
            }
            Some((p99[0], p99[1]))
        } else {
            None
        };
        Ok(Federated {
            side: federated,
            isolation,
            idle_member: one.idle_member(clusters),
            one_member: one.one_member,
        })
    }

    /// N processes: started, a warm-up, the burst.
    async fn separate(&self) -> Result<Side> {
        let (processes, solo, idle) = self.start_separate().await?;
        let (upper, lowers) = (self.upper, self.lowers);
        warm_up(
            upper,
            lowers,
            &solo,
            self.per_member,
            self.args.concurrency,
            "solo",
        )
        .await?;
        let refs: Vec<&VirtualNode> = processes.iter().collect();
        let separate = self.burst(&refs, &solo, "solo").await?;
        Ok(Side { idle, ..separate })
    }

    /// Both ways running side by side on the same clusters, warmed up, then two bursts
    /// each over both ways' nodes at once (`--side-by-side`): a pod for each node of the
    /// one process, then one for each of the N processes', and again, so that both ways
    /// take the same arrivals at the same moment from the same API servers. Answers the
    /// two bursts' (one process, N processes) and the one process's start.
    async fn side_by_side(&self) -> Result<(Vec<(Side, Side)>, OneProcess)> {
        let (upper, lowers, per_member) = (self.upper, self.lowers, self.per_member);
        let one = self.start_federated().await?;
        let watches_one = open_watches(upper)
            .await?
            .saturating_sub(self.watches_before);
        let (processes, solo, _) = self.start_separate().await?;
        let watches_all = open_watches(upper)
            .await?
            .saturating_sub(self.watches_before);
        let refs: Vec<&VirtualNode> = processes.iter().collect();
        let all_nodes: Vec<String> = one.members.iter().chain(&solo).cloned().collect();
        let concurrency = self.args.concurrency;
        warm_up(upper, lowers, &all_nodes, per_member, concurrency, "both").await?;
        let groups = [
            Group {
                processes: &[&one.process],
                nodes: &one.members,
            },
            Group {
                processes: &refs,
                nodes: &solo,
            },
        ];
        let mut bursts = Vec::new();
        for round in 1..=2 {
            let prefix = format!("both-{round}");
            let (mut sides, ns) =
                measure_groups(upper, lowers, &groups, per_member, self.pace(), &prefix).await?;
            clean(upper, lowers, &ns, 2 * per_member * lowers.len()).await?;
            let separate = sides.pop().context("two groups")?;
            let federated = sides.pop().context("two groups")?;
            bursts.push((
                Side {
                    watches: watches_one,
                    ..federated
                },
                Side {
                    watches: watches_all.saturating_sub(watches_one),
                    ..separate
                },
            ));
        }
        Ok((bursts, one))
    }
}

/// The one process, started with its members.
struct OneProcess {
    process: VirtualNode,
    members: Vec<String>,
    /// Resident memory with one member (bytes).
    one_member: u64,
    /// Resident memory with every member, idle (bytes).
    idle: u64,
}

impl OneProcess {
    /// Resident memory one more idle member adds (bytes).
    fn idle_member(&self, clusters: usize) -> f64 {
        (self.idle as f64 - self.one_member as f64) / (clusters.max(2) - 1) as f64
    }
}

/// Joins each of `members` for the lower cluster beside it in `lowers`, as members of
/// [`MEMBERS_NAMESPACE`].
pub(super) async fn join_all(
    binary: &Path,
    pair: &ClusterPair,
    members: &[String],
    lowers: &[&Cluster],
) -> Result<()> {
    for (node, lower) in members.iter().zip(lowers) {
        join_member(
            binary,
            &pair.upper.kubeconfig,
            &lower.kubeconfig,
            node,
            MEMBERS_NAMESPACE,
        )
        .await?;
    }
    Ok(())
}

/// The pair and the `clusters - 1` further lower clusters, each with room for `pods` pods.
pub(super) async fn start_clusters(
    clusters: usize,
    pods: usize,
) -> Result<(ClusterPair, Vec<Cluster>)> {
    let options = super::lower_for(pods);
    let (lower_nodes, shape, inflight) = (
        options.lower.nodes,
        options.lower.node_shape.clone(),
        options.lower.apiserver_args.clone(),
    );
    eprintln!(
        "starting {clusters} lower cluster(s) of {lower_nodes} kwok nodes and the upper one ..."
    );
    let pair = ClusterPair::start(options).await?;
    let mut extra = Vec::new();
    for i in 2..=clusters {
        let octet = u8::try_from(100 + i)?;
        let mut cluster = ClusterOptions::new(
            &format!("lower-{i}"),
            lower_nodes,
            (Ipv4Addr::new(10, octet, 0, 0), 16),
            &format!("10.{}.0.0/16", 130 + i),
        );
        cluster.node_shape = shape.clone();
        cluster.apiserver_args.clone_from(&inflight);
        extra.push(pair.start_cluster(cluster).await?);
    }
    Ok((pair, extra))
}

/// virtual-node's request budget on both sides (`qps`, burst twice that) and its log level.
pub(super) fn rate_args(qps: u32) -> Vec<String> {
    vec![
        "--client-qps".to_owned(),
        qps.to_string(),
        "--client-burst".into(),
        (2 * qps).to_string(),
        "--kube-api-qps".into(),
        qps.to_string(),
        "--kube-api-burst".into(),
        (2 * qps).to_string(),
        "--log-level".into(),
        "warn".into(),
    ]
}

/// The one process serving every member of [`MEMBERS_NAMESPACE`] (`--runtime-workers`
/// as its tokio workers).
pub(super) fn start_one_process(
    pair: &ClusterPair,
    binary: &Path,
    args: &Args,
    rate: &[String],
) -> Result<VirtualNode> {
    let mut options = VirtualNodeOptions::new(binary, "vk-fed");
    options.flags_member = false;
    if let Some(workers) = args.runtime_workers {
        options
            .envs
            .push(("TOKIO_WORKER_THREADS".into(), workers.to_string()));
    }
    options.args = ["--members-namespace", MEMBERS_NAMESPACE]
        .iter()
        .map(ToString::to_string)
        .chain(rate.iter().cloned())
        .collect();
    pair.start_virtual_node(&options)
}

/// Deletes the `pods` pods of namespace `ns` upstairs and waits until they are gone from
/// every lower cluster too.
async fn clean(upper: &Client, lowers: &[&Cluster], ns: &str, pods: usize) -> Result<()> {
    for lower in lowers {
        delete_and_wait(upper, &lower.client().await?, ns, pods).await?;
    }
    Ok(())
}

/// A burst of a quarter of `per_node` pods on each of `nodes`, deleted once Running:
/// each way's measured burst then finds the API servers, kwok and its own processes warm
/// (connections open, caches and heaps grown), whichever way runs first. Without it the
/// way measured first, on clusters just started, was the slower (N = 5 on 2 cores: the
/// one process's 1000-pod p99 10.6 s, its next 800-pod burst 6.5 s, the N processes'
/// 7.2 s after it).
async fn warm_up(
    upper: &Client,
    lowers: &[&Cluster],
    nodes: &[String],
    per_node: usize,
    concurrency: usize,
    prefix: &str,
) -> Result<()> {
    let per_node = per_node.div_ceil(4);
    let pods = bound_pods(nodes, 0..per_node, "-warm");
    let (ns, _, _) = burst(upper, &format!("{prefix}-warm"), pods, concurrency).await?;
    clean(upper, lowers, &ns.name, per_node * nodes.len()).await
}

/// Pods `range` bound to each of `nodes`, named `<node><tag>-<i>`, interleaved by node.
pub(super) fn bound_pods(nodes: &[String], range: Range<usize>, tag: &str) -> Vec<Pod> {
    range
        .flat_map(|i| {
            nodes
                .iter()
                .map(move |node| labelled(bound_pod(&format!("{node}{tag}-{i:05}"), node)))
        })
        .collect()
}

/// Waits for every node of `nodes` to be Ready.
pub(super) async fn all_ready(upper: &Client, nodes: &[String]) -> Result<()> {
    let api: Api<Node> = Api::all(upper.clone());
    for node in nodes {
        wait_for(
            &format!("node {node} Ready"),
            Duration::from_secs(120),
            || async { Ok(api.get_opt(node).await?.filter(node_is_ready).map(|_| ())) },
        )
        .await?;
    }
    Ok(())
}

/// The processes' resident memory together, once it has stopped growing (two readings a
/// second apart within 1 %, or after 20 s).
pub(super) async fn settled_rss(processes: &[&VirtualNode]) -> Result<u64> {
    let read = || -> Result<u64> {
        processes
            .iter()
            .map(|p| footprint(p.pid()).map(|(rss, _, _)| rss))
            .sum()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut last = read()?;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = read()?;
        if now.abs_diff(last) * 100 <= last || Instant::now() >= deadline {
            return Ok(now);
        }
        last = now;
    }
}

fn cpu(processes: &[&VirtualNode]) -> Result<f64> {
    processes
        .iter()
        .map(|p| footprint(p.pid()).map(|(_, _, cpu)| cpu))
        .sum()
}

/// Idle memory and watches, then `per_node` pods bound to each of `nodes` created at once
/// (one namespace, at `pace`): reflection latency, CPU and memory.
async fn measure(
    upper: &Client,
    lowers: &[&Cluster],
    processes: &[&VirtualNode],
    nodes: &[String],
    per_node: usize,
    pace: Pace,
    prefix: &str,
) -> Result<(Side, String)> {
    let (mut sides, ns) = measure_groups(
        upper,
        lowers,
        &[Group { processes, nodes }],
        per_node,
        pace,
        prefix,
    )
    .await?;
    Ok((sides.remove(0), ns))
}

/// Whether the bench pod `name` (`<node>-<index>`, [`bound_pods`]) is bound to one of
/// `nodes`.
fn bound_to_one_of(nodes: &[String], name: &str) -> bool {
    nodes.iter().any(|node| {
        name.strip_prefix(node.as_str())
            .and_then(|rest| rest.strip_prefix('-'))
            .is_some_and(|index| index.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// Processes and the nodes they serve, measured together in a burst.
struct Group<'a> {
    processes: &'a [&'a VirtualNode],
    nodes: &'a [String],
}

/// As [`measure`], one burst over the nodes of every group at once (each pod index's pods
/// created node after node, the groups' in turn), with each group's figures apart: the
/// same arrivals, API servers and moment for every group.
async fn measure_groups(
    upper: &Client,
    lowers: &[&Cluster],
    groups: &[Group<'_>],
    per_node: usize,
    pace: Pace,
    prefix: &str,
) -> Result<(Vec<Side>, String)> {
    let mut idle = Vec::new();
    for group in groups {
        idle.push(settled_rss(group.processes).await?);
    }
    let watches = open_watches(upper).await?;
    let quiet = machine_quiet().await?;
    let all_nodes: Vec<String> = groups
        .iter()
        .flat_map(|g| g.nodes.iter().cloned())
        .collect();
    let pods = bound_pods(&all_nodes, 0..per_node, "");
    let mut before = Vec::new();
    for group in groups {
        let processes = group.processes;
        before.push((
            scrape_all(processes).await?,
            run_queue_seconds(processes),
            cpu(processes)?,
        ));
    }
    let below = Shared::default();
    let mut trackers = Vec::new();
    for lower in lowers {
        let every_namespace: Api<Pod> = Api::all(lower.client().await?);
        trackers.push(track_running(every_namespace, "bench=1", below.clone()));
    }
    let started = Instant::now();
    let burst = burst(upper, prefix, pods, pace).await;
    trackers.iter().for_each(tokio::task::JoinHandle::abort);
    let (ns, _, upstairs) = burst?;
    let (upstairs, below) = (
        std::mem::take(&mut *lock(&upstairs)),
        std::mem::take(&mut *lock(&below)),
    );
    let mut sides = Vec::new();
    for (group, (metrics_before, queued_before, cpu_before)) in groups.iter().zip(before) {
        let processes = group.processes;
        let cpu_after = cpu(processes)?;
        let queued = run_queue_seconds(processes) - queued_before;
        let waits = waits(&metrics_before, &scrape_all(processes).await?, queued);
        let ours = |name: &str| bound_to_one_of(group.nodes, name);
        let (upstairs, below) = (upstairs.only(ours), below.only(ours));
        let latencies = latencies(&upstairs, started);
        sides.push(Side {
            idle: 0,
            loaded: 0,
            cpu: cpu_after - cpu_before,
            p50: latencies.p50,
            p99: latencies.p99,
            total: latencies.total,
            watches,
            waits,
            workers: runtime_workers(processes),
            stages: Stages::of(&upstairs, &below),
            quiet,
        });
    }
    for ((side, group), idle) in sides.iter_mut().zip(groups).zip(idle) {
        side.idle = idle;
        side.loaded = settled_rss(group.processes).await?;
    }
    Ok((sides, ns.name))
}

/// The watches open on the upper API server, every resource's and client's together
/// (`apiserver_longrunning_requests{verb="WATCH"}`).
async fn open_watches(upper: &Client) -> Result<u64> {
    let request = http::Request::get("/metrics").body(Vec::new())?;
    let text = upper.request_text(request).await?;
    let open: f64 = text
        .lines()
        .filter(|l| {
            l.starts_with("apiserver_longrunning_requests{") && l.contains("verb=\"WATCH\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    Ok(open as u64)
}

/// The histograms of where a pod waits, as the bench prints them: (row, series name,
/// label that selects the series, empty for none).
const WAIT_ROWS: [(&str, &str, &str); 12] = [
    (
        "shared upper pod watch: decode + route an event",
        "tensile_upper_pod_watch_event_seconds",
        "",
    ),
    (
        "pod queue: ready -> taken by a worker",
        "tensile_queue_wait_seconds",
        "queue=\"pod queue\"",
    ),
    (
        "status queue: ready -> taken by a worker",
        "tensile_queue_wait_seconds",
        "queue=\"status queue\"",
    ),
    (
        "pod reconcile",
        "tensile_reconcile_duration_seconds",
        "controller=\"pod\"",
    ),
    (
        "status reconcile",
        "tensile_reconcile_duration_seconds",
        "controller=\"status\"",
    ),
    (
        "upper request: held by the rate limiter",
        "tensile_api_throttle_seconds",
        "cluster=\"upper\"",
    ),
    (
        "upper request: sent -> answered",
        "tensile_api_request_seconds",
        "cluster=\"upper\"",
    ),
    (
        "upper: new connection (TCP + TLS)",
        "tensile_api_connect_seconds",
        "cluster=\"upper\"",
    ),
    (
        "lower request: held by the rate limiter",
        "tensile_api_throttle_seconds",
        "cluster=\"lower\"",
    ),
    (
        "lower request: sent -> answered",
        "tensile_api_request_seconds",
        "cluster=\"lower\"",
    ),
    (
        "lower: new connection (TCP + TLS)",
        "tensile_api_connect_seconds",
        "cluster=\"lower\"",
    ),
    (
        "runtime: a woken task waits for a worker",
        "tensile_runtime_lag_seconds",
        "",
    ),
];

/// One histogram's change over a burst.
#[derive(Debug, Default, PartialEq)]
struct Histogram {
    count: f64,
    sum: f64,
    /// (upper bound, cumulative count), by bound.
    buckets: Vec<(f64, f64)>,
}

impl Histogram {
    /// The series `name` whose labels include `label` (all when empty), as it changed
    /// from `before` to `after` (scrapes, every process's summed).
    fn delta(
        before: &BTreeMap<String, f64>,
        after: &BTreeMap<String, f64>,
        name: &str,
        label: &str,
    ) -> Self {
        let change = |series: &str| {
            after.get(series).copied().unwrap_or(0.0) - before.get(series).copied().unwrap_or(0.0)
        };
        let matches = |series: &str, suffix: &str| {
            series
                .strip_prefix(name)
                .and_then(|s| s.strip_prefix(suffix))
                .is_some_and(|rest| {
                    rest.is_empty() || (rest.starts_with('{') && rest.contains(label))
                })
        };
        let mut histogram = Self::default();
        let mut buckets = BTreeMap::<u64, (f64, f64)>::new();
        for series in after.keys() {
            if matches(series, "_count") {
                histogram.count += change(series);
            } else if matches(series, "_sum") {
                histogram.sum += change(series);
            } else if matches(series, "_bucket")
                && let Some(le) = series
                    .split_once("le=\"")
                    .and_then(|(_, rest)| rest.split_once('"'))
                    .and_then(|(le, _)| le.parse::<f64>().ok())
            {
                buckets.entry(le.to_bits()).or_insert((le, 0.0)).1 += change(series);
            }
        }
        histogram.buckets = buckets.into_values().collect();
        histogram
            .buckets
            .sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
        histogram
    }

    /// The mean, seconds.
    fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }

    /// The `q` quantile, seconds, interpolated within its bucket as Prometheus'
    /// `histogram_quantile` does; the largest finite bound when it falls in `+Inf`.
    fn quantile(&self, q: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = q * self.count;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(bound, cumulative) in &self.buckets {
            if cumulative >= rank {
                if bound.is_infinite() {
                    return Some(lower);
                }
                let within = cumulative - below;
                let share = if within > 0.0 {
                    (rank - below) / within
                } else {
                    1.0
                };
                return Some(lower + (bound - lower) * share);
            }
            (lower, below) = (bound, cumulative);
        }
        Some(lower)
    }

    /// `count, mean / p99` for the table.
    fn cell(&self) -> String {
        match (self.mean(), self.quantile(0.99)) {
            (Some(mean), Some(p99)) => format!(
                "{:.0}, {:.1} / {:.1} ms, sum {:.1} s",
                self.count,
                mean * 1000.0,
                p99 * 1000.0,
                self.sum
            ),
            _ => "-".into(),
        }
    }
}

/// Where the pods waited during one burst: the processes' wait histograms, and the time
/// their threads were runnable but not run by the OS.
#[derive(Debug, Default)]
struct Waits {
    histograms: Vec<Histogram>,
    /// Seconds the processes' threads waited on a run queue (`/proc/<pid>/task/*/schedstat`).
    run_queue: f64,
    /// Upper requests answered 429 (throttled by the API server).
    upper_429: f64,
}

/// The processes' tokio threads (the workers and the blocking pool's: `tokio-rt-worker`,
/// `tokio-runtime-worker` in older tokio), together.
fn runtime_workers(processes: &[&VirtualNode]) -> usize {
    processes
        .iter()
        .filter_map(|p| std::fs::read_dir(format!("/proc/{}/task", p.pid())).ok())
        .flat_map(|tasks| tasks.flatten())
        .filter(|task| {
            std::fs::read_to_string(task.path().join("comm")).is_ok_and(|comm| {
                comm.starts_with("tokio-rt-worker") || comm.starts_with("tokio-runtime-w")
            })
        })
        .count()
}

/// Every process's metrics, summed by series.
async fn scrape_all(processes: &[&VirtualNode]) -> Result<BTreeMap<String, f64>> {
    let mut sum = BTreeMap::new();
    for process in processes {
        for (series, value) in scrape(process.metrics_port).await? {
            *sum.entry(series).or_insert(0.0) += value;
        }
    }
    Ok(sum)
}

/// Seconds the processes' threads have spent runnable but waiting for a CPU (the second
/// figure of `/proc/<pid>/task/<tid>/schedstat`; threads that ended are not counted).
fn run_queue_seconds(processes: &[&VirtualNode]) -> f64 {
    let mut nanos = 0u64;
    for process in processes {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", process.pid())) else {
            continue;
        };
        for task in tasks.flatten() {
            let waited = std::fs::read_to_string(task.path().join("schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok());
            nanos += waited.unwrap_or(0);
        }
    }
    nanos as f64 / 1e9
}

fn waits(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>, run_queue: f64) -> Waits {
    let upper_429 = after
        .iter()
        .filter(|(series, _)| {
            series.starts_with("tensile_api_responses_total{")
                && series.contains("cluster=\"upper\"")
                && series.contains("code=\"429\"")
        })
        .map(|(series, value)| value - before.get(series).copied().unwrap_or(0.0))
        .sum();
    Waits {
        histograms: WAIT_ROWS
            .iter()
            .map(|(_, name, label)| Histogram::delta(before, after, name, label))
            .collect(),
        run_queue,
        upper_429,
    }
}

/// Where the pods waited during the burst, both ways: one row per wait histogram (its
/// count, mean and p99 over the burst), the OS run-queue wait and the upper 429s.
fn print_waits(federated: &Waits, separate: &Waits) {
    println!("  where a pod waits during the burst (count, mean / p99; every process's summed):");
    for ((what, _, _), (one, many)) in WAIT_ROWS
        .iter()
        .zip(federated.histograms.iter().zip(&separate.histograms))
    {
        println!("    {what:<42} {:>34} {:>34}", one.cell(), many.cell());
    }
    println!(
        "    {:<42} {:>34} {:>34}",
        "threads runnable, not run by the OS",
        format!("{:.1} s", federated.run_queue),
        format!("{:.1} s", separate.run_queue)
    );
    println!(
        "    {:<42} {:>34} {:>34}",
        "upper answers 429 (API server throttled)",
        federated.upper_429.to_string(),
        separate.upper_429.to_string()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_belongs_to_its_own_node_only() {
        let nodes = |names: &[&str]| names.iter().map(ToString::to_string).collect::<Vec<_>>();
        // (nodes, pod, bound to one of them)
        let cases = [
            (nodes(&["vk-fed-1"]), "vk-fed-1-00007", true),
            (nodes(&["vk-fed-1"]), "vk-fed-10-00007", false),
            (nodes(&["vk-fed-1", "vk-fed-10"]), "vk-fed-10-00007", true),
            (nodes(&["vk-solo-1"]), "vk-fed-1-00007", false),
            (nodes(&["vk-fed-1"]), "vk-fed-1-warm-00007", false),
            (nodes(&[]), "vk-fed-1-00007", false),
        ];
        for (nodes, pod, want) in cases {
            assert_eq!(bound_to_one_of(&nodes, pod), want, "{pod} on {nodes:?}");
        }
    }

    #[test]
    fn busy_cores_from_two_readings() {
        let line = "cpu  100 0 50 800 50 0 0 0 0 0";
        assert_eq!(ticks(line), (1000, 850));
        // (before, after, cores, busy)
        let cases = [
            ((1000, 850), (1200, 950), 2, 1.0),
            ((1000, 850), (1200, 1050), 2, 0.0),
            ((1000, 850), (1200, 850), 4, 4.0),
            ((1000, 850), (1000, 850), 2, 0.0),
        ];
        for (before, after, cores, want) in cases {
            assert!(
                (busy_cores(before, after, cores) - want).abs() < 1e-9,
                "{before:?} {after:?}"
            );
        }
    }

    #[test]
    fn stages_are_measured_pod_by_pod() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let times = |pairs: &[(&str, u64)]| {
            pairs
                .iter()
                .map(|(name, ms)| (name.to_string(), at(*ms)))
                .collect::<HashMap<_, _>>()
        };
        let upstairs = Timeline {
            created: times(&[("a", 0), ("b", 10)]),
            seen: times(&[("a", 5), ("b", 30)]),
            running: times(&[("a", 100), ("b", 200)]),
        };
        // Pod b never seen below: its later stages are not counted.
        let below = Timeline {
            created: HashMap::new(),
            seen: times(&[("a", 20)]),
            running: times(&[("a", 60)]),
        };
        let stages = Stages::of(&upstairs, &below);
        let ms = Duration::from_millis;
        assert_eq!(stages.created, (ms(5), ms(20)));
        assert_eq!(stages.mirrored, (ms(15), ms(15)));
        assert_eq!(stages.started_below, (ms(40), ms(40)));
        assert_eq!(stages.reflected, (ms(40), ms(40)));
        let only_b = upstairs.only(|name| name == "b");
        assert_eq!(only_b.created.len(), 1);
        assert_eq!(only_b.running.get("b"), Some(&at(200)));
    }

    fn series(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
    }

    #[test]
    fn histogram_deltas_and_quantiles() {
        let before = series(&[
            ("w_bucket{q=\"a\",le=\"0.1\"}", 1.0),
            ("w_bucket{q=\"a\",le=\"1.0\"}", 1.0),
            ("w_bucket{q=\"a\",le=\"+Inf\"}", 1.0),
            ("w_sum{q=\"a\"}", 0.05),
            ("w_count{q=\"a\"}", 1.0),
        ]);
        let after = series(&[
            ("w_bucket{q=\"a\",le=\"0.1\"}", 51.0),
            ("w_bucket{q=\"a\",le=\"1.0\"}", 101.0),
            ("w_bucket{q=\"a\",le=\"+Inf\"}", 101.0),
            ("w_sum{q=\"a\"}", 25.05),
            ("w_count{q=\"a\"}", 101.0),
            // Another label and another name: not counted.
            ("w_count{q=\"b\"}", 7.0),
            ("w_total_count{q=\"a\"}", 7.0),
        ]);
        let h = Histogram::delta(&before, &after, "w", "q=\"a\"");
        assert_eq!(h.count, 100.0);
        assert_eq!(h.buckets.len(), 3);
        let cases = [
            (0.5, Some(0.1)),
            (0.25, Some(0.05)),
            (0.99, Some(0.1 + 0.9 * 49.0 / 50.0)),
        ];
        for (q, want) in cases {
            let got = h.quantile(q);
            assert!(
                (got.unwrap_or(-1.0) - want.unwrap_or(-1.0)).abs() < 1e-9,
                "{q}: {got:?}"
            );
        }
        assert!((h.mean().unwrap_or(0.0) - 0.25).abs() < 1e-9);
        // Past the largest finite bound: that bound.
        let inf = series(&[
            ("w_bucket{le=\"1\"}", 0.0),
            ("w_bucket{le=\"+Inf\"}", 10.0),
            ("w_count", 10.0),
            ("w_sum", 50.0),
        ]);
        let h = Histogram::delta(&BTreeMap::new(), &inf, "w", "");
        assert_eq!(h.quantile(0.99), Some(1.0));
        assert_eq!(Histogram::default().quantile(0.99), None);
        assert_eq!(Histogram::default().cell(), "-");
    }
}
