//! virtual-node keeps what pods depend on in step, against two real clusters: ConfigMaps
//! and Secrets follow their upper originals, Services and their endpoints are mirrored
//! down, lower events about a pod show on the upper pod, and `--enable-controllers=`
//! turns the optional controllers off.
//!
//! Every virtual node started here mirrors the Services of the whole upper cluster unless
//! told otherwise; so that one test's node never owns another test's copies (and leaves
//! them behind when it stops), only the Service test runs `ServiceControllers`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::time::{Duration, Instant};

use common::{TIMEOUT, lower_writes, metric, start_node, wait_running};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Endpoints, Namespace, Pod, Secret, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::await_condition;
use serde_json::json;
use tensile::translate::meta::{LABEL_SELECTOR_ANNOTATION, OWNER_NODE_LABEL};
use tensile_harness::fixtures::{
    bound_pod, config_map, deployment, merge, pinned_spec, pod, secret,
};
use tensile_harness::{ClusterPair, TestNamespace, VirtualNode, wait_for};

/// Only the PV controllers: see the module comment.
const NO_SERVICES: &str = "--enable-controllers=PVControllers";
/// A full resync every second, so that "nothing is written when nothing changed" shows
/// within seconds.
const FAST_RESYNC: &str = "--full-resync-period=1s";

/// Waits until `rounds` full resyncs have passed on a node with `pods` pods (seen through
/// its pod reconcile counter; every controller resyncs on the same period).
async fn resyncs(vn: &VirtualNode, pods: u64, rounds: u64) {
    let series = "tensile_pod_reconciles_total";
    let from = metric(vn, series).await;
    wait_for(&format!("{rounds} resyncs"), TIMEOUT, || async {
        Ok((metric(vn, series).await >= from + pods * rounds).then_some(()))
    })
    .await
    .unwrap();
}

fn owner(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Option<String> {
    meta.labels.as_ref()?.get(OWNER_NODE_LABEL).cloned()
}

fn from<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> T {
    serde_json::from_value(value).unwrap()
}

/// Waits (watching, not polling) until `check` holds for `name`, and returns how long it
/// took from `since`.
async fn watch_until<K>(
    api: &Api<K>,
    name: &str,
    since: Instant,
    check: impl Fn(Option<&K>) -> bool,
) -> Duration
where
    K: Clone + std::fmt::Debug + Send + serde::de::DeserializeOwned + kube::Resource + 'static,
{
    tokio::time::timeout(TIMEOUT, await_condition(api.clone(), name, check))
        .await
        .unwrap_or_else(|_| panic!("timed out waiting on {name}"))
        .unwrap();
    since.elapsed()
}

/// `text` without ANSI escape sequences (the log may be coloured).
fn without_colours(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index]
}

/// Upper events (events.k8s.io) about `name` with `reason`.
async fn events_about(api: &Api<Event>, name: &str, reason: &str) -> Vec<Event> {
    api.list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| {
            e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
                && e.reason.as_deref() == Some(reason)
        })
        .collect()
}

