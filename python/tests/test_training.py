"""A user's training step with ``linear_cross_entropy`` in place of
``F.cross_entropy(F.linear(...))``: a small GPT-like model trained with AdamW, autocast, gradient
accumulation, activation checkpointing, frozen parameters, views, shifting, per-token weights,
the Liger module's edge cases, a double backward, determinism, pickling. CPU, small shapes."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import cut_cross_entropy_rs as cce
from cut_cross_entropy_rs import CceError, LigerFusedLinearCrossEntropyLoss, linear_cross_entropy

V, D = 53, 16


def rel(got, want):
    """``‖got − want‖ / ‖want‖`` in f64."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def torch_loss(h, w, y, b=None, **kw):
    """The line this package replaces: materialized logits, ``F.cross_entropy``."""
    return F.cross_entropy(F.linear(h, w, b).float().flatten(0, -2), y.flatten(), **kw)


class TinyGPT(nn.Module):
    """Embedding, two causal transformer layers, a final norm and an LM head (tied or not)."""

    def __init__(self, tied: bool, bias: bool):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True) for _ in range(2)
        )
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=bias)
        if tied:
            self.head.weight = self.emb.weight

    def hidden(self, x):
        h = self.emb(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return self.norm(h)


def train(loss_of, tied, bias, steps=4):
    torch.manual_seed(0)
    model = TinyGPT(tied, bias)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, V, (3, 9), generator=g)
        x[0, -2:] = -100  # padding in the targets
        h = model.hidden(x.clamp_min(0))
        loss = loss_of(h, model.head.weight, x, model.head.bias)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # The key part of the attention's input bias has a gradient of exactly 0 in exact arithmetic
    # (softmax is shift-invariant): AdamW turns its rounding noise into full steps, so it is left
    # out of the comparison.
    return losses, [p.detach().clone() for n, p in model.named_parameters() if "in_proj_bias" not in n]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_training_curve_matches_torch(tied, bias):
    ours, p1 = train(lambda h, w, x, b: linear_cross_entropy(h, w, x, b, shift=1, filter_eps=None), tied, bias)
    theirs, p2 = train(lambda h, w, x, b: torch_loss(h[:, :-1], w, x[:, 1:], b), tied, bias)
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b))
    for a, b in zip(p1, p2, strict=True):
        assert rel(a, b) < 1e-4


def leaves(*xs):
    return [None if x is None else x.detach().clone().requires_grad_() for x in xs]


def inputs(n=14, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(n, D, generator=g).to(dtype)
    c = (torch.randn(V, D, generator=g) / 3).to(dtype)
    b = torch.randn(V, generator=g).to(dtype)
    t = torch.randint(0, V, (n,), generator=g)
    t[3] = -100
    return e, c, b, t


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 8e-3), (torch.float16, 2e-3)], ids=str)
def test_gradients_against_f64(dtype, tol):
    e, c, b, t = inputs(dtype=dtype)
    xs = leaves(e, c, b)
    linear_cross_entropy(*xs[:2], t, xs[2], filter_eps=None).backward()
    ys = [x.detach().double().requires_grad_() for x in (e, c, b)]
    torch_loss(ys[0], ys[1], t, ys[2]).backward()
    for x, y in zip(xs, ys, strict=True):
        assert x.grad.dtype == dtype
        assert rel(x.grad, y.grad) < tol


def test_float64_raises_unsupported():
    """float64 is not a dtype of the library: a typed error (README: gradcheck in f64 is out)."""
    e, c, _, t = inputs()
    with pytest.raises(CceError) as err:
        linear_cross_entropy(e.double(), c.double(), t)
    assert err.value.kind == "Unsupported"


