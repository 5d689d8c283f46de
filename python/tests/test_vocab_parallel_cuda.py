"""Vocabulary-parallel calls on CUDA tensors (skipped without a CUDA device): k = 1, 2, 3 ranks as
threads of one process, joined by an in-process communicator with ``TorchDistributedComm``'s four
methods, against the unsharded CUDA call of the same package: loss, lse, d_e, d_c and d_bias for
f32 and bf16, with bias, softcap, ignored rows, V not divisible by k, a padded vocabulary, label
smoothing and z-loss, a filtered bf16 call, per-rank streams; a rank with a NaN input named on
the others; a mixed-device call raising ``CceError``. The same
harness runs on CPU tensors here too (a check of the harness against the CPU path)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from cut_cross_entropy_rs import CceError, VocabParallelOptions, linear_cross_entropy
from cut_cross_entropy_rs.functional import _options
from cut_cross_entropy_rs.vocab_parallel import partition_vocab, vocab_parallel_call

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CUDA path runs on the H200")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=CUDA)]

# (name, options, batch, D, V, dtype, bias, padded)
CASES = [
    ("f32 mean bias softcap", dict(softcap=3.0), (13,), 16, 37, torch.float32, True, False),
    ("bf16 mean bias softcap", dict(softcap=3.0), (16,), 32, 41, torch.bfloat16, True, False),
    ("f32 none", dict(reduction="none"), (11,), 16, 23, torch.float32, False, False),
    ("bf16 sum", dict(reduction="sum"), (9,), 8, 29, torch.bfloat16, True, False),
    (
        "bf16 smoothing z-loss ignore_index",
        dict(label_smoothing=0.1, z_loss=1e-2, ignore_index=5),
        (2, 7),
        16,
        31,
        torch.bfloat16,
        True,
        False,
    ),
    ("f32 padded", dict(), (8,), 8, 17, torch.float32, True, True),
    ("bf16 larger", dict(softcap=20.0), (96,), 64, 301, torch.bfloat16, True, False),
    ("f32 larger none", dict(reduction="none", softcap=20.0), (70,), 64, 257, torch.float32, True, False),
    ("bf16 filtered", dict(filter_eps="auto"), (64,), 32, 211, torch.bfloat16, False, False),
]
EXACT = dict(filter_eps=None)
TIMEOUT_S = 300.0


class _Group:
    """What the ranks of one simulated group share: a barrier and one slot per rank."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=TIMEOUT_S)
        self.slots: list = [None] * world


class ThreadComm:
    """``TorchDistributedComm``'s four methods between threads of one process (``t``: 1-D CPU
    tensors). Every rank reduces the same stacked slots in rank order, so each gets the same
    bits."""

    def __init__(self, group: _Group, rank: int):
        self.group, self._rank = group, rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self.group.world

    def _exchange(self, t: torch.Tensor) -> list:
        g = self.group
        g.slots[self._rank] = t.detach().clone()
        g.barrier.wait()
        parts = list(g.slots)
        g.barrier.wait()  # everyone has read the slots before the next exchange writes them
        return parts

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        stacked = torch.stack(self._exchange(t))
        t.copy_(stacked.amax(0) if op == "max" else stacked.sum(0))
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(t))


def run_ranks(world: int, fn):
    """``fn(comm)`` on ``world`` threads; their results in rank order (the first exception is
    raised; a failing rank aborts the barrier so that no other waits)."""
    group = _Group(world)
    results: list = [None] * world
    errors: list = [None] * world

    def body(r: int):
        try:
            results[r] = fn(ThreadComm(group, r))
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            errors[r] = err
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S + 60)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    if first is None:
        first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


def _inputs(case, device: str, seed: int = 0):
    _, opts, batch, d, v, dtype, with_bias, _ = case
    g = torch.Generator().manual_seed(seed)
    e = (torch.randn(*batch, d, generator=g) * 0.8).to(dtype)
    c = (torch.randn(v, d, generator=g) * 0.8).to(dtype)
    bias = (torch.randn(v, generator=g) * 0.5).to(dtype) if with_bias else None
    targets = torch.randint(0, v, batch, generator=g)
    targets.view(-1)[::4] = opts.get("ignore_index", -100)
    put = lambda x: None if x is None else x.to(device)  # noqa: E731
    return put(e), put(c), put(bias), put(targets)


def _kwargs(case) -> dict:
    kw = dict(EXACT)
    kw.update(case[1])
    return kw


def _opts(case):
    """The ops' Options of ``linear_cross_entropy(**_kwargs(case))``."""
    kw = dict(
        ignore_index=-100, softcap=None, reduction="mean", shift=0, filter_eps=None, label_smoothing=0.0, z_loss=0.0
    )
    kw.update(_kwargs(case))
    return _options(
        kw["ignore_index"],
        kw["softcap"],
        kw["reduction"],
        kw["shift"],
        kw["filter_eps"],
        kw["filter_eps"] is not None,
        kw["filter_eps"] is not None,
        kw["label_smoothing"],
        kw["z_loss"],
        1e-3,
        None,
        False,
        True,
    )


