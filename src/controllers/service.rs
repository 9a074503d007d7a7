//! `ServiceControllers`: upper Services (outside kube-system, `default/kubernetes` aside)
//! are mirrored down, with their EndpointSlices and Endpoints, so that a pod in the lower
//! cluster resolves and reaches them on a flat network. One level-triggered controller
//! per kind, keyed by the upper object and reading reflector stores; copies whose
//! original is gone are deleted at once on the deletion event and every
//! [`SWEEP_INTERVAL`] (for deletions missed while down).
//!
//! Two virtual nodes sharing both clusters both see every Service: the first to create a
//! copy owns it and keeps it in step; the other leaves it alone without a warning (same
//! upper UID). A lower Service of that name that tensile did not make is never touched
//! (Warning event on the upper Service).

use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::channel::mpsc;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{Endpoints, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::dependencies::ensure_namespace;
use super::stores::{Ready, Reflected, every, log_outcome, reflected, tick_or_wake};
use super::write_budget::{WriteBudget, upper_version};
use super::{Context, Error, api_error};
use crate::api::{Deleted, Replaced, delete_exact, is_status, replace_exact};
use crate::side::Side;
use crate::translate::TranslateError;
use crate::translate::meta::OWNER_NODE_LABEL;
use crate::translate::pod::{is_owned_by, upper_uid};
use crate::translate::service::{
    SERVICE_NAME_LABEL, Update, endpoint_slice_update, endpoints_update, is_mirrored_service,
    lower_endpoint_slice, lower_endpoints, lower_service, service_update,
};

/// How often copies are compared with their originals to delete orphans (in memory).
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(30);
/// How long before a copy that another virtual node owns, or that is not tensile's, is
/// looked at again.
const FOREIGN_RECHECK: Duration = Duration::from_secs(300);

/// The watches of the Service controllers.
pub struct ServiceWatches {
    upper_services: Reflected<Service>,
    lower_services: Reflected<Service>,
    upper_slices: Reflected<EndpointSlice>,
    lower_slices: Reflected<EndpointSlice>,
    upper_endpoints: Reflected<Endpoints>,
    lower_endpoints: Reflected<Endpoints>,
    deleted: Arc<Notify>,
    /// Ready once every watch has listed.
    pub ready: Ready,
}

/// Sets up the watches: upper Services, EndpointSlices and Endpoints (in `--namespace` if
/// given), and their copies below labelled as this node's.
pub fn watches(ctx: &Context) -> ServiceWatches {
    let deleted = Arc::new(Notify::new());
    let ours = || watcher::Config::default().labels(&ctx.owner.selector());
    fn upper_api<K>(ctx: &Context) -> Api<K>
    where
        K: Resource<DynamicType = (), Scope = NamespaceResourceScope>,
    {
        if ctx.namespace.is_empty() {
            Api::all(ctx.upper.clone())
        } else {
            Api::namespaced(ctx.upper.clone(), &ctx.namespace)
        }
    }
    let (upper_services, upper_slices, upper_endpoints) = match ctx
        .upper_watches
        .as_ref()
        .and_then(|shared| shared.services.as_ref())
    {
        Some(shared) => (
            shared.services.subscribe(Some(deleted.clone())),
            shared.slices.subscribe(Some(deleted.clone())),
            shared.endpoints.subscribe(Some(deleted.clone())),
        ),
        None => (
            reflected(
                upper_api(ctx),
                Side::Upper,
                Default::default(),
                Some(deleted.clone()),
            ),
            reflected(
                upper_api(ctx),
                Side::Upper,
                Default::default(),
                Some(deleted.clone()),
            ),
            reflected(
                upper_api(ctx),
                Side::Upper,
                Default::default(),
                Some(deleted.clone()),
            ),
        ),
    };
    let lower_services = reflected(Api::all(ctx.lower.clone()), Side::Lower, ours(), None);
    let mirrored = lower_services.store.clone();
    ctx.metrics
        .count_mirrored(&ctx.owner.node, "services", move || mirrored.state().len());
    let lower_slices = reflected(Api::all(ctx.lower.clone()), Side::Lower, ours(), None);
    let lower_endpoints = reflected(Api::all(ctx.lower.clone()), Side::Lower, ours(), None);
    let ready = upper_services
        .ready
        .clone()
        .and(&lower_services.ready)
        .and(&upper_slices.ready)
        .and(&lower_slices.ready)
        .and(&upper_endpoints.ready)
        .and(&lower_endpoints.ready);
    ServiceWatches {
        upper_services,
        lower_services,
        upper_slices,
        lower_slices,
        upper_endpoints,
        lower_endpoints,
        deleted,
        ready,
    }
}

/// What the three controllers and the sweep share: every store, and the copies' write
/// budget.
struct ServiceContext {
    ctx: Arc<Context>,
    upper_services: Store<Service>,
    lower_services: Store<Service>,
    upper_slices: Store<EndpointSlice>,
    lower_slices: Store<EndpointSlice>,
    upper_endpoints: Store<Endpoints>,
    lower_endpoints: Store<Endpoints>,
    ready: Ready,
    /// How often each copy may be rewritten while something below keeps editing it.
    budget: Mutex<WriteBudget>,
}

/// Runs the Service, EndpointSlice and Endpoints controllers and the orphan sweep until
/// `shutdown`.
pub async fn run(
    ctx: Arc<Context>,
    watches: ServiceWatches,
    resync: Duration,
    shutdown: CancellationToken,
) {
    let ServiceWatches {
        upper_services,
        lower_services,
        upper_slices,
        lower_slices,
        upper_endpoints,
        lower_endpoints,
        deleted,
        ready,
    } = watches;
    let sc = Arc::new(ServiceContext {
        ctx: ctx.clone(),
        upper_services: upper_services.store.clone(),
        lower_services: lower_services.store.clone(),
        upper_slices: upper_slices.store.clone(),
        lower_slices: lower_slices.store.clone(),
        upper_endpoints: upper_endpoints.store.clone(),
        lower_endpoints: lower_endpoints.store.clone(),
        ready,
        budget: Mutex::default(),
    });

    // A Service copy appearing (or changing) below wakes its endpoints: they wait for it,
    // as they are owned by it.
    let (slice_tx, slice_rx) = mpsc::unbounded::<ObjectRef<EndpointSlice>>();
    let (endpoints_tx, endpoints_rx) = mpsc::unbounded::<ObjectRef<Endpoints>>();
    let slices_of = upper_slices.store.clone();
    let listed = lower_services.ready.clone();
    let lower_service_events = lower_services.stream.inspect_ok(move |service: &Service| {
        // Not during the first list: every slice is reconciled once all stores are listed.
        if !listed.is_ready() {
            return;
        }
        let (Some(namespace), Some(name)) = (service.namespace(), service.metadata.name.clone())
        else {
            return;
        };
        for slice in slices_of.state() {
            if slice.namespace().as_deref() == Some(namespace.as_str())
                && slice.labels().get(SERVICE_NAME_LABEL) == Some(&name)
            {
                let _ = slice_tx.unbounded_send(ObjectRef::from_obj(&*slice));
            }
        }
        let _ = endpoints_tx.unbounded_send(ObjectRef::new(&name).within(&namespace));
    });

    let services = Controller::for_stream(upper_services.stream, upper_services.store.clone())
        .watches_stream(lower_service_events, original_of::<Service>)
        .reconcile_all_on(every(resync))
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(reconcile_service, error_policy::<Service>, sc.clone())
        .for_each(|result| log_outcome("service reconcile", result));
    let slices = Controller::for_stream(upper_slices.stream, upper_slices.store.clone())
        .watches_stream(lower_slices.stream, original_of::<EndpointSlice>)
        .reconcile_on(slice_rx)
        .reconcile_all_on(every(resync))
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(reconcile_slice, error_policy::<EndpointSlice>, sc.clone())
        .for_each(|result| log_outcome("service reconcile", result));
    let endpoints = Controller::for_stream(upper_endpoints.stream, upper_endpoints.store.clone())
        .watches_stream(lower_endpoints.stream, original_of::<Endpoints>)
        .reconcile_on(endpoints_rx)
        .reconcile_all_on(every(resync))
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(reconcile_endpoints, error_policy::<Endpoints>, sc.clone())
        .for_each(|result| log_outcome("service reconcile", result));
    let sweep = remove_orphans(sc, deleted, shutdown);
    tokio::join!(services, slices, endpoints, sweep);
}

/// The upper original of a lower copy: the object of its kind with the copy's namespace
/// and name.
fn original_of<K: Resource<DynamicType = ()>>(copy: K) -> Option<ObjectRef<K>> {
    Some(ObjectRef::new(&copy.meta().name.clone()?).within(&copy.meta().namespace.clone()?))
}

fn backoff_key<K: k8s_openapi::Resource + ResourceExt>(object: &K) -> String {
    format!(
        "{}/{}/{}",
        K::KIND,
        object.namespace().unwrap_or_default(),
        object.name_any()
    )
}

fn error_policy<K: k8s_openapi::Resource + ResourceExt>(
    object: Arc<K>,
    _error: &Error,
    sc: Arc<ServiceContext>,
) -> Action {
    Action::requeue(sc.ctx.backoff(&backoff_key(&*object)))
}

async fn reconcile_service(upper: Arc<Service>, sc: Arc<ServiceContext>) -> Result<Action, Error> {
    sc.ready.wait().await?;
    let started = Instant::now();
    let result = sync_service(&upper, &sc).await;
    sc.ctx.metrics.reconciled("service", started.elapsed());
    result
}

async fn sync_service(upper: &Service, sc: &ServiceContext) -> Result<Action, Error> {
    let ctx = &sc.ctx;
    let namespace = upper.namespace().unwrap_or_default();
    let name = upper.name_any();
    if !is_mirrored_service(&namespace, &name) {
        return Ok(Action::await_change());
    }
    let current = sc
        .lower_services
        .get(&ObjectRef::new(&name).within(&namespace));
    if upper.metadata.deletion_timestamp.is_some() {
        // Going (held by a finalizer): the copy goes now.
        if let Some(copy) = current {
            delete_copy(ctx, &*copy, "its upper original is being deleted").await?;
        }
        return Ok(Action::await_change());
    }
    let desired = match lower_service(upper, &ctx.owner) {
        Ok(desired) => desired,
        Err(error @ TranslateError::NotMirrored { .. }) => {
            warn!(object = %format!("{namespace}/{name}"), kind = "Service", cluster = "upper", %error, "not mirrored");
            ctx.warn_on(upper, "ServiceNotMirrored", error.to_string())
                .await;
            return Ok(Action::await_change());
        }
        Err(error) => return Err(error.into()),
    };
    let source = upper_version(&upper.metadata);
    let result = apply(
        sc,
        desired,
        current.as_deref(),
        upper,
        &source,
        service_update,
    )
    .await;
    if result.is_ok() {
        ctx.succeeded(&backoff_key(upper));
    }
    result
}

/// The mirrored Service `namespace/name` (upper) and its lower copy, if that copy is this
/// node's and reflects the upper Service as it is now.
fn services_of(
    sc: &ServiceContext,
    namespace: &str,
    name: &str,
) -> Option<(Arc<Service>, Arc<Service>)> {
    if !is_mirrored_service(namespace, name) {
        return None;
    }
    let key = ObjectRef::new(name).within(namespace);
    let upper = sc.upper_services.get(&key)?;
    let lower = sc.lower_services.get(&key)?;
    let current = upper.metadata.deletion_timestamp.is_none()
        && upper_uid(&lower.metadata).is_some()
        && upper_uid(&lower.metadata) == upper.metadata.uid.as_deref()
        && lower.metadata.uid.is_some()
        && lower.metadata.deletion_timestamp.is_none();
    current.then_some((upper, lower))
}

async fn reconcile_slice(
    upper: Arc<EndpointSlice>,
    sc: Arc<ServiceContext>,
) -> Result<Action, Error> {
    sc.ready.wait().await?;
    let ctx = &sc.ctx;
    let namespace = upper.namespace().unwrap_or_default();
    if upper.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let Some(service_name) = upper.labels().get(SERVICE_NAME_LABEL).cloned() else {
        return Ok(Action::await_change());
    };
    // Without this node's copy of its Service there is nothing to attach it to; the copy
    // appearing wakes this slice.
    let Some((upper_service, service)) = services_of(&sc, &namespace, &service_name) else {
        return Ok(Action::await_change());
    };
    let desired = lower_endpoint_slice(&upper, &ctx.owner, &service)?;
    let current = sc
        .lower_slices
        .get(&ObjectRef::new(&upper.name_any()).within(&namespace));
    // The copy follows the upper object and is owned by the lower Service.
    let source = format!(
        "{}/{}",
        upper_version(&upper.metadata),
        service.metadata.uid.as_deref().unwrap_or_default()
    );
    let result = apply(
        &sc,
        desired,
        current.as_deref(),
        &*upper_service,
        &source,
        endpoint_slice_update,
    )
    .await;
    if result.is_ok() {
        ctx.succeeded(&backoff_key(&*upper));
    }
    result
}

async fn reconcile_endpoints(
    upper: Arc<Endpoints>,
    sc: Arc<ServiceContext>,
) -> Result<Action, Error> {
    sc.ready.wait().await?;
    let ctx = &sc.ctx;
    let namespace = upper.namespace().unwrap_or_default();
    let name = upper.name_any();
    if upper.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let Some((upper_service, service)) = services_of(&sc, &namespace, &name) else {
        return Ok(Action::await_change());
    };
    let desired = lower_endpoints(&upper, &ctx.owner, &service)?;
    let current = sc
        .lower_endpoints
        .get(&ObjectRef::new(&name).within(&namespace));
    // The copy follows the upper object and is owned by the lower Service.
    let source = format!(
        "{}/{}",
        upper_version(&upper.metadata),
        service.metadata.uid.as_deref().unwrap_or_default()
    );
    let result = apply(
        &sc,
        desired,
        current.as_deref(),
        &*upper_service,
        &source,
        endpoints_update,
    )
    .await;
    if result.is_ok() {
        ctx.succeeded(&backoff_key(&*upper));
    }
    result
}

/// A kind tensile mirrors down as is (with the Service it belongs to).
trait Mirrored:
    Resource<DynamicType = (), Scope = NamespaceResourceScope>
    + k8s_openapi::Resource
    + Clone
    + Debug
    + Serialize
    + DeserializeOwned
    + Send
    + Sync
    + 'static
{
}
impl Mirrored for Service {}
impl Mirrored for EndpointSlice {}
impl Mirrored for Endpoints {}

/// Brings the lower copy to `desired` (made from the upper version `source`): creates it
/// (with its namespace) when missing, replaces it when it differs, re-creates it when it
/// cannot change in place; creates and replaces spend the copy's write budget. A lower
/// object of that name that is not this node's is left alone: silently when another
/// virtual node mirrors the same upper object, with a Warning on `upper` otherwise.
async fn apply<K: Mirrored, U: Resource<DynamicType = ()>>(
    sc: &ServiceContext,
    desired: K,
    current: Option<&K>,
    upper: &U,
    source: &str,
    update: fn(&K, &K) -> Update<K>,
) -> Result<Action, Error> {
    let ctx = &sc.ctx;
    let kind = <K as k8s_openapi::Resource>::KIND;
    let namespace = desired.namespace().unwrap_or_default();
    let name = desired.name_any();
    let key = format!("{namespace}/{name}");
    let api: Api<K> = Api::namespaced(ctx.lower.clone(), &namespace);
    let write_delay = || async {
        ctx.copy_write_delay(&sc.budget, kind, &key, source, &upper.object_ref(&()))
            .await
    };
    let Some(current) = current else {
        ensure_namespace(ctx, &namespace).await?;
        if let Some(wait) = write_delay().await {
            return Ok(Action::requeue(wait));
        }
        return match api.create(&PostParams::default(), &desired).await {
            Ok(_) => {
                info!(object = %key, kind, cluster = "lower", "mirrored");
                Ok(Action::await_change())
            }
            Err(e) if is_status(&e, 409) => foreign(ctx, &api, &desired, upper).await,
            Err(e) => Err(warn_if_refused(
                ctx,
                upper,
                api_error(Side::Lower, "creating", kind, &key)(e),
            )
            .await),
        };
    };
    match update(&desired, current) {
        Update::InStep => Ok(Action::await_change()),
        Update::Replace(replacement) => {
            if let Some(wait) = write_delay().await {
                return Ok(Action::requeue(wait));
            }
            match replace_exact(&api, &name, &replacement).await {
                Ok(Replaced::Now) => {
                    debug!(object = %key, kind, cluster = "lower", "updated");
                    Ok(Action::await_change())
                }
                // Changed meanwhile: again on the newer copy, within its write budget.
                Ok(Replaced::Conflict) => Ok(Action::requeue(Duration::from_millis(200))),
                Ok(Replaced::Gone) => Ok(Action::await_change()),
                Err(e) => Err(warn_if_refused(
                    ctx,
                    upper,
                    api_error(Side::Lower, "updating", kind, &key)(e),
                )
                .await),
            }
        }
        Update::Recreate => {
            // The deletion event wakes this object again, and it is created anew.
            delete_copy(ctx, current, "a field that cannot change in place differs").await?;
            Ok(Action::await_change())
        }
    }
}

/// A lower object of the copy's name exists that the store does not show: this node's
/// (the store lags a create), another node's copy of the same upper object, or foreign.
async fn foreign<K: Mirrored, U: Resource<DynamicType = ()>>(
    ctx: &Context,
    api: &Api<K>,
    desired: &K,
    upper: &U,
) -> Result<Action, Error> {
    let kind = <K as k8s_openapi::Resource>::KIND;
    let name = desired.name_any();
    let key = format!("{}/{name}", desired.namespace().unwrap_or_default());
    let Some(existing) =
        api.get_metadata_opt(&name)
            .await
            .map_err(api_error(Side::Lower, "reading", kind, &key))?
    else {
        return Ok(Action::requeue(Duration::from_millis(200)));
    };
    let meta = &existing.metadata;
    if is_owned_by(meta, &ctx.owner) {
        return Ok(Action::await_change());
    }
    let owner = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(OWNER_NODE_LABEL))
        .cloned();
    if owner.is_some() && upper_uid(meta).is_some() && upper_uid(meta) == upper_uid(desired.meta())
    {
        debug!(object = %key, kind, cluster = "lower", owner = ?owner, "mirrored by another virtual node");
        return Ok(Action::requeue(FOREIGN_RECHECK));
    }
    let note = format!(
        "lower cluster: {kind} {key} exists and was not created by virtual node {} for this object; leaving it alone",
        ctx.owner.node
    );
    warn!(object = %key, kind, cluster = "lower", "{note}");
    ctx.warn_on(upper, "LowerObjectNotOurs", note).await;
    Ok(Action::requeue(FOREIGN_RECHECK))
}

