"""Vocabulary-parallel calls over torch.distributed (gloo, CPU): k ranks as processes against
the unsharded call of the same package, for k in 1-3, V not divisible by k, padded shards,
every option; errors."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cut_cross_entropy_rs import CceError, VocabParallelOptions, linear_cross_entropy
from cut_cross_entropy_rs.vocab_parallel import partition_vocab

# (name, options, shape (batch dims, D, V), dtype, bias, padded)
CASES = [
    ("mean", dict(), ((13,), 16, 37), torch.float32, False, False),
    ("sum bias", dict(reduction="sum"), ((9,), 8, 29), torch.float32, True, False),
    ("none", dict(reduction="none"), ((11,), 16, 23), torch.float32, False, False),
    ("softcap", dict(softcap=3.0), ((10,), 16, 31), torch.float32, True, False),
    ("smoothing z-loss", dict(label_smoothing=0.1, z_loss=1e-2), ((12,), 8, 19), torch.float32, False, False),
    ("shift", dict(shift=1, reduction="none"), ((2, 7), 8, 21), torch.float32, False, False),
    ("padded", dict(), ((8,), 8, 17), torch.float32, True, True),
    ("bf16", dict(), ((16,), 32, 41), torch.bfloat16, False, False),
    ("filtered", dict(filter_eps="auto"), ((24,), 16, 53), torch.float32, False, False),
]
EXACT = dict(filter_eps=None)


def _inputs(case, seed: int = 0):
    _, _, (batch, d, v), dtype, with_bias, _ = case
    g = torch.Generator().manual_seed(seed)
    e = (torch.randn(*batch, d, generator=g) * 0.8).to(dtype)
    c = (torch.randn(v, d, generator=g) * 0.8).to(dtype)
    bias = (torch.randn(v, generator=g) * 0.5).to(dtype) if with_bias else None
    targets = torch.randint(0, v, batch, generator=g)
    targets.view(-1)[::4] = -100
    return e, c, bias, targets


def _options(case):
    opts = dict(EXACT)
    opts.update(case[1])
    return opts


def _upstream(loss: torch.Tensor) -> torch.Tensor:
    """A scalar to differentiate: per-row weights for reduction none."""
    if loss.dim() == 0:
        return loss * 0.7
    w = torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape)
    return (loss * w).sum()


def _shard_of(case, rank: int, world: int) -> tuple[int, int, int | None]:
    v = case[2][2]
    if case[5]:  # padded: every shard the same size, the last ones past V
        per = -(-v // world) + 1
        return rank * per, (rank + 1) * per, v
    start, stop = partition_vocab(v, rank, world)
    return start, stop, None


def _run_case(rank: int, world: int, case):
    e, c, bias, targets = _inputs(case)
    start, stop, vocab_size = _shard_of(case, rank, world)
    d = c.shape[1]
    rows = torch.zeros(stop - start, d, dtype=c.dtype)
    real = c[start:stop]
    rows[: real.shape[0]] = real
    c_shard = rows.requires_grad_(True)
    b_shard = None
    if bias is not None:
        b = torch.zeros(stop - start, dtype=bias.dtype)
        b[: bias[start:stop].shape[0]] = bias[start:stop]
        b_shard = b.requires_grad_(True)
    e = e.clone().requires_grad_(True)
    vp = VocabParallelOptions(start, stop, vocab_size=vocab_size)
    loss, lse = linear_cross_entropy(
        e, c_shard, targets, bias=b_shard, vocab_parallel_options=vp, return_lse=True, **_options(case)
    )
    _upstream(loss).backward()
    return dict(
        loss=loss.detach(),
        lse=lse.detach(),
        d_e=e.grad,
        d_c=c_shard.grad,
        d_bias=None if b_shard is None else b_shard.grad,
        start=start,
        stop=stop,
    )


def _bad_tiling(rank: int, world: int):
    """Rank 1 claims classes that overlap rank 0's: every rank gets a VocabParallel error."""
    e, c, _, targets = _inputs(CASES[0])
    start, stop = partition_vocab(c.shape[0], rank, world)
    if rank == 1:
        start, stop = start - 1, stop - 1
    try:
        linear_cross_entropy(
            e, c[start:stop], targets, vocab_parallel_options=VocabParallelOptions(start, stop, vocab_size=c.shape[0])
        )
    except CceError as err:
        return err.kind
    return None


def _bad_rank(rank: int, world: int):
    """The last rank's e holds a NaN: it raises NonFinite, every other rank VocabParallel (the
    peer that failed is named; nobody waits for it)."""
    e, c, _, targets = _inputs(CASES[0])
    if rank == world - 1:
        e[3, 5] = float("nan")
    start, stop = partition_vocab(c.shape[0], rank, world)
    try:
        linear_cross_entropy(e, c[start:stop], targets, vocab_parallel_options=VocabParallelOptions(start, stop))
    except CceError as err:
        return err.kind
    return None


