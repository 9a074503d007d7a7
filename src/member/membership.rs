//! The membership controller (`--members-namespace`): the member Secrets of that namespace
//! (labelled [`MEMBER_LABEL`]) are the lower clusters this process joins, each as a
//! member of its own, started, restarted and stopped here:
//! - a Secret added joins its cluster within seconds; a member that fails or panics is
//!   restarted with backoff, named in an Event on its Secret and in
//!   `tensile_member_up{node}`; the others carry on;
//! - a changed Secret (a rotated kubeconfig, other options) restarts its member in place:
//!   the Node stays;
//! - a Secret deleted makes its member leave ([`super::leave`]): its finalizer keeps the
//!   Secret, and so the kubeconfig, until the node is drained, everything below cleaned up
//!   and the Node deleted — across a restart of this process too;
//! - a Secret that cannot be used (no kubeconfig, an unreadable one, a node name another
//!   member or a real node has) is named in a Warning Event on it and in the log.
//!   A virtual node name of one group that another member has already is refused alone
//!   ([`super::names`], `MemberNodeNameClash`); the member runs its other groups.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use backon::BackoffBuilder;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Secret};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::events::{EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, error, info, info_span, warn};

use super::spec::{self, BadMember, Defaults, MEMBER_FINALIZER, MEMBER_LABEL, MemberSecret};
use super::{LowerCheck, MemberSpec, Shared, leave};
use crate::node::groups::{GRANULARITY_ANNOTATION, Granularity};
use crate::node::owner::{Holding, NodeOwner};
use crate::translate::meta::Owner;

/// Recorded on a member Secret when its member joins: the node it joined as. A changed
/// `tensile.dev/node-name` is refused (the member keeps this name), since the old Node,
/// its pods and their lower copies would be abandoned.
pub const JOINED_NODE_ANNOTATION: &str = "tensile.dev/joined-node";
/// Recorded on a member Secret once its member reached its lower cluster: that cluster's
/// identity (the UID of its `kube-system` Namespace). A kubeconfig that later reaches
/// another cluster is refused.
pub const JOINED_LOWER_ANNOTATION: &str = "tensile.dev/joined-lower-cluster";

/// A member that ran at least this long before failing starts again at once.
const HEALTHY_RUN: Duration = Duration::from_secs(60);
/// The longest wait between restarts of a failing member.
const MAX_RESTART_DELAY: Duration = Duration::from_secs(60);
/// How often the Secrets are looked at again without a change (a failed leave, a node
/// name that a real node gave up).
const RECHECK: Duration = Duration::from_secs(10);
/// How long a member's start-up (lower cluster reached, permissions checked, older objects
/// adopted, Node registered) may take before it counts as failed and is started again: a
/// lower API server that answers `/version` and then nothing holds it no longer.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(180);
/// How long a member may take to stop once told (its tasks drain within
/// [`crate::shutdown::DRAIN_TIMEOUT`]); past it, it is aborted.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs the membership of `namespace` until `shutdown`. `static_node` is the node of the
/// single-cluster flags, if any, which no member Secret may take. `listed` is cancelled
/// once the Secrets have been listed and the members they name started.
pub async fn run(
    shared: Arc<Shared>,
    namespace: String,
    static_node: Option<String>,
    listed: CancellationToken,
    shutdown: CancellationToken,
) {
    let span = info_span!("membership", namespace = %namespace);
    Membership::new(shared, namespace, static_node)
        .run(listed, shutdown)
        .instrument(span)
        .await;
}

/// A member running (or restarting with backoff) on a task of its own.
struct Running {
    /// Its node.
    node: String,
    /// Its Secret's UID.
    uid: String,
    /// What it was started from ([`fingerprint`]): a change restarts it.
    fingerprint: u64,
    /// What it was started with (kept for its leave).
    spec: MemberSpec,
    /// Stops it.
    stop: CancellationToken,
    /// Its supervising task.
    task: JoinHandle<()>,
}

/// A member leaving on a task of its own, by Secret name.
struct Leaving {
    task: JoinHandle<()>,
}

struct Membership {
    shared: Arc<Shared>,
    namespace: String,
    static_node: Option<String>,
    defaults: Defaults,
    recorder: Recorder,
    /// Running members by Secret name.
    running: HashMap<String, Running>,
    /// Leaves in progress by Secret name.
    leaving: HashMap<String, Leaving>,
    /// The last complaint published per Secret (name, resourceVersion, message), so a
    /// Secret's problem is said once per version, not at every look.
    complained: HashMap<String, (String, String)>,
}

impl Membership {
    fn new(shared: Arc<Shared>, namespace: String, static_node: Option<String>) -> Self {
        let args = &shared.args;
        let defaults = Defaults {
            taint: super::flag_taint(args),
            ignore_labels: args
                .ignore_labels
                .iter()
                .filter(|l| !l.is_empty())
                .cloned()
                .collect(),
            qps: args.client_qps,
            burst: args.client_burst,
        };
        let recorder = Recorder::new(
            shared.upper.client.clone(),
            Reporter {
                controller: "tensile-virtual-node".into(),
                instance: Some(format!("membership/{namespace}")),
            },
        );
        Self {
            shared,
            namespace,
            static_node,
            defaults,
            recorder,
            running: HashMap::new(),
            leaving: HashMap::new(),
            complained: HashMap::new(),
        }
    }

