//! A fault-injecting proxy in front of one API server, on loopback: clients talk plain HTTP
//! to it (a kubeconfig with an `http://` server and no credentials), and it forwards each
//! request with the cluster's admin identity. While a fault is set, a share of requests is
//! answered 429 (with `Retry-After: 1`), 500 or 503, cut off without an answer, or delayed,
//! or its watches are made to expire (410 Gone, as when a resourceVersion is too old), or
//! the events of its watches of one resource are held back (a watch that lags); it counts
//! every request it receives, by verb and resource, so a test can bound a client's
//! request rate during a storm and count the relists and writes an expiry causes.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use futures::FutureExt;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use kube::Client;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the proxy answers with: the API server's body, or one of its own.
type ProxyBody = UnsyncBoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// The watch event an API server ends a watch with when its resourceVersion is too old
/// (compacted away): kube-runtime's watcher relists on its code 410.
const EXPIRED_EVENT: &str = concat!(
    r#"{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","metadata":{},"#,
    r#""status":"Failure","message":"too old resource version (injected by the fault proxy)","#,
    r#""reason":"Expired","code":410}}"#,
    "\n"
);

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
    /// Only watches that resume from a resourceVersion: answered as an API server answers
    /// one whose version is too old, a stream of one `ERROR` event (410, `Expired`).
    /// Other requests are forwarded.
    Expired,
    /// Only watches that resume from a resourceVersion: answered `410 Gone`. Other
    /// requests are forwarded.
    Gone,
    /// Only requests for resources: answered `403 Forbidden`, as when the client's RBAC
    /// is revoked. Discovery and `/version`, which every identity may read, are forwarded.
    Forbidden,
}

impl Fault {
    /// Whether the fault hits only watches that resume from a resourceVersion.
    fn resumed_watches_only(self) -> bool {
        matches!(self, Self::Expired | Self::Gone)
    }
}

#[derive(Debug)]
struct State {
    fault: Fault,
    /// Out of every 100 requests, how many the fault hits.
    percent: u64,
    /// GETs of this path answered `500` (besides `fault`), this many more times.
    failing_gets: Option<(String, u64)>,
}

