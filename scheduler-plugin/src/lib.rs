//! tensile-scheduler-extender: a kube-scheduler extender that lets a virtual node pass
//! filter only when a real node of its lower cluster takes the pod.
//!
//! The pure core: [`fit`] (does a pod fit a lower node, and why not), [`cache`] (a lower
//! cluster folded from watch events), [`extender`] (filter / prioritize over the caches),
//! [`wire`] (kube-scheduler's extender v1 JSON). The wiring: [`watch`] feeds the caches
//! from the lower API servers, [`server`] serves HTTP(S), [`metrics`] counts.
#![forbid(unsafe_code)]

pub mod cache;
pub mod cli;
pub mod extender;
pub mod fit;
pub mod metrics;
pub mod server;
pub mod upper;
pub mod watch;
pub mod wire;