def _upstream(loss: torch.Tensor) -> torch.Tensor:
    """A scalar to differentiate: per-row weights for reduction none."""
    if loss.dim() == 0:
        return loss * 0.7
    w = torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).view(loss.shape)
    return (loss * w).sum()


def _shard_of(case, rank: int, world: int) -> tuple[int, int, int | None]:
    v = case[4]
    if case[7]:  # padded: every shard the same size, the last ones past V
        per = -(-v // world) + 1
        return rank * per, (rank + 1) * per, v
    start, stop = partition_vocab(v, rank, world)
    return start, stop, None


def _rank_call(case, device: str, comm, own_stream: bool = False):
    """One rank's call: its shard of ``c`` (padding rows NaN: never read), forward and backward."""
    e, c, bias, targets = _inputs(case, device)
    start, stop, vocab_size = _shard_of(case, comm.rank(), comm.size())
    d = c.shape[1]
    rows = torch.full((stop - start, d), float("nan"), dtype=c.dtype, device=device)
    real = c[start:stop]
    rows[: real.shape[0]] = real
    c_shard = rows.requires_grad_(True)
    b_shard = None
    if bias is not None:
        b = torch.full((stop - start,), float("nan"), dtype=bias.dtype, device=device)
        b[: bias[start:stop].shape[0]] = bias[start:stop]
        b_shard = b.requires_grad_(True)
    e = e.clone().requires_grad_(True)
    vp = VocabParallelOptions(start, stop, vocab_size=vocab_size)
    stream = torch.cuda.Stream() if own_stream else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    # Autograd runs the backward of CUDA tensors on one worker thread per device: two ranks'
    # backwards there would wait on each other's collectives. Each rank thread runs its own.
    with (
        torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
        torch.autograd.set_multithreading_enabled(False),
    ):
        loss, lse = vocab_parallel_call(e, c_shard, targets, b_shard, _opts(case), vp, comm=comm)
        _upstream(loss).backward()
    if stream is not None:
        torch.cuda.current_stream().wait_stream(stream)
    return dict(
        loss=loss.detach(),
        lse=lse.detach(),
        d_e=e.grad,
        d_c=c_shard.grad,
        d_bias=None if b_shard is None else b_shard.grad,
        start=start,
        stop=stop,
    )


def _reference(case, device: str):
    """The unsharded call of the same package on the same inputs and device."""
    e, c, bias, targets = _inputs(case, device)
    e.requires_grad_(True)
    c.requires_grad_(True)
    if bias is not None:
        bias.requires_grad_(True)
    loss, lse = linear_cross_entropy(e, c, targets, bias=bias, return_lse=True, **_kwargs(case))
    _upstream(loss).backward()
    flat = lambda x: x.detach().reshape(-1)  # noqa: E731
    return flat(loss), flat(lse), e.grad.reshape(-1, e.shape[-1]), c.grad, None if bias is None else bias.grad


def _close(got: torch.Tensor, want: torch.Tensor, what: str, slack: float = 0.0):
    """Max-abs error within a tolerance relative to the largest value (plus ``slack``): bf16
    results are each rounded once from f32 (one bf16 step apart at most); f32 ones differ by
    summation order."""
    assert got.device == want.device, f"{what}: on {got.device}, the unsharded call's on {want.device}"
    bf16 = torch.bfloat16 in (got.dtype, want.dtype)
    got, want = got.double().reshape(-1), want.double().reshape(-1)
    scale = want.abs().max().item() + 1e-12
    tol = (2e-2 if bf16 else 1e-4) * scale + slack
    err = (got - want).abs().max().item()
    assert err <= tol, f"{what}: max |err| {err:.3e} > {tol:.3e} (scale {scale:.3e})"


def _check(case, device: str, world: int, own_stream: bool = False):
    loss, lse, d_e, d_c, d_bias = _reference(case, device)
    per_rank = run_ranks(world, lambda comm: _rank_call(case, device, comm, own_stream))
    v = case[4]
    # Filtering may drop up to max_dropped_mass (1e-3) of each row's probability: the sharded
    # and unsharded calls may drop different entries within that bound.
    slack = 2e-3 * float(_inputs(case, "cpu")[1].float().norm(dim=1).max()) if case[1].get("filter_eps") else 0.0
    for r, got in enumerate(per_rank):
        # Every rank holds the whole loss, lse and d_e, bit for bit the same, on the device.
        for name in ("loss", "lse", "d_e", "d_c"):
            assert got[name].device.type == device, f"rank {r} {name} on {got[name].device}"
        assert torch.equal(got["loss"], per_rank[0]["loss"]), f"rank {r} loss differs from rank 0"
        assert torch.equal(got["d_e"], per_rank[0]["d_e"]), f"rank {r} d_e differs from rank 0"
        assert got["d_e"].dtype == case[5] and got["d_c"].dtype == case[5]
        _close(got["loss"].reshape(-1), loss, f"rank {r} loss")
        _close(got["lse"].reshape(-1), lse, f"rank {r} lse")
        _close(got["d_e"], d_e, f"rank {r} d_e", slack)
        # Padding rows (at and past V) get no gradient.
        pad = max(0, got["stop"] - max(v, got["start"]))
        if pad:
            assert torch.all(got["d_c"][-pad:] == 0), f"rank {r}: padding rows of d_c not 0"
            if got["d_bias"] is not None:
                assert torch.all(got["d_bias"][-pad:] == 0), f"rank {r}: padding of d_bias not 0"
    _close(torch.cat([o["d_c"] for o in per_rank])[:v], d_c, "d_c (shards concatenated)", slack)
    if d_bias is not None:
        _close(torch.cat([o["d_bias"] for o in per_rank])[:v], d_bias, "d_bias (shards concatenated)", slack)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_thread_ranks_match_the_unsharded_call(device, world, index):
    _check(CASES[index], device, world)


@CUDA
def test_ranks_on_their_own_streams():
    """Each rank on a non-default current stream of its own: the call is ordered on it."""
    _check(CASES[1], "cuda", 3, own_stream=True)


@CUDA
@pytest.mark.parametrize("world", [1, 2])
def test_mixed_devices_raise(world):
    """``e`` on CUDA with ``c`` on the CPU (and the reverse): CceError of kind Unsupported on
    every rank, as the unsharded call raises; nothing waits in a collective."""
    case = CASES[0]

    def call(comm, e_device, c_device):
        e, c, bias, targets = _inputs(case, "cpu")
        start, stop = partition_vocab(c.shape[0], comm.rank(), comm.size())
        vp = VocabParallelOptions(start, stop, vocab_size=c.shape[0])
        try:
            vocab_parallel_call(
                e.to(e_device), c[start:stop].to(c_device), targets.to(e_device), None, _opts(case), vp, comm=comm
            )
        except CceError as err:
            return err.kind
        return None

    for e_device, c_device in [("cuda", "cpu"), ("cpu", "cuda")]:
        kinds = run_ranks(world, lambda comm, a=e_device, b=c_device: call(comm, a, b))
        assert kinds == ["Unsupported"] * world, (e_device, c_device, kinds)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [2, 3])
