//! A SPDY/3.1 connection, as kube-apiserver speaks it (moby/spdystream via
//! `k8s.io/apimachinery/pkg/util/httpstream/spdy`) for exec, attach and port-forward: the
//! server's end ([`Connection::server`], streams the peer opens), and the client's end
//! ([`Connection::client`], streams this side opens, as kubectl does toward a kubelet).
//!
//! One reader task decodes frames and routes them; one writer task owns the sending half and
//! the header deflater, so frames leave in one order and the zlib stream stays consistent.
//! There is no flow control: the Go peer neither sends nor expects WINDOW_UPDATE.
//!
//! Limits, so that a peer cannot make the process hold more than a few MiB a connection:
//! - received DATA is handed on in pieces of at most [`frame::MAX_DATA_PIECE`] bytes, whatever
//!   length a frame declares (up to 16 MiB);
//! - what the streams of a connection have received and not yet read is budgeted in bytes,
//!   [`RECEIVE_BUDGET`] (each piece also charged [`PIECE_OVERHEAD`] for its bookkeeping).
//!   When it is spent the reader task waits, which stops reading the whole connection (TCP
//!   then pushes back on the peer). A stream nobody reads therefore stalls the others of its
//!   connection, as it does in spdystream itself; without flow control the only other answer
//!   is to drop data;
//! - sent DATA waits for the writer within [`SEND_BUDGET`] bytes, in frames of at most
//!   [`MAX_DATA_FRAME`];
//! - at most [`MAX_STREAMS`] streams are open at once; a SYN_STREAM beyond is answered with
//!   RST_STREAM REFUSED_STREAM. Each keeps at most [`headers::MAX_DECOMPRESSED_HEADERS`] of
//!   headers.

pub mod frame;
pub mod headers;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio_util::sync::{CancellationToken, PollSemaphore};
use tracing::{debug, trace, warn};

use frame::{Frame, FrameDecoder, FrameEncoder, goaway, rst};

/// The `Upgrade` token of an HTTP upgrade to SPDY.
pub const UPGRADE_TOKEN: &str = "SPDY/3.1";
/// The header that offers (in a request) and names (in the 101) the protocol carried on an
/// upgraded SPDY connection.
pub const PROTOCOL_HEADER: &str = "X-Stream-Protocol-Version";
/// That protocol for port-forward (client-go's `PortForwardProtocolV1Name`).
pub const PORT_FORWARD_PROTOCOL: &str = "portforward.k8s.io";

/// Largest DATA frame this server sends; larger writes are split.
pub const MAX_DATA_FRAME: usize = 32 * 1024;
/// Bytes received on a connection's streams and not yet read, before the connection stops
/// reading: Go's HTTP/2 server buffers as much (1 MiB) for a connection's request bodies.
pub const RECEIVE_BUDGET: usize = 1024 * 1024;
/// Bytes of DATA queued for the writer across a connection before stream writers wait.
pub const SEND_BUDGET: usize = 1024 * 1024;
/// What a queued piece of DATA costs beyond its bytes (its handle, its permit, its queue
/// slot), charged to the budgets so that one-byte frames cannot queue unbounded bookkeeping.
pub const PIECE_OVERHEAD: usize = 128;
/// Streams open at once on a connection; more are refused. Go's HTTP/2 server allows 250
/// streams a connection (`x/net/http2` `defaultMaxStreams`), the kubelet's HTTP/2 limit;
/// spdystream sets none. A port-forwarded TCP connection takes two (data and error), an exec
/// up to five.
pub const MAX_STREAMS: usize = 250;
/// Accepted streams queued before the connection stops reading.
const ACCEPT_QUEUE: usize = 16;
/// Control frames (replies, PING echoes, resets) queued for the writer.
const CONTROL_QUEUE: usize = 64;
/// Bytes written to the transport in one go.
const WRITE_BATCH: usize = 256 * 1024;
/// Bytes the reader asks the transport for at once (TLS hands over a record at a time).
const READ_CHUNK: usize = 64 * 1024;
/// How often a client pings its peer, as client-go's SPDY round tripper does (5 s): an
/// idle port-forward then outlives the idle timeouts of proxies and load balancers between
/// virtual-node and the lower API server.
pub const PING_PERIOD: std::time::Duration = std::time::Duration::from_secs(5);

/// How a stream's receiving half ended; read by [`StreamReader`] once its queue is empty.
const OPEN: u8 = 0;
const FIN: u8 = 1;
const RESET: u8 = 2;

