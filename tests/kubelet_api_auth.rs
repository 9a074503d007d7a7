//! Who the kubelet port lets in, decided as a 1.33+ kubelet decides it, against the real
//! upper API server: the subresources each path is authorized on, the caller's uid and
//! extra carried into the SubjectAccessReview, and TokenReview answers reused for the
//! cache TTL.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};

use common::{TIMEOUT, start_node};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenReview};
use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};
use tensile_harness::fixtures::pod;
use tensile_harness::pki::ClientCert;
use tensile_harness::{ClusterPair, TestNamespace, wait_for};
use tokio::process::Command;

/// A pod-bound token's extra: its pod's name and UID.
const POD_NAME: &str = "authentication.kubernetes.io/pod-name";
const POD_UID: &str = "authentication.kubernetes.io/pod-uid";
/// The extra naming the credential (a token's JTI).
const CREDENTIAL_ID: &str = "authentication.kubernetes.io/credential-id";

/// How a request to the kubelet port presents itself.
#[derive(Clone, Copy)]
enum Credential<'a> {
    None,
    Cert(&'a ClientCert),
    Token(&'a str),
}

/// `GET url` on the kubelet port: the HTTP status code and the body.
async fn get(url: &str, ca: &Path, credential: Credential<'_>) -> (u16, String) {
    let mut command = Command::new("curl");
    command
        .args([
            "-sS",
            "--max-time",
            "30",
            "-w",
            "\n%{http_code}",
            "--cacert",
        ])
        .arg(ca);
    match credential {
        Credential::None => {}
        Credential::Cert(cert) => {
            command
                .arg("--cert")
                .arg(&cert.cert)
                .arg("--key")
                .arg(&cert.key);
        }
        Credential::Token(token) => {
            command
                .arg("-H")
                .arg(format!("Authorization: Bearer {token}"));
        }
    }
    let output = command.arg(url).output().await.unwrap();
    let out = String::from_utf8_lossy(&output.stdout).into_owned();
    let (body, code) = out.rsplit_once('\n').unwrap_or(("", &out));
    let code = code.trim().parse().unwrap_or_else(|_| {
        panic!(
            "curl {url}: {out} {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (code, body.to_owned())
}

/// Cluster-scoped objects a test made, deleted by [`Cleanup::run`].
#[derive(Default)]
struct Cleanup {
    roles: Vec<String>,
    bindings: Vec<String>,
    webhooks: Vec<String>,
}

impl Cleanup {
    async fn run(self, client: &Client) {
        let dp = DeleteParams::default();
        for name in &self.bindings {
            Api::<ClusterRoleBinding>::all(client.clone())
                .delete(name, &dp)
                .await
                .unwrap();
        }
        for name in &self.roles {
            Api::<ClusterRole>::all(client.clone())
                .delete(name, &dp)
                .await
                .unwrap();
        }
        for name in &self.webhooks {
            Api::<ValidatingWebhookConfiguration>::all(client.clone())
                .delete(name, &dp)
                .await
                .unwrap();
        }
    }
}

/// Lets `subject` (an RBAC subject) `get` `nodes/<subresource>` of `node` only, through a
/// ClusterRole and binding named `name`.
async fn grant(
    client: &Client,
    cleanup: &mut Cleanup,
    name: &str,
    subject: Value,
    node: &str,
    subresource: &str,
) {
    let pp = PostParams::default();
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": name},
        "rules": [{"apiGroups": [""], "resources": [format!("nodes/{subresource}")],
                   "verbs": ["get"], "resourceNames": [node]}],
    }))
    .unwrap();
    Api::<ClusterRole>::all(client.clone())
        .create(&pp, &role)
        .await
        .unwrap();
    cleanup.roles.push(name.to_owned());
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [subject],
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(&pp, &binding)
        .await
        .unwrap();
    cleanup.bindings.push(name.to_owned());
}

/// Waits until the upper API server answers `review` (a SubjectAccessReview spec) with
/// `allowed`: RBAC objects just made take effect a moment later, and a denial the node
/// saw before that would stay cached for the unauthorized TTL.
async fn wait_review(client: &Client, review: Value, allowed: bool) {
    let reviews: Api<SubjectAccessReview> = Api::all(client.clone());
    let sar: SubjectAccessReview = serde_json::from_value(json!({"spec": review})).unwrap();
    wait_for(
        &format!("SubjectAccessReview {review} allowed={allowed}"),
        TIMEOUT,
        || async {
            let answer = reviews.create(&PostParams::default(), &sar).await?;
            Ok((answer.status.is_some_and(|s| s.allowed) == allowed).then_some(()))
        },
    )
    .await
    .unwrap();
}

/// `get nodes/<subresource>` of `node` for `user` in `groups`, as a SubjectAccessReview spec.
fn node_review(user: &str, groups: &[&str], node: &str, subresource: &str) -> Value {
    json!({
        "user": user, "groups": groups,
        "resourceAttributes": {"verb": "get", "resource": "nodes", "subresource": subresource, "name": node},
    })
}

/// Each path is authorized on the subresources a 1.33+ kubelet uses (KubeletFineGrainedAuthz,
/// GA and locked on in 1.36), the first allowed one letting the call in: `/healthz` on
/// `nodes/healthz` then `nodes/proxy`, `/pods` and `/runningpods/` on `nodes/pods` then
/// `nodes/proxy`, `/stats/*` on `nodes/stats` alone, `/metrics/*` on `nodes/metrics`
/// alone, the rest on `nodes/proxy`;
/// `/healthz` is no exception to authentication; and every caller, a certificate's too, is
/// in `system:authenticated`.
#[tokio::test]
async fn each_path_is_authorized_on_the_subresources_a_kubelet_uses() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-authz-paths";
    let vn = start_node(pair, node, &[]).await;
    let upper = pair.upper.client().await.unwrap();
    let mut cleanup = Cleanup::default();
    let kinds = ["healthz", "pods", "proxy", "metrics"];
    let mut certs = std::collections::BTreeMap::new();
    for kind in kinds.iter().chain(&["nobody"]) {
        let user = format!("{node}-{kind}");
        certs.insert(*kind, pair.upper.pki.issue_client(&user, &[]).unwrap());
    }
    for kind in kinds {
        let user = format!("{node}-{kind}");
        let subject =
            json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user});
        grant(&upper, &mut cleanup, &user, subject, node, kind).await;
        wait_review(&upper, node_review(&user, &[], node, kind), true).await;
    }
    // Every authenticated caller is in system:authenticated, certificates included.
    let everyone = "system:authenticated";
    let subject =
        json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": everyone});
    let name = format!("{node}-stats");
    grant(&upper, &mut cleanup, &name, subject, node, "stats").await;
    wait_review(&upper, node_review(&name, &[everyone], node, "stats"), true).await;

    let base = format!("https://127.0.0.1:{}", vn.kubelet_port);
    let logs = "/containerLogs/default/web/app";
    // (who, path, status, what the body says)
    let cases: &[(Option<&str>, &str, u16, &str)] = &[
        (None, "/healthz", 401, "Unauthorized"),
        (None, "/pods", 401, "Unauthorized"),
        (
            Some("nobody"),
            "/healthz",
            403,
            "subresource(s)=[healthz proxy]",
        ),
        (
            Some("nobody"),
            "/runningpods/",
            403,
            "subresource(s)=[pods proxy]",
        ),
        (Some("healthz"), "/healthz", 200, "ok"),
        (Some("healthz"), "/pods", 403, "subresource(s)=[pods proxy]"),
        (Some("pods"), "/pods", 200, "PodList"),
        (Some("pods"), "/runningpods/", 200, "PodList"),
        (Some("pods"), "/healthz", 403, "user=vk-authz-paths-pods"),
        (Some("pods"), logs, 403, "subresource(s)=[proxy]"),
        (Some("proxy"), "/healthz", 200, "ok"),
        (Some("proxy"), "/pods", 200, "PodList"),
        (Some("proxy"), "/runningpods/", 200, "PodList"),
        (Some("healthz"), "/pods/", 403, "verb=get"),
        // past authorization (system:authenticated): the lower cluster has no metrics API
        (Some("nobody"), "/stats/summary", 404, "metrics.k8s.io"),
        (Some("proxy"), "/stats/summary", 404, "metrics.k8s.io"),
        (
            Some("nobody"),
            "/metrics/resource",
            403,
            "subresource(s)=[metrics]",
        ),
        (
            Some("proxy"),
            "/metrics/resource",
            403,
            "subresource(s)=[metrics]",
        ),
        (Some("metrics"), "/pods", 403, "subresource(s)=[pods proxy]"),
        // no pods on the node: nothing to read below, and nothing missing
        (
            Some("metrics"),
            "/metrics/resource",
            200,
            "\nscrape_error 0\n",
        ),
    ];
    let ca = &pair.upper.pki.ca_cert;
    let mut failures = Vec::new();
    for (who, path, want, says) in cases {
        let credential = who.map_or(Credential::None, |who| Credential::Cert(&certs[who]));
        let (code, body) = get(&format!("{base}{path}"), ca, credential).await;
        if code != *want || !body.contains(says) {
            failures.push(format!(
                "{who:?} {path}: {code} {body:?}, want {want} with {says:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    cleanup.run(&upper).await;
}

/// A token of `account`, requested with `spec` (a TokenRequest spec).
async fn token(accounts: &Api<ServiceAccount>, account: &str, spec: Value) -> String {
    let request: TokenRequest = serde_json::from_value(json!({"spec": spec})).unwrap();
    accounts
        .create_token_request(account, &PostParams::default(), &request)
        .await
        .unwrap()
        .status
        .and_then(|s| s.token)
        .unwrap()
}

/// A token of `account` bound to `pod`, as a pod's projected token is.
async fn bound_token(accounts: &Api<ServiceAccount>, account: &str, pod: &Pod) -> String {
    let bound = json!({"apiVersion": "v1", "kind": "Pod",
        "name": pod.metadata.name, "uid": pod.metadata.uid});
    let spec = json!({"audiences": [], "expirationSeconds": 3600, "boundObjectRef": bound});
    token(accounts, account, spec).await
}

/// A validating admission webhook on 127.0.0.1 that the upper API server sends the
/// SubjectAccessReviews it receives for one user: it records each review's spec and admits
/// it only if `admit` says so (a review refused here fails, as an authorizer's error).
struct ReviewWebhook {
    /// `https://127.0.0.1:<port>/`.
    url: String,
    /// Its self-signed serving certificate, PEM (the configuration's `caBundle`).
    ca_pem: String,
    /// The specs received, in order.
    seen: Arc<Mutex<Vec<Value>>>,
    server: tokio::task::JoinHandle<()>,
}

impl ReviewWebhook {
    async fn start(admit: fn(&Value) -> Result<(), String>) -> Self {
        let generated = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
        let ca_pem = generated.cert.pem();
        let key = rustls::pki_types::PrivateKeyDer::try_from(generated.signing_key.serialize_der())
            .unwrap();
        let tls = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![generated.cert.der().clone()], key)
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}/", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let recorded = seen.clone();
        let server = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, recorded) = (acceptor.clone(), recorded.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let service = hyper::service::service_fn(move |req| {
                        let recorded = recorded.clone();
                        async move {
                            let body = http_body_util::BodyExt::collect(req.into_body())
                                .await?
                                .to_bytes();
                            let review: Value = serde_json::from_slice(&body).unwrap_or_default();
                            let spec = review["request"]["object"]["spec"].clone();
                            let verdict = admit(&spec);
                            recorded.lock().unwrap().push(spec);
                            let mut response = json!({"uid": review["request"]["uid"], "allowed": verdict.is_ok()});
                            if let Err(message) = verdict {
                                response["status"] = json!({"code": 403, "message": message});
                            }
                            let answer = json!({"apiVersion": "admission.k8s.io/v1",
                                "kind": "AdmissionReview", "response": response});
                            Ok::<_, hyper::Error>(hyper::Response::new(http_body_util::Full::new(
                                bytes::Bytes::from(answer.to_string()),
                            )))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                        .await;
                });
            }
        });
        Self {
            url,
            ca_pem,
            seen,
            server,
        }
    }

    /// The specs received so far.
    fn seen(&self) -> Vec<Value> {
        self.seen.lock().unwrap().clone()
    }

    /// Sends it the SubjectAccessReviews for `user`, failing closed, as `name`.
    async fn register(&self, client: &Client, name: &str, user: &str) {
        let mut configuration: ValidatingWebhookConfiguration = serde_json::from_value(json!({
            "metadata": {"name": name},
            "webhooks": [{
                "name": "reviews.tensile.dev",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "timeoutSeconds": 5,
                "failurePolicy": "Fail",
                "clientConfig": {"url": self.url},
                "rules": [{"apiGroups": ["authorization.k8s.io"], "apiVersions": ["v1"],
                           "operations": ["CREATE"], "resources": ["subjectaccessreviews"]}],
                "matchConditions": [{"name": "the-test-caller",
                    "expression": format!("has(object.spec.user) && object.spec.user == '{user}'")}],
            }],
        }))
        .unwrap();
        for webhook in configuration.webhooks.iter_mut().flatten() {
            webhook.client_config.ca_bundle = Some(ByteString(self.ca_pem.clone().into_bytes()));
        }
        Api::<ValidatingWebhookConfiguration>::all(client.clone())
            .create(&PostParams::default(), &configuration)
            .await
            .unwrap();
    }
}

