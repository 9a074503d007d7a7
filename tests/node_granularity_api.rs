//! Node granularity (issue 36), what runs per virtual node beyond registration: the
//! kubelet API serves the pods of every virtual node of the member (`kubectl logs` on
//! each), and authorizes a call about a pod on the node that pod is bound to, as that
//! node's kubelet would (a caller allowed `nodes/proxy` on one group node only is refused
//! on the other's pods); and a member's share spans all its virtual nodes (their
//! allocatable adds up to the cap, not the cap each). With `--kubelet-port-range`, each
//! virtual node has a kubelet port of its own, whose `/metrics/resource` is that node's.
//! Its own test binary.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::Path;

use common::granularity::{labelled_lower, ready_virtual_nodes};
use common::{TIMEOUT, kubectl};
use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::json;
use tensile::node::groups::{Granularity, virtual_node_name};
use tensile::node::quantity::milli;
use tensile_harness::fixtures::bound_pod;
use tensile_harness::metrics_server::{USAGE_CPU_ANNOTATION, USAGE_MEMORY_ANNOTATION};
use tensile_harness::pki::ClientCert;
use tensile_harness::{
    ClusterOptions, ClusterPair, KWOK_LOG_LINES, PairOptions, TestNamespace, VirtualNodeOptions,
    wait_for,
};
use tokio::process::Command;

/// The member's name (`--nodename`).
const BASE: &str = "vk-gapi";

/// `GET url` on the kubelet port with a client certificate: the HTTP status code and the
/// body.
async fn get(url: &str, ca: &Path, cert: &ClientCert) -> (u16, String) {
    let output = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "30",
            "-w",
            "\n%{http_code}",
            "--cacert",
        ])
        .arg(ca)
        .arg("--cert")
        .arg(&cert.cert)
        .arg("--key")
        .arg(&cert.key)
        .arg(url)
        .output()
        .await
        .unwrap();
    let out = String::from_utf8_lossy(&output.stdout).into_owned();
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", &out));
    let code = code.trim().parse().unwrap_or_else(|_| {
        panic!(
            "curl {url}: {out} {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (code, body.to_owned())
}

/// Lets user `user` `get` `nodes/<subresource>` of `node` only (a ClusterRole and binding
/// named `user`), and waits until the upper API server says so.
async fn grant(client: &Client, user: &str, node: &str, subresource: &str) {
    let pp = PostParams::default();
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": user},
        "rules": [{"apiGroups": [""], "resources": [format!("nodes/{subresource}")],
                   "verbs": ["get"], "resourceNames": [node]}],
    }))
    .unwrap();
    Api::<ClusterRole>::all(client.clone())
        .create(&pp, &role)
        .await
        .unwrap();
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": user},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": user},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&pp, &binding)
        .await
        .unwrap();
    let reviews: Api<SubjectAccessReview> = Api::all(client.clone());
    let sar: SubjectAccessReview = serde_json::from_value(json!({"spec": {
        "user": user,
        "resourceAttributes": {"verb": "get", "resource": "nodes", "subresource": subresource, "name": node},
    }}))
    .unwrap();
    wait_for(
        &format!("{user} may get nodes/{subresource} of {node}"),
        TIMEOUT,
        || async {
            let answer = reviews.create(&PostParams::default(), &sar).await?;
            Ok(answer.status.is_some_and(|s| s.allowed).then_some(()))
        },
    )
    .await
    .unwrap();
}

/// The sum of the allocatable CPU of `nodes`, in millicores.
fn cpu_sum(nodes: &BTreeMap<String, Node>) -> i128 {
    nodes
        .values()
        .filter_map(|n| {
            n.status
                .as_ref()?
                .allocatable
                .as_ref()?
                .get("cpu")
                .map(milli)
        })
        .sum()
}

