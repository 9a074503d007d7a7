//! Who may use the kubelet API, as a kubelet decides it: an X.509 client certificate
//! verified against a CA, or a bearer token checked with a TokenReview (authentication,
//! cached); a SubjectAccessReview on `nodes/<subresource>` carrying the caller's name, uid,
//! groups and extra (authorization, cached).

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Client;
use kube::api::{Api, PostParams};
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};

/// The group every authenticated caller is in (the kubelet's authenticator adds it).
pub const ALL_AUTHENTICATED: &str = "system:authenticated";

/// The extra key naming the credential a caller used (k8s.io/apiserver `CredentialIDKey`).
pub const CREDENTIAL_ID: &str = "authentication.kubernetes.io/credential-id";

/// The X.509 name attribute a certificate's user UID is in (1.3.6.1.4.1.57683.2, the
/// Kubernetes UID OID; read by the kubelet since 1.33, `AllowParsingUserUIDFromCertAuth`).
const CERTIFICATE_UID_OID: &str = "1.3.6.1.4.1.57683.2";

/// How many answers a cache keeps at most: a flood of distinct callers cannot grow it
/// without end.
const CACHE_CAPACITY: usize = 4096;

/// An authenticated caller, as the kubelet's authenticator gives it to its authorizer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct User {
    /// User name (a certificate's CN).
    pub name: String,
    /// Unique id (a certificate's UID attribute, a token's user UID); empty when none.
    pub uid: String,
    /// Groups (a certificate's O), `system:authenticated` among them.
    pub groups: Vec<String>,
    /// Further attributes (the credential's id; a pod-bound token's pod), which
    /// authorizers may use, e.g. to scope a token.
    pub extra: BTreeMap<String, Vec<String>>,
}

impl User {
    /// `self` in `system:authenticated`, as the kubelet's authenticator adds it.
    fn authenticated(mut self) -> Self {
        if !self
            .groups
            .iter()
            .any(|g| g == ALL_AUTHENTICATED || g == "system:unauthenticated")
        {
            self.groups.push(ALL_AUTHENTICATED.to_owned());
        }
        self
    }
}

/// Why a request is refused.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    /// No or invalid credentials: 401.
    #[error("Unauthorized: {0}")]
    Unauthenticated(String),
    /// Authenticated but not allowed on any of the subresources: 403.
    #[error(
        "Forbidden (user={user}, verb={verb}, resource=nodes, subresource(s)=[{}]){}",
        .subresources.join(" "),
        if .reason.is_empty() { String::new() } else { format!(": {}", .reason) }
    )]
    Forbidden {
        /// Who.
        user: String,
        /// What.
        verb: String,
        /// On which subresources, in the order they were asked.
        subresources: Vec<&'static str>,
        /// The authorizer's reasons.
        reason: String,
    },
    /// The upper API server could not be asked: 500.
    #[error("{review} in the upper cluster failed: {source}")]
    Review {
        /// Which review, about what.
        review: String,
        /// Why.
        source: kube::Error,
    },
}

impl Refused {
    /// The HTTP status code a kubelet answers with.
    pub fn status(&self) -> http::StatusCode {
        match self {
            Self::Unauthenticated(_) => http::StatusCode::UNAUTHORIZED,
            Self::Forbidden { .. } => http::StatusCode::FORBIDDEN,
            Self::Review { .. } => http::StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// Asks for a client certificate but lets the handshake finish without one, or with one
/// from another CA, so that the request is answered 401 as a kubelet does (Go's
/// `RequestClientCert`), rather than cut off by a TLS alert. [`Authenticator::user`]
/// verifies the certificate against the CA.
#[derive(Debug)]
pub struct RequestClientCert {
    verifier: Arc<dyn ClientCertVerifier>,
}

impl RequestClientCert {
    /// Signatures are checked by `verifier`; certificates are not.
    pub fn new(verifier: Arc<dyn ClientCertVerifier>) -> Self {
        Self { verifier }
    }
}

impl ClientCertVerifier for RequestClientCert {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }

    // The handshake still proves the client holds the certificate's key.
    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verifier.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verifier.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.verifier.supported_verify_schemes()
    }
}

/// How callers are authenticated and authorized.
#[derive(Clone, Debug)]
pub struct AuthConfig {
    /// Check bearer tokens with TokenReview (`--authentication-token-webhook`).
    pub token_webhook: bool,
    /// How long a TokenReview answer, either way, is reused (0: not at all).
    pub token_ttl: Duration,
    /// How long an allowed decision is reused.
    pub authorized_ttl: Duration,
    /// How long a denied decision is reused.
    pub unauthorized_ttl: Duration,
    /// Let everyone in (`--no-verify-clients`): labs only.
    pub no_verify: bool,
}

/// Answers reused until they expire, bounded by [`CACHE_CAPACITY`]. Pure: the caller
/// says what time it is.
#[derive(Debug)]
struct Answers<K, V> {
    entries: HashMap<K, (V, Instant)>,
}

impl<K: Eq + Hash, V: Clone> Answers<K, V> {
    fn new() -> Self {
        Self {
            entries: HashMap::new(),
        }
    }

