//! The upper watches the members of a federated process share (`--members-namespace`):
//! one watch of each upper kind, however many members there are, where each member would
//! otherwise open its own. With one lower cluster and no `--members-namespace`, each
//! member watches for itself, as before (its pod watch is then the kubelet's, of its node
//! alone).
//!
//! - Upper Services, EndpointSlices, Endpoints, PersistentVolumeClaims and the
//!   PersistentVolumes virtual nodes reflected: one store that every member reads
//!   ([`SharedStore`]).
//! - Upper ConfigMaps and Secrets: one metadata index ([`SharedIndex`]).
//! - Upper pods: every pod bound to a node, watched once and handed by its node to the
//!   member of that node ([`PodRouter`]), which stores it compactly as it always has. A
//!   member of `node` or `label=<key>` granularity takes the pods of every one of its
//!   virtual nodes on one channel ([`PodRouter::subscribe_set`]). Pods of other nodes are
//!   dropped as they arrive.
//!
//! A member is woken by the objects touched on a broadcast that never waits for a slow
//! member: one that falls behind is handed every stored object again. Pods are routed on
//! unbounded channels instead (a member's pod watch never drops a change); a member that
//! joins or restarts once the watch has listed is handed a list of its own node's pods
//! (the router keeps none); only each start of a member of several virtual nodes makes
//! the pod watch list every bound pod again.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt::Debug;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, Stream, StreamExt};
use k8s_openapi::api::core::v1::{
    ConfigMap, Endpoints, PersistentVolume, PersistentVolumeClaim, Pod, Secret, Service,
};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams, ObjectList};
use kube::core::{NamespaceResourceScope, PartialObjectMeta};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource};
use prometheus_client::metrics::histogram::Histogram;
use serde::de::DeserializeOwned;
use tokio::sync::{Notify, broadcast, mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::cli::OptionalControllers;
use crate::controllers::stores::{MetaIndex, ObjectStream, Ready, Reflected, indexed};
use crate::node::groups::GroupNodes;
use crate::side::Side;
use crate::translate::meta::OWNER_NODE_LABEL;

/// Touched objects a broadcast holds for members that have not taken them yet; a member
/// further behind is handed every object again.
const BROADCAST: usize = 1024;

/// How long the pod watch waits after a member joins before it lists again, so that
/// members joining together cost one list.
const RELIST_SETTLE: Duration = Duration::from_millis(250);

/// The scope of the shared watches' `tensile_memory_bytes` (no member's node).
const SHARED_SCOPE: &str = "";

/// Pods a page of a node's own list holds (as the watch's lists: kube's default).
const NODE_LIST_PAGE: u32 = 500;

/// The upper watches every member shares.
pub struct UpperWatches {
    /// Upper pods bound to any node, by node.
    pub pods: Arc<PodRouter>,
    /// Upper Services, EndpointSlices and Endpoints (with `ServiceControllers`).
    pub services: Option<ServiceStores>,
    /// Upper PersistentVolumeClaims (with `PVControllers`).
    pub claims: Option<SharedStore<PersistentVolumeClaim>>,
    /// Upper PersistentVolumes reflected by any virtual node (with `PVControllers`): each
    /// member acts only on those its node reflected.
    pub volumes: Option<SharedStore<PersistentVolume>>,
    /// Upper ConfigMaps, metadata only.
    pub config_maps: SharedIndex<ConfigMap>,
    /// Upper Secrets, metadata only.
    pub secrets: SharedIndex<Secret>,
    /// Every virtual node's cordon.
    pub cordons: Arc<crate::node::Cordons>,
}

/// The upper stores the Service controller reads.
pub struct ServiceStores {
    /// Services.
    pub services: SharedStore<Service>,
    /// EndpointSlices.
    pub slices: SharedStore<EndpointSlice>,
    /// Endpoints.
    pub endpoints: SharedStore<Endpoints>,
}

impl UpperWatches {
    /// The watches over `upper` (in `namespace`, unless empty) that the `optional`
    /// controllers need, and the future that drives them until `shutdown`.
    /// The pod watch's handling of each event is recorded in `metrics`.
    pub fn new(
        upper: &Client,
        namespace: &str,
        optional: &OptionalControllers,
        metrics: &crate::metrics::Metrics,
        shutdown: CancellationToken,
    ) -> (Arc<Self>, BoxFuture<'static, ()>) {
        let mut pumps: Vec<BoxFuture<'static, ()>> = Vec::new();
        let node_pods: Api<Pod> = scoped(upper, namespace);
        let lister: NodeLister = Arc::new(move |node| {
            let api = node_pods.clone();
            async move {
                let bound = ListParams::default()
                    .fields(&format!("spec.nodeName={node}"))
                    .limit(NODE_LIST_PAGE);
                // Pages of one snapshot: the first page's resource version is the list's.
                let mut list = api.list(&bound).await?;
                while let Some(next) = list.metadata.continue_.take().filter(|c| !c.is_empty()) {
                    let page = api.list(&bound.clone().continue_token(&next)).await?;
                    list.items.extend(page.items);
                    list.metadata.continue_ = page.metadata.continue_;
                }
                Ok(list)
            }
            .boxed()
        });
        let pods = Arc::new(PodRouter {
            handled: metrics.upper_pod_watch(),
            ..PodRouter::new(lister)
        });
        let router = Arc::downgrade(&pods);
        metrics.measure_memory(SHARED_SCOPE, "upper pod router", move || {
            router.upgrade().map_or(0, |router| router.heap_bytes())
        });
        pumps.push(
            pods.clone()
                .pump(scoped(upper, namespace), shutdown.clone())
                .boxed(),
        );
        let services = optional.services.then(|| ServiceStores {
            services: shared_store(upper, namespace, &mut pumps),
            slices: shared_store(upper, namespace, &mut pumps),
            endpoints: shared_store(upper, namespace, &mut pumps),
        });
        let claims = optional
            .volumes
            .then(|| shared_store(upper, namespace, &mut pumps));
        let volumes = optional.volumes.then(|| {
            let reflections = watcher::Config::default().labels(OWNER_NODE_LABEL);
            let (store, pump) = SharedStore::new(Api::all(upper.clone()), reflections);
            pumps.push(pump);
            store
        });
        let (config_maps, pump) = SharedIndex::new(scoped(upper, namespace));
        pumps.push(pump);
        let (secrets, pump) = SharedIndex::new(scoped(upper, namespace));
        pumps.push(pump);
        let cordons = Arc::new(crate::node::Cordons::default());
        pumps.push(
            cordons
                .clone()
                .watch(upper.clone(), shutdown.clone())
                .boxed(),
        );
        let watches = Arc::new(Self {
            cordons,
            pods,
            services,
            claims,
            volumes,
            config_maps,
            secrets,
        });
        let run = async move {
            tokio::select! {
                () = shutdown.cancelled() => {}
                _ = futures::future::join_all(pumps) => {}
            }
        };
        (watches, run.boxed())
    }
}

/// A [`SharedStore`] of the upper `K` in `namespace`; its pump joins `pumps`.
fn shared_store<K>(
    upper: &Client,
    namespace: &str,
    pumps: &mut Vec<BoxFuture<'static, ()>>,
) -> SharedStore<K>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Clone
        + Debug
        + DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let (store, pump) = SharedStore::new(scoped(upper, namespace), watcher::Config::default());
    pumps.push(pump);
    store
}

