//! exec and attach over WebSockets (`channel.k8s.io`, `base64.channel.k8s.io`,
//! `v4.channel.k8s.io`, `v5.channel.k8s.io`) through the real upper API server to a pod on
//! the virtual node, beside the same call straight to the lower cluster: the same
//! channels, the same verdict. The API server passes a WebSocket exec through to the
//! kubelet (v5 it may translate to SPDY); Kubernetes' e2e test "Pods should support remote
//! command execution over websockets" speaks `channel.k8s.io`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use base64::Engine;
use bytes::Bytes;
use common::{TIMEOUT, start_node, wait_running};
use futures::{SinkExt, StreamExt};
use http::HeaderValue;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use tensile_harness::fixtures::{bound_pod, merge};
use tensile_harness::real_node::BUSYBOX_IMAGE;
use tensile_harness::{
    ClusterPair, PairOptions, TestNamespace, cri_log_line, real_node_placement, rfc3339, wait_for,
};
use tokio::io::AsyncWriteExt;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::client::generate_key;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;

type Socket = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

/// What came back on each channel of one call.
#[derive(Debug, Default, PartialEq, Eq)]
struct Session {
    stdout: String,
    stderr: String,
    /// The error channel: a JSON Status (v4+) or a message (before).
    error: String,
    /// The close frame's code (`None`: a close without one, which Go's clients report as
    /// `close 1005 (no status)`; or no close frame at all).
    close: Option<u16>,
}

impl Session {
    fn status(&self) -> Value {
        serde_json::from_str(&self.error)
            .unwrap_or_else(|e| panic!("error channel {:?}: {e}", self.error))
    }
}

/// Opens `path` (an exec or attach URL) on `client`'s API server as a WebSocket offering
/// `protocol`; the socket and the protocol chosen, or the refusal's status and body.
async fn open(
    client: &kube::Client,
    path: &str,
    protocol: &str,
) -> Result<(Socket, Option<String>), (u16, String)> {
    let key = generate_key();
    let request = http::Request::get(path)
        .header(http::header::CONNECTION, "Upgrade")
        .header(http::header::UPGRADE, "websocket")
        .header(http::header::SEC_WEBSOCKET_VERSION, "13")
        .header(http::header::SEC_WEBSOCKET_KEY, &key)
        .header(http::header::SEC_WEBSOCKET_PROTOCOL, protocol)
        .body(kube::client::Body::empty())
        .unwrap();
    let response = client.send(request).await.unwrap();
    if response.status() != http::StatusCode::SWITCHING_PROTOCOLS {
        let status = response.status().as_u16();
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        return Err((status, String::from_utf8_lossy(&body).into_owned()));
    }
    let accept = derive_accept_key(key.as_bytes());
    assert_eq!(
        response
            .headers()
            .get(http::header::SEC_WEBSOCKET_ACCEPT)
            .map(HeaderValue::as_bytes),
        Some(accept.as_bytes())
    );
    let chosen = response
        .headers()
        .get(http::header::SEC_WEBSOCKET_PROTOCOL)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let upgraded = hyper::upgrade::on(response).await.unwrap();
    let socket = WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Client, None).await;
    Ok((socket, chosen))
}

fn base64_protocol(protocol: &str) -> bool {
    protocol.contains("base64")
}

fn frame(protocol: &str, channel: u8, payload: &[u8]) -> Message {
    if base64_protocol(protocol) {
        let text = format!(
            "{}{}",
            char::from(b'0' + channel),
            base64::engine::general_purpose::STANDARD.encode(payload)
        );
        Message::text(text)
    } else {
        let mut bytes = vec![channel];
        bytes.extend_from_slice(payload);
        Message::Binary(Bytes::from(bytes))
    }
}

