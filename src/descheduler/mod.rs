//! tensile-descheduler: gives upper pods that a lower cluster cannot place another chance.
//!
//! [`select`] decides (pure); this module reads the upper cluster, acts on the verdicts
//! (evict a controlled pod, re-create a bare one), and counts what it did. With
//! `--return-home`, [`home`] decides (pure) which burst pods come back to regular nodes,
//! and `return_home` evicts them.

pub mod cli;
pub mod home;
pub mod metrics;
mod return_home;
pub mod select;

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, EvictParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use self::metrics::Metrics;
use self::select::{Method, MoveReason, Policy, Verdict};
use crate::api::{delete_exact, is_status};
use crate::translate::meta::SELECTED_NODE_ANNOTATION;

/// What a round does.
#[derive(Clone, Debug)]
pub struct Config {
    /// Extra label selector for virtual nodes (`--node-selector`), ANDed with
    /// `type=virtual-kubelet`.
    pub node_selector: String,
    /// Which pods, and how many per node.
    pub policy: Policy,
    /// Log and emit `WouldReschedule` only.
    pub dry_run: bool,
    /// Time between rounds.
    pub interval: Duration,
    /// Move burst pods home, within these limits (`None`: off).
    pub return_home: Option<home::ReturnHome>,
}

/// Why a round or one pod's move failed (retried next round).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Listing nodes or pods failed.
    #[error("listing {what} (upper): {source}")]
    List {
        /// What was listed.
        what: &'static str,
        /// The error.
        source: kube::Error,
    },
    /// Reading a claim a pod mounts failed.
    #[error("reading claim {claim} of pod {pod} (upper): {source}")]
    Claim {
        /// `namespace/name` of the claim.
        claim: String,
        /// `namespace/name` of the pod.
        pod: String,
        /// The error.
        source: kube::Error,
    },
    /// A call about one pod failed.
    #[error("{action} pod {pod} (upper): {source}")]
    Pod {
        /// What was being done.
        action: &'static str,
        /// `namespace/name`.
        pod: String,
        /// The error.
        source: kube::Error,
    },
}

/// The outcome of acting on one pod.
#[derive(Debug, PartialEq, Eq)]
enum Acted {
    Moved,
    WouldMove,
    /// It vanished or changed mid-round, or is no longer selected.
    Changed,
    /// A PodDisruptionBudget refused the eviction (429): next round.
    Disruption,
    /// A claim it mounts was provisioned on the node: it cannot go anywhere else.
    Pinned,
    /// Its replacement's name is held by a pod not made for it.
    NameTaken,
}

impl Acted {
    /// The skipped counter's reason for an outcome that moved nothing.
    pub(crate) const SKIP_LABELS: [&'static str; 4] = [
        "changed",
        "disruption_budget",
        "pinned_by_claim",
        "replacement_name_taken",
    ];

    fn skip_label(&self) -> Option<&'static str> {
        match self {
            Self::Moved | Self::WouldMove => None,
            Self::Changed => Some(Self::SKIP_LABELS[0]),
            Self::Disruption => Some(Self::SKIP_LABELS[1]),
            Self::Pinned => Some(Self::SKIP_LABELS[2]),
            Self::NameTaken => Some(Self::SKIP_LABELS[3]),
        }
    }
}

