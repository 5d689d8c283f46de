"""torch.library registration and torch.compile on the CPU: the custom ops pass opcheck (schema,
fake kernels, autograd registration, AOT dispatch) and a fullgraph compile matches eager."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from op_options import opts

import cut_cross_entropy_rs as cce
from cut_cross_entropy_rs._ops import backward_op, forward_op

# Inductor's on-disk caches outlive a rebuild of the package (the key does not cover the ops'
# implementation): compile afresh.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="cce-inductor-")
torch._inductor.config.fx_graph_cache = False


def inputs(bias=True, requires_grad=True):
    g = torch.Generator().manual_seed(1)
    e = torch.randn(2, 6, 8, generator=g, requires_grad=requires_grad)
    c = torch.randn(19, 8, generator=g, requires_grad=requires_grad)
    t = torch.randint(0, 19, (2, 6), generator=g)
    t[0, 2] = -100
    b = torch.randn(19, generator=g, requires_grad=requires_grad) if bias else None
    return e, c, t, b


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_forward_op_passes_opcheck(reduction):
    e, c, t, b = inputs()
    o = opts(reduction, softcap=5.0, label_smoothing=0.1, z_loss=1e-3, entropy=True, argmax=True)
    torch.library.opcheck(forward_op, (e, c, t, b, -1, *o))
    torch.library.opcheck(forward_op, (e, c, t, None, -1, *opts(reduction)))


def test_backward_op_passes_opcheck():
    e, c, t, b = inputs(requires_grad=False)
    o = opts()
    _, lse, rest, _, _ = forward_op(e, c, t, b, -1, *o)
    torch.library.opcheck(backward_op, (e, c, t, b, lse, rest, torch.tensor(1.0), None, True, True, True, -1, *o))
    torch.library.opcheck(
        backward_op, (e, c, t, b, lse, rest, torch.tensor(0.5), lse.clone(), True, False, False, -1, *o)
    )


def loss_fn(e, c, t, b):
    loss, lse = cce.linear_cross_entropy(e, c, t, b, shift=1, softcap=20.0, return_lse=True, filter_eps=None)
    return loss + 1e-2 * lse.square().mean()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(backend):
    torch._dynamo.reset()
    e, c, t, b = inputs()
    compiled = torch.compile(loss_fn, fullgraph=True, backend=backend)
    got = compiled(e, c, t, b)
    got_grads = torch.autograd.grad(got, (e, c, b))
    want = loss_fn(e, c, t, b)
    want_grads = torch.autograd.grad(want, (e, c, b))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for x, y in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_compiled_liger_module():
    torch._dynamo.reset()
    e, c, t, b = inputs()
    fn = cce.LigerFusedLinearCrossEntropyLoss(lse_square_scale=1e-4)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = compiled(c, e.reshape(-1, 8), t.reshape(-1), b)
    want = fn(c, e.reshape(-1, 8), t.reshape(-1), b)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_return_stats_is_eager_only():
    torch._dynamo.reset()
    e, c, t, _ = inputs()

    def f(e, c, t):
        return cce.linear_cross_entropy(e, c, t, return_stats=True)[0]

    with pytest.raises(Exception, match="eager mode only"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(e, c, t)


def test_compile_dynamic_shapes():
    """One graph for several row counts (symbolic N in the fake kernels)."""
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager", dynamic=True)
    for rows in (6, 9, 13):
        g = torch.Generator().manual_seed(rows)
        e = torch.randn(2, rows, 8, generator=g, requires_grad=True)
        c = torch.randn(19, 8, generator=g, requires_grad=True)
        b = torch.randn(19, generator=g, requires_grad=True)
        t = torch.randint(0, 19, (2, rows), generator=g)
        got = compiled(e, c, t, b)
        got_grads = torch.autograd.grad(got, (e, c, b))
        want = loss_fn(e, c, t, b)
        want_grads = torch.autograd.grad(want, (e, c, b))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for x, y in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
