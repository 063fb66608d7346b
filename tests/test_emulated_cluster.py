"""The torus across emulated nodes (benchmarks/emulated_cluster.py: network namespaces on a
bridge, torchrun with a c10d rendezvous in each): rows are nodes and the training job ends as on
one host; a link that goes down fails every rank within the collective timeout, naming the torus
phase, and a restart resumes to the parameters of an uninterrupted run; Gloo finds the node's
address where its name resolves to a loopback one; the columns' bytes cross the links as the
torus promises. These need root and network namespaces, and skip (saying why) without them."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from multiprocess import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_cluster  # noqa: E402
from conftest import process_environment  # noqa: E402
from emulated_cluster import (EmulatedCluster, format_outputs, read_text,  # noqa: E402
                              unsupported_reason)

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(ROOT, "examples", "train_resnet50.py")
TIMEOUT = 10  # the job's collective timeout, seconds
# 4 ranks x 32 = 128 per step: 8 steps, a checkpoint every 2.
JOB = [SCRIPT, "--dataset", "synthetic", "--synthetic-size", "1024", "--batch-per-rank", "32",
       "--epochs", "1", "--checkpoint-every", "2", "--print-every", "1",
       "--timeout", str(TIMEOUT)]
STEPS = 8
# A short job, for what only has to start and take a step.
SHORT_JOB = [*JOB[:4], "256", *JOB[5:]]


@pytest.fixture(scope="module", autouse=True)
def cluster_support():
    reason = unsupported_reason()
    if reason:
        pytest.skip(reason)


def torus_env(**extra):
    """process_environment with the torus algorithm fixed, for runs compared bit for bit: "auto"
    measures, and two runs may pick algorithms whose sums round differently."""
    return process_environment(TORCH_BIGBATCH_TORUS_ALGORITHM="torus", **extra)


def run_on_cluster(cluster, args, env=None, timeout=240):
    return cluster.run(lambda node: cluster.torchrun(node, args, 2), timeout=timeout,
                       env=env or process_environment())


def assert_succeeded(cluster, results):
    assert all(code == 0 for code, _ in results), format_outputs(
        cluster.nodes, [output[-4000:] for _, output in results])


def run_on_one_host(args, env, timeout=240):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-12000:]


def parameters(output):
    return torch.load(os.path.join(output, "checkpoint.pt"), weights_only=True)["model"]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """The job on 2 emulated nodes x 2 processes over the torus algorithm, uninterrupted: its
    output."""
    output = str(tmp_path_factory.mktemp("cluster") / "straight")
    with EmulatedCluster(2) as cluster:
        results = run_on_cluster(cluster, [*JOB, "--output", output], env=torus_env())
    assert_succeeded(cluster, results)
    assert "backend torus (2x2)" in results[0][1] and "finished after epoch 1" in results[0][1]
    return output


def test_teardown_removes_namespaces_and_processes(tmp_path):
    """An exception inside the cluster ends its processes and removes everything it made."""
    with pytest.raises(ZeroDivisionError):
        with EmulatedCluster(2, rate="100mbit") as cluster:
            sleeper = cluster.start(cluster.nodes[1], ["sleep", "600"], tmp_path / "sleep.log")
            names = [node.namespace for node in cluster.nodes] + [cluster.bridge]
            folder = cluster.folder
            assert set(names) <= set(namespaces())
            assert sorted(os.listdir(folder)) == ["hosts-0", "hosts-1", "owner"]
            1 / 0
    assert sleeper.poll() is not None
    assert not set(names) & set(namespaces())
    assert not os.path.exists(folder)


def test_a_node_resolves_the_names_with_its_own_hostname_and_hosts():
    """Each node's command has its hostname and sees the cluster's names in /etc/hosts (bound
    over it in the command's mount namespace: the host's /etc is never written)."""
    with open("/etc/hosts") as file:
        host_hosts = file.read()
    etc_netns = os.path.exists("/etc/netns")
    with EmulatedCluster(2) as cluster:
        results = cluster.run(lambda node: ["sh", "-c", "hostname; getent hosts node0 node1"],
                              timeout=30)
    for index, (code, output) in enumerate(results):
        lines = output.split()
        assert code == 0 and lines[0] == f"node{index}", output
        assert lines[1:] == ["10.77.0.1", "node0", "10.77.0.2", "node1"], output
    with open("/etc/hosts") as file:
        assert file.read() == host_hosts
    assert os.path.exists("/etc/netns") == etc_netns


def test_a_rate_limit_holds_a_message_of_a_few_hundred_kilobytes():
    """tbf's bucket is the limit's free burst: at 4 ms of traffic (500 KB at 1 Gbit/s) a
    400 KB message crossed at the host's speed and the demo job's gradient bucket never met the
    limit. Now two 64 KiB GSO packets, or 1 ms of traffic at higher rates."""
    for rate, burst in (("1gbit", 128 << 10), ("10gbit", 1_250_000)):
        with EmulatedCluster(2, rate=rate) as cluster:
            for namespace, device in ((cluster.nodes[0].namespace, "eth0"),
                                      (cluster.bridge, cluster.nodes[0].port)):
                shown = subprocess.run(["tc", "-j", "-n", namespace, "qdisc", "show", "dev",
                                        device], capture_output=True, text=True, timeout=10,
                                       check=True).stdout
                (qdisc,) = [q for q in json.loads(shown) if q["kind"] == "tbf"]
                # tc shows the bucket as the kernel keeps it, rounded to its time units
                assert abs(qdisc["options"]["burst"] - burst) < burst / 100, qdisc


def test_a_failed_node_ends_the_run_without_waiting_for_the_timeout(monkeypatch):
    """One node's command failed, the other's ran on (as a rank waits out its collectives'
    timeout): run() waited for the whole timeout and then named the survivor as late. Now it
    ends the others after a grace period and returns every node's code."""
    import emulated_cluster
    monkeypatch.setattr(emulated_cluster, "FAILED_NODE_GRACE", 1)
    start = time.monotonic()
    with EmulatedCluster(2) as cluster:
        results = cluster.run(lambda node: ["sh", "-c", "exit 3"] if node.index == 1
                              else ["sleep", "120"], timeout=100)
    assert time.monotonic() - start < 60
    assert results[1][0] == 3 and results[0][0] != 0, results


