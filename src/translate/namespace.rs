//! Namespace remapping (`--lower-namespace`): which lower namespace each upper namespace's
//! objects go to, and the rewriting of API paths and objects between the two names. With
//! a mode other than `same`, the lower client speaks upper names ([`crate::lower_view`]):
//! every path and object it sends is rewritten to lower names and every object it receives
//! back to upper names, so controllers never see a lower namespace name.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::str::FromStr;

use serde_json::Value;

use super::hash::fnv1a;
use super::meta::UPPER_CLUSTER_LABEL;

/// Annotation on an upper Namespace: the lower namespace its objects go to
/// (`--lower-namespace=prefixed` or `annotation`).
pub const LOWER_NAMESPACE_ANNOTATION: &str = "tensile.dev/lower-namespace";
/// How a lower namespace that no upper namespace maps to is named to the controllers: a
/// name no upper namespace can have (a namespace name has no dot), so it is never taken
/// for one.
const UNMAPPED_SUFFIX: &str = ".unmapped";
/// The longest namespace name (a DNS label).
const MAX_NAMESPACE: usize = 63;

/// `--lower-namespace`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Mode {
    /// The upper namespace's name (tensile-kube's behaviour).
    #[default]
    Same,
    /// `<namespace>-<upper cluster, short>`, or the Namespace's annotation.
    Prefixed,
    /// The upper namespace's name, or the Namespace's annotation.
    Annotation,
}

impl FromStr for Mode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "same" => Ok(Self::Same),
            "prefixed" => Ok(Self::Prefixed),
            "annotation" => Ok(Self::Annotation),
            other => Err(format!("{other:?}: expected same, prefixed or annotation")),
        }
    }
}

/// Whether `name` is a valid namespace name (a DNS label).
pub fn is_namespace_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAMESPACE
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// 8 hex digits of a hash stable across releases (names built with it must not change on
/// an upgrade).
fn hash8(text: &str) -> String {
    format!("{:08x}", fnv1a(text.as_bytes()) & 0xffff_ffff)
}

/// The upper cluster's identity, short, for `prefixed` names: itself when it is a short
/// DNS label (`--cluster-id=eu1`), else the first 8 characters of a UID (the default
/// identity, the `kube-system` namespace's UID), else a hash of it.
pub fn cluster_suffix(cluster_id: &str) -> String {
    let id = cluster_id.to_ascii_lowercase();
    if id.len() <= 12 && is_namespace_name(&id) {
        return id;
    }
    let head: String = id.chars().take(8).collect();
    if head.len() == 8 && head.bytes().all(|b| b.is_ascii_hexdigit()) {
        head
    } else {
        hash8(cluster_id)
    }
}

/// `<namespace>-<suffix>`; a name too long for that keeps the head of `namespace` with a
/// hash of all of it (`<head>-<hash>-<suffix>`), so two long names never meet.
pub fn prefixed(namespace: &str, suffix: &str) -> String {
    let name = format!("{namespace}-{suffix}");
    if name.len() <= MAX_NAMESPACE {
        return name;
    }
    let hash = hash8(namespace);
    let keep = MAX_NAMESPACE - suffix.len() - hash.len() - 2;
    let head = namespace[..keep.min(namespace.len())].trim_end_matches('-');
    format!("{head}-{hash}-{suffix}")
}

/// The lower namespace of the upper namespace `namespace` with the annotation value
/// `annotated`: `Err` says why the annotation is not used (the default name is then).
pub fn desired(
    mode: Mode,
    namespace: &str,
    annotated: Option<&str>,
    suffix: &str,
) -> (String, Result<(), String>) {
    let default = match mode {
        Mode::Same | Mode::Annotation => namespace.to_owned(),
        Mode::Prefixed => prefixed(namespace, suffix),
    };
    match annotated {
        None => (default, Ok(())),
        Some(_) if mode == Mode::Same => (default, Ok(())),
        Some(name) if is_namespace_name(name) => (name.to_owned(), Ok(())),
        Some(name) => (
            default,
            Err(format!(
                "annotation {LOWER_NAMESPACE_ANNOTATION}={name:?} is not a namespace name"
            )),
        ),
    }
}

/// The lower namespace `virtual-node join` keeps member identities in (its ServiceAccounts
/// and their token Secrets); `member::join::LOWER_NAMESPACE`.
pub const JOIN_NAMESPACE: &str = "tensile-system";

