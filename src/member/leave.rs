//! A member leaving: its node cordoned, its pods evicted through the Eviction API
//! (PodDisruptionBudgets respected, as `kubectl drain` does), then — once its member has
//! stopped — everything tensile made for it below deleted, and its Node and node Lease.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{
    ConfigMap, Endpoints, Node, PersistentVolumeClaim, Pod, Secret, Service, ServiceAccount,
};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, EvictParams, ListParams, Patch, PatchParams};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::api::{delete_exact, is_status};
use crate::translate::meta::Owner;

/// How often a drain looks again at the pods left on the node.
const DRAIN_POLL: Duration = Duration::from_secs(2);

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

/// Cordons `node` and evicts every pod bound to it but DaemonSet pods (which a Node's
/// deletion ends), until none is left: a pod a PodDisruptionBudget protects is tried again
/// every [`DRAIN_POLL`], as `kubectl drain` does. Its member must run meanwhile: it deletes
/// each evicted pod's lower copy and then finishes the upper pod's deletion.
pub async fn drain(
    upper: &Client,
    node: &str,
    shutdown: &CancellationToken,
) -> Result<(), LeaveError> {
    let nodes: Api<Node> = Api::all(upper.clone());
    match nodes
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"unschedulable": true}})),
        )
        .await
    {
        Ok(_) => info!(%node, cluster = "upper", "member leaving: node cordoned"),
        Err(error) if is_status(&error, 404) => {}
        Err(error) => return Err(upper_error("cordoning node", node)(error)),
    }
    let pods: Api<Pod> = Api::all(upper.clone());
    let on_node = ListParams::default().fields(&format!("spec.nodeName={node}"));
    loop {
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
        tokio::select! {
            () = shutdown.cancelled() => return Err(LeaveError::Shutdown),
            () = tokio::time::sleep(DRAIN_POLL) => {}
        }
    }
}

fn is_daemon_set_pod(pod: &Pod) -> bool {
    pod.owner_references()
        .iter()
        .any(|o| o.kind == "DaemonSet" && o.controller == Some(true))
}

/// Deletes every lower object that carries `owner`'s marks (pods, ConfigMaps, Secrets,
/// ServiceAccounts, PVCs, Services, EndpointSlices, Endpoints), each under its UID. Run
/// once the member has stopped, so nothing re-creates them.
pub async fn clean_lower(lower: &Client, owner: &Owner) -> Result<usize, LeaveError> {
    let selector = owner.selector();
    let mut deleted = 0;
    deleted += delete_marked::<Pod>(lower, &selector).await?;
    deleted += delete_marked::<ConfigMap>(lower, &selector).await?;
    deleted += delete_marked::<Secret>(lower, &selector).await?;
    deleted += delete_marked::<ServiceAccount>(lower, &selector).await?;
    deleted += delete_marked::<PersistentVolumeClaim>(lower, &selector).await?;
    deleted += delete_marked::<Service>(lower, &selector).await?;
    deleted += delete_marked::<EndpointSlice>(lower, &selector).await?;
    deleted += delete_marked::<Endpoints>(lower, &selector).await?;
    Ok(deleted)
}

async fn delete_marked<K>(lower: &Client, selector: &str) -> Result<usize, LeaveError>
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
        let api: Api<K> = Api::namespaced(lower.clone(), &namespace);
        delete_exact(&api, &name, object.uid(), None)
            .await
            .map_err(lower_error(
                "deleting",
                &format!("{kind} {namespace}/{name}"),
            ))?;
        deleted += 1;
    }
    Ok(deleted)
}

/// Deletes the Node `node` (under its UID, if it still is the one read) and its Lease in
/// `kube-node-lease`.
pub async fn delete_node(upper: &Client, node: &str) -> Result<(), LeaveError> {
    let nodes: Api<Node> = Api::all(upper.clone());
    if let Some(found) = nodes
        .get_opt(node)
        .await
        .map_err(upper_error("reading node", node))?
    {
        delete_exact(&nodes, node, found.uid(), None)
            .await
            .map_err(upper_error("deleting node", node))?;
    }
    let leases: Api<Lease> = Api::namespaced(upper.clone(), crate::node::LEASE_NAMESPACE);
    if let Some(lease) = leases
        .get_opt(node)
        .await
        .map_err(upper_error("reading the node lease", node))?
    {
        delete_exact(&leases, node, lease.uid(), None)
            .await
            .map_err(upper_error("deleting the node lease", node))?;
    }
    info!(%node, cluster = "upper", "member left: node deleted");
    Ok(())
}
