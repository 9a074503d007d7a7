//! The virtual Node in the upper cluster: registered at start, its capacity kept current
//! from lower watches, its Lease renewed while the lower cluster answers.

pub mod burst;
pub mod capacity;
pub mod groups;
pub mod owner;
pub mod placement;
pub mod quantity;
pub mod resources;
pub mod spec;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use self::burst::{BURST_PRIORITY_LABEL, Burst};
use self::capacity::{LowerCapacity, PodFeed};
use self::groups::{GroupOffer, Groups, offers};
use self::spec::{
    LowerReadiness, NodeConfig, merge_taints, new_node, node_annotations, node_labels, node_status,
};
use crate::clusters::{HEARTBEAT_TIMEOUT, HeartbeatClients};
use crate::side::Side;
use crate::translate::meta::Owner;

/// The Lease is renewed this often…
pub const LEASE_RENEW: Duration = Duration::from_secs(10);
/// …and is valid this long (the kubelet's values).
pub const LEASE_DURATION_SECONDS: i32 = 40;
/// Status is rewritten at least this often even without a change, like a kubelet's
/// `nodeStatusReportFrequency`, so its heartbeat times stay meaningful.
const STATUS_REFRESH: Duration = Duration::from_secs(300);
/// Where node Leases live.
pub const LEASE_NAMESPACE: &str = "kube-node-lease";
const FIELD_MANAGER: &str = "tensile-virtual-node";

/// Failures of the node's API calls; each names the node and the cluster.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// An upper API call failed.
    #[error("upper cluster: {action} node {node}: {source}")]
    Upper {
        /// What was being done.
        action: &'static str,
        /// The node.
        node: String,
        /// The API error.
        source: kube::Error,
    },
    /// A heartbeat call got no answer in time.
    #[error("{side} cluster: {action} node {node}: no answer within {timeout:?}")]
    Timeout {
        /// Which cluster.
        side: Side,
        /// What was being done.
        action: &'static str,
        /// The node.
        node: String,
        /// How long it waited.
        timeout: Duration,
    },
    /// A heartbeat client could not be made.
    #[error("{side} cluster: making the heartbeat client of node {node}: {source}")]
    Client {
        /// Which cluster.
        side: Side,
        /// The node.
        node: String,
        /// What went wrong.
        source: kube::Error,
    },
    /// The lower API server's health probe failed.
    #[error("lower cluster: probing the API server for node {node}: {source}")]
    Lower {
        /// The node.
        node: String,
        /// The API error.
        source: kube::Error,
    },
    /// A Node of the name is another's ([`owner::NodeOwner::holding`]): never written.
    #[error(
        "upper cluster: node {node} is not registered: the Node of that name is {holder}'s, not this member's ({owner}); rename the member (--nodename, tensile.dev/node-name) or delete that Node"
    )]
    Taken {
        /// The node.
        node: String,
        /// Who has it, in words.
        holder: String,
        /// This member, as it would be recorded.
        owner: String,
    },
}

fn upper_error(action: &'static str, node: &str) -> impl FnOnce(kube::Error) -> NodeError {
    let node = node.to_owned();
    move |source| NodeError::Upper {
        action,
        node,
        source,
    }
}

/// Creates the Node, or brings an existing one's labels and taints up to date (keeping
/// taints others added), then writes its status.
pub async fn register(
    upper: &Client,
    config: &NodeConfig,
    capacity: &BTreeMap<String, Quantity>,
    bursting: &Burst,
) -> Result<Node, NodeError> {
    register_as(upper, config, capacity, &LowerReadiness::Ready, bursting)
        .await
        .map(|(node, _)| node)
}

