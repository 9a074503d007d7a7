//! Fuzzing the request decoder and the mutation with generated input.
//!
//! The properties run for a bounded number of cases and are not part of the default test
//! run (they are `#[ignore]`d); run them with, e.g.,
//! `PROPTEST_CASES=20000 cargo test -p tensile-webhook --test fuzz -- --ignored`.
//! A fixed corpus of hostile pods goes through the same checks in every test run.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::collections::BTreeMap;
use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use proptest::prelude::*;
use serde_json::{Value, json};
use tensile_webhook::loopback::sample_review;
use tensile_webhook::memory::DeschedulerMemory;
use tensile_webhook::mutate::{Decision, MutateConfig, admit};
use tensile_webhook::review;

const PATHS: [&str; 18] = [
    "/apiVersion",
    "/kind",
    "/request/uid",
    "/request/kind",
    "/request/operation",
    "/request/namespace",
    "/request/object",
    "/request/object/metadata",
    "/request/object/metadata/labels",
    "/request/object/metadata/annotations",
    "/request/object/metadata/ownerReferences",
    "/request/object/spec",
    "/request/object/spec/tolerations",
    "/request/object/spec/affinity",
    "/request/object/spec/affinity/nodeAffinity",
    "/request/object/spec/nodeSelector",
    "/request/object/spec/volumes",
    "/request/object/spec/nodeName",
];

const KEYS: [&str; 14] = [
    "key",
    "operator",
    "values",
    "effect",
    "nodeSelectorTerms",
    "matchExpressions",
    "matchFields",
    "requiredDuringSchedulingIgnoredDuringExecution",
    "preferredDuringSchedulingIgnoredDuringExecution",
    "nodeAffinity",
    "persistentVolumeClaim",
    "claimName",
    "virtual-pod",
    "clusterSelector",
];

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        prop_oneof![
            Just("true"),
            Just("Exists"),
            Just("Equal"),
            Just("In"),
            Just("NotIn"),
            Just("NoExecute"),
            Just(""),
            Just("kube-system"),
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

/// A pod review with up to four of its fields replaced by generated JSON, or removed.
fn review_value() -> impl Strategy<Value = Value> {
    let edits = prop::collection::vec(
        (
            prop::sample::select(PATHS.to_vec()),
            prop::option::of(json_value()),
        ),
        0..4,
    );
    (
        any::<bool>(),
        prop_oneof![Just("CREATE"), Just("UPDATE")],
        edits,
    )
        .prop_map(|(labelled, operation, edits)| {
            let mut review = sample_review("fuzz", labelled);
            review["request"]["operation"] = operation.into();
            for (path, value) in edits {
                let (parent, last) = path.rsplit_once('/').unwrap();
                if let Some(Value::Object(map)) = review.pointer_mut(parent) {
                    match value {
                        Some(value) => map.insert(last.to_owned(), value),
                        None => map.remove(last),
                    };
                }
            }
            review
        })
}

/// Decodes and admits `body`; checks what must hold whatever came in.
fn check(body: &[u8]) {
    let Ok(request) = review::decode(body) else {
        return;
    };
    let memory = DeschedulerMemory::default();
    memory.remember(
        "0f9f4c3e-1d2b-4c5d-8e9f-0a1b2c3d4e5f",
        "vk-old",
        Instant::now(),
    );
    let volumes: BTreeMap<(String, String), String> = BTreeMap::new();
    let config = MutateConfig::default();
    let outcome = admit(&request, &config, &memory, &volumes, Instant::now());
    let Some(object) = request.object.clone() else {
        assert!(outcome.patch.0.is_empty());
        return;
    };
    if outcome.decision != Decision::Mutated {
        assert!(
            outcome.patch.0.is_empty(),
            "{:?} with a patch",
            outcome.decision
        );
        return;
    }
    assert_eq!(
        object["metadata"]["labels"]["virtual-pod"], "true",
        "mutated an unlabelled pod"
    );
    let mut patched = object.clone();
    json_patch::patch(&mut patched, &outcome.patch)
        .unwrap_or_else(|e| panic!("patch does not apply: {e}\n{:?}\n{object}", outcome.patch));
    serde_json::from_value::<Pod>(patched.clone()).expect("the mutated pod is a pod");
    // Admitting the result again changes nothing.
    let mut again = request.clone();
    again.object = Some(patched);
    let second = admit(&again, &config, &memory, &volumes, Instant::now());
    assert!(
        second.patch.0.is_empty(),
        "not idempotent: {:?}",
        second.patch
    );
}

proptest! {
    #[test]
    #[ignore = "fuzzing: run with --ignored and PROPTEST_CASES"]
    fn decoder_survives_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        check(&bytes);
    }

    #[test]
    #[ignore = "fuzzing: run with --ignored and PROPTEST_CASES"]
    fn decoder_survives_truncation_and_flips(cut in any::<prop::sample::Index>(), flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6)) {
        let mut bytes = serde_json::to_vec(&sample_review("fuzz", true)).unwrap();
        for (at, byte) in flips {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        let keep = cut.index(bytes.len() + 1);
        bytes.truncate(keep);
        check(&bytes);
    }

    #[test]
    #[ignore = "fuzzing: run with --ignored and PROPTEST_CASES"]
    fn mutation_holds_for_generated_pods(review in review_value()) {
        check(&serde_json::to_vec(&review).unwrap());
    }
}