/// Lower namespaces no mapping may choose ([`Mapping::admit`]): the lower cluster's own
/// (`kube-*`), the one `join` keeps member identities in ([`JOIN_NAMESPACE`]), and those of
/// `--reserved-lower-namespaces`. A pod mapped there would run as their ServiceAccounts and
/// mount their Secrets.
#[derive(Clone, Debug, Default)]
pub struct Reserved {
    names: BTreeSet<String>,
}

impl Reserved {
    /// The built-in names and `extra`.
    pub fn new(extra: impl IntoIterator<Item = String>) -> Self {
        Self {
            names: extra.into_iter().filter(|n| !n.is_empty()).collect(),
        }
    }

    /// Whether `lower` is reserved.
    pub fn contains(&self, lower: &str) -> bool {
        lower.starts_with("kube-") || lower == JOIN_NAMESPACE || self.names.contains(lower)
    }
}

/// What the lower cluster holds under a namespace name, as far as mapping onto it goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Below {
    /// No such namespace: tensile creates it, with its marks, when a pod needs it.
    Absent,
    /// A namespace tensile made for this upper cluster (its cluster mark).
    Ours,
    /// A namespace tensile made for another upper cluster (that cluster's identity).
    Foreign(String),
    /// A namespace tensile did not make for any upper cluster (the lower cluster's own, a
    /// user's, or one a tensile release before cluster marks made: whose is undecidable).
    Unmarked,
}

impl Below {
    /// An existing lower Namespace with `labels`, to the upper cluster `cluster`.
    pub fn of(labels: Option<&BTreeMap<String, String>>, cluster: &str) -> Self {
        match labels.and_then(|l| l.get(UPPER_CLUSTER_LABEL)) {
            Some(mark) if mark == cluster => Self::Ours,
            Some(mark) => Self::Foreign(mark.clone()),
            None => Self::Unmarked,
        }
    }
}

/// Why a lower namespace is not used for an upper one: the Warning's reason and note.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Refused {
    /// The Event's reason.
    pub reason: &'static str,
    /// What it says.
    pub note: String,
}

/// Whether the upper namespace `upper` may map onto the lower namespace `lower`, which holds
/// `below`; `derived` says whether `lower` is the name the mode derives for `upper` rather
/// than one its annotation chose. Pure: the table test below covers it.
///
/// Refused: under any mode but `same` (tensile-kube's, where each upper namespace is its
/// lower namespace of one name), a namespace tensile made for another upper cluster (two
/// upper clusters never meet in one); a reserved name ([`Reserved`]), unless `prefixed`
/// derived it (`<namespace>-<cluster>` is tensile's own, whatever it starts with); and,
/// for a name an annotation chose, a namespace that exists and that tensile did not make
/// for this upper cluster (its ServiceAccounts and Secrets would be used as they are).
pub fn admit(
    mode: Mode,
    upper: &str,
    lower: &str,
    derived: bool,
    below: &Below,
    reserved: &Reserved,
) -> Result<(), Refused> {
    if mode == Mode::Same {
        return Ok(());
    }
    let chosen = if derived {
        "its default lower namespace"
    } else {
        "the lower namespace its annotation names"
    };
    if !(derived && mode == Mode::Prefixed) && reserved.contains(lower) {
        return Err(Refused {
            reason: "LowerNamespaceReserved",
            note: format!(
                "namespace {upper} is not mapped to {chosen}, {lower}: it is reserved (kube-*, \
                 {JOIN_NAMESPACE}, --reserved-lower-namespaces)"
            ),
        });
    }
    match below {
        Below::Foreign(cluster) => Err(Refused {
            reason: "LowerNamespaceNotOurs",
            note: format!(
                "namespace {upper} is not mapped to {chosen}, {lower}: tensile made it for \
                 another upper cluster ({cluster})"
            ),
        }),
        Below::Unmarked if !derived => Err(Refused {
            reason: "LowerNamespaceNotOurs",
            note: format!(
                "namespace {upper} is not mapped to {chosen}, {lower}: it exists and tensile \
                 did not make it for this upper cluster"
            ),
        }),
        _ => Ok(()),
    }
}

/// Which lower namespace each upper namespace maps to, both ways (one to one).
#[derive(Clone, Debug, Default)]
pub struct Mapping {
    mode: Mode,
    suffix: String,
    /// Lower namespaces no mapping may choose.
    reserved: Reserved,
    /// Upper name to lower name, for every upper namespace known.
    forward: HashMap<String, String>,
    /// Lower name to upper name.
    reverse: HashMap<String, String>,
}

