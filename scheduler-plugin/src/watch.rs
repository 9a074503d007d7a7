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
use tensile::clusters::{load_config, load_kubeconfig};
use tensile::side::Side;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::cli::LowerCluster;
use crate::extender::{SharedCluster, Watched};
use crate::upper::SharedUpperNodes;

/// How often the lower API server is probed.
const PROBE_INTERVAL: Duration = Duration::from_secs(5);
/// A probe not answered by then counts as a failure.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Why a lower cluster could not be connected to.
#[derive(thiserror::Error, Debug)]
pub enum WatchError {
    /// Its kubeconfig could not be loaded, or one from a Secret asks for more than its
    /// inline credentials (the source names the file and the field).
    #[error("virtual node {node}: {source}")]
    Kubeconfig {
        /// The virtual node.
        node: String,
        /// The kubeconfig.
        path: PathBuf,
        /// Why.
        source: tensile::clusters::StartupError,
    },
    /// The upper cluster's kubeconfig could not be loaded, or no client built from it.
    #[error("upper cluster (for its node labels): {0}")]
    Upper(String),
    /// No client could be built from it.
    #[error("lower cluster of {node}: {source}")]
    Client {
        /// The virtual node.
        node: String,
        /// Why.
        source: kube::Error,
    },
}

/// A client of the lower cluster of `cluster`'s virtual node, from its kubeconfig read at
/// its trust: one from a Secret may hold inline credentials only.
pub async fn lower_client(cluster: &LowerCluster) -> Result<Client, WatchError> {
    let LowerCluster {
        node,
        kubeconfig,
        trust,
    } = cluster;
    let config = load_kubeconfig(Side::Lower, kubeconfig, *trust)
        .await
        .map_err(|source| WatchError::Kubeconfig {
            node: node.clone(),
            path: kubeconfig.clone(),
            source,
        })?;
    Client::try_from(config).map_err(|source| WatchError::Client {
        node: node.clone(),
        source,
    })
}

/// Keeps `cluster` current from `client` until `shutdown`. `siblings` are the other
/// lower clusters: a lower copy appearing here ends its upper pod's assumptions there too.
pub async fn run(
    node: String,
    client: Client,
    cluster: SharedCluster,
    siblings: Vec<SharedCluster>,
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
            let applied = apply(&mut cluster.write(), change);
            if let Some(watched) = applied.listed_again {
                info!(node = %node, cluster = "lower", watch = watched.name(), "lower watch listed again");
            }
            if let Some(uid) = applied.mirrored {
                // It passed filter on other virtual nodes too; it went to this one.
                for sibling in &siblings {
                    sibling.write().cache.release(&uid);
                }
            }
        }
    };
    tokio::join!(fold, probe);
}

/// A client of the upper cluster, from `kubeconfig` (else `~/.kube/config`, else
/// in-cluster), for the upper Node watch.
pub async fn upper_client(kubeconfig: Option<&Path>) -> Result<Client, WatchError> {
    let config = load_config(Side::Upper, kubeconfig)
        .await
        .map_err(|e| WatchError::Upper(e.to_string()))?;
    Client::try_from(config).map_err(|e| WatchError::Upper(e.to_string()))
}

/// Keeps `nodes` current from the upper cluster's Nodes (metadata only: their labels say
/// which are virtual and their burst priority) until `shutdown`.
pub async fn run_upper(client: Client, nodes: SharedUpperNodes, shutdown: CancellationToken) {
    let api = Api::<kube::core::PartialObjectMeta<Node>>::all(client);
    let config = watcher::Config::default();
    let events =
        restarting(move || watcher::watcher(api.clone(), config.clone()).boxed()).default_backoff();
    let mut events = std::pin::pin!(events);
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return,
            event = events.next() => event,
        };
        let Some(event) = event else { return };
        let mut state = nodes.write();
        match event {
            Ok(Event::Init) => state.relist_start(),
            Ok(Event::InitApply(n) | Event::Apply(n)) => state.apply(&n.metadata),
            Ok(Event::Delete(n)) => state.delete(n.metadata.name.as_deref().unwrap_or_default()),
            Ok(Event::InitDone) => {
                if state.relist_done() {
                    info!(
                        cluster = "upper",
                        watch = "nodes",
                        "upper node watch listed again"
                    );
                }
            }
            Err(error) => {
                let error = describe(&error);
                warn!(
                    cluster = "upper", watch = "nodes", %error,
                    "upper node watch failed: prioritize uses the last known labels until it lists again"
                );
                state.failed(error);
            }
        }
    }
}

