//! What prioritize knows of the upper cluster's nodes: which are virtual and their burst
//! priority, folded from a metadata watch of upper Nodes (kube-scheduler sends only node
//! names). Pure: no client.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use kube::api::ObjectMeta;

/// Node label virtual-node writes on each virtual node: a non-negative integer, the
/// member's place in the burst order (lowest fills first; absent means 0); and the pod
/// annotation whose `eager` scores virtual nodes like regular ones (no local first).
pub use tensile::node::burst::{BURST_ANNOTATION, BURST_EAGER, BURST_PRIORITY_LABEL};
use tensile::node::groups::{LOWER_SELECTOR_ANNOTATION, MEMBER_NODE_LABEL, parse_lower_selector};
/// Node label every virtual node carries (tensile-kube's), `type=virtual-kubelet`.
pub use tensile::translate::meta::VIRTUAL_NODE_LABEL as VIRTUAL_NODE_TYPE_LABEL;
use tensile::translate::scheduling::Confinement;

/// An upper node, as filter and prioritize see it.
#[derive(Clone, Debug, PartialEq)]
pub enum UpperNode {
    /// A node of the upper cluster's own.
    Regular,
    /// A virtual node, with its burst priority.
    Virtual {
        /// Lowest fills first.
        burst_priority: u64,
        /// For one of the virtual nodes of a member of `node` or `label=<key>`
        /// granularity: its member and lower nodes.
        group: Option<GroupNode>,
    },
}

/// One of the virtual nodes of a member of `node` or `label=<key>` granularity, from its
/// labels and annotations.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupNode {
    /// The member's `--nodename` ([`MEMBER_NODE_LABEL`]): the name its lower cluster is
    /// configured under (`--cluster NODE=KUBECONFIG`).
    pub member: String,
    /// Which of the member's lower nodes are behind it ([`LOWER_SELECTOR_ANNOTATION`]);
    /// `None` when not said (a virtual-node before it wrote it): the whole cluster.
    pub within: Option<Confinement>,
}

impl UpperNode {
    /// Classifies a node by its labels. A burst priority that is not a non-negative
    /// integer counts as the default, 0 (what virtual-node writes when none is set).
    pub fn of(meta: &ObjectMeta) -> Self {
        let labels = meta.labels.as_ref();
        let label = |key: &str| labels.and_then(|l| l.get(key)).map(String::as_str);
        let (key, value) = VIRTUAL_NODE_TYPE_LABEL;
        if label(key) != Some(value) {
            return Self::Regular;
        }
        let group = label(MEMBER_NODE_LABEL).map(|member| GroupNode {
            member: member.to_owned(),
            within: meta
                .annotations
                .as_ref()
                .and_then(|a| a.get(LOWER_SELECTOR_ANNOTATION))
                .and_then(|text| parse_lower_selector(text)),
        });
        Self::Virtual {
            burst_priority: label(BURST_PRIORITY_LABEL)
                .and_then(|p| p.trim().parse().ok())
                .unwrap_or(0),
            group,
        }
    }
}

/// The upper nodes, folded from watch events (`apply / delete / relist`).
#[derive(Debug, Default)]
pub struct UpperNodes {
    nodes: BTreeMap<String, UpperNode>,
    /// Names seen since the relist started; the rest are gone when it is done.
    relisting: Option<BTreeMap<String, UpperNode>>,
    /// The watch has listed everything once.
    pub synced: bool,
    /// Why the watch failed, until it has listed everything again. The last known labels
    /// are still used meanwhile: they change rarely, and they are better than none.
    pub failing: Option<String>,
}

impl UpperNodes {
    /// A node, by name, if known.
    pub fn get(&self, name: &str) -> Option<&UpperNode> {
        self.nodes.get(name)
    }

    /// A node was added or changed (or listed).
    pub fn apply(&mut self, meta: &ObjectMeta) {
        let Some(name) = meta.name.clone() else {
            return;
        };
        let node = UpperNode::of(meta);
        if let Some(seen) = self.relisting.as_mut() {
            seen.insert(name.clone(), node.clone());
        }
        self.nodes.insert(name, node);
    }

    /// A node was deleted.
    pub fn delete(&mut self, name: &str) {
        self.nodes.remove(name);
        if let Some(seen) = self.relisting.as_mut() {
            seen.remove(name);
        }
    }

    /// A complete list starts.
    pub fn relist_start(&mut self) {
        self.relisting = Some(BTreeMap::new());
    }

    /// The complete list is done: nodes it did not list are gone. Returns whether this
    /// ended a failure.
    pub fn relist_done(&mut self) -> bool {
        if let Some(seen) = self.relisting.take() {
            self.nodes = seen;
        }
        self.synced = true;
        self.failing.take().is_some()
    }

    /// The watch failed.
    pub fn failed(&mut self, error: String) {
        self.failing = Some(error);
    }

