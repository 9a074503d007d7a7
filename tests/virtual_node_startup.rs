//! virtual-node refuses to start with one clear line naming the cluster and what is
//! wrong, and a non-zero exit: no panic, no stack trace. What it checks at start is what
//! it needs: run as identities granted exactly the checked permissions, every scenario
//! works without a single refusal.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use k8s_openapi::api::core::v1::{
    ConfigMap, PersistentVolume, PersistentVolumeClaim, Pod, Secret, Service, ServiceAccount,
};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, Resource};
use serde_json::json;
use tensile::clusters::{Features, Permission, needed_permissions};
use tensile::side::Side;
use tensile::translate::meta::OWNER_NODE_LABEL;
use tensile_harness::fixtures::{config_map, merge, pinned_spec, pod, secret};
use tensile_harness::{ClusterPair, KWOK_LOG_LINES, TestNamespace, VirtualNodeOptions, wait_for};

fn virtual_node(upper: &Path, lower: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_virtual-node"))
        .args(["--nodename", "vk-startup", "--metrics-addr", "127.0.0.1:0"])
        .arg("--kubeconfig")
        .arg(upper)
        .arg("--client-kubeconfig")
        .arg(lower)
        .env("KUBELET_PORT", "0")
        .output()
        .unwrap()
}

fn assert_one_clear_line(output: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "must fail; stderr: {stderr}");
    assert_eq!(output.status.code(), Some(1), "stderr: {stderr}");
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("virtual-node:"))
        .collect();
    assert_eq!(lines.len(), 1, "one error line; stderr: {stderr}");
    for needle in needles {
        assert!(lines[0].contains(needle), "{needle:?} in {:?}", lines[0]);
    }
    assert!(!stderr.contains("panicked"), "no panic: {stderr}");
}

fn write_kubeconfig(dir: &Path, name: &str, server: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    let config = serde_json::json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server, "insecure-skip-tls-verify": true}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    });
    std::fs::write(&path, config.to_string()).unwrap();
    path
}

#[test]
fn a_missing_kubeconfig_names_the_cluster_and_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let upper = write_kubeconfig(dir.path(), "upper", "https://127.0.0.1:1");
    let output = virtual_node(&upper, &dir.path().join("no-such-file"));
    assert_one_clear_line(&output, &["lower cluster", "kubeconfig", "no-such-file"]);
}

#[test]
fn an_unreachable_api_server_names_the_cluster_and_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let port = tensile_harness::ports::free_port().unwrap();
    let server = format!("https://127.0.0.1:{port}");
    let upper = write_kubeconfig(dir.path(), "upper", &server);
    let lower = write_kubeconfig(dir.path(), "lower", &server);
    let output = virtual_node(&upper, &lower);
    assert_one_clear_line(&output, &["cluster", "unreachable", &server]);
}

#[tokio::test]
async fn insufficient_rbac_names_the_cluster_and_what_is_missing() {
    let pair = ClusterPair::shared().await.unwrap();
    let nobody = pair.upper.kubeconfig_for("nobody", &[]).unwrap();
    let output = virtual_node(&nobody, pair.lower_kubeconfig());
    assert_one_clear_line(
        &output,
        &["upper cluster", "not allowed to", "create nodes", "RBAC"],
    );
}

/// Runs `kubectl apply` of a manifest file of this repository against `kubeconfig`.
fn kubectl_apply(pair: &ClusterPair, kubeconfig: &Path, namespace: Option<&str>, file: &str) {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    let mut command = Command::new(pair.bin("kubectl"));
    command
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["apply", "-f"])
        .arg(manifest);
    if let Some(ns) = namespace {
        command.args(["-n", ns]);
    }
    let output = command.output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[tokio::test]
