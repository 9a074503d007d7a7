//! Namespace remapping (`--lower-namespace` other than `same`): keeps the member's
//! [`NamespaceView`] in step with the upper Namespaces (a new one mapped, an annotation
//! `tensile.dev/lower-namespace` followed, a deleted one forgotten). A change of mapping
//! for a namespace that has pods below is refused with an Event on the Namespace, not half
//! applied: it takes effect once they are gone. Two upper namespaces asking for one lower
//! namespace: the one mapped first keeps it, the other gets its default name and an Event.

use std::cell::OnceCell;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
use crate::translate::namespace::{Below, LOWER_NAMESPACE_ANNOTATION, Mapping, Refused, desired};
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

impl Refusal {
    fn new(namespace: &str, refused: Refused) -> Self {
        Self {
            namespace: namespace.to_owned(),
            reason: refused.reason,
            note: refused.note,
        }
    }
}

/// The lower namespaces [`apply`] may look at: those of the namespaces whose mapping it
/// may change (their annotation's, and their default). Pure.
fn looked_at(mapping: &Mapping, suffix: &str, wanted: &Wanted) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (namespace, annotated) in wanted {
        let (target, _) = desired(mapping.mode(), namespace, annotated.as_deref(), suffix);
        if mapping.current(namespace) != Some(target.as_str()) {
            names.insert(desired(mapping.mode(), namespace, None, suffix).0);
            names.insert(target);
        }
    }
    names
}

/// Where `namespace` should map to: `wished` (its annotation's name, or its default),
/// else (refused) its default, else (refused as well) nowhere; each refusal is added to
/// `refused`.
fn target(
    mapping: &Mapping,
    suffix: &str,
    namespace: &str,
    wished: String,
    below: &dyn Fn(&str) -> Below,
    refused: &mut Vec<Refusal>,
) -> Option<String> {
    let default = desired(mapping.mode(), namespace, None, suffix).0;
    let mut candidates = vec![wished];
    if candidates[0] != default {
        candidates.push(default);
    }
    for candidate in candidates {
        match mapping.admit(namespace, &candidate, &below(&candidate)) {
            Ok(()) => return Some(candidate),
            Err(why) => refused.push(Refusal::new(namespace, why)),
        }
    }
    None
}

/// Brings `mapping` in step with `wanted`, given `in_use` (upper namespaces with pods
/// below) and `below` (what the lower cluster holds under a name, asked only of the names
/// of [`looked_at`]); what it refused. Pure: the tests below cover it.
fn apply(
    mapping: &mut Mapping,
    suffix: &str,
    wanted: &Wanted,
    in_use: &dyn Fn(&str) -> bool,
    below: &dyn Fn(&str) -> Below,
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
        let current = mapping.current(namespace).map(str::to_owned);
        let (wished, why) = desired(mapping.mode(), namespace, annotated.as_deref(), suffix);
        if let Err(note) = why {
            refused.push(Refusal {
                namespace: namespace.clone(),
                reason: "LowerNamespaceInvalid",
                note,
            });
        }
        if current.as_deref() == Some(wished.as_str()) {
            // Admitted when it was mapped; a pod's namespace is looked at again when the
            // pod is made below (controllers::dependencies).
            continue;
        }
        let Some(target) = target(mapping, suffix, namespace, wished, below, &mut refused) else {
            // Nowhere it may go: unmapped (its pods wait), unless its pods run below.
            if current.is_some() && !in_use(namespace) {
                mapping.remove(namespace);
            }
            continue;
        };
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
                if mapping
                    .admit(namespace, &fallback, &below(&fallback))
                    .is_ok()
                {
                    let _ = mapping.set(namespace, &fallback);
                }
            }
        }
    }
    refused
}

/// An upper pod of this node, as [`in_place`] reads it: its namespace, name and UID.
type UpperPod<'a> = (&'a str, &'a str, &'a str);

/// A lower pod carrying this node's marks, as [`in_place`] reads it: its lower namespace,
/// name and the upper UID it names.
type LowerPod<'a> = (&'a str, &'a str, &'a str);

/// A lower pod (or a lower namespace) [`in_place`] did not count, and why: logged as a
/// warning, since the marks and the upper UID it carries are readable and copyable by
/// anyone who may create pods below.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Ignored {
    /// `lower namespace/name` of the pod, or the lower namespace.
    what: String,
    /// Why.
    why: String,
}