def test_a_namespace_of_its_tag_that_it_never_recorded_is_removed():
    """An `ip netns add` that times out may still have made the namespace: unrecorded, it was
    never deleted (a later run's cleanup follows only a dead owner's folder)."""
    with EmulatedCluster(1) as cluster:
        stray = f"{cluster.nodes[0].namespace}9"  # this cluster's tag, as a node's name is
        subprocess.run(["ip", "netns", "add", stray], check=True, timeout=10)
    try:
        assert stray not in namespaces()
    finally:
        if stray in namespaces():
            subprocess.run(["ip", "netns", "del", stray], timeout=10)


def test_namespaces_it_did_not_make_are_left_alone():
    """A namespace whose name looks like one of a killed run's (bbnode<a pid no process has>-0)
    is not this module's unless a cluster folder claims it: neither it nor what runs in it is
    touched (a run once killed its processes and deleted it)."""
    name = "bbnode4000001-0"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
    try:
        foreign = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "60"])
        try:
            time.sleep(0.5)
            with EmulatedCluster(1):
                pass
            assert name in namespaces()
            assert foreign.poll() is None
        finally:
            foreign.kill()
            foreign.wait(timeout=10)
    finally:
        subprocess.run(["ip", "netns", "del", name], timeout=10)


def test_a_killed_driver_ends_its_nodes_processes_and_the_next_run_removes_the_rest(tmp_path):
    """SIGKILL of the driver ends every process of its nodes (torchrun's workers would keep
    training), and the next cluster removes the namespaces and folder it left."""
    ready = tmp_path / "ready"
    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.join(ROOT, "benchmarks")!r})
        from emulated_cluster import EmulatedCluster
        with EmulatedCluster(2) as cluster:
            cluster.start(cluster.nodes[0], ["sh", "-c", "sleep 121 & sleep 122"], "/dev/null")
            print(cluster.folder, flush=True)
            time.sleep(1)
            open({str(ready)!r}, "w").close()
            time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        folder = driver.stdout.readline().strip()
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.1)
        assert ready.exists(), "the cluster was not built within 60 s"
        assert len(sleeps()) == 2
    finally:
        driver.kill()
        driver.wait(timeout=10)
    left = [name for name in namespaces() if name.startswith(f"bbnode{driver.pid}-")]
    assert len(left) == 2 and os.path.exists(folder)
    deadline = time.monotonic() + 10
    while sleeps() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not sleeps()
    with EmulatedCluster(1):
        pass
    assert not set(left) & set(namespaces())
    assert not os.path.exists(folder)


