//! Ownership at start. Lower objects made by a tensile version before cluster marks (the
//! node mark only) are adopted once: given this upper cluster's mark, each only if its
//! upper origin (the upper-UID annotation) is an object of this upper cluster, so that an
//! upgrade loses nothing and never takes another upper cluster's objects. Objects that
//! carry this node's name and another upper cluster's mark are counted and left alone.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt::Debug;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{
    ConfigMap, Endpoints, PersistentVolumeClaim, Pod, Secret, Service,
};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::core::PartialObjectMeta;
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use serde_json::json;
use tracing::{info, warn};

use super::{Error, api_error};
use crate::api::is_status;
use crate::side::Side;
use crate::translate::meta::{Owner, UPPER_CLUSTER_LABEL, UPPER_UID_ANNOTATION};

/// What [`adopt`] found.
#[derive(Debug, Default, PartialEq)]
pub struct Adoption {
    /// Objects given this cluster's mark, by kind.
    pub adopted: BTreeMap<&'static str, usize>,
    /// Objects with this node's mark only whose origin is not in this upper cluster.
    pub unknown_origin: BTreeMap<&'static str, usize>,
    /// Objects with this node's name and another upper cluster's mark, by kind.
    pub foreign: BTreeMap<&'static str, usize>,
    /// The other upper clusters' marks seen.
    pub foreign_clusters: BTreeSet<String>,
}