/// Where this node's pods are below now: each upper namespace with pods of this node and
/// the lower namespace that holds their lower copies; and the lower pods not believed.
/// Pure: `upper` are the node's upper pods, `lower` the lower pods with its marks, `now`
/// each upper namespace's lower namespace as the mapping gives it now, `admitted` whether
/// an upper namespace may map onto a lower namespace ([`Mapping::admit`]).
///
/// A lower pod counts only when the upper UID it names is a pod of this node of its name,
/// and its lower namespace is one the pod's upper namespace may map onto: its marks alone
/// prove nothing. Of several lower namespaces claimed for one upper namespace, the one the
/// mapping gives now wins; a lower namespace that is another upper namespace's now is never
/// placed; where that leaves several, or two upper namespaces claim one lower namespace,
/// none is placed (the mapping then follows the upper Namespaces alone).
fn in_place<'a>(
    upper: impl Iterator<Item = UpperPod<'a>>,
    lower: impl Iterator<Item = LowerPod<'a>>,
    now: &BTreeMap<String, String>,
    admitted: &dyn Fn(&str, &str) -> bool,
) -> (BTreeMap<String, String>, Vec<Ignored>) {
    let by_uid: HashMap<&str, (&str, &str)> = upper
        .map(|(namespace, name, uid)| (uid, (namespace, name)))
        .collect();
    // The upper namespace each lower namespace is the mapping of now.
    let now_of: HashMap<&str, &str> = now
        .iter()
        .map(|(upper, lower)| (lower.as_str(), upper.as_str()))
        .collect();
    let mut ignored = Vec::new();
    let mut claimed: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (lower_namespace, name, uid) in lower {
        let what = format!("{lower_namespace}/{name}");
        let Some(&(namespace, upper_name)) = by_uid.get(uid) else {
            // Its upper pod is gone, or not this node's: the orphan collector's.
            continue;
        };
        let why = if upper_name != name {
            Some(format!(
                "it names the upper UID {uid} of pod {namespace}/{upper_name}, whose copy is \
                 named {upper_name}"
            ))
        } else if !admitted(namespace, lower_namespace) {
            Some(format!(
                "it names the upper UID {uid} of pod {namespace}/{upper_name}, whose namespace \
                 may not map to lower namespace {lower_namespace}"
            ))
        } else {
            now_of
                .get(lower_namespace)
                .filter(|other| **other != namespace)
                .map(|other| {
                    format!(
                        "it names the upper UID {uid} of pod {namespace}/{upper_name}, but lower \
                         namespace {lower_namespace} is upper namespace {other}'s"
                    )
                })
        };
        match why {
            Some(why) => ignored.push(Ignored { what, why }),
            None => {
                claimed
                    .entry(namespace)
                    .or_default()
                    .insert(lower_namespace);
            }
        }
    }
    let mut chosen: BTreeMap<&str, &str> = BTreeMap::new();
    for (namespace, lowers) in claimed {
        let current = now.get(namespace).map(String::as_str);
        let pick = match current {
            Some(current) if lowers.contains(current) => Some(current),
            _ if lowers.len() == 1 => lowers.first().copied(),
            _ => None,
        };
        match pick {
            Some(lower) => {
                chosen.insert(namespace, lower);
            }
            None => ignored.push(Ignored {
                what: lowers.iter().copied().collect::<Vec<_>>().join(", "),
                why: format!(
                    "lower pods in each of these claim pods of upper namespace {namespace}; \
                     none is believed"
                ),
            }),
        }
    }
    // One lower namespace claimed for two upper namespaces: the one it is the mapping of
    // now keeps it (another's claims were dropped above); else neither.
    let mut holders: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (namespace, lower) in &chosen {
        holders.entry(lower).or_default().push(namespace);
    }
    let mut placed = BTreeMap::new();
    for (lower, namespaces) in holders {
        if let [namespace] = namespaces[..] {
            placed.insert(namespace.to_owned(), lower.to_owned());
        } else {
            ignored.push(Ignored {
                what: lower.to_owned(),
                why: format!(
                    "lower pods in it claim pods of upper namespaces {}; none is believed",
                    namespaces.join(", ")
                ),
            });
        }
    }
    (placed, ignored)
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
    // Every lower namespace, once, rather than one read for each upper namespace.
    let below: BTreeMap<String, Below> = Api::<Namespace>::all(lower.clone())
        .list_metadata(&ListParams::default())
        .await
        .map_err(|e| format!("lower cluster: listing Namespaces: {e}"))?
        .items
        .into_iter()
        .filter_map(|ns| {
            let marks = Below::of(ns.metadata.labels.as_ref(), &owner.cluster);
            Some((ns.metadata.name?, marks))
        })
        .collect();
    let wanted = wanted(list.items.iter());
    let mut mapping = view.write();
    // Each upper namespace's lower namespace as the mapping would give it now.
    let now: BTreeMap<String, String> = wanted
        .iter()
        .map(|(namespace, annotated)| {
            let (lower, _) = desired(mapping.mode(), namespace, annotated.as_deref(), suffix);
            (namespace.clone(), lower)
        })
        .collect();
    let below_of = |name: &str| below.get(name).cloned().unwrap_or(Below::Absent);
    let admitted = |upper: &str, lower: &str| mapping.admit(upper, lower, &below_of(lower)).is_ok();
    let (placed, ignored) = in_place(
        upper_pods.items.iter().filter_map(|p| {
            Some((
                p.metadata.namespace.as_deref()?,
                p.metadata.name.as_deref()?,
                p.metadata.uid.as_deref()?,
            ))
        }),
        lower_pods.items.iter().filter_map(|p| {
            Some((
                p.metadata.namespace.as_deref()?,
                p.metadata.name.as_deref()?,
                upper_uid(&p.metadata)?,
            ))
        }),
        &now,
        &admitted,
    );
    for Ignored { what, why } in &ignored {
        warn!(node = %owner.node, cluster = "lower", lower = %what,
            "namespace mapping: a lower pod with this node's marks is not believed: {why}");
    }
    for (namespace, lower) in &placed {
        if let Err(holder) = mapping.set(namespace, lower) {
            warn!(namespace = %namespace, lower = %lower, holder = %holder,
                "pods of two upper namespaces run in one lower namespace");
        }
    }
    let in_use = |ns: &str| placed.contains_key(ns);
    for refusal in apply(&mut mapping, suffix, &wanted, &in_use, &below_of) {
        warn!(namespace = %refusal.namespace, reason = refusal.reason, "{}", refusal.note);
    }
    Ok(())
}