/// A frame for the writer task; DATA carries what it took from the send budget.
struct Outgoing {
    frame: Frame,
    _budget: Option<OwnedSemaphorePermit>,
}

/// A piece of received DATA, holding its share of the receive budget until it is read.
struct Piece {
    data: Bytes,
    budget: OwnedSemaphorePermit,
}

/// Orders for the writer task that come from the connection rather than from a stream.
enum Ctrl {
    /// A frame to send ahead of queued DATA (SYN_REPLY, PING echo, refusals).
    Frame(Frame),
    /// Write what is queued, then GOAWAY if given, then close the transport.
    Shutdown {
        goaway: Option<u32>,
        done: Option<oneshot::Sender<()>>,
    },
}

/// What the reader task keeps per open stream.
struct Entry {
    /// `None` once the peer has sent FIN. Unbounded: the receive budget bounds it.
    data: Option<mpsc::UnboundedSender<Piece>>,
    end: Arc<AtomicU8>,
    local_closed: bool,
    /// A stream this side opened: told when the peer's SYN_REPLY comes (dropped, unsent,
    /// when the peer resets the stream or the connection ends first).
    replied: Option<oneshot::Sender<()>>,
}

/// State the reader task shares with the stream writers.
#[derive(Default)]
struct Shared {
    streams: Mutex<HashMap<u32, Entry>>,
    last_stream_id: AtomicU32,
}

impl Shared {
    fn streams(&self) -> MutexGuard<'_, HashMap<u32, Entry>> {
        // A panic while holding the lock cannot leave the map inconsistent; keep going.
        self.streams
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records our FIN (or reset); forgets the stream if the peer has finished too.
    fn local_closed(&self, id: u32, reset: bool) {
        let mut streams = self.streams();
        let forget = match streams.get_mut(&id) {
            Some(entry) if reset => {
                entry.end.store(RESET, Ordering::Release);
                true
            }
            Some(entry) => {
                entry.local_closed = true;
                entry.data.is_none()
            }
            None => false,
        };
        if forget {
            streams.remove(&id);
        }
    }
}

/// A SPDY/3.1 connection over an upgraded HTTP connection (or a tunnel).
pub struct Connection {
    accept: mpsc::Receiver<Stream>,
    ctrl: mpsc::Sender<Ctrl>,
    /// Keeps the writer task alive; it ends when this and every stream half are gone.
    alive: mpsc::UnboundedSender<Outgoing>,
    shared: Arc<Shared>,
    permits: Arc<Semaphore>,
    /// Cancelled once the connection has ended (the writer task is done).
    ended: CancellationToken,
    /// The id of the next stream this side opens (client: odd, from 1).
    next_id: u32,
}

/// Why a stream could not be opened.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OpenError {
    /// The connection has ended (or is ending).
    #[error("the SPDY connection has ended")]
    Ended,
    /// Every stream id has been used.
    #[error("the SPDY connection has no stream ids left")]
    IdsExhausted,
    /// The peer reset the stream (or the connection ended) before it replied.
    #[error("the peer refused the stream")]
    Refused,
}

/// Which end of the connection this side is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Server,
    Client,
}

/// A stream this side asked for: usable once the peer replies ([`PendingStream::established`]).
pub struct PendingStream {
    stream: Stream,
    replied: oneshot::Receiver<()>,
}

impl std::fmt::Debug for PendingStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingStream")
            .field("id", &self.stream.id)
            .finish_non_exhaustive()
    }
}

impl PendingStream {
    /// Waits for the peer's SYN_REPLY; the stream, or why there is none.
    pub async fn established(self) -> Result<Stream, OpenError> {
        match self.replied.await {
            Ok(()) => Ok(self.stream),
            Err(_) => Err(OpenError::Refused),
        }
    }
}

/// Pings the peer every `period` (odd ids: a client's) until the connection ends. The
/// peer's echoes are read and dropped ([`Reader::handle`]).
async fn pings(period: std::time::Duration, ctrl: mpsc::Sender<Ctrl>, stop: CancellationToken) {
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is at once: the connection was just opened.
    ticks.tick().await;
    let mut id: u32 = 1;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        if ctrl.send(Ctrl::Frame(Frame::Ping { id })).await.is_err() {
            return;
        }
        // Odd ids, wrapping within SPDY's 31 bits.
        id = if id >= 0x7fff_fffd { 1 } else { id + 2 };
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection").finish_non_exhaustive()
    }
}

