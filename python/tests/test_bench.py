"""CPU smoke test of the side-by-side benchmark (``python -m cut_cross_entropy_rs.bench``): its
data generators, safetensors reader, fp32 truth, floor, peers and report at tiny shapes, so CI
runs the code path the H200 runs."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from cut_cross_entropy_rs import bench

CPU = torch.device("cpu")


def test_parsers():
    assert bench.parse_shapes("32768,4096,256000;8192,2304,256000,30") == [
        (32768, 4096, 256000, None),
        (8192, 2304, 256000, 30.0),
    ]
    with pytest.raises(ValueError):
        bench.parse_shapes("1,2")
    assert bench.parse_bytes("512MiB") == 512 << 20
    assert bench.parse_bytes("0.5GiB") == 1 << 29
    assert bench.parse_bytes(None) is None
    assert bench.parse_scaled("c/8") == (1.0, 0.125)
    assert bench.parse_scaled("e*2+c/4") == (2.0, 0.25)
    assert bench.parse_scaled("lm") is None


def test_ar1_matches_the_sequential_recurrence():
    torch.manual_seed(0)
    z = torch.randn(600, 5, dtype=torch.float64).float()
    r = 0.98
    q = math.sqrt(1 - r * r)
    want = z.clone()
    for i in range(1, z.shape[0]):
        want[i] = r * want[i - 1] + q * z[i]
    torch.testing.assert_close(bench.ar1_rows(z, r, block=64), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("data", ["randn", "c/8", "e*8", "iid", "iid:1.0", "lm", "lm:large"])
def test_generators(data):
    case = bench.make_synthetic(data, 48, 40, 300, None, torch.bfloat16, CPU, seed=3)
    assert case.e.shape == (48, 40) and case.c.shape == (300, 40) and case.targets.shape == (48,)
    assert case.e.dtype == torch.bfloat16 and case.targets.dtype == torch.int64
    assert int(case.targets.min()) >= 0 and int(case.targets.max()) < 300
    again = bench.make_synthetic(data, 48, 40, 300, None, torch.bfloat16, CPU, seed=3)
    assert torch.equal(case.e, again.e) and torch.equal(case.targets, again.targets)
    if data.startswith("iid"):
        want = 2.5 if data == "iid" else 1.0
        f = case.e.float() @ case.c.float().T
        # The scale is solved on these rows in f32; rounding e to bf16 moves it a little.
        entropy = float(-(f.softmax(1) * f.log_softmax(1)).sum(1).mean())
        assert abs(entropy - want) < 0.1


def test_truth_matches_autograd_in_f64():
    case = bench.make_synthetic("c/8", 37, 24, 130, 4.0, torch.bfloat16, CPU, seed=1)
    case.targets[3] = -100
    ref = bench.truth(case, chunk_bytes=130 * 12 * 8)  # several chunks of 8 rows
    e = case.e.double().requires_grad_(True)
    c = case.c.double().requires_grad_(True)
    z = e @ c.T
    z = 4.0 * torch.tanh(z / 4.0)
    loss = F.cross_entropy(z, case.targets, ignore_index=-100)
    d_e, d_c = torch.autograd.grad(loss, (e, c))
    assert abs(ref.loss - float(loss.detach())) < 1e-5
    assert bench.rel_err(ref.d_e, d_e.float()) < 1e-5
    assert bench.rel_err(ref.d_c, d_c.float()) < 1e-5
    assert 0 < ref.entropy < math.log(130)


def _write_safetensors(path, tensors):
    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.int8: "I8", torch.int32: "I32"}
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def test_safetensors_fixture_layout(tmp_path):
    """A file laid out as the SmolLM2 fixtures: E bf16, C as Q8_0 (C_q8, C_scale), targets i32;
    and an E-only file taking its head from the 1k fixture's name beside it."""
    torch.manual_seed(0)
    n, d, v = 16, 64, 50
    e = torch.randn(n, d).to(torch.bfloat16)
    q8 = torch.randint(-127, 128, (v, d), dtype=torch.int8)
    scale = (torch.rand(v, d // 32) * 0.01).to(torch.float16)
    targets = torch.randint(0, v, (n,), dtype=torch.int32)
    _write_safetensors(tmp_path / bench.FIXTURE_FILE, {"E": e, "C_q8": q8, "C_scale": scale, "targets": targets})
    _write_safetensors(tmp_path / bench.E12K_FILE, {"E": e[:8], "targets": targets[:8]})
    case = bench.load_safetensors_case(tmp_path / bench.FIXTURE_FILE, torch.float32, CPU)
    want = scale.float().repeat_interleave(32, dim=1) * q8.float()
    assert torch.equal(case.c, want) and torch.equal(case.e, e.float()) and case.shape == (n, d, v, None)
    split = bench.load_safetensors_case(tmp_path / bench.E12K_FILE, torch.bfloat16, CPU)
    assert split.shape == (8, d, v, None) and "head from" in split.note
    assert torch.equal(split.c, want.to(torch.bfloat16))


def test_main_writes_the_table(tmp_path, capsys):
    st = tmp_path / "user.safetensors"
    torch.manual_seed(0)
    _write_safetensors(
        st,
        {
            "h": torch.randn(20, 16).to(torch.bfloat16),
            "w": torch.randn(70, 16).to(torch.bfloat16),
            "y": torch.randint(0, 70, (20,), dtype=torch.int32),
        },
    )
    out = tmp_path / "bench.md"
    argv = [
        "--device",
        "cpu",
        "--shapes",
        "40,16,200;24,8,100,5",
        "--data",
        "randn,lm",
        "--peers",
        "ours,ours-exact,ours-bf16dc,torch",
    ]
    argv += ["--safetensors", str(st), "--keys", "h,w,y", "--iters", "1", "--warmup", "0", "--out", str(out)]
    rows = bench.main(argv)
    assert len(rows) == 4 * 5
    assert all(r["status"] == "ok" for r in rows), rows
    for r in rows:
        # bf16 gradients against the f32 truth: rounding only.
        assert r["de_err"] < 2e-2 and r["dc_err"] < 2e-2 and r["loss_err"] < 1e-2, r
    report = out.read_text()
    assert report.startswith("Command: `python -m cut_cross_entropy_rs.bench --device cpu")
    assert "floor 40x16x200" in report and "3-GEMM floor" in report
    assert report.count("| ours-exact |") == 5 and "20x16x70" in report
    assert "kept" in report  # ours' return_stats in the notes


def test_missing_and_failing_peers():
    peers, missing = bench.load_peers(["ours"], None)
    assert [p.name for p in peers] == ["ours"] and not missing

    def boom(e, c, t, softcap, stats):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    case = bench.make_synthetic("randn", 8, 8, 20, None, torch.float32, CPU)
    row = bench.run_peer(bench.Peer("boom", boom), case, None, 0, 1)
    assert row["status"] == "OOM"
    line = bench.format_row(case.label, case.data, row, None)
    assert "| boom | OOM |" in line


def test_forward_failure_keeps_the_forward_backward_figures():
    def loss_or_boom(e, c, t, softcap, stats):
        if not torch.is_grad_enabled():
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return F.cross_entropy(e @ c.T, t), None

    case = bench.make_synthetic("randn", 8, 8, 20, None, torch.float32, CPU)
    row = bench.run_peer(bench.Peer("half", loss_or_boom), case, bench.truth(case), 0, 1)
    assert row["status"] == "ok" and row["f_status"] == "OOM" and row["de_err"] < 1e-5
    assert "| half | " in bench.format_row(case.label, case.data, row, None) and "| OOM |" in bench.format_row(
        case.label, case.data, row, None
    )


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_staircase_prototype_is_exact_unfiltered_and_bounded_filtered(softcap):
    from cut_cross_entropy_rs.bench_staircase import staircase_loss

    case = bench.make_synthetic("lm", 200, 48, 2000, softcap, torch.float32, CPU, seed=4)
    e = case.e.clone().requires_grad_(True)
    c = case.c.clone().requires_grad_(True)
    t = case.targets.clone()
    t[3] = -100
    z = e @ c.T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    ref = F.cross_entropy(z, t, ignore_index=-100)
    de_ref, dc_ref = torch.autograd.grad(ref, (e, c))
    # Unfiltered: the staircase keeps everything and is the dense gradient.
    stats = {}
    exact = dict(filter_eps=0.0, max_dropped_mass=0.0, chunk_classes=512)
    loss = staircase_loss(e, c, t, softcap=softcap, stats=stats, **exact)
    d_e, d_c = torch.autograd.grad(loss, (e, c))
    assert abs(float(loss.detach()) - float(ref.detach())) < 1e-5
    assert bench.rel_err(d_e, de_ref) < 1e-5 and bench.rel_err(d_c, dc_ref) < 1e-5
    assert stats["backward"]["entries_skipped"] == 0
    # Filtered: each row drops at most its budget, and the gradients stay within it.
    stats = {}
    loss = staircase_loss(e, c, t, softcap=softcap, max_dropped_mass=1e-2, chunk_classes=256, stats=stats)
    d_e, d_c = torch.autograd.grad(loss, (e, c))
    b = stats["backward"]
    assert b["dropped_mass_max"] <= 1e-2 * (1 + 1e-9)
    assert b["entries_kept"] + b["entries_skipped"] == 199 * 2000
    assert bench.rel_err(d_e, de_ref) < 2e-2 and bench.rel_err(d_c, dc_ref) < 2e-2
    assert sorted(b["chunk_rows"], reverse=True) == b["chunk_rows"]


def test_staircase_is_a_peer_of_the_benchmark():
    peer = bench.load_peers(["staircase"], None)[0][0]
    case = bench.make_synthetic("lm", 64, 32, 700, None, torch.bfloat16, CPU, seed=5)
    row = bench.run_peer(peer, case, bench.truth(case), warmup=0, iters=1)
    assert row["status"] == "ok", row
    assert row["notes"].startswith("staircase prototype (kept"), row["notes"]
    assert row["de_err"] < 5e-2 and row["dc_err"] < 5e-2
