//! tensile-playground: a local pair of real clusters to try tensile on.
//!
//! `up --dir DIR` starts the pair and keeps it running until Ctrl-C / SIGTERM (or
//! `down --dir DIR`); `DIR/ready` appears once both API servers serve and every kwok node
//! is Ready. `--lower-clusters N` starts N lower clusters and joins each, through
//! `virtual-node join`, as a member of one virtual-node process. `--real-node` adds a real
//! node (kubelet, containerd, runc) to the lower cluster and runs the example workload on
//! it, so `kubectl exec -it vk-demo -- sh` through the virtual node is a real shell.
//! `--kueue` adds Kueue upstairs with the flavors and queues of `deploy/examples/kueue`,
//! their quotas the nodes' own, for batch bursting.
//! `conformance` runs Kubernetes' node conformance tests through the virtual node and
//! straight against the lower cluster, and prints both side by side (docs/conformance.md).

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::Api;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tensile_harness::conformance::{self, ConformanceOptions, Preset, Way};
use tensile_harness::install::{self, LOWER_REAL_NODE, UPPER_REAL_NODE};
use tensile_harness::kueue::{
    self, BURST_FLAVOR, CLUSTER_QUEUE, Kueue, LOCAL_FLAVOR, LOCAL_QUEUE, Quotas, parse_milli,
};
use tensile_harness::metrics_server::USAGE_CPU_ANNOTATION;
use tensile_harness::real_node::BUSYBOX_IMAGE;
use tensile_harness::{
    Cluster, ClusterOptions, ClusterPair, PairOptions, RealNode, VirtualNode, VirtualNodeOptions,
    node_is_ready, real_node_placement, wait_for,
};
use tokio::io::AsyncWriteExt;
use tokio::signal::unix::{SignalKind, signal};

#[derive(Parser)]
#[command(version, about = "Local upper + lower Kubernetes clusters for tensile")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start a cluster pair and keep it running until interrupted.
    Up {
        /// State directory: kubeconfigs, logs, PKI, etcd data.
        #[arg(long)]
        dir: PathBuf,
        /// Simulated nodes in the lower cluster.
        #[arg(long, default_value_t = 3)]
        lower_nodes: usize,
        /// Simulated regular nodes in the upper cluster (default 0; 1 with --kueue or
        /// --install).
        #[arg(long)]
        upper_nodes: Option<usize>,
        /// Name of the virtual node joining the lower cluster to the upper one.
        #[arg(long, default_value = "vk-node")]
        node_name: String,
        /// Only the two clusters: no virtual node, no example workload, and no scheduler
        /// extender (the upper kube-scheduler as it comes).
        #[arg(long)]
        clusters_only: bool,
        /// Lower clusters. Past one, each is joined by `virtual-node join` as a member of
        /// one virtual-node process (`--members-namespace tensile-members`), as
        /// `<node-name>`, `<node-name>-2`, ...
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=20))]
        lower_clusters: u8,
        /// Also start a real node (kubelet, containerd, runc; built by
        /// tests/k8s/real-node/build.sh on first use) in the lower cluster, and run the
        /// example workload on it (busybox made locally). With one lower cluster.
        #[arg(long, conflicts_with = "lower_clusters")]
        real_node: bool,
        /// tensile installed as users install it: its images (tests/k8s/images/build.sh,
        /// from the binaries beside this one) on a real node of the upper cluster, the chart
        /// deploy/helm/tensile installed with helm (virtual-node registers vk-node from a
        /// pod), a real node below, and vk-demo running on it through the in-cluster
        /// virtual-node (README, "Installing with Helm").
        #[arg(long, conflicts_with_all = ["lower_clusters", "real_node", "clusters_only", "node_name"])]
        install: bool,
        /// Batch bursting: Kueue (tests/k8s/kueue/build.sh, built on first use) in the upper
        /// cluster with deploy/examples/kueue applied, the quota of flavor `local` the
        /// regular upper nodes' allocatable and that of `burst` the virtual nodes' (kept so
        /// by virtual-node's --kueue-quota with one lower cluster); Jobs submitted to
        /// `user-queue` fill the regular nodes, then burst (README, "Batch bursting with
        /// Kueue").
        #[arg(long, conflicts_with_all = ["install", "real_node", "clusters_only"])]
        kueue: bool,
    },
    /// Run Kubernetes' node conformance tests (e2e.test of the pinned release, built with its
    /// images by tests/k8s/e2e/build.sh on first use) through the virtual node and straight
    /// against the lower cluster, and print both side by side (docs/conformance.md).
    Conformance {
        /// Which tests: a focus and a skip together (`resize`: in-place resize and pod
        /// generation; `generation`: pod generation only). --focus and --skip replace its
        /// parts.
        #[arg(long, value_enum, default_value_t = Preset::Node)]
        preset: Preset,
        /// ginkgo's focus (a regular expression over the tests' full names); default the
        /// preset's (`node`: `\[NodeConformance\]`).
        #[arg(long)]
        focus: Option<String>,
        /// ginkgo's skip; default the preset's (`node`:
        /// `\[Serial\]|\[Disruptive\]|\[Slow\]|\[Flaky\]|\[Feature:`).
        #[arg(long)]
        skip: Option<String>,
        /// Where each way's JUnit report goes: DIR/vk-node/junit.xml, DIR/straight/junit.xml
        /// (with ginkgo's output beside it, e2e.log).
        #[arg(long, default_value = "conformance-results")]
        junit_dir: PathBuf,
        /// Parallel test processes (ginkgo -p --procs).
        #[arg(long, default_value_t = 5)]
        procs: u16,
        /// Only straight against the lower cluster.
        #[arg(long, conflicts_with = "vk_only")]
        straight_only: bool,
        /// Only through the virtual node.
        #[arg(long)]
        vk_only: bool,
        /// Exit 1 when a test passes straight and fails through vk-node, or (one way only,
        /// as in CI) when any test fails through vk-node.
        #[arg(long)]
        require_parity: bool,
        /// Real nodes in the lower cluster (2 lets the straight run's tests that ask for two
        /// schedulable nodes run; through vk-node there is one node either way).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=4))]
        real_nodes: u8,
        /// State directory of the pair (kubeconfigs, logs); default a temporary one, removed
        /// at the end unless TENSILE_KEEP_STATE is set.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// ginkgo's --timeout for each way, in minutes.
        #[arg(long, default_value_t = 180)]
        timeout_minutes: u64,
    },
    /// Stop a pair started by `up` with the same directory.
    Down {
        /// The directory given to `up`.
        #[arg(long)]
        dir: PathBuf,
    },
}

