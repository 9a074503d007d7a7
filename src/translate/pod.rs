//! A pod on its way down (the lower copy, and the updates that follow it) and its status on
//! the way back up.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{
    Container, ContainerState, ContainerStateTerminated, ContainerStatus, EphemeralContainer, Pod,
    PodCondition, PodReadinessGate, PodSpec, PodStatus, Toleration, Volume,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::downward::{
    DOWNWARD_ANNOTATIONS, literal_upper_fields, present_upper_fields, upper_value,
};
use super::identity::{UpperApi, give_upper_identity, token_secret_name};
use super::meta::{
    DELETION_COST_ANNOTATION, DELETION_COST_MARK, MIRRORED_KEYS_ANNOTATION, Owner,
    TRIPPED_LABELS_ANNOTATION, UPPER_UID_ANNOTATION, VIRTUAL_POD_LABEL,
};
use super::resize::{
    RESIZE_CONDITIONS, RESIZE_IN_PROGRESS, RESIZE_PENDING, RESIZE_PENDING_ANNOTATION,
    UPPER_GENERATION_ANNOTATION, pending_resize, recorded_upper_generation, resize_outstanding,
    resize_unseen, upper_observed,
};
use super::scheduling::{Confinement, parse_cluster_selector, restore_constraints};
use super::{TranslateError, lower_meta, object_ref, with_uid_precondition};

/// tensile's own records on a lower pod, never copied from the upper pod nor named in its
/// [`MirroredKeys`]: the upper generation it carries and a resize left pending.
const OWN_POD_RECORDS: [&str; 2] = [UPPER_GENERATION_ANNOTATION, RESIZE_PENDING_ANNOTATION];

/// Where the kubelet mounts a pod's service-account credentials.
const SERVICE_ACCOUNT_MOUNT_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Name prefix of the projected token volume the ServiceAccount admission plugin adds.
const PROJECTED_TOKEN_VOLUME_PREFIX: &str = "kube-api-access-";
/// Name prefix of the legacy token volume (before Kubernetes 1.24), as tensile-kube matches it.
const LEGACY_TOKEN_VOLUME_PREFIX: &str = "default-token-";
/// The ServiceAccount every namespace has; each cluster makes its own.
pub(crate) const DEFAULT_SERVICE_ACCOUNT: &str = "default";
/// Exit code the kubelet reports for a container killed with SIGKILL.
const KILLED_EXIT_CODE: i32 = 137;

/// What a lower pod depends on besides the upper pod itself.
#[derive(Clone, Copy, Debug)]
pub struct PodTranslation<'a> {
    /// The virtual node of this upper cluster: the owner marks on every lower pod.
    pub owner: &'a Owner,
    /// Labels moved into `tripped-labels` so they do not steer the lower cluster
    /// (`--ignore-labels`).
    pub ignore_labels: &'a [String],
    /// With `--upper-identity`, where the lower pod reaches the upper API server: its
    /// service-account tokens are then the upper cluster's ([`give_upper_identity`]).
    pub upper_identity: Option<&'a UpperApi>,
    /// With `node` or `label=<key>` granularity, what keeps the pod within the lower nodes
    /// of the virtual node it is bound to, ANDed into what `clusterSelector` restores;
    /// `None` for a member that is one virtual node.
    pub confinement: Option<&'a Confinement>,
}

/// Type of the upper pod condition that records "this pod was mirrored": written with the
/// first status reflected from its lower pod, so that a pod whose lower copy disappears is
/// failed only if it really ran below.
pub const MIRRORED_CONDITION: &str = "tensile.dev/Mirrored";

/// What tensile wrote on a lower pod, as recorded in [`MIRRORED_KEYS_ANNOTATION`]: the keys
/// of its labels and annotations, and each container's image.
#[derive(Serialize, Deserialize, Default, Debug, PartialEq)]
struct MirroredKeys {
    #[serde(default)]
    labels: BTreeSet<String>,
    #[serde(default)]
    annotations: BTreeSet<String>,
    /// Image by container name (init containers included: names are unique in a pod), so
    /// that a lower admission webhook rewriting an image (a registry mirror) is not undone.
    /// Absent in records written before images were recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    images: Option<BTreeMap<String, String>>,
    /// The annotations that hold upper values the lower pod's downward API reads
    /// ([`present_upper_fields`]): kept current from the upper pod (which the stores keep
    /// without the spec that says which are read), never removed. Absent when none.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    downward: BTreeSet<String>,
}

/// The pod to create in the lower cluster for `upper`.
pub fn lower_pod(upper: &Pod, t: &PodTranslation) -> Result<Pod, TranslateError> {
    let (mut pod, record) = lower_pod_and_record(upper, t)?;
    let object = format!("Pod {}", object_ref(&upper.metadata));
    let record = encode_record(&record, &object)?;
    pod.metadata
        .annotations
        .get_or_insert_default()
        .insert(MIRRORED_KEYS_ANNOTATION.to_owned(), record);
    Ok(pod)
}

/// [`MirroredKeys`] as its annotation holds it.
fn encode_record(record: &MirroredKeys, object: &str) -> Result<String, TranslateError> {
    serde_json::to_string(record).map_err(|source| TranslateError::Encode {
        object: object.to_owned(),
        what: MIRRORED_KEYS_ANNOTATION,
        source,
    })
}

/// [`lower_pod`] without its record, and the record.
fn lower_pod_and_record(
    upper: &Pod,
    t: &PodTranslation,
) -> Result<(Pod, MirroredKeys), TranslateError> {
    let mut metadata = lower_meta("Pod", &upper.metadata, t.owner)?;
    let object = format!("Pod {}", object_ref(&upper.metadata));

    // Tripped from the upper labels, before the marks go on, so --ignore-labels can never
    // take tensile's own marks off.
    let mut labels = upper.metadata.labels.clone().unwrap_or_default();
    let tripped = trip_labels(&mut labels, t.ignore_labels);
    labels.insert(VIRTUAL_POD_LABEL.to_owned(), "true".to_owned());
    t.owner.mark(&mut labels);
    let labels = metadata.labels.insert(labels);

    let annotations = metadata.annotations.get_or_insert_default();
    // Their values are tensile's to set (below), never the upper pod's.
    for key in DOWNWARD_ANNOTATIONS {
        annotations.remove(key);
    }
    // Scale-in order upstairs: nothing below reads it, and copying it would cost a lower
    // write per pod when virtual-node sets it.
    for key in [DELETION_COST_ANNOTATION, DELETION_COST_MARK] {
        annotations.remove(key);
    }
    // tensile's own records on the lower pod, never the upper pod's.
    for key in OWN_POD_RECORDS {
        annotations.remove(key);
    }
    if !tripped.is_empty() {
        let encoded = serde_json::to_string(&tripped).map_err(|source| TranslateError::Encode {
            object: object.clone(),
            what: TRIPPED_LABELS_ANNOTATION,
            source,
        })?;
        annotations.insert(TRIPPED_LABELS_ANNOTATION.to_owned(), encoded);
    }
    let spec = upper
        .spec
        .as_ref()
        .ok_or_else(|| TranslateError::MissingField {
            kind: "Pod",
            object: object_ref(&upper.metadata),
            field: "spec",
        })?;
    let mut record = MirroredKeys {
        labels: labels.keys().cloned().collect(),
        annotations: annotations.keys().cloned().collect(),
        images: Some(images_of(spec)),
        downward: BTreeSet::new(),
    };

    let mut spec = spec.clone();
    spec.node_name = None;
    // The lower admission chain derives these from the priority and runtime classes and
    // rejects a pod whose values disagree with its own.
    spec.priority = None;
    spec.preemption_policy = None;
    spec.overhead = None;
    // Nobody sets the gates' conditions below (the upper actors set them upstairs): the
    // upper Ready counts them ([`upper_status`]), the lower pod runs without them.
    spec.readiness_gates = None;
    // A pod cannot be created with ephemeral containers: they follow through the lower
    // pod's ephemeralcontainers subresource ([`missing_ephemeral_containers`]).
    spec.ephemeral_containers = None;
    let stash = parse_cluster_selector(upper.metadata.annotations.as_ref())
        .map_err(|e| e.for_object(object.clone()))?;
    restore_constraints(&mut spec, stash.as_ref());
    if let Some(confinement) = t.confinement {
        confinement.apply(&mut spec);
    }
    match t.upper_identity {
        Some(api) => {
            // Tokens of the upper cluster, from a Secret the token controller keeps; a
            // legacy token Secret of the upper cluster is never copied.
            drop_volumes(&mut spec, |v| v.projected.is_none());
            let name = upper.metadata.name.as_deref().unwrap_or_default();
            give_upper_identity(&mut spec, &token_secret_name(name), api);
        }
        None => drop_volumes(&mut spec, |_| true),
    }
    // After the upper identity, which serves the token volume's namespace from its Secret.
    for key in present_upper_fields(&mut spec) {
        if let Some(value) = upper_value(key, upper) {
            annotations.insert(key.to_owned(), value);
            record.downward.insert(key.to_owned());
        }
    }
    // Not in the record: written by tensile alone, compared apart ([`lower_pod_update`]).
    if let Some(generation) = upper.metadata.generation {
        annotations.insert(
            UPPER_GENERATION_ANNOTATION.to_owned(),
            generation.to_string(),
        );
    }

    let pod = Pod {
        metadata,
        spec: Some(spec),
        status: None,
    };
    Ok((pod, record))
}

/// The image of each container and init container, by name.
fn images_of(spec: &PodSpec) -> BTreeMap<String, String> {
    all_containers(spec)
        .filter_map(|c| Some((c.name.clone(), c.image.clone()?)))
        .collect()
}

/// Moves the labels named in `ignore` out of `labels`, returning them (tensile-kube's
/// `TrimLabels`).
fn trip_labels(
    labels: &mut BTreeMap<String, String>,
    ignore: &[String],
) -> BTreeMap<String, String> {
    ignore
        .iter()
        .filter_map(|key| labels.remove_entry(key))
        .collect()
}

/// Names of the volumes through which the upper cluster handed the pod its service-account
/// token. The lower cluster injects its own, and a token of the upper cluster is of no use
/// below, so these volumes, their mounts and the objects they reference are not mirrored.
pub fn injected_token_volumes(spec: &PodSpec) -> BTreeSet<&str> {
    let legacy_secret_prefix = format!("{}-token-", service_account_name(spec));
    let mounted_as_service_account = |volume: &str| {
        all_containers(spec).any(|c| {
            c.volume_mounts.iter().flatten().any(|m| {
                m.name == volume && m.mount_path.trim_end_matches('/') == SERVICE_ACCOUNT_MOUNT_PATH
            })
        })
    };
    spec.volumes
        .iter()
        .flatten()
        .filter(|volume| {
            let projected_token = volume.name.starts_with(PROJECTED_TOKEN_VOLUME_PREFIX)
                && volume.projected.as_ref().is_some_and(|p| {
                    p.sources
                        .iter()
                        .flatten()
                        .any(|s| s.service_account_token.is_some())
                });
            let legacy_token = volume.secret.as_ref().is_some_and(|secret| {
                let own_token = secret
                    .secret_name
                    .as_deref()
                    .is_some_and(|name| name.starts_with(&legacy_secret_prefix));
                volume.name.starts_with(LEGACY_TOKEN_VOLUME_PREFIX)
                    || (own_token && mounted_as_service_account(&volume.name))
            });
            projected_token || legacy_token
        })
        .map(|volume| volume.name.as_str())
        .collect()
}

/// The ServiceAccount the pod runs as (`default` when unset).
pub fn service_account_name(spec: &PodSpec) -> &str {
    spec.service_account_name
        .as_deref()
        .or(spec.service_account.as_deref())
        .filter(|sa| !sa.is_empty())
        .unwrap_or(DEFAULT_SERVICE_ACCOUNT)
}

/// The pod's containers and init containers.
fn all_containers(spec: &PodSpec) -> impl Iterator<Item = &Container> {
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
}

/// Removes the injected token volumes that `which` picks, and every mount of them.
fn drop_volumes(spec: &mut PodSpec, which: impl Fn(&Volume) -> bool) {
    let injected = injected_token_volumes(spec);
    let dropped: BTreeSet<String> = spec
        .volumes
        .iter()
        .flatten()
        .filter(|v| injected.contains(v.name.as_str()) && which(v))
        .map(|v| v.name.clone())
        .collect();
    if dropped.is_empty() {
        return;
    }
    if let Some(volumes) = spec.volumes.as_mut() {
        volumes.retain(|v| !dropped.contains(&v.name));
    }
    if spec.volumes.as_ref().is_some_and(Vec::is_empty) {
        spec.volumes = None;
    }
    let containers = spec
        .containers
        .iter_mut()
        .chain(spec.init_containers.iter_mut().flatten());
    for container in containers {
        if let Some(mounts) = container.volume_mounts.as_mut() {
            mounts.retain(|m| !dropped.contains(&m.name));
        }
        if container.volume_mounts.as_ref().is_some_and(Vec::is_empty) {
            container.volume_mounts = None;
        }
    }
}

/// Whether the lower object carries both of `owner`'s marks (its node's and its upper
/// cluster's).
pub fn is_owned_by(meta: &ObjectMeta, owner: &Owner) -> bool {
    owner.owns(meta.labels.as_ref())
}

/// Whether the lower object is the copy of the upper object `upper`, by the UID mark
/// alone: it is recognised even when an edit below took its owner label off.
pub fn is_copy_of(lower: &ObjectMeta, upper: &ObjectMeta) -> bool {
    upper.uid.is_some() && upper_uid(lower) == upper.uid.as_deref()
}

/// The UID of the upper object a lower object was copied from.
pub fn upper_uid(meta: &ObjectMeta) -> Option<&str> {
    meta.annotations
        .as_ref()
        .and_then(|a| a.get(UPPER_UID_ANNOTATION))
        .map(String::as_str)
}

/// The pod condition types reflected from the lower pod: those its kubelet owns (and
/// `PodScheduled`, the lower scheduler's). Every other type on the upper pod is an upper
/// actor's (a readiness gate's condition, `DisruptionTarget`, tensile's own mark): a
/// lower actor with `pods/status` writing one below must not make the upper pod Ready
/// early or never, nor mark it disrupted.
pub const REFLECTED_CONDITIONS: [&str; 7] = [
    "PodScheduled",
    "PodReadyToStartContainers",
    "Initialized",
    "ContainersReady",
    "Ready",
    RESIZE_CONDITIONS[0],
    RESIZE_CONDITIONS[1],
];

/// Whether a lower pod condition of type `type_` is reflected up ([`REFLECTED_CONDITIONS`]).
fn is_reflected(type_: &str) -> bool {
    REFLECTED_CONDITIONS.contains(&type_)
}

/// The status to write on the upper pod so it shows what its lower copy is doing. Of the
/// lower conditions only [`REFLECTED_CONDITIONS`]; the upper pod's others stay as they
/// are (the write merges conditions by type).
pub fn upper_status(lower: &Pod, upper: &Pod) -> PodStatus {
    let from = lower.status.clone().unwrap_or_default();
    // Generations count differently in the two clusters: a lower one is shown as the upper
    // one it answers ([`upper_observed`]), or not at all (the upper value stays).
    let mut conditions: Option<Vec<PodCondition>> = from.conditions.map(|conditions| {
        conditions
            .into_iter()
            .filter(|c| is_reflected(&c.type_))
            .map(|c| PodCondition {
                observed_generation: upper_observed(lower, c.observed_generation),
                ..c
            })
            .collect()
    });
    // A resize virtual-node left pending itself, while the lower kubelet says nothing of
    // one and it is still not carried; one it carried that the lower kubelet has yet to
    // see, in progress.
    let lower_has = |type_: &str| conditions.iter().flatten().any(|c| c.type_ == type_);
    let pending = pending_resize(lower)
        .filter(|_| !lower_has(RESIZE_PENDING) && resize_outstanding(upper, lower));
    let in_progress = !lower_has(RESIZE_IN_PROGRESS) && resize_unseen(lower);
    if let Some(pending) = pending {
        conditions.get_or_insert_default().push(pending.condition());
    }
    if in_progress {
        conditions.get_or_insert_default().push(PodCondition {
            type_: RESIZE_IN_PROGRESS.to_owned(),
            status: "True".to_owned(),
            observed_generation: recorded_upper_generation(lower),
            ..PodCondition::default()
        });
    }
    PodStatus {
        phase: from.phase,
        observed_generation: upper_observed(lower, from.observed_generation),
        conditions: conditions.map(|conditions| with_readiness_gates(conditions, upper)),
        container_statuses: from.container_statuses,
        init_container_statuses: from.init_container_statuses,
        ephemeral_container_statuses: from.ephemeral_container_statuses,
        // Pod-level resources: what the lower kubelet allocated and actuated.
        allocated_resources: from.allocated_resources,
        resources: from.resources,
        pod_ip: from.pod_ip,
        pod_ips: from.pod_ips,
        host_ip: from.host_ip,
        host_ips: from.host_ips,
        start_time: from.start_time,
        reason: from.reason,
        message: from.message,
        // Immutable once set upstream; the lower cluster computes the same class anyway.
        qos_class: upper.status.as_ref().and_then(|s| s.qos_class.clone()),
        ..PodStatus::default()
    }
}

