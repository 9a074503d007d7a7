//! The kubelet API on the virtual node: `kubectl logs/exec/attach/port-forward` through the
//! real upper API server reach the lower pod, and the port refuses anyone not allowed.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::path::Path;
use std::time::Duration;

use common::{Streaming, TIMEOUT, kubectl, start_node, wait_running};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::json;
use tensile_harness::fixtures::{bound_pod, pod};
use tensile_harness::{
    ClusterPair, KWOK_FOLLOW_CONTAINER, KWOK_LOG_LINES, KWOK_PREVIOUS_LOG_LINE, TestNamespace,
    cri_log_line, rfc3339, wait_for,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A pod spec with two containers: `app`, and the one whose log a test may extend.
fn two_containers() -> serde_json::Value {
    json!({"containers": [
        {"name": "app", "image": "busybox"},
        {"name": KWOK_FOLLOW_CONTAINER, "image": "busybox"},
    ]})
}

/// What every kubectl check below expects of a running pod `name` in `ns`, whichever
/// cluster `kubeconfig` points at.
async fn kubectl_reaches_the_pod(pair: &ClusterPair, kubeconfig: &Path, ns: &str, name: &str) {
    let follow_log = pair.lower.kwok_follow_log();
    let follow_log = follow_log.as_path();
    let run = |args: Vec<String>, stdin: &'static [u8]| async move {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        kubectl(pair, kubeconfig, &args, stdin).await
    };
    let base = |verb: &str| vec![verb.to_owned(), "-n".to_owned(), ns.to_owned()];
    let with = |verb: &str, more: &[&str]| {
        let mut args = base(verb);
        args.extend(more.iter().map(ToString::to_string));
        args
    };

    // logs, whole and with each option
    let all = run(with("logs", &[name, "-c", "app"]), b"").await;
    assert!(all.status.success(), "logs: {}", text(&all.stderr));
    assert_eq!(text(&all.stdout), KWOK_LOG_LINES.join("\n") + "\n");
    let tail = run(with("logs", &[name, "-c", "app", "--tail=1"]), b"").await;
    assert_eq!(text(&tail.stdout), format!("{}\n", KWOK_LOG_LINES[2]));
    let limit = run(with("logs", &[name, "-c", "app", "--limit-bytes=5"]), b"").await;
    assert_eq!(text(&limit.stdout), &KWOK_LOG_LINES[0][..5]);
    let stamps = run(with("logs", &[name, "-c", "app", "--timestamps"]), b"").await;
    let first = text(&stamps.stdout);
    let first = first.lines().next().unwrap_or_default();
    assert!(
        first.ends_with(KWOK_LOG_LINES[0]) && first.contains('T') && first.contains('Z'),
        "--timestamps: {first:?}"
    );
    // The lines were written an hour ago: none is within the last 10 minutes.
    let since = run(with("logs", &[name, "-c", "app", "--since=10m"]), b"").await;
    assert!(since.status.success(), "--since: {}", text(&since.stderr));
    assert_eq!(text(&since.stdout), "", "--since=10m");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let since_time = format!("--since-time={}", &rfc3339(now - 3600 - 30)[..19]) + "Z";
    let recent = run(with("logs", &[name, "-c", "app", &since_time]), b"").await;
    assert_eq!(
        text(&recent.stdout),
        format!("{}\n", KWOK_LOG_LINES[2]),
        "{since_time}: {}",
        text(&recent.stderr)
    );
    let previous = run(with("logs", &[name, "-c", "app", "--previous"]), b"").await;
    assert_eq!(
        text(&previous.stdout),
        format!("{KWOK_PREVIOUS_LOG_LINE}\n"),
        "--previous: {}",
        text(&previous.stderr)
    );

    // exec: output, exit codes, stdin
    let hi = run(with("exec", &[name, "-c", "app", "--", "echo", "hi"]), b"").await;
    assert!(hi.status.success(), "exec echo: {}", text(&hi.stderr));
    assert_eq!(text(&hi.stdout), "hi\n");
    let three = run(
        with(
            "exec",
            &[name, "--", "sh", "-c", "echo out; echo err >&2; exit 3"],
        ),
        b"",
    )
    .await;
    // kwok reports a command's failure as an error naming the exit status rather than as
    // an exit code (its local exec loses the code), so kubectl exits 1; what matters
    // here is that the lower cluster's verdict arrives unchanged.
    assert!(
        !three.status.success(),
        "exit code: {}",
        text(&three.stderr)
    );
    assert!(
        text(&three.stderr).contains("exit status 3"),
        "{}",
        text(&three.stderr)
    );
    assert_eq!(text(&three.stdout), "out\n");
    assert!(
        text(&three.stderr).contains("err"),
        "stderr: {}",
        text(&three.stderr)
    );
    // `head -n 1`, not `cat`: kwok never closes a command's stdin.
    let cat = run(
        with("exec", &["-i", name, "--", "head", "-n", "1"]),
        b"piped in\n",
    )
    .await;
    assert!(cat.status.success(), "exec -i: {}", text(&cat.stderr));
    assert_eq!(text(&cat.stdout), "piped in\n");
    // attach prints what the container prints from then on, until the client goes
    let mut attach = Streaming::start(pair, kubeconfig, &with("attach", &[name, "-c", "app"]));
    let marker = format!("attached {ns}");
    let appending = keep_appending(follow_log.to_owned(), marker.clone());
    attach.wait_for_line(&marker).await;
    appending.abort();
    attach.stop().await;

    // logs -f prints what is there, then new lines as they come
    let mut follow = Streaming::start(
        pair,
        kubeconfig,
        &with("logs", &[name, "-c", KWOK_FOLLOW_CONTAINER, "-f"]),
    );
    let marker = format!("followed {ns}");
    let appending = keep_appending(follow_log.to_owned(), marker.clone());
    follow.wait_for_line(&marker).await;
    appending.abort();
    follow.stop().await;
}

