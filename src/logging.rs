//! Logging setup shared by the binaries: a tracing filter, and text or JSON lines.

use std::io::IsTerminal;

use clap::ValueEnum;
use tracing::info;
use tracing_subscriber::EnvFilter;

/// How log lines are written (`--log-format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object a line, the event's fields at the top level, for log collectors.
    Json,
}

/// Installs the global subscriber. A `filter` that is not a valid tracing directive falls
/// back to `info`, so a Go-style level (`--log-level=warning`) never stops a start. Text
/// lines are coloured only on a terminal: a file or a log collector gets them plain.
pub fn init(filter: &str, format: LogFormat) {
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stdout().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .init(),
    }
}

/// Logs, once at start, the flags given that only tensile-kube's command lines use.
pub fn log_ignored_flags(ignored: &[String]) {
    if !ignored.is_empty() {
        info!(
            "accepted for tensile-kube compatibility; ignored: {}",
            ignored.join(" ")
        );
    }
}