/// A running proxy; dropping it stops it.
pub struct FaultProxy {
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

/// What the proxy's connections share.
struct Shared {
    state: Mutex<State>,
    received: AtomicU64,
    faulted: AtomicU64,
    /// Watches ended or refused with a 410.
    expired: AtomicU64,
    /// Requests by verb and resource.
    requests: Mutex<Requests>,
    /// Bumped to end every open watch with an expiry.
    expire: watch::Sender<u64>,
    /// The resource whose watch events are held back, if any.
    held: watch::Sender<Option<String>>,
}

impl Shared {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn requests(&self) -> std::sync::MutexGuard<'_, Requests> {
        self.requests.lock().unwrap_or_else(|e| e.into_inner())
    }
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
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                fault: Fault::None,
                percent: 0,
                failing_gets: None,
            }),
            received: AtomicU64::new(0),
            faulted: AtomicU64::new(0),
            expired: AtomicU64::new(0),
            requests: Mutex::new(Requests::default()),
            expire: watch::Sender::new(0),
            held: watch::Sender::new(None),
        });
        let task = tokio::spawn(serve(listener, upstream, shared.clone()));
        Ok(Self {
            url: format!("http://{address}"),
            shared,
            task,
        })
    }

    /// From now on, `percent` of requests (0–100) get `fault`; for [`Fault::Expired`] and
    /// [`Fault::Gone`], `percent` of the watches that resume from a resourceVersion.
    pub fn set(&self, fault: Fault, percent: u64) {
        let mut state = self.shared.state();
        state.fault = fault;
        state.percent = percent.min(100);
    }

    /// The next `count` GETs of `path` (e.g. `/api/v1/nodes/vk-a`) are answered `500`,
    /// whatever [`FaultProxy::set`] says for the others.
    pub fn fail_gets(&self, path: &str, count: u64) {
        self.shared.state().failing_gets = Some((path.to_owned(), count));
    }

    /// How many of the GETs [`FaultProxy::fail_gets`] asked to fail are still to come.
    pub fn gets_left_to_fail(&self) -> u64 {
        self.shared
            .state()
            .failing_gets
            .as_ref()
            .map_or(0, |(_, left)| *left)
    }

    /// Ends every watch open now with an `ERROR` event (410, `Expired`), as an API server
    /// does when the watch falls too far behind.
    pub fn expire_watches(&self) {
        self.shared
            .expire
            .send_modify(|generation| *generation += 1);
    }

    /// From now on, the events of every watch of `resource` (`pods`, …), open now or
    /// opened later, are held back until [`FaultProxy::release_watches`]: the client's
    /// watch stays open and its requests are answered, but its store stops moving, as when
    /// a watch lags far behind. Lists and other requests are forwarded.
    pub fn hold_watches(&self, resource: &str) {
        self.shared.held.send_replace(Some(resource.to_owned()));
    }

    /// Lets the events [`FaultProxy::hold_watches`] held back through, in order.
    pub fn release_watches(&self) {
        self.shared.held.send_replace(None);
    }

    /// Requests received so far.
    pub fn received(&self) -> u64 {
        self.shared.received.load(Ordering::Relaxed)
    }

    /// Requests a fault hit so far.
    pub fn faulted(&self) -> u64 {
        self.shared.faulted.load(Ordering::Relaxed)
    }

    /// Watches ended or refused with a 410 so far.
    pub fn expired(&self) -> u64 {
        self.shared.expired.load(Ordering::Relaxed)
    }

    /// Requests received so far, by verb and resource.
    pub fn requests(&self) -> Requests {
        self.shared.requests().clone()
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

/// Requests counted by verb (`list`, `watch`, `get`, `create`, `update`, `patch`,
/// `delete`, `deletecollection`) and resource (`pods`, `pods/status`, `leases`, …).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Requests {
    by_route: BTreeMap<(&'static str, String), u64>,
    /// Those with a field selector, by verb, resource and the selector.
    by_selector: BTreeMap<(&'static str, String, String), u64>,
}

/// What `now` counts beyond `before`.
fn counted_since<K: Ord + Clone>(
    now: &BTreeMap<K, u64>,
    before: &BTreeMap<K, u64>,
) -> BTreeMap<K, u64> {
    now.iter()
        .filter_map(|(key, n)| {
            let n = n - before.get(key).copied().unwrap_or_default();
            (n > 0).then(|| (key.clone(), n))
        })
        .collect()
}

/// The verbs that change something.
const WRITES: [&str; 5] = ["create", "update", "patch", "delete", "deletecollection"];

impl Requests {
    /// The requests counted here and not in `before` (an earlier count).
    #[must_use]
    pub fn since(&self, before: &Requests) -> Requests {
        Requests {
            by_route: counted_since(&self.by_route, &before.by_route),
            by_selector: counted_since(&self.by_selector, &before.by_selector),
        }
    }

    /// Requests of `verb` to `resource` with the field selector `selector`
    /// (`spec.nodeName=vk`).
    pub fn count_selected(&self, verb: &str, resource: &str, selector: &str) -> u64 {
        self.by_selector
            .iter()
            .filter(|((v, r, f), _)| *v == verb && r == resource && f == selector)
            .map(|(_, n)| n)
            .sum()
    }

    /// Requests of `verb` to `resource` (`pods` counts neither `pods/status` nor `pods/log`).
    pub fn count(&self, verb: &str, resource: &str) -> u64 {
        self.by_route
            .iter()
            .filter(|((v, r), _)| *v == verb && r == resource)
            .map(|(_, n)| n)
            .sum()
    }

    /// Requests of `verb`, to any resource.
    pub fn of_verb(&self, verb: &str) -> u64 {
        self.by_route
            .iter()
            .filter(|((v, _), _)| *v == verb)
            .map(|(_, n)| n)
            .sum()
    }

    /// Writes to `resource` and its subresources (`pods` counts `pods/status` too).
    pub fn writes_to(&self, resource: &str) -> u64 {
        self.by_route
            .iter()
            .filter(|((v, r), _)| {
                WRITES.contains(v)
                    && r.strip_prefix(resource)
                        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
            })
            .map(|(_, n)| n)
            .sum()
    }

    /// Every write.
    pub fn writes(&self) -> u64 {
        self.by_route
            .iter()
            .filter(|((v, _), _)| WRITES.contains(v))
            .map(|(_, n)| n)
            .sum()
    }

    /// Every request.
    pub fn total(&self) -> u64 {
        self.by_route.values().sum()
    }

    fn add(&mut self, verb: &'static str, resource: String, selector: Option<String>) {
        if let Some(selector) = selector {
            *self
                .by_selector
                .entry((verb, resource.clone(), selector))
                .or_default() += 1;
        }
        *self.by_route.entry((verb, resource)).or_default() += 1;
    }
}

impl fmt::Display for Requests {
    /// `list pods 2, watch pods 3, patch leases 1`, or `none`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.by_route.is_empty() {
            return f.write_str("none");
        }
        let counts: Vec<String> = self
            .by_route
            .iter()
            .map(|((verb, resource), n)| format!("{verb} {resource} {n}"))
            .collect();
        f.write_str(&counts.join(", "))
    }
}