async fn the_shipped_rbac_is_enough_to_run() {
    use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Secret};
    use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
    use kube::api::{Api, PostParams};
    use serde_json::json;
    use tensile_harness::fixtures::{config_map, merge, pinned_spec, pod, secret};
    use tensile_harness::{TestNamespace, VirtualNodeOptions, wait_for};

    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let pp = PostParams::default();
    let ns: Namespace =
        serde_json::from_value(json!({"metadata": {"name": "tensile-system"}})).unwrap();
    Api::<Namespace>::all(upper.clone())
        .create(&pp, &ns)
        .await
        .unwrap();
    kubectl_apply(
        pair,
        pair.upper_kubeconfig(),
        Some("tensile-system"),
        "deploy/virtual-node/rbac.yaml",
    );
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "tensile-virtual-node-test-user"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "tensile-virtual-node"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "vk-rbac"}],
    }))
    .unwrap();
    Api::<ClusterRoleBinding>::all(upper.clone())
        .create(&pp, &binding)
        .await
        .unwrap();
    kubectl_apply(
        pair,
        pair.lower_kubeconfig(),
        None,
        "deploy/virtual-node-lower/rbac.yaml",
    );

    let node = "vk-rbac";
    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), node);
    options.upper_kubeconfig = Some(pair.upper.kubeconfig_for("vk-rbac", &[]).unwrap());
    options.lower_kubeconfig = Some(
        pair.lower
            .kubeconfig_for("tensile-virtual-node", &[])
            .unwrap(),
    );
    // Every node running ServiceControllers mirrors every upper Service, the first copy
    // standing: only the least-privilege test's node runs them, so that this one never
    // owns (and leaves behind, once stopped) the copies that test waits for.
    options.args = vec!["--enable-controllers=PVControllers".into()];
    let mut vn = common::start_node_with(pair, &options, &upper).await;

    let test_ns = TestNamespace::create(&upper, "rbac").await.unwrap();
    Api::<ConfigMap>::namespaced(upper.clone(), &test_ns.name)
        .create(&pp, &config_map("c", json!({"k": "v"})))
        .await
        .unwrap();
    Api::<Secret>::namespaced(upper.clone(), &test_ns.name)
        .create(&pp, &secret("s", json!({"k": "v"})))
        .await
        .unwrap();
    let mut spec = pinned_spec(node);
    merge(
        &mut spec,
        json!({"nodeName": node, "volumes": [
            {"name": "c", "configMap": {"name": "c"}}, {"name": "s", "secret": {"secretName": "s"}}]}),
    );
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &test_ns.name);
    upper_pods.create(&pp, &pod("app", spec)).await.unwrap();
    wait_for(
        "the pod Running through the least-privileged identities",
        Duration::from_secs(60),
        || async {
            let phase = upper_pods.get("app").await?.status.and_then(|s| s.phase);
            Ok((phase.as_deref() == Some("Running")).then_some(()))
        },
    )
    .await
    .unwrap();
    vn.stop().unwrap();
    test_ns.delete().await.unwrap();
}

