//! What a member Secret says (pure): the label that makes a Secret a member, the key
//! holding its kubeconfig, and the annotations that set what may differ between members.
//!
//! ```yaml
//! apiVersion: v1
//! kind: Secret
//! metadata:
//!   name: lower-a                      # the node's name unless annotated
//!   namespace: tensile-system          # --members-namespace
//!   labels: { tensile.dev/lower-cluster: "true" }
//!   annotations:
//!     tensile.dev/node-name: vk-a              # optional
//!     tensile.dev/taint: "virtual-kubelet.io/provider=k8s:NoSchedule"   # or "none"
//!     tensile.dev/ignore-labels: "a,b"         # optional
//!     tensile.dev/kubelet-port: "10251"        # optional; default any free port
//!     tensile.dev/client-qps: "500"            # optional
//!     tensile.dev/client-burst: "1000"         # optional
//!     tensile.dev/burst-priority: "1"          # optional; default 0 (fills first)
//!     tensile.dev/share: "cpu=64,memory=256Gi" # optional; default no cap
//!     tensile.dev/node-granularity: cluster    # optional; or node, label=<key>
//!     tensile.dev/lower-node-labels: "example.com/pool,gpu-*"  # optional
//! data: { kubeconfig: <base64 kubeconfig of the lower cluster> }
//! ```
//!
//! The kubeconfig is taken as `join` writes it and no further: credentials inline (a
//! bearer `token`, or `client-certificate-data` and `client-key-data`), the CA inline
//! (`certificate-authority-data`). Whoever may create a Secret in the members namespace
//! must not get virtual-node to run a command (`exec`, `auth-provider`), read one of its
//! files (`tokenFile`, `client-certificate`, `client-key`, `certificate-authority`: its
//! own ServiceAccount token among them) or send anything but the Secret's own credentials
//! ([`lower_kubeconfig`], [`Trust::FromSecret`]: the check the scheduler extender makes of
//! the kubeconfigs it is given from Secrets too). The single-cluster `--client-kubeconfig`
//! is the operator's own file and is read as it is ([`Trust::Operator`]).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Secret, Taint};
use kube::config::Kubeconfig;

use crate::cli::{MIN_QPS, parse_node_name};
use crate::clusters::{BadKubeconfig, Trust, read_kubeconfig};
use crate::node::burst::{Burst, parse_priority, parse_share};
pub use crate::node::groups::{GRANULARITY_ANNOTATION, LOWER_NODE_LABELS_ANNOTATION};
use crate::node::groups::{Granularity, LabelPatterns, parse_granularity, parse_label_patterns};

/// The label that makes a Secret of `--members-namespace` a member.
pub const MEMBER_LABEL: &str = "tensile.dev/lower-cluster";
/// The Secret key holding the lower cluster's kubeconfig.
pub const KUBECONFIG_KEY: &str = "kubeconfig";
/// The node's name (default: the Secret's name).
pub const NODE_NAME_ANNOTATION: &str = "tensile.dev/node-name";
/// The node's taint as `key[=value]:Effect`, or `none` (default: the flags').
pub const TAINT_ANNOTATION: &str = "tensile.dev/taint";
/// Comma-separated labels moved into `tripped-labels` (default: `--ignore-labels`).
pub const IGNORE_LABELS_ANNOTATION: &str = "tensile.dev/ignore-labels";
/// The member's kubelet API port (default: any free one; the Node says which).
pub const KUBELET_PORT_ANNOTATION: &str = "tensile.dev/kubelet-port";
/// Requests per second to the lower cluster (default: `--client-qps`).
pub const CLIENT_QPS_ANNOTATION: &str = "tensile.dev/client-qps";
/// Burst to the lower cluster (default: `--client-burst`).
pub const CLIENT_BURST_ANNOTATION: &str = "tensile.dev/client-burst";
/// The member's burst priority: virtual nodes fill lowest first, and their pods leave
/// highest first (default 0). Changed on a running member, it takes effect in place.
pub const BURST_PRIORITY_ANNOTATION: &str = "tensile.dev/burst-priority";
/// Caps on what the member's node offers, `resource=quantity,...` (default: none).
/// Changed on a running member, it takes effect in place.
pub const SHARE_ANNOTATION: &str = "tensile.dev/share";
/// The member annotation giving each of its virtual nodes a kubelet port of its own from a
/// range (`FROM-TO`), as `--kubelet-port-range` does for the flags' member: with `node` or
/// `label=<key>` granularity, `kubectl top node` then shows each.
pub const KUBELET_PORT_RANGE_ANNOTATION: &str = "tensile.dev/kubelet-port-range";
/// Held on a member Secret while its member runs, so deleting the Secret makes the member
/// leave (drain, clean up below, delete the Node) before the Secret goes, even across a
/// restart of virtual-node.
pub const MEMBER_FINALIZER: &str = "tensile.dev/member";

