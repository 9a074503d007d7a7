//! The pod controllers' work queue: object keys waiting for a reconcile, each at most once
//! in the queue and never reconciled twice at once (a key triggered while it is being
//! reconciled runs again after), with workers that take from it. Like client-go's
//! workqueue. It replaces kube-runtime's controller scheduler for the pod controllers
//! because that one keeps its tables at their largest: after a burst or a full resync of
//! 10 000 pods they held 1.3 KB a pod for good. This queue hands its memory back once it
//! has drained.

use std::collections::{HashSet, VecDeque};
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::shrink::shrunk_capacity;
use crate::metrics::Metrics;

/// Below this many slots a drained queue keeps its tables: not worth handing back.
const KEEP: usize = 256;

/// Keys waiting for a worker; see the module doc.
#[derive(Debug)]
pub struct WorkQueue<K> {
    state: Mutex<State<K>>,
    /// Woken when a key becomes ready for a worker, or on close.
    ready: Notify,
    /// How long each key waited, ready, for a worker (`tensile_queue_wait_seconds`).
    wait: Option<Histogram>,
}

#[derive(Debug)]
struct State<K> {
    /// Keys ready for a worker, in the order they were added, with when each became
    /// ready.
    order: VecDeque<(K, Instant)>,
    /// Keys added and not yet taken: those in `order`, and those added while being
    /// reconciled (put in `order` when that reconcile is done).
    waiting: HashSet<K>,
    /// Keys a worker holds.
    running: HashSet<K>,
    /// No worker takes a key any more.
    closed: bool,
}

impl<K> Default for WorkQueue<K> {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                order: VecDeque::new(),
                waiting: HashSet::new(),
                running: HashSet::new(),
                closed: false,
            }),
            ready: Notify::new(),
            wait: None,
        }
    }
}

impl<K: Clone + Eq + Hash> WorkQueue<K> {
    fn state(&self) -> MutexGuard<'_, State<K>> {
        // Nothing panics while holding the lock; a poisoned one is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `key`, unless it is already waiting. A key being reconciled is taken again
    /// once that reconcile is done.
    pub fn add(&self, key: K) {
        let mut state = self.state();
        if state.closed || state.waiting.contains(&key) {
            return;
        }
        state.waiting.insert(key.clone());
        if !state.running.contains(&key) {
            state.order.push_back((key, Instant::now()));
            drop(state);
            self.ready.notify_one();
        }
    }

    /// Queues `key` after `delay` (a retry). An earlier add of the same key is not held
    /// back; the retry then costs one more (level-triggered, idempotent) reconcile.
    pub fn add_after(self: &Arc<Self>, key: K, delay: Duration)
    where
        K: Send + Sync + 'static,
    {
        let queue = Arc::downgrade(self);
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            if let Some(queue) = queue.upgrade() {
                queue.add(key);
            }
        });
    }

    /// Takes the next ready key, waiting for one; `None` once closed.
    pub async fn next(&self) -> Option<K> {
        loop {
            // Registered before looking, so that an add or a close between the look and
            // the wait wakes it.
            let notified = self.ready.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            {
                let mut state = self.state();
                if state.closed {
                    return None;
                }
                if let Some((key, since)) = state.order.pop_front() {
                    state.waiting.remove(&key);
                    state.running.insert(key.clone());
                    let more = !state.order.is_empty();
                    drop(state);
                    if let Some(wait) = &self.wait {
                        wait.observe(since.elapsed().as_secs_f64());
                    }
                    if more {
                        // Another worker may be waiting for what is left.
                        self.ready.notify_one();
                    }
                    return Some(key);
                }
            }
            notified.await;
        }
    }

    /// Marks `key`'s reconcile done: it is queued again if it was added meanwhile.
    pub fn done(&self, key: &K) {
        let mut state = self.state();
        state.running.remove(key);
        if state.waiting.contains(key) {
            state.order.push_back((key.clone(), Instant::now()));
            drop(state);
            self.ready.notify_one();
        } else {
            state.shrink();
        }
    }

    /// Keys waiting or being reconciled.
    #[cfg(test)]
    fn len(&self) -> usize {
        let state = self.state();
        state.waiting.len() + state.running.len()
    }

    /// Whether no key is waiting or being reconciled.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes its tables hold (the keys' own heap parts apart): for
    /// `tensile_memory_bytes`.
    pub fn heap_bytes(&self) -> usize {
        let state = self.state();
        let slot = size_of::<K>();
        state.order.capacity() * size_of::<(K, Instant)>()
            + (state.waiting.capacity() + state.running.capacity()) * (slot + 1)
    }

    /// A queue whose memory `metrics` reports as `owner`'s, for the member `scope`, and
    /// whose keys' waits it records under `owner` (every member's together).
    pub fn measured(metrics: &Metrics, scope: &str, owner: &'static str) -> Arc<Self>
    where
        K: Send + Sync + 'static,
    {
        let queue = Arc::new(Self {
            wait: Some(metrics.queue_wait(owner)),
            ..Self::default()
        });
        let measured = Arc::downgrade(&queue);
        metrics.measure_memory(scope, owner, move || {
            measured.upgrade().map_or(0, |queue| queue.heap_bytes())
        });
        queue
    }

    /// Stops handing out keys: every [`WorkQueue::next`] returns `None`.
    pub fn close(&self) {
        self.state().closed = true;
        self.ready.notify_waiters();
    }

    /// Slots the tables hold.
    #[cfg(test)]
    fn capacity(&self) -> usize {
        let state = self.state();
        state.order.capacity() + state.waiting.capacity() + state.running.capacity()
    }
}

