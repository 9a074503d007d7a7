//! Kubelet API served by virtual-node (logs, exec, attach, port-forward, pods, stats,
//! resource metrics),
//! proxied to the lower cluster: kube-apiserver reaches it at the node's daemon endpoint.

pub mod auth;
pub mod node_ports;
pub mod resource_metrics;
pub mod resource_scrape;
pub mod route;
pub mod spdy;
pub mod streams;
pub mod tunnel;
pub mod websocket;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, ListParams, LogParams};
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::translate::meta::{Owner, UPPER_UID_ANNOTATION};
use auth::{Authenticator, Refused, RequestClientCert};
use resource_metrics::PodName;
use route::{Route, Target};

/// How long a client has to send its request headers (hyper's own default, which needs a
/// timer to apply).
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

type Body = UnsyncBoxBody<Bytes, std::io::Error>;

/// The serving certificate: from files, or generated at start.
#[derive(Clone, Debug)]
pub struct ServingCert {
    /// PEM certificate chain (`APISERVER_CERT_LOCATION`).
    pub cert: Option<PathBuf>,
    /// PEM private key (`APISERVER_KEY_LOCATION`).
    pub key: Option<PathBuf>,
    /// Names and addresses a generated certificate is valid for.
    pub sans: Vec<String>,
}

/// Why the kubelet API cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A certificate or key could not be read or used.
    #[error("kubelet API certificate: {0}")]
    Certificate(String),
    /// The port is taken.
    #[error("cannot listen on the kubelet port {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// The TLS configuration: the serving certificate, and client certificates requested.
pub fn tls_config(cert: &ServingCert, auth: &Authenticator) -> Result<ServerConfig, StartError> {
    let bad = |e: &dyn std::fmt::Display| StartError::Certificate(e.to_string());
    let (chain, key) = match (&cert.cert, &cert.key) {
        (Some(cert_path), Some(key_path)) => {
            let chain = CertificateDer::pem_file_iter(cert_path)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| bad(&format!("{}: {e}", cert_path.display())))?;
            let key = PrivateKeyDer::from_pem_file(key_path)
                .map_err(|e| bad(&format!("{}: {e}", key_path.display())))?;
            (chain, key)
        }
        (None, None) => {
            let generated =
                rcgen::generate_simple_self_signed(cert.sans.clone()).map_err(|e| bad(&e))?;
            info!(
                names = ?cert.sans,
                "kubelet API: no APISERVER_CERT_LOCATION/APISERVER_KEY_LOCATION, serving a \
                 self-signed certificate (the upper API server accepts it only without \
                 --kubelet-certificate-authority)"
            );
            let key = PrivateKeyDer::try_from(generated.signing_key.serialize_der())
                .map_err(|e| bad(&e))?;
            (vec![generated.cert.der().clone()], key)
        }
        _ => {
            return Err(StartError::Certificate(
                "set both the certificate and the key (APISERVER_CERT_LOCATION and \
                 APISERVER_KEY_LOCATION), or neither"
                    .into(),
            ));
        }
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(&e))?;
    let builder = match auth.handshake_verifier() {
        Some(verifier) => {
            builder.with_client_cert_verifier(Arc::new(RequestClientCert::new(verifier)))
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| bad(&e))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// What every request handler needs.
pub struct KubeletApi {
    /// The lower cluster, where the calls go.
    pub lower: Client,
    /// This virtual node of this upper cluster: the marks of the pods it serves.
    pub owner: Owner,
    /// Who may call.
    pub auth: Authenticator,
    /// `/metrics/resource` and the counters it keeps between scrapes.
    pub resource_metrics: resource_scrape::ResourceMetrics,
    /// With `--lower-namespace`, the member's namespace mapping: `lower` speaks upper
    /// names, except in what the kubelets and the metrics API say.
    pub namespaces: Option<Arc<crate::lower_view::NamespaceView>>,
    /// The member's lower pods, as its pod watch keeps them (what `/metrics/resource`
    /// reads instead of listing them).
    pub lower_pods: resource_scrape::LowerPods,
}

/// The lower pod an upper pod is mirrored to: the same namespace and name today. Every
/// kubelet API path maps names through this and [`upper_pod`], so that a namespace
/// remapping changes only these two.
pub fn lower_pod(upper: &PodName) -> PodName {
    upper.clone()
}

/// The lower pod of the upper pod a kubelet API call names.
fn lower_target(target: &Target) -> PodName {
    lower_pod(&PodName::new(&target.namespace, &target.pod))
}

/// The upper pod a lower pod mirrors (the inverse of [`lower_pod`]).
pub fn upper_pod(lower: &PodName) -> PodName {
    lower.clone()
}

impl std::fmt::Debug for KubeletApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeletApi")
            .field("node", &self.owner.node)
            .finish_non_exhaustive()
    }
}

