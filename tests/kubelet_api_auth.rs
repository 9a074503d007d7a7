//! Who the kubelet port lets in, decided as a 1.33+ kubelet decides it, against the real
//! upper API server: the subresources each path is authorized on.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::path::Path;

use common::{TIMEOUT, start_node};
use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};
use tensile_harness::pki::ClientCert;
use tensile_harness::{ClusterPair, wait_for};
use tokio::process::Command;

/// How a request to the kubelet port presents itself.
#[derive(Clone, Copy)]
enum Credential<'a> {
    None,
    Cert(&'a ClientCert),
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
/// `nodes/proxy`, `/stats/*` on `nodes/stats` alone, the rest on `nodes/proxy`; and
/// `/healthz` is no exception to authentication.
#[tokio::test]
async fn each_path_is_authorized_on_the_subresources_a_kubelet_uses() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-authz-paths";
    let vn = start_node(pair, node, &[]).await;
    let upper = pair.upper.client().await.unwrap();
    let mut cleanup = Cleanup::default();
    let kinds = ["healthz", "pods", "proxy"];
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
        (
            Some("proxy"),
            "/stats/summary",
            403,
            "subresource(s)=[stats]",
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
