//! `virtual-node status`: the federation as the upper cluster shows it, for an operator.
//! For each virtual node: its member Secret, Ready and since when, the lower API server's
//! address (from the member Secret's kubeconfig: the server, never a credential) and
//! version, the pods it runs, allocatable and what they request, share limit and burst
//! priority, and the last Warning about it; then the leader-election Leases. Reads the
//! upper cluster only (Nodes, member Secrets, Pods by node, Events, Leases), so it works
//! from a laptop with the upper kubeconfig. [`summarize`] and [`render`] are pure.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::{Parser, ValueEnum};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Event, Node, Pod, Secret};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams};
use kube::config::Kubeconfig;
use kube::{Client, ResourceExt};
use serde::Serialize;

use crate::member::spec::{KUBECONFIG_KEY, MEMBER_LABEL, SHARE_ANNOTATION, node_name};
use crate::node::burst::BURST_PRIORITY_LABEL;
use crate::node::groups::MEMBER_NODE_LABEL;
use crate::node::quantity::format_readable;
use crate::node::resources::{self, Resources};
use crate::side::Side;

/// The label every virtual node carries (tensile-kube's).
const VIRTUAL_NODE_SELECTOR: &str = "type=virtual-kubelet";
/// Leader-election Leases of virtual-node are named so by default.
const LEASE_PREFIX: &str = "tensile-virtual-node-";

/// `virtual-node status` flags.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "virtual-node status",
    about = "Shows every virtual node of the upper cluster, its member and its lower cluster"
)]
pub struct StatusArgs {
    /// Kubeconfig of the upper cluster (default: $KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Namespace of the member Secrets (and, by default, of the leader-election Leases).
    #[arg(
        long,
        env = "TENSILE_MEMBERS_NAMESPACE",
        default_value = crate::member::join::LOWER_NAMESPACE
    )]
    pub members_namespace: String,

    /// Show only this virtual node (repeatable; default: every node labelled
    /// `type=virtual-kubelet`).
    #[arg(long = "nodename")]
    pub nodes: Vec<String>,

    /// Namespace of the leader-election Leases (default: `--members-namespace`).
    #[arg(long)]
    pub leader_elect_resource_namespace: Option<String>,

    /// `text` (a table) or `json` (for scripts).
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Text)]
    pub output: Output,
}

/// How `status` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// A table for a person.
    Text,
    /// One JSON document.
    Json,
}

/// What `status` found.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    /// One per virtual node (or member Secret whose node is not registered yet).
    pub nodes: Vec<NodeStatus>,
    /// virtual-node's leader-election Leases.
    pub leases: Vec<LeaseStatus>,
    /// What could not be read (e.g. Secrets forbidden to this identity).
    pub unread: Vec<String>,
}

/// One virtual node.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    /// The Node's name.
    pub node: String,
    /// The member Secret (`namespace/name`); none for the single-cluster flags' node.
    pub member: Option<String>,
    /// Whether the Node is registered upstairs.
    pub registered: bool,
    /// The Ready condition's status (`True`, `False`, `Unknown`).
    pub ready: Option<String>,
    /// When Ready last changed (RFC 3339).
    pub ready_since: Option<String>,
    /// Cordoned (`spec.unschedulable`).
    pub cordoned: bool,
    /// The lower API server's address, from the member Secret's kubeconfig.
    pub lower_server: Option<String>,
    /// The lower API server's version (the Node's kubelet version).
    pub lower_version: Option<String>,
    /// Pods bound to the node, not finished.
    pub pods: usize,
    /// The Node's allocatable.
    pub allocatable: BTreeMap<String, String>,
    /// What the node's pods request, for the resources allocatable shows.
    pub requested: BTreeMap<String, String>,
    /// The member's share limit (`tensile.dev/share`).
    pub share: Option<String>,
    /// The node's burst priority (`tensile.dev/burst-priority`).
    pub burst_priority: Option<String>,
    /// The newest Warning Event about the node or its member Secret.
    pub last_error: Option<LastError>,
}

