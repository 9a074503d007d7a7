//! tensile as users install it: the images of the `Dockerfile` (built by
//! `tests/k8s/images/build.sh`) imported into a real node of the upper cluster, the chart
//! installed with helm, and what a platform team checks next: every pod Running and Ready on
//! that node, `vk-node` registered by the in-cluster virtual-node at its pod IP, a labelled
//! Deployment kept local by the webhook and the extender until the regular node is full and
//! then run below on a real node, `kubectl logs`, `exec`, `port-forward` and `top` through
//! the in-cluster virtual-node; `helm upgrade` to other images and two replicas under
//! leader election while the burst pods run (nothing below touched, the node never
//! NotReady, no pod refused); `helm uninstall` (what is left, as the README says).
//! What differs from a production cluster (no kube-proxy): `tensile_harness::install`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{Streaming, TIMEOUT};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{
    ConfigMap, Namespace, Node, Pod, Secret, Service, ServiceAccount,
};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tensile::translate::meta::OWNER_NODE_LABEL;
use tensile_harness::install::{self, LOWER_REAL_NODE, NAMESPACE, UPPER_REAL_NODE, VIRTUAL_NODE};
use tensile_harness::real_node::BUSYBOX_IMAGE;
use tensile_harness::{ClusterPair, TestNamespace, real_node_placement, wait_for};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The images' tag at install, and the one `helm upgrade` moves to (same contents).
const TAG: &str = "0.0.0-install";
const UPGRADE_TAG: &str = "0.0.0-upgrade";
/// The upper cluster's one regular node: room for three workload pods.
const REGULAR_NODE: &str = "upper-node-0";
const REGULAR_CPU: &str = "1";
const POD_CPU: &str = "300m";
/// Usage goes through two metrics-servers of 10 s resolution.
const METRICS_TIMEOUT: Duration = Duration::from_secs(240);

fn images(tag: &str) -> Vec<std::path::PathBuf> {
    tensile_harness::images::Images::build(Some(tag))
        .unwrap_or_else(|e| panic!("building the images: {e:#}"))
        .all()
        .map(|image| image.tarball.clone())
        .to_vec()
}

/// The workload: busybox that says it started, then echoes each connection on 8080; placed
/// on the real node below (`clusterSelector`, as a user of tensile-kube writes it).
fn workload(replicas: i32) -> Deployment {
    serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {
                    "labels": {"app": "web", "virtual-pod": "true"},
                    "annotations": {"clusterSelector": real_node_placement().to_string()},
                },
                "spec": {
                    "automountServiceAccountToken": false,
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{
                        "name": "app",
                        "image": BUSYBOX_IMAGE,
                        "command": ["sh", "-c", "echo started; exec nc -ll -p 8080 -e cat"],
                        "resources": {"requests": {"cpu": POD_CPU, "memory": "16Mi"}},
                    }],
                },
            },
        },
    }))
    .unwrap()
}

fn node_of(pod: &Pod) -> Option<&str> {
    pod.spec.as_ref().and_then(|s| s.node_name.as_deref())
}

/// Waits until `n` pods of the workload run, and returns them by name.
async fn running_workload(api: &Api<Pod>, n: usize) -> BTreeMap<String, Pod> {
    wait_for(&format!("{n} workload pods Running"), TIMEOUT, || async {
        let pods = api.list(&ListParams::default().labels("app=web")).await?;
        let running: BTreeMap<String, Pod> = pods
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && common::running(p))
            .map(|p| (p.metadata.name.clone().unwrap(), p))
            .collect();
        Ok((running.len() == n).then_some(running))
    })
    .await
    .unwrap()
}

