"""End to end: the training job's images per second with --backend torus against --backend gloo.

Each case runs examples/train_resnet50.py under torchrun on this machine (OMP_NUM_THREADS=1, as
`make demo`), the two backends taking turns over --rounds, and stops it after a number of
steps. The rate is the steady one between the first progress line and the last (the first
steps pay for connections and allocations), read from rank 0's progress lines; the table gives
the median over rounds and torus / gloo. With --nodes N the processes run on N emulated nodes
(benchmarks/emulated_cluster.py, root; `make demo-cluster` is the demo on 2 nodes x 2), over
links of --rate when given. Cases:

    demo       `make demo`'s job: goyal2017, resnet_small on Fashion-MNIST, 64 images per rank
    resnet50   ResNet-50 (25.6 M parameters: a 102 MB gradient, in DDP's default 25 MiB
               buckets) on synthetic 28x28 images, 8 per rank

    python benchmarks/bench_ddp.py --cases demo --nprocs 4 8
    python benchmarks/bench_ddp.py --cases resnet50 --nprocs 8 --csv ddp.csv
    python benchmarks/bench_ddp.py --cases demo --nprocs 4 --nodes 2 --rates none 1gbit
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

from common import positive_int, positive_seconds, taking_turns, write_csv
from emulated_cluster import (EmulatedCluster, check_every_node_succeeded, node_environment,
                              rate_argument, refuse_a_rate_on_one_node)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Job arguments, steps, steps between progress lines, and the step from which the rate counts:
# after "auto" has decided the buckets' classes (a CPU class: 5 trial calls per candidate, two
# to four candidates, then 16 calls while the ranks agree: the demo's one 311 KB bucket per step
# decides at its 27th call; ResNet-50's buckets after DDP's rebuild: three of about 25 MiB, a
# class of 3 calls a step, and one each of 4 and 9 MiB, classes of one call a step, the 16 MiB
# one with four candidates at 4 ranks: its 37th call, so the rate counts from step 45).
CASES = {
    "demo": (["--recipe", "goyal2017", "--dataset", "fashion-mnist", "--epochs", "5",
              "--batch-per-rank", "64"], 100, 10, 40),
    "resnet50": (["--recipe", "goyal2017", "--dataset", "synthetic", "--model", "resnet50",
                  "--synthetic-size", "8192", "--epochs", "1", "--batch-per-rank", "8"], 70, 5,
                 45),
}
PROGRESS = re.compile(r"epoch (\d+)/\d+ step (\d+)/\d+ .* batch (\d+) ([\d.]+) img/s")
# Rank 0's log line at the tuner's decision of a size class (csrc/torus/algorithm_tuner.cpp).
DECISION = re.compile(r"torch_bigbatch torus \([^)]*\): \S+ allreduces (?:over \S+ \S+ )?"
                      r"up to (\S+ \S+) run (flat|torus \([^)]*\))")
CSV_FIELDS = ["case", "nodes", "rate", "processes", "backend", "images_per_second",
              "torus_over_gloo", "torus_choices"]


def steady_rate(output, settled=0):
    """Images per second between the first progress line of the first epoch from step
    `settled` on and that epoch's last. Each line gives the epoch's rate so far (its steps and
    its clock start again at the next epoch), so the time at a line is step * batch / rate."""
    lines = [(int(epoch), int(step), int(batch), float(rate))
             for epoch, step, batch, rate in PROGRESS.findall(output)]
    lines = [line[1:] for line in lines if line[0] == 1 and line[1] >= settled]
    if len(lines) < 2:
        raise RuntimeError(f"fewer than two progress lines in the first epoch from step "
                           f"{settled} on (more processes make shorter epochs) in:\n"
                           f"{output[-3000:]}")
    (first, batch, first_rate), (last, _, last_rate) = lines[0], lines[-1]
    seconds = last * batch / last_rate - first * batch / first_rate
    return (last - first) * batch / seconds


def decisions(output):
    """What auto ran, per size class decided in the run: "up to 512 KiB: torus (8 MiB
    segments)"; empty for gloo, or where no class was decided."""
    return "; ".join(f"up to {top}: {choice}" for top, choice in DECISION.findall(output))


