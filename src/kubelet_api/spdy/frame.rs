//! SPDY/3 frames (version 3, as moby/spdystream speaks it): encoding and incremental decoding.

use bytes::Buf;

use super::headers::{HeaderDecoder, HeaderEncoder, HeaderError};

/// Largest frame payload the 24-bit length field can carry.
pub const MAX_FRAME_LEN: usize = (1 << 24) - 1;
/// Largest control frame accepted (its header block included); kube-apiserver's are tiny.
pub const MAX_CONTROL_FRAME: usize = 64 * 1024;
/// Largest piece of a received DATA frame handed on at once. The format allows a frame of
/// 16 MiB; a longer one than this is handed on in pieces as its bytes arrive, so what a peer
/// declares never decides how much is buffered. (Go's spdystream peers write a frame per
/// `Write`, 32 KiB from `io.Copy`.)
pub const MAX_DATA_PIECE: usize = 32 * 1024;

const VERSION: u16 = 3;
/// FLAG_FIN, for DATA and for SYN_STREAM / SYN_REPLY / HEADERS.
pub const FLAG_FIN: u8 = 0x01;

const SYN_STREAM: u16 = 1;
const SYN_REPLY: u16 = 2;
const RST_STREAM: u16 = 3;
const SETTINGS: u16 = 4;
const PING: u16 = 6;
const GOAWAY: u16 = 7;
const HEADERS: u16 = 8;
const WINDOW_UPDATE: u16 = 9;

/// RST_STREAM status codes used here.
pub mod rst {
    /// PROTOCOL_ERROR.
    pub const PROTOCOL_ERROR: u32 = 1;
    /// INVALID_STREAM: a frame for a stream that is not open.
    pub const INVALID_STREAM: u32 = 2;
    /// REFUSED_STREAM: the stream was not processed.
    pub const REFUSED_STREAM: u32 = 3;
    /// CANCEL: the stream is no longer needed.
    pub const CANCEL: u32 = 5;
    /// STREAM_IN_USE: a SYN_STREAM reused an open stream id.
    pub const STREAM_IN_USE: u32 = 8;
}

/// GOAWAY status codes.
pub mod goaway {
    /// OK: a normal teardown.
    pub const OK: u32 = 0;
    /// PROTOCOL_ERROR: the peer sent something undecodable.
    pub const PROTOCOL_ERROR: u32 = 1;
}

/// One decoded SPDY/3 frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// DATA for a stream; `fin` ends the sender's half. Decoded, a piece of a longer frame
    /// ([`MAX_DATA_PIECE`]); `fin` then comes with the last piece.
    Data {
        stream_id: u32,
        fin: bool,
        data: bytes::Bytes,
    },
    /// SYN_STREAM opening a stream.
    SynStream {
        stream_id: u32,
        associated_to: u32,
        priority: u8,
        flags: u8,
        headers: Vec<(String, String)>,
    },
    /// SYN_REPLY accepting a stream.
    SynReply {
        stream_id: u32,
        flags: u8,
        headers: Vec<(String, String)>,
    },
    /// RST_STREAM aborting a stream.
    RstStream { stream_id: u32, status: u32 },
    /// SETTINGS: `(flags, id, value)` entries.
    Settings {
        flags: u8,
        entries: Vec<(u8, u32, u32)>,
    },
    /// PING, echoed by the receiver.
    Ping { id: u32 },
    /// GOAWAY: no new streams after `last_good_stream_id`.
    GoAway {
        last_good_stream_id: u32,
        status: u32,
    },
    /// HEADERS adding headers to a stream.
    Headers {
        stream_id: u32,
        flags: u8,
        headers: Vec<(String, String)>,
    },
    /// WINDOW_UPDATE (flow control, which this server does not do).
    WindowUpdate { stream_id: u32, delta: u32 },
    /// A control frame of a type this server does not know; ignored per spec.
    Unknown { frame_type: u16 },
}

