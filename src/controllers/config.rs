//! ConfigMaps and Secrets that tensile copied down for pods (see `dependencies`) are kept
//! equal to their upper originals: an upper edit reaches the copy within a second, an
//! edit made below is undone, deleting the original deletes the copy, and a copy that no
//! pod references any more is removed. Always on.
//!
//! What it watches, and why it is cheap on a big upper cluster: the copies below (label
//! selected: only what this node made, with their data), and the upper kind through a
//! *metadata-only* watch folded into a [`MetaIndex`] of UIDs and resourceVersions — not
//! every Secret's data. Each copy records the upper version it was made from and a hash
//! of its content, so a reconcile compares in memory and reads the upper original only
//! when it changed. A restart costs two lists and no write for copies in step.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kube::api::{Api, ListParams, PostParams};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::dependencies::ensure;
use super::pod_watch::PodStores;
use super::queue::{self, WorkQueue};
use super::references::References;
use super::stores::{
    MetaIndex, ObjectStream, Ready, Reflected, every, indexed, log_outcome, reflected,
};
use super::write_budget::{WriteBudget, upper_version};
use super::{Context, Error, api_error};
use crate::api::{Deleted, Replaced, delete_exact, is_status, replace_exact};
use crate::side::Side;
use crate::translate::TranslateError;
use crate::translate::config::{
    Copied, CopyState, Reference, SYSTEM_NAMESPACE, copy_state, holds, kind_of, referenced,
    replacement, stamped_copy,
};
use crate::translate::deps::{Dependency, DependencyKind};
use crate::translate::meta::Owner;
use crate::translate::pod::is_owned_by;
use crate::upper_watches::{SharedIndex, UpperWatches};

/// How often unreferenced copies are looked for (in memory).
const SWEEP_INTERVAL: Duration = Duration::from_secs(5);
/// How long a copy stays unreferenced before it is removed, so a pod replaced under the
/// same references (a rollout) does not make it go and come back.
const UNREFERENCED_GRACE: Duration = Duration::from_secs(10);

/// A kind this controller keeps in step.
pub trait Kept:
    Copied
    + Resource<DynamicType = (), Scope = NamespaceResourceScope>
    + Clone
    + Debug
    + Serialize
    + DeserializeOwned
    + Send
    + Sync
    + 'static
{
    /// The upper index of this kind a federated process's members share.
    fn shared(watches: &UpperWatches) -> &SharedIndex<Self>;
}
impl Kept for ConfigMap {
    fn shared(watches: &UpperWatches) -> &SharedIndex<Self> {
        &watches.config_maps
    }
}
impl Kept for Secret {
    fn shared(watches: &UpperWatches) -> &SharedIndex<Self> {
        &watches.secrets
    }
}

/// The watches of one kind.
struct KindWatches<K: Kept> {
    lower: Reflected<K>,
    index: Arc<MetaIndex>,
    upper: ObjectStream<PartialObjectMeta<K>>,
}

/// The controller's watches, set up before it runs.
pub struct ConfigWatches {
    config_maps: KindWatches<ConfigMap>,
    secrets: KindWatches<Secret>,
    /// Ready once every watch has listed.
    pub ready: Ready,
}

fn kind_watches<K: Kept>(ctx: &Context) -> (KindWatches<K>, Ready) {
    let lower = reflected(
        Api::<K>::all(ctx.lower.clone()),
        Side::Lower,
        watcher::Config::default().labels(&ctx.owner.selector()),
        None,
    );
    let (index, upper, upper_ready) = match &ctx.upper_watches {
        Some(shared) => K::shared(shared).subscribe(),
        None => {
            let index = Arc::new(MetaIndex::default());
            let upper_api: Api<PartialObjectMeta<K>> = if ctx.namespace.is_empty() {
                Api::all(ctx.upper.clone())
            } else {
                Api::namespaced(ctx.upper.clone(), &ctx.namespace)
            };
            let (upper, upper_ready) = indexed(
                upper_api,
                Side::Upper,
                watcher::Config::default(),
                index.clone(),
            );
            (index, upper, upper_ready)
        }
    };
    let copies = lower.store.clone();
    let kind = match K::DEPENDENCY {
        DependencyKind::Secret => "secrets",
        _ => "configmaps",
    };
    ctx.metrics
        .count_mirrored(&ctx.owner.node, kind, move || copies.state().len());
    let ready = lower.ready.clone().and(&upper_ready);
    (
        KindWatches {
            lower,
            index,
            upper,
        },
        ready,
    )
}

