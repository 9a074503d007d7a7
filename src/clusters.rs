//! The two API clients (upper, lower) and the checks made before anything starts: each
//! kubeconfig is readable, each API server answers, and tensile may do what it needs there.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use kube::client::ClientBuilder;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use tower::limit::RateLimitLayer;
use tower::util::MapRequestLayer;

use crate::metrics::Metrics;
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
    /// Its API server's URL, for messages.
    pub server: String,
    /// Its Kubernetes version (`v1.36.3`), which the virtual node reports as kubelet version.
    pub version: String,
}

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
        let burst = self.burst.max(1);
        let qps = if self.qps > 0.0 { self.qps } else { f64::MAX };
        let window = Duration::from_secs_f64((f64::from(burst) / qps).max(0.001));
        RateLimitLayer::new(u64::from(burst), window)
    }
}

/// Loads the config: an explicit kubeconfig, else `~/.kube/config` (upper only), else
/// in-cluster.
pub async fn load_config(side: Side, path: Option<&Path>) -> Result<Config, StartupError> {
    let home = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".kube/config"));
    let path = path
        .map(Path::to_owned)
        .or_else(|| home.filter(|p| p.exists()));
    match path {
        Some(path) => {
            let kubeconfig =
                Kubeconfig::read_from(&path).map_err(|source| StartupError::Kubeconfig {
                    side,
                    path: path.clone(),
                    source,
                })?;
            Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(|source| StartupError::Kubeconfig { side, path, source })
        }
        None => Config::incluster().map_err(|source| StartupError::NoConfig { side, source }),
    }
}

/// Builds the client (rate limited, its requests counted in `metrics`) and checks that
/// the API server answers.
pub async fn connect(
    side: Side,
    config: Config,
    limit: RateLimit,
    metrics: Arc<Metrics>,
) -> Result<Cluster, StartupError> {
    let server = config.cluster_url.to_string();
    let count = MapRequestLayer::new(move |request: http::Request<kube::client::Body>| {
        metrics.api_requests.record(side, &request);
        request
    });
    let client = ClientBuilder::try_from(config)
        .map_err(|source| StartupError::Client { side, source })?
        .with_layer(&limit.layer())
        .with_layer(&count)
        .build();
    let version = tokio::time::timeout(Duration::from_secs(15), client.apiserver_version())
        .await
        .map_err(|_| StartupError::Unreachable {
            side,
            server: server.clone(),
            reason: "no answer within 15s".into(),
        })?
        .map_err(|e| StartupError::Unreachable {
            side,
            server: server.clone(),
            reason: e.to_string(),
        })?;
    Ok(Cluster {
        side,
        client,
        server,
        version: version.git_version,
    })
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

/// Fails with every missing permission listed, naming the cluster.
pub async fn check_permissions(
    cluster: &Cluster,
    needed: &[Permission],
) -> Result<(), StartupError> {
    let reviews: Api<SelfSubjectAccessReview> = Api::all(cluster.client.clone());
    let mut missing = Vec::new();
    for permission in needed {
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
        let allowed = reviews
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| StartupError::Unreachable {
                side: cluster.side,
                server: cluster.server.clone(),
                reason: format!("access review failed: {e}"),
            })?
            .status
            .is_some_and(|s| s.allowed);
        if !allowed {
            missing.push(permission.to_string());
        }
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(StartupError::Forbidden {
            side: cluster.side,
            missing: missing.join(", "),
        })
    }
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

/// What virtual-node does in the upper cluster.
pub const UPPER_PERMISSIONS: &[Permission] = &[
    perm("create", "nodes"),
    perm("patch", "nodes"),
    Permission {
        subresource: "status",
        ..perm("patch", "nodes")
    },
    perm("watch", "pods"),
    perm("delete", "pods"),
    Permission {
        subresource: "status",
        ..perm("patch", "pods")
    },
    perm("get", "configmaps"),
    perm("watch", "configmaps"),
    perm("get", "secrets"),
    perm("watch", "secrets"),
    perm("get", "serviceaccounts"),
    perm("get", "persistentvolumeclaims"),
    Permission {
        group: "events.k8s.io",
        ..perm("create", "events")
    },
    Permission {
        group: "events.k8s.io",
        ..perm("patch", "events")
    },
    Permission {
        group: "coordination.k8s.io",
        namespace: Some("kube-node-lease"),
        ..perm("update", "leases")
    },
    // The kubelet API authorizes each caller like a kubelet.
    Permission {
        group: "authorization.k8s.io",
        ..perm("create", "subjectaccessreviews")
    },
];

/// What virtual-node does in the lower cluster.
pub const LOWER_PERMISSIONS: &[Permission] = &[
    perm("watch", "nodes"),
    perm("watch", "pods"),
    perm("create", "pods"),
    perm("patch", "pods"),
    perm("delete", "pods"),
    perm("list", "pods"),
    perm("create", "namespaces"),
    perm("create", "configmaps"),
    perm("watch", "configmaps"),
    perm("update", "configmaps"),
    perm("delete", "configmaps"),
    perm("create", "secrets"),
    perm("watch", "secrets"),
    perm("update", "secrets"),
    perm("delete", "secrets"),
    perm("create", "serviceaccounts"),
    perm("create", "persistentvolumeclaims"),
    perm("watch", "events"),
];

/// What `ServiceControllers` does in the upper cluster.
pub const UPPER_SERVICE_PERMISSIONS: &[Permission] = &[
    perm("watch", "services"),
    perm("watch", "endpoints"),
    Permission {
        group: "discovery.k8s.io",
        ..perm("watch", "endpointslices")
    },
];

/// What `ServiceControllers` does in the lower cluster.
pub const LOWER_SERVICE_PERMISSIONS: &[Permission] = &[
    perm("watch", "services"),
    perm("create", "services"),
    perm("update", "services"),
    perm("delete", "services"),
    perm("watch", "endpoints"),
    perm("create", "endpoints"),
    perm("update", "endpoints"),
    perm("delete", "endpoints"),
    Permission {
        group: "discovery.k8s.io",
        ..perm("watch", "endpointslices")
    },
    Permission {
        group: "discovery.k8s.io",
        ..perm("create", "endpointslices")
    },
    Permission {
        group: "discovery.k8s.io",
        ..perm("update", "endpointslices")
    },
    Permission {
        group: "discovery.k8s.io",
        ..perm("delete", "endpointslices")
    },
];

/// What `PVControllers` does in the upper cluster.
pub const UPPER_PV_PERMISSIONS: &[Permission] = &[
    perm("watch", "persistentvolumeclaims"),
    perm("patch", "persistentvolumeclaims"),
    perm("watch", "persistentvolumes"),
    perm("create", "persistentvolumes"),
    perm("patch", "persistentvolumes"),
    perm("delete", "persistentvolumes"),
];

/// What `PVControllers` does in the lower cluster.
pub const LOWER_PV_PERMISSIONS: &[Permission] = &[
    perm("watch", "persistentvolumeclaims"),
    perm("delete", "persistentvolumeclaims"),
    perm("watch", "persistentvolumes"),
    Permission {
        group: "storage.k8s.io",
        ..perm("watch", "storageclasses")
    },
];
