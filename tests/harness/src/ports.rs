//! Free loopback ports, chosen at runtime so harnesses can run side by side.

use std::collections::HashSet;
use std::net::TcpListener;
use std::sync::Mutex;

use anyhow::{Context, Result};

static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// A port that is free on 127.0.0.1 now and that this process has not handed out before.
/// (Another process may still take it before it is bound; the window is short.)
pub fn free_port() -> Result<u16> {
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let handed_out = handed_out.get_or_insert_with(HashSet::new);
    loop {
        let port = TcpListener::bind(("127.0.0.1", 0))
            .and_then(|l| l.local_addr())
            .context("binding an ephemeral port on 127.0.0.1")?
            .port();
        if handed_out.insert(port) {
            return Ok(port);
        }
    }
}
