"""The alpha-beta cost of allreduce algorithms, from one node to thousands of GPUs.

A message of b bytes over one link takes alpha + b / bandwidth. A ring of m members moves
(m - 1)/m of the buffer per rank in m - 1 steps for a reduce-scatter or an allgather, and
twice that for an allreduce (Thakur et al. 2005; Patarasuk and Yuan 2009). Each step of a ring
waits for its slowest hop, so a ring that leaves the node pays the inter-node alpha and the
inter-node bandwidth that one ring gets there. Algorithms, for p = nodes * gpus_per_node:

  ring           one flat ring of p ranks (NCCL's rings use every NIC of a node together);
  hierarchical   Goyal et al. 2017, section 4: reduce to one GPU per node, a ring allreduce
                 between the nodes' leaders (one NIC each), a broadcast in the node;
  torus          Mikami et al. 2018: X x Y grid, reduce-scatter along the rows, allreduce of
                 the 1/X slices along the columns (the X columns of a node share its NICs),
                 allgather along the rows;
  pipelined      torch_bigbatch's torus: the buffer cut into segments whose phases overlap,
                 the rows' links busy with one segment while the columns carry another
                 (at the segment size the model finds best, printed with the table).

The model leaves out the time to sum (it is folded into the bandwidth term when calibrated)
and contention beyond the NICs' shares. Run `python -m torch_bigbatch.distributed.cost_model`
for the table and plot of ResNet-50's gradient from 8 to 4096 GPUs, and
`--calibrate CSV` to fit alpha and beta to benchmarks/bench_allreduce.py's Gloo rows and set
model and measurement side by side.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os

from .torus import TorusOptions

RESNET50_PARAMETERS = 25_557_032  # torchvision's resnet50: 25.6M fp32 gradients
RESNET50_GRADIENT_BYTES = 4 * RESNET50_PARAMETERS
SEGMENT_BYTES = TorusOptions.segment_bytes  # the backend's default


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A cluster of identical nodes. Bandwidths in bytes per second, one direction.

    intra_bandwidth: per GPU inside a node (NVLink); inter_bandwidth: per node, all its NICs
    together, shared by the flows that leave the node at once, one NIC at most per flow.
    overlap: whether the links inside and between nodes run at the same time (False where the
    ranks share their cores, as loopback processes on one machine do).
    """

    name: str
    gpus_per_node: int
    intra_alpha: float
    intra_bandwidth: float
    inter_alpha: float
    inter_bandwidth: float
    nics: int = 1
    overlap: bool = True
    compute_ms: float = 0.0  # forward and backward of 32 images per GPU, for the efficiency

    def flow_bandwidth(self, flows_per_node):
        """Bandwidth of each of `flows_per_node` flows that leave a node together."""
        per_flow = self.inter_bandwidth / max(1, flows_per_node)
        return min(self.intra_bandwidth, per_flow, self.inter_bandwidth / self.nics)


GB = 1e9
PRESETS = {
    # Mikami et al. 2018's ABCI node: 4 V100 (NVLink 2, 50 GB/s per pair) and two InfiniBand
    # EDR links (100 Gb/s each). Compute, an assumption (--compute-ms changes it): 32 images
    # forward and backward on a V100 in fp16 at about 700 images/s.
    "abci-v100": Hardware("abci-v100", gpus_per_node=4, intra_alpha=5e-6, intra_bandwidth=50 * GB,
                          inter_alpha=10e-6, inter_bandwidth=2 * 12.5 * GB, nics=2,
                          compute_ms=45.0),
    # DGX H100: 8 H100 on NVLink 4 (about 360 GB/s per GPU as NCCL reaches it) and eight
    # 400 Gb/s NICs. Compute, an assumption: 32 images on an H100 in bf16 at about 2,700/s.
    "dgx-h100": Hardware("dgx-h100", gpus_per_node=8, intra_alpha=3e-6,
                         intra_bandwidth=360 * GB, inter_alpha=8e-6,
                         inter_bandwidth=8 * 50 * GB, nics=8, compute_ms=12.0),
}


def ring_phase(members, nbytes, alpha, bandwidth):
    """A reduce-scatter or an allgather over a ring of `members`: (m-1) steps of nbytes/m."""
    if members <= 1:
        return 0.0
    return (members - 1) * (alpha + nbytes / members / bandwidth)


def ring_allreduce(members, nbytes, alpha, bandwidth):
    return 2 * ring_phase(members, nbytes, alpha, bandwidth)


