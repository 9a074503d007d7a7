//! `--kueue-quota CLUSTERQUEUE/FLAVOR`: keeps the `nominalQuota`s of a Kueue ClusterQueue's
//! flavor equal to the virtual node's `status.allocatable`, so that Kueue admits to the
//! burst flavor only what the lower cluster can run (a quota above it leaves admitted jobs
//! Pending below). It watches the Node and the ClusterQueue, each by name, and looks again
//! at every change of either, level-triggered; what to write is
//! [`crate::translate::kueue_quota`]'s.
//!
//! `spec.resourceGroups` is an atomic list, so no field manager can own one quota in it:
//! the list is written whole by a merge patch carrying the ClusterQueue's UID and
//! resourceVersion (another writer's change meanwhile is a conflict, read again and
//! retried). Only the leader writes (`--leader-elect`). What cannot be done (no such
//! ClusterQueue or flavor, Kueue's CRDs not installed, no permission) is logged and said
//! in a Warning Event, once per cause, and tried again on the next change or as the watch
//! retries (with backoff, up to every 30 s): never an exit.

use std::collections::BTreeMap;
use std::time::Duration;

use backon::BackoffBuilder;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, ObjectReference};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::translate::kueue_quota::{QuotaTarget, QuotaUpdate, kueue_quota};

/// Kueue's API group.
pub const GROUP: &str = "kueue.x-k8s.io";
/// The version of Kueue's API read and written (Kueue v0.17 stores v1beta2).
pub const VERSION: &str = "v1beta2";
/// The field manager of the quota writes.
const FIELD_MANAGER: &str = "tensile-virtual-node";
/// Conflicts retried at once, from a fresh read, before the retry waits its backoff.
const CONFLICTS_AT_ONCE: u32 = 3;

/// The API of ClusterQueues (cluster-scoped).
pub fn cluster_queues(upper: Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(GROUP, VERSION, "ClusterQueue");
    Api::all_with(
        upper,
        &ApiResource::from_gvk_with_plural(&gvk, "clusterqueues"),
    )
}

/// Keeps `target`'s quota equal to the allocatable of the upper Node `node` until
/// `shutdown`; writes only while `leading` (if given) is true.
pub async fn run(
    upper: Client,
    node: String,
    target: QuotaTarget,
    leading: Option<watch::Receiver<bool>>,
    shutdown: CancellationToken,
) {
    let by_name = |name: &str| watcher::Config::default().fields(&format!("metadata.name={name}"));
    let nodes = watcher(Api::<Node>::all(upper.clone()), by_name(&node))
        .default_backoff()
        .map_ok(|e| Change::Node(Box::new(e)))
        .map_err(Failure::Node);
    let queues = watcher(
        cluster_queues(upper.clone()),
        by_name(&target.cluster_queue),
    )
    .default_backoff()
    .map_ok(|e| Change::Queue(Box::new(e)))
    .map_err(Failure::Queue);
    let mut changes = std::pin::pin!(futures::stream::select(nodes, queues));
    let recorder = Recorder::new(
        upper.clone(),
        Reporter {
            controller: "tensile-virtual-node".into(),
            instance: Some(node.clone()),
        },
    );
    let mut keeper = QuotaKeeper::new(cluster_queues(upper), recorder, node, target);
    let mut leading = leading;
    loop {
        let retry_at = keeper.retry_at;
        tokio::select! {
            () = shutdown.cancelled() => return,
            change = changes.next() => match change {
                Some(Ok(change)) => keeper.apply(change),
                Some(Err(failure)) => keeper.failed(&failure),
                None => return,
            },
            () = sleep_until(retry_at) => keeper.retry_at = None,
            () = lead_changed(&mut leading) => {}
        }
        if leading.as_ref().is_none_or(|l| *l.borrow()) && keeper.retry_at.is_none() {
            keeper.reconcile().await;
        }
    }
}