/// An upper API of `K` in `namespace`, or in every namespace when it is empty.
fn scoped<K>(upper: &Client, namespace: &str) -> Api<K>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>,
{
    if namespace.is_empty() {
        Api::all(upper.clone())
    } else {
        Api::namespaced(upper.clone(), namespace)
    }
}

/// An object a watch touched, as broadcast to the members.
#[derive(Clone, Debug)]
struct Touch<T> {
    object: T,
    /// The watch reported it deleted.
    deleted: bool,
}

/// The objects touched on `touches`, to one member: first, if the watch has listed
/// (`ready`), every object `replay` gives, as its own first list would have handed them;
/// then each touched object; after falling behind, every object again. `deleted`, if
/// given, is notified of every deletion.
fn subscription<T, R>(
    touches: &broadcast::Sender<Touch<T>>,
    ready: &Ready,
    replay: R,
    deleted: Option<Arc<Notify>>,
) -> BoxStream<'static, T>
where
    T: Clone + Send + 'static,
    R: Fn() -> Vec<T> + Send + Sync + 'static,
{
    let receiver = touches.subscribe();
    // Subscribed before the watch's first list ended: what it listed before now went by
    // unseen, so every object is handed over once it has.
    let (first, until_listed): (VecDeque<T>, Option<Ready>) = if ready.is_ready() {
        (replay().into(), None)
    } else {
        (VecDeque::new(), Some(ready.clone()))
    };
    futures::stream::unfold(
        (receiver, first, replay, deleted, until_listed),
        |(mut receiver, mut pending, replay, deleted, mut until_listed)| async move {
            loop {
                if let Some(object) = pending.pop_front() {
                    return Some((object, (receiver, pending, replay, deleted, until_listed)));
                }
                let received = match &until_listed {
                    Some(listed) => tokio::select! {
                        biased;
                        received = receiver.recv() => Err(received),
                        listed = listed.wait() => Ok(listed.is_ok()),
                    },
                    None => Err(receiver.recv().await),
                };
                let received = match received {
                    Ok(listed) => {
                        until_listed = None;
                        if listed {
                            pending.extend(replay());
                        }
                        continue;
                    }
                    Err(received) => received,
                };
                match received {
                    Ok(touch) => {
                        if touch.deleted
                            && let Some(deleted) = &deleted
                        {
                            deleted.notify_one();
                        }
                        return Some((
                            touch.object,
                            (receiver, pending, replay, deleted, until_listed),
                        ));
                    }
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        debug!(
                            missed,
                            "a member fell behind a shared upper watch: handing it every object again"
                        );
                        pending.extend(replay());
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        },
    )
    .boxed()
}

/// One upper watch of `K` whose store every member reads.
pub struct SharedStore<K: Resource<DynamicType = ()> + 'static> {
    store: Store<K>,
    ready: Ready,
    touches: broadcast::Sender<Touch<Arc<K>>>,
}

impl<K> SharedStore<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    /// The watch of `api` with `config`, and the future that drives it.
    fn new(api: Api<K>, config: watcher::Config) -> (Self, BoxFuture<'static, ()>) {
        let (store, writer) = reflector::store();
        let (ready_tx, ready_rx) = watch::channel(false);
        let (touches, _) = broadcast::channel(BROADCAST);
        let sender = touches.clone();
        let watch = reflector::reflector(writer, watcher::watcher(api, config)).default_backoff();
        let pump = errors_logged_as_events(watch).for_each(move |event| {
            let touch = match event {
                watcher::Event::Apply(object) | watcher::Event::InitApply(object) => Touch {
                    object: Arc::new(object),
                    deleted: false,
                },
                watcher::Event::Delete(object) => Touch {
                    object: Arc::new(object),
                    deleted: true,
                },
                watcher::Event::InitDone => {
                    ready_tx.send_replace(true);
                    return futures::future::ready(());
                }
                watcher::Event::Init => return futures::future::ready(()),
            };
            // Fails only while no member listens.
            let _ = sender.send(touch);
            futures::future::ready(())
        });
        (
            Self {
                store,
                ready: Ready::listed(ready_rx),
                touches,
            },
            pump.boxed(),
        )
    }

    /// A member's view: the shared store, the objects touched (`deleted` notified of
    /// deletions), and whether the watch has listed.
    pub fn subscribe(&self, deleted: Option<Arc<Notify>>) -> Reflected<K> {
        let store = self.store.clone();
        let replay = move || store.state();
        let stream: ObjectStream<K> = subscription(&self.touches, &self.ready, replay, deleted)
            .map(|object| Ok(K::clone(&object)))
            .boxed();
        Reflected {
            store: self.store.clone(),
            stream,
            ready: self.ready.clone(),
        }
    }
}

