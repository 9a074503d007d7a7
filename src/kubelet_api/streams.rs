//! exec, attach and port-forward: the streams kube-apiserver opens on an SPDY connection
//! (remotecommand v4, portforward.k8s.io) joined to the same call on the lower pod over
//! WebSocket: exec and attach through kube's client, port-forward through
//! [`lower_port_forward`], one WebSocket for each forwarded connection. exec and attach
//! over a WebSocket ([`super::websocket`]) feed the same lower call ([`call_lower`]).

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{FutureExt, SinkExt, StreamExt};
use http::HeaderValue;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Status;
use kube::api::{Api, AttachParams, AttachedProcess, TerminalSize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tracing::{debug, info, warn};

use super::route::StreamFlags;
use super::spdy::{Connection, Stream, StreamReader, StreamWriter};

/// How long the client has to open the streams it asked for (the kubelet's default).
const STREAM_CREATION_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes buffered per stdin, stdout and stderr toward the lower call.
const STREAM_BUFFER: usize = 64 * 1024;
/// How long a port-forward connection carries the other direction once one has ended.
const PORT_FORWARD_LINGER: Duration = Duration::from_secs(1);
/// How long an error stream waits for its data stream (the kubelet's pairing timeout).
const PORT_FORWARD_PAIRING: Duration = STREAM_CREATION_TIMEOUT;

/// The streams of one exec or attach.
#[derive(Debug, Default)]
struct ExecStreams {
    error: Option<StreamWriter>,
    stdin: Option<StreamReader>,
    stdout: Option<StreamWriter>,
    stderr: Option<StreamWriter>,
    resize: Option<StreamReader>,
    /// The sending halves of the client's input streams (stdin, resize), kept open until the
    /// call ends: the client reads its stdin stream and, at our FIN, stops sending input.
    held: Vec<StreamWriter>,
}

impl ExecStreams {
    fn complete(&self, flags: StreamFlags) -> bool {
        self.error.is_some()
            && (!flags.stdin || self.stdin.is_some())
            && (!flags.stdout || self.stdout.is_some())
            && (!flags.stderr || flags.tty || self.stderr.is_some())
            && (!flags.tty || self.resize.is_some())
    }

    fn add(&mut self, stream: Stream) {
        let kind = stream.header("streamtype").unwrap_or_default().to_owned();
        debug!(streamtype = %kind, id = stream.id(), "stream opened");
        let (reader, writer) = stream.split();
        match kind.as_str() {
            "error" => self.error = Some(writer),
            "stdin" => {
                self.stdin = Some(reader);
                self.held.push(writer);
            }
            "stdout" => self.stdout = Some(writer),
            "stderr" => self.stderr = Some(writer),
            "resize" => {
                self.resize = Some(reader);
                self.held.push(writer);
            }
            other => debug!(streamtype = other, "unknown stream type ignored"),
        }
    }
}

/// The v4 error stream's verdict for a failure that is not the command's own.
pub fn failure(message: &str) -> Status {
    Status {
        status: Some("Failure".into()),
        message: Some(message.to_owned()),
        reason: Some("InternalError".into()),
        code: Some(500),
        ..Status::default()
    }
}

/// Serves one exec (`command` given) or attach on `conn`, against the lower pod.
pub async fn exec(
    mut conn: Connection,
    pods: Api<Pod>,
    pod: String,
    container: String,
    command: Option<Vec<String>>,
    flags: StreamFlags,
) {
    let mut streams = ExecStreams::default();
    let gathered = tokio::time::timeout(STREAM_CREATION_TIMEOUT, async {
        while !streams.complete(flags) {
            match conn.accept().await {
                Some(stream) => streams.add(stream),
                None => return false,
            }
        }
        true
    })
    .await;
    if gathered != Ok(true) {
        warn!(object = %pod, kind = "Pod", cluster = "lower", "exec/attach: the client did not open its streams");
        conn.close().await;
        return;
    }
    debug!(object = %pod, kind = "Pod", cluster = "lower", ?flags, "streams gathered; calling the lower pod");
    let ends = ClientEnds {
        stdin: streams.stdin.take(),
        stdout: streams.stdout.take(),
        stderr: streams.stderr.take(),
        resize: streams.resize.take(),
    };
    // The client may go away without a word (killed, network gone) while the command
    // prints nothing: the end of the connection ends the lower call too.
    let closed = async { while conn.accept().await.is_some() {} };
    let Some(status) = call_lower(&pods, &pod, container, command, flags, ends, closed).await
    else {
        return;
    };
    if let Some(mut error) = streams.error.take() {
        // v4: Success is written too; the client reads it as a clean exit.
        if let Ok(json) = serde_json::to_vec(&status) {
            let _ = error.write_all(&json).await;
        }
        let _ = error.shutdown().await;
    }
    // The FINs of every stream go out before GOAWAY.
    drop(streams);
    conn.close().await;
}

/// The client's ends of one exec or attach, whatever carries them (SPDY streams, or the
/// channels of a WebSocket): what the command reads, and where its output goes.
#[derive(Debug)]
pub struct ClientEnds<I, O> {
    /// Standard input, when asked for.
    pub stdin: Option<I>,
    /// Standard output, when asked for.
    pub stdout: Option<O>,
    /// Standard error, when asked for (never with a TTY).
    pub stderr: Option<O>,
    /// Terminal sizes (JSON `{"Width":…,"Height":…}` one after the other), with a TTY.
    pub resize: Option<I>,
}

/// Starts `command` (or an attach, without one) in `container` of the lower pod and joins
/// `ends` to it until it ends: the status for the client's error stream, or `None` when
/// `gone` (the client went away) came first, which ends the lower call.
pub async fn call_lower<I, O>(
    pods: &Api<Pod>,
    pod: &str,
    container: String,
    command: Option<Vec<String>>,
    flags: StreamFlags,
    ends: ClientEnds<I, O>,
    gone: impl Future<Output = ()>,
) -> Option<Status>
where
    I: AsyncRead + Unpin + Send + 'static,
    O: AsyncWrite + Unpin,
{
    let params = AttachParams {
        container: Some(container),
        stdin: flags.stdin,
        stdout: flags.stdout,
        stderr: flags.stderr && !flags.tty,
        tty: flags.tty,
        // kube's default is 1 KiB, a DATA frame per KiB: slow for `kubectl cp`.
        max_stdin_buf_size: Some(STREAM_BUFFER),
        max_stdout_buf_size: Some(STREAM_BUFFER),
        max_stderr_buf_size: Some(STREAM_BUFFER),
    };
    let started = match command {
        Some(command) => pods.exec(pod, command, &params).await,
        None => pods.attach(pod, &params).await,
    };
    let status = match started {
        Ok(process) => {
            tokio::select! {
                status = run_process(process, ends) => status,
                () = gone => {
                    debug!(object = %pod, kind = "Pod", cluster = "lower", "exec/attach: the client went away; ending the lower call");
                    return None;
                }
            }
        }
        Err(kube::Error::Api(status)) => Status {
            status: Some("Failure".into()),
            message: Some(status.message.clone()),
            reason: Some(status.reason.clone()),
            code: Some(i32::from(status.code)),
            ..Status::default()
        },
        Err(error) => failure(&format!("lower cluster: {error}")),
    };
    Some(status)
}

/// Joins the client's ends to the lower process until it ends; its status.
async fn run_process<I, O>(mut process: AttachedProcess, ends: ClientEnds<I, O>) -> Status
where
    I: AsyncRead + Unpin + Send + 'static,
    O: AsyncWrite + Unpin,
{
    let status = process.take_status();
    let input = match (ends.stdin, process.stdin()) {
        (Some(from), Some(to)) => Some(tokio::spawn(pump(from, to, "stdin"))),
        _ => None,
    };
    let resize = match (ends.resize, process.terminal_size()) {
        (Some(from), Some(to)) => Some(tokio::spawn(forward_resizes(from, to))),
        _ => None,
    };
    let stdout = copy_out(process.stdout(), ends.stdout);
    let stderr = copy_out(process.stderr(), ends.stderr);
    tokio::join!(stdout, stderr);
    // Output is done (or was never asked for): the status ends the call, so a command fed
    // only stdin keeps it until it exits.
    let status = match status {
        Some(status) => status.await,
        None => None,
    };
    for task in [input, resize].into_iter().flatten() {
        task.abort();
    }
    let joined = process.join().await;
    match (status, joined) {
        (Some(status), _) => status,
        // The lower side sends a status for every end, Success included; none means the
        // connection broke, and the client must not read that as exit code 0.
        (None, Err(error)) => failure(&format!(
            "lower cluster: the exec connection ended without the command's status: {error}"
        )),
        (None, Ok(())) => {
            failure("lower cluster: the exec connection ended without the command's status")
        }
    }
}

async fn copy_out(from: Option<impl AsyncRead + Unpin>, to: Option<impl AsyncWrite + Unpin>) {
    if let (Some(from), Some(to)) = (from, to) {
        pump(from, to, "output").await;
    }
}

/// Copies until the end of `from`, writing each chunk through at once (a TTY's echo is a
/// byte at a time and must not wait for more), then closes `to`.
async fn pump(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    what: &'static str,
) {
    let mut buffer = vec![0u8; 32 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) => break,
            Ok(n) => n,
            Err(error) => {
                debug!(%error, what, "stream read ended");
                break;
            }
        };
        debug!(what, bytes = n, "forwarding");
        if to.write_all(&buffer[..n]).await.is_err() || to.flush().await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

/// The resize stream is a sequence of JSON objects `{"Width":…,"Height":…}`.
async fn forward_resizes(
    mut from: impl AsyncRead + Unpin,
    mut to: futures::channel::mpsc::Sender<TerminalSize>,
) {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 512];
    loop {
        let n = match from.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        buffer.extend_from_slice(&chunk[..n]);
        let (sizes, used) = parse_resizes(&buffer);
        debug!(?sizes, "resize");
        buffer.drain(..used);
        for size in sizes {
            if to.send(size).await.is_err() {
                return;
            }
        }
        if buffer.len() > 64 * 1024 {
            return;
        }
    }
}