    async fn run(mut self, listed: CancellationToken, shutdown: CancellationToken) {
        let secrets: Api<Secret> =
            Api::namespaced(self.shared.upper.client.clone(), &self.namespace);
        let (store, writer) = reflector::store();
        let config = watcher::Config::default().labels(&format!("{MEMBER_LABEL}=true"));
        let mut changes = std::pin::pin!(reflector::reflector(
            writer,
            watcher::watcher(secrets, config).default_backoff()
        ));
        let mut recheck = tokio::time::interval(RECHECK);
        recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Members are started from a complete list only (the first one, then every change).
        let mut synced = false;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                change = changes.next() => match change {
                    Some(Ok(watcher::Event::InitDone)) => synced = true,
                    Some(Ok(_)) => {}
                    Some(Err(error)) => {
                        warn!(%error, cluster = "upper", "watching member Secrets");
                        continue;
                    }
                    None => break,
                },
                _ = recheck.tick() => {}
            }
            if !synced {
                continue;
            }
            // Waiting for the lease: a standby starts no member (each would write). It has
            // started, and is ready to take over, once it has the member Secrets: without
            // that, `--startup-timeout` would end it, and a rollout (maxUnavailable 0) or a
            // drain (a PodDisruptionBudget) would wait for it forever.
            if let Some(leading) = &self.shared.leading
                && !*leading.borrow()
            {
                if !listed.is_cancelled() {
                    info!("member Secrets listed: standing by until this process holds the lease");
                }
                self.stand_by(&listed);
                continue;
            }
            self.reconcile(&store, &shutdown).await;
            listed.cancel();
        }
        self.stop_all().await;
    }

    /// A standby with the member Secrets listed: started, and (without a member of the
    /// flags, whose own readiness says) ready.
    fn stand_by(&self, listed: &CancellationToken) {
        if self.static_node.is_none() {
            self.shared.metrics.ready.store(true, Ordering::Relaxed);
        }
        listed.cancel();
    }

    /// Brings the running members in line with the Secrets in `store`.
    async fn reconcile(&mut self, store: &Store<Secret>, shutdown: &CancellationToken) {
        self.leaving.retain(|_, l| !l.task.is_finished());
        let mut secrets: Vec<Arc<Secret>> = store.state();
        // The oldest Secret keeps a node name that several give.
        secrets.sort_by(|a, b| {
            (a.creation_timestamp(), a.name_any()).cmp(&(b.creation_timestamp(), b.name_any()))
        });
        let mut claimed: BTreeMap<String, String> = BTreeMap::new();
        if let Some(node) = &self.static_node {
            claimed.insert(node.clone(), "--nodename".into());
        }
        let mut wanted: HashMap<String, (Arc<Secret>, MemberSecret)> = HashMap::new();
        for secret in &secrets {
            let name = secret.name_any();
            if secret.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let mut member = match spec::read(secret, &self.defaults) {
                Ok(member) => member,
                Err(bad) => {
                    self.complain(secret, "MemberInvalid", &bad.to_string())
                        .await;
                    continue;
                }
            };
            let running = self.running.get(&name).map(|r| r.node.as_str());
            if let Err(renamed) = joined_node(secret, running, &mut member) {
                // The member keeps running under the name it joined as.
                self.complain(secret, "MemberRenameRefused", &renamed.to_string())
                    .await;
            }
            if let Some(by) = claimed.get(&member.node) {
                let why = format!("node name {} is taken by {by}", member.node);
                self.complain(secret, "MemberNodeNameTaken", &why).await;
                continue;
            }
            claimed.insert(member.node.clone(), format!("member Secret {name}"));
            wanted.insert(name, (secret.clone(), member));
        }

        // Leaves: Secrets being deleted, Secrets whose member label was removed (the
        // finalizer says their member joined), and members whose Secret is gone.
        for secret in self.unlabelled().await {
            let name = secret.name_any();
            if !self.leaving.contains_key(&name) {
                let node = recorded_node(&secret).unwrap_or_default().to_owned();
                leave::say(
                    &self.recorder,
                    &secret.object_ref(&()),
                    EventType::Normal,
                    "MemberUnlabelled",
                    format!(
                        "label {MEMBER_LABEL}=true removed: node {node} leaves, as if this Secret were deleted"
                    ),
                )
                .await;
                self.start_leave(secret, shutdown).await;
            }
        }
        for secret in &secrets {
            let name = secret.name_any();
            if secret.metadata.deletion_timestamp.is_some()
                && has_finalizer(secret)
                && !self.leaving.contains_key(&name)
            {
                self.start_leave(secret.clone(), shutdown).await;
            }
        }
        let gone: Vec<String> = self
            .running
            .keys()
            .filter(|name| !secrets.iter().any(|s| &s.name_any() == *name))
            .cloned()
            .collect();
        for name in gone {
            if let Some(running) = self.running.remove(&name) {
                info!(secret = %name, node = %running.node, "member Secret gone: stopping its member");
                self.shared.metrics.forget_member(&running.node);
                let node = running.node.clone();
                stop(running).await;
                self.shared.node_names.release(&node);
            }
        }

        for (name, (secret, member)) in wanted {
            if self.leaving.contains_key(&name) {
                // Labelled again while its member leaves: it joins once the leave is done.
                continue;
            }
            // A running member keeps its granularity: its virtual nodes and their pods
            // stay as they are.
            if let Some(running) = self.running.get(&name)
                && Some(&running.uid) == secret.uid().as_ref()
                && running.spec.granularity != member.granularity
            {
                let why = granularity_change(&running.spec.granularity, &member.granularity);
                self.complain(&secret, "MemberGranularityChanged", &why)
                    .await;
                continue;
            }
            let fingerprint = fingerprint(&member);
            if let Some(running) = self.running.get(&name)
                && running.fingerprint == fingerprint
                && Some(&running.uid) == secret.uid().as_ref()
            {
                if !is_marked(&secret, &member.node) {
                    // Marked by an older version: the finalizer without the joined name.
                    self.mark(&secret, &member.node).await;
                }
                // Burst priority and share are taken in place: no restart.
                if let Some(running) = self.running.get(&name) {
                    let bursting = member.bursting;
                    running.spec.bursting.send_if_modified(|current| {
                        let changed = *current != bursting;
                        if changed {
                            info!(secret = %name, node = %member.node, ?bursting, "member's burst priority or share changed");
                            *current = bursting;
                        }
                        changed
                    });
                }
                continue;
            }
            let spec = match super::member_spec(&member).await {
                Ok(spec) => MemberSpec {
                    secret: Some(secret.object_ref(&())),
                    secret_created: secret.metadata.creation_timestamp.clone(),
                    ..spec
                },
                Err(why) => {
                    // A rotation to a bad kubeconfig leaves the running member as it is.
                    self.complain(&secret, "MemberInvalid", &why).await;
                    continue;
                }
            };
            if let Err(why) = self.node_is_ours_to_take(&member.node, &secret).await {
                self.complain(&secret, "MemberNodeNameTaken", &why).await;
                continue;
            }
            if !is_marked(&secret, &member.node) && !self.mark(&secret, &member.node).await {
                continue;
            }
            if let Some(old) = self.running.remove(&name) {
                info!(secret = %name, node = %member.node, "member Secret changed: restarting its member");
                if old.node != member.node {
                    self.shared.metrics.forget_member(&old.node);
                }
                stop(old).await;
            }
            self.complained.remove(&name);
            let object = secret.object_ref(&());
            let stop = shutdown.child_token();
            let check = LowerCheck {
                joined: recorded_lower(&secret).map(str::to_owned),
                ..LowerCheck::default()
            };
            let task = tokio::spawn(
                supervise(
                    self.shared.clone(),
                    spec.clone(),
                    Some(check),
                    object,
                    self.recorder.clone(),
                    stop.clone(),
                )
                .instrument(info_span!("member", node = %member.node)),
            );
            info!(secret = %name, node = %member.node, "member joining");
            self.running.insert(
                name,
                Running {
                    node: member.node.clone(),
                    uid: secret.uid().unwrap_or_default(),
                    fingerprint,
                    spec,
                    stop,
                    task,
                },
            );
        }
    }

    /// The Secrets of the namespace that carry the member finalizer but no longer the member
    /// label: their members leave. Read from the API (the watch sees labelled ones only).
    async fn unlabelled(&self) -> Vec<Arc<Secret>> {
        let api: Api<Secret> = Api::namespaced(self.shared.upper.client.clone(), &self.namespace);
        let params = ListParams::default().labels(&format!("{MEMBER_LABEL}!=true"));
        let listed = match api.list_metadata(&params).await {
            Ok(listed) => listed,
            Err(error) => {
                warn!(%error, cluster = "upper", "listing unlabelled member Secrets");
                return Vec::new();
            }
        };
        let mut found = Vec::new();
        for meta in listed.items {
            let finalized = meta.finalizers().iter().any(|f| f == MEMBER_FINALIZER);
            if !finalized {
                continue;
            }
            match api.get_opt(&meta.name_any()).await {
                Ok(Some(secret)) if secret.uid() == meta.uid() => found.push(Arc::new(secret)),
                Ok(_) => {}
                Err(error) => {
                    warn!(secret = %meta.name_any(), %error, cluster = "upper", "reading an unlabelled member Secret");
                }
            }
        }
        found
    }

    /// Whether `node` may be registered by the member of `secret`: no Node of that name,
    /// or one that member registered ([`NodeOwner::holding`]); a real node's name,
    /// another virtual kubelet's (Liqo, Admiralty), or another member's (of this
    /// installation or another) is refused: its leave would drain and delete it.
    async fn node_is_ours_to_take(&self, node: &str, secret: &Secret) -> Result<(), String> {
        let nodes: Api<Node> = Api::all(self.shared.upper.client.clone());
        let owner = NodeOwner::new(node, Some(&secret.object_ref(&())))
            .made_at(secret.metadata.creation_timestamp.as_ref());
        match nodes.get_opt(node).await {
            Ok(None) => Ok(()),
            Ok(Some(found)) => match owner.holding(&found) {
                Holding::Ours | Holding::Unrecorded => Ok(()),
                Holding::Another(holder) => Err(format!(
                    "node name {node} is taken: the upper Node of that name is {holder}'s, not this Secret's; rename the member (tensile.dev/node-name)"
                )),
            },
            Err(error) => Err(format!("upper cluster: reading node {node}: {error}")),
        }
    }

    /// Marks `secret` as the member of `node`: the member finalizer and the node it joined
    /// as ([`JOINED_NODE_ANNOTATION`]), under its UID and resourceVersion; false if it
    /// could not (it changed meanwhile: the next look tries again).
    async fn mark(&mut self, secret: &Secret, node: &str) -> bool {
        let api: Api<Secret> = Api::namespaced(self.shared.upper.client.clone(), &self.namespace);
        let mut finalizers = secret.finalizers().to_vec();
        if !has_finalizer(secret) {
            finalizers.push(MEMBER_FINALIZER.to_owned());
        }
        let patch = json!({
            "metadata": {
                "uid": secret.uid(),
                "resourceVersion": secret.resource_version(),
                "finalizers": finalizers,
                "annotations": {JOINED_NODE_ANNOTATION: node},
            }
        });
        match api
            .patch(
                &secret.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => true,
            Err(error) => {
                warn!(secret = %secret.name_any(), %error, cluster = "upper",
                    "marking the member Secret (finalizer, joined node) failed; trying again");
                false
            }
        }
    }

    async fn start_leave(&mut self, secret: Arc<Secret>, shutdown: &CancellationToken) {
        let name = secret.name_any();
        let running = self.running.remove(&name);
        let member = spec::read(&secret, &self.defaults).map(|mut member| {
            // The member leaves as the node it joined as, whatever the Secret names now.
            let _ = joined_node(
                &secret,
                running.as_ref().map(|r| r.node.as_str()),
                &mut member,
            );
            member
        });
        let (shared, recorder, namespace) = (
            self.shared.clone(),
            self.recorder.clone(),
            self.namespace.clone(),
        );
        let shutdown = shutdown.clone();
        let node = running
            .as_ref()
            .map(|r| r.node.clone())
            .or_else(|| member.as_ref().ok().map(|m| m.node.clone()));
        info!(secret = %name, node = ?node, "member Secret deleted or unlabelled: the member leaves");
        let task = tokio::spawn(
            async move {
                let outcome = leave_member(&shared, &secret, running, member, &recorder, &shutdown).await;
                match outcome {
                    Ok(()) => {
                        remove_finalizer(&shared, &namespace, &secret).await;
                        // Gone for good: its virtual node names are free.
                        if let Some(node) = &node {
                            shared.node_names.release(node);
                        }
                    }
                    Err(error) => {
                        warn!(secret = %secret.name_any(), %error, "member leave failed; trying again");
                        leave::say(&recorder, &secret.object_ref(&()), EventType::Warning,
                            "MemberLeaveFailed", error).await;
                    }
                }
            }
            .instrument(info_span!("leave", secret = %name)),
        );
        self.leaving.insert(name, Leaving { task });
    }

    /// Says `why` about `secret` (a Warning Event and a log line), once per version.
    async fn complain(&mut self, secret: &Secret, reason: &str, why: &str) {
        let name = secret.name_any();
        let version = secret.resource_version().unwrap_or_default();
        if self
            .complained
            .get(&name)
            .is_some_and(|(v, w)| *v == version && w == why)
        {
            return;
        }
        error!(secret = %format!("{}/{name}", self.namespace), reason, cluster = "upper",
            "member Secret not used: {why}");
        leave::say(
            &self.recorder,
            &secret.object_ref(&()),
            EventType::Warning,
            reason,
            format!("member Secret {}/{name} not used: {why}", self.namespace),
        )
        .await;
        self.complained.insert(name, (version, why.to_owned()));
    }

    async fn stop_all(&mut self) {
        for (_, running) in self.running.drain() {
            stop(running).await;
        }
        for (_, leaving) in self.leaving.drain() {
            leaving.task.abort();
        }
    }
}

