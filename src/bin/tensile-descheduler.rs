//! tensile-descheduler: gives upper pods that a lower cluster cannot place another
//! chance. Wiring only; the logic is in `tensile::descheduler`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use kube::runtime::events::{Recorder, Reporter};
use tensile::cli::{CompatCommand, USAGE_ERROR, compat_command, parse_args, usage_exit};
use tensile::clusters::{self, RateLimit};
use tensile::descheduler::cli::{Args, strip_klog_flags};
use tensile::descheduler::home::ReturnHome;
use tensile::descheduler::metrics::{self, Metrics};
use tensile::descheduler::select::{Policy, parse_policy};
use tensile::descheduler::{Config, Descheduler};
use tensile::leader::{self, LeaseConfig};
use tensile::logging;
use tensile::shutdown::Tasks;
use tensile::side::Side;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

const PROGRAM: &str = "tensile-descheduler";

#[tokio::main]
async fn main() -> ExitCode {
    // Usage errors (flags, policy file) are one line and exit with 2, like Go's flag package.
    let argv: Vec<_> = std::env::args_os().collect();
    if compat_command(&argv, false) == Some(CompatCommand::Version) {
        println!("{PROGRAM} {}", env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    let (argv, ignored) = strip_klog_flags(argv);
    let args = match parse_args::<Args>(PROGRAM, argv) {
        Ok(args) => args,
        Err(status) => return status,
    };
    if let Err(error) = args.check() {
        return usage_exit(PROGRAM, &error);
    }
    logging::init(&args.log_level, args.log_format);
    logging::log_ignored_flags(&ignored);
    let (policy, return_home) = match policy(&args) {
        Ok(policy) => policy,
        Err(message) => {
            eprintln!("{PROGRAM}: {message}");
            return ExitCode::from(USAGE_ERROR);
        }
    };
    match run(args, policy, return_home).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{PROGRAM}: {message}");
            ExitCode::FAILURE
        }
    }
}

/// What a round does: the flags, and over them what the policy file sets.
fn policy(args: &Args) -> Result<(Policy, Option<ReturnHome>), String> {
    let mut return_home = ReturnHome {
        after: args.return_home_after,
        max_per_round: (args.return_home_max_per_round > 0)
            .then_some(args.return_home_max_per_round),
        max_per_owner: usize::try_from(args.return_home_max_per_owner).unwrap_or(usize::MAX),
    };
    let mut return_home_enabled = args.return_home;
    let mut policy = Policy {
        max_pod_lifetime: args.max_pod_lifetime,
        max_pods_per_node: (args.max_pods_to_evict_per_node > 0)
            .then_some(args.max_pods_to_evict_per_node),
        evict_local_storage_pods: args.evict_local_storage_pods,
    };
    if let Some(path) = &args.policy_config_file {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read --policy-config-file {shown}: {e}"))?;
        let file = parse_policy(&shown, &text).map_err(|e| e.to_string())?;
        for name in &file.ignored_strategies {
            warn!(strategy = %name, "policy strategy ignored: tensile runs PodLifeTime only");
        }
        if let Some(lifetime) = file.max_pod_lifetime {
            policy.max_pod_lifetime = lifetime;
        }
        if let Some(file) = file.return_home {
            return_home_enabled = file.enabled;
            if let Some(after) = file.after {
                return_home.after = after;
            }
            if let Some(max) = file.max_per_round {
                return_home.max_per_round = (max > 0).then_some(max);
            }
            if let Some(max) = file.max_per_owner {
                return_home.max_per_owner = usize::try_from(max).unwrap_or(usize::MAX);
            }
        }
    }
    Ok((policy, return_home_enabled.then_some(return_home)))
}

