//! Drain-style shutdown shared by tensile's binaries.

use tokio_util::sync::CancellationToken;

/// First SIGTERM/SIGINT cancels `shutdown`: the process drains (stops watching or
/// accepting, finishes work in flight). A second one exits at once (status 130).
pub async fn on_signals(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutting down (signal again to exit at once)");
    shutdown.cancel();
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    std::process::exit(130);
}
