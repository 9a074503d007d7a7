//! Upper identity (`--upper-identity`): the lower Secret of each offloaded pod that holds
//! the tokens the upper API server issued for the pod's upper ServiceAccount, bound to the
//! upper pod ([`crate::translate::identity`]). One Secret a pod, owned by the lower pod
//! (the lower cluster deletes it with the pod), renewed at 70 to 80 % of the tokens'
//! lifetime. Woken by the pod controller when it first sees a lower pod, by the renewal
//! time of each Secret, and by a full resync (which finds, after a restart, the Secrets
//! written before it). Nothing of a token is ever logged.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{
    BoundObjectReference, TokenRequest, TokenRequestSpec, TokenRequestStatus,
};
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, ServiceAccount};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use kube::runtime::reflector::ObjectRef;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use super::pod_watch::{PodQueue, PodStores, same_name};
use super::queue;
use super::{Context, Error, api_error};
use crate::api::is_status;
use crate::side::Side;
use crate::translate::TranslateError;
use crate::translate::identity::{
    CA_KEY, ROOT_CA_CONFIG_MAP, TOKEN_NODE_LABEL, TokenSecret, TokenSource, UpperApi,
    is_token_secret_of, renew_after, renewal_due, token_secret, token_secret_name, token_sources,
};
use crate::translate::pod::service_account_name;

/// Workers requesting tokens at once.
const WORKERS: u16 = 4;
/// How soon to look again at a Secret changed by someone else while it was written.
const CHANGED_MEANWHILE: Duration = Duration::from_secs(1);
/// How soon a token Secret written without the upper CA is written again.
const CA_MISSING: Duration = Duration::from_secs(5);
/// Reason of the Warning on an upper pod whose tokens could not be issued or stored.
const TOKEN_FAILED: &str = "UpperTokenFailed";

/// For each pod whose Secret is current: its lower pod's UID and when it is renewed.
type Due = HashMap<ObjectRef<Pod>, (Box<str>, Instant)>;

/// `--upper-identity` and what goes with it.
#[derive(Clone, Debug)]
pub struct UpperIdentity {
    /// `--upper-api-address`: where lower pods reach the upper API server.
    pub api: UpperApi,
    /// `--upper-token-max-age`: tokens are renewed at least this often.
    pub max_age: Option<Duration>,
}

/// The token controller's state, in the member's [`Context`].
#[derive(Debug)]
pub struct Tokens {
    /// The flags.
    pub identity: UpperIdentity,
    /// Upper pods (by namespace and name) whose Secret to look at.
    queue: Arc<PodQueue>,
    /// For each pod whose Secret is current: its lower pod's UID and when it is renewed (a
    /// wake-up is scheduled then). What is here costs no API call to look at again.
    due: Mutex<Due>,
}

impl Tokens {
    /// The state of a member running with `identity`.
    pub fn new(identity: UpperIdentity) -> Self {
        Self {
            identity,
            queue: Arc::default(),
            due: Mutex::default(),
        }
    }

    /// Looks at the token Secret of the upper pod `key` soon.
    pub(crate) fn wake(&self, key: ObjectRef<Pod>) {
        self.queue.add(key);
    }

    fn due(&self) -> std::sync::MutexGuard<'_, Due> {
        self.due.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Runs the token controller until `shutdown` (at once done without `--upper-identity`).
pub async fn run(
    ctx: Arc<Context>,
    stores: PodStores,
    resync: Duration,
    shutdown: CancellationToken,
) {
    let Some(tokens) = ctx.tokens.clone() else {
        return;
    };
    tokio::select! {
        () = shutdown.cancelled() => return,
        synced = stores.synced.wait() => if synced.is_err() { return },
    }
    let feed = async {
        loop {
            for pod in stores.lower.state() {
                tokens.wake(same_name(&pod));
            }
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = tokio::time::sleep(resync) => {}
            }
        }
    };
    let work = queue::work(&tokens.queue, WORKERS, &shutdown, |key| {
        let (ctx, stores, tokens) = (ctx.clone(), stores.clone(), tokens.clone());
        async move {
            let pod = format!(
                "{}/{}",
                key.namespace.as_deref().unwrap_or_default(),
                key.name
            );
            reconcile(&ctx, &stores, &tokens, &key, &pod)
                .instrument(info_span!("pod tokens", pod = %pod))
                .await
        }
    });
    futures::future::join(feed, work).await;
}

