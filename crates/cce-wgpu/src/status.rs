//! The backward's status words: what its passes found that `Options::check_finite` rejects,
//! written on the device and read back in the one wait the backward already has (with its
//! statistics), instead of reading the saved state or the upstream gradients back first.
//!
//! `STATUS_WORDS` u32 words, `u32::MAX` until a check fails:
//! - words 0 .. 3 (`bwd_prep.wgsl`): the first row (`atomicMin`) whose saved `lse`, saved
//!   `rest_mass`, per-row `d_loss` or `d_lse` the CPU's rule rejects
//!   ([`cce_core::problem::check_saved_finite`], [`cce_core::problem::check_upstream_finite`]);
//! - word 4 (`finalize.wgsl`): 0 when a gradient written is NaN or ±inf (in f32, before the
//!   output dtype's rounding), the CPU backward's overflow check
//!   ([`cce_core::problem::locate_non_finite`]).

/// Words of the status buffer.
pub(crate) const STATUS_WORDS: usize = 5;
/// Bytes of the status buffer.
pub(crate) const STATUS_BYTES: u64 = 4 * STATUS_WORDS as u64;
/// What each of words 0 .. 3 checks, in the order the CPU backward checks them (the first
/// failed check names the error).
pub(crate) const ROW_CHECKS: [&str; 4] = ["lse", "rest_mass", "d_loss", "d_lse"];
/// The word `finalize.wgsl` clears for a non-finite gradient.
const GRAD_WORD: usize = 4;

/// What the status words report, in the CPU backward's order of checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Finding {
    /// Every check passed.
    Clean,
    /// Check `ROW_CHECKS[k]` failed first, at `row` (its first bad row).
    Row {
        /// Index into [`ROW_CHECKS`].
        k: usize,
        /// The row.
        row: usize,
    },
    /// Only a gradient came out NaN or ±inf: a non-finite input, else an overflow.
    Gradient,
}

/// The initial words (every check passed so far).
pub(crate) fn initial() -> [u32; STATUS_WORDS] {
    [u32::MAX; STATUS_WORDS]
}

/// Reads the status words (`STATUS_WORDS` of them).
pub(crate) fn finding(words: &[u32]) -> Finding {
    let row = ROW_CHECKS
        .iter()
        .zip(words)
        .position(|(_, &w)| w != u32::MAX);
    match row {
        Some(k) => Finding::Row {
            k,
            row: words[k] as usize,
        },
        None if words[GRAD_WORD] != u32::MAX => Finding::Gradient,
        None => Finding::Clean,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_failed_check_in_the_cpus_order_names_the_error() {
        let mut w = initial();
        assert_eq!(finding(&w), Finding::Clean);
        w[GRAD_WORD] = 0;
        assert_eq!(finding(&w), Finding::Gradient);
        w[3] = 7;
        assert_eq!(finding(&w), Finding::Row { k: 3, row: 7 });
        w[1] = 9;
        assert_eq!(finding(&w), Finding::Row { k: 1, row: 9 });
        w[0] = 0;
        assert_eq!(finding(&w), Finding::Row { k: 0, row: 0 });
    }
}
