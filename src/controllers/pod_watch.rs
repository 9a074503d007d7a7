//! The two pod watches every pod-reading controller shares: upper pods bound to this node
//! and lower pods it owns, each stored once (compactly, as [`StoredPod`]s), and each change
//! handed to both the pod controller ([`super::pod`]) and the status reflector
//! ([`super::status`]) on queues of their own.

use std::sync::Arc;
use std::time::Duration;

use futures::channel::mpsc;
use futures::stream::BoxStream;
use futures::{FutureExt, SinkExt, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::Context;
use super::pod_store::{Departed, PodStore, Touched, WholePods, Writer};
use super::queue::{self, WorkQueue};
use super::stores::{Ready, errors_logged_as, every};
use crate::side::Side;
use crate::translate::meta::LOWER_POD_MARKS;
use crate::translate::stored::{SharedSpecs, StoredPod};

/// The pods a watch touched, after their store took them in.
type PodStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<Touched, watcher::Error>> + Send>>;

/// Whether a touched pod wakes the pod controller. A change of status alone says nothing
/// to it about a lower pod, and nothing about an upper pod whose lower copy exists: its
/// [`super::pod::decide`] reads the upper status only without one. Most watch events are
/// such changes (a lower pod going Running, Ready; their reflection up), and the periodic
/// resync still visits every pod.
fn wakes_pod_controller(side: Side, status_only: bool, lower_copy: impl FnOnce() -> bool) -> bool {
    !status_only
        || match side {
            Side::Lower => false,
            Side::Upper => !lower_copy(),
        }
}

/// How many changed pods may wait for a controller to take them before the watch waits.
const TRIGGER_BUFFER: usize = 1024;

/// The changed pods one controller is woken by: upper pods bound to this node and lower
/// pods it owns.
pub struct Triggers {
    pub(crate) upper: BoxStream<'static, Arc<StoredPod>>,
    pub(crate) lower: BoxStream<'static, Arc<StoredPod>>,
}

impl Triggers {
    /// Drops every change until `until` ends, then yields every pod of `upper` once, as if
    /// each had just changed, before the changes from then on. A standby (`--leader-elect`)
    /// runs no controller: dropping keeps its watches, and so its stores, current instead of
    /// waiting on a full queue; the replay makes the new leader act on whatever changed
    /// meanwhile (both controllers map an upper pod to its lower one; a lower pod whose
    /// upper pod is gone is the orphan collector's).
    pub async fn drop_until(mut self, upper: &PodStore, until: impl Future<Output = ()>) -> Self {
        let mut until = std::pin::pin!(until);
        loop {
            tokio::select! {
                () = &mut until => break,
                Some(_) = self.upper.next() => {}
                Some(_) = self.lower.next() => {}
                else => {
                    until.await;
                    break;
                }
            }
        }
        let replay = futures::stream::iter(upper.state());
        Self {
            upper: replay.chain(self.upper).boxed(),
            lower: self.lower,
        }
    }
}

/// The two pod watches, their stores, and the changes they hand to the pod controller and
/// to the status reflector. Each pod is stored once; both controllers read the same stores.
pub struct PodWatches {
    /// The two stores, read by every controller that needs pods.
    pub stores: PodStores,
    /// Drives both watches and hands each changed pod to both controllers; run it beside
    /// them until shutdown.
    pub pump: futures::future::BoxFuture<'static, ()>,
    /// What wakes the pod controller ([`super::pod::run`]).
    pub pods: Triggers,
    /// What wakes the status reflector ([`super::status::run`]).
    pub status: Triggers,
}

/// The stores the pod controllers read.
#[derive(Clone)]
pub struct PodStores {
    /// Upper pods bound to this node.
    pub upper: PodStore,
    /// Lower pods this node owns.
    pub lower: PodStore,
    /// Whether both have listed once.
    pub synced: Ready,
    /// Upper pods kept whole while their lower copy is being made.
    pub whole: WholePods,
}

/// A pod controller's queue: pods by namespace and name.
pub type PodQueue = WorkQueue<ObjectRef<Pod>>;

/// How a pod store keeps each pod ([`StoredPod::new`] or [`StoredPod::summarized`]).
type Keep = fn(Pod, &mut SharedSpecs) -> StoredPod;

/// Upper pods kept whole ([`WholePods`]) beside the store, and the lower store that
/// tells whether a pod's copy exists.
type KeepWhole = Option<(WholePods, PodStore)>;

/// The pod watch events of `watch` filling a [`PodStore`] with [`StoredPod`]s made by
/// `keep` through `shared` (pods are stored compactly: a full pod's spec detail is read
/// only when its lower pod is created, and is most of its memory) (and offering each pod to `whole`, if given, before it is stored); the pods it
/// touched, and whether it has listed once.
fn pod_reflector(
    watch: BoxStream<'static, Result<watcher::Event<Pod>, watcher::Error>>,
    keep: Keep,
    mut shared: SharedSpecs,
    whole: KeepWhole,
    side: Side,
) -> (PodStore, PodStream, Ready) {
    let store = PodStore::default();
    let mut writer = Writer::new(store.clone());
    let stored = store.clone();
    let (listed_tx, listed_rx) = watch::channel(false);
    let touched = watch
        .map_ok(move |event| {
            if let Some((whole, lower)) = &whole {
                offer_whole(&event, whole, lower);
            }
            let event = match event {
                watcher::Event::Apply(pod) => watcher::Event::Apply(keep(pod, &mut shared)),
                watcher::Event::Delete(pod) => watcher::Event::Delete(keep(pod, &mut shared)),
                watcher::Event::InitApply(pod) => watcher::Event::InitApply(keep(pod, &mut shared)),
                watcher::Event::Init => watcher::Event::Init,
                watcher::Event::InitDone => watcher::Event::InitDone,
            };
            let listed = matches!(event, watcher::Event::InitDone);
            let touched = writer.apply(event);
            if listed {
                if let Some((whole, _)) = &whole {
                    whole.retain_stored(&stored);
                }
                listed_tx.send_replace(true);
            }
            touched
        })
        .try_filter_map(|touched| futures::future::ready(Ok(touched)));
    let touched = errors_logged_as(touched, side, "Pod".into());
    (store, touched, Ready::listed(listed_rx))
}

/// Offers the upper pod of `event` to `whole` (or forgets it, deleted).
fn offer_whole(event: &watcher::Event<Pod>, whole: &WholePods, lower: &PodStore) {
    match event {
        watcher::Event::Apply(pod) | watcher::Event::InitApply(pod) => whole.offer(pod, lower),
        watcher::Event::Delete(pod) => whole.forget(
            pod.metadata.namespace.as_deref().unwrap_or_default(),
            pod.metadata.name.as_deref().unwrap_or_default(),
        ),
        watcher::Event::Init | watcher::Event::InitDone => {}
    }
}

/// Polls `touched` (which keeps its store current, on `side`) and hands every changed
/// pod, deletions included, to the status reflector, and to the pod controller those that
/// [`wakes_pod_controller`] (`lower` is the lower store). A lower pod touched is one whose
/// upper pod need no longer be kept whole (`made`). A controller that has stopped is
/// skipped; the store is kept current for the other.
async fn fan_out(
    mut touched: PodStream,
    side: Side,
    lower: PodStore,
    departed: Option<(PodStore, Departed)>,
    made: Option<WholePods>,
    mut pods: mpsc::Sender<Arc<StoredPod>>,
    mut status: mpsc::Sender<Arc<StoredPod>>,
) {
    // Its errors were logged and left out: every item is a pod.
    while let Some(Ok(Touched { pod, status_only })) = touched.next().await {
        let lower_copy = || lower.get(&pod.meta.namespace, pod.meta.name()).is_some();
        if let Some((upper, departed)) = &departed {
            keep_if_departed(&pod, &lower, upper, departed);
        }
        if let Some(whole) = &made {
            whole.forget(&pod.meta.namespace, pod.meta.name());
        }
        // Each send fails only once that controller has stopped.
        if wakes_pod_controller(side, status_only, lower_copy) {
            let _ = pods.send(pod.clone()).await;
        }
        let _ = status.send(pod).await;
    }
}

/// Keeps `lower` (a lower pod the watch just touched) in `departed` if that touch was its
/// deletion (`store` no longer has it) while its upper pod is being deleted: the pod
/// controller writes its last status upstairs before finishing the deletion.
fn keep_if_departed(
    lower: &Arc<StoredPod>,
    store: &PodStore,
    upper: &PodStore,
    departed: &Departed,
) {
    let (namespace, name) = (&lower.meta.namespace, lower.meta.name());
    if store.get(namespace, name).is_some() {
        return;
    }
    let upper_deleting = upper.get(namespace, name).is_some_and(|upper| {
        upper.meta.deletion_timestamp().is_some()
            && upper
                .meta
                .uid()
                .is_some_and(|uid| lower.upper_uid() == Some(uid))
    });
    if upper_deleting {
        departed.keep(lower.clone());
    }
}

/// Sets up the watches: upper pods with `spec.nodeName=<node>` (in `--namespace` if
/// given; routed from the shared watch in a federated process), lower pods labelled as
/// this node's. With node granularity, each change of `replay` starts the upper watch
/// anew (a fresh list): a virtual node with pods joined the member after it listed.
pub fn watches(ctx: &Arc<Context>, replay: watch::Receiver<u64>) -> PodWatches {
    let upper_watch = match &ctx.groups {
        None => upper_pod_watch(ctx),
        Some(_) => {
            let ctx = ctx.clone();
            relisted(move || upper_pod_watch(&ctx), replay)
        }
    };
    lower_and_stores(ctx, upper_watch)
}

type PodEvents = futures::stream::BoxStream<'static, Result<watcher::Event<Pod>, watcher::Error>>;

/// The stream `make` gives, made again (from its first list) each time `replay` changes.
fn relisted(
    make: impl Fn() -> PodEvents + Send + 'static,
    replay: watch::Receiver<u64>,
) -> PodEvents {
    futures::stream::unfold(
        (make(), replay, true, make),
        |(mut events, mut replay, mut open, make)| async move {
            loop {
                tokio::select! {
                    changed = replay.changed(), if open => {
                        open = changed.is_ok();
                        if open {
                            replay.mark_unchanged();
                            events = make();
                        }
                    }
                    event = events.next() => return event.map(|e| (e, (events, replay, open, make))),
                }
            }
        },
    )
    .boxed()
}

/// The member's upper pod watch: its node's pods, or its virtual nodes' (node
/// granularity).
fn upper_pod_watch(ctx: &Context) -> PodEvents {
    match &ctx.upper_watches {
        Some(shared) => match &ctx.groups {
            None => shared.pods.subscribe(&ctx.owner.node),
            // Node granularity: the pods of every one of the member's virtual nodes.
            Some(groups) => shared.pods.subscribe_set(&ctx.owner.node, groups.clone()),
        },
        None => {
            let upper_api: Api<Pod> = if ctx.namespace.is_empty() {
                Api::all(ctx.upper.clone())
            } else {
                Api::namespaced(ctx.upper.clone(), &ctx.namespace)
            };
            match &ctx.groups {
                None => {
                    let node = watcher::Config::default()
                        .fields(&format!("spec.nodeName={}", ctx.owner.node));
                    watcher::watcher(upper_api, node).default_backoff().boxed()
                }
                // Node granularity: every bound pod, kept only if bound to one of the
                // member's virtual nodes (a pod's node never changes once bound, and a
                // virtual node is known before it is registered).
                Some(groups) => {
                    let groups = groups.clone();
                    let bound = watcher::Config::default().fields("spec.nodeName!=");
                    watcher::watcher(upper_api, bound)
                        .default_backoff()
                        .try_filter(move |event| {
                            let ours = match event {
                                watcher::Event::Apply(pod)
                                | watcher::Event::Delete(pod)
                                | watcher::Event::InitApply(pod) => pod
                                    .spec
                                    .as_ref()
                                    .and_then(|s| s.node_name.as_deref())
                                    .is_some_and(|n| groups.contains(n)),
                                watcher::Event::Init | watcher::Event::InitDone => true,
                            };
                            futures::future::ready(ours)
                        })
                        .boxed()
                }
            }
        }
    }
}

/// The lower pod watch and both stores, the upper fed by `upper_watch`.
fn lower_and_stores(ctx: &Context, upper_watch: PodEvents) -> PodWatches {
    let lower_watch = watcher::watcher(
        Api::all(ctx.lower.clone()),
        watcher::Config::default().labels(&ctx.owner.selector()),
    )
    .default_backoff()
    .boxed();
    let (lower_store, lower_stream, lower_ready) = pod_reflector(
        lower_watch,
        StoredPod::new,
        SharedSpecs::with_common_labels(LOWER_POD_MARKS),
        None,
        Side::Lower,
    );
    let whole = WholePods::default();
    let (upper_store, upper_stream, upper_ready) = pod_reflector(
        upper_watch,
        // An upper status is only compared with the lower one (as a digest) between
        // reconciles; the lower status is what gets written up, so it is kept whole.
        StoredPod::summarized,
        SharedSpecs::default(),
        Some((whole.clone(), lower_store.clone())),
        Side::Upper,
    );
    let mirrored = lower_store.clone();
    ctx.metrics
        .count_mirrored(&ctx.owner.node, "pods", move || mirrored.len());
    for (owner, store) in [("upper pods", &upper_store), ("lower pods", &lower_store)] {
        let store = store.clone();
        ctx.metrics
            .measure_memory(&ctx.owner.node, owner, move || store.heap_bytes());
    }
    let (pods_upper, pods_upper_rx) = mpsc::channel(TRIGGER_BUFFER);
    let (pods_lower, pods_lower_rx) = mpsc::channel(TRIGGER_BUFFER);
    let (status_upper, status_upper_rx) = mpsc::channel(TRIGGER_BUFFER);
    let (status_lower, status_lower_rx) = mpsc::channel(TRIGGER_BUFFER);
    let pump = futures::future::join(
        fan_out(
            upper_stream,
            Side::Upper,
            lower_store.clone(),
            None,
            None,
            pods_upper,
            status_upper,
        ),
        fan_out(
            lower_stream,
            Side::Lower,
            lower_store.clone(),
            Some((upper_store.clone(), ctx.departed.clone())),
            Some(whole.clone()),
            pods_lower,
            status_lower,
        ),
    )
    .map(|((), ())| ())
    .boxed();
    PodWatches {
        stores: PodStores {
            upper: upper_store,
            lower: lower_store,
            synced: upper_ready.and(&lower_ready),
            whole,
        },
        pump,
        pods: Triggers {
            upper: pods_upper_rx.boxed(),
            lower: pods_lower_rx.boxed(),
        },
        status: Triggers {
            upper: status_upper_rx.boxed(),
            lower: status_lower_rx.boxed(),
        },
    }
}

/// Runs a pod controller until `shutdown`: every pod either watch of `triggers` hands over
/// (and, every `resync`, every pod of `store`) queues its namespace/name, and `reconcile`
/// runs on the pod of `store` under it, at most `workers` at once and never twice at once
/// for one pod; a pod gone from `store` meanwhile is skipped. `reconcile` answers when to
/// retry, if it must.
pub async fn run_controller<F, Fut>(
    triggers: Triggers,
    store: PodStore,
    queue: Arc<PodQueue>,
    workers: u16,
    resync: Duration,
    shutdown: CancellationToken,
    reconcile: F,
) where
    F: Fn(Arc<StoredPod>) -> Fut,
    Fut: Future<Output = Option<Duration>>,
{
    let feed = async {
        let mut changed = futures::stream::select(triggers.upper, triggers.lower);
        let mut resync = std::pin::pin!(every(resync));
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                Some(pod) = changed.next() => queue.add(same_name(&pod)),
                Some(()) = resync.next() => {
                    for pod in store.state() {
                        queue.add(same_name(&pod));
                    }
                }
            }
        }
    };
    let work = queue::work(&queue, workers, &shutdown, |key| {
        let pod = store.get(key.namespace.as_deref().unwrap_or_default(), &key.name);
        let reconciled = pod.map(&reconcile);
        async move {
            match reconciled {
                Some(reconciled) => reconciled.await,
                None => None,
            }
        }
    });
    futures::future::join(feed, work).await;
}