/// What a member takes from the flags unless its Secret says otherwise.
#[derive(Clone, Debug, PartialEq)]
pub struct Defaults {
    /// The flags' taint (`None` with `--disable-taint`).
    pub taint: Option<Taint>,
    /// `--ignore-labels`.
    pub ignore_labels: Vec<String>,
    /// `--client-qps`.
    pub qps: f64,
    /// `--client-burst`.
    pub burst: u32,
}

/// A member Secret, read.
#[derive(Clone, Debug, PartialEq)]
pub struct MemberSecret {
    /// The virtual node's name.
    pub node: String,
    /// The lower cluster's kubeconfig (YAML).
    pub kubeconfig: String,
    /// The node's taint.
    pub taint: Option<Taint>,
    /// Labels moved into `tripped-labels`.
    pub ignore_labels: Vec<String>,
    /// The kubelet API port (0: any).
    pub kubelet_port: u16,
    /// Requests per second to the lower cluster.
    pub qps: f64,
    /// Burst to the lower cluster.
    pub burst: u32,
    /// Burst priority and share: the settings a running member takes in place.
    pub bursting: Burst,
    /// One virtual node for the cluster, per lower node, or per value of a lower node
    /// label ([`GRANULARITY_ANNOTATION`]; default `cluster`).
    pub granularity: Granularity,
    /// Lower node labels a group's virtual node shows beside the documented ones
    /// ([`LOWER_NODE_LABELS_ANNOTATION`]; default none).
    pub lower_node_labels: LabelPatterns,
    /// A kubelet port per virtual node ([`KUBELET_PORT_RANGE_ANNOTATION`]; default none).
    pub kubelet_port_range: Option<crate::kubelet_api::node_ports::PortRange>,
}

/// Why a member Secret cannot be used; said in an Event on it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadMember {
    /// No `kubeconfig` key.
    #[error("has no data key {KUBECONFIG_KEY:?} holding the lower cluster's kubeconfig")]
    NoKubeconfig,
    /// The kubeconfig is not UTF-8 text.
    #[error("its {KUBECONFIG_KEY:?} is not UTF-8 text")]
    NotText,
    /// An annotation's value is malformed.
    #[error("annotation {annotation}={value:?}: {why}")]
    Annotation {
        /// Which.
        annotation: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        why: String,
    },
    /// The node name is not a valid one.
    #[error("node name {name:?}: {why}")]
    NodeName {
        /// The name.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// The kubeconfig is not one, or asks for more than a kubeconfig from a Secret may
    /// ([`Trust::FromSecret`]): a command run, a file read, or credentials other than its
    /// own inline ones. Quotes none of it.
    #[error("its {KUBECONFIG_KEY:?} {0}")]
    Kubeconfig(#[from] BadKubeconfig),
}

/// Reads the kubeconfig of a member Secret: written by whoever may write the Secret, it
/// is read as [`Trust::FromSecret`] (what `join` writes: inline credentials and CA), the
/// same check every kubeconfig from a Secret passes ([`crate::clusters::read_kubeconfig`]).
pub fn lower_kubeconfig(text: &str) -> Result<Kubeconfig, BadMember> {
    Ok(read_kubeconfig(text, Trust::FromSecret)?)
}

/// The node a member Secret names (its annotation, else the Secret's name), unchecked.
pub fn node_name(secret: &Secret) -> String {
    secret
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(NODE_NAME_ANNOTATION))
        .map(|n| n.trim())
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .or_else(|| secret.metadata.name.clone())
        .unwrap_or_default()
}

