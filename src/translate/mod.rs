//! Pure translation between upper and lower objects: no client, no async.

pub mod meta;
