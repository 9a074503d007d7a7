//! The Helm chart `deploy/helm/tensile`, with the real helm (v3, pinned and built by
//! `tests/k8s/helm/build.sh`): `helm lint`; `helm template` with the default values renders
//! the objects of `kubectl kustomize deploy/all` (the differences allowed are listed, each
//! with why); every value set passes a server-side dry run; `helm install` and `helm
//! upgrade` into the harness's upper cluster leave every identity exactly the permissions
//! `deploy/` grants (which `tests/deploy.rs` and `tests/least_privilege.rs` check), and
//! each may do what its binary calls.
//!
//! One source of truth: the chart's RBAC and MutatingWebhookConfiguration are read from the
//! kustomize files themselves (`deploy/helm/tensile/files/` links into `deploy/`), and
//! [`the_default_values_render_what_kustomize_renders`] fails naming each object and field
//! where the rest drifts.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Stdio};

use common::access::{
    Access, access, all_features, denied, descheduler_accesses, install_test_crds, service_account,
    service_account_groups, virtual_node_accesses, webhook_accesses,
};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::Client;
use kube::api::{Api, ListParams};
use serde_json::{Value, json};
use tensile::side::Side;
use tensile_harness::{Binaries, ClusterPair};

/// The chart, relative to the repository.
const CHART: &str = "deploy/helm/tensile";
/// The namespace `deploy/all` installs into.
const KUSTOMIZE_NAMESPACE: &str = "tensile-system";
/// The release namespace of the install test: another than deploy/'s, so every namespace
/// the chart writes (binding subjects, the webhook's Service, certificate names) is its own.
const RELEASE_NAMESPACE: &str = "tensile-helm";
/// The labels the chart adds to every object (`tensile.labels` in `_helpers.tpl`).
const CHART_LABELS: [&str; 4] = [
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/part-of",
    "helm.sh/chart",
];
/// The ServiceAccounts of the chart.
const IDENTITIES: [&str; 4] = [
    "virtual-node",
    "tensile-webhook",
    "tensile-descheduler",
    "tensile-scheduler-extender",
];

/// The root of the repository.
fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs the pinned helm with `args` in the repository, its state under `home` (never the
/// user's), and returns its stdout; `stdin` is fed to it. Panics with its stderr.
fn helm(home: &Path, args: &[&str]) -> String {
    let helm = tensile_harness::binaries::helm().unwrap_or_else(|e| panic!("{e:#}"));
    let output = Command::new(helm)
        .current_dir(repo())
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_DATA_HOME", home.join("data"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "helm {}: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The objects of `helm template` in `namespace` with `sets` (`--set` values).
fn template(home: &Path, namespace: &str, sets: &[&str]) -> Vec<Value> {
    let mut args = vec!["template", "tensile", CHART, "--namespace", namespace];
    for set in sets {
        args.extend(["--set", set]);
    }
    let yaml = helm(home, &args);
    serde_saphyr::from_multiple::<Value>(&yaml)
        .unwrap_or_else(|e| panic!("helm template: {e}\n{yaml}"))
        .into_iter()
        .filter(|o| !o.is_null())
        .collect()
}

/// The objects of `kubectl kustomize dir`.
fn kustomize(kubectl: &Path, dir: &str) -> Vec<Value> {
    tensile_harness::rbac::render(kubectl, repo(), dir).unwrap_or_else(|e| panic!("{e:#}"))
}

/// `Kind/namespace/name` of an object.
fn key(o: &Value) -> String {
    format!(
        "{}/{}/{}",
        o["kind"].as_str().unwrap_or_default(),
        o["metadata"]["namespace"].as_str().unwrap_or_default(),
        o["metadata"]["name"].as_str().unwrap_or_default()
    )
}

/// The objects by key, made comparable: the chart's own labels removed (and `labels` with
/// them when nothing else is left), and a ConfigMap named by its content (kustomize's
/// `-<10 characters>` hash suffix, the chart's of its own) renamed `<name>-<hash>`
/// everywhere it is referred to.
fn comparable(objects: &[Value]) -> BTreeMap<String, Value> {
    let mut text = Value::Array(objects.to_vec()).to_string();
    for o in objects.iter().filter(|o| o["kind"] == "ConfigMap") {
        let name = o["metadata"]["name"].as_str().unwrap_or_default();
        if let Some((base, suffix)) = name.rsplit_once('-')
            && suffix.len() == 10
            && suffix.chars().all(|c| c.is_ascii_alphanumeric())
        {
            text = text.replace(&format!("\"{name}\""), &format!("\"{base}-<hash>\""));
        }
    }
    let objects: Vec<Value> = serde_json::from_str(&text).unwrap();
    objects
        .into_iter()
        .map(|mut o| {
            if let Some(labels) = o["metadata"]["labels"].as_object_mut() {
                for label in CHART_LABELS {
                    labels.remove(label);
                }
                if labels.is_empty() {
                    o["metadata"].as_object_mut().unwrap().remove("labels");
                }
            }
            (key(&o), o)
        })
        .collect()
}

/// Each place where `a` (kustomize's) and `b` (the chart's) differ, as `path: kustomize X,
/// chart Y`; maps are compared key by key, lists of one length item by item.
fn field_differences(path: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let (va, vb) = (&x.get(k), &y.get(k));
                let null = Value::Null;
                field_differences(
                    &format!("{path}.{k}"),
                    va.unwrap_or(&null),
                    vb.unwrap_or(&null),
                    out,
                );
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (va, vb)) in x.iter().zip(y).enumerate() {
                field_differences(&format!("{path}[{i}]"), va, vb, out);
            }
        }
        _ if a != b => out.push(format!("{path}: kustomize {a}, chart {b}")),
        _ => {}
    }
}

