//! The upper cluster's PVCs, as far as the webhook needs them: which node each was
//! provisioned on (`volume.kubernetes.io/selected-node`). A metadata-only reflector keeps
//! them in memory, so admission never waits on the API server.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::StreamExt;
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use tensile::translate::meta::SELECTED_NODE_ANNOTATION;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::mutate::SelectedNodes;

/// PVC metadata of the upper cluster, kept current by [`run`].
#[derive(Clone)]
pub struct PvcStore(Store<PartialObjectMeta<PersistentVolumeClaim>>);

impl SelectedNodes for PvcStore {
    fn selected_node(&self, namespace: &str, claim: &str) -> Option<String> {
        let key = ObjectRef::new(claim).within(namespace);
        self.0
            .get(&key)?
            .metadata
            .annotations
            .as_ref()?
            .get(SELECTED_NODE_ANNOTATION)
            .cloned()
    }
}

/// A store and the task that fills it: watches PVC metadata in every namespace (with
/// backoff on errors) until `shutdown`, and marks the webhook ready once the first list
/// is in.
pub fn watch(
    client: kube::Client,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> (PvcStore, impl Future<Output = ()>) {
    let (store, writer) = reflector::store();
    // Api of PartialObjectMeta makes metadata-only requests.
    let api: Api<PartialObjectMeta<PersistentVolumeClaim>> = Api::all(client);
    let events = watcher(api, watcher::Config::default())
        .default_backoff()
        // Only annotations are read; managed fields are most of the rest.
        .modify(|pvc| pvc.metadata.managed_fields = None);
    let reflect = reflector::reflector(writer, events).for_each(|event| async move {
        if let Err(error) = event {
            warn!(%error, "upper cluster: watching PVCs");
        }
    });
    let ready = {
        let store = store.clone();
        async move {
            if store.wait_until_ready().await.is_ok() {
                metrics.ready.store(true, Ordering::Relaxed);
                info!("upper cluster: PVC cache synced");
            }
        }
    };
    let task = async move {
        tokio::select! {
            () = shutdown.cancelled() => {}
            ((), ()) = futures::future::join(reflect, ready) => {}
        }
    };
    (PvcStore(store), task)
}