/// Appends a line with `marker` to a kwok log file every 200 ms until aborted: a client
/// that connects at any moment sees one.
fn keep_appending(path: std::path::PathBuf, marker: String) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs();
            let mut file = tokio::fs::OpenOptions::new()
                .append(true)
                .open(&path)
                .await
                .unwrap();
            file.write_all(cri_log_line(&rfc3339(now), &marker).as_bytes())
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

/// A TTY and a resize reach the command (kubectl only asks for a TTY from a terminal, so
/// this speaks the same WebSocket protocol through the API server with kube's client).
async fn tty_and_resize(client: kube::Client, ns: &str, name: &str) {
    use futures::SinkExt;
    use kube::api::{AttachParams, TerminalSize};
    let pods: Api<Pod> = Api::namespaced(client, ns);
    let mut process = pods
        .exec(
            name,
            ["sh", "-c", "while read -r line; do stty size; done"],
            &AttachParams::interactive_tty().container("app"),
        )
        .await
        .unwrap();
    let mut size = process.terminal_size().unwrap();
    size.send(TerminalSize {
        width: 77,
        height: 33,
    })
    .await
    .unwrap();
    let mut stdin = process.stdin().unwrap();
    let mut stdout = process.stdout().unwrap();
    common::until_shown(&mut stdin, &mut stdout, "33 77").await;
    // kwok never closes a command's input, so the command is left to end with the
    // connection.
    process.abort();
}

/// `kubectl port-forward` to two ports at once; several connections to each echo back.
async fn port_forward_echoes(pair: &ClusterPair, kubeconfig: &Path, ns: &str, name: &str) {
    let args: Vec<String> = [
        "-n",
        ns,
        "port-forward",
        &format!("pod/{name}"),
        ":8080",
        ":9090",
    ]
    .iter()
    .map(ToString::to_string)
    .chain(["--address=127.0.0.1".to_owned()])
    .collect();
    let mut forward = Streaming::start(pair, kubeconfig, &args);
    let mut ports = Vec::new();
    while ports.len() < 2 {
        // "Forwarding from 127.0.0.1:40123 -> 8080"
        let line = forward.wait_for_line("Forwarding from 127.0.0.1:").await;
        let rest = line.trim_start_matches("Forwarding from 127.0.0.1:");
        ports.push(rest.split(' ').next().unwrap().parse::<u16>().unwrap());
    }
    for round in 0..10 {
        for port in &ports {
            let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", *port))
                .await
                .unwrap();
            let message = format!("round {round} to {port}\n");
            conn.write_all(message.as_bytes()).await.unwrap();
            let mut back = vec![0; message.len()];
            tokio::time::timeout(TIMEOUT, conn.read_exact(&mut back))
                .await
                .expect("echo in time")
                .unwrap();
            assert_eq!(text(&back), message);
        }
    }
    // A client that half-closes once it has sent (`nc -N`) still gets its answer.
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", ports[0]))
        .await
        .unwrap();
    conn.write_all(b"half-closed\n").await.unwrap();
    conn.shutdown().await.unwrap();
    let mut back = vec![0; b"half-closed\n".len()];
    tokio::time::timeout(TIMEOUT, conn.read_exact(&mut back))
        .await
        .expect("echo after a half-close in time")
        .unwrap();
    assert_eq!(text(&back), "half-closed\n");
    forward.stop().await;
}

