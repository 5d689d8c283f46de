//! The CPU backward's visiting orders: a filtered backward visits the classes sorted by their
//! batch-mean logit ([`cce_core::vocab_order`]), so that each row's small entries gather in a
//! suffix of whole tiles it can drop, and the rows by descending count of kept tiles
//! ([`cce_core::tile_budget::rows_by_kept`]), so that a row tile's rows keep about as many. The
//! backward runs on a reordered copy of the problem (rows of `c`, the bias, the targets mapped
//! into the order; rows of `e` and the targets by row) and writes `d_c`, `d_bias` and `d_e`
//! back in class and row order at the end.

use super::Prepared;
use cce_core::vocab_order::{takes_order, OrderFacts, VocabOrder};
use cce_core::PreparedTargets;
use std::borrow::Cow;

/// `[V]` batch-mean logits `ē · c_j + b_j` before softcap, `ē` the mean of the rows of `e` with
/// a target (f64 sums; all rows when none has one).
pub(super) fn mean_logits(p: &Prepared) -> Vec<f32> {
    let (n, d) = (p.problem.n, p.problem.d);
    let valid: Vec<usize> = (0..n).filter(|&i| p.targets.classes[i] >= 0).collect();
    let rows: Vec<usize> = if valid.is_empty() {
        (0..n).collect()
    } else {
        valid
    };
    let mut mean = vec![0.0f64; d];
    for &i in &rows {
        for (m, &x) in mean.iter_mut().zip(&p.e[i * d..(i + 1) * d]) {
            *m += x as f64;
        }
    }
    let scale = 1.0 / rows.len().max(1) as f64;
    mean.iter_mut().for_each(|m| *m *= scale);
    p.c.chunks(d.max(1))
        .take(p.problem.v)
        .enumerate()
        .map(|(j, cj)| {
            let dot: f64 = cj.iter().zip(&mean).map(|(&c, &m)| c as f64 * m).sum();
            let b = p.bias.as_ref().map_or(0.0, |b| b[j] as f64);
            (dot + b) as f32
        })
        .collect()
}

/// The order the backward of `p` takes under `budget_bytes`, or `None`
/// ([`takes_order`]: filter on, more than one class tile, the copy within the budget).
pub(super) fn order_for(p: &Prepared, budget_bytes: u64) -> Option<VocabOrder> {
    let facts = OrderFacts {
        rule: p.plan.filter,
        v: p.problem.v,
        tile_classes: p.plan.tile.classes,
        order_bytes: VocabOrder::copy_bytes(p.problem.v, p.problem.d, p.bias.is_some()),
        plan_bytes: p.plan.workspace_bytes,
        budget_bytes,
    };
    takes_order(facts).then(|| VocabOrder::by_score(&mean_logits(p)))
}

/// `p` with its classes in `order`: row `k` of `c` and entry `k` of the bias are class
/// `order.perm()[k]`'s, each target is its class's position; the plan's reason says so and its
/// workspace counts the copy.
pub(super) fn reordered<'a>(p: Prepared<'a>, order: &VocabOrder) -> Prepared<'a> {
    let d = p.problem.d;
    let perm = order.perm();
    let mut c = Vec::with_capacity(p.c.len());
    for &j in perm {
        c.extend_from_slice(&p.c[j as usize * d..(j as usize + 1) * d]);
    }
    let bias = p
        .bias
        .as_ref()
        .map(|b| Cow::Owned(perm.iter().map(|&j| b[j as usize]).collect()));
    let inv = order.inverse();
    let classes = p
        .targets
        .classes
        .iter()
        .map(|&y| if y >= 0 { inv[y as usize] as i32 } else { y })
        .collect();
    let mut plan = p.plan;
    plan.reason.push_str(
        "; the backward visits the classes by descending batch-mean logit, so that the kept \
         classes share tiles",
    );
    plan.workspace_bytes += VocabOrder::copy_bytes(p.problem.v, d, bias.is_some());
    Prepared {
        problem: p.problem,
        plan,
        targets: PreparedTargets {
            classes,
            n_valid: p.targets.n_valid,
        },
        e: p.e,
        c: Cow::Owned(c),
        bias,
        wide_logits: p.wide_logits,
    }
}

/// `p` with its rows in `rows` (row `k` of the result is row `rows[k]` of `p`: rows of `e` and
/// the targets); the plan's workspace counts the copy of `e`.
pub(super) fn reordered_rows<'a>(p: Prepared<'a>, rows: &[u32]) -> Prepared<'a> {
    let d = p.problem.d;
    let mut e = Vec::with_capacity(p.e.len());
    for &i in rows {
        e.extend_from_slice(&p.e[i as usize * d..(i as usize + 1) * d]);
    }
    let mut plan = p.plan;
    plan.reason.push_str(
        "; the backward visits the rows by descending count of kept tiles, so that a row \
         tile's rows drop about as many",
    );
    plan.workspace_bytes += e.len() as u64 * 4;
    Prepared {
        targets: PreparedTargets {
            classes: gather(&p.targets.classes, rows),
            n_valid: p.targets.n_valid,
        },
        e: Cow::Owned(e),
        problem: p.problem,
        plan,
        c: p.c,
        bias: p.bias,
        wide_logits: p.wide_logits,
    }
}

/// `x` in `order` ([`gather`]), or `x` itself without one.
pub(super) fn in_order<'x, T: Copy>(x: &'x [T], order: Option<&[u32]>) -> Cow<'x, [T]> {
    match order {
        Some(o) => Cow::Owned(gather(x, o)),
        None => Cow::Borrowed(x),
    }
}

/// `[order.len()]`: `x[order[k]]` at `k`.
pub(super) fn gather<T: Copy>(x: &[T], order: &[u32]) -> Vec<T> {
    order.iter().map(|&i| x[i as usize]).collect()
}

/// `x` (`[len, width]`, row `k` belonging to row `perm[k]` of the original order) rewritten in
/// the original order. An empty `x` (a gradient not computed) stays empty.
pub(super) fn restore_rows(x: &mut Vec<f32>, width: usize, perm: &[u32]) {
    if x.is_empty() || width == 0 {
        return;
    }
    let mut out = vec![0.0f32; x.len()];
    for (k, &j) in perm.iter().enumerate() {
        let j = j as usize;
        out[j * width..(j + 1) * width].copy_from_slice(&x[k * width..(k + 1) * width]);
    }
    *x = out;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restore_rows_inverts_the_visiting_order() {
        let order = VocabOrder::by_score(&[0.5, 2.0, -1.0]);
        assert_eq!(order.perm(), &[1, 0, 2]);
        // Rows in visiting order: class 1, class 0, class 2.
        let mut x = vec![10.0, 11.0, 0.0, 1.0, 20.0, 21.0];
        restore_rows(&mut x, 2, order.perm());
        assert_eq!(x, [0.0, 1.0, 10.0, 11.0, 20.0, 21.0]);
        assert_eq!(gather(&[5, 6, 7], order.perm()), [6, 5, 7]);
        let mut empty = Vec::new();
        restore_rows(&mut empty, 2, order.perm());
        assert!(empty.is_empty());
    }
}