def check_ranks(hardware, ranks):
    nodes = max(1, ranks // hardware.gpus_per_node)
    if ranks < 1 or (ranks > hardware.gpus_per_node and ranks % hardware.gpus_per_node):
        raise ValueError(f"{ranks} ranks do not fill whole nodes of {hardware.gpus_per_node} GPUs")
    return nodes


def ring_time(hardware, ranks, nbytes):
    """One flat ring over every rank; with several nodes, each node's boundary hop carries a
    chunk per step through all its NICs (NCCL runs as many rings as NICs)."""
    if check_ranks(hardware, ranks) == 1:
        return ring_allreduce(ranks, nbytes, hardware.intra_alpha, hardware.intra_bandwidth)
    bandwidth = min(hardware.intra_bandwidth, hardware.inter_bandwidth)
    return ring_allreduce(ranks, nbytes, hardware.inter_alpha, bandwidth)


def hierarchical_time(hardware, ranks, nbytes):
    """Reduce in the node (reduce-scatter + gather), a ring between the nodes' leaders, a
    broadcast in the node (scatter + allgather)."""
    nodes = check_ranks(hardware, ranks)
    local = min(ranks, hardware.gpus_per_node)
    in_node = 4 * ring_phase(local, nbytes, hardware.intra_alpha, hardware.intra_bandwidth)
    leaders = ring_allreduce(nodes, nbytes, hardware.inter_alpha, hardware.flow_bandwidth(1))
    return in_node + leaders


def torus_phases(hardware, ranks, nbytes, columns=None):
    """(row reduce-scatter, column allreduce, row allgather) seconds of the X x Y torus, X =
    `columns` (default: the GPUs of a node). X must divide a node or be whole nodes."""
    check_ranks(hardware, ranks)
    columns = columns or min(ranks, hardware.gpus_per_node)
    node = hardware.gpus_per_node
    if ranks % columns or not (node % columns == 0 or columns % node == 0):
        raise ValueError(f"a torus row of {columns} must divide {ranks} ranks and divide or "
                         f"be whole nodes of {node}")
    rows = ranks // columns
    if columns <= node:  # a row inside a node; the node's `columns` columns share its NICs
        row = (hardware.intra_alpha, hardware.intra_bandwidth)
        column_crosses = rows > node // columns
        column_flows = columns
    else:  # a row over several nodes: one flow per node; every column leaves the node
        row = (hardware.inter_alpha, hardware.flow_bandwidth(1))
        column_crosses, column_flows = True, node
    column = (hardware.inter_alpha, hardware.flow_bandwidth(column_flows)) if column_crosses \
        else (hardware.intra_alpha, hardware.intra_bandwidth)
    scatter = ring_phase(columns, nbytes, *row)
    return scatter, ring_allreduce(rows, nbytes / columns, *column), scatter


def torus_time(hardware, ranks, nbytes, columns=None):
    return sum(torus_phases(hardware, ranks, nbytes, columns))


def pipelined_time(hardware, ranks, nbytes, columns=None, segment_bytes=SEGMENT_BYTES):
    """Segments of `segment_bytes`: the rows' links do every segment's scatter and gather,
    the columns' links every segment's allreduce, the busier of the two sets the pace and the
    other adds one segment's share (fill and drain). Without overlap, the segments add up.
    Each segment pays every phase's latency again: on thousands of GPUs, fewer segments win."""
    segments = max(1, math.ceil(nbytes / segment_bytes))
    scatter, column, gather = torus_phases(hardware, ranks, nbytes / segments, columns)
    if not hardware.overlap:
        return segments * (scatter + column + gather)
    return max(scatter + segments * column + gather, segments * (scatter + gather) + column)


def best_segment_bytes(hardware, ranks, nbytes, columns=None, max_segments=64):
    """The segment size (nbytes / s for s = 1 .. max_segments) that the model finds fastest."""
    sizes = [math.ceil(nbytes / segments) for segments in range(1, max_segments + 1)]
    return min(sizes, key=lambda size: pipelined_time(hardware, ranks, nbytes, columns, size))


def tuned_pipelined_time(hardware, ranks, nbytes):
    """The pipelined torus at the segment size best for this size and scale."""
    return pipelined_time(hardware, ranks, nbytes,
                          segment_bytes=best_segment_bytes(hardware, ranks, nbytes))


def best_columns(hardware, ranks, nbytes):
    """The row length X (dividing a node, or whole nodes) whose torus the model finds fastest:
    wider rows cut the column's steps, at the price of rows that leave the node."""
    node = hardware.gpus_per_node
    choices = [x for x in range(1, ranks + 1)
               if ranks % x == 0 and (node % x == 0 or x % node == 0)]
    return min(choices, key=lambda x: torus_time(hardware, ranks, nbytes, x))


MODELS = {"ring": ring_time, "hierarchical": hierarchical_time, "torus": torus_time,
          "pipelined": tuned_pipelined_time}
ALGORITHMS = tuple(MODELS)


def allreduce_time(algorithm, hardware, ranks, nbytes=RESNET50_GRADIENT_BYTES):
    if algorithm not in MODELS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    return MODELS[algorithm](hardware, ranks, nbytes)


def scaling_efficiency(compute_seconds, allreduce_seconds):
    """Throughput of p GPUs over p times one GPU's, when the allreduce does not overlap the
    backward pass (the worst case; DDP hides part of it behind the backward)."""
    return compute_seconds / (compute_seconds + allreduce_seconds)


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


def calibrate(path, cores=None, segment_bytes=SEGMENT_BYTES):
    """Fits alpha and beta to the Gloo rows measured on a machine of `cores` cores; returns
    them and rows with model and measurement of Gloo (a ring) and of the torus (pipelined, at
    the measured shape and the backend's default segment)."""
    rows = read_bench_allreduce(path)
    alpha, beta = fit_alpha_beta([row for row in rows if row["backend"] == "gloo"], cores)
    table = []
    for row in rows:
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


def projection(hardware, gpu_counts, nbytes=RESNET50_GRADIENT_BYTES, compute_ms=None):
    """Rows of allreduce milliseconds and scaling efficiency per algorithm and GPU count."""
    compute = (compute_ms if compute_ms is not None else hardware.compute_ms) / 1e3
    rows = []
    for ranks in gpu_counts:
        row = {"gpus": ranks}
        for algorithm in ALGORITHMS:
            seconds = allreduce_time(algorithm, hardware, ranks, nbytes)
            row[f"{algorithm}_ms"] = seconds * 1e3
            row[f"{algorithm}_efficiency"] = scaling_efficiency(compute, seconds) \
                if compute > 0 else float("nan")
        row["segment_mib"] = best_segment_bytes(hardware, ranks, nbytes) / 2**20
        row["best_columns"] = best_columns(hardware, ranks, nbytes)
        row["best_torus_ms"] = torus_time(hardware, ranks, nbytes, row["best_columns"]) * 1e3
        rows.append(row)
    return rows


def print_projection(hardware, rows, nbytes, compute_ms):
    print(f"\n{hardware.name}: allreduce of {nbytes / 1e6:.1f} MB (ms), and scaling efficiency "
          f"with {compute_ms:g} ms of compute per step and no overlap")
    header = " | ".join(f"{name:>12}" for name in ALGORITHMS)
    print("(torus: X = the GPUs of a node; pipelined: at the segment size printed; best X: the "
          "row length the model finds fastest)")
    print(f"{'GPUs':>5} | {header} | " + " | ".join(f"{'eff ' + n[:8]:>12}" for n in ALGORITHMS)
          + " | segment MiB | best X | its ms")
    for row in rows:
        times = " | ".join(f"{row[f'{name}_ms']:12.2f}" for name in ALGORITHMS)
        efficiency = " | ".join(f"{row[f'{name}_efficiency']:12.1%}" for name in ALGORITHMS)
        print(f"{row['gpus']:>5} | {times} | {efficiency} | {row['segment_mib']:11.1f} | "
              f"{row['best_columns']:>6} | {row['best_torus_ms']:6.2f}")


def print_calibration(alpha, beta, table):
    print(f"\nloopback Gloo fit: alpha = {alpha * 1e3:.3f} ms, beta = {beta * 1e9:.3f} ns/byte "
          f"({1 / beta / 1e9:.2f} GB/s per core)")
    print(f"{'shape':>5} | {'bytes':>9} | {'gloo meas':>9} | {'ring model':>10} | "
          f"{'torus meas':>10} | {'torus model':>11}")
    pairs = {}
    for row in table:
        pairs.setdefault((row["shape"], row["bytes"]), {})[row["backend"]] = row
    for (shape, nbytes), pair in pairs.items():
        gloo, torus = pair.get("gloo"), pair.get("torus")
        cells = [f"{gloo['measured_ms']:9.2f} | {gloo['model_ms']:10.2f}" if gloo
                 else f"{'':>9} | {'':>10}",
                 f"{torus['measured_ms']:10.2f} | {torus['model_ms']:11.2f}" if torus
                 else f"{'':>10} | {'':>11}"]
        print(f"{shape:>5} | {nbytes:>9} | {cells[0]} | {cells[1]}")
    for backend in ("gloo", "torus"):
        errors = sorted(abs(row["model_ms"] / row["measured_ms"] - 1) for row in table
                        if row["backend"] == backend)
        if errors:
            print(f"{backend}: model within {errors[len(errors) // 2]:.0%} of the measurement "
                  f"at the median, {errors[-1]:.0%} at worst")


def plot(projections, calibration, path):
    """Left: the allreduce time per algorithm and preset; middle: scaling efficiency;
    right (with a calibration): loopback model against measurement."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot

    panels = 3 if calibration else 2
    figure, axes = pyplot.subplots(1, panels, figsize=(5.5 * panels, 4))
    styles = ["-", "--", ":", "-."]
    for style, (hardware, rows) in zip(styles, projections):
        gpus = [row["gpus"] for row in rows]
        for color, name in zip(("tab:blue", "tab:orange", "tab:green", "tab:red"), ALGORITHMS):
            label = f"{hardware.name} {name}"
            axes[0].plot(gpus, [row[f"{name}_ms"] for row in rows], style, color=color,
                         label=label)
            axes[1].plot(gpus, [100 * row[f"{name}_efficiency"] for row in rows], style,
                         color=color, label=label)
    for axis, title in zip(axes, ("ResNet-50 allreduce (ms)", "scaling efficiency (%)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("GPUs")
        axis.set_title(title)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    if calibration:
        alpha, beta, table = calibration
        rank_counts = sorted({row["ranks"] for row in table})
        for backend, color in (("gloo", "tab:blue"), ("torus", "tab:red")):
            for ranks in rank_counts:
                rows = [row for row in table if row["backend"] == backend and
                        row["ranks"] == ranks]
                sizes = [row["bytes"] for row in rows]
                shade = 0.3 + 0.7 * ranks / rank_counts[-1]  # darker: more ranks
                axes[2].plot(sizes, [row["measured_ms"] for row in rows], "o", color=color,
                             alpha=shade)
                axes[2].plot(sizes, [row["model_ms"] for row in rows], "-", color=color,
                             alpha=shade, label=f"{backend} {ranks} ranks")
        axes[2].set_xscale("log", base=2)
        axes[2].set_yscale("log")
        axes[2].set_xlabel("bytes")
        axes[2].set_title(f"loopback: model (lines) vs measured (dots)\nalpha "
                          f"{alpha * 1e3:.2f} ms, {1 / beta / 1e9:.2f} GB/s per core")
        axes[2].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    pyplot.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hardware", nargs="+", choices=PRESETS, default=list(PRESETS))
    parser.add_argument("--bytes", type=int, default=RESNET50_GRADIENT_BYTES,
                        help="allreduce size (default: ResNet-50's fp32 gradient)")
    parser.add_argument("--gpus", type=int, nargs="+",
                        default=[2 ** i for i in range(3, 13)], help="8 to 4096 by default")
    parser.add_argument("--compute-ms", type=float,
                        help="compute per step for the efficiency (default: the preset's)")
    parser.add_argument("--calibrate", metavar="CSV",
                        help="benchmarks/bench_allreduce.py --csv output to fit loopback to")
    parser.add_argument("--cores", type=int, default=os.cpu_count(),
                        help="cores of the machine the calibration CSV was measured on")
    parser.add_argument("--plot", metavar="PNG", default="cost_model.png")
    parser.add_argument("--csv", metavar="PATH", help="also write the projection rows")
    args = parser.parse_args(argv)
    projections = []
    for name in args.hardware:
        hardware = PRESETS[name]
        compute_ms = args.compute_ms if args.compute_ms is not None else hardware.compute_ms
        rows = projection(hardware, args.gpus, args.bytes, compute_ms)
        print_projection(hardware, rows, args.bytes, compute_ms)
        projections.append((hardware, rows))
    calibration = calibrate(args.calibrate, args.cores) if args.calibrate else None
    if calibration:
        print_calibration(*calibration)
    if args.csv:
        with open(args.csv, "w", newline="") as file:
            fields = ["hardware", "gpus"]
            fields += [f"{name}_{kind}" for name in ALGORITHMS for kind in ("ms", "efficiency")]
            fields += ["segment_mib", "best_columns", "best_torus_ms"]
            writer = csv.DictWriter(file, fieldnames=fields)
            writer.writeheader()
            for hardware, rows in projections:
                writer.writerows({"hardware": hardware.name, **row} for row in rows)
    if args.plot:
        plot(projections, calibration, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
