//! AdmissionReview `admission.k8s.io/v1`: decoding a request body, strictly enough to say
//! what is wrong with a bad one, and encoding the response.

use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The only AdmissionReview version served (tensile-kube spoke only v1beta1).
pub const API_VERSION: &str = "admission.k8s.io/v1";
/// The envelope kind.
pub const KIND: &str = "AdmissionReview";

/// Why a body is not an AdmissionReview this webhook can answer. The server turns each into
/// HTTP 400 with this message.
#[derive(thiserror::Error, Debug)]
pub enum BadReview {
    /// Nothing was sent.
    #[error("empty body: expected an AdmissionReview ({API_VERSION})")]
    Empty,
    /// The body is larger than the server accepts.
    #[error("body is larger than {limit} bytes")]
    TooLarge {
        /// The limit in bytes (`--max-body-bytes`).
        limit: usize,
    },
    /// The body could not be read off the connection.
    #[error("cannot read the body: {0}")]
    Read(String),
    /// Not JSON at all.
    #[error("body is not valid JSON: {0}")]
    Syntax(serde_json::Error),
    /// JSON, but not shaped like an AdmissionReview.
    #[error("body is not an AdmissionReview: {0}")]
    Shape(serde_json::Error),
    /// Another apiVersion, e.g. tensile-kube's `admission.k8s.io/v1beta1`.
    #[error(
        "apiVersion {0:?} is not supported: this webhook speaks {API_VERSION} \
         (admissionReviewVersions: [\"v1\"])"
    )]
    ApiVersion(String),
    /// Another kind.
    #[error("kind {0:?} is not {KIND}")]
    Kind(String),
    /// An envelope without a request (e.g. a response sent back).
    #[error("the AdmissionReview has no request")]
    NoRequest,
    /// A request the response could not be matched to.
    #[error("request.uid is missing or empty")]
    NoUid,
    /// A CREATE or UPDATE without the object it creates or updates.
    #[error("{operation} request {uid} has no object")]
    NoObject {
        /// `CREATE` or `UPDATE`.
        operation: String,
        /// The request's uid.
        uid: String,
    },
}

/// Group, version and kind of the object under admission.
#[derive(Deserialize, Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupVersionKind {
    /// API group (`""` for core).
    #[serde(default)]
    pub group: String,
    /// API version.
    #[serde(default)]
    pub version: String,
    /// Kind, e.g. `Pod`.
    #[serde(default)]
    pub kind: String,
}

/// The fields of `AdmissionReview.request` the webhook reads.
#[derive(Deserialize, Debug, Clone, Default)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionRequest {
    /// Identifies the request; the response must carry it back.
    #[serde(default)]
    pub uid: String,
    /// Kind of the object.
    #[serde(default)]
    pub kind: GroupVersionKind,
    /// Subresource (`status`, `binding`, …), if any.
    #[serde(default)]
    pub sub_resource: Option<String>,
    /// Namespace of the object.
    #[serde(default)]
    pub namespace: Option<String>,
    /// Name of the object (empty on CREATE with generateName).
    #[serde(default)]
    pub name: Option<String>,
    /// `CREATE`, `UPDATE`, `DELETE` or `CONNECT`.
    #[serde(default)]
    pub operation: String,
    /// The object as it would be stored, kept raw so a patch addresses exactly what came.
    #[serde(default)]
    pub object: Option<Value>,
    /// A dry run: nothing may be remembered from it.
    #[serde(default)]
    pub dry_run: Option<bool>,
}

impl AdmissionRequest {
    /// `namespace/name` for logs (the name may be empty on CREATE).
    pub fn object_ref(&self) -> String {
        let name = self
            .name
            .as_deref()
            .filter(|n| !n.is_empty())
            .or_else(|| {
                let meta = self.object.as_ref()?.get("metadata")?;
                meta.get("name")
                    .or_else(|| meta.get("generateName"))?
                    .as_str()
            })
            .unwrap_or("<unnamed>");
        match self.namespace.as_deref() {
            Some(ns) if !ns.is_empty() => format!("{ns}/{name}"),
            _ => name.to_owned(),
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Envelope {
    #[serde(default)]
    api_version: Option<String>,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    request: Option<AdmissionRequest>,
}

/// The most of a warning the API server keeps (it truncates longer ones).
const MAX_WARNING: usize = 250;

/// `warning` cut to what the API server keeps, at a character boundary, with `…` when cut:
/// the start says what happened.
pub fn short_warning(mut warning: String) -> String {
    if warning.len() > MAX_WARNING {
        let mut end = MAX_WARNING;
        while !warning.is_char_boundary(end) {
            end -= 1;
        }
        warning.truncate(end);
        warning.push('…');
    }
    warning
}

/// Decodes a request body into its AdmissionRequest, or says what is wrong with it.
pub fn decode(body: &[u8]) -> Result<AdmissionRequest, BadReview> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(BadReview::Empty);
    }
    let envelope: Envelope = serde_json::from_slice(body).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => BadReview::Shape(e),
        _ => BadReview::Syntax(e),
    })?;
    match envelope.api_version.as_deref() {
        Some(API_VERSION) => {}
        other => return Err(BadReview::ApiVersion(other.unwrap_or("").to_owned())),
    }
    match envelope.kind.as_deref() {
        Some(KIND) => {}
        other => return Err(BadReview::Kind(other.unwrap_or("").to_owned())),
    }
    let request = envelope.request.ok_or(BadReview::NoRequest)?;
    if request.uid.is_empty() {
        return Err(BadReview::NoUid);
    }
    let needs_object = matches!(request.operation.as_str(), "CREATE" | "UPDATE");
    if needs_object && request.object.as_ref().is_none_or(Value::is_null) {
        return Err(BadReview::NoObject {
            operation: request.operation,
            uid: request.uid,
        });
    }
    Ok(request)
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ResponseEnvelope<'a> {
    api_version: &'static str,
    kind: &'static str,
    response: Response<'a>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Response<'a> {
    uid: &'a str,
    allowed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    patch_type: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    patch: Option<String>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    warnings: &'a [String],
}

