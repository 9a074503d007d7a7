//! exec and attach over a WebSocket, as a kubelet serves them: the subprotocols
//! `channel.k8s.io`, `base64.channel.k8s.io`, `v4.channel.k8s.io`,
//! `v4.base64.channel.k8s.io` and `v5.channel.k8s.io`. Each message carries one channel
//! (0 stdin, 1 stdout, 2 stderr, 3 error, 4 resize) in its first byte (an ASCII digit, and
//! the rest base64 text, in the base64 variants); v5 adds 255, a stream's close (the
//! client's end of stdin). The channels feed the same lower call as SPDY
//! ([`streams::call_lower`]). The framing and the handshake are pure; [`exec`] runs it.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use http::{HeaderMap, StatusCode, header};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Status;
use kube::api::Api;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tracing::debug;

use super::route::StreamFlags;
use super::streams::{self, ClientEnds};

/// Channel of the command's standard input.
pub const STDIN: u8 = 0;
/// Channel of its standard output.
pub const STDOUT: u8 = 1;
/// Channel of its standard error.
pub const STDERR: u8 = 2;
/// Channel of the call's verdict (v4+: a JSON `Status`; before: the failure's message).
pub const ERROR: u8 = 3;
/// Channel of terminal sizes (JSON `{"Width":…,"Height":…}`).
pub const RESIZE: u8 = 4;
/// v5: a message on this channel closes the stream its one byte names.
pub const CLOSE: u8 = 255;

/// Bytes buffered between the WebSocket and the lower call, per stream.
const PIPE_BUFFER: usize = 64 * 1024;
/// Largest output chunk sent in one message.
const MESSAGE_PAYLOAD: usize = 32 * 1024;

/// A remote-command subprotocol a kubelet serves over a WebSocket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// `channel.k8s.io` (and no subprotocol at all): binary, a failure's message as text.
    V1,
    /// `base64.channel.k8s.io`.
    V1Base64,
    /// `v4.channel.k8s.io`: the error channel carries a JSON `Status`.
    V4,
    /// `v4.base64.channel.k8s.io`.
    V4Base64,
    /// `v5.channel.k8s.io`: v4, and the client may close its stdin (channel 255).
    V5,
}

/// The subprotocols of exec and attach, by name; none offered: `channel.k8s.io`.
pub const EXEC_PROTOCOLS: Served = Served {
    names: &PROTOCOLS,
    default: Protocol::V1,
};
/// The subprotocols of port-forward, by name (a kubelet's); none offered: binary.
pub const PORT_FORWARD_PROTOCOLS: Served = Served {
    names: &[
        ("v4.channel.k8s.io", Protocol::V4),
        ("v4.base64.channel.k8s.io", Protocol::V4Base64),
    ],
    default: Protocol::V4,
};

/// The subprotocols one call serves.
#[derive(Clone, Copy, Debug)]
pub struct Served {
    /// By name, in the server's order.
    names: &'static [(&'static str, Protocol)],
    /// What a client that offers none gets.
    default: Protocol,
}

/// The subprotocols served, by name.
const PROTOCOLS: [(&str, Protocol); 5] = [
    ("channel.k8s.io", Protocol::V1),
    ("base64.channel.k8s.io", Protocol::V1Base64),
    ("v4.channel.k8s.io", Protocol::V4),
    ("v4.base64.channel.k8s.io", Protocol::V4Base64),
    ("v5.channel.k8s.io", Protocol::V5),
];

impl Protocol {
    /// Payloads are base64 text, the channel an ASCII digit.
    pub fn base64(self) -> bool {
        matches!(self, Self::V1Base64 | Self::V4Base64)
    }

    /// The error channel carries a JSON `Status`, Success included.
    pub fn json_status(self) -> bool {
        !matches!(self, Self::V1 | Self::V1Base64)
    }

    /// The client may close a stream (channel 255).
    pub fn close_signal(self) -> bool {
        self == Self::V5
    }
}

/// The server's half of the handshake: what the 101 answer carries.
#[derive(Debug, PartialEq, Eq)]
pub struct Handshake {
    /// `Sec-WebSocket-Accept`.
    pub accept: String,
    /// The protocol chosen.
    pub protocol: Protocol,
    /// `Sec-WebSocket-Protocol`, when the client offered any.
    pub protocol_name: Option<&'static str>,
}

