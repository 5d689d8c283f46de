"""Vocabulary-parallel linear cross-entropy over ``torch.distributed``.

Large models shard the output layer's classes over the ranks of a tensor-parallel group
(Megatron-LM's vocab-parallel cross-entropy): every rank holds the whole batch ``e`` ``(N, D)``
and the targets, and its own classes ``c[start:stop]``. :func:`linear_cross_entropy` with
``vocab_parallel_options=VocabParallelOptions(...)`` (Apple CCE's names) then returns the loss of
the whole vocabulary on every rank, with the gradient of ``e`` summed over the ranks (the same
on every rank) and the gradients of this rank's ``c`` and ``bias`` rows.

Per call: the forward all-gathers per-row partials (max, sum of exponentials, target logit, ...;
``k · (7 + 8N)`` float64) and merges them on every rank; the backward all-reduces the dropped
mass and counters (``N + k + 5`` float64) and, when ``e`` needs a gradient, ``d_e`` (``N · D``
float32). Filtering keeps its per-row bound across shards: shard ``r`` may drop at most
``max_dropped_mass · (its real classes) / V``. The math and its contract:
``cce_core::vocab_parallel`` (Rust docs).

Devices: CPU tensors (the CPU reference's shard primitives) or CUDA tensors (the CUDA
backend's shard primitives, composed from its unsharded calls, on
``torch.cuda.current_stream()`` of the tensors' device; loss, lse and gradients come back on that
device). Either way the collectives run on 1-D CPU tensors through ``torch.distributed`` (a CPU
process group such as gloo): with CUDA tensors the merge of the partials and the ``d_e``
all-reduce go through the host (each call synchronizes the stream a few times and copies
``N · D`` f32 of ``d_e`` each way). Every tensor of a call on one device (``e`` on CUDA with
``c`` on the CPU raises ``CceError`` of kind ``Unsupported``, as the unsharded call does); not
inside a CUDA graph capture. Eager mode only (the collectives run inside the call, so
``torch.compile`` runs it outside the graph).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import _native
from ._ops import CceError, Options, _native_options, _stream

__all__ = ["VocabParallelOptions", "TorchDistributedComm", "partition_vocab"]


def partition_vocab(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Classes ``[start, stop)`` of ``rank`` when ``vocab_size`` classes are split over
    ``world_size`` ranks as evenly as possible (the first ``vocab_size % world_size`` ranks hold
    one class more; the library's ``ShardLayout::even``, Apple CCE's split)."""
    q, extra = divmod(vocab_size, world_size)
    start = rank * q + min(rank, extra)
    return start, start + q + (1 if rank < extra else 0)


@dataclass
class VocabParallelOptions:
    """Which classes this rank holds, and over which process group.

    :param start: First class of this rank's shard (``c`` and ``bias`` hold rows
        ``[start, stop)`` of the whole vocabulary).
    :param stop: One past its last class; rows at or past ``vocab_size`` are padding (never
        read, gradient 0), so a padded vocabulary never lets a target match a padding row.
    :param group: The ``torch.distributed`` process group (None: the default group).
    :param reduce_e_grad: Sum the gradient of ``e`` over the ranks (every rank then holds the
        whole gradient). Only True is supported.
    :param vocab_size: Real classes of the whole vocabulary; None: the largest ``stop`` over
        the ranks (one all-reduce per call; pass it when the vocabulary is padded).
    """

    start: int
    stop: int
    group: Any = None
    reduce_e_grad: bool = True
    vocab_size: Optional[int] = None

    @classmethod
    def from_vocab(cls, vocab_size: int, group: Any = None) -> "VocabParallelOptions":
        """This rank's even share of ``vocab_size`` classes (:func:`partition_vocab`)."""
        start, stop = partition_vocab(vocab_size, dist.get_rank(group), dist.get_world_size(group))
        return cls(start, stop, group, vocab_size=vocab_size)


class TorchDistributedComm:
    """The collectives the library calls back into: ``torch.distributed`` over ``group``.

    ``all_reduce(t, op)`` reduces the 1-D tensor ``t`` in place (``op`` "sum" or "max") and
    ``all_gather(t)`` returns the ranks' ``t`` concatenated in rank order; ``t`` is a CPU tensor
    of float32 or float64, whatever the device of the call's tensors.
    """

    def __init__(self, group: Any = None):
        self.group = group

    def rank(self) -> int:
        return dist.get_rank(self.group)

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def all_reduce(self, t: Tensor, op: str) -> Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, t: Tensor) -> Tensor:
        parts = [torch.empty_like(t) for _ in range(self.size())]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts)


def _error(kind: str, message: str) -> CceError:
    err = CceError(message)
    err.kind = kind
    return err