/// `events` without its errors, each logged with the kind: the watch retries by itself.
fn errors_logged_as_events<K>(
    events: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
) -> BoxStream<'static, watcher::Event<K>>
where
    K: Resource<DynamicType = ()> + Send + 'static,
{
    let kind = K::kind(&()).into_owned();
    events
        .filter_map(move |event| {
            futures::future::ready(match event {
                Ok(event) => Some(event),
                Err(error) => {
                    warn!(cluster = %Side::Upper, %kind, %error, "watching; retrying with backoff");
                    None
                }
            })
        })
        .boxed()
}

/// One metadata-only upper watch of `K` whose index every member reads.
pub struct SharedIndex<K> {
    index: Arc<MetaIndex>,
    ready: Ready,
    touches: broadcast::Sender<Touch<PartialObjectMeta<K>>>,
}

impl<K> SharedIndex<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    /// The metadata-only watch of `api`, and the future that drives it.
    fn new(api: Api<PartialObjectMeta<K>>) -> (Self, BoxFuture<'static, ()>) {
        let index = Arc::new(MetaIndex::default());
        let (stream, ready) = indexed(api, Side::Upper, watcher::Config::default(), index.clone());
        let (touches, _) = broadcast::channel(BROADCAST);
        let sender = touches.clone();
        let pump = stream.for_each(move |touched| {
            if let Ok(object) = touched {
                let _ = sender.send(Touch {
                    object,
                    deleted: false,
                });
            }
            futures::future::ready(())
        });
        (
            Self {
                index,
                ready,
                touches,
            },
            pump.boxed(),
        )
    }

    /// A member's view: the shared index, the objects touched, and whether the watch has
    /// listed.
    pub fn subscribe(&self) -> (Arc<MetaIndex>, ObjectStream<PartialObjectMeta<K>>, Ready) {
        let index = self.index.clone();
        let replay = move || index.objects::<K>();
        let stream = subscription(&self.touches, &self.ready, replay, None)
            .map(Ok)
            .boxed();
        (self.index.clone(), stream, self.ready.clone())
    }
}

/// The one watch of upper pods bound to a node, routed by node to its member.
///
/// No pod is kept here: a member that subscribes once the watch has listed (a member
/// joined at run time, or one that restarts) is handed a list of its own node's pods
/// (`spec.nodeName=<node>`, a consistent read), the events of its node that arrive
/// meanwhile held and handed after it, but those the list already holds (a resource
/// version not newer than the list's). Neither a list of every bound pod (which would
/// hold back every member's pod events, then wake each member for each of its pods) nor a
/// copy of every pod (as much memory again as the members' own stores).
pub struct PodRouter {
    routing: Mutex<Routing>,
    /// Lists one node's pods.
    lister: NodeLister,
    /// Each watch event's handling: decoded (the watch stream's poll that yielded it) and
    /// routed (`tensile_upper_pod_watch_event_seconds`). One task does it for every member.
    handled: Histogram,
    /// A node needs a list.
    relist: Notify,
    /// Lists begun.
    lists: AtomicU64,
}

type PodSender = mpsc::UnboundedSender<watcher::Event<Pod>>;

/// Lists the pods bound to one node, a consistent read.
pub type NodeLister =
    Arc<dyn Fn(String) -> BoxFuture<'static, Result<ObjectList<Pod>, kube::Error>> + Send + Sync>;

/// A member of `node` or `label=<key>` granularity: its virtual nodes (as its fleet adds
/// them) and its channel.
struct SetRoute {
    nodes: Arc<GroupNodes>,
    sender: PodSender,
}

impl SetRoute {
    /// Whether a pod bound to `node` is this member's.
    fn serves(&self, node: &str) -> bool {
        self.nodes.contains(node)
    }
}

/// A member whose node's own list is being read: the events of its node meanwhile.
struct Pending {
    sender: PodSender,
    held: Vec<watcher::Event<Pod>>,
    /// Which list is its (a later subscription of the node starts another).
    list: u64,
}

#[derive(Default)]
struct Routing {
    /// Node → the member's channel.
    routes: HashMap<String, PodSender>,
    /// Members waiting for their node's own list.
    pending: HashMap<String, Pending>,
    /// Members that subscribed during a list of every bound pod: their node's own list
    /// is read once it ends.
    waiting: HashMap<String, PodSender>,
    /// Members whose node's own list failed: served from the next list of every bound pod.
    unlisted: HashSet<String>,
    /// Node → the resource version of the own list its member was handed: an event of the
    /// node not newer (the watch, resuming after a break from where it was, replays what
    /// the list holds) is dropped, until the next list of every bound pod.
    floors: HashMap<String, u64>,
    /// Members of several virtual nodes, by member, that have had a list's start: each
    /// event of a pod bound to a node no member has by name is offered to them.
    sets: HashMap<String, SetRoute>,
    /// Members of several virtual nodes waiting for the next list's start (each (re)start
    /// of such a member costs a list).
    sets_waiting: HashMap<String, SetRoute>,
    /// Whether a list has begun since the router started.
    started: bool,
    /// Between a list's start and end.
    listing: bool,
    /// The last node list begun.
    node_lists: u64,
}

fn pod_node(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
}

/// A resource version as a number, as the API server's storage (etcd) writes them;
/// `None` for another form (then a node's own list cannot be joined to the watch).
fn numbered(version: Option<&str>) -> Option<u64> {
    version?.parse().ok()
}

/// The events of `held` newer than the list at `listed`; `None` if a resource version is
/// not a number.
fn newer_than(listed: u64, held: Vec<watcher::Event<Pod>>) -> Option<Vec<watcher::Event<Pod>>> {
    let mut newer = Vec::with_capacity(held.len());
    for event in held {
        let pod = match &event {
            watcher::Event::Apply(pod) | watcher::Event::Delete(pod) => pod,
            // Only changes are held.
            _ => continue,
        };
        if numbered(pod.metadata.resource_version.as_deref())? > listed {
            newer.push(event);
        }
    }
    Some(newer)
}

