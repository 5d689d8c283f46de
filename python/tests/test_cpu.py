"""The CPU path against ``F.cross_entropy(F.linear(...))`` in f64: loss, lse and gradients for
every option, hostile shapes, ignored rows, and every bad input raising ``CceError``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cut_cross_entropy_rs as cce
from cut_cross_entropy_rs import CceError, linear_cross_entropy

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative tolerance of results returned in each dtype (the loss is always f32).
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make(n_shape, d, v, dtype=torch.float32, bias=False, seed=0, scale=1.0, ignore=0.0, ignore_index=-100):
    """Inputs rounded to ``dtype``: e ``(*n_shape, d)``, c ``(v, d)``, targets, bias."""
    g = torch.Generator().manual_seed(seed)
    e = (torch.randn(*n_shape, d, generator=g) * scale).to(dtype)
    c = (torch.randn(v, d, generator=g) * scale / d**0.5 * 4).to(dtype)
    t = torch.randint(0, v, n_shape, generator=g)
    if ignore > 0:
        t[torch.rand(n_shape, generator=g) < ignore] = ignore_index
    b = (torch.randn(v, generator=g)).to(dtype) if bias else None
    return e, c, t, b


def reference(
    e, c, t, b=None, ignore_index=-100, softcap=None, reduction="mean", shift=0, label_smoothing=0.0, z_loss=0.0
):
    """Loss and lse in f64 from the materialized logits; with ``shift`` both of the rows
    ``e[..., :-shift, :]``, as Apple's CCE returns them."""
    shift = int(shift)
    x = F.linear(e.double(), c.double(), None if b is None else b.double())
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    lse = torch.logsumexp(x, -1)
    if shift:
        xs, ts = x[..., :-shift, :], t[..., shift:]
        lse = lse[..., :-shift]
    else:
        xs, ts = x, t
    v = c.shape[0]
    rows = F.cross_entropy(
        xs.reshape(-1, v),
        ts.reshape(-1).long(),
        ignore_index=ignore_index,
        reduction="none",
        label_smoothing=label_smoothing,
    )
    valid = ts.reshape(-1) != ignore_index
    rows = rows + z_loss * torch.logsumexp(xs.reshape(-1, v), -1).square() * valid
    if reduction == "none":
        return rows.view(ts.shape), lse
    if reduction == "sum":
        return rows.sum(), lse
    return rows.sum() / valid.sum(), lse


def grads(loss, tensors, upstream=None):
    """d(loss)/d(tensors), with ``upstream`` for a non-scalar loss."""
    return torch.autograd.grad(loss, tensors, grad_outputs=upstream, allow_unused=True)


def close(got, want, tol, what):
    """``|got - want| <= tol · max(1, max |want|)``, reported with the worst index."""
    got, want = got.double(), want.double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    err = (got - want).abs()
    worst = err.max().item() if err.numel() else 0.0
    assert worst <= tol * scale, f"{what}: max |diff| {worst:.3e} at {err.argmax().item()} > {tol:.1e} x {scale:.3g}"


