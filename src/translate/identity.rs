//! The upper identity of an offloaded pod (`--upper-identity`): its lower copy mounts
//! tokens the upper API server issued for its upper ServiceAccount, bound to the upper pod,
//! from a lower Secret tensile keeps current, and reaches the upper API server
//! (`--upper-api-address`) as `kubernetes.default`.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    EnvVar, HostAlias, KeyToPath, PodSpec, Secret, SecretProjection, VolumeProjection,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::hash::fnv1a;
use super::meta::UPPER_UID_ANNOTATION;

/// Data key of the upper cluster's CA certificate in a token Secret (and the file name the
/// kubelet gives it in the service-account volume).
pub const CA_KEY: &str = "ca.crt";
/// Data key of the upper namespace in a token Secret.
pub const NAMESPACE_KEY: &str = "namespace";
/// The ConfigMap of the cluster CA the ServiceAccount admission projects into every pod.
pub const ROOT_CA_CONFIG_MAP: &str = "kube-root-ca.crt";
/// Annotation on a token Secret: when its tokens are renewed (RFC 3339).
pub const RENEW_AT_ANNOTATION: &str = "tensile.dev/renew-at";
/// Label on a token Secret: the virtual node that keeps it (not the owner marks: it is
/// no copy of an upper Secret, and the copies' controllers must not take it for one).
pub const TOKEN_NODE_LABEL: &str = "tensile.dev/upper-token-of";
/// Suffix of a token Secret's name after the pod's.
const SECRET_SUFFIX: &str = "-upper-token";
/// The longest object name (a DNS subdomain).
const MAX_NAME: usize = 253;
/// The expiration the kubelet requests when a source names none (the API's default).
const DEFAULT_EXPIRATION_SECONDS: i64 = 3600;
/// Environment variables in-cluster clients read to find the API server.
const HOST_ENV: &str = "KUBERNETES_SERVICE_HOST";
const PORT_ENV: &str = "KUBERNETES_SERVICE_PORT";
/// The names of the API server's Service a hostAlias points at the upper API server. A
/// name left out is resolved by the lower DNS to the lower API server, which would then get
/// the upper token; the fully qualified name is under `cluster.local`, the domain nearly
/// every cluster keeps (the lower kubelets set pod DNS, and tensile is told no other).
const API_SERVICE_NAMES: [&str; 4] = [
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
];

/// Where lower pods reach the upper API server: `--upper-api-address`, `IP:PORT`
/// (`[v6]:PORT` for IPv6).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpperApi {
    /// An IP address (without brackets).
    pub host: String,
    /// The port.
    pub port: u16,
}

impl FromStr for UpperApi {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // An IP address, not a name: `kubernetes.default` is pointed at it by a hostAlias,
        // which takes only addresses, and a name left to the lower DNS would send the upper
        // token to the lower API server.
        let bad = || {
            format!(
                "{s:?} is not IP:PORT (the address lower pods reach the upper API server at, e.g. 203.0.113.10:6443 or [2001:db8::1]:6443)"
            )
        };
        let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        let port: u16 = port.parse().map_err(|_| bad())?;
        if port == 0 || host.parse::<IpAddr>().is_err() {
            return Err(bad());
        }
        Ok(Self {
            host: host.to_owned(),
            port,
        })
    }
}

impl fmt::Display for UpperApi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.host.parse::<IpAddr>() {
            Ok(IpAddr::V6(_)) => write!(f, "[{}]:{}", self.host, self.port),
            _ => write!(f, "{}:{}", self.host, self.port),
        }
    }
}

/// One projected `serviceAccountToken` source of a pod: the token to request for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenSource {
    /// Its key in the token Secret.
    pub key: String,
    /// The audience (`None`: the API server's own).
    pub audience: Option<String>,
    /// The lifetime to request, in seconds.
    pub expiration_seconds: i64,
}

/// The name of the lower Secret holding the tokens of the pod `pod`: `<pod>-upper-token`,
/// or, when that is too long for a name, the pod's name cut short with a hash of the whole
/// (so two long names never share one Secret).
pub fn token_secret_name(pod: &str) -> String {
    if pod.len() + SECRET_SUFFIX.len() <= MAX_NAME {
        return format!("{pod}{SECRET_SUFFIX}");
    }
    let hash = format!("-{:016x}", fnv1a(pod.as_bytes()));
    let keep = MAX_NAME - SECRET_SUFFIX.len() - hash.len();
    // Names are ASCII: any byte is a char boundary.
    let cut = pod[..keep].trim_end_matches(['-', '.']);
    format!("{cut}{hash}{SECRET_SUFFIX}")
}