#[tokio::test]
async fn config_maps_and_secrets_follow_their_upper_originals() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-sync-config";
    let vn = start_node(pair, node, &[NO_SERVICES, FAST_RESYNC]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "sync-config").await.unwrap();
    let pp = PostParams::default();
    let (upper_cms, lower_cms): (Api<ConfigMap>, Api<ConfigMap>) = (
        Api::namespaced(upper.clone(), &ns.name),
        Api::namespaced(lower.clone(), &ns.name),
    );
    let (upper_secrets, lower_secrets): (Api<Secret>, Api<Secret>) = (
        Api::namespaced(upper.clone(), &ns.name),
        Api::namespaced(lower.clone(), &ns.name),
    );

    // A lower ConfigMap of the same name as an upper one, that tensile did not make.
    let lower_ns: Namespace = from(json!({"metadata": {"name": ns.name}}));
    Api::<Namespace>::all(lower.clone())
        .create(&pp, &lower_ns)
        .await
        .unwrap();
    lower_cms
        .create(
            &pp,
            &config_map("theirs", json!({"owner": "someone below"})),
        )
        .await
        .unwrap();
    upper_cms
        .create(&pp, &config_map("theirs", json!({"owner": "upper"})))
        .await
        .unwrap();
    upper_cms
        .create(&pp, &config_map("settings", json!({"greeting": "hello"})))
        .await
        .unwrap();
    upper_cms
        .create(&pp, &config_map("extra", json!({"k": "v"})))
        .await
        .unwrap();
    upper_secrets
        .create(&pp, &secret("password", json!({"password": "s3cret"})))
        .await
        .unwrap();

    let mut spec = pinned_spec(node);
    merge(
        &mut spec,
        json!({
            "nodeName": node,
            "containers": [{
                "name": "app", "image": "nginx",
                "env": [{"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "password", "key": "password"}}}],
            }],
            "volumes": [
                {"name": "settings", "configMap": {"name": "settings"}},
                {"name": "theirs", "configMap": {"name": "theirs"}},
            ],
        }),
    );
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    upper_pods.create(&pp, &pod("app", spec)).await.unwrap();
    let mut extra_spec = pinned_spec(node);
    merge(
        &mut extra_spec,
        json!({"nodeName": node, "volumes": [{"name": "extra", "configMap": {"name": "extra"}}]}),
    );
    upper_pods
        .create(&pp, &pod("extra-user", extra_spec))
        .await
        .unwrap();
    wait_running(&lower_pods, "app=app", 1).await;
    wait_running(&lower_pods, "app=extra-user", 1).await;
    for (name, copy) in [
        (
            "settings",
            lower_cms.get("settings").await.unwrap().metadata,
        ),
        ("extra", lower_cms.get("extra").await.unwrap().metadata),
        (
            "password",
            lower_secrets.get("password").await.unwrap().metadata,
        ),
    ] {
        assert_eq!(owner(&copy).as_deref(), Some(node), "{name} is a copy");
    }
    let events: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    wait_for(
        "a Warning that `theirs` is not tensile's",
        TIMEOUT,
        || async {
            Ok(events_about(&events, "theirs", "LowerObjectNotOurs")
                .await
                .into_iter()
                .find(|e| e.type_.as_deref() == Some("Warning")))
        },
    )
    .await
    .unwrap();

    // Upper edits reach the copies; the delay is measured by watching the copy.
    let mut delays = Vec::new();
    for i in 0..10 {
        let value = format!("hello-{i}");
        let start = Instant::now();
        upper_cms
            .patch(
                "settings",
                &PatchParams::default(),
                &Patch::Merge(json!({"data": {"greeting": value}})),
            )
            .await
            .unwrap();
        delays.push(
            watch_until(&lower_cms, "settings", start, |cm: Option<&ConfigMap>| {
                cm.and_then(|c| c.data.as_ref())
                    .and_then(|d| d.get("greeting"))
                    == Some(&value)
            })
            .await,
        );
    }
    delays.sort();
    eprintln!(
        "ConfigMap edit -> lower copy: p50 {:?}, max {:?} over {} edits",
        percentile(&delays, 0.5),
        delays[delays.len() - 1],
        delays.len()
    );
    assert!(
        percentile(&delays, 0.5) < Duration::from_secs(1),
        "an edit reaches the copy within a second: {delays:?}"
    );

    let start = Instant::now();
    upper_secrets
        .patch(
            "password",
            &PatchParams::default(),
            &Patch::Merge(json!({"stringData": {"password": "n3w"}, "metadata": {"labels": {"tier": "gold"}}})),
        )
        .await
        .unwrap();
    let delay = watch_until(&lower_secrets, "password", start, |s: Option<&Secret>| {
        let data = s.and_then(|s| s.data.as_ref());
        let labels = s.and_then(|s| s.metadata.labels.as_ref());
        data.and_then(|d| d.get("password")).map(|v| v.0.as_slice()) == Some(b"n3w")
            && labels.and_then(|l| l.get("tier")).map(String::as_str) == Some("gold")
    })
    .await;
    eprintln!("Secret edit -> lower copy: {delay:?}");

    // An edit made below is undone.
    lower_cms
        .patch(
            "settings",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"greeting": "tampered"}})),
        )
        .await
        .unwrap();
    watch_until(
        &lower_cms,
        "settings",
        Instant::now(),
        |cm: Option<&ConfigMap>| {
            cm.and_then(|c| c.data.as_ref())
                .and_then(|d| d.get("greeting"))
                .is_some_and(|v| v == "hello-9")
        },
    )
    .await;

    // The lower ConfigMap that is not tensile's is never touched: edit its upper
    // namesake, then an upper object tensile does follow; once that edit is below, the
    // foreign one must still be as it was.
    upper_cms
        .patch(
            "theirs",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"owner": "upper, edited"}})),
        )
        .await
        .unwrap();
    let start = Instant::now();
    upper_cms
        .patch(
            "settings",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"greeting": "after"}})),
        )
        .await
        .unwrap();
    watch_until(&lower_cms, "settings", start, |cm: Option<&ConfigMap>| {
        cm.and_then(|c| c.data.as_ref())
            .and_then(|d| d.get("greeting"))
            .is_some_and(|v| v == "after")
    })
    .await;
    let theirs = lower_cms.get("theirs").await.unwrap();
    assert_eq!(theirs.data.unwrap()["owner"], "someone below");
    assert_eq!(owner(&theirs.metadata), None);

    // In step, nothing is written below, resync after resync.
    let before = lower_writes(&vn).await;
    resyncs(&vn, 2, 3).await;
    assert_eq!(
        lower_writes(&vn).await,
        before,
        "no lower write while in step"
    );

    // A copy no pod references any more goes (after a grace period).
    upper_pods
        .delete("extra-user", &DeleteParams::default())
        .await
        .unwrap();
    let start = Instant::now();
    watch_until(&lower_cms, "extra", start, |cm: Option<&ConfigMap>| {
        cm.is_none()
    })
    .await;
    eprintln!(
        "last pod gone -> unreferenced copy removed: {:?}",
        start.elapsed()
    );
    assert!(
        lower_cms.get_opt("settings").await.unwrap().is_some(),
        "a copy still in use stays"
    );

    // Deleting the originals deletes the copies; the foreign object stays.
    let start = Instant::now();
    upper_cms
        .delete("settings", &DeleteParams::default())
        .await
        .unwrap();
    upper_secrets
        .delete("password", &DeleteParams::default())
        .await
        .unwrap();
    upper_cms
        .delete("theirs", &DeleteParams::default())
        .await
        .unwrap();
    watch_until(&lower_cms, "settings", start, |cm: Option<&ConfigMap>| {
        cm.is_none()
    })
    .await;
    let delay = watch_until(&lower_secrets, "password", start, |s: Option<&Secret>| {
        s.is_none()
    })
    .await;
    eprintln!("upper delete -> copies gone: {delay:?}");
    assert!(
        lower_cms.get_opt("theirs").await.unwrap().is_some(),
        "not tensile's: never deleted"
    );

    let name = ns.name.clone();
    ns.delete().await.unwrap();
    Api::<Namespace>::all(lower)
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap();
}