/// A namespace of the lower cluster with the two-container pod `two` in it, Running.
async fn pod_on_the_lower_cluster(pair: &ClusterPair, prefix: &str) -> (TestNamespace, Api<Pod>) {
    let lower = pair.lower.client().await.unwrap();
    let ns = TestNamespace::create(&lower, prefix).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(lower, &ns.name);
    pods.create(&PostParams::default(), &pod("two", two_containers()))
        .await
        .unwrap();
    wait_for("pod two Running", TIMEOUT, || async {
        Ok(pods
            .get("two")
            .await
            .ok()
            .filter(common::running)
            .map(|_| ()))
    })
    .await
    .unwrap();
    (ns, pods)
}

#[tokio::test]
async fn lower_cluster_answers_kubectl_directly() {
    let pair = ClusterPair::shared().await.unwrap();
    let (ns, _) = pod_on_the_lower_cluster(pair, "kubelet-direct").await;
    kubectl_reaches_the_pod(pair, pair.lower_kubeconfig(), &ns.name, "two").await;
    port_forward_echoes(pair, pair.lower_kubeconfig(), &ns.name, "two").await;
    tty_and_resize(pair.lower.client().await.unwrap(), &ns.name, "two").await;
    ns.delete().await.unwrap();
}

/// Issue #38: virtual-node's SPDY connection to a lower kubelet opens through the lower API
/// server by either upgrade, SPDY (asked for first: the API server only passes the bytes on)
/// or the WebSocket tunnel (where the SPDY upgrade is refused), and carries a forwarded
/// connection both ways with its FIN.
#[tokio::test]
async fn the_lower_kubelet_is_reached_by_a_spdy_upgrade_or_the_websocket_tunnel() {
    use tensile::kubelet_api::tunnel::{Upgrade, open_by};
    let pair = ClusterPair::shared().await.unwrap();
    let (ns, pods) = pod_on_the_lower_cluster(pair, "kubelet-upgrade").await;
    let headers = |kind: &str| {
        [("streamtype", kind), ("port", "8080"), ("requestid", "0")]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .to_vec()
    };
    for by in [Upgrade::Spdy, Upgrade::WebSocket] {
        let mut conn = open_by(&pods, "two", by)
            .await
            .unwrap_or_else(|e| panic!("{by}: {e}"));
        let mut streams = Vec::new();
        for kind in ["error", "data"] {
            let pending = conn.open(headers(kind)).await.unwrap();
            let stream = tokio::time::timeout(TIMEOUT, pending.established())
                .await
                .unwrap_or_else(|_| panic!("{by}: the {kind} stream in time"))
                .unwrap_or_else(|e| panic!("{by}: the {kind} stream: {e}"));
            streams.push(stream);
        }
        let data = streams.pop().unwrap();
        let (_, mut error) = streams.pop().unwrap().split();
        error.shutdown().await.unwrap();
        let (mut reader, mut writer) = data.split();
        let message = format!("{by}: {}\n", "x".repeat(100_000));
        writer.write_all(message.as_bytes()).await.unwrap();
        let mut back = vec![0; message.len()];
        tokio::time::timeout(TIMEOUT, reader.read_exact(&mut back))
            .await
            .unwrap_or_else(|_| panic!("{by}: the echo in time"))
            .unwrap();
        assert!(back == message.as_bytes(), "{by}: the echo");
        conn.close().await;
    }
    // The API server's own refusal (a pod that is not there) is final: not asked again
    // the other way.
    let Err(error) = open_by(&pods, "absent", Upgrade::Spdy).await else {
        panic!("an upgrade to a pod that is not there");
    };
    assert!(error.is_final(), "{error}");
    assert!(error.to_string().contains("404"), "{error}");
    assert!(
        error.to_string().contains("\"absent\" not found"),
        "{error}"
    );
    ns.delete().await.unwrap();
}

