//! The virtual nodes of a member of `node` or `label=<key>` granularity: one Node and
//! Lease per group of lower nodes ([`crate::node::groups`]), registered as its group
//! appears below (a registration that fails is tried again with backoff, the other groups
//! running meanwhile), kept alive with the group's own capacity and readiness (NotReady
//! while every lower node of the group is), cordoned while every lower node of the group
//! is. A group gone below drains its virtual node as a member's leave does
//! ([`super::leave::drain`]: cordoned, its pods evicted, PodDisruptionBudgets respected,
//! the node kept alive meanwhile), then deletes its Node and Lease; should the group come
//! back meanwhile, the drain stops and the leave's cordon is lifted. The ownership marks below stay the member's
//! (`--nodename`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use backon::BackoffBuilder;
use k8s_openapi::api::core::v1::{Node, ObjectReference};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::events::{EventType, Recorder, Reporter};
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

use super::leave::{self, Bound, LeaveError, MemberNode};
use crate::clusters::HeartbeatClients;
use crate::kubelet_api::node_ports::{self, GroupPorts};
use crate::node::burst::Burst;
use crate::node::groups::{
    Granularity, GroupNodes, GroupOffer, LeftBehind, MEMBER_NODE_LABEL, group_requirement,
    left_behind, lower_selector,
};
use crate::node::owner::{Holding, NodeOwner};
use crate::node::spec::{LowerReadiness, NodeConfig};
use crate::node::{self, CORDONED_BY_ANNOTATION, CORDONED_BY_LEAVE, SharedBeat};

/// [`CORDONED_BY_ANNOTATION`]'s value on the cordon of a virtual node whose lower nodes
/// are all cordoned: lifted when one of them is uncordoned (a user's cordon is kept).
pub const CORDONED_BY_LOWER: &str = "lower";

/// The longest wait before a group's registration is tried again.
const MAX_REGISTER_DELAY: Duration = Duration::from_secs(60);

/// What the member's virtual nodes share.
pub struct Fleet {
    pub upper: Client,
    pub upper_heartbeat: HeartbeatClients,
    pub lower_heartbeat: HeartbeatClients,
    /// The member's Node as `cluster` would show it: each group's is this, renamed and
    /// with the group's agreed labels.
    pub base: NodeConfig,
    pub granularity: Granularity,
    pub use_lease: bool,
    pub bursting: watch::Receiver<Burst>,
    /// Where the member's controllers learn its virtual nodes.
    pub nodes: Arc<GroupNodes>,
    /// How long the drain of a group gone below may take (`--leave-timeout`): past it, the
    /// pods left are deleted with no grace period, as a member's leave does.
    pub drain_timeout: Duration,
    /// `--kubelet-port-range`: a kubelet port per virtual node.
    pub ports: Option<GroupPorts>,
    /// Virtual nodes of an earlier run whose group is gone ([`find_left_behind`]):
    /// drained and deleted unless their group is back.
    pub left_behind: Vec<LeftBehind>,
    /// The virtual nodes' cordons, as the member's pods read them: each node's recorded
    /// at its registration.
    pub cordons: Arc<node::Cordons>,
    /// Asks the member's upper pod watch to list again (a Node that has pods joined the
    /// member's virtual nodes after it listed).
    pub replay: watch::Sender<u64>,
}

/// One registered virtual node.
struct Running {
    name: String,
    uid: String,
    capacity: watch::Sender<Option<BTreeMap<String, Quantity>>>,
    readiness: watch::Sender<LowerReadiness>,
    cordoned_below: bool,
    /// The lower labels its group agrees on, as last written.
    labels: BTreeMap<String, String>,
    stop: CancellationToken,
    /// Its own kubelet port (`--kubelet-port-range`), if it has one.
    port: Option<u16>,
}

/// A virtual node to drain: (group key, Node name, its UID if known, its keep-alive if it
/// runs).
type Gone = (String, String, Option<String>, Option<Running>);