#[tokio::test]
async fn services_and_their_endpoints_are_mirrored_down() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-sync-svc";
    let vn = start_node(pair, node, &[FAST_RESYNC]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "sync-svc").await.unwrap();
    let pp = PostParams::default();
    let upper_services: Api<Service> = Api::namespaced(upper.clone(), &ns.name);
    let lower_services: Api<Service> = Api::namespaced(lower.clone(), &ns.name);
    let upper_slices: Api<EndpointSlice> = Api::namespaced(upper.clone(), &ns.name);
    let lower_slices: Api<EndpointSlice> = Api::namespaced(lower.clone(), &ns.name);
    let lower_endpoints: Api<Endpoints> = Api::namespaced(lower.clone(), &ns.name);

    Api::<Deployment>::namespaced(upper.clone(), &ns.name)
        .create(&pp, &deployment("web", 2, pinned_spec(node)))
        .await
        .unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let running = wait_running(&upper_pods, "app=web", 2).await;
    let ips = |pods: &[Pod]| -> std::collections::BTreeSet<String> {
        pods.iter()
            .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
            .collect()
    };
    let service = |name: &str, spec: serde_json::Value| -> Service {
        from(json!({"metadata": {"name": name, "labels": {"tier": "front"}}, "spec": spec}))
    };
    upper_services
        .create(
            &pp,
            &service(
                "web",
                json!({"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": 80}]}),
            ),
        )
        .await
        .unwrap();
    upper_services
        .create(
            &pp,
            &service(
                "web-headless",
                json!({"clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 80}]}),
            ),
        )
        .await
        .unwrap();
    upper_services
        .create(
            &pp,
            &service(
                "web-nodeport",
                json!({"type": "NodePort", "selector": {"app": "web"}, "ports": [{"port": 80}]}),
            ),
        )
        .await
        .unwrap();

    // The Service, without selector (it is in the annotation), with a lower cluster IP.
    let copy = wait_for("the Service below", TIMEOUT, || async {
        Ok(lower_services.get_opt("web").await?)
    })
    .await
    .unwrap();
    assert_eq!(owner(&copy.metadata).as_deref(), Some(node));
    let lower_spec = copy.spec.clone().unwrap();
    assert_eq!(lower_spec.selector, None);
    assert_eq!(
        copy.metadata.annotations.as_ref().unwrap()[LABEL_SELECTOR_ANNOTATION],
        r#"{"app":"web"}"#
    );
    let upper_ip = upper_services
        .get("web")
        .await
        .unwrap()
        .spec
        .unwrap()
        .cluster_ip
        .unwrap();
    let lower_ip = lower_spec.cluster_ip.unwrap();
    assert!(
        lower_ip.starts_with("10.97."),
        "a lower cluster IP: {lower_ip}"
    );
    assert_ne!(lower_ip, upper_ip);
    assert_eq!(lower_spec.ports.unwrap()[0].port, 80);

    let headless = wait_for("the headless Service below", TIMEOUT, || async {
        Ok(lower_services.get_opt("web-headless").await?)
    })
    .await
    .unwrap();
    assert_eq!(
        headless.spec.unwrap().cluster_ip.as_deref(),
        Some("None"),
        "headless stays headless"
    );
    let node_port = wait_for("the NodePort Service below", TIMEOUT, || async {
        Ok(lower_services.get_opt("web-nodeport").await?)
    })
    .await
    .unwrap()
    .spec
    .unwrap();
    assert_eq!(node_port.type_.as_deref(), Some("ClusterIP"));
    assert!(
        node_port
            .ports
            .unwrap()
            .iter()
            .all(|p| p.node_port.is_none())
    );

    // Its endpoints: the upper pods' addresses, ready, in slices the lower EndpointSlice
    // controllers leave alone, and in an Endpoints for older consumers.
    let want = ips(&running);
    let slices = wait_for("the EndpointSlices below", TIMEOUT, || async {
        let list = lower_slices
            .list(&ListParams::default().labels("kubernetes.io/service-name=web"))
            .await?
            .items;
        let found: std::collections::BTreeSet<String> = list
            .iter()
            .flat_map(|s| s.endpoints.iter().flatten())
            .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
            .flat_map(|e| e.addresses.clone())
            .collect();
        Ok((found == want).then_some(list))
    })
    .await
    .unwrap();
    let upper_slice_names: std::collections::BTreeSet<_> = upper_slices
        .list(&ListParams::default().labels("kubernetes.io/service-name=web"))
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|s| s.metadata.name)
        .collect();
    for slice in &slices {
        let labels = slice.metadata.labels.clone().unwrap();
        assert_eq!(
            labels["endpointslice.kubernetes.io/managed-by"],
            "tensile.dev"
        );
        assert_eq!(labels[OWNER_NODE_LABEL], node);
        assert!(upper_slice_names.contains(slice.metadata.name.as_ref().unwrap()));
        let owner_ref = &slice.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner_ref.kind.as_str(), Some(&owner_ref.uid)),
            ("Service", copy.metadata.uid.as_ref())
        );
    }
    wait_for("the Endpoints below", TIMEOUT, || async {
        let Some(endpoints) = lower_endpoints.get_opt("web").await? else {
            return Ok(None);
        };
        let found: std::collections::BTreeSet<String> = endpoints
            .subsets
            .iter()
            .flatten()
            .flat_map(|s| s.addresses.iter().flatten())
            .map(|a| a.ip.clone())
            .collect();
        let skip = endpoints
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("endpointslice.kubernetes.io/skip-mirror").cloned());
        Ok((found == want && skip.as_deref() == Some("true")).then_some(()))
    })
    .await
    .unwrap();
    // The lower mirroring controller made no slices of its own from them.
    let mirrored_by_lower = lower_slices
        .list(&ListParams::default().labels(
            "endpointslice.kubernetes.io/managed-by=endpointslicemirroring-controller.k8s.io",
        ))
        .await
        .unwrap();
    assert!(mirrored_by_lower.items.is_empty());

    // Updates follow: a port added upstream, a third replica.
    let start = Instant::now();
    upper_services
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"ports": [
                {"name": "http", "port": 80, "targetPort": 80},
                {"name": "admin", "port": 9090, "targetPort": 9090},
            ]}})),
        )
        .await
        .unwrap();
    let delay = watch_until(&lower_services, "web", start, |s: Option<&Service>| {
        s.and_then(|s| s.spec.as_ref()?.ports.as_ref())
            .is_some_and(|p| p.len() == 2)
    })
    .await;
    eprintln!("Service edit -> lower copy: {delay:?}");
    assert_eq!(
        lower_services
            .get("web")
            .await
            .unwrap()
            .spec
            .unwrap()
            .cluster_ip
            .as_deref(),
        Some(lower_ip.as_str()),
        "updated in place"
    );
    Api::<Deployment>::namespaced(upper.clone(), &ns.name)
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 3}})),
        )
        .await
        .unwrap();
    let want = ips(&wait_running(&upper_pods, "app=web", 3).await);
    wait_for("the third endpoint below", TIMEOUT, || async {
        let found: std::collections::BTreeSet<String> = lower_slices
            .list(&ListParams::default().labels("kubernetes.io/service-name=web"))
            .await?
            .items
            .iter()
            .flat_map(|s| s.endpoints.iter().flatten())
            .flat_map(|e| e.addresses.clone())
            .collect();
        Ok((found == want).then_some(()))
    })
    .await
    .unwrap();

    // In step, copies are not rewritten, resync after resync (unless their original
    // changed meanwhile).
    let versions = || async {
        let service = |s: Service| s.metadata.resource_version;
        let endpoints = |e: Endpoints| e.metadata.resource_version;
        let slices = |api: Api<EndpointSlice>| async move {
            let list = api
                .list(&ListParams::default().labels("kubernetes.io/service-name=web"))
                .await
                .unwrap();
            let mut versions: Vec<_> = list
                .items
                .into_iter()
                .map(|s| (s.metadata.name, s.metadata.resource_version))
                .collect();
            versions.sort();
            versions
        };
        let upper_endpoints: Api<Endpoints> = Api::namespaced(upper.clone(), &ns.name);
        [
            (
                format!("{:?}", service(upper_services.get("web").await.unwrap())),
                format!("{:?}", service(lower_services.get("web").await.unwrap())),
            ),
            (
                format!("{:?}", endpoints(upper_endpoints.get("web").await.unwrap())),
                format!("{:?}", endpoints(lower_endpoints.get("web").await.unwrap())),
            ),
            (
                format!("{:?}", slices(upper_slices.clone()).await),
                format!("{:?}", slices(lower_slices.clone()).await),
            ),
        ]
    };
    let before = versions().await;
    resyncs(&vn, 3, 3).await;
    for ((upper_then, lower_then), (upper_now, lower_now)) in before.iter().zip(versions().await) {
        if *upper_then == upper_now {
            assert_eq!(*lower_then, lower_now, "rewritten though in step");
        }
    }

    // A lower Service of that name that tensile did not make is left alone, and said so.
    let foreign: Service = from(json!({
        "metadata": {"name": "theirs"},
        "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 7}]},
    }));
    lower_services.create(&pp, &foreign).await.unwrap();
    upper_services
        .create(
            &pp,
            &service(
                "theirs",
                json!({"selector": {"app": "web"}, "ports": [{"port": 8}]}),
            ),
        )
        .await
        .unwrap();
    let events: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    wait_for(
        "a Warning that `theirs` is not tensile's",
        TIMEOUT,
        || async {
            Ok(events_about(&events, "theirs", "LowerObjectNotOurs")
                .await
                .into_iter()
                .next())
        },
    )
    .await
    .unwrap();
    let untouched = lower_services.get("theirs").await.unwrap();
    assert_eq!(owner(&untouched.metadata), None);
    assert_eq!(untouched.spec.unwrap().ports.unwrap()[0].port, 7);

    // Deletions follow, the endpoints with the Service.
    let start = Instant::now();
    upper_services
        .delete("web", &DeleteParams::default())
        .await
        .unwrap();
    let delay = watch_until(&lower_services, "web", start, |s: Option<&Service>| {
        s.is_none()
    })
    .await;
    eprintln!("Service delete -> lower copy gone: {delay:?}");
    wait_for("the endpoints of web gone below", TIMEOUT, || async {
        let slices = lower_slices
            .list(&ListParams::default().labels("kubernetes.io/service-name=web"))
            .await?;
        let endpoints = lower_endpoints.get_opt("web").await?;
        Ok((slices.items.is_empty() && endpoints.is_none()).then_some(()))
    })
    .await
    .unwrap();
    upper_services
        .delete("theirs", &DeleteParams::default())
        .await
        .unwrap();
    upper_services
        .delete("web-headless", &DeleteParams::default())
        .await
        .unwrap();
    watch_until(
        &lower_services,
        "web-headless",
        Instant::now(),
        |s: Option<&Service>| s.is_none(),
    )
    .await;
    assert!(
        lower_services.get_opt("theirs").await.unwrap().is_some(),
        "not tensile's: never deleted"
    );
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn a_pod_unschedulable_below_shows_why_on_the_upper_pod() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-sync-events";
    let _vn = start_node(pair, node, &[NO_SERVICES]).await;
    let upper = pair.upper.client().await.unwrap();
    let ns = TestNamespace::create(&upper, "sync-events").await.unwrap();
    // The webhook's stash: below, the pod asks for a node label no lower node has.
    let mut stuck = bound_pod("stuck", node);
    stuck.metadata.annotations = Some(
        [(
            "clusterSelector".to_owned(),
            json!({"nodeSelector": {"disk": "nvme"}}).to_string(),
        )]
        .into(),
    );
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    upper_pods
        .create(&PostParams::default(), &stuck)
        .await
        .unwrap();

    let events: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    let event = wait_for("FailedScheduling on the upper pod", TIMEOUT, || async {
        Ok(events_about(&events, "stuck", "FailedScheduling")
            .await
            .into_iter()
            .next())
    })
    .await
    .unwrap();
    let note = event.note.unwrap_or_default();
    assert!(
        note.contains("didn't match Pod's node affinity/selector"),
        "the lower scheduler's message: {note}"
    );
    assert_eq!(event.type_.as_deref(), Some("Warning"));
    let regarding = event.regarding.unwrap();
    assert_eq!(
        regarding.uid,
        upper_pods.get("stuck").await.unwrap().metadata.uid,
        "about the upper pod"
    );
    // As `kubectl describe pod` reads them (core/v1).
    let described = Api::<k8s_openapi::api::core::v1::Event>::namespaced(upper.clone(), &ns.name)
        .list(&ListParams::default().fields("involvedObject.name=stuck,reason=FailedScheduling"))
        .await
        .unwrap();
    assert!(!described.items.is_empty());
    let status = upper_pods.get("stuck").await.unwrap().status.unwrap();
    assert_eq!(status.phase.as_deref(), Some("Pending"));
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn empty_enable_controllers_turns_the_optional_controllers_off() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-sync-off";
    let vn = start_node(pair, node, &["--enable-controllers="]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "sync-off").await.unwrap();
    let pp = PostParams::default();
    let service: Service = from(json!({
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]},
    }));
    Api::<Service>::namespaced(upper.clone(), &ns.name)
        .create(&pp, &service)
        .await
        .unwrap();
    Api::<ConfigMap>::namespaced(upper.clone(), &ns.name)
        .create(&pp, &config_map("settings", json!({"a": "1"})))
        .await
        .unwrap();
    let mut spec = pinned_spec(node);
    merge(
        &mut spec,
        json!({"nodeName": node, "volumes": [{"name": "s", "configMap": {"name": "settings"}}]}),
    );
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    upper_pods.create(&pp, &pod("web", spec)).await.unwrap();
    wait_running(&upper_pods, "app=web", 1).await;

    // The always-on ConfigMap/Secret controller works ...
    let lower_cms: Api<ConfigMap> = Api::namespaced(lower.clone(), &ns.name);
    let start = Instant::now();
    Api::<ConfigMap>::namespaced(upper.clone(), &ns.name)
        .patch(
            "settings",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"a": "2"}})),
        )
        .await
        .unwrap();
    watch_until(&lower_cms, "settings", start, |cm: Option<&ConfigMap>| {
        cm.and_then(|c| c.data.as_ref())
            .is_some_and(|d| d.get("a").map(String::as_str) == Some("2"))
    })
    .await;
    // ... and since well before that edit went through, the upper Service has been there
    // for this node to mirror, had its Service controller run.
    let ours = format!("{OWNER_NODE_LABEL}={node}");
    let services = Api::<Service>::all(lower.clone())
        .list(&ListParams::default().labels(&ours))
        .await
        .unwrap();
    assert!(services.items.is_empty(), "no Service mirrored by {node}");
    let log = without_colours(&std::fs::read_to_string(vn.log()).unwrap());
    assert!(
        log.contains("pv_controllers=false") && log.contains("service_controllers=false"),
        "the start line says which controllers run"
    );
    ns.delete().await.unwrap();
}
