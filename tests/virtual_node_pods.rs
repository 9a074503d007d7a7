//! Pods against two real clusters where the wrong pod could be hit: a status write meant
//! for a pod that was re-created under its name, a pod that never ran taken for one that
//! did, tensile's marks edited away below, and a lower admission webhook rewriting images.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use common::{TIMEOUT, lower_writes, metric, running, start_node, wait_running};
use k8s_openapi::api::core::v1::{Pod, PodStatus};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tensile::controllers::pod::{StatusWrite, write_upper_status};
use tensile::translate::meta::{OWNER_NODE_LABEL, UPPER_UID_ANNOTATION};
use tensile::translate::pod::MIRRORED_CONDITION;
use tensile_harness::fixtures::{bound_pod, merge, pod};
use tensile_harness::{ClusterPair, TestNamespace, VirtualNode, wait_for};

/// A full resync every second, so that "nothing is written" shows within seconds.
const FAST_RESYNC: &str = "--full-resync-period=1s";
/// No Service mirroring, so that the node's lower writes are its pods' alone.
const NO_SERVICES: &str = "--enable-controllers=PVControllers";

/// A condition another upper actor owns (a load balancer controller's readiness gate).
const GATE: &str = "example.com/load-balancer-ready";

fn from<T: serde::de::DeserializeOwned>(value: Value) -> T {
    serde_json::from_value(value).unwrap()
}

fn condition<'a>(pod: &'a Pod, type_: &str) -> Option<&'a str> {
    let conditions = pod.status.as_ref()?.conditions.as_ref()?;
    conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.status.as_str())
}

fn phase(pod: &Pod) -> Option<&str> {
    pod.status.as_ref()?.phase.as_deref()
}

fn label(pod: &Pod, key: &str) -> Option<String> {
    pod.metadata.labels.as_ref()?.get(key).cloned()
}

fn annotation(pod: &Pod, key: &str) -> Option<String> {
    pod.metadata.annotations.as_ref()?.get(key).cloned()
}

fn image(pod: &Pod) -> Option<String> {
    pod.spec.as_ref()?.containers.first()?.image.clone()
}