    /// The answer for `key`, unless it has expired by `now`.
    fn get(&self, key: &K, now: Instant) -> Option<V> {
        self.entries
            .get(key)
            .filter(|(_, expires)| now < *expires)
            .map(|(value, _)| value.clone())
    }

    /// Keeps `value` for `ttl` from `now`; a zero TTL keeps nothing.
    fn insert(&mut self, key: K, value: V, ttl: Duration, now: Instant) {
        let Some(expires) = now.checked_add(ttl).filter(|_| !ttl.is_zero()) else {
            return;
        };
        if self.entries.len() >= CACHE_CAPACITY && !self.entries.contains_key(&key) {
            self.entries.retain(|_, (_, expires)| now < *expires);
            if self.entries.len() >= CACHE_CAPACITY {
                self.entries.clear();
            }
        }
        self.entries.insert(key, (value, expires));
    }
}

/// Who asked for which subresource of which node with which verb: a SubjectAccessReview's
/// spec, as the kubelet's authorizer keys its cache (a kubelet has one node; a member of
/// `node` or `label=<key>` granularity answers for each of its virtual nodes).
type DecisionKey = (User, String, &'static str, &'static str);
/// Allowed or not, and the authorizer's reason.
type Decision = (bool, String);
/// A TokenReview's answer: the user, or why the token is refused.
type TokenAnswer = Result<User, String>;

/// Authenticates and authorizes callers against the upper cluster.
pub struct Authenticator {
    ca: Option<Arc<dyn ClientCertVerifier>>,
    upper: Client,
    node: String,
    config: AuthConfig,
    /// Tokens are cached under an HMAC with a key of this process's, so that no token is
    /// kept and none can be matched from outside (k8s.io/apiserver does the same).
    token_key: ring::hmac::Key,
    tokens: Mutex<Answers<Box<[u8]>, TokenAnswer>>,
    decisions: Mutex<Answers<DecisionKey, Decision>>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("node", &self.node)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The user a certificate names, as the kubelet reads it: CN is the name, each O a group,
/// the UID attribute (at most one, not empty) the uid, and the certificate's SHA-256 the
/// credential id in extra.
pub fn certificate_user(der: &[u8]) -> Result<User, String> {
    let (_, cert) =
        x509_parser::parse_x509_certificate(der).map_err(|e| format!("client certificate: {e}"))?;
    let subject = cert.subject();
    let name = subject
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .filter(|cn| !cn.is_empty())
        .ok_or("client certificate has no common name")?
        .to_owned();
    let groups = subject
        .iter_organization()
        .filter_map(|o| o.as_str().ok().map(str::to_owned))
        .collect();
    let uids = subject
        .iter_attributes()
        .filter(|a| a.attr_type().to_id_string() == CERTIFICATE_UID_OID)
        .map(|a| {
            a.as_str()
                .map_err(|_| "client certificate: its UID is not a string")
        })
        .collect::<Result<Vec<_>, _>>()?;
    let uid = match uids.as_slice() {
        [] => String::new(),
        [""] => return Err("client certificate: its UID is empty".into()),
        [uid] => (*uid).to_owned(),
        _ => return Err(format!("client certificate: more than one UID {uids:?}")),
    };
    let digest = ring::digest::digest(&ring::digest::SHA256, der);
    let id: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    Ok(User {
        name,
        uid,
        groups,
        extra: BTreeMap::from([(CREDENTIAL_ID.to_owned(), vec![format!("X509SHA256={id}")])]),
    })
}

/// The SubjectAccessReview a kubelet sends for `user` to `verb` `nodes/<subresource>` of
/// `node`: the whole user (name, uid, groups, extra), resource attributes of core `v1`.
pub fn access_review(
    user: &User,
    node: &str,
    verb: &str,
    subresource: &str,
) -> SubjectAccessReview {
    SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.name.clone()),
            uid: (!user.uid.is_empty()).then(|| user.uid.clone()),
            groups: (!user.groups.is_empty()).then(|| user.groups.clone()),
            extra: (!user.extra.is_empty()).then(|| user.extra.clone()),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.to_owned()),
                version: Some("v1".into()),
                resource: Some("nodes".into()),
                subresource: Some(subresource.to_owned()),
                name: Some(node.to_owned()),
                ..ResourceAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    }
}