/// Binds the kubelet port.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, StartError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind { addr, source })
}

/// A kubelet port of one virtual node of a member (`--kubelet-port-range`): the calls
/// that name no pod are that node's (authorized on its name; `/metrics/resource`,
/// `/stats/summary` and `/pods` keep to the pods bound to it).
#[derive(Debug)]
pub struct NodeScope {
    /// The virtual node.
    pub node: String,
    /// Its `/metrics/resource`, with its own node series.
    pub resource_metrics: resource_scrape::ResourceMetrics,
}

impl NodeScope {
    /// The port of virtual node `node`.
    pub fn new(node: &str) -> Self {
        Self {
            node: node.to_owned(),
            resource_metrics: resource_scrape::ResourceMetrics::default(),
        }
    }
}

/// Serves until `shutdown`; connections in flight are dropped then.
pub async fn serve(
    listener: tokio::net::TcpListener,
    tls: ServerConfig,
    api: Arc<KubeletApi>,
    shutdown: CancellationToken,
) {
    serve_scoped(listener, tls, api, None, shutdown).await;
}

/// [`serve`], for one virtual node where `scope` says which.
async fn serve_scoped(
    listener: tokio::net::TcpListener,
    tls: ServerConfig,
    api: Arc<KubeletApi>,
    scope: Option<Arc<NodeScope>>,
    shutdown: CancellationToken,
) {
    let acceptor = TlsAcceptor::from(Arc::new(tls));
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(error) => {
                warn!(%error, "kubelet API: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        // A peer that vanished (exec, port-forward sessions last long) is noticed.
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(30))
            .with_interval(Duration::from_secs(10));
        let _ = socket2::SockRef::from(&tcp).set_tcp_keepalive(&keepalive);
        let (acceptor, api, scope) = (acceptor.clone(), api.clone(), scope.clone());
        connections.spawn(
            async move {
                let tls = match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp))
                    .await
                {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(error)) => {
                        debug!(%error, "TLS handshake failed");
                        return;
                    }
                    Err(_) => return,
                };
                let certs: Option<Arc<Vec<CertificateDer<'static>>>> = tls
                    .get_ref()
                    .1
                    .peer_certificates()
                    .map(|c| Arc::new(c.to_vec()));
                let service = hyper::service::service_fn(move |req| {
                    let (api, certs, scope) = (api.clone(), certs.clone(), scope.clone());
                    async move {
                        Ok::<_, Infallible>(
                            handle(api, scope.as_deref(), certs.as_deref(), req).await,
                        )
                    }
                });
                let served = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(HEADER_READ_TIMEOUT)
                    .serve_connection(TokioIo::new(tls), service)
                    .with_upgrades()
                    .await;
                if let Err(error) = served {
                    debug!(%error, "kubelet API connection ended");
                }
            }
            .instrument(info_span!("kubelet_api", %peer)),
        );
        while connections.try_join_next().is_some() {}
    }
    connections.abort_all();
}

