//! The manifests in `deploy/` are valid for the pinned Kubernetes release (server-side dry
//! run of every kustomization against the harness's API servers), every container they
//! run is bounded, probed and locked down, and every ServiceAccount is allowed what its
//! binary does (SubjectAccessReviews against the RBAC of `deploy/all`, applied for real).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::path::Path;
use std::process::Command;

use serde_json::{Value, json};
use tensile::side::Side;
use tensile_harness::fixtures::merge;
use tensile_harness::rbac::rbac_list;
use tensile_harness::{Binaries, ClusterPair};

use common::access::{
    access, all_features, denied, descheduler_accesses, extender_lower_accesses, install_test_crds,
    service_account_groups, virtual_node_accesses, webhook_accesses,
};

/// The namespace every upper-cluster base installs into.
const NAMESPACE: &str = "tensile-system";

/// Held by a test while it applies to [`NAMESPACE`] of the shared pair: a dry-run create
/// answers AlreadyExists for an object another test created between kubectl's read and
/// its create.
static NAMESPACE_IN_USE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The root of the repository.
fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every directory under `deploy/` with a kustomization, relative to the repository, so a
/// base added later is checked without editing this test.
fn kustomizations() -> Vec<String> {
    fn walk(dir: &Path, found: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, found);
            } else if path.file_name().is_some_and(|n| n == "kustomization.yaml") {
                let dir = path.parent().unwrap().strip_prefix(repo()).unwrap();
                found.push(dir.to_string_lossy().into_owned());
            }
        }
    }
    let mut found = Vec::new();
    walk(&repo().join("deploy"), &mut found);
    found.sort();
    found
}

/// Whether a kustomization is meant for the lower cluster.
fn for_lower_cluster(dir: &str) -> bool {
    dir.ends_with("/lower") || dir.ends_with("-lower")
}