impl Authenticator {
    /// `ca_pem`: the CA client certificates must chain to (none: certificates are refused).
    pub fn new(
        ca_pem: Option<&[u8]>,
        upper: Client,
        node: String,
        config: AuthConfig,
    ) -> Result<Self, String> {
        let ca = match ca_pem {
            None => None,
            Some(pem) => {
                use rustls::pki_types::pem::PemObject;
                let mut roots = RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(pem) {
                    let cert = cert.map_err(|e| format!("client CA: {e}"))?;
                    roots.add(cert).map_err(|e| format!("client CA: {e}"))?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    Arc::new(rustls::crypto::ring::default_provider()),
                )
                .build()
                .map_err(|e| format!("client CA: {e}"))?;
                Some(verifier)
            }
        };
        let token_key =
            ring::hmac::Key::generate(ring::hmac::HMAC_SHA256, &ring::rand::SystemRandom::new())
                .map_err(|_| "token cache key: the system gave no random bytes".to_owned())?;
        Ok(Self {
            ca,
            upper,
            node,
            config,
            token_key,
            tokens: Mutex::new(Answers::new()),
            decisions: Mutex::new(Answers::new()),
        })
    }

    /// The verifier the TLS server uses for handshake signatures.
    pub fn handshake_verifier(&self) -> Option<Arc<dyn ClientCertVerifier>> {
        self.ca.clone()
    }

    /// Whether every caller is let in.
    pub fn open(&self) -> bool {
        self.config.no_verify
    }

    /// Who is calling: a verified client certificate, else a reviewed bearer token.
    pub async fn user(
        &self,
        peer_certs: Option<&[CertificateDer<'static>]>,
        authorization: Option<&str>,
    ) -> Result<User, Refused> {
        // As the kubelet's union authenticator: a certificate that fails leaves the token
        // to try, and the certificate's refusal is the answer only without one.
        let certificate = match peer_certs.map(|certs| self.certificate_user(certs)) {
            Some(Ok(user)) => return Ok(user.authenticated()),
            Some(Err(refused)) => Some(refused),
            None => None,
        };
        let token = authorization
            .and_then(|h| h.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .filter(|t| !t.is_empty());
        match (token, certificate) {
            (Some(token), _) if self.config.token_webhook => {
                self.review_token(token).await.map(User::authenticated)
            }
            (_, Some(refused)) => Err(refused),
            (Some(_), None) => Err(Refused::Unauthenticated(
                "bearer tokens are not accepted (--authentication-token-webhook is off)".into(),
            )),
            (None, _) => Err(Refused::Unauthenticated("no credentials".into())),
        }
    }

    fn certificate_user(&self, certs: &[CertificateDer<'static>]) -> Result<User, Refused> {
        let [end_entity, intermediates @ ..] = certs else {
            return Err(Refused::Unauthenticated(
                "empty client certificate chain".into(),
            ));
        };
        let Some(ca) = &self.ca else {
            return Err(Refused::Unauthenticated(
                "no client CA is configured".into(),
            ));
        };
        ca.verify_client_cert(end_entity, intermediates, UnixTime::now())
            .map_err(|e| Refused::Unauthenticated(format!("client certificate: {e}")))?;
        certificate_user(end_entity).map_err(Refused::Unauthenticated)
    }

    /// The user a bearer token stands for, from the upper cluster's TokenReview, whose
    /// answer (either way, not a failure to ask) is reused for the token cache TTL.
    async fn review_token(&self, token: &str) -> Result<User, Refused> {
        let key: Box<[u8]> = ring::hmac::sign(&self.token_key, token.as_bytes())
            .as_ref()
            .into();
        let cached = self
            .tokens
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key, Instant::now());
        let answer = match cached {
            Some(answer) => answer,
            None => {
                let answer = self.ask_token_review(token).await?;
                self.tokens
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(key, answer.clone(), self.config.token_ttl, Instant::now());
                answer
            }
        };
        answer.map_err(Refused::Unauthenticated)
    }

    async fn ask_token_review(&self, token: &str) -> Result<TokenAnswer, Refused> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_owned(),
                audiences: None,
            },
            ..TokenReview::default()
        };
        let answer = Api::<TokenReview>::all(self.upper.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(|source| Refused::Review {
                review: "TokenReview of a bearer token".into(),
                source,
            })?;
        let status = answer.status.unwrap_or_default();
        Ok(match (status.authenticated, status.user) {
            (Some(true), Some(user)) => Ok(User {
                name: user.username.unwrap_or_default(),
                uid: user.uid.unwrap_or_default(),
                groups: user.groups.unwrap_or_default(),
                extra: user.extra.unwrap_or_default(),
            }),
            _ => Err(status
                .error
                .unwrap_or_else(|| "invalid bearer token".into())),
        })
    }