/// What differs between kustomize's objects and the chart's, one line each, after
/// [`comparable`], less what `allowed` lists (`key` alone: the whole object on one side;
/// `key path`: one field), each with why.
fn differences(kustomize: &[Value], chart: &[Value], allowed: &[(&str, &str)]) -> Vec<String> {
    let (kustomize, chart) = (comparable(kustomize), comparable(chart));
    let allowed: BTreeSet<&str> = allowed.iter().map(|(what, _why)| *what).collect();
    let keys: BTreeSet<&String> = kustomize.keys().chain(chart.keys()).collect();
    let mut out = Vec::new();
    for key in keys {
        if allowed.contains(key.as_str()) {
            continue;
        }
        match (kustomize.get(key), chart.get(key)) {
            (Some(_), None) => out.push(format!("{key}: only in kubectl kustomize deploy/all")),
            (None, Some(_)) => out.push(format!("{key}: only in the chart")),
            (Some(a), Some(b)) => {
                let mut fields = Vec::new();
                field_differences("", a, b, &mut fields);
                out.extend(
                    fields
                        .into_iter()
                        .map(|f| format!("{key} {f}"))
                        .filter(|line| {
                            let general = any_index(line);
                            !allowed
                                .iter()
                                .any(|w| general.starts_with(&format!("{w}:")))
                        }),
                );
            }
            (None, None) => {}
        }
    }
    out
}

/// `line` with every list index (`[3]`) made `[*]`.
fn any_index(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(open) = rest.find('[') {
        out.push_str(&rest[..=open]);
        rest = &rest[open + 1..];
        match rest.find(']') {
            Some(close) if close > 0 && rest[..close].chars().all(|c| c.is_ascii_digit()) => {
                out.push('*');
                rest = &rest[close..];
            }
            _ => {}
        }
    }
    out.push_str(rest);
    out
}

/// The objects of the chart's pre-delete hook (`templates/uninstall.yaml`).
const UNINSTALL_HOOK: [&str; 8] = [
    "ServiceAccount/tensile-system/tensile-uninstall",
    "ClusterRole//tensile-uninstall",
    "ClusterRoleBinding//tensile-uninstall",
    "Role/kube-node-lease/tensile-uninstall",
    "RoleBinding/kube-node-lease/tensile-uninstall",
    "Role/tensile-system/tensile-uninstall",
    "RoleBinding/tensile-system/tensile-uninstall",
    "Job/tensile-system/tensile-uninstall",
];

