//! Kubernetes' node conformance tests, run through the virtual node and straight against the
//! lower cluster, side by side (`tensile-playground conformance`).
//!
//! What runs: `e2e.test` and `ginkgo` of the pinned release, and the e2e test images made
//! locally under their upstream names, all from `tests/k8s/e2e/build.sh` (nothing pulled from
//! a registry). The pair: an upper cluster whose only node is `vk-node` (started with
//! `--disable-taint`, so the tests' pods land there), a lower cluster whose only nodes are
//! real ones (kubelet, containerd, runc) with the e2e images imported and their
//! [`REAL_NODE_LABEL`] taint removed, and no kwok nodes. The same focus runs through vk-node
//! (the upper kubeconfig), then straight against the lower cluster (the lower kubeconfig):
//! the straight run is the ceiling of what a pod below can pass on this machine.
//!
//! Results: JUnit per way (`<junit-dir>/<way>/junit.xml`, with ginkgo's output beside it in
//! `e2e.log`), and [`Comparison`]: passed/failed/skipped each way, and every test that passes
//! straight and fails through vk-node with its first failure line.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use kube::api::{Api, PostParams};

use crate::cluster::node_is_schedulable;
use crate::pair::{ClusterPair, PairOptions};
use crate::real_node::{REAL_NODE_LABEL, RealNode};
use crate::virtual_node::{VirtualNode, VirtualNodeOptions};
use crate::wait::wait_for;

/// The default focus: the node conformance tests.
pub const DEFAULT_FOCUS: &str = r"\[NodeConformance\]";
/// The default skip: what needs a dedicated cluster, is slow or flaky, or needs a feature
/// (gate) this pair does not have. (It does not catch `[FeatureGate:…]`.)
pub const DEFAULT_SKIP: &str = r"\[Serial\]|\[Disruptive\]|\[Slow\]|\[Flaky\]|\[Feature:";
/// The focus of [`Preset::Generation`]: `metadata.generation` and `status.observedGeneration`
/// of a pod (`test/e2e/node/pods.go`, 4 tests in v1.36.3).
pub const GENERATION_FOCUS: &str = r"\[sig-node\] Pods Extended \(pod generation\)";
/// The focus of [`Preset::Resize`] (223 tests in v1.36.3): in-place resize of containers
/// (`test/e2e/common/node/pod_resize.go`, tagged `[Feature:InPlacePodVerticalScaling]`, and
/// `test/e2e/node/pod_resize.go`: resource quota, limit ranger, and the `[Serial]` scheduler
/// and deferred-resize tests, whose `[Serial]` comes before `Pod InPlace`), of a non-sidecar
/// init container (`InPlacePodVerticalScalingInitContainers`, beta and on by default in
/// 1.36), of pod-level resources (`PLR`, `test/e2e/common/node/pod_level_resources_resize.go`:
/// `InPlacePodLevelResourcesVerticalScaling`, beta and on by default in 1.36), and the pod
/// generation tests, which a resize bumps.
pub const RESIZE_FOCUS: &str = concat!(
    r"\[sig-node\] (\[Serial\] )?Pod InPlace Resize (Init )?Container",
    r"|\[sig-node\] PLR Pod InPlace Resize",
    r"|\[sig-node\] Pods Extended \(pod generation\)",
);
/// The skip of [`Preset::Resize`] and [`Preset::Generation`]: only what disrupts the
/// cluster or is known flaky. `[Feature:InPlacePodVerticalScaling]` is what the resize tests
/// are tagged with, and the `[Serial]` ones (ginkgo runs them last, alone) need only one
/// schedulable node whose CPU they may fill.
pub const RESIZE_SKIP: &str = r"\[Disruptive\]|\[Flaky\]";

/// A named focus and skip (`--preset`); an explicit `--focus` or `--skip` replaces its part.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// The node conformance tests: `[NodeConformance]`, without `[Serial]`, `[Disruptive]`,
    /// `[Slow]`, `[Flaky]`, `[Feature:…]`.
    #[default]
    Node,
    /// In-place resize (containers, init containers, pod-level resources) and pod
    /// generation, `[Serial]` included.
    Resize,
    /// Pod generation and observedGeneration only.
    Generation,
}

