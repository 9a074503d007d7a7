//! `--upper-identity`: an offloaded pod mounts tokens the upper API server issued for its
//! upper ServiceAccount, bound to the upper pod, from a lower Secret owned by the lower pod;
//! they pass an upper TokenReview, are renewed before they expire, and are refused once the
//! upper pod is gone. Without the flag nothing of this happens.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{TIMEOUT, review, start_node, wait_running};
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use kube::api::{Api, DeleteParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tensile_harness::{ClusterPair, TestNamespace, wait_for};

/// No Service mirroring: the shared pair's other tests own their Services.
const NO_SERVICES: &str = "--enable-controllers=PVControllers";

fn token(secret: &Secret, key: &str) -> String {
    let data = secret.data.as_ref().expect("the token Secret has data");
    let value = data
        .get(key)
        .unwrap_or_else(|| panic!("no {key} in the token Secret: {:?}", data.keys()));
    String::from_utf8(value.0.clone()).unwrap()
}

/// Creates the ServiceAccount `robot` in `namespace`.
async fn create_robot(upper: &Client, namespace: &str) {
    let mut robot = ServiceAccount::default();
    robot.metadata.name = Some("robot".into());
    Api::<ServiceAccount>::namespaced(upper.clone(), namespace)
        .create(&PostParams::default(), &robot)
        .await
        .unwrap();
}

/// A pod bound to `node` running as `robot`, mounting the token the upper admission adds
/// and one of its own for the audience `vault` (600 s, the shortest the API allows).
fn pod_with_tokens(name: &str, node: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeName": node,
            "serviceAccountName": "robot",
            "tolerations": [{"operator": "Exists"}],
            "containers": [{"name": "app", "image": "busybox", "volumeMounts": [
                {"name": "vault", "mountPath": "/var/run/secrets/vault"},
            ]}],
            "volumes": [{"name": "vault", "projected": {"sources": [
                {"serviceAccountToken": {"audience": "vault", "expirationSeconds": 600, "path": "token"}},
            ]}}],
        },
    }))
    .unwrap()
}

