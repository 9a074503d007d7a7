//! `tensile-bench --lower-clusters N --member-footprint S1,S2,...`: one virtual-node process
//! serving N members, its memory with S pods mirrored on each member (N × S in all) at
//! each size, and what that projects to for 1 000 000 pods over the N members: the idle
//! process plus 1 000 000 times the resident memory a further pod adds.

use std::path::Path;

use anyhow::Result;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use tensile_harness::measure::{footprint, resident_split, scrape, settle_resident, slope};
use tensile_harness::{Cluster, TestNamespace};

use super::federation::{
    all_ready, bound_pods, join_all, rate_args, settled_rss, start_clusters, start_one_process,
};
use super::{
    Args, Report, Shared, allocator_stats, create_all, heap_by_owner, track_running,
    wait_all_running,
};

const MIB: f64 = 1024.0 * 1024.0;
/// The pods the projection is for.
const PROJECTED_PODS: f64 = 1_000_000.0;

/// Measures the one process of `clusters` members at each of `sizes` pods per member.
pub async fn run(binary: &Path, clusters: usize, sizes: &[usize], args: &Args) -> Result<()> {
    let mut sizes = sizes.to_vec();
    sizes.retain(|s| *s > 0);
    sizes.sort_unstable();
    sizes.dedup();
    let largest = sizes.last().copied().unwrap_or(0);
    let (pair, extra) = start_clusters(clusters, largest).await?;
    let upper = pair.upper.client().await?;
    let members: Vec<String> = (1..=clusters).map(|i| format!("vk-fed-{i}")).collect();
    let lowers: Vec<&Cluster> = std::iter::once(&pair.lower).chain(&extra).collect();
    join_all(binary, &pair, &members, &lowers).await?;
    let one = start_one_process(&pair, binary, args, &rate_args(args.qps))?;
    all_ready(&upper, &members).await?;
    let idle = settled_rss(&[&one]).await?;
    let (_, _, cpu_before) = footprint(one.pid())?;

    println!(
        "\nmember footprint: one process, {clusters} member(s), pods per member {sizes:?}, {} cores",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
    );
    let mut report = Report { rows: Vec::new() };
    report.row(
        "idle (every member's node Ready)",
        "resident memory",
        format!("{:.1} MiB", idle as f64 / MIB),
    );
    let ns = TestNamespace::create(&upper, "bench-members").await?;
    let api: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let timeline = Shared::default();
    let tracker = track_running(api.clone(), "bench=1", timeline.clone());
    // (mirrored pods, resident bytes) and (mirrored pods, jemalloc's statistics) at each size.
    let mut resident: Vec<(f64, f64)> = Vec::new();
    let mut allocator: Vec<(f64, Vec<f64>)> = Vec::new();
    let mut made = 0;
    for size in &sizes {
        let pods = bound_pods(&members, made..*size, "");
        create_all(&api, pods, args.concurrency, &timeline).await?;
        made = *size;
        let total = made * clusters;
        wait_all_running(&timeline, total, &format!("{total} mirrored pods Running")).await?;
        settle_resident(one.pid()).await?;
        let (rss, peak, cpu) = footprint(one.pid())?;
        let metrics = scrape(one.metrics_port).await?;
        resident.push((total as f64, rss as f64));
        allocator.push((total as f64, allocator_stats(&metrics)));
        let label = format!("{made} per member, {total} pods");
        report.row(
            &label,
            "resident / peak memory",
            format!("{:.1} MiB / {:.1} MiB", rss as f64 / MIB, peak as f64 / MIB),
        );
        report.row(
            &label,
            "heap by owner (tensile_memory_bytes) / rest of anonymous",
            heap_by_owner(&metrics, resident_split(one.pid())?.0 as f64)?,
        );
        report.allocator_and_cpu(&label, &allocator, cpu - cpu_before);
    }
    tracker.abort();
    if let Some(per_pod) = slope(&resident) {
        let projected = idle as f64 + PROJECTED_PODS * per_pod;
        report.row(
            &format!("fit over {sizes:?} per member"),
            "resident per further mirrored pod (target <= 1 KB)",
            format!("{:.2} KB", per_pod / 1000.0),
        );
        report.row(
            &format!("projection, {clusters} members"),
            "1 000 000 pods: idle + 1 000 000 x per pod (target <= 1 GiB)",
            format!("{:.0} MiB", projected / MIB),
        );
    }
    println!("\n{} figures.", report.rows.len());
    drop(one);
    for cluster in &extra {
        cluster.stop();
    }
    Ok(())
}
