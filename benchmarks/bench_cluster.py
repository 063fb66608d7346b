"""Allreduce across an emulated cluster: torus and Gloo, their time and the bytes on each link.

N emulated nodes (benchmarks/emulated_cluster.py: network namespaces on a bridge) run this
script under torchrun with a c10d rendezvous, X processes each, so the torus has one row per
node (X = LOCAL_WORLD_SIZE) and its columns cross the nodes' links (with one process per
node, the squarest shape instead: 4 nodes, 2x2, rows of two nodes). For each link rate (none,
or a tbf rate per node standing for its NIC) and each size, the algorithms take turns over
several rounds of back-to-back fp32 allreduces (as benchmarks/bench_allreduce.py times them);
then each node reads its eth0 counters around a run of each algorithm alone: the bytes it
sends per allreduce, headers and a barrier included. Next to them: the bytes the algorithm
should send per node (torus: 2(Y-1)/Y of the buffer, X(Y-1) in its one-shot form, a flat
ring: 2(p-1)/p; expected_per_buffer) and the time
torch_bigbatch.distributed.cost_model's allreduce_time predicts, fitted (fit_alpha_beta) to
this run's Gloo times on unlimited links.

Run it as root from the repository root:

    python benchmarks/bench_cluster.py --nodes 2 --nproc-per-node 2 --rates none 1gbit
    python benchmarks/bench_cluster.py --nodes 3 --sizes 1M 16M --csv cluster.csv
"""

import argparse
import datetime
import json
import os
import socket
import statistics
import sys

import torch
import torch.distributed as dist

import torch_bigbatch  # noqa: F401  (registers the "torus" backend)
from bench_allreduce import (DEFAULT_SIZES, describe_choice, label, parse_size, time_round,
                             warm_up)
from common import positive_int, positive_seconds, taking_turns, write_csv
from emulated_cluster import (EmulatedCluster, check_every_node_succeeded, format_outputs,
                              node_environment, parse_rate, rate_argument,
                              refuse_a_rate_on_one_node)
from torch_bigbatch.distributed import TorusOptions, torus_shape
from torch_bigbatch.distributed.cost_model import Hardware, allreduce_time, fit_alpha_beta