/// Whether a request asks for a WebSocket (`Upgrade: websocket`, `Connection: …upgrade…`).
pub fn is_upgrade(headers: &HeaderMap) -> bool {
    let upgrade = headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("websocket"));
    let connection = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("upgrade"));
    upgrade && connection
}

/// Checks a WebSocket upgrade request and picks the first protocol the client offers that
/// is `served` (none offered: its default); else the status and message to refuse with.
pub fn handshake(headers: &HeaderMap, served: Served) -> Result<Handshake, (StatusCode, String)> {
    let version = headers
        .get(header::SEC_WEBSOCKET_VERSION)
        .and_then(|v| v.to_str().ok());
    if version.map(str::trim) != Some("13") {
        return Err((
            StatusCode::BAD_REQUEST,
            format!("unsupported Sec-WebSocket-Version {version:?}: 13 is served"),
        ));
    }
    let Some(key) = headers.get(header::SEC_WEBSOCKET_KEY) else {
        return Err((
            StatusCode::BAD_REQUEST,
            "missing Sec-WebSocket-Key".to_owned(),
        ));
    };
    let offered: Vec<&str> = headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    let (protocol, protocol_name) = if offered.is_empty() {
        (served.default, None)
    } else {
        let chosen = offered
            .iter()
            .find_map(|name| served.names.iter().find(|(served, _)| served == name));
        match chosen {
            Some((name, protocol)) => (*protocol, Some(*name)),
            None => {
                let served: Vec<&str> = served.names.iter().map(|(name, _)| *name).collect();
                return Err((
                    StatusCode::FORBIDDEN,
                    format!(
                        "requested protocol(s) are not supported: {offered:?}; supports {served:?}"
                    ),
                ));
            }
        }
    };
    Ok(Handshake {
        accept: derive_accept_key(key.as_bytes()),
        protocol,
        protocol_name,
    })
}

/// The message that carries `payload` on `channel`.
pub fn encode(protocol: Protocol, channel: u8, payload: &[u8]) -> Message {
    if protocol.base64() {
        let mut text = String::with_capacity(1 + payload.len().div_ceil(3) * 4);
        text.push(char::from(b'0'.wrapping_add(channel)));
        STANDARD.encode_string(payload, &mut text);
        Message::text(text)
    } else {
        let mut frame = Vec::with_capacity(1 + payload.len());
        frame.push(channel);
        frame.extend_from_slice(payload);
        Message::Binary(Bytes::from(frame))
    }
}

/// What a message from the client means.
#[derive(Debug, PartialEq, Eq)]
pub enum FromClient {
    /// Bytes for a channel.
    Data(u8, Bytes),
    /// v5: the client closed this stream.
    CloseStream(u8),
    /// The client closed the connection.
    Closed,
    /// Nothing to act on (control frames, empty messages).
    Nothing,
}

/// A message the client sent that the protocol cannot carry.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// A base64 payload that is not base64.
    #[error("channel {channel}: invalid base64 payload")]
    Base64 {
        /// The channel.
        channel: u8,
    },
    /// A base64 protocol's channel that is not a digit.
    #[error("invalid channel character {0:?}")]
    Channel(char),
    /// A v5 close message without the stream it closes.
    #[error("close message without a stream")]
    EmptyClose,
}

/// Reads one message from the client.
pub fn decode(protocol: Protocol, message: Message) -> Result<FromClient, DecodeError> {
    let data: Bytes = match message {
        Message::Binary(data) => data,
        Message::Text(text) => Bytes::from(text),
        Message::Close(_) => return Ok(FromClient::Closed),
        Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => return Ok(FromClient::Nothing),
    };
    let Some((&first, payload)) = data.split_first() else {
        return Ok(FromClient::Nothing);
    };
    if protocol.base64() {
        let channel = first
            .checked_sub(b'0')
            .filter(|c| *c <= 9)
            .ok_or(DecodeError::Channel(char::from(first)))?;
        let decoded = STANDARD
            .decode(payload)
            .map_err(|_| DecodeError::Base64 { channel })?;
        return Ok(FromClient::Data(channel, Bytes::from(decoded)));
    }
    if first == CLOSE && protocol.close_signal() {
        return payload
            .first()
            .map(|stream| FromClient::CloseStream(*stream))
            .ok_or(DecodeError::EmptyClose);
    }
    Ok(FromClient::Data(first, data.slice(1..)))
}

