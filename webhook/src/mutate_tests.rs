//! The core, table-tested: tensile-kube's inject and tolerations cases as behaviour, the
//! cases its bugs got wrong, and the patch applied to the raw object.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use serde_json::json;

use super::*;

const NOT_READY_300: &str = r#"{"key":"node.kubernetes.io/not-ready","operator":"Exists","effect":"NoExecute","tolerationSeconds":300}"#;
const UNREACHABLE_300: &str = r#"{"key":"node.kubernetes.io/unreachable","operator":"Exists","effect":"NoExecute","tolerationSeconds":300}"#;

fn defaults() -> Value {
    json!([
        serde_json::from_str::<Value>(NOT_READY_300).unwrap(),
        serde_json::from_str::<Value>(UNREACHABLE_300).unwrap(),
    ])
}

fn forever(key: &str) -> Value {
    json!({"key": key, "operator": "Exists", "effect": "NoExecute"})
}

fn virtual_toleration() -> Value {
    json!({"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"})
}

/// The tolerations every mutated pod ends up with when it had only the API server's
/// defaults.
fn upper_defaults() -> Value {
    json!([
        forever(NOT_READY),
        forever(UNREACHABLE),
        virtual_toleration()
    ])
}

fn labelled(spec: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "web-", "namespace": "apps", "labels": {"virtual-pod": "true", "app": "web"}},
        "spec": spec,
    })
}

fn with_spec(spec: Value) -> Value {
    let mut base =
        json!({"containers": [{"name": "app", "image": "nginx"}], "tolerations": defaults()});
    base.as_object_mut()
        .unwrap()
        .extend(spec.as_object().unwrap().clone());
    base
}

fn request(operation: &str, object: Value) -> AdmissionRequest {
    let namespace = object["metadata"]["namespace"].as_str().map(str::to_owned);
    AdmissionRequest {
        uid: "uid-1".into(),
        kind: crate::review::GroupVersionKind {
            group: String::new(),
            version: "v1".into(),
            kind: "Pod".into(),
        },
        namespace,
        operation: operation.into(),
        object: Some(object),
        ..AdmissionRequest::default()
    }
}

struct Env {
    config: MutateConfig,
    memory: DeschedulerMemory,
    volumes: BTreeMap<(String, String), String>,
    now: Instant,
}

impl Env {
    /// The default configuration less the preference for regular nodes, which
    /// `local_first_*` tests cover: the other tests' expectations stay about their subject.
    fn new() -> Self {
        Self {
            config: MutateConfig {
                prefer_regular_nodes: false,
                ..MutateConfig::default()
            },
            memory: DeschedulerMemory::default(),
            volumes: BTreeMap::new(),
            now: Instant::now(),
        }
    }

    fn admit(&self, request: &AdmissionRequest) -> Outcome {
        admit(request, &self.config, &self.memory, &self.volumes, self.now)
    }

    /// Admits a CREATE of `object` and returns the outcome and the patched object.
    fn create(&self, object: &Value) -> (Outcome, Value) {
        let outcome = self.admit(&request("CREATE", object.clone()));
        let mut patched = object.clone();
        json_patch::patch(&mut patched, &outcome.patch).expect("the patch applies");
        (outcome, patched)
    }
}

fn stash_of(pod: &Value) -> Option<Value> {
    let raw = pod["metadata"]["annotations"][CLUSTER_SELECTOR_ANNOTATION].as_str()?;
    Some(serde_json::from_str(raw).unwrap())
}

