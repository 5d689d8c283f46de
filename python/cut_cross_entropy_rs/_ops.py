"""The ``torch.library`` custom ops around the native extension.

Three ops, ``cut_cross_entropy_rs::forward``, ``cut_cross_entropy_rs::backward`` and
``cut_cross_entropy_rs::forward_eager`` (the forward and the gradients in one call), each with a
fake (meta) kernel, and the autograd formulas of the two forwards, so ``torch.compile`` traces
through a call (``fullgraph=True``) without running it.

When to compute the gradients, decided by measurement:
- CUDA tensors, reduction mean or sum, a gradient needed: ``forward_eager`` computes the loss
  and the gradients of an upstream gradient of 1 in one call (the logits computed once, the
  sparse backward reusing the forward's GEMM), and the backward scales them by the real
  upstream gradient, as Liger does. Measured on the H200 at 32768 x 4096 x 256000 (bf16):
  the forward then a backward that recomputes took 245 ms filtered on randn and 548 ms
  exact, the fused call 128 ms and 425 ms (``python -m cut_cross_entropy_rs.bench`` and the
  dense bench, same session): one logits GEMM (~100 ms) saved. Its price: ``d_e`` and ``d_c``
  are held from the forward to the backward (the classifier's size). The backward scales them
  in place and lets go of them, so autograd owns the returned tensors alone and
  ``AccumulateGrad`` adopts them as ``.grad`` without a copy (no second gradient-sized buffer).
  A gradient through the returned ``lse``, a ``create_graph=True`` backward and a second
  backward through a retained graph (the held gradients are spent) take the recomputing
  backward instead. On CPU tensors the op runs the CPU backend's forward, then its backward
  with an upstream gradient of 1 (the package does not choose it there; it keeps the op and its
  autograd formula testable everywhere).
- Otherwise (CPU tensors, ``reduction="none"``, no gradient needed): the backward recomputes
  the logits from the saved ``lse`` and ``rest_mass`` (``1 − p_y`` per row, kept without
  cancellation; paper section 4.3). On the CPU backend (N=1024, D=256, V=16384, 2 cores):
  forward 0.77 s, backward 2.0 s, a separate pass either way; a per-row upstream weight does
  not factor out of ``d_c = Gᵀ E``, so ``reduction="none"`` cannot scale eager gradients.

Options travel as typed arguments of the ops (:class:`Options`, in the ops' argument order),
so that ``torch.compile`` passes them through, symbolic floats included (``dynamic=True``).

Device dispatch lives in the native extension: CPU tensors run on the CPU backend, read in
place; CUDA tensors on the CUDA backend on ``torch.cuda.current_stream()`` of their device, read
in place (raw device pointers), outputs allocated here with torch so its caching allocator
accounts for them. Their input checks are deferred (:mod:`.checks`): no call reads the device
back, except eager checks (``set_checks("eager")``, ``return_stats=True``), and a recomputing
backward given both an upstream gradient of the lse and a mean's or sum's upstream gradient
(without the former it asks for the gradients of an upstream gradient of 1 and scales them on
the device, as the eager path does).
"""

from __future__ import annotations

import inspect
import weakref
from typing import NamedTuple, Optional, get_type_hints

import torch
from torch import Tensor

from . import _native
from .checks import eager_for

__all__ = ["CceError", "CallStats", "Options", "forward_op", "forward_eager_op", "backward_op"]

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


class Options(NamedTuple):
    """The options of a call, in the ops' argument order. The numbers are validated by the
    library (``CceError`` of kind ``InvalidOption``)."""

    reduction: str = "mean"
    ignore_index: int = -100
    shift: int = 0
    softcap: Optional[float] = None
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    filter_mode: str = "auto"
    """``"auto"`` (the dtype's epsilon / 32), ``"off"`` (exact) or ``"value"`` (``filter_eps``)."""
    filter_eps: float = 0.0
    max_dropped_mass: float = 1e-3
    filter_e_grad: bool = True
    filter_c_grad: bool = True
    workspace_budget_bytes: int = -1
    """Negative: the library's default (512 MiB)."""
    deterministic: bool = False
    check_finite: bool = True
    dc_in_grad_dtype: bool = False
    """CUDA, exact bf16 calls with bf16 gradients: ``d_c`` accumulated in the output dtype where
    the budget holds no f32 accumulator (Liger's trade; ignored on the CPU)."""
    entropy: bool = False
    """Forward side output: entropy per row."""
    argmax: bool = False
    """Forward side output: argmax per row."""


