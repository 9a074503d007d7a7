//! What a kubelet refuses at admission that a virtual node refuses too, as one node: a pod
//! bound to it (by `spec.nodeName`, past the upper scheduler) asking for a host port that
//! a pod already there holds. The upper scheduler sees the virtual node as one node with
//! one port space, so it never places two such pods there; a kubelet rejects the second
//! (`Failed`, reason `NodePorts`) and the pod's controller makes another. Below, the lower
//! scheduler would keep such a pod Pending instead, forever where the lower cluster has one
//! node. Pure.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{Pod, PodSpec, PodStatus};

/// The reason a kubelet gives a pod rejected for its host ports (the scheduler plugin's
/// name).
pub const NODE_PORTS_REASON: &str = "NodePorts";
/// The message a kubelet gives a pod rejected for its host ports.
pub const NODE_PORTS_MESSAGE: &str = "Pod was rejected: Predicate NodePorts failed: node(s) didn't have free ports for the requested pod ports";

/// One host port: protocol, host IP (empty for every address), port.
type HostPort = (String, String, i32);

/// The host ports a pod spec asks for (containers and init containers), as the kubelet
/// counts them.
fn host_ports(spec: &PodSpec) -> BTreeSet<HostPort> {
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .flat_map(|c| c.ports.iter().flatten())
        .filter_map(|p| {
            let port = p.host_port.filter(|port| *port > 0)?;
            let protocol = p.protocol.clone().unwrap_or_else(|| "TCP".to_owned());
            let ip = p
                .host_ip
                .clone()
                .filter(|ip| ip != "0.0.0.0" && ip != "::")
                .unwrap_or_default();
            Some((protocol, ip, port))
        })
        .collect()
}

/// Whether `pod` asks for host ports at all (only then is [`host_ports_taken`] worth a
/// look at the node's other pods).
pub fn asks_for_host_ports(pod: &Pod) -> bool {
    pod.spec.as_ref().is_some_and(|s| !host_ports(s).is_empty())
}

/// Whether a host port `pod` asks for is held by one of `others` (the pods admitted to
/// the node before it): the same protocol and port, on the same host IP or where either
/// side listens on every address.
pub fn host_ports_taken<'a>(pod: &Pod, others: impl IntoIterator<Item = &'a Pod>) -> bool {
    let Some(spec) = pod.spec.as_ref() else {
        return false;
    };
    let wanted = host_ports(spec);
    if wanted.is_empty() {
        return false;
    }
    others
        .into_iter()
        .filter_map(|other| other.spec.as_ref())
        .flat_map(host_ports)
        .any(|(protocol, ip, port)| {
            wanted.iter().any(|(p, i, n)| {
                *p == protocol && *n == port && (i.is_empty() || ip.is_empty() || *i == ip)
            })
        })
}

/// Whether `other` holds its host ports on the node ahead of `pod`: it is not finished,
/// and it was admitted first (it has run or is being made below, or was created before
/// `pod`; the kubelet too admits pods in the order they were created).
pub fn admitted_before(other: &Pod, pod: &Pod, other_mirrored: bool) -> bool {
    let finished = other
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Succeeded" || p == "Failed");
    if finished || other.metadata.uid == pod.metadata.uid {
        return false;
    }
    let order = |p: &Pod| {
        (
            p.metadata.creation_timestamp.as_ref().map(|t| t.0),
            p.metadata.namespace.clone(),
            p.metadata.name.clone(),
        )
    };
    other_mirrored || order(other) < order(pod)
}

