//! Pods bound to the virtual node: mirrored down, updates and deletions followed.
//! Level-triggered: each reconcile compares the upper pod with the lower pod in the store
//! and does the one step that closes the gap, whatever woke it (an upper change, a lower
//! change, a resync). Status is reflected up by [`super::status`], on a queue of its own
//! fed by the same two watches ([`super::pod_watch`]), so that a reflection never waits
//! behind pods being created.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Pod, PodStatus};
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::ObjectRef;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use futures::StreamExt;
use tokio::sync::watch;

use super::pod_store::{PodStore, WholePods};
use super::pod_watch::{PodQueue, PodStores, Triggers, run_controller};
use super::resize::{DEFERRED_RETRY, Resized, Stores, carry_resize};
use super::stores::Ready;
use super::{Context, Error, api_error, dependencies};
use crate::api::{Deleted, delete_exact, is_replaced, is_status};
use crate::node::burst::{
    Burst, DELETION_COST_ANNOTATION, DELETION_COST_MARK, deletion_cost_to_write, with_deletion_cost,
};
use crate::side::Side;
use crate::translate::admission::{
    NODE_PORTS_MESSAGE, NODE_PORTS_REASON, admitted_before, asks_for_host_ports, host_ports_taken,
    rejected_status,
};
use crate::translate::meta::Owner;
use crate::translate::pod::{
    PodTranslation, ephemeral_containers_patch, is_copy_of, is_owned_by, lower_gone_status,
    lower_pod, lower_pod_update, missing_ephemeral_containers, pending_reason_patch,
    terminated_status, upper_status, upper_status_patch, upper_uid, was_mirrored,
};
use crate::translate::stored::StoredPod;
use crate::translate::with_uid_precondition;
use crate::translate::{TranslateError, object_ref};

/// Reason of the Event on an upper pod held back because its node is cordoned.
pub const NODE_CORDONED: &str = "NodeCordoned";

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
    /// The lower pod vanished while the upper one runs: end the upper pod (unless the
    /// lower pod is still there, only without tensile's owner label).
    MarkFailed,
    /// Both exist and are a pair: propagate upper updates down (and put back any of
    /// tensile's marks edited away below). Their status is reflected by
    /// [`super::status`], not by this step.
    Sync,
    /// Nothing to do (a finished pod whose lower copy is gone).
    Nothing,
}

/// Decides the step. Pure: the table tests below cover every branch.
pub fn decide(upper: &Pod, lower: Option<&Pod>, owner: &Owner) -> Step {
    let uid = upper.metadata.uid.as_deref();
    let lower = lower.filter(|l| is_owned_by(&l.metadata, owner));
    let lower_deleting = lower.is_some_and(|l| l.metadata.deletion_timestamp.is_some());
    // A lower pod of ours whose upper-UID mark was edited away is this pod's copy if this
    // pod ran below: deleting it would kill what runs. Without that record it may be an
    // older pod's, and is replaced (nothing of this pod ran).
    let same = lower.is_some_and(|l| match upper_uid(&l.metadata) {
        Some(mark) => Some(mark) == uid,
        None => was_mirrored(upper),
    });
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

/// Which pods a destructive step must be confirmed against, read from the API servers
/// rather than the stores (which may lag: a new leader's upper store may still hold the
/// UID a StatefulSet pod had before the old leader replaced it, a lower store may not yet
/// hold a copy made a moment ago).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LiveReads {
    /// The upper pod of the name.
    pub upper: bool,
    /// The lower pod of the name.
    pub lower: bool,
}

/// What `step` (decided over the stores, `upper` and `lower` as they hold them) needs read
/// live before it is taken: deleting a lower pod needs the upper pod, unless the lower
/// pod carries the UID of the stored upper pod, which is being deleted (a deletion is
/// never undone, so that copy goes whatever the store lags); finishing an upper deletion
/// needs the lower pod. Every other step destroys nothing. Pure.
pub fn live_reads(step: &Step, upper: &Pod, lower: Option<&Pod>) -> LiveReads {
    match step {
        Step::DeleteStale => LiveReads {
            upper: true,
            lower: false,
        },
        Step::DeleteLower { .. } => {
            let mark = lower.and_then(|l| upper_uid(&l.metadata));
            let own_copy = mark.is_some() && mark == upper.metadata.uid.as_deref();
            LiveReads {
                upper: !own_copy,
                lower: false,
            }
        }
        Step::FinishDeletion => LiveReads {
            upper: false,
            lower: true,
        },
        _ => LiveReads::default(),
    }
}

/// The step to take now: `planned`, decided over the stores (`stored` the upper pod),
/// decided again over the pods as read live (`live_upper`, `live_lower`: `None` is no pod
/// of the name; the stored pods stand in for what [`live_reads`] did not ask for). When the
/// upper pod of the name is gone or another one (another UID), or the live pods call for
/// another kind of step, the stores lag: [`Step::Nothing`], and their watch events bring
/// the next reconcile. Pure.
pub fn confirm(
    planned: &Step,
    stored: &Pod,
    live_upper: Option<&Pod>,
    live_lower: Option<&Pod>,
    owner: &Owner,
) -> Step {
    let Some(live) = live_upper
        .filter(|live| live.metadata.uid.is_some() && live.metadata.uid == stored.metadata.uid)
    else {
        return Step::Nothing;
    };
    let now = decide(live, live_lower, owner);
    if std::mem::discriminant(&now) == std::mem::discriminant(planned) {
        now
    } else {
        Step::Nothing
    }
}

