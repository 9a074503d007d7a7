//! virtual-node against two real clusters: pods mirrored down with what they need, status
//! up, updates and deletions followed, ownership kept between virtual nodes and restarts.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{TIMEOUT, gc_rounds, names, pods, start_node, wait_gone, wait_running};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, ServiceAccount};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tensile::translate::meta::{OWNER_NODE_LABEL, UPPER_UID_ANNOTATION};
use tensile_harness::fixtures::{
    bound_pod, config_map, deployment, merge, pinned_spec, pod, secret,
};
use tensile_harness::{ClusterPair, TestNamespace, VirtualNode, invariant, wait_for};

/// A virtual node and one pod `web` bound to it, in a namespace of its own.
struct OnePod {
    _vn: VirtualNode,
    ns: TestNamespace,
    upper_pods: Api<Pod>,
    lower_pods: Api<Pod>,
}

async fn one_pod(node: &str, namespace: &str) -> OnePod {
    let pair = ClusterPair::shared().await.unwrap();
    let vn = start_node(pair, node, &[]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, namespace).await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper, &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower, &ns.name);
    upper_pods
        .create(&PostParams::default(), &bound_pod("web", node))
        .await
        .unwrap();
    OnePod {
        _vn: vn,
        ns,
        upper_pods,
        lower_pods,
    }
}

fn label(pod: &Pod, key: &str) -> Option<String> {
    pod.metadata.labels.as_ref()?.get(key).cloned()
}

fn annotation(pod: &Pod, key: &str) -> Option<String> {
    pod.metadata.annotations.as_ref()?.get(key).cloned()
}