/// The lower copies of the workload: name -> (UID, restart count, node).
async fn lower_copies(api: &Api<Pod>) -> BTreeMap<String, (String, i32, String)> {
    api.list(&ListParams::default().labels("app=web"))
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|p| {
            let restarts = p
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .map(|c| c.iter().map(|c| c.restart_count).sum())
                .unwrap_or(0);
            (
                p.metadata.name.clone().unwrap(),
                (
                    p.metadata.uid.clone().unwrap(),
                    restarts,
                    node_of(&p).unwrap_or_default().to_owned(),
                ),
            )
        })
        .collect()
}

async fn text(pair: &ClusterPair, args: &[&str]) -> String {
    let out = common::kubectl(pair, pair.upper_kubeconfig(), args, b"").await;
    assert!(
        out.status.success(),
        "kubectl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn helm_install_bursts_through_the_in_cluster_virtual_node_and_upgrade_touches_nothing() {
    let pair = ClusterPair::start(install::pair_options(REGULAR_CPU))
        .await
        .unwrap();
    let mut tarballs = images(TAG);
    tarballs.extend(images(UPGRADE_TAG));
    let installed = install::install(&pair, &tarballs, TAG, 1)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    println!(
        "helm install -> every Deployment available: {:.1} s; -> {VIRTUAL_NODE} Ready: {:.1} s",
        installed.install_to_running.as_secs_f64(),
        installed.install_to_node_ready.as_secs_f64()
    );
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();

    // Every pod of the chart on the upper real node, Ready, non-root with a read-only root,
    // from the images imported there; the node at the virtual-node pod's IP.
    let tensile_pods: Api<Pod> = Api::namespaced(upper.clone(), NAMESPACE);
    let pods = tensile_pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .items;
    assert_eq!(
        pods.len(),
        7,
        "1 virtual-node and 2 of each other component"
    );
    for pod in &pods {
        let name = pod.metadata.name.as_deref().unwrap();
        assert_eq!(node_of(pod), Some(UPPER_REAL_NODE), "{name}");
        let container = &pod.spec.as_ref().unwrap().containers[0];
        assert!(
            container
                .image
                .as_deref()
                .unwrap()
                .ends_with(&format!(":{TAG}")),
            "{name}: {:?}",
            container.image
        );
        let security = container.security_context.as_ref().unwrap();
        assert_eq!(security.read_only_root_filesystem, Some(true), "{name}");
        assert_eq!(security.run_as_non_root, Some(true), "{name}");
        let statuses = pod.status.as_ref().unwrap().container_statuses.as_ref();
        assert!(
            statuses.is_some_and(|s| s.iter().all(|c| c.ready)),
            "{name} not Ready: {:?}",
            pod.status
        );
    }
    let virtual_node_pod = pods
        .iter()
        .find(|p| p.metadata.labels.as_ref().unwrap()["app"] == "virtual-node")
        .unwrap();
    let pod_ip = virtual_node_pod.status.as_ref().unwrap().pod_ip.clone();
    let node = Api::<Node>::all(upper.clone())
        .get(VIRTUAL_NODE)
        .await
        .unwrap();
    let addresses = node.status.as_ref().unwrap().addresses.clone().unwrap();
    let internal = addresses
        .iter()
        .find(|a| a.type_ == "InternalIP")
        .map(|a| a.address.clone());
    assert_eq!(internal, pod_ip, "{VIRTUAL_NODE}'s address: {addresses:?}");

    // The burst: local while the regular node has room, then below.
    let ns = TestNamespace::create(&upper, "install").await.unwrap();
    let n = ns.name.as_str();
    let deployments: Api<Deployment> = Api::namespaced(upper.clone(), n);
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), n);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), n);
    deployments
        .create(&PostParams::default(), &workload(3))
        .await
        .unwrap();
    let local = running_workload(&upper_pods, 3).await;
    for (name, pod) in &local {
        assert_eq!(node_of(pod), Some(REGULAR_NODE), "{name} kept local");
        let tolerations = pod.spec.as_ref().unwrap().tolerations.clone();
        assert!(
            tolerations
                .unwrap_or_default()
                .iter()
                .any(|t| t.key.as_deref() == Some("virtual-kubelet.io/provider")),
            "{name} went through the webhook"
        );
    }
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 5}})),
        )
        .await
        .unwrap();
    let all = running_workload(&upper_pods, 5).await;
    let burst: Vec<&String> = all
        .iter()
        .filter(|(_, p)| node_of(p) == Some(VIRTUAL_NODE))
        .map(|(name, _)| name)
        .collect();
    assert_eq!(burst.len(), 2, "two burst, three local: {:?}", all.keys());
    let below = wait_for(
        "the burst pods Running on the lower real node",
        TIMEOUT,
        || async {
            let copies = lower_copies(&lower_pods).await;
            let on_real = copies
                .values()
                .filter(|(_, _, node)| node == LOWER_REAL_NODE)
                .count();
            let running = lower_pods
                .list(&ListParams::default().labels("app=web"))
                .await?
                .items
                .iter()
                .filter(|p| common::running(p))
                .count();
            Ok((on_real == 2 && running == 2).then_some(copies))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n{}", installed.lower_node.logs_tail(20)));

    // kubectl through the in-cluster virtual-node.
    let pod = burst[0].as_str();
    let logs = text(&pair, &["-n", n, "logs", pod]).await;
    assert_eq!(logs.trim(), "started", "kubectl logs {pod}");
    let exec = text(
        &pair,
        &["-n", n, "exec", pod, "--", "echo", "through vk-node"],
    )
    .await;
    assert_eq!(exec.trim(), "through vk-node", "kubectl exec {pod}");
    let mut forward = Streaming::start(
        &pair,
        pair.upper_kubeconfig(),
        &[
            "-n",
            n,
            "port-forward",
            &format!("pod/{pod}"),
            ":8080",
            "--address=127.0.0.1",
        ],
    );
    let line = forward.next_line().await;
    let port: u16 = line
        .strip_prefix("Forwarding from 127.0.0.1:")
        .and_then(|rest| rest.split(' ').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("{line:?}"));
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    conn.write_all(b"hello through the install\n")
        .await
        .unwrap();
    let mut back = vec![0; 26];
    tokio::time::timeout(TIMEOUT, conn.read_exact(&mut back))
        .await
        .expect("the echo in time")
        .unwrap();
    assert_eq!(back, b"hello through the install\n", "port-forward {pod}");
    drop(conn);
    forward.stop().await;
    wait_for(
        "kubectl top pod through vk-node",
        METRICS_TIMEOUT,
        || async {
            let out = common::kubectl(
                &pair,
                pair.upper_kubeconfig(),
                &["-n", n, "top", "pod", pod, "--no-headers"],
                b"",
            )
            .await;
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            Ok((out.status.success() && stdout.starts_with(pod)).then_some(()))
        },
    )
    .await
    .unwrap();

    // helm upgrade to other images and two virtual-node replicas under leader election,
    // while the burst pods run: the node stays Ready, the webhook refuses nothing, and
    // nothing below changes.
    let stop = Arc::new(AtomicBool::new(false));
    let watch_node = {
        let (nodes, stop) = (Api::<Node>::all(upper.clone()), stop.clone());
        tokio::spawn(async move {
            let mut not_ready = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                match nodes.get(VIRTUAL_NODE).await {
                    Ok(node) if tensile_harness::cluster::node_is_ready(&node) => {}
                    Ok(node) => not_ready.push(format!("{:?}", node.status.map(|s| s.conditions))),
                    Err(error) => not_ready.push(error.to_string()),
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            not_ready
        })
    };
    let create_pods = {
        let (api, stop) = (upper_pods.clone(), stop.clone());
        tokio::spawn(async move {
            let (mut created, mut refused) = (0, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                // Gated: never scheduled, only admitted.
                let pod: Pod = serde_json::from_value(json!({
                    "metadata": {"name": format!("probe-{created}"), "labels": {"virtual-pod": "true"}},
                    "spec": {
                        "schedulingGates": [{"name": "tensile.dev/test-probe"}],
                        "containers": [{"name": "c", "image": BUSYBOX_IMAGE}],
                    },
                }))
                .unwrap();
                match api.create(&PostParams::default(), &pod).await {
                    Ok(pod) => {
                        let mutated = pod
                            .spec
                            .unwrap()
                            .tolerations
                            .unwrap_or_default()
                            .iter()
                            .any(|t| t.key.as_deref() == Some("virtual-kubelet.io/provider"));
                        if !mutated {
                            refused.push(format!("probe-{created} not mutated"));
                        }
                    }
                    Err(error) => refused.push(format!("probe-{created}: {error}")),
                }
                created += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            (created, refused)
        })
    };
    let values = pair.dir.join("upgrade-values.json");
    std::fs::write(
        &values,
        install::values(&pair.upper, UPGRADE_TAG, 2)
            .unwrap()
            .to_string(),
    )
    .unwrap();
    let started = std::time::Instant::now();
    install::helm(
        &installed.helm_home,
        pair.upper_kubeconfig(),
        &[
            "upgrade",
            install::RELEASE,
            install::CHART,
            "--namespace",
            NAMESPACE,
            "--values",
            values.to_str().unwrap(),
        ],
    )
    .unwrap();
    install::wait_available(&upper, NAMESPACE, install::INSTALL_TIMEOUT)
        .await
        .unwrap();
    let upgrade_took = started.elapsed();
    // A while more under the new leader before the verdict.
    let leader_settled = wait_for("both virtual-node replicas Ready", TIMEOUT, || async {
        let pods = tensile_pods
            .list(&ListParams::default().labels("app=virtual-node"))
            .await?
            .items;
        let ready = pods
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && common::running(p))
            .count();
        Ok((ready == 2 && pods.len() == 2).then_some(()))
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    leader_settled.unwrap();
    let not_ready = watch_node.await.unwrap();
    let (probes, refused) = create_pods.await.unwrap();
    println!(
        "helm upgrade -> every Deployment available: {:.1} s ({probes} pods admitted meanwhile)",
        upgrade_took.as_secs_f64()
    );
    assert!(
        not_ready.is_empty(),
        "{VIRTUAL_NODE} not Ready during the upgrade: {not_ready:?}"
    );
    assert!(
        refused.is_empty(),
        "pods refused during the upgrade: {refused:?}"
    );
    // The old pods leave after their preStop pause: wait for them, then every pod left
    // runs the new tag.
    let suffix = format!(":{UPGRADE_TAG}");
    wait_for(
        "every tensile pod from the upgrade's tag",
        TIMEOUT,
        || async {
            let pods = tensile_pods.list(&ListParams::default()).await?.items;
            let all_new = pods.iter().all(|pod| {
                pod.spec
                    .as_ref()
                    .and_then(|spec| spec.containers.first()?.image.as_deref())
                    .is_some_and(|image| image.ends_with(&suffix))
            });
            Ok(all_new.then_some(()))
        },
    )
    .await
    .unwrap();
    let after = lower_copies(&lower_pods).await;
    assert_eq!(
        after, below,
        "the lower copies (UID, restarts, node) before and after"
    );
    running_workload(&upper_pods, 5).await;

    // helm uninstall: the pre-delete hook removes the virtual node as a member leaves (its
    // pods evicted, their lower copies deleted, virtual-node stopped, what tensile made
    // below deleted, the Node and its Lease), then helm deletes the release.
    let started = std::time::Instant::now();
    install::helm(
        &installed.helm_home,
        pair.upper_kubeconfig(),
        &[
            "uninstall",
            install::RELEASE,
            "--namespace",
            NAMESPACE,
            "--wait",
            "--timeout",
            "5m",
        ],
    )
    .unwrap();
    println!(
        "helm uninstall (drain, virtual-node stopped, lower cleaned, node deleted): {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let nodes: Api<Node> = Api::all(upper.clone());
    assert!(
        nodes.get_opt(VIRTUAL_NODE).await.unwrap().is_none(),
        "{VIRTUAL_NODE} deleted"
    );
    let leases: Api<Lease> = Api::namespaced(upper.clone(), "kube-node-lease");
    assert!(
        leases.get_opt(VIRTUAL_NODE).await.unwrap().is_none(),
        "its Lease deleted"
    );
    // The workload: the three local pods untouched; the two evicted ones re-created by
    // their ReplicaSet, with no room left anywhere.
    let workload_pods = upper_pods
        .list(&ListParams::default().labels("app=web"))
        .await
        .unwrap()
        .items;
    for (name, pod) in &local {
        assert!(
            workload_pods
                .iter()
                .any(|p| p.metadata.uid == pod.metadata.uid),
            "local pod {name} untouched"
        );
    }
    assert!(
        workload_pods
            .iter()
            .all(|p| node_of(p) != Some(VIRTUAL_NODE)),
        "no workload pod left on {VIRTUAL_NODE}"
    );
    // Nothing of the release upstairs but the user's Secret; nothing of tensile's below.
    wait_for("the release's pods gone", TIMEOUT, || async {
        let left = tensile_pods.list(&ListParams::default()).await?.items;
        Ok(left.is_empty().then_some(()))
    })
    .await
    .unwrap();
    let release = ListParams::default().labels("app.kubernetes.io/part-of=tensile");
    let mut left = Vec::new();
    left.extend(names::<Deployment>(&upper, Some(NAMESPACE), &release).await);
    left.extend(names::<Service>(&upper, Some(NAMESPACE), &release).await);
    left.extend(names::<Secret>(&upper, Some(NAMESPACE), &ListParams::default()).await);
    left.extend(names::<ServiceAccount>(&upper, Some(NAMESPACE), &release).await);
    left.extend(names::<ClusterRole>(&upper, None, &release).await);
    left.extend(names::<ClusterRoleBinding>(&upper, None, &release).await);
    left.extend(names::<MutatingWebhookConfiguration>(&upper, None, &release).await);
    assert_eq!(
        left,
        [format!("Secret {NAMESPACE}/{}", install::LOWER_SECRET)],
        "upstairs after helm uninstall"
    );
    let marked = ListParams::default().labels(&format!("{OWNER_NODE_LABEL}={VIRTUAL_NODE}"));
    let mut below = Vec::new();
    below.extend(names::<Pod>(&lower, None, &marked).await);
    below.extend(names::<ConfigMap>(&lower, None, &marked).await);
    below.extend(names::<Secret>(&lower, None, &marked).await);
    below.extend(names::<ServiceAccount>(&lower, None, &marked).await);
    below.extend(names::<Service>(&lower, None, &marked).await);
    below.extend(names::<EndpointSlice>(&lower, None, &marked).await);
    assert_eq!(below, Vec::<String>::new(), "below after helm uninstall");
    let namespaces = names::<Namespace>(&lower, None, &marked).await;
    println!("left below, as the README says: {namespaces:?}");

    ns.delete().await.unwrap();
}

/// `Kind namespace/name` of each object listed.
async fn names<K>(
    client: &kube::Client,
    namespace: Option<&str>,
    params: &ListParams,
) -> Vec<String>
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Api::<K>::all(client.clone())
        .list(params)
        .await
        .unwrap()
        .items
        .iter()
        .filter(|o| namespace.is_none() || o.meta().namespace.as_deref() == namespace)
        .map(|o| {
            let meta = o.meta();
            let ns = meta
                .namespace
                .as_deref()
                .map(|ns| format!("{ns}/"))
                .unwrap_or_default();
            format!(
                "{} {ns}{}",
                K::kind(&()),
                meta.name.as_deref().unwrap_or_default()
            )
        })
        .collect()
}
