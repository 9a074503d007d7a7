//! Watches shared by the ConfigMap/Secret, Service, volume and event controllers: a
//! reflector store whose readiness any number of tasks may wait on, and a compact index of
//! upper objects' versions fed from a metadata-only watch.

use std::collections::HashMap;
use std::fmt::Debug;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt, TryStreamExt};
use kube::Resource;
use kube::api::Api;
use kube::core::{PartialObjectMeta, PartialObjectMetaExt};
use kube::runtime::controller;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use serde::de::DeserializeOwned;
use tokio::sync::{Notify, watch};

use super::Error;
use crate::side::Side;
use crate::translate::config::UpperVersion;

/// A stream of touched objects (applied or deleted), as a controller consumes it.
pub type ObjectStream<K> = Pin<Box<dyn Stream<Item = Result<K, watcher::Error>> + Send>>;

/// A reflector: its store, the stream that fills it (poll it, e.g. as a controller's
/// trigger), and whether it has completed its first list.
pub struct Reflected<K: Resource<DynamicType = ()> + 'static> {
    /// The objects.
    pub store: Store<K>,
    /// Touched objects, after the store saw them.
    pub stream: ObjectStream<K>,
    /// Turns true at the first complete list.
    pub ready: Ready,
}

/// A reflector over `api` (of cluster `side`). `deleted`, if given, is notified on every
/// deletion the watch reports (after the store has dropped the object), for clean-up loops
/// that act at once rather than at their next tick.
pub fn reflected<K>(
    api: Api<K>,
    side: Side,
    config: watcher::Config,
    deleted: Option<Arc<Notify>>,
) -> Reflected<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let (ready_tx, ready_rx) = watch::channel(false);
    let stream = reflector::reflector(writer, watcher::watcher(api, config))
        .default_backoff()
        .inspect_ok(move |event| match event {
            watcher::Event::InitDone => {
                ready_tx.send_replace(true);
            }
            watcher::Event::Delete(_) => {
                if let Some(deleted) = &deleted {
                    deleted.notify_one();
                }
            }
            _ => {}
        })
        .touched_objects();
    Reflected {
        store,
        stream: errors_logged(stream, side),
        ready: Ready::listed(ready_rx),
    }
}

/// Whether some watches have completed their first list; any number of tasks may wait on
/// it (unlike `Store::wait_until_ready`, which wakes only its last waiter).
#[derive(Clone, Default)]
pub struct Ready(Vec<watch::Receiver<bool>>);

impl Ready {
    /// Ready once `listed` turns true (a watch's first complete list).
    pub fn listed(listed: watch::Receiver<bool>) -> Self {
        Self(vec![listed])
    }

    /// Ready when both are.
    #[must_use]
    pub fn and(mut self, other: &Ready) -> Ready {
        self.0.extend(other.0.iter().cloned());
        self
    }

    /// Waits until every watch has listed once; `Err` if one ended first (shutdown).
    pub async fn wait(&self) -> Result<(), Error> {
        for ready in &self.0 {
            ready
                .clone()
                .wait_for(|ready| *ready)
                .await
                .map_err(|_| Error::Shutdown)?;
        }
        Ok(())
    }

    /// Whether every watch has listed once.
    pub fn is_ready(&self) -> bool {
        self.0.iter().all(|ready| *ready.borrow())
    }
}

/// `namespace/name` of an upper object.
type Key = (String, String);

/// The UID and resourceVersion of every upper object of one kind, from a metadata-only
/// watch: about a hundred bytes an object, where a reflector store of full objects would
/// hold every Secret's data. Fed through [`MetaIndex::apply`]; relists replace it whole.
#[derive(Default)]
pub struct MetaIndex {
    inner: Mutex<IndexState>,
}

#[derive(Default)]
struct IndexState {
    current: HashMap<Key, UpperVersion>,
    /// Filled during a relist, swapped in at its end.
    relisting: Option<HashMap<Key, UpperVersion>>,
}

