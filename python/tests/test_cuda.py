"""The CUDA path (skipped without a CUDA device): the same f64 checks as the CPU's on torch's CUDA
tensors, a non-default current stream, bad inputs raising ``CceError``, torch.compile, CUDA graph
capture and replay, and the eager
gradients of mean and sum (scaled in place, adopted by autograd without a copy, recomputed for a
retained graph's second backward)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_cpu import DTYPES, check, kind_of, make

from cut_cross_entropy_rs import CceError, get_checks, linear_cross_entropy, set_checks, status

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA path runs on the H200")


def cuda(*xs):
    return [None if x is None else x.cuda() for x in xs]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_plain_matches_f64(dtype, reduction):
    e, c, t, _ = cuda(*make((37,), 64, 301, dtype, ignore=0.2))
    check(e, c, t, reduction=reduction)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_option_together(dtype):
    e, c, t, b = cuda(*make((3, 17), 64, 277, dtype, bias=True, ignore=0.1, ignore_index=5))
    for reduction in ("mean", "sum", "none"):
        check(e, c, t, b, ignore_index=5, softcap=3.0, reduction=reduction, shift=2, label_smoothing=0.1, z_loss=1e-2)


@pytest.mark.parametrize(
    "n_shape,d,v",
    [((1,), 1, 1), ((2,), 3, 1), ((63,), 5, 65), ((129,), 7, 1000), ((2, 3, 5), 9, 31), ((300,), 128, 4099)],
)
def test_hostile_shapes(n_shape, d, v):
    e, c, t, b = cuda(*make(n_shape, d, v, bias=True, seed=sum(n_shape) + d + v))
    check(e, c, t, b)
    check(e, c, t, b, reduction="none")


def test_filtered_bf16_is_close():
    e, c, t, _ = cuda(*make((256,), 128, 2048, torch.bfloat16, scale=2.0))
    check(e, c, t, filter_eps="auto")


def test_dc_in_grad_dtype_takes_chunked_dense():
    """``dc_in_grad_dtype=True``: an exact bf16 call whose budget (44 MiB) holds no f32 ``d_c``
    accumulator (16 MiB beside cuBLAS's workspace) runs chunked dense with ``d_c`` accumulated
    in the bf16 gradient, as its statistics say; ``d_c`` within 6e-3 of f64 (relative Frobenius,
    the Rust test's bound: 3.9e-3 measured at 16 row chunks), ``d_e`` within 4e-3. Without it
    the same call runs split dense."""
    e, c, t, _ = cuda(*make((2048,), 512, 8192, torch.bfloat16, seed=23))
    e2, c2 = e.double().requires_grad_(), c.double().requires_grad_()
    F.cross_entropy(e2 @ c2.T, t).backward()

    def run(flag):
        e1, c1 = e.clone().requires_grad_(), c.clone().requires_grad_()
        loss, stats = linear_cross_entropy(
            e1, c1, t, filter_eps=None, workspace_budget_bytes=44 << 20, dc_in_grad_dtype=flag, return_stats=True
        )
        loss.backward()
        why = " ".join(stats[k]["plan_reason"] for k in ("forward", "backward") if k in stats)
        return e1.grad, c1.grad, why

    def rel(x, y):
        return float((x.double() - y).norm() / y.norm())

    d_e, d_c, why = run(True)
    assert "chunked-dense" in why and "dc_in_grad_dtype" in why, why
    assert d_c.dtype == torch.bfloat16
    assert rel(d_e, e2.grad) <= 4e-3 and rel(d_c, c2.grad) <= 6e-3, (rel(d_e, e2.grad), rel(d_c, c2.grad))
    _, _, why = run(False)
    assert "split-dense" in why and "dc_in_grad_dtype" not in why, why


def test_runs_on_the_current_stream():
    """A non-default current stream: the call is ordered on it, results match the default's."""
    e, c, t, b = cuda(*make((64,), 64, 500, torch.bfloat16, bias=True))
    want = linear_cross_entropy(e, c, t, b)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        e1 = e.clone().requires_grad_()
        got = linear_cross_entropy(e1, c, t, b)
        got.backward()
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(got, want)
    assert torch.isfinite(e1.grad).all()


def test_bad_inputs_are_deferred_to_status():
    """By default nothing is read back at a call: a bad target makes the loss NaN (and every later
    loss on the stream while the error is unread), status() raises the library's typed error
    and clears it; a host-side error (a CPU tensor among CUDA ones) still raises at the call."""
    assert get_checks() == "deferred"
    e, c, t, _ = cuda(*make((8,), 16, 40))
    bad = t.clone()
    bad[3] = 40
    assert torch.isnan(linear_cross_entropy(e, c, bad))
    assert torch.isnan(linear_cross_entropy(e, c, t))
    with pytest.raises(CceError) as excinfo:
        status()
    assert kind_of(excinfo) == "TargetOutOfRange"
    report = status()
    assert report is not None and report["n_valid"] == 8
    assert torch.isfinite(linear_cross_entropy(e, c, t))
    with pytest.raises(CceError) as excinfo:
        linear_cross_entropy(e, c.cpu(), t)
    assert kind_of(excinfo) == "Unsupported"
    assert status(torch.device("cpu")) is None


def test_bad_inputs_raise_with_eager_checks():
    e, c, t, _ = cuda(*make((8,), 16, 40))
    bad = t.clone()
    bad[3] = 40
    set_checks("eager")
    try:
        with pytest.raises(CceError) as excinfo:
            linear_cross_entropy(e, c, bad)
        assert kind_of(excinfo) == "TargetOutOfRange"
        e_nan = e.clone()
        e_nan[2, 1] = float("nan")
        with pytest.raises(CceError) as excinfo:
            linear_cross_entropy(e_nan, c, t)
        assert kind_of(excinfo) == "NonFinite"
    finally:
        set_checks("deferred")
    # The eager call read and cleared its error: nothing is left for status().
    assert status() is not None


def test_return_stats_reads_the_device_counts():
    """Statistics need the device's counts: a call with return_stats=True is eager."""
    e, c, t, _ = cuda(*make((16,), 32, 100, ignore=0.25, seed=7))
    n_valid = int((t != -100).sum())
    _, stats = linear_cross_entropy(e, c, t, return_stats=True)
    assert stats["forward"]["n_valid"] == n_valid


def test_torch_compile_fullgraph():
    e, c, t, b = cuda(*make((2, 33), 64, 300, torch.bfloat16, bias=True, ignore=0.1))

    def step(e, c, t, b):
        return linear_cross_entropy(e, c, t, b, shift=1) * 2.0

    compiled = torch.compile(step, fullgraph=True)
    e1, c1 = e.clone().requires_grad_(), c.clone().requires_grad_()
    e2, c2 = e.clone().requires_grad_(), c.clone().requires_grad_()
    l1 = step(e1, c1, t, b)
    l2 = compiled(e2, c2, t, b)
    l1.backward()
    l2.backward()
    assert torch.equal(l1, l2)
    assert torch.equal(e1.grad, e2.grad) and torch.equal(c1.grad, c2.grad)


def test_cuda_graph_capture_and_replay():
    """A training step's loss and backward captured in a CUDA graph (the calls read nothing back
    while the stream captures), replayed on new contents of the captured input: the loss and
    the gradient match an eager call on the same data."""
    e, c, t, _ = cuda(*make((64,), 64, 500, torch.bfloat16, ignore=0.1))
    static_e = e.clone().requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up outside the capture (kernels loaded, cuBLAS handle lent)
            linear_cross_entropy(static_e, c, t).backward()
    torch.cuda.current_stream().wait_stream(s)
    static_e.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        loss = linear_cross_entropy(static_e, c, t)
        loss.backward()
    for trial in range(3):
        fresh = (e.float() + 0.5 * trial * torch.randn_like(e, dtype=torch.float32)).to(e.dtype)
        with torch.no_grad():
            static_e.copy_(fresh)
        g.replay()
        torch.cuda.synchronize()
        ref = fresh.clone().requires_grad_()
        want = linear_cross_entropy(ref, c, t)
        want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(static_e.grad, ref.grad, rtol=1e-2, atol=1e-5)


def test_gradient_through_the_lse_recomputes():
    """The forward computes the gradients eagerly for the loss; a gradient through the returned
    lse takes the recomputing backward instead, and both match the f64 reference."""
    e, c, t, b = cuda(*make((48,), 64, 300, torch.float32, bias=True, ignore=0.1))
    e1, c1, b1 = (x.clone().requires_grad_() for x in (e, c, b))
    loss, lse = linear_cross_entropy(e1, c1, t, b1, return_lse=True, filter_eps=None)
    (loss + 0.1 * lse.square().mean()).backward()
    e2, c2, b2 = (x.double().requires_grad_() for x in (e, c, b))
    x = F.linear(e2, c2, b2)
    want = F.cross_entropy(x, t, ignore_index=-100) + 0.1 * torch.logsumexp(x, -1).square().mean()
    want.backward()
    for got, ref in ((e1.grad, e2.grad), (c1.grad, c2.grad), (b1.grad, b2.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.5, 3.0])
def test_eager_gradients_scale_with_the_upstream(dtype, scale):
    """The forward's gradients (upstream 1), scaled in place by the backward, against the
    recomputing backward (``return_lse``: a gradient through the lse takes it)."""
    e, c, t, b = cuda(*make((64,), 64, 500, dtype, bias=True, ignore=0.1))
    xs = [x.clone().requires_grad_() for x in (e, c, b)]
    (linear_cross_entropy(xs[0], xs[1], t, xs[2], filter_eps=None) * scale).backward()
    ys = [x.clone().requires_grad_() for x in (e, c, b)]
    loss, lse = linear_cross_entropy(ys[0], ys[1], t, ys[2], filter_eps=None, return_lse=True)
    (loss * scale + 0.0 * lse.sum()).backward()
    for x, y in zip(xs, ys, strict=True):
        # bf16: the eager path rounds G·1 to bf16 and then scales, the recomputing one rounds
        # G·scale once; an entry that is a sum of cancelling terms differs by a few bf16 units
        # of the gradient's largest entries, not of its own.
        big = y.grad.abs().max().item()
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 * 2.0**-7, atol=2.0**-7 * big)
        torch.testing.assert_close(x.grad, y.grad, **tol)


def test_eager_backward_allocates_no_second_copy():
    """The backward scales the held gradients in place and autograd adopts them as ``.grad``:
    nothing gradient-sized is allocated during the backward (the held gradients plus a scaled
    copy would be 12 MiB here)."""
    e, c, t, b = cuda(*make((4096,), 256, 8192, torch.float32, bias=True))
    xs = [x.clone().requires_grad_() for x in (e, c, b)]
    loss = linear_cross_entropy(xs[0], xs[1], t, xs[2], filter_eps=None) * 0.5
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    torch.cuda.synchronize()
    grad_bytes = sum(x.numel() * x.element_size() for x in xs)
    assert torch.cuda.max_memory_allocated() - before < grad_bytes // 8
    assert torch.cuda.memory_allocated() <= before


def test_eager_retained_graph_second_backward_recomputes():
    """The first backward spends the held gradients; a second one through the retained graph
    recomputes them."""
    e, c, t, b = cuda(*make((64,), 64, 500, torch.float32, bias=True, ignore=0.1))
    xs = [x.clone().requires_grad_() for x in (e, c, b)]
    loss = linear_cross_entropy(xs[0], xs[1], t, xs[2], filter_eps=None) * 0.5
    first = torch.autograd.grad(loss, xs, retain_graph=True)
    second = torch.autograd.grad(loss, xs)
    for f, s in zip(first, second, strict=True):
        torch.testing.assert_close(s, f, rtol=1e-5, atol=1e-6)


def test_eager_double_backward_raises():
    """``create_graph=True`` takes the recomputing backward, which has no second-order formula."""
    e, c, t, _ = cuda(*make((32,), 32, 100, torch.float32))
    e1 = e.clone().requires_grad_()
    (d_e,) = torch.autograd.grad(linear_cross_entropy(e1, c, t), e1, create_graph=True)
    assert torch.isfinite(d_e).all()
    with pytest.raises(CceError, match="no second derivative"):
        d_e.sum().backward()
