//! Pods bound to the virtual node: mirrored down, updates and deletions followed.
//! Level-triggered: each reconcile compares the upper pod with the lower pod in the store
//! and does the one step that closes the gap, whatever woke it (an upper change, a lower
//! change, a resync). Status is reflected up by [`super::status`], on a queue of its own
//! fed by the same two watches ([`watches`]), so that a reflection never waits behind
//! pods being created.

use std::sync::Arc;
use std::time::Duration;

use futures::SinkExt;
use futures::channel::mpsc;
use futures::{FutureExt, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use super::status::write_status;
use super::{Context, Error, api_error, dependencies};
use crate::api::{Deleted, delete_exact, is_status};
use crate::side::Side;
use crate::translate::meta::OWNER_NODE_LABEL;
use crate::translate::pod::{
    PodTranslation, is_owned_by, lower_gone_status, lower_pod, lower_pod_update, upper_uid,
};
use crate::translate::stored::StoredPod;

/// Reason on an upper pod whose lower pod disappeared.
pub const LOWER_POD_GONE: &str = "LowerPodGone";

/// The one step a reconcile takes for an upper pod, given its lower pod (if any).
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Upper is being deleted and the lower pod is gone: finish the upper deletion.
    FinishDeletion,
    /// Upper is being deleted: delete the lower pod with the same grace period.
    DeleteLower {
        /// Grace period in seconds.
        grace: Option<i64>,
    },
    /// The lower pod is already going; its deletion event wakes us again.
    WaitForLower,
    /// The lower pod belongs to an older upper pod of the same name: remove it first.
    DeleteStale,
    /// Create the lower pod (after its dependencies).
    Create,
    /// The lower pod vanished while the upper one runs: end the upper pod.
    MarkFailed,
    /// Both exist: reflect status up, propagate updates down.
    Sync,
    /// Nothing to do (a finished pod whose lower copy is gone).
    Nothing,
}

/// Decides the step. Pure: the table tests below cover every branch.
pub fn decide(upper: &Pod, lower: Option<&Pod>, node: &str) -> Step {
    let uid = upper.metadata.uid.as_deref();
    let lower = lower.filter(|l| is_owned_by(&l.metadata, node));
    let lower_deleting = lower.is_some_and(|l| l.metadata.deletion_timestamp.is_some());
    let same =
        lower.is_some_and(|l| upper_uid(&l.metadata).is_some() && upper_uid(&l.metadata) == uid);
    if upper.metadata.deletion_timestamp.is_some() {
        return match lower {
            None => Step::FinishDeletion,
            Some(_) if lower_deleting => Step::WaitForLower,
            Some(_) => Step::DeleteLower {
                grace: upper.metadata.deletion_grace_period_seconds,
            },
        };
    }
    match lower {
        Some(_) if same => Step::Sync,
        Some(_) if lower_deleting => Step::WaitForLower,
        Some(_) => Step::DeleteStale,
        None if is_terminal(upper) => Step::Nothing,
        None if was_mirrored(upper) => Step::MarkFailed,
        None => Step::Create,
    }
}

fn is_terminal(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// Whether the upper pod's status shows it ran below: only a reflected lower status sets
/// these (the upper scheduler writes nothing but `PodScheduled=True`).
fn was_mirrored(pod: &Pod) -> bool {
    let Some(status) = &pod.status else {
        return false;
    };
    status.start_time.is_some()
        || status.host_ip.is_some()
        || status
            .container_statuses
            .as_ref()
            .is_some_and(|c| !c.is_empty())
        || status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ != "PodScheduled" || c.status != "True")
}

/// A watch stream feeding a reflector store.
type PodStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<StoredPod, watcher::Error>> + Send>>;

/// How many changed pods may wait for a controller to take them before the watch waits.
const TRIGGER_BUFFER: usize = 1024;

