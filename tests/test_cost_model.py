"""The alpha-beta cost model: each algorithm against its formula written out by hand, the
identities the papers state, the calibration fit, the command line, and a math module that
imports nothing compiled."""

import csv
import json
import math
import pathlib
import subprocess
import sys

import pytest

import torch_bigbatch as bb
from torch_bigbatch.distributed.cost_model import alpha_beta, calibration, cli
from torch_bigbatch.distributed.cost_model.alpha_beta import Hardware

ABCI = alpha_beta.PRESETS["abci-v100"]
REPOSITORY = pathlib.Path(__file__).resolve().parents[1]


def uniform(ranks, alpha, bandwidth, overlap=True, gpus_per_node=None):
    """Every link alike; one node unless `gpus_per_node` says otherwise."""
    return Hardware("uniform", gpus_per_node=gpus_per_node or ranks, intra_alpha=alpha,
                    intra_bandwidth=bandwidth, inter_alpha=alpha, inter_bandwidth=bandwidth,
                    overlap=overlap)


def test_math_module_imports_nothing_compiled():
    """alpha_beta.py loaded on its own, as a file, in a fresh interpreter: no torch, no
    torch_bigbatch._C, and it computes what the package's copy computes."""
    script = (
        "import importlib.util, json, sys\n"
        "spec = importlib.util.spec_from_file_location('alpha_beta', sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules['alpha_beta'] = module\n"
        "spec.loader.exec_module(module)\n"
        "loaded = [name for name in sys.modules if name.split('.')[0] in "
        "('torch', 'torch_bigbatch')]\n"
        "seconds = module.allreduce_time('tree', module.PRESETS['abci-v100'], 4096)\n"
        "print(json.dumps({'loaded': loaded, 'seconds': seconds}))\n")
    result = subprocess.run([sys.executable, "-c", script, alpha_beta.__file__],
                            capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(result.stdout)
    assert report["loaded"] == []  # neither torch nor torch_bigbatch._C
    assert report["seconds"] == alpha_beta.allreduce_time("tree", ABCI, 4096)


def test_resnet50_gradient_size():
    model = bb.models.resnet50()
    assert sum(p.numel() for p in model.parameters()) == alpha_beta.RESNET50_PARAMETERS


def test_ring_is_twice_p_minus_one_steps():
    # 2(p-1) steps of alpha + n/p bytes: 14 * (10 us + 125 us).
    assert alpha_beta.ring_time(uniform(8, 1e-5, 1e9), 8, 1e6) == pytest.approx(1.89e-3)


def test_torus_latency_and_bandwidth_terms():
    """ARCHITECTURE.md: torus = 2(X-1)alpha + 2(Y-1)alpha + 2(p-1)/p n beta, the ring's
    bandwidth term with far fewer steps."""
    hardware = uniform(64, 1e-5, 1e9)
    assert alpha_beta.torus_time(hardware, 64, 0, columns=8) == pytest.approx(28 * 1e-5)
    assert alpha_beta.ring_time(hardware, 64, 0) == pytest.approx(126 * 1e-5)
    no_latency = uniform(64, 0.0, 1e9)
    for columns in (2, 4, 8, 16, 32):
        assert alpha_beta.torus_time(no_latency, 64, 1e8, columns) == \
            pytest.approx(alpha_beta.ring_time(no_latency, 64, 1e8))


def test_torus_on_abci_by_hand():
    """16 V100 as 4 x 4: rows on NVLink, the 4 columns of a node share its 25 GB/s."""
    n = alpha_beta.RESNET50_GRADIENT_BYTES
    row = 3 * (5e-6 + n / 4 / 50e9)
    column = 2 * 3 * (10e-6 + n / 4 / 4 / (25e9 / 4))
    assert alpha_beta.torus_time(ABCI, 16, n) == pytest.approx(2 * row + column)
    # The flat ring crosses nodes at every step: the inter-node alpha, all NICs' bandwidth.
    assert alpha_beta.ring_time(ABCI, 16, n) == pytest.approx(30 * (10e-6 + n / 16 / 25e9))
    # Goyal's hierarchy: reduce and broadcast in the node, leaders' ring on one 12.5 GB/s NIC.
    leaders = 2 * 3 * (10e-6 + n / 4 / 12.5e9)
    assert alpha_beta.hierarchical_time(ABCI, 16, n) == pytest.approx(2 * row * 2 + leaders)


def test_tree_on_abci_by_hand():
    """NCCL's double binary tree: a chain of 4 GPUs up and down in each node (5 us a step),
    floor(log2 N) levels up and down between nodes (10 us), 2n bytes through the slower of
    NVLink (50 GB/s) and the node's NICs (25 GB/s)."""
    n = alpha_beta.RESNET50_GRADIENT_BYTES
    # 16 GPUs, 4 nodes: 2 levels.
    assert alpha_beta.tree_time(ABCI, 16, n) == \
        pytest.approx(2 * 3 * 5e-6 + 2 * 2 * 10e-6 + 2 * n / 25e9)
    # 24 GPUs, 6 nodes: a binary tree of 6 nodes is still 2 levels deep.
    assert alpha_beta.tree_time(ABCI, 24, n) == alpha_beta.tree_time(ABCI, 16, n)
    # One node: the chain alone, on NVLink.
    assert alpha_beta.tree_time(ABCI, 4, n) == pytest.approx(2 * 3 * 5e-6 + 2 * n / 50e9)
    assert alpha_beta.tree_time(ABCI, 1, n) == 0.0
    assert alpha_beta.allreduce_time("tree", ABCI, 16, n) == alpha_beta.tree_time(ABCI, 16, n)


def test_tree_latency_grows_like_log_p():
    """One GPU per node, no bytes: 2 log2(p) steps for the tree, 2(p-1) for the ring; from p
    to p^2 the tree's latency doubles while the ring's grows p + 1 times."""
    hardware = uniform(1, 1e-5, 1e9, gpus_per_node=1)
    p = 16
    assert alpha_beta.tree_time(hardware, p, 0) == pytest.approx(2 * math.log2(p) * 1e-5)
    assert alpha_beta.tree_time(hardware, p * p, 0) == \
        pytest.approx(2 * alpha_beta.tree_time(hardware, p, 0))
    assert alpha_beta.ring_time(hardware, p * p, 0) == \
        pytest.approx((p + 1) * alpha_beta.ring_time(hardware, p, 0))


@pytest.mark.parametrize("ranks, gpus_per_node", [(8, 8), (64, 1), (64, 4)])
def test_tree_bandwidth_is_the_rings_times_p_over_p_minus_one(ranks, gpus_per_node):
    """With no latency: 2n bytes per rank through the tree against the ring's 2(p-1)/p n,
    through the same path bandwidth (on one node and across nodes)."""
    hardware = Hardware("no latency", gpus_per_node=gpus_per_node, intra_alpha=0.0,
                        intra_bandwidth=50e9, inter_alpha=0.0, inter_bandwidth=25e9)
    n = 1e8
    assert alpha_beta.tree_time(hardware, ranks, n) == \
        pytest.approx(alpha_beta.ring_time(hardware, ranks, n) * ranks / (ranks - 1))


def test_rows_spanning_nodes():
    """An 8 x 2 torus on 4-GPU nodes: rows cross nodes (one NIC), each node's 4 columns leave
    it and share its NICs."""
    n = 1e8
    row = 7 * (10e-6 + n / 8 / 12.5e9)
    column = 2 * 1 * (10e-6 + n / 8 / 2 / (25e9 / 4))
    assert alpha_beta.torus_time(ABCI, 16, n, columns=8) == pytest.approx(2 * row + column)


def test_one_shot_by_hand():
    """The one-shot form: X - 1 steps of the whole buffer along the row, then Y - 1 along the
    column (on ABCI's 4 x 4: NVLink, then the node's NICs shared by its 4 columns)."""
    n = 256 << 10
    assert alpha_beta.one_shot_time(uniform(16, 1e-5, 1e9), 16, n, columns=4) == \
        pytest.approx(6 * (1e-5 + n / 1e9))
    row = 3 * (5e-6 + n / 50e9)
    column = 3 * (10e-6 + n / (25e9 / 4))
    assert alpha_beta.one_shot_time(ABCI, 16, n) == pytest.approx(row + column)


def test_a_torus_on_part_of_one_node():
    """6 of a node's 8 GPUs: any row length dividing 6, every link NVLink (it was refused,
    where the ring, the tree and the hierarchy computed)."""
    dgx = alpha_beta.PRESETS["dgx-h100"]
    n = 1e8
    step = (3e-6 + n / 6 / 360e9)
    assert alpha_beta.torus_time(dgx, 6, n) == pytest.approx(2 * 5 * step)  # 6 x 1: a ring
    row = 2 * (3e-6 + n / 3 / 360e9)
    column = 2 * 1 * (3e-6 + n / 3 / 2 / 360e9)
    assert alpha_beta.torus_time(dgx, 6, n, columns=3) == pytest.approx(2 * row + column)
    assert alpha_beta.best_columns(dgx, 6, n) in (1, 2, 3, 6)
    assert alpha_beta.allreduce_time("pipelined", dgx, 6, n) > 0
    with pytest.raises(ValueError, match="torus row"):
        alpha_beta.torus_time(dgx, 6, n, columns=4)


def test_pipelining():
    n = 64 << 20
    hardware = uniform(16, 0.0, 1e9)
    torus = alpha_beta.torus_time(hardware, 16, n, columns=4)
    # One segment is the plain torus; with no latency more segments only help, down to the
    # busier links' share plus one segment of the other.
    assert alpha_beta.pipelined_time(hardware, 16, n, 4, segment_bytes=n) == pytest.approx(torus)
    scatter, column, gather = alpha_beta.torus_phases(hardware, 16, n, 4)
    eight = alpha_beta.pipelined_time(hardware, 16, n, 4, segment_bytes=n // 8)
    assert eight == pytest.approx(scatter + gather + column / 8)
    # Without overlap (loopback: the phases share the cores) segments change nothing.
    shared = uniform(16, 0.0, 1e9, overlap=False)
    assert alpha_beta.pipelined_time(shared, 16, n, 4, segment_bytes=n // 8) == \
        pytest.approx(torus)
    # With latency, each segment pays it again: the best segment beats the default.
    best = alpha_beta.best_segment_bytes(ABCI, 4096, n)
    assert alpha_beta.pipelined_time(ABCI, 4096, n, segment_bytes=best) < \
        alpha_beta.pipelined_time(ABCI, 4096, n)


def test_efficiency_and_projection():
    assert alpha_beta.scaling_efficiency(0.09, 0.01) == pytest.approx(0.9)
    rows = alpha_beta.projection(ABCI, [8, 1024, 4096], compute_ms=45)
    assert [row["gpus"] for row in rows] == [8, 1024, 4096]
    for row in rows:
        for name in alpha_beta.ALGORITHMS:
            seconds = row[f"{name}_ms"] / 1e3
            assert row[f"{name}_efficiency"] == pytest.approx(0.045 / (0.045 + seconds))
        fastest_torus = min(row["pipelined_ms"], row["best_torus_ms"])
        assert row["torus_speedup_over_tree"] == pytest.approx(row["tree_ms"] / fastest_torus)
    # The torus' point: far fewer steps than the flat ring at thousands of GPUs.
    assert rows[-1]["torus_ms"] < rows[-1]["ring_ms"] / 2
    # Against the tree it wins on two nodes (half the tree's bytes on the NICs, NVLink
    # phases hidden by the pipeline) and loses at thousands of GPUs (Y steps against log N).
    assert rows[0]["torus_speedup_over_tree"] > 1 > rows[-1]["torus_speedup_over_tree"]
    one_gpu = alpha_beta.projection(ABCI, [1])[0]
    assert one_gpu["tree_ms"] == one_gpu["ring_ms"] == 0 and \
        one_gpu["torus_speedup_over_tree"] == 1


def test_bad_rank_counts():
    with pytest.raises(ValueError, match="whole nodes"):
        alpha_beta.ring_time(ABCI, 6, 1e6)
    with pytest.raises(ValueError, match="whole nodes"):
        alpha_beta.tree_time(ABCI, 6, 1e6)
    with pytest.raises(ValueError, match="torus row"):
        alpha_beta.torus_time(ABCI, 16, 1e6, columns=3)
    with pytest.raises(ValueError, match="algorithm"):
        alpha_beta.allreduce_time("butterfly", ABCI, 16)


def forced_torus_time(hardware, ranks, nbytes, columns):
    """What the forced torus runs on CPU tensors: one shot up to 256 KiB, else its four phases
    in segments of 2 MiB per rank, 8 to 16 MiB."""
    if nbytes <= 256 << 10:
        return alpha_beta.one_shot_time(hardware, ranks, nbytes, columns)
    segment_bytes = min(max(ranks * (2 << 20), 8 << 20), 16 << 20)
    return alpha_beta.pipelined_time(hardware, ranks, nbytes, columns, segment_bytes)


def synthetic_rows(alpha, beta, cores):
    """bench_allreduce rows that follow the model exactly."""
    rows = []
    for ranks, columns in ((4, 2), (8, 2), (16, 4)):
        hardware = calibration.loopback(alpha, beta, ranks, cores)
        for nbytes in (4096, 1 << 20, 64 << 20):
            for backend in ("gloo", "torus"):
                seconds = alpha_beta.ring_time(hardware, ranks, nbytes) if backend == "gloo" \
                    else forced_torus_time(hardware, ranks, nbytes, columns)
                rows.append({"shape": f"{columns}x{ranks // columns}", "ranks": ranks,
                             "bytes": nbytes, "backend": backend, "ms": seconds * 1e3})
    return rows


@pytest.mark.parametrize("cores", [None, 2])
def test_fit_recovers_alpha_and_beta(cores):
    rows = [{**row, "seconds": row["ms"] / 1e3} for row in synthetic_rows(1e-3, 1e-9, cores)
            if row["backend"] == "gloo"]
    alpha, beta = calibration.fit_alpha_beta(rows, cores)
    assert alpha == pytest.approx(1e-3, rel=1e-9)
    assert beta == pytest.approx(1e-9, rel=1e-9)
    with pytest.raises(ValueError, match="two sizes"):
        calibration.fit_alpha_beta(rows[:1], cores)


def test_fit_keeps_alpha_and_beta_positive():
    """Noise in the small sizes fitted a negative latency (or bandwidth) and printed it; now
    alpha stays at 0 or above, and times that do not grow with the bytes are refused."""
    def row(nbytes, ms):
        return {"ranks": 2, "bytes": nbytes, "seconds": ms / 1e3}
    # 1 MB in 1 ms and 10 MB in 11 ms: a line through them crosses 0 below 0 bytes
    alpha, beta = calibration.fit_alpha_beta([row(1e6, 1.0), row(1e7, 11.0)])
    assert alpha == 0
    # least squares of the relative error with alpha = 0: beta = sum(b/t) / sum((b/t)^2)
    ratios = [2 * 1 / 2 * 1e6 / 1e-3, 2 * 1 / 2 * 1e7 / 11e-3]
    assert beta == pytest.approx(sum(ratios) / sum(r * r for r in ratios))
    with pytest.raises(ValueError, match="do not grow with the bytes"):
        calibration.fit_alpha_beta([row(4096, 1.0), row(65536, 0.9)])
    with pytest.raises(ValueError, match="above 0, got -0.001 s"):
        calibration.fit_alpha_beta([row(4096, 1.0), row(65536, -1.0)])


def test_command_line(tmp_path, capsys):
    measured = tmp_path / "allreduce.csv"
    with open(measured, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=["shape", "ranks", "bytes", "backend", "ms"])
        writer.writeheader()
        writer.writerows(synthetic_rows(2e-3, 5e-10, 2))
        # bench_allreduce's "auto" rows: whichever algorithm its trials chose, not modelled
        # (they were modelled as the torus)
        writer.writerow({"shape": "2x2", "ranks": 4, "bytes": 4096, "backend": "auto",
                         "ms": 123.0})
    plot, table = tmp_path / "model.png", tmp_path / "model.csv"
    cli.main(["--gpus", "8", "64", "4096", "--calibrate", str(measured), "--cores", "2",
              "--plot", str(plot), "--csv", str(table)])
    output = capsys.readouterr().out
    assert "alpha = 2.000 ms" in output and "abci-v100" in output and "dgx-h100" in output
    assert "the torus beats NCCL's tree at 8 GPUs; the tree beats the torus at 64, 4096 GPUs" \
        in output
    assert plot.stat().st_size > 0
    with open(table) as file:
        rows = list(csv.DictReader(file))
    assert [(row["hardware"], row["gpus"]) for row in rows] == [
        (hardware, gpus) for hardware in ("abci-v100", "dgx-h100") for gpus in ("8", "64", "4096")]
    projected = alpha_beta.projection(ABCI, [4096])[0]
    assert float(rows[2]["tree_ms"]) == pytest.approx(projected["tree_ms"])
    assert float(rows[2]["torus_speedup_over_tree"]) == \
        pytest.approx(projected["torus_speedup_over_tree"])
    _, _, table = calibration.calibrate(measured, cores=2)
    assert {row["backend"] for row in table} == {"gloo", "torus"}
    for row in table:  # rows made by the model: model and measurement agree
        assert row["model_ms"] == pytest.approx(row["measured_ms"])



@pytest.mark.parametrize("arguments, message", [
    (["--gpus", "6"], "--gpus: 6 ranks do not fill whole nodes of 4 GPUs"),  # was a traceback
    (["--bytes", "0"], "--bytes must be positive, got 0"),  # was a ZeroDivisionError
])
def test_command_line_errors_are_usage_errors(arguments, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*arguments, "--plot", ""])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("contents, arguments, message", [
    (None, [], "--calibrate {path}: [Errno 2] No such file"),  # were tracebacks, printed
    ("shape,ranks,bytes,backend\n2x2,4,4096,gloo\n", [],  # after the whole projection
     "--calibrate {path}: not a CSV of benchmarks/bench_allreduce.py: no column ms"),
    ("shape,ranks,bytes,backend,ms\n2x2,4,4096,gloo,0\n2x2,4,65536,gloo,1\n", [],
     "--calibrate {path}: a measured time must be above 0, got 0.0 s"),
    ("shape,ranks,bytes,backend,ms\n2x2,4,4096,gloo,1\n", [],
     "--calibrate {path}: fitting alpha and beta needs rows of at least two sizes"),
    ("", ["--compute-ms", "-5"], "--compute-ms must be 0 or more, got -5.0"),  # was nan%
    ("", ["--cores", "0"], "--cores must be at least 1, got 0"),  # was one core per rank
])
def test_bad_calibration_input_is_a_usage_error_before_any_output(
        tmp_path, contents, arguments, message, capsys):
    path = tmp_path / "allreduce.csv"
    if contents is not None:
        path.write_text(contents)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--calibrate", str(path), *arguments, "--plot", ""])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and message.format(path=path) in captured.err
    assert captured.out == ""


def test_python_dash_m_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "torch_bigbatch.distributed.cost_model", "--hardware",
         "abci-v100", "--gpus", "8", "16", "--plot", ""],
        cwd=REPOSITORY, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "abci-v100" in result.stdout and "dgx-h100" not in result.stdout
    assert "the torus beats NCCL's tree at 8, 16 GPUs" in result.stdout


def test_best_row_length():
    """Latency only: 2(X-1) + 2(4096/X - 1) steps are fewest at X = 64, the square root; with
    the full gradient the model keeps ABCI's rows inside a node until a thousand GPUs."""
    assert alpha_beta.best_columns(ABCI, 4096, 0) == 64
    assert alpha_beta.best_columns(ABCI, 1024, alpha_beta.RESNET50_GRADIENT_BYTES) == 4
    rows = alpha_beta.projection(ABCI, [4096])
    assert rows[0]["best_torus_ms"] <= rows[0]["torus_ms"]
