"""Loss modules matching Apple's ``cut_cross_entropy.LinearCrossEntropy`` and Liger's
``LigerFusedLinearCrossEntropyLoss`` (constructor and call), so switching is one import."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from .functional import IGNORE_INDEX, _call, _error, _options, linear_cross_entropy

__all__ = ["LinearCrossEntropy", "LigerFusedLinearCrossEntropyLoss", "CrossEntropyOutput"]


# The keyword-only arguments of ``linear_cross_entropy`` beyond Apple's that the module passes on.
_EXTRA_KWARGS = frozenset(
    {
        "label_smoothing",
        "z_loss",
        "max_dropped_mass",
        "workspace_budget_bytes",
        "deterministic",
        "check_finite",
        "dc_in_grad_dtype",
        "return_stats",
    }
)


class LinearCrossEntropy(nn.Module):
    """Apple CCE's module: ``LinearCrossEntropy(...)(e, c, targets, bias=None)``; the arguments
    are those of :func:`~cut_cross_entropy_rs.linear_cross_entropy`, Apple's positionally and
    this package's others (``label_smoothing``, ``z_loss``, ``max_dropped_mass``,
    ``workspace_budget_bytes``, ``deterministic``, ``check_finite``, ``dc_in_grad_dtype``,
    ``return_stats``) by keyword; any other keyword is a ``TypeError``."""

    def __init__(
        self,
        ignore_index: int = IGNORE_INDEX,
        softcap: float | None = None,
        reduction: str = "mean",
        shift: bool | int = 0,
        filter_eps: float | str | None = "auto",
        accum_e_fp32: bool = False,
        accum_c_fp32: bool = False,
        filter_e_grad: bool = True,
        filter_c_grad: bool = True,
        impl: str | None = None,
        return_lse: bool = False,
        **kwargs: Any,
    ):
        super().__init__()
        unknown = set(kwargs) - _EXTRA_KWARGS
        if unknown:
            raise TypeError(f"LinearCrossEntropy: unexpected keyword argument(s) {', '.join(sorted(unknown))}")
        self.kwargs = kwargs
        self.ignore_index = ignore_index
        self.softcap = softcap
        self.reduction = reduction
        self.shift = shift
        self.filter_eps = filter_eps
        self.accum_e_fp32 = accum_e_fp32
        self.accum_c_fp32 = accum_c_fp32
        self.filter_e_grad = filter_e_grad
        self.filter_c_grad = filter_c_grad
        self.impl = impl
        self.return_lse = return_lse

    def forward(self, e: Tensor, c: Tensor, targets: Tensor, bias: Tensor | None = None):
        """The loss (and the lse with ``return_lse``) of ``e @ c.T + bias`` against ``targets``."""
        return linear_cross_entropy(
            e,
            c,
            targets,
            bias=bias,
            ignore_index=self.ignore_index,
            softcap=self.softcap,
            reduction=self.reduction,
            shift=self.shift,
            filter_eps=self.filter_eps,
            filter_e_grad=self.filter_e_grad,
            filter_c_grad=self.filter_c_grad,
            return_lse=self.return_lse,
            **self.kwargs,
        )


@dataclass
class CrossEntropyOutput:
    """Liger's output record when a side output is asked."""

    loss: Tensor
    z_loss: Optional[Tensor] = None
    token_accuracy: Optional[Tensor] = None
    predicted_tokens: Optional[Tensor] = None


