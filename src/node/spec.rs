//! The virtual Node object, built from configuration and the lower cluster's capacity.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    DaemonEndpoint, Node, NodeAddress, NodeCondition, NodeDaemonEndpoints, NodeSpec, NodeStatus,
    NodeSystemInfo, Taint,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

/// Everything the node reports that does not come from watches.
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// `--nodename`.
    pub name: String,
    /// `--os`, lower-cased for labels and nodeInfo.
    pub os: String,
    /// The `clusterID` label (users select a virtual node by it).
    pub cluster_id: String,
    /// The node's taint, unless `--disable-taint`.
    pub taint: Option<Taint>,
    /// InternalIP address.
    pub address: String,
    /// `KUBELET_PORT`.
    pub kubelet_port: i32,
    /// Lower API server version, reported as kubelet version.
    pub lower_version: String,
    /// For one group of a member of `node` or `label=<key>` granularity, the labels its
    /// lower nodes agree on ([`super::groups::Group::labels`]), shown over tensile's own;
    /// empty for a member that is one virtual node.
    pub group_labels: BTreeMap<String, String>,
    /// For one group, which lower nodes are behind it
    /// ([`super::groups::LOWER_SELECTOR_ANNOTATION`]); `None` for a member that is one
    /// virtual node.
    pub lower_selector: Option<String>,
}

/// The annotations tensile writes on the virtual node: the group's lower selector.
pub fn node_annotations(config: &NodeConfig) -> BTreeMap<String, String> {
    config
        .lower_selector
        .iter()
        .map(|s| {
            (
                super::groups::LOWER_SELECTOR_ANNOTATION.to_owned(),
                s.clone(),
            )
        })
        .collect()
}

/// Labels tensile-kube's nodes carry (users' nodeSelectors depend on them).
pub fn node_labels(config: &NodeConfig) -> BTreeMap<String, String> {
    let os = config.os.to_lowercase();
    let own = [
        ("type", "virtual-kubelet"),
        ("kubernetes.io/role", "agent"),
        ("kubernetes.io/hostname", config.name.as_str()),
        ("kubernetes.io/os", os.as_str()),
        ("beta.kubernetes.io/os", os.as_str()),
        ("kubernetes.io/arch", "amd64"),
        ("beta.kubernetes.io/arch", "amd64"),
        ("clusterID", config.cluster_id.as_str()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    super::groups::group_labels(&own, &config.group_labels)
}

/// The Node to create when none exists.
pub fn new_node(config: &NodeConfig) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(config.name.clone()),
            labels: Some(node_labels(config)),
            annotations: Some(node_annotations(config)).filter(|a| !a.is_empty()),
            ..ObjectMeta::default()
        },
        spec: Some(NodeSpec {
            taints: merge_taints(None, config.taint.as_ref()),
            ..NodeSpec::default()
        }),
        status: None,
    }
}

/// The node's taints: every taint others put there (the node lifecycle controller's, an
/// operator's) kept, ours added or updated by key and effect.
pub fn merge_taints(existing: Option<&[Taint]>, ours: Option<&Taint>) -> Option<Vec<Taint>> {
    let mut taints: Vec<Taint> = existing
        .unwrap_or_default()
        .iter()
        .filter(|t| ours.is_none_or(|o| !(t.key == o.key && t.effect == o.effect)))
        .cloned()
        .collect();
    if let Some(ours) = ours {
        taints.push(ours.clone());
    }
    (!taints.is_empty()).then_some(taints)
}

fn condition(type_: &str, status: &str, reason: &str, message: &str, now: &Time) -> NodeCondition {
    NodeCondition {
        type_: type_.into(),
        status: status.into(),
        reason: Some(reason.into()),
        message: Some(message.into()),
        last_heartbeat_time: Some(now.clone()),
        last_transition_time: Some(now.clone()),
    }
}

/// Whether the lower nodes behind a virtual node are ready: a member of `node` or
/// `label=<key>` granularity shows a group whose lower nodes are all NotReady as NotReady.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum LowerReadiness {
    /// Some lower node behind it is Ready (always, for a member that is one virtual node).
    #[default]
    Ready,
    /// Every lower node of this group (its key) is NotReady.
    GroupNotReady(String),
}

impl LowerReadiness {
    /// The readiness of group `key` whose lower nodes are (some) `ready`.
    pub fn of_group(key: &str, ready: bool) -> Self {
        if ready {
            Self::Ready
        } else {
            Self::GroupNotReady(key.to_owned())
        }
    }
}

/// The reason of a group's NotReady condition.
pub const LOWER_NODES_NOT_READY: &str = "LowerNodesNotReady";