/// The response body: always allowed; the JSON patch (base64, as the API server expects
/// a `[]byte`) only when there is something to change.
pub fn encode(
    uid: &str,
    patch: &json_patch::Patch,
    warnings: &[String],
) -> Result<Vec<u8>, serde_json::Error> {
    let patch = if patch.0.is_empty() {
        None
    } else {
        Some(base64::engine::general_purpose::STANDARD.encode(serde_json::to_vec(patch)?))
    };
    serde_json::to_vec(&ResponseEnvelope {
        api_version: API_VERSION,
        kind: KIND,
        response: Response {
            uid,
            allowed: true,
            patch_type: patch.is_some().then_some("JSONPatch"),
            patch,
            warnings,
        },
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn review(request: Value) -> Vec<u8> {
        serde_json::to_vec(&json!({"apiVersion": API_VERSION, "kind": KIND, "request": request}))
            .unwrap()
    }

    #[test]
    fn decodes_a_pod_create() {
        let body = review(json!({
            "uid": "u1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "ns", "operation": "CREATE", "userInfo": {"username": "me"},
            "object": {"metadata": {"generateName": "web-"}, "spec": {"containers": []}},
            "oldObject": null, "dryRun": false,
        }));
        let request = decode(&body).unwrap();
        assert_eq!(request.uid, "u1");
        assert_eq!(request.kind.kind, "Pod");
        assert_eq!(request.operation, "CREATE");
        assert_eq!(request.object_ref(), "ns/web-");
    }

    /// Every malformed input is a named error, never a panic.
    #[test]
    fn says_what_is_wrong_with_bad_bodies() {
        let pod = json!({"metadata": {}, "spec": {}});
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("empty", b"".to_vec(), "empty body"),
            ("whitespace", b" \n".to_vec(), "empty body"),
            ("not JSON", b"{\"apiVersion\":".to_vec(), "not valid JSON"),
            ("binary", vec![0xff, 0xfe, 0x00], "not valid JSON"),
            (
                "a JSON string",
                b"\"hello\"".to_vec(),
                "not an AdmissionReview",
            ),
            ("a JSON array", b"[1,2]".to_vec(), "not an AdmissionReview"),
            (
                "request of the wrong type",
                serde_json::to_vec(&json!({"apiVersion": API_VERSION, "kind": KIND, "request": 5}))
                    .unwrap(),
                "not an AdmissionReview",
            ),
            (
                "v1beta1",
                serde_json::to_vec(
                    &json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": KIND,
                    "request": {"uid": "u", "operation": "CREATE", "object": pod}}),
                )
                .unwrap(),
                "admission.k8s.io/v1beta1\" is not supported",
            ),
            (
                "no apiVersion",
                serde_json::to_vec(&json!({"kind": KIND})).unwrap(),
                "apiVersion \"\" is not supported",
            ),
            (
                "wrong kind",
                serde_json::to_vec(&json!({"apiVersion": API_VERSION, "kind": "Pod"})).unwrap(),
                "kind \"Pod\" is not AdmissionReview",
            ),
            (
                "no request",
                serde_json::to_vec(&json!({"apiVersion": API_VERSION, "kind": KIND})).unwrap(),
                "has no request",
            ),
            (
                "no uid",
                review(json!({"operation": "CREATE", "object": pod})),
                "uid is missing",
            ),
            (
                "create without object",
                review(json!({"uid": "u", "operation": "CREATE"})),
                "CREATE request u has no object",
            ),
            (
                "update with a null object",
                review(json!({"uid": "u", "operation": "UPDATE", "object": null})),
                "UPDATE request u has no object",
            ),
        ];
        for (name, body, want) in cases {
            let err = decode(&body).unwrap_err().to_string();
            assert!(err.contains(want), "{name}: {err}");
        }
        // A DELETE carries no object (only oldObject): not an error.
        assert!(decode(&review(json!({"uid": "u", "operation": "DELETE"}))).is_ok());
    }

    #[test]
    fn encodes_allowed_with_base64_patch_and_warnings() {
        let patch: json_patch::Patch =
            serde_json::from_value(json!([{"op": "add", "path": "/spec/nodeName", "value": "n"}]))
                .unwrap();
        let body = encode("u1", &patch, &["careful".to_owned()]).unwrap();
        let value: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["apiVersion"], API_VERSION);
        assert_eq!(value["kind"], KIND);
        assert_eq!(value["response"]["uid"], "u1");
        assert_eq!(value["response"]["allowed"], true);
        assert_eq!(value["response"]["patchType"], "JSONPatch");
        assert_eq!(value["response"]["warnings"], json!(["careful"]));
        let raw = base64::engine::general_purpose::STANDARD
            .decode(value["response"]["patch"].as_str().unwrap())
            .unwrap();
        assert_eq!(
            serde_json::from_slice::<Value>(&raw).unwrap(),
            json!([{"op": "add", "path": "/spec/nodeName", "value": "n"}])
        );

        let body = encode("u2", &json_patch::Patch(vec![]), &[]).unwrap();
        let value: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            value,
            json!({"apiVersion": API_VERSION, "kind": KIND, "response": {"uid": "u2", "allowed": true}})
        );
    }
}
