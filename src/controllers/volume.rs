//! `PVControllers`: the claims tensile copied down for pods (see `dependencies`) are bound
//! or provisioned by the lower cluster; this controller reflects that binding up. For
//! each lower claim of this node: the volume it is bound to appears in the upper cluster
//! (pinned to the virtual node, pre-bound to the upper claim, which the upper PV
//! controller then binds), `volume.kubernetes.io/selected-node` on the upper claim names
//! the virtual node, a storage class the lower cluster lacks is reported, and the lower
//! claim is deleted once the upper one is gone (the lower cluster's own protection keeps
//! it while a pod uses it). A reflected volume goes when its lower volume goes.
//!
//! A lower claim's marks (owner labels, upper UID) are anyone's to copy who may create
//! claims below, so they alone never let it write upstairs: the selected-node annotation,
//! an upper volume and a Warning go only onto an upper claim (within `--namespace`) that
//! an upper pod bound to this node uses, as it is only for such pods that claims are copied
//! down. Anything else is refused with a warning naming the lower claim (and a
//! `LowerClaimRefused` Warning on the upper claim).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::ResourceExt;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::stores::{Ready, Reflected, every, log_outcome, reflected, tick_or_wake};
use super::{Context, Error, api_error};
use crate::api::{Deleted, delete_exact, is_status};
use crate::side::Side;
use crate::translate::config::SYSTEM_NAMESPACE;
use crate::translate::namespace::is_unmapped;
use crate::translate::pod::{is_owned_by, upper_uid};
use crate::translate::volume::{
    bound_volume, is_reflected_by, missing_storage_class, pv_patch, reflected_from,
    reflections_selector, refused_claim, selected_node_patch, upper_pv,
};

/// How often reflected volumes are compared with the lower ones (in memory).
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(30);
/// The page size of the upper pod list that tells whether a pod of this node uses a claim.
const POD_PAGE: u32 = 500;
/// The reason of the Warning on an upper claim a lower claim names without right.
const CLAIM_REFUSED: &str = "LowerClaimRefused";

/// The watches of the volume controller.
pub struct VolumeWatches {
    lower_claims: Reflected<PersistentVolumeClaim>,
    upper_claims: Reflected<PersistentVolumeClaim>,
    lower_volumes: Reflected<PersistentVolume>,
    upper_volumes: Reflected<PersistentVolume>,
    lower_classes: Reflected<StorageClass>,
    lower_volume_deleted: Arc<Notify>,
    /// Ready once every watch has listed.
    pub ready: Ready,
}

/// Sets up the watches: lower claims with this node's marks and upper volumes reflected by
/// this node, upper claims (in `--namespace` if given), lower volumes and storage classes.
pub fn watches(ctx: &Context) -> VolumeWatches {
    let ours = watcher::Config::default().labels(&ctx.owner.selector());
    let reflections = watcher::Config::default().labels(&reflections_selector(&ctx.owner.node));
    let lower_volume_deleted = Arc::new(Notify::new());
    let upper_claims_api = if ctx.namespace.is_empty() {
        Api::all(ctx.upper.clone())
    } else {
        Api::namespaced(ctx.upper.clone(), &ctx.namespace)
    };
    let lower_claims = reflected(Api::all(ctx.lower.clone()), Side::Lower, ours, None);
    let upper_claims = match ctx.upper_watches.as_ref().and_then(|s| s.claims.as_ref()) {
        Some(shared) => shared.subscribe(None),
        None => reflected(
            upper_claims_api,
            Side::Upper,
            watcher::Config::default(),
            None,
        ),
    };
    let lower_volumes = reflected(
        Api::all(ctx.lower.clone()),
        Side::Lower,
        watcher::Config::default(),
        Some(lower_volume_deleted.clone()),
    );
    let upper_volumes = match ctx.upper_watches.as_ref().and_then(|s| s.volumes.as_ref()) {
        Some(shared) => shared.subscribe(None),
        None => reflected(Api::all(ctx.upper.clone()), Side::Upper, reflections, None),
    };
    let lower_classes = reflected(
        Api::all(ctx.lower.clone()),
        Side::Lower,
        watcher::Config::default(),
        None,
    );
    let ready = lower_claims
        .ready
        .clone()
        .and(&upper_claims.ready)
        .and(&lower_volumes.ready)
        .and(&upper_volumes.ready)
        .and(&lower_classes.ready);
    VolumeWatches {
        lower_claims,
        upper_claims,
        lower_volumes,
        upper_volumes,
        lower_classes,
        lower_volume_deleted,
        ready,
    }
}