fn text(status: StatusCode, message: impl Into<String>) -> Response<Body> {
    let mut response = Response::new(
        Full::new(Bytes::from(message.into()))
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

fn json(value: &impl serde::Serialize) -> Response<Body> {
    match serde_json::to_vec(value) {
        Ok(bytes) => {
            let mut response = text(StatusCode::OK, String::new());
            *response.body_mut() = Full::new(Bytes::from(bytes))
                .map_err(|never| match never {})
                .boxed_unsync();
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            response
        }
        Err(error) => text(StatusCode::INTERNAL_SERVER_ERROR, error.to_string()),
    }
}

/// An error from the lower API server, with its code and message, as a kubelet would give it.
fn lower_error(what: &str, error: &kube::Error) -> Response<Body> {
    match error {
        kube::Error::Api(status) => text(
            StatusCode::from_u16(status.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            status.message.clone(),
        ),
        other => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("{what} in the lower cluster: {other}"),
        ),
    }
}

async fn handle(
    api: Arc<KubeletApi>,
    scope: Option<&NodeScope>,
    certs: Option<&Vec<CertificateDer<'static>>>,
    req: Request<Incoming>,
) -> Response<Body> {
    let query = route::query_pairs(req.uri().query());
    let Some(route) = route::route(req.uri().path(), &query) else {
        return text(StatusCode::NOT_FOUND, "404 page not found\n");
    };
    if !api.auth.open() {
        let authorization = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        let user = match api.auth.user(certs.map(Vec::as_slice), authorization).await {
            Ok(user) => user,
            Err(refused) => return refusal(&refused),
        };
        let (verb, subresources) = (route::verb(req.method()), route::subresources(&route));
        let node = match call_node(&api, scope, &route).await {
            Ok(node) => node,
            Err(response) => return response,
        };
        if let Err(refused) = api.auth.authorize(&user, &node, verb, subresources).await {
            return refusal(&refused);
        }
    }
    match route {
        Route::Healthz => text(StatusCode::OK, "ok"),
        Route::Pods | Route::RunningPods => pods(&api, scope, route == Route::RunningPods).await,
        Route::StatsSummary => stats_summary(&api, scope).await,
        Route::MetricsResource => {
            let (metrics, node) = match scope {
                Some(scope) => (&scope.resource_metrics, Some(scope.node.as_str())),
                None => (&api.resource_metrics, None),
            };
            let body = metrics
                .scrape(
                    &api.lower,
                    &api.owner,
                    api.namespaces.as_deref(),
                    &api.lower_pods,
                    node,
                )
                .await;
            let mut response = text(StatusCode::OK, body);
            // The kubelet's content type: Prometheus text format 0.0.4.
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            response
        }
        Route::Logs(target) => logs(&api, &target, &query).await,
        Route::Exec(target, command, flags) => {
            if command.is_empty() {
                return text(StatusCode::BAD_REQUEST, "missing command");
            }
            let (pod, container) = (lower_target(&target).name, target.container.clone());
            if websocket::is_upgrade(req.headers()) {
                return upgrade_websocket(
                    &api,
                    req,
                    &target,
                    websocket::EXEC_PROTOCOLS,
                    move |socket, protocol, pods| {
                        websocket::exec(
                            socket,
                            protocol,
                            pods,
                            pod,
                            container,
                            Some(command),
                            flags,
                        )
                    },
                )
                .await;
            }
            upgrade(
                &api,
                req,
                &target,
                "v4.channel.k8s.io",
                move |conn, pods| streams::exec(conn, pods, pod, container, Some(command), flags),
            )
            .await
        }
        Route::Attach(target, flags) => {
            let (pod, container) = (lower_target(&target).name, target.container.clone());
            if websocket::is_upgrade(req.headers()) {
                return upgrade_websocket(
                    &api,
                    req,
                    &target,
                    websocket::EXEC_PROTOCOLS,
                    move |socket, protocol, pods| {
                        websocket::exec(socket, protocol, pods, pod, container, None, flags)
                    },
                )
                .await;
            }
            upgrade(
                &api,
                req,
                &target,
                "v4.channel.k8s.io",
                move |conn, pods| streams::exec(conn, pods, pod, container, None, flags),
            )
            .await
        }
        Route::PortForward(target) => {
            let pod = lower_target(&target).name;
            if websocket::is_upgrade(req.headers()) {
                let ports = match websocket::forwarded_ports(req.uri().query()) {
                    Ok(ports) => ports,
                    Err(message) => return text(StatusCode::BAD_REQUEST, message),
                };
                return upgrade_websocket(
                    &api,
                    req,
                    &target,
                    websocket::PORT_FORWARD_PROTOCOLS,
                    move |socket, protocol, pods| {
                        websocket::port_forward(socket, protocol, pods, pod, ports)
                    },
                )
                .await;
            }
            upgrade(
                &api,
                req,
                &target,
                spdy::PORT_FORWARD_PROTOCOL,
                move |conn, pods| streams::port_forward(conn, pods, pod),
            )
            .await
        }
    }
}

fn refusal(refused: &Refused) -> Response<Body> {
    if let Refused::Review { .. } = refused {
        warn!(error = %refused, "kubelet API: review failed");
    }
    text(refused.status(), refused.to_string())
}

/// Waits (at most 5 s) until the member's pod watches have listed once: which pods are
/// bound to its nodes is known.
async fn synced(api: &KubeletApi) -> Result<(), Response<Body>> {
    let stores = &api.lower_pods;
    if stores.synced.is_ready() {
        return Ok(());
    }
    match tokio::time::timeout(Duration::from_secs(5), stores.synced.wait()).await {
        Ok(Ok(())) => Ok(()),
        _ => Err(text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "node {}: the pods bound to it are not known yet",
                api.owner.node
            ),
        )),
    }
}