/// The descheduler: one upper client, the recorder, the counters.
pub struct Descheduler {
    client: Client,
    recorder: Recorder,
    config: Config,
    metrics: Arc<Metrics>,
    /// (pod UID, reason) of the Warnings already published: a pod left alone round after
    /// round gets one, not one a round. Forgotten once the pod is no longer a candidate.
    warned: Mutex<HashSet<(String, &'static str)>>,
    /// What the return home's rounds remember (room held, moves followed up).
    home: Mutex<home::Memory>,
    /// Set once the PodDisruptionBudgets could not be read (warned once).
    budgets_unreadable: std::sync::atomic::AtomicBool,
}

impl Descheduler {
    /// A descheduler acting on `client`'s cluster.
    pub fn new(client: Client, recorder: Recorder, config: Config, metrics: Arc<Metrics>) -> Self {
        Self {
            client,
            recorder,
            config,
            metrics,
            warned: Mutex::default(),
            home: Mutex::default(),
            budgets_unreadable: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Runs a round every interval while `leader` says so, until `shutdown`, and at once
    /// when a pod bound to a node is refused below (watched, so the lower scheduler's
    /// verdict is acted on without waiting for the interval). A round in progress stops
    /// between pods as soon as leadership is lost or shutdown begins.
    pub async fn run(&self, mut leader: watch::Receiver<bool>, shutdown: CancellationToken) {
        let refused = Arc::new(Notify::new());
        let watch = watch_refusals(self.client.clone(), refused.clone());
        let rounds = async {
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    changed = leader.wait_for(|l| *l) => if changed.is_err() { return },
                }
                let started = tokio::time::Instant::now();
                if let Err(error) = self.round(&leader, &shutdown).await {
                    self.metrics.errors.inc();
                    warn!(%error, "round failed; retrying next round");
                }
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep_until(started + self.config.interval) => {}
                    () = refused.notified() => {
                        // A burst of refusals makes one round, not one each.
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = tokio::time::sleep_until(started + MIN_ROUND_GAP) => {}
                        }
                    }
                }
            }
        };
        tokio::select! {
            () = rounds => {}
            () = watch => {}
        }
    }

    /// One round over every virtual node.
    pub async fn round(
        &self,
        leader: &watch::Receiver<bool>,
        shutdown: &CancellationToken,
    ) -> Result<(), Error> {
        let mut selector = format!(
            "{}={}",
            select::VIRTUAL_NODE_LABEL.0,
            select::VIRTUAL_NODE_LABEL.1
        );
        if !self.config.node_selector.trim().is_empty() {
            selector.push(',');
            selector.push_str(self.config.node_selector.trim());
        }
        let nodes: Api<Node> = Api::all(self.client.clone());
        let virtual_nodes: BTreeSet<String> = nodes
            .list_metadata(&ListParams::default().labels(&selector))
            .await
            .map_err(|source| Error::List {
                what: "virtual nodes",
                source,
            })?
            .items
            .into_iter()
            .filter_map(|n| n.metadata.name)
            .collect();
        let pods: Api<Pod> = Api::all(self.client.clone());
        let mut candidates = Vec::new();
        for fields in select::pending_lists(&virtual_nodes) {
            let list = pods
                .list(&ListParams::default().fields(&fields))
                .await
                .map_err(|source| Error::List {
                    what: "pods on virtual nodes",
                    source,
                })?;
            candidates.extend(list.items);
        }
        let candidate_uids: HashSet<&str> = candidates
            .iter()
            .filter_map(|p| p.metadata.uid.as_deref())
            .collect();
        self.warned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|(uid, _)| candidate_uids.contains(uid.as_str()));
        let selected = select::select(
            &candidates,
            &virtual_nodes,
            &self.config.policy,
            Timestamp::now(),
        );
        debug!(nodes = virtual_nodes.len(), pods = selected.len(), "round");
        for (pod, node, verdict) in selected {
            let _ = self.metrics.considered.inc();
            let reason = match verdict {
                Verdict::Skip(skip) => {
                    self.metrics.skip(skip.label());
                    continue;
                }
                Verdict::Move(reason) => reason,
            };
            if shutdown.is_cancelled() || !*leader.borrow() {
                info!("round stopped: shutting down or no longer the leader");
                return Ok(());
            }
            let name = pod_key(pod);
            let span = info_span!("pod", pod = %name, node = %node);
            match self.act(pod, &node, &reason).instrument(span.clone()).await {
                Ok(Acted::Moved) => {
                    self.metrics.moved.inc();
                }
                Ok(Acted::WouldMove) => {
                    self.metrics.would_move.inc();
                }
                Ok(acted) => {
                    if let Some(label) = acted.skip_label() {
                        self.metrics.skip(label);
                    }
                }
                Err(error) => {
                    let _ = self.metrics.errors.inc();
                    span.in_scope(|| warn!(%error, "not moved; retrying next round"));
                }
            }
        }
        if let Some(limits) = &self.config.return_home {
            self.return_home(limits, &virtual_nodes, leader, shutdown)
                .await?;
        }
        Ok(())
    }

    async fn act(&self, seen: &Pod, node: &str, reason: &MoveReason) -> Result<Acted, Error> {
        let namespace = seen.metadata.namespace.clone().unwrap_or_default();
        let name = seen.metadata.name.clone().unwrap_or_default();
        let key = format!("{namespace}/{name}");
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        let pod_error = |action| {
            let pod = key.clone();
            move |source| Error::Pod {
                action,
                pod,
                source,
            }
        };
        // Read it again: the list may be a round old.
        let Some(pod) = pods.get_opt(&name).await.map_err(pod_error("reading"))? else {
            debug!("vanished");
            return Ok(Acted::Changed);
        };
        let same = pod.metadata.uid == seen.metadata.uid
            && pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
            && matches!(
                select::judge(&pod, &self.config.policy, Timestamp::now()),
                Verdict::Move(_)
            );
        if !same {
            debug!("changed since listed; skipped");
            return Ok(Acted::Changed);
        }
        if let Some(claim) = self.pinning_claim(&pod, node).await? {
            debug!(%claim, "its claim was provisioned on the node; left alone");
            self.warn_once(
                &pod,
                "PinnedByVolume",
                format!(
                    "not moved off {node} ({reason}): its claim {claim} was provisioned there \
                     ({SELECTED_NODE_ANNOTATION}), so any new pod mounting it is bound there again"
                ),
            )
            .await;
            return Ok(Acted::Pinned);
        }
        let method = select::method(&pod);
        if self.config.dry_run {
            info!(?method, %reason, "dry run: would reschedule");
            self.event(
                &pod,
                "WouldReschedule",
                format!("would move it off {node}: {reason}"),
            )
            .await;
            return Ok(Acted::WouldMove);
        }
        let acted = match method {
            Method::Evict => self.evict(&pods, &pod, node).await?,
            Method::Recreate => self.recreate(&pods, &pod, node).await?,
        };
        if acted == Acted::Moved {
            info!(?method, %reason, "rescheduled");
            self.event(&pod, "Rescheduled", format!("moved off {node}: {reason}"))
                .await;
        }
        Ok(acted)
    }

    /// Marks the pod (the webhook remembers the node for its owner), then evicts it.
    async fn evict(&self, pods: &Api<Pod>, pod: &Pod, node: &str) -> Result<Acted, Error> {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let key = pod_key(pod);
        let mut patch = select::mark_patch(pod, node);
        // The resourceVersion makes the patch fail if the pod changed since read.
        patch["metadata"]["resourceVersion"] = pod.metadata.resource_version.clone().into();
        match pods
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            Err(e) if is_status(&e, 404) || is_status(&e, 409) => return Ok(Acted::Changed),
            Err(source) => {
                return Err(Error::Pod {
                    action: "marking",
                    pod: key,
                    source,
                });
            }
        }
        self.evict_only(pods, pod).await
    }

    /// Evicts the pod (its UID as a precondition): Moved, Disruption (a
    /// PodDisruptionBudget refused it) or Changed (gone, or another pod by now).
    async fn evict_only(&self, pods: &Api<Pod>, pod: &Pod) -> Result<Acted, Error> {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let key = pod_key(pod);
        let params = EvictParams {
            delete_options: Some(DeleteParams {
                preconditions: Some(kube::api::Preconditions {
                    uid: pod.metadata.uid.clone(),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            }),
            post_options: PostParams::default(),
        };
        match pods.evict(&name, &params).await {
            Ok(_) => Ok(Acted::Moved),
            Err(e) if is_status(&e, 429) => {
                info!("eviction refused by a PodDisruptionBudget; retrying next round");
                Ok(Acted::Disruption)
            }
            Err(e) if is_status(&e, 404) || is_status(&e, 409) => Ok(Acted::Changed),
            Err(source) => Err(Error::Pod {
                action: "evicting",
                pod: key,
                source,
            }),
        }
    }

    /// Creates the replacement, and deletes the old pod only once it exists.
    async fn recreate(&self, pods: &Api<Pod>, pod: &Pod, node: &str) -> Result<Acted, Error> {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let key = pod_key(pod);
        let new = select::replacement(pod, node);
        let new_name = new.metadata.name.clone().unwrap_or_default();
        match pods.create(&PostParams::default(), &new).await {
            Ok(_) => {}
            // A previous round created it but could not delete the old pod, or the name
            // holds a pod made for another (an earlier pod of the same name, say).
            Err(e) if is_status(&e, 409) => {
                let existing = pods.get_opt(&new_name).await.map_err(|source| Error::Pod {
                    action: "reading the replacement of",
                    pod: key.clone(),
                    source,
                })?;
                match existing {
                    Some(existing) if select::is_replacement_of(&existing, pod) => {}
                    Some(_) => {
                        warn!(replacement = %new_name, "the replacement's name is taken by a pod not made for this one; left alone");
                        self.warn_once(
                            pod,
                            "ReplacementNameTaken",
                            format!(
                                "not moved off {node}: pod {new_name} exists and is not its \
                                 replacement (no {} of this pod)",
                                select::REPLACES_UID_ANNOTATION
                            ),
                        )
                        .await;
                        return Ok(Acted::NameTaken);
                    }
                    // Gone again since the create: next round.
                    None => return Ok(Acted::Changed),
                }
            }
            Err(source) => {
                return Err(Error::Pod {
                    action: "re-creating",
                    pod: key,
                    source,
                });
            }
        }
        debug!(replacement = %new_name, "replacement created");
        match delete_exact(pods, &name, pod.metadata.uid.clone(), None).await {
            Ok(_) => Ok(Acted::Moved),
            Err(source) => Err(Error::Pod {
                action: "deleting the re-created",
                pod: key,
                source,
            }),
        }
    }

    /// The claim of `pod` provisioned on `node`, if any (reading each claim it mounts).
    async fn pinning_claim(&self, pod: &Pod, node: &str) -> Result<Option<String>, Error> {
        let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), namespace);
        let mut selected = BTreeMap::new();
        for name in select::claim_names(pod) {
            let claim = claims
                .get_metadata_opt(name)
                .await
                .map_err(|source| Error::Claim {
                    claim: format!("{namespace}/{name}"),
                    pod: pod_key(pod),
                    source,
                })?;
            let node = claim
                .and_then(|c| c.metadata.annotations)
                .and_then(|mut a| a.remove(SELECTED_NODE_ANNOTATION));
            if let Some(node) = node {
                selected.insert(name.to_owned(), node);
            }
        }
        Ok(select::pinning_claim(pod, node, |claim| {
            selected.get(claim).cloned()
        }))
    }

    /// A Warning about a pod left alone, published once while it stays a candidate.
    async fn warn_once(&self, pod: &Pod, reason: &'static str, note: String) {
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let first = self
            .warned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((uid, reason));
        if first {
            self.publish(pod, EventType::Warning, reason, note).await;
        }
    }

    async fn event(&self, pod: &Pod, reason: &str, note: String) {
        self.publish(pod, EventType::Normal, reason, note).await;
    }

    async fn publish(&self, pod: &Pod, type_: EventType, reason: &str, note: String) {
        self.publish_on(&pod.object_ref(&()), type_, "Reschedule", reason, note)
            .await;
    }

    async fn publish_on(
        &self,
        object: &k8s_openapi::api::core::v1::ObjectReference,
        type_: EventType,
        action: &str,
        reason: &str,
        note: String,
    ) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: None,
        };
        if let Err(error) = self.recorder.publish(&event, object).await {
            debug!(%error, cluster = "upper", "publishing the event");
        }
    }
}

/// Rounds woken by a refusal start at least this far apart.
const MIN_ROUND_GAP: Duration = Duration::from_millis(200);

/// Watches Pending pods and wakes `refused` whenever one bound to a node carries the lower
/// scheduler's verdict. Runs until dropped; watch errors are retried with backoff.
async fn watch_refusals(client: Client, refused: Arc<Notify>) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let pods: Api<Pod> = Api::all(client);
    let config = watcher::Config::default().fields("status.phase=Pending");
    let mut events = std::pin::pin!(watcher(pods, config).default_backoff().applied_objects());
    while let Some(event) = events.next().await {
        match event {
            Ok(pod) => {
                let bound = pod.spec.as_ref().is_some_and(|s| s.node_name.is_some());
                if bound
                    && pod.metadata.deletion_timestamp.is_none()
                    && select::refused(&pod).is_some()
                {
                    refused.notify_one();
                }
            }
            Err(error) => debug!(%error, cluster = "upper", "watching Pending pods"),
        }
    }
}

fn pod_key(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or_default(),
        pod.metadata.name.as_deref().unwrap_or_default()
    )
}