/// The `ObjectRef` of the pod of the same namespace and name in the other cluster.
pub(crate) fn same_name(pod: &StoredPod) -> ObjectRef<Pod> {
    ObjectRef::new(pod.meta.name()).within(&pod.meta.namespace)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::time::Duration;

    use super::*;

    fn pod(name: &str) -> StoredPod {
        let mut pod = Pod::default();
        pod.metadata.name = Some(name.into());
        pod.metadata.namespace = Some("ns".into());
        StoredPod::from(pod)
    }

    fn name(pod: &StoredPod) -> String {
        pod.meta.name().to_owned()
    }

    #[test]
    fn status_alone_wakes_the_pod_controller_for_an_upper_pod_without_a_lower_copy() {
        // (side, status only, lower copy exists, wakes)
        let cases = [
            (Side::Lower, false, true, true),
            (Side::Lower, true, true, false),
            (Side::Lower, true, false, false),
            (Side::Upper, false, true, true),
            (Side::Upper, false, false, true),
            (Side::Upper, true, true, false),
            (Side::Upper, true, false, true),
        ];
        for (side, status_only, lower_copy, want) in cases {
            assert_eq!(
                wakes_pod_controller(side, status_only, || lower_copy),
                want,
                "{side:?}, status only {status_only}, lower copy {lower_copy}"
            );
        }
    }

    /// A standby's triggers never make its watch wait (queues of one, ten changes), and
    /// the new leader is handed every stored pod, then the live changes.
    #[tokio::test]
    async fn a_standby_drops_changes_then_replays_its_store() {
        let store = PodStore::default();
        let mut writer = Writer::new(store.clone());
        let (mut upper_tx, upper_rx) = mpsc::channel(1);
        let (mut lower_tx, lower_rx) = mpsc::channel(1);
        let triggers = Triggers {
            upper: upper_rx.boxed(),
            lower: lower_rx.boxed(),
        };
        let (lead_tx, lead_rx) = tokio::sync::oneshot::channel::<()>();
        let standby = tokio::spawn(async move {
            let until = async {
                let _ = lead_rx.await;
            };
            triggers.drop_until(&store, until).await
        });
        let test = async {
            let stored: BTreeSet<String> = (0..10).map(|i| format!("pod-{i}")).collect();
            for name in &stored {
                writer.apply(watcher::Event::Apply(pod(name)));
                upper_tx.send(Arc::new(pod(name))).await.unwrap();
                lower_tx.send(Arc::new(pod(name))).await.unwrap();
            }
            lead_tx.send(()).unwrap();
            let mut triggers = standby.await.unwrap();
            // A change or two may still sit in a queue when the Lease comes (the standby
            // stops reading then): they follow the replay, before the live ones.
            let live = tokio::spawn(async move {
                upper_tx.send(Arc::new(pod("live"))).await.unwrap();
                lower_tx.send(Arc::new(pod("live-below"))).await.unwrap();
            });
            let mut upper = Vec::new();
            while upper.last().map(String::as_str) != Some("live") {
                upper.push(triggers.upper.next().await.map(|p| name(&p)).unwrap());
            }
            let replayed: BTreeSet<String> = upper[..10].iter().cloned().collect();
            assert_eq!(replayed, stored, "the whole store first: {upper:?}");
            assert!(
                upper.len() <= 13,
                "then at most the queued changes: {upper:?}"
            );
            let mut below = Vec::new();
            while below.last().map(String::as_str) != Some("live-below") {
                below.push(triggers.lower.next().await.map(|p| name(&p)).unwrap());
            }
            assert!(
                below.len() <= 3,
                "at most the queued changes first: {below:?}"
            );
            live.await.unwrap();
        };
        tokio::time::timeout(Duration::from_secs(10), test)
            .await
            .unwrap();
    }
}
