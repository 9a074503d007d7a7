//! A fault-injecting proxy in front of one API server, on loopback: clients talk plain HTTP
//! to it (a kubeconfig with an `http://` server and no credentials), and it forwards each
//! request with the cluster's admin identity. While a fault is set, a share of requests is
//! answered 429 (with `Retry-After: 1`), 500 or 503, cut off without an answer, or delayed;
//! it counts every request it receives, so a test can bound a client's request rate
//! during the storm.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use kube::Client;
use kube::client::Body;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// What the proxy does to the requests a fault hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Forward everything.
    None,
    /// Answer `429 Too Many Requests` with `Retry-After: 1`.
    TooManyRequests,
    /// Answer `500 Internal Server Error`.
    InternalError,
    /// Answer `503 Service Unavailable`.
    Unavailable,
    /// Close the connection without an answer.
    Reset,
    /// Forward after this delay.
    Delay(Duration),
    /// 429, 500, 503 and resets in turn.
    Mixed,
}

#[derive(Debug)]
struct State {
    fault: Fault,
    /// Out of every 100 requests, how many the fault hits.
    percent: u64,
}

/// A running proxy; dropping it stops it.
pub struct FaultProxy {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    state: Arc<Mutex<State>>,
    received: Arc<AtomicU64>,
    faulted: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FaultProxy {
    /// Starts a proxy forwarding to the API server `upstream` is a client of.
    pub async fn start(upstream: Client) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding the fault proxy")?;
        let address: SocketAddr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State {
            fault: Fault::None,
            percent: 0,
        }));
        let received = Arc::new(AtomicU64::new(0));
        let faulted = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(serve(
            listener,
            upstream,
            state.clone(),
            received.clone(),
            faulted.clone(),
        ));
        Ok(Self {
            url: format!("http://{address}"),
            state,
            received,
            faulted,
            task,
        })
    }

    /// From now on, `percent` of requests (0–100) get `fault`.
    pub fn set(&self, fault: Fault, percent: u64) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.fault = fault;
        state.percent = percent.min(100);
    }

    /// Requests received so far.
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Requests a fault hit so far.
    pub fn faulted(&self) -> u64 {
        self.faulted.load(Ordering::Relaxed)
    }

    /// Writes a kubeconfig pointing at the proxy (no credentials: it adds its own).
    pub fn write_kubeconfig(&self, path: &Path) -> Result<PathBuf> {
        let config = serde_json::json!({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "proxy", "cluster": {"server": self.url}}],
            "users": [{"name": "proxy", "user": {}}],
            "contexts": [{"name": "proxy", "context": {"cluster": "proxy", "user": "proxy"}}],
            "current-context": "proxy",
        });
        std::fs::write(path, config.to_string())
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(path.to_owned())
    }
}

async fn serve(
    listener: TcpListener,
    upstream: Client,
    state: Arc<Mutex<State>>,
    received: Arc<AtomicU64>,
    faulted: Arc<AtomicU64>,
) {
    while let Ok((stream, _)) = listener.accept().await {
        let upstream = upstream.clone();
        let state = state.clone();
        let received = received.clone();
        let faulted = faulted.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let n = received.fetch_add(1, Ordering::Relaxed);
                let (fault, percent) = {
                    let state = state.lock().unwrap_or_else(|e| e.into_inner());
                    (state.fault, state.percent)
                };
                // Spread evenly: request n is hit when its share crosses a whole request.
                let hit = fault != Fault::None && (n * percent) / 100 != ((n + 1) * percent) / 100;
                if hit {
                    faulted.fetch_add(1, Ordering::Relaxed);
                }
                let fault = if hit { fault } else { Fault::None };
                let upstream = upstream.clone();
                async move { answer(upstream, request, fault, n).await }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Why a request got no answer (hyper closes the connection on a service error).
#[derive(Debug, thiserror::Error)]
enum ProxyError {
    /// The fault: cut off on purpose.
    #[error("connection reset by the fault proxy")]
    Reset,
    /// The request could not be read.
    #[error("reading the request: {0}")]
    Read(#[from] hyper::Error),
    /// The forwarded request or the answer could not be built.
    #[error("building a request or answer: {0}")]
    Build(#[from] http::Error),
    /// The API server could not be reached.
    #[error("forwarding: {0}")]
    Upstream(#[from] kube::Error),
}

async fn answer(
    upstream: Client,
    request: hyper::Request<Incoming>,
    fault: Fault,
    n: u64,
) -> Result<hyper::Response<Body>, ProxyError> {
    let fault = match fault {
        Fault::Mixed => [
            Fault::TooManyRequests,
            Fault::InternalError,
            Fault::Unavailable,
            Fault::Reset,
        ][usize::try_from(n % 4).unwrap_or_default()],
        other => other,
    };
    let status = match fault {
        Fault::TooManyRequests => Some(429),
        Fault::InternalError => Some(500),
        Fault::Unavailable => Some(503),
        Fault::Reset => return Err(ProxyError::Reset),
        Fault::Delay(delay) => {
            tokio::time::sleep(delay).await;
            None
        }
        Fault::None | Fault::Mixed => None,
    };
    if let Some(code) = status {
        let body = serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure",
            "message": "injected by the fault proxy", "code": code,
        });
        let mut response = hyper::Response::builder()
            .status(code)
            .header("content-type", "application/json");
        if code == 429 {
            response = response.header("retry-after", "1");
        }
        return Ok(response.body(Body::from(Bytes::from(body.to_string())))?);
    }
    let (parts, body) = request.into_parts();
    let body = body.collect().await?.to_bytes();
    let mut forwarded = http::Request::builder().method(parts.method).uri(
        parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_owned(),
    );
    for (name, value) in &parts.headers {
        if name != http::header::HOST && name != http::header::AUTHORIZATION {
            forwarded = forwarded.header(name, value);
        }
    }
    let forwarded = forwarded.body(Body::from(body))?;
    Ok(upstream.send(forwarded).await?)
}
