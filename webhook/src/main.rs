//! tensile-webhook: mutating admission webhook for the upper cluster (not built yet; see the issue tracker).

use std::process::ExitCode;

fn main() -> ExitCode {
    eprintln!("tensile-webhook: not implemented yet");
    ExitCode::FAILURE
}
