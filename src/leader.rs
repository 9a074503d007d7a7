//! Leader election on a coordination.k8s.io/v1 Lease, for binaries that run several
//! replicas and must act from one only (the descheduler, virtual-node with `--leader-elect`).
//!
//! Like client-go's leaderelection: a replica takes the Lease when it is free or its
//! holder has not renewed it for `lease_duration` (measured on the local clock, from when
//! this replica last saw the record change, so clocks need not agree); the holder renews
//! every `retry_period`, and stops acting at once when it could not renew within
//! `renew_deadline`. On shutdown the holder releases the Lease so another takes over
//! without waiting for it to expire. Writes use the Lease's resourceVersion, so two
//! replicas never both win.
//!
//! Why a leader that could not renew has stopped before another replica can hold the
//! Lease: a renewal counts from the start `s` of its attempt, so the Lease was written no
//! earlier than `s`. A standby takes it only once it has seen one record unchanged for the
//! written `leaseDurationSeconds` (the lease duration, rounded up), and its write carries
//! the resourceVersion it read: the record it waited on is the leader's last write, seen
//! at `s` or later, so it takes over at `s + lease_duration` at the earliest. The leader
//! stops at `s + renew_deadline`, sooner since renew deadline < lease duration; the margin
//! between the two absorbs the replicas' clocks running at slightly different rates and
//! the process's exit. Counted from the answer instead (`s + d`), an answer `d` late would
//! let the leader act until `s + d + renew_deadline`, past the takeover once
//! `d > lease_duration - renew_deadline`. (client-go takes its `observedTime` when the
//! answer comes and counts its renew deadline from the next round's start: the same
//! window.)

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// Which Lease, who we are, and the timings.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This replica's identity (e.g. the pod name), written as the holder.
    pub identity: String,
    /// How long a holder that stopped renewing keeps the Lease.
    pub lease_duration: Duration,
    /// The holder stops acting when it could not renew for this long (< lease_duration).
    pub renew_deadline: Duration,
    /// How often to renew, or to try to acquire.
    pub retry_period: Duration,
}

/// The shortest lease duration: the Lease holds whole seconds, and a duration written as 0
/// lets every standby take a live Lease at once.
pub const MIN_LEASE_DURATION: Duration = Duration::from_secs(1);

impl LeaseConfig {
    /// client-go's defaults: 15 s lease, 10 s renew deadline, 2 s retry period.
    pub fn new(namespace: &str, name: &str, identity: &str) -> Self {
        Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            identity: identity.to_owned(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }

    /// Fails, naming the flags, unless lease duration > renew deadline > retry period
    /// (as client-go requires) and the lease duration is at least [`MIN_LEASE_DURATION`]:
    /// otherwise a leader could lose the Lease while still acting, or give up before its
    /// first retry.
    pub fn check_timings(&self) -> Result<(), String> {
        use crate::duration::format_duration;
        if self.lease_duration < MIN_LEASE_DURATION {
            return Err(format!(
                "--leader-elect-lease-duration ({}) must be at least {}: the Lease holds whole seconds",
                format_duration(self.lease_duration),
                format_duration(MIN_LEASE_DURATION)
            ));
        }
        if self.lease_duration <= self.renew_deadline {
            return Err(format!(
                "--leader-elect-lease-duration ({}) must be longer than --leader-elect-renew-deadline ({})",
                format_duration(self.lease_duration),
                format_duration(self.renew_deadline)
            ));
        }
        if self.renew_deadline <= self.retry_period {
            return Err(format!(
                "--leader-elect-renew-deadline ({}) must be longer than --leader-elect-retry-period ({})",
                format_duration(self.renew_deadline),
                format_duration(self.retry_period)
            ));
        }
        Ok(())
    }
}

/// Where the service account's namespace is mounted in a pod.
const SERVICE_ACCOUNT_NAMESPACE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// The Lease's namespace: `flag` (`--leader-elect-resource-namespace` or $POD_NAMESPACE),
/// else this pod's service account namespace, else `kube-system`.
pub fn lease_namespace(flag: Option<&str>) -> String {
    let mounted = std::fs::read_to_string(SERVICE_ACCOUNT_NAMESPACE).ok();
    first_named([flag, mounted.as_deref()]).unwrap_or_else(|| "kube-system".into())
}

/// This replica's identity: `flag` (`--leader-elect-identity` or $POD_NAME), else the host
/// name with a random suffix, so two processes on one host never share it.
pub fn identity(flag: Option<&str>) -> String {
    use std::hash::{BuildHasher, Hasher};
    if let Some(identity) = first_named([flag]) {
        return identity;
    }
    let env_host = std::env::var("HOSTNAME").ok();
    let file_host = std::fs::read_to_string("/etc/hostname").ok();
    let host =
        first_named([env_host.as_deref(), file_host.as_deref()]).unwrap_or_else(|| "host".into());
    // std's hasher keys are random per process: a random suffix without another crate.
    let suffix = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    format!("{host}_{:08x}", suffix & 0xffff_ffff)
}

/// The first of `candidates` that is not blank, trimmed.
fn first_named<const N: usize>(candidates: [Option<&str>; N]) -> Option<String> {
    candidates
        .into_iter()
        .flatten()
        .map(str::trim)
        .find(|c| !c.is_empty())
        .map(str::to_owned)
}

/// What to do with the Lease as last read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// It does not exist: create it, held by us.
    Create,
    /// We hold it: renew it.
    Renew,
    /// It is free or expired: take it.
    Take,
    /// Another holds it and it is still live.
    Wait,
}

