//! webhook-bench: the webhook's figures on loopback, and a bounded soak with malformed input.
//!
//! `webhook-bench latency` starts the real server (rustls, axum, the pure core) in this
//! process on its own runtime threads, with a freshly generated certificate, and drives
//! it at a fixed rate from other threads; it prints p50/p99 latency and throughput against
//! the target (p99 < 2 ms at 1000 requests/s). `webhook-bench soak` sends malformed and
//! mutated reviews as fast as it can for a bounded time and fails if any answer is other
//! than 200 (allowed, with a patch that applies) or 400.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine;
use clap::{Parser, Subcommand};
use serde_json::{Value, json};
use tensile_webhook::loopback::{self, Client, ClientError, Running};
use tensile_webhook::memory::DeschedulerMemory;
use tensile_webhook::metrics::Metrics;
use tensile_webhook::mutate::{MutateConfig, NoSelectedNodes};
use tensile_webhook::server::App;

#[derive(Parser, Debug)]
#[command(name = "webhook-bench", about)]
struct Cli {
    #[command(subcommand)]
    command: Mode,
    /// Worker threads of the server's runtime (the client has its own).
    #[arg(long, global = true, default_value_t = 1)]
    server_threads: usize,
}

#[derive(Subcommand, Debug)]
enum Mode {
    /// Latency and throughput at a fixed request rate.
    Latency {
        /// Requests per second.
        #[arg(long, default_value_t = 1000.0)]
        rate: f64,
        /// Measured seconds (after a 1 s warm-up).
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Connections the requests are spread over.
        #[arg(long, default_value_t = 8)]
        connections: u64,
        /// Review unlabelled pods (the fast path) instead of labelled ones.
        #[arg(long)]
        unlabelled: bool,
    },
    /// Malformed and mutated reviews for a bounded time.
    Soak {
        /// Seconds to run.
        #[arg(long, default_value_t = 60.0)]
        seconds: f64,
        /// Concurrent connections.
        #[arg(long, default_value_t = 4)]
        connections: u64,
        /// Seed of the input generator (default: from the clock); printed for replay.
        #[arg(long)]
        seed: Option<u64>,
    },
}

/// Body limit of the soak's server, so oversized bodies are cheap to send.
const SOAK_MAX_BODY: usize = 256 << 10;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("webhook-bench: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<bool, ClientError> {
    let dir = std::env::temp_dir().join(format!("tensile-webhook-bench-{}", std::process::id()));
    let certs = tensile_webhook::certs::generate("tensile-webhook", &["127.0.0.1".to_owned()], 1)?;
    certs.write(&dir)?;
    let result = run_in(&cli, &dir, certs.ca_pem.as_bytes());
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run_in(cli: &Cli, dir: &std::path::Path, ca: &[u8]) -> Result<bool, ClientError> {
    let max_body_bytes = match cli.command {
        Mode::Soak { .. } => SOAK_MAX_BODY,
        Mode::Latency { .. } => tensile_webhook::server::DEFAULT_MAX_BODY_BYTES,
    };
    let app = Arc::new(App {
        config: MutateConfig::default(),
        memory: DeschedulerMemory::default(),
        volumes: Arc::new(NoSelectedNodes),
        metrics: Arc::new(Metrics::default()),
        max_body_bytes,
    });
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cli.server_threads.max(1))
        .thread_name("webhook-server")
        .enable_all()
        .build()?;
    let (cert, key): (PathBuf, PathBuf) = (dir.join("tls.crt"), dir.join("tls.key"));
    let running: Running = server_rt.block_on(loopback::serve(
        app.clone(),
        &cert,
        &key,
        Duration::from_secs(3600),
    ))?;
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let client = Client::new(running.addr, ca, "127.0.0.1")?;
    let ok = match cli.command {
        Mode::Latency {
            rate,
            seconds,
            connections,
            unlabelled,
        } => client_rt.block_on(latency(
            &client,
            rate,
            seconds,
            connections,
            !unlabelled,
            cli.server_threads,
        ))?,
        Mode::Soak {
            seconds,
            connections,
            seed,
        } => client_rt.block_on(soak(&client, seconds, connections, seed))?,
    };
    running.shutdown.cancel();
    let _ = server_rt.block_on(running.task);
    let text = app.metrics.render();
    let shown = [
        "tensile_webhook_requests_total",
        "tensile_webhook_bad_requests_total",
        // Time inside the handler, without TLS, HTTP or queueing for a CPU.
        "tensile_webhook_review_duration_seconds_bucket",
    ];
    for line in text
        .lines()
        .filter(|l| shown.iter().any(|s| l.starts_with(s)) && !l.ends_with(" 0"))
    {
        println!("  server: {line}");
    }
    Ok(ok)
}

