//! Waiting for a condition with a deadline, by polling.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};

/// Polls `check` (every 50 ms, backing off to 500 ms) until it returns `Some`, an error
/// that persists past `timeout`, or the deadline. The error names `what` and the last
/// error seen.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let start = Instant::now();
    let mut delay = Duration::from_millis(50);
    loop {
        let last_error = match check().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => None,
            Err(error) => Some(error),
        };
        if start.elapsed() >= timeout {
            match last_error {
                Some(error) => bail!("timed out after {timeout:?} waiting for {what}: {error:#}"),
                None => bail!("timed out after {timeout:?} waiting for {what}"),
            }
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(500));
    }
}
