//! The invariant every fault case ends with, checked from the outside (the two API
//! servers only, as an operator would):
//! - every upper pod bound to the virtual node, not finished and not being deleted, has
//!   exactly one lower pod owned by the node (same namespace and name, carrying its UID);
//! - every lower pod owned by the node has its upper pod (same UID), unless it is being
//!   deleted;
//! - the upper status shows the lower one: phase, pod IP and readiness;
//! - the ConfigMaps and Secrets those pods mount are copied below with the same data.
//!
//! It reports lost, orphaned, duplicated and stale objects, each a count with the names.
//! The marks are tensile's contract with the lower cluster, spelled out here because the
//! harness never links tensile.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::{Duration, Instant};

use anyhow::Result;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};

/// The label naming the virtual node that owns a lower object.
pub const OWNER_NODE_LABEL: &str = "tensile.dev/virtual-node";
/// The annotation carrying the UID of a lower object's upper original.
pub const UPPER_UID_ANNOTATION: &str = "tensile.dev/upper-uid";

/// What the checker found; the invariant holds when every list is empty.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// Upper pods checked.
    pub pods: usize,
    /// Upper pods (or the objects they mount) with no lower copy.
    pub lost: Vec<String>,
    /// Lower objects owned by the node whose upper original is gone or another.
    pub orphans: Vec<String>,
    /// Upper pods with more than one lower pod.
    pub duplicates: Vec<String>,
    /// Pairs whose upper side does not show the lower one (status, or data below).
    pub stale: Vec<String>,
}

impl Report {
    /// Whether the invariant holds.
    pub fn holds(&self) -> bool {
        self.lost.is_empty()
            && self.orphans.is_empty()
            && self.duplicates.is_empty()
            && self.stale.is_empty()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} pods: lost {}, orphans {}, duplicates {}, stale {}",
            self.pods,
            self.lost.len(),
            self.orphans.len(),
            self.duplicates.len(),
            self.stale.len()
        )?;
        for (what, names) in [
            ("lost", &self.lost),
            ("orphans", &self.orphans),
            ("duplicates", &self.duplicates),
            ("stale", &self.stale),
        ] {
            if !names.is_empty() {
                let shown: Vec<&str> = names.iter().take(10).map(String::as_str).collect();
                let more = names.len().saturating_sub(shown.len());
                write!(f, "\n  {what}: {}", shown.join(", "))?;
                if more > 0 {
                    write!(f, " (and {more} more)")?;
                }
            }
        }
        Ok(())
    }
}

/// Checks the invariant for virtual node `node` over pods in `namespace` (every
/// namespace when `None`).
pub async fn check(
    upper: &Client,
    lower: &Client,
    node: &str,
    namespace: Option<&str>,
) -> Result<Report> {
    let (upper_pods, _) = pod_apis(upper, lower, namespace);
    let bound = upper_pods
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?
        .items;
    owned_against(upper, lower, node, namespace, bound).await
}

/// [`check`] for a member of `node` or `label=<key>` granularity: the upper pods bound to
/// any of its virtual nodes `nodes` against the lower pods its `owner` mark (`--nodename`)
/// owns, over pods in `namespace` (every namespace when `None`).
pub async fn check_nodes(
    upper: &Client,
    lower: &Client,
    owner: &str,
    nodes: &BTreeSet<String>,
    namespace: Option<&str>,
) -> Result<Report> {
    let (upper_pods, _) = pod_apis(upper, lower, namespace);
    let bound: Vec<Pod> = upper_pods
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|p| {
            p.spec
                .as_ref()
                .and_then(|s| s.node_name.as_ref())
                .is_some_and(|n| nodes.contains(n))
        })
        .collect();
    owned_against(upper, lower, owner, namespace, bound).await
}

/// The upper and lower pod APIs of `namespace` (every namespace when `None`).
fn pod_apis(upper: &Client, lower: &Client, namespace: Option<&str>) -> (Api<Pod>, Api<Pod>) {
    match namespace {
        Some(ns) => (
            Api::namespaced(upper.clone(), ns),
            Api::namespaced(lower.clone(), ns),
        ),
        None => (Api::all(upper.clone()), Api::all(lower.clone())),
    }
}

/// The invariant's report for the upper pods `bound` against the lower pods the mark
/// `owner` owns in `namespace`, and the copies the bound pods mount.
async fn owned_against(
    upper: &Client,
    lower: &Client,
    owner: &str,
    namespace: Option<&str>,
    bound: Vec<Pod>,
) -> Result<Report> {
    let (_, lower_pods) = pod_apis(upper, lower, namespace);
    let owned = lower_pods
        .list(&ListParams::default().labels(&format!("{OWNER_NODE_LABEL}={owner}")))
        .await?
        .items;
    let mut report = pods(&bound, &owned);
    for (ns, mounted) in mounted_objects(&bound) {
        copies_of(upper, lower, &ns, &mounted, &mut report).await?;
    }
    Ok(report)
}

