//! Bad input: pods that are hard to mirror are mirrored as written or refused below with
//! a Warning naming the reason, and one pod the lower cluster refuses never stalls the
//! others.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::time::Instant;

use common::{TIMEOUT, gc_rounds, lower_writes, start_node, wait_running};
use k8s_openapi::api::core::v1::{ConfigMap, EphemeralContainer, Namespace, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tensile::translate::pod::ephemeral_containers_patch;
use tensile_harness::fixtures::{bound_pod, config_map, merge, pinned_spec};
use tensile_harness::{ClusterPair, TestNamespace, VirtualNode, wait_for};

/// The most bytes the API server admits in one object's annotations (keys and values).
const ANNOTATIONS_LIMIT: usize = 256 * 1024;

/// A pod bound to `node` from `metadata` and a patch over the pinned spec.
fn pod_with(metadata: Value, node: &str, spec_patch: Value) -> Pod {
    let mut spec = pinned_spec(node);
    merge(&mut spec, json!({"nodeName": node}));
    merge(&mut spec, spec_patch);
    serde_json::from_value(json!({"metadata": metadata, "spec": spec})).unwrap()
}

/// The Warning events about the upper pod `name`, as `reason: note`.
async fn warnings(events: &Api<Event>, name: &str) -> Vec<String> {
    events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.type_.as_deref() == Some("Warning"))
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
        .map(|e| {
            format!(
                "{}: {}",
                e.reason.unwrap_or_default(),
                e.note.unwrap_or_default()
            )
        })
        .collect()
}

/// Two pods that only the lower cluster refuses, each with a Warning naming the reason,
/// while 50 ordinary pods created after them all run: one whose annotations fill the
/// upper limit (tensile's own annotations push its copy over), and one whose
/// `priorityClassName` names a PriorityClass that exists in the upper cluster only (the
/// lower Priority admission refuses it). Both stay Pending upstream.
#[tokio::test]
async fn a_pod_refused_below_stalls_none_of_fifty_others_and_is_named_in_a_warning() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-bad-one";
    let _vn = start_node(pair, node, &[]).await;
    let upper = pair.upper.client().await.unwrap();
    let ns = TestNamespace::create(&upper, "bad-one").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let pp = PostParams::default();

    // Cluster-scoped, so named after the namespace, which is unique to this run.
    let class_name = format!("upper-only-{}", ns.name);
    let class: PriorityClass =
        serde_json::from_value(json!({"metadata": {"name": class_name}, "value": 1000})).unwrap();
    let classes: Api<PriorityClass> = Api::all(upper.clone());
    classes.create(&pp, &class).await.unwrap();
    let upper_only = pod_with(
        json!({"name": "upper-only-priority", "labels": {"role": "bad"}}),
        node,
        json!({"priorityClassName": class_name}),
    );
    upper_pods.create(&pp, &upper_only).await.unwrap();

    let key = "example.com/bulk";
    let bulk = "x".repeat(ANNOTATIONS_LIMIT - key.len() - 64);
    let too_big = pod_with(
        json!({"name": "too-big", "labels": {"role": "bad"}, "annotations": {key: bulk}}),
        node,
        json!({}),
    );
    upper_pods.create(&pp, &too_big).await.unwrap();

    let started = Instant::now();
    for i in 0..50 {
        let mut good = bound_pod(&format!("good-{i}"), node);
        good.metadata.labels = Some(BTreeMap::from([("role".into(), "good".into())]));
        upper_pods.create(&pp, &good).await.unwrap();
    }
    wait_running(&upper_pods, "role=good", 50).await;
    println!(
        "50 good pods Running {:.1} s after the first was created, beside one refused below",
        started.elapsed().as_secs_f64()
    );

    let events: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    let warning = wait_for(
        "a Warning on too-big naming the refusal",
        TIMEOUT,
        || async {
            let found = warnings(&events, "too-big").await;
            Ok(found
                .into_iter()
                .find(|w| w.starts_with("LowerSyncFailed") && w.contains("262144 bytes")))
        },
    )
    .await
    .unwrap();
    assert!(warning.contains("lower"), "names the cluster: {warning}");
    let warning = wait_for(
        "a Warning on upper-only-priority naming the missing PriorityClass",
        TIMEOUT,
        || async {
            let found = warnings(&events, "upper-only-priority").await;
            Ok(found
                .into_iter()
                .find(|w| w.starts_with("LowerSyncFailed") && w.contains(&class_name)))
        },
    )
    .await
    .unwrap();
    assert!(warning.contains("lower"), "names the cluster: {warning}");
    for name in ["too-big", "upper-only-priority"] {
        let status = upper_pods
            .get(name)
            .await
            .unwrap()
            .status
            .unwrap_or_default();
        assert_eq!(
            status.phase.as_deref(),
            Some("Pending"),
            "{name}: {status:?}"
        );
    }
    ns.delete().await.unwrap();
    classes
        .delete(&class_name, &DeleteParams::default())
        .await
        .unwrap();
}

