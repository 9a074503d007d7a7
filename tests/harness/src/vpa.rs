//! The VerticalPodAutoscaler's updater beside a harness cluster, for in-place resize: the
//! release's CRDs applied and its updater (both from `tests/k8s/vpa/build.sh`) run as a
//! process against one cluster and one namespace.
//!
//! Only the updater runs. A test writes the recommendation into the VPA's status itself
//! (the recommender's job, which needs metrics and history); the admission controller is
//! not needed for an in-place resize (it sets the resources of new pods), so the updater
//! runs with `--use-admission-controller-status=false`. In `InPlaceOrRecreate` mode (no
//! feature gate since VPA 1.8) the updater sends a JSON patch to `pods/<name>/resize`
//! (`add /spec/containers/<i>/resources/{requests,limits}/<resource>`), then a JSON patch
//! of the pod adding the annotation [`IN_PLACE_UPDATED_ANNOTATION`]; it waits while the
//! pod's `PodResizePending` or `PodResizeInProgress` condition is True, and falls back to
//! eviction when the resize is refused, found Infeasible, or stays Deferred for 5 minutes.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use serde_json::{Value, json};

use crate::cluster::Cluster;
use crate::pair::ClusterPair;
use crate::ports::free_port;
use crate::process::Process;
use crate::wait::wait_for;

/// How often the updater runs its loop (its default is a minute).
pub const UPDATER_INTERVAL: Duration = Duration::from_secs(2);
/// The annotation the updater adds to a pod it resized in place.
pub const IN_PLACE_UPDATED_ANNOTATION: &str = "vpaInPlaceUpdated";
/// The CRD of VerticalPodAutoscalers.
const VPA_CRD: &str = "verticalpodautoscalers.autoscaling.k8s.io";

/// The directory `tests/k8s/vpa/build.sh` printed (`bin/vpa-updater`, `crds.yaml`).
#[derive(Clone, Debug)]
pub struct VpaBinaries {
    dir: PathBuf,
}

static LOCATED: OnceLock<PathBuf> = OnceLock::new();

impl VpaBinaries {
    /// Finds them (`TENSILE_VPA_DIR`), else builds them (once; later calls reuse it).
    pub fn locate() -> Result<Self> {
        if let Some(dir) = LOCATED.get() {
            return Ok(Self { dir: dir.clone() });
        }
        let dir = match std::env::var_os("TENSILE_VPA_DIR") {
            Some(dir) => PathBuf::from(dir),
            None => crate::binaries::run_build_script(&build_script())?,
        };
        if !dir.join(".complete").exists() {
            bail!(
                "{} is not a directory built by tests/k8s/vpa/build.sh",
                dir.display()
            );
        }
        Ok(Self {
            dir: LOCATED.get_or_init(|| dir).clone(),
        })
    }

    /// The updater.
    pub fn updater(&self) -> PathBuf {
        self.dir.join("bin").join("vpa-updater")
    }

    /// The release's CRDs (VerticalPodAutoscaler and its checkpoints), one YAML stream.
    pub fn crds(&self) -> PathBuf {
        self.dir.join("crds.yaml")
    }
}

/// The build script of the updater.
pub fn build_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../k8s/vpa/build.sh")
}

/// Applies the VPA CRDs to the cluster of `client` and waits until VerticalPodAutoscalers
/// are served.
pub async fn install_crds(client: &Client, bins: &VpaBinaries) -> Result<()> {
    let path = bins.crds();
    let yaml = std::fs::read_to_string(&path)
        .with_context(|| format!("reading the VPA CRDs {}", path.display()))?;
    let documents = serde_saphyr::from_multiple::<Value>(&yaml)
        .with_context(|| format!("parsing {}", path.display()))?;
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let apply = PatchParams::apply("tensile-harness").force();
    for crd in documents.into_iter().filter(|d| !d.is_null()) {
        let name = crd["metadata"]["name"]
            .as_str()
            .with_context(|| format!("a CRD without a name in {}", path.display()))?
            .to_owned();
        api.patch(&name, &apply, &Patch::Apply(&crd))
            .await
            .with_context(|| format!("applying the CRD {name}"))?;
    }
    wait_for(
        &format!("CRD {VPA_CRD} Established"),
        Duration::from_secs(30),
        || async {
            let established = api.get(VPA_CRD).await?.status.is_some_and(|s| {
                s.conditions
                    .unwrap_or_default()
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            });
            Ok(established.then_some(()))
        },
    )
    .await
}

/// The API of VerticalPodAutoscalers (`autoscaling.k8s.io/v1`) in `namespace`.
pub fn vpa_api(client: &Client, namespace: &str) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("autoscaling.k8s.io", "v1", "VerticalPodAutoscaler"),
        "verticalpodautoscalers",
    );
    Api::namespaced_with(client.clone(), namespace, &resource)
}

/// A VerticalPodAutoscaler named `name` of the Deployment `deployment`, in update mode
/// `mode` (e.g. `InPlaceOrRecreate`), acting on one replica; `resource_policy` is its
/// `spec.resourcePolicy` (`null` for none).
pub fn vertical_pod_autoscaler(
    name: &str,
    deployment: &str,
    mode: &str,
    resource_policy: Value,
) -> Value {
    json!({
        "apiVersion": "autoscaling.k8s.io/v1",
        "kind": "VerticalPodAutoscaler",
        "metadata": {"name": name},
        "spec": {
            "targetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
            "updatePolicy": {"updateMode": mode, "minReplicas": 1},
            "resourcePolicy": resource_policy,
        },
    })
}

/// Starts the updater against `cluster` (its admin identity), acting only on the VPAs and
/// pods of `namespace`, every [`UPDATER_INTERVAL`], on groups of one replica, without the
/// admission controller; its log is `<pair dir>/<cluster>-vpa-updater-<namespace>.log`
/// (verbosity 4: each patch it sends). It stops when dropped, or with the test process.
pub fn start_updater(
    pair: &ClusterPair,
    cluster: &Cluster,
    namespace: &str,
    bins: &VpaBinaries,
) -> Result<Process> {
    let port = free_port()?;
    let args = vec![
        format!("--kubeconfig={}", cluster.kubeconfig.display()),
        format!("--vpa-object-namespace={namespace}"),
        format!("--updater-interval={}s", UPDATER_INTERVAL.as_secs()),
        "--min-replicas=1".into(),
        "--use-admission-controller-status=false".into(),
        // Its metrics and health endpoint (":8943" by default, shared by every updater).
        format!("--address=127.0.0.1:{port}"),
        "--v=4".into(),
    ];
    pair.spawn(
        &format!("{}-vpa-updater-{namespace}", cluster.name),
        &bins.updater(),
        &args,
    )
}
