//! `kubectl top` and the HorizontalPodAutoscaler for pods on virtual nodes, end to end: a
//! real metrics-server in each cluster, kwok simulating the lower kubelets' resource
//! metrics with usage the test sets (annotations, see `tensile_harness::metrics_server`),
//! and the virtual nodes' `/metrics/resource` between them. The lower API server will not
//! proxy to kwok's loopback node addresses, so the virtual nodes read the lower metrics API
//! (their fallback), as they would for an identity without `nodes/proxy`. Its own test
//! binary: its clusters run metrics-servers and a fast HPA controller.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{TIMEOUT, start_node};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::autoscaling::v2::HorizontalPodAutoscaler;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tensile_harness::fixtures::{bound_pod, deployment, virtual_node_toleration};
use tensile_harness::metrics_server::{
    USAGE_CPU_ANNOTATION, USAGE_MEMORY_ANNOTATION, fast_hpa_controller_args,
};
use tensile_harness::{ClusterPair, PairOptions, TestNamespace, invariant, wait_for};

const A: &str = "vk-top-a";
const B: &str = "vk-top-b";
/// Usage goes through two metrics-servers (10 s resolution each) and the virtual node:
/// about a minute from a change to what `kubectl top` and the HPA see.
const METRICS_TIMEOUT: Duration = Duration::from_secs(240);

/// `kubectl top <args>` upstairs: its rows, name → (millicores, MiB).
fn top(pair: &ClusterPair, args: &[&str]) -> Result<BTreeMap<String, (u64, u64)>, String> {
    let output = std::process::Command::new(pair.bin("kubectl"))
        .arg("--kubeconfig")
        .arg(pair.upper_kubeconfig())
        .arg("top")
        .args(args)
        .arg("--no-headers")
        .output()
        .map_err(|e| e.to_string())?;
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).trim().to_owned());
    }
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let mut rows = BTreeMap::new();
    for line in text.lines() {
        // Pods: NAME CPU MEMORY; nodes: NAME CPU CPU% MEMORY MEMORY%.
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (Some(name), Some(cpu)) = (fields.first(), fields.get(1)) else {
            continue;
        };
        let cpu = cpu.strip_suffix('m').and_then(|m| m.parse().ok());
        let memory = fields
            .iter()
            .skip(2)
            .find_map(|f| f.strip_suffix("Mi").and_then(|m| m.parse().ok()));
        if let (Some(cpu), Some(memory)) = (cpu, memory) {
            rows.insert((*name).to_owned(), (cpu, memory));
        }
    }
    if rows.is_empty() {
        return Err(format!("no row read from {text:?}"));
    }
    Ok(rows)
}

/// Whether `got` millicores is within 20 % of `want`.
fn near(got: u64, want: u64) -> bool {
    got.abs_diff(want) * 5 <= want
}

/// A pod bound to `node` whose simulated usage below is `cpu` and `memory`.
fn using(name: &str, node: &str, cpu: &str, memory: &str) -> Pod {
    let mut pod = bound_pod(name, node);
    pod.metadata.annotations = Some(
        [
            (USAGE_CPU_ANNOTATION.to_owned(), cpu.to_owned()),
            (USAGE_MEMORY_ANNOTATION.to_owned(), memory.to_owned()),
        ]
        .into(),
    );
    pod
}