impl Drop for ReviewWebhook {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// RBAC cannot see a caller's uid or extra, but other authorizers can (webhooks; tokens
/// scoped by extra), so the SubjectAccessReview carries them as a kubelet's does, and its
/// answers are cached per uid and extra. The least powerful real check: the upper API
/// server hands the reviews it receives for one service account to a validating admission
/// webhook (ValidatingAdmissionPolicies never see reviews), which records them and refuses
/// any without a pod-bound token's `authentication.kubernetes.io/pod-name` of `holder-a`:
/// the node's review then fails, a 500 as a kubelet's authorization error.
#[tokio::test]
async fn a_token_callers_uid_and_extra_reach_the_subject_access_review() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-authz-extra";
    let vn = start_node(pair, node, &["--authentication-token-webhook"]).await;
    let upper = pair.upper.client().await.unwrap();
    let ns = TestNamespace::create(&upper, "authz-extra").await.unwrap();
    let pp = PostParams::default();
    let accounts: Api<ServiceAccount> = Api::namespaced(upper.clone(), &ns.name);
    let account: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": "caller"}})).unwrap();
    let account = accounts.create(&pp, &account).await.unwrap();
    let uid = account.metadata.uid.unwrap();
    let user = format!("system:serviceaccount:{}:caller", ns.name);
    // Pods of the account the tokens are bound to; they need not run.
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let spec = json!({"serviceAccountName": "caller",
        "containers": [{"name": "app", "image": "busybox"}]});
    let holder_a = pods
        .create(&pp, &pod("holder-a", spec.clone()))
        .await
        .unwrap();
    let holder_b = pods.create(&pp, &pod("holder-b", spec)).await.unwrap();

