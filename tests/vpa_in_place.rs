//! The VerticalPodAutoscaler resizes a pod in place through the virtual node (issue 50
//! item 5): the VPA's updater (`tensile_harness::vpa`, InPlaceOrRecreate mode) runs against
//! the upper cluster, a Deployment's pod runs on the virtual node with its lower copy on a
//! REAL node (a kubelet actuates the resize; kwok does not), and the updater's resize of
//! the upper pod must reach the lower copy and come back as status, with no pod recreated.
//! The same updater against the lower cluster, resizing a pod on the real node straight,
//! is the reference. Its own test binary: its pair runs a real node.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{TIMEOUT, start_node};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tensile_harness::cluster::Cluster;
use tensile_harness::fixtures::{deployment, merge, pinned_spec};
use tensile_harness::real_node::BUSYBOX_IMAGE;
use tensile_harness::vpa::{self, IN_PLACE_UPDATED_ANNOTATION, VpaBinaries};
use tensile_harness::{
    ClusterPair, PairOptions, RealNode, TestNamespace, VirtualNode, real_node_placement, wait_for,
};
use tokio::sync::OnceCell;

const NODE: &str = "vk-vpa";
const REAL_NODE: &str = "lower-vpa-0";
const APP: &str = "app";
/// A few updater loops, the resize below and its status back up.
const RESIZE_TIMEOUT: Duration = Duration::from_secs(60);

/// The pair, its real node, the virtual node and the VPA's binaries (its CRDs applied in
/// both clusters), shared by this binary's tests.
struct Setup {
    pair: ClusterPair,
    real: RealNode,
    vk: VirtualNode,
    vpa: VpaBinaries,
}

static SETUP: OnceCell<Setup> = OnceCell::const_new();

async fn setup() -> &'static Setup {
    SETUP
        .get_or_init(|| async {
            let vpa = VpaBinaries::locate().unwrap();
            let pair = ClusterPair::start(PairOptions::default()).await.unwrap();
            let real = pair.start_real_node(REAL_NODE).await.unwrap_or_else(|error| {
                panic!("the real node did not start (see tests/harness/src/real_node.rs): {error:#}")
            });
            let vk = start_node(&pair, NODE, &[]).await;
            for cluster in [&pair.upper, &pair.lower] {
                vpa::install_crds(&cluster.client().await.unwrap(), &vpa)
                    .await
                    .unwrap();
            }
            Setup {
                pair,
                real,
                vk,
                vpa,
            }
        })
        .await
}

/// One replica of busybox asking 100m CPU (limit 200m) and 32Mi memory (limit 64Mi), its
/// pod spec `placement` with that container; `annotations` go on its pod template.
fn app(placement: Value, annotations: BTreeMap<String, String>) -> Deployment {
    let mut spec = placement;
    let own = json!({
        "automountServiceAccountToken": false,
        "terminationGracePeriodSeconds": 1,
        "containers": [{
            "name": APP,
            "image": BUSYBOX_IMAGE,
            "command": ["sleep", "3600"],
            "resources": {
                "requests": {"cpu": "100m", "memory": "32Mi"},
                "limits": {"cpu": "200m", "memory": "64Mi"},
            },
        }],
    });
    // Over the placement: its container list (pinned_spec's) is replaced, not kept.
    merge(&mut spec, own);
    let mut app = deployment(APP, 1, spec);
    if let Some(template) = app.spec.as_mut().map(|s| &mut s.template) {
        template.metadata.get_or_insert_default().annotations = Some(annotations);
    }
    app
}

/// The VPA of [`app`] in InPlaceOrRecreate mode on CPU only, with a recommendation of 300m
/// (its bounds too, so the pod's 100m is out of range and resized at once, however young).
async fn autoscale(client: &Client, namespace: &str) {
    let api = vpa::vpa_api(client, namespace);
    let object = vpa::vertical_pod_autoscaler(
        APP,
        APP,
        "InPlaceOrRecreate",
        json!({"containerPolicies": [{"containerName": APP, "controlledResources": ["cpu"]}]}),
    );
    api.create(
        &PostParams::default(),
        &serde_json::from_value(object).unwrap(),
    )
    .await
    .unwrap();
    let cpu = json!({"cpu": "300m"});
    let status = json!({"status": {"recommendation": {"containerRecommendations": [{
        "containerName": APP,
        "target": cpu, "lowerBound": cpu, "upperBound": cpu, "uncappedTarget": cpu,
    }]}}});
    api.patch_status(APP, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
}

/// The one pod of [`app`] in `api` once it is Running.
async fn running_pod(api: &Api<Pod>, what: &str) -> anyhow::Result<Pod> {
    wait_for(
        &format!("{what}: the pod of {APP} Running"),
        TIMEOUT,
        || async {
            let pods = api
                .list(&ListParams::default().labels(&format!("app={APP}")))
                .await?
                .items;
            Ok(match pods.as_slice() {
                [pod] if common::running(pod) => Some(pod.clone()),
                _ => None,
            })
        },
    )
    .await
}

/// CPU (request, limit) of the container in the spec and in its status.
fn cpu(pod: &Pod) -> [(Option<String>, Option<String>); 2] {
    let spec = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers[0].resources.clone());
    let status = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.resources.clone());
    [spec, status].map(|r| {
        let r = r.unwrap_or_default();
        let get = |list: Option<&BTreeMap<String, _>>| {
            list.and_then(|l| l.get("cpu"))
                .map(|q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity| q.0.clone())
        };
        (get(r.requests.as_ref()), get(r.limits.as_ref()))
    })
}