/// A group whose registration failed: when it is tried again.
struct Retry {
    at: Instant,
    delays: backon::ExponentialBackoff,
}

/// The drain of a group gone below.
struct Draining {
    /// Which drain (a group may go, come back and go again).
    id: u64,
    /// Stops it (the group came back, or shutdown).
    stop: CancellationToken,
    /// Cancelled once it has ended.
    finished: CancellationToken,
    /// Its virtual node, kept alive until the drain is over (`None`: an earlier run's).
    node: Option<Running>,
}

/// The names of the virtual nodes `offers` asks for, each with what confines its pods
/// below, added to `nodes` before any is registered (so their pods are watched from the
/// start).
pub fn know(nodes: &GroupNodes, granularity: &Granularity, offers: &BTreeMap<String, GroupOffer>) {
    for (key, offer) in offers {
        nodes.insert(&offer.group.name, group_requirement(granularity, key));
    }
}

/// How many times the list of an earlier run's virtual nodes is tried at the start.
const LEFT_BEHIND_TRIES: usize = 4;

/// The member's virtual nodes from an earlier run that no group of `offers` registers
/// ([`left_behind`]: their group went while no process ran), listed once at the start
/// (tried [`LEFT_BEHIND_TRIES`] times with backoff); each is added to `nodes`, so that its
/// pods are the member's, and is drained and deleted by [`Fleet::run`]. A list that keeps
/// failing is logged: those Nodes stay until the next start.
pub async fn find_left_behind(
    upper: &Client,
    (base, owner): (&str, &NodeOwner),
    granularity: &Granularity,
    offers: &BTreeMap<String, GroupOffer>,
    nodes: &GroupNodes,
) -> Vec<LeftBehind> {
    let api: Api<Node> = Api::all(upper.clone());
    let params = ListParams::default().labels(&format!("{MEMBER_NODE_LABEL}={base}"));
    let mut delays = register_delays();
    let mut tries = 0;
    let listed = loop {
        tries += 1;
        match api.list(&params).await {
            Ok(list) => break list.items,
            Err(error) if tries >= LEFT_BEHIND_TRIES => {
                warn!(%error, cluster = "upper", member = base,
                    "listing the member's virtual nodes of an earlier run failed: those whose group is gone are not drained until the next start");
                return Vec::new();
            }
            Err(error) => {
                let delay = delays.next().unwrap_or(MAX_REGISTER_DELAY);
                warn!(%error, cluster = "upper", member = base, retry_in = ?delay,
                    "listing the member's virtual nodes of an earlier run; trying again");
                tokio::time::sleep(delay).await;
            }
        }
    };
    // Only the member's own: a Node labelled with its name by anyone else stays.
    let listed: Vec<Node> = listed
        .into_iter()
        .filter(|n| owner.holding(n).is_ours())
        .collect();
    let found = left_behind(granularity, offers, &listed);
    for node in &found {
        info!(node = %node.name, group = %node.key, cluster = "upper",
            "a virtual node of an earlier run whose group is gone below: it will be drained and deleted");
        nodes.insert(&node.name, node.confinement.clone());
    }
    found
}

fn register_delays() -> backon::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_secs(1))
        .with_max_delay(MAX_REGISTER_DELAY)
        .with_jitter()
        .without_max_times()
        .build()
}

