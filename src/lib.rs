//! tensile: joins a lower Kubernetes cluster to an upper one as a virtual node.
//!
//! Pure translation (`translate`, and the capacity math in `node::capacity`) is kept apart
//! from everything that calls an API server (`node`, `controllers`); `main.rs` only wires.

pub mod allocator;
pub mod api;
pub mod check;
pub mod cli;
pub mod clusters;
pub mod controllers;
pub mod descheduler;
pub mod duration;
pub mod kubelet_api;
pub mod leader;
pub mod logging;
pub mod lower_view;
pub mod member;
pub mod metrics;
pub mod node;
pub mod runtime;
pub mod shutdown;
pub mod side;
pub mod status;
pub mod translate;
pub mod upper_watches;