def test_a_failing_rank_is_named_and_nobody_waits(device, world):
    """The last rank's e holds a NaN: it raises NonFinite (read at the call: the CUDA path's
    checks are eager), every other rank VocabParallel naming it. The bias shards are slices of
    the whole bias (on CUDA most start at an address the backend cannot borrow: the package
    copies them)."""
    case = CASES[0]

    def call(comm):
        e, c, bias, targets = _inputs(case, device)
        if comm.rank() == comm.size() - 1:
            e[3, 5] = float("nan")
        start, stop = partition_vocab(c.shape[0], comm.rank(), comm.size())
        vp = VocabParallelOptions(start, stop)
        try:
            vocab_parallel_call(e, c[start:stop], targets, bias[start:stop], _opts(case), vp, comm=comm)
        except CceError as err:
            return err.kind
        return None

    assert run_ranks(world, call) == ["VocabParallel"] * (world - 1) + ["NonFinite"]


def _one_bad_rank(comm, device: str, bad: str):
    """The last rank's call is bad before its shard runs (``bad``: "vocab_size", a vocabulary
    of 0 classes; "device", its ``c`` on the CPU); returns the kind each rank raises."""
    case = CASES[0]
    e, c, _, targets = _inputs(case, device)
    start, stop = partition_vocab(c.shape[0], comm.rank(), comm.size())
    vp = VocabParallelOptions(start, stop, vocab_size=c.shape[0])
    c_shard = c[start:stop]
    if comm.rank() == comm.size() - 1:
        if bad == "vocab_size":
            vp.vocab_size = 0
        else:
            c_shard = c_shard.cpu()
    try:
        vocab_parallel_call(e, c_shard, targets, None, _opts(case), vp, comm=comm)
    except CceError as err:
        return err.kind
    return None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [2, 3])
def test_a_rank_failing_before_its_shard_is_named(device, world):
    """A rank whose call fails before its shard runs still takes part in the first collective
    as a failed rank: it raises its own error, the others VocabParallel (nobody waits)."""
    kinds = run_ranks(world, lambda comm: _one_bad_rank(comm, device, "vocab_size"))
    assert kinds == ["VocabParallel"] * (world - 1) + ["EmptyInput"]


@CUDA
def test_one_rank_on_mixed_devices_is_named():
    kinds = run_ranks(2, lambda comm: _one_bad_rank(comm, "cuda", "device"))
    assert kinds == ["VocabParallel", "Unsupported"]
