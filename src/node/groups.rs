//! Node granularity (pure): a member shows its lower cluster as one virtual node (`cluster`,
//! the default), one per lower node (`node`), or one per value of a lower node label
//! (`label=<key>`), so that the upper scheduler's topology spread, affinity and fit see
//! the lower cluster's shape.
//!
//! Here: the granularity's parsing, the group a lower node belongs to, the virtual node's
//! name, the labels a group shows (those with one value across its lower nodes, from
//! [`TOPOLOGY_LABELS`] and `--lower-node-labels`), its readiness and cordon, and the
//! requirement that confines a pod's lower copy to the group ([`group_requirement`],
//! [`Confinement::apply`]). The capacity of
//! a group is [`super::capacity::LowerCapacity::capacity_of`] over [`Group::members`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::str::FromStr;
use std::sync::{PoisonError, RwLock};

use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use tracing::warn;

use super::capacity::LowerCapacity;

use crate::translate::hash::fnv1a;
pub use crate::translate::scheduling::{Confinement, Placement};

/// The member annotation and flag (`--node-granularity`) value: `cluster`, `node` or
/// `label=<key>`.
pub const GRANULARITY_ANNOTATION: &str = "tensile.dev/node-granularity";
/// The member annotation (and flag `--lower-node-labels`): comma-separated label keys or
/// patterns (`*` matches any run of characters) that a group's virtual node shows when its
/// lower nodes agree on their value, beside [`TOPOLOGY_LABELS`].
pub const LOWER_NODE_LABELS_ANNOTATION: &str = "tensile.dev/lower-node-labels";
/// The lower node labels a group's virtual node always shows when its lower nodes agree on
/// their value.
pub const TOPOLOGY_LABELS: [&str; 5] = [
    "topology.kubernetes.io/zone",
    "topology.kubernetes.io/region",
    "node.kubernetes.io/instance-type",
    "kubernetes.io/arch",
    "kubernetes.io/os",
];
/// The labels tensile writes on every virtual node and never takes from below.
const OWN_LABELS: [&str; 5] = [
    "type",
    "kubernetes.io/role",
    HOSTNAME_LABEL,
    "clusterID",
    super::burst::BURST_PRIORITY_LABEL,
];
/// The label on each virtual node of a member of `node` or `label=<key>` granularity: its
/// member's `--nodename` (the name a `cluster` member's one node has), which joins the
/// node with its member (`virtual-node status`). Set over any lower node's value.
pub const MEMBER_NODE_LABEL: &str = "tensile.dev/member-node";
/// The annotation on each virtual node of a member of `node` or `label=<key>` granularity:
/// which lower nodes are behind it, `metadata.name=<lower node>` or `<key>=<value>` (the
/// requirement its pods' lower copies get, [`group_requirement`]). The scheduler extender
/// reads it to check a pod against those lower nodes only ([`parse_lower_selector`]).
pub const LOWER_SELECTOR_ANNOTATION: &str = "tensile.dev/lower-node-selector";
/// The label keys a kubelet may set on its own Node under the NodeRestriction admission
/// plugin (Kubernetes' `kubeletLabels`, `k8s.io/kubelet/pkg/apis/well_known_labels.go`);
/// every other key of [`KUBERNETES_NAMESPACES`] outside [`KUBELET_NAMESPACES`] is refused
/// from below ([`refused_from_below`]).
const KUBELET_LABELS: [&str; 11] = [
    HOSTNAME_LABEL,
    "topology.kubernetes.io/zone",
    "topology.kubernetes.io/region",
    "failure-domain.beta.kubernetes.io/zone",
    "failure-domain.beta.kubernetes.io/region",
    "beta.kubernetes.io/instance-type",
    "node.kubernetes.io/instance-type",
    "kubernetes.io/os",
    "kubernetes.io/arch",
    "beta.kubernetes.io/os",
    "beta.kubernetes.io/arch",
];
/// The label namespaces (each with its subdomains) a kubelet may set any key of on its own
/// Node (Kubernetes' `kubeletLabelNamespaces`).
const KUBELET_NAMESPACES: [&str; 2] = ["kubelet.kubernetes.io", "node.kubernetes.io"];
/// The label namespaces (each with its subdomains) Kubernetes reserves: NodeRestriction
/// lets a kubelet set only [`KUBELET_LABELS`] and [`KUBELET_NAMESPACES`] of them.
const KUBERNETES_NAMESPACES: [&str; 2] = ["kubernetes.io", "k8s.io"];
/// The label namespaces (each with its subdomains) no lower node label of ever reaches a
/// virtual node: NodeRestriction's own (labels a node cannot set on itself, so that
/// workloads can trust them) and tensile's.
const REFUSED_NAMESPACES: [&str; 2] = ["node-restriction.kubernetes.io", "tensile.dev"];
/// The well-known hostname label.
const HOSTNAME_LABEL: &str = "kubernetes.io/hostname";
/// The field a node-granularity group's pods are confined by: the lower node's name (its
/// hostname label may differ from its name; the DaemonSet controller pins pods the same way).
const NODE_NAME_FIELD: &str = "metadata.name";
/// A Node name here is a DNS-1123 label: it is also the value of its hostname label.
const MAX_NAME: usize = 63;
/// Hex digits of the hash suffix of a name that was cut or changed.
const HASH_DIGITS: usize = 8;

/// How a member's lower cluster is shown upstairs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Granularity {
    /// One virtual node, `--nodename` (today's behaviour).
    #[default]
    Cluster,
    /// One virtual node per lower node.
    Node,
    /// One virtual node per value of this lower node label; lower nodes without it are
    /// in no group (offered nowhere).
    Label(String),
}

impl fmt::Display for Granularity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Granularity::Cluster => f.write_str("cluster"),
            Granularity::Node => f.write_str("node"),
            Granularity::Label(key) => write!(f, "label={key}"),
        }
    }
}

impl FromStr for Granularity {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        parse_granularity(text)
    }
}