/// A virtual node and a two-container pod bound to it, Running (reflected up).
async fn pod_on_virtual_node(
    pair: &ClusterPair,
    node: &str,
    prefix: &str,
) -> (tensile_harness::VirtualNode, TestNamespace) {
    let vn = start_node(pair, node, &[]).await;
    let upper = pair.upper.client().await.unwrap();
    let ns = TestNamespace::create(&upper, prefix).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper, &ns.name);
    let mut bound = bound_pod("two", node);
    let mut spec = two_containers();
    spec["nodeName"] = json!(node);
    bound.spec = Some(serde_json::from_value(spec).unwrap());
    pods.create(&PostParams::default(), &bound).await.unwrap();
    wait_running(&pods, "app=two", 1).await;
    (vn, ns)
}

#[tokio::test]
async fn kubectl_logs_exec_attach_and_port_forward_reach_a_pod_on_the_virtual_node() {
    let pair = ClusterPair::shared().await.unwrap();
    let (_vn, ns) = pod_on_virtual_node(pair, "vk-kubelet", "kubelet-vk").await;
    kubectl_reaches_the_pod(pair, pair.upper_kubeconfig(), &ns.name, "two").await;
    port_forward_echoes(pair, pair.upper_kubeconfig(), &ns.name, "two").await;
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn a_tty_and_its_resize_reach_a_pod_on_the_virtual_node() {
    let pair = ClusterPair::shared().await.unwrap();
    let (_vn, ns) = pod_on_virtual_node(pair, "vk-kubelet-tty", "kubelet-tty").await;
    tty_and_resize(pair.upper.client().await.unwrap(), &ns.name, "two").await;
    ns.delete().await.unwrap();
}

/// `curl` straight to the kubelet port: the HTTP status code and the body.
async fn curl(
    url: &str,
    ca: &Path,
    cert: Option<&tensile_harness::pki::ClientCert>,
) -> (u16, String) {
    let mut command = Command::new("curl");
    command
        .args([
            "-sS",
            "--max-time",
            "30",
            "-w",
            "\n%{http_code}",
            "--cacert",
        ])
        .arg(ca);
    if let Some(cert) = cert {
        command
            .arg("--cert")
            .arg(&cert.cert)
            .arg("--key")
            .arg(&cert.key);
    }
    let output = command.arg(url).output().await.unwrap();
    let out = text(&output.stdout);
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", &out));
    let code = code
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("curl {url}: {out} {}", text(&output.stderr)));
    (code, body.to_owned())
}

