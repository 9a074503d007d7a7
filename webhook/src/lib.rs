//! tensile-webhook: the mutating admission webhook that lets pods labelled
//! `virtual-pod: "true"` burst onto tensile virtual nodes.
//!
//! The pure core ([`mutate::admit`]: an admission request in, a JSON patch out) is apart
//! from the wiring: [`review`] decodes and encodes AdmissionReview v1, [`server`] serves it
//! over rustls, [`tls`] reloads the certificate, [`pvc`] keeps the upper PVCs in memory.

pub mod certs;
pub mod cli;
pub mod loopback;
pub mod memory;
pub mod metrics;
pub mod mutate;
pub mod pvc;
pub mod review;
pub mod server;
pub mod tls;
