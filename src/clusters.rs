//! The two API clients (upper, lower) and the checks made before anything starts: each
//! kubeconfig is readable, each API server answers, and tensile may do what it needs there.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use http_body_util::BodyExt;
use hyper_timeout::TimeoutConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use kube::client::retry::RetryPolicy;
use kube::client::{ClientBuilder, ConfigExt, DynBody};
use kube::config::{KubeConfigOptions, Kubeconfig, KubeconfigError};
use kube::{Client, Config};
use prometheus_client::metrics::histogram::Histogram;
use tower::limit::RateLimitLayer;
use tower::retry::RetryLayer;
use tower::util::BoxService;
use tower::{BoxError, ServiceBuilder};

use crate::metrics::{ApiWaits, Metrics};
use crate::side::Side;

/// Why virtual-node could not start; one line, naming the cluster.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    /// The kubeconfig is missing or unreadable.
    #[error("{side} cluster: cannot read kubeconfig {path}: {source}")]
    Kubeconfig {
        /// Which cluster.
        side: Side,
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: kube::config::KubeconfigError,
    },
    /// A kubeconfig from a Secret (mounted as a file) is not one, or asks for more than
    /// its inline credentials ([`Trust::FromSecret`]).
    #[error("{side} cluster: kubeconfig {path}, from a Secret, {reason}")]
    FromSecret {
        /// Which cluster.
        side: Side,
        /// The file.
        path: PathBuf,
        /// What it asks for, or where it cannot be read.
        reason: BadKubeconfig,
    },
    /// No kubeconfig given and not running in a pod.
    #[error(
        "{side} cluster: no kubeconfig (--kubeconfig, $KUBECONFIG, ~/.kube/config) and not in a cluster: {source}"
    )]
    NoConfig {
        /// Which cluster.
        side: Side,
        /// What went wrong.
        source: kube::config::InClusterError,
    },
    /// The client could not be built (TLS material, proxy settings).
    #[error("{side} cluster: cannot build a client: {source}")]
    Client {
        /// Which cluster.
        side: Side,
        /// What went wrong.
        source: kube::Error,
    },
    /// The API server did not answer.
    #[error("{side} cluster: API server {server} is unreachable: {reason}")]
    Unreachable {
        /// Which cluster.
        side: Side,
        /// Its URL.
        server: String,
        /// What went wrong.
        reason: String,
    },
    /// The API server answered 401: it does not accept the kubeconfig's credentials.
    #[error(
        "{side} cluster: API server {server} rejected the credentials (401 Unauthorized): \
         the kubeconfig's client certificate may have expired or be signed by another CA, \
         or its token may be revoked"
    )]
    Unauthenticated {
        /// Which cluster.
        side: Side,
        /// Its URL.
        server: String,
    },
    /// RBAC does not allow something virtual-node needs.
    #[error(
        "{side} cluster: not allowed to {missing} (check the RBAC of the identity in its kubeconfig)"
    )]
    Forbidden {
        /// Which cluster.
        side: Side,
        /// e.g. `create pods in every namespace, watch nodes`.
        missing: String,
    },
}

/// A connected cluster.
#[derive(Clone)]
pub struct Cluster {
    /// Which one.
    pub side: Side,
    /// Its client (rate limited).
    pub client: Client,
    /// A client for the leader-election Lease only: not rate limited, and with a queue and
    /// connections of its own, so a renewal never waits behind the controllers' requests
    /// (under a low `--kube-api-qps`, long past the renew deadline).
    pub unthrottled: Client,
    /// Makes the clients of the node heartbeat (Lease renewals, node status, the lower
    /// health probe): see [`HeartbeatClients`].
    pub heartbeat: HeartbeatClients,
    /// Makes rate-limited clients with a limiter and connections of their own: see
    /// [`MemberClients`].
    pub member_clients: MemberClients,
    /// Its API server's URL, for messages.
    pub server: String,
    /// Its Kubernetes version (`v1.36.3`), which the virtual node reports as kubelet version.
    pub version: String,
}

/// How long one heartbeat call (a Lease renewal, a node status write, the lower health
/// probe) may take before it counts as failed and its connection is dropped: half the
/// renew interval, so a renewal that fails is tried again within the same interval, and a
/// 40 s Lease outlives several failures.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);

/// TCP keepalive on every connection to an API server (Go's dialer sends its first probe
/// after 15 s and then every 15 s): an idle pooled connection whose peer vanished (a
/// rebooted load balancer, a NAT entry expired) is found dead within about a minute,
/// instead of when the next request on it times out after the kernel's retransmissions
/// (~15 min).
const TCP_KEEPALIVE: Duration = Duration::from_secs(15);
const TCP_KEEPALIVE_RETRIES: u32 = 3;

/// Makes the clients of the node heartbeat, as the kubelet makes its heartbeat client
/// (kubernetes#48638): not rate limited, so a renewal never waits behind the controllers'
/// requests (under `--kube-api-qps=1`, minutes of them); with connections of their own, so
/// a half-open connection of the shared pool never holds it; connect and write timeouts of
/// [`HEARTBEAT_TIMEOUT`]. The heartbeat bounds each call to [`HEARTBEAT_TIMEOUT`] and makes
/// a fresh client (new connections) after a failed or timed-out call, dropping the old
/// one's connections. (No read timeout on the connections: it would also end the idle
/// connection between two heartbeats, a new TLS handshake every 10 s per node.)
#[derive(Clone)]
pub struct HeartbeatClients {
    config: Config,
    count: CountRequests,
}

impl HeartbeatClients {
    fn new(mut config: Config, count: CountRequests) -> Self {
        config.write_timeout = Some(HEARTBEAT_TIMEOUT);
        config.connect_timeout = Some(HEARTBEAT_TIMEOUT);
        Self { config, count }
    }

    /// Which cluster.
    pub fn side(&self) -> Side {
        self.count.side
    }

    /// A new client, with connections of its own.
    pub fn build(&self) -> Result<Client, kube::Error> {
        Ok(
            client_builder(self.config.clone(), &self.count.waits.connect)?
                .with_layer(&self.count)
                .build(),
        )
    }
}

/// Makes a client like [`Cluster::client`] with a rate limiter, a request buffer and a
/// connection pool of its own, for one member of a federated process (its controllers'
/// upper requests, its events). N single-cluster processes each have their own upper
/// client: its `--kube-api-qps`/`--kube-api-burst` budget, and its pool's
/// [`IDLE_CONNECTIONS`] idle connections between the waves of a burst. Members sharing
/// one client shared one budget, and 24 idle connections among all their workers: a
/// burst over 5 members opened 892 upper connections (TCP and TLS) where 5 processes
/// opened 111, and each member got a fifth of the budget. Requests are counted and timed
/// in the same metrics as the shared client's.
#[derive(Clone)]
pub struct MemberClients {
    config: Config,
    limit: RateLimit,
    count: CountRequests,
    view: Option<crate::lower_view::ViewLayer>,
}

