//! `PVControllers` against two real clusters: the seed's example (ConfigMap + Secret +
//! PVC `vk-demo` bound to a local PV prepared in the lower cluster, a pod mounting all
//! three) runs end to end, a claim provisioned below on the lower scheduler's node choice
//! gets `volume.kubernetes.io/selected-node` rewritten, and the lower claim and the
//! reflected volume follow deletions.
//!
//! As with tensile-kube, the upper kube-scheduler must not check volume binding for pods
//! bound for a virtual node (the claim binds below, after the pod is placed): this pair's
//! upper scheduler runs without the VolumeBinding and VolumeZone plugins (both refuse a
//! pod whose claim is unbound), so it needs a pair of its own.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::time::Instant;

use common::{TIMEOUT, start_node, wait_running};
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolume, PersistentVolumeClaim, Pod, Secret};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::{Value, json};
use tensile::translate::meta::{OWNER_NODE_LABEL, SELECTED_NODE_ANNOTATION};
use tensile_harness::{ClusterPair, PairOptions, TestNamespace, wait_for};

fn from<T: serde::de::DeserializeOwned>(value: Value) -> T {
    serde_json::from_value(value).unwrap()
}

/// A pair whose upper scheduler skips the volume binding checks.
async fn pair() -> ClusterPair {
    let mut options = PairOptions::default();
    options.upper.scheduler_config.insert(
        "profiles".into(),
        json!([{
            "schedulerName": "default-scheduler",
            "plugins": {"multiPoint": {"disabled": [{"name": "VolumeBinding"}, {"name": "VolumeZone"}]}},
        }]),
    );
    ClusterPair::start(options).await.unwrap()
}

/// A local PV on `host` of the lower cluster.
fn local_pv(
    name: &str,
    class: &str,
    size: &str,
    host: &str,
    claim: Option<Value>,
) -> PersistentVolume {
    from(json!({
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": size},
            "volumeMode": "Filesystem",
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": class,
            "local": {"path": "/tmp/example"},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [host]},
            ]}]}},
            "claimRef": claim,
        },
    }))
}

fn claim(name: &str, class: &str, size: &str) -> PersistentVolumeClaim {
    from(json!({
        "metadata": {"name": name, "labels": {"app": "nginx"}},
        "spec": {
            "storageClassName": class,
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": size}},
        },
    }))
}

/// The seed's pod: busybox mounting the ConfigMap, the Secret and the claim, placed by
/// `nodeSelector: type: virtual-kubelet` and the toleration.
fn seed_pod(name: &str, claim: &str) -> Pod {
    from(json!({
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "automountServiceAccountToken": false,
            "containers": [{
                "name": "busybox", "image": "busybox:1.27", "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", "tail -f /dev/null"],
                "volumeMounts": [
                    {"name": "foo", "mountPath": "/etc/foo", "readOnly": true},
                    {"name": "bar", "mountPath": "/etc/bar", "readOnly": true},
                    {"name": "local", "mountPath": "/datadir"},
                ],
            }],
            "nodeSelector": {"type": "virtual-kubelet"},
            "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists", "effect": "NoSchedule"}],
            "volumes": [
                {"name": "foo", "configMap": {"name": "myconfigmap"}},
                {"name": "bar", "secret": {"secretName": "mysecret", "optional": false}},
                {"name": "local", "persistentVolumeClaim": {"claimName": claim}},
            ],
        },
    }))
}

fn phase(claim: &PersistentVolumeClaim) -> Option<&str> {
    claim.status.as_ref()?.phase.as_deref()
}

fn annotation<'a>(claim: &'a PersistentVolumeClaim, key: &str) -> Option<&'a str> {
    claim
        .metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

