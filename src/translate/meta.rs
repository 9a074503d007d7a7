//! The labels and annotations tensile reads and writes: tensile-kube's, kept verbatim, and
//! tensile's own ownership marks.

/// Pod label: the pod may run in a lower cluster; mirrored pods carry it too (tensile-kube).
pub const VIRTUAL_POD_LABEL: &str = "virtual-pod";
/// Pod annotation: JSON `{"nodeSelector","affinity","tolerations"}` stashed by the webhook.
pub const CLUSTER_SELECTOR_ANNOTATION: &str = "clusterSelector";
/// Pod annotation: JSON map of the labels removed before mirroring (`--ignore-labels`).
pub const TRIPPED_LABELS_ANNOTATION: &str = "tripped-labels";
/// Annotation on objects created by the system in the lower cluster (tensile-kube).
pub const GLOBAL_ANNOTATION: &str = "global";
/// Annotation: JSON of a Service/PVC selector removed when mirrored.
pub const LABEL_SELECTOR_ANNOTATION: &str = "labelSelector";
/// PVC annotation rewritten to the virtual node's name on the way up.
pub const SELECTED_NODE_ANNOTATION: &str = "volume.kubernetes.io/selected-node";

/// Prefix of tensile's own keys.
pub const PREFIX: &str = "tensile.dev/";
/// Label on every lower object tensile creates: the virtual node that owns it. tensile acts
/// only on lower objects whose value is its own `--nodename`.
pub const OWNER_NODE_LABEL: &str = "tensile.dev/virtual-node";
/// Annotation on every lower object tensile creates: the UID of its upper origin, so an
/// upper object re-created under the same name is never mistaken for the old one.
pub const UPPER_UID_ANNOTATION: &str = "tensile.dev/upper-uid";
/// Annotation on lower pods: JSON `{"labels":[…],"annotations":[…]}` naming the keys tensile
/// wrote, so a key removed upstream is removed below while keys the lower cluster added
/// itself (CNI, sidecar injectors) are left alone.
pub const MIRRORED_KEYS_ANNOTATION: &str = "tensile.dev/mirrored-keys";
/// Annotation on lower ConfigMap and Secret copies: the upper resourceVersion they were
/// copied from, so an upper edit is noticed without keeping upper contents in memory.
pub const UPPER_RESOURCE_VERSION_ANNOTATION: &str = "tensile.dev/upper-resource-version";
/// Annotation on lower ConfigMap and Secret copies: a hash of their content as tensile
/// wrote it, so an edit made below is noticed (and undone).
pub const CONTENT_HASH_ANNOTATION: &str = "tensile.dev/content-hash";
/// Annotation on upper PersistentVolumes reflected from the lower cluster: the UID of the
/// lower PersistentVolume, so a lower volume re-created under the same name is noticed.
pub const LOWER_UID_ANNOTATION: &str = "tensile.dev/lower-uid";
/// Value of `endpointslice.kubernetes.io/managed-by` on the EndpointSlices tensile mirrors,
/// so the lower cluster's EndpointSlice controllers leave them alone.
pub const ENDPOINT_SLICE_MANAGER: &str = "tensile.dev";
/// Key of the virtual node's taint (tensile-kube's default for `VKUBELET_TAINT_KEY`), which
/// the webhook's toleration matches.
pub const VIRTUAL_NODE_TAINT_KEY: &str = "virtual-kubelet.io/provider";
/// Value of the virtual node's taint (tensile-kube's default for `VKUBELET_TAINT_VALUE`).
pub const VIRTUAL_NODE_TAINT_VALUE: &str = "k8s";
/// Effect of the virtual node's taint (tensile-kube's default for `VKUBELET_TAINT_EFFECT`).
pub const VIRTUAL_NODE_TAINT_EFFECT: &str = "NoSchedule";
