//! The pod controller's resize step: an upper pod's new resources (an in-place resize
//! through its `resize` subresource) carried to its lower copy's `resize` subresource, once
//! the virtual node admits them as a kubelet admits a resize against its own allocatable
//! (its `status.allocatable`, which `--share` already bounds, and the other pods bound to
//! it), in a kubelet's order among the node's deferred resizes. What the virtual node does
//! not carry is recorded on the lower copy ([`RESIZE_PENDING_ANNOTATION`]) and shown
//! upstairs as `PodResizePending` by the status
//! reflector; the lower kubelet's own resize conditions and the resources it reports follow
//! with the lower status.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use tracing::{debug, info, warn};

use super::pod_store::PodStore;
use super::{Context, Error, api_error};
use crate::api::is_replaced;
use crate::node::resources::{Resources, add, phase_is_terminal, pod_requests, to_resources};
use crate::side::Side;
use crate::translate::resize::{
    DEFERRED, Deferral, INFEASIBLE, PendingResize, RESIZE_PENDING_ANNOTATION, deferral, deferred,
    deferred_in_turn, pending_resize, pending_resize_patch, resize_patch,
};

/// How soon a deferred resize is tried again: a kubelet retries when room may have freed
/// (a pod gone, another resized down); here the pod's next reconcile comes this soon.
pub const DEFERRED_RETRY: Duration = Duration::from_secs(5);

/// What the resize step did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resized {
    /// The upper and lower resources agree.
    Nothing,
    /// The resize went down (or the lower pod was replaced meanwhile).
    Carried,
    /// Not carried: recorded as pending (deferred: tried again after [`DEFERRED_RETRY`]).
    Pending {
        /// Whether it is tried again.
        retry: bool,
    },
}

/// The upper and lower pod stores, for the other pods' requests on the node.
pub struct Stores<'a> {
    /// Upper pods.
    pub upper: &'a PodStore,
    /// Lower pods.
    pub lower: &'a PodStore,
}

/// Carries `upper`'s resources to `lower` (its copy) if they differ, as admitted.
pub async fn carry_resize(
    upper: &Pod,
    lower: &Pod,
    ctx: &Context,
    stores: Stores<'_>,
    lower_api: &Api<Pod>,
    key: &str,
) -> Result<Resized, Error> {
    let Some(patch) = resize_patch(upper, lower) else {
        return Ok(Resized::Nothing);
    };
    if let Some(message) = misfit(upper, lower, ctx, &stores, key).await? {
        record_pending(upper, lower, ctx, lower_api, key, DEFERRED, message).await?;
        return Ok(Resized::Pending { retry: true });
    }
    let name = lower.name_any();
    match lower_api
        .patch_subresource(
            "resize",
            &name,
            &PatchParams::default(),
            &Patch::Strategic(&patch),
        )
        .await
    {
        Ok(_) => {
            ctx.metrics.lower_updates.inc();
            info!(object = %key, kind = "Pod", cluster = "lower", resources = %patch["spec"], "carried a resize");
            Ok(Resized::Carried)
        }
        Err(kube::Error::Api(status)) if status.code == 404 && !names_the_pod(&status, &name) => {
            // No such subresource: the lower API server predates in-place resize.
            let version = match ctx.lower.apiserver_version().await {
                Ok(info) => info.git_version,
                Err(_) => "unknown".to_owned(),
            };
            let message = format!(
                "the lower cluster's API server ({version}) has no pods/resize subresource: \
                 in-place resize needs Kubernetes 1.33 or later below"
            );
            record_pending(upper, lower, ctx, lower_api, key, INFEASIBLE, message).await?;
            Ok(Resized::Pending { retry: false })
        }
        Err(e) if is_replaced(&e) => {
            debug!(object = %key, kind = "Pod", cluster = "lower", "the lower pod was replaced meanwhile");
            Ok(Resized::Carried)
        }
        Err(kube::Error::Api(status)) if matches!(status.code, 400 | 403 | 422) => {
            // The lower cluster's own admission (a quota, a LimitRange, a policy) said no:
            // it will say no again until something changes there.
            let message = format!("the lower cluster refused the resize: {}", status.message);
            record_pending(upper, lower, ctx, lower_api, key, INFEASIBLE, message).await?;
            Ok(Resized::Pending { retry: false })
        }
        Err(e) => Err(api_error(Side::Lower, "resizing", "Pod", key)(e)),
    }
}

/// Whether a 404's status names the pod `name` (the pod is gone) rather than nothing (the
/// path is unknown).
fn names_the_pod(status: &kube::core::Status, name: &str) -> bool {
    status
        .details
        .as_ref()
        .is_some_and(|d| !d.name.is_empty() && d.name == name)
}