def _placed(t: Optional[Tensor]) -> Optional[Tensor]:
    """``t`` contiguous and, on CUDA, at an address the CUDA backend borrows in place (16-byte
    aligned: its vector loads); else a copy (differentiable). A rank's slice of a larger tensor
    (``bias[start:stop]``) often starts elsewhere, and an error there, before the call's first
    collective, would leave the other ranks waiting for this one."""
    if t is None:
        return None
    t = t.contiguous()
    if t.is_cuda and t.data_ptr() % 16 != 0:
        t = t.clone()
    return t


def _vocab_size(vp: VocabParallelOptions, comm) -> int:
    """The options' ``vocab_size``, else the largest ``stop`` over the ranks of ``comm`` (f64:
    exact for any vocabulary)."""
    if vp.vocab_size is not None:
        return int(vp.vocab_size)
    stop = torch.tensor([float(vp.stop)], dtype=torch.float64)
    got = comm.all_reduce(stop, "max")
    return int((stop if got is None else got).item())


class _VocabParallelLce(torch.autograd.Function):
    """Loss and lse of the whole vocabulary from this rank's shard; gradients as the module
    docs say."""

    @staticmethod
    def forward(ctx, e, c, bias, targets, opts: Options, comm, vocab_size: int, start: int):
        native = _native_options(opts)
        n = targets.numel()
        f32 = dict(dtype=torch.float32, device=e.device)
        loss = torch.empty((n,) if opts.reduction == "none" else (), **f32)
        lse = torch.empty((n,), **f32)
        rest = torch.empty((n,), **f32)
        _native.vp_forward(e, c, bias, targets, native, comm, vocab_size, start, loss, lse, rest, stream=_stream(e))
        ctx.save_for_backward(e, c, bias, targets, lse, rest)
        ctx.call = (native, comm, vocab_size, start, opts.reduction)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(rest)
        return loss, lse, rest

    @staticmethod
    def backward(ctx, d_loss, d_lse, _d_rest):
        e, c, bias, targets, lse, rest = ctx.saved_tensors
        native, comm, vocab_size, start, reduction = ctx.call
        need_e, need_c, need_bias = ctx.needs_input_grad[:3]
        if d_loss is None:
            d_loss = torch.zeros(
                (targets.numel(),) if reduction == "none" else (), dtype=torch.float32, device=e.device
            )
        d_loss = _placed(d_loss.float())
        d_lse = _placed(None if d_lse is None else d_lse.float())
        d_e = torch.empty_like(e) if need_e else None
        d_c = torch.empty_like(c) if need_c else None
        d_bias = torch.empty_like(bias) if need_bias else None
        _native.vp_backward(
            e,
            c,
            bias,
            targets,
            native,
            comm,
            vocab_size,
            start,
            lse,
            rest,
            d_loss,
            d_lse=d_lse,
            d_e_out=d_e,
            d_c_out=d_c,
            d_bias_out=d_bias,
            stream=_stream(e),
        )
        return d_e, d_c, d_bias, None, None, None, None, None


@torch.compiler.disable
def vocab_parallel_call(
    e: Tensor,
    c: Tensor,
    targets: Tensor,
    bias: Optional[Tensor],
    opts: Options,
    vp: VocabParallelOptions,
    comm: Any = None,
) -> tuple[Tensor, Tensor]:
    """The loss and lse (``[N]`` f32, on ``e``'s device) of the whole vocabulary on this rank
    (see the module docs); ``e`` ``(N, D)``, ``targets`` ``(N,)``, ``c`` and ``bias`` this rank's
    rows. ``comm``: the collectives, ``TorchDistributedComm(vp.group)`` when None; any object
    with its four methods (the tests simulate ranks as threads of one process with one).

    Ranks as threads of one process on CUDA tensors: autograd runs the backward of CUDA
    tensors on one worker thread per device, so two ranks' backwards would wait there on each
    other's collectives; run each rank's backward in its own thread with
    ``torch.autograd.set_multithreading_enabled(False)``. One process per rank (the usual
    torch.distributed launch) needs nothing."""
    if not isinstance(vp, VocabParallelOptions):
        raise _error(
            "InvalidOption",
            f"invalid option vocab_parallel_options: expected VocabParallelOptions, got {type(vp).__name__}",
        )
    if not vp.reduce_e_grad:
        raise _error("Unsupported", "vocab_parallel_options.reduce_e_grad=False is not supported")
    if c.dim() != 2 or c.shape[0] != vp.stop - vp.start:
        raise _error(
            "ShapeMismatch",
            f"c: expected this rank's {vp.stop - vp.start} rows [{vp.start}, {vp.stop}), got shape {tuple(c.shape)}",
        )
    comm = TorchDistributedComm(vp.group) if comm is None else comm
    vocab_size = _vocab_size(vp, comm)
    loss, lse, _ = _VocabParallelLce.apply(
        _placed(e),
        _placed(c),
        _placed(bias),
        _placed(targets),
        opts,
        comm,
        vocab_size,
        int(vp.start),
    )
    return loss, lse
