//! Command line of `virtual-node`, with tensile-kube's flag and environment names.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Parser};

/// Joins a lower Kubernetes cluster to an upper one as a virtual node.
#[derive(Parser, Debug, Clone)]
#[command(name = "virtual-node", version, about, long_about = None)]
pub struct Args {
    /// Name of the virtual node in the upper cluster.
    #[arg(long, env = "DEFAULTNODE_NAME", default_value = "virtual-kubelet")]
    pub nodename: String,

    /// Kubeconfig of the upper cluster (default: $KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Kubeconfig of the lower cluster.
    #[arg(long)]
    pub client_kubeconfig: PathBuf,

    /// Requests per second to the lower cluster.
    #[arg(long, default_value_t = 500.0)]
    pub client_qps: f64,

    /// Burst of requests to the lower cluster.
    #[arg(long, default_value_t = 1000)]
    pub client_burst: u32,

    /// Requests per second to the upper cluster.
    #[arg(long, default_value_t = 500.0)]
    pub kube_api_qps: f64,

    /// Burst of requests to the upper cluster.
    #[arg(long, default_value_t = 1000)]
    pub kube_api_burst: u32,

    /// Pod labels removed before mirroring (kept in the `tripped-labels` annotation).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "pod-group.scheduling.sigs.k8s.io"
    )]
    pub ignore_labels: Vec<String>,

    /// Optional controllers, comma-separated: `PVControllers` (claims bound below, their
    /// volumes reflected up), `ServiceControllers` (Services, EndpointSlices and Endpoints
    /// mirrored down). `--enable-controllers=` runs neither. ConfigMap/Secret sync and
    /// event reflection always run. Unknown names are logged and skipped (tensile-kube).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "PVControllers,ServiceControllers"
    )]
    pub enable_controllers: Vec<String>,

    /// Mirror the ServiceAccounts pods use into the lower cluster.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = true, default_missing_value = "true")]
    pub enable_serviceaccount: bool,

    /// Only mirror pods of this namespace (empty: all).
    #[arg(long, default_value = "")]
    pub namespace: String,

    /// Operating system the node reports.
    #[arg(long, default_value = "Linux")]
    pub os: String,

    /// Register the node without the virtual-kubelet taint.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true")]
    pub disable_taint: bool,

    /// Key of the node's taint.
    #[arg(
        long,
        env = "VKUBELET_TAINT_KEY",
        default_value = "virtual-kubelet.io/provider"
    )]
    pub taint_key: String,

    /// Value of the node's taint.
    #[arg(long, env = "VKUBELET_TAINT_VALUE", default_value = "k8s")]
    pub taint_value: String,

    /// Effect of the node's taint.
    #[arg(long, env = "VKUBELET_TAINT_EFFECT", default_value = "NoSchedule")]
    pub taint_effect: String,

    /// Pods reconciled at once.
    #[arg(long, default_value_t = 10)]
    pub pod_sync_workers: u16,

    /// Pod statuses reflected at once (each is one write to the upper cluster); 0 for
    /// three times `--pod-sync-workers`. Reflection has a queue of its own, so this bounds
    /// only how many status writes may wait on a busy upper API server together.
    #[arg(long, default_value_t = 0)]
    pub status_sync_workers: u16,

    /// Heartbeat through a Lease in kube-node-lease (otherwise through node status).
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = true, default_missing_value = "true")]
    pub enable_node_lease: bool,

    /// How often every mirrored pod is reconciled even without a change.
    #[arg(long, value_parser = parse_duration, default_value = "1m")]
    pub full_resync_period: Duration,

    /// Log filter (`info`, `debug`, or a tracing directive such as `tensile=debug`).
    #[arg(long, default_value = "info")]
    pub log_level: String,

    /// Address of the health and metrics endpoint (`/healthz`, `/readyz`, `/metrics`).
    #[arg(long, value_parser = parse_addr, default_value = ":10255")]
    pub metrics_addr: SocketAddr,

    /// Port of the kubelet API, reported as the node's daemon endpoint.
    #[arg(long, env = "KUBELET_PORT", default_value_t = 10250)]
    pub kubelet_port: u16,

    /// The node's InternalIP (default: the first non-loopback address, else 127.0.0.1).
    #[arg(long, env = "VKUBELET_POD_IP")]
    pub node_ip: Option<String>,

    /// Kubelet API serving certificate, PEM (default: a self-signed one generated at start).
    #[arg(long, env = "APISERVER_CERT_LOCATION")]
    pub apiserver_cert: Option<PathBuf>,

    /// Kubelet API serving key, PEM.
    #[arg(long, env = "APISERVER_KEY_LOCATION")]
    pub apiserver_key: Option<PathBuf>,

    /// CA that kubelet API client certificates must chain to (default: the upper cluster's
    /// CA from the `kube-root-ca.crt` ConfigMap in kube-system).
    #[arg(
        long = "client-verify-ca",
        alias = "apiserver-ca-cert",
        env = "APISERVER_CA_CERT_LOCATION"
    )]
    pub apiserver_ca_cert: Option<PathBuf>,

    /// Accept bearer tokens on the kubelet API, checked with a TokenReview in the upper cluster.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true")]
    pub authentication_token_webhook: bool,

    /// Accepted for tensile-kube compatibility; token reviews are not cached.
    #[arg(long, value_parser = parse_duration, default_value = "2m")]
    pub authentication_token_webhook_cache_ttl: Duration,

    /// How long an allowed kubelet API authorization is reused.
    #[arg(long, value_parser = parse_duration, default_value = "5m")]
    pub authorization_webhook_cache_authorized_ttl: Duration,

    /// How long a denied kubelet API authorization is reused.
    #[arg(long, value_parser = parse_duration, default_value = "30s")]
    pub authorization_webhook_cache_unauthorized_ttl: Duration,

    /// Serve the kubelet API to anyone, unauthenticated: a remote shell for all. Labs only.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true")]
    pub no_verify_clients: bool,
}

