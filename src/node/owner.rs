//! Whose an upper Node is: the one predicate every path that writes, adopts, drains or
//! deletes a virtual node goes through, federated or not (as Kubernetes' NodeRestriction
//! answers "may this kubelet touch this Node" in one place).
//!
//! A virtual node is one member's: the member records itself on the Node when it
//! registers it ([`NODE_OWNER_ANNOTATION`]): the flags' member as its `--nodename` (any
//! process started with that `--nodename` is that member: a restart, a standby, an
//! upgrade), a member Secret as the Secret (namespace, name and UID: another Secret naming
//! the same node, in this installation or another, is another member). A Node of the name
//! that records another member, or that tensile did not register, is never written,
//! adopted, drained or deleted: the name is refused, said in an Event. A Node registered
//! by a tensile release that recorded no owner is adopted by the member whose `clusterID`
//! it carries (the owner recorded then). After registration every write carries the Node's
//! UID, so a Node deleted and made again by someone else is not written either.

use k8s_openapi::api::core::v1::{Node, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

/// The annotation on a virtual node naming the member that registered it.
pub const NODE_OWNER_ANNOTATION: &str = "tensile.dev/registered-by";

/// The container runtime a Node registered by tensile reports (`tensile://<version>`).
pub const TENSILE_RUNTIME: &str = "tensile://";

/// The member that registers (and alone writes, adopts, drains and deletes) a virtual
/// node, as recorded on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeOwner {
    /// The member's `--nodename` (or `tensile.dev/node-name`): its Nodes' `clusterID`.
    member: String,
    /// [`NODE_OWNER_ANNOTATION`]'s value.
    mark: String,
    /// A member Secret's creation: an unrecorded Node older than it is not adopted (it is
    /// another installation's, or predates the Secret that names it).
    since: Option<Timestamp>,
}

/// Whose a Node is, to one [`NodeOwner`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holding {
    /// It records this owner.
    Ours,
    /// Registered by a tensile release that recorded no owner, for this member (its
    /// `clusterID`): adopted, the owner recorded.
    Unrecorded,
    /// Another's: who, in words.
    Another(String),
}

impl Holding {
    /// Whether the owner may write the Node (and adopt it if unrecorded).
    pub fn is_ours(&self) -> bool {
        !matches!(self, Self::Another(_))
    }
}

impl NodeOwner {
    /// The member `member`: of the Secret `secret`, or (`None`) the flags' member.
    pub fn new(member: &str, secret: Option<&ObjectReference>) -> Self {
        let mark = match secret {
            Some(secret) => format!(
                "secret/{}/{}/{}",
                secret.namespace.as_deref().unwrap_or_default(),
                secret.name.as_deref().unwrap_or_default(),
                secret.uid.as_deref().unwrap_or_default(),
            ),
            None => format!("nodename/{member}"),
        };
        Self {
            member: member.to_owned(),
            mark,
            since: None,
        }
    }

    /// The same owner, a member Secret made at `created`: it adopts no unrecorded Node
    /// older than itself.
    pub fn made_at(mut self, created: Option<&Time>) -> Self {
        self.since = created.map(|t| t.0);
        self
    }

    /// [`NODE_OWNER_ANNOTATION`]'s value for this owner.
    pub fn mark(&self) -> &str {
        &self.mark
    }

    /// Whose `node` is, to this owner.
    pub fn holding(&self, node: &Node) -> Holding {
        let recorded = node
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(NODE_OWNER_ANNOTATION));
        match recorded {
            Some(mark) if *mark == self.mark => Holding::Ours,
            Some(mark) => Holding::Another(format!("another member ({mark})")),
            None if !registered_by_tensile(node) => {
                Holding::Another("a Node tensile did not register".to_owned())
            }
            None => {
                let cluster_id = node
                    .metadata
                    .labels
                    .as_ref()
                    .and_then(|l| l.get("clusterID"));
                let older = |since: Timestamp| {
                    node.metadata
                        .creation_timestamp
                        .as_ref()
                        .is_some_and(|created| created.0 < since)
                };
                match cluster_id {
                    Some(id) if *id == self.member && self.since.is_some_and(older) => {
                        Holding::Another(format!(
                            "an earlier Node of member {id} that records no owner and is older than this member Secret (another installation's?); to hand it over, annotate it {NODE_OWNER_ANNOTATION}={}",
                            self.mark
                        ))
                    }
                    Some(id) if *id == self.member => Holding::Unrecorded,
                    Some(id) => Holding::Another(format!("the member of node name {id}")),
                    None => Holding::Another("a Node tensile did not register".to_owned()),
                }
            }
        }
    }
}

/// Whether `node` is a virtual node of the member `member` (`--nodename`): labelled
/// [`super::groups::MEMBER_NODE_LABEL`] with it, or the member's own node. Such a Node's
/// pods are never taken for orphans below, served yet or not.
pub fn of_member(node: &Node, member: &str) -> bool {
    node.metadata.name.as_deref() == Some(member)
        || node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(super::groups::MEMBER_NODE_LABEL))
            .is_some_and(|m| m == member)
}