impl MemberClients {
    /// A new client: its own limiter (the cluster's rate), buffer and connections.
    pub fn build(&self) -> Result<Client, kube::Error> {
        let throttle = TimedReady(self.count.waits.throttle.clone());
        let builder = client_builder(self.config.clone(), &self.count.waits.connect)?
            .with_layer(&self.limit.layer())
            .with_layer(&throttle)
            .with_layer(&self.count);
        Ok(match &self.view {
            Some(view) => builder.with_layer(view).build(),
            None => builder.build(),
        })
    }
}

/// The longest rate-limit window: a year.
const MAX_WINDOW: Duration = Duration::from_secs(365 * 24 * 3600);

/// Requests per second and burst for one client.
#[derive(Clone, Copy, Debug)]
pub struct RateLimit {
    /// Sustained requests per second.
    pub qps: f64,
    /// Requests allowed at once.
    pub burst: u32,
}

impl RateLimit {
    /// `burst` requests per `burst / qps` seconds: the sustained rate is `qps`, and a quiet
    /// client can send `burst` at once.
    fn layer(self) -> RateLimitLayer {
        RateLimitLayer::new(u64::from(self.burst.max(1)), self.window())
    }

    /// The limiter's window, `burst / qps` seconds: at least 1 ms (no limit: a `qps` of 0
    /// or less, or infinite), at most a year (whatever `qps` a member's annotation or a
    /// caller gives, never a `Duration` that overflows).
    pub fn window(self) -> Duration {
        let burst = self.burst.max(1);
        let qps = if self.qps > 0.0 { self.qps } else { f64::MAX };
        let seconds = (f64::from(burst) / qps).max(0.001);
        Duration::try_from_secs_f64(seconds)
            .unwrap_or(MAX_WINDOW)
            .min(MAX_WINDOW)
    }
}

/// Loads the config: an explicit kubeconfig, else `~/.kube/config` (upper only), else
/// in-cluster. A kubeconfig named here is the operator's ([`Trust::Operator`]).
pub async fn load_config(side: Side, path: Option<&Path>) -> Result<Config, StartupError> {
    let home = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".kube/config"));
    let path = path
        .map(Path::to_owned)
        .or_else(|| home.filter(|p| p.exists()));
    match path {
        Some(path) => load_kubeconfig(side, &path, Trust::Operator).await,
        None => Config::incluster().map_err(|source| StartupError::NoConfig { side, source }),
    }
}

/// Who wrote a kubeconfig, and so what loading it may make this process do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trust {
    /// The operator's own file (a flag, `~/.kube/config`): read as it is, whatever it asks
    /// for (exec plugins, auth providers, file paths).
    Operator,
    /// A Secret's, chosen by whoever may write that Secret: inline credentials only (a
    /// bearer `token`, or `client-certificate-data` and `client-key-data`) and an inline CA
    /// (or none: the system roots). Nothing that runs a command (`exec`, `auth-provider`),
    /// reads one of this process's files (`tokenFile`, `client-certificate`, `client-key`,
    /// `certificate-authority`: its own ServiceAccount token among them) or sends anything
    /// but those credentials (basic authentication, impersonation).
    FromSecret,
}

/// Why a kubeconfig cannot be used at its [`Trust`]. Quotes none of the kubeconfig: it may
/// hold credentials.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadKubeconfig {
    /// It is not a kubeconfig. Only where: a YAML error message may quote the value it
    /// choked on.
    #[error("cannot be read as a kubeconfig{at} (not quoted: it may hold credentials)")]
    Unreadable {
        /// ` at line L, column C`, or empty where the parser knows no position.
        at: String,
    },
    /// It sets a field that its trust does not allow.
    #[error("sets {field}: {why}")]
    Refused {
        /// Where, as in the kubeconfig: `users[NAME].user.exec`.
        field: String,
        /// Why it is refused.
        why: &'static str,
    },
}

/// Why each field a kubeconfig from a Secret may not set is refused.
const RUNS_A_COMMAND: &str = "a kubeconfig from a Secret may not run a command; put the credentials inline (virtual-node join does)";
const READS_A_FILE: &str = "a kubeconfig from a Secret may not name a file to read (the reader's own ServiceAccount token is one); put the data inline (the *-data field)";
const BASIC_AUTH: &str = "basic authentication is refused (API servers dropped it in Kubernetes 1.19); use a token or a client certificate";
const IMPERSONATES: &str = "impersonation is refused in a kubeconfig from a Secret; give the identity's own token or client certificate";

impl Trust {
    /// Whether `kubeconfig` may be used at this trust: [`Trust::Operator`] takes anything,
    /// [`Trust::FromSecret`] refuses the first field beyond inline credentials. Every user
    /// and cluster is checked, not only the current context's, so that no later edit of
    /// `current-context` turns a refused entry on.
    pub fn admit(self, kubeconfig: &Kubeconfig) -> Result<(), BadKubeconfig> {
        if self == Trust::Operator {
            return Ok(());
        }
        let refused = |field: String, why: &'static str| BadKubeconfig::Refused { field, why };
        for named in &kubeconfig.clusters {
            if let Some(cluster) = &named.cluster
                && cluster.certificate_authority.is_some()
            {
                let field = format!("clusters[{}].cluster.certificate-authority", named.name);
                return Err(refused(field, READS_A_FILE));
            }
        }
        for named in &kubeconfig.auth_infos {
            if let Some(user) = &named.auth_info
                && let Some((field, why)) = refused_user_field(user)
            {
                return Err(refused(format!("users[{}].user.{field}", named.name), why));
            }
        }
        Ok(())
    }
}

/// The first field of `user` a kubeconfig from a Secret may not set, and why.
fn refused_user_field(user: &kube::config::AuthInfo) -> Option<(&'static str, &'static str)> {
    [
        ("exec", user.exec.is_some(), RUNS_A_COMMAND),
        (
            "auth-provider",
            user.auth_provider.is_some(),
            RUNS_A_COMMAND,
        ),
        ("tokenFile", user.token_file.is_some(), READS_A_FILE),
        (
            "client-certificate",
            user.client_certificate.is_some(),
            READS_A_FILE,
        ),
        ("client-key", user.client_key.is_some(), READS_A_FILE),
        ("username", user.username.is_some(), BASIC_AUTH),
        ("password", user.password.is_some(), BASIC_AUTH),
        ("as", user.impersonate.is_some(), IMPERSONATES),
        ("as-uid", user.impersonate_uid.is_some(), IMPERSONATES),
        ("as-groups", user.impersonate_groups.is_some(), IMPERSONATES),
        (
            "as-user-extra",
            user.impersonate_user_extra.is_some(),
            IMPERSONATES,
        ),
    ]
    .into_iter()
    .find(|(_, set, _)| *set)
    .map(|(field, _, why)| (field, why))
}