/// Whether the status of `lower` is reflected onto `upper`: a pair in step ([`Step::Sync`]),
/// or an upper pod being deleted and its own copy below (by the upper-UID mark) while that
/// terminates: a kubelet keeps writing a terminating pod's status (not ready, containers
/// terminated) until it finishes the deletion.
pub fn reflects_status(upper: &Pod, lower: &Pod, owner: &Owner) -> bool {
    let deleting_with_its_copy = upper.metadata.deletion_timestamp.is_some()
        && is_owned_by(&lower.metadata, owner)
        && upper_uid(&lower.metadata).is_some()
        && upper_uid(&lower.metadata) == upper.metadata.uid.as_deref();
    deleting_with_its_copy || decide(upper, Some(lower), owner) == Step::Sync
}

fn is_terminal(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// The upper pod of `name` as the API server has it now, not as the store holds it (the
/// store may lag: a standby's watch, a relist after a 410): what a step that destroys
/// something below decides on. `None`: there is no pod of that name.
pub(crate) async fn read_upper_pod(
    api: &Api<Pod>,
    name: &str,
    key: &str,
) -> Result<Option<Pod>, Error> {
    api.get_opt(name)
        .await
        .map_err(api_error(Side::Upper, "reading", "Pod", key))
}

/// [`read_upper_pod`], only while the pod of that name is still `stored` (by UID).
async fn upper_pod_now(api: &Api<Pod>, stored: &Pod, key: &str) -> Result<Option<Pod>, Error> {
    Ok(read_upper_pod(api, &stored.name_any(), key)
        .await?
        .filter(|p| p.metadata.uid == stored.metadata.uid))
}

/// What a status write to an upper pod did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusWrite {
    /// The status was written.
    Written,
    /// The pod is gone or was re-created under its name; nothing was written.
    PodReplaced,
}

/// Writes `status` as the status of the upper pod `upper` ([`upper_status_patch`]), only
/// while the pod of that name is still `upper` (by UID).
pub async fn write_upper_status(
    api: &Api<Pod>,
    upper: &Pod,
    status: &PodStatus,
    key: &str,
) -> Result<StatusWrite, Error> {
    write_upper_status_and_cost(api, upper, status, None, key).await
}

/// [`write_upper_status`], with the deletion cost `cost` in the same write if given
/// ([`with_deletion_cost`]).
pub async fn write_upper_status_and_cost(
    api: &Api<Pod>,
    upper: &Pod,
    status: &PodStatus,
    cost: Option<i32>,
    key: &str,
) -> Result<StatusWrite, Error> {
    let uid = upper.metadata.uid.as_deref().ok_or_else(|| {
        Error::Translate(TranslateError::MissingField {
            kind: "Pod",
            object: key.to_owned(),
            field: "metadata.uid",
        })
    })?;
    let patch = upper_status_patch(uid, status);
    let patch = match cost {
        Some(cost) => with_deletion_cost(patch, cost),
        None => patch,
    };
    match api
        .patch_status(
            &upper.name_any(),
            &PatchParams::default(),
            &Patch::Strategic(&patch),
        )
        .await
    {
        Ok(_) => Ok(StatusWrite::Written),
        Err(e) if is_replaced(&e) => Ok(StatusWrite::PodReplaced),
        Err(e) => Err(api_error(Side::Upper, "writing the status of", "Pod", key)(
            e,
        )),
    }
}

struct PodContext {
    ctx: Arc<Context>,
    upper_pods: PodStore,
    lower_pods: PodStore,
    /// Upper pods whole while their lower copy is being made.
    whole: WholePods,
    synced: Ready,
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
    let pod_ctx = Arc::new(PodContext {
        ctx,
        upper_pods: stores.upper.clone(),
        lower_pods: stores.lower,
        whole: stores.whole,
        synced: stores.synced,
    });
    let queue = PodQueue::measured(&pod_ctx.ctx.metrics, &pod_ctx.ctx.owner.node, "pod queue");
    // An uncordon, or a new burst priority, concerns every pod: each is looked at again.
    let every_pod = wake_every_pod(
        pod_ctx.ctx.cordons.lifted(),
        pod_ctx.ctx.bursting.clone(),
        pod_ctx.upper_pods.clone(),
    );
    let triggers = Triggers {
        upper: futures::stream::select(triggers.upper, every_pod).boxed(),
        lower: triggers.lower,
    };
    run_controller(
        triggers,
        stores.upper,
        queue,
        workers,
        resync,
        shutdown,
        |upper| {
            let pc = pod_ctx.clone();
            async move {
                match reconcile(&upper, &pc).await {
                    Ok(again) => again,
                    Err(_) => Some(pc.ctx.backoff(&upper.meta.key())),
                }
            }
        },
    )
    .await;
}

/// Every pod of `upper` each time a node is uncordoned (`lifted`) or the burst priority
/// changes.
fn wake_every_pod(
    lifted: watch::Receiver<u64>,
    bursting: watch::Receiver<Burst>,
    upper: PodStore,
) -> impl futures::Stream<Item = Arc<StoredPod>> + Send + 'static {
    let priority = bursting.borrow().priority;
    let state = (lifted, priority, bursting, true, true);
    let changes = futures::stream::unfold(state, |mut state| async move {
        loop {
            let (lifted, priority, bursting, cordon_open, bursting_open) = &mut state;
            if !*cordon_open && !*bursting_open {
                return None;
            }
            tokio::select! {
                changed = lifted.changed(), if *cordon_open => {
                    *cordon_open = changed.is_ok();
                    lifted.mark_unchanged();
                    if changed.is_ok() {
                        return Some(((), state));
                    }
                }
                changed = bursting.changed(), if *bursting_open => {
                    *bursting_open = changed.is_ok();
                    let now = bursting.borrow_and_update().priority;
                    if changed.is_ok() && now != *priority {
                        *priority = now;
                        return Some(((), state));
                    }
                }
            }
        }
    });
    changes.flat_map(move |()| futures::stream::iter(upper.state()))
}