/// Stops a running member and waits for it, [`STOP_TIMEOUT`] at most: one that does not
/// stop by then is aborted, so a stuck member never holds up the membership.
async fn stop(running: Running) {
    running.stop.cancel();
    let mut task = running.task;
    // The supervisor itself gives its run STOP_TIMEOUT before aborting it.
    if tokio::time::timeout(STOP_TIMEOUT + Duration::from_secs(5), &mut task)
        .await
        .is_err()
    {
        warn!(node = %running.node, timeout = ?STOP_TIMEOUT, "member did not stop in time; aborting it");
        task.abort();
        let _ = task.await;
    }
}

/// Drains the member's node (its member running meanwhile, started for the leave if it was
/// not), stops it, deletes what it made below, then its Node.
async fn leave_member(
    shared: &Arc<Shared>,
    secret: &Secret,
    running: Option<Running>,
    member: Result<MemberSecret, BadMember>,
    recorder: &Recorder,
    shutdown: &CancellationToken,
) -> Result<(), String> {
    let object = secret.object_ref(&());
    let running = match running {
        Some(running) => running,
        None => {
            // Not running here (this process restarted meanwhile, or the member never
            // started): start it for the leave, from the Secret the finalizer kept.
            let member = member.map_err(|e| format!("cannot leave: the Secret {e}"))?;
            let spec = MemberSpec {
                secret: Some(object.clone()),
                secret_created: secret.metadata.creation_timestamp.clone(),
                ..super::member_spec(&member).await?
            };
            let stop = shutdown.child_token();
            // Unchecked: a leave only cleans what carries this node's marks.
            let task = tokio::spawn(supervise(
                shared.clone(),
                spec.clone(),
                None,
                object.clone(),
                recorder.clone(),
                stop.clone(),
            ));
            Running {
                node: member.node.clone(),
                uid: secret.uid().unwrap_or_default(),
                fingerprint: fingerprint(&member),
                spec,
                stop,
                task,
            }
        }
    };
    let node = running.node.clone();
    leave::say(
        recorder,
        &object,
        EventType::Normal,
        "MemberLeaving",
        format!("node {node}: cordoned and drained before it leaves"),
    )
    .await;
    let bound = leave::Bound::of(secret, shared.args.leave_timeout);
    let say = (recorder, &object);
    // Every virtual node of the member at once (one per group with node or label=
    // granularity), so that each is cordoned before any pod is evicted: only those it
    // registered (another's Node of its name is not drained).
    let owner_of_nodes =
        NodeOwner::new(&node, Some(&object)).made_at(secret.metadata.creation_timestamp.as_ref());
    let nodes = match leave::member_nodes(&shared.upper.client, &node, &owner_of_nodes).await {
        Ok(nodes) => nodes,
        Err(error) => {
            stop(running).await;
            return Err(error.to_string());
        }
    };
    let drains = nodes
        .iter()
        .map(|n| leave::drain(&shared.upper.client, n, bound, say, shutdown));
    if let Err(error) = futures::future::try_join_all(drains).await {
        stop(running).await;
        return Err(error.to_string());
    }
    let spec = running.spec.clone();
    stop(running).await;
    shared.metrics.forget_member(&node);
    let owner = Owner::new(node.clone(), shared.cluster_id.clone());
    let deleted = leave::within(bound, &owner, say, async {
        let lower = crate::clusters::connect(
            crate::side::Side::Lower,
            spec.lower.clone(),
            spec.lower_limit,
            shared.metrics.clone(),
            None,
        )
        .await
        .map_err(|e| format!("node {node}: {e}"))?;
        leave::clean_lower(&lower.client, &owner)
            .await
            .map_err(|e| format!("node {node}: {e}"))
    })
    .await?
    .unwrap_or(0);
    for node in &nodes {
        leave::delete_node_of(&shared.upper.client, &node.name, &node.uid)
            .await
            .map_err(|e| e.to_string())?;
    }
    info!(%node, virtual_nodes = nodes.len(), lower_objects_deleted = deleted, "member left");
    leave::say(
        recorder,
        &object,
        EventType::Normal,
        "MemberLeft",
        format!("node {node} left: {deleted} lower objects deleted, Node deleted"),
    )
    .await;
    Ok(())
}