const PID_FILE: &str = "playground.pid";
const READY_FILE: &str = "ready";

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,kube_client=off".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match Cli::parse().command {
        Command::Up {
            dir,
            lower_nodes,
            upper_nodes,
            node_name,
            clusters_only,
            lower_clusters,
            real_node,
            install,
            kueue,
        } => {
            let node = (!clusters_only).then_some(node_name);
            let shape = Shape {
                lower_nodes,
                upper_nodes,
                lower_clusters: usize::from(lower_clusters),
                real_node,
                install,
                kueue,
            };
            up(&dir, shape, node.as_deref()).await
        }
        Command::Down { dir } => down(&dir),
        Command::Conformance {
            preset,
            focus,
            skip,
            junit_dir,
            procs,
            straight_only,
            vk_only,
            require_parity,
            real_nodes,
            dir,
            timeout_minutes,
        } => {
            let ways = match (straight_only, vk_only) {
                (true, _) => vec![Way::Straight],
                (_, true) => vec![Way::VirtualNode],
                _ => vec![Way::VirtualNode, Way::Straight],
            };
            let (focus, skip) = preset.select(focus, skip);
            let options = ConformanceOptions {
                focus,
                skip,
                junit_dir,
                procs,
                ways,
                real_nodes,
                dir,
                virtual_node: std::env::current_exe()
                    .map(|exe| exe.with_file_name("virtual-node"))
                    .unwrap_or_default(),
                timeout: Duration::from_secs(timeout_minutes * 60),
            };
            run_conformance(&options, require_parity).await
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("tensile-playground: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// How many clusters and nodes.
struct Shape {
    lower_nodes: usize,
    upper_nodes: Option<usize>,
    lower_clusters: usize,
    real_node: bool,
    install: bool,
    kueue: bool,
}

/// The namespace of the member Secrets with more than one lower cluster.
const MEMBERS_NAMESPACE: &str = "tensile-members";

async fn up(dir: &Path, shape: Shape, node: Option<&str>) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let dir = std::path::absolute(dir)?;
    if let Some(pid) = live_playground(&dir) {
        bail!(
            "a playground (pid {pid}) is already running in {}; stop it with `tensile-playground down --dir {}`",
            dir.display(),
            dir.display()
        );
    }
    // A fresh pair every time: the previous run's state (etcd data, PKI) is discarded.
    let extra: Vec<String> = (2..=shape.lower_clusters)
        .map(|i| format!("lower-{i}"))
        .collect();
    let stale = ["upper", "lower", READY_FILE, "pids"]
        .into_iter()
        .map(str::to_owned)
        .chain(extra.iter().cloned());
    for stale in stale {
        let path = dir.join(stale);
        if path.is_dir() {
            std::fs::remove_dir_all(&path)?;
        } else if path.exists() {
            std::fs::remove_file(&path)?;
        }
    }
    std::fs::write(dir.join(PID_FILE), std::process::id().to_string())?;

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let started = Instant::now();
    let mut options = PairOptions {
        dir: Some(dir.clone()),
        ..PairOptions::default()
    };
    if shape.install {
        // Both API servers reachable from pods, metrics in both; one regular node at least.
        let installing = install::pair_options(&options.upper.node_shape.cpu);
        options.upper = installing.upper;
        options.lower = installing.lower;
    }
    options.lower.nodes = shape.lower_nodes;
    // Installed, tensile's pods need a regular node; Kueue's flavor `local` is regular nodes.
    options.upper.nodes = match shape.upper_nodes {
        Some(nodes) => nodes.max(usize::from(shape.install)),
        None => usize::from(shape.install || shape.kueue),
    };
    // With virtual nodes, the upper kube-scheduler calls the scheduler extender as the
    // README tells users to configure it (deploy/scheduler-extender/kube-scheduler-config.yaml):
    // local first. `--clusters-only` leaves the scheduler as it comes and starts no
    // extender: configured with the shipped `ignorable: false` and not running, it would
    // keep every pod Pending, and running, it would fail the virtual node a user then
    // starts by hand (one it was not given with `--cluster`).
    let extender_port = match node {
        // Installed, the extender runs from the chart and install() gives it to the
        // kube-scheduler once it runs.
        Some(_) if shape.install => None,
        Some(_) => {
            let port = tensile_harness::ports::free_port()?;
            options.upper.scheduler_config.extend(
                tensile_harness::scheduler_extender::shipped_scheduler_config(&format!(
                    "http://127.0.0.1:{port}"
                ))?,
            );
            Some(port)
        }
        None => None,
    };
    // metrics-server in every cluster: `kubectl top` upstairs reads the virtual nodes.
    options.upper.metrics = true;
    options.lower.metrics = true;
    eprintln!(
        "starting the upper and lower clusters in {} ...",
        dir.display()
    );
    let pair = tokio::select! {
        pair = ClusterPair::start(options) => pair?,
        _ = sigterm.recv() => bail!("interrupted while starting"),
        _ = sigint.recv() => bail!("interrupted while starting"),
    };
    let more = async {
        let mut clusters = Vec::new();
        for (i, name) in (2u8..).zip(&extra) {
            eprintln!("starting lower cluster {name} ...");
            let mut options = ClusterOptions::new(
                name,
                shape.lower_nodes,
                (Ipv4Addr::new(10, 100 + i, 0, 0), 16),
                &format!("10.{}.0.0/16", 200 + i),
            );
            options.metrics = true;
            clusters.push(pair.start_cluster(options).await?);
        }
        anyhow::Ok(clusters)
    };
    let extra_clusters = tokio::select! {
        clusters = more => clusters?,
        _ = sigterm.recv() => bail!("interrupted while starting"),
        _ = sigint.recv() => bail!("interrupted while starting"),
    };
    let installed = if shape.install {
        eprintln!(
            "installing tensile with its chart (images from tests/k8s/images/build.sh, real \
             nodes {UPPER_REAL_NODE} upstairs and {LOWER_REAL_NODE} below) ..."
        );
        Some(tokio::select! {
            installed = install_and_demo(&pair) => installed?,
            _ = sigterm.recv() => bail!("interrupted while starting"),
            _ = sigint.recv() => bail!("interrupted while starting"),
        })
    } else {
        None
    };
    let real_node = if shape.real_node {
        eprintln!(
            "starting a real node ({REAL_NODE}: kubelet, containerd, runc) in the lower cluster ..."
        );
        Some(tokio::select! {
            node = pair.start_real_node(REAL_NODE) => node?,
            _ = sigterm.recv() => bail!("interrupted while starting"),
            _ = sigint.recv() => bail!("interrupted while starting"),
        })
    } else {
        None
    };
    let members: Vec<(String, &Cluster)> = node
        .filter(|_| !shape.install)
        .map(|node| {
            let names = std::iter::once(node.to_owned())
                .chain((2..=shape.lower_clusters).map(|i| format!("{node}-{i}")));
            names
                .zip(std::iter::once(&pair.lower).chain(&extra_clusters))
                .collect()
        })
        .unwrap_or_default();
    // Before any pod: the upper kube-scheduler waits for the extender (ignorable: false).
    let extender = if let Some(extender_port) = extender_port {
        eprintln!("starting the scheduler extender on 127.0.0.1:{extender_port} ...");
        let clusters: Vec<(String, &Path)> = members
            .iter()
            .map(|(node, cluster)| (node.clone(), cluster.kubeconfig.as_path()))
            .collect();
        let program = std::env::current_exe()?.with_file_name("tensile-scheduler-extender");
        Some(tokio::select! {
            started = tensile_harness::scheduler_extender::start_extender(
                &pair, &program, "scheduler-extender", extender_port, &clusters,
            ) => started?,
            _ = sigterm.recv() => bail!("interrupted while starting"),
            _ = sigint.recv() => bail!("interrupted while starting"),
        })
    } else {
        None
    };
    let virtual_node = if members.is_empty() {
        None
    } else {
        Some(tokio::select! {
            started = join_and_demo(&pair, &members, real_node.is_some(), shape.kueue) => started?,
            _ = sigterm.recv() => bail!("interrupted while starting"),
            _ = sigint.recv() => bail!("interrupted while starting"),
        })
    };
    let batch = if shape.kueue {
        eprintln!("starting Kueue in the upper cluster (tests/k8s/kueue/build.sh) ...");
        Some(tokio::select! {
            started = start_kueue(&pair) => started?,
            _ = sigterm.recv() => bail!("interrupted while starting"),
            _ = sigint.recv() => bail!("interrupted while starting"),
        })
    } else {
        None
    };
    std::fs::write(dir.join(READY_FILE), "")?;
    let mut nodes: Vec<&str> = members.iter().map(|(n, _)| n.as_str()).collect();
    if installed.is_some() {
        nodes.push(install::VIRTUAL_NODE);
    }
    print_summary(
        &pair,
        &extra_clusters,
        started.elapsed(),
        &nodes,
        virtual_node.as_ref(),
        real_node
            .as_ref()
            .or(installed.as_ref().map(|i| &i.lower_node)),
    );
    if let Some(installed) = &installed {
        print_installed(&pair, installed);
    }
    if let Some((kueue, quotas)) = &batch {
        print_kueue(&pair, kueue, quotas, nodes.len());
    }
    if virtual_node.is_some() || installed.is_some() {
        print_status(&pair, nodes.len() > 1).await;
    }

    tokio::select! {
        _ = sigterm.recv() => {}
        _ = sigint.recv() => {}
    }
    eprintln!("stopping ...");
    let _ = std::fs::remove_file(dir.join(READY_FILE));
    drop(batch);
    drop(real_node);
    drop(installed);
    drop(extender);
    for cluster in &extra_clusters {
        cluster.stop();
    }
    pair.stop();
    let _ = std::fs::remove_file(dir.join(PID_FILE));
    eprintln!("stopped");
    Ok(())
}

/// The example workload (the seed's: a ConfigMap, a Secret and a pod using both).
const DEMO: &str = include_str!("../../../../deploy/examples/vk-demo.yaml");

const WAIT: Duration = Duration::from_secs(120);

/// The name of the real node (`--real-node`) in the lower cluster.
const REAL_NODE: &str = "lower-real-0";

/// The example workload for the real node: the busybox image made locally, a command that
/// prints (for `kubectl logs`) and stays, and the placement onto the real node stashed in
/// `clusterSelector`, which the virtual node restores below.
fn demo_on_real_node() -> Result<String> {
    let placement = serde_json::to_string(&real_node_placement())?;
    let mut demo = DEMO.to_owned();
    for (from, to) in [
        ("image: busybox:1.27", format!("image: {BUSYBOX_IMAGE}")),
        (
            r#"command: ["/bin/sh", "-c", "tail -f /dev/null"]"#,
            r#"command: ["/bin/sh", "-c", "echo hello from vk-demo on $(hostname), a real container; exec tail -f /dev/null"]"#.to_owned(),
        ),
        (
            "  name: vk-demo\n",
            format!("  name: vk-demo\n  annotations:\n    clusterSelector: '{placement}'\n"),
        ),
    ] {
        if !demo.contains(from) {
            bail!("deploy/examples/vk-demo.yaml no longer has {from:?}: update demo_on_real_node");
        }
        demo = demo.replacen(from, &to, 1);
    }
    Ok(demo)
}

/// Starts virtual-node (built next to this binary) for `members` (node name, lower
/// cluster), waits for every Node to be Ready, applies the example workload and waits for
/// its pod to run. One member is the single-cluster flags, as tensile-kube runs; more are
/// joined by `virtual-node join` and served by one process. With `kueue`, one member keeps
/// the quota of flavor `burst` equal to its node's allocatable (`--kueue-quota`).
async fn join_and_demo(
    pair: &ClusterPair,
    members: &[(String, &Cluster)],
    real_node: bool,
    kueue: bool,
) -> Result<VirtualNode> {
    let binary = std::env::current_exe()?.with_file_name("virtual-node");
    if !binary.exists() {
        bail!(
            "{} not found: build it first (`cargo build --workspace --bins`)",
            binary.display()
        );
    }
    let virtual_node = match members {
        [(node, _)] => {
            eprintln!("joining the lower cluster as {node} ...");
            let mut options = VirtualNodeOptions::new(&binary, node);
            if kueue {
                options.args.push(kueue_quota_flag());
            }
            pair.start_virtual_node(&options)?
        }
        _ => {
            for (node, cluster) in members {
                eprintln!(
                    "virtual-node join --nodename {node} --members-namespace {MEMBERS_NAMESPACE} (lower cluster {}) ...",
                    cluster.name
                );
            }
            let joined: Vec<(&str, &Path)> = members
                .iter()
                .map(|(node, cluster)| (node.as_str(), cluster.kubeconfig.as_path()))
                .collect();
            pair.start_members(&binary, MEMBERS_NAMESPACE, &joined, &[])
                .await?
        }
    };
    let upper = pair.upper.client().await?;
    let nodes: Api<Node> = Api::all(upper.clone());
    for (node, _) in members {
        let what = format!("node {node} Ready (log: {})", virtual_node.log().display());
        wait_for(&what, WAIT, || async {
            Ok(nodes.get_opt(node).await?.filter(node_is_ready).map(|_| ()))
        })
        .await?;
    }

    apply_demo(pair, real_node).await?;
    Ok(virtual_node)
}

/// `--install`: tensile installed by its chart ([`install::install`]), then the example
/// workload on the lower real node through the in-cluster virtual-node.
async fn install_and_demo(pair: &ClusterPair) -> Result<install::Installed> {
    let images =
        tokio::task::spawn_blocking(|| tensile_harness::images::Images::build(None)).await??;
    let tarballs: Vec<PathBuf> = images.all().iter().map(|i| i.tarball.clone()).collect();
    let installed = install::install(pair, &tarballs, &images.tag, 1).await?;
    eprintln!(
        "tensile installed: every pod available {:.1}s and {} Ready {:.1}s after helm install",
        installed.install_to_running.as_secs_f64(),
        install::VIRTUAL_NODE,
        installed.install_to_node_ready.as_secs_f64()
    );
    apply_demo(pair, true).await?;
    Ok(installed)
}

/// `--install`: what was installed, and helm's commands for it.
fn print_installed(pair: &ClusterPair, installed: &install::Installed) {
    let home = installed.helm_home.display();
    let helm = format!(
        "HELM_CONFIG_HOME={home}/config HELM_CACHE_HOME={home}/cache HELM_DATA_HOME={home}/data \
         KUBECONFIG={} {}",
        pair.upper.kubeconfig.display(),
        tensile_harness::binaries::helm()
            .map(|h| h.display().to_string())
            .unwrap_or_else(|_| "helm".into())
    );
    println!(
        "\ninstalled with helm (release {} in {}, from {}):",
        install::RELEASE,
        install::NAMESPACE,
        install::CHART
    );
    println!(
        "  {} --kubeconfig {} get pods -n {} -o wide   # tensile's pods on {}",
        pair.bin("kubectl").display(),
        pair.upper.kubeconfig.display(),
        install::NAMESPACE,
        install::UPPER_REAL_NODE
    );
    println!("  {helm} list -n {}", install::NAMESPACE);
    println!(
        "  {helm} uninstall {} -n {} --wait   # drains vk-node first (README, \"Uninstalling\")",
        install::RELEASE,
        install::NAMESPACE
    );
    println!(
        "real node {} ({}:{}): {}",
        installed.upper_node.name,
        installed.upper_node.node_ip,
        installed.upper_node.kubelet_port,
        installed.upper_node.kubelet_log().display()
    );
}

/// Applies the example workload (on the lower real node with `real_node`) and waits until
/// it runs and its log reads through the virtual node.
async fn apply_demo(pair: &ClusterPair, real_node: bool) -> Result<()> {
    let upper = pair.upper.client().await?;
    let demo = if real_node {
        eprintln!(
            "applying the example workload (deploy/examples/vk-demo.yaml), on the real node ..."
        );
        demo_on_real_node()?
    } else {
        eprintln!("applying the example workload (deploy/examples/vk-demo.yaml) ...");
        DEMO.to_owned()
    };
    let mut kubectl = tokio::process::Command::new(pair.bin("kubectl"))
        .arg("--kubeconfig")
        .arg(&pair.upper.kubeconfig)
        .args(["apply", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()?;
    if let Some(mut stdin) = kubectl.stdin.take() {
        stdin.write_all(demo.as_bytes()).await?;
    }
    let status = kubectl.wait().await?;
    if !status.success() {
        bail!("kubectl apply of the example workload failed ({status})");
    }
    let pods: Api<Pod> = Api::namespaced(upper, "default");
    wait_for("pod vk-demo Running in the upper cluster", WAIT, || async {
        let phase = pods.get_opt("vk-demo").await?.and_then(|p| p.status?.phase);
        Ok((phase.as_deref() == Some("Running")).then_some(()))
    })
    .await?;
    // Through the upper API server and the virtual node's kubelet API, as `kubectl logs`.
    wait_for(
        "kubectl logs vk-demo through the virtual node",
        WAIT,
        || async {
            Ok(pods
                .logs("vk-demo", &Default::default())
                .await
                .ok()
                .map(|_| ()))
        },
    )
    .await?;
    Ok(())
}

/// virtual-node's flag that keeps flavor `burst`'s quota equal to its node's allocatable.
fn kueue_quota_flag() -> String {
    format!("--kueue-quota={CLUSTER_QUEUE}/{BURST_FLAVOR}")
}

/// `--kueue`: Kueue in the upper cluster, then `deploy/examples/kueue` with each flavor's
/// quota what its nodes offer ([`kueue::flavor_quotas`]); returns when the LocalQueue is
/// Active.
async fn start_kueue(pair: &ClusterPair) -> Result<(Kueue, Quotas)> {
    let kueue = Kueue::start(pair, &pair.upper).await?;
    let client = pair.upper.client().await?;
    let nodes = Api::<Node>::all(client.clone())
        .list(&Default::default())
        .await?
        .items;
    let quotas = kueue::flavor_quotas(&nodes)?;
    kueue::apply_examples(&client, &quotas)
        .await
        .with_context(|| {
            format!(
                "deploy/examples/kueue (Kueue's log: {})",
                kueue.log().display()
            )
        })?;
    Ok((kueue, quotas))
}

/// `--kueue`: the quotas, and the commands that submit Jobs and watch them burst.
fn print_kueue(pair: &ClusterPair, kueue: &Kueue, quotas: &Quotas, members: usize) {
    let upper = format!(
        "{} --kubeconfig {}",
        pair.bin("kubectl").display(),
        pair.upper.kubeconfig.display()
    );
    let shown = |flavor: &str| {
        quotas
            .iter()
            .find(|(f, _)| *f == flavor)
            .map(|(_, resources)| {
                resources
                    .iter()
                    .map(|(r, q)| format!("{r} {q}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default()
    };
    // One CPU a Job: what fills the regular nodes, and a few more.
    let local_cpus = quotas
        .iter()
        .find(|(f, _)| *f == LOCAL_FLAVOR)
        .and_then(|(_, r)| r.iter().find(|(r, _)| r == "cpu"))
        .and_then(|(_, q)| parse_milli(q))
        .map_or(0, |milli| milli / 1000);
    let jobs = local_cpus + 4;
    println!(
        "
batch bursting with Kueue (deploy/examples/kueue; README, \"Batch bursting with Kueue\"):"
    );
    println!(
        "  ClusterQueue {CLUSTER_QUEUE}: flavor {LOCAL_FLAVOR} (regular nodes) {}, then {BURST_FLAVOR} (virtual nodes) {}",
        shown(LOCAL_FLAVOR),
        shown(BURST_FLAVOR)
    );
    if members == 1 {
        println!(
            "  (virtual-node {} keeps {BURST_FLAVOR}'s quota equal to the node's allocatable)",
            kueue_quota_flag()
        );
    }
    println!(
        "  for i in $(seq {jobs}); do {upper} create -f deploy/examples/kueue/job.yaml; done   # {jobs} one-CPU Jobs in {LOCAL_QUEUE}"
    );
    println!(
        "  {upper} get workloads,jobs,pods -o wide   # {local_cpus} on the regular nodes (flavor {LOCAL_FLAVOR}), the rest on the virtual nodes ({BURST_FLAVOR}), each done in 10s"
    );
    println!(
        "  {upper} get clusterqueue {CLUSTER_QUEUE} -o jsonpath='{{.status.flavorsUsage}}'   # what each flavor uses"
    );
    println!("Kueue's log: {}", kueue.log().display());
}

fn print_summary(
    pair: &ClusterPair,
    extra_clusters: &[Cluster],
    elapsed: Duration,
    nodes: &[&str],
    virtual_node: Option<&VirtualNode>,
    real_node: Option<&RealNode>,
) {
    println!(
        "\nready in {:.1}s (Kubernetes {})",
        elapsed.as_secs_f64(),
        pair.binaries.kubernetes_version()
    );
    for cluster in [&pair.upper, &pair.lower].into_iter().chain(extra_clusters) {
        let (name, server) = (&cluster.name, &cluster.server);
        println!(
            "  {name:<5} {server}  kubeconfig {}",
            cluster.kubeconfig.display()
        );
    }
    let kubectl = pair.bin("kubectl");
    let upper = format!(
        "{} --kubeconfig {}",
        kubectl.display(),
        pair.upper.kubeconfig.display()
    );
    let lower = format!(
        "{} --kubeconfig {}",
        kubectl.display(),
        pair.lower.kubeconfig.display()
    );
    println!("\nlook around:");
    println!("  {upper} get nodes -o wide");
    if nodes.len() > 1 {
        println!(
            "  {upper} get secrets -n {MEMBERS_NAMESPACE}   # one member Secret per lower cluster ({})",
            nodes.join(", ")
        );
        println!(
            "  {upper} apply -f deploy/examples/spread.yaml && {upper} get pods -l app=spread -o wide   # spread over the members"
        );
    }
    if let Some(node) = nodes.first() {
        let on = if nodes.len() > 1 {
            "one of the virtual nodes".to_owned()
        } else {
            (*node).to_owned()
        };
        println!("  {upper} get pods -o wide       # vk-demo runs on {on} ...");
        println!("  {lower} get pods,cm,secrets -o wide   # ... and really in the lower cluster");
        println!("  {upper} describe node {node}");
        println!("  {upper} logs vk-demo               # the kubelet API, served by {node}");
        if real_node.is_some() {
            println!(
                "  {upper} exec -it vk-demo -- sh   # a real shell in the container on {REAL_NODE}"
            );
            println!(
                "  {upper} exec vk-demo -- httpd -p 8080 -h /etc/foo; {upper} port-forward pod/vk-demo 8080 &   # a real listener ..."
            );
            println!(
                "  curl http://127.0.0.1:8080/username   # ... serving the mirrored ConfigMap"
            );
            println!(
                "  {upper} top pod vk-demo   # the container's real usage (lower kubelet -> metrics-server -> {node} -> upper metrics-server), within a minute"
            );
        } else {
            println!("  {upper} exec vk-demo -- echo hi   # commands run inside kwok here");
            println!("  {upper} port-forward pod/vk-demo 8080:80   # kwok echoes what you send");
            println!(
                "  {upper} annotate pod vk-demo {USAGE_CPU_ANNOTATION}=250m   # kwok's simulated CPU use below ..."
            );
            println!(
                "  {upper} top pod vk-demo; {upper} top node {node}   # ... in kubectl top within a minute"
            );
        }
    }
    println!("  {lower} get nodes,pods -A");
    if let Some(real) = real_node {
        println!(
            "real node {} ({}:{}): {}, {}",
            real.name,
            real.node_ip,
            real.kubelet_port,
            real.kubelet_log().display(),
            real.containerd_log().display()
        );
    }
    if let Some(vn) = virtual_node {
        let port = vn.metrics_port;
        println!(
            "  curl -s http://127.0.0.1:{port}/metrics   # the virtual node's metrics (also /healthz, /readyz)"
        );
    }
    let dir = pair.dir.display();
    println!("logs: {dir}/{{upper,lower}}/*.log, {dir}/virtual-node-*.log");
    println!("\nCtrl-C (or `tensile-playground down --dir {dir}`) stops it.");
}

/// `virtual-node status` as an operator runs it (the upper kubeconfig only), once.
async fn print_status(pair: &ClusterPair, members: bool) {
    let Ok(binary) = std::env::current_exe().map(|exe| exe.with_file_name("virtual-node")) else {
        return;
    };
    let mut command = tokio::process::Command::new(&binary);
    command
        .arg("status")
        .arg("--kubeconfig")
        .arg(&pair.upper.kubeconfig);
    if members {
        command.args(["--members-namespace", MEMBERS_NAMESPACE]);
    }
    let shown = if members {
        format!("--members-namespace {MEMBERS_NAMESPACE}")
    } else {
        String::new()
    };
    match command.output().await {
        Ok(output) if output.status.success() => {
            println!(
                "\n{} status --kubeconfig {} {shown}",
                binary.display(),
                pair.upper.kubeconfig.display()
            );
            print!("{}", String::from_utf8_lossy(&output.stdout));
        }
        Ok(output) => eprintln!(
            "virtual-node status: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        ),
        Err(error) => eprintln!("virtual-node status: {error}"),
    }
}

/// `conformance`: the whole run, interrupted cleanly by Ctrl-C / SIGTERM (the pair and its
/// real nodes end with this process).
async fn run_conformance(options: &ConformanceOptions, require_parity: bool) -> Result<()> {
    if !options.virtual_node.exists() {
        bail!(
            "{} not found: build it first (`cargo build --workspace --bins`)",
            options.virtual_node.display()
        );
    }
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let started = Instant::now();
    let (comparison, times) = tokio::select! {
        result = conformance::run(options) => result?,
        _ = sigterm.recv() => bail!("interrupted"),
        _ = sigint.recv() => bail!("interrupted"),
    };
    println!(
        "\nfocus {:?}, skip {:?}, {} proc(s), {} real node(s); JUnit under {}",
        options.focus,
        options.skip,
        options.procs,
        options.real_nodes,
        options.junit_dir.display()
    );
    for (way, elapsed) in &times {
        println!("  {}: {:.0}s", way.label(), elapsed.as_secs_f64());
    }
    println!("total {:.0}s\n", started.elapsed().as_secs_f64());
    print!("{}", comparison.render());
    let short = comparison.regressions.len() + comparison.vk_failures_unmatched.len();
    if require_parity && short > 0 {
        bail!("{short} test(s) fail through vk-node (--require-parity)");
    }
    Ok(())
}

/// The PID of a playground still running for `dir`, if any.
fn live_playground(dir: &Path) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(dir.join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    String::from_utf8_lossy(&cmdline)
        .contains("tensile-playground")
        .then_some(pid)
}

fn down(dir: &Path) -> Result<()> {
    let dir = std::path::absolute(dir)?;
    if let Some(pid) = live_playground(&dir) {
        kill(Pid::from_raw(pid), Signal::SIGTERM)
            .with_context(|| format!("signalling playground pid {pid}"))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline && live_playground(&dir).is_some() {
            std::thread::sleep(Duration::from_millis(100));
        }
        if live_playground(&dir).is_some() {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
    // Whatever the playground could not stop: only PIDs whose command line names this
    // directory, so a recycled PID is never hit.
    let marker = dir.display().to_string();
    let mut killed = 0;
    for pid in std::fs::read_to_string(dir.join("pids"))
        .unwrap_or_default()
        .lines()
    {
        let Ok(pid) = pid.trim().parse::<i32>() else {
            continue;
        };
        let ours = std::fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&marker));
        if ours && kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok() {
            killed += 1;
        }
    }
    let _ = std::fs::remove_file(dir.join(READY_FILE));
    let _ = std::fs::remove_file(dir.join(PID_FILE));
    println!(
        "playground in {} is down ({killed} leftover process(es) killed)",
        dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use super::*;

    /// `up --real-node` edits the example workload: every edit still applies, and the
    /// result is a pod placed on the real node with the local busybox image.
    #[test]
    fn the_example_workload_goes_to_the_real_node() {
        let demo = demo_on_real_node().unwrap();
        let pod = serde_saphyr::from_multiple::<serde_json::Value>(&demo)
            .unwrap()
            .into_iter()
            .find(|d| d["kind"] == "Pod")
            .unwrap();
        assert_eq!(pod["spec"]["containers"][0]["image"], BUSYBOX_IMAGE);
        let stash: serde_json::Value = serde_json::from_str(
            pod["metadata"]["annotations"]["clusterSelector"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(stash, real_node_placement());
    }
}
