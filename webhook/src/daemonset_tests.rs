#![allow(clippy::unwrap_used)]
use super::*;
use crate::review::GroupVersionKind;

fn request(operation: &str, object: Value) -> AdmissionRequest {
    AdmissionRequest {
        uid: "u".into(),
        kind: GroupVersionKind {
            group: "apps".into(),
            version: "v1".into(),
            kind: "DaemonSet".into(),
        },
        namespace: Some("ns".into()),
        name: Some("agent".into()),
        operation: operation.into(),
        object: Some(object),
        ..AdmissionRequest::default()
    }
}

/// A DaemonSet tolerating everything, with `labels` and template spec fields `extra`.
fn daemonset(labels: Value, extra: Value) -> Value {
    let mut spec = json!({
        "containers": [{"name": "agent", "image": "agent"}],
        "tolerations": [{"operator": "Exists"}],
    });
    if let (Value::Object(spec), Value::Object(extra)) = (&mut spec, extra) {
        spec.extend(extra);
    }
    json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "agent", "namespace": "ns", "labels": labels},
        "spec": {
            "selector": {"matchLabels": {"app": "agent"}},
            "template": {"metadata": {"labels": {"app": "agent"}}, "spec": spec},
        },
    })
}

fn ours() -> Value {
    off_virtual_nodes()
}

