//! What virtual-node did, on prometheus-client, served as text on `--metrics-addr`, with
//! `/healthz` and `/readyz`.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::side::Side;

/// Upper bounds of the latency histograms' buckets, in seconds.
pub const LATENCY_BUCKETS: [f64; 11] =
    [0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0];

/// A histogram over [`LATENCY_BUCKETS`].
pub fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// Upper bounds of the wait histograms' buckets, in seconds: from a timer tick to a burst
/// that keeps a pod waiting most of a minute.
pub const WAIT_BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
];

/// A histogram over [`WAIT_BUCKETS`].
pub fn wait_histogram() -> Histogram {
    Histogram::new(WAIT_BUCKETS)
}

/// A family of histograms over [`WAIT_BUCKETS`].
type WaitFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn wait_family<L: Clone + std::hash::Hash + Eq>() -> WaitFamily<L> {
    Family::new_with_constructor(wait_histogram)
}

/// How often the runtime probe wakes ([`Metrics::probe_runtime`]).
const RUNTIME_PROBE: Duration = Duration::from_millis(50);

/// The verbs counted, from the HTTP method (a GET with `watch=` is a watch).
pub const VERBS: [&str; 6] = ["get", "watch", "create", "update", "patch", "delete"];

/// The verb of `request`, one of [`VERBS`]; `None` for methods not counted.
pub fn verb<B>(request: &http::Request<B>) -> Option<&'static str> {
    let watch = request
        .uri()
        .query()
        .is_some_and(|q| q.split('&').any(|p| p.starts_with("watch=")));
    let verb = match *request.method() {
        http::Method::GET if watch => "watch",
        http::Method::GET => "get",
        http::Method::POST => "create",
        http::Method::PUT => "update",
        http::Method::PATCH => "patch",
        http::Method::DELETE => "delete",
        _ => return None,
    };
    Some(verb)
}

/// Labels of the API request counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// `upper` or `lower`.
    pub cluster: &'static str,
    /// One of [`VERBS`].
    pub verb: &'static str,
}

/// Labels of the API response counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResponseLabels {
    /// `upper` or `lower`.
    pub cluster: &'static str,
    /// One of [`VERBS`].
    pub verb: &'static str,
    /// The HTTP status code, or `error` when no answer came (connection, timeout).
    pub code: String,
}

/// Label of the reconcile error counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// The error's kind (`Error::metric_label`).
    pub error: &'static str,
}

/// Label of the API wait histograms.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClusterLabels {
    /// `upper` or `lower` (every member's lower cluster together).
    pub cluster: &'static str,
}

/// Label of the work queue wait histogram.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    /// `pod queue`, `status queue` (every member's together).
    pub queue: &'static str,
}

/// Where a request to one cluster waits ([`Metrics::api_waits`]).
#[derive(Clone, Debug)]
pub struct ApiWaits {
    /// Sent to answered (response headers).
    pub request: Histogram,
    /// Held by the client's rate limiter before it is sent.
    pub throttle: Histogram,
    /// A new connection: TCP and TLS.
    pub connect: Histogram,
}

/// Label of the reconcile duration histogram.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    /// `pod`, `status`, `config`, `secret`, `service`, `volume`.
    pub controller: &'static str,
}

/// Label of the mirrored objects gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// `pods`, `configmaps`, `secrets`, `services`.
    pub kind: &'static str,
}

/// Label of the leader gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LeaseLabels {
    /// `namespace/name` of the leader-election Lease; empty without `--leader-elect`.
    pub lease: String,
}

/// Label of the memory gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OwnerLabels {
    /// e.g. `upper pods` (a store), `pod queue`.
    pub owner: &'static str,
}

/// Label of the allocator gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatLabels {
    /// The allocator's statistic: `allocated`, `active`, `resident`, ... (see
    /// [`crate::allocator::jemalloc_stats`]).
    pub stat: &'static str,
}

/// Reads the allocator's statistics (name, bytes) at scrape time.
pub type AllocatorStats = fn() -> Vec<(&'static str, u64)>;

/// Label of the member gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabels {
    /// The member's virtual node.
    pub node: String,
}

/// A gauge's value, read at scrape time (a store's size, its memory).
type ReadAtScrape = Box<dyn Fn() -> usize + Send + Sync>;

/// API requests sent, by cluster and verb (to tell what each mirrored pod costs), and
/// their answers by status code.
#[derive(Debug, Default)]
pub struct ApiRequests {
    sent: Family<RequestLabels, Counter>,
    answered: Family<ResponseLabels, Counter>,
}