/// The status to write: capacity = allocatable = what the lower cluster offers;
/// conditions healthy but Ready, which follows `readiness` (and the node goes NotReady
/// through its Lease when the lower cluster stops answering); transition times kept from
/// `previous` where a condition did not change.
pub fn node_status(
    config: &NodeConfig,
    capacity: &BTreeMap<String, Quantity>,
    readiness: &LowerReadiness,
    previous: Option<&NodeStatus>,
    now: Time,
) -> NodeStatus {
    let ready = match readiness {
        LowerReadiness::Ready => condition(
            "Ready",
            "True",
            "KubeletReady",
            "tensile virtual node: lower cluster reachable",
            &now,
        ),
        LowerReadiness::GroupNotReady(group) => condition(
            "Ready",
            "False",
            LOWER_NODES_NOT_READY,
            &format!("tensile virtual node: every lower node of group {group} is NotReady"),
            &now,
        ),
    };
    let mut conditions = vec![
        ready,
        condition(
            "MemoryPressure",
            "False",
            "KubeletHasSufficientMemory",
            "kubelet has sufficient memory available",
            &now,
        ),
        condition(
            "DiskPressure",
            "False",
            "KubeletHasNoDiskPressure",
            "kubelet has no disk pressure",
            &now,
        ),
        condition(
            "PIDPressure",
            "False",
            "KubeletHasSufficientPID",
            "kubelet has sufficient PID available",
            &now,
        ),
    ];
    let previous_conditions = previous.and_then(|s| s.conditions.as_ref());
    for condition in &mut conditions {
        let unchanged = previous_conditions
            .and_then(|cs| cs.iter().find(|c| c.type_ == condition.type_))
            .filter(|c| c.status == condition.status);
        if let Some(before) = unchanged {
            condition
                .last_transition_time
                .clone_from(&before.last_transition_time);
        }
    }
    let os = config.os.to_lowercase();
    NodeStatus {
        capacity: Some(capacity.clone()),
        allocatable: Some(capacity.clone()),
        conditions: Some(conditions),
        addresses: Some(vec![
            NodeAddress {
                type_: "InternalIP".into(),
                address: config.address.clone(),
            },
            NodeAddress {
                type_: "Hostname".into(),
                address: config.name.clone(),
            },
        ]),
        daemon_endpoints: Some(NodeDaemonEndpoints {
            kubelet_endpoint: Some(DaemonEndpoint {
                port: config.kubelet_port,
            }),
        }),
        node_info: Some(NodeSystemInfo {
            architecture: "amd64".into(),
            operating_system: os,
            kubelet_version: config.lower_version.clone(),
            kube_proxy_version: String::new(),
            container_runtime_version: format!("tensile://{}", env!("CARGO_PKG_VERSION")),
            ..NodeSystemInfo::default()
        }),
        ..NodeStatus::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A status's Ready condition.
    fn ready_condition(s: &NodeStatus) -> NodeCondition {
        s.conditions
            .as_ref()
            .unwrap()
            .iter()
            .find(|c| c.type_ == "Ready")
            .cloned()
            .unwrap()
    }
    use k8s_openapi::jiff::Timestamp;

    fn config() -> NodeConfig {
        NodeConfig {
            name: "vk-node".into(),
            os: "Linux".into(),
            cluster_id: "vk-node".into(),
            taint: Some(Taint {
                key: "virtual-kubelet.io/provider".into(),
                value: Some("k8s".into()),
                effect: "NoSchedule".into(),
                time_added: None,
            }),
            address: "10.0.0.5".into(),
            kubelet_port: 10250,
            lower_version: "v1.36.3".into(),
            group_labels: BTreeMap::new(),
            lower_selector: None,
        }
    }

    #[test]
    fn labels_are_tensile_kubes() {
        let labels = node_labels(&config());
        for (k, v) in [
            ("type", "virtual-kubelet"),
            ("kubernetes.io/role", "agent"),
            ("kubernetes.io/hostname", "vk-node"),
            ("kubernetes.io/os", "linux"),
            ("kubernetes.io/arch", "amd64"),
            ("clusterID", "vk-node"),
        ] {
            assert_eq!(labels.get(k).map(String::as_str), Some(v), "{k}");
        }
    }

    #[test]
    fn a_group_shows_what_its_lower_nodes_agree_on() {
        let plain = node_labels(&config());
        let zoned = NodeConfig {
            name: "vk-node-a".into(),
            group_labels: [
                ("topology.kubernetes.io/zone", "a"),
                ("kubernetes.io/arch", "arm64"),
                ("type", "not-ours"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
            ..config()
        };
        let labels = node_labels(&zoned);
        let get = |k: &str| labels.get(k).map(String::as_str);
        assert_eq!(get("topology.kubernetes.io/zone"), Some("a"));
        assert_eq!(get("kubernetes.io/arch"), Some("arm64"));
        assert_eq!(get("type"), Some("virtual-kubelet"), "tensile's own kept");
        assert_eq!(get("kubernetes.io/hostname"), Some("vk-node-a"));
        // Without group labels: exactly tensile-kube's set, as before.
        assert_eq!(plain.len(), 8);
        assert!(!plain.contains_key("topology.kubernetes.io/zone"));
    }

    #[test]
    fn taints_merge() {
        let ours = config().taint;
        let unreachable = Taint {
            key: "node.kubernetes.io/unreachable".into(),
            effect: "NoSchedule".into(),
            ..Taint::default()
        };
        let stale_ours = Taint {
            value: Some("old".into()),
            ..ours.clone().unwrap()
        };
        type Case<'a> = (&'a str, Option<Vec<Taint>>, Option<&'a Taint>, Vec<&'a str>);
        let cases: Vec<Case> = vec![
            ("none, none", None, None, vec![]),
            (
                "ours added",
                None,
                ours.as_ref(),
                vec!["virtual-kubelet.io/provider=k8s"],
            ),
            (
                "others kept",
                Some(vec![unreachable.clone()]),
                ours.as_ref(),
                vec![
                    "node.kubernetes.io/unreachable=",
                    "virtual-kubelet.io/provider=k8s",
                ],
            ),
            (
                "ours updated",
                Some(vec![stale_ours]),
                ours.as_ref(),
                vec!["virtual-kubelet.io/provider=k8s"],
            ),
            (
                "disabled: others kept",
                Some(vec![unreachable]),
                None,
                vec!["node.kubernetes.io/unreachable="],
            ),
        ];
        for (name, existing, ours, want) in cases {
            let got: Vec<String> = merge_taints(existing.as_deref(), ours)
                .unwrap_or_default()
                .iter()
                .map(|t| format!("{}={}", t.key, t.value.as_deref().unwrap_or_default()))
                .collect();
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn status_reports_capacity_version_and_endpoint() {
        let capacity: BTreeMap<String, Quantity> =
            [("cpu".to_owned(), Quantity("24".into()))].into();
        let now = Time(Timestamp::from_second(1_000).unwrap());
        let status = node_status(
            &config(),
            &capacity,
            &LowerReadiness::Ready,
            None,
            now.clone(),
        );
        assert_eq!(status.capacity, Some(capacity.clone()));
        assert_eq!(status.allocatable, Some(capacity.clone()));
        assert_eq!(
            status.node_info.as_ref().unwrap().kubelet_version,
            "v1.36.3"
        );
        assert_eq!(
            status
                .daemon_endpoints
                .clone()
                .unwrap()
                .kubelet_endpoint
                .unwrap()
                .port,
            10250
        );
        let ready = ready_condition;
        assert_eq!(ready(&status).status, "True");

        // A later write keeps the transition time of an unchanged condition.
        let later = Time(Timestamp::from_second(2_000).unwrap());
        let again = node_status(
            &config(),
            &capacity,
            &LowerReadiness::Ready,
            Some(&status),
            later.clone(),
        );
        assert_eq!(ready(&again).last_transition_time, Some(now));
        assert_eq!(ready(&again).last_heartbeat_time, Some(later));
    }

    /// A group whose lower nodes are all NotReady is NotReady above, saying which group;
    /// Ready again when one recovers; each flip is a transition, an unchanged status
    /// keeps its transition time.
    #[test]
    fn ready_follows_the_groups_lower_nodes() {
        let capacity = BTreeMap::new();
        let at = |second| Time(Timestamp::from_second(second).unwrap());
        let ready = ready_condition;
        let down = LowerReadiness::of_group("zone-a", false);
        let up = LowerReadiness::of_group("zone-a", true);
        assert_eq!(down, LowerReadiness::GroupNotReady("zone-a".into()));
        assert_eq!(up, LowerReadiness::Ready);
        // (readiness, status, reason, message contains, transition at)
        let cases = [
            (&up, "True", "KubeletReady", "reachable", 1),
            (
                &down,
                "False",
                LOWER_NODES_NOT_READY,
                "every lower node of group zone-a is NotReady",
                2,
            ),
            (&down, "False", LOWER_NODES_NOT_READY, "zone-a", 2),
            (&up, "True", "KubeletReady", "reachable", 4),
        ];
        let mut previous: Option<NodeStatus> = None;
        for (second, (readiness, status, reason, message, transition)) in (1..).zip(cases) {
            let now = node_status(
                &config(),
                &capacity,
                readiness,
                previous.as_ref(),
                at(second),
            );
            let got = ready(&now);
            assert_eq!(got.status, status, "at {second}");
            assert_eq!(got.reason.as_deref(), Some(reason), "at {second}");
            assert!(
                got.message.as_deref().unwrap_or_default().contains(message),
                "at {second}: {:?}",
                got.message
            );
            assert_eq!(
                got.last_transition_time,
                Some(at(transition)),
                "at {second}"
            );
            assert_eq!(got.last_heartbeat_time, Some(at(second)), "at {second}");
            // The other conditions stay healthy.
            let pressure = now
                .conditions
                .as_ref()
                .unwrap()
                .iter()
                .filter(|c| c.type_ != "Ready");
            assert!(pressure.clone().all(|c| c.status == "False"), "at {second}");
            previous = Some(now);
        }
    }
}
