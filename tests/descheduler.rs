//! tensile-descheduler end to end: an upper cluster with one regular (kwok) node, a lower
//! one of 4-CPU nodes, virtual-node, the webhook, and two descheduler replicas.
//! One pair for every case (they share 2 cores with everything else).
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::time::{Duration, Instant};

use common::descheduler::{
    INTERVAL_SECS, annotation, big_spec, events, node_of, not_in_hostnames, refused_below,
    set_unschedulable, shipped_rbac_kubeconfig, start_descheduler, start_webhook, watch_for_mark,
};
use common::{TIMEOUT, running, start_node};
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use serde_json::json;
use tensile_harness::fixtures::{deployment, pod, with_template_label};
use tensile_harness::{
    ClusterOptions, ClusterPair, NodeShape, PairOptions, TestNamespace, wait_for,
};

const REGULAR: &str = "upper-node-0";

/// The value of one series in OpenMetrics text (0 when absent).
fn counter(metrics: &str, series: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

#[tokio::test]
async fn descheduler_moves_what_the_lower_cluster_cannot_place() {
    let mut options = PairOptions::default();
    options.upper = ClusterOptions {
        nodes: 1,
        ..options.upper
    };
    options.lower.node_shape = NodeShape {
        cpu: "4".into(),
        ..NodeShape::default()
    };
    let pair = ClusterPair::start(options).await.unwrap();
    let upper = pair.upper.client().await.unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    wait_for("the regular upper node", TIMEOUT, || async {
        Ok(nodes
            .get_opt(REGULAR)
            .await?
            .filter(tensile_harness::node_is_ready)
            .map(|_| ()))
    })
    .await
    .unwrap();
    let _webhook = start_webhook(&pair).await;
    let kubeconfig = shipped_rbac_kubeconfig(&pair).await;
    // The first placement must go to the virtual node: keep the regular one closed until
    // the pod is bound.
    set_unschedulable(&nodes, REGULAR, true).await;
    let _vk = start_node(&pair, "vk-node", &[]).await;
    let ns = TestNamespace::create(&upper, "desched").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let event_api: Api<Event> = Api::namespaced(upper.clone(), &ns.name);

    // A Running pod (bound straight to vk-node) and a pod Pending for a reason that is not
    // the lower scheduler's (a ConfigMap that does not exist yet), both to be left alone.
    let mut quiet = pod(
        "quiet",
        json!({"nodeName": "vk-node", "containers": [{"name": "app", "image": "nginx"}]}),
    );
    quiet
        .metadata
        .labels
        .get_or_insert_default()
        .insert("virtual-pod".into(), "true".into());
    pods.create(&PostParams::default(), &quiet).await.unwrap();
    let mut waiting = pod(
        "waiting",
        json!({"nodeName": "vk-node", "containers": [{"name": "app", "image": "nginx",
            "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "missing", "key": "k"}}}]}]}),
    );
    waiting
        .metadata
        .labels
        .get_or_insert_default()
        .insert("virtual-pod".into(), "true".into());
    let waiting_uid = pods
        .create(&PostParams::default(), &waiting)
        .await
        .unwrap()
        .metadata
        .uid;
    wait_for("quiet Running", TIMEOUT, || async {
        Ok(pods.get("quiet").await?).map(|p| running(&p).then_some(()))
    })
    .await
    .unwrap();

    // --dry-run first, alone: it reports, and changes nothing.
    let dry = start_descheduler(
        &pair,
        &kubeconfig,
        "desched-dry",
        // A short lifetime, so that it would also move `waiting` (Pending, not refused).
        &["--dry-run", "--leader-elect=false", "--max-pod-lifetime=1s"],
    );
    let fragmented =
        with_template_label(deployment("big", 1, big_spec("6")), "virtual-pod", "true");
    let deployments: Api<Deployment> = Api::namespaced(upper.clone(), &ns.name);
    deployments
        .create(&PostParams::default(), &fragmented)
        .await
        .unwrap();
    let first = wait_for("big refused below", TIMEOUT, || async {
        let list = pods
            .list(&ListParams::default().labels("app=big"))
            .await?
            .items;
        Ok(list
            .into_iter()
            .find(|p| node_of(p) == Some("vk-node") && refused_below(p)))
    })
    .await
    .unwrap();
    let would = |name: String, why: &'static str| {
        let event_api = event_api.clone();
        async move {
            wait_for(&format!("WouldReschedule for {name}"), TIMEOUT, || async {
                let found = events(&event_api, "WouldReschedule")
                    .await
                    .into_iter()
                    .any(|e| {
                        e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name.as_str())
                            && e.note.as_deref().is_some_and(|n| n.contains(why))
                    });
                Ok(found.then_some(()))
            })
            .await
            .unwrap();
        }
    };
    would(first.metadata.name.clone().unwrap(), "Unschedulable").await;
    would("waiting".into(), "Pending for").await;
    let waiting_now = pods.get("waiting").await.unwrap();
    assert_eq!(
        waiting_now.metadata.uid, waiting_uid,
        "dry run moved waiting"
    );
    assert_eq!(
        annotation(&waiting_now, "sigs.k8s.io/deschedule-count"),
        None
    );
    let still = pods
        .get(first.metadata.name.as_deref().unwrap())
        .await
        .unwrap();
    assert_eq!(still.metadata.uid, first.metadata.uid, "dry run moved it");
    assert_eq!(annotation(&still, "sigs.k8s.io/deschedule-count"), None);
    assert!(events(&event_api, "Rescheduled").await.is_empty());
    let status = dry.terminate().await;
    assert!(status.success(), "dry run exit: {status}");

    // Two replicas; the regular node opens. The pod moves there within about one interval.
    let marked = watch_for_mark(&pods, first.metadata.name.as_deref().unwrap());
    set_unschedulable(&nodes, REGULAR, false).await;
    let refused_at = Instant::now();
    // tensile-kube's policy file; a lifetime long enough that `waiting` stays.
    let policy = pair.dir.join("policy.yaml");
    std::fs::write(
        &policy,
        "apiVersion: descheduler/v1alpha1\nkind: DeschedulerPolicy\nstrategies:\n  PodLifeTime:\n    enabled: true\n    params:\n      maxPodLifeTimeSeconds: 3600\n",
    )
    .unwrap();
    let policy_flag = format!("--policy-config-file={}", policy.display());
    let lease_flags = [
        policy_flag.as_str(),
        "--leader-elect-lease-duration=3s",
        "--leader-elect-renew-deadline=2s",
    ];
    let a = start_descheduler(&pair, &kubeconfig, "desched-a", &lease_flags);
    let b = start_descheduler(&pair, &kubeconfig, "desched-b", &lease_flags);
    let replacement = wait_for("big Running on the regular node", TIMEOUT, || async {
        let list = pods
            .list(&ListParams::default().labels("app=big"))
            .await?
            .items;
        Ok(list
            .into_iter()
            .find(|p| node_of(p) == Some(REGULAR) && running(p)))
    })
    .await
    .unwrap();
    let took = refused_at.elapsed();
    println!(
        "big: refused below → replacement Running on {REGULAR}: {took:?} (includes descheduler start)"
    );
    assert_eq!(
        not_in_hostnames(&replacement),
        [vec!["vk-node".to_owned()]],
        "the webhook keeps the replacement off vk-node"
    );
    let marked = tokio::time::timeout(TIMEOUT, marked)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(annotation(&marked, "unschedulable-node"), Some("vk-node"));
    assert_eq!(
        annotation(&marked, "sigs.k8s.io/deschedule-count"),
        Some("1")
    );
    let moved = events(&event_api, "Rescheduled").await;
    assert!(
        moved
            .iter()
            .any(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref())
                == first.metadata.name.as_deref()
                && e.note
                    .as_deref()
                    .is_some_and(|n| n.contains("vk-node") && n.contains("Unschedulable"))),
        "{moved:?}"
    );

    // Time from the lower verdict to the replacement Running, descheduler already running.
    Api::<Deployment>::namespaced(upper.clone(), &ns.name)
        .delete("big", &Default::default())
        .await
        .unwrap();
    common::wait_gone(&pods, "app=big").await;
    let mut timings = Vec::new();
    for i in 0..5 {
        let name = format!("timed-{i}");
        let labels = format!("app={name}");
        set_unschedulable(&nodes, REGULAR, true).await;
        let timed = with_template_label(deployment(&name, 1, big_spec("6")), "virtual-pod", "true");
        deployments
            .create(&PostParams::default(), &timed)
            .await
            .unwrap();
        wait_for(&format!("{name} bound to vk-node"), TIMEOUT, || async {
            let list = pods
                .list(&ListParams::default().labels(&labels))
                .await?
                .items;
            Ok(list
                .iter()
                .any(|p| node_of(p) == Some("vk-node"))
                .then_some(()))
        })
        .await
        .unwrap();
        // Both moments from a watch, so polling adds nothing to the figure.
        let watched = watcher(pods.clone(), watcher::Config::default().labels(&labels));
        let mut watched = std::pin::pin!(watched.applied_objects());
        set_unschedulable(&nodes, REGULAR, false).await;
        let mut refused = None;
        let ran = tokio::time::timeout(TIMEOUT, async {
            while let Some(pod) = watched.next().await {
                let pod = pod.unwrap();
                if refused.is_none() && refused_below(&pod) {
                    refused = Some(Instant::now());
                }
                if node_of(&pod) == Some(REGULAR) && running(&pod) {
                    return Instant::now();
                }
            }
            panic!("watch ended");
        })
        .await
        .unwrap_or_else(|_| panic!("{name} not Running on {REGULAR} in time"));
        let refused = refused.expect("the refusal was seen");
        timings.push(ran - refused);
        deployments
            .delete(&name, &Default::default())
            .await
            .unwrap();
        common::wait_gone(&pods, &labels).await;
    }
    timings.sort();
    println!(
        "lower Unschedulable → replacement Running: median {:?} of {timings:?}",
        timings[2]
    );
    assert!(
        timings[2] < Duration::from_secs(INTERVAL_SECS + 5),
        "median {:?} not within about one interval",
        timings[2]
    );

    // Nothing but virtual nodes has room now: the regular node is closed again.
    set_unschedulable(&nodes, REGULAR, true).await;
    let _vk2 = start_node(&pair, "vk-node2", &[]).await;
    // A bare pod: re-created with its annotations, the counter, and the NotIn affinity;
    // vk-node2 cannot place it either (nothing else has room), so it moves twice.
    let mut bare = pod("bare", big_spec("6"));
    bare.spec.as_mut().unwrap().node_name = Some("vk-node".into());
    bare.spec.as_mut().unwrap().tolerations = Some(vec![
        serde_json::from_value(tensile_harness::fixtures::virtual_node_toleration()).unwrap(),
    ]);
    bare.metadata.annotations = Some([("keep".to_owned(), "me".to_owned())].into());
    pods.create(&PostParams::default(), &bare).await.unwrap();
    let second = wait_for("bare-2", TIMEOUT, || async {
        Ok(pods.get_opt("bare-2").await?)
    })
    .await
    .unwrap();
    assert_eq!(annotation(&second, "keep"), Some("me"));
    assert_eq!(
        annotation(&second, "sigs.k8s.io/deschedule-count"),
        Some("2")
    );
    assert_eq!(
        annotation(&second, "unschedulable-node"),
        Some("vk-node,vk-node2")
    );
    assert_eq!(
        second
            .metadata
            .labels
            .as_ref()
            .unwrap()
            .get("create-by-descheduler")
            .map(String::as_str),
        Some("true")
    );
    assert_eq!(
        not_in_hostnames(&second),
        [vec!["vk-node".to_owned(), "vk-node2".to_owned()]]
    );
    let rescheduled = events(&event_api, "Rescheduled").await;
    for name in ["bare", "bare-1"] {
        assert!(
            rescheduled
                .iter()
                .any(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)),
            "no Rescheduled for {name}: {rescheduled:?}"
        );
    }
    wait_for("bare and bare-1 gone", TIMEOUT, || async {
        Ok(
            (pods.get_opt("bare").await?.is_none() && pods.get_opt("bare-1").await?.is_none())
                .then_some(()),
        )
    })
    .await
    .unwrap();

    // A pod whose claim was provisioned behind vk-node: the webhook binds every pod of its
    // Deployment straight back there, so moving it would only loop. It stays, with one
    // Event saying why.
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(upper.clone(), &ns.name);
    let claim: PersistentVolumeClaim = serde_json::from_value(json!({
        "metadata": {"name": "pinned-data",
                     "annotations": {"volume.kubernetes.io/selected-node": "vk-node"}},
        "spec": {"storageClassName": "", "accessModes": ["ReadWriteOnce"],
                 "resources": {"requests": {"storage": "1Gi"}}},
    }))
    .unwrap();
    claims.create(&PostParams::default(), &claim).await.unwrap();
    let mut pinned_spec = big_spec("6");
    pinned_spec["volumes"] =
        json!([{"name": "data", "persistentVolumeClaim": {"claimName": "pinned-data"}}]);
    let pinned = with_template_label(deployment("pinned", 1, pinned_spec), "virtual-pod", "true");
    deployments
        .create(&PostParams::default(), &pinned)
        .await
        .unwrap();
    let pinned = wait_for("pinned refused below", TIMEOUT, || async {
        let list = pods
            .list(&ListParams::default().labels("app=pinned"))
            .await?
            .items;
        Ok(list
            .into_iter()
            .find(|p| node_of(p) == Some("vk-node") && refused_below(p)))
    })
    .await
    .unwrap();
    let pinned_name = pinned.metadata.name.clone().unwrap();
    let left_alone = wait_for("pinned left alone, or moved", TIMEOUT, || async {
        let now = pods.get_opt(&pinned_name).await?;
        let moved = now.as_ref().is_none_or(|p| {
            p.metadata.uid != pinned.metadata.uid || annotation(p, "unschedulable-node").is_some()
        });
        let noticed = events(&event_api, "PinnedByVolume")
            .await
            .into_iter()
            .any(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pinned_name.as_str())
                    && e.note.as_deref().is_some_and(|n| n.contains("pinned-data"))
            });
        Ok((moved || noticed).then_some(!moved))
    })
    .await
    .unwrap();
    assert!(
        left_alone,
        "the pinned pod was moved: it would come back to vk-node"
    );

    // A bare pod whose replacement's name is held by a pod the descheduler did not make for
    // it (labelled as a replacement, of an earlier pod of the same name): the original stays.
    let mut imposter = pod(
        "imposter-1",
        json!({"containers": [{"name": "app", "image": "nginx"}]}),
    );
    imposter
        .metadata
        .labels
        .get_or_insert_default()
        .insert("create-by-descheduler".into(), "true".into());
    pods.create(&PostParams::default(), &imposter)
        .await
        .unwrap();
    let mut original = pod("imposter", big_spec("6"));
    original.spec.as_mut().unwrap().node_name = Some("vk-node".into());
    original.spec.as_mut().unwrap().tolerations = Some(vec![
        serde_json::from_value(tensile_harness::fixtures::virtual_node_toleration()).unwrap(),
    ]);
    let original_uid = pods
        .create(&PostParams::default(), &original)
        .await
        .unwrap()
        .metadata
        .uid;
    let kept = wait_for("imposter left alone, or deleted", TIMEOUT, || async {
        let now = pods.get_opt("imposter").await?;
        let deleted = now.is_none_or(|p| p.metadata.uid != original_uid);
        let noticed = events(&event_api, "ReplacementNameTaken")
            .await
            .into_iter()
            .any(|e| {
                e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("imposter")
                    && e.note.as_deref().is_some_and(|n| n.contains("imposter-1"))
            });
        Ok((deleted || noticed).then_some(!deleted))
    })
    .await
    .unwrap();
    assert!(
        kept,
        "imposter was deleted though imposter-1 is not its replacement"
    );

    // Left alone, many rounds later; one Event each, not one a round.
    wait_for("three rounds past both", TIMEOUT, || async {
        let mut rounds = 0;
        for replica in [&a, &b] {
            let (_, metrics) = replica.get("/metrics").await;
            let skipped = |reason: &str| {
                counter(
                    &metrics,
                    &format!("tensile_descheduler_pods_skipped_total{{reason=\"{reason}\"}}"),
                )
            };
            rounds += skipped("pinned_by_claim").min(skipped("replacement_name_taken"));
        }
        Ok((rounds >= 3).then_some(()))
    })
    .await
    .unwrap();
    for reason in ["PinnedByVolume", "ReplacementNameTaken"] {
        let noticed = events(&event_api, reason).await;
        assert_eq!(noticed.len(), 1, "{reason}: {noticed:?}");
        assert_eq!(noticed[0].series, None, "{reason} repeated: {noticed:?}");
    }
    let p = pods.get(&pinned_name).await.unwrap();
    assert_eq!(p.metadata.uid, pinned.metadata.uid);
    assert_eq!(annotation(&p, "sigs.k8s.io/deschedule-count"), None);
    let p = pods.get("imposter").await.unwrap();
    assert_eq!(p.metadata.uid, original_uid);
    for name in ["quiet", "waiting"] {
        let p = pods.get(name).await.unwrap();
        assert_eq!(
            annotation(&p, "sigs.k8s.io/deschedule-count"),
            None,
            "{name}"
        );
        assert_eq!(node_of(&p), Some("vk-node"), "{name}");
    }

    // Only the leader acted.
    let lease = Api::<Lease>::namespaced(upper.clone(), "tensile-system")
        .get("tensile-descheduler")
        .await
        .unwrap();
    let holder = lease.spec.unwrap().holder_identity.unwrap();
    let (a_log, b_log) = (a.log_text(), b.log_text());
    let acted = |log: &str| log.lines().filter(|l| l.contains("rescheduled")).count();
    let (leader_log, other_log) = if holder == "desched-a" {
        (&a_log, &b_log)
    } else {
        (&b_log, &a_log)
    };
    assert_eq!(acted(leader_log), 8, "leader {holder}:\n{leader_log}");
    assert_eq!(acted(other_log), 0, "follower:\n{other_log}");
    assert!(
        leader_log.contains("accepted for tensile-kube compatibility; ignored: --v="),
        "the klog flag is named as ignored:\n{leader_log}"
    );
    let (leader, follower) = if holder == "desched-a" {
        (&a, &b)
    } else {
        (&b, &a)
    };
    let (status, _) = leader.get("/healthz").await;
    assert_eq!(status, 200);
    let (_, metrics) = leader.get("/metrics").await;
    for line in [
        "tensile_descheduler_pods_moved_total 8",
        "tensile_descheduler_leader 1",
        "tensile_descheduler_pods_skipped_total{reason=\"not_pending\"}",
        "tensile_descheduler_pods_skipped_total{reason=\"pinned_by_claim\"}",
        "tensile_descheduler_pods_skipped_total{reason=\"replacement_name_taken\"}",
    ] {
        assert!(metrics.contains(line), "{line} missing:\n{metrics}");
    }
    let (_, metrics) = follower.get("/metrics").await;
    assert!(
        metrics.contains("tensile_descheduler_pods_moved_total 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tensile_descheduler_leader 0"),
        "{metrics}"
    );
    // The leader dies without a word: the other takes over once the Lease expires (3 s),
    // then releases it on SIGTERM.
    let (dead, survivor) = if holder == "desched-a" {
        (a, b)
    } else {
        (b, a)
    };
    dead.kill().await;
    let killed = Instant::now();
    let leases = Api::<Lease>::namespaced(upper.clone(), "tensile-system");
    let survivor_name = if holder == "desched-a" {
        "desched-b"
    } else {
        "desched-a"
    };
    wait_for("the survivor to lead", TIMEOUT, || async {
        let lease = leases.get("tensile-descheduler").await?;
        let now = lease.spec.and_then(|s| s.holder_identity);
        Ok((now.as_deref() == Some(survivor_name)).then_some(()))
    })
    .await
    .unwrap();
    println!(
        "leader killed → the other leads after {:?}",
        killed.elapsed()
    );
    let (_, metrics) = survivor.get("/metrics").await;
    assert!(
        metrics.contains("tensile_descheduler_leader 1"),
        "{metrics}"
    );
    let status = survivor.terminate().await;
    assert!(status.success(), "{status}");
    let released = leases.get("tensile-descheduler").await.unwrap();
    assert_eq!(
        released.spec.unwrap().holder_identity,
        None,
        "released on SIGTERM"
    );
    ns.delete().await.unwrap();
}

#[test]
fn bad_flags_and_policy_files_exit_2_with_one_line() {
    let bin = common::workspace_binary("tensile-descheduler");
    let dir = tempfile::tempdir().unwrap();
    let bad_policy = dir.path().join("policy.yaml");
    std::fs::write(&bad_policy, "kind: ConfigMap\n").unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["--descheduling-interval=soon".into()], "soon"),
        (vec!["--no-such-flag".into()], "--no-such-flag"),
        (
            vec!["--policy-config-file=/nonexistent/policy.yaml".into()],
            "cannot read",
        ),
        (
            vec![format!("--policy-config-file={}", bad_policy.display())],
            "DeschedulerPolicy",
        ),
    ];
    for (args, want) in cases {
        let out = std::process::Command::new(&bin)
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
}
