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
    /// The node features every usable lower node declares (`status.declaredFeatures`,
    /// [`crate::node::resources::common_declared_features`]), declared as the virtual
    /// node's own: the API server admits a pod update (an init container's resize) and the
    /// scheduler places a pod that needs one only on a node declaring it.
    pub declared_features: Vec<String>,
    /// For one group of a member of `node` or `label=<key>` granularity, the labels its
    /// lower nodes agree on ([`super::groups::Group::labels`]), shown over tensile's own;
    /// empty for a member that is one virtual node.
    pub group_labels: BTreeMap<String, String>,
    /// For one group, which lower nodes are behind it
    /// ([`super::groups::LOWER_SELECTOR_ANNOTATION`]); `None` for a member that is one
    /// virtual node.
    pub lower_selector: Option<String>,
    /// The member that registers the Node, recorded on it ([`super::owner`]).
    pub owner: super::owner::NodeOwner,
}

/// The annotations tensile writes on the virtual node: its owner and the group's lower
/// selector.
pub fn node_annotations(config: &NodeConfig) -> BTreeMap<String, String> {
    let owner = (
        super::owner::NODE_OWNER_ANNOTATION.to_owned(),
        config.owner.mark().to_owned(),
    );
    let selector = config.lower_selector.iter().map(|s| {
        (
            super::groups::LOWER_SELECTOR_ANNOTATION.to_owned(),
            s.clone(),
        )
    });
    // A group's virtual node records the label keys it is given, to remove those its
    // lower nodes no longer agree on.
    let managed = config.lower_selector.is_some().then(|| {
        let keys: Vec<String> = node_labels(config).into_keys().collect();
        (MANAGED_LABELS_ANNOTATION.to_owned(), keys.join(","))
    });
    std::iter::once(owner)
        .chain(selector)
        .chain(managed)
        .collect()
}

/// The annotation on a group's virtual node listing the label keys tensile wrote there
/// (comma-separated): a key it no longer wants is removed, never one another writer added.
pub const MANAGED_LABELS_ANNOTATION: &str = "tensile.dev/managed-labels";

/// The label keys tensile may have written on a group's virtual node that records none
/// (registered by an earlier release): the documented lower labels and their beta twins.
const MANAGED_BEFORE_RECORDS: [&str; 7] = [
    "topology.kubernetes.io/zone",
    "topology.kubernetes.io/region",
    "node.kubernetes.io/instance-type",
    "kubernetes.io/arch",
    "beta.kubernetes.io/arch",
    "kubernetes.io/os",
    "beta.kubernetes.io/os",
];

/// Labels tensile-kube's nodes carry (users' nodeSelectors depend on them). A group's
/// virtual node shows an architecture only where its lower nodes agree on one (an arm64
/// node joining an amd64 group takes `kubernetes.io/arch` off).
pub fn node_labels(config: &NodeConfig) -> BTreeMap<String, String> {
    let os = config.os.to_lowercase();
    let group = config.lower_selector.is_some();
    let own = [
        crate::translate::meta::VIRTUAL_NODE_LABEL,
        ("kubernetes.io/role", "agent"),
        ("kubernetes.io/hostname", config.name.as_str()),
        ("kubernetes.io/os", os.as_str()),
        ("beta.kubernetes.io/os", os.as_str()),
        ("kubernetes.io/arch", "amd64"),
        ("beta.kubernetes.io/arch", "amd64"),
        ("clusterID", config.cluster_id.as_str()),
    ]
    .into_iter()
    .filter(|(k, _)| !(group && k.ends_with("kubernetes.io/arch")))
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    super::groups::group_labels(&own, &config.group_labels)
}

/// The change to `node`'s labels (a merge patch's `metadata.labels`: a value to set, or
/// null to remove) that makes them `desired`: keys tensile wrote before
/// ([`MANAGED_LABELS_ANNOTATION`]) and no longer wants are removed; `None` when nothing
/// changes. `group`: a group's virtual node (only those record the keys).
pub fn labels_change(
    node: &Node,
    desired: &BTreeMap<String, String>,
    group: bool,
) -> Option<serde_json::Map<String, serde_json::Value>> {
    let current = node.metadata.labels.clone().unwrap_or_default();
    let recorded = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(MANAGED_LABELS_ANNOTATION));
    let managed: Vec<&str> = match recorded {
        Some(keys) => keys.split(',').filter(|k| !k.is_empty()).collect(),
        None if group => MANAGED_BEFORE_RECORDS.to_vec(),
        None => Vec::new(),
    };
    let mut change = serde_json::Map::new();
    for (key, value) in desired {
        if current.get(key) != Some(value) {
            change.insert(key.clone(), value.clone().into());
        }
    }
    for key in managed {
        if !desired.contains_key(key) && current.contains_key(key) {
            change.insert(key.to_owned(), serde_json::Value::Null);
        }
    }
    (!change.is_empty()).then_some(change)
}