impl ApiRequests {
    /// Counts one request to `side`.
    pub fn record<B>(&self, side: Side, request: &http::Request<B>) {
        if let Some(verb) = verb(request) {
            self.sent(side, verb);
        }
    }

    /// Counts one request of `verb` to `side`.
    pub fn sent(&self, side: Side, verb: &'static str) {
        self.sent.get_or_create(&request_labels(side, verb)).inc();
    }

    /// Counts the answer to a request of `verb` to `side`: its status, or `None` when
    /// none came.
    pub fn answered(&self, side: Side, verb: &'static str, status: Option<http::StatusCode>) {
        let code = status.map_or_else(|| "error".to_owned(), |s| s.as_u16().to_string());
        let labels = ResponseLabels {
            cluster: side_label(side),
            verb,
            code,
        };
        self.answered.get_or_create(&labels).inc();
    }

    /// Requests of `verb` sent to `side`.
    pub fn get(&self, side: Side, verb: &'static str) -> u64 {
        self.sent
            .get(&request_labels(side, verb))
            .map_or(0, |c| c.get())
    }
}

fn side_label(side: Side) -> &'static str {
    match side {
        Side::Upper => "upper",
        Side::Lower => "lower",
    }
}

fn request_labels(side: Side, verb: &'static str) -> RequestLabels {
    RequestLabels {
        cluster: side_label(side),
        verb,
    }
}

/// Which gauge a scrape source sets.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum ScrapeTarget {
    /// `tensile_mirrored_objects{kind}`.
    Mirrored(&'static str),
    /// `tensile_memory_bytes{owner}`.
    Memory(&'static str),
}

/// Gauges set at scrape time, each to the sum of what its sources read: one source per
/// gauge and member (its `scope`, the node's name). A member that registers again (it was
/// restarted) replaces its sources, never adds to them; they are forgotten when a run of
/// the member ends and when it leaves, so a restarted member's old stores are freed. A
/// gauge whose sources are all gone reads 0.
#[derive(Default)]
struct ScrapeSources(Mutex<SourcesInner>);

#[derive(Default)]
struct SourcesInner {
    sources: Vec<(ScrapeTarget, String, ReadAtScrape)>,
    targets: HashSet<ScrapeTarget>,
}

impl ScrapeSources {
    fn add(&self, target: ScrapeTarget, scope: &str, read: ReadAtScrape) {
        let mut inner = self.inner();
        inner.targets.insert(target);
        let replaced = inner
            .sources
            .iter_mut()
            .find(|(t, s, _)| *t == target && s == scope);
        // The closure replaced (and what it holds: a store, a queue) is dropped with it.
        let old = match replaced {
            Some(source) => Some(std::mem::replace(&mut source.2, read)),
            None => {
                inner.sources.push((target, scope.to_owned(), read));
                None
            }
        };
        drop(inner);
        drop(old);
    }

    fn forget(&self, scope: &str) {
        let mut inner = self.inner();
        let (gone, kept) = std::mem::take(&mut inner.sources)
            .into_iter()
            .partition(|(_, s, _)| s == scope);
        inner.sources = kept;
        drop(inner);
        // Dropped outside the lock: what a closure holds may take a while to free.
        drop::<Vec<_>>(gone);
    }

    /// Every target's sum now.
    fn sums(&self) -> HashMap<ScrapeTarget, usize> {
        let inner = self.inner();
        let mut sums: HashMap<ScrapeTarget, usize> =
            inner.targets.iter().map(|t| (*t, 0)).collect();
        for (target, _, read) in &inner.sources {
            *sums.entry(*target).or_default() += read();
        }
        sums
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, SourcesInner> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl std::fmt::Debug for ScrapeSources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} gauges read at scrape", self.inner().sources.len())
    }
}

/// The kinds of pod reconcile error (`tensile_pod_reconcile_errors_total{error}`), each
/// exported at zero from the start.
pub const RECONCILE_ERROR_LABELS: [&str; 5] = [
    "api",
    "conflict",
    "missing_dependency",
    "translate",
    "shutdown",
];