/// The complete resize messages at the start of `bytes`, and how many bytes they took.
pub fn parse_resizes(bytes: &[u8]) -> (Vec<TerminalSize>, usize) {
    #[derive(serde::Deserialize)]
    struct Size {
        #[serde(rename = "Width")]
        width: u16,
        #[serde(rename = "Height")]
        height: u16,
    }
    let mut sizes = Vec::new();
    let mut stream = serde_json::Deserializer::from_slice(bytes).into_iter::<Size>();
    let mut used = 0;
    while let Some(Ok(size)) = stream.next() {
        used = stream.byte_offset();
        sizes.push(TerminalSize {
            width: size.width,
            height: size.height,
        });
    }
    (sizes, used)
}

/// Serves port-forward on `conn`: over one SPDY connection to the lower kubelet, upgraded
/// or tunnelled through the lower API server ([`super::tunnel`]), or, where the lower API
/// server takes neither, a WebSocket per forwarded connection
/// ([`port_forward_per_connection`]).
pub async fn port_forward(conn: Connection, pods: Api<Pod>, pod: String) {
    let opened = tokio::select! {
        opened = super::tunnel::open(&pods, &pod) => opened,
        () = conn.ended() => {
            debug!(object = %pod, kind = "Pod", cluster = "lower", "port-forward: the client went away before the lower kubelet was reached");
            return;
        }
    };
    match opened {
        Ok((lower, by)) => {
            info!(object = %pod, kind = "Pod", cluster = "lower", %by, "port-forward: SPDY to the lower kubelet");
            super::tunnel::relay(conn, lower).await;
        }
        Err(error) => {
            info!(object = %pod, kind = "Pod", cluster = "lower", %error, "port-forward: no tunnel; a WebSocket per forwarded connection");
            port_forward_per_connection(conn, pods, pod).await;
        }
    }
}