/// Sets up the watches: copies below labelled as this node's, upper ConfigMaps and
/// Secrets metadata-only (in `--namespace` if given).
pub fn watches(ctx: &Context) -> ConfigWatches {
    let (config_maps, cm_ready) = kind_watches::<ConfigMap>(ctx);
    let (secrets, secret_ready) = kind_watches::<Secret>(ctx);
    ConfigWatches {
        config_maps,
        secrets,
        ready: cm_ready.and(&secret_ready),
    }
}

/// Runs until `shutdown`: one controller per kind, and the removal of unreferenced copies.
pub async fn run(
    ctx: Arc<Context>,
    watches: ConfigWatches,
    pods: PodStores,
    resync: Duration,
    shutdown: CancellationToken,
) {
    let ConfigWatches {
        config_maps,
        secrets,
        ready,
    } = watches;
    let sweep = remove_unreferenced(
        ctx.clone(),
        config_maps.lower.store.clone(),
        secrets.lower.store.clone(),
        pods,
        ready.clone(),
        shutdown.clone(),
    );
    tokio::join!(
        control(
            ctx.clone(),
            config_maps,
            ready.clone(),
            resync,
            shutdown.clone()
        ),
        control(ctx.clone(), secrets, ready, resync, shutdown.clone()),
        sweep,
    );
}

struct KindContext {
    ctx: Arc<Context>,
    index: Arc<MetaIndex>,
    ready: Ready,
    /// How often each copy may be rewritten while something below keeps editing it.
    budget: Mutex<WriteBudget>,
}

async fn control<K: Kept>(
    ctx: Arc<Context>,
    watches: KindWatches<K>,
    ready: Ready,
    resync: Duration,
    shutdown: CancellationToken,
) {
    let KindWatches {
        lower,
        index,
        upper,
    } = watches;
    let copies = lower.store.clone();
    let missing = Arc::new(WorkQueue::<(String, String)>::default());
    let (wanted, present, references) = (missing.clone(), index.clone(), ctx.clone());
    // An upper event wakes the copy of the same name, if there is one; an original that
    // has none and that a pod of this node references (an optional one created after the
    // pod, or created again) is queued to be copied. The rest of the upper cluster's
    // objects cost nothing past the index.
    let wake_copy = move |original: PartialObjectMeta<K>| {
        let name = original.metadata.name?;
        let namespace = original.metadata.namespace?;
        let copy = ObjectRef::<K>::new(&name).within(&namespace);
        if copies.get(&copy).is_some() {
            return Some(copy);
        }
        let reference = (K::DEPENDENCY, namespace, name);
        if present.get(&reference.1, &reference.2).is_some()
            && references.references.references(&reference)
        {
            wanted.add((reference.1, reference.2));
        }
        None
    };
    let kc = Arc::new(KindContext {
        ctx,
        index,
        ready,
        budget: Mutex::default(),
    });
    let copy_missing = queue::work(&missing, 1, &shutdown, |(namespace, name)| {
        let kc = kc.clone();
        async move { copy_referenced::<K>(&kc, &namespace, &name).await }
    });
    let controller = Controller::for_stream(lower.stream, lower.store)
        .watches_stream(upper, wake_copy)
        .reconcile_all_on(every(resync))
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(reconcile::<K>, error_policy::<K>, kc.clone())
        .for_each(|result| log_outcome("copy reconcile", result));
    tokio::join!(controller, copy_missing);
}

