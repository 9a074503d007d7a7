//! Before a pod is created below, what it references must exist there: its Namespace and
//! the ConfigMaps, Secrets, PVCs and ServiceAccount it names. Each is created from its
//! upper original only when missing; an existing lower object (ours or not) is used as it
//! is and never overwritten. Under namespace remapping, the lower namespace itself is used
//! only when the mapping may choose it ([`crate::translate::namespace::admit`]), so a pod
//! never meets the ServiceAccounts and Secrets of a namespace that is not this upper
//! cluster's.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::time::{Duration, Instant};

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{
    ConfigMap, Namespace, PersistentVolumeClaim, Pod, Secret, ServiceAccount,
};
use k8s_openapi::api::node::v1::RuntimeClass;
use kube::Resource;
use kube::api::{Api, PostParams};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Context, Error, api_error};
use crate::api::is_status;
use crate::lower_view::NamespaceView;
use crate::side::Side;
use crate::translate::TranslateError;
use crate::translate::config::stamped_copy;
use crate::translate::deps::{
    Dependency, DependencyKind, lower_namespace, lower_pvc, lower_runtime_class,
    lower_service_account, pod_dependencies, runtime_class_name,
};
use crate::translate::meta::{OWNER_NODE_LABEL, Owner};
use crate::translate::namespace::Below;

