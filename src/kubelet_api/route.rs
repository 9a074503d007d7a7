//! Which kubelet API call a request is, from its method, path and query: pure.

use std::collections::BTreeMap;

/// A kubelet API call virtual-node answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// `/healthz`.
    Healthz,
    /// `/containerLogs/{ns}/{pod}/{container}`.
    Logs(Target),
    /// `/exec/{ns}/{pod}[/{uid}]/{container}?command=…`.
    Exec(Target, Vec<String>, StreamFlags),
    /// `/attach/{ns}/{pod}[/{uid}]/{container}`.
    Attach(Target, StreamFlags),
    /// `/portForward/{ns}/{pod}[/{uid}]`.
    PortForward(Target),
    /// `/pods`: the pods on this node.
    Pods,
    /// `/runningpods/`: those of them running.
    RunningPods,
    /// `/stats/summary`.
    StatsSummary,
    /// `/metrics/resource`: the kubelet's resource metrics (metrics-server's source).
    MetricsResource,
}

/// The pod (and container) a call is about.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Target {
    /// Namespace.
    pub namespace: String,
    /// Pod name.
    pub pod: String,
    /// Upper pod UID, when the path names one.
    pub uid: Option<String>,
    /// Container (empty for port-forward).
    pub container: String,
}

/// Which streams an exec or attach asks for (`input`/`stdin`, `output`/`stdout`,
/// `error`/`stderr`, `tty`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamFlags {
    /// Standard input.
    pub stdin: bool,
    /// Standard output.
    pub stdout: bool,
    /// Standard error (never with a TTY).
    pub stderr: bool,
    /// A TTY.
    pub tty: bool,
}

/// The `nodes` subresources a kubelet authorizes a call on, in the order it asks (the
/// first allowed one lets the call in), as a 1.33+ kubelet maps the paths
/// (`KubeletFineGrainedAuthz`, locked on since 1.36): `/healthz` on `healthz` then
/// `proxy`, `/pods` and `/runningpods/` on `pods` then `proxy`, `/stats/*` on `stats`,
/// `/metrics/*` on `metrics`, everything else (`/containerLogs`, `/exec`, `/attach`, `/portForward`) on `proxy`.
pub fn subresources(route: &Route) -> &'static [&'static str] {
    match route {
        Route::Healthz => &["healthz", "proxy"],
        Route::Pods | Route::RunningPods => &["pods", "proxy"],
        Route::StatsSummary => &["stats"],
        Route::MetricsResource => &["metrics"],
        Route::Logs(_) | Route::Exec(..) | Route::Attach(..) | Route::PortForward(_) => &["proxy"],
    }
}

/// The authorization verb for an HTTP method, as the kubelet maps it.
pub fn verb(method: &http::Method) -> &'static str {
    match *method {
        http::Method::POST => "create",
        http::Method::PUT => "update",
        http::Method::PATCH => "patch",
        http::Method::DELETE => "delete",
        _ => "get",
    }
}

/// Query parameters, each with all its values in order.
pub fn query_pairs(query: Option<&str>) -> BTreeMap<String, Vec<String>> {
    let mut pairs: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for part in query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (key, value) = part.split_once('=').unwrap_or((part, ""));
        pairs
            .entry(percent_decode(key))
            .or_default()
            .push(percent_decode(value));
    }
    pairs
}

/// `%XX` and `+` decoding of a query component; invalid escapes are kept as they are.
pub fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A boolean query flag as the kubelet reads it (`1`, `true`).
fn flag(query: &BTreeMap<String, Vec<String>>, names: &[&str]) -> bool {
    names.iter().any(|name| {
        query
            .get(*name)
            .and_then(|v| v.last())
            .is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
    })
}

/// The route of a path and query, or `None` for a path the kubelet API has no call for.
pub fn route(path: &str, query: &BTreeMap<String, Vec<String>>) -> Option<Route> {
    let segments: Vec<String> = path
        .trim_end_matches('/')
        .split('/')
        .skip(1)
        .map(percent_decode)
        .collect();
    let segments: Vec<&str> = segments.iter().map(String::as_str).collect();
    let target = |ns: &str, pod: &str, uid: Option<&str>, container: &str| Target {
        namespace: ns.to_owned(),
        pod: pod.to_owned(),
        uid: uid.map(str::to_owned),
        container: container.to_owned(),
    };
    let streams = StreamFlags {
        stdin: flag(query, &["input", "stdin"]),
        stdout: flag(query, &["output", "stdout"]),
        stderr: flag(query, &["error", "stderr"]),
        tty: flag(query, &["tty"]),
    };
    let pod_and_container = |rest: &[&str]| match rest {
        [ns, pod, container] => Some(target(ns, pod, None, container)),
        [ns, pod, uid, container] => Some(target(ns, pod, Some(uid), container)),
        _ => None,
    };
    // Names go into lower-cluster URLs: only what Kubernetes accepts as names gets there.
    let valid = |t: &Target| {
        dns_label(&t.namespace)
            && dns_subdomain(&t.pod)
            && (t.container.is_empty() || dns_label(&t.container))
    };
    match segments.as_slice() {
        ["healthz"] => Some(Route::Healthz),
        ["pods"] => Some(Route::Pods),
        ["runningpods"] => Some(Route::RunningPods),
        ["stats", "summary"] => Some(Route::StatsSummary),
        ["metrics", "resource"] => Some(Route::MetricsResource),
        ["containerLogs", ns, pod, container] => {
            Some(Route::Logs(target(ns, pod, None, container))).filter(|r| match r {
                Route::Logs(t) => valid(t) && !t.container.is_empty(),
                _ => false,
            })
        }
        ["exec", rest @ ..] => {
            let t = pod_and_container(rest).filter(valid)?;
            let command = query.get("command").cloned().unwrap_or_default();
            Some(Route::Exec(t, command, streams))
        }
        ["attach", rest @ ..] => pod_and_container(rest)
            .filter(valid)
            .map(|t| Route::Attach(t, streams)),
        ["portForward", ns, pod] => Some(target(ns, pod, None, ""))
            .filter(valid)
            .map(Route::PortForward),
        ["portForward", ns, pod, uid] => Some(target(ns, pod, Some(uid), ""))
            .filter(valid)
            .map(Route::PortForward),
        _ => None,
    }
}