/// Reason of the Ready condition while a readiness gate is not True (the kubelet's).
pub const READINESS_GATES_NOT_READY: &str = "ReadinessGatesNotReady";

/// The readiness gates of `pod`.
fn readiness_gates(pod: &Pod) -> &[PodReadinessGate] {
    pod.spec
        .as_ref()
        .and_then(|s| s.readiness_gates.as_deref())
        .unwrap_or_default()
}

/// `lower` (the lower pod's conditions) with Ready as a kubelet computes it for `upper`'s
/// readiness gates: the containers ready (the lower ContainersReady, else its Ready) and
/// every gate's condition True on the upper pod, where the upper actors set them (the lower
/// pod runs without the gates). When not ready for the containers, the containers' reason;
/// for a gate, [`READINESS_GATES_NOT_READY`] and the kubelet's message. It changed when
/// the last of its inputs did. A pod without gates: `lower` as it is.
fn with_readiness_gates(mut lower: Vec<PodCondition>, upper: &Pod) -> Vec<PodCondition> {
    let gates = readiness_gates(upper);
    if gates.is_empty() {
        return lower;
    }
    let find = |conditions: &[PodCondition], type_: &str| -> Option<PodCondition> {
        conditions.iter().find(|c| c.type_ == type_).cloned()
    };
    let Some(containers) = find(&lower, "ContainersReady").or_else(|| find(&lower, "Ready")) else {
        return lower;
    };
    let ready = if containers.status != "True" {
        PodCondition {
            type_: "Ready".to_owned(),
            last_probe_time: None,
            ..containers
        }
    } else {
        let upper_conditions = upper
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_deref())
            .unwrap_or_default();
        let mut since = containers.last_transition_time;
        let mut unready = Vec::new();
        for gate in gates {
            let type_ = &gate.condition_type;
            match find(upper_conditions, type_) {
                None => unready.push(format!(
                    "corresponding condition of pod readiness gate {type_:?} does not exist."
                )),
                Some(condition) => {
                    since = since.max(condition.last_transition_time);
                    if condition.status != "True" {
                        unready.push(format!(
                            "the status of pod readiness gate {type_:?} is not \"True\", but {}",
                            condition.status
                        ));
                    }
                }
            }
        }
        let ready = unready.is_empty();
        PodCondition {
            type_: "Ready".to_owned(),
            status: if ready { "True" } else { "False" }.to_owned(),
            reason: (!ready).then(|| READINESS_GATES_NOT_READY.to_owned()),
            message: (!ready).then(|| unready.join(", ")),
            last_transition_time: since,
            ..PodCondition::default()
        }
    };
    match lower.iter_mut().find(|c| c.type_ == "Ready") {
        Some(condition) => *condition = ready,
        None => lower.push(ready),
    }
    lower
}

/// Whether the upper pod ran below: its status carries [`MIRRORED_CONDITION`], written with
/// the first status reflected from its lower pod. A pod mirrored by a version of tensile
/// that wrote no such record shows it by fields only a reflected lower status sets (the
/// upper scheduler writes only `PodScheduled`); conditions prove nothing there, since
/// other upper actors add their own (readiness gates).
pub fn was_mirrored(upper: &Pod) -> bool {
    let Some(status) = &upper.status else {
        return false;
    };
    let recorded = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == MIRRORED_CONDITION && c.status == "True");
    recorded
        || status.start_time.is_some()
        || status.host_ip.is_some()
        || status
            .container_statuses
            .as_ref()
            .is_some_and(|c| !c.is_empty())
}

/// Whether a lower status says anything the upper pod does not already show. A lower pod
/// that is merely Pending (every condition True, no container status, no reason) tells
/// the user nothing the Pending upper pod does not; not writing it saves one upper write
/// per pod in a burst. A problem (a False condition such as Unschedulable, a waiting
/// container, a reason) is always worth writing.
pub fn status_is_informative(lower: &PodStatus) -> bool {
    lower.phase.as_deref() != Some("Pending")
        || lower.reason.is_some()
        || lower
            .container_statuses
            .as_ref()
            .is_some_and(|c| !c.is_empty())
        || lower
            .init_container_statuses
            .as_ref()
            .is_some_and(|c| !c.is_empty())
        || lower
            .conditions
            .iter()
            .flatten()
            .any(|c| is_reflected(&c.type_) && c.status != "True")
}

/// Whether `current` (the upper pod's status) already shows `desired` (from
/// [`upper_status`]), comparing only the fields copied from the lower pod. Fields
/// [`upper_status`] leaves empty are not compared, so something else setting them upstream
/// (the upper scheduler's nominatedNodeName) does not cause a write on every event.
pub fn status_in_sync(current: Option<&PodStatus>, desired: &PodStatus) -> bool {
    digest_in_sync(&status_digest(current), desired)
}

/// What [`status_in_sync`] compares of a status, as 64-bit hashes: the fields
/// [`upper_status`] copies (conditions apart) and each condition by type. The upper pod
/// store keeps this instead of the upper status (see [`status_summary`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StatusDigest {
    /// The copied fields but conditions.
    fields: u64,
    /// Each condition: the hash of its type and of the whole condition.
    conditions: Box<[(u64, u64)]>,
}

impl StatusDigest {
    /// The heap bytes it holds.
    pub fn heap_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.conditions)
    }

    /// How many bytes [`StatusDigest::write_to`] appends.
    pub fn encoded_len(&self) -> usize {
        8 + 4 + 16 * self.conditions.len()
    }

    /// Appends it to `out`: `fields`, the number of conditions (4 bytes), and each
    /// condition's two hashes, all little-endian.
    pub fn write_to(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.fields.to_le_bytes());
        let count = u32::try_from(self.conditions.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&count.to_le_bytes());
        for (kind, whole) in self.conditions.iter().take(count as usize) {
            out.extend_from_slice(&kind.to_le_bytes());
            out.extend_from_slice(&whole.to_le_bytes());
        }
    }

    /// The digest [`StatusDigest::write_to`] wrote at the start of `bytes`, and the bytes
    /// after it.
    pub fn read_from(bytes: &[u8]) -> Option<(Self, &[u8])> {
        fn u64_at(bytes: &[u8]) -> Option<(u64, &[u8])> {
            let (head, rest) = bytes.split_first_chunk::<8>()?;
            Some((u64::from_le_bytes(*head), rest))
        }
        let (fields, rest) = u64_at(bytes)?;
        let (count, mut rest) = rest.split_first_chunk::<4>()?;
        let count = u32::from_le_bytes(*count) as usize;
        let mut conditions = Vec::with_capacity(count.min(rest.len() / 16));
        for _ in 0..count {
            let (kind, tail) = u64_at(rest)?;
            let (whole, tail) = u64_at(tail)?;
            conditions.push((kind, whole));
            rest = tail;
        }
        Some((
            Self {
                fields,
                conditions: conditions.into_boxed_slice(),
            },
            rest,
        ))
    }
}

fn hash_of<T: std::hash::Hash + ?Sized>(value: &T) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    BuildHasherDefault::<DefaultHasher>::default().hash_one(value)
}

/// A value's hash through its JSON: k8s-openapi types implement no `Hash`, and their
/// JSON is canonical (struct fields in order, maps sorted).
fn json_hash<T: Serialize>(value: &T) -> u64 {
    hash_of(&serde_json::to_vec(value).unwrap_or_default())
}

/// The digest of `status` for [`digest_in_sync`].
pub fn status_digest(status: Option<&PodStatus>) -> StatusDigest {
    let mut copied = copied_fields(status.cloned().unwrap_or_default());
    let conditions = copied
        .conditions
        .take()
        .unwrap_or_default()
        .iter()
        .map(|c| (hash_of(c.type_.as_str()), json_hash(c)))
        .collect();
    StatusDigest {
        fields: json_hash(&copied),
        conditions,
    }
}

/// [`status_in_sync`] for a current status known by its digest.
pub fn digest_in_sync(current: &StatusDigest, desired: &PodStatus) -> bool {
    let desired = status_digest(Some(desired));
    if current.fields != desired.fields {
        return false;
    }
    // Conditions of types the lower pod does not report are other upper actors' (readiness
    // gates) or tensile's own mark: a status write merges conditions by type and leaves
    // them be, so they are no difference. Order does not matter either: a merge by type
    // keeps the upper order.
    // The resize conditions are compared even when the lower pod has none: one left
    // upstairs is removed ([`upper_status_patch`]).
    let reflected_types: BTreeSet<u64> = desired
        .conditions
        .iter()
        .map(|(t, _)| *t)
        .chain(RESIZE_CONDITIONS.iter().map(|t| hash_of(*t)))
        .collect();
    let mut current: Vec<(u64, u64)> = current
        .conditions
        .iter()
        .filter(|(t, _)| reflected_types.contains(t))
        .copied()
        .collect();
    let mut desired = desired.conditions.into_vec();
    current.sort_unstable();
    desired.sort_unstable();
    current == desired
}

/// What the pod controller reads of an upper pod's status between reconciles: phase,
/// reason, message, qosClass, and whether it [`was_mirrored`] (as tensile's own
/// [`MIRRORED_CONDITION`]). The rest is compared through its [`StatusDigest`]; a step that
/// needs the whole status (marking the pod Failed) reads the pod again. The conditions of
/// the pod's readiness `gates` are kept (type, status, transition time): the upper Ready
/// counts them ([`upper_status`]).
pub fn status_summary(status: &PodStatus, gates: &[PodReadinessGate]) -> PodStatus {
    let mirrored = was_mirrored(&Pod {
        status: Some(status.clone()),
        ..Pod::default()
    });
    let mut conditions: Vec<PodCondition> = status
        .conditions
        .iter()
        .flatten()
        .filter(|c| gates.iter().any(|g| g.condition_type == c.type_))
        .map(|c| PodCondition {
            type_: c.type_.clone(),
            status: c.status.clone(),
            last_transition_time: c.last_transition_time.clone(),
            ..PodCondition::default()
        })
        .collect();
    if mirrored {
        conditions.push(PodCondition {
            type_: MIRRORED_CONDITION.to_owned(),
            status: "True".to_owned(),
            ..PodCondition::default()
        });
    }
    PodStatus {
        phase: status.phase.clone(),
        reason: status.reason.clone(),
        message: status.message.clone(),
        qos_class: status.qos_class.clone(),
        conditions: (!conditions.is_empty()).then_some(conditions),
        ..PodStatus::default()
    }
}

/// The part of a status that [`upper_status`] copies, with empty lists as absent and
/// conditions in type order (a write merges them by type, keeping the upper order).
fn copied_fields(status: PodStatus) -> PodStatus {
    fn non_empty<T>(list: Option<Vec<T>>) -> Option<Vec<T>> {
        list.filter(|l| !l.is_empty())
    }
    PodStatus {
        phase: status.phase,
        observed_generation: status.observed_generation,
        conditions: non_empty(status.conditions).map(|conditions| {
            let mut conditions: Vec<PodCondition> = conditions
                .into_iter()
                .map(|c| PodCondition {
                    observed_generation: None,
                    ..c
                })
                .collect();
            conditions.sort_by(|a, b| a.type_.cmp(&b.type_));
            conditions
        }),
        container_statuses: non_empty(status.container_statuses),
        init_container_statuses: non_empty(status.init_container_statuses),
        ephemeral_container_statuses: non_empty(status.ephemeral_container_statuses),
        allocated_resources: status.allocated_resources.filter(|r| !r.is_empty()),
        resources: status.resources,
        pod_ip: status.pod_ip,
        pod_ips: non_empty(status.pod_ips),
        host_ip: status.host_ip,
        host_ips: non_empty(status.host_ips),
        start_time: status.start_time,
        reason: status.reason,
        message: status.message,
        ..PodStatus::default()
    }
}

/// The status fields tensile writes on an upper pod that a written status clears when it
/// lacks them. Conditions are not among them: they are merged by type, so that those of
/// other upper actors (readiness gates) stay.
const CLEARED_WHEN_ABSENT: &[&str] = &[
    "phase",
    "containerStatuses",
    "initContainerStatuses",
    "ephemeralContainerStatuses",
    "allocatedResources",
    "resources",
    "podIP",
    "podIPs",
    "hostIP",
    "hostIPs",
    "startTime",
    "reason",
    "message",
    "nominatedNodeName",
];

/// The optional fields of a pod condition that a written condition clears when it lacks
/// them. Not `observedGeneration`: one not known yet (the lower kubelet lags) leaves the
/// upper value as it was.
const CONDITION_FIELDS: &[&str] = &["lastProbeTime", "lastTransitionTime", "message", "reason"];

/// The strategic merge patch that writes `status` on the upper pod whose UID is `uid`:
/// the fields it lacks are cleared, its conditions merged by type with the pod's others,
/// and [`MIRRORED_CONDITION`] added. Carries `uid` as a precondition (as the kubelet's
/// status manager does), so it never lands on a pod re-created under the same name.
pub fn upper_status_patch(uid: &str, status: &PodStatus) -> Value {
    let mut body = serde_json::to_value(status).unwrap_or_else(|_| json!({}));
    if let Some(fields) = body.as_object_mut() {
        for field in CLEARED_WHEN_ABSENT {
            fields.entry(*field).or_insert(Value::Null);
        }
        let conditions = fields.entry("conditions").or_insert_with(|| json!([]));
        if let Some(conditions) = conditions.as_array_mut() {
            conditions.retain(|c| c["type"] != MIRRORED_CONDITION);
            conditions.push(json!({"type": MIRRORED_CONDITION, "status": "True"}));
            // A condition is merged field by field too: what it lacks must be cleared, or
            // a reason would outlive the state it explained.
            for condition in conditions.iter_mut().filter_map(Value::as_object_mut) {
                for field in CONDITION_FIELDS {
                    condition.entry(*field).or_insert(Value::Null);
                }
            }
            // A kubelet removes its resize conditions once the resize is done: so do we.
            for type_ in RESIZE_CONDITIONS {
                if !conditions.iter().any(|c| c["type"] == type_) {
                    conditions.push(json!({"type": type_, "$patch": "delete"}));
                }
            }
        }
        // Lists merged by IP are replaced whole, so an address the lower pod no longer
        // has does not linger.
        for field in ["podIPs", "hostIPs"] {
            if let Some(ips) = fields.get_mut(field).and_then(Value::as_array_mut) {
                ips.push(json!({"$patch": "replace"}));
            }
        }
    }
    with_uid_precondition(json!({ "status": body }), uid)
}

/// The patch that shows on a pending upper pod (UID `uid`) why it is not running below.
pub fn pending_reason_patch(uid: &str, reason: &str, message: &str) -> Value {
    with_uid_precondition(
        json!({"status": {"phase": "Pending", "reason": reason, "message": message}}),
        uid,
    )
}