/// Everything counted.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// API requests sent and answered.
    pub api_requests: ApiRequests,
    /// Pod reconciles run.
    pub reconciles: Counter,
    /// Pod reconciles that failed (every kind of error; see [`Metrics::reconcile_failed`]).
    pub errors: Counter,
    /// Pod reconciles that failed, by the error's kind (`Error::metric_label`).
    reconcile_errors: Family<ErrorLabels, Counter>,
    /// How long each reconcile took, by controller.
    reconcile_seconds: Family<ControllerLabels, Histogram, fn() -> Histogram>,
    /// Upper pod status writes.
    pub status_writes: Counter,
    /// How long the upper API server took to answer each status write.
    pub status_write_seconds: Histogram,
    /// From the status reflector's reconcile start (the lower change taken from its
    /// queue) to the upper status write answered.
    pub status_reflection_seconds: Histogram,
    /// Objects mirrored now, by kind (set at scrape time).
    mirrored: Family<KindLabels, Gauge>,
    /// Heap bytes held, by owner (set at scrape time).
    memory: Family<OwnerLabels, Gauge>,
    /// What the gauges set at scrape time read.
    read_at_scrape: ScrapeSources,
    /// The allocator's statistics, by statistic (set at scrape time).
    allocator: Family<StatLabels, Gauge>,
    /// What reads them ([`Metrics::read_allocator`]).
    allocator_stats: OnceLock<AllocatorStats>,
    /// Lower pods created.
    pub lower_creates: Counter,
    /// Lower pods updated.
    pub lower_updates: Counter,
    /// Orphaned lower pods deleted.
    pub orphans_deleted: Counter,
    /// Rewrites of lower copies put off by their write budget (a lower controller keeps
    /// editing them).
    pub copy_rewrites_deferred: Counter,
    /// Lower events not reflected up because the publish queue was full.
    pub events_dropped: Counter,
    /// Orphan collection rounds completed.
    pub gc_rounds: Counter,
    /// Whether every watch has synced and the node is registered.
    pub ready: AtomicBool,
    /// 1 while this process may write (leads), by Lease.
    leader: Family<LeaseLabels, Gauge>,
    /// 1 while a member runs, 0 while it fails or restarts, by node.
    member_up: Family<NodeLabels, Gauge>,
    /// API requests: sent to answered, by cluster.
    api_request_seconds: WaitFamily<ClusterLabels>,
    /// API requests: held by the rate limiter, by cluster.
    api_throttle_seconds: WaitFamily<ClusterLabels>,
    /// New API server connections (TCP and TLS), by cluster.
    api_connect_seconds: WaitFamily<ClusterLabels>,
    /// Work queue keys: ready for a worker to taken by one, by queue.
    queue_wait_seconds: WaitFamily<QueueLabels>,
    /// How late the runtime wakes a timer task ([`Metrics::probe_runtime`]).
    runtime_lag_seconds: Histogram,
    /// The shared upper pod watch: each event decoded and routed to its member.
    upper_pod_watch_seconds: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tensile");
        let api_requests = ApiRequests::default();
        let reconcile_errors = Family::<ErrorLabels, Counter>::default();
        let reconcile_seconds =
            Family::<ControllerLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                latency_histogram,
            );
        let mirrored = Family::<KindLabels, Gauge>::default();
        let memory = Family::<OwnerLabels, Gauge>::default();
        let allocator = Family::<StatLabels, Gauge>::default();
        let status_write_seconds = latency_histogram();
        let status_reflection_seconds = latency_histogram();
        let counters: [(&str, &str, Counter); 8] = [
            ("pod_reconciles", "Pod reconciles run", Counter::default()),
            (
                "upper_status_writes",
                "Upper pod status writes",
                Counter::default(),
            ),
            (
                "lower_pod_creates",
                "Lower pods created",
                Counter::default(),
            ),
            (
                "lower_pod_updates",
                "Lower pods updated",
                Counter::default(),
            ),
            (
                "orphans_deleted",
                "Orphaned lower pods deleted",
                Counter::default(),
            ),
            (
                "lower_copy_rewrites_deferred",
                "Rewrites of lower copies put off because something below keeps editing them",
                Counter::default(),
            ),
            (
                "upper_events_dropped",
                "Lower events not reflected up because the publish queue was full",
                Counter::default(),
            ),
            (
                "gc_rounds",
                "Orphan collection rounds completed",
                Counter::default(),
            ),
        ];
        registry.register(
            "pod_reconcile_errors",
            "Pod reconciles that failed, by kind of error",
            reconcile_errors.clone(),
        );
        for (name, help, counter) in &counters {
            registry.register(*name, *help, counter.clone());
        }
        registry.register(
            "upper_status_write_seconds",
            "How long the upper API server took to answer a pod status write",
            status_write_seconds.clone(),
        );
        registry.register(
            "status_reflection_seconds",
            "From the status reflector taking a lower pod change to the upper status write answered",
            status_reflection_seconds.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "How long a reconcile took, by controller",
            reconcile_seconds.clone(),
        );
        registry.register(
            "memory_bytes",
            "Heap bytes held, by owner (pod stores, work queues), estimated from their sizes at scrape",
            memory.clone(),
        );
        registry.register(
            "allocator_bytes",
            "The heap as the allocator counts it, by statistic (allocated: live; active: in pages holding live data; resident)",
            allocator.clone(),
        );
        registry.register(
            "mirrored_objects",
            "Objects mirrored into the lower cluster now, by kind",
            mirrored.clone(),
        );
        let leader = Family::<LeaseLabels, Gauge>::default();
        registry.register(
            "leader",
            "1 while this process leads and may write, by leader-election Lease (empty: --leader-elect off)",
            leader.clone(),
        );
        let member_up = Family::<NodeLabels, Gauge>::default();
        registry.register(
            "member_up",
            "1 while the member (one lower cluster and its virtual node) runs, 0 while it fails or restarts, by node",
            member_up.clone(),
        );
        registry.register(
            "api_requests",
            "API requests sent",
            api_requests.sent.clone(),
        );
        registry.register(
            "api_responses",
            "API answers received, by status code (`error`: none came)",
            api_requests.answered.clone(),
        );
        let (api_request_seconds, api_throttle_seconds, api_connect_seconds) =
            (wait_family(), wait_family(), wait_family());
        let queue_wait_seconds: WaitFamily<QueueLabels> = wait_family();
        let runtime_lag_seconds = wait_histogram();
        let upper_pod_watch_seconds = wait_histogram();
        registry.register(
            "upper_pod_watch_event_seconds",
            "The upper pod watch members share: each event decoded and routed to its member, on one task",
            upper_pod_watch_seconds.clone(),
        );
        registry.register(
            "api_request_seconds",
            "API requests: sent to answered (response headers), by cluster",
            api_request_seconds.clone(),
        );
        registry.register(
            "api_throttle_seconds",
            "API requests: held by the client's rate limiter (--kube-api-qps, --client-qps) before being sent, by cluster",
            api_throttle_seconds.clone(),
        );
        registry.register(
            "api_connect_seconds",
            "New connections to an API server (TCP and TLS), by cluster",
            api_connect_seconds.clone(),
        );
        registry.register(
            "queue_wait_seconds",
            "Work queue keys: ready for a worker to taken by one, by queue (every member's together)",
            queue_wait_seconds.clone(),
        );
        registry.register(
            "runtime_lag_seconds",
            "How late the async runtime wakes a task whose timer fired (busy workers, or threads the OS does not run)",
            runtime_lag_seconds.clone(),
        );
        // Dashboards read every kind of reconcile error before the first one.
        for error in RECONCILE_ERROR_LABELS {
            reconcile_errors.get_or_create(&ErrorLabels { error }).get();
        }
        // Tests and dashboards read every cluster × verb before anything was sent.
        for side in [Side::Upper, Side::Lower] {
            for verb in VERBS {
                api_requests
                    .sent
                    .get_or_create(&request_labels(side, verb))
                    .get();
            }
        }
        let [
            reconciles,
            status_writes,
            lower_creates,
            lower_updates,
            orphans_deleted,
            copy_rewrites_deferred,
            events_dropped,
            gc_rounds,
        ] = counters.map(|(_, _, counter)| counter);
        Self {
            registry,
            api_requests,
            reconciles,
            errors: Counter::default(),
            reconcile_errors,
            reconcile_seconds,
            status_writes,
            status_write_seconds,
            status_reflection_seconds,
            mirrored,
            memory,
            read_at_scrape: ScrapeSources::default(),
            allocator,
            allocator_stats: OnceLock::new(),
            lower_creates,
            lower_updates,
            orphans_deleted,
            copy_rewrites_deferred,
            events_dropped,
            gc_rounds,
            ready: AtomicBool::new(false),
            leader,
            member_up,
            api_request_seconds,
            api_throttle_seconds,
            api_connect_seconds,
            queue_wait_seconds,
            runtime_lag_seconds,
            upper_pod_watch_seconds,
        }
    }
}