/// Runs one call: sends `input` (channel, payload: stdin 0, resize 4, v5's close 255),
/// reads every channel until the server closes.
async fn run(client: &kube::Client, path: &str, protocol: &str, input: &[(u8, &[u8])]) -> Session {
    let (mut socket, chosen) = open(client, path, protocol)
        .await
        .unwrap_or_else(|(code, body)| panic!("{protocol} {path}: {code} {body}"));
    assert_eq!(chosen.as_deref(), Some(protocol), "{path}");
    for (channel, payload) in input {
        socket
            .send(frame(protocol, *channel, payload))
            .await
            .unwrap();
    }
    let mut session = Session::default();
    let read = async {
        while let Some(message) = socket.next().await {
            let bytes: Vec<u8> = match message {
                Ok(Message::Binary(bytes)) => bytes.to_vec(),
                Ok(Message::Text(text)) => text.as_bytes().to_vec(),
                Ok(Message::Close(frame)) => {
                    session.close = frame.map(|f| u16::from(f.code));
                    break;
                }
                Err(_) => break,
                Ok(_) => continue,
            };
            let Some((&channel, payload)) = bytes.split_first() else {
                continue;
            };
            let (channel, payload) = if base64_protocol(protocol) {
                let decoded = base64::engine::general_purpose::STANDARD
                    .decode(payload)
                    .unwrap_or_else(|e| panic!("{protocol}: {payload:?}: {e}"));
                (channel - b'0', decoded)
            } else {
                (channel, payload.to_vec())
            };
            let text = String::from_utf8_lossy(&payload);
            match channel {
                1 => session.stdout.push_str(&text),
                2 => session.stderr.push_str(&text),
                3 => session.error.push_str(&text),
                other => panic!("{protocol}: message on channel {other}: {text:?}"),
            }
        }
    };
    tokio::time::timeout(TIMEOUT, read)
        .await
        .unwrap_or_else(|_| panic!("{protocol} {path}: the call did not end"));
    session
}

/// The exec URL of `command` in container `app` of `pod`, with `streams` (`stdout=1&…`).
fn exec_path(ns: &str, pod: &str, command: &[&str], streams: &str) -> String {
    let command: String = command
        .iter()
        .map(|arg| {
            let encoded: String = arg
                .bytes()
                .map(|b| match b {
                    b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                        char::from(b).to_string()
                    }
                    other => format!("%{other:02X}"),
                })
                .collect();
            format!("&command={encoded}")
        })
        .collect();
    format!("/api/v1/namespaces/{ns}/pods/{pod}/exec?container=app&{streams}{command}")
}

/// Attaches to `path` over `protocol` (binary) until stdout shows `want`, then leaves.
async fn attach_shows(client: &kube::Client, path: &str, protocol: &str, want: &str) {
    let (mut socket, chosen) = open(client, path, protocol)
        .await
        .unwrap_or_else(|(code, body)| panic!("{protocol} {path}: {code} {body}"));
    assert_eq!(chosen.as_deref(), Some(protocol));
    let mut stdout = String::new();
    let shown = tokio::time::timeout(TIMEOUT, async {
        while let Some(Ok(message)) = socket.next().await {
            if let Message::Binary(bytes) = message
                && let Some((1, payload)) = bytes.split_first()
            {
                stdout.push_str(&String::from_utf8_lossy(payload));
                if stdout.contains(want) {
                    return true;
                }
            }
        }
        false
    })
    .await;
    assert_eq!(shown, Ok(true), "{protocol} {path}: {stdout:?}");
    let _ = socket.close(None).await;
}

/// Appends a line with `marker` to kwok's attach log every 200 ms until aborted.
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
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    })
}

/// A virtual node and a pod bound to it, Running.
async fn pod_on_virtual_node(
    pair: &ClusterPair,
    node: &str,
    prefix: &str,
) -> (tensile_harness::VirtualNode, TestNamespace) {
    let vn = start_node(pair, node, &[]).await;
    let upper = pair.upper.client().await.unwrap();
    let ns = TestNamespace::create(&upper, prefix).await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper, &ns.name);
    let mut pod = bound_pod("ws", node);
    let mut spec = json!({"containers": [{"name": "app", "image": "busybox"}]});
    spec["nodeName"] = json!(node);
    pod.spec = Some(serde_json::from_value(spec).unwrap());
    pods.create(&PostParams::default(), &pod).await.unwrap();
    wait_running(&pods, "app=ws", 1).await;
    (vn, ns)
}

const PROTOCOLS: [&str; 5] = [
    "channel.k8s.io",
    "base64.channel.k8s.io",
    "v4.channel.k8s.io",
    "v4.base64.channel.k8s.io",
    "v5.channel.k8s.io",
];