/// Serves port-forward on `conn`: each request (an `error` and a `data` stream with the
/// same `requestid`) becomes one WebSocket connection to that port of the lower pod.
pub async fn port_forward_per_connection(mut conn: Connection, pods: Api<Pod>, pod: String) {
    let mut errors: std::collections::HashMap<String, (StreamWriter, Instant)> = Default::default();
    let mut tasks = tokio::task::JoinSet::new();
    while let Some(stream) = conn.accept().await {
        let request = stream.header("requestid").unwrap_or_default().to_owned();
        let port = stream.header("port").and_then(|p| p.parse::<u16>().ok());
        // An error stream whose data stream never came is given up (and closed).
        errors.retain(|_, (_, opened)| opened.elapsed() < PORT_FORWARD_PAIRING);
        match stream.header("streamtype") {
            Some("error") => {
                let (_, writer) = stream.split();
                errors.insert(request, (writer, Instant::now()));
            }
            Some("data") => {
                let error = errors.remove(&request).map(|(writer, _)| writer);
                let (pods, pod) = (pods.clone(), pod.clone());
                tasks.spawn(forward_one(stream, error, port, pods, pod));
            }
            other => debug!(streamtype = ?other, "port-forward: unknown stream ignored"),
        }
        // Reap finished forwards so a long session does not keep them.
        while tasks.try_join_next().is_some() {}
    }
    tasks.abort_all();
}

