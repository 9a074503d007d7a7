//! Namespace remapping at the lower client (`--lower-namespace` other than `same`): a tower
//! layer under which the lower cluster speaks upper namespace names. Every path it is sent
//! names the lower namespace ([`Mapping::to_lower`]), every object it is sent is written
//! in the lower namespace, and every object it answers with (a list, a watch event, an
//! Event's involved object, an endpoint's target, a volume's claim) names the upper one
//! ([`Mapping::to_view`]). Controllers, stores and the kubelet API thus work on upper names
//! alone, and only this module and [`crate::translate::namespace`] know there are two.
//! What is not a Kubernetes object in JSON (logs, exec and port-forward streams, a kubelet's
//! metrics text, the metrics API) passes as it is.

use std::pin::Pin;
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::{FutureExt, Stream, StreamExt};
use http::{HeaderValue, Method, Request, Response, Uri, header};
use http_body_util::combinators::UnsyncBoxBody as BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use kube::client::Body;
use tower::{BoxError, Layer, Service};

use crate::translate::namespace::{
    Mapping, is_namespace_path, rewrite_body, rewrite_event, rewrite_path,
};

/// The namespace mapping of one member, shared by its lower client and the controller that
/// keeps it ([`crate::controllers::namespace`]).
#[derive(Debug)]
pub struct NamespaceView {
    mapping: RwLock<Mapping>,
}

impl NamespaceView {
    /// A view over `mapping`.
    pub fn new(mapping: Mapping) -> Arc<Self> {
        Arc::new(Self {
            mapping: RwLock::new(mapping),
        })
    }

    /// The mapping, to read.
    pub fn read(&self) -> RwLockReadGuard<'_, Mapping> {
        self.mapping.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The mapping, to change.
    pub fn write(&self) -> RwLockWriteGuard<'_, Mapping> {
        self.mapping.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lower name of the namespace the controllers call `view` (`None`: not known
    /// yet).
    pub fn to_lower(&self, view: &str) -> Option<String> {
        self.read().to_lower(view)
    }

    /// The name the controllers see for the lower namespace `lower`.
    pub fn to_view(&self, lower: &str) -> String {
        self.read().to_view(lower)
    }
}

/// The layer; see the module doc.
#[derive(Clone, Debug)]
pub struct ViewLayer {
    view: Arc<NamespaceView>,
}

impl ViewLayer {
    /// The layer of `view`.
    pub fn new(view: Arc<NamespaceView>) -> Self {
        Self { view }
    }
}

impl<S> Layer<S> for ViewLayer {
    type Service = ViewService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ViewService {
            inner,
            view: self.view.clone(),
        }
    }
}

/// The service [`ViewLayer`] makes.
#[derive(Clone, Debug)]
pub struct ViewService<S> {
    inner: S,
    view: Arc<NamespaceView>,
}

/// The answer's body, rewritten or passed through.
type ViewBody = BoxBody<Bytes, BoxError>;

/// What a request asks for, as far as the rewriting goes.
#[derive(Clone, Copy, Debug)]
struct Asked {
    /// The objects are Namespaces (their names are namespace names).
    namespaces: bool,
    /// A watch: the answer is a stream of events, one JSON object a line.
    watch: bool,
    /// The metrics API: its namespaces are kept as the lower cluster names them (the
    /// kubelet API matches them with the kubelets' own series).
    metrics: bool,
}

fn asked(uri: &Uri) -> Asked {
    let path = uri.path();
    let watch = uri.query().is_some_and(|q| {
        q.split('&')
            .any(|pair| matches!(pair, "watch=true" | "watch=1"))
    });
    Asked {
        namespaces: is_namespace_path(path),
        watch,
        metrics: path.starts_with("/apis/metrics.k8s.io/"),
    }
}