/// Sleeps until `at`; forever without one.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Returns when `leading` changes; never without an election, or once it has ended.
async fn lead_changed(leading: &mut Option<watch::Receiver<bool>>) {
    if let Some(leading) = leading
        && leading.changed().await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

/// A watch event of the Node or of the ClusterQueue.
enum Change {
    Node(Box<watcher::Event<Node>>),
    Queue(Box<watcher::Event<DynamicObject>>),
}

/// What a look at the quota leaves to do.
enum Step {
    /// Nothing until the next change (or retry).
    Done,
    /// Look again at once: the ClusterQueue was read again after a conflict.
    Again,
}

/// A watch that failed (and is retried by the watcher, with backoff).
enum Failure {
    Node(watcher::Error),
    Queue(watcher::Error),
}

/// The one object a watch by name shows, kept through relists.
struct Watched<K> {
    /// The object, `None` when there is none.
    current: Option<K>,
    /// The object of a relist in progress.
    relisting: Option<K>,
    /// Listed at least once.
    listed: bool,
}

impl<K> Default for Watched<K> {
    fn default() -> Self {
        Self {
            current: None,
            relisting: None,
            listed: false,
        }
    }
}

impl<K> Watched<K> {
    /// Takes in `event`.
    fn apply(&mut self, event: watcher::Event<K>) {
        match event {
            watcher::Event::Init => self.relisting = None,
            watcher::Event::InitApply(object) => self.relisting = Some(object),
            watcher::Event::InitDone => {
                self.current = self.relisting.take();
                self.listed = true;
            }
            watcher::Event::Apply(object) => self.current = Some(object),
            watcher::Event::Delete(_) => self.current = None,
        }
    }
}

/// What the controller knows, and what it has said.
struct QuotaKeeper {
    api: Api<DynamicObject>,
    recorder: Recorder,
    node_name: String,
    target: QuotaTarget,
    node: Watched<Node>,
    queue: Watched<DynamicObject>,
    /// Why the ClusterQueue cannot be watched (Kueue not installed, no permission), until
    /// its watch works again.
    queue_unwatchable: Option<String>,
    /// The last problem said (logged and in an Event): said again only once it changed.
    said: Option<String>,
    /// Writes refused one after the other: their retries wait longer each time.
    delays: backon::ExponentialBackoff,
    /// When a failed write is tried again; nothing is written before.
    retry_at: Option<Instant>,
    /// Conflicts in a row.
    conflicts: u32,
}

impl QuotaKeeper {
    fn new(
        api: Api<DynamicObject>,
        recorder: Recorder,
        node_name: String,
        target: QuotaTarget,
    ) -> Self {
        Self {
            api,
            recorder,
            node_name,
            target,
            node: Watched::default(),
            queue: Watched::default(),
            queue_unwatchable: None,
            said: None,
            delays: write_delays(),
            retry_at: None,
            conflicts: 0,
        }
    }

    fn apply(&mut self, change: Change) {
        match change {
            Change::Node(event) => self.node.apply(*event),
            Change::Queue(event) => {
                // Changed by someone: a refused write is tried again at once.
                self.retry_at = None;
                self.queue_unwatchable = None;
                self.queue.apply(*event);
            }
        }
    }

    fn failed(&mut self, failure: &Failure) {
        match failure {
            Failure::Node(error) => {
                warn!(node = %self.node_name, %error, cluster = "upper",
                    "--kueue-quota: watching the virtual node");
            }
            Failure::Queue(error) => {
                let cluster_queue = &self.target.cluster_queue;
                match unwatchable(error) {
                    Some(why) => self.queue_unwatchable = Some(why),
                    None => warn!(%cluster_queue, %error, cluster = "upper",
                        "--kueue-quota: watching the ClusterQueue"),
                }
            }
        }
    }

    /// Brings the quota in line with the Node, or says why it cannot.
    async fn reconcile(&mut self) {
        while let Step::Again = self.step().await {}
    }

    /// One look: writes what differs, or says why it cannot.
    async fn step(&mut self) -> Step {
        if let Some(why) = self.queue_unwatchable.clone() {
            self.problem(why, None).await;
            return Step::Done;
        }
        if !(self.node.listed && self.queue.listed) {
            return Step::Done;
        }
        let Some(node) = &self.node.current else {
            debug!(node = %self.node_name, cluster = "upper",
                "--kueue-quota: no Node yet; the quota is left as it is");
            return Step::Done;
        };
        let Some(queue) = &self.queue.current else {
            let why = format!(
                "ClusterQueue {} not found: the quota of its flavor {} follows virtual node \
                 {} once it exists",
                self.target.cluster_queue, self.target.flavor, self.node_name
            );
            self.problem(why, None).await;
            return Step::Done;
        };
        let allocatable: BTreeMap<String, Quantity> = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.clone())
            .unwrap_or_default();
        let json = match serde_json::to_value(queue) {
            Ok(json) => json,
            Err(error) => {
                warn!(cluster_queue = %self.target.cluster_queue, %error, cluster = "upper",
                    "--kueue-quota: cannot read the ClusterQueue as JSON");
                return Step::Done;
            }
        };
        match kueue_quota(&json, &self.target.flavor, &allocatable) {
            Err(error) => {
                let queue = queue_reference(queue);
                self.problem(error.to_string(), Some(queue)).await;
                Step::Done
            }
            Ok(None) => {
                self.settled();
                Step::Done
            }
            Ok(Some(update)) => {
                let queue = queue.clone();
                self.write(&queue, &update).await
            }
        }
    }

    /// Writes `update` to `queue` as last seen (its UID and resourceVersion preconditions);
    /// [`Step::Again`] after a conflict, the ClusterQueue read again.
    async fn write(&mut self, queue: &DynamicObject, update: &QuotaUpdate) -> Step {
        let name = &self.target.cluster_queue;
        let flavor = &self.target.flavor;
        let patch = json!({
            "metadata": {"uid": queue.uid(), "resourceVersion": queue.resource_version()},
            "spec": {"resourceGroups": update.resource_groups},
        });
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        match self.api.patch(name, &params, &Patch::Merge(&patch)).await {
            Ok(written) => {
                let changes = update.describe();
                info!(cluster_queue = %name, %flavor, node = %self.node_name, %changes,
                    cluster = "upper", "--kueue-quota: quota updated to the node's allocatable");
                let note = format!(
                    "flavor {flavor}: nominalQuota {changes} (the allocatable of virtual node {})",
                    self.node_name
                );
                self.say(
                    EventType::Normal,
                    "QuotaUpdated",
                    note,
                    &queue_reference(&written),
                )
                .await;
                self.queue.current = Some(written);
                self.settled();
                Step::Done
            }
            Err(error) if crate::api::is_replaced(&error) => {
                // Changed (or replaced) since it was seen: read it again and retry.
                self.conflicts += 1;
                debug!(cluster_queue = %name, %error, cluster = "upper",
                    "--kueue-quota: the ClusterQueue changed meanwhile; reading it again");
                match self.api.get_opt(name).await {
                    Ok(fresh) => self.queue.current = fresh,
                    Err(error) => warn!(cluster_queue = %name, %error, cluster = "upper",
                        "--kueue-quota: reading the ClusterQueue again"),
                }
                if self.conflicts > CONFLICTS_AT_ONCE {
                    self.retry_later();
                    return Step::Done;
                }
                Step::Again
            }
            Err(error) => {
                let why = format!(
                    "ClusterQueue {name}: writing the quota of flavor {flavor} ({}) failed: \
                     {error}",
                    update.describe()
                );
                self.problem(why, Some(queue_reference(queue))).await;
                self.retry_later();
                Step::Done
            }
        }
    }

    /// The quota is as it should be: the next problem is said, the next failure retried
    /// soon.
    fn settled(&mut self) {
        if self.said.take().is_some() {
            info!(cluster_queue = %self.target.cluster_queue, flavor = %self.target.flavor,
                node = %self.node_name, cluster = "upper",
                "--kueue-quota: the quota follows the node again");
        }
        self.delays = write_delays();
        self.conflicts = 0;
    }

    fn retry_later(&mut self) {
        let delay = self.delays.next().unwrap_or(Duration::from_secs(60));
        self.retry_at = Some(Instant::now() + delay);
        self.conflicts = 0;
    }

    /// Logs `why` and says it in a Warning Event on `on` (the Node when `None`), unless it
    /// was the last thing said.
    async fn problem(&mut self, why: String, on: Option<ObjectReference>) {
        if self.said.as_deref() == Some(why.as_str()) {
            return;
        }
        warn!(cluster_queue = %self.target.cluster_queue, flavor = %self.target.flavor,
            node = %self.node_name, cluster = "upper", "--kueue-quota: {why}");
        let on = on.unwrap_or_else(|| self.node_reference());
        self.say(EventType::Warning, "QuotaNotUpdated", why.clone(), &on)
            .await;
        self.said = Some(why);
    }

    async fn say(&self, type_: EventType, reason: &str, note: String, on: &ObjectReference) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: "KueueQuota".into(),
            secondary: None,
        };
        if let Err(error) = self.recorder.publish(&event, on).await {
            debug!(%error, cluster = "upper", "publishing an event");
        }
    }

    /// The virtual Node, as last seen (by name before).
    fn node_reference(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(self.node_name.clone()),
            uid: self.node.current.as_ref().and_then(|n| n.uid()),
            ..ObjectReference::default()
        }
    }
}