/// What the claim controller and the volume sweep share: the context and the stores.
struct VolumeContext {
    ctx: Arc<Context>,
    upper_claims: Store<PersistentVolumeClaim>,
    lower_volumes: Store<PersistentVolume>,
    upper_volumes: Store<PersistentVolume>,
    lower_classes: Store<StorageClass>,
    ready: Ready,
}

/// Runs the claim controller and the sweep of reflected volumes until `shutdown`.
pub async fn run(
    ctx: Arc<Context>,
    watches: VolumeWatches,
    resync: Duration,
    shutdown: CancellationToken,
) {
    let VolumeWatches {
        lower_claims,
        upper_claims,
        lower_volumes,
        upper_volumes,
        lower_classes,
        lower_volume_deleted,
        ready,
    } = watches;
    let vc = Arc::new(VolumeContext {
        ctx,
        upper_claims: upper_claims.store.clone(),
        lower_volumes: lower_volumes.store.clone(),
        upper_volumes: upper_volumes.store.clone(),
        lower_classes: lower_classes.store.clone(),
        ready,
    });
    let claims = lower_claims.store.clone();
    let claim_named = {
        let claims = claims.clone();
        move |namespace: Option<String>, name: Option<String>| {
            let claim = ObjectRef::new(&name?).within(&namespace?);
            claims.get(&claim).map(|_| claim)
        }
    };
    let by_upper_claim = {
        let claim_named = claim_named.clone();
        move |upper: PersistentVolumeClaim| {
            claim_named(upper.metadata.namespace, upper.metadata.name)
        }
    };
    let by_volume = {
        let claim_named = claim_named.clone();
        move |volume: PersistentVolume| {
            let claim = volume.spec?.claim_ref?;
            claim_named(claim.namespace, claim.name)
        }
    };
    // A storage class appearing below wakes the pending claims that ask for it.
    let by_class = move |class: StorageClass| {
        let name = class.name_any();
        claims
            .state()
            .iter()
            .filter(|c| {
                c.spec
                    .as_ref()
                    .and_then(|s| s.storage_class_name.as_deref())
                    == Some(name.as_str())
            })
            .map(|c| ObjectRef::from_obj(&**c))
            .collect::<Vec<_>>()
    };
    let controller = Controller::for_stream(lower_claims.stream, lower_claims.store)
        .watches_stream(upper_claims.stream, by_upper_claim)
        .watches_stream(lower_volumes.stream, by_volume.clone())
        .watches_stream(upper_volumes.stream, by_volume)
        .watches_stream(lower_classes.stream, by_class)
        .reconcile_all_on(every(resync))
        .graceful_shutdown_on(shutdown.clone().cancelled_owned())
        .run(reconcile, error_policy, vc.clone())
        .for_each(|result| log_outcome("claim reconcile", result));
    tokio::join!(
        controller,
        remove_orphaned_volumes(vc, lower_volume_deleted, shutdown)
    );
}

fn backoff_key(claim: &PersistentVolumeClaim) -> String {
    format!(
        "PersistentVolumeClaim/{}/{}",
        claim.namespace().unwrap_or_default(),
        claim.name_any()
    )
}

fn error_policy(
    claim: Arc<PersistentVolumeClaim>,
    _error: &Error,
    vc: Arc<VolumeContext>,
) -> Action {
    Action::requeue(vc.ctx.backoff(&backoff_key(&claim)))
}

async fn reconcile(
    lower: Arc<PersistentVolumeClaim>,
    vc: Arc<VolumeContext>,
) -> Result<Action, Error> {
    vc.ready.wait().await?;
    let started = Instant::now();
    let result = reflect_claim(&lower, &vc).await;
    vc.ctx.metrics.reconciled("volume", started.elapsed());
    if result.is_ok() {
        vc.ctx.succeeded(&backoff_key(&lower));
    }
    result
}

