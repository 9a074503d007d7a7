//! The downward API of a pod that runs below: what it reads of itself must be what the upper
//! pod has, as on a real node of the upper cluster. The lower pod's own `metadata.uid`,
//! `metadata.namespace` (remapped: `--lower-namespace`), `spec.nodeName` (a lower node) and
//! `metadata.labels` (tensile's marks, no tripped labels) differ from the upper pod's, so
//! each `fieldRef` to one of them is rewritten to read an annotation that the translation
//! puts on the lower pod with the upper value. An annotation serves environment variables
//! and volume files alike, keeps `fieldRef` semantics (the kubelet resolves it, a volume
//! file follows a change), and costs nothing for the pods that read none of these.
//!
//! Faithful as they are: `metadata.name` (the lower pod has the upper name),
//! `spec.serviceAccountName` (the same name below), `status.hostIP(s)` and
//! `status.podIP(s)` (the upper status is the lower pod's, reflected), single
//! `metadata.annotations['…']` (the upper annotations are copied down).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{
    DownwardAPIVolumeFile, EnvVar, ObjectFieldSelector, Pod, PodSpec,
};

use super::meta::{
    UPPER_LABELS_ANNOTATION, UPPER_NAMESPACE_ANNOTATION, UPPER_NODE_NAME_ANNOTATION,
    UPPER_UID_ANNOTATION,
};

/// The annotations [`present_upper_fields`] may ask for besides [`UPPER_UID_ANNOTATION`]
/// (which every lower object carries): added only to pods that read them.
pub const DOWNWARD_ANNOTATIONS: [&str; 3] = [
    UPPER_NAMESPACE_ANNOTATION,
    UPPER_NODE_NAME_ANNOTATION,
    UPPER_LABELS_ANNOTATION,
];

/// The annotation that holds the upper value of the downward API field `path`, for the
/// fields whose lower value differs.
fn annotation_for(path: &str) -> Option<&'static str> {
    match path {
        "metadata.uid" => Some(UPPER_UID_ANNOTATION),
        "metadata.namespace" => Some(UPPER_NAMESPACE_ANNOTATION),
        "spec.nodeName" => Some(UPPER_NODE_NAME_ANNOTATION),
        "metadata.labels" => Some(UPPER_LABELS_ANNOTATION),
        _ => None,
    }
}

/// `selector` rewritten to read the annotation that holds its field's upper value, and that
/// annotation; `None` when its field is faithful below as it is.
fn rewritten(selector: &ObjectFieldSelector) -> Option<(ObjectFieldSelector, &'static str)> {
    let key = annotation_for(&selector.field_path)?;
    let api_version = selector
        .api_version
        .clone()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "v1".to_owned());
    Some((
        ObjectFieldSelector {
            api_version: Some(api_version),
            field_path: format!("metadata.annotations['{key}']"),
        },
        key,
    ))
}

/// Rewrites every `fieldRef` of `spec`'s containers, init containers, downward API volumes
/// and projected downward API sources whose field differs below ([`annotation_for`]) to
/// read its annotation instead; the annotations it asks for, besides
/// [`UPPER_UID_ANNOTATION`]. Ephemeral containers are left alone (they follow later:
/// [`literal_upper_fields`]).
pub fn present_upper_fields(spec: &mut PodSpec) -> BTreeSet<&'static str> {
    let mut wanted = BTreeSet::new();
    let mut rewrite = |selector: &mut Option<ObjectFieldSelector>| {
        if let Some((new, key)) = selector.as_ref().and_then(rewritten) {
            *selector = Some(new);
            if key != UPPER_UID_ANNOTATION {
                wanted.insert(key);
            }
        }
    };
    let containers = spec
        .containers
        .iter_mut()
        .chain(spec.init_containers.iter_mut().flatten());
    for container in containers {
        for var in container.env.iter_mut().flatten() {
            if let Some(from) = var.value_from.as_mut() {
                rewrite(&mut from.field_ref);
            }
        }
    }
    for volume in spec.volumes.iter_mut().flatten() {
        let mut items: Vec<&mut DownwardAPIVolumeFile> = Vec::new();
        if let Some(downward) = volume.downward_api.as_mut() {
            items.extend(downward.items.iter_mut().flatten());
        }
        if let Some(projected) = volume.projected.as_mut() {
            let sources = projected.sources.iter_mut().flatten();
            for downward in sources.filter_map(|s| s.downward_api.as_mut()) {
                items.extend(downward.items.iter_mut().flatten());
            }
        }
        for item in items {
            rewrite(&mut item.field_ref);
        }
    }
    wanted
}

