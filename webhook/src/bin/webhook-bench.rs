//! webhook-bench: see the next commit.

fn main() {}
