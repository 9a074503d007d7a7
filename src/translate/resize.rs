//! In-place resize of a pod on the virtual node, and the pod's generation, as a kubelet
//! answers them: the patch that carries an upper resize to the lower copy's `resize`
//! subresource, the `PodResizePending` decision virtual-node takes itself (recorded on the
//! lower copy, so that the status reflector shows it from the pair alone), and which upper
//! generation a lower status answers. Pure.

use std::cmp::Ordering;

use k8s_openapi::api::core::v1::{
    Container, ContainerStatus, Pod, PodCondition, ResourceRequirements,
};
use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::with_uid_precondition;
use crate::node::resources::{Resources, add, pod_requests, shortfall, subtract};

/// Annotation on a lower pod: the upper pod's `metadata.generation` that the lower pod (as
/// it is now) carries. Written with every write that brings an upper change down (a
/// metadata-only change bumps no generation below), after any resize, so that a lower
/// status observing the lower generation observed this upper one.
pub const UPPER_GENERATION_ANNOTATION: &str = "tensile.dev/upper-generation";
/// Annotation on a lower pod: a resize virtual-node did not carry down
/// ([`PendingResize`] as JSON), shown upstairs as `PodResizePending` while the upper
/// resources still differ from the lower ones.
pub const RESIZE_PENDING_ANNOTATION: &str = "tensile.dev/resize-pending";
/// A kubelet's condition: a resize not (yet) admitted.
pub const RESIZE_PENDING: &str = "PodResizePending";
/// A kubelet's condition: an admitted resize being actuated.
pub const RESIZE_IN_PROGRESS: &str = "PodResizeInProgress";
/// The kubelet's resize conditions: reflected up while the lower pod has them, removed
/// upstairs once it no longer does (a kubelet deletes them when the resize is done).
pub const RESIZE_CONDITIONS: [&str; 2] = [RESIZE_PENDING, RESIZE_IN_PROGRESS];
/// `PodResizePending` reason: the node has no room for it now.
pub const DEFERRED: &str = "Deferred";
/// `PodResizePending` reason: the node can never actuate it.
pub const INFEASIBLE: &str = "Infeasible";

/// A resize virtual-node did not carry down, as [`RESIZE_PENDING_ANNOTATION`] holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingResize {
    /// [`DEFERRED`] or [`INFEASIBLE`].
    pub reason: String,
    /// Why, as a kubelet words it.
    pub message: String,
    /// The upper generation decided on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// When it was first decided (RFC 3339): the condition's transition time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
}

impl PendingResize {
    /// Whether `other` says the same (when apart).
    pub fn same_decision(&self, other: &PendingResize) -> bool {
        self.reason == other.reason
            && self.message == other.message
            && self.generation == other.generation
    }

    /// The `PodResizePending` condition it stands for.
    pub fn condition(&self) -> PodCondition {
        PodCondition {
            type_: RESIZE_PENDING.to_owned(),
            status: "True".to_owned(),
            reason: Some(self.reason.clone()),
            message: Some(self.message.clone()),
            observed_generation: self.generation,
            last_transition_time: self
                .since
                .as_deref()
                .and_then(|t| t.parse().ok())
                .map(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time),
            last_probe_time: None,
        }
    }
}

/// The [`PendingResize`] recorded on `lower`, if any (a malformed record reads as none).
pub fn pending_resize(lower: &Pod) -> Option<PendingResize> {
    let raw = lower
        .metadata
        .annotations
        .as_ref()?
        .get(RESIZE_PENDING_ANNOTATION)?;
    serde_json::from_str(raw).ok()
}

/// The merge patch that records `pending` on the lower pod whose UID is `uid` (`None`
/// removes the record).
pub fn pending_resize_patch(uid: &str, pending: Option<&PendingResize>) -> Value {
    let value = pending
        .and_then(|p| serde_json::to_string(p).ok())
        .map_or(Value::Null, Value::String);
    with_uid_precondition(
        json!({"metadata": {"annotations": {RESIZE_PENDING_ANNOTATION: value}}}),
        uid,
    )
}

/// The upper generation recorded on `lower` ([`UPPER_GENERATION_ANNOTATION`]).
pub fn recorded_upper_generation(lower: &Pod) -> Option<i64> {
    lower
        .metadata
        .annotations
        .as_ref()?
        .get(UPPER_GENERATION_ANNOTATION)?
        .parse()
        .ok()
}