/// The deletion cost virtual-node writes on `upper` (one of its pods) at `priority`, if
/// one is to be written ([`deletion_cost_to_write`]): none on a pod being deleted.
pub(crate) fn deletion_cost_due(upper: &StoredPod, priority: u32) -> Option<i32> {
    if upper.meta.deletion_timestamp().is_some() {
        return None;
    }
    deletion_cost_to_write(
        upper.annotation(DELETION_COST_ANNOTATION),
        upper.annotation(DELETION_COST_MARK),
        priority,
    )
}

/// Writes deletion cost `cost` on the upper pod `stored`, marked as virtual-node's, only
/// while the pod of that name is `stored` (by UID).
async fn write_deletion_cost(stored: &StoredPod, cost: i32, ctx: &Context) -> Result<(), Error> {
    let key = stored.meta.key();
    let api: Api<Pod> = Api::namespaced(ctx.upper.clone(), &stored.meta.namespace);
    let cost = cost.to_string();
    let patch = serde_json::json!({"metadata": {
        "uid": stored.meta.uid(),
        "annotations": { DELETION_COST_ANNOTATION: cost, DELETION_COST_MARK: cost },
    }});
    match api
        .patch(
            stored.meta.name(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => {
            debug!(object = %key, kind = "Pod", cluster = "upper", cost, "wrote the pod deletion cost");
            Ok(())
        }
        Err(e) if is_replaced(&e) => Ok(()),
        Err(e) => Err(api_error(
            Side::Upper,
            "writing the deletion cost of",
            "Pod",
            &key,
        )(e)),
    }
}

/// Holds back the lower copy of `upper` while its node `node` is cordoned: said in an
/// Event on the pod (it stays Pending; an uncordon wakes it).
async fn hold_while_cordoned(upper: &Pod, ctx: &Context, key: &str, node: &str) {
    info!(object = %key, kind = "Pod", cluster = "upper", %node, "node cordoned: not creating the lower pod");
    let note = format!(
        "virtual node {node} is cordoned (spec.unschedulable): the pod is not created in the \
         lower cluster until the node is uncordoned"
    );
    ctx.warn_on(upper, NODE_CORDONED, note).await;
}

/// Reconciles one upper pod; a failure is reported (Event, metric) and retried with backoff.
/// A pod last found in step with its lower copy, neither changed since, is passed over.
/// One pod's reconcile; `Ok(Some(wait))`: look at it again after `wait` (a deferred
/// resize).
async fn reconcile(stored: &StoredPod, pc: &PodContext) -> Result<Option<Duration>, Error> {
    let key = stored.meta.key();
    let span = info_span!("pod", pod = %key);
    async {
        pc.synced.wait().await?;
        let ctx = &pc.ctx;
        ctx.metrics.reconciles.inc();
        let lower = pc
            .lower_pods
            .get(&stored.meta.namespace, stored.meta.name());
        let result = if lower
            .as_deref()
            .is_some_and(|lower| stored.in_step_with(lower))
        {
            Ok(None)
        } else {
            let upper = stored.to_pod();
            let started = Instant::now();
            let result = reconcile_pod(&upper, lower.as_deref(), pc, &key).await;
            ctx.metrics.reconciled("pod", started.elapsed());
            match &result {
                Ok(outcome) => {
                    if let Some(lower) = lower.as_deref().filter(|_| outcome.in_step) {
                        stored.mark_in_step_with(lower);
                    }
                    ctx.succeeded(&key);
                }
                Err(error) => {
                    ctx.metrics.reconcile_failed(error.metric_label());
                    explain_failure(ctx, &upper, error).await;
                }
            }
            result.map(|outcome| outcome.again)
        };
        // The scale-in order upstairs, after the pod's own step (its lower copy is never
        // made later for it), and never holding it back: a pod that cannot take the
        // annotation (its annotations at the API server's limit), or a refused write, is
        // left without it until its next event. Until the pod shows it ran below, the
        // status reflector's first write carries it (no write of its own); this write is
        // for the pods that ran before, and for a new burst priority.
        let priority = ctx.bursting.borrow().priority;
        if let Some(cost) = deletion_cost_due(stored, priority)
            && was_mirrored(&stored.to_pod())
            && let Err(error) = write_deletion_cost(stored, cost, ctx).await
        {
            warn!(
                object = %key, kind = "Pod", cluster = "upper", %error,
                "could not write the pod deletion cost; going on without it"
            );
        }
        result
    }
    .instrument(span)
    .await
}

/// What a reconcile of a pod found.
#[derive(Clone, Copy, Debug, Default)]
struct Outcome {
    /// The pod and its copy were in step (a copy to sync, and nothing to write).
    in_step: bool,
    /// Look at the pod again after this long.
    again: Option<Duration>,
}

/// Takes the step [`decide`] names for `upper` and its lower copy as stored.
async fn reconcile_pod(
    upper: &Pod,
    stored_lower: Option<&StoredPod>,
    pc: &PodContext,
    key: &str,
) -> Result<Outcome, Error> {
    let ctx = &pc.ctx;
    let name = upper.name_any();
    let namespace = upper.namespace().unwrap_or_default();
    let lower = stored_lower.map(StoredPod::to_pod);
    let lower_api: Api<Pod> = Api::namespaced(ctx.lower.clone(), &namespace);
    let upper_api: Api<Pod> = Api::namespaced(ctx.upper.clone(), &namespace);
    let planned = decide(upper, lower.as_ref(), &ctx.owner);
    debug!(object = %key, kind = "Pod", cluster = "upper", step = ?planned, "reconcile");
    let step = confirmed(
        &planned,
        upper,
        lower.as_ref(),
        &upper_api,
        &lower_api,
        ctx,
        key,
    )
    .await?;
    match step {
        Step::Nothing | Step::WaitForLower => {}
        Step::FinishDeletion => {
            write_final_status(upper, pc, &upper_api, key).await?;
            let deleted = delete_exact(&upper_api, &name, upper.metadata.uid.clone(), Some(0))
                .await
                .map_err(api_error(Side::Upper, "deleting", "Pod", key))?;
            if deleted == Deleted::Now {
                info!(object = %key, kind = "Pod", cluster = "upper", "lower pod gone; finished the deletion");
            }
        }
        Step::DeleteLower { grace } => {
            delete_lower(&lower_api, lower.as_ref(), grace, key).await?;
            info!(object = %key, kind = "Pod", cluster = "lower", ?grace, "deleting the lower pod");
        }
        Step::DeleteStale => {
            delete_lower(&lower_api, lower.as_ref(), None, key).await?;
            info!(
                object = %key, kind = "Pod", cluster = "lower",
                "deleting a lower pod left by an earlier pod of this name"
            );
        }
        Step::Create if ctx.node_cordoned(pod_node(upper)) => {
            let node = pod_node(upper).unwrap_or(&ctx.owner.node);
            hold_while_cordoned(upper, ctx, key, node).await;
        }
        Step::Create => create(upper, pc, &lower_api, key).await?,
        Step::MarkFailed => match reclaim(upper, pc, &lower_api, key).await? {
            Found::Copy | Found::OursInTransit => {}
            Found::Nothing | Found::Foreign => mark_failed(upper, ctx, &upper_api, key).await?,
        },
        Step::Sync => {
            if let Some(tokens) = &ctx.tokens {
                tokens.wake(ObjectRef::new(&name).within(&namespace));
            }
            if let Some(lower) = lower.as_ref() {
                // The resize and the ephemeral containers (each a subresource, each
                // bumping the lower generation) before the update that records the upper
                // generation: a lower status observing that generation observed them.
                let stores = Stores {
                    upper: &pc.upper_pods,
                    lower: &pc.lower_pods,
                };
                let resized = carry_resize(upper, lower, ctx, stores, &lower_api, key).await?;
                let added = add_ephemeral_containers(upper, lower, ctx, &lower_api, key).await?;
                let updated = propagate_update(upper, lower, pc, &lower_api, key).await?;
                return Ok(Outcome {
                    in_step: !updated && !added && resized == Resized::Nothing,
                    again: matches!(resized, Resized::Pending { retry: true })
                        .then_some(DEFERRED_RETRY),
                });
            }
        }
    }
    Ok(Outcome::default())
}

/// `planned` if the pods as the API servers have them now call for it too (read as
/// [`live_reads`] says, judged by [`confirm`]); [`Step::Nothing`] while a store lags.
async fn confirmed(
    planned: &Step,
    upper: &Pod,
    lower: Option<&Pod>,
    upper_api: &Api<Pod>,
    lower_api: &Api<Pod>,
    ctx: &Context,
    key: &str,
) -> Result<Step, Error> {
    let reads = live_reads(planned, upper, lower);
    if reads == LiveReads::default() {
        return Ok(planned.clone());
    }
    let name = upper.name_any();
    let live_upper = if reads.upper {
        read_upper_pod(upper_api, &name, key).await?
    } else {
        Some(upper.clone())
    };
    let live_lower = if reads.lower {
        lower_api
            .get_opt(&name)
            .await
            .map_err(api_error(Side::Lower, "reading", "Pod", key))?
    } else {
        lower.cloned()
    };
    let step = confirm(
        planned,
        upper,
        live_upper.as_ref(),
        live_lower.as_ref(),
        &ctx.owner,
    );
    if step == Step::Nothing {
        let cluster = if reads.upper { "upper" } else { "lower" };
        info!(
            object = %key, kind = "Pod", cluster, step = ?planned,
            "the pod store lags the API server; not taking the step until its watch catches up"
        );
    }
    Ok(step)
}

/// Writes on the deleted upper pod the last status of its lower copy, gone now, with every
/// container terminated ([`terminated_status`]), as a kubelet does before it finishes a
/// deletion: a pod held by a finalizer shows how its containers ended. Unless the status
/// reflector showed it already, or the lower pod's last version was not seen (a restart).
async fn write_final_status(
    upper: &Pod,
    pc: &PodContext,
    upper_api: &Api<Pod>,
    key: &str,
) -> Result<(), Error> {
    let ctx = &pc.ctx;
    let (namespace, name) = (upper.namespace().unwrap_or_default(), upper.name_any());
    let Some(last) = ctx.departed.take(&namespace, &name) else {
        return Ok(());
    };
    if last.upper_uid().as_deref() != upper.metadata.uid.as_deref() {
        return Ok(());
    }
    let status = terminated_status(upper_status(&last.to_pod(), upper));
    let shown = pc
        .upper_pods
        .get(&namespace, &name)
        .is_some_and(|stored| stored.status_in_sync(&status));
    if shown {
        return Ok(());
    }
    match write_upper_status(upper_api, upper, &status, key).await {
        Ok(_) => {
            ctx.metrics.status_writes.inc();
            debug!(object = %key, kind = "Pod", cluster = "upper", phase = ?status.phase, "wrote the final status");
            Ok(())
        }
        Err(error) => {
            // Tried again with the step.
            ctx.departed.keep(last);
            Err(error)
        }
    }
}

/// Ends the upper pod whose lower pod is gone, so that its controller replaces it.
async fn mark_failed(
    upper: &Pod,
    ctx: &Context,
    upper_api: &Api<Pod>,
    key: &str,
) -> Result<(), Error> {
    // The store keeps a summary of an upper pod's status; the Failed status keeps what
    // the whole one knew of each container.
    let Some(upper) = upper_pod_now(upper_api, upper, key).await? else {
        // Gone or replaced meanwhile: its own watch event brings the next step.
        return Ok(());
    };
    let upper = &upper;
    let status = lower_gone_status(
        upper,
        LOWER_POD_GONE,
        "the pod was deleted or evicted in the lower cluster",
    );
    if write_upper_status(upper_api, upper, &status, key).await? == StatusWrite::PodReplaced {
        debug!(
            object = %key, kind = "Pod", cluster = "upper",
            "the pod was replaced meanwhile; nothing to fail"
        );
        return Ok(());
    }
    ctx.warn_on(
        upper,
        LOWER_POD_GONE,
        format!("lower pod {key} disappeared; the pod has failed so its controller can replace it"),
    )
    .await;
    info!(object = %key, kind = "Pod", cluster = "upper", "lower pod gone; marked the pod Failed");
    Ok(())
}

/// What the lower cluster holds under an upper pod's name, read from the API: the store
/// holds only the pods that carry this node's owner label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Found {
    /// No pod of that name.
    Nothing,
    /// The upper pod's copy (by its upper-UID mark); any of tensile's marks an edit below
    /// took off have been put back.
    Copy,
    /// Another pod with this node's owner label: the store has yet to see it, and its
    /// watch event brings the next step.
    OursInTransit,
    /// Someone else's pod.
    Foreign,
}

