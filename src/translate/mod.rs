//! Pure translation between upper and lower objects: no client, no async.

pub mod admission;
pub mod config;
pub mod deps;
pub mod downward;
pub mod events;
pub(crate) mod hash;
pub mod identity;
pub mod kueue_quota;
pub mod meta;
pub mod namespace;
pub mod packed_status;
pub mod pod;
pub mod resize;
pub mod scheduling;
pub mod service;
pub mod stored;
pub mod volume;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{Value, json};

use self::meta::Owner;

/// Why an upper object could not be translated for the lower cluster.
#[derive(thiserror::Error, Debug)]
pub enum TranslateError {
    /// The upper object lacks a field every mirrored object needs.
    #[error("{kind} {object}: missing {field}")]
    MissingField {
        /// Kind of the upper object, e.g. `Pod`.
        kind: &'static str,
        /// `namespace/name` of the upper object, as far as it is known.
        object: String,
        /// The missing field, e.g. `metadata.uid`.
        field: &'static str,
    },
    /// An annotation tensile reads holds malformed JSON.
    #[error("{object}: annotation {key} is not valid JSON: {source}")]
    BadAnnotation {
        /// The object carrying the annotation, e.g. `Pod default/web-0`.
        object: String,
        /// The annotation key.
        key: &'static str,
        /// What the JSON parser objected to.
        source: serde_json::Error,
    },
    /// The object is of a sort tensile never copies to the lower cluster.
    #[error("{kind} {object} is not mirrored: {reason}")]
    NotMirrored {
        /// Kind of the upper object.
        kind: &'static str,
        /// `namespace/name` of the upper object.
        object: String,
        /// Why it stays in the upper cluster.
        reason: &'static str,
    },
    /// A value tensile builds could not be encoded as JSON (not expected to happen).
    #[error("{object}: cannot encode {what} as JSON: {source}")]
    Encode {
        /// The object being translated.
        object: String,
        /// What was being encoded.
        what: &'static str,
        /// The encoder's error.
        source: serde_json::Error,
    },
}

impl TranslateError {
    /// Names the object an error raised without one (such as a parse of bare annotations).
    pub(crate) fn for_object(self, name: String) -> Self {
        match self {
            Self::BadAnnotation { key, source, .. } => Self::BadAnnotation {
                object: name,
                key,
                source,
            },
            other => other,
        }
    }
}

/// `namespace/name` (or just `name`) of an object, for error messages and logs.
pub(crate) fn object_ref(meta: &ObjectMeta) -> String {
    let name = meta.name.as_deref().unwrap_or("<unnamed>");
    match meta.namespace.as_deref() {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_owned(),
    }
}

/// Metadata of a lower copy of a dependency or a Service: [`lower_meta`] plus `global`,
/// which tells tensile-kube-era tooling the object belongs to the system.
pub(crate) fn copy_meta(
    kind: &'static str,
    upper: &ObjectMeta,
    owner: &Owner,
) -> Result<ObjectMeta, TranslateError> {
    let mut meta = lower_meta(kind, upper, owner)?;
    meta.annotations
        .get_or_insert_default()
        .insert(meta::GLOBAL_ANNOTATION.to_owned(), "true".to_owned());
    Ok(meta)
}

/// The metadata of a lower copy of `upper`: name, namespace, labels and annotations kept,
/// everything the upper API server assigned cleared (the lower one assigns its own), and
/// tensile's ownership marks added. Errors if `upper` has no name, namespace or uid.
pub fn lower_meta(
    kind: &'static str,
    upper: &ObjectMeta,
    owner: &Owner,
) -> Result<ObjectMeta, TranslateError> {
    let missing = |field| TranslateError::MissingField {
        kind,
        object: object_ref(upper),
        field,
    };
    let name = upper.name.clone().ok_or_else(|| missing("metadata.name"))?;
    let namespace = upper
        .namespace
        .clone()
        .ok_or_else(|| missing("metadata.namespace"))?;
    let uid = upper.uid.clone().ok_or_else(|| missing("metadata.uid"))?;

    let mut labels = upper.labels.clone().unwrap_or_default();
    owner.mark(&mut labels);
    let mut annotations = upper.annotations.clone().unwrap_or_default();
    annotations.insert(meta::UPPER_UID_ANNOTATION.to_owned(), uid);

    // Built field by field rather than cleared from a clone, so a field a future
    // ObjectMeta grows is left out instead of leaking an upper-cluster value.
    Ok(ObjectMeta {
        name: Some(name),
        namespace: Some(namespace),
        labels: Some(labels),
        annotations: Some(annotations),
        ..ObjectMeta::default()
    })
}

/// `patch` (a merge or strategic merge patch) restricted to the object whose UID is `uid`:
/// the API server refuses it (422, `metadata.uid` is immutable) once the name belongs to
/// an object re-created under it.
pub fn with_uid_precondition(mut patch: Value, uid: &str) -> Value {
    if let Some(fields) = patch.as_object_mut() {
        let metadata = fields.entry("metadata").or_insert_with(|| json!({}));
        if let Some(metadata) = metadata.as_object_mut() {
            metadata.insert("uid".to_owned(), Value::String(uid.to_owned()));
        }
    }
    patch
}