/// The node a call is authorized on ([`auth::review_node`]): for a call about a pod, the
/// node its upper pod is bound to (with `node` or `label=<key>` granularity, all the
/// member's virtual nodes share this endpoint, and the path names no node); otherwise
/// the node of the port it came to ([`NodeScope`]), else `--nodename`.
async fn call_node(
    api: &KubeletApi,
    scope: Option<&NodeScope>,
    route: &Route,
) -> Result<String, Response<Body>> {
    let (Route::Logs(target)
    | Route::Exec(target, ..)
    | Route::Attach(target, _)
    | Route::PortForward(target)) = route
    else {
        return Ok(scope.map_or(api.auth.node(), |s| &s.node).to_owned());
    };
    synced(api).await?;
    let bound = api
        .lower_pods
        .upper
        .get(&target.namespace, &target.pod)
        .and_then(|pod| pod.node_name());
    Ok(auth::review_node(api.auth.node(), bound.as_deref()).to_owned())
}

/// The lower pod's API, if the target is a pod this node mirrors (else the kubelet's 404).
/// The lower pod's marks and upper UID are read from the lower store (the watch keeps it
/// current, and a pod a call is about has run for a while), else with a GET: no lower
/// round trip before most calls.
async fn mirrored(api: &KubeletApi, target: &Target) -> Result<Api<Pod>, Response<Body>> {
    let lower = lower_target(target);
    let pods: Api<Pod> = Api::namespaced(api.lower.clone(), &lower.namespace);
    let not_found = || {
        text(
            StatusCode::NOT_FOUND,
            format!(
                "pod \"{}/{}\" does not exist on node {}",
                target.namespace, target.pod, api.owner.node
            ),
        )
    };
    let stores = &api.lower_pods;
    synced(api).await?;
    let (ours, lower_uid) = match stores.store.get(&lower.namespace, &lower.name) {
        Some(stored) => (
            stored.is_owned_by(&api.owner),
            stored.upper_uid().map(|uid| uid.to_string()),
        ),
        None => match pods.get_opt(&lower.name).await {
            Ok(Some(pod)) => {
                let meta = &pod.metadata;
                let uid = meta
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(UPPER_UID_ANNOTATION))
                    .cloned();
                (api.owner.owns(meta.labels.as_ref()), uid)
            }
            Ok(None) => return Err(not_found()),
            Err(error) => return Err(lower_error("reading the pod", &error)),
        },
    };
    let lower_uid = lower_uid.as_deref();
    let bound = stores
        .upper
        .get(&target.namespace, &target.pod)
        .and_then(|p| p.meta.uid().map(|uid| uid.to_string()));
    if serves(ours, lower_uid, bound.as_deref(), target.uid.as_deref()) {
        Ok(pods)
    } else {
        if ours && lower_uid.is_some() {
            warn!(node = %api.owner.node, cluster = "lower",
                pod = %format!("{}/{}", lower.namespace, lower.name), upper_uid = ?lower_uid,
                bound_uid = ?bound, "kubelet API: a lower pod with this node's marks is not the \
                 copy of the upper pod of its name bound here; not served");
        }
        Err(not_found())
    }
}

