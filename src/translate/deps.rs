//! What a pod needs in the lower cluster before it can start there, and the lower copies
//! of those objects.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    ConfigMap, Namespace, PersistentVolumeClaim, Pod, Secret, ServiceAccount, Volume,
};
use k8s_openapi::api::node::v1::RuntimeClass;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::meta::{
    GLOBAL_ANNOTATION, LABEL_SELECTOR_ANNOTATION, Owner, SELECTED_NODE_ANNOTATION,
    UPPER_UID_ANNOTATION,
};
use super::pod::{DEFAULT_SERVICE_ACCOUNT, injected_token_volumes, service_account_name};
use super::{TranslateError, copy_meta, object_ref};

/// Secret type of the legacy, controller-minted service-account tokens.
const SERVICE_ACCOUNT_TOKEN_TYPE: &str = "kubernetes.io/service-account-token";
/// PVC annotations that record the upper cluster's binding and provisioning; the lower
/// cluster's controllers write their own.
const PVC_BINDING_ANNOTATIONS: [&str; 3] = [
    SELECTED_NODE_ANNOTATION,
    "volume.beta.kubernetes.io/storage-provisioner",
    "volume.kubernetes.io/storage-provisioner",
];
/// Prefix of the PV controller's PVC annotations (`pv.kubernetes.io/bind-completed`, …).
const PV_CONTROLLER_ANNOTATION_PREFIX: &str = "pv.kubernetes.io/";

/// The kinds of namespaced object a pod can reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DependencyKind {
    /// Referenced by volumes, projected sources, env and envFrom.
    ConfigMap,
    /// Referenced by volumes, projected sources, env, envFrom, imagePullSecrets and the
    /// secret references of volume plugins.
    Secret,
    /// Referenced by `persistentVolumeClaim` volumes.
    PersistentVolumeClaim,
    /// The pod's `serviceAccountName`.
    ServiceAccount,
}

/// One object a pod references, in the pod's namespace.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Dependency {
    /// What kind of object.
    pub kind: DependencyKind,
    /// Its name.
    pub name: String,
    /// The pod starts without it (every reference to it is marked optional).
    pub optional: bool,
}

/// Everything `pod` references that must exist below before the pod is created there,
/// sorted and with one entry per object. The upper cluster's token volume is left out: it
/// is not mirrored (see [`injected_token_volumes`]).
pub fn pod_dependencies(pod: &Pod, with_service_account: bool) -> Vec<Dependency> {
    let mut found = BTreeMap::<(DependencyKind, String), bool>::new();
    let mut add = |kind: DependencyKind, name: &str, optional: Option<bool>| {
        if name.is_empty() {
            return;
        }
        let optional = optional.unwrap_or(false);
        found
            .entry((kind, name.to_owned()))
            .and_modify(|all_optional| *all_optional &= optional)
            .or_insert(optional);
    };
    let Some(spec) = pod.spec.as_ref() else {
        return Vec::new();
    };

    let dropped = injected_token_volumes(spec);
    for volume in spec.volumes.iter().flatten() {
        if !dropped.contains(volume.name.as_str()) {
            volume_dependencies(volume, &mut add);
        }
    }

    let containers = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten());
    for container in containers {
        for env in container.env.iter().flatten() {
            let Some(source) = env.value_from.as_ref() else {
                continue;
            };
            if let Some(r) = source.config_map_key_ref.as_ref() {
                add(DependencyKind::ConfigMap, &r.name, r.optional);
            }
            if let Some(r) = source.secret_key_ref.as_ref() {
                add(DependencyKind::Secret, &r.name, r.optional);
            }
        }
        for env_from in container.env_from.iter().flatten() {
            if let Some(r) = env_from.config_map_ref.as_ref() {
                add(DependencyKind::ConfigMap, &r.name, r.optional);
            }
            if let Some(r) = env_from.secret_ref.as_ref() {
                add(DependencyKind::Secret, &r.name, r.optional);
            }
        }
    }

    // The kubelet pulls without a missing pull secret rather than refusing the pod.
    for secret in spec.image_pull_secrets.iter().flatten() {
        add(DependencyKind::Secret, &secret.name, Some(true));
    }

    if with_service_account {
        let service_account = service_account_name(spec);
        if service_account != DEFAULT_SERVICE_ACCOUNT {
            add(DependencyKind::ServiceAccount, service_account, None);
        }
    }

    found
        .into_iter()
        .map(|((kind, name), optional)| Dependency {
            kind,
            name,
            optional,
        })
        .collect()
}