/// tensile-kube's `TestGetPodTolerations`, plus the virtual node's toleration.
#[test]
fn normalises_tolerations_like_tensile_kube() {
    let tolerations = |v: Value| -> Vec<Toleration> { serde_json::from_value(v).unwrap() };
    let testbase = json!({"key": "testbase", "operator": "Exists", "effect": "NoExecute"});
    let all = json!({"operator": "Exists"});
    let provider_any_effect = json!({"key": "virtual-kubelet.io/provider", "operator": "Exists"});
    let provider_equal = json!({"key": "virtual-kubelet.io/provider", "operator": "Equal", "value": "k8s", "effect": "NoSchedule"});
    let virtual_node: Toleration = serde_json::from_value(virtual_toleration()).unwrap();
    // (case, tolerations, add the virtual node's, expected)
    let cases: Vec<(&str, Option<Value>, bool, Value)> = vec![
        (
            "system tolerations lose their seconds",
            Some(defaults()),
            false,
            json!([forever(NOT_READY), forever(UNREACHABLE)]),
        ),
        (
            "other tolerations kept, system ones added",
            Some(json!([testbase])),
            false,
            json!([testbase, forever(NOT_READY), forever(UNREACHABLE)]),
        ),
        (
            "none at all",
            None,
            false,
            json!([forever(NOT_READY), forever(UNREACHABLE)]),
        ),
        (
            "virtual node's toleration added",
            Some(defaults()),
            true,
            upper_defaults(),
        ),
        (
            "a tolerate-everything toleration covers it",
            Some(json!([all])),
            true,
            json!([all, forever(NOT_READY), forever(UNREACHABLE)]),
        ),
        (
            "an Exists on the key with any effect covers it",
            Some(json!([provider_any_effect])),
            true,
            json!([
                provider_any_effect,
                forever(NOT_READY),
                forever(UNREACHABLE)
            ]),
        ),
        (
            "an Equal on some value may not: ours is added",
            Some(json!([provider_equal])),
            true,
            json!([
                provider_equal,
                forever(NOT_READY),
                forever(UNREACHABLE),
                virtual_toleration()
            ]),
        ),
        (
            "duplicates collapse",
            Some(json!([
                testbase,
                testbase,
                forever(NOT_READY),
                serde_json::from_str::<Value>(NOT_READY_300).unwrap()
            ])),
            false,
            json!([testbase, forever(NOT_READY), forever(UNREACHABLE)]),
        ),
    ];
    for (name, input, add, want) in cases {
        let input = input.map(tolerations);
        let got = upper_tolerations(input.as_deref(), add.then_some(&virtual_node));
        assert_eq!(got, tolerations(want), "{name}");
    }
}

/// tensile-kube's `TestInject` table, through the whole request: what is stashed and what
/// the upper pod keeps.
#[test]
fn stashes_constraints_like_tensile_kube_inject() {
    let four = json!({"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "test0", "operator": "In", "values": ["aa"]},
        {"key": "clusterID", "operator": "In", "values": ["aa"]},
        {"key": "test", "operator": "In", "values": ["aa"]},
        {"key": "test1", "operator": "In", "values": ["aa"]},
    ]}]});
    let only = |keys: &[&str]| {
        let exprs: Vec<Value> = keys
            .iter()
            .map(|k| json!({"key": k, "operator": "In", "values": ["aa"]}))
            .collect();
        json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": exprs}]}}})
    };
    let selector_and_affinity = json!({
        "nodeSelector": {"testbase": "testbase", "clusterID": "1"},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": four}},
    });
    // (case, spec, keys kept, expected stash less tolerations, expected upper nodeSelector, affinity)
    type Case = (
        &'static str,
        Value,
        &'static [&'static str],
        Value,
        Value,
        Value,
    );
    let cases: Vec<Case> = vec![
        (
            "node selector",
            json!({"nodeSelector": {"testbase": "testbase"}}),
            &[],
            json!({"nodeSelector": {"testbase": "testbase"}}),
            Value::Null,
            Value::Null,
        ),
        (
            "node selector with clusterID",
            json!({"nodeSelector": {"testbase": "testbase", "clusterID": "1"}}),
            &["clusterID"],
            json!({"nodeSelector": {"testbase": "testbase"}}),
            json!({"clusterID": "1"}),
            Value::Null,
        ),
        (
            "node selector and affinity with clusterID",
            selector_and_affinity.clone(),
            &["clusterID"],
            json!({"nodeSelector": {"testbase": "testbase"}, "affinity": only(&["test0", "test", "test1"])}),
            json!({"clusterID": "1"}),
            only(&["clusterID"]),
        ),
        (
            "node selector and affinity without kept keys",
            selector_and_affinity.clone(),
            &[],
            json!({"nodeSelector": {"testbase": "testbase", "clusterID": "1"},
                   "affinity": only(&["test0", "clusterID", "test", "test1"])}),
            Value::Null,
            Value::Null,
        ),
        (
            "node selector and affinity with several kept keys",
            selector_and_affinity,
            &["clusterID", "test0"],
            json!({"nodeSelector": {"testbase": "testbase"}, "affinity": only(&["test", "test1"])}),
            json!({"clusterID": "1"}),
            only(&["test0", "clusterID"]),
        ),
        (
            "affinity",
            json!({"nodeSelector": {"testbase": "testbase"}, "affinity": only(&["testbase"])}),
            &[],
            json!({"nodeSelector": {"testbase": "testbase"}, "affinity": only(&["testbase"])}),
            Value::Null,
            Value::Null,
        ),
    ];
    for (name, spec, keep, mut want_stash, want_selector, want_affinity) in cases {
        let mut env = Env::new();
        env.config.ignore_selector_keys = keep.iter().map(|k| (*k).to_owned()).collect();
        let (outcome, pod) = env.create(&labelled(with_spec(spec)));
        assert_eq!(outcome.decision, Decision::Mutated, "{name}");
        want_stash["tolerations"] = defaults();
        assert_eq!(stash_of(&pod), Some(want_stash), "{name}: stash");
        assert_eq!(
            pod["spec"]["nodeSelector"], want_selector,
            "{name}: nodeSelector"
        );
        assert_eq!(pod["spec"]["affinity"], want_affinity, "{name}: affinity");
        assert_eq!(
            pod["spec"]["tolerations"],
            upper_defaults(),
            "{name}: tolerations"
        );
    }
}