#[tokio::test]
async fn exec_over_websockets_reaches_a_pod_on_the_virtual_node_as_it_does_below() {
    let pair = ClusterPair::shared().await.unwrap();
    let (_vn, ns) = pod_on_virtual_node(pair, "vk-websocket", "kubelet-ws").await;
    let n = ns.name.as_str();
    let upper = pair.upper.client().await.unwrap();
    let refused = open(
        &upper,
        &exec_path(n, "ws", &["true"], "stdout=1"),
        "nonsense.k8s.io",
    )
    .await;
    assert!(refused.is_err(), "a protocol nobody serves was accepted");
    let clients = [
        ("upper", pair.upper.client().await.unwrap()),
        ("lower", pair.lower.client().await.unwrap()),
    ];
    for protocol in PROTOCOLS {
        let v4 = protocol.starts_with("v");
        let mut seen = Vec::new();
        for (cluster, client) in &clients {
            // The e2e test's call: stdout on channel 1, nothing else.
            let echo = exec_path(
                n,
                "ws",
                &["echo", "remote execution test"],
                "stdout=1&stderr=1",
            );
            let ok = run(client, &echo, protocol, &[]).await;
            assert_eq!(ok.stdout, "remote execution test\n", "{cluster} {protocol}");
            // A normal close, as the kubelet's: a close without a code is an error to
            // kubectl ("close 1005 (no status)") when the API server passes its WebSocket
            // through (ExtendWebSocketsToKubelet).
            assert_eq!(
                ok.close,
                Some(1000),
                "{cluster} {protocol}: the close frame"
            );
            assert_eq!(ok.stderr, "", "{cluster} {protocol}");
            if v4 {
                assert_eq!(ok.status()["status"], "Success", "{cluster} {protocol}");
            } else {
                assert_eq!(ok.error, "", "{cluster} {protocol}: a success says nothing");
            }
            // A failing command: its output on both channels, and a Failure verdict.
            let script = "echo out; echo err >&2; exit 3";
            let failing = exec_path(n, "ws", &["sh", "-c", script], "stdout=1&stderr=1");
            let failed = run(client, &failing, protocol, &[]).await;
            assert_eq!(
                (failed.stdout.as_str(), failed.stderr.as_str()),
                ("out\n", "err\n"),
                "{cluster} {protocol}"
            );
            assert!(!failed.error.is_empty(), "{cluster} {protocol}: no verdict");
            // kwok loses the exit code: its verdict is an error naming the exit status.
            assert!(
                failed.error.contains("exit status 3"),
                "{cluster} {protocol}: {}",
                failed.error
            );
            if v4 {
                assert_eq!(failed.status()["status"], "Failure", "{cluster} {protocol}");
            }
            // stdin reaches the command (`head -n 1`: kwok never closes a command's input).
            let head = exec_path(n, "ws", &["head", "-n", "1"], "stdin=1&stdout=1&stderr=1");
            let echoed = run(client, &head, protocol, &[(0, b"hello websocket\n")]).await;
            assert_eq!(echoed.stdout, "hello websocket\n", "{cluster} {protocol}");
            seen.push((ok, failed, echoed));
        }
        // The same output and verdicts both ways. (Not the same failure message: the lower
        // API server, translating kube's v5 call to SPDY for kwok, wraps it in one more
        // "Internal error occurred: ", with that as a cause.)
        let verdict = |session: &Session| {
            if v4 {
                let status = session.status();
                json!([status["status"], status["reason"], status["code"]])
            } else {
                json!(session.error.is_empty())
            }
        };
        let summary = |(ok, failed, echoed): &(Session, Session, Session)| {
            json!([
                ok.stdout,
                ok.stderr,
                verdict(ok),
                failed.stdout,
                failed.stderr,
                verdict(failed),
                echoed.stdout,
                echoed.stderr,
                verdict(echoed),
            ])
        };
        assert_eq!(
            summary(&seen[0]),
            summary(&seen[1]),
            "{protocol}: upper vs lower"
        );
    }
    // attach: what the container prints from then on, on stdout.
    let marker = format!("attached over a WebSocket {n}");
    let appending = keep_appending(pair.lower.kwok_follow_log(), marker.clone());
    let attach = format!("/api/v1/namespaces/{n}/pods/ws/attach?container=app&stdout=1");
    for protocol in ["channel.k8s.io", "v4.channel.k8s.io"] {
        for (_, client) in &clients {
            attach_shows(client, &attach, protocol, &marker).await;
        }
    }
    appending.abort();
    ns.delete().await.unwrap();
}

/// A pod bound to `node` whose lower copy runs on the real node (the placement in
/// `clusterSelector`, as the webhook stashes it), sleeping in busybox.
fn real_pod(name: &str, node: &str) -> Pod {
    let mut pod = bound_pod(name, node);
    pod.metadata.annotations = Some(
        [(
            "clusterSelector".to_owned(),
            real_node_placement().to_string(),
        )]
        .into(),
    );
    let mut spec = serde_json::to_value(pod.spec.take().unwrap()).unwrap();
    merge(
        &mut spec,
        json!({
            "automountServiceAccountToken": false,
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "app",
                "image": BUSYBOX_IMAGE,
                "command": ["sh", "-c", "exec sleep 3600"],
            }],
        }),
    );
    pod.spec = Some(serde_json::from_value(spec).unwrap());
    pod
}