/// Reads kubeconfig `text` written with `trust` ([`Trust::admit`]). The error quotes
/// nothing of the text.
pub fn read_kubeconfig(text: &str, trust: Trust) -> Result<Kubeconfig, BadKubeconfig> {
    let kubeconfig = Kubeconfig::from_yaml(text).map_err(|error| BadKubeconfig::Unreadable {
        at: match error {
            KubeconfigError::Parse(error) => error
                .location()
                .filter(|l| l.line() > 0)
                .map(|l| format!(" at line {}, column {}", l.line(), l.column()))
                .unwrap_or_default(),
            _ => String::new(),
        },
    })?;
    trust.admit(&kubeconfig)?;
    Ok(kubeconfig)
}

/// Loads the kubeconfig file at `path`, written with `trust`, as a client config: the one
/// way a kubeconfig file becomes a [`Config`]. An operator's is read as kube-rs reads it
/// (relative file paths from its directory); a Secret's (one mounted as a file) through
/// [`read_kubeconfig`], so that it asks for nothing beyond its inline credentials and no
/// error quotes it.
pub async fn load_kubeconfig(
    side: Side,
    path: &Path,
    trust: Trust,
) -> Result<Config, StartupError> {
    let unusable = |source| StartupError::Kubeconfig {
        side,
        path: path.to_owned(),
        source,
    };
    let kubeconfig = match trust {
        Trust::Operator => Kubeconfig::read_from(path).map_err(unusable)?,
        Trust::FromSecret => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| unusable(KubeconfigError::ReadConfig(e, path.to_owned())))?;
            read_kubeconfig(&text, trust).map_err(|reason| StartupError::FromSecret {
                side,
                path: path.to_owned(),
                reason,
            })?
        }
    };
    Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(unusable)
}

/// Builds the client (rate limited, its requests counted in `metrics`; speaking upper
/// namespace names through `view` when given, see [`crate::lower_view`]) and checks that
/// the API server answers.
pub async fn connect(
    side: Side,
    config: Config,
    limit: RateLimit,
    metrics: Arc<Metrics>,
    view: Option<Arc<crate::lower_view::NamespaceView>>,
) -> Result<Cluster, StartupError> {
    let server = config.cluster_url.to_string();
    let waits = metrics.api_waits(side);
    let throttle = TimedReady(waits.throttle.clone());
    let count = CountRequests {
        side,
        metrics,
        waits,
    };
    let view = view.map(crate::lower_view::ViewLayer::new);
    let throttled = client_builder(config.clone(), &count.waits.connect)
        .map_err(|source| StartupError::Client { side, source })?
        .with_layer(&limit.layer())
        .with_layer(&throttle)
        .with_layer(&count);
    let heartbeat = HeartbeatClients::new(config.clone(), count.clone());
    let member_clients = MemberClients {
        config: config.clone(),
        limit,
        count: count.clone(),
        view: view.clone(),
    };
    let plain = client_builder(config, &count.waits.connect)
        .map_err(|source| StartupError::Client { side, source })?
        .with_layer(&count);
    let (client, unthrottled) = match &view {
        Some(view) => (
            throttled.with_layer(view).build(),
            plain.with_layer(view).build(),
        ),
        None => (throttled.build(), plain.build()),
    };
    let version = tokio::time::timeout(Duration::from_secs(15), client.apiserver_version())
        .await
        .map_err(|_| StartupError::Unreachable {
            side,
            server: server.clone(),
            reason: "no answer within 15s".into(),
        })?
        .map_err(|e| {
            if crate::api::is_status(&e, 401) {
                StartupError::Unauthenticated {
                    side,
                    server: server.clone(),
                }
            } else {
                StartupError::Unreachable {
                    side,
                    server: server.clone(),
                    reason: e.to_string(),
                }
            }
        })?;
    Ok(Cluster {
        side,
        client,
        unthrottled,
        heartbeat,
        member_clients,
        server,
        version: version.git_version,
    })
}

/// The kube client's service stack, as kube-client builds it.
type GenericService =
    BoxService<http::Request<kube::client::Body>, http::Response<Box<DynBody>>, BoxError>;

/// Idle connections kept open to each API server (client-go keeps 25). The kube client's
/// own keeps every connection a burst opened (HTTP/1.1: one per request in flight) for
/// 90 s: ~190 of them, ~45 KB each, after a 10 000-pod burst.
const IDLE_CONNECTIONS: usize = 24;

/// The kube client's stack (kube-client's `ClientBuilder::try_from`: timeouts, TLS, base
/// URI, retries of 429/503/504, authentication, extra headers) over a pool that keeps at
/// most [`IDLE_CONNECTIONS`] idle, each new connection timed in `connects`. Through a
/// proxy (`proxy-url`), kube-client's own, which knows the proxy protocols.
fn client_builder(
    config: Config,
    connects: &Histogram,
) -> Result<ClientBuilder<GenericService>, kube::Error> {
    if config.proxy_url.is_some() {
        return ClientBuilder::try_from(config);
    }
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    // As Go (client-go) does: a small write (a port-forward message, a request) goes out at
    // once instead of waiting for the ACK of the one before it (Nagle).
    http.set_nodelay(true);
    http.set_keepalive(Some(TCP_KEEPALIVE));
    http.set_keepalive_interval(Some(TCP_KEEPALIVE));
    http.set_keepalive_retries(Some(TCP_KEEPALIVE_RETRIES));
    let mut connector = TimeoutConnector::new(config.rustls_https_connector_with_connector(http)?);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let pool = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(IDLE_CONNECTIONS)
        .build::<_, kube::client::Body>(TimedConnect {
            inner: connector,
            seconds: connects.clone(),
        });
    let retry = config
        .default_retry
        .then(|| RetryLayer::new(RetryPolicy::server_retry()));
    let service = ServiceBuilder::new()
        .map_response(|response: http::Response<hyper::body::Incoming>| {
            response.map(|body| Box::new(BodyExt::map_err(body, BoxError::from)) as Box<DynBody>)
        })
        .layer(config.base_uri_layer())
        .option_layer(retry)
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(pool);
    Ok(ClientBuilder::new(
        BoxService::new(service),
        config.default_namespace,
    ))
}

/// Times each new connection (TCP and TLS) to an API server.
#[derive(Clone)]
struct TimedConnect<C> {
    inner: C,
    seconds: Histogram,
}

