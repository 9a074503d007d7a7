//! The Kubernetes binaries: built by `tests/k8s/build.sh` from the Go module proxy and
//! cached by version, or taken from `TENSILE_K8S_DIR`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{Context, Result, bail};

/// The directory holding `bin/`, `stages/` and `versions`.
#[derive(Clone, Debug)]
pub struct Binaries {
    dir: PathBuf,
    versions: BTreeMap<String, String>,
}

static LOCATED: OnceLock<PathBuf> = OnceLock::new();

impl Binaries {
    /// Finds the binaries, building them on first use (a cold build takes a while; it is
    /// locked so concurrent callers wait for one build).
    pub fn locate() -> Result<Self> {
        let dir = match LOCATED.get() {
            Some(dir) => dir.clone(),
            None => {
                let dir = match std::env::var_os("TENSILE_K8S_DIR") {
                    Some(dir) => PathBuf::from(dir),
                    None => build()?,
                };
                LOCATED.get_or_init(|| dir).clone()
            }
        };
        Self::at(&dir)
    }

    /// Uses the binaries in `dir` (a directory `build.sh` printed).
    pub fn at(dir: &Path) -> Result<Self> {
        let versions_file = dir.join("versions");
        let text = std::fs::read_to_string(&versions_file).with_context(|| {
            format!(
                "reading {} (is {} a directory printed by tests/k8s/build.sh?)",
                versions_file.display(),
                dir.display()
            )
        })?;
        let versions = text
            .lines()
            .filter_map(|line| line.split_once('='))
            .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
            .collect();
        Ok(Self {
            dir: dir.to_owned(),
            versions,
        })
    }

    /// Path of the binary `name` (e.g. `kube-apiserver`).
    pub fn bin(&self, name: &str) -> PathBuf {
        self.dir.join("bin").join(name)
    }

    /// Path of kwok's Stage file `name`.
    pub fn stage(&self, name: &str) -> PathBuf {
        self.dir.join("stages").join(name)
    }

    /// The Kubernetes release built (e.g. `v1.36.3`).
    pub fn kubernetes_version(&self) -> &str {
        self.versions
            .get("kubernetes")
            .map(String::as_str)
            .unwrap_or("unknown")
    }

    /// Every component and its version.
    pub fn versions(&self) -> &BTreeMap<String, String> {
        &self.versions
    }
}

/// The build script beside this crate.
pub fn build_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../k8s/build.sh")
}

fn build() -> Result<PathBuf> {
    run_build_script(&build_script())
}

/// Runs a build script of `tests/k8s` (its progress to stderr) and answers the directory
/// its last line of stdout names.
pub(crate) fn run_build_script(script: &Path) -> Result<PathBuf> {
    run_build_script_with(script, &[])
}

/// [`run_build_script`] with `args`.
pub(crate) fn run_build_script_with(script: &Path, args: &[&str]) -> Result<PathBuf> {
    let output = Command::new("bash")
        .arg(script)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !output.status.success() {
        bail!(
            "{} {} failed ({}); see its output above",
            script.display(),
            args.join(" "),
            output.status
        );
    }
    let stdout = String::from_utf8(output.stdout)?;
    match stdout.lines().last() {
        Some(dir) if !dir.trim().is_empty() => Ok(PathBuf::from(dir.trim())),
        _ => bail!("{} printed no directory", script.display()),
    }
}

/// The pinned helm (v3), for the chart's tests: built by `tests/k8s/helm/build.sh` from the
/// Go module proxy and cached by version, or `$TENSILE_HELM_DIR/bin/helm` (a directory that
/// script printed).
pub fn helm() -> Result<PathBuf> {
    static HELM: OnceLock<PathBuf> = OnceLock::new();
    if let Some(bin) = HELM.get() {
        return Ok(bin.clone());
    }
    let dir = match std::env::var_os("TENSILE_HELM_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            run_build_script(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../k8s/helm/build.sh"))?
        }
    };
    let bin = dir.join("bin").join("helm");
    if !bin.is_file() {
        bail!(
            "{} is missing (is {} a directory printed by tests/k8s/helm/build.sh?)",
            bin.display(),
            dir.display()
        );
    }
    Ok(HELM.get_or_init(|| bin).clone())
}
