//! Events the lower cluster records about this node's pods (FailedScheduling, Pulled,
//! BackOff, …) are reflected onto the upper pods, with the lower reason and message, so
//! that `kubectl describe pod` in the upper cluster tells why a pod is Pending below.
//! Repeats already reflected are dropped, each pod has a budget
//! ([`BURST`] at once, one more every [`REFILL`]), and the recorder folds repeats into
//! event series. Always on.
//!
//! It reads the lower events as a stream (no store: events are many and short-lived) and
//! the pod stores the pod controller keeps. The watch only decides; a separate publisher
//! writes to the upper cluster from a bounded queue.

use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Event as LowerEvent, ObjectReference};
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::events::{Event, EventType};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::Context;
use super::pod_watch::PodStores;
use crate::translate::events::{
    EventGate, PendingEvents, Verdict, last_seen, occurrences, reflection,
};

/// Events a pod may get at once.
pub const BURST: u32 = 10;
/// One more event per pod after this long.
pub const REFILL: Duration = Duration::from_secs(6);
/// Lower events older than this when tensile starts are not reflected: the upper pod got
/// them from the previous run, or they no longer matter.
const STARTUP_SLACK_SECONDS: i64 = 60;
/// How long a reflected event is remembered (the API server keeps events an hour).
const REMEMBER: Duration = Duration::from_secs(3600);

/// Reflections waiting for the upper API server, at most this many.
pub const QUEUE_CAPACITY: usize = 1000;

/// One reflection, decided and ready to publish.
struct Outgoing {
    /// `namespace/name` of the pod, for logs.
    pod: String,
    reference: ObjectReference,
    event: Event,
}

/// The queue between the watch, which decides, and the publisher, which writes upstream.
struct Outbox {
    pending: Mutex<PendingEvents<Outgoing>>,
    added: Notify,
}

impl Outbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, PendingEvents<Outgoing>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Runs until `shutdown`, once both pod stores are synced: the watch of lower events and
/// the publisher of their reflections, apart, so a slow upper API server never holds up
/// the watch (a full queue drops its oldest reflection, counted in
/// `tensile_upper_events_dropped_total`).
pub async fn run(ctx: Arc<Context>, pods: PodStores, shutdown: CancellationToken) {
    tokio::select! {
        () = shutdown.cancelled() => return,
        synced = pods.synced.wait() => if synced.is_err() { return },
    }
    let outbox = Outbox {
        pending: Mutex::new(PendingEvents::new(QUEUE_CAPACITY)),
        added: Notify::new(),
    };
    tokio::join!(
        watch(&ctx, &pods, &outbox, &shutdown),
        publish(&ctx, &outbox, &shutdown)
    );
}

/// Watches lower events about pods and queues the reflections the gate lets through.
async fn watch(ctx: &Context, pods: &PodStores, outbox: &Outbox, shutdown: &CancellationToken) {
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
        let event = tokio::select! {
            () = shutdown.cancelled() => return,
            _ = prune.tick() => {
                gate.forget_older_than(Instant::now(), REMEMBER);
                continue;
            }
            item = events.next() => match item {
                None => return,
                Some(Err(error)) => {
                    debug!(%error, cluster = "lower", "watching events");
                    continue;
                }
                Some(Ok(watcher::Event::Apply(event) | watcher::Event::InitApply(event))) => event,
                Some(Ok(_)) => continue,
            },
        };
        let Some(outgoing) = reflect(pods, &mut gate, &event, started) else {
            continue;
        };
        let dropped = outbox.lock().push(outgoing);
        outbox.added.notify_one();
        if let Some(dropped) = dropped {
            ctx.metrics.events_dropped.inc();
            debug!(object = %dropped.pod, kind = "Pod", reason = %dropped.event.reason, cluster = "upper",
                "the upper API server is behind; dropped a lower event");
        }
    }
}

/// Publishes queued reflections one at a time until `shutdown`.
async fn publish(ctx: &Context, outbox: &Outbox, shutdown: &CancellationToken) {
    loop {
        let next = outbox.lock().pop();
        let Some(outgoing) = next else {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = outbox.added.notified() => continue,
            }
        };
        let Outgoing {
            pod,
            reference,
            event,
        } = outgoing;
        let published = tokio::select! {
            () = shutdown.cancelled() => return,
            published = ctx.recorder.publish(&event, &reference) => published,
        };
        match published {
            Ok(()) => {
                debug!(object = %pod, kind = "Pod", cluster = "upper", reason = %event.reason, "reflected a lower event")
            }
            Err(error) => {
                debug!(object = %pod, kind = "Pod", cluster = "upper", %error, "reflecting a lower event")
            }
        }
    }
}

/// The reflection of `event` on the upper pod of the lower pod it is about, if that pod
/// is this node's and the gate lets it through.
fn reflect(
    pods: &PodStores,
    gate: &mut EventGate,
    event: &LowerEvent,
    started: i64,
) -> Option<Outgoing> {
    let about = &event.involved_object;
    let (namespace, name) = (about.namespace.as_deref()?, about.name.as_deref()?);
    let lower = pods.lower.get(namespace, name)?;
    if about.uid.is_some() && about.uid.as_deref() != lower.meta.uid.as_deref() {
        return None; // about an earlier pod of this name
    }
    let origin = lower.upper_uid()?;
    let upper = pods
        .upper
        .get(namespace, name)
        .filter(|u| u.meta.uid.as_deref() == Some(origin))?;
    let reflected = reflection(event)?;
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
        return None;
    }
    let pod = format!("{namespace}/{name}");
    match gate.admit(now, &pod, &id, count) {
        Verdict::Publish => {}
        Verdict::Duplicate => return None,
        Verdict::RateLimited => {
            debug!(object = %pod, kind = "Pod", cluster = "upper", reason = %reflected.reason, "rate-limited a lower event");
            return None;
        }
    }
    let mut reference = upper.object_reference();
    reference.field_path = reflected.field_path.clone();
    let event = Event {
        type_: if reflected.warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reflected.reason,
        note: Some(reflected.note),
        action: reflected.action,
        secondary: None,
    };
    Some(Outgoing {
        pod,
        reference,
        event,
    })
}