impl Metrics {
    /// Counts a failed pod reconcile (pod controller or status reflector) whose error is of
    /// the kind `label` (`api`, `conflict`, ...).
    pub fn reconcile_failed(&self, label: &'static str) {
        self.errors.inc();
        self.reconcile_errors
            .get_or_create(&ErrorLabels { error: label })
            .inc();
    }

    /// Records that one reconcile of `controller` took `took`.
    pub fn reconciled(&self, controller: &'static str, took: Duration) {
        self.reconcile_seconds
            .get_or_create(&ControllerLabels { controller })
            .observe(took.as_secs_f64());
    }

    /// Reports `count()` as the number of `kind` mirrored now, read at each scrape (from a
    /// reflector store's size).
    /// Each member (`scope`, its node) adds its own; the gauge is their sum.
    pub fn count_mirrored(
        &self,
        scope: &str,
        kind: &'static str,
        count: impl Fn() -> usize + Send + Sync + 'static,
    ) {
        // Exported (at 0) from the start, whether or not a member adds to it.
        let _ = self.mirrored.get_or_create(&KindLabels { kind });
        self.read_at_scrape
            .add(ScrapeTarget::Mirrored(kind), scope, Box::new(count));
    }

    /// Reports `bytes()` as the heap bytes `owner` holds, read at each scrape: an
    /// estimate from its sizes (the allocator's rounding apart), so that the owner of a
    /// process's memory can be told from outside it.
    /// Each member (`scope`, its node) adds its own; the gauge is their sum.
    pub fn measure_memory(
        &self,
        scope: &str,
        owner: &'static str,
        bytes: impl Fn() -> usize + Send + Sync + 'static,
    ) {
        let _ = self.memory.get_or_create(&OwnerLabels { owner });
        self.read_at_scrape
            .add(ScrapeTarget::Memory(owner), scope, Box::new(bytes));
    }

