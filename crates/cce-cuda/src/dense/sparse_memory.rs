//! What the last sparse backward of a call's shape did, so that the next call of that shape
//! does not pay for a probe that gave way. Pure: no CUDA call.
//!
//! A filtered call's plan tries the sparse backward first ([`cce_core::SparseBackward`]): a
//! probe chunk measures how many entries each row keeps, and rows that keep more than the
//! plan allows give way to the dense passes. On peaked data it pays (0.41x of the 3-GEMM floor
//! at the seed shape); on the rows language models produce it gives way at every bound of
//! interest (thousands of entries per row at `max_dropped_mass` 1e-3, against a limit of
//! `V / 256`: docs/perf-log.md, session 14), and then the filtered call costs more than the
//! exact one: the probe, and split dense where an exact call's budget holds chunked dense
//! (12288 x 576 x 49152 real rows on the H200: 7.14 against 5.28 ms).
//!
//! A training loop calls the same shape every step on data of the same kind. So a backend
//! remembers, per [`SparseKey`], that the last try gave way, and the next
//! [`RETRY_AFTER`] calls of that key are planned as an exact call would be (no probe; chunked
//! dense where it fits, run without skipping anything); the call after them tries again, so data
//! that becomes peaked is noticed. A try that ran to the end forgets the key.

use cce_core::{DType, FilterRule};

/// Calls of a key planned without the sparse backward after a try gave way, before the next
/// try. At one probe per 33 calls its cost (2-35% of a call where it gives way) is under 1.1%.
pub(crate) const RETRY_AFTER: u32 = 32;

/// Keys remembered; the least recently recorded is forgotten past this (a training loop has a
/// few shapes: the last micro-batch, evaluation).
pub(crate) const MAX_KEYS: usize = 64;

/// What decides a call's density besides its data: the shape, the dtype, the bias and softcap,
/// and the filter's threshold and bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct SparseKey {
    n: usize,
    d: usize,
    v: usize,
    dtype: DType,
    has_bias: bool,
    softcap_bits: u32,
    eps_bits: u32,
    delta_bits: u32,
}

impl SparseKey {
    /// The key of a call of `n x d x v` in `dtype` under `filter` (the resolved rule).
    pub fn new(
        (n, d, v): (usize, usize, usize),
        dtype: DType,
        has_bias: bool,
        softcap: Option<f32>,
        filter: &FilterRule,
    ) -> Self {
        Self {
            n,
            d,
            v,
            dtype,
            has_bias,
            softcap_bits: softcap.map_or(0, f32::to_bits),
            eps_bits: filter.eps.to_bits(),
            delta_bits: filter.max_dropped_mass.to_bits(),
        }
    }
}

/// The remembered outcomes: per key, the calls left to plan without the sparse backward.
#[derive(Debug, Default)]
pub(crate) struct SparseMemory {
    /// Oldest record first.
    entries: Vec<(SparseKey, u32)>,
}

impl SparseMemory {
    /// Whether a call of `key` should be planned with the sparse backward, without counting
    /// it (a workspace query).
    pub fn expects_sparse(&self, key: &SparseKey) -> bool {
        !self.entries.iter().any(|(k, left)| k == key && *left > 0)
    }

    /// As [`SparseMemory::expects_sparse`] for a call about to run: a call planned without
    /// the sparse backward counts towards the next try.
    pub fn plan_call(&mut self, key: &SparseKey) -> bool {
        match self.entries.iter_mut().find(|(k, _)| k == key) {
            Some((_, left)) if *left > 0 => {
                *left -= 1;
                false
            }
            _ => true,
        }
    }

    /// A sparse try of `key` ran: `gave_way` when it gave way to the dense passes.
    pub fn record(&mut self, key: SparseKey, gave_way: bool) {
        self.entries.retain(|(k, _)| *k != key);
        if gave_way {
            if self.entries.len() >= MAX_KEYS {
                self.entries.remove(0);
            }
            self.entries.push((key, RETRY_AFTER));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cce_core::Options;

    fn key(n: usize) -> SparseKey {
        let rule = FilterRule::resolve(&Options::default(), DType::BF16);
        SparseKey::new((n, 576, 49152), DType::BF16, false, None, &rule)
    }

    #[test]
    fn a_give_way_skips_the_next_calls_then_tries_again() {
        let mut m = SparseMemory::default();
        let k = key(12288);
        assert!(m.plan_call(&k), "no history: try");
        m.record(k, true);
        for call in 0..RETRY_AFTER {
            assert!(!m.expects_sparse(&k), "call {call}");
            assert!(!m.plan_call(&k), "call {call}");
        }
        assert!(m.expects_sparse(&k));
        assert!(m.plan_call(&k), "the retry");
        // The retry ran to the end (the data became peaked): tried from now on.
        m.record(k, false);
        assert!(m.plan_call(&k) && m.plan_call(&k));
    }

    #[test]
    fn a_query_does_not_count_and_keys_are_apart() {
        let mut m = SparseMemory::default();
        m.record(key(1), true);
        for _ in 0..10 * RETRY_AFTER {
            assert!(!m.expects_sparse(&key(1)));
        }
        assert!(m.plan_call(&key(2)), "another shape keeps its own history");
        let rule = FilterRule::resolve(&Options::default(), DType::BF16);
        let capped = SparseKey::new((1, 576, 49152), DType::BF16, false, Some(30.0), &rule);
        assert!(
            m.expects_sparse(&capped),
            "a softcap changes the data's density"
        );
    }

    #[test]
    fn the_oldest_key_is_forgotten_past_the_bound() {
        let mut m = SparseMemory::default();
        for n in 0..=MAX_KEYS {
            m.record(key(n), true);
        }
        assert!(m.expects_sparse(&key(0)), "the oldest forgotten");
        assert!(!m.expects_sparse(&key(1)) && !m.expects_sparse(&key(MAX_KEYS)));
        assert_eq!(m.entries.len(), MAX_KEYS);
    }
}