/// Publishes a failed lower write as a Warning on the upper object when the lower cluster
/// refused it (a 4xx: the user can act on it), and returns the error.
async fn warn_if_refused<U: Resource<DynamicType = ()>>(
    ctx: &Context,
    upper: &U,
    error: Error,
) -> Error {
    if let Error::Api {
        source: kube::Error::Api(status),
        ..
    } = &error
        && (400..500).contains(&status.code)
    {
        warn!(object = %format!("{}/{}", upper.meta().namespace.as_deref().unwrap_or_default(), upper.meta().name.as_deref().unwrap_or_default()), kind = %U::kind(&()), cluster = "lower", %error, "mirroring");
        let mut note = error.to_string();
        note.truncate(1000);
        ctx.warn_on(upper, "LowerSyncFailed", note).await;
    }
    error
}

/// Deletes a copy (that one: UID precondition).
async fn delete_copy<K: Mirrored>(ctx: &Context, copy: &K, why: &str) -> Result<(), Error> {
    let kind = <K as k8s_openapi::Resource>::KIND;
    let namespace = copy.namespace().unwrap_or_default();
    let name = copy.name_any();
    let key = format!("{namespace}/{name}");
    let api: Api<K> = Api::namespaced(ctx.lower.clone(), &namespace);
    let deleted = delete_exact(&api, &name, copy.meta().uid.clone(), None)
        .await
        .map_err(api_error(Side::Lower, "deleting", kind, &key))?;
    if deleted == Deleted::Now {
        info!(object = %key, kind, cluster = "lower", why, "deleted the copy");
    }
    Ok(())
}