/// A frame that cannot be decoded or encoded; the connection cannot continue after it.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FrameError {
    /// A control frame of a version other than 3.
    #[error("unsupported SPDY version {0}")]
    Version(u16),
    /// A frame whose length does not fit its type.
    #[error("{0} frame with bad length {1}")]
    Length(&'static str, usize),
    /// A frame on stream 0 that needs a stream, or another invalid field.
    #[error("invalid frame: {0}")]
    Invalid(&'static str),
    /// A header block that does not decompress or parse.
    #[error(transparent)]
    Headers(#[from] HeaderError),
}

/// Decodes frames from a byte buffer, keeping the receive-side zlib stream.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    headers: HeaderDecoder,
    /// The DATA frame whose payload is being handed on in pieces.
    data: Option<DataLeft>,
}

/// What is left of a DATA frame being decoded.
#[derive(Debug)]
struct DataLeft {
    stream_id: u32,
    /// Payload bytes not yet handed on.
    left: usize,
    fin: bool,
}

impl FrameDecoder {
    /// A decoder for a new connection.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes one frame (or the next piece of a long DATA frame) off the front of `buf`, or
    /// returns `Ok(None)` if more bytes are needed.
    pub fn decode(&mut self, buf: &mut bytes::BytesMut) -> Result<Option<Frame>, FrameError> {
        if self.data.is_some() {
            return Ok(self.data_piece(buf));
        }
        let Some(head) = buf.first_chunk::<8>() else {
            return Ok(None);
        };
        let word = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
        let flags = head[4];
        let len = u32::from_be_bytes([0, head[5], head[6], head[7]]) as usize;
        let is_control = word & 0x8000_0000 != 0;
        if is_control {
            let version = ((word >> 16) & 0x7fff) as u16;
            if version != VERSION {
                return Err(FrameError::Version(version));
            }
            // Control frames are capped well below 2^24 so a peer cannot make us buffer 16 MiB
            // of headers or settings; kube-apiserver's are a few dozen bytes.
            if len > MAX_CONTROL_FRAME {
                return Err(FrameError::Length("control", len));
            }
        }
        if !is_control {
            let stream_id = word & 0x7fff_ffff;
            if stream_id == 0 {
                return Err(FrameError::Invalid("DATA on stream 0"));
            }
            buf.advance(8);
            self.data = Some(DataLeft {
                stream_id,
                left: len,
                fin: flags & FLAG_FIN != 0,
            });
            return Ok(self.data_piece(buf));
        }
        if buf.len() < 8 + len {
            // Reserve only what this frame needs (at most 64 KiB), never more.
            buf.reserve(8 + len - buf.len());
            return Ok(None);
        }
        buf.advance(8);
        let payload = buf.split_to(len);
        self.decode_control((word & 0xffff) as u16, flags, &payload)
            .map(Some)
    }

    /// The next piece of the DATA frame under way, once all of it is in `buf`. It is copied
    /// out, so a piece a stream keeps queued never holds a larger read buffer alive.
    fn data_piece(&mut self, buf: &mut bytes::BytesMut) -> Option<Frame> {
        let data = self.data.as_mut()?;
        let want = data.left.min(MAX_DATA_PIECE);
        if buf.len() < want {
            buf.reserve(want - buf.len());
            return None;
        }
        let piece = bytes::Bytes::copy_from_slice(&buf[..want]);
        buf.advance(want);
        data.left -= want;
        let stream_id = data.stream_id;
        let fin = data.left == 0 && data.fin;
        if data.left == 0 {
            self.data = None;
        }
        Some(Frame::Data {
            stream_id,
            fin,
            data: piece,
        })
    }

    fn decode_control(
        &mut self,
        frame_type: u16,
        flags: u8,
        p: &[u8],
    ) -> Result<Frame, FrameError> {
        let u32_at =
            |at: usize| -> u32 { u32::from_be_bytes([p[at], p[at + 1], p[at + 2], p[at + 3]]) };
        let exact = |name: &'static str, want: usize| -> Result<(), FrameError> {
            if p.len() == want {
                Ok(())
            } else {
                Err(FrameError::Length(name, p.len()))
            }
        };
        let stream = |id: u32| -> Result<u32, FrameError> {
            let id = id & 0x7fff_ffff;
            if id == 0 {
                Err(FrameError::Invalid("control frame on stream 0"))
            } else {
                Ok(id)
            }
        };
        Ok(match frame_type {
            SYN_STREAM => {
                if p.len() < 10 {
                    return Err(FrameError::Length("SYN_STREAM", p.len()));
                }
                let stream_id = stream(u32_at(0))?;
                Frame::SynStream {
                    stream_id,
                    associated_to: u32_at(4) & 0x7fff_ffff,
                    priority: p[8] >> 5,
                    flags,
                    headers: self.headers.decode(&p[10..])?,
                }
            }
            SYN_REPLY | HEADERS => {
                if p.len() < 4 {
                    return Err(FrameError::Length("SYN_REPLY/HEADERS", p.len()));
                }
                let stream_id = stream(u32_at(0))?;
                let headers = self.headers.decode(&p[4..])?;
                if frame_type == SYN_REPLY {
                    Frame::SynReply {
                        stream_id,
                        flags,
                        headers,
                    }
                } else {
                    Frame::Headers {
                        stream_id,
                        flags,
                        headers,
                    }
                }
            }
            RST_STREAM => {
                exact("RST_STREAM", 8)?;
                Frame::RstStream {
                    stream_id: stream(u32_at(0))?,
                    status: u32_at(4),
                }
            }
            SETTINGS => {
                if p.len() < 4 {
                    return Err(FrameError::Length("SETTINGS", p.len()));
                }
                let count = u32_at(0) as usize;
                if count.checked_mul(8).and_then(|n| n.checked_add(4)) != Some(p.len()) {
                    return Err(FrameError::Length("SETTINGS", p.len()));
                }
                let entries = (0..count)
                    .map(|i| {
                        let at = 4 + i * 8;
                        let id = u32_at(at);
                        ((id >> 24) as u8, id & 0x00ff_ffff, u32_at(at + 4))
                    })
                    .collect();
                Frame::Settings { flags, entries }
            }
            PING => {
                exact("PING", 4)?;
                Frame::Ping { id: u32_at(0) }
            }
            GOAWAY => {
                exact("GOAWAY", 8)?;
                Frame::GoAway {
                    last_good_stream_id: u32_at(0) & 0x7fff_ffff,
                    status: u32_at(4),
                }
            }
            WINDOW_UPDATE => {
                exact("WINDOW_UPDATE", 8)?;
                Frame::WindowUpdate {
                    stream_id: u32_at(0) & 0x7fff_ffff,
                    delta: u32_at(4) & 0x7fff_ffff,
                }
            }
            other => Frame::Unknown { frame_type: other },
        })
    }
}

