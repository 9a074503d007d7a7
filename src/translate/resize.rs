//! In-place resize of a pod on the virtual node, and the pod's generation, as a kubelet
//! answers them: the patch that carries an upper resize to the lower copy's `resize`
//! subresource, the `PodResizePending` decision virtual-node takes itself (recorded on the
//! lower copy, so that the status reflector shows it from the pair alone), and which upper
//! generation a lower status answers. Pure.

use k8s_openapi::api::core::v1::{
    Container, ContainerStatus, Pod, PodCondition, ResourceRequirements,
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::with_uid_precondition;

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
}