/// Deletes copies whose original is gone (or re-created, or no longer mirrored): on every
/// upper deletion and every [`SWEEP_INTERVAL`].
async fn remove_orphans(
    sc: Arc<ServiceContext>,
    deleted: Arc<Notify>,
    shutdown: CancellationToken,
) {
    tokio::select! {
        () = shutdown.cancelled() => return,
        ready = sc.ready.wait() => if ready.is_err() { return },
    }
    let mut tick = tokio::time::interval(SWEEP_INTERVAL);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tick_or_wake(&mut tick, &deleted) => {}
        }
        let ctx = &sc.ctx;
        let service_wanted = |upper: &Service| {
            is_mirrored_service(&upper.namespace().unwrap_or_default(), &upper.name_any())
                && lower_service(upper, &ctx.owner).is_ok()
        };
        let results = [
            sweep(ctx, &sc.lower_services, &sc.upper_services, service_wanted).await,
            sweep(ctx, &sc.lower_slices, &sc.upper_slices, |_| true).await,
            sweep(ctx, &sc.lower_endpoints, &sc.upper_endpoints, |_| true).await,
        ];
        for error in results.into_iter().filter_map(Result::err) {
            warn!(cluster = "lower", %error, "deleting orphaned copies");
        }
    }
}

/// Deletes this node's copies in `lower` whose original in `upper` is gone, re-created
/// (another UID), going, or no longer `wanted`. An original missing from the store is
/// looked up before its copy goes (the store may lag).
async fn sweep<K: Mirrored>(
    ctx: &Context,
    lower: &Store<K>,
    upper: &Store<K>,
    wanted: impl Fn(&K) -> bool,
) -> Result<(), Error> {
    let kind = <K as k8s_openapi::Resource>::KIND;
    for copy in lower.state() {
        if !is_owned_by(copy.meta(), &ctx.owner) || copy.meta().deletion_timestamp.is_some() {
            continue;
        }
        let namespace = copy.namespace().unwrap_or_default();
        let name = copy.name_any();
        let origin = upper_uid(copy.meta());
        let original = upper.get(&ObjectRef::new(&name).within(&namespace));
        let keep = original.as_deref().is_some_and(|o| {
            o.meta().uid.as_deref() == origin && o.meta().deletion_timestamp.is_none() && wanted(o)
        });
        if keep {
            continue;
        }
        if original.is_none() {
            let api: Api<K> = Api::namespaced(ctx.upper.clone(), &namespace);
            let key = format!("{namespace}/{name}");
            let live = api.get_metadata_opt(&name).await.map_err(api_error(
                Side::Upper,
                "reading",
                kind,
                &key,
            ))?;
            if live.is_some_and(|m| m.metadata.uid.as_deref() == origin) {
                continue;
            }
        }
        delete_copy(ctx, &*copy, "its upper original is gone").await?;
    }
    Ok(())
}