/// The part of the Lease whose change shows that its holder is alive.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Record {
    holder: Option<String>,
    renew_time: Option<Timestamp>,
    transitions: Option<i32>,
}

/// The pure decision logic: what this replica saw of the Lease, and when.
#[derive(Debug)]
pub struct Elector {
    identity: String,
    lease_duration: Duration,
    observed: Option<(Record, Instant)>,
}

impl Elector {
    /// An elector for `identity` that considers a Lease unrenewed for `lease_duration` expired.
    pub fn new(identity: &str, lease_duration: Duration) -> Self {
        Self {
            identity: identity.to_owned(),
            lease_duration,
            observed: None,
        }
    }

    /// Decides on the Lease as read at `now` (`None`: it does not exist).
    pub fn decide(&mut self, lease: Option<&LeaseSpec>, now: Instant) -> Decision {
        let Some(spec) = lease else {
            self.observed = None;
            return Decision::Create;
        };
        let record = Record {
            holder: spec.holder_identity.clone().filter(|h| !h.is_empty()),
            renew_time: spec.renew_time.as_ref().map(|t| t.0),
            transitions: spec.lease_transitions,
        };
        let Some(holder) = record.holder.clone() else {
            self.observed = Some((record, now));
            return Decision::Take;
        };
        if holder == self.identity {
            self.observed = Some((record, now));
            return Decision::Renew;
        }
        let seen_at = match &self.observed {
            Some((seen, at)) if *seen == record => *at,
            _ => {
                self.observed = Some((record, now));
                now
            }
        };
        // The holder's own duration counts, so replicas configured apart still agree; a
        // zero one (written by older versions for a sub-second duration) is no duration.
        let duration = spec
            .lease_duration_seconds
            .filter(|s| *s > 0)
            .and_then(|s| u64::try_from(s).ok())
            .map_or(self.lease_duration, Duration::from_secs);
        if now.saturating_duration_since(seen_at) >= duration {
            Decision::Take
        } else {
            Decision::Wait
        }
    }
}

/// Whether a holder that last renewed at `last_renew` may still act at `now`.
pub fn still_leader(last_renew: Option<Instant>, renew_deadline: Duration, now: Instant) -> bool {
    last_renew.is_some_and(|at| now.saturating_duration_since(at) < renew_deadline)
}

/// Why a Lease write failed.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The API call failed (a conflict means another replica wrote first).
    #[error("lease {namespace}/{name} (upper): {source}")]
    Api {
        /// Namespace of the Lease.
        namespace: String,
        /// Name of the Lease.
        name: String,
        /// The error.
        source: kube::Error,
    },
    /// The API call did not answer in time.
    #[error("lease {namespace}/{name} (upper): no answer within the renew deadline")]
    Timeout {
        /// Namespace of the Lease.
        namespace: String,
        /// Name of the Lease.
        name: String,
    },
}

/// Why a replica must stop writing at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Lapse {
    /// It led, and could not renew the Lease within the renew deadline.
    #[error("the lease was not renewed within the renew deadline")]
    Lost,
    /// The election itself ended (its task panicked, or was dropped): nothing renews the
    /// Lease, and this replica would never know it lost it.
    #[error("the election task ended: nothing renews the lease")]
    Ended,
}

