//! A minimal HTTPS client for the webhook on loopback, and a load generator: what the
//! benchmark, the soak run and the server tests drive the real server with.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use rustls::RootCertStore;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls_pki_types::pem::PemObject;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// Anything that went wrong on the client side.
pub type ClientError = Box<dyn std::error::Error + Send + Sync>;

/// Connects to one address, trusting one CA.
#[derive(Clone)]
pub struct Client {
    addr: SocketAddr,
    connector: TlsConnector,
    server_name: ServerName<'static>,
}

/// One HTTP/1.1 connection.
pub struct Connection {
    sender: SendRequest<Body>,
}

/// A response: status and body.
#[derive(Debug, Clone)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// Body bytes.
    pub body: Vec<u8>,
}

impl Client {
    /// A client of `addr` that trusts `ca_pem` and checks the certificate is for `host`
    /// (an IP address or DNS name).
    pub fn new(addr: SocketAddr, ca_pem: &[u8], host: &str) -> Result<Self, ClientError> {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem) {
            roots.add(cert?)?;
        }
        let config = rustls::ClientConfig::builder_with_provider(crate::tls::provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Self {
            addr,
            connector: TlsConnector::from(Arc::new(config)),
            server_name: ServerName::try_from(host.to_owned())?,
        })
    }

    async fn tls(&self) -> Result<tokio_rustls::client::TlsStream<TcpStream>, ClientError> {
        let tcp = TcpStream::connect(self.addr).await?;
        tcp.set_nodelay(true)?;
        Ok(self
            .connector
            .connect(self.server_name.clone(), tcp)
            .await?)
    }

    /// Opens a connection; its driver runs on the current runtime until it closes.
    pub async fn connect(&self) -> Result<Connection, ClientError> {
        let tls = self.tls().await?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(Connection { sender })
    }

    /// The DER of the certificate the server presents to a new connection.
    pub async fn peer_certificate(&self) -> Result<Vec<u8>, ClientError> {
        let tls = self.tls().await?;
        let (_, session) = tls.get_ref();
        let chain = session.peer_certificates().ok_or("no peer certificate")?;
        Ok(chain.first().ok_or("empty chain")?.as_ref().to_vec())
    }
}

impl Connection {
    /// Sends one request and reads the whole response.
    pub async fn send(
        &mut self,
        method: &str,
        path: &str,
        body: Vec<u8>,
    ) -> Result<Reply, ClientError> {
        self.sender.ready().await?;
        let request = axum::http::Request::builder()
            .method(method)
            .uri(path)
            .header("host", "tensile-webhook")
            .header("content-type", "application/json")
            .body(Body::from(body))?;
        let response = self.sender.send_request(request).await?;
        let status = response.status().as_u16();
        let body = axum::body::to_bytes(Body::new(response.into_body()), 64 << 20).await?;
        Ok(Reply {
            status,
            body: body.to_vec(),
        })
    }
}

