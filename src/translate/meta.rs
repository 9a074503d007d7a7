//! The labels and annotations tensile reads and writes: tensile-kube's, kept verbatim, and
//! tensile's own ownership marks.

use std::collections::BTreeMap;

/// Pod label: the pod may run in a lower cluster; mirrored pods carry it too (tensile-kube).
/// The upper pod annotation the ReplicaSet controller orders scale-in by (lower goes
/// first). It orders upper pods only: never copied below, where no ReplicaSet owns a pod.
pub const DELETION_COST_ANNOTATION: &str = "controller.kubernetes.io/pod-deletion-cost";
/// Beside a deletion cost virtual-node wrote on an upper pod: the value it wrote. Never
/// copied below.
pub const DELETION_COST_MARK: &str = "tensile.dev/deletion-cost";
pub const VIRTUAL_POD_LABEL: &str = "virtual-pod";
/// The label every virtual node carries (`type: virtual-kubelet`, tensile-kube's). A
/// nodeSelector entry on it, or a required `type In [virtual-kubelet]`, selects the virtual
/// node itself (Kueue's flavor for virtual nodes injects the first).
pub const VIRTUAL_NODE_LABEL: (&str, &str) = ("type", "virtual-kubelet");
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
/// Label on every lower object tensile creates: the identity of the upper cluster whose
/// virtual node made it (`--cluster-id`, by default the UID of the upper `kube-system`
/// namespace), so that two upper clusters running virtual nodes of the same name against
/// one lower cluster never take each other's objects.
pub const UPPER_CLUSTER_LABEL: &str = "tensile.dev/upper-cluster";
/// Annotation on every lower object tensile creates: the UID of its upper origin, so an
/// upper object re-created under the same name is never mistaken for the old one.
pub const UPPER_UID_ANNOTATION: &str = "tensile.dev/upper-uid";
/// Annotation on lower pods: JSON `{"labels":[…],"annotations":[…]}` naming the keys tensile
/// wrote, so a key removed upstream is removed below while keys the lower cluster added
/// itself (CNI, sidecar injectors) are left alone.
pub const MIRRORED_KEYS_ANNOTATION: &str = "tensile.dev/mirrored-keys";
/// Annotation on a lower pod whose downward API reads `metadata.namespace`: the upper
/// namespace, which its rewritten `fieldRef`s read instead (the lower one may differ).
pub const UPPER_NAMESPACE_ANNOTATION: &str = "tensile.dev/upper-namespace";
/// Annotation on a lower pod whose downward API reads `spec.nodeName`: the virtual node's
/// name, which its rewritten `fieldRef`s read instead of the lower node's.
pub const UPPER_NODE_NAME_ANNOTATION: &str = "tensile.dev/upper-node-name";
/// Annotation on a lower pod whose downward API volumes read `metadata.labels`: the upper
/// pod's labels as the kubelet writes them (`key="value"` lines), which the rewritten
/// `fieldRef`s read instead of the lower labels (tensile's marks, no tripped labels).
pub const UPPER_LABELS_ANNOTATION: &str = "tensile.dev/upper-labels";
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

/// Who owns a lower object: the virtual node `node` of the upper cluster `cluster`. An
/// object is its own only when it carries both marks.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Owner {
    /// `--nodename`.
    pub node: String,
    /// The upper cluster's identity (`--cluster-id`).
    pub cluster: String,
}

/// The labels every lower pod of one [`Owner`] carries, with the same values: its marks and
/// `virtual-pod`.
pub const LOWER_POD_MARKS: &[&str] = &[OWNER_NODE_LABEL, UPPER_CLUSTER_LABEL, VIRTUAL_POD_LABEL];

/// What a lower object's ownership marks say about it, to one [`Owner`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// Both marks are the owner's.
    Ours,
    /// Its node mark is the owner's and it has no cluster mark: made by a tensile version
    /// before cluster marks, by this owner or by another upper cluster's node of the same
    /// name (undecidable; adopted once at start).
    Unclaimed,
    /// Its node mark is the owner's and its cluster mark another upper cluster's.
    Foreign,
    /// Another node's, or nobody's.
    NotOurs,
}