/// Parses `cluster` (or empty), `node`, or `label=<key>` with `<key>` a label key.
pub fn parse_granularity(text: &str) -> Result<Granularity, String> {
    let text = text.trim();
    match text {
        "" | "cluster" => return Ok(Granularity::Cluster),
        "node" => return Ok(Granularity::Node),
        _ => {}
    }
    let Some(key) = text.strip_prefix("label=") else {
        return Err("must be cluster, node or label=<label key>".into());
    };
    let key = key.trim();
    check_label_key(key)?;
    Ok(Granularity::Label(key.to_owned()))
}

/// Whether `key` is a label key: `[prefix/]name`, the prefix a DNS subdomain, the name at
/// most 63 alphanumerics, `-`, `_`, `.`, starting and ending alphanumeric.
fn check_label_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.rsplit_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    let name_ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && alnum(name.chars().next())
        && alnum(name.chars().last())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !name_ok {
        return Err(format!("{key:?} is not a label key"));
    }
    if let Some(prefix) = prefix {
        let prefix_ok = !prefix.is_empty()
            && prefix.len() <= 253
            && prefix.split('.').all(|part| {
                !part.is_empty()
                    && part.len() <= MAX_NAME
                    && !part.starts_with('-')
                    && !part.ends_with('-')
                    && part
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            });
        if !prefix_ok {
            return Err(format!("{key:?}: the prefix is not a DNS subdomain"));
        }
    }
    Ok(())
}

/// Label keys or patterns (`*` matches any run of characters), from `--lower-node-labels`
/// or its annotation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LabelPatterns(Vec<String>);

impl LabelPatterns {
    /// Whether `key` is one of [`TOPOLOGY_LABELS`] or matches a pattern.
    pub fn shows(&self, key: &str) -> bool {
        TOPOLOGY_LABELS.contains(&key) || self.0.iter().any(|p| glob(p, key))
    }
}

impl FromStr for LabelPatterns {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        parse_label_patterns(text)
    }
}

/// Parses comma-separated label keys or patterns; empty is none beyond the documented list.
pub fn parse_label_patterns(text: &str) -> Result<LabelPatterns, String> {
    let mut patterns = Vec::new();
    for pattern in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if pattern.chars().all(|c| c == '*') {
            return Err(format!(
                "{pattern:?} would show every lower node label: name the keys, or a prefix \
                 such as example.com/*"
            ));
        }
        // A pattern is a label key once its `*`s are letters.
        check_label_key(&pattern.replace('*', "x"))
            .map_err(|_| format!("{pattern:?} is not a label key or pattern"))?;
        patterns.push(pattern.to_owned());
    }
    Ok(LabelPatterns(patterns))
}

/// Whether lower node label `key` is refused on a virtual node whatever
/// `--lower-node-labels` matches: a key a kubelet may not set on its own Node under the
/// NodeRestriction admission plugin (`node-restriction.kubernetes.io/`, and any
/// `kubernetes.io` or `k8s.io` key, the domain or a subdomain, outside the kubelet's own
/// [`KUBELET_LABELS`] and [`KUBELET_NAMESPACES`]), or one of tensile's (`tensile.dev/`).
/// A lower admin could otherwise put `node-role.kubernetes.io/control-plane` or a
/// `node-restriction.kubernetes.io/` label on the upper virtual node and draw the
/// workloads steered by it.
pub fn refused_from_below(key: &str) -> bool {
    // As NodeRestriction reads a key: the namespace is what comes before the first `/`.
    let Some((namespace, _)) = key.split_once('/') else {
        return false;
    };
    let within = |domains: &[&str]| domains.iter().any(|d| in_domain(namespace, d));
    if within(&REFUSED_NAMESPACES) {
        return true;
    }
    within(&KUBERNETES_NAMESPACES) && !KUBELET_LABELS.contains(&key) && !within(&KUBELET_NAMESPACES)
}

/// Whether `namespace` is `domain` or one of its subdomains.
fn in_domain(namespace: &str, domain: &str) -> bool {
    namespace
        .strip_suffix(domain)
        .is_some_and(|rest| rest.is_empty() || rest.ends_with('.'))
}

/// Whether `text` matches `pattern`, where `*` matches any run of characters.
fn glob(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        // No `*`: the whole text must be the pattern.
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// The group of lower node `node` under `granularity`: `""` for `cluster` (one group), the
/// node's name for `node`, the label's value for `label=<key>` (`None` without the label).
pub fn group_of(granularity: &Granularity, node: &Node) -> Option<String> {
    match granularity {
        Granularity::Cluster => Some(String::new()),
        Granularity::Node => node.metadata.name.clone(),
        Granularity::Label(key) => node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(key))
            .cloned(),
    }
}

/// The virtual node of group `group`: `base` (`--nodename`) for `cluster`, else
/// `<base>-<group>` made a DNS-1123 label: lower-cased, other characters turned into `-`;
/// when that changed the group or the name is longer than 63 characters, it is cut and
/// ends in `-` and 8 hex digits of a hash of `base` and the group as they were, so the
/// name is the same on every start and two groups never share it.
pub fn virtual_node_name(base: &str, granularity: &Granularity, group: &str) -> String {
    if *granularity == Granularity::Cluster {
        return base.to_owned();
    }
    let tidy: String = group
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9' | '-') => c,
            _ => '-',
        })
        .collect();
    let tidy = tidy.trim_matches('-');
    let name = if tidy.is_empty() {
        base.to_owned()
    } else {
        format!("{base}-{tidy}")
    };
    if tidy == group && !group.is_empty() && name.len() <= MAX_NAME {
        return name;
    }
    let hash = fnv1a(format!("{base}/{group}").as_bytes());
    let mut cut = name;
    cut.truncate(MAX_NAME - HASH_DIGITS - 1);
    let cut = cut.trim_end_matches('-');
    let hex = format!("{hash:016x}");
    format!("{cut}-{}", &hex[..HASH_DIGITS])
}