def check(e, c, t, b=None, *, grad_tol=None, loss_tol=2e-5, filter_eps=None, upstream=None, **kw):
    """Our loss, lse and gradients of e, c, bias against the f64 reference."""
    dtype = e.dtype
    grad_tol = GRAD_TOL[dtype] if grad_tol is None else grad_tol
    e1, c1 = e.clone().requires_grad_(), c.clone().requires_grad_()
    b1 = None if b is None else b.clone().requires_grad_()
    loss, lse = linear_cross_entropy(e1, c1, t, b1, filter_eps=filter_eps, return_lse=True, **kw)
    ref_kw = {
        k: v
        for k, v in kw.items()
        if k in ("ignore_index", "softcap", "reduction", "shift", "label_smoothing", "z_loss")
    }
    e2, c2 = e.double().requires_grad_(), c.double().requires_grad_()
    b2 = None if b is None else b.double().requires_grad_()
    ref, ref_lse = reference(e2, c2, t, b2, **ref_kw)
    assert loss.dtype == torch.float32
    close(loss, ref, loss_tol, "loss")
    close(lse, ref_lse, loss_tol, "lse")
    if upstream is None and loss.dim() > 0:
        upstream = torch.linspace(0.5, 1.5, loss.numel(), dtype=torch.float64, device=loss.device).view(loss.shape)
    ours = [x for x in (e1, c1, b1) if x is not None]
    theirs = [x for x in (e2, c2, b2) if x is not None]
    g1 = grads(loss, ours, None if upstream is None else upstream.float())
    g2 = grads(ref, theirs, upstream)
    for name, x, y, src in zip(("d_e", "d_c", "d_bias"), g1, g2, ours, strict=False):
        assert x.dtype == src.dtype, f"{name} dtype {x.dtype}"
        close(x, y, grad_tol, name)
    return loss


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_plain_matches_f64(dtype, reduction):
    e, c, t, _ = make((37,), 24, 101, dtype, ignore=0.2)
    check(e, c, t, reduction=reduction)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_option_together(dtype):
    e, c, t, b = make((3, 17), 20, 77, dtype, bias=True, ignore=0.1, ignore_index=5)
    for reduction in ("mean", "sum", "none"):
        check(e, c, t, b, ignore_index=5, softcap=3.0, reduction=reduction, shift=2, label_smoothing=0.1, z_loss=1e-2)