/// [`register`], its status showing `readiness` (a group's virtual node); with whether
/// the Node was created (else it was there, this member's).
pub async fn register_as(
    upper: &Client,
    config: &NodeConfig,
    capacity: &BTreeMap<String, Quantity>,
    readiness: &LowerReadiness,
    bursting: &Burst,
) -> Result<(Node, bool), NodeError> {
    let nodes: Api<Node> = Api::all(upper.clone());
    let name = config.name.as_str();
    let existing = nodes
        .get_opt(name)
        .await
        .map_err(upper_error("reading", name))?;
    let existing_none = existing.is_none();
    let node = match existing {
        None => {
            info!(
                node = name,
                object = name,
                kind = "Node",
                cluster = "upper",
                "registering the virtual node in the upper cluster"
            );
            let mut node = new_node(config);
            node.labels_mut()
                .insert(BURST_PRIORITY_LABEL.into(), bursting.priority.to_string());
            nodes
                .create(&PostParams::default(), &node)
                .await
                .map_err(upper_error("creating", name))?
        }
        Some(node) => {
            let holding = config.owner.holding(&node);
            if let owner::Holding::Another(holder) = holding {
                return Err(NodeError::Taken {
                    node: name.to_owned(),
                    holder,
                    owner: config.owner.mark().to_owned(),
                });
            }
            if holding == owner::Holding::Unrecorded {
                info!(
                    node = name,
                    cluster = "upper",
                    owner = config.owner.mark(),
                    "adopting the virtual node an earlier tensile release registered for this member: recording its owner"
                );
            }
            match node_update(&node, config, bursting.priority) {
                None => node,
                Some(patch) => {
                    if cordoned_by_leave(&node) {
                        info!(
                            node = name,
                            cluster = "upper",
                            "member joins again: lifting the cordon its leave made"
                        );
                    }
                    nodes
                        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .map_err(upper_error("updating", name))?
                }
            }
        }
    };
    let created = existing_none;
    write_status(upper, config, capacity, readiness, &node)
        .await
        .map(|node| (node, created))
}

/// The merge patch (under `node`'s UID) that brings the existing Node `node` to what
/// `config` and burst `priority` say: tensile's labels and annotations (labels it no
/// longer wants removed, [`spec::labels_change`]), its taint (others' kept), and the
/// cordon a leave made lifted (a user's kept); `None` when it is so already.
pub fn node_update(node: &Node, config: &NodeConfig, priority: u32) -> Option<serde_json::Value> {
    let existing_taints = node.spec.as_ref().and_then(|s| s.taints.as_deref());
    let mut labels = node_labels(config);
    labels.insert(BURST_PRIORITY_LABEL.into(), priority.to_string());
    let labels = spec::labels_change(node, &labels, config.lower_selector.is_some());
    let taints = merge_taints(existing_taints, config.taint.as_ref());
    let annotations = node_annotations(config);
    let noted = node.metadata.annotations.clone().unwrap_or_default();
    let annotations_ok = annotations.iter().all(|(k, v)| noted.get(k) == Some(v));
    // A cordon is the user's and kept; only the one a leave made (marked) goes when the
    // member joins again.
    let leave_cordon = cordoned_by_leave(node);
    if labels.is_none() && annotations_ok && taints.as_deref() == existing_taints && !leave_cordon {
        return None;
    }
    let mut patch = json!({
        "metadata": {"uid": node.metadata.uid, "labels": labels.unwrap_or_default(), "annotations": annotations},
        "spec": {"taints": taints},
    });
    if leave_cordon {
        patch["metadata"]["annotations"][CORDONED_BY_ANNOTATION] = json!(null);
        patch["spec"]["unschedulable"] = json!(null);
    }
    Some(patch)
}

/// Brings the labels and annotations of the registered virtual node `uid` up to
/// `config` ([`node_update`]): a group whose lower nodes changed what they agree on. A Node
/// of that name with another UID is not written.
pub async fn relabel(
    upper: &Client,
    config: &NodeConfig,
    uid: &str,
    priority: u32,
) -> Result<(), NodeError> {
    let nodes: Api<Node> = Api::all(upper.clone());
    let name = config.name.as_str();
    let Some(node) = nodes
        .get_opt(name)
        .await
        .map_err(upper_error("reading", name))?
        .filter(|n| n.metadata.uid.as_deref() == Some(uid))
    else {
        return Ok(());
    };
    if let Some(patch) = node_update(&node, config, priority) {
        info!(
            node = name,
            cluster = "upper",
            "the group's lower nodes agree on other labels: updating the virtual node's"
        );
        nodes
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(upper_error("updating", name))?;
    }
    Ok(())
}