/// The changed pods one controller is woken by: upper pods bound to this node and lower
/// pods it owns.
pub struct Triggers {
    pub(crate) upper: mpsc::Receiver<Arc<StoredPod>>,
    pub(crate) lower: mpsc::Receiver<Arc<StoredPod>>,
}

/// The two pod watches, their stores, and the changes they hand to the pod controller and
/// to the status reflector. Each pod is stored once; both controllers read the same stores.
pub struct PodWatches {
    /// The two stores, read by every controller that needs pods.
    pub stores: PodStores,
    /// Drives both watches and hands each changed pod to both controllers; run it beside
    /// them until shutdown.
    pub pump: futures::future::BoxFuture<'static, ()>,
    /// What wakes the pod controller ([`run`]).
    pub pods: Triggers,
    /// What wakes the status reflector ([`super::status::run`]).
    pub status: Triggers,
}

/// Whether both stores are synced; any number of tasks may wait on it. (A reflector
/// `Store::wait_until_ready` wakes only its most recent waiter, so it is awaited nowhere
/// but inside kube-runtime's runner: the upper store by the pod controller's, the lower
/// store by the status reflector's.)
#[derive(Clone)]
pub struct Synced {
    upper: watch::Receiver<bool>,
    lower: watch::Receiver<bool>,
}

impl Synced {
    /// Waits until both stores are synced; `Err` if their watches ended first.
    pub async fn wait(&self) -> Result<(), Error> {
        let (mut upper, mut lower) = (self.upper.clone(), self.lower.clone());
        upper
            .wait_for(|ready| *ready)
            .await
            .map_err(|_| Error::Shutdown)?;
        lower
            .wait_for(|ready| *ready)
            .await
            .map_err(|_| Error::Shutdown)?;
        Ok(())
    }
}

/// A reflector over `api` whose first complete list flips `ready`.
fn reflected(
    api: Api<Pod>,
    config: watcher::Config,
) -> (Store<StoredPod>, PodStream, watch::Receiver<bool>) {
    let (store, writer) = reflector::store();
    let (ready_tx, ready_rx) = watch::channel(false);
    // Pods are stored compactly: a full pod's spec detail is read only when its lower pod
    // is created, and is most of its memory.
    let events = watcher::watcher(api, config).map_ok(|event| match event {
        watcher::Event::Apply(pod) => watcher::Event::Apply(StoredPod::from(pod)),
        watcher::Event::Delete(pod) => watcher::Event::Delete(StoredPod::from(pod)),
        watcher::Event::InitApply(pod) => watcher::Event::InitApply(StoredPod::from(pod)),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitDone => watcher::Event::InitDone,
    });
    let stream = reflector::reflector(writer, events)
        .default_backoff()
        .inspect_ok(move |event| {
            if matches!(event, watcher::Event::InitDone) {
                ready_tx.send_replace(true);
            }
        })
        .touched_objects();
    (store, Box::pin(stream), ready_rx)
}

/// Polls `stream` (which keeps its store current) and hands every changed pod, deletions
/// included, to each of `to`. A controller that has stopped is skipped; the store is kept
/// current for the others.
async fn fan_out(mut stream: PodStream, side: Side, mut to: [mpsc::Sender<Arc<StoredPod>>; 2]) {
    while let Some(changed) = stream.next().await {
        match changed {
            Ok(pod) => {
                let pod = Arc::new(pod);
                for tx in &mut to {
                    // Fails only once that controller has stopped.
                    let _ = tx.send(pod.clone()).await;
                }
            }
            Err(error) => warn!(cluster = %side, %error, "watching pods; retrying with backoff"),
        }
    }
}

