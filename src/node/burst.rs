//! What a member gives to bursting (pure): its burst priority (the order in which virtual
//! nodes fill, shown as a node label; the order in which their pods leave on scale-in, as
//! `controller.kubernetes.io/pod-deletion-cost`) and its share (a cap per resource on what
//! its node offers).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::quantity::{format_milli, milli, parse_milli};
use super::resources::Resources;

/// The node label carrying the member's burst priority (always present; `0` by default).
pub const BURST_PRIORITY_LABEL: &str = "tensile.dev/burst-priority";
/// Pod annotation: `eager` lets the pod burst as soon as a virtual node scores best by
/// room, instead of only what regular nodes cannot take (the webhook sets it for
/// `--eager-namespaces`, the scheduler extender reads it).
pub const BURST_ANNOTATION: &str = "tensile.dev/burst";
/// The value of [`BURST_ANNOTATION`] that opts into eager bursting.
pub const BURST_EAGER: &str = "eager";
/// The highest burst priority: deletion costs stay well inside `int32`.
pub const MAX_BURST_PRIORITY: u32 = 1_000_000;
/// The pod annotation the ReplicaSet controller orders scale-in by (lower goes first), and
/// beside it the value virtual-node wrote (a cost without it, or with another value, is
/// the user's and is never touched). Neither is copied below.
pub use crate::translate::meta::{DELETION_COST_ANNOTATION, DELETION_COST_MARK};

/// What a member gives to bursting; changes take effect on a running member.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Burst {
    /// Lower fills first and leaves last.
    pub priority: u32,
    /// Caps per resource (milli-units); a resource not named is not capped.
    pub share: Share,
}

/// Caps per resource name, in milli-units.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Share(pub BTreeMap<String, i128>);

/// Parses a burst priority: a whole number from 0 to [`MAX_BURST_PRIORITY`].
pub fn parse_priority(text: &str) -> Result<u32, String> {
    let priority: u64 = text
        .trim()
        .parse()
        .map_err(|_| format!("must be a whole number from 0 to {MAX_BURST_PRIORITY}"))?;
    u32::try_from(priority)
        .ok()
        .filter(|p| *p <= MAX_BURST_PRIORITY)
        .ok_or_else(|| format!("must be at most {MAX_BURST_PRIORITY}"))
}

/// Parses a share: `resource=quantity` pairs, comma-separated
/// (`cpu=64,memory=256Gi,pods=500,nvidia.com/gpu=4`); empty or `none` is no cap.
pub fn parse_share(text: &str) -> Result<Share, String> {
    let text = text.trim();
    let mut caps = BTreeMap::new();
    if text.is_empty() || text.eq_ignore_ascii_case("none") {
        return Ok(Share(caps));
    }
    for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (resource, amount) = pair
            .split_once('=')
            .ok_or_else(|| format!("{pair:?} must be resource=quantity"))?;
        let resource = resource.trim();
        if resource.is_empty() || resource.contains(char::is_whitespace) {
            return Err(format!("{pair:?}: the resource name is not one"));
        }
        let amount = parse_milli(amount)
            .ok_or_else(|| format!("{pair:?}: {:?} is not a quantity", amount.trim()))?;
        if amount < 0 {
            return Err(format!("{pair:?}: a share cannot be negative"));
        }
        if caps.insert(resource.to_owned(), amount).is_some() {
            return Err(format!("{resource} is named twice"));
        }
    }
    Ok(Share(caps))
}

impl Share {
    /// What the node offers under this share: per resource, the lower cluster's room
    /// (`offered`) or the cap, whichever is lower, never below zero. The upper scheduler
    /// subtracts the node's own pods from this itself, so a cap below what runs leaves no
    /// room and evicts nothing. A capped resource the lower cluster does not list is not
    /// added (there is none of it to share).
    pub fn cap(&self, offered: &BTreeMap<String, Quantity>) -> BTreeMap<String, Quantity> {
        offered
            .iter()
            .map(|(resource, amount)| {
                let room = milli(amount);
                let capped = match self.0.get(resource) {
                    Some(cap) => room.min(*cap),
                    None => room,
                };
                (resource.clone(), format_milli(capped.max(0)))
            })
            .collect()
    }