def _stream(t: Tensor) -> int:
    """torch's current stream of ``t``'s device as a ``CUstream`` (0 for CPU tensors)."""
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def _options_as_arguments(fn):
    """``fn(<its own arguments>, *opts)`` as a custom op's prototype: its signature gets the
    fields of :class:`Options`, typed by their annotations, in place of ``*opts``, so that torch
    infers the op's schema with every option as a typed argument (declared once, in
    :class:`Options`, for every op). The op calls ``fn`` with all of them positionally."""
    sig = inspect.signature(fn)
    types = get_type_hints(Options)
    own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    options = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=types[name])
        for name in Options._fields
    ]
    fn.__signature__ = sig.replace(parameters=own + options)
    return fn


def _native_options(o: Options) -> dict:
    """``o`` as the native extension's options dict (the library's ``Options`` by name)."""
    d = o._asdict()
    mode, eps = d.pop("filter_mode"), d.pop("filter_eps")
    # "auto", or a word the library parses ("off", "exact", or a bad one it names).
    d["filter_eps"] = eps if mode == "value" else None if mode == "off" else mode
    if d["workspace_budget_bytes"] < 0:
        del d["workspace_budget_bytes"]
    del d["entropy"], d["argmax"]
    return d


def _forward_outputs(e: Tensor, o: Options):
    n = _rows(e)
    f32 = dict(dtype=torch.float32, device=e.device)
    loss = torch.empty((n,) if o.reduction == "none" else (), **f32)
    lse = torch.empty((n,), **f32)
    rest_mass = torch.empty((n,), **f32)
    ent = torch.empty((n if o.entropy else 0,), **f32)
    arg = torch.empty((n if o.argmax else 0,), dtype=torch.int32, device=e.device)
    return loss, lse, rest_mass, ent, arg


