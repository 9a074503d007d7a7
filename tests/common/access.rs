//! What each tensile identity calls, as accesses to ask a cluster by SubjectAccessReview:
//! shared by `tests/deploy.rs` (the kustomize bases) and `tests/helm.rs` (the chart).

use k8s_openapi::api::authorization::v1::SubjectAccessReview;
use kube::Client;
use kube::api::{Api, PostParams};
use serde_json::json;
use tensile::clusters::{Features, needed_permissions};
use tensile::side::Side;

/// One access an identity needs: `verb` on `group`/`resource`[/`subresource`], in
/// `namespace` (`None`: all namespaces, or cluster-scoped), of the object `name` if set.
#[derive(Clone, Debug)]
pub struct Access {
    pub verb: &'static str,
    pub group: &'static str,
    pub resource: &'static str,
    pub subresource: &'static str,
    pub namespace: Option<&'static str>,
    pub name: Option<&'static str>,
}

/// `verb` on `resource` (`group/resource/subresource`, the core group empty) everywhere.
pub fn access(verb: &'static str, path: &'static str) -> Access {
    let mut parts = path.split('/');
    let group = parts.next().unwrap_or_default();
    let resource = parts.next().unwrap_or_default();
    let subresource = parts.next().unwrap_or_default();
    Access {
        verb,
        group,
        resource,
        subresource,
        namespace: None,
        name: None,
    }
}

/// The accesses denied to `user` (with `groups`) by the cluster of `client`.
pub async fn denied(
    client: &Client,
    user: &str,
    groups: &[&str],
    wanted: &[Access],
) -> Vec<String> {
    let reviews: Api<SubjectAccessReview> = Api::all(client.clone());
    let mut denied = Vec::new();
    for a in wanted {
        let review: SubjectAccessReview = serde_json::from_value(json!({
            "spec": {
                "user": user,
                "groups": groups,
                "resourceAttributes": {
                    "verb": a.verb, "group": a.group, "resource": a.resource,
                    "subresource": a.subresource, "namespace": a.namespace.unwrap_or_default(),
                    "name": a.name.unwrap_or_default(),
                },
            },
        }))
        .unwrap();
        let answer = reviews
            .create(&PostParams::default(), &review)
            .await
            .unwrap();
        if !answer.status.is_some_and(|s| s.allowed) {
            denied.push(format!("{user}: {a:?}"));
        }
    }
    denied
}

/// The user name of ServiceAccount `name` in `namespace`.
pub fn service_account(namespace: &str, name: &str) -> String {
    format!("system:serviceaccount:{namespace}:{name}")
}

/// The groups a ServiceAccount's token in `namespace` authenticates with.
pub fn service_account_groups(namespace: &str) -> [String; 2] {
    [
        "system:serviceaccounts".to_owned(),
        format!("system:serviceaccounts:{namespace}"),
    ]
}

/// What tensile-descheduler calls in the upper cluster (`src/descheduler`, `src/leader.rs`),
/// installed in `namespace`.
pub fn descheduler_accesses(namespace: &'static str) -> Vec<Access> {
    let mut wanted = vec![
        access("list", "/nodes"),
        access("list", "/pods"),
        access("watch", "/pods"),
        access("get", "/pods"),
        access("create", "/pods"),
        access("patch", "/pods"),
        access("delete", "/pods"),
        access("create", "/pods/eviction"),
        access("create", "events.k8s.io/events"),
        access("patch", "events.k8s.io/events"),
    ];
    let lease = |verb, name| Access {
        namespace: Some(namespace),
        name,
        ..access(verb, "coordination.k8s.io/leases")
    };
    wanted.push(lease("create", None));
    wanted.push(lease("get", Some("tensile-descheduler")));
    wanted.push(lease("update", Some("tensile-descheduler")));
    wanted
}

/// What the scheduler extender reads in each lower cluster (`scheduler-plugin/src/watch.rs`).
pub fn extender_lower_accesses() -> Vec<Access> {
    ["list", "watch"]
        .into_iter()
        .flat_map(|verb| [access(verb, "/nodes"), access(verb, "/pods")])
        .collect()
}

/// What tensile-webhook reads in the upper cluster (its PVC metadata watch).
pub fn webhook_accesses() -> Vec<Access> {
    vec![
        access("list", "/persistentvolumeclaims"),
        access("watch", "/persistentvolumeclaims"),
    ]
}

/// Every feature on, installed in `namespace` (Lease and members there): the shipped RBAC
/// must allow whatever flags the user turns on. `--upper-identity`'s and `--kueue-quota`'s
/// RBAC are opt-in (deploy/virtual-node/upper-identity-rbac.yaml, kueue-rbac.yaml), so
/// they are off.
pub fn all_features(namespace: &'static str) -> Features {
    Features {
        services: true,
        volumes: true,
        node_lease: true,
        access_reviews: true,
        token_reviews: true,
        leader_election: Some(namespace),
        members: Some(namespace),
        upper_identity: false,
        namespaces: true,
        kueue_quota: false,
    }
}

/// virtual-node's start-up permission table for `side` with `features`, as accesses.
pub fn virtual_node_accesses(side: Side, features: Features) -> Vec<Access> {
    needed_permissions(side, features)
        .into_iter()
        .map(|p| Access {
            verb: p.verb,
            group: p.group,
            resource: p.resource,
            subresource: p.subresource,
            namespace: p.namespace,
            name: None,
        })
        .collect()
}

/// Installs the reduced CRDs of `tests/deploy-crds` (cert-manager, Prometheus Operator)
/// in the upper cluster of `pair` and waits until the API server serves them.
pub async fn install_test_crds(pair: &tensile_harness::ClusterPair, client: &Client) {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let out = std::process::Command::new(pair.bin("kubectl"))
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .arg("--kubeconfig")
        .arg(pair.upper_kubeconfig())
        .args(["apply", "--server-side", "-f", "tests/deploy-crds"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kubectl apply -f tests/deploy-crds: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in [
        "issuers.cert-manager.io",
        "certificates.cert-manager.io",
        "podmonitors.monitoring.coreos.com",
    ] {
        tensile_harness::wait_for(
            &format!("CRD {name} Established"),
            std::time::Duration::from_secs(30),
            || async {
                let established = crds.get(name).await?.status.is_some_and(|s| {
                    s.conditions
                        .unwrap_or_default()
                        .iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                });
                Ok(established.then_some(()))
            },
        )
        .await
        .unwrap();
    }
}