#[tokio::test]
async fn the_kubelet_port_refuses_whoever_may_not_use_it() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-kubelet-auth";
    let (vn, ns) = pod_on_virtual_node(pair, node, "kubelet-auth").await;
    // A lower pod of the same namespace that this node does not mirror.
    let lower: Api<Pod> = Api::namespaced(pair.lower.client().await.unwrap(), &ns.name);
    lower
        .create(&PostParams::default(), &pod("stranger", two_containers()))
        .await
        .unwrap();
    let base = format!("https://127.0.0.1:{}", vn.kubelet_port);
    let logs = |pod: &str| format!("{base}/containerLogs/{}/{pod}/app", ns.name);
    let ca = &pair.upper.pki.ca_cert;
    let apiserver = &pair.upper.pki.apiserver_kubelet_client;

    let (code, body) = curl(&logs("two"), ca, Some(apiserver)).await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body, KWOK_LOG_LINES.join("\n") + "\n");

    let (code, body) = curl(&logs("two"), ca, None).await;
    assert_eq!(code, 401, "no credentials: {body}");
    let other_ca = pair
        .lower
        .pki
        .issue_client("kube-apiserver-kubelet-client", &["system:masters"])
        .unwrap();
    let (code, body) = curl(&logs("two"), ca, Some(&other_ca)).await;
    assert_eq!(code, 401, "a certificate of another CA: {body}");
    let nobody = pair.upper.pki.issue_client("nobody", &[]).unwrap();
    let (code, body) = curl(&logs("two"), ca, Some(&nobody)).await;
    assert_eq!(code, 403, "a user without nodes/proxy: {body}");
    assert!(body.contains("nobody") && body.contains("proxy"), "{body}");

    let (code, body) = curl(&logs("stranger"), ca, Some(apiserver)).await;
    assert_eq!(code, 404, "a lower pod this node does not mirror: {body}");
    let (code, body) = curl(&logs("absent"), ca, Some(apiserver)).await;
    assert_eq!(code, 404, "no such pod: {body}");
    let (code, body) = curl(&format!("{base}/stats/summary"), ca, Some(apiserver)).await;
    assert_eq!(code, 404, "no metrics API below: {body}");
    assert!(body.contains("metrics.k8s.io"), "{body}");
    let (code, body) = curl(&format!("{base}/pods"), ca, Some(apiserver)).await;
    assert_eq!(code, 200, "{body}");
    let list: serde_json::Value = serde_json::from_str(&body).unwrap();
    let names: Vec<&str> = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["metadata"]["name"].as_str())
        .collect();
    assert_eq!(names, ["two"], "only its own pods");
    // As on a kubelet's secure port, /healthz needs credentials too.
    let (code, body) = curl(&format!("{base}/healthz"), ca, None).await;
    assert_eq!(code, 401, "{body}");
    let (code, body) = curl(&format!("{base}/healthz"), ca, Some(apiserver)).await;
    assert_eq!((code, body.as_str()), (200, "ok"));
    ns.delete().await.unwrap();
}

/// A SPDY port-forward connection to `pod` through the upper API server, upgraded as
/// kubectl asks for it.
async fn spdy_port_forward(
    client: &kube::Client,
    ns: &str,
    pod: &str,
) -> hyper_util::rt::TokioIo<hyper::upgrade::Upgraded> {
    let request = http::Request::post(format!("/api/v1/namespaces/{ns}/pods/{pod}/portforward"))
        .header(http::header::CONNECTION, "Upgrade")
        .header(http::header::UPGRADE, "SPDY/3.1")
        .header("X-Stream-Protocol-Version", "portforward.k8s.io")
        .body(kube::client::Body::from(Vec::new()))
        .unwrap();
    let response = client.send(request).await.unwrap();
    assert_eq!(response.status(), http::StatusCode::SWITCHING_PROTOCOLS);
    hyper_util::rt::TokioIo::new(hyper::upgrade::on(response).await.unwrap())
}

const MIB: u64 = 1024 * 1024;

