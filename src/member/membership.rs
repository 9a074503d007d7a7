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

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use backon::BackoffBuilder;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, ObjectReference, Secret};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde_json::json;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, error, info, info_span, warn};

use super::spec::{self, BadMember, Defaults, MEMBER_FINALIZER, MEMBER_LABEL, MemberSecret};
use super::{MemberSpec, Shared, leave};
use crate::translate::meta::Owner;

/// A member that ran at least this long before failing starts again at once.
const HEALTHY_RUN: Duration = Duration::from_secs(60);
/// The longest wait between restarts of a failing member.
const MAX_RESTART_DELAY: Duration = Duration::from_secs(60);
/// How often the Secrets are looked at again without a change (a failed leave, a node
/// name that a real node gave up).
const RECHECK: Duration = Duration::from_secs(10);

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
            // Waiting for the lease: a standby starts no member (each would write).
            if let Some(leading) = &self.shared.leading
                && !*leading.borrow()
            {
                continue;
            }
            self.reconcile(&store, &shutdown).await;
            listed.cancel();
        }
        self.stop_all().await;
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
            let member = match spec::read(secret, &self.defaults) {
                Ok(member) => member,
                Err(bad) => {
                    self.complain(secret, "MemberInvalid", &bad.to_string())
                        .await;
                    continue;
                }
            };
            if let Some(by) = claimed.get(&member.node) {
                let why = format!("node name {} is taken by {by}", member.node);
                self.complain(secret, "MemberNodeNameTaken", &why).await;
                continue;
            }
            claimed.insert(member.node.clone(), format!("member Secret {name}"));
            wanted.insert(name, (secret.clone(), member));
        }

        // Leaves: Secrets being deleted, and members whose Secret is gone.
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
                stop(running).await;
            }
        }

        for (name, (secret, member)) in wanted {
            let fingerprint = fingerprint(&member);
            if let Some(running) = self.running.get(&name)
                && running.fingerprint == fingerprint
                && Some(&running.uid) == secret.uid().as_ref()
            {
                continue;
            }
            let spec = match super::member_spec(&member).await {
                Ok(spec) => spec,
                Err(why) => {
                    // A rotation to a bad kubeconfig leaves the running member as it is.
                    self.complain(&secret, "MemberInvalid", &why).await;
                    continue;
                }
            };
            if let Err(why) = self.node_is_ours_to_take(&member.node).await {
                self.complain(&secret, "MemberNodeNameTaken", &why).await;
                continue;
            }
            if !has_finalizer(&secret) && !self.add_finalizer(&secret).await {
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
            let task = tokio::spawn(
                supervise(
                    self.shared.clone(),
                    spec.clone(),
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

    /// Whether `node` may be registered by a member: no Node of that name, or one that is
    /// a virtual node (`type=virtual-kubelet`); a real node's name is refused.
    async fn node_is_ours_to_take(&self, node: &str) -> Result<(), String> {
        let nodes: Api<Node> = Api::all(self.shared.upper.client.clone());
        match nodes.get_opt(node).await {
            Ok(None) => Ok(()),
            Ok(Some(found)) => {
                let virtual_node = found
                    .labels()
                    .get("type")
                    .is_some_and(|t| t == "virtual-kubelet");
                if virtual_node {
                    Ok(())
                } else {
                    Err(format!(
                        "node name {node} is taken by a Node of the upper cluster that is not a virtual node"
                    ))
                }
            }
            Err(error) => Err(format!("upper cluster: reading node {node}: {error}")),
        }
    }

    /// Adds the member finalizer to `secret` (under its UID); false if it could not.
    async fn add_finalizer(&mut self, secret: &Secret) -> bool {
        let api: Api<Secret> = Api::namespaced(self.shared.upper.client.clone(), &self.namespace);
        let mut finalizers = secret.finalizers().to_vec();
        finalizers.push(MEMBER_FINALIZER.to_owned());
        let patch = json!({
            "metadata": {
                "uid": secret.uid(),
                "resourceVersion": secret.resource_version(),
                "finalizers": finalizers,
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
                    "adding the member finalizer failed; trying again");
                false
            }
        }
    }

    async fn start_leave(&mut self, secret: Arc<Secret>, shutdown: &CancellationToken) {
        let name = secret.name_any();
        let running = self.running.remove(&name);
        let member = spec::read(&secret, &self.defaults);
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
        info!(secret = %name, node = ?node, "member Secret deleted: the member leaves");
        let task = tokio::spawn(
            async move {
                let outcome = leave_member(&shared, &secret, running, member, &recorder, &shutdown).await;
                match outcome {
                    Ok(()) => {
                        remove_finalizer(&shared, &namespace, &secret).await;
                    }
                    Err(error) => {
                        warn!(secret = %secret.name_any(), %error, "member leave failed; trying again");
                        publish(&recorder, &secret.object_ref(&()), EventType::Warning,
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
        publish(
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

/// Stops a running member and waits for it.
async fn stop(running: Running) {
    running.stop.cancel();
    let _ = running.task.await;
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
            let spec = super::member_spec(&member).await?;
            let stop = shutdown.child_token();
            let task = tokio::spawn(supervise(
                shared.clone(),
                spec.clone(),
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
    publish(
        recorder,
        &object,
        EventType::Normal,
        "MemberLeaving",
        format!("node {node}: cordoned and drained before it leaves"),
    )
    .await;
    let bound = leave::Bound::of(secret, shared.args.leave_timeout);
    let say = (recorder, &object);
    if let Err(error) = leave::drain(&shared.upper.client, &node, bound, say, shutdown).await {
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
    leave::delete_node(&shared.upper.client, &node)
        .await
        .map_err(|e| e.to_string())?;
    info!(%node, lower_objects_deleted = deleted, "member left");
    publish(
        recorder,
        &object,
        EventType::Normal,
        "MemberLeft",
        format!("node {node} left: {deleted} lower objects deleted, Node deleted"),
    )
    .await;
    Ok(())
}

async fn remove_finalizer(shared: &Shared, namespace: &str, secret: &Secret) {
    let api: Api<Secret> = Api::namespaced(shared.upper.client.clone(), namespace);
    let finalizers: Vec<&String> = secret
        .finalizers()
        .iter()
        .filter(|f| *f != MEMBER_FINALIZER)
        .collect();
    let patch = json!({"metadata": {"uid": secret.uid(), "finalizers": finalizers}});
    if let Err(error) = api
        .patch(
            &secret.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        && !crate::api::is_status(&error, 404)
    {
        warn!(secret = %secret.name_any(), %error, cluster = "upper", "removing the member finalizer");
    }
}

fn has_finalizer(secret: &Secret) -> bool {
    secret.finalizers().iter().any(|f| f == MEMBER_FINALIZER)
}

/// What a member was started from: a change to any of it restarts the member.
fn fingerprint(member: &MemberSecret) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    member.node.hash(&mut hasher);
    member.kubeconfig.hash(&mut hasher);
    format!("{:?}", member.taint).hash(&mut hasher);
    member.ignore_labels.hash(&mut hasher);
    member.kubelet_port.hash(&mut hasher);
    member.qps.to_bits().hash(&mut hasher);
    member.burst.hash(&mut hasher);
    hasher.finish()
}

/// Runs member `spec` until `stop`, restarting it with backoff whenever it fails or
/// panics: each failure is a Warning Event on `secret` and `tensile_member_up{node} 0`
/// until it runs again.
async fn supervise(
    shared: Arc<Shared>,
    spec: MemberSpec,
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
        let mut member = tokio::spawn(
            super::run(
                shared.clone(),
                spec.clone(),
                started.clone(),
                attempt.clone(),
            )
            .in_current_span(),
        );
        let ended = tokio::select! {
            ended = &mut member => ended,
            () = started.cancelled() => {
                shared.metrics.set_member_up(&node, true);
                (&mut member).await
            }
        };
        shared.metrics.set_member_up(&node, false);
        let why = match ended {
            Ok(Ok(())) if stop.is_cancelled() => return,
            Ok(Ok(())) => "it stopped by itself".to_owned(),
            Ok(Err(message)) => message,
            Err(join) if join.is_panic() => format!("it panicked: {}", panic_message(join)),
            Err(join) => format!("its task ended: {join}"),
        };
        if stop.is_cancelled() {
            return;
        }
        if began.elapsed() >= HEALTHY_RUN {
            delays = restart_delays();
        }
        let delay = delays.next().unwrap_or(MAX_RESTART_DELAY);
        error!(%node, error = %why, retry_in = ?delay, "member failed; restarting it");
        publish(
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

async fn publish(
    recorder: &Recorder,
    object: &ObjectReference,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let event = Event {
        type_,
        reason: reason.into(),
        note: Some(note),
        action: "Membership".into(),
        secondary: None,
    };
    if let Err(error) = recorder.publish(&event, object).await {
        tracing::debug!(%error, cluster = "upper", "publishing an event on a member Secret");
    }
}
