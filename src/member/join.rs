//! `virtual-node join` and `virtual-node leave`: a lower cluster made a member in one
//! command, and unmade in another. `join` creates, with the lower cluster's admin
//! kubeconfig, a ServiceAccount bound to exactly the RBAC of `deploy/virtual-node-lower`
//! and a token for it, makes a kubeconfig of that identity, and writes the member Secret
//! into the upper members namespace; a virtual-node with `--members-namespace` joins it
//! within seconds. `leave` deletes the member Secret, waits until the member has left
//! (its node drained and deleted, its lower objects gone: the virtual-node does it, then
//! drops the Secret's finalizer), and deletes the identity below. Both are idempotent.
//!
//! The identity below is per upper cluster (its names carry the upper cluster's identity,
//! `--cluster-id` or the UID of the upper `kube-system`, and its objects are labelled
//! with it), so two upper clusters that join one lower cluster under one node name each
//! have their own, and one's `leave` never revokes the other's. An identity of the naming
//! before (`tensile-<node>`, shared) is deleted by `leave` only when the member Secret
//! being deleted holds its token: then it is this upper cluster's.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use base64::Engine;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Namespace, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, RoleRef, Subject};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::Kubeconfig;
use kube::{Client, Resource};
use serde_json::json;

use super::spec::{KUBECONFIG_KEY, MEMBER_LABEL, NODE_NAME_ANNOTATION};
use crate::api::is_status;
use crate::cli::Args;
use crate::clusters;
use crate::side::Side;
use crate::translate::namespace::cluster_suffix;

/// The label of a joined identity's objects below: the node joined.
pub const JOINED_NODE_LABEL: &str = "tensile.dev/joined-node";

/// The label of a joined identity's objects below: the upper cluster that joined it.
pub const JOINED_CLUSTER_LABEL: &str = "tensile.dev/joined-cluster";

/// The lower RBAC a member's identity is bound to: the ClusterRole of
/// `deploy/virtual-node-lower`, as shipped.
const LOWER_RBAC: &str = include_str!("../../deploy/virtual-node-lower/rbac.yaml");

/// The lower namespace of the members' ServiceAccounts and their token Secrets.
pub const LOWER_NAMESPACE: &str = "tensile-system";

/// How long `leave` waits for the member to have left, at least.
const LEAVE_WAIT: Duration = Duration::from_secs(300);

/// How much longer than `--leave-timeout` `leave` waits for the member to have left.
const LEAVE_WAIT_MARGIN: Duration = Duration::from_secs(60);

/// How long `join` waits for the lower token controller to fill the token Secret.
const TOKEN_WAIT: Duration = Duration::from_secs(60);

/// The objects a member's lower identity is made of.
#[derive(Debug, PartialEq)]
pub struct LowerIdentity {
    /// The ServiceAccount (in [`LOWER_NAMESPACE`]) and its token Secret's name.
    pub service_account: String,
    /// Its token Secret.
    pub token_secret: String,
    /// The ClusterRoleBinding to the shipped ClusterRole.
    pub binding: String,
}

impl LowerIdentity {
    /// The identity of the member joined as `node` by the upper cluster `upper_cluster`
    /// (its identity, as on lower objects).
    pub fn of(node: &str, upper_cluster: &str) -> Self {
        let suffix = cluster_suffix(upper_cluster);
        Self {
            service_account: format!("tensile-{node}-{suffix}"),
            token_secret: format!("tensile-{node}-{suffix}-token"),
            binding: format!("tensile-virtual-node-lower-{node}-{suffix}"),
        }
    }

    /// The identity of the member joined as `node` by a tensile before per-cluster
    /// identities: one for every upper cluster that joined `node`.
    pub fn legacy(node: &str) -> Self {
        Self {
            service_account: format!("tensile-{node}"),
            token_secret: format!("tensile-{node}-token"),
            binding: format!("tensile-virtual-node-lower-{node}"),
        }
    }
}

