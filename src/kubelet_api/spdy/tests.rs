//! Connection tests: a client built from this module's own codec, bytes a Go spdystream client
//! wrote, and random input to the decoder.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::time::timeout;

use super::frame::{FLAG_FIN, Frame, FrameDecoder, FrameEncoder, goaway, rst};
use super::*;

const LIMIT: Duration = Duration::from_secs(5);

/// The client side, speaking frames through the module's own codec.
struct Peer {
    io: DuplexStream,
    enc: FrameEncoder,
    dec: FrameDecoder,
    buf: BytesMut,
}

impl Peer {
    /// Speaks frames on `io`.
    fn on(io: DuplexStream) -> Peer {
        Peer {
            io,
            enc: FrameEncoder::new().unwrap(),
            dec: FrameDecoder::new(),
            buf: BytesMut::new(),
        }
    }

    /// The client side of a server [`Connection`].
    fn connect() -> (Peer, Connection) {
        let (client, server) = tokio::io::duplex(1 << 20);
        (Peer::on(client), Connection::server(server))
    }

    /// The server side of a client [`Connection`] that pings every [`PING`].
    fn serve() -> (Peer, Connection) {
        let (client, server) = tokio::io::duplex(1 << 20);
        let conn = Connection::start(client, Role::Client, Some(PING));
        (Peer::on(server), conn)
    }

    async fn send(&mut self, frame: Frame) {
        let mut wire = Vec::new();
        self.enc.encode(&frame, &mut wire).unwrap();
        self.io.write_all(&wire).await.unwrap();
    }

    async fn open(&mut self, stream_id: u32, headers: &[(&str, &str)]) {
        let headers = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        self.send(Frame::SynStream {
            stream_id,
            associated_to: 0,
            priority: 0,
            flags: 0,
            headers,
        })
        .await;
    }

    /// The next frame, or None at EOF.
    async fn recv(&mut self) -> Option<Frame> {
        timeout(LIMIT, async {
            loop {
                if let Some(frame) = self.dec.decode(&mut self.buf).unwrap() {
                    return Some(frame);
                }
                if self.io.read_buf(&mut self.buf).await.unwrap_or(0) == 0 {
                    return None;
                }
            }
        })
        .await
        .unwrap()
    }

    /// Every frame until EOF.
    async fn recv_all(&mut self) -> Vec<Frame> {
        let mut frames = Vec::new();
        while let Some(frame) = self.recv().await {
            frames.push(frame);
        }
        frames
    }
}

async fn accept(conn: &mut Connection) -> Stream {
    timeout(LIMIT, conn.accept()).await.unwrap().unwrap()
}

async fn read_to_end(reader: &mut StreamReader) -> io::Result<Vec<u8>> {
    let mut out = Vec::new();
    timeout(LIMIT, reader.read_to_end(&mut out))
        .await
        .unwrap()?;
    Ok(out)
}

fn data(stream_id: u32, fin: bool, bytes: &'static [u8]) -> Frame {
    Frame::Data {
        stream_id,
        fin,
        data: Bytes::from_static(bytes),
    }
}

fn reply(stream_id: u32) -> Frame {
    Frame::SynReply {
        stream_id,
        flags: 0,
        headers: vec![],
    }
}