/// Polls [`check_nodes`] until the invariant holds or `timeout` passes; the last report.
pub async fn converge_nodes(
    upper: &Client,
    lower: &Client,
    owner: &str,
    nodes: &BTreeSet<String>,
    namespace: Option<&str>,
    timeout: Duration,
) -> Result<Report> {
    let started = Instant::now();
    loop {
        let report = check_nodes(upper, lower, owner, nodes, namespace).await?;
        if report.holds() || started.elapsed() > timeout {
            return Ok(report);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The UIDs of the pods of `api`, by name: taken before and after a fault, they show
/// which pods were re-created.
pub async fn uids_by_name(api: &Api<Pod>) -> Result<BTreeMap<String, String>> {
    Ok(api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|p| Some((p.metadata.name?, p.metadata.uid?)))
        .collect())
}

/// Polls [`check`] until the invariant holds or `timeout` passes; returns the last
/// report and how long it took.
pub async fn converge(
    upper: &Client,
    lower: &Client,
    node: &str,
    namespace: Option<&str>,
    timeout: Duration,
) -> Result<(Report, Duration)> {
    let started = Instant::now();
    loop {
        let report = check(upper, lower, node, namespace).await?;
        if report.holds() || started.elapsed() > timeout {
            return Ok((report, started.elapsed()));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn key(pod: &Pod) -> String {
    format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any())
}

fn finished(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

fn upper_uid(pod: &Pod) -> Option<&str> {
    pod.annotations()
        .get(UPPER_UID_ANNOTATION)
        .map(String::as_str)
}

/// What the upper status must show of the lower one.
fn shown(pod: &Pod) -> (Option<String>, Option<String>, Option<String>) {
    let status = pod.status.as_ref();
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"))
        .map(|c| c.status.clone());
    (
        status.and_then(|s| s.phase.clone()),
        status.and_then(|s| s.pod_ip.clone()),
        ready,
    )
}

/// The pod part of the invariant (pure).
pub fn pods(bound: &[Pod], owned: &[Pod]) -> Report {
    let mut report = Report::default();
    let mut below: BTreeMap<String, Vec<&Pod>> = BTreeMap::new();
    for pod in owned {
        if let Some(uid) = upper_uid(pod) {
            below.entry(uid.to_owned()).or_default().push(pod);
        }
    }
    let mut expected: BTreeSet<&str> = BTreeSet::new();
    for pod in bound {
        let Some(uid) = pod.metadata.uid.as_deref() else {
            continue;
        };
        expected.insert(uid);
        if pod.metadata.deletion_timestamp.is_some() || finished(pod) {
            continue;
        }
        report.pods += 1;
        let copies: Vec<&&Pod> = below
            .get(uid)
            .map(|c| {
                c.iter()
                    .filter(|l| l.metadata.deletion_timestamp.is_none())
                    .collect()
            })
            .unwrap_or_default();
        match copies.as_slice() {
            [] => report.lost.push(key(pod)),
            [copy] => {
                if key(copy) != key(pod) {
                    report
                        .stale
                        .push(format!("{} (copy named {})", key(pod), key(copy)));
                } else if shown(pod) != shown(copy) {
                    report.stale.push(format!(
                        "{}: upper {:?}, lower {:?}",
                        key(pod),
                        shown(pod),
                        shown(copy)
                    ));
                }
            }
            many => report
                .duplicates
                .push(format!("{} ({} copies)", key(pod), many.len())),
        }
    }
    for pod in owned {
        if pod.metadata.deletion_timestamp.is_some() {
            continue;
        }
        if !upper_uid(pod).is_some_and(|uid| expected.contains(uid)) {
            report.orphans.push(format!("Pod {}", key(pod)));
        }
    }
    report
}

/// The ConfigMaps and Secrets the running pods mount (volumes, projected sources and
/// envFrom), by namespace: `(kind, name)`.
fn mounted_objects(bound: &[Pod]) -> BTreeMap<String, BTreeSet<(&'static str, String)>> {
    let mut found: BTreeMap<String, BTreeSet<(&'static str, String)>> = BTreeMap::new();
    for pod in bound {
        if pod.metadata.deletion_timestamp.is_some() || finished(pod) {
            continue;
        }
        let Some(spec) = &pod.spec else { continue };
        let entry = found
            .entry(pod.namespace().unwrap_or_default())
            .or_default();
        for volume in spec.volumes.iter().flatten() {
            if let Some(c) = &volume.config_map
                && c.optional != Some(true)
            {
                entry.insert(("ConfigMap", c.name.clone()));
            }
            if let Some(s) = &volume.secret
                && s.optional != Some(true)
                && let Some(name) = &s.secret_name
            {
                entry.insert(("Secret", name.clone()));
            }
        }
        for container in &spec.containers {
            for from in container.env_from.iter().flatten() {
                if let Some(c) = &from.config_map_ref
                    && c.optional != Some(true)
                {
                    entry.insert(("ConfigMap", c.name.clone()));
                }
                if let Some(s) = &from.secret_ref
                    && s.optional != Some(true)
                {
                    entry.insert(("Secret", s.name.clone()));
                }
            }
        }
    }
    found
}

/// Checks that each mounted object that exists above has a copy below with its data.
async fn copies_of(
    upper: &Client,
    lower: &Client,
    namespace: &str,
    mounted: &BTreeSet<(&'static str, String)>,
    report: &mut Report,
) -> Result<()> {
    for (kind, name) in mounted {
        let key = format!("{kind} {namespace}/{name}");
        let (above, below) = if *kind == "ConfigMap" {
            let data = |c: ConfigMap| (c.data, c.binary_data.map(|b| format!("{b:?}")));
            (
                Api::<ConfigMap>::namespaced(upper.clone(), namespace)
                    .get_opt(name)
                    .await?
                    .map(|c| format!("{:?}", data(c))),
                Api::<ConfigMap>::namespaced(lower.clone(), namespace)
                    .get_opt(name)
                    .await?
                    .map(|c| format!("{:?}", data(c))),
            )
        } else {
            let data = |s: Secret| format!("{:?}", s.data);
            (
                Api::<Secret>::namespaced(upper.clone(), namespace)
                    .get_opt(name)
                    .await?
                    .map(data),
                Api::<Secret>::namespaced(lower.clone(), namespace)
                    .get_opt(name)
                    .await?
                    .map(data),
            )
        };
        match (above, below) {
            // Missing above: the pod waits for it (a Warning says so); nothing to copy.
            (None, _) => {}
            (Some(_), None) => report.lost.push(key),
            (Some(a), Some(b)) if a != b => report.stale.push(key),
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).unwrap()
    }

    fn upper(name: &str, uid: &str, phase: &str) -> Pod {
        pod(
            json!({"metadata": {"name": name, "namespace": "ns", "uid": uid},
                   "spec": {"nodeName": "vk", "containers": []},
                   "status": {"phase": phase, "podIP": "10.0.0.1"}}),
        )
    }

    fn lower(name: &str, upper_uid: &str, phase: &str) -> Pod {
        pod(
            json!({"metadata": {"name": name, "namespace": "ns", "uid": format!("l-{name}"),
                                "labels": {OWNER_NODE_LABEL: "vk"},
                                "annotations": {UPPER_UID_ANNOTATION: upper_uid}},
                   "spec": {"containers": []},
                   "status": {"phase": phase, "podIP": "10.0.0.1"}}),
        )
    }

    #[test]
    fn pods_table() {
        let deleting = {
            let mut p = upper("gone", "u9", "Running");
            p.metadata.deletion_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    "2026-01-01T00:00:00Z".parse().unwrap(),
                ));
            p
        };
        // name, upper pods bound, lower pods owned, [lost, orphans, duplicates, stale]
        type Case = (&'static str, Vec<Pod>, Vec<Pod>, [usize; 4]);
        let cases: Vec<Case> = vec![
            (
                "in step",
                vec![upper("a", "u1", "Running")],
                vec![lower("a", "u1", "Running")],
                [0, 0, 0, 0],
            ),
            (
                "lost",
                vec![upper("a", "u1", "Running")],
                vec![],
                [1, 0, 0, 0],
            ),
            (
                "orphan",
                vec![],
                vec![lower("a", "u1", "Running")],
                [0, 1, 0, 0],
            ),
            (
                "orphan of a re-created pod",
                vec![upper("a", "u2", "Running")],
                vec![lower("a", "u1", "Running")],
                [1, 1, 0, 0],
            ),
            (
                "duplicate",
                vec![upper("a", "u1", "Running")],
                vec![lower("a", "u1", "Running"), lower("b", "u1", "Running")],
                [0, 0, 1, 0],
            ),
            (
                "stale phase",
                vec![upper("a", "u1", "Pending")],
                vec![lower("a", "u1", "Running")],
                [0, 0, 0, 1],
            ),
            (
                "finished above: no copy needed",
                vec![upper("a", "u1", "Succeeded")],
                vec![],
                [0, 0, 0, 0],
            ),
            (
                "being deleted above, copy still there",
                vec![deleting],
                vec![lower("gone", "u9", "Running")],
                [0, 0, 0, 0],
            ),
        ];
        for (name, bound, owned, [lost, orphans, duplicates, stale]) in cases {
            let report = pods(&bound, &owned);
            assert_eq!(
                [
                    report.lost.len(),
                    report.orphans.len(),
                    report.duplicates.len(),
                    report.stale.len()
                ],
                [lost, orphans, duplicates, stale],
                "{name}: {report}"
            );
        }
    }

    #[test]
    fn the_report_names_what_it_counts() {
        let report = pods(&[upper("a", "u1", "Running")], &[]);
        assert!(!report.holds());
        assert_eq!(
            report.to_string(),
            "1 pods: lost 1, orphans 0, duplicates 0, stale 0\n  lost: ns/a"
        );
    }
}