/// Pods that are unusual but valid run below as written: a 253-character name, unicode
/// in annotations and env, hostNetwork, init containers, projected volumes with every
/// source, downward API, emptyDir and a ConfigMap, and a hostPath volume; a reference to a
/// ConfigMap that does not exist is named in a Warning and does not hold up the others.
/// A hostPath volume is mirrored as written, as tensile-kube does: whether a pod may
/// mount a path of a lower node is the lower cluster's to decide (its Pod Security
/// admission), and a refusal there is named in a Warning like any other.
#[tokio::test]
async fn unusual_but_valid_pods_run_below_as_written() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-unusual";
    let _vn = start_node(pair, node, &[]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "unusual").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let pp = PostParams::default();
    Api::<ConfigMap>::namespaced(upper.clone(), &ns.name)
        .create(&pp, &config_map("settings", json!({"k": "v"})))
        .await
        .unwrap();

    let long_name = format!("long-{}", "n".repeat(253 - 5));
    let unicode = "ünïcødé ✓ 日本語 🚀";
    let corpus = [
        pod_with(
            json!({"name": long_name, "labels": {"role": "unusual"}}),
            node,
            json!({}),
        ),
        pod_with(
            json!({"name": "unicode", "labels": {"role": "unusual"},
                   "annotations": {"example.com/note": unicode}}),
            node,
            json!({"containers": [{"name": "app", "image": "nginx",
                                   "env": [{"name": "GREETING", "value": unicode}]}]}),
        ),
        pod_with(
            json!({"name": "host-network", "labels": {"role": "unusual"}}),
            node,
            json!({"hostNetwork": true}),
        ),
        pod_with(
            json!({"name": "init", "labels": {"role": "unusual"}}),
            node,
            json!({"initContainers": [{"name": "setup", "image": "busybox",
                                       "command": ["true"]}]}),
        ),
        pod_with(
            json!({"name": "host-path", "labels": {"role": "unusual"}}),
            node,
            json!({
                "volumes": [{"name": "logs",
                             "hostPath": {"path": "/var/log", "type": "Directory"}}],
                "containers": [{"name": "app", "image": "nginx", "volumeMounts": [
                    {"name": "logs", "mountPath": "/host/logs", "readOnly": true}]}],
            }),
        ),
        pod_with(
            json!({"name": "volumes", "labels": {"role": "unusual"}}),
            node,
            json!({
                "volumes": [
                    {"name": "scratch", "emptyDir": {"sizeLimit": "1Mi"}},
                    {"name": "settings", "configMap": {"name": "settings"}},
                    {"name": "info", "downwardAPI": {"items": [
                        {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}},
                    {"name": "all-in-one", "projected": {"sources": [
                        {"configMap": {"name": "settings"}},
                        {"downwardAPI": {"items": [
                            {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]}},
                        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3600}},
                    ]}},
                ],
                "containers": [{"name": "app", "image": "nginx", "volumeMounts": [
                    {"name": "scratch", "mountPath": "/scratch"},
                    {"name": "settings", "mountPath": "/settings"},
                    {"name": "info", "mountPath": "/info"},
                    {"name": "all-in-one", "mountPath": "/all"},
                ]}],
            }),
        ),
    ];
    let missing = pod_with(
        json!({"name": "missing-config", "labels": {"role": "waiting"}}),
        node,
        json!({"volumes": [{"name": "c", "configMap": {"name": "does-not-exist"}}]}),
    );
    upper_pods.create(&pp, &missing).await.unwrap();
    for pod in &corpus {
        upper_pods.create(&pp, pod).await.unwrap();
    }
    wait_running(&upper_pods, "role=unusual", corpus.len()).await;

    let below = lower_pods.get("unicode").await.unwrap();
    assert_eq!(
        below
            .metadata
            .annotations
            .unwrap_or_default()
            .get("example.com/note")
            .map(String::as_str),
        Some(unicode)
    );
    let env = below.spec.unwrap().containers[0].env.clone().unwrap();
    assert_eq!(env[0].value.as_deref(), Some(unicode));
    assert!(lower_pods.get_opt(&long_name).await.unwrap().is_some());
    let host = lower_pods.get("host-network").await.unwrap();
    assert_eq!(host.spec.unwrap().host_network, Some(true));
    let host_path = lower_pods.get("host-path").await.unwrap().spec.unwrap();
    assert_eq!(
        serde_json::to_value(&host_path.volumes.unwrap()[0]).unwrap(),
        json!({"name": "logs", "hostPath": {"path": "/var/log", "type": "Directory"}}),
        "mirrored as written"
    );
    let init = lower_pods.get("init").await.unwrap();
    assert_eq!(init.spec.unwrap().init_containers.unwrap()[0].name, "setup");
    let volumes = lower_pods.get("volumes").await.unwrap().spec.unwrap();
    let sources = volumes
        .volumes
        .unwrap()
        .into_iter()
        .find(|v| v.name == "all-in-one")
        .and_then(|v| v.projected)
        .and_then(|p| p.sources)
        .unwrap_or_default();
    assert_eq!(sources.len(), 3, "every projected source kept: {sources:?}");

    let events: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    wait_for(
        "a Warning naming the missing ConfigMap",
        TIMEOUT,
        || async {
            let found = warnings(&events, "missing-config").await;
            Ok(found.into_iter().find(|w| w.contains("does-not-exist")))
        },
    )
    .await
    .unwrap();
    ns.delete().await.unwrap();
}