/// Reads member Secret `secret` with `defaults` for what it does not say.
pub fn read(secret: &Secret, defaults: &Defaults) -> Result<MemberSecret, BadMember> {
    let empty = BTreeMap::new();
    let annotations = secret.metadata.annotations.as_ref().unwrap_or(&empty);
    let annotation = |key: &str| annotations.get(key).map(|v| v.trim());
    let name = node_name(secret);
    let node = parse_node_name(&name).map_err(|why| BadMember::NodeName { name, why })?;
    let kubeconfig = secret
        .data
        .as_ref()
        .and_then(|d| d.get(KUBECONFIG_KEY))
        .map(|b| String::from_utf8(b.0.clone()).map_err(|_| BadMember::NotText))
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(KUBECONFIG_KEY))
                .cloned()
                .map(Ok)
        })
        .ok_or(BadMember::NoKubeconfig)??;
    if kubeconfig.trim().is_empty() {
        return Err(BadMember::NoKubeconfig);
    }
    let bad = |annotation: &'static str, value: &str, why: String| BadMember::Annotation {
        annotation,
        value: value.to_owned(),
        why,
    };
    let taint = match annotation(TAINT_ANNOTATION) {
        None => defaults.taint.clone(),
        Some(value) => parse_taint(value).map_err(|why| bad(TAINT_ANNOTATION, value, why))?,
    };
    let ignore_labels = match annotation(IGNORE_LABELS_ANNOTATION) {
        None => defaults.ignore_labels.clone(),
        Some(value) => value
            .split(',')
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect(),
    };
    let kubelet_port = match annotation(KUBELET_PORT_ANNOTATION) {
        None => 0,
        Some(value) => value
            .parse::<u16>()
            .map_err(|e| bad(KUBELET_PORT_ANNOTATION, value, e.to_string()))?,
    };
    let qps = match annotation(CLIENT_QPS_ANNOTATION) {
        None => defaults.qps,
        Some(value) => match value.parse::<f64>() {
            // Below MIN_QPS the limiter's window overflows a timer (1e-30 panicked).
            Ok(qps) if qps.is_finite() && (qps == 0.0 || qps >= MIN_QPS) => qps,
            _ => {
                return Err(bad(
                    CLIENT_QPS_ANNOTATION,
                    value,
                    format!("must be 0 (unlimited) or a number of at least {MIN_QPS}"),
                ));
            }
        },
    };
    let burst = match annotation(CLIENT_BURST_ANNOTATION) {
        None => defaults.burst,
        Some(value) => match value.parse::<u32>() {
            Ok(burst) if burst > 0 => burst,
            _ => {
                return Err(bad(
                    CLIENT_BURST_ANNOTATION,
                    value,
                    "must be a whole number, 1 or more".into(),
                ));
            }
        },
    };
    let priority = match annotation(BURST_PRIORITY_ANNOTATION) {
        None => 0,
        Some(value) => {
            parse_priority(value).map_err(|why| bad(BURST_PRIORITY_ANNOTATION, value, why))?
        }
    };
    let share = match annotation(SHARE_ANNOTATION) {
        None => Default::default(),
        Some(value) => parse_share(value).map_err(|why| bad(SHARE_ANNOTATION, value, why))?,
    };
    let granularity = match annotation(GRANULARITY_ANNOTATION) {
        None => Granularity::Cluster,
        Some(value) => {
            parse_granularity(value).map_err(|why| bad(GRANULARITY_ANNOTATION, value, why))?
        }
    };
    let lower_node_labels = match annotation(LOWER_NODE_LABELS_ANNOTATION) {
        None => LabelPatterns::default(),
        Some(value) => parse_label_patterns(value)
            .map_err(|why| bad(LOWER_NODE_LABELS_ANNOTATION, value, why))?,
    };
    let kubelet_port_range = annotation(KUBELET_PORT_RANGE_ANNOTATION)
        .map(|value| {
            crate::kubelet_api::node_ports::parse_port_range(value)
                .map_err(|why| bad(KUBELET_PORT_RANGE_ANNOTATION, value, why))
        })
        .transpose()?;
    Ok(MemberSecret {
        bursting: Burst { priority, share },
        granularity,
        lower_node_labels,
        kubelet_port_range,
        node,
        kubeconfig,
        taint,
        ignore_labels,
        kubelet_port,
        qps,
        burst,
    })
}