/// Reads the lower pod of `upper`'s name and, if it is `upper`'s copy that lost a mark
/// below (an owner label edited away hides it from the store, and from the orphan
/// collection), puts the marks back with the lower pod's UID as a precondition.
async fn reclaim(
    upper: &Pod,
    pc: &PodContext,
    lower_api: &Api<Pod>,
    key: &str,
) -> Result<Found, Error> {
    let Some(lower) = lower_api
        .get_opt(&upper.name_any())
        .await
        .map_err(api_error(Side::Lower, "reading", "Pod", key))?
    else {
        return Ok(Found::Nothing);
    };
    let owner = &pc.ctx.owner;
    if is_copy_of(&lower.metadata, &upper.metadata) {
        if !is_owned_by(&lower.metadata, owner) {
            propagate_update(upper, &lower, pc, lower_api, key).await?;
            info!(
                object = %key, kind = "Pod", cluster = "lower",
                "the lower pod had lost this node's owner label below; put it back"
            );
        }
        return Ok(Found::Copy);
    }
    if is_owned_by(&lower.metadata, owner) {
        return Ok(Found::OursInTransit);
    }
    Ok(Found::Foreign)
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
    let (namespace, name) = (stored.namespace().unwrap_or_default(), stored.name_any());
    let upper_api: Api<Pod> = Api::namespaced(ctx.upper.clone(), &namespace);
    // The store holds a pruned pod; the lower pod is made from the whole one, as its watch
    // delivered it (kept until the copy is made), else as the API server has it.
    let whole = pc
        .whole
        .get(&namespace, &name, stored.metadata.uid.as_deref());
    let upper = match whole {
        Some(upper) => upper,
        None => match upper_pod_now(&upper_api, stored, key).await? {
            Some(upper) => upper,
            // Gone or replaced meanwhile: its own watch event brings the next step.
            None => return Ok(()),
        },
    };
    let upper = &upper;
    if host_ports_taken_here(upper, ctx, key).await? {
        return reject(
            upper,
            NODE_PORTS_REASON,
            NODE_PORTS_MESSAGE,
            ctx,
            &upper_api,
            key,
        )
        .await;
    }
    dependencies::ensure_for_pod(ctx, upper, key).await?;
    // Node granularity: the copy stays within the lower nodes of the pod's virtual node.
    let confinement = ctx.confinement(upper.spec.as_ref().and_then(|s| s.node_name.as_deref()));
    let translation = PodTranslation {
        owner: &ctx.owner,
        ignore_labels: &ctx.ignore_labels,
        upper_identity: ctx.tokens.as_ref().map(|t| &t.identity.api),
        confinement: confinement.as_ref(),
    };
    let pod = lower_pod(upper, &translation)?;
    match lower_api.create(&PostParams::default(), &pod).await {
        Ok(_) => {
            pc.whole.forget(&namespace, &name);
            ctx.metrics.lower_creates.inc();
            info!(object = %key, kind = "Pod", cluster = "lower", "created the lower pod");
            Ok(())
        }
        // Our store may lag our own create, or an edit below took our owner label off our
        // copy; anything else of this name is not ours.
        Err(e) if is_status(&e, 409) => match reclaim(stored, pc, lower_api, key).await? {
            Found::Nothing | Found::Copy | Found::OursInTransit => Ok(()),
            Found::Foreign => Err(Error::Conflict {
                key: key.to_owned(),
                node: ctx.owner.node.clone(),
            }),
        },
        Err(e) => Err(api_error(Side::Lower, "creating", "Pod", key)(e)),
    }
}