/// Copies the upper `namespace/name` of kind `K` below while a pod of this node references
/// it and no copy exists (the pods' dependency check makes copies only when a pod is
/// created below: one referenced optionally may appear later, as a kubelet would then
/// project it). When to try again, after a failure.
async fn copy_referenced<K: Kept>(
    kc: &KindContext,
    namespace: &str,
    name: &str,
) -> Option<Duration> {
    let ctx = &kc.ctx;
    let kind = kind_of(K::DEPENDENCY);
    let key = format!("{namespace}/{name}");
    let backoff_key = format!("create:{kind}/{key}");
    if kc.ready.wait().await.is_err() {
        return None;
    }
    let reference = (K::DEPENDENCY, namespace.to_owned(), name.to_owned());
    if !ctx.references.references(&reference) {
        return None;
    }
    let dependency = Dependency {
        kind: K::DEPENDENCY,
        name: name.to_owned(),
        optional: true,
    };
    match ensure::<K>(ctx, namespace, &dependency, stamped_copy).await {
        Ok(_) => {
            ctx.succeeded(&backoff_key);
            None
        }
        // Never mirrored (a service-account token Secret): the pods' own step reports it.
        Err(error @ Error::Translate(_)) => {
            debug!(object = %key, kind, cluster = "upper", %error, "not copied");
            None
        }
        Err(error) => {
            ctx.metrics.reconcile_failed(error.metric_label());
            warn!(object = %key, kind, cluster = "lower", %error,
                "copying a referenced original that appeared upstairs; retrying with backoff");
            Some(ctx.backoff(&backoff_key))
        }
    }
}

fn backoff_key<K: Kept>(copy: &K) -> String {
    format!(
        "{}/{}/{}",
        kind_of(K::DEPENDENCY),
        copy.namespace().unwrap_or_default(),
        copy.name_any()
    )
}

async fn reconcile<K: Kept>(copy: Arc<K>, kc: Arc<KindContext>) -> Result<Action, Error> {
    kc.ready.wait().await?;
    let ctx = &kc.ctx;
    let started = Instant::now();
    let result = keep_in_step(&*copy, &kc).await;
    let controller = match K::DEPENDENCY {
        DependencyKind::Secret => "secret",
        _ => "config",
    };
    ctx.metrics.reconciled(controller, started.elapsed());
    if result.is_ok() {
        ctx.succeeded(&backoff_key(&*copy));
    }
    result
}

async fn keep_in_step<K: Kept>(copy: &K, kc: &KindContext) -> Result<Action, Error> {
    let ctx = &kc.ctx;
    let kind = kind_of(K::DEPENDENCY);
    let namespace = copy.namespace().unwrap_or_default();
    let name = copy.name_any();
    let key = format!("{namespace}/{name}");
    if namespace == SYSTEM_NAMESPACE
        || !is_owned_by(copy.meta(), &ctx.owner)
        || copy.meta().deletion_timestamp.is_some()
    {
        return Ok(Action::await_change());
    }
    if copy_state(copy, kc.index.get(&namespace, &name).as_ref()) == CopyState::InStep {
        return Ok(Action::await_change());
    }
    // The index says the original changed (or seems gone: it may lag an original created
    // a moment ago); read it to know.
    let upper_api: Api<K> = Api::namespaced(ctx.upper.clone(), &namespace);
    let lower_api: Api<K> = Api::namespaced(ctx.lower.clone(), &namespace);
    let original =
        upper_api
            .get_opt(&name)
            .await
            .map_err(api_error(Side::Upper, "reading", kind, &key))?;
    let Some(original) = original else {
        delete_copy(ctx, &lower_api, copy, "its upper original was deleted").await?;
        return Ok(Action::await_change());
    };
    let desired = match stamped_copy(&original, &ctx.owner) {
        Ok(desired) => desired,
        Err(error @ TranslateError::NotMirrored { .. }) => {
            warn!(object = %key, kind, cluster = "upper", %error, "deleting the lower copy");
            ctx.warn_on(&original, "NotMirrored", error.to_string())
                .await;
            delete_copy(
                ctx,
                &lower_api,
                copy,
                "its upper original may not be mirrored",
            )
            .await?;
            return Ok(Action::await_change());
        }
        Err(error) => return Err(error.into()),
    };
    if holds(copy, &desired) {
        return Ok(Action::await_change());
    }
    let source = upper_version(original.meta());
    if let Some(wait) = ctx
        .copy_write_delay(&kc.budget, kind, &key, &source, &original.object_ref(&()))
        .await
    {
        return Ok(Action::requeue(wait));
    }
    match replace_exact(&lower_api, &name, &replacement(copy, desired.clone())).await {
        Ok(Replaced::Now) => {
            info!(object = %key, kind, cluster = "lower", "updated the copy from its upper original");
            Ok(Action::await_change())
        }
        // Changed meanwhile (or our store lags our own write): again on the newer copy,
        // within the copy's write budget.
        Ok(Replaced::Conflict) => Ok(Action::requeue(Duration::from_millis(200))),
        Ok(Replaced::Gone) => Ok(Action::await_change()),
        // A field that cannot change in place (an immutable ConfigMap's data, a Secret's
        // type): make the copy anew.
        Err(e) if is_status(&e, 422) => {
            debug!(object = %key, kind, cluster = "lower", error = %e, "update refused; re-creating the copy");
            delete_copy(ctx, &lower_api, copy, "it cannot be updated in place").await?;
            match lower_api.create(&PostParams::default(), &desired).await {
                Ok(_) => {
                    info!(object = %key, kind, cluster = "lower", "re-created the copy from its upper original");
                    Ok(Action::await_change())
                }
                // The pods' dependency check creates it too; either copy is right.
                Err(e) if is_status(&e, 409) => Ok(Action::await_change()),
                Err(e) => {
                    let error = api_error(Side::Lower, "re-creating", kind, &key)(e);
                    ctx.warn_on(&original, "LowerSyncFailed", error.to_string())
                        .await;
                    Err(error)
                }
            }
        }
        Err(e) => {
            let error = api_error(Side::Lower, "updating", kind, &key)(e);
            warn!(object = %key, kind, cluster = "lower", %error, "keeping the copy in step");
            ctx.warn_on(&original, "LowerSyncFailed", error.to_string())
                .await;
            Err(error)
        }
    }
}