/// Sets `type_` on the upper pod's status, as another upper actor would.
async fn set_condition(pods: &Api<Pod>, name: &str, type_: &str, status: &str) {
    let patch = json!({"status": {"conditions": [{"type": type_, "status": status}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch))
        .await
        .unwrap();
}

/// Waits until `rounds` full resyncs of a node with one pod have passed.
async fn resyncs(vn: &VirtualNode, rounds: u64) {
    let series = "tensile_pod_reconciles_total";
    let from = metric(vn, series).await;
    wait_for(&format!("{rounds} resyncs"), TIMEOUT, || async {
        Ok((metric(vn, series).await >= from + rounds).then_some(()))
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn a_status_write_for_a_pod_re_created_under_its_name_is_refused() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let ns = TestNamespace::create(&upper, "replaced").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    // Bound to a node no kubelet serves: nothing but the test writes these statuses.
    let pp = PostParams::default();
    let old = pods
        .create(&pp, &bound_pod("web", "vk-nobody"))
        .await
        .unwrap();
    pods.delete("web", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    wait_for("the old pod gone", TIMEOUT, || async {
        Ok(pods.get_opt("web").await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    let new = pods
        .create(&pp, &bound_pod("web", "vk-nobody"))
        .await
        .unwrap();
    set_condition(&pods, "web", GATE, "True").await;

    // What a store that has not yet seen the re-create would write.
    let running: PodStatus = from(json!({
        "phase": "Running", "podIP": "10.9.9.9", "podIPs": [{"ip": "10.9.9.9"}],
        "startTime": "2026-01-01T00:00:00Z",
        "conditions": [{"type": "Ready", "status": "True"}],
    }));
    let written = write_upper_status(&pods, &old, &running, "replaced/web")
        .await
        .unwrap();
    assert_eq!(written, StatusWrite::PodReplaced);
    let kept = pods.get("web").await.unwrap();
    assert_eq!(kept.metadata.uid, new.metadata.uid);
    assert_ne!(
        phase(&kept),
        Some("Running"),
        "the old pod's status is not on the new one"
    );
    assert_eq!(condition(&kept, MIRRORED_CONDITION), None);
    assert_eq!(condition(&kept, "Ready"), None);
    assert_eq!(condition(&kept, GATE), Some("True"));

    // Meant for the new pod, it lands, and leaves the other actor's condition alone.
    let written = write_upper_status(&pods, &new, &running, "replaced/web")
        .await
        .unwrap();
    assert_eq!(written, StatusWrite::Written);
    let written = pods.get("web").await.unwrap();
    assert_eq!(phase(&written), Some("Running"));
    assert_eq!(condition(&written, "Ready"), Some("True"));
    assert_eq!(condition(&written, MIRRORED_CONDITION), Some("True"));
    assert_eq!(condition(&written, GATE), Some("True"), "not wiped");

    pods.delete("web", &DeleteParams::default().grace_period(0))
        .await
        .unwrap();
    let gone = write_upper_status(&pods, &new, &running, "replaced/web")
        .await
        .unwrap();
    assert_eq!(gone, StatusWrite::PodReplaced, "a deleted pod is no error");
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn a_pod_with_only_another_actors_condition_is_created_below_not_failed() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-gate";
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "gate").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    // Bound, and its readiness gate set, before the node runs: it never ran below.
    let mut spec = serde_json::to_value(bound_pod("web", node).spec).unwrap();
    merge(
        &mut spec,
        json!({"readinessGates": [{"conditionType": GATE}]}),
    );
    upper_pods
        .create(&PostParams::default(), &pod("web", spec))
        .await
        .unwrap();
    set_condition(&upper_pods, "web", GATE, "True").await;

    let _vn = start_node(pair, node, &[]).await;
    let runs = wait_for("the pod running", TIMEOUT, || async {
        let pod = upper_pods.get("web").await?;
        assert_ne!(phase(&pod), Some("Failed"), "failed though it never ran");
        Ok(running(&pod).then_some(pod))
    })
    .await
    .unwrap();
    assert!(lower_pods.get_opt("web").await.unwrap().is_some());
    assert_eq!(condition(&runs, MIRRORED_CONDITION), Some("True"));
    assert_eq!(
        condition(&runs, GATE),
        Some("True"),
        "the reflected status leaves the other actor's condition"
    );
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn tensiles_marks_edited_away_below_come_back_and_the_pod_runs_on() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-marks";
    let _vn = start_node(pair, node, &[]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "marks").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    upper_pods
        .create(&PostParams::default(), &bound_pod("web", node))
        .await
        .unwrap();
    let upper_uid = wait_running(&upper_pods, "app=web", 1).await[0]
        .metadata
        .uid
        .clone();
    let lower_uid = wait_running(&lower_pods, "app=web", 1).await[0]
        .metadata
        .uid
        .clone();

    // (what is edited away, the key, whether it is an annotation, its value)
    let marks = [
        ("the owner label", OWNER_NODE_LABEL, false, node.to_owned()),
        (
            "the upper-UID annotation",
            UPPER_UID_ANNOTATION,
            true,
            upper_uid.clone().unwrap(),
        ),
    ];
    for (what, key, is_annotation, value) in marks {
        let field = if is_annotation {
            "annotations"
        } else {
            "labels"
        };
        lower_pods
            .patch(
                "web",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {field: {key: null}}})),
            )
            .await
            .unwrap();
        let restored = wait_for(&format!("{what} back"), TIMEOUT, || async {
            let pod = lower_pods.get("web").await?;
            let mark = if is_annotation {
                annotation(&pod, key)
            } else {
                label(&pod, key)
            };
            Ok((mark.as_deref() == Some(value.as_str())).then_some(pod))
        })
        .await
        .unwrap();
        assert_eq!(restored.metadata.uid, lower_uid, "{what}: not re-created");
        let upper_pod = upper_pods.get("web").await.unwrap();
        assert_eq!(upper_pod.metadata.uid, upper_uid, "{what}");
        assert!(running(&upper_pod), "{what}: the upper pod runs on");
    }
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn an_image_the_lower_admission_rewrote_is_left_alone_until_the_upper_image_changes() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-mirror";
    let vn = start_node(pair, node, &[FAST_RESYNC, NO_SERVICES]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "mirror").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    upper_pods
        .create(&PostParams::default(), &bound_pod("web", node))
        .await
        .unwrap();
    wait_running(&upper_pods, "app=web", 1).await;
    wait_running(&lower_pods, "app=web", 1).await;

    // A registry-mirror webhook's rewrite, done here by hand.
    let rewritten = "mirror.example.com/library/nginx";
    let before = lower_writes(&vn).await;
    let containers =
        |image: &str| json!({"spec": {"containers": [{"name": "app", "image": image}]}});
    lower_pods
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Strategic(containers(rewritten)),
        )
        .await
        .unwrap();
    resyncs(&vn, 3).await;
    assert_eq!(
        image(&lower_pods.get("web").await.unwrap()).as_deref(),
        Some(rewritten),
        "not patched back"
    );
    assert_eq!(lower_writes(&vn).await, before, "no lower write");

    // A change upstream still goes down.
    upper_pods
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Strategic(containers("nginx:1.27")),
        )
        .await
        .unwrap();
    wait_for("the new upper image below", TIMEOUT, || async {
        let pod = lower_pods.get("web").await?;
        Ok((image(&pod).as_deref() == Some("nginx:1.27")).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(lower_writes(&vn).await, before + 1, "one patch");
    ns.delete().await.unwrap();
}