/// Bad flags are refused before anything starts: exit status 2 and one line naming the
/// flag (`--full-resync-period=0` used to reach `interval_at` and panic).
#[test]
fn nonsensical_flags_exit_2_with_one_line_naming_the_flag() {
    let virtual_node = env!("CARGO_BIN_EXE_virtual-node");
    let descheduler = env!("CARGO_BIN_EXE_tensile-descheduler");
    let lower = ["--client-kubeconfig", "/nonexistent"];
    let cases: [(&str, &[&str], &str); 6] = [
        (virtual_node, &lower, "--full-resync-period=0"),
        (virtual_node, &lower, "--pod-sync-workers=0"),
        // A positive rate too small for a limiter (it panicked); -1, client-go's "no
        // limit", is accepted since tensile-kube's command lines may say it.
        (virtual_node, &lower, "--client-qps=1e-30"),
        (virtual_node, &lower, "--nodename=Not_A_Name"),
        (descheduler, &[], "--leader-elect-retry-period=0"),
        (descheduler, &[], "--descheduling-interval=1ns"),
    ];
    for (binary, args, flag) in cases {
        let output = Command::new(binary).args(args).arg(flag).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{flag}: {stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(lines.len(), 1, "{flag}: one line: {stderr}");
        let name = flag.split('=').next().unwrap();
        assert!(lines[0].contains(name), "{flag}: {stderr}");
        assert!(!stderr.contains("panicked"), "{flag}: {stderr}");
    }
}

/// RBAC rules granting exactly `permissions`: cluster-wide ones, and per namespace.
fn rules(permissions: &[Permission]) -> BTreeMap<Option<&'static str>, Vec<PolicyRule>> {
    let mut verbs: BTreeMap<(Option<&str>, &str, String), BTreeSet<&str>> = BTreeMap::new();
    for p in permissions {
        let resource = match p.subresource {
            "" => p.resource.to_owned(),
            sub => format!("{}/{sub}", p.resource),
        };
        verbs
            .entry((p.namespace, p.group, resource))
            .or_default()
            .insert(p.verb);
    }
    let mut rules: BTreeMap<Option<&'static str>, Vec<PolicyRule>> = BTreeMap::new();
    for ((namespace, group, resource), verbs) in verbs {
        rules.entry(namespace).or_default().push(PolicyRule {
            api_groups: Some(vec![group.to_owned()]),
            resources: Some(vec![resource]),
            verbs: verbs.into_iter().map(str::to_owned).collect(),
            ..PolicyRule::default()
        });
    }
    rules
}

/// Grants `user` exactly `permissions` (a ClusterRole, and a Role per namespace, named
/// after the user) and returns what to delete afterwards.
async fn grant(client: &Client, user: &str, permissions: &[Permission]) -> Vec<(String, String)> {
    let pp = PostParams::default();
    let subject = json!([{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]);
    let mut made = Vec::new();
    for (namespace, rules) in rules(permissions) {
        let role_ref = |kind: &str| json!({"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": user});
        match namespace {
            None => {
                let role: ClusterRole =
                    serde_json::from_value(json!({"metadata": {"name": user}, "rules": rules}))
                        .unwrap();
                Api::<ClusterRole>::all(client.clone())
                    .create(&pp, &role)
                    .await
                    .unwrap();
                let binding: ClusterRoleBinding = serde_json::from_value(json!({
                    "metadata": {"name": user}, "roleRef": role_ref("ClusterRole"), "subjects": subject,
                }))
                .unwrap();
                Api::<ClusterRoleBinding>::all(client.clone())
                    .create(&pp, &binding)
                    .await
                    .unwrap();
                made.push((String::new(), user.to_owned()));
            }
            Some(ns) => {
                let role: Role =
                    serde_json::from_value(json!({"metadata": {"name": user}, "rules": rules}))
                        .unwrap();
                Api::<Role>::namespaced(client.clone(), ns)
                    .create(&pp, &role)
                    .await
                    .unwrap();
                let binding: RoleBinding = serde_json::from_value(json!({
                    "metadata": {"name": user}, "roleRef": role_ref("Role"), "subjects": subject,
                }))
                .unwrap();
                Api::<RoleBinding>::namespaced(client.clone(), ns)
                    .create(&pp, &binding)
                    .await
                    .unwrap();
                made.push((ns.to_owned(), user.to_owned()));
            }
        }
    }
    made
}

/// Deletes what [`grant`] made.
async fn revoke(client: &Client, made: Vec<(String, String)>) {
    let dp = DeleteParams::default();
    for (namespace, name) in made {
        if namespace.is_empty() {
            let _ = Api::<ClusterRoleBinding>::all(client.clone())
                .delete(&name, &dp)
                .await;
            let _ = Api::<ClusterRole>::all(client.clone())
                .delete(&name, &dp)
                .await;
        } else {
            let _ = Api::<RoleBinding>::namespaced(client.clone(), &namespace)
                .delete(&name, &dp)
                .await;
            let _ = Api::<Role>::namespaced(client.clone(), &namespace)
                .delete(&name, &dp)
                .await;
        }
    }
}

/// What virtual-node runs with by default (both optional controllers, the node lease, the
/// kubelet API authorizing its callers).
const DEFAULT_FEATURES: Features = Features {
    services: true,
    volumes: true,
    node_lease: true,
    access_reviews: true,
    token_reviews: false,
    leader_election: None,
    members: None,
    upper_identity: false,
    namespaces: false,
    kueue_quota: false,
};

/// Lines of a virtual-node log that tell of a refusal by RBAC.
fn refusals(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| {
            let lower = l.to_ascii_lowercase();
            lower.contains("forbidden") || lower.contains("code: 403")
        })
        .collect()
}