/// What selects the virtual node itself (`type: virtual-kubelet`, Kueue's flavor for
/// virtual nodes puts it in the nodeSelector) stays upstairs, where it keeps the pod on a
/// virtual node, and is not stashed: below, it would match no node. Anything else on
/// `type` moves as before; the lower copy ends with the rest only.
#[test]
fn keeps_what_selects_the_virtual_node_upstairs() {
    let required = |terms: Value| {
        json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": terms}}})
    };
    let req = |key: &str, operator: &str, values: &[&str]| json!({"key": key, "operator": operator, "values": values});
    let vk = req("type", "In", &["virtual-kubelet"]);
    let zone = req("zone", "In", &["a"]);
    // (case, spec, keys kept, expected stash less tolerations, upper nodeSelector, affinity)
    type Case = (
        &'static str,
        Value,
        &'static [&'static str],
        Value,
        Value,
        Value,
    );
    let cases: Vec<Case> = vec![
        (
            "Kueue's flavor: the nodeSelector entry stays, the rest moves",
            json!({"nodeSelector": {"type": "virtual-kubelet", "disktype": "ssd"}}),
            &[],
            json!({"nodeSelector": {"disktype": "ssd"}}),
            json!({"type": "virtual-kubelet"}),
            Value::Null,
        ),
        (
            "alone, nothing is stashed but the tolerations",
            json!({"nodeSelector": {"type": "virtual-kubelet"}}),
            &[],
            json!({}),
            json!({"type": "virtual-kubelet"}),
            Value::Null,
        ),
        (
            "beside a kept key",
            json!({"nodeSelector": {"type": "virtual-kubelet", "clusterID": "1", "disktype": "ssd"}}),
            &["clusterID"],
            json!({"nodeSelector": {"disktype": "ssd"}}),
            json!({"type": "virtual-kubelet", "clusterID": "1"}),
            Value::Null,
        ),
        (
            "another value of type is the lower nodes'",
            json!({"nodeSelector": {"type": "gpu"}}),
            &[],
            json!({"nodeSelector": {"type": "gpu"}}),
            Value::Null,
            Value::Null,
        ),
        (
            "required affinity: type In [virtual-kubelet] stays, the term's rest moves",
            json!({"affinity": required(json!([{"matchExpressions": [vk, zone]}]))}),
            &[],
            json!({"affinity": required(json!([{"matchExpressions": [zone]}]))}),
            Value::Null,
            required(json!([{"matchExpressions": [vk]}])),
        ),
        (
            "required affinity: more values than the virtual node's move",
            json!({"affinity": required(json!([{"matchExpressions": [
                req("type", "In", &["virtual-kubelet", "kwok"])]}]))}),
            &[],
            json!({"affinity": required(json!([{"matchExpressions": [
                req("type", "In", &["virtual-kubelet", "kwok"])]}]))}),
            Value::Null,
            Value::Null,
        ),
        (
            "required affinity: NotIn moves",
            json!({"affinity": required(json!([{"matchExpressions": [
                req("type", "NotIn", &["virtual-kubelet"])]}]))}),
            &[],
            json!({"affinity": required(json!([{"matchExpressions": [
                req("type", "NotIn", &["virtual-kubelet"])]}]))}),
            Value::Null,
            Value::Null,
        ),
    ];
    for (name, spec, keep, mut want_stash, want_selector, want_affinity) in cases {
        let mut env = Env::new();
        env.config.ignore_selector_keys = keep.iter().map(|k| (*k).to_owned()).collect();
        let (outcome, pod) = env.create(&labelled(with_spec(spec)));
        assert_eq!(outcome.decision, Decision::Mutated, "{name}");
        want_stash["tolerations"] = defaults();
        assert_eq!(stash_of(&pod), Some(want_stash.clone()), "{name}: stash");
        assert_eq!(
            pod["spec"]["nodeSelector"], want_selector,
            "{name}: nodeSelector"
        );
        assert_eq!(pod["spec"]["affinity"], want_affinity, "{name}: affinity");

        // Below: what the stash held, and no more.
        let pod: Pod = serde_json::from_value(pod).unwrap();
        let mut lower = pod.spec.clone().unwrap();
        let stash = parse_cluster_selector(pod.metadata.annotations.as_ref()).unwrap();
        tensile::translate::scheduling::restore_constraints(&mut lower, stash.as_ref());
        assert_eq!(
            serde_json::to_value(&lower.node_selector).unwrap(),
            want_stash["nodeSelector"],
            "{name}: the lower copy's nodeSelector"
        );
        assert_eq!(
            serde_json::to_value(&lower.affinity).unwrap(),
            want_stash["affinity"],
            "{name}: the lower copy's affinity"
        );
    }
}

