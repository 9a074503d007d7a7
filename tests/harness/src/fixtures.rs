//! Objects tests and benchmarks create, built fluently from JSON.

use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use serde_json::{Value, json};

/// The toleration that lets a pod onto a virtual node (its default taint).
pub fn virtual_node_toleration() -> Value {
    json!({"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"})
}

/// A pod spec that the upper scheduler places on the virtual node `node` only:
/// nodeSelector `type: virtual-kubelet` plus the node's hostname (tests share an upper
/// cluster with other virtual nodes), and the toleration.
pub fn pinned_spec(node: &str) -> Value {
    json!({
        "nodeSelector": {"type": "virtual-kubelet", "kubernetes.io/hostname": node},
        "tolerations": [virtual_node_toleration()],
        "containers": [{"name": "app", "image": "nginx"}],
    })
}

/// Merges `patch` into `base` (objects recursively; anything else replaced).
pub fn merge(base: &mut Value, patch: Value) {
    match (base, patch) {
        (Value::Object(base), Value::Object(patch)) => {
            for (k, v) in patch {
                merge(base.entry(k).or_insert(Value::Null), v);
            }
        }
        (base, patch) => *base = patch,
    }
}

/// A Deployment of `replicas` pods labelled `app: <name>` with `spec` as pod spec.
pub fn deployment(name: &str, replicas: i32, spec: Value) -> Deployment {
    from(json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": spec},
        },
    }))
}

/// The same Deployment with `key: value` added to its pod template's labels (e.g.
/// `virtual-pod: "true"`, which the webhook and descheduler look for).
pub fn with_template_label(mut deployment: Deployment, key: &str, value: &str) -> Deployment {
    if let Some(metadata) = deployment
        .spec
        .as_mut()
        .and_then(|spec| spec.template.metadata.as_mut())
    {
        metadata
            .labels
            .get_or_insert_default()
            .insert(key.into(), value.into());
    }
    deployment
}

/// A bare pod.
pub fn pod(name: &str, spec: Value) -> Pod {
    from(json!({"metadata": {"name": name, "labels": {"app": name}}, "spec": spec}))
}

/// A pod bound straight to `node` (no scheduler), as a kubelet would receive it.
pub fn bound_pod(name: &str, node: &str) -> Pod {
    let mut spec = pinned_spec(node);
    merge(&mut spec, json!({"nodeName": node}));
    pod(name, spec)
}

/// A ConfigMap with `data`.
pub fn config_map(name: &str, data: Value) -> ConfigMap {
    from(json!({"metadata": {"name": name}, "data": data}))
}

/// An Opaque Secret with `string_data`.
pub fn secret(name: &str, string_data: Value) -> Secret {
    from(json!({"metadata": {"name": name}, "type": "Opaque", "stringData": string_data}))
}

/// Deserializes a fixture; fixtures are written by hand, so a bad one is a bug in the test.
fn from<T: serde::de::DeserializeOwned>(value: Value) -> T {
    match serde_json::from_value(value) {
        Ok(object) => object,
        Err(error) => panic!("invalid fixture: {error}"),
    }
}

/// The MutatingWebhookConfiguration `deploy/webhook` ships (pods labelled
/// `virtual-pod=true`, on create and update, failing closed; every DaemonSet, on create and
/// update, failing open), named `name`, pointed at `url` with `ca_bundle`, for the
/// namespaces `namespace_selector` selects.
pub fn webhook_configuration(
    name: &str,
    url: &str,
    ca_bundle: &str,
    namespace_selector: Value,
) -> MutatingWebhookConfiguration {
    from(json!({
        "metadata": {"name": name},
        "webhooks": [{
            "name": "tensile-webhook.tensile.dev",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "timeoutSeconds": 5,
            // Fail, as shipped: a pod that skipped the webhook must not look untouched.
            "failurePolicy": "Fail",
            "clientConfig": {"url": url, "caBundle": ca_bundle},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                       "resources": ["pods"], "scope": "Namespaced"}],
            "objectSelector": {"matchLabels": {"virtual-pod": "true"}},
            "namespaceSelector": namespace_selector,
        }, {
            "name": "daemonsets.tensile-webhook.tensile.dev",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "timeoutSeconds": 5,
            // Ignore, as shipped: every DaemonSet passes here, none must be blocked.
            "failurePolicy": "Ignore",
            "clientConfig": {"url": url, "caBundle": ca_bundle},
            "rules": [{"apiGroups": ["apps"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                       "resources": ["daemonsets"], "scope": "Namespaced"}],
            "namespaceSelector": namespace_selector,
        }],
    }))
}

/// Every namespace but kube-system, as `deploy/webhook` selects them.
pub fn all_but_kube_system() -> Value {
    json!({"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]}]})
}