/// The Node to create when none exists.
pub fn new_node(config: &NodeConfig) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(config.name.clone()),
            labels: Some(node_labels(config)),
            annotations: Some(node_annotations(config)),
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
        declared_features: (!config.declared_features.is_empty())
            .then(|| config.declared_features.clone()),
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
            container_runtime_version: format!(
                "{}{}",
                super::owner::TENSILE_RUNTIME,
                env!("CARGO_PKG_VERSION")
            ),
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
            declared_features: vec!["InPlacePodVerticalScalingInitContainers".into()],
            group_labels: BTreeMap::new(),
            lower_selector: None,
            owner: crate::node::owner::NodeOwner::new("vk-node", None),
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

    /// A group's virtual node loses the labels tensile wrote and no longer wants (recorded,
    /// or the documented ones on a Node of an earlier release), never another writer's; a
    /// member's one node removes nothing.
    #[test]
    fn labels_no_longer_agreed_leave_the_node() {
        let node = |labels: serde_json::Value, managed: Option<&str>| -> Node {
            let mut node = serde_json::json!({"metadata": {"name": "vk-gpu", "labels": labels}});
            if let Some(managed) = managed {
                node["metadata"]["annotations"] =
                    serde_json::json!({ MANAGED_LABELS_ANNOTATION: managed });
            }
            serde_json::from_value(node).unwrap()
        };
        let desired: BTreeMap<String, String> = [("type", "virtual-kubelet"), ("pool", "gpu")]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        let now = serde_json::json!({
            "type": "virtual-kubelet", "pool": "gpu", "kubernetes.io/arch": "amd64",
            "topology.kubernetes.io/zone": "z1", "team": "theirs",
        });
        type Case<'a> = (&'a str, Node, bool, Option<serde_json::Value>);
        let cases: Vec<Case> = vec![
            (
                "recorded keys no longer agreed go; another writer's stays",
                node(
                    now.clone(),
                    Some("type,pool,kubernetes.io/arch,topology.kubernetes.io/zone"),
                ),
                true,
                Some(serde_json::json!({
                    "kubernetes.io/arch": null, "topology.kubernetes.io/zone": null,
                })),
            ),
            (
                "an earlier release's group node: the documented keys",
                node(now.clone(), None),
                true,
                Some(serde_json::json!({
                    "kubernetes.io/arch": null, "topology.kubernetes.io/zone": null,
                })),
            ),
            (
                "a member's one node removes nothing",
                node(now.clone(), None),
                false,
                None,
            ),
            (
                "a value changed and one missing",
                node(serde_json::json!({"type": "x"}), Some("type,pool")),
                true,
                Some(serde_json::json!({"type": "virtual-kubelet", "pool": "gpu"})),
            ),
            (
                "as wanted",
                node(
                    serde_json::json!({"type": "virtual-kubelet", "pool": "gpu"}),
                    Some("type,pool"),
                ),
                true,
                None,
            ),
        ];
        for (what, node, group, want) in cases {
            let got = labels_change(&node, &desired, group).map(serde_json::Value::Object);
            assert_eq!(got, want, "{what}");
        }
    }

    /// A group's virtual node shows an architecture only where its lower nodes agree on
    /// one, and records the keys it is given.
    #[test]
    fn a_group_shows_no_architecture_its_nodes_do_not_agree_on() {
        let group = NodeConfig {
            lower_selector: Some("pool=gpu".into()),
            ..config()
        };
        let labels = node_labels(&group);
        assert!(!labels.contains_key("kubernetes.io/arch"), "{labels:?}");
        assert!(
            !labels.contains_key("beta.kubernetes.io/arch"),
            "{labels:?}"
        );
        let managed = node_annotations(&group);
        assert_eq!(
            managed.get(MANAGED_LABELS_ANNOTATION).map(String::as_str),
            Some(
                labels
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(",")
                    .as_str()
            )
        );
        assert_eq!(
            managed
                .get(crate::node::owner::NODE_OWNER_ANNOTATION)
                .map(String::as_str),
            Some("nodename/vk-node")
        );
        let agreed = NodeConfig {
            group_labels: [("kubernetes.io/arch".to_owned(), "arm64".to_owned())].into(),
            ..group
        };
        assert_eq!(
            node_labels(&agreed)
                .get("kubernetes.io/arch")
                .map(String::as_str),
            Some("arm64")
        );
        assert!(!node_annotations(&config()).contains_key(MANAGED_LABELS_ANNOTATION));
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
            status.declared_features,
            Some(vec!["InPlacePodVerticalScalingInitContainers".to_owned()]),
            "the lower nodes' features, declared as its own"
        );
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
