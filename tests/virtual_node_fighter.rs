//! A lower controller that keeps editing tensile's copies (a "fighter") must not draw
//! tensile into an endless write loop: each copy has a write budget, so the lower write
//! rate stays bounded while the fight goes on, an upper edit still gets through at once,
//! the user hears of it once (a Warning on the upper original), and once the fighter
//! stops the copy converges back to the upper content.
//!
//! Prints tensile's lower write rate over a window without the fighter and over the same
//! window with it.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::pin::pin;
use std::time::{Duration, Instant};

use common::{TIMEOUT, lower_writes, start_node, wait_running};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Service};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::await_condition;
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::{Value, json};
use tensile::translate::meta::UPPER_RESOURCE_VERSION_ANNOTATION;
use tensile_harness::fixtures::{config_map, merge, pinned_spec, pod};
use tensile_harness::{ClusterPair, TestNamespace, VirtualNode, wait_for};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// How long the fight, and the quiet window it is compared with, last.
const WINDOW: Duration = Duration::from_secs(30);
/// The first seconds of the fight, where a few rewrites are free, left out of the bound.
const SETTLING: Duration = Duration::from_secs(5);
/// The label the fighter puts on the Service copy.
const FOUGHT_LABEL: &str = "fighter";

/// Lower write counts sampled every second over `WINDOW` (the first at its start);
/// `half_way` is notified once half the window has passed.
async fn sample_writes(vn: &VirtualNode, half_way: &Notify) -> Vec<(Duration, u64)> {
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut samples = Vec::new();
    loop {
        tick.tick().await;
        samples.push((start.elapsed(), lower_writes(vn).await));
        if start.elapsed() >= WINDOW / 2 {
            half_way.notify_one();
        }
        if start.elapsed() >= WINDOW {
            return samples;
        }
    }
}

/// Writes per second between the first sample at or after `from` and the last sample.
fn rate_since(samples: &[(Duration, u64)], from: Duration) -> f64 {
    let (t0, w0) = samples
        .iter()
        .copied()
        .find(|(t, _)| *t >= from)
        .unwrap_or(samples[0]);
    let (t1, w1) = samples[samples.len() - 1];
    (w1 - w0) as f64 / (t1 - t0).as_secs_f64().max(f64::EPSILON)
}

/// Edits `name` below with `patch` whenever it sees it without the edit (`fought` says
/// whether it carries it), as fast as it sees it change back, until `stop`; returns how
/// many edits it made.
async fn fight<K>(
    api: Api<K>,
    name: &str,
    fought: impl Fn(&K) -> bool,
    patch: Value,
    stop: CancellationToken,
) -> u64
where
    K: kube::Resource
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut changes = pin!(
        watcher::watcher(api.clone(), config)
            .default_backoff()
            .applied_objects()
    );
    let mut edits = 0;
    loop {
        tokio::select! {
            () = stop.cancelled() => return edits,
            change = changes.next() => match change {
                Some(Ok(object)) if !fought(&object) => {
                    if api.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await.is_ok() {
                        edits += 1;
                    }
                }
                Some(_) => {}
                None => return edits,
            },
        }
    }
}

fn greeting(cm: &ConfigMap) -> Option<&str> {
    cm.data.as_ref()?.get("greeting").map(String::as_str)
}

fn is_fought(service: &Service) -> bool {
    service
        .metadata
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(FOUGHT_LABEL))
}