/// What confines a group's pods below: the lower node by name (`node`), or the label's
/// value (`label=<key>`); `None` for `cluster`.
pub fn group_requirement(granularity: &Granularity, group: &str) -> Option<Confinement> {
    let (placement, key) = match granularity {
        Granularity::Cluster => return None,
        Granularity::Node => (Placement::Field, NODE_NAME_FIELD),
        Granularity::Label(key) => (Placement::Expression, key.as_str()),
    };
    Some(Confinement {
        placement,
        requirement: NodeSelectorRequirement {
            key: key.to_owned(),
            operator: "In".to_owned(),
            values: Some(vec![group.to_owned()]),
        },
    })
}

/// [`LOWER_SELECTOR_ANNOTATION`]'s value for a group's confinement: `<key>=<value>`, the key
/// `metadata.name` for a field (`node` granularity).
pub fn lower_selector(confinement: &Confinement) -> String {
    let requirement = &confinement.requirement;
    let value = requirement
        .values
        .as_deref()
        .and_then(<[String]>::first)
        .map_or("", String::as_str);
    format!("{}={value}", requirement.key)
}

/// The confinement a [`LOWER_SELECTOR_ANNOTATION`] value names: `metadata.name=<node>` is
/// the lower node by name, `<key>=<value>` a label; `None` when it is not `<key>=<value>`
/// with a label key (an annotation a person wrote by hand, or a later format).
pub fn parse_lower_selector(text: &str) -> Option<Confinement> {
    let (key, value) = text.trim().split_once('=')?;
    let placement = if key == NODE_NAME_FIELD {
        Placement::Field
    } else {
        check_label_key(key).ok()?;
        Placement::Expression
    };
    Some(Confinement {
        placement,
        requirement: NodeSelectorRequirement {
            key: key.to_owned(),
            operator: "In".to_owned(),
            values: Some(vec![value.to_owned()]),
        },
    })
}

/// A lower node, as far as its group needs it.
#[derive(Clone, Debug, PartialEq)]
struct LowerNode {
    group: Option<String>,
    /// Only the labels a group may show.
    labels: BTreeMap<String, String>,
    ready: bool,
    unschedulable: bool,
}

/// One group: the lower nodes of one virtual node.
#[derive(Clone, Debug, PartialEq)]
pub struct Group {
    /// The group's key ([`group_of`]).
    pub key: String,
    /// The virtual node's name ([`virtual_node_name`]).
    pub name: String,
    /// Its lower nodes, by name.
    pub members: BTreeSet<String>,
    /// The labels its lower nodes agree on (documented list, patterns, and the grouping
    /// label itself), to show beside tensile's own.
    pub labels: BTreeMap<String, String>,
    /// Whether any of its lower nodes is Ready (all NotReady below: NotReady above).
    pub ready: bool,
    /// Whether every one of its lower nodes is cordoned below.
    pub cordoned: bool,
}

/// The lower nodes grouped under a granularity, kept from the lower node watch.
#[derive(Clone, Debug)]
pub struct Groups {
    base: String,
    granularity: Granularity,
    patterns: LabelPatterns,
    nodes: HashMap<String, LowerNode>,
    groups: BTreeMap<String, BTreeSet<String>>,
    /// The nodes a relist under way has listed.
    relisted: Option<BTreeSet<String>>,
    /// Per lower node, the labels its group would show but [`refused_from_below`] refuses
    /// (warned of when they change).
    refused: HashMap<String, BTreeSet<String>>,
}

impl Groups {
    /// No lower nodes yet; virtual nodes named from `base` (`--nodename`).
    pub fn new(base: &str, granularity: Granularity, patterns: LabelPatterns) -> Self {
        Self {
            base: base.to_owned(),
            granularity,
            patterns,
            nodes: HashMap::new(),
            groups: BTreeMap::new(),
            relisted: None,
            refused: HashMap::new(),
        }
    }

    /// A relist of the lower nodes begins.
    pub fn relist_start(&mut self) {
        self.relisted = Some(BTreeSet::new());
    }

    /// A relist is complete: the nodes it did not list are gone. Returns the groups that
    /// changed.
    pub fn relist_done(&mut self) -> BTreeSet<String> {
        let Some(listed) = self.relisted.take() else {
            return BTreeSet::new();
        };
        let gone: Vec<String> = self
            .nodes
            .keys()
            .filter(|n| !listed.contains(*n))
            .cloned()
            .collect();
        gone.iter().flat_map(|n| self.delete_node(n)).collect()
    }

    /// A lower node was added or changed; returns the keys of the groups that changed
    /// (the one it left and the one it joined; none when nothing a group shows changed).
    pub fn apply_node(&mut self, node: &Node) -> BTreeSet<String> {
        let Some(name) = node.metadata.name.clone() else {
            return BTreeSet::new();
        };
        let shows = |key: &str| {
            self.patterns.shows(key)
                || matches!(&self.granularity, Granularity::Label(k) if k == key)
        };
        let (refused, labels): (BTreeMap<String, String>, _) = node
            .metadata
            .labels
            .iter()
            .flatten()
            .filter(|(k, _)| shows(k) && !OWN_LABELS.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .partition(|(k, _)| refused_from_below(k));
        if let Some(keys) = self.note_refused(&name, refused.into_keys().collect()) {
            warn!(
                node = %name,
                cluster = "lower",
                member = %self.base,
                labels = %keys,
                "lower node labels refused: never shown on a virtual node (keys a kubelet may \
                 not set on its own Node, or tensile's), whatever --lower-node-labels matches"
            );
        }
        let seen = LowerNode {
            group: group_of(&self.granularity, node),
            labels,
            ready: node_ready(node),
            unschedulable: node
                .spec
                .as_ref()
                .and_then(|s| s.unschedulable)
                .unwrap_or(false),
        };
        if let Some(listed) = self.relisted.as_mut() {
            listed.insert(name.clone());
        }
        if self.nodes.get(&name) == Some(&seen) {
            return BTreeSet::new();
        }
        let mut changed = self.leave_group(&name);
        if let Some(group) = &seen.group {
            self.groups
                .entry(group.clone())
                .or_default()
                .insert(name.clone());
            changed.insert(group.clone());
        }
        self.nodes.insert(name, seen);
        changed
    }

    /// Records `refused`, the labels of lower node `name` its group would show but
    /// [`refused_from_below`] refuses; returns them, comma-separated, when they changed
    /// and are not none: what [`Groups::apply_node`] warns of, once per change rather than
    /// on every event of the node.
    fn note_refused(&mut self, name: &str, refused: BTreeSet<String>) -> Option<String> {
        if refused.is_empty() {
            self.refused.remove(name);
            return None;
        }
        if self.refused.get(name) == Some(&refused) {
            return None;
        }
        let keys = refused
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(",");
        self.refused.insert(name.to_owned(), refused);
        Some(keys)
    }

    /// A lower node was deleted; returns the key of the group it left, if any.
    pub fn delete_node(&mut self, name: &str) -> BTreeSet<String> {
        self.refused.remove(name);
        self.leave_group(name)
    }

    /// Forgets lower node `name` and takes it out of its group; returns that group's key.
    fn leave_group(&mut self, name: &str) -> BTreeSet<String> {
        let Some(gone) = self.nodes.remove(name) else {
            return BTreeSet::new();
        };
        let Some(group) = gone.group else {
            return BTreeSet::new();
        };
        if let Some(members) = self.groups.get_mut(&group) {
            members.remove(name);
            if members.is_empty() {
                self.groups.remove(&group);
            }
        }
        BTreeSet::from([group])
    }

    /// The keys of every group that has lower nodes.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.groups.keys().map(String::as_str)
    }