#[tokio::test]
async fn kubectl_top_and_an_hpa_see_the_usage_of_pods_on_virtual_nodes() {
    let mut options = PairOptions::default();
    options.upper.metrics = true;
    options.lower.metrics = true;
    // An HPA that acts in seconds.
    options.upper.controller_manager_args = fast_hpa_controller_args();
    let pair = ClusterPair::start(options).await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    // Two virtual nodes on the one lower cluster.
    let mut vk_a = start_node(&pair, A, &[]).await;
    let mut vk_b = start_node(&pair, B, &[]).await;
    let ns = TestNamespace::create(&upper, "top").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    for pod in [
        using("a-0", A, "250m", "64Mi"),
        using("a-1", A, "150m", "32Mi"),
        using("b-0", B, "300m", "128Mi"),
    ] {
        pods.create(&PostParams::default(), &pod).await.unwrap();
    }
    common::wait_running(&pods, "", 3).await;

    // kubectl top pod: each pod's usage as set below, under its upper name.
    let want = BTreeMap::from([
        ("a-0".to_owned(), (250, 64)),
        ("a-1".to_owned(), (150, 32)),
        ("b-0".to_owned(), (300, 128)),
    ]);
    let last = std::sync::Mutex::new(Err(String::new()));
    let shown = wait_for(
        "kubectl top pod to show the usage set below",
        METRICS_TIMEOUT,
        || async {
            let rows = top(&pair, &["pod", "-n", &ns.name]);
            let matches = rows.as_ref().is_ok_and(|rows| {
                want.iter().all(|(name, (cpu, memory))| {
                    rows.get(name)
                        .is_some_and(|(c, m)| near(*c, *cpu) && m == memory)
                })
            });
            *last.lock().unwrap() = rows;
            Ok(matches.then_some(()))
        },
    )
    .await;
    if let Err(error) = shown {
        let _ = (vk_a.check_running(), vk_b.check_running());
        panic!(
            "{error:#}; last: {:?}\n{}",
            last.lock().unwrap(),
            tensile_harness::process::tail(vk_a.log(), 30)
        );
    }
    println!("kubectl top pod: {:?}", last.lock().unwrap());

    // kubectl top node: each virtual node's own pods only (400m and 96Mi on A, 300m and
    // 128Mi on B; the lower nodes run all three).
    let nodes = std::sync::Mutex::new(Err(String::new()));
    let shown = wait_for(
        "kubectl top node to show each virtual node's own pods",
        METRICS_TIMEOUT,
        || async {
            // kubectl top node takes one name.
            let rows = top(&pair, &["node", A]).and_then(|mut rows| {
                rows.extend(top(&pair, &["node", B])?);
                Ok(rows)
            });
            let matches = rows.as_ref().is_ok_and(|rows| {
                rows.get(A).is_some_and(|(c, m)| near(*c, 400) && *m == 96)
                    && rows.get(B).is_some_and(|(c, m)| near(*c, 300) && *m == 128)
            });
            *nodes.lock().unwrap() = rows;
            Ok(matches.then_some(()))
        },
    )
    .await;
    assert!(
        shown.is_ok(),
        "kubectl top node: {:?}",
        nodes.lock().unwrap()
    );
    println!("kubectl top node: {:?}", nodes.lock().unwrap());

    // The HPA loop: a Deployment on vk-top-a whose pods use what their lower node's
    // annotation says; 200m requested, a 50 % target.
    let lower_nodes: Api<Node> = Api::all(lower.clone());
    let set_usage = async |cpu: &str| {
        for node in lower_nodes
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
        {
            let name = node.metadata.name.unwrap();
            lower_nodes
                .patch(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(
                        json!({"metadata": {"annotations": {USAGE_CPU_ANNOTATION: cpu}}}),
                    ),
                )
                .await
                .unwrap();
        }
    };
    set_usage("20m").await;
    let spec = json!({
        "tolerations": [virtual_node_toleration()],
        "nodeSelector": {"kubernetes.io/hostname": A},
        "containers": [{"name": "app", "image": "nginx",
            "resources": {"requests": {"cpu": "200m", "memory": "64Mi"}}}],
    });
    let deployments: Api<Deployment> = Api::namespaced(upper.clone(), &ns.name);
    deployments
        .create(&PostParams::default(), &deployment("scaled", 1, spec))
        .await
        .unwrap();
    let hpa: HorizontalPodAutoscaler = serde_json::from_value(json!({
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "scaled"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "scaled"},
            "minReplicas": 1, "maxReplicas": 4,
            "metrics": [{"type": "Resource", "resource": {"name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": 50}}}],
        },
    }))
    .unwrap();
    let hpas: Api<HorizontalPodAutoscaler> = Api::namespaced(upper.clone(), &ns.name);
    hpas.create(&PostParams::default(), &hpa).await.unwrap();
    let utilization = async || {
        hpas.get("scaled")
            .await
            .ok()
            .and_then(|h| h.status)
            .and_then(|s| s.current_metrics)
            .and_then(|m| m.into_iter().next())
            .and_then(|m| m.resource)
            .and_then(|r| r.current.average_utilization)
    };
    wait_for(
        "the HPA to see the pods' usage (10 %)",
        METRICS_TIMEOUT,
        || async { Ok(utilization().await.filter(|u| *u <= 20).map(|_| ())) },
    )
    .await
    .unwrap();

    // Usage rises to 90 % of the request: scaled out to the maximum, every new pod
    // mirrored below and Running.
    set_usage("180m").await;
    let scaled_to = async |replicas: i32| {
        wait_for(
            &format!("the HPA to scale the Deployment to {replicas}"),
            METRICS_TIMEOUT,
            || async {
                let d = deployments.get("scaled").await?;
                let want = d.spec.and_then(|s| s.replicas) == Some(replicas);
                let ready = d.status.and_then(|s| s.ready_replicas).unwrap_or(0) == replicas;
                Ok((want && ready).then_some(()))
            },
        )
        .await
    };
    if let Err(error) = scaled_to(4).await {
        panic!(
            "{error:#}; HPA utilization {:?}\n{}",
            utilization().await,
            tensile_harness::process::tail(vk_a.log(), 30)
        );
    }
    let (report, _) = invariant::converge(&upper, &lower, A, Some(&ns.name), TIMEOUT)
        .await
        .unwrap();
    assert!(report.holds(), "after the scale-out: {report}");

    // Usage falls: scaled back in.
    set_usage("10m").await;
    scaled_to(1).await.unwrap();
    println!("HPA: scaled out to 4 at 90 % of requests, back to 1 at 5 %");

    vk_a.check_running().unwrap();
    vk_b.check_running().unwrap();
    ns.delete().await.unwrap();
}
