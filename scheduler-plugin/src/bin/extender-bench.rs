//! extender-bench: filter and prioritize latency over a large pure cache, and the
//! resident memory it takes. Prints figures; not a timed test.
//!
//! Default: 10 virtual nodes, each with a lower cluster of 500 nodes and 20 000 pods, all
//! in cache; every call decodes the JSON body, judges all 10 virtual nodes plus 10 regular
//! ones, and encodes the answer, as the HTTP handler does. A pod with a UID (as
//! kube-scheduler sends) is also assumed in each cluster it passes.
//!
//!     cargo run --release -p tensile-scheduler-extender --bin extender-bench -- [CLUSTERS NODES PODS CALLS]

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::json;
use tensile_scheduler_extender::extender::{Extender, SharedCluster};
use tensile_scheduler_extender::wire;

fn main() -> Result<(), String> {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>());
    let mut next = |default: usize| -> Result<usize, String> {
        args.next()
            .unwrap_or(Ok(default))
            .map_err(|e| format!("usage: extender-bench [CLUSTERS NODES PODS CALLS]: {e}"))
    };
    let (clusters, nodes, pods, calls) = (next(10)?, next(500)?, next(20_000)?, next(2_000)?);
    let rss_before = rss_kib();
    let started = Instant::now();
    let extender = build(clusters, nodes, pods)?;
    let built = started.elapsed();
    let rss_after = rss_kib();

    let mut names: Vec<String> = (0..clusters).map(|c| format!("vk-{c}")).collect();
    names.extend((0..10).map(|r| format!("regular-{r}")));
    let body = |cpu: &str, uid: Option<&str>| {
        json!({
        "Pod": {
            "metadata": {"name": "web-0", "namespace": "default", "uid": uid, "annotations": {
                "clusterSelector": json!({
                    "nodeSelector": {"zone": "zone-1"},
                    "tolerations": [{"key": "dedicated", "operator": "Exists"}],
                }).to_string(),
            }},
            "spec": {
                "initContainers": [{"name": "init", "resources": {"requests": {"cpu": "3"}}}],
                "containers": [{"name": "app", "resources": {"requests": {"cpu": cpu, "memory": "4Gi"}}}],
                "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
            },
        },
        "NodeNames": names,
    })
    .to_string()
    .into_bytes()
    };
    // 2 CPU fits on most nodes: filter stops at the first that takes it. 9 CPU fits on no
    // 8-CPU node: every node of every cluster is checked and a reason written.
    // With a UID the pod passing is assumed in each cluster: one more pass over its nodes
    // for the one the pod most likely gets. The same pod each call: its assumption is
    // replaced, as when kube-scheduler retries a pod.
    let (fits, fits_nowhere) = (body("2", None), body("9", None));
    let assumed_body = body("2", Some("3f0e7c52-0000-4000-8000-000000000001"));

    let mut passed = 0;
    let filter = measure(calls, || {
        let Ok(args) = wire::decode(&fits) else {
            return;
        };
        let (result, _) = extender.filter(&args);
        passed = result.node_names.as_ref().map_or(0, Vec::len);
        let _ = serde_json::to_vec(&result);
    });
    let assumed = measure(calls, || {
        let Ok(args) = wire::decode(&assumed_body) else {
            return;
        };
        let (result, _) = extender.filter(&args);
        let _ = serde_json::to_vec(&result);
    });
    let mut failed = 0;
    let no_fit = measure(calls, || {
        let Ok(args) = wire::decode(&fits_nowhere) else {
            return;
        };
        let (result, _) = extender.filter(&args);
        failed = result.failed_nodes.len() + result.failed_and_unresolvable_nodes.len();
        let _ = serde_json::to_vec(&result);
    });
    let prioritize = measure(calls, || {
        let Ok(args) = wire::decode(&fits) else {
            return;
        };
        let _ = serde_json::to_vec(&extender.prioritize(&args));
    });

    println!(
        "extender-bench: {clusters} virtual nodes x {nodes} lower nodes x {pods} lower pods each \
         ({} nodes, {} pods in cache), {calls} calls per verb, {} of {} nodes pass",
        clusters * nodes,
        clusters * pods,
        passed,
        names.len()
    );
    println!("cache built in {built:.2?}");
    println!(
        "filter      p50 {:>9.3?}  p99 {:>9.3?}  max {:>9.3?}",
        filter.0, filter.1, filter.2
    );
    println!(
        "filter, pod assumed  p50 {:>9.3?}  p99 {:>9.3?}  max {:>9.3?}",
        assumed.0, assumed.1, assumed.2
    );
    println!(
        "filter, no fit ({failed} reasons)  p50 {:>9.3?}  p99 {:>9.3?}  max {:>9.3?}",
        no_fit.0, no_fit.1, no_fit.2
    );
    println!(
        "prioritize  p50 {:>9.3?}  p99 {:>9.3?}  max {:>9.3?}",
        prioritize.0, prioritize.1, prioritize.2
    );
    println!(
        "resident memory: {} MiB with the caches ({} MiB before building them)",
        rss_after / 1024,
        rss_before / 1024
    );
    Ok(())
}

