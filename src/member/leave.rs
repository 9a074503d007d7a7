//! A member leaving: its node cordoned, its pods evicted through the Eviction API
//! (PodDisruptionBudgets respected, as `kubectl drain` does), then — once its member has
//! stopped — everything tensile made for it below deleted, and its Node and node Lease.
//!
//! A leave is bounded (`--leave-timeout`, counted from the member Secret's deletion, so a
//! restart does not start the count again): past it, the pods the member could not end
//! (its lower cluster gone: only the member finishes an evicted pod) are deleted upstairs
//! with no grace period, as Kubernetes' pod garbage collector does for pods of a lost node,
//! and a lower cluster that cannot be cleaned is given up; both are said in an Event.
//!
//! Copies (ConfigMaps, Secrets, ServiceAccounts, PVCs) that a lower pod of another virtual
//! node uses are not deleted: members on one lower cluster share them. They are handed to
//! that node (its marks replace the leaving node's), which keeps them in step and removes
//! them once no pod uses them.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{
    ConfigMap, Endpoints, Node, ObjectReference, PersistentVolumeClaim, Pod, Secret, Service,
    ServiceAccount,
};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, EvictParams, ListParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::api::{delete_exact, is_status};
use crate::duration::format_duration;
use crate::node::owner::{Holding, NodeOwner};
use crate::translate::deps::{DependencyKind, pod_dependencies};
use crate::translate::meta::{OWNER_NODE_LABEL, Owner, UPPER_CLUSTER_LABEL};

/// How often a drain looks again at the pods left on the node.
const DRAIN_POLL: Duration = Duration::from_secs(2);

/// The least time the lower cleanup gets once the bound has passed (a leave tried again
/// after its bound tries the lower cluster once more before giving it up).
const LAST_TRY: Duration = Duration::from_secs(20);

/// How many pod names an Event lists.
const NAMED_IN_EVENT: usize = 10;

/// Why a leave did not finish.
#[derive(Debug, thiserror::Error)]
pub enum LeaveError {
    /// An API call failed.
    #[error("{cluster} cluster: {action} {object}: {source}")]
    Api {
        /// `upper` or `lower`.
        cluster: &'static str,
        /// e.g. `evicting pod`.
        action: &'static str,
        /// `namespace/name` or a name.
        object: String,
        /// The API's error.
        source: kube::Error,
    },
    /// Shutdown came first.
    #[error("shut down before the member left")]
    Shutdown,
}

fn upper_error(action: &'static str, object: &str) -> impl FnOnce(kube::Error) -> LeaveError {
    let object = object.to_owned();
    move |source| LeaveError::Api {
        cluster: "upper",
        action,
        object,
        source,
    }
}

fn lower_error(action: &'static str, object: &str) -> impl FnOnce(kube::Error) -> LeaveError {
    let object = object.to_owned();
    move |source| LeaveError::Api {
        cluster: "lower",
        action,
        object,
        source,
    }
}

/// How long a leave may take (`--leave-timeout`), and when it is over.
#[derive(Clone, Copy, Debug)]
pub struct Bound {
    /// When the leave must be over.
    pub until: Instant,
    /// `--leave-timeout`.
    pub timeout: Duration,
}

impl Bound {
    /// The bound of the leave of the member Secret `secret`: `timeout` from its deletion.
    pub fn of(secret: &Secret, timeout: Duration) -> Self {
        let left = time_left(
            secret.metadata.deletion_timestamp.as_ref(),
            timeout,
            Timestamp::now(),
        );
        Self {
            until: Instant::now() + left,
            timeout,
        }
    }

    fn passed(&self) -> bool {
        Instant::now() >= self.until
    }
}

/// What is left at `now` of `timeout` from `deleted` (all of it if not deleted; none if it
/// passed; a deletion time ahead of this clock counts as now).
fn time_left(deleted: Option<&Time>, timeout: Duration, now: Timestamp) -> Duration {
    let Some(Time(deleted)) = deleted else {
        return timeout;
    };
    let elapsed = Duration::try_from(now.duration_since(*deleted)).unwrap_or(Duration::ZERO);
    timeout.saturating_sub(elapsed)
}

/// Says `note` in an Event of `reason` on the member Secret `object`.
pub(super) async fn say(
    recorder: &Recorder,
    object: &ObjectReference,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let event = Event {
        type_,
        reason: reason.into(),
        note: Some(note),
        action: "Membership".into(),
        secondary: None,
    };
    if let Err(error) = recorder.publish(&event, object).await {
        tracing::debug!(%error, cluster = "upper", "publishing an event on a member Secret");
    }
}

