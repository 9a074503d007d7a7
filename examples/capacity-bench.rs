//! capacity-bench (`cargo run --release --example capacity-bench`): what keeping the virtual node's capacity current costs per lower pod
//! event at scale. Builds a lower cluster's worth of nodes and pods (no API server: the
//! cost measured is the fold, not the watch), feeds them to `LowerCapacity` as a relist
//! would, then applies changed pods one at a time and reads the capacity after each, as
//! `watch_capacity` does; and the same with the walk over every pod that the incremental
//! sums replaced, as the reference, in the same run. Figures, not assertions.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::Parser;
use k8s_openapi::api::core::v1::{
    Container, Node, NodeCondition, NodeSpec, NodeStatus, Pod, PodSpec, PodStatus,
    ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tensile::node::capacity::{LowerCapacity, PodFeed};
use tensile::translate::meta::Owner;
use tensile_harness::measure::footprint;

#[derive(Parser)]
#[command(about = "Cost per lower pod event of the virtual node's capacity: incremental vs. walk")]
struct Args {
    /// Lower pods.
    #[arg(long, default_value_t = 20_000)]
    pods: usize,
    /// Lower nodes the pods are spread over.
    #[arg(long, default_value_t = 200)]
    nodes: usize,
    /// Timed pod events for the incremental sums.
    #[arg(long, default_value_t = 200_000)]
    events: usize,
    /// Timed pod events for the walk (each walks every pod, so fewer).
    #[arg(long, default_value_t = 2_000)]
    walk_events: usize,
}

/// The virtual node whose capacity is computed; every fourth lower pod is its mirror.
const OUR_NODE: &str = "vk-bench";
const OUR_CLUSTER: &str = "bench-cluster";

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("capacity-bench: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// A pod event, handed to the feed whose watch would carry it (none carries our own
/// mirrors: the API server filters them out, so they cost nothing here).
fn fold(capacity: &mut LowerCapacity, owner: &Owner, pod: &Pod) {
    if let Some(feed) = PodFeed::of(owner, pod.metadata.labels.as_ref()) {
        capacity.apply_pod(feed, pod);
    }
}

fn run(args: &Args) -> Result<()> {
    if args.pods == 0 || args.nodes == 0 {
        bail!("--pods and --nodes must be positive");
    }
    let nodes: Vec<Node> = (0..args.nodes).map(lower_node).collect();
    // Two versions of each pod, so that every timed event is a real change.
    let pods: Vec<Pod> = (0..args.pods)
        .map(|i| lower_pod(i, args.nodes, 0))
        .collect();
    let changed: Vec<Pod> = (0..args.pods)
        .map(|i| lower_pod(i, args.nodes, 100))
        .collect();
    let event = |e: usize| -> &Pod {
        let version = if (e / args.pods).is_multiple_of(2) {
            &changed
        } else {
            &pods
        };
        &version[e % args.pods]
    };

    let resident_before = footprint(std::process::id())?.0;
    let started = Instant::now();
    let owner = Owner::new(OUR_NODE, OUR_CLUSTER);
    let mut capacity = LowerCapacity::new(&owner);
    capacity.relist_nodes_start();
    for node in &nodes {
        capacity.apply_node(node);
    }
    capacity.relist_nodes_done();
    for feed in PodFeed::ALL {
        capacity.relist_pods_start(feed);
    }
    for pod in &pods {
        fold(&mut capacity, &owner, pod);
    }
    for feed in PodFeed::ALL {
        capacity.relist_pods_done(feed);
    }
    let initial = capacity.capacity_if_changed();
    let sync = started.elapsed();
    let resident_after = footprint(std::process::id())?.0;
    if initial.as_ref() != Some(&capacity.capacity_by_walk()) {
        bail!("the incremental capacity differs from the walk after the initial list");
    }

    let incremental = per_event(args.events, |e| {
        fold(&mut capacity, &owner, event(e));
        black_box(capacity.capacity_if_changed());
    });
    let apply_only = per_event(args.events, |e| fold(&mut capacity, &owner, event(e)));
    let walk_only = per_event(args.walk_events, |_| {
        black_box(capacity.capacity_by_walk());
    });
    let with_walk = per_event(args.walk_events, |e| {
        fold(&mut capacity, &owner, event(e));
        black_box(capacity.capacity_by_walk());
    });
    if capacity.capacity() != capacity.capacity_by_walk() {
        bail!("the incremental capacity differs from the walk after the timed events");
    }

    // A relist after the first sync (the watch fell behind): each of its events was
    // followed by a read, which with the walk made the relist quadratic.
    let started = Instant::now();
    for feed in PodFeed::ALL {
        capacity.relist_pods_start(feed);
    }
    for e in 0..args.pods {
        fold(&mut capacity, &owner, event(e));
        black_box(capacity.capacity_if_changed());
    }
    for feed in PodFeed::ALL {
        capacity.relist_pods_done(feed);
    }
    let relist = started.elapsed();

    let taking_room = (0..args.pods).filter(|i| takes_room(*i)).count();
    println!(
        "lower cluster: {} nodes, {} pods ({taking_room} take room: not mirrored by \
         {OUR_NODE}, not Succeeded), 3 containers each, an init container in one of five",
        args.nodes, args.pods
    );
    println!(
        "initial list folded in: {:.1} ms; resident memory {:+.1} MiB ({} B per pod)",
        ms(sync),
        mib(resident_after.saturating_sub(resident_before)),
        resident_after.saturating_sub(resident_before) / args.pods as u64,
    );
    println!(
        "per pod event ({} events incremental, {} with the walk):",
        args.events, args.walk_events
    );
    println!(
        "  incremental: apply + capacity read  {:>12.0} ns",
        ns(incremental)
    );
    println!(
        "    of which apply                    {:>12.0} ns",
        ns(apply_only)
    );
    println!(
        "  reference: apply + walk every pod   {:>12.0} ns",
        ns(with_walk)
    );
    println!(
        "    of which the walk                 {:>12.0} ns",
        ns(walk_only)
    );
    println!(
        "  ratio reference / incremental       {:>12.1}x",
        ns(with_walk) / ns(incremental)
    );
    println!(
        "relist of {} pods after sync, read per event: incremental {:.1} ms, with the walk ≈ {:.1} s (pods × reference)",
        args.pods,
        ms(relist),
        ns(with_walk) * args.pods as f64 / 1e9
    );
    Ok(())
}

/// Mean time of one call of `event`, over `events` calls.
fn per_event(events: usize, mut event: impl FnMut(usize)) -> Duration {
    let started = Instant::now();
    for e in 0..events {
        event(e);
    }
    started.elapsed() / u32::try_from(events.max(1)).unwrap_or(u32::MAX)
}

fn ns(d: Duration) -> f64 {
    d.as_secs_f64() * 1e9
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn quantities(pairs: &[(&str, String)]) -> BTreeMap<String, Quantity> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), Quantity(v.clone())))
        .collect()
}

