//! Controllers: one file per kind. They read from reflector stores and call the API only
//! to change something; translation is delegated to the pure `translate` module.

pub mod config;
pub mod dependencies;
pub mod events;
pub mod gc;
pub mod pod;
pub mod pod_watch;
pub mod service;
pub mod status;
pub mod stores;
pub mod volume;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource};

use crate::metrics::Metrics;
use crate::side::Side;
use crate::translate::TranslateError;

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
            Self::Conflict { .. } => "conflict",
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
    /// `--nodename`.
    pub node_name: String,
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
    failures: Mutex<HashMap<String, u32>>,
    /// Lower dependencies recently seen to exist, so creating many pods that share one
    /// ConfigMap does not read it each time.
    pub(crate) known_present: dependencies::PresenceCache,
    /// What each pod references, kept apart from the pod stores (which may be pruned).
    pub(crate) references: config::References,
}

impl Context {
    /// The shared context.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        upper: Client,
        lower: Client,
        node_name: String,
        ignore_labels: Vec<String>,
        with_service_account: bool,
        namespace: String,
        recorder: Recorder,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            upper,
            lower,
            node_name,
            ignore_labels,
            with_service_account,
            namespace,
            recorder,
            metrics,
            failures: Mutex::default(),
            known_present: dependencies::PresenceCache::default(),
            references: config::References::default(),
        }
    }

    /// Records a failure of `key` and returns how long to wait before the next try:
    /// 250 ms doubling up to 30 s.
    pub(crate) fn backoff(&self, key: &str) -> Duration {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        let n = failures.entry(key.to_owned()).or_default();
        *n = n.saturating_add(1);
        let exp = (*n - 1).min(7);
        Duration::from_millis(250 << exp).min(Duration::from_secs(30))
    }

    /// Forgets the failures of `key` after a success.
    pub(crate) fn succeeded(&self, key: &str) {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        failures.remove(key);
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
