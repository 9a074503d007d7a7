//! Resource arithmetic shared by the virtual node's capacity and the scheduler extender's
//! fit: quantities as milli-units per resource name, a pod's effective requests as the
//! scheduler computes them, and which lower nodes can take pods at all. Pure: no client.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::quantity::milli;

/// Resource name → milli-units.
pub type Resources = BTreeMap<String, i128>;

/// The resource every bound pod takes one of (in milli-units, like every other).
pub const PODS: &str = "pods";
/// One pod, in milli-units of [`PODS`].
pub const ONE_POD: i128 = 1000;

/// A resource list in milli-units.
pub fn to_resources(list: &BTreeMap<String, Quantity>) -> Resources {
    list.iter().map(|(k, v)| (k.clone(), milli(v))).collect()
}

fn requests_of(resources: Option<&ResourceRequirements>) -> Resources {
    resources
        .and_then(|r| r.requests.as_ref())
        .map(to_resources)
        .unwrap_or_default()
}

/// Adds `from` into `into`, resource by resource.
pub fn add(into: &mut Resources, from: &Resources) {
    for (resource, amount) in from {
        *into.entry(resource.clone()).or_default() += amount;
    }
}

/// Subtracts `from` from `into`, resource by resource (dropping what reaches zero).
pub fn subtract(into: &mut Resources, from: &Resources) {
    for (resource, amount) in from {
        if let Some(slot) = into.get_mut(resource) {
            *slot -= amount;
            if *slot == 0 {
                into.remove(resource);
            }
        } else if *amount != 0 {
            into.insert(resource.clone(), -amount);
        }
    }
}

fn max_into(into: &mut Resources, from: &Resources) {
    for (resource, amount) in from {
        let slot = into.entry(resource.clone()).or_default();
        *slot = (*slot).max(*amount);
    }
}

/// A pod's effective requests, as the scheduler computes them: the larger of (regular
/// containers + sidecars) and, for each init container, its request plus the sidecars
/// started before it; plus overhead. Pod-level requests, where set, win for their
/// resources.
pub fn pod_requests(spec: &PodSpec) -> Resources {
    let mut running = Resources::new();
    for container in &spec.containers {
        add(&mut running, &requests_of(container.resources.as_ref()));
    }
    let mut sidecars = Resources::new();
    let mut init_peak = Resources::new();
    for init in spec.init_containers.iter().flatten() {
        let requests = requests_of(init.resources.as_ref());
        if init.restart_policy.as_deref() == Some("Always") {
            add(&mut sidecars, &requests);
            max_into(&mut init_peak, &sidecars);
        } else {
            let mut during = sidecars.clone();
            add(&mut during, &requests);
            max_into(&mut init_peak, &during);
        }
    }
    add(&mut running, &sidecars);
    max_into(&mut running, &init_peak);
    if let Some(pod_level) = spec.resources.as_ref().and_then(|r| r.requests.as_ref()) {
        running.extend(to_resources(pod_level));
    }
    if let Some(overhead) = &spec.overhead {
        add(&mut running, &to_resources(overhead));
    }
    running
}

/// What a bound pod takes on its node: its effective requests and one [`PODS`].
pub fn pod_footprint(spec: &PodSpec) -> Resources {
    let mut requests = pod_requests(spec);
    *requests.entry(PODS.into()).or_default() += ONE_POD;
    requests
}

