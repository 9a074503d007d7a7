//! A pod on the virtual node behaves as on a real node where Kubernetes' node conformance
//! tests look (kwok below): Ready counts the upper pod's readiness gates, an optional
//! ConfigMap or Secret created after the pod reaches it below, and a RuntimeClass it
//! names is there below. One pair and one virtual node for the file; each test keeps to
//! its own namespace.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use common::{TIMEOUT, start_node, wait_running};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use tensile_harness::fixtures::{bound_pod, merge};
use tensile_harness::{ClusterPair, TestNamespace, VirtualNode, wait_for};
use tokio::sync::OnceCell;

const NODE: &str = "vk-fidelity";

static NODE_PROCESS: OnceCell<VirtualNode> = OnceCell::const_new();

/// The shared pair with this file's virtual node running.
async fn pair() -> &'static ClusterPair {
    let pair = ClusterPair::shared().await.unwrap();
    NODE_PROCESS
        .get_or_init(|| async { start_node(pair, NODE, &[]).await })
        .await;
    pair
}

/// A pod bound to the virtual node with `spec` merged into its spec.
fn pod_with(name: &str, spec: serde_json::Value) -> Pod {
    let mut pod = serde_json::to_value(bound_pod(name, NODE)).unwrap();
    merge(&mut pod, json!({ "spec": spec }));
    serde_json::from_value(pod).unwrap()
}