impl<C> tower::Service<http::Uri> for TimedConnect<C>
where
    C: tower::Service<http::Uri>,
    C::Future: Send + 'static,
{
    type Response = C::Response;
    type Error = C::Error;
    type Future = futures::future::BoxFuture<'static, Result<C::Response, C::Error>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let (started, seconds) = (Instant::now(), self.seconds.clone());
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            let connected = connecting.await;
            seconds.observe(started.elapsed().as_secs_f64());
            connected
        })
    }
}

/// Records how long the service it wraps (the rate limiter) keeps each request waiting
/// before it may be sent: from the first readiness poll to ready. The kube client's
/// buffer polls readiness once per request, so one figure per request (0 when the
/// limiter let it through at once); while one waits, the requests behind it in the
/// buffer wait too.
#[derive(Clone)]
struct TimedReady(Histogram);

impl<S> tower::Layer<S> for TimedReady {
    type Service = TimedReadyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TimedReadyService {
            inner,
            seconds: self.0.clone(),
            since: None,
        }
    }
}

/// The service [`TimedReady`] wraps.
struct TimedReadyService<S> {
    inner: S,
    seconds: Histogram,
    /// The first readiness poll of the request under way.
    since: Option<Instant>,
}

impl<S, R> tower::Service<R> for TimedReadyService<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        let since = *self.since.get_or_insert_with(Instant::now);
        let ready = self.inner.poll_ready(cx);
        if ready.is_ready() {
            self.since = None;
            self.seconds.observe(since.elapsed().as_secs_f64());
        }
        ready
    }

    fn call(&mut self, request: R) -> Self::Future {
        self.inner.call(request)
    }
}

/// Counts each request to one cluster by verb, and its answer by status code, and times
/// it (sent to answered).
#[derive(Clone)]
struct CountRequests {
    side: Side,
    metrics: Arc<Metrics>,
    waits: ApiWaits,
}

impl<S> tower::Layer<S> for CountRequests {
    type Service = CountedRequests<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CountedRequests {
            inner,
            counter: self.clone(),
        }
    }
}

/// The service [`CountRequests`] wraps.
#[derive(Clone)]
struct CountedRequests<S> {
    inner: S,
    counter: CountRequests,
}

impl<S, B, R> tower::Service<http::Request<B>> for CountedRequests<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let verb = crate::metrics::verb(&request);
        let CountRequests {
            side,
            metrics,
            waits,
        } = self.counter.clone();
        if let Some(verb) = verb {
            metrics.api_requests.sent(side, verb);
        }
        let sent = Instant::now();
        let answer = self.inner.call(request);
        Box::pin(async move {
            let answer = answer.await;
            // A watch's answer comes at once; its events are not counted here.
            waits.request.observe(sent.elapsed().as_secs_f64());
            if let Some(verb) = verb {
                let status = answer.as_ref().ok().map(http::Response::status);
                metrics.api_requests.answered(side, verb, status);
            }
            answer
        })
    }
}

/// One permission: verb, API group, resource (with optional subresource), namespace.
#[derive(Clone, Copy, Debug)]
pub struct Permission {
    /// e.g. `create`.
    pub verb: &'static str,
    /// `""` for the core group.
    pub group: &'static str,
    /// e.g. `pods`.
    pub resource: &'static str,
    /// e.g. `status`.
    pub subresource: &'static str,
    /// `None`: every namespace (or cluster-scoped).
    pub namespace: Option<&'static str>,
}

impl fmt::Display for Permission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.verb, self.resource)?;
        if !self.subresource.is_empty() {
            write!(f, "/{}", self.subresource)?;
        }
        if !self.group.is_empty() {
            write!(f, ".{}", self.group)?;
        }
        if let Some(ns) = self.namespace {
            write!(f, " in {ns}")?;
        }
        Ok(())
    }
}

/// How many access reviews are in flight at once at start.
const CONCURRENT_REVIEWS: usize = 16;

/// Fails with every missing permission listed, naming the cluster.
pub async fn check_permissions(
    cluster: &Cluster,
    needed: &[Permission],
) -> Result<(), StartupError> {
    let missing: Vec<String> = review_permissions(cluster, needed)
        .await?
        .into_iter()
        .filter(|(_, allowed)| !allowed)
        .map(|(permission, _)| permission.to_string())
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(StartupError::Forbidden {
            side: cluster.side,
            missing: missing.join(", "),
        })
    }
}

/// Whether this client may do each of `needed` in `cluster` (SelfSubjectAccessReviews,
/// [`CONCURRENT_REVIEWS`] at a time), in order.
pub async fn review_permissions(
    cluster: &Cluster,
    needed: &[Permission],
) -> Result<Vec<(Permission, bool)>, StartupError> {
    let reviews: Api<SelfSubjectAccessReview> = Api::all(cluster.client.clone());
    // Each permission is moved into its review (not borrowed from the stream), so the
    // future stays `Send` for a member's task.
    let reviews = &reviews;
    let answers: Vec<Result<bool, StartupError>> = futures::stream::iter(needed.iter().copied())
        .map(|permission| async move { is_allowed(cluster, reviews, &permission).await })
        .buffered(CONCURRENT_REVIEWS)
        .collect()
        .await;
    needed
        .iter()
        .zip(answers)
        .map(|(permission, allowed)| Ok((*permission, allowed?)))
        .collect()
}

async fn is_allowed(
    cluster: &Cluster,
    reviews: &Api<SelfSubjectAccessReview>,
    permission: &Permission,
) -> Result<bool, StartupError> {
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                verb: Some(permission.verb.into()),
                group: Some(permission.group.into()),
                resource: Some(permission.resource.into()),
                subresource: (!permission.subresource.is_empty())
                    .then(|| permission.subresource.into()),
                namespace: permission.namespace.map(Into::into),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = reviews
        .create(&PostParams::default(), &review)
        .await
        .map_err(|e| StartupError::Unreachable {
            side: cluster.side,
            server: cluster.server.clone(),
            reason: format!("access review failed: {e}"),
        })?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}

const fn perm(verb: &'static str, resource: &'static str) -> Permission {
    Permission {
        verb,
        group: "",
        resource,
        subresource: "",
        namespace: None,
    }
}

const fn sub(verb: &'static str, resource: &'static str, subresource: &'static str) -> Permission {
    Permission {
        subresource,
        ..perm(verb, resource)
    }
}

const fn grouped(verb: &'static str, group: &'static str, resource: &'static str) -> Permission {
    Permission {
        group,
        ..perm(verb, resource)
    }
}

// The tables below list every API call virtual-node makes, by cluster and feature. A
// watch is a list and then a watch. `tests/virtual_node_startup.rs` runs virtual-node as
// identities granted exactly these (RBAC generated from them), so a call missing here
// fails there.