/// A Ready kwok-like node: 64 CPUs, 256 GiB, 110 pods, hugepages listed as zero.
fn lower_node(i: usize) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(format!("lower-node-{i}")),
            ..ObjectMeta::default()
        },
        spec: Some(NodeSpec::default()),
        status: Some(NodeStatus {
            allocatable: Some(quantities(&[
                ("cpu", "64".into()),
                ("memory", "256Gi".into()),
                ("ephemeral-storage", "100Gi".into()),
                ("hugepages-1Gi", "0".into()),
                ("hugepages-2Mi", "0".into()),
                ("pods", "110".into()),
            ])),
            conditions: Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: "True".into(),
                ..NodeCondition::default()
            }]),
            ..NodeStatus::default()
        }),
    }
}

fn mirrored(i: usize) -> bool {
    i.is_multiple_of(4)
}

fn succeeded(i: usize) -> bool {
    i % 50 == 49
}

fn takes_room(i: usize) -> bool {
    !mirrored(i) && !succeeded(i)
}

fn container(name: &str, cpu_milli: usize, memory_mi: usize) -> Container {
    let requests = quantities(&[
        ("cpu", format!("{cpu_milli}m")),
        ("memory", format!("{memory_mi}Mi")),
    ]);
    Container {
        name: name.to_owned(),
        image: Some(format!("registry.example/{name}:1.0")),
        resources: Some(ResourceRequirements {
            limits: Some(requests.clone()),
            requests: Some(requests),
            ..ResourceRequirements::default()
        }),
        ..Container::default()
    }
}

/// Lower pod `i`: an app, a sidecar and a log shipper; an init container in one of five;
/// every fourth one mirrored by [`OUR_NODE`], one in fifty Succeeded. `extra_milli` CPU
/// on the app makes the changed version.
fn lower_pod(i: usize, nodes: usize, extra_milli: usize) -> Pod {
    let mut labels = BTreeMap::from([("app".to_owned(), format!("app-{}", i % 100))]);
    if mirrored(i) {
        Owner::new(OUR_NODE, OUR_CLUSTER).mark(&mut labels);
    }
    let init_containers = i
        .is_multiple_of(5)
        .then(|| vec![container("migrate", 200, 64)]);
    Pod {
        metadata: ObjectMeta {
            name: Some(format!("app-{i}")),
            namespace: Some(format!("team-{}", i % 50)),
            labels: Some(labels),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some(format!("lower-node-{}", i % nodes)),
            init_containers,
            containers: vec![
                container("app", 100 + (i % 10) * 50 + extra_milli, 128 + (i % 8) * 64),
                container("sidecar", 50, 64),
                container("log-shipper", 10, 32),
            ],
            ..PodSpec::default()
        }),
        status: Some(PodStatus {
            phase: Some(if succeeded(i) { "Succeeded" } else { "Running" }.into()),
            ..PodStatus::default()
        }),
    }
}
