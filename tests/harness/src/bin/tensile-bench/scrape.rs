//! `tensile-bench --scrape 1000,10000`: the cost of one scrape of the virtual node's
//! kubelet `/metrics/resource` at each pod count: its time, the bytes and series of the
//! answer, the lower and upper API requests it made and virtual-node's CPU for it.
//!
//! The lower cluster runs kwok's simulated resource metrics and a real metrics-server. Its
//! API server will not proxy to kwok's loopback node addresses, so the virtual node reads
//! the lower metrics API (its fallback) and tries the kubelets again only every 10 minutes:
//! the first scrape of a process (which tries them) is reported apart from the steady ones.
//! One cluster pair grows from the smallest count to the largest; before each count after
//! the first, virtual-node is restarted so that the first scrape is again its first.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::Api;
use tensile_harness::fixtures::bound_pod;
use tensile_harness::measure::{footprint, scrape};
use tensile_harness::{ClusterPair, TestNamespace, VirtualNode, wait_for};

use super::{
    Args, PODS_PER_LOWER_NODE, Shared, WAIT, create_all, labelled, track_running, wait_all_running,
};

const NODE: &str = "vk-scrape";
/// Scrapes after the first, at each count.
const STEADY: usize = 5;
/// How long the lower metrics-server may take to have metrics for every pod.
const METRICS_WAIT: Duration = Duration::from_secs(300);

/// One scrape of `/metrics/resource`.
struct Scrape {
    /// Wall time of the request (curl's `time_total`, TLS handshake included).
    time: Duration,
    bytes: u64,
    /// `container_cpu_usage_seconds_total` series.
    series: usize,
    /// `scrape_error` of the answer.
    error: bool,
    /// API requests virtual-node made meanwhile, by cluster then verb.
    requests: BTreeMap<(String, String), f64>,
    /// virtual-node's CPU seconds meanwhile.
    cpu: f64,
    /// virtual-node's resident memory (bytes) just before the scrape, and the most it
    /// held during it (sampled every 5 ms).
    rss_before: u64,
    rss_peak: u64,
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

impl Scrape {
    fn requests_of(&self, cluster: &str) -> f64 {
        self.requests
            .iter()
            .filter(|((c, _), _)| c == cluster)
            .map(|(_, n)| n)
            .sum()
    }

    /// `lower get 2, upper create 1`: the non-zero request counts.
    fn requests_by_verb(&self) -> String {
        let parts: Vec<String> = self
            .requests
            .iter()
            .filter(|(_, n)| **n > 0.0)
            .map(|((cluster, verb), n)| format!("{cluster} {verb} {n:.0}"))
            .collect();
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(", ")
        }
    }
}

/// `tensile_api_requests_total` by (cluster, verb).
fn api_requests(metrics: &BTreeMap<String, f64>) -> BTreeMap<(String, String), f64> {
    metrics
        .iter()
        .filter_map(|(series, n)| {
            let labels = series
                .strip_prefix("tensile_api_requests_total{")?
                .strip_suffix('}')?;
            let mut cluster = None;
            let mut verb = None;
            for pair in labels.split(',') {
                let (key, value) = pair.split_once('=')?;
                let value = value.trim_matches('"').to_owned();
                match key {
                    "cluster" => cluster = Some(value),
                    "verb" => verb = Some(value),
                    _ => {}
                }
            }
            Some(((cluster?, verb?), *n))
        })
        .collect()
}

fn delta(
    after: &BTreeMap<(String, String), f64>,
    before: &BTreeMap<(String, String), f64>,
) -> BTreeMap<(String, String), f64> {
    after
        .iter()
        .map(|(k, n)| (k.clone(), n - before.get(k).copied().unwrap_or(0.0)))
        .collect()
}