/// What virtual-node always does in the upper cluster.
pub const UPPER_PERMISSIONS: &[Permission] = &[
    // node: registered (read first), labels and taints patched, status written; watched
    // for a cordon (the virtual nodes, with --members-namespace)
    perm("get", "nodes"),
    perm("list", "nodes"),
    perm("watch", "nodes"),
    perm("create", "nodes"),
    perm("patch", "nodes"),
    sub("patch", "nodes", "status"),
    // pods bound to the node: watched, read whole before mirroring, their deletion cost
    // written, deleted when the lower pod is gone, status reflected
    perm("list", "pods"),
    perm("watch", "pods"),
    perm("get", "pods"),
    perm("patch", "pods"),
    perm("delete", "pods"),
    sub("patch", "pods", "status"),
    // dependencies copied down; ConfigMaps and Secrets watched (metadata) to keep copies
    // in step; kube-system/kube-root-ca.crt is the kubelet API's default client CA
    perm("list", "configmaps"),
    perm("watch", "configmaps"),
    perm("get", "configmaps"),
    perm("list", "secrets"),
    perm("watch", "secrets"),
    perm("get", "secrets"),
    perm("get", "serviceaccounts"),
    perm("get", "persistentvolumeclaims"),
    // the cluster's identity (the UID of kube-system) when --cluster-id is not given
    perm("get", "namespaces"),
    // Warning events and lower events reflected (kube-runtime's Recorder)
    grouped("create", "events.k8s.io", "events"),
    grouped("patch", "events.k8s.io", "events"),
];

/// Reading a node Lease: the node lease's first renewal (is it the node's own, its owner
/// the Node's UID?) and a member's leave (is it the leaving Node's?).
pub const UPPER_LEASE_READ_PERMISSIONS: &[Permission] = &[Permission {
    namespace: Some("kube-node-lease"),
    ..grouped("get", "coordination.k8s.io", "leases")
}];

/// What the node lease (`--enable-node-lease`) needs in the upper cluster beside reading it
/// ([`UPPER_LEASE_READ_PERMISSIONS`]): made once, then renewed under its UID.
pub const UPPER_LEASE_PERMISSIONS: &[Permission] = &[
    Permission {
        namespace: Some("kube-node-lease"),
        ..grouped("create", "coordination.k8s.io", "leases")
    },
    Permission {
        namespace: Some("kube-node-lease"),
        ..grouped("patch", "coordination.k8s.io", "leases")
    },
];

/// What the kubelet API needs in the upper cluster to authorize each caller like a
/// kubelet (unless `--no-verify-clients`).
pub const UPPER_ACCESS_REVIEW_PERMISSIONS: &[Permission] = &[grouped(
    "create",
    "authorization.k8s.io",
    "subjectaccessreviews",
)];

/// What the kubelet API needs in the upper cluster to accept bearer tokens
/// (`--authentication-token-webhook`).
pub const UPPER_TOKEN_REVIEW_PERMISSIONS: &[Permission] =
    &[grouped("create", "authentication.k8s.io", "tokenreviews")];

/// What virtual-node always does in the lower cluster.
pub const LOWER_PERMISSIONS: &[Permission] = &[
    // capacity: every node and pod
    perm("list", "nodes"),
    perm("watch", "nodes"),
    perm("list", "pods"),
    perm("watch", "pods"),
    // mirrored pods: created, read back on a conflict, updated, deleted
    perm("get", "pods"),
    perm("create", "pods"),
    perm("patch", "pods"),
    perm("delete", "pods"),
    // ephemeral containers (`kubectl debug` on the virtual node) added to mirrored pods
    sub("patch", "pods", "ephemeralcontainers"),
    // the kubelet API: logs, exec, attach, port-forward (WebSocket upgrades are GETs that
    // also need create), /stats/summary from the metrics API
    sub("get", "pods", "log"),
    sub("get", "pods", "exec"),
    sub("create", "pods", "exec"),
    sub("get", "pods", "attach"),
    sub("create", "pods", "attach"),
    sub("get", "pods", "portforward"),
    sub("create", "pods", "portforward"),
    grouped("list", "metrics.k8s.io", "pods"),
    // (`get nodes/proxy`, the lower kubelets' /metrics/resource, is optional and so not
    // here: without it that is built from metrics.k8s.io)
    // dependencies: namespace and copies made when missing
    perm("get", "namespaces"),
    perm("create", "namespaces"),
    perm("get", "serviceaccounts"),
    perm("create", "serviceaccounts"),
    perm("get", "persistentvolumeclaims"),
    perm("create", "persistentvolumeclaims"),
    // ConfigMap and Secret copies: watched, kept in step, removed when unreferenced
    perm("list", "configmaps"),
    perm("watch", "configmaps"),
    perm("get", "configmaps"),
    perm("create", "configmaps"),
    perm("update", "configmaps"),
    // (patch: marks added to copies made by an earlier version)
    perm("patch", "configmaps"),
    perm("delete", "configmaps"),
    perm("list", "secrets"),
    perm("watch", "secrets"),
    perm("get", "secrets"),
    perm("create", "secrets"),
    perm("update", "secrets"),
    perm("patch", "secrets"),
    perm("delete", "secrets"),
    // events about mirrored pods, reflected up
    perm("list", "events"),
    perm("watch", "events"),
];

/// What `ServiceControllers` does in the upper cluster.
pub const UPPER_SERVICE_PERMISSIONS: &[Permission] = &[
    perm("list", "services"),
    perm("watch", "services"),
    perm("get", "services"),
    perm("list", "endpoints"),
    perm("watch", "endpoints"),
    perm("get", "endpoints"),
    grouped("list", "discovery.k8s.io", "endpointslices"),
    grouped("watch", "discovery.k8s.io", "endpointslices"),
    grouped("get", "discovery.k8s.io", "endpointslices"),
];

/// What `ServiceControllers` does in the lower cluster.
pub const LOWER_SERVICE_PERMISSIONS: &[Permission] = &[
    perm("list", "services"),
    perm("watch", "services"),
    perm("get", "services"),
    perm("create", "services"),
    perm("update", "services"),
    perm("patch", "services"),
    perm("delete", "services"),
    perm("list", "endpoints"),
    perm("watch", "endpoints"),
    perm("get", "endpoints"),
    perm("create", "endpoints"),
    perm("update", "endpoints"),
    perm("patch", "endpoints"),
    perm("delete", "endpoints"),
    grouped("list", "discovery.k8s.io", "endpointslices"),
    grouped("watch", "discovery.k8s.io", "endpointslices"),
    grouped("get", "discovery.k8s.io", "endpointslices"),
    grouped("create", "discovery.k8s.io", "endpointslices"),
    grouped("update", "discovery.k8s.io", "endpointslices"),
    grouped("patch", "discovery.k8s.io", "endpointslices"),
    grouped("delete", "discovery.k8s.io", "endpointslices"),
];