impl Fleet {
    /// Follows `offers` until `shutdown`: a group's virtual node registered as it appears
    /// (tried again with backoff while that fails), its capacity, readiness and cordon
    /// kept, and drained and deleted when the group is gone.
    pub async fn run(
        mut self,
        mut offers: watch::Receiver<BTreeMap<String, GroupOffer>>,
        shutdown: CancellationToken,
    ) -> Result<(), String> {
        let recorder = Recorder::new(
            self.upper.clone(),
            Reporter {
                controller: "tensile-virtual-node".into(),
                instance: Some(format!("fleet/{}", self.base.name)),
            },
        );
        let mut running: HashMap<String, Running> = HashMap::new();
        let mut retrying: HashMap<String, Retry> = HashMap::new();
        let mut draining: HashMap<String, Draining> = HashMap::new();
        let mut beats = JoinSet::new();
        let mut drains: JoinSet<(String, u64)> = JoinSet::new();
        let mut drain_ids = 0_u64;
        // One heartbeat client per cluster for all the member's virtual nodes.
        let beats_on = (
            SharedBeat::new(self.upper_heartbeat.clone()),
            SharedBeat::new(self.lower_heartbeat.clone()),
        );
        let (mut bursting, mut bursting_open) = (self.bursting.clone(), true);
        let mut left_behind = std::mem::take(&mut self.left_behind);
        loop {
            let now = offers.borrow_and_update().clone();
            // The member's share spans all its virtual nodes: each offers its part.
            let parts = bursting.borrow_and_update().share.split(
                &now.iter()
                    .map(|(key, offer)| (key.clone(), offer.capacity.clone()))
                    .collect(),
            );
            let mut ports = self.choose_ports(&now, &running).await;
            let taken: BTreeSet<u16> = running
                .values()
                .filter_map(|r| r.port)
                .chain(ports.values().flatten().copied())
                .collect();
            for (key, offer) in &now {
                let part = parts.get(key).unwrap_or(&offer.capacity);
                if let Some(drain) = draining.remove(key) {
                    let span = info_span!("virtual node", node = %offer.group.name, group = %key);
                    info!(parent: &span, cluster = "upper",
                        "group back below: stopping its virtual node's drain");
                    drain.stop.cancel();
                    drain.finished.cancelled().await;
                    // Still alive (the drain had not come to deleting it): kept, the
                    // drain's cordon lifted; else registered anew below.
                    if let Some(node) = drain.node.filter(|n| !n.stop.is_cancelled()) {
                        self.uncordon(&node.name, &node.uid, CORDONED_BY_LEAVE)
                            .instrument(span)
                            .await;
                        running.insert(key.clone(), node);
                    }
                }
                if let Some(r) = running.get_mut(key) {
                    let priority = bursting.borrow().priority;
                    self.follow(r, key, offer, part, priority).await;
                    continue;
                }
                if retrying.get(key).is_some_and(|r| r.at > Instant::now()) {
                    continue;
                }
                let span = info_span!("virtual node", node = %offer.group.name, group = %key);
                match self
                    .start(
                        key,
                        offer,
                        part,
                        (ports.remove(key).flatten(), &taken),
                        &beats_on,
                        shutdown.child_token(),
                    )
                    .instrument(span.clone())
                    .await
                {
                    Ok((started, beat)) => {
                        retrying.remove(key);
                        beats.spawn(beat.instrument(span));
                        running.insert(key.clone(), started);
                    }
                    Err(error) => {
                        let retry = retrying.entry(key.clone()).or_insert_with(|| Retry {
                            at: Instant::now(),
                            delays: register_delays(),
                        });
                        let delay = retry.delays.next().unwrap_or(MAX_REGISTER_DELAY);
                        retry.at = Instant::now() + delay;
                        warn!(parent: &span, %error, cluster = "upper", retry_in = ?delay,
                            "registering the virtual node failed; trying again (the member's other virtual nodes run on)");
                    }
                }
            }
            let gone = self.gone(&now, &mut retrying, &mut left_behind, &mut running);
            for (key, name, uid, node) in gone {
                drain_ids += 1;
                let (stop, finished) = (shutdown.child_token(), CancellationToken::new());
                let drain = GroupDrain {
                    upper: self.upper.clone(),
                    nodes: self.nodes.clone(),
                    recorder: recorder.clone(),
                    key: key.clone(),
                    name: name.clone(),
                    uid,
                    owner: self.base.owner.clone(),
                    keep_alive: node.as_ref().map(|n| n.stop.clone()),
                    bound: Bound {
                        until: Instant::now() + self.drain_timeout,
                        timeout: self.drain_timeout,
                    },
                };
                let (id, task_stop, done) = (drain_ids, stop.clone(), finished.clone());
                let span = info_span!("virtual node", node = %name, group = %key);
                drains.spawn(
                    async move {
                        let _finished = done.drop_guard();
                        drain.run(&task_stop).await;
                        (drain.key, id)
                    }
                    .instrument(span),
                );
                draining.insert(
                    key,
                    Draining {
                        id,
                        stop,
                        finished,
                        node,
                    },
                );
            }
            let next_retry = retrying.values().map(|r| r.at).min();
            tokio::select! {
                () = shutdown.cancelled() => break,
                changed = offers.changed() => if changed.is_err() { break },
                changed = bursting.changed(), if bursting_open => bursting_open = changed.is_ok(),
                Some(ended) = beats.join_next() => {
                    // Its Node deleted or replaced: not the member's any more (registered
                    // anew, or refused, at the next look).
                    if let Ok((key, node::Ended::Gone)) = ended
                        && let Some(r) = running.remove(&key)
                    {
                        r.stop.cancel();
                        self.nodes.remove(&r.name);
                    }
                }
                Some(done) = drains.join_next() => {
                    if let Ok((key, id)) = done
                        && draining.get(&key).is_some_and(|d| d.id == id)
                    {
                        draining.remove(&key);
                    }
                }
                () = tokio::time::sleep_until(next_retry.unwrap_or_else(Instant::now)), if next_retry.is_some() => {}
            }
        }
        for r in running.values() {
            r.stop.cancel();
        }
        for d in draining.values() {
            d.stop.cancel();
            if let Some(node) = &d.node {
                node.stop.cancel();
            }
        }
        while beats.join_next().await.is_some() {}
        while drains.join_next().await.is_some() {}
        Ok(())
    }

