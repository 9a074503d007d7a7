//! Controllers: one file per kind. They read from stores (kube-runtime's reflector
//! stores; for pods, tensile's own, [`pod_store`], on a work queue of its own, [`queue`])
//! and call the API only to change something; translation is delegated to the pure
//! `translate` module.

pub mod adopt;
pub mod config;
pub mod dependencies;
pub mod events;
pub mod failure_backoff;
pub mod gc;
pub mod kueue_quota;
pub mod namespace;
pub mod pod;
pub mod pod_store;
pub mod pod_watch;
pub mod presence;
pub mod queue;
pub mod references;
pub mod resize;
pub mod service;
pub mod shrink;
pub mod status;
pub mod stores;
pub mod token;
pub mod volume;
pub mod write_budget;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource};
use tokio::sync::watch;

use self::failure_backoff::FailureBackoff;
use self::presence::PresenceCache;
use self::references::References;
use self::write_budget::{Admission, LONGEST_DELAY, QUIET, WriteBudget};
use crate::lower_view::NamespaceView;
use crate::metrics::Metrics;
use crate::node::Cordons;
use crate::node::burst::Burst;
use crate::side::Side;
use crate::translate::TranslateError;
use crate::translate::meta::Owner;
use crate::upper_watches::UpperWatches;

/// Everything a reconcile may go wrong on; each names the object and the cluster.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An API call failed.
    #[error("{side} cluster: {action} {kind} {key}: {source}")]
    Api {
        /// Which cluster.
        side: Side,
        /// e.g. `creating`.
        action: &'static str,
        /// e.g. `Pod`.
        kind: &'static str,
        /// `namespace/name`.
        key: String,
        /// The API's error.
        source: kube::Error,
    },
    /// Objects the pod references do not exist in the upper cluster.
    #[error("upper cluster: {missing} referenced by pod {pod} not found")]
    MissingDependencies {
        /// The pod.
        pod: String,
        /// e.g. `Secret ns/db-password, ConfigMap ns/settings`.
        missing: String,
    },
    /// A lower pod of the same name exists and is not ours.
    #[error(
        "lower cluster: pod {key} exists and is not managed by virtual node {node}; leaving it alone"
    )]
    Conflict {
        /// `namespace/name`.
        key: String,
        /// Our node.
        node: String,
    },
    /// A lower object tensile must write (other than the pod) exists and is not its own.
    #[error(
        "lower cluster: {kind} {key} exists and is not virtual node {node}'s; leaving it alone"
    )]
    Taken {
        /// e.g. `Secret`.
        kind: &'static str,
        /// `namespace/name`.
        key: String,
        /// Our node.
        node: String,
    },
    /// The lower namespace an upper namespace maps to may not be used
    /// (`--lower-namespace`: a reserved one, or one tensile did not make for this upper
    /// cluster).
    #[error("lower cluster: {note}")]
    NamespaceRefused {
        /// The Event's reason.
        reason: &'static str,
        /// Which namespaces, and why.
        note: String,
    },
    /// The pod cannot be translated (e.g. a malformed annotation).
    #[error(transparent)]
    Translate(#[from] TranslateError),
    /// A store stopped before it was ready (shutdown).
    #[error("shutting down")]
    Shutdown,
}

impl Error {
    /// A short label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Api { .. } => "api",
            Self::MissingDependencies { .. } => "missing_dependency",
            Self::Conflict { .. } | Self::Taken { .. } => "conflict",
            Self::NamespaceRefused { .. } => "namespace_refused",
            Self::Translate(_) => "translate",
            Self::Shutdown => "shutdown",
        }
    }

    /// The reason of the Warning event on the upper pod, if the user should see one.
    fn event_reason(&self) -> Option<&'static str> {
        match self {
            Self::Api {
                side: Side::Lower, ..
            } => Some("LowerSyncFailed"),
            Self::Api { .. } | Self::Shutdown => None,
            Self::MissingDependencies { .. } => Some("MissingDependency"),
            Self::Conflict { .. } => Some("LowerPodConflict"),
            Self::Taken { .. } => Some("LowerObjectConflict"),
            Self::NamespaceRefused { reason, .. } => Some(reason),
            Self::Translate(_) => Some("TranslationFailed"),
        }
    }
}