/// What `PVControllers` does in the upper cluster.
pub const UPPER_PV_PERMISSIONS: &[Permission] = &[
    perm("list", "persistentvolumeclaims"),
    perm("watch", "persistentvolumeclaims"),
    perm("patch", "persistentvolumeclaims"),
    perm("list", "persistentvolumes"),
    perm("watch", "persistentvolumes"),
    perm("get", "persistentvolumes"),
    perm("create", "persistentvolumes"),
    perm("patch", "persistentvolumes"),
    perm("delete", "persistentvolumes"),
];

/// What `PVControllers` does in the lower cluster.
pub const LOWER_PV_PERMISSIONS: &[Permission] = &[
    perm("list", "persistentvolumeclaims"),
    perm("watch", "persistentvolumeclaims"),
    perm("patch", "persistentvolumeclaims"),
    perm("delete", "persistentvolumeclaims"),
    perm("list", "persistentvolumes"),
    perm("watch", "persistentvolumes"),
    perm("get", "persistentvolumes"),
    grouped("list", "storage.k8s.io", "storageclasses"),
    grouped("watch", "storage.k8s.io", "storageclasses"),
];

/// What the membership controller (`--members-namespace`) needs in the upper cluster
/// beyond the member Secrets of its namespace ([`MEMBER_SECRET_VERBS`]) and reading node
/// Leases ([`UPPER_LEASE_READ_PERMISSIONS`]): a leaving member's node cordoned, its pods
/// evicted, then the Node and its node Lease deleted.
pub const UPPER_MEMBER_PERMISSIONS: &[Permission] = &[
    sub("create", "pods", "eviction"),
    perm("delete", "nodes"),
    Permission {
        namespace: Some("kube-node-lease"),
        ..grouped("delete", "coordination.k8s.io", "leases")
    },
];

/// What `--upper-identity` adds in the upper cluster: tokens requested for the pods'
/// ServiceAccounts (the cluster CA is read like any ConfigMap; below, the token Secrets are
/// written like the copies of Secrets).
pub const UPPER_IDENTITY_PERMISSIONS: &[Permission] = &[sub("create", "serviceaccounts", "token")];

/// What `--lower-namespace` other than `same` adds in the upper cluster: the Namespaces
/// and their annotations, watched.
pub const UPPER_NAMESPACE_PERMISSIONS: &[Permission] =
    &[perm("list", "namespaces"), perm("watch", "namespaces")];

/// What `--kueue-quota` adds in the upper cluster: the ClusterQueue watched, read again
/// after a conflict, and its `spec.resourceGroups` patched.
pub const UPPER_KUEUE_QUOTA_PERMISSIONS: &[Permission] = &[
    grouped("get", "kueue.x-k8s.io", "clusterqueues"),
    grouped("list", "kueue.x-k8s.io", "clusterqueues"),
    grouped("watch", "kueue.x-k8s.io", "clusterqueues"),
    grouped("patch", "kueue.x-k8s.io", "clusterqueues"),
];

/// What `--lower-namespace` other than `same` adds in the lower cluster: the Namespaces
/// listed at start, to know which a mapping may choose (whose marks they carry).
pub const LOWER_NAMESPACE_PERMISSIONS: &[Permission] = &[perm("list", "namespaces")];

/// The member Secrets: watched, and their finalizer added and removed.
const MEMBER_SECRET_VERBS: [&str; 4] = ["list", "watch", "get", "patch"];

/// Which optional parts run, and so which permissions they need.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Features {
    /// `ServiceControllers`.
    pub services: bool,
    /// `PVControllers`.
    pub volumes: bool,
    /// `--enable-node-lease`.
    pub node_lease: bool,
    /// The kubelet API authorizes callers (not `--no-verify-clients`).
    pub access_reviews: bool,
    /// `--authentication-token-webhook`.
    pub token_reviews: bool,
    /// `--leader-elect`: the namespace of the leader-election Lease.
    pub leader_election: Option<&'static str>,
    /// `--members-namespace`: where the member Secrets are.
    pub members: Option<&'static str>,
    /// `--upper-identity`.
    pub upper_identity: bool,
    /// `--lower-namespace` other than `same`: the upper Namespaces are watched.
    pub namespaces: bool,
    /// `--kueue-quota`: a Kueue ClusterQueue's flavor quota kept.
    pub kueue_quota: bool,
}

/// Leader election's calls (`crate::leader`): the Lease read, created once, then updated.
const LEADER_ELECTION_VERBS: [&str; 3] = ["get", "create", "update"];

/// Every permission virtual-node needs in `side` with `features`: the list checked at
/// start.
pub fn needed_permissions(side: Side, features: Features) -> Vec<Permission> {
    let tables: Vec<(bool, &[Permission])> = match side {
        Side::Upper => vec![
            (true, UPPER_PERMISSIONS),
            (
                features.node_lease || features.members.is_some(),
                UPPER_LEASE_READ_PERMISSIONS,
            ),
            (features.node_lease, UPPER_LEASE_PERMISSIONS),
            (features.access_reviews, UPPER_ACCESS_REVIEW_PERMISSIONS),
            (features.token_reviews, UPPER_TOKEN_REVIEW_PERMISSIONS),
            (features.services, UPPER_SERVICE_PERMISSIONS),
            (features.volumes, UPPER_PV_PERMISSIONS),
            (features.members.is_some(), UPPER_MEMBER_PERMISSIONS),
            (features.upper_identity, UPPER_IDENTITY_PERMISSIONS),
            (features.namespaces, UPPER_NAMESPACE_PERMISSIONS),
            (features.kueue_quota, UPPER_KUEUE_QUOTA_PERMISSIONS),
        ],
        Side::Lower => vec![
            (true, LOWER_PERMISSIONS),
            (features.services, LOWER_SERVICE_PERMISSIONS),
            (features.volumes, LOWER_PV_PERMISSIONS),
            (features.namespaces, LOWER_NAMESPACE_PERMISSIONS),
        ],
    };
    let mut needed: Vec<Permission> = tables
        .into_iter()
        .filter(|(on, _)| *on)
        .flat_map(|(_, table)| table.iter().copied())
        .collect();
    if let (Side::Upper, Some(namespace)) = (side, features.leader_election) {
        needed.extend(LEADER_ELECTION_VERBS.map(|verb| Permission {
            namespace: Some(namespace),
            ..grouped(verb, "coordination.k8s.io", "leases")
        }));
    }
    if let (Side::Upper, Some(namespace)) = (side, features.members) {
        needed.extend(MEMBER_SECRET_VERBS.map(|verb| Permission {
            namespace: Some(namespace),
            ..perm(verb, "secrets")
        }));
    }
    needed
}

#[cfg(test)]
pub(crate) mod tests {
    use tower::{Service, ServiceExt};