@torch.library.custom_op("cut_cross_entropy_rs::forward", mutates_args=())
@_options_as_arguments
def forward_op(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Optional[Tensor],
    stats_id: int,
    *opts,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Loss (``[]`` or ``[N]`` f32), lse and rest mass ``1 − p_y`` (``[N]`` f32 each, saved for
    the backward), entropy and argmax (``[N]``, or empty when not asked) of
    ``CE(e cᵀ + bias, targets)``. The arguments after ``stats_id`` are the fields
    of :class:`Options`; ``stats_id`` files the call's statistics (-1: none)."""
    o = Options(*opts)
    loss, lse, rest_mass, ent, arg = _forward_outputs(e, o)
    stats = _native.forward(
        e.contiguous(),
        c.contiguous(),
        None if bias is None else bias.contiguous(),
        targets.contiguous(),
        _native_options(o),
        loss,
        lse,
        rest_mass,
        ent if o.entropy else None,
        arg if o.argmax else None,
        stream=_stream(e),
        eager=eager_for(stats_id),
    )
    _record(stats_id, "forward", stats)
    return loss, lse, rest_mass, ent, arg


@forward_op.register_fake
def _forward_fake(e, c, targets, bias, stats_id, *opts):
    return _forward_outputs(e, Options(*opts))


@torch.library.custom_op("cut_cross_entropy_rs::backward", mutates_args=())
@_options_as_arguments
def backward_op(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Optional[Tensor],
    lse: Tensor,
    rest_mass: Tensor,
    d_loss: Tensor,
    d_lse: Optional[Tensor],
    need_d_e: bool,
    need_d_c: bool,
    need_d_bias: bool,
    stats_id: int,
    *opts,
) -> tuple[Tensor, Tensor, Tensor]:
    """``d_e``, ``d_c``, ``d_bias`` (in the input dtype; empty when not needed) from the saved
    ``lse`` and ``rest_mass`` and the upstream gradients of the loss and the lse. The arguments after
    ``stats_id`` are the fields of :class:`Options`."""
    o = Options(*opts)
    d_e, d_c, d_bias = _gradient_outputs(e, c, bias, need_d_e, need_d_c, need_d_bias)
    if need_d_e or need_d_c or (need_d_bias and bias is not None):
        # A mean's or sum's upstream gradient on CUDA without one of the lse: the gradients of an
        # upstream gradient of 1, scaled here on the device (the native call reads nothing back).
        # Not with eager checks (the native call checks the real upstream for NaN/Inf) nor for
        # float16 (the unit gradients would be rounded to f16 before a loss scaler's factor).
        unit = (
            e.is_cuda
            and o.reduction != "none"
            and d_lse is None
            and e.dtype != torch.float16
            and not eager_for(stats_id)
        )
        outs = (
            d_e if need_d_e else None,
            d_c if need_d_c else None,
            d_bias if need_d_bias and bias is not None else None,
        )
        stats = _native.backward(
            e.contiguous(),
            c.contiguous(),
            None if bias is None else bias.contiguous(),
            targets.contiguous(),
            _native_options(o),
            lse.contiguous(),
            rest_mass.contiguous(),
            d_loss.to(torch.float32).contiguous(),
            None if d_lse is None else d_lse.to(torch.float32).contiguous(),
            *outs,
            stream=_stream(e),
            unit_d_loss=unit,
            eager=eager_for(stats_id),
        )
        if unit:
            scale = d_loss.to(torch.float32)
            for g in outs:
                if g is not None:
                    g.mul_(scale)
        _record(stats_id, "backward", stats)
    return d_e, d_c, d_bias


def _no_second_derivative(ctx, *grads):
    """The backward of :func:`backward_op`: none (there is no second-order formula); reached by a
    backward through gradients taken with ``create_graph=True``."""
    err = CceError(
        "cut_cross_entropy_rs has no second derivative: the gradients of linear_cross_entropy "
        "(taken with create_graph=True) cannot be differentiated again (double backward, "
        "gradient penalties, Hessian-vector products)"
    )
    err.kind = "Unsupported"
    raise err


def _setup_backward_context(ctx, inputs, output):
    """Nothing to save: :func:`_no_second_derivative` only raises."""


backward_op.register_autograd(_no_second_derivative, setup_context=_setup_backward_context)


def _gradient_outputs(e, c, bias, need_d_e, need_d_c, need_d_bias):
    """Fresh contiguous gradients (empty when not needed)."""

    def like(x, need):
        return torch.empty(x.shape, dtype=x.dtype, device=x.device) if need else x.new_empty((0,))

    return like(e, need_d_e), like(c, need_d_c), like(c, False) if bias is None else like(bias, need_d_bias)


@backward_op.register_fake
def _backward_fake(
    e, c, targets, bias, lse, rest_mass, d_loss, d_lse, need_d_e, need_d_c, need_d_bias, stats_id, *opts
):
    return _gradient_outputs(e, c, bias, need_d_e, need_d_c, need_d_bias)


def _setup_context(ctx, inputs, output):
    e, c, targets, bias, stats_id = inputs[:5]
    _, lse, rest_mass, entropy, argmax = output
    # The rest mass is saved state; the entropy and argmax are statistics of the forward. None
    # has a gradient.
    ctx.mark_non_differentiable(rest_mass, entropy, argmax)
    ctx.save_for_backward(e, c, targets, bias, lse, rest_mass)
    ctx.stats_id = stats_id
    ctx.opts = Options(*inputs[5:])
    ctx.has_bias = bias is not None
    ctx.set_materialize_grads(False)


def _backward(ctx, d_loss, d_lse, d_rest_mass, d_entropy, d_argmax):
    e, c, targets, bias, lse, rest_mass = ctx.saved_tensors
    need_d_e, need_d_c = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_d_bias = ctx.has_bias and ctx.needs_input_grad[3]
    none = (None,) * (5 + len(Options._fields))
    if d_loss is None and d_lse is None:
        return none
    if d_loss is None:
        d_loss = lse.new_zeros((lse.shape[0],) if ctx.opts.reduction == "none" else ())
    d_e, d_c, d_bias = backward_op(
        e, c, targets, bias, lse, rest_mass, d_loss, d_lse, need_d_e, need_d_c, need_d_bias, ctx.stats_id, *ctx.opts
    )
    grads = (d_e if need_d_e else None, d_c if need_d_c else None, None, d_bias if need_d_bias else None)
    return grads + none[4:]


forward_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("cut_cross_entropy_rs::forward_eager", mutates_args=())
@_options_as_arguments
def forward_eager_op(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Optional[Tensor],
    need_d_e: bool,
    need_d_c: bool,
    need_d_bias: bool,
    stats_id: int,
    *opts,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`forward_op`'s outputs, then ``d_e``, ``d_c``, ``d_bias`` (input dtype; empty when
    not needed) of the loss with an upstream gradient of 1: on CUDA tensors from one call that
    computes the logits once, on CPU tensors from the CPU backend's forward then backward.

    Under autograd the three gradients belong to the backward, which scales them in place by
    the upstream gradient and returns them as the gradients of ``e``, ``c`` and ``bias``: a
    caller must not keep or use them (``linear_cross_entropy`` drops them at once)."""
    o = Options(*opts)
    loss, lse, rest_mass, ent, arg = _forward_outputs(e, o)
    d_e, d_c, d_bias = _gradient_outputs(e, c, bias, need_d_e, need_d_c, need_d_bias)
    inputs = (e.contiguous(), c.contiguous(), None if bias is None else bias.contiguous(), targets.contiguous())
    side = (ent if o.entropy else None, arg if o.argmax else None)
    grads = (d_e if need_d_e else None, d_c if need_d_c else None, d_bias if need_d_bias and bias is not None else None)
    if e.is_cuda:
        fwd_stats, bwd_stats = _native.forward_backward(
            *inputs,
            _native_options(o),
            loss,
            lse,
            rest_mass,
            *side,
            *grads,
            stream=_stream(e),
            eager=eager_for(stats_id),
        )
    else:
        fwd_stats = _native.forward(*inputs, _native_options(o), loss, lse, rest_mass, *side, stream=0)
        bwd_stats = None
        if any(g is not None for g in grads):
            one = torch.ones((), dtype=torch.float32, device=e.device)
            bwd_stats = _native.backward(*inputs, _native_options(o), lse, rest_mass, one, None, *grads, stream=0)
    _record(stats_id, "forward", fwd_stats)
    if bwd_stats is not None:
        _record(stats_id, "backward", bwd_stats)
    return loss, lse, rest_mass, ent, arg, d_e, d_c, d_bias


@forward_eager_op.register_fake
def _forward_eager_fake(e, c, targets, bias, need_d_e, need_d_c, need_d_bias, stats_id, *opts):
    return _forward_outputs(e, Options(*opts)) + _gradient_outputs(e, c, bias, need_d_e, need_d_c, need_d_bias)


def _setup_eager_context(ctx, inputs, output):
    e, c, targets, bias, need_d_e, need_d_c, need_d_bias, stats_id = inputs[:8]
    _, lse, rest_mass, entropy, argmax, d_e, d_c, d_bias = output
    ctx.mark_non_differentiable(rest_mass, entropy, argmax, d_e, d_c, d_bias)
    ctx.save_for_backward(e, c, targets, bias, lse, rest_mass)
    # The gradients are plain attributes, not saved tensors: the backward takes them off ctx
    # (see ``_take_held``), scales them in place and hands them to autograd.
    ctx.held = [d_e if need_d_e else None, d_c if need_d_c else None, d_bias if need_d_bias else None]
    ctx.stats_id = stats_id
    ctx.opts = Options(*inputs[8:])
    ctx.has_bias = bias is not None
    ctx.set_materialize_grads(False)


def _take_held(ctx, needed: tuple[bool, bool, bool]) -> Optional[list]:
    """The forward's gradients of ``(e, c, bias)`` if they serve this backward, else None; taken
    off ``ctx`` in either case, so that a tensor returned from the backward has autograd as its
    only owner (``AccumulateGrad`` then adopts it as ``.grad`` instead of copying it) and an
    unused one is freed now. A second backward through a retained graph finds None: the held
    gradients were scaled in place by the first, and it recomputes."""
    held, ctx.held = ctx.held, None
    if held is None or any(n and h is None for n, h in zip(needed, held, strict=True)):
        return None
    return [h if n else None for n, h in zip(needed, held, strict=True)]


def _eager_backward(ctx, d_loss, d_lse, *_):
    needed = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[3])
    held = _take_held(ctx, needed)
    none = (None,) * (8 + len(Options._fields))
    if d_loss is None and d_lse is None:
        return none
    if held is None or d_lse is not None or torch.is_grad_enabled():
        # A gradient through the lse, one the forward did not compute, spent gradients (a
        # retained graph's second backward) or create_graph=True (whose own backward then raises
        # as the recomputing path's does): recompute.
        e, c, targets, bias, lse, rest_mass = ctx.saved_tensors
        if d_loss is None:
            d_loss = lse.new_zeros(())
        d_e, d_c, d_bias = backward_op(
            e, c, targets, bias, lse, rest_mass, d_loss, d_lse, *needed, ctx.stats_id, *ctx.opts
        )
        grads = [g if n else None for n, g in zip(needed, (d_e, d_c, d_bias), strict=True)]
    else:
        # The forward's gradients are those of an upstream gradient of 1: scale them in place,
        # on the device (no host read of the upstream).
        scale = d_loss.to(torch.float32)
        grads = [None if h is None else h.mul_(scale) for h in held]
    return (grads[0], grads[1], None, grads[2]) + none[4:]


forward_eager_op.register_autograd(_eager_backward, setup_context=_setup_eager_context)
