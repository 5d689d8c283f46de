"""The eager op (``cut_cross_entropy_rs::forward_eager``, which ``linear_cross_entropy`` picks on
CUDA for mean and sum) on CPU tensors, where it runs the CPU backend's forward then backward: its
autograd formula scales the held gradients in place and hands them to autograd without a copy,
and recomputes where the held gradients cannot serve (a gradient through the lse, a retained
graph's second backward, ``create_graph=True``)."""

from __future__ import annotations

import pytest
import torch
from op_options import opts
from test_cpu import make

from cut_cross_entropy_rs import CceError
from cut_cross_entropy_rs._ops import forward_eager_op, forward_op

SCALES = [1.0, 0.5, 3.0]


def eager(e, c, t, b=None, reduction="mean", **kw):
    """Loss and lse from the eager op, asking for the gradients of the inputs that require one;
    the held gradients are dropped here, as ``linear_cross_entropy`` does."""
    needs = [x is not None and x.requires_grad for x in (e, c, b)]
    loss, lse, *_ = forward_eager_op(e, c, t, b, *needs, -1, *opts(reduction, **kw))
    return loss, lse


def recomputing(e, c, t, b=None, reduction="mean", **kw):
    """Loss and lse from the op whose backward recomputes the logits."""
    loss, lse, *_ = forward_op(e, c, t, b, -1, *opts(reduction, **kw))
    return loss, lse


def leaves(*xs):
    return [None if x is None else x.clone().requires_grad_() for x in xs]


