//! Members leaving and restarting, and `join`/`leave` from two upper clusters:
//! - a copy that another member's pod uses below stays when the member that made it
//!   leaves (handed to the other member, which removes it once unused);
//! - a leave ends within `--leave-timeout` even once the lower cluster is gone, its pods
//!   deleted upstairs, said in an Event;
//! - a member that restarts again and again costs no list of the upper pods, and the
//!   other member's pods carry on;
//! - two upper clusters that join one lower cluster under one node name each have their
//!   own identity below: a `leave` from one leaves the other's working; an identity of
//!   the naming before is deleted only by the upper cluster whose member Secret holds it;
//! - `virtual-node uninstall` removes the node of the flags as a member leaves: drained
//!   while virtual-node runs, virtual-node's Deployment scaled to 0, then its lower
//!   objects, Node and Lease deleted; again, it finds nothing to do.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{TIMEOUT, member_secret, wait_running};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{
    ConfigMap, EnvFromSource, Event, Namespace, Node, Pod, Secret, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleRef, Subject};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;
use tensile::member::join::{LOWER_NAMESPACE, LowerIdentity, member_kubeconfig};
use tensile::member::spec::{CLIENT_QPS_ANNOTATION, KUBECONFIG_KEY};
use tensile::translate::meta::{OWNER_NODE_LABEL, Owner};
use tensile_harness::fault_proxy::{Fault, FaultProxy};
use tensile_harness::fixtures::{bound_pod, config_map};
use tensile_harness::ports::free_port;
use tensile_harness::{
    ClusterOptions, ClusterPair, TestNamespace, VirtualNode, VirtualNodeOptions,
    node_is_schedulable, wait_for,
};

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_virtual-node"))
}