    /// The virtual nodes to drain now that `now` is offered: (group key, Node name, its UID
    /// if known, its keep-alive if it runs). A group gone before it was registered (taken
    /// out of `retrying`): its Node of the name, if the member's from an earlier run; an
    /// earlier run's Node whose group is gone (`left_behind`, looked at once: a group back
    /// meanwhile registers it as its own); a running one whose group is gone (taken out
    /// of `running`, kept alive while it drains, as a leaving member's node is: its pods'
    /// readiness, and so their disruption budgets, stay as they are).
    fn gone(
        &self,
        now: &BTreeMap<String, GroupOffer>,
        retrying: &mut HashMap<String, Retry>,
        left_behind: &mut Vec<LeftBehind>,
        running: &mut HashMap<String, Running>,
    ) -> Vec<Gone> {
        let mut gone = Vec::new();
        let unregistered: Vec<String> = retrying
            .keys()
            .filter(|k| !now.contains_key(*k))
            .cloned()
            .collect();
        for key in unregistered {
            retrying.remove(&key);
            let name =
                crate::node::groups::virtual_node_name(&self.base.name, &self.granularity, &key);
            gone.push((key, name, None, None));
        }
        for node in left_behind.drain(..) {
            if !now.contains_key(&node.key) && !running.contains_key(&node.key) {
                gone.push((node.key, node.name, Some(node.uid), None));
            }
        }
        let registered: Vec<String> = running
            .keys()
            .filter(|k| !now.contains_key(*k))
            .cloned()
            .collect();
        for key in registered {
            if let Some(r) = running.remove(&key) {
                gone.push((key, r.name.clone(), Some(r.uid.clone()), Some(r)));
            }
        }
        gone
    }

