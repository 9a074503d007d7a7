//! A pod status as a stored pod keeps it: its JSON, LZ4-compressed against a dictionary
//! of typical statuses. Most of a status's kilobyte is field names, condition types,
//! reasons and mount paths that every pod repeats, which the dictionary supplies; what is
//! left is each pod's own times, addresses and IDs (a third to a quarter of the JSON).
//! Reading it back costs a microsecond; a status is read once a reconcile.

use std::sync::LazyLock;

use k8s_openapi::api::core::v1::PodStatus;
use lz4_flex::block::{compress_prepend_size_with_dict, decompress_size_prepended_with_dict};

/// Statuses of a pod's life (pending, running, completed, failed, evicted), as the
/// kubelet of the pinned Kubernetes release writes them. Only compression depends on it:
/// any status packs and unpacks whatever this holds.
const TYPICAL_STATUSES: &[&str] = &[
    r#"{"conditions":[{"lastTransitionTime":"2026-01-01T00:00:00Z","observedGeneration":1,"status":"False","type":"PodReadyToStartContainers"},{"lastTransitionTime":"2026-01-01T00:00:00Z","observedGeneration":1,"status":"True","type":"Initialized"},{"lastTransitionTime":"2026-01-01T00:00:00Z","message":"containers with unready status: [app]","observedGeneration":1,"reason":"ContainersNotReady","status":"False","type":"Ready"},{"lastTransitionTime":"2026-01-01T00:00:00Z","message":"containers with unready status: [app]","observedGeneration":1,"reason":"ContainersNotReady","status":"False","type":"ContainersReady"},{"lastTransitionTime":"2026-01-01T00:00:00Z","observedGeneration":1,"status":"True","type":"PodScheduled"}],"containerStatuses":[{"image":"docker.io/library/nginx:latest","imageID":"","lastState":{},"name":"app","ready":false,"restartCount":0,"started":false,"state":{"waiting":{"reason":"ContainerCreating"}},"volumeMounts":[{"mountPath":"/var/run/secrets/kubernetes.io/serviceaccount","name":"kube-api-access-abcde","readOnly":true,"recursiveReadOnly":"Disabled"}]}],"hostIP":"10.0.0.1","hostIPs":[{"ip":"10.0.0.1"}],"observedGeneration":1,"phase":"Pending","qosClass":"BestEffort","startTime":"2026-01-01T00:00:00Z"}"#,
    r#"{"conditions":[{"lastTransitionTime":"2026-01-01T00:00:00Z","observedGeneration":1,"status":"True","type":"PodReadyToStartContainers"},{"lastTransitionTime":"2026-01-01T00:00:00Z","observedGeneration":1,"status":"True","type":"Initialized"},{"lastTransitionTime":"2026-01-01T00:00:00Z","observedGeneration":1,"status":"True","type":"Ready"},{"lastTransitionTime":"2026-01-01T00:00:00Z","observedGeneration":1,"status":"True","type":"ContainersReady"},{"lastTransitionTime":"2026-01-01T00:00:00Z","observedGeneration":1,"status":"True","type":"PodScheduled"}],"containerStatuses":[{"allocatedResources":{"cpu":"100m","memory":"128Mi"},"containerID":"containerd://0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef","image":"docker.io/library/nginx:latest","imageID":"docker.io/library/nginx@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef","lastState":{},"name":"app","ready":true,"resources":{"limits":{"cpu":"500m","memory":"256Mi"},"requests":{"cpu":"100m","memory":"128Mi"}},"restartCount":0,"started":true,"state":{"running":{"startedAt":"2026-01-01T00:00:00Z"}},"user":{"linux":{"gid":0,"supplementalGroups":[0],"uid":0}},"volumeMounts":[{"mountPath":"/var/run/secrets/kubernetes.io/serviceaccount","name":"kube-api-access-abcde","readOnly":true,"recursiveReadOnly":"Disabled"}]}],"hostIP":"10.0.0.1","hostIPs":[{"ip":"10.0.0.1"}],"observedGeneration":1,"phase":"Running","podIP":"10.244.0.1","podIPs":[{"ip":"10.244.0.1"}],"qosClass":"Burstable","startTime":"2026-01-01T00:00:00Z"}"#,
    r#"{"conditions":[{"lastTransitionTime":"2026-01-01T00:00:00Z","status":"False","type":"PodReadyToStartContainers"},{"lastTransitionTime":"2026-01-01T00:00:00Z","reason":"PodCompleted","status":"True","type":"Initialized"},{"lastTransitionTime":"2026-01-01T00:00:00Z","reason":"PodCompleted","status":"False","type":"Ready"},{"lastTransitionTime":"2026-01-01T00:00:00Z","reason":"PodCompleted","status":"False","type":"ContainersReady"},{"lastTransitionTime":"2026-01-01T00:00:00Z","status":"True","type":"PodScheduled"}],"containerStatuses":[{"containerID":"containerd://0123456789abcdef","image":"docker.io/library/busybox:latest","imageID":"docker.io/library/busybox@sha256:0123456789abcdef","lastState":{"terminated":{"containerID":"containerd://0123456789abcdef","exitCode":1,"finishedAt":"2026-01-01T00:00:00Z","reason":"Error","startedAt":"2026-01-01T00:00:00Z"}},"name":"app","ready":false,"restartCount":1,"started":false,"state":{"terminated":{"containerID":"containerd://0123456789abcdef","exitCode":0,"finishedAt":"2026-01-01T00:00:00Z","reason":"Completed","startedAt":"2026-01-01T00:00:00Z"}}}],"initContainerStatuses":[{"containerID":"containerd://0123456789abcdef","image":"docker.io/library/busybox:latest","imageID":"docker.io/library/busybox@sha256:0123456789abcdef","lastState":{},"name":"init","ready":true,"restartCount":0,"started":false,"state":{"terminated":{"exitCode":0,"reason":"Completed"}}}],"hostIP":"10.0.0.1","phase":"Succeeded","podIP":"10.244.0.1","qosClass":"Guaranteed","startTime":"2026-01-01T00:00:00Z"}"#,
    r#"{"conditions":[{"lastTransitionTime":"2026-01-01T00:00:00Z","message":"The node was low on resource: memory.","reason":"TerminationByKubelet","status":"True","type":"DisruptionTarget"}],"message":"The node was low on resource: memory. ","phase":"Failed","reason":"Evicted","containerStatuses":[{"state":{"waiting":{"message":"back-off 5m0s restarting failed container","reason":"CrashLoopBackOff"}},"lastState":{"terminated":{"exitCode":137,"reason":"OOMKilled"}}},{"state":{"waiting":{"reason":"ImagePullBackOff","message":"Back-off pulling image"}}},{"state":{"waiting":{"reason":"ErrImagePull"}}}]}"#,
];