#[tokio::test]
async fn deployment_runs_below_with_its_dependencies_and_is_cleaned_up() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-deploy";
    let _vn = start_node(pair, node, &[]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "deploy").await.unwrap();
    let pp = PostParams::default();
    Api::<ConfigMap>::namespaced(upper.clone(), &ns.name)
        .create(&pp, &config_map("settings", json!({"greeting": "hello"})))
        .await
        .unwrap();
    Api::<Secret>::namespaced(upper.clone(), &ns.name)
        .create(&pp, &secret("password", json!({"password": "s3cret"})))
        .await
        .unwrap();
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "app"}})).unwrap();
    Api::<ServiceAccount>::namespaced(upper.clone(), &ns.name)
        .create(&pp, &sa)
        .await
        .unwrap();

    let mut spec = pinned_spec(node);
    merge(
        &mut spec,
        json!({
            "serviceAccountName": "app",
            "containers": [{
                "name": "app", "image": "nginx",
                "env": [{"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "password", "key": "password"}}}],
                "volumeMounts": [{"name": "settings", "mountPath": "/etc/settings"}],
            }],
            "volumes": [{"name": "settings", "configMap": {"name": "settings"}}],
        }),
    );
    let deployments: Api<Deployment> = Api::namespaced(upper.clone(), &ns.name);
    deployments
        .create(&pp, &deployment("web", 3, spec))
        .await
        .unwrap();

    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let running = wait_running(&upper_pods, "app=web", 3).await;
    let below = wait_running(&lower_pods, "app=web", 3).await;
    assert_eq!(names(&running), names(&below));

    let upper_by_name: BTreeMap<_, _> = running
        .iter()
        .map(|p| (p.metadata.name.clone().unwrap(), p))
        .collect();
    for lower_pod in &below {
        let upper_pod = upper_by_name[lower_pod.metadata.name.as_ref().unwrap()];
        let (us, ls) = (
            upper_pod.spec.as_ref().unwrap(),
            lower_pod.spec.as_ref().unwrap(),
        );
        // Translated: scheduled by the lower scheduler, not onto the virtual node.
        assert_eq!(us.node_name.as_deref(), Some(node));
        assert!(ls.node_name.as_deref().unwrap().starts_with("lower-node-"));
        assert_eq!(
            ls.node_selector, None,
            "the upper nodeSelector is not carried down"
        );
        // The upper token volume is dropped (the lower cluster injects its own).
        let upper_token = us
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name.starts_with("kube-api-access-"))
            .unwrap();
        assert!(
            ls.volumes
                .iter()
                .flatten()
                .all(|v| v.name != upper_token.name)
        );
        assert_eq!(ls.service_account_name.as_deref(), Some("app"));
        // Marks.
        assert_eq!(label(lower_pod, "virtual-pod").as_deref(), Some("true"));
        assert_eq!(label(lower_pod, OWNER_NODE_LABEL).as_deref(), Some(node));
        assert_eq!(
            annotation(lower_pod, UPPER_UID_ANNOTATION),
            upper_pod.metadata.uid
        );
        // Status reflected with the lower pod IP.
        let ip = |p: &Pod| p.status.as_ref().and_then(|s| s.pod_ip.clone());
        assert_eq!(ip(upper_pod), ip(lower_pod));
    }
    for (kind, owner) in [
        (
            "ConfigMap",
            Api::<ConfigMap>::namespaced(lower.clone(), &ns.name)
                .get("settings")
                .await
                .unwrap()
                .metadata,
        ),
        (
            "Secret",
            Api::<Secret>::namespaced(lower.clone(), &ns.name)
                .get("password")
                .await
                .unwrap()
                .metadata,
        ),
        (
            "ServiceAccount",
            Api::<ServiceAccount>::namespaced(lower.clone(), &ns.name)
                .get("app")
                .await
                .unwrap()
                .metadata,
        ),
    ] {
        let labels = owner.labels.unwrap_or_default();
        assert_eq!(
            labels.get(OWNER_NODE_LABEL).map(String::as_str),
            Some(node),
            "{kind}"
        );
        let annotations = owner.annotations.unwrap_or_default();
        assert_eq!(
            annotations.get("global").map(String::as_str),
            Some("true"),
            "{kind}"
        );
    }

    // Scale down: the lower pods follow.
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 1}})),
        )
        .await
        .unwrap();
    wait_running(&lower_pods, "app=web", 1).await;
    wait_running(&upper_pods, "app=web", 1).await;

    // Delete: nothing left in either cluster.
    deployments
        .delete("web", &DeleteParams::foreground())
        .await
        .unwrap();
    wait_gone(&upper_pods, "app=web").await;
    wait_gone(&lower_pods, "app=web").await;
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn a_lower_pod_deleted_out_of_band_ends_the_upper_pod_and_is_replaced() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-oob";
    let _vn = start_node(pair, node, &[]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "oob").await.unwrap();
    Api::<Deployment>::namespaced(upper.clone(), &ns.name)
        .create(
            &PostParams::default(),
            &deployment("web", 2, pinned_spec(node)),
        )
        .await
        .unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let before = wait_running(&upper_pods, "app=web", 2).await;
    wait_running(&lower_pods, "app=web", 2).await;

    let victim = before[0].metadata.name.clone().unwrap();
    lower_pods
        .delete(&victim, &DeleteParams::default())
        .await
        .unwrap();

    let failed = wait_for("the upper pod to fail", TIMEOUT, || async {
        let p = upper_pods.get(&victim).await?;
        let status = p.status.unwrap_or_default();
        Ok((status.phase.as_deref() == Some("Failed")).then_some(status))
    })
    .await
    .unwrap();
    assert_eq!(failed.reason.as_deref(), Some("LowerPodGone"));
    let after = wait_running(&upper_pods, "app=web", 2).await;
    assert!(
        !names(&after).contains(&victim),
        "a replacement runs instead"
    );
    let below = wait_running(&lower_pods, "app=web", 2).await;
    assert_eq!(names(&after), names(&below));
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn two_virtual_nodes_on_one_lower_cluster_keep_their_own_pods_through_restarts() {
    let pair = ClusterPair::shared().await.unwrap();
    let mut a = start_node(pair, "vk-a", &[]).await;
    let mut b = start_node(pair, "vk-b", &[]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "two-nodes").await.unwrap();
    let deployments: Api<Deployment> = Api::namespaced(upper.clone(), &ns.name);
    for (name, node) in [("app-a", "vk-a"), ("app-b", "vk-b")] {
        deployments
            .create(
                &PostParams::default(),
                &deployment(name, 2, pinned_spec(node)),
            )
            .await
            .unwrap();
    }
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let snapshot = || async {
        let mut uids = BTreeMap::new();
        for (app, node) in [("app-a", "vk-a"), ("app-b", "vk-b")] {
            wait_running(&upper_pods, &format!("app={app}"), 2).await;
            for p in wait_running(&lower_pods, &format!("app={app}"), 2).await {
                assert_eq!(label(&p, OWNER_NODE_LABEL).as_deref(), Some(node));
                uids.insert(
                    p.metadata.name.clone().unwrap(),
                    p.metadata.uid.clone().unwrap(),
                );
            }
        }
        uids
    };
    let before = snapshot().await;

    a.stop().unwrap();
    let mut a = start_node(pair, "vk-a", &[]).await;
    b.kill().unwrap();
    let b = start_node(pair, "vk-b", &[]).await;
    // Both have run orphan collection (two rounds after this point, so that a whole one
    // saw both stores synced) before comparing.
    for vn in [&a, &b] {
        gc_rounds(vn, 2).await;
    }
    assert_eq!(
        snapshot().await,
        before,
        "no lower pod was deleted or re-created"
    );
    a.stop().unwrap();
    ns.delete().await.unwrap();
}