/// The objects one volume references.
fn volume_dependencies(volume: &Volume, add: &mut impl FnMut(DependencyKind, &str, Option<bool>)) {
    use DependencyKind::{ConfigMap, PersistentVolumeClaim, Secret};
    if let Some(v) = volume.config_map.as_ref() {
        add(ConfigMap, &v.name, v.optional);
    }
    if let Some(v) = volume.secret.as_ref() {
        add(
            Secret,
            v.secret_name.as_deref().unwrap_or_default(),
            v.optional,
        );
    }
    if let Some(v) = volume.persistent_volume_claim.as_ref() {
        add(PersistentVolumeClaim, &v.claim_name, None);
    }
    for source in volume
        .projected
        .iter()
        .flat_map(|p| p.sources.iter().flatten())
    {
        if let Some(s) = source.config_map.as_ref() {
            add(ConfigMap, &s.name, s.optional);
        }
        if let Some(s) = source.secret.as_ref() {
            add(Secret, &s.name, s.optional);
        }
    }
    // Volume plugins that read their credentials from a Secret in the pod's namespace.
    let plugin_secrets = [
        volume
            .csi
            .as_ref()
            .and_then(|v| v.node_publish_secret_ref.as_ref()),
        volume.cephfs.as_ref().and_then(|v| v.secret_ref.as_ref()),
        volume.cinder.as_ref().and_then(|v| v.secret_ref.as_ref()),
        volume
            .flex_volume
            .as_ref()
            .and_then(|v| v.secret_ref.as_ref()),
        volume.iscsi.as_ref().and_then(|v| v.secret_ref.as_ref()),
        volume.rbd.as_ref().and_then(|v| v.secret_ref.as_ref()),
        volume.scale_io.as_ref().map(|v| &v.secret_ref),
        volume
            .storageos
            .as_ref()
            .and_then(|v| v.secret_ref.as_ref()),
    ];
    for secret in plugin_secrets.into_iter().flatten() {
        add(Secret, &secret.name, None);
    }
    if let Some(v) = volume.azure_file.as_ref() {
        add(Secret, &v.secret_name, None);
    }
}

/// The lower copy of a ConfigMap.
pub fn lower_config_map(upper: &ConfigMap, owner: &Owner) -> Result<ConfigMap, TranslateError> {
    Ok(ConfigMap {
        metadata: copy_meta("ConfigMap", &upper.metadata, owner)?,
        data: upper.data.clone(),
        binary_data: upper.binary_data.clone(),
        immutable: upper.immutable,
    })
}

/// Whether `secret` is a legacy service-account token: minted by, and valid only in, the
/// upper cluster.
pub fn is_service_account_token_secret(secret: &Secret) -> bool {
    secret.type_.as_deref() == Some(SERVICE_ACCOUNT_TOKEN_TYPE)
}

/// The lower copy of a Secret; service-account tokens are refused (never mirrored).
pub fn lower_secret(upper: &Secret, owner: &Owner) -> Result<Secret, TranslateError> {
    if is_service_account_token_secret(upper) {
        return Err(TranslateError::NotMirrored {
            kind: "Secret",
            object: object_ref(&upper.metadata),
            reason: "service-account tokens of the upper cluster are not valid below",
        });
    }
    Ok(Secret {
        metadata: copy_meta("Secret", &upper.metadata, owner)?,
        data: upper.data.clone(),
        string_data: upper.string_data.clone(),
        type_: upper.type_.clone(),
        immutable: upper.immutable,
    })
}