/// The strategic merge patch that brings the lower pod in line with the upper pod, within
/// what Kubernetes lets change on an existing pod; `None` when they already agree. Maps
/// and tolerations are sent as a JSON merge patch would; containers only as `{name,
/// image}` for those whose image changed upstream since tensile wrote it (merged by name).
/// The record of what tensile wrote is rewritten only when what it records changed.
pub fn lower_pod_update(
    upper: &Pod,
    lower: &Pod,
    t: &PodTranslation,
) -> Result<Option<Value>, TranslateError> {
    let (desired, mut want_record) = lower_pod_and_record(upper, t)?;
    let object = format!("Pod {}", object_ref(&lower.metadata));
    let recorded: MirroredKeys = lower
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(MIRRORED_KEYS_ANNOTATION))
        .and_then(|raw| serde_json::from_str(raw).ok())
        .unwrap_or_default();
    // The record is compared for what it says rather than as text, so a record written
    // before images were recorded costs no write of its own.
    let mut want_annotations = desired.metadata.annotations.clone().unwrap_or_default();
    let mut have_annotations = lower.metadata.annotations.clone().unwrap_or_default();
    have_annotations.remove(MIRRORED_KEYS_ANNOTATION);
    // The downward API's annotations are kept apart: which ones the lower pod reads is
    // known from its record (`upper` may be a stored pod, without the spec that says),
    // and they are never removed (the spec that reads them cannot change).
    want_record
        .downward
        .extend(recorded.downward.iter().cloned());
    for key in DOWNWARD_ANNOTATIONS.iter().chain(&OWN_POD_RECORDS) {
        want_annotations.remove(*key);
        have_annotations.remove(*key);
    }
    let downward: Vec<(String, String)> = want_record
        .downward
        .iter()
        .filter_map(|key| Some((key.clone(), upper_value(key, upper)?)))
        .collect();
    let want_labels = desired.metadata.labels.clone().unwrap_or_default();

    let labels = map_patch(
        lower.metadata.labels.as_ref(),
        &want_labels,
        &recorded.labels,
    );
    let mut annotations = map_patch(
        Some(&have_annotations),
        &want_annotations,
        &recorded.annotations,
    );
    let lower_annotations = lower.metadata.annotations.as_ref();
    for (key, value) in downward {
        if lower_annotations.and_then(|a| a.get(&key)) != Some(&value) {
            annotations.insert(key, Value::String(value));
        }
    }
    // The upper generation this write brings down, and a pending resize no longer pending
    // (carried, or undone upstairs) forgotten.
    if let Some(generation) = upper.metadata.generation
        && recorded_upper_generation(lower) != Some(generation)
    {
        annotations.insert(
            UPPER_GENERATION_ANNOTATION.to_owned(),
            Value::String(generation.to_string()),
        );
    }
    if lower_annotations.is_some_and(|a| a.contains_key(RESIZE_PENDING_ANNOTATION))
        && !resize_outstanding(upper, lower)
    {
        annotations.insert(RESIZE_PENDING_ANNOTATION.to_owned(), Value::Null);
    }

    let mut spec = Map::new();
    let want = desired.spec.unwrap_or_default();
    let have = lower.spec.clone().unwrap_or_default();
    let written = recorded.images.as_ref();
    let mut images_changed = false;
    if let Some(containers) = with_images(&have.containers, &want.containers, written) {
        images_changed = true;
        spec.insert(
            "containers".to_owned(),
            encode(&object, "containers", &containers)?,
        );
    }
    let have_init = have.init_containers.clone().unwrap_or_default();
    let want_init = want.init_containers.clone().unwrap_or_default();
    if let Some(containers) = with_images(&have_init, &want_init, written) {
        images_changed = true;
        spec.insert(
            "initContainers".to_owned(),
            encode(&object, "initContainers", &containers)?,
        );
    }
    if have.active_deadline_seconds != want.active_deadline_seconds {
        spec.insert(
            "activeDeadlineSeconds".to_owned(),
            want.active_deadline_seconds
                .map_or(Value::Null, Value::from),
        );
    }
    if let Some(tolerations) =
        added_tolerations(have.tolerations.as_deref(), want.tolerations.as_deref())
    {
        spec.insert(
            "tolerations".to_owned(),
            encode(&object, "tolerations", &tolerations)?,
        );
    }

    let keys_changed = recorded.labels.iter().ne(want_labels.keys())
        || recorded.annotations.iter().ne(want_annotations.keys())
        || recorded.downward != want_record.downward;
    let recorded_images_stale = recorded
        .images
        .as_ref()
        .is_some_and(|images| *images != images_of(&want));
    if keys_changed || images_changed || recorded_images_stale {
        annotations.insert(
            MIRRORED_KEYS_ANNOTATION.to_owned(),
            Value::String(encode_record(&want_record, &object)?),
        );
    }
    let mut metadata = Map::new();
    for (field, patch) in [("labels", labels), ("annotations", annotations)] {
        if !patch.is_empty() {
            metadata.insert(field.to_owned(), Value::Object(patch));
        }
    }

    let mut patch = Map::new();
    if !metadata.is_empty() {
        patch.insert("metadata".to_owned(), Value::Object(metadata));
    }
    if !spec.is_empty() {
        patch.insert("spec".to_owned(), Value::Object(spec));
    }
    Ok((!patch.is_empty()).then_some(Value::Object(patch)))
}

/// The ephemeral containers of `upper` (added by `kubectl debug` through its
/// ephemeralcontainers subresource) that `lower` lacks, as they go below: without mounts
/// of the upper cluster's service-account token volume, which the lower pod does not have,
/// and reading the upper pod's UID, namespace and node as literal values
/// ([`literal_upper_fields`]). Matched by name: an ephemeral container can be neither
/// changed nor removed once added, so one of that name below is this one. Those added
/// below only are left alone.
pub fn missing_ephemeral_containers(upper: &Pod, lower: &Pod) -> Vec<EphemeralContainer> {
    let Some(spec) = upper.spec.as_ref() else {
        return Vec::new();
    };
    let present: BTreeSet<&str> = lower
        .spec
        .as_ref()
        .and_then(|s| s.ephemeral_containers.as_ref())
        .into_iter()
        .flatten()
        .map(|c| c.name.as_str())
        .collect();
    let token_volumes = injected_token_volumes(spec);
    spec.ephemeral_containers
        .iter()
        .flatten()
        .filter(|c| !present.contains(c.name.as_str()))
        .map(|c| {
            let mut container = c.clone();
            if let Some(mounts) = container.volume_mounts.as_mut() {
                mounts.retain(|m| !token_volumes.contains(m.name.as_str()));
            }
            if container.volume_mounts.as_ref().is_some_and(Vec::is_empty) {
                container.volume_mounts = None;
            }
            literal_upper_fields(&mut container.env, upper);
            container
        })
        .collect()
}

/// The strategic merge patch of the lower pod's ephemeralcontainers subresource that adds
/// `added` (merged by name, so those already there stay), only to the pod whose UID is
/// `lower_uid`.
pub fn ephemeral_containers_patch(
    lower_uid: &str,
    added: &[EphemeralContainer],
    object: &str,
) -> Result<Value, TranslateError> {
    let containers = encode(object, "ephemeralContainers", &added)?;
    Ok(with_uid_precondition(
        json!({"spec": {"ephemeralContainers": containers}}),
        lower_uid,
    ))
}

/// `value` as JSON, for a patch.
fn encode<T: Serialize>(
    object: &str,
    what: &'static str,
    value: &T,
) -> Result<Value, TranslateError> {
    serde_json::to_value(value).map_err(|source| TranslateError::Encode {
        object: object.to_owned(),
        what,
        source,
    })
}

/// The merge patch of a label or annotation map: desired entries that differ, and `null`
/// for keys tensile wrote earlier (`recorded`) that are no longer desired. Empty when the
/// maps agree.
fn map_patch(
    have: Option<&BTreeMap<String, String>>,
    want: &BTreeMap<String, String>,
    recorded: &BTreeSet<String>,
) -> Map<String, Value> {
    let empty = BTreeMap::new();
    let have = have.unwrap_or(&empty);
    let mut patch = Map::new();
    for (key, value) in want {
        if have.get(key) != Some(value) {
            patch.insert(key.clone(), Value::String(value.clone()));
        }
    }
    for key in recorded {
        if !want.contains_key(key) && have.contains_key(key) {
            patch.insert(key.clone(), Value::Null);
        }
    }
    patch
}

/// The containers whose image changed upstream since tensile wrote it (`written`, by
/// container name; the lower pod's own image where nothing was recorded), matched by name
/// (the lower cluster may have injected containers of its own), as `{name, image}`
/// entries of a strategic merge patch (which merges containers by name, so the rest of
/// each container and the unchanged ones need not be sent, nor kept in memory). Comparing
/// with what was written rather than what runs leaves alone an image that the lower
/// admission rewrote (a registry mirror): undoing it would restart the container, and
/// the webhook would rewrite it again, for ever.
fn with_images(
    lower: &[Container],
    upper: &[Container],
    written: Option<&BTreeMap<String, String>>,
) -> Option<Vec<Container>> {
    let changed: Vec<Container> = lower
        .iter()
        .filter_map(|c| {
            let image = upper
                .iter()
                .find(|u| u.name == c.name)
                .and_then(|u| u.image.as_ref())?;
            let last = written.and_then(|w| w.get(&c.name)).or(c.image.as_ref());
            (last != Some(image)).then(|| Container {
                name: c.name.clone(),
                image: Some(image.clone()),
                ..Container::default()
            })
        })
        .collect();
    (!changed.is_empty()).then_some(changed)
}

/// The lower tolerations plus those the upper pod gained. Kubernetes accepts only
/// additions on a running pod, and the lower admission adds its own defaults, so a removal
/// upstream is not sent; `None` when nothing was added.
fn added_tolerations(
    lower: Option<&[Toleration]>,
    upper: Option<&[Toleration]>,
) -> Option<Vec<Toleration>> {
    let lower = lower.unwrap_or_default();
    let added: Vec<&Toleration> = upper
        .unwrap_or_default()
        .iter()
        .filter(|t| !lower.contains(t))
        .collect();
    if added.is_empty() {
        return None;
    }
    Some(lower.iter().chain(added).cloned().collect())
}

/// Reason a kubelet gives a container it could not find when its pod was terminated.
const CONTAINER_STATUS_UNKNOWN: &str = "ContainerStatusUnknown";

/// The last status of a deleted upper pod whose lower copy is gone, as a kubelet writes it
/// before it finishes the deletion: `last` (the lower pod's last status, reflected by
/// [`upper_status`]) with every container terminated (one still shown otherwise was
/// stopped unseen: [`CONTAINER_STATUS_UNKNOWN`], exit code 137, as the kubelet reports it),
/// not ready, and a terminal phase (Succeeded when every container exited 0).
pub fn terminated_status(last: PodStatus) -> PodStatus {
    let terminate = |status: ContainerStatus| -> ContainerStatus {
        let state = status.state.clone().unwrap_or_default();
        if state.terminated.is_some() {
            return ContainerStatus {
                ready: false,
                started: Some(false),
                ..status
            };
        }
        let started_at = state.running.and_then(|r| r.started_at);
        ContainerStatus {
            ready: false,
            started: Some(false),
            state: Some(ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: KILLED_EXIT_CODE,
                    reason: Some(CONTAINER_STATUS_UNKNOWN.to_owned()),
                    message: Some(
                        "The container could not be located when the pod was terminated".to_owned(),
                    ),
                    started_at,
                    ..ContainerStateTerminated::default()
                }),
                ..ContainerState::default()
            }),
            ..status
        }
    };
    let containers: Option<Vec<ContainerStatus>> = last
        .container_statuses
        .map(|c| c.into_iter().map(terminate).collect());
    let init_containers: Option<Vec<ContainerStatus>> = last
        .init_container_statuses
        .map(|c| c.into_iter().map(terminate).collect());
    // No container ever reported (a pod that never ran below) is not a success.
    let all_succeeded = containers.as_ref().is_some_and(|c| !c.is_empty())
        && containers.iter().flatten().all(|c| {
            c.state
                .as_ref()
                .and_then(|s| s.terminated.as_ref())
                .is_some_and(|t| t.exit_code == 0)
        });
    let phase = match last.phase.as_deref() {
        Some("Succeeded" | "Failed") => last.phase,
        _ if all_succeeded => Some("Succeeded".to_owned()),
        _ => Some("Failed".to_owned()),
    };
    // Ready and ContainersReady as the lower kubelet last wrote them when it did write them
    // False; otherwise False now.
    let conditions = last.conditions.map(|conditions| {
        conditions
            .into_iter()
            .map(|c| match c.type_.as_str() {
                "Ready" | "ContainersReady" if c.status == "True" => PodCondition {
                    status: "False".to_owned(),
                    reason: Some("PodCompleted".to_owned()),
                    message: None,
                    ..c
                },
                _ => c,
            })
            .collect()
    });
    PodStatus {
        phase,
        conditions,
        container_statuses: containers,
        init_container_statuses: init_containers,
        ..last
    }
}