/// The ephemeral containers of `pod`, as `name image target`, sorted (a strategic merge
/// patch puts the new ones first).
fn ephemeral_containers(pod: &Pod) -> Vec<String> {
    let containers: Vec<EphemeralContainer> = pod
        .spec
        .as_ref()
        .and_then(|s| s.ephemeral_containers.clone())
        .unwrap_or_default();
    containers
        .into_iter()
        .map(|c| {
            format!(
                "{} {} {}",
                c.name,
                c.image.unwrap_or_default(),
                c.target_container_name.unwrap_or_default()
            )
        })
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

/// Waits until the lower pod `target` has exactly the ephemeral containers `want`
/// ([`ephemeral_containers`]); panics with the tail of the node's log if it does not.
async fn wait_ephemeral_below(lower_pods: &Api<Pod>, vn: &VirtualNode, want: &[&str]) {
    let result = wait_for(
        &format!("ephemeral containers {want:?} below"),
        TIMEOUT,
        || async {
            let pod = lower_pods.get("target").await?;
            Ok((ephemeral_containers(&pod) == want).then_some(()))
        },
    )
    .await;
    if let Err(error) = result {
        let seen = ephemeral_containers(&lower_pods.get("target").await.unwrap());
        panic!(
            "{error:#}; below: {seen:?}\n{}",
            tensile_harness::process::tail(vn.log(), 40)
        );
    }
}

/// `kubectl debug` of a pod on the virtual node (an ephemeral container added through the
/// upper pod's ephemeralcontainers subresource) adds the container to the lower pod
/// through the lower pod's ephemeralcontainers subresource, so the debugger runs beside
/// the pod where it runs; a second one is added beside the first; and then the node
/// writes nothing more below (no write war over a container it cannot change). One that
/// only the lower cluster refuses is named in a Warning and retried with backoff.
#[tokio::test]
async fn kubectl_debug_on_the_virtual_node_adds_the_ephemeral_container_below() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-debug";
    let vn = start_node(pair, node, &[]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "debug").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let mut target = bound_pod("target", node);
    target.metadata.labels = Some(BTreeMap::from([("role".into(), "debugged".into())]));
    upper_pods
        .create(&PostParams::default(), &target)
        .await
        .unwrap();
    wait_running(&upper_pods, "role=debugged", 1).await;

    let debug = |container: &str, image: &str, extra: &[&str]| {
        let output = Command::new(pair.bin("kubectl"))
            .arg("--kubeconfig")
            .arg(pair.upper_kubeconfig())
            .args(["debug", "-n", &ns.name, "target", "--image", image])
            .args(["--container", container, "--target", "app"])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "kubectl debug: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    debug("debugger", "busybox:1.36", &[]);
    wait_ephemeral_below(&lower_pods, &vn, &["debugger busybox:1.36 app"]).await;
    debug("second", "alpine:3", &[]);
    let both = ["debugger busybox:1.36 app", "second alpine:3 app"];
    wait_ephemeral_below(&lower_pods, &vn, &both).await;

    // The UID precondition holds on this subresource: a patch meant for an earlier pod of
    // this name is refused (422 on metadata.uid).
    let stale: Vec<EphemeralContainer> =
        serde_json::from_value(json!([{"name": "stale", "image": "busybox"}])).unwrap();
    let patch = ephemeral_containers_patch("an-earlier-pod", &stale, "Pod target").unwrap();
    let refused = lower_pods
        .patch_ephemeral_containers("target", &PatchParams::default(), &Patch::Strategic(&patch))
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, kube::Error::Api(s) if s.code == 422 && s.message.contains("metadata.uid")),
        "{refused:?}"
    );

    let writes = lower_writes(&vn).await;
    gc_rounds(&vn, 2).await;
    assert_eq!(lower_writes(&vn).await, writes, "no write below once added");
    let events: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    assert!(warnings(&events, "target").await.is_empty(), "no Warning");

    // A debugger only the lower cluster refuses (its namespace enforces the baseline Pod
    // Security level; the upper one does not): named in a Warning on the upper pod, retried
    // with backoff, and the pod runs on.
    let label = json!({"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "baseline"}}});
    Api::<Namespace>::all(lower.clone())
        .patch(&ns.name, &PatchParams::default(), &Patch::Merge(&label))
        .await
        .unwrap();
    debug("privileged", "busybox:1.36", &["--profile", "sysadmin"]);
    let warning = wait_for("a Warning naming the refused debugger", TIMEOUT, || async {
        let found = warnings(&events, "target").await;
        Ok(found.into_iter().find(|w| {
            w.starts_with("LowerSyncFailed")
                && w.contains("adding ephemeral containers")
                && w.contains("PodSecurity")
        }))
    })
    .await
    .unwrap();
    assert!(warning.contains("lower"), "names the cluster: {warning}");
    let writes = lower_writes(&vn).await;
    gc_rounds(&vn, 2).await;
    let retries = lower_writes(&vn).await - writes;
    println!("{retries} refused tries below in two orphan collection rounds; {warning}");
    assert!(
        retries <= 6,
        "{retries} tries in two collection rounds: no backoff"
    );
    let upper_pod = upper_pods.get("target").await.unwrap();
    assert!(
        common::running(&upper_pod),
        "still running: {:?}",
        upper_pod.status
    );
    ns.delete().await.unwrap();
}
