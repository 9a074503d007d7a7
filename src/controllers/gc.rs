//! Orphan collection: lower pods this node owns whose upper pod is gone (force-deleted,
//! deleted while virtual-node was down, or re-created with a new UID) are deleted — at
//! start, once both stores are synced, and every few seconds after. Reads only the two
//! stores; calls the API only to delete. A lower pod whose upper-UID mark was edited away
//! is left to the pod controller while an upper pod of its name exists: only that one
//! can tell whether it is that pod's copy (to keep) or an older one's (to replace).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::Context;
use super::pod_watch::PodStores;
use crate::api::{Deleted, delete_exact};
use crate::translate::meta::Owner;
use crate::translate::stored::StoredPod;

/// How often the stores are compared (in memory; cheap).
pub const INTERVAL: Duration = Duration::from_secs(5);

/// The lower pods to delete: owned by `owner`, not already going, whose upper counterpart
/// (same namespace/name and UID) is absent; `upper_uid` gives the UID of the upper pod of
/// a namespace and name. Pure over the two snapshots.
pub fn orphans<'a, U: AsRef<str>>(
    lower: &'a [Arc<StoredPod>],
    upper_uid: impl Fn(&str, &str) -> Option<U>,
    owner: &Owner,
    namespace: &str,
) -> Vec<&'a StoredPod> {
    lower
        .iter()
        .map(AsRef::as_ref)
        .filter(|p| p.is_owned_by(owner))
        .filter(|p| p.meta.deletion_timestamp.is_none())
        .filter(|p| namespace.is_empty() || *p.meta.namespace == *namespace)
        .filter(
            |p| match (p.upper_uid(), upper_uid(&p.meta.namespace, &p.meta.name)) {
                (_, None) => true,
                (Some(mark), Some(uid)) => mark != uid.as_ref(),
                (None, Some(_)) => false,
            },
        )
        .collect()
}

/// Runs until `shutdown`, starting once both stores are synced.
pub async fn run(ctx: Arc<Context>, pods: PodStores, shutdown: CancellationToken) {
    let PodStores {
        upper: upper_pods,
        lower: lower_pods,
        synced,
    } = pods;
    tokio::select! {
        () = shutdown.cancelled() => return,
        synced = synced.wait() => if synced.is_err() { return },
    }
    let mut tick = tokio::time::interval(INTERVAL);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let snapshot = lower_pods.state();
        let upper_uid =
            |ns: &str, name: &str| upper_pods.get(ns, name).and_then(|p| p.meta.uid.clone());
        for orphan in orphans(&snapshot, upper_uid, &ctx.owner, &ctx.namespace) {
            let key = orphan.meta.key();
            let api: Api<Pod> = Api::namespaced(ctx.lower.clone(), &orphan.meta.namespace);
            let uid = orphan.meta.uid.as_deref().map(str::to_owned);
            match delete_exact(&api, &orphan.meta.name, uid, None).await {
                Ok(Deleted::Now) => {
                    ctx.metrics.orphans_deleted.inc();
                    info!(object = %key, kind = "Pod", cluster = "lower", "deleted an orphaned lower pod (its upper pod is gone)");
                }
                Ok(Deleted::AlreadyGone) => {}
                Err(error) => {
                    warn!(object = %key, kind = "Pod", cluster = "lower", %error, "deleting an orphaned pod")
                }
            }
        }
        ctx.metrics.gc_rounds.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::translate::meta::{OWNER_NODE_LABEL, UPPER_CLUSTER_LABEL, UPPER_UID_ANNOTATION};
    use serde_json::json;

    fn lower(
        name: &str,
        ns: &str,
        owner: &str,
        uid: Option<&str>,
        deleting: bool,
    ) -> Arc<StoredPod> {
        // `node@cluster`, or `node` of cluster c1.
        let (node, cluster) = owner.split_once('@').unwrap_or((owner, "c1"));
        let mut meta = json!({"name": name, "namespace": ns,
            "labels": {OWNER_NODE_LABEL: node, UPPER_CLUSTER_LABEL: cluster}});
        if let Some(uid) = uid {
            meta["annotations"] = json!({UPPER_UID_ANNOTATION: uid});
        }
        if deleting {
            meta["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        }
        Arc::new(serde_json::from_value(json!({"metadata": meta})).unwrap())
    }

    #[test]
    fn orphan_table() {
        let upper = [("ns", "a", "u-a"), ("other", "c", "u-c")];
        let upper_uid = |ns: &str, name: &str| {
            upper
                .iter()
                .find(|(n, m, _)| (*n, *m) == (ns, name))
                .map(|(_, _, uid)| *uid)
        };
        let cases: Vec<(&str, Arc<StoredPod>, &str, bool)> = vec![
            (
                "upper exists: kept",
                lower("a", "ns", "vk", Some("u-a"), false),
                "",
                false,
            ),
            (
                "upper gone: orphan",
                lower("b", "ns", "vk", Some("u-b"), false),
                "",
                true,
            ),
            (
                "upper re-created with a new uid: orphan",
                lower("a", "ns", "vk", Some("u-old"), false),
                "",
                true,
            ),
            (
                "another node's pod: never touched",
                lower("b", "ns", "vk-other", Some("u-b"), false),
                "",
                false,
            ),
            (
                "already going: left alone",
                lower("b", "ns", "vk", Some("u-b"), true),
                "",
                false,
            ),
            (
                "ours without a uid mark, no upper pod of its name: orphan",
                lower("b", "ns", "vk", None, false),
                "",
                true,
            ),
            (
                "ours without a uid mark, an upper pod of its name: the pod controller's",
                lower("a", "ns", "vk", None, false),
                "",
                false,
            ),
            (
                "another upper cluster's node of the same name: not ours to judge",
                lower("x", "ns", "vk@c2", Some("u-x"), false),
                "",
                false,
            ),
            (
                "outside --namespace: not ours to judge",
                lower("b", "elsewhere", "vk", Some("u-b"), false),
                "ns",
                false,
            ),
        ];
        for (name, pod, namespace, want) in cases {
            let pods = [pod];
            let got = !orphans(&pods, upper_uid, &Owner::new("vk", "c1"), namespace).is_empty();
            assert_eq!(got, want, "{name}");
        }
    }
}