/// Objects of `api` labelled as `node`'s.
async fn owned_by<K>(api: &Api<K>, node: &str) -> Vec<K>
where
    K: Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.list(&ListParams::default().labels(&format!("{OWNER_NODE_LABEL}={node}")))
        .await
        .unwrap()
        .items
}

/// Runs `kubectl` against the upper cluster (admin) and returns its stdout, failing on
/// a non-zero exit.
fn kubectl(pair: &ClusterPair, args: &[&str]) -> String {
    let output = Command::new(pair.bin("kubectl"))
        .arg("--kubeconfig")
        .arg(pair.upper_kubeconfig())
        .args(args)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// virtual-node run as users granted exactly the permissions it checks at start (RBAC
/// generated from `clusters::needed_permissions`, so the two cannot drift): a pod with a
/// ConfigMap, a Secret, a ServiceAccount, a PVC and a Service runs below with its status
/// reflected, `kubectl logs` and `exec` reach it through the node, and everything is
/// cleaned up after it; the log shows no refusal; SIGTERM ends it with status 0.
#[tokio::test]
async fn exactly_the_checked_permissions_run_every_scenario() {
    let pair = ClusterPair::shared().await.unwrap();
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let node = "vk-least";
    let upper_user = "tensile-least-upper";
    let lower_user = "tensile-least-lower";
    let upper_grants = grant(
        &upper,
        upper_user,
        &needed_permissions(Side::Upper, DEFAULT_FEATURES),
    )
    .await;
    let lower_grants = grant(
        &lower,
        lower_user,
        &needed_permissions(Side::Lower, DEFAULT_FEATURES),
    )
    .await;

    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), node);
    options.upper_kubeconfig = Some(pair.upper.kubeconfig_for(upper_user, &[]).unwrap());
    options.lower_kubeconfig = Some(pair.lower.kubeconfig_for(lower_user, &[]).unwrap());
    // Debug, so that refusals only logged at debug (events) show too.
    options.args = vec!["--log-level=tensile=debug,virtual_node=debug,info".into()];
    let mut vn = common::start_node_with(pair, &options, &upper).await;

    let ns = TestNamespace::create(&upper, "least").await.unwrap();
    let pp = PostParams::default();
    let upper_claims: Api<PersistentVolumeClaim> = Api::namespaced(upper.clone(), &ns.name);
    let upper_services: Api<Service> = Api::namespaced(upper.clone(), &ns.name);
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    Api::<ConfigMap>::namespaced(upper.clone(), &ns.name)
        .create(&pp, &config_map("settings", json!({"k": "v"})))
        .await
        .unwrap();
    Api::<Secret>::namespaced(upper.clone(), &ns.name)
        .create(&pp, &secret("password", json!({"k": "v"})))
        .await
        .unwrap();
    let account: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": "app"}})).unwrap();
    Api::<ServiceAccount>::namespaced(upper.clone(), &ns.name)
        .create(&pp, &account)
        .await
        .unwrap();
    let claim: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "data"},
        "spec": {"storageClassName": "", "accessModes": ["ReadWriteOnce"],
                 "resources": {"requests": {"storage": "10Mi"}}},
    }))
    .unwrap();
    upper_claims.create(&pp, &claim).await.unwrap();
    // The volume the claim's copy binds below, prepared there for it.
    let volume_name = format!("least-{}", ns.name);
    let volume: PersistentVolume = serde_json::from_value(json!({
        "metadata": {"name": volume_name},
        "spec": {
            "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
            "hostPath": {"path": "/tmp/least"},
            "claimRef": {"namespace": ns.name, "name": "data"},
        },
    }))
    .unwrap();
    let lower_volumes: Api<PersistentVolume> = Api::all(lower.clone());
    lower_volumes.create(&pp, &volume).await.unwrap();
    let service: Service = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "app"}, "ports": [{"port": 80}]},
    }))
    .unwrap();
    upper_services.create(&pp, &service).await.unwrap();
    let mut spec = pinned_spec(node);
    merge(
        &mut spec,
        json!({"nodeName": node, "serviceAccountName": "app", "volumes": [
            {"name": "settings", "configMap": {"name": "settings"}},
            {"name": "password", "secret": {"secretName": "password"}},
            {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
        ]}),
    );
    upper_pods.create(&pp, &pod("app", spec)).await.unwrap();

    let running = wait_for("the pod Running upstairs", common::TIMEOUT, || async {
        let pod = upper_pods.get("app").await?;
        Ok(common::running(&pod).then_some(pod))
    })
    .await;
    if let Err(error) = running {
        panic!(
            "{error:#}\n{}",
            tensile_harness::process::tail(vn.log(), 40)
        );
    }
    let upper_pods_uid = upper_pods.get("app").await.unwrap().metadata.uid;
    let lower_pod = lower_pods.get("app").await.unwrap();
    assert!(common::running(&lower_pod), "running below too");
    for (kind, found) in [
        (
            "ConfigMap",
            !owned_by(&Api::<ConfigMap>::namespaced(lower.clone(), &ns.name), node)
                .await
                .is_empty(),
        ),
        (
            "Secret",
            !owned_by(&Api::<Secret>::namespaced(lower.clone(), &ns.name), node)
                .await
                .is_empty(),
        ),
        (
            "ServiceAccount",
            !owned_by(
                &Api::<ServiceAccount>::namespaced(lower.clone(), &ns.name),
                node,
            )
            .await
            .is_empty(),
        ),
        (
            "PersistentVolumeClaim",
            !owned_by(
                &Api::<PersistentVolumeClaim>::namespaced(lower.clone(), &ns.name),
                node,
            )
            .await
            .is_empty(),
        ),
    ] {
        assert!(found, "the {kind} copied below");
    }
    // PVControllers: the lower binding reflected up.
    wait_for("the upper claim Bound", common::TIMEOUT, || async {
        let claim = upper_claims.get("data").await?;
        let phase = claim.status.and_then(|s| s.phase);
        Ok((phase.as_deref() == Some("Bound")).then_some(()))
    })
    .await
    .unwrap();
    // ServiceControllers: the Service and its endpoints mirrored.
    let lower_services: Api<Service> = Api::namespaced(lower.clone(), &ns.name);
    let lower_slices: Api<EndpointSlice> = Api::namespaced(lower.clone(), &ns.name);
    wait_for(
        "the Service and its endpoints below",
        common::TIMEOUT,
        || async {
            let service = owned_by(&lower_services, node).await.len();
            let slices = owned_by(&lower_slices, node).await.len();
            Ok((service == 1 && slices >= 1).then_some(()))
        },
    )
    .await
    .unwrap();

    // The events reflector: a Warning about the lower pod reaches the upper one.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let warning: k8s_openapi::api::core::v1::Event = serde_json::from_value(json!({
        "metadata": {"name": "app.least"},
        "involvedObject": {"kind": "Pod", "apiVersion": "v1", "namespace": ns.name,
                           "name": "app", "uid": lower_pod.metadata.uid},
        "type": "Warning", "reason": "LeastPrivilege", "message": "seen below",
        "firstTimestamp": tensile_harness::rfc3339(now),
        "lastTimestamp": tensile_harness::rfc3339(now),
        "count": 1, "source": {"component": "test"},
    }))
    .unwrap();
    Api::<k8s_openapi::api::core::v1::Event>::namespaced(lower.clone(), &ns.name)
        .create(&pp, &warning)
        .await
        .unwrap();
    let upper_events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(upper.clone(), &ns.name);
    wait_for(
        "the lower Warning reflected up",
        common::TIMEOUT,
        || async {
            let events = upper_events.list(&ListParams::default()).await?.items;
            let reflected = events.iter().any(|e| {
                e.reason.as_deref() == Some("LeastPrivilege")
                    && e.regarding.as_ref().and_then(|r| r.uid.as_deref())
                        == upper_pods_uid.as_deref()
            });
            Ok(reflected.then_some(()))
        },
    )
    .await
    .unwrap();

    // The kubelet API, through the upper API server.
    let logs = kubectl(pair, &["logs", "-n", &ns.name, "app", "-c", "app"]);
    assert_eq!(logs, KWOK_LOG_LINES.join("\n") + "\n");
    let hi = kubectl(pair, &["exec", "-n", &ns.name, "app", "--", "echo", "hi"]);
    assert_eq!(hi, "hi\n");

    // Clean-up: the pod, then what it used.
    upper_pods
        .delete("app", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("the pod gone in both clusters", common::TIMEOUT, || async {
        let gone = upper_pods.get_opt("app").await?.is_none()
            && lower_pods.get_opt("app").await?.is_none();
        Ok(gone.then_some(()))
    })
    .await
    .unwrap();
    let lower_config_maps = Api::<ConfigMap>::namespaced(lower.clone(), &ns.name);
    let lower_secrets = Api::<Secret>::namespaced(lower.clone(), &ns.name);
    wait_for(
        "the unreferenced copies removed",
        common::TIMEOUT,
        || async {
            let left = owned_by(&lower_config_maps, node).await.len()
                + owned_by(&lower_secrets, node).await.len();
            Ok((left == 0).then_some(()))
        },
    )
    .await
    .unwrap();
    upper_services
        .delete("web", &DeleteParams::default())
        .await
        .unwrap();
    upper_claims
        .delete("data", &DeleteParams::default())
        .await
        .unwrap();
    let lower_claims = Api::<PersistentVolumeClaim>::namespaced(lower.clone(), &ns.name);
    wait_for(
        "the Service and claim copies removed",
        common::TIMEOUT,
        || async {
            let left = owned_by(&lower_services, node).await.len()
                + owned_by(&lower_slices, node).await.len()
                + owned_by(&lower_claims, node).await.len();
            Ok((left == 0).then_some(()))
        },
    )
    .await
    .unwrap();
    lower_volumes
        .delete(&volume_name, &DeleteParams::default())
        .await
        .unwrap();
    let upper_volumes: Api<PersistentVolume> = Api::all(upper.clone());
    wait_for("the reflected volume removed", common::TIMEOUT, || async {
        Ok(upper_volumes
            .get_opt(&volume_name)
            .await?
            .is_none()
            .then_some(()))
    })
    .await
    .unwrap();

    // Graceful stop: SIGTERM, everything drains, status 0.
    vn.signal(nix::sys::signal::Signal::SIGTERM).unwrap();
    let exited = wait_for("virtual-node to exit on SIGTERM", common::TIMEOUT, || {
        let exited = vn.check_running().err().map(|e| e.to_string());
        async move { Ok(exited) }
    })
    .await
    .unwrap();
    assert!(exited.contains("exit status: 0"), "{exited}");

    let log = std::fs::read_to_string(vn.log()).unwrap();
    let refused = refusals(&log);
    assert!(
        refused.is_empty(),
        "refused by RBAC:\n{}",
        refused.join("\n")
    );
    ns.delete().await.unwrap();
    revoke(&upper, upper_grants).await;
    revoke(&lower, lower_grants).await;
}

