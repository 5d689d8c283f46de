//! An in-process [`Communicator`]: `k` ranks as threads of one process, for tests and for
//! simulating a vocabulary-parallel group on the CPU.
//!
//! A collective is a rendezvous under one mutex: each rank deposits its buffer, the last to
//! arrive combines them (sums in rank order, so every run gives the same bits) and publishes
//! the result, and the others copy it out. A rank whose `ThreadComm` is dropped (it returned,
//! or panicked) leaves the group: a rank waiting in a collective, or entering one later, gets
//! `VocabParallelError::PeerLost` instead of waiting forever.

use cce_core::vocab_parallel::{Communicator, ReduceOp, VocabParallelError};
use cce_core::Result;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// One rank of an in-process group ([`ThreadComm::group`]). Send it to its thread.
#[derive(Debug)]
pub struct ThreadComm {
    rank: usize,
    size: usize,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    turn: Condvar,
}

/// What a rank deposits.
#[derive(Clone, Debug, PartialEq)]
enum Data {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// Which collective a deposit is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Reduce(ReduceOp),
    Gather,
}

#[derive(Debug)]
struct State {
    /// Completed collectives.
    generation: u64,
    slots: Vec<Option<(Kind, Data)>>,
    arrived: usize,
    /// The result of the last completed collective.
    result: Option<Arc<std::result::Result<Data, VocabParallelError>>>,
    /// The first rank that left the group.
    left: Option<usize>,
}