/// The key of the token of source `index` of volume `volume` in the token Secret.
fn token_key(volume: &str, index: usize) -> String {
    format!("{volume}.{index}.token")
}

/// Every projected `serviceAccountToken` source of `spec`, in volume order.
pub fn token_sources(spec: &PodSpec) -> Vec<TokenSource> {
    spec.volumes
        .iter()
        .flatten()
        .filter_map(|v| Some((v.name.as_str(), v.projected.as_ref()?)))
        .flat_map(|(volume, projected)| {
            projected
                .sources
                .iter()
                .flatten()
                .enumerate()
                .filter_map(move |(index, source)| {
                    let token = source.service_account_token.as_ref()?;
                    Some(TokenSource {
                        key: token_key(volume, index),
                        audience: token.audience.clone().filter(|a| !a.is_empty()),
                        expiration_seconds: token
                            .expiration_seconds
                            .unwrap_or(DEFAULT_EXPIRATION_SECONDS),
                    })
                })
        })
        .collect()
}

/// Gives the lower pod spec `spec` (of the upper pod's) the upper identity: every projected
/// volume with a token source reads its tokens, the cluster CA and the namespace from the
/// token Secret `secret` instead; the lower cluster mounts no token of its own; and the
/// containers find the API server at `api`.
pub fn give_upper_identity(spec: &mut PodSpec, secret: &str, api: &UpperApi) {
    let from_secret = |items: Vec<KeyToPath>| VolumeProjection {
        secret: Some(SecretProjection {
            name: secret.to_owned(),
            items: Some(items),
            optional: None,
        }),
        ..VolumeProjection::default()
    };
    for volume in spec.volumes.iter_mut().flatten() {
        let name = volume.name.clone();
        let Some(projected) = volume.projected.as_mut() else {
            continue;
        };
        let Some(sources) = projected
            .sources
            .as_mut()
            .filter(|s| s.iter().any(|s| s.service_account_token.is_some()))
        else {
            continue;
        };
        let mut rewritten = Vec::with_capacity(sources.len());
        for (index, mut source) in std::mem::take(sources).into_iter().enumerate() {
            if let Some(token) = &source.service_account_token {
                rewritten.push(from_secret(vec![KeyToPath {
                    key: token_key(&name, index),
                    path: token.path.clone(),
                    mode: None,
                }]));
            } else if let Some(ca) = source
                .config_map
                .as_ref()
                .filter(|c| c.name == ROOT_CA_CONFIG_MAP)
            {
                let items = ca.items.clone().unwrap_or_else(|| {
                    vec![KeyToPath {
                        key: CA_KEY.to_owned(),
                        path: CA_KEY.to_owned(),
                        mode: None,
                    }]
                });
                rewritten.push(from_secret(items));
            } else if let Some(downward) = source.downward_api.as_mut() {
                // The namespace as the upper cluster names it (the lower one may differ).
                let (namespace, rest): (Vec<_>, Vec<_>) = downward
                    .items
                    .take()
                    .unwrap_or_default()
                    .into_iter()
                    .partition(|item| {
                        item.field_ref
                            .as_ref()
                            .is_some_and(|f| f.field_path == "metadata.namespace")
                    });
                if !rest.is_empty() {
                    downward.items = Some(rest);
                    rewritten.push(source);
                }
                if !namespace.is_empty() {
                    rewritten.push(from_secret(
                        namespace
                            .into_iter()
                            .map(|item| KeyToPath {
                                key: NAMESPACE_KEY.to_owned(),
                                path: item.path,
                                mode: item.mode,
                            })
                            .collect(),
                    ));
                }
            } else {
                rewritten.push(source);
            }
        }
        *sources = rewritten;
    }
    spec.automount_service_account_token = Some(false);
    let env = [
        (HOST_ENV, api.host.clone()),
        (PORT_ENV, api.port.to_string()),
    ];
    let containers = spec
        .containers
        .iter_mut()
        .chain(spec.init_containers.iter_mut().flatten());
    for container in containers {
        let vars = container.env.get_or_insert_default();
        for (name, value) in &env {
            // A value the user set is the user's.
            if !vars.iter().any(|v| v.name == *name) {
                vars.push(EnvVar {
                    name: (*name).to_owned(),
                    value: Some(value.clone()),
                    value_from: None,
                });
            }
        }
    }
    spec.host_aliases.get_or_insert_default().push(HostAlias {
        ip: api.host.clone(),
        hostnames: Some(API_SERVICE_NAMES.iter().map(|&n| n.to_owned()).collect()),
    });
}

