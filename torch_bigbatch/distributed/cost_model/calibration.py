"""Fitting the model's alpha and beta to benchmarks/bench_allreduce.py's measurements, and
setting model and measurement side by side."""

import csv

from .alpha_beta import DEFAULT_SEGMENT_BYTES, Hardware, pipelined_time, ring_time


def oversubscription(ranks, cores):
    """How many ranks share a core: their messages share its copy bandwidth."""
    return max(1.0, ranks / cores) if cores else 1.0


def fit_alpha_beta(rows, cores=None):
    """(alpha, beta) of the ring model 2(p-1) alpha + 2(p-1)/p nbytes beta s fitted to rows of
    {"ranks", "bytes", "seconds"}, s the ranks per core (1 without `cores`): least squares on
    the relative error, as the sizes span orders of magnitude."""
    # Weighted normal equations of t = a * alpha + b * beta, weight 1 / t.
    saa = sab = sbb = sat = sbt = 0.0
    for row in rows:
        ranks, nbytes, seconds = int(row["ranks"]), float(row["bytes"]), float(row["seconds"])
        a = 2 * (ranks - 1) / seconds
        b = 2 * (ranks - 1) / ranks * nbytes * oversubscription(ranks, cores) / seconds
        saa, sab, sbb, sat, sbt = saa + a * a, sab + a * b, sbb + b * b, sat + a, sbt + b
    determinant = saa * sbb - sab * sab
    if len(rows) < 2 or determinant <= 1e-12 * saa * sbb:
        raise ValueError("fitting alpha and beta needs rows of at least two sizes")
    return (sat * sbb - sbt * sab) / determinant, (saa * sbt - sab * sat) / determinant


def loopback(alpha, beta, ranks, cores=None):
    """One machine whose `ranks` processes talk over loopback: every link alike, sharing the
    `cores` (None: a core each), and no overlap of the phases, which share those cores."""
    bandwidth = 1 / (beta * oversubscription(ranks, cores))
    return Hardware("loopback", gpus_per_node=ranks, intra_alpha=alpha,
                    intra_bandwidth=bandwidth, inter_alpha=alpha, inter_bandwidth=bandwidth,
                    overlap=False)


def read_bench_allreduce(path):
    """benchmarks/bench_allreduce.py's CSV as rows with seconds."""
    with open(path, newline="") as file:
        return [{**row, "seconds": float(row["ms"]) / 1e3} for row in csv.DictReader(file)]


def calibrate(path, cores=None, segment_bytes=DEFAULT_SEGMENT_BYTES):
    """Fits alpha and beta to the Gloo rows measured on a machine of `cores` cores; returns
    them and rows with model and measurement of Gloo (a ring) and of the torus (pipelined, at
    the measured shape and the backend's default segment). Rows of "auto" are left out: each
    ran whichever its trials chose, which the CSV does not say."""
    rows = read_bench_allreduce(path)
    alpha, beta = fit_alpha_beta([row for row in rows if row["backend"] == "gloo"], cores)
    table = []
    for row in rows:
        if row["backend"] not in ("gloo", "torus"):  # "auto": either, as its trials chose
            continue
        ranks, nbytes = int(row["ranks"]), int(row["bytes"])
        hardware = loopback(alpha, beta, ranks, cores)
        if row["backend"] == "gloo":
            model = ring_time(hardware, ranks, nbytes)
        else:
            columns = int(row["shape"].split("x")[0])
            model = pipelined_time(hardware, ranks, nbytes, columns, segment_bytes)
        table.append({"shape": row["shape"], "ranks": ranks, "bytes": nbytes,
                      "backend": row["backend"], "measured_ms": row["seconds"] * 1e3,
                      "model_ms": model * 1e3})
    return alpha, beta, table
