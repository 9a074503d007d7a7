//! The pod as the controllers' stores keep it. A k8s-openapi `Pod` costs kilobytes even
//! when pruned (its structs hold every optional field inline); between reconciles the
//! controllers compare only identity, marks, container names and images, ephemeral
//! container names, tolerations, activeDeadlineSeconds, nodeName and status. Watch events
//! are converted on arrival, so ten thousand mirrored pods fit in a small footprint; a
//! reconcile rebuilds a `Pod` view. A lower pod's status is kept whole, packed
//! ([`PackedStatus`]: status reflection writes it up), an upper pod's as a short summary and a digest of what status
//! reflection compares. The compared part of the spec is kept as its JSON, which pods of
//! one workload share ([`SharedSpecs`]). Labels and annotations are kept as [`Pairs`], one
//! buffer each instead of a `BTreeMap` (whose smallest node reserves room for eleven
//! entries: half a kilobyte for the two to five a pod has).

use std::borrow::Borrow;
use std::collections::{BTreeMap, HashSet};
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};

use k8s_openapi::api::core::v1::{
    Container, EphemeralContainer, ObjectReference, Pod, PodSpec, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use super::meta::{Claim, Owner, UPPER_UID_ANNOTATION};
use super::packed_status::PackedStatus;
use super::pod::{StatusDigest, digest_in_sync, status_digest, status_in_sync, status_summary};

/// A string map of a few entries in one allocation: each key and value as its length in
/// decimal, a colon, then itself (`3:app3:web`). Entries keep the map's (sorted) order.
/// Equal maps of many pods (a workload's labels, tensile's own marks below) share one
/// buffer through [`SharedSpecs`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pairs(Arc<str>);

impl Default for Pairs {
    fn default() -> Self {
        static EMPTY: LazyLock<Arc<str>> = LazyLock::new(|| Arc::from(""));
        Self(EMPTY.clone())
    }
}

impl Pairs {
    /// Packs `map`.
    pub fn new(map: &BTreeMap<String, String>) -> Self {
        Self(Self::text(map.iter()).into())
    }

    /// The packed text of `entries`.
    fn text<'a>(entries: impl Iterator<Item = (&'a String, &'a String)> + Clone) -> String {
        let mut text =
            String::with_capacity(entries.clone().map(|(k, v)| k.len() + v.len() + 8).sum());
        for part in entries.flat_map(|(k, v)| [k, v]) {
            text.push_str(&part.len().to_string());
            text.push(':');
            text.push_str(part);
        }
        text
    }

    /// The keys and values, one after the other.
    fn parts(&self) -> impl Iterator<Item = &str> {
        let mut rest: &str = &self.0;
        std::iter::from_fn(move || {
            let (len, tail) = rest.split_once(':')?;
            let len: usize = len.parse().ok()?;
            let part = tail.get(..len)?;
            rest = tail.get(len..)?;
            Some(part)
        })
    }

    /// The entries, in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        let mut parts = self.parts();
        std::iter::from_fn(move || Some((parts.next()?, parts.next()?)))
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The heap bytes it holds (shared with the equal maps of other pods).
    pub fn heap_bytes(&self) -> usize {
        self.0.len()
    }

    /// The map back; `None` when empty.
    pub fn to_map(&self) -> Option<BTreeMap<String, String>> {
        (!self.is_empty()).then(|| {
            self.iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect()
        })
    }
}

/// The metadata a reconcile reads between watch events: identity and deletion (labels and
/// annotations are [`Pairs`] beside it). A tenth of `ObjectMeta`'s 360 bytes, whose
/// every field is inline.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoredMeta {
    /// `metadata.namespace`, shared with the other pods of the namespace.
    pub namespace: Arc<str>,
    /// `metadata.name`, `metadata.uid`, a lower pod's [`UPPER_UID_ANNOTATION`],
    /// `metadata.deletionTimestamp`, `deletionGracePeriodSeconds` and `generation` ([`StoredMeta::name`],
    /// [`StoredMeta::uid`], [`StoredPod::upper_uid`], …).
    identity: Identity,
}

/// A pod's name, UID, upper UID (a lower pod's [`UPPER_UID_ANNOTATION`]) deletion
/// fields and generation in one allocation: a byte of [`IdentityFlags`], then each UID present (16 bytes
/// for a canonical UUID, the form API servers give, where its text takes 36; else its
/// length as 4 bytes and its text), the deletion time (nanoseconds, 16 bytes) and grace
/// period (8 bytes) and generation (8 bytes) if set, and the name to the end. Empty: no name, nothing else set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Identity(Box<[u8]>);

/// The bits of an [`Identity`]'s first byte.
struct IdentityFlags;

impl IdentityFlags {
    const UID: u8 = 1;
    const UID_TEXT: u8 = 2;
    const UPPER_UID: u8 = 4;
    const UPPER_UID_TEXT: u8 = 8;
    const DELETION_TIMESTAMP: u8 = 16;
    const GRACE_PERIOD: u8 = 32;
    const GENERATION: u8 = 64;
}

/// An [`Identity`] read.
#[derive(Debug, Default)]
struct IdentityParts<'a> {
    uid: Option<Uid<'a>>,
    upper_uid: Option<Uid<'a>>,
    /// Nanoseconds since the epoch.
    deletion_timestamp: Option<i128>,
    grace_period_seconds: Option<i64>,
    generation: Option<i64>,
    name: &'a str,
}

impl Identity {
    fn new(parts: &IdentityParts<'_>) -> Self {
        let name = parts.name;
        let mut flags = 0;
        let mut bytes = Vec::with_capacity(1 + 2 * 20 + name.len());
        bytes.push(0);
        for (uid, present, text) in [
            (&parts.uid, IdentityFlags::UID, IdentityFlags::UID_TEXT),
            (
                &parts.upper_uid,
                IdentityFlags::UPPER_UID,
                IdentityFlags::UPPER_UID_TEXT,
            ),
        ] {
            let Some(uid) = uid else { continue };
            flags |= present;
            match uuid_bytes(uid) {
                Some(binary) => bytes.extend_from_slice(&binary),
                None => {
                    flags |= text;
                    let len = u32::try_from(uid.len()).unwrap_or(u32::MAX);
                    bytes.extend_from_slice(&len.to_le_bytes());
                    bytes.extend_from_slice(&uid.as_bytes()[..len as usize]);
                }
            }
        }
        if let Some(at) = parts.deletion_timestamp {
            flags |= IdentityFlags::DELETION_TIMESTAMP;
            bytes.extend_from_slice(&at.to_le_bytes());
        }
        if let Some(grace) = parts.grace_period_seconds {
            flags |= IdentityFlags::GRACE_PERIOD;
            bytes.extend_from_slice(&grace.to_le_bytes());
        }
        if let Some(generation) = parts.generation {
            flags |= IdentityFlags::GENERATION;
            bytes.extend_from_slice(&generation.to_le_bytes());
        }
        bytes.extend_from_slice(name.as_bytes());
        if flags == 0 && name.is_empty() {
            return Self::default();
        }
        bytes[0] = flags;
        Self(bytes.into_boxed_slice())
    }