/// Sets up the watches: upper pods with `spec.nodeName=<node>` (in `--namespace` if
/// given), lower pods labelled as this node's.
pub fn watches(ctx: &Context) -> PodWatches {
    let upper_api: Api<Pod> = if ctx.namespace.is_empty() {
        Api::all(ctx.upper.clone())
    } else {
        Api::namespaced(ctx.upper.clone(), &ctx.namespace)
    };
    let (upper_store, upper_stream, upper_ready) = reflected(
        upper_api,
        watcher::Config::default().fields(&format!("spec.nodeName={}", ctx.node_name)),
    );
    let (lower_store, lower_stream, lower_ready) = reflected(
        Api::all(ctx.lower.clone()),
        watcher::Config::default().labels(&format!("{OWNER_NODE_LABEL}={}", ctx.node_name)),
    );
    let (pods_upper, pods_upper_rx) = mpsc::channel(TRIGGER_BUFFER);
    let (pods_lower, pods_lower_rx) = mpsc::channel(TRIGGER_BUFFER);
    let (status_upper, status_upper_rx) = mpsc::channel(TRIGGER_BUFFER);
    let (status_lower, status_lower_rx) = mpsc::channel(TRIGGER_BUFFER);
    let pump = futures::future::join(
        fan_out(upper_stream, Side::Upper, [pods_upper, status_upper]),
        fan_out(lower_stream, Side::Lower, [pods_lower, status_lower]),
    )
    .map(|((), ())| ())
    .boxed();
    PodWatches {
        stores: PodStores {
            upper: upper_store,
            lower: lower_store,
            synced: Synced {
                upper: upper_ready,
                lower: lower_ready,
            },
        },
        pump,
        pods: Triggers {
            upper: pods_upper_rx,
            lower: pods_lower_rx,
        },
        status: Triggers {
            upper: status_upper_rx,
            lower: status_lower_rx,
        },
    }
}

/// The stores both pod controllers read.
#[derive(Clone)]
pub struct PodStores {
    /// Upper pods bound to this node.
    pub upper: Store<StoredPod>,
    /// Lower pods this node owns.
    pub lower: Store<StoredPod>,
    /// Whether both are synced.
    pub synced: Synced,
}

struct PodContext {
    ctx: Arc<Context>,
    lower_pods: Store<StoredPod>,
    synced: Synced,
}

/// The `ObjectRef` of the pod of the same namespace and name in the other cluster.
pub(crate) fn same_name(pod: &Arc<StoredPod>) -> Option<ObjectRef<StoredPod>> {
    let name = pod.metadata.name.as_deref()?;
    let namespace = pod.metadata.namespace.as_deref()?;
    Some(ObjectRef::new(name).within(namespace))
}

/// Runs the pod controller until `shutdown`.
pub async fn run(
    ctx: Arc<Context>,
    triggers: Triggers,
    stores: PodStores,
    workers: u16,
    resync: Duration,
    shutdown: CancellationToken,
) {
    let controller = Controller::for_shared_stream(triggers.upper, stores.upper)
        .with_config(ControllerConfig::default().concurrency(workers))
        .watches_shared_stream(triggers.lower, |lower: Arc<StoredPod>| same_name(&lower))
        .reconcile_all_on(tokio_stream_interval(resync))
        .graceful_shutdown_on(shutdown.cancelled_owned());
    let pod_ctx = Arc::new(PodContext {
        ctx,
        lower_pods: stores.lower,
        synced: stores.synced,
    });
    drain(
        controller.run(reconcile, error_policy, pod_ctx),
        "pod reconcile",
    )
    .await;
}

/// Runs a controller's result stream to its end; failures were reported by the reconcile
/// itself, so they are only logged at debug here.
pub(crate) async fn drain<T, E: std::fmt::Display>(
    results: impl futures::Stream<Item = Result<T, E>>,
    what: &'static str,
) {
    results
        .for_each(|result| async move {
            if let Err(error) = result {
                debug!(%error, "{what}");
            }
        })
        .await;
}

pub(crate) fn tokio_stream_interval(
    period: Duration,
) -> impl futures::Stream<Item = ()> + Send + 'static {
    futures::stream::unfold(
        tokio::time::interval_at(tokio::time::Instant::now() + period, period),
        |mut interval| async move {
            interval.tick().await;
            Some(((), interval))
        },
    )
}