    let mut cleanup = Cleanup::default();
    let name = format!("{node}-{}", ns.name);
    let subject = json!({"kind": "ServiceAccount", "name": "caller", "namespace": ns.name});
    grant(&upper, &mut cleanup, &name, subject, node, "proxy").await;
    let webhook =
        ReviewWebhook::start(
            |spec| match spec["extra"][POD_NAME].as_array().map(Vec::as_slice) {
                Some([pod]) if pod == "holder-a" => Ok(()),
                other => Err(format!("pod-name {other:?}: only holder-a's token may")),
            },
        )
        .await;
    webhook.register(&upper, &name, &user).await;
    cleanup.webhooks.push(name.clone());
    // In force once a review without the extra is refused, and RBAC once the full one is
    // allowed.
    let reviews: Api<SubjectAccessReview> = Api::all(upper.clone());
    let bare: SubjectAccessReview =
        serde_json::from_value(json!({"spec": node_review(&user, &[], node, "proxy")})).unwrap();
    wait_for("the webhook in force", TIMEOUT, || async {
        Ok(reviews.create(&pp, &bare).await.is_err().then_some(()))
    })
    .await
    .unwrap();
    let mut full = node_review(&user, &[], node, "proxy");
    full["extra"] = json!({POD_NAME: ["holder-a"]});
    wait_review(&upper, full, true).await;
    let before = webhook.seen().len();