    /// What it holds. Written by [`Identity::new`], so it reads back whole; a malformed
    /// rest reads as absent.
    fn parts(&self) -> IdentityParts<'_> {
        fn take<'a, const N: usize>(rest: &mut &'a [u8]) -> Option<&'a [u8; N]> {
            let (head, tail) = rest.split_first_chunk::<N>()?;
            *rest = tail;
            Some(head)
        }
        fn uid<'a>(rest: &mut &'a [u8], text: bool) -> Option<Uid<'a>> {
            if !text {
                return take::<16>(rest).map(|b| Uid(UidText::Binary(*b)));
            }
            let len = u32::from_le_bytes(*take::<4>(rest)?) as usize;
            let (text, tail) = rest.split_at_checked(len)?;
            *rest = tail;
            Some(Uid(UidText::Kept(std::str::from_utf8(text).ok()?)))
        }
        let Some((&flags, mut rest)) = self.0.split_first() else {
            return IdentityParts::default();
        };
        let has = |flag: u8| flags & flag != 0;
        let mut parts = IdentityParts::default();
        if has(IdentityFlags::UID) {
            parts.uid = uid(&mut rest, has(IdentityFlags::UID_TEXT));
        }
        if has(IdentityFlags::UPPER_UID) {
            parts.upper_uid = uid(&mut rest, has(IdentityFlags::UPPER_UID_TEXT));
        }
        if has(IdentityFlags::DELETION_TIMESTAMP) {
            parts.deletion_timestamp = take::<16>(&mut rest).map(|b| i128::from_le_bytes(*b));
        }
        if has(IdentityFlags::GRACE_PERIOD) {
            parts.grace_period_seconds = take::<8>(&mut rest).map(|b| i64::from_le_bytes(*b));
        }
        if has(IdentityFlags::GENERATION) {
            parts.generation = take::<8>(&mut rest).map(|b| i64::from_le_bytes(*b));
        }
        parts.name = std::str::from_utf8(rest).unwrap_or_default();
        parts
    }

    /// The heap bytes it holds.
    fn heap_bytes(&self) -> usize {
        self.0.len()
    }
}

/// The 16 bytes of `uid` if it is a canonical UUID (lowercase hex, hyphens at 8, 13, 18
/// and 23), which they write back as the same text; `None` for any other text.
fn uuid_bytes(uid: &str) -> Option<[u8; 16]> {
    let text = uid.as_bytes();
    if text.len() != 36 {
        return None;
    }
    let mut digits = [0u8; 32];
    let mut n = 0;
    for (i, &c) in text.iter().enumerate() {
        if matches!(i, 8 | 13 | 18 | 23) {
            if c != b'-' {
                return None;
            }
            continue;
        }
        digits[n] = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'f' => c - b'a' + 10,
            _ => return None,
        };
        n += 1;
    }
    let mut bytes = [0u8; 16];
    for (byte, pair) in bytes.iter_mut().zip(digits.chunks_exact(2)) {
        *byte = pair[0] << 4 | pair[1];
    }
    Some(bytes)
}

/// A stored pod's UID ([`StoredMeta::uid`], [`StoredPod::upper_uid`]): its text, as a
/// `&str` through `Deref` (written out of its 16 bytes for a UUID).
#[derive(Clone, Copy)]
pub struct Uid<'a>(UidText<'a>);

#[derive(Clone, Copy)]
enum UidText<'a> {
    /// A canonical UUID's bytes.
    Binary([u8; 16]),
    /// Any other UID, kept as text.
    Kept(&'a str),
    /// A [`UidText::Binary`] written out, on the stack.
    Written([u8; 36]),
}

impl<'a> Uid<'a> {
    /// Keeping its text at hand: a binary UID written out.
    fn written(self) -> Self {
        let UidText::Binary(bytes) = self.0 else {
            return self;
        };
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut text = [b'-'; 36];
        let mut at = 0;
        for (i, byte) in bytes.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                at += 1;
            }
            text[at] = HEX[usize::from(byte >> 4)];
            text[at + 1] = HEX[usize::from(byte & 15)];
            at += 2;
        }
        Self(UidText::Written(text))
    }
}

impl std::ops::Deref for Uid<'_> {
    type Target = str;

    fn deref(&self) -> &str {
        match &self.0 {
            UidText::Kept(text) => text,
            // Hex digits and hyphens: ASCII.
            UidText::Written(text) => std::str::from_utf8(text).unwrap_or_default(),
            // Never handed out unwritten ([`Uid::written`]).
            UidText::Binary(_) => "",
        }
    }
}

impl AsRef<str> for Uid<'_> {
    fn as_ref(&self) -> &str {
        self
    }
}

impl std::fmt::Display for Uid<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self)
    }
}

impl std::fmt::Debug for Uid<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&**self, f)
    }
}

impl PartialEq for Uid<'_> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for Uid<'_> {}

impl PartialEq<str> for Uid<'_> {
    fn eq(&self, other: &str) -> bool {
        &**self == other
    }
}

impl PartialEq<&str> for Uid<'_> {
    fn eq(&self, other: &&str) -> bool {
        &**self == *other
    }
}

impl serde::Serialize for Uid<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self)
    }
}

impl StoredMeta {
    /// What [`StoredPod`] keeps of `metadata` (labels and annotations apart), its
    /// namespace shared through `shared`.
    fn new(metadata: ObjectMeta, upper_uid: Option<&str>, shared: &mut SharedSpecs) -> Self {
        let parts = IdentityParts {
            uid: metadata.uid.as_deref().map(|u| Uid(UidText::Kept(u))),
            upper_uid: upper_uid.map(|u| Uid(UidText::Kept(u))),
            deletion_timestamp: metadata
                .deletion_timestamp
                .as_ref()
                .map(|t| t.0.as_nanosecond()),
            grace_period_seconds: metadata.deletion_grace_period_seconds,
            generation: metadata.generation,
            name: metadata.name.as_deref().unwrap_or_default(),
        };
        Self {
            namespace: shared
                .namespaces
                .share(metadata.namespace.unwrap_or_default().as_str()),
            identity: Identity::new(&parts),
        }
    }

    /// `metadata.name`.
    pub fn name(&self) -> &str {
        self.identity.parts().name
    }

    /// `metadata.uid`.
    pub fn uid(&self) -> Option<Uid<'_>> {
        self.identity.parts().uid.map(Uid::written)
    }

    /// `metadata.deletionTimestamp`.
    pub fn deletion_timestamp(&self) -> Option<Time> {
        let at = self.identity.parts().deletion_timestamp?;
        // Kept from a `Time`'s nanoseconds: within its range.
        k8s_openapi::jiff::Timestamp::from_nanosecond(at)
            .ok()
            .map(Time)
    }

    /// `metadata.deletionGracePeriodSeconds`.
    pub fn deletion_grace_period_seconds(&self) -> Option<i64> {
        self.identity.parts().grace_period_seconds
    }

    /// `metadata.generation`.
    pub fn generation(&self) -> Option<i64> {
        self.identity.parts().generation
    }

    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name())
    }
}