/// The upper generation a lower `observed` generation (the lower status's, or a lower
/// condition's) answers: the one recorded on `lower` once the lower kubelet has observed
/// the lower pod as it is now (its own generation); `None` while it lags, or without a
/// record.
pub fn upper_observed(lower: &Pod, observed: Option<i64>) -> Option<i64> {
    let now = lower.metadata.generation?;
    (observed? >= now)
        .then(|| recorded_upper_generation(lower))
        .flatten()
}

/// The strategic merge patch of the lower pod's `resize` subresource that gives its
/// containers (init containers too) and the pod itself the requests and limits they have
/// upstairs, only to the pod whose UID is the lower one; `None` when they agree. Compared
/// as the API servers write quantities (both in canonical form: `0.5` is stored `500m`);
/// a resource set only below (a lower LimitRange's default) is left alone: a resize cannot
/// remove one anyway.
pub fn resize_patch(upper: &Pod, lower: &Pod) -> Option<Value> {
    let (upper_spec, lower_spec) = (upper.spec.as_ref()?, lower.spec.as_ref()?);
    let mut spec = Map::new();
    for (field, want, have) in [
        (
            "containers",
            &upper_spec.containers[..],
            &lower_spec.containers[..],
        ),
        (
            "initContainers",
            upper_spec.init_containers.as_deref().unwrap_or_default(),
            lower_spec.init_containers.as_deref().unwrap_or_default(),
        ),
    ] {
        let changed: Vec<Value> = want
            .iter()
            .filter_map(|container| {
                let below = have.iter().find(|c| c.name == container.name)?;
                let resources =
                    resources_patch(container.resources.as_ref(), below.resources.as_ref())?;
                Some(json!({"name": container.name, "resources": resources}))
            })
            .collect();
        if !changed.is_empty() {
            spec.insert(field.to_owned(), Value::Array(changed));
        }
    }
    if let Some(resources) =
        resources_patch(upper_spec.resources.as_ref(), lower_spec.resources.as_ref())
    {
        spec.insert("resources".to_owned(), resources);
    }
    if spec.is_empty() {
        return None;
    }
    let uid = lower.metadata.uid.as_deref().unwrap_or_default();
    Some(with_uid_precondition(json!({"spec": spec}), uid))
}

/// Whether `upper`'s resources are still not those of `lower` (a resize not carried).
pub fn resize_outstanding(upper: &Pod, lower: &Pod) -> bool {
    resize_patch(upper, lower).is_some()
}

/// A resize left pending on a node (or the one being decided), as a kubelet's retry pass
/// ranks it (`sortPendingResizes` in `pkg/kubelet/allocation`): resizes that do not grow
/// first, then by priority, then Guaranteed before the rest, then the longest pending,
/// then (where a kubelet keeps arrival order) by `key`, so that every pod's reconcile
/// ranks them alike.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deferral {
    /// `namespace/name`.
    pub key: String,
    /// `spec.priority` (0 without).
    pub priority: i32,
    /// Whether its QoS class is Guaranteed.
    pub guaranteed: bool,
    /// Since when it is pending ([`PendingResize::since`]); `None` for a resize not
    /// decided yet, which a kubelet ranks after those pending.
    pub since: Option<Timestamp>,
    /// What it takes now (its lower copy's requests).
    pub now: Resources,
    /// What it asks (the upper pod's requests).
    pub wanted: Resources,
}

impl Deferral {
    /// Whether it asks more of some resource than it takes now.
    pub fn grows(&self) -> bool {
        self.wanted
            .iter()
            .any(|(name, amount)| *amount > self.now.get(name).copied().unwrap_or_default())
    }

    /// The kubelet's order: `Less` for the one tried first.
    fn turn(&self, other: &Deferral) -> Ordering {
        self.grows()
            .cmp(&other.grows())
            .then_with(|| other.priority.cmp(&self.priority))
            .then_with(|| other.guaranteed.cmp(&self.guaranteed))
            .then_with(|| match (self.since, other.since) {
                (Some(a), Some(b)) => a.cmp(&b),
                (Some(_), None) => Ordering::Less,
                (None, Some(_)) => Ordering::Greater,
                (None, None) => Ordering::Equal,
            })
            .then_with(|| self.key.cmp(&other.key))
    }
}

