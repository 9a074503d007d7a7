//! `/metrics/resource` as a kubelet serves it, for the pods of one virtual node: read from
//! the lower kubelets' own `/metrics/resource` (or, without `nodes/proxy`, from the lower
//! metrics API), kept to this node's pods, renamed to their upper names, written in the
//! kubelet's text format. Pure: the caller fetches and says what time it is.
//!
//! The text is parsed by hand, not with a crate: only nine series of one fixed, simple
//! shape matter (`name{labels} value [timestamp]`), every other line is skipped unread,
//! and the Rust parsers of the exposition format bring chrono and regex for what is
//! forty lines here.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;

use crate::node::quantity::{parse_milli, parse_nano};

/// A pod's namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodName {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl PodName {
    /// `namespace/name`.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl std::fmt::Display for PodName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A pod this node mirrors: its upper name, and where its lower copy runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mirrored {
    /// The upper pod: the names the series carry.
    pub upper: PodName,
    /// The lower pod: the names the lower kubelet reports.
    pub lower: PodName,
    /// The lower node it is bound to, if any yet.
    pub lower_node: Option<String>,
}

/// One value and the time it was measured (ms since the epoch), as the kubelet gives it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// The value.
    pub value: f64,
    /// When it was measured; the scrape's time where the kubelet gave none.
    pub timestamp_ms: Option<i64>,
}

/// A container's values.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ContainerUsage {
    /// Cumulative CPU, core-seconds.
    pub cpu: Option<Sample>,
    /// Working set, bytes.
    pub memory: Option<Sample>,
    /// When the CPU counter was last zero, seconds since the epoch.
    pub start_time: Option<f64>,
}

/// A pod's values and its containers'.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodUsage {
    /// Cumulative CPU of the pod, core-seconds.
    pub cpu: Option<Sample>,
    /// Working set of the pod, bytes.
    pub memory: Option<Sample>,
    /// Its containers, by name.
    pub containers: BTreeMap<String, ContainerUsage>,
}

/// This node's pods' values, by upper name.
pub type Usage = BTreeMap<PodName, PodUsage>;

/// A line of a lower kubelet's text that could not be read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason}")]
pub struct ParseError {
    /// 1-based line number.
    pub line: usize,
    /// What is wrong with it.
    pub reason: &'static str,
}

/// The series read and served, in the order the kubelet writes them (by name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Series {
    ContainerCpu,
    ContainerMemory,
    ContainerStart,
    PodCpu,
    PodMemory,
}

impl Series {
    fn of(name: &str) -> Option<Self> {
        Some(match name {
            "container_cpu_usage_seconds_total" => Self::ContainerCpu,
            "container_memory_working_set_bytes" => Self::ContainerMemory,
            "container_start_time_seconds" => Self::ContainerStart,
            "pod_cpu_usage_seconds_total" => Self::PodCpu,
            "pod_memory_working_set_bytes" => Self::PodMemory,
            _ => return None,
        })
    }
}

/// The lower pods of `mirrored`, by lower name: what a lower kubelet's series are looked
/// up in.
pub fn by_lower_name(mirrored: &[Mirrored]) -> HashMap<&PodName, &Mirrored> {
    mirrored.iter().map(|m| (&m.lower, m)).collect()
}

/// Adds to `usage` the series of `text`, the `/metrics/resource` of the lower kubelet of
/// `lower_node`, that are about pods of `pods` (see [`by_lower_name`]) bound to that node,
/// under their upper names. Every other series and pod is left out: the lower node's own
/// totals and other tenants' pods never reach this node's figures.
pub fn read_kubelet(
    text: &str,
    lower_node: &str,
    pods: &HashMap<&PodName, &Mirrored>,
    usage: &mut Usage,
) -> Result<(), ParseError> {
    for (index, line) in text.lines().enumerate() {
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line
            .find(|c: char| c == '{' || c.is_ascii_whitespace())
            .unwrap_or(line.len());
        let Some(series) = Series::of(&line[..name_end]) else {
            continue;
        };
        let bad = |reason| ParseError {
            line: index + 1,
            reason,
        };
        let (labels, rest) = labels(&line[name_end..]).map_err(bad)?;
        let sample = sample(rest).map_err(bad)?;
        let label = |key: &str| labels.iter().find(|(k, _)| k == key).map(|(_, v)| v);
        let (Some(namespace), Some(pod)) = (label("namespace"), label("pod")) else {
            return Err(bad("a pod series without namespace and pod labels"));
        };
        let Some(mirrored) = pods.get(&PodName::new(namespace.as_str(), pod.as_str())) else {
            continue;
        };
        if mirrored.lower_node.as_deref() != Some(lower_node) {
            continue;
        }
        let entry = usage.entry(mirrored.upper.clone()).or_default();
        match series {
            Series::PodCpu => entry.cpu = Some(sample),
            Series::PodMemory => entry.memory = Some(sample),
            Series::ContainerCpu | Series::ContainerMemory | Series::ContainerStart => {
                let name = label("container").ok_or(bad("a container series without container"))?;
                let container = entry.containers.entry(name.clone()).or_default();
                match series {
                    Series::ContainerCpu => container.cpu = Some(sample),
                    Series::ContainerMemory => container.memory = Some(sample),
                    _ => container.start_time = Some(sample.value),
                }
            }
        }
    }
    Ok(())
}