/// The same checks over hand-picked hostile pods, in every test run.
#[test]
fn hostile_corpus() {
    let edits: Vec<(&str, Value)> = vec![
        ("/request/object/spec/tolerations", json!(null)),
        ("/request/object/spec/tolerations", json!([])),
        ("/request/object/spec/tolerations", json!([{}])),
        (
            "/request/object/spec/tolerations",
            json!([{"operator": "Exists"}]),
        ),
        ("/request/object/spec/affinity", json!({})),
        ("/request/object/spec/affinity", json!({"nodeAffinity": {}})),
        (
            "/request/object/spec/affinity",
            json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}),
        ),
        (
            "/request/object/spec/affinity",
            json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{}, {"matchFields": []}]}}}),
        ),
        (
            "/request/object/spec/affinity",
            json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "clusterID", "operator": "Exists"}], "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}]}}}),
        ),
        ("/request/object/spec/affinity", json!("x")),
        ("/request/object/spec/nodeSelector", json!({})),
        ("/request/object/spec/nodeSelector", json!(null)),
        (
            "/request/object/spec/nodeSelector",
            json!({"clusterID": "only-kept"}),
        ),
        ("/request/object/spec/nodeName", json!("")),
        (
            "/request/object/spec/volumes",
            json!([{"name": "v", "persistentVolumeClaim": {"claimName": ""}}]),
        ),
        ("/request/object/spec", json!(null)),
        ("/request/object/spec", json!({})),
        (
            "/request/object/metadata",
            json!({"labels": {"virtual-pod": "true"}}),
        ),
        ("/request/object/metadata/annotations", json!(null)),
        (
            "/request/object/metadata/annotations",
            json!({"clusterSelector": ""}),
        ),
        (
            "/request/object/metadata/annotations",
            json!({"clusterSelector": "null"}),
        ),
        (
            "/request/object/metadata/annotations",
            json!({"clusterSelector": "[]"}),
        ),
        (
            "/request/object/metadata/ownerReferences",
            json!([{"uid": ""}]),
        ),
        (
            "/request/object/metadata/labels",
            json!({"virtual-pod": true}),
        ),
        ("/request/namespace", json!(null)),
        ("/request/kind", json!(null)),
    ];
    for (path, value) in edits {
        for operation in ["CREATE", "UPDATE"] {
            let mut review = sample_review("corpus", true);
            review["request"]["operation"] = operation.into();
            let (parent, last) = path.rsplit_once('/').unwrap();
            review
                .pointer_mut(parent)
                .and_then(Value::as_object_mut)
                .unwrap()
                .insert(last.to_owned(), value.clone());
            check(&serde_json::to_vec(&review).unwrap());
        }
    }
}
