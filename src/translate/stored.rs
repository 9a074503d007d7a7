//! The pod as the controllers' stores keep it. A k8s-openapi `Pod` costs kilobytes even
//! when pruned (its structs hold every optional field inline); between reconciles the
//! controllers compare only identity, marks, container names and images, tolerations,
//! activeDeadlineSeconds, nodeName and status. Watch events are converted on arrival, so
//! ten thousand mirrored pods fit in a small footprint; a reconcile rebuilds a `Pod` view.
//! The status is kept as its JSON, a third of the size of its struct graph, and parsed
//! back when a reconcile needs it. Labels and annotations are kept as [`Pairs`], one
//! buffer each instead of a `BTreeMap` (whose smallest node reserves room for eleven
//! entries: half a kilobyte for the two to five a pod has).

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, PodStatus, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::core::NamespaceResourceScope;

use super::meta::{Claim, Owner, UPPER_UID_ANNOTATION};

/// A container as stored: its name and image.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoredContainer {
    /// `name`.
    pub name: String,
    /// `image`.
    pub image: Option<String>,
}

/// A string map of a few entries in one buffer: `text` holds the keys and values one
/// after the other, `ends[i]` where the i-th of them ends. Entries keep the map's (sorted)
/// order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pairs {
    text: Box<str>,
    ends: Box<[u32]>,
}

impl Pairs {
    /// Packs `map`. `None` if it is too large for 32-bit offsets (4 GiB: never for a real
    /// object, whose metadata the API server caps at 256 KiB).
    pub fn new(map: &BTreeMap<String, String>) -> Option<Self> {
        let mut text = String::with_capacity(map.iter().map(|(k, v)| k.len() + v.len()).sum());
        let mut ends = Vec::with_capacity(2 * map.len());
        for part in map.iter().flat_map(|(k, v)| [k, v]) {
            text.push_str(part);
            ends.push(u32::try_from(text.len()).ok()?);
        }
        Some(Self {
            text: text.into_boxed_str(),
            ends: ends.into_boxed_slice(),
        })
    }

    /// The entries, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        let mut start = 0;
        let mut parts = self.ends.iter().map(move |&end| {
            let end = end as usize;
            let part = self.text.get(start..end).unwrap_or_default();
            start = end;
            part
        });
        std::iter::from_fn(move || Some((parts.next()?, parts.next()?)))
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// The map back; `None` when empty.
    pub fn to_map(&self) -> Option<BTreeMap<String, String>> {
        (!self.is_empty()).then(|| {
            self.iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect()
        })
    }
}

/// A pod reduced to what the controllers compare. It deserializes from a pod's JSON.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(from = "Pod")]
pub struct StoredPod {
    /// Metadata, without managedFields, and without labels and annotations: read those
    /// with [`StoredPod::label`] and [`StoredPod::annotation`].
    pub metadata: ObjectMeta,
    /// `metadata.labels`.
    labels: Pairs,
    /// `metadata.annotations`.
    annotations: Pairs,
    /// `spec.nodeName`.
    pub node_name: Option<String>,
    /// `spec.containers`, names and images.
    pub containers: Vec<StoredContainer>,
    /// `spec.initContainers`, names and images.
    pub init_containers: Vec<StoredContainer>,
    /// `spec.tolerations`, as JSON (a `Toleration` is 112 bytes before its strings, and
    /// every pod has at least the two the API server adds).
    tolerations: Option<Box<[u8]>>,
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
        // Every write of a pod is a merge patch or carries a UID precondition; the
        // reflector would copy it into the store's key as well.
        metadata.resource_version = None;
        let labels = packed(metadata.labels.take());
        let annotations = packed(metadata.annotations.take());
        let spec = spec.unwrap_or_default();
        Self {
            metadata,
            labels,
            annotations,
            containers: stored(&spec.containers),
            init_containers: stored(spec.init_containers.as_deref().unwrap_or_default()),
            node_name: spec.node_name,
            tolerations: spec.tolerations.as_ref().and_then(json),
            active_deadline_seconds: spec.active_deadline_seconds,
            status: status.as_ref().and_then(json),
        }
    }
}

