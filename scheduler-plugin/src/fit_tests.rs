#![allow(clippy::unwrap_used)]
use super::*;
use serde_json::{Value, json};

fn lower(value: Value) -> Node {
    serde_json::from_value(value).unwrap()
}

/// A Ready node with `cpu` allocatable, 8Gi memory, 110 pods, and `extra` merged in.
fn node(cpu: &str, extra: Value) -> LowerNode {
    let mut value = json!({
        "metadata": {"name": "n", "labels": {"zone": "a", "disk": "ssd", "gen": "5"}},
        "status": {"allocatable": {"cpu": cpu, "memory": "8Gi", "pods": "110"},
                   "conditions": [{"type": "Ready", "status": "True"}]},
    });
    merge(&mut value, extra);
    LowerNode::from_node(&lower(value))
}

fn merge(base: &mut Value, patch: Value) {
    match (base, patch) {
        (Value::Object(base), Value::Object(patch)) => {
            for (k, v) in patch {
                merge(base.entry(k).or_insert(Value::Null), v);
            }
        }
        (base, patch) => *base = patch,
    }
}

fn pod(spec: Value) -> Pod {
    serde_json::from_value(json!({"metadata": {"name": "p", "namespace": "ns"}, "spec": spec}))
        .unwrap()
}

fn cpu_pod(cpu: &str) -> Value {
    json!({"containers": [{"name": "c", "resources": {"requests": {"cpu": cpu}}}]})
}

fn demand(spec: Value) -> Demand {
    Demand::of(&pod(spec)).unwrap()
}

fn with(mut spec: Value, extra: Value) -> Value {
    merge(&mut spec, extra);
    spec
}

fn required(expressions: Value) -> Value {
    json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
        {"nodeSelectorTerms": [{"matchExpressions": expressions}]}}}})
}

fn demand_stashed(spec: Value, stash: Value) -> Demand {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "annotations": {"clusterSelector": stash.to_string()}},
        "spec": spec,
    }))
    .unwrap();
    Demand::of(&pod).unwrap()
}

#[test]
fn requests_init_containers_and_overhead() {
    let req = |cpu: &str| json!({"requests": {"cpu": cpu}});
    // (case, pod spec, millicpu wanted)
    let cases: Vec<(&str, Value, i128)> = vec![
        (
            "containers add up",
            json!({"containers": [
            {"name": "a", "resources": req("1")}, {"name": "b", "resources": req("2")}]}),
            3000,
        ),
        (
            "a larger init container wins",
            json!({
            "initContainers": [{"name": "i", "resources": req("5")}],
            "containers": [{"name": "a", "resources": req("1")}, {"name": "b", "resources": req("2")}]}),
            5000,
        ),
        (
            "a smaller init container does not",
            json!({
            "initContainers": [{"name": "i", "resources": req("1")}],
            "containers": [{"name": "a", "resources": req("2")}]}),
            2000,
        ),
        (
            "overhead is added",
            json!({"overhead": {"cpu": "250m"},
            "containers": [{"name": "a", "resources": req("1")}]}),
            1250,
        ),
        (
            "overhead on top of the init peak",
            json!({"overhead": {"cpu": "500m"},
            "initContainers": [{"name": "i", "resources": req("3")}],
            "containers": [{"name": "a", "resources": req("1")}]}),
            3500,
        ),
    ];
    for (name, spec, want) in cases {
        let d = demand(spec);
        assert_eq!(d.requests.get("cpu").copied().unwrap_or(0), want, "{name}");
        assert_eq!(d.requests["pods"], 1000, "{name}: one pod");
    }
}

