//! A vocabulary-parallel group of `k` ranks simulated by threads of one process, behind the
//! [`Backend`] trait: the whole vocabulary in, the whole vocabulary's outputs out, each call
//! split over `k` shards, run by `k` [`RankDriver`]s over a [`ThreadComm`] group and joined
//! back (`d_c` and `d_bias` concatenated over the shards' real classes). What the conformance
//! suite and the tests run; also a way to try a layout on the CPU.

use super::driver::{RankBackward, RankDriver, RankForward};
use super::thread_comm::ThreadComm;
use super::CpuShard;
use cce_core::plan::{DeviceLimits, StrategyKind};
use cce_core::vocab_parallel::{Communicator, ShardLayout, VocabParallelError};
use cce_core::{
    Backend, BackwardOutput, CceError, ForwardOutput, HostTensor, Inputs, Options, Result, Saved,
    TensorMeta, Upstream,
};

/// How the simulated group splits a vocabulary of `V` classes over its ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SimulatedLayout {
    /// [`ShardLayout::even`] (no padding); when `V` is smaller than the ranks,
    /// [`ShardLayout::padded`] with multiple 1.
    Even,
    /// [`ShardLayout::padded`]: `V` padded to a multiple of `ranks × multiple`, the padding in
    /// the last shards. The simulation fills the padding rows of `c` and entries of `bias`
    /// with NaN, which no output may show.
    Padded {
        /// Megatron-LM's `make_vocab_size_divisible_by`.
        multiple: usize,
    },
}

/// `k` simulated ranks of a vocabulary-parallel group ([`SimulatedVocabParallel::new`]).
#[derive(Clone, Debug)]
pub struct SimulatedVocabParallel {
    ranks: usize,
    layout: SimulatedLayout,
    cpu: CpuShard,
}

impl SimulatedVocabParallel {
    /// `ranks` ranks (at least 1), [`SimulatedLayout::Even`], default CPU shard tiles.
    pub fn new(ranks: usize) -> Self {
        Self {
            ranks,
            layout: SimulatedLayout::Even,
            cpu: CpuShard::new(),
        }
    }

    /// The same group with another layout.
    pub fn with_layout(self, layout: SimulatedLayout) -> Self {
        Self { layout, ..self }
    }

    /// The same group with other CPU shard primitives (e.g. smaller tiles).
    pub fn with_cpu(self, cpu: CpuShard) -> Self {
        Self { cpu, ..self }
    }

    /// Ranks of the group.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// The layout of a vocabulary of `vocab_size` classes. Errors as [`ShardLayout::even`]
    /// and [`ShardLayout::padded`].
    pub fn layout_for(&self, vocab_size: usize) -> Result<ShardLayout> {
        match self.layout {
            SimulatedLayout::Even if vocab_size >= self.ranks => {
                ShardLayout::even(vocab_size, self.ranks)
            }
            SimulatedLayout::Even => ShardLayout::padded(vocab_size, self.ranks, 1),
            SimulatedLayout::Padded { multiple } => {
                ShardLayout::padded(vocab_size, self.ranks, multiple)
            }
        }
    }

    /// The forward on every rank, results in rank order (for tests that compare the ranks).
    /// Errors (outer): the unsharded call's shape, dtype and option errors, the layout's.
    pub fn forward_ranks(
        &self,
        inputs: &Inputs<'_, HostTensor>,
        opts: &Options,
    ) -> Result<Vec<Result<RankForward>>> {
        let (layout, shards) = self.split(inputs, opts)?;
        Ok(ThreadComm::run(self.ranks, |comm| {
            let (c, bias) = &shards[comm.rank()];
            let local = Inputs {
                c,
                bias: bias.as_ref(),
                ..*inputs
            };
            RankDriver::new(comm, &layout)?
                .with_cpu(self.cpu.clone())
                .forward(&local, opts)
        }))
    }

    /// The backward on every rank, results in rank order. Errors (outer) as
    /// [`SimulatedVocabParallel::forward_ranks`].
    pub fn backward_ranks(
        &self,
        inputs: &Inputs<'_, HostTensor>,
        opts: &Options,
        saved: Saved<'_, HostTensor>,
        upstream: &Upstream<'_, HostTensor>,
    ) -> Result<(ShardLayout, Vec<Result<RankBackward>>)> {
        let (layout, shards) = self.split(inputs, opts)?;
        let out = ThreadComm::run(self.ranks, |comm| {
            let (c, bias) = &shards[comm.rank()];
            let local = Inputs {
                c,
                bias: bias.as_ref(),
                ..*inputs
            };
            RankDriver::new(comm, &layout)?
                .with_cpu(self.cpu.clone())
                .backward(&local, opts, saved, upstream)
        });
        Ok((layout, out))
    }