/// The value of the annotation `key` (one of [`DOWNWARD_ANNOTATIONS`]) for `upper`; `None`
/// when `upper` lacks the field (no node yet) or `key` is none of them.
pub fn upper_value(key: &str, upper: &Pod) -> Option<String> {
    match key {
        UPPER_NAMESPACE_ANNOTATION => upper.metadata.namespace.clone(),
        UPPER_NODE_NAME_ANNOTATION => upper.spec.as_ref()?.node_name.clone(),
        UPPER_LABELS_ANNOTATION => Some(format_map(
            upper.metadata.labels.as_ref().unwrap_or(&BTreeMap::new()),
        )),
        _ => None,
    }
}

/// The static fields a container of `upper` reads through `fieldRef`s in its environment,
/// as literal values: for an ephemeral container, which is added to the running lower pod
/// (whose annotations were made for the containers it was created with) and never
/// restarted, so a value set once is the value the kubelet would have resolved.
pub fn literal_upper_fields(container_env: &mut Option<Vec<EnvVar>>, upper: &Pod) {
    for var in container_env.iter_mut().flatten() {
        let path = var
            .value_from
            .as_ref()
            .and_then(|from| from.field_ref.as_ref())
            .map(|f| f.field_path.as_str());
        let value = match path {
            Some("metadata.uid") => upper.metadata.uid.clone(),
            Some(path @ ("metadata.namespace" | "spec.nodeName")) => {
                annotation_for(path).and_then(|key| upper_value(key, upper))
            }
            _ => None,
        };
        if let Some(value) = value {
            var.value = Some(value);
            var.value_from = None;
        }
    }
}

/// `map` as the kubelet writes a whole map of the downward API (`fieldpath.FormatMap`):
/// `key="value"` lines in key order, each value quoted as Go's `strconv.Quote` quotes it.
pub fn format_map(map: &BTreeMap<String, String>) -> String {
    let mut out = String::new();
    for (key, value) in map {
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str(key);
        out.push('=');
        go_quote(value, &mut out);
    }
    out
}