    use super::*;

    /// The value of the series line `series` in `text`.
    fn value(text: &str, series: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {series} in {text}"))
    }

    /// Requests through a rate limiter of `burst` per `window`: each is recorded once, and
    /// the time they were held adds up to the windows they waited for.
    #[tokio::test]
    async fn the_rate_limiters_hold_is_recorded_per_request() {
        // (burst, window ms, requests, least total hold ms, most total hold ms)
        let cases = [
            (10, 40, 5, 0, 30),
            (1, 40, 3, 70, 1000),
            (2, 40, 5, 70, 1000),
        ];
        for (burst, window, requests, least, most) in cases {
            let metrics = Metrics::default();
            let held = metrics.api_waits(Side::Lower).throttle;
            let mut service = ServiceBuilder::new()
                .layer(TimedReady(held))
                .layer(RateLimitLayer::new(burst, Duration::from_millis(window)))
                .service_fn(|()| async { Ok::<_, BoxError>(()) });
            for _ in 0..requests {
                service.ready().await.unwrap().call(()).await.unwrap();
            }
            let text = metrics.render();
            let series = "tensile_api_throttle_seconds";
            let label = "{cluster=\"lower\"}";
            let count = value(&text, &format!("{series}_count{label}"));
            let sum = value(&text, &format!("{series}_sum{label}")) * 1000.0;
            let case = format!("{burst} per {window} ms, {requests} requests: held {sum} ms");
            assert_eq!(count, f64::from(requests), "{case}");
            assert!(sum >= f64::from(least) && sum <= f64::from(most), "{case}");
        }
    }

    #[test]
    fn needed_permissions_follow_the_features() {
        let has = |side, features, wanted: &str| {
            needed_permissions(side, features)
                .iter()
                .any(|p| p.to_string() == wanted)
        };
        let all = Features {
            services: true,
            volumes: true,
            node_lease: true,
            access_reviews: true,
            token_reviews: true,
            leader_election: Some("tensile-system"),
            members: Some("tensile-members"),
            upper_identity: true,
            namespaces: true,
            kueue_quota: true,
        };
        let none = Features::default();
        let cases = [
            (Side::Upper, none, "get pods", true),
            (Side::Upper, none, "patch pods/status", true),
            (Side::Upper, none, "list pods", true),
            (
                Side::Upper,
                none,
                "patch leases.coordination.k8s.io in kube-node-lease",
                false,
            ),
            (
                Side::Upper,
                all,
                "patch leases.coordination.k8s.io in kube-node-lease",
                true,
            ),
            (
                Side::Upper,
                all,
                "create leases.coordination.k8s.io in kube-node-lease",
                true,
            ),
            (
                Side::Upper,
                none,
                "create tokenreviews.authentication.k8s.io",
                false,
            ),
            (
                Side::Upper,
                all,
                "create tokenreviews.authentication.k8s.io",
                true,
            ),
            (
                Side::Upper,
                all,
                "create subjectaccessreviews.authorization.k8s.io",
                true,
            ),
            (Side::Upper, none, "watch services", false),
            (Side::Upper, all, "watch services", true),
            (
                Side::Upper,
                all,
                "update leases.coordination.k8s.io in tensile-system",
                true,
            ),
            (
                Side::Upper,
                none,
                "get leases.coordination.k8s.io in tensile-system",
                false,
            ),
            (
                Side::Lower,
                all,
                "get leases.coordination.k8s.io in tensile-system",
                false,
            ),
            (
                Side::Upper,
                none,
                "patch clusterqueues.kueue.x-k8s.io",
                false,
            ),
            (Side::Upper, all, "patch clusterqueues.kueue.x-k8s.io", true),
            (Side::Upper, all, "watch clusterqueues.kueue.x-k8s.io", true),
            (Side::Lower, all, "get clusterqueues.kueue.x-k8s.io", false),
            (Side::Lower, none, "get namespaces", true),
            (Side::Lower, none, "create pods/exec", true),
            (Side::Lower, none, "patch pods/ephemeralcontainers", true),
            (Side::Lower, none, "update services", false),
            (Side::Lower, all, "update services", true),
            (
                Side::Lower,
                all,
                "watch storageclasses.storage.k8s.io",
                true,
            ),
            (
                Side::Lower,
                all,
                "create leases.coordination.k8s.io in kube-node-lease",
                false,
            ),
        ];
        let members = [
            (Side::Upper, none, "create pods/eviction", false),
            (Side::Upper, all, "create pods/eviction", true),
            (Side::Upper, all, "patch secrets in tensile-members", true),
            (Side::Upper, all, "watch secrets in tensile-members", true),
            (Side::Upper, all, "delete nodes", true),
            (Side::Lower, all, "create pods/eviction", false),
            (Side::Upper, none, "create serviceaccounts/token", false),
            (Side::Upper, all, "create serviceaccounts/token", true),
        ];
        for (side, features, wanted, want) in cases.into_iter().chain(members) {
            assert_eq!(has(side, features, wanted), want, "{side}: {wanted}");
        }
    }

    #[test]
    fn no_permission_is_listed_twice() {
        for side in [Side::Upper, Side::Lower] {
            let all = Features {
                services: true,
                volumes: true,
                node_lease: true,
                access_reviews: true,
                token_reviews: true,
                leader_election: Some("tensile-system"),
                members: Some("tensile-members"),
                upper_identity: true,
                namespaces: true,
                kueue_quota: true,
            };
            let listed: Vec<String> = needed_permissions(side, all)
                .iter()
                .map(ToString::to_string)
                .collect();
            let unique: std::collections::BTreeSet<&String> = listed.iter().collect();
            assert_eq!(unique.len(), listed.len(), "{side}: {listed:?}");
        }
    }