    /// What each of a member's virtual nodes (node granularity: one per group, `offered`
    /// by group key) offers under this share, the share spanning them all: per capped
    /// resource, when the groups' room adds up to more than the cap, the cap is split in
    /// proportion to each group's room (largest remainders first, ties in key order;
    /// whole units, except CPU in millicores), so the virtual nodes together never offer
    /// more than the cap; otherwise each offers its room. One group alone offers what
    /// [`Share::cap`] gives. Deterministic and pure: recomputed whenever the groups'
    /// offers or the share change.
    pub fn split<K: Ord + Clone>(
        &self,
        offered: &BTreeMap<K, BTreeMap<String, Quantity>>,
    ) -> BTreeMap<K, BTreeMap<String, Quantity>> {
        let mut parts: BTreeMap<K, BTreeMap<String, Quantity>> = offered
            .iter()
            .map(|(key, offer)| (key.clone(), self.cap(offer)))
            .collect();
        for (resource, &cap) in &self.0 {
            let rooms: Vec<(&K, i128)> = offered
                .iter()
                .filter_map(|(key, offer)| offer.get(resource).map(|q| (key, milli(q).max(0))))
                .collect();
            let total: i128 = rooms.iter().map(|(_, room)| room).sum();
            if rooms.len() < 2 || total <= cap {
                // What `cap` gave each: its room, or (alone) the cap.
                continue;
            }
            let unit: i128 = if resource == "cpu" { 1 } else { 1000 };
            let (cap_units, total_units) = (cap.max(0) / unit, total / unit);
            let units: Vec<(&K, i128)> = rooms.iter().map(|(k, room)| (*k, room / unit)).collect();
            // Each group's floor of its proportional part, and what the floor left out.
            let mut shares: Vec<(&K, i128, i128)> = units
                .iter()
                .map(|(key, room)| {
                    let (part, left) = proportion(*room, cap_units, total_units);
                    (*key, part, left)
                })
                .collect();
            let given: i128 = shares.iter().map(|(_, part, _)| part).sum();
            let mut order: Vec<usize> = (0..shares.len()).collect();
            // Stable: equal remainders keep key order.
            order.sort_by(|a, b| shares[*b].2.cmp(&shares[*a].2));
            let extra = usize::try_from((cap_units.min(total_units) - given).max(0)).unwrap_or(0);
            for &i in order.iter().take(extra) {
                shares[i].1 += 1;
            }
            for (key, part, _) in shares {
                if let Some(offer) = parts.get_mut(key) {
                    offer.insert(resource.clone(), format_milli(part * unit));
                }
            }
        }
        parts
    }

    /// The caps, as the Resources arithmetic has them.
    pub fn caps(&self) -> &Resources {
        &self.0
    }
}

/// `room * cap / total` rounded down, and the remainder of that division (which orders
/// who gets the units the rounding left over). Nothing when `total` is not a whole unit:
/// room that sums below one unit over the groups (`500m` pods) has no unit to split.
fn proportion(room: i128, cap: i128, total: i128) -> (i128, i128) {
    if total <= 0 {
        return (0, 0);
    }
    match room.checked_mul(cap) {
        Some(product) => (product / total, product % total),
        // Beyond any real quantity; approximate rather than fail.
        None => {
            #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
            let part = (room as f64 * cap as f64 / total as f64) as i128;
            (part.min(room), 0)
        }
    }
}

/// The deletion cost of a burst pod of a member of `priority`: below any pod's default 0,
/// lower for a higher priority (the last-filled member's pods leave first).
pub fn deletion_cost(priority: u32) -> i32 {
    i32::try_from(i64::from(priority) + 1)
        .map(|c| -c)
        .unwrap_or(i32::MIN)
}