/// Appends `value` quoted as Go's `strconv.Quote` does: exact for label values (letters,
/// digits, `-`, `_`, `.`) and for any ASCII; a non-ASCII character is escaped only when it
/// is a control or a space character (Go escapes the few other unprintable ones too).
fn go_quote(value: &str, out: &mut String) {
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{7}' => out.push_str("\\a"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{b}' => out.push_str("\\v"),
            ' ' => out.push(' '),
            c if c < ' ' || c == '\u{7f}' => out.push_str(&format!("\\x{:02x}", u32::from(c))),
            c if c.is_control() || c.is_whitespace() => {
                let code = u32::from(c);
                if code < 0x1_0000 {
                    out.push_str(&format!("\\u{code:04x}"));
                } else {
                    out.push_str(&format!("\\U{code:08x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn field(path: &str) -> Value {
        json!({"apiVersion": "v1", "fieldPath": path})
    }

    fn annotation(key: &str) -> Value {
        field(&format!("metadata.annotations['{key}']"))
    }

    fn spec(value: Value) -> PodSpec {
        serde_json::from_value(value).unwrap()
    }

    fn env_of(fields: &[Value]) -> Value {
        let env: Vec<Value> = fields
            .iter()
            .enumerate()
            .map(|(i, f)| json!({"name": format!("V{i}"), "valueFrom": {"fieldRef": f}}))
            .collect();
        json!({"containers": [{"name": "app", "env": env}]})
    }

    #[test]
    fn rewrites_the_fields_that_differ_below() {
        let volume = |items: Value| json!({"containers": [{"name": "app"}], "volumes": [{"name": "info", "downwardAPI": {"items": items}}]});
        let item = |path: &str, f: Value| json!({"path": path, "fieldRef": f});
        // (case, upper spec, lower spec, annotations asked for)
        let cases: Vec<(&str, Value, Value, Vec<&str>)> = vec![
            (
                "env: uid, namespace and nodeName read annotations",
                env_of(&[
                    field("metadata.uid"),
                    field("metadata.namespace"),
                    field("spec.nodeName"),
                ]),
                env_of(&[
                    annotation(UPPER_UID_ANNOTATION),
                    annotation(UPPER_NAMESPACE_ANNOTATION),
                    annotation(UPPER_NODE_NAME_ANNOTATION),
                ]),
                vec![UPPER_NAMESPACE_ANNOTATION, UPPER_NODE_NAME_ANNOTATION],
            ),
            (
                "env: fields faithful below are left alone",
                env_of(&[
                    field("metadata.name"),
                    field("status.hostIP"),
                    field("status.hostIPs"),
                    field("status.podIP"),
                    field("spec.serviceAccountName"),
                    field("metadata.labels['app']"),
                    field("metadata.annotations['note']"),
                ]),
                env_of(&[
                    field("metadata.name"),
                    field("status.hostIP"),
                    field("status.hostIPs"),
                    field("status.podIP"),
                    field("spec.serviceAccountName"),
                    field("metadata.labels['app']"),
                    field("metadata.annotations['note']"),
                ]),
                vec![],
            ),
            (
                "env without apiVersion gets v1",
                env_of(&[json!({"fieldPath": "metadata.uid"})]),
                env_of(&[annotation(UPPER_UID_ANNOTATION)]),
                vec![],
            ),
            (
                "env of init containers too; resourceFieldRef and values untouched",
                json!({"containers": [{"name": "app"}], "initContainers": [{"name": "init", "env": [
                    {"name": "NS", "valueFrom": {"fieldRef": field("metadata.namespace")}},
                    {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
                    {"name": "X", "value": "metadata.namespace"},
                ]}]}),
                json!({"containers": [{"name": "app"}], "initContainers": [{"name": "init", "env": [
                    {"name": "NS", "valueFrom": {"fieldRef": annotation(UPPER_NAMESPACE_ANNOTATION)}},
                    {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
                    {"name": "X", "value": "metadata.namespace"},
                ]}]}),
                vec![UPPER_NAMESPACE_ANNOTATION],
            ),
            (
                "downwardAPI volume: uid, namespace, labels; name and annotations stay",
                volume(json!([
                    item("uid", field("metadata.uid")),
                    item("ns", field("metadata.namespace")),
                    item("name", field("metadata.name")),
                    item("labels", field("metadata.labels")),
                    item("annotations", field("metadata.annotations")),
                ])),
                volume(json!([
                    item("uid", annotation(UPPER_UID_ANNOTATION)),
                    item("ns", annotation(UPPER_NAMESPACE_ANNOTATION)),
                    item("name", field("metadata.name")),
                    item("labels", annotation(UPPER_LABELS_ANNOTATION)),
                    item("annotations", field("metadata.annotations")),
                ])),
                vec![UPPER_NAMESPACE_ANNOTATION, UPPER_LABELS_ANNOTATION],
            ),
            (
                "projected downwardAPI source, beside a ConfigMap source",
                json!({"containers": [{"name": "app"}], "volumes": [{"name": "all", "projected": {"sources": [
                    {"configMap": {"name": "cm"}},
                    {"downwardAPI": {"items": [item("ns", field("metadata.namespace"))]}},
                ]}}]}),
                json!({"containers": [{"name": "app"}], "volumes": [{"name": "all", "projected": {"sources": [
                    {"configMap": {"name": "cm"}},
                    {"downwardAPI": {"items": [item("ns", annotation(UPPER_NAMESPACE_ANNOTATION))]}},
                ]}}]}),
                vec![UPPER_NAMESPACE_ANNOTATION],
            ),
            (
                "ephemeral containers are left to literal_upper_fields",
                json!({"containers": [{"name": "app"}], "ephemeralContainers": [{"name": "debug", "env": [
                    {"name": "NS", "valueFrom": {"fieldRef": field("metadata.namespace")}}]}]}),
                json!({"containers": [{"name": "app"}], "ephemeralContainers": [{"name": "debug", "env": [
                    {"name": "NS", "valueFrom": {"fieldRef": field("metadata.namespace")}}]}]}),
                vec![],
            ),
        ];
        for (name, upper, lower, keys) in cases {
            let mut got = spec(upper);
            let asked = present_upper_fields(&mut got);
            assert_eq!(got, spec(lower), "{name}");
            assert_eq!(asked, keys.into_iter().collect(), "{name}");
        }
    }

    #[test]
    fn upper_values_and_literals() {
        let upper: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "shop", "uid": "upper-uid",
                         "labels": {"app": "web", "tier": "front"}},
            "spec": {"nodeName": "vk-node", "containers": [{"name": "app"}]},
        }))
        .unwrap();
        let cases = [
            (UPPER_NAMESPACE_ANNOTATION, Some("shop")),
            (UPPER_NODE_NAME_ANNOTATION, Some("vk-node")),
            (UPPER_LABELS_ANNOTATION, Some("app=\"web\"\ntier=\"front\"")),
            ("other", None),
        ];
        for (key, want) in cases {
            assert_eq!(upper_value(key, &upper).as_deref(), want, "{key}");
        }
        let unbound = Pod::default();
        assert_eq!(upper_value(UPPER_NODE_NAME_ANNOTATION, &unbound), None);
        assert_eq!(
            upper_value(UPPER_LABELS_ANNOTATION, &unbound).as_deref(),
            Some("")
        );

        let var = |name: &str, f: Value| json!({"name": name, "valueFrom": {"fieldRef": f}});
        let literal = |name: &str, value: &str| json!({"name": name, "value": value});
        let mut env: Option<Vec<EnvVar>> = serde_json::from_value(json!([
            var("UID", field("metadata.uid")),
            var("NS", field("metadata.namespace")),
            var("NODE", field("spec.nodeName")),
            var("NAME", field("metadata.name")),
            var("IP", field("status.podIP")),
            literal("PLAIN", "x"),
        ]))
        .unwrap();
        literal_upper_fields(&mut env, &upper);
        let want: Option<Vec<EnvVar>> = serde_json::from_value(json!([
            literal("UID", "upper-uid"),
            literal("NS", "shop"),
            literal("NODE", "vk-node"),
            var("NAME", field("metadata.name")),
            var("IP", field("status.podIP")),
            literal("PLAIN", "x"),
        ]))
        .unwrap();
        assert_eq!(env, want);
    }

    #[test]
    fn formats_maps_as_the_kubelet_does() {
        // (case, map, what fieldpath.FormatMap writes)
        type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, &'a str);
        let cases: Vec<Case> = vec![
            ("empty", vec![], ""),
            ("one", vec![("app", "web")], "app=\"web\""),
            (
                "sorted by key, one a line",
                vec![("z", "1"), ("a.example.com/x", "v-1_2.3"), ("m", "")],
                "a.example.com/x=\"v-1_2.3\"\nm=\"\"\nz=\"1\"",
            ),
            (
                "Go's escapes",
                vec![("k", "a\"b\\c\nd\te\u{1}f\u{7f} g")],
                "k=\"a\\\"b\\\\c\\nd\\te\\x01f\\x7f g\"",
            ),
            (
                "printable non-ASCII as is, other spaces escaped",
                vec![("k", "é日\u{a0}\u{2028}")],
                "k=\"é日\\u00a0\\u2028\"",
            ),
        ];
        for (name, pairs, want) in cases {
            let map = pairs
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
            assert_eq!(format_map(&map), want, "{name}");
        }
    }
}