/// The 8-byte header of a DATA frame carrying `len` bytes (at most 2^24 - 1), so that a
/// payload can be written from where it is, after its header, instead of copied beside it.
pub fn data_header(stream_id: u32, fin: bool, len: u32) -> [u8; 8] {
    let mut head = [0; 8];
    head[..4].copy_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
    let flags = if fin { FLAG_FIN } else { 0 };
    head[4..].copy_from_slice(&((u32::from(flags) << 24) | (len & 0x00ff_ffff)).to_be_bytes());
    head
}

/// Encodes frames, keeping the send-side zlib stream.
#[derive(Debug)]
pub struct FrameEncoder {
    headers: HeaderEncoder,
}

impl FrameEncoder {
    /// An encoder for a new connection.
    pub fn new() -> Result<Self, FrameError> {
        Ok(Self {
            headers: HeaderEncoder::new()?,
        })
    }

    /// Appends `frame` in wire format to `out`.
    pub fn encode(&mut self, frame: &Frame, out: &mut Vec<u8>) -> Result<(), FrameError> {
        let start = out.len();
        // The 8-byte header is written last, once the payload length is known.
        out.extend_from_slice(&[0; 8]);
        let (first_word, flags) = match frame {
            Frame::Data {
                stream_id,
                fin,
                data,
            } => {
                out.extend_from_slice(data);
                (stream_id & 0x7fff_ffff, if *fin { FLAG_FIN } else { 0 })
            }
            Frame::SynStream {
                stream_id,
                associated_to,
                priority,
                flags,
                headers,
            } => {
                out.extend_from_slice(&stream_id.to_be_bytes());
                out.extend_from_slice(&associated_to.to_be_bytes());
                out.extend_from_slice(&[(priority & 0x7) << 5, 0]);
                self.headers.encode(headers, out)?;
                (control_word(SYN_STREAM), *flags)
            }
            Frame::SynReply {
                stream_id,
                flags,
                headers,
            } => {
                out.extend_from_slice(&stream_id.to_be_bytes());
                self.headers.encode(headers, out)?;
                (control_word(SYN_REPLY), *flags)
            }
            Frame::Headers {
                stream_id,
                flags,
                headers,
            } => {
                out.extend_from_slice(&stream_id.to_be_bytes());
                self.headers.encode(headers, out)?;
                (control_word(HEADERS), *flags)
            }
            Frame::RstStream { stream_id, status } => {
                out.extend_from_slice(&stream_id.to_be_bytes());
                out.extend_from_slice(&status.to_be_bytes());
                (control_word(RST_STREAM), 0)
            }
            Frame::Settings { flags, entries } => {
                let count = u32::try_from(entries.len())
                    .map_err(|_| FrameError::Invalid("too many settings"))?;
                out.extend_from_slice(&count.to_be_bytes());
                for (entry_flags, id, value) in entries {
                    out.extend_from_slice(
                        &((u32::from(*entry_flags) << 24) | (id & 0x00ff_ffff)).to_be_bytes(),
                    );
                    out.extend_from_slice(&value.to_be_bytes());
                }
                (control_word(SETTINGS), *flags)
            }
            Frame::Ping { id } => {
                out.extend_from_slice(&id.to_be_bytes());
                (control_word(PING), 0)
            }
            Frame::GoAway {
                last_good_stream_id,
                status,
            } => {
                out.extend_from_slice(&last_good_stream_id.to_be_bytes());
                out.extend_from_slice(&status.to_be_bytes());
                (control_word(GOAWAY), 0)
            }
            Frame::WindowUpdate { stream_id, delta } => {
                out.extend_from_slice(&stream_id.to_be_bytes());
                out.extend_from_slice(&delta.to_be_bytes());
                (control_word(WINDOW_UPDATE), 0)
            }
            Frame::Unknown { frame_type } => (control_word(*frame_type), 0),
        };
        let len = out.len() - start - 8;
        if len > MAX_FRAME_LEN {
            out.truncate(start);
            return Err(FrameError::Length("outgoing", len));
        }
        let len = len as u32;
        out[start..start + 4].copy_from_slice(&first_word.to_be_bytes());
        out[start + 4..start + 8].copy_from_slice(&((u32::from(flags) << 24) | len).to_be_bytes());
        Ok(())
    }
}