#[tokio::test]
async fn an_offloaded_pod_gets_upper_tokens_bound_to_it_renewed_and_refused_once_it_is_gone() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-identity";
    let address = pair.upper.server.trim_start_matches("https://").to_owned();
    let _vn = start_node(
        pair,
        node,
        &[
            NO_SERVICES,
            "--upper-identity",
            &format!("--upper-api-address={address}"),
            "--upper-token-max-age=3s",
        ],
    )
    .await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "identity").await.unwrap();
    create_robot(&upper, &ns.name).await;
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let created = upper_pods
        .create(&PostParams::default(), &pod_with_tokens("worker", node))
        .await
        .unwrap();
    let upper_uid = created.uid().unwrap();
    let injected = created
        .spec
        .as_ref()
        .unwrap()
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name.starts_with("kube-api-access-"))
        .expect("the upper admission added its token volume")
        .name
        .clone();
    wait_running(&upper_pods, "app=worker", 1).await;

    // The lower pod mounts the Secret, not a token of the lower cluster.
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let below = wait_running(&lower_pods, "app=worker", 1).await.remove(0);
    let spec = below.spec.as_ref().unwrap();
    assert_eq!(spec.automount_service_account_token, Some(false));
    let volumes: BTreeSet<&str> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(volumes, BTreeSet::from([injected.as_str(), "vault"]));
    let env = spec.containers[0].env.clone().unwrap_or_default();
    let (host, port) = address.rsplit_once(':').unwrap();
    for (name, value) in [
        ("KUBERNETES_SERVICE_HOST", host),
        ("KUBERNETES_SERVICE_PORT", port),
    ] {
        assert!(
            env.iter()
                .any(|v| v.name == name && v.value.as_deref() == Some(value)),
            "{name}={value} in {env:?}"
        );
    }

    let secrets: Api<Secret> = Api::namespaced(lower.clone(), &ns.name);
    let secret = wait_for("the lower token Secret", TIMEOUT, || async {
        Ok(secrets.get_opt("worker-upper-token").await?)
    })
    .await
    .unwrap();
    let owner = &secret.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), Some(&owner.uid)),
        ("Pod", below.uid().as_ref()),
        "owned by the lower pod"
    );
    assert_eq!(token(&secret, "namespace"), ns.name);
    assert!(token(&secret, "ca.crt").contains("BEGIN CERTIFICATE"));

    // Both tokens are the upper ServiceAccount's, bound to the upper pod.
    let user = format!("system:serviceaccount:{}:robot", ns.name);
    for (key, audience) in [
        (format!("{injected}.0.token"), None),
        ("vault.0.token".to_owned(), Some("vault")),
    ] {
        let status = review(&upper, &token(&secret, &key), audience).await;
        assert_eq!(status.authenticated, Some(true), "{key}: {status:?}");
        let info = status.user.unwrap();
        assert_eq!(info.username.as_deref(), Some(user.as_str()), "{key}");
        let extra = info.extra.unwrap_or_default();
        assert_eq!(
            extra.get("authentication.kubernetes.io/pod-uid"),
            Some(&vec![upper_uid.clone()]),
            "{key}: bound to the upper pod"
        );
    }

    // Renewed (here every 3 s, --upper-token-max-age): a new token, as valid.
    let first = token(&secret, "vault.0.token");
    let renewed = wait_for("a renewed token", Duration::from_secs(60), || async {
        let now = secrets.get("worker-upper-token").await?;
        Ok((token(&now, "vault.0.token") != first).then_some(now))
    })
    .await
    .unwrap();
    let latest = token(&renewed, "vault.0.token");
    let status = review(&upper, &latest, Some("vault")).await;
    assert_eq!(status.authenticated, Some(true), "renewed: {status:?}");

    // Bound to the upper pod: refused once it is gone; the Secret goes with the lower pod.
    upper_pods
        .delete("worker", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the upper pod gone", TIMEOUT, || async {
        Ok(upper_pods.get_opt("worker").await?.is_none().then_some(()))
    })
    .await
    .unwrap();
    // The API server caches a token's review for a few seconds.
    wait_for("the token refused", Duration::from_secs(60), || async {
        let status = review(&upper, &latest, Some("vault")).await;
        Ok((status.authenticated != Some(true)).then_some(()))
    })
    .await
    .unwrap();
    wait_for("the token Secret deleted", TIMEOUT, || async {
        Ok(secrets
            .get_opt("worker-upper-token")
            .await?
            .is_none()
            .then_some(()))
    })
    .await
    .unwrap();
    ns.delete().await.unwrap();
}

/// Off (the default), the lower pod gets the lower cluster's token as before: no Secret,
/// no token volume of the upper cluster, nothing set on the pod.
#[tokio::test]
async fn without_the_flag_the_lower_cluster_gives_its_own_token() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-no-identity";
    let _vn = start_node(pair, node, &[NO_SERVICES]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "no-identity").await.unwrap();
    create_robot(&upper, &ns.name).await;
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    upper_pods
        .create(&PostParams::default(), &pod_with_tokens("worker", node))
        .await
        .unwrap();
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let below = wait_running(&lower_pods, "app=worker", 1).await.remove(0);
    let spec = below.spec.as_ref().unwrap();
    assert_eq!(spec.automount_service_account_token, None);
    assert!(spec.host_aliases.is_none());
    let vault = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "vault")
        .unwrap();
    let sources = vault.projected.as_ref().unwrap().sources.as_ref().unwrap();
    assert!(
        sources[0].service_account_token.is_some(),
        "the user's token source is the lower kubelet's to fill"
    );
    let secrets: Api<Secret> = Api::namespaced(lower.clone(), &ns.name);
    assert!(
        secrets
            .get_opt("worker-upper-token")
            .await
            .unwrap()
            .is_none()
    );
    ns.delete().await.unwrap();
}

/// The mode is refused at start without an address to reach the upper API server at.
#[test]
fn the_mode_needs_the_upper_api_address() {
    for (extra, message) in [
        (None, "--upper-identity needs --upper-api-address"),
        (Some("--upper-api-address=203.0.113.10"), "is not IP:PORT"),
        // A name: kubernetes.default could not be pointed at it.
        (
            Some("--upper-api-address=api.example.com:443"),
            "is not IP:PORT",
        ),
    ] {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_virtual-node"));
        command.args([
            "--nodename=vk",
            "--client-kubeconfig=/nonexistent",
            "--upper-identity",
        ]);
        command.args(extra);
        let output = command.output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(stderr.contains(message), "{extra:?}: {stderr}");
    }
}