/// Removes the member finalizer from `secret`, under its UID and resourceVersion, so that
/// a finalizer another controller added meanwhile is never dropped: on a conflict the
/// Secret is read again and the removal tried again, with backoff.
async fn remove_finalizer(shared: &Shared, namespace: &str, secret: &Secret) {
    let api: Api<Secret> = Api::namespaced(shared.upper.client.clone(), namespace);
    let name = secret.name_any();
    let mut current = secret.clone();
    let mut delays = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .with_max_times(8)
        .with_jitter()
        .build();
    while let Some(patch) = finalizer_removal(&current) {
        let error = match api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return,
            Err(error) if crate::api::is_status(&error, 404) => return,
            Err(error) => error,
        };
        let retry = crate::api::is_status(&error, 409)
            .then(|| delays.next())
            .flatten();
        let Some(delay) = retry else {
            warn!(secret = %name, %error, cluster = "upper", "removing the member finalizer");
            return;
        };
        tokio::time::sleep(delay).await;
        match api.get_opt(&name).await {
            Ok(Some(fresh)) if fresh.uid() == secret.uid() => current = fresh,
            // Gone, or another Secret of the name: nothing of ours to remove.
            Ok(_) => return,
            Err(error) => {
                warn!(secret = %name, %error, cluster = "upper", "removing the member finalizer: reading the Secret");
                return;
            }
        }
    }
}