fn control_word(frame_type: u16) -> u32 {
    0x8000_0000 | (u32::from(VERSION) << 16) | u32::from(frame_type)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;

    fn h(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn every_frame_type_round_trips() {
        let frames = vec![
            Frame::Data {
                stream_id: 1,
                fin: false,
                data: bytes::Bytes::from_static(b"hello"),
            },
            Frame::Data {
                stream_id: 3,
                fin: true,
                data: bytes::Bytes::new(),
            },
            Frame::SynStream {
                stream_id: 5,
                associated_to: 0,
                priority: 7,
                flags: 0,
                headers: h(&[
                    ("streamtype", "error"),
                    ("port", "8080"),
                    ("requestid", "0"),
                ]),
            },
            Frame::SynReply {
                stream_id: 5,
                flags: FLAG_FIN,
                headers: vec![],
            },
            Frame::RstStream {
                stream_id: 5,
                status: rst::CANCEL,
            },
            Frame::Settings {
                flags: 1,
                entries: vec![(0, 4, 100), (1, 7, 65536)],
            },
            Frame::Ping { id: 1 },
            Frame::GoAway {
                last_good_stream_id: 5,
                status: goaway::OK,
            },
            Frame::Headers {
                stream_id: 5,
                flags: 0,
                headers: h(&[("x", "y")]),
            },
            Frame::WindowUpdate {
                stream_id: 0,
                delta: 65536,
            },
            Frame::Unknown { frame_type: 10 },
        ];
        let mut enc = FrameEncoder::new().unwrap();
        let mut dec = FrameDecoder::new();
        let mut wire = Vec::new();
        for frame in &frames {
            enc.encode(frame, &mut wire).unwrap();
        }
        // Fed one byte at a time, so every partial-frame path is taken.
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for byte in wire {
            buf.extend_from_slice(&[byte]);
            while let Some(frame) = dec.decode(&mut buf).unwrap() {
                got.push(frame);
            }
        }
        assert_eq!(got, frames);
        assert!(buf.is_empty());
    }

    #[test]
    fn a_data_header_is_what_the_encoder_writes_before_the_payload() {
        let cases: [(u32, bool, usize); 5] = [
            (1, false, 0),
            (1, true, 0),
            (3, false, 1024),
            (0x7fff_ffff, true, 32 * 1024),
            (0x8000_0005, false, 7),
        ];
        for (stream_id, fin, len) in cases {
            let data = bytes::Bytes::from(vec![9; len]);
            let mut wire = Vec::new();
            FrameEncoder::new()
                .unwrap()
                .encode(
                    &Frame::Data {
                        stream_id,
                        fin,
                        data: data.clone(),
                    },
                    &mut wire,
                )
                .unwrap();
            let mut split = data_header(stream_id, fin, len as u32).to_vec();
            split.extend_from_slice(&data);
            assert_eq!(split, wire, "stream {stream_id} fin {fin} len {len}");
        }
    }

    /// A DATA frame's payload length, the bytes of it that have arrived, and the pieces
    /// (their lengths and FIN) decoded so far.
    type PieceCase = (usize, usize, Vec<(usize, bool)>);

    #[test]
    fn long_data_frames_are_decoded_in_pieces_as_they_arrive() {
        let piece = MAX_DATA_PIECE;
        let cases: Vec<PieceCase> = vec![
            (0, 0, vec![(0, true)]),
            (5, 5, vec![(5, true)]),
            (5, 4, vec![]),
            (piece, piece, vec![(piece, true)]),
            (piece + 1, piece, vec![(piece, false)]),
            (piece + 1, piece + 1, vec![(piece, false), (1, true)]),
            (
                2 * piece + 10,
                2 * piece + 9,
                vec![(piece, false), (piece, false)],
            ),
            (MAX_FRAME_LEN, 3 * piece + 7, vec![(piece, false); 3]),
        ];
        for (len, arrived, want) in cases {
            let mut wire = vec![0, 0, 0, 1, FLAG_FIN];
            wire.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
            wire.resize(8 + arrived, 7);
            let sent = wire.len();
            let mut buf = BytesMut::from(&wire[..]);
            let mut dec = FrameDecoder::new();
            let mut got = Vec::new();
            while let Some(frame) = dec.decode(&mut buf).unwrap() {
                match frame {
                    Frame::Data {
                        stream_id: 1,
                        fin,
                        data,
                    } => got.push((data.len(), fin)),
                    other => panic!("{other:?}"),
                }
            }
            assert_eq!(got, want, "{len} bytes declared, {arrived} arrived");
            // Room is made for one more piece at most, whatever the frame declared.
            assert!(
                buf.capacity() <= sent + piece,
                "{len}: {} reserved",
                buf.capacity()
            );
        }
    }

    #[test]
    fn malformed_frames_are_errors() {
        let cases: &[(&str, &[u8])] = &[
            (
                "version 2",
                &[0x80, 0x02, 0x00, 0x06, 0, 0, 0, 4, 0, 0, 0, 1],
            ),
            ("short ping", &[0x80, 0x03, 0x00, 0x06, 0, 0, 0, 3, 0, 0, 1]),
            (
                "long rst",
                &[
                    0x80, 0x03, 0x00, 0x03, 0, 0, 0, 9, 0, 0, 0, 1, 0, 0, 0, 5, 0,
                ],
            ),
            (
                "rst stream 0",
                &[0x80, 0x03, 0x00, 0x03, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 5],
            ),
            ("data stream 0", &[0, 0, 0, 0, 0, 0, 0, 1, 0xaa]),
            (
                "settings count",
                &[0x80, 0x03, 0x00, 0x04, 0, 0, 0, 4, 0xff, 0xff, 0xff, 0xff],
            ),
            (
                "short syn_stream",
                &[0x80, 0x03, 0x00, 0x01, 0, 0, 0, 2, 0, 1],
            ),
            (
                "syn_stream bad zlib",
                &[
                    0x80, 0x03, 0x00, 0x01, 0, 0, 0, 12, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 2,
                ],
            ),
            (
                "huge header block",
                &[0x80, 0x03, 0x00, 0x01, 0, 0xff, 0xff, 0xff],
            ),
        ];
        for (name, bytes) in cases {
            let mut buf = BytesMut::from(*bytes);
            assert!(
                FrameDecoder::new().decode(&mut buf).is_err(),
                "{name} decoded"
            );
        }
    }
}