/// Cordons `node` and evicts every pod bound to it but DaemonSet pods (which a Node's
/// deletion ends), until none is left: a pod a PodDisruptionBudget protects is tried again
/// every [`DRAIN_POLL`], as `kubectl drain` does. Its member must run meanwhile: it deletes
/// each evicted pod's lower copy and then finishes the upper pod's deletion. Once `bound`
/// has passed, the pods left are deleted with no grace period (their lower copies, if the
/// lower cluster still answers, go with the lower cleanup), said in an Event on `object`.
pub async fn drain(
    upper: &Client,
    member_node: &MemberNode,
    bound: Bound,
    (recorder, object): (&Recorder, &ObjectReference),
    shutdown: &CancellationToken,
) -> Result<(), LeaveError> {
    let node = member_node.name.as_str();
    let nodes: Api<Node> = Api::all(upper.clone());
    let found = nodes
        .get_opt(node)
        .await
        .map_err(upper_error("reading node", node))?;
    // Another Node of that name now (the member's was deleted): not this drain's.
    if found
        .as_ref()
        .is_some_and(|f| f.metadata.uid.as_deref() != Some(member_node.uid.as_str()))
    {
        info!(%node, cluster = "upper", "the Node drained is gone and another of that name is there: left as it is");
        return Ok(());
    }
    // A user's cordon (or none to make: the Node is gone) is left as it is, unmarked.
    if let Some(found) = found.filter(|n| !crate::node::resources::node_cordoned(n)) {
        let cordoned = nodes
            .patch(
                node,
                &PatchParams::default(),
                // Marked as the leave's: should the member join again before the Node
                // goes, this cordon (and only this, never a user's) is lifted.
                &Patch::Merge(&json!({
                    "metadata": {
                        "uid": found.uid(),
                        "annotations": {
                            crate::node::CORDONED_BY_ANNOTATION: crate::node::CORDONED_BY_LEAVE,
                        },
                    },
                    "spec": {"unschedulable": true},
                })),
            )
            .await;
        match cordoned {
            Ok(_) => info!(%node, cluster = "upper", "member leaving: node cordoned"),
            // Gone, or another Node of that name now (not this leave's to cordon).
            Err(error) if is_status(&error, 404) || is_status(&error, 409) => {}
            Err(error) => return Err(upper_error("cordoning node", node)(error)),
        }
    }
    let pods: Api<Pod> = Api::all(upper.clone());
    let on_node = ListParams::default().fields(&format!("spec.nodeName={node}"));
    let mut first = true;
    loop {
        // Another Node of that name since (the drained one deleted and another registered):
        // its pods are not this drain's.
        if !std::mem::take(&mut first)
            && nodes
                .get_opt(node)
                .await
                .map_err(upper_error("reading node", node))?
                .is_some_and(|f| f.metadata.uid.as_deref() != Some(member_node.uid.as_str()))
        {
            info!(%node, cluster = "upper", "the Node drained was replaced by another of that name: the drain stops");
            return Ok(());
        }
        let left: Vec<Pod> = pods
            .list(&on_node)
            .await
            .map_err(upper_error("listing the pods of node", node))?
            .items
            .into_iter()
            .filter(|p| !is_daemon_set_pod(p))
            .collect();
        if left.is_empty() {
            info!(%node, cluster = "upper", "member leaving: node drained");
            return Ok(());
        }
        if bound.passed() {
            let forced = force_delete(upper, node, &left).await?;
            let mut named = forced
                .iter()
                .take(NAMED_IN_EVENT)
                .cloned()
                .collect::<Vec<_>>();
            if forced.len() > NAMED_IN_EVENT {
                named.push(format!("and {} more", forced.len() - NAMED_IN_EVENT));
            }
            say(
                recorder,
                object,
                EventType::Warning,
                "MemberLeaveForced",
                format!(
                    "node {node}: {} pods not ended within --leave-timeout ({}) deleted with no grace period (their member could not end them: is its lower cluster gone?): {}",
                    forced.len(),
                    format_duration(bound.timeout),
                    named.join(", ")
                ),
            )
            .await;
            return Ok(());
        }
        for pod in left
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
        {
            let (namespace, name) = (pod.namespace().unwrap_or_default(), pod.name_any());
            let key = format!("{namespace}/{name}");
            let api: Api<Pod> = Api::namespaced(upper.clone(), &namespace);
            match api.evict(&name, &EvictParams::default()).await {
                Ok(_) => info!(pod = %key, %node, cluster = "upper", "member leaving: pod evicted"),
                // 429: a disruption budget forbids it now; 404: gone already.
                Err(error) if is_status(&error, 429) || is_status(&error, 404) => {}
                Err(error) => warn!(pod = %key, %node, cluster = "upper", %error,
                    "member leaving: evicting a pod failed; trying again"),
            }
        }
        let next = (Instant::now() + DRAIN_POLL).min(bound.until);
        tokio::select! {
            () = shutdown.cancelled() => return Err(LeaveError::Shutdown),
            () = tokio::time::sleep_until(next) => {}
        }
    }
}