def test_autocast_bf16_with_f32_parameters():
    e, c, b, t = inputs()
    xs = leaves(e, c, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(*xs[:2], t, xs[2], filter_eps=None)
    loss.backward()
    ys = [x.bfloat16().double().requires_grad_() for x in (e, c, b)]
    want = torch_loss(ys[0], ys[1], t, ys[2])
    want.backward()
    assert loss.dtype == torch.float32 and rel(loss, want) < 1e-6
    for x, y in zip(xs, ys, strict=True):
        assert x.grad.dtype == torch.float32
        assert rel(x.grad, y.grad) < 8e-3  # the gradients of the bf16 casts come back in bf16


def test_gradient_accumulation_over_micro_batches():
    e, c, b, t = inputs(n=16)
    xs, ys = leaves(e, c, b), leaves(e, c, b)
    for i in range(0, 16, 4):
        (linear_cross_entropy(xs[0][i : i + 4], xs[1], t[i : i + 4], xs[2], filter_eps=None) / 4).backward()
        (torch_loss(ys[0][i : i + 4], ys[1], t[i : i + 4], ys[2]) / 4).backward()
    for x, y in zip(xs, ys, strict=True):
        assert rel(x.grad, y.grad) < 1e-5


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpoint_around_the_loss(reentrant):
    e, c, b, t = inputs()
    xs, ys = leaves(e, c, b), leaves(e, c, b)
    fn = lambda e, c, b: linear_cross_entropy(e, c, t, b, filter_eps=None)  # noqa: E731
    checkpoint(fn, *xs, use_reentrant=reentrant).backward()
    fn(*ys).backward()
    for x, y in zip(xs, ys, strict=True):
        assert torch.equal(x.grad, y.grad)


@pytest.mark.parametrize("frozen", ["c", "e"])
def test_frozen_head_or_frozen_input(frozen):
    e, c, b, t = inputs()
    xs, ys = leaves(e, c, b), leaves(e, c, b)
    i = 1 if frozen == "c" else 0
    xs[i], ys[i] = xs[i].detach(), ys[i].detach()
    linear_cross_entropy(xs[0], xs[1], t, xs[2], filter_eps=None).backward()
    torch_loss(ys[0], ys[1], t, ys[2]).backward()
    assert xs[i].grad is None
    for x, y in zip(xs, ys, strict=True):
        if x.requires_grad:
            assert rel(x.grad, y.grad) < 1e-5


def test_views_slices_and_transposes():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(3, 8, 2 * D, generator=g, requires_grad=True)
    head_t = (torch.randn(D, V, generator=g) / 3).requires_grad_()  # a [D, V] parameter, used as .t()
    t = torch.randint(0, V, (3, 7), generator=g)
    linear_cross_entropy(wide[:, :-1, ::2], head_t.t(), t, filter_eps=None).backward()
    w2, h2 = leaves(wide, head_t)
    torch_loss(w2[:, :-1, ::2], h2.t(), t).backward()
    assert rel(wide.grad, w2.grad) < 1e-5 and rel(head_t.grad, h2.grad) < 1e-5


def test_shift_matches_manual_shifting():
    g = torch.Generator().manual_seed(4)
    e = torch.randn(3, 8, D, generator=g)
    c = torch.randn(V, D, generator=g) / 3
    t = torch.randint(0, V, (3, 8), generator=g)
    t[1, 4] = -100
    xs, ys = leaves(e, c), leaves(e, c)
    linear_cross_entropy(xs[0], xs[1], t, shift=True, filter_eps=None).backward()
    torch_loss(ys[0][:, :-1], ys[1], t[:, 1:]).backward()
    for x, y in zip(xs, ys, strict=True):
        assert rel(x.grad, y.grad) < 1e-5


@pytest.mark.parametrize("batch", [(3, 8), (11,)], ids=["3d", "2d"])
@pytest.mark.parametrize("shift", [1, 2])
def test_shift_none_loss_and_lse_have_apples_shapes(batch, shift):
    """Apple's CCE with ``shift`` and ``reduction="none"`` returns ``loss[..., shift:]`` of the
    full layout: shape ``(..., T - shift)``, entry ``j`` the loss of row ``j`` against target
    ``j + shift`` (``shift_e = e[..., :-shift, :]``, its documented meaning), and the lse in
    the same shape."""
    g = torch.Generator().manual_seed(5)
    e = torch.randn(*batch, D, generator=g)
    c = torch.randn(V, D, generator=g) / 3
    t = torch.randint(0, V, batch, generator=g)
    t[..., -1] = -100
    loss, lse = linear_cross_entropy(e, c, t, shift=shift, reduction="none", return_lse=True)
    short = batch[:-1] + (batch[-1] - shift,)
    assert tuple(loss.shape) == short and tuple(lse.shape) == short
    want = torch_loss(e[..., :-shift, :], c, t[..., shift:], reduction="none").view(short)
    assert rel(loss, want) < 1e-6
    assert rel(lse, torch.logsumexp(e[..., :-shift, :] @ c.T, -1)) < 1e-6
    # Per-token weights aligned with the shifted targets apply directly.
    w = torch.rand(short, generator=g)
    weighted = (loss * w).sum() / w.sum()
    assert rel(weighted, (want * w).sum() / w.sum()) < 1e-6


def test_shift_past_the_sequence_gives_empty_rows():
    e, c, _, _ = inputs()
    t = torch.randint(0, V, (2, 3))
    loss = linear_cross_entropy(e[:6].view(2, 3, D), c, t, shift=5, reduction="none")
    assert tuple(loss.shape) == (2, 0)


def test_per_token_weights_with_reduction_none():
    e, c, b, t = inputs()
    w = torch.rand(t.shape, generator=torch.Generator().manual_seed(6))
    xs, ys = leaves(e, c, b), leaves(e, c, b)
    ((linear_cross_entropy(xs[0], xs[1], t, xs[2], reduction="none", filter_eps=None) * w).sum() / w.sum()).backward()
    ((torch_loss(ys[0], ys[1], t, ys[2], reduction="none") * w).sum() / w.sum()).backward()
    for x, y in zip(xs, ys, strict=True):
        assert rel(x.grad, y.grad) < 1e-5


def test_all_ignored_batches():
    e, c, b, t = inputs()
    t = torch.full_like(t, -100)
    with pytest.raises(CceError) as err:
        linear_cross_entropy(e, c, t)
    assert err.value.kind == "AllTargetsIgnored"
    xs = leaves(e, c, b)
    loss = linear_cross_entropy(xs[0], xs[1], t, xs[2], reduction="sum")
    loss.backward()
    assert loss.item() == 0.0 and all(x.grad.abs().max().item() == 0.0 for x in xs)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_liger_all_ignored_batch_is_zero(reduction):
    """Liger's module gives 0 and zero gradients for a batch whose targets are all ignored (its
    mean divides by ``max(n_valid, 1)``): a fully masked micro-batch must not stop training."""
    e, c, b, t = inputs()
    t = torch.full_like(t, -100)
    xs = leaves(e, c, b)
    fn = LigerFusedLinearCrossEntropyLoss(
        reduction=reduction, lse_square_scale=1e-3, return_z_loss=True, return_token_accuracy=True
    )
    out = fn(xs[1], xs[0], t, xs[2])
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.z_loss.item() == 0.0 and out.token_accuracy.item() == 0.0
    assert all(x.grad.abs().max().item() == 0.0 for x in xs)
    plain = LigerFusedLinearCrossEntropyLoss(reduction=reduction)(c, e, t)
    assert plain.item() == 0.0


def test_liger_mean_matches_torch_with_ignored_rows():
    e, c, b, t = inputs()
    xs, ys = leaves(e, c, b), leaves(e, c, b)
    LigerFusedLinearCrossEntropyLoss()(xs[1], xs[0], t, xs[2]).backward()
    torch_loss(ys[0], ys[1], t, ys[2]).backward()
    for x, y in zip(xs, ys, strict=True):
        assert rel(x.grad, y.grad) < 1e-5


@pytest.mark.parametrize("path", ["recomputing", "eager"])
def test_double_backward_is_a_clear_error(path):
    """A backward through the gradients (``create_graph=True``, e.g. a gradient penalty) raises
    ``CceError`` of kind ``Unsupported`` naming the missing second derivative."""
    from op_options import opts

    from cut_cross_entropy_rs._ops import forward_eager_op, forward_op

    e, c, _, t = inputs()
    (e1,) = leaves(e)
    if path == "recomputing":
        loss = linear_cross_entropy(e1, c, t)
    else:
        loss = forward_eager_op(e1, c, t, None, True, False, False, -1, *opts())[0]
        assert forward_op is not None
    (g,) = torch.autograd.grad(loss, e1, create_graph=True)
    with pytest.raises(CceError, match="second derivative") as err:
        g.square().sum().backward()
    assert err.value.kind == "Unsupported"


def test_deterministic_repeat_of_a_step():
    e, c, b, t = inputs(n=40)
    runs = []
    for _ in range(3):
        xs = leaves(e, c, b)
        loss = linear_cross_entropy(xs[0], xs[1], t, xs[2])
        loss.backward()
        runs.append([loss.detach()] + [x.grad for x in xs])
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0], strict=True))