/// A member of `node` granularity over 2 lower kwok nodes of 4 CPU, its share `cpu=3`:
/// its 2 virtual nodes offer 3 CPU together (1500m each: the cap split by their room), not
/// 3 each; a pod bound to each is Running and `kubectl logs` reads both through the one
/// kubelet endpoint; a caller allowed `nodes/proxy` on the first virtual node only reads
/// the log of the first's pod straight from the kubelet port and is refused (403, on the
/// second node's name) the second's, and `/pods` (the whole member's, reviewed on
/// `--nodename`); `/metrics/resource` has no node series.
#[tokio::test]
async fn each_virtual_node_has_its_kubelet_api_and_the_share_spans_them() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let (lower, lower_names) = labelled_lower(
        pair,
        "lower-gapi",
        2,
        (Ipv4Addr::new(10, 93, 0, 0), 16),
        "10.223.0.0/16",
        |_| json!({}),
    )
    .await;
    let names: Vec<String> = lower_names
        .iter()
        .map(|n| virtual_node_name(BASE, &Granularity::Node, n))
        .collect();

    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), BASE);
    options.lower_kubeconfig = Some(lower.kubeconfig.clone());
    options.args = vec![
        "--node-granularity".into(),
        "node".into(),
        "--share".into(),
        "cpu=3".into(),
    ];
    let mut vn = pair.start_virtual_node(&options).unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    let grouped = ready_virtual_nodes(
        &mut vn,
        &nodes,
        BASE,
        "2 Ready virtual nodes whose allocatable CPU is known",
        |r| r.len() == 2,
    )
    .await;
    assert_eq!(grouped.keys().cloned().collect::<Vec<_>>(), names);

    // The share spans both virtual nodes.
    let per_node: Vec<String> = grouped
        .values()
        .map(|n| {
            n.status.as_ref().unwrap().allocatable.as_ref().unwrap()["cpu"]
                .0
                .clone()
        })
        .collect();
    println!("allocatable cpu per virtual node: {per_node:?}");
    assert_eq!(
        cpu_sum(&grouped),
        3000,
        "the virtual nodes offer cpu=3 together: {per_node:?}"
    );
    assert_eq!(
        per_node,
        ["1500m", "1500m"],
        "split by their room (4 CPU each)"
    );

    // A pod bound to each virtual node; kubectl logs reads both.
    let ns = TestNamespace::create(&upper, "gran-api").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let pod_names = ["on-first", "on-second"];
    for (pod, node) in pod_names.iter().zip(&names) {
        pods.create(&PostParams::default(), &bound_pod(pod, node))
            .await
            .unwrap();
    }
    for pod in pod_names {
        wait_for(&format!("pod {pod} Running upstairs"), TIMEOUT, || async {
            Ok(pods.get(pod).await.ok().filter(common::running).map(|_| ()))
        })
        .await
        .unwrap();
        let out = kubectl(
            pair,
            pair.upper_kubeconfig(),
            &["logs", pod, "-c", "app", "-n", &ns.name],
            b"",
        )
        .await;
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains(KWOK_LOG_LINES[0]),
            "kubectl logs {pod}: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // Allowed nodes/proxy on the first virtual node only.
    let user = "gapi-first-only";
    grant(&upper, user, &names[0], "proxy").await;
    let cert = pair.upper.pki.issue_client(user, &[]).unwrap();
    let base = format!("https://127.0.0.1:{}", vn.kubelet_port);
    let ca = &pair.upper.pki.ca_cert;
    let (code, body) = get(
        &format!("{base}/containerLogs/{}/{}/app", ns.name, pod_names[0]),
        ca,
        &cert,
    )
    .await;
    println!("the first node's pod: {code} {body:?}");
    assert!(
        code == 200 && body.contains(KWOK_LOG_LINES[0]),
        "the first node's pod: {code} {body:?}"
    );
    let (code, body) = get(
        &format!("{base}/containerLogs/{}/{}/app", ns.name, pod_names[1]),
        ca,
        &cert,
    )
    .await;
    println!("the second node's pod: {code} {body:?}");
    assert!(
        code == 403 && body.contains("subresource(s)=[proxy]"),
        "the second node's pod: {code} {body:?}"
    );

    // A call that names no pod covers the whole member: reviewed on `--nodename`, which a
    // grant on one virtual node does not open.
    let (code, body) = get(&format!("{base}/pods"), ca, &cert).await;
    assert!(
        code == 403 && body.contains("subresource(s)=[pods proxy]"),
        "/pods: {code} {body:?}"
    );
    // /metrics/resource of group nodes: no node series (no one virtual node's usage can be
    // told from the call), rather than the member's total.
    let scraper = "gapi-metrics";
    grant(&upper, scraper, BASE, "metrics").await;
    let scraper_cert = pair.upper.pki.issue_client(scraper, &[]).unwrap();
    let (code, body) = get(&format!("{base}/metrics/resource"), ca, &scraper_cert).await;
    println!("/metrics/resource: {code} {body:?}");
    assert_eq!(code, 200, "/metrics/resource: {body:?}");
    assert!(
        body.contains("# TYPE node_cpu_usage_seconds_total counter")
            && !body
                .lines()
                .any(|l| l.starts_with("node_cpu_usage_seconds_total ")
                    || l.starts_with("node_memory_working_set_bytes ")),
        "/metrics/resource: {body:?}"
    );

    vn.check_running().unwrap();
    let dp = DeleteParams::default();
    for name in [user, scraper] {
        Api::<ClusterRoleBinding>::all(upper.clone())
            .delete(name, &dp)
            .await
            .unwrap();
        Api::<ClusterRole>::all(upper.clone())
            .delete(name, &dp)
            .await
            .unwrap();
    }
    ns.delete().await.unwrap();
    vn.stop().unwrap();
}