/// Makes the token Secret of the pod `key` current; when to look again.
async fn reconcile(
    ctx: &Context,
    stores: &PodStores,
    tokens: &Tokens,
    key: &ObjectRef<Pod>,
    pod: &str,
) -> Option<Duration> {
    let namespace = key.namespace.as_deref().unwrap_or_default();
    let Some(lower) = stores.lower.get(namespace, &key.name) else {
        // Gone, or not created yet: the pod controller wakes this pod when it sees the
        // lower pod.
        tokens.due().remove(key);
        return None;
    };
    let lower_uid: Box<str> = lower
        .meta
        .uid()
        .map(|uid| Box::from(&*uid))
        .unwrap_or_default();
    let now = Instant::now();
    if let Some((uid, at)) = tokens.due().get(key)
        && *uid == lower_uid
        && *at > now
    {
        // Current, and a wake-up is scheduled at its renewal.
        return None;
    }
    match ensure(ctx, tokens, key, &lower.to_pod(), pod).await {
        Ok(Some(after)) => {
            tokens.due().insert(key.clone(), (lower_uid, now + after));
            ctx.succeeded(&backoff_key(pod));
            Some(after)
        }
        Ok(None) => {
            tokens.due().remove(key);
            None
        }
        Err((error, upper)) => {
            ctx.metrics.reconcile_failed(error.metric_label());
            tracing::warn!(object = %pod, kind = "Pod", %error, "issuing the pod's upper tokens");
            if let Some(upper) = upper {
                ctx.warn_on(
                    &upper,
                    TOKEN_FAILED,
                    format!("the pod's upper ServiceAccount tokens: {error}"),
                )
                .await;
            }
            Some(ctx.backoff(&backoff_key(pod)))
        }
    }
}

/// The key under which failures back off, apart from the pod controller's.
fn backoff_key(pod: &str) -> String {
    format!("token:{pod}")
}

/// An error, and the upper pod to put a Warning on if it was read.
type Failure = (Error, Option<Pod>);