    /// Brings the running virtual node `r` of group `key` to what `offer` says: its
    /// capacity (`part` of the member's share), readiness, cordon below and labels (a
    /// relabel that fails is tried again at the next change of the offers).
    async fn follow(
        &self,
        r: &mut Running,
        key: &str,
        offer: &GroupOffer,
        part: &BTreeMap<String, Quantity>,
        priority: u32,
    ) {
        r.capacity.send_if_modified(|c| {
            let changed = c.as_ref() != Some(part);
            if changed {
                *c = Some(part.clone());
            }
            changed
        });
        let readiness = LowerReadiness::of_group(key, offer.group.ready);
        r.readiness.send_if_modified(|r| {
            let changed = *r != readiness;
            *r = readiness;
            changed
        });
        if r.cordoned_below != offer.group.cordoned {
            r.cordoned_below = offer.group.cordoned;
            self.cordon_below(&r.name, &r.uid, r.cordoned_below).await;
        }
        if r.labels != offer.group.labels {
            let config = self.group_config(key, offer, r.port);
            match node::relabel(&self.upper, &config, &r.uid, priority).await {
                Ok(()) => r.labels = offer.group.labels.clone(),
                Err(error) => {
                    warn!(%error, node = %r.name, group = %key, cluster = "upper",
                        "updating the virtual node's labels to what its group agrees on")
                }
            }
        }
    }

    /// The ports of `--kubelet-port-range` for the groups of `now` not yet `running`
    /// ([`node_ports::assign`]), each keeping the one its Node shows from before where it
    /// can; empty without the flag.
    async fn choose_ports(
        &self,
        now: &BTreeMap<String, GroupOffer>,
        running: &HashMap<String, Running>,
    ) -> HashMap<String, Option<u16>> {
        let Some(ports) = &self.ports else {
            return HashMap::new();
        };
        let new: Vec<(&String, &GroupOffer)> = now
            .iter()
            .filter(|(key, _)| !running.contains_key(*key))
            .collect();
        if new.is_empty() {
            return HashMap::new();
        }
        let nodes: Api<Node> = Api::all(self.upper.clone());
        let selector = format!("clusterID={}", self.base.cluster_id);
        // One list, at start all the groups' Nodes at once (their ports from before).
        let before: HashMap<String, u16> = match nodes
            .list(&kube::api::ListParams::default().labels(&selector))
            .await
        {
            Ok(list) => list
                .items
                .into_iter()
                .filter_map(|node| {
                    let port = node
                        .status?
                        .daemon_endpoints?
                        .kubelet_endpoint
                        .map(|e| e.port)?;
                    Some((node.metadata.name?, u16::try_from(port).ok()?))
                })
                .collect(),
            Err(error) => {
                warn!(%error, cluster = "upper", "listing the virtual nodes' kubelet ports from before");
                HashMap::new()
            }
        };
        let taken: BTreeSet<u16> = running.values().filter_map(|r| r.port).collect();
        let wanted: Vec<Option<u16>> = new
            .iter()
            .map(|(_, o)| before.get(&o.group.name).copied())
            .collect();
        let chosen = node_ports::assign(ports.range, &taken, &wanted);
        new.into_iter()
            .map(|(key, _)| key.clone())
            .zip(chosen)
            .collect()
    }

