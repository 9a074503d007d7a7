//! `virtual-node check`: verifies, without changing anything, that virtual-node can run with
//! these flags: both kubeconfigs load, both API servers answer (and their versions), every
//! permission the enabled parts need is granted in each cluster (SelfSubjectAccessReviews
//! from the same tables the start-up check uses), the upper cluster's identity can be read,
//! and the kubelet and metrics ports are free; with `--members-namespace`, every member
//! Secret there is read and its lower cluster reached and checked the same way. One line
//! per check, ✓ or ✗.

use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Namespace, Node, Secret};
use kube::Api;
use kube::api::ListParams;

use crate::cli::Args;
use crate::clusters::{self, Cluster, RateLimit};
use crate::member::spec::{self, MEMBER_LABEL};
use crate::metrics::Metrics;
use crate::node::groups::{Granularity, Groups, LabelPatterns};
use crate::side::Side;

/// One check's outcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Line {
    /// Whether it passed.
    pub ok: bool,
    /// What was checked, and what was found.
    pub what: String,
}

/// Every check's outcome, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// The lines.
    pub lines: Vec<Line>,
}

impl Report {
    fn pass(&mut self, what: impl Into<String>) {
        self.lines.push(Line {
            ok: true,
            what: what.into(),
        });
    }

    fn push(&mut self, line: Line) {
        self.lines.push(line);
    }

    fn fail(&mut self, what: impl Into<String>) {
        self.lines.push(Line {
            ok: false,
            what: what.into(),
        });
    }

    /// Whether every check passed.
    pub fn passed(&self) -> bool {
        self.lines.iter().all(|line| line.ok)
    }

    /// The table: one `✓`/`✗` line per check, then a summary line.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for line in &self.lines {
            let _ = writeln!(out, "{} {}", if line.ok { "✓" } else { "✗" }, line.what);
        }
        let failed = self.lines.iter().filter(|l| !l.ok).count();
        if failed == 0 {
            let _ = writeln!(out, "all {} checks passed", self.lines.len());
        } else {
            let _ = writeln!(out, "{failed} of {} checks failed", self.lines.len());
        }
        out
    }
}

/// Runs every check for `args`.
pub async fn check(args: &Args) -> Report {
    let mut report = Report::default();
    report.pass(format!(
        "--nodename {} is a valid node name and label value",
        args.nodename
    ));
    let metrics = Arc::new(Metrics::default());
    let upper = reach(
        &mut report,
        Side::Upper,
        args.kubeconfig.as_deref(),
        RateLimit {
            qps: args.kube_api_qps,
            burst: args.kube_api_burst,
        },
        &metrics,
    )
    .await;
    let lower = match &args.client_kubeconfig {
        Some(kubeconfig) => {
            reach(
                &mut report,
                Side::Lower,
                Some(kubeconfig),
                RateLimit {
                    qps: args.client_qps,
                    burst: args.client_burst,
                },
                &metrics,
            )
            .await
        }
        None => None,
    };
    let features = args.features();
    for cluster in [&upper, &lower].into_iter().flatten() {
        permissions(&mut report, cluster, features, &cluster.side.to_string()).await;
    }
    if let Some(lower) = &lower {
        groups(
            &mut report,
            lower,
            &args.nodename,
            &args.node_granularity,
            &args.lower_node_labels,
        )
        .await;
    }
    if let Some(upper) = &upper {
        identity(&mut report, args, upper).await;
        if let Some(namespace) = &args.members_namespace {
            members(&mut report, args, upper, namespace, &metrics).await;
        }
    }
    port(
        &mut report,
        "kubelet API port (KUBELET_PORT)",
        SocketAddr::from(([0, 0, 0, 0], args.kubelet_port)),
    )
    .await;
    port(&mut report, "--metrics-addr", args.metrics_addr).await;
    report
}

async fn reach(
    report: &mut Report,
    side: Side,
    kubeconfig: Option<&std::path::Path>,
    limit: RateLimit,
    metrics: &Arc<Metrics>,
) -> Option<Cluster> {
    let config = match clusters::load_config(side, kubeconfig).await {
        Ok(config) => config,
        Err(error) => {
            report.fail(error.to_string());
            return None;
        }
    };
    match clusters::connect(side, config, limit, metrics.clone(), None).await {
        Ok(cluster) => {
            report.pass(format!(
                "{side} cluster reachable at {} (Kubernetes {})",
                cluster.server, cluster.version
            ));
            Some(cluster)
        }
        Err(error) => {
            report.fail(error.to_string());
            None
        }
    }
}