/// `uri` with its namespace mapped to the lower one (`None`: it names none); `Err` for an
/// upper namespace not known yet.
fn lower_uri(uri: &Uri, view: &NamespaceView) -> Result<Option<Uri>, BoxError> {
    let Some(path) = rewrite_path(uri.path(), |ns| view.to_lower(ns)) else {
        return Ok(None);
    };
    let path = path.map_err(|namespace| {
        BoxError::from(format!(
            "upper namespace {namespace} is not mapped to a lower namespace yet"
        ))
    })?;
    let path_and_query = match uri.query() {
        Some(query) => format!("{path}?{query}"),
        None => path,
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(path_and_query.parse().map_err(BoxError::from)?);
    Ok(Some(Uri::from_parts(parts).map_err(BoxError::from)?))
}

fn is_json(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"))
}

/// `bytes` (a JSON object) rewritten by `rewrite`; as they were if they are no JSON.
fn rewritten(bytes: &[u8], rewrite: impl FnOnce(&mut serde_json::Value)) -> Option<Vec<u8>> {
    let mut value: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    rewrite(&mut value);
    serde_json::to_vec(&value).ok()
}

impl<S, B> Service<Request<Body>> for ViewService<S>
where
    S: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<ViewBody>;
    type Error = BoxError;
    type Future =
        Pin<Box<dyn Future<Output = Result<Response<ViewBody>, BoxError>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let view = self.view.clone();
        let (mut parts, body) = request.into_parts();
        let asked = asked(&parts.uri);
        match lower_uri(&parts.uri, &view) {
            Ok(Some(uri)) => parts.uri = uri,
            Ok(None) => {}
            Err(error) => return Box::pin(futures::future::ready(Err(error))),
        }
        let body = if matches!(parts.method, Method::POST | Method::PUT) {
            match lower_body(body, asked.namespaces, &view) {
                Ok((body, rewritten)) => {
                    if rewritten {
                        parts.headers.remove(header::CONTENT_LENGTH);
                    }
                    body
                }
                Err(error) => return Box::pin(futures::future::ready(Err(error))),
            }
        } else {
            body
        };
        let response = self.inner.call(Request::from_parts(parts, body));
        Box::pin(async move {
            let response = response.await.map_err(Into::into)?;
            let (mut parts, body) = response.into_parts();
            let body = body.map_err(Into::into);
            if asked.metrics || !is_json(&parts.headers) {
                return Ok(Response::from_parts(parts, BoxBody::new(body)));
            }
            parts.headers.remove(header::CONTENT_LENGTH);
            if asked.watch {
                let events = watch_events(body.into_data_stream(), view, asked.namespaces);
                let frames = events.map(|chunk| chunk.map(Frame::data));
                return Ok(Response::from_parts(
                    parts,
                    BoxBody::new(StreamBody::new(frames)),
                ));
            }
            let bytes = body.collect().await?.to_bytes();
            let to_view = |ns: &str| view.to_view(ns);
            let bytes = rewritten(&bytes, |v| rewrite_body(v, asked.namespaces, &to_view))
                .map_or(bytes, Bytes::from);
            parts
                .headers
                .insert(header::CONTENT_LENGTH, HeaderValue::from(bytes.len()));
            Ok(Response::from_parts(
                parts,
                BoxBody::new(Full::new(bytes).map_err(|never| match never {})),
            ))
        })
    }
}

/// A request's body (an object kube sends whole) with its namespaces mapped to the lower
/// ones; whether it was rewritten.
fn lower_body(
    mut body: Body,
    namespaces: bool,
    view: &NamespaceView,
) -> Result<(Body, bool), BoxError> {
    // kube sends an object as one buffer, ready at once.
    let bytes = match body.frame().now_or_never() {
        None => return Err("a request body that is not ready at once (a stream)".into()),
        Some(None) => return Ok((Body::from(Bytes::new()), false)),
        Some(Some(frame)) => frame
            .map_err(BoxError::from)?
            .into_data()
            .map_err(|_| BoxError::from("a request body frame that is no data"))?,
    };
    if !hyper::body::Body::is_end_stream(&body) {
        return Err("a request body of more than one buffer".into());
    }
    // A namespace not known yet failed the path already (a Namespace's own name aside:
    // it is read before it is created).
    let to_lower = |ns: &str| view.to_lower(ns).unwrap_or_else(|| ns.to_owned());
    Ok(
        match rewritten(&bytes, |v| rewrite_body(v, namespaces, &to_lower)) {
            Some(json) => (Body::from(json), true),
            None => (Body::from(bytes), false),
        },
    )
}

