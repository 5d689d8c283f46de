//! A rank whose call fails before its shard runs (tensors on several devices, a shard range
//! that is none, a CUDA setup error) still takes part in the call's first collective, flagged
//! as failed, as a rank whose shard fails does: the driver runs with primitives that only
//! return the error ([`Failed`]), so the other ranks get `VocabParallel(PeerFailed)` naming
//! it instead of waiting for it (the driver's contract:
//! `cce_reference::vocab_parallel::RankDriver`).

use crate::args::{InputArgs, SavedArgs};
use cce_core::vocab_parallel::{
    Communicator, ShardBackward, ShardForward, ShardPrimitives, VocabShard,
};
use cce_core::CceError as LibError;
use cce_core::{DLoss, HostTensor, Inputs, Options, Saved, Upstream};
use cce_reference::vocab_parallel::RankDriver;
use std::cell::RefCell;

/// Shard primitives that fail with the error given (once; a second call is `Internal`).
struct Failed(RefCell<Option<LibError>>);

impl Failed {
    fn take(&self) -> LibError {
        self.0.borrow_mut().take().unwrap_or_else(|| {
            LibError::backend(
                "cut_cross_entropy_rs",
                "a failed rank's error was taken twice",
            )
        })
    }
}

impl<T, S, U> ShardPrimitives<T, S, U> for Failed {
    type Grad = HostTensor;

    fn shard_forward(
        &self,
        _: &Inputs<'_, T>,
        _: &VocabShard,
        _: &Options,
    ) -> cce_core::Result<ShardForward> {
        Err(self.take())
    }

    fn shard_backward(
        &self,
        _: &Inputs<'_, T>,
        _: &VocabShard,
        _: &Options,
        _: Saved<'_, S>,
        _: &Upstream<'_, U>,
    ) -> cce_core::Result<ShardBackward<HostTensor>> {
        Err(self.take())
    }
}

/// Any shard: the failed primitives never look at it.
fn some_shard() -> cce_core::Result<VocabShard> {
    VocabShard::new(1, 0, 1)
}

/// `err` after taking part in the forward's all-gather as a failed rank (the error of that
/// collective, when it fails too, is dropped: `err` is this rank's own).
pub(crate) fn forward<C: Communicator + ?Sized>(
    comm: &C,
    inp: &InputArgs,
    opts: &Options,
    err: LibError,
) -> LibError {
    let shard = match some_shard() {
        Ok(s) => s,
        Err(_) => return err,
    };
    let inputs = inp.metas();
    let driver =
        RankDriver::from_shard(comm, shard).with_primitives(Failed(RefCell::new(Some(err))));
    match driver.forward(&inputs, opts) {
        Err(e) => e,
        Ok(_) => LibError::backend("cut_cross_entropy_rs", "a failed rank's forward succeeded"),
    }
}

/// `err` after taking part in the backward's agreement all-reduce as a failed rank.
pub(crate) fn backward<C: Communicator + ?Sized>(
    comm: &C,
    inp: &InputArgs,
    sv: &SavedArgs,
    opts: &Options,
    err: LibError,
) -> LibError {
    let shard = match some_shard() {
        Ok(s) => s,
        Err(_) => return err,
    };
    let inputs = inp.metas();
    let driver =
        RankDriver::from_shard(comm, shard).with_primitives(Failed(RefCell::new(Some(err))));
    let saved = Saved {
        lse: &sv.lse,
        rest_mass: &sv.rest_mass,
    };
    let upstream = Upstream {
        d_loss: DLoss::PerRow(&sv.d_loss),
        d_lse: None,
    };
    match driver.backward(&inputs, opts, saved, &upstream) {
        Err(e) => e,
        Ok(_) => LibError::backend("cut_cross_entropy_rs", "a failed rank's backward succeeded"),
    }
}