/// `value` as JSON.
fn json<T: serde::Serialize>(value: &T) -> Option<Box<[u8]>> {
    serde_json::to_vec(value).ok().map(Vec::into_boxed_slice)
}

/// Parses what [`json`] wrote.
fn parsed<T: serde::de::DeserializeOwned>(json: Option<&[u8]>) -> Option<T> {
    // It was serialized from a `T` on arrival, so it parses back.
    json.and_then(|json| serde_json::from_slice(json).ok())
}

/// Packs a label or annotation map. One beyond 4 GiB cannot exist (the API server caps an
/// object's metadata at 256 KiB), so it would be dropped rather than fail the watch.
fn packed(map: Option<BTreeMap<String, String>>) -> Pairs {
    map.and_then(|m| Pairs::new(&m)).unwrap_or_default()
}

impl StoredPod {
    /// The value of label `key`.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels.get(key)
    }

    /// The value of annotation `key`.
    pub fn annotation(&self, key: &str) -> Option<&str> {
        self.annotations.get(key)
    }

    /// Whether `node` owns it ([`super::pod::is_owned_by`] on a stored pod).
    pub fn is_owned_by(&self, owner: &Owner) -> bool {
        owner.claim(|key| self.label(key)) == Claim::Ours
    }

    /// The UID of its upper pod ([`super::pod::upper_uid`] on a stored pod).
    pub fn upper_uid(&self) -> Option<&str> {
        self.annotation(UPPER_UID_ANNOTATION)
    }

    /// The status.
    pub fn status(&self) -> Option<PodStatus> {
        parsed(self.status.as_deref())
    }

    /// `spec.tolerations`.
    pub fn tolerations(&self) -> Option<Vec<Toleration>> {
        parsed(self.tolerations.as_deref())
    }

    /// The `Pod` this stands for, with only the stored fields set — enough for the
    /// comparisons and patches of a reconcile, not for creating a pod.
    pub fn to_pod(&self) -> Pod {
        Pod {
            metadata: ObjectMeta {
                labels: self.labels.to_map(),
                annotations: self.annotations.to_map(),
                ..self.metadata.clone()
            },
            spec: Some(PodSpec {
                node_name: self.node_name.clone(),
                containers: containers(&self.containers),
                init_containers: (!self.init_containers.is_empty())
                    .then(|| containers(&self.init_containers)),
                tolerations: self.tolerations(),
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
                "resourceVersion": "42",
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
        assert_eq!(stored.metadata.resource_version, None);
        assert_eq!(stored.label("app"), Some("web"));
        assert_eq!(stored.label("other"), None);
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

    #[test]
    fn pairs_round_trip() {
        let cases: Vec<(&str, Vec<(&str, &str)>)> = vec![
            ("empty", vec![]),
            ("one", vec![("app", "web")]),
            ("empty key and value", vec![("", ""), ("k", "")]),
            (
                "several, unsorted input",
                vec![("z", "1"), ("a", "{\"json\": true}"), ("m", "ünïcode")],
            ),
        ];
        for (name, entries) in cases {
            let map: BTreeMap<String, String> = entries
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let pairs = Pairs::new(&map).unwrap();
            assert_eq!(
                pairs.to_map(),
                (!map.is_empty()).then(|| map.clone()),
                "{name}"
            );
            assert_eq!(pairs.is_empty(), map.is_empty(), "{name}");
            for (k, v) in &map {
                assert_eq!(pairs.get(k), Some(v.as_str()), "{name}: {k}");
            }
            assert_eq!(pairs.get("absent"), None, "{name}");
            let keys: Vec<&str> = pairs.iter().map(|(k, _)| k).collect();
            let want: Vec<&str> = map.keys().map(String::as_str).collect();
            assert_eq!(keys, want, "{name}: key order");
        }
    }
}