/// The delays between retries of a refused write: 1 s doubling to 1 min, jittered.
fn write_delays() -> backon::ExponentialBackoff {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_secs(1))
        .with_max_delay(Duration::from_secs(60))
        .with_jitter()
        .without_max_times()
        .build()
}

/// What the Event on a ClusterQueue points at.
fn queue_reference(queue: &DynamicObject) -> ObjectReference {
    ObjectReference {
        api_version: Some(format!("{GROUP}/{VERSION}")),
        kind: Some("ClusterQueue".into()),
        name: queue.metadata.name.clone(),
        uid: queue.metadata.uid.clone(),
        ..ObjectReference::default()
    }
}

/// Why a failed ClusterQueue watch will keep failing until someone acts (Kueue's CRDs
/// missing, no permission), or `None` for a failure that passes (the API server away).
fn unwatchable(error: &watcher::Error) -> Option<String> {
    let api_error = match error {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => e,
        _ => return None,
    };
    let kube::Error::Api(status) = api_error else {
        return None;
    };
    match status.code {
        404 => Some(format!(
            "the upper cluster serves no ClusterQueues ({GROUP}/{VERSION}): is Kueue \
             installed? Watched again with backoff"
        )),
        403 => Some(format!(
            "virtual-node may not watch ClusterQueues: grant \
             deploy/virtual-node/kueue-rbac.yaml ({})",
            status.message
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use kube::core::Status;

    use super::*;

    fn api_error(code: u16) -> kube::Error {
        kube::Error::Api(Box::new(Status {
            code,
            ..Status::failure("refused", "Reason")
        }))
    }

    #[test]
    fn lasting_watch_failures_are_told_apart() {
        // (failure, part of what is said; None: it passes, only logged)
        let cases = [
            (
                watcher::Error::InitialListFailed(api_error(404)),
                Some("is Kueue installed?"),
            ),
            (
                watcher::Error::WatchStartFailed(api_error(403)),
                Some("deploy/virtual-node/kueue-rbac.yaml"),
            ),
            (watcher::Error::InitialListFailed(api_error(500)), None),
            (watcher::Error::NoResourceVersion, None),
        ];
        for (failure, want) in cases {
            let got = unwatchable(&failure);
            match want {
                Some(want) => assert!(
                    got.as_deref().is_some_and(|g| g.contains(want)),
                    "{failure}: {got:?}"
                ),
                None => assert_eq!(got, None, "{failure}"),
            }
        }
    }

    #[test]
    fn a_watch_by_name_keeps_its_object_through_relists() {
        use watcher::Event::{Apply, Delete, Init, InitApply, InitDone};
        // (events, the object after (None: none), listed)
        type Case = (&'static [watcher::Event<u8>], Option<u8>, bool);
        let cases: [Case; 5] = [
            (&[Init], None, false),
            (&[Init, InitApply(1), InitDone], Some(1), true),
            (&[Init, InitDone, Apply(2)], Some(2), true),
            (&[Init, InitApply(1), InitDone, Delete(1)], None, true),
            (&[Init, InitApply(1), InitDone, Init, InitDone], None, true),
        ];
        for (events, want, listed) in cases {
            let mut watched = Watched::default();
            for event in events {
                watched.apply(event.clone());
            }
            assert_eq!(watched.current, want, "{events:?}");
            assert_eq!(watched.listed, listed, "{events:?}");
        }
    }
}
