//! Status reflection: the lower pod's status, as the upper pod's. A controller of its
//! own, keyed by pod and woken by changes of either copy (the same watches as the pod
//! controller, [`super::pod::watches`]), so that a lower pod turning Ready is reflected
//! at once even while the pod controller's queue holds a burst of pods being created.
//! It writes only when the lower status says something the upper one does not show, so a
//! restart writes nothing for pods already in step.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Pod, PodStatus};
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span, warn};

use super::pod::{
    PodStores, Step, Triggers, decide, drain, key_of, same_name, tokio_stream_interval,
};
use super::{Context, Error, api_error};
use crate::side::Side;
use crate::translate::pod::{status_in_sync, status_is_informative, upper_status};
use crate::translate::stored::StoredPod;

struct StatusContext {
    ctx: Arc<Context>,
    pods: PodStores,
}

/// Runs the status reflector until `shutdown`.
pub async fn run(
    ctx: Arc<Context>,
    triggers: Triggers,
    stores: PodStores,
    workers: u16,
    resync: Duration,
    shutdown: CancellationToken,
) {
    let controller = Controller::for_shared_stream(triggers.lower, stores.lower.clone())
        .with_config(ControllerConfig::default().concurrency(workers))
        .watches_shared_stream(triggers.upper, |upper: Arc<StoredPod>| same_name(&upper))
        .reconcile_all_on(tokio_stream_interval(resync))
        .graceful_shutdown_on(shutdown.cancelled_owned());
    let status_ctx = Arc::new(StatusContext { ctx, pods: stores });
    drain(
        controller.run(reconcile, error_policy, status_ctx),
        "status reconcile",
    )
    .await;
}

/// The key under which failures back off, apart from the pod controller's.
fn backoff_key(key: &str) -> String {
    format!("status:{key}")
}

async fn reconcile(lower: Arc<StoredPod>, sc: Arc<StatusContext>) -> Result<Action, Error> {
    let key = key_of(&lower.metadata);
    let span = info_span!("pod status", pod = %key);
    async {
        sc.pods.synced.wait().await?;
        let ctx = &sc.ctx;
        let Some(upper) = same_name(&lower).and_then(|r| sc.pods.upper.get(&r)) else {
            return Ok(Action::await_change());
        };
        let (upper, lower) = (upper.to_pod(), lower.to_pod());
        // Only for a pod mirrored by this node and not being deleted: the pod controller
        // owns every other step.
        if decide(&upper, Some(&lower), &ctx.node_name) != Step::Sync {
            return Ok(Action::await_change());
        }
        let desired = upper_status(&lower, &upper);
        let informative = lower.status.as_ref().is_some_and(status_is_informative);
        if !informative || status_in_sync(upper.status.as_ref(), &desired) {
            return Ok(Action::await_change());
        }
        let api: Api<Pod> =
            Api::namespaced(ctx.upper.clone(), &upper.namespace().unwrap_or_default());
        let started = Instant::now();
        let written = write_status(&api, &upper.name_any(), &desired, &key).await;
        ctx.metrics.status_write_seconds.observe(started.elapsed());
        match written {
            Ok(()) => {
                ctx.metrics.status_writes.inc();
                ctx.succeeded(&backoff_key(&key));
                debug!(cluster = "upper", phase = ?desired.phase, "reflected status");
                Ok(Action::await_change())
            }
            Err(error) => {
                ctx.metrics.reconcile_failed(error.metric_label());
                warn!(%error, "reflecting status failed; retrying with backoff");
                Err(error)
            }
        }
    }
    .instrument(span)
    .await
}

fn error_policy(lower: Arc<StoredPod>, _error: &Error, sc: Arc<StatusContext>) -> Action {
    Action::requeue(sc.ctx.backoff(&backoff_key(&key_of(&lower.metadata))))
}

/// The status fields tensile owns on an upper pod: absent in `status` means cleared.
const REFLECTED_FIELDS: &[&str] = &[
    "phase",
    "conditions",
    "containerStatuses",
    "initContainerStatuses",
    "ephemeralContainerStatuses",
    "podIP",
    "podIPs",
    "hostIP",
    "hostIPs",
    "startTime",
    "reason",
    "message",
    "nominatedNodeName",
];

/// A merge patch that sets `status` and clears the reflected fields it leaves out.
pub fn status_patch(status: &PodStatus) -> Value {
    let mut body = serde_json::to_value(status).unwrap_or_else(|_| json!({}));
    if let Some(map) = body.as_object_mut() {
        for field in REFLECTED_FIELDS {
            map.entry(*field).or_insert(Value::Null);
        }
    }
    json!({ "status": body })
}

/// Writes `status` as the upper pod's (the reflected fields only).
pub(crate) async fn write_status(
    api: &Api<Pod>,
    name: &str,
    status: &PodStatus,
    key: &str,
) -> Result<(), Error> {
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(&status_patch(status)),
    )
    .await
    .map_err(api_error(Side::Upper, "writing the status of", "Pod", key))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_patch_clears_what_the_lower_status_lacks() {
        let status: PodStatus =
            serde_json::from_value(json!({"phase": "Running", "podIP": "10.1.1.1"})).unwrap();
        let patch = status_patch(&status);
        assert_eq!(patch["status"]["phase"], "Running");
        assert_eq!(patch["status"]["podIP"], "10.1.1.1");
        assert!(patch["status"]["reason"].is_null());
        assert!(patch["status"].as_object().unwrap().contains_key("reason"));
        assert!(
            !patch["status"]
                .as_object()
                .unwrap()
                .contains_key("qosClass")
        );
    }
}