impl Preset {
    /// ginkgo's `--focus` for it.
    pub fn focus(self) -> &'static str {
        match self {
            Preset::Node => DEFAULT_FOCUS,
            Preset::Resize => RESIZE_FOCUS,
            Preset::Generation => GENERATION_FOCUS,
        }
    }

    /// ginkgo's `--skip` for it.
    pub fn skip(self) -> &'static str {
        match self {
            Preset::Node => DEFAULT_SKIP,
            Preset::Resize | Preset::Generation => RESIZE_SKIP,
        }
    }

    /// The focus and skip to run: the preset's, each replaced by an explicit one.
    pub fn select(self, focus: Option<String>, skip: Option<String>) -> (String, String) {
        (
            focus.unwrap_or_else(|| self.focus().to_owned()),
            skip.unwrap_or_else(|| self.skip().to_owned()),
        )
    }
}
/// The virtual node's name in the upper cluster.
pub const VK_NODE: &str = "vk-node";
/// How long the virtual node may take to turn Ready and schedulable.
const NODE_WAIT: Duration = Duration::from_secs(180);

/// One way of running the tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Way {
    /// Through the virtual node: the upper cluster, every test pod on vk-node.
    VirtualNode,
    /// Straight against the lower cluster, on its real node(s).
    Straight,
}

impl Way {
    /// Its directory under the JUnit directory.
    pub fn dir_name(self) -> &'static str {
        match self {
            Way::VirtualNode => "vk-node",
            Way::Straight => "straight",
        }
    }

    /// Its column in the table.
    pub fn label(self) -> &'static str {
        match self {
            Way::VirtualNode => "through vk-node",
            Way::Straight => "straight (lower)",
        }
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct ConformanceOptions {
    /// ginkgo's `--focus`.
    pub focus: String,
    /// ginkgo's `--skip`.
    pub skip: String,
    /// Where each way's JUnit goes (`<junit_dir>/<way>/junit.xml`).
    pub junit_dir: PathBuf,
    /// ginkgo's `--procs` (parallel test processes).
    pub procs: u16,
    /// The ways, in order.
    pub ways: Vec<Way>,
    /// Real nodes in the lower cluster (tests that ask for two schedulable nodes run
    /// straight only with two; through vk-node there is always one node).
    pub real_nodes: u8,
    /// The pair's state directory (`None`: a temporary one).
    pub dir: Option<PathBuf>,
    /// The `virtual-node` binary.
    pub virtual_node: PathBuf,
    /// ginkgo's `--timeout` for each way.
    pub timeout: Duration,
}

/// The directory `tests/k8s/e2e/build.sh` printed (`bin/`, `images/`, `versions`).
#[derive(Clone, Debug)]
pub struct E2eBinaries {
    /// The directory.
    pub dir: PathBuf,
}

static LOCATED: OnceLock<PathBuf> = OnceLock::new();

impl E2eBinaries {
    /// Finds them (`TENSILE_E2E_DIR`), else builds them (once; later calls reuse it).
    pub fn locate() -> Result<Self> {
        if let Some(dir) = LOCATED.get() {
            return Ok(Self { dir: dir.clone() });
        }
        let dir = match std::env::var_os("TENSILE_E2E_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => crate::binaries::run_build_script(&build_script())?,
        };
        if !dir.join(".complete").exists() {
            bail!(
                "{} is not a directory built by tests/k8s/e2e/build.sh",
                dir.display()
            );
        }
        Ok(Self {
            dir: LOCATED.get_or_init(|| dir).clone(),
        })
    }

    /// One of its programs (`e2e.test`, `ginkgo`, `agnhost`, `nonewprivs`).
    pub fn bin(&self, name: &str) -> PathBuf {
        self.dir.join("bin").join(name)
    }

    /// The image tarballs to import into the real node(s).
    pub fn images(&self) -> Result<Vec<PathBuf>> {
        let dir = self.dir.join("images");
        let mut images: Vec<PathBuf> = std::fs::read_dir(&dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|path| path.extension().is_some_and(|e| e == "tar"))
            .collect();
        images.sort();
        Ok(images)
    }
}

/// The build script of e2e.test, ginkgo and the e2e images.
pub fn build_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../k8s/e2e/build.sh")
}