async fn run(args: Args, policy: Policy, return_home: Option<ReturnHome>) -> Result<(), String> {
    let mut config = clusters::load_config(Side::Upper, args.kubeconfig.as_deref())
        .await
        .map_err(|e| e.to_string())?;
    // A PodDisruptionBudget refuses an eviction with 429, which the client would retry 15
    // times, backing off for minutes, while the round waits: a refusal is retried next
    // round instead, as is every other failed call of a round.
    config.default_retry = false;
    let limit = RateLimit {
        qps: 50.0,
        burst: 100,
    };
    let upper = clusters::connect(
        Side::Upper,
        config,
        limit,
        Arc::new(tensile::metrics::Metrics::default()),
        None,
    )
    .await
    .map_err(|e| e.to_string())?;
    let listener = tensile::metrics::bind(args.metrics_addr).await?;
    let identity = args
        .leader_elect_identity
        .clone()
        .filter(|i| !i.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
        .unwrap_or_else(|| format!("tensile-descheduler-{}", std::process::id()));
    info!(
        upper = %upper.server, %identity, interval = ?args.descheduling_interval,
        lifetime = ?policy.max_pod_lifetime, dry_run = args.dry_run, ?return_home, "starting"
    );

    let shutdown = CancellationToken::new();
    tokio::spawn(tensile::shutdown::on_signals(shutdown.clone()));
    let mut tasks = Tasks::new(shutdown.clone());
    let metrics = Arc::new(Metrics::default());
    tasks.spawn_fallible(
        "metrics server",
        metrics::serve(listener, metrics.clone(), shutdown.clone()),
    );

    // The election outlives the descheduler's draining: it stops on `election_stop`, once
    // no round runs any more, and then gives the Lease up.
    let election_stop = CancellationToken::new();
    let (leader, always_leader) = if args.leader_elect {
        let namespace = args
            .leader_elect_resource_namespace
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| "kube-system".into());
        let lease = LeaseConfig {
            lease_duration: args.leader_elect_lease_duration,
            renew_deadline: args.leader_elect_renew_deadline,
            retry_period: args.leader_elect_retry_period,
            ..LeaseConfig::new(&namespace, &args.leader_elect_resource_name, &identity)
        };
        let (rx, election) = leader::elect(upper.client.clone(), lease, election_stop.clone());
        tasks.spawn("leader election", election);
        (rx, None)
    } else {
        let (tx, rx) = watch::channel(true);
        // Held until the end of `run`: the receiver always reads `true`.
        (rx, Some(tx))
    };
    {
        let (metrics, mut leader, stop) = (metrics.clone(), leader.clone(), shutdown.clone());
        tasks.spawn("leader gauge", async move {
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    changed = leader.changed() => if changed.is_err() { return },
                }
                metrics.leader.set(i64::from(*leader.borrow()));
            }
        });
    }
    let reporter = Reporter {
        controller: "tensile-descheduler".into(),
        instance: Some(identity.clone()),
    };
    let descheduler = Descheduler::new(
        upper.client.clone(),
        Recorder::new(upper.client.clone(), reporter),
        Config {
            node_selector: args.node_selector.clone(),
            policy,
            dry_run: args.dry_run,
            interval: args.descheduling_interval,
            return_home,
        },
        metrics.clone(),
    );
    let stop = shutdown.clone();
    tasks.spawn("descheduler", async move {
        if args.descheduling_interval == Duration::ZERO {
            // tensile-kube's meaning of 0: one round, then exit.
            let mut waiting = leader.clone();
            // The guard `wait_for` returns locks the channel: drop it before the round.
            let lead = tokio::select! {
                () = stop.cancelled() => false,
                ready = waiting.wait_for(|l| *l) => ready.is_ok(),
            };
            if lead && let Err(e) = descheduler.round(&leader, &stop).await {
                error!(error = %e, "round failed");
            }
        } else {
            descheduler.run(leader.clone(), stop.clone()).await;
        }
        // Drained: everything stops, and the election gives the Lease up so another
        // replica takes over at once.
        stop.cancel();
        election_stop.cancel();
    });
    let outcome = tasks.supervise().await;
    drop(always_leader);
    info!("stopped");
    outcome.map_err(|failure| failure.to_string())
}
