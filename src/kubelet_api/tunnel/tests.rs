//! The tunnel's pieces in process: the 101 checks, the WebSocket byte stream, and the relay
//! between an upper SPDY connection and a lower one (a SPDY client standing for kubectl, a
//! SPDY server for the kubelet).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::time::Duration;

use http::HeaderMap;
use http::header::{SEC_WEBSOCKET_ACCEPT, SEC_WEBSOCKET_PROTOCOL};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";
/// RFC 6455's accept key for [`KEY`].
const ACCEPT: &str = "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=";
const WAIT: Duration = Duration::from_secs(10);

/// Two headers of a 101 answer (Sec-WebSocket-Accept and Sec-WebSocket-Protocol, or
/// Upgrade and X-Stream-Protocol-Version), and whether the answer is taken (else the
/// protocol, or upgrade, it named).
type UpgradeCase = (
    Option<&'static str>,
    Option<&'static str>,
    Result<(), Option<&'static str>>,
);

#[test]
fn only_an_upgrade_to_the_tunnel_is_taken() {
    let cases: [UpgradeCase; 5] = [
        (Some(ACCEPT), Some(TUNNEL_PROTOCOL), Ok(())),
        // A kubelet reached through an API server that does not tunnel picks its own.
        (
            Some(ACCEPT),
            Some("v4.channel.k8s.io"),
            Err(Some("v4.channel.k8s.io")),
        ),
        (Some(ACCEPT), None, Err(None)),
        (
            Some("wrong"),
            Some(TUNNEL_PROTOCOL),
            Err(Some(TUNNEL_PROTOCOL)),
        ),
        (None, Some(TUNNEL_PROTOCOL), Err(Some(TUNNEL_PROTOCOL))),
    ];
    for (accept, protocol, want) in cases {
        let mut headers = HeaderMap::new();
        if let Some(accept) = accept {
            headers.insert(SEC_WEBSOCKET_ACCEPT, accept.parse().unwrap());
        }
        if let Some(protocol) = protocol {
            headers.insert(SEC_WEBSOCKET_PROTOCOL, protocol.parse().unwrap());
        }
        let want = want.map_err(|p| p.map(str::to_owned));
        assert_eq!(
            accepts_tunnel(&headers, KEY),
            want,
            "{accept:?} {protocol:?}"
        );
    }
}

#[test]
fn only_an_upgrade_to_spdy_carrying_port_forward_is_taken() {
    let cases: [UpgradeCase; 6] = [
        (Some("SPDY/3.1"), Some(PORT_FORWARD_PROTOCOL), Ok(())),
        (Some("spdy/3.1"), Some(PORT_FORWARD_PROTOCOL), Ok(())),
        // A kubelet that negotiated nothing speaks the first version.
        (Some("SPDY/3.1"), None, Ok(())),
        (
            Some("SPDY/3.1"),
            Some("channel.k8s.io"),
            Err(Some(
                "SPDY/3.1 with X-Stream-Protocol-Version channel.k8s.io",
            )),
        ),
        (Some("websocket"), None, Err(Some("websocket"))),
        (None, Some(PORT_FORWARD_PROTOCOL), Err(None)),
    ];
    for (upgrade, protocol, want) in cases {
        let mut headers = HeaderMap::new();
        if let Some(upgrade) = upgrade {
            headers.insert(http::header::UPGRADE, upgrade.parse().unwrap());
        }
        if let Some(protocol) = protocol {
            headers.insert("x-stream-protocol-version", protocol.parse().unwrap());
        }
        let want = want.map_err(|p| p.map(str::to_owned));
        assert_eq!(accepts_spdy(&headers), want, "{upgrade:?} {protocol:?}");
    }
    // A protocol header that is not text is not taken for none.
    let mut headers = HeaderMap::new();
    headers.insert(http::header::UPGRADE, "SPDY/3.1".parse().unwrap());
    headers.insert(
        "x-stream-protocol-version",
        HeaderValue::from_bytes(b"\xffportforward.k8s.io").unwrap(),
    );
    assert_eq!(
        accepts_spdy(&headers),
        Err(Some(
            "SPDY/3.1 with an unreadable X-Stream-Protocol-Version".to_owned()
        ))
    );
}

