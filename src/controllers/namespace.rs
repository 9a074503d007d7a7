//! Namespace remapping (`--lower-namespace` other than `same`): keeps the member's
//! [`NamespaceView`] in step with the upper Namespaces (a new one mapped, an annotation
//! `tensile.dev/lower-namespace` followed, a deleted one forgotten). A change of mapping
//! for a namespace that has pods below is refused with an Event on the Namespace, not half
//! applied: it takes effect once they are gone. Two upper namespaces asking for one lower
//! namespace: the one mapped first keeps it, the other gets its default name and an Event.

use std::cell::OnceCell;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, ObjectReference, Pod};
use kube::api::{Api, ListParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::Context;
use super::pod_store::PodStore;
use super::stores::{Ready, reflected};
use crate::lower_view::NamespaceView;
use crate::side::Side;
use crate::translate::meta::Owner;
use crate::translate::namespace::{LOWER_NAMESPACE_ANNOTATION, Mapping, desired};
use crate::translate::pod::upper_uid;

/// How often a refused change is looked at again (its pods may have gone).
const RETRY: Duration = Duration::from_secs(5);

/// Each upper namespace's name and annotation.
type Wanted = BTreeMap<String, Option<String>>;

fn wanted<'a>(namespaces: impl Iterator<Item = &'a Namespace>) -> Wanted {
    namespaces
        .map(|ns| {
            (
                ns.name_any(),
                ns.annotations().get(LOWER_NAMESPACE_ANNOTATION).cloned(),
            )
        })
        .collect()
}

/// Why a namespace is not mapped as its annotation asks: the Warning's reason and note.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Refusal {
    namespace: String,
    reason: &'static str,
    note: String,
}

/// Brings `mapping` in step with `wanted`, given `in_use` (upper namespaces with pods
/// below); what it refused. Pure: the tests below cover it.
fn apply(
    mapping: &mut Mapping,
    suffix: &str,
    wanted: &Wanted,
    in_use: &dyn Fn(&str) -> bool,
) -> Vec<Refusal> {
    let mut refused = Vec::new();
    // Gone upper namespaces (their pods with them) free their lower names first.
    let gone: Vec<String> = mapping
        .known()
        .filter(|ns| !wanted.contains_key(*ns))
        .map(str::to_owned)
        .collect();
    for namespace in gone {
        if !in_use(&namespace) {
            mapping.remove(&namespace);
        }
    }
    for (namespace, annotated) in wanted {
        let (target, why) = desired(mapping.mode(), namespace, annotated.as_deref(), suffix);
        if let Err(note) = why {
            refused.push(Refusal {
                namespace: namespace.clone(),
                reason: "LowerNamespaceInvalid",
                note,
            });
        }
        let current = mapping.current(namespace).map(str::to_owned);
        if current.as_deref() == Some(target.as_str()) {
            continue;
        }
        if let Some(current) = &current
            && in_use(namespace)
        {
            refused.push(Refusal {
                namespace: namespace.clone(),
                reason: "LowerNamespaceChangeRefused",
                note: format!(
                    "namespace {namespace} has pods in lower namespace {current}; it moves to \
                     {target} once they are gone"
                ),
            });
            continue;
        }
        if let Err(holder) = mapping.set(namespace, &target) {
            refused.push(Refusal {
                namespace: namespace.clone(),
                reason: "LowerNamespaceTaken",
                note: format!(
                    "lower namespace {target} is upper namespace {holder}'s already; \
                     {namespace} keeps its default"
                ),
            });
            if current.is_none() {
                let (fallback, _) = desired(mapping.mode(), namespace, None, suffix);
                // Taken as well: left to the default rule of the view, unmapped.
                let _ = mapping.set(namespace, &fallback);
            }
        }
    }
    refused
}

/// Where this node's pods are below now: each upper namespace with pods of this node (by
/// the upper pods' UIDs) and the lower namespace that holds their lower copies (marked
/// with those UIDs). Pure: `upper` is (namespace, UID) of the node's upper pods, `lower`
/// (lower namespace, upper UID) of the lower pods it owns.
fn in_place<'a>(
    upper: impl Iterator<Item = (&'a str, &'a str)>,
    lower: impl Iterator<Item = (&'a str, &'a str)>,
) -> BTreeMap<String, String> {
    let below: BTreeMap<&str, &str> = lower.map(|(ns, uid)| (uid, ns)).collect();
    let mut placed = BTreeMap::new();
    for (namespace, uid) in upper {
        if let Some(lower) = below.get(uid) {
            placed
                .entry(namespace.to_owned())
                .or_insert_with(|| (*lower).to_owned());
        }
    }
    placed
}