impl Connection {
    /// Starts serving on `io` (after the HTTP 101 upgrade); spawns its reader/writer tasks, which end when the peer goes away, on GOAWAY, or when the Connection and every Stream are dropped.
    pub fn server<IO>(io: IO) -> Connection
    where
        IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        Self::start(io, Role::Server, None)
    }

    /// Starts the client's end on `io`: streams are opened with [`Connection::open`]; any the
    /// peer opens are refused. Its tasks end as a server's do.
    pub fn client<IO>(io: IO) -> Connection
    where
        IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        Self::start(io, Role::Client, Some(PING_PERIOD))
    }

    /// Starts `role`'s end on `io`, pinging the peer every `ping` if given.
    fn start<IO>(io: IO, role: Role, ping: Option<std::time::Duration>) -> Connection
    where
        IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    {
        let (read_half, write_half) = tokio::io::split(io);
        let (accept_tx, accept) = mpsc::channel(ACCEPT_QUEUE);
        let (ctrl, ctrl_rx) = mpsc::channel(CONTROL_QUEUE);
        let (alive, data_rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared::default());
        let permits = Arc::new(Semaphore::new(SEND_BUDGET));
        let stop = CancellationToken::new();
        let reader = Reader {
            ctrl: ctrl.clone(),
            // A client accepts no streams: the peer's are refused.
            accept: (role == Role::Server).then_some(accept_tx),
            role,
            outgoing: alive.downgrade(),
            permits: permits.clone(),
            received: Arc::new(Semaphore::new(RECEIVE_BUDGET)),
            shared: shared.clone(),
            refused: 0,
        };
        tokio::spawn(reader.run(read_half, stop.clone()));
        if let Some(period) = ping {
            tokio::spawn(pings(period, ctrl.clone(), stop.clone()));
        }
        tokio::spawn(write_loop(
            write_half,
            ctrl_rx,
            data_rx,
            permits.clone(),
            shared.clone(),
            stop.clone(),
        ));
        Connection {
            accept,
            ctrl,
            alive,
            shared,
            permits,
            ended: stop,
            next_id: 1,
        }
    }

    /// Opens a stream with these request headers (SYN_STREAM); it is usable once the peer
    /// has replied. Streams are opened one after the other (`&mut self`), so their ids go out
    /// in order, as SPDY requires.
    pub async fn open(
        &mut self,
        headers: Vec<(String, String)>,
    ) -> Result<PendingStream, OpenError> {
        if self.ended.is_cancelled() {
            return Err(OpenError::Ended);
        }
        let id = self.next_id;
        if id > 0x7fff_ffff {
            return Err(OpenError::IdsExhausted);
        }
        self.next_id = id + 2;
        let (data_tx, data_rx) = mpsc::unbounded_channel();
        let end = Arc::new(AtomicU8::new(OPEN));
        let (replied_tx, replied) = oneshot::channel();
        self.shared.streams().insert(
            id,
            Entry {
                data: Some(data_tx),
                end: end.clone(),
                local_closed: false,
                replied: Some(replied_tx),
            },
        );
        let syn = Frame::SynStream {
            stream_id: id,
            associated_to: 0,
            priority: 0,
            flags: 0,
            headers: headers.clone(),
        };
        if self.ctrl.send(Ctrl::Frame(syn)).await.is_err() {
            self.shared.streams().remove(&id);
            return Err(OpenError::Ended);
        }
        let stream = new_stream(
            id,
            headers,
            data_rx,
            end,
            self.alive.clone(),
            &self.permits,
            &self.shared,
        );
        Ok(PendingStream { stream, replied })
    }

    /// Resolves once the connection has ended (the peer went away, GOAWAY, or a failure).
    pub async fn ended(&self) {
        self.ended.cancelled().await;
    }

    /// The next stream the peer opened (SYN_STREAM), already answered with SYN_REPLY. None once the connection has ended.
    pub async fn accept(&mut self) -> Option<Stream> {
        self.accept.recv().await
    }

    /// Sends GOAWAY and closes the connection after queued frames are written.
    pub async fn close(self) {
        let (done, written) = oneshot::channel();
        let order = Ctrl::Shutdown {
            goaway: Some(goaway::OK),
            done: Some(done),
        };
        if self.ctrl.send(order).await.is_ok() {
            // An error only means the writer already ended.
            let _ = written.await;
        }
    }
}

/// One stream the peer opened.
pub struct Stream {
    id: u32,
    headers: Vec<(String, String)>,
    reader: StreamReader,
    writer: StreamWriter,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("id", &self.id)
            .field("headers", &self.headers)
            .finish_non_exhaustive()
    }
}

impl Stream {
    /// The SPDY stream id.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// A request header of the SYN_STREAM (case-insensitive name), e.g. "streamtype", "port", "requestid".
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// All request headers of the SYN_STREAM, names lowercase.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }

    /// Splits into the receiving half (AsyncRead: EOF after the peer's FIN; an io::Error of kind ConnectionReset after RST_STREAM) and the sending half (AsyncWrite; poll_shutdown sends FIN, an empty DATA frame with FLAG_FIN; dropping it without shutdown also sends FIN).
    pub fn split(self) -> (StreamReader, StreamWriter) {
        (self.reader, self.writer)
    }
}

/// The two halves of stream `id`, over the connection's queues and budgets.
fn new_stream(
    id: u32,
    headers: Vec<(String, String)>,
    data: mpsc::UnboundedReceiver<Piece>,
    end: Arc<AtomicU8>,
    outgoing: mpsc::UnboundedSender<Outgoing>,
    permits: &Arc<Semaphore>,
    shared: &Arc<Shared>,
) -> Stream {
    Stream {
        id,
        headers,
        reader: StreamReader {
            id,
            data,
            pending: Bytes::new(),
            pending_budget: None,
            end: end.clone(),
            _alive: outgoing.clone(),
        },
        writer: StreamWriter {
            id,
            outgoing,
            permits: PollSemaphore::new(permits.clone()),
            end,
            shared: shared.clone(),
            closed: false,
        },
    }
}

/// The receiving half of a stream.
pub struct StreamReader {
    id: u32,
    data: mpsc::UnboundedReceiver<Piece>,
    pending: Bytes,
    /// The receive budget `pending` holds, given back once it is read.
    pending_budget: Option<OwnedSemaphorePermit>,
    end: Arc<AtomicU8>,
    _alive: mpsc::UnboundedSender<Outgoing>,
}

impl std::fmt::Debug for StreamReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamReader")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// Data as it was received, holding its share of the receive budget until dropped: relayed
/// on without a copy ([`StreamReader::chunk`], [`StreamWriter::write_chunk`]).
pub struct Chunk {
    data: Bytes,
    _budget: Option<OwnedSemaphorePermit>,
}

impl std::fmt::Debug for Chunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chunk")
            .field("len", &self.data.len())
            .finish_non_exhaustive()
    }
}

impl Chunk {
    /// The bytes.
    pub fn data(&self) -> &Bytes {
        &self.data
    }
}

impl StreamReader {
    /// How the stream ended once its data ran out: `Ok` on the peer's FIN, an error on a
    /// reset or when the connection ended first.
    fn ended(&self) -> io::Result<()> {
        match self.end.load(Ordering::Acquire) {
            FIN => Ok(()),
            RESET => Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "stream reset",
            )),
            _ => Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "SPDY connection ended before the stream finished",
            )),
        }
    }

    /// The next data received, as it came; `None` after the peer's FIN. Errors as
    /// [`AsyncRead`] does (reset, connection ended).
    pub async fn chunk(&mut self) -> io::Result<Option<Chunk>> {
        if !self.pending.is_empty() {
            return Ok(Some(Chunk {
                data: std::mem::take(&mut self.pending),
                _budget: self.pending_budget.take(),
            }));
        }
        self.pending_budget = None;
        match self.data.recv().await {
            Some(piece) => Ok(Some(Chunk {
                data: piece.data,
                _budget: Some(piece.budget),
            })),
            None => self.ended().map(|()| None),
        }
    }
}

impl AsyncRead for StreamReader {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.pending.is_empty() {
            self.pending_budget = None;
            match ready!(self.data.poll_recv(cx)) {
                Some(piece) => {
                    self.pending = piece.data;
                    self.pending_budget = Some(piece.budget);
                }
                None => {
                    return Poll::Ready(self.ended());
                }
            }
        }
        let n = self.pending.len().min(buf.remaining());
        buf.put_slice(&self.pending.split_to(n));
        if self.pending.is_empty() {
            self.pending_budget = None;
        }
        Poll::Ready(Ok(()))
    }
}

/// The sending half of a stream.
pub struct StreamWriter {
    id: u32,
    outgoing: mpsc::UnboundedSender<Outgoing>,
    permits: PollSemaphore,
    end: Arc<AtomicU8>,
    shared: Arc<Shared>,
    closed: bool,
}