pub(crate) fn key_of(meta: &ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default()
    )
}

async fn reconcile(stored: Arc<StoredPod>, pc: Arc<PodContext>) -> Result<Action, Error> {
    let key = key_of(&stored.metadata);
    let upper = stored.to_pod();
    let span = info_span!("pod", pod = %key);
    async {
        pc.synced.wait().await?;
        let ctx = &pc.ctx;
        ctx.metrics.reconciles.inc();
        let result = reconcile_pod(&upper, &pc, &key).await;
        match &result {
            Ok(_) => ctx.succeeded(&key),
            Err(error) => {
                ctx.metrics.reconcile_failed(error.metric_label());
                report(ctx, &upper, error).await;
            }
        }
        result
    }
    .instrument(span)
    .await
}

async fn reconcile_pod(upper: &Pod, pc: &PodContext, key: &str) -> Result<Action, Error> {
    let ctx = &pc.ctx;
    let name = upper.name_any();
    let namespace = upper.namespace().unwrap_or_default();
    let lower_ref = ObjectRef::new(&name).within(&namespace);
    let lower = pc.lower_pods.get(&lower_ref).map(|l| l.to_pod());
    let lower_api: Api<Pod> = Api::namespaced(ctx.lower.clone(), &namespace);
    let upper_api: Api<Pod> = Api::namespaced(ctx.upper.clone(), &namespace);
    let step = decide(upper, lower.as_ref(), &ctx.node_name);
    debug!(?step, "reconcile");
    match step {
        Step::Nothing | Step::WaitForLower => {}
        Step::FinishDeletion => {
            let deleted = delete_exact(&upper_api, &name, upper.metadata.uid.clone(), Some(0))
                .await
                .map_err(api_error(Side::Upper, "deleting", "Pod", key))?;
            if deleted == Deleted::Now {
                info!(cluster = "upper", "lower pod gone; finished the deletion");
            }
        }
        Step::DeleteLower { grace } => {
            delete_lower(&lower_api, lower.as_ref(), grace, key).await?;
            info!(cluster = "lower", ?grace, "deleting the lower pod");
        }
        Step::DeleteStale => {
            delete_lower(&lower_api, lower.as_ref(), None, key).await?;
            info!(
                cluster = "lower",
                "deleting a lower pod left by an earlier pod of this name"
            );
        }
        Step::Create => create(upper, pc, &lower_api, key).await?,
        Step::MarkFailed => {
            let status = lower_gone_status(
                upper,
                LOWER_POD_GONE,
                "the pod was deleted or evicted in the lower cluster",
            );
            write_status(&upper_api, &name, &status, key).await?;
            ctx.warn_on(
                upper,
                LOWER_POD_GONE,
                format!("lower pod {key} disappeared; the pod has failed so its controller can replace it"),
            )
            .await;
            info!(cluster = "upper", "lower pod gone; marked the pod Failed");
        }
        Step::Sync => {
            if let Some(lower) = lower.as_ref() {
                propagate_update(upper, lower, pc, &lower_api, key).await?;
            }
        }
    }
    Ok(Action::await_change())
}

async fn delete_lower(
    lower_api: &Api<Pod>,
    lower: Option<&Pod>,
    grace: Option<i64>,
    key: &str,
) -> Result<(), Error> {
    let Some(lower) = lower else {
        return Ok(());
    };
    let grace = grace.and_then(|g| u32::try_from(g).ok());
    delete_exact(
        lower_api,
        &lower.name_any(),
        lower.metadata.uid.clone(),
        grace,
    )
    .await
    .map_err(api_error(Side::Lower, "deleting", "Pod", key))?;
    Ok(())
}

