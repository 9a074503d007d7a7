//! HTTPS wiring: the routes, the admission handler around the pure core, and the TLS accept
//! loop with drain-style shutdown.

use std::sync::Arc;
use std::sync::atomic::Ordering;
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
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::daemonset;
use crate::memory::DeschedulerMemory;
use crate::metrics::Metrics;
use crate::mutate::{self, Decision, MutateConfig, SelectedNodes};
use crate::review::{self, BadReview};

/// Largest request body read by default: an UPDATE review carries two pods of up to
/// 1.5 MiB (etcd's object limit) each.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;
/// A client that has not finished its TLS handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A client that has not sent its request headers by then is dropped.
const HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long shutdown waits for requests in flight.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// The state every request shares.
pub struct App {
    /// What to do to pods.
    pub config: MutateConfig,
    /// Descheduled nodes per owner.
    pub memory: DeschedulerMemory,
    /// The PVC lookup.
    pub volumes: Arc<dyn SelectedNodes + Send + Sync>,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Larger bodies get HTTP 400.
    pub max_body_bytes: usize,
}

/// Routes: `POST /mutate`, `GET /healthz`, `GET /readyz`, `GET /metrics`.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/mutate", post(mutate))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(app)
}

async fn readyz(State(app): State<Arc<App>>) -> Response {
    if app.metrics.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ok").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "PVC cache not synced yet").into_response()
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.metrics.render(),
    )
        .into_response()
}

async fn mutate(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let response = match read_body(&headers, body, app.max_body_bytes).await {
        Ok(bytes) => answer(&app, &bytes),
        Err(bad) => bad_request(&app, &bad),
    };
    app.metrics.observe(started.elapsed());
    response
}

/// Reads at most `limit` bytes, refusing a larger declared length before reading any.
async fn read_body(headers: &HeaderMap, body: Body, limit: usize) -> Result<Vec<u8>, BadReview> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|len| len > limit) {
        return Err(BadReview::TooLarge { limit });
    }
    let mut bytes = Vec::with_capacity(declared.unwrap_or(0));
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| BadReview::Read(e.to_string()))?;
        if bytes.len() + chunk.len() > limit {
            return Err(BadReview::TooLarge { limit });
        }
        bytes.extend_from_slice(&chunk);
    }
    Ok(bytes)
}

fn bad_request(app: &App, bad: &BadReview) -> Response {
    app.metrics.bad_requests.inc();
    warn!(error = %bad, "bad admission request");
    (StatusCode::BAD_REQUEST, format!("{bad}\n")).into_response()
}

/// Decodes, admits and encodes one review.
pub fn answer(app: &App, body: &[u8]) -> Response {
    let request = match review::decode(body) {
        Ok(request) => request,
        Err(bad) => return bad_request(app, &bad),
    };
    // Routed by the object's kind: pods get the burst mutation, DaemonSets are kept off
    // virtual nodes (see `daemonset`).
    let (outcome, kind) = if daemonset::is_daemonset(&request) {
        (daemonset::admit(&request), "DaemonSet")
    } else {
        let outcome = mutate::admit(
            &request,
            &app.config,
            &app.memory,
            app.volumes.as_ref(),
            Instant::now(),
        );
        (outcome, "Pod")
    };
    app.metrics.decided(outcome.decision);
    let object = || request.object_ref();
    if !outcome.warnings.is_empty() && outcome.decision != Decision::Unreadable {
        app.metrics.warnings.inc_by(outcome.warnings.len() as u64);
        warn!(object = %object(), kind, cluster = "upper", warnings = ?outcome.warnings, "admitted with warnings");
    }
    match outcome.decision {
        Decision::Mutated => {
            info!(object = %object(), kind, cluster = "upper", ops = outcome.patch.0.len(), reason = outcome.reason, "mutated")
        }
        Decision::Remembered => {
            info!(object = %object(), kind, cluster = "upper", "descheduled node remembered")
        }
        Decision::Unreadable => {
            app.metrics.warnings.inc_by(outcome.warnings.len() as u64);
            warn!(object = %object(), kind, cluster = "upper", warnings = ?outcome.warnings, "allowed unchanged");
        }
        Decision::Ignored | Decision::Unchanged => {
            debug!(object = %object(), kind, cluster = "upper", operation = %request.operation, reason = outcome.reason, "allowed unchanged");
        }
    }
    match review::encode(&request.uid, &outcome.patch, &outcome.warnings) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        // Serialising plain values cannot fail; should it, allow the request unchanged
        // rather than fail it.
        Err(error) => {
            warn!(%error, "cannot encode the response; allowing unchanged");
            let empty = json_patch::Patch(Vec::new());
            let body = review::encode(&request.uid, &empty, &[]).unwrap_or_default();
            ([(header::CONTENT_TYPE, "application/json")], body).into_response()
        }
    }
}

/// Serves `router` over TLS on `listener` until `shutdown`, then stops accepting, lets
/// requests in flight finish (up to 10 s) and returns.
pub async fn serve_tls(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    router: Router,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    let acceptor = TlsAcceptor::from(tls);
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
        let (acceptor, router, metrics, shutdown) = (
            acceptor.clone(),
            router.clone(),
            metrics.clone(),
            shutdown.clone(),
        );
        connections.spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(error)) => {
                    metrics.tls_handshake_errors.inc();
                    debug!(%peer, %error, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    metrics.tls_handshake_errors.inc();
                    debug!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(tls), TowerToHyperService::new(router));
            let mut connection = std::pin::pin!(connection);
            let result = tokio::select! {
                result = connection.as_mut() => result,
                () = shutdown.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(error) = result {
                debug!(%peer, %error, "connection ended with an error");
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
}