/// What a token Secret holds and whose it is.
#[derive(Debug)]
pub struct TokenSecret<'a> {
    /// The lower pod it belongs to (its owner: the lower cluster deletes it with the pod).
    pub lower_pod: &'a ObjectMeta,
    /// The upper pod's UID, the one the tokens are bound to.
    pub upper_uid: &'a str,
    /// The upper namespace.
    pub upper_namespace: &'a str,
    /// The virtual node that keeps it.
    pub node: &'a str,
    /// Token by key ([`TokenSource::key`]).
    pub tokens: BTreeMap<String, String>,
    /// The upper cluster's CA bundle (PEM), if it publishes one.
    pub ca: Option<String>,
    /// When to renew the tokens.
    pub renew_at: k8s_openapi::jiff::Timestamp,
}

/// The token Secret of `s.lower_pod`, in the lower pod's namespace.
pub fn token_secret(s: TokenSecret<'_>) -> Secret {
    let pod_name = s.lower_pod.name.clone().unwrap_or_default();
    let mut data: BTreeMap<String, ByteString> = s
        .tokens
        .into_iter()
        .map(|(key, token)| (key, ByteString(token.into_bytes())))
        .collect();
    if let Some(ca) = s.ca {
        data.insert(CA_KEY.to_owned(), ByteString(ca.into_bytes()));
    }
    data.insert(
        NAMESPACE_KEY.to_owned(),
        ByteString(s.upper_namespace.as_bytes().to_vec()),
    );
    Secret {
        metadata: ObjectMeta {
            name: Some(token_secret_name(&pod_name)),
            namespace: s.lower_pod.namespace.clone(),
            labels: Some(BTreeMap::from([(
                TOKEN_NODE_LABEL.to_owned(),
                s.node.to_owned(),
            )])),
            annotations: Some(BTreeMap::from([
                (UPPER_UID_ANNOTATION.to_owned(), s.upper_uid.to_owned()),
                (RENEW_AT_ANNOTATION.to_owned(), s.renew_at.to_string()),
            ])),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".to_owned(),
                kind: "Pod".to_owned(),
                name: pod_name,
                uid: s.lower_pod.uid.clone().unwrap_or_default(),
                ..OwnerReference::default()
            }]),
            ..ObjectMeta::default()
        },
        type_: Some("Opaque".to_owned()),
        data: Some(data),
        ..Secret::default()
    }
}

/// Whether `secret` is the token Secret of the lower pod of UID `lower_uid` (its owner).
pub fn is_token_secret_of(secret: &Secret, lower_uid: &str) -> bool {
    secret
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.kind == "Pod" && o.uid == lower_uid)
}

/// When a token Secret of `upper_uid` holding every key of `sources` is due for renewal;
/// `None` when it must be (re)written now: tokens missing, bound to another pod, or no
/// renewal time recorded.
pub fn renewal_due(
    secret: &Secret,
    upper_uid: &str,
    sources: &[TokenSource],
) -> Option<k8s_openapi::jiff::Timestamp> {
    let annotations = secret.metadata.annotations.as_ref()?;
    if annotations.get(UPPER_UID_ANNOTATION).map(String::as_str) != Some(upper_uid) {
        return None;
    }
    let data = secret.data.as_ref()?;
    if !sources.iter().all(|s| data.contains_key(&s.key)) {
        return None;
    }
    annotations.get(RENEW_AT_ANNOTATION)?.parse().ok()
}