/// Whether a host port `upper` asks for is held by a pod admitted to this node before it
/// (read live, and only for a pod that asks for host ports): a kubelet rejects such a pod.
async fn host_ports_taken_here(upper: &Pod, ctx: &Context, key: &str) -> Result<bool, Error> {
    if !asks_for_host_ports(upper) {
        return Ok(false);
    }
    let all: Api<Pod> = Api::all(ctx.upper.clone());
    let node = upper
        .spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .unwrap_or(&ctx.owner.node);
    let params = ListParams::default().fields(&format!("spec.nodeName={node}"));
    let on_node = all
        .list(&params)
        .await
        .map_err(api_error(
            Side::Upper,
            "listing the pods on the node of",
            "Pod",
            key,
        ))?
        .items;
    Ok(host_ports_taken(
        upper,
        on_node
            .iter()
            .filter(|other| admitted_before(other, upper, was_mirrored(other))),
    ))
}

/// Rejects `upper` as a kubelet rejects a pod at admission: Failed with `reason`, and an
/// Event; nothing is made below, and its controller makes another pod.
async fn reject(
    upper: &Pod,
    reason: &str,
    message: &str,
    ctx: &Context,
    upper_api: &Api<Pod>,
    key: &str,
) -> Result<(), Error> {
    let status = rejected_status(upper, reason, message);
    if write_upper_status(upper_api, upper, &status, key).await? == StatusWrite::PodReplaced {
        return Ok(());
    }
    ctx.warn_on(upper, reason, message.to_owned()).await;
    info!(object = %key, kind = "Pod", cluster = "upper", reason, "rejected the pod, as a kubelet would");
    Ok(())
}