    /// Group `key`, if it has lower nodes.
    pub fn group(&self, key: &str) -> Option<Group> {
        let members = self.groups.get(key)?;
        let nodes: Vec<&LowerNode> = members.iter().filter_map(|m| self.nodes.get(m)).collect();
        let mut labels = nodes.first().map(|n| n.labels.clone()).unwrap_or_default();
        labels.retain(|k, v| nodes.iter().all(|n| n.labels.get(k) == Some(v)));
        labels.insert(MEMBER_NODE_LABEL.to_owned(), self.base.clone());
        Some(Group {
            key: key.to_owned(),
            name: virtual_node_name(&self.base, &self.granularity, key),
            members: members.clone(),
            labels,
            ready: nodes.iter().any(|n| n.ready),
            cordoned: nodes.iter().all(|n| n.unschedulable),
        })
    }
}

/// What one group's virtual node offers: the group and its capacity.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupOffer {
    /// The group (name, lower nodes, labels, readiness, cordon).
    pub group: Group,
    /// [`LowerCapacity::capacity_of`] its lower nodes.
    pub capacity: BTreeMap<String, Quantity>,
}

/// Every group's offer, by group key: what a member of `node` or `label=<key>` granularity
/// registers and keeps current, one virtual node each. Walks each group's lower nodes once.
pub fn offers(groups: &Groups, capacity: &LowerCapacity) -> BTreeMap<String, GroupOffer> {
    groups
        .keys()
        .filter_map(|key| groups.group(key))
        .map(|group| {
            let capacity = capacity.capacity_of(group.members.iter().map(String::as_str));
            (group.key.clone(), GroupOffer { group, capacity })
        })
        .collect()
}

/// Whether a lower node's Ready condition is True.
fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status == "True")
}

/// A group's virtual node's labels: tensile's own (`own`, [`super::spec::node_labels`] of
/// the group's node, whose hostname is the virtual node's name) with the group's agreed
/// labels over them, except tensile's own marks; `beta.kubernetes.io/{arch,os}` follow
/// their GA label.
pub fn group_labels(
    own: &BTreeMap<String, String>,
    group: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    let mut labels = own.clone();
    for (key, value) in group {
        if OWN_LABELS.contains(&key.as_str()) {
            continue;
        }
        labels.insert(key.clone(), value.clone());
        if let Some(ga) = key.strip_prefix("kubernetes.io/")
            && matches!(ga, "arch" | "os")
        {
            labels.insert(format!("beta.kubernetes.io/{ga}"), value.clone());
        }
    }
    labels
}

/// The virtual nodes a member of `node` or `label=<key>` granularity has registered (or is
/// registering), by name, each with what confines its pods below: what its controllers
/// read to know an upper pod bound to one of them as theirs, and where its copy goes.
/// A group gone below keeps its entry until its virtual node is drained and deleted.
#[derive(Debug, Default)]
pub struct GroupNodes {
    nodes: RwLock<BTreeMap<String, Option<Confinement>>>,
}

impl GroupNodes {
    /// Adds (or replaces) the virtual node `name`.
    pub fn insert(&self, name: &str, confinement: Option<Confinement>) {
        self.nodes
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(name.to_owned(), confinement);
    }

    /// Forgets the virtual node `name` (its Node deleted, its pods gone).
    pub fn remove(&self, name: &str) {
        self.nodes
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(name);
    }

    /// Whether `name` is one of the member's virtual nodes.
    pub fn contains(&self, name: &str) -> bool {
        self.nodes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(name)
    }

    /// What confines the pods of the virtual node `name` below, if it is one.
    pub fn confinement(&self, name: &str) -> Option<Confinement> {
        self.nodes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .cloned()
            .flatten()
    }

    /// The names of the member's virtual nodes.
    pub fn names(&self) -> Vec<String> {
        self.nodes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect()
    }
}

/// A virtual node of this member from an earlier run whose group is not below any more
/// (gone while no process ran): drained and deleted as a group gone below is.
#[derive(Clone, Debug, PartialEq)]
pub struct LeftBehind {
    /// Its group's key when its [`LOWER_SELECTOR_ANNOTATION`] names one of this
    /// granularity (a group back below stops the drain), else its name.
    pub key: String,
    /// The Node's name.
    pub name: String,
    /// The Node's UID (its drain and deletion are of that Node only).
    pub uid: String,
    /// What confined its pods below, from the annotation.
    pub confinement: Option<Confinement>,
}