/// The lower copy of a ServiceAccount, without its token secrets (those are the upper
/// cluster's; the lower one issues its own tokens).
pub fn lower_service_account(
    upper: &ServiceAccount,
    owner: &Owner,
) -> Result<ServiceAccount, TranslateError> {
    Ok(ServiceAccount {
        metadata: copy_meta("ServiceAccount", &upper.metadata, owner)?,
        automount_service_account_token: upper.automount_service_account_token,
        image_pull_secrets: upper.image_pull_secrets.clone(),
        secrets: None,
    })
}

/// The lower copy of a PersistentVolumeClaim, unbound: the lower cluster binds or
/// provisions its own volume. A selector names upper PVs, so it moves to the
/// `labelSelector` annotation.
pub fn lower_pvc(
    upper: &PersistentVolumeClaim,
    owner: &Owner,
) -> Result<PersistentVolumeClaim, TranslateError> {
    let mut metadata = copy_meta("PersistentVolumeClaim", &upper.metadata, owner)?;
    let annotations = metadata.annotations.get_or_insert_default();
    annotations.retain(|key, _| {
        !PVC_BINDING_ANNOTATIONS.contains(&key.as_str())
            && !key.starts_with(PV_CONTROLLER_ANNOTATION_PREFIX)
    });
    let mut spec = upper.spec.clone();
    if let Some(spec) = spec.as_mut() {
        spec.volume_name = None;
        if let Some(selector) = spec.selector.take() {
            let encoded =
                serde_json::to_string(&selector).map_err(|source| TranslateError::Encode {
                    object: format!("PersistentVolumeClaim {}", object_ref(&upper.metadata)),
                    what: "spec.selector",
                    source,
                })?;
            annotations.insert(LABEL_SELECTOR_ANNOTATION.to_owned(), encoded);
        }
    }
    Ok(PersistentVolumeClaim {
        metadata,
        spec,
        status: None,
    })
}