/// Fills `view` from the upper Namespaces as they are now (before the member's lower
/// client is used). Upper namespaces whose pods already run below keep the lower namespace
/// they run in (read with `lower`, a client without the view), so a mapping changed while
/// virtual-node was down is refused as it is at run time, not applied under them.
pub async fn load(
    upper: &Client,
    lower: &Client,
    owner: &Owner,
    view: &NamespaceView,
    suffix: &str,
) -> Result<(), String> {
    let list = Api::<Namespace>::all(upper.clone())
        .list(&ListParams::default())
        .await
        .map_err(|e| format!("upper cluster: listing Namespaces: {e}"))?;
    let upper_pods = Api::<Pod>::all(upper.clone())
        .list_metadata(&ListParams::default().fields(&format!("spec.nodeName={}", owner.node)))
        .await
        .map_err(|e| {
            format!(
                "upper cluster: listing the pods of node {}: {e}",
                owner.node
            )
        })?;
    let lower_pods = Api::<Pod>::all(lower.clone())
        .list_metadata(&ListParams::default().labels(&owner.selector()))
        .await
        .map_err(|e| {
            format!(
                "lower cluster: listing the pods of node {}: {e}",
                owner.node
            )
        })?;
    let placed = in_place(
        upper_pods
            .items
            .iter()
            .filter_map(|p| Some((p.metadata.namespace.as_deref()?, p.metadata.uid.as_deref()?))),
        lower_pods
            .items
            .iter()
            .filter_map(|p| Some((p.metadata.namespace.as_deref()?, upper_uid(&p.metadata)?))),
    );
    let mut mapping = view.write();
    for (namespace, lower) in &placed {
        if let Err(holder) = mapping.set(namespace, lower) {
            warn!(namespace = %namespace, lower = %lower, holder = %holder,
                "pods of two upper namespaces run in one lower namespace");
        }
    }
    let in_use = |ns: &str| placed.contains_key(ns);
    for refusal in apply(&mut mapping, suffix, &wanted(list.items.iter()), &in_use) {
        warn!(namespace = %refusal.namespace, reason = refusal.reason, "{}", refusal.note);
    }
    Ok(())
}