/// The events of `receiver` from the first list's start on. Until a list begins, what
/// arrives is a list's tail or changes with no list before them: the member's store would
/// not know what the list left out.
fn from_a_list_on(
    receiver: mpsc::UnboundedReceiver<watcher::Event<Pod>>,
) -> BoxStream<'static, Result<watcher::Event<Pod>, watcher::Error>> {
    futures::stream::unfold(
        (receiver, false),
        |(mut receiver, mut listing)| async move {
            loop {
                let event = receiver.recv().await?;
                listing |= matches!(event, watcher::Event::Init);
                if listing {
                    return Some((Ok(event), (receiver, listing)));
                }
            }
        },
    )
    .boxed()
}

/// Hands `member` `pods` as a list, then `changes`; whether it still listens.
fn hand_list(member: &PodSender, pods: Vec<Pod>, changes: Vec<watcher::Event<Pod>>) -> bool {
    member.send(watcher::Event::Init).is_ok()
        && pods
            .into_iter()
            .all(|pod| member.send(watcher::Event::InitApply(pod)).is_ok())
        && member.send(watcher::Event::InitDone).is_ok()
        && changes.into_iter().all(|event| member.send(event).is_ok())
}

impl Default for PodRouter {
    /// A router whose node lists fail (each member is then served from the next list of
    /// every bound pod).
    fn default() -> Self {
        Self::new(Arc::new(|node| {
            async move {
                Err(kube::Error::Service(
                    format!("no lister for the pods of {node}").into(),
                ))
            }
            .boxed()
        }))
    }
}

impl PodRouter {
    /// A router that lists a node's pods with `lister`.
    pub fn new(lister: NodeLister) -> Self {
        Self {
            routing: Mutex::default(),
            lister,
            handled: crate::metrics::wait_histogram(),
            relist: Notify::default(),
            lists: AtomicU64::default(),
        }
    }

