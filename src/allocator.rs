//! The allocator's own account of the heap, for `tensile_allocator_bytes{stat}`: what is
//! allocated (live), what the allocator holds in active pages, and what of its mappings is
//! resident, so that the resident memory can be split into live bytes and the allocator's
//! free pages. virtual-node's allocator is jemalloc (`main.rs`); a process on another
//! allocator (the tests) reads jemalloc's near-empty heap.

use tikv_jemalloc_ctl::{Access, AsName, epoch, stats};

/// How long jemalloc keeps the pages a burst freed before handing them back to the
/// system, in milliseconds (its default: 10 s).
pub const DIRTY_DECAY_MS: isize = 1000;

/// The environment variable through which jemalloc is configured (its prefixed build).
pub const MALLOC_CONF_ENV: &str = "_RJEM_MALLOC_CONF";

/// Makes jemalloc hand the pages a burst freed back to the system within about
/// [`DIRTY_DECAY_MS`], idle or not: the decay for the arenas there are (the main
/// thread's) and those made later (one per thread, up to `narenas`), and its background
/// threads, which purge on a timer (without them, pages decay only while the process
/// allocates, so after a burst of pod creations an idle virtual-node kept up to 1.3 KB a
/// mirrored pod resident in freed pages). Nothing when [`MALLOC_CONF_ENV`] configures
/// jemalloc. Called first thing in `main`; `Ok(false)`: left as configured. `Err`:
/// jemalloc refused (the process runs with its defaults).
pub fn return_freed_pages_sooner() -> Result<bool, tikv_jemalloc_ctl::Error> {
    if std::env::var_os(MALLOC_CONF_ENV).is_some() {
        return Ok(false);
    }
    b"arenas.dirty_decay_ms\0".name().write(DIRTY_DECAY_MS)?;
    let arenas: u32 = b"arenas.narenas\0".name().read()?;
    for arena in 0..arenas {
        let name = format!("arena.{arena}.dirty_decay_ms\0");
        // An arena not made yet has nothing to decay, and takes the default above.
        let _ = name.as_bytes().name().write(DIRTY_DECAY_MS);
    }
    tikv_jemalloc_ctl::background_thread::write(true)?;
    Ok(true)
}

/// jemalloc's statistics, in bytes, refreshed (`epoch`) at each call: `allocated` (what
/// live allocations asked for, rounded to size classes), `active` (the pages of active
/// extents: allocated plus the free slots of partly used ones), `metadata`, `resident`
/// (the allocator's pages that are resident: active, metadata and dirty free pages),
/// `mapped` and `retained` (virtual memory kept for reuse, not resident). Empty if jemalloc
/// cannot be read.
pub fn jemalloc_stats() -> Vec<(&'static str, u64)> {
    if epoch::advance().is_err() {
        return Vec::new();
    }
    let stats = [
        ("allocated", stats::allocated::read()),
        ("active", stats::active::read()),
        ("metadata", stats::metadata::read()),
        ("resident", stats::resident::read()),
        ("mapped", stats::mapped::read()),
        ("retained", stats::retained::read()),
    ];
    stats
        .into_iter()
        .filter_map(|(stat, read)| Some((stat, u64::try_from(read.ok()?).ok()?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_statistic_is_read() {
        let stats = jemalloc_stats();
        let names: Vec<&str> = stats.iter().map(|(stat, _)| *stat).collect();
        assert_eq!(
            names,
            [
                "allocated",
                "active",
                "metadata",
                "resident",
                "mapped",
                "retained"
            ]
        );
        let get = |name| stats.iter().find(|(stat, _)| *stat == name).map(|s| s.1);
        assert!(get("active") >= get("allocated"));
        assert!(get("mapped") >= get("active"));
    }

    #[test]
    fn freed_pages_are_returned_after_a_second() {
        if std::env::var_os(MALLOC_CONF_ENV).is_some() {
            return;
        }
        assert!(return_freed_pages_sooner().unwrap());
        assert!(tikv_jemalloc_ctl::background_thread::read().unwrap());
        let decay: isize = b"arenas.dirty_decay_ms\0".name().read().unwrap();
        assert_eq!(decay, DIRTY_DECAY_MS);
        let main_arena: isize = b"arena.0.dirty_decay_ms\0".name().read().unwrap();
        assert_eq!(main_arena, DIRTY_DECAY_MS);
    }
}