/// Whether a resize is pending or in progress (the conditions the updater waits on).
fn resizing(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| {
            c.iter().any(|c| {
                (c.type_ == "PodResizePending" || c.type_ == "PodResizeInProgress")
                    && c.status == "True"
            })
        })
}

fn restarts(pod: &Pod) -> i32 {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map(|c| c.iter().map(|c| c.restart_count).sum())
        .unwrap_or(-1)
}

/// Runs the updater against `cluster` on `pod` (running in `api`'s namespace) and waits
/// until the pod is resized in place: 300m request, 600m limit (the limit scaled with the
/// request) in its spec and its container status, no resize pending, the same UID, no
/// restart, the updater's annotation.
async fn resized_in_place(setup: &Setup, cluster: &Cluster, api: &Api<Pod>, pod: &Pod) -> Pod {
    let namespace = pod.metadata.namespace.clone().unwrap();
    let name = pod.metadata.name.clone().unwrap();
    let want = (Some("300m".to_owned()), Some("600m".to_owned()));
    let updater = vpa::start_updater(&setup.pair, cluster, &namespace, &setup.vpa).unwrap();
    let waited = wait_for(
        &format!("{}: {namespace}/{name} resized in place", cluster.name),
        RESIZE_TIMEOUT,
        || async {
            let Some(now) = api.get_opt(&name).await? else {
                anyhow::bail!("{namespace}/{name} is gone (recreated?)");
            };
            Ok((cpu(&now) == [want.clone(), want.clone()] && !resizing(&now)).then_some(now))
        },
    )
    .await;
    let resized = match waited {
        Ok(pod) => pod,
        Err(error) => {
            let now = api.get_opt(&name).await.ok().flatten();
            panic!(
                "{error:#}\npod now: {}\n--- {}:\n{}\n--- {}:\n{}\n{}",
                serde_json::to_string(&now).unwrap(),
                updater.log().display(),
                tensile_harness::process::tail(updater.log(), 30),
                setup.vk.log().display(),
                tensile_harness::process::tail(setup.vk.log(), 40),
                setup.real.logs_tail(20),
            )
        }
    };
    assert_eq!(resized.metadata.uid, pod.metadata.uid, "{name}: recreated");
    assert_eq!(restarts(&resized), 0, "{name}: {:?}", resized.status);
    let annotations = resized.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        annotations
            .get(IN_PLACE_UPDATED_ANNOTATION)
            .map(String::as_str),
        Some("true"),
        "{name}: {annotations:?}"
    );
    resized
}

#[tokio::test]
async fn vpa_resizes_a_pod_in_place_through_the_virtual_node() {
    let setup = setup().await;
    let upper = setup.pair.upper.client().await.unwrap();
    let lower = setup.pair.lower.client().await.unwrap();
    let ns = TestNamespace::create(&upper, "vpa-upper").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower, &ns.name);
    // Placed on the virtual node, its lower copy on the real node (as the webhook would).
    let placement = [(
        "clusterSelector".to_owned(),
        real_node_placement().to_string(),
    )];
    Api::<Deployment>::namespaced(upper.clone(), &ns.name)
        .create(
            &PostParams::default(),
            &app(pinned_spec(NODE), placement.into()),
        )
        .await
        .unwrap();
    let pod = running_pod(&upper_pods, "upper").await.unwrap();
    let below = running_pod(&lower_pods, "lower").await.unwrap();
    assert_eq!(
        below.spec.as_ref().and_then(|s| s.node_name.as_deref()),
        Some(REAL_NODE)
    );

    autoscale(&upper, &ns.name).await;
    resized_in_place(setup, &setup.pair.upper, &upper_pods, &pod).await;

    // The lower copy was resized, not replaced.
    let below_now = lower_pods
        .get(below.metadata.name.as_deref().unwrap())
        .await
        .unwrap();
    assert_eq!(
        below_now.metadata.uid, below.metadata.uid,
        "lower copy recreated"
    );
    let want = (Some("300m".to_owned()), Some("600m".to_owned()));
    assert_eq!(cpu(&below_now), [want.clone(), want], "lower copy");
    assert_eq!(
        restarts(&below_now),
        0,
        "lower copy: {:?}",
        below_now.status
    );
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn vpa_resizes_a_pod_in_place_straight_below() {
    let setup = setup().await;
    let lower = setup.pair.lower.client().await.unwrap();
    let ns = TestNamespace::create(&lower, "vpa-lower").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    Api::<Deployment>::namespaced(lower.clone(), &ns.name)
        .create(
            &PostParams::default(),
            &app(real_node_placement(), BTreeMap::new()),
        )
        .await
        .unwrap();
    let pod = running_pod(&pods, "lower").await.unwrap();
    autoscale(&lower, &ns.name).await;
    resized_in_place(setup, &setup.pair.lower, &pods, &pod).await;
    ns.delete().await.unwrap();
}