async fn latency(
    client: &Client,
    rate: f64,
    seconds: f64,
    connections: u64,
    labelled: bool,
    server_threads: usize,
) -> Result<bool, ClientError> {
    let body = Arc::new(serde_json::to_vec(&loopback::sample_review(
        "bench", labelled,
    ))?);
    // Warm-up: connections, TLS sessions, allocator.
    loopback::paced_load(
        client,
        "/mutate",
        body.clone(),
        rate,
        rate as u64,
        connections,
    )
    .await?;
    let total = (rate * seconds).round() as u64;
    let report =
        loopback::paced_load(client, "/mutate", body.clone(), rate, total, connections).await?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let p99 = report.quantile(0.99);
    println!(
        "tensile-webhook on loopback: {total} reviews ({} pod CREATE, {} bytes) at {rate}/s over {connections} connections, {server_threads} server thread(s)",
        if labelled { "labelled" } else { "unlabelled" },
        body.len()
    );
    println!(
        "  throughput {:.1} req/s, errors {}",
        report.throughput(),
        report.errors
    );
    println!(
        "  latency p50 {:.3} ms  p90 {:.3} ms  p99 {:.3} ms  p99.9 {:.3} ms  max {:.3} ms",
        ms(report.quantile(0.5)),
        ms(report.quantile(0.9)),
        ms(p99),
        ms(report.quantile(0.999)),
        ms(report.quantile(1.0)),
    );
    let met = p99 < Duration::from_millis(2) && report.errors == 0;
    println!(
        "  target p99 < 2 ms at {rate}/s: {}",
        if met { "met" } else { "NOT met" }
    );
    Ok(met)
}

/// xorshift64*: enough randomness for input generation, and replayable from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn value(&mut self, depth: u32) -> Value {
        match self.below(if depth > 2 { 6 } else { 8 }) {
            0 => Value::Null,
            1 => Value::Bool(self.next().is_multiple_of(2)),
            2 => json!(self.next() as i64),
            3 => json!(f64::from(self.next() as u32) / 7.0),
            4 => Value::String(self.string()),
            5 => Value::String(
                [
                    "true",
                    "Exists",
                    "NoExecute",
                    "In",
                    "",
                    "kube-system",
                    "virtual-pod",
                ][self.below(7)]
                .into(),
            ),
            6 => Value::Array((0..self.below(4)).map(|_| self.value(depth + 1)).collect()),
            _ => Value::Object(
                (0..self.below(4))
                    .map(|_| (self.key(), self.value(depth + 1)))
                    .collect(),
            ),
        }
    }
    fn string(&mut self) -> String {
        (0..self.below(12))
            .map(|_| char::from_u32(self.below(0x2FF) as u32 + 1).unwrap_or('x'))
            .collect()
    }
    fn key(&mut self) -> String {
        const KEYS: [&str; 12] = [
            "key",
            "operator",
            "values",
            "effect",
            "nodeSelectorTerms",
            "matchExpressions",
            "matchFields",
            "requiredDuringSchedulingIgnoredDuringExecution",
            "nodeAffinity",
            "claimName",
            "uid",
            "x",
        ];
        KEYS[self.below(KEYS.len())].to_owned()
    }
}

const PATHS: [&str; 20] = [
    "/apiVersion",
    "/kind",
    "/request",
    "/request/uid",
    "/request/kind",
    "/request/kind/kind",
    "/request/operation",
    "/request/namespace",
    "/request/object",
    "/request/object/metadata",
    "/request/object/metadata/labels",
    "/request/object/metadata/annotations",
    "/request/object/metadata/ownerReferences",
    "/request/object/spec",
    "/request/object/spec/tolerations",
    "/request/object/spec/affinity",
    "/request/object/spec/affinity/nodeAffinity",
    "/request/object/spec/nodeSelector",
    "/request/object/spec/volumes",
    "/request/dryRun",
];