/// Against a real kubelet (containerd, runc) below: the exit code in the v4 Status, a
/// TTY resized over the resize channel, stdin closed by v5's close signal; the same
/// upstairs (through the virtual node) as straight below.
#[tokio::test]
async fn exec_over_websockets_carries_exit_codes_tty_resize_and_stdin_close_on_a_real_node() {
    const NODE: &str = "vk-real-ws";
    let pair = ClusterPair::start(PairOptions::default()).await.unwrap();
    let real = pair
        .start_real_node("lower-real-ws")
        .await
        .unwrap_or_else(|error| panic!("the real node did not start: {error:#}"));
    let _vk = start_node(&pair, NODE, &[]).await;
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let ns = TestNamespace::create(&upper, "kubelet-ws-real")
        .await
        .unwrap();
    let n = ns.name.as_str();
    Api::<Pod>::namespaced(upper.clone(), n)
        .create(&PostParams::default(), &real_pod("shell", NODE))
        .await
        .unwrap();
    let (upper_pods, lower_pods) = (
        Api::<Pod>::namespaced(upper.clone(), n),
        Api::<Pod>::namespaced(lower.clone(), n),
    );
    let ran = wait_for("shell Running below and upstairs", TIMEOUT, || async {
        let below = lower_pods.get_opt("shell").await?;
        let above = upper_pods.get_opt("shell").await?;
        Ok((below.as_ref().is_some_and(common::running)
            && above.as_ref().is_some_and(common::running))
        .then_some(()))
    })
    .await;
    if let Err(error) = ran {
        panic!("{error:#}\n{}", real.logs_tail(30));
    }
    for (cluster, client) in [("upper", &upper), ("lower", &lower)] {
        // The exit code: v4's Status, and before v4 the kubelet's message.
        let failing = exec_path(
            n,
            "shell",
            &["sh", "-c", "echo out; exit 3"],
            "stdout=1&stderr=1",
        );
        for protocol in [
            "v4.channel.k8s.io",
            "v4.base64.channel.k8s.io",
            "v5.channel.k8s.io",
        ] {
            let failed = run(client, &failing, protocol, &[]).await;
            assert_eq!(failed.stdout, "out\n", "{cluster} {protocol}");
            let status = failed.status();
            assert_eq!(
                (&status["status"], &status["reason"]),
                (&json!("Failure"), &json!("NonZeroExitCode")),
                "{cluster} {protocol}: {status}"
            );
            assert_eq!(
                status["details"]["causes"],
                json!([{"reason": "ExitCode", "message": "3"}]),
                "{cluster} {protocol}: {status}"
            );
        }
        let failed = run(client, &failing, "channel.k8s.io", &[]).await;
        assert!(
            // The message's tail is the kubelet's below, and the lower API server's (which
            // translates the virtual node's v5 call to SPDY) through the virtual node.
            failed
                .error
                .starts_with("command terminated with non-zero exit code: ")
                && failed.error.ends_with("exit code 3"),
            "{cluster} channel.k8s.io: {failed:?}"
        );
        // A TTY, sized over the resize channel before the command looks.
        let script =
            "until [ \"$(stty size 2>/dev/null)\" = \"33 77\" ]; do usleep 20000; done; stty size";
        let tty = exec_path(
            n,
            "shell",
            &["timeout", "30", "sh", "-c", script],
            "stdin=1&stdout=1&tty=1",
        );
        for protocol in ["v4.channel.k8s.io", "channel.k8s.io"] {
            let sized = run(
                client,
                &tty,
                protocol,
                &[(4, br#"{"Width":77,"Height":33}"#)],
            )
            .await;
            assert_eq!(sized.stdout, "33 77\r\n", "{cluster} {protocol}: {sized:?}");
        }
        // v5: stdin to its end, closed by the close signal; the command sees the end.
        let cat = exec_path(
            n,
            "shell",
            &["sh", "-c", "cat; echo done"],
            "stdin=1&stdout=1&stderr=1",
        );
        let input: &[(u8, &[u8])] = &[(0, b"hello\n"), (0, b"again\n"), (255, &[0])];
        let echoed = run(client, &cat, "v5.channel.k8s.io", input).await;
        assert_eq!(
            echoed.stdout, "hello\nagain\ndone\n",
            "{cluster}: {echoed:?}"
        );
        assert_eq!(echoed.status()["status"], "Success", "{cluster}");
    }
    ns.delete().await.unwrap();
}

/// The channel and payload of a message from the server (`protocol`'s framing).
fn unframe(protocol: &str, message: Message) -> Option<(u8, Vec<u8>)> {
    match message {
        Message::Binary(bytes) => {
            let (channel, payload) = bytes.split_first()?;
            Some((*channel, payload.to_vec()))
        }
        Message::Text(text) if base64_protocol(protocol) => {
            let (channel, payload) = text.as_str().split_at_checked(1)?;
            let channel = channel.as_bytes()[0].checked_sub(b'0')?;
            let payload = base64::engine::general_purpose::STANDARD
                .decode(payload)
                .ok()?;
            Some((channel, payload))
        }
        _ => None,
    }
}

/// Port-forward over a WebSocket (issue 50: what the Python client and other non-Go
/// clients speak), through the real upper API server to a pod on the virtual node and
/// straight to the lower cluster: each port's data and error channels open with the port
/// (2 bytes, little-endian), what is sent on a data channel comes back from that port
/// (kwok's forward is `cat`), in both the binary and the base64 framing; a port-forward
/// without a port is refused.
#[tokio::test]
async fn port_forward_over_websockets_reaches_a_pod_on_the_virtual_node_as_it_does_below() {
    let pair = ClusterPair::shared().await.unwrap();
    let (_vn, ns) = pod_on_virtual_node(pair, "vk-ws-forward", "kubelet-ws-forward").await;
    let n = ns.name.as_str();
    let clients = [
        ("upper", pair.upper.client().await.unwrap()),
        ("lower", pair.lower.client().await.unwrap()),
    ];
    let ports: [u16; 2] = [8080, 9090];
    for protocol in ["v4.channel.k8s.io", "v4.base64.channel.k8s.io"] {
        for (cluster, client) in &clients {
            let path = format!("/api/v1/namespaces/{n}/pods/ws/portforward?ports=8080,9090");
            let (mut socket, chosen) = open(client, &path, protocol)
                .await
                .unwrap_or_else(|e| panic!("{cluster} {protocol}: refused {e:?}"));
            assert_eq!(chosen.as_deref(), Some(protocol), "{cluster}");
            // Each channel opens with its port.
            let mut opened = std::collections::BTreeMap::new();
            while opened.len() < 4 {
                let message = tokio::time::timeout(TIMEOUT, socket.next())
                    .await
                    .unwrap_or_else(|_| panic!("{cluster} {protocol}: no port message"))
                    .unwrap()
                    .unwrap();
                if let Some((channel, payload)) = unframe(protocol, message) {
                    opened.insert(channel, payload);
                }
            }
            for (index, port) in ports.iter().enumerate() {
                let data = u8::try_from(index * 2).unwrap();
                for channel in [data, data + 1] {
                    assert_eq!(
                        opened.get(&channel).map(Vec::as_slice),
                        Some(port.to_le_bytes().as_slice()),
                        "{cluster} {protocol} channel {channel}"
                    );
                }
            }
            // Each port's bytes come back on its own channel.
            for (index, port) in ports.iter().enumerate() {
                let data = u8::try_from(index * 2).unwrap();
                let sent = format!("to port {port} over {protocol}\n").repeat(50);
                socket
                    .send(frame(protocol, data, sent.as_bytes()))
                    .await
                    .unwrap();
                let mut back = Vec::new();
                while back.len() < sent.len() {
                    let message = tokio::time::timeout(TIMEOUT, socket.next())
                        .await
                        .unwrap_or_else(|_| panic!("{cluster} {protocol}: no echo from {port}"))
                        .unwrap()
                        .unwrap();
                    match unframe(protocol, message) {
                        Some((channel, payload)) if channel == data => back.extend(payload),
                        Some((channel, payload)) => panic!(
                            "{cluster} {protocol}: channel {channel} said {:?}",
                            String::from_utf8_lossy(&payload)
                        ),
                        None => {}
                    }
                }
                assert_eq!(String::from_utf8_lossy(&back), sent, "{cluster} {protocol}");
            }
            let _ = socket.close(None).await;
        }
    }
    // No port: refused, as a kubelet refuses it (a 400 from the virtual node).
    let upper = pair.upper.client().await.unwrap();
    let refused = open(
        &upper,
        &format!("/api/v1/namespaces/{n}/pods/ws/portforward"),
        "v4.channel.k8s.io",
    )
    .await;
    assert!(refused.is_err(), "a port-forward with no port was accepted");
}
