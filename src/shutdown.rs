//! Drain-style shutdown shared by tensile's binaries, and the supervision of their
//! long-running tasks: one that fails takes the process down with a non-zero status.

use std::collections::HashMap;
use std::time::Duration;

use tokio::task::{Id, JoinError, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, error, info_span, warn};

/// First SIGTERM/SIGINT cancels `shutdown`: the process drains (stops watching or
/// accepting, finishes work in flight). A second one exits at once (status 130).
pub async fn on_signals(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutting down (signal again to exit at once)");
    shutdown.cancel();
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    std::process::exit(130);
}

/// How a task ended abnormally.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TaskFailure {
    /// It panicked.
    #[error("task {task:?} panicked: {message}")]
    Panicked {
        /// The task's name.
        task: &'static str,
        /// The panic's message.
        message: String,
    },
    /// It returned an error.
    #[error("task {task:?} failed: {error}")]
    Failed {
        /// The task's name.
        task: &'static str,
        /// What it returned.
        error: String,
    },
    /// It should have run until shutdown, and returned before (a watch stream that ended,
    /// a server that stopped).
    #[error("task {task:?} ended before shutdown")]
    EndedEarly {
        /// The task's name.
        task: &'static str,
    },
}

impl TaskFailure {
    /// Panics and errors are causes; a task ending early is often the consequence of
    /// another's failure (its input closed), so it is reported only when nothing else is.
    fn is_cause(&self) -> bool {
        !matches!(self, Self::EndedEarly { .. })
    }
}

/// How long all tasks together may take to stop once shutdown began; past it they are
/// aborted (named in a warning), so a task stuck in a call that ignores cancellation cannot
/// keep a failed process alive, and SIGTERM ends the process within 5 s.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(4);

/// The long-running tasks of a process, each on a task of its own (so the busy ones use
/// every core) inside an `info_span!("task", task = name)`, supervised by
/// [`Tasks::supervise`]: every task runs until `shutdown`; one that panics, fails or ends
/// before it cancels `shutdown`, so the others stop, and makes `supervise` fail naming it.
pub struct Tasks {
    running: JoinSet<Result<(), String>>,
    names: HashMap<Id, &'static str>,
    shutdown: CancellationToken,
    drain_timeout: Duration,
}

impl Tasks {
    /// No task yet; `shutdown` is what every task stops on.
    pub fn new(shutdown: CancellationToken) -> Self {
        Self {
            running: JoinSet::new(),
            names: HashMap::new(),
            shutdown,
            drain_timeout: DRAIN_TIMEOUT,
        }
    }

    /// Spawns `task`, which must run until shutdown.
    pub fn spawn(&mut self, name: &'static str, task: impl Future<Output = ()> + Send + 'static) {
        self.spawn_fallible(name, async move {
            task.await;
            Ok::<(), std::convert::Infallible>(())
        });
    }

    /// Spawns `task`, which must run until shutdown and may fail.
    pub fn spawn_fallible<E: std::fmt::Display>(
        &mut self,
        name: &'static str,
        task: impl Future<Output = Result<(), E>> + Send + 'static,
    ) {
        let task = async move { task.await.map_err(|e| e.to_string()) };
        let handle = self
            .running
            .spawn(task.instrument(info_span!("task", task = name)));
        self.names.insert(handle.id(), name);
    }

    /// Waits until every task has ended. `Ok` when all ended on shutdown; otherwise the
    /// first failure — a panic or an error preferred over a task that merely ended early,
    /// which is usually its consequence — after every other has been stopped.
    pub async fn supervise(mut self) -> Result<(), TaskFailure> {
        let mut failures: Vec<TaskFailure> = Vec::new();
        // One deadline for the whole drain, set when shutdown is first seen.
        let mut drain_deadline: Option<tokio::time::Instant> = None;
        loop {
            let next = if self.shutdown.is_cancelled() {
                let deadline = *drain_deadline
                    .get_or_insert_with(|| tokio::time::Instant::now() + self.drain_timeout);
                match tokio::time::timeout_at(deadline, self.running.join_next_with_id()).await {
                    Ok(next) => next,
                    Err(_) => {
                        let stuck: Vec<&str> = self.names.values().copied().collect();
                        warn!(tasks = ?stuck, timeout = ?self.drain_timeout,
                            "tasks did not stop in time; aborting them");
                        self.running.shutdown().await;
                        break;
                    }
                }
            } else {
                self.running.join_next_with_id().await
            };
            let Some(ended) = next else { break };
            let (id, outcome) = match ended {
                Ok((id, outcome)) => (id, Ok(outcome)),
                Err(join_error) => (join_error.id(), Err(join_error)),
            };
            let task = self.names.remove(&id).unwrap_or("unnamed");
            let failure = match outcome {
                Ok(Ok(())) if self.shutdown.is_cancelled() => None,
                Ok(Ok(())) => Some(TaskFailure::EndedEarly { task }),
                Ok(Err(error)) => Some(TaskFailure::Failed { task, error }),
                Err(join_error) => Some(TaskFailure::Panicked {
                    task,
                    message: panic_message(join_error),
                }),
            };
            if let Some(failure) = failure {
                error!(task, %failure, "shutting down");
                self.shutdown.cancel();
                failures.push(failure);
            }
        }
        let first_cause = failures.iter().position(TaskFailure::is_cause);
        match first_cause.or((!failures.is_empty()).then_some(0)) {
            Some(i) => Err(failures.swap_remove(i)),
            None => Ok(()),
        }
    }
}