/// Issue #23: someone allowed `pods/portforward` opens 1000 streams on one connection and
/// sends 4 MiB DATA frames, never reading what comes back (so the pod's echo backs up and
/// the pod stops reading too). virtual-node refuses the streams beyond its limit, holds a
/// bounded amount, and serves everyone else as before.
#[tokio::test]
async fn a_flood_of_port_forward_streams_leaves_memory_bounded_and_exec_working() {
    use bytes::BytesMut;
    use std::sync::atomic::{AtomicU64, Ordering};
    use tensile::kubelet_api::spdy::frame::{Frame, FrameDecoder, FrameEncoder, rst};

    let pair = ClusterPair::shared().await.unwrap();
    let (vn, ns) = pod_on_virtual_node(pair, "vk-kubelet-flood", "kubelet-flood").await;
    let memory = || tensile_harness::measure::footprint(vn.pid()).unwrap();
    let (rss_before, peak_before, _) = memory();
    let client = pair.upper.client().await.unwrap();
    let (mut read, mut write) = tokio::io::split(spdy_port_forward(&client, &ns.name, "two").await);

    // 500 forwarded connections, an error and a data stream each, as kubectl opens them.
    let mut encoder = FrameEncoder::new().unwrap();
    let mut wire = Vec::new();
    for request in 0..500u32 {
        for (offset, kind) in [(1, "error"), (3, "data")] {
            let headers = [("streamtype", kind), ("port", "8080")]
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .chain([("requestid".to_owned(), request.to_string())])
                .collect();
            let syn = Frame::SynStream {
                stream_id: 4 * request + offset,
                associated_to: 0,
                priority: 0,
                flags: 0,
                headers,
            };
            encoder.encode(&syn, &mut wire).unwrap();
        }
    }
    write.write_all(&wire).await.unwrap();
    let mut decoder = FrameDecoder::new();
    let mut buf = BytesMut::new();
    let (mut accepted, mut refused) = (Vec::new(), 0);
    while accepted.len() + refused < 1000 {
        let frame = tokio::time::timeout(TIMEOUT, async {
            loop {
                if let Some(frame) = decoder.decode(&mut buf).unwrap() {
                    return frame;
                }
                assert!(
                    read.read_buf(&mut buf).await.unwrap() > 0,
                    "connection closed"
                );
            }
        })
        .await
        .expect("an answer to every SYN_STREAM");
        match frame {
            Frame::SynReply { stream_id, .. } => accepted.push(stream_id),
            Frame::RstStream { status, .. } if status == rst::REFUSED_STREAM => refused += 1,
            _ => {}
        }
    }
    let data: Vec<u32> = accepted.iter().copied().filter(|id| id % 4 == 3).collect();

    // From here on the client reads nothing.
    let sent = std::sync::Arc::new(AtomicU64::new(0));
    let flood = {
        let (sent, data) = (sent.clone(), data.clone());
        tokio::spawn(async move {
            let frame_len = 4 * MIB as usize;
            let payload = vec![0x5a; frame_len];
            for id in data.iter().cycle() {
                if sent.load(Ordering::Relaxed) >= 512 * MIB {
                    break;
                }
                let mut head = id.to_be_bytes().to_vec();
                head.push(0);
                head.extend_from_slice(&(frame_len as u32).to_be_bytes()[1..]);
                if write.write_all(&head).await.is_err() {
                    break;
                }
                for chunk in payload.chunks(64 * 1024) {
                    if write.write_all(chunk).await.is_err() {
                        return;
                    }
                    sent.fetch_add(chunk.len() as u64, Ordering::Relaxed);
                }
            }
        })
    };
    // Until the flood has stalled (nothing sent for 5 s) or ended, virtual-node's resident
    // memory stays within 128 MiB of where it was.
    let limit = rss_before + 128 * MIB;
    let progress = std::sync::Mutex::new((0, std::time::Instant::now()));
    let progress = &progress;
    wait_for(
        "the flood to stall or end",
        Duration::from_secs(300),
        || async {
            let (rss, _, _) = memory();
            let now = sent.load(Ordering::Relaxed);
            assert!(
                rss <= limit,
                "virtual-node grew from {} MiB to {} MiB after {} MiB sent",
                rss_before / MIB,
                rss / MIB,
                now / MIB
            );
            let mut last = progress.lock().unwrap();
            if now != last.0 {
                *last = (now, std::time::Instant::now());
            }
            let stalled = last.1.elapsed() >= Duration::from_secs(5);
            Ok((stalled || flood.is_finished()).then_some(()))
        },
    )
    .await
    .unwrap();
    let (rss_flooded, _, _) = memory();

    // Others are served as before, while the flood holds.
    let exec = kubectl(
        pair,
        pair.upper_kubeconfig(),
        &[
            "exec",
            "-n",
            &ns.name,
            "two",
            "-c",
            "app",
            "--",
            "echo",
            "still here",
        ],
        b"",
    )
    .await;
    assert!(exec.status.success(), "exec: {}", text(&exec.stderr));
    assert_eq!(text(&exec.stdout), "still here\n");
    let (rss_after, peak_after, _) = memory();
    println!(
        "flood: {} streams opened, {} accepted, {refused} refused; {} MiB sent on {} data \
         streams; virtual-node resident {} MiB before, {} MiB flooded, {} MiB after an exec, \
         peak {} MiB",
        accepted.len() + refused,
        accepted.len(),
        sent.load(Ordering::Relaxed) / MIB,
        data.len(),
        rss_before / MIB,
        rss_flooded / MIB,
        rss_after / MIB,
        peak_after / MIB,
    );
    assert!(
        peak_after <= peak_before.max(rss_before) + 128 * MIB,
        "peak {} MiB",
        peak_after / MIB
    );
    assert_eq!(
        (accepted.len(), refused),
        (
            tensile::kubelet_api::spdy::MAX_STREAMS,
            1000 - tensile::kubelet_api::spdy::MAX_STREAMS
        ),
        "streams beyond the limit are refused"
    );
    flood.abort();
    ns.delete().await.unwrap();
}