/// Set by a member's leave beside the cordon it makes, so that the cordon is told from a
/// user's (which virtual-node never lifts).
pub const CORDONED_BY_ANNOTATION: &str = "tensile.dev/cordoned-by";
/// [`CORDONED_BY_ANNOTATION`]'s value on a leave's cordon.
pub const CORDONED_BY_LEAVE: &str = "leave";

/// Whether `node` is cordoned by a member's leave (not by a user).
pub fn cordoned_by_leave(node: &Node) -> bool {
    self::resources::node_cordoned(node)
        && node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(CORDONED_BY_ANNOTATION))
            .is_some_and(|v| v == CORDONED_BY_LEAVE)
}

async fn write_status(
    upper: &Client,
    config: &NodeConfig,
    capacity: &BTreeMap<String, Quantity>,
    readiness: &LowerReadiness,
    previous: &Node,
) -> Result<Node, NodeError> {
    let status = node_status(
        config,
        capacity,
        readiness,
        previous.status.as_ref(),
        Time(Timestamp::now()),
    );
    // Only while it is the Node registered (its UID).
    let patch = json!({ "metadata": {"uid": previous.metadata.uid}, "status": status });
    Api::<Node>::all(upper.clone())
        .patch_status(&config.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(upper_error("writing the status of", &config.name))
}

/// Folds the lower cluster's node watch and its two pod watches (the pods that are not
/// ours, [`PodFeed`]) into [`LowerCapacity`] and publishes each new capacity, and with
/// `grouped` each group's offer ([`GroupWatch`]). Returns when `shutdown` fires.
pub async fn watch_capacity(
    lower: Client,
    owner: Owner,
    tx: watch::Sender<Option<BTreeMap<String, Quantity>>>,
    mut grouped: Option<GroupWatch>,
    shutdown: CancellationToken,
) {
    let mut capacity = LowerCapacity::new(&owner);
    // Published once even when the lower cluster has no group.
    let mut groups_changed = true;
    let nodes = watcher(Api::<Node>::all(lower.clone()), watcher::Config::default())
        .map_ok(|e| Change::Node(Box::new(e)))
        .boxed();
    let pods = PodFeed::ALL.map(|feed| {
        let config = watcher::Config::default().labels(&feed.selector(&owner));
        watcher(Api::<Pod>::all(lower.clone()), config)
            .map_ok(move |e| Change::Pod(feed, Box::new(e)))
            .boxed()
    });
    let mut events = futures::stream::select_all(std::iter::once(nodes).chain(pods));
    let mut nodes_synced = false;
    let mut pods_synced = [false; PodFeed::ALL.len()];
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return,
            event = events.next() => event,
        };
        match event {
            None => return,
            Some(Err(error)) => {
                warn!(%error, cluster = "lower", "watching nodes and pods for capacity");
                continue;
            }
            Some(Ok(Change::Node(event))) => {
                nodes_synced |= matches!(*event, Event::InitDone);
                let groups = grouped.as_mut().map(|g| &mut g.groups);
                let changed = match *event {
                    Event::Init => {
                        capacity.relist_nodes_start();
                        if let Some(groups) = groups {
                            groups.relist_start();
                        }
                        None
                    }
                    Event::InitApply(n) | Event::Apply(n) => {
                        capacity.apply_node(&n);
                        groups.map(|g| g.apply_node(&n))
                    }
                    Event::Delete(n) => {
                        let name = n.meta().name.as_deref().unwrap_or_default();
                        capacity.delete_node(name);
                        groups.map(|g| g.delete_node(name))
                    }
                    Event::InitDone => {
                        capacity.relist_nodes_done();
                        groups.map(Groups::relist_done)
                    }
                };
                groups_changed |= changed.is_some_and(|c| !c.is_empty());
            }
            Some(Ok(Change::Pod(feed, event))) => {
                pods_synced[feed.index()] |= matches!(*event, Event::InitDone);
                match *event {
                    Event::Init => capacity.relist_pods_start(feed),
                    Event::InitApply(p) | Event::Apply(p) => capacity.apply_pod(feed, &p),
                    Event::Delete(p) => capacity.delete_pod(feed, &p),
                    Event::InitDone => capacity.relist_pods_done(feed),
                }
            }
        }
        // Only events that moved the sums produce an output to compare and publish.
        if !(nodes_synced && pods_synced.iter().all(|synced| *synced)) {
            continue;
        }
        let total = capacity.capacity_if_changed();
        if let Some(grouped) = grouped.as_ref()
            && (total.is_some() || groups_changed)
        {
            groups_changed = false;
            let now = offers(&grouped.groups, &capacity);
            grouped.tx.send_if_modified(|current| {
                let changed = *current != now;
                if changed {
                    *current = now;
                }
                changed
            });
        }
        if let Some(now) = total {
            tx.send_if_modified(|current| {
                let changed = current.as_ref() != Some(&now);
                if changed {
                    *current = Some(now);
                }
                changed
            });
        }
    }
}

