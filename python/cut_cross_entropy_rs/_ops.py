"""The ``torch.library`` custom ops around the native extension.

Two ops, ``cut_cross_entropy_rs::forward`` and ``cut_cross_entropy_rs::backward``, each with a
fake (meta) kernel, and the autograd formula linking them, so ``torch.compile`` traces through a
call (``fullgraph=True``) without running it.

The backward recomputes the logits from the saved ``lse`` (paper section 4.3) instead of the
forward computing the gradients eagerly as Liger does: on the CPU backend the two cost the same
(the backward is a separate pass either way), eager gradients would hold ``d_c`` (the size of the
classifier) from the forward to the backward, and they cannot serve ``reduction="none"`` or an
upstream gradient of ``lse`` (a per-row weight does not factor out of ``d_c = Gᵀ E``).

Options travel as one JSON string (a constant for the compiler): the keys of the native
``Options`` plus ``entropy`` and ``argmax`` (side outputs asked of the forward).

Device dispatch lives in the native extension: CPU tensors run on the CPU backend, read in
place; CUDA tensors are the place of the CUDA device API (raw device pointers on
``torch.cuda.current_stream()``, outputs allocated here with torch so its caching allocator
accounts for them, no host synchronization: the upstream gradient stays a device tensor).
"""

from __future__ import annotations

import json
import weakref
from typing import Optional

import torch
from torch import Tensor

from . import _native

__all__ = ["CceError", "CallStats", "forward_op", "backward_op"]

CceError = _native.CceError


class CallStats(dict):
    """Statistics of one call, filled as its passes run: ``forward`` (the plan's strategy and
    why, valid rows, workspace) as soon as the loss is computed, ``backward`` (entries kept and
    skipped, dropped probability mass per row) once the backward has run. Each is a dict with
    the fields of the library's ``CallStats`` plus ``summary``, the library's text report."""


# Stats dicts of calls made with ``return_stats=True``, by call id; weak, so a dict the caller
# drops is forgotten.
_STATS: "weakref.WeakValueDictionary[int, CallStats]" = weakref.WeakValueDictionary()
_NEXT_STATS_ID = [0]


def new_stats() -> tuple[int, CallStats]:
    """A fresh stats dict and the id the ops file it under."""
    _NEXT_STATS_ID[0] += 1
    stats = CallStats()
    _STATS[_NEXT_STATS_ID[0]] = stats
    return _NEXT_STATS_ID[0], stats


def _record(stats_id: int, phase: str, stats: dict) -> None:
    if stats_id >= 0:
        target = _STATS.get(stats_id)
        if target is not None:
            target[phase] = stats


def _rows(e: Tensor) -> int:
    """N: the product of ``e``'s leading dimensions (0 for a tensor of fewer than 2)."""
    if e.dim() < 2:
        return 0
    n = 1
    for s in e.shape[:-1]:
        n *= s
    return n


def _split(opts: str) -> tuple[dict, bool, bool]:
    o = json.loads(opts)
    entropy = bool(o.pop("entropy", False))
    argmax = bool(o.pop("argmax", False))
    return o, entropy, argmax


def _forward_outputs(e: Tensor, reduction: str, entropy: bool, argmax: bool):
    n = _rows(e)
    f32 = dict(dtype=torch.float32, device=e.device)
    loss = torch.empty((n,) if reduction == "none" else (), **f32)
    lse = torch.empty((n,), **f32)
    ent = torch.empty((n if entropy else 0,), **f32)
    arg = torch.empty((n if argmax else 0,), dtype=torch.int32, device=e.device)
    return loss, lse, ent, arg


