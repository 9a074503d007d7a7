//! `tensile-playground` run as a user runs it: the binary with its `--dir`, then `kubectl`
//! against the kubeconfig it writes there.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tensile_harness::{Binaries, wait_for};

const PLAYGROUND: &str = env!("CARGO_BIN_EXE_tensile-playground");

/// A running `tensile-playground up`. Dropped (a failed test included), it is taken `down`
/// and killed if still there, and its directory removed unless `TENSILE_KEEP_STATE` is set.
struct Playground {
    dir: PathBuf,
    up: std::process::Child,
}

impl Playground {
    /// Runs `tensile-playground up --dir <temporary> <args>`, its output in
    /// `<dir>/playground.log`.
    fn up(args: &[&str]) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("tensile-playground-test-")
            .tempdir()
            .context("creating the playground directory")?
            .keep();
        let log = std::fs::File::create(dir.join("playground.log"))?;
        let up = std::process::Command::new(PLAYGROUND)
            .arg("up")
            .arg("--dir")
            .arg(&dir)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {PLAYGROUND}"))?;
        Ok(Self { dir, up })
    }

    /// Waits for `<dir>/ready`; fails at once, with the log, if `up` ends first.
    async fn ready(&mut self, timeout: Duration) -> Result<()> {
        let ready = self.dir.join("ready");
        wait_for("tensile-playground up ready", timeout, || {
            let exited = self.up.try_wait();
            let ready = ready.exists();
            async move {
                if let Some(status) = exited? {
                    bail!("tensile-playground up ended ({status}) before ready");
                }
                Ok(ready.then_some(()))
            }
        })
        .await
        .with_context(|| self.log_tail())
    }

    fn kubeconfig(&self, cluster: &str) -> PathBuf {
        self.dir.join(format!("{cluster}.kubeconfig"))
    }

    /// The last lines of `up`'s output, for a failure's message.
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("playground.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(20)..].join("\n");
        format!("tensile-playground up's output ends:\n{tail}")
    }

    /// `tensile-playground down --dir <dir>`, as from another terminal; `up` must then end
    /// cleanly.
    async fn down(mut self) -> Result<()> {
        let down = tokio::process::Command::new(PLAYGROUND)
            .arg("down")
            .arg("--dir")
            .arg(&self.dir)
            .output()
            .await?;
        if !down.status.success() {
            bail!(
                "tensile-playground down failed ({}): {}",
                down.status,
                String::from_utf8_lossy(&down.stderr)
            );
        }
        let status = wait_for(
            "tensile-playground up ended",
            Duration::from_secs(10),
            || {
                let exited = self.up.try_wait();
                async move { Ok(exited?) }
            },
        )
        .await?;
        if !status.success() {
            bail!(
                "tensile-playground up ended with {status}\n{}",
                self.log_tail()
            );
        }
        Ok(())
    }
}