    /// Registers the virtual node of group `key` (lifting the cordon of a drain it comes
    /// back from), cordoned if the group is, offering `part` (its part of the member's
    /// share, [`crate::node::burst::Share::split`]), on `port` of the range (with `taken`,
    /// the range's ports others have) or else the member's; its keep-alive (and its port's
    /// kubelet API), to run until `stop`.
    async fn start(
        &self,
        key: &str,
        offer: &GroupOffer,
        part: &BTreeMap<String, Quantity>,
        (port, taken): (Option<u16>, &BTreeSet<u16>),
        (upper_beat, lower_beat): &(SharedBeat, SharedBeat),
        stop: CancellationToken,
    ) -> Result<
        (
            Running,
            impl Future<Output = (String, node::Ended)> + Send + 'static,
        ),
        String,
    > {
        // A name the member's pod watch did not know when it listed (a group admitted
        // late): pods bound to its Node from an earlier run are handed to it again.
        let known = self.nodes.contains(&offer.group.name);
        self.nodes
            .insert(&offer.group.name, group_requirement(&self.granularity, key));
        let listening = match (&self.ports, port) {
            (Some(ports), Some(port)) => {
                node_ports::listen(ports, port, taken, &offer.group.name, stop.clone()).await
            }
            _ => None,
        };
        let own_port = listening.as_ref().map(|(port, _)| *port);
        let config = self.group_config(key, offer, own_port);
        let bursting = self.bursting.borrow().clone();
        let offered = bursting.share.cap(part);
        let readiness = LowerReadiness::of_group(key, offer.group.ready);
        let (registered, created) =
            match node::register_as(&self.upper, &config, &offered, &readiness, &bursting).await {
                Ok(registered) => registered,
                Err(error) => {
                    // Another's Node (registered since the name was admitted): its pods are
                    // not the member's; the name's admission reads it again and refuses it.
                    if matches!(error, node::NodeError::Taken { .. }) {
                        self.nodes.remove(&config.name);
                    }
                    return Err(format!("node {} (group {key}): {error}", config.name));
                }
            };
        self.cordons
            .set(&config.name, node::resources::node_cordoned(&registered));
        if !known && !created {
            info!(node = %config.name, group = %key, cluster = "upper",
                "a virtual node of an earlier run joins the member late: listing its pods again");
            self.replay.send_modify(|n| *n = n.wrapping_add(1));
        }
        info!(node = %config.name, group = %key, kubelet_port = config.kubelet_port, "virtual node registered");
        if let (Some(ports), None) = (&self.ports, own_port) {
            no_port_left(ports, &registered, self.base.kubelet_port).await;
        }
        let uid = registered.metadata.uid.clone().unwrap_or_default();
        // The cordon a lower cordon made is followed from now on: made if the group is
        // cordoned, lifted if it no longer is (an earlier run's).
        if offer.group.cordoned || cordoned_by(&registered, CORDONED_BY_LOWER) {
            self.cordon_below(&config.name, &uid, offer.group.cordoned)
                .await;
        }
        let (capacity, capacity_rx) = watch::channel(Some(part.clone()));
        let (readiness, readiness_rx) = watch::channel(readiness);
        let beat = node::keep_group_alive(
            upper_beat.clone(),
            lower_beat.clone(),
            config.clone(),
            self.use_lease,
            node::Offer {
                capacity: capacity_rx,
                bursting: self.bursting.clone(),
            },
            readiness_rx,
            registered,
            stop.clone(),
        );
        let (key, beat_stop) = (key.to_owned(), stop.clone());
        let beat = async move {
            let beat = async {
                let ended = beat.await;
                // Its Node gone or another's: its port's kubelet API stops too.
                if ended == node::Ended::Gone {
                    beat_stop.cancel();
                }
                ended
            };
            let ended = match listening {
                Some((_, serving)) => tokio::join!(beat, serving).0,
                None => beat.await,
            };
            (key, ended)
        };
        Ok((
            Running {
                name: config.name,
                uid,
                capacity,
                readiness,
                cordoned_below: offer.group.cordoned,
                labels: offer.group.labels.clone(),
                stop,
                port: own_port,
            },
            beat,
        ))
    }

    /// The Node of group `key` as `offer` shows it, on its own kubelet port `port` if it
    /// has one.
    fn group_config(&self, key: &str, offer: &GroupOffer, port: Option<u16>) -> NodeConfig {
        let confinement = group_requirement(&self.granularity, key);
        NodeConfig {
            name: offer.group.name.clone(),
            group_labels: offer.group.labels.clone(),
            lower_selector: confinement.as_ref().map(lower_selector),
            kubelet_port: port.map_or(self.base.kubelet_port, i32::from),
            ..self.base.clone()
        }
    }