/// How long what a lower Namespace was read to hold is trusted: a refused namespace is
/// looked at again every [`RETRY`], its lower Namespace read at most this often (a pod's
/// namespace is read again anyway when the pod is made below).
const BELOW_TTL: Duration = Duration::from_secs(30);

/// What the lower cluster holds under the names a mapping may change to, as last read.
#[derive(Default)]
struct LowerNamespaces {
    seen: HashMap<String, (Below, Instant)>,
}

impl LowerNamespaces {
    /// Reads those of `names` not read within [`BELOW_TTL`] with `lower` (a client without
    /// the view), and forgets the others.
    async fn refresh(
        &mut self,
        lower: &Client,
        cluster: &str,
        names: BTreeSet<String>,
    ) -> Result<(), String> {
        self.seen
            .retain(|name, (_, at)| names.contains(name) && at.elapsed() < BELOW_TTL);
        let api = Api::<Namespace>::all(lower.clone());
        for name in names {
            if self.seen.contains_key(&name) {
                continue;
            }
            let below = match api
                .get_metadata_opt(&name)
                .await
                .map_err(|e| format!("lower cluster: reading Namespace {name}: {e}"))?
            {
                None => Below::Absent,
                Some(ns) => Below::of(ns.metadata.labels.as_ref(), cluster),
            };
            self.seen.insert(name, (below, Instant::now()));
        }
        Ok(())
    }

    /// What `name` holds, as last read (absent if it was not).
    fn get(&self, name: &str) -> Below {
        self.seen
            .get(name)
            .map_or(Below::Absent, |(below, _)| below.clone())
    }
}