#[test]
fn node_checks() {
    let used =
        |cpu: i128, pods: i128| Resources::from([("cpu".into(), cpu), ("pods".into(), pods)]);
    let tol = |v: Value| json!({"tolerations": [v]});
    let taint = |key: &str, value: &str, effect: &str| json!({"spec": {"taints": [{"key": key, "value": value, "effect": effect}]}});
    let insufficient = |r: &[&str]| {
        Err(Misfit::Insufficient(
            r.iter().map(|s| s.to_string()).collect(),
        ))
    };
    // (case, node, used, pod spec, want)
    type Case = (
        &'static str,
        LowerNode,
        Option<Resources>,
        Value,
        Result<(), Misfit>,
    );
    let cases: Vec<Case> = vec![
        ("fits", node("4", json!({})), None, cpu_pod("2"), Ok(())),
        (
            "exactly fits",
            node("4", json!({})),
            Some(used(2000, 1000)),
            cpu_pod("2"),
            Ok(()),
        ),
        (
            "too big (fragmentation: 4 CPU nodes, 6 CPU pod)",
            node("4", json!({})),
            None,
            cpu_pod("6"),
            insufficient(&["cpu"]),
        ),
        (
            "used room counts",
            node("4", json!({})),
            Some(used(3000, 1000)),
            cpu_pod("2"),
            insufficient(&["cpu"]),
        ),
        (
            "over-committed node never negative",
            node("4", json!({})),
            Some(used(9000, 1000)),
            cpu_pod("0"),
            Ok(()),
        ),
        (
            "pod count full",
            node("4", json!({})),
            Some(used(0, 110_000)),
            cpu_pod("1"),
            insufficient(&["pods"]),
        ),
        (
            "extended resource absent",
            node("4", json!({})),
            None,
            json!({"containers": [{"name": "c", "resources": {"requests": {"nvidia.com/gpu": "1"}}}]}),
            insufficient(&["nvidia.com/gpu"]),
        ),
        (
            "extended resource present",
            node(
                "4",
                json!({"status": {"allocatable": {"nvidia.com/gpu": "2"}}}),
            ),
            None,
            json!({"containers": [{"name": "c", "resources": {"requests": {"nvidia.com/gpu": "2"}}}]}),
            Ok(()),
        ),
        (
            "memory",
            node("4", json!({})),
            None,
            json!({"containers": [{"name": "c", "resources": {"requests": {"memory": "9Gi"}}}]}),
            insufficient(&["memory"]),
        ),
        (
            "not ready",
            node(
                "4",
                json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}),
            ),
            None,
            cpu_pod("1"),
            Err(Misfit::NotReady),
        ),
        (
            "cordoned",
            node("4", json!({"spec": {"unschedulable": true}})),
            None,
            cpu_pod("1"),
            Err(Misfit::Cordoned),
        ),
        (
            "nodeSelector matches",
            node("4", json!({})),
            None,
            with(cpu_pod("1"), json!({"nodeSelector": {"zone": "a"}})),
            Ok(()),
        ),
        (
            "nodeSelector differs",
            node("4", json!({})),
            None,
            with(cpu_pod("1"), json!({"nodeSelector": {"zone": "b"}})),
            Err(Misfit::NodeSelector),
        ),
        (
            "nodeSelector key absent",
            node("4", json!({})),
            None,
            with(cpu_pod("1"), json!({"nodeSelector": {"gpu": "yes"}})),
            Err(Misfit::NodeSelector),
        ),
        (
            "NoSchedule taint untolerated",
            node("4", taint("dedicated", "db", "NoSchedule")),
            None,
            cpu_pod("1"),
            Err(Misfit::Taint("dedicated=db:NoSchedule".into())),
        ),
        (
            "NoExecute taint untolerated",
            node("4", taint("dedicated", "", "NoExecute")),
            None,
            cpu_pod("1"),
            Err(Misfit::Taint("dedicated:NoExecute".into())),
        ),
        (
            "PreferNoSchedule is ignored",
            node("4", taint("dedicated", "db", "PreferNoSchedule")),
            None,
            cpu_pod("1"),
            Ok(()),
        ),
        (
            "Equal toleration",
            node("4", taint("dedicated", "db", "NoSchedule")),
            None,
            with(
                cpu_pod("1"),
                tol(
                    json!({"key": "dedicated", "operator": "Equal", "value": "db", "effect": "NoSchedule"}),
                ),
            ),
            Ok(()),
        ),
        (
            "default operator is Equal",
            node("4", taint("dedicated", "db", "NoSchedule")),
            None,
            with(
                cpu_pod("1"),
                tol(json!({"key": "dedicated", "value": "db"})),
            ),
            Ok(()),
        ),
        (
            "Equal with another value",
            node("4", taint("dedicated", "db", "NoSchedule")),
            None,
            with(
                cpu_pod("1"),
                tol(json!({"key": "dedicated", "operator": "Equal", "value": "web"})),
            ),
            Err(Misfit::Taint("dedicated=db:NoSchedule".into())),
        ),
        (
            "Exists toleration, any value",
            node("4", taint("dedicated", "db", "NoExecute")),
            None,
            with(
                cpu_pod("1"),
                tol(json!({"key": "dedicated", "operator": "Exists"})),
            ),
            Ok(()),
        ),
        (
            "toleration for another effect",
            node("4", taint("dedicated", "db", "NoExecute")),
            None,
            with(
                cpu_pod("1"),
                tol(json!({"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"})),
            ),
            Err(Misfit::Taint("dedicated=db:NoExecute".into())),
        ),
        (
            "empty key with Exists tolerates everything",
            node("4", taint("dedicated", "db", "NoSchedule")),
            None,
            with(cpu_pod("1"), tol(json!({"operator": "Exists"}))),
            Ok(()),
        ),
        (
            "In",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                required(json!([{"key": "zone", "operator": "In", "values": ["a", "b"]}])),
            ),
            Ok(()),
        ),
        (
            "In, no value matches",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                required(json!([{"key": "zone", "operator": "In", "values": ["b"]}])),
            ),
            Err(Misfit::NodeAffinity),
        ),
        (
            "NotIn",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                required(json!([{"key": "zone", "operator": "NotIn", "values": ["b"]}])),
            ),
            Ok(()),
        ),
        (
            "NotIn, excluded",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                required(json!([{"key": "zone", "operator": "NotIn", "values": ["a"]}])),
            ),
            Err(Misfit::NodeAffinity),
        ),
        (
            "NotIn, key absent",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                required(json!([{"key": "gpu", "operator": "NotIn", "values": ["a"]}])),
            ),
            Ok(()),
        ),
        (
            "Exists",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                required(json!([{"key": "disk", "operator": "Exists"}])),
            ),
            Ok(()),
        ),
        (
            "Exists, absent",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                required(json!([{"key": "gpu", "operator": "Exists"}])),
            ),
            Err(Misfit::NodeAffinity),
        ),
        (
            "DoesNotExist",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                required(json!([{"key": "gpu", "operator": "DoesNotExist"}])),
            ),
            Ok(()),
        ),
        (
            "DoesNotExist, present",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                required(json!([{"key": "disk", "operator": "DoesNotExist"}])),
            ),
            Err(Misfit::NodeAffinity),
        ),
        (
            "Gt",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                required(json!([{"key": "gen", "operator": "Gt", "values": ["4"]}])),
            ),
            Ok(()),
        ),
        (
            "Gt, equal is not greater",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                required(json!([{"key": "gen", "operator": "Gt", "values": ["5"]}])),
            ),
            Err(Misfit::NodeAffinity),
        ),
        (
            "Lt",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                required(json!([{"key": "gen", "operator": "Lt", "values": ["6"]}])),
            ),
            Ok(()),
        ),
        (
            "Lt, not a number",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                required(json!([{"key": "zone", "operator": "Lt", "values": ["6"]}])),
            ),
            Err(Misfit::NodeAffinity),
        ),
        (
            "expressions of a term all hold",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                required(json!([
            {"key": "zone", "operator": "In", "values": ["a"]}, {"key": "disk", "operator": "In", "values": ["hdd"]}])),
            ),
            Err(Misfit::NodeAffinity),
        ),
        (
            "terms are alternatives",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
            {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
                {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}]}]}}}}),
            ),
            Ok(()),
        ),
        (
            "an empty term matches nothing",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
            {"nodeSelectorTerms": [{}]}}}}),
            ),
            Err(Misfit::NodeAffinity),
        ),
        (
            "matchFields metadata.name",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
            {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}]}}}}),
            ),
            Ok(()),
        ),
        (
            "matchFields metadata.name, other node",
            node("4", json!({})),
            None,
            with(
                cpu_pod("1"),
                json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
            {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["m"]}]}]}}}}),
            ),
            Err(Misfit::NodeAffinity),
        ),
    ];
    for (name, lower_node, used, spec, want) in cases {
        // Without a stash virtual-node clears the pod's own constraints (they were written
        // for the upper cluster); with one, the stash is what the lower pod carries. Put
        // the constraints in a stash so the check sees them.
        let mut spec = spec;
        let object = spec.as_object_mut().unwrap();
        let stash = json!({
            "nodeSelector": object.remove("nodeSelector"),
            "affinity": object.remove("affinity"),
            "tolerations": object.remove("tolerations"),
        });
        let d = demand_stashed(spec, stash);
        let got = check_node("n", &lower_node, used.as_ref(), &d).map(|_| ());
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn constraints_are_those_the_lower_pod_will_carry() {
    // No stash: the pod's own constraints name upper nodes (the virtual node) and are
    // dropped below, so they do not count.
    let own = with(
        cpu_pod("1"),
        json!({
            "nodeSelector": {"kubernetes.io/hostname": "vk-node"},
            "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
        }),
    );
    let d = demand(own.clone());
    assert!(d.node_selector.is_empty() && d.tolerations.is_empty());
    assert_eq!(check_node("n", &node("4", json!({})), None, &d), Ok(10 - 1));
    // A stash is restored.
    let d = demand_stashed(own, json!({"nodeSelector": {"zone": "b"}}));
    assert_eq!(
        d.node_selector,
        BTreeMap::from([("zone".into(), "b".into())])
    );
    assert_eq!(
        check_node("n", &node("4", json!({})), None, &d),
        Err(Misfit::NodeSelector)
    );
    // A malformed stash is an error naming the annotation.
    let bad: Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "annotations": {"clusterSelector": "{"}}, "spec": cpu_pod("1"),
    }))
    .unwrap();
    assert!(
        Demand::of(&bad)
            .unwrap_err()
            .to_string()
            .contains("clusterSelector")
    );
}

