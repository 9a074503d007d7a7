//! Free loopback ports, chosen at runtime so harnesses can run side by side.

use std::collections::HashSet;
use std::net::{Ipv4Addr, TcpListener, UdpSocket};
use std::sync::Mutex;

use anyhow::{Context, Result, bail};

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

/// The machine's address on its default route: a real kubelet needs a node IP that is not
/// loopback, and pods on a real node reach the host's API servers there. (Connecting a UDP socket sends nothing; it only picks the source address.)
pub fn host_ip() -> Result<Ipv4Addr> {
    let socket = UdpSocket::bind(("0.0.0.0", 0)).context("binding a UDP socket")?;
    socket
        .connect(("192.0.2.255", 9))
        .or_else(|_| socket.connect(("10.255.255.255", 9)))
        .context(
            "finding this machine's non-loopback address (no route out): a real kubelet \
             needs a node IP that is not loopback",
        )?;
    match socket.local_addr()?.ip() {
        std::net::IpAddr::V4(ip) if !ip.is_loopback() && !ip.is_unspecified() => Ok(ip),
        other => bail!(
            "this machine's address on its default route is {other}: a real kubelet needs an \
             IPv4 node IP that is not loopback"
        ),
    }
}