/// A DNS-1123 label: namespaces and container names.
fn dns_label(name: &str) -> bool {
    name.len() <= 63
        && !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// A DNS-1123 subdomain: pod and node names.
pub(crate) fn dns_subdomain(name: &str) -> bool {
    name.len() <= 253 && name.split('.').all(dns_label)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ns: &str, pod: &str, uid: Option<&str>, container: &str) -> Target {
        Target {
            namespace: ns.into(),
            pod: pod.into(),
            uid: uid.map(Into::into),
            container: container.into(),
        }
    }

    #[test]
    fn routes() {
        let all = StreamFlags {
            stdin: true,
            stdout: true,
            stderr: true,
            tty: false,
        };
        let cases: Vec<(&str, Option<Route>)> = vec![
            ("/healthz", Some(Route::Healthz)),
            ("/pods", Some(Route::Pods)),
            ("/pods/", Some(Route::Pods)),
            ("/runningpods/", Some(Route::RunningPods)),
            ("/stats/summary", Some(Route::StatsSummary)),
            ("/metrics/resource", Some(Route::MetricsResource)),
            ("/metrics/cadvisor", None),
            ("/metrics", None),
            (
                "/containerLogs/ns/web/app?follow=true",
                Some(Route::Logs(t("ns", "web", None, "app"))),
            ),
            ("/containerLogs/ns/web", None),
            (
                "/exec/ns/web/app?command=sh&command=-c&command=echo%20hi&input=1&output=1&error=1",
                Some(Route::Exec(
                    t("ns", "web", None, "app"),
                    vec!["sh".into(), "-c".into(), "echo hi".into()],
                    all,
                )),
            ),
            (
                "/exec/ns/web/uid-1/app?command=true&stdout=true&tty=1",
                Some(Route::Exec(
                    t("ns", "web", Some("uid-1"), "app"),
                    vec!["true".into()],
                    StreamFlags {
                        stdout: true,
                        tty: true,
                        ..StreamFlags::default()
                    },
                )),
            ),
            (
                "/attach/ns/web/app?input=1&output=1&error=1",
                Some(Route::Attach(t("ns", "web", None, "app"), all)),
            ),
            (
                "/portForward/ns/web",
                Some(Route::PortForward(t("ns", "web", None, ""))),
            ),
            (
                "/portForward/ns/web/uid-2",
                Some(Route::PortForward(t("ns", "web", Some("uid-2"), ""))),
            ),
            ("/exec/ns", None),
            ("/run/ns/web/app", None),
            // names a lower URL must never carry
            ("/containerLogs/ns/..%2Fsecrets/app", None),
            ("/containerLogs/ns/web%3Fx=1/app", None),
            ("/exec/NS/web/app?command=sh", None),
            ("/exec/ns/web/-app?command=sh", None),
            ("/portForward//web", None),
            ("/portForward/ns/web.a_b", None),
            (
                "/containerLogs/ns/web.v2/app",
                Some(Route::Logs(t("ns", "web.v2", None, "app"))),
            ),
            ("/", None),
            ("/configz", None),
        ];
        for (uri, want) in cases {
            let (path, query) = uri.split_once('?').unwrap_or((uri, ""));
            assert_eq!(route(path, &query_pairs(Some(query))), want, "{uri}");
        }
    }

    #[test]
    fn decoding() {
        for (raw, want) in [
            ("a%20b", "a b"),
            ("a+b", "a b"),
            ("%2Fx", "/x"),
            ("bad%zz", "bad%zz"),
            ("end%2", "end%2"),
            ("%", "%"),
            ("caf%C3%A9", "café"),
        ] {
            assert_eq!(percent_decode(raw), want, "{raw}");
        }
    }

    #[test]
    fn verbs_and_subresources() {
        assert_eq!(verb(&http::Method::POST), "create");
        assert_eq!(verb(&http::Method::GET), "get");
        let cases: &[(&str, &[&str])] = &[
            ("/healthz", &["healthz", "proxy"]),
            ("/pods", &["pods", "proxy"]),
            ("/runningpods/", &["pods", "proxy"]),
            ("/stats/summary", &["stats"]),
            ("/metrics/resource", &["metrics"]),
            ("/containerLogs/ns/web/app", &["proxy"]),
            ("/exec/ns/web/app", &["proxy"]),
            ("/attach/ns/web/app", &["proxy"]),
            ("/portForward/ns/web", &["proxy"]),
        ];
        for (path, want) in cases {
            let route = route(path, &query_pairs(None)).unwrap();
            assert_eq!(subresources(&route), *want, "{path}");
        }
    }
}