    /// Reports what `read` answers as `tensile_allocator_bytes{stat}`, read at each scrape:
    /// the process's allocator (the binary chooses it). Only the first call counts.
    pub fn read_allocator(&self, read: AllocatorStats) {
        let _ = self.allocator_stats.set(read);
    }

    /// Sets `tensile_member_up{node}`: 1 while the member of `node` runs, 0 while it is
    /// failing or restarting.
    pub fn set_member_up(&self, node: &str, up: bool) {
        let labels = NodeLabels {
            node: node.to_owned(),
        };
        self.member_up.get_or_create(&labels).set(i64::from(up));
    }

    /// Forgets the member of `node` (it left): its series and what its gauges read.
    pub fn forget_member(&self, node: &str) {
        self.member_up.remove(&NodeLabels {
            node: node.to_owned(),
        });
        self.read_at_scrape.forget(node);
    }

    /// Forgets what the gauges read from one run of the member of `node` (it ended: failed,
    /// panicked or stopped for a restart), so that the stores and queues that run held are
    /// freed; its next run registers its own. `tensile_member_up{node}` stays.
    pub fn forget_member_run(&self, node: &str) {
        self.read_at_scrape.forget(node);
    }

    /// Sets every gauge read at scrape to the sum of its sources.
    fn set_read_at_scrape(&self) {
        for (target, sum) in self.read_at_scrape.sums() {
            let gauge = match target {
                ScrapeTarget::Mirrored(kind) => self.mirrored.get_or_create(&KindLabels { kind }),
                ScrapeTarget::Memory(owner) => self.memory.get_or_create(&OwnerLabels { owner }),
            };
            gauge.set(i64::try_from(sum).unwrap_or(i64::MAX));
        }
        if let Some(read) = self.allocator_stats.get() {
            for (stat, bytes) in read() {
                let gauge = self.allocator.get_or_create(&StatLabels { stat });
                gauge.set(i64::try_from(bytes).unwrap_or(i64::MAX));
            }
        }
    }

    /// Sets whether this process leads through `lease` (`namespace/name`; empty without
    /// `--leader-elect`): `tensile_leader{lease="…"} 1|0`.
    pub fn set_leader(&self, lease: &str, leading: bool) {
        let labels = LeaseLabels {
            lease: lease.to_owned(),
        };
        self.leader.get_or_create(&labels).set(i64::from(leading));
    }

    /// The histograms of where requests to `side` wait, to be kept by its client.
    pub fn api_waits(&self, side: Side) -> ApiWaits {
        let labels = ClusterLabels {
            cluster: side_label(side),
        };
        ApiWaits {
            request: self.api_request_seconds.get_or_create(&labels).clone(),
            throttle: self.api_throttle_seconds.get_or_create(&labels).clone(),
            connect: self.api_connect_seconds.get_or_create(&labels).clone(),
        }
    }

