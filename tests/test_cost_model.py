"""The alpha-beta cost model: each algorithm against its formula written out by hand, the
identities the papers state, the calibration fit and the command line."""

import csv

import pytest

import torch_bigbatch as bb
from torch_bigbatch.distributed import cost_model
from torch_bigbatch.distributed.cost_model import Hardware

ABCI = cost_model.PRESETS["abci-v100"]


def uniform(ranks, alpha, bandwidth, overlap=True):
    """Every link alike, one node."""
    return Hardware("uniform", gpus_per_node=ranks, intra_alpha=alpha,
                    intra_bandwidth=bandwidth, inter_alpha=alpha, inter_bandwidth=bandwidth,
                    overlap=overlap)


def test_ring_is_twice_p_minus_one_steps():
    # 2(p-1) steps of alpha + n/p bytes: 14 * (10 us + 125 us).
    assert cost_model.ring_time(uniform(8, 1e-5, 1e9), 8, 1e6) == pytest.approx(1.89e-3)


def test_torus_latency_and_bandwidth_terms():
    """ARCHITECTURE.md: torus = 2(X-1)alpha + 2(Y-1)alpha + 2(p-1)/p n beta, the ring's
    bandwidth term with far fewer steps."""
    hardware = uniform(64, 1e-5, 1e9)
    assert cost_model.torus_time(hardware, 64, 0, columns=8) == pytest.approx(28 * 1e-5)
    assert cost_model.ring_time(hardware, 64, 0) == pytest.approx(126 * 1e-5)
    no_latency = uniform(64, 0.0, 1e9)
    for columns in (2, 4, 8, 16, 32):
        assert cost_model.torus_time(no_latency, 64, 1e8, columns) == \
            pytest.approx(cost_model.ring_time(no_latency, 64, 1e8))


def test_torus_on_abci_by_hand():
    """16 V100 as 4 x 4: rows on NVLink, the 4 columns of a node share its 25 GB/s."""
    n = cost_model.RESNET50_GRADIENT_BYTES
    row = 3 * (5e-6 + n / 4 / 50e9)
    column = 2 * 3 * (10e-6 + n / 4 / 4 / (25e9 / 4))
    assert cost_model.torus_time(ABCI, 16, n) == pytest.approx(2 * row + column)
    # The flat ring crosses nodes at every step: the inter-node alpha, all NICs' bandwidth.
    assert cost_model.ring_time(ABCI, 16, n) == pytest.approx(30 * (10e-6 + n / 16 / 25e9))
    # Goyal's hierarchy: reduce and broadcast in the node, leaders' ring on one 12.5 GB/s NIC.
    leaders = 2 * 3 * (10e-6 + n / 4 / 12.5e9)
    assert cost_model.hierarchical_time(ABCI, 16, n) == pytest.approx(2 * row * 2 + leaders)


def test_rows_spanning_nodes():
    """An 8 x 2 torus on 4-GPU nodes: rows cross nodes (one NIC), each node's 4 columns leave
    it and share its NICs."""
    n = 1e8
    row = 7 * (10e-6 + n / 8 / 12.5e9)
    column = 2 * 1 * (10e-6 + n / 8 / 2 / (25e9 / 4))
    assert cost_model.torus_time(ABCI, 16, n, columns=8) == pytest.approx(2 * row + column)