/// What a request asks, read from its method, path and query.
#[derive(Debug, PartialEq, Eq)]
struct Route {
    /// `list`, `watch`, `get`, `create`, … (`None` for other methods).
    verb: Option<&'static str>,
    /// `pods`, `pods/status`, `namespaces`, … (the path outside `/api` and `/apis`).
    resource: String,
    /// A watch that resumes from a resourceVersion (neither empty nor `0`): one an API
    /// server may find too old.
    resumed_watch: bool,
    /// Its field selector, decoded.
    field_selector: Option<String>,
}

impl Route {
    /// Whether it asks for a resource, which RBAC guards (not discovery or `/version`).
    fn names_a_resource(&self) -> bool {
        !self.resource.starts_with('/')
    }

    fn of(method: &http::Method, path: &str, query: Option<&str>) -> Self {
        // The first value of query parameter `name`, decoded.
        let param = |name: &str| {
            form_urlencoded::parse(query.unwrap_or_default().as_bytes())
                .find(|(key, _)| key == name)
                .map(|(_, value)| value.into_owned())
        };
        let watch = param("watch").is_some_and(|v| v == "true" || v == "1");
        let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        // `/api/v1/...` or `/apis/<group>/<version>/...`
        let rest = match segments.as_slice() {
            ["api", _, rest @ ..] => rest,
            ["apis", _, _, rest @ ..] => rest,
            _ => &[][..],
        };
        let rest = match rest {
            ["namespaces", _, namespaced @ ..] if !namespaced.is_empty() => namespaced,
            other => other,
        };
        let (resource, named) = match rest {
            // Discovery and `/version`: reads of one thing, named by their path.
            [] => (path.to_owned(), true),
            [resource] => ((*resource).to_owned(), false),
            [resource, _] => ((*resource).to_owned(), true),
            [resource, _, sub, ..] => (format!("{resource}/{sub}"), true),
        };
        let verb = match *method {
            http::Method::GET if watch => Some("watch"),
            http::Method::GET if named => Some("get"),
            http::Method::GET => Some("list"),
            http::Method::POST => Some("create"),
            http::Method::PUT => Some("update"),
            http::Method::PATCH => Some("patch"),
            http::Method::DELETE if named => Some("delete"),
            http::Method::DELETE => Some("deletecollection"),
            _ => None,
        };
        let resumed_watch =
            watch && param("resourceVersion").is_some_and(|v| !v.is_empty() && v != "0");
        Self {
            verb,
            resource,
            resumed_watch,
            field_selector: param("fieldSelector"),
        }
    }
}

