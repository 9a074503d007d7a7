//! virtual-node: joins the lower cluster to the upper one as a virtual node (being built).

use std::process::ExitCode;

fn main() -> ExitCode {
    eprintln!("virtual-node: not implemented yet");
    ExitCode::FAILURE
}
