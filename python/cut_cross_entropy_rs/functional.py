"""``linear_cross_entropy``: the loss of a language model's output layer without the N x V logits.

Argument names and meanings follow Apple's ``cut_cross_entropy.linear_cross_entropy`` where they
overlap, so switching is one import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._ops import CceError, Options, forward_eager_op, forward_op, new_stats
from .vocab_parallel import vocab_parallel_call

__all__ = ["linear_cross_entropy"]

IGNORE_INDEX = -100


def _error(kind: str, message: str) -> CceError:
    err = CceError(message)
    err.kind = kind
    return err


def _options(
    ignore_index: int,
    softcap: float | None,
    reduction: str,
    shift: int,
    filter_eps: float | str | None,
    filter_e_grad: bool,
    filter_c_grad: bool,
    label_smoothing: float,
    z_loss: float,
    max_dropped_mass: float,
    workspace_budget_bytes: int | None,
    deterministic: bool,
    check_finite: bool,
    dc_in_grad_dtype: bool = False,
    entropy: bool = False,
    argmax: bool = False,
) -> Options:
    """The ops' :class:`Options` from the public arguments (validated by the library)."""
    if filter_eps is None:
        mode, eps = "off", 0.0
    elif isinstance(filter_eps, str):
        mode, eps = filter_eps, 0.0
    else:
        mode, eps = "value", float(filter_eps)
    return Options(
        reduction=reduction,
        ignore_index=int(ignore_index),
        shift=int(shift),
        softcap=None if softcap is None else float(softcap),
        label_smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        filter_mode=mode,
        filter_eps=eps,
        max_dropped_mass=float(max_dropped_mass),
        filter_e_grad=bool(filter_e_grad),
        filter_c_grad=bool(filter_c_grad),
        workspace_budget_bytes=-1 if workspace_budget_bytes is None else int(workspace_budget_bytes),
        deterministic=bool(deterministic),
        check_finite=bool(check_finite),
        dc_in_grad_dtype=bool(dc_in_grad_dtype),
        entropy=entropy,
        argmax=argmax,
    )