/// The labels of the identity joined as `node` by `upper_cluster`.
fn identity_labels(node: &str, upper_cluster: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (JOINED_NODE_LABEL.to_owned(), node.to_owned()),
        (JOINED_CLUSTER_LABEL.to_owned(), upper_cluster.to_owned()),
    ])
}

/// The selector of the identity joined as `node` by `upper_cluster`.
fn identity_selector(node: &str, upper_cluster: &str) -> String {
    format!("{JOINED_NODE_LABEL}={node},{JOINED_CLUSTER_LABEL}={upper_cluster}")
}

/// The bearer tokens of the kubeconfig in the member Secret `secret` (none if it has none
/// or cannot be read). Never logged.
fn member_tokens(secret: &Secret) -> Vec<String> {
    let Some(text) = secret
        .data
        .as_ref()
        .and_then(|d| d.get(KUBECONFIG_KEY))
        .and_then(|k| std::str::from_utf8(&k.0).ok())
    else {
        return Vec::new();
    };
    let Ok(kubeconfig) = serde_saphyr::from_str::<serde_json::Value>(text) else {
        return Vec::new();
    };
    kubeconfig["users"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|u| u["user"]["token"].as_str())
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Whether the legacy token Secret `token_secret` holds one of `tokens`: the legacy
/// identity is then the one these member Secrets used.
fn holds_one_of(token_secret: &Secret, tokens: &[String]) -> bool {
    token_secret
        .data
        .as_ref()
        .and_then(|d| d.get("token"))
        .and_then(|t| std::str::from_utf8(&t.0).ok())
        .is_some_and(|t| !t.is_empty() && tokens.iter().any(|m| m == t))
}

/// The shipped ClusterRole of `deploy/virtual-node-lower`.
pub fn lower_cluster_role() -> Result<ClusterRole, String> {
    serde_saphyr::from_multiple::<serde_json::Value>(LOWER_RBAC)
        .map_err(|e| format!("deploy/virtual-node-lower/rbac.yaml: {e}"))?
        .into_iter()
        .find(|object| object["kind"] == "ClusterRole")
        .ok_or_else(|| "deploy/virtual-node-lower/rbac.yaml has no ClusterRole".to_owned())
        .and_then(|object| {
            serde_json::from_value(object)
                .map_err(|e| format!("deploy/virtual-node-lower/rbac.yaml: its ClusterRole: {e}"))
        })
}

/// A kubeconfig for the member identity: the cluster of `admin`'s current context (its
/// server, and its CA inlined; `ca_file` reads a CA given as a path), and `token`.
pub fn member_kubeconfig(
    admin: &Kubeconfig,
    token: &str,
    user: &str,
    ca_file: impl Fn(&Path) -> std::io::Result<Vec<u8>>,
) -> Result<String, String> {
    let context_name = admin
        .current_context
        .as_deref()
        .ok_or("the lower kubeconfig has no current context")?;
    let cluster_name = admin
        .contexts
        .iter()
        .find(|c| c.name == context_name)
        .and_then(|c| c.context.as_ref())
        .map(|c| c.cluster.clone())
        .ok_or_else(|| format!("the lower kubeconfig has no context {context_name}"))?;
    let mut cluster = admin
        .clusters
        .iter()
        .find(|c| c.name == cluster_name)
        .and_then(|c| c.cluster.clone())
        .ok_or_else(|| format!("the lower kubeconfig has no cluster {cluster_name}"))?;
    if cluster.server.is_none() {
        return Err(format!(
            "the lower kubeconfig's cluster {cluster_name} has no server"
        ));
    }
    if let Some(path) = cluster.certificate_authority.take() {
        let pem = ca_file(Path::new(&path))
            .map_err(|e| format!("the lower kubeconfig's CA {path}: {e}"))?;
        cluster.certificate_authority_data =
            Some(base64::engine::general_purpose::STANDARD.encode(pem));
    }
    let kubeconfig = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": cluster_name, "cluster": cluster}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": user, "context": {"cluster": cluster_name, "user": user}}],
        "current-context": user,
    });
    serde_saphyr::to_string(&kubeconfig).map_err(|e| format!("writing the kubeconfig: {e}"))
}

