//! Feeds each lower cluster's cache from its API server: a node and a pod watch (the pod
//! watch leaves out terminal pods server-side), and a probe that marks the cluster
//! unreachable while its API server does not answer. Nothing here runs on the request
//! path.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Client, Resource};
use tensile::clusters::load_config;
use tensile::side::Side;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::extender::SharedCluster;

/// How often the lower API server is probed.
const PROBE_INTERVAL: Duration = Duration::from_secs(5);
/// A probe not answered by then counts as a failure.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Why a lower cluster could not be connected to.
#[derive(thiserror::Error, Debug)]
pub enum WatchError {
    /// Its kubeconfig could not be loaded (the source names the file).
    #[error("virtual node {node}: {source}")]
    Kubeconfig {
        /// The virtual node.
        node: String,
        /// The kubeconfig.
        path: PathBuf,
        /// Why.
        source: tensile::clusters::StartupError,
    },
    /// No client could be built from it.
    #[error("lower cluster of {node}: {source}")]
    Client {
        /// The virtual node.
        node: String,
        /// Why.
        source: kube::Error,
    },
}

/// A client of the lower cluster of `node`, from `kubeconfig`.
pub async fn lower_client(node: &str, kubeconfig: &Path) -> Result<Client, WatchError> {
    let config = load_config(Side::Lower, Some(kubeconfig))
        .await
        .map_err(|source| WatchError::Kubeconfig {
            node: node.to_owned(),
            path: kubeconfig.to_owned(),
            source,
        })?;
    Client::try_from(config).map_err(|source| WatchError::Client {
        node: node.to_owned(),
        source,
    })
}

/// Keeps `cluster` current from `client` until `shutdown`.
pub async fn run(
    node: String,
    client: Client,
    cluster: SharedCluster,
    shutdown: CancellationToken,
) {
    let probe = probe(
        node.clone(),
        client.clone(),
        cluster.clone(),
        shutdown.clone(),
    );
    let nodes = watcher(Api::<Node>::all(client.clone()), watcher::Config::default())
        .map_ok(|e| Change::Node(Box::new(e)));
    let pods = watcher(
        Api::<Pod>::all(client),
        watcher::Config::default().fields("status.phase!=Succeeded,status.phase!=Failed"),
    )
    .map_ok(|e| Change::Pod(Box::new(e)));
    let mut events = std::pin::pin!(futures::stream::select(nodes, pods));
    let fold = async {
        loop {
            let event = tokio::select! {
                () = shutdown.cancelled() => return,
                event = events.next() => event,
            };
            match event {
                None => return,
                Some(Err(error)) => {
                    warn!(%error, node = %node, cluster = "lower", "watching nodes and pods");
                }
                Some(Ok(change)) => apply(&mut cluster.write(), change),
            }
        }
    };
    tokio::join!(fold, probe);
}

/// Folds one watch event into a cluster's state.
fn apply(state: &mut crate::extender::ClusterState, change: Change) {
    match change {
        Change::Node(event) => match *event {
            Event::Init => state.cache.relist_nodes_start(),
            Event::InitApply(n) | Event::Apply(n) => state.cache.apply_node(&n),
            Event::Delete(n) => state
                .cache
                .delete_node(n.meta().name.as_deref().unwrap_or_default()),
            Event::InitDone => {
                state.cache.relist_nodes_done();
                state.nodes_synced = true;
            }
        },
        Change::Pod(event) => match *event {
            Event::Init => state.cache.relist_pods_start(),
            Event::InitApply(p) | Event::Apply(p) => state.cache.apply_pod(&p),
            Event::Delete(p) => state.cache.delete_pod(&p),
            Event::InitDone => {
                state.cache.relist_pods_done();
                state.pods_synced = true;
            }
        },
    }
}

enum Change {
    Node(Box<Event<Node>>),
    Pod(Box<Event<Pod>>),
}

fn watcher<K>(
    api: Api<K>,
    config: watcher::Config,
) -> impl futures::Stream<Item = Result<Event<K>, watcher::Error>> + Send
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    watcher::watcher(api, config).default_backoff()
}

/// Marks the cluster unreachable while its API server does not answer, and reachable
/// again when it does.
async fn probe(node: String, client: Client, cluster: SharedCluster, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(PROBE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let answer = match tokio::time::timeout(PROBE_TIMEOUT, client.apiserver_version()).await {
            Ok(Ok(_)) => None,
            Ok(Err(error)) => Some(error.to_string()),
            Err(_) => Some(format!("no answer within {PROBE_TIMEOUT:?}")),
        };
        let mut state = cluster.write();
        match (&state.unreachable, &answer) {
            (None, Some(error)) => {
                warn!(node = %node, cluster = "lower", %error, "lower API server does not answer")
            }
            (Some(_), None) => {
                info!(node = %node, cluster = "lower", "lower API server answers again")
            }
            _ => {}
        }
        state.unreachable = answer;
    }
}

/// Connects to every lower cluster (virtual node name, kubeconfig) and returns the
/// extender over their caches with the future that keeps them current until `shutdown`.
/// The caches fill in the background; until a cluster has synced its virtual node is
/// unknown.
pub async fn connect(
    clusters: &[(String, PathBuf)],
    on_unknown: crate::extender::OnUnknown,
    shutdown: CancellationToken,
) -> Result<
    (
        crate::extender::Extender,
        impl Future<Output = ()> + Send + 'static,
    ),
    WatchError,
> {
    let mut extender = crate::extender::Extender {
        on_unknown,
        ..Default::default()
    };
    let mut watches = Vec::new();
    for (node, kubeconfig) in clusters {
        let client = lower_client(node, kubeconfig).await?;
        let cluster = SharedCluster::default();
        extender.clusters.insert(node.clone(), cluster.clone());
        watches.push(run(node.clone(), client, cluster, shutdown.clone()));
    }
    Ok((extender, async move {
        futures::future::join_all(watches).await;
    }))
}