/// Whether a kubelet API call for an upper pod is served by the lower pod of its name:
/// only where that lower pod carries this node's marks (`ours`) and the upper UID
/// (`lower_uid`) of the upper pod of that name bound to this node (`bound`), and, where
/// the call names a UID (`asked`), that one. Marks and UID are copyable by anyone who may
/// create pods below, so the upper pod bound here decides. Pure.
fn serves(ours: bool, lower_uid: Option<&str>, bound: Option<&str>, asked: Option<&str>) -> bool {
    ours && lower_uid.is_some_and(|uid| {
        bound.is_some_and(|bound| bound == uid) && asked.is_none_or(|asked| asked == uid)
    })
}

/// Log parameters from a kubelet `containerLogs` query.
pub fn log_params(
    container: &str,
    query: &std::collections::BTreeMap<String, Vec<String>>,
) -> Result<LogParams, String> {
    let last = |name: &str| query.get(name).and_then(|v| v.last()).map(String::as_str);
    let boolean =
        |name: &str| last(name).is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    let number = |name: &str| -> Result<Option<i64>, String> {
        last(name)
            .map(|v| {
                v.parse::<i64>()
                    .map_err(|_| format!("invalid {name} {v:?}"))
            })
            .transpose()
    };
    // The kubelet's old `tail` parameter; "all" is no limit.
    let tail = match last("tail") {
        Some("all") => None,
        Some(_) => number("tail")?,
        None => None,
    };
    let since_time = last("sinceTime")
        .map(|v| {
            v.parse::<k8s_openapi::jiff::Timestamp>()
                .map_err(|e| format!("invalid sinceTime {v:?}: {e}"))
        })
        .transpose()?;
    Ok(LogParams {
        container: Some(container.to_owned()),
        follow: boolean("follow"),
        limit_bytes: number("limitBytes")?,
        pretty: false,
        previous: boolean("previous"),
        since_seconds: number("sinceSeconds")?,
        since_time,
        tail_lines: number("tailLines")?.or(tail),
        timestamps: boolean("timestamps"),
    })
}

async fn logs(
    api: &KubeletApi,
    target: &Target,
    query: &std::collections::BTreeMap<String, Vec<String>>,
) -> Response<Body> {
    let params = match log_params(&target.container, query) {
        Ok(params) => params,
        Err(message) => return text(StatusCode::BAD_REQUEST, message),
    };
    let lower = lower_target(target);
    let pods: Api<Pod> = Api::namespaced(api.lower.clone(), &lower.namespace);
    // Whether the pod is this node's and its log are asked of the lower API server at once,
    // not one after the other: the log is passed on only once the pod is known to be ours,
    // and otherwise dropped unread.
    let (ours, reader) = tokio::join!(mirrored(api, target), pods.log_stream(&lower.name, &params));
    if let Err(response) = ours {
        return response;
    }
    let reader = match reader {
        Ok(reader) => reader,
        Err(error) => return lower_error("reading the log", &error),
    };
    // Each chunk is sent as soon as it is read, so `-f` shows lines as they come; the
    // stream ends when the client goes (hyper drops the body).
    let chunks = futures::stream::unfold(Box::pin(reader), |mut reader| async move {
        let mut buffer = vec![0u8; 16 * 1024];
        match futures::AsyncReadExt::read(&mut reader, &mut buffer).await {
            Ok(0) => None,
            Ok(n) => {
                buffer.truncate(n);
                Some((Ok(Frame::data(Bytes::from(buffer))), reader))
            }
            Err(error) => Some((Err(error), reader)),
        }
    });
    let mut response = Response::new(BodyExt::boxed_unsync(StreamBody::new(chunks)));
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    response
}

