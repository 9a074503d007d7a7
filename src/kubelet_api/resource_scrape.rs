//! `/metrics/resource`: the lower kubelets that run this node's pods, read through the
//! lower API server's node proxy, or the lower metrics API where the lower identity may
//! not use it; turned into this node's series by [`super::resource_metrics`]. Which pods
//! are this node's, and on which lower nodes, is read from the member's lower pod store
//! (the pod controller's watch), never listed: a scrape costs no list of every pod.

use crate::lower_view::NamespaceView;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::{Duration, Instant};

use futures::StreamExt;
use http::Request;
use kube::Client;
use tracing::{debug, info, warn};

use super::resource_metrics::{
    self, Integrated, Mirrored, NodeCpu, NodeUsage, PodName, Sample, Usage,
};
use crate::controllers::pod_store::PodStore;
use crate::controllers::stores::Ready;
use crate::translate::meta::Owner;
use crate::translate::stored::StoredPod;

/// How many lower kubelets are read at once.
const PARALLEL_KUBELETS: usize = 16;

/// How long one lower call may take: a scrape answers in time with what it has, rather
/// than hang its caller (metrics-server gives up after 10 s).
const LOWER_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the metrics API stands in for kubelets that could not be read through the
/// lower API server before they are tried again (a permission granted later takes effect).
const FALLBACK_RETRY: Duration = Duration::from_secs(600);

/// Why some of this node's figures are missing from a scrape.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// The pods this node mirrors are not known.
    #[error("reading this node's pods in the lower cluster: {0}")]
    Pods(String),
    /// A lower kubelet could not be read.
    #[error(
        "reading /metrics/resource of lower node {node} through the lower API server: {reason}"
    )]
    Kubelet {
        /// The lower node.
        node: String,
        /// Why.
        reason: String,
    },
    /// The lower metrics API could not be read.
    #[error("reading pod metrics (metrics.k8s.io) in the lower cluster: {0}")]
    MetricsApi(String),
}

/// What one lower kubelet answered.
enum Kubelet {
    Text(String),
    /// It cannot be read through the lower API server, for a reason that holds for every
    /// scrape (the lower metrics API stands in): the lower identity may not `get
    /// nodes/proxy`, or the API server will not proxy to the node's address (it refuses
    /// loopback and link-local ones).
    Unreadable(String),
    Failed(ScrapeError),
}

/// The state kept between scrapes: the node's CPU counter, the integrated counters of the
/// fallback, and what has been logged.
#[derive(Debug)]
struct State {
    node_cpu: NodeCpu,
    integrated: Integrated,
    /// Since when the metrics API stands in for refused kubelets.
    fallback_since: Option<Instant>,
    /// Why the metrics API stands in, as last logged.
    fallback_logged: Option<String>,
    /// The last scrape's errors, logged at warn only when they change.
    last_errors: String,
    /// When the last scrape was taken, and its text (reused for a member of group nodes).
    last_scrape: Option<(Instant, String)>,
}

/// How long the `/metrics/resource` of a member of `node` or `label=<key>` granularity is
/// answered again from its last scrape: metrics-server scrapes each of its virtual nodes
/// at this one endpoint in turn (every `--metric-resolution`, 15 s by default), and one
/// scrape of the lower kubelets answers them all.
pub const GROUP_SCRAPE_REUSE: Duration = Duration::from_secs(5);

/// Serves `/metrics/resource` of one virtual node. Scrapes are taken one at a time: the
/// counters they keep advance in order.
#[derive(Debug)]
pub struct ResourceMetrics {
    state: tokio::sync::Mutex<State>,
    /// A member of `node` or `label=<key>` granularity, whose virtual nodes share this
    /// endpoint (see [`ResourceMetrics::for_group_nodes`]).
    grouped: bool,
}

impl Default for ResourceMetrics {
    fn default() -> Self {
        Self {
            state: tokio::sync::Mutex::new(State {
                node_cpu: NodeCpu::default(),
                integrated: Integrated::new(now_ms()),
                fallback_since: None,
                fallback_logged: None,
                last_errors: String::new(),
                last_scrape: None,
            }),
            grouped: false,
        }
    }
}