/// The status and reason of condition `type_`.
fn condition(pod: &Pod, type_: &str) -> Option<(String, Option<String>)> {
    let conditions = pod.status.as_ref()?.conditions.as_ref()?;
    conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

/// Sets `type_` on the upper pod's status, as the gate's controller would.
async fn set_condition(pods: &Api<Pod>, name: &str, type_: &str, status: &str) {
    let patch = json!({"status": {"conditions": [{"type": type_, "status": status}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Strategic(&patch))
        .await
        .unwrap();
}

/// Waits until the upper pod's Ready is `status` (with `reason`, if given).
async fn wait_ready(pods: &Api<Pod>, name: &str, status: &str, reason: Option<&str>) {
    wait_for(&format!("{name} Ready={status}"), TIMEOUT, || async {
        let pod = pods.get(name).await?;
        let ready = condition(&pod, "Ready");
        let matches = ready.as_ref().is_some_and(|(s, r)| {
            s == status && reason.is_none_or(|want| r.as_deref() == Some(want))
        });
        Ok(matches.then_some(()))
    })
    .await
    .unwrap();
}

/// Kubernetes' "Pods should support pod readiness gates", through the virtual node: the
/// pod is Ready only once both gate conditions are True upstairs, and not Ready again when
/// one turns False; the lower pod runs without the gates.
#[tokio::test]
async fn ready_counts_the_readiness_gates_set_upstairs() {
    let pair = pair().await;
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let ns = TestNamespace::create(&upper, "gates").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper, &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower, &ns.name);
    let (gate_a, gate_b) = ("k8s.io/test-condition1", "k8s.io/test-condition2");
    let pod = pod_with(
        "gated",
        json!({"readinessGates": [{"conditionType": gate_a}, {"conditionType": gate_b}]}),
    );
    pods.create(&PostParams::default(), &pod).await.unwrap();
    wait_running(&pods, "app=gated", 1).await;

    let below = lower_pods.get("gated").await.unwrap();
    assert_eq!(below.spec.unwrap().readiness_gates, None);
    wait_ready(&pods, "gated", "False", Some("ReadinessGatesNotReady")).await;

    set_condition(&pods, "gated", gate_a, "True").await;
    // Still not Ready: only the second gate is named now.
    wait_for("Ready=False for the second gate alone", TIMEOUT, || async {
        let pod = pods.get("gated").await?;
        let ready = pod
            .status
            .and_then(|s| s.conditions)
            .and_then(|c| c.into_iter().find(|c| c.type_ == "Ready"));
        Ok(ready
            .filter(|c| c.status == "False")
            .and_then(|c| c.message)
            .filter(|m| m.contains(gate_b) && !m.contains(gate_a))
            .map(|_| ()))
    })
    .await
    .unwrap();

    set_condition(&pods, "gated", gate_b, "True").await;
    wait_ready(&pods, "gated", "True", None).await;

    set_condition(&pods, "gated", gate_a, "False").await;
    wait_ready(&pods, "gated", "False", Some("ReadinessGatesNotReady")).await;
    let pod = pods.get("gated").await.unwrap();
    assert_eq!(
        condition(&pod, gate_a).map(|(s, _)| s).as_deref(),
        Some("False"),
        "the gate's own condition is left as its controller set it"
    );
    ns.delete().await.unwrap();
}

/// Kubernetes' "optional updates should be reflected in volume" (ConfigMap, Secret and
/// their projected forms), through the virtual node: a running pod references optional
/// ConfigMaps and Secrets that do not exist yet; once created upstairs, each is copied
/// below (where the kubelet projects it), and again once deleted and re-created.
#[tokio::test]
async fn optional_config_maps_and_secrets_created_later_are_copied_down() {
    use k8s_openapi::api::core::v1::{ConfigMap, Secret};
    use kube::api::DeleteParams;
    use tensile_harness::fixtures::{config_map, secret};

    let pair = pair().await;
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let ns = TestNamespace::create(&upper, "optional").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let pod = pod_with(
        "late",
        json!({
            "volumes": [
                {"name": "cm", "configMap": {"name": "late-cm", "optional": true}},
                {"name": "secret", "secret": {"secretName": "late-secret", "optional": true}},
                {"name": "projected", "projected": {"sources": [
                    {"configMap": {"name": "late-projected-cm", "optional": true}},
                    {"secret": {"name": "late-projected-secret", "optional": true}},
                ]}},
            ],
            "containers": [{"name": "app", "image": "busybox", "volumeMounts": [
                {"name": "cm", "mountPath": "/cm"},
                {"name": "secret", "mountPath": "/secret"},
                {"name": "projected", "mountPath": "/projected"},
            ]}],
        }),
    );
    pods.create(&PostParams::default(), &pod).await.unwrap();
    wait_running(&pods, "app=late", 1).await;

    let upper_maps: Api<ConfigMap> = Api::namespaced(upper.clone(), &ns.name);
    let upper_secrets: Api<Secret> = Api::namespaced(upper, &ns.name);
    let lower_maps: Api<ConfigMap> = Api::namespaced(lower.clone(), &ns.name);
    let lower_secrets: Api<Secret> = Api::namespaced(lower, &ns.name);
    let pp = PostParams::default();
    for name in ["late-cm", "late-projected-cm"] {
        let map = config_map(name, json!({"data-1": "value-1"}));
        upper_maps.create(&pp, &map).await.unwrap();
    }
    for name in ["late-secret", "late-projected-secret"] {
        let s = secret(name, json!({"data-1": "value-1"}));
        upper_secrets.create(&pp, &s).await.unwrap();
    }
    for name in ["late-cm", "late-projected-cm"] {
        wait_for(
            &format!("ConfigMap {name} copied below"),
            TIMEOUT,
            || async {
                let copy = lower_maps.get_opt(name).await?;
                Ok(copy
                    .and_then(|c| c.data)
                    .filter(|d| d.get("data-1").map(String::as_str) == Some("value-1"))
                    .map(|_| ()))
            },
        )
        .await
        .unwrap();
    }
    for name in ["late-secret", "late-projected-secret"] {
        wait_for(&format!("Secret {name} copied below"), TIMEOUT, || async {
            let copy = lower_secrets.get_opt(name).await?;
            Ok(copy
                .and_then(|c| c.data)
                .filter(|d| d.get("data-1").is_some_and(|v| v.0 == b"value-1"))
                .map(|_| ()))
        })
        .await
        .unwrap();
    }

    // Deleted upstairs, the copy goes; created again, it comes back.
    upper_maps
        .delete("late-cm", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the copy of late-cm gone", TIMEOUT, || async {
        Ok(lower_maps.get_opt("late-cm").await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    let again = config_map("late-cm", json!({"data-1": "value-2"}));
    upper_maps.create(&pp, &again).await.unwrap();
    wait_for("late-cm copied below again", TIMEOUT, || async {
        let copy = lower_maps.get_opt("late-cm").await?;
        Ok(copy
            .and_then(|c| c.data)
            .filter(|d| d.get("data-1").map(String::as_str) == Some("value-2"))
            .map(|_| ()))
    })
    .await
    .unwrap();
    ns.delete().await.unwrap();
}

/// A pod naming a RuntimeClass runs below: the lower cluster lacks it, so it is copied from
/// the upper one (handler and overhead as upstairs, marked as tensile's); one the lower
/// cluster has is used as it is, never overwritten.
#[tokio::test]
async fn the_runtime_class_a_pod_names_is_there_below() {
    use k8s_openapi::api::node::v1::RuntimeClass;
    use kube::api::DeleteParams;
    use tensile::translate::meta::OWNER_NODE_LABEL;

    let pair = pair().await;
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let ns = TestNamespace::create(&upper, "runtime").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let upper_classes: Api<RuntimeClass> = Api::all(upper);
    let lower_classes: Api<RuntimeClass> = Api::all(lower);
    let pp = PostParams::default();
    // Cluster-scoped: names of this test's own.
    let (copied, existing) = (format!("{}-sandbox", ns.name), format!("{}-below", ns.name));
    let class = |name: &str, handler: &str| -> RuntimeClass {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "handler": handler,
            "overhead": {"podFixed": {"cpu": "10m", "memory": "16Mi"}},
        }))
        .unwrap()
    };
    upper_classes
        .create(&pp, &class(&copied, "runsc"))
        .await
        .unwrap();
    upper_classes
        .create(&pp, &class(&existing, "upper-handler"))
        .await
        .unwrap();
    lower_classes
        .create(&pp, &class(&existing, "lower-handler"))
        .await
        .unwrap();

    for (name, runtime_class) in [("sandboxed", &copied), ("below", &existing)] {
        let mut pod = pod_with(name, json!({"runtimeClassName": runtime_class}));
        pod.metadata.labels = Some([("app".to_owned(), "runtime".to_owned())].into());
        pods.create(&pp, &pod).await.unwrap();
    }
    wait_running(&pods, "app=runtime", 2).await;

    let made = lower_classes.get(&copied).await.unwrap();
    assert_eq!(made.handler, "runsc");
    assert_eq!(
        made.overhead.and_then(|o| o.pod_fixed).map(|f| f.len()),
        Some(2)
    );
    assert_eq!(
        made.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(OWNER_NODE_LABEL))
            .map(String::as_str),
        Some(NODE),
        "marked as this node's"
    );
    let kept = lower_classes.get(&existing).await.unwrap();
    assert_eq!(kept.handler, "lower-handler", "never overwritten");
    assert!(
        kept.metadata
            .labels
            .as_ref()
            .is_none_or(|l| !l.contains_key(OWNER_NODE_LABEL))
    );

    ns.delete().await.unwrap();
    for name in [&copied, &existing] {
        let _ = upper_classes.delete(name, &DeleteParams::default()).await;
        let _ = lower_classes.delete(name, &DeleteParams::default()).await;
    }
}

/// A pod bound to the node by name that asks for a host port a pod there already holds is
/// rejected as a kubelet rejects it (Failed, `NodePorts`, an Event), and nothing of it is
/// made below; its controller (a StatefulSet in Kubernetes' conformance test "Should
/// recreate evicted statefulset") makes another. Below, it would wait Pending forever on a
/// one-node lower cluster.
#[tokio::test]
async fn a_pod_whose_host_port_is_taken_is_rejected_as_a_kubelet_rejects_it() {
    let pair = pair().await;
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let ns = TestNamespace::create(&upper, "hostport").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower, &ns.name);
    let ports = |port: i32| json!({"containers": [{"name": "c", "image": "busybox", "ports": [{"containerPort": port, "hostPort": port}]}]});
    pods.create(&PostParams::default(), &pod_with("first", ports(21017)))
        .await
        .unwrap();
    wait_running(&pods, "", 1).await;
    for (name, port) in [("second", 21017), ("other-port", 21018)] {
        pods.create(&PostParams::default(), &pod_with(name, ports(port)))
            .await
            .unwrap();
    }
    let rejected = wait_for("the second pod Failed with NodePorts", TIMEOUT, || async {
        let pod = pods.get("second").await?;
        let status = pod.status.unwrap_or_default();
        Ok((status.phase.as_deref() == Some("Failed")).then_some(status))
    })
    .await
    .unwrap();
    assert_eq!(
        rejected.reason.as_deref(),
        Some("NodePorts"),
        "{rejected:?}"
    );
    assert!(
        rejected
            .message
            .as_deref()
            .is_some_and(|m| m.starts_with("Pod was rejected")),
        "{rejected:?}"
    );
    assert!(lower_pods.get_opt("second").await.unwrap().is_none());
    // A pod on another port runs; the first keeps running.
    wait_for("the pod on another port Running", TIMEOUT, || async {
        Ok(pods
            .get_opt("other-port")
            .await?
            .filter(common::running)
            .map(|_| ()))
    })
    .await
    .unwrap();
    assert!(common::running(&pods.get("first").await.unwrap()));
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(upper.clone(), &ns.name);
    wait_for("a NodePorts Event on the rejected pod", TIMEOUT, || async {
        let found = events.list(&Default::default()).await?.items;
        Ok(found
            .iter()
            .any(|e| {
                e.involved_object.name.as_deref() == Some("second")
                    && e.reason.as_deref() == Some("NodePorts")
            })
            .then_some(()))
    })
    .await
    .unwrap();
    ns.delete().await.unwrap();
}
