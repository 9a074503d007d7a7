//! `virtual-node uninstall`: the virtual node of the flags (`--nodename`, its lower
//! cluster `--client-kubeconfig`) removed the way a member leaves, for `helm uninstall`
//! (the chart runs it as a `pre-delete` hook) or by hand:
//!
//! 1. its Nodes (the node, and with `node` or `label=<key>` granularity each group's,
//!    only those this install registered: [`leave::member_nodes`]) cordoned and drained
//!    through the Eviction API, PodDisruptionBudgets respected, as `kubectl drain` does,
//!    while virtual-node still runs and deletes each evicted pod's lower copy;
//! 2. the Deployment `--deployment` that runs virtual-node scaled to 0 replicas, and
//!    waited on until no pod of it is left, so that nothing re-creates what follows;
//! 3. everything tensile made below for the node deleted ([`leave::clean_lower`]);
//! 4. its Nodes and their Leases deleted, each under the UID read in step 1.
//!
//! The drain is bounded by `--leave-timeout`: past it, the pods left are deleted with no
//! grace period, and a lower cluster that cannot be cleaned is given up (said, with the
//! label that finds what is left). A re-run after a partial one finishes the job: a Node
//! already gone, a Deployment already at 0, objects already deleted are all fine.

use std::fmt;
use std::time::Duration;

use backon::BackoffBuilder;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, ObjectReference, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::core::Selector;
use kube::runtime::events::{EventType, Recorder, Reporter};
use kube::{Client, ResourceExt};
use serde_json::json;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::leave::{self, Bound, LeaveError, MemberNode};
use crate::cli::Args;
use crate::clusters;
use crate::duration::format_duration;
use crate::node::owner::NodeOwner;
use crate::side::Side;
use crate::translate::meta::Owner;

/// How long virtual-node's Deployment may take to have no pod left once scaled to 0
/// (its pods' grace period is 30 s as the chart ships it).
const STOP_WAIT: Duration = Duration::from_secs(180);

/// How often the Deployment's pods are looked at while it stops.
const STOP_POLL: Duration = Duration::from_secs(1);

/// The longest wait between two tries of the lower cleanup.
const MAX_CLEAN_DELAY: Duration = Duration::from_secs(10);

/// The Deployment that runs virtual-node (`--deployment`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeploymentRef {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

impl fmt::Display for DeploymentRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The Deployment `--deployment` names: `name`, in `default_namespace` (the upper
/// kubeconfig's namespace; in a pod, its own), or `namespace/name`.
pub fn deployment_ref(flag: &str, default_namespace: &str) -> Result<DeploymentRef, String> {
    let (namespace, name) = match flag.split_once('/') {
        Some((namespace, name)) => (namespace, name),
        None => (default_namespace, flag),
    };
    let valid = |part: &str| !part.is_empty() && !part.contains('/');
    if !valid(namespace) || !valid(name) {
        return Err(format!(
            "--deployment {flag:?}: expected NAME or NAMESPACE/NAME"
        ));
    }
    Ok(DeploymentRef {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
    })
}

/// The label selector of `deployment`'s pods, as a list query takes it; an empty one
/// (every pod of the namespace) is refused.
fn pod_selector(deployment: &Deployment, named: &DeploymentRef) -> Result<String, String> {
    let selector = deployment
        .spec
        .as_ref()
        .map(|s| s.selector.clone())
        .ok_or_else(|| format!("Deployment {named} has no spec"))?;
    let selector = Selector::try_from(selector)
        .map_err(|e| format!("Deployment {named}: its selector: {e}"))?
        .to_string();
    if selector.is_empty() {
        return Err(format!(
            "Deployment {named} selects every pod of its namespace: its pods cannot be told apart"
        ));
    }
    Ok(selector)
}

/// A [`LeaveError`] in words, naming the cluster by its server.
fn said_at(error: LeaveError, upper: &str, lower: &str) -> String {
    match error {
        LeaveError::Api {
            cluster,
            action,
            object,
            source,
        } => {
            let server = if cluster == "lower" { lower } else { upper };
            format!("{cluster} cluster {server}: {action} {object}: {source}")
        }
        LeaveError::Shutdown => {
            "interrupted (SIGTERM or SIGINT): run `virtual-node uninstall` again to finish".into()
        }
    }
}

/// The Node `node` as the object of an Event.
fn node_reference(node: &MemberNode) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node.name.clone()),
        uid: Some(node.uid.clone()),
        ..ObjectReference::default()
    }
}