/// Reads the upper pod and the lower Secret, and writes new tokens if the Secret lacks
/// them or they are due; how long until they are. `None`: nothing to keep (the pod is gone,
/// or mounts no token).
async fn ensure(
    ctx: &Context,
    tokens: &Tokens,
    key: &ObjectRef<Pod>,
    lower: &Pod,
    pod: &str,
) -> Result<Option<Duration>, Failure> {
    let namespace = key.namespace.as_deref().unwrap_or_default();
    let upper_api: Api<Pod> = Api::namespaced(ctx.upper.clone(), namespace);
    // The whole pod (the store keeps a pruned one), as the API server has it now.
    let upper = upper_api
        .get_opt(&key.name)
        .await
        .map_err(|e| (api_error(Side::Upper, "reading", "Pod", pod)(e), None))?;
    let Some(upper) = upper.filter(|u| u.metadata.deletion_timestamp.is_none()) else {
        return Ok(None);
    };
    let fail = |e: Error| (e, Some(upper.clone()));
    let upper_uid = upper.metadata.uid.clone().unwrap_or_default();
    if crate::translate::pod::upper_uid(&lower.metadata) != Some(upper_uid.as_str()) {
        // Not this pod's copy (yet): the pod controller replaces it.
        return Ok(None);
    }
    // Node granularity: any of the member's virtual nodes is its own.
    let bound = upper.spec.as_ref().and_then(|s| s.node_name.as_deref());
    let node = bound
        .filter(|b| ctx.serves(Some(b)))
        .unwrap_or(&ctx.owner.node);
    if let Some(why) = not_ours(&upper, node, &ctx.namespace) {
        // The marks of a lower pod are anyone's to copy who may create pods below: only an
        // upper pod bound to this node (and within --namespace) gets tokens, as
        // NodeRestriction allows a kubelet only for its own pods.
        let forged = format!(
            "{}/{}",
            lower.namespace().unwrap_or_default(),
            lower.name_any()
        );
        warn!(object = %forged, kind = "Pod", cluster = "lower", upper_pod = %pod,
            node = %ctx.owner.node, "refused the upper tokens lower pod {forged} asks for by \
            its marks: upper pod {pod} {why}");
        return Ok(None);
    }
    let spec = upper.spec.as_ref().ok_or_else(|| {
        fail(Error::Translate(TranslateError::MissingField {
            kind: "Pod",
            object: pod.to_owned(),
            field: "spec",
        }))
    })?;
    let sources = token_sources(spec);
    if sources.is_empty() {
        return Ok(None);
    }
    let lower_uid = lower.metadata.uid.clone().unwrap_or_default();
    let lower_namespace = lower.namespace().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(ctx.lower.clone(), &lower_namespace);
    let name = token_secret_name(&lower.name_any());
    let secret_key = format!("{lower_namespace}/{name}");
    let existing = secrets
        .get_opt(&name)
        .await
        .map_err(|e| fail(api_error(Side::Lower, "reading", "Secret", &secret_key)(e)))?;
    if let Some(existing) = &existing {
        let ours = is_token_secret_of(existing, &lower_uid)
            || existing.labels().get(TOKEN_NODE_LABEL) == Some(&ctx.owner.node);
        if !ours {
            return Err(fail(Error::Taken {
                kind: "Secret",
                key: secret_key,
                node: ctx.owner.node.clone(),
            }));
        }
        if let Some(at) = is_token_secret_of(existing, &lower_uid)
            .then(|| renewal_due(existing, &upper_uid, &sources))
            .flatten()
            && let Some(after) = until(at)
        {
            return Ok(Some(after));
        }
    }

    let sa = service_account_name(spec);
    let mut issued = BTreeMap::new();
    let mut renew_in: Option<Duration> = None;
    for source in &sources {
        let (token, lifetime) = request_token(ctx, namespace, sa, &upper, source)
            .await
            .map_err(fail)?;
        let after = renew_after(lifetime, &upper_uid, tokens.identity.max_age);
        renew_in = Some(renew_in.map_or(after, |r| r.min(after)));
        issued.insert(source.key.clone(), token);
    }
    let ca = upper_ca(ctx, namespace).await.map_err(fail)?;
    let renew_in = match &ca {
        Some(_) => renew_in.unwrap_or_default(),
        // Not published in the namespace yet (the upper root-ca publisher writes it after
        // the namespace appears): the volume needs it, so look again soon, not at renewal.
        None => {
            warn!(pod = %pod, namespace = %namespace, "upper ConfigMap {ROOT_CA_CONFIG_MAP} \
                is missing: the token Secret is written without ca.crt and rewritten in {}s",
                CA_MISSING.as_secs());
            renew_in.unwrap_or_default().min(CA_MISSING)
        }
    };
    let renew_at = Timestamp::now()
        .checked_add(renew_in)
        .unwrap_or_else(|_| Timestamp::now());
    let mut secret = token_secret(TokenSecret {
        lower_pod: &lower.metadata,
        upper_uid: &upper_uid,
        upper_namespace: namespace,
        node: &ctx.owner.node,
        tokens: issued,
        ca,
        renew_at,
    });
    let written = match existing {
        None => secrets.create(&PostParams::default(), &secret).await,
        Some(existing) => {
            // Written over only while it is the Secret just read (its UID and version).
            secret.metadata.uid = existing.metadata.uid;
            secret.metadata.resource_version = existing.metadata.resource_version;
            secrets
                .replace(&name, &PostParams::default(), &secret)
                .await
        }
    };
    match written {
        Ok(_) => {
            info!(object = %secret_key, kind = "Secret", cluster = "lower", pod = %pod,
                renew_in = ?renew_in, "wrote the pod's upper tokens");
            Ok(Some(renew_in))
        }
        // Written or replaced meanwhile: look again soon.
        Err(e) if is_status(&e, 409) || is_status(&e, 404) => {
            debug!(object = %secret_key, kind = "Secret", cluster = "lower", "changed meanwhile");
            Ok(Some(CHANGED_MEANWHILE))
        }
        Err(e) => Err(fail(api_error(
            Side::Lower,
            "writing",
            "Secret",
            &secret_key,
        )(e))),
    }
}