/// What the error channel carries at the end of a call, if anything: v4+ the `Status` as
/// JSON, Success included; before v4, a failure's message only.
pub fn status_payload(protocol: Protocol, status: &Status) -> Option<Vec<u8>> {
    if protocol.json_status() {
        serde_json::to_vec(status).ok()
    } else if status.status.as_deref() == Some("Success") {
        None
    } else {
        Some(status.message.clone().unwrap_or_default().into_bytes())
    }
}

/// The WebSocket a kubelet API client upgraded to.
pub type ClientSocket = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

/// Wraps the upgraded connection as the server's end of a WebSocket.
pub async fn server_socket(upgraded: hyper::upgrade::Upgraded) -> ClientSocket {
    let config = WebSocketConfig::default().read_buffer_size(32 * 1024);
    WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, Some(config)).await
}

/// The messages the client sent, and one writer to it: the messages queued on the sender
/// go out in order, then the close, once every sender is dropped (run the writer beside
/// the session).
fn one_writer(
    socket: ClientSocket,
) -> (
    impl Future<Output = ()> + Send,
    futures::channel::mpsc::Sender<Message>,
    futures::stream::SplitStream<ClientSocket>,
) {
    let (mut sink, source) = socket.split();
    let (out, mut outgoing) = futures::channel::mpsc::channel::<Message>(8);
    let writer = async move {
        while let Some(message) = outgoing.next().await {
            if sink.send(message).await.is_err() {
                return;
            }
        }
        // A normal close, as the kubelet's: a close frame without a code reaches a Go
        // client as `close 1005 (no status)`, an error to kubectl when the API server
        // passes its WebSocket through.
        let normal = CloseFrame {
            code: CloseCode::Normal,
            reason: "".into(),
        };
        let _ = sink.send(Message::Close(Some(normal))).await;
        let _ = sink.close().await;
    };
    (writer, out, source)
}

/// Serves one exec (`command` given) or attach on `socket`, against the lower pod.
pub async fn exec(
    socket: ClientSocket,
    protocol: Protocol,
    pods: Api<Pod>,
    pod: String,
    container: String,
    command: Option<Vec<String>>,
    flags: StreamFlags,
) {
    // One writer: output, the verdict and the close go out in the order they were queued.
    let (writer, out, mut source) = one_writer(socket);
    let session = async move {
        let mut out = out;
        let stderr_wanted = flags.stderr && !flags.tty;
        // An empty message on the lowest channel the client writes tells it the call is
        // connected (as the kubelet does).
        let first = if flags.stdout {
            STDOUT
        } else if stderr_wanted {
            STDERR
        } else {
            ERROR
        };
        if out.send(encode(protocol, first, &[])).await.is_err() {
            return;
        }
        // One end for the lower call, one for the WebSocket; either dropped ends the other.
        let pipe = || tokio::io::duplex(PIPE_BUFFER);
        let (stdin, mut stdin_writer) = split(flags.stdin.then(pipe));
        let (resize, mut resize_writer) = split(flags.tty.then(pipe));
        let (mut stdout_reader, stdout) = split(flags.stdout.then(pipe));
        let (mut stderr_reader, stderr) = split(stderr_wanted.then(pipe));
        let ends = ClientEnds {
            stdin,
            stdout,
            stderr,
            resize,
        };
        // The client's messages, until it closes the connection (which ends the call).
        let input = async {
            while let Some(Ok(message)) = source.next().await {
                match decode(protocol, message) {
                    Ok(FromClient::Data(STDIN, data)) => {
                        write_or_close(&mut stdin_writer, &data).await;
                    }
                    Ok(FromClient::Data(RESIZE, data)) => {
                        write_or_close(&mut resize_writer, &data).await;
                    }
                    Ok(FromClient::CloseStream(STDIN)) => {
                        if let Some(mut writer) = stdin_writer.take() {
                            let _ = writer.shutdown().await;
                        }
                    }
                    Ok(FromClient::Closed) => return,
                    Ok(FromClient::Data(channel, _) | FromClient::CloseStream(channel)) => {
                        // Never the payload: it may be what the user types.
                        debug!(channel, "exec/attach over WebSocket: message ignored");
                    }
                    Ok(FromClient::Nothing) => {}
                    Err(error) => debug!(%error, "exec/attach over WebSocket: message ignored"),
                }
            }
        };
        let call = streams::call_lower(&pods, &pod, container, command, flags, ends, input);
        let (status, (), ()) = tokio::join!(
            call,
            send_output(&mut stdout_reader, STDOUT, protocol, out.clone()),
            send_output(&mut stderr_reader, STDERR, protocol, out.clone()),
        );
        let Some(status) = status else {
            return;
        };
        if let Some(payload) = status_payload(protocol, &status) {
            let _ = out.send(encode(protocol, ERROR, &payload)).await;
        }
    };
    tokio::join!(session, writer);
}