impl ResourceMetrics {
    /// For a member shown as several virtual nodes, all reached at this one endpoint (the
    /// API server and metrics-server call a node's address and port, which the member's
    /// virtual nodes share, and the path names no node): the series of every pod of the
    /// member, whichever of its virtual nodes is scraped, and no node series (no one
    /// virtual node's usage can be told from the call, and the member's total shown on
    /// each would be wrong on each); a scrape younger than [`GROUP_SCRAPE_REUSE`] is
    /// answered again rather than taken again.
    pub fn for_group_nodes() -> Self {
        Self {
            grouped: true,
            ..Self::default()
        }
    }
}

fn now_ms() -> i64 {
    k8s_openapi::jiff::Timestamp::now().as_millisecond()
}

/// The member's pods as its pod controller's watches keep them: every lower pod with the
/// node's marks, under the names the controllers see (upper namespace names where the
/// lower client speaks through a namespace view), and the upper pods bound to the node,
/// which say which of those lower pods are copies rather than forgeries.
#[derive(Clone)]
pub struct LowerPods {
    /// The lower pods.
    pub store: PodStore,
    /// The upper pods bound to this node (in `--namespace`, if given).
    pub upper: PodStore,
    /// Whether both watches have listed once.
    pub synced: Ready,
}

impl std::fmt::Debug for LowerPods {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LowerPods")
            .field("pods", &self.store.len())
            .field("upper", &self.upper.len())
            .field("synced", &self.synced.is_ready())
            .finish()
    }
}

/// The pods of `pods` that `owner` owns and that are the copy of an upper pod bound to
/// the node, as [`Mirrored`]s: `bound` gives the UID of the upper pod bound to the node
/// under a namespace and name, if any, and a lower pod counts only where the upper UID it
/// carries is that one (its marks and UID are copyable by anyone who may create pods
/// below, and a pod reported here is taken for that upper pod by `kubectl top` and the
/// HorizontalPodAutoscaler). Each pod's lower name is its name in the lower cluster, as
/// the kubelets and the metrics API give it: its namespace mapped back through the
/// member's namespace `view` (if any). Pure.
pub fn mirrored_of<'a>(
    pods: impl IntoIterator<Item = &'a StoredPod>,
    owner: &Owner,
    view: Option<&NamespaceView>,
    bound: &dyn Fn(&str, &str) -> Option<Box<str>>,
) -> Vec<Mirrored> {
    pods.into_iter()
        .filter(|pod| pod.is_owned_by(owner))
        .filter(|pod| {
            let copy = pod.upper_uid().is_some_and(|uid| {
                bound(&pod.meta.namespace, pod.meta.name()).is_some_and(|upper| *upper == *uid)
            });
            if !copy {
                debug!(node = %owner.node, cluster = "lower", pod = %pod.meta.key(),
                    upper_uid = ?pod.upper_uid(),
                    "/metrics/resource: a lower pod with this node's marks is the copy of no \
                     upper pod bound here; left out");
            }
            copy
        })
        .filter_map(|pod| {
            let (namespace, name) = (&*pod.meta.namespace, pod.meta.name());
            let seen = PodName::new(namespace, name);
            let lower = match view {
                Some(view) => PodName::new(view.to_lower(namespace)?, name),
                None => seen.clone(),
            };
            Some(Mirrored {
                upper: super::upper_pod(&seen),
                lower,
                lower_node: pod.node_name(),
            })
        })
        .collect()
}

/// The lower pods `owner` owns, as [`Mirrored`]s, from the member's store (waiting for its
/// first list at most [`LOWER_TIMEOUT`]); only those whose upper pod is bound to `node`,
/// where given.
async fn mirrored(
    pods: &LowerPods,
    owner: &Owner,
    view: Option<&NamespaceView>,
    node: Option<&str>,
) -> Result<Vec<Mirrored>, ScrapeError> {
    if !pods.synced.is_ready() {
        tokio::time::timeout(LOWER_TIMEOUT, pods.synced.wait())
            .await
            .map_err(|_| {
                ScrapeError::Pods(format!(
                    "the lower pod watch has not listed in {LOWER_TIMEOUT:?}"
                ))
            })?
            .map_err(|_| ScrapeError::Pods("the lower pod watch has stopped".into()))?;
    }
    let state = pods.store.state();
    let bound = |namespace: &str, name: &str| {
        let upper = pods.upper.get(namespace, name)?;
        if let Some(node) = node
            && upper.node_name().as_deref() != Some(node)
        {
            return None;
        }
        upper.meta.uid().map(|uid| Box::<str>::from(&*uid))
    };
    Ok(mirrored_of(
        state.iter().map(AsRef::as_ref),
        owner,
        view,
        &bound,
    ))
}

