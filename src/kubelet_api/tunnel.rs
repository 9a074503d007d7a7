//! port-forward over one SPDY connection to the lower kubelet, through the lower API
//! server: by an HTTP upgrade to `SPDY/3.1` (the API server then passes the bytes on as they
//! are, the least work for it and for virtual-node), or, where that is refused (a proxy in
//! front that takes only WebSockets), tunnelled in a WebSocket (subprotocol
//! `SPDY/3.1+portforward.k8s.io`, the API server's `PortForwardWebsockets`, on by default
//! since Kubernetes 1.31). Either way the kubelet handles the stream the direct path gives
//! it, instead of the WebSocket channel protocol (which costs it twice the CPU).
//!
//! Each stream kubectl opens upstairs (an `error` and a `data` stream per forwarded
//! connection) is opened below with the same headers and joined to it both ways, FIN for
//! FIN and reset for reset: virtual-node keeps its own limits on the upper connection
//! ([`super::spdy`]) and the kubelet sees what kubectl would have sent it. Where the lower
//! API server takes neither upgrade, [`super::streams::port_forward`] serves the connection
//! as before (a WebSocket per forwarded connection).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::{Sink, Stream as _};
use http::{HeaderValue, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{self, Message};
use tracing::{Instrument, debug, debug_span};

use super::spdy::{
    Connection, PORT_FORWARD_PROTOCOL, PROTOCOL_HEADER, PendingStream, Stream, StreamReader,
    StreamWriter, UPGRADE_TOKEN,
};

/// The WebSocket subprotocol of tunnelled port-forward: SPDY/3.1 carrying
/// `portforward.k8s.io`, in binary messages.
pub const TUNNEL_PROTOCOL: &str = "SPDY/3.1+portforward.k8s.io";
/// How long the lower kubelet has to answer a stream (the kubelet's own creation timeout).
const STREAM_REPLY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the lower API server has to answer one way of opening a port-forward (kube's
/// client sets no read timeout: a proxy that takes the request and never answers would
/// hold the upper connection for good).
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(30);
/// The most of a refusal's body that is read for its message.
const REFUSAL_BODY_LIMIT: usize = 64 * 1024;
/// Largest WebSocket message sent toward the lower API server.
const TUNNEL_MESSAGE: usize = 64 * 1024;

/// Why the SPDY connection to the lower kubelet could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum TunnelError {
    /// The request could not be built or sent, or was not answered in time.
    #[error("lower cluster: port-forward to {pod} {by}: {source}")]
    Request {
        /// The lower pod.
        pod: String,
        /// The upgrade asked for.
        by: Upgrade,
        /// Why.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The answer was not an upgrade (the lower API server, or a proxy in front of it,
    /// does not take this one, or refused the caller or the pod).
    #[error("lower cluster: port-forward to {pod} {by} refused: {}", .refusal)]
    Refused {
        /// The lower pod.
        pod: String,
        /// The upgrade asked for.
        by: Upgrade,
        /// The answer.
        refusal: Refusal,
    },
    /// It upgraded, but not to what was asked.
    #[error("lower cluster: port-forward to {pod} {by}: the answer upgraded to {protocol:?}")]
    Protocol {
        /// The lower pod.
        pod: String,
        /// The upgrade asked for.
        by: Upgrade,
        /// The protocol it chose.
        protocol: Option<String>,
    },
}

impl TunnelError {
    /// Whether asking again another way would be answered the same ([`Refusal::is_final`]).
    pub fn is_final(&self) -> bool {
        matches!(self, TunnelError::Refused { refusal, .. } if refusal.is_final())
    }
}

/// An answer that was not an upgrade.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// Its status.
    pub status: StatusCode,
    /// Its message: the API server's `Status` message, else the body as text.
    pub message: String,
    /// Whether the body was the API server's own `Status` (not a proxy's page).
    pub from_api_server: bool,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status, self.message)
    }
}

