"""Fitting the model's alpha and beta to benchmarks/bench_allreduce.py's measurements, and
setting model and measurement side by side."""

import csv

from ... import _C
from .alpha_beta import (Hardware, default_segment_bytes, one_shot_time, pipelined_time,
                         ring_time)


def oversubscription(ranks, cores):
    """How many ranks share a core: their messages share its copy bandwidth."""
    return max(1.0, ranks / cores) if cores else 1.0


def fit_alpha_beta(rows, cores=None):
    """(alpha, beta) of the ring model 2(p-1) alpha + 2(p-1)/p nbytes beta s fitted to rows of
    {"ranks", "bytes", "seconds"}, s the ranks per core (1 without `cores`): least squares on
    the relative error, as the sizes span orders of magnitude, with alpha kept at 0 or above
    (a latency below 0 is noise in the small sizes: beta is then fitted alone)."""
    # Weighted normal equations of t = a * alpha + b * beta, weight 1 / t.
    saa = sab = sbb = sat = sbt = 0.0
    for row in rows:
        ranks, nbytes, seconds = int(row["ranks"]), float(row["bytes"]), float(row["seconds"])
        if not seconds > 0:
            raise ValueError(f"a measured time must be above 0, got {seconds} s for {ranks} ranks "
                             f"and {nbytes:g} bytes")
        a = 2 * (ranks - 1) / seconds
        b = 2 * (ranks - 1) / ranks * nbytes * oversubscription(ranks, cores) / seconds
        saa, sab, sbb, sat, sbt = saa + a * a, sab + a * b, sbb + b * b, sat + a, sbt + b
    determinant = saa * sbb - sab * sab
    if len(rows) < 2 or determinant <= 1e-12 * saa * sbb:
        raise ValueError("fitting alpha and beta needs rows of at least two sizes")
    alpha, beta = (sat * sbb - sbt * sab) / determinant, (saa * sbt - sab * sat) / determinant
    if alpha < 0:
        alpha, beta = 0.0, sbt / sbb
    if not beta > 0:
        raise ValueError(f"the times do not grow with the bytes (beta fitted as {beta:.3g} s per "
                         f"byte): measure sizes far enough apart")
    return alpha, beta


def loopback(alpha, beta, ranks, cores=None):
    """One machine whose `ranks` processes talk over loopback: every link alike, sharing the
    `cores` (None: a core each), and no overlap of the phases, which share those cores."""
    bandwidth = 1 / (beta * oversubscription(ranks, cores))
    return Hardware("loopback", gpus_per_node=ranks, intra_alpha=alpha,
                    intra_bandwidth=bandwidth, inter_alpha=alpha, inter_bandwidth=bandwidth,
                    overlap=False)


COLUMNS = ("shape", "ranks", "bytes", "backend", "ms")


def read_bench_allreduce(path):
    """benchmarks/bench_allreduce.py's CSV as rows with seconds."""
    with open(path, newline="") as file:
        reader = csv.DictReader(file)
        missing = [name for name in COLUMNS if name not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"not a CSV of benchmarks/bench_allreduce.py: no column "
                             f"{', '.join(missing)}")
        return [{**row, "seconds": float(row["ms"]) / 1e3} for row in reader]


def torus_model(hardware, row):
    """What the forced torus of bench_allreduce.py ran for this row: its one-shot form on CPU
    buffers up to _C.torus_one_shot_max_bytes, else its four phases in the default segments of
    the row's device and group size."""
    ranks, nbytes = int(row["ranks"]), int(row["bytes"])
    columns = int(row["shape"].split("x")[0])
    device = row.get("device", "cpu")
    if device == "cpu" and nbytes <= _C.torus_one_shot_max_bytes:
        return one_shot_time(hardware, ranks, nbytes, columns)
    return pipelined_time(hardware, ranks, nbytes, columns, default_segment_bytes(device, ranks))


def calibrate(path, cores=None):
    """Fits alpha and beta to the Gloo rows measured on a machine of `cores` cores; returns
    them and rows with model and measurement of Gloo (a ring) and of the forced torus (as
    torus_model says it ran). Rows of "auto" are left out: each ran one of the other two."""
    rows = read_bench_allreduce(path)
    alpha, beta = fit_alpha_beta([row for row in rows if row["backend"] == "gloo"], cores)
    table = []
    for row in rows:
        if row["backend"] not in ("gloo", "torus"):  # "auto": either, as its trials chose
            continue
        ranks, nbytes = int(row["ranks"]), int(row["bytes"])
        hardware = loopback(alpha, beta, ranks, cores)
        model = ring_time(hardware, ranks, nbytes) if row["backend"] == "gloo" \
            else torus_model(hardware, row)
        table.append({"shape": row["shape"], "ranks": ranks, "bytes": nbytes,
                      "backend": row["backend"], "measured_ms": row["seconds"] * 1e3,
                      "model_ms": model * 1e3})
    return alpha, beta, table