#[test]
fn cluster_verdicts_and_reasons() {
    let four = node("4", json!({}));
    let cordoned = node("8", json!({"spec": {"unschedulable": true}}));
    let not_ready = node(
        "8",
        json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}),
    );
    let busy = Resources::from([("cpu".into(), 1000)]);
    let fit = |nodes: Vec<(&'static str, &LowerNode, Option<&Resources>)>, spec: Value| {
        fit_cluster(nodes, &demand(spec), Search::Best)
    };
    assert_eq!(
        fit(vec![("a", &four, None), ("b", &four, None)], cpu_pod("6")),
        ClusterFit::NoFit {
            reason: "no node fits cpu 6 (largest free 4)".into()
        },
        "fragmentation: 8 CPU in all, but no node has 6"
    );
    assert_eq!(
        fit(
            vec![("a", &four, Some(&busy)), ("b", &cordoned, None)],
            cpu_pod("4")
        ),
        ClusterFit::NoFit {
            reason: "no node fits cpu 4 (largest free 3); other nodes: 1 cordoned".into()
        }
    );
    assert_eq!(
        fit(
            vec![
                ("b", &cordoned, None),
                ("c", &not_ready, None),
                ("d", &not_ready, None)
            ],
            cpu_pod("1")
        ),
        ClusterFit::NoFit {
            reason: "0/3 nodes fit: 1 cordoned, 2 not ready".into()
        }
    );
    assert_eq!(
        fit(vec![], cpu_pod("1")),
        ClusterFit::NoFit {
            reason: "no nodes".into()
        }
    );
    let memory = json!({"containers": [{"name": "c", "resources": {"requests": {"cpu": "3", "memory": "6Gi"}}}]});
    let full_memory = Resources::from([("memory".into(), 4 * (1i128 << 30) * 1000)]);
    let four_busy = Resources::from([("cpu".into(), 2000)]);
    assert_eq!(
        fit(
            vec![
                ("a", &four, Some(&full_memory)),
                ("b", &four, Some(&four_busy))
            ],
            memory
        ),
        ClusterFit::NoFit {
            reason: "no node fits cpu 3, memory 6Gi together".into()
        },
        "each resource fits somewhere, never both on one node"
    );
    // The best node decides the score: an empty 4-CPU node keeps 3/4 of its CPU and
    // 8Gi−0 memory free for a 1-CPU pod → (0.75 + 1) / 2 → 9 (rounded).
    assert_eq!(
        fit(
            vec![("a", &four, Some(&four_busy)), ("b", &four, None)],
            cpu_pod("1")
        ),
        ClusterFit::Fits { score: 9 }
    );
    let first = fit_cluster(
        vec![("a", &four, Some(&four_busy)), ("b", &four, None)],
        &demand(cpu_pod("1")),
        Search::First,
    );
    assert_eq!(
        first,
        ClusterFit::Fits { score: 6 },
        "filter stops at the first fit"
    );
}

#[test]
fn scores_prefer_room() {
    let d = demand(cpu_pod("2"));
    let empty = node("8", json!({}));
    let tight = node("2", json!({}));
    let roomy = check_node("a", &empty, None, &d).unwrap();
    let full = check_node("b", &tight, None, &d).unwrap();
    assert!(roomy > full, "{roomy} > {full}");
    assert!((0..=MAX_SCORE).contains(&roomy) && (0..=MAX_SCORE).contains(&full));
}
