//! Command line of `tensile-webhook`, with tensile-kube's flag names.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::RangedU64ValueParser;
use clap::{ArgAction, Args, Parser, Subcommand, value_parser};
use tensile::cli::parse_period;
use tensile::logging::LogFormat;
use tensile::translate::meta::{VIRTUAL_NODE_TAINT_EFFECT, VIRTUAL_NODE_TAINT_KEY};

use crate::server::DEFAULT_MAX_BODY_BYTES;

/// Mutating admission webhook that lets pods labelled `virtual-pod: "true"` burst onto
/// tensile virtual nodes.
///
/// Accepted for compatibility with tensile-kube but without effect: `--CA` (the API server
/// verifies the webhook, not the reverse), `--master` and `--incluster` (the upper cluster
/// is found from `--kubeconfig`, `$KUBECONFIG`, `~/.kube/config`, else in-cluster).
#[derive(Parser, Debug, Clone)]
#[command(
    name = "tensile-webhook",
    about,
    long_about = None,
    disable_version_flag = true,
    args_conflicts_with_subcommands = true,
    args_override_self = true,
    after_help = "klog's flags (`-v 6`, `--v=6`, `--logtostderr`, ...) are accepted and ignored: use --log-level."
)]
pub struct Cli {
    /// Print the version and exit (a Go boolean, as tensile-kube's: `--version=true` too).
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true")]
    pub version: bool,
    /// A one-off task instead of serving.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Serving flags.
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// One-off tasks.
#[derive(Subcommand, Debug, Clone)]
pub enum Command {
    /// Writes a CA and a serving certificate for the webhook's Service (ca.crt, tls.crt,
    /// tls.key) and prints the caBundle.
    GenCerts(GenCertsArgs),
}

/// Flags of the server.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0")]
    pub address: IpAddr,

    /// HTTPS port (`/mutate`, `/healthz`, `/readyz`, `/metrics`).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,

    /// Serving certificate (PEM); reloaded when it changes on disk.
    #[arg(long)]
    pub tlscert: Option<PathBuf>,

    /// Serving key (PEM); reloaded with the certificate.
    #[arg(long)]
    pub tlskey: Option<PathBuf>,

    /// Accepted for tensile-kube compatibility; ignored.
    #[arg(long = "CA", hide = true)]
    pub ca: Option<PathBuf>,

    /// Kubeconfig of the upper cluster (default: $KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Accepted for tensile-kube compatibility; ignored.
    #[arg(long, hide = true)]
    pub master: Option<String>,

    /// Accepted for tensile-kube compatibility; ignored.
    #[arg(long, hide = true, action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true")]
    pub incluster: bool,

    /// nodeSelector / required node-affinity keys that stay in the upper pod instead of
    /// moving into `clusterSelector` (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "clusterID")]
    pub ignore_selector_keys: Vec<String>,

    /// Namespaces whose pods are never mutated (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "kube-system")]
    pub excluded_namespaces: Vec<String>,

    /// Namespaces whose pods burst eagerly (comma-separated): the webhook annotates them
    /// `tensile.dev/burst: eager`, and they do not get the preference for regular nodes.
    #[arg(long, value_delimiter = ',')]
    pub eager_namespaces: Vec<String>,

    /// Add a preferred node-affinity term for nodes without `type=virtual-kubelet` (weight
    /// 100) to mutated pods that are not eager: local first where kube-scheduler does not
    /// call the scheduler extender.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = true, default_missing_value = "true")]
    pub prefer_regular_nodes: bool,

    /// Add a toleration of the virtual node's taint to mutated pods.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = true, default_missing_value = "true")]
    pub virtual_node_toleration: bool,

    /// Key of the virtual node's taint (as virtual-node's `VKUBELET_TAINT_KEY`).
    #[arg(long, env = "VKUBELET_TAINT_KEY", default_value = VIRTUAL_NODE_TAINT_KEY)]
    pub taint_key: String,

    /// Effect of the virtual node's taint (as virtual-node's `VKUBELET_TAINT_EFFECT`).
    #[arg(long, env = "VKUBELET_TAINT_EFFECT", default_value = VIRTUAL_NODE_TAINT_EFFECT)]
    pub taint_effect: String,

    /// How often the certificate files are checked for changes (1s to a year).
    #[arg(long, value_parser = parse_period, default_value = "5s")]
    pub cert_reload_interval: Duration,