/// Builds the `map_err` closure for an API call.
pub(crate) fn api_error(
    side: Side,
    action: &'static str,
    kind: &'static str,
    key: &str,
) -> impl FnOnce(kube::Error) -> Error {
    let key = key.to_owned();
    move |source| Error::Api {
        side,
        action,
        kind,
        key,
        source,
    }
}

/// What every controller shares.
pub struct Context {
    /// Upper cluster client.
    pub upper: Client,
    /// Lower cluster client.
    pub lower: Client,
    /// This node (`--nodename`) of this upper cluster: the marks on what it makes below.
    pub owner: Owner,
    /// `--ignore-labels`.
    pub ignore_labels: Vec<String>,
    /// `--enable-serviceaccount`.
    pub with_service_account: bool,
    /// `--namespace` (empty: all).
    pub namespace: String,
    /// Events on upper objects.
    pub recorder: Recorder,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Consecutive failures per object, for backoff.
    failures: Mutex<FailureBackoff>,
    /// Lower dependencies recently seen to exist, so creating many pods that share one
    /// ConfigMap does not read it each time.
    pub(crate) known_present: PresenceCache,
    /// What each pod references, kept apart from the pod stores (which may be pruned).
    pub(crate) references: References,
    /// Lower pods deleted while their upper pods were being deleted, for the final status.
    pub(crate) departed: pod_store::Departed,
    /// The upper watches this member shares with the others of a federated process; `None`:
    /// it watches the upper cluster itself.
    pub upper_watches: Option<Arc<UpperWatches>>,
    /// With `--upper-identity`, the token controller's state; `None` without.
    pub tokens: Option<Arc<token::Tokens>>,
    /// With `--lower-namespace` other than `same`, the mapping the lower client speaks
    /// through; `None` without.
    pub namespaces: Option<Arc<NamespaceView>>,
    /// The member's burst priority and share, as they change.
    pub bursting: watch::Receiver<Burst>,
    /// The virtual nodes' cordons (`spec.unschedulable`): nothing new is created below for
    /// a pod whose own node is cordoned ([`Context::node_cordoned`]).
    pub cordons: Arc<Cordons>,
    /// A member of `node` or `label=<key>` granularity: its virtual nodes (the upper pods
    /// bound to any of them are its own). `None`: the one node `owner.node`.
    pub groups: Option<Arc<crate::node::groups::GroupNodes>>,
}