@torch.library.custom_op("cut_cross_entropy_rs::forward", mutates_args=())
def forward_op(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Optional[Tensor],
    opts: str,
    stats_id: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Loss (``[]`` or ``[N]`` f32), lse (``[N]`` f32), entropy and argmax (``[N]``, or empty when
    not asked) of ``CE(e cᵀ + bias, targets)``."""
    o, entropy, argmax = _split(opts)
    loss, lse, ent, arg = _forward_outputs(e, o.get("reduction", "mean"), entropy, argmax)
    e, c = e.contiguous(), c.contiguous()
    stats = _native.forward(
        e,
        c,
        None if bias is None else bias.contiguous(),
        targets.contiguous(),
        o,
        loss,
        lse,
        ent if entropy else None,
        arg if argmax else None,
    )
    _record(stats_id, "forward", stats)
    return loss, lse, ent, arg


@forward_op.register_fake
def _forward_fake(e, c, targets, bias, opts, stats_id):
    o, entropy, argmax = _split(opts)
    return _forward_outputs(e, o.get("reduction", "mean"), entropy, argmax)


@torch.library.custom_op("cut_cross_entropy_rs::backward", mutates_args=())
def backward_op(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Optional[Tensor],
    lse: Tensor,
    d_loss: Tensor,
    d_lse: Optional[Tensor],
    opts: str,
    need_d_e: bool,
    need_d_c: bool,
    need_d_bias: bool,
    stats_id: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``d_e``, ``d_c``, ``d_bias`` (in the input dtype; empty when not needed) from the saved
    ``lse`` and the upstream gradients of the loss and the lse."""
    o, _, _ = _split(opts)
    d_e = torch.empty(e.shape, dtype=e.dtype, device=e.device) if need_d_e else e.new_empty((0,))
    d_c = torch.empty(c.shape, dtype=c.dtype, device=c.device) if need_d_c else c.new_empty((0,))
    d_bias = (
        torch.empty(bias.shape, dtype=bias.dtype, device=bias.device)
        if need_d_bias and bias is not None
        else c.new_empty((0,))
    )
    if need_d_e or need_d_c or need_d_bias:
        stats = _native.backward(
            e.contiguous(),
            c.contiguous(),
            None if bias is None else bias.contiguous(),
            targets.contiguous(),
            o,
            lse.contiguous(),
            d_loss.to(torch.float32).contiguous(),
            None if d_lse is None else d_lse.to(torch.float32).contiguous(),
            d_e if need_d_e else None,
            d_c if need_d_c else None,
            d_bias if need_d_bias and bias is not None else None,
        )
        _record(stats_id, "backward", stats)
    return d_e, d_c, d_bias


@backward_op.register_fake
def _backward_fake(e, c, targets, bias, lse, d_loss, d_lse, opts, need_d_e, need_d_c, need_d_bias, stats_id):
    d_e = torch.empty(e.shape, dtype=e.dtype, device=e.device) if need_d_e else e.new_empty((0,))
    d_c = torch.empty(c.shape, dtype=c.dtype, device=c.device) if need_d_c else c.new_empty((0,))
    d_bias = (
        torch.empty(bias.shape, dtype=bias.dtype, device=bias.device)
        if need_d_bias and bias is not None
        else c.new_empty((0,))
    )
    return d_e, d_c, d_bias


def _setup_context(ctx, inputs, output):
    e, c, targets, bias, opts, stats_id = inputs
    _, lse, entropy, argmax = output
    # The entropy and argmax are statistics of the forward, without a gradient.
    ctx.mark_non_differentiable(entropy, argmax)
    ctx.save_for_backward(e, c, targets, bias, lse)
    ctx.opts = opts
    ctx.stats_id = stats_id
    ctx.has_bias = bias is not None
    ctx.set_materialize_grads(False)


def _backward(ctx, d_loss, d_lse, d_entropy, d_argmax):
    e, c, targets, bias, lse = ctx.saved_tensors
    need_d_e, need_d_c = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_d_bias = ctx.has_bias and ctx.needs_input_grad[3]
    if d_loss is None and d_lse is None:
        return None, None, None, None, None, None
    if d_loss is None:
        o, _, _ = _split(ctx.opts)
        shape = (lse.shape[0],) if o.get("reduction", "mean") == "none" else ()
        d_loss = lse.new_zeros(shape)
    d_e, d_c, d_bias = backward_op(
        e, c, targets, bias, lse, d_loss, d_lse, ctx.opts, need_d_e, need_d_c, need_d_bias, ctx.stats_id
    )
    return (
        d_e if need_d_e else None,
        d_c if need_d_c else None,
        None,
        d_bias if need_d_bias else None,
        None,
        None,
    )


forward_op.register_autograd(_backward, setup_context=_setup_context)