/// The deletion cost to write on an upper pod with `annotations` (its cost and the mark
/// of ours), if one is to be written: where it has none, or ours from another priority.
/// A cost the user set (no mark, or a mark that is not its value) is kept.
pub fn deletion_cost_to_write(
    cost: Option<&str>,
    mark: Option<&str>,
    priority: u32,
) -> Option<i32> {
    let want = deletion_cost(priority);
    match (cost, mark) {
        (None, _) => Some(want),
        (Some(cost), Some(mark)) if cost.trim() == mark.trim() => {
            (cost.trim() != want.to_string()).then_some(want)
        }
        _ => None,
    }
}

/// `patch` (a merge or strategic merge patch of an upper pod) with deletion cost `cost`
/// written too, marked as virtual-node's: folded into the first status write of a burst
/// pod (the pods/status subresource takes annotations), so that the cost costs no write
/// of its own. Pure.
pub fn with_deletion_cost(mut patch: serde_json::Value, cost: i32) -> serde_json::Value {
    let cost = cost.to_string();
    if let Some(patch) = patch.as_object_mut() {
        let metadata = patch
            .entry("metadata")
            .or_insert_with(|| serde_json::json!({}));
        if let Some(metadata) = metadata.as_object_mut() {
            let annotations = metadata
                .entry("annotations")
                .or_insert_with(|| serde_json::json!({}));
            if let Some(annotations) = annotations.as_object_mut() {
                annotations.insert(DELETION_COST_ANNOTATION.into(), cost.clone().into());
                annotations.insert(DELETION_COST_MARK.into(), cost.into());
            }
        }
    }
    patch
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deletion_cost_joins_a_patch() {
        use serde_json::json;
        let both = json!({DELETION_COST_ANNOTATION: "-3", DELETION_COST_MARK: "-3"});
        // (case, patch, written)
        let cases = [
            (
                "a status patch with its UID precondition",
                json!({"metadata": {"uid": "u1"}, "status": {"phase": "Running"}}),
                json!({"metadata": {"uid": "u1", "annotations": both.clone()},
                       "status": {"phase": "Running"}}),
            ),
            (
                "other annotations kept",
                json!({"metadata": {"annotations": {"a": "1"}}}),
                json!({"metadata": {"annotations": {"a": "1", DELETION_COST_ANNOTATION: "-3",
                                                    DELETION_COST_MARK: "-3"}}}),
            ),
            (
                "no metadata yet",
                json!({"status": {}}),
                json!({"metadata": {"annotations": both}, "status": {}}),
            ),
        ];
        for (case, patch, want) in cases {
            assert_eq!(with_deletion_cost(patch, -3), want, "{case}");
        }
    }

    #[test]
    fn priorities_parse() {
        let cases = [
            ("0", Ok(0)),
            (" 7 ", Ok(7)),
            ("1000000", Ok(MAX_BURST_PRIORITY)),
            ("1000001", Err("at most 1000000")),
            ("99999999999", Err("at most")),
            ("-1", Err("whole number")),
            ("1.5", Err("whole number")),
            ("", Err("whole number")),
        ];
        for (text, want) in cases {
            match (parse_priority(text), want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{text:?}"),
                (Err(e), Err(needle)) => assert!(e.contains(needle), "{text:?}: {e}"),
                (got, want) => panic!("{text:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn shares_parse() {
        type Want = Result<&'static [(&'static str, i128)], &'static str>;
        let cases: [(&str, Want); 9] = [
            ("", Ok(&[])),
            ("none", Ok(&[])),
            (
                "cpu=64, memory=1Gi,pods=500,nvidia.com/gpu=4",
                Ok(&[
                    ("cpu", 64_000),
                    ("memory", 1_073_741_824_000),
                    ("nvidia.com/gpu", 4000),
                    ("pods", 500_000),
                ]),
            ),
            ("cpu=500m,", Ok(&[("cpu", 500)])),
            ("cpu=0", Ok(&[("cpu", 0)])),
            ("cpu", Err("resource=quantity")),
            ("cpu=lots", Err("not a quantity")),
            ("cpu=-1", Err("cannot be negative")),
            ("cpu=1,cpu=2", Err("named twice")),
        ];
        for (text, want) in cases {
            match (parse_share(text), want) {
                (Ok(got), Ok(want)) => {
                    let want: BTreeMap<String, i128> =
                        want.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect();
                    assert_eq!(got.0, want, "{text:?}");
                }
                (Err(e), Err(needle)) => assert!(e.contains(needle), "{text:?}: {e}"),
                (got, want) => panic!("{text:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    fn list(pairs: &[(&str, &str)]) -> BTreeMap<String, Quantity> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Quantity((*v).to_owned())))
            .collect()
    }

    #[test]
    fn a_share_caps_what_the_node_offers() {
        // (case, share, lower room, offered)
        type Pairs = &'static [(&'static str, &'static str)];
        let cases: [(&str, &str, Pairs, Pairs); 6] = [
            (
                "no share",
                "",
                &[("cpu", "8"), ("example.com/foo", "3")],
                &[("cpu", "8"), ("example.com/foo", "3")],
            ),
            (
                "cap below the room",
                "cpu=2,nvidia.com/gpu=1",
                &[("cpu", "8"), ("memory", "4Gi"), ("nvidia.com/gpu", "4")],
                &[
                    ("cpu", "2"),
                    ("memory", "4294967296"),
                    ("nvidia.com/gpu", "1"),
                ],
            ),
            (
                "room below the cap (today's rule)",
                "cpu=64",
                &[("cpu", "1500m")],
                &[("cpu", "1500m")],
            ),
            ("a cap of zero", "cpu=0", &[("cpu", "8")], &[("cpu", "0")]),
            (
                "a capped resource the lower cluster lacks is not added",
                "nvidia.com/gpu=4",
                &[("cpu", "8")],
                &[("cpu", "8")],
            ),
            (
                "extended resources capped like cpu",
                "example.com/foo=2",
                &[("example.com/foo", "5"), ("pods", "110")],
                &[("example.com/foo", "2"), ("pods", "110")],
            ),
        ];
        for (case, share, room, want) in cases {
            let share = parse_share(share).unwrap();
            assert_eq!(share.cap(&list(room)), list(want), "{case}");
        }
    }

    /// A member's share spans all its virtual nodes: the cap is split in proportion to
    /// each group's room when they would offer more together, and one group alone gets
    /// exactly what `cap` gives it (the `cluster` result).
    #[test]
    fn a_share_spans_all_of_a_members_virtual_nodes() {
        let share = |text: &str| parse_share(text).unwrap();
        let groups =
            |offers: &[(&str, &[(&str, &str)])]| -> BTreeMap<String, BTreeMap<String, Quantity>> {
                offers
                    .iter()
                    .map(|(key, pairs)| ((*key).to_owned(), list(pairs)))
                    .collect()
            };
        // (case, share, offers by group, what each offers)
        type Offers<'a> = &'a [(&'a str, &'a [(&'a str, &'a str)])];
        let cases: &[(&str, &str, Offers, Offers)] = &[
            (
                "no cap: each its room",
                "",
                &[("a", &[("cpu", "4")]), ("b", &[("cpu", "8")])],
                &[("a", &[("cpu", "4")]), ("b", &[("cpu", "8")])],
            ),
            (
                "room under the cap: each its room",
                "cpu=16",
                &[("a", &[("cpu", "4")]), ("b", &[("cpu", "8")])],
                &[("a", &[("cpu", "4")]), ("b", &[("cpu", "8")])],
            ),
            (
                "the cap split by room, 1:2",
                "cpu=6,memory=3Gi",
                &[
                    ("a", &[("cpu", "4"), ("memory", "4Gi"), ("pods", "110")]),
                    ("b", &[("cpu", "8"), ("memory", "8Gi"), ("pods", "110")]),
                ],
                &[
                    (
                        "a",
                        &[("cpu", "2"), ("memory", "1073741824"), ("pods", "110")],
                    ),
                    (
                        "b",
                        &[("cpu", "4"), ("memory", "2147483648"), ("pods", "110")],
                    ),
                ],
            ),
            (
                "millicores for CPU, the rounding's leftover to the largest remainder",
                "cpu=1",
                &[
                    ("a", &[("cpu", "1")]),
                    ("b", &[("cpu", "1")]),
                    ("c", &[("cpu", "1")]),
                ],
                &[
                    ("a", &[("cpu", "334m")]),
                    ("b", &[("cpu", "333m")]),
                    ("c", &[("cpu", "333m")]),
                ],
            ),
            (
                "whole units otherwise: ties in key order",
                "pods=5",
                &[("a", &[("pods", "10")]), ("b", &[("pods", "10")])],
                &[("a", &[("pods", "3")]), ("b", &[("pods", "2")])],
            ),
            (
                "a group with no room gets none",
                "cpu=2",
                &[("a", &[("cpu", "0")]), ("b", &[("cpu", "8")])],
                &[("a", &[("cpu", "0")]), ("b", &[("cpu", "2")])],
            ),
            (
                "a zero cap",
                "cpu=0",
                &[("a", &[("cpu", "4")]), ("b", &[("cpu", "8")])],
                &[("a", &[("cpu", "0")]), ("b", &[("cpu", "0")])],
            ),
            (
                "room below one unit over the groups, a zero cap: none, no division by zero",
                "pods=0",
                &[("a", &[("pods", "500m")]), ("b", &[("pods", "0")])],
                &[("a", &[("pods", "0")]), ("b", &[("pods", "0")])],
            ),
            (
                "room below one unit in all, a cap below it: none",
                "pods=300m",
                &[("a", &[("pods", "400m")]), ("b", &[("pods", "400m")])],
                &[("a", &[("pods", "0")]), ("b", &[("pods", "0")])],
            ),
            (
                "room summing to a unit, a cap below it: none",
                "pods=500m",
                &[("a", &[("pods", "600m")]), ("b", &[("pods", "600m")])],
                &[("a", &[("pods", "0")]), ("b", &[("pods", "0")])],
            ),
            (
                "a capped resource one group lacks is not added to it",
                "nvidia.com/gpu=2",
                &[("a", &[("nvidia.com/gpu", "4")]), ("b", &[("cpu", "8")])],
                &[("a", &[("nvidia.com/gpu", "2")]), ("b", &[("cpu", "8")])],
            ),
        ];
        for (case, text, offers, want) in cases {
            let share = share(text);
            let offered = groups(offers);
            let got = share.split(&offered);
            assert_eq!(got, groups(want), "{case}");
            for (resource, cap) in share.caps() {
                let sum: i128 = got
                    .values()
                    .filter_map(|o| o.get(resource))
                    .map(milli)
                    .sum();
                assert!(sum <= *cap, "{case}: {resource} {sum} over the cap {cap}");
            }
        }
        // One group: what `cap` gives, byte for byte (the cluster's result).
        for text in ["", "cpu=2", "cpu=1500m,memory=1.5", "pods=0"] {
            let share = share(text);
            let alone = groups(&[("only", &[("cpu", "4"), ("memory", "8Gi"), ("pods", "110")])]);
            assert_eq!(
                share.split(&alone)["only"],
                share.cap(&alone["only"]),
                "{text}"
            );
        }
    }

    #[test]
    fn deletion_costs_order_members_and_keep_the_users() {
        assert_eq!(deletion_cost(0), -1);
        assert_eq!(deletion_cost(2), -3);
        assert_eq!(deletion_cost(MAX_BURST_PRIORITY), -1_000_001);
        assert_eq!(deletion_cost(u32::MAX), i32::MIN);
        // (case, cost, mark, priority, to write)
        let cases = [
            ("none yet", None, None, 1, Some(-2)),
            ("ours, current", Some("-2"), Some("-2"), 1, None),
            (
                "ours, priority changed",
                Some("-2"),
                Some("-2"),
                4,
                Some(-5),
            ),
            ("the user's", Some("100"), None, 1, None),
            ("the user's over ours", Some("100"), Some("-2"), 1, None),
            ("a mark without a cost", None, Some("-2"), 1, Some(-2)),
        ];
        for (case, cost, mark, priority, want) in cases {
            assert_eq!(deletion_cost_to_write(cost, mark, priority), want, "{case}");
        }
    }
}