    /// Cordons the virtual node `name` (`uid` as the precondition), marked `by`.
    async fn cordon(&self, name: &str, uid: &str, by: &str) {
        let patch = json!({
            "metadata": {"uid": uid, "annotations": {CORDONED_BY_ANNOTATION: by}},
            "spec": {"unschedulable": true},
        });
        let nodes: Api<Node> = Api::all(self.upper.clone());
        if let Err(error) = nodes
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            warn!(%error, node = name, object = name, kind = "Node", cluster = "upper",
                "cordoning the virtual node");
        }
    }

    /// Follows the cordon of a group's lower nodes: cordons its virtual node when they all
    /// are, and lifts only that cordon (not a user's) when one is uncordoned.
    async fn cordon_below(&self, name: &str, uid: &str, cordoned: bool) {
        if cordoned {
            info!(
                node = name,
                cluster = "upper",
                "every lower node of the group is cordoned: cordoning its virtual node"
            );
            self.cordon(name, uid, CORDONED_BY_LOWER).await;
            return;
        }
        self.uncordon(name, uid, CORDONED_BY_LOWER).await;
    }

    /// Lifts the cordon of the virtual node `name` (`uid` as the precondition) if it is
    /// the one marked `by` (never a user's).
    async fn uncordon(&self, name: &str, uid: &str, by: &str) {
        let nodes: Api<Node> = Api::all(self.upper.clone());
        let ours = match nodes.get_opt(name).await {
            Ok(Some(node)) => cordoned_by(&node, by),
            Ok(None) => false,
            Err(error) => {
                warn!(%error, node = name, cluster = "upper", "reading the virtual node to uncordon it");
                false
            }
        };
        if !ours {
            return;
        }
        info!(
            node = name,
            cluster = "upper",
            by,
            "lifting the virtual node's cordon"
        );
        let patch = json!({
            "metadata": {"uid": uid, "annotations": {CORDONED_BY_ANNOTATION: null}},
            "spec": {"unschedulable": null},
        });
        if let Err(error) = nodes
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            warn!(%error, node = name, cluster = "upper", "uncordoning the virtual node");
        }
    }
}

/// Whether `node` is cordoned with the mark `by`.
fn cordoned_by(node: &Node, by: &str) -> bool {
    node::resources::node_cordoned(node)
        && node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(CORDONED_BY_ANNOTATION))
            .is_some_and(|v| v == by)
}

/// The drain of the virtual node of a group gone below, then its deletion.
struct GroupDrain {
    upper: Client,
    nodes: Arc<GroupNodes>,
    recorder: Recorder,
    key: String,
    name: String,
    /// The Node registered (`None`: a Node of that name from an earlier run, drained only
    /// if it is the member's).
    uid: Option<String>,
    /// The member, whose Node alone is drained.
    owner: NodeOwner,
    /// Stops the Node's keep-alive, once its pods are gone and before it is deleted.
    keep_alive: Option<CancellationToken>,
    bound: Bound,
}

