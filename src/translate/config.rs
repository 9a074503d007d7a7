//! ConfigMaps and Secrets after their first copy: when a lower copy is in step with its
//! upper original, the copy that replaces a stale one, and which copies pods still use.
//!
//! A copy records the upper `resourceVersion` it was made from and a hash of its own
//! content, so the controller tells "in step" from the upper object's metadata alone (it
//! never keeps upper contents in memory) and notices an edit made below.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::{ByteString, Metadata};
use serde_json::{Value, json};

use super::deps::{DependencyKind, lower_config_map, lower_secret, pod_dependencies};
use super::hash::fnv1a;
use super::meta::{
    CONTENT_HASH_ANNOTATION, Owner, UPPER_RESOURCE_VERSION_ANNOTATION, UPPER_UID_ANNOTATION,
};
use super::{TranslateError, object_ref};

/// Namespace whose objects tensile never mirrors nor touches below.
pub const SYSTEM_NAMESPACE: &str = "kube-system";

/// A kind whose lower copies are kept equal to their upper originals: ConfigMap, Secret.
pub trait Copied: Clone + Metadata<Ty = ObjectMeta> {
    /// The pod dependency kind (for reference counting).
    const DEPENDENCY: DependencyKind;

    /// The plain lower copy (ownership marks, no version stamps).
    fn lower_copy(upper: &Self, owner: &Owner) -> Result<Self, TranslateError>;

    /// What "equal to the original" covers besides labels and annotations.
    fn payload(&self) -> Value;
}

impl Copied for ConfigMap {
    const DEPENDENCY: DependencyKind = DependencyKind::ConfigMap;

    fn lower_copy(upper: &Self, owner: &Owner) -> Result<Self, TranslateError> {
        lower_config_map(upper, owner)
    }

    fn payload(&self) -> Value {
        json!({"data": self.data, "binaryData": self.binary_data, "immutable": self.immutable})
    }
}

impl Copied for Secret {
    const DEPENDENCY: DependencyKind = DependencyKind::Secret;

    fn lower_copy(upper: &Self, owner: &Owner) -> Result<Self, TranslateError> {
        let mut copy = lower_secret(upper, owner)?;
        // The API server folds stringData into data on write; doing it here keeps the
        // recorded hash equal to what is read back.
        if let Some(strings) = copy.string_data.take() {
            let data = copy.data.get_or_insert_default();
            for (key, value) in strings {
                data.insert(key, ByteString(value.into_bytes()));
            }
        }
        Ok(copy)
    }

    fn payload(&self) -> Value {
        json!({"data": self.data, "type": self.type_, "immutable": self.immutable})
    }
}

/// The identity and version of an upper object, as its metadata-only watch shows them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpperVersion {
    /// `metadata.uid`.
    pub uid: String,
    /// `metadata.resourceVersion`.
    pub resource_version: String,
}

/// How a lower copy stands against its upper original.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyState {
    /// Made from the original's current version and unchanged since: nothing to do.
    InStep,
    /// The original changed, was re-created, or the copy was edited below: read the
    /// original and rewrite the copy.
    Stale,
    /// The original is gone: delete the copy.
    OriginalGone,
}

/// Compares a copy with what the upper watch says of its original.
pub fn copy_state<K: Copied>(copy: &K, original: Option<&UpperVersion>) -> CopyState {
    let Some(original) = original else {
        return CopyState::OriginalGone;
    };
    let annotation = |key: &str| {
        copy.metadata()
            .annotations
            .as_ref()
            .and_then(|a| a.get(key))
            .map(String::as_str)
    };
    let in_step = annotation(UPPER_UID_ANNOTATION) == Some(original.uid.as_str())
        && annotation(UPPER_RESOURCE_VERSION_ANNOTATION)
            == Some(original.resource_version.as_str())
        && annotation(CONTENT_HASH_ANNOTATION) == Some(content_hash(copy).as_str());
    if in_step {
        CopyState::InStep
    } else {
        CopyState::Stale
    }
}

/// The lower copy of `upper`, stamped with the upper version it reflects and the hash of
/// its content.
pub fn stamped_copy<K: Copied>(upper: &K, owner: &Owner) -> Result<K, TranslateError> {
    let mut copy = K::lower_copy(upper, owner)?;
    let version =
        upper
            .metadata()
            .resource_version
            .clone()
            .ok_or_else(|| TranslateError::MissingField {
                kind: kind_of(K::DEPENDENCY),
                object: object_ref(upper.metadata()),
                field: "metadata.resourceVersion",
            })?;
    let annotations = copy.metadata_mut().annotations.get_or_insert_default();
    annotations.remove(CONTENT_HASH_ANNOTATION);
    annotations.insert(UPPER_RESOURCE_VERSION_ANNOTATION.to_owned(), version);
    let hash = content_hash(&copy);
    copy.metadata_mut()
        .annotations
        .get_or_insert_default()
        .insert(CONTENT_HASH_ANNOTATION.to_owned(), hash);
    Ok(copy)
}

