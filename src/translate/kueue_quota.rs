//! A Kueue ClusterQueue's flavor quota kept true to what a virtual node offers
//! (`--kueue-quota CLUSTERQUEUE/FLAVOR`), pure: the ClusterQueue as JSON in, its new
//! `spec.resourceGroups` out. A quota above what the lower cluster holds makes Kueue admit
//! jobs whose pods then stay Pending below; one under it leaves offered room unused.
//!
//! `spec.resourceGroups` is an atomic list (`x-kubernetes-list-type: atomic`), so no field
//! manager can own one flavor's quota in it: the whole list is written back, changed only
//! in that flavor's `nominalQuota`s, under the ClusterQueue's UID and resourceVersion.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::Value;

use crate::node::quantity::parse_milli;

/// The ClusterQueue and flavor of `--kueue-quota`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaTarget {
    /// The ClusterQueue's name.
    pub cluster_queue: String,
    /// The ResourceFlavor's name in it.
    pub flavor: String,
}

impl fmt::Display for QuotaTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.cluster_queue, self.flavor)
    }
}

/// Parses `CLUSTERQUEUE/FLAVOR`: both DNS subdomain names, as Kueue requires of them.
pub fn parse_target(text: &str) -> Result<QuotaTarget, String> {
    let (cluster_queue, flavor) = text
        .split_once('/')
        .ok_or_else(|| format!("{text:?}: must be CLUSTERQUEUE/FLAVOR"))?;
    for (what, name) in [("ClusterQueue", cluster_queue), ("flavor", flavor)] {
        if !is_dns_subdomain(name) {
            return Err(format!(
                "{text:?}: the {what} {name:?} is not a DNS subdomain name (lowercase \
                 alphanumerics, '-' and '.', at most 253)"
            ));
        }
    }
    Ok(QuotaTarget {
        cluster_queue: cluster_queue.to_owned(),
        flavor: flavor.to_owned(),
    })
}

/// A DNS subdomain name (RFC 1123), the names of ClusterQueues and ResourceFlavors.
fn is_dns_subdomain(name: &str) -> bool {
    name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

/// One `nominalQuota` changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuotaChange {
    /// The resource (`cpu`, `memory`, ...).
    pub resource: String,
    /// The quota before, as written (`None`: unreadable or absent).
    pub old: Option<String>,
    /// The quota after: the node's allocatable, as the node shows it.
    pub new: String,
}

/// The ClusterQueue's new `spec.resourceGroups`, and what changed in it.
#[derive(Clone, Debug, PartialEq)]
pub struct QuotaUpdate {
    /// The whole list, to write back as it is (atomic).
    pub resource_groups: Value,
    /// The quotas changed, in the flavor's order.
    pub changes: Vec<QuotaChange>,
}

impl QuotaUpdate {
    /// `cpu 4 → 24, memory 8Gi → 103079215104`.
    pub fn describe(&self) -> String {
        self.changes
            .iter()
            .map(|c| {
                let old = c.old.as_deref().unwrap_or("(none)");
                format!("{} {old} → {}", c.resource, c.new)
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Why a flavor's quota cannot be kept.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    /// The ClusterQueue does not list the flavor.
    #[error(
        "ClusterQueue {cluster_queue} has no flavor {flavor} in spec.resourceGroups \
         (its flavors: {present}); its quota is not kept"
    )]
    FlavorMissing {
        /// The ClusterQueue.
        cluster_queue: String,
        /// The flavor looked for.
        flavor: String,
        /// The flavors it has, comma-separated (`none` when it has none).
        present: String,
    },
}

/// The ClusterQueue `cluster_queue`'s `spec.resourceGroups` with every `nominalQuota` of
/// `flavor` set to `allocatable`'s quantity of the same resource; `None` when each already
/// equals it (compared as quantities: `2` is `2000m`). A resource the flavor lists and the
/// node does not (or shows unreadable) is left alone, as is every other flavor and field.
/// `Err` when the ClusterQueue has no such flavor.
pub fn kueue_quota(
    cluster_queue: &Value,
    flavor: &str,
    allocatable: &BTreeMap<String, Quantity>,
) -> Result<Option<QuotaUpdate>, QuotaError> {
    let mut groups = cluster_queue["spec"]["resourceGroups"].clone();
    let mut found = false;
    let mut changes = Vec::new();
    let flavors = groups
        .as_array_mut()
        .into_iter()
        .flatten()
        .filter_map(|group| group["flavors"].as_array_mut())
        .flatten()
        .filter(|f| f["name"] == flavor);
    for entry in flavors {
        found = true;
        let resources = entry["resources"].as_array_mut().into_iter().flatten();
        for resource in resources {
            let Some(name) = resource["name"].as_str() else {
                continue;
            };
            let Some(offered) = allocatable.get(name) else {
                continue;
            };
            let Some(offered_milli) = parse_milli(&offered.0) else {
                continue;
            };
            let old = quantity_text(&resource["nominalQuota"]);
            if old.as_deref().and_then(parse_milli) == Some(offered_milli) {
                continue;
            }
            changes.push(QuotaChange {
                resource: name.to_owned(),
                old,
                new: offered.0.clone(),
            });
            resource["nominalQuota"] = Value::String(offered.0.clone());
        }
    }
    if !found {
        return Err(QuotaError::FlavorMissing {
            cluster_queue: cluster_queue["metadata"]["name"]
                .as_str()
                .unwrap_or("<unnamed>")
                .to_owned(),
            flavor: flavor.to_owned(),
            present: flavor_names(cluster_queue),
        });
    }
    Ok((!changes.is_empty()).then_some(QuotaUpdate {
        resource_groups: groups,
        changes,
    }))
}

/// A quantity field (`x-kubernetes-int-or-string`) as text.
fn quantity_text(value: &Value) -> Option<String> {
    match value {
        Value::String(text) => Some(text.clone()),
        Value::Number(number) => Some(number.to_string()),
        _ => None,
    }
}

/// The flavors `cluster_queue` lists, comma-separated, or `none`.
fn flavor_names(cluster_queue: &Value) -> String {
    let names: Vec<&str> = cluster_queue["spec"]["resourceGroups"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|group| group["flavors"].as_array())
        .flatten()
        .filter_map(|f| f["name"].as_str())
        .collect();
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use serde_json::json;

    use super::*;

    /// A ClusterQueue `cq` of one resource group over cpu, memory and pods with `flavors`
    /// (name, [cpu, memory, pods] nominal quotas).
    fn cluster_queue(flavors: &[(&str, [Value; 3])]) -> Value {
        let flavors: Vec<Value> = flavors
            .iter()
            .map(|(name, [cpu, memory, pods])| {
                json!({"name": name, "resources": [
                    {"name": "cpu", "nominalQuota": cpu, "borrowingLimit": "1"},
                    {"name": "memory", "nominalQuota": memory},
                    {"name": "pods", "nominalQuota": pods},
                ]})
            })
            .collect();
        json!({
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "ClusterQueue",
            "metadata": {"name": "cq", "uid": "u-1", "resourceVersion": "7"},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [{
                    "coveredResources": ["cpu", "memory", "pods"],
                    "flavors": flavors,
                }],
            },
        })
    }