def sleeps():
    listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, timeout=10)
    return [line for line in listing.stdout.splitlines() if line in ("sleep 121", "sleep 122")]


@pytest.mark.parametrize("signals", [["SIGTERM"], ["SIGHUP"], ["SIGTERM", "SIGINT"]],
                         ids=lambda signals: "_then_".join(signals))
def test_a_signal_tears_the_cluster_down(tmp_path, signals):
    """A driver ended by a signal still removes its namespaces: also by SIGHUP (its terminal
    closed; it left them), and by a second signal while it removes them (a node's process that
    ignores SIGTERM makes that take 5 s; the second signal ended the removal half done)."""
    ready = tmp_path / "ready"
    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.path.join(ROOT, "benchmarks")!r})
        from emulated_cluster import EmulatedCluster
        with EmulatedCluster(2) as cluster:
            cluster.start(cluster.nodes[0], ["sh", "-c", "trap '' TERM; sleep 120"], "/dev/null")
            time.sleep(0.5)  # the shell has set its trap
            open({str(ready)!r}, "w").close()
            time.sleep(120)
        """)])
    prefix = f"bbnode{driver.pid}-"
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.1)
        assert ready.exists(), "the cluster was not built within 60 s"
        assert any(name.startswith(prefix) for name in namespaces())
        for name in signals:
            driver.send_signal(getattr(signal, name))
            time.sleep(1)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode != 0
    assert not any(name.startswith((prefix, f"bbbr{driver.pid}")) for name in namespaces())


def namespaces():
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10)
    return [line.split()[0] for line in listing.stdout.splitlines() if line.strip()]


def test_rows_are_nodes_and_columns_cross_the_links():
    """bench_cluster on 2 nodes x 2 with 200 Mbit/s links: the torus is 2x2 with a node per
    row; per 1 MiB allreduce each node sends about 2(Y-1)/Y = 1 buffer over its link with the
    torus and 2(p-1)/p = 1.5 with Gloo's ring, no faster than the link's rate; per 64 KiB the
    forced torus runs its one-shot form, X(Y-1) = 2 buffers (the table said "torus" and
    expected 1)."""
    args = bench_cluster.get_args_parser().parse_args(
        ["--sizes", "64K", "1M", "--iters", "4", "--rounds", "1", "--timeout", "240"])
    result = bench_cluster.measure(2, 2, "200mbit", args)
    assert result["shape"] == [2, 2]
    assert result["hosts"] == ["node0", "node0", "node1", "node1"]
    rows = {(row["algorithm"], row["bytes"]): row for row in result["rows"]}
    for algorithm, nbytes, runs, expected in (("torus", 1 << 20, "torus", 1.0),
                                              ("gloo", 1 << 20, "gloo", 1.5),
                                              ("torus", 64 << 10, "torus 1-shot", 2.0)):
        row = rows[algorithm, nbytes]
        assert row["runs"] == runs
        assert bench_cluster.expected_per_buffer(runs, 2, result["shape"]) == expected
        assert set(row["sent_per_node"]) == {"node0", "node1"}
        for node, sent in row["sent_per_node"].items():
            # Headers, the barrier and the rendezvous's heartbeats add under 1% here.
            assert expected <= sent / row["bytes"] <= expected * 1.03, (algorithm, node, sent)
        if nbytes == 1 << 20:  # (64 KiB fits tbf's bucket of 128 KiB: no rate applies)
            link_ms = max(row["sent_per_node"].values()) * 8 / 200e6 * 1e3
            assert row["ms"] >= 0.9 * link_ms, (algorithm, row["ms"], link_ms)


def test_two_nodes_end_as_one_host(straight_run, tmp_path):
    """The torus across 2 nodes ends bit for bit as on one host with TORCH_BIGBATCH_TORUS=2x2
    (the same phases over the same ranks), and as Gloo's ring up to rounding."""
    host_torus, host_gloo = str(tmp_path / "torus"), str(tmp_path / "gloo")
    run_on_one_host([*JOB, "--output", host_torus], torus_env(TORCH_BIGBATCH_TORUS="2x2"))
    run_on_one_host([*JOB, "--output", host_gloo, "--backend", "gloo"], process_environment())
    cluster, torus, gloo = parameters(straight_run), parameters(host_torus), parameters(host_gloo)
    assert cluster.keys() == torus.keys() == gloo.keys()
    for key in cluster:
        assert torch.equal(cluster[key], torus[key]), key
        torch.testing.assert_close(cluster[key], gloo[key], rtol=1e-4, atol=1e-5, msg=key)