/// Where curl finds the upper admin's client certificate and the upper CA.
struct Credentials {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

/// GETs `/metrics/resource` of `vn` once, as the upper admin, with curl.
async fn scrape_once(vn: &VirtualNode, credentials: &Credentials, body: &Path) -> Result<Scrape> {
    let url = format!("https://127.0.0.1:{}/metrics/resource", vn.kubelet_port);
    let before = api_requests(&scrape(vn.metrics_port).await?);
    let (rss_before, _, cpu_before) = footprint(vn.pid())?;
    let pid = vn.pid();
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = tokio::spawn({
        let sampling = sampling.clone();
        async move {
            let mut peak = 0;
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok((rss, _, _)) = footprint(pid) {
                    peak = peak.max(rss);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            peak
        }
    });
    let output = tokio::process::Command::new("curl")
        .arg("-sS")
        .arg("--cacert")
        .arg(&credentials.ca)
        .arg("--cert")
        .arg(&credentials.cert)
        .arg("--key")
        .arg(&credentials.key)
        .arg("-o")
        .arg(body)
        .args(["-w", "%{http_code} %{time_total} %{size_download}", &url])
        .output()
        .await
        .context("running curl")?;
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let rss_peak = sampler.await.context("the memory sampler")?;
    let cpu_after = footprint(vn.pid())?.2;
    let after = api_requests(&scrape(vn.metrics_port).await?);
    let written = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        bail!(
            "curl {url}: {} {}",
            written,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let fields: Vec<&str> = written.split_whitespace().collect();
    let [code, time, bytes] = fields[..] else {
        bail!("curl {url} wrote {written:?}");
    };
    let text = std::fs::read_to_string(body)?;
    if code != "200" {
        bail!("{url} answered {code}: {}", text.trim());
    }
    let series = text
        .lines()
        .filter(|l| l.starts_with("container_cpu_usage_seconds_total{"))
        .count();
    let error = text
        .lines()
        .find_map(|l| l.strip_prefix("scrape_error "))
        .is_some_and(|v| v.trim() != "0");
    Ok(Scrape {
        time: Duration::from_secs_f64(time.parse()?),
        bytes: bytes.parse()?,
        series,
        error,
        requests: delta(&after, &before),
        cpu: cpu_after - cpu_before,
        rss_before,
        rss_peak: rss_peak.max(rss_before),
    })
}

/// The lower metrics API's PodMetrics of the virtual node's pods.
async fn lower_pod_metrics(lower: &Client) -> Result<usize> {
    let uri = format!(
        "/apis/metrics.k8s.io/v1beta1/pods?labelSelector=tensile.dev%2Fvirtual-node%3D{NODE}"
    );
    let request = http::Request::get(uri).body(Vec::new())?;
    let list: serde_json::Value = lower.request(request).await?;
    Ok(list
        .get("items")
        .and_then(serde_json::Value::as_array)
        .map_or(0, Vec::len))
}

/// Waits (5 s between polls, [`METRICS_WAIT`] at most) until the lower metrics API has
/// metrics for `n` of the node's pods; answers how many it had at the end and when.
async fn wait_lower_metrics(lower: &Client, n: usize) -> (usize, Duration) {
    let start = Instant::now();
    let mut last = 0;
    loop {
        match lower_pod_metrics(lower).await {
            Ok(got) => last = got,
            Err(error) => eprintln!("tensile-bench: lower metrics API: {error:#}"),
        }
        if last >= n || start.elapsed() >= METRICS_WAIT {
            return (last, start.elapsed());
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
}

fn ms(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1000.0)
}

/// Runs the scenario at each pod count of `counts`, growing one pair.
pub async fn run(binary: &Path, counts: &[usize], args: &Args) -> Result<()> {
    let mut counts: Vec<usize> = counts.iter().copied().filter(|n| *n > 0).collect();
    counts.sort_unstable();
    counts.dedup();
    let Some(&largest) = counts.last() else {
        bail!("--scrape needs at least one pod count above 0");
    };
    let mut options = super::lower_for(largest);
    let lower_nodes = options.lower.nodes;
    options.lower.metrics = true;
    eprintln!(
        "starting the cluster pair ({lower_nodes} lower kwok nodes of {PODS_PER_LOWER_NODE} pods, \
         lower metrics-server) ..."
    );
    let started = Instant::now();
    let pair = ClusterPair::start(options).await?;
    eprintln!("pair started in {:.0} s", started.elapsed().as_secs_f64());
    let (upper, lower) = (pair.upper.client().await?, pair.lower.client().await?);
    let credentials = Credentials {
        ca: pair.upper.pki.ca_cert.clone(),
        cert: pair.upper.pki.admin.cert.clone(),
        key: pair.upper.pki.admin.key.clone(),
    };
    let body = pair.dir.join("metrics-resource.txt");
    let mut vn = super::start_node(&pair, binary, args, NODE).await?;

    let ns = TestNamespace::create(&upper, "bench-scrape").await?;
    let api: Api<Pod> = Api::namespaced(upper.clone(), &ns.name);
    let timeline = Shared::default();
    let tracker = track_running(api.clone(), "bench=1", timeline.clone());
    let mut made = 0;
    let mut rows = Vec::new();
    for (i, &count) in counts.iter().enumerate() {
        let pods: Vec<Pod> = (made..count)
            .map(|i| labelled(bound_pod(&format!("s-{i:05}"), NODE)))
            .collect();
        let creating = Instant::now();
        create_all(&api, pods, args.concurrency, &timeline).await?;
        made = count;
        wait_all_running(&timeline, made, &format!("{made} pods Running upstairs")).await?;
        eprintln!(
            "{made} pods Running upstairs ({:.0} s)",
            creating.elapsed().as_secs_f64()
        );
        let (metrics, waited) = wait_lower_metrics(&lower, made).await;
        eprintln!(
            "lower metrics API: PodMetrics for {metrics} of {made} pods after {:.0} s",
            waited.as_secs_f64()
        );
        if i > 0 {
            // A fresh process, so that its first scrape tries the lower kubelets again.
            vn.stop()?;
            let restart = Instant::now();
            vn = super::start_node(&pair, binary, args, NODE).await?;
            wait_for("restart caught up", WAIT, || async {
                let m = scrape(vn.metrics_port).await?;
                let reconciled = m
                    .get("tensile_pod_reconciles_total")
                    .copied()
                    .unwrap_or(0.0);
                Ok((reconciled >= made as f64).then_some(()))
            })
            .await?;
            eprintln!(
                "virtual-node restarted, caught up in {:.1} s",
                restart.elapsed().as_secs_f64()
            );
        }
        // Whatever the pods set off has settled; the idle request rate, for comparison.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let idle_before = api_requests(&scrape(vn.metrics_port).await?);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let idle = delta(&api_requests(&scrape(vn.metrics_port).await?), &idle_before);
        let of = |cluster: &str| -> f64 {
            idle.iter()
                .filter(|((c, _), _)| c == cluster)
                .map(|(_, n)| n)
                .sum()
        };
        let idle = format!("{:.0} / {:.0}", of("lower"), of("upper"));

        let first = scrape_once(&vn, &credentials, &body).await?;
        eprintln!(
            "  {made} pods, first scrape: {} ms, {} bytes, {} series, scrape_error {}, requests: {}, CPU {:.2} s, RSS {} before, {} peak",
            ms(first.time),
            first.bytes,
            first.series,
            u8::from(first.error),
            first.requests_by_verb(),
            first.cpu,
            mib(first.rss_before),
            mib(first.rss_peak)
        );
        let mut steady = Vec::new();
        for _ in 0..STEADY {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let s = scrape_once(&vn, &credentials, &body).await?;
            eprintln!(
                "  {made} pods, scrape: {} ms, {} bytes, {} series, scrape_error {}, requests: {}, CPU {:.2} s, RSS {} before, {} peak",
                ms(s.time),
                s.bytes,
                s.series,
                u8::from(s.error),
                s.requests_by_verb(),
                s.cpu,
                mib(s.rss_before),
                mib(s.rss_peak)
            );
            steady.push(s);
        }
        rows.push((made, first, steady, idle));
    }
    tracker.abort();

    println!(
        "\n/metrics/resource of virtual node {NODE} ({} cores, virtual-node {}, lower metrics API \
         fallback; {} lower kwok nodes; steady = {STEADY} scrapes 1 s apart)",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        if cfg!(debug_assertions) {
            "debug build"
        } else {
            "release build"
        },
        lower_nodes,
    );
    println!(
        "  {:>6} | {:>22} | {:>26} | {:>10} | {:>6} | {:>15} | {:>16}",
        "pods",
        "first ms / lower req",
        "steady p50 / max ms / lower",
        "bytes",
        "series",
        "CPU s first/p50",
        "idle lower/upper"
    );
    for (pods, first, steady, idle) in &rows {
        let mut times: Vec<Duration> = steady.iter().map(|s| s.time).collect();
        times.sort();
        let median = times.get(times.len() / 2).copied().unwrap_or_default();
        let max = times.last().copied().unwrap_or_default();
        let mut lower_steady: Vec<f64> = steady.iter().map(|s| s.requests_of("lower")).collect();
        lower_steady.sort_by(f64::total_cmp);
        let lower_steady = match (lower_steady.first(), lower_steady.last()) {
            (Some(a), Some(b)) if a == b => format!("{a:.0}"),
            (Some(a), Some(b)) => format!("{a:.0}-{b:.0}"),
            _ => "-".into(),
        };
        let mut cpu: Vec<f64> = steady.iter().map(|s| s.cpu).collect();
        cpu.sort_by(f64::total_cmp);
        let cpu_median = cpu.get(cpu.len() / 2).copied().unwrap_or_default();
        let bytes = steady.last().map_or(first.bytes, |s| s.bytes);
        let series = steady.last().map_or(first.series, |s| s.series);
        let errors = std::iter::once(first)
            .chain(steady)
            .filter(|s| s.error)
            .count();
        println!(
            "  {:>6} | {:>22} | {:>26} | {:>10} | {:>6} | {:>15} | {:>16}{}",
            pods,
            format!("{} / {:.0}", ms(first.time), first.requests_of("lower")),
            format!("{} / {} / {}", ms(median), ms(max), lower_steady),
            bytes,
            series,
            format!("{:.2} / {:.2}", first.cpu, cpu_median),
            idle,
            if errors > 0 {
                format!("  ({errors} with scrape_error 1)")
            } else {
                String::new()
            },
        );
    }
    println!(
        "  (lower req: lower API requests virtual-node made during the scrape; idle: its lower / upper \
         requests over 2 s without a scrape)"
    );
    for (pods, first, steady, _) in &rows {
        let peak = std::iter::once(first)
            .chain(steady)
            .map(|s| s.rss_peak.saturating_sub(s.rss_before))
            .max()
            .unwrap_or_default();
        println!(
            "  {pods} pods, virtual-node resident memory: {} before the first scrape, {} at its peak \
             during a scrape, {} the most a scrape added",
            mib(first.rss_before),
            mib(std::iter::once(first)
                .chain(steady)
                .map(|s| s.rss_peak)
                .max()
                .unwrap_or_default()),
            mib(peak)
        );
        println!(
            "  {pods} pods, first scrape requests: {}",
            first.requests_by_verb()
        );
        if let Some(s) = steady.last() {
            println!(
                "  {pods} pods, steady scrape requests: {}",
                s.requests_by_verb()
            );
        }
    }
    let log = std::fs::read_to_string(vn.log()).unwrap_or_default();
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .collect();
    println!("  virtual-node log: {} warning/error lines", warnings.len());
    for line in warnings.iter().rev().take(5).rev() {
        println!("    {line}");
    }
    vn.stop()?;
    ns.delete().await?;
    Ok(())
}