    /// Larger request bodies are answered with HTTP 400 (at least 1).
    #[arg(
        long,
        value_parser = RangedU64ValueParser::<usize>::new().range(1..),
        default_value_t = DEFAULT_MAX_BODY_BYTES
    )]
    pub max_body_bytes: usize,

    /// Log filter (`info`, `debug`, or a tracing directive such as `tensile_webhook=debug`).
    #[arg(long, default_value = "info")]
    pub log_level: String,

    /// Log lines as `text` or `json`.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

impl ServeArgs {
    /// The flags given that only tensile-kube's command lines use, as given.
    pub fn ignored_flags(&self) -> Vec<String> {
        let mut ignored = Vec::new();
        if let Some(ca) = &self.ca {
            ignored.push(format!("--CA={}", ca.display()));
        }
        if let Some(master) = &self.master {
            ignored.push(format!("--master={master}"));
        }
        if self.incluster {
            ignored.push("--incluster".to_owned());
        }
        ignored
    }
}

/// Flags of `gen-certs`.
#[derive(Args, Debug, Clone)]
pub struct GenCertsArgs {
    /// Name of the webhook's Service.
    #[arg(long, default_value = "tensile-webhook")]
    pub service: String,

    /// Namespace of the webhook's Service.
    #[arg(long, default_value = "tensile-system")]
    pub namespace: String,

    /// Further names the certificate is valid for: DNS names or IP addresses
    /// (comma-separated or repeated), e.g. `127.0.0.1` for a webhook reached by URL.
    #[arg(long, value_delimiter = ',')]
    pub host: Vec<String>,

    /// Validity in days (at least 1).
    #[arg(long, value_parser = value_parser!(u32).range(1..), default_value_t = 3650)]
    pub days: u32,

    /// Directory to write ca.crt, tls.crt and tls.key into.
    #[arg(long)]
    pub out: PathBuf,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn accepts_tensile_kube_flags() {
        let cli = Cli::try_parse_from([
            "tensile-webhook",
            "--address=127.0.0.1",
            "--port=9443",
            "--tlscert=/c",
            "--tlskey=/k",
            "--CA=/ca",
            "--master=https://x",
            "--incluster",
            "--ignore-selector-keys=clusterID,zone",
        ])
        .unwrap();
        assert!(cli.command.is_none());
        assert_eq!(cli.serve.port, 9443);
        assert_eq!(cli.serve.ignore_selector_keys, ["clusterID", "zone"]);
        assert!(cli.serve.virtual_node_toleration);
        assert_eq!(cli.serve.excluded_namespaces, ["kube-system"]);
        assert!(cli.serve.eager_namespaces.is_empty());
        assert!(cli.serve.prefer_regular_nodes);

        let cli =
            Cli::try_parse_from(["tensile-webhook", "--virtual-node-toleration=false"]).unwrap();
        assert!(!cli.serve.virtual_node_toleration);
    }

    /// Zero or absurd values are refused, naming the flag.
    #[test]
    fn nonsensical_values_are_refused_naming_the_flag() {
        let cases: [&[&str]; 6] = [
            &["--cert-reload-interval=0"],
            &["--cert-reload-interval=1ms"],
            &["--cert-reload-interval=100000h"],
            &["--max-body-bytes=0"],
            &["--max-body-bytes=-1"],
            &["gen-certs", "--out=/tmp/x", "--days=0"],
        ];
        for flags in cases {
            let flag = flags.last().unwrap().split('=').next().unwrap();
            let argv = std::iter::once("tensile-webhook").chain(flags.iter().copied());
            let error = Cli::try_parse_from(argv).expect_err(flag);
            let line = tensile::cli::one_line(&error);
            assert!(line.contains(flag), "{flags:?}: {line}");
        }
        let cli = Cli::try_parse_from(["tensile-webhook", "--cert-reload-interval=1m0s"]).unwrap();
        assert_eq!(cli.serve.cert_reload_interval, Duration::from_secs(60));
    }

    /// The webhook tolerates the taint virtual-node puts on its node by default.
    #[test]
    fn taint_defaults_are_virtual_nodes() {
        let webhook = Cli::try_parse_from(["tensile-webhook"]).unwrap().serve;
        let node = tensile::cli::Args::try_parse_from(["virtual-node", "--client-kubeconfig", "k"])
            .unwrap();
        assert_eq!(webhook.taint_key, node.taint_key);
        assert_eq!(webhook.taint_effect, node.taint_effect);
        assert_eq!(
            (
                node.taint_key.as_str(),
                node.taint_value.as_str(),
                node.taint_effect.as_str()
            ),
            (VIRTUAL_NODE_TAINT_KEY, "k8s", VIRTUAL_NODE_TAINT_EFFECT)
        );
    }