    /// The histogram of the shared upper pod watch's handling of each event.
    pub fn upper_pod_watch(&self) -> Histogram {
        self.upper_pod_watch_seconds.clone()
    }

    /// The wait histogram of the work queues named `queue`, to be kept by each.
    pub fn queue_wait(&self, queue: &'static str) -> Histogram {
        self.queue_wait_seconds
            .get_or_create(&QueueLabels { queue })
            .clone()
    }

    /// Sleeps [`RUNTIME_PROBE`] at a time until `shutdown`, recording how late each wake
    /// is (`tensile_runtime_lag_seconds`): the time a ready task waits for a runtime
    /// worker, every member's tasks being on the same workers.
    pub async fn probe_runtime(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            let slept = tokio::time::Instant::now();
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(RUNTIME_PROBE) => {}
            }
            let late = slept.elapsed().saturating_sub(RUNTIME_PROBE);
            self.runtime_lag_seconds.observe(late.as_secs_f64());
        }
    }

    /// OpenMetrics text exposition.
    pub fn render(&self) -> String {
        self.set_read_at_scrape();
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Serves `/healthz`, `/readyz` and `/metrics` on `listener` until `shutdown`, and runs
/// the runtime probe ([`Metrics::probe_runtime`]) meanwhile.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    tokio::spawn(metrics.clone().probe_runtime(shutdown.clone()));
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(m): State<Arc<Metrics>>| async move {
                if m.ready.load(Ordering::Relaxed) {
                    (StatusCode::OK, "ok")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "starting")
                }
            }),
        )
        .route(
            "/metrics",
            get(|State(m): State<Arc<Metrics>>| async move {
                (
                    [(
                        header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    m.render(),
                )
                    .into_response()
            }),
        )
        .with_state(metrics);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

/// Binds the metrics address, naming it on failure.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, String> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on --metrics-addr {addr}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of the series line `series` in `text`.
    fn value<'a>(text: &'a str, series: &str) -> Option<&'a str> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
    }

    #[test]
    fn reconcile_errors_are_counted_by_kind() {
        let metrics = Metrics::default();
        for label in ["api", "conflict", "api", "missing_dependency", "api"] {
            metrics.reconcile_failed(label);
        }
        let out = metrics.render();
        let cases = [
            (
                "tensile_pod_reconcile_errors_total{error=\"api\"}",
                Some("3"),
            ),
            (
                "tensile_pod_reconcile_errors_total{error=\"conflict\"}",
                Some("1"),
            ),
            (
                "tensile_pod_reconcile_errors_total{error=\"missing_dependency\"}",
                Some("1"),
            ),
            // Exported at zero from the start, so dashboards show 0, not "No data".
            (
                "tensile_pod_reconcile_errors_total{error=\"translate\"}",
                Some("0"),
            ),
        ];
        for (series, want) in cases {
            assert_eq!(value(&out, series), want, "{series} in\n{out}");
        }
        assert_eq!(metrics.errors.get(), 5, "the total follows");
    }

    #[test]
    fn the_leader_gauge_follows_the_lease() {
        let metrics = Metrics::default();
        let series = "tensile_leader{lease=\"kube-system/tensile-virtual-node-vk\"}";
        let cases = [(false, "0"), (true, "1"), (false, "0")];
        for (leading, want) in cases {
            metrics.set_leader("kube-system/tensile-virtual-node-vk", leading);
            assert_eq!(value(&metrics.render(), series), Some(want), "{leading}");
        }
    }

    /// Every series that existed before prometheus-client is there, with today's name and
    /// labels, before anything happened.
    #[test]
    fn todays_series_are_there_from_the_start() {
        let out = Metrics::default().render();
        let mut series: Vec<String> = [
            "tensile_pod_reconciles_total",
            "tensile_upper_status_writes_total",
            "tensile_lower_pod_creates_total",
            "tensile_lower_pod_updates_total",
            "tensile_orphans_deleted_total",
            "tensile_lower_copy_rewrites_deferred_total",
            "tensile_upper_events_dropped_total",
            "tensile_gc_rounds_total",
            "tensile_upper_status_write_seconds_count",
            "tensile_upper_status_write_seconds_bucket{le=\"+Inf\"}",
        ]
        .map(String::from)
        .into();
        for cluster in ["upper", "lower"] {
            for verb in VERBS {
                series.push(format!(
                    "tensile_api_requests_total{{cluster=\"{cluster}\",verb=\"{verb}\"}}"
                ));
            }
        }
        for name in series {
            assert_eq!(value(&out, &name), Some("0"), "{name} in\n{out}");
        }
    }

    #[test]
    fn api_requests_and_answers_are_counted() {
        let metrics = Metrics::default();
        let request = |method: http::Method, uri: &str| {
            http::Request::builder()
                .method(method)
                .uri(uri)
                .body(())
                .unwrap()
        };
        let cases = [
            (
                request(http::Method::GET, "/api/v1/pods?watch=true"),
                Some("watch"),
            ),
            (request(http::Method::GET, "/api/v1/pods"), Some("get")),
            (request(http::Method::POST, "/api/v1/pods"), Some("create")),
            (request(http::Method::PUT, "/api/v1/pods/a"), Some("update")),
            (
                request(http::Method::PATCH, "/api/v1/pods/a"),
                Some("patch"),
            ),
            (
                request(http::Method::DELETE, "/api/v1/pods/a"),
                Some("delete"),
            ),
            (request(http::Method::OPTIONS, "/api/v1/pods"), None),
        ];
        for (request, want) in &cases {
            assert_eq!(verb(request), *want, "{request:?}");
            metrics.api_requests.record(Side::Lower, request);
        }
        metrics
            .api_requests
            .answered(Side::Lower, "create", Some(http::StatusCode::CONFLICT));
        metrics.api_requests.answered(Side::Upper, "patch", None);
        let out = metrics.render();
        for (series, want) in [
            (
                "tensile_api_requests_total{cluster=\"lower\",verb=\"create\"}",
                "1",
            ),
            (
                "tensile_api_requests_total{cluster=\"lower\",verb=\"watch\"}",
                "1",
            ),
            (
                "tensile_api_requests_total{cluster=\"upper\",verb=\"create\"}",
                "0",
            ),
            (
                "tensile_api_responses_total{cluster=\"lower\",verb=\"create\",code=\"409\"}",
                "1",
            ),
            (
                "tensile_api_responses_total{cluster=\"upper\",verb=\"patch\",code=\"error\"}",
                "1",
            ),
        ] {
            assert_eq!(value(&out, series), Some(want), "{series} in\n{out}");
        }
        assert_eq!(metrics.api_requests.get(Side::Lower, "delete"), 1);
    }

    #[test]
    fn histograms_render_cumulative_buckets() {
        let metrics = Metrics::default();
        for ms in [1, 5, 7, 150, 9000] {
            let took = Duration::from_millis(ms);
            metrics.status_write_seconds.observe(took.as_secs_f64());
            metrics
                .status_reflection_seconds
                .observe(took.as_secs_f64());
            metrics.reconciled("status", took);
        }
        metrics.reconciled("pod", Duration::from_millis(30));
        let out = metrics.render();
        let mut cases = Vec::new();
        for (name, labels) in [
            ("tensile_upper_status_write_seconds", ""),
            ("tensile_status_reflection_seconds", ""),
            (
                "tensile_reconcile_duration_seconds",
                ",controller=\"status\"",
            ),
        ] {
            for (le, want) in [
                ("0.005", "2"), // 1 ms and exactly 5 ms
                ("0.01", "3"),
                ("0.1", "3"),
                ("0.2", "4"),
                ("5.0", "4"),
                ("+Inf", "5"),
            ] {
                cases.push((format!("{name}_bucket{{le=\"{le}\"{labels}}}"), want));
            }
            let labels = labels.trim_start_matches(',');
            let labels = if labels.is_empty() {
                String::new()
            } else {
                format!("{{{labels}}}")
            };
            cases.push((format!("{name}_count{labels}"), "5"));
            cases.push((format!("{name}_sum{labels}"), "9.163"));
        }
        cases.push((
            "tensile_reconcile_duration_seconds_count{controller=\"pod\"}".into(),
            "1",
        ));
        for (series, want) in cases {
            assert_eq!(value(&out, &series), Some(want), "{series} in\n{out}");
        }
    }

    #[test]
    fn mirrored_objects_and_memory_are_read_at_scrape_time() {
        let metrics = Metrics::default();
        let pods = Arc::new(std::sync::atomic::AtomicUsize::new(3));
        let seen = pods.clone();
        metrics.count_mirrored("vk", "pods", move || seen.load(Ordering::Relaxed));
        metrics.count_mirrored("vk", "secrets", || 0);
        let series = "tensile_mirrored_objects{kind=\"pods\"}";
        assert_eq!(value(&metrics.render(), series), Some("3"));
        pods.store(7, Ordering::Relaxed);
        let out = metrics.render();
        assert_eq!(value(&out, series), Some("7"), "{out}");
        assert_eq!(
            value(&out, "tensile_mirrored_objects{kind=\"secrets\"}"),
            Some("0")
        );
        metrics.measure_memory("vk", "pod queue", || 4096);
        assert_eq!(
            value(
                &metrics.render(),
                "tensile_memory_bytes{owner=\"pod queue\"}"
            ),
            Some("4096")
        );
    }

    #[test]
    fn the_allocator_is_read_at_scrape_time_once_given() {
        let metrics = Metrics::default();
        let series = "tensile_allocator_bytes{stat=\"allocated\"}";
        assert_eq!(value(&metrics.render(), series), None);
        metrics.read_allocator(|| vec![("allocated", 1024), ("active", 4096)]);
        metrics.read_allocator(Vec::new);
        let out = metrics.render();
        assert_eq!(value(&out, series), Some("1024"), "{out}");
        assert_eq!(
            value(&out, "tensile_allocator_bytes{stat=\"active\"}"),
            Some("4096")
        );
    }

    /// A member restarted registers its gauges again: they replace the old run's (whose
    /// stores are then freed), they never add to them.
    #[test]
    fn registering_a_member_twice_replaces_not_adds() {
        let metrics = Metrics::default();
        let old_store = Arc::new(vec![0u8; 16]);
        let held = old_store.clone();
        metrics.count_mirrored("vk-a", "pods", move || held.len());
        metrics.measure_memory("vk-a", "lower pods", || 100);
        metrics.count_mirrored("vk-b", "pods", || 1);
        // The restart: the same member registers the same gauges again.
        let new_store = Arc::new(vec![0u8; 16]);
        let held = new_store.clone();
        metrics.count_mirrored("vk-a", "pods", move || held.len());
        metrics.measure_memory("vk-a", "lower pods", || 100);
        let out = metrics.render();
        let cases = [
            ("tensile_mirrored_objects{kind=\"pods\"}", "17"),
            ("tensile_memory_bytes{owner=\"lower pods\"}", "100"),
        ];
        for (series, want) in cases {
            assert_eq!(value(&out, series), Some(want), "{series} in\n{out}");
        }
        assert_eq!(
            Arc::strong_count(&old_store),
            1,
            "the old run's store is freed"
        );
        // A run that ended is forgotten (and its store freed) until the next registers.
        metrics.set_member_up("vk-a", false);
        metrics.forget_member_run("vk-a");
        let out = metrics.render();
        assert_eq!(
            value(&out, "tensile_mirrored_objects{kind=\"pods\"}"),
            Some("1")
        );
        assert_eq!(value(&out, "tensile_member_up{node=\"vk-a\"}"), Some("0"));
        assert_eq!(
            Arc::strong_count(&new_store),
            1,
            "the ended run's store is freed"
        );
    }

    #[test]
    fn member_gauges_are_summed_and_forgotten_when_a_member_leaves() {
        let metrics = Metrics::default();
        metrics.count_mirrored("vk-a", "pods", || 3);
        metrics.count_mirrored("vk-b", "pods", || 4);
        metrics.set_member_up("vk-a", true);
        metrics.set_member_up("vk-b", false);
        let out = metrics.render();
        let pods = "tensile_mirrored_objects{kind=\"pods\"}";
        assert_eq!(value(&out, pods), Some("7"), "{out}");
        assert_eq!(
            value(&out, "tensile_member_up{node=\"vk-a\"}"),
            Some("1"),
            "{out}"
        );
        assert_eq!(
            value(&out, "tensile_member_up{node=\"vk-b\"}"),
            Some("0"),
            "{out}"
        );
        metrics.forget_member("vk-b");
        let out = metrics.render();
        assert_eq!(value(&out, pods), Some("3"), "{out}");
        assert_eq!(
            value(&out, "tensile_member_up{node=\"vk-b\"}"),
            None,
            "{out}"
        );
        metrics.forget_member("vk-a");
        assert_eq!(value(&metrics.render(), pods), Some("0"));
    }
}
