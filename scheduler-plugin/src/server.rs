//! HTTP(S) wiring: the routes around the pure filter / prioritize, and an accept loop
//! (plain or TLS) with drain-style shutdown.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::extender::Extender;
use crate::metrics::Metrics;
use crate::wire::{self, BadArgs, ExtenderArgs, ExtenderFilterResult};

/// Largest request body read: `Nodes` mode carries every candidate Node in full.
pub const MAX_BODY_BYTES: usize = 64 << 20;
/// A client that has not sent its request headers by then is dropped.
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// A client that has not finished its TLS handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long shutdown waits for requests in flight.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// The state every request shares.
#[derive(Debug)]
pub struct App {
    /// The caches and the fit.
    pub extender: Extender,
    /// Counters.
    pub metrics: Metrics,
}

/// Routes: `POST /filter`, `POST /prioritize` (the verbs to configure in
/// `KubeSchedulerConfiguration.extenders`), `GET /healthz`, `/readyz`, `/metrics`.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/filter", post(filter))
        .route("/prioritize", post(prioritize))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(app)
}

async fn readyz(State(app): State<Arc<App>>) -> Response {
    match app.extender.ready() {
        Ok(()) => (StatusCode::OK, "ok").into_response(),
        Err(waiting) => (StatusCode::SERVICE_UNAVAILABLE, format!("{waiting}\n")).into_response(),
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.metrics.render(&app.extender),
    )
        .into_response()
}

async fn filter(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let response = match read_args(&headers, body).await {
        Ok(args) => {
            let (result, outcomes) = app.extender.filter(&args);
            app.metrics.decided(&outcomes);
            log_filter(&args, &result);
            json(StatusCode::OK, &result)
        }
        Err(bad) => {
            app.metrics.bad_request("filter");
            warn!(error = %bad, "bad filter request");
            let result = ExtenderFilterResult {
                error: bad.to_string(),
                ..ExtenderFilterResult::default()
            };
            json(StatusCode::BAD_REQUEST, &result)
        }
    };
    app.metrics.observe("filter", started.elapsed());
    response
}

fn log_filter(args: &ExtenderArgs, result: &ExtenderFilterResult) {
    let failed = result.failed_nodes.len() + result.failed_and_unresolvable_nodes.len();
    if failed == 0 {
        return;
    }
    let meta = args.pod.as_ref().map(|p| &p.metadata);
    let pod = format!(
        "{}/{}",
        meta.and_then(|m| m.namespace.as_deref())
            .unwrap_or_default(),
        meta.and_then(|m| m.name.as_deref()).unwrap_or_default()
    );
    for (node, reason) in result
        .failed_nodes
        .iter()
        .chain(&result.failed_and_unresolvable_nodes)
    {
        debug!(%pod, %node, %reason, "filtered out");
    }
}

async fn prioritize(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let response = match read_args(&headers, body).await {
        Ok(args) => json(StatusCode::OK, &app.extender.prioritize(&args)),
        Err(bad) => {
            app.metrics.bad_request("prioritize");
            warn!(error = %bad, "bad prioritize request");
            json(
                StatusCode::BAD_REQUEST,
                &serde_json::json!({"Error": bad.to_string()}),
            )
        }
    };
    app.metrics.observe("prioritize", started.elapsed());
    response
}

fn json(status: StatusCode, value: &impl serde::Serialize) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => (status, [(header::CONTENT_TYPE, "application/json")], body).into_response(),
        // Serialising plain values cannot fail; should it, say so rather than panic.
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

/// Reads at most [`MAX_BODY_BYTES`] and decodes them.
async fn read_args(headers: &HeaderMap, body: Body) -> Result<ExtenderArgs, BadArgs> {
    let limit = MAX_BODY_BYTES;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|len| len > limit) {
        return Err(BadArgs::TooLarge { limit });
    }
    let mut bytes = Vec::with_capacity(declared.unwrap_or(0));
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| BadArgs::Read(e.to_string()))?;
        if bytes.len() + chunk.len() > limit {
            return Err(BadArgs::TooLarge { limit });
        }
        bytes.extend_from_slice(&chunk);
    }
    wire::decode(&bytes)
}

/// Why the serving certificate could not be loaded.
#[derive(thiserror::Error, Debug)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The PEM could not be parsed.
    #[error("{path}: {source}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// Why.
        source: rustls_pki_types::pem::Error,
    },
    /// rustls refused the pair.
    #[error("{cert} / {key}: {source}")]
    Rustls {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// Why.
        source: rustls::Error,
    },
}

/// A TLS acceptor serving HTTP/1.1 with the PEM certificate chain and key.
pub fn tls_acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, TlsError> {
    let read = |path: &Path| {
        std::fs::read(path).map_err(|source| TlsError::Read {
            path: path.to_owned(),
            source,
        })
    };
    let (cert_pem, key_pem) = (read(cert)?, read(key)?);
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            path: cert.to_owned(),
            source,
        })?;
    let private = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|source| TlsError::Pem {
        path: key.to_owned(),
        source,
    })?;
    let rustls_error = |source| TlsError::Rustls {
        cert: cert.to_owned(),
        key: key.to_owned(),
        source,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(rustls_error)?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(rustls_error)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Serves `router` on `listener` (over TLS when `tls` is given) until `shutdown`, then
/// stops accepting, lets requests in flight finish (up to 10 s) and returns.
pub async fn serve(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    router: Router,
    shutdown: CancellationToken,
) {
    let connections = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of file descriptors and the like: pause rather than spin.
                warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (tls, router, shutdown) = (tls.clone(), router.clone(), shutdown.clone());
        connections.spawn(async move {
            match tls {
                None => serve_connection(TokioIo::new(stream), router, shutdown).await,
                Some(acceptor) => {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            serve_connection(TokioIo::new(stream), router, shutdown).await;
                        }
                        Ok(Err(error)) => debug!(%peer, %error, "TLS handshake failed"),
                        Err(_) => debug!(%peer, "TLS handshake timed out"),
                    }
                }
            }
        });
    }
    connections.close();
    if tokio::time::timeout(DRAIN_TIMEOUT, connections.wait())
        .await
        .is_err()
    {
        warn!("requests still in flight after {DRAIN_TIMEOUT:?}; stopping anyway");
    }
    info!("stopped serving");
}

async fn serve_connection<S>(io: TokioIo<S>, router: Router, shutdown: CancellationToken)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .serve_connection(io, TowerToHyperService::new(router));
    let mut connection = std::pin::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        () = shutdown.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(error) = result {
        debug!(%error, "connection ended with an error");
    }
}