impl GroupDrain {
    /// The Node to drain: the one registered, or (an earlier run's, unregistered in this
    /// one) the Node of the name, read (with backoff), if it is the member's; `None` when
    /// there is none of the member's, or `stop` fired.
    async fn member_node(&self, stop: &CancellationToken) -> Option<MemberNode> {
        if let Some(uid) = &self.uid {
            return Some(MemberNode {
                name: self.name.clone(),
                uid: uid.clone(),
            });
        }
        let nodes: Api<Node> = Api::all(self.upper.clone());
        let mut delays = register_delays();
        loop {
            match nodes.get_opt(&self.name).await {
                Ok(None) => return None,
                Ok(Some(found)) => {
                    if let Holding::Another(holder) = self.owner.holding(&found) {
                        info!(%holder, cluster = "upper",
                            "group gone below: the Node of its name is not this member's: nothing to drain");
                        return None;
                    }
                    return Some(MemberNode {
                        name: self.name.clone(),
                        uid: found.metadata.uid?,
                    });
                }
                Err(error) => {
                    let delay = delays.next().unwrap_or(MAX_REGISTER_DELAY);
                    warn!(%error, cluster = "upper", retry_in = ?delay,
                        "reading the Node of a group gone below; trying again");
                    tokio::select! {
                        () = stop.cancelled() => return None,
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }

    /// [`GroupDrain::drain`] until `stop` fires, which ends it at once, even in the middle
    /// of a call (an eviction a disruption budget refuses is retried within the client
    /// for minutes): what it did is read from the cluster by whoever comes next.
    async fn run(&self, stop: &CancellationToken) {
        tokio::select! {
            biased;
            () = stop.cancelled() => {}
            () = self.drain(stop) => {}
        }
    }

    /// Drains the Node as a member's leave does, then deletes it and its Lease (under
    /// its UID) and forgets its name, once its pods (and so their lower copies) are gone.
    /// A failure is tried again with backoff; returns when done or when `stop` fires.
    async fn drain(&self, stop: &CancellationToken) {
        let Some(member_node) = self.member_node(stop).await else {
            if !stop.is_cancelled() {
                self.nodes.remove(&self.name);
            }
            return;
        };
        let object = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(self.name.clone()),
            uid: Some(member_node.uid.clone()),
            ..ObjectReference::default()
        };
        info!(
            cluster = "upper",
            "every lower node of the group is gone: draining its virtual node, then deleting it"
        );
        leave::say(
            &self.recorder,
            &object,
            EventType::Normal,
            "LowerGroupGone",
            format!(
                "every lower node of group {} is gone: draining node {} (its pods evicted, PodDisruptionBudgets respected), then deleting it",
                self.key, self.name
            ),
        )
        .await;
        let mut delays = register_delays();
        loop {
            let done = async {
                leave::drain(
                    &self.upper,
                    &member_node,
                    self.bound,
                    (&self.recorder, &object),
                    stop,
                )
                .await?;
                if stop.is_cancelled() {
                    return Err(LeaveError::Shutdown);
                }
                if let Some(keep_alive) = &self.keep_alive {
                    keep_alive.cancel();
                }
                leave::delete_node_of(&self.upper, &self.name, &member_node.uid).await
            }
            .await;
            let error = match done {
                Ok(()) => break,
                Err(LeaveError::Shutdown) => return,
                Err(error) => error,
            };
            let delay = delays.next().unwrap_or(MAX_REGISTER_DELAY);
            warn!(%error, cluster = "upper", retry_in = ?delay,
                "draining the virtual node of a group gone below; trying again");
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
        }
        self.nodes.remove(&self.name);
        info!(
            cluster = "upper",
            "virtual node of a group gone below drained and deleted"
        );
        leave::say(
            &self.recorder,
            &object,
            EventType::Normal,
            "LowerGroupNodeDeleted",
            format!(
                "group {} gone below: node {} drained and deleted",
                self.key, self.name
            ),
        )
        .await;
    }
}

/// Says (a Warning log and Event on `node`) that no port of `--kubelet-port-range` was
/// left for it: it is reached on the member's `shared` port, with no node series.
async fn no_port_left(ports: &GroupPorts, node: &Node, shared: i32) {
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let note = format!(
        "no port of --kubelet-port-range {} is left for this virtual node (a port per \
         virtual node; widen the range): it shares the member's kubelet port {shared}, \
         and kubectl top node shows <unknown> for it",
        ports.range
    );
    warn!(node = name, cluster = "upper", "{note}");
    let event = kube::runtime::events::Event {
        type_: EventType::Warning,
        reason: "KubeletPortRangeExhausted".into(),
        note: Some(note),
        action: "Register".into(),
        secondary: None,
    };
    let reference = kube::Resource::object_ref(node, &());
    if let Err(error) = ports.recorder.publish(&event, &reference).await {
        tracing::debug!(%error, node = name, cluster = "upper", "publishing an event on a virtual node");
    }
}
