"""Real processes for distributed tests: one per rank, spawned, joined with a deadline.

run_ranks(fn, world_size, *args) runs fn(rank, world_size, port, *args) in world_size fresh
processes and returns their return values by rank. A rank that raises, dies or outlives the
deadline fails the test with what it printed, so a hang fails fast instead of stalling CI.
"""

import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(fn, rank, world_size, port, args, results):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        results.put((rank, "ok", fn(rank, world_size, port, *args)))
    except BaseException:  # noqa: BLE001  (report every failure to the parent)
        results.put((rank, "error", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # the result is in the pipe before the process ends
        os._exit(0)  # no teardown: a broken process group must not hang the exit


def run_ranks(fn, world_size, *args, deadline=120.0, allow_missing=()):
    """Return [fn's result of rank 0, ...]. Ranks in allow_missing may end without a result:
    theirs is ("exited", exit code), -6 for an abort."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_entry, args=(fn, rank, world_size, port, args, results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    outcomes = {}
    give_up = time.monotonic() + deadline
    try:
        while len(outcomes) < world_size:
            try:
                rank, status, value = results.get(timeout=0.5)
                outcomes[rank] = (status, value)
                continue
            except queue.Empty:
                pass
            pending = [rank for rank in range(world_size) if rank not in outcomes]
            if not any(processes[rank].is_alive() for rank in pending) and results.empty():
                ended = sorted(set(pending) - set(allow_missing))
                assert not ended, f"ranks {ended} ended without a result"
                break
            if time.monotonic() > give_up:
                raise AssertionError(f"ranks {pending} gave no result within {deadline} s")
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
    errors = {rank: value for rank, (status, value) in outcomes.items() if status == "error"}
    assert not errors, "\n".join(f"rank {rank}:\n{text}" for rank, text in errors.items())
    return [outcomes[rank][1] if rank in outcomes else ("exited", processes[rank].exitcode)
            for rank in range(world_size)]