/// For a member of `node` or `label=<key>` granularity: its lower nodes grouped, folded
/// from the capacity's node watch, and where every group's offer is published (by group
/// key) as it changes.
pub struct GroupWatch {
    /// The lower nodes grouped.
    pub groups: Groups,
    /// Every group's offer.
    pub tx: watch::Sender<BTreeMap<String, GroupOffer>>,
}

/// The virtual nodes' cordons (`spec.unschedulable`), by name, from one upper watch of the
/// Nodes labelled `type=virtual-kubelet` (one watch however many members share it): what
/// decides, per pod, whether its own node takes new pods. A Node deleted is forgotten.
pub struct Cordons {
    nodes: std::sync::Mutex<HashMap<String, bool>>,
    /// Counts the cordons lifted: each wakes the pods held back.
    lifted: watch::Sender<u64>,
    /// Whether the watch has listed once.
    listed: watch::Sender<bool>,
}

impl Default for Cordons {
    fn default() -> Self {
        Self {
            nodes: std::sync::Mutex::default(),
            lifted: watch::Sender::new(0),
            listed: watch::Sender::new(false),
        }
    }
}

impl Cordons {
    /// Whether `node` is cordoned as last seen (false for a node not seen).
    pub fn is_cordoned(&self, node: &str) -> bool {
        self.lock().get(node).copied().unwrap_or(false)
    }

    /// Returns once the watch has listed every virtual node (their cordons are known).
    pub async fn listed(&self) {
        let mut listed = self.listed.subscribe();
        // The sender lives as long as `self`.
        let _ = listed.wait_for(|l| *l).await;
    }

    /// Changes each time a cordon is lifted (or a cordoned node goes).
    pub fn lifted(&self) -> watch::Receiver<u64> {
        self.lifted.subscribe()
    }