async fn reflect_claim(lower: &PersistentVolumeClaim, vc: &VolumeContext) -> Result<Action, Error> {
    let ctx = &vc.ctx;
    let namespace = lower.namespace().unwrap_or_default();
    let name = lower.name_any();
    let key = format!("{namespace}/{name}");
    if namespace == SYSTEM_NAMESPACE
        || !is_owned_by(&lower.metadata, &ctx.owner)
        || lower.metadata.deletion_timestamp.is_some()
    {
        return Ok(Action::await_change());
    }
    let origin = upper_uid(&lower.metadata);
    let upper_api: Api<PersistentVolumeClaim> = Api::namespaced(ctx.upper.clone(), &namespace);
    let upper = match vc
        .upper_claims
        .get(&ObjectRef::new(&name).within(&namespace))
        .filter(|u| u.metadata.uid.as_deref() == origin)
    {
        Some(upper) => upper,
        None => {
            // Gone from the store (or re-created): make sure before deleting below.
            let live = upper_api.get_opt(&name).await.map_err(api_error(
                Side::Upper,
                "reading",
                "PersistentVolumeClaim",
                &key,
            ))?;
            match live.filter(|u| u.metadata.uid.as_deref() == origin) {
                Some(upper) => Arc::new(upper),
                None if is_unmapped(&namespace) => {
                    // Its upper namespace moved to another lower namespace (no pod was
                    // left here): the claim may still be the upper claim's, and its data
                    // is not ours to drop.
                    warn!(object = %key, cluster = "lower",
                        "claim in a lower namespace no upper namespace maps to any more: kept");
                    return Ok(Action::await_change());
                }
                None => {
                    delete_lower_claim(ctx, lower, &key).await?;
                    return Ok(Action::await_change());
                }
            }
        }
    };
    if upper.metadata.deletion_timestamp.is_some() {
        // The upper cluster keeps it while a pod uses it; it goes below once it is gone.
        return Ok(Action::await_change());
    }
    // Asked (once) before the first write upstairs: in the steady state nothing is written
    // and no pod is listed.
    let mut gate = Gate::default();

    let class_exists = |class: &str| vc.lower_classes.get(&ObjectRef::new(class)).is_some();
    if let Some(class) = missing_storage_class(lower, class_exists) {
        let note = format!(
            "lower cluster: storage class {class} does not exist, so PersistentVolumeClaim {key} cannot bind there"
        );
        warn!(object = %key, kind = "PersistentVolumeClaim", cluster = "lower", class, "storage class missing below");
        if gate.allows(ctx, &upper, &key).await? {
            ctx.warn_on(&*upper, "LowerStorageClassMissing", note).await;
        }
        // The class appearing below wakes this claim.
        return Ok(Action::await_change());
    }

    if let Some(patch) = selected_node_patch(&upper, lower, &ctx.owner.node) {
        if !gate.allows(ctx, &upper, &key).await? {
            return Ok(Action::await_change());
        }
        upper_api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(api_error(
                Side::Upper,
                "annotating",
                "PersistentVolumeClaim",
                &key,
            ))?;
        info!(object = %key, kind = "PersistentVolumeClaim", cluster = "upper", "set selected-node to the virtual node");
    }

    let Some(volume) = bound_volume(lower) else {
        return Ok(Action::await_change());
    };
    let upper_volume_name = upper
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.as_deref())
        .filter(|v| !v.is_empty());
    if upper_volume_name.is_some_and(|v| v != volume) {
        debug!(object = %key, kind = "PersistentVolumeClaim", cluster = "upper", "the upper claim is bound to another volume; nothing to reflect");
        return Ok(Action::await_change());
    }
    let Some(lower_volume) = vc.lower_volumes.get(&ObjectRef::new(volume)) else {
        // Its event wakes this claim.
        return Ok(Action::await_change());
    };
    let bound_to_copy = lower_volume
        .spec
        .as_ref()
        .and_then(|s| s.claim_ref.as_ref())
        .is_some_and(|c| c.uid.is_some() && c.uid == lower.metadata.uid);
    if !bound_to_copy {
        return Ok(Action::await_change());
    }
    let desired = upper_pv(&lower_volume, &upper, &ctx.owner.node)?;
    let volumes: Api<PersistentVolume> = Api::all(ctx.upper.clone());
    // Shared by the members of a federated process, the store holds other nodes'
    // reflections too: one of those is not this node's to replace.
    let reflection = vc
        .upper_volumes
        .get(&ObjectRef::new(volume))
        .filter(|pv| is_reflected_by(&pv.metadata, &ctx.owner.node));
    let in_step = reflection.as_ref().is_some_and(|current| {
        reflected_from(current) == lower_volume.metadata.uid.as_deref()
            && pv_patch(&desired, current).is_none()
    });
    if in_step || !gate.allows(ctx, &upper, &key).await? {
        return Ok(Action::await_change());
    }
    match reflection {
        None => match volumes.create(&PostParams::default(), &desired).await {
            Ok(_) => {
                info!(object = %key, kind = "PersistentVolumeClaim", volume, cluster = "upper", "reflected the bound volume");
            }
            Err(e) if is_status(&e, 409) => {
                let existing = volumes.get_metadata_opt(volume).await.map_err(api_error(
                    Side::Upper,
                    "reading",
                    "PersistentVolume",
                    volume,
                ))?;
                let ours = existing
                    .as_ref()
                    .is_some_and(|m| is_reflected_by(&m.metadata, &ctx.owner.node));
                // The seed's way: the user prepared an upper volume and the claim bound it.
                let users_bound = upper_volume_name == Some(volume);
                if existing.is_some() && !ours && !users_bound {
                    let note = format!(
                        "upper cluster: PersistentVolume {volume} exists and was not created by tensile; the lower volume bound to {key} is not reflected"
                    );
                    warn!(object = %key, kind = "PersistentVolumeClaim", volume, cluster = "upper", "{note}");
                    ctx.warn_on(&*upper, "UpperVolumeConflict", note).await;
                }
            }
            Err(e) => {
                let error = api_error(Side::Upper, "creating", "PersistentVolume", volume)(e);
                let mut note = error.to_string();
                note.truncate(1000);
                ctx.warn_on(&*upper, "VolumeReflectionFailed", note).await;
                return Err(error);
            }
        },
        Some(current) if reflected_from(&current) != lower_volume.metadata.uid.as_deref() => {
            // The lower volume was re-created under this name: the reflection goes and is
            // made again (its deletion event wakes this claim).
            delete_upper_volume(ctx, &current, "the lower volume was re-created").await?;
        }
        Some(current) => {
            if let Some(patch) = pv_patch(&desired, &current) {
                volumes
                    .patch(volume, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                    .map_err(api_error(
                        Side::Upper,
                        "updating",
                        "PersistentVolume",
                        volume,
                    ))?;
                info!(object = %key, kind = "PersistentVolumeClaim", volume, cluster = "upper", "updated the reflected volume");
            }
        }
    }
    Ok(Action::await_change())
}