/// Why the virtual node cannot take `upper` at its new requests now, as a kubelet words a
/// deferred resize; `None` when it can, or when its node is not known (the lower kubelet
/// decides then). Decided as a kubelet's retry pass decides it ([`deferred_in_turn`]):
/// the resizes left deferred on the node that rank before it go first.
async fn misfit(
    upper: &Pod,
    lower: &Pod,
    ctx: &Context,
    stores: &Stores<'_>,
    key: &str,
) -> Result<Option<String>, Error> {
    let Some(node) = upper.spec.as_ref().and_then(|s| s.node_name.as_deref()) else {
        return Ok(None);
    };
    let nodes: Api<Node> = Api::all(ctx.upper.clone());
    let Some(node_object) =
        nodes
            .get_opt(node)
            .await
            .map_err(api_error(Side::Upper, "reading", "Node", node))?
    else {
        return Ok(None);
    };
    let Some(allocatable) = node_object.status.and_then(|s| s.allocatable) else {
        return Ok(None);
    };
    let others = others_on(node, upper, stores);
    let mut used = Resources::new();
    for (other, below) in &others {
        let runs = below.as_ref().unwrap_or(other);
        if let Some(spec) = runs.spec.as_ref() {
            add(&mut used, &pod_requests(spec));
        }
    }
    let pending: Vec<Deferral> = others
        .iter()
        .filter_map(|(other, below)| deferred(other, below.as_ref()?))
        .collect();
    let message = deferred_in_turn(
        &to_resources(&allocatable),
        &used,
        &pending,
        &deferral(upper, lower),
    );
    if let Some(message) = &message {
        debug!(object = %key, kind = "Pod", cluster = "upper", node, %message, pending = pending.len(), "resize deferred");
    }
    Ok(message)
}

/// The pods bound to `node` but `pod`, not finished, each with its lower copy (none for a
/// pod not copied yet). Each takes what its lower copy asks (the upper pod's requests for
/// one not copied yet): a pod's resize not carried yet takes what it had, as a kubelet
/// counts allocated resources.
fn others_on(node: &str, pod: &Pod, stores: &Stores<'_>) -> Vec<(Pod, Option<Pod>)> {
    stores
        .upper
        .state()
        .into_iter()
        .filter(|other| {
            other.meta.uid().as_deref() != pod.metadata.uid.as_deref()
                && other.node_name().as_deref() == Some(node)
        })
        .map(|other| other.to_pod())
        .filter(|other| !phase_is_terminal(other.status.as_ref().and_then(|s| s.phase.as_deref())))
        .map(|other| {
            let below = stores
                .lower
                .get(&other.namespace().unwrap_or_default(), &other.name_any())
                .map(|l| l.to_pod());
            (other, below)
        })
        .collect()
}

/// Records on `lower` a resize left pending for `reason` (unless it records the same), and
/// tells the user with an Event on the upper pod, as a kubelet does.
async fn record_pending(
    upper: &Pod,
    lower: &Pod,
    ctx: &Context,
    lower_api: &Api<Pod>,
    key: &str,
    reason: &str,
    message: String,
) -> Result<(), Error> {
    let recorded = pending_resize(lower);
    let mut pending = PendingResize {
        reason: reason.to_owned(),
        message,
        generation: upper.metadata.generation,
        since: None,
    };
    if recorded.as_ref().is_some_and(|r| r.same_decision(&pending)) {
        return Ok(());
    }
    pending.since = recorded
        .filter(|r| r.reason == pending.reason)
        .and_then(|r| r.since)
        .or_else(|| Some(k8s_openapi::jiff::Timestamp::now().to_string()));
    let uid = lower.metadata.uid.as_deref().unwrap_or_default();
    let patch = pending_resize_patch(uid, Some(&pending));
    match lower_api
        .patch(
            &lower.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => {
            ctx.metrics.lower_updates.inc();
        }
        Err(e) if is_replaced(&e) => return Ok(()),
        Err(e) => {
            return Err(api_error(
                Side::Lower,
                "recording a pending resize on",
                "Pod",
                key,
            )(e));
        }
    }
    let event = if reason == INFEASIBLE {
        "ResizeInfeasible"
    } else {
        "ResizeDeferred"
    };
    warn!(
        object = %key, kind = "Pod", cluster = "upper", reason, message = %pending.message,
        annotation = RESIZE_PENDING_ANNOTATION, "resize not carried to the lower pod"
    );
    ctx.warn_on(
        upper,
        event,
        format!("Pod resize {reason}: {}", pending.message),
    )
    .await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_404_names_the_pod_when_it_is_gone_and_nothing_when_the_path_is_unknown() {
        let status = |details: serde_json::Value| -> kube::core::Status {
            serde_json::from_value(serde_json::json!({
                "status": "Failure", "code": 404, "reason": "NotFound",
                "message": "m", "details": details,
            }))
            .unwrap()
        };
        // (case, details, the pod's name, names the pod)
        let cases = [
            (
                "the pod gone",
                serde_json::json!({"name": "web", "kind": "pods"}),
                true,
            ),
            (
                "another pod",
                serde_json::json!({"name": "db", "kind": "pods"}),
                false,
            ),
            (
                "an unknown subresource (an older API server)",
                serde_json::json!({}),
                false,
            ),
            ("no details at all", serde_json::Value::Null, false),
        ];
        for (case, details, want) in cases {
            assert_eq!(names_the_pod(&status(details), "web"), want, "{case}");
        }
    }
}
