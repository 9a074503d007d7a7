//! Status reflection: the lower pod's status, as the upper pod's. A controller of its
//! own, keyed by pod and woken by changes of either copy (the same watches as the pod
//! controller, [`super::pod_watch`]), so that a lower pod turning Ready is reflected
//! at once even while the pod controller's queue holds a burst of pods being created.
//! It writes only when the lower status says something the upper one does not show, so a
//! restart writes nothing for pods already in step.

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::Api;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span, warn};

use super::pod::{StatusWrite, deletion_cost_due, reflects_status, write_upper_status_and_cost};
use super::pod_watch::{PodQueue, PodStores, Triggers, run_controller};
use super::{Context, Error};
use crate::translate::pod::{status_is_informative, upper_status};
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
    let sc = Arc::new(StatusContext { ctx, pods: stores });
    let lower = sc.pods.lower.clone();
    let queue = PodQueue::measured(&sc.ctx.metrics, &sc.ctx.owner.node, "status queue");
    run_controller(triggers, lower, queue, workers, resync, shutdown, |lower| {
        let sc = sc.clone();
        async move {
            reconcile(&lower, &sc)
                .await
                .err()
                .map(|_| sc.ctx.backoff(&backoff_key(&lower.meta.key())))
        }
    })
    .await;
}

/// The key under which failures back off, apart from the pod controller's.
fn backoff_key(key: &str) -> String {
    format!("status:{key}")
}

/// Reflects one lower pod's status; a failure is retried with backoff.
async fn reconcile(lower: &StoredPod, sc: &StatusContext) -> Result<(), Error> {
    let key = lower.meta.key();
    let span = info_span!("pod status", pod = %key);
    async {
        sc.pods.synced.wait().await?;
        let started = Instant::now();
        let result = reflect_status(lower, sc, &key, started).await;
        sc.ctx.metrics.reconciled("status", started.elapsed());
        result
    }
    .instrument(span)
    .await
}

/// Writes the status of `lower` onto its upper pod when it says more than the upper
/// one; a pair found in step before, neither changed since, is passed over. `started`
/// (the reconcile's start) stands for when the watch saw the lower change: the time it
/// waited in the controller's queue is not counted.
async fn reflect_status(
    lower: &StoredPod,
    sc: &StatusContext,
    key: &str,
    started: Instant,
) -> Result<(), Error> {
    let ctx = &sc.ctx;
    let Some(stored_upper) = sc.pods.upper.get(&lower.meta.namespace, lower.meta.name()) else {
        return Ok(());
    };
    // Found in step before, neither copy changed since.
    if lower.in_step_with(&stored_upper) {
        return Ok(());
    }
    let stored_lower = lower;
    let (upper, lower) = (stored_upper.to_pod(), stored_lower.to_pod());
    // Only for a pod mirrored by this node (while it terminates too): the pod controller
    // owns every other step.
    if !reflects_status(&upper, &lower, &ctx.owner) {
        return Ok(());
    }
    let desired = upper_status(&lower, &upper);
    let informative = lower.status.as_ref().is_some_and(status_is_informative);
    if !informative || stored_upper.status_in_sync(&desired) {
        stored_lower.mark_in_step_with(&stored_upper);
        return Ok(());
    }
    let api: Api<Pod> = Api::namespaced(ctx.upper.clone(), &upper.namespace().unwrap_or_default());
    let write_started = Instant::now();
    // The UID precondition keeps a store that lags a same-name re-create from writing
    // the old pod's status onto the new one. The pod's deletion cost, while it has none
    // of ours, goes in the same write (the pod controller writes it only for pods that
    // ran below before).
    let cost = deletion_cost_due(&stored_upper, ctx.bursting.borrow().priority);
    let written = write_upper_status_and_cost(&api, &upper, &desired, cost, key).await;
    ctx.metrics
        .status_write_seconds
        .observe(write_started.elapsed().as_secs_f64());
    match written {
        Ok(StatusWrite::Written) => {
            ctx.metrics.status_writes.inc();
            ctx.metrics
                .status_reflection_seconds
                .observe(started.elapsed().as_secs_f64());
            ctx.succeeded(&backoff_key(key));
            debug!(object = %key, kind = "Pod", cluster = "upper", phase = ?desired.phase, "reflected status");
            Ok(())
        }
        Ok(StatusWrite::PodReplaced) => {
            ctx.succeeded(&backoff_key(key));
            debug!(
                object = %key, kind = "Pod", cluster = "upper",
                "the upper pod was replaced meanwhile; its own events bring the next step"
            );
            Ok(())
        }
        Err(error) => {
            ctx.metrics.reconcile_failed(error.metric_label());
            warn!(object = %key, kind = "Pod", cluster = "upper", %error, "reflecting status failed; retrying with backoff");
            Err(error)
        }
    }
}