    #[test]
    fn gen_certs_subcommand() {
        let cli = Cli::try_parse_from([
            "tensile-webhook",
            "gen-certs",
            "--out",
            "/tmp/x",
            "--host",
            "127.0.0.1,localhost",
        ])
        .unwrap();
        let Some(Command::GenCerts(args)) = cli.command else {
            panic!("gen-certs expected")
        };
        assert_eq!(args.service, "tensile-webhook");
        assert_eq!(args.host, ["127.0.0.1", "localhost"]);
    }

    /// Every flag tensile-kube's webhook takes (its pflags and klog's Go flags, which
    /// pflag takes with `--`, and `-v` as a shorthand). A flag missing here, or refused,
    /// fails.
    const TENSILE_KUBE_WEBHOOK_FLAGS: &[&str] = &[
        "--address=0.0.0.0",
        "--port=443",
        "--tlscert=/root/cert.pem",
        "--tlskey=/root/key.pem",
        "--CA=/root/ca.pem",
        "--kubeconfig=/root/.kube/config",
        "--master=https://10.0.0.1:6443",
        "--incluster",
        "--incluster=true",
        "--incluster=false",
        "--ignore-selector-keys=clusterID",
        "--version=false",
        "--v=6",
        "-v=6",
        "--add_dir_header",
        "--alsologtostderr",
        "--log_backtrace_at=main.go:1",
        "--log_dir=/tmp",
        "--log_file=/tmp/w.log",
        "--log_file_max_size=1800",
        "--logtostderr=true",
        "--skip_headers",
        "--skip_log_headers",
        "--stderrthreshold=2",
        "--vmodule=server=4",
        "--log-format=json",
    ];

    /// The args of tensile-kube's `manifeasts/webhook.yaml`.
    const TENSILE_KUBE_WEBHOOK_MANIFEST: &[&str] = &[
        "--tlscert=/root/cert.pem",
        "--tlskey=/root/key.pem",
        "--port=443",
        "--v=6",
    ];

    fn parse(flags: &[&str]) -> (Result<Cli, clap::Error>, Vec<String>) {
        let (kept, klog) = tensile::cli::strip_klog_flags(
            std::iter::once("tensile-webhook").chain(flags.iter().copied()),
        );
        (Cli::try_parse_from(kept), klog)
    }

    #[test]
    fn every_tensile_kube_webhook_flag_is_accepted_alone() {
        for flag in TENSILE_KUBE_WEBHOOK_FLAGS {
            if let (Err(error), _) = parse(&[flag]) {
                panic!("{flag}: {}", tensile::cli::one_line(&error));
            }
        }
        let (cli, klog) = parse(&["-v", "6", "--port=1"]);
        assert_eq!(cli.unwrap().serve.port, 1);
        assert_eq!(klog, ["-v 6"]);
    }

    #[test]
    fn tensile_kube_webhook_manifest_parses() {
        let (cli, klog) = parse(TENSILE_KUBE_WEBHOOK_MANIFEST);
        let cli = cli.unwrap();
        assert_eq!(cli.serve.port, 443);
        assert_eq!(cli.serve.tlscert, Some("/root/cert.pem".into()));
        assert!(cli.serve.ignored_flags().is_empty());
        assert_eq!(klog, ["--v=6"]);
    }

    #[test]
    fn version_and_ignored_flags() {
        let cases: [(&[&str], bool); 4] = [
            (&["--version"], true),
            (&["--version=true"], true),
            (&["--version=false"], false),
            (&[], false),
        ];
        for (flags, want) in cases {
            assert_eq!(parse(flags).0.unwrap().version, want, "{flags:?}");
        }
        let (cli, _) = parse(&["--CA=/ca", "--master=https://m", "--incluster"]);
        assert_eq!(
            cli.unwrap().serve.ignored_flags(),
            ["--CA=/ca", "--master=https://m", "--incluster"]
        );
        let (cli, _) = parse(&["--incluster=false", "--log-format=json"]);
        let cli = cli.unwrap();
        assert!(cli.serve.ignored_flags().is_empty());
        assert_eq!(cli.serve.log_format, LogFormat::Json);
    }
}