/// Deletes a copy (only the one seen: UID precondition) and drops it from the presence
/// cache, so the next pod needing it makes it again.
async fn delete_copy<K: Kept>(
    ctx: &Context,
    api: &Api<K>,
    copy: &K,
    why: &str,
) -> Result<(), Error> {
    let kind = kind_of(K::DEPENDENCY);
    let namespace = copy.namespace().unwrap_or_default();
    let name = copy.name_any();
    let key = format!("{namespace}/{name}");
    let result = delete_exact(api, &name, copy.meta().uid.clone(), None).await;
    ctx.known_present.forget(kind, &namespace, &name);
    if result.map_err(api_error(Side::Lower, "deleting", kind, &key))? == Deleted::Now {
        info!(object = %key, kind, cluster = "lower", why, "deleted the copy");
    }
    Ok(())
}

fn error_policy<K: Kept>(copy: Arc<K>, _error: &Error, kc: Arc<KindContext>) -> Action {
    Action::requeue(kc.ctx.backoff(&backoff_key(&*copy)))
}

/// [`References::resolve`] over the pods in the two stores.
fn resolve(references: &References, pods: &PodStores) -> (BTreeSet<Reference>, BTreeSet<String>) {
    let (upper, lower) = (pods.upper.state(), pods.lower.state());
    let listed = upper
        .iter()
        .chain(lower.iter())
        .map(|p| (&*p.meta.namespace, p.meta.name()));
    let is_present = |namespace: &str, name: &str| {
        pods.upper.get(namespace, name).is_some() || pods.lower.get(namespace, name).is_some()
    };
    references.resolve(listed, is_present)
}

/// A copy that may go: what it is and which one (UID).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Unreferenced {
    reference: Reference,
    uid: Option<String>,
}

/// Copies in `store` that are this node's, outside kube-system, not going, and not in
/// `referenced`.
fn unreferenced<K: Kept>(
    store: &Store<K>,
    referenced: &BTreeSet<Reference>,
    owner: &Owner,
) -> Vec<Unreferenced> {
    store
        .state()
        .iter()
        .filter(|c| is_owned_by(c.meta(), owner) && c.meta().deletion_timestamp.is_none())
        .filter_map(|c| {
            let namespace = c.namespace()?;
            let reference = (K::DEPENDENCY, namespace, c.name_any());
            (reference.1 != SYSTEM_NAMESPACE && !referenced.contains(&reference)).then(|| {
                Unreferenced {
                    reference,
                    uid: c.meta().uid.clone(),
                }
            })
        })
        .collect()
}