/// The upper member Secret for the lower cluster of `kubeconfig`, joined as `node`.
pub fn member_secret(node: &str, namespace: &str, kubeconfig: String) -> Secret {
    let mut secret = Secret::default();
    secret.metadata.name = Some(node.to_owned());
    secret.metadata.namespace = Some(namespace.to_owned());
    secret.metadata.labels = Some([(MEMBER_LABEL.to_owned(), "true".to_owned())].into());
    secret.metadata.annotations = Some([(NODE_NAME_ANNOTATION.to_owned(), node.to_owned())].into());
    secret.data = Some(BTreeMap::from([(
        KUBECONFIG_KEY.to_owned(),
        ByteString(kubeconfig.into_bytes()),
    )]));
    secret
}

/// The names of the objects below that a leave deletes, by kind.
#[derive(Default)]
struct Doomed {
    bindings: std::collections::BTreeSet<String>,
    secrets: std::collections::BTreeSet<String>,
    accounts: std::collections::BTreeSet<String>,
}

impl From<&LowerIdentity> for Doomed {
    fn from(identity: &LowerIdentity) -> Self {
        Self {
            bindings: [identity.binding.clone()].into(),
            secrets: [identity.token_secret.clone()].into(),
            accounts: [identity.service_account.clone()].into(),
        }
    }
}

impl Doomed {
    fn extend(&mut self, other: Self) {
        self.bindings.extend(other.bindings);
        self.secrets.extend(other.secrets);
        self.accounts.extend(other.accounts);
    }
}

/// What `join` and `leave` need of the flags: both clusters, the node and the members
/// namespace.
struct Target {
    upper: Client,
    upper_server: String,
    lower: Client,
    lower_server: String,
    lower_kubeconfig: Kubeconfig,
    node: String,
    namespace: String,
    /// The upper cluster's identity: `--cluster-id`, or its `kube-system` namespace's UID.
    upper_cluster: String,
}

async fn target(args: &Args, verb: &str) -> Result<Target, String> {
    let namespace = args
        .members_namespace
        .clone()
        .ok_or_else(|| format!("{verb}: --members-namespace is required"))?;
    let lower_path = args.client_kubeconfig.as_deref().ok_or_else(|| {
        format!("{verb}: --client-kubeconfig (the lower cluster's admin kubeconfig) is required")
    })?;
    let lower_kubeconfig = Kubeconfig::read_from(lower_path)
        .map_err(|e| format!("lower cluster: kubeconfig {}: {e}", lower_path.display()))?;
    let upper_config = clusters::load_config(Side::Upper, args.kubeconfig.as_deref())
        .await
        .map_err(|e| e.to_string())?;
    let lower_config = clusters::load_config(Side::Lower, Some(lower_path))
        .await
        .map_err(|e| e.to_string())?;
    let (upper_server, lower_server) = (
        upper_config.cluster_url.to_string(),
        lower_config.cluster_url.to_string(),
    );
    let client =
        |config, side: Side| Client::try_from(config).map_err(|e| format!("{side} cluster: {e}"));
    let upper = client(upper_config, Side::Upper)?;
    let upper_cluster = match &args.cluster_id {
        Some(id) => id.clone(),
        None => Api::<Namespace>::all(upper.clone())
            .get("kube-system")
            .await
            .map_err(|e| {
                format!(
                    "upper cluster {upper_server}: reading namespace kube-system, whose UID names the lower identity (or set --cluster-id): {e}"
                )
            })?
            .metadata
            .uid
            .ok_or_else(|| {
                format!("upper cluster {upper_server}: namespace kube-system has no UID; set --cluster-id")
            })?,
    };
    Ok(Target {
        upper,
        upper_server,
        lower: client(lower_config, Side::Lower)?,
        lower_server,
        lower_kubeconfig,
        node: args.nodename.clone(),
        namespace,
        upper_cluster,
    })
}

