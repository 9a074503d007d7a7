//! SPDY/3 name/value header blocks, zlib-compressed with the dictionary from the spec.
//!
//! Each direction of a connection is one zlib stream: every block sent goes through the same
//! deflater and every block received through the same inflater, and each block ends with a
//! sync flush so the peer can decode it without waiting for more.

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

/// Most header bytes accepted after decompression. kube-apiserver sends a handful of short
/// headers (kubectl's streams carry ~50 bytes); a stream keeps its headers while it is open,
/// so this bounds what [`super::MAX_STREAMS`] streams hold, and stops a zlib bomb.
pub const MAX_DECOMPRESSED_HEADERS: usize = 16 * 1024;

/// Most name/value pairs accepted in one block.
const MAX_PAIRS: u32 = 1024;

/// A header block that could not be encoded or decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HeaderError {
    /// The zlib stream is corrupt or was primed with another dictionary.
    #[error("header block zlib: {0}")]
    Zlib(String),
    /// The decompressed block is larger than [`MAX_DECOMPRESSED_HEADERS`].
    #[error("header block larger than {MAX_DECOMPRESSED_HEADERS} bytes decompressed")]
    TooLarge,
    /// The decompressed block does not parse as SPDY/3 name/value pairs.
    #[error("malformed header block: {0}")]
    Malformed(&'static str),
}

/// The words of the SPDY/3 header dictionary, each sent with a 4-byte length prefix.
const DICTIONARY_WORDS: [&str; 65] = [
    "options",
    "head",
    "post",
    "put",
    "delete",
    "trace",
    "accept",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "age",
    "allow",
    "authorization",
    "cache-control",
    "connection",
    "content-base",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-md5",
    "content-range",
    "content-type",
    "date",
    "etag",
    "expect",
    "expires",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "location",
    "max-forwards",
    "pragma",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "referer",
    "retry-after",
    "server",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "user-agent",
    "vary",
    "via",
    "warning",
    "www-authenticate",
    "method",
    "get",
    "status",
    "200 OK",
    "version",
    "HTTP/1.1",
    "url",
    "public",
    "set-cookie",
    "keep-alive",
    "origin",
];

/// The tail of the SPDY/3 dictionary, appended without a length prefix.
const DICTIONARY_TAIL: &str = concat!(
    "100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505",
    "203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request",
    "401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented",
    "503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 ",
    "Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,image/png,image/jpg,image/gif,",
    "application/xml,application/xhtml+xml,text/plain,text/javascript,publicprivatemax-age=",
    "gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0.",
);

const DICTIONARY_LEN: usize = dictionary_len();

/// The SPDY/3 header compression dictionary (spec section 2.6.10.1), 1423 bytes.
pub static DICTIONARY: [u8; DICTIONARY_LEN] = build_dictionary();

const fn dictionary_len() -> usize {
    let mut len = DICTIONARY_TAIL.len();
    let mut i = 0;
    while i < DICTIONARY_WORDS.len() {
        len += 4 + DICTIONARY_WORDS[i].len();
        i += 1;
    }
    len
}

const fn build_dictionary() -> [u8; DICTIONARY_LEN] {
    let mut out = [0u8; DICTIONARY_LEN];
    let mut at = 0;
    let mut i = 0;
    while i < DICTIONARY_WORDS.len() {
        let word = DICTIONARY_WORDS[i].as_bytes();
        let prefix = (word.len() as u32).to_be_bytes();
        let mut k = 0;
        while k < 4 {
            out[at] = prefix[k];
            at += 1;
            k += 1;
        }
        let mut k = 0;
        while k < word.len() {
            out[at] = word[k];
            at += 1;
            k += 1;
        }
        i += 1;
    }
    let tail = DICTIONARY_TAIL.as_bytes();
    let mut k = 0;
    while k < tail.len() {
        out[at] = tail[k];
        at += 1;
        k += 1;
    }
    out
}

/// Compresses the header blocks one side sends.
pub struct HeaderEncoder {
    zlib: Compress,
}

impl std::fmt::Debug for HeaderEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeaderEncoder").finish_non_exhaustive()
    }
}

impl HeaderEncoder {
    /// A deflater primed with the SPDY/3 dictionary.
    pub fn new() -> Result<Self, HeaderError> {
        let mut zlib = Compress::new(Compression::default(), true);
        zlib.set_dictionary(&DICTIONARY)
            .map_err(|e| HeaderError::Zlib(e.to_string()))?;
        Ok(Self { zlib })
    }

