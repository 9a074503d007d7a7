//! The RBAC that `deploy/` ships, rendered with the pinned kubectl and applied to a harness
//! cluster, so that a test runs a component as exactly the identity it binds.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// The kinds that make up RBAC: who an identity is and what it may do.
const RBAC_KINDS: [&str; 5] = [
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
];

/// Runs `kubectl args` in `dir` and returns its stdout; an error carries its stderr.
fn kubectl(kubectl: &Path, dir: &Path, args: &[&str]) -> Result<String> {
    let output = Command::new(kubectl)
        .current_dir(dir)
        .args(args)
        .output()
        .with_context(|| format!("running {}", kubectl.display()))?;
    if !output.status.success() {
        bail!(
            "kubectl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The objects `kubectl kustomize <kustomization>` renders, `kustomization` relative to
/// `repo`.
pub fn render(kubectl_bin: &Path, repo: &Path, kustomization: &str) -> Result<Vec<Value>> {
    let yaml = kubectl(kubectl_bin, repo, &["kustomize", kustomization])?;
    let objects = serde_saphyr::from_multiple::<Value>(&yaml)
        .with_context(|| format!("{kustomization}: rendered YAML"))?;
    Ok(objects.into_iter().filter(|o| !o.is_null()).collect())
}

/// The objects of RBAC kinds among `objects`, as a kubectl List.
pub fn rbac_list(objects: &[Value]) -> Value {
    let items: Vec<&Value> = objects
        .iter()
        .filter(|o| o["kind"].as_str().is_some_and(|k| RBAC_KINDS.contains(&k)))
        .collect();
    json!({"apiVersion": "v1", "kind": "List", "items": items})
}

/// The RBAC of one kustomization, applied to one cluster until [`ShippedRbac::remove`].
#[derive(Debug)]
pub struct ShippedRbac {
    kubectl: PathBuf,
    kubeconfig: PathBuf,
    file: PathBuf,
}

impl ShippedRbac {
    /// Renders `kustomization` (relative to `repo`) and applies its RBAC objects, and only
    /// those, to the cluster of `kubeconfig`; the rendered List is kept in `work_dir`.
    /// The namespaces the objects name must exist.
    pub fn apply(
        kubectl_bin: &Path,
        kubeconfig: &Path,
        repo: &Path,
        kustomization: &str,
        work_dir: &Path,
    ) -> Result<Self> {
        let list = rbac_list(&render(kubectl_bin, repo, kustomization)?);
        let file = work_dir.join(format!("rbac-{}.json", kustomization.replace('/', "-")));
        std::fs::write(&file, list.to_string())
            .with_context(|| format!("writing {}", file.display()))?;
        let rbac = Self {
            kubectl: kubectl_bin.to_owned(),
            kubeconfig: kubeconfig.to_owned(),
            file,
        };
        rbac.kubectl_on_file("apply")?;
        Ok(rbac)
    }

    /// Deletes what [`ShippedRbac::apply`] applied.
    pub fn remove(self) -> Result<()> {
        self.kubectl_on_file("delete")
    }

    fn kubectl_on_file(&self, verb: &str) -> Result<()> {
        let (kubeconfig, file) = (path_arg(&self.kubeconfig)?, path_arg(&self.file)?);
        let cwd = self.file.parent().unwrap_or(Path::new("."));
        kubectl(
            &self.kubectl,
            cwd,
            &["--kubeconfig", kubeconfig, verb, "-f", file],
        )
        .map(|_| ())
    }
}

/// `path` as a command argument.
fn path_arg(path: &Path) -> Result<&str> {
    path.to_str()
        .with_context(|| format!("{} is not UTF-8", path.display()))
}
