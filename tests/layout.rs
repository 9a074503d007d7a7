//! The library's modules form no import cycle: each `use crate::…` / `super::…` path in a
//! module's non-test code is an edge to the module it names, and the graph must be acyclic
//! (a module naming its own ancestor, as `super::Context`, is not counted: the ancestor
//! declares it). A cycle is named, module by module.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed unwrap is a failed test

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every library module's path (`controllers::pod`) and file; binaries are left out.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    fn walk(dir: &Path, found: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, found);
            } else if path.extension().is_some_and(|e| e == "rs") {
                found.push(path);
            }
        }
    }
    let mut files = Vec::new();
    walk(src, &mut files);
    files
        .into_iter()
        .filter_map(|file| {
            let relative = file.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> = relative
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if parts.first().is_some_and(|p| p == "bin") || parts == ["main"] {
                return None;
            }
            if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
                parts.pop();
            }
            Some((parts.join("::"), file))
        })
        .collect()
}

/// The code of a module before its tests, without line comments.
fn code(file: &Path) -> String {
    let text = std::fs::read_to_string(file).unwrap();
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    text.lines()
        .map(|line| line.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The paths in `code` that start with `crate`, `super` or `self`, braces expanded one
/// level (`crate::a::{b, c::d}` is `crate::a::b` and `crate::a::c::d`).
fn paths(code: &str) -> Vec<String> {
    let bytes = code.as_bytes();
    let is_ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut found = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let starts = ["crate::", "super::", "self::"]
            .iter()
            .any(|root| bytes[i..].starts_with(root.as_bytes()))
            && (i == 0 || !is_ident(bytes[i - 1]));
        if !starts {
            i += 1;
            continue;
        }
        let mut end = i;
        while end < bytes.len() && (is_ident(bytes[end]) || bytes[end] == b':') {
            end += 1;
        }
        let prefix = code[i..end].trim_end_matches(':').to_owned();
        if code[end..].starts_with('{') {
            let close = code[end..].find('}').map_or(bytes.len(), |c| end + c);
            for item in code[end + 1..close].split(',') {
                let item: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                if !item.is_empty() {
                    found.push(format!("{prefix}::{item}"));
                }
            }
            i = close;
        } else {
            found.push(prefix);
            i = end;
        }
    }
    found
}

/// The module `path` names, seen from module `from`: its longest prefix that is a module.
fn resolve(path: &str, from: &str, modules: &BTreeMap<String, PathBuf>) -> Option<String> {
    let mut segments: Vec<&str> = path.split("::").collect();
    let mut base: Vec<&str> = if from.is_empty() {
        Vec::new()
    } else {
        from.split("::").collect()
    };
    match segments.first().copied() {
        Some("crate") => {
            segments.remove(0);
        }
        Some("self") => {
            segments.remove(0);
            base.extend(segments);
            segments = base;
        }
        Some("super") => {
            while segments.first() == Some(&"super") {
                segments.remove(0);
                base.pop();
            }
            base.extend(segments);
            segments = base;
        }
        _ => return None,
    }
    (1..=segments.len())
        .rev()
        .map(|n| segments[..n].join("::"))
        .find(|m| modules.contains_key(m))
}

/// The import graph: module → the modules it names (its ancestors and itself left out).
fn graph(modules: &BTreeMap<String, PathBuf>) -> BTreeMap<String, BTreeSet<String>> {
    modules
        .iter()
        .map(|(module, file)| {
            let named = paths(&code(file))
                .iter()
                .filter_map(|path| resolve(path, module, modules))
                .filter(|target| target != module && !module.starts_with(&format!("{target}::")))
                .collect();
            (module.clone(), named)
        })
        .collect()
}

/// One cycle of `graph`, if it has any, as the modules along it.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|n| n == node) {
            let mut found = stack[at..].to_vec();
            found.push(node.to_owned());
            return Some(found);
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, graph, done, stack) {
                return Some(found);
            }
        }
        stack.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut done, &mut Vec::new()))
}

#[test]
fn paths_are_read_as_written() {
    let cases: [(&str, &[&str]); 4] = [
        ("use crate::cli::Args;", &["crate::cli::Args"]),
        (
            "use crate::translate::{meta::Owner, pod};",
            &["crate::translate::meta::Owner", "crate::translate::pod"],
        ),
        (
            "use super::{Context, Error};",
            &["super::Context", "super::Error"],
        ),
        ("let x = my_crate::a; self::b::c();", &["self::b::c"]),
    ];
    for (code, want) in cases {
        assert_eq!(paths(code), want, "{code}");
    }
}

#[test]
fn a_cycle_is_found_and_named() {
    let edges = |pairs: &[(&str, &str)]| {
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (from, to) in pairs {
            graph
                .entry((*from).to_owned())
                .or_default()
                .insert((*to).to_owned());
            graph.entry((*to).to_owned()).or_default();
        }
        graph
    };
    assert_eq!(cycle(&edges(&[("a", "b"), ("b", "c")])), None);
    assert_eq!(
        cycle(&edges(&[("a", "b"), ("b", "c"), ("c", "a")])),
        Some(vec!["a".into(), "b".into(), "c".into(), "a".into()])
    );
}

#[test]
fn the_library_has_no_import_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules = modules(&src);
    assert!(
        modules.contains_key("controllers::pod") && modules.contains_key("cli"),
        "the module walk found {:?}",
        modules.keys()
    );
    let graph = graph(&modules);
    if let Some(cycle) = cycle(&graph) {
        panic!("import cycle: {}", cycle.join(" -> "));
    }
}