/// Whether `node` was registered by tensile: it reports tensile as its container runtime,
/// or (registered a moment ago, its status not yet written) it is a virtual kubelet with a
/// `clusterID` label, as tensile labels its Nodes, and reports no runtime.
pub fn registered_by_tensile(node: &Node) -> bool {
    let runtime = node
        .status
        .as_ref()
        .and_then(|s| s.node_info.as_ref())
        .map(|i| i.container_runtime_version.as_str())
        .filter(|r| !r.is_empty());
    match runtime {
        Some(runtime) => runtime.starts_with(TENSILE_RUNTIME),
        None => node.metadata.labels.as_ref().is_some_and(|labels| {
            let (key, value) = crate::translate::meta::VIRTUAL_NODE_LABEL;
            labels.get(key).is_some_and(|t| t == value) && labels.contains_key("clusterID")
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn node(labels: serde_json::Value, owner: Option<&str>, runtime: Option<&str>) -> Node {
        let mut node = json!({"metadata": {"name": "vk-gpu", "labels": labels}});
        if let Some(owner) = owner {
            node["metadata"]["annotations"] = json!({ NODE_OWNER_ANNOTATION: owner });
        }
        if let Some(runtime) = runtime {
            node["status"] = json!({"nodeInfo": {
                "containerRuntimeVersion": runtime, "architecture": "", "bootID": "",
                "kernelVersion": "", "kubeProxyVersion": "", "kubeletVersion": "",
                "machineID": "", "operatingSystem": "", "osImage": "", "systemUUID": "",
            }});
        }
        serde_json::from_value(node).unwrap()
    }

    /// A Node is a member's when it records that member; one recording nothing is adopted
    /// only if tensile registered it for that member (its `clusterID`); anything else is
    /// another's, whatever its name or labels say.
    #[test]
    fn a_node_is_the_member_it_records() {
        let secret = ObjectReference {
            namespace: Some("members".into()),
            name: Some("lower-a".into()),
            uid: Some("u-1".into()),
            ..ObjectReference::default()
        };
        let flags_vk = NodeOwner::new("vk", None);
        let flags_gpu = NodeOwner::new("vk-gpu", None);
        let secret_gpu = NodeOwner::new("vk-gpu", Some(&secret));
        let tensile = json!({"type": "virtual-kubelet", "clusterID": "vk-gpu"});
        let at = |second| Time(Timestamp::from_second(second).unwrap());
        let secret_gpu_at_200 = NodeOwner::new("vk-gpu", Some(&secret)).made_at(Some(&at(200)));
        let node_at = |labels: serde_json::Value, second| {
            let mut node = node(labels, None, Some("tensile://0.1.0"));
            node.metadata.creation_timestamp = Some(at(second));
            node
        };
        let runtime = Some("tensile://0.1.0");
        let another = |s: &str| Holding::Another(s.to_owned());
        let cases = [
            // Recorded: the record decides, not the labels.
            (
                "recorded, same flags member",
                node(tensile.clone(), Some("nodename/vk-gpu"), runtime),
                &flags_gpu,
                Holding::Ours,
            ),
            (
                "another process's group node (H1)",
                node(tensile.clone(), Some("nodename/vk-gpu"), runtime),
                &flags_vk,
                another("another member (nodename/vk-gpu)"),
            ),
            (
                "a member Secret naming a flags member's node (M4)",
                node(tensile.clone(), Some("nodename/vk-gpu"), runtime),
                &secret_gpu,
                another("another member (nodename/vk-gpu)"),
            ),
            (
                "the Secret's own node",
                node(tensile.clone(), Some("secret/members/lower-a/u-1"), runtime),
                &secret_gpu,
                Holding::Ours,
            ),
            (
                "a Secret of the same name made again (another UID)",
                node(tensile.clone(), Some("secret/members/lower-a/u-0"), runtime),
                &secret_gpu,
                another("another member (secret/members/lower-a/u-0)"),
            ),
            (
                "a record on a Node tensile did not register is still a record",
                node(json!({}), Some("nodename/vk-gpu"), Some("containerd://2.0")),
                &flags_gpu,
                Holding::Ours,
            ),
            // Unrecorded: an older tensile's Node of this member is adopted.
            (
                "older tensile, this member",
                node(tensile.clone(), None, runtime),
                &flags_gpu,
                Holding::Unrecorded,
            ),
            (
                "older tensile, registered a moment ago",
                node(tensile.clone(), None, None),
                &secret_gpu,
                Holding::Unrecorded,
            ),
            (
                "older tensile, older than the member Secret naming it (M4)",
                node_at(tensile.clone(), 100),
                &secret_gpu_at_200,
                another(&format!(
                    "an earlier Node of member vk-gpu that records no owner and is older than this member Secret (another installation's?); to hand it over, annotate it {NODE_OWNER_ANNOTATION}=secret/members/lower-a/u-1"
                )),
            ),
            (
                "older tensile, registered after its member Secret",
                node_at(tensile.clone(), 300),
                &secret_gpu_at_200,
                Holding::Unrecorded,
            ),
            (
                "older tensile, another member's",
                node(tensile.clone(), None, runtime),
                &flags_vk,
                another("the member of node name vk-gpu"),
            ),
            (
                "a real node",
                node(
                    json!({"clusterID": "vk-gpu"}),
                    None,
                    Some("containerd://2.0"),
                ),
                &flags_gpu,
                another("a Node tensile did not register"),
            ),
            (
                "another virtual kubelet",
                node(tensile.clone(), None, Some("liqo://1.0")),
                &flags_gpu,
                another("a Node tensile did not register"),
            ),
            (
                "a bare Node",
                node(json!({}), None, None),
                &flags_gpu,
                another("a Node tensile did not register"),
            ),
        ];
        for (what, node, owner, want) in cases {
            let got = owner.holding(&node);
            assert_eq!(got.is_ours(), want.is_ours(), "{what}");
            assert_eq!(got, want, "{what}");
        }
    }

    #[test]
    fn the_record_names_the_member_and_its_secret() {
        assert_eq!(NodeOwner::new("vk", None).mark(), "nodename/vk");
        let secret = ObjectReference {
            namespace: Some("ns".into()),
            name: Some("s".into()),
            uid: Some("u".into()),
            ..ObjectReference::default()
        };
        assert_eq!(NodeOwner::new("vk", Some(&secret)).mark(), "secret/ns/s/u");
    }
}
