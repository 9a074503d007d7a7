//! The virtual nodes of a member of `node` or `label=<key>` granularity: one Node and
//! Lease per group of lower nodes ([`crate::node::groups`]), registered as its group
//! appears below, kept alive with the group's own capacity, cordoned while every lower
//! node of the group is, and cordoned (its Lease no longer renewed, so it goes NotReady)
//! once its group is gone. The ownership marks below stay the member's (`--nodename`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

use crate::clusters::HeartbeatClients;
use crate::kubelet_api::node_ports::{self, GroupPorts};
use crate::node::burst::Burst;
use crate::node::groups::{Granularity, GroupNodes, GroupOffer, group_requirement};
use crate::node::spec::NodeConfig;
use crate::node::{self, CORDONED_BY_ANNOTATION, CORDONED_BY_LEAVE};

/// [`CORDONED_BY_ANNOTATION`]'s value on the cordon of a virtual node whose lower nodes
/// are all cordoned: lifted when one of them is uncordoned (a user's cordon is kept).
pub const CORDONED_BY_LOWER: &str = "lower";

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
    /// `--kubelet-port-range`: a kubelet port per virtual node.
    pub ports: Option<GroupPorts>,
}

/// One registered virtual node.
struct Running {
    name: String,
    uid: String,
    capacity: watch::Sender<Option<BTreeMap<String, Quantity>>>,
    cordoned_below: bool,
    stop: CancellationToken,
    /// Its own kubelet port (`--kubelet-port-range`), if it has one.
    port: Option<u16>,
}

/// The names of the virtual nodes `offers` asks for, each with what confines its pods
/// below, added to `nodes` before any is registered (so their pods are watched from the
/// start).
pub fn know(nodes: &GroupNodes, granularity: &Granularity, offers: &BTreeMap<String, GroupOffer>) {
    for (key, offer) in offers {
        nodes.insert(&offer.group.name, group_requirement(granularity, key));
    }
}

impl Fleet {
    /// Follows `offers` until `shutdown`: a group's virtual node registered as it appears,
    /// its capacity and cordon kept, and cordoned when the group is gone. A registration
    /// that fails ends the member (it restarts).
    pub async fn run(
        self,
        mut offers: watch::Receiver<BTreeMap<String, GroupOffer>>,
        shutdown: CancellationToken,
    ) -> Result<(), String> {
        let mut running: HashMap<String, Running> = HashMap::new();
        let mut beats = JoinSet::new();
        let (mut bursting, mut bursting_open) = (self.bursting.clone(), true);
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
                if let Some(r) = running.get_mut(key) {
                    r.capacity.send_if_modified(|c| {
                        let changed = c.as_ref() != Some(part);
                        if changed {
                            *c = Some(part.clone());
                        }
                        changed
                    });
                    if r.cordoned_below != offer.group.cordoned {
                        r.cordoned_below = offer.group.cordoned;
                        self.cordon_below(&r.name, &r.uid, r.cordoned_below).await;
                    }
                    continue;
                }
                let span = info_span!("virtual node", node = %offer.group.name, group = %key);
                let (started, beat) = self
                    .start(
                        key,
                        offer,
                        part,
                        (ports.remove(key).flatten(), &taken),
                        shutdown.child_token(),
                    )
                    .instrument(span.clone())
                    .await?;
                if started.cordoned_below {
                    self.cordon_below(&started.name, &started.uid, true).await;
                }
                beats.spawn(beat.instrument(span));
                running.insert(key.clone(), started);
            }
            let gone: Vec<String> = running
                .keys()
                .filter(|k| !now.contains_key(*k))
                .cloned()
                .collect();
            for key in gone {
                if let Some(r) = running.remove(&key) {
                    r.stop.cancel();
                    info!(node = %r.name, group = %key, cluster = "upper",
                        "group gone below: cordoning its virtual node; its lease is no longer renewed");
                    self.cordon(&r.name, &r.uid, CORDONED_BY_LEAVE).await;
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                changed = offers.changed() => if changed.is_err() { break },
                changed = bursting.changed(), if bursting_open => bursting_open = changed.is_ok(),
                Some(_) = beats.join_next() => {}
            }
        }
        for r in running.values() {
            r.stop.cancel();
        }
        while beats.join_next().await.is_some() {}
        Ok(())
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

    /// Registers the virtual node of group `key`, offering `part` (its part of the
    /// member's share, [`crate::node::burst::Share::split`]), on `port` of the range (with
    /// `taken`, the range's ports others have) or else the member's; its keep-alive (and
    /// its port's kubelet API), to run until `stop`.
    async fn start(
        &self,
        key: &str,
        offer: &GroupOffer,
        part: &BTreeMap<String, Quantity>,
        (port, taken): (Option<u16>, &BTreeSet<u16>),
        stop: CancellationToken,
    ) -> Result<(Running, impl Future<Output = ()> + Send + 'static), String> {
        self.nodes
            .insert(&offer.group.name, group_requirement(&self.granularity, key));
        let listening = match (&self.ports, port) {
            (Some(ports), Some(port)) => {
                node_ports::listen(ports, port, taken, &offer.group.name, stop.clone()).await
            }
            _ => None,
        };
        let own_port = listening.as_ref().map(|(port, _)| *port);
        let config = NodeConfig {
            name: offer.group.name.clone(),
            group_labels: offer.group.labels.clone(),
            kubelet_port: own_port.map_or(self.base.kubelet_port, i32::from),
            ..self.base.clone()
        };
        let bursting = self.bursting.borrow().clone();
        let offered = bursting.share.cap(part);
        let registered = node::register(&self.upper, &config, &offered, &bursting)
            .await
            .map_err(|e| format!("node {} (group {key}): {e}", config.name))?;
        info!(node = %config.name, group = %key, kubelet_port = config.kubelet_port, "virtual node registered");
        if let (Some(ports), None) = (&self.ports, own_port) {
            no_port_left(ports, &registered, self.base.kubelet_port).await;
        }
        let uid = registered.metadata.uid.clone().unwrap_or_default();
        let (capacity, capacity_rx) = watch::channel(Some(part.clone()));
        let beat = node::keep_alive(
            self.upper_heartbeat.clone(),
            self.lower_heartbeat.clone(),
            config.clone(),
            self.use_lease,
            node::Offer {
                capacity: capacity_rx,
                bursting: self.bursting.clone(),
            },
            registered,
            stop.clone(),
        );
        let beat = async move {
            match listening {
                Some((_, serving)) => {
                    tokio::join!(beat, serving);
                }
                None => beat.await,
            }
        };
        Ok((
            Running {
                name: config.name,
                uid,
                capacity,
                cordoned_below: offer.group.cordoned,
                stop,
                port: own_port,
            },
            beat,
        ))
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
        let nodes: Api<Node> = Api::all(self.upper.clone());
        let ours = match nodes.get_opt(name).await {
            Ok(Some(node)) => node
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(CORDONED_BY_ANNOTATION))
                .is_some_and(|v| v == CORDONED_BY_LOWER),
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
            "a lower node of the group is uncordoned: lifting its virtual node's cordon"
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
        type_: kube::runtime::events::EventType::Warning,
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