/// One generated body.
fn generate(rng: &mut Rng, i: u64) -> Vec<u8> {
    let mut seed = loopback::sample_review(&format!("soak-{i}"), rng.below(4) != 0);
    if rng.below(3) == 0 {
        seed["request"]["operation"] = "UPDATE".into();
        seed["request"]["object"]["metadata"]["annotations"] =
            json!({"unschedulable-node": "vk-node"});
    }
    match rng.below(100) {
        0 => vec![b' '; SOAK_MAX_BODY + 1],
        1..=9 => (0..rng.below(2048)).map(|_| rng.next() as u8).collect(),
        10..=24 => {
            let mut bytes = serde_json::to_vec(&seed).unwrap_or_default();
            let cut = rng.below(bytes.len());
            bytes.truncate(cut);
            bytes
        }
        25..=39 => {
            let mut bytes = serde_json::to_vec(&seed).unwrap_or_default();
            for _ in 0..=rng.below(8) {
                let at = rng.below(bytes.len());
                if let Some(b) = bytes.get_mut(at) {
                    *b = rng.next() as u8;
                }
            }
            bytes
        }
        _ => {
            for _ in 0..=rng.below(3) {
                let path = PATHS[rng.below(PATHS.len())];
                let replacement = rng.value(0);
                let delete = rng.below(4) == 0;
                let (parent, last) = path.rsplit_once('/').unwrap_or(("", path));
                if let Some(Value::Object(map)) = seed.pointer_mut(parent) {
                    if delete {
                        map.remove(last);
                    } else {
                        map.insert(last.to_owned(), replacement);
                    }
                }
            }
            serde_json::to_vec(&seed).unwrap_or_default()
        }
    }
}

/// Whether a reply to `body` is acceptable: a 400, or an allowed review whose patch applies.
fn check(body: &[u8], status: u16, reply: &[u8]) -> Result<(), String> {
    match status {
        400 => return Ok(()),
        200 => {}
        other => return Err(format!("HTTP {other}: {}", String::from_utf8_lossy(reply))),
    }
    let review: Value =
        serde_json::from_slice(reply).map_err(|e| format!("reply not JSON: {e}"))?;
    if review["response"]["allowed"] != true {
        return Err(format!("not allowed: {review}"));
    }
    let Some(patch) = review["response"]["patch"].as_str() else {
        return Ok(());
    };
    let patch = base64::engine::general_purpose::STANDARD
        .decode(patch)
        .map_err(|e| e.to_string())?;
    let patch: json_patch::Patch = serde_json::from_slice(&patch).map_err(|e| e.to_string())?;
    // Decoded as the server does: it skips parts it does not read without validating them.
    let request =
        tensile_webhook::review::decode(body).map_err(|e| format!("patched a bad review: {e}"))?;
    let mut object = request.object.unwrap_or_default();
    json_patch::patch(&mut object, &patch).map_err(|e| format!("patch does not apply: {e}"))?;
    serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(object)
        .map_err(|e| format!("patched pod unreadable: {e}"))?;
    Ok(())
}

async fn soak(
    client: &Client,
    seconds: f64,
    connections: u64,
    seed: Option<u64>,
) -> Result<bool, ClientError> {
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    }) | 1;
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    println!("soak: {seconds} s over {connections} connections, seed {seed}");
    let mut workers = tokio::task::JoinSet::new();
    for k in 0..connections.max(1) {
        let client = client.clone();
        workers.spawn(async move {
            let mut rng = Rng(seed.wrapping_add(k.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1);
            let (mut sent, mut status_400, mut failures) = (0u64, 0u64, Vec::<String>::new());
            let mut conn = client.connect().await.ok();
            let mut i = k;
            while Instant::now() < deadline {
                let body = generate(&mut rng, i);
                i += connections;
                let Some(c) = conn.as_mut() else {
                    conn = client.connect().await.ok();
                    if conn.is_none() {
                        failures.push("cannot reconnect".into());
                        break;
                    }
                    continue;
                };
                let oversized = body.len() > SOAK_MAX_BODY;
                let result = c.send("POST", "/mutate", body.clone()).await;
                if oversized {
                    // The server answers before reading an oversized body, then closes.
                    conn = None;
                }
                match result {
                    Ok(reply) => {
                        sent += 1;
                        status_400 += u64::from(reply.status == 400);
                        if let Err(problem) = check(&body, reply.status, &reply.body) {
                            failures.push(format!(
                                "{problem}\n  body: {}",
                                String::from_utf8_lossy(&body[..body.len().min(600)])
                            ));
                        }
                    }
                    // The server may close after answering an oversized body; anything else is a failure.
                    Err(error) => {
                        if !oversized {
                            failures.push(format!(
                                "connection failed: {error} ({} bytes sent)",
                                body.len()
                            ));
                        }
                        conn = None;
                    }
                }
            }
            (sent, status_400, failures)
        });
    }
    let (mut sent, mut status_400, mut failures) = (0, 0, Vec::new());
    while let Some(done) = workers.join_next().await {
        let (s, b, f) = done?;
        sent += s;
        status_400 += b;
        failures.extend(f);
    }
    println!(
        "  {sent} requests: {} answered 200, {status_400} answered 400, {} failures",
        sent - status_400,
        failures.len()
    );
    for failure in failures.iter().take(5) {
        println!("  FAILURE: {failure}");
    }
    Ok(failures.is_empty())
}
