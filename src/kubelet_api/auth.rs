//! Who may use the kubelet API, as a kubelet decides it: an X.509 client certificate
//! verified against a CA, or a bearer token checked with a TokenReview (authentication);
//! a SubjectAccessReview on `nodes/<subresource>` (authorization), cached briefly.

use std::collections::HashMap;
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

/// An authenticated caller.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct User {
    /// User name (a certificate's CN).
    pub name: String,
    /// Groups (a certificate's O).
    pub groups: Vec<String>,
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
    #[error("authorization check failed in the upper cluster: {0}")]
    Review(#[from] kube::Error),
}

impl Refused {
    /// The HTTP status code a kubelet answers with.
    pub fn status(&self) -> http::StatusCode {
        match self {
            Self::Unauthenticated(_) => http::StatusCode::UNAUTHORIZED,
            Self::Forbidden { .. } => http::StatusCode::FORBIDDEN,
            Self::Review(_) => http::StatusCode::INTERNAL_SERVER_ERROR,
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
    /// How long an allowed decision is reused.
    pub authorized_ttl: Duration,
    /// How long a denied decision is reused.
    pub unauthorized_ttl: Duration,
    /// Let everyone in (`--no-verify-clients`): labs only.
    pub no_verify: bool,
}

/// Authenticates and authorizes callers against the upper cluster.
pub struct Authenticator {
    ca: Option<Arc<dyn ClientCertVerifier>>,
    upper: Client,
    node: String,
    config: AuthConfig,
    decisions: Mutex<HashMap<DecisionKey, Decision>>,
}

/// Who asked for which subresource with which verb.
type DecisionKey = (User, &'static str, &'static str);
/// Allowed or not, the reason, and when the answer was given.
type Decision = (bool, String, Instant);

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("node", &self.node)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The user named by a certificate: CN is the name, each O a group.
pub fn certificate_user(der: &[u8]) -> Option<User> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let subject = cert.subject();
    let name = subject
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())?
        .to_owned();
    let groups = subject
        .iter_organization()
        .filter_map(|o| o.as_str().ok().map(str::to_owned))
        .collect();
    Some(User { name, groups })
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
        Ok(Self {
            ca,
            upper,
            node,
            config,
            decisions: Mutex::new(HashMap::new()),
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
            Some(Ok(user)) => return Ok(user),
            Some(Err(refused)) => Some(refused),
            None => None,
        };
        let token = authorization
            .and_then(|h| h.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .filter(|t| !t.is_empty());
        match (token, certificate) {
            (Some(token), _) if self.config.token_webhook => self.review_token(token).await,
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
        certificate_user(end_entity)
            .ok_or_else(|| Refused::Unauthenticated("client certificate has no common name".into()))
    }

    async fn review_token(&self, token: &str) -> Result<User, Refused> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_owned(),
                audiences: None,
            },
            ..TokenReview::default()
        };
        let answer = Api::<TokenReview>::all(self.upper.clone())
            .create(&PostParams::default(), &review)
            .await?;
        let status = answer.status.unwrap_or_default();
        match (status.authenticated, status.user) {
            (Some(true), Some(user)) => Ok(User {
                name: user.username.unwrap_or_default(),
                groups: user.groups.unwrap_or_default(),
            }),
            _ => Err(Refused::Unauthenticated(
                status
                    .error
                    .unwrap_or_else(|| "invalid bearer token".into()),
            )),
        }
    }

    /// Whether `user` may `verb` `nodes/<subresource>` of this node for one of
    /// `subresources`, asked in order as the kubelet does: the first allowed one lets the
    /// call in, a failure to ask ends it. Each answer is a SubjectAccessReview in the upper
    /// cluster, cached for the configured TTLs.
    pub async fn authorize(
        &self,
        user: &User,
        verb: &'static str,
        subresources: &'static [&'static str],
    ) -> Result<(), Refused> {
        let mut reasons = Vec::new();
        for &subresource in subresources {
            let (allowed, reason) = self.decision(user, verb, subresource).await?;
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
        verb: &'static str,
        subresource: &'static str,
    ) -> Result<(bool, String), Refused> {
        let key = (user.clone(), verb, subresource);
        let cached = self
            .decisions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .filter(|(allowed, _, at)| {
                let ttl = if *allowed {
                    self.config.authorized_ttl
                } else {
                    self.config.unauthorized_ttl
                };
                at.elapsed() < ttl
            })
            .map(|(allowed, reason, _)| (*allowed, reason.clone()));
        if let Some(decision) = cached {
            return Ok(decision);
        }
        let (allowed, reason) = self.review_access(user, verb, subresource).await?;
        let mut decisions = self
            .decisions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Bounded: a flood of distinct users cannot grow it without end.
        if decisions.len() > 4096 {
            decisions.clear();
        }
        decisions.insert(key, (allowed, reason.clone(), Instant::now()));
        Ok((allowed, reason))
    }

    async fn review_access(
        &self,
        user: &User,
        verb: &str,
        subresource: &str,
    ) -> Result<(bool, String), Refused> {
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(user.name.clone()),
                groups: Some(user.groups.clone()),
                resource_attributes: Some(ResourceAttributes {
                    verb: Some(verb.to_owned()),
                    resource: Some("nodes".into()),
                    subresource: Some(subresource.to_owned()),
                    name: Some(self.node.clone()),
                    ..ResourceAttributes::default()
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let answer = Api::<SubjectAccessReview>::all(self.upper.clone())
            .create(&PostParams::default(), &review)
            .await?;
        let status = answer.status.unwrap_or_default();
        Ok((status.allowed, status.reason.unwrap_or_default()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificate_names_user_and_groups() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "kube-apiserver-kubelet-client");
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, "system:masters");
        let cert = params.self_signed(&key).unwrap();
        assert_eq!(
            certificate_user(cert.der()),
            Some(User {
                name: "kube-apiserver-kubelet-client".into(),
                groups: vec!["system:masters".into()],
            })
        );
        assert_eq!(certificate_user(b"not a certificate"), None);
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