/// How long after issue to renew a token living `lifetime`: at 70 to 80 % of it (the
/// kubelet renews at 80 %), spread by `seed` (the pod's UID) so that pods started together
/// do not all renew at once, and never later than `max_age`.
pub fn renew_after(lifetime: Duration, seed: &str, max_age: Option<Duration>) -> Duration {
    // A fraction in [0.7, 0.8), in thousandths.
    let thousandths = 700 + u32::try_from(fnv1a(seed.as_bytes()) % 100).unwrap_or(0);
    let after = lifetime * thousandths / 1000;
    match max_age {
        Some(max) => after.min(max),
        None => after,
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Pod;
    use serde_json::{Value, json};

    use super::*;

    fn spec(value: Value) -> PodSpec {
        serde_json::from_value(value).unwrap()
    }

    /// A pod as the upper admission made it: the injected volume, and a user's token for
    /// another audience beside a ConfigMap.
    fn admitted() -> PodSpec {
        spec(json!({
            "serviceAccountName": "robot",
            "containers": [
                {"name": "app", "image": "busybox", "env": [{"name": "KUBERNETES_SERVICE_PORT", "value": "8443"}]},
            ],
            "initContainers": [{"name": "init", "image": "busybox"}],
            "volumes": [
                {"name": "kube-api-access-x7k2p", "projected": {"defaultMode": 420, "sources": [
                    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                    {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                    {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
                ]}},
                {"name": "vault", "projected": {"sources": [
                    {"configMap": {"name": "vault-settings"}},
                    {"serviceAccountToken": {"audience": "vault", "path": "vault-token"}},
                    {"downwardAPI": {"items": [
                        {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                        {"path": "ns", "fieldRef": {"fieldPath": "metadata.namespace"}},
                    ]}},
                ]}},
                {"name": "settings", "configMap": {"name": "kube-root-ca.crt"}},
            ],
        }))
    }

    #[test]
    fn parses_the_upper_api_address() {
        let cases = [
            ("203.0.113.10:6443", Some(("203.0.113.10", 6443))),
            ("api.example.com:443", None),
            ("[2001:db8::1]:6443", Some(("2001:db8::1", 6443))),
            ("api.example.com", None),
            ("api.example.com:0", None),
            (":6443", None),
            ("https://api:6443", None),
            ("a b:1", None),
        ];
        for (input, want) in cases {
            let got = input.parse::<UpperApi>();
            match want {
                Some((host, port)) => {
                    let got = got.unwrap();
                    assert_eq!((got.host.as_str(), got.port), (host, port), "{input}");
                    assert_eq!(got.to_string(), input, "{input}");
                }
                None => assert!(got.is_err(), "{input}: {got:?}"),
            }
        }
    }

    #[test]
    fn names_the_token_secret() {
        assert_eq!(token_secret_name("web-0"), "web-0-upper-token");
        let long = "a".repeat(253);
        let other = format!("{}b", "a".repeat(252));
        let (a, b) = (token_secret_name(&long), token_secret_name(&other));
        for name in [&a, &b] {
            assert_eq!(name.len(), MAX_NAME, "{name}");
            assert!(name.ends_with(SECRET_SUFFIX), "{name}");
        }
        assert_ne!(a, b, "two long names share no Secret");
        // Lower pods mount it by this name after an upgrade: the hash must never change.
        assert_eq!(
            a,
            format!("{}-8e8f6581e0ff9e30-upper-token", "a".repeat(224))
        );
        let fits = "p".repeat(MAX_NAME - SECRET_SUFFIX.len());
        assert_eq!(token_secret_name(&fits), format!("{fits}{SECRET_SUFFIX}"));
    }

    #[test]
    fn finds_every_token_source() {
        let want = vec![
            TokenSource {
                key: "kube-api-access-x7k2p.0.token".into(),
                audience: None,
                expiration_seconds: 3607,
            },
            TokenSource {
                key: "vault.1.token".into(),
                audience: Some("vault".into()),
                expiration_seconds: DEFAULT_EXPIRATION_SECONDS,
            },
        ];
        assert_eq!(token_sources(&admitted()), want);
        assert!(token_sources(&spec(json!({"containers": []}))).is_empty());
    }

    #[test]
    fn gives_the_upper_identity() {
        let api: UpperApi = "203.0.113.10:6443".parse().unwrap();
        let mut got = admitted();
        give_upper_identity(&mut got, "p-upper-token", &api);
        let secret = |items: Value| json!({"secret": {"name": "p-upper-token", "items": items}});
        let want = spec(json!({
            "serviceAccountName": "robot",
            "automountServiceAccountToken": false,
            "containers": [{"name": "app", "image": "busybox", "env": [
                {"name": "KUBERNETES_SERVICE_PORT", "value": "8443"},
                {"name": "KUBERNETES_SERVICE_HOST", "value": "203.0.113.10"},
            ]}],
            "initContainers": [{"name": "init", "image": "busybox", "env": [
                {"name": "KUBERNETES_SERVICE_HOST", "value": "203.0.113.10"},
                {"name": "KUBERNETES_SERVICE_PORT", "value": "6443"},
            ]}],
            // Every name of the API server's Service a client may use, the fully qualified
            // one too: a name left out resolves to the lower API server, which would get the
            // upper token.
            "hostAliases": [{"ip": "203.0.113.10", "hostnames": [
                "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ]}],
            "volumes": [
                {"name": "kube-api-access-x7k2p", "projected": {"defaultMode": 420, "sources": [
                    secret(json!([{"key": "kube-api-access-x7k2p.0.token", "path": "token"}])),
                    secret(json!([{"key": "ca.crt", "path": "ca.crt"}])),
                    secret(json!([{"key": "namespace", "path": "namespace"}])),
                ]}},
                {"name": "vault", "projected": {"sources": [
                    {"configMap": {"name": "vault-settings"}},
                    secret(json!([{"key": "vault.1.token", "path": "vault-token"}])),
                    {"downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}},
                    secret(json!([{"key": "namespace", "path": "ns"}])),
                ]}},
                {"name": "settings", "configMap": {"name": "kube-root-ca.crt"}},
            ],
        }));
        assert_eq!(
            serde_json::to_value(&got).unwrap(),
            serde_json::to_value(&want).unwrap()
        );
    }

    #[test]
    fn builds_and_reads_back_the_token_secret() {
        let pod: Pod = serde_json::from_value(
            json!({"metadata": {"name": "p", "namespace": "lower-ns", "uid": "lower-uid"}}),
        )
        .unwrap();
        let sources = token_sources(&admitted());
        let renew_at: k8s_openapi::jiff::Timestamp = "2026-11-25T05:00:00Z".parse().unwrap();
        let tokens: BTreeMap<String, String> = sources
            .iter()
            .map(|s| (s.key.clone(), format!("token-of-{}", s.key)))
            .collect();
        let secret = token_secret(TokenSecret {
            lower_pod: &pod.metadata,
            upper_uid: "upper-uid",
            upper_namespace: "team-a",
            node: "vk",
            tokens,
            ca: Some("PEM".into()),
            renew_at,
        });
        assert_eq!(secret.metadata.name.as_deref(), Some("p-upper-token"));
        assert_eq!(secret.metadata.namespace.as_deref(), Some("lower-ns"));
        assert!(is_token_secret_of(&secret, "lower-uid"));
        assert!(!is_token_secret_of(&secret, "another-pod"));
        let data = secret.data.as_ref().unwrap();
        assert_eq!(data["namespace"].0, b"team-a");
        assert_eq!(data["ca.crt"].0, b"PEM");
        assert_eq!(renewal_due(&secret, "upper-uid", &sources), Some(renew_at));
        assert_eq!(
            renewal_due(&secret, "a-new-pod", &sources),
            None,
            "bound to another pod"
        );
        let more = [TokenSource {
            key: "added.0.token".into(),
            audience: None,
            expiration_seconds: 600,
        }];
        assert_eq!(
            renewal_due(&secret, "upper-uid", &more),
            None,
            "a token missing"
        );
    }

    #[test]
    fn renews_at_70_to_80_percent_and_within_max_age() {
        let hour = Duration::from_secs(3600);
        for seed in ["a", "b", "c", "d", "uid-1", "uid-2"] {
            let after = renew_after(hour, seed, None);
            assert!(
                after >= hour * 7 / 10 && after < hour * 8 / 10,
                "{seed}: {after:?}"
            );
            assert_eq!(renew_after(hour, seed, None), after, "stable per pod");
            let capped = renew_after(hour, seed, Some(Duration::from_secs(5)));
            assert_eq!(capped, Duration::from_secs(5));
        }
        let spread: std::collections::BTreeSet<_> = (0..50)
            .map(|i| renew_after(hour, &format!("uid-{i}"), None))
            .collect();
        assert!(spread.len() > 10, "pods are spread: {spread:?}");
    }
}