    /// Records `node`'s cordon as just read (the watch's, or a registration's).
    pub fn set(&self, node: &str, cordoned: bool) {
        let before = self.lock().insert(node.to_owned(), cordoned);
        if before != Some(cordoned) && (before.is_some() || cordoned) {
            info!(node, cordoned, cluster = "upper", "node cordon changed");
        }
        if before == Some(true) && !cordoned {
            self.lifted.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Forgets `node` (deleted).
    fn forget(&self, node: &str) {
        if self.lock().remove(node) == Some(true) {
            self.lifted.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// How many nodes it holds.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, bool>> {
        self.nodes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps every virtual node's cordon current until `shutdown`.
    pub async fn watch(self: std::sync::Arc<Self>, upper: Client, shutdown: CancellationToken) {
        let (key, value) = crate::translate::meta::VIRTUAL_NODE_LABEL;
        let config = watcher::Config::default().labels(&format!("{key}={value}"));
        let mut events = watcher(Api::<Node>::all(upper), config).boxed();
        let mut listed = std::collections::HashSet::new();
        loop {
            let event = tokio::select! {
                () = shutdown.cancelled() => return,
                event = events.next() => event,
            };
            match event {
                None => return,
                Some(Err(error)) => {
                    warn!(%error, cluster = "upper", "watching the virtual nodes for cordons");
                }
                Some(Ok(Event::Init)) => listed.clear(),
                Some(Ok(Event::InitApply(node))) => {
                    let name = node.name_any();
                    self.set(&name, self::resources::node_cordoned(&node));
                    listed.insert(name);
                }
                Some(Ok(Event::Apply(node))) => {
                    self.set(&node.name_any(), self::resources::node_cordoned(&node));
                }
                Some(Ok(Event::Delete(node))) => self.forget(&node.name_any()),
                // A node deleted while the watch was away is not in the new list.
                Some(Ok(Event::InitDone)) => {
                    let gone: Vec<String> = self
                        .lock()
                        .keys()
                        .filter(|n| !listed.contains(*n))
                        .cloned()
                        .collect();
                    for node in gone {
                        self.forget(&node);
                    }
                    listed = std::collections::HashSet::new();
                    self.listed.send_replace(true);
                }
            }
        }
    }
}

enum Change {
    Node(Box<Event<Node>>),
    Pod(PodFeed, Box<Event<Pod>>),
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

/// One cluster's heartbeat client ([`HeartbeatClients`]), shared by the virtual nodes of
/// one member (a member of `node` granularity may have a thousand: a client each, with its
/// connections and TLS sessions, cost more than the rest of a virtual node), made anew
/// after a call on it failed so that the next call never waits on a connection that
/// stopped answering (the kubelet closes its heartbeat connections on a failure the same
/// way, kubernetes#48638). Calls in flight keep the client they started on.
#[derive(Clone)]
pub struct SharedBeat {
    clients: HeartbeatClients,
    current: Arc<Mutex<BeatClient>>,
}

/// The client a [`SharedBeat`] hands out, and which one it is.
#[derive(Default)]
struct BeatClient {
    /// Counts the clients made, so a failure on an old one does not drop a newer one.
    made: u64,
    client: Option<Client>,
    /// When the API server last answered a health probe.
    answered: Option<tokio::time::Instant>,
}

/// A lower health probe answered this recently counts for every virtual node of the
/// member (shorter than [`LEASE_RENEW`], so a lone node probes at each renewal as before;
/// a thousand nodes probe about once in this time, not a thousand times per renewal).
const SHARED_PROBE: Duration = HEARTBEAT_TIMEOUT;

impl SharedBeat {
    /// No client yet: the first call makes it.
    pub fn new(clients: HeartbeatClients) -> Self {
        Self {
            clients,
            current: Arc::new(Mutex::new(BeatClient::default())),
        }
    }

    fn side(&self) -> Side {
        self.clients.side()
    }

    /// The current client (made if there is none) and which one it is.
    fn client(&self) -> Result<(u64, Client), kube::Error> {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(client) = &current.client {
            return Ok((current.made, client.clone()));
        }
        let client = self.clients.build()?;
        current.made += 1;
        current.client = Some(client.clone());
        Ok((current.made, client))
    }

    /// A call on client `made` failed: the next call makes a new one, unless another
    /// failure already did. A probe's answer no longer counts.
    fn failed(&self, made: u64) {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        current.answered = None;
        if current.made == made {
            current.client = None;
        }
    }

    /// The API server answered a health probe now.
    fn answered(&self) {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        current.answered = Some(tokio::time::Instant::now());
    }

    /// Whether the API server answered a health probe within `within`.
    fn answered_within(&self, within: Duration) -> bool {
        let current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        current.answered.is_some_and(|at| at.elapsed() < within)
    }
}

/// One node's calls on a [`SharedBeat`].
struct Beat {
    shared: SharedBeat,
    node: String,
}

impl Beat {
    fn new(shared: SharedBeat, node: &str) -> Self {
        Self {
            shared,
            node: node.to_owned(),
        }
    }

    /// Runs `call` on the heartbeat client within [`HEARTBEAT_TIMEOUT`]; on a failure or a
    /// timeout the client, and with it its connections, is dropped.
    async fn call<T, F>(
        &mut self,
        action: &'static str,
        call: impl FnOnce(Client) -> F,
    ) -> Result<T, NodeError>
    where
        F: Future<Output = Result<T, NodeError>>,
    {
        let side = self.shared.side();
        let (made, client) = self.shared.client().map_err(|source| NodeError::Client {
            side,
            node: self.node.clone(),
            source,
        })?;
        let outcome = tokio::time::timeout(HEARTBEAT_TIMEOUT, call(client))
            .await
            .unwrap_or_else(|_| {
                Err(NodeError::Timeout {
                    side,
                    action,
                    node: self.node.clone(),
                    timeout: HEARTBEAT_TIMEOUT,
                })
            });
        if outcome.is_err() {
            self.shared.failed(made);
        }
        outcome
    }

    /// [`Beat::call`], tried once more on fresh connections if it fails.
    async fn call_twice<T, F>(
        &mut self,
        action: &'static str,
        call: impl Fn(Client) -> F,
    ) -> Result<T, NodeError>
    where
        F: Future<Output = Result<T, NodeError>>,
    {
        match self.call(action, &call).await {
            Ok(value) => Ok(value),
            Err(error) => {
                debug!(%error, node = %self.node, cluster = %self.shared.side(), "heartbeat call failed; trying once more on new connections");
                self.call(action, &call).await
            }
        }
    }
}

/// What the node offers, as it changes: the lower cluster's room and the member's share
/// (with its burst priority, the node's label).
pub struct Offer {
    /// The lower capacity; `None` until known.
    pub capacity: watch::Receiver<Option<BTreeMap<String, Quantity>>>,
    /// The member's burst priority and share.
    pub bursting: watch::Receiver<Burst>,
}

/// Keeps the node alive: renews the Lease every [`LEASE_RENEW`] while the lower API server
/// answers (so the node goes NotReady through the lease path when it does not, and Ready
/// again when it returns), and rewrites the status when capacity changes, after an outage,
/// and every few minutes. Every call goes through the heartbeat clients (`upper`, `lower`:
/// unthrottled, a timeout on each call, fresh connections after a failure), never behind
/// the controllers' requests. Returns when `shutdown` fires.
pub async fn keep_alive(
    upper: HeartbeatClients,
    lower: HeartbeatClients,
    config: NodeConfig,
    use_lease: bool,
    offer: Offer,
    last: Node,
    shutdown: CancellationToken,
) {
    // Never changes: its sender is gone.
    let readiness = watch::channel(LowerReadiness::Ready).1;
    keep_group_alive(
        SharedBeat::new(upper),
        SharedBeat::new(lower),
        config,
        use_lease,
        offer,
        readiness,
        last,
        shutdown,
    )
    .await;
}

/// How a node's keep-alive ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// On shutdown.
    Shutdown,
    /// Its Node was deleted or replaced.
    Gone,
}

/// [`keep_alive`] for a group's virtual node, on the heartbeat clients its member's nodes
/// share, its status also showing `readiness` (the group's lower nodes), written again as
/// it changes.
/// Returns [`Ended::Gone`] when its Node is deleted or replaced (another UID): what is
/// left of that name is not this node's to keep.
#[allow(clippy::too_many_arguments)]
pub async fn keep_group_alive(
    upper: SharedBeat,
    lower: SharedBeat,
    config: NodeConfig,
    use_lease: bool,
    offer: Offer,
    mut readiness: watch::Receiver<LowerReadiness>,
    mut last: Node,
    shutdown: CancellationToken,
) -> Ended {
    let Offer {
        mut capacity,
        mut bursting,
    } = offer;
    let mut readiness_open = true;
    // What register wrote; a change since then is still to be seen (and written).
    let mut written_readiness = readiness.borrow().clone();
    let mut upper = Beat::new(upper, &config.name);
    let mut lower = Beat::new(lower, &config.name);
    // Kept for its UID and status; what the API server adds for its writers is not read.
    last.metadata.managed_fields = None;
    // The node Lease's UID once it is known to be this Node's (owned by its UID): every
    // renewal is under it.
    let mut lease_uid = None;
    let mut tick = tokio::time::interval(LEASE_RENEW);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut lower_healthy = true;
    let mut last_status_write = tokio::time::Instant::now();
    let mut written_capacity = last.status.as_ref().and_then(|s| s.capacity.clone());
    let mut labelled = last.labels().get(BURST_PRIORITY_LABEL).cloned();
    let mut bursting_open = true;
    loop {
        let mut write = false;
        tokio::select! {
            () = shutdown.cancelled() => return Ended::Shutdown,
            changed = bursting.changed(), if bursting_open => {
                // Closed: the settings never change again (the flags').
                bursting_open = changed.is_ok();
                let share = bursting.borrow_and_update().share.clone();
                let offered = capacity.borrow().as_ref().map(|c| share.cap(c));
                write = offered.is_some() && offered != written_capacity;
            }
            changed = readiness.changed(), if readiness_open => {
                readiness_open = changed.is_ok();
                readiness.mark_unchanged();
                write = readiness_open;
            }
            _ = tick.tick() => {
                // The member's other virtual nodes probe the same API server: an answer
                // one of them had within the last few seconds is this node's too.
                let probe = if lower.shared.answered_within(SHARED_PROBE) {
                    Ok(())
                } else {
                    let probe = lower
                        .call_twice("probing the API server for", |client| {
                            let node = config.name.clone();
                            async move {
                                client
                                    .apiserver_version()
                                    .await
                                    .map(drop)
                                    .map_err(|source| NodeError::Lower { node, source })
                            }
                        })
                        .await;
                    if probe.is_ok() {
                        lower.shared.answered();
                    }
                    probe
                };
                let healthy = probe.is_ok();
                if healthy != lower_healthy {
                    if let Err(error) = probe {
                        warn!(%error, node = %config.name, object = %config.name, kind = "Node", cluster = "lower", "lower API server does not answer; no longer renewing the node's lease");
                    } else {
                        info!(node = %config.name, object = %config.name, kind = "Node", cluster = "lower", "lower API server answers again");
                    }
                }
                // After an outage the node lifecycle controller has marked the node
                // Unknown; only a status write makes it Ready again.
                write |= healthy && !lower_healthy;
                lower_healthy = healthy;
                if !healthy {
                    continue;
                }
                if use_lease {
                    let renewed = upper
                        .call_twice("renewing the lease of", |client| {
                            let (last, node, known) = (&last, config.name.as_str(), lease_uid.clone());
                            async move {
                                renew_lease(&client, last, known)
                                    .await
                                    .map_err(upper_error("renewing the lease of", node))
                            }
                        })
                        .await;
                    match &renewed {
                        Ok(uid) => lease_uid = Some(uid.clone()),
                        // Read again at the next renewal.
                        Err(_) => lease_uid = None,
                    }
                    if let Err(error) = renewed {
                        warn!(%error, node = %config.name, object = %format!("{LEASE_NAMESPACE}/{}", config.name), kind = "Lease", cluster = "upper", "renewing the node lease");
                    }
                } else {
                    write = true;
                }
                write |= last_status_write.elapsed() >= STATUS_REFRESH;
                // A readiness write that failed is tried again.
                write |= *readiness.borrow() != written_readiness;
            }
            changed = capacity.changed() => {
                if changed.is_err() {
                    return Ended::Shutdown;
                }
                // Coalesce a burst of pod events into one write.
                tokio::time::sleep(Duration::from_millis(200)).await;
                let share = bursting.borrow().share.clone();
                let offered = capacity.borrow_and_update().as_ref().map(|c| share.cap(c));
                write = offered != written_capacity;
            }
        }
        let priority = bursting.borrow().priority.to_string();
        if labelled.as_ref() != Some(&priority) {
            let labelled_now = upper
                .call("labelling", |client| {
                    let (node, priority) = (config.name.as_str(), priority.as_str());
                    let uid = last.metadata.uid.clone();
                    async move { label_priority(&client, node, uid, priority).await }
                })
                .await;
            match labelled_now {
                Ok(()) => {
                    info!(node = %config.name, priority, cluster = "upper", "burst priority labelled");
                    labelled = Some(priority);
                }
                // Tried again at the next tick.
                Err(error) => {
                    warn!(%error, node = %config.name, object = %config.name, kind = "Node", cluster = "upper", "labelling the burst priority")
                }
            }
        }
        if !write || !lower_healthy {
            continue;
        }
        let share = bursting.borrow().share.clone();
        let Some(current) = capacity.borrow().as_ref().map(|c| share.cap(c)) else {
            continue;
        };
        let ready = readiness.borrow().clone();
        if ready != written_readiness {
            match &ready {
                LowerReadiness::Ready => {
                    info!(node = %config.name, object = %config.name, kind = "Node", cluster = "upper", "a lower node of the group is Ready: the virtual node is Ready")
                }
                LowerReadiness::GroupNotReady(group) => {
                    warn!(node = %config.name, object = %config.name, kind = "Node", cluster = "upper", %group, "every lower node of the group is NotReady: the virtual node is NotReady")
                }
            }
        }
        let written = upper
            .call("writing the status of", |client| {
                let (config, current, ready, previous) = (&config, &current, &ready, &last);
                async move { write_status(&client, config, current, ready, previous).await }
            })
            .await;
        match written {
            Ok(mut node) => {
                node.metadata.managed_fields = None;
                last = node;
                written_capacity = Some(current);
                written_readiness = ready;
                last_status_write = tokio::time::Instant::now();
            }
            Err(NodeError::Upper { source, .. })
                if crate::api::is_status(&source, 404) || crate::api::is_status(&source, 409) =>
            {
                warn!(node = %config.name, object = %config.name, kind = "Node", cluster = "upper", error = %source,
                    "the virtual node was deleted or replaced (another UID): no longer keeping it");
                return Ended::Gone;
            }
            Err(error) => {
                warn!(%error, node = %config.name, object = %config.name, kind = "Node", cluster = "upper", "node status")
            }
        }
    }
}

/// Writes the burst priority label on node `name`, only while it is the Node of `uid`.
async fn label_priority(
    upper: &Client,
    name: &str,
    uid: Option<String>,
    priority: &str,
) -> Result<(), NodeError> {
    let mut patch = json!({"metadata": {"labels": { BURST_PRIORITY_LABEL: priority }}});
    if let Some(uid) = uid {
        patch["metadata"]["uid"] = uid.into();
    }
    Api::<Node>::all(upper.clone())
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(drop)
        .map_err(upper_error("labelling", name))
}

/// Renews the node Lease of `node`, under `known` (the Lease's UID, once read and found
/// owned by this Node); a Lease of that name another Node owns is not renewed (an error).
/// Creates it, owned by the Node, if there is none. The Lease's UID.
async fn renew_lease(
    upper: &Client,
    node: &Node,
    known: Option<String>,
) -> Result<String, kube::Error> {
    let name = node.metadata.name.clone().unwrap_or_default();
    let node_uid = node.metadata.uid.clone().unwrap_or_default();
    let leases: Api<Lease> = Api::namespaced(upper.clone(), LEASE_NAMESPACE);
    let now = MicroTime(Timestamp::now());
    let spec = json!({
        "holderIdentity": name,
        "leaseDurationSeconds": LEASE_DURATION_SECONDS,
        "renewTime": now,
    });
    let uid = match known {
        Some(uid) => uid,
        None => match leases.get_opt(&name).await? {
            Some(lease) => {
                let owned = lease
                    .owner_references()
                    .iter()
                    .any(|o| o.kind == "Node" && o.uid == node_uid);
                if !owned {
                    return Err(kube::Error::Service(
                        format!(
                            "the Lease {LEASE_NAMESPACE}/{name} is another Node's: not renewed"
                        )
                        .into(),
                    ));
                }
                lease.uid().unwrap_or_default()
            }
            None => {
                // Owned by the Node, as a kubelet's lease is, so it goes when the node does.
                let lease: Lease = serde_json::from_value(json!({
                    "metadata": {
                        "name": name,
                        "namespace": LEASE_NAMESPACE,
                        "ownerReferences": [{
                            "apiVersion": "v1", "kind": "Node", "name": name, "uid": node_uid,
                        }],
                    },
                    "spec": spec,
                }))
                .map_err(kube::Error::SerdeError)?;
                let created = leases.create(&PostParams::default(), &lease).await?;
                return Ok(created.uid().unwrap_or_default());
            }
        },
    };
    let patch = json!({"metadata": {"uid": uid}, "spec": spec});
    leases
        .patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Merge(&patch),
        )
        .await?;
    Ok(uid)
}