/// Keeps `view` in step with the upper Namespaces until `shutdown`; `lower_pods` says
/// which namespaces have pods below; `lower` (a client without the view) reads the lower
/// Namespaces a mapping may go to.
pub async fn run(
    ctx: Arc<Context>,
    lower: Client,
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
    let mut lower_namespaces = LowerNamespaces::default();
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
        // Read before the mapping is locked; only the names a mapping may change to.
        if let Err(error) = lower_namespaces
            .refresh(
                &lower,
                &ctx.owner.cluster,
                looked_at(&before, &suffix, &wanted),
            )
            .await
        {
            warn!(error = %error, "namespace mapping: retried in {RETRY:?}");
            continue;
        }
        let below = |name: &str| lower_namespaces.get(name);
        let refused = {
            // Which namespaces have pods below: read from the store (every pod) only when
            // a mapping is about to change.
            let used: OnceCell<BTreeSet<Box<str>>> = OnceCell::new();
            let in_use = |ns: &str| {
                used.get_or_init(|| {
                    lower_pods
                        .state()
                        .iter()
                        .map(|p| p.meta.namespace.as_ref().into())
                        .collect()
                })
                .contains(ns)
            };
            apply(&mut view.write(), &suffix, &wanted, &in_use, &below)
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
    use crate::translate::namespace::{Mode, Reserved};

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
        let absent = |_: &str| Below::Absent;
        let refused = apply(
            &mut m,
            "c1",
            &wanted_of(&[("shop", None), ("team", Some("team-below"))]),
            &idle,
            &absent,
        );
        assert!(refused.is_empty(), "{refused:?}");
        assert_eq!(m.current("shop"), Some("shop-c1"));
        assert_eq!(m.current("team"), Some("team-below"));

        // A change under running pods waits, with a refusal; applied once they are gone.
        let busy = |ns: &str| ns == "shop";
        let change = wanted_of(&[("shop", Some("shop-new")), ("team", Some("team-below"))]);
        let refused = apply(&mut m, "c1", &change, &busy, &absent);
        assert_eq!(refused.len(), 1);
        assert_eq!(refused[0].reason, "LowerNamespaceChangeRefused");
        assert_eq!(m.current("shop"), Some("shop-c1"));
        assert!(apply(&mut m, "c1", &change, &idle, &absent).is_empty());
        assert_eq!(m.current("shop"), Some("shop-new"));

        // Two namespaces asking for one: the first keeps it.
        let clash = wanted_of(&[
            ("shop", Some("shop-new")),
            ("team", Some("team-below")),
            ("zoo", Some("team-below")),
        ]);
        let refused = apply(&mut m, "c1", &clash, &idle, &absent);
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].reason, "LowerNamespaceTaken");
        assert_eq!(m.current("zoo"), Some("zoo-c1"));

        // A bad annotation: the default, and a refusal.
        let bad = wanted_of(&[("shop", Some("Bad_Name"))]);
        let refused = apply(&mut m, "c1", &bad, &idle, &absent);
        assert_eq!(refused[0].reason, "LowerNamespaceInvalid");
        assert_eq!(m.current("shop"), Some("shop-c1"));
        // Namespaces gone from the upper cluster are forgotten.
        assert_eq!(m.current("team"), None);
    }

    /// `tensile.dev/lower-namespace` may not name a system namespace, join's, or one tensile
    /// did not make for this upper cluster: the default instead, with a Warning; where the
    /// default is refused too (another upper cluster's), nowhere, and its pods wait.
    #[test]
    fn refuses_lower_namespaces_not_this_upper_clusters() {
        let reserved = Reserved::new(["infra".to_owned()]);
        let lower: BTreeMap<&str, Below> = [
            ("kube-system", Below::Unmarked),
            ("tensile-system", Below::Unmarked),
            ("default", Below::Unmarked),
            ("legacy", Below::Unmarked),
            ("shop-c2", Below::Foreign("c2".into())),
            ("team-c1", Below::Foreign("c2".into())),
            ("mine", Below::Ours),
        ]
        .into();
        let below = |name: &str| lower.get(name).cloned().unwrap_or(Below::Absent);
        let idle = |_: &str| false;
        // (mode, namespace, annotation, mapped to, refusals)
        type Case<'a> = (
            Mode,
            &'a str,
            Option<&'a str>,
            Option<&'a str>,
            &'a [&'a str],
        );
        let cases: &[Case] = &[
            (
                Mode::Prefixed,
                "a",
                Some("kube-system"),
                Some("a-c1"),
                &["LowerNamespaceReserved"],
            ),
            (
                Mode::Prefixed,
                "a",
                Some("tensile-system"),
                Some("a-c1"),
                &["LowerNamespaceReserved"],
            ),
            (
                Mode::Prefixed,
                "a",
                Some("kube-fresh"),
                Some("a-c1"),
                &["LowerNamespaceReserved"],
            ),
            (
                Mode::Prefixed,
                "a",
                Some("infra"),
                Some("a-c1"),
                &["LowerNamespaceReserved"],
            ),
            (
                Mode::Annotation,
                "a",
                Some("kube-system"),
                Some("a"),
                &["LowerNamespaceReserved"],
            ),
            (
                Mode::Prefixed,
                "a",
                Some("shop-c2"),
                Some("a-c1"),
                &["LowerNamespaceNotOurs"],
            ),
            (
                Mode::Prefixed,
                "a",
                Some("legacy"),
                Some("a-c1"),
                &["LowerNamespaceNotOurs"],
            ),
            (
                Mode::Annotation,
                "a",
                Some("default"),
                Some("a"),
                &["LowerNamespaceNotOurs"],
            ),
            (Mode::Prefixed, "a", Some("mine"), Some("mine"), &[]),
            (Mode::Prefixed, "a", Some("free"), Some("free"), &[]),
            // Defaults: derived names may exist unmarked (an upgrade), never another's.
            (Mode::Annotation, "default", None, Some("default"), &[]),
            (
                Mode::Prefixed,
                "kube-system",
                None,
                Some("kube-system-c1"),
                &[],
            ),
            (
                Mode::Prefixed,
                "team",
                None,
                None,
                &["LowerNamespaceNotOurs"],
            ),
            (
                Mode::Prefixed,
                "team",
                Some("kube-system"),
                None,
                &["LowerNamespaceReserved", "LowerNamespaceNotOurs"],
            ),
            (
                Mode::Annotation,
                "kube-system",
                None,
                None,
                &["LowerNamespaceReserved"],
            ),
            (
                Mode::Annotation,
                "shop-c2",
                None,
                None,
                &["LowerNamespaceNotOurs"],
            ),
        ];
        for (mode, namespace, annotation, want, reasons) in cases {
            let mut m = Mapping::new(*mode, "c1".into()).with_reserved(reserved.clone());
            let wanted = wanted_of(&[(namespace, *annotation)]);
            let looked = looked_at(&m, "c1", &wanted);
            let asked = std::cell::RefCell::new(BTreeSet::new());
            let below = |name: &str| {
                asked.borrow_mut().insert(name.to_owned());
                below(name)
            };
            let refused = apply(&mut m, "c1", &wanted, &idle, &below);
            let case = format!("{mode:?} {namespace} {annotation:?}");
            assert_eq!(m.current(namespace), *want, "{case}");
            let got: Vec<&str> = refused.iter().map(|r| r.reason).collect();
            assert_eq!(got, *reasons, "{case}: {refused:?}");
            assert!(
                asked.borrow().is_subset(&looked),
                "{case}: read {asked:?} of {looked:?}"
            );
        }

        // A mapping refused now is not kept: once it was mapped, a refused change leaves
        // it where it is while its pods run, and unmaps it once they are gone.
        let mut m = Mapping::new(Mode::Prefixed, "c1".into());
        m.set("team", "team-c1").expect("free");
        let wanted = wanted_of(&[("team", Some("kube-system"))]);
        let busy = |ns: &str| ns == "team";
        apply(&mut m, "c1", &wanted, &busy, &below);
        assert_eq!(m.current("team"), Some("team-c1"), "pods run there");
        apply(&mut m, "c1", &wanted, &idle, &below);
        assert_eq!(m.current("team"), None, "nowhere it may go");
        // Asked for nothing when nothing would change.
        let mut m = Mapping::new(Mode::Prefixed, "c1".into());
        m.set("a", "a-c1").expect("free");
        assert!(looked_at(&m, "c1", &wanted_of(&[("a", None)])).is_empty());
    }

    #[test]
    fn pods_running_below_keep_their_lower_namespace() {
        // (upper namespace, name, UID) of the node's upper pods; (lower namespace, name,
        // upper UID) of the lower pods with its marks; (upper, lower) placed; how many
        // lower pods or namespaces are not believed.
        type Upper = &'static [(&'static str, &'static str, &'static str)];
        type Pairs = &'static [(&'static str, &'static str)];
        // What the mapping gives now: `<namespace>-c1`, except `moved` (annotated).
        let now: BTreeMap<String, String> = ["shop", "a", "b", "m", "n", "moved"]
            .iter()
            .map(|ns| {
                let lower = if *ns == "moved" {
                    "moved-new".to_owned()
                } else {
                    format!("{ns}-c1")
                };
                ((*ns).to_owned(), lower)
            })
            .collect();
        // Lower namespaces no upper namespace may map onto: reserved, or a user's.
        let admitted = |_: &str, lower: &str| !matches!(lower, "kube-system" | "users");
        let cases: &[(Upper, Upper, Pairs, usize)] = &[
            (&[], &[], &[], 0),
            // Moved by an annotation while down: the pods' namespace wins.
            (
                &[("shop", "p", "u1")],
                &[("shop-old", "p", "u1")],
                &[("shop", "shop-old")],
                0,
            ),
            // An upper pod not mirrored yet, a lower pod whose upper pod is gone.
            (&[("shop", "p", "u1")], &[("shop-c1", "q", "u2")], &[], 0),
            (
                &[("a", "p", "u1"), ("a", "q", "u2"), ("b", "r", "u3")],
                &[
                    ("a-c1", "p", "u1"),
                    ("a-c1", "q", "u2"),
                    ("team", "r", "u3"),
                ],
                &[("a", "a-c1"), ("b", "team")],
                0,
            ),
            // Forged: a lower pod in another upper namespace's lower namespace naming a
            // pod of `n`, listed after the real copy: not believed.
            (
                &[("n", "p", "u1"), ("m", "x", "u2")],
                &[
                    ("m-c1", "x", "u2"),
                    ("n-c1", "p", "u1"),
                    ("m-c1", "p", "u1"),
                ],
                &[("m", "m-c1"), ("n", "n-c1")],
                1,
            ),
            // ... listed before it.
            (
                &[("n", "p", "u1"), ("m", "x", "u2")],
                &[
                    ("m-c1", "p", "u1"),
                    ("m-c1", "x", "u2"),
                    ("n-c1", "p", "u1"),
                ],
                &[("m", "m-c1"), ("n", "n-c1")],
                1,
            ),
            // ... with no real copy, and `m` with no pods of this node.
            (&[("n", "p", "u1")], &[("m-c1", "p", "u1")], &[], 1),
            // Forged in a lower namespace `n` may not map to (reserved, a user's).
            (
                &[("n", "p", "u1")],
                &[("kube-system", "p", "u1"), ("users", "p", "u1")],
                &[],
                2,
            ),
            // Named otherwise than the pod whose UID it names.
            (&[("n", "p", "u1")], &[("elsewhere", "other", "u1")], &[], 1),
            // Two lower namespaces claimed, neither the one the mapping gives now: none.
            (
                &[("moved", "p", "u1"), ("moved", "q", "u2")],
                &[("old-1", "p", "u1"), ("old-2", "q", "u2")],
                &[],
                1,
            ),
            // ... one of them the one it gives now: that one.
            (
                &[("moved", "p", "u1"), ("moved", "q", "u2")],
                &[("old-1", "p", "u1"), ("moved-new", "q", "u2")],
                &[("moved", "moved-new")],
                0,
            ),
            // Two upper namespaces claiming one lower namespace neither maps to now.
            (
                &[("moved", "p", "u1"), ("other", "q", "u2")],
                &[("spare", "p", "u1"), ("spare", "q", "u2")],
                &[],
                1,
            ),
        ];
        for (upper, lower, want, ignored) in cases {
            let (got, not_believed) = in_place(
                upper.iter().copied(),
                lower.iter().copied(),
                &now,
                &admitted,
            );
            let want: BTreeMap<String, String> = want
                .iter()
                .map(|(u, l)| ((*u).to_owned(), (*l).to_owned()))
                .collect();
            assert_eq!(got, want, "upper {upper:?} lower {lower:?}");
            assert_eq!(
                not_believed.len(),
                *ignored,
                "upper {upper:?} lower {lower:?}: {not_believed:?}"
            );
        }
    }

    #[test]
    fn a_placed_namespace_keeps_its_lower_name_against_its_annotation() {
        let mut m = Mapping::new(Mode::Prefixed, "c1".into());
        m.set("shop", "shop-old").expect("free");
        let in_use = |ns: &str| ns == "shop";
        let absent = |_: &str| Below::Absent;
        let refused = apply(
            &mut m,
            "c1",
            &wanted_of(&[("shop", None)]),
            &in_use,
            &absent,
        );
        assert_eq!(refused.len(), 1, "{refused:?}");
        assert_eq!(refused[0].reason, "LowerNamespaceChangeRefused");
        assert_eq!(m.current("shop"), Some("shop-old"));
    }
}