/// What folding an event did that reaches beyond the cluster's state.
#[derive(Debug, Default, PartialEq)]
struct Applied {
    /// The watch whose complete list ended a failure.
    listed_again: Option<Watched>,
    /// The upper pod whose lower copy appeared, ending its assumption.
    mirrored: Option<String>,
}

/// Folds one watch event into a cluster's state.
fn apply(state: &mut crate::extender::ClusterState, change: Change) -> Applied {
    let mut applied = Applied::default();
    match change {
        Change::Node(event) => match *event {
            Event::Init => state.cache.relist_nodes_start(),
            Event::InitApply(n) | Event::Apply(n) => state.cache.apply_node(&n),
            Event::Delete(n) => state
                .cache
                .delete_node(n.meta().name.as_deref().unwrap_or_default()),
            Event::InitDone => {
                state.cache.relist_nodes_done();
                applied.listed_again = state.listed(Watched::Nodes);
            }
        },
        Change::Pod(event) => match *event {
            Event::Init => state.cache.relist_pods_start(),
            Event::InitApply(p) | Event::Apply(p) => applied.mirrored = state.cache.apply_pod(&p),
            Event::Delete(p) => state.cache.delete_pod(&p),
            Event::InitDone => {
                state.cache.relist_pods_done();
                applied.listed_again = state.listed(Watched::Pods);
            }
        },
        Change::Failed(watched, error) => state.watch_failed(watched, error),
    }
    applied
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

/// Connects to every lower cluster (virtual node name, kubeconfig and its trust) and returns
/// `extender` (its settings; its clusters are replaced) over their caches, with the future
/// that keeps them current until `shutdown`. The caches fill in the background; until a
/// cluster has synced its virtual node is unknown.
pub async fn connect(
    clusters: &[LowerCluster],
    mut extender: crate::extender::Extender,
    shutdown: CancellationToken,
) -> Result<
    (
        crate::extender::Extender,
        impl Future<Output = ()> + Send + 'static,
    ),
    WatchError,
> {
    let mut clients = Vec::new();
    for cluster in clusters {
        clients.push((cluster.node.clone(), lower_client(cluster).await?));
    }
    let clusters: Vec<(String, Client, SharedCluster)> = clients
        .into_iter()
        .map(|(node, client)| (node, client, SharedCluster::default()))
        .collect();
    extender.clusters = clusters
        .iter()
        .map(|(node, _, cluster)| (node.clone(), cluster.clone()))
        .collect();
    let mut watches = Vec::new();
    for (node, client, cluster) in clusters {
        let siblings = extender
            .clusters
            .iter()
            .filter(|(other, _)| **other != node)
            .map(|(_, sibling)| sibling.clone())
            .collect();
        watches.push(run(node, client, cluster, siblings, shutdown.clone()));
    }
    Ok((extender, async move {
        futures::future::join_all(watches).await;
    }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tensile::clusters::Trust;

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
    fn events_fold_into_the_state() {
        use crate::extender::ClusterState;
        use serde_json::json;
        let mut state = ClusterState::default();
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": "n1"},
            "status": {"allocatable": {"cpu": "4"}, "conditions": [{"type": "Ready", "status": "True"}]},
        }))
        .unwrap();
        let copy: Pod = serde_json::from_value(json!({
            "metadata": {"name": "a", "namespace": "ns",
                         "annotations": {"tensile.dev/upper-uid": "uid-a"}},
            "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "3"}}}]},
        }))
        .unwrap();
        let node_event = |event| Change::Node(Box::new(event));
        let pod_event = |event| Change::Pod(Box::new(event));
        for change in [
            node_event(Event::Init),
            node_event(Event::InitApply(node)),
            node_event(Event::InitDone),
            pod_event(Event::Init),
            pod_event(Event::InitDone),
        ] {
            assert_eq!(apply(&mut state, change), Applied::default());
        }
        assert_eq!(state.known(), Ok(()));
        let demand = crate::fit::Demand::of(&copy).unwrap();
        state
            .cache
            .assume("uid-a", &demand, std::time::Instant::now() + PROBE_INTERVAL);
        let mirrored = apply(&mut state, pod_event(Event::Apply(copy)));
        assert_eq!(mirrored.mirrored.as_deref(), Some("uid-a"));
        let failed = Change::Failed(Watched::Pods, "list: 403 Forbidden: no".into());
        assert_eq!(apply(&mut state, failed), Applied::default());
        assert!(state.known().is_err());
        apply(&mut state, pod_event(Event::Init));
        assert!(state.known().is_err(), "not until the list is complete");
        let done = apply(&mut state, pod_event(Event::InitDone));
        assert_eq!(done.listed_again, Some(Watched::Pods));
        assert_eq!(state.known(), Ok(()));
        assert_eq!(
            state.cache.len(),
            (1, 0),
            "the relist did not list the copy"
        );
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

    /// What a member Secret's writer puts in the kubeconfig the chart mounts for the
    /// extender (a `--config` entry) is refused before any client is built: the field is
    /// named, and nothing is sent. The operator's own `--cluster` file is read as it is.
    #[tokio::test]
    async fn a_kubeconfig_from_a_secret_may_not_name_the_extenders_token() {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "the-extenders-own-token").unwrap();
        let kubeconfig = |user: &str| {
            format!(
                "apiVersion: v1\nkind: Config\n\
                 clusters: [{{name: l, cluster: {{server: 'https://203.0.113.1:6443'}}}}]\n\
                 users: [{{name: u, user: {{{user}}}}}]\n\
                 contexts: [{{name: l, context: {{cluster: l, user: u}}}}]\n\
                 current-context: l\n"
            )
        };
        // (case, user fields, trust, the error's text or None for a client)
        let cases = [
            (
                "inline token, from a Secret",
                "token: abc".to_owned(),
                Trust::FromSecret,
                None,
            ),
            (
                "inline token, the operator's",
                "token: abc".to_owned(),
                Trust::Operator,
                None,
            ),
            (
                "tokenFile, from a Secret",
                format!("tokenFile: {}", token.display()),
                Trust::FromSecret,
                Some("from a Secret, sets users[u].user.tokenFile: "),
            ),
            (
                "tokenFile, the operator's",
                format!("tokenFile: {}", token.display()),
                Trust::Operator,
                None,
            ),
            (
                "exec, from a Secret",
                "exec: {apiVersion: client.authentication.k8s.io/v1, command: sh}".to_owned(),
                Trust::FromSecret,
                Some("from a Secret, sets users[u].user.exec: "),
            ),
        ];
        for (case, user, trust, want) in cases {
            let path = dir.path().join("vk-b.kubeconfig");
            std::fs::write(&path, kubeconfig(&user)).unwrap();
            let cluster = LowerCluster {
                node: "vk-b".into(),
                kubeconfig: path.clone(),
                trust,
            };
            match (lower_client(&cluster).await, want) {
                (Ok(_), None) => {}
                (Err(error), Some(needle)) => {
                    let error = error.to_string();
                    let prefix = format!(
                        "virtual node vk-b: lower cluster: kubeconfig {}, ",
                        path.display()
                    );
                    assert!(error.starts_with(&prefix), "{case}: {error}");
                    assert!(error.contains(needle), "{case}: {error}");
                }
                (got, want) => panic!("{case}: got {:?}, want {want:?}", got.map(|_| ())),
            }
        }
    }
}