/// Carries an upper pod's changed labels, annotations, images, tolerations or deadline
/// down to its lower pod (and tensile's marks, should an edit below have removed them),
/// only while the lower pod of that name is still `lower` (by UID). Whether there was
/// anything to carry.
async fn propagate_update(
    upper: &Pod,
    lower: &Pod,
    pc: &PodContext,
    lower_api: &Api<Pod>,
    key: &str,
) -> Result<bool, Error> {
    let ctx = &pc.ctx;
    let translation = PodTranslation {
        owner: &ctx.owner,
        ignore_labels: &ctx.ignore_labels,
        upper_identity: ctx.tokens.as_ref().map(|t| &t.identity.api),
        confinement: None,
    };
    let Some(patch) = lower_pod_update(upper, lower, &translation)? else {
        return Ok(false);
    };
    let uid = lower.metadata.uid.as_deref().unwrap_or_default();
    let patch = with_uid_precondition(patch, uid);
    match lower_api
        .patch(
            &lower.name_any(),
            &PatchParams::default(),
            &Patch::Strategic(&patch),
        )
        .await
    {
        Ok(_) => {
            ctx.metrics.lower_updates.inc();
            info!(object = %key, kind = "Pod", cluster = "lower", "propagated an update");
            Ok(true)
        }
        Err(e) if is_replaced(&e) => {
            debug!(object = %key, kind = "Pod", cluster = "lower", "the lower pod was replaced meanwhile");
            Ok(true)
        }
        Err(e) => Err(api_error(Side::Lower, "updating", "Pod", key)(e)),
    }
}

/// Adds to the lower pod the ephemeral containers added to the upper pod (`kubectl debug`
/// on the virtual node), through the lower pod's ephemeralcontainers subresource, only
/// while the lower pod of that name is still `lower` (by UID). Which ones it lacks is
/// known from the stores (by name); the containers themselves are read from the upper pod.
/// Whether any were missing.
async fn add_ephemeral_containers(
    stored_upper: &Pod,
    lower: &Pod,
    ctx: &Context,
    lower_api: &Api<Pod>,
    key: &str,
) -> Result<bool, Error> {
    if missing_ephemeral_containers(stored_upper, lower).is_empty() {
        return Ok(false);
    }
    let name = stored_upper.name_any();
    let upper_api: Api<Pod> = Api::namespaced(
        ctx.upper.clone(),
        &stored_upper.namespace().unwrap_or_default(),
    );
    let Some(upper) = upper_pod_now(&upper_api, stored_upper, key).await? else {
        // Gone or replaced meanwhile: its own watch event brings the next step.
        return Ok(true);
    };
    let added = missing_ephemeral_containers(&upper, lower);
    let names: Vec<&str> = added.iter().map(|c| c.name.as_str()).collect();
    let uid = lower.metadata.uid.as_deref().unwrap_or_default();
    let patch = ephemeral_containers_patch(uid, &added, &format!("Pod {key}"))?;
    match lower_api
        .patch_ephemeral_containers(&name, &PatchParams::default(), &Patch::Strategic(&patch))
        .await
    {
        Ok(_) => {
            ctx.metrics.lower_updates.inc();
            info!(object = %key, kind = "Pod", cluster = "lower", containers = ?names, "added ephemeral containers");
            Ok(true)
        }
        Err(e) if is_replaced(&e) => {
            debug!(object = %key, kind = "Pod", cluster = "lower", "the lower pod was replaced meanwhile");
            Ok(true)
        }
        Err(e) => Err(api_error(
            Side::Lower,
            "adding ephemeral containers to",
            "Pod",
            key,
        )(e)),
    }
}

/// Tells the user why a pod is not running below: a Warning event (deduplicated into a
/// series) and, while nothing runs below, the reason on the pending upper pod.
async fn explain_failure(ctx: &Context, upper: &Pod, error: &Error) {
    let Some(reason) = error.event_reason() else {
        warn!(object = %object_ref(&upper.metadata), kind = "Pod", cluster = "upper", %error, "reconcile failed");
        return;
    };
    warn!(object = %object_ref(&upper.metadata), kind = "Pod", cluster = "upper", %error, reason, "reconcile failed");
    let mut note = error.to_string();
    note.truncate(1000);
    ctx.warn_on(upper, reason, note.clone()).await;
    let status = upper.status.clone().unwrap_or_default();
    let pending = status.phase.as_deref().is_none_or(|p| p == "Pending") && !was_mirrored(upper);
    let Some(uid) = upper.metadata.uid.as_deref() else {
        return;
    };
    if pending
        && (status.reason.as_deref() != Some(reason) || status.message.as_deref() != Some(&note))
    {
        let api: Api<Pod> =
            Api::namespaced(ctx.upper.clone(), &upper.namespace().unwrap_or_default());
        let patch = pending_reason_patch(uid, reason, &note);
        match api
            .patch_status(
                &upper.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => {}
            Err(e) if is_replaced(&e) => {}
            Err(error) => {
                debug!(object = %object_ref(&upper.metadata), kind = "Pod", cluster = "upper", %error, "recording the pending reason")
            }
        }
    }
}

