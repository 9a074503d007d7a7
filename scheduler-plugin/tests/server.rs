//! The HTTP server without clusters: routes, bad input, drain on shutdown, TLS.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tensile_harness::http::exchange;
use tensile_scheduler_extender::extender::{Extender, SharedCluster};
use tensile_scheduler_extender::metrics::Metrics;
use tensile_scheduler_extender::server::{self, App};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

async fn start(
    extender: Extender,
    tls: Option<tokio_rustls::TlsAcceptor>,
) -> (u16, CancellationToken, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = Arc::new(App {
        extender,
        metrics: Metrics::default(),
    });
    let shutdown = CancellationToken::new();
    let served = tokio::spawn(server::serve(
        listener,
        tls,
        server::router(app),
        shutdown.clone(),
    ));
    (port, shutdown, served)
}

#[tokio::test]
async fn routes_bad_input_and_drain() {
    let mut extender = Extender::default();
    extender
        .clusters
        .insert("vk".into(), SharedCluster::default());
    let (port, shutdown, served) = start(extender, None).await;

    assert_eq!(http(port, "GET", "/healthz", "").await.0, 200);
    let (status, body) = http(port, "GET", "/readyz", "").await;
    assert_eq!(
        (status, body.as_str()),
        (503, "vk: not synced yet; upper nodes: not synced yet\n")
    );

    for bad in [
        "",
        "{",
        "{\"Pod\": {}, \"NodeNames\": [",
        "[]",
        "{\"Pod\": {}}",
    ] {
        let (status, body) = http(port, "POST", "/filter", bad).await;
        assert_eq!(status, 400, "{bad:?}: {body}");
        let answer: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(!answer["Error"].as_str().unwrap().is_empty(), "{body}");
        let (status, _) = http(port, "POST", "/prioritize", bad).await;
        assert_eq!(status, 400, "{bad:?}");
    }
    let args = json!({"Pod": {"metadata": {"name": "p"}}, "NodeNames": ["vk", "regular"]});
    let (status, body) = http(port, "POST", "/filter", &args.to_string()).await;
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&body).unwrap(),
        json!({"NodeNames": ["regular"], "FailedNodes": {},
               "FailedAndUnresolvableNodes": {"vk": "lower cluster of vk: not synced yet"},
               "Error": ""})
    );
    let (_, metrics) = http(port, "GET", "/metrics", "").await;
    assert!(
        metrics.contains("tensile_extender_bad_requests_total{verb=\"filter\"} 5"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tensile_extender_lower_cluster_known{node=\"vk\"} 0"),
        "{metrics}"
    );

    // A request in flight when shutdown begins is still answered.
    let mut slow = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let body = args.to_string();
    let head = format!(
        "POST /filter HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    slow.write_all(head.as_bytes()).await.unwrap();
    slow.write_all(&body.as_bytes()[..5]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await; // let the server read the head
    shutdown.cancel();
    slow.write_all(&body.as_bytes()[5..]).await.unwrap();
    let mut response = String::new();
    slow.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    tokio::time::timeout(Duration::from_secs(5), served)
        .await
        .expect("drained and stopped")
        .unwrap();
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err(),
        "no longer listening"
    );
}

#[tokio::test]
async fn serves_tls() {
    let dir = tempfile::tempdir().unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let (cert_path, key_path) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert_path, cert.pem()).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    let acceptor = server::tls_acceptor(&cert_path, &key_path).unwrap();
    let (port, shutdown, served) = start(Extender::default(), Some(acceptor)).await;

    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.der().clone()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
    let tls = connector.connect(name, tcp).await.unwrap();
    let (status, body) = exchange(tls, "GET", "/healthz", "").await.unwrap();
    assert_eq!((status, body.as_str()), (200, "ok"));

    assert!(
        server::tls_acceptor(&key_path, &cert_path).is_err(),
        "swapped files"
    );
    shutdown.cancel();
    served.await.unwrap();
}

async fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    tensile_harness::http::request(port, method, path, body)
        .await
        .unwrap()
}

/// A member Secret's writer who puts `tokenFile: <the extender's own token>` and a server of
/// theirs in a kubeconfig the extender is given through `--config` (as the chart mounts
/// Secrets) stops it at start, the node, the file and the field named, and nothing reaches
/// their server.
#[tokio::test]
async fn a_kubeconfig_from_a_secret_naming_a_token_file_is_refused_at_start() {
    let theirs = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    theirs.set_nonblocking(true).unwrap();
    let server = format!("https://{}", theirs.local_addr().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "the-extenders-own-token").unwrap();
    let kubeconfig = |server: &str, user: &str| {
        json!({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": server}}],
            "users": [{"name": "u", "user": serde_json::from_str::<serde_json::Value>(user).unwrap()}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "c",
        })
        .to_string()
    };
    let upper = dir.path().join("upper.kubeconfig");
    std::fs::write(
        &upper,
        kubeconfig("https://127.0.0.1:1", r#"{"token": "abc"}"#),
    )
    .unwrap();
    let member = dir.path().join("vk-b.kubeconfig");
    let user = json!({"tokenFile": token}).to_string();
    std::fs::write(&member, kubeconfig(&server, &user)).unwrap();
    let config = dir.path().join("config.json");
    std::fs::write(&config, json!({"clusters": {"vk-b": member}}).to_string()).unwrap();

    let output = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_tensile-scheduler-extender"))
            .arg(format!("--kubeconfig={}", upper.display()))
            .arg(format!("--config={}", config.display()))
            .arg("--listen=127.0.0.1:0")
            .env_remove("KUBECONFIG")
            .output(),
    )
    .await
    .expect("the extender kept running")
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    let refused = format!(
        "virtual node vk-b: lower cluster: kubeconfig {}, from a Secret, sets users[u].user.tokenFile: ",
        member.display()
    );
    assert!(stderr.contains(&refused), "{stderr}");
    assert!(
        theirs.accept().is_err(),
        "the extender connected to the kubeconfig's server"
    );
}