/// Answers an SPDY upgrade with 101 and hands the connection to `serve`.
/// (A WebSocket upgrade of exec and attach goes to [`upgrade_websocket`].)
async fn upgrade<F, Fut>(
    api: &KubeletApi,
    mut req: Request<Incoming>,
    target: &Target,
    protocol: &'static str,
    serve: F,
) -> Response<Body>
where
    F: FnOnce(spdy::Connection, Api<Pod>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let upgrade = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if !upgrade.eq_ignore_ascii_case(spdy::UPGRADE_TOKEN) {
        return text(
            StatusCode::BAD_REQUEST,
            "this call needs an Upgrade: SPDY/3.1 (or, for exec and attach, websocket) connection",
        );
    }
    let offered: Vec<String> = req
        .headers()
        .get_all(spdy::PROTOCOL_HEADER)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|p| p.trim().to_owned()))
        .collect();
    if !offered.is_empty() && !offered.iter().any(|p| p == protocol) {
        return text(
            StatusCode::FORBIDDEN,
            format!(
                "unable to upgrade: no common protocol; offered {offered:?}, served {protocol}"
            ),
        );
    }
    let pods = match mirrored(api, target).await {
        Ok(pods) => pods,
        Err(response) => return response,
    };
    let on_upgrade = hyper::upgrade::on(&mut req);
    let span = info_span!("stream", pod = %format!("{}/{}", target.namespace, target.pod));
    tokio::spawn(
        async move {
            match on_upgrade.await {
                Ok(upgraded) => serve(spdy::Connection::server(TokioIo::new(upgraded)), pods).await,
                Err(error) => warn!(%error, "kubelet API: upgrade failed"),
            }
        }
        .instrument(span),
    );
    let mut response = text(StatusCode::SWITCHING_PROTOCOLS, String::new());
    let headers = response.headers_mut();
    headers.remove(header::CONTENT_TYPE);
    headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    headers.insert(
        header::UPGRADE,
        HeaderValue::from_static(spdy::UPGRADE_TOKEN),
    );
    headers.insert(spdy::PROTOCOL_HEADER, HeaderValue::from_static(protocol));
    response
}

/// Answers a WebSocket upgrade (exec, attach) with 101 and the protocol chosen, and hands
/// the socket to `serve`.
async fn upgrade_websocket<F, Fut>(
    api: &KubeletApi,
    mut req: Request<Incoming>,
    target: &Target,
    served: websocket::Served,
    serve: F,
) -> Response<Body>
where
    F: FnOnce(websocket::ClientSocket, websocket::Protocol, Api<Pod>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let handshake = match websocket::handshake(req.headers(), served) {
        Ok(handshake) => handshake,
        Err((status, message)) => return text(status, message),
    };
    let pods = match mirrored(api, target).await {
        Ok(pods) => pods,
        Err(response) => return response,
    };
    let on_upgrade = hyper::upgrade::on(&mut req);
    let span = info_span!(
        "stream",
        pod = %format!("{}/{}", target.namespace, target.pod),
        protocol = handshake.protocol_name.unwrap_or("channel.k8s.io"),
    );
    let protocol = handshake.protocol;
    tokio::spawn(
        async move {
            match on_upgrade.await {
                Ok(upgraded) => {
                    serve(websocket::server_socket(upgraded).await, protocol, pods).await
                }
                Err(error) => warn!(%error, "kubelet API: WebSocket upgrade failed"),
            }
        }
        .instrument(span),
    );
    let mut response = text(StatusCode::SWITCHING_PROTOCOLS, String::new());
    let headers = response.headers_mut();
    headers.remove(header::CONTENT_TYPE);
    headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    match HeaderValue::from_str(&handshake.accept) {
        Ok(accept) => headers.insert(header::SEC_WEBSOCKET_ACCEPT, accept),
        Err(error) => return text(StatusCode::INTERNAL_SERVER_ERROR, error.to_string()),
    };
    if let Some(name) = handshake.protocol_name {
        headers.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static(name),
        );
    }
    response
}