def job_arguments(case, backend, output):
    arguments, steps, every, _ = CASES[case]
    return [os.path.join(ROOT, "examples", "train_resnet50.py"), *arguments, "--backend",
            backend, "--stop-after-steps", str(steps), "--print-every", str(every),
            "--checkpoint-every", "0", "--output", output]


def run(case, processes, backend, timeout, nodes=1, rate=None):
    """One run's steady rate and what auto decided, from rank 0's output: under torchrun
    here, or on `nodes` emulated nodes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as output:
        job = job_arguments(case, backend, output)
        if nodes == 1:
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                       str(processes), *job]
            torchrun = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=env, cwd=ROOT)
            try:
                stdout, stderr = torchrun.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                # SIGTERM: torchrun ends its workers first (killed, it left them running).
                torchrun.terminate()
                try:
                    torchrun.communicate(timeout=60)
                finally:
                    torchrun.kill()
                raise
            if torchrun.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed:\n{stdout[-2000:]}"
                                   f"{stderr[-3000:]}")
            return steady_rate(stdout, CASES[case][3]), decisions(stdout + stderr)
        with EmulatedCluster(nodes, rate=rate) as cluster:
            results = cluster.run(lambda node: cluster.torchrun(node, job, processes // nodes),
                                  timeout=timeout, env=node_environment(OMP_NUM_THREADS="1"))
        check_every_node_succeeded(cluster, results, f"{case} over {backend} on {nodes} nodes")
        outputs = [text for _, text in results]
        # Rank 0 runs on node 0.
        return steady_rate(outputs[0], CASES[case][3]), decisions(outputs[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--nprocs", nargs="+", type=positive_int, default=[4, 8])
    parser.add_argument("--nodes", type=positive_int, default=1,
                        help="emulated nodes the processes are spread over (root)")
    parser.add_argument("--rates", nargs="+", type=rate_argument, default=["none"],
                        help='with --nodes: each node\'s link rate, e.g. "1gbit", or "none"')
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--timeout", type=positive_seconds, default=1200, help="seconds per run")
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args()
    if args.nodes > 1 and os.geteuid() != 0:
        parser.error("--nodes needs root (network namespaces)")
    refuse_a_rate_on_one_node(parser, args.nodes, args.rates)
    for processes in args.nprocs:
        if processes % args.nodes:
            parser.error(f"{processes} processes do not spread evenly over {args.nodes} nodes")
    rows = []
    print(f"{'case':>9} | {'nodes':>5} | {'rate':>6} | {'processes':>9} | {'gloo img/s':>10} | "
          f"{'torus img/s':>11} | torus / gloo")
    for case in args.cases:
        for rate in args.rates if args.nodes > 1 else ["none"]:
            for processes in args.nprocs:
                rates = {"gloo": [], "torus": []}
                choices = []  # per torus round
                for backend in taking_turns(rates, args.rounds):
                    images, decided = run(case, processes, backend, args.timeout,
                                          args.nodes, None if rate == "none" else rate)
                    rates[backend].append(images)
                    if backend == "torus":
                        choices.append(decided or "none decided")
                medians = {backend: statistics.median(values)
                           for backend, values in rates.items()}
                ratio = medians["torus"] / medians["gloo"]
                rounds = "; ".join(f"{backend} rounds: " + " ".join(f"{v:.0f}" for v in values)
                                   for backend, values in rates.items())
                print(f"{case:>9} | {args.nodes:>5} | {rate:>6} | {processes:>9} | "
                      f"{medians['gloo']:10.0f} | {medians['torus']:11.0f} | {ratio:.3f}x   "
                      f"{rounds}; auto ran: " + " | ".join(choices), flush=True)
                rows += [{"case": case, "nodes": args.nodes, "rate": rate,
                          "processes": processes, "backend": backend,
                          "images_per_second": medians[backend], "torus_over_gloo": ratio,
                          "torus_choices": " | ".join(choices) if backend == "torus" else ""}
                         for backend in medians]
    if args.csv:
        write_csv(args.csv, rows, CSV_FIELDS)


if __name__ == "__main__":
    main()