/// Latencies of a paced run, and what failed.
#[derive(Debug, Default)]
pub struct LoadReport {
    /// Latency of each successful request: from its send, or from when it was due if its
    /// connection was still waiting for the previous answer then (so a server that falls
    /// behind is charged for the wait: no coordinated omission).
    pub latencies: Vec<Duration>,
    /// Requests that failed or did not get HTTP 200.
    pub errors: u64,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl LoadReport {
    /// The `q` quantile (0..=1) of the latencies.
    pub fn quantile(&self, q: f64) -> Duration {
        let mut sorted = self.latencies.clone();
        sorted.sort_unstable();
        if sorted.is_empty() {
            return Duration::ZERO;
        }
        let rank = ((sorted.len() as f64 - 1.0) * q.clamp(0.0, 1.0)).round() as usize;
        sorted[rank.min(sorted.len() - 1)]
    }

    /// Successful requests per second.
    pub fn throughput(&self) -> f64 {
        self.latencies.len() as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Sends `total` POSTs of `body` to `path` at `rate` per second, spread over `connections`
/// connections (each sends its share on a fixed schedule, one at a time).
pub async fn paced_load(
    client: &Client,
    path: &str,
    body: Arc<Vec<u8>>,
    rate: f64,
    total: u64,
    connections: u64,
) -> Result<LoadReport, ClientError> {
    let connections = connections.max(1);
    let interval = Duration::from_secs_f64(1.0 / rate.max(1.0));
    let mut conns = Vec::new();
    for _ in 0..connections {
        conns.push(client.connect().await?);
    }
    let start = Instant::now() + Duration::from_millis(50);
    let mut workers = tokio::task::JoinSet::new();
    for (k, mut conn) in (0..connections).zip(conns) {
        let (body, path) = (body.clone(), path.to_owned());
        workers.spawn(async move {
            let mut report = LoadReport::default();
            let mut i = k;
            while i < total {
                let due = start + interval.mul_f64(i as f64);
                // Behind schedule (the previous answer came late): the wait since `due` is
                // the server's. Otherwise the clock starts at the send, as the timer wakes
                // up to a millisecond after `due`, which is the client's lateness.
                let sent = if Instant::now() >= due {
                    due
                } else {
                    tokio::time::sleep_until(due.into()).await;
                    Instant::now()
                };
                match conn.send("POST", &path, body.as_ref().clone()).await {
                    Ok(reply) if reply.status == 200 => report.latencies.push(sent.elapsed()),
                    _ => report.errors += 1,
                }
                i += connections;
            }
            report
        });
    }
    let mut all = LoadReport::default();
    while let Some(done) = workers.join_next().await {
        let part = done?;
        all.latencies.extend(part.latencies);
        all.errors += part.errors;
    }
    all.elapsed = start.elapsed();
    Ok(all)
}

/// A webhook server started in this process on an ephemeral loopback port.
pub struct Running {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Cancel to stop it (it drains first).
    pub shutdown: tokio_util::sync::CancellationToken,
    /// The server and certificate-watch tasks.
    pub task: tokio::task::JoinHandle<()>,
}

/// Starts `app` on `127.0.0.1:0` over TLS with the certificate files `cert`/`key`,
/// checked for changes every `reload_interval`, on the current runtime.
pub async fn serve(
    app: Arc<crate::server::App>,
    cert: &std::path::Path,
    key: &std::path::Path,
    reload_interval: Duration,
) -> Result<Running, ClientError> {
    let (loaded, bytes) = crate::tls::load(cert, key)?;
    let resolver = Arc::new(crate::tls::ReloadingCert::new(loaded));
    let tls = crate::tls::server_config(resolver.clone())?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let metrics = app.metrics.clone();
    let watch = crate::tls::watch(
        cert.to_owned(),
        key.to_owned(),
        bytes,
        resolver,
        metrics.clone(),
        reload_interval,
        shutdown.clone(),
    );
    let serve = crate::server::serve_tls(
        listener,
        tls,
        crate::server::router(app),
        metrics,
        shutdown.clone(),
    );
    let task = tokio::spawn(async move {
        tokio::join!(serve, watch);
    });
    Ok(Running {
        addr,
        shutdown,
        task,
    })
}

/// An AdmissionReview of a pod CREATE as the API server sends it: with the defaults
/// admission added (tolerations, service-account volume), a nodeSelector, required node
/// affinity and managed fields; labelled `virtual-pod: "true"` if `labelled`.
pub fn sample_review(uid: &str, labelled: bool) -> serde_json::Value {
    let mut labels = serde_json::json!({"app": "web", "pod-template-hash": "5d8f7c9b4"});
    if labelled {
        labels["virtual-pod"] = "true".into();
    }
    serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "apps",
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller",
                         "uid": "6a0c1f0e", "groups": ["system:serviceaccounts", "system:authenticated"]},
            "object": {
                "kind": "Pod", "apiVersion": "v1",
                "metadata": {
                    "generateName": "web-5d8f7c9b4-", "namespace": "apps", "labels": labels,
                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-5d8f7c9b4",
                        "uid": "0f9f4c3e-1d2b-4c5d-8e9f-0a1b2c3d4e5f", "controller": true, "blockOwnerDeletion": true}],
                    "managedFields": [{"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
                        "time": "2024-01-01T00:00:00Z", "fieldsType": "FieldsV1",
                        "fieldsV1": {"f:metadata": {"f:generateName": {}, "f:labels": {".": {}, "f:app": {}}},
                                     "f:spec": {"f:containers": {"k:{\"name\":\"app\"}": {".": {}, "f:image": {}}}}}}],
                },
                "spec": {
                    "volumes": [{"name": "kube-api-access-x7k2p", "projected": {"defaultMode": 420, "sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}],
                    "containers": [{"name": "app", "image": "nginx:1.27", "ports": [{"containerPort": 80, "protocol": "TCP"}],
                        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                        "volumeMounts": [{"name": "kube-api-access-x7k2p", "readOnly": true, "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
                        "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File", "imagePullPolicy": "IfNotPresent"}],
                    "restartPolicy": "Always", "terminationGracePeriodSeconds": 30, "dnsPolicy": "ClusterFirst",
                    "nodeSelector": {"disktype": "ssd", "clusterID": "vk-node"},
                    "serviceAccountName": "default", "serviceAccount": "default", "securityContext": {},
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a", "b"]}]}]}}},
                    "schedulerName": "default-scheduler",
                    "tolerations": [
                        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}],
                    "priority": 0, "enableServiceLinks": true, "preemptionPolicy": "PreemptLowerPriority",
                },
                "status": {},
            },
            "oldObject": null,
            "dryRun": false,
            "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"},
        },
    })
}