    /// Appends the compressed block for `headers` (names lowercased) to `out`.
    pub fn encode(
        &mut self,
        headers: &[(String, String)],
        out: &mut Vec<u8>,
    ) -> Result<(), HeaderError> {
        let mut plain = Vec::new();
        let count =
            u32::try_from(headers.len()).map_err(|_| HeaderError::Malformed("too many headers"))?;
        plain.extend_from_slice(&count.to_be_bytes());
        for (name, value) in headers {
            for field in [name.to_ascii_lowercase().as_bytes(), value.as_bytes()] {
                let len = u32::try_from(field.len())
                    .map_err(|_| HeaderError::Malformed("header too long"))?;
                plain.extend_from_slice(&len.to_be_bytes());
                plain.extend_from_slice(field);
            }
        }
        let mut input = plain.as_slice();
        loop {
            // Room for the worst case of one round, so a short output buffer never ends the loop early.
            out.reserve(input.len() + 64);
            let before_in = self.zlib.total_in();
            let before_out = self.zlib.total_out();
            self.zlib
                .compress_vec(input, out, FlushCompress::Sync)
                .map_err(|e| HeaderError::Zlib(e.to_string()))?;
            let consumed = usize::try_from(self.zlib.total_in() - before_in)
                .map_err(|_| HeaderError::Malformed("zlib counter overflow"))?;
            input = &input[consumed..];
            let produced = self.zlib.total_out() - before_out;
            // A sync flush is complete once all input is taken and the output was not cut short.
            if input.is_empty() && out.len() < out.capacity() {
                return Ok(());
            }
            if consumed == 0 && produced == 0 {
                return Err(HeaderError::Zlib("deflate made no progress".into()));
            }
        }
    }
}

/// Decompresses the header blocks the peer sends.
pub struct HeaderDecoder {
    zlib: Decompress,
}

impl std::fmt::Debug for HeaderDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeaderDecoder").finish_non_exhaustive()
    }
}

impl Default for HeaderDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl HeaderDecoder {
    /// An inflater that supplies the SPDY/3 dictionary when the stream asks for it.
    pub fn new() -> Self {
        Self {
            zlib: Decompress::new(true),
        }
    }

    /// Decodes one compressed block into lowercase-named pairs; NUL-separated values stay joined.
    pub fn decode(&mut self, block: &[u8]) -> Result<Vec<(String, String)>, HeaderError> {
        let plain = self.inflate(block)?;
        parse_pairs(&plain)
    }

    fn inflate(&mut self, mut input: &[u8]) -> Result<Vec<u8>, HeaderError> {
        let mut out: Vec<u8> = Vec::with_capacity(input.len().saturating_mul(4).min(16 * 1024));
        loop {
            if out.len() == out.capacity() {
                if out.len() >= MAX_DECOMPRESSED_HEADERS {
                    return Err(HeaderError::TooLarge);
                }
                // Exact, so that the amortized growth of `reserve` cannot pass the limit.
                out.reserve_exact(
                    out.len()
                        .max(1024)
                        .min(MAX_DECOMPRESSED_HEADERS - out.len()),
                );
            }
            let before_in = self.zlib.total_in();
            let before_out = self.zlib.total_out();
            let result = self
                .zlib
                .decompress_vec(input, &mut out, FlushDecompress::Sync);
            let consumed = usize::try_from(self.zlib.total_in() - before_in)
                .map_err(|_| HeaderError::Malformed("zlib counter overflow"))?;
            input = &input[consumed..];
            let produced = self.zlib.total_out() - before_out;
            match result {
                Ok(Status::StreamEnd) => {
                    // The peer must keep one zlib stream open for the whole connection.
                    return Err(HeaderError::Zlib("zlib stream ended".into()));
                }
                Ok(_) => {}
                Err(e) if e.needs_dictionary().is_some() => {
                    self.zlib
                        .set_dictionary(&DICTIONARY)
                        .map_err(|e| HeaderError::Zlib(e.to_string()))?;
                    continue;
                }
                Err(e) => return Err(HeaderError::Zlib(e.to_string())),
            }
            if input.is_empty() && out.len() < out.capacity() {
                return Ok(out);
            }
            if consumed == 0 && produced == 0 && out.len() < out.capacity() {
                return Err(HeaderError::Zlib("inflate made no progress".into()));
            }
        }
    }
}

