//! Helpers shared by the virtual-node integration tests.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::Client;
use kube::api::{Api, ListParams};
use tensile::member::spec::{KUBECONFIG_KEY, MEMBER_LABEL, NODE_NAME_ANNOTATION};
use tensile_harness::{ClusterPair, VirtualNode, VirtualNodeOptions, node_is_ready, wait_for};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::Command;

pub mod access;
pub mod descheduler;
pub mod granularity;
pub mod ha;

/// Generous: two clusters and several virtual nodes share 2 cores.
pub const TIMEOUT: Duration = Duration::from_secs(120);

/// A binary of this workspace beside `virtual-node` (`cargo build --workspace --bins`).
pub fn workspace_binary(name: &str) -> std::path::PathBuf {
    let path = std::path::Path::new(env!("CARGO_BIN_EXE_virtual-node")).with_file_name(name);
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo build --workspace --bins`",
        path.display()
    );
    path
}

/// Starts `virtual-node --nodename <name>` on `pair` and waits until its Node is Ready.
pub async fn start_node(pair: &ClusterPair, name: &str, args: &[&str]) -> VirtualNode {
    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), name);
    options.args = args.iter().map(ToString::to_string).collect();
    start_node_with(pair, &options, &pair.upper.client().await.unwrap()).await
}

/// Starts `virtual-node` with `options` on `pair` and waits until `upper` (the cluster it
/// joins) shows its Node Ready; panics with the tail of its log if it does not.
pub async fn start_node_with(
    pair: &ClusterPair,
    options: &VirtualNodeOptions,
    upper: &Client,
) -> VirtualNode {
    let name = &options.node_name;
    let mut node = pair.start_virtual_node(options).unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    let result = wait_for(&format!("node {name} Ready"), TIMEOUT, || async {
        Ok(nodes.get_opt(name).await?.filter(node_is_ready).map(|_| ()))
    })
    .await;
    if let Err(error) = result {
        let _ = node.check_running();
        panic!(
            "{error:#}\n--- {}:\n{}",
            node.log().display(),
            tensile_harness::process::tail(node.log(), 40)
        );
    }
    // A restarted node's Node is Ready before its process listens: wait for the listener.
    wait_for("the metrics endpoint", TIMEOUT, || async {
        let listening = tokio::net::TcpStream::connect(("127.0.0.1", node.metrics_port)).await;
        Ok(listening.is_ok().then_some(()))
    })
    .await
    .unwrap();
    node
}

/// Waits until `vn` has completed `rounds` more orphan collection rounds than now, so that
/// "nothing was collected" is asserted after collection had its chance.
pub async fn gc_rounds(vn: &VirtualNode, rounds: u64) {
    let series = "tensile_gc_rounds_total";
    let from = metric(vn, series).await;
    wait_for(
        &format!("{rounds} orphan collection rounds"),
        TIMEOUT,
        || async { Ok((metric(vn, series).await >= from + rounds).then_some(())) },
    )
    .await
    .unwrap();
}

/// Writes the node has sent to the lower cluster so far.
pub async fn lower_writes(vn: &VirtualNode) -> u64 {
    let mut total = 0;
    for verb in ["create", "update", "patch", "delete"] {
        total += metric(
            vn,
            &format!("tensile_api_requests_total{{cluster=\"lower\",verb=\"{verb}\"}}"),
        )
        .await;
    }
    total
}

/// The pods of `api` matching `labels`.
pub async fn pods(api: &Api<Pod>, labels: &str) -> Vec<Pod> {
    api.list(&ListParams::default().labels(labels))
        .await
        .unwrap()
        .items
}

/// What a wait gave, or a panic with the wait's error and the tail of `vn`'s log (after
/// noting whether it still runs): the failure says what virtual-node was doing.
pub fn or_log<T>(waited: anyhow::Result<T>, vn: &mut VirtualNode) -> T {
    match waited {
        Ok(value) => value,
        Err(error) => {
            let _ = vn.check_running();
            panic!(
                "{error:#}\n{}",
                tensile_harness::process::tail(vn.log(), 60)
            );
        }
    }
}

/// Whether a pod is Running with a pod IP.
pub fn running(pod: &Pod) -> bool {
    let status = pod.status.as_ref();
    status.and_then(|s| s.phase.as_deref()) == Some("Running")
        && status.and_then(|s| s.pod_ip.as_ref()).is_some()
}

/// Waits until exactly `n` pods match `labels` and all are Running (with an IP).
pub async fn wait_running(api: &Api<Pod>, labels: &str, n: usize) -> Vec<Pod> {
    wait_for(&format!("{n} pods {labels} Running"), TIMEOUT, || async {
        let list = api.list(&ListParams::default().labels(labels)).await?.items;
        let active: Vec<Pod> = list
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| {
                !matches!(
                    p.status.as_ref().and_then(|s| s.phase.as_deref()),
                    Some("Failed" | "Succeeded")
                )
            })
            .collect();
        Ok((active.len() == n && active.iter().all(running)).then_some(active))
    })
    .await
    .unwrap()
}

/// Waits until no pod matches `labels`.
pub async fn wait_gone(api: &Api<Pod>, labels: &str) {
    wait_for(&format!("no pods {labels}"), TIMEOUT, || async {
        let list = api.list(&ListParams::default().labels(labels)).await?.items;
        Ok(list.is_empty().then_some(()))
    })
    .await
    .unwrap();
}

/// Names of pods.
pub fn names(pods: &[Pod]) -> BTreeSet<String> {
    pods.iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect()
}

/// The value of the series `series` (its name and labels, exactly as exposed) on the
/// node's metrics endpoint. Panics when the endpoint does not export it, so an assertion
/// on a renamed metric fails instead of reading 0.
pub async fn metric(vn: &VirtualNode, series: &str) -> u64 {
    let text = metrics_text(vn).await;
    series_value(&text, series)
        .unwrap_or_else(|| panic!("the metrics endpoint exports no series {series}"))
}

/// The node's metrics endpoint's whole answer.
pub async fn metrics_text(vn: &VirtualNode) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", vn.metrics_port))
        .await
        .unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).await.unwrap();
    text
}

/// The value of `series` in a Prometheus text exposition, if it is there.
fn series_value(text: &str, series: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (name, value) = line.rsplit_once(' ')?;
        (name == series)
            .then(|| value.parse::<f64>().ok())?
            .map(|v| v as u64)
    })
}

/// The status of `node`'s Ready condition (`True`, `False`, `Unknown`), if it has one.
pub fn ready_status(node: &Node) -> Option<String> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.status.clone())
}

/// A member Secret named `name` for the lower cluster of `kubeconfig`, joined as `node`.
pub fn member_secret(name: &str, node: &str, kubeconfig: &std::path::Path) -> Secret {
    let mut secret = Secret::default();
    secret.metadata.name = Some(name.into());
    secret.metadata.labels = Some([(MEMBER_LABEL.to_owned(), "true".to_owned())].into());
    secret.metadata.annotations = Some([(NODE_NAME_ANNOTATION.to_owned(), node.to_owned())].into());
    secret.data = Some(
        [(
            KUBECONFIG_KEY.to_owned(),
            ByteString(std::fs::read(kubeconfig).unwrap()),
        )]
        .into(),
    );
    secret
}

/// A pair of its own whose upper node monitor marks a node whose lease stopped NotReady in
/// seconds, not minutes: a 20 s grace period, which still leaves a missed renewal or two of
/// slack (the lease is renewed every 10 s).
pub async fn pair_with_fast_node_monitor() -> ClusterPair {
    let mut options = tensile_harness::PairOptions::default();
    options.upper.controller_manager_args = vec![
        "--node-monitor-grace-period=20s".into(),
        "--node-monitor-period=1s".into(),
    ];
    ClusterPair::start(options).await.unwrap()
}

/// [`pair_with_fast_node_monitor`] and a second lower cluster `lower-b` of one node, with
/// its service range at `service_net`/16 and pod IPs from `pod_cidr`.
pub async fn fast_pair_and_second_lower(
    service_net: std::net::Ipv4Addr,
    pod_cidr: &str,
) -> (ClusterPair, tensile_harness::Cluster) {
    let pair = pair_with_fast_node_monitor().await;
    let b = pair
        .start_cluster(tensile_harness::ClusterOptions::new(
            "lower-b",
            1,
            (service_net, 16),
            pod_cidr,
        ))
        .await
        .unwrap();
    (pair, b)
}

/// Runs kubectl of the pinned release with `kubeconfig`, feeding `stdin`.
pub async fn kubectl(
    pair: &ClusterPair,
    kubeconfig: &std::path::Path,
    args: &[&str],
    stdin: &[u8],
) -> std::process::Output {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new(pair.bin("kubectl"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin).await.unwrap();
    drop(input);
    tokio::time::timeout(TIMEOUT, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("kubectl {args:?} timed out"))
        .unwrap()
}

/// Starts `virtual-node` as `node` with `args` against `upper` (a second upper cluster of
/// `pair`, its kubeconfig `kubeconfig`) and the pair's lower cluster.
pub async fn start_node_on(
    pair: &ClusterPair,
    upper: &Client,
    kubeconfig: &std::path::Path,
    node: &str,
    args: &[&str],
) -> VirtualNode {
    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), node);
    options.args = args.iter().map(ToString::to_string).collect();
    options.upper_kubeconfig = Some(kubeconfig.to_owned());
    start_node_with(pair, &options, upper).await
}

/// Creates the Namespace `namespace` (with `annotations`) in `client`'s cluster and waits
/// for its `default` ServiceAccount, which pods need.
pub async fn create_namespace(
    client: &Client,
    namespace: &str,
    annotations: std::collections::BTreeMap<String, String>,
) {
    use kube::api::PostParams;
    let mut object = k8s_openapi::api::core::v1::Namespace::default();
    object.metadata.name = Some(namespace.to_owned());
    object.metadata.annotations = (!annotations.is_empty()).then_some(annotations);
    Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .create(&PostParams::default(), &object)
        .await
        .unwrap();
    let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(client.clone(), namespace);
    wait_for("the default ServiceAccount", TIMEOUT, || async {
        Ok(accounts.get_opt("default").await?.map(|_| ()))
    })
    .await
    .unwrap();
}

/// Writes a line to a TTY session's `stdin` until what it prints on `stdout` contains
/// `want` (a resize travels apart from the input, so the command is asked again until the
/// new size shows).
pub async fn until_shown(
    stdin: &mut (impl tokio::io::AsyncWrite + Unpin),
    stdout: &mut (impl tokio::io::AsyncRead + Unpin),
    want: &str,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut seen = String::new();
    let mut buf = [0; 256];
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while !seen.contains(want) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "TTY output {want:?} never shown: {seen:?}"
        );
        stdin.write_all(b"go\n").await.unwrap();
        if let Ok(read) =
            tokio::time::timeout(Duration::from_millis(500), stdout.read(&mut buf)).await
        {
            let n = read.unwrap();
            assert!(n > 0, "TTY closed before {want:?}: {seen:?}");
            seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    }
}

/// A kubectl command that streams (`logs -f`, `attach`, `port-forward`), read line by line.
pub struct Streaming {
    pub child: tokio::process::Child,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
    seen: Vec<String>,
}

impl Streaming {
    pub fn start(pair: &ClusterPair, kubeconfig: &Path, args: &[impl AsRef<OsStr>]) -> Self {
        let mut child = Command::new(pair.bin("kubectl"))
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The next line, failing with kubectl's stderr if it ends first.
    pub async fn next_line(&mut self) -> String {
        let line = tokio::time::timeout(TIMEOUT, self.lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("no line in time; seen {:?}", self.seen))
            .unwrap();
        match line {
            Some(line) => {
                self.seen.push(line.clone());
                line
            }
            None => {
                let mut err = String::new();
                let mut stderr = self.child.stderr.take().unwrap();
                stderr.read_to_string(&mut err).await.unwrap();
                panic!("kubectl ended after {:?}: {err}", self.seen);
            }
        }
    }

    /// Reads until a line containing `text`.
    pub async fn wait_for_line(&mut self, text: &str) -> String {
        loop {
            let line = self.next_line().await;
            if line.contains(text) {
                return line;
            }
        }
    }

    pub async fn stop(mut self) {
        self.child.kill().await.unwrap();
    }
}

/// What the upper API server says of `token` for `audience` (`None`: its own).
pub async fn review(
    upper: &Client,
    token: &str,
    audience: Option<&str>,
) -> k8s_openapi::api::authentication::v1::TokenReviewStatus {
    use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
    let review = TokenReview {
        spec: TokenReviewSpec {
            token: token.to_owned(),
            audiences: audience.map(|a| vec![a.to_owned()]),
        },
        ..TokenReview::default()
    };
    Api::<TokenReview>::all(upper.clone())
        .create(&kube::api::PostParams::default(), &review)
        .await
        .unwrap()
        .status
        .unwrap()
}