impl Owner {
    /// The owner `node` of upper cluster `cluster`.
    pub fn new(node: impl Into<String>, cluster: impl Into<String>) -> Self {
        Self {
            node: node.into(),
            cluster: cluster.into(),
        }
    }

    /// The label selector of the objects it owns (both marks).
    pub fn selector(&self) -> String {
        format!(
            "{OWNER_NODE_LABEL}={},{UPPER_CLUSTER_LABEL}={}",
            self.node, self.cluster
        )
    }

    /// The label selector of objects with its node mark and no cluster mark.
    pub fn unclaimed_selector(&self) -> String {
        format!("{OWNER_NODE_LABEL}={},!{UPPER_CLUSTER_LABEL}", self.node)
    }

    /// The label selector of objects with its node mark and another cluster's mark.
    pub fn foreign_selector(&self) -> String {
        format!(
            "{OWNER_NODE_LABEL}={},{UPPER_CLUSTER_LABEL},{UPPER_CLUSTER_LABEL}!={}",
            self.node, self.cluster
        )
    }

    /// Adds both marks to `labels`.
    pub fn mark(&self, labels: &mut BTreeMap<String, String>) {
        labels.insert(OWNER_NODE_LABEL.to_owned(), self.node.clone());
        labels.insert(UPPER_CLUSTER_LABEL.to_owned(), self.cluster.clone());
    }

    /// What the marks read through `label` (a label lookup) say.
    pub fn claim<'a>(&self, label: impl Fn(&str) -> Option<&'a str>) -> Claim {
        if label(OWNER_NODE_LABEL) != Some(self.node.as_str()) {
            return Claim::NotOurs;
        }
        match label(UPPER_CLUSTER_LABEL) {
            Some(cluster) if cluster == self.cluster => Claim::Ours,
            Some(_) => Claim::Foreign,
            None => Claim::Unclaimed,
        }
    }

    /// [`Owner::claim`] over a label map.
    pub fn claim_labels(&self, labels: Option<&BTreeMap<String, String>>) -> Claim {
        self.claim(|key| labels.and_then(|l| l.get(key)).map(String::as_str))
    }

    /// Whether `labels` carry both of its marks.
    pub fn owns(&self, labels: Option<&BTreeMap<String, String>>) -> bool {
        self.claim_labels(labels) == Claim::Ours
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims() {
        let owner = Owner::new("vk", "c1");
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        let cases = [
            (vec![], Claim::NotOurs),
            (vec![(OWNER_NODE_LABEL, "other")], Claim::NotOurs),
            (
                vec![(OWNER_NODE_LABEL, "other"), (UPPER_CLUSTER_LABEL, "c1")],
                Claim::NotOurs,
            ),
            (vec![(OWNER_NODE_LABEL, "vk")], Claim::Unclaimed),
            (
                vec![(OWNER_NODE_LABEL, "vk"), (UPPER_CLUSTER_LABEL, "c2")],
                Claim::Foreign,
            ),
            (
                vec![(OWNER_NODE_LABEL, "vk"), (UPPER_CLUSTER_LABEL, "c1")],
                Claim::Ours,
            ),
        ];
        for (pairs, want) in cases {
            let map = labels(&pairs);
            assert_eq!(owner.claim_labels(Some(&map)), want, "{pairs:?}");
            assert_eq!(owner.owns(Some(&map)), want == Claim::Ours, "{pairs:?}");
        }
        assert_eq!(owner.claim_labels(None), Claim::NotOurs);
        let mut marked = BTreeMap::new();
        owner.mark(&mut marked);
        assert!(owner.owns(Some(&marked)));
        assert_eq!(
            owner.selector(),
            "tensile.dev/virtual-node=vk,tensile.dev/upper-cluster=c1"
        );
    }
}
