//! The real server on loopback (rustls, axum, the core), in process: HTTP-level answers to
//! good and bad input, the side routes, and certificate reload.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use base64::Engine;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
use serde_json::{Value, json};
use tensile_harness::wait_for;
use tensile_webhook::certs;
use tensile_webhook::loopback::{self, Client, Running, sample_review};
use tensile_webhook::memory::DeschedulerMemory;
use tensile_webhook::metrics::Metrics;
use tensile_webhook::mutate::{MutateConfig, NoSelectedNodes};
use tensile_webhook::server::App;

const LIMIT: usize = 64 << 10;

struct Fixture {
    running: Running,
    client: Client,
    metrics: Arc<Metrics>,
    dir: tempfile::TempDir,
}

async fn start() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let generated = certs::generate("tensile-webhook", &["127.0.0.1".into()], 1).unwrap();
    generated.write(dir.path()).unwrap();
    let metrics = Arc::new(Metrics::default());
    let app = Arc::new(App {
        config: MutateConfig::default(),
        memory: DeschedulerMemory::default(),
        volumes: Arc::new(NoSelectedNodes),
        metrics: metrics.clone(),
        max_body_bytes: LIMIT,
    });
    let running = loopback::serve(
        app,
        &dir.path().join("tls.crt"),
        &dir.path().join("tls.key"),
        Duration::from_millis(100),
    )
    .await
    .unwrap();
    let client = Client::new(running.addr, generated.ca_pem.as_bytes(), "127.0.0.1").unwrap();
    Fixture {
        running,
        client,
        metrics,
        dir,
    }
}

async fn post(client: &Client, body: Vec<u8>) -> (u16, String) {
    let mut conn = client.connect().await.unwrap();
    let reply = conn.send("POST", "/mutate", body).await.unwrap();
    (
        reply.status,
        String::from_utf8_lossy(&reply.body).into_owned(),
    )
}

#[tokio::test]
async fn answers_a_review_with_a_patch() {
    let f = start().await;
    let (status, body) = post(
        &f.client,
        serde_json::to_vec(&sample_review("u-1", true)).unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let review: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(review["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(review["response"]["uid"], "u-1");
    assert_eq!(review["response"]["allowed"], true);
    assert_eq!(review["response"]["patchType"], "JSONPatch");
    let patch = base64::engine::general_purpose::STANDARD
        .decode(review["response"]["patch"].as_str().unwrap())
        .unwrap();
    let patch: json_patch::Patch = serde_json::from_slice(&patch).unwrap();
    let mut pod = sample_review("u-1", true)["request"]["object"].clone();
    json_patch::patch(&mut pod, &patch).unwrap();
    assert_eq!(pod["spec"]["nodeSelector"], json!({"clusterID": "vk-node"}));
    assert!(pod["metadata"]["annotations"]["clusterSelector"].is_string());

    // An unlabelled pod: allowed, no patch.
    let (status, body) = post(
        &f.client,
        serde_json::to_vec(&sample_review("u-2", false)).unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    let review: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(review["response"], json!({"uid": "u-2", "allowed": true}));
    f.running.shutdown.cancel();
}

/// A DaemonSet review goes to the DaemonSet core (its template kept off virtual nodes), a
/// pod review to the pod core, on the one `/mutate` path.
#[tokio::test]
async fn routes_a_daemonset_review_by_its_kind() {
    let f = start().await;
    let daemonset = json!({
        "metadata": {"name": "agent", "namespace": "ns"},
        "spec": {"template": {"spec": {"containers": [], "tolerations": [{"operator": "Exists"}]}}},
    });
    let review = |uid: &str, group: &str, kind: &str| {
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": uid, "kind": {"group": group, "version": "v1", "kind": kind},
            "resource": {"group": group, "version": "v1", "resource": "daemonsets"},
            "namespace": "ns", "operation": "CREATE", "object": daemonset,
        }})
    };
    let (status, body) = post(
        &f.client,
        serde_json::to_vec(&review("ds", "apps", "DaemonSet")).unwrap(),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    let patch = base64::engine::general_purpose::STANDARD
        .decode(answer["response"]["patch"].as_str().unwrap())
        .unwrap();
    let patch: json_patch::Patch = serde_json::from_slice(&patch).unwrap();
    let mut object = daemonset.clone();
    json_patch::patch(&mut object, &patch).unwrap();
    assert_eq!(
        object["spec"]["template"]["spec"]["affinity"],
        json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "type", "operator": "NotIn", "values": ["virtual-kubelet"]}]}]}}})
    );
    // The same object under another kind is not a DaemonSet: allowed, no patch.
    let (status, body) = post(
        &f.client,
        serde_json::to_vec(&review("other", "example.com", "DaemonSet")).unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["response"], json!({"uid": "other", "allowed": true}));
    f.running.shutdown.cancel();
}

