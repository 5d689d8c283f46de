//! `Autodiff<B>`: the forward of `B`, and a hand-written backward that recomputes the logits
//! blockwise from the saved lse and rest mass (arXiv 2411.09009, section 4.3) instead of
//! letting burn differentiate a materialized `N x V` matrix.

use crate::backend::LinearCrossEntropyBackend;
use crate::kernels::{CceForward, CceKernels};
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, NodeGuard, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::backend::tensor::{FloatTensor, IntTensor};
use cce_core::{CceError, Options};

/// The backward step; `N` = 2 (`e`, `c`) or 3 (`e`, `c`, `bias`) parents.
#[derive(Debug)]
struct CceBackward<const N: usize>;

/// What the backward reads: the inputs (burn primitives are reference-counted handles, so
/// keeping them copies nothing), the forward's per-row lse and rest mass (`[N]` f32 each: the
/// only memory this op adds to the graph) and the options.
#[derive(Debug)]
struct CceState<B: CceKernels> {
    e: FloatTensor<B>,
    c: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    targets: IntTensor<B>,
    saved: CceForward<B>,
    opts: Options,
}

impl<B: CceKernels> Clone for CceState<B> {
    fn clone(&self) -> Self {
        Self {
            e: self.e.clone(),
            c: self.c.clone(),
            bias: self.bias.clone(),
            targets: self.targets.clone(),
            saved: self.saved.clone(),
            opts: self.opts.clone(),
        }
    }
}

impl<B: CceKernels, const N: usize> Backward<B, N> for CceBackward<N> {
    type State = CceState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let d_loss = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let parent = |i: usize| ops.parents.get(i).and_then(|p| p.as_ref());
        let mut opts = s.opts;
        opts.compute_d_e = parent(0).is_some();
        opts.compute_d_c = parent(1).is_some() || parent(2).is_some();
        // A backward cannot return an error in burn. The inputs were validated by the forward,
        // so what is left is a non-finite upstream gradient or a device failure: panic with
        // our typed error's message.
        let g = B::cce_backward(s.e, s.c, s.bias, s.targets, s.saved, d_loss, &opts)
            .unwrap_or_else(|err| panic!("linear_cross_entropy backward: {err}"));
        for (i, grad) in [g.d_e, g.d_c, g.d_bias].into_iter().enumerate() {
            if let (Some(node), Some(grad)) = (parent(i), grad) {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Run the forward of `B` and record the backward step over the `N` parent nodes.
fn record<B, C, const N: usize>(
    nodes: [NodeGuard; N],
    e: FloatTensor<B>,
    c: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    targets: IntTensor<B>,
    opts: Options,
) -> (Option<FloatTensor<Autodiff<B, C>>>, Option<CceError>)
where
    B: CceKernels,
    C: CheckpointStrategy,
{
    let fwd = match B::cce_forward(e.clone(), c.clone(), bias.clone(), targets.clone(), &opts) {
        Ok(f) => f,
        Err(err) => return (None, Some(err)),
    };
    // Compute bound: the state is kept rather than the forward re-run under checkpointing.
    let out = match CceBackward::<N>
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let loss = fwd.loss.clone();
            let state = CceState {
                e,
                c,
                bias,
                targets,
                saved: fwd,
                opts,
            };
            prep.finish(state, loss)
        }
        OpsKind::UnTracked(prep) => prep.finish(fwd.loss),
    };
    (Some(out), None)
}

impl<B, C> LinearCrossEntropyBackend for Autodiff<B, C>
where
    B: LinearCrossEntropyBackend + CceKernels,
    C: CheckpointStrategy,
{
    fn linear_cross_entropy(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        targets: IntTensor<Self>,
        opts: Options,
    ) -> (Option<FloatTensor<Self>>, Option<CceError>) {
        let (e, e_node) = e.into_parts();
        let (c, c_node) = c.into_parts();
        record::<B, C, 2>([e_node, c_node], e, c, None, targets, opts)
    }

    fn linear_cross_entropy_with_bias(
        e: FloatTensor<Self>,
        c: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        targets: IntTensor<Self>,
        opts: Options,
    ) -> (Option<FloatTensor<Self>>, Option<CceError>) {
        let (e, e_node) = e.into_parts();
        let (c, c_node) = c.into_parts();
        let (b, b_node) = bias.into_parts();
        record::<B, C, 3>([e_node, c_node, b_node], e, c, Some(b), targets, opts)
    }
}
