//! The shipped Grafana dashboard against what the binaries export: the metric names its
//! PromQL queries read, and the metric names a `/metrics` answer exposes.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

/// `deploy/monitoring/grafana-dashboard.json`, from the repository root `repo`.
pub fn path(repo: &Path) -> PathBuf {
    repo.join("deploy/monitoring/grafana-dashboard.json")
}

/// Every `expr` of the dashboard at `path` (in panels, rows, templating), in order.
pub fn exprs(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    let json: Value = serde_json::from_str(&text).with_context(|| format!("{}", path.display()))?;
    let mut found = Vec::new();
    collect_exprs(&json, &mut found);
    Ok(found)
}

fn collect_exprs(value: &Value, found: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("expr", Value::String(expr)) => found.push(expr.clone()),
                    _ => collect_exprs(value, found),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| collect_exprs(v, found)),
        _ => {}
    }
}

/// PromQL words that are followed by a parenthesised label list, not an expression.
const LABEL_LIST_KEYWORDS: [&str; 6] = [
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// PromQL words that are operators, literals or aggregations (which may come before their
/// `by (..)` rather than their `(`), never metric names.
const KEYWORDS: [&str; 22] = [
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "atan2",
    "inf",
    "nan",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
];

/// The metric names a PromQL expression selects: the identifiers that are neither a
/// function or aggregation (followed by `(`), nor a keyword, nor inside a label matcher
/// `{..}`, a range `[..]`, a string or a label list (`by (..)`), nor a Grafana variable
/// (`$__rate_interval`). A name given only as `{__name__="..."}` is not seen.
pub fn metric_names(expr: &str) -> BTreeSet<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => i = skip_string(&chars, i),
            '{' => i = skip_group(&chars, i, '{', '}'),
            '[' => i = skip_group(&chars, i, '[', ']'),
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '$' => {
                i += 1;
                if chars.get(i) == Some(&'{') {
                    i = skip_group(&chars, i, '{', '}');
                } else {
                    i = skip_identifier(&chars, i);
                }
            }
            c if c.is_ascii_digit() || c == '.' => {
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let end = skip_identifier(&chars, i);
                let word: String = chars[i..end].iter().collect();
                let mut next = end;
                while next < chars.len() && chars[next].is_whitespace() {
                    next += 1;
                }
                let opens = chars.get(next) == Some(&'(');
                let lower = word.to_ascii_lowercase();
                if LABEL_LIST_KEYWORDS.contains(&lower.as_str()) {
                    i = if opens {
                        skip_group(&chars, next, '(', ')')
                    } else {
                        end
                    };
                    continue;
                }
                if !opens && !KEYWORDS.contains(&lower.as_str()) {
                    names.insert(word);
                }
                i = end;
            }
            _ => i += 1,
        }
    }
    names
}

/// The index after the identifier starting at `i`.
fn skip_identifier(chars: &[char], mut i: usize) -> usize {
    while i < chars.len()
        && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
    {
        i += 1;
    }
    i
}

/// The index after the string literal opening at `i` (backslash escapes, except in
/// backquoted raw strings).
fn skip_string(chars: &[char], i: usize) -> usize {
    let quote = chars[i];
    let mut j = i + 1;
    while j < chars.len() {
        match chars[j] {
            '\\' if quote != '`' => j += 2,
            c if c == quote => return j + 1,
            _ => j += 1,
        }
    }
    j
}

/// The index after the group opening with `open` at `i` and closing with its matching
/// `close`, strings inside skipped whole.
fn skip_group(chars: &[char], i: usize, open: char, close: char) -> usize {
    let mut depth = 0;
    let mut j = i;
    while j < chars.len() {
        match chars[j] {
            '"' | '\'' | '`' => {
                j = skip_string(chars, j);
                continue;
            }
            c if c == open => depth += 1,
            c if c == close => {
                depth -= 1;
                if depth == 0 {
                    return j + 1;
                }
            }
            _ => {}
        }
        j += 1;
    }
    j
}

/// `name` without a histogram series suffix (`_bucket`, `_sum`, `_count`), so a query on a
/// histogram's series and the histogram itself compare equal.
pub fn histogram_family(name: &str) -> &str {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))
        .unwrap_or(name)
}