impl Refusal {
    /// Reads the answer `status` with `body` (what of it was read): pure.
    pub fn read(status: StatusCode, body: &[u8]) -> Self {
        #[derive(serde::Deserialize)]
        struct ApiStatus {
            kind: Option<String>,
            message: Option<String>,
        }
        let api = serde_json::from_slice::<ApiStatus>(body)
            .ok()
            .filter(|s| s.kind.as_deref() == Some("Status"));
        let from_api_server = api.is_some();
        let message = api
            .and_then(|s| s.message)
            .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_owned());
        Self {
            status,
            message,
            from_api_server,
        }
    }

    /// Reads `response`'s body (at most [`REFUSAL_BODY_LIMIT`] of it; the caller bounds the
    /// time, [`OPEN_TIMEOUT`]).
    pub async fn of(response: http::Response<kube::client::Body>) -> Self {
        let status = response.status();
        let body = http_body_util::Limited::new(response.into_body(), REFUSAL_BODY_LIMIT);
        let body = http_body_util::BodyExt::collect(body)
            .await
            .ok()
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        Self::read(status, &body)
    }

    /// Whether asking again another way would be answered the same: the API server
    /// itself said the caller may not, or the pod is not there. A proxy's refusal of an
    /// upgrade it does not pass on (Envoy answers 403 `upgrade_failed` to SPDY while it
    /// passes WebSockets) is not final.
    pub fn is_final(&self) -> bool {
        self.from_api_server
            && [
                StatusCode::UNAUTHORIZED,
                StatusCode::FORBIDDEN,
                StatusCode::NOT_FOUND,
            ]
            .contains(&self.status)
    }
}

/// Whether a 101 answer chose the tunnel (and accepted our key): pure.
pub fn accepts_tunnel(headers: &http::HeaderMap, key: &str) -> Result<(), Option<String>> {
    use http::header::{SEC_WEBSOCKET_ACCEPT, SEC_WEBSOCKET_PROTOCOL};
    let protocol = headers
        .get(SEC_WEBSOCKET_PROTOCOL)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.trim().to_owned());
    let accept = tungstenite::handshake::derive_accept_key(key.as_bytes());
    let accepted =
        headers.get(SEC_WEBSOCKET_ACCEPT).map(HeaderValue::as_bytes) == Some(accept.as_bytes());
    if accepted && protocol.as_deref() == Some(TUNNEL_PROTOCOL) {
        Ok(())
    } else {
        Err(protocol)
    }
}

/// How the SPDY connection to the lower kubelet reaches it through the lower API server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upgrade {
    /// An HTTP upgrade to `SPDY/3.1`: the API server passes the bytes as they are, both
    /// ways (what kubectl did before 1.31, and still does where WebSockets are refused).
    Spdy,
    /// A WebSocket carrying the SPDY bytes in binary messages ([`TUNNEL_PROTOCOL`]): for an
    /// API server, or a proxy in front of it, that does not take the SPDY upgrade.
    WebSocket,
}

impl std::fmt::Display for Upgrade {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Upgrade::Spdy => "upgraded to SPDY",
            Upgrade::WebSocket => "tunnelled in a WebSocket",
        })
    }
}

/// Whether a 101 answer to a SPDY upgrade is one (and carries port-forward, where it says):
/// pure. Else what it upgraded to: the `Upgrade` header, and the protocol header where
/// that is what is wrong.
pub fn accepts_spdy(headers: &http::HeaderMap) -> Result<(), Option<String>> {
    use http::header::UPGRADE;
    let upgrade = headers.get(UPGRADE).and_then(|v| v.to_str().ok());
    if !upgrade.is_some_and(|u| u.trim().eq_ignore_ascii_case(UPGRADE_TOKEN)) {
        return Err(upgrade.map(str::to_owned));
    }
    // A kubelet that negotiated nothing (no protocol header) speaks the first version.
    let Some(protocol) = headers.get(PROTOCOL_HEADER) else {
        return Ok(());
    };
    match protocol.to_str().map(str::trim) {
        Ok(PORT_FORWARD_PROTOCOL) => Ok(()),
        Ok(other) => Err(Some(format!(
            "{UPGRADE_TOKEN} with {PROTOCOL_HEADER} {other}"
        ))),
        Err(_) => Err(Some(format!(
            "{UPGRADE_TOKEN} with an unreadable {PROTOCOL_HEADER}"
        ))),
    }
}

/// Opens the SPDY connection to the kubelet of `pod` through the lower API server: by a
/// SPDY upgrade (the API server then only passes bytes on: the least work for it and for
/// virtual-node), else tunnelled in a WebSocket. Where neither is taken, the error of the
/// WebSocket's; where the API server refuses the SPDY upgrade as unauthorized, forbidden
/// or not found ([`Refusal::is_final`]), that error, without asking again (the caller's
/// fallback, a WebSocket per forwarded connection, then reports it on each).
pub async fn open(pods: &Api<Pod>, pod: &str) -> Result<(Connection, Upgrade), TunnelError> {
    match open_by(pods, pod, Upgrade::Spdy).await {
        Ok(connection) => Ok((connection, Upgrade::Spdy)),
        Err(error) if error.is_final() => Err(error),
        Err(error) => {
            debug!(object = %pod, kind = "Pod", cluster = "lower", %error, "port-forward: no SPDY upgrade; trying the WebSocket tunnel");
            let connection = open_by(pods, pod, Upgrade::WebSocket).await?;
            Ok((connection, Upgrade::WebSocket))
        }
    }
}