def tol(dtype):
    """The eager path accumulates the gradient of upstream 1, rounds it to the dtype, then
    scales and rounds again; the recomputing path accumulates the scaled one and rounds once: a
    few units in the last place apart (more in f32, where the accumulation order shows)."""
    return dict(rtol=max(2 * torch.finfo(dtype).eps, 1e-5), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("scale", SCALES)
def test_scaled_gradients_match_the_recomputing_path(dtype, reduction, scale):
    e, c, t, b = make((29,), 16, 61, dtype, bias=True, ignore=0.1)
    xs = leaves(e, c, b)
    (eager(xs[0], xs[1], t, xs[2], reduction)[0] * scale).backward()
    ys = leaves(e, c, b)
    (recomputing(ys[0], ys[1], t, ys[2], reduction)[0] * scale).backward()
    for x, y in zip(xs, ys, strict=True):
        assert x.grad.dtype == dtype
        torch.testing.assert_close(x.grad, y.grad, **tol(dtype))


def test_held_gradients_become_the_grads_without_a_copy():
    """The tensors the forward wrote are the ``.grad`` tensors after the backward: scaled in
    place, owned by autograd alone, adopted by ``AccumulateGrad``."""
    e, c, t, b = make((2, 9), 16, 40, bias=True)
    xs = leaves(e, c, b)
    out = forward_eager_op(xs[0], xs[1], t, xs[2], True, True, True, -1, *opts())
    loss, held = out[0], [x.data_ptr() for x in out[5:]]
    del out
    (loss * 0.5).backward()
    assert [x.grad.data_ptr() for x in xs] == held
    ys = leaves(e, c, b)
    (recomputing(ys[0], ys[1], t, ys[2])[0] * 0.5).backward()
    for x, y in zip(xs, ys, strict=True):
        torch.testing.assert_close(x.grad, y.grad, **tol(torch.float32))


def test_gradients_accumulate_into_existing_grads():
    e, c, t, _ = make((23,), 16, 40)
    xs = leaves(e, c)
    for x in xs:
        x.grad = torch.ones_like(x)
    (eager(xs[0], xs[1], t)[0] * 3.0).backward()
    ys = leaves(e, c)
    (recomputing(ys[0], ys[1], t)[0] * 3.0).backward()
    for x, y in zip(xs, ys, strict=True):
        torch.testing.assert_close(x.grad, 1.0 + y.grad, **tol(torch.float32))


def test_a_subset_of_the_gradients():
    """``autograd.grad`` for ``e`` alone, though the forward also computed ``d_c`` and ``d_bias``."""
    e, c, t, b = make((23,), 16, 40, bias=True)
    xs = leaves(e, c, b)
    (got,) = torch.autograd.grad(eager(xs[0], xs[1], t, xs[2])[0] * 0.5, xs[0])
    ys = leaves(e, c, b)
    (want,) = torch.autograd.grad(recomputing(ys[0], ys[1], t, ys[2])[0] * 0.5, ys[0])
    torch.testing.assert_close(got, want, **tol(torch.float32))


def test_retained_graph_second_backward_recomputes():
    """The first backward spends the held gradients (scaled in place); a second backward through
    the retained graph recomputes them and gets the same gradients."""
    e, c, t, b = make((31,), 16, 40, bias=True, ignore=0.1)
    xs = leaves(e, c, b)
    loss = eager(xs[0], xs[1], t, xs[2])[0] * 0.5
    first = torch.autograd.grad(loss, xs, retain_graph=True)
    second = torch.autograd.grad(loss, xs, retain_graph=True)
    third = torch.autograd.grad(loss * 3.0, xs)
    for f, s, th in zip(first, second, third, strict=True):
        torch.testing.assert_close(s, f, **tol(torch.float32))
        torch.testing.assert_close(th, 3.0 * f, **tol(torch.float32))


def test_double_backward_raises():
    """``create_graph=True`` takes the recomputing backward: first-order gradients as usual, and a
    backward through them raises as on the recomputing path (no second-order formula)."""
    e, c, t, _ = make((17,), 8, 30)
    xs = leaves(e, c)
    (d_e,) = torch.autograd.grad(eager(xs[0], xs[1], t)[0], xs[0], create_graph=True)
    ys = leaves(e, c)
    (want,) = torch.autograd.grad(recomputing(ys[0], ys[1], t)[0], ys[0])
    torch.testing.assert_close(d_e, want, rtol=0, atol=0)
    with pytest.raises(CceError, match="no second derivative"):
        d_e.sum().backward()


def test_gradient_through_the_lse_recomputes():
    e, c, t, b = make((29,), 16, 61, bias=True, ignore=0.1)
    xs = leaves(e, c, b)
    loss, lse = eager(xs[0], xs[1], t, xs[2], z_loss=1e-3)
    (loss + 0.1 * lse.square().mean()).backward()
    ys = leaves(e, c, b)
    loss, lse = recomputing(ys[0], ys[1], t, ys[2], z_loss=1e-3)
    (loss + 0.1 * lse.square().mean()).backward()
    for x, y in zip(xs, ys, strict=True):
        torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_forward_eager_op_passes_opcheck(reduction):
    e, c, t, b = make((2, 6), 8, 19, bias=True, ignore=0.1)
    e, c, b = leaves(e, c, b)
    o = opts(reduction, softcap=5.0, label_smoothing=0.1, z_loss=1e-3, entropy=True, argmax=True)
    torch.library.opcheck(forward_eager_op, (e, c, t, b, True, True, True, -1, *o))
    torch.library.opcheck(forward_eager_op, (e, c, t, None, True, False, False, -1, *opts(reduction)))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(backend):
    torch._dynamo.reset()
    e, c, t, b = make((2, 7), 16, 50, bias=True, ignore=0.1)

    def step(e, c, t, b):
        return eager(e, c, t, b, shift=1, softcap=20.0)[0] * 0.5

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    xs, ys = leaves(e, c, b), leaves(e, c, b)
    with torch._inductor.config.patch(fx_graph_cache=False):
        got = compiled(ys[0], ys[1], t, ys[2])
    want = step(xs[0], xs[1], t, xs[2])
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for x, y in zip(xs, ys, strict=True):
        torch.testing.assert_close(y.grad, x.grad, rtol=0, atol=0)