/// The merge patch that removes the member finalizer from `secret` as read (its UID and
/// resourceVersion as preconditions); `None` when it has none.
fn finalizer_removal(secret: &Secret) -> Option<serde_json::Value> {
    if !has_finalizer(secret) {
        return None;
    }
    let finalizers: Vec<&String> = secret
        .finalizers()
        .iter()
        .filter(|f| *f != MEMBER_FINALIZER)
        .collect();
    Some(json!({"metadata": {
        "uid": secret.uid(),
        "resourceVersion": secret.resource_version(),
        "finalizers": finalizers,
    }}))
}

fn has_finalizer(secret: &Secret) -> bool {
    secret.finalizers().iter().any(|f| f == MEMBER_FINALIZER)
}

/// The identity of the lower cluster the member of `secret` joined, if recorded (with the
/// member finalizer, as [`recorded_node`]).
fn recorded_lower(secret: &Secret) -> Option<&str> {
    if !has_finalizer(secret) {
        return None;
    }
    secret
        .annotations()
        .get(JOINED_LOWER_ANNOTATION)
        .map(|n| n.trim())
        .filter(|n| !n.is_empty())
}

/// Records on the member Secret `secret` (under its UID) the identity of the lower cluster
/// its member reached, unless it is recorded already.
async fn record_lower(shared: &Shared, secret: &ObjectReference, check: &mut LowerCheck) {
    let found = check
        .found
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let (Some(found), None) = (found, &check.joined) else {
        return;
    };
    let (Some(namespace), Some(name)) = (&secret.namespace, &secret.name) else {
        return;
    };
    let api: Api<Secret> = Api::namespaced(shared.upper.client.clone(), namespace);
    let patch = json!({"metadata": {
        "uid": secret.uid,
        "annotations": {JOINED_LOWER_ANNOTATION: found},
    }});
    match api
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => check.joined = Some(found),
        Err(error) => {
            warn!(secret = %format!("{namespace}/{name}"), %error, cluster = "upper",
                "recording the member's lower cluster on its Secret; trying again at its next start");
        }
    }
}