/// One permission short of the table, virtual-node does not start: one line names the
/// cluster and the permission.
#[tokio::test]
async fn a_single_missing_permission_is_named_at_start() {
    let pair = ClusterPair::shared().await.unwrap();
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let (upper_user, lower_user) = ("tensile-short-upper", "tensile-short-lower");
    let mut upper_needs = needed_permissions(Side::Upper, DEFAULT_FEATURES);
    upper_needs.retain(|p| p.to_string() != "patch pods/status");
    let upper_grants = grant(&upper, upper_user, &upper_needs).await;
    let lower_grants = grant(
        &lower,
        lower_user,
        &needed_permissions(Side::Lower, DEFAULT_FEATURES),
    )
    .await;
    let output = virtual_node(
        &pair.upper.kubeconfig_for(upper_user, &[]).unwrap(),
        &pair.lower.kubeconfig_for(lower_user, &[]).unwrap(),
    );
    assert_one_clear_line(
        &output,
        &[
            "upper cluster",
            "not allowed to patch pods/status (check the RBAC",
        ],
    );
    revoke(&upper, upper_grants).await;
    revoke(&lower, lower_grants).await;
}

/// Kubeconfigs that are broken in each common way: one clear line naming the cluster and
/// what is wrong, exit 1, no panic.
#[test]
fn broken_kubeconfigs_name_the_cluster_and_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let good = write_kubeconfig(dir.path(), "good", "https://127.0.0.1:1");
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let garbage = write("garbage", "{this is: [not a kubeconfig");
    let empty = write("empty", "");
    let no_context = write(
        "no-context",
        r#"{"apiVersion": "v1", "kind": "Config", "clusters": [], "users": [], "contexts": []}"#,
    );
    let missing_cert = write(
        "missing-cert",
        &json!({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
            "users": [{"name": "u", "user": {"client-certificate": "/nonexistent/u.crt",
                                              "client-key": "/nonexistent/u.key"}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "c",
        })
        .to_string(),
    );
    let cases: [(&str, &Path, &Path, &[&str]); 5] = [
        (
            "garbage upper",
            &garbage,
            &good,
            &["upper cluster", "garbage"],
        ),
        (
            "garbage lower",
            &good,
            &garbage,
            &["lower cluster", "garbage"],
        ),
        ("empty", &good, &empty, &["lower cluster", "empty"]),
        (
            "no context",
            &no_context,
            &good,
            &["upper cluster", "no-context"],
        ),
        (
            "missing cert",
            &missing_cert,
            &good,
            &["upper cluster", "u.crt"],
        ),
    ];
    for (case, upper, lower, needles) in cases {
        let output = virtual_node(upper, lower);
        eprintln!("{case}: {}", String::from_utf8_lossy(&output.stderr).trim());
        assert_one_clear_line(&output, needles);
    }
}

/// A client certificate that has expired: one line naming the cluster and saying the
/// credentials were rejected (it used to say the API server was unreachable).
#[tokio::test]
async fn an_expired_client_certificate_names_the_cluster() {
    let pair = ClusterPair::shared().await.unwrap();
    let expired = pair.upper.kubeconfig_expired_for("vk-expired").unwrap();
    let lower = pair.lower.kubeconfig_for("vk-expired", &[]).unwrap();
    let output = tokio::task::spawn_blocking(move || virtual_node(&expired, &lower))
        .await
        .unwrap();
    eprintln!("{}", String::from_utf8_lossy(&output.stderr).trim());
    assert_one_clear_line(
        &output,
        &["upper cluster", "rejected the credentials", "expired"],
    );
}
