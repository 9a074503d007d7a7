//! tensile-webhook: the mutating admission webhook that lets pods labelled
//! `virtual-pod: "true"` burst onto tensile virtual nodes, and keeps DaemonSets' pods off
//! them unless a DaemonSet opts in.
//!
//! The pure cores ([`mutate::admit`] for pods, [`daemonset::admit`] for DaemonSets: an
//! admission request in, a JSON patch out) are apart from the wiring: [`review`] decodes
//! and encodes AdmissionReview v1, [`server`] routes a review by kind and serves it over
//! rustls, [`tls`] reloads the certificate, [`pvc`] keeps the upper PVCs in memory.

pub mod certs;
pub mod cli;
pub mod daemonset;
pub mod loopback;
pub mod memory;
pub mod metrics;
pub mod mutate;
pub mod pvc;
pub mod review;
pub mod server;
pub mod tls;