/// Waits until the invariant holds over `node`'s pods, failing with the report.
async fn assert_converges(upper: &kube::Client, lower: &kube::Client, node: &str, after: &str) {
    let (report, took) = invariant::converge(upper, lower, node, None, TIMEOUT)
        .await
        .unwrap();
    println!("after {after}: {report} (converged in {took:?})");
    assert!(report.holds(), "after {after}: {report}");
}

/// A throttled virtual node `node` in the middle of a 100-pod burst (labelled `app=<app>`,
/// in a namespace of their own): at least 20 created below, most not yet.
struct MidBurst {
    vn: VirtualNode,
    ns: TestNamespace,
    upper: kube::Client,
    lower: kube::Client,
    upper_pods: Api<Pod>,
    lower_pods: Api<Pod>,
}

async fn mid_burst(node: &str, app: &str) -> MidBurst {
    let pair = ClusterPair::shared().await.unwrap();
    // Throttled, so that what the test does next lands while pods are still being created.
    let vn = start_node(pair, node, &["--client-qps", "20", "--client-burst", "5"]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, app).await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let creates = (0..100).map(|i| {
        let api = upper_pods.clone();
        async move {
            let mut p = bound_pod(&format!("p-{i:03}"), node);
            p.metadata.labels = Some([("app".to_owned(), app.to_owned())].into());
            api.create(&PostParams::default(), &p).await.unwrap();
        }
    });
    futures::future::join_all(creates).await;
    let selector = format!("app={app}");
    wait_for("some lower pods to exist", TIMEOUT, || async {
        Ok((pods(&lower_pods, &selector).await.len() >= 20).then_some(()))
    })
    .await
    .unwrap();
    MidBurst {
        vn,
        ns,
        upper,
        lower,
        upper_pods,
        lower_pods,
    }
}