class LigerFusedLinearCrossEntropyLoss(nn.Module):
    """Liger's fused linear cross-entropy module: ``loss_fn(lin_weight, _input, target,
    bias=None)`` with ``lin_weight`` ``(V, D)`` and ``_input`` ``(..., D)``.

    ``lse_square_scale`` is the z-loss weight (included in the loss; ``return_z_loss`` also
    returns it, detached), ``return_token_accuracy`` the fraction of rows with a target whose
    argmax is the target, ``return_predicted_tokens`` the argmax per row (int64, -1 at ignored
    rows). The gradient is exact (no filtering), as Liger's. As Liger's, the mean divides by
    ``max(n_valid, 1)``: a batch whose targets are all ignored gives a loss of 0 and zero
    gradients (where :func:`~cut_cross_entropy_rs.linear_cross_entropy`'s mean raises). ``accum_dtype=None`` (Liger's
    default: the gradient of ``lin_weight`` accumulated in its own dtype) sets
    ``dc_in_grad_dtype=True`` of :func:`~cut_cross_entropy_rs.linear_cross_entropy` where
    ``lin_weight`` is bfloat16 (the same trade, its measured error there; f32 weights under
    autocast keep f32 accumulation); ``accum_dtype=torch.float32`` accumulates in f32. Not
    supported (``CceError`` of kind ``Unsupported``): ``ce_weight``, ``use_token_scaling``, an
    ``accum_dtype`` other than None or float32."""

    def __init__(
        self,
        ce_weight: Optional[torch.FloatTensor] = None,
        ignore_index: int = -100,
        lse_square_scale: float = 0.0,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap: Optional[float] = None,
        return_z_loss: bool = False,
        accum_dtype: Optional[torch.dtype] = None,
        use_token_scaling: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
    ):
        super().__init__()
        if ce_weight is not None:
            raise _error("Unsupported", "ce_weight (per-class weights) is not supported by cut_cross_entropy_rs")
        if use_token_scaling:
            raise _error("Unsupported", "use_token_scaling is not supported by cut_cross_entropy_rs")
        if accum_dtype not in (None, torch.float32):
            raise _error("Unsupported", f"accum_dtype {accum_dtype}: None or torch.float32")
        if reduction not in ("mean", "sum", "none"):
            raise _error(
                "InvalidOption", f"invalid option reduction: unknown reduction '{reduction}' (none, mean, sum)"
            )
        self.ce_weight = ce_weight
        self.ignore_index = ignore_index
        self.lse_square_scale = lse_square_scale
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.softcap = softcap
        self.return_z_loss = return_z_loss
        self.accum_dtype = accum_dtype
        self.use_token_scaling = use_token_scaling
        self.return_token_accuracy = return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens

    def forward(self, lin_weight: Tensor, _input: Tensor, target: Tensor, bias: Tensor | None = None):
        """The loss, or a :class:`CrossEntropyOutput` when a side output is asked."""
        if self.reduction not in ("mean", "sum", "none"):
            raise _error(
                "InvalidOption", f"invalid option reduction: unknown reduction '{self.reduction}' (none, mean, sum)"
            )
        want_argmax = self.return_token_accuracy or self.return_predicted_tokens
        mean = self.reduction == "mean"
        opts = _options(
            self.ignore_index,
            self.softcap,
            # Liger's mean divides the sum by max(n_valid, 1): a batch whose targets are all
            # ignored gives 0 and zero gradients (the library's mean refuses it), so the mean is
            # taken here, on the device (no host read of the count).
            "sum" if mean else self.reduction,
            0,
            None,
            False,
            False,
            self.label_smoothing,
            self.lse_square_scale,
            1e-3,
            None,
            False,
            True,
            # Liger's None accumulates in the weight's dtype: the bf16 trade only for bf16 weights
            # (f32 weights under autocast keep an f32 accumulation).
            dc_in_grad_dtype=self.accum_dtype is None and lin_weight.dtype == torch.bfloat16,
            argmax=want_argmax,
        )
        loss, lse, _, argmax, _ = _call(_input, lin_weight, target, bias, opts, False)
        if not (mean or self.return_z_loss or want_argmax):
            return loss
        valid = target.reshape(-1) != self.ignore_index
        n_valid = valid.sum().clamp_min(1).to(torch.float32)
        if mean:
            loss = loss / n_valid
        if not (self.return_z_loss or want_argmax):
            return loss
        out = CrossEntropyOutput(loss=loss)
        if self.return_z_loss:
            z = self.lse_square_scale * lse.detach().reshape(-1).square() * valid
            if self.reduction == "none":
                out.z_loss = z.view(lse.shape)
            elif self.reduction == "sum":
                out.z_loss = z.sum()
            else:
                out.z_loss = z.sum() / n_valid
        if want_argmax:
            pred = argmax.to(torch.int64)
            hit = (pred == target.reshape(-1)) & valid
            if self.return_token_accuracy:
                if self.reduction == "none":
                    out.token_accuracy = hit.to(torch.float32).view(lse.shape)
                else:
                    out.token_accuracy = hit.sum().to(torch.float32) / n_valid
            if self.return_predicted_tokens:
                out.predicted_tokens = torch.where(valid, pred, torch.full_like(pred, -1))
        return out