impl Mapping {
    /// An empty mapping for `mode`, with the cluster suffix `suffix` ([`cluster_suffix`]).
    pub fn new(mode: Mode, suffix: String) -> Self {
        Self {
            mode,
            suffix,
            ..Self::default()
        }
    }

    /// The same mapping, never choosing the lower namespaces `reserved`.
    pub fn with_reserved(mut self, reserved: Reserved) -> Self {
        self.reserved = reserved;
        self
    }

    /// The mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// [`admit`] of `upper` onto `lower`, which holds `below`, under this mapping's mode
    /// and reserved names (`lower` is derived when it is `upper`'s default name).
    pub fn admit(&self, upper: &str, lower: &str, below: &Below) -> Result<(), Refused> {
        let derived = self.default_lower(upper) == lower;
        admit(self.mode, upper, lower, derived, below, &self.reserved)
    }

    /// The upper namespaces known.
    pub fn known(&self) -> impl Iterator<Item = &str> {
        self.forward.keys().map(String::as_str)
    }

    /// The lower namespace `upper` maps to now, if it is known.
    pub fn current(&self, upper: &str) -> Option<&str> {
        self.forward.get(upper).map(String::as_str)
    }

    /// The upper namespace that maps to `lower`, if any.
    pub fn owner_of(&self, lower: &str) -> Option<&str> {
        self.reverse.get(lower).map(String::as_str)
    }

    /// Maps `upper` to `lower`. `Err` names the upper namespace that maps there already.
    pub fn set(&mut self, upper: &str, lower: &str) -> Result<(), String> {
        if let Some(other) = self.reverse.get(lower).filter(|o| *o != upper) {
            return Err(other.clone());
        }
        self.remove(upper);
        self.forward.insert(upper.to_owned(), lower.to_owned());
        self.reverse.insert(lower.to_owned(), upper.to_owned());
        Ok(())
    }

    /// Forgets `upper` (its Namespace was deleted).
    pub fn remove(&mut self, upper: &str) {
        if let Some(lower) = self.forward.remove(upper) {
            self.reverse.remove(&lower);
        }
    }

    /// The default lower name of an upper namespace not (yet) known.
    fn default_lower(&self, upper: &str) -> String {
        desired(self.mode, upper, None, &self.suffix).0
    }

    /// The lower name of the namespace the controllers call `view`; `None` for an upper
    /// namespace not known yet (its annotation may say otherwise than the default: the
    /// caller retries once the Namespace watch has seen it).
    pub fn to_lower(&self, view: &str) -> Option<String> {
        if let Some(lower) = self.forward.get(view) {
            return Some(lower.clone());
        }
        if let Some(lower) = view.strip_suffix(UNMAPPED_SUFFIX) {
            return Some(lower.to_owned());
        }
        (self.mode == Mode::Same).then(|| view.to_owned())
    }

    /// The name the controllers see for the lower namespace `lower` (the inverse of
    /// [`Mapping::to_lower`]).
    pub fn to_view(&self, lower: &str) -> String {
        if let Some(upper) = self.reverse.get(lower) {
            return upper.clone();
        }
        // An upper namespace not known yet, named by the default rule.
        let candidate = match self.mode {
            Mode::Same | Mode::Annotation => Some(lower),
            Mode::Prefixed => lower
                .strip_suffix(self.suffix.as_str())
                .and_then(|l| l.strip_suffix('-')),
        };
        if let Some(upper) = candidate
            && !self.forward.contains_key(upper)
            && self.default_lower(upper) == lower
        {
            return upper.to_owned();
        }
        format!("{lower}{UNMAPPED_SUFFIX}")
    }
}

/// Whether `view` is how the controllers see a lower namespace no upper namespace maps to
/// ([`Mapping::to_view`]).
pub fn is_unmapped(view: &str) -> bool {
    view.ends_with(UNMAPPED_SUFFIX)
}

/// Whether a request path names the Namespace resource itself (`/api/v1/namespaces` or
/// `/api/v1/namespaces/<name>`, with a `status` or `finalize` subresource), whose objects'
/// names are namespace names.
pub fn is_namespace_path(path: &str) -> bool {
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    matches!(
        segments.as_slice(),
        ["api", "v1", "namespaces"]
            | ["api", "v1", "namespaces", _]
            | ["api", "v1", "namespaces", _, "status" | "finalize"]
    )
}

