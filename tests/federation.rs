//! Federation: one virtual-node process joining three lower clusters, each a member (its
//! own virtual node) taken from member Secrets at run time. Its own test binary, so its
//! clusters have no other tests' pods in them.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::time::Duration;

use common::{TIMEOUT, member_secret, metric};
use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Event, Node, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tensile::member::INJECT_PANIC_ENV;
use tensile::member::spec::{KUBECONFIG_KEY, MEMBER_FINALIZER, MEMBER_LABEL};
use tensile::translate::meta::OWNER_NODE_LABEL;
use tensile_harness::fixtures::{deployment, virtual_node_toleration};
use tensile_harness::{
    ClusterOptions, ClusterPair, TestNamespace, VirtualNodeOptions, invariant, node_is_ready,
    wait_for,
};

/// The watches open on the upper API server, by resource (its
/// `apiserver_longrunning_requests` gauge, every client's together).
async fn open_watches(upper: &Client) -> BTreeMap<String, u64> {
    let request = http::Request::get("/metrics").body(Vec::new()).unwrap();
    let text = upper.request_text(request).await.unwrap();
    let mut watches = BTreeMap::new();
    for line in text.lines() {
        let Some(labels) = line.strip_prefix("apiserver_longrunning_requests{") else {
            continue;
        };
        if !labels.contains("verb=\"WATCH\"") {
            continue;
        }
        let resource = labels
            .split("resource=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .unwrap_or_default();
        let value: f64 = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .expect("a gauge value");
        *watches.entry(resource.to_owned()).or_default() += value as u64;
    }
    assert!(
        !watches.is_empty(),
        "the upper API server reports no apiserver_longrunning_requests WATCH series"
    );
    watches
}

/// Waits for an Event of `reason` on the member Secret `secret` whose message says `says`.
async fn event_on(events: &Api<Event>, secret: &str, reason: &str, says: &str) {
    wait_for(
        &format!("a {reason} Event on the member Secret {secret} saying {says:?}"),
        TIMEOUT,
        || async {
            let found = events.list(&ListParams::default()).await?.items;
            Ok(found
                .iter()
                .any(|e| {
                    e.involved_object.name.as_deref() == Some(secret)
                        && e.reason.as_deref() == Some(reason)
                        && e.message.as_deref().unwrap_or_default().contains(says)
                })
                .then_some(()))
        },
    )
    .await
    .unwrap();
}

/// Pods of `app` in `ns` by the node they are bound to ("" for none).
async fn placement(pods: &Api<Pod>, app: &str) -> BTreeMap<String, usize> {
    let mut by_node = BTreeMap::new();
    for pod in pods
        .list(&ListParams::default().labels(&format!("app={app}")))
        .await
        .unwrap()
        .items
    {
        if pod.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let node = pod.spec.and_then(|s| s.node_name).unwrap_or_default();
        *by_node.entry(node).or_default() += 1;
    }
    by_node
}

async fn running(pods: &Api<Pod>, app: &str) -> usize {
    pods.list(&ListParams::default().labels(&format!("app={app}")))
        .await
        .unwrap()
        .items
        .iter()
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .count()
}

/// Lower objects of `node` left in `lower`: pods and ConfigMaps carrying its mark.
async fn marked_below(lower: &Client, node: &str) -> usize {
    let selector = ListParams::default().labels(&format!("{OWNER_NODE_LABEL}={node}"));
    let pods = Api::<Pod>::all(lower.clone())
        .list(&selector)
        .await
        .unwrap();
    let config_maps = Api::<ConfigMap>::all(lower.clone())
        .list(&selector)
        .await
        .unwrap();
    pods.items.len() + config_maps.items.len()
}

/// The whole membership life cycle on real clusters: three member Secrets make three
/// Ready virtual nodes, which open no more upper watches than one; a Deployment that fits no single member runs across all three,
/// each member's lower pods matching its node's pods upstairs; past the total capacity
/// the surplus stays Pending upstairs and nothing is Pending below; a rotated kubeconfig
/// keeps the node; a bad Secret is named in an Event and the others carry on; a deleted
/// Secret drains its node, cleans its lower cluster and deletes the Node.
#[tokio::test]
async fn three_lower_clusters_joined_from_member_secrets_share_a_deployment() {
    let pair = ClusterPair::shared().await.unwrap();
    // Member A is the pair's lower cluster (3 nodes of 8 CPU); B and C have one node each.
    let (b, c) = tokio::try_join!(
        pair.start_cluster(ClusterOptions::new(
            "lower-b",
            1,
            (Ipv4Addr::new(10, 98, 0, 0), 16),
            "10.245.0.0/16",
        )),
        pair.start_cluster(ClusterOptions::new(
            "lower-c",
            1,
            (Ipv4Addr::new(10, 99, 0, 0), 16),
            "10.246.0.0/16",
        )),
    )
    .unwrap();
    let upper = pair.upper.client().await.unwrap();
    let lowers = [
        ("vk-fed-a", pair.lower.client().await.unwrap()),
        ("vk-fed-b", b.client().await.unwrap()),
        ("vk-fed-c", c.client().await.unwrap()),
    ];
    let members = TestNamespace::create(&upper, "members").await.unwrap();
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    let join = |name: &'static str, node: &'static str, kubeconfig: &std::path::Path| {
        let (secrets, secret) = (secrets.clone(), member_secret(name, node, kubeconfig));
        async move {
            secrets
                .create(&PostParams::default(), &secret)
                .await
                .unwrap()
        }
    };
    join("lower-a", "vk-fed-a", &pair.lower.kubeconfig).await;

    let mut options = VirtualNodeOptions::new(env!("CARGO_BIN_EXE_virtual-node"), "vk-fed");
    options.flags_member = false;
    options.args = vec!["--members-namespace".into(), members.name.clone()];
    // A task of member C panics once, a moment after it started.
    options.envs = vec![(INJECT_PANIC_ENV.into(), "vk-fed-c".into())];
    let mut vn = pair.start_virtual_node(&options).unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    let mut all_ready = async |members: &[(&str, Client)]| {
        for (node, _) in members {
            let ready = wait_for(&format!("node {node} Ready"), TIMEOUT, || async {
                Ok(nodes.get_opt(node).await?.filter(node_is_ready).map(|_| ()))
            })
            .await;
            if let Err(error) = ready {
                let _ = vn.check_running();
                panic!(
                    "{error:#}\n{}",
                    tensile_harness::process::tail(vn.log(), 40)
                );
            }
        }
    };
    all_ready(&lowers[..1]).await;
    let one_member = open_watches(&upper).await;
    println!("upper watches by resource with one member: {one_member:?}");

    join("lower-b", "vk-fed-b", &b.kubeconfig).await;
    join("lower-c", "vk-fed-c", &c.kubeconfig).await;
    // A member Secret that cannot be used: no kubeconfig.
    let mut bad = Secret::default();
    bad.metadata.name = Some("lower-bad".into());
    bad.metadata.labels = Some([(MEMBER_LABEL.to_owned(), "true".to_owned())].into());
    secrets.create(&PostParams::default(), &bad).await.unwrap();
    all_ready(&lowers).await;
    // One watch of each upper kind serves every member: three members open no more
    // upper watches than one (a watch the cluster's own components renew may be missing
    // for a moment, hence the wait).
    let three_members = std::sync::Mutex::new(BTreeMap::new());
    let same = wait_for(
        "as many upper watches with three members as with one",
        Duration::from_secs(30),
        || async {
            let open = open_watches(&upper).await;
            let same = open == one_member;
            *three_members.lock().unwrap() = open;
            Ok(same.then_some(()))
        },
    )
    .await;
    assert!(
        same.is_ok(),
        "upper watches by resource, one member: {one_member:?}; three: {:?}",
        three_members.lock().unwrap()
    );
    let events: Api<Event> = Api::namespaced(upper.clone(), &members.name);
    // Member C's panic ended C alone: named in a Warning on its Secret, restarted with
    // backoff, up again; the process and the other members went on.
    event_on(&events, "lower-c", "MemberFailed", "panicked").await;
    wait_for("member C up again after its panic", TIMEOUT, || async {
        let up = metric(&vn, r#"tensile_member_up{node="vk-fed-c"}"#).await == 1;
        let ready = nodes
            .get_opt("vk-fed-c")
            .await?
            .is_some_and(|n| node_is_ready(&n));
        Ok((up && ready).then_some(()))
    })
    .await
    .unwrap();
    for node in ["vk-fed-a", "vk-fed-b"] {
        assert_eq!(
            metric(&vn, &format!(r#"tensile_member_up{{node="{node}"}}"#)).await,
            1,
            "{node} stays up through C's panic"
        );
    }
    vn.check_running().unwrap();
    event_on(&events, "lower-bad", "MemberInvalid", "kubeconfig").await;
    let with_finalizer = secrets.get("lower-a").await.unwrap();
    assert!(
        with_finalizer
            .finalizers()
            .iter()
            .any(|f| f == MEMBER_FINALIZER),
        "a started member's Secret carries the member finalizer"
    );

    // 10 pods of 4 CPU: 6 fit A (3 nodes x 2), 2 fit B, 2 fit C; no member takes them all.
    let ns = TestNamespace::create(&upper, "fed").await.unwrap();
    let spec = json!({
        "tolerations": [virtual_node_toleration()],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{
                "key": "kubernetes.io/hostname", "operator": "In",
                "values": ["vk-fed-a", "vk-fed-b", "vk-fed-c"]}]}]}}},
        "containers": [{"name": "app", "image": "nginx",
            "resources": {"requests": {"cpu": "4", "memory": "1Gi"}}}],
    });
    let deployments: Api<Deployment> = Api::namespaced(upper.clone(), &ns.name);
    deployments
        .create(&PostParams::default(), &deployment("spread", 10, spec))
        .await
        .unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    wait_for(
        "10 pods Running across the three members",
        TIMEOUT,
        || async { Ok((running(&pods, "spread").await == 10).then_some(())) },
    )
    .await
    .unwrap();
    let placed = placement(&pods, "spread").await;
    for (node, _) in &lowers {
        assert!(
            placed.get(*node).copied().unwrap_or(0) > 0,
            "every member takes some: {placed:?}"
        );
    }
    for (node, lower) in &lowers {
        let (report, _) = invariant::converge(&upper, lower, node, Some(&ns.name), TIMEOUT)
            .await
            .unwrap();
        assert!(report.holds(), "{node}: {report}");
    }

    // Past the total capacity: the surplus waits upstairs, nothing waits below.
    deployments
        .patch(
            "spread",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"replicas": 12}})),
        )
        .await
        .unwrap();
    wait_for("2 pods Pending unscheduled upstairs", TIMEOUT, || async {
        let placed = placement(&pods, "spread").await;
        Ok(
            (placed.get("").copied() == Some(2) && placed.values().sum::<usize>() == 12)
                .then_some(()),
        )
    })
    .await
    .unwrap();
    for (node, lower) in &lowers {
        let below: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
        let pending: Vec<String> = below
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .iter()
            .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Pending"))
            .map(ResourceExt::name_any)
            .collect();
        assert!(pending.is_empty(), "{node}: pending below: {pending:?}");
    }
    deployments
        .patch(
            "spread",
            &PatchParams::default(),
            &Patch::Merge(&json!({"spec": {"replicas": 10}})),
        )
        .await
        .unwrap();

    // A rotated kubeconfig (another identity of the same cluster) keeps the node.
    let node_c = nodes.get("vk-fed-c").await.unwrap();
    let rotated = c
        .kubeconfig_for("tensile-rotated", &["system:masters"])
        .unwrap();
    secrets
        .patch(
            "lower-c",
            &PatchParams::default(),
            &Patch::Merge(
                &json!({"data": {KUBECONFIG_KEY: ByteString(std::fs::read(&rotated).unwrap())}}),
            ),
        )
        .await
        .unwrap();
    wait_for("the rotated member restarted", TIMEOUT, || async {
        let log = std::fs::read_to_string(vn.log())?;
        Ok(log
            .contains("member Secret changed: restarting its member")
            .then_some(()))
    })
    .await
    .unwrap();
    let (report, _) =
        invariant::converge(&upper, &lowers[2].1, "vk-fed-c", Some(&ns.name), TIMEOUT)
            .await
            .unwrap();
    assert!(report.holds(), "vk-fed-c after rotation: {report}");
    let after = nodes.get("vk-fed-c").await.unwrap();
    assert_eq!(
        after.uid(),
        node_c.uid(),
        "the node is kept across a rotation"
    );
    assert!(node_is_ready(&after));

    // A deleted Secret: its member leaves, the others carry on.
    secrets
        .delete("lower-b", &DeleteParams::default())
        .await
        .unwrap();
    wait_for(
        "member B left: Node and Secret gone",
        Duration::from_secs(180),
        || async {
            let node_gone = nodes.get_opt("vk-fed-b").await?.is_none();
            let secret_gone = secrets.get_opt("lower-b").await?.is_none();
            Ok((node_gone && secret_gone).then_some(()))
        },
    )
    .await
    .unwrap();
    assert_eq!(
        marked_below(&lowers[1].1, "vk-fed-b").await,
        0,
        "nothing of member B is left below"
    );
    wait_for("the pods B ran are placed again", TIMEOUT, || async {
        let placed = placement(&pods, "spread").await;
        Ok(
            (!placed.contains_key("vk-fed-b") && placed.values().sum::<usize>() == 10)
                .then_some(()),
        )
    })
    .await
    .unwrap();
    for (node, lower) in [&lowers[0], &lowers[2]] {
        let (report, _) = invariant::converge(&upper, lower, node, Some(&ns.name), TIMEOUT)
            .await
            .unwrap();
        assert!(report.holds(), "{node} after B left: {report}");
    }
    vn.check_running().unwrap();

    deployments
        .delete("spread", &DeleteParams::default())
        .await
        .unwrap();
    for name in ["lower-a", "lower-c", "lower-bad"] {
        let _ = secrets.delete(name, &DeleteParams::default()).await;
    }
    wait_for("members A and C left", Duration::from_secs(180), || async {
        let left = nodes.get_opt("vk-fed-a").await?.is_none()
            && nodes.get_opt("vk-fed-c").await?.is_none();
        Ok(left.then_some(()))
    })
    .await
    .unwrap();
    vn.stop().unwrap();
    ns.delete().await.unwrap();
    members.delete().await.unwrap();
}
