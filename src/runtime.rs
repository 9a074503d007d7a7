//! The async runtime's worker threads.
//!
//! Tokio starts one worker per core. A process serving several members (a federated
//! process, `--members-namespace`) does on those workers what N single-cluster processes
//! do on N times as many: on a machine shared with other busy processes (the lower
//! clusters' own components beside it, other pods on its node) the OS shares the cores by
//! runnable thread, so the one process got a fraction of what the N got, and every member's
//! tasks waited for its two workers. `tensile-bench --lower-clusters 5 --pods 1000` (2
//! cores, debug build): a woken task waited 61 ms on average (p99 589 ms) for a worker
//! in the one process, 10 ms (p99 96 ms) in five processes; the lower requests' answers
//! were read 3 times later. A federated process therefore starts at least
//! [`FEDERATED_MIN_WORKERS`] workers. More workers cost memory (jemalloc's caches and
//! arenas per thread): at 5 members and 1000 pods, 8 workers brought the runtime lag to
//! the five processes' (10 / 144 ms) for +4 MiB idle and +7 to 13 MiB with every pod
//! Running; 4 workers kept the memory within 4 % of 2 workers' (lag 48 / 480 ms, against
//! 19 / 247 ms for five processes in that run). `TOKIO_WORKER_THREADS` chooses.

use std::ffi::OsString;

/// Worker threads a federated process starts at least, whatever the core count.
pub const FEDERATED_MIN_WORKERS: usize = 4;

/// Tokio's own variable for the worker count: when set, it decides.
pub const WORKERS_ENV: &str = "TOKIO_WORKER_THREADS";

/// The variable of `--members-namespace` (`crate::cli::Args::members_namespace`).
pub const MEMBERS_NAMESPACE_ENV: &str = "TENSILE_MEMBERS_NAMESPACE";

/// The worker count to set for a process started with `argv` on `cores` cores, given the
/// values of [`WORKERS_ENV`] and [`MEMBERS_NAMESPACE_ENV`]: `None` leaves it to tokio
/// (one per core, or [`WORKERS_ENV`]); a federated process (`--members-namespace` given
/// on the command line or in its variable) gets at least [`FEDERATED_MIN_WORKERS`].
pub fn workers(
    cores: usize,
    argv: &[OsString],
    workers_env: Option<&OsString>,
    members_env: Option<&OsString>,
) -> Option<usize> {
    if workers_env.is_some() {
        return None;
    }
    let flag = argv.iter().any(|arg| {
        arg.to_str().is_some_and(|arg| {
            arg == "--members-namespace" || arg.starts_with("--members-namespace=")
        })
    });
    let federated = flag || members_env.is_some_and(|value| !value.is_empty());
    federated.then_some(cores.max(FEDERATED_MIN_WORKERS))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flag and variable looked for are `--members-namespace`'s.
    #[test]
    fn the_flag_and_variable_are_members_namespaces() {
        use clap::CommandFactory;
        let command = crate::cli::Args::command();
        let arg = command
            .get_arguments()
            .find(|a| a.get_id() == "members_namespace")
            .expect("--members-namespace");
        assert_eq!(arg.get_long(), Some("members-namespace"));
        assert_eq!(
            arg.get_env(),
            Some(std::ffi::OsStr::new(MEMBERS_NAMESPACE_ENV))
        );
    }

    #[test]
    fn a_federated_process_gets_at_least_the_minimum() {
        let os = |s: &str| OsString::from(s);
        let argv = |args: &[&str]| args.iter().map(|a| os(a)).collect::<Vec<_>>();
        let min = FEDERATED_MIN_WORKERS;
        // (case, cores, argv, TOKIO_WORKER_THREADS, TENSILE_MEMBERS_NAMESPACE, want)
        let cases = [
            (
                "single cluster",
                2,
                argv(&["vk", "--nodename", "a"]),
                None,
                None,
                None,
            ),
            (
                "flag",
                2,
                argv(&["vk", "--members-namespace", "m"]),
                None,
                None,
                Some(min),
            ),
            (
                "flag=",
                2,
                argv(&["vk", "--members-namespace=m"]),
                None,
                None,
                Some(min),
            ),
            ("variable", 2, argv(&["vk"]), None, Some(os("m")), Some(min)),
            ("empty variable", 2, argv(&["vk"]), None, Some(os("")), None),
            (
                "more cores",
                32,
                argv(&["vk", "--members-namespace=m"]),
                None,
                None,
                Some(32),
            ),
            (
                "tokio's variable decides",
                2,
                argv(&["vk", "--members-namespace=m"]),
                Some(os("3")),
                None,
                None,
            ),
            (
                "a value, not the flag",
                2,
                argv(&["vk", "--nodename", "--members-namespace-x"]),
                None,
                None,
                None,
            ),
        ];
        for (case, cores, argv, workers_env, members_env, want) in cases {
            assert_eq!(
                workers(cores, &argv, workers_env.as_ref(), members_env.as_ref()),
                want,
                "{case}"
            );
        }
    }
}