/// The local port of kubectl port-forward's "Forwarding from 127.0.0.1:40123 -> 8080".
async fn forwarded_port(
    lines: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
) -> u16 {
    loop {
        let line = tokio::time::timeout(TIMEOUT, lines.next_line())
            .await
            .expect("kubectl port-forward forwards in time")
            .unwrap()
            .expect("kubectl port-forward ended before forwarding");
        if let Some(rest) = line.strip_prefix("Forwarding from 127.0.0.1:") {
            return rest.split(' ').next().unwrap().parse().unwrap();
        }
    }
}

/// Sends `bytes` (a pattern) on `conn` while reading the echo back; the echo matches.
async fn echo_both_ways(conn: tokio::net::TcpStream, bytes: usize) {
    let pattern = |i: usize| (i % 251) as u8;
    let (mut read, mut write) = conn.into_split();
    let send = async move {
        let mut sent = 0;
        while sent < bytes {
            let n = (bytes - sent).min(64 * 1024);
            let piece: Vec<u8> = (sent..sent + n).map(pattern).collect();
            write.write_all(&piece).await.unwrap();
            sent += n;
        }
        write
    };
    let receive = async move {
        let mut got = 0;
        let mut buffer = vec![0u8; 64 * 1024];
        while got < bytes {
            let n = read.read(&mut buffer).await.unwrap();
            assert!(n > 0, "the echo ended after {got} of {bytes} bytes");
            for (i, byte) in buffer[..n].iter().enumerate() {
                assert_eq!(*byte, pattern(got + i), "byte {}", got + i);
            }
            got += n;
        }
    };
    let (_write, ()) = tokio::time::timeout(Duration::from_secs(120), async {
        tokio::join!(send, receive)
    })
    .await
    .expect("the echo in time");
}

/// Issue #38: port-forward through the virtual node rides one SPDY connection to the lower
/// kubelet, upgraded through the lower API server (`SPDY/3.1`, which the API server passes
/// on as it is), whichever way kubectl reaches the upper API server (its own WebSocket
/// tunnel, or SPDY): 16 MiB echoed both ways at once beside a second connection, and
/// virtual-node says that the SPDY upgrade carried each session (before, every forwarded
/// connection was a WebSocket of its own, in the channel protocol; then the SPDY bytes went
/// in a WebSocket tunnel, kept for API servers that refuse the upgrade).
#[tokio::test]
async fn port_forward_through_the_virtual_node_is_one_spdy_connection_to_the_lower_kubelet() {
    use tokio::io::AsyncBufReadExt;
    let pair = ClusterPair::shared().await.unwrap();
    let (vn, ns) = pod_on_virtual_node(pair, "vk-kubelet-tunnel", "kubelet-tunnel").await;
    for websockets in ["true", "false"] {
        let mut child = Command::new(pair.bin("kubectl"))
            .arg("--kubeconfig")
            .arg(pair.upper_kubeconfig())
            .args(["-n", &ns.name, "port-forward", "pod/two", ":8080", ":9090"])
            .arg("--address=127.0.0.1")
            .env("KUBECTL_PORT_FORWARD_WEBSOCKETS", websockets)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let (first, second) = (
            forwarded_port(&mut lines).await,
            forwarded_port(&mut lines).await,
        );
        let big = tokio::net::TcpStream::connect(("127.0.0.1", first))
            .await
            .unwrap();
        let small = tokio::net::TcpStream::connect(("127.0.0.1", second))
            .await
            .unwrap();
        tokio::join!(
            echo_both_ways(big, 16 * 1024 * 1024),
            echo_both_ways(small, 1000)
        );
        child.kill().await.unwrap();
    }
    let log = std::fs::read_to_string(vn.log()).unwrap();
    let sessions: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("port-forward: SPDY to the lower kubelet"))
        .collect();
    assert!(
        sessions.len() == 2 && sessions.iter().all(|l| l.contains("upgraded to SPDY")),
        "each kubectl port-forward session upgraded to SPDY to the lower kubelet; log:\n{}",
        log.lines()
            .filter(|l| l.contains("port-forward"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(!log.contains("port-forward: no tunnel"));
    ns.delete().await.unwrap();
}
