//! `tensile-bench --lower-clusters N`: one virtual-node process serving N lower clusters
//! (members joined by `virtual-node join`) against N single-cluster processes side by
//! side, in one run on the same clusters, at the same total of mirrored pods: memory, CPU,
//! what one more idle member costs, status reflection while every member bursts at once,
//! the upper API server's open watches, and isolation: the other members' reflection p99
//! with one member's lower API server frozen, against the same burst without.

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::Api;
use nix::sys::signal::Signal;
use tensile_harness::fixtures::bound_pod;
use tensile_harness::measure::footprint;
use tensile_harness::virtual_node::join_member;
use tensile_harness::{
    Cluster, ClusterOptions, ClusterPair, Component, VirtualNode, VirtualNodeOptions,
    node_is_ready, wait_for,
};

use super::{Args, burst, delete_and_wait, labelled, ms};

const MEMBERS_NAMESPACE: &str = "tensile-bench-members";
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
}

/// Runs the comparison for `clusters` lower clusters and `pods` pods in all.
pub async fn run(binary: &Path, clusters: usize, args: &Args) -> Result<()> {
    let (pods, concurrency, qps) = (args.pods, args.concurrency, args.qps);
    let per_member = pods.div_ceil(clusters);
    // Both ways' pods stay below until the end.
    let options = super::lower_for(2 * per_member);
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
    let lowers: Vec<&Cluster> = std::iter::once(&pair.lower).chain(&extra).collect();
    let upper = pair.upper.client().await?;
    let rate = [
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
    ];
    let watches_before = open_watches(&upper).await?;

    // One process: the first member, then the others (what one more idle member costs).
    let members: Vec<String> = (1..=clusters).map(|i| format!("vk-fed-{i}")).collect();
    join_member(
        binary,
        &pair.upper.kubeconfig,
        &lowers[0].kubeconfig,
        &members[0],
        MEMBERS_NAMESPACE,
    )
    .await?;
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
    let one = pair.start_virtual_node(&options)?;
    all_ready(&upper, &members[..1]).await?;
    let one_member = settled_rss(&[&one]).await?;
    for (node, lower) in members.iter().zip(&lowers).skip(1) {
        join_member(
            binary,
            &pair.upper.kubeconfig,
            &lower.kubeconfig,
            node,
            MEMBERS_NAMESPACE,
        )
        .await?;
    }
    all_ready(&upper, &members).await?;
    let (federated, ns) =
        measure(&upper, &[&one], &members, per_member, concurrency, "fed").await?;
    // The other way starts from the same empty clusters: these pods leave as users delete
    // them, while their process still runs.
    clean(&upper, &lowers, &ns, pods).await?;
    let idle_member = (federated.idle as f64 - one_member as f64) / (clusters.max(2) - 1) as f64;
    let federated = Side {
        watches: federated.watches.saturating_sub(watches_before),
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
            let burst = measure(&upper, &[&one], others, per_member, concurrency, prefix).await;
            if frozen {
                lowers[0].signal(Component::ApiServer, Signal::SIGCONT)?;
            }
            let (side, ns) = burst?;
            clean(&upper, &lowers[1..], &ns, per_member * others.len()).await?;
            p99.push(side.p99);
        }
        Some((p99[0], p99[1]))
    } else {
        None
    };
    drop(one);

    // N processes, one per lower cluster, as tensile-kube runs.
    let solo: Vec<String> = (1..=clusters).map(|i| format!("vk-solo-{i}")).collect();
    let mut processes = Vec::new();
    for (node, lower) in solo.iter().zip(&lowers) {
        let mut options = VirtualNodeOptions::new(binary, node);
        options.lower_kubeconfig = Some(lower.kubeconfig.clone());
        options.args = rate.to_vec();
        processes.push(pair.start_virtual_node(&options)?);
    }
    all_ready(&upper, &solo).await?;
    let refs: Vec<&VirtualNode> = processes.iter().collect();
    let (separate, _) = measure(&upper, &refs, &solo, per_member, concurrency, "solo").await?;
    let separate = Side {
        watches: separate.watches.saturating_sub(watches_before),
        ..separate
    };

    println!(
        "\nfederation: {clusters} lower cluster(s), {} pods in all ({per_member} per cluster), {} cores",
        per_member * clusters,
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
    );
    println!(
        "  {:<44} {:>24} {:>24}",
        "", "one process, N members", "N processes"
    );
    let mib = |bytes: u64| format!("{:.1} MiB", bytes as f64 / MIB);
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
            "burst, until the last pod Running",
            ms(federated.total),
            ms(separate.total),
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
    if clusters > 1 {
        println!(
            "  one more idle member: {:.2} MiB resident (one member {}, {clusters} members {})",
            idle_member / MIB,
            mib(one_member),
            mib(federated.idle)
        );
    }
    if let Some((calm, frozen)) = isolation {
        println!(
            "  isolation: the other {} member(s)' p99 (created -> Running) with member 1's lower API server frozen: {} vs {} without ({:+.0} %)",
            clusters - 1,
            ms(frozen),
            ms(calm),
            (frozen.as_secs_f64() / calm.as_secs_f64().max(1e-9) - 1.0) * 100.0
        );
    }
    drop(processes);
    for cluster in &extra {
        cluster.stop();
    }
    Ok(())
}

/// Deletes the `pods` pods of namespace `ns` upstairs and waits until they are gone from
/// every lower cluster too.
async fn clean(upper: &Client, lowers: &[&Cluster], ns: &str, pods: usize) -> Result<()> {
    for lower in lowers {
        delete_and_wait(upper, &lower.client().await?, ns, pods).await?;
    }
    Ok(())
}

/// Waits for every node of `nodes` to be Ready.
async fn all_ready(upper: &Client, nodes: &[String]) -> Result<()> {
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
async fn settled_rss(processes: &[&VirtualNode]) -> Result<u64> {
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
/// (one namespace, `concurrency` at a time): reflection latency, CPU and memory.
async fn measure(
    upper: &Client,
    processes: &[&VirtualNode],
    nodes: &[String],
    per_node: usize,
    concurrency: usize,
    prefix: &str,
) -> Result<(Side, String)> {
    let idle = settled_rss(processes).await?;
    let watches = open_watches(upper).await?;
    let pods: Vec<Pod> = (0..per_node)
        .flat_map(|i| {
            nodes
                .iter()
                .map(move |node| labelled(bound_pod(&format!("{node}-{i:05}"), node)))
        })
        .collect();
    let cpu_before = cpu(processes)?;
    let (ns, latencies, _) = burst(upper, prefix, pods, concurrency).await?;
    let cpu_after = cpu(processes)?;
    let loaded = settled_rss(processes).await?;
    let side = Side {
        idle,
        loaded,
        cpu: cpu_after - cpu_before,
        p50: latencies.p50,
        p99: latencies.p99,
        total: latencies.total,
        watches,
    };
    Ok((side, ns.name))
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