/// The status that ends an upper pod whose lower copy is gone (evicted or deleted out of
/// band), so its controller replaces it.
pub fn lower_gone_status(upper: &Pod, reason: &str, message: &str) -> PodStatus {
    let current = upper.status.clone().unwrap_or_default();
    let terminate = |status: ContainerStatus| -> ContainerStatus {
        if status
            .state
            .as_ref()
            .is_some_and(|s| s.terminated.is_some())
        {
            return status;
        }
        let started_at = status
            .state
            .as_ref()
            .and_then(|s| s.running.as_ref())
            .and_then(|r| r.started_at.clone());
        ContainerStatus {
            ready: false,
            started: Some(false),
            state: Some(ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: KILLED_EXIT_CODE,
                    reason: Some(reason.to_owned()),
                    message: Some(message.to_owned()),
                    started_at,
                    container_id: status.container_id.clone(),
                    ..ContainerStateTerminated::default()
                }),
                ..ContainerState::default()
            }),
            ..status
        }
    };
    // Every container of the spec gets a status, keeping what was known of it.
    let statuses_for = |containers: &[Container], known: Option<Vec<ContainerStatus>>| {
        let mut known = known.unwrap_or_default();
        containers
            .iter()
            .map(|c| {
                let status = known
                    .iter()
                    .position(|s| s.name == c.name)
                    .map(|i| known.swap_remove(i))
                    .unwrap_or_else(|| ContainerStatus {
                        name: c.name.clone(),
                        image: c.image.clone().unwrap_or_default(),
                        ..ContainerStatus::default()
                    });
                terminate(status)
            })
            .collect::<Vec<_>>()
    };
    let spec = upper.spec.clone().unwrap_or_default();
    let container_statuses = statuses_for(&spec.containers, current.container_statuses);
    let init_container_statuses = statuses_for(
        spec.init_containers.as_deref().unwrap_or_default(),
        current.init_container_statuses,
    );

    let mut conditions: Vec<PodCondition> = current
        .conditions
        .unwrap_or_default()
        .into_iter()
        .filter(|c| c.type_ != "Ready" && c.type_ != "ContainersReady")
        .collect();
    for type_ in ["ContainersReady", "Ready"] {
        conditions.push(PodCondition {
            type_: type_.to_owned(),
            status: "False".to_owned(),
            reason: Some(reason.to_owned()),
            message: Some(message.to_owned()),
            ..PodCondition::default()
        });
    }

    PodStatus {
        phase: Some("Failed".to_owned()),
        reason: Some(reason.to_owned()),
        message: Some(message.to_owned()),
        conditions: Some(conditions),
        container_statuses: Some(container_statuses),
        init_container_statuses: (!init_container_statuses.is_empty())
            .then_some(init_container_statuses),
        ..current
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NODE: &str = "vk-node";
    use crate::translate::meta::{
        OWNER_NODE_LABEL, UPPER_CLUSTER_LABEL, UPPER_LABELS_ANNOTATION, UPPER_NAMESPACE_ANNOTATION,
        UPPER_NODE_NAME_ANNOTATION,
    };

    const CLUSTER: &str = "cluster-1";
    static OWNER: std::sync::LazyLock<Owner> =
        std::sync::LazyLock::new(|| Owner::new(NODE, CLUSTER));

    fn pod(value: Value) -> Pod {
        serde_json::from_value(value).unwrap()
    }

    fn translation(ignore_labels: &[String]) -> PodTranslation<'_> {
        PodTranslation {
            upper_identity: None,
            owner: &OWNER,
            ignore_labels,
            confinement: None,
        }
    }

    /// tensile-kube's `PodForTest`, as the upper API server returns it after binding.
    fn upper_json() -> Value {
        json!({
            "metadata": {
                "name": "testbase",
                "namespace": "default",
                "uid": "uid-1",
                "resourceVersion": "42",
                "generation": 1,
                "generateName": "testbase-",
                "creationTimestamp": "2024-01-01T00:00:00Z",
                "selfLink": "/api/v1/namespaces/default/pods/testbase",
                "finalizers": ["example.com/keep"],
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "test", "uid": "sts-uid"}],
                "managedFields": [{"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1"}],
            },
            "spec": {
                "containers": [{
                    "name": "app",
                    "image": "nginx:1",
                    "resources": {"limits": {"cpu": "10"}, "requests": {"cpu": "10"}},
                    "volumeMounts": [{"name": "default-token-mvzcf", "mountPath": SERVICE_ACCOUNT_MOUNT_PATH, "readOnly": true}],
                }],
                "nodeName": NODE,
                "volumes": [{"name": "default-token-mvzcf", "secret": {"secretName": "default-token-mvzcf", "defaultMode": 420}}],
            },
            "status": {"phase": "Pending", "qosClass": "Guaranteed"},
        })
    }

    /// What [`lower_pod`] makes of [`upper_json`], without the mirrored-keys record.
    fn lower_json() -> Value {
        json!({
            "metadata": {
                "name": "testbase",
                "namespace": "default",
                "labels": {VIRTUAL_POD_LABEL: "true", OWNER_NODE_LABEL: NODE, UPPER_CLUSTER_LABEL: CLUSTER},
                "annotations": {UPPER_UID_ANNOTATION: "uid-1"},
            },
            "spec": {
                "containers": [{
                    "name": "app",
                    "image": "nginx:1",
                    "resources": {"limits": {"cpu": "10"}, "requests": {"cpu": "10"}},
                }],
            },
        })
    }

    /// A pod bound to a group's virtual node is confined to the group below: the
    /// requirement ANDed into each restored alternative, or alone without a stash; the
    /// update path never touches the affinity (immutable below).
    #[test]
    fn a_group_confines_the_lower_pod() {
        use crate::translate::scheduling::Placement;
        let zone = Confinement {
            placement: Placement::Expression,
            requirement: serde_json::from_value(
                json!({"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}),
            )
            .unwrap(),
        };
        let in_a = json!({"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]});
        let ssd = json!({"key": "disk", "operator": "In", "values": ["ssd"]});
        let stash =
            json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
            {"nodeSelectorTerms": [{"matchExpressions": [ssd]}]}}}})
            .to_string();
        let cases = [
            ("no stash", json!({}), json!([{"matchExpressions": [in_a]}])),
            (
                "stash: ANDed",
                json!({"metadata": {"annotations": {"clusterSelector": stash}}}),
                json!([{"matchExpressions": [ssd, in_a]}]),
            ),
        ];
        for (name, patch, want) in cases {
            let mut upper = upper_json();
            merge(&mut upper, &patch);
            let upper = pod(upper);
            let t = PodTranslation {
                confinement: Some(&zone),
                ..translation(&[])
            };
            let lower = lower_pod(&upper, &t).unwrap();
            let spec = serde_json::to_value(lower.spec.as_ref().unwrap()).unwrap();
            assert_eq!(
                spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                    ["nodeSelectorTerms"],
                want,
                "{name}"
            );
            // Without it, as before: no required node affinity of its own.
            let plain = lower_pod(&upper, &translation(&[])).unwrap();
            let plain = serde_json::to_value(plain.spec.as_ref().unwrap()).unwrap();
            assert!(
                !plain["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
                    .to_string()
                    .contains("topology.kubernetes.io/zone"),
                "{name}"
            );
            // The update of the confined copy patches no affinity.
            let patch = lower_pod_update(&upper, &lower, &t).unwrap();
            assert!(
                patch.is_none_or(|p| p["spec"].get("affinity").is_none()),
                "{name}"
            );
        }
    }

    /// Applies a JSON merge patch (RFC 7386), to build fixtures and check patches.
    fn merge(target: &mut Value, patch: &Value) {
        match patch {
            Value::Object(fields) => {
                if !target.is_object() {
                    *target = json!({});
                }
                for (key, value) in fields {
                    if value.is_null() {
                        target.as_object_mut().unwrap().remove(key);
                    } else {
                        merge(
                            target
                                .as_object_mut()
                                .unwrap()
                                .entry(key)
                                .or_insert(Value::Null),
                            value,
                        );
                    }
                }
            }
            other => *target = other.clone(),
        }
    }

    fn patched(base: Value, patch: Value) -> Value {
        let mut base = base;
        merge(&mut base, &patch);
        base
    }

    fn without_record(mut pod: Pod) -> Pod {
        if let Some(a) = pod.metadata.annotations.as_mut() {
            a.remove(MIRRORED_KEYS_ANNOTATION);
            a.remove(UPPER_GENERATION_ANNOTATION);
        }
        pod
    }

    #[test]
    fn lowers_pods_like_trim_pod() {
        let required = json!({"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "testbase", "operator": "In", "values": ["aa"]}
        ]}]});
        let selector = r#"{"nodeSelector":{"test": "test"}}"#;
        // (case, change to the upper pod, --ignore-labels, change to the expected lower pod)
        let cases: Vec<(&str, Value, Vec<String>, Value)> = vec![
            ("base", json!({}), vec![], json!({})),
            (
                "clusterSelector restores the node selector and stays",
                json!({"metadata": {"annotations": {"clusterSelector": selector}}}),
                vec![],
                json!({"metadata": {"annotations": {"clusterSelector": selector}},
                       "spec": {"nodeSelector": {"test": "test"}}}),
            ),
            (
                "ignored label is tripped",
                json!({"metadata": {"labels": {"test": "test"}}}),
                vec!["test".into()],
                json!({"metadata": {"annotations": {TRIPPED_LABELS_ANNOTATION: r#"{"test":"test"}"#}}}),
            ),
            (
                "ignored label with an empty value is tripped too",
                json!({"metadata": {"labels": {"test": "", "keep": "x"}}}),
                vec!["test".into()],
                json!({"metadata": {"labels": {"keep": "x"},
                                    "annotations": {TRIPPED_LABELS_ANNOTATION: r#"{"test":""}"#}}}),
            ),
            (
                "ignore list without a match: labels kept, no tripped-labels",
                json!({"metadata": {"labels": {"app": "web"}}}),
                vec!["pod-group.scheduling.sigs.k8s.io".into()],
                json!({"metadata": {"labels": {"app": "web"}}}),
            ),
            (
                "nothing tripped: an upper tripped-labels is left as is",
                json!({"metadata": {"annotations": {TRIPPED_LABELS_ANNOTATION: r#"{"old":"x"}"#}}}),
                vec!["test".into()],
                json!({"metadata": {"annotations": {TRIPPED_LABELS_ANNOTATION: r#"{"old":"x"}"#}}}),
            ),
            (
                "something tripped: an upper tripped-labels is replaced",
                json!({"metadata": {"labels": {"a": "1", "b": "2"},
                                    "annotations": {TRIPPED_LABELS_ANNOTATION: r#"{"old":"x"}"#}}}),
                vec!["b".into(), "a".into()],
                json!({"metadata": {"annotations": {TRIPPED_LABELS_ANNOTATION: r#"{"a":"1","b":"2"}"#}}}),
            ),
            (
                "other tolerations are cleared",
                json!({"spec": {"tolerations": [{"key": "testbase", "operator": "Exists", "effect": "NoExecute"}]}}),
                vec![],
                json!({}),
            ),
            (
                "node selector is cleared",
                json!({"spec": {"nodeSelector": {"testbase": "testbase"}}}),
                vec![],
                json!({}),
            ),
            (
                "node selector and required node affinity are cleared",
                json!({"spec": {"nodeSelector": {"testbase": "testbase"},
                                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}}}),
                vec![],
                json!({}),
            ),
            (
                "fields the lower admission recomputes are cleared",
                json!({"spec": {"priority": 1000, "priorityClassName": "high", "preemptionPolicy": "Never",
                                "overhead": {"cpu": "250m"}, "runtimeClassName": "kata",
                                "ephemeralContainers": [{"name": "debug", "image": "busybox"}]}}),
                vec![],
                json!({"spec": {"priorityClassName": "high", "runtimeClassName": "kata"}}),
            ),
            (
                "the rest of the spec is kept",
                json!({"spec": {"serviceAccountName": "web", "activeDeadlineSeconds": 60,
                                "hostname": "h", "subdomain": "s", "schedulerName": "default-scheduler"}}),
                vec![],
                json!({"spec": {"serviceAccountName": "web", "activeDeadlineSeconds": 60,
                                "hostname": "h", "subdomain": "s", "schedulerName": "default-scheduler"}}),
            ),
            (
                "the upper scale-in order stays upstairs, other annotations go down",
                json!({"metadata": {"annotations": {DELETION_COST_ANNOTATION: "-2", DELETION_COST_MARK: "-2", "note": "x"}}}),
                vec![],
                json!({"metadata": {"annotations": {"note": "x"}}}),
            ),
            (
                "an ignored label cannot remove the ownership marks",
                json!({"metadata": {"labels": {OWNER_NODE_LABEL: "other"}}}),
                vec![OWNER_NODE_LABEL.into(), VIRTUAL_POD_LABEL.into()],
                json!({"metadata": {"annotations": {TRIPPED_LABELS_ANNOTATION: json!({OWNER_NODE_LABEL: "other"}).to_string()}}}),
            ),
        ];
        for (name, upper_change, ignore, lower_change) in cases {
            let upper = pod(patched(upper_json(), upper_change));
            let got = lower_pod(&upper, &translation(&ignore)).unwrap();
            let want = pod(patched(lower_json(), lower_change));
            assert_eq!(without_record(got), want, "{name}");
        }
    }

    #[test]
    fn ephemeral_containers_the_lower_pod_lacks() {
        let debugger =
            json!({"name": "debugger", "image": "busybox", "targetContainerName": "app"});
        let with_token_mount = json!({"name": "shell", "image": "busybox", "volumeMounts": [
            {"name": "default-token-mvzcf", "mountPath": SERVICE_ACCOUNT_MOUNT_PATH},
            {"name": "data", "mountPath": "/data"}]});
        let only_token_mount = json!({"name": "tokens", "image": "busybox", "volumeMounts": [
            {"name": "default-token-mvzcf", "mountPath": SERVICE_ACCOUNT_MOUNT_PATH}]});
        let cases: Vec<(&str, Value, Value, Value)> = vec![
            (
                "none upstream: nothing",
                json!(null),
                json!(null),
                json!([]),
            ),
            (
                "added upstream: added below as written",
                json!([debugger]),
                json!(null),
                json!([debugger]),
            ),
            (
                "already below (by name): nothing, whatever the lower cluster made of it",
                json!([debugger]),
                json!([{"name": "debugger", "image": "mirror.example/busybox"}]),
                json!([]),
            ),
            (
                "only the new one of two",
                json!([debugger, {"name": "second", "image": "alpine"}]),
                json!([debugger]),
                json!([{"name": "second", "image": "alpine"}]),
            ),
            (
                "one added below only: left alone",
                json!(null),
                json!([{"name": "below", "image": "busybox"}]),
                json!([]),
            ),
            (
                "the upper token volume is not mounted below",
                json!([with_token_mount]),
                json!(null),
                json!([{"name": "shell", "image": "busybox",
                        "volumeMounts": [{"name": "data", "mountPath": "/data"}]}]),
            ),
            (
                "a mount of the token volume alone leaves no mount list",
                json!([only_token_mount]),
                json!(null),
                json!([{"name": "tokens", "image": "busybox"}]),
            ),
            (
                "the upper UID, namespace and node are read as literals",
                json!([{"name": "env", "image": "busybox", "env": [
                    {"name": "NS", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}},
                    {"name": "UID", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}}},
                    {"name": "NODE", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "spec.nodeName"}}},
                    {"name": "IP", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}}]}]),
                json!(null),
                json!([{"name": "env", "image": "busybox", "env": [
                    {"name": "NS", "value": "default"},
                    {"name": "UID", "value": "uid-1"},
                    {"name": "NODE", "value": NODE},
                    {"name": "IP", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}}]}]),
            ),
        ];
        for (name, upper_ephemeral, lower_ephemeral, want) in cases {
            let upper = pod(patched(
                upper_json(),
                json!({"spec": {"ephemeralContainers": upper_ephemeral}}),
            ));
            let lower = pod(patched(
                lower_json(),
                json!({"spec": {"ephemeralContainers": lower_ephemeral}}),
            ));
            let want: Vec<EphemeralContainer> = serde_json::from_value(want).unwrap();
            assert_eq!(missing_ephemeral_containers(&upper, &lower), want, "{name}");
        }
    }

    #[test]
    fn ephemeral_containers_patch_carries_the_lower_uid() {
        let added: Vec<EphemeralContainer> =
            serde_json::from_value(json!([{"name": "debugger", "image": "busybox"}])).unwrap();
        assert_eq!(
            ephemeral_containers_patch("lower-uid", &added, "Pod ns/p").unwrap(),
            json!({"metadata": {"uid": "lower-uid"},
                   "spec": {"ephemeralContainers": [{"name": "debugger", "image": "busybox"}]}})
        );
    }

    #[test]
    fn records_the_keys_it_wrote() {
        let upper = pod(patched(
            upper_json(),
            json!({"metadata": {"labels": {"app": "web", "group": "g"}, "annotations": {"note": "x"}}}),
        ));
        let lower = lower_pod(&upper, &translation(&["group".into()])).unwrap();
        let record: MirroredKeys =
            serde_json::from_str(&lower.metadata.annotations.unwrap()[MIRRORED_KEYS_ANNOTATION])
                .unwrap();
        let keys = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
        assert_eq!(
            record.labels,
            keys(&[
                "app",
                OWNER_NODE_LABEL,
                UPPER_CLUSTER_LABEL,
                VIRTUAL_POD_LABEL
            ])
        );
        assert_eq!(
            record.annotations,
            keys(&["note", TRIPPED_LABELS_ANNOTATION, UPPER_UID_ANNOTATION])
        );
    }

    #[test]
    fn refuses_pods_it_cannot_own() {
        let cases = [
            ("metadata.name", json!({"metadata": {"name": null}})),
            (
                "metadata.namespace",
                json!({"metadata": {"namespace": null}}),
            ),
            ("metadata.uid", json!({"metadata": {"uid": null}})),
            ("spec", json!({"spec": null})),
        ];
        for (field, change) in cases {
            let upper = pod(patched(upper_json(), change));
            match lower_pod(&upper, &translation(&[])) {
                Err(TranslateError::MissingField { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    #[test]
    fn malformed_cluster_selector_is_an_error_naming_pod_and_annotation() {
        let upper = pod(patched(
            upper_json(),
            json!({"metadata": {"annotations": {"clusterSelector": "{not json"}}}),
        ));
        let err = lower_pod(&upper, &translation(&[]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("default/testbase") && err.contains("clusterSelector"),
            "{err}"
        );
    }

    /// A pod as admitted by Kubernetes 1.24+: the projected token volume, mounted in every
    /// container.
    fn projected_token_pod() -> Value {
        let token_mount = json!({"name": "kube-api-access-x7k2p", "mountPath": SERVICE_ACCOUNT_MOUNT_PATH, "readOnly": true});
        json!({
            "metadata": {"name": "web", "namespace": "default", "uid": "uid-2"},
            "spec": {
                "serviceAccountName": "web",
                "initContainers": [{"name": "init", "image": "busybox", "volumeMounts": [token_mount]}],
                "containers": [{"name": "app", "image": "nginx", "volumeMounts": [
                    token_mount,
                    {"name": "vault-token", "mountPath": "/var/run/secrets/vault"},
                    {"name": "config", "mountPath": "/etc/app"},
                ]}],
                "volumes": [
                    {"name": "kube-api-access-x7k2p", "projected": {"defaultMode": 420, "sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
                    ]}},
                    {"name": "vault-token", "projected": {"sources": [
                        {"serviceAccountToken": {"audience": "vault", "path": "token"}},
                    ]}},
                    {"name": "config", "configMap": {"name": "app-config"}},
                ],
            },
        })
    }

    #[test]
    fn finds_the_injected_token_volumes() {
        let legacy_mount = |name: &str, path: &str| json!({"name": name, "mountPath": path});
        // (case, spec, volumes to drop)
        let cases: Vec<(&str, Value, Vec<&str>)> = vec![
            (
                "projected token, user's projected token kept",
                projected_token_pod()["spec"].clone(),
                vec!["kube-api-access-x7k2p"],
            ),
            (
                "kube-api-access- name without a token source is the user's",
                json!({"containers": [], "volumes": [{"name": "kube-api-access-mine", "projected": {"sources": [{"configMap": {"name": "c"}}]}}]}),
                vec![],
            ),
            (
                "legacy default-token- secret (tensile-kube)",
                json!({"containers": [], "volumes": [{"name": "default-token-abcde", "secret": {"secretName": "default-token-abcde"}}]}),
                vec!["default-token-abcde"],
            ),
            (
                "legacy <sa>-token- secret at the service-account path",
                json!({"serviceAccountName": "web",
                       "containers": [{"name": "c", "volumeMounts": [legacy_mount("web-token-abcde", SERVICE_ACCOUNT_MOUNT_PATH)]}],
                       "volumes": [{"name": "web-token-abcde", "secret": {"secretName": "web-token-abcde"}}]}),
                vec!["web-token-abcde"],
            ),
            (
                "legacy <sa>-token- secret mounted by an init container only",
                json!({"serviceAccount": "web",
                       "containers": [{"name": "c"}],
                       "initContainers": [{"name": "i", "volumeMounts": [legacy_mount("tok", "/var/run/secrets/kubernetes.io/serviceaccount/")]}],
                       "volumes": [{"name": "tok", "secret": {"secretName": "web-token-abcde"}}]}),
                vec!["tok"],
            ),
            (
                "<sa>-token- secret mounted elsewhere is the user's",
                json!({"serviceAccountName": "web",
                       "containers": [{"name": "c", "volumeMounts": [legacy_mount("web-token-abcde", "/etc/token")]}],
                       "volumes": [{"name": "web-token-abcde", "secret": {"secretName": "web-token-abcde"}}]}),
                vec![],
            ),
            (
                "another account's token secret is the user's",
                json!({"serviceAccountName": "web",
                       "containers": [{"name": "c", "volumeMounts": [legacy_mount("t", SERVICE_ACCOUNT_MOUNT_PATH)]}],
                       "volumes": [{"name": "t", "secret": {"secretName": "other-token-abcde"}}]}),
                vec![],
            ),
        ];
        for (name, spec, want) in cases {
            let spec: PodSpec = serde_json::from_value(spec).unwrap();
            let got: Vec<&str> = injected_token_volumes(&spec).into_iter().collect();
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn drops_the_token_volume_and_its_mounts_only() {
        let lower = lower_pod(&pod(projected_token_pod()), &translation(&[])).unwrap();
        let spec = serde_json::to_value(lower.spec.unwrap()).unwrap();
        assert_eq!(
            spec,
            json!({
                "serviceAccountName": "web",
                "initContainers": [{"name": "init", "image": "busybox"}],
                "containers": [{"name": "app", "image": "nginx", "volumeMounts": [
                    {"name": "vault-token", "mountPath": "/var/run/secrets/vault"},
                    {"name": "config", "mountPath": "/etc/app"},
                ]}],
                "volumes": [
                    {"name": "vault-token", "projected": {"sources": [
                        {"serviceAccountToken": {"audience": "vault", "path": "token"}},
                    ]}},
                    {"name": "config", "configMap": {"name": "app-config"}},
                ],
            })
        );
    }

    /// With `--upper-identity` the token volumes stay, reading the upper tokens from the
    /// pod's token Secret; a legacy upper token Secret is still never mounted below.
    #[test]
    fn keeps_the_token_volumes_under_the_upper_identity() {
        let api: UpperApi = "192.0.2.7:6443".parse().unwrap();
        let mut upper = projected_token_pod();
        upper["spec"]["volumes"].as_array_mut().unwrap().push(
            json!({"name": "default-token-abcde", "secret": {"secretName": "default-token-abcde"}}),
        );
        let t = PodTranslation {
            upper_identity: Some(&api),
            ..translation(&[])
        };
        let lower = lower_pod(&pod(upper.clone()), &t).unwrap();
        let spec = lower.spec.unwrap();
        let volumes: Vec<&str> = spec
            .volumes
            .iter()
            .flatten()
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(volumes, ["kube-api-access-x7k2p", "vault-token", "config"]);
        assert_eq!(spec.automount_service_account_token, Some(false));
        let sources = |name: &str| {
            let volume = spec
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == name)
                .unwrap();
            serde_json::to_value(&volume.projected.as_ref().unwrap().sources).unwrap()
        };
        let secret = format!(
            "{}-upper-token",
            upper["metadata"]["name"].as_str().unwrap()
        );
        assert_eq!(
            sources("vault-token"),
            json!([{"secret": {"name": secret, "items": [{"key": "vault-token.0.token", "path": "token"}]}}])
        );
        assert!(
            sources("kube-api-access-x7k2p")
                .to_string()
                .contains("kube-api-access-x7k2p.0.token"),
            "{}",
            sources("kube-api-access-x7k2p")
        );
        let mounts: Vec<&str> = spec.containers[0]
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| m.name.as_str())
            .collect();
        assert!(mounts.contains(&"kube-api-access-x7k2p"), "{mounts:?}");

        // Off, the translation is today's.
        let off = lower_pod(&pod(upper), &translation(&[])).unwrap();
        assert_eq!(off.spec.unwrap().automount_service_account_token, None);
    }

    #[test]
    fn marks_ownership() {
        let lower = lower_pod(&pod(upper_json()), &translation(&[])).unwrap();
        assert!(is_owned_by(&lower.metadata, &OWNER));
        assert!(!is_owned_by(
            &lower.metadata,
            &Owner::new("other-node", CLUSTER)
        ));
        assert!(!is_owned_by(
            &lower.metadata,
            &Owner::new(NODE, "another-cluster")
        ));
        assert!(!is_owned_by(&ObjectMeta::default(), &OWNER));
        assert_eq!(upper_uid(&lower.metadata), Some("uid-1"));
        assert_eq!(upper_uid(&ObjectMeta::default()), None);
    }

    #[test]
    fn a_pod_recreated_under_the_same_name_gets_the_new_uid() {
        let old = lower_pod(&pod(upper_json()), &translation(&[])).unwrap();
        let recreated = pod(patched(upper_json(), json!({"metadata": {"uid": "uid-2"}})));
        let new = lower_pod(&recreated, &translation(&[])).unwrap();
        assert_eq!(old.metadata.name, new.metadata.name);
        assert_eq!(upper_uid(&old.metadata), Some("uid-1"));
        assert_eq!(upper_uid(&new.metadata), Some("uid-2"));
    }

    fn running_lower() -> Pod {
        pod(json!({
            "metadata": {"name": "testbase", "namespace": "default"},
            "status": {
                "phase": "Running",
                "observedGeneration": 3,
                "nominatedNodeName": "lower-node-2",
                "qosClass": "BestEffort",
                "conditions": [
                    {"type": "PodScheduled", "status": "True", "observedGeneration": 3, "lastTransitionTime": "2024-01-01T00:00:01Z"},
                    {"type": "Ready", "status": "True", "observedGeneration": 3, "lastTransitionTime": "2024-01-01T00:00:05Z"},
                ],
                "containerStatuses": [{"name": "app", "image": "nginx:1", "imageID": "docker.io/nginx@sha256:1",
                    "ready": true, "restartCount": 0, "started": true,
                    "state": {"running": {"startedAt": "2024-01-01T00:00:04Z"}}}],
                "podIP": "10.0.0.5",
                "podIPs": [{"ip": "10.0.0.5"}],
                "hostIP": "192.168.1.10",
                "hostIPs": [{"ip": "192.168.1.10"}],
                "startTime": "2024-01-01T00:00:02Z",
                "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "gpu-claim"}],
            },
        }))
    }

    /// [`running_lower`] at lower generation `generation`, recording upper generation 7,
    /// with `resources` for its container and `annotations` besides.
    fn lower_at(generation: i64, cpu: &str, extra: Value) -> Pod {
        let mut lower = serde_json::to_value(running_lower()).unwrap();
        lower["metadata"]["generation"] = json!(generation);
        lower["metadata"]["uid"] = json!("lower-uid");
        let mut annotations = json!({UPPER_GENERATION_ANNOTATION: "7"});
        if let (Some(a), Some(extra)) = (annotations.as_object_mut(), extra.as_object()) {
            a.extend(extra.clone());
        }
        lower["metadata"]["annotations"] = annotations;
        lower["spec"] = json!({"containers": [{"name": "app", "image": "nginx:1",
            "resources": {"requests": {"cpu": cpu}, "limits": {"cpu": cpu}}}]});
        pod(lower)
    }

    #[test]
    fn the_observed_generation_is_the_upper_one_the_lower_status_answers() {
        let upper = pod(upper_json());
        // running_lower's status and conditions observed lower generation 3.
        // (case, lower generation, status observedGeneration, conditions' observedGeneration)
        let cases = [
            (
                "caught up: the recorded upper generation",
                3,
                Some(7),
                Some(7),
            ),
            ("lagging: none (the upper value stays)", 4, None, None),
        ];
        for (case, generation, status, conditions) in cases {
            let desired = upper_status(&lower_at(generation, "10", json!({})), &upper);
            assert_eq!(desired.observed_generation, status, "{case}");
            for condition in desired.conditions.iter().flatten() {
                assert_eq!(
                    condition.observed_generation, conditions,
                    "{case}: {}",
                    condition.type_
                );
            }
        }
    }

    #[test]
    fn resize_conditions_follow_the_kubelet_below_or_our_own_decision() {
        // The upper pod asks for 10 CPUs; lower copies hold `cpu`.
        let upper = pod(upper_json());
        let pending = serde_json::to_string(&crate::translate::resize::PendingResize {
            reason: "Deferred".into(),
            message: "Node didn't have enough resource: cpu".into(),
            generation: Some(7),
            since: None,
        })
        .unwrap();
        let with_conditions = |mut lower: Pod, conditions: Value| {
            let status = lower.status.as_mut().unwrap();
            let extra: Vec<PodCondition> = serde_json::from_value(conditions).unwrap();
            status.conditions.get_or_insert_default().extend(extra);
            lower
        };
        let types = |status: &PodStatus| -> Vec<(String, Option<String>)> {
            status
                .conditions
                .iter()
                .flatten()
                .filter(|c| c.type_.starts_with("PodResize"))
                .map(|c| (c.type_.clone(), c.reason.clone()))
                .collect()
        };
        let pending_deferred = vec![("PodResizePending".to_owned(), Some("Deferred".to_owned()))];
        let in_progress = vec![("PodResizeInProgress".to_owned(), None)];
        // The lower kubelet reporting container `app` running with `cpu`.
        let running_with = |mut lower: Pod, cpu: &str| {
            let status = lower.status.as_mut().unwrap();
            status.container_statuses.as_mut().unwrap()[0].resources = Some(
                serde_json::from_value(json!({"requests": {"cpu": cpu}, "limits": {"cpu": cpu}}))
                    .unwrap(),
            );
            lower
        };
        // (case, lower, the resize conditions upstairs)
        let cases = [
            ("none", lower_at(3, "10", json!({})), vec![]),
            (
                "ours, while not carried",
                lower_at(3, "5", json!({RESIZE_PENDING_ANNOTATION: pending})),
                pending_deferred.clone(),
            ),
            (
                "ours, once carried: gone",
                lower_at(3, "10", json!({RESIZE_PENDING_ANNOTATION: pending})),
                vec![],
            ),
            (
                "ours, carried (generation 4) while the lower kubelet reports 3 at the old \
                 CPU: in progress",
                running_with(
                    lower_at(4, "10", json!({RESIZE_PENDING_ANNOTATION: pending})),
                    "5",
                ),
                in_progress.clone(),
            ),
            (
                "carried at once, the lower kubelet not caught up: in progress",
                running_with(lower_at(4, "10", json!({})), "5"),
                in_progress.clone(),
            ),
            (
                "the lower kubelet caught up at the new CPU: done",
                running_with(lower_at(3, "10", json!({})), "10"),
                vec![],
            ),
            (
                "the lower kubelet not caught up on another change (an image): none",
                running_with(lower_at(4, "10", json!({})), "10"),
                vec![],
            ),
            (
                "the lower kubelet caught up, still at the old CPU (it reports no resize): \
                 none of ours",
                running_with(lower_at(3, "10", json!({})), "5"),
                vec![],
            ),
            (
                "the lower kubelet's in progress",
                with_conditions(
                    lower_at(3, "10", json!({})),
                    json!([{"type": "PodResizeInProgress", "status": "True", "observedGeneration": 3}]),
                ),
                in_progress.clone(),
            ),
            (
                "the lower kubelet's pending wins over ours",
                with_conditions(
                    lower_at(3, "5", json!({RESIZE_PENDING_ANNOTATION: pending})),
                    json!([{"type": "PodResizePending", "status": "True", "reason": "Infeasible"}]),
                ),
                vec![("PodResizePending".to_owned(), Some("Infeasible".to_owned()))],
            ),
        ];
        for (case, lower, want) in cases {
            let desired = upper_status(&lower, &upper);
            assert_eq!(types(&desired), want, "{case}");
        }

        // A resize condition left upstairs once the lower pod has none is a difference.
        let done = upper_status(&lower_at(3, "10", json!({})), &upper);
        let mut left = done.clone();
        left.conditions.get_or_insert_default().push(
            serde_json::from_value(json!({"type": "PodResizeInProgress", "status": "True"}))
                .unwrap(),
        );
        assert!(status_in_sync(Some(&done), &done));
        assert!(
            !status_in_sync(Some(&left), &done),
            "a finished resize's condition is removed"
        );
    }

    #[test]
    fn pod_level_resources_the_lower_kubelet_reports_are_reflected() {
        let upper = pod(upper_json());
        let mut lower = lower_at(3, "10", json!({}));
        let status = lower.status.as_mut().unwrap();
        status.allocated_resources =
            Some(serde_json::from_value(json!({"cpu": "200m", "memory": "64Mi"})).unwrap());
        status.resources = Some(
            serde_json::from_value(json!({"requests": {"cpu": "200m"}, "limits": {"cpu": "400m"}}))
                .unwrap(),
        );
        let (allocated, resources) = (status.allocated_resources.clone(), status.resources.clone());
        let desired = upper_status(&lower, &upper);
        assert_eq!(desired.allocated_resources, allocated);
        assert_eq!(desired.resources, resources);
        let before = upper_status(&lower_at(3, "10", json!({})), &upper);
        assert!(
            !status_in_sync(Some(&before), &desired),
            "a change of them is written"
        );
    }

    #[test]
    fn an_update_brings_the_upper_generation_down_and_forgets_a_carried_resize() {
        let mut upper = pod(upper_json());
        upper.metadata.generation = Some(8);
        let ignore = [];
        let t = translation(&ignore);
        let annotations =
            |patch: Option<Value>| patch.map(|p| p["metadata"]["annotations"].clone());
        // Generation 7 recorded, resize carried (10 CPUs below), a pending record left.
        let carried = lower_at(3, "10", json!({RESIZE_PENDING_ANNOTATION: "{}"}));
        let mut created = lower_pod(&upper, &t).unwrap();
        created.metadata.uid = Some("lower-uid".into());
        assert_eq!(
            created.metadata.annotations.as_ref().unwrap()[UPPER_GENERATION_ANNOTATION],
            "8",
            "a new copy records the generation it was made from"
        );
        let patch = lower_pod_update(&upper, &carried, &t).unwrap();
        let got = annotations(patch).unwrap();
        assert_eq!(got[UPPER_GENERATION_ANNOTATION], "8");
        assert_eq!(got[RESIZE_PENDING_ANNOTATION], Value::Null);
        // Still not carried: the record stays.
        let pending = lower_at(3, "5", json!({RESIZE_PENDING_ANNOTATION: "{}"}));
        let got = annotations(lower_pod_update(&upper, &pending, &t).unwrap()).unwrap();
        assert!(got.get(RESIZE_PENDING_ANNOTATION).is_none());
        // An upper pod cannot set tensile's own records below.
        let mut forged = pod(upper_json());
        forged.metadata.annotations = Some(
            [
                (RESIZE_PENDING_ANNOTATION.to_owned(), "{}".to_owned()),
                (UPPER_GENERATION_ANNOTATION.to_owned(), "99".to_owned()),
            ]
            .into(),
        );
        let copy = lower_pod(&forged, &t).unwrap();
        let kept = copy.metadata.annotations.unwrap();
        assert_eq!(
            kept.get(UPPER_GENERATION_ANNOTATION).map(String::as_str),
            Some("1")
        );
        assert!(!kept.contains_key(RESIZE_PENDING_ANNOTATION));
    }

    #[test]
    fn upper_status_comes_from_the_lower_pod() {
        let upper = pod(upper_json());
        let status = upper_status(&running_lower(), &upper);
        let want: PodStatus = serde_json::from_value(json!({
            "phase": "Running",
            "qosClass": "Guaranteed",
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2024-01-01T00:00:01Z"},
                {"type": "Ready", "status": "True", "lastTransitionTime": "2024-01-01T00:00:05Z"},
            ],
            "containerStatuses": [{"name": "app", "image": "nginx:1", "imageID": "docker.io/nginx@sha256:1",
                "ready": true, "restartCount": 0, "started": true,
                "state": {"running": {"startedAt": "2024-01-01T00:00:04Z"}}}],
            "podIP": "10.0.0.5",
            "podIPs": [{"ip": "10.0.0.5"}],
            "hostIP": "192.168.1.10",
            "hostIPs": [{"ip": "192.168.1.10"}],
            "startTime": "2024-01-01T00:00:02Z",
        }))
        .unwrap();
        assert_eq!(status, want);
    }

    /// Only the lower kubelet's condition types come up: a lower actor with `pods/status`
    /// writing a readiness gate's condition, `DisruptionTarget` or tensile's mark below
    /// changes nothing above, and Ready is still counted from the upper pod's own gates.
    #[test]
    fn only_the_lower_kubelets_conditions_are_reflected() {
        let condition = |type_: &str, status: &str| json!({"type": type_, "status": status});
        let kubelet = || {
            vec![
                condition("PodReadyToStartContainers", "True"),
                condition("Initialized", "True"),
                condition("ContainersReady", "True"),
                condition("Ready", "True"),
                condition("PodScheduled", "True"),
            ]
        };
        let with = |extra: &[Value]| -> Vec<Value> {
            let mut all = kubelet();
            all.extend_from_slice(extra);
            all
        };
        let gate = json!([{"conditionType": "example.com/lb-ready"}]);
        let upper = |gates: Value, conditions: Value| -> Pod {
            pod(
                json!({"metadata": {"name": "p", "namespace": "ns", "uid": "u"},
                "spec": {"containers": [{"name": "app"}], "readinessGates": gates},
                "status": {"conditions": conditions}}),
            )
        };
        // (case, lower conditions, upper pod, the types and statuses reflected)
        type Case = (
            &'static str,
            Vec<Value>,
            Pod,
            Vec<(&'static str, &'static str)>,
        );
        let cases: Vec<Case> = vec![
            (
                "the kubelet's: all of them, as below",
                kubelet(),
                upper(Value::Null, json!([])),
                vec![
                    ("PodReadyToStartContainers", "True"),
                    ("Initialized", "True"),
                    ("ContainersReady", "True"),
                    ("Ready", "True"),
                    ("PodScheduled", "True"),
                ],
            ),
            (
                "a gate's condition forged below: not copied, the upper gate still False",
                with(&[condition("example.com/lb-ready", "True")]),
                upper(
                    gate.clone(),
                    json!([condition("example.com/lb-ready", "False")]),
                ),
                vec![
                    ("PodReadyToStartContainers", "True"),
                    ("Initialized", "True"),
                    ("ContainersReady", "True"),
                    ("Ready", "False"),
                    ("PodScheduled", "True"),
                ],
            ),
            (
                "a gate's condition forged False below: the upper gate's True counts",
                with(&[condition("example.com/lb-ready", "False")]),
                upper(
                    gate.clone(),
                    json!([condition("example.com/lb-ready", "True")]),
                ),
                vec![
                    ("PodReadyToStartContainers", "True"),
                    ("Initialized", "True"),
                    ("ContainersReady", "True"),
                    ("Ready", "True"),
                    ("PodScheduled", "True"),
                ],
            ),
            (
                "DisruptionTarget, tensile's mark and others below: not copied",
                with(&[
                    condition("DisruptionTarget", "True"),
                    condition(MIRRORED_CONDITION, "False"),
                    condition("example.com/other", "True"),
                ]),
                upper(
                    Value::Null,
                    json!([condition("example.com/other", "False")]),
                ),
                vec![
                    ("PodReadyToStartContainers", "True"),
                    ("Initialized", "True"),
                    ("ContainersReady", "True"),
                    ("Ready", "True"),
                    ("PodScheduled", "True"),
                ],
            ),
        ];
        for (name, conditions, upper, want) in cases {
            let lower = pod(json!({"status": {"phase": "Running", "conditions": conditions}}));
            let status = upper_status(&lower, &upper);
            let got: Vec<(&str, &str)> = status
                .conditions
                .iter()
                .flatten()
                .map(|c| (c.type_.as_str(), c.status.as_str()))
                .collect();
            assert_eq!(got, want, "{name}");
            // Written, the upper pod's own conditions stay as they were.
            let patch = upper_status_patch("u", &status);
            let written: Vec<&str> = patch["status"]["conditions"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|c| c["type"].as_str())
                .collect();
            assert!(
                written
                    .iter()
                    .all(|t| is_reflected(t) || *t == MIRRORED_CONDITION),
                "{name}: {written:?}"
            );
        }
    }

    /// Ready as a kubelet computes it for a pod with readiness gates: the lower pod's
    /// containers ready, and every gate's condition True on the upper pod (the lower pod
    /// never has the gates: nobody sets their conditions below).
    #[test]
    fn ready_counts_the_upper_pods_readiness_gates() {
        let gates = json!([{"conditionType": "example.com/a"}, {"conditionType": "example.com/b"}]);
        let lower = |containers_ready: &str, ready: &str| -> Pod {
            pod(json!({"status": {"phase": "Running", "conditions": [
                {"type": "ContainersReady", "status": containers_ready,
                 "reason": if containers_ready == "True" { Value::Null } else { json!("ContainersNotReady") },
                 "message": if containers_ready == "True" { Value::Null } else { json!("containers with unready status: [app]") },
                 "lastTransitionTime": "2024-01-01T00:00:05Z"},
                {"type": "Ready", "status": ready,
                 "reason": if ready == "True" { Value::Null } else { json!("ContainersNotReady") },
                 "message": if ready == "True" { Value::Null } else { json!("containers with unready status: [app]") },
                 "lastTransitionTime": "2024-01-01T00:00:05Z"},
            ]}}))
        };
        let upper = |gates: Value, conditions: Value| -> Pod {
            pod(
                json!({"metadata": {"name": "p", "namespace": "ns", "uid": "u"},
                "spec": {"containers": [{"name": "app"}], "readinessGates": gates},
                "status": {"conditions": conditions}}),
            )
        };
        let a = |status: &str| json!({"type": "example.com/a", "status": status, "lastTransitionTime": "2024-01-01T00:00:07Z"});
        let b = |status: &str| json!({"type": "example.com/b", "status": status, "lastTransitionTime": "2024-01-01T00:00:09Z"});
        let ready = |status: &str, reason: Value, message: Value, at: &str| -> PodCondition {
            serde_json::from_value(json!({"type": "Ready", "status": status, "reason": reason,
                "message": message, "lastTransitionTime": at}))
            .unwrap()
        };
        let not_ready = |message: &str| {
            ready(
                "False",
                json!("ReadinessGatesNotReady"),
                json!(message),
                "2024-01-01T00:00:09Z",
            )
        };
        // (case, lower pod, upper pod, the upper Ready condition wanted)
        let cases: Vec<(&str, Pod, Pod, PodCondition)> = vec![
            (
                "no gates: the lower Ready as it is",
                lower("True", "True"),
                upper(Value::Null, json!([])),
                ready("True", Value::Null, Value::Null, "2024-01-01T00:00:05Z"),
            ),
            (
                "gates without conditions yet",
                lower("True", "True"),
                upper(gates.clone(), json!([])),
                ready(
                    "False",
                    json!("ReadinessGatesNotReady"),
                    json!(
                        "corresponding condition of pod readiness gate \"example.com/a\" does not exist., \
                     corresponding condition of pod readiness gate \"example.com/b\" does not exist."
                    ),
                    "2024-01-01T00:00:05Z",
                ),
            ),
            (
                "one gate True, the other False",
                lower("True", "True"),
                upper(gates.clone(), json!([a("True"), b("False")])),
                not_ready(
                    "the status of pod readiness gate \"example.com/b\" is not \"True\", but False",
                ),
            ),
            (
                "both gates True: Ready since the last of them",
                lower("True", "True"),
                upper(gates.clone(), json!([a("True"), b("True")])),
                ready("True", Value::Null, Value::Null, "2024-01-01T00:00:09Z"),
            ),
            (
                "a gate back to False",
                lower("True", "True"),
                upper(gates.clone(), json!([a("False"), b("True")])),
                not_ready(
                    "the status of pod readiness gate \"example.com/a\" is not \"True\", but False",
                ),
            ),
            (
                "both gates True, containers not ready: the containers' reason",
                lower("False", "False"),
                upper(gates.clone(), json!([a("True"), b("True")])),
                ready(
                    "False",
                    json!("ContainersNotReady"),
                    json!("containers with unready status: [app]"),
                    "2024-01-01T00:00:05Z",
                ),
            ),
            (
                "gates kept below by an older copy: the lower Ready waits for them, ContainersReady counts",
                lower("True", "False"),
                upper(gates.clone(), json!([a("True"), b("True")])),
                ready("True", Value::Null, Value::Null, "2024-01-01T00:00:09Z"),
            ),
        ];
        for (name, lower, upper, want) in cases {
            let status = upper_status(&lower, &upper);
            let got: Vec<&PodCondition> = status
                .conditions
                .iter()
                .flatten()
                .filter(|c| c.type_ == "Ready")
                .collect();
            assert_eq!(got, [&want], "{name}");
            let containers_ready = status
                .conditions
                .iter()
                .flatten()
                .find(|c| c.type_ == "ContainersReady");
            assert_eq!(
                containers_ready,
                lower
                    .status
                    .as_ref()
                    .unwrap()
                    .conditions
                    .as_ref()
                    .unwrap()
                    .first(),
                "{name}: ContainersReady as below"
            );
            assert!(
                !status
                    .conditions
                    .iter()
                    .flatten()
                    .any(|c| c.type_.starts_with("example.com")),
                "{name}: the gates' own conditions are the upper actor's, never written"
            );
        }

        // The lower pod never waits for gates nobody sets below.
        let gated = serde_json::to_value(upper(gates.clone(), json!([]))).unwrap();
        let gated = pod(patched(gated, json!({"spec": {"nodeName": NODE}})));
        let lowered = lower_pod(&gated, &translation(&[])).unwrap();
        assert_eq!(lowered.spec.unwrap().readiness_gates, None);
    }

    /// What a deleted pod shows last, once its lower copy is gone.
    #[test]
    fn a_terminated_pod_shows_every_container_terminated() {
        let container = |state: Value| {
            json!({"name": "app", "image": "busybox", "imageID": "", "ready": true,
                   "restartCount": 0, "started": true, "state": state})
        };
        let running = json!({"running": {"startedAt": "2024-01-01T00:00:04Z"}});
        let exited = |code: i32| {
            json!({"terminated": {"exitCode": code, "reason": "Completed",
                   "startedAt": "2024-01-01T00:00:04Z", "finishedAt": "2024-01-01T00:00:09Z"}})
        };
        let status = |phase: &str, ready: &str, state: Value| -> PodStatus {
            serde_json::from_value(json!({"phase": phase, "conditions": [
                {"type": "Ready", "status": ready},
                {"type": "ContainersReady", "status": ready},
                {"type": "PodScheduled", "status": "True"},
            ], "containerStatuses": [container(state)], "podIP": "10.0.0.5"}))
            .unwrap()
        };
        // (case, the last status from below, the phase, the container's exit code and
        // reason)
        let cases = [
            (
                "written terminal below: kept",
                status("Succeeded", "False", exited(0)),
                "Succeeded",
                0,
                "Completed",
            ),
            (
                "exited 0, phase not yet written",
                status("Running", "False", exited(0)),
                "Succeeded",
                0,
                "Completed",
            ),
            (
                "exited 143",
                status("Running", "False", exited(143)),
                "Failed",
                143,
                "Completed",
            ),
            (
                "never ran: no container reported",
                serde_json::from_value(json!({"phase": "Pending", "conditions": [
                    {"type": "Ready", "status": "False"},
                    {"type": "ContainersReady", "status": "False"},
                    {"type": "PodScheduled", "status": "True"},
                ], "podIP": "10.0.0.5"}))
                .unwrap(),
                "Failed",
                -1,
                "",
            ),
            (
                "still running when the copy went",
                status("Running", "True", running.clone()),
                "Failed",
                137,
                "ContainerStatusUnknown",
            ),
        ];
        for (name, last, phase, code, reason) in cases {
            let done = terminated_status(last.clone());
            assert_eq!(done.phase.as_deref(), Some(phase), "{name}");
            if let Some(c) = done.container_statuses.as_ref().and_then(|c| c.first()) {
                let terminated = c.state.as_ref().unwrap().terminated.as_ref().unwrap();
                assert_eq!(
                    (terminated.exit_code, terminated.reason.as_deref(), c.ready),
                    (code, Some(reason), false),
                    "{name}"
                );
            } else {
                assert_eq!(code, -1, "{name}: no container status");
            }
            let condition = |t: &str| {
                done.conditions
                    .iter()
                    .flatten()
                    .find(|c| c.type_ == t)
                    .map(|c| c.status.clone())
            };
            assert_eq!(condition("Ready").as_deref(), Some("False"), "{name}");
            assert_eq!(
                condition("ContainersReady").as_deref(),
                Some("False"),
                "{name}"
            );
            assert_eq!(condition("PodScheduled").as_deref(), Some("True"), "{name}");
            assert_eq!(done.pod_ip, last.pod_ip, "{name}: the rest as it was");
        }
        let started = status("Running", "True", running);
        let done = terminated_status(started);
        let terminated = done.container_statuses.unwrap()[0].state.clone().unwrap();
        assert_eq!(
            terminated.terminated.unwrap().started_at,
            serde_json::from_value(json!("2024-01-01T00:00:04Z")).unwrap(),
            "when it started is kept"
        );
    }

    #[test]
    fn status_in_sync_compares_only_what_is_reflected() {
        let upper = pod(upper_json());
        let desired = upper_status(&running_lower(), &upper);
        let with = |change: Value| -> PodStatus {
            serde_json::from_value(patched(serde_json::to_value(&desired).unwrap(), change))
                .unwrap()
        };
        // (case, current upper status, in sync)
        let cases: Vec<(&str, Option<PodStatus>, bool)> = vec![
            ("no status yet", None, false),
            ("the old upper status", upper.status.clone(), false),
            ("just written", Some(desired.clone()), true),
            (
                "upstream extras are not compared",
                Some(with(
                    json!({"nominatedNodeName": "vk-node", "resize": "Proposed"}),
                )),
                true,
            ),
            (
                "the observed generation differs",
                Some(with(json!({"observedGeneration": 7}))),
                false,
            ),
            (
                "observedGeneration on conditions is not compared",
                Some(with(json!({"conditions": [
                    {"type": "PodScheduled", "status": "True", "observedGeneration": 1, "lastTransitionTime": "2024-01-01T00:00:01Z"},
                    {"type": "Ready", "status": "True", "observedGeneration": 1, "lastTransitionTime": "2024-01-01T00:00:05Z"},
                ]}))),
                true,
            ),
            (
                "phase differs",
                Some(with(json!({"phase": "Pending"}))),
                false,
            ),
            (
                "pod IP differs",
                Some(with(
                    json!({"podIP": "10.0.0.6", "podIPs": [{"ip": "10.0.0.6"}]}),
                )),
                false,
            ),
            (
                "container became unready",
                Some(with(
                    json!({"containerStatuses": [{"name": "app", "image": "nginx:1", "imageID": "docker.io/nginx@sha256:1",
                    "ready": false, "restartCount": 0, "started": true,
                    "state": {"running": {"startedAt": "2024-01-01T00:00:04Z"}}}]}),
                )),
                false,
            ),
        ];
        for (name, current, want) in cases {
            assert_eq!(status_in_sync(current.as_ref(), &desired), want, "{name}");
        }

        let empty_lists = PodStatus {
            phase: Some("Pending".into()),
            conditions: Some(vec![]),
            container_statuses: Some(vec![]),
            pod_ips: Some(vec![]),
            ..PodStatus::default()
        };
        let absent_lists = PodStatus {
            phase: Some("Pending".into()),
            ..PodStatus::default()
        };
        assert!(status_in_sync(Some(&empty_lists), &absent_lists));
        assert!(status_in_sync(Some(&absent_lists), &empty_lists));
    }

    #[test]
    fn a_status_summary_answers_what_the_pod_controller_asks() {
        let running = pod(upper_json()).status.unwrap();
        let statuses = [
            ("none", PodStatus::default()),
            ("the upper fixture", running.clone()),
            (
                "written from below",
                upper_status(&running_lower(), &pod(upper_json())),
            ),
            (
                "pending with a reason",
                serde_json::from_value(json!({"phase": "Pending", "reason": "R", "message": "M",
                    "qosClass": "BestEffort"}))
                .unwrap(),
            ),
            (
                "only tensile's mark",
                serde_json::from_value(json!({"phase": "Pending",
                    "conditions": [{"type": MIRRORED_CONDITION, "status": "True"}]}))
                .unwrap(),
            ),
            (
                "only a container status",
                serde_json::from_value(json!({"containerStatuses": [{"name": "app",
                    "image": "i", "imageID": "", "ready": false, "restartCount": 0}]}))
                .unwrap(),
            ),
        ];
        let with = |status: PodStatus| Pod {
            status: Some(status),
            ..Pod::default()
        };
        for (name, status) in statuses {
            let summary = status_summary(&status, &[]);
            assert_eq!(summary.phase, status.phase, "{name}");
            assert_eq!(summary.reason, status.reason, "{name}");
            assert_eq!(summary.message, status.message, "{name}");
            assert_eq!(summary.qos_class, status.qos_class, "{name}");
            assert_eq!(
                was_mirrored(&with(summary)),
                was_mirrored(&with(status.clone())),
                "{name}"
            );
            assert!(
                digest_in_sync(&status_digest(Some(&status)), &status),
                "{name}: a status is in sync with itself"
            );
        }
    }

    #[test]
    fn a_digest_reads_back_what_it_wrote_in_the_bytes_it_said() {
        let condition = |kind: &str| json!({"type": kind, "status": "True"});
        let cases = [
            json!(null),
            json!({"phase": "Running"}),
            json!({"phase": "Running", "conditions": [condition("Ready")]}),
            json!({"phase": "Running", "podIP": "10.0.0.1", "conditions": [
                condition("tensile.dev/Mirrored"), condition("PodReadyToStartContainers"),
                condition("Initialized"), condition("Ready"), condition("ContainersReady"),
                condition("PodScheduled")]}),
        ];
        for status in cases {
            let status: Option<PodStatus> = serde_json::from_value(status.clone()).unwrap();
            let digest = status_digest(status.as_ref());
            let mut bytes = Vec::new();
            digest.write_to(&mut bytes);
            assert_eq!(bytes.len(), digest.encoded_len(), "{status:?}");
            bytes.extend_from_slice(b"rest");
            let (read, rest) = StatusDigest::read_from(&bytes).unwrap();
            assert_eq!((read, rest), (digest, &b"rest"[..]), "{status:?}");
        }
    }

    #[test]
    fn status_in_sync_ignores_conditions_the_lower_pod_does_not_report() {
        let desired = upper_status(&running_lower(), &pod(upper_json()));
        let conditions = |list: Value| -> PodStatus {
            let mut status = serde_json::to_value(&desired).unwrap();
            status["conditions"] = list;
            serde_json::from_value(status).unwrap()
        };
        let scheduled = json!({"type": "PodScheduled", "status": "True", "lastTransitionTime": "2024-01-01T00:00:01Z"});
        let ready = json!({"type": "Ready", "status": "True", "lastTransitionTime": "2024-01-01T00:00:05Z"});
        let gate = json!({"type": "example.com/lb-ready", "status": "True"});
        let mark = json!({"type": MIRRORED_CONDITION, "status": "True"});
        // (case, the upper pod's conditions, in sync)
        let cases = [
            (
                "another actor's readiness gate and tensile's mark",
                json!([gate, scheduled, ready, mark]),
                true,
            ),
            (
                "in another order (a merge by type keeps the upper order)",
                json!([ready, scheduled]),
                true,
            ),
            ("a reported condition missing", json!([gate, ready]), false),
            (
                "a reported condition differs",
                json!([scheduled, {"type": "Ready", "status": "False"}]),
                false,
            ),
        ];
        for (name, list, want) in cases {
            assert_eq!(
                status_in_sync(Some(&conditions(list)), &desired),
                want,
                "{name}"
            );
        }
    }

    #[test]
    fn the_upper_status_patch_carries_the_uid_and_the_mark_and_keeps_others_conditions() {
        let status: PodStatus = serde_json::from_value(json!({
            "phase": "Running",
            "podIP": "10.1.1.1",
            "podIPs": [{"ip": "10.1.1.1"}],
            "conditions": [
                {"type": "Ready", "status": "True"},
                {"type": MIRRORED_CONDITION, "status": "True"},
            ],
        }))
        .unwrap();
        let want = json!({
            "metadata": {"uid": "uid-1"},
            "status": {
                "phase": "Running",
                "podIP": "10.1.1.1",
                // Replaced whole: merged by IP, an old address would stay.
                "podIPs": [{"ip": "10.1.1.1"}, {"$patch": "replace"}],
                // Merged by type: no null, no list that drops another actor's condition;
                // the mark once; within a condition, what it lacks cleared (an observed
                // generation not known yet left as it was); the kubelet's resize
                // conditions the status lacks removed.
                "conditions": [
                    {"type": "Ready", "status": "True", "reason": null, "message": null,
                     "lastProbeTime": null, "lastTransitionTime": null},
                    {"type": MIRRORED_CONDITION, "status": "True", "reason": null, "message": null,
                     "lastProbeTime": null, "lastTransitionTime": null},
                    {"type": "PodResizePending", "$patch": "delete"},
                    {"type": "PodResizeInProgress", "$patch": "delete"},
                ],
                "containerStatuses": null,
                "initContainerStatuses": null,
                "ephemeralContainerStatuses": null,
                "allocatedResources": null,
                "resources": null,
                "hostIP": null,
                "hostIPs": null,
                "startTime": null,
                "reason": null,
                "message": null,
                "nominatedNodeName": null,
            },
        });
        assert_eq!(upper_status_patch("uid-1", &status), want);

        let bare = upper_status_patch("uid-2", &PodStatus::default());
        assert_eq!(bare["metadata"], json!({"uid": "uid-2"}));
        assert_eq!(
            bare["status"]["conditions"][0]["type"], MIRRORED_CONDITION,
            "never a null that would drop every condition"
        );
        assert_eq!(bare["status"]["podIPs"], Value::Null);
        assert!(
            bare["status"].get("qosClass").is_none(),
            "immutable: never sent"
        );

        assert_eq!(
            pending_reason_patch("uid-3", "MissingDependency", "secret s not found"),
            json!({"metadata": {"uid": "uid-3"},
                   "status": {"phase": "Pending", "reason": "MissingDependency", "message": "secret s not found"}})
        );
        assert_eq!(
            with_uid_precondition(json!({"metadata": {"labels": {"a": "b"}}, "spec": {}}), "u"),
            json!({"metadata": {"labels": {"a": "b"}, "uid": "u"}, "spec": {}})
        );
    }

    #[test]
    fn was_mirrored_by_record_or_by_what_only_a_lower_status_sets() {
        let status = |v: Value| pod(patched(upper_json(), json!({"status": v})));
        let cases = [
            (
                "no status",
                pod(patched(upper_json(), json!({"status": null}))),
                false,
            ),
            ("just bound", status(json!({"phase": "Pending"})), false),
            (
                "upper scheduler's condition",
                status(json!({"conditions": [{"type": "PodScheduled", "status": "True"}]})),
                false,
            ),
            (
                "another actor's readiness gate only",
                status(
                    json!({"conditions": [{"type": "example.com/lb-ready", "status": "False"}]}),
                ),
                false,
            ),
            (
                "our pending reason only",
                status(json!({"phase": "Pending", "reason": "MissingDependency"})),
                false,
            ),
            (
                "the record",
                status(json!({"conditions": [{"type": MIRRORED_CONDITION, "status": "True"}]})),
                true,
            ),
            (
                "reflected by an older version: start time",
                status(json!({"phase": "Running", "startTime": "2024-01-01T00:00:02Z"})),
                true,
            ),
            (
                "reflected by an older version: container statuses",
                status(
                    json!({"containerStatuses": [{"name": "app", "image": "nginx:1", "imageID": "", "ready": false, "restartCount": 0}]}),
                ),
                true,
            ),
        ];
        for (name, upper, want) in cases {
            assert_eq!(was_mirrored(&upper), want, "{name}");
        }
    }

    #[test]
    fn a_copy_is_recognised_by_its_uid_mark_alone() {
        let upper = pod(upper_json());
        let mut lower = lower_pod(&upper, &translation(&[])).unwrap();
        assert!(is_copy_of(&lower.metadata, &upper.metadata));
        lower.metadata.labels = None;
        assert!(
            is_copy_of(&lower.metadata, &upper.metadata),
            "owner label edited away"
        );
        let recreated = pod(patched(upper_json(), json!({"metadata": {"uid": "uid-2"}})));
        assert!(!is_copy_of(&lower.metadata, &recreated.metadata));
        assert!(!is_copy_of(&ObjectMeta::default(), &ObjectMeta::default()));
    }

    /// [`lower_pod`] of `upper` as the lower API server returns it: defaults, the lower
    /// cluster's own token mount and tolerations, and annotations from its CNI.
    fn lower_as_stored(upper: &Pod) -> Pod {
        let created = serde_json::to_value(lower_pod(upper, &translation(&[])).unwrap()).unwrap();
        let mut stored = patched(
            created,
            json!({
                "metadata": {"uid": "lower-uid", "resourceVersion": "7",
                             "annotations": {"cni.projectcalico.org/podIP": "10.0.0.5/32"},
                             "labels": {"lower.example.com/injected": "yes"}},
                "status": {"phase": "Running"},
            }),
        );
        let spec = &mut stored["spec"];
        spec["containers"][0]["volumeMounts"] = json!([{"name": "kube-api-access-lower", "mountPath": SERVICE_ACCOUNT_MOUNT_PATH, "readOnly": true}]);
        spec["containers"][0]["terminationMessagePath"] = json!("/dev/termination-log");
        let mut tolerations = spec["tolerations"].as_array().cloned().unwrap_or_default();
        tolerations.push(json!({"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}));
        spec["tolerations"] = Value::Array(tolerations);
        pod(stored)
    }

    /// An upper pod with a stash, init container and labels to update.
    fn updatable_upper() -> Value {
        patched(
            upper_json(),
            json!({
                "metadata": {
                    "labels": {"app": "web", "track": "canary"},
                    "annotations": {"note": "x", CLUSTER_SELECTOR: json!({"tolerations": [{"key": "gpu", "operator": "Exists"}]}).to_string()},
                },
                "spec": {"initContainers": [{"name": "init", "image": "busybox:1"}]},
            }),
        )
    }

    const CLUSTER_SELECTOR: &str = crate::translate::meta::CLUSTER_SELECTOR_ANNOTATION;

    #[test]
    fn lower_pod_update_follows_allowed_changes() {
        let stored = lower_as_stored(&pod(updatable_upper()));
        let stored_json = serde_json::to_value(&stored).unwrap();
        let record_after = |change: Value| record_of(&pod(patched(updatable_upper(), change)));
        let record_without_track = record_after(json!({"metadata": {"labels": {"track": null}}}));
        let stash_with = |tolerations: Value| json!({"tolerations": tolerations}).to_string();
        let gpu = json!({"key": "gpu", "operator": "Exists"});
        let tpu = json!({"key": "tpu", "operator": "Exists"});
        let not_ready = stored_json["spec"]["tolerations"][1].clone();

        // (case, change to the upper pod, expected patch)
        let cases: Vec<(&str, Value, Option<Value>)> = vec![
            ("in sync", json!({}), None),
            (
                "image change sends {name, image} of that container (strategic merge by name), and records it",
                json!({"spec": {"containers": [{"name": "app", "image": "nginx:2"}]}}),
                Some(json!({
                    "metadata": {"annotations": {MIRRORED_KEYS_ANNOTATION: record_after(
                        json!({"spec": {"containers": [{"name": "app", "image": "nginx:2"}]}}))}},
                    "spec": {"containers": [{"name": "app", "image": "nginx:2"}]},
                })),
            ),
            (
                "init container image change",
                json!({"spec": {"initContainers": [{"name": "init", "image": "busybox:2"}]}}),
                Some(json!({
                    "metadata": {"annotations": {MIRRORED_KEYS_ANNOTATION: record_after(
                        json!({"spec": {"initContainers": [{"name": "init", "image": "busybox:2"}]}}))}},
                    "spec": {"initContainers": [{"name": "init", "image": "busybox:2"}]},
                })),
            ),
            (
                "removed label is removed below, the lower cluster's own label stays",
                json!({"metadata": {"labels": {"track": null}}}),
                Some(json!({"metadata": {"labels": {"track": null},
                                         "annotations": {MIRRORED_KEYS_ANNOTATION: record_without_track}}})),
            ),
            (
                "changed label",
                json!({"metadata": {"labels": {"track": "stable"}}}),
                Some(json!({"metadata": {"labels": {"track": "stable"}}})),
            ),
            (
                "activeDeadlineSeconds set",
                json!({"spec": {"activeDeadlineSeconds": 30}}),
                Some(json!({"spec": {"activeDeadlineSeconds": 30}})),
            ),
            (
                "toleration removal cannot be sent, only the annotation follows",
                json!({"metadata": {"annotations": {CLUSTER_SELECTOR: stash_with(json!([]))}}}),
                Some(
                    json!({"metadata": {"annotations": {CLUSTER_SELECTOR: stash_with(json!([]))}}}),
                ),
            ),
            (
                "toleration addition is sent on top of the lower list",
                json!({"metadata": {"annotations": {CLUSTER_SELECTOR: stash_with(json!([gpu, tpu]))}}}),
                Some(json!({
                    "metadata": {"annotations": {CLUSTER_SELECTOR: stash_with(json!([gpu, tpu]))}},
                    "spec": {"tolerations": [gpu, not_ready, tpu]},
                })),
            ),
        ];
        for (name, change, want) in cases {
            let upper = pod(patched(updatable_upper(), change));
            let got = lower_pod_update(&upper, &stored, &translation(&[])).unwrap();
            assert_eq!(got, want, "{name}");
            if let Some(patch) = got {
                // Applying the patch brings the lower pod in sync, except for what the API
                // forbids changing.
                let after = pod(patched(stored_json.clone(), patch));
                let again = lower_pod_update(&upper, &after, &translation(&[])).unwrap();
                assert_eq!(again, None, "{name}: after applying");
            }
        }
    }

    /// The record [`lower_pod`] writes for `upper`.
    fn record_of(upper: &Pod) -> String {
        lower_pod(upper, &translation(&[]))
            .unwrap()
            .metadata
            .annotations
            .unwrap()[MIRRORED_KEYS_ANNOTATION]
            .clone()
    }

    #[test]
    fn lower_pod_update_leaves_alone_an_image_the_lower_admission_rewrote() {
        let upper_at = |image: &str| {
            pod(patched(
                updatable_upper(),
                json!({"spec": {"containers": [{"name": "app", "image": image}]}}),
            ))
        };
        // The record as a version that did not record images wrote it.
        let record_without_images = |upper: &Pod| {
            let mut record: Value = serde_json::from_str(&record_of(upper)).unwrap();
            record.as_object_mut().unwrap().remove("images");
            record.to_string()
        };
        // A lower pod created for `created_for`, whose `app` image now reads `live`, with
        // `record` as its record.
        let lower = |created_for: &Pod, live: &str, record: String| {
            let mut stored = serde_json::to_value(lower_as_stored(created_for)).unwrap();
            stored["spec"]["containers"][0]["image"] = json!(live);
            stored["metadata"]["annotations"][MIRRORED_KEYS_ANNOTATION] = json!(record);
            pod(stored)
        };
        let (v1, v2) = (upper_at("nginx:1"), upper_at("nginx:2"));
        let mirror = "mirror.local/library/nginx:1";
        // (case, upper pod, lower pod, expected patch)
        let cases: Vec<(&str, &Pod, Pod, Option<Value>)> = vec![
            (
                "rewritten below, unchanged upstream: left alone",
                &v1,
                lower(&v1, mirror, record_of(&v1)),
                None,
            ),
            (
                "rewritten below, changed upstream: the new image, recorded",
                &v2,
                lower(&v1, mirror, record_of(&v1)),
                Some(json!({
                    "metadata": {"annotations": {MIRRORED_KEYS_ANNOTATION: record_of(&v2)}},
                    "spec": {"containers": [{"name": "app", "image": "nginx:2"}]},
                })),
            ),
            (
                "record without images, in step: no write (a restart writes nothing)",
                &v1,
                lower(&v1, "nginx:1", record_without_images(&v1)),
                None,
            ),
            (
                "record without images, rewritten below: the live image is all there is to go by, once",
                &v1,
                lower(&v1, mirror, record_without_images(&v1)),
                Some(json!({
                    "metadata": {"annotations": {MIRRORED_KEYS_ANNOTATION: record_of(&v1)}},
                    "spec": {"containers": [{"name": "app", "image": "nginx:1"}]},
                })),
            ),
            (
                "recorded images stale (the upper pod changed back): the record follows",
                &v1,
                lower(&v1, "nginx:1", record_of(&v2)),
                Some(json!({
                    "spec": {"containers": [{"name": "app", "image": "nginx:1"}]},
                    "metadata": {"annotations": {MIRRORED_KEYS_ANNOTATION: record_of(&v1)}},
                })),
            ),
        ];
        for (name, upper, lower, want) in cases {
            let got = lower_pod_update(upper, &lower, &translation(&[])).unwrap();
            assert_eq!(got, want, "{name}");
            if let Some(patch) = got {
                // Applied, then rewritten again by the webhook: nothing more to do.
                let mut after = patched(serde_json::to_value(&lower).unwrap(), patch);
                after["spec"]["containers"][0]["image"] = json!(mirror);
                let again = lower_pod_update(upper, &pod(after), &translation(&[])).unwrap();
                assert_eq!(again, None, "{name}: after applying");
            }
        }
    }

    #[test]
    fn lower_pod_update_without_a_record_removes_nothing() {
        let upper = pod(updatable_upper());
        let mut stored = lower_as_stored(&upper);
        stored
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .remove(MIRRORED_KEYS_ANNOTATION);
        stored
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("stale".into(), "x".into());
        let patch = lower_pod_update(&upper, &stored, &translation(&[]))
            .unwrap()
            .unwrap();
        let record = lower_pod(&upper, &translation(&[]))
            .unwrap()
            .metadata
            .annotations
            .unwrap()[MIRRORED_KEYS_ANNOTATION]
            .clone();
        assert_eq!(
            patch,
            json!({"metadata": {"annotations": {MIRRORED_KEYS_ANNOTATION: record}}})
        );
    }

    #[test]
    fn lower_pod_update_keeps_tripped_labels_out() {
        let ignore = vec!["group".to_owned()];
        let upper = pod(patched(
            updatable_upper(),
            json!({"metadata": {"labels": {"group": "g1"}}}),
        ));
        let stored = lower_pod(&upper, &translation(&ignore)).unwrap();
        assert_eq!(
            lower_pod_update(&upper, &stored, &translation(&ignore)).unwrap(),
            None
        );

        let regrouped = pod(patched(
            updatable_upper(),
            json!({"metadata": {"labels": {"group": "g2"}}}),
        ));
        let patch = lower_pod_update(&regrouped, &stored, &translation(&ignore))
            .unwrap()
            .unwrap();
        assert_eq!(
            patch,
            json!({"metadata": {"annotations": {TRIPPED_LABELS_ANNOTATION: r#"{"group":"g2"}"#}}})
        );
    }

    #[test]
    fn lower_gone_status_ends_the_pod() {
        let upper = pod(patched(
            upper_json(),
            json!({
                "spec": {"containers": [{"name": "app", "image": "nginx:1"}, {"name": "sidecar", "image": "envoy:1"}],
                         "initContainers": [{"name": "init", "image": "busybox"}]},
                "status": {
                    "phase": "Running",
                    "podIP": "10.0.0.5",
                    "conditions": [
                        {"type": "PodScheduled", "status": "True"},
                        {"type": "Ready", "status": "True"},
                        {"type": "ContainersReady", "status": "True"},
                    ],
                    "initContainerStatuses": [{"name": "init", "image": "busybox", "imageID": "", "ready": false, "restartCount": 0,
                        "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}],
                    "containerStatuses": [{"name": "app", "image": "nginx:1", "imageID": "id", "ready": true, "restartCount": 2,
                        "containerID": "containerd://abc", "state": {"running": {"startedAt": "2024-01-01T00:00:04Z"}}}],
                },
            }),
        ));
        let status = lower_gone_status(&upper, "NotFound", "the lower pod is gone");
        let want: PodStatus = serde_json::from_value(json!({
            "phase": "Failed",
            "reason": "NotFound",
            "message": "the lower pod is gone",
            "qosClass": "Guaranteed",
            "podIP": "10.0.0.5",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "ContainersReady", "status": "False", "reason": "NotFound", "message": "the lower pod is gone"},
                {"type": "Ready", "status": "False", "reason": "NotFound", "message": "the lower pod is gone"},
            ],
            "initContainerStatuses": [{"name": "init", "image": "busybox", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}],
            "containerStatuses": [
                {"name": "app", "image": "nginx:1", "imageID": "id", "ready": false, "started": false, "restartCount": 2,
                 "containerID": "containerd://abc",
                 "state": {"terminated": {"exitCode": 137, "reason": "NotFound", "message": "the lower pod is gone",
                                          "containerID": "containerd://abc", "startedAt": "2024-01-01T00:00:04Z"}}},
                {"name": "sidecar", "image": "envoy:1", "imageID": "", "ready": false, "started": false, "restartCount": 0,
                 "state": {"terminated": {"exitCode": 137, "reason": "NotFound", "message": "the lower pod is gone"}}},
            ],
        }))
        .unwrap();
        assert_eq!(status, want);
    }

    #[test]
    fn trips_labels() {
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        // (case, labels, ignore, labels left, tripped)
        type Case<'a> = (
            &'a str,
            &'a [(&'a str, &'a str)],
            &'a [&'a str],
            &'a [(&'a str, &'a str)],
            &'a [(&'a str, &'a str)],
        );
        let cases: &[Case] = &[
            ("nothing to ignore", &[("a", "1")], &[], &[("a", "1")], &[]),
            ("no labels", &[], &["a"], &[], &[]),
            (
                "one of two",
                &[("a", "1"), ("b", "2")],
                &["b"],
                &[("a", "1")],
                &[("b", "2")],
            ),
            (
                "all",
                &[("a", "1"), ("b", "2")],
                &["a", "b", "c"],
                &[],
                &[("a", "1"), ("b", "2")],
            ),
            (
                "the default --ignore-labels",
                &[("pod-group.scheduling.sigs.k8s.io", "job-1"), ("app", "x")],
                &["pod-group.scheduling.sigs.k8s.io"],
                &[("app", "x")],
                &[("pod-group.scheduling.sigs.k8s.io", "job-1")],
            ),
        ];
        for (name, input, ignore, left, tripped) in cases {
            let mut got = labels(input);
            let ignore: Vec<String> = ignore.iter().map(|s| s.to_string()).collect();
            assert_eq!(trip_labels(&mut got, &ignore), labels(tripped), "{name}");
            assert_eq!(got, labels(left), "{name}");
        }
    }

    #[test]
    fn only_informative_lower_statuses_are_worth_a_write() {
        let status = |v: Value| -> PodStatus { serde_json::from_value(v).unwrap() };
        let cases = [
            ("just created", json!({"phase": "Pending"}), false),
            (
                "scheduled below",
                json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}),
                false,
            ),
            (
                "unschedulable below",
                json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}),
                true,
            ),
            (
                "containers waiting",
                json!({"phase": "Pending", "containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": false, "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}}]}),
                true,
            ),
            ("running", json!({"phase": "Running"}), true),
            ("failed", json!({"phase": "Failed"}), true),
            (
                "a False condition never reflected up",
                json!({"phase": "Pending", "conditions": [{"type": "example.com/gate", "status": "False"}]}),
                false,
            ),
        ];
        for (name, s, want) in cases {
            assert_eq!(status_is_informative(&status(s)), want, "{name}");
        }
    }

    /// [`upper_json`] reading itself through the downward API: env and a volume.
    fn downward_upper() -> Value {
        let field = |path: &str| json!({"apiVersion": "v1", "fieldPath": path});
        patched(
            upper_json(),
            json!({
                "metadata": {"labels": {"app": "web", "pod-group.scheduling.sigs.k8s.io": "g"}},
                "spec": {
                    "containers": [{"name": "app", "image": "nginx:1", "env": [
                        {"name": "NS", "valueFrom": {"fieldRef": field("metadata.namespace")}},
                        {"name": "NODE", "valueFrom": {"fieldRef": field("spec.nodeName")}},
                    ]}],
                    "volumes": [{"name": "info", "downwardAPI": {"items": [
                        {"path": "uid", "fieldRef": field("metadata.uid")},
                        {"path": "labels", "fieldRef": field("metadata.labels")},
                    ]}}],
                },
            }),
        )
    }

    #[test]
    fn the_downward_api_reads_the_upper_values() {
        let ignore = vec!["pod-group.scheduling.sigs.k8s.io".to_owned()];
        let labels = "app=\"web\"\npod-group.scheduling.sigs.k8s.io=\"g\"";
        let annotated = |path: &str| json!({"apiVersion": "v1", "fieldPath": format!("metadata.annotations['{path}']")});
        // (case, upper pod, annotations expected below besides the marks)
        let cases: Vec<(&str, Value, Value)> = vec![
            (
                "a pod that reads none: no annotation",
                upper_json(),
                json!({}),
            ),
            (
                "env and volume: their annotations, the labels with the tripped one",
                downward_upper(),
                json!({
                    UPPER_NAMESPACE_ANNOTATION: "default",
                    UPPER_NODE_NAME_ANNOTATION: NODE,
                    UPPER_LABELS_ANNOTATION: labels,
                }),
            ),
            (
                "an upper pod's own values of these keys are not believed",
                patched(
                    downward_upper(),
                    json!({"metadata": {"annotations": {UPPER_NAMESPACE_ANNOTATION: "forged"}}}),
                ),
                json!({
                    UPPER_NAMESPACE_ANNOTATION: "default",
                    UPPER_NODE_NAME_ANNOTATION: NODE,
                    UPPER_LABELS_ANNOTATION: labels,
                }),
            ),
        ];
        for (name, upper, extra) in cases {
            let lower = lower_pod(&pod(upper), &translation(&ignore)).unwrap();
            let mut annotations = lower.metadata.annotations.clone().unwrap();
            let record: MirroredKeys =
                serde_json::from_str(&annotations.remove(MIRRORED_KEYS_ANNOTATION).unwrap())
                    .unwrap();
            annotations.remove(UPPER_UID_ANNOTATION);
            annotations.remove(TRIPPED_LABELS_ANNOTATION);
            annotations.remove(UPPER_GENERATION_ANNOTATION);
            let extra: BTreeMap<String, String> = serde_json::from_value(extra).unwrap();
            assert_eq!(annotations, extra, "{name}");
            assert_eq!(
                record.downward,
                extra.keys().cloned().collect::<BTreeSet<_>>(),
                "{name}"
            );
            assert!(
                record.annotations.iter().all(|k| !extra.contains_key(k)),
                "{name}: the downward annotations are recorded apart"
            );
            if extra.is_empty() {
                continue;
            }
            let spec = serde_json::to_value(lower.spec.unwrap()).unwrap();
            let env = &spec["containers"][0]["env"];
            assert_eq!(
                env[0]["valueFrom"]["fieldRef"],
                annotated(UPPER_NAMESPACE_ANNOTATION),
                "{name}"
            );
            assert_eq!(
                env[1]["valueFrom"]["fieldRef"],
                annotated(UPPER_NODE_NAME_ANNOTATION),
                "{name}"
            );
            let items = &spec["volumes"][0]["downwardAPI"]["items"];
            assert_eq!(
                items[0]["fieldRef"],
                annotated(UPPER_UID_ANNOTATION),
                "{name}"
            );
            assert_eq!(
                items[1]["fieldRef"],
                annotated(UPPER_LABELS_ANNOTATION),
                "{name}"
            );
        }
    }

    /// The upper pod as the controllers' stores keep it (no env, no volumes).
    fn as_stored(upper: &Pod) -> Pod {
        crate::translate::stored::StoredPod::from(upper.clone()).to_pod()
    }

    #[test]
    fn lower_pod_update_keeps_the_downward_annotations_current() {
        let full = pod(downward_upper());
        let lower = lower_as_stored(&full);
        let lower_json = serde_json::to_value(&lower).unwrap();
        let labels_of = |l: &str| format!("app=\"web\"\npod-group.scheduling.sigs.k8s.io=\"g\"{l}");
        // (case, change to the upper pod, change to the lower pod, expected patch)
        let cases: Vec<(&str, Value, Value, Option<Value>)> = vec![
            ("in sync", json!({}), json!({}), None),
            (
                "a new label reaches the labels annotation",
                json!({"metadata": {"labels": {"tier": "front"}}}),
                json!({}),
                Some(json!({"metadata": {
                    "labels": {"tier": "front"},
                    "annotations": {
                        UPPER_LABELS_ANNOTATION: labels_of("\ntier=\"front\""),
                        MIRRORED_KEYS_ANNOTATION: serde_json::to_value(&lower_pod(
                            &pod(patched(downward_upper(), json!({"metadata": {"labels": {"tier": "front"}}}))),
                            &translation(&[]),
                        ).unwrap().metadata.annotations.unwrap()[MIRRORED_KEYS_ANNOTATION]).unwrap(),
                    },
                }})),
            ),
            (
                "one removed below is put back",
                json!({}),
                json!({"metadata": {"annotations": {UPPER_NAMESPACE_ANNOTATION: null}}}),
                Some(json!({"metadata": {"annotations": {UPPER_NAMESPACE_ANNOTATION: "default"}}})),
            ),
            (
                "one edited below is put back",
                json!({}),
                json!({"metadata": {"annotations": {UPPER_NODE_NAME_ANNOTATION: "lower-node-1"}}}),
                Some(json!({"metadata": {"annotations": {UPPER_NODE_NAME_ANNOTATION: NODE}}})),
            ),
        ];
        for (name, upper_change, lower_change, want) in cases {
            let upper = pod(patched(downward_upper(), upper_change));
            let lower = pod(patched(lower_json.clone(), lower_change));
            // The full pod (when it is created) and the stored one (every update after)
            // agree.
            for (which, upper) in [("full", upper.clone()), ("stored", as_stored(&upper))] {
                let got = lower_pod_update(&upper, &lower, &translation(&[])).unwrap();
                assert_eq!(got, want, "{name} ({which})");
                if let Some(patch) = got {
                    let after = pod(patched(serde_json::to_value(&lower).unwrap(), patch));
                    let again = lower_pod_update(&upper, &after, &translation(&[])).unwrap();
                    assert_eq!(again, None, "{name} ({which}): after applying");
                }
            }
        }
    }
}
