//! kubelet-bench: what a user feels of the kubelet API through a virtual node. The same
//! kubectl commands on the same pod, once through the upper cluster (upper apiserver →
//! virtual-node → lower apiserver → kwok) and once straight to the lower cluster (lower
//! apiserver → kwok), interleaved on one cluster pair, so the ratio is what the virtual
//! node adds. Figures, not assertions.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, PostParams};
use serde_json::json;
use tensile_harness::fixtures::bound_pod;
use tensile_harness::measure::{cpu_by_component, cpu_profile, footprint, percentile};
use tensile_harness::real_node::BUSYBOX_IMAGE;
use tensile_harness::{
    ClusterPair, PairOptions, RealNode, TestNamespace, VirtualNode, VirtualNodeOptions,
    node_is_ready, real_node_placement, wait_for,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

#[derive(Parser)]
#[command(
    about = "kubectl logs, exec and port-forward through a virtual node vs. straight to the lower cluster"
)]
struct Args {
    /// Runs of each timed command on each path.
    #[arg(long, default_value_t = 20)]
    runs: usize,
    /// MiB sent through `kubectl port-forward` (echoed back) on each path.
    #[arg(long, default_value_t = 64)]
    mebibytes: usize,
    /// Port-forward transfers on each path, alternated; the median is reported.
    #[arg(long, default_value_t = 3)]
    forward_runs: usize,
    /// The virtual-node binary (default: beside this one).
    #[arg(long)]
    virtual_node: Option<PathBuf>,
    /// Runs the pod on a real node of the lower cluster (a kubelet with containerd, as
    /// tests/real_node.rs starts it; needs root) instead of kwok: busybox's `nc` echoes.
    #[arg(long)]
    real_node: bool,
}

const NODE: &str = "vk-kubelet-bench";
const REAL_NODE: &str = "lower-real-bench";
const POD: &str = "bench";
const WAIT: Duration = Duration::from_secs(120);

#[tokio::main]
async fn main() -> ExitCode {
    match run(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kubelet-bench: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// One way to reach the pod: a kubeconfig and a name for the table.
struct Route<'a> {
    name: &'static str,
    kubeconfig: &'a Path,
}

struct Bench<'a> {
    kubectl: PathBuf,
    namespace: String,
    paths: [Route<'a>; 2],
}

impl Bench<'_> {
    fn command(&self, kubeconfig: &Path, args: &[&str]) -> Command {
        let mut command = Command::new(&self.kubectl);
        command
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["-n", &self.namespace])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        command
    }

    /// From starting `kubectl logs` to the first byte of the log on its stdout.
    async fn logs_first_byte(&self, kubeconfig: &Path) -> Result<Duration> {
        let started = Instant::now();
        let mut child = self
            .command(kubeconfig, &["logs", POD, "-c", "app"])
            .spawn()?;
        let mut stdout = child.stdout.take().context("kubectl stdout")?;
        let mut byte = [0u8; 1];
        let n = tokio::time::timeout(WAIT, stdout.read(&mut byte)).await??;
        let elapsed = started.elapsed();
        let output = child.wait_with_output().await?;
        if n == 0 || !output.status.success() {
            bail!("kubectl logs: {}", String::from_utf8_lossy(&output.stderr));
        }
        Ok(elapsed)
    }

    /// `kubectl exec -- true`, start to exit.
    async fn exec_round_trip(&self, kubeconfig: &Path) -> Result<Duration> {
        let started = Instant::now();
        let output = tokio::time::timeout(
            WAIT,
            self.command(kubeconfig, &["exec", POD, "-c", "app", "--", "true"])
                .output(),
        )
        .await??;
        if !output.status.success() {
            bail!("kubectl exec: {}", String::from_utf8_lossy(&output.stderr));
        }
        Ok(started.elapsed())
    }

    /// Bytes sent through `kubectl port-forward` to the pod's echo and read back at once:
    /// MB/s each way, and the CPU seconds kubectl spent (the same on both paths, but part of
    /// what the two cores share).
    async fn port_forward(&self, kubeconfig: &Path, bytes: usize) -> Result<(f64, f64)> {
        let mut child = self
            .command(
                kubeconfig,
                &[
                    "port-forward",
                    &format!("pod/{POD}"),
                    ":8080",
                    "--address=127.0.0.1",
                ],
            )
            .spawn()?;
        let port = forwarded_port(&mut child).await?;
        let conn = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        let (mut read, mut write) = conn.into_split();
        let started = Instant::now();
        let send = async move {
            let chunk = vec![b'x'; 64 * 1024];
            let mut left = bytes;
            while left > 0 {
                let n = left.min(chunk.len());
                write.write_all(&chunk[..n]).await?;
                left -= n;
            }
            anyhow::Ok(write)
        };
        let receive = async move {
            let mut buffer = vec![0u8; 64 * 1024];
            let mut got = 0;
            while got < bytes {
                let n = read.read(&mut buffer).await?;
                if n == 0 {
                    bail!("the echo closed after {got} of {bytes} bytes");
                }
                got += n;
            }
            anyhow::Ok(())
        };
        let (write, ()) = tokio::time::timeout(WAIT, async { tokio::try_join!(send, receive) })
            .await
            .context("port-forward echo timed out")??;
        let elapsed = started.elapsed();
        let kubectl = child
            .id()
            .and_then(|pid| footprint(pid).ok())
            .map_or(0.0, |(_, _, seconds)| seconds);
        drop(write);
        child.kill().await?;
        Ok((bytes as f64 / 1e6 / elapsed.as_secs_f64(), kubectl))
    }
}

