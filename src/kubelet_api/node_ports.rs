//! `--kubelet-port-range`: a kubelet port of its own for each virtual node of a member of
//! `node` or `label=<key>` granularity. Its virtual nodes share the member's address, and
//! metrics-server (with `--kubelet-use-node-status-port`) and the API server call a node
//! at its Node's `status.daemonEndpoints.kubeletEndpoint.Port`: with a port each, a call
//! says by where it arrives which virtual node it is for ([`super::NodeScope`]). The port
//! choice is pure ([`assign`]); binding and serving follow ([`listen`]).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;

use kube::runtime::events::Recorder;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info_span, warn};

use super::{KubeletApi, NodeScope, StartError};

/// An inclusive range of ports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortRange {
    /// The first port.
    pub from: u16,
    /// The last port (included).
    pub to: u16,
}

impl PortRange {
    /// Whether `port` is in the range.
    pub fn contains(&self, port: u16) -> bool {
        (self.from..=self.to).contains(&port)
    }
}

impl std::fmt::Display for PortRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.from, self.to)
    }
}

/// Parses a port range as Kubernetes writes one (`--service-node-port-range`):
/// `FROM-TO`, `FROM+N` (`FROM` to `FROM+N`), or a single port.
pub fn parse_port_range(text: &str) -> Result<PortRange, String> {
    let bad = |why: &str| format!("invalid port range {text:?}: {why} (FROM-TO, e.g. 10300-10399)");
    let port = |s: &str| -> Result<u16, String> {
        match s.trim().parse::<u16>() {
            Ok(0) | Err(_) => Err(bad(&format!("{s:?} is not a port (1-65535)"))),
            Ok(port) => Ok(port),
        }
    };
    let range = if let Some((from, to)) = text.split_once('-') {
        PortRange {
            from: port(from)?,
            to: port(to)?,
        }
    } else if let Some((from, more)) = text.split_once('+') {
        let from = port(from)?;
        let more: u16 = more
            .trim()
            .parse()
            .map_err(|_| bad(&format!("{more:?} is not a count of ports")))?;
        PortRange {
            from,
            to: from.checked_add(more).ok_or_else(|| bad("past 65535"))?,
        }
    } else {
        let single = port(text)?;
        PortRange {
            from: single,
            to: single,
        }
    };
    if range.to < range.from {
        return Err(bad("it ends before it starts"));
    }
    Ok(range)
}

/// The ports of `range` for virtual nodes starting now, in order: `wanted` holds the port
/// each one's Node shows from before (a restart), if any. A node keeps its port where it
/// is in the range, not in `taken` (the running nodes' ports) and no earlier node kept it;
/// the others get the lowest ports left, in order, and `None` once the range is used up
/// (they keep the member's shared port). Pure.
pub fn assign(range: PortRange, taken: &BTreeSet<u16>, wanted: &[Option<u16>]) -> Vec<Option<u16>> {
    let mut used = taken.clone();
    let mut chosen: Vec<Option<u16>> = wanted
        .iter()
        .map(|want| {
            let port = (*want).filter(|p| range.contains(*p) && !used.contains(p))?;
            used.insert(port);
            Some(port)
        })
        .collect();
    let mut free = (range.from..=range.to).filter(|p| !used.contains(p));
    for port in chosen.iter_mut().filter(|p| p.is_none()) {
        *port = free.next();
    }
    chosen
}

/// What a member's virtual nodes need to serve a kubelet port each.
#[derive(Clone)]
pub struct GroupPorts {
    /// `--kubelet-port-range`.
    pub range: PortRange,
    /// The member's kubelet API TLS configuration.
    pub tls: rustls::ServerConfig,
    /// The member's kubelet API.
    pub api: Arc<KubeletApi>,
    /// Events on the virtual nodes (a range too small).
    pub recorder: Recorder,
}