/// Every member Secret of `namespace`: readable, its lower cluster reachable with it, and
/// every permission a member needs there granted.
async fn members(
    report: &mut Report,
    args: &Args,
    upper: &Cluster,
    namespace: &str,
    metrics: &Arc<Metrics>,
) {
    let secrets: Api<Secret> = Api::namespaced(upper.client.clone(), namespace);
    let listed = secrets
        .list(&ListParams::default().labels(&format!("{MEMBER_LABEL}=true")))
        .await;
    let found = match listed {
        Ok(found) => found.items,
        Err(error) => {
            report.fail(format!(
                "upper cluster: listing the member Secrets of {namespace}: {error}"
            ));
            return;
        }
    };
    report.pass(format!(
        "--members-namespace {namespace}: {} member Secrets",
        found.len()
    ));
    let defaults = spec::Defaults {
        taint: crate::member::flag_taint(args),
        ignore_labels: args.ignore_labels.clone(),
        qps: args.client_qps,
        burst: args.client_burst,
    };
    for secret in &found {
        let name = format!(
            "{namespace}/{}",
            secret.metadata.name.as_deref().unwrap_or_default()
        );
        let member = match spec::read(secret, &defaults) {
            Ok(member) => member,
            Err(error) => {
                report.fail(format!("member Secret {name}: {error}"));
                continue;
            }
        };
        let member = match crate::member::member_spec(&member).await {
            Ok(member) => member,
            Err(error) => {
                report.fail(format!("member Secret {name}: {error}"));
                continue;
            }
        };
        let node = member.node.clone();
        match clusters::connect(
            Side::Lower,
            member.lower,
            member.lower_limit,
            metrics.clone(),
            None,
        )
        .await
        {
            Ok(lower) => {
                report.pass(format!(
                    "node {node} (member Secret {name}): lower cluster reachable at {} (Kubernetes {})",
                    lower.server, lower.version
                ));
                permissions(
                    report,
                    &lower,
                    args.features(),
                    &format!("node {node}: lower"),
                )
                .await;
                groups(
                    report,
                    &lower,
                    &node,
                    &member.granularity,
                    &member.lower_node_labels,
                )
                .await;
            }
            Err(error) => report.fail(format!("node {node} (member Secret {name}): {error}")),
        }
    }
}

/// The virtual nodes a member of `node` or `label=<key>` granularity would register from
/// the lower nodes as they are now: a failure when none would (`label=<key>` that no
/// lower node carries). Nothing for `cluster`.
async fn groups(
    report: &mut Report,
    lower: &Cluster,
    base: &str,
    granularity: &Granularity,
    patterns: &LabelPatterns,
) {
    if *granularity == Granularity::Cluster {
        return;
    }
    let nodes: Api<Node> = Api::all(lower.client.clone());
    match nodes.list(&ListParams::default()).await {
        Ok(list) => report.push(granularity_line(base, granularity, patterns, &list.items)),
        Err(error) => report.fail(format!(
            "node {base}: lower cluster: listing Nodes for --node-granularity {granularity}: {error}"
        )),
    }
}

/// What `groups` reports for the lower `nodes`. Pure.
fn granularity_line(
    base: &str,
    granularity: &Granularity,
    patterns: &LabelPatterns,
    nodes: &[Node],
) -> Line {
    let mut groups = Groups::new(base, granularity.clone(), patterns.clone());
    for node in nodes {
        groups.apply_node(node);
    }
    let names: Vec<String> = groups
        .keys()
        .filter_map(|key| groups.group(key))
        .map(|group| group.name)
        .collect();
    if names.is_empty() {
        return Line {
            ok: false,
            what: format!(
                "node {base}: --node-granularity {granularity}: none of the {} lower nodes \
                 makes a virtual node (no lower node carries the label?)",
                nodes.len()
            ),
        };
    }
    const SHOWN: usize = 5;
    let more = names.len().saturating_sub(SHOWN);
    let mut shown = names
        .iter()
        .take(SHOWN)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if more > 0 {
        let _ = write!(shown, " and {more} more");
    }
    Line {
        ok: true,
        what: format!(
            "node {base}: --node-granularity {granularity}: {} virtual nodes from {} lower nodes ({shown})",
            names.len(),
            nodes.len()
        ),
    }
}

