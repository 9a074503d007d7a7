//! tensile-scheduler-extender: kube-scheduler extender for virtual nodes (not built yet; see the issue tracker).

use std::process::ExitCode;

fn main() -> ExitCode {
    eprintln!("tensile-scheduler-extender: not implemented yet");
    ExitCode::FAILURE
}