/// Whether this node may write onto an upper claim, found once per reconcile. A lower
/// claim's marks are anyone's to copy who may create claims below: only an upper claim that
/// a pod bound to this node uses (within `--namespace`) is reflected onto, as it is only for
/// such pods that tensile copies claims down ([`refused_claim`]).
#[derive(Default)]
struct Gate(Option<bool>);

impl Gate {
    /// Whether the lower claim `key` may be reflected onto `upper`; a refusal is logged,
    /// naming the lower claim, and put on the upper claim as a Warning.
    async fn allows(
        &mut self,
        ctx: &Context,
        upper: &PersistentVolumeClaim,
        key: &str,
    ) -> Result<bool, Error> {
        if let Some(known) = self.0 {
            return Ok(known);
        }
        let why = refusal(ctx, upper).await?;
        if let Some(why) = &why {
            let node = &ctx.owner.node;
            let claim = format!(
                "{}/{}",
                upper.namespace().unwrap_or_default(),
                upper.name_any()
            );
            warn!(object = %key, kind = "PersistentVolumeClaim", cluster = "lower",
                upper_claim = %claim, node = %node,
                "refused to reflect lower PersistentVolumeClaim {key} by its marks: upper \
                 PersistentVolumeClaim {claim} {why}");
            if ctx.namespace.is_empty() || ctx.namespace == upper.namespace().unwrap_or_default() {
                let note = format!(
                    "lower cluster: PersistentVolumeClaim {key} carries the marks of node {node} \
                     and this claim's UID, but this claim {why}: nothing is reflected onto it"
                );
                ctx.warn_on(upper, CLAIM_REFUSED, note).await;
            }
        }
        let allowed = why.is_none();
        self.0 = Some(allowed);
        Ok(allowed)
    }
}