/// Which optional controllers `--enable-controllers` turns on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OptionalControllers {
    /// `PVControllers`.
    pub volumes: bool,
    /// `ServiceControllers`.
    pub services: bool,
    /// Names given that are neither (skipped with a warning, as tensile-kube does).
    pub unknown: Vec<String>,
}

impl Args {
    /// The optional controllers to run. Names match without regard to case.
    pub fn optional_controllers(&self) -> OptionalControllers {
        let mut enabled = OptionalControllers::default();
        for name in self.enable_controllers.iter().map(|n| n.trim()) {
            if name.eq_ignore_ascii_case("PVControllers") {
                enabled.volumes = true;
            } else if name.eq_ignore_ascii_case("ServiceControllers") {
                enabled.services = true;
            } else if !name.is_empty() {
                enabled.unknown.push(name.to_owned());
            }
        }
        enabled
    }
}

/// `10s`, `1m`, `1h`, `500ms`, plain seconds, or Go's compound form (`1m0s`, `1h30m`,
/// `1.5s`, `300ms`) — the forms tensile-kube users write.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let invalid = || format!("invalid duration {text:?}");
    if text.is_empty() {
        return Err(invalid());
    }
    if text.chars().all(|c| c.is_ascii_digit() || c == '.') {
        let value: f64 = text.parse().map_err(|_| invalid())?;
        return Duration::try_from_secs_f64(value).map_err(|e| format!("{}: {e}", invalid()));
    }
    let mut rest = text;
    let mut seconds = 0.0;
    while !rest.is_empty() {
        let split = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, tail) = rest.split_at(split);
        let value: f64 = number.parse().map_err(|_| invalid())?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let scale = match unit {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => {
                return Err(format!(
                    "invalid duration unit in {text:?} (use ns, us, ms, s, m or h)"
                ));
            }
        };
        seconds += value * scale;
        rest = tail;
    }
    Duration::try_from_secs_f64(seconds).map_err(|e| format!("{}: {e}", invalid()))
}

/// `host:port`, or `:port` for all interfaces (Go's form).
pub fn parse_addr(text: &str) -> Result<SocketAddr, String> {
    let full = match text.strip_prefix(':') {
        Some(port) => format!("0.0.0.0:{port}"),
        None => text.to_owned(),
    };
    full.parse()
        .map_err(|e| format!("invalid address {text:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        let cases = [
            ("10s", Some(10_000)),
            ("1m", Some(60_000)),
            ("1h", Some(3_600_000)),
            ("500ms", Some(500)),
            ("30", Some(30_000)),
            ("1.5s", Some(1_500)),
            ("5d", None),
            ("", None),
            ("s", None),
            ("1m0s", Some(60_000)),
            ("1h30m", Some(5_400_000)),
            ("2m3.5s", Some(123_500)),
            ("0s", Some(0)),
            ("0", Some(0)),
            ("1m0", None),
            ("1x2s", None),
            ("-1s", None),
        ];
        for (text, millis) in cases {
            let got = parse_duration(text).ok().map(|d| d.as_millis() as u64);
            assert_eq!(got, millis, "{text:?}");
        }
    }

    #[test]
    fn addresses() {
        assert_eq!(parse_addr(":10255").unwrap().to_string(), "0.0.0.0:10255");
        assert_eq!(
            parse_addr("127.0.0.1:9").unwrap().to_string(),
            "127.0.0.1:9"
        );
        assert!(parse_addr("nope").is_err());
    }

    #[test]
    fn tensile_kube_command_line_parses() {
        let args = Args::try_parse_from([
            "virtual-node",
            "--nodename",
            "vk-node",
            "--kubeconfig",
            "./config",
            "--client-kubeconfig",
            "/root/.kube/config",
            "--enable-serviceaccount=false",
            "--disable-taint",
            "--enable-controllers=",
            "--ignore-labels=a,b",
            "--full-resync-period=30s",
        ])
        .unwrap();
        assert_eq!(args.nodename, "vk-node");
        assert!(!args.enable_serviceaccount);
        assert!(args.disable_taint);
        assert_eq!(args.ignore_labels, ["a", "b"]);
        assert_eq!(args.full_resync_period, Duration::from_secs(30));
        assert_eq!(args.metrics_addr.port(), 10255);
        assert!(args.enable_node_lease);
        assert_eq!(args.optional_controllers(), OptionalControllers::default());
    }

    #[test]
    fn optional_controllers() {
        let parse = |flag: Option<&str>| {
            let mut argv = vec!["virtual-node", "--client-kubeconfig", "k"];
            argv.extend(flag);
            Args::try_parse_from(argv).unwrap().optional_controllers()
        };
        let both = OptionalControllers {
            volumes: true,
            services: true,
            unknown: vec![],
        };
        assert_eq!(parse(None), both, "both by default");
        assert_eq!(
            parse(Some("--enable-controllers=")),
            OptionalControllers::default()
        );
        assert_eq!(
            parse(Some("--enable-controllers=ServiceControllers")),
            OptionalControllers {
                services: true,
                ..OptionalControllers::default()
            }
        );
        assert_eq!(
            parse(Some("--enable-controllers=pvcontrollers, Nope")),
            OptionalControllers {
                volumes: true,
                services: false,
                unknown: vec!["Nope".into()],
            }
        );
    }
}