/// What the chart renders, with its default values, and `kubectl kustomize deploy/all` does
/// not, or differently, on purpose.
fn allowed_default_differences() -> Vec<(&'static str, &'static str)> {
    vec![
        (
            "Namespace//tensile-system",
            "helm installs into the release namespace (--create-namespace), it is not a chart object",
        ),
        (
            "Secret/tensile-system/tensile-webhook-tls",
            "webhook.certificate=generate: the chart makes the serving certificate \
             (deploy/all expects a Secret made by hand)",
        ),
        (
            "MutatingWebhookConfiguration//tensile-webhook .webhooks[*].clientConfig.caBundle",
            "and the caBundle of that certificate (deploy/all has it patched in by hand)",
        ),
    ]
    .into_iter()
    .chain(UNINSTALL_HOOK.iter().map(|key| {
        (
            *key,
            "uninstall.drain: helm uninstall's pre-delete hook (virtual-node uninstall) and \
             its own identity, created for the hook and gone with it (with deploy/all, run \
             the command by hand: README, \"Uninstalling\")",
        )
    }))
    .collect()
}

#[test]
fn differences_table() {
    let base = json!({"kind": "Deployment", "metadata": {"name": "d", "namespace": "n",
        "labels": {"app": "d"}}, "spec": {"replicas": 2, "args": ["--a", "--b"]}});
    let mut chart_labelled = base.clone();
    chart_labelled["metadata"]["labels"]["helm.sh/chart"] = json!("tensile-0.1.0");
    let mut other_arg = base.clone();
    other_arg["spec"]["args"][1] = json!("--c");
    let mut more_args = base.clone();
    more_args["spec"]["args"] = json!(["--a"]);
    let config = |name: &str| {
        vec![
            json!({"kind": "ConfigMap", "metadata": {"name": name, "namespace": "n"}}),
            json!({"kind": "Deployment", "metadata": {"name": "x", "namespace": "n"},
                   "spec": {"volumes": [{"configMap": {"name": name}}]}}),
        ]
    };
    let other = json!({"kind": "Service", "metadata": {"name": "s", "namespace": "n"}});
    let allowed = [("Service/n/s", "why")];
    /// A case: its name, kustomize's objects, the chart's, the differences allowed, the lines wanted.
    type Case<'a> = (
        &'a str,
        Vec<Value>,
        Vec<Value>,
        &'a [(&'a str, &'a str)],
        &'a [&'a str],
    );
    let cases: Vec<Case> = vec![
        ("same", vec![base.clone()], vec![base.clone()], &[], &[]),
        (
            "chart labels",
            vec![base.clone()],
            vec![chart_labelled],
            &[],
            &[],
        ),
        (
            "an argument",
            vec![base.clone()],
            vec![other_arg.clone()],
            &[],
            &["Deployment/n/d .spec.args[1]: kustomize \"--b\", chart \"--c\""],
        ),
        (
            "a list's length",
            vec![base.clone()],
            vec![more_args],
            &[],
            &["Deployment/n/d .spec.args: kustomize [\"--a\",\"--b\"], chart [\"--a\"]"],
        ),
        (
            "only on one side",
            vec![base.clone()],
            vec![],
            &[],
            &["Deployment/n/d: only in kubectl kustomize deploy/all"],
        ),
        (
            "allowed",
            vec![base.clone()],
            vec![base.clone(), other],
            &allowed,
            &[],
        ),
        (
            "allowed at any index",
            vec![base.clone()],
            vec![other_arg.clone()],
            &[("Deployment/n/d .spec.args[*]", "why")],
            &[],
        ),
        (
            "content-named ConfigMaps",
            config("c-5kkc7f7h8b"),
            config("c-0123456789"),
            &[],
            &[],
        ),
        (
            "a ConfigMap of another name",
            config("c-5kkc7f7h8b"),
            config("d-0123456789"),
            &[],
            &[
                "ConfigMap/n/c-<hash>: only in kubectl kustomize deploy/all",
                "ConfigMap/n/d-<hash>: only in the chart",
                "Deployment/n/x .spec.volumes[0].configMap.name: kustomize \"c-<hash>\", chart \"d-<hash>\"",
            ],
        ),
    ];
    for (case, kustomize, chart, allowed, wanted) in cases {
        assert_eq!(differences(&kustomize, &chart, allowed), wanted, "{case}");
    }
}

/// `helm lint --strict` passes with the default values and with each other value set.
#[test]
fn the_chart_lints() {
    let home = tempfile::tempdir().unwrap();
    for sets in value_sets() {
        let mut args = vec!["lint", "--strict", CHART, "--namespace", RELEASE_NAMESPACE];
        for set in &sets {
            args.extend(["--set", set]);
        }
        let out = helm(home.path(), &args);
        assert!(out.contains("0 chart(s) failed"), "{sets:?}: {out}");
    }
}