/// The outcome of one test.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It passed.
    Passed,
    /// It failed (failed, timed out, panicked, interrupted, aborted): the first line of its
    /// failure message.
    Failed(String),
    /// It was selected and skipped itself (`skipped - <reason>`).
    Skipped,
}

/// One way's results: each test's outcome by its name (without ginkgo's `[It] `). Specs
/// the focus and skip filtered out (JUnit `<skipped message="skipped"/>`) and suite setup
/// nodes that passed are left out; a setup node that failed is a failed test.
pub type Results = BTreeMap<String, Outcome>;

/// Counts of one way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Tests passed.
    pub passed: usize,
    /// Tests failed.
    pub failed: usize,
    /// Tests that skipped themselves.
    pub skipped: usize,
}

impl Counts {
    /// The counts of `results`.
    pub fn of(results: &Results) -> Self {
        let mut counts = Self::default();
        for outcome in results.values() {
            match outcome {
                Outcome::Passed => counts.passed += 1,
                Outcome::Failed(_) => counts.failed += 1,
                Outcome::Skipped => counts.skipped += 1,
            }
        }
        counts
    }
}

/// Both ways side by side.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Comparison {
    /// The counts of each way that ran.
    pub counts: Vec<(Way, Counts)>,
    /// Tests that pass straight and fail through vk-node, with vk-node's first failure line.
    pub regressions: Vec<(String, String)>,
    /// Tests that fail through vk-node and did not run straight (only one way ran, or the
    /// test is missing from the straight results): every failure, with its first line.
    pub vk_failures_unmatched: Vec<(String, String)>,
}

/// Compares the ways' results (either may be missing when only one way ran).
pub fn compare(vk: Option<&Results>, straight: Option<&Results>) -> Comparison {
    let mut comparison = Comparison::default();
    for (way, results) in [(Way::VirtualNode, vk), (Way::Straight, straight)] {
        if let Some(results) = results {
            comparison.counts.push((way, Counts::of(results)));
        }
    }
    if let Some(vk) = vk {
        for (name, outcome) in vk {
            let Outcome::Failed(line) = outcome else {
                continue;
            };
            match straight.and_then(|s| s.get(name)) {
                Some(Outcome::Passed) => comparison.regressions.push((name.clone(), line.clone())),
                Some(_) => {}
                None => comparison
                    .vk_failures_unmatched
                    .push((name.clone(), line.clone())),
            }
        }
    }
    comparison
}

impl Comparison {
    /// The table: counts each way, then each test that passes straight and fails through
    /// vk-node with its first failure line.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<18} {:>7} {:>7} {:>8}",
            "", "passed", "failed", "skipped"
        );
        for (way, counts) in &self.counts {
            let _ = writeln!(
                out,
                "{:<18} {:>7} {:>7} {:>8}",
                way.label(),
                counts.passed,
                counts.failed,
                counts.skipped
            );
        }
        let both = self.counts.len() == 2;
        if both {
            let _ = writeln!(
                out,
                "\n{} pass straight and fail through vk-node{}",
                self.regressions.len(),
                if self.regressions.is_empty() { "" } else { ":" }
            );
            for (name, line) in &self.regressions {
                let _ = writeln!(out, "  {name}\n      {line}");
            }
        }
        if !self.vk_failures_unmatched.is_empty() {
            let _ = writeln!(
                out,
                "\n{} fail through vk-node{}:",
                self.vk_failures_unmatched.len(),
                if both {
                    " and did not run straight"
                } else {
                    ""
                }
            );
            for (name, line) in &self.vk_failures_unmatched {
                let _ = writeln!(out, "  {name}\n      {line}");
            }
        }
        out
    }
}

