"""When a CUDA call's input checks reach Python, and the device status that holds them.

A CUDA call checks its inputs on the device (targets out of range, targets a ``-inf`` bias
masks, all targets ignored, non-finite upstream gradients, ...). Reading that result back
synchronizes the host with the GPU, which a training step does not want, and is impossible
while a CUDA graph is being captured. So, as PyTorch's own CUDA kernels report a bad target
through an asynchronous device-side assert, the checks are **deferred** by default:

- nothing is read back at the call: a row with a bad target is treated as ignored, and the
  device records the first error in the status of the stream the call ran on;
- while the status holds an error that has not been read, every loss of reduction ``"mean"``
  or ``"sum"`` computed on that device stream is NaN, so a failed check is never a silent
  wrong loss (per-row losses of ``reduction="none"`` are not marked);
- :func:`status` reads the status (one synchronization), raises the recorded error as a
  :class:`CceError` with the library's message, and clears it.

``set_checks("eager")`` reads the checks at every call instead (one synchronization per check
point; the error raises at the call, naming the first bad row, as on the CPU). A call with
``return_stats=True`` is eager too, since its statistics need the device's counts. A call
made while its stream captures a CUDA graph is always deferred. CPU tensors are always checked
at the call.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import _native

__all__ = ["get_checks", "set_checks", "status"]

_MODES = ("deferred", "eager")
_CHECKS = ["deferred"]


def set_checks(mode: str) -> None:
    """Set when CUDA calls' input checks reach Python: ``"deferred"`` (the default: read by
    :func:`status`, no host synchronization in a call) or ``"eager"`` (read at every call).
    Process-wide. Raises ``ValueError`` for another value."""
    if mode not in _MODES:
        raise ValueError(f"checks must be one of {_MODES}, got {mode!r}")
    _CHECKS[0] = mode


def get_checks() -> str:
    """The current mode of :func:`set_checks`."""
    return _CHECKS[0]


def eager_for(stats_id: int) -> bool:
    """Whether a call reads its checks at once: eager mode, or statistics asked for."""
    return _CHECKS[0] == "eager" or stats_id >= 0


def status(device: Union[torch.device, str, int, None] = None) -> Optional[dict]:
    """Read the device status of a CUDA device (default: the current one) and raise the first
    error a deferred call on any of its streams recorded since the last read (a
    :class:`CceError` with the library's message; the record is then cleared).

    Returns, when no error was recorded, what the device knows of the last call on the current
    stream: ``{"n_valid": rows with a valid target, "filter": None or the gradient filter's
    counts {"kept", "dropped_sum", "dropped_max", "tiles_visited", "active_rows"}}``; ``None``
    when no call ran on that stream, and for a CPU device or ``device=None`` where torch has
    no CUDA (CPU calls raise at the call).
    Synchronizes the device's streams that ran a call; not allowed while one captures a graph.
    """
    dev = (
        torch.device("cuda" if device is None else device)
        if not isinstance(device, int)
        else torch.device("cuda", device)
    )
    if dev.type == "cpu" or (device is None and not torch.cuda.is_available()):
        # The CPU (also the default device where torch has no CUDA): CPU calls raise at the call.
        return None
    if dev.type != "cuda":
        raise ValueError(f"status: a CUDA or CPU device, got {dev}")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    stream = torch.cuda.current_stream(index).cuda_stream
    return _native.status(index, stream=stream)