/// The upper cluster's identity on lower objects: `--cluster-id`, or the UID of its
/// `kube-system` namespace (as virtual-node reads it).
async fn cluster_id(args: &Args, upper: &Client, server: &str) -> Result<String, String> {
    if let Some(id) = &args.cluster_id {
        return Ok(id.clone());
    }
    Api::<Namespace>::all(upper.clone())
        .get("kube-system")
        .await
        .map_err(|e| {
            format!(
                "upper cluster {server}: reading namespace kube-system, whose UID marks the node's lower objects (or set --cluster-id): {e}"
            )
        })?
        .metadata
        .uid
        .ok_or_else(|| {
            format!("upper cluster {server}: namespace kube-system has no UID; set --cluster-id")
        })
}

/// `virtual-node uninstall`: each step said to `out` as one line once done; `Err` is the
/// one line saying what failed (nothing after it was done; run it again to finish).
pub async fn uninstall(args: &Args, out: &mut dyn FnMut(String)) -> Result<(), String> {
    let node = args.nodename.as_str();
    let lower_path = args
        .client_kubeconfig
        .as_deref()
        .ok_or("--client-kubeconfig (the lower cluster of --nodename) is required")?;
    let mut upper_config = clusters::load_config(Side::Upper, args.kubeconfig.as_deref())
        .await
        .map_err(|e| e.to_string())?;
    // A PodDisruptionBudget refuses an eviction with 429, which the client would retry 15
    // times (minutes, past --leave-timeout, the other pods' evictions held behind it): the
    // drain tries a refused eviction again itself, every 2 s, within its bound.
    upper_config.default_retry = false;
    let lower_config = clusters::load_config(Side::Lower, Some(lower_path))
        .await
        .map_err(|e| e.to_string())?;
    let (upper_server, lower_server) = (
        upper_config.cluster_url.to_string(),
        lower_config.cluster_url.to_string(),
    );
    let deployment = args
        .deployment
        .as_deref()
        .map(|flag| deployment_ref(flag, &upper_config.default_namespace))
        .transpose()?;
    let client =
        |config, side: Side| Client::try_from(config).map_err(|e| format!("{side} cluster: {e}"));
    let upper = client(upper_config, Side::Upper)?;
    let lower = client(lower_config, Side::Lower)?;
    let at = |error: LeaveError| said_at(error, &upper_server, &lower_server);

    // Read before anything changes: a wrong --deployment stops here.
    let stopping = match &deployment {
        Some(named) => {
            let found = Api::<Deployment>::namespaced(upper.clone(), &named.namespace)
                .get_opt(&named.name)
                .await
                .map_err(|e| format!("upper cluster {upper_server}: reading Deployment {named}: {e}"))?
                .ok_or_else(|| {
                    format!(
                        "upper cluster {upper_server}: no Deployment {named} (--deployment): virtual-node must be stopped before its lower objects and Node are deleted; nothing changed"
                    )
                })?;
            let selector = pod_selector(&found, named)
                .map_err(|e| format!("upper cluster {upper_server}: {e}"))?;
            Some((named, selector))
        }
        None => None,
    };
    let owner = Owner::new(node, cluster_id(args, &upper, &upper_server).await?);
    let shutdown = CancellationToken::new();
    tokio::spawn(crate::shutdown::on_signals(shutdown.clone()));
    let bound = Bound {
        until: Instant::now() + args.leave_timeout,
        timeout: args.leave_timeout,
    };
    let recorder = Recorder::new(
        upper.clone(),
        Reporter {
            controller: "tensile-virtual-node".into(),
            instance: Some(format!("uninstall/{node}")),
        },
    );

    // 1. Every virtual node at once, so that each is cordoned before any pod is evicted.
    let nodes = leave::member_nodes(&upper, node, &NodeOwner::new(node, None))
        .await
        .map_err(at)?;
    let objects: Vec<ObjectReference> = nodes.iter().map(node_reference).collect();
    for object in &objects {
        leave::say(
            &recorder,
            object,
            EventType::Normal,
            "VirtualNodeUninstalling",
            "virtual-node uninstall: cordoned and drained (PodDisruptionBudgets respected), then deleted"
                .into(),
        )
        .await;
    }
    let drains = nodes
        .iter()
        .zip(&objects)
        .map(|(n, object)| leave::drain(&upper, n, bound, (&recorder, object), &shutdown));
    futures::future::try_join_all(drains).await.map_err(at)?;
    if nodes.is_empty() {
        out(format!(
            "upper cluster {upper_server}: no virtual node of --nodename {node} to drain (gone already, or none of this install's)"
        ));
    }
    for n in &nodes {
        out(format!(
            "upper cluster {upper_server}: node {} cordoned and drained (no pod bound to it but DaemonSet pods)",
            n.name
        ));
    }

    // 2. Nothing may re-create what follows.
    match stopping {
        Some((named, selector)) => {
            stop(&upper, named, &selector, &shutdown)
                .await
                .map_err(|e| format!("upper cluster {upper_server}: {e}"))?;
            out(format!(
                "upper cluster {upper_server}: Deployment {named} scaled to 0 replicas, no pod of it left: virtual-node stopped"
            ));
        }
        None => out(format!(
            "upper cluster {upper_server}: no --deployment: virtual-node taken as stopped already"
        )),
    }

    // 3. Tried again until the bound has passed; past it, the lower cluster is given up.
    let mut delays = backon::ExponentialBuilder::default()
        .with_max_delay(MAX_CLEAN_DELAY)
        .without_max_times()
        .build();
    // Said on the first virtual node (none left: on no object, an Event the API server
    // refuses and nobody misses).
    let cleanup_object = objects.first().cloned().unwrap_or_default();
    let cleaned = loop {
        let clean = async { leave::clean_lower(&lower, &owner).await.map_err(at) };
        match leave::within(bound, &owner, (&recorder, &cleanup_object), clean).await {
            Ok(cleaned) => break cleaned,
            Err(error) => {
                let delay = delays.next().unwrap_or(MAX_CLEAN_DELAY);
                eprintln!(
                    "virtual-node uninstall: {error}; trying again in {}",
                    format_duration(delay)
                );
                tokio::select! {
                    () = shutdown.cancelled() => return Err(at(LeaveError::Shutdown)),
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
    };
    out(match cleaned {
        Some(deleted) => format!(
            "lower cluster {lower_server}: {deleted} objects tensile made for node {node} deleted (labelled {})",
            owner.selector()
        ),
        None => format!(
            "lower cluster {lower_server}: not cleaned within --leave-timeout ({}): given up; what tensile made there for node {node} is left, labelled {}",
            format_duration(bound.timeout),
            owner.selector()
        ),
    });

    // 4.
    for n in &nodes {
        leave::delete_node_of(&upper, &n.name, &n.uid)
            .await
            .map_err(at)?;
        out(format!(
            "upper cluster {upper_server}: node {} and its Lease deleted",
            n.name
        ));
    }
    if nodes.is_empty() {
        out(format!(
            "upper cluster {upper_server}: no Node of --nodename {node} to delete"
        ));
    }
    Ok(())
}

/// Scales `named` to 0 replicas, then waits until no pod of `selector` is left in its
/// namespace (each gone, not only terminating: a terminating virtual-node still writes).
async fn stop(
    upper: &Client,
    named: &DeploymentRef,
    selector: &str,
    shutdown: &CancellationToken,
) -> Result<(), String> {
    let deployments: Api<Deployment> = Api::namespaced(upper.clone(), &named.namespace);
    deployments
        .patch_scale(
            &named.name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 0}})),
        )
        .await
        .map_err(|e| format!("scaling Deployment {named} to 0 replicas: {e}"))?;
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &named.namespace);
    let deadline = Instant::now() + STOP_WAIT;
    loop {
        let left = pods
            .list(&ListParams::default().labels(selector))
            .await
            .map_err(|e| {
                format!(
                    "listing the pods of Deployment {named} ({selector}) in {}: {e}",
                    named.namespace
                )
            })?
            .items;
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            let names: Vec<String> = left.iter().map(ResourceExt::name_any).collect();
            return Err(format!(
                "Deployment {named}: pods {} still there {} after it was scaled to 0: virtual-node has not stopped, so its lower objects and Node are kept (run uninstall again)",
                names.join(", "),
                format_duration(STOP_WAIT)
            ));
        }
        tokio::select! {
            () = shutdown.cancelled() => return Err(
                "interrupted (SIGTERM or SIGINT) while virtual-node stopped: run `virtual-node uninstall` again to finish".into()
            ),
            () = tokio::time::sleep(STOP_POLL) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deployment_is_a_name_or_a_namespace_and_a_name() {
        let named = |namespace: &str, name: &str| {
            Ok(DeploymentRef {
                namespace: namespace.into(),
                name: name.into(),
            })
        };
        let cases = [
            ("virtual-node", named("tensile-system", "virtual-node")),
            ("ops/virtual-node", named("ops", "virtual-node")),
            ("", Err("expected NAME or NAMESPACE/NAME")),
            ("/virtual-node", Err("expected NAME or NAMESPACE/NAME")),
            ("ops/", Err("expected NAME or NAMESPACE/NAME")),
            ("a/b/c", Err("expected NAME or NAMESPACE/NAME")),
        ];
        for (flag, want) in cases {
            let got = deployment_ref(flag, "tensile-system");
            match (&got, &want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{flag:?}"),
                (Err(error), Err(want)) => assert!(error.contains(*want), "{flag:?}: {error}"),
                _ => panic!("{flag:?}: {got:?}, want {want:?}"),
            }
        }
    }

    /// The pods waited on are those the Deployment selects; a selector of every pod (or
    /// none at all) is refused rather than waited on.
    #[test]
    fn the_pods_waited_on_are_the_deployments() {
        let named = DeploymentRef {
            namespace: "tensile-system".into(),
            name: "virtual-node".into(),
        };
        let with = |selector: serde_json::Value| -> Deployment {
            serde_json::from_value(json!({
                "metadata": {"name": "virtual-node"},
                "spec": {"selector": selector, "template": {}},
            }))
            .unwrap()
        };
        let cases = [
            (
                with(json!({"matchLabels": {"app": "virtual-node"}})),
                Ok("app=virtual-node"),
            ),
            (
                with(json!({"matchExpressions": [
                    {"key": "app", "operator": "In", "values": ["virtual-node"]}]})),
                Ok("app in (virtual-node)"),
            ),
            (with(json!({})), Err("selects every pod")),
            (
                serde_json::from_value(json!({"metadata": {"name": "virtual-node"}})).unwrap(),
                Err("has no spec"),
            ),
        ];
        for (deployment, want) in cases {
            let got = pod_selector(&deployment, &named);
            match (&got, want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want),
                (Err(error), Err(want)) => assert!(error.contains(want), "{error}"),
                _ => panic!("{:?}: {got:?}, want {want:?}", deployment.spec),
            }
        }
    }

    /// A failure names the cluster by its server, the action and the object.
    #[test]
    fn a_failure_names_the_cluster_and_the_object() {
        let api = |cluster| LeaveError::Api {
            cluster,
            action: "deleting node",
            object: "vk".into(),
            source: kube::Error::LinesCodecMaxLineLengthExceeded,
        };
        let cases = [
            (api("upper"), "upper cluster https://up: deleting node vk: "),
            (
                api("lower"),
                "lower cluster https://down: deleting node vk: ",
            ),
            (LeaveError::Shutdown, "run `virtual-node uninstall` again"),
        ];
        for (error, want) in cases {
            let said = said_at(error, "https://up", "https://down");
            assert!(said.contains(want), "{said}");
        }
    }
}
