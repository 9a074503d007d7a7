//! The pod as the controllers' stores keep it. A k8s-openapi `Pod` costs kilobytes even
//! when pruned (its structs hold every optional field inline); between reconciles the
//! controllers compare only identity, marks, container names and images, tolerations,
//! activeDeadlineSeconds, nodeName and status. Watch events are converted on arrival, so
//! ten thousand mirrored pods fit in a small footprint; a reconcile rebuilds a `Pod` view.
//! The status is kept as its JSON, a third of the size of its struct graph, and parsed
//! back when a reconcile needs it.

use std::borrow::Cow;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, PodStatus, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::core::NamespaceResourceScope;

/// A container as stored: its name and image.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoredContainer {
    /// `name`.
    pub name: String,
    /// `image`.
    pub image: Option<String>,
}

/// A pod reduced to what the controllers compare. It deserializes from a pod's JSON.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(from = "Pod")]
pub struct StoredPod {
    /// Metadata, without managedFields.
    pub metadata: ObjectMeta,
    /// `spec.nodeName`.
    pub node_name: Option<String>,
    /// `spec.containers`, names and images.
    pub containers: Vec<StoredContainer>,
    /// `spec.initContainers`, names and images.
    pub init_containers: Vec<StoredContainer>,
    /// `spec.tolerations`.
    pub tolerations: Option<Vec<Toleration>>,
    /// `spec.activeDeadlineSeconds`.
    pub active_deadline_seconds: Option<i64>,
    /// `status`, as JSON.
    status: Option<Box<[u8]>>,
}

fn stored(containers: &[Container]) -> Vec<StoredContainer> {
    containers
        .iter()
        .map(|c| StoredContainer {
            name: c.name.clone(),
            image: c.image.clone(),
        })
        .collect()
}

fn containers(stored: &[StoredContainer]) -> Vec<Container> {
    stored
        .iter()
        .map(|c| Container {
            name: c.name.clone(),
            image: c.image.clone(),
            ..Container::default()
        })
        .collect()
}

impl From<Pod> for StoredPod {
    fn from(pod: Pod) -> Self {
        let Pod {
            mut metadata,
            spec,
            status,
        } = pod;
        // Nothing between reconciles reads these; a lower pod is made from the whole
        // upper pod, read again when it is created.
        metadata.managed_fields = None;
        metadata.owner_references = None;
        metadata.finalizers = None;
        metadata.generate_name = None;
        metadata.creation_timestamp = None;
        let spec = spec.unwrap_or_default();
        Self {
            metadata,
            containers: stored(&spec.containers),
            init_containers: stored(spec.init_containers.as_deref().unwrap_or_default()),
            node_name: spec.node_name,
            tolerations: spec.tolerations,
            active_deadline_seconds: spec.active_deadline_seconds,
            status: status
                .and_then(|s| serde_json::to_vec(&s).ok())
                .map(Vec::into_boxed_slice),
        }
    }
}

impl StoredPod {
    /// The status.
    pub fn status(&self) -> Option<PodStatus> {
        // It was serialized from a `PodStatus` on arrival, so it parses back.
        self.status
            .as_deref()
            .and_then(|json| serde_json::from_slice(json).ok())
    }

    /// The `Pod` this stands for, with only the stored fields set — enough for the
    /// comparisons and patches of a reconcile, not for creating a pod.
    pub fn to_pod(&self) -> Pod {
        Pod {
            metadata: self.metadata.clone(),
            spec: Some(PodSpec {
                node_name: self.node_name.clone(),
                containers: containers(&self.containers),
                init_containers: (!self.init_containers.is_empty())
                    .then(|| containers(&self.init_containers)),
                tolerations: self.tolerations.clone(),
                active_deadline_seconds: self.active_deadline_seconds,
                ..PodSpec::default()
            }),
            status: self.status(),
        }
    }
}

impl Resource for StoredPod {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("Pod")
    }

    fn group(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }

    fn version(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("v1")
    }

    fn plural(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("pods")
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keeps_what_reconciles_compare_and_drops_the_rest() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {
                "name": "web", "namespace": "ns", "uid": "u", "labels": {"app": "web"},
                "managedFields": [{"manager": "kubectl", "operation": "Update"}],
            },
            "spec": {
                "nodeName": "vk",
                "activeDeadlineSeconds": 60,
                "tolerations": [{"key": "k", "operator": "Exists"}],
                "initContainers": [{"name": "init", "image": "busybox"}],
                "containers": [{
                    "name": "app", "image": "nginx:1",
                    "env": [{"name": "A", "value": "b"}],
                    "livenessProbe": {"httpGet": {"path": "/", "port": 80}},
                }],
                "volumes": [{"name": "v", "emptyDir": {}}],
            },
            "status": {"phase": "Running", "podIP": "10.0.0.1"},
        }))
        .unwrap();
        let stored = StoredPod::from(pod.clone());
        assert_eq!(stored.metadata.managed_fields, None);
        assert_eq!(stored.status(), pod.status);
        let view = stored.to_pod();
        let (spec, original) = (view.spec.unwrap(), pod.spec.unwrap());
        assert_eq!(view.metadata.labels, pod.metadata.labels);
        assert_eq!(view.status, pod.status);
        assert_eq!(spec.node_name, original.node_name);
        assert_eq!(spec.tolerations, original.tolerations);
        assert_eq!(spec.active_deadline_seconds, Some(60));
        assert_eq!(spec.containers[0].name, "app");
        assert_eq!(spec.containers[0].image.as_deref(), Some("nginx:1"));
        assert!(spec.containers[0].env.is_none() && spec.containers[0].liveness_probe.is_none());
        assert_eq!(
            spec.init_containers.unwrap()[0].image.as_deref(),
            Some("busybox")
        );
        assert!(spec.volumes.is_none());
        assert_eq!(StoredPod::kind(&()), "Pod");
        assert_eq!(StoredPod::plural(&()), "pods");
    }
}