    /// How many nodes are known.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether none is known.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

/// The upper nodes, shared between their watch (writer) and requests (readers).
#[derive(Debug, Default, Clone)]
pub struct SharedUpperNodes(Arc<RwLock<UpperNodes>>);

impl SharedUpperNodes {
    /// Reads them.
    pub fn read(&self) -> RwLockReadGuard<'_, UpperNodes> {
        self.0.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Changes them.
    pub fn write(&self) -> RwLockWriteGuard<'_, UpperNodes> {
        self.0.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Extender scores (kube-scheduler's `MaxExtenderPriority` is 10) for candidate nodes
/// (`None`: regular; `Some(p)`: virtual with burst priority `p`): local first, then the
/// members in order. Regular nodes get 10; virtual nodes get 9 for the lowest burst
/// priority among the candidates, 8 for the next distinct one, and so on, never below 1.
/// Equal priorities score equal: kube-scheduler's own scoring decides among them.
pub fn burst_scores(candidates: &[Option<u64>]) -> Vec<i64> {
    let mut priorities: Vec<u64> = candidates.iter().flatten().copied().collect();
    priorities.sort_unstable();
    priorities.dedup();
    candidates
        .iter()
        .map(|candidate| match candidate {
            None => MAX_EXTENDER_PRIORITY,
            Some(priority) => {
                let rank = priorities.partition_point(|p| p < priority);
                let rank = i64::try_from(rank).unwrap_or(i64::MAX);
                (MAX_EXTENDER_PRIORITY - 1).saturating_sub(rank).max(1)
            }
        })
        .collect()
}

/// kube-scheduler's `extenderv1.MaxExtenderPriority`.
pub const MAX_EXTENDER_PRIORITY: i64 = 10;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn meta(name: &str, labels: &[(&str, &str)]) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn nodes_are_classified_by_their_labels() {
        let virt = ("type", "virtual-kubelet");
        let cases: [(&[(&str, &str)], UpperNode); 7] = [
            (&[], UpperNode::Regular),
            (&[("type", "other")], UpperNode::Regular),
            (
                &[(BURST_PRIORITY_LABEL, "3")],
                UpperNode::Regular, // the priority alone does not make a node virtual
            ),
            (
                &[virt],
                UpperNode::Virtual {
                    burst_priority: 0,
                    group: None,
                },
            ),
            (
                &[virt, (BURST_PRIORITY_LABEL, "7")],
                UpperNode::Virtual {
                    burst_priority: 7,
                    group: None,
                },
            ),
            (
                &[virt, (BURST_PRIORITY_LABEL, "-1")],
                UpperNode::Virtual {
                    burst_priority: 0,
                    group: None,
                },
            ),
            (
                &[virt, (BURST_PRIORITY_LABEL, "high")],
                UpperNode::Virtual {
                    burst_priority: 0,
                    group: None,
                },
            ),
        ];
        for (labels, want) in cases {
            assert_eq!(UpperNode::of(&meta("n", labels)), want, "{labels:?}");
        }
    }

    #[test]
    fn a_group_node_names_its_member_and_lower_nodes() {
        let virt = ("type", "virtual-kubelet");
        let zone = Confinement {
            placement: tensile::translate::scheduling::Placement::Expression,
            requirement: k8s_openapi::api::core::v1::NodeSelectorRequirement {
                key: "topology.kubernetes.io/zone".into(),
                operator: "In".into(),
                values: Some(vec!["a".into()]),
            },
        };
        let cases: [(&str, Option<&str>, Option<GroupNode>); 4] = [
            ("no member label: no group", None, None),
            (
                "member, selector",
                Some("topology.kubernetes.io/zone=a"),
                Some(GroupNode {
                    member: "vk".into(),
                    within: Some(zone.clone()),
                }),
            ),
            (
                "member, no selector: the whole cluster",
                Some(""),
                Some(GroupNode {
                    member: "vk".into(),
                    within: None,
                }),
            ),
            (
                "member, unreadable selector: the whole cluster",
                Some("zone"),
                Some(GroupNode {
                    member: "vk".into(),
                    within: None,
                }),
            ),
        ];
        for (what, selector, want) in cases {
            let mut m = if want.is_some() {
                meta("vk-a", &[virt, (MEMBER_NODE_LABEL, "vk")])
            } else {
                meta("vk-a", &[virt])
            };
            if let Some(selector) = selector.filter(|s| !s.is_empty()) {
                m.annotations =
                    Some([(LOWER_SELECTOR_ANNOTATION.to_owned(), selector.to_owned())].into());
            }
            let UpperNode::Virtual { group, .. } = UpperNode::of(&m) else {
                panic!("{what}: not virtual");
            };
            assert_eq!(group, want, "{what}");
        }
    }

    #[test]
    fn scores_rank_regular_first_then_priorities_densely() {
        let cases: [(&[Option<u64>], &[i64]); 7] = [
            (&[], &[]),
            (&[None, None], &[10, 10]),
            (&[None, Some(0)], &[10, 9]),
            (&[Some(5)], &[9]),
            (&[Some(2), None, Some(1), Some(2)], &[8, 10, 9, 8]),
            (&[Some(100), Some(1), Some(7)], &[7, 9, 8]),
            (
                &[
                    Some(0),
                    Some(1),
                    Some(2),
                    Some(3),
                    Some(4),
                    Some(5),
                    Some(6),
                    Some(7),
                    Some(8),
                    Some(9),
                    Some(10),
                ],
                &[9, 8, 7, 6, 5, 4, 3, 2, 1, 1, 1],
            ),
        ];
        for (candidates, want) in cases {
            assert_eq!(burst_scores(candidates), want, "{candidates:?}");
        }
    }

    #[test]
    fn a_relist_forgets_nodes_it_did_not_list() {
        let mut nodes = UpperNodes::default();
        nodes.apply(&meta("a", &[]));
        nodes.apply(&meta("vk", &[("type", "virtual-kubelet")]));
        nodes.failed("watch: cut".into());
        nodes.relist_start();
        nodes.apply(&meta(
            "vk",
            &[("type", "virtual-kubelet"), (BURST_PRIORITY_LABEL, "2")],
        ));
        assert_eq!(nodes.get("a"), Some(&UpperNode::Regular), "kept until done");
        assert!(nodes.relist_done(), "ended the failure");
        assert_eq!(nodes.get("a"), None);
        assert_eq!(
            nodes.get("vk"),
            Some(&UpperNode::Virtual {
                burst_priority: 2,
                group: None
            })
        );
        nodes.delete("vk");
        assert!(nodes.is_empty());
        assert!(nodes.synced);
        assert!(!nodes.relist_done());
    }
}