#[tokio::test]
async fn a_lower_fighter_does_not_make_a_write_loop() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-fighter";
    // The default controllers (Services included): this is the only test of its process.
    let vn = start_node(pair, node, &[]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "fighter").await.unwrap();
    let pp = PostParams::default();
    let upper_cms: Api<ConfigMap> = Api::namespaced(upper.clone(), &ns.name);
    let lower_cms: Api<ConfigMap> = Api::namespaced(lower.clone(), &ns.name);
    let upper_services: Api<Service> = Api::namespaced(upper.clone(), &ns.name);
    let lower_services: Api<Service> = Api::namespaced(lower.clone(), &ns.name);

    upper_cms
        .create(&pp, &config_map("settings", json!({"greeting": "hello"})))
        .await
        .unwrap();
    let service: Service = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]},
    }))
    .unwrap();
    upper_services.create(&pp, &service).await.unwrap();
    let mut spec = pinned_spec(node);
    merge(
        &mut spec,
        json!({"volumes": [{"name": "settings", "configMap": {"name": "settings"}}]}),
    );
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    upper_pods.create(&pp, &pod("web", spec)).await.unwrap();
    wait_running(&Api::namespaced(lower.clone(), &ns.name), "app=web", 1).await;
    wait_for("the Service copy below", TIMEOUT, || async {
        Ok(lower_services.get_opt("web").await?)
    })
    .await
    .unwrap();

    // Without a fighter.
    let quiet = sample_writes(&vn, &Notify::new()).await;
    let quiet_rate = rate_since(&quiet, Duration::ZERO);

    // With one on the ConfigMap copy and one on the Service copy.
    let stop = CancellationToken::new();
    let cm_fighter = tokio::spawn(fight(
        lower_cms.clone(),
        "settings",
        |cm: &ConfigMap| greeting(cm) == Some("fighter"),
        json!({"data": {"greeting": "fighter"}}),
        stop.clone(),
    ));
    let service_fighter = tokio::spawn(fight(
        lower_services.clone(),
        "web",
        is_fought,
        json!({"metadata": {"labels": {FOUGHT_LABEL: "yes"}}}),
        stop.clone(),
    ));
    let half_way = Notify::new();
    let upper_edit = async {
        // Half-way through the fight, an upper edit must still reach the copy at once.
        half_way.notified().await;
        let start = Instant::now();
        let edited = upper_cms
            .patch(
                "settings",
                &PatchParams::default(),
                &Patch::Merge(json!({"data": {"greeting": "hello-again"}})),
            )
            .await
            .unwrap();
        let version = edited.metadata.resource_version.unwrap();
        tokio::time::timeout(
            TIMEOUT,
            await_condition(lower_cms.clone(), "settings", |cm: Option<&ConfigMap>| {
                cm.and_then(|c| c.metadata.annotations.as_ref())
                    .and_then(|a| a.get(UPPER_RESOURCE_VERSION_ANNOTATION))
                    == Some(&version)
            }),
        )
        .await
        .expect("the upper edit reaches the copy")
        .unwrap();
        start.elapsed()
    };
    let (fought, upper_edit_delay) = tokio::join!(sample_writes(&vn, &half_way), upper_edit);
    stop.cancel();
    let (cm_edits, service_edits) = (cm_fighter.await.unwrap(), service_fighter.await.unwrap());
    let fought_rate = rate_since(&fought, Duration::ZERO);
    let settled_rate = rate_since(&fought, SETTLING);
    eprintln!(
        "lower writes by tensile over {WINDOW:?}: without a fighter {quiet_rate:.2}/s; \
         with fighters {fought_rate:.2}/s ({settled_rate:.2}/s after the first {SETTLING:?}); \
         the fighters made {cm_edits} ConfigMap and {service_edits} Service edits"
    );
    eprintln!("upper edit during the fight -> lower copy: {upper_edit_delay:?}");
    eprintln!(
        "lower write count, per second of the fight: {:?}",
        fought
            .iter()
            .map(|(_, w)| w - fought[0].1)
            .collect::<Vec<_>>()
    );
    assert!(
        settled_rate < 1.0,
        "tensile's lower write rate stays bounded while fought: {settled_rate:.2}/s"
    );
    assert!(
        upper_edit_delay < Duration::from_secs(3),
        "an upper edit gets through at once: {upper_edit_delay:?}"
    );

    // The fighters stopped: the copies converge back to the upper content.
    let start = Instant::now();
    wait_for("the copies back in step", TIMEOUT, || async {
        let cm = lower_cms.get("settings").await?;
        let service = lower_services.get("web").await?;
        Ok((greeting(&cm) == Some("hello-again") && !is_fought(&service)).then_some(()))
    })
    .await
    .unwrap();
    eprintln!("fighters stopped -> copies in step: {:?}", start.elapsed());

    // The user heard of it: a Warning on each upper original.
    let events: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    for (kind, name) in [("ConfigMap", "settings"), ("Service", "web")] {
        let found = wait_for(&format!("a Warning on {kind} {name}"), TIMEOUT, || async {
            let list = events.list(&ListParams::default()).await?.items;
            let about: Vec<Event> = list
                .into_iter()
                .filter(|e| {
                    let regarding = e.regarding.as_ref();
                    regarding.and_then(|r| r.kind.as_deref()) == Some(kind)
                        && regarding.and_then(|r| r.name.as_deref()) == Some(name)
                        && e.reason.as_deref() == Some("LowerCopyContested")
                })
                .collect();
            Ok((!about.is_empty()).then_some(about))
        })
        .await
        .unwrap();
        let note = found[0].note.clone().unwrap_or_default();
        assert!(
            note.contains("lower cluster") && note.contains(&format!("{}/{name}", ns.name)),
            "the Warning names the cluster and the object: {note}"
        );
        assert_eq!(found.len(), 1, "one Warning per episode: {found:?}");
    }

    let name = ns.name.clone();
    ns.delete().await.unwrap();
    let _ = Api::<Namespace>::all(lower)
        .delete(&name, &DeleteParams::default())
        .await;
}