impl std::fmt::Debug for StreamWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamWriter")
            .field("id", &self.id)
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl StreamWriter {
    /// Aborts the stream with RST_STREAM (CANCEL) instead of a FIN.
    pub fn reset(mut self) {
        self.closed = true;
        self.shared.local_closed(self.id, true);
        self.send(
            Frame::RstStream {
                stream_id: self.id,
                status: rst::CANCEL,
            },
            None,
        );
    }

    /// Sends `chunk` (in frames of at most [`MAX_DATA_FRAME`]) without copying it, within
    /// the connection's send budget; its receive budget is given back once it is queued.
    pub async fn write_chunk(&mut self, chunk: Chunk) -> io::Result<()> {
        let mut data = chunk.data.clone();
        while !data.is_empty() {
            if self.closed {
                return Err(broken_pipe());
            }
            if self.end.load(Ordering::Acquire) == RESET {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    "stream reset",
                ));
            }
            let piece = data.split_to(data.len().min(MAX_DATA_FRAME));
            // At most 32 KiB + 128: fits.
            let cost = (piece.len() + PIECE_OVERHEAD) as u32;
            let permit = std::future::poll_fn(|cx| self.permits.poll_acquire_many(cx, cost))
                .await
                .ok_or_else(broken_pipe)?;
            let frame = Frame::Data {
                stream_id: self.id,
                fin: false,
                data: piece,
            };
            if !self.send(frame, Some(permit)) {
                return Err(broken_pipe());
            }
        }
        drop(chunk);
        Ok(())
    }

    fn send(&self, frame: Frame, budget: Option<OwnedSemaphorePermit>) -> bool {
        self.outgoing
            .send(Outgoing {
                frame,
                _budget: budget,
            })
            .is_ok()
    }

    fn finish(&mut self) {
        // After a reset the stream is gone on both sides; a FIN then would be a protocol error.
        if !self.closed && self.end.load(Ordering::Acquire) != RESET {
            self.closed = true;
            // Queued behind this stream's DATA, so the FIN is never written before it.
            self.send(
                Frame::Data {
                    stream_id: self.id,
                    fin: true,
                    data: Bytes::new(),
                },
                None,
            );
            self.shared.local_closed(self.id, false);
        }
    }
}

fn broken_pipe() -> io::Error {
    io::Error::new(
        io::ErrorKind::BrokenPipe,
        "SPDY stream or connection closed",
    )
}

impl AsyncWrite for StreamWriter {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.closed {
            return Poll::Ready(Err(broken_pipe()));
        }
        if self.end.load(Ordering::Acquire) == RESET {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "stream reset",
            )));
        }
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let n = buf.len().min(MAX_DATA_FRAME);
        // At most 32 KiB + 128: fits.
        let cost = (n + PIECE_OVERHEAD) as u32;
        let Some(permit) = ready!(self.permits.poll_acquire_many(cx, cost)) else {
            return Poll::Ready(Err(broken_pipe()));
        };
        let frame = Frame::Data {
            stream_id: self.id,
            fin: false,
            data: Bytes::copy_from_slice(&buf[..n]),
        };
        if self.send(frame, Some(permit)) {
            Poll::Ready(Ok(n))
        } else {
            Poll::Ready(Err(broken_pipe()))
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // The writer task flushes the transport whenever its queue runs dry.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.finish();
        Poll::Ready(Ok(()))
    }
}

impl Drop for StreamWriter {
    fn drop(&mut self) {
        self.finish();
    }
}

/// The reader task's state.
struct Reader {
    ctrl: mpsc::Sender<Ctrl>,
    /// `None` after GOAWAY (and always for a client); new streams are then refused.
    accept: Option<mpsc::Sender<Stream>>,
    role: Role,
    /// Weak, so the reader alone does not keep the connection alive.
    outgoing: mpsc::WeakUnboundedSender<Outgoing>,
    /// The send budget, handed to each stream's writer.
    permits: Arc<Semaphore>,
    /// The receive budget: bytes queued on streams, not yet read.
    received: Arc<Semaphore>,
    shared: Arc<Shared>,
    /// Streams refused for the [`MAX_STREAMS`] limit, so far.
    refused: u64,
}

/// Why the reader stopped.
#[derive(Debug, thiserror::Error)]
enum ReadError {
    #[error("reading the transport: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Frame(#[from] frame::FrameError),
    #[error("peer sent GOAWAY")]
    GoAway,
    #[error("writer ended")]
    WriterGone,
}