/// A watch's body, one event a line, with each event's object rewritten to upper names.
fn watch_events<D>(
    data: D,
    view: Arc<NamespaceView>,
    namespaces: bool,
) -> impl Stream<Item = Result<Bytes, BoxError>> + Send + 'static
where
    D: Stream<Item = Result<Bytes, BoxError>> + Send + 'static,
{
    let data = Box::pin(data);
    futures::stream::unfold(
        (data, Vec::<u8>::new(), false),
        move |(mut data, mut pending, mut ended)| {
            let view = view.clone();
            async move {
                loop {
                    if ended {
                        if pending.is_empty() {
                            return None;
                        }
                        let line = std::mem::take(&mut pending);
                        return Some((
                            Ok(event_line(&line, &view, namespaces)),
                            (data, pending, ended),
                        ));
                    }
                    match data.next().await {
                        Some(Ok(chunk)) => {
                            pending.extend_from_slice(&chunk);
                            if let Some(end) = pending.iter().rposition(|&b| b == b'\n') {
                                let rest = pending.split_off(end + 1);
                                let lines = std::mem::replace(&mut pending, rest);
                                let mut out = Vec::with_capacity(lines.len());
                                for line in lines.split_inclusive(|&b| b == b'\n') {
                                    out.extend_from_slice(&event_line(line, &view, namespaces));
                                }
                                return Some((Ok(Bytes::from(out)), (data, pending, ended)));
                            }
                        }
                        Some(Err(error)) => return Some((Err(error), (data, pending, true))),
                        None => ended = true,
                    }
                }
            }
        },
    )
}

/// One line of a watch (a JSON event, maybe with its newline), rewritten.
fn event_line(line: &[u8], view: &NamespaceView, namespaces: bool) -> Bytes {
    let (json, newline) = match line.strip_suffix(b"\n") {
        Some(json) => (json, true),
        None => (line, false),
    };
    let to_view = |ns: &str| view.to_view(ns);
    let mut out = rewritten(json, |v| rewrite_event(v, namespaces, &to_view))
        .unwrap_or_else(|| json.to_vec());
    if newline {
        out.push(b'\n');
    }
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use crate::translate::namespace::Mode;

    use super::*;

    fn view() -> Arc<NamespaceView> {
        let mut mapping = Mapping::new(Mode::Prefixed, "c1".into());
        mapping.set("shop", "shop-c1").unwrap();
        NamespaceView::new(mapping)
    }

    #[tokio::test]
    async fn rewrites_a_watch_split_anywhere() {
        let events = concat!(
            r#"{"type":"ADDED","object":{"kind":"Pod","metadata":{"namespace":"shop-c1","name":"a"}}}"#,
            "\n",
            r#"{"type":"MODIFIED","object":{"kind":"Pod","metadata":{"namespace":"shop-c1","name":"b"}}}"#,
            "\n",
        );
        for split in [1, 7, 50, events.len() - 1] {
            let chunks: Vec<Result<Bytes, BoxError>> = vec![
                Ok(Bytes::copy_from_slice(&events.as_bytes()[..split])),
                Ok(Bytes::copy_from_slice(&events.as_bytes()[split..])),
            ];
            let out: Vec<u8> = watch_events(futures::stream::iter(chunks), view(), false)
                .map(|c| c.unwrap().to_vec())
                .concat()
                .await;
            let text = String::from_utf8(out).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            assert_eq!(lines.len(), 2, "{split}: {text}");
            for line in lines {
                let event: serde_json::Value = serde_json::from_str(line).unwrap();
                assert_eq!(event["object"]["metadata"]["namespace"], "shop", "{split}");
            }
        }
    }

    #[test]
    fn maps_request_paths_and_tells_what_was_asked() {
        let view = view();
        let uri: Uri = "https://h/api/v1/namespaces/shop/pods?watch=true&labelSelector=a%3Db"
            .parse()
            .unwrap();
        let lower = lower_uri(&uri, &view).unwrap().unwrap();
        assert_eq!(
            lower.to_string(),
            "https://h/api/v1/namespaces/shop-c1/pods?watch=true&labelSelector=a%3Db"
        );
        let a = asked(&uri);
        assert!(a.watch && !a.namespaces && !a.metrics);
        let a = asked(&"/apis/metrics.k8s.io/v1beta1/pods".parse().unwrap());
        assert!(a.metrics && !a.watch);
        assert!(asked(&"/api/v1/namespaces/shop".parse().unwrap()).namespaces);
        assert!(
            lower_uri(&"/api/v1/pods".parse().unwrap(), &view)
                .unwrap()
                .is_none()
        );
        let unknown = lower_uri(&"/api/v1/namespaces/new/pods".parse().unwrap(), &view);
        assert!(unknown.is_err(), "{unknown:?}");
    }
}
