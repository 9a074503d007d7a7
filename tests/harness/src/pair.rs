//! A pair of independent clusters, `upper` and `lower`, and per-test namespaces.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use tokio::sync::OnceCell;

use crate::binaries::Binaries;
use crate::cluster::{Cluster, ClusterOptions, Component};
use crate::process::{Process, Reaper};
use crate::wait::wait_for;

/// How to start a pair.
#[derive(Clone, Debug)]
pub struct PairOptions {
    /// The upper cluster (where users and virtual nodes live).
    pub upper: ClusterOptions,
    /// The lower cluster (whose capacity the virtual node offers).
    pub lower: ClusterOptions,
    /// State directory; `None` makes a temporary one, removed when the pair ends
    /// (kept when `TENSILE_KEEP_STATE` is set).
    pub dir: Option<PathBuf>,
}

impl Default for PairOptions {
    fn default() -> Self {
        Self {
            upper: ClusterOptions::new(
                "upper",
                0,
                (Ipv4Addr::new(10, 96, 0, 0), 16),
                "10.224.0.0/16",
            ),
            lower: ClusterOptions::new(
                "lower",
                3,
                (Ipv4Addr::new(10, 97, 0, 0), 16),
                "10.244.0.0/16",
            ),
            dir: None,
        }
    }
}

/// Two running clusters. Dropping the pair stops them.
pub struct ClusterPair {
    /// The upper cluster.
    pub upper: Cluster,
    /// The lower cluster.
    pub lower: Cluster,
    /// State directory (logs of every component, PKI, kubeconfigs).
    pub dir: PathBuf,
    /// The Kubernetes binaries in use.
    pub binaries: Binaries,
    reaper: Reaper,
}

static SHARED: OnceCell<ClusterPair> = OnceCell::const_new();

impl ClusterPair {
    /// Starts both clusters side by side and waits until both are ready.
    pub async fn start(options: PairOptions) -> Result<Self> {
        let started = Instant::now();
        let binaries = tokio::task::spawn_blocking(Binaries::locate).await??;
        let (dir, remove) = match &options.dir {
            Some(dir) => {
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("creating {}", dir.display()))?;
                (std::path::absolute(dir)?, false)
            }
            None => {
                let dir = tempfile::Builder::new()
                    .prefix("tensile-harness-")
                    .tempdir()
                    .context("creating a temporary state directory")?
                    .keep();
                (dir, std::env::var_os("TENSILE_KEEP_STATE").is_none())
            }
        };
        let reaper = Reaper::start(&dir.join("pids"), remove.then_some(dir.as_path()))?;
        let (upper, lower) = tokio::try_join!(
            Cluster::start(&binaries, options.upper, &dir, &reaper),
            Cluster::start(&binaries, options.lower, &dir, &reaper),
        )
        .with_context(|| format!("starting the cluster pair (logs in {})", dir.display()))?;
        tracing::info!(dir = %dir.display(), elapsed = ?started.elapsed(), "cluster pair ready");
        Ok(Self {
            upper,
            lower,
            dir,
            binaries,
            reaper,
        })
    }

    /// One pair per test process, started on first use with default options. Tests that
    /// share it keep to their own namespaces and node names. Its processes end with the
    /// test process. Create clients per test: a client is bound to its test's runtime.
    pub async fn shared() -> Result<&'static Self> {
        SHARED
            .get_or_try_init(|| Self::start(PairOptions::default()))
            .await
    }

    /// Starts one more cluster beside the pair, e.g. a second upper cluster whose virtual
    /// node shares the pair's lower cluster. Its state lives in the pair's directory under
    /// `options.name` (which must differ from `upper` and `lower`); its processes end when
    /// it is dropped, or with the test process.
    pub async fn start_cluster(&self, options: ClusterOptions) -> Result<Cluster> {
        Cluster::start(&self.binaries, options, &self.dir, &self.reaper).await
    }

    /// SIGKILLs `component` of `cluster` (one of this pair's) and starts it again; does
    /// not wait for it to serve.
    pub fn restart(&self, cluster: &Cluster, component: Component) -> Result<()> {
        cluster.restart(component, &self.reaper)
    }

    /// Starts `program args` beside the pair (a component under test, e.g. the webhook),
    /// its output in `<dir>/<name>.log`; it ends when dropped, or with the test process.
    pub fn spawn(&self, name: &str, program: &Path, args: &[String]) -> Result<Process> {
        let log = self.dir.join(format!("{name}.log"));
        Process::spawn(name, program, args, &[], &log, &self.reaper)
    }

    pub(crate) fn reaper(&self) -> &Reaper {
        &self.reaper
    }

    /// Path of a Kubernetes binary, e.g. `kubectl`.
    pub fn bin(&self, name: &str) -> PathBuf {
        self.binaries.bin(name)
    }

    /// Stops both clusters.
    pub fn stop(&self) {
        self.upper.stop();
        self.lower.stop();
    }

    /// Kubeconfig of the upper cluster.
    pub fn upper_kubeconfig(&self) -> &Path {
        &self.upper.kubeconfig
    }

    /// Kubeconfig of the lower cluster.
    pub fn lower_kubeconfig(&self) -> &Path {
        &self.lower.kubeconfig
    }
}

impl Drop for ClusterPair {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Creates namespace `name` unless it exists: for a fixed namespace that the shipped
/// manifests name and several tests share (it ends with the pair).
pub async fn ensure_namespace(client: &Client, name: &str) -> Result<()> {
    let mut namespace = Namespace::default();
    namespace.metadata.name = Some(name.to_owned());
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
        Err(error) => Err(error).with_context(|| format!("creating namespace {name}")),
    }
}

/// A namespace of one test, with a generated unique name.
pub struct TestNamespace {
    /// Its name.
    pub name: String,
    client: Client,
}

impl TestNamespace {
    /// Creates `<prefix>-<random>` and waits for its `default` ServiceAccount (pods cannot
    /// be created before it exists).
    pub async fn create(client: &Client, prefix: &str) -> Result<Self> {
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let mut ns = Namespace::default();
        ns.metadata.generate_name = Some(format!("{prefix}-"));
        let created = namespaces
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("creating a namespace {prefix}-*"))?;
        let name = created
            .metadata
            .name
            .context("created namespace has no name")?;
        let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &name);
        wait_for(
            &format!("ServiceAccount {name}/default"),
            Duration::from_secs(30),
            || async { Ok(accounts.get_opt("default").await?.map(|_| ())) },
        )
        .await?;
        Ok(Self {
            name,
            client: client.clone(),
        })
    }

    /// Deletes the namespace (without waiting for its finalization). A busy API server's
    /// transient error (a 5xx, a 429, a connection closed under the request) is retried
    /// for up to 30 s; a namespace already gone or already terminating counts as deleted.
    pub async fn delete(self) -> Result<()> {
        let namespaces = Api::<Namespace>::all(self.client);
        wait_for(
            &format!("namespace {} deleted", self.name),
            Duration::from_secs(30),
            || async {
                match namespaces
                    .delete(&self.name, &DeleteParams::default())
                    .await
                {
                    Ok(_) => Ok(Some(())),
                    Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => {
                        Ok(Some(()))
                    }
                    Err(error) => Err(error).context("deleting it"),
                }
            },
        )
        .await
    }
}