/// The local port of "Forwarding from 127.0.0.1:40123 -> 8080".
async fn forwarded_port(child: &mut Child) -> Result<u16> {
    let stdout = child.stdout.take().context("kubectl stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(WAIT, async {
        while let Some(line) = lines.next_line().await? {
            if let Some(rest) = line.strip_prefix("Forwarding from 127.0.0.1:") {
                return anyhow::Ok(rest.to_owned());
            }
        }
        bail!("kubectl port-forward ended before forwarding")
    })
    .await??;
    // Keep draining, so kubectl never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(line.split(' ').next().unwrap_or_default().parse()?)
}

/// CPU seconds so far of each component, the real node's kubelet and containerd included
/// (the processes whose command line names its directory).
fn cpu(pair: &ClusterPair, vn: &VirtualNode, real: Option<&RealNode>) -> BTreeMap<String, f64> {
    let mut cpu = cpu_by_component(pair, vn, "kubelet-bench");
    let Some(real) = real else { return cpu };
    let dir = real.dir.to_string_lossy().into_owned();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return cpu;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline);
        let program = cmdline.split('\0').next().unwrap_or_default();
        let name = Path::new(program)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if matches!(name.as_str(), "kubelet" | "containerd")
            && cmdline.contains(&dir)
            && let Ok((_, _, seconds)) = footprint(pid)
        {
            *cpu.entry(format!("real {name}")).or_insert(0.0) += seconds;
        }
    }
    cpu
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