#[tokio::test]
async fn three_streams_data_fin_rst_ping_goaway() {
    let (mut peer, mut conn) = Peer::connect();
    peer.open(
        1,
        &[
            ("streamtype", "error"),
            ("port", "8080"),
            ("requestid", "0"),
        ],
    )
    .await;
    peer.open(
        3,
        &[("StreamType", "data"), ("port", "8080"), ("requestid", "0")],
    )
    .await;
    peer.open(5, &[("streamtype", "stdout")]).await;
    for id in [1, 3, 5] {
        assert_eq!(peer.recv().await, Some(reply(id)));
    }

    let s1 = accept(&mut conn).await;
    assert_eq!(
        (
            s1.id(),
            s1.header("STREAMTYPE"),
            s1.header("port"),
            s1.header("requestid")
        ),
        (1, Some("error"), Some("8080"), Some("0"))
    );
    let s3 = accept(&mut conn).await;
    assert_eq!(
        (s3.header("streamtype"), s3.header("missing")),
        (Some("data"), None)
    );
    let s5 = accept(&mut conn).await;
    assert_eq!(
        s5.headers(),
        &[("streamtype".to_string(), "stdout".to_string())]
    );

    // Stream 1: the client sends and finishes; the server answers and finishes.
    peer.send(data(1, false, b"ping ")).await;
    peer.send(data(1, true, b"pong")).await;
    let (mut r1, mut w1) = s1.split();
    assert_eq!(read_to_end(&mut r1).await.unwrap(), b"ping pong");
    w1.write_all(b"answer").await.unwrap();
    w1.shutdown().await.unwrap();
    assert_eq!(peer.recv().await, Some(data(1, false, b"answer")));
    assert_eq!(peer.recv().await, Some(data(1, true, b"")));
    assert!(w1.write_all(b"late").await.is_err(), "write after FIN");

    // Stream 3: a large write is split into frames of at most 32 KiB, in order.
    let (_r3, mut w3) = s3.split();
    let big: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    w3.write_all(&big).await.unwrap();
    let mut got = Vec::new();
    while got.len() < big.len() {
        match peer.recv().await {
            Some(Frame::Data {
                stream_id: 3,
                fin: false,
                data,
            }) => {
                assert!(data.len() <= MAX_DATA_FRAME);
                got.extend_from_slice(&data);
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(got, big);
    // A server-side reset reaches the client as RST_STREAM CANCEL.
    w3.reset();
    assert_eq!(
        peer.recv().await,
        Some(Frame::RstStream {
            stream_id: 3,
            status: rst::CANCEL
        })
    );

    // Stream 5: the client resets it.
    let (mut r5, mut w5) = s5.split();
    peer.send(Frame::RstStream {
        stream_id: 5,
        status: rst::CANCEL,
    })
    .await;
    let err = read_to_end(&mut r5).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::ConnectionReset);
    assert_eq!(
        w5.write(b"x").await.unwrap_err().kind(),
        io::ErrorKind::ConnectionReset
    );

    // PING is echoed; DATA for unknown streams and ignorable frames change nothing.
    peer.send(data(99, false, b"nobody")).await;
    peer.send(Frame::Settings {
        flags: 0,
        entries: vec![(0, 7, 1 << 20)],
    })
    .await;
    peer.send(Frame::WindowUpdate {
        stream_id: 0,
        delta: 1000,
    })
    .await;
    peer.send(Frame::Unknown { frame_type: 42 }).await;
    peer.send(Frame::Ping { id: 7 }).await;
    assert_eq!(peer.recv().await, Some(Frame::Ping { id: 7 }));

    // GOAWAY: no more streams; the server closes its side.
    peer.send(Frame::GoAway {
        last_good_stream_id: 0,
        status: goaway::OK,
    })
    .await;
    assert!(timeout(LIMIT, conn.accept()).await.unwrap().is_none());
    drop((w5, r5));
    let rest = peer.recv_all().await;
    assert!(
        rest.iter()
            .all(|f| matches!(f, Frame::Data { fin: true, data, .. } if data.is_empty())),
        "{rest:?}"
    );
}

#[tokio::test]
async fn close_sends_goaway_after_queued_data() {
    let (mut peer, mut conn) = Peer::connect();
    peer.open(1, &[("streamtype", "stdout")]).await;
    let (_r, mut w) = accept(&mut conn).await.split();
    w.write_all(b"last words").await.unwrap();
    timeout(LIMIT, conn.close()).await.unwrap();
    let frames = peer.recv_all().await;
    assert_eq!(
        frames,
        vec![
            reply(1),
            data(1, false, b"last words"),
            Frame::GoAway {
                last_good_stream_id: 1,
                status: goaway::OK
            }
        ]
    );
    assert_eq!(
        w.write(b"more").await.unwrap_err().kind(),
        io::ErrorKind::BrokenPipe
    );
}

#[tokio::test]
async fn dropping_every_handle_ends_the_connection() {
    let (mut peer, mut conn) = Peer::connect();
    peer.open(1, &[("streamtype", "stdin")]).await;
    let stream = accept(&mut conn).await;
    drop(conn);
    // With the Connection gone new streams are refused, but open ones keep working.
    peer.open(3, &[("streamtype", "stdout")]).await;
    assert_eq!(peer.recv().await, Some(reply(1)));
    assert_eq!(
        peer.recv().await,
        Some(Frame::RstStream {
            stream_id: 3,
            status: rst::REFUSED_STREAM
        })
    );
    drop(stream);
    let frames = peer.recv_all().await;
    assert_eq!(
        frames,
        vec![
            data(1, true, b""),
            Frame::GoAway {
                last_good_stream_id: 3,
                status: goaway::OK
            }
        ]
    );
}

#[tokio::test]
async fn peer_going_away_aborts_unfinished_streams() {
    let (mut peer, mut conn) = Peer::connect();
    peer.open(1, &[("streamtype", "stdin")]).await;
    let (mut r, _w) = accept(&mut conn).await.split();
    peer.send(data(1, false, b"partial")).await;
    drop(peer);
    let mut got = vec![0; 7];
    timeout(LIMIT, r.read_exact(&mut got))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, b"partial");
    assert_eq!(
        read_to_end(&mut r).await.unwrap_err().kind(),
        io::ErrorKind::ConnectionAborted
    );
    assert!(timeout(LIMIT, conn.accept()).await.unwrap().is_none());
}

#[tokio::test]
async fn out_of_order_stream_ids_are_refused() {
    let (mut peer, mut conn) = Peer::connect();
    peer.open(3, &[]).await;
    peer.open(3, &[]).await;
    peer.open(1, &[]).await;
    peer.open(4, &[]).await;
    assert_eq!(peer.recv().await, Some(reply(3)));
    assert_eq!(
        peer.recv().await,
        Some(Frame::RstStream {
            stream_id: 3,
            status: rst::STREAM_IN_USE
        })
    );
    assert_eq!(
        peer.recv().await,
        Some(Frame::RstStream {
            stream_id: 1,
            status: rst::PROTOCOL_ERROR
        })
    );
    assert_eq!(
        peer.recv().await,
        Some(Frame::RstStream {
            stream_id: 4,
            status: rst::PROTOCOL_ERROR
        })
    );
    assert_eq!(accept(&mut conn).await.id(), 3);
}

#[tokio::test]
async fn malformed_input_ends_the_connection_with_goaway() {
    let cases: &[(&str, &[u8])] = &[
        (
            "wrong version",
            &[0x80, 0x02, 0x00, 0x06, 0, 0, 0, 4, 0, 0, 0, 1],
        ),
        (
            "bad zlib",
            &[
                0x80, 0x03, 0x00, 0x01, 0, 0, 0, 14, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 9, 9, 9, 9,
            ],
        ),
        (
            "oversized header frame",
            &[0x80, 0x03, 0x00, 0x08, 0, 0x10, 0, 0],
        ),
    ];
    for (name, bytes) in cases {
        let (mut peer, mut conn) = Peer::connect();
        peer.io.write_all(bytes).await.unwrap();
        assert!(
            timeout(LIMIT, conn.accept()).await.unwrap().is_none(),
            "{name}"
        );
        drop(conn);
        let frames = peer.recv_all().await;
        assert_eq!(
            frames,
            vec![Frame::GoAway {
                last_good_stream_id: 0,
                status: goaway::PROTOCOL_ERROR
            }],
            "{name}"
        );
    }
}

/// Bytes a moby/spdystream client wrote (see tests/spdy-vectors): port-forward's error and
/// data streams, an exec stdout stream, 18 + 40000 bytes of DATA, PING, FIN, RST, GOAWAY.
#[tokio::test]
async fn replays_a_go_spdystream_client() {
    let wire = include_bytes!("testdata/go_client.bin");
    let (client, server) = tokio::io::duplex(1 << 20);
    let mut conn = Connection::server(server);
    let (mut client_read, mut client_write) = tokio::io::split(client);
    let writer = tokio::spawn(async move {
        client_write.write_all(wire).await.unwrap();
        client_write
    });

    let s1 = accept(&mut conn).await;
    let s3 = accept(&mut conn).await;
    let s5 = accept(&mut conn).await;
    let summary: Vec<_> = [&s1, &s3, &s5]
        .iter()
        .map(|s| {
            (
                s.id(),
                s.header("streamtype"),
                s.header("port"),
                s.header("requestid"),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            (1, Some("error"), Some("8080"), Some("0")),
            (3, Some("data"), Some("8080"), Some("0")),
            (5, Some("stdout"), None, None),
        ]
    );
    let (mut r1, _w1) = s1.split();
    assert_eq!(read_to_end(&mut r1).await.unwrap(), b"");
    let (mut r3, _w3) = s3.split();
    let mut want = b"GET / HTTP/1.1\r\n\r\n".to_vec();
    want.extend((0..40_000u32).map(|i| (i % 251) as u8));
    assert_eq!(read_to_end(&mut r3).await.unwrap(), want);
    let (mut r5, _w5) = s5.split();
    assert_eq!(
        read_to_end(&mut r5).await.unwrap_err().kind(),
        io::ErrorKind::ConnectionReset
    );
    assert!(
        timeout(LIMIT, conn.accept()).await.unwrap().is_none(),
        "GOAWAY ends accepting"
    );

    let _keep = writer.await.unwrap();
    let mut out = Vec::new();
    timeout(LIMIT, client_read.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    let mut buf = BytesMut::from(&out[..]);
    let mut dec = FrameDecoder::new();
    let mut frames = Vec::new();
    while let Some(frame) = dec.decode(&mut buf).unwrap() {
        frames.push(frame);
    }
    assert!(buf.is_empty());
    assert_eq!(&frames[..3], &[reply(1), reply(3), reply(5)]);
    assert!(frames.contains(&Frame::Ping { id: 1 }), "{frames:?}");
}

/// Feeds arbitrary bytes to a fresh decoder until it errors or runs dry.
fn decode_all(bytes: &[u8]) {
    let mut dec = FrameDecoder::new();
    let mut buf = BytesMut::from(bytes);
    while let Ok(Some(_)) = dec.decode(&mut buf) {}
}

fn valid_wire() -> Vec<u8> {
    let mut enc = FrameEncoder::new().unwrap();
    let mut wire = Vec::new();
    let headers = vec![
        ("streamtype".to_string(), "error".to_string()),
        ("port".to_string(), "8080".to_string()),
    ];
    for frame in [
        Frame::SynStream {
            stream_id: 1,
            associated_to: 0,
            priority: 0,
            flags: 0,
            headers: headers.clone(),
        },
        Frame::SynStream {
            stream_id: 3,
            associated_to: 0,
            priority: 0,
            flags: FLAG_FIN,
            headers,
        },
        data(1, true, b"payload"),
        Frame::Settings {
            flags: 0,
            entries: vec![(0, 4, 100)],
        },
        Frame::Ping { id: 1 },
        Frame::GoAway {
            last_good_stream_id: 3,
            status: 0,
        },
    ] {
        enc.encode(&frame, &mut wire).unwrap();
    }
    wire
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn decoder_survives_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        decode_all(&bytes);
    }

    #[test]
    fn decoder_survives_mutated_frames(edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let mut wire = valid_wire();
        for (at, byte) in edits {
            let i = at.index(wire.len());
            wire[i] = byte;
        }
        decode_all(&wire);
    }
}

#[tokio::test]
async fn connection_survives_mutated_frames() {
    // A few fixed mutations through the whole connection, not just the decoder.
    let wire = valid_wire();
    for i in (0..wire.len()).step_by(7) {
        let mut bad = wire.clone();
        bad[i] ^= 0xa5;
        let (mut peer, mut conn) = Peer::connect();
        peer.io.write_all(&bad).await.unwrap();
        peer.io.shutdown().await.unwrap();
        while let Ok(Some(stream)) = timeout(LIMIT, conn.accept()).await {
            drop(stream);
        }
        drop(conn);
        let _ = peer.recv_all().await;
    }
}

/// A real moby/spdystream client against this server over TCP. Needs `go` and the Go module
/// proxy: `cargo test --lib spdy -- --ignored`.
#[tokio::test]
#[ignore = "runs `go run` in tests/spdy-vectors"]
async fn go_client_against_live_server() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/spdy-vectors");
    let mut go = tokio::process::Command::new("go")
        .args(["run", ".", "-connect", &addr.to_string()])
        .current_dir(dir)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let (tcp, _) = timeout(Duration::from_secs(120), listener.accept())
        .await
        .unwrap()
        .unwrap();
    let mut conn = Connection::server(tcp);
    let server = tokio::spawn(async move {
        while let Some(stream) = conn.accept().await {
            tokio::spawn(async move {
                let kind = stream.header("streamtype").map(str::to_owned);
                let (mut r, mut w) = stream.split();
                let mut got = Vec::new();
                r.read_to_end(&mut got).await.unwrap();
                if kind.as_deref() == Some("data") {
                    w.write_all(b"echo: ").await.unwrap();
                    w.write_all(&got).await.unwrap();
                }
                w.shutdown().await.unwrap();
            });
        }
    });
    let status = timeout(Duration::from_secs(120), go.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "Go client failed: {status}");
    timeout(LIMIT, server).await.unwrap().unwrap();
}

#[test]
fn public_types_are_send_and_static() {
    fn check<T: Send + Unpin + std::fmt::Debug + 'static>() {}
    check::<Connection>();
    check::<Stream>();
    check::<StreamReader>();
    check::<StreamWriter>();
}

#[tokio::test]
async fn no_fin_after_a_reset() {
    let (mut peer, mut conn) = Peer::connect();
    peer.open(1, &[("streamtype", "stdout")]).await;
    let stream = accept(&mut conn).await;
    assert_eq!(peer.recv().await, Some(reply(1)));
    peer.send(Frame::RstStream {
        stream_id: 1,
        status: rst::CANCEL,
    })
    .await;
    peer.send(Frame::Ping { id: 1 }).await;
    assert_eq!(peer.recv().await, Some(Frame::Ping { id: 1 }));
    drop((stream, conn));
    assert_eq!(
        peer.recv_all().await,
        vec![Frame::GoAway {
            last_good_stream_id: 1,
            status: goaway::OK
        }]
    );
}

/// The wire bytes of one DATA frame.
fn data_wire(stream_id: u32, len: usize) -> Vec<u8> {
    let mut wire = Vec::with_capacity(8 + len);
    wire.extend_from_slice(&stream_id.to_be_bytes());
    wire.push(0);
    wire.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
    wire.resize(8 + len, 0x5a);
    wire
}

#[tokio::test]
async fn a_long_data_frame_reaches_its_stream_in_pieces_as_it_arrives() {
    let (mut peer, mut conn) = Peer::connect();
    peer.open(1, &[("streamtype", "data")]).await;
    let (mut reader, _writer) = accept(&mut conn).await.split();
    // The longest frame the format allows, of which only the first 100 000 bytes are sent:
    // they reach the stream without the server waiting for (and buffering) 16 MiB.
    let mut wire = data_wire(1, frame::MAX_FRAME_LEN);
    wire.truncate(8 + 100_000);
    peer.io.write_all(&wire).await.unwrap();
    let mut got = vec![0; 3 * frame::MAX_DATA_PIECE];
    timeout(LIMIT, reader.read_exact(&mut got))
        .await
        .expect("the first pieces of a 16 MiB frame before all of it arrived")
        .unwrap();
    assert!(got.iter().all(|b| *b == 0x5a));
}

/// Writes `wire` to `io` a slice at a time until done or until the server stops reading (no
/// progress for a second); the bytes written, and whether it stopped.
async fn write_until_stalled(io: &mut DuplexStream, wire: &[u8]) -> (usize, bool) {
    let mut written = 0;
    while written < wire.len() {
        match timeout(Duration::from_secs(1), io.write(&wire[written..])).await {
            Ok(result) => written += result.unwrap(),
            Err(_) => return (written, true),
        }
    }
    (written, false)
}

#[tokio::test]
async fn unread_data_stops_the_connection_within_its_byte_budget() {
    // A small pipe, so that what the server took is what the client could write.
    let (client, server) = tokio::io::duplex(4096);
    let mut peer = Peer::on(client);
    let mut conn = Connection::server(server);
    let mut readers = Vec::new();
    for id in (1..=15).step_by(2) {
        peer.open(id, &[("streamtype", "data")]).await;
        let (reader, _writer) = accept(&mut conn).await.split();
        readers.push(reader);
    }
    // 1 MiB frames round the eight streams, none of them read.
    let mut sent = 0;
    let mut unsent = Vec::new();
    'send: for _ in 0..16 {
        for id in (1..=15).step_by(2) {
            let wire = data_wire(id, 1 << 20);
            let (written, stalled) = write_until_stalled(&mut peer.io, &wire).await;
            sent += written;
            if stalled {
                unsent = wire[written..].to_vec();
                break 'send;
            }
        }
    }
    // Beyond the budget: what the reader has read and not yet decoded, and the pipe.
    let slack = 2 * READ_CHUNK + frame::MAX_DATA_PIECE + 4096;
    assert!(
        !unsent.is_empty() && sent <= RECEIVE_BUDGET + slack,
        "the server took {sent} bytes of unread DATA (budget {RECEIVE_BUDGET}), stalled: {}",
        !unsent.is_empty()
    );
    // Dropping the readers gives the budget back; the rest is read and discarded, and the
    // connection answers again.
    drop(readers);
    let mut ping = Vec::new();
    FrameEncoder::new()
        .unwrap()
        .encode(&Frame::Ping { id: 9 }, &mut ping)
        .unwrap();
    unsent.extend_from_slice(&ping);
    let (_, stalled) = write_until_stalled(&mut peer.io, &unsent).await;
    assert!(
        !stalled,
        "the connection reads again once its streams are gone"
    );
    let mut frames = Vec::new();
    while !frames.contains(&Frame::Ping { id: 9 }) {
        frames.push(peer.recv().await.unwrap());
    }
}

