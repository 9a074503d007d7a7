//! Events the lower cluster records about this node's pods (FailedScheduling, Pulled,
//! BackOff, …) are reflected onto the upper pods, with the lower reason and message, so
//! that `kubectl describe pod` in the upper cluster tells why a pod is Pending below.
//! Repeats already reflected are dropped, each pod has a budget
//! ([`BURST`] at once, one more every [`REFILL`]), and the recorder folds repeats into
//! event series. Always on.
//!
//! It reads the lower events as a stream (no store: events are many and short-lived) and
//! the pod stores the pod controller keeps.

use std::pin::pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Event as LowerEvent;
use k8s_openapi::jiff::Timestamp;
use kube::Resource;
use kube::api::Api;
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, watcher};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::Context;
use super::pod_watch::PodStores;
use crate::translate::events::{EventGate, Verdict, last_seen, occurrences, reflection};

/// Events a pod may get at once.
pub const BURST: u32 = 10;
/// One more event per pod after this long.
pub const REFILL: Duration = Duration::from_secs(6);
/// Lower events older than this when tensile starts are not reflected: the upper pod got
/// them from the previous run, or they no longer matter.
const STARTUP_SLACK_SECONDS: i64 = 60;
/// How long a reflected event is remembered (the API server keeps events an hour).
const REMEMBER: Duration = Duration::from_secs(3600);

/// Runs until `shutdown`, once both pod stores are synced.
pub async fn run(ctx: Arc<Context>, pods: PodStores, shutdown: CancellationToken) {
    tokio::select! {
        () = shutdown.cancelled() => return,
        synced = pods.synced.wait() => if synced.is_err() { return },
    }
    let started = Timestamp::now().as_second();
    let api: Api<LowerEvent> = if ctx.namespace.is_empty() {
        Api::all(ctx.lower.clone())
    } else {
        Api::namespaced(ctx.lower.clone(), &ctx.namespace)
    };
    let mut events = pin!(
        watcher::watcher(
            api,
            watcher::Config::default().fields("involvedObject.kind=Pod")
        )
        .default_backoff()
    );
    let mut gate = EventGate::new(BURST, REFILL);
    let mut prune = tokio::time::interval(Duration::from_secs(300));
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = prune.tick() => gate.forget_older_than(Instant::now(), REMEMBER),
            item = events.next() => match item {
                None => return,
                Some(Err(error)) => debug!(%error, cluster = "lower", "watching events"),
                Some(Ok(watcher::Event::Apply(event) | watcher::Event::InitApply(event))) => {
                    reflect(&ctx, &pods, &mut gate, &event, started).await;
                }
                Some(Ok(_)) => {}
            },
        }
    }
}

/// Publishes `event` on the upper pod of the lower pod it is about, if that pod is this
/// node's and the gate lets it through.
async fn reflect(
    ctx: &Context,
    pods: &PodStores,
    gate: &mut EventGate,
    event: &LowerEvent,
    started: i64,
) {
    let about = &event.involved_object;
    let (Some(namespace), Some(name)) = (about.namespace.as_deref(), about.name.as_deref()) else {
        return;
    };
    let Some(lower) = pods.lower.get(&ObjectRef::new(name).within(namespace)) else {
        return;
    };
    if about.uid.is_some() && about.uid != lower.metadata.uid {
        return; // about an earlier pod of this name
    }
    let Some(origin) = lower.upper_uid() else {
        return;
    };
    let Some(upper) = pods
        .upper
        .get(&ObjectRef::new(name).within(namespace))
        .filter(|u| u.metadata.uid.as_deref() == Some(origin))
    else {
        return;
    };
    let Some(reflected) = reflection(event) else {
        return;
    };
    let id = event
        .metadata
        .uid
        .clone()
        .or_else(|| event.metadata.name.clone())
        .unwrap_or_default();
    let count = occurrences(event);
    let now = Instant::now();
    if last_seen(event).is_some_and(|t| t.as_second() < started - STARTUP_SLACK_SECONDS) {
        gate.remember(now, &id, count);
        return;
    }
    let pod = format!("{namespace}/{name}");
    match gate.admit(now, &pod, &id, count) {
        Verdict::Publish => {}
        Verdict::Duplicate => return,
        Verdict::RateLimited => {
            debug!(%pod, reason = %reflected.reason, "rate-limited a lower event");
            return;
        }
    }
    let mut reference = upper.object_ref(&());
    reference.field_path = reflected.field_path.clone();
    let published = Event {
        type_: if reflected.warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reflected.reason.clone(),
        note: Some(reflected.note),
        action: reflected.action,
        secondary: None,
    };
    match ctx.recorder.publish(&published, &reference).await {
        Ok(()) => debug!(%pod, reason = %reflected.reason, "reflected a lower event"),
        Err(error) => debug!(%pod, %error, cluster = "upper", "reflecting a lower event"),
    }
}