fn required(terms: Value) -> Value {
    json!({"affinity": {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": terms}}}})
}

fn apply(object: &Value, patch: &Patch) -> Value {
    let mut object = object.clone();
    json_patch::patch(&mut object, patch).unwrap();
    object
}

fn affinity(object: &Value) -> Value {
    object["spec"]["template"]["spec"]
        .get("affinity")
        .cloned()
        .unwrap_or(Value::Null)
}

const ALLOWED: &str = "allow";

/// (name, labels, template spec extras, decision, the affinity after the patch).
#[test]
fn keeps_daemonsets_off_virtual_nodes_unless_they_opt_in() {
    let ssd = json!({"key": "disktype", "operator": "In", "values": ["ssd"]});
    let host = json!({"key": "metadata.name", "operator": "In", "values": ["n1"]});
    let cases: Vec<(&str, Value, Value, Decision, Value)> = vec![
        (
            "no affinity: one term",
            json!({}),
            json!({}),
            Decision::Mutated,
            json!({"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [{"matchExpressions": [ours()]}]}}}),
        ),
        (
            "null affinity: one term",
            json!({}),
            json!({"affinity": null}),
            Decision::Mutated,
            json!({"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [{"matchExpressions": [ours()]}]}}}),
        ),
        (
            "pod anti-affinity and preferred node affinity kept",
            json!({}),
            json!({"affinity": {
                "podAntiAffinity": {"x": 1},
                "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1}]},
            }}),
            Decision::Mutated,
            json!({
                "podAntiAffinity": {"x": 1},
                "nodeAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1}],
                    REQUIRED: {"nodeSelectorTerms": [{"matchExpressions": [ours()]}]},
                },
            }),
        ),
        (
            "an empty list of terms gets one",
            json!({}),
            required(json!([])),
            Decision::Mutated,
            required(json!([{"matchExpressions": [ours()]}]))["affinity"].clone(),
        ),
        (
            "ANDed into every term: matchExpressions, matchFields, both",
            json!({}),
            required(json!([
                {"matchExpressions": [ssd]},
                {"matchFields": [host]},
                {"matchExpressions": [ssd], "matchFields": [host]},
            ])),
            Decision::Mutated,
            required(json!([
                {"matchExpressions": [ssd, ours()]},
                {"matchFields": [host], "matchExpressions": [ours()]},
                {"matchExpressions": [ssd, ours()], "matchFields": [host]},
            ]))["affinity"]
                .clone(),
        ),
        (
            "an empty term matches no node and stays so",
            json!({}),
            required(json!([{}, {"matchExpressions": [ssd]}])),
            Decision::Mutated,
            required(json!([{}, {"matchExpressions": [ssd, ours()]}]))["affinity"].clone(),
        ),
        (
            "already in every term: unchanged (no rollout)",
            json!({}),
            required(json!([
                {"matchExpressions": [ssd, ours()]},
                {"matchFields": [host], "matchExpressions": [ours()]},
            ])),
            Decision::Unchanged,
            required(json!([
                {"matchExpressions": [ssd, ours()]},
                {"matchFields": [host], "matchExpressions": [ours()]},
            ]))["affinity"]
                .clone(),
        ),
        (
            "written by hand with more values: counts as present",
            json!({}),
            required(json!([{"matchExpressions": [
                {"key": "type", "operator": "NotIn", "values": ["gpu", "virtual-kubelet"]}]}])),
            Decision::Unchanged,
            required(json!([{"matchExpressions": [
                {"key": "type", "operator": "NotIn", "values": ["gpu", "virtual-kubelet"]}]}]))
                ["affinity"]
                .clone(),
        ),
        (
            "present in one term only: added to the other",
            json!({}),
            required(json!([{"matchExpressions": [ours()]}, {"matchExpressions": [ssd]}])),
            Decision::Mutated,
            required(json!([{"matchExpressions": [ours()]}, {"matchExpressions": [ssd, ours()]}]))
                ["affinity"]
                .clone(),
        ),
        (
            "another label value: kept off, with a warning",
            json!({VIRTUAL_NODES_LABEL: "true"}),
            json!({}),
            Decision::Mutated,
            json!({"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [{"matchExpressions": [ours()]}]}}}),
        ),
        (
            "opt-in, no affinity: unchanged",
            json!({VIRTUAL_NODES_LABEL: ALLOWED}),
            json!({}),
            Decision::Unchanged,
            Value::Null,
        ),
        (
            "opt-in, a user's affinity: unchanged",
            json!({VIRTUAL_NODES_LABEL: ALLOWED}),
            required(json!([{"matchExpressions": [ssd]}])),
            Decision::Unchanged,
            required(json!([{"matchExpressions": [ssd]}]))["affinity"].clone(),
        ),
        (
            "opt-in later: what the webhook added goes, the affinity with it",
            json!({VIRTUAL_NODES_LABEL: ALLOWED}),
            required(json!([{"matchExpressions": [ours()]}])),
            Decision::Mutated,
            Value::Null,
        ),
        (
            "opt-in later: the user's requirements and other affinity stay",
            json!({VIRTUAL_NODES_LABEL: ALLOWED}),
            json!({"affinity": {
                "podAffinity": {"x": 1},
                "nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [
                    {"matchExpressions": [ssd, ours()]},
                    {"matchFields": [host], "matchExpressions": [ours()]},
                ]}},
            }}),
            Decision::Mutated,
            json!({
                "podAffinity": {"x": 1},
                "nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [
                    {"matchExpressions": [ssd]},
                    {"matchFields": [host]},
                ]}},
            }),
        ),
    ];
    for (name, labels, extra, decision, want) in cases {
        let object = daemonset(labels.clone(), extra);
        for operation in ["CREATE", "UPDATE"] {
            let outcome = admit(&request(operation, object.clone()));
            assert_eq!(outcome.decision, decision, "{name} ({operation})");
            let patched = apply(&object, &outcome.patch);
            assert_eq!(affinity(&patched), want, "{name} ({operation})");
            // Nothing but the affinity changes.
            let mut rest = patched.clone();
            let mut before = object.clone();
            for o in [&mut rest, &mut before] {
                o["spec"]["template"]["spec"]
                    .as_object_mut()
                    .unwrap()
                    .remove("affinity");
            }
            assert_eq!(rest, before, "{name} ({operation})");
            // Idempotent: the result admitted again changes nothing.
            let again = admit(&request(operation, patched.clone()));
            assert_eq!(again.decision, Decision::Unchanged, "{name}: again");
            assert!(again.patch.0.is_empty(), "{name}: again");
            let warned = labels
                .get(VIRTUAL_NODES_LABEL)
                .is_some_and(|v| v != ALLOWED);
            assert_eq!(!outcome.warnings.is_empty(), warned, "{name}: warnings");
        }
    }
}

/// Malformed input is allowed unchanged with a warning, never a panic.
#[test]
fn allows_unreadable_daemonsets_unchanged_with_a_warning() {
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "no template spec",
            json!({"metadata": {}, "spec": {"template": {}}}),
            "spec.template.spec is missing",
        ),
        (
            "spec not an object",
            json!({"metadata": {}, "spec": 5}),
            "spec.template.spec is missing",
        ),
        (
            "affinity a string",
            daemonset(json!({}), json!({"affinity": "x"})),
            "affinity is not an object",
        ),
        (
            "nodeAffinity an array",
            daemonset(json!({}), json!({"affinity": {"nodeAffinity": []}})),
            "nodeAffinity is not an object",
        ),
        (
            "required a number",
            daemonset(
                json!({}),
                json!({"affinity": {"nodeAffinity": {REQUIRED: 3}}}),
            ),
            "requiredDuringSchedulingIgnoredDuringExecution is not an object",
        ),
        (
            "terms an object",
            daemonset(json!({}), required(json!({"a": 1}))),
            "nodeSelectorTerms is not an array",
        ),
        (
            "a term a string",
            daemonset(json!({}), required(json!(["x"]))),
            "nodeSelectorTerms[0] is not an object",
        ),
        (
            "matchExpressions an object",
            daemonset(json!({}), required(json!([{"matchExpressions": {}}]))),
            "matchExpressions is not an array",
        ),
        (
            "matchFields a string",
            daemonset(json!({}), required(json!([{"matchFields": "x"}]))),
            "matchFields is not an array",
        ),
        (
            "opted in, a term a number",
            daemonset(
                json!({VIRTUAL_NODES_LABEL: ALLOWED}),
                required(json!([{"matchExpressions": [ours()]}, 7])),
            ),
            "nodeSelectorTerms[1] is not an object",
        ),
    ];
    for (name, object, want) in cases {
        let outcome = admit(&request("CREATE", object));
        assert_eq!(outcome.decision, Decision::Unreadable, "{name}");
        assert!(outcome.patch.0.is_empty(), "{name}");
        assert_eq!(outcome.warnings.len(), 1, "{name}");
        assert!(
            outcome.warnings[0].contains(want),
            "{name}: {:?}",
            outcome.warnings
        );
        assert!(outcome.warnings[0].contains("ns/agent"), "{name}");
    }
}

#[test]
fn ignores_what_is_not_a_daemonset_create_or_update() {
    let object = daemonset(json!({}), json!({}));
    let pod = AdmissionRequest {
        kind: GroupVersionKind {
            group: String::new(),
            version: "v1".into(),
            kind: "Pod".into(),
        },
        ..request("CREATE", object.clone())
    };
    let status = AdmissionRequest {
        sub_resource: Some("status".into()),
        ..request("UPDATE", object.clone())
    };
    let other_group = AdmissionRequest {
        kind: GroupVersionKind {
            group: "example.com".into(),
            version: "v1".into(),
            kind: "DaemonSet".into(),
        },
        ..request("CREATE", object.clone())
    };
    let delete = AdmissionRequest {
        object: None,
        ..request("DELETE", object.clone())
    };
    for (name, request) in [
        ("a pod", pod),
        ("the status subresource", status),
        ("another group's DaemonSet", other_group),
        ("a delete", delete),
    ] {
        let outcome = admit(&request);
        assert_eq!(outcome.decision, Decision::Ignored, "{name}");
        assert!(outcome.patch.0.is_empty(), "{name}");
    }
}