    /// The node this kubelet API answers for when a call names no pod bound to one of
    /// its virtual nodes: `--nodename`.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Whether `user` may `verb` `nodes/<subresource>` of `node` (the node the call is
    /// for: see [`review_node`]) for one of `subresources`, asked in order as the kubelet
    /// does: the first allowed one lets the call in, a failure to ask ends it. Each answer
    /// is a SubjectAccessReview in the upper cluster, cached for the configured TTLs per
    /// user (name, uid, groups, extra), node, verb and subresource.
    pub async fn authorize(
        &self,
        user: &User,
        node: &str,
        verb: &'static str,
        subresources: &'static [&'static str],
    ) -> Result<(), Refused> {
        let mut reasons = Vec::new();
        for &subresource in subresources {
            let (allowed, reason) = self.decision(user, node, verb, subresource).await?;
            if allowed {
                return Ok(());
            }
            if !reason.is_empty() {
                reasons.push(reason);
            }
        }
        Err(Refused::Forbidden {
            user: user.name.clone(),
            verb: verb.to_owned(),
            subresources: subresources.to_vec(),
            reason: reasons.join("; "),
        })
    }

    async fn decision(
        &self,
        user: &User,
        node: &str,
        verb: &'static str,
        subresource: &'static str,
    ) -> Result<Decision, Refused> {
        let key = (user.clone(), node.to_owned(), verb, subresource);
        let cached = self
            .decisions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key, Instant::now());
        if let Some(decision) = cached {
            return Ok(decision);
        }
        let review = access_review(user, node, verb, subresource);
        let answer = Api::<SubjectAccessReview>::all(self.upper.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(|source| Refused::Review {
                review: format!(
                    "SubjectAccessReview of {} to {verb} nodes/{subresource} of {node}",
                    user.name
                ),
                source,
            })?;
        let status = answer.status.unwrap_or_default();
        // An authorizer that both allows and denies denies.
        let allowed = status.allowed && status.denied != Some(true);
        let decision = (allowed, status.reason.unwrap_or_default());
        let ttl = if allowed {
            self.config.authorized_ttl
        } else {
            self.config.unauthorized_ttl
        };
        self.decisions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, decision.clone(), ttl, Instant::now());
        Ok(decision)
    }
}