fn key_and_version(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Option<(Key, UpperVersion)> {
    Some((
        (meta.namespace.clone()?, meta.name.clone()?),
        UpperVersion {
            uid: meta.uid.clone()?,
            resource_version: meta.resource_version.clone().unwrap_or_default(),
        },
    ))
}

impl MetaIndex {
    /// Applies one watch event.
    pub fn apply<K>(&self, event: &watcher::Event<PartialObjectMeta<K>>) {
        let mut state = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match event {
            watcher::Event::Init => state.relisting = Some(HashMap::new()),
            watcher::Event::InitApply(object) => {
                if let Some((key, version)) = key_and_version(&object.metadata) {
                    state.relisting.get_or_insert_default().insert(key, version);
                }
            }
            watcher::Event::InitDone => {
                if let Some(listed) = state.relisting.take() {
                    state.current = listed;
                }
            }
            watcher::Event::Apply(object) => {
                if let Some((key, version)) = key_and_version(&object.metadata) {
                    state.current.insert(key, version);
                }
            }
            watcher::Event::Delete(object) => {
                if let Some((key, _)) = key_and_version(&object.metadata) {
                    state.current.remove(&key);
                }
            }
        }
    }

    /// Every object it holds, as metadata with only a namespace and a name: what a
    /// controller woken by name needs.
    pub fn objects<K>(&self) -> Vec<PartialObjectMeta<K>> {
        let state = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        state
            .current
            .keys()
            .map(|(namespace, name)| {
                k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                    namespace: Some(namespace.clone()),
                    name: Some(name.clone()),
                    ..Default::default()
                }
                .into_response_partial()
            })
            .collect()
    }

    /// The version of `namespace/name`, if the upper cluster has it.
    pub fn get(&self, namespace: &str, name: &str) -> Option<UpperVersion> {
        let state = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        state
            .current
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// How many objects it holds.
    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .current
            .len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A metadata-only watch of `api`'s kind (of cluster `side`) feeding `index`, as a stream
/// of touched objects (for a controller's triggers) and its readiness.
pub fn indexed<K>(
    api: Api<PartialObjectMeta<K>>,
    side: Side,
    config: watcher::Config,
    index: Arc<MetaIndex>,
) -> (ObjectStream<PartialObjectMeta<K>>, Ready)
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    let (ready_tx, ready_rx) = watch::channel(false);
    let stream = watcher::watcher(api, config)
        .default_backoff()
        .inspect_ok(move |event| {
            index.apply(event);
            if matches!(event, watcher::Event::InitDone) {
                ready_tx.send_replace(true);
            }
        })
        .touched_objects();
    (errors_logged(stream, side), Ready::listed(ready_rx))
}

/// `watch` (already retried with its own backoff) without its errors, each logged with the
/// cluster and kind. A kube-runtime `Controller` backs off all its watches together, with a
/// backoff that grows with every error of any of them: handed errors, a controller
/// watching five kinds stopped reading every one of them for minutes after its watches
/// expired (410 Gone) a few times, its stores stale meanwhile.
pub(crate) fn errors_logged<K>(
    watch: impl Stream<Item = Result<K, watcher::Error>> + Send + 'static,
    side: Side,
) -> ObjectStream<K>
where
    K: Resource<DynamicType = ()> + Send + 'static,
{
    errors_logged_as(watch, side, K::kind(&()).into_owned())
}

/// [`errors_logged`] for a watch of `kind` whose items are not objects (e.g. shared ones).
pub(crate) fn errors_logged_as<T>(
    watch: impl Stream<Item = Result<T, watcher::Error>> + Send + 'static,
    side: Side,
    kind: String,
) -> Pin<Box<dyn Stream<Item = Result<T, watcher::Error>> + Send>>
where
    T: Send + 'static,
{
    let stream = watch.filter_map(move |result| {
        futures::future::ready(match result {
            Ok(object) => Some(Ok(object)),
            Err(error) => {
                tracing::warn!(cluster = %side, %kind, %error, "watching; retrying with backoff");
                None
            }
        })
    });
    Box::pin(stream)
}

/// Ticks at `period`, and at once when `woken` is notified; for clean-up loops.
pub async fn tick_or_wake(interval: &mut tokio::time::Interval, woken: &Notify) {
    tokio::select! {
        _ = interval.tick() => {}
        () = woken.notified() => {
            // Let a burst of deletions (a namespace going) settle into one pass.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A stream that yields every `period`, first after one period (a controller's resync).
pub fn every(period: Duration) -> impl Stream<Item = ()> + Send + 'static {
    futures::stream::unfold(
        tokio::time::interval_at(tokio::time::Instant::now() + period, period),
        |mut interval| async move {
            interval.tick().await;
            Some(((), interval))
        },
    )
}

/// Logs what a controller's run yields, at debug level (failures were already reported by
/// the reconciler), leaving out the expected "not in the store": a trigger for an object
/// deleted meanwhile.
pub async fn log_outcome<T, E, Q>(what: &'static str, result: Result<T, controller::Error<E, Q>>)
where
    E: std::error::Error,
    Q: std::error::Error,
{
    match result {
        Ok(_) | Err(controller::Error::ObjectNotFound(_)) => {}
        Err(error) => tracing::debug!(%error, what),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Secret;
    use serde_json::json;

    #[tokio::test]
    async fn watch_errors_are_logged_and_left_out_of_a_controllers_triggers() {
        let secret = |name: &str| {
            let mut secret = Secret::default();
            secret.metadata.name = Some(name.into());
            secret
        };
        type Watch = Vec<Result<Secret, watcher::Error>>;
        let cases: [(Watch, Vec<&str>); 3] = [
            (vec![Ok(secret("a")), Ok(secret("b"))], vec!["a", "b"]),
            (
                vec![
                    Ok(secret("a")),
                    Err(watcher::Error::NoResourceVersion),
                    Err(watcher::Error::NoResourceVersion),
                    Ok(secret("b")),
                ],
                vec!["a", "b"],
            ),
            (vec![Err(watcher::Error::NoResourceVersion)], vec![]),
        ];
        for (watch, want) in cases {
            let got: Vec<String> = errors_logged(futures::stream::iter(watch), Side::Lower)
                .map(|result| result.map(|s| s.metadata.name.unwrap_or_default()))
                .try_collect()
                .await
                .unwrap();
            assert_eq!(got, want);
        }
    }

    fn meta(name: &str, uid: &str, rv: &str) -> PartialObjectMeta<Secret> {
        serde_json::from_value(json!({
            "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": {"name": name, "namespace": "ns", "uid": uid, "resourceVersion": rv},
        }))
        .unwrap()
    }

    #[test]
    fn the_index_follows_the_watch() {
        let index = MetaIndex::default();
        let init = watcher::Event::<PartialObjectMeta<Secret>>::Init;
        let done = watcher::Event::<PartialObjectMeta<Secret>>::InitDone;
        index.apply(&init);
        index.apply(&watcher::Event::InitApply(meta("a", "ua", "1")));
        assert!(index.is_empty(), "nothing until the list is complete");
        index.apply(&watcher::Event::InitApply(meta("b", "ub", "2")));
        index.apply(&done);
        assert_eq!(index.len(), 2);
        assert_eq!(
            index.get("ns", "a"),
            Some(UpperVersion {
                uid: "ua".into(),
                resource_version: "1".into()
            })
        );
        index.apply(&watcher::Event::Apply(meta("a", "ua", "3")));
        assert_eq!(index.get("ns", "a").unwrap().resource_version, "3");
        index.apply(&watcher::Event::Delete(meta("b", "ub", "2")));
        assert_eq!(index.get("ns", "b"), None);
        assert_eq!(index.get("other", "a"), None);

        // A relist replaces everything: what it does not list is gone.
        index.apply(&init);
        index.apply(&watcher::Event::InitApply(meta("c", "uc", "9")));
        assert!(index.get("ns", "a").is_some(), "kept until the relist ends");
        index.apply(&done);
        assert_eq!(index.get("ns", "a"), None);
        assert!(index.get("ns", "c").is_some());
    }
}