/// Deletes `pods` (of `node`) with no grace period, each under its UID; their keys.
async fn force_delete(upper: &Client, node: &str, pods: &[Pod]) -> Result<Vec<String>, LeaveError> {
    let mut forced = Vec::new();
    for pod in pods {
        let (namespace, name) = (pod.namespace().unwrap_or_default(), pod.name_any());
        let key = format!("{namespace}/{name}");
        let api: Api<Pod> = Api::namespaced(upper.clone(), &namespace);
        delete_exact(&api, &name, pod.uid(), Some(0))
            .await
            .map_err(upper_error("deleting with no grace period pod", &key))?;
        warn!(pod = %key, %node, cluster = "upper",
            "member leaving: pod not ended within --leave-timeout, deleted with no grace period");
        forced.push(key);
    }
    Ok(forced)
}

fn is_daemon_set_pod(pod: &Pod) -> bool {
    pod.owner_references()
        .iter()
        .any(|o| o.kind == "DaemonSet" && o.controller == Some(true))
}

/// Runs `clean` (the lower cleanup) within `bound`. Its error fails the leave (tried
/// again later) until the bound has passed; past it (or with no answer by then) the lower
/// cluster is given up: `None`, said in an Event on `object` with the label that finds
/// what is left there.
pub async fn within<T>(
    bound: Bound,
    owner: &Owner,
    (recorder, object): (&Recorder, &ObjectReference),
    clean: impl Future<Output = Result<T, String>>,
) -> Result<Option<T>, String> {
    let node = &owner.node;
    let left = bound
        .until
        .saturating_duration_since(Instant::now())
        .max(LAST_TRY);
    let error = match tokio::time::timeout(left, clean).await {
        Ok(Ok(done)) => return Ok(Some(done)),
        Ok(Err(error)) => error,
        Err(_) => format!(
            "node {node}: the lower cluster was not cleaned within {}",
            format_duration(left)
        ),
    };
    if !bound.passed() {
        return Err(error);
    }
    warn!(%node, cluster = "lower", %error,
        "member leaving: the lower cluster not cleaned within --leave-timeout; given up");
    say(
        recorder,
        object,
        EventType::Warning,
        "MemberLeftUncleaned",
        format!(
            "{error}; given up after --leave-timeout ({}): what tensile made there for this node is left, labelled {}",
            format_duration(bound.timeout),
            owner.selector()
        ),
    )
    .await;
    Ok(None)
}

/// Deletes every lower object that carries `owner`'s marks (pods, ConfigMaps, Secrets,
/// ServiceAccounts, PVCs, Services, EndpointSlices, Endpoints), each under its UID, but
/// the copies that another node's lower pod uses: those are handed to that node. Run once
/// the member has stopped, so nothing re-creates them. How many objects were deleted.
pub async fn clean_lower(lower: &Client, owner: &Owner) -> Result<usize, LeaveError> {
    let selector = owner.selector();
    let none = BTreeMap::new();
    let mut deleted = 0;
    deleted += delete_marked::<Pod>(lower, &selector, None, &none).await?;
    // Read once this node's pods are going: what any other pod below uses stays.
    let everyone: Api<Pod> = Api::all(lower.clone());
    let below = everyone
        .list(&ListParams::default())
        .await
        .map_err(lower_error("listing", "every Pod"))?;
    let used = users(&below.items, owner);
    use DependencyKind as D;
    deleted += delete_marked::<ConfigMap>(lower, &selector, Some(D::ConfigMap), &used).await?;
    deleted += delete_marked::<Secret>(lower, &selector, Some(D::Secret), &used).await?;
    deleted +=
        delete_marked::<ServiceAccount>(lower, &selector, Some(D::ServiceAccount), &used).await?;
    deleted += delete_marked::<PersistentVolumeClaim>(
        lower,
        &selector,
        Some(D::PersistentVolumeClaim),
        &used,
    )
    .await?;
    deleted += delete_marked::<Service>(lower, &selector, None, &none).await?;
    deleted += delete_marked::<EndpointSlice>(lower, &selector, None, &none).await?;
    deleted += delete_marked::<Endpoints>(lower, &selector, None, &none).await?;
    let runtime_classes = runtime_class_users(&below.items, owner);
    deleted += delete_marked_runtime_classes(lower, &selector, &runtime_classes).await?;
    Ok(deleted)
}