/// The names a Prometheus or OpenMetrics text exposition makes queryable, histogram
/// suffixes stripped: each sample's name, and each declared family (`# TYPE`) even with no
/// sample yet (a labelled family before its first child), a counter as `<name>_total`.
pub fn exported_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(declared) = line.strip_prefix("# TYPE ") {
            let mut words = declared.split_whitespace();
            if let (Some(name), Some(kind)) = (words.next(), words.next()) {
                let name = match kind {
                    "counter" if !name.ends_with("_total") => format!("{name}_total"),
                    _ => name.to_owned(),
                };
                names.insert(histogram_family(&name).to_owned());
            }
        } else if !line.starts_with('#') {
            let name: String = line
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            if !name.is_empty() {
                names.insert(histogram_family(&name).to_owned());
            }
        }
    }
    names
}

/// The metric names `exprs` read (histogram suffixes stripped) that `exported` lacks,
/// keeping only those `belongs` says the checked binary should export and leaving out
/// `pending` (names another change adds).
pub fn missing(
    exprs: &[String],
    exported: &BTreeSet<String>,
    belongs: impl Fn(&str) -> bool,
    pending: &[&str],
) -> BTreeSet<String> {
    exprs
        .iter()
        .flat_map(|e| metric_names(e))
        .map(|name| histogram_family(&name).to_owned())
        .filter(|name| belongs(name) && !pending.contains(&name.as_str()))
        .filter(|name| !exported.contains(name))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_names_of_promql() {
        let cases: [(&str, &[&str]); 13] = [
            ("up", &["up"]),
            ("tensile_leader", &["tensile_leader"]),
            ("max by (pod, lease) (tensile_leader)", &["tensile_leader"]),
            (
                "sum(rate(foo_total{code!~\"2..\", verb=\"get\"}[$__rate_interval])) by (code)",
                &["foo_total"],
            ),
            (
                "histogram_quantile(0.99, sum by (le, controller) (rate(x_seconds_bucket[5m])))",
                &["x_seconds_bucket"],
            ),
            ("a / on(pod) group_left(node) b", &["a", "b"]),
            ("count without (le) (topk by (x) (3, a))", &["a"]),
            (
                "a and ignoring (x) b unless c or bool d",
                &["a", "b", "c", "d"],
            ),
            ("rate(a[5m] offset 1h) > 0.5e-3", &["a"]),
            (
                "label_replace(a, \"dst\", \"$1\", \"src\", \"(b_total)\")",
                &["a"],
            ),
            ("sum(a{l='}'}) without (le)", &["a"]),
            ("ns:rule:rate5m * ${factor} + $x", &["ns:rule:rate5m"]),
            ("vector(1) # no_metric here", &[]),
        ];
        for (expr, want) in cases {
            let want: BTreeSet<String> = want.iter().map(ToString::to_string).collect();
            assert_eq!(metric_names(expr), want, "{expr}");
        }
    }

    #[test]
    fn exported_names_of_an_exposition() {
        let text = "# HELP c_total C.\n# TYPE c counter\nc_total 3\n\
                    # TYPE empty counter\n\
                    # TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 0.1\nh_count 1\n\
                    # TYPE g gauge\ng{kind=\"pods\"} 2\n\
                    # TYPE family_without_children gauge\n# EOF\n";
        let want = [
            "c_total",
            "empty_total",
            "h",
            "g",
            "family_without_children",
        ];
        let want: BTreeSet<String> = want.iter().map(ToString::to_string).collect();
        assert_eq!(exported_names(text), want);
    }

    #[test]
    fn missing_names_are_those_neither_exported_nor_pending() {
        let exported = exported_names("# TYPE h histogram\nh_count 1\nc_total 1\n");
        let exprs: Vec<String> = [
            "histogram_quantile(0.5, rate(h_bucket[1m]))",
            "rate(c_total[1m]) + rate(gone_total[1m])",
            "pending_gauge + other_binary_total",
        ]
        .map(String::from)
        .into();
        let ours = |name: &str| !name.starts_with("other_");
        let missing = missing(&exprs, &exported, ours, &["pending_gauge"]);
        assert_eq!(missing, BTreeSet::from(["gone_total".to_owned()]));
    }
}