/// Whether `current` already holds what `desired` (a [`stamped_copy`]) would write.
pub fn holds<K: Copied>(current: &K, desired: &K) -> bool {
    content(current) == content(desired)
}

/// `desired` carrying what the lower cluster owns of `current` (its resourceVersion, for an
/// optimistic update, UID, finalizers, owner references), ready to replace it.
pub fn replacement<K: Copied>(current: &K, mut desired: K) -> K {
    let now = current.metadata();
    let meta = desired.metadata_mut();
    carry_server_fields(now, meta);
    meta.owner_references.clone_from(&now.owner_references);
    desired
}

/// Copies onto `meta` the fields the lower API server owns on `now`: resourceVersion (so a
/// replace is optimistic), UID, creation time and finalizers.
pub(crate) fn carry_server_fields(now: &ObjectMeta, meta: &mut ObjectMeta) {
    meta.resource_version.clone_from(&now.resource_version);
    meta.uid.clone_from(&now.uid);
    meta.finalizers.clone_from(&now.finalizers);
    meta.creation_timestamp.clone_from(&now.creation_timestamp);
}

/// Everything a copy is kept equal on, hash annotation aside.
fn content<K: Copied>(object: &K) -> Value {
    let meta = object.metadata();
    let mut annotations = meta.annotations.clone().unwrap_or_default();
    let hash = annotations.remove(CONTENT_HASH_ANNOTATION);
    json!({
        "labels": meta.labels,
        "annotations": annotations,
        "hash": hash,
        "payload": object.payload(),
    })
}

/// FNV-1a (64 bit) of the canonical JSON of labels, annotations (hash aside) and payload:
/// stable across releases and platforms, unlike `std`'s hasher.
pub fn content_hash<K: Copied>(object: &K) -> String {
    let meta = object.metadata();
    let mut annotations = meta.annotations.clone().unwrap_or_default();
    annotations.remove(CONTENT_HASH_ANNOTATION);
    let canonical = json!({
        "labels": meta.labels,
        "annotations": annotations,
        "payload": object.payload(),
    })
    .to_string();
    format!("{:016x}", fnv1a(canonical.as_bytes()))
}

/// `ConfigMap` or `Secret`, for messages.
pub fn kind_of(kind: DependencyKind) -> &'static str {
    match kind {
        DependencyKind::ConfigMap => "ConfigMap",
        DependencyKind::Secret => "Secret",
        DependencyKind::PersistentVolumeClaim => "PersistentVolumeClaim",
        DependencyKind::ServiceAccount => "ServiceAccount",
    }
}

/// One referenced object: kind, namespace, name.
pub type Reference = (DependencyKind, String, String);