    /// Validate the whole call as the unsharded backend does, then split `c` and `bias` into
    /// the shards of the layout (padding rows and entries NaN).
    #[allow(clippy::type_complexity)]
    fn split(
        &self,
        inputs: &Inputs<'_, HostTensor>,
        opts: &Options,
    ) -> Result<(ShardLayout, Vec<(HostTensor, Option<HostTensor>)>)> {
        let problem = inputs.problem(opts)?;
        if self.ranks == 0 {
            return Err(VocabParallelError::NoShards {
                vocab_size: problem.v,
            }
            .into());
        }
        let layout = self.layout_for(problem.v)?;
        let c = inputs.c.try_to_f32_vec()?;
        let bias = inputs.bias.map(|b| b.try_to_f32_vec()).transpose()?;
        let (v, d) = (problem.v, problem.d);
        let shards = layout
            .shards()
            .iter()
            .map(|s| {
                let rows = |vals: &[f32], width: usize| -> Vec<f32> {
                    let real = s.real_classes();
                    let mut out = vals[real.start * width..real.end * width].to_vec();
                    out.resize(s.len() * width, f32::NAN);
                    out
                };
                let c_shard = HostTensor::from_f32(vec![s.len(), d], &rows(&c, d), problem.dtype)?;
                let b_shard = bias
                    .as_ref()
                    .map(|b| HostTensor::from_f32(vec![s.len()], &rows(b, 1), problem.dtype))
                    .transpose()?;
                debug_assert!(s.real_classes().end <= v);
                Ok((c_shard, b_shard))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((layout, shards))
    }
}

/// Every rank's result, or the error of the failed step: the first rank's own error (not a
/// peer's report of it), in rank order.
fn all_ranks<T>(results: Vec<Result<T>>) -> Result<Vec<T>> {
    let mut first_peer = None;
    let mut ok = Vec::with_capacity(results.len());
    for r in results {
        match r {
            Err(CceError::VocabParallel(
                e @ (VocabParallelError::PeerFailed { .. } | VocabParallelError::PeerLost { .. }),
            )) => {
                first_peer.get_or_insert(e);
            }
            Err(e) => return Err(e),
            Ok(x) => ok.push(x),
        }
    }
    match first_peer {
        Some(e) => Err(e.into()),
        None => Ok(ok),
    }
}

/// The real rows of each shard's `[len, width]` gradient, concatenated into `[V, width]`.
fn concat_real(
    layout: &ShardLayout,
    parts: &[Option<HostTensor>],
    width: usize,
    shape: Vec<usize>,
) -> Result<Option<HostTensor>> {
    let Some(dtype) = parts.first().and_then(|p| p.as_ref()).map(|p| p.dtype()) else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(layout.vocab_size() * width);
    for (s, p) in layout.shards().iter().zip(parts) {
        let Some(p) = p else { return Ok(None) };
        let vals = p.try_to_f32_vec()?;
        out.extend_from_slice(&vals[..s.real_len() * width]);
    }
    // Exact: every value came from a tensor of `dtype`.
    Ok(Some(HostTensor::from_f32(shape, &out, dtype)?))
}

impl Backend for SimulatedVocabParallel {
    type Buffer = HostTensor;

    fn name(&self) -> &'static str {
        "cpu-vocab-parallel"
    }

    fn limits(&self) -> DeviceLimits {
        DeviceLimits {
            name: format!("cpu vocab-parallel ({} ranks)", self.ranks),
            tile: self.cpu.tile(),
            strategies: vec![StrategyKind::TileOwnership],
            ..DeviceLimits::cpu()
        }
    }

    fn upload(&self, host: &HostTensor) -> Result<HostTensor> {
        host.try_clone()
    }

    fn download(&self, buf: &HostTensor) -> Result<HostTensor> {
        buf.try_clone()
    }

    fn forward(
        &self,
        inputs: &Inputs<'_, HostTensor>,
        opts: &Options,
    ) -> Result<ForwardOutput<HostTensor>> {
        let f = all_ranks(self.forward_ranks(inputs, opts)?)?
            .into_iter()
            .next()
            .ok_or(VocabParallelError::NoShards { vocab_size: 0 })?;
        Ok(f.output)
    }

    fn backward(
        &self,
        inputs: &Inputs<'_, HostTensor>,
        opts: &Options,
        saved: Saved<'_, HostTensor>,
        upstream: &Upstream<'_, HostTensor>,
    ) -> Result<BackwardOutput<HostTensor>> {
        let (layout, ranks) = self.backward_ranks(inputs, opts, saved, upstream)?;
        let ranks = all_ranks(ranks)?;
        let d = inputs.c.shape()[1];
        let v = layout.vocab_size();
        let d_c: Vec<Option<HostTensor>> = ranks.iter().map(|r| r.d_c.clone()).collect();
        let d_bias: Vec<Option<HostTensor>> = ranks.iter().map(|r| r.d_bias.clone()).collect();
        let first = ranks
            .into_iter()
            .next()
            .ok_or(VocabParallelError::NoShards { vocab_size: v })?;
        Ok(BackwardOutput {
            d_e: first.d_e,
            d_c: concat_real(&layout, &d_c, d, vec![v, d])?,
            d_bias: concat_real(&layout, &d_bias, 1, vec![v])?,
            stats: first.stats,
        })
    }
}