/// Pods the webhook must leave alone, including the unlabelled pod tensile-kube mutated.
#[test]
fn leaves_other_pods_and_requests_alone() {
    let spec = with_spec(json!({"nodeSelector": {"disktype": "ssd"}}));
    let pod_with = |metadata: Value| json!({"metadata": metadata, "spec": spec});
    let mut not_pod = request(
        "CREATE",
        json!({"metadata": {"labels": {"virtual-pod": "true"}}, "spec": {}}),
    );
    not_pod.kind.kind = "Deployment".into();
    not_pod.kind.group = "apps".into();
    let mut binding = request("CREATE", labelled(spec.clone()));
    binding.sub_resource = Some("binding".into());
    let cases: Vec<(&str, AdmissionRequest)> = vec![
        (
            "no labels at all (tensile-kube mutated it)",
            request(
                "CREATE",
                pod_with(json!({"name": "p", "namespace": "apps"})),
            ),
        ),
        (
            "other labels",
            request(
                "CREATE",
                pod_with(json!({"name": "p", "namespace": "apps", "labels": {"app": "x"}})),
            ),
        ),
        (
            "virtual-pod not true",
            request(
                "CREATE",
                pod_with(
                    json!({"name": "p", "namespace": "apps", "labels": {"virtual-pod": "false"}}),
                ),
            ),
        ),
        (
            "kube-system",
            request(
                "CREATE",
                pod_with(
                    json!({"name": "p", "namespace": "kube-system", "labels": {"virtual-pod": "true"}}),
                ),
            ),
        ),
        (
            "re-created by the descheduler",
            request(
                "CREATE",
                pod_with(json!({"name": "p", "namespace": "apps",
            "labels": {"virtual-pod": "true", "create-by-descheduler": "true"}})),
            ),
        ),
        ("not a pod", not_pod),
        ("a subresource", binding),
        ("DELETE", request("DELETE", labelled(spec.clone()))),
        ("CONNECT", request("CONNECT", labelled(spec.clone()))),
    ];
    let env = Env::new();
    for (name, request) in cases {
        let outcome = env.admit(&request);
        assert_eq!(outcome.decision, Decision::Ignored, "{name}");
        assert!(outcome.patch.0.is_empty(), "{name}");
        assert!(outcome.warnings.is_empty(), "{name}");
    }
}

