//! `k` simulated ranks whose shards run on a backend's own calls
//! ([`BackendShard`]), one backend per rank, joined by a [`ThreadComm`]: how a GPU backend's
//! shard primitives are checked on one device against its unsharded call.

use super::driver::RankDriver;
use super::thread_comm::ThreadComm;
use cce_core::vocab_parallel::{BackendShard, Communicator, ShardLayout, ShardRows};
use cce_core::{
    CallStats, CceError, DLoss, ForwardOutput, HostTensor, Inputs, Options, Result, Saved,
    TensorMeta, Upstream,
};

/// A whole call over the simulated ranks, joined on the host.
#[derive(Debug)]
pub struct SimulatedCall {
    /// Rank 0's forward (every rank's loss, lse and `rest_mass` are checked bit-equal).
    pub forward: ForwardOutput<HostTensor>,
    /// `d_e` summed over the ranks (rank 0's; every rank's is checked bit-equal).
    pub d_e: Option<HostTensor>,
    /// `d_c` of the real classes, the shards' concatenated, `[V, D]`.
    pub d_c: Option<HostTensor>,
    /// `d_bias` of the real classes, `[V]`.
    pub d_bias: Option<HostTensor>,
    /// Rank 0's statistics of the whole backward.
    pub stats: CallStats,
    /// Each rank's padding rows of `d_c` and entries of `d_bias` were all zero.
    pub padding_zero: bool,
}