/// `key[=value]:Effect`, or `none` for no taint.
pub fn parse_taint(value: &str) -> Result<Option<Taint>, String> {
    if value.eq_ignore_ascii_case("none") {
        return Ok(None);
    }
    let (key_value, effect) = value
        .rsplit_once(':')
        .ok_or("must be key[=value]:Effect, or none")?;
    if !matches!(effect, "NoSchedule" | "PreferNoSchedule" | "NoExecute") {
        return Err(format!(
            "effect {effect:?} must be NoSchedule, PreferNoSchedule or NoExecute"
        ));
    }
    let (key, taint_value) = match key_value.split_once('=') {
        Some((key, value)) => (key, Some(value.to_owned())),
        None => (key_value, None),
    };
    if key.is_empty() {
        return Err("the key is empty".into());
    }
    Ok(Some(Taint {
        key: key.to_owned(),
        value: taint_value,
        effect: effect.to_owned(),
        time_added: None,
    }))
}

/// Whether `secret` is a member Secret (carries the member label).
pub fn is_member(secret: &Secret) -> bool {
    secret
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(MEMBER_LABEL))
        .is_some_and(|v| v == "true")
}

#[cfg(test)]
mod tests {
    use k8s_openapi::ByteString;

    use super::*;

    fn defaults() -> Defaults {
        Defaults {
            taint: Some(Taint {
                key: "virtual-kubelet.io/provider".into(),
                value: Some("k8s".into()),
                effect: "NoSchedule".into(),
                time_added: None,
            }),
            ignore_labels: vec!["pod-group.scheduling.sigs.k8s.io".into()],
            qps: 500.0,
            burst: 1000,
        }
    }

    fn secret(name: &str, annotations: &[(&str, &str)], kubeconfig: Option<&[u8]>) -> Secret {
        let mut secret = Secret::default();
        secret.metadata.name = Some(name.into());
        secret.metadata.annotations = Some(
            annotations
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        );
        secret.data = kubeconfig.map(|k| {
            [(KUBECONFIG_KEY.to_owned(), ByteString(k.to_vec()))]
                .into_iter()
                .collect()
        });
        secret
    }