/// `GET /api/v1/nodes/<node>/proxy/metrics/resource` in the lower cluster.
async fn kubelet(lower: &Client, node: &str) -> Kubelet {
    let failed = |reason: String| {
        Kubelet::Failed(ScrapeError::Kubelet {
            node: node.to_owned(),
            reason,
        })
    };
    if !super::route::dns_subdomain(node) {
        return failed("not a node name".into());
    }
    let request = match Request::get(format!("/api/v1/nodes/{node}/proxy/metrics/resource"))
        .body(Vec::new())
    {
        Ok(request) => request,
        Err(e) => return failed(e.to_string()),
    };
    match tokio::time::timeout(LOWER_TIMEOUT, lower.request_text(request)).await {
        Ok(Ok(text)) => Kubelet::Text(text),
        // The lower API server's own refusal (a Status with reason Forbidden), not one the
        // kubelet gave it, which comes back as its plain text.
        Ok(Err(kube::Error::Api(status))) if status.code == 403 && status.reason == "Forbidden" => {
            Kubelet::Unreadable(
                "the lower identity may not get nodes/proxy (grant it for the kubelets' own counters)"
                    .into(),
            )
        }
        Ok(Err(kube::Error::Api(status)))
            if status.code == 400 && status.message.contains("address not allowed") =>
        {
            Kubelet::Unreadable(format!(
                "the lower API server will not proxy to node {node}: {}",
                status.message
            ))
        }
        Ok(Err(e)) => failed(e.to_string()),
        Err(_) => failed(format!("no answer in {LOWER_TIMEOUT:?}")),
    }
}

/// The lower metrics API's PodMetrics of `owner`'s pods: they carry their pod's labels.
pub(super) fn pod_metrics_uri(owner: &Owner) -> String {
    // Node names, cluster identities and the label keys need no escaping beyond `/`, `=`
    // and `,`.
    let selector = owner
        .selector()
        .replace('/', "%2F")
        .replace('=', "%3D")
        .replace(',', "%2C");
    format!("/apis/metrics.k8s.io/v1beta1/pods?labelSelector={selector}")
}

/// The lower metrics API's PodMetrics of `owner`'s pods.
async fn pod_metrics(lower: &Client, owner: &Owner) -> Result<serde_json::Value, ScrapeError> {
    let request = Request::get(pod_metrics_uri(owner))
        .body(Vec::new())
        .map_err(|e| ScrapeError::MetricsApi(e.to_string()))?;
    match tokio::time::timeout(LOWER_TIMEOUT, lower.request::<serde_json::Value>(request)).await {
        Ok(Ok(list)) => Ok(list),
        Ok(Err(kube::Error::Api(status))) if status.code == 404 || status.code == 503 => {
            Err(ScrapeError::MetricsApi(format!(
                "the lower cluster serves no metrics API ({}: {})",
                status.code, status.message
            )))
        }
        Ok(Err(e)) => Err(ScrapeError::MetricsApi(e.to_string())),
        Err(_) => Err(ScrapeError::MetricsApi(format!(
            "no answer in {LOWER_TIMEOUT:?}"
        ))),
    }
}