fn split<R, W>(pipe: Option<(R, W)>) -> (Option<R>, Option<W>) {
    match pipe {
        Some((r, w)) => (Some(r), Some(w)),
        None => (None, None),
    }
}

/// Passes client input to the call; once the call stops reading it, drops it.
async fn write_or_close(writer: &mut Option<impl AsyncWrite + Unpin>, data: &[u8]) {
    if let Some(to) = writer
        && to.write_all(data).await.is_err()
    {
        *writer = None;
    }
}

/// Sends what the command writes on `channel`, a message per chunk read, until its end.
async fn send_output(
    from: &mut Option<impl AsyncRead + Unpin>,
    channel: u8,
    protocol: Protocol,
    mut out: futures::channel::mpsc::Sender<Message>,
) {
    let Some(from) = from else {
        return;
    };
    let mut buffer = vec![0u8; MESSAGE_PAYLOAD];
    loop {
        match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => {
                if out
                    .send(encode(protocol, channel, &buffer[..n]))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }
    }
}

/// The ports a WebSocket port-forward asks for: every `port` (what an API server passes
/// on) or `ports` query parameter, each a comma-separated list of ports above 0, as a
/// kubelet reads them; else why not.
pub fn forwarded_ports(query: Option<&str>) -> Result<Vec<u16>, String> {
    let mut ports = Vec::new();
    let pairs = super::route::query_pairs(query);
    let given = ["port", "ports"]
        .into_iter()
        .flat_map(|key| pairs.get(key).into_iter().flatten().map(move |v| (key, v)));
    for (key, value) in given {
        if value.is_empty() {
            return Err(format!("query parameter {key:?} cannot be empty"));
        }
        for port in value.split(',') {
            match port.trim().parse::<u16>() {
                Ok(0) => return Err(format!("port {port:?} must be > 0")),
                Ok(port) => ports.push(port),
                Err(_) => return Err(format!("unable to parse {port:?} as a port")),
            }
        }
    }
    if ports.is_empty() {
        return Err("query parameter \"port\" is required".to_owned());
    }
    Ok(ports)
}

/// The channels of the `index`th port of a WebSocket port-forward: its data, and its
/// error (a message, then the end).
fn port_channels(index: usize) -> Option<(u8, u8)> {
    let data = u8::try_from(index.checked_mul(2)?).ok()?;
    Some((data, data.checked_add(1)?))
}