/// The identity tensile gives an upper cluster by default: its kube-system namespace's UID.
async fn cluster_id(upper: &Client) -> String {
    Api::<Namespace>::all(upper.clone())
        .get("kube-system")
        .await
        .unwrap()
        .uid()
        .unwrap()
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

/// Waits until `pods` has `name` Running; the virtual node's log tail on failure.
async fn until_running(pods: &Api<Pod>, name: &str, vn: &mut VirtualNode) {
    let running = wait_for(&format!("pod {name} Running"), TIMEOUT, || async {
        let pod = pods.get_opt(name).await?;
        Ok(pod
            .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            .map(|_| ()))
    })
    .await;
    if let Err(error) = running {
        let _ = vn.check_running();
        panic!(
            "{error:#}\n{}",
            tensile_harness::process::tail(vn.log(), 40)
        );
    }
}

/// Waits until the member Secret `name` and the Node `node` are gone (the member left).
async fn until_left(
    secrets: &Api<Secret>,
    nodes: &Api<Node>,
    name: &str,
    node: &str,
    within: Duration,
) {
    wait_for(&format!("member {node} left"), within, || async {
        let left = secrets.get_opt(name).await?.is_none() && nodes.get_opt(node).await?.is_none();
        Ok(left.then_some(()))
    })
    .await
    .unwrap();
}

/// A pod bound to `node` that takes its environment from the ConfigMap `config_map`.
fn pod_using(name: &str, node: &str, config_map: &str) -> Pod {
    let mut pod = bound_pod(name, node);
    pod.metadata.labels = Some([("app".to_owned(), name.to_owned())].into());
    if let Some(spec) = pod.spec.as_mut() {
        for container in &mut spec.containers {
            container.env_from = Some(vec![EnvFromSource {
                config_map_ref: Some(k8s_openapi::api::core::v1::ConfigMapEnvSource {
                    name: config_map.to_owned(),
                    optional: Some(false),
                }),
                ..Default::default()
            }]);
        }
    }
    pod
}

/// Two members on one lower cluster: B's pod uses the copy of a ConfigMap that A made.
/// A leaves: the copy stays (now B's) and B's pod runs on; once B's pod is gone, B removes
/// the copy.
#[tokio::test]
async fn a_copy_another_members_pod_uses_stays_when_its_maker_leaves() {
    let pair = ClusterPair::shared().await.unwrap();
    let (a, b) = ("vk-share-a", "vk-share-b");
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let id = cluster_id(&upper).await;
    let members = TestNamespace::create(&upper, "share-members")
        .await
        .unwrap();
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    for node in [a, b] {
        secrets
            .create(
                &PostParams::default(),
                &member_secret(node, node, &pair.lower.kubeconfig),
            )
            .await
            .unwrap();
    }
    let mut vn = pair
        .serve_members(binary(), "vk-share", &members.name, &[a, b], &[])
        .await
        .unwrap();
    let ns = TestNamespace::create(&upper, "share").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let lower_config_maps: Api<ConfigMap> = Api::namespaced(lower.clone(), &ns.name);
    Api::<ConfigMap>::namespaced(upper.clone(), &ns.name)
        .create(
            &PostParams::default(),
            &config_map("shared", json!({"GREETING": "hello"})),
        )
        .await
        .unwrap();

    upper_pods
        .create(&PostParams::default(), &pod_using("on-a", a, "shared"))
        .await
        .unwrap();
    until_running(&upper_pods, "on-a", &mut vn).await;
    let copy = lower_config_maps.get("shared").await.unwrap();
    assert_eq!(
        copy.labels().get(OWNER_NODE_LABEL).map(String::as_str),
        Some(a),
        "A made the copy"
    );
    upper_pods
        .create(&PostParams::default(), &pod_using("on-b", b, "shared"))
        .await
        .unwrap();
    until_running(&upper_pods, "on-b", &mut vn).await;
    let below_b = wait_running(&lower_pods, "app=on-b", 1).await;

    secrets.delete(a, &DeleteParams::default()).await.unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    until_left(&secrets, &nodes, a, a, Duration::from_secs(180)).await;

    let kept = lower_config_maps.get_opt("shared").await.unwrap();
    assert_eq!(
        kept.as_ref().and_then(ResourceExt::uid),
        copy.uid(),
        "the copy B's pod uses stays"
    );
    assert!(
        Owner::new(b, &id).owns(kept.as_ref().map(|c| c.labels())),
        "the copy is B's now: {:?}",
        kept.map(|c| c.labels().clone())
    );
    assert_eq!(
        lower_pods.get("on-b").await.unwrap().uid(),
        below_b[0].uid(),
        "B's pod below runs on"
    );
    assert_eq!(
        upper_pods
            .get("on-b")
            .await
            .unwrap()
            .status
            .and_then(|s| s.phase)
            .as_deref(),
        Some("Running")
    );

    // B's now: B removes it once no pod uses it.
    upper_pods
        .delete("on-b", &DeleteParams::default())
        .await
        .unwrap();
    wait_for("B removes the copy no pod uses", TIMEOUT, || async {
        Ok(lower_config_maps
            .get_opt("shared")
            .await?
            .is_none()
            .then_some(()))
    })
    .await
    .unwrap();
    secrets.delete(b, &DeleteParams::default()).await.unwrap();
    until_left(&secrets, &nodes, b, b, Duration::from_secs(180)).await;
    vn.check_running().unwrap();
    vn.stop().unwrap();
    ns.delete().await.unwrap();
    members.delete().await.unwrap();
}

/// A member whose lower cluster is gone (its API server answers nothing) leaves within
/// `--leave-timeout`: its evicted pods, which only it could end, are deleted upstairs with
/// no grace period, and Events say so.
#[tokio::test]
async fn a_leave_ends_within_the_leave_timeout_once_the_lower_cluster_is_gone() {
    const TIMEOUT_FLAG: Duration = Duration::from_secs(15);
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-gone";
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let proxy = FaultProxy::start(lower.clone()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxied = proxy
        .write_kubeconfig(&dir.path().join("proxy.kubeconfig"))
        .unwrap();
    let members = TestNamespace::create(&upper, "gone-members").await.unwrap();
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    secrets
        .create(&PostParams::default(), &member_secret(node, node, &proxied))
        .await
        .unwrap();
    let mut vn = pair
        .serve_members(
            binary(),
            "vk-gone",
            &members.name,
            &[node],
            &["--leave-timeout=15s".to_owned()],
        )
        .await
        .unwrap();
    let ns = TestNamespace::create(&upper, "gone").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    for name in ["one", "two"] {
        upper_pods
            .create(&PostParams::default(), &bound_pod(name, node))
            .await
            .unwrap();
    }
    until_running(&upper_pods, "one", &mut vn).await;
    until_running(&upper_pods, "two", &mut vn).await;

    // The lower API server gone: every connection closed unanswered.
    proxy.set(Fault::Reset, 100);
    let deleted = Instant::now();
    secrets
        .delete(node, &DeleteParams::default())
        .await
        .unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    // The bound, and the lower cluster's last try (20 s), the member's stop and a poll.
    until_left(
        &secrets,
        &nodes,
        node,
        node,
        TIMEOUT_FLAG + Duration::from_secs(60),
    )
    .await;
    println!("left in {:?} with --leave-timeout 15s", deleted.elapsed());
    // No sooner than the bound (from the deletion time, which has whole seconds).
    assert!(
        deleted.elapsed() >= TIMEOUT_FLAG - Duration::from_secs(1),
        "forced no sooner than the bound"
    );
    for name in ["one", "two"] {
        assert!(
            upper_pods.get_opt(name).await.unwrap().is_none(),
            "upper pod {name} is gone"
        );
    }
    let events: Api<Event> = Api::namespaced(upper.clone(), &members.name);
    event_on(
        &events,
        node,
        "MemberLeaveForced",
        "2 pods not ended within --leave-timeout (15s)",
    )
    .await;
    event_on(
        &events,
        node,
        "MemberLeftUncleaned",
        "given up after --leave-timeout (15s)",
    )
    .await;
    vn.check_running().unwrap();
    vn.stop().unwrap();

    // What stays below (named by the Event's label) is this test's to remove.
    let id = cluster_id(&upper).await;
    let owned = ListParams::default().labels(&Owner::new(node, &id).selector());
    for pod in Api::<Pod>::all(lower.clone())
        .list(&owned)
        .await
        .unwrap()
        .items
    {
        Api::<Pod>::namespaced(lower.clone(), &pod.namespace().unwrap())
            .delete(&pod.name_any(), &DeleteParams::default())
            .await
            .unwrap();
    }
    ns.delete().await.unwrap();
    members.delete().await.unwrap();
}

/// Lines of the virtual node's log that say `text`.
fn said(vn: &VirtualNode, text: &str) -> usize {
    std::fs::read_to_string(vn.log())
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(text))
        .count()
}

/// Member B restarts again and again (its Secret changed each time): the shared upper pod
/// watch is not listed again (each restart of B is handed a list of its own node's pods),
/// A's pods run meanwhile, and B works after.
#[tokio::test]
async fn a_member_restarting_again_and_again_costs_no_list_of_every_bound_pod() {
    const RESTARTS: usize = 5;
    let pair = ClusterPair::shared().await.unwrap();
    let (a, b) = ("vk-loop-a", "vk-loop-b");
    let upper = pair.upper.client().await.unwrap();
    let proxy = FaultProxy::start(upper.clone()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxied = proxy
        .write_kubeconfig(&dir.path().join("upper.kubeconfig"))
        .unwrap();
    let members = TestNamespace::create(&upper, "loop-members").await.unwrap();
    let secrets: Api<Secret> = Api::namespaced(upper.clone(), &members.name);
    for node in [a, b] {
        secrets
            .create(
                &PostParams::default(),
                &member_secret(node, node, &pair.lower.kubeconfig),
            )
            .await
            .unwrap();
    }
    let mut options = VirtualNodeOptions::new(binary(), "vk-loop");
    options.flags_member = false;
    options.upper_kubeconfig = Some(proxied);
    options.args = vec!["--members-namespace".into(), members.name.clone()];
    let mut vn = pair.start_virtual_node(&options).unwrap();
    let nodes: Api<Node> = Api::all(upper.clone());
    for node in [a, b] {
        let ready = wait_for(&format!("node {node} schedulable"), TIMEOUT, || async {
            Ok(nodes
                .get_opt(node)
                .await?
                .filter(node_is_schedulable)
                .map(|_| ()))
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
    let ns = TestNamespace::create(&upper, "loop").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    pods.create(&PostParams::default(), &bound_pod("b-before", b))
        .await
        .unwrap();
    until_running(&pods, "b-before", &mut vn).await;
    // A figure, not a bound (2 shared cores time nothing stably): A's pod created ->
    // Running upstairs, B calm and B restarting.
    let started = Instant::now();
    pods.create(&PostParams::default(), &bound_pod("a-calm", a))
        .await
        .unwrap();
    until_running(&pods, "a-calm", &mut vn).await;
    let calm = started.elapsed();
    let mut restarting = Vec::new();
    let before = proxy.requests();

    for restart in 1..=RESTARTS {
        let patch = json!({"metadata": {"annotations": {
            CLIENT_QPS_ANNOTATION: format!("{}", 100 + restart)
        }}});
        secrets
            .patch(b, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
        wait_for(
            &format!("member B restarted ({restart})"),
            TIMEOUT,
            || async { Ok((said(&vn, "restarting its member") >= restart).then_some(())) },
        )
        .await
        .unwrap();
        // A's pods carry on while B restarts.
        let name = format!("a-{restart}");
        let started = Instant::now();
        pods.create(&PostParams::default(), &bound_pod(&name, a))
            .await
            .unwrap();
        until_running(&pods, &name, &mut vn).await;
        restarting.push(started.elapsed());
    }
    pods.create(&PostParams::default(), &bound_pod("b-after", b))
        .await
        .unwrap();
    until_running(&pods, "b-after", &mut vn).await;
    let during = proxy.requests().since(&before);
    println!(
        "member A: a pod created -> Running in {calm:?} with B calm, {:?} at most while B restarts",
        restarting.iter().max()
    );
    // Each restart is handed a list of B's own node's pods, never the list of every bound
    // pod that would hold up member A's pod events.
    assert_eq!(
        during.count_selected("list", "pods", "spec.nodeName!="),
        0,
        "no list of every bound pod during {RESTARTS} restarts of member B: {during:?}"
    );
    let own = during.count_selected("list", "pods", &format!("spec.nodeName={b}"));
    assert!(
        during.count("list", "pods") == own && own <= RESTARTS as u64,
        "only lists of B's own node, one a restart at most, during {RESTARTS} restarts: {own} of {during:?}"
    );

    for node in [a, b] {
        secrets
            .delete(node, &DeleteParams::default())
            .await
            .unwrap();
    }
    for node in [a, b] {
        until_left(&secrets, &nodes, node, node, Duration::from_secs(180)).await;
    }
    vn.check_running().unwrap();
    vn.stop().unwrap();
    ns.delete().await.unwrap();
    members.delete().await.unwrap();
}

/// Runs `virtual-node <verb>` for `node` in the members namespace `namespace` of the upper
/// cluster of `upper`, with the pair's lower cluster; what it printed, and whether it
/// succeeded.
async fn member_command(
    pair: &ClusterPair,
    verb: &str,
    upper: &Path,
    node: &str,
    namespace: &str,
) -> (bool, String) {
    let output = tokio::process::Command::new(binary())
        .arg(verb)
        .args(["--nodename", node, "--members-namespace", namespace])
        .arg("--kubeconfig")
        .arg(upper)
        .arg("--client-kubeconfig")
        .arg(pair.lower_kubeconfig())
        .arg(format!("--metrics-addr=127.0.0.1:{}", free_port().unwrap()))
        .output()
        .await
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), said)
}

/// A client of the lower cluster as the kubeconfig `text` (a member Secret's).
async fn client_of(text: &str) -> Client {
    let kubeconfig = kube::config::Kubeconfig::from_yaml(text).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    Client::try_from(config).unwrap()
}

/// The kubeconfig of the member Secret `name` in `namespace` of `upper`.
async fn member_kubeconfig_of(upper: &Client, namespace: &str, name: &str) -> String {
    let secret = Api::<Secret>::namespaced(upper.clone(), namespace)
        .get(name)
        .await
        .unwrap();
    String::from_utf8(secret.data.unwrap().remove(KUBECONFIG_KEY).unwrap().0).unwrap()
}

/// Whether `client` (a member identity) is still let in: 401 is no.
async fn authenticates(client: &Client) -> bool {
    match Api::<Pod>::namespaced(client.clone(), LOWER_NAMESPACE)
        .list(&ListParams::default().limit(1))
        .await
    {
        Ok(_) => true,
        // Let in, and refused by its RBAC: authenticated all the same.
        Err(kube::Error::Api(status)) if status.code == 403 => true,
        Err(kube::Error::Api(status)) if status.code == 401 => false,
        Err(error) => panic!("listing pods as a member identity: {error}"),
    }
}

/// Two upper clusters join one lower cluster under one node name: each has its own
/// identity below, and a `leave` from one leaves the other's kubeconfig working. An
/// identity of the naming before (`tensile-<node>`) is kept by a `leave` from the cluster
/// whose member Secret does not hold its token, and deleted by the one whose does.
#[tokio::test]
async fn two_upper_clusters_join_one_lower_cluster_and_leave_alone() {
    let pair = ClusterPair::shared().await.unwrap();
    let second = pair
        .start_cluster(ClusterOptions::new(
            "upper-join",
            0,
            (Ipv4Addr::new(10, 98, 0, 0), 16),
            "10.225.0.0/16",
        ))
        .await
        .unwrap();
    let (upper, upper_2, lower) = (
        pair.upper.client().await.unwrap(),
        second.client().await.unwrap(),
        pair.lower.client().await.unwrap(),
    );
    let node = "vk-twice";
    let members = TestNamespace::create(&upper, "twice").await.unwrap();
    common::create_namespace(&upper_2, &members.name, Default::default()).await;
    for kubeconfig in [&pair.upper.kubeconfig, &second.kubeconfig] {
        let (ok, said) = member_command(pair, "join", kubeconfig, node, &members.name).await;
        assert!(ok, "{said}");
    }
    let id_2 = cluster_id(&upper_2).await;
    let two = LowerIdentity::of(node, &id_2);
    let first_client = client_of(&member_kubeconfig_of(&upper, &members.name, node).await).await;
    let second_client = client_of(&member_kubeconfig_of(&upper_2, &members.name, node).await).await;
    assert!(authenticates(&first_client).await);
    assert!(authenticates(&second_client).await);

    let (ok, said) =
        member_command(pair, "leave", &pair.upper.kubeconfig, node, &members.name).await;
    assert!(ok, "{said}");
    wait_for(
        "the first upper cluster's identity revoked",
        TIMEOUT,
        || async { Ok((!authenticates(&first_client).await).then_some(())) },
    )
    .await
    .unwrap();
    assert!(
        authenticates(&second_client).await,
        "the second upper cluster's identity still lets it in"
    );
    let accounts: Api<ServiceAccount> = Api::namespaced(lower.clone(), LOWER_NAMESPACE);
    assert!(
        accounts
            .get_opt(&two.service_account)
            .await
            .unwrap()
            .is_some()
    );

    // An identity of the naming before, joined from the first upper cluster: its member
    // Secret there holds its token.
    let old = "vk-old";
    let legacy = LowerIdentity::legacy(old);
    let mut account = ServiceAccount::default();
    account.metadata.name = Some(legacy.service_account.clone());
    accounts
        .create(&PostParams::default(), &account)
        .await
        .unwrap();
    let lower_secrets: Api<Secret> = Api::namespaced(lower.clone(), LOWER_NAMESPACE);
    let mut token_secret = Secret::default();
    token_secret.metadata.name = Some(legacy.token_secret.clone());
    token_secret.metadata.annotations = Some(
        [(
            "kubernetes.io/service-account.name".to_owned(),
            legacy.service_account.clone(),
        )]
        .into(),
    );
    token_secret.type_ = Some("kubernetes.io/service-account-token".into());
    lower_secrets
        .create(&PostParams::default(), &token_secret)
        .await
        .unwrap();
    let binding = ClusterRoleBinding {
        metadata: kube::api::ObjectMeta {
            name: Some(legacy.binding.clone()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: "tensile-virtual-node-lower".into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: legacy.service_account.clone(),
            namespace: Some(LOWER_NAMESPACE.into()),
            ..Default::default()
        }]),
    };
    Api::<ClusterRoleBinding>::all(lower.clone())
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    let token = wait_for("the legacy token filled", TIMEOUT, || async {
        Ok(lower_secrets
            .get(&legacy.token_secret)
            .await?
            .data
            .and_then(|mut d| d.remove("token"))
            .map(|t| String::from_utf8(t.0).unwrap()))
    })
    .await
    .unwrap();
    let admin = kube::config::Kubeconfig::read_from(pair.lower_kubeconfig()).unwrap();
    let kubeconfig = member_kubeconfig(&admin, &token, &legacy.service_account, |p| {
        std::fs::read(p)
    })
    .unwrap();
    let kubeconfig_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(kubeconfig_file.path(), &kubeconfig).unwrap();
    Api::<Secret>::namespaced(upper.clone(), &members.name)
        .create(
            &PostParams::default(),
            &member_secret(old, old, kubeconfig_file.path()),
        )
        .await
        .unwrap();

    let (ok, said) = member_command(pair, "leave", &second.kubeconfig, old, &members.name).await;
    assert!(ok, "{said}");
    assert!(said.contains("kept"), "{said}");
    assert!(
        accounts
            .get_opt(&legacy.service_account)
            .await
            .unwrap()
            .is_some(),
        "not the second cluster's to delete"
    );
    let (ok, said) =
        member_command(pair, "leave", &pair.upper.kubeconfig, old, &members.name).await;
    assert!(ok, "{said}");
    assert!(said.contains("was this cluster's: deleted"), "{said}");
    assert!(
        accounts
            .get_opt(&legacy.service_account)
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        Api::<ClusterRoleBinding>::all(lower.clone())
            .get_opt(&legacy.binding)
            .await
            .unwrap()
            .is_none()
    );

    let (ok, said) = member_command(pair, "leave", &second.kubeconfig, node, &members.name).await;
    assert!(ok, "{said}");
    assert!(
        accounts
            .get_opt(&two.service_account)
            .await
            .unwrap()
            .is_none()
    );
    members.delete().await.unwrap();
}

/// The finalizer that holds the pod of the test's stand-in for virtual-node's Deployment
/// until the test has stopped the virtual-node process (a real one's pod ends only once
/// virtual-node has).
const HOLD: &str = "tensile.dev/test-hold";

/// A Deployment standing in for the chart's `virtual-node`: one pod, never scheduled
/// (no such scheduler), held by [`HOLD`] once deleted.
fn stand_in(name: &str) -> Deployment {
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}, "finalizers": [HOLD]},
                "spec": {"schedulerName": "tensile-test-nobody",
                         "containers": [{"name": "virtual-node", "image": "virtual-node"}]},
            },
        },
    }))
    .unwrap()
}