/// The value sets every check runs with: the defaults, then members only (no single
/// cluster; the extender reads a member Secret), cert-manager with monitoring and a Kueue
/// quota, and a Secret made by hand with everything but virtual-node off.
fn value_sets() -> Vec<Vec<&'static str>> {
    vec![
        vec![],
        vec![
            "virtualNode.nodeName=",
            "virtualNode.members=true",
            "virtualNode.upperIdentity=true",
            "schedulerExtender.clusters[0].node=vk-b",
            "schedulerExtender.clusters[0].secretName=vk-b",
            "schedulerExtender.clusters[0].key=kubeconfig",
            "schedulerExtender.clusters[1].node=vk-c",
            "schedulerExtender.clusters[1].secretName=vk-c",
            "schedulerExtender.clusters[1].key=kubeconfig",
        ],
        vec![
            "webhook.certificate=certManager",
            "monitoring.enabled=true",
            "virtualNode.kueueQuota=cluster-queue/burst",
            "image.tag=0.2.0",
            "image.pullPolicy=Always",
            "imagePullSecrets[0]=registry",
        ],
        vec![
            "webhook.enabled=false",
            "descheduler.enabled=false",
            "schedulerExtender.enabled=false",
            "virtualNode.replicas=1",
            "virtualNode.leaderElect=false",
        ],
    ]
}

/// `helm template` with the default values renders what `kubectl kustomize deploy/all`
/// renders, object for object and field for field, but for the differences
/// [`allowed_default_differences`] lists. The RBAC and the MutatingWebhookConfiguration are
/// read from deploy/ (files/ links); a failure names each object and field to fix in
/// `deploy/helm/tensile/templates`.
#[test]
fn the_default_values_render_what_kustomize_renders() {
    let binaries = Binaries::locate().unwrap();
    let home = tempfile::tempdir().unwrap();
    let kustomized = kustomize(&binaries.bin("kubectl"), "deploy/all");
    let chart = template(home.path(), KUSTOMIZE_NAMESPACE, &[]);
    let allowed = allowed_default_differences();
    let found = differences(&kustomized, &chart, &allowed);
    assert!(
        found.is_empty(),
        "helm template {CHART} (default values, namespace {KUSTOMIZE_NAMESPACE}) and kubectl \
         kustomize deploy/all differ (fix the chart's templates, or add the difference with \
         its reason to allowed_default_differences):\n{}",
        found.join("\n")
    );
    // What is allowed to differ does.
    let keys: BTreeSet<String> = chart.iter().map(key).collect();
    assert!(keys.contains("Secret/tensile-system/tensile-webhook-tls"));
    assert!(!keys.contains("Namespace//tensile-system"));
}

/// Every file the chart reads from deploy/ is a link into deploy/, not a copy.
#[test]
fn the_chart_reads_its_rbac_from_deploy() {
    let files = repo().join(CHART).join("files");
    let deploy = repo().join("deploy").canonicalize().unwrap();
    let mut links = Vec::new();
    for entry in std::fs::read_dir(&files).unwrap() {
        let path = entry.unwrap().path();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        assert!(
            meta.file_type().is_symlink(),
            "{} is a copy: make it a link into deploy/",
            path.display()
        );
        let target = path.canonicalize().unwrap();
        assert!(target.starts_with(&deploy), "{}", target.display());
        assert!(
            !target.starts_with(deploy.join("helm")),
            "{}",
            target.display()
        );
        links.push(path.file_name().unwrap().to_string_lossy().into_owned());
    }
    links.sort();
    for wanted in [
        "descheduler-rbac.yaml",
        "scheduler-extender-rbac.yaml",
        "virtual-node-rbac.yaml",
        "virtual-node-upper-identity-rbac.yaml",
        "virtual-node-kueue-rbac.yaml",
        "webhook-mutatingwebhookconfiguration.yaml",
        "webhook-rbac.yaml",
    ] {
        assert!(links.iter().any(|l| l == wanted), "{wanted} in {links:?}");
    }
}

/// Each permission of `rules`, one per group, resource, verb and object name.
fn atoms(rules: &Value) -> Vec<String> {
    let list = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|s| s.as_str().unwrap_or_default().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut out = Vec::new();
    for rule in rules.as_array().into_iter().flatten() {
        let mut names = list(&rule["resourceNames"]);
        if names.is_empty() {
            names.push("*".to_owned());
        }
        for group in list(&rule["apiGroups"]) {
            for resource in list(&rule["resources"]) {
                for verb in list(&rule["verbs"]) {
                    for name in &names {
                        out.push(format!("{group}/{resource} {verb} {name}"));
                    }
                }
            }
        }
    }
    out
}