/// The RuntimeClasses the lower `pods` that are not `leaving`'s run with, each with the
/// node to hand it to ([`users`]' rule).
fn runtime_class_users(pods: &[Pod], leaving: &Owner) -> BTreeMap<String, Option<Owner>> {
    let mut used: BTreeMap<String, Option<Owner>> = BTreeMap::new();
    for pod in pods {
        let labels = pod.metadata.labels.as_ref();
        if leaving.owns(labels) {
            continue;
        }
        let Some(name) = pod.spec.as_ref().and_then(|s| s.runtime_class_name.clone()) else {
            continue;
        };
        let label = |key: &str| labels.and_then(|l| l.get(key)).cloned();
        let owner = label(OWNER_NODE_LABEL)
            .zip(label(UPPER_CLUSTER_LABEL))
            .map(|(node, cluster)| Owner::new(node, cluster));
        let entry = used.entry(name).or_insert(None);
        if entry.is_none() {
            *entry = owner;
        }
    }
    used
}

/// The RuntimeClasses labelled `selector` (cluster-scoped, copied for the leaving node's
/// pods): handed to another node whose pod runs with one, kept if a pod of no node does,
/// else deleted; how many were deleted.
async fn delete_marked_runtime_classes(
    lower: &Client,
    selector: &str,
    used: &BTreeMap<String, Option<Owner>>,
) -> Result<usize, LeaveError> {
    let api: Api<RuntimeClass> = Api::all(lower.clone());
    let found = api
        .list(&ListParams::default().labels(selector))
        .await
        .map_err(lower_error(
            "listing",
            &format!("RuntimeClasses labelled {selector}"),
        ))?;
    let mut deleted = 0;
    for object in found.items {
        let name = object.name_any();
        if settle(&api, &object, &name, used.get(&name)).await? {
            deleted += 1;
        }
    }
    Ok(deleted)
}

/// An object a pod uses: kind, namespace, name.
type Used = (DependencyKind, String, String);

/// What the lower `pods` that are not `leaving`'s use, each with the node to hand it to:
/// the first user's owner that is a tensile node, or `None` if only pods of no tensile
/// node use it.
fn users(pods: &[Pod], leaving: &Owner) -> BTreeMap<Used, Option<Owner>> {
    let mut used: BTreeMap<Used, Option<Owner>> = BTreeMap::new();
    for pod in pods {
        let labels = pod.metadata.labels.as_ref();
        if leaving.owns(labels) {
            continue;
        }
        let label = |key: &str| labels.and_then(|l| l.get(key)).cloned();
        let owner = label(OWNER_NODE_LABEL)
            .zip(label(UPPER_CLUSTER_LABEL))
            .map(|(node, cluster)| Owner::new(node, cluster));
        let namespace = pod.namespace().unwrap_or_default();
        for dependency in pod_dependencies(pod, true) {
            let entry = used
                .entry((dependency.kind, namespace.clone(), dependency.name))
                .or_default();
            if entry.is_none() {
                entry.clone_from(&owner);
            }
        }
    }
    used
}

async fn delete_marked<K>(
    lower: &Client,
    selector: &str,
    dependency: Option<DependencyKind>,
    used: &BTreeMap<Used, Option<Owner>>,
) -> Result<usize, LeaveError>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug,
{
    let kind = K::kind(&());
    let all: Api<K> = Api::all(lower.clone());
    let found = all
        .list(&ListParams::default().labels(selector))
        .await
        .map_err(lower_error(
            "listing",
            &format!("{kind}s labelled {selector}"),
        ))?;
    let mut deleted = 0;
    for object in found.items {
        let (namespace, name) = (object.namespace().unwrap_or_default(), object.name_any());
        let key = format!("{namespace}/{name}");
        let api: Api<K> = Api::namespaced(lower.clone(), &namespace);
        let user = dependency.and_then(|d| used.get(&(d, namespace.clone(), name.clone())));
        if settle(&api, &object, &key, user).await? {
            deleted += 1;
        }
    }
    Ok(deleted)
}