    fn allocatable(pairs: &[(&str, &str)]) -> BTreeMap<String, Quantity> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned())))
            .collect()
    }

    /// The `nominalQuota`s of `flavor` in `groups`, by resource.
    fn quotas(groups: &Value, flavor: &str) -> Vec<(String, Value)> {
        groups[0]["flavors"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["name"] == flavor)
            .flat_map(|f| f["resources"].as_array().unwrap().iter())
            .map(|r| {
                (
                    r["name"].as_str().unwrap().to_owned(),
                    r["nominalQuota"].clone(),
                )
            })
            .collect()
    }

    #[test]
    fn the_flavor_quota_follows_the_allocatable() {
        let node = allocatable(&[("cpu", "24"), ("memory", "96Gi"), ("pods", "330")]);
        let with_burst = |burst: [Value; 3]| {
            cluster_queue(&[
                ("local", [json!("8"), json!("32Gi"), json!(110)]),
                ("burst", burst),
            ])
        };
        // (case, ClusterQueue, allocatable, the burst quotas after (None: unchanged),
        // the description)
        type Case<'a> = (
            &'a str,
            Value,
            BTreeMap<String, Quantity>,
            Option<[Value; 3]>,
            &'a str,
        );
        let cases: [Case; 7] = [
            (
                "every quota wrong",
                with_burst([json!("4"), json!("1Gi"), json!(10)]),
                node.clone(),
                Some([json!("24"), json!("96Gi"), json!("330")]),
                "cpu 4 → 24, memory 1Gi → 96Gi, pods 10 → 330",
            ),
            (
                "equal as quantities: no write",
                with_burst([json!("24000m"), json!("103079215104"), json!(330)]),
                node.clone(),
                None,
                "",
            ),
            (
                "one quota wrong",
                with_burst([json!("24"), json!("96Gi"), json!(300)]),
                node.clone(),
                Some([json!("24"), json!("96Gi"), json!("330")]),
                "pods 300 → 330",
            ),
            (
                "a resource the node does not show is left alone",
                with_burst([json!("4"), json!("1Gi"), json!(10)]),
                allocatable(&[("cpu", "24"), ("memory", "96Gi")]),
                Some([json!("24"), json!("96Gi"), json!(10)]),
                "cpu 4 → 24, memory 1Gi → 96Gi",
            ),
            (
                "an unreadable allocatable is left alone",
                with_burst([json!("4"), json!("1Gi"), json!(10)]),
                allocatable(&[("cpu", "lots"), ("memory", "96Gi"), ("pods", "10")]),
                Some([json!("4"), json!("96Gi"), json!(10)]),
                "memory 1Gi → 96Gi",
            ),
            (
                "an unreadable quota is rewritten",
                with_burst([json!("x"), json!(null), json!(330)]),
                node.clone(),
                Some([json!("24"), json!("96Gi"), json!(330)]),
                "cpu x → 24, memory (none) → 96Gi",
            ),
            (
                "zero offered is written as zero",
                with_burst([json!("4"), json!("1Gi"), json!(10)]),
                allocatable(&[("cpu", "0"), ("memory", "0"), ("pods", "0")]),
                Some([json!("0"), json!("0"), json!("0")]),
                "cpu 4 → 0, memory 1Gi → 0, pods 10 → 0",
            ),
        ];
        for (case, cq, node, want, described) in cases {
            let got = kueue_quota(&cq, "burst", &node).unwrap();
            let Some(want) = want else {
                assert_eq!(got, None, "{case}");
                continue;
            };
            let update = got.unwrap_or_else(|| panic!("{case}: no update"));
            let names = ["cpu", "memory", "pods"].map(str::to_owned);
            let wanted: Vec<(String, Value)> = names.into_iter().zip(want).collect();
            assert_eq!(quotas(&update.resource_groups, "burst"), wanted, "{case}");
            assert_eq!(update.describe(), described, "{case}");
            // Everything else as it was: the other flavor, the covered resources, the
            // borrowing limit.
            let mut before = cq["spec"]["resourceGroups"].clone();
            let mut after = update.resource_groups.clone();
            for groups in [&mut before, &mut after] {
                for f in groups[0]["flavors"].as_array_mut().unwrap() {
                    if f["name"] != "burst" {
                        continue;
                    }
                    for r in f["resources"].as_array_mut().unwrap() {
                        r["nominalQuota"] = json!(null);
                    }
                }
            }
            assert_eq!(before, after, "{case}: only the burst quotas change");
        }
    }

    #[test]
    fn a_flavor_in_a_second_resource_group_is_found() {
        let mut cq = cluster_queue(&[("local", [json!("8"), json!("32Gi"), json!(110)])]);
        cq["spec"]["resourceGroups"]
            .as_array_mut()
            .unwrap()
            .push(json!({
                "coveredResources": ["nvidia.com/gpu"],
                "flavors": [{"name": "burst", "resources": [
                    {"name": "nvidia.com/gpu", "nominalQuota": "0"},
                ]}],
            }));
        let node = allocatable(&[("cpu", "24"), ("nvidia.com/gpu", "4")]);
        let update = kueue_quota(&cq, "burst", &node).unwrap().unwrap();
        assert_eq!(update.describe(), "nvidia.com/gpu 0 → 4");
        assert_eq!(
            update.resource_groups[1]["flavors"][0]["resources"][0]["nominalQuota"],
            "4"
        );
        assert_eq!(update.resource_groups[0], cq["spec"]["resourceGroups"][0]);
    }

    #[test]
    fn a_missing_flavor_names_the_cluster_queue_and_the_flavor() {
        let node = allocatable(&[("cpu", "24")]);
        let only_local = cluster_queue(&[("local", [json!("8"), json!("32Gi"), json!(110)])]);
        let no_groups = json!({"metadata": {"name": "cq"}, "spec": {}});
        // (case, ClusterQueue, the error's text)
        let cases = [
            (
                "another flavor only",
                only_local,
                "ClusterQueue cq has no flavor burst in spec.resourceGroups (its flavors: \
                 local); its quota is not kept",
            ),
            (
                "no resource groups",
                no_groups,
                "ClusterQueue cq has no flavor burst in spec.resourceGroups (its flavors: \
                 none); its quota is not kept",
            ),
        ];
        for (case, cq, want) in cases {
            let error = kueue_quota(&cq, "burst", &node).unwrap_err();
            assert_eq!(error.to_string(), want, "{case}");
        }
    }

    #[test]
    fn targets_parse_as_cluster_queue_and_flavor() {
        let ok = |cq: &str, flavor: &str| {
            Ok(QuotaTarget {
                cluster_queue: cq.to_owned(),
                flavor: flavor.to_owned(),
            })
        };
        // (text, Ok(target) or Err(part of the message))
        let cases: [(&str, Result<QuotaTarget, &str>); 9] = [
            ("cluster-queue/burst", ok("cluster-queue", "burst")),
            ("team.a/vk.burst-1", ok("team.a", "vk.burst-1")),
            ("cluster-queue", Err("must be CLUSTERQUEUE/FLAVOR")),
            ("/burst", Err("the ClusterQueue \"\"")),
            ("cluster-queue/", Err("the flavor \"\"")),
            ("Cluster/burst", Err("the ClusterQueue \"Cluster\"")),
            ("cq/burst/x", Err("the flavor \"burst/x\"")),
            ("cq/-burst", Err("the flavor \"-burst\"")),
            ("cq/a..b", Err("the flavor \"a..b\"")),
        ];
        for (text, want) in cases {
            match (parse_target(text), want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{text}"),
                (Err(got), Err(want)) => assert!(got.contains(want), "{text}: {got}"),
                (got, want) => panic!("{text}: got {got:?}, want {want:?}"),
            }
        }
        assert_eq!(
            parse_target(&format!("{}/b", "a".repeat(254))).map(drop),
            Err(format!(
                "{:?}: the ClusterQueue {:?} is not a DNS subdomain name (lowercase \
                 alphanumerics, '-' and '.', at most 253)",
                format!("{}/b", "a".repeat(254)),
                "a".repeat(254)
            ))
        );
    }
}