impl ResourceMetrics {
    /// The `/metrics/resource` text of `owner`'s node (of its virtual node `node` alone,
    /// where given: the pods bound to it), from the `lower` cluster. Never fails: what
    /// could not be read is left out and `scrape_error` is 1.
    pub async fn scrape(
        &self,
        lower: &Client,
        owner: &Owner,
        view: Option<&NamespaceView>,
        lower_pods: &LowerPods,
        node: Option<&str>,
    ) -> String {
        let mut state = self.state.lock().await;
        if self.grouped
            && let Some((at, text)) = &state.last_scrape
            && at.elapsed() < GROUP_SCRAPE_REUSE
        {
            return text.clone();
        }
        let mut errors: Vec<ScrapeError> = Vec::new();
        let (pods, listed) = match mirrored(lower_pods, owner, view, node).await {
            Ok(pods) => (pods, true),
            Err(e) => {
                errors.push(e);
                (Vec::new(), false)
            }
        };
        let by_lower = resource_metrics::by_lower_name(&pods);
        let mut usage = Usage::new();
        let retry_kubelets = state
            .fallback_since
            .is_none_or(|since| since.elapsed() >= FALLBACK_RETRY);
        // Why the metrics API stands in for the kubelets this time, if it does.
        let mut unreadable: Option<String> = (!retry_kubelets)
            .then(|| state.fallback_logged.clone())
            .flatten();
        if retry_kubelets {
            let nodes: BTreeSet<String> =
                pods.iter().filter_map(|p| p.lower_node.clone()).collect();
            let mut answers = futures::stream::iter(nodes)
                .map(|node: String| async move {
                    let answer = kubelet(lower, &node).await;
                    (node, answer)
                })
                .buffer_unordered(PARALLEL_KUBELETS);
            while let Some((node, answer)) = answers.next().await {
                match answer {
                    Kubelet::Text(text) => {
                        if let Err(e) =
                            resource_metrics::read_kubelet(&text, &node, &by_lower, &mut usage)
                        {
                            errors.push(ScrapeError::Kubelet {
                                node,
                                reason: e.to_string(),
                            });
                        }
                    }
                    Kubelet::Unreadable(why) => {
                        unreadable.get_or_insert(why);
                    }
                    Kubelet::Failed(e) => errors.push(e),
                }
            }
        }
        if let Some(why) = unreadable {
            if state.fallback_logged.as_ref() != Some(&why) {
                warn!(
                    node = %owner.node, cluster = "lower", reason = %why,
                    "kubelet API: the lower kubelets cannot be read, so /metrics/resource is \
                     built from the lower metrics API (metrics.k8s.io), with CPU counters \
                     integrated from usage that start again when virtual-node restarts"
                );
                state.fallback_logged = Some(why);
            }
            if retry_kubelets {
                state.fallback_since = Some(Instant::now());
            }
            // Whatever kubelets did answer are dropped: one source for all pods, so that no
            // pod's counter switches between the two.
            usage = match pod_metrics(lower, owner).await {
                Ok(list) => state
                    .integrated
                    .observe(&resource_metrics::readings(&list, &by_lower)),
                Err(e) => {
                    errors.push(e);
                    Usage::new()
                }
            };
        } else if state.fallback_since.take().is_some() {
            state.fallback_logged = None;
            info!(
                node = %owner.node, cluster = "lower",
                "kubelet API: the lower kubelets can be read now: /metrics/resource reads them"
            );
        }

        let now = now_ms();
        let current: BTreeMap<&PodName, f64> = usage
            .iter()
            .filter_map(|(pod, u)| u.cpu.map(|s| (pod, s.value)))
            .collect();
        let on_node: HashSet<&PodName> = pods.iter().map(|p| &p.upper).collect();
        let node = if self.grouped {
            NodeUsage::default()
        } else {
            NodeUsage {
                cpu: Some(Sample {
                    value: if listed {
                        state.node_cpu.observe(&current, &on_node)
                    } else {
                        state.node_cpu.total()
                    },
                    timestamp_ms: Some(resource_metrics::newest_cpu(&usage, now)),
                }),
                memory: Some(resource_metrics::node_memory(&usage, now)),
            }
        };
        let summary: String = errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        if summary != state.last_errors {
            if summary.is_empty() {
                info!(node = %owner.node, cluster = "lower", "kubelet API: /metrics/resource complete again");
            } else {
                warn!(
                    node = %owner.node, cluster = "lower", errors = %summary,
                    "kubelet API: /metrics/resource is incomplete (scrape_error 1)"
                );
            }
            state.last_errors.clone_from(&summary);
        } else if !summary.is_empty() {
            debug!(node = %owner.node, cluster = "lower", errors = %summary, "kubelet API: /metrics/resource still incomplete");
        }
        let text = resource_metrics::render(&usage, &node, !errors.is_empty());
        if self.grouped {
            state.last_scrape = Some((Instant::now(), text.clone()));
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::Pod;

    use super::*;
    use crate::translate::namespace::{Mapping, Mode};
    use crate::translate::stored::SharedSpecs;

    fn stored(namespace: &str, name: &str, node: Option<&str>, marks: &Owner) -> StoredPod {
        stored_with(namespace, name, node, marks, Some(&format!("uid-{name}")))
    }

    fn stored_with(
        namespace: &str,
        name: &str,
        node: Option<&str>,
        marks: &Owner,
        upper_uid: Option<&str>,
    ) -> StoredPod {
        let mut labels = BTreeMap::new();
        marks.mark(&mut labels);
        let annotations: BTreeMap<&str, &str> = upper_uid
            .map(|uid| (crate::translate::meta::UPPER_UID_ANNOTATION, uid))
            .into_iter()
            .collect();
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": namespace, "name": name, "labels": labels,
                "annotations": annotations},
            "spec": {"nodeName": node, "containers": [{"name": "app", "image": "busybox"}]},
        }))
        .unwrap();
        StoredPod::new(pod, &mut SharedSpecs::default())
    }

    /// Every pod named is bound here, its UID `uid-<name>`.
    fn all_bound(_: &str, name: &str) -> Option<Box<str>> {
        Some(format!("uid-{name}").into_boxed_str())
    }

    /// The scrape's pods come from the store: this node's only, each with its lower node
    /// and its lower name (through the namespace view).
    #[test]
    fn reads_the_nodes_pods_from_the_store() {
        let owner = Owner::new("vk", "c1");
        let pods = [
            stored("shop", "a", Some("lower-1"), &owner),
            stored("shop", "b", None, &owner),
            stored("team", "c", Some("lower-2"), &owner),
            // Another node's, another cluster's: not this node's figures.
            stored("shop", "d", Some("lower-1"), &Owner::new("other", "c1")),
            stored("shop", "e", Some("lower-1"), &Owner::new("vk", "c2")),
        ];
        let got = mirrored_of(&pods, &owner, None, &all_bound);
        let want = [
            ("shop", "a", Some("lower-1")),
            ("shop", "b", None),
            ("team", "c", Some("lower-2")),
        ];
        assert_eq!(got.len(), want.len(), "{got:?}");
        for (m, (namespace, name, node)) in got.iter().zip(want) {
            assert_eq!(m.upper, PodName::new(namespace, name));
            assert_eq!(m.lower, m.upper);
            assert_eq!(m.lower_node.as_deref(), node);
        }

        let mut mapping = Mapping::new(Mode::Prefixed, "c1".into());
        mapping.set("shop", "shop-c1").unwrap();
        let view = NamespaceView::new(mapping);
        let got = mirrored_of(&pods, &owner, Some(&view), &all_bound);
        // `team` is not mapped (yet): its pod is left out rather than guessed.
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0].upper, PodName::new("shop", "a"));
        assert_eq!(got[0].lower, PodName::new("shop-c1", "a"));
    }

    /// A lower pod with this node's marks counts only as the copy of an upper pod bound
    /// here: of that name, and whose UID it carries. A forged one (named like a pod on
    /// another node, or carrying another UID, or none) is not reported as that pod.
    #[test]
    fn reports_only_copies_of_pods_bound_here() {
        let owner = Owner::new("vk", "c1");
        // The upper pods bound to this node.
        let upper: BTreeMap<(&str, &str), &str> =
            [(("shop", "web"), "u-web"), (("shop", "db"), "u-db")].into();
        let bound = |namespace: &str, name: &str| {
            upper
                .get(&(namespace, name))
                .map(|uid| (*uid).to_owned().into_boxed_str())
        };
        // (namespace, name, upper UID it carries, reported)
        let cases: &[(&str, &str, Option<&str>, bool)] = &[
            ("shop", "web", Some("u-web"), true),
            // Named like a pod on a real node (not bound here), with its UID.
            ("shop", "api", Some("u-api"), false),
            // Named like a pod bound here, with another UID (its predecessor's, or made up).
            ("shop", "db", Some("u-other"), false),
            // With no UID.
            ("shop", "db", None, false),
            // Another namespace's pod of that name.
            ("team", "web", Some("u-web"), false),
        ];
        for (namespace, name, uid, reported) in cases {
            let pod = stored_with(namespace, name, Some("lower-1"), &owner, *uid);
            let got = mirrored_of([&pod], &owner, None, &bound);
            assert_eq!(
                !got.is_empty(),
                *reported,
                "{namespace}/{name} carrying {uid:?}: {got:?}"
            );
        }
    }
}