/// The first resource a pod asking `requested` lacks on a node of `allocatable` where the
/// other pods take `used`, worded as a kubelet's admission words it ("Node didn't have
/// enough resource: cpu, requested: 5000, used: 2000, capacity: 4000": CPU in millicores,
/// the rest in units); `None` when it fits. CPU, memory and ephemeral storage first, then
/// the rest by name; [`PODS`] and what it does not ask for are not checked.
pub fn shortfall(
    allocatable: &Resources,
    used: &Resources,
    requested: &Resources,
) -> Option<String> {
    const FIRST: [&str; 3] = ["cpu", "memory", "ephemeral-storage"];
    let rest = requested
        .keys()
        .map(String::as_str)
        .filter(|name| !FIRST.contains(name) && *name != PODS);
    FIRST.into_iter().chain(rest).find_map(|name| {
        let asked = requested.get(name).copied().unwrap_or_default();
        if asked <= 0 {
            return None;
        }
        let capacity = allocatable.get(name).copied().unwrap_or_default();
        let taken = used.get(name).copied().unwrap_or_default();
        if asked + taken <= capacity {
            return None;
        }
        let unit = |milli: i128| {
            if name == "cpu" {
                milli
            } else {
                milli.div_euclid(1000)
            }
        };
        Some(format!(
            "Node didn't have enough resource: {name}, requested: {}, used: {}, capacity: {}",
            unit(asked),
            unit(taken),
            unit(capacity)
        ))
    })
}

/// Whether a pod in this phase no longer takes room on its node.
pub fn phase_is_terminal(phase: Option<&str>) -> bool {
    matches!(phase, Some("Succeeded" | "Failed"))
}

/// Whether a node's Ready condition is True.
pub fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// Whether a node is cordoned (`spec.unschedulable`).
pub fn node_cordoned(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false)
}

/// Whether a taint effect keeps pods that do not tolerate it off a node
/// (`PreferNoSchedule` only steers).
pub fn effect_repels(effect: &str) -> bool {
    effect == "NoSchedule" || effect == "NoExecute"
}

/// Whether a lower node can take pods the virtual node sends: Ready, schedulable, and
/// without a NoSchedule/NoExecute taint (mirrored pods carry no tolerations for it).
pub fn node_usable(node: &Node) -> bool {
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| ts.iter().any(|t| effect_repels(&t.effect)));
    node_ready(node) && !node_cordoned(node) && !tainted
}

/// Node features that describe the kubelet's own API server rather than how pods run:
/// virtual-node serves that API itself, so it declares them for what it serves, whatever the
/// lower kubelets say. `ExtendWebSocketsToKubelet`: the upper API server hands a WebSocket
/// exec, attach or port-forward to the node as it came (instead of translating it to SPDY),
/// and virtual-node serves those (`kubelet_api::websocket`, and SPDY tunnelled in a
/// WebSocket), closing each with a normal close frame as the kubelet does.
pub const KUBELET_API_FEATURES: [&str; 1] = ["ExtendWebSocketsToKubelet"];