async fn forward_one(
    data: Stream,
    error: Option<StreamWriter>,
    port: Option<u16>,
    pods: Api<Pod>,
    pod: String,
) {
    let (from_client, mut to_client) = data.split();
    let result = async {
        let port = port.ok_or("port-forward: missing or invalid port header")?;
        forward_port(&pods, &pod, port, from_client, &mut to_client).await
    }
    .await;
    let _ = to_client.shutdown().await;
    if let Some(mut error) = error {
        if let Err(message) = result {
            debug!(object = %pod, kind = "Pod", cluster = "lower", %message, "port-forward ended in error");
            let _ = error.write_all(message.as_bytes()).await;
        }
        let _ = error.shutdown().await;
    }
}

/// The lower API server's WebSocket port-forward to one port of a pod.
type LowerPortForward = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

/// The WebSocket subprotocol of port-forward: binary frames, each led by its channel byte.
const PORT_FORWARD_PROTOCOL: &str = "v4.channel.k8s.io";
/// The channels of one port: its data, and its error (a message, then the end).
const DATA_CHANNEL: u8 = 0;
const ERROR_CHANNEL: u8 = 1;
/// Largest message sent toward the pod: what the client has sent meanwhile, gathered, so
/// that each message (and each flush of the connection) carries as much as is there.
const TO_POD_MESSAGE: usize = 64 * 1024;

/// Opens the port-forward WebSocket to `port` of `pod` through the lower API server, as
/// kube's `Api::portforward` does but with buffers sized for one port's traffic.
async fn lower_port_forward(
    pods: &Api<Pod>,
    pod: &str,
    port: u16,
) -> Result<LowerPortForward, String> {
    use http::header::{
        CONNECTION, SEC_WEBSOCKET_ACCEPT, SEC_WEBSOCKET_KEY, SEC_WEBSOCKET_PROTOCOL,
        SEC_WEBSOCKET_VERSION, UPGRADE,
    };
    use tokio_tungstenite::tungstenite::handshake;
    let request = kube::core::Request::new(pods.resource_url())
        .portforward(pod, &[port])
        .map_err(|e| e.to_string())?;
    let (mut parts, body) = request.into_parts();
    let key = handshake::client::generate_key();
    let headers = &mut parts.headers;
    headers.insert(CONNECTION, HeaderValue::from_static("Upgrade"));
    headers.insert(UPGRADE, HeaderValue::from_static("websocket"));
    headers.insert(SEC_WEBSOCKET_VERSION, HeaderValue::from_static("13"));
    headers.insert(
        SEC_WEBSOCKET_PROTOCOL,
        HeaderValue::from_static(PORT_FORWARD_PROTOCOL),
    );
    headers.insert(
        SEC_WEBSOCKET_KEY,
        HeaderValue::from_str(&key).map_err(|e| e.to_string())?,
    );
    let client = pods.clone().into_client();
    let response = client
        .send(http::Request::from_parts(
            parts,
            kube::client::Body::from(body),
        ))
        .await
        .map_err(|e| e.to_string())?;
    if response.status() != http::StatusCode::SWITCHING_PROTOCOLS {
        // The API server's answer is a Status; its message is what the user needs.
        return Err(super::tunnel::Refusal::of(response).await.to_string());
    }
    let accept = handshake::derive_accept_key(key.as_bytes());
    if response
        .headers()
        .get(SEC_WEBSOCKET_ACCEPT)
        .map(HeaderValue::as_bytes)
        != Some(accept.as_bytes())
    {
        return Err("the WebSocket upgrade was not accepted (Sec-WebSocket-Accept)".into());
    }
    let upgraded = hyper::upgrade::on(response)
        .await
        .map_err(|e| e.to_string())?;
    // The default reads into 128 KiB allocated up front, per forwarded connection.
    let config = WebSocketConfig::default().read_buffer_size(32 * 1024);
    Ok(WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Client, Some(config)).await)
}

