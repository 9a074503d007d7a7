//! A destructive step is confirmed against the API server, not taken on the word of a
//! store that lags. The upper pod watch is held back (the harness's proxy), as a new
//! leader's may lag after a takeover: its store still holds a StatefulSet pod's old UID U1
//! while the API server has the pod re-created as U2 and the old leader has made U2's lower
//! copy. The lower copy marked U2 is kept (no DeleteStale), and once the watch catches up
//! the pair is in step: U2 Running on that very copy, never `LowerPodGone`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use common::{TIMEOUT, running};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, PostParams};
use tensile::translate::meta::UPPER_UID_ANNOTATION;
use tensile_harness::fault_proxy::FaultProxy;
use tensile_harness::fixtures::bound_pod;
use tensile_harness::{ClusterPair, TestNamespace, VirtualNodeOptions, wait_for};

/// What virtual-node logs when it deletes a lower pod it takes for an older pod's…
const DELETED_STALE: &str = "deleting a lower pod left by an earlier pod of this name";
/// …and when it does not, because the API server has the upper pod the lower one is for.
const STORE_LAGS: &str = "the pod store lags the API server";

#[tokio::test]
async fn a_lower_copy_of_the_new_uid_survives_an_upper_store_holding_the_old_one() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-stale-upper";
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let proxy = FaultProxy::start(upper.clone()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = proxy
        .write_kubeconfig(&dir.path().join("upper.kubeconfig"))
        .unwrap();
    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), node);
    options.args = vec!["--enable-controllers=".into()];
    options.upper_kubeconfig = Some(kubeconfig);
    let vn = common::start_node_with(pair, &options, &upper).await;

    let ns = TestNamespace::create(&upper, "stale-upper").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let name = "web-0";
    upper_pods
        .create(&PostParams::default(), &bound_pod(name, node))
        .await
        .unwrap();
    let first_copy = wait_for("web-0 Running below", TIMEOUT, || async {
        Ok(lower_pods.get_opt(name).await?.filter(running))
    })
    .await
    .unwrap();

    // From here virtual-node's upper pod store stands still at U1.
    proxy.hold_watches("pods");
    upper_pods
        .delete(name, &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    wait_for("U1 gone", TIMEOUT, || async {
        Ok(upper_pods.get_opt(name).await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    let u2 = upper_pods
        .create(&PostParams::default(), &bound_pod(name, node))
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    // The old leader replaced the lower copy with U2's.
    lower_pods
        .delete(name, &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    wait_for("U1's copy gone", TIMEOUT, || async {
        Ok(lower_pods.get_opt(name).await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    let mut copy = first_copy.clone();
    copy.metadata.uid = None;
    copy.metadata.resource_version = None;
    copy.metadata.creation_timestamp = None;
    copy.metadata.managed_fields = None;
    copy.status = None;
    copy.metadata
        .annotations
        .get_or_insert_default()
        .insert(UPPER_UID_ANNOTATION.into(), u2.clone());
    if let Some(spec) = copy.spec.as_mut() {
        spec.node_name = None;
    }
    let log_before = std::fs::read_to_string(vn.log()).unwrap_or_default().len();
    let new_copy = lower_pods
        .create(&PostParams::default(), &copy)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();

    // virtual-node reconciles web-0 on the lower event, its upper store still at U1.
    let seen = wait_for(
        "the reconcile of web-0 on its new copy",
        TIMEOUT,
        || async {
            let log = std::fs::read_to_string(vn.log()).unwrap_or_default();
            let new = log.get(log_before..).unwrap_or_default();
            Ok([DELETED_STALE, STORE_LAGS]
                .into_iter()
                .find(|line| new.contains(line)))
        },
    )
    .await
    .unwrap();
    proxy.release_watches();
    assert_eq!(seen, STORE_LAGS, "the lower copy of U2 was deleted");

    let pod = wait_for("U2 Running", TIMEOUT, || async {
        Ok(upper_pods.get_opt(name).await?.filter(running))
    })
    .await
    .unwrap();
    assert_eq!(pod.metadata.uid.as_deref(), Some(u2.as_str()));
    let below = lower_pods.get(name).await.unwrap();
    assert_eq!(
        below.metadata.uid.as_deref(),
        Some(new_copy.as_str()),
        "U2 runs on the copy made for it, not on a new one"
    );
    ns.delete().await.unwrap();
}

/// What virtual-node logs when it force-finishes an upper pod's deletion.
const FINISHED: &str = "lower pod gone; finished the deletion";

/// The lower pod watch is held back: virtual-node creates a pod's lower copy, which its
/// lower store never sees. The upper pod is then deleted: with no copy in the store it
/// would finish the deletion at once while the copy still runs below; read live, the copy
/// is there, so nothing is finished until the watch catches up, and then the copy goes
/// first.
#[tokio::test]
async fn an_upper_deletion_is_not_finished_while_a_lagging_lower_store_misses_the_copy() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-stale-lower";
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let proxy = FaultProxy::start(lower.clone()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = proxy
        .write_kubeconfig(&dir.path().join("lower.kubeconfig"))
        .unwrap();
    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), node);
    options.args = vec!["--enable-controllers=".into()];
    options.lower_kubeconfig = Some(kubeconfig);
    let vn = common::start_node_with(pair, &options, &upper).await;

    let ns = TestNamespace::create(&upper, "stale-lower").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let name = "web-0";
    proxy.hold_watches("pods");
    upper_pods
        .create(&PostParams::default(), &bound_pod(name, node))
        .await
        .unwrap();
    let copy = wait_for("web-0's copy below", TIMEOUT, || async {
        Ok(lower_pods.get_opt(name).await?)
    })
    .await
    .unwrap();

    let log_before = std::fs::read_to_string(vn.log()).unwrap_or_default().len();
    upper_pods
        .delete(name, &DeleteParams::default())
        .await
        .unwrap();
    let seen = wait_for("the reconcile of web-0's deletion", TIMEOUT, || async {
        let log = std::fs::read_to_string(vn.log()).unwrap_or_default();
        let new = log.get(log_before..).unwrap_or_default();
        Ok([FINISHED, STORE_LAGS]
            .into_iter()
            .find(|line| new.contains(line)))
    })
    .await
    .unwrap();
    let upper_gone_early = upper_pods.get_opt(name).await.unwrap().is_none();
    proxy.release_watches();
    assert_eq!(
        seen, STORE_LAGS,
        "the upper deletion was finished while its copy ran below"
    );
    assert!(!upper_gone_early, "the upper pod went before its copy");

    // Caught up: the copy goes, then the upper pod.
    wait_for("the copy gone below", TIMEOUT, || async {
        let now = lower_pods.get_opt(name).await?;
        Ok((now.and_then(|p| p.metadata.uid) != copy.metadata.uid).then_some(()))
    })
    .await
    .unwrap();
    wait_for("the upper pod gone", TIMEOUT, || async {
        Ok(upper_pods.get_opt(name).await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    ns.delete().await.unwrap();
}