/// The features (`status.declaredFeatures`) a virtual node declares, sorted: those every
/// usable lower node declares ([`node_usable`]; all of them when none is usable), which a
/// node standing for any of them may declare, and [`KUBELET_API_FEATURES`], which are its
/// own kubelet API's.
pub fn common_declared_features(nodes: &[Node]) -> Vec<String> {
    let usable: Vec<&Node> = nodes.iter().filter(|n| node_usable(n)).collect();
    let counted: Vec<&Node> = if usable.is_empty() {
        nodes.iter().collect()
    } else {
        usable
    };
    let declared = |node: &Node| -> std::collections::BTreeSet<String> {
        node.status
            .as_ref()
            .and_then(|s| s.declared_features.clone())
            .unwrap_or_default()
            .into_iter()
            .collect()
    };
    let mut nodes = counted.into_iter();
    let lower = match nodes.next() {
        Some(first) => nodes.fold(declared(first), |common, node| {
            common.intersection(&declared(node)).cloned().collect()
        }),
        None => std::collections::BTreeSet::new(),
    };
    lower
        .into_iter()
        .filter(|feature| !KUBELET_API_FEATURES.contains(&feature.as_str()))
        .chain(KUBELET_API_FEATURES.iter().map(|f| (*f).to_owned()))
        .collect::<std::collections::BTreeSet<String>>()
        .into_iter()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shortfall_is_the_first_resource_that_does_not_fit_in_kubelet_units() {
        let r = |pairs: &[(&str, i128)]| -> Resources {
            pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
        };
        let node = r(&[
            ("cpu", 4000),
            ("memory", 4_294_967_296_000),
            ("pods", 110_000),
        ]);
        // (case, used, requested, expected)
        let cases = [
            ("fits", r(&[("cpu", 2000)]), r(&[("cpu", 2000)]), None),
            (
                "cpu, in millicores",
                r(&[("cpu", 2000)]),
                r(&[("cpu", 5000)]),
                Some(
                    "Node didn't have enough resource: cpu, requested: 5000, used: 2000, capacity: 4000",
                ),
            ),
            (
                "memory, in bytes, after cpu fits",
                r(&[("memory", 2_147_483_648_000)]),
                r(&[("cpu", 100), ("memory", 4_718_592_000_000)]),
                Some(
                    "Node didn't have enough resource: memory, requested: 4718592000, used: 2147483648, capacity: 4294967296",
                ),
            ),
            (
                "an extended resource the node lacks",
                r(&[]),
                r(&[("example.com/gpu", 1000)]),
                Some(
                    "Node didn't have enough resource: example.com/gpu, requested: 1, used: 0, capacity: 0",
                ),
            ),
            (
                "pods are not checked",
                r(&[("pods", 110_000)]),
                r(&[("pods", 1000)]),
                None,
            ),
            ("nothing asked", r(&[("cpu", 9000)]), r(&[]), None),
        ];
        for (case, used, requested, expected) in cases {
            assert_eq!(
                shortfall(&node, &used, &requested).as_deref(),
                expected,
                "{case}"
            );
        }
    }

    #[test]
    fn a_virtual_node_declares_what_every_usable_lower_node_declares() {
        let node = |ready: &str, features: &[&str]| -> Node {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "n"},
                "status": {"conditions": [{"type": "Ready", "status": ready}],
                           "declaredFeatures": features},
            }))
            .unwrap()
        };
        let a = [
            "InPlacePodVerticalScalingInitContainers",
            "PodLevelResources",
        ];
        let own = "ExtendWebSocketsToKubelet";
        let with_own = |features: &[&'static str]| -> Vec<&'static str> {
            let mut all = features.to_vec();
            all.push(own);
            all.sort_unstable();
            all
        };
        // (case, nodes, declared)
        let cases: Vec<(&str, Vec<Node>, Vec<&str>)> = vec![
            ("no nodes: its own kubelet API's", vec![], vec![own]),
            ("one node", vec![node("True", &a)], with_own(&a)),
            (
                "only what all declare",
                vec![node("True", &a), node("True", &["PodLevelResources"])],
                with_own(&["PodLevelResources"]),
            ),
            (
                "a NotReady node does not narrow it",
                vec![node("True", &a), node("False", &[])],
                with_own(&a),
            ),
            (
                "none usable: all of them",
                vec![node("False", &a), node("False", &a)],
                with_own(&a),
            ),
            (
                "the kubelet API's own, declared once whatever the lower kubelets say",
                vec![node("True", &[own, "PodLevelResources"]), node("True", &[])],
                vec![own],
            ),
        ];
        for (case, nodes, want) in cases {
            assert_eq!(common_declared_features(&nodes), want, "{case}");
        }
    }

    #[test]
    fn subtract_undoes_add() {
        let a = Resources::from([("cpu".into(), 1500), ("pods".into(), 1000)]);
        let b = Resources::from([("cpu".into(), 500), ("memory".into(), 7)]);
        let mut sum = Resources::new();
        add(&mut sum, &a);
        add(&mut sum, &b);
        subtract(&mut sum, &b);
        assert_eq!(sum, a);
        subtract(&mut sum, &a);
        assert!(sum.is_empty());
    }

    #[test]
    fn prefer_no_schedule_does_not_repel() {
        assert!(effect_repels("NoSchedule"));
        assert!(effect_repels("NoExecute"));
        assert!(!effect_repels("PreferNoSchedule"));
    }
}