def linear_cross_entropy(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    softcap: float | None = None,
    reduction: str = "mean",
    shift: bool | int = 0,
    return_lse: bool = False,
    filter_eps: float | str | None = "auto",
    accum_e_fp32: bool = False,
    accum_c_fp32: bool = False,
    filter_e_grad: bool = True,
    filter_c_grad: bool = True,
    impl: str | None = None,
    vocab_parallel_options: Any = None,
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    max_dropped_mass: float = 1e-3,
    workspace_budget_bytes: int | None = None,
    deterministic: bool = False,
    check_finite: bool = True,
    dc_in_grad_dtype: bool = False,
    return_stats: bool = False,
):
    """Cross-entropy of the logits ``e @ c.T (+ bias)`` against ``targets``, without allocating
    the logits: ``F.cross_entropy((e @ c.T).float(), targets)``, with the logits accumulated in
    f32 and never rounded to the input dtype.

    :param e: Embeddings, shape ``(..., D)``, float32, float16 or bfloat16. Under
        ``torch.autocast`` ``e``, ``c`` and ``bias`` are cast to the autocast dtype first.
    :param c: Classifier, shape ``(V, D)``, the dtype of ``e``.
    :param targets: Class per row, shape ``e.shape[:-1]`` (or ``(N,)``), int64 or int32; each in
        ``[0, V)`` or ``ignore_index``.
    :param bias: Optional bias, shape ``(V,)``, the dtype of ``e``.
    :param ignore_index: Rows whose target is this have no loss and no gradient.
    :param softcap: Logit softcapping ``s · tanh(z / s)``; None for none.
    :param reduction: ``"mean"`` (over the rows with a target; a batch without any raises
        ``CceError`` of kind ``AllTargetsIgnored``, one of no rows ``EmptyInput``), ``"sum"`` or
        ``"none"`` (shape ``e.shape[:-1]``, 0 at ignored rows). A batch of no rows under
        ``"sum"`` or ``"none"`` gives 0 or an empty loss (and zero gradients), as
        ``F.cross_entropy`` does.
    :param shift: n-th next token prediction: row ``(..., t)`` of ``e`` pairs with target
        ``(..., t + shift)`` along the second-to-last axis of ``e``; True is 1. As in Apple's
        CCE, ``reduction="none"`` then gives shape ``(..., T - shift)`` (``T`` that axis's
        length), entry ``t`` the loss of that pair: the loss of
        ``F.cross_entropy(e[..., :-shift, :] @ c.T, targets[..., shift:])``; so does the lse.
    :param return_lse: Also return the log-sum-exp per row, shape ``e.shape[:-1]`` f32, or
        ``(..., T - shift)`` with ``shift`` (the rows of ``e`` that pair with a target); every
        row's value, ignored or not (Apple's CCE writes 0 at ignored rows); differentiable (for
        a z-loss).
    :param filter_eps: Gradient filtering: ``"auto"`` (the dtype's epsilon / 32), a float, or
        None for the exact gradient. Skipped entries are bounded per row by ``max_dropped_mass``.
    :param accum_e_fp32: Accepted for compatibility: gradients always accumulate in f32.
    :param accum_c_fp32: Accepted for compatibility: gradients always accumulate in f32.
    :param filter_e_grad: Apply the filter to the gradient of ``e``.
    :param filter_c_grad: Apply the filter to the gradients of ``c`` and ``bias``.
    :param impl: Accepted for compatibility with Apple's CCE and ignored (there is one).
    :param vocab_parallel_options: None, or a :class:`VocabParallelOptions`: ``c`` and ``bias``
        hold this rank's classes ``[start, stop)`` of a vocabulary sharded over a
        ``torch.distributed`` group; the loss and lse are those of the whole vocabulary, the
        gradient of ``e`` is summed over the ranks (CPU or CUDA tensors, the collectives on
        CPU tensors; :mod:`.vocab_parallel`).
    :param label_smoothing: Label smoothing in ``[0, 1)``.
    :param z_loss: Weight of ``lse²`` added to each row's loss (Liger's ``lse_square_scale``).
    :param max_dropped_mass: Per-row bound on the probability mass the filter may skip.
    :param workspace_budget_bytes: Extra memory the call may use; None for the default 512 MiB.
    :param deterministic: Bitwise-repeatable results.
    :param check_finite: Raise ``CceError`` of kind ``NonFinite`` on NaN/Inf inputs.
    :param dc_in_grad_dtype: Speed for accuracy in the gradient of ``c`` (CUDA, Hopper):
        exact calls (``filter_eps=None``) of bfloat16 inputs whose budget holds no f32
        ``V x D`` accumulator accumulate ``d_c`` across row chunks in the bfloat16 gradient
        itself (each chunk's product summed in f32, the running sum rounded once per chunk, as
        Liger does) and run 3 GEMMs instead of 4: 1.14-1.22x the 3-GEMM cuBLAS floor against
        1.47-1.57x on an H200, ``d_c`` 3.3e-3 to 3.9e-3 from an f64 truth against 1.7e-3
        (docs/perf-log.md of the repository, session 19). Ignored elsewhere (CPU tensors
        accumulate in f32).
    :param return_stats: Also return a :class:`CallStats` dict: the forward's statistics (strategy
        and why, valid rows, workspace) at once, the backward's (entries kept and skipped,
        dropped mass) once the backward has run. Eager mode only.
    :returns: ``loss``, or a tuple ``(loss[, lse][, stats])``.
    :raises CceError: every invalid input or option, with the library's message and ``kind``.
    """
    del accum_e_fp32, accum_c_fp32, impl
    if vocab_parallel_options is not None and return_stats:
        raise _error("Unsupported", "return_stats=True with vocab_parallel_options is not supported")
    if reduction not in ("mean", "sum", "none"):
        raise _error("InvalidOption", f"invalid option reduction: unknown reduction '{reduction}' (none, mean, sum)")
    if not isinstance(shift, int):
        raise _error("InvalidOption", f"invalid option shift: expected an int or a bool, got {shift!r}")
    shift = int(shift)
    budget = workspace_budget_bytes
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
        raise _error(
            "InvalidOption",
            f"invalid option workspace_budget_bytes: expected None or an int >= 0, got {workspace_budget_bytes!r}",
        )
    opts = _options(
        ignore_index,
        softcap,
        reduction,
        shift,
        filter_eps,
        filter_e_grad and filter_eps is not None,
        filter_c_grad and filter_eps is not None,
        label_smoothing,
        z_loss,
        max_dropped_mass,
        workspace_budget_bytes,
        deterministic,
        check_finite,
        dc_in_grad_dtype,
    )
    if vocab_parallel_options is not None:
        loss, lse = vocab_parallel_call(e, c, targets, bias, opts, vocab_parallel_options)
        loss, lse = _shaped(e, opts, loss, lse)
        stats = None
    elif _empty_batch(e, c, targets, bias, reduction):
        loss, lse, stats = _empty_call(e, c, bias, reduction)
    else:
        loss, lse, _, _, stats = _call(e, c, targets, bias, opts, return_stats)
    out: list[Any] = [loss]
    if return_lse:
        out.append(lse)
    if return_stats:
        out.append(stats)
    return out[0] if len(out) == 1 else tuple(out)