async fn run(args: Args) -> Result<()> {
    let binary = match &args.virtual_node {
        Some(path) => path.clone(),
        None => std::env::current_exe()?.with_file_name("virtual-node"),
    };
    if !binary.exists() {
        bail!(
            "{} not found: build it first (`cargo build --release --workspace --bins`)",
            binary.display()
        );
    }
    eprintln!("starting the cluster pair ...");
    let pair = ClusterPair::start(PairOptions::default()).await?;
    let real = match args.real_node {
        true => {
            eprintln!("starting the real node ...");
            Some(pair.start_real_node(REAL_NODE).await?)
        }
        false => None,
    };
    let mut options = VirtualNodeOptions::new(&binary, NODE);
    options.args = vec!["--log-level".into(), "warn".into()];
    let vn = pair.start_virtual_node(&options)?;
    let upper = pair.upper.client().await?;
    let nodes: Api<Node> = Api::all(upper.clone());
    wait_for(&format!("node {NODE} Ready"), WAIT, || async {
        Ok(nodes.get_opt(NODE).await?.filter(node_is_ready).map(|_| ()))
    })
    .await?;
    let ns = TestNamespace::create(&upper, "kubelet-bench").await?;
    let pods: Api<Pod> = Api::namespaced(upper, &ns.name);
    let mut pod = bound_pod(POD, NODE);
    pod.spec = Some(serde_json::from_value(json!({
        "nodeName": NODE,
        "containers": [{"name": "app", "image": "busybox"}],
    }))?);
    if real.is_some() {
        // Placed on the real node below (as the webhook would stash it); a log line, then an
        // echo on 8080 (busybox nc runs `cat` for each connection).
        pod.metadata.annotations = Some(
            [(
                "clusterSelector".to_owned(),
                real_node_placement().to_string(),
            )]
            .into(),
        );
        pod.spec = Some(serde_json::from_value(json!({
            "nodeName": NODE,
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "app",
                "image": BUSYBOX_IMAGE,
                "command": ["sh", "-c", "echo started; exec nc -ll -p 8080 -e cat"],
            }],
        }))?);
    }
    pods.create(&PostParams::default(), &pod).await?;
    wait_for(&format!("pod {POD} Running"), WAIT, || async {
        let phase = pods.get_opt(POD).await?.and_then(|p| p.status?.phase);
        Ok((phase.as_deref() == Some("Running")).then_some(()))
    })
    .await?;

    let bench = Bench {
        kubectl: pair.bin("kubectl"),
        namespace: ns.name.clone(),
        paths: [
            Route {
                name: "through vk-node",
                kubeconfig: pair.upper_kubeconfig(),
            },
            Route {
                name: "straight to lower",
                kubeconfig: pair.lower_kubeconfig(),
            },
        ],
    };
    // One untimed round each, so both paths start warm (connections, caches).
    for path in &bench.paths {
        bench.logs_first_byte(path.kubeconfig).await?;
        bench.exec_round_trip(path.kubeconfig).await?;
    }
    let cpu_now = || cpu(&pair, &vn, real.as_ref());
    let cpu = cpu_now();
    let mut logs = [Vec::new(), Vec::new()];
    let mut execs = [Vec::new(), Vec::new()];
    let mut throughput = [Vec::new(), Vec::new()];
    for _ in 0..args.runs {
        for (i, path) in bench.paths.iter().enumerate() {
            logs[i].push(bench.logs_first_byte(path.kubeconfig).await?);
            execs[i].push(bench.exec_round_trip(path.kubeconfig).await?);
        }
    }
    let profile = cpu_profile(&cpu, &cpu_now());
    let bytes = args.mebibytes * 1024 * 1024;
    // CPU seconds by component during each path's transfers, summed over the runs.
    let mut forward_cpu = [BTreeMap::new(), BTreeMap::new()];
    for _ in 0..args.forward_runs.max(1) {
        for (i, path) in bench.paths.iter().enumerate() {
            let before = cpu_now();
            let (rate, kubectl) = bench.port_forward(path.kubeconfig, bytes).await?;
            throughput[i].push(rate);
            let after = cpu_now();
            *forward_cpu[i].entry("kubectl".to_owned()).or_insert(0.0) += kubectl;
            for (name, seconds) in &after {
                *forward_cpu[i].entry(name.clone()).or_insert(0.0) +=
                    seconds - before.get(name).copied().unwrap_or(0.0);
            }
        }
    }
    let throughput = throughput.map(|mut runs| {
        runs.sort_by(f64::total_cmp);
        runs[runs.len() / 2]
    });

    println!(
        "\nkubelet-bench: {} cores, Kubernetes {}, the pod on {}, virtual-node {}, {} runs each, \
         {} MiB echoed (median of {})",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        pair.binaries.kubernetes_version(),
        if real.is_some() {
            "a real node (kubelet + containerd)"
        } else {
            "kwok"
        },
        if cfg!(debug_assertions) {
            "debug build"
        } else {
            "release build"
        },
        args.runs,
        args.mebibytes,
        args.forward_runs.max(1),
    );
    println!(
        "{:<34} {:>22} {:>22} {:>7}",
        "", bench.paths[0].name, bench.paths[1].name, "ratio"
    );
    for (what, samples) in [
        ("kubectl logs, first byte (p50/p90)", &mut logs),
        ("kubectl exec -- true (p50/p90)", &mut execs),
    ] {
        for s in samples.iter_mut() {
            s.sort();
        }
        let cell =
            |s: &[Duration]| format!("{} / {}", ms(percentile(s, 50.0)), ms(percentile(s, 90.0)));
        let ratio = percentile(&samples[0], 50.0).as_secs_f64()
            / percentile(&samples[1], 50.0).as_secs_f64().max(1e-9);
        println!(
            "{what:<34} {:>22} {:>22} {ratio:>7.2}",
            cell(&samples[0]),
            cell(&samples[1])
        );
    }
    println!(
        "{:<34} {:>22} {:>22} {:>7.2}",
        "port-forward echo, MB/s each way",
        format!("{:.1}", throughput[0]),
        format!("{:.1}", throughput[1]),
        throughput[0] / throughput[1].max(1e-9)
    );
    println!("CPU during logs and exec (both paths): {profile}");
    for (path, cpu) in bench.paths.iter().zip(&forward_cpu) {
        println!(
            "CPU during port-forward {} ({} x {} MiB): {}",
            path.name,
            args.forward_runs.max(1),
            args.mebibytes,
            cpu_profile(&BTreeMap::new(), cpu)
        );
    }
    ns.delete().await?;
    Ok(())
}