/// The kubelet port a Node advertises.
fn advertised_port(node: &Node) -> u16 {
    let port = node
        .status
        .as_ref()
        .and_then(|s| s.daemon_endpoints.as_ref())
        .and_then(|d| d.kubelet_endpoint.as_ref())
        .map_or(0, |e| e.port);
    u16::try_from(port).unwrap()
}

/// `--kubelet-port-range` with `node` granularity over 2 lower kwok nodes (the lower
/// cluster runs metrics-server; the virtual node reads it, kwok's loopback kubelets being
/// out of the lower API server's proxy's reach): each virtual node advertises a port of its
/// own from the range, and `/metrics/resource` there has that node's pod alone and a node
/// series (before: one shared port, all the member's pods and no node series); a caller
/// allowed `nodes/metrics` on one virtual node reads its port and is refused (403) the
/// other's, which is authorized on that node's name. A restart keeps the ports.
#[tokio::test]
async fn each_virtual_node_has_its_own_kubelet_port_and_node_metrics() {
    const MEMBER: &str = "vk-gport";
    // Its own pair: metrics-server upstairs too (`kubectl top node`).
    let mut pair_options = PairOptions::default();
    pair_options.upper.metrics = true;
    pair_options.lower = ClusterOptions::new(
        "lower-gport",
        2,
        (Ipv4Addr::new(10, 92, 0, 0), 16),
        "10.222.0.0/16",
    );
    pair_options.lower.metrics = true;
    let pair = ClusterPair::start(pair_options).await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let lower = &pair.lower;
    let lower_client = lower.client().await.unwrap();
    let mut lower_names: Vec<String> = Api::<Node>::all(lower_client.clone())
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|n| n.metadata.name)
        .collect();
    lower_names.sort();
    let names: Vec<String> = lower_names
        .iter()
        .map(|n| virtual_node_name(MEMBER, &Granularity::Node, n))
        .collect();

    // 8 ports from a free one: a port of the range another process holds is skipped.
    let from = tensile_harness::ports::free_port().unwrap().min(65_000);
    let range = (from, from + 7);
    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), MEMBER);
    options.lower_kubeconfig = Some(lower.kubeconfig.clone());
    options.args = vec![
        "--node-granularity".into(),
        "node".into(),
        "--kubelet-port-range".into(),
        format!("{}-{}", range.0, range.1),
    ];
    let mut vn = pair.start_virtual_node(&options).unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    let grouped = ready_virtual_nodes(&mut vn, &nodes, MEMBER, "2 Ready virtual nodes", |r| {
        r.len() == 2
    })
    .await;
    assert_eq!(grouped.keys().cloned().collect::<Vec<_>>(), names);
    let ports: Vec<u16> = grouped.values().map(advertised_port).collect();
    println!(
        "kubelet ports: {ports:?} (range {range:?}, shared {})",
        vn.kubelet_port
    );
    assert!(
        ports[0] != ports[1]
            && ports
                .iter()
                .all(|p| (range.0..=range.1).contains(p) && *p != vn.kubelet_port),
        "a port of the range each: {ports:?}, range {range:?}, shared {}",
        vn.kubelet_port
    );

    // A pod bound to each virtual node, with simulated usage below.
    let ns = TestNamespace::create(&upper, "gran-port").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let pod_names = ["port-first", "port-second"];
    for (pod, node) in pod_names.iter().zip(&names) {
        let mut pod = bound_pod(pod, node);
        pod.metadata.annotations = Some(
            [
                (USAGE_CPU_ANNOTATION.to_owned(), "200m".to_owned()),
                (USAGE_MEMORY_ANNOTATION.to_owned(), "64Mi".to_owned()),
            ]
            .into(),
        );
        pods.create(&PostParams::default(), &pod).await.unwrap();
    }
    for pod in pod_names {
        wait_for(&format!("pod {pod} Running upstairs"), TIMEOUT, || async {
            Ok(pods.get(pod).await.ok().filter(common::running).map(|_| ()))
        })
        .await
        .unwrap();
    }

    // A restart keeps each virtual node's port (read from its Node), even with the range
    // widened below (where a fresh start would begin): the scrapes below reach the new
    // process at the ports from before.
    vn.stop().unwrap();
    options.args[3] = format!("{}-{}", range.0 - 1, range.1);
    vn = pair.start_virtual_node(&options).unwrap();

    let ca = &pair.upper.pki.ca_cert;
    let dp = DeleteParams::default();
    for (i, node) in names.iter().enumerate() {
        let (own, other) = (pod_names[i], pod_names[1 - i]);
        let user = format!("gport-metrics-{i}");
        grant(&upper, &user, node, "metrics").await;
        let cert = pair.upper.pki.issue_client(&user, &[]).unwrap();
        let url = |port: u16| format!("https://127.0.0.1:{port}/metrics/resource");
        let pod_series = |pod: &str| format!("pod=\"{pod}\"");
        // The lower metrics-server's first readings take a resolution or two.
        let last = std::sync::Mutex::new(String::new());
        let scraped = wait_for(
            &format!("{node}'s port to report its pod {own}"),
            TIMEOUT,
            || async {
                let (code, body) = get(&url(ports[i]), ca, &cert).await;
                let done = code == 200
                    && body.lines().any(|l| {
                        l.starts_with("pod_cpu_usage_seconds_total") && l.contains(&pod_series(own))
                    });
                *last.lock().unwrap() = format!("{code} {body}");
                Ok(done.then_some(body))
            },
        )
        .await;
        let body = match scraped {
            Ok(body) => body,
            Err(error) => panic!("{error:#}: {}", last.lock().unwrap()),
        };
        println!("{node} (port {}) /metrics/resource:\n{body}", ports[i]);
        assert!(
            !body.contains(&pod_series(other)),
            "{node}'s port reports the other node's pod {other}: {body}"
        );
        for family in [
            "node_cpu_usage_seconds_total ",
            "node_memory_working_set_bytes ",
        ] {
            assert!(
                body.lines().any(|l| l.starts_with(family)),
                "{node}'s port: no {family}series: {body}"
            );
        }
        // The other node's port is authorized on the other node's name.
        let (code, body) = get(&url(ports[1 - i]), ca, &cert).await;
        println!("{user} on {}'s port: {code} {body:?}", names[1 - i]);
        assert!(
            code == 403 && body.contains("subresource(s)=[metrics]"),
            "{user} on {}'s port: {code} {body:?}",
            names[1 - i]
        );
        Api::<ClusterRoleBinding>::all(upper.clone())
            .delete(&user, &dp)
            .await
            .unwrap();
        Api::<ClusterRole>::all(upper.clone())
            .delete(&user, &dp)
            .await
            .unwrap();
    }

    let mut after = Vec::new();
    for name in &names {
        after.push(advertised_port(&nodes.get(name).await.unwrap()));
    }
    assert_eq!(after, ports, "the ports after a restart");

    // metrics-server upstairs (`--kubelet-use-node-status-port`) scrapes each virtual node
    // at its own port: `kubectl top node` shows each one's usage (its pod's 200m, 64Mi),
    // not `<unknown>`.
    let last = std::sync::Mutex::new(String::new());
    let shown = wait_for(
        "kubectl top node to show both virtual nodes",
        TIMEOUT,
        || async {
            let output = Command::new(pair.bin("kubectl"))
                .arg("--kubeconfig")
                .arg(pair.upper_kubeconfig())
                .args(["top", "node", "--no-headers"])
                .output()
                .await?;
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
            // NAME CPU(cores) CPU% MEMORY(bytes) MEMORY%: each row's CPU in millicores.
            let cpu: Vec<Option<u64>> = text
                .lines()
                .filter(|l| names.iter().any(|n| l.starts_with(n.as_str())))
                .map(|l| {
                    let cpu = l.split_whitespace().nth(1)?;
                    cpu.strip_suffix('m')?.parse().ok()
                })
                .collect();
            *last.lock().unwrap() = text.clone();
            let done =
                cpu.len() == 2 && cpu.iter().all(|c| c.is_some_and(|c| c.abs_diff(200) <= 40));
            Ok(done.then_some(text))
        },
    )
    .await;
    match shown {
        Ok(text) => println!("kubectl top node:\n{text}"),
        Err(error) => panic!("{error:#}: {}", last.lock().unwrap()),
    }

    vn.check_running().unwrap();
    ns.delete().await.unwrap();
    vn.stop().unwrap();
}