#[tokio::test]
async fn streams_beyond_the_limit_are_refused() {
    let (mut peer, mut conn) = Peer::connect();
    let accepted = tokio::spawn(async move {
        let mut streams = Vec::new();
        while streams.len() < MAX_STREAMS {
            streams.push(accept(&mut conn).await);
        }
        (conn, streams)
    });
    let over = 3;
    let last = 2 * (MAX_STREAMS + over) as u32 - 1;
    for id in (1..=last).step_by(2) {
        peer.open(id, &[("streamtype", "data")]).await;
    }
    let mut replies = 0;
    let mut refused = Vec::new();
    while replies + refused.len() < MAX_STREAMS + over {
        match peer.recv().await.unwrap() {
            Frame::SynReply { .. } => replies += 1,
            Frame::RstStream {
                stream_id,
                status: rst::REFUSED_STREAM,
            } => refused.push(stream_id),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(replies, MAX_STREAMS);
    assert_eq!(refused, [last - 4, last - 2, last]);
    // Once a stream has ended on both sides, another may open.
    let (mut conn, mut streams) = timeout(LIMIT, accepted).await.unwrap().unwrap();
    peer.send(data(1, true, b"")).await;
    drop(streams.remove(0));
    assert_eq!(peer.recv().await, Some(data(1, true, b"")));
    peer.open(last + 2, &[("streamtype", "data")]).await;
    assert_eq!(peer.recv().await, Some(reply(last + 2)));
    assert_eq!(accept(&mut conn).await.id(), last + 2);
}

/// A writer that takes at most `max` bytes a call, vectored or not, and records each call.
struct Recorder {
    wire: Vec<u8>,
    max: usize,
    vectored: bool,
    calls: Vec<usize>,
}

impl tokio::io::AsyncWrite for Recorder {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let n = buf.len().min(self.max);
        self.wire.extend_from_slice(&buf[..n]);
        self.calls.push(n);
        Poll::Ready(Ok(n))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut n = 0;
        for buf in bufs {
            let take = buf.len().min(self.max - n);
            self.wire.extend_from_slice(&buf[..take]);
            n += take;
        }
        self.calls.push(n);
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        self.vectored
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

#[tokio::test]
async fn a_batch_writes_the_encoded_frames_with_data_payloads_uncopied() {
    let data = |len: usize, fill: u8| Frame::Data {
        stream_id: 3,
        fin: false,
        data: Bytes::from(vec![fill; len]),
    };
    let frames = vec![
        Frame::SynReply {
            stream_id: 1,
            flags: 0,
            headers: Vec::new(),
        },
        data(MAX_DATA_FRAME, 1),
        data(COPY_DATA_BELOW - 1, 2),
        data(COPY_DATA_BELOW, 3),
        Frame::Ping { id: 2 },
        data(5000, 4),
        data(MAX_DATA_FRAME, 5),
        Frame::Data {
            stream_id: 3,
            fin: true,
            data: Bytes::new(),
        },
        Frame::GoAway {
            last_good_stream_id: 1,
            status: goaway::OK,
        },
    ];
    let mut want = Vec::new();
    let mut reference = FrameEncoder::new().unwrap();
    for frame in &frames {
        reference.encode(frame, &mut want).unwrap();
    }
    // Whatever the transport takes a call, vectored or not, the bytes are the encoder's.
    for (max, vectored) in [
        (usize::MAX, true),
        (usize::MAX, false),
        (7, true),
        (4096, false),
    ] {
        let mut encoder = FrameEncoder::new().unwrap();
        let mut batch = Batch::default();
        for frame in &frames {
            batch.push(&mut encoder, frame);
        }
        batch.seal();
        assert_eq!(batch.len(), want.len());
        // Payloads of COPY_DATA_BELOW or more are the queued bytes themselves.
        let queued: Vec<*const u8> = frames
            .iter()
            .filter_map(|f| match f {
                Frame::Data { data, .. } if data.len() >= COPY_DATA_BELOW => Some(data.as_ptr()),
                _ => None,
            })
            .collect();
        let parts: Vec<*const u8> = batch.parts.iter().map(|p| p.as_ptr()).collect();
        for ptr in &queued {
            assert!(parts.contains(ptr), "a payload was copied");
        }
        let mut io = Recorder {
            wire: Vec::new(),
            max,
            vectored,
            calls: Vec::new(),
        };
        io.write_all_buf(&mut batch).await.unwrap();
        assert_eq!(io.wire, want, "max {max} vectored {vectored}");
        if vectored && max == usize::MAX {
            assert_eq!(io.calls, [want.len()], "one vectored write");
        }
        batch.clear();
        assert_eq!(batch.len(), 0);
    }
}

/// A ping period short enough for a test.
const PING: Duration = Duration::from_millis(50);

#[tokio::test]
async fn a_client_pings_its_peer_every_period_until_it_ends() {
    let (mut peer, conn) = Peer::serve();
    let started = tokio::time::Instant::now();
    assert_eq!(peer.recv().await, Some(Frame::Ping { id: 1 }));
    assert!(started.elapsed() >= PING, "{:?}", started.elapsed());
    // The peer's echo is taken quietly: nothing answers it, and the pings go on.
    peer.send(Frame::Ping { id: 1 }).await;
    assert_eq!(peer.recv().await, Some(Frame::Ping { id: 3 }));
    assert!(started.elapsed() >= 2 * PING, "{:?}", started.elapsed());
    // A ping of the peer's own (even id) is echoed, among the client's own.
    peer.send(Frame::Ping { id: 2 }).await;
    loop {
        match peer.recv().await {
            Some(Frame::Ping { id: 2 }) => break,
            Some(Frame::Ping { id }) if id % 2 == 1 => continue,
            other => panic!("want the echo of ping 2, got {other:?}"),
        }
    }
    drop(conn);
    let rest = peer.recv_all().await;
    assert!(
        rest.iter().all(|f| !matches!(f, Frame::Ping { .. })),
        "no ping after the end: {rest:?}"
    );
}

#[tokio::test]
async fn a_server_does_not_ping() {
    let (mut peer, _conn) = Peer::connect();
    let quiet = timeout(6 * PING, peer.recv()).await;
    assert!(quiet.is_err(), "a server sent {quiet:?}");
}

#[test]
fn a_client_pings_as_often_as_client_go() {
    // client-go's SPDY round tripper: `PingPeriod: time.Second * 5`.
    assert_eq!(PING_PERIOD, Duration::from_secs(5));
}