/// Parses ginkgo's JUnit report (`--junit-report`; e2e.test's own `--report-dir` writes the
/// same) into [`Results`]. A small reader for that format's elements and attributes (the
/// harness has no XML dependency): `<testcase name=".." status="..">` with an optional
/// `<failure message="..">`, `<error message="..">` or `<skipped message="..">`.
pub fn parse_junit(xml: &str) -> Result<Results> {
    let mut results = Results::new();
    let mut rest = xml;
    let mut seen_testcase = false;
    while let Some(start) = rest.find("<testcase") {
        seen_testcase = true;
        let after = &rest[start..];
        let open_end = tag_end(after).context("an unterminated <testcase> tag")?;
        let open = &after[..=open_end];
        let (body, next) = if open.ends_with("/>") {
            ("", &after[open_end + 1..])
        } else {
            let close = after
                .find("</testcase>")
                .context("a <testcase> without </testcase>")?;
            (
                &after[open_end + 1..close],
                &after[close + "</testcase>".len()..],
            )
        };
        rest = next;
        let name = attribute(open, "name").context("a <testcase> without a name")?;
        let status = attribute(open, "status").unwrap_or_default();
        let child = |tag: &str| {
            let at = body.find(&format!("<{tag}"))?;
            let child = &body[at..];
            let end = tag_end(child)?;
            Some(attribute(&child[..=end], "message").unwrap_or_default())
        };
        let failure = child("failure").or_else(|| child("error"));
        let skipped = child("skipped");
        let is_it = name.starts_with("[It]");
        let outcome = if let Some(message) = failure {
            Outcome::Failed(first_line(&message, &status))
        } else if let Some(message) = skipped {
            // "skipped": filtered out by focus/skip; "pending": marked pending; "skipped -
            // reason": the test skipped itself.
            if message.starts_with("skipped - ") {
                Outcome::Skipped
            } else {
                continue;
            }
        } else if matches!(status.as_str(), "" | "passed") {
            if !is_it {
                continue;
            }
            Outcome::Passed
        } else {
            Outcome::Failed(first_line("", &status))
        };
        let name = name.strip_prefix("[It] ").unwrap_or(&name).to_owned();
        results.insert(name, outcome);
    }
    if !seen_testcase && !xml.contains("<testsuite") {
        bail!("not a JUnit report (no <testsuite> or <testcase>)");
    }
    Ok(results)
}

/// The first non-empty line of a failure message (or the status when it has none).
fn first_line(message: &str, status: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_owned)
        .unwrap_or_else(|| format!("({})", if status.is_empty() { "failed" } else { status }))
}

/// The index of the `>` that ends the tag `tag` starts with (outside quoted values).
fn tag_end(tag: &str) -> Option<usize> {
    let mut quote = None;
    for (i, c) in tag.char_indices() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '>') => return Some(i),
            _ => {}
        }
    }
    None
}

/// An attribute's value in an opening tag, entities decoded.
fn attribute(tag: &str, name: &str) -> Option<String> {
    let mut rest = tag;
    loop {
        let at = rest.find(name)?;
        let before = rest[..at].chars().next_back();
        let after = rest[at + name.len()..].trim_start();
        rest = &rest[at + name.len()..];
        if !before.is_some_and(char::is_whitespace) {
            continue;
        }
        let Some(value) = after.strip_prefix('=') else {
            continue;
        };
        let value = value.trim_start();
        let quote = value.chars().next()?;
        if quote != '"' && quote != '\'' {
            return None;
        }
        let end = value[1..].find(quote)?;
        return Some(unescape(&value[1..=end]));
    }
}

