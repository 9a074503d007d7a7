//! Command line of `tensile-descheduler`, with tensile-kube's descheduler flag names.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{ArgAction, CommandFactory, Parser};

pub use crate::cli::strip_klog_flags;
use crate::cli::{MAX_DURATION, MIN_PERIOD, duration_in, parse_addr, parse_period};
use crate::duration::{format_duration, parse_duration};
use crate::leader::LeaseConfig;
use crate::logging::LogFormat;

/// The shortest leader-election timing accepted: client-go's are seconds, and tests run
/// elections in fractions of one.
const MIN_LEASE_TIMING: Duration = Duration::from_millis(100);

/// Gives pods that a lower cluster cannot place another chance.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "tensile-descheduler",
    version,
    about,
    long_about = None,
    args_override_self = true,
    after_help = "`tensile-descheduler version` prints the version. klog's flags (`--v=3`, \
                  `--logtostderr`, ...) are accepted and ignored: use --log-level."
)]
pub struct Args {
    /// Kubeconfig of the upper cluster (default: $KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// Time between rounds (Go durations such as `1m0s` work; 0 runs one round and exits;
    /// otherwise 1s to a year).
    #[arg(long, value_parser = parse_interval, default_value = "10s")]
    pub descheduling_interval: Duration,

    /// A `DeschedulerPolicy` file; its PodLifeTime `maxPodLifeTimeSeconds` sets the
    /// lifetime, its ReturnHome (`enabled`, `returnHomeAfterSeconds`, `maxMovesPerRound`,
    /// `maxMovesPerOwner`) the return home (other strategies are reported as ignored).
    #[arg(long)]
    pub policy_config_file: Option<PathBuf>,

    /// Log and emit `WouldReschedule` (and `WouldReturnHome`) events; change nothing else.
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true")]
    pub dry_run: bool,

    /// Label selector narrowing the virtual nodes (those labelled `type=virtual-kubelet`).
    #[arg(long, default_value = "")]
    pub node_selector: String,

    /// At most this many pods moved per node per round (0: no limit).
    #[arg(long, default_value_t = 0)]
    pub max_pods_to_evict_per_node: usize,

    /// Also move pods with local storage (hostPath, or any emptyDir, as the upstream
    /// descheduler counts it).
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true")]
    pub evict_local_storage_pods: bool,

    /// A pod still Pending this long after it was bound to a virtual node, and not placed
    /// by the lower cluster, is moved (the policy file wins; 1s to a year).
    #[arg(long, value_parser = parse_period, default_value = "180s")]
    pub max_pod_lifetime: Duration,

    /// Move burst pods back to regular nodes once these have had room for them for
    /// --return-home-after: evicted (PodDisruptionBudgets honoured) when the replacement
    /// would land on a regular node (the policy file's ReturnHome strategy wins).
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = false, default_missing_value = "true")]
    pub return_home: bool,

    /// How long the room on the regular nodes must have held, round after round, before a
    /// burst pod moves home (1s to a year).
    #[arg(long, value_parser = parse_period, default_value = "1m")]
    pub return_home_after: Duration,

    /// At most this many pods moved home per round (0: no limit).
    #[arg(long, default_value_t = 10)]
    pub return_home_max_per_round: usize,

    /// At most this many pods of one owner moved home per round; for an owner that no
    /// PodDisruptionBudget covers, also at most this many replacements not yet Ready.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..), default_value_t = 1)]
    pub return_home_max_per_owner: u32,

    /// Address of `/healthz` and `/metrics`.
    #[arg(long, value_parser = parse_addr, default_value = ":10258")]
    pub metrics_addr: SocketAddr,

    /// Elect a leader among replicas through a Lease (off: this replica always acts).
    #[arg(long, action = ArgAction::Set, num_args = 0..=1, default_value_t = true, default_missing_value = "true")]
    pub leader_elect: bool,

    /// Namespace of the leader-election Lease (default: this pod's, else kube-system).
    #[arg(long, env = "POD_NAMESPACE")]
    pub leader_elect_resource_namespace: Option<String>,

    /// Name of the leader-election Lease.
    #[arg(long, default_value = "tensile-descheduler")]
    pub leader_elect_resource_name: String,

    /// This replica's identity in the Lease (default: the host name).
    #[arg(long, env = "POD_NAME")]
    pub leader_elect_identity: Option<String>,

    /// How long a leader that stopped renewing keeps the Lease (longer than the renew
    /// deadline).
    #[arg(long, value_parser = duration_in(MIN_LEASE_TIMING, MAX_DURATION), default_value = "15s")]
    pub leader_elect_lease_duration: Duration,

    /// The leader stops acting when it could not renew for this long (longer than the
    /// retry period).
    #[arg(long, value_parser = duration_in(MIN_LEASE_TIMING, MAX_DURATION), default_value = "10s")]
    pub leader_elect_renew_deadline: Duration,

    /// How often the Lease is renewed or tried.
    #[arg(long, value_parser = duration_in(MIN_LEASE_TIMING, MAX_DURATION), default_value = "2s")]
    pub leader_elect_retry_period: Duration,

    /// Log filter (`info`, `debug`, or a tracing directive).
    #[arg(long, default_value = "info")]
    pub log_level: String,

    /// Log lines as `text` or `json`.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// `--descheduling-interval`: 0 (one round), or a period.