/// A pod reduced to what the controllers compare. It deserializes from a pod's JSON.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(from = "Pod")]
pub struct StoredPod {
    /// Identity and deletion; labels and annotations are read with
    /// [`StoredPod::label`] and [`StoredPod::annotation`].
    pub meta: StoredMeta,
    /// `metadata.labels`, but those of [`SharedSpecs::with_common_labels`]'s keys.
    labels: Pairs,
    /// The labels of [`SharedSpecs::with_common_labels`]'s keys: those every pod of the
    /// store carries (a lower pod's ownership marks), shared. Apart from `labels`, so
    /// that a label unique to the pod (its name as `app`, a StatefulSet's pod name) does
    /// not make a copy of them per pod. Behind a thin pointer: one field of every stored
    /// pod.
    common_labels: Option<Arc<Pairs>>,
    /// `metadata.annotations`, but [`UPPER_UID_ANNOTATION`] (a lower pod's own, kept in
    /// `upper_uid`): the rest are equal for a workload's pods, and shared.
    annotations: Pairs,
    /// The spec fields a reconcile compares (nodeName, container names, images, resources
    /// and restart policies, pod-level resources and overhead, ephemeral container names,
    /// tolerations, activeDeadlineSeconds, priority), as the JSON of a
    /// `PodSpec` with only those set. The pods of one workload on one node have equal
    /// ones, which a [`SharedSpecs`] keeps once: three tolerations alone are 300 bytes a
    /// pod.
    spec: Option<Arc<Box<[u8]>>>,
    /// `status`, packed; only its [`status_summary`] and digest for a pod stored
    /// [`StoredPod::summarized`].
    status: Status,
    /// Which version it is, and what it was last found in step with.
    version: Version,
}

/// A stored pod's status, in one allocation (none without a status): whole, as
/// [`PackedStatus`]'s bytes; or, for a pod stored [`StoredPod::summarized`],
/// [`SUMMARY_MARK`], then what [`status_in_sync`] compares of it ([`StatusDigest`]) and
/// its [`status_summary`] packed (if any), to the end.
#[derive(Clone, Debug, Default, PartialEq)]
struct Status(Option<Box<[u8]>>);

/// What a summarized [`Status`] starts with, where a whole one starts with the length of
/// its JSON: 4 GiB, which no pod's status is (an API server takes objects of a few MiB).
const SUMMARY_MARK: [u8; 4] = [0xff; 4];

impl Status {
    /// `status`, whole.
    fn whole(status: Option<&PodStatus>) -> Self {
        Self(
            status
                .and_then(PackedStatus::new)
                .map(PackedStatus::into_bytes),
        )
    }

    /// `digest` and `summary` (packed).
    fn summary(digest: &StatusDigest, summary: Option<PackedStatus>) -> Self {
        let summary = summary.map(PackedStatus::into_bytes).unwrap_or_default();
        // Exactly: the boxed slice then keeps the allocation (no shrinking copy).
        let mut bytes =
            Vec::with_capacity(SUMMARY_MARK.len() + digest.encoded_len() + summary.len());
        bytes.extend_from_slice(&SUMMARY_MARK);
        digest.write_to(&mut bytes);
        bytes.extend_from_slice(&summary);
        Self(Some(bytes.into_boxed_slice()))
    }

    /// The packed status (or summary), and the digest for a summarized one.
    fn parts(&self) -> (Option<&[u8]>, Option<StatusDigest>) {
        let Some(bytes) = self.0.as_deref() else {
            return (None, None);
        };
        let Some(rest) = bytes.strip_prefix(&SUMMARY_MARK) else {
            return (Some(bytes), None);
        };
        match StatusDigest::read_from(rest) {
            Some((digest, packed)) => ((!packed.is_empty()).then_some(packed), Some(digest)),
            // Written by [`Status::summary`]: never.
            None => (None, None),
        }
    }

    /// The heap bytes it holds.
    fn heap_bytes(&self) -> usize {
        self.0.as_deref().map_or(0, <[u8]>::len)
    }
}

/// Which stored version of a pod a [`StoredPod`] is (unique in the process, never
/// reused: a clone is a version of its own), and the version of its copy in the other
/// cluster that a controller last found it in step with. While neither changes,
/// reconciling the two again finds the same, so a resync passes over them.
#[derive(Debug)]
struct Version {
    id: u64,
    /// The other copy's `id`; 0, which no version has, for none.
    in_step_with: AtomicU64,
}

static NEXT_VERSION: AtomicU64 = AtomicU64::new(1);

impl Default for Version {
    fn default() -> Self {
        Self {
            id: NEXT_VERSION.fetch_add(1, Ordering::Relaxed),
            in_step_with: AtomicU64::new(0),
        }
    }
}

impl Clone for Version {
    fn clone(&self) -> Self {
        Self::default()
    }
}

/// Stored pods compare by what they hold, whichever versions they are.
impl PartialEq for Version {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// `spec` reduced to what [`StoredPod`] keeps.
fn compared_spec(spec: PodSpec) -> PodSpec {
    // Resources: what an in-place resize changes, and what a resize is admitted against
    // (the other pods' requests on the node); the restart policy tells a sidecar.
    let names_and_images = |containers: Vec<Container>| -> Vec<Container> {
        containers
            .into_iter()
            .map(|c| Container {
                name: c.name,
                image: c.image,
                resources: c.resources,
                restart_policy: c.restart_policy,
                ..Container::default()
            })
            .collect()
    };
    PodSpec {
        node_name: spec.node_name,
        containers: names_and_images(spec.containers),
        init_containers: spec
            .init_containers
            .filter(|c| !c.is_empty())
            .map(names_and_images),
        // Names only: an ephemeral container is never changed once added, so its name
        // tells whether the lower pod has it.
        ephemeral_containers: spec.ephemeral_containers.filter(|c| !c.is_empty()).map(
            |containers| {
                containers
                    .into_iter()
                    .map(|c| EphemeralContainer {
                        name: c.name,
                        ..EphemeralContainer::default()
                    })
                    .collect()
            },
        ),
        tolerations: spec.tolerations,
        active_deadline_seconds: spec.active_deadline_seconds,
        // The upper Ready counts them (and their conditions, kept in the summary).
        readiness_gates: spec.readiness_gates.filter(|g| !g.is_empty()),
        resources: spec.resources,
        overhead: spec.overhead,
        // The order in which deferred resizes are admitted.
        priority: spec.priority,
        ..PodSpec::default()
    }
}

/// Equal buffers of many [`StoredPod`]s, kept once: their compared specs, label and
/// annotation maps ([`Pairs`]) and namespaces. One per pod store (the watch that fills it
/// is its only writer).
#[derive(Debug, Default)]
pub struct SharedSpecs {
    specs: Interned<Box<[u8]>>,
    pairs: Interned<str>,
    namespaces: Interned<str>,
    /// The label keys kept apart as [`StoredPod`]'s `common_labels`.
    common_keys: &'static [&'static str],
    /// The last `common_labels` made: all the store's pods have the same.
    common: Option<Arc<Pairs>>,
}

/// Equal values kept once. Values no stored pod holds any more are swept out once it has
/// doubled since the last sweep, so it stays within twice the distinct values in use.
#[derive(Debug)]
struct Interned<T: ?Sized> {
    values: HashSet<Arc<T>>,
    /// How many it kept after the last sweep.
    swept_to: usize,
}

impl<T: ?Sized> Default for Interned<T> {
    fn default() -> Self {
        Self {
            values: HashSet::new(),
            swept_to: 0,
        }
    }
}

/// Below this, an [`Interned`] set is never swept: the sweep would cost more than it frees.
const SWEEP_FLOOR: usize = 64;

impl<T: ?Sized + Eq + Hash> Interned<T> {
    /// The shared copy of `value`.
    fn share<V>(&mut self, value: V) -> Arc<T>
    where
        V: Borrow<T> + Into<Arc<T>>,
        Arc<T>: Borrow<T>,
    {
        if let Some(shared) = self.values.get(value.borrow()) {
            return shared.clone();
        }
        if self.values.len() >= 2 * self.swept_to.max(SWEEP_FLOOR) {
            // Held only here: no stored pod has this value any more.
            self.values.retain(|value| Arc::strong_count(value) > 1);
            self.swept_to = self.values.len();
        }
        let shared: Arc<T> = value.into();
        self.values.insert(shared.clone());
        shared
    }
}