/// The node `pod` is bound to.
fn pod_node(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::translate::meta::{OWNER_NODE_LABEL, UPPER_CLUSTER_LABEL, UPPER_UID_ANNOTATION};
    use crate::translate::pod::MIRRORED_CONDITION;
    use serde_json::{Value, json};

    const NODE: &str = "vk";
    const CLUSTER: &str = "c1";

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
            "labels": {OWNER_NODE_LABEL: owner, UPPER_CLUSTER_LABEL: CLUSTER},
            "annotations": {UPPER_UID_ANNOTATION: uid},
        });
        if deleting {
            meta["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        }
        serde_json::from_value(json!({"metadata": meta, "spec": {"containers": []}})).unwrap()
    }

    #[test]
    fn what_means_the_pod_was_replaced() {
        let api_error = |code: u16, cause_field: Option<&str>| {
            let mut status =
                json!({"status": "Failure", "code": code, "message": "m", "reason": "r"});
            if let Some(field) = cause_field {
                status["details"] = json!({"causes": [{"reason": "FieldValueInvalid", "field": field, "message": "field is immutable"}]});
            }
            kube::Error::Api(Box::new(serde_json::from_value(status).unwrap()))
        };
        let cases = [
            (
                "uid precondition refused",
                api_error(422, Some("metadata.uid")),
                true,
            ),
            ("gone", api_error(404, None), true),
            ("conflict", api_error(409, None), true),
            (
                "another invalid field",
                api_error(422, Some("status.phase")),
                false,
            ),
            ("server error", api_error(500, None), false),
        ];
        for (name, error, want) in cases {
            assert_eq!(is_replaced(&error), want, "{name}");
        }
    }

    /// A destructive step decided over the stores is taken only when the pods as read live
    /// call for it too, and reads only what it needs.
    #[test]
    fn destructive_steps_are_confirmed_live() {
        let deleting =
            json!({"deletionTimestamp": "2026-01-01T00:00:00Z", "deletionGracePeriodSeconds": 30});
        let running =
            json!({"phase": "Running", "hostIP": "10.0.0.1", "startTime": "2026-01-01T00:00:00Z"});
        let scheduled =
            json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]});
        let owner = Owner::new(NODE, CLUSTER);
        let u1 = upper(json!({}), running.clone());
        let u1_deleting = upper(deleting.clone(), running.clone());
        let u1_deleting_now = upper(
            json!({"deletionTimestamp": "2026-01-01T00:00:00Z", "deletionGracePeriodSeconds": 0}),
            running.clone(),
        );
        let u2 = upper(json!({"uid": "u2"}), scheduled);
        let copy_of = |uid: &str| lower(NODE, uid, false);
        let going = lower(NODE, "u1", true);
        let foreign = lower("vk-other", "u1", false);
        // (name, stored upper, stored lower, planned, reads, live upper, live lower, step taken)
        type Case<'a> = (
            &'a str,
            &'a Pod,
            Option<Pod>,
            Step,
            LiveReads,
            Option<&'a Pod>,
            Option<Pod>,
            Step,
        );
        let upper_read = LiveReads {
            upper: true,
            lower: false,
        };
        let lower_read = LiveReads {
            upper: false,
            lower: true,
        };
        let cases: Vec<Case> = vec![
            (
                "store U1, lower marked U2, API U2 (a takeover): no lower DELETE",
                &u1,
                Some(copy_of("u2")),
                Step::DeleteStale,
                upper_read,
                Some(&u2),
                Some(copy_of("u2")),
                Step::Nothing,
            ),
            (
                "store U1, lower marked U2, API U1: the lower pod is stale, delete it",
                &u1,
                Some(copy_of("u2")),
                Step::DeleteStale,
                upper_read,
                Some(&u1),
                Some(copy_of("u2")),
                Step::DeleteStale,
            ),
            (
                "store U1, lower marked U2, no upper pod in the API: nothing (its deletion event comes)",
                &u1,
                Some(copy_of("u2")),
                Step::DeleteStale,
                upper_read,
                None,
                Some(copy_of("u2")),
                Step::Nothing,
            ),
            (
                "store U1 deleting, lower marked U2, API U2: the new pod's copy is not deleted",
                &u1_deleting,
                Some(copy_of("u2")),
                Step::DeleteLower { grace: Some(30) },
                upper_read,
                Some(&u2),
                Some(copy_of("u2")),
                Step::Nothing,
            ),
            (
                "store U1 deleting, lower marked U2, API U1 deleting: delete the stale copy",
                &u1_deleting,
                Some(copy_of("u2")),
                Step::DeleteLower { grace: Some(30) },
                upper_read,
                Some(&u1_deleting),
                Some(copy_of("u2")),
                Step::DeleteLower { grace: Some(30) },
            ),
            (
                "store U1 deleting, lower marked U1: its own copy goes, nothing read",
                &u1_deleting,
                Some(copy_of("u1")),
                Step::DeleteLower { grace: Some(30) },
                LiveReads::default(),
                Some(&u1_deleting),
                Some(copy_of("u1")),
                Step::DeleteLower { grace: Some(30) },
            ),
            (
                "deleting, lower without a mark: read the upper pod, the live grace period wins",
                &u1_deleting,
                Some({
                    let mut pod = copy_of("");
                    pod.metadata.annotations = None;
                    pod
                }),
                Step::DeleteLower { grace: Some(30) },
                upper_read,
                Some(&u1_deleting_now),
                Some({
                    let mut pod = copy_of("");
                    pod.metadata.annotations = None;
                    pod
                }),
                Step::DeleteLower { grace: Some(0) },
            ),
            (
                "lower store lags: the copy still runs below, the upper pod is not force-deleted",
                &u1_deleting,
                None,
                Step::FinishDeletion,
                lower_read,
                Some(&u1_deleting),
                Some(copy_of("u1")),
                Step::Nothing,
            ),
            (
                "lower store lags: the copy is going below, still not finished",
                &u1_deleting,
                None,
                Step::FinishDeletion,
                lower_read,
                Some(&u1_deleting),
                Some(going),
                Step::Nothing,
            ),
            (
                "no pod below: finish the deletion",
                &u1_deleting,
                None,
                Step::FinishDeletion,
                lower_read,
                Some(&u1_deleting),
                None,
                Step::FinishDeletion,
            ),
            (
                "only another node's pod below: finish the deletion",
                &u1_deleting,
                None,
                Step::FinishDeletion,
                lower_read,
                Some(&u1_deleting),
                Some(foreign),
                Step::FinishDeletion,
            ),
            (
                "a step that destroys nothing reads nothing",
                &u1,
                Some(copy_of("u1")),
                Step::Sync,
                LiveReads::default(),
                Some(&u1),
                Some(copy_of("u1")),
                Step::Sync,
            ),
        ];
        for (name, stored, stored_lower, planned, reads, live_upper, live_lower, want) in cases {
            assert_eq!(
                decide(stored, stored_lower.as_ref(), &owner),
                planned,
                "{name}: planned"
            );
            assert_eq!(
                live_reads(&planned, stored, stored_lower.as_ref()),
                reads,
                "{name}: reads"
            );
            assert_eq!(
                confirm(&planned, stored, live_upper, live_lower.as_ref(), &owner),
                want,
                "{name}"
            );
        }
    }

    #[test]
    fn status_is_reflected_from_the_pods_own_copy_while_it_terminates() {
        let deleting =
            json!({"deletionTimestamp": "2026-01-01T00:00:00Z", "deletionGracePeriodSeconds": 30});
        let running =
            json!({"phase": "Running", "hostIP": "10.0.0.1", "startTime": "2026-01-01T00:00:00Z"});
        // (case, upper, lower, reflected)
        let cases = [
            (
                "a pair in step",
                upper(json!({}), running.clone()),
                lower(NODE, "u1", false),
                true,
            ),
            (
                "upper deleting, its copy not yet",
                upper(deleting.clone(), running.clone()),
                lower(NODE, "u1", false),
                true,
            ),
            (
                "upper deleting, its copy terminating",
                upper(deleting.clone(), running.clone()),
                lower(NODE, "u1", true),
                true,
            ),
            (
                "upper deleting, a copy of an older pod of the name",
                upper(deleting.clone(), running.clone()),
                lower(NODE, "u0", true),
                false,
            ),
            (
                "upper deleting, another node's pod",
                upper(deleting, running.clone()),
                lower("vk-other", "u1", true),
                false,
            ),
            (
                "a stale copy",
                upper(json!({"uid": "u2"}), running),
                lower(NODE, "u1", false),
                false,
            ),
        ];
        for (name, upper, lower, want) in cases {
            assert_eq!(
                reflects_status(&upper, &lower, &Owner::new(NODE, CLUSTER)),
                want,
                "{name}"
            );
        }
    }

    #[test]
    fn decide_table() {
        let deleting =
            json!({"deletionTimestamp": "2026-01-01T00:00:00Z", "deletionGracePeriodSeconds": 30});
        let scheduled =
            json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]});
        let running =
            json!({"phase": "Running", "hostIP": "10.0.0.1", "startTime": "2026-01-01T00:00:00Z"});
        let unschedulable_below = json!({"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False"},
            {"type": MIRRORED_CONDITION, "status": "True"},
        ]});
        let unschedulable_unrecorded = json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False"}]});
        let gated = json!({"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "example.com/load-balancer-ready", "status": "True"},
        ]});
        let without_uid_mark = || {
            let mut pod = lower(NODE, "", false);
            pod.metadata.annotations = None;
            pod
        };
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
                upper(json!({}), unschedulable_below.clone()),
                None,
                Step::MarkFailed,
            ),
            (
                "unschedulable below per a status written without the record: nothing ran, re-create",
                upper(json!({}), unschedulable_unrecorded),
                None,
                Step::Create,
            ),
            (
                "only another actor's readiness-gate condition: never ran, create",
                upper(json!({}), gated.clone()),
                None,
                Step::Create,
            ),
            (
                "our upper-UID mark edited away under a pod that ran: keep it (sync puts it back)",
                upper(json!({}), unschedulable_below),
                Some(without_uid_mark()),
                Step::Sync,
            ),
            (
                "our upper-UID mark edited away under a pod that ran (no record, older status): keep it",
                upper(json!({}), running.clone()),
                Some(without_uid_mark()),
                Step::Sync,
            ),
            (
                "no upper-UID mark and nothing ran: may be an older pod's, replace it",
                upper(json!({}), gated),
                Some(without_uid_mark()),
                Step::DeleteStale,
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
            assert_eq!(
                decide(&upper, lower.as_ref(), &Owner::new(NODE, CLUSTER)),
                want,
                "{name}"
            );
        }
    }
}