impl Reader {
    async fn run<R: AsyncRead + Unpin>(mut self, mut io: R, stop: CancellationToken) {
        let result = tokio::select! {
            r = self.read_frames(&mut io) => r,
            () = stop.cancelled() => Err(ReadError::WriterGone),
        };
        let goaway = match &result {
            Ok(()) => {
                debug!("SPDY peer closed the connection");
                None
            }
            Err(e @ (ReadError::GoAway | ReadError::WriterGone)) => {
                debug!(reason = %e, "SPDY connection ending");
                None
            }
            Err(ReadError::Io(e)) => {
                debug!(error = %e, "SPDY connection read failed");
                None
            }
            Err(ReadError::Frame(e)) => {
                warn!(error = %e, "SPDY peer sent a malformed frame; closing the connection");
                Some(goaway::PROTOCOL_ERROR)
            }
        };
        // Streams the peer did not finish read as aborted from here on.
        self.shared.streams().clear();
        self.accept = None;
        if !stop.is_cancelled() {
            let order = Ctrl::Shutdown { goaway, done: None };
            tokio::select! {
                _ = self.ctrl.send(order) => {}
                () = stop.cancelled() => {}
            }
        }
    }

    async fn read_frames<R: AsyncRead + Unpin>(&mut self, io: &mut R) -> Result<(), ReadError> {
        let mut decoder = FrameDecoder::new();
        let mut buf = BytesMut::with_capacity(READ_CHUNK);
        loop {
            while let Some(frame) = decoder.decode(&mut buf)? {
                self.handle(frame).await?;
            }
            // DATA is copied out of `buf`, so this reuses its space once it has been decoded.
            if buf.capacity() - buf.len() < READ_CHUNK / 4 {
                buf.reserve(READ_CHUNK);
            }
            if io.read_buf(&mut buf).await? == 0 {
                return Ok(());
            }
        }
    }

    async fn control(&self, frame: Frame) -> Result<(), ReadError> {
        self.ctrl
            .send(Ctrl::Frame(frame))
            .await
            .map_err(|_| ReadError::WriterGone)
    }

    async fn handle(&mut self, frame: Frame) -> Result<(), ReadError> {
        match frame {
            Frame::SynStream {
                stream_id,
                flags,
                headers,
                ..
            } => self.open(stream_id, flags, headers).await,
            Frame::Data {
                stream_id,
                fin,
                data,
            } => {
                let sender = match self.shared.streams().get(&stream_id) {
                    Some(entry) => entry.data.clone(),
                    None => {
                        trace!(
                            stream_id,
                            "SPDY DATA for a stream that is not open; ignored"
                        );
                        return Ok(());
                    }
                };
                let Some(sender) = sender else {
                    debug!(stream_id, "SPDY DATA after the peer's FIN; ignored");
                    return Ok(());
                };
                // A closed queue means the StreamReader was dropped: the data has nowhere to go.
                if !data.is_empty() && !sender.is_closed() {
                    // At most 32 KiB + 128 (frame::MAX_DATA_PIECE): fits.
                    let cost = (data.len() + PIECE_OVERHEAD) as u32;
                    // Waiting here is what stops reading the connection.
                    let budget = self
                        .received
                        .clone()
                        .acquire_many_owned(cost)
                        .await
                        .map_err(|_| ReadError::WriterGone)?;
                    let _ = sender.send(Piece { data, budget });
                }
                if fin {
                    drop(sender);
                    self.remote_fin(stream_id);
                }
                Ok(())
            }
            Frame::SynReply { stream_id, .. } => {
                let replied = self
                    .shared
                    .streams()
                    .get_mut(&stream_id)
                    .and_then(|entry| entry.replied.take());
                match replied {
                    Some(replied) => {
                        let _ = replied.send(());
                    }
                    None => debug!(
                        stream_id,
                        "SPDY SYN_REPLY for a stream this side did not open (or twice); ignored"
                    ),
                }
                Ok(())
            }
            Frame::RstStream { stream_id, status } => {
                debug!(stream_id, status, "SPDY peer reset a stream");
                if let Some(entry) = self.shared.streams().remove(&stream_id) {
                    entry.end.store(RESET, Ordering::Release);
                }
                Ok(())
            }
            Frame::Ping { id } => {
                // The peer's own pings are echoed: odd ids are the client's, even the server's;
                // the others would answer pings this side never sends.
                let peers = match self.role {
                    Role::Server => 1,
                    Role::Client => 0,
                };
                if id % 2 == peers {
                    self.control(Frame::Ping { id }).await
                } else {
                    Ok(())
                }
            }
            Frame::GoAway {
                last_good_stream_id,
                status,
            } => {
                debug!(last_good_stream_id, status, "SPDY peer sent GOAWAY");
                Err(ReadError::GoAway)
            }
            // kube-apiserver sends none of these; SPDY/3 lets a receiver ignore them here.
            Frame::Headers { .. }
            | Frame::Settings { .. }
            | Frame::WindowUpdate { .. }
            | Frame::Unknown { .. } => Ok(()),
        }
    }