/// Why this node may not write onto `upper` (`None`: it may): the upper pods bound to this
/// node in its namespace are read live, a page at a time, until one that uses it.
async fn refusal(ctx: &Context, upper: &PersistentVolumeClaim) -> Result<Option<String>, Error> {
    let namespace = upper.namespace().unwrap_or_default();
    let name = upper.name_any();
    let node = &ctx.owner.node;
    let decide = |pods: &[Pod]| refused_claim(&namespace, &name, pods, node, &ctx.namespace);
    if !ctx.namespace.is_empty() && namespace != ctx.namespace {
        return Ok(decide(&[]));
    }
    let api: Api<Pod> = Api::namespaced(ctx.upper.clone(), &namespace);
    let mut params = ListParams::default()
        .fields(&format!("spec.nodeName={node}"))
        .limit(POD_PAGE);
    loop {
        let page = api.list(&params).await.map_err(api_error(
            Side::Upper,
            "listing",
            "Pod",
            &namespace,
        ))?;
        let why = decide(&page.items);
        if why.is_none() {
            return Ok(None);
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(next) => params = params.continue_token(&next),
            None => return Ok(why),
        }
    }
}

async fn delete_lower_claim(
    ctx: &Context,
    lower: &PersistentVolumeClaim,
    key: &str,
) -> Result<(), Error> {
    let api: Api<PersistentVolumeClaim> =
        Api::namespaced(ctx.lower.clone(), &lower.namespace().unwrap_or_default());
    let result = delete_exact(&api, &lower.name_any(), lower.metadata.uid.clone(), None).await;
    ctx.known_present.forget(
        "PersistentVolumeClaim",
        &lower.namespace().unwrap_or_default(),
        &lower.name_any(),
    );
    if result.map_err(api_error(
        Side::Lower,
        "deleting",
        "PersistentVolumeClaim",
        key,
    ))? == Deleted::Now
    {
        info!(object = %key, kind = "PersistentVolumeClaim", cluster = "lower",
            "the upper claim is gone; deleted the lower one (kept by the lower cluster while a pod uses it)");
    }
    Ok(())
}

async fn delete_upper_volume(
    ctx: &Context,
    volume: &PersistentVolume,
    why: &str,
) -> Result<(), Error> {
    let name = volume.name_any();
    let api = Api::<PersistentVolume>::all(ctx.upper.clone());
    match delete_exact(&api, &name, volume.metadata.uid.clone(), None).await {
        Ok(Deleted::Now) => {
            info!(object = %name, kind = "PersistentVolume", cluster = "upper", why, "deleted the reflected volume");
            Ok(())
        }
        Ok(Deleted::AlreadyGone) => Ok(()),
        Err(e) => Err(api_error(
            Side::Upper,
            "deleting",
            "PersistentVolume",
            &name,
        )(e)),
    }
}

/// Deletes reflected volumes whose lower volume is gone (or re-created): on every lower
/// volume deletion and every [`SWEEP_INTERVAL`]. A lower volume missing from the store is
/// looked up before its reflection goes.
async fn remove_orphaned_volumes(
    vc: Arc<VolumeContext>,
    deleted: Arc<Notify>,
    shutdown: CancellationToken,
) {
    tokio::select! {
        () = shutdown.cancelled() => return,
        ready = vc.ready.wait() => if ready.is_err() { return },
    }
    let ctx = &vc.ctx;
    let lower_api: Api<PersistentVolume> = Api::all(ctx.lower.clone());
    let mut tick = tokio::time::interval(SWEEP_INTERVAL);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tick_or_wake(&mut tick, &deleted) => {}
        }
        for reflection in vc.upper_volumes.state() {
            if !is_reflected_by(&reflection.metadata, &ctx.owner.node)
                || reflection.metadata.deletion_timestamp.is_some()
            {
                continue;
            }
            let name = reflection.name_any();
            let origin = reflected_from(&reflection);
            let lower = vc.lower_volumes.get(&ObjectRef::new(&name));
            if lower.is_some_and(|l| l.metadata.uid.as_deref() == origin) {
                continue;
            }
            match lower_api.get_metadata_opt(&name).await {
                Ok(Some(live)) if live.metadata.uid.as_deref() == origin => continue,
                Ok(_) => {}
                Err(error) => {
                    warn!(object = %name, kind = "PersistentVolume", cluster = "lower", %error, "reading a volume");
                    continue;
                }
            }
            if let Err(error) =
                delete_upper_volume(ctx, &reflection, "its lower volume is gone").await
            {
                warn!(object = %name, kind = "PersistentVolume", cluster = "upper", %error, "deleting a reflected volume");
            }
        }
    }
}