def _empty_batch(e, c, targets, bias, reduction: str) -> bool:
    """Whether the call is a well-formed batch of no rows under ``sum`` or ``none`` (which
    ``F.cross_entropy`` answers with 0 or an empty loss; the library refuses empty inputs, and a
    ``mean`` over no row stays its error)."""
    tensors = (e, c, targets) + (() if bias is None else (bias,))
    if reduction == "mean" or not all(isinstance(x, Tensor) for x in tensors):
        return False
    if e.dim() < 1 or e.shape[:-1].numel() != 0 or c.dim() != 2 or c.shape[1] != e.shape[-1]:
        return False
    if targets.numel() != 0 or targets.dtype not in (torch.int64, torch.int32):
        return False
    return bias is None or tuple(bias.shape) == (c.shape[0],)


def _zero_of(x: Tensor) -> Tensor:
    """A 0 (f32 scalar) whose gradient reaches ``x`` (as zeros), from one element of ``x``: no
    copy or pass over a classifier-sized tensor."""
    one = x[(0,) * x.dim()] if x.numel() > 0 else x.sum()
    return one.float() * 0.0


def _empty_call(e, c, bias, reduction: str):
    """``(loss, lse, stats)`` of a batch of no rows (:func:`_empty_batch`): the loss 0 (``sum``)
    or empty (``none``), f32, tied to ``e``, ``c`` and ``bias`` so that a backward gives them
    zero gradients; the lse empty; no pass ran, so the statistics are empty."""
    from ._ops import CallStats

    batch = e.shape[:-1]
    tie = _zero_of(c)
    if bias is not None:
        tie = tie + _zero_of(bias)
    rows = e.sum(-1).float() * 0.0 + tie  # e has no rows: nothing is read or copied
    loss = rows if reduction == "none" else rows.sum() + tie
    lse = torch.zeros(batch, dtype=torch.float32, device=e.device)
    return loss, lse, CallStats()


def _call(e, c, targets, bias, opts: Options, return_stats: bool):
    """Run the forward op; returns ``(loss, lse, entropy, argmax, stats)``, the loss and lse
    shaped ``e.shape[:-1]`` (the loss a scalar unless ``reduction="none"``), ``stats`` a
    :class:`CallStats` or None."""
    stats_id, stats = -1, None
    if return_stats:
        if torch.compiler.is_compiling():
            raise _error("Unsupported", "return_stats=True is available in eager mode only")
        stats_id, stats = new_stats()
    for name, x in (("e", e), ("c", c), ("targets", targets), ("bias", bias)):
        if not isinstance(x, Tensor) and not (name == "bias" and x is None):
            raise _error("InvalidOption", f"invalid option {name}: expected a torch.Tensor, got {type(x).__name__}")
    device_type = e.device.type
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        # As F.linear under autocast: the product runs in the autocast dtype (the casts are
        # differentiable, so f32 parameters get f32 gradients).
        dtype = torch.get_autocast_dtype(device_type)
        e, c = e.to(dtype), c.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    needs = [torch.is_grad_enabled() and x is not None and x.requires_grad for x in (e, c, bias)]
    if e.device.type == "cuda" and opts.reduction != "none" and any(needs) and e.dtype != torch.float16:
        # The gradients in the same call as the loss (the logits computed once), scaled by the
        # upstream gradient in the backward: see ``_ops``. Not for float16: gradients of an
        # upstream of 1 held in f16 lose what a loss scaler's factor (applied later) would have
        # lifted above f16's range, so f16 calls recompute with the real upstream.
        loss, lse, _, entropy, argmax, *_ = forward_eager_op(e, c, targets, bias, *needs, stats_id, *opts)
    else:
        loss, lse, _, entropy, argmax = forward_op(e, c, targets, bias, stats_id, *opts)
    loss, lse = _shaped(e, opts, loss, lse)
    return loss, lse, entropy, argmax, stats


def _shaped(e: Tensor, opts: Options, loss: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """The ops' flat loss and lse in the shape of ``e.shape[:-1]`` (the loss a scalar unless
    ``reduction="none"``)."""
    reduction, shift = opts.reduction, opts.shift
    batch = e.shape[:-1] if e.dim() >= 2 else e.shape
    lse = lse.view(batch)
    if reduction == "none":
        loss = loss.view(batch)
    if shift > 0 and len(batch) >= 1:
        # As Apple's CCE (``loss[..., shift:]`` of the target layout): the rows that pair with a
        # target, ``e[..., :-shift, :]``; entry t is the pair (t, t + shift).
        keep = max(batch[-1] - shift, 0)
        lse = lse[..., :keep]
        if reduction == "none":
            loss = loss[..., :keep]
    return loss, lse