/// A series' labels, as key and value.
type Labels = Vec<(String, String)>;

/// The labels at the start of `text` (`{k="v",…}`, or nothing), and what follows them.
fn labels(text: &str) -> Result<(Labels, &str), &'static str> {
    let Some(mut rest) = text.strip_prefix('{') else {
        return Ok((Vec::new(), text));
    };
    let mut labels = Vec::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix('}') {
            return Ok((labels, after));
        }
        let (key, after) = rest.split_once('=').ok_or("a label without =")?;
        let mut chars = after
            .trim_start()
            .strip_prefix('"')
            .ok_or("a label value without quotes")?
            .char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next() {
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c)) => value.push(c),
                    None => return Err("an unterminated label value"),
                },
                Some((_, c)) => value.push(c),
                None => return Err("an unterminated label value"),
            }
        };
        let after = after.trim_start();
        // `end` indexes into `after` without its opening quote.
        rest = after[1 + end + 1..].trim_start();
        labels.push((key.trim().to_owned(), value));
        if let Some(after) = rest.strip_prefix(',') {
            rest = after;
        }
    }
}

/// The value and optional timestamp after a series' name and labels.
fn sample(text: &str) -> Result<Sample, &'static str> {
    let mut fields = text.split_ascii_whitespace();
    let value = fields
        .next()
        .ok_or("a series without a value")?
        .parse::<f64>()
        .map_err(|_| "a value that is not a number")?;
    let timestamp_ms = fields
        .next()
        .map(|t| {
            t.parse::<i64>()
                .map_err(|_| "a timestamp that is not an integer")
        })
        .transpose()?;
    if fields.next().is_some() {
        return Err("more than a value and a timestamp");
    }
    Ok(Sample {
        value,
        timestamp_ms,
    })
}

/// Keeps `node_cpu_usage_seconds_total` a counter while pods come and go. The node's CPU
/// is the sum over its pods; a plain sum would fall each time a pod leaves (or a pod's
/// counter starts again, a pod re-created under its name), which metrics-server refuses
/// ("unexpected decrease in cumulative CPU") and Prometheus reads as a reset. So what a
/// pod had consumed when it left stays in the total. A pod still on this node whose
/// lower kubelet did not answer this time counts with its last value, so that it is not
/// counted twice when it answers again. Starts at zero when virtual-node does: one
/// decrease per restart, which consumers read as the counter reset it is.
#[derive(Debug, Default)]
pub struct NodeCpu {
    last: HashMap<PodName, f64>,
    retired: f64,
}

impl NodeCpu {
    /// The node's cumulative CPU given each pod's that is known now (`current`) and the
    /// pods still on this node (`mirrored`, by upper name).
    pub fn observe(
        &mut self,
        current: &BTreeMap<&PodName, f64>,
        mirrored: &HashSet<&PodName>,
    ) -> f64 {
        let mut next = HashMap::with_capacity(current.len());
        for (&pod, &cpu) in current {
            if let Some(&before) = self.last.get(pod)
                && cpu < before
            {
                self.retired += before;
            }
            next.insert(pod.clone(), cpu);
        }
        for (pod, before) in self.last.drain() {
            if next.contains_key(&pod) {
                continue;
            }
            if mirrored.contains(&pod) {
                next.insert(pod, before);
            } else {
                self.retired += before;
            }
        }
        self.last = next;
        self.total()
    }

    /// The node's cumulative CPU as last observed: for when it is not known which pods are
    /// on the node (their list failed), so none of them is taken to have left.
    pub fn total(&self) -> f64 {
        self.retired + self.last.values().sum::<f64>()
    }
}

/// One container's reading in the lower metrics API (a PodMetrics).
#[derive(Clone, Debug, PartialEq)]
pub struct Reading {
    /// The upper pod.
    pub pod: PodName,
    /// The container.
    pub container: String,
    /// When the reading's window ended, ms since the epoch.
    pub timestamp_ms: i64,
    /// How long the window was, ms.
    pub window_ms: i64,
    /// CPU over the window, cores.
    pub cores: f64,
    /// Working set, bytes.
    pub memory: f64,
}

/// CPU counters integrated from usage rates, for when only the lower metrics API can be
/// read: a PodMetrics gives a container's CPU as a rate averaged over a window, and a
/// kubelet's consumers want a cumulative counter. A container's counter starts with its
/// first reading, at the CPU used over that reading's window, and advances by rate × the
/// time since the previous reading (a reading of the same time adds nothing: several
/// scrapes per metrics window do not count it twice).
///
/// Its `container_start_time_seconds` is when the counter was zero (the start of that
/// first window), not when the container started: metrics-server keeps its previous point
/// of a container only while the new start time is before it, and takes the CPU between
/// the two as used, so the start time must move whenever the counter starts again. Which
/// is why it is never before virtual-node started: when virtual-node restarts, every
/// counter starts again at a start time later than any point the previous process
/// served, which metrics-server reads as a container restart (it drops the old point,
/// where a decrease with the same start time would be refused as "unexpected decrease in
/// cumulative CPU") and Prometheus' `rate()` as the counter reset it is. A container no
/// longer reported is forgotten, and starts again if it comes back.
#[derive(Debug)]
pub struct Integrated {
    /// When this process started, ms since the epoch.
    started_ms: i64,
    counters: HashMap<(PodName, String), Counter>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Counter {
    start_ms: i64,
    last_ms: i64,
    cpu_seconds: f64,
}

impl Integrated {
    /// No counters yet, in a process started at `started_ms`.
    pub fn new(started_ms: i64) -> Self {
        Self {
            started_ms,
            counters: HashMap::new(),
        }
    }