#[tokio::test]
async fn killed_mid_burst_it_converges_without_duplicates_or_orphans() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-burst";
    let MidBurst {
        mut vn,
        ns,
        upper,
        lower,
        upper_pods,
        lower_pods,
    } = mid_burst(node, "burst").await;
    vn.kill().unwrap();
    let at_kill = pods(&lower_pods, "app=burst").await.len();
    assert!(at_kill < 100, "killed mid-way ({at_kill} of 100 created)");
    let _vn = start_node(pair, node, &[]).await;

    let running = wait_running(&upper_pods, "app=burst", 100).await;
    let below = wait_running(&lower_pods, "app=burst", 100).await;
    let upper_uids: BTreeSet<_> = running
        .iter()
        .filter_map(|p| p.metadata.uid.clone())
        .collect();
    let marks: Vec<_> = below
        .iter()
        .filter_map(|p| annotation(p, UPPER_UID_ANNOTATION))
        .collect();
    assert_eq!(marks.len(), 100, "every lower pod carries its upper uid");
    assert_eq!(
        marks.iter().cloned().collect::<BTreeSet<_>>(),
        upper_uids,
        "one lower pod per upper pod: no duplicate, no orphan"
    );
    let everywhere = Api::<Pod>::all(lower.clone())
        .list(&ListParams::default().labels(&format!("{OWNER_NODE_LABEL}={node}")))
        .await
        .unwrap();
    assert_eq!(
        everywhere.items.len(),
        100,
        "no stray pods of this node elsewhere"
    );
    assert_converges(&upper, &lower, node, "the kill mid-burst").await;
    ns.delete().await.unwrap();
}

/// SIGTERM in the middle of a 100-pod burst: the process ends with status 0 within 5 s
/// (in-flight work finished or abandoned), and once started again nothing is lost,
/// duplicated or orphaned.
#[tokio::test]
async fn sigterm_mid_burst_exits_within_5_s_and_loses_nothing() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-term";
    let MidBurst {
        mut vn,
        ns,
        upper,
        lower,
        upper_pods,
        lower_pods,
    } = mid_burst(node, "term").await;

    let signalled = std::time::Instant::now();
    vn.signal(nix::sys::signal::Signal::SIGTERM).unwrap();
    let exited = wait_for("virtual-node to exit on SIGTERM", TIMEOUT, || {
        let exited = vn.check_running().err().map(|e| e.to_string());
        async move { Ok(exited) }
    })
    .await
    .unwrap();
    let took = signalled.elapsed();
    let at_exit = pods(&lower_pods, "app=term").await.len();
    println!("SIGTERM with {at_exit} of 100 created below: exited in {took:?}");
    assert!(exited.contains("exit status: 0"), "{exited}");
    assert!(
        at_exit < 100,
        "signalled mid-way ({at_exit} of 100 created)"
    );
    assert!(
        took < std::time::Duration::from_secs(5),
        "exited in {took:?}"
    );

    let _vn = start_node(pair, node, &[]).await;
    wait_running(&upper_pods, "app=term", 100).await;
    assert_converges(&upper, &lower, node, "SIGTERM mid-burst").await;
    ns.delete().await.unwrap();
}