/// Every object the given pods reference (required or optional), by kind, namespace and
/// name.
pub fn referenced<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    with_service_account: bool,
) -> BTreeSet<Reference> {
    let mut found = BTreeSet::new();
    for pod in pods {
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        for dependency in pod_dependencies(pod, with_service_account) {
            found.insert((dependency.kind, namespace.clone(), dependency.name));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::translate::meta::GLOBAL_ANNOTATION;
    use crate::translate::meta::OWNER_NODE_LABEL;

    const NODE: &str = "vk";
    const CLUSTER: &str = "cluster-1";

    fn owner() -> Owner {
        Owner::new(NODE, CLUSTER)
    }

    fn config_map(rv: &str, uid: &str, data: Value) -> ConfigMap {
        serde_json::from_value(json!({
            "metadata": {"name": "cm", "namespace": "ns", "uid": uid, "resourceVersion": rv,
                         "labels": {"app": "web"}},
            "data": data,
        }))
        .unwrap()
    }

    fn version(uid: &str, rv: &str) -> UpperVersion {
        UpperVersion {
            uid: uid.into(),
            resource_version: rv.into(),
        }
    }

    #[test]
    fn stamped_copies_carry_version_and_hash() {
        let upper = config_map("7", "u1", json!({"a": "1"}));
        let copy = stamped_copy(&upper, &owner()).unwrap();
        let annotations = copy.metadata.annotations.clone().unwrap();
        assert_eq!(annotations[UPPER_RESOURCE_VERSION_ANNOTATION], "7");
        assert_eq!(annotations[UPPER_UID_ANNOTATION], "u1");
        assert_eq!(annotations[GLOBAL_ANNOTATION], "true");
        assert_eq!(annotations[CONTENT_HASH_ANNOTATION], content_hash(&copy));
        assert_eq!(
            copy.metadata.labels.clone().unwrap()[OWNER_NODE_LABEL],
            NODE
        );
        assert_eq!(copy.metadata.resource_version, None);
        assert_eq!(
            copy_state(&copy, Some(&version("u1", "7"))),
            CopyState::InStep
        );
    }

    #[test]
    fn copy_states() {
        let copy = stamped_copy(&config_map("7", "u1", json!({"a": "1"})), &owner()).unwrap();
        let mut edited_below = copy.clone();
        edited_below
            .data
            .get_or_insert_default()
            .insert("a".into(), "2".into());
        let mut relabelled_below = copy.clone();
        relabelled_below
            .metadata
            .labels
            .get_or_insert_default()
            .insert("extra".into(), "x".into());
        let mut unstamped = copy.clone();
        unstamped
            .metadata
            .annotations
            .get_or_insert_default()
            .remove(UPPER_RESOURCE_VERSION_ANNOTATION);
        let cases = [
            (
                "in step",
                &copy,
                Some(version("u1", "7")),
                CopyState::InStep,
            ),
            (
                "upper edited",
                &copy,
                Some(version("u1", "8")),
                CopyState::Stale,
            ),
            (
                "upper re-created",
                &copy,
                Some(version("u2", "7")),
                CopyState::Stale,
            ),
            (
                "data edited below",
                &edited_below,
                Some(version("u1", "7")),
                CopyState::Stale,
            ),
            (
                "label added below",
                &relabelled_below,
                Some(version("u1", "7")),
                CopyState::Stale,
            ),
            (
                "made without a stamp",
                &unstamped,
                Some(version("u1", "7")),
                CopyState::Stale,
            ),
            ("upper gone", &copy, None, CopyState::OriginalGone),
        ];
        for (name, copy, original, want) in cases {
            assert_eq!(copy_state(copy, original.as_ref()), want, "{name}");
        }
    }

    #[test]
    fn a_metadata_only_upper_change_needs_only_a_restamp() {
        let old = stamped_copy(&config_map("7", "u1", json!({"a": "1"})), &owner()).unwrap();
        let new = stamped_copy(&config_map("8", "u1", json!({"a": "1"})), &owner()).unwrap();
        assert!(holds(&old, &old));
        assert!(!holds(&old, &new), "the stamp must move on");
        let changed = stamped_copy(&config_map("8", "u1", json!({"a": "2"})), &owner()).unwrap();
        assert!(!holds(&new, &changed));
    }

    #[test]
    fn replacements_keep_what_the_lower_cluster_owns() {
        let mut current =
            stamped_copy(&config_map("7", "u1", json!({"a": "1"})), &owner()).unwrap();
        current.metadata.resource_version = Some("lower-42".into());
        current.metadata.uid = Some("lower-uid".into());
        current.metadata.finalizers = Some(vec!["example.com/keep".into()]);
        let desired = stamped_copy(&config_map("8", "u1", json!({"a": "2"})), &owner()).unwrap();
        let replaced = replacement(&current, desired.clone());
        assert_eq!(
            replaced.metadata.resource_version.as_deref(),
            Some("lower-42")
        );
        assert_eq!(replaced.metadata.uid.as_deref(), Some("lower-uid"));
        assert_eq!(replaced.metadata.finalizers, current.metadata.finalizers);
        assert_eq!(replaced.data, desired.data);
        assert!(holds(&replaced, &desired));
    }

    #[test]
    fn secrets_fold_string_data_and_hash_their_type() {
        let upper: Secret = serde_json::from_value(json!({
            "metadata": {"name": "s", "namespace": "ns", "uid": "u", "resourceVersion": "3"},
            "type": "Opaque",
            "data": {"a": "YQ=="},
            "stringData": {"b": "b"},
        }))
        .unwrap();
        let copy = stamped_copy(&upper, &owner()).unwrap();
        assert_eq!(copy.string_data, None);
        let data = copy.data.clone().unwrap();
        assert_eq!(data["a"].0, b"a");
        assert_eq!(data["b"].0, b"b");
        let mut retyped = copy.clone();
        retyped.type_ = Some("example.com/other".into());
        assert_ne!(content_hash(&copy), content_hash(&retyped));

        let token: Secret = serde_json::from_value(json!({
            "metadata": {"name": "t", "namespace": "ns", "uid": "u", "resourceVersion": "3"},
            "type": "kubernetes.io/service-account-token",
        }))
        .unwrap();
        assert!(matches!(
            stamped_copy(&token, &owner()),
            Err(TranslateError::NotMirrored { .. })
        ));
    }

    #[test]
    fn the_hash_is_stable() {
        // The hash itself is pinned in `hash`: a change there rewrites every copy once
        // after an upgrade.
        let copy = stamped_copy(&config_map("7", "u1", json!({"a": "1"})), &owner()).unwrap();
        assert_eq!(content_hash(&copy), content_hash(&copy.clone()));
    }

    #[test]
    fn references_of_pods() {
        let pod = |ns: &str, volumes: Value| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"name": "p", "namespace": ns},
                "spec": {"containers": [{"name": "c"}], "volumes": volumes},
            }))
            .unwrap()
        };
        let pods = [
            pod(
                "a",
                json!([{"name": "v", "configMap": {"name": "settings"}}]),
            ),
            pod(
                "b",
                json!([{"name": "v", "secret": {"secretName": "password", "optional": true}}]),
            ),
        ];
        let found = referenced(&pods, true);
        let want: BTreeSet<Reference> = [
            (DependencyKind::ConfigMap, "a".into(), "settings".into()),
            (DependencyKind::Secret, "b".into(), "password".into()),
        ]
        .into();
        assert_eq!(found, want);
    }
}