/// The status a kubelet writes on a pod it rejects: Failed, with the reason and message.
pub fn rejected_status(pod: &Pod, reason: &str, message: &str) -> PodStatus {
    PodStatus {
        phase: Some("Failed".to_owned()),
        reason: Some(reason.to_owned()),
        message: Some(message.to_owned()),
        qos_class: pod.status.as_ref().and_then(|s| s.qos_class.clone()),
        ..PodStatus::default()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::{Value, json};

    fn pod(name: &str, created: &str, ports: Value, phase: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "uid": format!("uid-{name}"),
                         "creationTimestamp": created},
            "spec": {"containers": [{"name": "c", "ports": ports}]},
            "status": {"phase": phase, "qosClass": "BestEffort"},
        }))
        .unwrap()
    }

    #[test]
    fn host_ports_conflict_as_the_kubelet_counts_them() {
        let new = |ports: Value| pod("new", "2026-01-01T00:00:02Z", ports, "Pending");
        let held = |ports: Value| pod("old", "2026-01-01T00:00:01Z", ports, "Running");
        // (case, the new pod's ports, the held pod's ports, taken)
        let cases = [
            (
                "same port",
                json!([{"containerPort": 80, "hostPort": 8080}]),
                json!([{"containerPort": 80, "hostPort": 8080}]),
                true,
            ),
            (
                "another port",
                json!([{"containerPort": 80, "hostPort": 8080}]),
                json!([{"containerPort": 80, "hostPort": 8081}]),
                false,
            ),
            (
                "another protocol",
                json!([{"containerPort": 53, "hostPort": 53, "protocol": "UDP"}]),
                json!([{"containerPort": 53, "hostPort": 53}]),
                false,
            ),
            (
                "TCP is the default",
                json!([{"containerPort": 53, "hostPort": 53, "protocol": "TCP"}]),
                json!([{"containerPort": 53, "hostPort": 53}]),
                true,
            ),
            (
                "other host IPs",
                json!([{"containerPort": 80, "hostPort": 80, "hostIP": "10.0.0.1"}]),
                json!([{"containerPort": 80, "hostPort": 80, "hostIP": "10.0.0.2"}]),
                false,
            ),
            (
                "every address takes them all",
                json!([{"containerPort": 80, "hostPort": 80, "hostIP": "10.0.0.1"}]),
                json!([{"containerPort": 80, "hostPort": 80, "hostIP": "0.0.0.0"}]),
                true,
            ),
            (
                "container ports only",
                json!([{"containerPort": 80}]),
                json!([{"containerPort": 80}]),
                false,
            ),
            (
                "no ports",
                json!(null),
                json!([{"containerPort": 80, "hostPort": 80}]),
                false,
            ),
        ];
        for (case, wanted, holding, taken) in cases {
            let new = new(wanted);
            let held = held(holding);
            assert_eq!(host_ports_taken(&new, [&held]), taken, "{case}");
        }
    }

    #[test]
    fn who_holds_the_ports_first() {
        let ports = json!([{"containerPort": 80, "hostPort": 80}]);
        let new = pod("new", "2026-01-01T00:00:02Z", ports.clone(), "Pending");
        // (case, the other pod, whether it is mirrored, admitted before the new pod)
        let cases = [
            (
                "older",
                pod("a", "2026-01-01T00:00:01Z", ports.clone(), "Running"),
                false,
                true,
            ),
            (
                "younger, not yet below",
                pod("b", "2026-01-01T00:00:03Z", ports.clone(), "Pending"),
                false,
                false,
            ),
            (
                "younger, already below",
                pod("c", "2026-01-01T00:00:03Z", ports.clone(), "Running"),
                true,
                true,
            ),
            (
                "finished",
                pod("d", "2026-01-01T00:00:01Z", ports.clone(), "Failed"),
                true,
                false,
            ),
            ("itself", new.clone(), true, false),
        ];
        for (case, other, mirrored, before) in cases {
            assert_eq!(admitted_before(&other, &new, mirrored), before, "{case}");
        }
        let status = rejected_status(&new, NODE_PORTS_REASON, NODE_PORTS_MESSAGE);
        assert_eq!(status.phase.as_deref(), Some("Failed"));
        assert_eq!(status.reason.as_deref(), Some("NodePorts"));
        assert_eq!(status.qos_class.as_deref(), Some("BestEffort"));
    }
}
