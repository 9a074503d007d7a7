//! `tensile-bench --lower-nodes N`: one member whose lower cluster has N kwok nodes,
//! joined first as one virtual node (`--node-granularity cluster`, the reference) and then
//! as one virtual node per lower node (`--node-granularity node`), in one run on the same
//! clusters (issue #36). Each way: time from start until every virtual node is Ready,
//! virtual-node's resident memory (and, for `node`, what each virtual node adds over the
//! reference), upper writes a second at rest (Leases renewed, node status only on change),
//! and a burst of `--pods` pods bound round-robin to the virtual nodes: pod created →
//! Running upstairs, p50 / p99, and virtual-node's CPU seconds.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Client;
use kube::api::{Api, ListParams};
use tensile_harness::fixtures::bound_pod;
use tensile_harness::measure::{footprint, scrape};
use tensile_harness::{ClusterPair, NodeShape, VirtualNode, node_is_ready};

use super::{Args, burst, delete_and_wait, labelled, lower_for, ms, node_options};

const KIB: f64 = 1024.0;
const MIB: f64 = 1024.0 * 1024.0;
/// How long the bench counts upper writes with every node Ready and no pod moving.
const AT_REST: Duration = Duration::from_secs(60);

/// What one granularity measured.
struct Side {
    nodes: usize,
    ready_after: Duration,
    idle_rss: u64,
    writes_per_second: f64,
    loaded_rss: u64,
    cpu: f64,
    p50: Duration,
    p99: Duration,
    total: Duration,
}

/// Runs both granularities over one lower cluster of `lower_nodes` kwok nodes.
pub async fn run(binary: &Path, lower_nodes: usize, args: &Args) -> Result<()> {
    let mut options = lower_for(args.pods);
    options.lower.nodes = lower_nodes;
    // Room for the burst on any one node, as the cluster-granularity reference offers it.
    options.lower.node_shape = NodeShape {
        cpu: "64".into(),
        memory: "256Gi".into(),
        pods: args
            .pods
            .div_ceil(lower_nodes)
            .saturating_mul(2)
            .max(110)
            .to_string(),
    };
    eprintln!("starting the upper cluster and a lower one of {lower_nodes} kwok nodes ...");
    let pair = ClusterPair::start(options).await?;
    let upper = pair.upper.client().await?;
    let reference = side(&pair, &upper, binary, args, ("cluster", 1), "vk-one").await?;
    let each = side(
        &pair,
        &upper,
        binary,
        args,
        ("node", lower_nodes),
        "vk-each",
    )
    .await?;

    println!();
    println!(
        "one member, {lower_nodes} lower kwok nodes, {} pods, {} at a time ({} build)",
        args.pods,
        args.concurrency,
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );
    println!(
        "  {:<44} {:>18} {:>18}",
        "", "cluster (1 node)", "node (1 per lower)"
    );
    let row = |what: &str, a: String, b: String| println!("  {what:<44} {a:>18} {b:>18}");
    row(
        "virtual nodes",
        reference.nodes.to_string(),
        each.nodes.to_string(),
    );
    row(
        "start → every virtual node Ready",
        ms(reference.ready_after),
        ms(each.ready_after),
    );
    row(
        "resident memory, idle",
        format!("{:.1} MiB", reference.idle_rss as f64 / MIB),
        format!("{:.1} MiB", each.idle_rss as f64 / MIB),
    );
    let per_node =
        (each.idle_rss as f64 - reference.idle_rss as f64) / (each.nodes.max(2) - 1) as f64;
    row(
        "  what one more virtual node costs",
        "-".into(),
        format!("{:.1} KiB", per_node / KIB),
    );
    row(
        &format!("upper writes/s at rest ({} s)", AT_REST.as_secs()),
        format!("{:.2}", reference.writes_per_second),
        format!("{:.2}", each.writes_per_second),
    );
    row(
        "  of which Lease renewals expected (n / 10 s)",
        format!("{:.2}", reference.nodes as f64 / 10.0),
        format!("{:.2}", each.nodes as f64 / 10.0),
    );
    row(
        "burst: pod created → Running p50",
        ms(reference.p50),
        ms(each.p50),
    );
    row("burst: p99", ms(reference.p99), ms(each.p99));
    row(
        "burst: last pod Running after",
        ms(reference.total),
        ms(each.total),
    );
    row(
        "burst: virtual-node CPU",
        format!("{:.1} s", reference.cpu),
        format!("{:.1} s", each.cpu),
    );
    row(
        "resident memory, every pod Running",
        format!("{:.1} MiB", reference.loaded_rss as f64 / MIB),
        format!("{:.1} MiB", each.loaded_rss as f64 / MIB),
    );
    Ok(())
}