/// Runs `kubectl args` and returns its stdout, failing with its stderr.
fn kubectl(kubectl: &Path, args: &[&str]) -> String {
    let output = Command::new(kubectl)
        .current_dir(repo())
        .args(args)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "kubectl {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The objects `kubectl kustomize dir` renders.
fn render(kubectl_bin: &Path, dir: &str) -> Vec<Value> {
    tensile_harness::rbac::render(kubectl_bin, repo(), dir).unwrap_or_else(|e| panic!("{e:#}"))
}

/// What is wrong with one container of a pod template, by the rules every tensile
/// container follows; empty when nothing is. The pod's own securityContext counts for
/// the fields a container inherits.
fn container_faults(pod_spec: &Value, container: &Value) -> Vec<String> {
    let mut faults = Vec::new();
    let pod_security = &pod_spec["securityContext"];
    let security = &container["securityContext"];
    let inherited = |field: &str| {
        if security[field].is_null() {
            pod_security[field].clone()
        } else {
            security[field].clone()
        }
    };
    let wanted: [(&str, Value); 4] = [
        ("runAsNonRoot", json!(true)),
        ("readOnlyRootFilesystem", json!(true)),
        ("allowPrivilegeEscalation", json!(false)),
        ("seccompProfile", json!({"type": "RuntimeDefault"})),
    ];
    for (field, value) in wanted {
        // readOnlyRootFilesystem and allowPrivilegeEscalation exist only per container.
        let actual = match field {
            "runAsNonRoot" | "seccompProfile" => inherited(field),
            _ => security[field].clone(),
        };
        if actual != value {
            faults.push(format!("securityContext.{field} is {actual}, not {value}"));
        }
    }
    if security["capabilities"]["drop"] != json!(["ALL"]) {
        faults.push("securityContext.capabilities.drop is not [ALL]".to_owned());
    }
    if !security["capabilities"]["add"].is_null() {
        faults.push("securityContext.capabilities.add is set".to_owned());
    }
    for (path, field) in [
        ("requests", "cpu"),
        ("requests", "memory"),
        ("limits", "memory"),
    ] {
        if container["resources"][path][field].is_null() {
            faults.push(format!("no resources.{path}.{field}"));
        }
    }
    for probe in ["livenessProbe", "readinessProbe"] {
        if container[probe]["httpGet"]["path"].as_str().is_none() {
            faults.push(format!("no {probe} over HTTP(S)"));
        }
    }
    faults
}

/// Every container of every pod template in `objects`, with its faults, as lines
/// `kind/name container: fault`.
fn workload_faults(objects: &[Value]) -> Vec<String> {
    let mut faults = Vec::new();
    for object in objects {
        let pod_spec = match object["kind"].as_str() {
            Some("Deployment" | "StatefulSet" | "DaemonSet" | "Job") => {
                &object["spec"]["template"]["spec"]
            }
            Some("Pod") => &object["spec"],
            _ => continue,
        };
        let owner = format!(
            "{}/{}",
            object["kind"].as_str().unwrap_or_default(),
            object["metadata"]["name"].as_str().unwrap_or_default()
        );
        let containers = ["initContainers", "containers"]
            .iter()
            .filter_map(|k| pod_spec[k].as_array())
            .flatten();
        for container in containers {
            let name = container["name"].as_str().unwrap_or_default();
            for fault in container_faults(pod_spec, container) {
                faults.push(format!("{owner} {name}: {fault}"));
            }
        }
    }
    faults
}

#[test]
fn container_rules_table() {
    let good = json!({
        "name": "c",
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": 1}},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": 1}},
        "securityContext": {
            "runAsNonRoot": true, "readOnlyRootFilesystem": true,
            "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    });
    let with = |patch: Value| {
        let mut c = good.clone();
        merge(&mut c, patch);
        c
    };
    let pod_seccomp = json!({"securityContext": {"seccompProfile": {"type": "RuntimeDefault"}, "runAsNonRoot": true}});
    let cases: [(&str, Value, Value, &[&str]); 8] = [
        ("all set", json!({}), good.clone(), &[]),
        (
            "inherited from the pod",
            pod_seccomp.clone(),
            with(json!({"securityContext": {"seccompProfile": null, "runAsNonRoot": null}})),
            &[],
        ),
        (
            "no seccomp",
            json!({}),
            with(json!({"securityContext": {"seccompProfile": null}})),
            &["securityContext.seccompProfile"],
        ),
        (
            "capabilities kept",
            json!({}),
            with(json!({"securityContext": {"capabilities": null}})),
            &["capabilities.drop"],
        ),
        (
            "writable root",
            pod_seccomp,
            with(json!({"securityContext": {"readOnlyRootFilesystem": false}})),
            &["readOnlyRootFilesystem"],
        ),
        (
            "no cpu request",
            json!({}),
            with(json!({"resources": {"requests": {"cpu": null}}})),
            &["resources.requests.cpu"],
        ),
        (
            "no memory limit",
            json!({}),
            with(json!({"resources": {"limits": null}})),
            &["resources.limits.memory"],
        ),
        (
            "no probes",
            json!({}),
            with(json!({"livenessProbe": null, "readinessProbe": null})),
            &["livenessProbe", "readinessProbe"],
        ),
    ];
    for (case, pod, container, wanted) in cases {
        let faults = container_faults(&pod, &container);
        assert_eq!(faults.len(), wanted.len(), "{case}: {faults:?}");
        for (fault, needle) in faults.iter().zip(wanted) {
            assert!(fault.contains(needle), "{case}: {fault:?} lacks {needle:?}");
        }
    }
}

/// Every container that any kustomization in `deploy/` runs has CPU and memory requests,
/// a memory limit, liveness and readiness probes, and a non-root, read-only, unprivileged
/// security context with every capability dropped and the runtime's seccomp profile.
#[test]
fn every_container_is_bounded_probed_and_locked_down() {
    let binaries = Binaries::locate().unwrap();
    let kubectl_bin = binaries.bin("kubectl");
    let mut faults = Vec::new();
    for dir in kustomizations() {
        for fault in workload_faults(&render(&kubectl_bin, &dir)) {
            faults.push(format!("{dir}: {fault}"));
        }
    }
    assert!(faults.is_empty(), "{}", faults.join("\n"));
}

/// `deploy/all` installs the four upper-cluster components, each from an image of the one
/// release tag, and mounts the lower kubeconfig from the one Secret.
#[test]
fn the_all_in_one_overlay_installs_everything_at_one_tag() {
    let binaries = Binaries::locate().unwrap();
    let objects = render(&binaries.bin("kubectl"), "deploy/all");
    let tag = serde_saphyr::from_str::<Value>(
        &std::fs::read_to_string(repo().join("deploy/all/release.yaml")).unwrap(),
    )
    .unwrap()["data"]["tag"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut images: Vec<String> = objects
        .iter()
        .filter(|o| o["kind"] == "Deployment")
        .flat_map(|d| {
            d["spec"]["template"]["spec"]["containers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["image"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        })
        .collect();
    images.sort();
    let wanted: Vec<String> = [
        "tensile-descheduler",
        "tensile-scheduler-extender",
        "tensile-webhook",
        "virtual-node",
    ]
    .iter()
    .map(|b| format!("tensile/{b}:{tag}"))
    .collect();
    assert_eq!(images, wanted);
    assert!(
        objects
            .iter()
            .all(|o| o["metadata"]["name"] != "tensile-release"),
        "the release ConfigMap is local to kustomize"
    );
    for o in &objects {
        let scoped = !matches!(
            o["kind"].as_str(),
            Some(
                "Namespace" | "ClusterRole" | "ClusterRoleBinding" | "MutatingWebhookConfiguration"
            )
        );
        if scoped {
            assert_eq!(o["metadata"]["namespace"], NAMESPACE, "{o}");
        }
    }
    let lower_secrets: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"] == "Deployment")
        .flat_map(|d| {
            d["spec"]["template"]["spec"]["volumes"]
                .as_array()
                .into_iter()
                .flatten()
        })
        .filter(|v| v["name"] == "lower-kubeconfig" || v["name"] == "lower")
        .map(|v| &v["secret"]["secretName"])
        .collect();
    assert_eq!(lower_secrets.len(), 2, "virtual-node and the extender");
    assert!(lower_secrets.iter().all(|s| *s == "lower-kubeconfig"));
}

/// Every kustomization under `deploy/` passes `kubectl apply --dry-run=server -k` on the
/// cluster it is meant for: each object is valid for the pinned release (Kueue's, for
/// `deploy/examples/kueue`), with strict field validation (an unknown or misspelt field
/// fails).
#[tokio::test]
async fn every_kustomization_passes_a_server_side_dry_run() {
    let _applying = NAMESPACE_IN_USE.lock().await;
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    tensile_harness::pair::ensure_namespace(&upper, NAMESPACE)
        .await
        .unwrap();
    install_test_crds(pair, &upper).await;
    // deploy/examples/kueue needs the pinned Kueue's CRDs (no manager: a dry run only).
    tensile_harness::kueue::install_crds_only(&upper)
        .await
        .unwrap();
    let dirs = kustomizations();
    for wanted in [
        "deploy/all",
        "deploy/examples/kueue",
        "deploy/monitoring",
        "deploy/virtual-node-lower",
    ] {
        assert!(dirs.iter().any(|d| d == wanted), "{wanted} in {dirs:?}");
    }
    for dir in dirs {
        let kubeconfig = if for_lower_cluster(&dir) {
            pair.lower_kubeconfig()
        } else {
            pair.upper_kubeconfig()
        };
        let out = kubectl(
            &pair.bin("kubectl"),
            &[
                "--kubeconfig",
                kubeconfig.to_str().unwrap(),
                "apply",
                "--dry-run=server",
                "--validate=strict",
                "-k",
                &dir,
            ],
        );
        assert!(out.contains("(server dry run)"), "{dir}: {out}");
    }
}

/// The RBAC of `deploy/all`, applied for real to the upper cluster, and that of
/// `deploy/virtual-node-lower` and `deploy/scheduler-extender/lower` to the lower one,
/// allow each ServiceAccount and lower identity everything its binary calls: virtual-node
/// what it checks at start (`clusters::needed_permissions`, every feature on), the
/// webhook its PVC watch, the descheduler its pod moves and Lease; the extender nothing
/// upper and its node and pod watches lower, whether through its own identity or (as
/// `deploy/all` does) virtual-node's.
#[tokio::test]
async fn each_identity_may_do_what_its_binary_does() {
    let _applying = NAMESPACE_IN_USE.lock().await;
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let kubectl_bin = pair.bin("kubectl");
    tensile_harness::pair::ensure_namespace(&upper, NAMESPACE)
        .await
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let upper_rbac = dir.path().join("upper-rbac.json");
    let objects = render(&kubectl_bin, "deploy/all");
    std::fs::write(&upper_rbac, rbac_list(&objects).to_string()).unwrap();
    let upper_config = pair.upper_kubeconfig().to_str().unwrap();
    let lower_config = pair.lower_kubeconfig().to_str().unwrap();
    let upper_file = upper_rbac.to_str().unwrap();
    kubectl(
        &kubectl_bin,
        &["--kubeconfig", upper_config, "apply", "-f", upper_file],
    );
    let lower_dirs = [
        "deploy/virtual-node-lower",
        "deploy/scheduler-extender/lower",
    ];
    for d in lower_dirs {
        kubectl(
            &kubectl_bin,
            &["--kubeconfig", lower_config, "apply", "-k", d],
        );
    }

    let groups = service_account_groups(NAMESPACE);
    let groups: Vec<&str> = groups.iter().map(String::as_str).collect();
    let sa = |name: &str| format!("system:serviceaccount:{NAMESPACE}:{name}");
    let mut missing = Vec::new();
    let upper_checks = [
        (
            "virtual-node",
            virtual_node_accesses(Side::Upper, all_features(NAMESPACE)),
        ),
        ("tensile-webhook", webhook_accesses()),
        ("tensile-descheduler", descheduler_accesses(NAMESPACE)),
    ];
    for (name, wanted) in upper_checks {
        missing.extend(denied(&upper, &sa(name), &groups, &wanted).await);
    }
    let mut lower_node = virtual_node_accesses(Side::Lower, all_features(NAMESPACE));
    lower_node.extend(extender_lower_accesses());
    missing.extend(denied(&lower, "tensile-virtual-node", &[], &lower_node).await);
    missing.extend(
        denied(
            &lower,
            "tensile-scheduler-extender",
            &[],
            &extender_lower_accesses(),
        )
        .await,
    );
    // Least privilege: the extender's ServiceAccount reads nothing upper.
    let extender_upper = denied(
        &upper,
        &sa("tensile-scheduler-extender"),
        &groups,
        &[access("list", "/pods")],
    )
    .await;

    kubectl(
        &kubectl_bin,
        &["--kubeconfig", upper_config, "delete", "-f", upper_file],
    );
    for d in lower_dirs {
        kubectl(
            &kubectl_bin,
            &["--kubeconfig", lower_config, "delete", "-k", d],
        );
    }
    assert!(missing.is_empty(), "denied:\n{}", missing.join("\n"));
    assert_eq!(
        extender_upper.len(),
        1,
        "the extender may not list upper pods"
    );
}