/// Whether `secret` carries the member finalizer and names `node` as the one it joined as.
fn is_marked(secret: &Secret, node: &str) -> bool {
    has_finalizer(secret) && recorded_node(secret) == Some(node)
}

/// The node the member of `secret` joined as, if recorded (by this process: the Secret
/// carries the member finalizer too; a copied annotation alone says nothing).
fn recorded_node(secret: &Secret) -> Option<&str> {
    if !has_finalizer(secret) {
        return None;
    }
    secret
        .annotations()
        .get(JOINED_NODE_ANNOTATION)
        .map(|n| n.trim())
        .filter(|n| !n.is_empty())
}

/// A member Secret names another node than the one its member joined as.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "node name {requested} refused: this Secret's member joined as node {joined} and keeps \
     that name (renaming would abandon the Node {joined}, its pods and their lower copies); \
     to rename, delete this Secret (node {joined} is drained and leaves) and create one for \
     {requested}"
)]
struct Renamed {
    joined: String,
    requested: String,
}

/// Sets `member.node` to the node its Secret's member joined as: the name recorded on the
/// Secret, else that of the member running from it (`running`), else the one it names.
/// `Err` when the Secret names another: that rename is refused.
fn joined_node(
    secret: &Secret,
    running: Option<&str>,
    member: &mut MemberSecret,
) -> Result<(), Renamed> {
    let Some(joined) = recorded_node(secret).or(running) else {
        return Ok(());
    };
    if joined == member.node {
        return Ok(());
    }
    let requested = std::mem::replace(&mut member.node, joined.to_owned());
    Err(Renamed {
        joined: joined.to_owned(),
        requested,
    })
}

/// What a member was started from: a change to any of it restarts the member (burst
/// priority and share are not in it: they change in place).
fn fingerprint(member: &MemberSecret) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    member.node.hash(&mut hasher);
    member.kubeconfig.hash(&mut hasher);
    format!("{:?}", member.taint).hash(&mut hasher);
    member.ignore_labels.hash(&mut hasher);
    member.kubelet_port.hash(&mut hasher);
    member.qps.to_bits().hash(&mut hasher);
    member.burst.hash(&mut hasher);
    format!("{:?}", member.lower_node_labels).hash(&mut hasher);
    format!("{:?}", member.kubelet_port_range).hash(&mut hasher);
    hasher.finish()
}

/// Why a change of a running member's granularity is refused.
fn granularity_change(running: &Granularity, wanted: &Granularity) -> String {
    format!(
        "annotation {GRANULARITY_ANNOTATION} changed from {running} to {wanted} on a running \
         member: refused, the member keeps running as {running}. To change it, delete the \
         Secret (the member leaves, its pods drained) and join again"
    )
}