    /// Replaces the readings with `readings` and gives the usage they make.
    pub fn observe(&mut self, readings: &[Reading]) -> Usage {
        let mut usage = Usage::new();
        let mut next = HashMap::with_capacity(readings.len());
        for r in readings {
            let key = (r.pod.clone(), r.container.clone());
            let cores = r.cores.max(0.0);
            let counter = match self.counters.get(&key) {
                Some(c) if r.timestamp_ms > c.last_ms => Counter {
                    last_ms: r.timestamp_ms,
                    cpu_seconds: c.cpu_seconds
                        + cores * (r.timestamp_ms - c.last_ms) as f64 / 1000.0,
                    ..*c
                },
                Some(c) => *c,
                None => {
                    let start_ms = (r.timestamp_ms - r.window_ms.max(0))
                        .max(self.started_ms)
                        .min(r.timestamp_ms);
                    Counter {
                        start_ms,
                        last_ms: r.timestamp_ms,
                        cpu_seconds: cores * (r.timestamp_ms - start_ms) as f64 / 1000.0,
                    }
                }
            };
            next.insert(key, counter);
            let at = Some(counter.last_ms);
            usage.entry(r.pod.clone()).or_default().containers.insert(
                r.container.clone(),
                ContainerUsage {
                    cpu: Some(Sample {
                        value: counter.cpu_seconds,
                        timestamp_ms: at,
                    }),
                    memory: Some(Sample {
                        value: r.memory,
                        timestamp_ms: Some(r.timestamp_ms),
                    }),
                    start_time: Some(counter.start_ms as f64 / 1000.0),
                },
            );
        }
        self.counters = next;
        for pod in usage.values_mut() {
            let sum = |value: fn(&ContainerUsage) -> Option<Sample>| {
                let samples: Vec<Sample> = pod.containers.values().filter_map(value).collect();
                Some(Sample {
                    value: samples.iter().map(|s| s.value).sum(),
                    timestamp_ms: samples.iter().filter_map(|s| s.timestamp_ms).max(),
                })
                .filter(|_| !samples.is_empty())
            };
            pod.cpu = sum(|c| c.cpu);
            pod.memory = sum(|c| c.memory);
        }
        usage
    }
}

/// The readings of a lower PodMetricsList (`metrics.k8s.io/v1beta1`) about pods of `pods`
/// (see [`by_lower_name`]), under their upper names. Items it cannot read (no timestamp,
/// a quantity that is not one) are left out.
pub fn readings(list: &serde_json::Value, pods: &HashMap<&PodName, &Mirrored>) -> Vec<Reading> {
    let items = list["items"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut readings = Vec::new();
    for item in items {
        let meta = &item["metadata"];
        let (Some(namespace), Some(name)) = (meta["namespace"].as_str(), meta["name"].as_str())
        else {
            continue;
        };
        let Some(mirrored) = pods.get(&PodName::new(namespace, name)) else {
            continue;
        };
        let Some(timestamp_ms) = item["timestamp"]
            .as_str()
            .and_then(|t| t.parse::<k8s_openapi::jiff::Timestamp>().ok())
            .map(|t| t.as_millisecond())
        else {
            continue;
        };
        let window_ms = item["window"].as_str().and_then(duration_ms).unwrap_or(0);
        for container in item["containers"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            let usage = &container["usage"];
            let cores = usage["cpu"].as_str().and_then(parse_nano);
            let memory = usage["memory"].as_str().and_then(parse_milli);
            let (Some(container), Some(cores), Some(memory)) =
                (container["name"].as_str(), cores, memory)
            else {
                continue;
            };
            readings.push(Reading {
                pod: mirrored.upper.clone(),
                container: container.to_owned(),
                timestamp_ms,
                window_ms,
                cores: cores as f64 / 1e9,
                memory: (memory / 1000) as f64,
            });
        }
    }
    readings
}

/// A Go duration as metrics-server writes a window (`15.012s`, `1m0s`, `500ms`), in ms.
pub fn duration_ms(text: &str) -> Option<i64> {
    let mut rest = text.trim();
    let mut total = 0.0;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let number_end = rest.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
        let number: f64 = rest[..number_end].parse().ok()?;
        rest = &rest[number_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let ms_per_unit = match &rest[..unit_end] {
            "h" => 3_600_000.0,
            "m" => 60_000.0,
            "s" => 1000.0,
            "ms" => 1.0,
            "us" | "\u{b5}s" | "\u{3bc}s" => 1e-3,
            "ns" => 1e-6,
            _ => return None,
        };
        total += number * ms_per_unit;
        rest = &rest[unit_end..];
    }
    Some(total.round() as i64)
}

/// The node's own series: sums over its pods.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeUsage {
    /// Cumulative CPU (see [`NodeCpu`]).
    pub cpu: Option<Sample>,
    /// Working set.
    pub memory: Option<Sample>,
}

/// The node's working set, and the time of the newest reading it sums, or `now_ms`.
pub fn node_memory(usage: &Usage, now_ms: i64) -> Sample {
    let samples = usage.values().filter_map(|p| p.memory);
    let (mut value, mut newest) = (0.0, None::<i64>);
    for s in samples {
        value += s.value;
        newest = newest.max(s.timestamp_ms);
    }
    Sample {
        value,
        timestamp_ms: Some(newest.unwrap_or(now_ms)),
    }
}

/// The time of the newest CPU reading of `usage`, or `now_ms`.
pub fn newest_cpu(usage: &Usage, now_ms: i64) -> i64 {
    usage
        .values()
        .filter_map(|p| p.cpu.and_then(|s| s.timestamp_ms))
        .max()
        .unwrap_or(now_ms)
}

/// The `/metrics/resource` text: the kubelet's HELP, TYPE and series, each value with the
/// timestamp it was measured at, and `scrape_error` (both names the kubelet writes).
pub fn render(usage: &Usage, node: &NodeUsage, scrape_error: bool) -> String {
    let mut out = String::with_capacity(256 + usage.len() * 600);
    let family = |out: &mut String, name: &str, kind: &str, help: &str| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    };
    let containers = || {
        usage.iter().flat_map(|(pod, p)| {
            p.containers
                .iter()
                .map(move |(name, c)| (pod, name.as_str(), c))
        })
    };
    family(
        &mut out,
        "container_cpu_usage_seconds_total",
        "counter",
        "[STABLE] Cumulative cpu time consumed by the container in core-seconds",
    );
    for (pod, name, c) in containers() {
        series(
            &mut out,
            "container_cpu_usage_seconds_total",
            Some(name),
            Some(pod),
            c.cpu,
        );
    }
    family(
        &mut out,
        "container_memory_working_set_bytes",
        "gauge",
        "[STABLE] Current working set of the container in bytes",
    );
    for (pod, name, c) in containers() {
        series(
            &mut out,
            "container_memory_working_set_bytes",
            Some(name),
            Some(pod),
            c.memory,
        );
    }
    family(
        &mut out,
        "container_start_time_seconds",
        "gauge",
        "[STABLE] Start time of the container since unix epoch in seconds",
    );
    for (pod, name, c) in containers() {
        let start = c.start_time.map(|value| Sample {
            value,
            timestamp_ms: None,
        });
        series(
            &mut out,
            "container_start_time_seconds",
            Some(name),
            Some(pod),
            start,
        );
    }
    family(
        &mut out,
        "node_cpu_usage_seconds_total",
        "counter",
        "[STABLE] Cumulative cpu time consumed by the node in core-seconds",
    );
    series(
        &mut out,
        "node_cpu_usage_seconds_total",
        None,
        None,
        node.cpu,
    );
    family(
        &mut out,
        "node_memory_working_set_bytes",
        "gauge",
        "[STABLE] Current working set of the node in bytes",
    );
    series(
        &mut out,
        "node_memory_working_set_bytes",
        None,
        None,
        node.memory,
    );
    family(
        &mut out,
        "pod_cpu_usage_seconds_total",
        "counter",
        "[STABLE] Cumulative cpu time consumed by the pod in core-seconds",
    );
    for (pod, p) in usage {
        series(
            &mut out,
            "pod_cpu_usage_seconds_total",
            None,
            Some(pod),
            p.cpu,
        );
    }
    family(
        &mut out,
        "pod_memory_working_set_bytes",
        "gauge",
        "[STABLE] Current working set of the pod in bytes",
    );
    for (pod, p) in usage {
        series(
            &mut out,
            "pod_memory_working_set_bytes",
            None,
            Some(pod),
            p.memory,
        );
    }
    let error = Some(Sample {
        value: if scrape_error { 1.0 } else { 0.0 },
        timestamp_ms: None,
    });
    family(
        &mut out,
        "resource_scrape_error",
        "gauge",
        "[STABLE] 1 if there was an error while getting container metrics, 0 otherwise",
    );
    series(&mut out, "resource_scrape_error", None, None, error);
    family(
        &mut out,
        "scrape_error",
        "gauge",
        "[ALPHA] (Deprecated since 1.29.0) 1 if there was an error while getting container \
         metrics, 0 otherwise",
    );
    series(&mut out, "scrape_error", None, None, error);
    out
}