/// The API server's namespace wins over the object's (which is often unset on CREATE).
#[test]
fn excluded_namespace_comes_from_the_request() {
    let mut pod = labelled(with_spec(json!({})));
    pod["metadata"].as_object_mut().unwrap().remove("namespace");
    let mut req = request("CREATE", pod);
    req.namespace = Some("kube-system".into());
    assert_eq!(Env::new().admit(&req).decision, Decision::Ignored);
}

#[test]
fn patch_is_minimal_with_and_without_annotations() {
    let env = Env::new();
    let spec = with_spec(json!({"nodeSelector": {"disktype": "ssd"}}));
    // Without annotations: the map is added whole.
    let (outcome, pod) = env.create(&labelled(spec.clone()));
    let ops = serde_json::to_value(&outcome.patch).unwrap();
    let stash = json!({"nodeSelector": {"disktype": "ssd"}, "tolerations": defaults()}).to_string();
    assert_eq!(
        ops,
        json!([
            {"op": "add", "path": "/metadata/annotations", "value": {"clusterSelector": stash}},
            {"op": "remove", "path": "/spec/nodeSelector"},
            {"op": "add", "path": "/spec/tolerations", "value": upper_defaults()},
        ])
    );
    assert_eq!(
        stash_of(&pod).unwrap()["nodeSelector"],
        json!({"disktype": "ssd"})
    );

    // With annotations: one key is added, the others stay.
    let mut object = labelled(spec);
    object["metadata"]["annotations"] = json!({"owner": "team-a", "a/b~c": "x"});
    let (outcome, pod) = env.create(&object);
    assert_eq!(
        serde_json::to_value(&outcome.patch).unwrap()[0]["path"],
        "/metadata/annotations/clusterSelector"
    );
    assert_eq!(pod["metadata"]["annotations"]["owner"], "team-a");
    assert_eq!(pod["metadata"]["annotations"]["a/b~c"], "x");

    // Null annotations are replaced by a map.
    let mut object = labelled(with_spec(json!({"nodeSelector": {"a": "b"}})));
    object["metadata"]["annotations"] = Value::Null;
    let (_, pod) = env.create(&object);
    assert!(stash_of(&pod).is_some());
}

#[test]
fn only_required_node_affinity_leaves_an_existing_affinity() {
    let preferred = json!([{"weight": 1, "preference": {"matchExpressions": [{"key": "ssd", "operator": "Exists"}]}}]);
    let anti = json!({"requiredDuringSchedulingIgnoredDuringExecution": [
        {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "web"}}}]});
    let required = json!({"nodeSelectorTerms": [{"matchExpressions": [{"key": "disktype", "operator": "In", "values": ["ssd"]}]}]});
    let object = labelled(with_spec(json!({"affinity": {
        "podAntiAffinity": anti,
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required,
                         "preferredDuringSchedulingIgnoredDuringExecution": preferred}}})));
    let (outcome, pod) = Env::new().create(&object);
    let ops = serde_json::to_value(&outcome.patch).unwrap();
    assert!(
        ops.as_array().unwrap().contains(&json!({"op": "remove",
            "path": "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution"})),
        "{ops}"
    );
    assert_eq!(
        pod["spec"]["affinity"],
        json!({"podAntiAffinity": anti,
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred}})
    );
    assert_eq!(
        stash_of(&pod).unwrap()["affinity"],
        json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}})
    );
}

