//! A whole pod kept for later: its JSON without `managedFields` (which nothing here reads,
//! and a good part of a pod's size), LZ4-compressed. A decoded `Pod` takes ~14 KB of heap;
//! packed, a typical one takes well under 1 KB. Packing costs a few microseconds, reading
//! it back a few more: for pods kept long and read rarely.

use std::sync::LazyLock;

use k8s_openapi::api::core::v1::Pod;
use lz4_flex::block::{compress_prepend_size_with_dict, decompress_size_prepended_with_dict};

/// A pod of a Deployment as the API server completes it (defaults, the service account
/// volume, the default tolerations), without a status. Only compression depends on it:
/// any pod packs and unpacks whatever this holds.
const TYPICAL_POD: &str = r#"{"apiVersion":"v1","kind":"Pod","metadata":{"creationTimestamp":"2026-01-01T00:00:00Z","generateName":"web-5d8f7c9b6-","labels":{"app":"web","pod-template-hash":"5d8f7c9b6"},"name":"web-5d8f7c9b6-abcde","namespace":"default","ownerReferences":[{"apiVersion":"apps/v1","blockOwnerDeletion":true,"controller":true,"kind":"ReplicaSet","name":"web-5d8f7c9b6","uid":"00000000-0000-0000-0000-000000000000"}],"resourceVersion":"1","uid":"00000000-0000-0000-0000-000000000000"},"spec":{"containers":[{"image":"nginx:latest","imagePullPolicy":"Always","name":"app","ports":[{"containerPort":80,"protocol":"TCP"}],"resources":{"limits":{"cpu":"500m","memory":"256Mi"},"requests":{"cpu":"100m","memory":"128Mi"}},"terminationMessagePath":"/dev/termination-log","terminationMessagePolicy":"File","volumeMounts":[{"mountPath":"/var/run/secrets/kubernetes.io/serviceaccount","name":"kube-api-access-abcde","readOnly":true}]}],"dnsPolicy":"ClusterFirst","enableServiceLinks":true,"nodeName":"vk-node","preemptionPolicy":"PreemptLowerPriority","priority":0,"restartPolicy":"Always","schedulerName":"default-scheduler","securityContext":{},"serviceAccount":"default","serviceAccountName":"default","terminationGracePeriodSeconds":30,"tolerations":[{"effect":"NoExecute","key":"node.kubernetes.io/not-ready","operator":"Exists","tolerationSeconds":300},{"effect":"NoExecute","key":"node.kubernetes.io/unreachable","operator":"Exists","tolerationSeconds":300},{"effect":"NoSchedule","key":"virtual-kubelet.io/provider","operator":"Exists"}],"volumes":[{"name":"kube-api-access-abcde","projected":{"defaultMode":420,"sources":[{"serviceAccountToken":{"expirationSeconds":3607,"path":"token"}},{"configMap":{"items":[{"key":"ca.crt","path":"ca.crt"}],"name":"kube-root-ca.crt"}},{"downwardAPI":{"items":[{"fieldRef":{"apiVersion":"v1","fieldPath":"metadata.namespace"},"path":"namespace"}]}}]}}]}}"#;

/// [`TYPICAL_POD`] as the compressor sees it (parsed and written again, for the field
/// order and spelling of what is packed), then the typical statuses: lz4 finds matches
/// nearest the end first.
static DICTIONARY: LazyLock<Vec<u8>> = LazyLock::new(|| {
    let mut dictionary = match serde_json::from_str::<Pod>(TYPICAL_POD) {
        Ok(pod) => serde_json::to_vec(&pod).unwrap_or_default(),
        Err(_) => TYPICAL_POD.as_bytes().to_vec(),
    };
    dictionary.extend_from_slice(super::packed_status::typical_statuses());
    dictionary
});

/// `pod` as JSON, without its `managedFields`.
pub fn json_without_managed_fields(pod: &Pod) -> serde_json::Result<Vec<u8>> {
    if pod.metadata.managed_fields.is_some() {
        let mut pruned = pod.clone();
        pruned.metadata.managed_fields = None;
        serde_json::to_vec(&pruned)
    } else {
        serde_json::to_vec(pod)
    }
}

/// A [`Pod`] packed: its JSON without `managedFields`, compressed against [`DICTIONARY`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedPod(Box<[u8]>);

impl PackedPod {
    /// Packs `pod`; `None` if it cannot be written as JSON.
    pub fn new(pod: &Pod) -> Option<Self> {
        let json = json_without_managed_fields(pod).ok()?;
        Some(Self(
            compress_prepend_size_with_dict(&json, &DICTIONARY).into_boxed_slice(),
        ))
    }

    /// The pod back (without its `managedFields`).
    pub fn pod(&self) -> Option<Pod> {
        let json = decompress_size_prepended_with_dict(&self.0, &DICTIONARY).ok()?;
        serde_json::from_slice(&json).ok()
    }

    /// The heap bytes it holds.
    pub fn heap_bytes(&self) -> usize {
        self.0.len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    /// A pod as the upper API server hands a mirrored one: spec, managedFields, status.
    fn pod(name: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "team-a", "uid": "0b6f8f59-5a2c-4c8e-9d0e-3f1f0c2b9a11",
                "resourceVersion": "123456", "creationTimestamp": "2026-11-27T04:00:00Z",
                "labels": {"app": "web", "pod-template-hash": "5d8f7c9b6"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-5d8f7c9b6",
                    "uid": "6a1f3c52-2b7e-4f0a-8c1d-9e2b3a4c5d6e", "controller": true, "blockOwnerDeletion": true}],
                "managedFields": [{"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
                    "time": "2026-11-27T04:00:00Z", "fieldsType": "FieldsV1",
                    "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:app": {}, "f:pod-template-hash": {}}},
                        "f:spec": {"f:containers": {"k:{\"name\":\"app\"}": {".": {}, "f:image": {}, "f:name": {}}}}}}]},
            "spec": {"nodeName": "vk-node", "serviceAccountName": "default",
                "containers": [{"name": "app", "image": "nginx:1.27", "ports": [{"containerPort": 80}],
                    "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                    "volumeMounts": [{"name": "kube-api-access-x1y2z", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true}]}],
                "volumes": [{"name": "kube-api-access-x1y2z", "projected": {"sources": [
                    {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}}]}}],
                "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}]},
            "status": {"phase": "Running", "podIP": "10.244.1.7", "hostIP": "10.0.0.5",
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-27T04:00:02Z"},
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-27T04:00:00Z"}],
                "containerStatuses": [{"name": "app", "ready": true, "restartCount": 0, "image": "nginx:1.27",
                    "imageID": "", "state": {"running": {"startedAt": "2026-11-27T04:00:01Z"}}}]},
        }))
        .unwrap()
    }

    #[test]
    fn a_pod_packs_small_and_comes_back_without_managed_fields() {
        let whole = pod("web-1");
        let packed = PackedPod::new(&whole).unwrap();
        let mut want = whole.clone();
        want.metadata.managed_fields = None;
        assert_eq!(packed.pod().unwrap(), want);
        let json = serde_json::to_vec(&whole).unwrap().len();
        assert!(
            packed.heap_bytes() * 2 < json,
            "packed {} B, JSON {json} B",
            packed.heap_bytes()
        );
        assert!(packed.heap_bytes() < 512, "{} B", packed.heap_bytes());
    }
}