    /// The pod watch events of `node`, as a watch of `spec.nodeName=<node>` would have
    /// them: a complete list first, then every change. Before the watch's first list, from
    /// that list on; during a list, its node's own list once that one ends; after, its
    /// node's own list at once. A later subscription of the same node replaces this one.
    pub fn subscribe(
        self: &Arc<Self>,
        node: &str,
    ) -> BoxStream<'static, Result<watcher::Event<Pod>, watcher::Error>> {
        let (sender, receiver) = mpsc::unbounded_channel();
        let mut routing = self.routing.lock().unwrap_or_else(PoisonError::into_inner);
        routing.routes.remove(node);
        routing.waiting.remove(node);
        routing.pending.remove(node);
        routing.unlisted.remove(node);
        routing.floors.remove(node);
        if !routing.started {
            routing.routes.insert(node.to_owned(), sender);
        } else if routing.listing {
            routing.waiting.insert(node.to_owned(), sender);
        } else {
            self.list_node(&mut routing, node.to_owned(), sender);
        }
        drop(routing);
        from_a_list_on(receiver)
    }

    /// Holds `node`'s events for `sender` while its own list is read, then hands both
    /// ([`PodRouter::listed`]).
    fn list_node(self: &Arc<Self>, routing: &mut Routing, node: String, sender: PodSender) {
        routing.node_lists += 1;
        let list = routing.node_lists;
        routing.pending.insert(
            node.clone(),
            Pending {
                sender,
                held: Vec::new(),
                list,
            },
        );
        let listing = (self.lister)(node.clone());
        let router = Arc::downgrade(self);
        tokio::spawn(async move {
            let listed = listing.await;
            if let Some(router) = router.upgrade() {
                router.listed(&node, list, listed);
            }
        });
    }

    /// Hands the member of `node` its own list `list` (unless a later subscription or a
    /// list of every bound pod came first) and the newer events held meanwhile; if the
    /// list failed, or cannot be joined to the watch, serves it from the next list of
    /// every bound pod.
    fn listed(&self, node: &str, list: u64, listed: Result<ObjectList<Pod>, kube::Error>) {
        let mut routing = self.routing.lock().unwrap_or_else(PoisonError::into_inner);
        if routing.pending.get(node).is_none_or(|p| p.list != list) {
            return;
        }
        let Some(Pending { sender, held, .. }) = routing.pending.remove(node) else {
            return;
        };
        let joined = match listed {
            Ok(listed) => numbered(listed.metadata.resource_version.as_deref())
                .and_then(|version| Some((version, newer_than(version, held)?)))
                .map(|(version, changes)| (version, listed.items, changes))
                .ok_or_else(|| "a resource version that is not a number".to_owned()),
            Err(error) => Err(error.to_string()),
        };
        match joined {
            Ok((version, pods, changes)) => {
                debug!(
                    node,
                    pods = pods.len(),
                    changes = changes.len(),
                    "handed the node's own list"
                );
                if hand_list(&sender, pods, changes) {
                    routing.routes.insert(node.to_owned(), sender);
                    routing.floors.insert(node.to_owned(), version);
                }
            }
            Err(error) => {
                warn!(node, %error, "upper pods of the node not listed; from the next list of every bound pod");
                routing.routes.insert(node.to_owned(), sender);
                routing.unlisted.insert(node.to_owned());
                drop(routing);
                self.relist.notify_one();
            }
        }
    }

    /// The pod watch events of every node in `nodes`, to the member `member` of `node` or
    /// `label=<key>` granularity, as one watch would have them: a list of the pods bound to
    /// any of them (from the next list of every bound pod, which this asks for), then
    /// every change. A later subscription of the same member replaces this one.
    ///
    /// The subscription begins when the stream is first polled, so that the member has
    /// put the virtual nodes it knows into `nodes` by then (its pod watch is polled once
    /// its groups are known): the list it is handed holds their pods.
    ///
    /// After that list, a pod is the member's when `nodes` holds its node at the time of
    /// the event. A node that joins `nodes` later (a group that appears below) is
    /// inserted by the member's fleet before its Node is registered
    /// (`member::fleet::Fleet::start`), and the upper scheduler binds pods only to a
    /// Node that exists, so every pod it binds there arrives after the name is in `nodes`
    /// and is routed. Only a pod created already bound to that name (`spec.nodeName` set
    /// by hand) before its Node existed is missed until the next list, as the member's
    /// own watch would miss it (`controllers::pod_watch`).
    pub fn subscribe_set(
        self: &Arc<Self>,
        member: &str,
        nodes: Arc<GroupNodes>,
    ) -> BoxStream<'static, Result<watcher::Event<Pod>, watcher::Error>> {
        let router = self.clone();
        let member = member.to_owned();
        futures::stream::once(async move {
            let (sender, receiver) = mpsc::unbounded_channel();
            {
                let mut routing = router
                    .routing
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                routing.sets.remove(&member);
                routing
                    .sets_waiting
                    .insert(member, SetRoute { nodes, sender });
            }
            router.relist.notify_one();
            from_a_list_on(receiver)
        })
        .flatten()
        .boxed()
    }

    /// The heap bytes it holds for members (events held while a node is listed): for
    /// `tensile_memory_bytes`.
    pub fn heap_bytes(&self) -> usize {
        let routing = self.routing.lock().unwrap_or_else(PoisonError::into_inner);
        routing
            .pending
            .values()
            .map(|p| p.held.len() * size_of::<watcher::Event<Pod>>())
            .sum()
    }

    /// How many lists of every bound pod began.
    pub fn lists(&self) -> u64 {
        self.lists.load(Ordering::Relaxed)
    }

    /// Whether a member waits for a list of every bound pod.
    fn needs_list(&self) -> bool {
        let routing = self.routing.lock().unwrap_or_else(PoisonError::into_inner);
        !routing.sets_waiting.is_empty() || !routing.unlisted.is_empty()
    }

    /// Whether a list is under way.
    fn listing(&self) -> bool {
        self.routing
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .listing
    }

    /// Hands `event` to its pod's node's member (held for it while its node is listed;
    /// or to the members of several nodes that have it, if no member has it by name), or,
    /// for a list's start and end, to every member. A member gone is forgotten.
    fn route(self: &Arc<Self>, event: watcher::Event<Pod>) {
        let mut routing = self.routing.lock().unwrap_or_else(PoisonError::into_inner);
        let routing = &mut *routing;
        let node = match &event {
            watcher::Event::Init => {
                self.lists.fetch_add(1, Ordering::Relaxed);
                routing.started = true;
                routing.listing = true;
                routing.unlisted.clear();
                routing.floors.clear();
                // This list serves the members waiting for their own: theirs is dropped.
                for (node, pending) in routing.pending.drain() {
                    routing.routes.insert(node, pending.sender);
                }
                let waited = std::mem::take(&mut routing.waiting);
                routing.routes.extend(waited);
                routing
                    .routes
                    .retain(|_, member| member.send(watcher::Event::Init).is_ok());
                let waited = std::mem::take(&mut routing.sets_waiting);
                routing.sets.extend(waited);
                routing
                    .sets
                    .retain(|_, set| set.sender.send(watcher::Event::Init).is_ok());
                return;
            }
            watcher::Event::InitDone => {
                routing.listing = false;
                routing
                    .routes
                    .retain(|_, member| member.send(watcher::Event::InitDone).is_ok());
                routing
                    .sets
                    .retain(|_, set| set.sender.send(watcher::Event::InitDone).is_ok());
                for (node, member) in std::mem::take(&mut routing.waiting) {
                    self.list_node(routing, node, member);
                }
                return;
            }
            watcher::Event::InitApply(pod)
            | watcher::Event::Apply(pod)
            | watcher::Event::Delete(pod) => pod_node(pod).map(str::to_owned),
        };
        let Some(node) = node else {
            return;
        };
        if let Some(member) = routing.routes.get(&node) {
            if let (Some(floor), watcher::Event::Apply(pod) | watcher::Event::Delete(pod)) =
                (routing.floors.get(&node), &event)
                && numbered(pod.metadata.resource_version.as_deref()).is_some_and(|v| v <= *floor)
            {
                return;
            }
            if member.send(event).is_err() {
                routing.routes.remove(&node);
            }
            return;
        }
        if let Some(pending) = routing.pending.get_mut(&node) {
            if pending.sender.is_closed() {
                routing.pending.remove(&node);
            } else if !matches!(event, watcher::Event::InitApply(_)) {
                pending.held.push(event);
            }
            return;
        }
        routing
            .sets
            .retain(|_, set| !set.serves(&node) || set.sender.send(event.clone()).is_ok());
    }

    /// Watches the pods of `api` bound to a node until `shutdown`, listing again (after
    /// [`RELIST_SETTLE`], and after a list under way) when a node no list covers joins.
    async fn pump(self: Arc<Self>, api: Api<Pod>, shutdown: CancellationToken) {
        let bound = watcher::Config::default().fields("spec.nodeName!=");
        loop {
            let watch = watcher::watcher(api.clone(), bound.clone()).default_backoff();
            let mut watched = errors_logged_as_events(watch);
            // Each event with the time its poll took (decoding it).
            let mut events = futures::stream::poll_fn(move |cx| {
                let polled = Instant::now();
                watched
                    .poll_next_unpin(cx)
                    .map(|event| event.map(|event| (event, polled.elapsed())))
            });
            let mut wanted = false;
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = self.relist.notified() => {
                        if self.listing() {
                            wanted = true;
                        } else if self.needs_list() {
                            tokio::time::sleep(RELIST_SETTLE).await;
                            break;
                        }
                    }
                    event = events.next() => match event {
                        Some((event, decoded)) => {
                            let listed = matches!(event, watcher::Event::InitDone);
                            let routing = Instant::now();
                            self.route(event);
                            self.handled
                                .observe((decoded + routing.elapsed()).as_secs_f64());
                            if listed && std::mem::take(&mut wanted) && self.needs_list() {
                                tokio::time::sleep(RELIST_SETTLE).await;
                                break;
                            }
                        }
                        None => return,
                    },
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, node: &str) -> Pod {
        let mut pod = Pod::default();
        pod.metadata.name = Some(name.into());
        pod.metadata.namespace = Some("ns".into());
        pod.spec = Some(k8s_openapi::api::core::v1::PodSpec {
            node_name: Some(node.into()),
            ..Default::default()
        });
        pod
    }

    fn describe(event: &watcher::Event<Pod>) -> String {
        let name = |p: &Pod| p.metadata.name.clone().unwrap_or_default();
        match event {
            watcher::Event::Init => "init".into(),
            watcher::Event::InitApply(p) => format!("list {}", name(p)),
            watcher::Event::InitDone => "listed".into(),
            watcher::Event::Apply(p) => format!("apply {}", name(p)),
            watcher::Event::Delete(p) => format!("delete {}", name(p)),
        }
    }

    /// Each member gets its node's pods and every list's bounds, from its first list on;
    /// a replaced or dropped member is forgotten.
    #[tokio::test]
    async fn pods_are_routed_by_node_from_the_first_list_on() {
        let router = Arc::new(PodRouter::default());
        let a = router.subscribe("vk-a");
        let b = router.subscribe("vk-b");
        router.route(watcher::Event::Apply(pod("early", "vk-a")));
        router.route(watcher::Event::InitApply(pod("tail", "vk-a")));
        router.route(watcher::Event::InitDone);
        router.route(watcher::Event::Init);
        for (name, node) in [("a1", "vk-a"), ("b1", "vk-b"), ("real", "node-1")] {
            router.route(watcher::Event::InitApply(pod(name, node)));
        }
        router.route(watcher::Event::InitDone);
        router.route(watcher::Event::Apply(pod("a2", "vk-a")));
        router.route(watcher::Event::Delete(pod("b1", "vk-b")));
        drop(router.subscribe("vk-a"));
        router.route(watcher::Event::Apply(pod("a3", "vk-a")));
        assert!(
            !router.routing.lock().unwrap().routes.contains_key("vk-a"),
            "a member gone is forgotten"
        );
        drop(router);
        let seen = |stream: BoxStream<'static, Result<watcher::Event<Pod>, watcher::Error>>| async move {
            stream
                .map(|e| describe(&e.unwrap()))
                .collect::<Vec<_>>()
                .await
        };
        assert_eq!(
            seen(a).await,
            ["init", "list a1", "listed", "apply a2"],
            "replaced by a later subscription, the first one ends"
        );
        assert_eq!(seen(b).await, ["init", "list b1", "listed", "delete b1"]);
    }

    /// The first items `stream` has ready now, described.
    fn ready_now(
        stream: &mut BoxStream<'static, Result<watcher::Event<Pod>, watcher::Error>>,
    ) -> Vec<String> {
        let mut seen = Vec::new();
        while let Some(Some(event)) = stream.next().now_or_never() {
            seen.push(describe(&event.unwrap()));
        }
        seen
    }

    fn pod_at(name: &str, node: &str, version: &str) -> Pod {
        let mut pod = pod(name, node);
        pod.metadata.resource_version = Some(version.into());
        pod
    }

    /// A router whose node lists answer `lists` (node → the list), each once the test
    /// lets one through `gate`.
    fn gated_router(
        lists: Vec<(&str, ObjectList<Pod>)>,
    ) -> (Arc<PodRouter>, Arc<tokio::sync::Semaphore>) {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let lists: Arc<Mutex<HashMap<String, ObjectList<Pod>>>> = Arc::new(Mutex::new(
            lists
                .into_iter()
                .map(|(node, list)| (node.to_owned(), list))
                .collect(),
        ));
        let opened = gate.clone();
        let lister: NodeLister = Arc::new(move |node| {
            let (gate, lists) = (opened.clone(), lists.clone());
            async move {
                gate.acquire().await.unwrap().forget();
                let list = lists.lock().unwrap().remove(&node);
                list.ok_or_else(|| kube::Error::Service(format!("no list for {node}").into()))
            }
            .boxed()
        });
        (Arc::new(PodRouter::new(lister)), gate)
    }

    fn list_at(version: &str, pods: Vec<Pod>) -> ObjectList<Pod> {
        ObjectList {
            types: Default::default(),
            metadata: kube::core::ListMeta {
                resource_version: Some(version.into()),
                ..Default::default()
            },
            items: pods,
        }
    }

    /// The next `n` events of `stream`, described (1 s at most for each).
    async fn next_events(
        stream: &mut BoxStream<'static, Result<watcher::Event<Pod>, watcher::Error>>,
        n: usize,
    ) -> Vec<String> {
        let mut seen = Vec::new();
        for _ in 0..n {
            match tokio::time::timeout(Duration::from_secs(1), stream.next()).await {
                Ok(Some(event)) => seen.push(describe(&event.unwrap())),
                _ => break,
            }
        }
        seen
    }

    /// A member that subscribes once the watch has listed (one that restarts, or joins) is
    /// handed its node's own list, then the changes of its node that came meanwhile and
    /// are newer than that list, then every change newer than it: no list of every bound
    /// pod (which would stall every other member's pod events), and no copy of every pod
    /// kept.
    #[tokio::test]
    async fn a_member_subscribing_after_the_list_is_handed_its_nodes_own_list() {
        use watcher::Event::{Apply, Delete, Init, InitApply, InitDone};
        let (router, gate) = gated_router(vec![
            ("vk-a", list_at("8", vec![pod_at("a2", "vk-a", "6")])),
            ("vk-c", list_at("12", vec![pod_at("c1", "vk-c", "11")])),
        ]);
        let mut a = router.subscribe("vk-a");
        let mut b = router.subscribe("vk-b");
        router.route(Init);
        for (name, node) in [("a1", "vk-a"), ("b1", "vk-b"), ("real", "node-1")] {
            router.route(InitApply(pod_at(name, node, "1")));
        }
        router.route(InitDone);
        router.route(Apply(pod_at("a2", "vk-a", "5")));
        assert_eq!(ready_now(&mut a), ["init", "list a1", "listed", "apply a2"]);
        assert_eq!(ready_now(&mut b), ["init", "list b1", "listed"]);
        let lists = router.lists();

        // Member A restarts: its node's changes are held while its list is read.
        drop(a);
        a = router.subscribe("vk-a");
        for event in [
            Apply(pod_at("a2", "vk-a", "6")),
            Delete(pod_at("a1", "vk-a", "7")),
            Apply(pod_at("b2", "vk-b", "8")),
            Apply(pod_at("a3", "vk-a", "9")),
        ] {
            router.route(event);
        }
        assert_eq!(ready_now(&mut a), Vec::<String>::new(), "held");
        assert_eq!(ready_now(&mut b), ["apply b2"], "B is served meanwhile");
        gate.add_permits(1);
        assert_eq!(
            next_events(&mut a, 4).await,
            ["init", "list a2", "listed", "apply a3"],
            "its list (at 8), then what is newer"
        );
        // The watch resumes after a break from where it was: what the list holds is
        // replayed, and dropped.
        router.route(Apply(pod_at("a2", "vk-a", "6")));
        router.route(Delete(pod_at("a1", "vk-a", "7")));
        router.route(Apply(pod_at("a4", "vk-a", "10")));
        assert_eq!(ready_now(&mut a), ["apply a4"]);

        // A node never had joins: its own list too.
        let mut c = router.subscribe("vk-c");
        router.route(Apply(pod_at("c2", "vk-c", "13")));
        gate.add_permits(1);
        assert_eq!(
            next_events(&mut c, 4).await,
            ["init", "list c1", "listed", "apply c2"]
        );
        assert_eq!(
            ready_now(&mut b),
            Vec::<String>::new(),
            "B is not disturbed"
        );
        assert_eq!(router.lists(), lists, "no list of every bound pod");
        assert!(!router.needs_list());
        assert_eq!(router.heap_bytes(), 0, "nothing held once handed");
    }

    /// A member whose node's own list fails, or cannot be joined to the watch (a resource
    /// version that is not a number), is served from the next list of every bound pod,
    /// which it asks for; one that subscribes during such a list gets its own list at its
    /// end, and a list of every bound pod that begins first serves one waiting for its own.
    #[tokio::test]
    async fn a_member_whose_list_fails_or_comes_late_is_served_by_the_next_list() {
        use watcher::Event::{Apply, Init, InitApply, InitDone};
        let (router, gate) = gated_router(vec![
            ("vk-b", list_at("not-a-number", vec![])),
            ("vk-c", list_at("30", vec![pod_at("c1", "vk-c", "21")])),
        ]);
        router.route(Init);
        router.route(InitDone);
        // No list for vk-a (an error), and vk-b's cannot be joined.
        let mut a = router.subscribe("vk-a");
        let mut b = router.subscribe("vk-b");
        gate.add_permits(2);
        wait_until(|| router.needs_list()).await;
        assert_eq!(ready_now(&mut a), Vec::<String>::new());
        assert_eq!(ready_now(&mut b), Vec::<String>::new());
        router.route(Init);
        router.route(InitApply(pod_at("a1", "vk-a", "20")));
        // vk-c subscribes during this list: its own list once it ends.
        let mut c = router.subscribe("vk-c");
        router.route(InitApply(pod_at("c1", "vk-c", "21")));
        router.route(InitApply(pod_at("b1", "vk-b", "22")));
        router.route(InitDone);
        assert!(!router.needs_list());
        assert_eq!(ready_now(&mut a), ["init", "list a1", "listed"]);
        assert_eq!(ready_now(&mut b), ["init", "list b1", "listed"]);
        assert_eq!(ready_now(&mut c), Vec::<String>::new());
        gate.add_permits(1);
        assert_eq!(next_events(&mut c, 3).await, ["init", "list c1", "listed"]);

        // D waits for its own list; the watch lists everything first: that serves it.
        let mut d = router.subscribe("vk-d");
        router.route(Apply(pod_at("d0", "vk-d", "31")));
        router.route(Init);
        router.route(InitApply(pod_at("d1", "vk-d", "32")));
        router.route(InitDone);
        assert_eq!(ready_now(&mut d), ["init", "list d1", "listed"]);
        gate.add_permits(1);
        tokio::task::yield_now().await;
        assert_eq!(
            ready_now(&mut d),
            Vec::<String>::new(),
            "its own list is dropped"
        );
    }

    /// Polls `done` (the router's tasks run meanwhile), 1 s at most.
    async fn wait_until(done: impl Fn() -> bool) {
        tokio::time::timeout(Duration::from_secs(1), async {
            while !done() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("in time");
    }

    /// One step of a router scene: a watch event routed, or a virtual node added to the
    /// set member's nodes (by its fleet, before it registers the Node).
    enum Step {
        Route(Box<watcher::Event<Pod>>),
        Add(&'static str),
    }

    fn route(event: watcher::Event<Pod>) -> Step {
        Step::Route(Box::new(event))
    }

    /// A member of several virtual nodes is handed, on one channel, one list covering all
    /// its nodes (from the next list of every bound pod on, none of an earlier list's
    /// tail), then the changes of each pod whose node its set holds at the time; a member
    /// by name beside it is served as before, and pods of other nodes go nowhere.
    #[tokio::test]
    async fn a_set_member_is_handed_every_node_of_its_set() {
        use watcher::Event::{Apply, Delete, Init, InitApply, InitDone};
        let router = Arc::new(PodRouter::default());
        let groups = Arc::new(GroupNodes::default());
        groups.insert("vk-z-a", None);
        let mut one = router.subscribe("vk-one");
        let mut set = router.subscribe_set("vk-z", groups.clone());
        // Subscribed on its first poll.
        assert_eq!(ready_now(&mut set), Vec::<String>::new());
        let steps: Vec<(Step, &[&str], &[&str])> = vec![
            // (step, then ready for the set member, for the member by name)
            (route(Apply(pod("early", "vk-z-a"))), &[], &[]),
            (route(InitApply(pod("tail", "vk-z-a"))), &[], &[]),
            (route(Init), &["init"], &["init"]),
            (route(InitApply(pod("a1", "vk-z-a"))), &["list a1"], &[]),
            (route(InitApply(pod("b0", "vk-z-b"))), &[], &[]),
            (route(InitApply(pod("o1", "vk-one"))), &[], &["list o1"]),
            (route(InitApply(pod("real", "node-1"))), &[], &[]),
            (route(InitDone), &["listed"], &["listed"]),
            (Step::Add("vk-z-b"), &[], &[]),
            (route(Apply(pod("b1", "vk-z-b"))), &["apply b1"], &[]),
            (route(Delete(pod("a1", "vk-z-a"))), &["delete a1"], &[]),
            (route(Apply(pod("o2", "vk-one"))), &[], &["apply o2"]),
            (route(Apply(pod("r2", "node-1"))), &[], &[]),
            // The watch's own relist: both are handed it.
            (route(Init), &["init"], &["init"]),
            (route(InitApply(pod("b1", "vk-z-b"))), &["list b1"], &[]),
            (route(InitApply(pod("o2", "vk-one"))), &[], &["list o2"]),
            (route(InitDone), &["listed"], &["listed"]),
        ];
        for (i, (step, for_set, for_one)) in steps.into_iter().enumerate() {
            match step {
                Step::Route(event) => router.route(*event),
                Step::Add(node) => groups.insert(node, None),
            }
            assert_eq!(ready_now(&mut set), for_set, "step {i}: the set member");
            assert_eq!(ready_now(&mut one), for_one, "step {i}: the member by name");
        }
        assert!(!router.needs_list());
    }

    /// A set member that starts again (replacing its subscription) ends the earlier one
    /// and waits for the next list, never handed the tail of a list under way; one gone is
    /// forgotten.
    #[tokio::test]
    async fn a_restarted_set_member_waits_for_the_next_list() {
        let router = Arc::new(PodRouter::default());
        let groups = Arc::new(GroupNodes::default());
        groups.insert("vk-z-a", None);
        let mut first = router.subscribe_set("vk-z", groups.clone());
        assert!(!router.needs_list(), "subscribed only once polled");
        assert_eq!(ready_now(&mut first), Vec::<String>::new());
        assert!(router.needs_list(), "a set member waits for a list");
        router.route(watcher::Event::Init);
        router.route(watcher::Event::InitApply(pod("a1", "vk-z-a")));
        router.route(watcher::Event::InitDone);
        assert_eq!(ready_now(&mut first), ["init", "list a1", "listed"]);
        let lists = router.lists();

        router.route(watcher::Event::Init);
        router.route(watcher::Event::InitApply(pod("a1", "vk-z-a")));
        let mut second = router.subscribe_set("vk-z", groups.clone());
        assert_eq!(ready_now(&mut second), Vec::<String>::new());
        assert_eq!(ready_now(&mut first), ["init", "list a1"]);
        assert_eq!(
            first.next().now_or_never().map(|e| e.is_none()),
            Some(true),
            "replaced, the first subscription ends"
        );
        router.route(watcher::Event::InitApply(pod("a2", "vk-z-a")));
        router.route(watcher::Event::InitDone);
        assert_eq!(
            ready_now(&mut second),
            Vec::<String>::new(),
            "no list's tail"
        );
        assert!(router.needs_list(), "it asks for a list");
        router.route(watcher::Event::Init);
        router.route(watcher::Event::InitApply(pod("a1", "vk-z-a")));
        router.route(watcher::Event::InitApply(pod("a2", "vk-z-a")));
        router.route(watcher::Event::InitDone);
        assert_eq!(
            ready_now(&mut second),
            ["init", "list a1", "list a2", "listed"]
        );
        assert_eq!(router.lists(), lists + 2);
        assert!(!router.needs_list());

        drop(second);
        router.route(watcher::Event::Apply(pod("a3", "vk-z-a")));
        let routing = router.routing.lock().unwrap();
        assert!(
            routing.sets.is_empty() && routing.sets_waiting.is_empty(),
            "a member gone is forgotten"
        );
    }

    /// A member that subscribes while the watch's first list is under way (part of it
    /// broadcast before it listened) is handed every object once the list has ended, not
    /// only at its next resync.
    #[tokio::test]
    async fn a_member_subscribed_during_the_first_list_is_handed_every_object() {
        let (touches, _) = broadcast::channel(8);
        let (ready_tx, ready_rx) = watch::channel(false);
        let ready = Ready::listed(ready_rx);
        let all = || vec!["x".to_owned(), "y".to_owned()];
        let touch = |name: &str| Touch {
            object: name.to_owned(),
            deleted: false,
        };
        // Listed before the member subscribed: it never sees this touch.
        let _ = touches.send(touch("x"));
        let mut during = subscription(&touches, &ready, all, None);
        touches.send(touch("y")).unwrap();
        ready_tx.send_replace(true);
        let mut seen = Vec::new();
        for _ in 0..3 {
            let next = tokio::time::timeout(Duration::from_secs(1), during.next()).await;
            seen.push(next.ok().flatten());
        }
        let every = ["y", "x", "y"].map(|n| Some(n.to_owned()));
        assert_eq!(seen, every, "the list's tail, then every object");
    }

    /// A member that falls behind the broadcast is handed every object again; one that
    /// joins a listed watch is handed every object first.
    #[tokio::test]
    async fn a_member_behind_or_late_is_handed_every_object() {
        let (touches, _) = broadcast::channel(2);
        let (ready_tx, ready_rx) = watch::channel(false);
        let ready = Ready::listed(ready_rx);
        let all = || vec!["x".to_owned(), "y".to_owned()];
        let deleted = Arc::new(Notify::new());
        let mut early = subscription(&touches, &ready, all, Some(deleted.clone()));
        for name in ["1", "2", "3"] {
            touches
                .send(Touch {
                    object: name.to_owned(),
                    deleted: name == "3",
                })
                .unwrap();
        }
        ready_tx.send_replace(true);
        let mut late = subscription(&touches, &ready, all, None);
        touches
            .send(Touch {
                object: "4".to_owned(),
                deleted: false,
            })
            .unwrap();
        drop(touches);
        let mut seen = Vec::new();
        while let Some(name) = early.next().await {
            seen.push(name);
        }
        assert_eq!(seen, ["x", "y", "3", "4"], "behind: every object, then on");
        tokio::time::timeout(Duration::from_secs(1), deleted.notified())
            .await
            .expect("the deletion was notified");
        let mut seen = Vec::new();
        while let Some(name) = late.next().await {
            seen.push(name);
        }
        assert_eq!(seen, ["x", "y", "4"]);
    }
}