/// Keeps `view` in step with the upper Namespaces until `shutdown`; `lower_pods` says
/// which namespaces have pods below.
pub async fn run(
    ctx: Arc<Context>,
    view: Arc<NamespaceView>,
    suffix: String,
    lower_pods: PodStore,
    synced: Ready,
    shutdown: CancellationToken,
) {
    let reflected = reflected(
        Api::<Namespace>::all(ctx.upper.clone()),
        Side::Upper,
        watcher::Config::default(),
        None,
    );
    let (store, mut stream, ready) = (reflected.store, reflected.stream, reflected.ready);
    let mut tick = tokio::time::interval(RETRY);
    let mut warned: HashSet<Refusal> = HashSet::new();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            Some(_) = stream.next() => {}
            _ = tick.tick() => {}
        }
        if !ready.is_ready() || !synced.is_ready() {
            continue;
        }
        let namespaces = store.state();
        let wanted = wanted(namespaces.iter().map(AsRef::as_ref));
        let before = view.read().clone();
        let refused = {
            // Which namespaces have pods below: read from the store (every pod) only when
            // a mapping is about to change.
            let used: OnceCell<BTreeSet<Box<str>>> = OnceCell::new();
            let in_use = |ns: &str| {
                used.get_or_init(|| {
                    lower_pods
                        .state()
                        .iter()
                        .map(|p| p.meta.namespace.clone())
                        .collect()
                })
                .contains(ns)
            };
            apply(&mut view.write(), &suffix, &wanted, &in_use)
        };
        let after = view.read().clone();
        for namespace in wanted.keys() {
            if before.current(namespace) != after.current(namespace) {
                info!(namespace = %namespace, lower = ?after.current(namespace),
                    "upper namespace mapped to a lower namespace");
            }
        }
        for refusal in refused {
            if warned.insert(refusal.clone()) {
                warn!(namespace = %refusal.namespace, reason = refusal.reason, "{}", refusal.note);
                let reference = ObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Namespace".into()),
                    name: Some(refusal.namespace.clone()),
                    ..ObjectReference::default()
                };
                ctx.warn_on_ref(&reference, refusal.reason, refusal.note)
                    .await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::translate::namespace::Mode;

    use super::*;

    fn wanted_of(pairs: &[(&str, Option<&str>)]) -> Wanted {
        pairs
            .iter()
            .map(|(n, a)| ((*n).to_owned(), a.map(str::to_owned)))
            .collect()
    }

    #[test]
    fn maps_follows_and_refuses() {
        let mut m = Mapping::new(Mode::Prefixed, "c1".into());
        let idle = |_: &str| false;
        let refused = apply(
            &mut m,
            "c1",
            &wanted_of(&[("shop", None), ("team", Some("team-below"))]),
            &idle,
        );
        assert!(refused.is_empty(), "{refused:?}");
        assert_eq!(m.current("shop"), Some("shop-c1"));
        assert_eq!(m.current("team"), Some("team-below"));

        // A change under running pods waits, with a refusal; applied once they are gone.
        let busy = |ns: &str| ns == "shop";
        let change = wanted_of(&[("shop", Some("shop-new")), ("team", Some("team-below"))]);
        let refused = apply(&mut m, "c1", &change, &busy);
        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].reason, "LowerNamespaceChangeRefused");
        assert_eq!(m.current("shop"), Some("shop-c1"));
        assert!(apply(&mut m, "c1", &change, &idle).is_empty());
        assert_eq!(m.current("shop"), Some("shop-new"));

        // Two namespaces asking for one: the first keeps it.
        let clash = wanted_of(&[
            ("shop", Some("shop-new")),
            ("team", Some("team-below")),
            ("zoo", Some("team-below")),
        ]);
        let refused = apply(&mut m, "c1", &clash, &idle);
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].reason, "LowerNamespaceTaken");
        assert_eq!(m.current("zoo"), Some("zoo-c1"));

        // A bad annotation: the default, and a refusal.
        let bad = wanted_of(&[("shop", Some("Bad_Name"))]);
        let refused = apply(&mut m, "c1", &bad, &idle);
        assert_eq!(refused[0].reason, "LowerNamespaceInvalid");
        assert_eq!(m.current("shop"), Some("shop-c1"));
        // Namespaces gone from the upper cluster are forgotten.
        assert_eq!(m.current("team"), None);
    }

    #[test]
    fn pods_running_below_keep_their_lower_namespace() {
        // (upper namespace, upper UID) of the node's upper pods; (lower namespace, upper
        // UID) of the lower pods it owns.
        type Pairs = &'static [(&'static str, &'static str)];
        let cases: &[(Pairs, Pairs, Pairs)] = &[
            (&[], &[], &[]),
            // Moved by an annotation while down: the pods' namespace wins.
            (
                &[("shop", "u1")],
                &[("shop-old", "u1")],
                &[("shop", "shop-old")],
            ),
            // An upper pod not mirrored yet, a lower pod whose upper pod is gone.
            (&[("shop", "u1")], &[("shop-c1", "u2")], &[]),
            (
                &[("a", "u1"), ("a", "u2"), ("b", "u3")],
                &[("a-c1", "u1"), ("a-c1", "u2"), ("team", "u3")],
                &[("a", "a-c1"), ("b", "team")],
            ),
        ];
        for (upper, lower, want) in cases {
            let got = in_place(upper.iter().copied(), lower.iter().copied());
            let want: BTreeMap<String, String> = want
                .iter()
                .map(|(u, l)| ((*u).to_owned(), (*l).to_owned()))
                .collect();
            assert_eq!(got, want, "upper {upper:?} lower {lower:?}");
        }
    }

    #[test]
    fn a_placed_namespace_keeps_its_lower_name_against_its_annotation() {
        let mut m = Mapping::new(Mode::Prefixed, "c1".into());
        m.set("shop", "shop-old").expect("free");
        let in_use = |ns: &str| ns == "shop";
        let refused = apply(&mut m, "c1", &wanted_of(&[("shop", None)]), &in_use);
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].reason, "LowerNamespaceChangeRefused");
        assert_eq!(m.current("shop"), Some("shop-old"));
    }
}