def test_modules_pickle_and_state_dict():
    e, c, b, t = inputs()
    liger = LigerFusedLinearCrossEntropyLoss(lse_square_scale=1e-4, label_smoothing=0.1)
    apple = cce.LinearCrossEntropy(reduction="sum", z_loss=1e-3)
    assert liger.state_dict() == {} and apple.state_dict() == {}
    buf = io.BytesIO()
    torch.save(liger, buf)
    buf.seek(0)
    for m, again, args in [
        (liger, pickle.loads(pickle.dumps(liger)), (c, e, t, b)),
        (liger, torch.load(buf, weights_only=False), (c, e, t, b)),
        (apple, copy.deepcopy(apple), (e, c, t, b)),
    ]:
        assert torch.equal(m(*args), again(*args))


def test_no_grad_eval_and_stats():
    e, c, b, t = inputs()
    (e1,) = leaves(e)
    with torch.no_grad():
        loss = linear_cross_entropy(e1, c, t, b)
    assert not loss.requires_grad and abs(loss.item() - torch_loss(e, c, t, b).item()) < 1e-5
    loss, stats = linear_cross_entropy(e1, c, t, b, return_stats=True)
    value = loss.item()
    loss.backward()
    assert value == loss.item() and stats["forward"]["n_valid"] == 13
    assert stats["backward"]["entries_kept"] > 0


class CopyWatch(TorchDispatchMode):
    """Records the shapes of the tensors every op outside the custom ops writes."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.sizes.append((str(func), o.numel()))
        return out


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_empty_batch_makes_no_copy_of_the_classifier(reduction):
    """A batch of no rows ties the zero loss to ``c`` without a ``V x D`` copy (bf16 ``c`` once
    went through an f32 copy of itself)."""
    c = torch.randn(V, D).bfloat16().requires_grad_()
    e = torch.randn(0, D).bfloat16().requires_grad_()
    t = torch.zeros(0, dtype=torch.int64)
    with CopyWatch() as watch:
        loss = linear_cross_entropy(e, c, t, reduction=reduction)
    assert all(n < c.numel() for _, n in watch.sizes), watch.sizes
    loss.sum().backward()
    assert c.grad.abs().max().item() == 0.0 and c.grad.dtype == torch.bfloat16
