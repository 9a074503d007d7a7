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

use std::collections::VecDeque;
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
    let mut unseen = Unseen::default();
    let mut retry = tokio::time::interval(UNSEEN_RETRY);
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return,
            _ = prune.tick() => {
                gate.forget_older_than(Instant::now(), REMEMBER);
                continue;
            }
            _ = retry.tick() => {
                for (first, event) in unseen.due(Instant::now()) {
                    match reflect(pods, &mut gate, &event, started) {
                        Reflection::Publish(outgoing) => send(ctx, outbox, *outgoing),
                        Reflection::Skip => {}
                        Reflection::PodNotSeen => unseen.push(first, event),
                    }
                }
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
        match reflect(pods, &mut gate, &event, started) {
            Reflection::Publish(outgoing) => send(ctx, outbox, *outgoing),
            Reflection::Skip => {}
            Reflection::PodNotSeen => unseen.push(Instant::now(), event),
        }
    }
}

/// Queues `outgoing` for the publisher.
fn send(ctx: &Context, outbox: &Outbox, outgoing: Outgoing) {
    let dropped = outbox.lock().push(outgoing);
    outbox.added.notify_one();
    if let Some(dropped) = dropped {
        ctx.metrics.events_dropped.inc();
        debug!(object = %dropped.pod, kind = "Pod", reason = %dropped.event.reason, cluster = "upper",
            "the upper API server is behind; dropped a lower event");
    }
}

/// How often events about pods not seen yet are tried again, and for how long.
const UNSEEN_RETRY: Duration = Duration::from_secs(1);
const UNSEEN_FOR: Duration = Duration::from_secs(10);
/// At most this many such events wait (the oldest goes first).
const UNSEEN_CAPACITY: usize = 1024;

/// Lower events about a pod the pod stores do not hold yet. The pod watches may lag the
/// event watch: a lower scheduler's FailedScheduling comes right after the pod it is
/// about was created, and was lost when its watch event came first. Events about pods
/// that are not this node's wait here too, until they expire.
#[derive(Default)]
struct Unseen {
    events: VecDeque<(Instant, LowerEvent)>,
}

impl Unseen {
    fn push(&mut self, now: Instant, event: LowerEvent) {
        if self.events.len() >= UNSEEN_CAPACITY {
            self.events.pop_front();
        }
        self.events.push_back((now, event));
    }

    /// The events still worth a try at `now`; the expired ones are dropped.
    fn due(&mut self, now: Instant) -> Vec<(Instant, LowerEvent)> {
        self.events
            .drain(..)
            .filter(|(first, _)| now.saturating_duration_since(*first) < UNSEEN_FOR)
            .collect()
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

/// What becomes of a lower event.
enum Reflection {
    /// Its reflection on the upper pod.
    Publish(Box<Outgoing>),
    /// Nothing: not reflected, or not let through.
    Skip,
    /// Its pod is not in the pod stores (yet): try again.
    PodNotSeen,
}

/// The reflection of `event` on the upper pod of the lower pod it is about, if that pod
/// is this node's and the gate lets it through.
fn reflect(pods: &PodStores, gate: &mut EventGate, event: &LowerEvent, started: i64) -> Reflection {
    let about = &event.involved_object;
    let (Some(namespace), Some(name)) = (about.namespace.as_deref(), about.name.as_deref()) else {
        return Reflection::Skip;
    };
    let Some(lower) = pods.lower.get(namespace, name) else {
        return Reflection::PodNotSeen;
    };
    if about.uid.is_some() && about.uid.as_deref() != lower.meta.uid().as_deref() {
        // About another pod of this name: an earlier one, or one the store has not seen.
        return Reflection::PodNotSeen;
    }
    let Some(origin) = lower.upper_uid() else {
        return Reflection::Skip;
    };
    let Some(upper) = pods
        .upper
        .get(namespace, name)
        .filter(|u| u.meta.uid() == Some(origin))
    else {
        return Reflection::PodNotSeen;
    };
    match reflect_on(
        gate,
        event,
        started,
        namespace,
        name,
        upper.object_reference(),
    ) {
        Some(outgoing) => Reflection::Publish(Box::new(outgoing)),
        None => Reflection::Skip,
    }
}

/// `event`'s reflection on the upper pod `namespace/name` (`reference`), if it is one the
/// user should see and the gate lets it through.
fn reflect_on(
    gate: &mut EventGate,
    event: &LowerEvent,
    started: i64,
    namespace: &str,
    name: &str,
    mut reference: ObjectReference,
) -> Option<Outgoing> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn event(name: &str) -> LowerEvent {
        let mut event = LowerEvent::default();
        event.metadata.name = Some(name.into());
        event
    }

    fn names(due: &[(Instant, LowerEvent)]) -> Vec<String> {
        due.iter()
            .map(|(_, e)| e.metadata.name.clone().unwrap_or_default())
            .collect()
    }

    /// Events about pods not seen yet wait for their pods a while, and a bounded number.
    #[test]
    fn unseen_events_wait_a_while_and_so_many() {
        let start = Instant::now();
        let mut unseen = Unseen::default();
        unseen.push(start, event("early"));
        unseen.push(start + UNSEEN_FOR / 2, event("later"));
        let due = unseen.due(start + UNSEEN_FOR);
        assert_eq!(names(&due), ["later"], "expired after UNSEEN_FOR");
        assert!(unseen.events.is_empty(), "handed out");
        for i in 0..=UNSEEN_CAPACITY {
            unseen.push(start, event(&i.to_string()));
        }
        let due = unseen.due(start);
        assert_eq!(due.len(), UNSEEN_CAPACITY);
        assert_eq!(names(&due[..1]), ["1"], "the oldest went first");
    }
}