/// Serves port-forward on `socket` as a kubelet does over a WebSocket: for the `i`th of
/// `ports`, channel `2i` carries its data both ways and `2i + 1` its error, each opened by
/// the port (2 bytes, little-endian); each port is one connection to that port of the
/// lower pod ([`streams::forward_port`]). Ends once every port's connection has.
pub async fn port_forward(
    socket: ClientSocket,
    protocol: Protocol,
    pods: Api<Pod>,
    pod: String,
    ports: Vec<u16>,
) {
    let (writer, out, mut source) = one_writer(socket);
    let session = async move {
        let mut to_ports = Vec::new();
        let mut forwards = futures::stream::FuturesUnordered::new();
        for (index, port) in ports.into_iter().enumerate() {
            let Some((data, error)) = port_channels(index) else {
                break;
            };
            let mut out = out.clone();
            for channel in [data, error] {
                if out
                    .send(encode(protocol, channel, &port.to_le_bytes()))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            // One end for the lower connection, one for the WebSocket.
            let (client_end, forward_end) = tokio::io::duplex(PIPE_BUFFER);
            let (mut from_port, to_port) = tokio::io::split(client_end);
            to_ports.push(Some(to_port));
            let (pods, pod) = (pods.clone(), pod.clone());
            forwards.push(async move {
                let (from_client, mut to_client) = tokio::io::split(forward_end);
                let forwarded = async {
                    let result =
                        streams::forward_port(&pods, &pod, port, from_client, &mut to_client)
                            .await;
                    let _ = to_client.shutdown().await;
                    result
                };
                let copied = async {
                    let mut buffer = vec![0; MESSAGE_PAYLOAD];
                    loop {
                        match from_port.read(&mut buffer).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                if out.send(encode(protocol, data, &buffer[..n])).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                };
                let (result, ()) = tokio::join!(forwarded, copied);
                if let Err(message) = result {
                    debug!(object = %pod, kind = "Pod", cluster = "lower", port, %message, "port-forward over WebSocket ended in error");
                    let _ = out.send(encode(protocol, error, message.as_bytes())).await;
                }
            });
        }
        drop(out);
        // The client's messages, until it closes the connection or every port is done.
        let input = async {
            while let Some(Ok(message)) = source.next().await {
                match decode(protocol, message) {
                    Ok(FromClient::Data(channel, data)) if channel % 2 == 0 => {
                        let port = to_ports.get_mut(usize::from(channel / 2));
                        if let Some(writer) = port {
                            write_or_close(writer, &data).await;
                        }
                    }
                    Ok(FromClient::Closed) => return,
                    Ok(_) => {}
                    Err(error) => debug!(%error, "port-forward over WebSocket: message ignored"),
                }
            }
        };
        tokio::pin!(input);
        let all_done = async { while forwards.next().await.is_some() {} };
        tokio::select! {
            () = &mut input => {}
            () = all_done => {}
        }
    };
    tokio::join!(writer, session);
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(protocols: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, Upgrade"),
        );
        h.insert(
            header::SEC_WEBSOCKET_VERSION,
            HeaderValue::from_static("13"),
        );
        h.insert(
            header::SEC_WEBSOCKET_KEY,
            HeaderValue::from_static("dGhlIHNhbXBsZSBub25jZQ=="),
        );
        for p in protocols {
            h.append(
                header::SEC_WEBSOCKET_PROTOCOL,
                HeaderValue::from_str(p).unwrap(),
            );
        }
        h
    }

    #[test]
    fn negotiation_picks_the_first_protocol_offered_that_is_served() {
        /// Protocols offered, and the protocol chosen (and named) or the refusal's code.
        type Case = (
            &'static [&'static str],
            Result<(Protocol, Option<&'static str>), StatusCode>,
        );
        let cases: [Case; 8] = [
            (&[], Ok((Protocol::V1, None))),
            (
                &["channel.k8s.io"],
                Ok((Protocol::V1, Some("channel.k8s.io"))),
            ),
            (
                &["base64.channel.k8s.io"],
                Ok((Protocol::V1Base64, Some("base64.channel.k8s.io"))),
            ),
            (
                &["v5.channel.k8s.io, v4.channel.k8s.io"],
                Ok((Protocol::V5, Some("v5.channel.k8s.io"))),
            ),
            (
                &[
                    "v6.channel.k8s.io",
                    "v4.base64.channel.k8s.io",
                    "v4.channel.k8s.io",
                ],
                Ok((Protocol::V4Base64, Some("v4.base64.channel.k8s.io"))),
            ),
            (
                // A bearer token offered as a protocol (as browsers do) is skipped.
                &[
                    "base64url.bearer.authorization.k8s.io.dG9rZW4",
                    "v4.channel.k8s.io",
                ],
                Ok((Protocol::V4, Some("v4.channel.k8s.io"))),
            ),
            (&["SPDY/3.1"], Err(StatusCode::FORBIDDEN)),
            (&["portforward.k8s.io"], Err(StatusCode::FORBIDDEN)),
        ];
        for (offered, want) in cases {
            let got = handshake(&headers(offered), EXEC_PROTOCOLS)
                .map(|h| (h.protocol, h.protocol_name))
                .map_err(|(code, _)| code);
            assert_eq!(got, want, "{offered:?}");
        }
        // RFC 6455's example key.
        assert_eq!(
            handshake(&headers(&[]), EXEC_PROTOCOLS).unwrap().accept,
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
        let mut old = headers(&[]);
        old.insert(header::SEC_WEBSOCKET_VERSION, HeaderValue::from_static("8"));
        assert_eq!(
            handshake(&old, EXEC_PROTOCOLS).unwrap_err().0,
            StatusCode::BAD_REQUEST
        );
        let mut keyless = headers(&[]);
        keyless.remove(header::SEC_WEBSOCKET_KEY);
        assert_eq!(
            handshake(&keyless, EXEC_PROTOCOLS).unwrap_err().0,
            StatusCode::BAD_REQUEST
        );
    }

    #[test]
    fn upgrade_requests() {
        assert!(is_upgrade(&headers(&[])));
        let mut spdy = headers(&[]);
        spdy.insert(header::UPGRADE, HeaderValue::from_static("SPDY/3.1"));
        assert!(!is_upgrade(&spdy));
        let mut no_connection = headers(&[]);
        no_connection.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
        assert!(!is_upgrade(&no_connection));
    }

    fn binary(bytes: &[u8]) -> Message {
        Message::Binary(Bytes::copy_from_slice(bytes))
    }

    #[test]
    fn encoding_per_protocol() {
        let cases = [
            (Protocol::V1, STDOUT, &b"hi\n"[..], binary(b"\x01hi\n")),
            (Protocol::V4, STDERR, b"", binary(b"\x02")),
            (Protocol::V5, ERROR, b"{}", binary(b"\x03{}")),
            (
                Protocol::V1Base64,
                STDOUT,
                b"foo\n",
                Message::text("1Zm9vCg=="),
            ),
            (Protocol::V4Base64, ERROR, b"", Message::text("3")),
            (
                Protocol::V4Base64,
                STDERR,
                b"\xff\x00",
                Message::text("2/wA="),
            ),
        ];
        for (protocol, channel, payload, want) in cases {
            assert_eq!(encode(protocol, channel, payload), want, "{protocol:?}");
        }
    }

    #[test]
    fn decoding_per_protocol() {
        let data = |c: u8, b: &[u8]| Ok(FromClient::Data(c, Bytes::copy_from_slice(b)));
        let cases = [
            (Protocol::V1, binary(b"\x00foo\n"), data(STDIN, b"foo\n")),
            (
                Protocol::V4,
                binary(b"\x04{\"Width\":80,\"Height\":24}"),
                data(RESIZE, br#"{"Width":80,"Height":24}"#),
            ),
            (Protocol::V1, binary(b""), Ok(FromClient::Nothing)),
            (Protocol::V1, Message::text("\u{0}x"), data(STDIN, b"x")),
            (
                Protocol::V1Base64,
                Message::text("0Zm9vCg=="),
                data(STDIN, b"foo\n"),
            ),
            (Protocol::V4Base64, binary(b"4e30="), data(RESIZE, b"{}")),
            (
                Protocol::V4Base64,
                Message::text("0!!"),
                Err(DecodeError::Base64 { channel: 0 }),
            ),
            (
                Protocol::V4Base64,
                Message::text("x"),
                Err(DecodeError::Channel('x')),
            ),
            // v5's close signal; before v5, channel 255 is data like any other.
            (
                Protocol::V5,
                binary(b"\xff\x00"),
                Ok(FromClient::CloseStream(STDIN)),
            ),
            (Protocol::V5, binary(b"\xff"), Err(DecodeError::EmptyClose)),
            (Protocol::V4, binary(b"\xff\x00"), data(CLOSE, b"\x00")),
            (Protocol::V5, binary(b"\x00abc"), data(STDIN, b"abc")),
            (Protocol::V5, Message::Close(None), Ok(FromClient::Closed)),
            (
                Protocol::V1Base64,
                Message::Close(None),
                Ok(FromClient::Closed),
            ),
            (
                Protocol::V4,
                Message::Ping(Bytes::new()),
                Ok(FromClient::Nothing),
            ),
        ];
        for (protocol, message, want) in cases {
            let shown = format!("{protocol:?} {message:?}");
            assert_eq!(decode(protocol, message), want, "{shown}");
        }
    }

    #[test]
    fn verdict_per_protocol() {
        let success = Status {
            status: Some("Success".into()),
            ..Status::default()
        };
        let exit = Status {
            status: Some("Failure".into()),
            message: Some("command terminated with non-zero exit code".into()),
            reason: Some("NonZeroExitCode".into()),
            ..Status::default()
        };
        assert_eq!(status_payload(Protocol::V1, &success), None);
        assert_eq!(status_payload(Protocol::V1Base64, &success), None);
        assert_eq!(
            status_payload(Protocol::V1, &exit).unwrap(),
            b"command terminated with non-zero exit code"
        );
        for protocol in [Protocol::V4, Protocol::V4Base64, Protocol::V5] {
            let json: serde_json::Value =
                serde_json::from_slice(&status_payload(protocol, &success).unwrap()).unwrap();
            assert_eq!(json["status"], "Success", "{protocol:?}");
            let json: serde_json::Value =
                serde_json::from_slice(&status_payload(protocol, &exit).unwrap()).unwrap();
            assert_eq!(json["reason"], "NonZeroExitCode", "{protocol:?}");
        }
    }

    /// The ports of a WebSocket port-forward, as a kubelet reads them: every `port` (and
    /// `ports`) parameter, comma-separated lists too; none, an empty one, 0 or a word is
    /// refused.
    #[test]
    fn forwarded_ports_are_read_as_a_kubelet_reads_them() {
        type Case<'a> = (Option<&'a str>, Result<Vec<u16>, &'a str>);
        let cases: [Case; 8] = [
            (Some("port=8080"), Ok(vec![8080])),
            (Some("port=8080&port=9090"), Ok(vec![8080, 9090])),
            (Some("ports=80,81"), Ok(vec![80, 81])),
            (Some("port=80&other=1"), Ok(vec![80])),
            (None, Err("query parameter \"port\" is required")),
            (
                Some("port="),
                Err("query parameter \"port\" cannot be empty"),
            ),
            (Some("port=0"), Err("port \"0\" must be > 0")),
            (Some("port=http"), Err("unable to parse \"http\" as a port")),
        ];
        for (query, want) in cases {
            assert_eq!(
                forwarded_ports(query),
                want.map_err(str::to_owned),
                "{query:?}"
            );
        }
    }

    /// Port-forward serves the kubelet's WebSocket subprotocols (binary by default), not
    /// the exec ones; each port has a data and an error channel.
    #[test]
    fn port_forward_speaks_the_kubelets_subprotocols() {
        let chosen = |offered: &[&str]| {
            handshake(&headers(offered), PORT_FORWARD_PROTOCOLS)
                .map(|h| (h.protocol, h.protocol_name))
                .map_err(|(status, _)| status)
        };
        assert_eq!(chosen(&[]), Ok((Protocol::V4, None)));
        assert_eq!(
            chosen(&["v4.channel.k8s.io"]),
            Ok((Protocol::V4, Some("v4.channel.k8s.io")))
        );
        assert_eq!(
            chosen(&["v4.base64.channel.k8s.io"]),
            Ok((Protocol::V4Base64, Some("v4.base64.channel.k8s.io")))
        );
        assert_eq!(chosen(&["v5.channel.k8s.io"]), Err(StatusCode::FORBIDDEN));
        assert_eq!(port_channels(0), Some((0, 1)));
        assert_eq!(port_channels(3), Some((6, 7)));
        assert_eq!(port_channels(127), Some((254, 255)));
        assert_eq!(port_channels(128), None);
    }
}