impl<K: Eq + Hash> State<K> {
    /// Hands back what a drained burst left: a table four times larger than what it holds.
    fn shrink(&mut self) {
        if let Some(to) = shrunk_capacity(self.order.capacity(), self.order.len(), KEEP) {
            self.order.shrink_to(to);
        }
        if let Some(to) = shrunk_capacity(self.waiting.capacity(), self.waiting.len(), KEEP) {
            self.waiting.shrink_to(to);
        }
        if let Some(to) = shrunk_capacity(self.running.capacity(), self.running.len(), KEEP) {
            self.running.shrink_to(to);
        }
    }
}

/// Runs `reconcile` on the keys of `queue`, at most `workers` at once (on this task, as
/// kube-runtime's controller does), until `shutdown`: then no key is taken, and the
/// reconciles under way finish. `reconcile` answers when to look again (a retry); `None`
/// waits for the next change.
pub async fn work<K, F, Fut>(
    queue: &Arc<WorkQueue<K>>,
    workers: u16,
    shutdown: &CancellationToken,
    reconcile: F,
) where
    K: Clone + Eq + Hash + Send + Sync + 'static,
    F: Fn(K) -> Fut,
    Fut: Future<Output = Option<Duration>>,
{
    let worker = || async {
        loop {
            let key = tokio::select! {
                biased;
                () = shutdown.cancelled() => return,
                key = queue.next() => match key {
                    Some(key) => key,
                    None => return,
                },
            };
            let again = reconcile(key.clone()).await;
            queue.done(&key);
            if let Some(delay) = again {
                queue.add_after(key, delay);
            }
        }
    };
    futures::future::join_all((0..workers.max(1)).map(|_| worker())).await;
    queue.close();
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Adds, takes and dones, in order, against what each take returns.
    #[tokio::test]
    async fn keys_are_deduplicated_and_never_handed_out_twice_at_once() {
        enum Op {
            Add(u32),
            Take(Option<u32>),
            Done(u32),
        }
        use Op::{Add, Done, Take};
        let cases: Vec<(&str, Vec<Op>)> = vec![
            (
                "in order",
                vec![Add(1), Add(2), Take(Some(1)), Take(Some(2))],
            ),
            (
                "a waiting key is queued once",
                vec![
                    Add(1),
                    Add(2),
                    Add(1),
                    Take(Some(1)),
                    Take(Some(2)),
                    Take(None),
                ],
            ),
            (
                "a key added while running waits for its done",
                vec![
                    Add(1),
                    Take(Some(1)),
                    Add(1),
                    Add(2),
                    Take(Some(2)),
                    Take(None),
                    Done(1),
                    Take(Some(1)),
                ],
            ),
            (
                "a key done and not added again is gone",
                vec![Add(1), Take(Some(1)), Done(1), Take(None)],
            ),
        ];
        for (name, ops) in cases {
            let queue = WorkQueue::default();
            for op in ops {
                match op {
                    Add(key) => queue.add(key),
                    Done(key) => queue.done(&key),
                    Take(want) => {
                        let got = tokio::time::timeout(Duration::from_millis(20), queue.next())
                            .await
                            .ok()
                            .flatten();
                        assert_eq!(got, want, "{name}");
                    }
                }
            }
        }
    }

    /// Each key taken from a measured queue records how long it waited, ready, for a
    /// worker: from its add, or from the done of the reconcile it was added during.
    #[tokio::test]
    async fn a_measured_queue_records_each_keys_wait() {
        let metrics = Metrics::default();
        let queue = WorkQueue::<u32>::measured(&metrics, "node", "pod queue");
        queue.add(1);
        queue.add(2);
        let held = Duration::from_millis(30);
        tokio::time::sleep(held).await;
        assert_eq!(queue.next().await, Some(1));
        assert_eq!(queue.next().await, Some(2));
        // Added while running: waits from its done on.
        queue.add(1);
        queue.done(&1);
        assert_eq!(queue.next().await, Some(1));
        let text = metrics.render();
        let value = |series: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {series} in {text}"))
        };
        let label = "{queue=\"pod queue\"}";
        assert_eq!(
            value(&format!("tensile_queue_wait_seconds_count{label}")),
            3.0
        );
        let sum = value(&format!("tensile_queue_wait_seconds_sum{label}"));
        // The two first waited at least `held` each; the third hardly at all.
        assert!(sum >= 2.0 * held.as_secs_f64(), "{sum}");
        assert!(sum < 2.0 * held.as_secs_f64() + 1.0, "{sum}");
    }

    #[tokio::test]
    async fn a_drained_burst_hands_its_memory_back() {
        let queue = WorkQueue::default();
        for key in 0..10_000u32 {
            queue.add(key);
        }
        let full = queue.capacity();
        assert!(full >= 20_000, "{full}");
        while let Ok(Some(key)) =
            tokio::time::timeout(Duration::from_millis(20), queue.next()).await
        {
            queue.done(&key);
        }
        assert!(queue.is_empty());
        let drained = queue.capacity();
        assert!(drained <= 3 * KEEP, "{drained} slots after draining {full}");
    }

    #[tokio::test]
    async fn workers_share_the_queue_and_stop_on_shutdown() {
        let queue = Arc::new(WorkQueue::default());
        let shutdown = CancellationToken::new();
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        for key in 0..20u32 {
            queue.add(key);
        }
        let work = {
            let (queue, shutdown) = (queue.clone(), shutdown.clone());
            let (running, most, seen) = (running.clone(), most.clone(), seen.clone());
            tokio::spawn(async move {
                work(&queue, 4, &shutdown, |key: u32| {
                    let (running, most, seen) = (running.clone(), most.clone(), seen.clone());
                    async move {
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        running.fetch_sub(1, Ordering::SeqCst);
                        let retry = {
                            let mut seen = seen.lock().unwrap();
                            seen.push(key);
                            // Key 0 fails once and is retried.
                            key == 0 && seen.iter().filter(|k| **k == 0).count() == 1
                        };
                        retry.then_some(Duration::from_millis(10))
                    }
                })
                .await;
            })
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while seen.lock().unwrap().len() < 21 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{:?}",
                seen.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(most.load(Ordering::SeqCst), 4, "four at once, no more");
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), work)
            .await
            .unwrap()
            .unwrap();
        queue.add(99);
        assert!(queue.next().await.is_none(), "closed after shutdown");
        let mut seen = seen.lock().unwrap().clone();
        seen.sort_unstable();
        let mut want: Vec<u32> = (0..20).collect();
        want.insert(0, 0);
        assert_eq!(seen, want);
    }
}