#[test]
fn only_the_api_servers_own_refusal_of_the_caller_or_pod_is_final() {
    let status = |code: u16, reason: &str| {
        format!(
            r#"{{"kind":"Status","apiVersion":"v1","status":"Failure","message":"pods \"p\" is {reason}","reason":"{reason}","code":{code}}}"#
        )
    };
    // (status, body, message read, from the API server, final)
    let cases: [(u16, String, &str, bool, bool); 8] = [
        (
            403,
            status(403, "Forbidden"),
            "pods \"p\" is Forbidden",
            true,
            true,
        ),
        (
            401,
            status(401, "Unauthorized"),
            "pods \"p\" is Unauthorized",
            true,
            true,
        ),
        (
            404,
            status(404, "NotFound"),
            "pods \"p\" is NotFound",
            true,
            true,
        ),
        // Envoy refusing an upgrade it does not pass on: try the other way.
        (403, "upgrade_failed".into(), "upgrade_failed", false, false),
        // A kubelet's own answer passed through: no common protocol.
        (
            403,
            "unable to upgrade: no common protocol\n".into(),
            "unable to upgrade: no common protocol",
            false,
            false,
        ),
        (
            400,
            status(400, "BadRequest"),
            "pods \"p\" is BadRequest",
            true,
            false,
        ),
        (
            500,
            status(500, "InternalError"),
            "pods \"p\" is InternalError",
            true,
            false,
        ),
        // JSON, but not a Status.
        (
            404,
            r#"{"message":"no route"}"#.into(),
            r#"{"message":"no route"}"#,
            false,
            false,
        ),
    ];
    for (code, body, message, from_api_server, fin) in cases {
        let refusal = Refusal::read(StatusCode::from_u16(code).unwrap(), body.as_bytes());
        assert_eq!(refusal.message, message, "{code} {body}");
        assert_eq!(refusal.from_api_server, from_api_server, "{code} {body}");
        assert_eq!(refusal.is_final(), fin, "{code} {body}");
        let error = TunnelError::Refused {
            pod: "p".into(),
            by: Upgrade::Spdy,
            refusal,
        };
        assert_eq!(error.is_final(), fin);
        assert!(
            error.to_string().starts_with(&format!(
                "lower cluster: port-forward to p upgraded to SPDY refused: {code} "
            )),
            "{error}"
        );
    }
}

/// Two ends of a WebSocket over memory.
async fn socket_pair() -> (
    WebSocketStream<tokio::io::DuplexStream>,
    WebSocketStream<tokio::io::DuplexStream>,
) {
    let (a, b) = tokio::io::duplex(256 * 1024);
    let client = WebSocketStream::from_raw_socket(a, Role::Client, None).await;
    let server = WebSocketStream::from_raw_socket(b, Role::Server, None).await;
    (client, server)
}