impl std::fmt::Debug for GroupPorts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupPorts")
            .field("range", &self.range)
            .finish_non_exhaustive()
    }
}

/// Binds `port` of `ports.range` for virtual node `node` (or, where it is taken by another
/// process, the next free one of the range not in `taken`), and serves the member's
/// kubelet API there for `node` alone until `stop`. `None` where no port of the range
/// could be bound.
pub async fn listen(
    ports: &GroupPorts,
    port: u16,
    taken: &BTreeSet<u16>,
    node: &str,
    stop: CancellationToken,
) -> Option<(u16, impl Future<Output = ()> + Send + 'static)> {
    let candidates = std::iter::once(port).chain(
        (port.saturating_add(1)..=ports.range.to)
            .chain(ports.range.from..port)
            .filter(|p| !taken.contains(p)),
    );
    for candidate in candidates {
        let addr = SocketAddr::from(([0, 0, 0, 0], candidate));
        match super::bind(addr).await {
            Ok(listener) => {
                let scope = NodeScope::new(node);
                let serving = super::serve_scoped(
                    listener,
                    ports.tls.clone(),
                    ports.api.clone(),
                    Some(Arc::new(scope)),
                    stop,
                )
                .instrument(info_span!("kubelet_api", %node, port = candidate));
                return Some((candidate, serving));
            }
            Err(error @ StartError::Bind { .. }) => {
                warn!(%error, %node, "kubelet port of the range taken: trying the next");
            }
            Err(error) => {
                warn!(%error, %node, "kubelet port");
                return None;
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_ranges_parse_as_kubernetes_writes_them() {
        let r = |from, to| Ok(PortRange { from, to });
        let cases: &[(&str, Result<PortRange, String>)] = &[
            ("10300-10399", r(10300, 10399)),
            (" 10300 - 10301 ", r(10300, 10301)),
            ("10300+99", r(10300, 10399)),
            ("10300", r(10300, 10300)),
        ];
        for (text, want) in cases {
            assert_eq!(&parse_port_range(text), want, "{text}");
        }
        for bad in [
            "", "0-10", "10-5", "a-b", "10300-", "65535+1", "10300+x", "70000",
        ] {
            assert!(parse_port_range(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_port_range("1-2").unwrap().to_string(), "1-2");
    }

    /// A node keeps the port its Node shows where the range has it and it is free; the
    /// others get the lowest left; past the range's size, none.
    #[test]
    fn ports_are_kept_across_restarts_and_handed_out_lowest_first() {
        let range = PortRange { from: 100, to: 102 };
        let set = |ports: &[u16]| ports.iter().copied().collect::<BTreeSet<u16>>();
        // (taken by running nodes, wanted, chosen)
        type Case = (
            &'static [u16],
            &'static [Option<u16>],
            &'static [Option<u16>],
        );
        let cases: &[Case] = &[
            // Fresh: lowest first.
            (&[], &[None, None], &[Some(100), Some(101)]),
            // A restart: each keeps its own, even where a fresh one comes first.
            (
                &[],
                &[None, Some(100), Some(102)],
                &[Some(101), Some(100), Some(102)],
            ),
            // Out of the range (the range changed): a new one.
            (&[], &[Some(5000), None], &[Some(100), Some(101)]),
            // Taken by a running node, or kept by an earlier one: a new one.
            (&[100], &[Some(100)], &[Some(101)]),
            (&[], &[Some(101), Some(101)], &[Some(101), Some(100)]),
            // Too many: the last ones get none.
            (
                &[],
                &[None, None, None, None],
                &[Some(100), Some(101), Some(102), None],
            ),
            (&[100, 101, 102], &[Some(100), None], &[None, None]),
            // Nothing asked.
            (&[], &[], &[]),
        ];
        for (taken, wanted, want) in cases {
            assert_eq!(
                assign(range, &set(taken), wanted),
                *want,
                "taken {taken:?} wanted {wanted:?}"
            );
        }
    }
}