/// The lower namespace a mirrored object lives in. It has no single upper origin, so it
/// carries the owner mark but no upper UID.
pub fn lower_namespace(name: &str, owner: &Owner) -> Namespace {
    let mut labels = BTreeMap::new();
    owner.mark(&mut labels);
    Namespace {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(labels),
            annotations: Some(BTreeMap::from([(
                GLOBAL_ANNOTATION.to_owned(),
                "true".to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    }
}

/// The RuntimeClass `pod` names (`spec.runtimeClassName`), if any.
pub fn runtime_class_name(pod: &Pod) -> Option<&str> {
    pod.spec
        .as_ref()
        .and_then(|s| s.runtime_class_name.as_deref())
        .filter(|name| !name.is_empty())
}

/// The lower copy of a RuntimeClass a pod names, made when the lower cluster has none of
/// that name (one it has is used as it is): handler, overhead and scheduling as upstairs,
/// marked as tensile's (owner labels, the upper UID, `global`). Cluster-scoped, so built
/// here rather than by [`copy_meta`].
pub fn lower_runtime_class(
    upper: &RuntimeClass,
    owner: &Owner,
) -> Result<RuntimeClass, TranslateError> {
    let missing = |field| TranslateError::MissingField {
        kind: "RuntimeClass",
        object: object_ref(&upper.metadata),
        field,
    };
    let name = upper
        .metadata
        .name
        .clone()
        .ok_or_else(|| missing("metadata.name"))?;
    let uid = upper
        .metadata
        .uid
        .clone()
        .ok_or_else(|| missing("metadata.uid"))?;
    let mut labels = upper.metadata.labels.clone().unwrap_or_default();
    owner.mark(&mut labels);
    let mut annotations = upper.metadata.annotations.clone().unwrap_or_default();
    annotations.insert(UPPER_UID_ANNOTATION.to_owned(), uid);
    annotations.insert(GLOBAL_ANNOTATION.to_owned(), "true".to_owned());
    Ok(RuntimeClass {
        metadata: ObjectMeta {
            name: Some(name),
            labels: Some(labels),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        handler: upper.handler.clone(),
        overhead: upper.overhead.clone(),
        scheduling: upper.scheduling.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::translate::meta::{OWNER_NODE_LABEL, UPPER_CLUSTER_LABEL};
    use serde_json::{Value, json};

    const NODE: &str = "vk-node";
    const CLUSTER: &str = "cluster-1";

    fn owner() -> Owner {
        Owner::new(NODE, CLUSTER)
    }

    fn from<T: serde::de::DeserializeOwned>(value: Value) -> T {
        serde_json::from_value(value).unwrap()
    }

    fn dep(kind: DependencyKind, name: &str, optional: bool) -> Dependency {
        Dependency {
            kind,
            name: name.to_owned(),
            optional,
        }
    }

    fn pod_with(spec: Value) -> Pod {
        from(json!({"metadata": {"name": "p", "namespace": "ns", "uid": "u"}, "spec": spec}))
    }

    #[test]
    fn finds_every_kind_of_reference() {
        use DependencyKind::{ConfigMap, PersistentVolumeClaim, Secret, ServiceAccount};
        let spec = json!({
            "serviceAccountName": "web",
            "imagePullSecrets": [{"name": "registry"}],
            "initContainers": [{"name": "init", "envFrom": [{"secretRef": {"name": "init-env"}}]}],
            "containers": [{
                "name": "app",
                "env": [
                    {"name": "A", "valueFrom": {"configMapKeyRef": {"name": "env-cm", "key": "a"}}},
                    {"name": "B", "valueFrom": {"secretKeyRef": {"name": "env-secret", "key": "b", "optional": true}}},
                    {"name": "C", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "D", "value": "plain"},
                ],
                "envFrom": [{"configMapRef": {"name": "envfrom-cm", "optional": true}, "prefix": "X_"}],
            }],
            "volumes": [
                {"name": "kube-api-access-abcde", "projected": {"sources": [
                    {"serviceAccountToken": {"path": "token"}},
                    {"configMap": {"name": "kube-root-ca.crt"}},
                ]}},
                {"name": "cm", "configMap": {"name": "vol-cm"}},
                {"name": "sec", "secret": {"secretName": "vol-secret", "optional": false}},
                {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
                {"name": "bundle", "projected": {"sources": [
                    {"configMap": {"name": "proj-cm", "optional": true}},
                    {"secret": {"name": "proj-secret"}},
                    {"downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}},
                ]}},
                {"name": "csi", "csi": {"driver": "secrets-store.csi.k8s.io", "nodePublishSecretRef": {"name": "csi-creds"}}},
                {"name": "scratch", "emptyDir": {}},
                {"name": "eph", "ephemeral": {"volumeClaimTemplate": {"spec": {"accessModes": ["ReadWriteOnce"]}}}},
            ],
        });
        let want = vec![
            dep(ConfigMap, "env-cm", false),
            dep(ConfigMap, "envfrom-cm", true),
            dep(ConfigMap, "proj-cm", true),
            dep(ConfigMap, "vol-cm", false),
            dep(Secret, "csi-creds", false),
            dep(Secret, "env-secret", true),
            dep(Secret, "init-env", false),
            dep(Secret, "proj-secret", false),
            dep(Secret, "registry", true),
            dep(Secret, "vol-secret", false),
            dep(PersistentVolumeClaim, "data", false),
            dep(ServiceAccount, "web", false),
        ];
        assert_eq!(pod_dependencies(&pod_with(spec.clone()), true), want);
        let without_sa: Vec<_> = want
            .into_iter()
            .filter(|d| d.kind != ServiceAccount)
            .collect();
        assert_eq!(pod_dependencies(&pod_with(spec), false), without_sa);
    }

    #[test]
    fn dependency_cases() {
        use DependencyKind::{ConfigMap, Secret, ServiceAccount};
        let cm_volume = |name: &str, optional: Option<bool>| json!({"name": name, "configMap": {"name": "shared", "optional": optional}});
        let cm_env = |optional: Option<bool>| json!({"name": "E", "valueFrom": {"configMapKeyRef": {"name": "shared", "key": "k", "optional": optional}}});
        // (case, pod spec, with service account, expected)
        let cases: Vec<(&str, Value, bool, Vec<Dependency>)> = vec![
            (
                "no references",
                json!({"containers": [{"name": "c"}]}),
                true,
                vec![],
            ),
            (
                "default service account is never a dependency",
                json!({"serviceAccountName": "default", "containers": []}),
                true,
                vec![],
            ),
            (
                "unset service account means default",
                json!({"containers": []}),
                true,
                vec![],
            ),
            (
                "deprecated serviceAccount field",
                json!({"serviceAccount": "old", "containers": []}),
                true,
                vec![dep(ServiceAccount, "old", false)],
            ),
            (
                "optional only when every reference is optional",
                json!({"containers": [{"name": "c", "env": [cm_env(Some(true))]}],
                       "volumes": [cm_volume("a", Some(true)), cm_volume("b", None)]}),
                true,
                vec![dep(ConfigMap, "shared", false)],
            ),
            (
                "all references optional",
                json!({"containers": [{"name": "c", "env": [cm_env(Some(true))]}],
                       "volumes": [cm_volume("a", Some(true))]}),
                true,
                vec![dep(ConfigMap, "shared", true)],
            ),
            (
                "a pull secret also mounted is required",
                json!({"imagePullSecrets": [{"name": "reg"}], "containers": [],
                       "volumes": [{"name": "v", "secret": {"secretName": "reg"}}]}),
                true,
                vec![dep(Secret, "reg", false)],
            ),
            (
                "legacy token volume is skipped, the same secret referenced elsewhere is not",
                json!({"containers": [{"name": "c", "volumeMounts": [{"name": "default-token-x1", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}]}],
                       "volumes": [{"name": "default-token-x1", "secret": {"secretName": "default-token-x1"}},
                                   {"name": "copy", "secret": {"secretName": "my-token-copy"}}]}),
                true,
                vec![dep(Secret, "my-token-copy", false)],
            ),
            (
                "kube-root-ca.crt mounted by the user is a dependency",
                json!({"containers": [], "volumes": [{"name": "ca", "configMap": {"name": "kube-root-ca.crt"}}]}),
                true,
                vec![dep(ConfigMap, "kube-root-ca.crt", false)],
            ),
            (
                "volume plugin credentials",
                json!({"containers": [], "volumes": [
                    {"name": "a", "azureFile": {"secretName": "azure", "shareName": "s"}},
                    {"name": "c", "cephfs": {"monitors": ["m"], "secretRef": {"name": "ceph"}}},
                    {"name": "r", "rbd": {"monitors": ["m"], "image": "i", "secretRef": {"name": "rbd"}}},
                    {"name": "s", "scaleIO": {"gateway": "g", "system": "s", "secretRef": {"name": "scaleio"}}},
                ]}),
                true,
                vec![
                    dep(Secret, "azure", false),
                    dep(Secret, "ceph", false),
                    dep(Secret, "rbd", false),
                    dep(Secret, "scaleio", false),
                ],
            ),
        ];
        for (name, spec, with_sa, want) in cases {
            assert_eq!(pod_dependencies(&pod_with(spec), with_sa), want, "{name}");
        }
        let no_spec: Pod = from(json!({"metadata": {"name": "p"}}));
        assert_eq!(pod_dependencies(&no_spec, true), vec![]);
    }

    /// The metadata every mirrored dependency should get from `upper_meta()`.
    fn upper_meta() -> Value {
        json!({
            "name": "obj",
            "namespace": "ns",
            "uid": "upper-uid",
            "resourceVersion": "9",
            "generation": 2,
            "creationTimestamp": "2024-01-01T00:00:00Z",
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u"}],
            "finalizers": ["kubernetes.io/pvc-protection"],
            "managedFields": [{"manager": "kubectl", "operation": "Apply", "apiVersion": "v1"}],
            "labels": {"app": "web"},
            "annotations": {"note": "x"},
        })
    }

    fn lower_meta_json() -> Value {
        json!({
            "name": "obj",
            "namespace": "ns",
            "labels": {"app": "web", OWNER_NODE_LABEL: NODE, UPPER_CLUSTER_LABEL: CLUSTER},
            "annotations": {"note": "x", UPPER_UID_ANNOTATION: "upper-uid", GLOBAL_ANNOTATION: "true"},
        })
    }

    #[test]
    fn lowers_config_maps() {
        let upper: ConfigMap = from(
            json!({"metadata": upper_meta(), "data": {"a": "1"}, "binaryData": {"b": "AAE="}, "immutable": true}),
        );
        let want: ConfigMap = from(
            json!({"metadata": lower_meta_json(), "data": {"a": "1"}, "binaryData": {"b": "AAE="}, "immutable": true}),
        );
        assert_eq!(lower_config_map(&upper, &owner()).unwrap(), want);
    }

    #[test]
    fn lowers_secrets_but_never_tokens() {
        let upper: Secret =
            from(json!({"metadata": upper_meta(), "type": "Opaque", "data": {"p": "cGFzcw=="}}));
        let want: Secret = from(
            json!({"metadata": lower_meta_json(), "type": "Opaque", "data": {"p": "cGFzcw=="}}),
        );
        assert_eq!(lower_secret(&upper, &owner()).unwrap(), want);

        let token: Secret =
            from(json!({"metadata": upper_meta(), "type": "kubernetes.io/service-account-token"}));
        assert!(is_service_account_token_secret(&token));
        assert!(!is_service_account_token_secret(&upper));
        let err = lower_secret(&token, &owner()).unwrap_err();
        assert!(matches!(err, TranslateError::NotMirrored { .. }), "{err:?}");
        assert!(err.to_string().contains("ns/obj"), "{err}");
    }

    #[test]
    fn lowers_service_accounts_without_their_token_secrets() {
        let upper: ServiceAccount = from(json!({
            "metadata": upper_meta(),
            "secrets": [{"name": "obj-token-abcde"}],
            "imagePullSecrets": [{"name": "registry"}],
            "automountServiceAccountToken": false,
        }));
        let want: ServiceAccount = from(json!({
            "metadata": lower_meta_json(),
            "imagePullSecrets": [{"name": "registry"}],
            "automountServiceAccountToken": false,
        }));
        assert_eq!(lower_service_account(&upper, &owner()).unwrap(), want);
    }

    #[test]
    fn lowers_pvcs_unbound() {
        let mut meta = upper_meta();
        meta["annotations"] = json!({
            "note": "x",
            SELECTED_NODE_ANNOTATION: "vk-node",
            "volume.beta.kubernetes.io/storage-provisioner": "rancher.io/local-path",
            "volume.kubernetes.io/storage-provisioner": "rancher.io/local-path",
            "pv.kubernetes.io/bind-completed": "yes",
            "pv.kubernetes.io/bound-by-controller": "yes",
        });
        let selector = json!({"matchLabels": {"tier": "fast"}});
        let spec = json!({
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}},
            "storageClassName": "local-path",
            "volumeMode": "Filesystem",
        });
        let mut bound_spec = spec.clone();
        bound_spec["volumeName"] = json!("pvc-123");
        bound_spec["selector"] = selector.clone();
        let upper: PersistentVolumeClaim = from(json!({
            "metadata": meta,
            "spec": bound_spec,
            "status": {"phase": "Bound", "accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"}},
        }));
        let mut want_meta = lower_meta_json();
        want_meta["annotations"][LABEL_SELECTOR_ANNOTATION] = json!(selector.to_string());
        let want: PersistentVolumeClaim = from(json!({"metadata": want_meta, "spec": spec}));
        let got = lower_pvc(&upper, &owner()).unwrap();
        assert_eq!(got, want);
        let stored: Value =
            serde_json::from_str(&got.metadata.annotations.unwrap()[LABEL_SELECTOR_ANNOTATION])
                .unwrap();
        assert_eq!(stored, selector);
    }

    #[test]
    fn copies_need_the_upper_uid() {
        let mut meta = upper_meta();
        meta["uid"] = Value::Null;
        let cm: ConfigMap = from(json!({"metadata": meta}));
        match lower_config_map(&cm, &owner()) {
            Err(TranslateError::MissingField {
                kind,
                object,
                field,
            }) => {
                assert_eq!(
                    (kind, object.as_str(), field),
                    ("ConfigMap", "ns/obj", "metadata.uid")
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn lowers_namespaces() {
        let want: Namespace = from(json!({"metadata": {
            "name": "team-a",
            "labels": {OWNER_NODE_LABEL: NODE, UPPER_CLUSTER_LABEL: CLUSTER},
            "annotations": {GLOBAL_ANNOTATION: "true"},
        }}));
        assert_eq!(lower_namespace("team-a", &owner()), want);
    }

    #[test]
    fn runtime_classes_go_down_as_they_are_upstairs_marked_as_ours() {
        let upper: RuntimeClass = serde_json::from_value(json!({
            "metadata": {"name": "gvisor", "uid": "rc-uid", "resourceVersion": "7",
                         "labels": {"team": "a"}, "creationTimestamp": "2024-01-01T00:00:00Z"},
            "handler": "runsc",
            "overhead": {"podFixed": {"cpu": "250m", "memory": "64Mi"}},
            "scheduling": {"nodeSelector": {"sandbox": "true"},
                           "tolerations": [{"key": "sandbox", "operator": "Exists"}]},
        }))
        .unwrap();
        let lower = lower_runtime_class(&upper, &owner()).unwrap();
        assert_eq!(lower.handler, "runsc");
        assert_eq!(lower.overhead, upper.overhead);
        assert_eq!(lower.scheduling, upper.scheduling);
        let meta = &lower.metadata;
        assert_eq!(meta.name.as_deref(), Some("gvisor"));
        assert_eq!(meta.namespace, None, "cluster-scoped");
        assert_eq!(meta.uid, None);
        assert_eq!(meta.resource_version, None);
        assert_eq!(meta.creation_timestamp, None);
        let labels = meta.labels.as_ref().unwrap();
        assert_eq!(labels.get("team").map(String::as_str), Some("a"));
        assert_eq!(labels.get(OWNER_NODE_LABEL).map(String::as_str), Some(NODE));
        assert_eq!(
            labels.get(UPPER_CLUSTER_LABEL).map(String::as_str),
            Some(CLUSTER)
        );
        let annotations = meta.annotations.as_ref().unwrap();
        assert_eq!(
            annotations.get(UPPER_UID_ANNOTATION).map(String::as_str),
            Some("rc-uid")
        );
        assert_eq!(
            annotations.get(GLOBAL_ANNOTATION).map(String::as_str),
            Some("true")
        );

        let mut nameless = upper.clone();
        nameless.metadata.uid = None;
        assert!(matches!(
            lower_runtime_class(&nameless, &owner()),
            Err(TranslateError::MissingField {
                field: "metadata.uid",
                ..
            })
        ));

        // (case, runtimeClassName, named)
        let cases = [
            ("none", Value::Null, None),
            ("empty", json!(""), None),
            ("named", json!("gvisor"), Some("gvisor")),
        ];
        for (name, class, want) in cases {
            let pod: Pod = serde_json::from_value(json!({
                "spec": {"containers": [{"name": "c"}], "runtimeClassName": class},
            }))
            .unwrap();
            assert_eq!(runtime_class_name(&pod), want, "{name}");
        }
    }
}