/// Follows `leading` (from [`elect`]) until `stop`, passing each change to `on_change`.
/// `Err` the moment the Lease lapses before `stop`: leading turns from true to false, or
/// the election ends.
pub async fn follow(
    mut leading: watch::Receiver<bool>,
    stop: &CancellationToken,
    mut on_change: impl FnMut(bool),
) -> Result<(), Lapse> {
    let mut was_leading = false;
    loop {
        tokio::select! {
            () = stop.cancelled() => return Ok(()),
            // The sender is dropped only when the election ends, which it does on `stop`.
            changed = leading.changed() => if changed.is_err() {
                return if stop.is_cancelled() { Ok(()) } else { Err(Lapse::Ended) };
            },
        }
        let leads = *leading.borrow_and_update();
        if was_leading && !leads && !stop.is_cancelled() {
            return Err(Lapse::Lost);
        }
        was_leading = leads;
        on_change(leads);
    }
}

/// Runs the election until `shutdown`, publishing "we are the leader" on the returned
/// receiver; the future must be polled (spawned) for the election to run. On shutdown it
/// releases the Lease if held, then publishes `false`.
pub fn elect(
    client: Client,
    config: LeaseConfig,
    shutdown: CancellationToken,
) -> (watch::Receiver<bool>, impl Future<Output = ()> + Send) {
    let (tx, rx) = watch::channel(false);
    (rx, run(client, config, tx, shutdown))
}

async fn run(
    client: Client,
    config: LeaseConfig,
    leader: watch::Sender<bool>,
    shutdown: CancellationToken,
) {
    let leases: Api<Lease> = Api::namespaced(client, &config.namespace);
    let mut elector = Elector::new(&config.identity, config.lease_duration);
    let mut last_renew: Option<Instant> = None;
    loop {
        // A renewal counts from here, before anything is sent (see the module's doc).
        let started = Instant::now();
        // A leader's attempt may last only until its renew deadline: past it, it must
        // already have stopped acting, however long the API server takes to answer.
        let budget = match last_renew {
            Some(at) => config
                .renew_deadline
                .saturating_sub(started.saturating_duration_since(at)),
            None => config.renew_deadline,
        };
        let attempt = tokio::time::timeout(budget, try_once(&leases, &config, &mut elector));
        let outcome = tokio::select! {
            () = shutdown.cancelled() => break,
            outcome = attempt => outcome.unwrap_or_else(|_| Err(LeaseError::Timeout {
                namespace: config.namespace.clone(),
                name: config.name.clone(),
            })),
        };
        let now = Instant::now();
        match outcome {
            Ok(true) => last_renew = Some(started),
            Ok(false) => last_renew = None,
            Err(error) => debug!(%error, identity = %config.identity, "lease not renewed"),
        }
        let is_leader = still_leader(last_renew, config.renew_deadline, now);
        if !is_leader {
            last_renew = None;
        }
        leader.send_if_modified(|was| {
            if *was == is_leader {
                return false;
            }
            if is_leader {
                info!(lease = %config.name, identity = %config.identity, "became the leader");
            } else {
                warn!(lease = %config.name, identity = %config.identity, "no longer the leader");
            }
            *was = is_leader;
            true
        });
        // While leading, wake up in time to stop acting at the renew deadline.
        let wait = match last_renew {
            Some(at) => config.retry_period.min(
                config
                    .renew_deadline
                    .saturating_sub(now.saturating_duration_since(at)),
            ),
            None => config.retry_period,
        };
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = tokio::time::sleep(wait) => {}
        }
    }
    let was_leader = *leader.borrow();
    leader.send_replace(false);
    if was_leader {
        release(&leases, &config).await;
    }
}

/// One read-decide-write. Ok(true): we hold the Lease now.
async fn try_once(
    leases: &Api<Lease>,
    config: &LeaseConfig,
    elector: &mut Elector,
) -> Result<bool, LeaseError> {
    let api_error = |source| LeaseError::Api {
        namespace: config.namespace.clone(),
        name: config.name.clone(),
        source,
    };
    let current = leases.get_opt(&config.name).await.map_err(api_error)?;
    let decision = elector.decide(
        current.as_ref().and_then(|l| l.spec.as_ref()),
        Instant::now(),
    );
    let now = MicroTime(Timestamp::now());
    let duration = whole_seconds(config.lease_duration);
    match decision {
        Decision::Wait => Ok(false),
        Decision::Create => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(config.name.clone()),
                    namespace: Some(config.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(config.identity.clone()),
                    lease_duration_seconds: Some(duration),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            leases
                .create(&PostParams::default(), &lease)
                .await
                .map_err(api_error)?;
            Ok(true)
        }
        Decision::Renew | Decision::Take => {
            let Some(mut lease) = current else {
                return Ok(false);
            };
            let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
            if decision == Decision::Take {
                spec.holder_identity = Some(config.identity.clone());
                spec.acquire_time = Some(now.clone());
                spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
            }
            spec.lease_duration_seconds = Some(duration);
            spec.renew_time = Some(now);
            // `replace` carries the resourceVersion read above: a concurrent writer wins,
            // we get a conflict and try again next period.
            leases
                .replace(&config.name, &PostParams::default(), &lease)
                .await
                .map_err(api_error)?;
            Ok(true)
        }
    }
}