/// A Warning Event.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LastError {
    /// Its reason.
    pub reason: String,
    /// Its message.
    pub message: String,
    /// When it was last seen (RFC 3339).
    pub at: Option<String>,
}

/// A leader-election Lease.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaseStatus {
    /// `namespace/name`.
    pub lease: String,
    /// The holder's identity.
    pub holder: Option<String>,
    /// Its last renewal (RFC 3339).
    pub renewed: Option<String>,
}

/// Everything `status` reads, as read.
#[derive(Clone, Debug, Default)]
pub struct Inputs {
    /// Virtual Nodes.
    pub nodes: Vec<Node>,
    /// Member Secrets.
    pub secrets: Vec<Secret>,
    /// Pods by node name.
    pub pods: BTreeMap<String, Vec<Pod>>,
    /// Warning Events about Nodes and member Secrets.
    pub events: Vec<Event>,
    /// Leases of the lease namespace.
    pub leases: Vec<Lease>,
    /// What could not be read.
    pub unread: Vec<String>,
}

/// Why `status` could not run at all.
#[derive(thiserror::Error, Debug)]
pub enum StatusError {
    /// The upper cluster could not be reached.
    #[error(transparent)]
    Connect(#[from] crate::clusters::StartupError),
    /// A client could not be built.
    #[error("upper cluster: {0}")]
    Client(#[source] kube::Error),
    /// Nodes could not be listed.
    #[error("upper cluster: listing Nodes: {0}")]
    Nodes(#[source] kube::Error),
}

/// Reads the upper cluster and prints the status as `args.output` says.
pub async fn run(args: &StatusArgs) -> Result<String, StatusError> {
    let config = crate::clusters::load_config(Side::Upper, args.kubeconfig.as_deref()).await?;
    let client = Client::try_from(config).map_err(StatusError::Client)?;
    let inputs = read(&client, args).await?;
    let status = summarize(&inputs, &args.members_namespace, &args.nodes);
    Ok(match args.output {
        Output::Text => render(&status),
        Output::Json => {
            let mut text = serde_json::to_string_pretty(&status).unwrap_or_default();
            text.push('\n');
            text
        }
    })
}

/// Beyond this many virtual nodes, their pods are read in one list of every bound pod.
const ONE_LIST_BEYOND: usize = 16;

async fn read(client: &Client, args: &StatusArgs) -> Result<Inputs, StatusError> {
    let mut inputs = Inputs::default();
    let nodes: Api<Node> = Api::all(client.clone());
    inputs.nodes = nodes
        .list(&ListParams::default().labels(VIRTUAL_NODE_SELECTOR))
        .await
        .map_err(StatusError::Nodes)?
        .items;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &args.members_namespace);
    match secrets
        .list(&ListParams::default().labels(MEMBER_LABEL))
        .await
    {
        Ok(list) => inputs.secrets = list.items,
        Err(error) => inputs.unread.push(format!(
            "member Secrets in {}: {error}",
            args.members_namespace
        )),
    }
    let mut names: Vec<String> = inputs.nodes.iter().map(ResourceExt::name_any).collect();
    names.extend(inputs.secrets.iter().map(node_name));
    names.sort();
    names.dedup();
    let pods: Api<Pod> = Api::all(client.clone());
    let asked: Vec<&String> = names
        .iter()
        .filter(|n| args.nodes.is_empty() || args.nodes.contains(n))
        .collect();
    if asked.len() > ONE_LIST_BEYOND {
        // Many virtual nodes (a member of node or label= granularity): one list of every
        // bound pod rather than one per node.
        let params = ListParams::default().fields("spec.nodeName!=");
        match pods.list(&params).await {
            Ok(list) => {
                for name in &asked {
                    inputs.pods.insert((*name).clone(), Vec::new());
                }
                for pod in list.items {
                    let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
                    if let Some(kept) = node.and_then(|n| inputs.pods.get_mut(&n)) {
                        kept.push(pod);
                    }
                }
            }
            Err(error) => inputs.unread.push(format!("pods bound to a node: {error}")),
        }
    } else {
        for name in asked {
            let params = ListParams::default().fields(&format!("spec.nodeName={name}"));
            match pods.list(&params).await {
                Ok(list) => {
                    inputs.pods.insert(name.clone(), list.items);
                }
                Err(error) => inputs.unread.push(format!("pods on {name}: {error}")),
            }
        }
    }
    let events: Api<Event> = Api::all(client.clone());
    for kind in ["Node", "Secret"] {
        let params =
            ListParams::default().fields(&format!("type=Warning,involvedObject.kind={kind}"));
        match events.list(&params).await {
            Ok(list) => inputs.events.extend(list.items),
            Err(error) => inputs.unread.push(format!("Events about {kind}s: {error}")),
        }
    }
    let lease_namespace = args
        .leader_elect_resource_namespace
        .as_deref()
        .unwrap_or(&args.members_namespace);
    let leases: Api<Lease> = Api::namespaced(client.clone(), lease_namespace);
    match leases.list(&ListParams::default()).await {
        Ok(list) => inputs.leases = list.items,
        Err(error) => inputs
            .unread
            .push(format!("Leases in {lease_namespace}: {error}")),
    }
    Ok(inputs)
}

/// The status of `inputs`: every virtual node (only `only`, when not empty), joined with
/// its member Secret of `members_namespace`. Pure.
pub fn summarize(inputs: &Inputs, members_namespace: &str, only: &[String]) -> Status {
    let wanted = |name: &str| only.is_empty() || only.iter().any(|n| n == name);
    let secrets: BTreeMap<String, &Secret> =
        inputs.secrets.iter().map(|s| (node_name(s), s)).collect();
    let mut rows: BTreeMap<String, NodeStatus> = BTreeMap::new();
    // Each row's member node name: its own, or for a group's virtual node its member's.
    let mut member_of: BTreeMap<String, String> = BTreeMap::new();
    for node in &inputs.nodes {
        let name = node.name_any();
        if wanted(&name) {
            rows.insert(name.clone(), node_row(node, inputs.pods.get(&name)));
            member_of.insert(name.clone(), member_node(node));
        }
    }
    for (name, secret) in &secrets {
        let mut nodes: Vec<String> = member_of
            .iter()
            .filter(|(_, member)| *member == name)
            .map(|(node, _)| node.clone())
            .collect();
        if nodes.is_empty() && wanted(name) {
            // No Node yet (or none of that name): the member alone.
            rows.insert(
                name.clone(),
                NodeStatus {
                    node: name.clone(),
                    ..NodeStatus::default()
                },
            );
            member_of.insert(name.clone(), name.clone());
            nodes.push(name.clone());
        }
        for node in nodes {
            let Some(row) = rows.get_mut(&node) else {
                continue;
            };
            row.member = Some(format!("{members_namespace}/{}", secret.name_any()));
            row.lower_server = secret
                .data
                .as_ref()
                .and_then(|d| d.get(KUBECONFIG_KEY))
                .and_then(|k| lower_server(&k.0));
            row.share = secret
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(SHARE_ANNOTATION))
                .cloned();
        }
    }
    for row in rows.values_mut() {
        let member = member_of.get(&row.node).unwrap_or(&row.node);
        let secret = secrets.get(member).copied();
        row.last_error = last_warning(&inputs.events, &row.node, secret, members_namespace);
    }
    let leases = inputs
        .leases
        .iter()
        .filter(|l| l.name_any().starts_with(LEASE_PREFIX))
        .map(|lease| {
            let spec = lease.spec.clone().unwrap_or_default();
            LeaseStatus {
                lease: format!(
                    "{}/{}",
                    lease.namespace().unwrap_or_default(),
                    lease.name_any()
                ),
                holder: spec.holder_identity,
                renewed: spec.renew_time.map(|t| t.0.to_string()),
            }
        })
        .collect();
    Status {
        nodes: rows.into_values().collect(),
        leases,
        unread: inputs.unread.clone(),
    }
}

/// The member node name of `node`: [`MEMBER_NODE_LABEL`] on a group's virtual node, else
/// its own name.
fn member_node(node: &Node) -> String {
    node.labels()
        .get(MEMBER_NODE_LABEL)
        .cloned()
        .unwrap_or_else(|| node.name_any())
}

fn node_row(node: &Node, pods: Option<&Vec<Pod>>) -> NodeStatus {
    let status = node.status.clone().unwrap_or_default();
    let ready = status
        .conditions
        .as_ref()
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"));
    let allocatable = resources::to_resources(&status.allocatable.unwrap_or_default());
    let running: Vec<&Pod> = pods
        .map(|pods| {
            pods.iter()
                .filter(|p| {
                    !resources::phase_is_terminal(
                        p.status.as_ref().and_then(|s| s.phase.as_deref()),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let mut requested = Resources::new();
    for pod in &running {
        if let Some(spec) = pod.spec.as_ref() {
            resources::add(&mut requested, &resources::pod_footprint(spec));
        }
    }
    let shown = |list: &Resources| -> BTreeMap<String, String> {
        allocatable
            .keys()
            .map(|k| {
                (
                    k.clone(),
                    format_readable(list.get(k).copied().unwrap_or(0)),
                )
            })
            .collect()
    };
    NodeStatus {
        node: node.name_any(),
        registered: true,
        ready: ready.map(|c| c.status.clone()),
        ready_since: ready
            .and_then(|c| c.last_transition_time.as_ref())
            .map(|t| t.0.to_string()),
        cordoned: resources::node_cordoned(node),
        lower_version: status.node_info.map(|i| i.kubelet_version),
        pods: running.len(),
        requested: shown(&requested),
        allocatable: shown(&allocatable),
        burst_priority: node.labels().get(BURST_PRIORITY_LABEL).cloned(),
        ..NodeStatus::default()
    }
}

/// The server of a kubeconfig's current context (never anything else of it).
fn lower_server(kubeconfig: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(kubeconfig).ok()?;
    let config = Kubeconfig::from_yaml(text).ok()?;
    let context = config.current_context.as_deref().and_then(|current| {
        config
            .contexts
            .iter()
            .find(|c| c.name == current)
            .and_then(|c| c.context.as_ref())
    });
    let cluster_name = match context {
        Some(context) => context.cluster.clone(),
        None => config.clusters.first()?.name.clone(),
    };
    config
        .clusters
        .iter()
        .find(|c| c.name == cluster_name)
        .and_then(|c| c.cluster.as_ref())
        .and_then(|c| c.server.clone())
}

/// The newest Warning about the Node `node` or its member Secret.
fn last_warning(
    events: &[Event],
    node: &str,
    secret: Option<&Secret>,
    members_namespace: &str,
) -> Option<LastError> {
    let about = |event: &Event| {
        let object = &event.involved_object;
        match object.kind.as_deref() {
            Some("Node") => object.name.as_deref() == Some(node),
            Some("Secret") => secret.is_some_and(|s| {
                object.name.as_deref() == s.metadata.name.as_deref()
                    && object.namespace.as_deref() == Some(members_namespace)
            }),
            _ => false,
        }
    };
    events
        .iter()
        .filter(|e| about(e))
        .filter_map(|e| event_time(e).map(|t| (t, e)))
        .max_by_key(|(t, _)| *t)
        .map(|(t, e)| LastError {
            reason: e.reason.clone().unwrap_or_default(),
            message: e.message.clone().unwrap_or_default(),
            at: Some(t.to_string()),
        })
}

fn event_time(event: &Event) -> Option<Timestamp> {
    event
        .last_timestamp
        .as_ref()
        .map(|t| t.0)
        .or_else(|| event.event_time.as_ref().map(|t| t.0))
        .or_else(|| event.metadata.creation_timestamp.as_ref().map(|t| t.0))
}

/// The table a person reads. Pure.
pub fn render(status: &Status) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    if status.nodes.is_empty() {
        out.push_str("no virtual node (no Node labelled type=virtual-kubelet, no member Secret)\n");
    }
    for row in &status.nodes {
        let dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".to_owned());
        let ready = match (&row.ready, row.registered) {
            (_, false) => "not registered".to_owned(),
            (Some(ready), true) => match &row.ready_since {
                Some(since) => format!("Ready={ready} since {since}"),
                None => format!("Ready={ready}"),
            },
            (None, true) => "Ready unknown".to_owned(),
        };
        let cordoned = if row.cordoned { ", cordoned" } else { "" };
        let _ = writeln!(out, "{}  {ready}{cordoned}", row.node);
        let _ = writeln!(
            out,
            "  member: {}   lower: {} ({})",
            dash(&row.member),
            dash(&row.lower_server),
            dash(&row.lower_version)
        );
        let used: Vec<String> = row
            .allocatable
            .iter()
            .filter(|(k, _)| ["cpu", "memory", "pods"].contains(&k.as_str()) || k.contains('/'))
            .map(|(k, a)| {
                let r = row.requested.get(k).map_or("0", String::as_str);
                if k == "pods" {
                    format!("pods {}/{a}", row.pods)
                } else {
                    format!("{k} {r}/{a}")
                }
            })
            .collect();
        let _ = writeln!(
            out,
            "  requested/allocatable: {}",
            if used.is_empty() {
                format!("pods {}", row.pods)
            } else {
                used.join(", ")
            }
        );
        let _ = writeln!(
            out,
            "  share: {}   burst priority: {}",
            dash(&row.share),
            dash(&row.burst_priority)
        );
        if let Some(error) = &row.last_error {
            let _ = writeln!(
                out,
                "  last warning: {} {}: {}",
                error.at.as_deref().unwrap_or("-"),
                error.reason,
                error.message
            );
        }
    }
    for lease in &status.leases {
        let _ = writeln!(
            out,
            "lease {}: held by {} (renewed {})",
            lease.lease,
            lease.holder.as_deref().unwrap_or("nobody"),
            lease.renewed.as_deref().unwrap_or("never")
        );
    }
    for unread in &status.unread {
        let _ = writeln!(out, "not read: {unread}");
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn node(name: &str, extra: serde_json::Value) -> Node {
        let mut value = json!({
            "metadata": {"name": name, "labels": {"type": "virtual-kubelet"}},
            "status": {
                "allocatable": {"cpu": "8", "memory": "16Gi", "pods": "110"},
                "conditions": [{"type": "Ready", "status": "True",
                                "lastTransitionTime": "2026-11-26T10:00:00Z"}],
                "nodeInfo": {"kubeletVersion": "v1.36.3", "architecture": "amd64",
                    "bootID": "", "containerRuntimeVersion": "", "kernelVersion": "",
                    "kubeProxyVersion": "", "machineID": "", "operatingSystem": "linux",
                    "osImage": "", "systemUUID": ""},
            },
        });
        merge(&mut value, extra);
        serde_json::from_value(value).unwrap()
    }

    fn merge(base: &mut serde_json::Value, extra: serde_json::Value) {
        match (base, extra) {
            (serde_json::Value::Object(base), serde_json::Value::Object(extra)) => {
                for (k, v) in extra {
                    merge(base.entry(k).or_insert(serde_json::Value::Null), v);
                }
            }
            (base, extra) => *base = extra,
        }
    }

    fn pod(name: &str, cpu: &str, phase: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": cpu, "memory": "1Gi"}}}]},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    fn secret(name: &str, node: &str, annotations: serde_json::Value) -> Secret {
        let kubeconfig = "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters:\n- name: lower\n  cluster: {server: \"https://10.0.0.9:6443\"}\ncontexts:\n- name: c\n  context: {cluster: lower, user: u}\nusers:\n- name: u\n  user: {token: secret-token}\n";
        let mut annotations = annotations;
        annotations["tensile.dev/node-name"] = json!(node);
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "tensile-system",
                         "labels": {"tensile.dev/lower-cluster": "true"},
                         "annotations": annotations},
            "data": {"kubeconfig": k8s_openapi::ByteString(kubeconfig.as_bytes().to_vec())},
        }))
        .unwrap()
    }

    fn event(kind: &str, name: &str, reason: &str, at: &str) -> Event {
        serde_json::from_value(json!({
            "metadata": {"name": format!("{name}.{reason}"), "namespace": "tensile-system"},
            "involvedObject": {"kind": kind, "name": name, "namespace": "tensile-system"},
            "reason": reason, "message": format!("{reason} happened"), "type": "Warning",
            "lastTimestamp": at,
        }))
        .unwrap()
    }

    #[test]
    fn each_virtual_node_joined_with_its_member() {
        let inputs = Inputs {
            nodes: vec![
                node("vk-a", json!({"metadata": {"labels": {"tensile.dev/burst-priority": "1"}}})),
                node("vk-flags", json!({"spec": {"unschedulable": true}})),
            ],
            secrets: vec![
                secret("lower-a", "vk-a", json!({"tensile.dev/share": "cpu=4"})),
                secret("lower-b", "vk-b", json!({})),
            ],
            pods: [(
                "vk-a".to_owned(),
                vec![pod("p1", "500m", "Running"), pod("p2", "1", "Pending"), pod("done", "4", "Succeeded")],
            )]
            .into(),
            events: vec![
                event("Secret", "lower-a", "Old", "2026-11-26T09:00:00Z"),
                event("Secret", "lower-a", "MemberFailed", "2026-11-26T11:00:00Z"),
                event("Node", "vk-flags", "NodeNotReady", "2026-11-26T08:00:00Z"),
                event("Secret", "other", "Unrelated", "2026-11-26T12:00:00Z"),
            ],
            leases: vec![serde_json::from_value(json!({
                "metadata": {"name": "tensile-virtual-node-vk-members", "namespace": "tensile-system"},
                "spec": {"holderIdentity": "pod-0", "renewTime": "2026-11-26T12:00:00.000000Z"},
            }))
            .unwrap()],
            unread: vec![],
        };
        let status = summarize(&inputs, "tensile-system", &[]);
        let by_name: BTreeMap<&str, &NodeStatus> =
            status.nodes.iter().map(|r| (r.node.as_str(), r)).collect();
        let names: Vec<&str> = by_name.keys().copied().collect();
        assert_eq!(names, ["vk-a", "vk-b", "vk-flags"]);

        let a = by_name["vk-a"];
        assert_eq!(a.member.as_deref(), Some("tensile-system/lower-a"));
        assert_eq!(a.lower_server.as_deref(), Some("https://10.0.0.9:6443"));
        assert_eq!(a.lower_version.as_deref(), Some("v1.36.3"));
        assert_eq!(a.ready.as_deref(), Some("True"));
        assert_eq!(a.pods, 2, "the finished pod is not counted");
        assert_eq!(a.requested["cpu"], "1500m");
        assert_eq!(a.requested["memory"], "2Gi");
        assert_eq!(a.allocatable["cpu"], "8");
        assert_eq!(a.share.as_deref(), Some("cpu=4"));
        assert_eq!(a.burst_priority.as_deref(), Some("1"));
        assert_eq!(a.last_error.as_ref().unwrap().reason, "MemberFailed");

        let b = by_name["vk-b"];
        assert!(!b.registered);
        assert_eq!(b.member.as_deref(), Some("tensile-system/lower-b"));
        assert!(b.last_error.is_none());

        let flags = by_name["vk-flags"];
        assert!(flags.member.is_none() && flags.cordoned);
        assert_eq!(flags.last_error.as_ref().unwrap().reason, "NodeNotReady");

        assert_eq!(status.leases.len(), 1);
        assert_eq!(status.leases[0].holder.as_deref(), Some("pod-0"));

        let text = render(&status);
        assert!(
            text.contains("vk-a  Ready=True since 2026-11-26T10:00:00Z"),
            "{text}"
        );
        assert!(text.contains("cpu 1500m/8"), "{text}");
        assert!(text.contains("vk-b  not registered"), "{text}");
        assert!(
            text.contains("vk-flags  Ready=True since 2026-11-26T10:00:00Z, cordoned"),
            "{text}"
        );
        assert!(text.contains("held by pod-0"), "{text}");
        assert!(
            !text.contains("secret-token"),
            "a credential was printed: {text}"
        );
        let json = serde_json::to_string(&status).unwrap();
        assert!(!json.contains("secret-token"), "{json}");
    }

    #[test]
    fn a_members_group_nodes_each_joined_with_it() {
        let grouped = |name: &str| {
            node(
                name,
                json!({"metadata": {"labels": {MEMBER_NODE_LABEL: "vk-z"}}}),
            )
        };
        let inputs = Inputs {
            nodes: vec![grouped("vk-z-zone-a"), grouped("vk-z-zone-b")],
            secrets: vec![secret(
                "lower-z",
                "vk-z",
                json!({"tensile.dev/share": "cpu=3"}),
            )],
            events: vec![event(
                "Secret",
                "lower-z",
                "MemberNodeNameClash",
                "2026-11-26T11:00:00Z",
            )],
            ..Inputs::default()
        };
        let status = summarize(&inputs, "tensile-system", &[]);
        let names: Vec<&str> = status.nodes.iter().map(|r| r.node.as_str()).collect();
        assert_eq!(
            names,
            ["vk-z-zone-a", "vk-z-zone-b"],
            "no row for the member's own name"
        );
        for row in &status.nodes {
            assert_eq!(
                row.member.as_deref(),
                Some("tensile-system/lower-z"),
                "{}",
                row.node
            );
            assert_eq!(row.share.as_deref(), Some("cpu=3"), "{}", row.node);
            assert_eq!(
                row.last_error.as_ref().map(|e| e.reason.as_str()),
                Some("MemberNodeNameClash"),
                "{}",
                row.node
            );
        }
        let only = summarize(&inputs, "tensile-system", &["vk-z-zone-b".to_owned()]);
        assert_eq!(only.nodes.len(), 1);
        assert_eq!(
            only.nodes[0].member.as_deref(),
            Some("tensile-system/lower-z")
        );
    }

    #[test]
    fn only_the_nodes_asked_for() {
        let inputs = Inputs {
            nodes: vec![node("vk-a", json!({})), node("vk-b", json!({}))],
            ..Inputs::default()
        };
        let status = summarize(&inputs, "ns", &["vk-b".to_owned()]);
        assert_eq!(status.nodes.len(), 1);
        assert_eq!(status.nodes[0].node, "vk-b");
    }

    #[test]
    fn a_kubeconfig_server_or_nothing() {
        for (text, want) in [
            (
                "clusters:\n- name: x\n  cluster: {server: https://a:1}\ncontexts: []\nusers: []\n",
                Some("https://a:1"),
            ),
            ("not: [yaml", None),
            ("", None),
        ] {
            assert_eq!(lower_server(text.as_bytes()).as_deref(), want, "{text}");
        }
    }
}