@pytest.mark.parametrize(
    "option",
    [
        dict(softcap=2.0),
        dict(softcap=50.0),
        dict(shift=True),
        dict(shift=3),
        dict(label_smoothing=0.25),
        dict(z_loss=1e-3),
        dict(ignore_index=0),
        dict(ignore_index=-1),
        dict(deterministic=True),
        dict(dc_in_grad_dtype=True),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_each_option(option):
    ii = option.get("ignore_index", -100)
    e, c, t, b = make((2, 19), 16, 53, ignore=0.15, ignore_index=ii, bias=True)
    for reduction in ("mean", "none"):
        check(e, c, t, b, reduction=reduction, **option)


@pytest.mark.parametrize(
    "n_shape,d,v",
    [
        ((1,), 1, 1),
        ((1,), 1, 2),
        ((2,), 3, 1),
        ((63,), 5, 65),
        ((65,), 63, 129),
        ((129,), 7, 1000),
        ((2, 3, 5), 9, 31),
        ((4, 1, 33), 8, 257),
    ],
)
def test_hostile_shapes(n_shape, d, v):
    e, c, t, b = make(n_shape, d, v, bias=True, seed=sum(n_shape) + d + v)
    check(e, c, t, b)
    check(e, c, t, b, reduction="none")


def test_workspace_budget_picks_the_strategy():
    """A small budget moves the CPU backend to tile ownership (same numbers); too small raises."""
    e, c, t, b = make((64,), 32, 500, bias=True, ignore=0.1)
    for budget in (65536, None):
        _, stats = linear_cross_entropy(e, c, t, b, workspace_budget_bytes=budget, return_stats=True)
        check(e, c, t, b, workspace_budget_bytes=budget)
        assert stats["forward"]["strategy"].startswith("tile-ownership" if budget else "chunked-dense")
    with pytest.raises(CceError, match="over the budget of 4096 B") as excinfo:
        linear_cross_entropy(e, c, t, b, workspace_budget_bytes=4096)
    assert kind_of(excinfo) == "ResourceLimit"


def test_filter_switches():
    """max_dropped_mass=0 and filter_e_grad/filter_c_grad=False give exact gradients."""
    e, c, t, _ = make((48,), 32, 512, torch.bfloat16, scale=2.0)
    check(e, c, t, filter_eps="auto", max_dropped_mass=0.0)
    check(e, c, t, filter_eps="auto", filter_e_grad=False, filter_c_grad=False)


def test_check_finite_off_propagates_nan():
    e, c, t, _ = make((8,), 6, 17)
    e[3, 2] = float("nan")
    assert torch.isnan(linear_cross_entropy(e, c, t, check_finite=False))


def test_int32_targets_and_flat_targets():
    e, c, t, _ = make((3, 11), 8, 40, ignore=0.2)
    check(e, c, t.to(torch.int32))
    check(e, c, t.reshape(-1))


def test_non_contiguous_inputs():
    e, c, t, b = make((8, 13), 12, 30, bias=True)
    e_t = e.transpose(0, 1).contiguous().transpose(0, 1)
    c_t = c.t().contiguous().t()
    assert not e_t.is_contiguous() and not c_t.is_contiguous()
    check(e_t, c_t, t, b)


def test_large_logits_stay_exact():
    e, c, t, _ = make((16,), 32, 64, scale=6.0)
    check(e, c, t, loss_tol=1e-5, grad_tol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_filtered_gradients_within_bound(dtype):
    """filter_eps='auto' (the default) skips entries whose total mass per row stays < 1e-3."""
    e, c, t, _ = make((48,), 32, 512, dtype, scale=2.0)
    check(e, c, t, filter_eps="auto", grad_tol=max(GRAD_TOL[dtype], 2e-3))
    check(e, c, t, filter_eps=1e-3, grad_tol=max(GRAD_TOL[dtype], 2e-3), filter_c_grad=False)


def test_ignored_rows_have_no_gradient():
    e, c, t, _ = make((10,), 8, 20)
    t[3] = t[7] = -100
    e1 = e.clone().requires_grad_()
    linear_cross_entropy(e1, c, t).backward()
    assert torch.all(e1.grad[3] == 0) and torch.all(e1.grad[7] == 0)
    assert torch.any(e1.grad[0] != 0)


def test_all_ignored_sum_and_none_are_zero():
    e, c, t, _ = make((6,), 4, 9)
    t[:] = -100
    for reduction in ("sum", "none"):
        e1 = e.clone().requires_grad_()
        loss = linear_cross_entropy(e1, c, t, reduction=reduction)
        assert torch.all(loss == 0)
        loss.sum().backward()
        assert torch.all(e1.grad == 0)


def test_lse_gradient_flows():
    """A z-loss computed by the caller from the returned lse (Apple's recipe)."""
    e, c, t, b = make((2, 9), 8, 33, bias=True)
    e1, c1, b1 = (x.clone().requires_grad_() for x in (e, c, b))
    loss, lse = linear_cross_entropy(e1, c1, t, b1, filter_eps=None, return_lse=True)
    (loss + 1e-2 * lse.square().mean()).backward()
    e2, c2, b2 = (x.double().requires_grad_() for x in (e, c, b))
    ref, ref_lse = reference(e2, c2, t, b2)
    (ref + 1e-2 * ref_lse.square().mean()).backward()
    for x, y, name in ((e1, e2, "d_e"), (c1, c2, "d_c"), (b1, b2, "d_bias")):
        close(x.grad, y.grad, 1e-5, name)


def test_only_some_gradients():
    """Each gradient alone, as when the other inputs are frozen."""
    e, c, t, b = make((12,), 8, 30, bias=True)
    ref_e, ref_c, ref_b = (x.double().requires_grad_() for x in (e, c, b))
    ref, _ = reference(ref_e, ref_c, t, ref_b)
    want = dict(zip("ecb", grads(ref, [ref_e, ref_c, ref_b]), strict=True))
    for which in "ecb":
        xs = {k: x.clone().requires_grad_(k == which) for k, x in zip("ecb", (e, c, b), strict=True)}
        linear_cross_entropy(xs["e"], xs["c"], t, xs["b"], filter_eps=None).backward()
        for k, x in xs.items():
            if k == which:
                close(x.grad, want[k], 1e-5, f"d_{k}")
            else:
                assert x.grad is None


def test_no_grad_forward():
    e, c, t, _ = make((12,), 8, 30)
    with torch.no_grad():
        loss = linear_cross_entropy(e, c, t)
    assert loss.requires_grad is False
    ref, _ = reference(e, c, t)
    close(loss, ref, 2e-5, "loss")


def test_apple_module():
    e, c, t, b = make((2, 10), 8, 21, bias=True)
    m = cce.LinearCrossEntropy(shift=1, reduction="sum", return_lse=True)
    loss, lse = m(e, c, t, b)
    ref, ref_lse = reference(e, c, t, b, shift=1, reduction="sum")
    close(loss, ref, 2e-5, "loss")
    close(lse, ref_lse, 2e-5, "lse")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_liger_module(reduction):
    e, c, t, b = make((24,), 16, 45, bias=True, ignore=0.2)
    fn = cce.LigerFusedLinearCrossEntropyLoss(
        lse_square_scale=1e-3,
        label_smoothing=0.1,
        reduction=reduction,
        softcap=10.0,
        return_z_loss=True,
        return_token_accuracy=True,
        return_predicted_tokens=True,
    )
    e1, c1, b1 = (x.clone().requires_grad_() for x in (e, c, b))
    out = fn(c1, e1, t, b1)
    e2, c2, b2 = (x.double().requires_grad_() for x in (e, c, b))
    kw = dict(reduction=reduction, softcap=10.0, label_smoothing=0.1, z_loss=1e-3)
    ref, lse = reference(e2, c2, t, b2, **kw)
    close(out.loss, ref, 2e-5, "loss")
    up = torch.ones_like(ref) if reduction == "none" else None
    for x, y, name in zip(
        grads(out.loss, [e1, c1, b1], None if up is None else up.float()),
        grads(ref, [e2, c2, b2], up),
        ("d_e", "d_c", "d_bias"),
        strict=True,
    ):
        close(x, y, 1e-5, name)
    valid = t != -100
    logits = F.linear(e.double(), c.double(), b.double())
    pred = torch.where(valid, (10.0 * torch.tanh(logits / 10.0)).argmax(-1), torch.full_like(t, -1))
    assert torch.equal(out.predicted_tokens, pred)
    z = 1e-3 * lse.detach().square() * valid
    acc = ((pred == t) & valid).double()
    if reduction == "none":
        close(out.z_loss, z, 1e-5, "z_loss")
        close(out.token_accuracy, acc, 0, "token_accuracy")
    else:
        div = valid.sum() if reduction == "mean" else 1
        close(out.z_loss, z.sum() / div if reduction == "mean" else z.sum(), 1e-5, "z_loss")
        close(out.token_accuracy, acc.sum() / valid.sum(), 1e-6, "token_accuracy")


def test_liger_plain_call_returns_the_loss():
    e, c, t, _ = make((24,), 16, 45)
    loss = cce.LigerFusedLinearCrossEntropyLoss()(c, e, t)
    ref, _ = reference(e, c, t)
    close(loss, ref, 2e-5, "loss")


def kind_of(excinfo):
    return getattr(excinfo.value, "kind", None)


BAD = {
    "e float64": (lambda e, c, t, b: (e.double(), c, t, b), {}, "Unsupported"),
    "e int": (lambda e, c, t, b: (e.to(torch.int32), c, t, b), {}, "DTypeMismatch"),
    "c dtype": (lambda e, c, t, b: (e, c.half(), t, b), {}, "DTypeMismatch"),
    "bias dtype": (lambda e, c, t, b: (e, c, t, b.half()), {}, "DTypeMismatch"),
    "c hidden size": (lambda e, c, t, b: (e, c[:, :-1], t, b), {}, "ShapeMismatch"),
    "c rank": (lambda e, c, t, b: (e, c.reshape(-1), t, b), {}, "ShapeMismatch"),
    "e rank": (lambda e, c, t, b: (e.reshape(-1), c, t, b), {}, "ShapeMismatch"),
    "bias shape": (lambda e, c, t, b: (e, c, t, b[:-1]), {}, "ShapeMismatch"),
    "targets shape": (lambda e, c, t, b: (e, c, t[:-1], b), {}, "ShapeMismatch"),
    "targets dtype": (lambda e, c, t, b: (e, c, t.float(), b), {}, "DTypeMismatch"),
    "targets uint8": (lambda e, c, t, b: (e, c, t.to(torch.uint8), b), {}, "Unsupported"),
    "target too large": (lambda e, c, t, b: (e, c, t.index_fill(0, torch.tensor([3]), 17), b), {}, "TargetOutOfRange"),
    "target negative": (lambda e, c, t, b: (e, c, t.index_fill(0, torch.tensor([0]), -5), b), {}, "TargetOutOfRange"),
    "all ignored": (lambda e, c, t, b: (e, c, torch.full_like(t, -100), b), {}, "AllTargetsIgnored"),
    "shift past sequence": (lambda e, c, t, b: (e, c, t, b), dict(shift=100), "AllTargetsIgnored"),
    "nan in e": (lambda e, c, t, b: (e.index_fill(0, torch.tensor([2]), float("nan")), c, t, b), {}, "NonFinite"),
    "inf in c": (lambda e, c, t, b: (e, c.index_fill(0, torch.tensor([1]), float("inf")), t, b), {}, "NonFinite"),
    "inf in bias": (lambda e, c, t, b: (e, c, t, b.index_fill(0, torch.tensor([1]), float("inf"))), {}, "NonFinite"),
    "empty rows": (lambda e, c, t, b: (e[:0], c, t[:0], b), {}, "EmptyInput"),
    "empty hidden": (lambda e, c, t, b: (e[:, :0], c[:, :0], t, b), {}, "EmptyInput"),
    "empty vocab": (lambda e, c, t, b: (e, c[:0], t, b[:0]), {}, "EmptyInput"),
    "softcap zero": (lambda *a: a, dict(softcap=0.0), "InvalidOption"),
    "softcap negative": (lambda *a: a, dict(softcap=-1.0), "InvalidOption"),
    "softcap nan": (lambda *a: a, dict(softcap=float("nan")), "InvalidOption"),
    "label smoothing 1": (lambda *a: a, dict(label_smoothing=1.0), "InvalidOption"),
    "z_loss negative": (lambda *a: a, dict(z_loss=-1.0), "InvalidOption"),
    "filter_eps zero": (lambda *a: a, dict(filter_eps=0.0), "InvalidOption"),
    "filter_eps above 1": (lambda *a: a, dict(filter_eps=2.0), "InvalidOption"),
    "filter_eps word": (lambda *a: a, dict(filter_eps="fast"), "InvalidOption"),
    "max_dropped_mass": (lambda *a: a, dict(max_dropped_mass=2.0), "InvalidOption"),
    "reduction": (lambda *a: a, dict(reduction="avg"), "InvalidOption"),
    "shift negative": (lambda *a: a, dict(shift=-1), "InvalidOption"),
    "shift float": (lambda *a: a, dict(shift=1.5), "InvalidOption"),
    "budget negative": (lambda *a: a, dict(workspace_budget_bytes=-5), "InvalidOption"),
    "targets list": (lambda e, c, t, b: (e, c, t.tolist(), b), {}, "InvalidOption"),
    "vocab parallel options": (lambda *a: a, dict(vocab_parallel_options=object()), "InvalidOption"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_raises(case):
    mutate, kw, kind = BAD[case]
    e, c, t, b = make((8,), 6, 17, bias=True)
    args = mutate(e, c, t, b)
    with pytest.raises(CceError) as excinfo:
        linear_cross_entropy(*args, **kw)
    if kind is not None:
        assert kind_of(excinfo) == kind, f"{case}: {excinfo.value!r}"
    assert str(excinfo.value)


def test_bad_input_raises_in_backward_too():
    """A NaN upstream gradient is refused by the library, not propagated silently."""
    e, c, t, _ = make((8,), 6, 17)
    e1 = e.clone().requires_grad_()
    loss = linear_cross_entropy(e1, c, t)
    with pytest.raises(CceError) as excinfo:
        loss.backward(torch.tensor(float("nan")))
    assert kind_of(excinfo) == "NonFinite"


def test_meta_tensors_give_shapes():
    """Meta tensors run the fake kernels: shapes and dtypes without computing."""
    e, c, t, b = (x.to("meta") for x in make((2, 8), 6, 17, bias=True))
    loss, lse = linear_cross_entropy(e, c, t, b, reduction="none", return_lse=True)
    assert loss.shape == (2, 8) and lse.shape == (2, 8) and loss.device.type == "meta"


def test_a_minus_inf_bias_masks_a_class():
    """-inf in the bias is a masked class (finite lse), not an error."""
    e, c, t, b = make((8,), 6, 17, bias=True)
    t[t == 1] = 0
    b[1] = float("-inf")
    check(e, c, t, b)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_empty_batch_sums_to_zero(reduction):
    """No rows under sum or none: 0 or an empty loss and zero gradients, as F.cross_entropy."""
    e, c, t, b = make((0,), 6, 17, bias=True)
    e1, c1, b1 = (x.clone().requires_grad_() for x in (e, c, b))
    loss, lse = linear_cross_entropy(e1, c1, t, b1, reduction=reduction, return_lse=True)
    want = F.cross_entropy(F.linear(e, c, b), t, reduction=reduction)
    assert loss.shape == want.shape and loss.dtype == torch.float32 and lse.shape == (0,)
    assert float(loss.sum()) == 0.0
    loss.sum().backward()
    for x in (e1, c1, b1):
        assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any()


def test_apple_module_takes_the_extra_keywords():
    e, c, t, _ = make((12,), 8, 21)
    m = cce.LinearCrossEntropy(filter_eps=None, label_smoothing=0.1, z_loss=1e-3, dc_in_grad_dtype=True)
    ref, _ = reference(e, c, t, label_smoothing=0.1, z_loss=1e-3)
    close(m(e, c, t), ref, 2e-5, "loss")
    with pytest.raises(TypeError):
        cce.LinearCrossEntropy(lse_square_scale=1e-3)


def test_liger_module_checks_its_reduction_when_made():
    with pytest.raises(CceError) as excinfo:
        cce.LigerFusedLinearCrossEntropyLoss(reduction="avg")
    assert kind_of(excinfo) == "InvalidOption"


def test_not_a_tensor_raises():
    e, c, t, _ = make((8,), 6, 17)
    with pytest.raises((CceError, TypeError, RuntimeError)):
        linear_cross_entropy(e.tolist(), c, t)


@pytest.mark.parametrize(
    "kw",
    [dict(ce_weight=torch.ones(3)), dict(use_token_scaling=True), dict(accum_dtype=torch.float16)],
    ids=["ce_weight", "use_token_scaling", "accum_dtype"],
)
def test_liger_unsupported_options_raise(kw):
    with pytest.raises(CceError) as excinfo:
        cce.LigerFusedLinearCrossEntropyLoss(**kw)
    assert kind_of(excinfo) == "Unsupported"


def test_error_message_is_the_librarys():
    e, c, t, _ = make((8,), 6, 17)
    t[5] = 99
    with pytest.raises(CceError, match=r"target out of range at row 5: 99 is not in \[0, 17\)"):
        linear_cross_entropy(e, c, t)


STATS_KEYS = {
    "backend",
    "strategy",
    "plan_reason",
    "n_valid",
    "tiles_total",
    "tiles_visited",
    "tiles_skipped",
    "entries_kept",
    "entries_skipped",
    "dropped_mass_max",
    "dropped_mass_mean",
    "filter_eps",
    "max_dropped_mass",
    "workspace_bytes",
    "summary",
}


def test_return_stats_forward_then_backward():
    e, c, t, _ = make((40,), 16, 300, scale=3.0, ignore=0.1)
    e1 = e.clone().requires_grad_()
    loss, lse, stats = linear_cross_entropy(e1, c, t, return_lse=True, return_stats=True)
    assert isinstance(stats, cce.CallStats) and set(stats) == {"forward"}
    fwd = stats["forward"]
    assert set(fwd) == STATS_KEYS
    assert fwd["backend"] == "cpu" and fwd["strategy"] and fwd["plan_reason"]
    assert fwd["n_valid"] == int((t != -100).sum())
    assert fwd["filter_eps"] == 2.0**-28 and fwd["max_dropped_mass"] == pytest.approx(1e-3)
    loss.backward()
    bwd = stats["backward"]
    assert set(bwd) == STATS_KEYS
    assert bwd["entries_kept"] > 0
    assert bwd["entries_kept"] + bwd["entries_skipped"] > 0
    assert 0.0 <= bwd["dropped_mass_mean"] <= bwd["dropped_mass_max"] <= 1e-3
    assert "strategy" in bwd["summary"] and "dropped mass" in bwd["summary"]


def test_return_stats_exact_and_with_lse():
    e, c, t, _ = make((20,), 8, 50)
    e1 = e.clone().requires_grad_()
    loss, stats = linear_cross_entropy(e1, c, t, filter_eps=None, return_stats=True)
    loss.backward()
    assert stats["backward"]["filter_eps"] == 0.0
    assert stats["backward"]["entries_skipped"] == 0
    assert stats["backward"]["dropped_mass_max"] == 0.0
    out = linear_cross_entropy(e, c, t, return_lse=True, return_stats=True)
    assert len(out) == 3 and out[1].shape == (20,) and "backward" not in out[2]


def test_autocast_casts_to_its_dtype():
    """Under torch.autocast f32 inputs run in the autocast dtype (as F.linear does) and the f32
    parameters get f32 gradients."""
    e, c, t, b = make((24,), 16, 45, bias=True)
    e1, c1, b1 = (x.clone().requires_grad_() for x in (e, c, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(e1, c1, t, b1, filter_eps=None)
    loss.backward()
    assert c1.grad.dtype == torch.float32
    e2, c2, b2 = (x.to(torch.bfloat16).double().requires_grad_() for x in (e, c, b))
    ref, _ = reference(e2, c2, t, b2)
    close(loss, ref, 2e-5, "loss")
    for x, y, name in zip((e1, c1, b1), grads(ref, [e2, c2, b2]), ("d_e", "d_c", "d_bias"), strict=True):
        close(x.grad, y, GRAD_TOL[torch.bfloat16], name)


def test_retained_graph_backward_twice():
    """The backward leaves its saved tensors untouched: a retained graph gives the same gradient
    again."""
    e, c, t, _ = make((16,), 8, 40)
    e1 = e.clone().requires_grad_()
    loss = linear_cross_entropy(e1, c, t)
    loss.backward(retain_graph=True)
    first = e1.grad.clone()
    loss.backward()
    close(e1.grad, 2 * first, 0, "d_e twice")


def test_checks_setting():
    """The checks mode of CUDA calls: deferred by default, eager on request, any other value a
    ValueError; the CPU device has no deferred status (its calls raise at the call)."""
    assert cce.get_checks() == "deferred"
    with pytest.raises(ValueError):
        cce.set_checks("sometimes")
    cce.set_checks("eager")
    try:
        assert cce.get_checks() == "eager"
        # CPU calls are checked at the call in either mode.
        e, c, t, _ = make((4,), 8, 10)
        bad = t.clone()
        bad[1] = 10
        with pytest.raises(cce.CceError):
            cce.linear_cross_entropy(e, c, bad)
    finally:
        cce.set_checks("deferred")
    e, c, t, _ = make((4,), 8, 10)
    bad = t.clone()
    bad[1] = 10
    with pytest.raises(cce.CceError):
        cce.linear_cross_entropy(e, c, bad)
    assert cce.status("cpu") is None