fn parse_interval(text: &str) -> Result<Duration, String> {
    match parse_duration(text)? {
        Duration::ZERO => Ok(Duration::ZERO),
        d if d < MIN_PERIOD => Err(format!(
            "must be 0 (one round) or at least {}",
            format_duration(MIN_PERIOD)
        )),
        d if d > MAX_DURATION => Err(format!("must be at most {}", format_duration(MAX_DURATION))),
        d => Ok(d),
    }
}

impl Args {
    /// What one flag cannot say alone: the leader-election timings must nest as client-go
    /// requires (lease duration > renew deadline > retry period), or a leader would lose
    /// the Lease while still acting, or give up before its first retry.
    pub fn check(&self) -> Result<(), clap::Error> {
        let timings = LeaseConfig {
            lease_duration: self.leader_elect_lease_duration,
            renew_deadline: self.leader_elect_renew_deadline,
            retry_period: self.leader_elect_retry_period,
            ..LeaseConfig::new("", "", "")
        };
        timings
            .check_timings()
            .map_err(|message| Args::command().error(ErrorKind::ValueValidation, message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(args: &[&str]) -> Vec<String> {
        std::iter::once("tensile-descheduler")
            .chain(args.iter().copied())
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn tensile_kube_command_line_parses() {
        let (kept, ignored) = strip_klog_flags(argv(&[
            "--kubeconfig=/etc/kube/config",
            "--descheduling-interval=1m0s",
            "--policy-config-file",
            "/policy.yaml",
            "--dry-run",
            "--node-selector=type=virtual-kubelet",
            "--max-pods-to-evict-per-node=5",
            "--evict-local-storage-pods",
            "--v=4",
            "-v",
            "2",
            "--logtostderr",
            "--klog.alsologtostderr=true",
        ]));
        assert_eq!(
            ignored,
            [
                "--v=4",
                "-v 2",
                "--logtostderr",
                "--klog.alsologtostderr=true"
            ]
        );
        let args = Args::try_parse_from(kept).unwrap();
        assert_eq!(args.descheduling_interval, Duration::from_secs(60));
        assert_eq!(args.policy_config_file, Some("/policy.yaml".into()));
        assert!(args.dry_run);
        assert!(args.evict_local_storage_pods);
        assert_eq!(args.max_pods_to_evict_per_node, 5);
        assert_eq!(args.node_selector, "type=virtual-kubelet");
        assert_eq!(args.max_pod_lifetime, Duration::from_secs(180));
        assert!(args.leader_elect);
    }

    #[test]
    fn defaults_and_bad_flags() {
        let args = Args::try_parse_from(argv(&[])).unwrap();
        assert_eq!(args.descheduling_interval, Duration::from_secs(10));
        assert!(!args.dry_run);
        assert!(!args.return_home);
        assert_eq!(args.return_home_after, Duration::from_secs(60));
        assert_eq!(args.return_home_max_per_round, 10);
        assert_eq!(args.return_home_max_per_owner, 1);
        args.check().unwrap();
        let args = Args::try_parse_from(argv(&[
            "--return-home",
            "--return-home-after=5s",
            "--return-home-max-per-round=0",
            "--return-home-max-per-owner=3",
        ]))
        .unwrap();
        assert!(args.return_home);
        assert_eq!(args.return_home_after, Duration::from_secs(5));
        assert_eq!(args.return_home_max_per_round, 0);
        assert_eq!(args.return_home_max_per_owner, 3);
        for bad in [
            &["--descheduling-interval=soon"][..],
            &["--max-pods-to-evict-per-node=-1"],
            &["--no-such-flag"],
            &["--max-pod-lifetime=3d"],
            &["--return-home-after=0"],
            &["--return-home-max-per-owner=0"],
            &["--return-home=maybe"],
        ] {
            let (kept, _) = strip_klog_flags(argv(bad));
            assert!(Args::try_parse_from(kept).is_err(), "{bad:?}");
        }
    }

    /// Zero or absurd durations are refused, naming the flag; 0 keeps its meaning where it
    /// has one.
    #[test]
    fn durations_are_checked() {
        let cases: [(&[&str], Result<(), &str>); 13] = [
            (&["--descheduling-interval=0"], Ok(())),
            (&["--leader-elect-retry-period=500ms"], Ok(())),
            (&["--descheduling-interval=1m0s"], Ok(())),
            (
                &["--descheduling-interval=1ns"],
                Err("--descheduling-interval"),
            ),
            (
                &["--descheduling-interval=9000h"],
                Err("--descheduling-interval"),
            ),
            (&["--max-pod-lifetime=0"], Err("--max-pod-lifetime")),
            (&["--max-pod-lifetime=3m0s"], Ok(())),
            (
                &["--leader-elect-retry-period=0"],
                Err("--leader-elect-retry-period"),
            ),
            (
                &["--leader-elect-renew-deadline=0s"],
                Err("--leader-elect-renew-deadline"),
            ),
            (
                &["--leader-elect-lease-duration=0"],
                Err("--leader-elect-lease-duration"),
            ),
            (
                &["--leader-elect-lease-duration=10s"],
                Err(
                    "--leader-elect-lease-duration (10s) must be longer than --leader-elect-renew-deadline (10s)",
                ),
            ),
            (
                &["--leader-elect-retry-period=10s"],
                Err(
                    "--leader-elect-renew-deadline (10s) must be longer than --leader-elect-retry-period (10s)",
                ),
            ),
            (
                &[
                    "--leader-elect-lease-duration=1m",
                    "--leader-elect-renew-deadline=30s",
                    "--leader-elect-retry-period=5s",
                ],
                Ok(()),
            ),
        ];
        for (flags, want) in cases {
            let (kept, _) = strip_klog_flags(argv(flags));
            let got = Args::try_parse_from(kept).and_then(|args| args.check());
            match (got, want) {
                (Ok(()), Ok(())) => {}
                (Err(error), Err(flag)) => {
                    let line = crate::cli::one_line(&error);
                    assert!(line.contains(flag), "{flags:?}: {line}");
                }
                (got, want) => panic!("{flags:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    /// Every flag tensile-kube's descheduler takes: its own, klog's Go flags and
    /// component-base's `--log-flush-frequency` (cobra normalises `_` to `-`).
    const TENSILE_KUBE_DESCHEDULER_FLAGS: &[&str] = &[
        "--descheduling-interval=1m0s",
        "--kubeconfig=/root/.kube/config",
        "--policy-config-file=/policy-dir/policy.yaml",
        "--dry-run",
        "--dry-run=false",
        "--node-selector=type=virtual-kubelet",
        "--max-pods-to-evict-per-node=5",
        "--evict-local-storage-pods",
        "--evict-local-storage-pods=true",
        "--log-flush-frequency=5s",
        "--v=3",
        "-v=3",
        "--add-dir-header",
        "--alsologtostderr",
        "--log-backtrace-at=main.go:1",
        "--log-dir=/tmp",
        "--log-file=/tmp/d.log",
        "--log-file-max-size=1800",
        "--logtostderr",
        "--skip-headers",
        "--skip-log-headers",
        "--stderrthreshold=2",
        "--vmodule=x=4",
        "--log-format=json",
    ];

    /// The args of tensile-kube's `manifeasts/descheduler.yaml`.
    const TENSILE_KUBE_DESCHEDULER_MANIFEST: &[&str] = &[
        "--policy-config-file=/policy-dir/policy.yaml",
        "--v=3",
        "--descheduling-interval=10s",
    ];

    #[test]
    fn every_tensile_kube_descheduler_flag_is_accepted_alone() {
        for flag in TENSILE_KUBE_DESCHEDULER_FLAGS {
            let (kept, _) = strip_klog_flags(argv(&[flag]));
            if let Err(error) = Args::try_parse_from(kept) {
                panic!("{flag}: {}", crate::cli::one_line(&error));
            }
        }
        let (kept, ignored) = strip_klog_flags(argv(TENSILE_KUBE_DESCHEDULER_MANIFEST));
        let args = Args::try_parse_from(kept).unwrap();
        assert_eq!(args.descheduling_interval, Duration::from_secs(10));
        assert_eq!(ignored, ["--v=3"]);
    }
}