/// Decodes XML's entities (`&lt;` `&gt;` `&amp;` `&quot;` `&apos;` and numeric ones).
fn unescape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('&') {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let Some(end) = rest.find(';') else {
            break;
        };
        let entity = &rest[1..end];
        let decoded = match entity {
            "lt" => Some('<'),
            "gt" => Some('>'),
            "amp" => Some('&'),
            "quot" => Some('"'),
            "apos" => Some('\''),
            _ => entity
                .strip_prefix("#x")
                .map(|hex| u32::from_str_radix(hex, 16))
                .or_else(|| entity.strip_prefix('#').map(str::parse::<u32>))
                .and_then(Result::ok)
                .and_then(char::from_u32),
        };
        match decoded {
            Some(c) => {
                out.push(c);
                rest = &rest[end + 1..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The pair as the tests need it: the upper cluster's only schedulable node vk-node without
/// its taint, the lower cluster's only nodes real ones without theirs.
pub struct ConformancePair {
    /// The clusters.
    pub pair: ClusterPair,
    /// The real nodes in the lower cluster.
    pub real_nodes: Vec<RealNode>,
    /// The virtual node.
    pub virtual_node: VirtualNode,
}

impl ConformancePair {
    /// Starts it: the clusters (no kwok nodes), `real_nodes` real nodes with `images`
    /// imported and untainted, then vk-node with `--disable-taint`, Ready and schedulable.
    pub async fn start(
        dir: Option<PathBuf>,
        real_nodes: u8,
        images: &[PathBuf],
        virtual_node: &Path,
    ) -> Result<Self> {
        let mut options = PairOptions {
            dir,
            ..PairOptions::default()
        };
        // No kwok nodes: every pod of a test lands on a real node (straight) or vk-node
        // (whose capacity is the real nodes').
        options.lower.nodes = 0;
        options.upper.nodes = 0;
        let pair = ClusterPair::start(options).await?;
        let lower = pair.lower.client().await?;
        let mut nodes = Vec::new();
        for i in 0..real_nodes {
            let name = format!("lower-real-{i}");
            tracing::info!(node = %name, images = images.len(), "starting a real node");
            nodes.push(pair.start_real_node_with(&name, images).await?);
            untaint(&lower, &name, REAL_NODE_LABEL).await?;
        }
        let mut vk = VirtualNodeOptions::new(virtual_node, VK_NODE);
        vk.args.push("--disable-taint".into());
        let virtual_node = pair.start_virtual_node(&vk)?;
        let upper = pair.upper.client().await?;
        let upper_nodes: Api<Node> = Api::all(upper);
        let what = format!(
            "{VK_NODE} Ready and schedulable (log: {})",
            virtual_node.log().display()
        );
        wait_for(&what, NODE_WAIT, || async {
            Ok(upper_nodes
                .get_opt(VK_NODE)
                .await?
                .filter(node_is_schedulable)
                .map(|_| ()))
        })
        .await?;
        Ok(Self {
            pair,
            real_nodes: nodes,
            virtual_node,
        })
    }

    /// The kubeconfig a way's tests use.
    pub fn kubeconfig(&self, way: Way) -> &Path {
        match way {
            Way::VirtualNode => &self.pair.upper.kubeconfig,
            Way::Straight => &self.pair.lower.kubeconfig,
        }
    }
}

/// Removes the taint `key` from node `name` (a replace at the node's resourceVersion,
/// retried on a conflict with the kubelet's own writes).
async fn untaint(client: &Client, name: &str, key: &str) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let what = format!("taint {key} removed from node {name}");
    wait_for(&what, Duration::from_secs(30), || async {
        let mut node = nodes.get(name).await?;
        let Some(spec) = node.spec.as_mut() else {
            return Ok(Some(()));
        };
        let Some(taints) = spec.taints.as_mut() else {
            return Ok(Some(()));
        };
        if !taints.iter().any(|t| t.key == key) {
            return Ok(Some(()));
        }
        taints.retain(|t| t.key != key);
        // The replace carries the resourceVersion read: a conflict is retried.
        nodes.replace(name, &PostParams::default(), &node).await?;
        Ok(None)
    })
    .await
}

/// The e2e flags every run gets (besides the kubeconfig).
pub fn e2e_flags(kubectl: &Path) -> Vec<String> {
    vec![
        "--provider=skeleton".into(),
        // Cordoned or not-ready nodes would hold the start-up check otherwise.
        "--allowed-not-ready-nodes=-1".into(),
        "--minStartupPods=0".into(),
        "--node-schedulable-timeout=1m".into(),
        format!("--kubectl-path={}", kubectl.display()),
    ]
}

/// Runs one way: ginkgo over e2e.test with the focus, skip and procs, JUnit and the output
/// (`e2e.log`) under `<junit_dir>/<way>/`. Returns the JUnit's path; the tests failing is
/// not an error, a run that leaves no report is.
pub async fn run_way(
    e2e: &E2eBinaries,
    pair: &ConformancePair,
    options: &ConformanceOptions,
    way: Way,
) -> Result<PathBuf> {
    let dir = std::path::absolute(options.junit_dir.join(way.dir_name()))?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let log_path = dir.join("e2e.log");
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let mut args = vec![
        format!("--procs={}", options.procs.max(1)),
        format!("--focus={}", options.focus),
        format!("--skip={}", options.skip),
        format!("--timeout={}s", options.timeout.as_secs()),
        "--junit-report=junit.xml".into(),
        format!("--output-dir={}", dir.display()),
        "--no-color".into(),
        e2e.bin("e2e.test").display().to_string(),
        "--".into(),
        format!("--kubeconfig={}", pair.kubeconfig(way).display()),
        format!("--report-dir={}", dir.display()),
    ];
    if options.procs > 1 {
        args.insert(0, "-p".into());
    }
    args.extend(e2e_flags(&pair.pair.bin("kubectl")));
    tracing::info!(way = way.label(), log = %log_path.display(), "running the e2e tests");
    let started = Instant::now();
    let status = tokio::process::Command::new(e2e.bin("ginkgo"))
        .args(&args)
        .current_dir(&dir)
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .status()
        .await
        .with_context(|| format!("running {}", e2e.bin("ginkgo").display()))?;
    let junit = dir.join("junit.xml");
    tracing::info!(way = way.label(), %status, elapsed = ?started.elapsed(), "e2e tests done");
    if !junit.exists() {
        bail!(
            "ginkgo ({status}) wrote no {}: see {}",
            junit.display(),
            log_path.display()
        );
    }
    Ok(junit)
}

/// Reads and parses a JUnit file.
pub fn read_junit(path: &Path) -> Result<Results> {
    let xml =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse_junit(&xml).with_context(|| format!("parsing {}", path.display()))
}

/// The whole run: builds (or finds) the e2e binaries and images, starts the pair, runs each
/// way and compares them. Each way's elapsed time comes back beside the comparison.
pub async fn run(options: &ConformanceOptions) -> Result<(Comparison, Vec<(Way, Duration)>)> {
    let e2e = tokio::task::spawn_blocking(E2eBinaries::locate).await??;
    let images = e2e.images()?;
    let pair = ConformancePair::start(
        options.dir.clone(),
        options.real_nodes.max(1),
        &images,
        &options.virtual_node,
    )
    .await?;
    let mut vk = None;
    let mut straight = None;
    let mut times = Vec::new();
    for &way in &options.ways {
        let started = Instant::now();
        let junit = run_way(&e2e, &pair, options, way).await?;
        times.push((way, started.elapsed()));
        let results = read_junit(&junit)?;
        match way {
            Way::VirtualNode => vk = Some(results),
            Way::Straight => straight = Some(results),
        }
    }
    drop(pair);
    Ok((compare(vk.as_ref(), straight.as_ref()), times))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

    use super::*;

    /// The shape ginkgo v2 writes (`--junit-report`): a setup node, a filtered spec, a
    /// passed one, a failed one (entities in its message), one that skipped itself.
    fn sample(ways_failure: &str) -> String {
        format!(
            r#"<?xml version="1.0" encoding="UTF-8"?>
  <testsuites tests="6" disabled="1" errors="0" failures="1" time="42.1">
      <testsuite name="Kubernetes e2e suite" package="/e2e" tests="6" disabled="0" skipped="2" errors="0" failures="1" time="42.1" timestamp="2026-11-26T16:00:00">
          <properties>
              <property name="SuiteSucceeded" value="false"></property>
          </properties>
          <testcase name="[SynchronizedBeforeSuite]" classname="Kubernetes e2e suite" status="passed" time="1.2"></testcase>
          <testcase name="[It] [sig-storage] Secrets should be immutable [Conformance]" classname="Kubernetes e2e suite" status="skipped" time="0">
              <skipped message="skipped"></skipped>
          </testcase>
          <testcase name="[It] [sig-node] Downward API should provide pod name, namespace and IP address as env vars [NodeConformance] [Conformance]" classname="Kubernetes e2e suite" status="passed" time="8.3">
              <system-err>&gt; Enter [BeforeEach]</system-err>
          </testcase>
          <testcase name="[It] [sig-node] Pods should support remote command execution over websockets [NodeConformance] [Conformance]" classname="Kubernetes e2e suite" status="{ways_failure}" time="30.1">
              <failure message="&#xA;websocket.Dial wss://127.0.0.1:6443/api/v1/...: bad status&#xA;second line" type="failed">[FAILED] long description &lt;b&gt;</failure>
          </testcase>
          <testcase name='[It] [sig-node] Pods should run on two nodes [NodeConformance]' classname="Kubernetes e2e suite" status="skipped" time="0.1">
              <skipped message="skipped - Requires at least 2 nodes (not 1)"/>
          </testcase>
          <testcase name="[ReportAfterSuite] Kubernetes e2e suite report" classname="Kubernetes e2e suite" status="passed" time="0"/>
      </testsuite>
  </testsuites>"#
        )
    }

    const DOWNWARD: &str = "[sig-node] Downward API should provide pod name, namespace and IP address as env vars [NodeConformance] [Conformance]";
    const WEBSOCKETS: &str = "[sig-node] Pods should support remote command execution over websockets [NodeConformance] [Conformance]";
    const TWO_NODES: &str = "[sig-node] Pods should run on two nodes [NodeConformance]";

    #[test]
    fn a_preset_sets_focus_and_skip_and_an_explicit_one_replaces_its_part() {
        let given = |s: &str| Some(s.to_owned());
        let cases = [
            (Preset::Node, None, None, DEFAULT_FOCUS, DEFAULT_SKIP),
            (Preset::Resize, None, None, RESIZE_FOCUS, RESIZE_SKIP),
            (
                Preset::Generation,
                None,
                None,
                GENERATION_FOCUS,
                RESIZE_SKIP,
            ),
            (Preset::Resize, given("PLR"), None, "PLR", RESIZE_SKIP),
            (Preset::Resize, None, given("x"), RESIZE_FOCUS, "x"),
            (Preset::Node, given("a"), given("b"), "a", "b"),
        ];
        for (preset, focus, skip, want_focus, want_skip) in cases {
            let what = format!("{preset:?} {focus:?} {skip:?}");
            assert_eq!(
                preset.select(focus, skip),
                (want_focus.to_owned(), want_skip.to_owned()),
                "{what}"
            );
        }
    }

    /// Real full names of v1.36.3 (`e2e.test --list-tests`), and whether each preset runs
    /// them as ginkgo decides: the focus matches and the skip does not.
    #[test]
    fn the_presets_select_the_real_tests() {
        const RESIZE: &str = "[sig-node] Pod InPlace Resize Container guaranteed qos - 1 container with resize policy [Feature:InPlacePodVerticalScaling] no restart resizing cpu & mem in the same direction";
        const RESIZE_CONFORMANCE: &str = "[sig-node] Pod InPlace Resize Container resize pod via the replace endpoint [MinimumKubeletVersion:1.34] [Conformance]";
        const DEFERRED: &str = "[sig-node] [Serial] Pod InPlace Resize Container (deferred-resizes) [FeatureGate:InPlacePodVerticalScaling] pod-resize-retry-deferred-test-1";
        const LIMIT_RANGER: &str = "[sig-node] Pod InPlace Resize Container (limit-ranger) [FeatureGate:InPlacePodVerticalScaling] pod-resize-limit-ranger-test valid increase of CPU";
        const INIT: &str = "[sig-node] Pod InPlace Resize Init Container [FeatureGate:InPlacePodVerticalScalingInitContainers] [Beta] should support resizing a non-sidecar init container";
        const PLR: &str = "[sig-node] PLR Pod InPlace Resize [FeatureGate:InPlacePodLevelResourcesVerticalScaling] [Beta] decrease pod-level memory limit below usage";
        const GENERATION: &str = "[sig-node] Pods Extended (pod generation) Pod Generation pod observedGeneration field set in pod conditions";
        const OTHER_EXTENDED: &str = "[sig-node] Pods Extended Pod Container Status should never report success for a pending container";
        const NODE_RESIZE: &str =
            "[sig-cloud-provider-gcp] Nodes [Disruptive] Resize [Slow] should be able to add nodes";
        let runs = |preset: Preset, name: &str| {
            let focus = regex::Regex::new(preset.focus()).unwrap();
            let skip = regex::Regex::new(preset.skip()).unwrap();
            focus.is_match(name) && !skip.is_match(name)
        };
        let cases = [
            (RESIZE, [false, true, false]),
            (RESIZE_CONFORMANCE, [false, true, false]),
            (DEFERRED, [false, true, false]),
            (LIMIT_RANGER, [false, true, false]),
            (INIT, [false, true, false]),
            (PLR, [false, true, false]),
            (GENERATION, [false, true, true]),
            (OTHER_EXTENDED, [false, false, false]),
            (NODE_RESIZE, [false, false, false]),
            (DOWNWARD, [true, false, false]),
        ];
        for (name, want) in cases {
            let got = [Preset::Node, Preset::Resize, Preset::Generation].map(|p| runs(p, name));
            assert_eq!(got, want, "node, resize, generation: {name}");
        }
    }

    #[test]
    fn junit_is_read_into_outcomes() {
        let results = parse_junit(&sample("failed")).unwrap();
        assert_eq!(
            results,
            Results::from([
                (DOWNWARD.to_owned(), Outcome::Passed),
                (
                    WEBSOCKETS.to_owned(),
                    Outcome::Failed(
                        "websocket.Dial wss://127.0.0.1:6443/api/v1/...: bad status".to_owned()
                    )
                ),
                (TWO_NODES.to_owned(), Outcome::Skipped),
            ])
        );
        assert_eq!(
            Counts::of(&results),
            Counts {
                passed: 1,
                failed: 1,
                skipped: 1
            }
        );
    }

    #[test]
    fn a_failed_setup_node_and_a_bare_timeout_are_failures() {
        let xml = r#"<testsuites><testsuite name="s">
            <testcase name="[SynchronizedBeforeSuite]" status="failed"><failure message="no nodes" type="failed"></failure></testcase>
            <testcase name="[It] slow one" status="timedout"></testcase>
            </testsuite></testsuites>"#;
        let results = parse_junit(xml).unwrap();
        assert_eq!(
            results["[SynchronizedBeforeSuite]"],
            Outcome::Failed("no nodes".into())
        );
        assert_eq!(results["slow one"], Outcome::Failed("(timedout)".into()));
    }

    #[test]
    fn not_junit_is_an_error() {
        assert!(parse_junit("<html></html>").is_err());
        assert!(parse_junit("<testsuites><testcase name=\"x\"").is_err());
    }

    #[test]
    fn attributes_and_entities() {
        let tag = r#"<testcase classname="c" name="a &amp; b &#34;q&#34; &#x41;" status='passed'>"#;
        assert_eq!(attribute(tag, "name").as_deref(), Some("a & b \"q\" A"));
        assert_eq!(attribute(tag, "status").as_deref(), Some("passed"));
        // `name` inside `classname` is not the attribute `name`.
        assert_eq!(attribute(r#"<t classname="c">"#, "name"), None);
        assert_eq!(unescape("x &unknown; &amp"), "x &unknown; &amp");
    }

    #[test]
    fn the_table_lists_what_passes_straight_and_fails_through_vk_node() {
        let vk = parse_junit(&sample("failed")).unwrap();
        let straight = parse_junit(&sample("passed").replace(
            r#"<failure message="&#xA;websocket.Dial wss://127.0.0.1:6443/api/v1/...: bad status&#xA;second line" type="failed">[FAILED] long description &lt;b&gt;</failure>"#,
            "",
        ))
        .unwrap();
        assert_eq!(straight[WEBSOCKETS], Outcome::Passed);
        let comparison = compare(Some(&vk), Some(&straight));
        assert_eq!(
            comparison.regressions,
            vec![(
                WEBSOCKETS.to_owned(),
                "websocket.Dial wss://127.0.0.1:6443/api/v1/...: bad status".to_owned()
            )]
        );
        assert!(comparison.vk_failures_unmatched.is_empty());
        let table = comparison.render();
        assert!(
            table.contains("through vk-node          1       1        1"),
            "{table}"
        );
        assert!(
            table.contains("straight (lower)         2       0        1"),
            "{table}"
        );
        assert!(
            table.contains("1 pass straight and fail through vk-node:"),
            "{table}"
        );
        assert!(
            table.contains(&format!("  {WEBSOCKETS}\n      websocket.Dial")),
            "{table}"
        );

        // Failing both ways is no regression.
        let comparison = compare(Some(&vk), Some(&vk));
        assert!(comparison.regressions.is_empty());
        assert!(
            comparison
                .render()
                .contains("0 pass straight and fail through vk-node\n")
        );

        // Through vk-node only: its failures are listed as such.
        let comparison = compare(Some(&vk), None);
        assert_eq!(comparison.counts.len(), 1);
        assert_eq!(comparison.vk_failures_unmatched.len(), 1);
        assert!(comparison.render().contains("1 fail through vk-node:"));
    }
}
