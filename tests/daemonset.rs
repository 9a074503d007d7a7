//! DaemonSets and virtual nodes (issue #37): an upper cluster with two regular (kwok)
//! nodes and vk-node, the upper DaemonSet controller, and tensile-webhook registered as
//! deploy/webhook ships it. A DaemonSet tolerating every taint runs on the regular nodes
//! only, nothing of it reaches the lower cluster, and nothing loops; one labelled
//! `tensile.dev/virtual-nodes: allow` runs on vk-node too, mirrored below; one created
//! before the webhook leaves vk-node at its next update.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::descheduler::start_webhook;
use common::{TIMEOUT, start_node};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tensile_harness::{ClusterOptions, ClusterPair, PairOptions, TestNamespace, wait_for};

/// The opt-in label, as README documents it (the webhook's `daemonset::VIRTUAL_NODES_LABEL`).
const VIRTUAL_NODES_LABEL: &str = "tensile.dev/virtual-nodes";
const ALLOW: &str = "allow";
const VK: &str = "vk-node";
const REGULAR: [&str; 2] = ["upper-node-0", "upper-node-1"];
/// How long "nothing changes" is watched for: several DaemonSet controller syncs and
/// virtual-node reconciles.
const QUIET: Duration = Duration::from_secs(15);
const POLL: Duration = Duration::from_millis(500);

/// A DaemonSet `name` whose pods tolerate every taint, as log and metrics agents do.
fn agent(name: &str, labels: Value) -> DaemonSet {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [{"name": "agent", "image": "agent:1"}],
                    "tolerations": [{"operator": "Exists"}],
                },
            },
        },
    }))
    .unwrap()
}

/// What the webhook ANDs into every required node-selector term.
fn off_virtual_nodes() -> Value {
    json!({"key": "type", "operator": "NotIn", "values": ["virtual-kubelet"]})
}

/// Whether every required node-selector term of the template keeps pods off virtual nodes.
fn keeps_off_virtual_nodes(ds: &DaemonSet) -> bool {
    let template = serde_json::to_value(&ds.spec.as_ref().unwrap().template).unwrap();
    let terms = &template["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"];
    terms.as_array().is_some_and(|terms| {
        !terms.is_empty()
            && terms.iter().all(|t| {
                t["matchExpressions"]
                    .as_array()
                    .is_some_and(|e| e.contains(&off_virtual_nodes()))
            })
    })
}

/// Live pods of `app`: name → (uid, node).
async fn placed(api: &Api<Pod>, app: &str) -> anyhow::Result<BTreeMap<String, (String, String)>> {
    let pods = api
        .list(&ListParams::default().labels(&format!("app={app}")))
        .await?
        .items;
    Ok(pods
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| {
            let node = p.spec.and_then(|s| s.node_name).unwrap_or_default();
            (
                p.metadata.name.unwrap_or_default(),
                (p.metadata.uid.unwrap_or_default(), node),
            )
        })
        .collect())
}

fn nodes_of(pods: &BTreeMap<String, (String, String)>) -> Vec<String> {
    let mut nodes: Vec<String> = pods.values().map(|(_, n)| n.clone()).collect();
    nodes.sort();
    nodes
}

/// Waits until `app`'s DaemonSet has synced its current generation with `desired` pods
/// scheduled, and its live pods are on exactly `nodes`.
async fn wait_placed(
    daemonsets: &Api<DaemonSet>,
    pods: &Api<Pod>,
    app: &str,
    nodes: &[&str],
) -> BTreeMap<String, (String, String)> {
    let mut want: Vec<String> = nodes.iter().map(ToString::to_string).collect();
    want.sort();
    wait_for(&format!("{app} on {want:?}"), TIMEOUT, || async {
        let ds = daemonsets.get(app).await?;
        let status = ds.status.clone().unwrap_or_default();
        let synced = status.observed_generation == ds.metadata.generation
            && status.desired_number_scheduled == want.len() as i32
            && status.current_number_scheduled == want.len() as i32;
        let placed = placed(pods, app).await?;
        Ok((synced && nodes_of(&placed) == want).then_some(placed))
    })
    .await
    .unwrap()
}

/// Counts of the DaemonSet's `SuccessfulCreate` and `SuccessfulDelete` Events.
async fn pod_events(events: &Api<Event>, ds: &DaemonSet) -> (i32, i32) {
    let uid = ds.metadata.uid.as_deref().unwrap();
    let list = events
        .list(&ListParams::default().fields(&format!("involvedObject.uid={uid}")))
        .await
        .unwrap()
        .items;
    let count = |reason: &str| {
        list.iter()
            .filter(|e| e.reason.as_deref() == Some(reason))
            .map(|e| e.count.unwrap_or(1))
            .sum()
    };
    (count("SuccessfulCreate"), count("SuccessfulDelete"))
}

/// Over [`QUIET`], the pods of `app` keep their UIDs and nodes, and the DaemonSet its
/// generation, synced.
async fn stays_put(
    daemonsets: &Api<DaemonSet>,
    pods: &Api<Pod>,
    app: &str,
    pods_before: &BTreeMap<String, (String, String)>,
    generation: Option<i64>,
) {
    let deadline = Instant::now() + QUIET;
    let mut interval = tokio::time::interval(POLL);
    while Instant::now() < deadline {
        interval.tick().await;
        let now = placed(pods, app).await.unwrap();
        assert_eq!(&now, pods_before, "{app}'s pods changed");
        let ds = daemonsets.get(app).await.unwrap();
        assert_eq!(
            ds.metadata.generation, generation,
            "{app} changed generation"
        );
        let observed = ds.status.and_then(|s| s.observed_generation);
        // The controller may lag a sync behind, never ahead or elsewhere.
        assert!(
            observed <= generation,
            "{app}: observed {observed:?}, generation {generation:?}"
        );
    }
    let ds = daemonsets.get(app).await.unwrap();
    assert_eq!(
        ds.status.and_then(|s| s.observed_generation),
        generation,
        "{app}: the DaemonSet controller settled"
    );
}

