//! Resource metrics in a harness cluster ([`ClusterOptions::metrics`]): the API server gets
//! the aggregation layer (front-proxy client certificate, request-header authentication),
//! kwok simulates each node's `/metrics/resource` at
//! `/metrics/nodes/<node>/metrics/resource` (the path the node's
//! [`RESOURCE_METRICS_PATH_ANNOTATION`] tells metrics-server), and metrics-server (built by
//! `tests/k8s/build.sh`) runs beside the cluster, registered as `v1beta1.metrics.k8s.io`
//! through an ExternalName Service at 127.0.0.1 (the aggregator resolves ExternalName
//! Services by name and needs no kube-proxy; Endpoints may not hold loopback addresses),
//! or, where the API server routes to endpoints ([`ClusterOptions::in_cluster`]), a
//! Service whose Endpoints are the machine's address.
//!
//! A simulated container's usage is set by annotations, on its pod, else on its node:
//! [`USAGE_CPU_ANNOTATION`] (cores, e.g. `250m`) and [`USAGE_MEMORY_ANNOTATION`] (bytes,
//! e.g. `64Mi`); without either, 1m and 1Mi (metrics-server drops a container that reports
//! zero). kwok integrates the CPU usage into the cumulative counter a kubelet reports.
//!
//! [`ClusterOptions::metrics`]: crate::cluster::ClusterOptions::metrics
//! [`ClusterOptions::in_cluster`]: crate::cluster::ClusterOptions::in_cluster

use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::Client;
use kube::api::{Api, ListParams, Patch, PatchParams};

use crate::binaries::Binaries;
use crate::cluster::{Cluster, Component, KWOK_NODE_ANNOTATION};
use crate::pki::Pki;
use crate::ports::free_port;

/// kube-controller-manager flags for an HPA that acts in seconds (sync every 5 s, short
/// stabilization and initialization), for tests and benchmarks of autoscaling.
pub fn fast_hpa_controller_args() -> Vec<String> {
    [
        "--horizontal-pod-autoscaler-sync-period=5s",
        "--horizontal-pod-autoscaler-downscale-stabilization=10s",
        "--horizontal-pod-autoscaler-cpu-initialization-period=10s",
        "--horizontal-pod-autoscaler-initial-readiness-delay=5s",
    ]
    .map(String::from)
    .to_vec()
}
use crate::process::Reaper;

/// The node annotation metrics-server (0.7 and later) reads the resource metrics path of
/// the node's kubelet from.
pub const RESOURCE_METRICS_PATH_ANNOTATION: &str = "metrics.k8s.io/resource-metrics-path";
/// A simulated pod's (or node's, for its pods without their own) CPU usage, in cores.
pub const USAGE_CPU_ANNOTATION: &str = "kwok.x-k8s.io/usage-cpu";
/// A simulated pod's (or node's) memory working set, in bytes.
pub const USAGE_MEMORY_ANNOTATION: &str = "kwok.x-k8s.io/usage-memory";
/// metrics-server's resolution: its shortest, so a usage change shows within seconds.
pub const RESOLUTION: Duration = Duration::from_secs(10);

/// Sets the simulated CPU usage of every pod (without its own [`USAGE_CPU_ANNOTATION`])
/// on the kwok nodes of `client`'s cluster to `cpu` (e.g. `900m`): the annotation on each
/// node kwok simulates. Virtual nodes (not kwok's) are left alone. Returns how many nodes
/// it annotated.
pub async fn set_node_usage(client: &Client, cpu: &str) -> Result<usize> {
    let nodes: Api<Node> = Api::all(client.clone());
    let mut annotated = 0;
    for node in nodes.list(&ListParams::default()).await?.items {
        let kwok = node
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(KWOK_NODE_ANNOTATION));
        let Some(name) = node.metadata.name.filter(|_| kwok) else {
            continue;
        };
        // The UID as precondition: a node replaced meanwhile is not annotated.
        let patch = serde_json::json!({"metadata": {
            "uid": node.metadata.uid,
            "annotations": {USAGE_CPU_ANNOTATION: cpu},
        }});
        nodes
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .with_context(|| format!("setting the CPU usage of node {name}"))?;
        annotated += 1;
    }
    Ok(annotated)
}

/// The common name of the API server's front-proxy client certificate.
const FRONT_PROXY_CLIENT: &str = "front-proxy-client";

/// The kube-apiserver flags of the aggregation layer. The front-proxy client certificate is
/// issued by the cluster CA; only its common name may assert request headers.
pub(crate) fn aggregation_args(pki: &Pki) -> Result<Vec<String>> {
    let proxy = pki.issue_client(FRONT_PROXY_CLIENT, &[])?;
    let p = |path: &std::path::Path| path.display().to_string();
    Ok(vec![
        format!("--requestheader-client-ca-file={}", p(&pki.ca_cert)),
        format!("--requestheader-allowed-names={FRONT_PROXY_CLIENT}"),
        "--requestheader-username-headers=X-Remote-User".into(),
        "--requestheader-group-headers=X-Remote-Group".into(),
        "--requestheader-extra-headers-prefix=X-Remote-Extra-".into(),
        format!("--proxy-client-cert-file={}", p(&proxy.cert)),
        format!("--proxy-client-key-file={}", p(&proxy.key)),
    ])
}

