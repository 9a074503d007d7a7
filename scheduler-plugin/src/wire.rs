//! kube-scheduler's extender v1 wire format (`k8s.io/kube-scheduler/extender/v1`,
//! types.go): Go structs without JSON tags, so the field names are Go's (`Pod`, `Nodes`,
//! `NodeNames`, …). kube-scheduler POSTs these as JSON to `<urlPrefix>/<verb>`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `ExtenderArgs`: the pod and the candidate nodes, either whole (`Nodes`, when
/// `nodeCacheCapable: false`) or by name (`NodeNames`).
#[derive(Deserialize, Serialize, Debug, Clone, Default, PartialEq)]
pub struct ExtenderArgs {
    /// The pod being scheduled.
    #[serde(rename = "Pod")]
    pub pod: Option<Pod>,
    /// The candidate nodes, whole.
    #[serde(rename = "Nodes", default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<NodeList>,
    /// The candidate nodes, by name.
    #[serde(rename = "NodeNames", default, skip_serializing_if = "Option::is_none")]
    pub node_names: Option<Vec<String>>,
}

/// A `v1.NodeList` passed through untouched: the nodes that pass filter go back to
/// kube-scheduler exactly as they came (a typed round trip could drop fields).
#[derive(Deserialize, Serialize, Debug, Clone, Default, PartialEq)]
pub struct NodeList {
    /// The nodes, as JSON.
    #[serde(default)]
    pub items: Vec<Value>,
    /// `apiVersion`, `kind`, `metadata`: kept as they came.
    #[serde(flatten)]
    pub rest: serde_json::Map<String, Value>,
}

/// The name of a node given as JSON.
pub fn node_name(node: &Value) -> Option<&str> {
    node.get("metadata")?.get("name")?.as_str()
}

/// `FailedNodesMap`: node name → why it failed.
pub type FailedNodesMap = BTreeMap<String, String>;

/// `ExtenderFilterResult`.
#[derive(Deserialize, Serialize, Debug, Clone, Default, PartialEq)]
pub struct ExtenderFilterResult {
    /// The nodes that pass, whole (answer to `Nodes`).
    #[serde(rename = "Nodes", default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<NodeList>,
    /// The nodes that pass, by name (answer to `NodeNames`).
    #[serde(rename = "NodeNames", default, skip_serializing_if = "Option::is_none")]
    pub node_names: Option<Vec<String>>,
    /// Failed nodes that preemption might make fit.
    #[serde(rename = "FailedNodes", default)]
    pub failed_nodes: FailedNodesMap,
    /// Failed nodes that preemption cannot help.
    #[serde(rename = "FailedAndUnresolvableNodes", default)]
    pub failed_and_unresolvable_nodes: FailedNodesMap,
    /// A failure of the whole call.
    #[serde(rename = "Error", default)]
    pub error: String,
}

/// `HostPriority`: one node's score, 0–`MaxExtenderPriority` (10).
#[derive(Deserialize, Serialize, Debug, Clone, PartialEq, Eq)]
pub struct HostPriority {
    /// The node.
    #[serde(rename = "Host")]
    pub host: String,
    /// Its score.
    #[serde(rename = "Score")]
    pub score: i64,
}

/// Why a request body is not usable `ExtenderArgs`.
#[derive(thiserror::Error, Debug)]
pub enum BadArgs {
    /// Not JSON of the right shape.
    #[error("request body is not extender v1 ExtenderArgs JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// No pod.
    #[error("ExtenderArgs without Pod")]
    NoPod,
    /// Neither list of nodes.
    #[error("ExtenderArgs without Nodes or NodeNames")]
    NoNodes,
    /// Larger than the limit.
    #[error("request body larger than {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: usize,
    },
    /// The body could not be read.
    #[error("reading the request body: {0}")]
    Read(String),
}

/// Decodes a request body; never panics, whatever the bytes.
pub fn decode(body: &[u8]) -> Result<ExtenderArgs, BadArgs> {
    let args: ExtenderArgs = serde_json::from_slice(body)?;
    if args.pod.is_none() {
        return Err(BadArgs::NoPod);
    }
    if args.nodes.is_none() && args.node_names.is_none() {
        return Err(BadArgs::NoNodes);
    }
    Ok(args)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn go_field_names() {
        let args = decode(
            json!({"Pod": {"metadata": {"name": "p"}}, "NodeNames": ["a"]})
                .to_string()
                .as_bytes(),
        )
        .unwrap();
        assert_eq!(args.node_names.unwrap(), ["a"]);
        let result = ExtenderFilterResult {
            node_names: Some(vec!["a".into()]),
            failed_nodes: [("b".to_owned(), "why".to_owned())].into(),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(result).unwrap(),
            json!({"NodeNames": ["a"], "FailedNodes": {"b": "why"},
                   "FailedAndUnresolvableNodes": {}, "Error": ""})
        );
        let score = serde_json::to_value(HostPriority {
            host: "a".into(),
            score: 3,
        })
        .unwrap();
        assert_eq!(score, json!({"Host": "a", "Score": 3}));
    }

    #[test]
    fn nodes_pass_through_untouched() {
        let list = json!({"kind": "NodeList", "apiVersion": "v1", "metadata": {},
                          "items": [{"metadata": {"name": "a", "uid": "1"}, "status": {"x": 1}}]});
        let args = decode(json!({"Pod": {}, "Nodes": list}).to_string().as_bytes()).unwrap();
        let nodes = args.nodes.unwrap();
        assert_eq!(node_name(&nodes.items[0]), Some("a"));
        assert_eq!(serde_json::to_value(nodes).unwrap(), list);
    }

    #[test]
    fn malformed_bodies_are_errors() {
        for bad in [
            &b""[..],
            b"{",
            b"null",
            b"[]",
            b"{\"Pod\": 3, \"NodeNames\": []}",
            b"{\"NodeNames\": []}",
            b"{\"Pod\": {}}",
            b"{\"Pod\": {}, \"NodeNames\": [1]}",
        ] {
            assert!(decode(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }
}