/// `upper`'s resize as a [`Deferral`], its lower copy `lower` taking what runs now.
pub fn deferral(upper: &Pod, lower: &Pod) -> Deferral {
    let requests = |pod: &Pod| pod.spec.as_ref().map(pod_requests).unwrap_or_default();
    Deferral {
        key: format!(
            "{}/{}",
            upper.metadata.namespace.as_deref().unwrap_or_default(),
            upper.metadata.name.as_deref().unwrap_or_default()
        ),
        priority: upper.spec.as_ref().and_then(|s| s.priority).unwrap_or(0),
        guaranteed: upper.status.as_ref().and_then(|s| s.qos_class.as_deref())
            == Some("Guaranteed"),
        since: pending_resize(lower)
            .filter(|p| p.reason == DEFERRED)
            .and_then(|p| p.since?.parse().ok()),
        now: requests(lower),
        wanted: requests(upper),
    }
}

/// `upper`'s resize, if its lower copy `lower` records it deferred and still does not
/// carry it: one of the node's pending resizes.
pub fn deferred(upper: &Pod, lower: &Pod) -> Option<Deferral> {
    (pending_resize(lower).is_some_and(|p| p.reason == DEFERRED)
        && resize_outstanding(upper, lower))
    .then(|| deferral(upper, lower))
}

/// Why `pod`'s resize cannot be admitted now, as a kubelet words a deferred one; `None`
/// when it is. A kubelet's retry pass over the node's pending resizes, in its order
/// ([`Deferral`]): each is admitted if it fits on `allocatable` beside what the pods not
/// pending take (`used`, which leaves out `pod` and counts each of `pending` at its
/// [`Deferral::now`]) and the resizes admitted before it in the pass. So a resize that
/// fits waits while one ranked before it takes the room, as it would on a kubelet.
pub fn deferred_in_turn(
    allocatable: &Resources,
    used: &Resources,
    pending: &[Deferral],
    pod: &Deferral,
) -> Option<String> {
    let mut used = used.clone();
    let mut before: Vec<&Deferral> = pending
        .iter()
        .filter(|other| other.turn(pod) == Ordering::Less)
        .collect();
    before.sort_by(|a, b| a.turn(b));
    for other in before {
        let mut without = used.clone();
        subtract(&mut without, &other.now);
        if shortfall(allocatable, &without, &other.wanted).is_none() {
            add(&mut without, &other.wanted);
            used = without;
        }
    }
    shortfall(allocatable, &used, &pod.wanted)
}

/// The resources a kubelet resizes in place.
const RESIZABLE: [&str; 2] = ["cpu", "memory"];

/// Whether a resize carried to `lower` is not yet seen by the lower kubelet: its status
/// observes an older generation than the pod's (or none), and the CPU or memory of a
/// container (or of the pod) differs from what the kubelet last reported running with.
/// virtual-node admitted that resize when it carried it down, so upstairs it is
/// `PodResizeInProgress`, as a kubelet shows an admitted resize until it is actuated
/// (without this, the pending condition would go while the old resources still show, and
/// a client would take the resize as done).
pub fn resize_unseen(lower: &Pod) -> bool {
    let Some(generation) = lower.metadata.generation else {
        return false;
    };
    let (Some(spec), Some(status)) = (lower.spec.as_ref(), lower.status.as_ref()) else {
        return false;
    };
    if status.observed_generation.is_some_and(|o| o >= generation) {
        return false;
    }
    let running = |containers: &[Container], statuses: Option<&Vec<ContainerStatus>>| {
        containers.iter().any(|container| {
            statuses
                .into_iter()
                .flatten()
                .find(|s| s.name == container.name)
                .and_then(|s| s.resources.as_ref())
                .is_some_and(|reported| {
                    differs_in_place(container.resources.as_ref(), Some(reported))
                })
        })
    };
    running(&spec.containers, status.container_statuses.as_ref())
        || running(
            spec.init_containers.as_deref().unwrap_or_default(),
            status.init_container_statuses.as_ref(),
        )
        || status
            .resources
            .as_ref()
            .is_some_and(|reported| differs_in_place(spec.resources.as_ref(), Some(reported)))
}

/// Whether `want` asks for CPU or memory (requests or limits) that `have` lacks or holds
/// another value of.
fn differs_in_place(
    want: Option<&ResourceRequirements>,
    have: Option<&ResourceRequirements>,
) -> bool {
    resources_patch(want, have).is_some_and(|patch| {
        ["requests", "limits"].iter().any(|field| {
            patch[field]
                .as_object()
                .is_some_and(|l| l.keys().any(|k| RESIZABLE.contains(&k.as_str())))
        })
    })
}