/// Opens the SPDY connection to the kubelet of `pod` through the lower API server, `by`
/// one way, within [`OPEN_TIMEOUT`].
pub async fn open_by(pods: &Api<Pod>, pod: &str, by: Upgrade) -> Result<Connection, TunnelError> {
    tokio::time::timeout(OPEN_TIMEOUT, open_within(pods, pod, by))
        .await
        .unwrap_or_else(|_| {
            Err(TunnelError::Request {
                pod: pod.to_owned(),
                by,
                source: format!("no answer within {OPEN_TIMEOUT:?}").into(),
            })
        })
}

async fn open_within(pods: &Api<Pod>, pod: &str, by: Upgrade) -> Result<Connection, TunnelError> {
    use http::header::{
        CONNECTION, SEC_WEBSOCKET_KEY, SEC_WEBSOCKET_PROTOCOL, SEC_WEBSOCKET_VERSION, UPGRADE,
    };
    let failed = |source: Box<dyn std::error::Error + Send + Sync>| TunnelError::Request {
        pod: pod.to_owned(),
        by,
        source,
    };
    let key = tungstenite::handshake::client::generate_key();
    let request = http::Request::get(format!("{}/{pod}/portforward", pods.resource_url()))
        .header(CONNECTION, "Upgrade");
    let request = match by {
        Upgrade::Spdy => request
            .header(UPGRADE, UPGRADE_TOKEN)
            .header(PROTOCOL_HEADER, PORT_FORWARD_PROTOCOL),
        Upgrade::WebSocket => request
            .header(UPGRADE, "websocket")
            .header(SEC_WEBSOCKET_VERSION, "13")
            .header(SEC_WEBSOCKET_PROTOCOL, TUNNEL_PROTOCOL)
            .header(SEC_WEBSOCKET_KEY, &key),
    };
    let request = request
        .body(kube::client::Body::empty())
        .map_err(|e| failed(e.into()))?;
    let client = pods.clone().into_client();
    let response = client.send(request).await.map_err(|e| failed(e.into()))?;
    if response.status() != StatusCode::SWITCHING_PROTOCOLS {
        return Err(TunnelError::Refused {
            pod: pod.to_owned(),
            by,
            refusal: Refusal::of(response).await,
        });
    }
    let accepted = match by {
        Upgrade::Spdy => accepts_spdy(response.headers()),
        Upgrade::WebSocket => accepts_tunnel(response.headers(), &key),
    };
    if let Err(protocol) = accepted {
        return Err(TunnelError::Protocol {
            pod: pod.to_owned(),
            by,
            protocol,
        });
    }
    let upgraded = hyper::upgrade::on(response)
        .await
        .map_err(|e| failed(e.into()))?;
    let io = TokioIo::new(upgraded);
    Ok(match by {
        Upgrade::Spdy => Connection::client(io),
        Upgrade::WebSocket => {
            let config = WebSocketConfig::default().read_buffer_size(64 * 1024);
            let socket = WebSocketStream::from_raw_socket(io, Role::Client, Some(config)).await;
            Connection::client(TunnelIo::new(socket))
        }
    })
}

/// A WebSocket as a byte stream: what is written goes out in binary messages, what comes
/// in binary messages is read in order (message bounds mean nothing), as client-go's
/// `TunnelingConnection` does.
pub struct TunnelIo<S> {
    socket: WebSocketStream<S>,
    /// The rest of the message being read.
    pending: Bytes,
    /// The peer closed (or the socket failed): reads see the end.
    done: bool,
}

impl<S> std::fmt::Debug for TunnelIo<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunnelIo")
            .field("pending", &self.pending.len())
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl<S> TunnelIo<S> {
    /// Wraps an open WebSocket.
    pub fn new(socket: WebSocketStream<S>) -> Self {
        Self {
            socket,
            pending: Bytes::new(),
            done: false,
        }
    }
}