/// Runs member `spec` until `stop`, restarting it with backoff whenever it fails, panics
/// or takes longer than [`STARTUP_TIMEOUT`] to start: each failure is a Warning Event on
/// `secret` and `tensile_member_up{node} 0` until it runs again. What a run registered in
/// the gauges is forgotten when it ends, so its stores are freed before the next.
async fn supervise(
    shared: Arc<Shared>,
    spec: MemberSpec,
    mut check: Option<LowerCheck>,
    secret: ObjectReference,
    recorder: Recorder,
    stop: CancellationToken,
) {
    let node = spec.node.clone();
    let mut delays = restart_delays();
    loop {
        shared.metrics.set_member_up(&node, false);
        let attempt = stop.child_token();
        let started = CancellationToken::new();
        let began = Instant::now();
        let mut member = MemberRun {
            task: tokio::spawn(
                super::run_checked(
                    shared.clone(),
                    spec.clone(),
                    check.clone(),
                    started.clone(),
                    attempt.clone(),
                )
                .in_current_span(),
            ),
            shared: shared.clone(),
            node: node.clone(),
        };
        let ended = member
            .until_ended(&started, &attempt, async {
                if let Some(check) = &mut check {
                    record_lower(&shared, &secret, check).await;
                }
            })
            .await;
        drop(member);
        shared.metrics.set_member_up(&node, false);
        let why = match ended {
            RunEnded::Joined(Ok(Ok(()))) if stop.is_cancelled() => return,
            RunEnded::Joined(Ok(Ok(()))) => "it stopped by itself".to_owned(),
            RunEnded::Joined(Ok(Err(message))) => message,
            RunEnded::Joined(Err(join)) if join.is_panic() => {
                format!("it panicked: {}", panic_message(join))
            }
            RunEnded::Joined(Err(join)) => format!("its task ended: {join}"),
            RunEnded::StartupTimedOut => format!(
                "it did not start within {}s (the lower API server answers too slowly, or not at all)",
                STARTUP_TIMEOUT.as_secs()
            ),
            RunEnded::Aborted => "it did not stop in time and was aborted".to_owned(),
        };
        if stop.is_cancelled() {
            return;
        }
        if began.elapsed() >= HEALTHY_RUN {
            delays = restart_delays();
        }
        let delay = delays.next().unwrap_or(MAX_RESTART_DELAY);
        error!(%node, error = %why, retry_in = ?delay, "member failed; restarting it");
        leave::say(
            &recorder,
            &secret,
            EventType::Warning,
            "MemberFailed",
            format!(
                "node {node}: {why}; restarting in {}s",
                delay.as_secs().max(1)
            ),
        )
        .await;
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

/// How one run of a member ended.
enum RunEnded {
    /// Its task ended by itself (or on its stop, in time).
    Joined(Result<Result<(), String>, tokio::task::JoinError>),
    /// It had not started within [`STARTUP_TIMEOUT`]; it was stopped.
    StartupTimedOut,
    /// Told to stop, it did not within [`STOP_TIMEOUT`]; it was aborted.
    Aborted,
}

/// One run of a member on a task of its own. Dropped (it ended, or the supervisor was
/// aborted) it aborts the task and forgets what the run registered in the gauges.
struct MemberRun {
    task: JoinHandle<Result<(), String>>,
    shared: Arc<Shared>,
    node: String,
}

impl MemberRun {
    /// Waits until the run ends: by itself, once `attempt` is cancelled (its stop, or a
    /// start-up past [`STARTUP_TIMEOUT`]), or aborted when it does not stop in time.
    /// `tensile_member_up{node}` is 1 from `started` on.
    async fn until_ended(
        &mut self,
        started: &CancellationToken,
        attempt: &CancellationToken,
        on_started: impl Future<Output = ()>,
    ) -> RunEnded {
        let mut timed_out = false;
        tokio::select! {
            ended = &mut self.task => return RunEnded::Joined(ended),
            () = attempt.cancelled() => {}
            () = started.cancelled() => {
                self.shared.metrics.set_member_up(&self.node, true);
                let run = async {
                    on_started.await;
                    std::future::pending::<()>().await;
                };
                tokio::select! {
                    () = run => {}
                    ended = &mut self.task => return RunEnded::Joined(ended),
                    () = attempt.cancelled() => {}
                }
            }
            () = tokio::time::sleep(STARTUP_TIMEOUT) => {
                timed_out = true;
                attempt.cancel();
            }
        }
        match tokio::time::timeout(STOP_TIMEOUT, &mut self.task).await {
            Ok(_) if timed_out => RunEnded::StartupTimedOut,
            Ok(ended) => RunEnded::Joined(ended),
            Err(_) => {
                warn!(node = %self.node, timeout = ?STOP_TIMEOUT, "member did not stop in time; aborting it");
                RunEnded::Aborted
            }
        }
    }
}

impl Drop for MemberRun {
    fn drop(&mut self) {
        self.task.abort();
        self.shared.metrics.forget_member_run(&self.node);
    }
}

fn restart_delays() -> impl Iterator<Item = Duration> {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_secs(1))
        .with_max_delay(MAX_RESTART_DELAY)
        .with_jitter()
        .without_max_times()
        .build()
}

fn panic_message(join: tokio::task::JoinError) -> String {
    let payload = join.into_panic();
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeStatus, NodeSystemInfo};

    fn secret(joined: Option<&str>) -> Secret {
        let mut secret = Secret::default();
        secret.metadata.name = Some("lower-a".into());
        secret.metadata.uid = Some("u1".into());
        secret.metadata.resource_version = Some("7".into());
        if let Some(joined) = joined {
            secret.metadata.annotations =
                Some([(JOINED_NODE_ANNOTATION.to_owned(), joined.to_owned())].into());
            secret.metadata.finalizers = Some(vec![MEMBER_FINALIZER.into()]);
        }
        secret
    }

    fn member(node: &str) -> MemberSecret {
        MemberSecret {
            node: node.into(),
            kubeconfig: String::new(),
            taint: None,
            ignore_labels: Vec::new(),
            kubelet_port: 0,
            qps: 1.0,
            burst: 1,
            bursting: Default::default(),
            granularity: Default::default(),
            lower_node_labels: Default::default(),
            kubelet_port_range: None,
        }
    }

    #[test]
    fn a_granularity_change_is_refused_and_says_how_to_change_it() {
        let why = granularity_change(
            &Granularity::Cluster,
            &Granularity::Label("topology.kubernetes.io/zone".into()),
        );
        assert!(
            why.contains("from cluster to label=topology.kubernetes.io/zone"),
            "{why}"
        );
        assert!(why.contains("keeps running as cluster"), "{why}");
        assert!(why.contains(GRANULARITY_ANNOTATION), "{why}");
    }

    /// A member keeps the node it joined as: a renamed Secret is refused (and says which
    /// name it keeps), whether the name was recorded on the Secret or only the running
    /// member knows it.
    #[test]
    fn a_rename_is_refused_and_the_joined_name_kept() {
        let cases = [
            // (recorded, running, requested, node run, refused)
            (None, None, "vk-a", "vk-a", false),
            (Some("vk-a"), None, "vk-a", "vk-a", false),
            (Some("vk-a"), None, "vk-b", "vk-a", true),
            (None, Some("vk-a"), "vk-b", "vk-a", true),
            (Some("vk-a"), Some("vk-a"), "vk-b", "vk-a", true),
            (Some(" "), None, "vk-b", "vk-b", false),
        ];
        for (recorded, running, requested, want, refused) in cases {
            let mut member = member(requested);
            let outcome = joined_node(&secret(recorded), running, &mut member);
            assert_eq!(member.node, want, "{recorded:?} {running:?} {requested}");
            assert_eq!(
                outcome.is_err(),
                refused,
                "{recorded:?} {running:?} {requested}"
            );
            if let Err(renamed) = outcome {
                let said = renamed.to_string();
                assert!(said.contains(requested) && said.contains(want), "{said}");
            }
        }
        // An annotation without the finalizer (copied from another Secret) says nothing.
        let mut copied = secret(Some("vk-a"));
        copied.metadata.finalizers = None;
        let mut member = member("vk-b");
        assert_eq!(joined_node(&copied, None, &mut member), Ok(()));
        assert_eq!(member.node, "vk-b");
    }

    fn node(labels: &[(&str, &str)], runtime: Option<&str>) -> Node {
        let mut node = Node::default();
        node.metadata.name = Some("vk".into());
        node.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        );
        node.status = runtime.map(|runtime| NodeStatus {
            node_info: Some(NodeSystemInfo {
                container_runtime_version: runtime.into(),
                ..NodeSystemInfo::default()
            }),
            ..NodeStatus::default()
        });
        node
    }

    /// Only a Node tensile registered (for this member, recording no other) may be taken
    /// over (and so deleted by a leave): not a real node, nor another virtual kubelet's
    /// (Liqo, Admiralty, tensile-kube).
    #[test]
    fn only_nodes_tensile_registered_are_ours_to_take() {
        let vk = [("type", "virtual-kubelet"), ("clusterID", "vk")];
        let cases = [
            (node(&vk, Some("tensile://0.1.0")), true),
            // Registered a moment ago: no status yet.
            (node(&vk, None), true),
            (node(&vk, Some("")), true),
            // Liqo's and Admiralty's virtual kubelets.
            (
                node(
                    &[
                        ("type", "virtual-kubelet"),
                        ("liqo.io/type", "virtual-node"),
                    ],
                    Some("vk-v0.10.0"),
                ),
                false,
            ),
            (node(&vk, Some("containerd://1.7.0")), false),
            (node(&[("type", "virtual-kubelet")], None), false),
            (
                node(&[("type", "virtual-kubelet"), ("clusterID", "other")], None),
                false,
            ),
            (node(&[], Some("containerd://1.7.0")), false),
            (node(&[], None), false),
        ];
        let owner = NodeOwner::new("vk", None);
        for (node, ours) in cases {
            assert_eq!(
                owner.holding(&node).is_ours(),
                ours,
                "{:?}",
                node.metadata.labels
            );
        }
    }

    /// The finalizer is removed from the Secret as read, never from a newer one: the patch
    /// carries its resourceVersion (a conflict, then a fresh read) and keeps the others'.
    #[test]
    fn the_finalizer_removal_is_preconditioned_on_the_version_read() {
        let mut with = secret(Some("vk-a"));
        with.metadata.annotations = None;
        with.metadata.finalizers = Some(vec!["other/keep".into(), MEMBER_FINALIZER.into()]);
        let patch = finalizer_removal(&with).unwrap();
        assert_eq!(
            patch,
            json!({"metadata": {"uid": "u1", "resourceVersion": "7", "finalizers": ["other/keep"]}})
        );
        assert_eq!(finalizer_removal(&secret(None)), None, "none to remove");
    }
}