/// Carries one forwarded connection, `from_client` and `to_client`, to `port` of the lower
/// pod `pod` and back ([`relay`]), opened through the lower API server within
/// [`super::tunnel::OPEN_TIMEOUT`]; the error to give the client, if any.
pub async fn forward_port(
    pods: &Api<Pod>,
    pod: &str,
    port: u16,
    from_client: impl AsyncRead + Unpin,
    to_client: &mut (impl AsyncWrite + Unpin),
) -> Result<(), String> {
    let timeout = super::tunnel::OPEN_TIMEOUT;
    let lower = tokio::time::timeout(timeout, lower_port_forward(pods, pod, port))
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {timeout:?}")))
        .map_err(|e| format!("lower cluster: port-forward to {pod}:{port}: {e}"))?;
    relay(lower, from_client, to_client).await
}

/// Carries one forwarded connection both ways until the pod side ends it (or, once the
/// client has finished sending, a moment longer); the lower error, if one came.
async fn relay(
    lower: LowerPortForward,
    mut from_client: impl AsyncRead + Unpin,
    to_client: &mut (impl AsyncWrite + Unpin),
) -> Result<(), String> {
    let (mut to_pod, mut from_pod) = lower.split();
    let send = async {
        let mut buffer = vec![0; 1 + TO_POD_MESSAGE];
        buffer[0] = DATA_CHANNEL;
        loop {
            let mut filled = match from_client.read(&mut buffer[1..]).await {
                Ok(0) | Err(_) => return,
                Ok(n) => 1 + n,
            };
            // What has already come joins the same message.
            while filled < buffer.len() {
                match from_client.read(&mut buffer[filled..]).now_or_never() {
                    Some(Ok(n)) if n > 0 => filled += n,
                    _ => break,
                }
            }
            let message = Message::Binary(Bytes::copy_from_slice(&buffer[..filled]));
            if to_pod.send(message).await.is_err() {
                return;
            }
        }
    };
    let receive = async {
        let mut seen = [false; 2];
        let mut lower_error = None;
        while let Some(Ok(message)) = from_pod.next().await {
            let Message::Binary(mut bytes) = message else {
                if message.is_close() {
                    break;
                }
                continue;
            };
            if bytes.is_empty() {
                continue;
            }
            let channel = bytes.split_to(1)[0];
            match channel {
                // Each channel opens with the port number (2 bytes), before any data.
                DATA_CHANNEL | ERROR_CHANNEL if !seen[usize::from(channel)] => {
                    seen[usize::from(channel)] = true;
                }
                DATA_CHANNEL => {
                    if to_client.write_all(&bytes).await.is_err() {
                        break;
                    }
                }
                ERROR_CHANNEL => {
                    lower_error = Some(String::from_utf8_lossy(&bytes).into_owned());
                }
                other => debug!(
                    channel = other,
                    "port-forward: message on an unknown channel ignored"
                ),
            }
        }
        lower_error
    };
    tokio::pin!(send, receive);
    // The client's FIN cannot be passed down (the WebSocket protocol has no half-close, and
    // closing would drop the answer still on its way): once the client is done, the pod side
    // gets a moment to finish, as containerd gives it.
    let lower_error = tokio::select! {
        lower_error = &mut receive => lower_error,
        () = &mut send => tokio::time::timeout(PORT_FORWARD_LINGER, &mut receive)
            .await
            .ok()
            .flatten(),
    };
    match lower_error {
        Some(message) => Err(format!("lower cluster: {message}")),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes read, the sizes parsed from them, and how many bytes those used.
    type ResizeCase = (&'static [u8], Vec<(u16, u16)>, usize);

    #[test]
    fn resize_messages() {
        let cases: Vec<ResizeCase> = vec![
            (b"", vec![], 0),
            (br#"{"Width":80,"Height":24}"#, vec![(80, 24)], 24),
            (
                br#"{"Width":80,"Height":24}{"Width":100,"Height":30}"#,
                vec![(80, 24), (100, 30)],
                49,
            ),
            (br#"{"Width":80,"Height":24}{"Wid"#, vec![(80, 24)], 24),
            (br#"{"Width":80"#, vec![], 0),
        ];
        for (bytes, want, used) in cases {
            let (sizes, n) = parse_resizes(bytes);
            let got: Vec<(u16, u16)> = sizes.iter().map(|s| (s.width, s.height)).collect();
            assert_eq!((got, n), (want, used), "{}", String::from_utf8_lossy(bytes));
        }
    }

    #[test]
    fn streams_complete_per_flags() {
        let flags = StreamFlags {
            stdin: false,
            stdout: true,
            stderr: true,
            tty: true,
        };
        assert!(!ExecStreams::default().complete(flags));
        assert!(!ExecStreams::default().complete(StreamFlags::default()));
    }
}
