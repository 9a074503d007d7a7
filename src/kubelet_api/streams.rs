//! exec, attach and port-forward: the streams kube-apiserver opens on an SPDY connection
//! (remotecommand v4, portforward.k8s.io) joined to the same call on the lower pod, which
//! kube's client makes over WebSocket.

use std::time::{Duration, Instant};

use futures::{FutureExt, SinkExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Status;
use kube::api::{Api, AttachParams, AttachedProcess, TerminalSize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tracing::{debug, warn};

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
    let started = match &command {
        Some(command) => pods.exec(&pod, command.clone(), &params).await,
        None => pods.attach(&pod, &params).await,
    };
    let status = match started {
        Ok(process) => {
            // The client may go away without a word (killed, network gone) while the
            // command prints nothing: the end of the connection ends the lower call too.
            let closed = async { while conn.accept().await.is_some() {} };
            tokio::select! {
                status = run_process(process, &mut streams) => status,
                () = closed => {
                    debug!(object = %pod, kind = "Pod", cluster = "lower", "exec/attach: the client went away; ending the lower call");
                    return;
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

/// Joins the client's streams to the lower process until it ends; its status.
async fn run_process(mut process: AttachedProcess, streams: &mut ExecStreams) -> Status {
    let status = process.take_status();
    let input = match (streams.stdin.take(), process.stdin()) {
        (Some(from), Some(to)) => Some(tokio::spawn(pump(from, to, "stdin"))),
        _ => None,
    };
    let resize = match (streams.resize.take(), process.terminal_size()) {
        (Some(from), Some(to)) => Some(tokio::spawn(forward_resizes(from, to))),
        _ => None,
    };
    let stdout = copy_out(process.stdout(), streams.stdout.take());
    let stderr = copy_out(process.stderr(), streams.stderr.take());
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

async fn copy_out(from: Option<impl AsyncRead + Unpin>, to: Option<StreamWriter>) {
    if let (Some(from), Some(to)) = (from, to) {
        pump(from, to, "output").await;
    }
}

/// Copies until the end of `from`, writing each chunk through at once (a TTY's echo is a
/// byte at a time and must not wait for more), then closes `to`.
async fn pump(
    mut from: impl AsyncRead + Unpin,
    mut to: impl tokio::io::AsyncWrite + Unpin,
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
    mut from: StreamReader,
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

/// Serves port-forward on `conn`: each request (an `error` and a `data` stream with the
/// same `requestid`) becomes one connection to that port of the lower pod.
pub async fn port_forward(mut conn: Connection, pods: Api<Pod>, pod: String) {
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
    let (mut from_client, mut to_client) = data.split();
    let result = async {
        let port = port.ok_or("port-forward: missing or invalid port header")?;
        let mut forwarder = pods
            .portforward(&pod, &[port])
            .await
            .map_err(|e| format!("lower cluster: port-forward to {pod}:{port}: {e}"))?;
        let upstream = forwarder
            .take_stream(port)
            .ok_or("lower cluster: no port-forward stream")?;
        let lower_error = forwarder.take_error(port);
        let (mut up_read, mut up_write) = tokio::io::split(upstream);
        let pod_closed = {
            // The client's FIN is not passed down: kube's forwarder would close the whole
            // lower connection and drop the answer still on its way. Once one direction
            // ends, the other gets a moment to finish, as containerd gives it.
            let to_lower = tokio::io::copy(&mut from_client, &mut up_write);
            let to_upper = tokio::io::copy(&mut up_read, &mut to_client);
            tokio::pin!(to_lower, to_upper);
            tokio::select! {
                _ = &mut to_upper => true,
                _ = &mut to_lower => tokio::time::timeout(PORT_FORWARD_LINGER, &mut to_upper)
                    .await
                    .is_ok(),
            }
        };
        let _ = to_client.shutdown().await;
        // The lower error (if any) is final once the pod side has closed; otherwise only
        // one already received counts.
        let message = match lower_error {
            Some(error) if pod_closed => tokio::time::timeout(PORT_FORWARD_LINGER, error)
                .await
                .ok()
                .flatten(),
            Some(error) => error.now_or_never().flatten(),
            None => None,
        };
        drop(forwarder);
        match message {
            Some(message) => Err(format!("lower cluster: {message}")),
            None => Ok(()),
        }
    }
    .await;
    if let Some(mut error) = error {
        if let Err(message) = result {
            let _ = error.write_all(message.as_bytes()).await;
        }
        let _ = error.shutdown().await;
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