/// Creates `object` with `api`, or, where it exists, leaves it (`Ok(false)`).
async fn create_once<K>(api: &Api<K>, object: &K, what: &str) -> Result<bool, String>
where
    K: Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.create(&PostParams::default(), object).await {
        Ok(_) => Ok(true),
        Err(e) if is_status(&e, 409) => Ok(false),
        Err(e) => Err(format!("creating {what}: {e}")),
    }
}

/// `virtual-node join`: the lines to print, or the one line saying what failed.
pub async fn join(args: &Args) -> Result<Vec<String>, String> {
    let t = target(args, "join").await?;
    let identity = LowerIdentity::of(&t.node, &t.upper_cluster);
    let labels = identity_labels(&t.node, &t.upper_cluster);
    let lower = |e: String| format!("lower cluster {}: {e}", t.lower_server);
    let mut said = Vec::new();

    // Below: the ServiceAccount, bound to the shipped ClusterRole, and its token.
    let namespace = Namespace {
        metadata: kube::api::ObjectMeta {
            name: Some(LOWER_NAMESPACE.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    create_once(
        &Api::<Namespace>::all(t.lower.clone()),
        &namespace,
        &format!("namespace {LOWER_NAMESPACE}"),
    )
    .await
    .map_err(lower)?;
    let role = lower_cluster_role()?;
    let role_name = role.metadata.name.clone().unwrap_or_default();
    let roles: Api<ClusterRole> = Api::all(t.lower.clone());
    roles
        .patch(
            &role_name,
            &PatchParams::apply("tensile-virtual-node-join").force(),
            &Patch::Apply(&role),
        )
        .await
        .map_err(|e| lower(format!("applying ClusterRole {role_name}: {e}")))?;
    let mut account = ServiceAccount::default();
    account.metadata.name = Some(identity.service_account.clone());
    account.metadata.labels = Some(labels.clone());
    create_once(
        &Api::namespaced(t.lower.clone(), LOWER_NAMESPACE),
        &account,
        &format!(
            "ServiceAccount {LOWER_NAMESPACE}/{}",
            identity.service_account
        ),
    )
    .await
    .map_err(lower)?;
    let binding = ClusterRoleBinding {
        metadata: kube::api::ObjectMeta {
            name: Some(identity.binding.clone()),
            labels: Some(labels.clone()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: role_name.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: identity.service_account.clone(),
            namespace: Some(LOWER_NAMESPACE.into()),
            ..Default::default()
        }]),
    };
    create_once(
        &Api::<ClusterRoleBinding>::all(t.lower.clone()),
        &binding,
        &format!("ClusterRoleBinding {}", identity.binding),
    )
    .await
    .map_err(lower)?;
    said.push(format!(
        "lower cluster {}: ServiceAccount {LOWER_NAMESPACE}/{} bound to ClusterRole {role_name} (deploy/virtual-node-lower)",
        t.lower_server, identity.service_account
    ));
    let token = lower_token(&t.lower, &identity, &labels)
        .await
        .map_err(lower)?;
    said.push(format!(
        "lower cluster {}: its token in Secret {LOWER_NAMESPACE}/{}",
        t.lower_server, identity.token_secret
    ));

    // Upstairs: the member Secret.
    let kubeconfig = member_kubeconfig(
        &t.lower_kubeconfig,
        &token,
        &identity.service_account,
        |path| std::fs::read(path),
    )?;
    let upper = |e: String| format!("upper cluster {}: {e}", t.upper_server);
    let members_namespace = Namespace {
        metadata: kube::api::ObjectMeta {
            name: Some(t.namespace.clone()),
            ..Default::default()
        },
        ..Default::default()
    };
    create_once(
        &Api::<Namespace>::all(t.upper.clone()),
        &members_namespace,
        &format!("namespace {}", t.namespace),
    )
    .await
    .map_err(upper)?;
    let secrets: Api<Secret> = Api::namespaced(t.upper.clone(), &t.namespace);
    // Joined before with the naming before: that identity is this cluster's if the member
    // Secret holds its token. Labelled as this cluster's, `leave` deletes it with the new.
    let before = secrets
        .get_opt(&t.node)
        .await
        .map_err(|e| upper(format!("reading Secret {}/{}: {e}", t.namespace, t.node)))?;
    if let Some(before) = before
        && let Some(adopted) = adopt_legacy(&t, &before, &labels).await.map_err(lower)?
    {
        said.push(adopted);
    }
    let secret = member_secret(&t.node, &t.namespace, kubeconfig);
    let created = create_once(
        &secrets,
        &secret,
        &format!("Secret {}/{}", t.namespace, t.node),
    )
    .await
    .map_err(upper)?;
    if !created {
        // Joined before: the kubeconfig is made anew (a rotation for the member).
        let patch = json!({
            "metadata": {
                "labels": secret.metadata.labels,
                "annotations": secret.metadata.annotations,
            },
            "data": secret.data,
        });
        secrets
            .patch(&t.node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|e| upper(format!("updating Secret {}/{}: {e}", t.namespace, t.node)))?;
    }
    said.push(format!(
        "upper cluster {}: member Secret {}/{} {}; a virtual-node with --members-namespace {} joins it as node {} within seconds",
        t.upper_server,
        t.namespace,
        t.node,
        if created { "created" } else { "updated" },
        t.namespace,
        t.node
    ));
    said.push(format!(
        "next: virtual-node check --members-namespace {} (reaches the lower cluster as the joined identity and checks its permissions), then kubectl get node {}",
        t.namespace, t.node
    ));
    Ok(said)
}

/// Labels the identity of the naming before of `t.node` with `labels` when the member
/// Secret `member` holds its token; what it did, if anything.
async fn adopt_legacy(
    t: &Target,
    member: &Secret,
    labels: &BTreeMap<String, String>,
) -> Result<Option<String>, String> {
    let legacy = LowerIdentity::legacy(&t.node);
    let secrets: Api<Secret> = Api::namespaced(t.lower.clone(), LOWER_NAMESPACE);
    let what = format!("Secret {LOWER_NAMESPACE}/{}", legacy.token_secret);
    let Some(token) = secrets
        .get_opt(&legacy.token_secret)
        .await
        .map_err(|e| format!("reading {what}: {e}"))?
    else {
        return Ok(None);
    };
    if !holds_one_of(&token, &member_tokens(member)) {
        return Ok(None);
    }
    let patch = Patch::Merge(json!({"metadata": {"labels": labels}}));
    let params = PatchParams::default();
    let found = |result: Result<(), kube::Error>, what: String| match result {
        Ok(()) => Ok(()),
        Err(e) if is_status(&e, 404) => Ok(()),
        Err(e) => Err(format!("labelling {what}: {e}")),
    };
    found(
        secrets
            .patch(&legacy.token_secret, &params, &patch)
            .await
            .map(|_| ()),
        what,
    )?;
    found(
        Api::<ServiceAccount>::namespaced(t.lower.clone(), LOWER_NAMESPACE)
            .patch(&legacy.service_account, &params, &patch)
            .await
            .map(|_| ()),
        format!(
            "ServiceAccount {LOWER_NAMESPACE}/{}",
            legacy.service_account
        ),
    )?;
    found(
        Api::<ClusterRoleBinding>::all(t.lower.clone())
            .patch(&legacy.binding, &params, &patch)
            .await
            .map(|_| ()),
        format!("ClusterRoleBinding {}", legacy.binding),
    )?;
    Ok(Some(format!(
        "lower cluster {}: the identity of the naming before ({LOWER_NAMESPACE}/{}) is this upper cluster's: labelled so that leave deletes it",
        t.lower_server, legacy.service_account
    )))
}

/// The token of the member identity: its token Secret, once the lower token controller
/// has filled it.
async fn lower_token(
    lower: &Client,
    identity: &LowerIdentity,
    labels: &BTreeMap<String, String>,
) -> Result<String, String> {
    let secrets: Api<Secret> = Api::namespaced(lower.clone(), LOWER_NAMESPACE);
    let mut secret = Secret::default();
    secret.metadata.name = Some(identity.token_secret.clone());
    secret.metadata.labels = Some(labels.clone());
    secret.metadata.annotations = Some(
        [(
            "kubernetes.io/service-account.name".to_owned(),
            identity.service_account.clone(),
        )]
        .into(),
    );
    secret.type_ = Some("kubernetes.io/service-account-token".into());
    let what = format!("Secret {LOWER_NAMESPACE}/{}", identity.token_secret);
    create_once(&secrets, &secret, &what).await?;
    let deadline = tokio::time::Instant::now() + TOKEN_WAIT;
    loop {
        let token = secrets
            .get_opt(&identity.token_secret)
            .await
            .map_err(|e| format!("reading {what}: {e}"))?
            .and_then(|s| s.data)
            .and_then(|mut data| data.remove("token"))
            .and_then(|token| String::from_utf8(token.0).ok())
            .filter(|token| !token.is_empty());
        if let Some(token) = token {
            return Ok(token);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!(
                "{what} got no token within {}s: is kube-controller-manager's token controller running (--service-account-private-key-file)?",
                TOKEN_WAIT.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `virtual-node leave`: the lines to print, or the one line saying what failed.
pub async fn leave(args: &Args) -> Result<Vec<String>, String> {
    let t = target(args, "leave").await?;
    let identity = LowerIdentity::of(&t.node, &t.upper_cluster);
    let mut said = Vec::new();
    let upper = |e: String| format!("upper cluster {}: {e}", t.upper_server);
    let secrets: Api<Secret> = Api::namespaced(t.upper.clone(), &t.namespace);
    let selector = format!("{MEMBER_LABEL}=true");
    let members = secrets
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(|e| upper(format!("listing member Secrets in {}: {e}", t.namespace)))?;
    let ours: Vec<String> = members
        .items
        .iter()
        .filter(|s| super::spec::node_name(s) == t.node)
        .filter_map(|s| s.metadata.name.clone())
        .collect();
    // Read before they go: an identity of the naming before is this cluster's only if
    // one of these holds its token.
    let tokens: Vec<String> = members
        .items
        .iter()
        .filter(|s| super::spec::node_name(s) == t.node)
        .flat_map(member_tokens)
        .collect();
    // The member's own leave is bounded by the virtual-node's --leave-timeout (this
    // flag's value is taken as the same): wait a little longer than that.
    let leave_wait = LEAVE_WAIT.max(args.leave_timeout + LEAVE_WAIT_MARGIN);
    for name in &ours {
        match secrets.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(e) if is_status(&e, 404) => {}
            Err(e) => {
                return Err(upper(format!(
                    "deleting Secret {}/{name}: {e}",
                    t.namespace
                )));
            }
        }
        let deadline = tokio::time::Instant::now() + leave_wait;
        while secrets
            .get_opt(name)
            .await
            .map_err(|e| upper(format!("reading Secret {}/{name}: {e}", t.namespace)))?
            .is_some()
        {
            if tokio::time::Instant::now() >= deadline {
                return Err(upper(format!(
                    "member Secret {}/{name} still there after {}s: the member has not left (is a virtual-node with --members-namespace {} running?); the lower identity is kept",
                    t.namespace,
                    leave_wait.as_secs(),
                    t.namespace
                )));
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        said.push(format!(
            "upper cluster {}: member {} left (node drained and deleted, its lower objects removed); Secret {}/{name} gone",
            t.upper_server, t.node, t.namespace
        ));
    }
    if ours.is_empty() {
        said.push(format!(
            "upper cluster {}: no member Secret for node {} in {}",
            t.upper_server, t.node, t.namespace
        ));
    }

    let lower = |e: String| format!("lower cluster {}: {e}", t.lower_server);
    let gone = |result: Result<(), kube::Error>, what: String| match result {
        Ok(_) => Ok(()),
        Err(e) if is_status(&e, 404) => Ok(()),
        Err(e) => Err(lower(format!("deleting {what}: {e}"))),
    };
    let bindings: Api<ClusterRoleBinding> = Api::all(t.lower.clone());
    let lower_secrets: Api<Secret> = Api::namespaced(t.lower.clone(), LOWER_NAMESPACE);
    let accounts: Api<ServiceAccount> = Api::namespaced(t.lower.clone(), LOWER_NAMESPACE);
    // This cluster's identity: its names, and whatever carries its labels (an identity of
    // the naming before that `join` adopted).
    let labelled = ListParams::default().labels(&identity_selector(&t.node, &t.upper_cluster));
    let list_error = |what: &str| {
        let what = what.to_owned();
        move |e: kube::Error| lower(format!("listing {what}: {e}"))
    };
    let mut doomed = Doomed::from(&identity);
    let labelled_names = |items: Vec<Option<String>>| items.into_iter().flatten();
    doomed.bindings.extend(labelled_names(
        bindings
            .list(&labelled)
            .await
            .map_err(list_error("ClusterRoleBindings"))?
            .items
            .into_iter()
            .map(|b| b.metadata.name)
            .collect(),
    ));
    doomed.secrets.extend(labelled_names(
        lower_secrets
            .list(&labelled)
            .await
            .map_err(list_error("Secrets"))?
            .items
            .into_iter()
            .map(|s| s.metadata.name)
            .collect(),
    ));
    doomed.accounts.extend(labelled_names(
        accounts
            .list(&labelled)
            .await
            .map_err(list_error("ServiceAccounts"))?
            .items
            .into_iter()
            .map(|a| a.metadata.name)
            .collect(),
    ));
    let legacy = LowerIdentity::legacy(&t.node);
    let legacy_token = lower_secrets
        .get_opt(&legacy.token_secret)
        .await
        .map_err(|e| {
            lower(format!(
                "reading Secret {LOWER_NAMESPACE}/{}: {e}",
                legacy.token_secret
            ))
        })?;
    let legacy_said = match &legacy_token {
        Some(secret) if holds_one_of(secret, &tokens) => {
            doomed.extend(Doomed::from(&legacy));
            format!(
                "; the identity of the naming before ({LOWER_NAMESPACE}/{}) was this cluster's: deleted",
                legacy.service_account
            )
        }
        Some(_) => format!(
            "; the identity of the naming before ({LOWER_NAMESPACE}/{}) kept: the member Secret did not hold its token (another upper cluster may use it; delete it there with `leave`)",
            legacy.service_account
        ),
        None => String::new(),
    };
    for name in &doomed.bindings {
        gone(
            bindings
                .delete(name, &DeleteParams::default())
                .await
                .map(|_| ()),
            format!("ClusterRoleBinding {name}"),
        )?;
    }
    for name in &doomed.secrets {
        gone(
            lower_secrets
                .delete(name, &DeleteParams::default())
                .await
                .map(|_| ()),
            format!("Secret {LOWER_NAMESPACE}/{name}"),
        )?;
    }
    for name in &doomed.accounts {
        gone(
            accounts
                .delete(name, &DeleteParams::default())
                .await
                .map(|_| ()),
            format!("ServiceAccount {LOWER_NAMESPACE}/{name}"),
        )?;
    }
    // The ClusterRole goes with its last binding (other members of other upper clusters
    // may share this lower cluster).
    let role_name = lower_cluster_role()?.metadata.name.unwrap_or_default();
    let still_bound = bindings
        .list(&ListParams::default())
        .await
        .map_err(|e| lower(format!("listing ClusterRoleBindings: {e}")))?
        .items
        .iter()
        .any(|b| b.role_ref.kind == "ClusterRole" && b.role_ref.name == role_name);
    if !still_bound {
        gone(
            Api::<ClusterRole>::all(t.lower.clone())
                .delete(&role_name, &DeleteParams::default())
                .await
                .map(|_| ()),
            format!("ClusterRole {role_name}"),
        )?;
    }
    said.push(format!(
        "lower cluster {}: ServiceAccount {LOWER_NAMESPACE}/{}, its token and binding deleted{}{}",
        t.lower_server,
        identity.service_account,
        legacy_said,
        if still_bound {
            format!("; ClusterRole {role_name} kept (still bound)")
        } else {
            format!("; ClusterRole {role_name} deleted (no binding left)")
        }
    ));
    Ok(said)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_lower_cluster_role_is_read() {
        let role = lower_cluster_role().unwrap();
        assert_eq!(
            role.metadata.name.as_deref(),
            Some("tensile-virtual-node-lower")
        );
        let rules = role.rules.unwrap_or_default();
        assert!(
            rules.iter().any(|r| r
                .resources
                .as_deref()
                .unwrap_or_default()
                .contains(&"pods".to_owned())
                && r.verbs.contains(&"create".to_owned())),
            "{rules:?}"
        );
    }

    fn admin(cluster: serde_json::Value) -> Kubeconfig {
        Kubeconfig::from_yaml(
            &serde_json::to_string(&json!({
                "apiVersion": "v1", "kind": "Config",
                "clusters": [{"name": "lower", "cluster": cluster}, {"name": "other", "cluster": {"server": "https://other"}}],
                "users": [{"name": "admin", "user": {"token": "admin-token"}}],
                "contexts": [{"name": "admin@lower", "context": {"cluster": "lower", "user": "admin"}}],
                "current-context": "admin@lower",
            }))
            .unwrap(),
        )
        .unwrap()
    }

    /// The member kubeconfig reaches the admin's cluster (its CA inlined) with the token
    /// alone; what is wrong with the admin's is named.
    #[test]
    fn the_member_kubeconfig_is_the_admins_cluster_and_the_token() {
        let no_file =
            |_: &Path| -> std::io::Result<Vec<u8>> { Err(std::io::ErrorKind::NotFound.into()) };
        let pem = |_: &Path| Ok(b"PEM".to_vec());
        let cases: [(serde_json::Value, Result<Option<&str>, &str>); 4] = [
            (
                json!({"server": "https://lower:6443", "certificate-authority-data": "Q0E="}),
                Ok(Some("Q0E=")),
            ),
            (
                json!({"server": "https://lower:6443", "certificate-authority": "/ca.crt"}),
                Ok(Some("UEVN")),
            ),
            (
                json!({"server": "https://lower:6443", "insecure-skip-tls-verify": true}),
                Ok(None),
            ),
            (
                json!({"certificate-authority-data": "Q0E="}),
                Err("has no server"),
            ),
        ];
        for (cluster, want) in cases {
            let file = cluster.get("certificate-authority").is_some();
            let made = if file {
                member_kubeconfig(&admin(cluster.clone()), "t0ken", "tensile-vk", pem)
            } else {
                member_kubeconfig(&admin(cluster.clone()), "t0ken", "tensile-vk", no_file)
            };
            match (made, want) {
                (Ok(text), Ok(ca)) => {
                    let parsed = Kubeconfig::from_yaml(&text).unwrap();
                    let c = parsed.clusters[0].cluster.clone().unwrap();
                    assert_eq!(c.server.as_deref(), Some("https://lower:6443"), "{cluster}");
                    assert_eq!(c.certificate_authority_data.as_deref(), ca, "{cluster}");
                    assert_eq!(c.certificate_authority, None);
                    assert_eq!(
                        parsed.auth_infos.len(),
                        1,
                        "the admin's user is not carried"
                    );
                    assert!(text.contains("t0ken") && !text.contains("admin-token"));
                    assert_eq!(parsed.current_context.as_deref(), Some("tensile-vk"));
                }
                (Err(error), Err(want)) => assert!(error.contains(want), "{error}"),
                (made, want) => panic!("{cluster}: {made:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn a_member_secret_is_labelled_and_names_its_node() {
        let secret = member_secret("vk-x", "members", "kubeconfig: text".into());
        let defaults = crate::member::spec::Defaults {
            taint: None,
            ignore_labels: Vec::new(),
            qps: 1.0,
            burst: 1,
        };
        let spec = crate::member::spec::read(&secret, &defaults).unwrap();
        assert_eq!(spec.node, "vk-x");
        assert_eq!(spec.kubeconfig, "kubeconfig: text");
    }
}