    /// A kubeconfig of one cluster and one user, with `cluster` and `user` as the fields
    /// of each (YAML flow mappings).
    pub(crate) fn kubeconfig(cluster: &str, user: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\n\
             clusters: [{{name: lower, cluster: {{server: 'https://203.0.113.1:6443', {cluster}}}}}]\n\
             users: [{{name: vk, user: {{{user}}}}}]\n\
             contexts: [{{name: lower, context: {{cluster: lower, user: vk}}}}]\n\
             current-context: lower\n"
        )
    }

    #[test]
    fn a_kubeconfig_from_a_secret_may_only_hold_inline_credentials() {
        let ca = "certificate-authority-data: Q0E=";
        // (case, cluster fields, user fields, the FromSecret error's text or None for
        // accepted). The operator's own file takes every one of them.
        let cases: [(&str, &str, &str, Option<&str>); 16] = [
            ("join's: inline token and CA", ca, "token: abc", None),
            (
                "inline client certificate and key",
                ca,
                "client-certificate-data: Q0VSVA==, client-key-data: S0VZ",
                None,
            ),
            ("no CA (system roots)", "", "token: abc", None),
            (
                "skip verify",
                "insecure-skip-tls-verify: true",
                "token: abc",
                None,
            ),
            (
                "exec",
                ca,
                "exec: {apiVersion: client.authentication.k8s.io/v1, command: sh, args: [-c, 'touch /tmp/x; exit 1']}",
                Some("sets users[vk].user.exec: a kubeconfig from a Secret may not run a command"),
            ),
            (
                "auth-provider",
                ca,
                "auth-provider: {name: gcp, config: {cmd-path: /bin/sh}}",
                Some(
                    "sets users[vk].user.auth-provider: a kubeconfig from a Secret may not run a command",
                ),
            ),
            (
                "tokenFile: the reader's own ServiceAccount token",
                ca,
                "tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token",
                Some(
                    "sets users[vk].user.tokenFile: a kubeconfig from a Secret may not name a file to read",
                ),
            ),
            (
                "tokenFile beside a token",
                ca,
                "token: abc, tokenFile: /etc/shadow",
                Some("sets users[vk].user.tokenFile"),
            ),
            (
                "client-certificate path",
                ca,
                "client-certificate: /etc/kubernetes/pki/admin.crt, client-key-data: S0VZ",
                Some(
                    "sets users[vk].user.client-certificate: a kubeconfig from a Secret may not name a file",
                ),
            ),
            (
                "client-key path",
                ca,
                "client-certificate-data: Q0VSVA==, client-key: /etc/kubernetes/pki/admin.key",
                Some(
                    "sets users[vk].user.client-key: a kubeconfig from a Secret may not name a file",
                ),
            ),
            (
                "certificate-authority path",
                "certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
                "token: abc",
                Some(
                    "sets clusters[lower].cluster.certificate-authority: a kubeconfig from a Secret may not name a file",
                ),
            ),
            (
                "basic auth",
                ca,
                "username: admin, password: hunter2",
                Some("sets users[vk].user.username: basic authentication is refused"),
            ),
            (
                "password alone",
                ca,
                "password: hunter2",
                Some("sets users[vk].user.password"),
            ),
            (
                "impersonation",
                ca,
                "token: abc, as: system:admin",
                Some("sets users[vk].user.as: impersonation is refused"),
            ),
            (
                "impersonated groups",
                ca,
                "token: abc, as-groups: [system:masters]",
                Some("sets users[vk].user.as-groups"),
            ),
            (
                "impersonated extra",
                ca,
                "token: abc, as-user-extra: {scopes: [all]}",
                Some("sets users[vk].user.as-user-extra"),
            ),
        ];
        for (case, cluster, user, want) in cases {
            let text = kubeconfig(cluster, user);
            if let Err(error) = read_kubeconfig(&text, Trust::Operator) {
                panic!("{case}: the operator's own file is refused: {error}");
            }
            match (read_kubeconfig(&text, Trust::FromSecret), want) {
                (Ok(_), None) => {}
                (Err(error), Some(needle)) => {
                    assert!(error.to_string().contains(needle), "{case}: {error}");
                }
                (got, want) => panic!("{case}: got {got:?}, want {want:?}"),
            }
        }
        // A user that no context names is checked too (a later current-context edit would
        // turn it on).
        let spare = format!(
            "{}users: [{{name: vk, user: {{token: abc}}}}, {{name: spare, user: {{exec: {{command: sh}}}}}}]\n",
            kubeconfig(ca, "token: abc").replace("users: [{name: vk, user: {token: abc}}]\n", "")
        );
        let error = read_kubeconfig(&spare, Trust::FromSecret).unwrap_err();
        assert!(
            error.to_string().contains("users[spare].user.exec"),
            "{error}"
        );
    }

    #[test]
    fn an_unreadable_kubeconfig_is_never_quoted() {
        let token = "eyJhbGciOiJSUzI1NiJ9.c2VjcmV0LXRva2VuLXRleHQ";
        for text in [
            // Malformed YAML right after the token.
            format!("users:\n- name: vk\n  user:\n    token: {token}\n  : [\n"),
            // A token where a mapping belongs (a type error names what it found).
            format!("users: {token}\n"),
            format!("users:\n- name: vk\n  user: \"{token}\"\n"),
            // Unterminated quoted token.
            format!("users:\n- name: vk\n  user:\n    token: \"{token}\n"),
            format!("clusters: [{{name: {token}, cluster: 7}}]\n"),
        ] {
            for trust in [Trust::Operator, Trust::FromSecret] {
                let error = read_kubeconfig(&text, trust).unwrap_err().to_string();
                assert!(error.contains("cannot be read as a kubeconfig"), "{error}");
                assert!(!error.contains("c2VjcmV0"), "the token is quoted: {error}");
            }
        }
        let error = read_kubeconfig(&kubeconfig("", "token: [abc"), Trust::FromSecret);
        assert!(
            error.unwrap_err().to_string().contains("at line"),
            "where, at least"
        );
    }

    /// The loader of kubeconfig files: a Secret's mounted as a file asks for no file of the
    /// reader's, an operator's may.
    #[tokio::test]
    async fn a_kubeconfig_file_is_loaded_at_its_trust() {
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("token");
        std::fs::write(&token, "file-token").unwrap();
        let reads_a_file = dir.path().join("reads-a-file.kubeconfig");
        let inline = dir.path().join("inline.kubeconfig");
        let user = format!("tokenFile: {}", token.display());
        std::fs::write(&reads_a_file, kubeconfig("", &user)).unwrap();
        std::fs::write(&inline, kubeconfig("", "token: abc")).unwrap();
        for trust in [Trust::Operator, Trust::FromSecret] {
            let config = load_kubeconfig(Side::Lower, &inline, trust).await.unwrap();
            assert_eq!(config.cluster_url.to_string(), "https://203.0.113.1:6443/");
        }
        let config = load_kubeconfig(Side::Lower, &reads_a_file, Trust::Operator)
            .await
            .unwrap();
        assert_eq!(
            config.auth_info.token_file,
            Some(token.display().to_string())
        );
        let error = load_kubeconfig(Side::Lower, &reads_a_file, Trust::FromSecret)
            .await
            .unwrap_err()
            .to_string();
        let path = reads_a_file.display();
        assert!(
            error.starts_with(&format!(
                "lower cluster: kubeconfig {path}, from a Secret, sets users[vk].user.tokenFile: "
            )),
            "{error}"
        );
        let missing = dir.path().join("missing");
        let error = load_kubeconfig(Side::Lower, &missing, Trust::FromSecret)
            .await
            .unwrap_err()
            .to_string();
        assert!(error.contains("cannot read kubeconfig"), "{error}");
    }
}