/// Why the upper pod `upper` is not one of `node`'s to issue tokens for (`None`: it is):
/// not bound to `node`, or outside `namespace` (`--namespace`; empty: all).
fn not_ours(upper: &Pod, node: &str, namespace: &str) -> Option<String> {
    let bound = upper.spec.as_ref().and_then(|s| s.node_name.as_deref());
    if bound != Some(node) {
        return Some(match bound {
            Some(other) => format!("is bound to node {other}, not {node}"),
            None => format!("is bound to no node, not {node}"),
        });
    }
    let own = upper.namespace().unwrap_or_default();
    (!namespace.is_empty() && own != namespace)
        .then(|| format!("is in namespace {own}, outside --namespace {namespace}"))
}

/// How long until `at`; `None` once it has passed.
fn until(at: Timestamp) -> Option<Duration> {
    let left = at.duration_since(Timestamp::now());
    Duration::try_from(left).ok().filter(|d| !d.is_zero())
}

/// A token for the upper ServiceAccount `sa` in `namespace`, bound to `upper`, as `source`
/// asks for it; and how long it lives (at most what was asked: an API server that extends
/// tokens does not make them renewed later than the kubelet would).
async fn request_token(
    ctx: &Context,
    namespace: &str,
    sa: &str,
    upper: &Pod,
    source: &TokenSource,
) -> Result<(String, Duration), Error> {
    let object = format!("{namespace}/{sa}");
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: source.audience.clone().map(|a| vec![a]),
            expiration_seconds: Some(source.expiration_seconds),
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Pod".to_owned()),
                name: upper.metadata.name.clone(),
                uid: upper.metadata.uid.clone(),
            }),
        }),
        ..TokenRequest::default()
    };
    let accounts: Api<ServiceAccount> = Api::namespaced(ctx.upper.clone(), namespace);
    let issued: TokenRequest = accounts
        .create_subresource("token", sa, &PostParams::default(), &request)
        .await
        .map_err(api_error(
            Side::Upper,
            "requesting a token for",
            "ServiceAccount",
            &object,
        ))?;
    let Some(TokenRequestStatus {
        token: Some(token),
        expiration_timestamp,
    }) = issued.status
    else {
        return Err(Error::Translate(TranslateError::MissingField {
            kind: "TokenRequest",
            object: object.clone(),
            field: "status.token",
        }));
    };
    let asked = Duration::from_secs(u64::try_from(source.expiration_seconds).unwrap_or(0));
    let lifetime = expiration_timestamp
        .and_then(|at| Duration::try_from(at.0.duration_since(Timestamp::now())).ok())
        .map_or(asked, |left| left.min(asked));
    Ok((token, lifetime))
}

/// The upper cluster's CA bundle as it publishes it in `namespace` (`None` if it does not).
async fn upper_ca(ctx: &Context, namespace: &str) -> Result<Option<String>, Error> {
    let config_maps: Api<ConfigMap> = Api::namespaced(ctx.upper.clone(), namespace);
    let ca = config_maps
        .get_opt(ROOT_CA_CONFIG_MAP)
        .await
        .map_err(api_error(
            Side::Upper,
            "reading",
            "ConfigMap",
            &format!("{namespace}/{ROOT_CA_CONFIG_MAP}"),
        ))?;
    Ok(ca.and_then(|c| c.data).and_then(|mut d| d.remove(CA_KEY)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(namespace: &str, node: Option<&str>) -> Pod {
        let mut pod = Pod::default();
        pod.metadata.name = Some("p".into());
        pod.metadata.namespace = Some(namespace.into());
        pod.spec = Some(k8s_openapi::api::core::v1::PodSpec {
            node_name: node.map(str::to_owned),
            ..Default::default()
        });
        pod
    }

    #[test]
    fn tokens_only_for_upper_pods_bound_to_this_node_in_scope() {
        // (case, upper pod, --namespace, refused because)
        let cases = [
            ("bound here", pod("a", Some("vk")), "", None),
            (
                "bound here, in --namespace",
                pod("a", Some("vk")),
                "a",
                None,
            ),
            (
                "on a real node",
                pod("a", Some("worker-1")),
                "",
                Some("is bound to node worker-1, not vk"),
            ),
            (
                "not scheduled",
                pod("a", None),
                "",
                Some("is bound to no node, not vk"),
            ),
            (
                "outside --namespace",
                pod("b", Some("vk")),
                "a",
                Some("is in namespace b, outside --namespace a"),
            ),
        ];
        for (case, upper, namespace, want) in cases {
            assert_eq!(not_ours(&upper, "vk", namespace).as_deref(), want, "{case}");
        }
    }
}