impl SharedSpecs {
    /// One whose pods keep the labels of `keys` (which every pod of the store carries,
    /// with the same values) apart from the rest, shared.
    pub fn with_common_labels(keys: &'static [&'static str]) -> Self {
        Self {
            common_keys: keys,
            ..Self::default()
        }
    }

    /// The shared copy of `json` (behind a thin pointer: a stored pod keeps one per
    /// pod).
    fn share(&mut self, json: Vec<u8>) -> Arc<Box<[u8]>> {
        self.specs.share(json.into_boxed_slice())
    }

    /// The shared copy of `pairs` (of the pod named `pod`). A map holding the pod's own
    /// name as a value (`app: <pod>`, `statefulset.kubernetes.io/pod-name`) is no other
    /// pod's: kept as it is, not in the set, where it would take a slot per pod.
    fn share_pairs(&mut self, pairs: Pairs, pod: &str) -> Pairs {
        if pairs.is_empty() {
            return Pairs::default();
        }
        if pairs.iter().any(|(_, value)| value == pod) {
            return pairs;
        }
        Pairs(self.pairs.share(pairs.0))
    }

    /// Takes the labels of [`SharedSpecs::with_common_labels`]'s keys out of `labels`,
    /// shared.
    fn common_labels(
        &mut self,
        labels: &mut Option<BTreeMap<String, String>>,
    ) -> Option<Arc<Pairs>> {
        let labels = labels.as_mut()?;
        let common: BTreeMap<String, String> = self
            .common_keys
            .iter()
            .filter_map(|key| labels.remove_entry(*key))
            .collect();
        if common.is_empty() {
            return None;
        }
        let common = Pairs::new(&common);
        match &self.common {
            Some(last) if **last == common => Some(last.clone()),
            _ => {
                let common = Arc::new(common);
                self.common = Some(common.clone());
                Some(common)
            }
        }
    }

    /// How many distinct specs it holds.
    pub fn len(&self) -> usize {
        self.specs.values.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.specs.values.is_empty()
    }
}

impl From<Pod> for StoredPod {
    fn from(pod: Pod) -> Self {
        Self::new(pod, &mut SharedSpecs::default())
    }
}

impl StoredPod {
    /// `pod` as stored, its spec shared through `shared` with the equal ones of other pods.
    pub fn new(pod: Pod, shared: &mut SharedSpecs) -> Self {
        // Nothing between reconciles reads the rest of the metadata (owner references,
        // finalizers, resourceVersion: every write of a pod is a merge patch or carries a
        // UID precondition); a lower pod is made from the whole upper pod, read again when
        // it is created.
        let Pod {
            mut metadata,
            spec,
            status,
        } = pod;
        let mut labels = metadata.labels.take();
        let mut annotations = metadata.annotations.take();
        let name = metadata.name.as_deref().unwrap_or_default();
        let common_labels = shared.common_labels(&mut labels);
        let labels = shared.share_pairs(packed(labels), name);
        let upper_uid = annotations
            .as_mut()
            .and_then(|a| a.remove(UPPER_UID_ANNOTATION));
        let annotations = shared.share_pairs(packed(annotations), name);
        Self {
            meta: StoredMeta::new(metadata, upper_uid.as_deref(), shared),
            labels,
            common_labels,
            annotations,
            spec: spec
                .map(compared_spec)
                .as_ref()
                .and_then(json)
                .map(|json| shared.share(json.into_vec())),
            status: Status::whole(status.as_ref()),
            version: Version::default(),
        }
    }

    /// Like [`StoredPod::new`], keeping of the status only its [`status_summary`] and
    /// [`StatusDigest`]: for upper pods, whose status only the status reflector compares
    /// (with the lower pod's) and a failing pod's step reads whole, from the API.
    pub fn summarized(mut pod: Pod, shared: &mut SharedSpecs) -> Self {
        let status = pod.status.take();
        let gates = pod
            .spec
            .as_ref()
            .and_then(|s| s.readiness_gates.clone())
            .unwrap_or_default();
        let mut stored = Self::new(pod, shared);
        let summary = status
            .as_ref()
            .map(|status| status_summary(status, &gates))
            .as_ref()
            .and_then(PackedStatus::new);
        stored.status = Status::summary(&status_digest(status.as_ref()), summary);
        stored
    }
}

/// `value` as JSON.
fn json<T: serde::Serialize>(value: &T) -> Option<Box<[u8]>> {
    serde_json::to_vec(value).ok().map(Vec::into_boxed_slice)
}

/// Parses what [`json`] wrote.
fn parsed<T: serde::de::DeserializeOwned>(json: Option<&[u8]>) -> Option<T> {
    // It was serialized from a `T` on arrival, so it parses back.
    json.and_then(|json| serde_json::from_slice(json).ok())
}

/// Packs a label or annotation map.
fn packed(map: Option<BTreeMap<String, String>>) -> Pairs {
    map.map(|m| Pairs::new(&m)).unwrap_or_default()
}

impl StoredPod {
    /// Whether `other` differs from it in its status at most: in nothing else a
    /// reconcile reads.
    pub fn same_but_status(&self, other: &StoredPod) -> bool {
        self.meta == other.meta
            && self.labels == other.labels
            && self.common_labels == other.common_labels
            && self.annotations == other.annotations
            && self.spec == other.spec
    }

    /// Whether a controller found it in step with `other`, its copy in the other cluster,
    /// as they are: neither has changed since ([`StoredPod::mark_in_step_with`]).
    pub fn in_step_with(&self, other: &StoredPod) -> bool {
        self.version.in_step_with.load(Ordering::Relaxed) == other.version.id
    }

    /// Records that a reconcile of it and `other` found nothing to do, and would find
    /// nothing again until either changes.
    pub fn mark_in_step_with(&self, other: &StoredPod) {
        self.version
            .in_step_with
            .store(other.version.id, Ordering::Relaxed);
    }

    /// The value of label `key`.
    pub fn label(&self, key: &str) -> Option<&str> {
        // Disjoint: a key is in one or the other.
        self.labels
            .get(key)
            .or_else(|| self.common_labels.as_ref()?.get(key))
    }

    /// The value of annotation `key`; [`UPPER_UID_ANNOTATION`]'s is read with
    /// [`StoredPod::upper_uid`] (kept apart, as 16 bytes).
    pub fn annotation(&self, key: &str) -> Option<&str> {
        if key == UPPER_UID_ANNOTATION {
            return None;
        }
        self.annotations.get(key)
    }

    /// Whether `node` owns it ([`super::pod::is_owned_by`] on a stored pod).
    pub fn is_owned_by(&self, owner: &Owner) -> bool {
        owner.claim(|key| self.label(key)) == Claim::Ours
    }