/// SIGKILLed while 100 pods are being deleted, then started again: every lower pod of a
/// deleted upper pod goes, the rest stay, and the invariant holds.
#[tokio::test]
async fn killed_mid_deletion_it_leaves_no_orphans() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-unburst";
    let mut vn = start_node(pair, node, &[]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "unburst").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let creates = (0..120).map(|i| {
        let api = upper_pods.clone();
        async move {
            let mut p = bound_pod(&format!("p-{i:03}"), node);
            let group = if i < 100 { "doomed" } else { "kept" };
            p.metadata.labels = Some([("group".to_owned(), group.to_owned())].into());
            api.create(&PostParams::default(), &p).await.unwrap();
        }
    });
    futures::future::join_all(creates).await;
    wait_running(&lower_pods, "group=doomed", 100).await;
    wait_running(&lower_pods, "group=kept", 20).await;

    // Restarted throttled, so that the kill lands while lower pods are still going.
    vn.kill().unwrap();
    let mut vn = start_node(pair, node, &["--client-qps", "10", "--client-burst", "2"]).await;
    upper_pods
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels("group=doomed"),
        )
        .await
        .unwrap();
    wait_for("some lower pods to go", TIMEOUT, || async {
        Ok((pods(&lower_pods, "group=doomed").await.len() <= 90).then_some(()))
    })
    .await
    .unwrap();
    vn.kill().unwrap();
    let left = pods(&lower_pods, "group=doomed").await.len();
    assert!(left > 0, "killed mid-way ({left} of 100 left below)");
    let _vn = start_node(pair, node, &[]).await;

    wait_gone(&upper_pods, "group=doomed").await;
    wait_gone(&lower_pods, "group=doomed").await;
    let kept = wait_running(&lower_pods, "group=kept", 20).await;
    assert_eq!(kept.len(), 20);
    let what = format!("the kill mid-deletion ({left} left below)");
    assert_converges(&upper, &lower, node, &what).await;
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn a_missing_secret_is_named_in_a_warning_and_the_pod_runs_once_it_exists() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-secret";
    let _vn = start_node(pair, node, &[]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "missing").await.unwrap();
    let mut spec = pinned_spec(node);
    merge(
        &mut spec,
        json!({"nodeName": node, "volumes": [{"name": "s", "secret": {"secretName": "late-secret"}}]}),
    );
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    upper_pods
        .create(&PostParams::default(), &pod("waits", spec))
        .await
        .unwrap();

    let events: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    let event = wait_for("a Warning event naming the secret", TIMEOUT, || async {
        let list = events.list(&ListParams::default()).await?.items;
        Ok(list.into_iter().find(|e| {
            e.type_.as_deref() == Some("Warning")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("waits")
                && e.note.as_deref().is_some_and(|n| n.contains("late-secret"))
        }))
    })
    .await
    .unwrap();
    assert_eq!(event.reason.as_deref(), Some("MissingDependency"));
    let pending = upper_pods.get("waits").await.unwrap().status.unwrap();
    assert_eq!(pending.phase.as_deref(), Some("Pending"));
    assert_eq!(pending.reason.as_deref(), Some("MissingDependency"));
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    assert!(
        lower_pods.get_opt("waits").await.unwrap().is_none(),
        "not created below without its secret"
    );

    Api::<Secret>::namespaced(upper.clone(), &ns.name)
        .create(
            &PostParams::default(),
            &secret("late-secret", json!({"k": "v"})),
        )
        .await
        .unwrap();
    wait_running(&upper_pods, "app=waits", 1).await;
    assert!(
        Api::<Secret>::namespaced(lower, &ns.name)
            .get_opt("late-secret")
            .await
            .unwrap()
            .is_some()
    );
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn updates_kubernetes_allows_reach_the_lower_pod() {
    let node = "vk-update";
    let OnePod {
        _vn,
        ns,
        upper_pods,
        lower_pods,
    } = one_pod(node, "update").await;
    wait_running(&lower_pods, "app=web", 1).await;

    let patch = json!({
        "metadata": {"labels": {"tier": "gold"}, "annotations": {"note": "v2"}},
        "spec": {
            "activeDeadlineSeconds": 3600,
            "containers": [{"name": "app", "image": "nginx:1.27"}],
        },
    });
    upper_pods
        .patch("web", &PatchParams::default(), &Patch::Strategic(&patch))
        .await
        .unwrap();
    let updated = wait_for("the update below", TIMEOUT, || async {
        let p = lower_pods.get("web").await?;
        let spec = p.spec.clone().unwrap_or_default();
        let done = label(&p, "tier").as_deref() == Some("gold")
            && annotation(&p, "note").as_deref() == Some("v2")
            && spec.active_deadline_seconds == Some(3600)
            && spec.containers[0].image.as_deref() == Some("nginx:1.27");
        Ok(done.then_some(p))
    })
    .await
    .unwrap();
    assert_eq!(
        label(&updated, OWNER_NODE_LABEL).as_deref(),
        Some(node),
        "marks kept"
    );

    // A label removed upstream goes below too.
    let remove = json!({"metadata": {"labels": {"tier": null}}});
    upper_pods
        .patch("web", &PatchParams::default(), &Patch::Merge(&remove))
        .await
        .unwrap();
    wait_for("the label removed below", TIMEOUT, || async {
        Ok(label(&lower_pods.get("web").await?, "tier")
            .is_none()
            .then_some(()))
    })
    .await
    .unwrap();
    ns.delete().await.unwrap();
}

