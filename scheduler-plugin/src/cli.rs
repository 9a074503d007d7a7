//! Command line of `tensile-scheduler-extender`, and its small config file.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;

use crate::extender::OnUnknown;
use tensile::clusters::Trust;
use tensile::logging::LogFormat;

/// kube-scheduler extender: a virtual node passes filter only when a real node of its
/// lower cluster takes the pod (resources, nodeSelector, node affinity, taints).
#[derive(Parser, Debug, Clone)]
#[command(
    name = "tensile-scheduler-extender",
    version,
    about,
    long_about = None,
    args_override_self = true
)]
pub struct Cli {
    /// A virtual node and the kubeconfig of its lower cluster, `NODE=KUBECONFIG`
    /// (repeatable). The operator's own file, read as it is (exec plugins, file paths).
    #[arg(long = "cluster", value_parser = parse_cluster)]
    pub clusters: Vec<(String, PathBuf)>,

    /// Kubeconfig of the upper cluster, whose Node labels (`type=virtual-kubelet`,
    /// `tensile.dev/burst-priority`) order prioritize (env `KUBECONFIG`, else
    /// `~/.kube/config`, else in-cluster).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// A JSON file `{"clusters": {"NODE": "KUBECONFIG", …}}`, merged with `--cluster`
    /// (`--cluster` wins for the same node). Its kubeconfigs are read as Secrets' (the
    /// chart and deploy/scheduler-extender mount them from Secrets, member Secrets among
    /// them): inline credentials only, no exec, auth-provider, tokenFile or other file.
    #[arg(long)]
    pub config: Option<PathBuf>,

    /// Address to serve `/filter`, `/prioritize`, `/healthz`, `/readyz`, `/metrics` on.
    #[arg(long, default_value = "0.0.0.0:8888")]
    pub listen: SocketAddr,

    /// Serving certificate (PEM); with `--tls-key`, serves HTTPS.
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// Serving key (PEM).
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// A virtual node whose lower cluster is not synced or not reachable: `fail` filter
    /// (with the reason) or `pass` (let the lower scheduler decide).
    #[arg(long, value_enum, default_value_t = OnUnknown::Fail)]
    pub on_unknown: OnUnknown,

    /// How long a pod that passed filter on a virtual node counts in its lower cluster
    /// while its lower copy has not appeared (Go duration, e.g. `30s`).
    #[arg(long, value_parser = tensile::duration::parse_duration, default_value = "30s")]
    pub assume_ttl: Duration,

    /// Log filter (`info`, `debug`, or a tracing directive).
    #[arg(long, default_value = "info")]
    pub log_level: String,

    /// Log lines as `text` or `json`.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// A virtual node the extender judges, and where its lower cluster's kubeconfig comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LowerCluster {
    /// The virtual node.
    pub node: String,
    /// The kubeconfig of its lower cluster.
    pub kubeconfig: PathBuf,
    /// [`Trust::Operator`] for `--cluster`; [`Trust::FromSecret`] for a `--config` entry:
    /// whoever may write the Secret mounted there (a member Secret's writer) must not get
    /// the extender to run a command, or to send its own ServiceAccount token (`tokenFile`)
    /// to a server of theirs.
    pub trust: Trust,
}

/// The config file.
#[derive(Deserialize, Debug, Default, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Virtual node name → kubeconfig of its lower cluster.
    #[serde(default)]
    pub clusters: BTreeMap<String, PathBuf>,
}

/// Why the configuration is unusable.
#[derive(thiserror::Error, Debug)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The config file is not valid.
    #[error("config file {path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// Why.
        source: serde_json::Error,
    },
    /// No cluster at all.
    #[error("no lower cluster configured: give --cluster NODE=KUBECONFIG or --config FILE")]
    NoClusters,
}

fn parse_cluster(text: &str) -> Result<(String, PathBuf), String> {
    match text.split_once('=') {
        Some((node, path)) if !node.is_empty() && !path.is_empty() => {
            Ok((node.to_owned(), PathBuf::from(path)))
        }
        _ => Err(format!("expected NODE=KUBECONFIG, got {text:?}")),
    }
}

impl Cli {
    /// Every virtual node and its kubeconfig: the config file's (from Secrets), then
    /// `--cluster` flags (the operator's), by node name.
    pub fn clusters(&self) -> Result<Vec<LowerCluster>, ConfigError> {
        let mut all: BTreeMap<String, (PathBuf, Trust)> = match &self.config {
            Some(path) => read_config(path)?
                .clusters
                .into_iter()
                .map(|(node, kubeconfig)| (node, (kubeconfig, Trust::FromSecret)))
                .collect(),
            None => BTreeMap::new(),
        };
        all.extend(
            self.clusters
                .iter()
                .map(|(node, kubeconfig)| (node.clone(), (kubeconfig.clone(), Trust::Operator))),
        );
        if all.is_empty() {
            return Err(ConfigError::NoClusters);
        }
        Ok(all
            .into_iter()
            .map(|(node, (kubeconfig, trust))| LowerCluster {
                node,
                kubeconfig,
                trust,
            })
            .collect())
    }
}

/// Reads the config file.
pub fn read_config(path: &Path) -> Result<ConfigFile, ConfigError> {
    let text = std::fs::read(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    serde_json::from_slice(&text).map_err(|source| ConfigError::Parse {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn flags_and_config_file_merge() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        std::fs::write(&file, r#"{"clusters": {"vk-a": "/a", "vk-b": "/b"}}"#).unwrap();
        let cli = Cli::try_parse_from([
            "x",
            "--cluster",
            "vk-b=/b2",
            "--cluster=vk-c=/c",
            "--config",
            file.to_str().unwrap(),
            "--on-unknown=pass",
            "--assume-ttl=1m30s",
        ])
        .unwrap();
        assert_eq!(cli.on_unknown, OnUnknown::Pass);
        assert_eq!(cli.assume_ttl, Duration::from_secs(90));
        let clusters: Vec<_> = cli
            .clusters()
            .unwrap()
            .into_iter()
            .map(|c| (c.node, c.kubeconfig, c.trust))
            .collect();
        // The config file's are mounted from Secrets; a flag's is the operator's own.
        assert_eq!(
            clusters,
            [
                ("vk-a".to_owned(), PathBuf::from("/a"), Trust::FromSecret),
                ("vk-b".to_owned(), PathBuf::from("/b2"), Trust::Operator),
                ("vk-c".to_owned(), PathBuf::from("/c"), Trust::Operator),
            ]
        );
    }

    #[test]
    fn bad_input_is_refused() {
        assert!(Cli::try_parse_from(["x", "--cluster", "novalue"]).is_err());
        assert!(Cli::try_parse_from(["x", "--tls-cert", "/c"]).is_err());
        assert!(Cli::try_parse_from(["x", "--assume-ttl", "soon"]).is_err());
        let cli = Cli::try_parse_from(["x"]).unwrap();
        assert_eq!(cli.assume_ttl, crate::extender::DEFAULT_ASSUME_TTL);
        assert!(matches!(cli.clusters(), Err(ConfigError::NoClusters)));
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        std::fs::write(&file, r#"{"cluster": {}}"#).unwrap();
        let error = read_config(&file).unwrap_err();
        assert!(error.to_string().contains("config.json"), "{error}");
    }
}