/// Adopts this node's unclaimed lower objects and counts the foreign ones, logging one line
/// for each outcome that is not empty: pods, ConfigMap and Secret copies, and the copies of
/// the optional controllers that run (`services`, `volumes`): the kinds something acts on
/// by their marks. (ServiceAccount copies and namespaces are only ever created.)
pub async fn adopt(
    upper: &Client,
    lower: &Client,
    owner: &Owner,
    services: bool,
    volumes: bool,
) -> Result<Adoption, Error> {
    let mut found = Adoption::default();
    kind::<Pod>(upper, lower, owner, &mut found).await?;
    kind::<ConfigMap>(upper, lower, owner, &mut found).await?;
    kind::<Secret>(upper, lower, owner, &mut found).await?;
    if volumes {
        kind::<PersistentVolumeClaim>(upper, lower, owner, &mut found).await?;
    }
    if services {
        kind::<Service>(upper, lower, owner, &mut found).await?;
        kind::<EndpointSlice>(upper, lower, owner, &mut found).await?;
        kind::<Endpoints>(upper, lower, owner, &mut found).await?;
    }
    if !found.adopted.is_empty() {
        info!(cluster = "lower", node = %owner.node, adopted = ?found.adopted,
            "adopted lower objects made by an earlier tensile version for this upper cluster");
    }
    if !found.unknown_origin.is_empty() {
        info!(cluster = "lower", node = %owner.node, objects = ?found.unknown_origin,
            "lower objects with this node's mark only and no origin in this upper cluster are left alone");
    }
    if !found.foreign.is_empty() {
        warn!(
            cluster = "lower",
            node = %owner.node,
            "lower cluster: {} carry virtual node {} of another upper cluster ({}); they are not this node's and are left alone",
            describe(&found.foreign),
            owner.node,
            found
                .foreign_clusters
                .iter()
                .cloned()
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(found)
}

/// `3 Pods, 1 ConfigMap`.
fn describe(counts: &BTreeMap<&'static str, usize>) -> String {
    counts
        .iter()
        .map(|(kind, n)| format!("{n} {kind}{}", if *n == 1 { "" } else { "s" }))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether a lower object with node mark only is this upper cluster's: its origin's UID is
/// one of `upper_uids`.
pub fn is_adoptable(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    upper_uids: &HashSet<String>,
) -> bool {
    meta.annotations
        .as_ref()
        .and_then(|a| a.get(UPPER_UID_ANNOTATION))
        .is_some_and(|uid| upper_uids.contains(uid))
}

async fn kind<K>(
    upper: &Client,
    lower: &Client,
    owner: &Owner,
    found: &mut Adoption,
) -> Result<(), Error>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + Debug,
{
    let kind_name: &'static str = match K::kind(&()) {
        std::borrow::Cow::Borrowed(kind) => kind,
        std::borrow::Cow::Owned(_) => "object",
    };
    let lower_all: Api<K> = Api::all(lower.clone());
    let foreign = lower_all
        .list_metadata(&ListParams::default().labels(&owner.foreign_selector()))
        .await
        .map_err(api_error(Side::Lower, "listing", kind_name, "*"))?;
    for object in &foreign.items {
        if let Some(cluster) = object
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(UPPER_CLUSTER_LABEL))
        {
            found.foreign_clusters.insert(cluster.clone());
        }
    }
    if !foreign.items.is_empty() {
        found.foreign.insert(kind_name, foreign.items.len());
    }
    let unclaimed = lower_all
        .list_metadata(&ListParams::default().labels(&owner.unclaimed_selector()))
        .await
        .map_err(api_error(Side::Lower, "listing", kind_name, "*"))?;
    if unclaimed.items.is_empty() {
        return Ok(());
    }
    // Only when there is something to adopt (an upgrade): the UIDs of this upper cluster's
    // objects of the kind, metadata only; or, without the right to list them, each read.
    let upper_all: Api<K> = Api::all(upper.clone());
    let upper_uids: Option<HashSet<String>> =
        match upper_all.list_metadata(&ListParams::default()).await {
            Ok(list) => Some(
                list.items
                    .into_iter()
                    .filter_map(|o: PartialObjectMeta<K>| o.metadata.uid)
                    .collect(),
            ),
            Err(e) if is_status(&e, 403) => None,
            Err(e) => return Err(api_error(Side::Upper, "listing", kind_name, "*")(e)),
        };
    for object in unclaimed.items {
        let namespace = object.metadata.namespace.clone().unwrap_or_default();
        let origin_here = match &upper_uids {
            Some(uids) => is_adoptable(&object.metadata, uids),
            None => {
                let name = object.metadata.name.as_deref().unwrap_or_default();
                let key = format!("{namespace}/{name}");
                let origin = Api::<K>::namespaced(upper.clone(), &namespace)
                    .get_metadata_opt(name)
                    .await
                    .map_err(api_error(Side::Upper, "reading", kind_name, &key))?;
                let uids: HashSet<String> =
                    origin.and_then(|o| o.metadata.uid).into_iter().collect();
                is_adoptable(&object.metadata, &uids)
            }
        };
        if !origin_here {
            *found.unknown_origin.entry(kind_name).or_default() += 1;
            continue;
        }
        let (Some(name), Some(uid)) = (
            object.metadata.name.as_deref(),
            object.metadata.uid.as_deref(),
        ) else {
            continue;
        };
        let api: Api<K> = Api::namespaced(lower.clone(), &namespace);
        // The UID in the patch is a precondition: an object re-created meanwhile is not
        // marked.
        let patch =
            json!({"metadata": {"uid": uid, "labels": {UPPER_CLUSTER_LABEL: owner.cluster}}});
        match api
            .patch_metadata(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => *found.adopted.entry(kind_name).or_default() += 1,
            Err(e) if is_status(&e, 404) || is_status(&e, 409) => {}
            Err(e) => {
                return Err(api_error(
                    Side::Lower,
                    "adopting",
                    kind_name,
                    &format!("{namespace}/{name}"),
                )(e));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn adoptable_only_with_an_origin_here() {
        let uids: HashSet<String> = ["u1".to_owned()].into();
        let meta = |annotations: serde_json::Value| {
            serde_json::from_value(json!({"name": "p", "annotations": annotations})).unwrap()
        };
        let cases = [
            (json!({UPPER_UID_ANNOTATION: "u1"}), true),
            (json!({UPPER_UID_ANNOTATION: "u2"}), false),
            (json!({}), false),
        ];
        for (annotations, want) in cases {
            assert_eq!(
                is_adoptable(&meta(annotations.clone()), &uids),
                want,
                "{annotations}"
            );
        }
        assert_eq!(
            describe(&BTreeMap::from([("Pod", 3), ("ConfigMap", 1)])),
            "1 ConfigMap, 3 Pods"
        );
    }
}
