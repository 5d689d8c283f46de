"""cut_cross_entropy_rs: fused linear cross-entropy without the N x V logits (cut cross-entropy,
Wijmans et al. 2024), backed by the cut-cross-entropy Rust library.

- :func:`linear_cross_entropy`: Apple CCE's ``cut_cross_entropy.linear_cross_entropy`` names;
- :class:`LinearCrossEntropy`: Apple CCE's module;
- :class:`LigerFusedLinearCrossEntropyLoss`: Liger's module (constructor and call);
- :class:`CceError`: every error of the library (its message, and ``kind``, the variant's name);
- :class:`CallStats`: what a call did (``return_stats=True``);
- :class:`VocabParallelOptions`: the vocabulary sharded over a ``torch.distributed`` group
  (Apple CCE's names; :mod:`.vocab_parallel`);
- :func:`status`, :func:`set_checks`: when CUDA calls' input checks reach Python (deferred to
  :func:`status` by default: no host synchronization in a call; :mod:`.checks`).

The package is named ``cut_cross_entropy_rs`` rather than ``cut_cross_entropy`` so that it
installs beside Apple's package (the side-by-side benchmark imports both); switching is the
import line.

The work runs in ``torch.library`` custom ops (``cut_cross_entropy_rs::forward``,
``::forward_eager``: the loss and the gradients in one CUDA call, and ``::backward``) with fake
kernels and autograd, so ``torch.compile`` traces through a call.
"""

from ._native import __version__
from ._ops import CallStats, CceError
from .checks import get_checks, set_checks, status
from .functional import linear_cross_entropy
from .modules import CrossEntropyOutput, LigerFusedLinearCrossEntropyLoss, LinearCrossEntropy
from .vocab_parallel import VocabParallelOptions

__all__ = [
    "CallStats",
    "CceError",
    "CrossEntropyOutput",
    "LigerFusedLinearCrossEntropyLoss",
    "LinearCrossEntropy",
    "VocabParallelOptions",
    "linear_cross_entropy",
    "__version__",
    "get_checks",
    "set_checks",
    "status",
]