/// (p50, p99, max) of `calls` runs of `f`.
fn measure(calls: usize, mut f: impl FnMut()) -> (Duration, Duration, Duration) {
    let mut times: Vec<Duration> = (0..calls.max(1))
        .map(|_| {
            let started = Instant::now();
            f();
            started.elapsed()
        })
        .collect();
    times.sort();
    let at = |q: f64| times[((times.len() as f64 * q) as usize).min(times.len() - 1)];
    (at(0.50), at(0.99), times[times.len() - 1])
}

/// `clusters` caches of `nodes` nodes (8 CPU, 32Gi, 110 pods; a zone label; every 10th
/// tainted, every 25th cordoned) and `pods` pods spread over them (50–150m CPU each: at
/// 40 pods a node, about half of it taken).
fn build(clusters: usize, nodes: usize, pods: usize) -> Result<Extender, String> {
    let mut extender = Extender::default();
    for c in 0..clusters {
        let cluster = SharedCluster::default();
        {
            let mut state = cluster.write();
            state.nodes_synced = true;
            state.pods_synced = true;
            for n in 0..nodes {
                let mut node = json!({
                    "metadata": {"name": format!("node-{n}"), "labels": {
                        "zone": format!("zone-{}", n % 3),
                        "kubernetes.io/hostname": format!("node-{n}"),
                    }},
                    "spec": {},
                    "status": {
                        "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110", "ephemeral-storage": "100Gi"},
                        "conditions": [{"type": "Ready", "status": "True"}],
                    },
                });
                if n % 10 == 0 {
                    node["spec"]["taints"] =
                        json!([{"key": "dedicated", "value": "db", "effect": "NoSchedule"}]);
                }
                if n % 25 == 0 {
                    node["spec"]["unschedulable"] = json!(true);
                }
                let node: Node = serde_json::from_value(node).map_err(|e| e.to_string())?;
                state.cache.apply_node(&node);
            }
            for p in 0..pods {
                let (cpu, memory) = [("50m", "64Mi"), ("100m", "128Mi"), ("150m", "256Mi")][p % 3];
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": {"name": format!("pod-{p}"), "namespace": format!("ns-{}", p % 50)},
                    "spec": {
                        "nodeName": format!("node-{}", (p * 7 + c) % nodes.max(1)),
                        "containers": [{"name": "app", "resources": {"requests": {"cpu": cpu, "memory": memory}}}],
                    },
                    "status": {"phase": "Running"},
                }))
                .map_err(|e| e.to_string())?;
                state.cache.apply_pod(&pod);
            }
        }
        extender.clusters.insert(format!("vk-{c}"), cluster);
    }
    Ok(extender)
}

/// Resident set size of this process, KiB (0 where /proc is absent).
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}
