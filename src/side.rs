//! Which of the two clusters an object, a client or an error belongs to.

use std::fmt;

/// Which cluster a client, an error or a log line is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The cluster users talk to, where the virtual node is registered.
    Upper,
    /// The cluster the pods really run in.
    Lower,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Upper => "upper",
            Self::Lower => "lower",
        })
    }
}