/// What a leave does with `object` (named `key` in messages), a copy the leaving node
/// made, by `user`, the node whose pod uses it: handed to that node, kept for a pod of no
/// node (`Some(None)`), else (`None`) deleted; whether it was deleted.
async fn settle<K>(
    api: &Api<K>,
    object: &K,
    key: &str,
    user: Option<&Option<Owner>>,
) -> Result<bool, LeaveError>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    let kind = K::kind(&());
    match user {
        Some(Some(heir)) => {
            hand_over(api, object, heir)
                .await
                .map_err(lower_error("handing over", &format!("{kind} {key}")))?;
            info!(object = %key, %kind, to = %heir.node, cluster = "lower",
                "member leaving: a copy another node's pod uses handed to that node");
            Ok(false)
        }
        Some(None) => {
            info!(object = %key, %kind, cluster = "lower",
                "member leaving: a copy a pod of no virtual node uses is kept");
            Ok(false)
        }
        None => {
            delete_exact(api, &object.name_any(), object.uid(), None)
                .await
                .map_err(lower_error("deleting", &format!("{kind} {key}")))?;
            Ok(true)
        }
    }
}

/// Marks `object` as `heir`'s (its UID a precondition).
async fn hand_over<K>(api: &Api<K>, object: &K, heir: &Owner) -> Result<(), kube::Error>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
{
    let mut labels = BTreeMap::new();
    heir.mark(&mut labels);
    let patch = json!({"metadata": {"uid": object.uid(), "labels": labels}});
    match api
        .patch(
            &object.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        // Gone, or another object of that name now (it is not this node's to hand over).
        Err(e) if is_status(&e, 404) || is_status(&e, 409) || is_status(&e, 422) => Ok(()),
        Err(e) => Err(e),
    }
}

/// A virtual node of a leaving member, as read: its drain and deletion are of that Node
/// only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberNode {
    /// The Node's name.
    pub name: String,
    /// Its UID.
    pub uid: String,
}

/// The virtual nodes the member `owner` (`--nodename` `node`) registered: `node` itself,
/// and with `node` or `label=<key>` granularity each group's node (labelled
/// [`crate::node::groups::MEMBER_NODE_LABEL`] with `node`), each only if it is the
/// member's ([`NodeOwner::holding`]): another's Node of such a name is never drained.
pub async fn member_nodes(
    upper: &Client,
    node: &str,
    owner: &NodeOwner,
) -> Result<Vec<MemberNode>, LeaveError> {
    let nodes: Api<Node> = Api::all(upper.clone());
    let groups = ListParams::default().labels(&format!(
        "{}={node}",
        crate::node::groups::MEMBER_NODE_LABEL
    ));
    let mut found: Vec<Node> = nodes
        .list(&groups)
        .await
        .map_err(upper_error("listing the virtual nodes of member", node))?
        .items;
    if !found
        .iter()
        .any(|n| n.metadata.name.as_deref() == Some(node))
        && let Some(own) = nodes
            .get_opt(node)
            .await
            .map_err(upper_error("reading node", node))?
    {
        found.insert(0, own);
    }
    Ok(found
        .into_iter()
        .filter_map(|found| {
            let name = found.name_any();
            if let Holding::Another(holder) = owner.holding(&found) {
                warn!(node = %name, %holder, cluster = "upper",
                    "member leaving: the Node of this name is not its own: left as it is");
                return None;
            }
            Some(MemberNode {
                uid: found.uid()?,
                name,
            })
        })
        .collect())
}