/// What a panicking task said; "cancelled" for a task aborted from outside.
fn panic_message(error: JoinError) -> String {
    match error.try_into_panic() {
        Ok(payload) => payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".to_owned()),
        Err(_) => "cancelled".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task that runs until shutdown, as every supervised task should.
    fn until(shutdown: &CancellationToken) -> impl Future<Output = ()> + Send + 'static {
        shutdown.clone().cancelled_owned()
    }

    #[tokio::test]
    async fn supervision() {
        type Case = (
            &'static str,
            fn(&mut Tasks, &CancellationToken),
            Result<(), TaskFailure>,
        );
        let cases: [Case; 6] = [
            (
                "every task stops on shutdown",
                |tasks, shutdown| {
                    tasks.spawn("a", until(shutdown));
                    tasks.spawn("b", until(shutdown));
                    shutdown.cancel();
                },
                Ok(()),
            ),
            (
                "a panic takes the others down and is named",
                |tasks, shutdown| {
                    tasks.spawn("steady", until(shutdown));
                    tasks.spawn("pod controller", async { panic!("boom") });
                },
                Err(TaskFailure::Panicked {
                    task: "pod controller",
                    message: "boom".into(),
                }),
            ),
            (
                "a task that returns before shutdown is a failure",
                |tasks, shutdown| {
                    tasks.spawn("steady", until(shutdown));
                    tasks.spawn("pod watches", async {});
                },
                Err(TaskFailure::EndedEarly {
                    task: "pod watches",
                }),
            ),
            (
                "an error is named with its message",
                |tasks, shutdown| {
                    tasks.spawn("steady", until(shutdown));
                    tasks.spawn_fallible("metrics server", async { Err("address in use") });
                },
                Err(TaskFailure::Failed {
                    task: "metrics server",
                    error: "address in use".into(),
                }),
            ),
            (
                "the panic is the cause, not the task whose input it closed",
                |tasks, shutdown| {
                    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
                    tasks.spawn("consumer", async move {
                        let _ = rx.await;
                    });
                    tasks.spawn("producer", async move {
                        let _tx = tx;
                        tokio::task::yield_now().await;
                        panic!("lost");
                    });
                    tasks.spawn("steady", until(shutdown));
                },
                Err(TaskFailure::Panicked {
                    task: "producer",
                    message: "lost".into(),
                }),
            ),
            (
                "a task ending after shutdown began is not a failure",
                |tasks, shutdown| {
                    let stop = shutdown.clone();
                    tasks.spawn("early", async move {
                        stop.cancelled().await;
                    });
                    tasks.spawn("late", {
                        let stop = shutdown.clone();
                        async move {
                            stop.cancelled().await;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    });
                    shutdown.cancel();
                },
                Ok(()),
            ),
        ];
        for (name, setup, want) in cases {
            let shutdown = CancellationToken::new();
            let mut tasks = Tasks::new(shutdown.clone());
            setup(&mut tasks, &shutdown);
            let got = tokio::time::timeout(Duration::from_secs(5), tasks.supervise())
                .await
                .unwrap_or_else(|_| panic!("{name}: supervise hung"));
            assert_eq!(got, want, "{name}");
            assert!(shutdown.is_cancelled(), "{name}: shutdown cancelled");
        }
    }

    #[tokio::test]
    async fn a_task_that_ignores_shutdown_is_aborted_after_the_drain_timeout() {
        let shutdown = CancellationToken::new();
        let mut tasks = Tasks::new(shutdown.clone());
        tasks.drain_timeout = Duration::from_millis(50);
        tasks.spawn("stuck", std::future::pending());
        tasks.spawn("failing", async { panic!("boom") });
        let got = tokio::time::timeout(Duration::from_secs(5), tasks.supervise())
            .await
            .expect("supervise returns once the stuck task is aborted");
        assert_eq!(
            got,
            Err(TaskFailure::Panicked {
                task: "failing",
                message: "boom".into()
            })
        );
    }

    /// The drain timeout bounds the whole drain, not each task's stop: tasks that each
    /// stop a little before it, one after another, cannot add up past it.
    #[tokio::test]
    async fn the_drain_timeout_bounds_the_whole_drain() {
        let shutdown = CancellationToken::new();
        let mut tasks = Tasks::new(shutdown.clone());
        tasks.drain_timeout = Duration::from_millis(100);
        for (name, stop_after) in [("first", 80), ("second", 160), ("third", 240)] {
            let stop = shutdown.clone();
            tasks.spawn(name, async move {
                stop.cancelled().await;
                tokio::time::sleep(Duration::from_millis(stop_after)).await;
            });
        }
        tasks.spawn("stuck", std::future::pending());
        shutdown.cancel();
        let started = tokio::time::Instant::now();
        let got = tasks.supervise().await;
        assert_eq!(got, Ok(()));
        // Per task, it took 340 ms (each stop restarted the clock); slack for a busy box.
        let took = started.elapsed();
        assert!(
            took < Duration::from_millis(250),
            "drained in {took:?}, far over the 100 ms timeout"
        );
    }

    #[test]
    fn failures_name_the_task() {
        let cases = [
            (
                TaskFailure::Panicked {
                    task: "status reflector",
                    message: "index out of bounds".into(),
                },
                "task \"status reflector\" panicked: index out of bounds",
            ),
            (
                TaskFailure::EndedEarly {
                    task: "pod watches",
                },
                "task \"pod watches\" ended before shutdown",
            ),
        ];
        for (failure, want) in cases {
            assert_eq!(failure.to_string(), want);
        }
    }
}