#[test]
fn a_pod_without_constraints_gets_only_tolerations() {
    let object = labelled(json!({"containers": [{"name": "app", "image": "nginx"}]}));
    let (outcome, pod) = Env::new().create(&object);
    assert_eq!(outcome.decision, Decision::Mutated);
    assert_eq!(
        serde_json::to_value(&outcome.patch).unwrap(),
        json!([
            {"op": "add", "path": "/metadata/annotations", "value": {"clusterSelector": "{}"}},
            {"op": "add", "path": "/spec/tolerations", "value":
                [forever(NOT_READY), forever(UNREACHABLE), virtual_toleration()]},
        ])
    );
    // An empty stash still marks the pod as done, so a second pass stashes nothing.
    assert_eq!(stash_of(&pod), Some(json!({})));

    let mut env = Env::new();
    env.config.virtual_node_toleration = None;
    let (_, pod) = env.create(&object);
    assert_eq!(
        pod["spec"]["tolerations"],
        json!([forever(NOT_READY), forever(UNREACHABLE)])
    );
}

#[test]
fn mutating_twice_changes_nothing_more() {
    let env = Env::new();
    let object = labelled(with_spec(
        json!({"nodeSelector": {"disktype": "ssd", "clusterID": "vk"},
        "tolerations": [{"key": "gpu", "operator": "Exists"}]}),
    ));
    let (_, once) = env.create(&object);
    let (outcome, twice) = env.create(&once);
    assert_eq!(outcome.decision, Decision::Unchanged);
    assert!(outcome.patch.0.is_empty());
    assert_eq!(once, twice);
    // The stash still holds the originals, not the upper constraints.
    assert_eq!(
        stash_of(&twice).unwrap()["nodeSelector"],
        json!({"disktype": "ssd"})
    );
    assert_eq!(
        stash_of(&twice).unwrap()["tolerations"],
        json!([{"key": "gpu", "operator": "Exists"}])
    );
}

#[test]
fn unreadable_pods_are_allowed_unchanged_with_a_warning() {
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "tolerations a string",
            labelled(json!({"containers": [], "tolerations": "all"})),
            "cannot read the pod",
        ),
        (
            "affinity a list",
            labelled(json!({"containers": [], "affinity": [1, 2]})),
            "cannot read the pod",
        ),
        (
            "nodeSelector values numbers",
            labelled(json!({"containers": [], "nodeSelector": {"a": 1}})),
            "cannot read the pod",
        ),
        (
            "a malformed stash",
            {
                let mut pod = labelled(json!({"containers": []}));
                pod["metadata"]["annotations"] = json!({"clusterSelector": "{nope"});
                pod
            },
            "cannot read clusterSelector",
        ),
    ];
    for (name, object, want) in cases {
        let outcome = Env::new().admit(&request("CREATE", object));
        assert_eq!(outcome.decision, Decision::Unreadable, "{name}");
        assert!(outcome.patch.0.is_empty(), "{name}");
        assert_eq!(outcome.warnings.len(), 1, "{name}");
        assert!(
            outcome.warnings[0].contains(want),
            "{name}: {:?}",
            outcome.warnings
        );
        assert!(
            outcome.warnings[0].contains("apps/web-"),
            "{name}: {:?}",
            outcome.warnings
        );
        assert!(outcome.warnings[0].len() <= 260, "{name}");
    }
}