/// `{"requests": {..}, "limits": {..}}` with the entries of `want` that `have` lacks or
/// holds another value of; `None` when there are none.
fn resources_patch(
    want: Option<&ResourceRequirements>,
    have: Option<&ResourceRequirements>,
) -> Option<Value> {
    let lists = |r: Option<&ResourceRequirements>| {
        (
            r.and_then(|r| r.requests.clone()).unwrap_or_default(),
            r.and_then(|r| r.limits.clone()).unwrap_or_default(),
        )
    };
    let (want_requests, want_limits) = lists(want);
    let (have_requests, have_limits) = lists(have);
    let mut patch = Map::new();
    for (field, want, have) in [
        ("requests", want_requests, have_requests),
        ("limits", want_limits, have_limits),
    ] {
        let differing: Map<String, Value> = want
            .into_iter()
            .filter(|(name, value)| have.get(name) != Some(value))
            .map(|(name, value)| (name, Value::String(value.0)))
            .collect();
        if !differing.is_empty() {
            patch.insert(field.to_owned(), Value::Object(differing));
        }
    }
    (!patch.is_empty()).then_some(Value::Object(patch))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(generation: Option<i64>, annotations: Value, spec: Value, status: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "lower-uid",
                         "generation": generation, "annotations": annotations},
            "spec": spec,
            "status": status,
        }))
        .unwrap()
    }

    fn with_resources(containers: Value, pod_level: Value) -> Value {
        json!({"containers": containers, "resources": pod_level})
    }

    #[test]
    fn a_resize_carries_only_what_differs_by_value() {
        let c = |name: &str, requests: Value, limits: Value| json!({"name": name, "image": "i", "resources": {"requests": requests, "limits": limits}});
        // (case, upper spec, lower spec, expected spec of the patch or null)
        let cases = [
            (
                "the same: nothing",
                with_resources(
                    json!([c("a", json!({"cpu": "500m"}), json!({"memory": "1Gi"}))]),
                    Value::Null,
                ),
                with_resources(
                    json!([c("a", json!({"cpu": "500m"}), json!({"memory": "1Gi"}))]),
                    Value::Null,
                ),
                Value::Null,
            ),
            (
                "a request and a limit changed: both, by name",
                with_resources(
                    json!([
                        c(
                            "a",
                            json!({"cpu": "200m", "memory": "64Mi"}),
                            json!({"cpu": "400m"})
                        ),
                        c("b", json!({"cpu": "100m"}), json!({}))
                    ]),
                    Value::Null,
                ),
                with_resources(
                    json!([
                        c(
                            "a",
                            json!({"cpu": "100m", "memory": "64Mi"}),
                            json!({"cpu": "200m"})
                        ),
                        c("b", json!({"cpu": "100m"}), json!({}))
                    ]),
                    Value::Null,
                ),
                json!({"containers": [{"name": "a", "resources": {
                    "requests": {"cpu": "200m"}, "limits": {"cpu": "400m"}}}]}),
            ),
            (
                "a default set only below is left alone",
                with_resources(
                    json!([c("a", json!({"cpu": "100m"}), json!({}))]),
                    Value::Null,
                ),
                with_resources(
                    json!([c(
                        "a",
                        json!({"cpu": "100m", "memory": "32Mi"}),
                        json!({"memory": "32Mi"})
                    )]),
                    Value::Null,
                ),
                Value::Null,
            ),
            (
                "pod-level resources",
                with_resources(
                    json!([c("a", json!({}), json!({}))]),
                    json!({"requests": {"cpu": "1"}, "limits": {"cpu": "2"}}),
                ),
                with_resources(
                    json!([c("a", json!({}), json!({}))]),
                    json!({"requests": {"cpu": "500m"}, "limits": {"cpu": "2"}}),
                ),
                json!({"resources": {"requests": {"cpu": "1"}}}),
            ),
        ];
        for (case, upper, lower, expected) in cases {
            let upper = pod(Some(2), json!({}), upper, json!({}));
            let lower = pod(Some(1), json!({}), lower, json!({}));
            let patch = resize_patch(&upper, &lower);
            let expected = (!expected.is_null())
                .then(|| json!({"spec": expected, "metadata": {"uid": "lower-uid"}}));
            assert_eq!(patch, expected, "{case}");
            assert_eq!(
                resize_outstanding(&upper, &lower),
                expected.is_some(),
                "{case}"
            );
        }
    }

    #[test]
    fn init_containers_are_resized_too() {
        let spec = |cpu: &str| {
            json!({"containers": [{"name": "a", "image": "i"}],
                   "initContainers": [{"name": "side", "image": "i", "restartPolicy": "Always",
                                       "resources": {"requests": {"cpu": cpu}}}]})
        };
        let upper = pod(Some(2), json!({}), spec("300m"), json!({}));
        let lower = pod(Some(1), json!({}), spec("100m"), json!({}));
        assert_eq!(
            resize_patch(&upper, &lower).unwrap()["spec"],
            json!({"initContainers": [{"name": "side", "resources": {"requests": {"cpu": "300m"}}}]})
        );
    }

    #[test]
    fn a_lower_observed_generation_answers_the_recorded_upper_one_once_caught_up() {
        // (case, lower generation, recorded upper generation, observed, expected)
        let cases = [
            ("caught up", Some(3), Some("7"), Some(3), Some(7)),
            (
                "ahead (a later lower write not ours)",
                Some(3),
                Some("7"),
                Some(4),
                Some(7),
            ),
            ("lagging", Some(3), Some("7"), Some(2), None),
            (
                "nothing observed (kwok, an old kubelet)",
                Some(3),
                Some("7"),
                None,
                None,
            ),
            (
                "no record (made by an older release)",
                Some(3),
                None,
                Some(3),
                None,
            ),
            ("a malformed record", Some(3), Some("seven"), Some(3), None),
            ("no lower generation", None, Some("7"), Some(3), None),
        ];
        for (case, generation, recorded, observed, expected) in cases {
            let annotations = match recorded {
                Some(r) => json!({UPPER_GENERATION_ANNOTATION: r}),
                None => json!({}),
            };
            let lower = pod(
                generation,
                annotations,
                json!({"containers": []}),
                json!({}),
            );
            assert_eq!(upper_observed(&lower, observed), expected, "{case}");
        }
    }

    #[test]
    fn a_pending_resize_reads_back_and_makes_its_condition() {
        let pending = PendingResize {
            reason: DEFERRED.to_owned(),
            message:
                "Node didn't have enough resource: cpu, requested: 5000, used: 2000, capacity: 4000"
                    .to_owned(),
            generation: Some(3),
            since: Some("2026-11-28T10:00:00Z".to_owned()),
        };
        let patch = pending_resize_patch("lower-uid", Some(&pending));
        let annotations = patch["metadata"]["annotations"].clone();
        assert_eq!(patch["metadata"]["uid"], "lower-uid");
        let lower = pod(Some(1), annotations, json!({"containers": []}), json!({}));
        let read = pending_resize(&lower).unwrap();
        assert_eq!(read, pending);
        let condition = read.condition();
        assert_eq!(
            (
                condition.type_.as_str(),
                condition.status.as_str(),
                condition.reason.as_deref(),
                condition.observed_generation
            ),
            (RESIZE_PENDING, "True", Some(DEFERRED), Some(3))
        );
        assert!(condition.last_transition_time.is_some());
        let removal = pending_resize_patch("lower-uid", None);
        assert_eq!(
            removal["metadata"]["annotations"][RESIZE_PENDING_ANNOTATION],
            Value::Null
        );
        let garbled = pod(
            Some(1),
            json!({RESIZE_PENDING_ANNOTATION: "{"}),
            json!({"containers": []}),
            json!({}),
        );
        assert_eq!(pending_resize(&garbled), None);
    }

    #[test]
    fn deferred_resizes_are_admitted_in_the_kubelets_order() {
        let cpu = |milli: i128| Resources::from([("cpu".to_owned(), milli)]);
        let at = |t: &str| Some(t.parse::<Timestamp>().unwrap());
        let resize = |key: &str,
                      priority: i32,
                      guaranteed: bool,
                      since: Option<Timestamp>,
                      now: i128,
                      wanted: i128| Deferral {
            key: key.to_owned(),
            priority,
            guaranteed,
            since,
            now: cpu(now),
            wanted: cpu(wanted),
        };
        let (early, late) = (at("2026-11-28T10:00:00Z"), at("2026-11-28T10:00:05.5Z"));
        // Allocatable 2 CPUs; `used` leaves the pod decided out and counts the pending ones
        // at what they take now, beside what the pods not pending take.
        // (case, the pods not pending, pending, the pod, admitted)
        let cases = [
            (
                "alone, it fits",
                1000,
                vec![],
                resize("ns/p", 0, false, None, 200, 800),
                true,
            ),
            (
                "a resize of higher priority takes the room first",
                1000,
                vec![resize("ns/q", 1000, false, early, 200, 800)],
                resize("ns/p", 0, false, early, 200, 800),
                false,
            ),
            (
                "one ranked first that cannot fit leaves the room to the next",
                1000,
                vec![resize("ns/q", 1000, false, early, 200, 1500)],
                resize("ns/p", 0, false, early, 200, 800),
                true,
            ),
            (
                "Guaranteed before the rest at equal priority",
                1000,
                vec![resize("ns/q", 0, true, late, 200, 800)],
                resize("ns/p", 0, false, early, 200, 800),
                false,
            ),
            (
                "the longest pending first",
                1000,
                vec![resize("ns/q", 0, false, late, 200, 800)],
                resize("ns/p", 0, false, early, 200, 800),
                true,
            ),
            (
                "pending longer than the pod's: first",
                1000,
                vec![resize("ns/q", 0, false, early, 200, 800)],
                resize("ns/p", 0, false, late, 200, 800),
                false,
            ),
            (
                "a resize not decided yet after those pending",
                1000,
                vec![resize("ns/q", 0, false, late, 200, 800)],
                resize("ns/p", 0, false, None, 200, 800),
                false,
            ),
            (
                "one that does not grow before those that do, whatever their priority",
                1400,
                vec![resize("ns/q", 1000, true, early, 200, 600)],
                resize("ns/p", 0, false, None, 800, 400),
                true,
            ),
            (
                "all else equal, by name",
                1000,
                vec![resize("ns/a", 0, false, early, 200, 800)],
                resize("ns/b", 0, false, early, 200, 800),
                false,
            ),
        ];
        for (case, others, pending, pod, admitted) in cases {
            let mut used = cpu(others);
            for other in &pending {
                add(&mut used, &other.now);
            }
            let decided = deferred_in_turn(&cpu(2000), &used, &pending, &pod);
            assert_eq!(decided.is_none(), admitted, "{case}: {decided:?}");
        }
    }

    #[test]
    fn a_pending_resize_reads_as_a_deferral_from_its_pods() {
        let upper: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "shop", "uid": "upper-uid"},
            "spec": {"priority": 1000, "containers": [{"name": "c", "image": "i",
                     "resources": {"requests": {"cpu": "800m"}}}]},
            "status": {"qosClass": "Guaranteed"},
        }))
        .unwrap();
        let record = |reason: &str| {
            serde_json::to_string(&PendingResize {
                reason: reason.to_owned(),
                message: "m".to_owned(),
                generation: Some(2),
                since: Some("2026-11-28T10:00:00Z".to_owned()),
            })
            .unwrap()
        };
        let lower = |annotations: Value, cpu: &str| {
            pod(
                Some(1),
                annotations,
                json!({"containers": [{"name": "c", "image": "i",
                                       "resources": {"requests": {"cpu": cpu}}}]}),
                json!({}),
            )
        };
        let found = deferred(
            &upper,
            &lower(json!({RESIZE_PENDING_ANNOTATION: record(DEFERRED)}), "200m"),
        )
        .unwrap();
        assert_eq!(
            (
                found.key.as_str(),
                found.priority,
                found.guaranteed,
                found.since
            ),
            (
                "shop/web",
                1000,
                true,
                Some("2026-11-28T10:00:00Z".parse().unwrap())
            )
        );
        assert_eq!((found.now["cpu"], found.wanted["cpu"]), (200, 800));
        assert!(found.grows());
        // (case, the lower copy's record, its CPU): not a pending resize of the node
        let cases = [
            ("nothing recorded", json!({}), "200m"),
            (
                "infeasible: never retried",
                json!({RESIZE_PENDING_ANNOTATION: record(INFEASIBLE)}),
                "200m",
            ),
            (
                "carried since",
                json!({RESIZE_PENDING_ANNOTATION: record(DEFERRED)}),
                "800m",
            ),
        ];
        for (case, annotations, cpu) in cases {
            assert_eq!(deferred(&upper, &lower(annotations, cpu)), None, "{case}");
        }
    }
}