/// Run forward then backward of `inputs` (the whole vocabulary, on the host) over
/// `backends.len()` ranks of `layout`, rank `r` on `backends[r]` through
/// [`BackendShard`]: the shard's `c` and `bias` (padding rows NaN), `e`, the targets and the
/// upstream gradients uploaded to its backend, the merged lse and `rest_mass` uploaded for the
/// backward.
///
/// Errors: the unsharded call's shape errors ([`cce_core::Problem::new`]), `VocabParallel(RankCount)`
/// when the layout has not one shard per backend, `Backend` when ranks disagree on a result
/// every rank must hold identically, and the first rank's error of the call (its own, not a
/// peer's report).
pub fn simulate_over_backends<B>(
    backends: &[B],
    layout: &ShardLayout,
    inputs: &Inputs<'_, HostTensor>,
    opts: &Options,
    upstream: &Upstream<'_, HostTensor>,
) -> Result<SimulatedCall>
where
    B: ShardRows + Sync,
{
    let problem = inputs.problem(opts)?;
    let d = problem.d;
    let c = inputs.c.try_to_f32_vec()?;
    let bias = inputs.bias.map(|b| b.try_to_f32_vec()).transpose()?;
    let rows = |s: &cce_core::vocab_parallel::VocabShard, vals: &[f32], width: usize| {
        let real = s.real_classes();
        let mut out = vals[real.start * width..real.end * width].to_vec();
        out.resize(s.len() * width, f32::NAN);
        out
    };
    type RankOut = (
        ForwardOutput<HostTensor>,
        Option<HostTensor>,
        Option<HostTensor>,
        Option<HostTensor>,
        CallStats,
    );
    let results: Vec<Result<RankOut>> = ThreadComm::run(backends.len(), |comm| {
        let r = comm.rank();
        let be = &backends[r];
        let driver = RankDriver::new(comm, layout)?.with_primitives(BackendShard::new(be));
        let s = layout.shard(r)?;
        let c_r = be.upload(&HostTensor::from_f32(
            vec![s.len(), d],
            &rows(&s, &c, d),
            problem.dtype,
        )?)?;
        let b_r = bias
            .as_ref()
            .map(|b| {
                be.upload(&HostTensor::from_f32(
                    vec![s.len()],
                    &rows(&s, b, 1),
                    problem.dtype,
                )?)
            })
            .transpose()?;
        let e = be.upload(inputs.e)?;
        let t = be.upload(inputs.targets)?;
        let local = Inputs {
            e: &e,
            c: &c_r,
            bias: b_r.as_ref(),
            targets: &t,
        };
        let fwd = driver.forward(&local, opts)?;
        let lse = be.upload(&fwd.output.lse)?;
        let rest = be.upload(&fwd.output.rest_mass)?;
        let d_loss_rows = match upstream.d_loss {
            DLoss::PerRow(x) => Some(be.upload(x)?),
            DLoss::Scalar(_) => None,
        };
        let d_lse = upstream.d_lse.map(|x| be.upload(x)).transpose()?;
        let up = Upstream {
            d_loss: match (&d_loss_rows, upstream.d_loss) {
                (Some(x), _) => DLoss::PerRow(x),
                (None, DLoss::Scalar(s)) => DLoss::Scalar(s),
                (None, DLoss::PerRow(_)) => unreachable!("uploaded above"),
            },
            d_lse: d_lse.as_ref(),
        };
        let bwd = driver.backward(
            &local,
            opts,
            Saved {
                lse: &lse,
                rest_mass: &rest,
            },
            &up,
        )?;
        let d_c = bwd.d_c.as_ref().map(|x| be.download(x)).transpose()?;
        let d_bias = bwd.d_bias.as_ref().map(|x| be.download(x)).transpose()?;
        Ok((fwd.output, bwd.d_e, d_c, d_bias, bwd.stats))
    });
    let mut ranks = Vec::with_capacity(results.len());
    let mut peer = None;
    for r in results {
        match r {
            Err(CceError::VocabParallel(
                e @ cce_core::vocab_parallel::VocabParallelError::PeerFailed { .. },
            )) => {
                peer.get_or_insert(e);
            }
            Err(e) => return Err(e),
            Ok(x) => ranks.push(x),
        }
    }
    if let Some(e) = peer {
        return Err(e.into());
    }
    let same = |a: &Option<HostTensor>, b: &Option<HostTensor>| match (a, b) {
        (Some(a), Some(b)) => a.as_bytes() == b.as_bytes(),
        (None, None) => true,
        _ => false,
    };
    for (r, x) in ranks.iter().enumerate().skip(1) {
        let f0 = &ranks[0].0;
        let agree = f0.loss.as_bytes() == x.0.loss.as_bytes()
            && f0.lse.as_bytes() == x.0.lse.as_bytes()
            && f0.rest_mass.as_bytes() == x.0.rest_mass.as_bytes()
            && same(&ranks[0].1, &x.1);
        if !agree {
            return Err(CceError::backend(
                "simulated",
                format!("rank {r}'s loss, lse, rest_mass or d_e differ from rank 0's"),
            ));
        }
    }
    let mut padding_zero = true;
    let mut join = |width: usize,
                    pick: &dyn Fn(&RankOut) -> &Option<HostTensor>|
     -> Result<Option<HostTensor>> {
        let mut out = Vec::with_capacity(problem.v * width);
        let mut dtype = None;
        for (s, x) in layout.shards().iter().zip(&ranks) {
            let Some(t) = pick(x) else { return Ok(None) };
            dtype = Some(t.dtype());
            let vals = t.try_to_f32_vec()?;
            padding_zero &= vals[s.real_len() * width..].iter().all(|&v| v == 0.0);
            out.extend_from_slice(&vals[..s.real_len() * width]);
        }
        let shape = if width == 1 {
            vec![problem.v]
        } else {
            vec![problem.v, width]
        };
        dtype
            .map(|dt| HostTensor::from_f32(shape, &out, dt))
            .transpose()
    };
    let d_c = join(d, &|x| &x.2)?;
    let d_bias = join(1, &|x| &x.3)?;
    let first =
        ranks
            .into_iter()
            .next()
            .ok_or(cce_core::vocab_parallel::VocabParallelError::NoShards {
                vocab_size: problem.v,
            })?;
    Ok(SimulatedCall {
        forward: first.0,
        d_e: first.1,
        d_c,
        d_bias,
        stats: first.4,
        padding_zero,
    })
}
