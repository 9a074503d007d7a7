//! The shipped webhook command lines run unchanged: the real `tensile-webhook` binary with
//! the args of tensile-kube's `manifeasts/webhook.yaml`, and with those of our
//! `deploy/webhook` (read from the manifest), starts against the harness's upper cluster
//! and answers an admission review with a patch. Only the certificate paths and the port
//! are the test's own (a temporary directory, a free port instead of 443/8443).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tensile_harness::{ClusterPair, wait_for};
use tensile_webhook::certs;
use tensile_webhook::loopback::{Client, sample_review};

const TIMEOUT: Duration = Duration::from_secs(120);

/// The args of tensile-kube's `manifeasts/webhook.yaml` (as in `src/cli.rs`'s tests).
const TENSILE_KUBE_WEBHOOK_MANIFEST: &[&str] = &[
    "--tlscert=/root/cert.pem",
    "--tlskey=/root/key.pem",
    "--port=443",
    "--v=6",
];

/// The container args of `deploy/webhook/deployment.yaml`, in order.
fn deploy_webhook_args() -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/webhook/deployment.yaml");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines = text.lines().skip_while(|l| l.trim() != "args:").skip(1);
    let mut args = Vec::new();
    for line in lines.by_ref() {
        let Some(arg) = line.trim().strip_prefix("- ") else {
            break;
        };
        args.push(arg.trim_matches('"').to_owned());
    }
    assert!(args.len() >= 4, "args of {}: {args:?}", path.display());
    args
}

/// `args` with the port, certificate and key the test provides in place of the
/// manifest's; every other arg exactly as given.
fn localized(args: &[String], port: u16, dir: &Path) -> Vec<String> {
    args.iter()
        .map(|arg| match arg.split_once('=') {
            Some(("--port", _)) => format!("--port={port}"),
            Some(("--tlscert", _)) => format!("--tlscert={}", dir.join("tls.crt").display()),
            Some(("--tlskey", _)) => format!("--tlskey={}", dir.join("tls.key").display()),
            _ => arg.clone(),
        })
        .collect()
}

#[test]
fn localized_replaces_only_paths_and_port() {
    let args: Vec<String> = TENSILE_KUBE_WEBHOOK_MANIFEST
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        localized(&args, 9443, Path::new("/t")),
        [
            "--tlscert=/t/tls.crt",
            "--tlskey=/t/tls.key",
            "--port=9443",
            "--v=6"
        ]
    );
    let ours = deploy_webhook_args();
    assert!(
        ours.iter().any(|a| a == "--ignore-selector-keys=clusterID"),
        "{ours:?}"
    );
}

/// Runs `tensile-webhook args` (the upper cluster from `$KUBECONFIG`, as in-cluster
/// config would give it), waits until it is ready and asks it to admit a labelled pod.
async fn admits_with(pair: &ClusterPair, manifest_args: &[String]) {
    let dir = tempfile::tempdir().unwrap();
    let generated = certs::generate("tensile-webhook", &["127.0.0.1".into()], 1).unwrap();
    generated.write(dir.path()).unwrap();
    let port = tensile_harness::ports::free_port().unwrap();
    let args = localized(manifest_args, port, dir.path());
    let log = dir.path().join("tensile-webhook.log");
    let out = std::fs::File::create(&log).unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tensile-webhook"))
        .args(&args)
        .env("KUBECONFIG", pair.upper_kubeconfig())
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let client = Client::new(addr, generated.ca_pem.as_bytes(), "127.0.0.1").unwrap();
    let tail = || tensile_harness::process::tail(&log, 40);
    let child = std::cell::RefCell::new(&mut child);
    let answered = wait_for(
        &format!("tensile-webhook {args:?} ready"),
        TIMEOUT,
        || async {
            if let Some(status) = child.borrow_mut().try_wait()? {
                anyhow::bail!("tensile-webhook exited: {status}");
            }
            let Ok(mut conn) = client.connect().await else {
                return Ok(None);
            };
            let ready = conn.send("GET", "/readyz", Vec::new()).await;
            if !ready.is_ok_and(|r| r.status == 200) {
                return Ok(None);
            }
            let review = serde_json::to_vec(&sample_review("drop-in", true))?;
            let reply = conn
                .send("POST", "/mutate", review)
                .await
                .map_err(|e| anyhow::anyhow!("POST /mutate: {e}"))?;
            Ok(Some(reply))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}\n--- tensile-webhook log:\n{}", tail()));
    assert_eq!(answered.status, 200, "{}", tail());
    let review: Value = serde_json::from_slice(&answered.body).unwrap();
    let response = &review["response"];
    assert_eq!(response["uid"], "drop-in", "{review}");
    assert_eq!(response["allowed"], true, "{review}");
    assert_eq!(response["patchType"], "JSONPatch", "{review}");
}

#[tokio::test]
async fn tensile_kube_manifest_args_serve_admission_reviews() {
    let pair = ClusterPair::shared().await.unwrap();
    let args: Vec<String> = TENSILE_KUBE_WEBHOOK_MANIFEST
        .iter()
        .map(ToString::to_string)
        .collect();
    admits_with(pair, &args).await;
}

#[tokio::test]
async fn deploy_webhook_args_serve_admission_reviews() {
    let pair = ClusterPair::shared().await.unwrap();
    admits_with(pair, &deploy_webhook_args()).await;
}