/// Every few seconds: copies referenced by no pod of this node (upper pods bound to it,
/// lower pods it owns) for [`UNREFERENCED_GRACE`], and by no pod at all in their lower
/// namespace (another virtual node sharing the lower cluster may use a copy this one made),
/// are deleted.
async fn remove_unreferenced(
    ctx: Arc<Context>,
    config_maps: Store<ConfigMap>,
    secrets: Store<Secret>,
    pods: PodStores,
    ready: Ready,
    shutdown: CancellationToken,
) {
    let synced = async {
        ready.wait().await?;
        pods.synced.wait().await
    };
    tokio::select! {
        () = shutdown.cancelled() => return,
        synced = synced => if synced.is_err() { return },
    }
    let mut since: HashMap<Reference, Instant> = HashMap::new();
    // Copies a pod came to reference while they were being deleted, whose re-creation
    // failed: tried again each round while a pod references them.
    let mut to_restore: BTreeSet<Reference> = BTreeSet::new();
    let mut tick = tokio::time::interval(SWEEP_INTERVAL);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let retried = std::mem::take(&mut to_restore);
        for reference in retried {
            if ctx.references.references(&reference)
                && let Err(error) = restore_copy(&ctx, &reference).await
            {
                warn!(%error, namespace = %reference.1, cluster = "lower", "re-creating a copy a pod references");
                to_restore.insert(reference);
            }
        }
        let (referenced, _) = resolve(&ctx.references, &pods);
        let mut candidates = unreferenced(&config_maps, &referenced, &ctx.owner);
        candidates.extend(unreferenced(&secrets, &referenced, &ctx.owner));
        let now = Instant::now();
        since.retain(|reference, _| candidates.iter().any(|c| &c.reference == reference));
        let mut due: BTreeMap<String, Vec<Unreferenced>> = BTreeMap::new();
        for candidate in candidates {
            let first = *since.entry(candidate.reference.clone()).or_insert(now);
            if now.duration_since(first) >= UNREFERENCED_GRACE {
                due.entry(candidate.reference.1.clone())
                    .or_default()
                    .push(candidate);
            }
        }
        for (namespace, copies) in due {
            if let Err(error) = remove_in(&ctx, &pods, &namespace, copies, &mut to_restore).await {
                warn!(%error, namespace, cluster = "lower", "removing unreferenced copies");
            }
        }
    }
}

/// Deletes `copies` in `namespace` unless a pod references them: any lower pod there
/// (listed now; this node's teach [`References`] what they use), or a pod of this node
/// (looked up again just before). While a pod of this node there has unknown references
/// (an upper pod not yet mirrored since a restart), nothing there goes. A copy whose
/// re-creation ([`sweep`]) failed is added to `to_restore`.
async fn remove_in(
    ctx: &Context,
    pods: &PodStores,
    namespace: &str,
    copies: Vec<Unreferenced>,
    to_restore: &mut BTreeSet<Reference>,
) -> Result<(), Error> {
    let all_pods: Api<Pod> = Api::namespaced(ctx.lower.clone(), namespace);
    let in_namespace = all_pods
        .list(&ListParams::default())
        .await
        .map_err(api_error(Side::Lower, "listing", "Pod", namespace))?;
    for pod in &in_namespace.items {
        if is_owned_by(&pod.metadata, &ctx.owner) {
            ctx.references.record(pod, ctx.with_service_account);
        }
    }
    let used_below = referenced(&in_namespace.items, ctx.with_service_account);
    let (used_here, unknown) = resolve(&ctx.references, pods);
    if unknown.contains(namespace) {
        debug!(
            namespace,
            "a pod's references are not known yet; removing nothing there"
        );
        return Ok(());
    }
    let copies = copies.into_iter().filter(|copy| {
        !used_below.contains(&copy.reference) && !used_here.contains(&copy.reference)
    });
    let outcome = sweep(
        &ctx.references,
        copies,
        |copy| delete_unreferenced(ctx, copy),
        |copy| async move { restore_copy(ctx, &copy.reference).await },
    )
    .await;
    to_restore.extend(outcome.unrestored);
    outcome.result
}