#[tokio::test]
async fn the_seed_example_binds_below_and_its_volume_is_reflected_up() {
    let pair = pair().await;
    let node = "vk-pv";
    let _vn = start_node(&pair, node, &[]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "seed").await.unwrap();
    let pp = PostParams::default();
    let upper_volumes: Api<PersistentVolume> = Api::all(upper.clone());
    let lower_volumes: Api<PersistentVolume> = Api::all(lower.clone());
    let upper_claims: Api<PersistentVolumeClaim> = Api::namespaced(upper.clone(), &ns.name);
    let lower_claims: Api<PersistentVolumeClaim> = Api::namespaced(lower.clone(), &ns.name);
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);

    // Prepared in the lower cluster, as in the seed.
    lower_volumes
        .create(&pp, &local_pv("vk-demo", "", "100Gi", "lower-node-0", None))
        .await
        .unwrap();
    // The seed's workload, in the upper cluster.
    let cm: ConfigMap =
        from(json!({"metadata": {"name": "myconfigmap"}, "data": {"username": "vk-demo"}}));
    let secret: Secret = from(
        json!({"metadata": {"name": "mysecret"}, "type": "Opaque", "data": {"USER_NAME": "YWRtaW4="}}),
    );
    Api::<ConfigMap>::namespaced(upper.clone(), &ns.name)
        .create(&pp, &cm)
        .await
        .unwrap();
    Api::<Secret>::namespaced(upper.clone(), &ns.name)
        .create(&pp, &secret)
        .await
        .unwrap();
    upper_claims
        .create(&pp, &claim("vk-demo", "", "50Mi"))
        .await
        .unwrap();
    let start = Instant::now();
    upper_pods
        .create(&pp, &seed_pod("vk-demo", "vk-demo"))
        .await
        .unwrap();

    let running = wait_running(&upper_pods, "app=vk-demo", 1).await;
    eprintln!(
        "seed pod created -> Running upstairs: {:?}",
        start.elapsed()
    );
    assert_eq!(
        running[0].spec.as_ref().unwrap().node_name.as_deref(),
        Some(node)
    );
    let below = wait_running(&lower_pods, "app=vk-demo", 1).await;
    assert_eq!(
        below[0].spec.as_ref().unwrap().node_name.as_deref(),
        Some("lower-node-0"),
        "placed by the lower scheduler where the local volume is"
    );

    // Bound in both clusters, to the same volume.
    let lower_claim = lower_claims.get("vk-demo").await.unwrap();
    assert_eq!(phase(&lower_claim), Some("Bound"));
    assert_eq!(
        lower_claim.metadata.labels.as_ref().unwrap()[OWNER_NODE_LABEL],
        node
    );
    let upper_claim = wait_for("the upper claim Bound", TIMEOUT, || async {
        let c = upper_claims.get("vk-demo").await?;
        Ok((phase(&c) == Some("Bound")).then_some(c))
    })
    .await
    .unwrap();
    assert_eq!(
        upper_claim.spec.as_ref().unwrap().volume_name.as_deref(),
        Some("vk-demo")
    );
    eprintln!(
        "seed pod created -> upper claim Bound: {:?}",
        start.elapsed()
    );

    // The reflected volume: this node's, pinned to it, bound to the upper claim.
    let reflected = upper_volumes.get("vk-demo").await.unwrap();
    assert_eq!(
        reflected.metadata.labels.as_ref().unwrap()[OWNER_NODE_LABEL],
        node
    );
    let spec = reflected.spec.clone().unwrap();
    let terms = spec
        .node_affinity
        .unwrap()
        .required
        .unwrap()
        .node_selector_terms;
    let hosts: Vec<_> = terms
        .iter()
        .flat_map(|t| t.match_expressions.iter().flatten())
        .filter(|e| e.key == "kubernetes.io/hostname")
        .flat_map(|e| e.values.clone().unwrap_or_default())
        .collect();
    assert_eq!(hosts, [node]);
    let claim_ref = spec.claim_ref.unwrap();
    assert_eq!(claim_ref.uid, upper_claim.metadata.uid);
    assert_eq!(claim_ref.name.as_deref(), Some("vk-demo"));
    assert_eq!(spec.local.unwrap().path, "/tmp/example");
    assert_eq!(
        spec.capacity.unwrap()["storage"].0,
        "100Gi",
        "the size of the lower volume"
    );

    // Deleting the upper claim (once no upper pod uses it) deletes the lower one; the
    // lower volume is released (Retain), and its reflection stays while it exists.
    upper_pods
        .delete("vk-demo", &DeleteParams::default())
        .await
        .unwrap();
    upper_claims
        .delete("vk-demo", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the lower claim gone", TIMEOUT, || async {
        Ok(lower_claims
            .get_opt("vk-demo")
            .await?
            .is_none()
            .then_some(()))
    })
    .await
    .unwrap();
    wait_for("the lower volume Released", TIMEOUT, || async {
        let v = lower_volumes.get("vk-demo").await?;
        Ok((v.status.and_then(|s| s.phase).as_deref() == Some("Released")).then_some(()))
    })
    .await
    .unwrap();
    assert!(upper_volumes.get_opt("vk-demo").await.unwrap().is_some());
    // The reflection follows the lower volume's end.
    lower_volumes
        .delete("vk-demo", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the reflected volume gone", TIMEOUT, || async {
        Ok(upper_volumes
            .get_opt("vk-demo")
            .await?
            .is_none()
            .then_some(()))
    })
    .await
    .unwrap();

    // A claim provisioned below where the lower scheduler puts the pod: the test plays the
    // provisioner of a WaitForFirstConsumer class.
    let lazy: StorageClass = from(json!({
        "metadata": {"name": "lazy"},
        "provisioner": "example.com/test-provisioner",
        "volumeBindingMode": "WaitForFirstConsumer",
        "reclaimPolicy": "Delete",
    }));
    Api::<StorageClass>::all(lower.clone())
        .create(&pp, &lazy)
        .await
        .unwrap();
    upper_claims
        .create(&pp, &claim("data", "lazy", "1Gi"))
        .await
        .unwrap();
    upper_pods
        .create(&pp, &seed_pod("lazy", "data"))
        .await
        .unwrap();
    let selected = wait_for("the lower scheduler to select a node", TIMEOUT, || async {
        let Some(c) = lower_claims.get_opt("data").await? else {
            return Ok(None);
        };
        Ok(annotation(&c, SELECTED_NODE_ANNOTATION).map(|n| (n.to_owned(), c.clone())))
    })
    .await
    .unwrap();
    let (host, lower_claim) = selected;
    let claim_ref = json!({"kind": "PersistentVolumeClaim", "namespace": ns.name, "name": "data",
                           "uid": lower_claim.metadata.uid});
    lower_volumes
        .create(
            &pp,
            &local_pv("pv-data", "lazy", "1Gi", &host, Some(claim_ref)),
        )
        .await
        .unwrap();
    wait_running(&upper_pods, "app=lazy", 1).await;
    let upper_claim = wait_for("the upper claim Bound and annotated", TIMEOUT, || async {
        let c = upper_claims.get("data").await?;
        let done =
            phase(&c) == Some("Bound") && annotation(&c, SELECTED_NODE_ANNOTATION) == Some(node);
        Ok(done.then_some(c))
    })
    .await
    .unwrap();
    assert_eq!(
        upper_claim.spec.unwrap().volume_name.as_deref(),
        Some("pv-data")
    );

    // A class the lower cluster lacks: a Warning on the upper claim.
    upper_claims
        .create(&pp, &claim("nowhere", "no-such-class", "1Gi"))
        .await
        .unwrap();
    upper_pods
        .create(&pp, &seed_pod("nowhere", "nowhere"))
        .await
        .unwrap();
    let events: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    let warning = wait_for("a Warning on the upper claim", TIMEOUT, || async {
        let list = events.list(&ListParams::default()).await?.items;
        Ok(list.into_iter().find(|e| {
            e.reason.as_deref() == Some("LowerStorageClassMissing")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("nowhere")
        }))
    })
    .await
    .unwrap();
    assert!(warning.note.unwrap().contains("no-such-class"));
    ns.delete().await.unwrap();
}