/// Whether the upper pod `namespace/name` is bound to the node of `scope` (always, without
/// one: the whole member).
fn in_scope(api: &KubeletApi, scope: Option<&NodeScope>, namespace: &str, name: &str) -> bool {
    scope.is_none_or(|scope| {
        api.lower_pods
            .upper
            .get(namespace, name)
            .is_some_and(|pod| pod.node_name().as_deref() == Some(scope.node.as_str()))
    })
}

/// `/pods` and `/runningpods/`: the lower pods this node mirrors.
async fn pods(api: &KubeletApi, scope: Option<&NodeScope>, running_only: bool) -> Response<Body> {
    let list = Api::<Pod>::all(api.lower.clone())
        .list(&ListParams::default().labels(&api.owner.selector()))
        .await;
    match list {
        Ok(mut list) => {
            if running_only {
                list.items.retain(|p| {
                    p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                });
            }
            if scope.is_some() {
                list.items.retain(|p| {
                    let meta = &p.metadata;
                    in_scope(
                        api,
                        scope,
                        meta.namespace.as_deref().unwrap_or_default(),
                        meta.name.as_deref().unwrap_or_default(),
                    )
                });
            }
            json(&serde_json::json!({
                "kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": list.items,
            }))
        }
        Err(error) => lower_error("listing pods", &error),
    }
}

/// `/stats/summary`: from the lower cluster's metrics API; 404 where it has none.
async fn stats_summary(api: &KubeletApi, scope: Option<&NodeScope>) -> Response<Body> {
    let uri = resource_scrape::pod_metrics_uri(&api.owner);
    let request = match Request::get(uri).body(Vec::new()) {
        Ok(request) => request,
        Err(error) => return text(StatusCode::INTERNAL_SERVER_ERROR, error.to_string()),
    };
    match api.lower.request::<serde_json::Value>(request).await {
        Ok(mut metrics) => {
            if let Some(view) = &api.namespaces {
                let to_view = |ns: &str| view.to_view(ns);
                crate::translate::namespace::rewrite_body(&mut metrics, false, &to_view);
            }
            if scope.is_some()
                && let Some(items) = metrics["items"].as_array_mut()
            {
                items.retain(|pod| {
                    let meta = &pod["metadata"];
                    in_scope(
                        api,
                        scope,
                        meta["namespace"].as_str().unwrap_or_default(),
                        meta["name"].as_str().unwrap_or_default(),
                    )
                });
            }
            let node = scope.map_or(api.owner.node.as_str(), |s| &s.node);
            json(&stats::summary(node, &metrics))
        }
        Err(kube::Error::Api(status)) if status.code == 404 => text(
            StatusCode::NOT_FOUND,
            "stats are not available: the lower cluster serves no metrics API (metrics.k8s.io)",
        ),
        Err(error) => lower_error("reading pod metrics", &error),
    }
}

pub mod stats {
    //! The kubelet's stats Summary built from the lower cluster's PodMetrics: pure.

    use serde_json::{Value, json};

    use crate::node::quantity::{parse_milli, parse_nano};