fn io_error(error: tungstenite::Error) -> io::Error {
    match error {
        tungstenite::Error::Io(error) => error,
        tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed => {
            io::Error::new(io::ErrorKind::BrokenPipe, "the tunnel is closed")
        }
        other => io::Error::other(other),
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for TunnelIo<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        while self.pending.is_empty() {
            if self.done {
                return Poll::Ready(Ok(()));
            }
            match ready!(Pin::new(&mut self.socket).poll_next(cx)) {
                Some(Ok(Message::Binary(data))) => self.pending = data,
                Some(Ok(Message::Close(_))) | None => self.done = true,
                // Pings are answered by the socket itself; text has no meaning here.
                Some(Ok(_)) => {}
                Some(Err(error)) => {
                    self.done = true;
                    return Poll::Ready(Err(io_error(error)));
                }
            }
        }
        let n = self.pending.len().min(buf.remaining());
        buf.put_slice(&self.pending.split_to(n));
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for TunnelIo<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let mut socket = Pin::new(&mut self.socket);
        ready!(socket.as_mut().poll_ready(cx)).map_err(io_error)?;
        let n = buf.len().min(TUNNEL_MESSAGE);
        socket
            .start_send(Message::Binary(Bytes::copy_from_slice(&buf[..n])))
            .map_err(io_error)?;
        Poll::Ready(Ok(n))
    }

    /// What the SPDY writer wrote at once (frame headers and the payloads beside them)
    /// goes out in one message of up to [`TUNNEL_MESSAGE`] bytes, gathered in one copy.
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let total = bufs
            .iter()
            .map(|b| b.len())
            .sum::<usize>()
            .min(TUNNEL_MESSAGE);
        if total == 0 {
            return Poll::Ready(Ok(0));
        }
        let mut socket = Pin::new(&mut self.socket);
        ready!(socket.as_mut().poll_ready(cx)).map_err(io_error)?;
        let mut message = BytesMut::with_capacity(total);
        for buf in bufs {
            let take = buf.len().min(total - message.len());
            message.extend_from_slice(&buf[..take]);
            if message.len() == total {
                break;
            }
        }
        socket
            .start_send(Message::Binary(message.freeze()))
            .map_err(io_error)?;
        Poll::Ready(Ok(total))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.socket).poll_flush(cx).map_err(io_error)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match ready!(Pin::new(&mut self.socket).poll_close(cx)) {
            Ok(())
            | Err(tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed) => {
                Poll::Ready(Ok(()))
            }
            Err(error) => Poll::Ready(Err(io_error(error))),
        }
    }
}

/// Joins every stream the client opens on `upper` to the same stream opened on `lower`,
/// until either connection ends.
pub async fn relay(mut upper: Connection, mut lower: Connection) {
    let mut streams = tokio::task::JoinSet::new();
    loop {
        let stream = tokio::select! {
            stream = upper.accept() => stream,
            () = lower.ended() => {
                debug!("port-forward: the lower connection ended; ending the upper one");
                break;
            }
        };
        let Some(stream) = stream else { break };
        let span = debug_span!(
            "forward",
            stream = stream.id(),
            streamtype = stream.header("streamtype").unwrap_or_default(),
            requestid = stream.header("requestid").unwrap_or_default(),
        );
        // Opened here, in the order the client opened them: SPDY wants ids in order.
        let pending = lower.open(stream.headers().to_vec()).await;
        streams.spawn(join(stream, pending).instrument(span));
        // Reap the finished ones so a long session does not keep them.
        while streams.try_join_next().is_some() {}
    }
    streams.abort_all();
    upper.close().await;
    lower.close().await;
}

/// Joins one upper stream to its lower twin both ways.
async fn join(upper: Stream, pending: Result<PendingStream, super::spdy::OpenError>) {
    let lower = match pending {
        Ok(pending) => tokio::time::timeout(STREAM_REPLY_TIMEOUT, pending.established())
            .await
            .unwrap_or(Err(super::spdy::OpenError::Refused)),
        Err(error) => Err(error),
    };
    let (upper_reader, upper_writer) = upper.split();
    let lower = match lower {
        Ok(lower) => lower,
        Err(error) => {
            debug!(%error, "port-forward: the lower kubelet did not take the stream");
            upper_writer.reset();
            return;
        }
    };
    let (lower_reader, lower_writer) = lower.split();
    tokio::join!(
        pass(upper_reader, lower_writer, "to the pod"),
        pass(lower_reader, upper_writer, "from the pod"),
    );
}

/// Passes one direction of a stream on: data as it comes, then the FIN, or the reset.
async fn pass(mut from: StreamReader, mut to: StreamWriter, direction: &'static str) {
    loop {
        match from.chunk().await {
            Ok(Some(chunk)) => {
                if let Err(error) = to.write_chunk(chunk).await {
                    debug!(%error, direction, "port-forward: stream ended");
                    return;
                }
            }
            Ok(None) => {
                let _ = tokio::io::AsyncWriteExt::shutdown(&mut to).await;
                return;
            }
            Err(error) => {
                debug!(%error, direction, "port-forward: stream aborted");
                to.reset();
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests;