async fn serve(listener: TcpListener, upstream: Client, shared: Arc<Shared>) {
    // Spreads a fault evenly over the requests it may hit: request n is hit when its
    // share crosses a whole request.
    let resumed_watches = Arc::new(AtomicU64::new(0));
    while let Ok((stream, _)) = listener.accept().await {
        let upstream = upstream.clone();
        let shared = shared.clone();
        let resumed_watches = resumed_watches.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
                let n = shared.received.fetch_add(1, Ordering::Relaxed);
                let route = Route::of(
                    request.method(),
                    request.uri().path(),
                    request.uri().query(),
                );
                if let Some(verb) = route.verb {
                    shared.requests().add(
                        verb,
                        route.resource.clone(),
                        route.field_selector.clone(),
                    );
                }
                let (fault, percent, failed_get) = {
                    let mut state = shared.state();
                    let failed_get = request.method() == hyper::Method::GET
                        && match &mut state.failing_gets {
                            Some((path, left)) if *left > 0 && path == request.uri().path() => {
                                *left -= 1;
                                true
                            }
                            _ => false,
                        };
                    (state.fault, state.percent, failed_get)
                };
                if failed_get {
                    shared.faulted.fetch_add(1, Ordering::Relaxed);
                    let (upstream, shared) = (upstream.clone(), shared.clone());
                    return async move {
                        answer(upstream, shared, request, Fault::InternalError, n).await
                    }
                    .boxed();
                }
                let n = if fault == Fault::Forbidden {
                    route.names_a_resource().then_some(n)
                } else if !fault.resumed_watches_only() {
                    Some(n)
                } else if route.resumed_watch {
                    Some(resumed_watches.fetch_add(1, Ordering::Relaxed))
                } else {
                    None
                };
                let hit = fault != Fault::None
                    && n.is_some_and(|n| (n * percent) / 100 != ((n + 1) * percent) / 100);
                if hit {
                    shared.faulted.fetch_add(1, Ordering::Relaxed);
                }
                let fault = if hit { fault } else { Fault::None };
                let upstream = upstream.clone();
                let shared = shared.clone();
                async move { answer(upstream, shared, request, fault, n.unwrap_or_default()).await }
                    .boxed()
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

/// A whole answer of the proxy's own.
fn own_answer(code: u16, content: String) -> Result<hyper::Response<ProxyBody>, ProxyError> {
    let mut response = hyper::Response::builder()
        .status(code)
        .header("content-type", "application/json");
    if code == 429 {
        response = response.header("retry-after", "1");
    }
    let body = http_body_util::Full::new(Bytes::from(content))
        .map_err(|never| match never {})
        .boxed_unsync();
    Ok(response.body(body)?)
}

async fn answer(
    upstream: Client,
    shared: Arc<Shared>,
    request: hyper::Request<Incoming>,
    fault: Fault,
    n: u64,
) -> Result<hyper::Response<ProxyBody>, ProxyError> {
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
        Fault::Gone => Some(410),
        Fault::Forbidden => Some(403),
        Fault::Reset => return Err(ProxyError::Reset),
        Fault::Expired => {
            shared.expired.fetch_add(1, Ordering::Relaxed);
            return own_answer(200, EXPIRED_EVENT.to_owned());
        }
        Fault::Delay(delay) => {
            tokio::time::sleep(delay).await;
            None
        }
        Fault::None | Fault::Mixed => None,
    };
    if let Some(code) = status {
        let (reason, message) = if code == 410 {
            shared.expired.fetch_add(1, Ordering::Relaxed);
            (
                "Expired",
                "too old resource version (injected by the fault proxy)",
            )
        } else if code == 403 {
            ("Forbidden", "forbidden (injected by the fault proxy)")
        } else {
            ("", "injected by the fault proxy")
        };
        let body = serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure",
            "message": message, "reason": reason, "code": code,
        });
        return own_answer(code, body.to_string());
    }
    let (parts, body) = request.into_parts();
    let route = Route::of(&parts.method, parts.uri.path(), parts.uri.query());
    let watch = route.verb == Some("watch");
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
    let forwarded = forwarded.body(kube::client::Body::from(body))?;
    // Subscribed before the watch starts, so an expiry from now on ends it.
    let expire = shared.expire.subscribe();
    let response = upstream.send(forwarded).await?;
    let (parts, body) = response.into_parts();
    let body = if watch && parts.status.is_success() {
        expiring(body, expire, route.resource, shared.clone())
    } else {
        body.map_err(Into::into).boxed_unsync()
    };
    Ok(hyper::Response::from_parts(parts, body))
}