impl Context {
    /// The shared context.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        upper: Client,
        lower: Client,
        owner: Owner,
        ignore_labels: Vec<String>,
        with_service_account: bool,
        namespace: String,
        recorder: Recorder,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            upper,
            lower,
            owner,
            ignore_labels,
            with_service_account,
            namespace,
            recorder,
            metrics,
            failures: Mutex::default(),
            known_present: PresenceCache::default(),
            references: References::default(),
            departed: pod_store::Departed::default(),
            upper_watches: None,
            tokens: None,
            namespaces: None,
            bursting: watch::channel(Burst::default()).1,
            cordons: Arc::default(),
            groups: None,
        }
    }

    /// The same context, for a member whose virtual nodes are `groups`.
    pub fn grouping(mut self, groups: Option<Arc<crate::node::groups::GroupNodes>>) -> Self {
        self.groups = groups;
        self
    }

    /// Whether an upper pod bound to `node` is this member's: bound to its node, or (node
    /// granularity) to one of its virtual nodes.
    pub fn serves(&self, node: Option<&str>) -> bool {
        node.is_some_and(|node| {
            node == self.owner.node || self.groups.as_ref().is_some_and(|g| g.contains(node))
        })
    }

    /// What confines the lower copy of a pod bound to `node` (node granularity).
    pub fn confinement(&self, node: Option<&str>) -> Option<crate::node::groups::Confinement> {
        let groups = self.groups.as_ref()?;
        groups.confinement(node?)
    }

    /// The same context, following the member's burst settings and its nodes' cordons.
    pub fn bursting(mut self, bursting: watch::Receiver<Burst>, cordons: Arc<Cordons>) -> Self {
        self.bursting = bursting;
        self.cordons = cordons;
        self
    }

    /// Whether `node`, a pod's node (one of the member's), is cordoned: its pods get no
    /// new lower copy.
    pub fn node_cordoned(&self, node: Option<&str>) -> bool {
        self.cordons.is_cordoned(node.unwrap_or(&self.owner.node))
    }

    /// The same context, its lower client speaking through the namespace mapping `view`.
    pub fn viewing(mut self, view: Option<Arc<NamespaceView>>) -> Self {
        self.namespaces = view;
        self
    }

    /// The same context, giving offloaded pods their upper identity (`--upper-identity`).
    pub fn with_upper_identity(mut self, identity: Option<token::UpperIdentity>) -> Self {
        self.tokens = identity.map(|i| Arc::new(token::Tokens::new(i)));
        self
    }

    /// The same context, reading the upper cluster through `watches`.
    pub fn sharing(mut self, watches: Option<Arc<UpperWatches>>) -> Self {
        self.upper_watches = watches;
        self
    }

    /// Records a failure of `key` and returns how long to wait before the next try:
    /// 250 ms doubling up to 30 s (see [`FailureBackoff`], which also forgets objects that
    /// stopped failing without a success, e.g. deleted ones).
    pub(crate) fn backoff(&self, key: &str) -> Duration {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        failures.failed(Instant::now(), key)
    }

    /// Forgets the failures of `key` after a success.
    pub(crate) fn succeeded(&self, key: &str) {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        failures.succeeded(key);
    }

    /// Publishes a Warning event about `object` in the upper cluster (deduplicated into a
    /// series by the recorder); a failure to publish is only logged.
    pub(crate) async fn warn_on<K: Resource<DynamicType = ()>>(
        &self,
        object: &K,
        reason: &str,
        note: String,
    ) {
        self.warn_on_ref(&object.object_ref(&()), reason, note)
            .await;
    }

    /// Spends the write budget of the lower copy `kind` `key` (see [`WriteBudget`]) for a
    /// write from the upper version `source`. `None`: write now. `Some(wait)`: a lower
    /// controller keeps editing the copy; try again after `wait`. The first time in an
    /// episode, a Warning goes on `original` (the upper object the copy follows).
    pub(crate) async fn copy_write_delay(
        &self,
        budget: &Mutex<WriteBudget>,
        kind: &str,
        key: &str,
        source: &str,
        original: &ObjectReference,
    ) -> Option<Duration> {
        let admission = budget.lock().unwrap_or_else(|e| e.into_inner()).admit(
            Instant::now(),
            &format!("{kind}/{key}"),
            source,
        );
        let Admission::Wait { after, warn } = admission else {
            return None;
        };
        self.metrics.copy_rewrites_deferred.inc();
        if warn {
            let note = format!(
                "lower cluster: {kind} {key} keeps being changed by something other than \
                 virtual node {node}; its rewrites from the upper {kind} are put off, up to \
                 {longest}s apart, until it stays as written for {quiet}s",
                node = self.owner.node,
                longest = LONGEST_DELAY.as_secs(),
                quiet = QUIET.as_secs(),
            );
            tracing::warn!(object = %key, kind, cluster = "lower", wait = ?after,
                "a lower copy keeps being changed below; putting off its rewrites");
            self.warn_on_ref(original, "LowerCopyContested", note).await;
        }
        Some(after)
    }

    /// [`Context::warn_on`] for an object known only by reference.
    pub(crate) async fn warn_on_ref(&self, object: &ObjectReference, reason: &str, note: String) {
        let event = Event {
            type_: EventType::Warning,
            reason: reason.into(),
            note: Some(note),
            action: "Mirror".into(),
            secondary: None,
        };
        if let Err(error) = self.recorder.publish(&event, object).await {
            tracing::debug!(%error, cluster = "upper", "publishing an event");
        }
    }
}
