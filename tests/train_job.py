"""How the tests run examples/train_resnet50.py: imported (its parser, checks and parts, in this
process), under torchrun, or as one rank of a job in a plain process."""

import importlib
import os
import subprocess
import sys

from conftest import ROOT, process_environment
from multiprocess import free_port

SCRIPT = os.path.join(ROOT, "examples", "train_resnet50.py")
# A small job: 256 synthetic training images, 32 per rank (8 steps an epoch on one rank).
TINY = ["--dataset", "synthetic", "--synthetic-size", "256", "--batch-per-rank", "32",
        "--base-lr", "1.0", "--print-every", "1000"]


def import_script():
    """The script as the module train_resnet50, found by name as loader workers find it when
    they unpickle its functions."""
    if os.path.dirname(SCRIPT) not in sys.path:
        sys.path.append(os.path.dirname(SCRIPT))
    return importlib.import_module("train_resnet50")


def torchrun(args, processes=2, timeout=180):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), SCRIPT, *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env=process_environment())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-12000:]
    return result.stdout


def run_single(args, rank=0, world_size=1, restart_count=0, **variables):
    """The script in one process (no torchrun), as rank `rank` of `world_size`, with the
    environment `variables`."""
    env = process_environment(RANK=str(rank), WORLD_SIZE=str(world_size),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                              TORCHELASTIC_RESTART_COUNT=str(restart_count), **variables)
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=60, env=env)