impl ThreadComm {
    /// A group of `size` ranks, rank `r` at index `r` (empty for `size == 0`).
    pub fn group(size: usize) -> Vec<ThreadComm> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                generation: 0,
                slots: vec![None; size],
                arrived: 0,
                result: None,
                left: None,
            }),
            turn: Condvar::new(),
        });
        (0..size)
            .map(|rank| ThreadComm {
                rank,
                size,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Run `f` on `size` ranks, one scoped thread each, and return their results in rank
    /// order. Each rank's communicator is dropped when its `f` returns.
    pub fn run<R: Send>(size: usize, f: impl Fn(&ThreadComm) -> R + Sync) -> Vec<R> {
        let f = &f;
        std::thread::scope(|s| {
            let handles: Vec<_> = ThreadComm::group(size)
                .into_iter()
                .map(|comm| s.spawn(move || f(&comm)))
                .collect();
            handles
                .into_iter()
                .map(|h| match h.join() {
                    Ok(r) => r,
                    Err(panic) => std::panic::resume_unwind(panic),
                })
                .collect()
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The lock is never held across user code, so a poisoned state is still consistent.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Deposit `data` for collective `kind`, wait for every rank, return the combined result.
    fn collective(
        &self,
        kind: Kind,
        data: Data,
    ) -> Result<Arc<std::result::Result<Data, VocabParallelError>>> {
        let mut st = self.lock();
        if let Some(rank) = st.left {
            return Err(VocabParallelError::PeerLost { rank }.into());
        }
        let generation = st.generation;
        st.slots[self.rank] = Some((kind, data));
        st.arrived += 1;
        if st.arrived == self.size {
            let deposits: Vec<(Kind, Data)> = st
                .slots
                .iter_mut()
                .map(|s| s.take().expect("every rank deposited"))
                .collect();
            st.result = Some(Arc::new(combine(&deposits)));
            st.arrived = 0;
            st.generation += 1;
            self.shared.turn.notify_all();
        } else {
            while st.generation == generation {
                if let Some(rank) = st.left {
                    return Err(VocabParallelError::PeerLost { rank }.into());
                }
                st = self
                    .shared
                    .turn
                    .wait(st)
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
            }
        }
        Ok(st
            .result
            .clone()
            .expect("a completed collective has a result"))
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        let mut st = self.lock();
        st.left.get_or_insert(self.rank);
        self.shared.turn.notify_all();
    }
}

/// The result of a collective from the deposits of every rank (rank order).
fn combine(deposits: &[(Kind, Data)]) -> std::result::Result<Data, VocabParallelError> {
    let (kind, first) = &deposits[0];
    for (rank, (k, d)) in deposits.iter().enumerate() {
        let same_type = std::mem::discriminant(d) == std::mem::discriminant(first);
        if k != kind || !same_type || len(d) != len(first) {
            return Err(VocabParallelError::CollectiveMismatch {
                what: format!(
                    "rank {rank} called {k:?} on {} {} values, rank 0 {kind:?} on {} {} values",
                    len(d),
                    type_name(d),
                    len(first),
                    type_name(first)
                ),
            });
        }
    }
    Ok(match (kind, first) {
        (Kind::Gather, Data::F32(_)) => Data::F32(
            deposits
                .iter()
                .flat_map(|(_, d)| as_f32(d).iter().copied())
                .collect(),
        ),
        (Kind::Gather, Data::F64(_)) => Data::F64(
            deposits
                .iter()
                .flat_map(|(_, d)| as_f64(d).iter().copied())
                .collect(),
        ),
        (Kind::Reduce(op), Data::F32(x)) => {
            let mut acc = x.clone();
            for (_, d) in &deposits[1..] {
                reduce_into(&mut acc, as_f32(d), *op);
            }
            Data::F32(acc)
        }
        (Kind::Reduce(op), Data::F64(x)) => {
            let mut acc = x.clone();
            for (_, d) in &deposits[1..] {
                reduce_into(&mut acc, as_f64(d), *op);
            }
            Data::F64(acc)
        }
    })
}

fn reduce_into<T: Copy + std::ops::Add<Output = T> + PartialOrd>(
    acc: &mut [T],
    x: &[T],
    op: ReduceOp,
) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a = match op {
            ReduceOp::Sum => *a + b,
            ReduceOp::Max => {
                if b > *a {
                    b
                } else {
                    *a
                }
            }
        };
    }
}

fn len(d: &Data) -> usize {
    match d {
        Data::F32(v) => v.len(),
        Data::F64(v) => v.len(),
    }
}

fn type_name(d: &Data) -> &'static str {
    match d {
        Data::F32(_) => "f32",
        Data::F64(_) => "f64",
    }
}

fn as_f32(d: &Data) -> &[f32] {
    match d {
        Data::F32(v) => v,
        Data::F64(_) => &[],
    }
}

fn as_f64(d: &Data) -> &[f64] {
    match d {
        Data::F64(v) => v,
        Data::F32(_) => &[],
    }
}

/// Copy a collective's result into `out`, or return its error.
fn take<T: Copy>(
    result: &std::result::Result<Data, VocabParallelError>,
    pick: impl Fn(&Data) -> &[T],
    out: &mut [T],
) -> Result<()> {
    match result {
        Ok(d) => {
            out.copy_from_slice(pick(d));
            Ok(())
        }
        Err(e) => Err(e.clone().into()),
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        let r = self.collective(Kind::Reduce(op), Data::F32(buf.to_vec()))?;
        take(&r, as_f32, buf)
    }

    fn all_reduce_f64(&self, buf: &mut [f64], op: ReduceOp) -> Result<()> {
        let r = self.collective(Kind::Reduce(op), Data::F64(buf.to_vec()))?;
        take(&r, as_f64, buf)
    }

    fn all_gather_f32(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        check_gather_len(send.len(), recv.len(), self.size)?;
        let r = self.collective(Kind::Gather, Data::F32(send.to_vec()))?;
        take(&r, as_f32, recv)
    }

    fn all_gather_f64(&self, send: &[f64], recv: &mut [f64]) -> Result<()> {
        check_gather_len(send.len(), recv.len(), self.size)?;
        let r = self.collective(Kind::Gather, Data::F64(send.to_vec()))?;
        take(&r, as_f64, recv)
    }
}

/// `ShapeMismatch` unless `recv` holds `size` sends.
fn check_gather_len(send: usize, recv: usize, size: usize) -> Result<()> {
    if send.checked_mul(size) != Some(recv) {
        return Err(cce_core::CceError::ShapeMismatch {
            what: "all-gather receive buffer",
            expected: format!("{size} x {send} values"),
            got: format!("{recv} values"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cce_core::CceError;

    #[test]
    fn collectives_combine_in_rank_order() {
        let out = ThreadComm::run(3, |c| {
            let r = c.rank() as f32;
            let mut s = vec![r, 10.0 * r];
            c.all_reduce_f32(&mut s, ReduceOp::Sum).unwrap();
            let mut m = vec![r as f64, -(r as f64)];
            c.all_reduce_f64(&mut m, ReduceOp::Max).unwrap();
            let mut g = vec![0.0f64; 6];
            c.all_gather_f64(&[r as f64, 1.0], &mut g).unwrap();
            let mut g32 = vec![0.0f32; 3];
            c.all_gather_f32(&[r], &mut g32).unwrap();
            (s, m, g, g32)
        });
        for (s, m, g, g32) in out {
            assert_eq!(s, vec![3.0, 30.0]);
            assert_eq!(m, vec![2.0, 0.0]);
            assert_eq!(g, vec![0.0, 1.0, 1.0, 1.0, 2.0, 1.0]);
            assert_eq!(g32, vec![0.0, 1.0, 2.0]);
        }
    }

    #[test]
    fn mismatched_collectives_are_errors_on_every_rank() {
        let out = ThreadComm::run(2, |c| {
            let mut buf = vec![1.0f32; 2 + c.rank()];
            c.all_reduce_f32(&mut buf, ReduceOp::Sum)
        });
        for r in out {
            assert!(
                matches!(
                    r,
                    Err(CceError::VocabParallel(
                        VocabParallelError::CollectiveMismatch { .. }
                    ))
                ),
                "{r:?}"
            );
        }
        let out = ThreadComm::run(2, |c| {
            if c.rank() == 0 {
                c.all_reduce_f32(&mut [1.0], ReduceOp::Sum)
            } else {
                c.all_reduce_f32(&mut [1.0], ReduceOp::Max)
            }
        });
        assert!(out.iter().all(|r| r.is_err()));
        let mut small = [0.0f64; 3];
        let g = ThreadComm::group(2);
        assert!(matches!(
            g[0].all_gather_f64(&[1.0, 2.0], &mut small),
            Err(CceError::ShapeMismatch { .. })
        ));
    }

    #[test]
    fn a_rank_that_leaves_never_hangs_the_others() {
        let out = ThreadComm::run(3, |c| {
            if c.rank() == 1 {
                return Ok(());
            }
            let mut buf = [1.0f64];
            c.all_reduce_f64(&mut buf, ReduceOp::Sum)?;
            c.all_reduce_f64(&mut buf, ReduceOp::Sum)
        });
        assert!(out[1].is_ok());
        for r in [&out[0], &out[2]] {
            assert!(
                matches!(
                    r,
                    Err(CceError::VocabParallel(VocabParallelError::PeerLost {
                        rank: 1
                    }))
                ),
                "{r:?}"
            );
        }
    }
}