async fn create(
    stored: &Pod,
    pc: &PodContext,
    lower_api: &Api<Pod>,
    key: &str,
) -> Result<(), Error> {
    let ctx = &pc.ctx;
    // The store holds a pruned pod; the lower pod is made from the whole one.
    let upper_api: Api<Pod> =
        Api::namespaced(ctx.upper.clone(), &stored.namespace().unwrap_or_default());
    let Some(upper) = upper_api
        .get_opt(&stored.name_any())
        .await
        .map_err(api_error(Side::Upper, "reading", "Pod", key))?
        .filter(|p| p.metadata.uid == stored.metadata.uid)
    else {
        // Gone or replaced meanwhile: its own watch event brings the next step.
        return Ok(());
    };
    let upper = &upper;
    dependencies::ensure_for_pod(ctx, upper, key).await?;
    let translation = PodTranslation {
        owner: &ctx.owner,
        ignore_labels: &ctx.ignore_labels,
    };
    let pod = lower_pod(upper, &translation)?;
    match lower_api.create(&PostParams::default(), &pod).await {
        Ok(_) => {
            ctx.metrics.lower_creates.inc();
            info!(cluster = "lower", "created the lower pod");
            Ok(())
        }
        Err(e) if is_status(&e, 409) => {
            // Our store may lag our own create; anything else of this name is not ours.
            let existing = lower_api
                .get_opt(&upper.name_any())
                .await
                .map_err(api_error(Side::Lower, "reading", "Pod", key))?;
            match existing {
                Some(p) if is_owned_by(&p.metadata, &ctx.node_name) => Ok(()),
                Some(_) => Err(Error::Conflict {
                    key: key.to_owned(),
                    node: ctx.node_name.clone(),
                }),
                None => Ok(()),
            }
        }
        Err(e) => Err(api_error(Side::Lower, "creating", "Pod", key)(e)),
    }
}

/// Carries an upper pod's changed labels, annotations, images, tolerations or deadline
/// down to its lower pod.
async fn propagate_update(
    upper: &Pod,
    lower: &Pod,
    pc: &PodContext,
    lower_api: &Api<Pod>,
    key: &str,
) -> Result<(), Error> {
    let ctx = &pc.ctx;
    let translation = PodTranslation {
        owner: &ctx.owner,
        ignore_labels: &ctx.ignore_labels,
    };
    if let Some(patch) = lower_pod_update(upper, lower, &translation)? {
        lower_api
            .patch(
                &lower.name_any(),
                &PatchParams::default(),
                &Patch::Strategic(&patch),
            )
            .await
            .map_err(api_error(Side::Lower, "updating", "Pod", key))?;
        ctx.metrics.lower_updates.inc();
        info!(cluster = "lower", "propagated an update");
    }
    Ok(())
}

/// Tells the user why a pod is not running below: a Warning event (deduplicated into a
/// series) and, while nothing runs below, the reason on the pending upper pod.
async fn report(ctx: &Context, upper: &Pod, error: &Error) {
    let Some(reason) = error.event_reason() else {
        warn!(%error, "reconcile failed");
        return;
    };
    warn!(%error, reason, "reconcile failed");
    let mut note = error.to_string();
    note.truncate(1000);
    ctx.warn_on(upper, reason, note.clone()).await;
    let status = upper.status.clone().unwrap_or_default();
    let pending = status.phase.as_deref().is_none_or(|p| p == "Pending") && !was_mirrored(upper);
    if pending
        && (status.reason.as_deref() != Some(reason) || status.message.as_deref() != Some(&note))
    {
        let patch = json!({"status": {"phase": "Pending", "reason": reason, "message": note}});
        let api: Api<Pod> =
            Api::namespaced(ctx.upper.clone(), &upper.namespace().unwrap_or_default());
        if let Err(error) = api
            .patch_status(
                &upper.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            debug!(%error, cluster = "upper", "recording the pending reason");
        }
    }
}