/// One series line; nothing without a finite value.
fn series(
    out: &mut String,
    name: &str,
    container: Option<&str>,
    pod: Option<&PodName>,
    sample: Option<Sample>,
) {
    let Some(sample) = sample.filter(|s| s.value.is_finite()) else {
        return;
    };
    out.push_str(name);
    let mut labels: Vec<(&str, &str)> = Vec::new();
    if let Some(container) = container {
        labels.push(("container", container));
    }
    if let Some(pod) = pod {
        labels.push(("namespace", &pod.namespace));
        labels.push(("pod", &pod.name));
    }
    for (i, (key, value)) in labels.iter().enumerate() {
        out.push(if i == 0 { '{' } else { ',' });
        out.push_str(key);
        out.push_str("=\"");
        for c in value.chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '"' => out.push_str("\\\""),
                '\n' => out.push_str("\\n"),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    if !labels.is_empty() {
        out.push('}');
    }
    let _ = write!(out, " {}", sample.value);
    if let Some(at) = sample.timestamp_ms {
        let _ = write!(out, " {at}");
    }
    out.push('\n');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mirrored(upper: (&str, &str), lower: (&str, &str), node: Option<&str>) -> Mirrored {
        Mirrored {
            upper: PodName::new(upper.0, upper.1),
            lower: PodName::new(lower.0, lower.1),
            lower_node: node.map(str::to_owned),
        }
    }

    fn at(value: f64, timestamp_ms: i64) -> Option<Sample> {
        Some(Sample {
            value,
            timestamp_ms: Some(timestamp_ms),
        })
    }

    /// A lower kubelet's `/metrics/resource` (1.34), with a node total, a pod of this node,
    /// a pod of another virtual node and the node's own pods.
    const KUBELET: &str = r#"# HELP container_cpu_usage_seconds_total [STABLE] Cumulative cpu time consumed by the container in core-seconds
# TYPE container_cpu_usage_seconds_total counter
container_cpu_usage_seconds_total{container="app",namespace="shop",pod="web-0"} 12.5 1700000000100
container_cpu_usage_seconds_total{container="sidecar",namespace="shop",pod="web-0"} 0.25 1700000000100
container_cpu_usage_seconds_total{container="app",namespace="shop",pod="other-tenant"} 99 1700000000100
container_cpu_usage_seconds_total{container="coredns",namespace="kube-system",pod="coredns-1"} 7 1700000000100
# HELP container_memory_working_set_bytes [STABLE] Current working set of the container in bytes
# TYPE container_memory_working_set_bytes gauge
container_memory_working_set_bytes{container="app",namespace="shop",pod="web-0"} 1.048576e+06 1700000000200
container_memory_working_set_bytes{container="sidecar",namespace="shop",pod="web-0"} 4096 1700000000200
# HELP container_start_time_seconds [STABLE] Start time of the container since unix epoch in seconds
# TYPE container_start_time_seconds gauge
container_start_time_seconds{container="app",namespace="shop",pod="web-0"} 1.6999999e+09
# HELP container_swap_usage_bytes [ALPHA] Current amount of the container swap usage in bytes.
# TYPE container_swap_usage_bytes gauge
container_swap_usage_bytes{container="app",namespace="shop",pod="web-0"} 0 1700000000200
# HELP node_cpu_usage_seconds_total [STABLE] Cumulative cpu time consumed by the node in core-seconds
# TYPE node_cpu_usage_seconds_total counter
node_cpu_usage_seconds_total 123456.75 1700000000050
# HELP node_memory_working_set_bytes [STABLE] Current working set of the node in bytes
# TYPE node_memory_working_set_bytes gauge
node_memory_working_set_bytes 8.589934592e+09 1700000000050
# HELP pod_cpu_usage_seconds_total [STABLE] Cumulative cpu time consumed by the pod in core-seconds
# TYPE pod_cpu_usage_seconds_total counter
pod_cpu_usage_seconds_total{namespace="shop",pod="web-0"} 12.8 1700000000100
pod_cpu_usage_seconds_total{namespace="shop",pod="other-tenant"} 99 1700000000100
# HELP pod_memory_working_set_bytes [STABLE] Current working set of the pod in bytes
# TYPE pod_memory_working_set_bytes gauge
pod_memory_working_set_bytes{namespace="shop",pod="web-0"} 1.06496e+06 1700000000200
# HELP resource_scrape_error [STABLE] 1 if there was an error while getting container metrics, 0 otherwise
# TYPE resource_scrape_error gauge
resource_scrape_error 0
"#;

    #[test]
    fn reads_pod_metrics_of_this_nodes_pods() {
        let list = serde_json::json!({"items": [
            {
                "metadata": {"namespace": "shop", "name": "web-0"},
                "timestamp": "2026-01-01T00:00:10Z",
                "window": "15.5s",
                "containers": [
                    {"name": "app", "usage": {"cpu": "250m", "memory": "64Mi"}},
                    {"name": "bad", "usage": {"cpu": "lots", "memory": "1Ki"}},
                ],
            },
            {
                "metadata": {"namespace": "shop", "name": "not-ours"},
                "timestamp": "2026-01-01T00:00:10Z",
                "window": "15s",
                "containers": [{"name": "app", "usage": {"cpu": "1", "memory": "1"}}],
            },
            {
                "metadata": {"namespace": "shop", "name": "web-1"},
                "containers": [{"name": "app", "usage": {"cpu": "1", "memory": "1"}}],
            },
        ]});
        let pods = [
            mirrored(("shop-up", "web-0"), ("shop", "web-0"), Some("l")),
            mirrored(("shop-up", "web-1"), ("shop", "web-1"), Some("l")),
        ];
        let got = readings(&list, &by_lower_name(&pods));
        assert_eq!(
            got,
            [Reading {
                pod: PodName::new("shop-up", "web-0"),
                container: "app".into(),
                timestamp_ms: 1_767_225_610_000,
                window_ms: 15_500,
                cores: 0.25,
                memory: 64.0 * 1024.0 * 1024.0,
            }]
        );
    }

    #[test]
    fn reads_go_durations() {
        let cases = [
            ("15s", Some(15_000)),
            ("15.012s", Some(15_012)),
            ("1m0s", Some(60_000)),
            ("1h2m3.5s", Some(3_723_500)),
            ("500ms", Some(500)),
            ("1500us", Some(2)),
            ("0s", Some(0)),
            ("", None),
            ("15", None),
            ("s", None),
            ("15x", None),
        ];
        for (text, want) in cases {
            assert_eq!(duration_ms(text), want, "{text:?}");
        }
    }

    #[test]
    fn keeps_only_this_nodes_pods_under_their_upper_names() {
        let web = (
            PodName::new("shop-up", "web-0"),
            PodUsage {
                cpu: at(12.8, 1_700_000_000_100),
                memory: at(1_064_960.0, 1_700_000_000_200),
                containers: BTreeMap::from([
                    (
                        "app".to_owned(),
                        ContainerUsage {
                            cpu: at(12.5, 1_700_000_000_100),
                            memory: at(1_048_576.0, 1_700_000_000_200),
                            start_time: Some(1_699_999_900.0),
                        },
                    ),
                    (
                        "sidecar".to_owned(),
                        ContainerUsage {
                            cpu: at(0.25, 1_700_000_000_100),
                            memory: at(4096.0, 1_700_000_000_200),
                            start_time: None,
                        },
                    ),
                ]),
            },
        );
        // (what this node mirrors, the lower node whose text it is, the usage kept)
        let cases: Vec<(Vec<Mirrored>, &str, Usage)> = vec![
            (
                vec![mirrored(
                    ("shop-up", "web-0"),
                    ("shop", "web-0"),
                    Some("lower-1"),
                )],
                "lower-1",
                Usage::from([web.clone()]),
            ),
            // Its lower pod is bound to another node: this node's series are an old copy.
            (
                vec![mirrored(
                    ("shop-up", "web-0"),
                    ("shop", "web-0"),
                    Some("lower-2"),
                )],
                "lower-1",
                Usage::new(),
            ),
            (
                vec![mirrored(("shop-up", "web-0"), ("shop", "web-0"), None)],
                "lower-1",
                Usage::new(),
            ),
            (Vec::new(), "lower-1", Usage::new()),
            (
                vec![mirrored(
                    ("shop-up", "db-0"),
                    ("shop", "db-0"),
                    Some("lower-1"),
                )],
                "lower-1",
                Usage::new(),
            ),
        ];
        for (pods, node, want) in cases {
            let mut usage = Usage::new();
            read_kubelet(KUBELET, node, &by_lower_name(&pods), &mut usage).unwrap();
            assert_eq!(usage, want, "{pods:?} on {node}");
        }
    }

    #[test]
    fn reads_labels_as_the_exposition_format_writes_them() {
        let pods = [mirrored(("up", "p"), ("n", "p"), Some("l"))];
        // (series line, the container named, its CPU)
        let cases = [
            (
                r#"container_cpu_usage_seconds_total{container="a",namespace="n",pod="p"} 1"#,
                "a",
                1.0,
            ),
            // any order, spaces, a trailing comma, escapes
            (
                r#"container_cpu_usage_seconds_total{ pod="p" , namespace="n", container="a\"b\\c\nd", } 2 5"#,
                "a\"b\\c\nd",
                2.0,
            ),
            (
                r#"container_cpu_usage_seconds_total{container="a,}=",namespace="n",pod="p"} 3e-3"#,
                "a,}=",
                0.003,
            ),
        ];
        for (line, container, cpu) in cases {
            let mut usage = Usage::new();
            read_kubelet(line, "l", &by_lower_name(&pods), &mut usage).unwrap();
            let got = usage[&PodName::new("up", "p")].containers[container].cpu;
            assert_eq!(got.map(|s| s.value), Some(cpu), "{line}");
        }
    }

    #[test]
    fn refuses_series_it_cannot_read() {
        let pods = [mirrored(("n", "p"), ("n", "p"), Some("l"))];
        let cases = [
            (
                "pod_cpu_usage_seconds_total{namespace=\"n\",pod=\"p\"}",
                1,
                "without a value",
            ),
            (
                "\n\npod_cpu_usage_seconds_total{namespace=\"n\",pod=\"p\"} x",
                3,
                "not a number",
            ),
            (
                "pod_cpu_usage_seconds_total{namespace=\"n\",pod=\"p\"} 1 soon",
                1,
                "not an integer",
            ),
            (
                "pod_cpu_usage_seconds_total{namespace=\"n\",pod=\"p\"} 1 2 3",
                1,
                "more than",
            ),
            (
                "pod_cpu_usage_seconds_total{namespace=\"n\",pod=\"p} 1",
                1,
                "unterminated",
            ),
            (
                "pod_cpu_usage_seconds_total{namespace=n} 1",
                1,
                "without quotes",
            ),
            ("pod_cpu_usage_seconds_total{namespace} 1", 1, "without ="),
            (
                "pod_cpu_usage_seconds_total 1",
                1,
                "without namespace and pod",
            ),
            (
                "container_cpu_usage_seconds_total{namespace=\"n\",pod=\"p\"} 1",
                1,
                "without container",
            ),
        ];
        for (text, line, reason) in cases {
            let got = read_kubelet(text, "l", &by_lower_name(&pods), &mut Usage::new());
            let error = got.expect_err(text);
            assert_eq!(error.line, line, "{text}");
            assert!(error.reason.contains(reason), "{text}: {error}");
        }
        // Series it does not serve are skipped unread, however they look.
        let other = "node_cpu_usage_seconds_total{{{ what\nmachine_memory_bytes";
        assert_eq!(
            read_kubelet(other, "l", &by_lower_name(&pods), &mut Usage::new()),
            Ok(())
        );
    }

    #[test]
    fn node_cpu_stays_a_counter_as_pods_come_and_go() {
        let (a, b) = (PodName::new("n", "a"), PodName::new("n", "b"));
        // (pods known now with their CPU, pods still on the node, the node's CPU)
        type Step<'a> = (Vec<(&'a PodName, f64)>, Vec<&'a PodName>, f64);
        let steps: Vec<Step> = vec![
            (vec![(&a, 10.0), (&b, 5.0)], vec![&a, &b], 15.0),
            (vec![(&a, 12.0), (&b, 6.0)], vec![&a, &b], 18.0),
            // b's lower kubelet did not answer: b counts with its last value
            (vec![(&a, 13.0)], vec![&a, &b], 19.0),
            (vec![(&a, 14.0), (&b, 7.0)], vec![&a, &b], 21.0),
            // b left the node: what it used stays
            (vec![(&a, 15.0)], vec![&a], 22.0),
            // a re-created under its name: its counter starts again
            (vec![(&a, 1.0)], vec![&a], 23.0),
            (vec![(&a, 2.0)], vec![&a], 24.0),
            // b comes back as a new pod
            (vec![(&a, 2.0), (&b, 0.5)], vec![&a, &b], 24.5),
            (vec![], vec![], 24.5),
        ];
        let mut node = NodeCpu::default();
        let mut before = 0.0;
        for (i, (current, on_node, want)) in steps.into_iter().enumerate() {
            let current: BTreeMap<&PodName, f64> = current.into_iter().collect();
            let on_node: HashSet<&PodName> = on_node.into_iter().collect();
            let got = node.observe(&current, &on_node);
            assert!((got - want).abs() < 1e-9, "step {i}: {got}, want {want}");
            assert!(got >= before, "step {i}: the counter fell");
            assert_eq!(node.total(), got, "step {i}");
            before = got;
        }
    }

    /// What metrics-server makes of two consecutive points of a container (start time s,
    /// timestamp ms, cumulative CPU): a rate in cores, `None` where it drops the older point
    /// as from before a restart, or an error where it refuses the pair.
    fn metrics_server_rate(
        prev: (f64, i64, f64),
        last: (f64, i64, f64),
    ) -> Result<Option<f64>, &'static str> {
        // pkg/storage/pod.go: the previous point is kept only if the new start time is before it
        if last.0 * 1000.0 >= prev.1 as f64 {
            return Ok(None);
        }
        if last.2 < prev.2 {
            return Err("unexpected decrease in cumulative CPU usage value");
        }
        if last.1 <= prev.1 {
            return Ok(None);
        }
        Ok(Some(
            (last.2 - prev.2) / ((last.1 - prev.1) as f64 / 1000.0),
        ))
    }

    #[test]
    fn integrated_cpu_is_a_counter_across_virtual_node_restarts() {
        let pod = PodName::new("up", "web");
        // (virtual-node (re)started at this time in s, the reading's time in s, CPU cores
        // over its 15 s window, the counter served, its start time in s, what metrics-server
        // derives from the previous point and this one)
        type Step = (
            Option<i64>,
            i64,
            f64,
            f64,
            f64,
            Result<Option<f64>, &'static str>,
        );
        let steps: [Step; 11] = [
            (Some(990), 1000, 0.5, 5.0, 990.0, Ok(None)),
            (None, 1015, 0.5, 12.5, 990.0, Ok(Some(0.5))),
            // scraped again before the metrics API moved on: nothing is added
            (None, 1015, 0.5, 12.5, 990.0, Ok(None)),
            (None, 1030, 2.0, 42.5, 990.0, Ok(Some(2.0))),
            // a negative rate is nonsense; it adds nothing
            (None, 1045, -1.0, 42.5, 990.0, Ok(Some(0.0))),
            // virtual-node restarts: the counter starts again, from a later start time,
            // which metrics-server takes for a restart rather than a decrease
            (Some(1050), 1060, 1.0, 10.0, 1050.0, Ok(None)),
            (None, 1075, 1.0, 25.0, 1050.0, Ok(Some(1.0))),
            // an older reading than the last (another metrics-server replica): no change
            (None, 1070, 9.0, 25.0, 1050.0, Ok(None)),
            // restarted after the reading was taken: the counter starts at it, at zero
            (Some(1080), 1075, 1.0, 0.0, 1075.0, Ok(None)),
            // (a start time equal to the last point's reads as one more restart)
            (None, 1090, 1.0, 15.0, 1075.0, Ok(None)),
            (None, 1105, 1.0, 30.0, 1075.0, Ok(Some(1.0))),
        ];
        let mut integrated = Integrated::new(0);
        let mut prev: Option<(f64, i64, f64)> = None;
        for (i, (started, at_s, cores, want_cpu, want_start, want_rate)) in
            steps.into_iter().enumerate()
        {
            if let Some(started) = started {
                integrated = Integrated::new(started * 1000);
            }
            let usage = integrated.observe(&[Reading {
                pod: pod.clone(),
                container: "app".into(),
                timestamp_ms: at_s * 1000,
                window_ms: 15_000,
                cores,
                memory: 100.0,
            }]);
            let c = &usage[&pod].containers["app"];
            let cpu = c.cpu.unwrap();
            assert_eq!(
                (cpu.value, c.start_time),
                (want_cpu, Some(want_start)),
                "step {i}"
            );
            assert_eq!(
                usage[&pod].cpu.map(|s| s.value),
                Some(want_cpu),
                "step {i}: pod"
            );
            let point = (want_start, cpu.timestamp_ms.unwrap(), cpu.value);
            if let Some(prev) = prev {
                assert_eq!(metrics_server_rate(prev, point), want_rate, "step {i}");
            }
            prev = Some(point);
        }
        // A container no longer reported is forgotten, and starts again when it comes back.
        assert!(integrated.observe(&[]).is_empty());
        let usage = integrated.observe(&[Reading {
            pod: pod.clone(),
            container: "app".into(),
            timestamp_ms: 1_200_000,
            window_ms: 20_000,
            cores: 1.0,
            memory: 1.0,
        }]);
        let c = &usage[&pod].containers["app"];
        assert_eq!(
            (c.start_time, c.cpu.map(|s| s.value)),
            (Some(1180.0), Some(20.0))
        );
    }

    #[test]
    fn renders_the_kubelet_format_with_timestamps() {
        let usage = Usage::from([(
            PodName::new("shop", "web-0"),
            PodUsage {
                cpu: at(12.75, 1_700_000_000_100),
                memory: at(1_048_576.0, 1_700_000_000_200),
                containers: BTreeMap::from([(
                    "a\"pp".to_owned(),
                    ContainerUsage {
                        cpu: at(12.75, 1_700_000_000_100),
                        memory: at(1_048_576.0, 1_700_000_000_200),
                        start_time: Some(1_699_999_900.5),
                    },
                )]),
            },
        )]);
        let node = NodeUsage {
            cpu: at(20.5, 1_700_000_000_100),
            memory: Some(node_memory(&usage, 1)),
        };
        let want = r#"# HELP container_cpu_usage_seconds_total [STABLE] Cumulative cpu time consumed by the container in core-seconds
# TYPE container_cpu_usage_seconds_total counter
container_cpu_usage_seconds_total{container="a\"pp",namespace="shop",pod="web-0"} 12.75 1700000000100
# HELP container_memory_working_set_bytes [STABLE] Current working set of the container in bytes
# TYPE container_memory_working_set_bytes gauge
container_memory_working_set_bytes{container="a\"pp",namespace="shop",pod="web-0"} 1048576 1700000000200
# HELP container_start_time_seconds [STABLE] Start time of the container since unix epoch in seconds
# TYPE container_start_time_seconds gauge
container_start_time_seconds{container="a\"pp",namespace="shop",pod="web-0"} 1699999900.5
# HELP node_cpu_usage_seconds_total [STABLE] Cumulative cpu time consumed by the node in core-seconds
# TYPE node_cpu_usage_seconds_total counter
node_cpu_usage_seconds_total 20.5 1700000000100
# HELP node_memory_working_set_bytes [STABLE] Current working set of the node in bytes
# TYPE node_memory_working_set_bytes gauge
node_memory_working_set_bytes 1048576 1700000000200
# HELP pod_cpu_usage_seconds_total [STABLE] Cumulative cpu time consumed by the pod in core-seconds
# TYPE pod_cpu_usage_seconds_total counter
pod_cpu_usage_seconds_total{namespace="shop",pod="web-0"} 12.75 1700000000100
# HELP pod_memory_working_set_bytes [STABLE] Current working set of the pod in bytes
# TYPE pod_memory_working_set_bytes gauge
pod_memory_working_set_bytes{namespace="shop",pod="web-0"} 1048576 1700000000200
# HELP resource_scrape_error [STABLE] 1 if there was an error while getting container metrics, 0 otherwise
# TYPE resource_scrape_error gauge
resource_scrape_error 0
# HELP scrape_error [ALPHA] (Deprecated since 1.29.0) 1 if there was an error while getting container metrics, 0 otherwise
# TYPE scrape_error gauge
scrape_error 0
"#;
        assert_eq!(render(&usage, &node, false), want);
        // What it serves reads back as it was.
        let pods = [mirrored(("shop", "web-0"), ("shop", "web-0"), Some("vk"))];
        let mut back = Usage::new();
        read_kubelet(want, "vk", &by_lower_name(&pods), &mut back).unwrap();
        assert_eq!(back, usage);
        // No pods, a lower cluster that gave nothing: the error and no series.
        let empty = render(&Usage::new(), &NodeUsage::default(), true);
        let series: Vec<&str> = empty.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(series, ["resource_scrape_error 1", "scrape_error 1"]);
    }
}
