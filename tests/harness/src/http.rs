//! One plain HTTP/1.1 exchange with a local server, for tests of the binaries' own HTTP
//! endpoints (the extender's, the webhook's health and metrics): no client library, so a
//! test sees exactly the status and body the server wrote.

use anyhow::{Context, Result};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Writes one request on `stream` (a JSON body, `Connection: close`) and reads the answer
/// to its end: the status (0 if the answer has none) and the body.
pub async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, String)> {
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .await
        .with_context(|| format!("sending {method} {path}"))?;
    let mut response = Vec::new();
    // A server that closes without a clean TLS shutdown still said what it had to say.
    let _ = stream.read_to_end(&mut response).await;
    let response = String::from_utf8_lossy(&response);
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// [`exchange`] over a fresh plain connection to `127.0.0.1:port`.
pub async fn request(port: u16, method: &str, path: &str, body: &str) -> Result<(u16, String)> {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .with_context(|| format!("connecting to 127.0.0.1:{port}"))?;
    exchange(stream, method, path, body).await
}