    let token_a = bound_token(&accounts, "caller", &holder_a).await;
    let token_b = bound_token(&accounts, "caller", &holder_b).await;
    let url = format!("https://127.0.0.1:{}/pods", vn.kubelet_port);
    let ca = &pair.upper.pki.ca_cert;
    let (code, body) = get(&url, ca, Credential::Token(&token_a)).await;
    assert_eq!(code, 200, "the token bound to holder-a: {body}");
    assert!(body.contains("PodList"), "{body}");
    // Same user, uid and groups, another pod-name: a review of its own, not holder-a's
    // cached answer.
    let (code, body) = get(&url, ca, Credential::Token(&token_b)).await;
    assert_eq!(code, 500, "the token bound to holder-b: {body}");
    assert!(
        body.contains("only holder-a"),
        "the webhook's refusal: {body}"
    );

    // What the upper API server received from the node: the whole caller, each time; for
    // `/pods`, `nodes/pods` then (RBAC grants only proxy) `nodes/proxy`; holder-b's stops
    // at the refused first review, as a kubelet stops at an authorizer's error.
    let seen = webhook.seen().split_off(before);
    let asked: Vec<(&Pod, &str)> = vec![
        (&holder_a, "pods"),
        (&holder_a, "proxy"),
        (&holder_b, "pods"),
    ];
    assert_eq!(seen.len(), asked.len(), "{seen:#?}");
    for (spec, (holder, subresource)) in seen.iter().zip(asked) {
        let want_extra = json!({
            POD_NAME: [holder.metadata.name],
            POD_UID: [holder.metadata.uid],
            CREDENTIAL_ID: spec["extra"][CREDENTIAL_ID],
        });
        assert_eq!(spec["user"], json!(user), "{spec:#}");
        assert_eq!(spec["uid"], json!(uid), "{spec:#}");
        assert_eq!(spec["extra"], want_extra, "{spec:#}");
        assert!(
            spec["extra"][CREDENTIAL_ID][0]
                .as_str()
                .is_some_and(|id| id.starts_with("JTI=")),
            "{spec:#}"
        );
        assert_eq!(
            spec["groups"],
            json!([
                "system:serviceaccounts",
                format!("system:serviceaccounts:{}", ns.name),
                "system:authenticated"
            ]),
            "{spec:#}"
        );
        assert_eq!(
            spec["resourceAttributes"],
            json!({"verb": "get", "version": "v1", "resource": "nodes",
                   "subresource": subresource, "name": node}),
        );
    }

