//! A lower claim's marks prove nothing: whoever may create claims in the lower cluster can
//! copy the owner labels of any mirrored object and name the UID of any upper claim. The
//! volume controller (`PVControllers`) reflects onto an upper claim only when an upper pod
//! bound to its node uses that claim: a forged lower claim naming a Pending upper claim that
//! no pod of the node uses gets neither `volume.kubernetes.io/selected-node` upstairs nor an
//! upper volume pre-bound to that claim (which would draw the claim, and the pod that uses
//! it, onto the virtual node and into storage the lower user controls); a warning names it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use common::{TIMEOUT, start_node, wait_running};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tensile::translate::meta::{PREFIX, SELECTED_NODE_ANNOTATION, UPPER_UID_ANNOTATION};
use tensile_harness::{ClusterPair, TestNamespace, wait_for};

fn from<T: serde::de::DeserializeOwned>(value: Value) -> T {
    serde_json::from_value(value).unwrap()
}

#[tokio::test]
async fn a_forged_lower_claim_naming_an_upper_claim_no_pod_of_this_node_uses_is_not_reflected() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-vol-forgery";
    let vn = start_node(
        pair,
        node,
        &[
            // No Service mirroring: the shared pair's other tests own their Services.
            "--enable-controllers=PVControllers",
            // Every lower claim of the node is looked at again on each resync.
            "--full-resync-period=2s",
        ],
    )
    .await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "vol-forgery").await.unwrap();
    let pp = PostParams::default();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let upper_claims: Api<PersistentVolumeClaim> = Api::namespaced(upper.clone(), &ns.name);
    let lower_claims: Api<PersistentVolumeClaim> = Api::namespaced(lower.clone(), &ns.name);
    let upper_volumes: Api<PersistentVolume> = Api::all(upper.clone());
    let lower_volumes: Api<PersistentVolume> = Api::all(lower.clone());

    // A pod of this node, mirrored below with marks anyone below can read (and its
    // namespace made there).
    let worker: Pod = from(json!({
        "metadata": {"name": "worker", "labels": {"app": "worker"}},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": false,
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "app", "image": "busybox"}],
        },
    }));
    upper_pods.create(&pp, &worker).await.unwrap();
    let copy = wait_running(&lower_pods, "app=worker", 1).await.remove(0);
    let marks: serde_json::Map<String, Value> = copy
        .labels()
        .iter()
        .filter(|(key, _)| key.starts_with(PREFIX))
        .map(|(key, value)| (key.clone(), json!(value)))
        .collect();
    assert!(!marks.is_empty(), "the copy carries the node's marks");

    // The victim: a Pending upper claim that no pod of this node uses (a pod bound for a
    // real node would use it once provisioned).
    let victim: PersistentVolumeClaim = from(json!({
        "metadata": {"name": "victim"},
        "spec": {
            "storageClassName": "",
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }));
    let victim = upper_claims.create(&pp, &victim).await.unwrap();
    let victim_uid = victim.uid().unwrap();

    // A lower user forges a claim of the same name with the node's marks and the victim's
    // UID, selected onto a lower node and bound to a volume of theirs.
    let volume = format!("forged-{}", ns.name);
    let forged_volume: PersistentVolume = from(json!({
        "metadata": {"name": volume},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "hostPath": {"path": "/tmp/forged"},
            "claimRef": {"kind": "PersistentVolumeClaim", "namespace": ns.name, "name": "victim"},
        },
    }));
    lower_volumes.create(&pp, &forged_volume).await.unwrap();
    let forged: PersistentVolumeClaim = from(json!({
        "metadata": {
            "name": "victim",
            "labels": marks,
            "annotations": {
                UPPER_UID_ANNOTATION: victim_uid,
                SELECTED_NODE_ANNOTATION: "lower-node-0",
            },
        },
        "spec": {
            "storageClassName": "",
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": "1Gi"}},
            "volumeName": volume,
        },
    }));
    lower_claims.create(&pp, &forged).await.unwrap();
    wait_for("the forged claim Bound below", TIMEOUT, || async {
        let c = lower_claims.get("victim").await?;
        Ok((c.status.and_then(|s| s.phase).as_deref() == Some("Bound")).then_some(()))
    })
    .await
    .unwrap();

    // Drawn up: the annotation on the victim, or an upper volume pre-bound to it.
    let drawn_up = || async {
        let claim = upper_claims.get("victim").await?;
        let selected = claim
            .annotations()
            .get(SELECTED_NODE_ANNOTATION)
            .is_some_and(|n| n == node);
        let reflected = upper_volumes.get_opt(&volume).await?.is_some();
        Ok::<_, kube::Error>(selected || reflected)
    };
    let refused = format!(
        "refused to reflect lower PersistentVolumeClaim {}/victim",
        ns.name
    );
    let tail = || tensile_harness::process::tail(vn.log(), 30);
    let outcome = wait_for("the forged claim refused", TIMEOUT, || async {
        if drawn_up().await? {
            return Ok(Some(Err(())));
        }
        let log = std::fs::read_to_string(vn.log())?;
        Ok(log.contains(&refused).then_some(Ok(())))
    })
    .await;
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(())) => panic!(
            "the forged lower claim drew the upper claim {}/victim onto {node}; log:\n{}",
            ns.name,
            tail()
        ),
        Err(error) => panic!("{error:#}\n{}", tail()),
    }
    // Later resyncs refuse it again; nothing is ever written upstairs.
    let again = wait_for("a second refusal", TIMEOUT, || async {
        let log = std::fs::read_to_string(vn.log())?;
        Ok((log.matches(&refused).count() >= 2).then_some(()))
    })
    .await;
    assert!(again.is_ok(), "{:?}\n{}", again.err(), tail());
    assert!(
        !drawn_up().await.unwrap(),
        "no selected-node and no upper volume for the forged claim"
    );
    // The upper claim's owner hears of it.
    let events: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    let warning = wait_for(
        "a LowerClaimRefused Warning on the victim",
        TIMEOUT,
        || async {
            let list = events.list(&ListParams::default()).await?.items;
            Ok(list.into_iter().find(|e| {
                e.reason.as_deref() == Some("LowerClaimRefused")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("victim")
            }))
        },
    )
    .await
    .unwrap();
    assert!(
        warning
            .note
            .unwrap_or_default()
            .contains(&format!("PersistentVolumeClaim {}/victim", ns.name)),
        "the Warning names the lower claim"
    );

    lower_claims
        .patch(
            "victim",
            &PatchParams::default(),
            &Patch::Merge(&json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    let _ = lower_claims
        .delete("victim", &DeleteParams::default())
        .await;
    let _ = lower_volumes
        .delete(&volume, &DeleteParams::default())
        .await;
    let _ = upper_volumes
        .delete(&volume, &DeleteParams::default())
        .await;
    ns.delete().await.unwrap();
}