def test_link_fault_fails_within_the_timeout_and_a_restart_resumes(straight_run, tmp_path):
    """Node 1's link goes down after step 3: the workers of both nodes fail within the collective
    timeout, naming the collective, the torus phase or group and the rank, never a bare Gloo
    timeout; with the link back, torchrun --max-restarts resumes from the last checkpoint and
    ends where the uninterrupted run does (torch's c10d
    rendezvous keeps one store across restarts: the torus's keys are per attempt, or the failed
    attempt's would send Gloo to dead ports, pytorch#135712)."""
    output = str(tmp_path / "faulty")
    env = torus_env()
    with EmulatedCluster(2) as cluster:
        logs = [str(tmp_path / f"{node.hostname}.log") for node in cluster.nodes]
        processes = [cluster.start(node, cluster.torchrun(node, [*JOB, "--output", output], 2,
                                                          max_restarts=1), log, env)
                     for node, log in zip(cluster.nodes, logs)]
        wait_for(lambda: f"step 3/{STEPS}" in read_text(logs[0]), 120, logs, cluster)
        cluster.set_link(cluster.nodes[1], up=False)
        down = time.monotonic()
        # Where a rank waits when the link goes: the column's allreduce, DDP's broadcast of
        # the buffers, or a row phase whose peer waits in one of those. torchrun may stop a
        # node's other worker once one has failed, before that one's own timeout.
        named = re.compile(r"torus \w+ failed in the .*?\(rank (\d) at x=\d, y=\d of a 2x2 "
                           r"torus\).*Timed out")

        def every_node_failed():  # node 0 holds ranks 0 and 1, node 1 ranks 2 and 3
            ranks = [set(named.findall(read_text(log))) for log in logs]
            return all(ranks) and ranks[0] <= {"0", "1"} and ranks[1] <= {"2", "3"}
        wait_for(every_node_failed, TIMEOUT + 20, logs, cluster)
        seconds = time.monotonic() - down
        cluster.set_link(cluster.nodes[1], up=True)
        for process in processes:
            process.wait(timeout=240)
        outputs = [read_text(log) for log in logs]
    assert seconds < TIMEOUT + 10, f"failed {seconds:.1f} s after the link went down"
    unnamed = re.compile(r"Error: \[[^\]]*gloo[^\]]*\] Timed out")
    assert not any(unnamed.search(text) for text in outputs), format_outputs(
        cluster.nodes, [text[-4000:] for text in outputs])
    assert [process.returncode for process in processes] == [0, 0], format_outputs(
        cluster.nodes, [text[-4000:] for text in outputs])
    resumed = re.search(r"resumed at epoch 1 step (\d+)", outputs[0])
    assert resumed and 0 < int(resumed[1]) < STEPS, outputs[0][-3000:]
    assert "finished after epoch 1" in outputs[0]
    faulty, straight = parameters(output), parameters(straight_run)
    for key in straight:
        assert torch.equal(faulty[key], straight[key]), key


def wait_for(condition, seconds, logs, cluster):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s:\n" + format_outputs(
            cluster.nodes, [read_text(log)[-3000:] for log in logs])
        time.sleep(0.05)


def test_gloo_finds_the_node_address_where_its_name_is_loopback(tmp_path):
    """Each node's name resolves to 127.0.1.1 on itself (Debian's /etc/hosts), the address
    torch's default Gloo device binds: the torus still trains with nothing set. A wrong
    GLOO_SOCKET_IFNAME (the loopback) is obeyed and the failure says what to set."""
    with EmulatedCluster(2, loopback_hostname=True) as cluster:
        results = run_on_cluster(cluster, [*SHORT_JOB, "--output", str(tmp_path / "a")])
        assert_succeeded(cluster, results)
        assert "finished after epoch 1" in results[0][1]
        results = run_on_cluster(cluster, [*SHORT_JOB, "--output", str(tmp_path / "b")],
                                 env=process_environment(GLOO_SOCKET_IFNAME="lo"))
    assert all(code != 0 for code, _ in results)
    # The node whose workers fail first ends the rendezvous; the other's may not get to print.
    message = ("The torus's Gloo group bound interface lo. If the ranks cannot reach each other "
               "there, set GLOO_SOCKET_IFNAME to the interface of the network the nodes share")
    assert any(message in output for _, output in results), format_outputs(
        cluster.nodes, [output[-3000:] for _, output in results])