/// Starts virtual-node `node` with `granularity` (which makes `want` virtual nodes), measures, and stops it with its pods
/// deleted from both clusters.
async fn side(
    pair: &ClusterPair,
    upper: &Client,
    binary: &Path,
    args: &Args,
    (granularity, want): (&str, usize),
    node: &str,
) -> Result<Side> {
    eprintln!("--node-granularity {granularity}: starting {node} ...");
    let options = node_options(binary, args, node, &["--node-granularity", granularity]);
    let started = Instant::now();
    let mut vn = pair.start_virtual_node(&options)?;
    let nodes = ready_nodes(upper, &vn, node, want).await?;
    let ready_after = started.elapsed();
    let idle_rss = settled_rss(&vn).await?;
    let before = scrape(vn.metrics_port).await?;
    tokio::time::sleep(AT_REST).await;
    let after = scrape(vn.metrics_port).await?;
    let writes_per_second = upper_writes(&after, &before) / AT_REST.as_secs_f64();

    let pods: Vec<Pod> = (0..args.pods)
        .map(|i| {
            let target = &nodes[i % nodes.len()];
            labelled(bound_pod(&format!("p-{i:06}"), target))
        })
        .collect();
    let cpu_before = footprint(vn.pid())?.2;
    let (ns, latencies, _) = burst(
        upper,
        &format!("bench-{granularity}"),
        pods,
        args.concurrency,
    )
    .await?;
    let cpu = footprint(vn.pid())?.2 - cpu_before;
    let loaded_rss = settled_rss(&vn).await?;
    delete_and_wait(upper, &pair.lower.client().await?, &ns.name, args.pods).await?;
    vn.stop()?;
    Ok(Side {
        nodes: nodes.len(),
        ready_after,
        idle_rss,
        writes_per_second,
        loaded_rss,
        cpu,
        p50: latencies.p50,
        p99: latencies.p99,
        total: latencies.total,
    })
}

/// Waits until `want` Ready virtual nodes of `vn` exist upstairs (the node itself, or the
/// nodes whose name starts with it), and returns their names.
async fn ready_nodes(
    upper: &Client,
    vn: &VirtualNode,
    prefix: &str,
    want: usize,
) -> Result<Vec<String>> {
    let api: Api<Node> = Api::all(upper.clone());
    let deadline = Instant::now() + Duration::from_secs(1800);
    let mut last = 0;
    loop {
        let list = api
            .list(&ListParams::default().labels("type=virtual-kubelet"))
            .await?;
        let ready: Vec<String> = list
            .items
            .iter()
            .filter(|n| node_is_ready(n))
            .filter_map(|n| n.metadata.name.clone())
            .filter(|name| name == prefix || name.starts_with(&format!("{prefix}-")))
            .collect();
        if ready.len() >= want {
            return Ok(ready);
        }
        if ready.len() != last {
            eprintln!("  {} of {want} virtual nodes Ready", ready.len());
            last = ready.len();
        }
        if Instant::now() >= deadline {
            bail!(
                "{} of {want} virtual nodes of {} Ready after 30 min",
                ready.len(),
                vn.node_name
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// virtual-node's resident memory once it has stopped growing (two readings a second apart
/// within 1 %, or after 30 s).
async fn settled_rss(vn: &VirtualNode) -> Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = footprint(vn.pid())?.0;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = footprint(vn.pid())?.0;
        if now.abs_diff(last) * 100 <= last || Instant::now() >= deadline {
            return Ok(now);
        }
        last = now;
    }
}

/// Upper writes (create, update, patch, delete) between two scrapes of virtual-node.
fn upper_writes(after: &BTreeMap<String, f64>, before: &BTreeMap<String, f64>) -> f64 {
    ["create", "update", "patch", "delete"]
        .iter()
        .map(|verb| {
            let key = format!("tensile_api_requests_total{{cluster=\"upper\",verb=\"{verb}\"}}");
            after.get(&key).unwrap_or(&0.0) - before.get(&key).unwrap_or(&0.0)
        })
        .sum()
}