    /// The UID of its upper pod ([`super::pod::upper_uid`] on a stored pod).
    pub fn upper_uid(&self) -> Option<Uid<'_>> {
        self.meta.identity.parts().upper_uid.map(Uid::written)
    }

    /// `spec.nodeName`: the node it is bound to, if any yet (read from the kept spec
    /// alone, without building a `PodSpec`).
    pub fn node_name(&self) -> Option<String> {
        #[derive(serde::Deserialize)]
        struct Bound {
            #[serde(rename = "nodeName")]
            node_name: Option<String>,
        }
        parsed::<Bound>(self.spec_json()).and_then(|b| b.node_name)
    }

    /// The status (only its [`status_summary`] for a pod stored [`StoredPod::summarized`]).
    pub fn status(&self) -> Option<PodStatus> {
        self.packed_status().and_then(PackedStatus::unpack)
    }

    /// The packed status, or summary.
    fn packed_status(&self) -> Option<&[u8]> {
        self.status.parts().0
    }

    /// Whether its status already shows `desired` ([`status_in_sync`]).
    pub fn status_in_sync(&self, desired: &PodStatus) -> bool {
        match self.status.parts() {
            (_, Some(digest)) => digest_in_sync(&digest, desired),
            (packed, None) => {
                status_in_sync(packed.and_then(PackedStatus::unpack).as_ref(), desired)
            }
        }
    }

    /// The heap bytes it holds, itself included (as kept behind an `Arc`), what it shares
    /// with other pods apart (its namespace, spec, labels and annotations but the upper
    /// UID and maps of its own): for `tensile_memory_bytes`.
    pub fn heap_bytes(&self) -> usize {
        let meta = &self.meta;
        2 * size_of::<usize>()
            + size_of::<Self>()
            + meta.identity.heap_bytes()
            + self.status.heap_bytes()
            + [&self.labels, &self.annotations]
                .iter()
                .filter(|pairs| !pairs.is_empty() && Arc::strong_count(&pairs.0) == 1)
                .map(|pairs| 2 * size_of::<usize>() + pairs.heap_bytes())
                .sum::<usize>()
    }

    /// The kept spec's JSON.
    fn spec_json(&self) -> Option<&[u8]> {
        self.spec.as_deref().map(|json| &**json)
    }

    /// `metadata.labels` back; `None` when none.
    fn label_map(&self) -> Option<BTreeMap<String, String>> {
        let mut map = self.labels.to_map();
        if let Some(common) = self.common_labels.as_ref().and_then(|c| c.to_map()) {
            map.get_or_insert_default().extend(common);
        }
        map
    }

    /// `metadata.annotations` back; `None` when none.
    fn annotation_map(&self) -> Option<BTreeMap<String, String>> {
        let mut map = self.annotations.to_map();
        if let Some(uid) = self.upper_uid() {
            map.get_or_insert_default()
                .insert(UPPER_UID_ANNOTATION.to_owned(), uid.to_string());
        }
        map
    }

    /// The reference an Event about this pod names (as `Resource::object_ref` makes it).
    pub fn object_reference(&self) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: Some(self.meta.namespace.to_string()),
            name: Some(self.meta.name().to_owned()),
            uid: self.meta.uid().map(|uid| uid.to_string()),
            ..ObjectReference::default()
        }
    }

    /// The `Pod` this stands for, with only the stored fields set — enough for the
    /// comparisons and patches of a reconcile, not for creating a pod.
    pub fn to_pod(&self) -> Pod {
        let meta = &self.meta;
        Pod {
            metadata: ObjectMeta {
                namespace: Some(meta.namespace.to_string()),
                name: Some(meta.name().to_owned()),
                uid: meta.uid().map(|uid| uid.to_string()),
                deletion_timestamp: meta.deletion_timestamp(),
                deletion_grace_period_seconds: meta.deletion_grace_period_seconds(),
                generation: meta.generation(),
                labels: self.label_map(),
                annotations: self.annotation_map(),
                ..ObjectMeta::default()
            },
            spec: Some(parsed(self.spec_json()).unwrap_or_default()),
            status: self.status(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keeps_what_reconciles_compare_and_drops_the_rest() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {
                "name": "web", "namespace": "ns", "uid": "u", "labels": {"app": "web"},
                "resourceVersion": "42",
                "managedFields": [{"manager": "kubectl", "operation": "Update"}],
            },
            "spec": {
                "nodeName": "vk",
                "activeDeadlineSeconds": 60,
                "tolerations": [{"key": "k", "operator": "Exists"}],
                "initContainers": [{"name": "init", "image": "busybox"}],
                "ephemeralContainers": [{"name": "debugger", "image": "busybox",
                                         "targetContainerName": "app"}],
                "containers": [{
                    "name": "app", "image": "nginx:1",
                    "env": [{"name": "A", "value": "b"}],
                    "livenessProbe": {"httpGet": {"path": "/", "port": 80}},
                }],
                "volumes": [{"name": "v", "emptyDir": {}}],
            },
            "status": {"phase": "Running", "podIP": "10.0.0.1"},
        }))
        .unwrap();
        let stored = StoredPod::from(pod.clone());
        let view = stored.to_pod();
        assert_eq!(view.metadata.managed_fields, None);
        assert_eq!(view.metadata.resource_version, None);
        assert_eq!(stored.label("app"), Some("web"));
        assert_eq!(stored.label("other"), None);
        assert_eq!(stored.status(), pod.status);
        let (spec, original) = (view.spec.unwrap(), pod.spec.unwrap());
        assert_eq!(view.metadata.labels, pod.metadata.labels);
        assert_eq!(view.status, pod.status);
        assert_eq!(spec.node_name, original.node_name);
        assert_eq!(spec.tolerations, original.tolerations);
        assert_eq!(spec.active_deadline_seconds, Some(60));
        assert_eq!(spec.containers[0].name, "app");
        assert_eq!(spec.containers[0].image.as_deref(), Some("nginx:1"));
        assert!(spec.containers[0].env.is_none() && spec.containers[0].liveness_probe.is_none());
        assert_eq!(
            spec.init_containers.unwrap()[0].image.as_deref(),
            Some("busybox")
        );
        let ephemeral = spec.ephemeral_containers.unwrap();
        assert_eq!(ephemeral[0].name, "debugger");
        assert!(ephemeral[0].image.is_none() && ephemeral[0].target_container_name.is_none());
        assert!(spec.volumes.is_none());
        let meta = view.metadata;
        assert_eq!(
            (
                meta.namespace.as_deref(),
                meta.name.as_deref(),
                meta.uid.as_deref()
            ),
            (Some("ns"), Some("web"), Some("u"))
        );
        assert!(stored.heap_bytes() > size_of::<StoredPod>());
        // With the `Arc`'s two counts, 128 bytes: one of the allocator's size classes (one
        // more field and every stored pod takes 160).
        assert!(
            size_of::<StoredPod>() <= 112,
            "{} bytes a stored pod",
            size_of::<StoredPod>()
        );
    }

    #[test]
    fn a_change_of_status_alone_is_told_from_any_other() {
        let base: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "ns", "uid": "u", "labels": {"app": "web"},
                         "annotations": {"a": "1"}, "resourceVersion": "1"},
            "spec": {"nodeName": "vk", "containers": [{"name": "app", "image": "nginx:1"}]},
            "status": {"phase": "Pending"},
        }))
        .unwrap();
        type Change = fn(&mut Pod);
        let cases: [(&str, Change, bool); 10] = [
            ("nothing", |_| {}, true),
            (
                "the status",
                |p| {
                    p.status = Some(PodStatus {
                        phase: Some("Running".into()),
                        pod_ip: Some("10.0.0.1".into()),
                        ..PodStatus::default()
                    })
                },
                true,
            ),
            (
                "the resource version",
                |p| p.metadata.resource_version = Some("2".into()),
                true,
            ),
            (
                "managed fields",
                |p| p.metadata.managed_fields = Some(vec![Default::default()]),
                true,
            ),
            (
                "a label",
                |p| p.metadata.labels = Some([("app".into(), "api".into())].into()),
                false,
            ),
            (
                "an annotation",
                |p| p.metadata.annotations = Some([("a".into(), "2".into())].into()),
                false,
            ),
            (
                "an image",
                |p| p.spec.as_mut().unwrap().containers[0].image = Some("nginx:2".into()),
                false,
            ),
            (
                "the deadline",
                |p| p.spec.as_mut().unwrap().active_deadline_seconds = Some(5),
                false,
            ),
            ("the UID", |p| p.metadata.uid = Some("v".into()), false),
            (
                "deletion",
                |p| p.metadata.deletion_grace_period_seconds = Some(30),
                false,
            ),
        ];
        let stored = StoredPod::from(base.clone());
        for (what, change, want) in cases {
            let mut pod = base.clone();
            change(&mut pod);
            assert_eq!(
                stored.same_but_status(&StoredPod::from(pod)),
                want,
                "{what}"
            );
        }
    }

    #[test]
    fn in_step_holds_for_the_versions_marked_only() {
        let pod = |name: &str| {
            StoredPod::from(Pod {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    namespace: Some("ns".into()),
                    ..ObjectMeta::default()
                },
                ..Pod::default()
            })
        };
        let (upper, lower) = (pod("web"), pod("web"));
        assert!(!upper.in_step_with(&lower), "nothing marked");
        upper.mark_in_step_with(&lower);
        assert!(upper.in_step_with(&lower));
        assert!(!lower.in_step_with(&upper), "marked one way");
        let next_lower = pod("web");
        assert_eq!(next_lower, lower, "equal content");
        assert!(
            !upper.in_step_with(&next_lower),
            "another version of the same pod"
        );
        assert!(
            !upper.in_step_with(&lower.clone()),
            "a clone is a version of its own"
        );
        assert!(
            !upper.clone().in_step_with(&lower),
            "a clone's record starts empty"
        );
        assert!(!StoredPod::default().in_step_with(&StoredPod::default()));
    }

    #[test]
    fn equal_specs_are_kept_once_and_swept_when_unused() {
        let pod = |name: &str, image: &str, node: &str| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "ns"},
                "spec": {"nodeName": node, "containers": [{"name": "app", "image": image,
                         "env": [{"name": "POD", "value": name}]}],
                         "tolerations": [{"key": "k", "operator": "Exists"}]},
            }))
            .unwrap()
        };
        let spec = |p: &StoredPod| p.spec.clone().unwrap();
        let mut shared = SharedSpecs::default();
        let a = StoredPod::new(pod("a", "nginx:1", "n1"), &mut shared);
        let b = StoredPod::new(pod("b", "nginx:1", "n1"), &mut shared);
        let c = StoredPod::new(pod("c", "nginx:2", "n1"), &mut shared);
        let d = StoredPod::new(pod("d", "nginx:1", "n2"), &mut shared);
        assert!(
            Arc::ptr_eq(&spec(&a), &spec(&b)),
            "same workload, same node"
        );
        assert!(!Arc::ptr_eq(&spec(&a), &spec(&c)), "another image");
        assert!(!Arc::ptr_eq(&spec(&a), &spec(&d)), "another node");
        assert_eq!(shared.len(), 3);
        assert_eq!(
            a.to_pod().spec.unwrap().containers[0].image.as_deref(),
            Some("nginx:1")
        );
        drop((b, c, d));
        // Enough distinct specs to trigger a sweep: only those still held survive it.
        let held: Vec<StoredPod> = (0..2 * SWEEP_FLOOR)
            .map(|i| StoredPod::new(pod("x", &format!("img:{i}"), "n1"), &mut shared))
            .collect();
        assert!(shared.len() <= held.len() + 1, "{} kept", shared.len());
        let again = StoredPod::new(pod("e", "nginx:1", "n1"), &mut shared);
        assert!(
            Arc::ptr_eq(&spec(&a), &spec(&again)),
            "a's spec is still held"
        );
    }

    #[test]
    fn a_summarized_pod_compares_its_status_through_the_digest() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "ns", "uid": "u"},
            "spec": {"nodeName": "vk", "containers": [{"name": "app", "image": "nginx:1"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1", "qosClass": "BestEffort",
                       "hostIP": "192.168.0.1",
                       "conditions": [{"type": "Ready", "status": "True"},
                                      {"type": "example.com/gate", "status": "True"}]},
        }))
        .unwrap();
        let whole = StoredPod::from(pod.clone());
        let summarized = StoredPod::summarized(pod.clone(), &mut SharedSpecs::default());
        let status = pod.status.clone().unwrap();
        let moved: PodStatus = serde_json::from_value(json!({"phase": "Running",
            "podIP": "10.0.0.2", "conditions": [{"type": "Ready", "status": "True"}]}))
        .unwrap();
        let reported: PodStatus = serde_json::from_value(json!({"phase": "Running",
            "podIP": "10.0.0.1", "hostIP": "192.168.0.1",
            "conditions": [{"type": "Ready", "status": "True"}]}))
        .unwrap();
        for (desired, want) in [(&status, true), (&moved, false), (&reported, true)] {
            assert_eq!(whole.status_in_sync(desired), want, "{desired:?}");
            assert_eq!(summarized.status_in_sync(desired), want, "{desired:?}");
        }
        let summary = summarized.status().unwrap();
        assert_eq!(summary.phase.as_deref(), Some("Running"));
        assert_eq!(summary.qos_class.as_deref(), Some("BestEffort"));
        assert_eq!(summary.pod_ip, None, "compared through the digest only");
        let kept_conditions: Vec<String> = summary
            .conditions
            .iter()
            .flatten()
            .map(|c| c.type_.clone())
            .collect();
        assert_eq!(
            kept_conditions,
            ["tensile.dev/Mirrored"],
            "only whether it was mirrored; the rest through the digest"
        );
        let kept = |p: &StoredPod| p.packed_status().map_or(0, <[u8]>::len);
        assert!(
            kept(&summarized) < kept(&whole),
            "{} bytes of status kept, {} whole",
            kept(&summarized),
            kept(&whole)
        );
        assert_eq!(summarized.to_pod().metadata, whole.to_pod().metadata);
    }

    /// What the upper Ready of a gated pod is computed from survives the store: the gates
    /// and their conditions.
    #[test]
    fn a_summarized_pod_keeps_its_readiness_gates_and_their_conditions() {
        let upper: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "ns", "uid": "u"},
            "spec": {"nodeName": "vk", "containers": [{"name": "app", "image": "nginx:1"}],
                     "readinessGates": [{"conditionType": "example.com/gate"}]},
            "status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": "False", "reason": "ReadinessGatesNotReady"},
                {"type": "example.com/gate", "status": "True", "reason": "Set",
                 "lastTransitionTime": "2024-01-01T00:00:09Z"},
                {"type": "example.com/other", "status": "True"},
            ]},
        }))
        .unwrap();
        let lower: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "ns"},
            "status": {"phase": "Running", "conditions": [
                {"type": "ContainersReady", "status": "True", "lastTransitionTime": "2024-01-01T00:00:05Z"},
                {"type": "Ready", "status": "True", "lastTransitionTime": "2024-01-01T00:00:05Z"},
            ]},
        }))
        .unwrap();
        let stored = StoredPod::summarized(upper.clone(), &mut SharedSpecs::default()).to_pod();
        assert_eq!(
            stored.spec.as_ref().unwrap().readiness_gates,
            upper.spec.as_ref().unwrap().readiness_gates
        );
        let kept: Vec<(String, String)> = stored
            .status
            .iter()
            .flat_map(|s| s.conditions.iter().flatten())
            .map(|c| (c.type_.clone(), c.status.clone()))
            .collect();
        assert_eq!(
            kept,
            [("example.com/gate".to_owned(), "True".to_owned())],
            "the gate's condition only"
        );
        let desired = super::super::pod::upper_status(&lower, &stored);
        assert_eq!(
            desired,
            super::super::pod::upper_status(&lower, &upper),
            "the same status from the stored pod as from the whole one"
        );
        let ready = desired
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == "Ready");
        assert_eq!(ready.map(|c| c.status.as_str()), Some("True"));
    }

    /// Two lower copies of one workload's pods keep their own names and upper UIDs, and
    /// share their namespace, labels and the rest of their annotations.
    #[test]
    fn a_workloads_pods_share_their_maps_and_namespace() {
        let lower = |name: &str, upper_uid: &str| -> Pod {
            serde_json::from_value(json!({
                "metadata": {
                    "name": name, "namespace": "team-a", "uid": format!("l-{name}"),
                    "labels": {"app": "web", "tensile.dev/virtual-node": "vk",
                               "tensile.dev/upper-cluster": "c1", "virtual-pod": "true"},
                    "annotations": {UPPER_UID_ANNOTATION: upper_uid,
                                    "tensile.dev/mirrored-keys": "{\"labels\":[\"app\"]}"},
                },
                "spec": {"containers": [{"name": "app", "image": "nginx:1"}]},
            }))
            .unwrap()
        };
        let mut shared = SharedSpecs::default();
        let (pod_a, pod_b) = (lower("a", "u-a"), lower("b", "u-b"));
        let a = StoredPod::new(pod_a.clone(), &mut shared);
        let b = StoredPod::new(pod_b.clone(), &mut shared);
        assert!(Arc::ptr_eq(&a.labels.0, &b.labels.0), "labels");
        assert!(
            Arc::ptr_eq(&a.annotations.0, &b.annotations.0),
            "annotations"
        );
        assert!(
            Arc::ptr_eq(&a.meta.namespace, &b.meta.namespace),
            "namespace"
        );
        assert_eq!(
            (a.upper_uid().as_deref(), b.upper_uid().as_deref()),
            (Some("u-a"), Some("u-b"))
        );
        assert_eq!(
            a.annotation(UPPER_UID_ANNOTATION),
            None,
            "read as upper_uid"
        );
        assert_eq!(
            a.annotation("tensile.dev/mirrored-keys"),
            Some("{\"labels\":[\"app\"]}")
        );
        assert_eq!(a.to_pod().metadata.annotations, pod_a.metadata.annotations);
        assert_eq!(b.to_pod().metadata.labels, pod_b.metadata.labels);
        let mut other_upper = pod_a.clone();
        other_upper
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(UPPER_UID_ANNOTATION.into(), "u-z".into());
        assert!(
            !a.same_but_status(&StoredPod::new(other_upper, &mut shared)),
            "the upper UID is compared"
        );
        let bare = StoredPod::new(Pod::default(), &mut shared);
        assert_eq!(bare.to_pod().metadata.annotations, None);
        assert_eq!(bare.to_pod().metadata.labels, None);
    }

    #[test]
    fn pairs_round_trip() {
        let cases: Vec<(&str, Vec<(&str, &str)>)> = vec![
            ("empty", vec![]),
            ("one", vec![("app", "web")]),
            ("empty key and value", vec![("", ""), ("k", "")]),
            (
                "several, unsorted input",
                vec![("z", "1"), ("a", "{\"json\": true}"), ("m", "ünïcode")],
            ),
            (
                "colons and digits inside",
                vec![("12:ab", "3:x"), ("k:", ":"), ("10", "0123456789ab")],
            ),
        ];
        for (name, entries) in cases {
            let map: BTreeMap<String, String> = entries
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let pairs = Pairs::new(&map);
            assert_eq!(
                pairs.to_map(),
                (!map.is_empty()).then(|| map.clone()),
                "{name}"
            );
            assert_eq!(pairs.is_empty(), map.is_empty(), "{name}");
            for (k, v) in &map {
                assert_eq!(pairs.get(k), Some(v.as_str()), "{name}: {k}");
            }
            assert_eq!(pairs.get("absent"), None, "{name}");
            let keys: Vec<&str> = pairs.iter().map(|(k, _)| k).collect();
            let want: Vec<&str> = map.keys().map(String::as_str).collect();
            assert_eq!(keys, want, "{name}: key order");
        }
    }

    #[test]
    fn common_labels_are_kept_apart_and_shared() {
        use crate::translate::meta::{LOWER_POD_MARKS, OWNER_NODE_LABEL, UPPER_CLUSTER_LABEL};
        let lower = |name: &str, node: &str| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "ns", "labels": {
                    "app": name, "bench": "1", "virtual-pod": "true",
                    OWNER_NODE_LABEL: node, UPPER_CLUSTER_LABEL: "c1",
                }},
            }))
            .unwrap()
        };
        let mut shared = SharedSpecs::with_common_labels(LOWER_POD_MARKS);
        let (pod_a, pod_b) = (lower("a", "vk"), lower("b", "vk"));
        let a = StoredPod::new(pod_a.clone(), &mut shared);
        let b = StoredPod::new(pod_b.clone(), &mut shared);
        let (common_a, common_b) = (a.common_labels.clone(), b.common_labels.clone());
        assert!(Arc::ptr_eq(&common_a.unwrap(), &common_b.unwrap()));
        assert_eq!(a.labels.get(OWNER_NODE_LABEL), None, "kept apart");
        // (case, label, value)
        let cases = [
            ("a mark", OWNER_NODE_LABEL, Some("vk")),
            ("the cluster mark", UPPER_CLUSTER_LABEL, Some("c1")),
            ("virtual-pod", "virtual-pod", Some("true")),
            ("the pod's own", "app", Some("a")),
            ("another", "bench", Some("1")),
            ("absent", "other", None),
        ];
        for (case, key, want) in cases {
            assert_eq!(a.label(key), want, "{case}");
        }
        assert_eq!(a.to_pod().metadata.labels, pod_a.metadata.labels);
        assert_eq!(b.to_pod().metadata.labels, pod_b.metadata.labels);
        let elsewhere = StoredPod::new(lower("a", "vk-2"), &mut shared);
        assert!(!a.same_but_status(&elsewhere), "a mark's value is compared");
        assert!(a.same_but_status(&StoredPod::new(pod_a, &mut shared)));
    }

    #[test]
    fn maps_holding_the_pods_own_name_are_not_interned() {
        let pod = |name: &str, labels: serde_json::Value| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "ns", "labels": labels},
            }))
            .unwrap()
        };
        let mut shared = SharedSpecs::default();
        let a = StoredPod::new(pod("a", json!({"app": "a"})), &mut shared);
        assert_eq!(Arc::strong_count(&a.labels.0), 1, "only the pod holds it");
        assert!(a.heap_bytes() >= size_of::<StoredPod>() + a.labels.heap_bytes());
        let web_a = StoredPod::new(pod("a", json!({"app": "web"})), &mut shared);
        let web_b = StoredPod::new(pod("b", json!({"app": "web"})), &mut shared);
        assert!(Arc::ptr_eq(&web_a.labels.0, &web_b.labels.0));
        assert_eq!(web_a.label("app"), Some("web"));
    }

    #[test]
    fn a_status_is_kept_whole_or_as_its_summary_and_digest_in_one_allocation() {
        let condition = |kind: &str| json!({"type": kind, "status": "True"});
        let statuses: Vec<PodStatus> = [
            json!({}),
            json!({"phase": "Running"}),
            json!({"phase": "Running", "podIP": "10.0.0.1", "conditions": [condition("Ready")]}),
            json!({"phase": "Running", "conditions":
                (0..40).map(|i| condition(&format!("c{i}"))).collect::<Vec<_>>()}),
        ]
        .into_iter()
        .map(|s| serde_json::from_value(s).unwrap())
        .collect();
        for status in &statuses {
            let whole = Status::whole(Some(status));
            assert_eq!(whole.parts().1.map(|_| ()), None, "{status:?}");
            assert_eq!(
                whole.parts().0.and_then(PackedStatus::unpack).as_ref(),
                Some(status)
            );
            assert!(!whole.0.as_deref().unwrap().starts_with(&SUMMARY_MARK));
            let digest = status_digest(Some(status));
            // (case, summary kept)
            for (case, summary) in [
                (
                    "with a summary",
                    PackedStatus::new(&status_summary(status, &[])),
                ),
                ("without", None),
            ] {
                let kept = Status::summary(&digest, summary.clone());
                let (packed, read) = kept.parts();
                assert_eq!(read, Some(digest.clone()), "{case}: {status:?}");
                assert_eq!(
                    packed.map(<[u8]>::to_vec),
                    summary.map(|s| s.into_bytes().into_vec()),
                    "{case}: {status:?}"
                );
                for other in &statuses {
                    assert_eq!(
                        digest_in_sync(&read.clone().unwrap(), other),
                        digest_in_sync(&digest, other),
                        "{case}: {status:?} against {other:?}"
                    );
                }
            }
        }
        assert_eq!(Status::whole(None), Status::default());
        assert_eq!(Status::default().parts(), (None, None));
    }

    #[test]
    fn identities_round_trip_uuids_in_16_bytes_and_any_other_uid_as_text() {
        const UUID: &str = "0d9c3d4e-5a8e-4a53-9f44-2a0c1c8f6b1e";
        const OTHER_UUID: &str = "ffffffff-0000-4fff-a000-0123456789ab";
        /// (case, name, uid, upper uid, deletion timestamp, grace period, bytes kept)
        type Case = (
            &'static str,
            &'static str,
            Option<&'static str>,
            Option<&'static str>,
            Option<i128>,
            Option<i64>,
            usize,
        );
        let cases: [Case; 12] = [
            ("nothing", "", None, None, None, None, 0),
            ("a name alone", "web-0", None, None, None, None, 1 + 5),
            (
                "an upper pod",
                "web-0",
                Some(UUID),
                None,
                None,
                None,
                1 + 16 + 5,
            ),
            (
                "a lower pod",
                "web-0",
                Some(UUID),
                Some(OTHER_UUID),
                None,
                None,
                1 + 32 + 5,
            ),
            (
                "an upper UID alone",
                "",
                None,
                Some(UUID),
                None,
                None,
                1 + 16,
            ),
            (
                "upper case: not canonical",
                "p",
                Some("0D9C3D4E-5A8E-4A53-9F44-2A0C1C8F6B1E"),
                None,
                None,
                None,
                1 + 4 + 36 + 1,
            ),
            (
                "no hyphens: not canonical",
                "p",
                Some("0d9c3d4e5a8e4a539f442a0c1c8f6b1eabcd"),
                None,
                None,
                None,
                1 + 4 + 36 + 1,
            ),
            (
                "hyphens elsewhere",
                "p",
                Some("0d9c3d4e5-a8e-4a53-9f44-2a0c1c8f6b1e"),
                None,
                None,
                None,
                1 + 4 + 36 + 1,
            ),
            (
                "short text",
                "p",
                Some("u"),
                Some(""),
                None,
                None,
                1 + 5 + 4 + 1,
            ),
            (
                "unicode",
                "pod-ü",
                Some("ü-ni-cödé"),
                Some(UUID),
                None,
                None,
                1 + 4 + 12 + 16 + 6,
            ),
            (
                "being deleted",
                "web-0",
                Some(UUID),
                Some(OTHER_UUID),
                Some(1_767_225_600_123_456_789),
                Some(30),
                1 + 32 + 16 + 8 + 5,
            ),
            (
                "before the epoch",
                "web-0",
                None,
                None,
                Some(-1),
                Some(0),
                1 + 16 + 8 + 5,
            ),
        ];
        for (case, name, uid, upper_uid, deleted_at, grace, kept) in cases {
            let identity = Identity::new(&IdentityParts {
                uid: uid.map(|u| Uid(UidText::Kept(u))),
                upper_uid: upper_uid.map(|u| Uid(UidText::Kept(u))),
                deletion_timestamp: deleted_at,
                grace_period_seconds: grace,
                // A generation beside each grace period in the table.
                generation: grace.map(|g| g + 100),
                name,
            });
            let parts = identity.parts();
            assert_eq!(parts.name, name, "{case}");
            assert_eq!(parts.uid.map(Uid::written).as_deref(), uid, "{case}");
            assert_eq!(
                parts.upper_uid.map(Uid::written).as_deref(),
                upper_uid,
                "{case}"
            );
            assert_eq!(parts.deletion_timestamp, deleted_at, "{case}");
            assert_eq!(parts.grace_period_seconds, grace, "{case}");
            assert_eq!(parts.generation, grace.map(|g| g + 100), "{case}");
            let generation_bytes = if grace.is_some() { 8 } else { 0 };
            assert_eq!(identity.heap_bytes(), kept + generation_bytes, "{case}");
        }
    }

    #[test]
    fn a_stored_pod_gives_back_its_identity() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web-0", "namespace": "ns",
                         "uid": "0d9c3d4e-5a8e-4a53-9f44-2a0c1c8f6b1e",
                         "annotations": {UPPER_UID_ANNOTATION: "not-a-uuid", "a": "1"},
                         "deletionTimestamp": "2026-01-01T00:00:00Z",
                         "deletionGracePeriodSeconds": 30},
        }))
        .unwrap();
        let stored = StoredPod::from(pod.clone());
        assert_eq!(stored.meta.name(), "web-0");
        assert_eq!(stored.meta.key(), "ns/web-0");
        assert_eq!(
            stored.meta.uid().as_deref(),
            Some("0d9c3d4e-5a8e-4a53-9f44-2a0c1c8f6b1e")
        );
        assert_eq!(stored.upper_uid().as_deref(), Some("not-a-uuid"));
        assert_eq!(
            stored.meta.deletion_timestamp(),
            pod.metadata.deletion_timestamp
        );
        assert_eq!(stored.meta.deletion_grace_period_seconds(), Some(30));
        let view = stored.to_pod().metadata;
        assert_eq!(
            (view.name, view.uid, view.annotations),
            (
                pod.metadata.name,
                pod.metadata.uid,
                pod.metadata.annotations
            )
        );
        assert_eq!(
            serde_json::to_value(stored.meta.uid()).unwrap(),
            json!("0d9c3d4e-5a8e-4a53-9f44-2a0c1c8f6b1e")
        );
    }
}
