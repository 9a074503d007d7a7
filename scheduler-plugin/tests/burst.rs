//! A burst through the real upper kube-scheduler: pods that the lower cluster takes only
//! one per node, created at once. The virtual node advertises the sum (4 × 4 CPU), so
//! in-tree plugins let six 2.5-CPU pods on; the lower nodes take four. The extender counts
//! the pods in flight (passed filter, lower copy not there yet or not scheduled yet), so
//! exactly four go to the virtual node and none is refused by the lower scheduler.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

mod common;

use std::collections::BTreeMap;

use common::{
    ServedExtender, TIMEOUT, cpu_pod, failed_scheduling, scheduler_extenders, start_virtual_node,
    to_vk, virtual_node_binary,
};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, PostParams};
use tensile_harness::ports::free_port;
use tensile_harness::{ClusterPair, NodeShape, PairOptions, TestNamespace, wait_for};

const PODS: usize = 8;
const LOWER_NODES: usize = 4;

/// Where one upper pod ended up.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Settled {
    /// Running below.
    Running,
    /// Not bound, with this FailedScheduling note.
    Waiting(String),
    /// Bound to the virtual node, but its lower copy is unschedulable there.
    RefusedBelow(String),
}

/// Why the lower scheduler refused `pod`, if it did.
fn refusal(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .map(|c| c.message.clone().unwrap_or_default())
}

#[tokio::test]
async fn a_burst_goes_below_only_as_far_as_the_lower_nodes_take_it() {
    let port = free_port().unwrap();
    let mut options = PairOptions::default();
    options.lower.nodes = LOWER_NODES;
    options.lower.node_shape = NodeShape {
        cpu: "4".into(),
        ..NodeShape::default()
    };
    options
        .upper
        .scheduler_config
        .insert("extenders".into(), scheduler_extenders(port));
    let binary = tokio::task::spawn_blocking(virtual_node_binary);
    let pair = ClusterPair::start(options).await.unwrap();
    let binary = binary.await.unwrap();
    let served = ServedExtender::start(&pair, pair.lower_kubeconfig().to_owned(), port).await;
    let upper = pair.upper.client().await.unwrap();
    let lower = pair.lower.client().await.unwrap();
    let _vn = start_virtual_node(&pair, &binary, &upper).await;
    let ns = TestNamespace::create(&upper, "burst").await.unwrap();
    let pods: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let lower_pods: Api<Pod> = Api::namespaced(lower.clone(), &ns.name);
    let events: Api<Event> = Api::namespaced(upper.clone(), &ns.name);

    let pp = PostParams::default();
    let names: Vec<String> = (0..PODS).map(|i| format!("burst-{i}")).collect();
    let burst: Vec<Pod> = names
        .iter()
        .map(|name| cpu_pod(name, "2500m", to_vk()))
        .collect();
    futures::future::try_join_all(burst.iter().map(|pod| pods.create(&pp, pod)))
        .await
        .unwrap();

    let settled = wait_for("every pod of the burst settled", TIMEOUT, || async {
        let mut settled = BTreeMap::new();
        let lower_list = lower_pods.list(&ListParams::default()).await?.items;
        for pod in pods.list(&ListParams::default()).await?.items {
            let name = pod.metadata.name.clone().unwrap_or_default();
            let bound = pod.spec.as_ref().and_then(|s| s.node_name.clone());
            let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
            let state = if running {
                Settled::Running
            } else if bound.is_some() {
                let copy = lower_list
                    .iter()
                    .find(|p| p.metadata.name.as_deref() == Some(name.as_str()));
                match copy.and_then(refusal) {
                    Some(why) => Settled::RefusedBelow(why),
                    None => return Ok(None),
                }
            } else {
                match failed_scheduling(&events, &name).await.pop() {
                    Some(note) => Settled::Waiting(note),
                    None => return Ok(None),
                }
            };
            settled.insert(name, state);
        }
        Ok((settled.len() == PODS).then_some(settled))
    })
    .await
    .unwrap();

    let refused: Vec<_> = settled
        .iter()
        .filter(|(_, s)| matches!(s, Settled::RefusedBelow(_)))
        .collect();
    assert!(refused.is_empty(), "refused below: {refused:?}");
    let running = settled.values().filter(|s| **s == Settled::Running).count();
    assert_eq!(running, LOWER_NODES, "{settled:#?}");
    for (name, state) in &settled {
        if let Settled::Waiting(note) = state {
            assert!(
                note.contains("lower cluster of vk-node: no node fits cpu 2500m"),
                "{name}: {note}"
            );
        }
    }
    for pod in lower_pods.list(&ListParams::default()).await.unwrap().items {
        assert!(
            pod.spec.and_then(|s| s.node_name).is_some(),
            "every lower copy is bound: {:?}",
            pod.metadata.name
        );
    }

    ns.delete().await.unwrap();
    served.stop().await;
}
