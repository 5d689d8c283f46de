//! The workspace budget's decisions, from plain data: the plan's share of the budget beside
//! the cuBLAS workspace ([`plan_budget`]), the cap of a forward-only call's workspace
//! ([`forward_workspace_cap`]) and the sizes that fit a forward-only call in it (the fused
//! WGMMA forward's row groups, the row chunks, the class tiles). `schedule.rs` takes the
//! paths, `workspace.rs` counts the bytes.

use super::*;

/// The bytes of a workspace budget of `budget` bytes that a plan may fill: the budget less the
/// cuBLAS workspace the engine holds ([`CUBLAS_WORKSPACE_BYTES`]), so that a call's workspace
/// with it stays within the budget. The backend plans with it (`cce_core::Plan::new` with
/// `workspace_budget_bytes` set to it); so does a caller of the engine that wants its plans.
pub fn plan_budget(budget: u64) -> u64 {
    budget.saturating_sub(CUBLAS_WORKSPACE_BYTES as u64)
}

/// The most workspace a forward-only call takes (the engine's buffers, without the cuBLAS
/// workspace): [`FORWARD_WORKSPACE_CAP`], or the plan's share of `budget` bytes
/// ([`plan_budget`]) where that is smaller.
pub(crate) fn forward_workspace_cap(budget: u64) -> u64 {
    FORWARD_WORKSPACE_CAP.min(plan_budget(budget))
}

/// A plan's `ResourceLimit` for the workspace (planned within [`plan_budget`]) as one against
/// the whole `budget`: the cuBLAS workspace added to what was asked. Other errors unchanged.
pub(crate) fn over_budget(e: CceError, budget: u64) -> CceError {
    match e {
        CceError::ResourceLimit {
            resource,
            requested,
            max,
        } if max == plan_budget(budget) && resource.starts_with("workspace bytes") => {
            CceError::ResourceLimit {
                resource: format!(
                    "{resource}, with the {CUBLAS_WORKSPACE_BYTES} B cuBLAS workspace beside it"
                ),
                requested: requested.saturating_add(CUBLAS_WORKSPACE_BYTES as u64),
                max: budget,
            }
        }
        other => other,
    }
}

/// The size of the fewest even pieces of `total` of at most `most` each: `total` when it
/// fits, else `⌈total / pieces⌉` rounded up to a multiple of `unit` (`most` a multiple of
/// `unit`, so the pieces stay within it; the last may be shorter). 0 when `most` is 0.
pub(crate) fn even_split(total: usize, most: usize, unit: usize) -> usize {
    if total <= most {
        return total;
    }
    if most == 0 {
        return 0;
    }
    let pieces = total.div_ceil(most);
    (total.div_ceil(pieces).div_ceil(unit.max(1)) * unit.max(1)).min(most)
}

/// Rows per row group of the fused WGMMA forward with `scratch` bytes for its float2 partials
/// (8 bytes per row and 256-class tile of `v` classes): all `n` rows when they fit, else the
/// fewest groups that fit, evenly sized in multiples of 128 rows ([`even_split`]: at
/// `V` = 256000, 64 MiB hold 8388 rows, so 32768 rows run as 4 groups of 8192); 0 when not
/// even 128 rows fit.
pub(crate) fn forward_group_rows(n: usize, v: usize, scratch: usize) -> usize {
    let per_row = (v.div_ceil(WGMMA_BN) * 8).max(1);
    let fit = scratch / per_row;
    let most = if fit >= n {
        n
    } else {
        fit / WGMMA_BM * WGMMA_BM
    };
    even_split(n, most, WGMMA_BM)
}

/// Rows per row chunk of a forward-only call over the row chunks: the plan's `chunk_rows` at
/// most, and at most the rows whose logits (`row_bytes` each) fit `room` bytes, at least 1,
/// evened out over the `n` rows ([`even_split`]).
pub(crate) fn forward_chunk_rows(
    n: usize,
    chunk_rows: usize,
    row_bytes: usize,
    room: usize,
) -> usize {
    let most = chunk_rows.min(room / row_bytes.max(1)).clamp(1, n.max(1));
    even_split(n, most, 1).max(1)
}

/// The class tiles of a forward-only call in `room` bytes of scratch, in tiles of whole `unit`s
/// (rows, classes): [`cce_core::ClassForward::fit`]'s, and where that splits the rows, the
/// fewest row groups of even size ([`even_split`], so that no short group streams `c` again
/// for a few rows) with the most classes that fit beside them (at least `fit`'s). `None` when
/// not even one unit of rows fits.
pub(crate) fn forward_class_tiles(
    n: usize,
    v: usize,
    (unit_rows, unit_classes): (usize, usize),
    room: usize,
) -> Option<cce_core::ClassForward> {
    use cce_core::ClassForward;
    let cf = ClassForward::fit(room, n, v, unit_rows, unit_classes)?;
    if cf.rows >= n {
        return Some(cf);
    }
    let rows = even_split(n, cf.rows, unit_rows);
    // Class units as `fit` takes them: multiples of 8.
    let unit = unit_classes.max(8).div_ceil(8) * 8;
    let state = (n * cce_core::plan::CLASS_FORWARD_STATE_BYTES).div_ceil(256) * 256;
    let k0 = (room.saturating_sub(state) / 2 / (rows * 4)).min(v);
    let mut classes = if k0 == v { v } else { k0 / unit * unit };
    while classes > cf.classes && (ClassForward { rows, classes }).bytes(n) > room {
        classes = if classes == v {
            (v - 1) / unit * unit
        } else {
            classes - unit
        };
    }
    Some(ClassForward {
        rows,
        classes: classes.max(cf.classes),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_only_sizes() {
        assert_eq!(even_split(100, 100, 8), 100);
        assert_eq!(even_split(100, 0, 8), 0);
        assert_eq!(even_split(32768, 8320, 128), 8192);
        assert_eq!(even_split(8193, 8192, 128), 4224);
        assert_eq!(even_split(1000, 300, 1), 250);
        // WGMMA row groups: 64 MiB hold the partials of 8388 rows of V = 256000 (8000 B each).
        assert_eq!(forward_group_rows(32768, 256000, 64 << 20), 8192);
        assert_eq!(forward_group_rows(8192, 256000, 65_536_000), 8192);
        assert_eq!(forward_group_rows(8193, 256000, 65_536_000), 4224);
        assert_eq!(forward_group_rows(100, 256000, 800_000), 100);
        assert_eq!(forward_group_rows(32768, 256000, 127 * 8000), 0);
        // Row chunks: what the room holds (65 rows of 1 MB), the plan's at most, at least one.
        assert_eq!(forward_chunk_rows(32768, 384, 1_024_000, 64 << 20), 65);
        assert_eq!(forward_chunk_rows(12288, 2176, 196_608, 1 << 30), 2048);
        assert_eq!(forward_chunk_rows(10, 384, 1 << 20, 100), 1);
        // Class tiles: all rows when two buffers of them fit; else even row groups (not 8064 +
        // 128 rows) with the most classes beside them.
        let cf = |rows, classes| Some(cce_core::ClassForward { rows, classes });
        assert_eq!(
            forward_class_tiles(1000, 3000, (128, 128), 64 << 20),
            cf(1000, 3000)
        );
        assert_eq!(
            forward_class_tiles(8192, 256000, (128, 128), 64 << 20),
            cf(4096, 1920)
        );
        assert_eq!(
            cce_core::ClassForward::fit(64 << 20, 8192, 256000, 128, 128),
            cf(8064, 1024)
        );
        assert_eq!(forward_class_tiles(1000, 3000, (128, 128), 1000), None);
    }
}