/// kwok's configuration documents for simulated resource metrics: kwok's own `Metric` of
/// the kubelet's `/metrics/resource` series, and the usage it reads from annotations.
pub(crate) fn kwok_metrics_config(bins: &Binaries) -> Result<Vec<String>> {
    let path = bins.stage("metrics-resource.yaml");
    let metric = std::fs::read_to_string(&path)
        .with_context(|| format!("reading kwok's Metric {}", path.display()))?;
    // The pod's annotation, else its node's, else a default that is not zero.
    let expression = |annotation: &str, default: &str| {
        format!(
            r#"|
          "{annotation}" in pod.metadata.annotations
          ? Quantity(pod.metadata.annotations["{annotation}"])
          : ("{annotation}" in node.metadata.annotations
             ? Quantity(node.metadata.annotations["{annotation}"]) : Quantity("{default}"))"#
        )
    };
    let usage = format!(
        r#"apiVersion: kwok.x-k8s.io/v1alpha1
kind: ClusterResourceUsage
metadata:
  name: usage-from-annotations
spec:
  usages:
  - usage:
      cpu:
        expression: {cpu}
      memory:
        expression: {memory}
"#,
        cpu = expression(USAGE_CPU_ANNOTATION, "1m"),
        memory = expression(USAGE_MEMORY_ANNOTATION, "1Mi"),
    );
    Ok(vec![metric, usage])
}

impl Cluster {
    /// Starts metrics-server against this cluster (the admin identity, which may read
    /// every node's metrics) and registers it with the aggregator; returns once
    /// `v1beta1.metrics.k8s.io` is Available.
    pub(crate) async fn start_metrics_server(
        &self,
        bins: &Binaries,
        reaper: &Reaper,
    ) -> Result<()> {
        let port = free_port()?;
        let kubeconfig = self.kubeconfig.display().to_string();
        self.spawn(
            bins,
            reaper,
            Component::MetricsServer,
            vec![
                format!("--kubeconfig={kubeconfig}"),
                format!("--authentication-kubeconfig={kubeconfig}"),
                format!("--authorization-kubeconfig={kubeconfig}"),
                // In-cluster (ClusterOptions::in_cluster), the aggregator goes to the
                // Service's endpoints: the machine's address.
                if self.options.in_cluster {
                    "--bind-address=0.0.0.0".into()
                } else {
                    "--bind-address=127.0.0.1".into()
                },
                format!("--secure-port={port}"),
                format!(
                    "--cert-dir={}",
                    self.dir.join("metrics-server-certs").display()
                ),
                "--kubelet-preferred-address-types=InternalIP".into(),
                "--kubelet-use-node-status-port".into(),
                // Nodes serve certificates for 127.0.0.1 of the cluster CA, but virtual
                // nodes of other tests may not: scraping is what is tested, not TLS.
                "--kubelet-insecure-tls".into(),
                format!("--metric-resolution={}s", RESOLUTION.as_secs()),
                // Below 90 % of the resolution, as metrics-server requires.
                "--kubelet-request-timeout=8s".into(),
            ],
        )?;
        let client = self.client().await?;
        let apply = PatchParams::apply("tensile-harness").force();
        let services: Api<Service> = Api::namespaced(client.clone(), "kube-system");
        // An API server that routes to endpoints (ClusterOptions::in_cluster) refuses an
        // ExternalName Service: a Service without a selector, its Endpoints at the
        // machine's address (not loopback, which validation refuses).
        let service = if self.options.in_cluster {
            serde_json::json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "metrics-server", "namespace": "kube-system"},
                "spec": {"ports": [{"name": "https", "port": port, "targetPort": port}]},
            })
        } else {
            serde_json::json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "metrics-server", "namespace": "kube-system"},
                "spec": {"type": "ExternalName", "externalName": "127.0.0.1"},
            })
        };
        services
            .patch("metrics-server", &apply, &Patch::Apply(&service))
            .await
            .with_context(|| format!("{}: the metrics-server Service", self.name))?;
        if self.options.in_cluster {
            let endpoints = serde_json::json!({
                "apiVersion": "v1", "kind": "Endpoints",
                "metadata": {"name": "metrics-server", "namespace": "kube-system"},
                "subsets": [{
                    "addresses": [{"ip": crate::ports::host_ip()?.to_string()}],
                    "ports": [{"name": "https", "port": port}],
                }],
            });
            Api::<k8s_openapi::api::core::v1::Endpoints>::namespaced(client.clone(), "kube-system")
                .patch("metrics-server", &apply, &Patch::Apply(&endpoints))
                .await
                .with_context(|| format!("{}: the metrics-server Endpoints", self.name))?;
        }
        let api_services: Api<APIService> = Api::all(client);
        let name = "v1beta1.metrics.k8s.io";
        let api_service = serde_json::json!({
            "apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
            "metadata": {"name": name},
            "spec": {
                "group": "metrics.k8s.io", "version": "v1beta1",
                "groupPriorityMinimum": 100, "versionPriority": 100,
                // metrics-server's certificate is its own, self-signed.
                "insecureSkipTLSVerify": true,
                "service": {"name": "metrics-server", "namespace": "kube-system", "port": port},
            },
        });
        api_services
            .patch(name, &apply, &Patch::Apply(&api_service))
            .await
            .with_context(|| format!("{}: the APIService {name}", self.name))?;
        self.wait_running(
            Component::MetricsServer,
            "metrics.k8s.io Available",
            || async {
                let available = api_services
                    .get(name)
                    .await?
                    .status
                    .and_then(|s| s.conditions)
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Available" && c.status == "True");
                Ok(available.then_some(()))
            },
        )
        .await
    }
}