/// `virtual-node uninstall --deployment`, as the chart's pre-delete hook runs it: the node
/// of the flags is drained while virtual-node runs (its pods evicted, their lower copies
/// deleted by virtual-node), the Deployment that runs virtual-node scaled to 0 and waited
/// on until its pod is gone, and only then what is left below for the node deleted, then
/// the Node and its Lease. Run again, it finds nothing left to do and succeeds.
#[tokio::test]
async fn uninstall_drains_stops_virtual_node_then_deletes_what_it_made() {
    let pair = ClusterPair::shared().await.unwrap();
    let node = "vk-uninstall";
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let owner = Owner::new(node, cluster_id(&upper).await);
    let mut vn = common::start_node(pair, node, &[]).await;
    let ns = TestNamespace::create(&upper, "uninstall").await.unwrap();
    let upper_pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    Api::<ConfigMap>::namespaced(upper.clone(), &ns.name)
        .create(
            &PostParams::default(),
            &config_map("settings", json!({"GREETING": "hello"})),
        )
        .await
        .unwrap();
    for name in ["one", "two"] {
        upper_pods
            .create(&PostParams::default(), &pod_using(name, node, "settings"))
            .await
            .unwrap();
    }
    until_running(&upper_pods, "one", &mut vn).await;
    until_running(&upper_pods, "two", &mut vn).await;
    let deployments: Api<Deployment> = Api::namespaced(upper.clone(), &ns.name);
    deployments
        .create(&PostParams::default(), &stand_in("vn-stand-in"))
        .await
        .unwrap();
    let held = wait_for("the stand-in Deployment's pod", TIMEOUT, || async {
        Ok(upper_pods
            .list(&ListParams::default().labels("app=vn-stand-in"))
            .await?
            .items
            .into_iter()
            .next())
    })
    .await
    .unwrap()
    .name_any();

    let uninstall = |deployment: String| {
        tokio::process::Command::new(binary())
            .arg("uninstall")
            .args(["--nodename", node, "--leave-timeout", "60s"])
            .arg("--kubeconfig")
            .arg(pair.upper_kubeconfig())
            .arg("--client-kubeconfig")
            .arg(pair.lower_kubeconfig())
            .args(["--deployment", &deployment])
            .output()
    };
    let first = tokio::spawn(uninstall(format!("{}/vn-stand-in", ns.name)));

    // Scaled to 0: its pod terminating. By then the node was drained, virtual-node running.
    wait_for("the stand-in's pod terminating", TIMEOUT, || async {
        let pod = upper_pods.get_opt(&held).await?;
        Ok(pod.and_then(|p| p.metadata.deletion_timestamp).map(drop))
    })
    .await
    .unwrap();
    for name in ["one", "two"] {
        assert!(
            upper_pods.get_opt(name).await.unwrap().is_none(),
            "pod {name} evicted and ended before virtual-node is stopped"
        );
    }
    let owned = ListParams::default().labels(&owner.selector());
    assert!(
        Api::<Pod>::all(lower.clone())
            .list(&owned)
            .await
            .unwrap()
            .items
            .is_empty(),
        "the lower copies deleted by virtual-node as it ran"
    );
    let nodes: Api<Node> = Api::all(upper.clone());
    let cordoned = nodes.get(node).await.unwrap();
    assert!(!node_is_schedulable(&cordoned), "the node is cordoned");

    // virtual-node stops; what it leaves below must go, and only now.
    vn.stop().unwrap();
    let left_behind: Api<ConfigMap> = Api::namespaced(lower.clone(), &ns.name);
    let mut marks = std::collections::BTreeMap::new();
    owner.mark(&mut marks);
    let mut planted = config_map("left-behind", json!({}));
    planted.metadata.labels = Some(marks);
    left_behind
        .create(&PostParams::default(), &planted)
        .await
        .unwrap();
    assert!(
        !first.is_finished() && nodes.get_opt(node).await.unwrap().is_some(),
        "nothing is deleted while virtual-node's pod is still there"
    );
    upper_pods
        .patch(
            &held,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    let output = tokio::time::timeout(TIMEOUT, first)
        .await
        .expect("uninstall ends")
        .unwrap()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    println!("{said}");
    assert!(output.status.success(), "{said}");
    for line in [
        format!("node {node} cordoned and drained"),
        format!("Deployment {}/vn-stand-in scaled to 0 replicas", ns.name),
        format!("objects tensile made for node {node} deleted"),
        format!("node {node} and its Lease deleted"),
    ] {
        assert!(said.contains(&line), "{line:?} not said:\n{said}");
    }
    assert!(nodes.get_opt(node).await.unwrap().is_none(), "Node deleted");
    assert!(
        Api::<Lease>::namespaced(upper.clone(), "kube-node-lease")
            .get_opt(node)
            .await
            .unwrap()
            .is_none(),
        "node Lease deleted"
    );
    assert!(
        Api::<ConfigMap>::all(lower.clone())
            .list(&owned)
            .await
            .unwrap()
            .items
            .is_empty(),
        "nothing of the node's left below"
    );
    assert_eq!(
        deployments
            .get("vn-stand-in")
            .await
            .unwrap()
            .spec
            .and_then(|s| s.replicas),
        Some(0)
    );

    // Again: nothing left to do, done all the same.
    let output = uninstall(format!("{}/vn-stand-in", ns.name)).await.unwrap();
    let said = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        said.contains(&format!("no virtual node of --nodename {node} to drain"))
            && said.contains(&format!("0 objects tensile made for node {node} deleted")),
        "{said}"
    );
    ns.delete().await.unwrap();
}