#[test]
fn binds_to_the_node_a_mounted_pvc_was_provisioned_on() {
    let mut env = Env::new();
    env.volumes
        .insert(("apps".into(), "data".into()), "vk-node".into());
    let volumes = json!([
        {"name": "cfg", "configMap": {"name": "cfg"}},
        {"name": "scratch", "persistentVolumeClaim": {"claimName": "unbound"}},
        {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
    ]);
    let (_, pod) = env.create(&labelled(with_spec(json!({"volumes": volumes}))));
    assert_eq!(pod["spec"]["nodeName"], "vk-node");

    // A pod that names its node keeps it.
    let (_, pod) = env.create(&labelled(with_spec(
        json!({"volumes": volumes, "nodeName": "mine"}),
    )));
    assert_eq!(pod["spec"]["nodeName"], "mine");

    // Another namespace's PVC of the same name does not count.
    let mut other = labelled(with_spec(json!({"volumes": volumes})));
    other["metadata"]["namespace"] = json!("other");
    let (_, pod) = env.create(&other);
    assert_eq!(pod["spec"].get("nodeName"), None);
}

fn owned(mut pod: Value, owner: &str) -> Value {
    pod["metadata"]["ownerReferences"] = json!([
        {"apiVersion": "v1", "kind": "Thing", "name": "t", "uid": "not-the-controller"},
        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web", "uid": owner, "controller": true},
    ]);
    pod
}

fn descheduled(owner: &str, node: &str) -> Value {
    let mut pod = owned(labelled(with_spec(json!({"nodeName": node}))), owner);
    pod["metadata"]["name"] = json!("web-old");
    pod["metadata"]["annotations"] = json!({"unschedulable-node": node});
    pod
}

#[test]
fn keeps_a_descheduled_pods_sibling_off_the_node_it_left() {
    let mut env = Env::new();
    let outcome = env.admit(&request("UPDATE", descheduled("rs-1", "vk-a")));
    assert_eq!(outcome.decision, Decision::Remembered);
    assert!(outcome.patch.0.is_empty());
    env.admit(&request("UPDATE", descheduled("rs-1", "vk-b")));

    let kept = json!({"nodeSelectorTerms": [{"matchExpressions": [{"key": "clusterID", "operator": "In", "values": ["c"]}]}]});
    let sibling = owned(
        labelled(with_spec(json!({"nodeSelector": {"disktype": "ssd"},
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": kept}}}))),
        "rs-1",
    );
    let (_, pod) = env.create(&sibling);
    let not_in =
        json!({"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["vk-a", "vk-b"]});
    assert_eq!(
        pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"],
        json!({"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "clusterID", "operator": "In", "values": ["c"]}, not_in]}]}),
        "kept in the upper spec, in every alternative"
    );
    assert_eq!(stash_of(&pod).unwrap().get("affinity"), None, "not stashed");

    // Without other affinity, the requirement is the whole of it.
    let bare = owned(labelled(with_spec(json!({}))), "rs-1");
    let (_, pod) = env.create(&bare);
    assert_eq!(
        pod["spec"]["affinity"],
        json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
            {"nodeSelectorTerms": [{"matchExpressions": [not_in]}]}}})
    );

    // Other owners are not affected; after five minutes, nor is this one.
    let (_, pod) = env.create(&owned(labelled(with_spec(json!({}))), "rs-2"));
    assert_eq!(pod["spec"].get("affinity"), None);
    env.now += Duration::from_secs(301);
    let (_, pod) = env.create(&bare);
    assert_eq!(pod["spec"].get("affinity"), None);
}

#[test]
fn remembers_nothing_from_dry_runs_ownerless_pods_or_plain_updates() {
    let env = Env::new();
    let mut dry = request("UPDATE", descheduled("rs-1", "vk-a"));
    dry.dry_run = Some(true);
    assert_eq!(env.admit(&dry).decision, Decision::Unchanged);

    let mut ownerless = descheduled("rs-1", "vk-a");
    ownerless["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("ownerReferences");
    assert_eq!(
        env.admit(&request("UPDATE", ownerless)).decision,
        Decision::Unchanged
    );

    let plain = owned(labelled(with_spec(json!({}))), "rs-1");
    assert_eq!(
        env.admit(&request("UPDATE", plain)).decision,
        Decision::Unchanged
    );
    assert!(env.memory.is_empty());
}

#[test]
fn merges_into_an_existing_hostname_not_in() {
    let mut spec: PodSpec = serde_json::from_value(json!({"containers": [], "affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["vk-a"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["vk-c"]}]},
        ]}}}}))
    .unwrap();
    avoid_nodes(&mut spec, &["vk-a".into(), "vk-b".into()]);
    assert_eq!(
        serde_json::to_value(&spec.affinity).unwrap(),
        json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["vk-a", "vk-b"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["vk-c"]}],
             "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["vk-a", "vk-b"]}]},
        ]}}})
    );
}