/// What [`sweep`] did.
struct Swept {
    /// The first failure, which ended the sweep.
    result: Result<(), Error>,
    /// Copies a pod came to reference while they were being deleted, that could not be
    /// made again.
    unrestored: Vec<Reference>,
}

/// Deletes each of `copies` in turn unless a pod came to reference it since they were
/// resolved (a pod ensured meanwhile records its references in `references` before it
/// checks that its copies exist). Checked again after each delete: a pod that came to
/// reference the copy while it was being deleted may have found it still there and been
/// created without it (its pod would wait for it in ContainerCreating), so it is made
/// again (`restore`). Stops at the first failed delete.
async fn sweep<D, DF, R, RF>(
    references: &References,
    copies: impl IntoIterator<Item = Unreferenced>,
    mut delete: D,
    mut restore: R,
) -> Swept
where
    D: FnMut(Unreferenced) -> DF,
    DF: Future<Output = Result<(), Error>>,
    R: FnMut(Unreferenced) -> RF,
    RF: Future<Output = Result<(), Error>>,
{
    let mut unrestored = Vec::new();
    for copy in copies {
        if references.references(&copy.reference) {
            let (_, namespace, name) = &copy.reference;
            debug!(object = %format!("{namespace}/{name}"), kind = kind_of(copy.reference.0),
                cluster = "lower", "a pod references the copy now; kept");
            continue;
        }
        if let Err(error) = delete(copy.clone()).await {
            return Swept {
                result: Err(error),
                unrestored,
            };
        }
        if references.references(&copy.reference) {
            let reference = copy.reference.clone();
            if let Err(error) = restore(copy).await {
                warn!(%error, namespace = %reference.1, cluster = "lower",
                    "re-creating a copy a pod came to reference while it was deleted");
                unrestored.push(reference);
            }
        }
    }
    Swept {
        result: Ok(()),
        unrestored,
    }
}

/// Deletes one unreferenced copy (only that one: its UID as a precondition) and drops it
/// from the presence cache.
async fn delete_unreferenced(ctx: &Context, copy: Unreferenced) -> Result<(), Error> {
    let (kind, namespace, name) = &copy.reference;
    let key = format!("{namespace}/{name}");
    let kind_name = kind_of(*kind);
    let uid = copy.uid.clone();
    let result = match kind {
        DependencyKind::ConfigMap => {
            let api = Api::<ConfigMap>::namespaced(ctx.lower.clone(), namespace);
            delete_exact(&api, name, uid, None).await
        }
        _ => {
            let api = Api::<Secret>::namespaced(ctx.lower.clone(), namespace);
            delete_exact(&api, name, uid, None).await
        }
    };
    ctx.known_present.forget(kind_name, namespace, name);
    if result.map_err(api_error(Side::Lower, "deleting", kind_name, &key))? == Deleted::Now {
        info!(object = %key, kind = kind_name, cluster = "lower",
            "deleted a copy no pod references any more");
    }
    Ok(())
}

/// Makes the copy `reference` names again from its upper original (if there is one).
async fn restore_copy(ctx: &Context, reference: &Reference) -> Result<(), Error> {
    match reference.0 {
        DependencyKind::ConfigMap => restore::<ConfigMap>(ctx, &reference.1, &reference.2).await,
        _ => restore::<Secret>(ctx, &reference.1, &reference.2).await,
    }
}