    fn remote_fin(&self, stream_id: u32) {
        let mut streams = self.shared.streams();
        let forget = match streams.get_mut(&stream_id) {
            Some(entry) => {
                entry.end.store(FIN, Ordering::Release);
                entry.data = None;
                entry.local_closed
            }
            None => false,
        };
        if forget {
            streams.remove(&stream_id);
        }
    }

    async fn open(
        &mut self,
        stream_id: u32,
        flags: u8,
        headers: Vec<(String, String)>,
    ) -> Result<(), ReadError> {
        let refuse = |status| Frame::RstStream { stream_id, status };
        // Client-initiated ids are odd and increase (SPDY/3 section 2.3.2).
        if stream_id.is_multiple_of(2)
            || stream_id <= self.shared.last_stream_id.load(Ordering::Relaxed)
        {
            let in_use = self.shared.streams().contains_key(&stream_id);
            debug!(
                stream_id,
                "SPDY SYN_STREAM with an id out of order; refused"
            );
            return self
                .control(refuse(if in_use {
                    rst::STREAM_IN_USE
                } else {
                    rst::PROTOCOL_ERROR
                }))
                .await;
        }
        self.shared
            .last_stream_id
            .store(stream_id, Ordering::Relaxed);
        let open = self.shared.streams().len();
        if open >= MAX_STREAMS {
            self.refused += 1;
            // Once a connection, so that a peer cannot flood the log.
            if self.refused == 1 {
                warn!(
                    stream_id,
                    open, "SPDY peer opened more streams than the limit; refusing the excess"
                );
            }
            debug!(
                stream_id,
                open, "SPDY SYN_STREAM over the stream limit; refused"
            );
            return self.control(refuse(rst::REFUSED_STREAM)).await;
        }
        let accept = self.accept.as_ref().filter(|a| !a.is_closed()).cloned();
        let (Some(accept), Some(outgoing)) = (accept, self.outgoing.upgrade()) else {
            debug!(stream_id, "SPDY SYN_STREAM while not accepting; refused");
            return self.control(refuse(rst::REFUSED_STREAM)).await;
        };
        let (data_tx, data_rx) = mpsc::unbounded_channel();
        let end = Arc::new(AtomicU8::new(OPEN));
        let fin = flags & frame::FLAG_FIN != 0;
        if fin {
            end.store(FIN, Ordering::Release);
        }
        self.shared.streams().insert(
            stream_id,
            Entry {
                data: (!fin).then_some(data_tx),
                end: end.clone(),
                local_closed: false,
                replied: None,
            },
        );
        // The reply is queued before the Stream exists, so it precedes any DATA on it.
        self.control(Frame::SynReply {
            stream_id,
            flags: 0,
            headers: Vec::new(),
        })
        .await?;
        let stream = new_stream(
            stream_id,
            headers,
            data_rx,
            end,
            outgoing,
            &self.permits,
            &self.shared,
        );
        // An error means the Connection was dropped; dropping the Stream sends its FIN.
        let _ = accept.send(stream).await;
        Ok(())
    }
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut io: W,
    mut ctrl: mpsc::Receiver<Ctrl>,
    mut data: mpsc::UnboundedReceiver<Outgoing>,
    permits: Arc<Semaphore>,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    let mut encoder = match FrameEncoder::new() {
        Ok(encoder) => encoder,
        Err(e) => {
            warn!(error = %e, "SPDY header compressor failed to start");
            stop.cancel();
            return;
        }
    };
    let mut wire = Batch::default();
    let mut held = Vec::new();
    let mut finished: Option<(Option<u32>, Option<oneshot::Sender<()>>)> = None;
    while finished.is_none() {
        // Control frames first, so PING echoes and replies do not wait behind bulk DATA.
        let first = tokio::select! {
            biased;
            () = stop.cancelled() => break,
            Some(order) = ctrl.recv() => Ok(order),
            outgoing = data.recv() => match outgoing {
                Some(outgoing) => Err(outgoing),
                // Every handle is gone: nobody can use the connection any more.
                None => Ok(Ctrl::Shutdown { goaway: Some(goaway::OK), done: None }),
            },
        };
        let mut next = Some(first);
        while let Some(item) = next.take() {
            match item {
                Ok(Ctrl::Frame(frame)) => wire.push(&mut encoder, &frame),
                Ok(Ctrl::Shutdown { goaway, done }) => {
                    finished = Some((goaway, done));
                    break;
                }
                Err(outgoing) => {
                    wire.push(&mut encoder, &outgoing.frame);
                    held.push(outgoing);
                }
            }
            if wire.len() < WRITE_BATCH {
                next = match ctrl.try_recv() {
                    Ok(order) => Some(Ok(order)),
                    Err(_) => data.try_recv().ok().map(Err),
                };
            }
        }
        if let Some((goaway, _)) = &finished {
            // What streams queued before the shutdown still goes out, then GOAWAY.
            while let Ok(outgoing) = data.try_recv() {
                wire.push(&mut encoder, &outgoing.frame);
            }
            if let Some(status) = goaway {
                let last = shared.last_stream_id.load(Ordering::Relaxed);
                wire.push(
                    &mut encoder,
                    &Frame::GoAway {
                        last_good_stream_id: last,
                        status: *status,
                    },
                );
            }
        }
        wire.seal();
        let written = tokio::select! {
            r = async {
                // Vectored where the transport is (TLS is): DATA goes out without a copy.
                io.write_all_buf(&mut wire).await?;
                io.flush().await
            } => r,
            () = stop.cancelled() => break,
        };
        wire.clear();
        held.clear();
        if let Err(e) = written {
            debug!(error = %e, "SPDY connection write failed");
            break;
        }
    }
    if finished.is_some() {
        let _ = io.shutdown().await;
    }
    // Writers waiting for send budget learn at once that the connection is gone.
    permits.close();
    drop(data);
    stop.cancel();
    if let Some((_, Some(done))) = finished {
        let _ = done.send(());
    }
}

