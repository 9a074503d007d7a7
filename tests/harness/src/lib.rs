//! Real local Kubernetes clusters for tensile's integration tests, benchmarks and
//! playground: a pair of independent clusters (`upper`, `lower`) on loopback, built from
//! pinned Kubernetes releases, with kwok simulating nodes and their pods.
//!
//! ```no_run
//! # async fn example() -> anyhow::Result<()> {
//! let pair = tensile_harness::ClusterPair::shared().await?;
//! let upper = pair.upper.client().await?;
//! let ns = tensile_harness::TestNamespace::create(&upper, "demo").await?;
//! // ... create objects in ns.name ...
//! ns.delete().await?;
//! # Ok(()) }
//! ```

pub mod binaries;
pub mod cluster;
pub mod conformance;
pub mod dashboard;
pub mod fault_proxy;
pub mod fixtures;
pub mod http;
pub mod images;
pub mod install;
pub mod invariant;
pub mod kueue;
pub mod measure;
pub mod metrics_server;
pub mod pair;
pub mod pki;
pub mod ports;
pub mod process;
pub mod rbac;
pub mod real_node;
pub mod scheduler_extender;
pub mod virtual_node;
pub mod vpa;
pub mod wait;

pub use binaries::Binaries;
pub use cluster::{
    Cluster, ClusterOptions, Component, KWOK_FOLLOW_CONTAINER, KWOK_LOG_LINES,
    KWOK_PREVIOUS_LOG_LINE, NodeShape, client_for, cri_log_line, node_is_ready,
    node_is_schedulable, rfc3339,
};
pub use pair::{ClusterPair, PairOptions, TestNamespace};
pub use real_node::{RealNode, real_node_placement};
pub use virtual_node::{VirtualNode, VirtualNodeOptions};
pub use wait::wait_for;