/// Ensures everything `pod` needs exists in the lower cluster. Fails naming every missing
/// upper object at once.
pub async fn ensure_for_pod(ctx: &Context, pod: &Pod, pod_key: &str) -> Result<(), Error> {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    // Before any copy is made, so the clean-up of unreferenced copies never misses them.
    ctx.references.record(pod, ctx.with_service_account);
    ensure_namespace(ctx, namespace).await?;
    ensure_runtime_class(ctx, pod, pod_key).await?;
    let mut missing = Vec::new();
    for dependency in pod_dependencies(pod, ctx.with_service_account) {
        let found = match dependency.kind {
            DependencyKind::ConfigMap => {
                ensure::<ConfigMap>(ctx, namespace, &dependency, stamped_copy).await?
            }
            DependencyKind::Secret => {
                ensure::<Secret>(ctx, namespace, &dependency, stamped_copy).await?
            }
            DependencyKind::PersistentVolumeClaim => {
                ensure::<PersistentVolumeClaim>(ctx, namespace, &dependency, lower_pvc).await?
            }
            DependencyKind::ServiceAccount => {
                ensure::<ServiceAccount>(ctx, namespace, &dependency, lower_service_account).await?
            }
        };
        if !found && !dependency.optional {
            missing.push(format!(
                "{} {namespace}/{}",
                kind_name(dependency.kind),
                dependency.name
            ));
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(Error::MissingDependencies {
            pod: pod_key.to_owned(),
            missing: missing.join(", "),
        })
    }
}

/// Creates the lower namespace when missing; a namespace tensile creates is then given a
/// moment for the lower controller-manager to add its `default` ServiceAccount, which pod
/// admission needs. Under `--lower-namespace` other than `same`, an existing lower namespace
/// is used only if the mapping may choose it as it is now ([`admitted`]): between the
/// mapping and the pod, another upper cluster may have made it, or a user.
pub(crate) async fn ensure_namespace(ctx: &Context, namespace: &str) -> Result<(), Error> {
    let cache_key = format!("Namespace/{namespace}");
    if ctx.known_present.contains(&cache_key) {
        return Ok(());
    }
    let namespaces: Api<Namespace> = Api::all(ctx.lower.clone());
    let existing = namespaces
        .get_metadata_opt(namespace)
        .await
        .map_err(api_error(Side::Lower, "reading", "Namespace", namespace))?;
    if let (Some(existing), Some(view)) = (&existing, &ctx.namespaces) {
        admitted(
            view,
            namespace,
            &ctx.owner,
            existing.metadata.labels.as_ref(),
        )?;
    }
    if existing.is_none() {
        match namespaces
            .create(
                &PostParams::default(),
                &lower_namespace(namespace, &ctx.owner),
            )
            .await
        {
            Ok(_) => {
                tracing::info!(object = %namespace, kind = "Namespace", cluster = "lower", "created namespace")
            }
            Err(e) if is_status(&e, 409) => {}
            Err(e) => {
                return Err(api_error(Side::Lower, "creating", "Namespace", namespace)(
                    e,
                ));
            }
        }
        let accounts: Api<ServiceAccount> = Api::namespaced(ctx.lower.clone(), namespace);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(accounts.get_metadata_opt("default").await, Ok(Some(_))) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    ctx.known_present.insert(cache_key);
    Ok(())
}

/// Whether the upper namespace `namespace` may use its lower namespace (in `view`), which
/// exists with `labels`.
fn admitted(
    view: &NamespaceView,
    namespace: &str,
    owner: &Owner,
    labels: Option<&BTreeMap<String, String>>,
) -> Result<(), Error> {
    let mapping = view.read();
    let Some(lower) = mapping.to_lower(namespace) else {
        // Read through the view already: not reached.
        return Ok(());
    };
    mapping
        .admit(namespace, &lower, &Below::of(labels, &owner.cluster))
        .map_err(|refused| Error::NamespaceRefused {
            reason: refused.reason,
            note: refused.note,
        })
}

/// Makes sure the lower copy of one dependency exists. `Ok(false)`: the upper original
/// does not exist either.
pub(crate) async fn ensure<K>(
    ctx: &Context,
    namespace: &str,
    dependency: &Dependency,
    translate: fn(&K, &Owner) -> Result<K, TranslateError>,
) -> Result<bool, Error>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Clone
        + Debug
        + Serialize
        + DeserializeOwned,
{
    let kind = kind_name(dependency.kind);
    let key = format!("{namespace}/{}", dependency.name);
    let cache_key = format!("{kind}/{key}");
    if ctx.known_present.contains(&cache_key) {
        return Ok(true);
    }
    let lower: Api<K> = Api::namespaced(ctx.lower.clone(), namespace);
    if let Some(existing) = lower
        .get_metadata_opt(&dependency.name)
        .await
        .map_err(api_error(Side::Lower, "reading", kind, &key))?
    {
        if !made_by_tensile(&existing.metadata) {
            warn_not_ours(ctx, kind, namespace, &dependency.name).await;
        }
        ctx.known_present.insert(cache_key);
        return Ok(true);
    }
    let upper: Api<K> = Api::namespaced(ctx.upper.clone(), namespace);
    let Some(original) = upper.get_opt(&dependency.name).await.map_err(api_error(
        Side::Upper,
        "reading",
        kind,
        &key,
    ))?
    else {
        return Ok(false);
    };
    let copy = translate(&original, &ctx.owner)?;
    match lower.create(&PostParams::default(), &copy).await {
        Ok(_) => {
            tracing::info!(object = %key, kind, cluster = "lower", "created dependency");
        }
        Err(e) if is_status(&e, 409) => {}
        Err(e) => return Err(api_error(Side::Lower, "creating", kind, &key)(e)),
    }
    ctx.known_present.insert(cache_key);
    Ok(true)
}

/// Makes sure the RuntimeClass `pod` names exists below (the lower admission refuses the
/// pod otherwise): one the lower cluster has is used as it is, never overwritten; a missing
/// one is copied from the upper one ([`lower_runtime_class`]). Failing, the pod is not
/// created and its Warning Event names the RuntimeClass.
async fn ensure_runtime_class(ctx: &Context, pod: &Pod, pod_key: &str) -> Result<(), Error> {
    let Some(name) = runtime_class_name(pod) else {
        return Ok(());
    };
    let cache_key = format!("RuntimeClass/{name}");
    if ctx.known_present.contains(&cache_key) {
        return Ok(());
    }
    let lower: Api<RuntimeClass> = Api::all(ctx.lower.clone());
    let exists = lower
        .get_metadata_opt(name)
        .await
        .map_err(api_error(Side::Lower, "reading", "RuntimeClass", name))?
        .is_some();
    if !exists {
        let upper: Api<RuntimeClass> = Api::all(ctx.upper.clone());
        let Some(original) = upper.get_opt(name).await.map_err(api_error(
            Side::Upper,
            "reading",
            "RuntimeClass",
            name,
        ))?
        else {
            return Err(Error::MissingDependencies {
                pod: pod_key.to_owned(),
                missing: format!("RuntimeClass {name}"),
            });
        };
        let copy = lower_runtime_class(&original, &ctx.owner)?;
        match lower.create(&PostParams::default(), &copy).await {
            Ok(_) => {
                tracing::info!(object = %name, kind = "RuntimeClass", cluster = "lower", "created the RuntimeClass a pod names")
            }
            Err(e) if is_status(&e, 409) => {}
            Err(e) => {
                return Err(api_error(Side::Lower, "creating", "RuntimeClass", name)(e));
            }
        }
    }
    ctx.known_present.insert(cache_key);
    Ok(())
}

/// Whether a lower object carries a virtual node's owner mark (this node's, or another
/// node's sharing the lower cluster, which keeps it in step itself).
fn made_by_tensile(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> bool {
    meta.labels
        .as_ref()
        .is_some_and(|labels| labels.contains_key(OWNER_NODE_LABEL))
}

/// A pod's dependency exists below and was not made by tensile: it is used as it is, never
/// updated nor deleted; the user hears of it (the lower cluster's own CA bundle aside).
async fn warn_not_ours(ctx: &Context, kind: &'static str, namespace: &str, name: &str) {
    if kind == "ConfigMap" && name == "kube-root-ca.crt" {
        return;
    }
    let note = format!(
        "lower cluster: {kind} {namespace}/{name} exists and was not created by tensile; \
         pods use it as it is and it is not kept in step with the upper {kind}"
    );
    tracing::warn!(object = %format!("{namespace}/{name}"), kind, cluster = "lower",
        "a dependency exists below and was not created by tensile; leaving it alone");
    let reference = k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some("v1".into()),
        kind: Some(kind.into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        ..Default::default()
    };
    ctx.warn_on_ref(&reference, "LowerObjectNotOurs", note)
        .await;
}

fn kind_name(kind: DependencyKind) -> &'static str {
    match kind {
        DependencyKind::ConfigMap => "ConfigMap",
        DependencyKind::Secret => "Secret",
        DependencyKind::PersistentVolumeClaim => "PersistentVolumeClaim",
        DependencyKind::ServiceAccount => "ServiceAccount",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::translate::meta::UPPER_CLUSTER_LABEL;
    use crate::translate::namespace::{Mapping, Mode};

    /// When a pod is made below, its lower namespace is checked again as it is then:
    /// another upper cluster or a user may have made it after the mapping was chosen.
    #[test]
    fn a_pods_lower_namespace_is_admitted_as_it_is_now() {
        let owner = Owner::new("vk", "c1");
        let mut mapping = Mapping::new(Mode::Prefixed, "c1".into());
        mapping.set("shop", "shop-c1").unwrap();
        mapping.set("team", "chosen").unwrap();
        let view = NamespaceView::new(mapping);
        let marked = |cluster: &str| BTreeMap::from([(UPPER_CLUSTER_LABEL.into(), cluster.into())]);
        let unmarked = BTreeMap::new();
        // (upper namespace, the lower namespace's labels, refused with)
        let cases = [
            ("shop", &marked("c1"), None),
            ("shop", &unmarked, None),
            ("shop", &marked("c2"), Some("LowerNamespaceNotOurs")),
            ("team", &marked("c1"), None),
            ("team", &unmarked, Some("LowerNamespaceNotOurs")),
            ("team", &marked("c2"), Some("LowerNamespaceNotOurs")),
        ];
        for (namespace, labels, want) in cases {
            let got = admitted(&view, namespace, &owner, Some(labels));
            let reason = match &got {
                Err(Error::NamespaceRefused { reason, .. }) => Some(*reason),
                Err(other) => panic!("{other}"),
                Ok(()) => None,
            };
            assert_eq!(reason, want, "{namespace} {labels:?}: {got:?}");
        }
    }
}