def test_pipelining():
    n = 64 << 20
    hardware = uniform(16, 0.0, 1e9)
    torus = cost_model.torus_time(hardware, 16, n, columns=4)
    # One segment is the plain torus; with no latency more segments only help, down to the
    # busier links' share plus one segment of the other.
    assert cost_model.pipelined_time(hardware, 16, n, 4, segment_bytes=n) == pytest.approx(torus)
    scatter, column, gather = cost_model.torus_phases(hardware, 16, n, 4)
    eight = cost_model.pipelined_time(hardware, 16, n, 4, segment_bytes=n // 8)
    assert eight == pytest.approx(scatter + gather + column / 8)
    # Without overlap (loopback: the phases share the cores) segments change nothing.
    shared = uniform(16, 0.0, 1e9, overlap=False)
    assert cost_model.pipelined_time(shared, 16, n, 4, segment_bytes=n // 8) == \
        pytest.approx(torus)
    # With latency, each segment pays it again: the best segment beats the default.
    best = cost_model.best_segment_bytes(ABCI, 4096, n)
    assert cost_model.pipelined_time(ABCI, 4096, n, segment_bytes=best) < \
        cost_model.pipelined_time(ABCI, 4096, n)


def test_resnet50_gradient_size():
    model = bb.models.resnet50()
    assert sum(p.numel() for p in model.parameters()) == cost_model.RESNET50_PARAMETERS


def test_efficiency_and_projection():
    assert cost_model.scaling_efficiency(0.09, 0.01) == pytest.approx(0.9)
    rows = cost_model.projection(ABCI, [8, 1024, 4096], compute_ms=45)
    assert [row["gpus"] for row in rows] == [8, 1024, 4096]
    for row in rows:
        for name in cost_model.ALGORITHMS:
            seconds = row[f"{name}_ms"] / 1e3
            assert row[f"{name}_efficiency"] == pytest.approx(0.045 / (0.045 + seconds))
    # The torus' point: far fewer steps than the flat ring at thousands of GPUs.
    assert rows[-1]["torus_ms"] < rows[-1]["ring_ms"] / 2


def test_bad_rank_counts():
    with pytest.raises(ValueError, match="whole nodes"):
        cost_model.ring_time(ABCI, 6, 1e6)
    with pytest.raises(ValueError, match="torus row"):
        cost_model.torus_time(ABCI, 16, 1e6, columns=3)
    with pytest.raises(ValueError, match="algorithm"):
        cost_model.allreduce_time("tree", ABCI, 16)


def synthetic_rows(alpha, beta, cores):
    """bench_allreduce rows that follow the model exactly."""
    rows = []
    for ranks, columns in ((4, 2), (8, 2), (16, 4)):
        hardware = cost_model.loopback(alpha, beta, ranks, cores)
        for nbytes in (4096, 1 << 20, 64 << 20):
            for backend in ("gloo", "torus"):
                seconds = cost_model.ring_time(hardware, ranks, nbytes) if backend == "gloo" \
                    else cost_model.pipelined_time(hardware, ranks, nbytes, columns)
                rows.append({"shape": f"{columns}x{ranks // columns}", "ranks": ranks,
                             "bytes": nbytes, "backend": backend, "ms": seconds * 1e3})
    return rows


@pytest.mark.parametrize("cores", [None, 2])
def test_fit_recovers_alpha_and_beta(cores):
    rows = [{**row, "seconds": row["ms"] / 1e3} for row in synthetic_rows(1e-3, 1e-9, cores)
            if row["backend"] == "gloo"]
    alpha, beta = cost_model.fit_alpha_beta(rows, cores)
    assert alpha == pytest.approx(1e-3, rel=1e-9)
    assert beta == pytest.approx(1e-9, rel=1e-9)
    with pytest.raises(ValueError, match="two sizes"):
        cost_model.fit_alpha_beta(rows[:1], cores)


def test_command_line(tmp_path, capsys):
    measured = tmp_path / "allreduce.csv"
    with open(measured, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=["shape", "ranks", "bytes", "backend", "ms"])
        writer.writeheader()
        writer.writerows(synthetic_rows(2e-3, 5e-10, 2))
    plot, table = tmp_path / "model.png", tmp_path / "model.csv"
    cost_model.main(["--gpus", "8", "64", "4096", "--calibrate", str(measured), "--cores", "2",
                     "--plot", str(plot), "--csv", str(table)])
    output = capsys.readouterr().out
    assert "alpha = 2.000 ms" in output and "abci-v100" in output and "dgx-h100" in output
    assert plot.stat().st_size > 0
    with open(table) as file:
        rows = list(csv.DictReader(file))
    assert [(row["hardware"], row["gpus"]) for row in rows] == [
        (hardware, gpus) for hardware in ("abci-v100", "dgx-h100") for gpus in ("8", "64", "4096")]
    _, _, calibration = cost_model.calibrate(measured, cores=2)
    for row in calibration:  # rows made by the model: model and measurement agree
        assert row["model_ms"] == pytest.approx(row["measured_ms"])


def test_best_row_length():
    """Latency only: 2(X-1) + 2(4096/X - 1) steps are fewest at X = 64, the square root; with
    the full gradient the model keeps ABCI's rows inside a node until a thousand GPUs."""
    assert cost_model.best_columns(ABCI, 4096, 0) == 64
    assert cost_model.best_columns(ABCI, 1024, cost_model.RESNET50_GRADIENT_BYTES) == 4
    rows = cost_model.projection(ABCI, [4096])
    assert rows[0]["best_torus_ms"] <= rows[0]["torus_ms"]