/// `duration` as the Lease's `leaseDurationSeconds`, rounded up: a standby then waits at
/// least as long as the holder counts on, never less.
fn whole_seconds(duration: Duration) -> i32 {
    let seconds = duration
        .as_secs()
        .saturating_add(u64::from(duration.subsec_nanos() > 0));
    i32::try_from(seconds).unwrap_or(i32::MAX)
}

/// Gives the Lease up (holder cleared), so another replica takes it at once.
async fn release(leases: &Api<Lease>, config: &LeaseConfig) {
    let released = async {
        let Some(mut lease) = leases.get_opt(&config.name).await? else {
            return Ok(());
        };
        let Some(spec) = lease.spec.as_mut() else {
            return Ok(());
        };
        if spec.holder_identity.as_deref() != Some(config.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        leases
            .replace(&config.name, &PostParams::default(), &lease)
            .await
            .map(|_| ())
    };
    match tokio::time::timeout(config.renew_deadline, released).await {
        Ok(Ok(())) => info!(lease = %config.name, identity = %config.identity, "lease released"),
        Ok(Err(error)) => {
            warn!(lease = %config.name, %error, cluster = "upper", "releasing the lease")
        }
        Err(_) => warn!(lease = %config.name, cluster = "upper", "releasing the lease timed out"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(holder: Option<&str>, renew_second: i64, duration: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: holder.map(str::to_owned),
            renew_time: Some(MicroTime(Timestamp::from_second(renew_second).unwrap())),
            lease_duration_seconds: Some(duration),
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn decisions() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        // (steps of (lease, seconds after t0), expected decision at each step)
        type Step = (Option<LeaseSpec>, u64, Decision);
        let cases: Vec<(&str, Vec<Step>)> = vec![
            ("missing", vec![(None, 0, Decision::Create)]),
            (
                "ours",
                vec![(Some(spec(Some("me"), 1, 15)), 0, Decision::Renew)],
            ),
            (
                "released",
                vec![(Some(spec(None, 1, 1)), 0, Decision::Take)],
            ),
            (
                "empty holder",
                vec![(Some(spec(Some(""), 1, 15)), 0, Decision::Take)],
            ),
            (
                "another renewing",
                vec![
                    (Some(spec(Some("other"), 1, 15)), 0, Decision::Wait),
                    (Some(spec(Some("other"), 2, 15)), 14, Decision::Wait),
                    (Some(spec(Some("other"), 3, 15)), 28, Decision::Wait),
                ],
            ),
            (
                "another stopped renewing",
                vec![
                    (Some(spec(Some("other"), 1, 15)), 0, Decision::Wait),
                    (Some(spec(Some("other"), 1, 15)), 14, Decision::Wait),
                    (Some(spec(Some("other"), 1, 15)), 15, Decision::Take),
                ],
            ),
            (
                "the holder's duration counts",
                vec![
                    (Some(spec(Some("other"), 1, 60)), 0, Decision::Wait),
                    (Some(spec(Some("other"), 1, 60)), 30, Decision::Wait),
                    (Some(spec(Some("other"), 1, 60)), 60, Decision::Take),
                ],
            ),
            (
                "a holder's zero duration is ours",
                vec![
                    (Some(spec(Some("other"), 1, 0)), 0, Decision::Wait),
                    (Some(spec(Some("other"), 1, 0)), 14, Decision::Wait),
                    (Some(spec(Some("other"), 1, 0)), 15, Decision::Take),
                ],
            ),
            (
                "a stale clock on the holder does not matter",
                vec![(Some(spec(Some("other"), -100_000, 15)), 0, Decision::Wait)],
            ),
        ];
        for (name, steps) in cases {
            let mut elector = Elector::new("me", s(15));
            for (i, (lease, at, want)) in steps.into_iter().enumerate() {
                assert_eq!(
                    elector.decide(lease.as_ref(), t0 + s(at)),
                    want,
                    "{name}, step {i}"
                );
            }
        }
    }

    #[test]
    fn timings_must_nest() {
        let ms = Duration::from_millis;
        let cases = [
            ((15_000, 10_000, 2_000), true),
            ((4_000, 3_000, 500), true),
            ((10_000, 10_000, 2_000), false),
            ((10_000, 12_000, 2_000), false),
            ((10_000, 2_000, 2_000), false),
            ((10_000, 1_000, 2_000), false),
            // The Lease holds whole seconds: under one, nothing sensible can be written.
            ((1_000, 600, 200), true),
            ((900, 600, 200), false),
        ];
        for ((lease, renew, retry), ok) in cases {
            let config = LeaseConfig {
                lease_duration: ms(lease),
                renew_deadline: ms(renew),
                retry_period: ms(retry),
                ..LeaseConfig::new("ns", "name", "me")
            };
            assert_eq!(
                config.check_timings().is_ok(),
                ok,
                "{lease} {renew} {retry}"
            );
        }
    }

    #[test]
    fn names_fall_back_in_order() {
        let cases: [([Option<&str>; 2], Option<&str>); 5] = [
            ([Some("flag"), Some("file")], Some("flag")),
            ([None, Some("file\n")], Some("file")),
            ([Some(""), Some("file")], Some("file")),
            ([Some("  "), None], None),
            ([None, None], None),
        ];
        for (candidates, want) in cases {
            assert_eq!(first_named(candidates).as_deref(), want, "{candidates:?}");
        }
        assert_eq!(identity(Some("pod-a")), "pod-a");
        assert_ne!(identity(None), identity(None), "two processes on one host");
    }

    #[test]
    fn the_lease_duration_is_written_rounded_up_to_whole_seconds() {
        let cases = [
            (Duration::from_millis(500), 1),
            (Duration::from_secs(1), 1),
            (Duration::from_millis(2_900), 3),
            (Duration::from_secs(15), 15),
            (Duration::from_secs(15) + Duration::from_nanos(1), 16),
            (Duration::from_secs(u64::from(u32::MAX)), i32::MAX),
            (Duration::MAX, i32::MAX),
        ];
        for (duration, want) in cases {
            assert_eq!(whole_seconds(duration), want, "{duration:?}");
        }
    }

    /// What happens to the election, in [`follow_outcomes`].
    #[derive(Clone, Copy, Debug)]
    enum Step {
        /// It publishes whether this replica leads.
        Leads(bool),
        /// Its task panics, dropping the sender.
        Panics,
        /// Shutdown: `stop` is cancelled.
        Stops,
    }

    #[tokio::test]
    async fn follow_outcomes() {
        use Step::{Leads, Panics, Stops};
        // (what happens, how `follow` ends: `None` while it still runs)
        type Case = (&'static str, &'static [Step], Option<Result<(), Lapse>>);
        let cases: [Case; 7] = [
            ("stopped while leading", &[Leads(true), Stops], Some(Ok(()))),
            ("stopped standing by", &[Stops], Some(Ok(()))),
            ("still leading", &[Leads(true)], None),
            ("lost", &[Leads(true), Leads(false)], Some(Err(Lapse::Lost))),
            (
                "released after stop",
                &[Leads(true), Stops, Leads(false), Panics],
                Some(Ok(())),
            ),
            (
                "the election panics while leading",
                &[Leads(true), Panics],
                Some(Err(Lapse::Ended)),
            ),
            (
                "the election panics standing by",
                &[Panics],
                Some(Err(Lapse::Ended)),
            ),
        ];
        for (name, steps, want) in cases {
            let (tx, rx) = watch::channel(false);
            let stop = CancellationToken::new();
            let follower = tokio::spawn({
                let stop = stop.clone();
                async move { follow(rx, &stop, |_| {}).await }
            });
            let mut tx = Some(tx);
            for step in steps {
                match step {
                    Leads(leads) => {
                        if let Some(tx) = &tx {
                            tx.send_replace(*leads);
                        }
                    }
                    Panics => {
                        let sender = tx.take();
                        let task = tokio::spawn(async move {
                            let _sender = sender;
                            panic!("injected");
                        });
                        assert!(task.await.is_err(), "{name}");
                    }
                    Stops => stop.cancel(),
                }
                // The follower sees each step before the next (a watch keeps the last only).
                for _ in 0..10 {
                    tokio::task::yield_now().await;
                }
            }
            let got = follower.is_finished().then_some(());
            let got = match got {
                Some(()) => Some(follower.await.unwrap()),
                None => {
                    follower.abort();
                    None
                }
            };
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn the_leader_stops_at_the_renew_deadline() {
        let t0 = Instant::now();
        let deadline = Duration::from_secs(10);
        assert!(!still_leader(None, deadline, t0));
        assert!(still_leader(
            Some(t0),
            deadline,
            t0 + Duration::from_secs(9)
        ));
        assert!(!still_leader(Some(t0), deadline, t0 + deadline));
    }
}
