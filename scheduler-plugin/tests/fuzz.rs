//! Fuzzing the request decoder, filter and prioritize with generated input: whatever the
//! bytes, no panic; a body that decodes gets an answer naming only nodes it was asked
//! about.
//!
//! The properties run a bounded number of cases (`PROPTEST_CASES`, default 256), e.g.
//! `PROPTEST_CASES=20000 cargo test -p tensile-scheduler-extender --test fuzz`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{Node, Pod};
use proptest::prelude::*;
use serde_json::{Value, json};
use tensile_scheduler_extender::extender::{Extender, SharedCluster};
use tensile_scheduler_extender::wire;

const PATHS: [&str; 14] = [
    "/Pod",
    "/Pod/metadata",
    "/Pod/metadata/annotations",
    "/Pod/spec",
    "/Pod/spec/containers",
    "/Pod/spec/initContainers",
    "/Pod/spec/overhead",
    "/Pod/spec/nodeSelector",
    "/Pod/spec/tolerations",
    "/Pod/spec/affinity",
    "/NodeNames",
    "/Nodes",
    "/Nodes/items",
    "/Pod/spec/containers/0/resources",
];

const KEYS: [&str; 16] = [
    "key",
    "operator",
    "values",
    "effect",
    "nodeSelectorTerms",
    "matchExpressions",
    "matchFields",
    "requiredDuringSchedulingIgnoredDuringExecution",
    "nodeAffinity",
    "requests",
    "cpu",
    "memory",
    "clusterSelector",
    "metadata",
    "name",
    "items",
];

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        prop_oneof![
            Just("Exists"),
            Just("In"),
            Just("Gt"),
            Just("NoExecute"),
            Just("vk-a"),
            Just("1e400"),
            Just("999999999999999999999Ei"),
            Just("-5"),
            Just("{"),
            Just("{\"nodeSelector\":{}}"),
        ]
        .prop_map(|s| Value::String(s.to_owned())),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS.to_vec()), inner), 0..4).prop_map(
                |kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
            ),
        ]
    })
}

fn sample_args() -> Value {
    json!({
        "Pod": {"metadata": {"name": "p", "namespace": "ns"}, "spec": {"containers": [
            {"name": "c", "resources": {"requests": {"cpu": "1"}}}]}},
        "NodeNames": ["vk-a", "vk-b", "regular"],
    })
}

/// ExtenderArgs with up to four fields replaced by generated JSON, or removed.
fn args_value() -> impl Strategy<Value = Value> {
    let edits = prop::collection::vec(
        (
            prop::sample::select(PATHS.to_vec()),
            prop::option::of(json_value()),
        ),
        0..4,
    );
    edits.prop_map(|edits| {
        let mut args = sample_args();
        for (path, value) in edits {
            let (parent, last) = path.rsplit_once('/').unwrap();
            match args.pointer_mut(if parent.is_empty() { "" } else { parent }) {
                Some(Value::Object(map)) => {
                    match value {
                        Some(value) => map.insert(last.to_owned(), value),
                        None => map.remove(last),
                    };
                }
                Some(Value::Array(items)) => {
                    if let (Ok(i), Some(value)) = (last.parse::<usize>(), value)
                        && i < items.len()
                    {
                        items[i] = value;
                    }
                }
                _ => {}
            }
        }
        args
    })
}

fn extender() -> Extender {
    let mut extender = Extender::default();
    for (name, synced) in [("vk-a", true), ("vk-b", false)] {
        let cluster = SharedCluster::default();
        {
            let mut state = cluster.write();
            state.nodes_synced = synced;
            state.pods_synced = synced;
            let node: Node = serde_json::from_value(json!({
                "metadata": {"name": "n1", "labels": {"zone": "a"}},
                "status": {"allocatable": {"cpu": "4", "memory": "8Gi", "pods": "110"},
                           "conditions": [{"type": "Ready", "status": "True"}]},
            }))
            .unwrap();
            state.cache.apply_node(&node);
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": "x", "namespace": "ns"},
                "spec": {"nodeName": "n1", "containers": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}]},
            }))
            .unwrap();
            state.cache.apply_pod(&pod);
        }
        extender.clusters.insert(name.to_owned(), cluster);
    }
    extender
}

/// Whatever the bytes: no panic; decoded args get an answer about their own nodes only.
fn check(extender: &Extender, body: &[u8]) {
    let Ok(args) = wire::decode(body) else {
        return;
    };
    let asked: BTreeSet<String> = match (&args.node_names, &args.nodes) {
        (Some(names), _) => names.iter().cloned().collect(),
        (None, Some(nodes)) => nodes
            .items
            .iter()
            .map(|n| wire::node_name(n).unwrap_or_default().to_owned())
            .collect(),
        _ => BTreeSet::new(),
    };
    let (result, outcomes) = extender.filter(&args);
    let passed: Vec<String> = match (&result.node_names, &result.nodes) {
        (Some(names), _) => names.clone(),
        (None, Some(nodes)) => nodes
            .items
            .iter()
            .map(|n| wire::node_name(n).unwrap_or_default().to_owned())
            .collect(),
        _ => Vec::new(),
    };
    for name in passed
        .iter()
        .chain(result.failed_nodes.keys())
        .chain(result.failed_and_unresolvable_nodes.keys())
    {
        assert!(asked.contains(name), "answered about {name}, not asked");
    }
    assert!(outcomes.len() >= passed.len());
    assert!(
        !passed.iter().any(|n| n == "vk-b"),
        "an unsynced cluster passed"
    );
    for score in extender.prioritize(&args) {
        assert!((0..=10).contains(&score.score), "{score:?}");
    }
    // What comes out is valid JSON in the Go field names.
    let encoded = serde_json::to_value(&result).unwrap();
    assert!(encoded.get("Error").is_some());
}

proptest! {
    #[test]
    fn generated_args_never_panic(args in args_value()) {
        let extender = extender();
        check(&extender, args.to_string().as_bytes());
    }

    #[test]
    fn truncated_and_corrupted_bodies_never_panic(cut in 0usize..400, flip in any::<u8>(), at in 0usize..400) {
        let extender = extender();
        let mut body = sample_args().to_string().into_bytes();
        if at < body.len() {
            body[at] ^= flip;
        }
        body.truncate(cut.min(body.len()));
        check(&extender, &body);
    }

    #[test]
    fn arbitrary_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..256)) {
        check(&extender(), &body);
    }
}

#[test]
fn the_sample_is_judged() {
    let extender = extender();
    let args = wire::decode(sample_args().to_string().as_bytes()).unwrap();
    let (result, _) = extender.filter(&args);
    assert_eq!(result.node_names.unwrap(), ["vk-a", "regular"]);
    assert_eq!(
        result.failed_and_unresolvable_nodes["vk-b"],
        "lower cluster of vk-b: not synced yet"
    );
}