async fn permissions(
    report: &mut Report,
    cluster: &Cluster,
    features: clusters::Features,
    which: &str,
) {
    let needed = clusters::needed_permissions(cluster.side, features);
    match clusters::review_permissions(cluster, &needed).await {
        Ok(answers) => {
            let granted = answers.iter().filter(|(_, allowed)| *allowed).count();
            for (permission, allowed) in &answers {
                if !allowed {
                    report.fail(format!("{which} cluster: may not {permission}"));
                }
            }
            if granted == answers.len() {
                report.pass(format!(
                    "{which} cluster: all {granted} permissions granted"
                ));
            }
        }
        Err(error) => report.fail(error.to_string()),
    }
}

async fn identity(report: &mut Report, args: &Args, upper: &Cluster) {
    if let Some(id) = &args.cluster_id {
        report.pass(format!("upper cluster identity (--cluster-id): {id}"));
        return;
    }
    match Api::<Namespace>::all(upper.client.clone())
        .get("kube-system")
        .await
    {
        Ok(ns) => match ns.metadata.uid {
            Some(uid) => report.pass(format!(
                "upper cluster identity (UID of kube-system): {uid}"
            )),
            None => report.fail("upper cluster: kube-system has no UID; set --cluster-id"),
        },
        Err(error) => report.fail(format!(
            "upper cluster: reading namespace kube-system for the cluster's identity (or set --cluster-id): {error}"
        )),
    }
}

async fn port(report: &mut Report, what: &str, addr: SocketAddr) {
    match tokio::net::TcpListener::bind(addr).await {
        Ok(_) => report.pass(format!("{what} {addr} is free")),
        Err(error) => report.fail(format!("{what} {addr}: {error}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_says_what_failed() {
        let mut report = Report::default();
        report.pass("upper cluster reachable");
        assert!(report.passed());
        assert_eq!(
            report.render(),
            "✓ upper cluster reachable\nall 1 checks passed\n"
        );
        report.fail("lower cluster: may not create pods");
        assert!(!report.passed());
        assert_eq!(
            report.render(),
            "✓ upper cluster reachable\n✗ lower cluster: may not create pods\n1 of 2 checks failed\n"
        );
    }

    #[test]
    fn the_virtual_nodes_a_granularity_would_make() {
        let node = |name: &str, zone: Option<&str>| -> Node {
            let mut node = Node::default();
            node.metadata.name = Some(name.into());
            if let Some(zone) = zone {
                node.metadata.labels =
                    Some([("topology.kubernetes.io/zone".to_owned(), zone.to_owned())].into());
            }
            node
        };
        let zone: Granularity = "label=topology.kubernetes.io/zone".parse().unwrap();
        let zoned = [
            node("n1", Some("a")),
            node("n2", Some("b")),
            node("n3", Some("a")),
        ];
        let bare = [node("n1", None), node("n2", None)];
        let seven: Vec<Node> = (0..7).map(|i| node(&format!("w{i}"), None)).collect();
        for (case, granularity, nodes, ok, says) in [
            (
                "zones",
                &zone,
                &zoned[..],
                true,
                "2 virtual nodes from 3 lower nodes (vk-a, vk-b)",
            ),
            (
                "no lower node has the label",
                &zone,
                &bare[..],
                false,
                "none of the 2 lower nodes",
            ),
            (
                "no lower node at all",
                &Granularity::Node,
                &[][..],
                false,
                "none of the 0",
            ),
            (
                "many",
                &Granularity::Node,
                &seven[..],
                true,
                "(vk-w0, vk-w1, vk-w2, vk-w3, vk-w4 and 2 more)",
            ),
        ] {
            let line = granularity_line("vk", granularity, &LabelPatterns::default(), nodes);
            assert_eq!(line.ok, ok, "{case}: {}", line.what);
            assert!(line.what.contains(says), "{case}: {}", line.what);
        }
    }
}