def _worker(rank: int, world: int, init_file: str, out_dir: str):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results = [_run_case(rank, world, case) for case in CASES]
        bad = _bad_tiling(rank, world) if world > 1 else None
        bad_rank = _bad_rank(rank, world)
        torch.save(dict(results=results, bad=bad, bad_rank=bad_rank), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _reference(case):
    """The unsharded call of the same package on the same inputs."""
    e, c, bias, targets = _inputs(case)
    e.requires_grad_(True)
    c.requires_grad_(True)
    if bias is not None:
        bias.requires_grad_(True)
    loss, lse = linear_cross_entropy(e, c, targets, bias=bias, return_lse=True, **_options(case))
    _upstream(loss).backward()
    return loss.detach(), lse.detach(), e.grad, c.grad, None if bias is None else bias.grad


def _close(got: torch.Tensor, want: torch.Tensor, what: str, slack: float = 0.0):
    # bf16 gradients: each side rounded once from f32 (one bf16 step apart at most).
    bf16 = torch.bfloat16 in (got.dtype, want.dtype)
    got, want = got.double(), want.double()
    scale = want.abs().max().item() + 1e-12
    tol = (2e-2 if bf16 else 2e-5) * scale + slack
    err = (got - want).abs().max().item()
    assert err <= tol, f"{what}: max |err| {err:.3e} > {tol:.3e} (scale {scale:.3e})"


@pytest.fixture(scope="module", params=[1, 2, 3])
def ranks(request):
    world = request.param
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), tmp), nprocs=world, join=True)
        yield world, [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_ranks_match_the_unsharded_call(ranks, index):
    world, outs = ranks
    case = CASES[index]
    loss, lse, d_e, d_c, d_bias = _reference(case)
    per_rank = [o["results"][index] for o in outs]
    v = case[2][2]
    # Filtering may drop up to max_dropped_mass (1e-3) of each row's probability: the sharded
    # and unsharded calls may drop different entries within that bound.
    slack = 2e-3 * float(_inputs(case)[1].float().norm(dim=1).max()) if case[1].get("filter_eps") else 0.0
    for r, got in enumerate(per_rank):
        # Every rank holds the whole loss, lse and d_e, bit for bit the same.
        assert torch.equal(got["loss"], per_rank[0]["loss"]), f"rank {r} loss differs from rank 0"
        assert torch.equal(got["d_e"], per_rank[0]["d_e"]), f"rank {r} d_e differs from rank 0"
        _close(got["loss"], loss, f"rank {r} loss")
        _close(got["lse"], lse, f"rank {r} lse")
        _close(got["d_e"], d_e, f"rank {r} d_e", slack)
        # Padding rows (at and past V) get no gradient.
        pad = max(0, got["stop"] - max(v, got["start"]))
        if pad:
            assert torch.all(got["d_c"][-pad:] == 0), f"rank {r}: padding rows of d_c not 0"
    d_c_sharded = torch.cat([o["d_c"] for o in per_rank])[:v]
    _close(d_c_sharded, d_c, "d_c (shards concatenated)", slack)
    if d_bias is not None:
        d_bias_sharded = torch.cat([o["d_bias"] for o in per_rank])[:v]
        _close(d_bias_sharded, d_bias, "d_bias (shards concatenated)", slack)


def test_shards_that_do_not_tile_raise_on_every_rank(ranks):
    world, outs = ranks
    if world == 1:
        pytest.skip("needs two ranks")
    assert [o["bad"] for o in outs] == ["VocabParallel"] * world


def test_a_failing_rank_is_named_and_nobody_hangs(ranks):
    world, outs = ranks
    assert [o["bad_rank"] for o in outs] == ["VocabParallel"] * (world - 1) + ["NonFinite"]


def test_options_checked_before_any_collective():
    e, c, _, targets = _inputs(CASES[0])
    with pytest.raises(CceError) as err:
        linear_cross_entropy(e, c, targets, vocab_parallel_options=VocabParallelOptions(0, 5, reduce_e_grad=False))
    assert err.value.kind == "Unsupported"
    with pytest.raises(CceError) as err:
        linear_cross_entropy(e, c, targets, vocab_parallel_options=VocabParallelOptions(0, 5, vocab_size=37))
    assert err.value.kind == "ShapeMismatch"
    with pytest.raises(CceError) as err:
        linear_cross_entropy(e, c, targets, vocab_parallel_options=(0, 37))
    assert err.value.kind == "InvalidOption"


def test_partition_matches_the_library_even_layout():
    for v, k in [(37, 3), (10, 4), (256000, 8), (5, 5)]:
        spans = [partition_vocab(v, r, k) for r in range(k)]
        assert spans[0][0] == 0 and spans[-1][1] == v
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert max(s[1] - s[0] for s in spans) - min(s[1] - s[0] for s in spans) <= 1