    cleanup.run(&upper).await;
    ns.delete().await.unwrap();
}

/// A TokenReview answer is reused for `--authentication-token-webhook-cache-ttl`, as the
/// kubelet's delegating authenticator does (and 0 turns the cache off): seen from outside,
/// a token revoked in the upper cluster keeps working on the kubelet port until its
/// answer expires.
#[tokio::test]
async fn token_reviews_are_reused_for_the_cache_ttl() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let ns = TestNamespace::create(&upper, "authn-cache").await.unwrap();
    let pp = PostParams::default();
    let (cached, uncached) = ("vk-authn-cached", "vk-authn-uncached");
    let (vn_cached, vn_uncached) = tokio::join!(
        start_node(
            pair,
            cached,
            &[
                "--authentication-token-webhook",
                "--authentication-token-webhook-cache-ttl=10m"
            ]
        ),
        start_node(
            pair,
            uncached,
            &[
                "--authentication-token-webhook",
                "--authentication-token-webhook-cache-ttl=0s"
            ]
        ),
    );
    let accounts: Api<ServiceAccount> = Api::namespaced(upper.clone(), &ns.name);
    let account: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": "caller"}})).unwrap();
    accounts.create(&pp, &account).await.unwrap();
    let user = format!("system:serviceaccount:{}:caller", ns.name);
    let groups = [
        "system:serviceaccounts",
        &format!("system:serviceaccounts:{}", ns.name),
        "system:authenticated",
    ];
    let mut cleanup = Cleanup::default();
    for node in [cached, uncached] {
        let name = format!("{node}-{}", ns.name);
        let subject = json!({"kind": "ServiceAccount", "name": "caller", "namespace": ns.name});
        grant(&upper, &mut cleanup, &name, subject, node, "proxy").await;
        wait_review(&upper, node_review(&user, &groups, node, "proxy"), true).await;
    }
    let token = token(
        &accounts,
        "caller",
        json!({"audiences": [], "expirationSeconds": 3600}),
    )
    .await;
    let ca = &pair.upper.pki.ca_cert;
    let url =
        |vn: &tensile_harness::VirtualNode| format!("https://127.0.0.1:{}/pods", vn.kubelet_port);
    for vn in [&vn_cached, &vn_uncached] {
        let (code, body) = get(&url(vn), ca, Credential::Token(&token)).await;
        assert_eq!(code, 200, "{}: {body}", vn.node_name);
    }

    // Revoked: the account is gone, and the upper API server says so.
    accounts
        .delete("caller", &DeleteParams::default())
        .await
        .unwrap();
    let reviews: Api<TokenReview> = Api::all(upper.clone());
    let review: TokenReview = serde_json::from_value(json!({"spec": {"token": token}})).unwrap();
    wait_for("the token revoked", TIMEOUT, || async {
        let answer = reviews.create(&pp, &review).await?;
        let authenticated = answer.status.and_then(|s| s.authenticated);
        Ok((authenticated != Some(true)).then_some(()))
    })
    .await
    .unwrap();

    let (code, body) = get(&url(&vn_cached), ca, Credential::Token(&token)).await;
    assert_eq!(code, 200, "within the 10m cache TTL: {body}");
    let (code, body) = get(&url(&vn_uncached), ca, Credential::Token(&token)).await;
    assert_eq!(code, 401, "with the cache off: {body}");

    cleanup.run(&upper).await;
    ns.delete().await.unwrap();
}
