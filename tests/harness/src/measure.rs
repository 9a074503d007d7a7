//! What the benchmarks measure about processes: percentiles, memory and CPU seconds from
//! `/proc`, CPU by component of a cluster pair.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Result;

use crate::{ClusterPair, VirtualNode};

/// The `p`th percentile (0–100, nearest rank) of `sorted`; zero when empty.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A reader of the `kB` fields of `/proc/<pid>/status` (0 for a field it lacks).
fn status_kib(pid: u32) -> Result<impl Fn(&str) -> u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    Ok(move |key: &str| -> u64 {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    })
}

/// Resident and peak memory (bytes) and CPU seconds of a process.
pub fn footprint(pid: u32) -> Result<(u64, u64, f64)> {
    let kib = status_kib(pid)?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let after = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .unwrap_or_default();
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 = fields.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
        + fields.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    // USER_HZ, the unit of utime/stime in /proc, is 100 on Linux whatever the kernel's HZ.
    let hz = 100.0;
    Ok((
        kib("VmRSS:") * 1024,
        kib("VmHWM:") * 1024,
        ticks as f64 / hz,
    ))
}

/// Resident memory (bytes) of a process split by what backs it: anonymous (heap, stacks)
/// and file-backed (the binary's code and other mapped files).
pub fn resident_split(pid: u32) -> Result<(u64, u64)> {
    let kib = status_kib(pid)?;
    Ok((kib("RssAnon:") * 1024, kib("RssFile:") * 1024))
}

/// Waits until the resident memory of `pid` stops falling (by at most `SETTLED` over
/// the last five one-second samples), at least five and at most thirty seconds; how long
/// it waited. The allocator returns what a burst freed over seconds (jemalloc's decay),
/// so a sample taken at a fixed moment lands anywhere on that curve.
pub async fn settle_resident(pid: u32) -> Result<Duration> {
    const SETTLED: u64 = 256 << 10;
    let started = std::time::Instant::now();
    let mut samples: Vec<u64> = Vec::new();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        samples.push(footprint(pid)?.0);
        let waited = started.elapsed();
        let settled = match samples.as_slice() {
            [.., before, _, _, _, now] => before.saturating_sub(*now) <= SETTLED,
            _ => false,
        };
        if settled || waited >= Duration::from_secs(30) {
            return Ok(waited);
        }
    }
}

/// The least-squares slope of `y` over `x`: e.g. the bytes each further mirrored pod
/// costs, fitted over the footprint sizes. `None` with fewer than two distinct `x`.
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    let (mean_x, mean_y) = (
        points.iter().map(|p| p.0).sum::<f64>() / n,
        points.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let spread: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
    (spread > 0.0).then(|| {
        points
            .iter()
            .map(|p| (p.0 - mean_x) * (p.1 - mean_y))
            .sum::<f64>()
            / spread
    })
}

/// CPU seconds so far of every process of the pair, of virtual-node and of this process
/// (named `me`), by name.
pub fn cpu_by_component(pair: &ClusterPair, vn: &VirtualNode, me: &str) -> BTreeMap<String, f64> {
    let mut pids: Vec<(String, u32)> = pair
        .upper
        .components()
        .into_iter()
        .chain(pair.lower.components())
        .map(|(name, pid, _)| (name, pid))
        .collect();
    pids.push(("virtual-node".into(), vn.pid()));
    pids.push((me.to_owned(), std::process::id()));
    pids.into_iter()
        .filter_map(|(name, pid)| Some((name, footprint(pid).ok()?.2)))
        .collect()
}

/// CPU seconds each component used between two samples, largest first.
pub fn cpu_profile(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>) -> String {
    let mut used: Vec<(&String, f64)> = after
        .iter()
        .map(|(name, s)| (name, s - before.get(name).copied().unwrap_or(0.0)))
        .filter(|(_, s)| *s >= 0.05)
        .collect();
    used.sort_by(|a, b| b.1.total_cmp(&a.1));
    let total: f64 = used.iter().map(|(_, s)| s).sum();
    let parts: Vec<String> = used.iter().map(|(n, s)| format!("{n} {s:.1}")).collect();
    format!("{total:.1} s: {}", parts.join(", "))
}

/// virtual-node's metrics, by series (`name{labels}` → value), from its endpoint on
/// `127.0.0.1:port`.
pub async fn scrape(port: u16) -> Result<BTreeMap<String, f64>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await?;
    let mut body = String::new();
    stream.read_to_string(&mut body).await?;
    Ok(body
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(k, v)| Some((k.to_owned(), v.parse().ok()?)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Points, and the slope fitted through them.
    type SlopeCase = (&'static [(f64, f64)], Option<f64>);

    #[test]
    fn slopes() {
        let cases: [SlopeCase; 4] = [
            (&[], None),
            (&[(1.0, 5.0), (1.0, 7.0)], None),
            (&[(1000.0, 10.0), (3000.0, 30.0)], Some(0.01)),
            (&[(0.0, 1.0), (1.0, 2.0), (2.0, 3.5)], Some(1.25)),
        ];
        for (points, want) in cases {
            let got = slope(points);
            assert_eq!(got.is_some(), want.is_some(), "{points:?}");
            if let (Some(got), Some(want)) = (got, want) {
                assert!((got - want).abs() < 1e-9, "{points:?}: {got}");
            }
        }
    }

    #[test]
    fn nearest_rank_percentiles() {
        let ms = |v: &[u64]| {
            v.iter()
                .map(|&m| Duration::from_millis(m))
                .collect::<Vec<_>>()
        };
        let cases: [(&[u64], f64, u64); 5] = [
            (&[], 50.0, 0),
            (&[7], 99.0, 7),
            (&[1, 2, 3, 4], 50.0, 2),
            (&[1, 2, 3, 4], 99.0, 4),
            (&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90.0, 9),
        ];
        for (values, p, want) in cases {
            assert_eq!(
                percentile(&ms(values), p),
                Duration::from_millis(want),
                "{values:?} p{p}"
            );
        }
    }
}