/// DATA payloads up to this size are copied beside their frame header; larger ones are
/// written from where they are (a slice of their own in a vectored write).
const COPY_DATA_BELOW: usize = 1024;

/// The frames of one write, in order: headers, control frames and small DATA encoded into
/// `head`, and DATA payloads as the streams queued them, without a copy. A [`Buf`] whose
/// chunks a vectored write takes at once.
struct Batch {
    parts: std::collections::VecDeque<Bytes>,
    head: BytesMut,
    /// Scratch for the encoder, which writes a whole frame.
    scratch: Vec<u8>,
    len: usize,
}

impl Default for Batch {
    fn default() -> Self {
        Self {
            parts: std::collections::VecDeque::new(),
            // Frame headers are cut from it one after the other, so they share its room.
            head: BytesMut::with_capacity(4096),
            scratch: Vec::new(),
            len: 0,
        }
    }
}

impl Batch {
    /// Appends `frame` in wire format.
    fn push(&mut self, encoder: &mut FrameEncoder, frame: &Frame) {
        if let Frame::Data {
            stream_id,
            fin,
            data,
        } = frame
            && data.len() >= COPY_DATA_BELOW
        {
            // MAX_DATA_FRAME: its length fits the 24-bit field.
            self.head
                .extend_from_slice(&frame::data_header(*stream_id, *fin, data.len() as u32));
            self.seal();
            self.parts.push_back(data.clone());
            self.len += 8 + data.len();
            return;
        }
        self.scratch.clear();
        if let Err(e) = encoder.encode(frame, &mut self.scratch) {
            // Only an oversized header block can fail, and this server sends none.
            warn!(error = %e, "SPDY frame could not be encoded; dropped");
            return;
        }
        self.head.extend_from_slice(&self.scratch);
        self.len += self.scratch.len();
    }

    /// Moves what `head` holds into the parts (before a payload, and before writing).
    fn seal(&mut self) {
        if !self.head.is_empty() {
            self.parts.push_back(self.head.split().freeze());
        }
    }

    /// Bytes pushed since the last [`Batch::clear`] (written or not).
    fn len(&self) -> usize {
        self.len
    }

    fn clear(&mut self) {
        self.parts.clear();
        self.head.clear();
        self.len = 0;
    }
}

impl bytes::Buf for Batch {
    fn remaining(&self) -> usize {
        self.parts.iter().map(Bytes::len).sum()
    }

    fn chunk(&self) -> &[u8] {
        self.parts.front().map(|b| &b[..]).unwrap_or_default()
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [io::IoSlice<'a>]) -> usize {
        let mut n = 0;
        for (slot, part) in dst.iter_mut().zip(&self.parts) {
            *slot = io::IoSlice::new(part);
            n += 1;
        }
        n
    }

    fn advance(&mut self, mut cnt: usize) {
        while cnt > 0 {
            let Some(front) = self.parts.front_mut() else {
                return;
            };
            if cnt < front.len() {
                front.advance(cnt);
                return;
            }
            cnt -= front.len();
            self.parts.pop_front();
        }
    }
}