/// A watch's answer, forwarded until [`FaultProxy::expire_watches`], which ends it with
/// [`EXPIRED_EVENT`] (on a line of its own); while [`FaultProxy::hold_watches`] names
/// `resource`, nothing of it is forwarded.
fn expiring(
    body: kube::client::Body,
    mut expire: watch::Receiver<u64>,
    resource: String,
    shared: Arc<Shared>,
) -> ProxyBody {
    /// The watch, and whether what it forwarded so far ends a line.
    type Open = (
        kube::client::Body,
        watch::Receiver<u64>,
        watch::Receiver<Option<String>>,
        bool,
    );
    type Item = Result<Frame<Bytes>, Box<dyn std::error::Error + Send + Sync>>;
    expire.borrow_and_update();
    let held = shared.held.subscribe();
    let stream = futures::stream::unfold(
        Some((body, expire, held, true)),
        move |open: Option<Open>| {
            let shared = shared.clone();
            let resource = resource.clone();
            async move {
                let (mut body, mut expire, mut held, line_ended) = open?;
                loop {
                    let holding = held.borrow_and_update().as_deref() == Some(resource.as_str());
                    tokio::select! {
                        changed = expire.changed() => {
                            // The proxy is gone: end the watch as a closed connection would.
                            changed.ok()?;
                            shared.expired.fetch_add(1, Ordering::Relaxed);
                            let event = if line_ended {
                                EXPIRED_EVENT.to_owned()
                            } else {
                                format!("\n{EXPIRED_EVENT}")
                            };
                            let item: Item = Ok(Frame::data(Bytes::from(event)));
                            return Some((item, None));
                        }
                        // Held or released: look again.
                        changed = held.changed() => changed.ok()?,
                        frame = body.frame(), if !holding => return match frame? {
                            Ok(frame) => {
                                let line_ended = frame
                                    .data_ref()
                                    .and_then(|data| data.last())
                                    .map_or(line_ended, |last| *last == b'\n');
                                Some((Ok(frame), Some((body, expire, held, line_ended))))
                            }
                            Err(error) => Some((Err(error.into()), None)),
                        },
                    }
                }
            }
        },
    );
    StreamBody::new(stream).boxed_unsync()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_named_by_verb_and_resource() {
        use http::Method;
        let cases = [
            (
                Method::GET,
                "/api/v1/pods",
                Some("limit=500&resourceVersion=0"),
                "list",
                "pods",
                false,
            ),
            (
                Method::GET,
                "/api/v1/pods",
                Some("watch=true&resourceVersion=812&allowWatchBookmarks=true"),
                "watch",
                "pods",
                true,
            ),
            (
                Method::GET,
                "/api/v1/namespaces/a/pods",
                Some("watch=1&resourceVersion=0"),
                "watch",
                "pods",
                false,
            ),
            (
                Method::GET,
                "/api/v1/namespaces/a/pods",
                Some("watch=true"),
                "watch",
                "pods",
                false,
            ),
            (
                Method::GET,
                "/api/v1/namespaces/a/pods/p",
                None,
                "get",
                "pods",
                false,
            ),
            (
                Method::PATCH,
                "/api/v1/namespaces/a/pods/p/status",
                None,
                "patch",
                "pods/status",
                false,
            ),
            (
                Method::POST,
                "/api/v1/namespaces/a/pods",
                None,
                "create",
                "pods",
                false,
            ),
            (
                Method::DELETE,
                "/api/v1/namespaces/a/pods/p",
                None,
                "delete",
                "pods",
                false,
            ),
            (
                Method::DELETE,
                "/api/v1/namespaces/a/pods",
                None,
                "deletecollection",
                "pods",
                false,
            ),
            (
                Method::GET,
                "/api/v1/namespaces/a",
                None,
                "get",
                "namespaces",
                false,
            ),
            (
                Method::POST,
                "/api/v1/namespaces",
                None,
                "create",
                "namespaces",
                false,
            ),
            (
                Method::PUT,
                "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/vk",
                None,
                "update",
                "leases",
                false,
            ),
            (
                Method::GET,
                "/apis/discovery.k8s.io/v1/endpointslices",
                Some("watch=true&resourceVersion=9"),
                "watch",
                "endpointslices",
                true,
            ),
            (
                Method::PATCH,
                "/api/v1/nodes/vk/status",
                Some("fieldManager=x"),
                "patch",
                "nodes/status",
                false,
            ),
            (Method::GET, "/version", None, "get", "/version", false),
            (Method::GET, "/apis", None, "get", "/apis", false),
        ];
        for (method, path, query, verb, resource, resumed_watch) in cases {
            let route = Route::of(&method, path, query);
            let want = Route {
                verb: Some(verb),
                resource: resource.to_owned(),
                resumed_watch,
                field_selector: route.field_selector.clone(),
            };
            assert_eq!(route, want, "{method} {path}?{query:?}");
        }
    }

    /// A list's field selector is read decoded, and counted beside its verb and resource.
    #[test]
    fn field_selectors_are_counted_decoded() {
        use http::Method;
        let cases = [
            (
                Some("fieldSelector=spec.nodeName%3Dvk-a&limit=500"),
                Some("spec.nodeName=vk-a"),
            ),
            (
                Some("fieldSelector=spec.nodeName%21%3D"),
                Some("spec.nodeName!="),
            ),
            (Some("fieldSelector=a%3Db%2Cc%21%3Dd+e"), Some("a=b,c!=d e")),
            (Some("limit=500"), None),
            (None, None),
        ];
        let mut requests = Requests::default();
        for (query, selector) in cases {
            let route = Route::of(&Method::GET, "/api/v1/pods", query);
            assert_eq!(route.field_selector.as_deref(), selector, "{query:?}");
            requests.add("list", route.resource, route.field_selector);
        }
        let before = requests.clone();
        requests.add("list", "pods".into(), Some("spec.nodeName=vk-a".into()));
        assert_eq!(requests.count("list", "pods"), 6);
        assert_eq!(
            requests.count_selected("list", "pods", "spec.nodeName=vk-a"),
            2
        );
        let since = requests.since(&before);
        assert_eq!(
            since.count_selected("list", "pods", "spec.nodeName=vk-a"),
            1
        );
        assert_eq!(since.count_selected("list", "pods", "spec.nodeName!="), 0);
        assert_eq!(since.count("list", "pods"), 1);
    }

    #[test]
    fn forbidden_hits_resources_only() {
        use http::Method;
        let cases = [
            ("/api/v1/pods", true),
            ("/api/v1/namespaces/a/pods/p", true),
            ("/apis/apps/v1/deployments", true),
            ("/version", false),
            ("/api/v1", false),
            ("/apis", false),
        ];
        for (path, guarded) in cases {
            let route = Route::of(&Method::GET, path, None);
            assert_eq!(route.names_a_resource(), guarded, "{path}");
        }
    }

    #[test]
    fn writes_are_counted_by_resource_and_since_an_earlier_count() {
        let mut before = Requests::default();
        before.add("list", "pods".into(), None);
        before.add("patch", "pods/status".into(), None);
        let mut after = before.clone();
        for (verb, resource) in [
            ("list", "pods"),
            ("watch", "pods"),
            ("patch", "pods/status"),
            ("create", "pods"),
            ("update", "leases"),
            ("create", "podsecuritypolicies"),
        ] {
            after.add(verb, resource.into(), None);
        }
        let window = after.since(&before);
        let cases = [
            (window.count("list", "pods"), 1),
            (window.count("watch", "pods"), 1),
            (window.count("patch", "pods"), 0),
            (window.of_verb("create"), 2),
            (window.writes_to("pods"), 2),
            (window.writes_to("pods/status"), 1),
            (window.writes_to("leases"), 1),
            (window.writes(), 4),
            (window.total(), 6),
            (after.writes_to("pods"), 3),
        ];
        for (i, (got, want)) in cases.into_iter().enumerate() {
            assert_eq!(got, want, "case {i}: {window}");
        }
        assert_eq!(
            window.to_string(),
            "create pods 1, create podsecuritypolicies 1, list pods 1, patch pods/status 1, \
             update leases 1, watch pods 1"
        );
        assert_eq!(Requests::default().to_string(), "none");
    }
}