/// `path` with the namespace it names (`…/namespaces/<ns>/…`) rewritten by `map`;
/// `None` when it names none, `Some(Err(namespace))` when `map` knows no name for it.
pub fn rewrite_path(
    path: &str,
    map: impl Fn(&str) -> Option<String>,
) -> Option<Result<String, String>> {
    let segments: Vec<&str> = path.split('/').collect();
    // ["", "api", "v1", "namespaces", ns, ...] or ["", "apis", group, version, "namespaces", ns, ...]
    let at = match segments.get(1) {
        Some(&"api") => 3,
        Some(&"apis") => 4,
        _ => return None,
    };
    if segments.get(at) != Some(&"namespaces") {
        return None;
    }
    let namespace = segments.get(at + 1).filter(|s| !s.is_empty())?;
    let Some(mapped) = map(namespace) else {
        return Some(Err((*namespace).to_owned()));
    };
    let mut rewritten: Vec<String> = segments.iter().map(|s| (*s).to_owned()).collect();
    rewritten[at + 1] = mapped;
    Some(Ok(rewritten.join("/")))
}

/// Rewrites, by `map`, every namespace an object or a list of objects names: its own
/// (`metadata.namespace`; `metadata.name` too where `namespaces` says the objects are
/// Namespaces) and those of the objects it refers to (an Event's involved object, an
/// endpoint's target, a volume's claim).
pub fn rewrite_body(body: &mut Value, namespaces: bool, map: &dyn Fn(&str) -> String) {
    let kind = body["kind"].as_str().unwrap_or_default().to_owned();
    match body.get_mut("items").and_then(Value::as_array_mut) {
        Some(items) if kind.ends_with("List") => {
            let item_kind = kind.trim_end_matches("List").to_owned();
            for item in items {
                rewrite_object(item, &item_kind, namespaces, map);
            }
        }
        _ => rewrite_object(body, &kind, namespaces, map),
    }
}

/// A watch event's object ([`rewrite_body`] on `object`).
pub fn rewrite_event(event: &mut Value, namespaces: bool, map: &dyn Fn(&str) -> String) {
    if let Some(object) = event.get_mut("object") {
        rewrite_body(object, namespaces, map);
    }
}

fn rewrite_field(value: Option<&mut Value>, map: &dyn Fn(&str) -> String) {
    if let Some(field) = value
        && let Some(name) = field.as_str().filter(|n| !n.is_empty())
    {
        *field = Value::String(map(name));
    }
}

