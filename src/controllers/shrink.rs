//! When a table that grew for a burst hands its memory back: the one rule the pod
//! stores, the work queue and the references index follow. Imports nothing.

/// The capacity to shrink a table of `capacity` slots holding `len` entries to: twice
/// what it holds, once it has more than `keep` slots and four times what it holds (so a
/// table that drains and refills a little is not rebuilt each time).
pub fn shrunk_capacity(capacity: usize, len: usize, keep: usize) -> Option<usize> {
    (capacity > keep && capacity > 4 * len).then_some(2 * len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_large_sparse_table_shrinks() {
        let cases = [
            ("small, empty", 256, 0, 256, None),
            ("large, empty", 16_384, 0, 256, Some(0)),
            ("large, a quarter full", 16_384, 4_096, 256, None),
            (
                "large, less than a quarter",
                16_384,
                4_095,
                256,
                Some(8_190),
            ),
            ("under its keep", 1_024, 10, 1_024, None),
        ];
        for (name, capacity, len, keep, want) in cases {
            assert_eq!(shrunk_capacity(capacity, len, keep), want, "{name}");
        }
    }
}