/// Fast and deterministic: every kind of bad input is a 400 saying what is wrong, and the
/// server keeps serving.
#[tokio::test]
async fn bad_input_is_a_400_with_a_message() {
    let f = start().await;
    let review = sample_review("u", true);
    let with = |pointer: &str, value: Value| {
        let mut r = review.clone();
        *r.pointer_mut(pointer).unwrap() = value;
        serde_json::to_vec(&r).unwrap()
    };
    let without = |key: &str| {
        let mut r = review.clone();
        r["request"].as_object_mut().unwrap().remove(key);
        serde_json::to_vec(&r).unwrap()
    };
    let mut no_request = review.clone();
    no_request.as_object_mut().unwrap().remove("request");
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("empty", Vec::new(), "empty body"),
        (
            "malformed JSON",
            b"{\"apiVersion\": \"admission.k8s.io/v1\", ".to_vec(),
            "not valid JSON",
        ),
        ("not UTF-8", vec![0xc3, 0x28, 0xa0, 0xa1], "not valid JSON"),
        (
            "wrong apiVersion",
            with("/apiVersion", json!("admission.k8s.io/v1beta1")),
            "is not supported",
        ),
        (
            "wrong kind",
            with("/kind", json!("ConversionReview")),
            "is not AdmissionReview",
        ),
        (
            "no request",
            serde_json::to_vec(&no_request).unwrap(),
            "has no request",
        ),
        ("no object", without("object"), "has no object"),
        (
            "request not an object",
            with("/request", json!("pod")),
            "not an AdmissionReview",
        ),
        (
            "oversized",
            vec![b' '; LIMIT + 1],
            "larger than 65536 bytes",
        ),
    ];
    for (name, body, want) in cases {
        let (status, message) = post(&f.client, body).await;
        assert_eq!(status, 400, "{name}: {message}");
        assert!(message.contains(want), "{name}: {message}");
    }
    assert_eq!(f.metrics.bad_requests.get(), 9);

    // An unreadable pod is not bad input: allowed, unchanged, with a warning.
    let (status, body) = post(
        &f.client,
        with("/request/object/spec/tolerations", json!("all")),
    )
    .await;
    assert_eq!(status, 200);
    let review: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(review["response"]["allowed"], true);
    assert!(review["response"].get("patch").is_none());
    assert!(
        review["response"]["warnings"][0]
            .as_str()
            .unwrap()
            .contains("unchanged")
    );

    // Still serving.
    let (status, _) = post(
        &f.client,
        serde_json::to_vec(&sample_review("again", true)).unwrap(),
    )
    .await;
    assert_eq!(status, 200);
    f.running.shutdown.cancel();
}

#[tokio::test]
async fn serves_health_readiness_and_metrics() {
    let f = start().await;
    let mut conn = f.client.connect().await.unwrap();
    assert_eq!(
        conn.send("GET", "/healthz", Vec::new())
            .await
            .unwrap()
            .status,
        200
    );
    assert_eq!(
        conn.send("GET", "/readyz", Vec::new())
            .await
            .unwrap()
            .status,
        503
    );
    f.metrics.ready.store(true, Ordering::Relaxed);
    assert_eq!(
        conn.send("GET", "/readyz", Vec::new())
            .await
            .unwrap()
            .status,
        200
    );
    conn.send(
        "POST",
        "/mutate",
        serde_json::to_vec(&sample_review("m", true)).unwrap(),
    )
    .await
    .unwrap();
    let metrics = conn.send("GET", "/metrics", Vec::new()).await.unwrap();
    let text = String::from_utf8(metrics.body).unwrap();
    assert!(
        text.contains("tensile_webhook_requests_total{decision=\"mutated\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("tensile_webhook_review_duration_seconds_count 1"),
        "{text}"
    );
    assert_eq!(
        conn.send("GET", "/nope", Vec::new()).await.unwrap().status,
        404
    );
    f.running.shutdown.cancel();
}

fn rewrite(dir: &Path, cert: &str, key: &str) {
    // As a Secret volume update does: new files swapped in, not edited in place.
    for (name, content) in [("tls.crt", cert), ("tls.key", key)] {
        let tmp = dir.join(format!(".{name}.new"));
        std::fs::write(&tmp, content).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    }
}

#[tokio::test]
async fn reloads_the_certificate_when_the_files_change() {
    let f = start().await;
    let before = f.client.peer_certificate().await.unwrap();
    // A connection made before the change keeps working after it.
    let mut old = f.client.connect().await.unwrap();

    // A half-written pair (a key of another certificate) is refused; the old one stays.
    let other = certs::generate("tensile-webhook", &["127.0.0.1".into()], 1).unwrap();
    let current_key = std::fs::read_to_string(f.dir.path().join("tls.key")).unwrap();
    rewrite(f.dir.path(), &other.cert_pem, &current_key);
    wait_for("the reload error", Duration::from_secs(10), || async {
        Ok((f.metrics.cert_reload_errors.get() > 0).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(f.client.peer_certificate().await.unwrap(), before);

    // A new pair (from another CA here, so a client trusting both tells them apart).
    rewrite(f.dir.path(), &other.cert_pem, &other.key_pem);
    let new_cert = CertificateDer::from_pem_slice(other.cert_pem.as_bytes()).unwrap();
    let both = format!(
        "{}{}",
        std::fs::read_to_string(f.dir.path().join("ca.crt")).unwrap(),
        other.ca_pem
    );
    let client = Client::new(f.running.addr, both.as_bytes(), "127.0.0.1").unwrap();
    wait_for(
        "the new certificate to be served",
        Duration::from_secs(10),
        || async {
            let served = client.peer_certificate().await;
            Ok(served
                .ok()
                .filter(|s| s.as_slice() == new_cert.as_ref())
                .map(|_| ()))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(f.metrics.cert_reloads.get(), 1);
    assert_eq!(
        old.send("GET", "/healthz", Vec::new())
            .await
            .unwrap()
            .status,
        200
    );
    f.running.shutdown.cancel();
}