/// One object, of kind `kind` (items of a list carry none themselves).
fn rewrite_object(object: &mut Value, kind: &str, namespaces: bool, map: &dyn Fn(&str) -> String) {
    if kind == "Status" {
        return;
    }
    if let Some(meta) = object.get_mut("metadata") {
        rewrite_field(meta.get_mut("namespace"), map);
        if namespaces {
            rewrite_field(meta.get_mut("name"), map);
        }
    }
    let reference = |object: &mut Value, key: &str| {
        rewrite_field(
            object.get_mut(key).and_then(|r| r.get_mut("namespace")),
            map,
        );
    };
    match kind {
        "Event" => {
            for key in ["involvedObject", "regarding", "related"] {
                reference(object, key);
            }
        }
        "Endpoints" => {
            let subsets = object.get_mut("subsets").and_then(Value::as_array_mut);
            for subset in subsets.into_iter().flatten() {
                for key in ["addresses", "notReadyAddresses"] {
                    let addresses = subset.get_mut(key).and_then(Value::as_array_mut);
                    for address in addresses.into_iter().flatten() {
                        reference(address, "targetRef");
                    }
                }
            }
        }
        "EndpointSlice" => {
            let endpoints = object.get_mut("endpoints").and_then(Value::as_array_mut);
            for endpoint in endpoints.into_iter().flatten() {
                reference(endpoint, "targetRef");
            }
        }
        "PersistentVolume" => {
            if let Some(spec) = object.get_mut("spec") {
                reference(spec, "claimRef");
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn parses_the_mode() {
        assert_eq!("same".parse(), Ok(Mode::Same));
        assert_eq!("prefixed".parse(), Ok(Mode::Prefixed));
        assert_eq!("annotation".parse(), Ok(Mode::Annotation));
        assert!("Prefixed".parse::<Mode>().is_err());
    }

    #[test]
    fn shortens_the_cluster_identity() {
        let cases = [
            ("eu1", "eu1"),
            ("EU1", "eu1"),
            ("5b0c2f9e-1d4b-4a7e-9a43-0e9f2b7c8d11", "5b0c2f9e"),
        ];
        for (id, want) in cases {
            assert_eq!(cluster_suffix(id), want, "{id}");
        }
        let long = cluster_suffix("a-cluster-with-a-long-name");
        assert_eq!(long.len(), 8);
        assert_ne!(long, cluster_suffix("a-cluster-with-a-long-nam3"));
    }

    #[test]
    fn prefixes_within_63_characters() {
        assert_eq!(prefixed("shop", "5b0c2f9e"), "shop-5b0c2f9e");
        let long = "n".repeat(63);
        let other = format!("{}m", "n".repeat(62));
        let (a, b) = (prefixed(&long, "5b0c2f9e"), prefixed(&other, "5b0c2f9e"));
        for name in [&a, &b] {
            assert!(name.len() <= MAX_NAMESPACE, "{name}");
            assert!(is_namespace_name(name), "{name}");
            assert!(name.ends_with("-5b0c2f9e"), "{name}");
        }
        assert_ne!(a, b);
        // Lower namespaces are found by these names after an upgrade: the hash (FNV-1a,
        // not `std`'s hasher) must never change.
        assert_eq!(
            prefixed(&"n".repeat(63), "c1"),
            format!("{}-233bc6a9-c1", "n".repeat(51))
        );
    }

    #[test]
    fn chooses_the_lower_namespace() {
        // (mode, annotation, want, annotation refused)
        let cases = [
            (Mode::Same, None, "shop", false),
            (Mode::Same, Some("elsewhere"), "shop", false),
            (Mode::Prefixed, None, "shop-c1", false),
            (Mode::Prefixed, Some("elsewhere"), "elsewhere", false),
            (Mode::Prefixed, Some("Not_A_Name"), "shop-c1", true),
            (Mode::Annotation, None, "shop", false),
            (Mode::Annotation, Some("elsewhere"), "elsewhere", false),
        ];
        for (mode, annotation, want, refused) in cases {
            let (got, why) = desired(mode, "shop", annotation, "c1");
            assert_eq!(got, want, "{mode:?} {annotation:?}");
            assert_eq!(why.is_err(), refused, "{mode:?} {annotation:?}: {why:?}");
        }
    }

    #[test]
    fn admits_only_namespaces_of_this_upper_cluster() {
        let reserved = Reserved::new(["infra".to_owned()]);
        let ours = Below::Ours;
        let foreign = Below::Foreign("c2".into());
        let (absent, unmarked) = (Below::Absent, Below::Unmarked);
        // (mode, lower, derived, below, refused with)
        let cases = [
            // tensile-kube's mode maps each namespace to its own name, whatever is there.
            (Mode::Same, "kube-system", true, &unmarked, None),
            // An annotation naming a system namespace, join's, or one of the flag.
            (
                Mode::Annotation,
                "kube-system",
                false,
                &unmarked,
                Some("LowerNamespaceReserved"),
            ),
            (
                Mode::Prefixed,
                "kube-system",
                false,
                &unmarked,
                Some("LowerNamespaceReserved"),
            ),
            (
                Mode::Prefixed,
                "kube-public",
                false,
                &absent,
                Some("LowerNamespaceReserved"),
            ),
            (
                Mode::Prefixed,
                "tensile-system",
                false,
                &absent,
                Some("LowerNamespaceReserved"),
            ),
            (
                Mode::Prefixed,
                "tensile-system",
                false,
                &unmarked,
                Some("LowerNamespaceReserved"),
            ),
            (
                Mode::Annotation,
                "infra",
                false,
                &absent,
                Some("LowerNamespaceReserved"),
            ),
            // `annotation`'s default is the upper name: upper kube-system stays home.
            (
                Mode::Annotation,
                "kube-system",
                true,
                &unmarked,
                Some("LowerNamespaceReserved"),
            ),
            // `prefixed` derives `kube-system-c1`: tensile's own name.
            (Mode::Prefixed, "kube-system-c1", true, &absent, None),
            (Mode::Prefixed, "kube-system-c1", true, &ours, None),
            // Another upper cluster's namespace, chosen or derived (cluster ids with dashes).
            (
                Mode::Prefixed,
                "shop-c2",
                false,
                &foreign,
                Some("LowerNamespaceNotOurs"),
            ),
            (
                Mode::Prefixed,
                "shop-c1",
                true,
                &foreign,
                Some("LowerNamespaceNotOurs"),
            ),
            (
                Mode::Annotation,
                "shop",
                true,
                &foreign,
                Some("LowerNamespaceNotOurs"),
            ),
            // A namespace tensile did not make: an annotation may not choose it; a default
            // name may be one (`default` under `annotation`), as under `same`.
            (
                Mode::Annotation,
                "default",
                false,
                &unmarked,
                Some("LowerNamespaceNotOurs"),
            ),
            (
                Mode::Prefixed,
                "legacy",
                false,
                &unmarked,
                Some("LowerNamespaceNotOurs"),
            ),
            (Mode::Annotation, "default", true, &unmarked, None),
            // Free, or made by tensile for this upper cluster.
            (Mode::Prefixed, "elsewhere", false, &absent, None),
            (Mode::Annotation, "elsewhere", false, &ours, None),
        ];
        for (mode, lower, derived, below, want) in cases {
            let got = admit(mode, "up", lower, derived, below, &reserved);
            assert_eq!(
                got.as_ref().err().map(|r| r.reason),
                want,
                "{mode:?} {lower} derived {derived} {below:?}: {got:?}"
            );
            if let Err(refused) = got {
                assert!(refused.note.contains(lower), "{}", refused.note);
            }
        }
        assert!(Reserved::default().contains("kube-node-lease"));
        assert!(!Reserved::default().contains("kubeflow"));
        assert!(!Reserved::new([String::new()]).contains(""));
        assert_eq!(JOIN_NAMESPACE, crate::member::join::LOWER_NAMESPACE);
    }

    #[test]
    fn reads_the_marks_of_a_lower_namespace() {
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        let node = crate::translate::meta::OWNER_NODE_LABEL;
        let cases = [
            (labels(&[]), Below::Unmarked),
            // Made before cluster marks: whose is undecidable.
            (labels(&[(node, "vk")]), Below::Unmarked),
            (
                labels(&[(node, "vk"), (UPPER_CLUSTER_LABEL, "c1")]),
                Below::Ours,
            ),
            // Another member of this upper cluster made it: still this cluster's.
            (
                labels(&[(node, "other"), (UPPER_CLUSTER_LABEL, "c1")]),
                Below::Ours,
            ),
            (
                labels(&[(node, "vk"), (UPPER_CLUSTER_LABEL, "c2")]),
                Below::Foreign("c2".into()),
            ),
        ];
        for (labels, want) in cases {
            assert_eq!(Below::of(Some(&labels), "c1"), want, "{labels:?}");
        }
        assert_eq!(Below::of(None, "c1"), Below::Unmarked);
        let m = Mapping::new(Mode::Prefixed, "c1".into());
        assert!(
            m.admit("kube-system", "kube-system-c1", &Below::Absent)
                .is_ok()
        );
        assert!(m.admit("shop", "kube-system", &Below::Absent).is_err());
    }

    #[test]
    fn maps_both_ways_one_to_one() {
        let mut m = Mapping::new(Mode::Prefixed, "c1".into());
        m.set("shop", "shop-c1").unwrap();
        m.set("team", "team-elsewhere").unwrap();
        assert_eq!(m.set("other", "shop-c1"), Err("shop".into()), "taken");
        // (view, lower)
        let cases = [
            ("shop", "shop-c1"),
            ("team", "team-elsewhere"),
            // Lower namespaces no upper one maps to.
            ("kube-system.unmapped", "kube-system"),
            ("team-c1.unmapped", "team-c1"),
        ];
        for (view, lower) in cases {
            assert_eq!(m.to_lower(view).as_deref(), Some(lower), "{view}");
            assert_eq!(m.to_view(lower), view, "{lower}");
        }
        // An upper namespace not known yet: no lower name until it is (its annotation may
        // name one); a lower one of the default rule's shape reads as it.
        assert_eq!(m.to_lower("new"), None);
        assert_eq!(m.to_view("new-c1"), "new");
        m.remove("shop");
        assert_eq!(m.owner_of("shop-c1"), None);
        m.set("other", "shop-c1").unwrap();

        let mut a = Mapping::new(Mode::Annotation, String::new());
        a.set("team", "elsewhere").unwrap();
        a.set("plain", "plain").unwrap();
        for (view, lower) in [
            ("team", "elsewhere"),
            ("plain", "plain"),
            ("team.unmapped", "team"),
        ] {
            assert_eq!(a.to_lower(view).as_deref(), Some(lower), "{view}");
            assert_eq!(a.to_view(lower), view, "{lower}");
        }
        assert_eq!(a.to_view("other"), "other", "the default rule");
    }

    #[test]
    fn rewrites_paths() {
        let map = |ns: &str| (ns != "unknown").then(|| format!("{ns}-c1"));
        let ok = |p: &str| Some(Ok(p.to_owned()));
        let cases = [
            (
                "/api/v1/namespaces/shop/pods/web-0",
                ok("/api/v1/namespaces/shop-c1/pods/web-0"),
            ),
            ("/api/v1/namespaces/shop", ok("/api/v1/namespaces/shop-c1")),
            (
                "/apis/discovery.k8s.io/v1/namespaces/shop/endpointslices",
                ok("/apis/discovery.k8s.io/v1/namespaces/shop-c1/endpointslices"),
            ),
            (
                "/api/v1/namespaces/unknown/pods",
                Some(Err("unknown".to_owned())),
            ),
            ("/api/v1/namespaces", None),
            ("/api/v1/pods", None),
            ("/api/v1/nodes/n1/proxy/metrics/resource", None),
            ("/version", None),
        ];
        for (path, want) in cases {
            assert_eq!(rewrite_path(path, map), want, "{path}");
        }
        assert!(is_namespace_path("/api/v1/namespaces"));
        assert!(is_namespace_path("/api/v1/namespaces/shop"));
        assert!(!is_namespace_path("/api/v1/namespaces/shop/pods"));
    }

    #[test]
    fn rewrites_objects_and_what_they_refer_to() {
        let map = |ns: &str| ns.to_uppercase();
        let mut list = json!({"kind": "EventList", "items": [
            {"metadata": {"name": "e", "namespace": "shop"}, "involvedObject": {"kind": "Pod", "namespace": "shop", "name": "p"}},
        ]});
        rewrite_body(&mut list, false, &map);
        assert_eq!(list["items"][0]["metadata"]["namespace"], "SHOP");
        assert_eq!(list["items"][0]["metadata"]["name"], "e");
        assert_eq!(list["items"][0]["involvedObject"]["namespace"], "SHOP");

        let mut slice = json!({"kind": "EndpointSlice", "metadata": {"namespace": "shop"},
            "endpoints": [{"targetRef": {"kind": "Pod", "namespace": "shop"}}, {"addresses": ["10.0.0.1"]}]});
        rewrite_body(&mut slice, false, &map);
        assert_eq!(slice["endpoints"][0]["targetRef"]["namespace"], "SHOP");

        let mut endpoints = json!({"kind": "Endpoints", "metadata": {"namespace": "shop"},
            "subsets": [{"addresses": [{"targetRef": {"namespace": "shop"}}], "notReadyAddresses": [{"targetRef": {"namespace": "shop"}}]}]});
        rewrite_body(&mut endpoints, false, &map);
        assert_eq!(
            endpoints["subsets"][0]["addresses"][0]["targetRef"]["namespace"],
            "SHOP"
        );
        assert_eq!(
            endpoints["subsets"][0]["notReadyAddresses"][0]["targetRef"]["namespace"],
            "SHOP"
        );

        let mut pv = json!({"kind": "PersistentVolume", "metadata": {"name": "pv-1"},
            "spec": {"claimRef": {"namespace": "shop", "name": "data"}}});
        rewrite_body(&mut pv, false, &map);
        assert_eq!(pv["spec"]["claimRef"]["namespace"], "SHOP");
        assert_eq!(pv["metadata"]["name"], "pv-1");

        let mut namespace = json!({"kind": "Namespace", "metadata": {"name": "shop"}});
        rewrite_body(&mut namespace, true, &map);
        assert_eq!(namespace["metadata"]["name"], "SHOP");

        let mut event = json!({"type": "ADDED", "object": {"kind": "Pod", "metadata": {"namespace": "shop", "name": "p"}}});
        rewrite_event(&mut event, false, &map);
        assert_eq!(event["object"]["metadata"]["namespace"], "SHOP");

        let mut status = json!({"kind": "Status", "details": {"name": "p"}, "metadata": {}});
        let before = status.clone();
        rewrite_body(&mut status, false, &map);
        assert_eq!(status, before);
    }
}