fn parse_pairs(mut plain: &[u8]) -> Result<Vec<(String, String)>, HeaderError> {
    let count = take_u32(&mut plain)?;
    if count > MAX_PAIRS {
        return Err(HeaderError::Malformed("too many header pairs"));
    }
    let mut pairs = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let name = take_string(&mut plain)?;
        if name.is_empty() {
            return Err(HeaderError::Malformed("empty header name"));
        }
        let value = take_string(&mut plain)?;
        // Go's framer lowercases names it receives; matching is case-insensitive anyway.
        pairs.push((name.to_ascii_lowercase(), value));
    }
    if !plain.is_empty() {
        return Err(HeaderError::Malformed("trailing bytes after header pairs"));
    }
    Ok(pairs)
}

fn take_u32(buf: &mut &[u8]) -> Result<u32, HeaderError> {
    let (head, rest) = buf
        .split_first_chunk::<4>()
        .ok_or(HeaderError::Malformed("truncated length"))?;
    *buf = rest;
    Ok(u32::from_be_bytes(*head))
}

fn take_string(buf: &mut &[u8]) -> Result<String, HeaderError> {
    let len = take_u32(buf)? as usize;
    if len > buf.len() {
        return Err(HeaderError::Malformed("length past end of block"));
    }
    let (field, rest) = buf.split_at(len);
    *buf = rest;
    String::from_utf8(field.to_vec()).map_err(|_| HeaderError::Malformed("header is not UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adler32(data: &[u8]) -> u32 {
        let (mut a, mut b) = (1u32, 0u32);
        for &byte in data {
            a = (a + u32::from(byte)) % 65521;
            b = (b + a) % 65521;
        }
        (b << 16) | a
    }

    #[test]
    fn dictionary_matches_the_spec() {
        assert_eq!(DICTIONARY.len(), 1423);
        // The dictionary id every SPDY/3 peer puts in its first zlib header.
        assert_eq!(adler32(&DICTIONARY), 0xe3c6_a7c2);
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn blocks_round_trip_on_one_zlib_stream() {
        let mut enc = HeaderEncoder::new().unwrap();
        let mut dec = HeaderDecoder::new();
        let cases = [
            pairs(&[]),
            pairs(&[
                ("streamtype", "error"),
                ("port", "8080"),
                ("requestid", "0"),
            ]),
            pairs(&[("streamtype", "stdout")]),
            pairs(&[("x-multi", "a\0b"), ("empty", "")]),
            pairs(&[("big", &"v".repeat(10_000))]),
        ];
        for case in &cases {
            let mut block = Vec::new();
            enc.encode(case, &mut block).unwrap();
            assert_eq!(&dec.decode(&block).unwrap(), case);
        }
    }

    #[test]
    fn names_are_lowercased_on_the_wire() {
        let mut enc = HeaderEncoder::new().unwrap();
        let mut block = Vec::new();
        enc.encode(&pairs(&[("StreamType", "data")]), &mut block)
            .unwrap();
        let got = HeaderDecoder::new().decode(&block).unwrap();
        assert_eq!(got, pairs(&[("streamtype", "data")]));
    }

    #[test]
    fn bad_blocks_are_errors() {
        let mut dec = HeaderDecoder::new();
        assert!(dec.decode(b"not zlib at all").is_err());
        // A zlib stream primed with a different dictionary.
        let mut other = Compress::new(Compression::default(), true);
        other.set_dictionary(b"some other dictionary").unwrap();
        let mut block = Vec::with_capacity(64);
        other
            .compress_vec(&[0, 0, 0, 0], &mut block, FlushCompress::Sync)
            .unwrap();
        assert!(HeaderDecoder::new().decode(&block).is_err());
    }

    #[test]
    fn a_stream_keeps_at_most_16_kib_of_headers() {
        // A stream's headers live as long as it does, on each of MAX_STREAMS streams.
        for (value, fits) in [(15 * 1024, true), (17 * 1024, false)] {
            let mut block = Vec::new();
            HeaderEncoder::new()
                .unwrap()
                .encode(&pairs(&[("big", &"v".repeat(value))]), &mut block)
                .unwrap();
            let decoded = HeaderDecoder::new().decode(&block).map(|_| ());
            assert_eq!(decoded.is_ok(), fits, "{value} bytes: {decoded:?}");
        }
    }

    #[test]
    fn zlib_bombs_are_capped() {
        let mut enc = HeaderEncoder::new().unwrap();
        let mut block = Vec::new();
        enc.encode(
            &pairs(&[("bomb", &"\0".repeat(2 * MAX_DECOMPRESSED_HEADERS))]),
            &mut block,
        )
        .unwrap();
        assert_eq!(
            HeaderDecoder::new().decode(&block),
            Err(HeaderError::TooLarge)
        );
    }
}