/// [`TYPICAL_STATUSES`] as the compressor sees them: each parsed and written again, so
/// the dictionary has the field order and spelling of what is packed.
static DICTIONARY: LazyLock<Vec<u8>> = LazyLock::new(|| {
    TYPICAL_STATUSES
        .iter()
        .flat_map(|text| match serde_json::from_str::<PodStatus>(text) {
            Ok(status) => serde_json::to_vec(&status).unwrap_or_default(),
            Err(_) => text.as_bytes().to_vec(),
        })
        .collect()
});

/// A [`PodStatus`] packed: its JSON, compressed against [`DICTIONARY`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedStatus(Box<[u8]>);

impl PackedStatus {
    /// Packs `status`.
    pub fn new(status: &PodStatus) -> Option<Self> {
        let json = serde_json::to_vec(status).ok()?;
        Some(Self(
            compress_prepend_size_with_dict(&json, &DICTIONARY).into_boxed_slice(),
        ))
    }

    /// The status back.
    pub fn status(&self) -> Option<PodStatus> {
        Self::unpack(&self.0)
    }

    /// The status packed as `bytes` ([`PackedStatus::into_bytes`]).
    pub fn unpack(bytes: &[u8]) -> Option<PodStatus> {
        // Packed from a `PodStatus` on arrival, so it unpacks and parses.
        let json = decompress_size_prepended_with_dict(bytes, &DICTIONARY).ok()?;
        serde_json::from_slice(&json).ok()
    }

    /// Its bytes: the JSON's length (4 bytes, little-endian), then the compressed JSON.
    pub fn into_bytes(self) -> Box<[u8]> {
        self.0
    }