/// Lower pods of `app`, in any namespace.
async fn below(lower: &kube::Client, app: &str) -> usize {
    Api::<Pod>::all(lower.clone())
        .list(&ListParams::default().labels(&format!("app={app}")))
        .await
        .unwrap()
        .items
        .len()
}

/// A label change, carrying the DaemonSet's UID.
async fn relabel(daemonsets: &Api<DaemonSet>, ds: &DaemonSet, key: &str, value: &str) -> DaemonSet {
    let patch = json!({"metadata": {"uid": ds.metadata.uid, "labels": {key: value}}});
    daemonsets
        .patch(
            ds.metadata.name.as_deref().unwrap(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .unwrap()
}

#[tokio::test]
async fn daemonsets_stay_off_virtual_nodes_unless_they_opt_in() {
    let mut options = PairOptions::default();
    options.upper = ClusterOptions {
        nodes: 2,
        ..options.upper
    };
    options.lower = ClusterOptions {
        nodes: 1,
        ..options.lower
    };
    let pair = ClusterPair::start(options).await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    for name in REGULAR {
        wait_for(&format!("{name} Ready"), TIMEOUT, || async {
            Ok(nodes
                .get_opt(name)
                .await?
                .filter(tensile_harness::node_is_ready)
                .map(|_| ()))
        })
        .await
        .unwrap();
    }
    let _vk = start_node(&pair, VK, &[]).await;
    let ns = TestNamespace::create(&upper, "daemonset").await.unwrap();
    let daemonsets: Api<DaemonSet> = Api::namespaced(upper.clone(), &ns.name);
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let events: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    let all = [REGULAR[0], REGULAR[1], VK];

    // Before the webhook, the issue itself: a pod on vk-node, mirrored below.
    let early = daemonsets
        .create(&PostParams::default(), &agent("early", json!({})))
        .await
        .unwrap();
    wait_placed(&daemonsets, &pods, "early", &all).await;
    wait_for("early's pod mirrored below", TIMEOUT, || async {
        Ok((below(&lower, "early").await == 1).then_some(()))
    })
    .await
    .unwrap();

    let webhook = start_webhook(&pair).await;
    // The API server picks the configuration up asynchronously, and fails open for
    // DaemonSets: probe with dry runs until the webhook answers.
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let probe = agent("probe", json!({}));
    let active = wait_for("the webhook to mutate DaemonSets", TIMEOUT, || async {
        let admitted = daemonsets.create(&dry, &probe).await?;
        Ok(keeps_off_virtual_nodes(&admitted).then_some(()))
    })
    .await;
    if let Err(error) = active {
        panic!(
            "{error:#}\n--- tensile-webhook log:\n{}",
            webhook.log_text()
        );
    }

    // Tolerating everything, created with the webhook: the regular nodes only.
    let created = daemonsets
        .create(&PostParams::default(), &agent("agent", json!({})))
        .await
        .unwrap();
    assert!(keeps_off_virtual_nodes(&created), "{:?}", created.spec);
    let placed_agent = wait_placed(&daemonsets, &pods, "agent", &REGULAR).await;
    let generation = created.metadata.generation;
    stays_put(&daemonsets, &pods, "agent", &placed_agent, generation).await;
    assert_eq!(below(&lower, "agent").await, 0, "nothing of agent below");
    assert_eq!(
        pod_events(&events, &created).await,
        (2, 0),
        "agent: one SuccessfulCreate per regular node, no SuccessfulDelete"
    );

    // A label change: the affinity stays, nothing rolls.
    let updated = relabel(&daemonsets, &created, "team", "observability").await;
    assert!(keeps_off_virtual_nodes(&updated), "{:?}", updated.spec);
    assert_eq!(updated.metadata.generation, generation, "no new generation");
    stays_put(&daemonsets, &pods, "agent", &placed_agent, generation).await;
    assert_eq!(pod_events(&events, &created).await, (2, 0), "agent rolled");

    // Opted in: vk-node too, mirrored below.
    let allowed = daemonsets
        .create(
            &PostParams::default(),
            &agent("allowed", json!({VIRTUAL_NODES_LABEL: ALLOW})),
        )
        .await
        .unwrap();
    assert!(
        allowed
            .spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .as_ref()
            .unwrap()
            .affinity
            .is_none(),
        "opted in: no affinity added"
    );
    let placed_allowed = wait_placed(&daemonsets, &pods, "allowed", &all).await;
    wait_for("allowed's pod mirrored below", TIMEOUT, || async {
        Ok((below(&lower, "allowed").await == 1).then_some(()))
    })
    .await
    .unwrap();
    stays_put(
        &daemonsets,
        &pods,
        "allowed",
        &placed_allowed,
        allowed.metadata.generation,
    )
    .await;
    assert_eq!(pod_events(&events, &allowed).await, (3, 0), "allowed");

    // Created before the webhook: its next update adds the affinity, and its pod leaves
    // vk-node (one rollout), the lower pod with it.
    let early = relabel(&daemonsets, &early, "team", "observability").await;
    assert!(keeps_off_virtual_nodes(&early), "{:?}", early.spec);
    wait_placed(&daemonsets, &pods, "early", &REGULAR).await;
    wait_for("early's lower pod gone", TIMEOUT, || async {
        Ok((below(&lower, "early").await == 0).then_some(()))
    })
    .await
    .unwrap();

    ns.delete().await.unwrap();
}
