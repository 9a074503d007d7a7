//! The upper kube-scheduler configured with tensile-scheduler-extender exactly as
//! `deploy/scheduler-extender/kube-scheduler-config.yaml` ships it (only the address
//! differs), and the extender run beside a pair.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Map, Value};

use crate::pair::ClusterPair;
use crate::process::Process;
use crate::wait::wait_for;

/// The shipped file.
const SHIPPED: &str = include_str!("../../../deploy/scheduler-extender/kube-scheduler-config.yaml");

/// The upper cluster of the HPA bursting scenes (`tests/burst_hpa.rs`, `tensile-bench
/// --burst-hpa`): two regular nodes of 4 CPU, the kube-scheduler configured with the
/// extender at `127.0.0.1:port` as shipped, metrics-servers in both clusters and an HPA that
/// acts in seconds.
pub fn hpa_bursting(options: &mut crate::PairOptions, port: u16) -> Result<()> {
    options.upper.nodes = 2;
    options.upper.node_shape = crate::NodeShape {
        cpu: "4".into(),
        ..crate::NodeShape::default()
    };
    options
        .upper
        .scheduler_config
        .extend(shipped_scheduler_config(&format!(
            "http://127.0.0.1:{port}"
        ))?);
    options.upper.metrics = true;
    options.lower.metrics = true;
    options.upper.controller_manager_args = crate::metrics_server::fast_hpa_controller_args();
    Ok(())
}

/// The fields of the shipped KubeSchedulerConfiguration beyond `apiVersion` and `kind`
/// (`extenders`, `percentageOfNodesToScore`), with the extender's `urlPrefix` replaced by
/// `url`: to merge into [`crate::ClusterOptions::scheduler_config`].
pub fn shipped_scheduler_config(url: &str) -> Result<Map<String, Value>> {
    let mut config = parse_flat_yaml(SHIPPED)?;
    config.remove("apiVersion");
    config.remove("kind");
    let extenders = config
        .get_mut("extenders")
        .and_then(Value::as_array_mut)
        .context("the shipped kube-scheduler config has no extenders")?;
    for extender in extenders {
        if let Some(extender) = extender.as_object_mut() {
            extender.insert("urlPrefix".into(), Value::String(url.to_owned()));
        }
    }
    Ok(config)
}

/// The small YAML subset the shipped file is written in: top-level `key: scalar`, and
/// `key:` followed by a list of flat maps (`- key: scalar` / `  key: scalar`); comments.
/// Scalars are read as JSON where they are JSON (numbers, booleans), else as strings.
fn parse_flat_yaml(text: &str) -> Result<Map<String, Value>> {
    let scalar = |raw: &str| -> Value {
        let raw = raw.trim();
        serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_owned()))
    };
    let mut top = Map::new();
    let mut list: Option<(String, Vec<Value>)> = None;
    for line in text.lines() {
        let line = line.split(" #").next().unwrap_or_default().trim_end();
        let content = line.trim_start();
        if content.is_empty() || content.starts_with('#') {
            continue;
        }
        // A list's items may start at column 0 (`- key: value`).
        let in_list = line.len() != content.len() || (list.is_some() && content.starts_with("- "));
        if !in_list {
            if let Some((key, items)) = list.take() {
                top.insert(key, Value::Array(items));
            }
            let Some((key, value)) = content.split_once(':') else {
                bail!("unexpected line {line:?}");
            };
            if value.trim().is_empty() {
                list = Some((key.to_owned(), Vec::new()));
            } else {
                top.insert(key.to_owned(), scalar(value));
            }
            continue;
        }
        let Some((_, items)) = list.as_mut() else {
            bail!("indented line outside a list: {line:?}");
        };
        let entry = match content.strip_prefix("- ") {
            Some(rest) => {
                items.push(Value::Object(Map::new()));
                rest
            }
            None => content,
        };
        let Some((key, value)) = entry.split_once(':') else {
            bail!("unexpected line {line:?}");
        };
        let Some(Value::Object(item)) = items.last_mut() else {
            bail!("a field before the first list item: {line:?}");
        };
        item.insert(key.trim().to_owned(), scalar(value));
    }
    if let Some((key, items)) = list.take() {
        top.insert(key, Value::Array(items));
    }
    Ok(top)
}

/// Starts `tensile-scheduler-extender` (`program`) beside `pair` on `port`, reading the
/// upper Node labels with the upper admin kubeconfig and serving each (virtual node, lower
/// kubeconfig) of `clusters`; waits until `/readyz` answers 200.
pub async fn start_extender(
    pair: &ClusterPair,
    program: &Path,
    name: &str,
    port: u16,
    clusters: &[(String, &Path)],
) -> Result<Process> {
    let mut args = vec![
        format!("--kubeconfig={}", pair.upper_kubeconfig().display()),
        format!("--listen=127.0.0.1:{port}"),
        "--log-level=tensile_scheduler_extender=debug,info".into(),
    ];
    args.extend(
        clusters
            .iter()
            .map(|(node, kubeconfig)| format!("--cluster={node}={}", kubeconfig.display())),
    );
    let process = pair.spawn(name, program, &args)?;
    wait_for(
        "the scheduler extender ready",
        Duration::from_secs(120),
        || async {
            Ok(crate::http::request(port, "GET", "/readyz", "")
                .await
                .ok()
                .filter(|(status, _)| *status == 200)
                .map(|_| ()))
        },
    )
    .await?;
    Ok(process)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_shipped_config_is_read_with_another_address() {
        let config = shipped_scheduler_config("http://127.0.0.1:1234").unwrap();
        assert_eq!(config["percentageOfNodesToScore"], 100);
        let extender = &config["extenders"][0];
        assert_eq!(extender["urlPrefix"], "http://127.0.0.1:1234");
        assert_eq!(extender["prioritizeVerb"], "prioritize");
        assert_eq!(extender["nodeCacheCapable"], true);
        assert_eq!(extender["httpTimeout"], "5s");
        assert!(extender["weight"].as_i64().unwrap() * 10 > 1600);
        assert_eq!(config.len(), 2, "{config:?}");
    }
}