# name: the group it runs on (built under torchrun) and the cost model's name for it.
ALGORITHMS = {  # name: (its group, the cost model's algorithm for what it runs)
    "torus": (lambda: dist.new_group(backend="torus", pg_options=TorusOptions(algorithm="torus")),
              "torus"),
    "auto": (lambda: dist.new_group(backend="torus", pg_options=TorusOptions(algorithm="auto")),
             None),  # per size: what it measured and chose
    "gloo": (lambda: dist.new_group(backend="gloo"), "ring"),
}
MODEL_OF_RUN = {"torus": "torus", "flat": "ring", "gloo": "ring"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "BENCH_CLUSTER_RESULT "
CSV_FIELDS = ["nodes", "nproc_per_node", "rate", "shape", "bytes", "algorithm", "runs", "ms",
              "model_ms", "sent_bytes_per_node", "sent_per_buffer", "expected_per_buffer"]


def expected_per_buffer(runs, nproc_per_node, shape):
    """The share of the buffer each node sends per allreduce. A flat ring: 2(p-1)/p (one hop
    per node leaves it, as the ranks of a node are contiguous). The torus of X columns and Y
    rows, with rows that are the nodes (X = the processes of a node): its columns carry
    2(Y-1)/Y (every node's X columns a 1/X slice each), in the one-shot form X(Y-1) (each
    member sends its row's sum to the Y - 1 others); with one process per node the shape is
    the squarest (torus.resolve_shape) and every message crosses a link: 2(p-1)/p again, in
    the one-shot form X - 1 + Y - 1."""
    columns, rows = shape
    ranks = columns * rows
    ring = 2 * (ranks - 1) / ranks
    one_shot = runs == "torus 1-shot"
    if runs in ("gloo", "flat"):
        return ring
    if columns == nproc_per_node:
        return columns * (rows - 1) if one_shot else 2 * (rows - 1) / rows
    return columns + rows - 2 if one_shot else ring


# ---- the worker: one rank under torchrun, in a node ----

def link_counters(interface):
    """(sent, received) bytes of this node's interface so far."""
    folder = f"/sys/class/net/{interface}/statistics"
    with open(f"{folder}/tx_bytes") as sent, open(f"{folder}/rx_bytes") as received:
        return int(sent.read()), int(received.read())


def sent_per_call(run, iters, interface):
    """Bytes this node's interface sends per call of `run`, every rank calling it together."""
    dist.barrier()
    before, _ = link_counters(interface)
    for _ in range(iters):
        run()
    dist.barrier()  # every rank has received its share: the node's bytes have left it
    after, _ = link_counters(interface)
    return (after - before) / iters


def worker(args):
    torch.set_num_threads(1)
    dist.init_process_group("torus", timeout=datetime.timedelta(seconds=args.collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {name: ALGORITHMS[name][0]() for name in args.algorithms}
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    leader = int(os.environ["LOCAL_RANK"]) == 0
    rows = []
    for nbytes in args.sizes:
        tensor = torch.ones(nbytes // 4)
        iters = max(1, min(args.iters, args.round_bytes // nbytes))
        seconds = {name: [] for name in groups}
        for name, group in groups.items():
            warm_up(tensor, name, group)
        for name, group in taking_turns(groups.items(), args.rounds):
            seconds[name].append(time_round(lambda: dist.all_reduce(tensor, group=group),
                                            dist.group.WORLD, iters, tensor.device)[0])
        for name, group in groups.items():
            sent = sent_per_call(lambda: dist.all_reduce(tensor, group=group), iters,
                                 args.interface)
            per_rank = [None] * world
            dist.all_gather_object(per_rank, sent if leader else None)
            runs = "gloo" if name == "gloo" else describe_choice(nbytes, group, tensor.device)
            rows.append({"bytes": nbytes, "algorithm": name, "runs": runs,
                         "ms": statistics.median(seconds[name]) * 1e3,
                         "sent_per_node": {hosts[r]: per_rank[r] for r in range(world)
                                           if per_rank[r] is not None}})
    if rank == 0:
        print(MARKER + json.dumps({"shape": list(torus_shape()), "hosts": hosts, "rows": rows}),
              flush=True)
    dist.destroy_process_group()


# ---- the driver: the emulated cluster, the model, the table ----

def worker_args(args):
    return ["--worker", "--algorithms", *args.algorithms, "--sizes", *map(str, args.sizes),
            "--iters", str(args.iters), "--rounds", str(args.rounds),
            "--round-bytes", str(args.round_bytes), "--interface", "eth0",
            "--collective-timeout", str(args.collective_timeout)]


def measure(nodes, nproc_per_node, rate, args):
    """The worker's result on `nodes` emulated nodes with links of `rate` (None: unlimited):
    {"shape", "hosts" (by rank), "rows"}."""
    env = node_environment(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    with EmulatedCluster(nodes, rate=rate) as cluster:
        results = cluster.run(lambda node: cluster.torchrun(
            node, [os.path.abspath(__file__), *worker_args(args)], nproc_per_node),
            timeout=args.timeout, env=env)
    check_every_node_succeeded(cluster, results, f"the allreduces on {nodes} nodes")
    outputs = [output for _, output in results]
    for output in outputs:
        for line in output.splitlines():
            if line.startswith(MARKER):
                return json.loads(line[len(MARKER):])
    raise RuntimeError("no result from the cluster:\n" + format_outputs(cluster.nodes, outputs))


def emulated_hardware(alpha, beta, nodes, nproc_per_node, rate):
    """The cost model's view of the emulated cluster: every rank's messages share this
    machine's cores (the fitted alpha and beta), and a node's link is at most `rate`."""
    ranks = nodes * nproc_per_node
    bandwidth = 1 / (beta * max(1.0, ranks / (os.cpu_count() or 1)))
    link = min(bandwidth, parse_rate(rate) / 8) if rate else bandwidth
    return Hardware("emulated", gpus_per_node=nproc_per_node, intra_alpha=alpha,
                    intra_bandwidth=bandwidth, inter_alpha=alpha, inter_bandwidth=link,
                    overlap=False)


def table_rows(result, nodes, nproc_per_node, rate, hardware):
    ranks = nodes * nproc_per_node
    rows = []
    for row in result["rows"]:
        nbytes, algorithm, runs = row["bytes"], row["algorithm"], row["runs"]
        kind = runs.split()[0]  # "torus 16M": the torus with other segments
        sent = statistics.mean(row["sent_per_node"].values())
        # The model has the four-phase torus with a row per node: not the one-shot form, nor
        # the squarest shape of one process per node.
        modelled = runs != "torus 1-shot" and (kind != "torus"
                                               or result["shape"][0] == nproc_per_node)
        model = allreduce_time(MODEL_OF_RUN[kind], hardware, ranks, nbytes) * 1e3 \
            if hardware and modelled else None
        rows.append({"nodes": nodes, "nproc_per_node": nproc_per_node, "rate": rate or "none",
                     "shape": "x".join(map(str, result["shape"])), "bytes": nbytes,
                     "algorithm": algorithm, "ms": row["ms"], "model_ms": model,
                     "sent_bytes_per_node": sent, "sent_per_buffer": sent / nbytes,
                     "runs": runs,
                     "expected_per_buffer": expected_per_buffer(runs, nproc_per_node,
                                                                result["shape"])})
    return rows


def print_table(rows, result):
    first = rows[0]
    hosts = result["hosts"]
    columns = int(first["shape"].split("x")[0])
    layout = "; ".join(f"row {y}: ranks {y * columns}-{(y + 1) * columns - 1} on "
                       f"{', '.join(sorted(set(hosts[y * columns:(y + 1) * columns])))}"
                       for y in range(len(hosts) // columns))
    print(f"\n{first['nodes']} nodes x {first['nproc_per_node']} processes, links "
          f"{first['rate']}, torus {first['shape']} ({layout})")
    print(f"{'size':>9} | {'algorithm':>9} | {'ms':>9} | {'model ms':>9} | "
          f"{'sent per node':>13} | {'x buffer':>8} | {'expected':>8} | runs")
    for row in rows:
        model = f"{row['model_ms']:9.2f}" if row["model_ms"] is not None else f"{'-':>9}"
        print(f"{label(row['bytes']):>9} | {row['algorithm']:>9} | {row['ms']:9.2f} | {model} | "
              f"{row['sent_bytes_per_node'] / 2**20:9.3f} MiB | {row['sent_per_buffer']:8.3f} | "
              f"{row['expected_per_buffer']:8.3f} | {row['runs']}")


def fitted_alpha_beta(result, ranks):
    """The ring model's alpha and beta fitted to Gloo's times on unlimited links."""
    rows = [{"ranks": ranks, "bytes": row["bytes"], "seconds": row["ms"] / 1e3}
            for row in result["rows"] if row["algorithm"] == "gloo"]
    return fit_alpha_beta(rows, cores=os.cpu_count())


def get_args_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=positive_int, default=2)
    parser.add_argument("--nproc-per-node", type=positive_int, default=2)
    parser.add_argument("--rates", nargs="+", type=rate_argument, default=["none", "1gbit"],
                        help='per-node link rates, "none" for unlimited (it calibrates the model)')
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=list(ALGORITHMS))
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=DEFAULT_SIZES,
                        help="e.g. 4K 1M 64M")
    parser.add_argument("--iters", type=positive_int, default=10, help="allreduces per round (fewer "
                        "for large sizes: at most --round-bytes moved per round)")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--round-bytes", type=parse_size, default=parse_size("64M"))
    parser.add_argument("--timeout", type=positive_seconds, default=1800,
                        help="seconds for each rate's whole run")
    parser.add_argument("--collective-timeout", type=positive_seconds, default=300)
    parser.add_argument("--interface", default="eth0", help="(worker) the link to count")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    return parser


def main():
    parser = get_args_parser()
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    refuse_a_rate_on_one_node(parser, args.nodes, args.rates)
    if len(set(args.rates)) < len(args.rates):  # measured twice, one result kept
        parser.error(f"--rates names a rate twice: {args.rates}")
    if os.geteuid() != 0:
        sys.exit("bench_cluster.py emulates nodes with network namespaces: run it as root")
    rates = [None if rate == "none" else rate for rate in args.rates]
    ranks = args.nodes * args.nproc_per_node
    results = {rate: measure(args.nodes, args.nproc_per_node, rate, args) for rate in rates}
    calibration = None
    if None in results and "gloo" in args.algorithms and len(set(args.sizes)) > 1:
        calibration = fitted_alpha_beta(results[None], ranks)
        if min(calibration) > 0:
            print(f"cost model fitted to Gloo on unlimited links: alpha "
                  f"{calibration[0] * 1e3:.3f} ms, {1 / calibration[1] / 1e9:.2f} GB/s per core")
        else:  # Gloo's times did not grow with the size (small sizes, a noisy run)
            print(f"cost model not calibrated: the fit to Gloo gave alpha "
                  f"{calibration[0] * 1e3:.3f} ms and beta {calibration[1]:.3g} s/B")
            calibration = None
    all_rows = []
    for rate, result in results.items():
        hardware = emulated_hardware(*calibration, args.nodes, args.nproc_per_node, rate) \
            if calibration else None
        rows = table_rows(result, args.nodes, args.nproc_per_node, rate, hardware)
        print_table(rows, result)
        all_rows += rows
    if args.csv:
        write_csv(args.csv, all_rows, CSV_FIELDS)


if __name__ == "__main__":
    main()
