//! The return home's round: reads the upper cluster, lets [`super::home`] decide, evicts
//! (or, in a dry run, reports) and counts.

use std::collections::BTreeSet;
use std::sync::PoisonError;
use std::sync::atomic::Ordering;

use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::jiff::Timestamp;
use kube::Resource;
use kube::api::{Api, ListParams};
use kube::runtime::events::EventType;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use super::home::{self, Cluster, HomeVerdict, ReturnHome};
use super::{Acted, Descheduler, Error, pod_key};
use crate::api::is_status;

/// The Events' action.
const ACTION: &str = "ReturnHome";

impl Descheduler {
    /// One round of the return home over the pods on `virtual_nodes`.
    pub(super) async fn return_home(
        &self,
        limits: &ReturnHome,
        virtual_nodes: &BTreeSet<String>,
        leader: &watch::Receiver<bool>,
        shutdown: &CancellationToken,
    ) -> Result<(), Error> {
        let list_error = |what| move |source| Error::List { what, source };
        let nodes = Api::<Node>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .map_err(list_error("nodes"))?
            .items;
        let pods = Api::<Pod>::all(self.client.clone())
            .list(&ListParams::default())
            .await
            .map_err(list_error("pods"))?
            .items;
        let budgets = self.budgets().await?;
        // Claims are read only for the pods that could move otherwise.
        let mut pinned = BTreeSet::new();
        for pod in &pods {
            let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
            let Some(node) = node.filter(|n| virtual_nodes.contains(*n)) else {
                continue;
            };
            if home::eligible(pod).is_ok()
                && super::select::claim_names(pod).next().is_some()
                && self.pinning_claim(pod, node).await?.is_some()
            {
                pinned.insert(pod.metadata.uid.clone().unwrap_or_default());
            }
        }
        let cluster = Cluster {
            nodes: &nodes,
            pods: &pods,
            budgets: &budgets,
        };
        let plan = self
            .home
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .plan(&cluster, virtual_nodes, &pinned, limits, Timestamp::now());
        for pod in &plan.rebursts {
            self.metrics.home_rebursts.inc();
            let node = pod
                .spec
                .as_ref()
                .and_then(|s| s.node_name.as_deref())
                .unwrap_or_default();
            info!(pod = %pod_key(pod), %node, cluster = "upper",
                "a replacement of a pod moved home burst again; its owner backs off");
            self.publish_on(
                &pod.object_ref(&()),
                EventType::Normal,
                ACTION,
                "BurstAgain",
                format!(
                    "replaces a pod moved home, but was placed on virtual node {node}: the room \
                     was taken first; moves of its owner back off"
                ),
            )
            .await;
        }
        let moves = plan
            .verdicts
            .iter()
            .filter(|j| matches!(j.verdict, HomeVerdict::Move { .. }))
            .count();
        debug!(pods = plan.verdicts.len(), moves, "return-home round");
        for judged in plan.verdicts {
            let (to, on_virtual) = match judged.verdict {
                HomeVerdict::Skip(skip) => {
                    self.metrics.home_skip(skip.label());
                    continue;
                }
                HomeVerdict::Move { to, on_virtual } => (to, on_virtual),
            };
            if shutdown.is_cancelled() || !*leader.borrow() {
                info!("return-home round stopped: shutting down or no longer the leader");
                return Ok(());
            }
            let span = info_span!("pod", pod = %pod_key(judged.pod), node = %judged.node,
                cluster = "upper");
            let acted = self
                .move_home(judged.pod, &judged.node, &to, &pods)
                .instrument(span.clone())
                .await;
            match acted {
                Ok(Acted::Moved) => {
                    self.metrics.home_moves.inc();
                    self.metrics
                        .home_time_on_virtual_node
                        .observe(on_virtual.as_secs_f64());
                }
                Ok(Acted::WouldMove) => {
                    self.metrics.home_would_move.inc();
                }
                Ok(Acted::Disruption) => {
                    self.metrics.home_refusals.inc();
                }
                Ok(acted) => {
                    if let Some(label) = acted.skip_label() {
                        self.metrics.home_skip(label);
                    }
                }
                Err(error) => {
                    self.metrics.errors.inc();
                    span.in_scope(|| warn!(%error, "not moved home; retrying next round"));
                }
            }
        }
        Ok(())
    }

    /// Every PodDisruptionBudget; none where they cannot be read (forbidden, or the API
    /// absent): then every owner moves one at a time, as owners without one do.
    async fn budgets(&self) -> Result<Vec<PodDisruptionBudget>, Error> {
        match Api::<PodDisruptionBudget>::all(self.client.clone())
            .list(&ListParams::default())
            .await
        {
            Ok(list) => Ok(list.items),
            Err(e) if is_status(&e, 403) || is_status(&e, 404) => {
                if !self.budgets_unreadable.swap(true, Ordering::Relaxed) {
                    warn!(error = %e, cluster = "upper",
                        "cannot list PodDisruptionBudgets: every owner moves home one pod at a \
                         time, the next once the replacement is Ready");
                }
                Ok(Vec::new())
            }
            Err(source) => Err(Error::List {
                what: "PodDisruptionBudgets",
                source,
            }),
        }
    }

    /// Evicts one burst pod to come home (or reports it in a dry run), once read again and
    /// still the pod judged.
    async fn move_home(
        &self,
        seen: &Pod,
        node: &str,
        to: &str,
        listed: &[Pod],
    ) -> Result<Acted, Error> {
        let namespace = seen.metadata.namespace.clone().unwrap_or_default();
        let name = seen.metadata.name.clone().unwrap_or_default();
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        let Some(pod) = pods.get_opt(&name).await.map_err(|source| Error::Pod {
            action: "reading",
            pod: pod_key(seen),
            source,
        })?
        else {
            return Ok(Acted::Changed);
        };
        let same = pod.metadata.uid == seen.metadata.uid
            && pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
            && home::eligible(&pod).is_ok();
        if !same {
            debug!("changed since listed; skipped");
            return Ok(Acted::Changed);
        }
        let owner = home::controller(&pod).map(|o| ObjectReference {
            api_version: Some(o.api_version.clone()),
            kind: Some(o.kind.clone()),
            name: Some(o.name.clone()),
            namespace: Some(namespace.clone()),
            uid: Some(o.uid.clone()),
            ..ObjectReference::default()
        });
        if self.config.dry_run {
            info!(%to, "dry run: would move home");
            self.publish_on(
                &pod.object_ref(&()),
                EventType::Normal,
                ACTION,
                "WouldReturnHome",
                format!("would move it off virtual node {node}: regular node {to} has room"),
            )
            .await;
            return Ok(Acted::WouldMove);
        }
        let acted = self.evict_only(&pods, &pod).await?;
        if acted == Acted::Moved {
            self.home
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .moved(listed, &pod, Timestamp::now());
            info!(%to, "evicted to return home");
            let note = format!(
                "evicted from virtual node {node}: its replacement fits on regular node {to}"
            );
            self.publish_on(
                &pod.object_ref(&()),
                EventType::Normal,
                ACTION,
                "ReturnedHome",
                note.clone(),
            )
            .await;
            if let Some(owner) = owner {
                self.publish_on(
                    &owner,
                    EventType::Normal,
                    ACTION,
                    "ReturnedHome",
                    format!("pod {name} {note}"),
                )
                .await;
            }
        }
        Ok(acted)
    }
}