/// Every permission each ServiceAccount of `namespace` named in [`IDENTITIES`] holds
/// through `objects` (roles and bindings as JSON), as `identity scope permission` lines; the
/// scope is `cluster`, `namespace` (the identity's own) or `namespace <another>`.
fn permissions(objects: &[Value], namespace: &str) -> BTreeSet<String> {
    let role = |kind: &str, name: &str, ns: &str| {
        objects.iter().find(|o| {
            o["kind"] == kind
                && o["metadata"]["name"] == name
                && (kind == "ClusterRole" || o["metadata"]["namespace"] == ns)
        })
    };
    let mut out = BTreeSet::new();
    for binding in objects
        .iter()
        .filter(|o| o["kind"] == "ClusterRoleBinding" || o["kind"] == "RoleBinding")
    {
        let binding_ns = binding["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default();
        let scope = match binding["kind"].as_str() {
            Some("ClusterRoleBinding") => "cluster".to_owned(),
            _ if binding_ns == namespace => "namespace".to_owned(),
            _ => format!("namespace {binding_ns}"),
        };
        let role_kind = binding["roleRef"]["kind"].as_str().unwrap_or_default();
        let role_name = binding["roleRef"]["name"].as_str().unwrap_or_default();
        for subject in binding["subjects"].as_array().into_iter().flatten() {
            let name = subject["name"].as_str().unwrap_or_default();
            let ours = subject["kind"] == "ServiceAccount"
                && subject["namespace"] == namespace
                && IDENTITIES.contains(&name);
            if !ours {
                continue;
            }
            let Some(role) = role(role_kind, role_name, binding_ns) else {
                out.insert(format!("{name} {scope} <missing {role_kind} {role_name}>"));
                continue;
            };
            for atom in atoms(&role["rules"]) {
                out.insert(format!("{name} {scope} {atom}"));
            }
        }
    }
    out
}

/// The roles and bindings the upper cluster of `client` holds now, as JSON.
async fn live_rbac(client: &Client) -> Vec<Value> {
    let all = ListParams::default();
    let mut objects = Vec::new();
    let json = |kind: &str, v: Value| {
        let mut v = v;
        v["kind"] = json!(kind);
        v
    };
    for o in Api::<ClusterRole>::all(client.clone())
        .list(&all)
        .await
        .unwrap()
    {
        objects.push(json("ClusterRole", serde_json::to_value(o).unwrap()));
    }
    for o in Api::<ClusterRoleBinding>::all(client.clone())
        .list(&all)
        .await
        .unwrap()
    {
        objects.push(json("ClusterRoleBinding", serde_json::to_value(o).unwrap()));
    }
    for o in Api::<Role>::all(client.clone()).list(&all).await.unwrap() {
        objects.push(json("Role", serde_json::to_value(o).unwrap()));
    }
    for o in Api::<RoleBinding>::all(client.clone())
        .list(&all)
        .await
        .unwrap()
    {
        objects.push(json("RoleBinding", serde_json::to_value(o).unwrap()));
    }
    objects
}

/// The RBAC virtual-node's opt-in flags need beside deploy/all's: `--upper-identity`'s and
/// `--kueue-quota`'s, each applied on its own where the flag is on.
const OPT_IN_RBAC: [&str; 2] = [
    "deploy/virtual-node/upper-identity-rbac.yaml",
    "deploy/virtual-node/kueue-rbac.yaml",
];

/// The permissions deploy/ grants (`kubectl kustomize deploy/all`, and with `opt_in`
/// [`OPT_IN_RBAC`]), in deploy/'s namespace.
fn shipped_permissions(kubectl: &Path, opt_in: bool) -> BTreeSet<String> {
    let mut objects = kustomize(kubectl, "deploy/all");
    for file in OPT_IN_RBAC.into_iter().filter(|_| opt_in) {
        let text = std::fs::read_to_string(repo().join(file)).unwrap();
        objects.extend(
            serde_saphyr::from_multiple::<Value>(&text)
                .unwrap()
                .into_iter()
                .filter(|o| !o.is_null()),
        );
    }
    permissions(&objects, KUSTOMIZE_NAMESPACE)
}

/// Fails unless each identity of the release holds exactly the permissions deploy/ grants
/// (`opt_in`: with --upper-identity's and --kueue-quota's), and may do what its binary
/// calls.
async fn assert_exact_permissions(upper: &Client, kubectl: &Path, opt_in: bool, when: &str) {
    let live = permissions(&live_rbac(upper).await, RELEASE_NAMESPACE);
    let shipped = shipped_permissions(kubectl, opt_in);
    let extra: Vec<&String> = live.difference(&shipped).collect();
    let missing: Vec<&String> = shipped.difference(&live).collect();
    assert!(
        extra.is_empty() && missing.is_empty(),
        "{when}: the release's identities hold other permissions than deploy/ grants\n\
         held, not granted by deploy/: {extra:#?}\ngranted by deploy/, not held: {missing:#?}"
    );

    let groups = service_account_groups(RELEASE_NAMESPACE);
    let groups: Vec<&str> = groups.iter().map(String::as_str).collect();
    let sa = |name| service_account(RELEASE_NAMESPACE, name);
    let mut features = all_features(RELEASE_NAMESPACE);
    features.upper_identity = opt_in;
    features.kueue_quota = opt_in;
    let checks: [(&str, Vec<Access>); 3] = [
        ("virtual-node", virtual_node_accesses(Side::Upper, features)),
        ("tensile-webhook", webhook_accesses()),
        (
            "tensile-descheduler",
            descheduler_accesses(RELEASE_NAMESPACE),
        ),
    ];
    let mut refused = Vec::new();
    for (name, wanted) in checks {
        refused.extend(denied(upper, &sa(name), &groups, &wanted).await);
    }
    assert!(
        refused.is_empty(),
        "{when}: denied:\n{}",
        refused.join("\n")
    );
    let token = access("create", "/serviceaccounts/token");
    let minted = denied(upper, &sa("virtual-node"), &groups, &[token]).await;
    assert_eq!(
        minted.is_empty(),
        opt_in,
        "{when}: virtual-node may mint tokens only with virtualNode.upperIdentity"
    );
    let quota = access("patch", "kueue.x-k8s.io/clusterqueues");
    let patched = denied(upper, &sa("virtual-node"), &groups, &[quota]).await;
    assert_eq!(
        patched.is_empty(),
        opt_in,
        "{when}: virtual-node may patch ClusterQueues only with virtualNode.kueueQuota"
    );
    let extender = denied(
        upper,
        &sa("tensile-scheduler-extender"),
        &groups,
        &[access("list", "/pods")],
    )
    .await;
    assert_eq!(
        extender.len(),
        1,
        "{when}: the extender reads nothing upper"
    );
}

/// `kubectl apply --dry-run=server --validate=strict` of `objects`: each valid for the
/// pinned release, no unknown field.
fn dry_run(pair: &ClusterPair, dir: &Path, name: &str, objects: &[Value]) {
    let file = dir.join(format!("{name}.json"));
    let list = json!({"apiVersion": "v1", "kind": "List", "items": objects});
    std::fs::write(&file, list.to_string()).unwrap();
    let kubeconfig = pair.upper_kubeconfig().to_str().unwrap();
    let out = Command::new(pair.bin("kubectl"))
        .args([
            "--kubeconfig",
            kubeconfig,
            "apply",
            "--dry-run=server",
            "--validate=strict",
            "-f",
            file.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The caBundle of the release's MutatingWebhookConfiguration, each webhook pointing at
/// the release namespace's Service.
async fn ca_bundles(upper: &Client) -> Vec<String> {
    let config = Api::<MutatingWebhookConfiguration>::all(upper.clone())
        .get("tensile-webhook")
        .await
        .unwrap();
    let hooks = config.webhooks.unwrap_or_default();
    assert!(!hooks.is_empty());
    hooks
        .iter()
        .map(|hook| {
            let service = hook.client_config.service.as_ref().unwrap();
            assert_eq!(service.namespace, RELEASE_NAMESPACE, "{}", hook.name);
            let bundle = hook.client_config.ca_bundle.as_ref().unwrap();
            assert!(!bundle.0.is_empty(), "{}: no caBundle", hook.name);
            String::from_utf8_lossy(&bundle.0).into_owned()
        })
        .collect()
}

/// The arguments of virtual-node's container, and its replicas.
async fn virtual_node_deployment(upper: &Client) -> (Vec<String>, i32) {
    let deployment = Api::<Deployment>::namespaced(upper.clone(), RELEASE_NAMESPACE)
        .get("virtual-node")
        .await
        .unwrap();
    let spec = deployment.spec.unwrap();
    let args = spec.template.spec.unwrap().containers[0]
        .args
        .clone()
        .unwrap_or_default();
    (args, spec.replicas.unwrap_or(1))
}

/// Every value set passes a server-side dry run; `helm install` (default values) and `helm
/// upgrade` (members, --upper-identity, --kueue-quota, three replicas; then the defaults
/// again) into the upper cluster, in a namespace of its own, leave each identity exactly
/// the permissions deploy/ grants and what its binary calls; the generated webhook
/// certificate survives the upgrades; `helm uninstall` takes every ClusterRole and binding
/// with it.
#[tokio::test]
async fn install_and_upgrade_keep_exactly_the_shipped_permissions() {
    let pair = ClusterPair::shared().await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let kubectl = pair.bin("kubectl");
    let home = tempfile::tempdir().unwrap();
    let home = home.path();
    tensile_harness::pair::ensure_namespace(&upper, RELEASE_NAMESPACE)
        .await
        .unwrap();
    install_test_crds(pair, &upper).await;
    for (i, sets) in value_sets().iter().enumerate() {
        let objects = template(home, RELEASE_NAMESPACE, sets);
        dry_run(pair, home, &format!("values-{i}"), &objects);
    }

    let kubeconfig = pair.upper_kubeconfig().to_str().unwrap();
    let release = [
        "tensile",
        CHART,
        "--namespace",
        RELEASE_NAMESPACE,
        "--kubeconfig",
        kubeconfig,
    ];
    let run = |verb: &str, sets: &[&str]| {
        let mut args = vec![verb];
        args.extend(release);
        for set in sets {
            args.extend(["--set", *set]);
        }
        helm(home, &args)
    };
    run("install", &[]);
    assert_exact_permissions(&upper, &kubectl, false, "after helm install").await;
    let bundles = ca_bundles(&upper).await;
    let (args, _) = virtual_node_deployment(&upper).await;
    assert!(args.contains(&"--nodename=vk-node".to_owned()), "{args:?}");

    run(
        "upgrade",
        &[
            "virtualNode.members=true",
            "virtualNode.upperIdentity=true",
            "virtualNode.kueueQuota=cluster-queue/burst",
            "virtualNode.replicas=3",
        ],
    );
    assert_exact_permissions(
        &upper,
        &kubectl,
        true,
        "after helm upgrade (upper identity, Kueue quota)",
    )
    .await;
    let (args, replicas) = virtual_node_deployment(&upper).await;
    assert_eq!(replicas, 3);
    for wanted in [
        format!("--members-namespace={RELEASE_NAMESPACE}"),
        "--upper-identity".to_owned(),
        "--kueue-quota=cluster-queue/burst".to_owned(),
    ] {
        assert!(args.contains(&wanted), "{wanted} in {args:?}");
    }
    assert_eq!(
        ca_bundles(&upper).await,
        bundles,
        "an upgrade keeps the certificate"
    );

    // Back to the chart's values: the upper-identity and Kueue RBAC go.
    helm(
        home,
        &[&["upgrade", "--reset-values"][..], &release[..]].concat(),
    );
    assert_exact_permissions(&upper, &kubectl, false, "after helm upgrade (defaults)").await;
    assert_eq!(
        ca_bundles(&upper).await,
        bundles,
        "an upgrade keeps the certificate"
    );

    // Without the pre-delete hook: on kwok nodes its Job never runs (tests/install.rs runs
    // it on a real node).
    helm(
        home,
        &[
            "uninstall",
            "tensile",
            "--namespace",
            RELEASE_NAMESPACE,
            "--kubeconfig",
            kubeconfig,
            "--no-hooks",
        ],
    );
    let left = permissions(&live_rbac(&upper).await, RELEASE_NAMESPACE);
    assert!(left.is_empty(), "left after helm uninstall: {left:#?}");
    let configs = Api::<MutatingWebhookConfiguration>::all(upper.clone());
    assert!(configs.get_opt("tensile-webhook").await.unwrap().is_none());
}