#[tokio::test]
async fn the_tunnel_carries_bytes_both_ways_whatever_the_message_bounds() {
    use futures::{SinkExt, StreamExt};
    let (client, mut server) = socket_pair().await;
    let mut io = TunnelIo::new(client);
    // A write larger than one message is cut into several.
    let big: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
    io.write_all(&big).await.unwrap();
    io.flush().await.unwrap();
    let mut got = Vec::new();
    while got.len() < big.len() {
        match server.next().await.unwrap().unwrap() {
            Message::Binary(data) => {
                assert!(data.len() <= TUNNEL_MESSAGE);
                got.extend_from_slice(&data);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(got, big);
    // Messages of any size (empty ones, pings, text too) read as one byte stream.
    for message in [
        Message::Binary(Bytes::from_static(b"ab")),
        Message::Binary(Bytes::new()),
        Message::Ping(Bytes::from_static(b"p")),
        Message::text("ignored"),
        Message::Binary(Bytes::from_static(b"cde")),
    ] {
        server.send(message).await.unwrap();
    }
    let mut five = [0u8; 5];
    tokio::time::timeout(WAIT, io.read_exact(&mut five))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&five, b"abcde");
    // The peer's close is the end of the stream.
    server.close(None).await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(WAIT, io.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    assert!(rest.is_empty());
}

#[tokio::test]
async fn a_vectored_write_goes_out_as_one_message() {
    use futures::StreamExt;
    // Slice lengths written at once, and the messages the peer then gets.
    let cases: [(&[usize], &[usize]); 4] = [
        (&[8, 32 * 1024], &[8 + 32 * 1024]),
        (&[8, 32 * 1024, 8, 32 * 1024 - 16], &[TUNNEL_MESSAGE]),
        // More than a message: the rest goes in the next one.
        (
            &[8, 32 * 1024, 8, 32 * 1024, 8, 32 * 1024],
            &[TUNNEL_MESSAGE, 3 * (8 + 32 * 1024) - TUNNEL_MESSAGE],
        ),
        (&[0, 3, 0, 4], &[7]),
    ];
    for (slices, want) in cases {
        let (client, mut server) = socket_pair().await;
        let mut io = TunnelIo::new(client);
        let parts: Vec<Vec<u8>> = slices
            .iter()
            .enumerate()
            .map(|(i, len)| vec![i as u8; *len])
            .collect();
        let mut batch: std::collections::VecDeque<Bytes> =
            parts.iter().map(|p| Bytes::from(p.clone())).collect();
        assert!(io.is_write_vectored());
        // What the SPDY writer does with its batch.
        while !batch.is_empty() {
            let slices: Vec<std::io::IoSlice<'_>> =
                batch.iter().map(|b| std::io::IoSlice::new(b)).collect();
            let mut n = io.write_vectored(&slices).await.unwrap();
            while n > 0 {
                let front = batch.front_mut().unwrap();
                if n < front.len() {
                    let _ = front.split_to(n);
                    n = 0;
                } else {
                    n -= front.len();
                    batch.pop_front();
                }
            }
            while batch.front().is_some_and(Bytes::is_empty) {
                batch.pop_front();
            }
        }
        io.flush().await.unwrap();
        let mut got = Vec::new();
        let mut sizes = Vec::new();
        while got.len() < parts.iter().map(Vec::len).sum::<usize>() {
            match server.next().await.unwrap().unwrap() {
                Message::Binary(data) => {
                    sizes.push(data.len());
                    got.extend_from_slice(&data);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(sizes, want, "{slices:?}");
        assert_eq!(got, parts.concat(), "{slices:?}");
    }
}

/// kubectl's connection (a SPDY client), virtual-node's upper connection (a server) and
/// lower one (a client, over a WebSocket as through the lower API server), and the
/// kubelet's (a server), with the relay running between the middle two.
async fn forwarding() -> (Connection, Connection, tokio::task::JoinHandle<()>) {
    let (kubectl_io, upper_io) = tokio::io::duplex(256 * 1024);
    let kubectl = Connection::client(kubectl_io);
    let upper = Connection::server(upper_io);
    let (lower_socket, kubelet_socket) = socket_pair().await;
    let lower = Connection::client(TunnelIo::new(lower_socket));
    let kubelet = Connection::server(TunnelIo::new(kubelet_socket));
    let relay = tokio::spawn(relay(upper, lower));
    (kubectl, kubelet, relay)
}

fn headers(kind: &str, request: u32) -> Vec<(String, String)> {
    vec![
        ("streamtype".into(), kind.into()),
        ("port".into(), "8080".into()),
        ("requestid".into(), request.to_string()),
    ]
}

async fn accept(conn: &mut Connection) -> Stream {
    tokio::time::timeout(WAIT, conn.accept())
        .await
        .expect("a stream in time")
        .expect("a stream")
}

async fn open(conn: &mut Connection, kind: &str, request: u32) -> Stream {
    let pending = conn.open(headers(kind, request)).await.unwrap();
    tokio::time::timeout(WAIT, pending.established())
        .await
        .expect("a reply in time")
        .unwrap()
}

#[tokio::test]
async fn a_forwarded_connection_reaches_the_kubelet_with_its_headers_data_and_fins() {
    let (mut kubectl, mut kubelet, _relay) = forwarding().await;
    // As kubectl: the error stream (closed at once for writing), then the data stream.
    let error = open(&mut kubectl, "error", 0).await;
    let data = open(&mut kubectl, "data", 0).await;
    let below_error = accept(&mut kubelet).await;
    let below_data = accept(&mut kubelet).await;
    assert_eq!(below_error.headers(), headers("error", 0).as_slice());
    assert_eq!(below_data.headers(), headers("data", 0).as_slice());
    let (mut error_reader, mut error_writer) = error.split();
    error_writer.shutdown().await.unwrap();
    let (mut below_error_reader, mut below_error_writer) = below_error.split();
    let mut nothing = Vec::new();
    tokio::time::timeout(WAIT, below_error_reader.read_to_end(&mut nothing))
        .await
        .unwrap()
        .unwrap();
    assert!(nothing.is_empty(), "the client's FIN on the error stream");

    // 8 MiB each way at once, echoed by the kubelet's end.
    let (mut reader, mut writer) = data.split();
    let (mut below_reader, mut below_writer) = below_data.split();
    let echo = tokio::spawn(async move {
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            let n = below_reader.read(&mut buffer).await.unwrap();
            if n == 0 {
                break;
            }
            below_writer.write_all(&buffer[..n]).await.unwrap();
        }
        // Half-closed by the client: the kubelet's answer still goes out, then its FIN.
        below_writer.write_all(b"bye").await.unwrap();
        below_writer.shutdown().await.unwrap();
    });
    let total = 8 * 1024 * 1024;
    let send = async move {
        let chunk: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut sent = 0;
        while sent < total {
            let n = chunk.len().min(total - sent);
            writer.write_all(&chunk[..n]).await.unwrap();
            sent += n;
        }
        writer.shutdown().await.unwrap();
    };
    let receive = async move {
        let mut got = Vec::new();
        reader.read_to_end(&mut got).await.unwrap();
        got
    };
    let started = std::time::Instant::now();
    let ((), got) = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(send, receive)
    })
    .await
    .expect("the transfer in time");
    println!(
        "relayed {} MiB each way in {:?}",
        total / (1024 * 1024),
        started.elapsed()
    );
    assert_eq!(got.len(), total + 3);
    assert!(
        got[..total]
            .iter()
            .enumerate()
            .all(|(i, b)| *b == ((i % 100_000) % 251) as u8),
        "the bytes come back in order"
    );
    assert_eq!(&got[total..], b"bye");
    echo.await.unwrap();

    // The kubelet's error message reaches the client's error stream.
    below_error_writer
        .write_all(b"an error from the kubelet")
        .await
        .unwrap();
    below_error_writer.shutdown().await.unwrap();
    let mut message = Vec::new();
    tokio::time::timeout(WAIT, error_reader.read_to_end(&mut message))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(message, b"an error from the kubelet");
}

#[tokio::test]
async fn resets_pass_both_ways() {
    let (mut kubectl, mut kubelet, _relay) = forwarding().await;
    let data = open(&mut kubectl, "data", 1).await;
    let below = accept(&mut kubelet).await;
    // The kubelet resets: the client's read fails, as it would straight to the kubelet.
    let (mut reader, _writer) = data.split();
    let (_below_reader, below_writer) = below.split();
    below_writer.reset();
    let read = tokio::time::timeout(WAIT, reader.read(&mut [0u8; 16]))
        .await
        .unwrap();
    assert_eq!(
        read.unwrap_err().kind(),
        io::ErrorKind::ConnectionReset,
        "the reset reaches the client"
    );
    // The client resets: the kubelet's read fails.
    let data = open(&mut kubectl, "data", 2).await;
    let below = accept(&mut kubelet).await;
    let (_reader, writer) = data.split();
    let (mut below_reader, _below_writer) = below.split();
    writer.reset();
    let read = tokio::time::timeout(WAIT, below_reader.read(&mut [0u8; 16]))
        .await
        .unwrap();
    assert_eq!(read.unwrap_err().kind(), io::ErrorKind::ConnectionReset);
}

#[tokio::test]
async fn the_end_of_either_connection_ends_the_other() {
    // The kubelet's side goes: the client's connection ends, its streams aborted.
    let (mut kubectl, mut kubelet, relay) = forwarding().await;
    let data = open(&mut kubectl, "data", 0).await;
    let _below = accept(&mut kubelet).await;
    kubelet.close().await;
    tokio::time::timeout(WAIT, relay).await.unwrap().unwrap();
    tokio::time::timeout(WAIT, kubectl.ended()).await.unwrap();
    let (mut reader, _) = data.split();
    assert!(reader.read(&mut [0u8; 16]).await.is_err());
    assert_eq!(
        kubectl.open(headers("data", 1)).await.unwrap_err(),
        super::super::spdy::OpenError::Ended
    );

    // The client goes: the kubelet's connection ends.
    let (mut kubectl, mut kubelet, relay) = forwarding().await;
    let _data = open(&mut kubectl, "data", 0).await;
    let _below = accept(&mut kubelet).await;
    kubectl.close().await;
    tokio::time::timeout(WAIT, relay).await.unwrap().unwrap();
    assert!(
        tokio::time::timeout(WAIT, kubelet.accept())
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn a_stream_the_kubelet_refuses_is_reset_for_the_client() {
    // The kubelet's connection no longer accepts streams (its Connection is gone, the
    // transport still open): each is refused with RST_STREAM, which the client sees.
    let (kubectl_io, upper_io) = tokio::io::duplex(64 * 1024);
    let mut kubectl = Connection::client(kubectl_io);
    let upper = Connection::server(upper_io);
    let (lower_socket, kubelet_socket) = socket_pair().await;
    let lower = Connection::client(TunnelIo::new(lower_socket));
    let kubelet = Connection::server(TunnelIo::new(kubelet_socket));
    let _relay = tokio::spawn(relay(upper, lower));
    let pending = kubectl.open(headers("data", 0)).await.unwrap();
    drop(kubelet);
    let established = tokio::time::timeout(WAIT, pending.established()).await;
    match established {
        // Refused outright, or accepted upstairs and then reset.
        Ok(Err(_)) => {}
        Ok(Ok(stream)) => {
            let (mut reader, _w) = stream.split();
            let read = tokio::time::timeout(WAIT, reader.read(&mut [0u8; 16]))
                .await
                .unwrap();
            assert!(
                read.is_err(),
                "a refused stream reads as an error: {read:?}"
            );
        }
        Err(_) => panic!("no answer to the stream"),
    }
}