    /// A Summary (node and pods, CPU and working-set memory) of `metrics`, a PodMetricsList.
    pub fn summary(node: &str, metrics: &Value) -> Value {
        let mut node_cpu: i128 = 0;
        let mut node_memory: i128 = 0;
        let pods: Vec<Value> = metrics["items"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .map(|pod| {
                let time = pod["timestamp"].clone();
                let (mut cpu, mut memory) = (0i128, 0i128);
                let containers: Vec<Value> = pod["containers"]
                    .as_array()
                    .map(Vec::as_slice)
                    .unwrap_or_default()
                    .iter()
                    .map(|c| {
                        let c_cpu = c["usage"]["cpu"].as_str().and_then(parse_nano).unwrap_or(0);
                        let c_memory = c["usage"]["memory"]
                            .as_str()
                            .and_then(parse_milli)
                            .unwrap_or(0)
                            / 1000;
                        cpu += c_cpu;
                        memory += c_memory;
                        json!({
                            "name": c["name"],
                            "cpu": {"time": time, "usageNanoCores": c_cpu},
                            "memory": {"time": time, "workingSetBytes": c_memory},
                        })
                    })
                    .collect();
                node_cpu += cpu;
                node_memory += memory;
                json!({
                    "podRef": {"name": pod["metadata"]["name"], "namespace": pod["metadata"]["namespace"], "uid": pod["metadata"]["uid"]},
                    "startTime": time,
                    "cpu": {"time": time, "usageNanoCores": cpu},
                    "memory": {"time": time, "workingSetBytes": memory},
                    "containers": containers,
                })
            })
            .collect();
        json!({
            "node": {
                "nodeName": node,
                "cpu": {"usageNanoCores": node_cpu},
                "memory": {"workingSetBytes": node_memory},
            },
            "pods": pods,
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn summary_sums_containers() {
            let metrics = json!({"items": [{
                "metadata": {"name": "web", "namespace": "ns"},
                "timestamp": "2026-01-01T00:00:00Z",
                "containers": [
                    {"name": "a", "usage": {"cpu": "250m", "memory": "64Mi"}},
                    {"name": "b", "usage": {"cpu": "1500000n", "memory": "1Ki"}},
                ],
            }]});
            let s = summary("vk", &metrics);
            assert_eq!(s["pods"][0]["cpu"]["usageNanoCores"], 251_500_000);
            assert_eq!(
                s["pods"][0]["memory"]["workingSetBytes"],
                64 * 1024 * 1024 + 1024
            );
            assert_eq!(s["node"]["cpu"]["usageNanoCores"], 251_500_000);
            assert_eq!(s["pods"][0]["podRef"]["name"], "web");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lower pod serves logs, exec, attach and port-forward only as the copy of the
    /// upper pod of its name bound here: marked as this node's, carrying that pod's UID
    /// (and the UID the call names, if any).
    #[test]
    fn serves_only_the_copy_of_the_pod_bound_here() {
        // (ours, the lower pod's upper UID, the UID of the upper pod bound here, the UID
        // the call names, served)
        type Case<'a> = (
            bool,
            Option<&'a str>,
            Option<&'a str>,
            Option<&'a str>,
            bool,
        );
        let cases: &[Case] = &[
            (true, Some("u1"), Some("u1"), None, true),
            (true, Some("u1"), Some("u1"), Some("u1"), true),
            (true, Some("u1"), Some("u1"), Some("u2"), false),
            // Forged: named like a pod not bound here (one on a real node), with its UID.
            (true, Some("u1"), None, None, false),
            (true, Some("u1"), None, Some("u1"), false),
            // Named like a pod bound here, carrying another UID (or none).
            (true, Some("u9"), Some("u1"), None, false),
            (true, None, Some("u1"), None, false),
            // Not this node's marks.
            (false, Some("u1"), Some("u1"), None, false),
        ];
        for (ours, lower, bound, asked, want) in cases {
            assert_eq!(
                serves(*ours, *lower, *bound, *asked),
                *want,
                "ours {ours} lower {lower:?} bound {bound:?} asked {asked:?}"
            );
        }
    }

    #[test]
    fn log_parameters() {
        let q = |s: &str| route::query_pairs(Some(s));
        let p = log_params(
            "app",
            &q("follow=true&tailLines=5&timestamps=1&limitBytes=10&previous=true&sinceSeconds=60"),
        )
        .unwrap();
        assert!(p.follow && p.timestamps && p.previous);
        assert_eq!(
            (p.tail_lines, p.limit_bytes, p.since_seconds),
            (Some(5), Some(10), Some(60))
        );
        assert_eq!(p.container.as_deref(), Some("app"));
        let p = log_params("app", &q("sinceTime=2026-11-23T10%3A00%3A00Z&tail=2")).unwrap();
        assert_eq!(p.tail_lines, Some(2));
        assert!(p.since_time.is_some());
        assert_eq!(log_params("app", &q("tail=all")).unwrap().tail_lines, None);
        assert!(log_params("app", &q("tailLines=x")).is_err());
        assert!(log_params("app", &q("sinceTime=yesterday")).is_err());
        let p = log_params("app", &q("")).unwrap();
        assert!(!p.follow && p.tail_lines.is_none());
    }
}