fn error_policy(upper: Arc<StoredPod>, _error: &Error, pc: Arc<PodContext>) -> Action {
    Action::requeue(pc.ctx.backoff(&key_of(&upper.metadata)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    const NODE: &str = "vk";

    fn upper(extra_meta: Value, status: Value) -> Pod {
        let mut meta = json!({"name": "p", "namespace": "ns", "uid": "u1"});
        if let (Some(m), Some(e)) = (meta.as_object_mut(), extra_meta.as_object()) {
            m.extend(e.clone());
        }
        serde_json::from_value(json!({
            "metadata": meta,
            "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "i"}]},
            "status": status,
        }))
        .unwrap()
    }

    fn lower(owner: &str, uid: &str, deleting: bool) -> Pod {
        let mut meta = json!({
            "name": "p", "namespace": "ns", "uid": "l1",
            "labels": {OWNER_NODE_LABEL: owner},
            "annotations": {crate::translate::meta::UPPER_UID_ANNOTATION: uid},
        });
        if deleting {
            meta["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        }
        serde_json::from_value(json!({"metadata": meta, "spec": {"containers": []}})).unwrap()
    }

    #[test]
    fn decide_table() {
        let deleting =
            json!({"deletionTimestamp": "2026-01-01T00:00:00Z", "deletionGracePeriodSeconds": 30});
        let scheduled =
            json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]});
        let running =
            json!({"phase": "Running", "hostIP": "10.0.0.1", "startTime": "2026-01-01T00:00:00Z"});
        let unschedulable_below = json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False"}]});
        let cases: Vec<(&str, Pod, Option<Pod>, Step)> = vec![
            (
                "new pod: create",
                upper(json!({}), scheduled.clone()),
                None,
                Step::Create,
            ),
            (
                "pending with our reason only: still create",
                upper(
                    json!({}),
                    json!({"phase": "Pending", "reason": "MissingDependency"}),
                ),
                None,
                Step::Create,
            ),
            (
                "mirrored pair: sync",
                upper(json!({}), running.clone()),
                Some(lower(NODE, "u1", false)),
                Step::Sync,
            ),
            (
                "lower vanished under a running pod: fail it",
                upper(json!({}), running.clone()),
                None,
                Step::MarkFailed,
            ),
            (
                "lower vanished while unschedulable below: fail it",
                upper(json!({}), unschedulable_below),
                None,
                Step::MarkFailed,
            ),
            (
                "finished pod without lower: nothing",
                upper(
                    json!({}),
                    json!({"phase": "Succeeded", "startTime": "2026-01-01T00:00:00Z"}),
                ),
                None,
                Step::Nothing,
            ),
            (
                "failed pod without lower: never re-created",
                upper(json!({}), json!({"phase": "Failed"})),
                None,
                Step::Nothing,
            ),
            (
                "upper deleting, lower there: delete it with the grace period",
                upper(deleting.clone(), running.clone()),
                Some(lower(NODE, "u1", false)),
                Step::DeleteLower { grace: Some(30) },
            ),
            (
                "upper deleting, lower going: wait",
                upper(deleting.clone(), running.clone()),
                Some(lower(NODE, "u1", true)),
                Step::WaitForLower,
            ),
            (
                "upper deleting, lower gone: finish",
                upper(deleting.clone(), running.clone()),
                None,
                Step::FinishDeletion,
            ),
            (
                "lower from an older pod of this name: remove it",
                upper(json!({"uid": "u2"}), scheduled.clone()),
                Some(lower(NODE, "u1", false)),
                Step::DeleteStale,
            ),
            (
                "stale lower already going: wait",
                upper(json!({"uid": "u2"}), scheduled.clone()),
                Some(lower(NODE, "u1", true)),
                Step::WaitForLower,
            ),
            (
                "another node's lower pod is invisible: create (the API's conflict tells)",
                upper(json!({}), scheduled),
                Some(lower("vk-other", "u1", false)),
                Step::Create,
            ),
        ];
        for (name, upper, lower, want) in cases {
            assert_eq!(decide(&upper, lower.as_ref(), NODE), want, "{name}");
        }
    }
}