/// The member's virtual nodes (`nodes`: upper Nodes labelled [`MEMBER_NODE_LABEL`] with
/// its `--nodename`) that none of `offers` registers: each with the group key its
/// annotation names (the Node's name when it names none of `granularity`, or a group
/// offered under another name).
pub fn left_behind(
    granularity: &Granularity,
    offers: &BTreeMap<String, GroupOffer>,
    nodes: &[Node],
) -> Vec<LeftBehind> {
    let offered: BTreeSet<&str> = offers.values().map(|o| o.group.name.as_str()).collect();
    nodes
        .iter()
        .filter_map(|node| {
            let name = node.metadata.name.clone()?;
            if offered.contains(name.as_str()) {
                return None;
            }
            let confinement = node
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(LOWER_SELECTOR_ANNOTATION))
                .and_then(|text| parse_lower_selector(text));
            let key = confinement
                .as_ref()
                .filter(|c| {
                    let ours = group_requirement(granularity, "");
                    ours.is_some_and(|o| {
                        o.placement == c.placement && o.requirement.key == c.requirement.key
                    })
                })
                .and_then(|c| c.requirement.values.as_deref()?.first().cloned())
                .filter(|key| !offers.contains_key(key))
                .unwrap_or_else(|| name.clone());
            Some(LeftBehind {
                key,
                name,
                uid: node.metadata.uid.clone().unwrap_or_default(),
                confinement,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(name: &str, labels: serde_json::Value, ready: bool, cordoned: bool) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": labels},
            "spec": {"unschedulable": cordoned},
            "status": {"conditions": [
                {"type": "Ready", "status": if ready { "True" } else { "False" }}
            ]},
        }))
        .unwrap()
    }

    fn zone() -> Granularity {
        Granularity::Label("topology.kubernetes.io/zone".into())
    }

    #[test]
    fn granularity_parses() {
        let cases: Vec<(&str, Result<Granularity, &str>)> = vec![
            ("", Ok(Granularity::Cluster)),
            ("cluster", Ok(Granularity::Cluster)),
            (" node ", Ok(Granularity::Node)),
            ("label=topology.kubernetes.io/zone", Ok(zone())),
            ("label=pool", Ok(Granularity::Label("pool".into()))),
            ("label=", Err("is not a label key")),
            ("label=a/b/c", Err("prefix is not a DNS subdomain")),
            (
                "label=Example.com/pool",
                Err("prefix is not a DNS subdomain"),
            ),
            ("label=-pool", Err("is not a label key")),
            ("nodes", Err("must be cluster, node or label=")),
            ("Node", Err("must be cluster, node or label=")),
        ];
        for (text, want) in cases {
            let got = parse_granularity(text);
            match (&got, want.clone()) {
                (Ok(got), Ok(want)) => {
                    assert_eq!(*got, want, "{text:?}");
                    // It prints back as it parses.
                    assert_eq!(parse_granularity(&got.to_string()).as_ref(), Ok(got));
                }
                (Err(got), Err(want)) => assert!(got.contains(want), "{text:?}: {got}"),
                _ => panic!("{text:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn label_patterns_match() {
        let patterns = parse_label_patterns("example.com/pool, *.example.org/*,gpu-*").unwrap();
        let cases = [
            ("topology.kubernetes.io/zone", true),
            ("kubernetes.io/os", true),
            ("example.com/pool", true),
            ("example.com/pools", false),
            ("a.example.org/tier", true),
            ("example.org/tier", false),
            ("gpu-type", true),
            ("gpu", false),
            ("kubernetes.io/hostname", false),
        ];
        for (key, want) in cases {
            assert_eq!(patterns.shows(key), want, "{key}");
        }
        assert!(parse_label_patterns("a b").is_err());
        for every in ["*", " * ", "example.com/x,*", "**"] {
            let error = parse_label_patterns(every).unwrap_err();
            assert!(
                error.contains("every lower node label"),
                "{every:?}: {error}"
            );
        }
        assert_eq!(
            parse_label_patterns(" , ").unwrap(),
            LabelPatterns::default()
        );
    }

    /// NodeRestriction's rule for the labels a kubelet may set on its own Node, and
    /// tensile's own namespace: what never comes up from a lower node.
    #[test]
    fn labels_a_kubelet_may_not_set_are_refused_from_below() {
        let cases = [
            ("node-role.kubernetes.io/control-plane", true),
            ("node-role.kubernetes.io/worker", true),
            ("node-restriction.kubernetes.io/x", true),
            ("a.node-restriction.kubernetes.io/x", true),
            ("kubernetes.io/role", true),
            ("kubernetes.io/hostname", false),
            ("kubernetes.io/arch", false),
            ("kubernetes.io/os", false),
            ("kubernetes.io/instance-type", true),
            ("k8s.io/x", true),
            ("foo.k8s.io/x", true),
            ("example.kubernetes.io/x", true),
            ("topology.kubernetes.io/zone", false),
            ("topology.kubernetes.io/region", false),
            ("topology.kubernetes.io/other", true),
            ("failure-domain.beta.kubernetes.io/zone", false),
            ("failure-domain.beta.kubernetes.io/region", false),
            ("node.kubernetes.io/instance-type", false),
            ("node.kubernetes.io/anything", false),
            ("pool.node.kubernetes.io/anything", false),
            ("kubelet.kubernetes.io/x", false),
            ("beta.kubernetes.io/instance-type", false),
            ("beta.kubernetes.io/arch", false),
            ("beta.kubernetes.io/os", false),
            ("beta.kubernetes.io/other", true),
            ("tensile.dev/x", true),
            ("burst.tensile.dev/x", true),
            ("example.com/x", false),
            ("notkubernetes.io/x", false),
            ("kubernetes.io.example.com/x", false),
            ("pool", false),
        ];
        for (key, want) in cases {
            assert_eq!(refused_from_below(key), want, "{key}");
        }
    }

    /// Patterns that match labels a kubelet may not set show none of them; the grouping
    /// label is held to the same rule.
    #[test]
    fn refused_labels_never_reach_a_group() {
        let patterns =
            parse_label_patterns("*.kubernetes.io/*,*.k8s.io/*,*.dev/*,example.com/*").unwrap();
        let mut groups = Groups::new(
            "vk",
            Granularity::Label("node-restriction.kubernetes.io/pool".into()),
            patterns,
        );
        let labels = json!({
            "node-role.kubernetes.io/control-plane": "",
            "node-restriction.kubernetes.io/pool": "p",
            "foo.k8s.io/x": "y",
            "tensile.dev/burst-priority": "0",
            "tensile.dev/x": "y",
            "beta.kubernetes.io/other": "y",
            "topology.kubernetes.io/zone": "a",
            "node.kubernetes.io/instance-type": "m5",
            "example.com/x": "y",
        });
        groups.apply_node(&node("w1", labels, true, false));
        let group = groups
            .group("p")
            .expect("grouped by the label all the same");
        let shown: Vec<&str> = group.labels.keys().map(String::as_str).collect();
        assert_eq!(
            shown,
            [
                "example.com/x",
                "node.kubernetes.io/instance-type",
                MEMBER_NODE_LABEL,
                "topology.kubernetes.io/zone",
            ]
        );
    }

    /// The refused labels are warned of when they change, not on every event of the node.
    #[test]
    fn refused_labels_are_warned_of_once_per_change() {
        let mut groups = Groups::new("vk", zone(), parse_label_patterns("*.io/*").unwrap());
        let role = json!({"topology.kubernetes.io/zone": "a",
                          "node-role.kubernetes.io/control-plane": ""});
        let role_and_more = json!({"topology.kubernetes.io/zone": "a",
                                   "node-role.kubernetes.io/control-plane": "",
                                   "node-restriction.kubernetes.io/x": "y"});
        let plain = json!({"topology.kubernetes.io/zone": "a"});
        let role_keys = "node-role.kubernetes.io/control-plane";
        let more_keys = "node-restriction.kubernetes.io/x,node-role.kubernetes.io/control-plane";
        // (event, lower node w1's labels, what is warned of)
        let cases = [
            ("first seen", role.clone(), Some(role_keys)),
            ("the same again", role.clone(), None),
            ("another refused label", role_and_more, Some(more_keys)),
            ("none any more", plain.clone(), None),
            ("back", role.clone(), Some(role_keys)),
        ];
        for (event, labels, want) in cases {
            let node = node("w1", labels, true, false);
            let refused: BTreeSet<String> = node
                .metadata
                .labels
                .iter()
                .flatten()
                .map(|(k, _)| k)
                .filter(|k| groups.patterns.shows(k) && refused_from_below(k))
                .cloned()
                .collect();
            // What this event's apply_node warns of ...
            let warned = groups.clone().note_refused("w1", refused.clone());
            assert_eq!(warned.as_deref(), want, "{event}");
            groups.apply_node(&node);
            // ... and it recorded it: the next event of the same node warns of nothing.
            assert_eq!(groups.note_refused("w1", refused), None, "{event}");
        }
        // A relist's copy of the node warns of nothing new; its deletion forgets it.
        groups.relist_start();
        groups.apply_node(&node("w1", role.clone(), true, false));
        groups.relist_done();
        assert!(groups.refused.contains_key("w1"));
        groups.delete_node("w1");
        assert!(groups.refused.is_empty());
    }

    #[test]
    fn glob_matches() {
        let cases = [
            ("a*c", "abc", true),
            ("a*c", "ac", true),
            ("a*c", "ab", false),
            ("*", "", true),
            ("a*b*a", "aba", true),
            ("a*a", "a", false),
            ("abc", "abc", true),
            ("abc", "abcd", false),
        ];
        for (pattern, text, want) in cases {
            assert_eq!(glob(pattern, text), want, "{pattern} ~ {text}");
        }
    }

    #[test]
    fn names_are_dns_labels_and_stable() {
        let long = "a".repeat(70);
        let cases: Vec<(&str, Granularity, &str, &str)> = vec![
            ("vk", Granularity::Cluster, "", "vk"),
            ("vk", Granularity::Node, "worker-1", "vk-worker-1"),
            ("vk", zone(), "us-east-1a", "vk-us-east-1a"),
            // Changed (dots, capitals, underscores): a hash says which it was.
            (
                "vk",
                Granularity::Node,
                "ip-10-0-0-1.ec2.internal",
                "vk-ip-10-0-0-1-ec2-internal-",
            ),
            ("vk", zone(), "EU_West", "vk-eu-west-"),
            ("vk", zone(), "...", "vk-"),
            // Cut to 63.
            ("vk", Granularity::Node, &long, "vk-aaaa"),
        ];
        for (base, granularity, group, prefix) in cases {
            let name = virtual_node_name(base, &granularity, group);
            assert!(name.starts_with(prefix), "{group}: {name}");
            assert!(name.len() <= MAX_NAME, "{group}: {name}");
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "{name}"
            );
            assert!(!name.starts_with('-') && !name.ends_with('-'), "{name}");
            assert_eq!(name, virtual_node_name(base, &granularity, group), "stable");
        }
        // Groups that read alike below still get names of their own.
        let a = virtual_node_name("vk", &zone(), "eu_west");
        let b = virtual_node_name("vk", &zone(), "eu.west");
        let c = virtual_node_name("vk", &zone(), "eu-west");
        assert!(a != b && b != c && a != c, "{a} {b} {c}");
        assert_eq!(c, "vk-eu-west");
        // A long group is cut to exactly 63 characters with the hash.
        let cut = virtual_node_name("vk", &Granularity::Node, &long);
        assert_eq!(cut.len(), MAX_NAME);
        assert_ne!(
            cut,
            virtual_node_name("vk", &Granularity::Node, &"a".repeat(71))
        );
    }

    #[test]
    fn groups_follow_nodes() {
        let mut groups = Groups::new("vk", zone(), parse_label_patterns("pool").unwrap());
        let z = |zone: &str, pool: &str| {
            json!({"topology.kubernetes.io/zone": zone, "pool": pool,
                   "kubernetes.io/hostname": "h", "kubernetes.io/arch": "arm64",
                   "node-role.kubernetes.io/worker": ""})
        };
        assert_eq!(
            groups.apply_node(&node("n1", z("a", "p1"), true, false)),
            BTreeSet::from(["a".into()])
        );
        groups.apply_node(&node("n2", z("a", "p2"), false, true));
        groups.apply_node(&node("n3", z("b", "p1"), false, true));
        groups.apply_node(&node("lost", json!({}), true, false));
        assert_eq!(groups.keys().collect::<Vec<_>>(), ["a", "b"]);

        let a = groups.group("a").unwrap();
        assert_eq!(a.name, "vk-a");
        assert_eq!(a.members, BTreeSet::from(["n1".into(), "n2".into()]));
        // pool differs, hostname is tensile's, the worker role is not shown.
        assert_eq!(
            a.labels,
            BTreeMap::from([
                ("kubernetes.io/arch".into(), "arm64".into()),
                (MEMBER_NODE_LABEL.into(), "vk".into()),
                ("topology.kubernetes.io/zone".into(), "a".into()),
            ])
        );
        assert!(a.ready, "one Ready lower node is enough");
        assert!(!a.cordoned, "one schedulable lower node is enough");
        let b = groups.group("b").unwrap();
        assert_eq!(b.labels.get("pool").map(String::as_str), Some("p1"));
        assert!(!b.ready && b.cordoned);

        // n2 moves to zone b: both groups change.
        assert_eq!(
            groups.apply_node(&node("n2", z("b", "p1"), true, false)),
            BTreeSet::from(["a".into(), "b".into()])
        );
        let b = groups.group("b").unwrap();
        assert!(b.ready && !b.cordoned);
        assert_eq!(b.members.len(), 2);
        // The last node of a group goes: so does the group.
        assert_eq!(groups.delete_node("n1"), BTreeSet::from(["a".into()]));
        assert!(groups.group("a").is_none());
        assert_eq!(groups.keys().collect::<Vec<_>>(), ["b"]);
        assert!(groups.delete_node("lost").is_empty());
        assert!(groups.delete_node("never").is_empty());
        // The same node again changes nothing.
        assert!(
            groups
                .apply_node(&node("n3", z("b", "p1"), false, true))
                .is_empty()
        );
        // A relist that lists only n2 drops n3 (group b stays, with n2).
        groups.relist_start();
        groups.apply_node(&node("n2", z("b", "p1"), true, false));
        assert_eq!(groups.relist_done(), BTreeSet::from(["b".into()]));
        assert_eq!(
            groups.group("b").unwrap().members,
            BTreeSet::from(["n2".into()])
        );
        assert!(groups.relist_done().is_empty(), "no relist under way");
    }

    #[test]
    fn offers_are_each_groups_nodes_capacity() {
        use super::super::capacity::PodFeed;
        use crate::translate::meta::Owner;
        let sized = |name: &str, zone: &str, cpu: &str, ready: bool| {
            let mut n = node(
                name,
                json!({"topology.kubernetes.io/zone": zone}),
                ready,
                false,
            );
            n.status.get_or_insert_default().allocatable =
                Some([("cpu".to_owned(), Quantity(cpu.into()))].into());
            n
        };
        let nodes = [
            sized("a1", "a", "4", true),
            sized("a2", "a", "4", true),
            sized("b1", "b", "4", true),
            sized("c1", "c", "4", false),
        ];
        let owner = Owner::new("vk", "cluster-1");
        let mut capacity = LowerCapacity::new(&owner);
        capacity.reset_nodes(&nodes);
        let other: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"nodeName": "a1", "containers": [
                {"name": "c", "resources": {"requests": {"cpu": "1"}}}]},
            "status": {"phase": "Running"},
        }))
        .unwrap();
        capacity.reset_pods(PodFeed::OtherNodes, [&other]);
        let mut groups = Groups::new("vk", zone(), LabelPatterns::default());
        for n in &nodes {
            groups.apply_node(n);
        }
        let got = offers(&groups, &capacity);
        let cpu = |key: &str| {
            got.get(key)
                .and_then(|o| o.capacity.get("cpu"))
                .map(|q| q.0.clone())
        };
        assert_eq!(
            cpu("a").as_deref(),
            Some("7"),
            "two nodes less another's pod"
        );
        assert_eq!(cpu("b").as_deref(), Some("4"));
        assert_eq!(cpu("c"), None, "NotReady: nothing offered");
        assert!(!got["c"].group.ready, "and NotReady above");
        assert_eq!(got["a"].group.name, "vk-a");
        assert_eq!(got.len(), 3);
    }

    #[test]
    fn node_granularity_groups_are_nodes() {
        let mut groups = Groups::new("vk", Granularity::Node, LabelPatterns::default());
        groups.apply_node(&node(
            "w1",
            json!({"topology.kubernetes.io/zone": "a"}),
            true,
            true,
        ));
        let w1 = groups.group("w1").unwrap();
        assert_eq!(w1.name, "vk-w1");
        assert!(w1.cordoned, "cordoned below, cordoned above");
        assert_eq!(w1.labels.len(), 2);
        assert_eq!(
            w1.labels.get(MEMBER_NODE_LABEL).map(String::as_str),
            Some("vk")
        );
    }

    #[test]
    fn group_labels_over_own() {
        let own: BTreeMap<String, String> = [
            ("type", "virtual-kubelet"),
            ("kubernetes.io/hostname", "vk-a"),
            ("kubernetes.io/arch", "amd64"),
            ("beta.kubernetes.io/arch", "amd64"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let group: BTreeMap<String, String> = [
            ("kubernetes.io/arch", "arm64"),
            ("kubernetes.io/hostname", "lower-1"),
            ("topology.kubernetes.io/zone", "a"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let labels = group_labels(&own, &group);
        let get = |k: &str| labels.get(k).map(String::as_str);
        assert_eq!(get("kubernetes.io/hostname"), Some("vk-a"));
        assert_eq!(get("kubernetes.io/arch"), Some("arm64"));
        assert_eq!(get("beta.kubernetes.io/arch"), Some("arm64"));
        assert_eq!(get("topology.kubernetes.io/zone"), Some("a"));
        assert_eq!(get("type"), Some("virtual-kubelet"));
    }

    use k8s_openapi::api::core::v1::PodSpec;

    fn spec(value: serde_json::Value) -> PodSpec {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn nodes_left_behind_are_those_no_group_registers() {
        let upper = |name: &str, selector: Option<&str>| -> Node {
            serde_json::from_value(json!({"metadata": {"name": name,
                "annotations": selector.map(|s| json!({LOWER_SELECTOR_ANNOTATION: s}))}}))
            .unwrap()
        };
        let mut groups = Groups::new("vk", zone(), LabelPatterns::default());
        groups.apply_node(&node(
            "w1",
            json!({"topology.kubernetes.io/zone": "a"}),
            true,
            false,
        ));
        let offers = offers(
            &groups,
            &LowerCapacity::new(&crate::translate::meta::Owner::new("vk", "cluster-1")),
        );
        let nodes = [
            upper("vk-a", Some("topology.kubernetes.io/zone=a")),
            upper("vk-b", Some("topology.kubernetes.io/zone=b")),
            upper("vk-w9", Some("metadata.name=w9")),
            upper("vk-old", None),
            upper("vk-a2", Some("topology.kubernetes.io/zone=a")),
        ];
        let got: Vec<(String, String)> = left_behind(&zone(), &offers, &nodes)
            .into_iter()
            .map(|l| (l.key, l.name))
            .collect();
        let want: Vec<(String, String)> = [
            ("b", "vk-b"),
            ("vk-w9", "vk-w9"),
            ("vk-old", "vk-old"),
            ("vk-a2", "vk-a2"),
        ]
        .into_iter()
        .map(|(k, n)| (k.to_owned(), n.to_owned()))
        .collect();
        assert_eq!(
            got, want,
            "offered vk-a kept; other granularity, none, or a key offered under another name: by name"
        );
    }

    #[test]
    fn the_lower_selector_annotation_names_the_group() {
        let cases: [(&str, Granularity, &str, &str); 3] = [
            (
                "node",
                Granularity::Node,
                "w1.example",
                "metadata.name=w1.example",
            ),
            ("zone", zone(), "a", "topology.kubernetes.io/zone=a"),
            (
                "empty value",
                Granularity::Label("pool".into()),
                "",
                "pool=",
            ),
        ];
        for (what, granularity, group, text) in cases {
            let confinement = group_requirement(&granularity, group).unwrap();
            assert_eq!(lower_selector(&confinement), text, "{what}");
            assert_eq!(parse_lower_selector(text), Some(confinement), "{what}");
        }
        for bad in ["", "no-equals", "=a", "bad key!=a"] {
            assert_eq!(parse_lower_selector(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn confine_ands_into_every_term() {
        let zone_a = || group_requirement(&zone(), "a").unwrap();
        let on_w1 = || group_requirement(&Granularity::Node, "w1").unwrap();
        assert!(group_requirement(&Granularity::Cluster, "").is_none());
        let in_a = json!({"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]});
        let on = json!({"key": "metadata.name", "operator": "In", "values": ["w1"]});
        let ssd = json!({"key": "disk", "operator": "In", "values": ["ssd"]});
        let gpu = json!({"key": "gpu", "operator": "Exists"});
        type Case = (
            &'static str,
            serde_json::Value,
            Confinement,
            serde_json::Value,
        );
        let cases: Vec<Case> = vec![
            (
                "no affinity: one term",
                json!({"containers": []}),
                zone_a(),
                json!([{"matchExpressions": [in_a]}]),
            ),
            (
                "restored terms: each gets it",
                json!({"containers": [], "affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [ssd]}, {"matchExpressions": [gpu]}
                ]}}}}),
                zone_a(),
                json!([{"matchExpressions": [ssd, in_a]}, {"matchExpressions": [gpu, in_a]}]),
            ),
            (
                "node: by field, beside expressions",
                json!({"containers": [], "affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [ssd]}
                ]}}}}),
                on_w1(),
                json!([{"matchExpressions": [ssd], "matchFields": [on]}]),
            ),
            (
                "already there: unchanged",
                json!({"containers": [], "affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [in_a]}
                ]}}}}),
                zone_a(),
                json!([{"matchExpressions": [in_a]}]),
            ),
        ];
        for (name, before, confinement, want) in cases {
            let mut got = spec(before);
            confinement.apply(&mut got);
            let terms = serde_json::to_value(
                &got.affinity
                    .unwrap()
                    .node_affinity
                    .unwrap()
                    .required_during_scheduling_ignored_during_execution
                    .unwrap()
                    .node_selector_terms,
            )
            .unwrap();
            assert_eq!(terms, want, "{name}");
        }
        // Preferred terms and pod affinity are left alone.
        let mut kept = spec(json!({"containers": [], "affinity": {
            "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [ssd]}}]},
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": "kubernetes.io/hostname"}]}}}));
        zone_a().apply(&mut kept);
        let affinity = kept.affinity.unwrap();
        assert!(affinity.pod_anti_affinity.is_some());
        let node_affinity = affinity.node_affinity.unwrap();
        assert!(
            node_affinity
                .preferred_during_scheduling_ignored_during_execution
                .is_some()
        );
    }

    /// The virtual nodes a member knows: each by its name, with the requirement that
    /// confines its pods below; a name it never had is no one's.
    #[test]
    fn group_nodes_know_their_names_and_confinements() {
        let known = GroupNodes::default();
        known.insert("vk-zone-a", group_requirement(&zone(), "zone-a"));
        known.insert("vk-n1", group_requirement(&Granularity::Node, "n1"));
        for (name, want) in [
            (
                "vk-zone-a",
                Some((
                    Placement::Expression,
                    "topology.kubernetes.io/zone",
                    "zone-a",
                )),
            ),
            ("vk-n1", Some((Placement::Field, NODE_NAME_FIELD, "n1"))),
            ("vk", None),
            ("vk-zone-b", None),
        ] {
            assert_eq!(known.contains(name), want.is_some(), "{name}");
            let got = known.confinement(name).map(|c| {
                let values = c.requirement.values.unwrap_or_default();
                (c.placement, c.requirement.key, values.join(","))
            });
            let want = want.map(|(p, k, v)| (p, k.to_owned(), v.to_owned()));
            assert_eq!(got, want, "{name}");
        }
        assert_eq!(known.names(), ["vk-n1", "vk-zone-a"]);
    }
}