/// Deletes the Node `node` of `uid` (the member's, [`member_nodes`]: one of that name
/// registered since is left alone) and its Lease in `kube-node-lease`.
pub async fn delete_node_of(upper: &Client, node: &str, uid: &str) -> Result<(), LeaveError> {
    let nodes: Api<Node> = Api::all(upper.clone());
    let uid = Some(uid.to_owned());
    delete_exact(&nodes, node, uid.clone(), None)
        .await
        .map_err(upper_error("deleting node", node))?;
    let leases: Api<Lease> = Api::namespaced(upper.clone(), crate::node::LEASE_NAMESPACE);
    // The Lease of a Node of that name registered since (owned by another UID) stays.
    let of_another = |lease: &Lease| {
        lease
            .owner_references()
            .iter()
            .any(|o| o.kind == "Node" && uid.as_ref().is_some_and(|uid| *uid != o.uid))
    };
    if let Some(lease) = leases
        .get_opt(node)
        .await
        .map_err(upper_error("reading the node lease", node))?
        .filter(|lease| !of_another(lease))
    {
        delete_exact(&leases, node, lease.uid(), None)
            .await
            .map_err(upper_error("deleting the node lease", node))?;
    }
    info!(%node, cluster = "upper", "member left: node deleted");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, labels: &[(&str, &str)], config_map: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns",
                         "labels": labels.iter().copied().collect::<BTreeMap<_, _>>()},
            "spec": {"containers": [{"name": "c", "image": "i",
                "envFrom": [{"configMapRef": {"name": config_map}}]}]},
        }))
        .unwrap()
    }

    /// Copies another node's pod uses go to that node; a pod of no node keeps a copy
    /// (with no heir); the leaving node's own pods keep nothing.
    #[test]
    fn what_other_pods_use_is_handed_to_their_node() {
        let leaving = Owner::new("vk-a", "c1");
        let (a, b, other_cluster) = (
            [(OWNER_NODE_LABEL, "vk-a"), (UPPER_CLUSTER_LABEL, "c1")],
            [(OWNER_NODE_LABEL, "vk-b"), (UPPER_CLUSTER_LABEL, "c1")],
            [(OWNER_NODE_LABEL, "vk-a"), (UPPER_CLUSTER_LABEL, "c2")],
        );
        let pods = [
            pod("a", &a, "only-a"),
            pod("a2", &a, "shared"),
            pod("native", &[], "shared"),
            pod("b", &b, "shared"),
            pod("native2", &[], "native-only"),
            pod("c2", &other_cluster, "same-name-node"),
        ];
        let used = users(&pods, &leaving);
        let at = |name: &str| used.get(&(DependencyKind::ConfigMap, "ns".into(), name.into()));
        assert_eq!(at("only-a"), None);
        assert_eq!(at("shared"), Some(&Some(Owner::new("vk-b", "c1"))));
        assert_eq!(at("native-only"), Some(&None));
        assert_eq!(
            at("same-name-node"),
            Some(&Some(Owner::new("vk-a", "c2"))),
            "a node of the same name in another upper cluster is another node"
        );
    }

    /// A RuntimeClass another node's pod runs with goes to that node; one only a pod of
    /// no node runs with is kept (no heir); the leaving node's alone is deleted (absent).
    #[test]
    fn runtime_classes_other_pods_run_with_are_handed_over() {
        let leaving = Owner::new("vk-a", "c1");
        let with = |name: &str, labels: &[(&str, &str)], class: &str| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "ns",
                             "labels": labels.iter().copied().collect::<BTreeMap<_, _>>()},
                "spec": {"containers": [], "runtimeClassName": class},
            }))
            .unwrap()
        };
        let a = [(OWNER_NODE_LABEL, "vk-a"), (UPPER_CLUSTER_LABEL, "c1")];
        let b = [(OWNER_NODE_LABEL, "vk-b"), (UPPER_CLUSTER_LABEL, "c1")];
        let pods = [
            with("a", &a, "only-a"),
            with("a2", &a, "shared"),
            with("b", &b, "shared"),
            with("native", &[], "native-only"),
        ];
        let used = runtime_class_users(&pods, &leaving);
        assert_eq!(used.get("only-a"), None);
        assert_eq!(used.get("shared"), Some(&Some(Owner::new("vk-b", "c1"))));
        assert_eq!(used.get("native-only"), Some(&None));
    }

    #[test]
    fn a_leave_is_bounded_from_the_deletion() {
        let now = Timestamp::from_second(1_000).unwrap();
        let at = |second| Time(Timestamp::from_second(second).unwrap());
        let timeout = Duration::from_secs(600);
        let cases = [
            (None, timeout),
            (Some(at(1_000)), timeout),
            (Some(at(900)), Duration::from_secs(500)),
            (Some(at(100)), Duration::ZERO),
            (Some(at(2_000)), timeout),
        ];
        for (deleted, want) in cases {
            assert_eq!(
                time_left(deleted.as_ref(), timeout, now),
                want,
                "{deleted:?}"
            );
        }
    }
}