#[tokio::test]
async fn a_lower_admission_denial_is_reported_on_the_pending_upper_pod() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-quota";
    let _vn = start_node(pair, node, &[]).await;
    let (upper, lower) = (
        pair.upper.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let ns = TestNamespace::create(&upper, "quota").await.unwrap();
    // The same namespace below, with a quota that admits no pod.
    let lower_ns: k8s_openapi::api::core::v1::Namespace =
        serde_json::from_value(json!({"metadata": {"name": ns.name}})).unwrap();
    Api::all(lower.clone())
        .create(&PostParams::default(), &lower_ns)
        .await
        .unwrap();
    let quota: k8s_openapi::api::core::v1::ResourceQuota = serde_json::from_value(
        json!({"metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}}),
    )
    .unwrap();
    Api::namespaced(lower.clone(), &ns.name)
        .create(&PostParams::default(), &quota)
        .await
        .unwrap();

    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    upper_pods
        .create(&PostParams::default(), &bound_pod("denied", node))
        .await
        .unwrap();
    let events: Api<Event> = Api::namespaced(upper.clone(), &ns.name);
    wait_for("a Warning with the quota message", TIMEOUT, || async {
        let list = events.list(&ListParams::default()).await?.items;
        Ok(list.into_iter().find(|e| {
            e.reason.as_deref() == Some("LowerSyncFailed")
                && e.note
                    .as_deref()
                    .is_some_and(|n| n.contains("exceeded quota"))
        }))
    })
    .await
    .unwrap();
    let status = wait_for("the pending reason", TIMEOUT, || async {
        let status = upper_pods.get("denied").await?.status.unwrap_or_default();
        Ok((status.reason.as_deref() == Some("LowerSyncFailed")).then_some(status))
    })
    .await
    .unwrap();
    assert_eq!(status.phase.as_deref(), Some("Pending"));
    assert!(status.message.unwrap_or_default().contains("no-pods"));
    let name = ns.name.clone();
    ns.delete().await.unwrap();
    Api::<k8s_openapi::api::core::v1::Namespace>::all(lower)
        .delete(&name, &DeleteParams::default())
        .await
        .unwrap();
}

fn ready_condition(pod: &Pod) -> Option<(String, Option<String>)> {
    let condition = pod
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")?;
    Some((condition.status.clone(), condition.reason.clone()))
}

#[tokio::test]
async fn a_lower_readiness_change_is_reflected_up_for_a_running_pod() {
    let OnePod {
        _vn,
        ns,
        upper_pods,
        lower_pods,
    } = one_pod("vk-ready", "ready").await;
    wait_running(&upper_pods, "app=web", 1).await;
    wait_running(&lower_pods, "app=web", 1).await;

    // The lower kubelet (here: the test) reports the readiness probe failing, then passing.
    for (status, reason) in [("False", Some("ContainersNotReady")), ("True", None)] {
        let condition = json!({
            "type": "Ready", "status": status, "reason": reason,
            "lastTransitionTime": k8s_openapi::jiff::Timestamp::now().to_string(),
        });
        lower_pods
            .patch_status(
                "web",
                &PatchParams::default(),
                &Patch::Strategic(json!({"status": {"conditions": [condition]}})),
            )
            .await
            .unwrap();
        let want = (status.to_owned(), reason.map(str::to_owned));
        let reflected = wait_for(&format!("upper Ready={status}"), TIMEOUT, || async {
            let pod = upper_pods.get("web").await?;
            Ok((ready_condition(&pod).as_ref() == Some(&want)).then_some(pod))
        })
        .await
        .unwrap();
        let phase = reflected.status.and_then(|s| s.phase);
        assert_eq!(phase.as_deref(), Some("Running"), "still Running");
    }
    ns.delete().await.unwrap();
}