impl Drop for Playground {
    fn drop(&mut self) {
        if self.up.try_wait().ok().flatten().is_none() {
            let _ = std::process::Command::new(PLAYGROUND)
                .arg("down")
                .arg("--dir")
                .arg(&self.dir)
                .stdout(Stdio::null())
                .status();
            let _ = self.up.kill();
        }
        let _ = self.up.wait();
        if std::env::var_os("TENSILE_KEEP_STATE").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// `kubectl --kubeconfig <kubeconfig> <args>`: its stdout, or an error with its stderr.
async fn kubectl(kubectl: &Path, kubeconfig: &Path, args: &[&str]) -> Result<String> {
    let output = tokio::process::Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .await
        .with_context(|| format!("running {}", kubectl.display()))?;
    if !output.status.success() {
        bail!(
            "kubectl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// `up --clusters-only` is just the two clusters, and their schedulers schedule: a plain
/// pod created with `kubectl run` in the upper cluster is bound to its regular node. (The
/// upper kube-scheduler used to call a scheduler extender that this mode never starts,
/// with `ignorable: false`, so every pod stayed Pending: "connection refused".)
#[tokio::test(flavor = "multi_thread")]
async fn clusters_only_schedules_pods_in_the_upper_cluster() -> Result<()> {
    // Built (once, locked) before the deadline below starts; the playground finds the same.
    let binaries = tokio::task::spawn_blocking(Binaries::locate).await??;
    let kubectl_bin = binaries.bin("kubectl");
    let mut playground = Playground::up(&[
        "--clusters-only",
        "--upper-nodes",
        "1",
        "--lower-nodes",
        "1",
    ])?;
    playground.ready(Duration::from_secs(180)).await?;
    let upper = playground.kubeconfig("upper");

    // Retried: the namespace's default ServiceAccount may not exist yet.
    let run = [
        "run",
        "probe",
        "--image=registry.k8s.io/pause:3.10",
        "--restart=Never",
    ];
    wait_for("kubectl run probe", Duration::from_secs(30), || async {
        match kubectl(&kubectl_bin, &upper, &run).await {
            Ok(_) => Ok(Some(())),
            Err(error) if format!("{error:#}").contains("AlreadyExists") => Ok(Some(())),
            Err(error) => Err(error),
        }
    })
    .await?;
    let get = ["get", "pod", "probe", "-o", "jsonpath={.spec.nodeName}"];
    let scheduled = wait_for(
        "pod probe scheduled in the upper cluster",
        Duration::from_secs(30),
        || async {
            let node = kubectl(&kubectl_bin, &upper, &get).await?;
            Ok((!node.trim().is_empty()).then(|| node.trim().to_owned()))
        },
    )
    .await;
    let node = match scheduled {
        Ok(node) => node,
        Err(error) => {
            let conditions = ["get", "pod", "probe", "-o", "jsonpath={.status.conditions}"];
            let why = kubectl(&kubectl_bin, &upper, &conditions)
                .await
                .unwrap_or_else(|e| format!("{e:#}"));
            return Err(error.context(format!("pod probe's conditions: {why}")));
        }
    };
    assert_eq!(
        node, "upper-node-0",
        "the upper cluster's only regular node"
    );

    playground.down().await
}

/// `up --install` is tensile installed by its chart: every pod of the release Running on the
/// upper real node, and `vk-demo` on `vk-node` through the in-cluster virtual-node, its log
/// and a command in it read with kubectl as a user does.
#[tokio::test(flavor = "multi_thread")]
async fn install_runs_tensile_from_its_chart_and_vk_demo_through_it() -> Result<()> {
    let binaries = tokio::task::spawn_blocking(Binaries::locate).await??;
    let kubectl_bin = binaries.bin("kubectl");
    let mut playground = Playground::up(&["--install", "--lower-nodes", "1"])?;
    playground.ready(Duration::from_secs(300)).await?;
    let upper = playground.kubeconfig("upper");

    let placed = kubectl(
        &kubectl_bin,
        &upper,
        &[
            "get",
            "pods",
            "-n",
            "tensile-system",
            "-o",
            "jsonpath={range .items[*]}{.spec.nodeName} {.status.phase}{\"\\n\"}{end}",
        ],
    )
    .await?;
    let lines: Vec<&str> = placed.lines().collect();
    assert_eq!(lines.len(), 7, "tensile's pods: {placed}");
    assert!(
        lines.iter().all(|l| *l == "upper-real-0 Running"),
        "tensile's pods on the upper real node: {placed}"
    );
    let node = kubectl(
        &kubectl_bin,
        &upper,
        &["get", "pod", "vk-demo", "-o", "jsonpath={.spec.nodeName}"],
    )
    .await?;
    assert_eq!(node, "vk-node");
    let logs = kubectl(&kubectl_bin, &upper, &["logs", "vk-demo"]).await?;
    assert!(logs.contains("hello from vk-demo"), "{logs}");
    let said = kubectl(
        &kubectl_bin,
        &upper,
        &["exec", "vk-demo", "--", "echo", "hi"],
    )
    .await?;
    assert_eq!(said.trim(), "hi");

    playground.down().await
}

/// `up --kueue` is batch bursting as a user tries it: more one-CPU Jobs from
/// `deploy/examples/kueue/job.yaml` than flavor `local` (the regular node) has quota for,
/// created with `kubectl create -f`; Kueue admits the first to `local`, whose pods run on
/// the regular node, and the rest to `burst`, whose pods run on vk-node (their lower copies
/// completed by the harness's kwok Stage), and every Job completes.
#[tokio::test(flavor = "multi_thread")]
async fn kueue_fills_the_regular_node_then_bursts_and_every_job_completes() -> Result<()> {
    let binaries = tokio::task::spawn_blocking(Binaries::locate).await??;
    let kubectl_bin = binaries.bin("kubectl");
    let mut playground = Playground::up(&["--kueue", "--lower-nodes", "1"])?;
    playground.ready(Duration::from_secs(240)).await?;
    let upper = playground.kubeconfig("upper");

    let quota = kubectl(
        &kubectl_bin,
        &upper,
        &[
            "get",
            "clusterqueue",
            "cluster-queue",
            "-o",
            "jsonpath={.spec.resourceGroups[0].flavors[0].name} \
             {.spec.resourceGroups[0].flavors[0].resources[0].name} \
             {.spec.resourceGroups[0].flavors[0].resources[0].nominalQuota}",
        ],
    )
    .await?;
    // The regular node's allocatable: the harness's default shape.
    assert_eq!(quota, "local cpu 8", "flavor local's CPU quota");
    let jobs = 8 + 2;
    let job = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/examples/kueue/job.yaml");
    let job = job.to_str().context("the job's path")?;
    for _ in 0..jobs {
        kubectl(&kubectl_bin, &upper, &["create", "-f", job]).await?;
    }

    // Job, workload flavor and node of every Job once all are complete.
    let get_jobs = [
        "get",
        "jobs",
        "-o",
        "jsonpath={range .items[*]}{.metadata.name} \
         {.status.conditions[?(@.type==\"Complete\")].status}{\"\\n\"}{end}",
    ];
    let complete = wait_for(
        &format!("{jobs} Jobs complete"),
        Duration::from_secs(120),
        || async {
            let listed = kubectl(&kubectl_bin, &upper, &get_jobs).await?;
            let lines: Vec<&str> = listed.lines().collect();
            let done = lines.len() == jobs && lines.iter().all(|l| l.ends_with(" True"));
            Ok(done.then_some(listed))
        },
    )
    .await;
    if let Err(error) = complete {
        let state = kubectl(
            &kubectl_bin,
            &upper,
            &["get", "workloads,jobs,pods", "-o", "wide"],
        )
        .await
        .unwrap_or_else(|e| format!("{e:#}"));
        return Err(error.context(state));
    }
    let flavors = kubectl(
        &kubectl_bin,
        &upper,
        &[
            "get",
            "workloads",
            "-o",
            "jsonpath={range .items[*]}{.metadata.ownerReferences[0].name} \
             {.status.admission.podSetAssignments[0].flavors.cpu}{\"\\n\"}{end}",
        ],
    )
    .await?;
    let nodes = kubectl(
        &kubectl_bin,
        &upper,
        &[
            "get",
            "pods",
            "-l",
            "batch.kubernetes.io/job-name",
            "-o",
            "jsonpath={range .items[*]}{.metadata.labels.batch\\.kubernetes\\.io/job-name} \
             {.spec.nodeName} {.status.phase}{\"\\n\"}{end}",
        ],
    )
    .await?;
    let flavor_of: std::collections::BTreeMap<&str, &str> =
        flavors.lines().filter_map(|l| l.split_once(' ')).collect();
    let mut placed = std::collections::BTreeMap::<(&str, &str), usize>::new();
    for line in nodes.lines() {
        let [job, node, phase] = line.split(' ').collect::<Vec<_>>()[..] else {
            bail!("unexpected pod line {line:?} in\n{nodes}");
        };
        assert_eq!(phase, "Succeeded", "{line}");
        let flavor = flavor_of.get(job).copied().unwrap_or("none");
        *placed.entry((flavor, node)).or_default() += 1;
    }
    // Kueue admits in creation order, and nothing finishes within the first 10 s: the
    // first 8 take local's quota, the other 2 burst.
    let want = std::collections::BTreeMap::from([
        (("burst", "vk-node"), 2),
        (("local", "upper-node-0"), 8),
    ]);
    assert_eq!(
        placed, want,
        "(flavor, node) of each Job's pod:\n{nodes}\n{flavors}"
    );

    playground.down().await
}
