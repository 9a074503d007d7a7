//! Feeds each lower cluster's cache from its API server: a node and a pod watch (the pod
//! watch leaves out terminal pods server-side), and a probe that marks the cluster
//! unreachable while its API server does not answer. A watch that fails (refused, cut,
//! expired) is not trusted until it has listed everything again, which it does at once,
//! with backoff. Nothing here runs on the request path.

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Client, Resource};
use tensile::clusters::load_config;
use tensile::side::Side;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::extender::{SharedCluster, Watched};

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
    let nodes =
        relisting(Api::<Node>::all(client.clone()), watcher::Config::default()).map(|item| {
            match item {
                Ok(event) => Change::Node(Box::new(event)),
                Err(error) => Change::Failed(Watched::Nodes, describe(&error)),
            }
        });
    let pods = relisting(
        Api::<Pod>::all(client),
        watcher::Config::default().fields("status.phase!=Succeeded,status.phase!=Failed"),
    )
    .map(|item| match item {
        Ok(event) => Change::Pod(Box::new(event)),
        Err(error) => Change::Failed(Watched::Pods, describe(&error)),
    });
    let mut events = std::pin::pin!(futures::stream::select(nodes, pods));
    let fold = async {
        loop {
            let event = tokio::select! {
                () = shutdown.cancelled() => return,
                event = events.next() => event,
            };
            let Some(change) = event else { return };
            if let Change::Failed(watched, error) = &change {
                warn!(
                    node = %node, cluster = "lower", watch = watched.name(), %error,
                    "lower watch failed: the virtual node fails filter until it has listed again"
                );
            }
            if let Some(watched) = apply(&mut cluster.write(), change) {
                info!(node = %node, cluster = "lower", watch = watched.name(), "lower watch listed again");
            }
        }
    };
    tokio::join!(fold, probe);
}

/// Folds one watch event into a cluster's state; returns the watch whose complete list
/// ended a failure.
fn apply(state: &mut crate::extender::ClusterState, change: Change) -> Option<Watched> {
    match change {
        Change::Node(event) => match *event {
            Event::Init => state.cache.relist_nodes_start(),
            Event::InitApply(n) | Event::Apply(n) => state.cache.apply_node(&n),
            Event::Delete(n) => state
                .cache
                .delete_node(n.meta().name.as_deref().unwrap_or_default()),
            Event::InitDone => {
                state.cache.relist_nodes_done();
                return state.listed(Watched::Nodes);
            }
        },
        Change::Pod(event) => match *event {
            Event::Init => state.cache.relist_pods_start(),
            Event::InitApply(p) | Event::Apply(p) => state.cache.apply_pod(&p),
            Event::Delete(p) => state.cache.delete_pod(&p),
            Event::InitDone => {
                state.cache.relist_pods_done();
                return state.listed(Watched::Pods);
            }
        },
        Change::Failed(watched, error) => state.watch_failed(watched, error),
    }
    None
}

enum Change {
    Node(Box<Event<Node>>),
    Pod(Box<Event<Pod>>),
    Failed(Watched, String),
}

/// A watcher that starts over with a complete list after any error, backing off between
/// attempts. kube-runtime's own resumes from its last resourceVersion where it can (after
/// a 403 on the watch, a cut connection): that never says whether anything was missed,
/// so the cache would stay "not trusted" for good.
fn relisting<K>(
    api: Api<K>,
    config: watcher::Config,
) -> impl futures::Stream<Item = Result<Event<K>, watcher::Error>> + Send
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    restarting(move || watcher::watcher(api.clone(), config.clone()).boxed()).default_backoff()
}

/// The items of streams `start` makes, one after the other: a stream is dropped after it
/// yields an error and the next one started.
fn restarting<S, T, E>(start: impl FnMut() -> S) -> impl futures::Stream<Item = Result<T, E>>
where
    S: futures::Stream<Item = Result<T, E>> + Unpin,
{
    futures::stream::unfold((start, None), |(mut start, current)| async move {
        let mut stream: S = current.unwrap_or_else(&mut start);
        let item = stream.next().await?;
        let current = item.is_ok().then_some(stream);
        Some((item, (start, current)))
    })
}

/// A watch failure in a few words: what failed, and the API server's code and message.
fn describe(error: &watcher::Error) -> String {
    let api = |what: &str, error: &kube::Error| match error {
        kube::Error::Api(status) => format!(
            "{what}: {} {}: {}",
            status.code, status.reason, status.message
        ),
        other => format!("{what}: {other}"),
    };
    match error {
        watcher::Error::InitialListFailed(e) => api("list", e),
        watcher::Error::WatchStartFailed(e) => api("watch", e),
        watcher::Error::WatchFailed(e) => api("watch stream", e),
        watcher::Error::WatchError(status) => format!(
            "watch ended: {} {}: {}",
            status.code, status.reason, status.message
        ),
        other => other.to_string(),
    }
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn an_error_starts_the_stream_over() {
        let mut started = 0;
        let items = restarting(|| {
            started += 1;
            let script: Vec<Result<u32, &str>> = match started {
                1 => vec![Ok(1), Err("refused"), Ok(99)],
                _ => vec![Ok(2), Ok(3)],
            };
            futures::stream::iter(script)
        });
        let seen: Vec<_> = futures::executor::block_on(items.collect());
        assert_eq!(seen, [Ok(1), Err("refused"), Ok(2), Ok(3)]);
    }

    #[test]
    fn failures_in_a_few_words() {
        let forbidden = kube::core::Status {
            code: 403,
            reason: "Forbidden".into(),
            message: "pods is forbidden".into(),
            ..Default::default()
        };
        let cases = [
            (
                watcher::Error::InitialListFailed(kube::Error::Api(Box::new(forbidden.clone()))),
                "list: 403 Forbidden: pods is forbidden",
            ),
            (
                watcher::Error::WatchStartFailed(kube::Error::Api(Box::new(forbidden.clone()))),
                "watch: 403 Forbidden: pods is forbidden",
            ),
            (
                watcher::Error::WatchError(Box::new(kube::core::Status {
                    code: 410,
                    reason: "Expired".into(),
                    message: "too old resource version".into(),
                    ..Default::default()
                })),
                "watch ended: 410 Expired: too old resource version",
            ),
        ];
        for (error, words) in cases {
            assert_eq!(describe(&error), words);
        }
    }
}