    /// The heap bytes it holds.
    pub fn heap_bytes(&self) -> usize {
        self.0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_dictionary_is_the_typical_statuses_rewritten() {
        for text in TYPICAL_STATUSES {
            let status: PodStatus = serde_json::from_str(text).unwrap();
            let rewritten = serde_json::to_vec(&status).unwrap();
            assert!(
                DICTIONARY.windows(rewritten.len()).any(|w| w == rewritten),
                "{text}"
            );
        }
    }

    #[test]
    fn statuses_round_trip_and_shrink() {
        let cases: Vec<(&str, serde_json::Value, usize)> = vec![
            ("empty", json!({}), 100),
            (
                "kwok running",
                json!({"phase": "Running", "podIP": "10.0.3.17", "hostIP": "10.0.0.7",
                       "startTime": "2026-11-24T04:01:09Z", "qosClass": "BestEffort",
                       "conditions": [
                           {"type": "Initialized", "status": "True", "lastTransitionTime": "2026-11-24T04:01:09Z"},
                           {"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-24T04:01:10Z"},
                           {"type": "ContainersReady", "status": "True", "lastTransitionTime": "2026-11-24T04:01:10Z"},
                           {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-24T04:01:09Z"}],
                       "containerStatuses": [{"name": "web", "image": "nginx:1.27", "imageID": "",
                           "ready": true, "restartCount": 0, "started": true,
                           "state": {"running": {"startedAt": "2026-11-24T04:01:10Z"}}}]}),
                30,
            ),
            (
                "kubelet running",
                json!({"phase": "Running", "podIP": "10.244.7.201", "podIPs": [{"ip": "10.244.7.201"}],
                       "hostIP": "172.18.0.4", "hostIPs": [{"ip": "172.18.0.4"}], "observedGeneration": 1,
                       "startTime": "2026-11-24T04:01:09Z", "qosClass": "Burstable",
                       "conditions": [
                           {"type": "PodReadyToStartContainers", "status": "True", "observedGeneration": 1, "lastTransitionTime": "2026-11-24T04:01:11Z"},
                           {"type": "Initialized", "status": "True", "observedGeneration": 1, "lastTransitionTime": "2026-11-24T04:01:09Z"},
                           {"type": "Ready", "status": "True", "observedGeneration": 1, "lastTransitionTime": "2026-11-24T04:01:12Z"},
                           {"type": "ContainersReady", "status": "True", "observedGeneration": 1, "lastTransitionTime": "2026-11-24T04:01:12Z"},
                           {"type": "PodScheduled", "status": "True", "observedGeneration": 1, "lastTransitionTime": "2026-11-24T04:01:09Z"}],
                       "containerStatuses": [{"name": "server", "image": "registry.example.com/team/server:v2.3.1",
                           "imageID": "registry.example.com/team/server@sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
                           "containerID": "containerd://5feceb66ffc86f38d952786c6d696c79c2dbc239dd4e91b46729d73a27fb57e9",
                           "ready": true, "restartCount": 0, "started": true,
                           "allocatedResources": {"cpu": "250m", "memory": "256Mi"},
                           "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}},
                           "user": {"linux": {"uid": 1000, "gid": 1000, "supplementalGroups": [1000]}},
                           "volumeMounts": [{"name": "kube-api-access-x7k2p", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                                             "readOnly": true, "recursiveReadOnly": "Disabled"}],
                           "lastState": {}, "state": {"running": {"startedAt": "2026-11-24T04:01:11Z"}}}]}),
                33,
            ),
            (
                "unusual",
                json!({"phase": "Failed", "reason": "DeadlineExceeded",
                       "message": "Pod was active on the node longer than the specified deadline ✓",
                       "nominatedNodeName": "n-1", "resize": "InProgress"}),
                110,
            ),
        ];
        for (name, value, most_percent) in cases {
            let status: PodStatus = serde_json::from_value(value).unwrap();
            let packed = PackedStatus::new(&status).unwrap();
            assert_eq!(packed.status().as_ref(), Some(&status), "{name}");
            let json = serde_json::to_vec(&status).unwrap().len();
            assert!(
                packed.heap_bytes() * 100 <= json * most_percent + 10 * 100,
                "{name}: {} bytes packed, {json} as JSON",
                packed.heap_bytes()
            );
        }
    }
}