/// Local first without the extender: pods the webhook lets burst prefer regular nodes
/// (weight 100); eager ones (annotated, or in an `--eager-namespaces` namespace, which
/// gets the annotation) do not. The preference is added after the stash, so it is not in
/// `clusterSelector`.
#[test]
fn local_first_unless_eager() {
    let term = serde_json::to_value(local_first_term()).unwrap();
    assert_eq!(
        term,
        json!({"weight": 100, "preference": {"matchExpressions": [
            {"key": "type", "operator": "NotIn", "values": ["virtual-kubelet"]}]}})
    );
    let other = json!({"weight": 5, "preference": {"matchExpressions": [
        {"key": "disk", "operator": "In", "values": ["ssd"]}]}});
    let required = json!({"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "zone", "operator": "In", "values": ["a"]}]}]});
    let mut env = Env::new();
    env.config.prefer_regular_nodes = true;
    env.config.eager_namespaces = BTreeSet::from(["eager-ns".to_owned()]);
    let in_namespace = |namespace: &str, spec: Value| {
        let mut pod = labelled(with_spec(spec));
        pod["metadata"]["namespace"] = json!(namespace);
        pod
    };
    let annotated = {
        let mut pod = labelled(with_spec(json!({})));
        pod["metadata"]["annotations"] = json!({"tensile.dev/burst": "eager"});
        pod
    };
    let preferred = |pod: &Value| {
        pod["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
            .clone()
    };
    // (case, pod, expected preferred terms, expected burst annotation)
    let cases = [
        (
            "a plain pod gets the term",
            labelled(with_spec(json!({}))),
            json!([term]),
            None,
        ),
        (
            "after its own preferred terms; its required affinity is stashed",
            labelled(with_spec(json!({"affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": required,
                "preferredDuringSchedulingIgnoredDuringExecution": [other]}}}))),
            json!([other, term]),
            None,
        ),
        (
            "not twice",
            labelled(with_spec(json!({"affinity": {"nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [term]}}}))),
            json!([term]),
            None,
        ),
        (
            "an annotated eager pod does not",
            annotated,
            Value::Null,
            Some("eager"),
        ),
        (
            "a pod in an eager namespace does not, and is annotated",
            in_namespace("eager-ns", json!({})),
            Value::Null,
            Some("eager"),
        ),
        (
            "an eager namespace's pod keeps its other annotations",
            {
                let mut pod = in_namespace("eager-ns", json!({"nodeSelector": {"zone": "a"}}));
                pod["metadata"]["annotations"] = json!({"note": "x"});
                pod
            },
            Value::Null,
            Some("eager"),
        ),
    ];
    for (name, object, want_preferred, want_annotation) in cases {
        let (outcome, pod) = env.create(&object);
        assert_eq!(outcome.decision, Decision::Mutated, "{name}");
        assert_eq!(preferred(&pod), want_preferred, "{name}");
        assert_eq!(
            pod["metadata"]["annotations"]["tensile.dev/burst"].as_str(),
            want_annotation,
            "{name}"
        );
        let stash = stash_of(&pod).unwrap();
        assert!(
            !stash.to_string().contains("virtual-kubelet"),
            "{name}: the preference is not stashed: {stash}"
        );
        if name.contains("stashed") {
            assert_eq!(
                stash["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"],
                required,
                "{name}"
            );
        }
        if name.contains("other annotations") {
            assert_eq!(pod["metadata"]["annotations"]["note"], "x", "{name}");
            assert!(
                pod["metadata"]["annotations"][CLUSTER_SELECTOR_ANNOTATION].is_string(),
                "{name}"
            );
        }
    }
}

/// The lower copy: virtual-node restores the stashed constraints and keeps preferred
/// node affinity, so the preference reaches the lower cluster, where it means local first
/// again (or nothing, where no lower node is virtual).
#[test]
fn the_translation_keeps_the_preference_below() {
    let mut env = Env::new();
    env.config.prefer_regular_nodes = true;
    let (_, pod) = env.create(&labelled(with_spec(json!({}))));
    let pod: Pod = serde_json::from_value(pod).unwrap();
    let mut spec = pod.spec.clone().unwrap();
    let stash =
        tensile::translate::scheduling::parse_cluster_selector(pod.metadata.annotations.as_ref())
            .unwrap();
    tensile::translate::scheduling::restore_constraints(&mut spec, stash.as_ref());
    let preferred = spec
        .affinity
        .and_then(|a| a.node_affinity)
        .and_then(|n| n.preferred_during_scheduling_ignored_during_execution);
    assert_eq!(preferred, Some(vec![local_first_term()]));
}