async fn restore<K: Kept>(ctx: &Context, namespace: &str, name: &str) -> Result<(), Error> {
    let kind = kind_of(K::DEPENDENCY);
    let key = format!("{namespace}/{name}");
    let upper_api: Api<K> = Api::namespaced(ctx.upper.clone(), namespace);
    let Some(original) =
        upper_api
            .get_opt(name)
            .await
            .map_err(api_error(Side::Upper, "reading", kind, &key))?
    else {
        return Ok(());
    };
    let copy = stamped_copy(&original, &ctx.owner)?;
    let lower_api: Api<K> = Api::namespaced(ctx.lower.clone(), namespace);
    match lower_api.create(&PostParams::default(), &copy).await {
        Ok(_) => {
            info!(object = %key, kind, cluster = "lower",
                "a pod came to reference the copy while it was deleted; made it again");
            Ok(())
        }
        Err(e) if is_status(&e, 409) => Ok(()),
        Err(e) => Err(api_error(Side::Lower, "re-creating", kind, &key)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tokio::sync::oneshot;

    fn copy(name: &str) -> Unreferenced {
        Unreferenced {
            reference: (DependencyKind::ConfigMap, "ns".to_owned(), name.to_owned()),
            uid: Some(format!("uid-{name}")),
        }
    }

    /// A pod of `ns` that mounts the ConfigMap `config_map`.
    fn pod(name: &str, config_map: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"containers": [{"name": "c", "image": "i"}],
                     "volumes": [{"name": "v", "configMap": {"name": config_map}}]},
        }))
        .unwrap()
    }

    /// The first DELETE is held; meanwhile a pod that references the second copy is
    /// ensured (its references recorded); once the DELETE is let through, the second copy
    /// is kept.
    #[tokio::test]
    async fn a_pod_ensured_while_a_delete_is_held_keeps_its_copy() {
        let references = References::default();
        let (held_tx, held_rx) = oneshot::channel::<()>();
        let (release_tx, release_rx) = oneshot::channel::<()>();
        let deleted = Mutex::new(Vec::new());
        let restored = Mutex::new(Vec::new());
        let mut held = Some((held_tx, release_rx));
        let sweeping = sweep(
            &references,
            [copy("first"), copy("second")],
            |c| {
                let hold = held.take();
                let deleted = &deleted;
                async move {
                    if let Some((held, release)) = hold {
                        held.send(()).unwrap();
                        release.await.unwrap();
                    }
                    deleted.lock().unwrap().push(c.reference.2);
                    Ok(())
                }
            },
            |c| {
                restored.lock().unwrap().push(c.reference.2);
                async { Ok(()) }
            },
        );
        let pod_ensured = async {
            held_rx.await.unwrap();
            references.record(&pod("new", "second"), true);
            release_tx.send(()).unwrap();
        };
        let (swept, ()) = tokio::join!(sweeping, pod_ensured);
        swept.result.unwrap();
        assert_eq!(*deleted.lock().unwrap(), ["first"]);
        assert!(restored.lock().unwrap().is_empty());
        assert!(swept.unrestored.is_empty());
    }

    /// A pod that comes to reference a copy while its DELETE is on the wire (it may have
    /// found the copy still there) gets the copy made again; one whose re-creation fails is
    /// handed back to be tried again.
    #[tokio::test]
    async fn a_pod_ensured_during_the_delete_gets_its_copy_again() {
        for restore_fails in [false, true] {
            let references = References::default();
            let deleted = Mutex::new(Vec::new());
            let restored = Mutex::new(Vec::new());
            let swept = sweep(
                &references,
                [copy("first"), copy("second")],
                |c| {
                    if c.reference.2 == "first" {
                        references.record(&pod("new", "first"), true);
                    }
                    deleted.lock().unwrap().push(c.reference.2);
                    async { Ok(()) }
                },
                |c| {
                    restored.lock().unwrap().push(c.reference.2);
                    async move {
                        if restore_fails {
                            Err(Error::Conflict {
                                key: "ns/first".into(),
                                node: "vk".into(),
                            })
                        } else {
                            Ok(())
                        }
                    }
                },
            )
            .await;
            swept.result.unwrap();
            assert_eq!(*deleted.lock().unwrap(), ["first", "second"]);
            assert_eq!(*restored.lock().unwrap(), ["first"]);
            let want: Vec<Reference> = if restore_fails {
                vec![copy("first").reference]
            } else {
                vec![]
            };
            assert_eq!(swept.unrestored, want, "restore fails: {restore_fails}");
        }
    }
}