/// The node a call is authorized on, as the kubelet of that node would: a call about a
/// pod (logs, exec, attach, port-forward) is for the node the upper pod is bound to
/// (`bound`: one of this member's virtual nodes, which all share one endpoint; the API
/// server sent the call there because the pod is bound there), any other call (or one
/// about a pod bound to none of them) for `own`, `--nodename`. Pure.
pub fn review_node<'a>(own: &'a str, bound: Option<&'a str>) -> &'a str {
    bound.filter(|b| !b.is_empty()).unwrap_or(own)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call about a pod is authorized on the node the pod is bound to; every other call
    /// on `--nodename` (a `cluster` member: always `--nodename`, as before).
    #[test]
    fn calls_are_authorized_on_the_node_of_their_pod() {
        // (case, own, the upper pod's node, reviewed)
        let cases = [
            ("cluster member: its one node", "vk", Some("vk"), "vk"),
            ("group node a", "vk", Some("vk-zone-a"), "vk-zone-a"),
            ("group node b", "vk", Some("vk-zone-b"), "vk-zone-b"),
            ("no pod bound here, or a node-wide call", "vk", None, "vk"),
            ("an empty nodeName", "vk", Some(""), "vk"),
        ];
        for (case, own, bound, want) in cases {
            assert_eq!(review_node(own, bound), want, "{case}");
            assert_eq!(
                access_review(&User::default(), review_node(own, bound), "get", "proxy")
                    .spec
                    .resource_attributes
                    .and_then(|a| a.name)
                    .as_deref(),
                Some(want),
                "{case}"
            );
        }
    }

    /// A self-signed certificate with `attributes` in its subject.
    fn certificate(attributes: &[(rcgen::DnType, &str)]) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        for (kind, value) in attributes {
            params.distinguished_name.push(kind.clone(), *value);
        }
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn certificate_names_user_uid_groups_and_credential() {
        use rcgen::DnType::{CommonName, CustomDnType, OrganizationName};
        let uid = || CustomDnType(vec![1, 3, 6, 1, 4, 1, 57683, 2]);
        let user = |name: &str, uid: &str, groups: &[&str]| User {
            name: name.into(),
            uid: uid.into(),
            groups: groups.iter().map(ToString::to_string).collect(),
            extra: BTreeMap::new(),
        };
        // (subject attributes, the user or a piece of the refusal)
        type Case = (
            Vec<(rcgen::DnType, &'static str)>,
            Result<User, &'static str>,
        );
        let cases: Vec<Case> = vec![
            (
                vec![
                    (CommonName, "kube-apiserver-kubelet-client"),
                    (OrganizationName, "system:masters"),
                ],
                Ok(user(
                    "kube-apiserver-kubelet-client",
                    "",
                    &["system:masters"],
                )),
            ),
            (
                vec![(CommonName, "alice"), (uid(), "alice-uid-1")],
                Ok(user("alice", "alice-uid-1", &[])),
            ),
            (
                vec![(CommonName, "alice"), (uid(), "")],
                Err("UID is empty"),
            ),
            (vec![(OrganizationName, "g")], Err("no common name")),
        ];
        for (attributes, want) in cases {
            let der = certificate(&attributes);
            match (certificate_user(&der), want) {
                (Ok(mut got), Ok(want)) => {
                    let id = got.extra.remove(CREDENTIAL_ID).unwrap();
                    assert_eq!(got, want, "{attributes:?}");
                    let digest = ring::digest::digest(&ring::digest::SHA256, &der);
                    let hex: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
                    assert_eq!(id, [format!("X509SHA256={hex}")], "{attributes:?}");
                }
                (Err(got), Err(want)) => assert!(got.contains(want), "{attributes:?}: {got}"),
                (got, want) => panic!("{attributes:?}: {got:?}, want {want:?}"),
            }
        }
        assert!(certificate_user(b"not a certificate").is_err());
    }

    #[test]
    fn every_caller_is_in_system_authenticated_once() {
        let cases: [(&[&str], &[&str]); 4] = [
            (&[], &["system:authenticated"]),
            (&["g"], &["g", "system:authenticated"]),
            (
                &["system:authenticated", "g"],
                &["system:authenticated", "g"],
            ),
            (&["system:unauthenticated"], &["system:unauthenticated"]),
        ];
        for (groups, want) in cases {
            let user = User {
                groups: groups.iter().map(ToString::to_string).collect(),
                ..User::default()
            };
            assert_eq!(user.authenticated().groups, want, "{groups:?}");
        }
    }

    #[test]
    fn access_review_carries_the_whole_user() {
        let scoped = User {
            name: "system:serviceaccount:ns:sa".into(),
            uid: "sa-uid".into(),
            groups: vec!["system:serviceaccounts".into()],
            extra: BTreeMap::from([(
                "authentication.kubernetes.io/pod-name".to_owned(),
                vec!["web-0".to_owned()],
            )]),
        };
        let spec = access_review(&scoped, "vk", "get", "pods").spec;
        assert_eq!(spec.user.as_deref(), Some("system:serviceaccount:ns:sa"));
        assert_eq!(spec.uid.as_deref(), Some("sa-uid"));
        assert_eq!(spec.groups, Some(scoped.groups.clone()));
        assert_eq!(spec.extra, Some(scoped.extra.clone()));
        let attributes = spec.resource_attributes.unwrap();
        assert_eq!(
            (
                attributes.verb.as_deref(),
                attributes.version.as_deref(),
                attributes.resource.as_deref(),
                attributes.subresource.as_deref(),
                attributes.name.as_deref(),
            ),
            (
                Some("get"),
                Some("v1"),
                Some("nodes"),
                Some("pods"),
                Some("vk")
            )
        );
        // Nothing to carry: the fields are left out, as Go's omitempty does.
        let bare = access_review(&User::default(), "vk", "get", "proxy").spec;
        assert_eq!((bare.uid, bare.groups, bare.extra), (None, None, None));
    }

    #[test]
    fn answers_expire_and_are_kept_apart_by_uid_and_extra() {
        let now = Instant::now();
        let minute = Duration::from_secs(60);
        let alice = User {
            name: "alice".into(),
            ..User::default()
        };
        let with_uid = User {
            uid: "1".into(),
            ..alice.clone()
        };
        let with_extra = User {
            extra: BTreeMap::from([("scope".to_owned(), vec!["logs".to_owned()])]),
            ..alice.clone()
        };
        let vk = || "vk".to_owned();
        let mut answers: Answers<DecisionKey, bool> = Answers::new();
        answers.insert((alice.clone(), vk(), "get", "proxy"), true, minute, now);
        answers.insert(
            (with_extra.clone(), vk(), "get", "proxy"),
            false,
            minute,
            now,
        );
        // (key, at, answer)
        let cases = [
            ((alice.clone(), vk(), "get", "proxy"), now, Some(true)),
            (
                (alice.clone(), vk(), "get", "proxy"),
                now + minute / 2,
                Some(true),
            ),
            ((alice.clone(), vk(), "get", "proxy"), now + minute, None),
            ((alice.clone(), vk(), "create", "proxy"), now, None),
            ((alice.clone(), vk(), "get", "pods"), now, None),
            ((with_uid, vk(), "get", "proxy"), now, None),
            // Another virtual node of the member: asked again.
            (
                (alice.clone(), "vk-zone-a".to_owned(), "get", "proxy"),
                now,
                None,
            ),
            ((with_extra, vk(), "get", "proxy"), now, Some(false)),
        ];
        for (key, at, want) in cases {
            assert_eq!(answers.get(&key, at), want, "{key:?} at +{:?}", at - now);
        }
        let mut off: Answers<u8, u8> = Answers::new();
        off.insert(1, 1, Duration::ZERO, now);
        assert_eq!(off.get(&1, now), None, "a zero TTL keeps nothing");
    }

    #[test]
    fn answers_stay_bounded() {
        let now = Instant::now();
        let mut answers: Answers<usize, ()> = Answers::new();
        for key in 0..CACHE_CAPACITY {
            answers.insert(key, (), Duration::from_secs(1), now);
        }
        // Full of live answers: the next one starts afresh.
        answers.insert(CACHE_CAPACITY, (), Duration::from_secs(60), now);
        assert_eq!(answers.entries.len(), 1);
        // Full with expired ones among them: only those go.
        for key in 0..CACHE_CAPACITY - 1 {
            answers.insert(key, (), Duration::from_secs(1), now);
        }
        let later = now + Duration::from_secs(2);
        answers.insert(usize::MAX, (), Duration::from_secs(60), later);
        assert_eq!(answers.entries.len(), 2);
        assert_eq!(answers.get(&CACHE_CAPACITY, later), Some(()));
    }

    #[test]
    fn refusals_map_to_kubelet_status_codes_and_messages() {
        assert_eq!(Refused::Unauthenticated("x".into()).status(), 401);
        let forbidden = Refused::Forbidden {
            user: "u".into(),
            verb: "get".into(),
            subresources: vec!["pods", "proxy"],
            reason: String::new(),
        };
        assert_eq!(forbidden.status(), 403);
        assert_eq!(
            forbidden.to_string(),
            "Forbidden (user=u, verb=get, resource=nodes, subresource(s)=[pods proxy])"
        );
        let with_reason = Refused::Forbidden {
            user: "u".into(),
            verb: "get".into(),
            subresources: vec!["stats"],
            reason: "no RBAC policy matched".into(),
        };
        assert!(
            with_reason
                .to_string()
                .ends_with("subresource(s)=[stats]): no RBAC policy matched"),
            "{with_reason}"
        );
    }
}