    #[test]
    fn a_member_secret_reads_as_its_annotations_say() {
        let config: &[u8] = b"apiVersion: v1\nkind: Config\n";
        let d = defaults();
        // (case, secret, want node / taint key / ignore labels / port / qps / burst, or the error)
        type Want = Result<
            (
                &'static str,
                Option<&'static str>,
                Vec<&'static str>,
                u16,
                f64,
                u32,
            ),
            &'static str,
        >;
        let cases: Vec<(&str, Secret, Want)> = vec![
            (
                "defaults",
                secret("lower-a", &[], Some(config)),
                Ok((
                    "lower-a",
                    Some("virtual-kubelet.io/provider"),
                    vec!["pod-group.scheduling.sigs.k8s.io"],
                    0,
                    500.0,
                    1000,
                )),
            ),
            (
                "annotated",
                secret(
                    "lower-a",
                    &[
                        (NODE_NAME_ANNOTATION, "vk-a"),
                        (TAINT_ANNOTATION, "burst=yes:NoExecute"),
                        (IGNORE_LABELS_ANNOTATION, "a, b,,"),
                        (KUBELET_PORT_ANNOTATION, "10251"),
                        (CLIENT_QPS_ANNOTATION, "50"),
                        (CLIENT_BURST_ANNOTATION, "100"),
                    ],
                    Some(config),
                ),
                Ok(("vk-a", Some("burst"), vec!["a", "b"], 10251, 50.0, 100)),
            ),
            (
                "no taint",
                secret("lower-a", &[(TAINT_ANNOTATION, "none")], Some(config)),
                Ok((
                    "lower-a",
                    None,
                    vec!["pod-group.scheduling.sigs.k8s.io"],
                    0,
                    500.0,
                    1000,
                )),
            ),
            (
                "no kubeconfig",
                secret("lower-a", &[], None),
                Err("has no data key"),
            ),
            (
                "empty kubeconfig",
                secret("lower-a", &[], Some(b"  ")),
                Err("has no data key"),
            ),
            (
                "binary kubeconfig",
                secret("lower-a", &[], Some(&[0xff, 0xfe])),
                Err("not UTF-8"),
            ),
            (
                "bad node name",
                secret("Lower_A", &[], Some(config)),
                Err("node name \"Lower_A\""),
            ),
            (
                "bad annotated name",
                secret("ok", &[(NODE_NAME_ANNOTATION, "-x")], Some(config)),
                Err("node name \"-x\""),
            ),
            (
                "bad taint",
                secret("a", &[(TAINT_ANNOTATION, "k=v:Sometimes")], Some(config)),
                Err("tensile.dev/taint"),
            ),
            (
                "taint without effect",
                secret("a", &[(TAINT_ANNOTATION, "k=v")], Some(config)),
                Err("key[=value]:Effect"),
            ),
            (
                "bad port",
                secret("a", &[(KUBELET_PORT_ANNOTATION, "70000")], Some(config)),
                Err("tensile.dev/kubelet-port"),
            ),
            (
                "bad qps",
                secret("a", &[(CLIENT_QPS_ANNOTATION, "-1")], Some(config)),
                Err("tensile.dev/client-qps"),
            ),
            (
                "qps too small for a limiter",
                secret("a", &[(CLIENT_QPS_ANNOTATION, "1e-30")], Some(config)),
                Err("at least 0.01"),
            ),
            (
                "bad burst",
                secret("a", &[(CLIENT_BURST_ANNOTATION, "0")], Some(config)),
                Err("tensile.dev/client-burst"),
            ),
        ];
        for (case, secret, want) in cases {
            let got = read(&secret, &d);
            match (got, want) {
                (Ok(got), Ok((node, taint, ignore, port, qps, burst))) => {
                    assert_eq!(got.node, node, "{case}");
                    assert_eq!(got.taint.as_ref().map(|t| t.key.as_str()), taint, "{case}");
                    assert_eq!(got.ignore_labels, ignore, "{case}");
                    assert_eq!(got.kubelet_port, port, "{case}");
                    assert!((got.qps - qps).abs() < f64::EPSILON, "{case}");
                    assert_eq!(got.burst, burst, "{case}");
                    assert_eq!(got.kubeconfig.as_bytes(), config, "{case}");
                }
                (Err(error), Err(needle)) => {
                    assert!(error.to_string().contains(needle), "{case}: {error}");
                }
                (got, want) => panic!("{case}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn burst_priority_and_share_read_from_their_annotations() {
        let config: &[u8] = b"apiVersion: v1\nkind: Config\n";
        // (case, annotations, priority and cpu cap, or the error)
        type Want = Result<(u32, Option<i128>), &'static str>;
        type Case = (&'static str, Vec<(&'static str, &'static str)>, Want);
        let cases: [Case; 5] = [
            ("defaults", vec![], Ok((0, None))),
            (
                "both",
                vec![
                    (BURST_PRIORITY_ANNOTATION, "2"),
                    (SHARE_ANNOTATION, "cpu=64,nvidia.com/gpu=4"),
                ],
                Ok((2, Some(64_000))),
            ),
            (
                "negative priority",
                vec![(BURST_PRIORITY_ANNOTATION, "-1")],
                Err("annotation tensile.dev/burst-priority=\"-1\": must be a whole number"),
            ),
            (
                "priority too high",
                vec![(BURST_PRIORITY_ANNOTATION, "2000000")],
                Err("tensile.dev/burst-priority=\"2000000\": must be at most 1000000"),
            ),
            (
                "bad share",
                vec![(SHARE_ANNOTATION, "cpu:4")],
                Err("annotation tensile.dev/share=\"cpu:4\""),
            ),
        ];
        for (case, annotations, want) in cases {
            let got = read(&secret("lower-a", &annotations, Some(config)), &defaults());
            match (got, want) {
                (Ok(got), Ok((priority, cpu))) => {
                    assert_eq!(got.bursting.priority, priority, "{case}");
                    assert_eq!(got.bursting.share.caps().get("cpu").copied(), cpu, "{case}");
                }
                (Err(error), Err(needle)) => {
                    assert!(error.to_string().contains(needle), "{case}: {error}");
                }
                (got, want) => panic!("{case}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn granularity_and_lower_node_labels_read_from_their_annotations() {
        let config: &[u8] = b"apiVersion: v1\nkind: Config\n";
        // (case, annotations, granularity and whether `pool` is shown, or the error)
        type Want = Result<(Granularity, bool), &'static str>;
        type Case = (&'static str, Vec<(&'static str, &'static str)>, Want);
        let cases: [Case; 8] = [
            ("defaults", vec![], Ok((Granularity::Cluster, false))),
            (
                "a kubelet port range",
                vec![
                    (GRANULARITY_ANNOTATION, "node"),
                    (KUBELET_PORT_RANGE_ANNOTATION, "10300-10399"),
                ],
                Ok((Granularity::Node, false)),
            ),
            (
                "a bad kubelet port range",
                vec![(KUBELET_PORT_RANGE_ANNOTATION, "10399-10300")],
                Err("tensile.dev/kubelet-port-range=\"10399-10300\""),
            ),
            (
                "node",
                vec![(GRANULARITY_ANNOTATION, "node")],
                Ok((Granularity::Node, false)),
            ),
            (
                "zone, with a pattern",
                vec![
                    (GRANULARITY_ANNOTATION, "label=topology.kubernetes.io/zone"),
                    (LOWER_NODE_LABELS_ANNOTATION, "po*"),
                ],
                Ok((
                    Granularity::Label("topology.kubernetes.io/zone".into()),
                    true,
                )),
            ),
            (
                "unknown granularity",
                vec![(GRANULARITY_ANNOTATION, "rack")],
                Err("annotation tensile.dev/node-granularity=\"rack\": must be cluster, node"),
            ),
            (
                "bad label key",
                vec![(GRANULARITY_ANNOTATION, "label=a b")],
                Err("tensile.dev/node-granularity=\"label=a b\""),
            ),
            (
                "bad pattern",
                vec![(LOWER_NODE_LABELS_ANNOTATION, "a b")],
                Err("tensile.dev/lower-node-labels=\"a b\""),
            ),
        ];
        for (case, annotations, want) in cases {
            let got = read(&secret("lower-a", &annotations, Some(config)), &defaults());
            match (got, want) {
                (Ok(got), Ok((granularity, pool))) => {
                    assert_eq!(got.granularity, granularity, "{case}");
                    let range = annotations
                        .iter()
                        .any(|(k, _)| *k == KUBELET_PORT_RANGE_ANNOTATION);
                    assert_eq!(
                        got.kubelet_port_range.map(|r| (r.from, r.to)),
                        range.then_some((10300, 10399)),
                        "{case}"
                    );
                    assert_eq!(got.lower_node_labels.shows("pool"), pool, "{case}");
                }
                (Err(error), Err(needle)) => {
                    assert!(error.to_string().contains(needle), "{case}: {error}");
                }
                (got, want) => panic!("{case}: got {got:?}, want {want:?}"),
            }
        }
    }

    use crate::clusters::tests::kubeconfig;

    /// The table of what a kubeconfig from a Secret may hold is `clusters`'
    /// (`a_kubeconfig_from_a_secret_may_only_hold_inline_credentials`); here, that a member
    /// Secret's is read at that trust and its error says which key.
    #[test]
    fn a_member_kubeconfig_may_only_hold_inline_credentials() {
        let ca = "certificate-authority-data: Q0E=";
        let cases = [
            ("join's: inline token and CA", "token: abc", None),
            (
                "tokenFile: virtual-node's own ServiceAccount token",
                "tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token",
                Some(
                    "its \"kubeconfig\" sets users[vk].user.tokenFile: a kubeconfig from a Secret may not name a file to read",
                ),
            ),
            (
                "exec",
                "exec: {command: sh}",
                Some(
                    "its \"kubeconfig\" sets users[vk].user.exec: a kubeconfig from a Secret may not run a command",
                ),
            ),
            (
                "not YAML",
                "token: [abc",
                Some("its \"kubeconfig\" cannot be read as a kubeconfig at line"),
            ),
        ];
        for (case, user, want) in cases {
            match (lower_kubeconfig(&kubeconfig(ca, user)), want) {
                (Ok(_), None) => {}
                (Err(error), Some(needle)) => {
                    assert!(error.to_string().starts_with(needle), "{case}: {error}");
                }
                (got, want) => panic!("{case}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn what_join_writes_is_accepted() {
        let admin = Kubeconfig::from_yaml(&kubeconfig(
            "certificate-authority: /etc/lower/ca.crt",
            "client-certificate: /etc/lower/admin.crt, client-key: /etc/lower/admin.key",
        ))
        .unwrap();
        let written = crate::member::join::member_kubeconfig(&admin, "abc", "tensile-vk", |_| {
            Ok(b"-----BEGIN CERTIFICATE-----\n".to_vec())
        })
        .unwrap();
        lower_kubeconfig(&written).unwrap();
    }

    #[test]
    fn taints_parse_with_or_without_a_value() {
        let cases = [
            ("k=v:NoSchedule", Ok(Some(("k", Some("v"), "NoSchedule")))),
            (
                "k:PreferNoSchedule",
                Ok(Some(("k", None, "PreferNoSchedule"))),
            ),
            (
                "example.com/k=a:b:NoExecute",
                Ok(Some(("example.com/k", Some("a:b"), "NoExecute"))),
            ),
            ("NONE", Ok(None)),
            ("=v:NoSchedule", Err("key is empty")),
            ("k=v", Err("key[=value]:Effect")),
        ];
        for (input, want) in cases {
            let got = parse_taint(input);
            match (got, want) {
                (Ok(Some(t)), Ok(Some((key, value, effect)))) => {
                    assert_eq!(
                        (t.key.as_str(), t.value.as_deref(), t.effect.as_str()),
                        (key, value, effect),
                        "{input}"
                    );
                }
                (Ok(None), Ok(None)) => {}
                (Err(e), Err(needle)) => assert!(e.contains(needle), "{input}: {e}"),
                (got, want) => panic!("{input}: got {got:?}, want {want:?}"),
            }
        }
    }
}
