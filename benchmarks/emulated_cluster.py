"""An emulated cluster on one Linux machine: nodes as network namespaces joined by a bridge.

Each node is a network namespace (bbnode<tag>-<i>) with one interface, eth0, at 10.77.0.<i+1>.
The eth0s are veth links whose other ends are ports of a bridge that lives in a namespace of its
own (bbbr<tag>), so the host's own namespace and interfaces are never touched, and traffic stays
inside. An optional rate (tc's tbf, both directions of each link) stands for the node's NIC. A
node's command runs in namespaces of its own besides: UTS (its hostname, node<i>), mount (its
/etc/hosts, a file of the cluster's bound over it: the names resolve on every node, as a
cluster's DNS would; `loopback_hostname=True` adds Debian's "127.0.1.1 <hostname>" line first,
the classic way a host's own name resolves to a loopback address) and PID (every process the
command starts ends with it, and with the driver: no process outlives a killed run; its
namespaces and folder stay until the next run removes them, below).

Ownership: a cluster claims its tag (<driver pid>-<8 random hex digits>) by making the folder
/run/torch_bigbatch/<tag>, which holds its owner (pid and start time) and its hosts files. A
run removes the namespaces of folders whose owner has died (a killed run's), and never touches
a namespace of another name, nor one that is the host's.

Needs root, iproute2 (ip, tc) and util-linux (unshare, mount). Everything is removed on exit,
on an exception, and on SIGINT, SIGTERM or SIGHUP (signals that arrive while it is being removed
wait until it is gone).

    # 2 nodes x 2 processes of the training job, over links of 1 Gbit/s:
    sudo python benchmarks/emulated_cluster.py --nodes 2 --nproc-per-node 2 --rate 1gbit \\
        examples/train_resnet50.py --dataset synthetic --epochs 1
"""

import argparse
import contextlib
import ctypes
import dataclasses
import json
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

SUBNET = "10.77.0"  # a private range that exists only inside the namespaces
RUN_DIR = "/run/torch_bigbatch"  # a folder per cluster: its owner and its hosts files
RDZV_PORT = 29400
COMMAND_TIMEOUT = 10  # seconds for one ip/tc call
FAILED_NODE_GRACE = 30  # seconds the other nodes get to end once one has failed
OWNERLESS_SECONDS = 60  # a cluster folder without an owner this old was left by a killed run
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # each tears the cluster down
RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
# tc rounds a rate below 8 bit/s to 0 bytes/s (and refuses it); its 32-bit queue limit (50 ms
# of traffic and the burst, in bytes) overflows above about 680 Gbit/s.
RATE_RANGE = (8, 500e9)
# What a node's torchrun must not inherit from the driver's environment: torchrun reads an
# option it is not given from PET_<OPTION>; the others are a launcher's or name the host's
# interfaces, which the nodes do not have.
INHERITED_NOT = re.compile(r"PET_.*|TORCHELASTIC_.*|MASTER_(ADDR|PORT)|(LOCAL_|GROUP_|ROLE_)?"
                           r"(RANK|WORLD_SIZE)|ROLE_NAME|.*_SOCKET_IFNAME")


def parse_rate(text):
    """Bits per second of a tc rate such as "1gbit" or "100mbit"."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?)(bit|kbit|mbit|gbit)", text.strip().lower())
    if not match:
        raise ValueError(f'a rate is a positive number and a unit of {list(RATE_UNITS)}, such as '
                         f'"1gbit"; got {text!r}')
    bits = float(match[1]) * RATE_UNITS[match[2]]
    if not RATE_RANGE[0] <= bits <= RATE_RANGE[1]:
        raise ValueError(f"a rate is 8bit to 500gbit (what tc's tbf takes); got {text!r}")
    return bits


def node_environment(**variables):
    """The driver's environment less what would misdirect a node's torchrun (INHERITED_NOT),
    one thread per process unless OMP_NUM_THREADS is set, and `variables`."""
    inherited = {name: value for name, value in os.environ.items()
                 if not INHERITED_NOT.fullmatch(name)}
    return {"OMP_NUM_THREADS": "1", **inherited, **variables}


def rate_argument(text):
    """An argparse type: a tc rate, as tc takes it ("1gbit"), or "none" (no limit); a bad one
    is refused before anything runs."""
    text = text.strip().lower()
    if text != "none":
        try:
            parse_rate(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return text


def sh(*argv):
    """Runs an ip/tc command; its stderr goes into the error when it fails. In a session of its
    own, as are the teardown's: a terminal's Ctrl-C does not end it half done."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                            start_new_session=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")
    return result.stdout


def start_time(pid):
    """When process `pid` started (clock ticks after boot), None where there is none: with the
    pid it names one process, where a pid alone may have been reused."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return int(file.read().rsplit(")", 1)[1].split()[19])  # field 22
    except (OSError, IndexError, ValueError):
        return None


def this_owner():
    return {"pid": os.getpid(), "start": start_time(os.getpid()),
            "pid_namespace": os.stat("/proc/self/ns/pid").st_ino}


def owner_died(folder):
    """Whether the run that made cluster folder `folder` has ended. A folder without an owner
    counts as alive while it may be being made (a claim writes its owner within milliseconds),
    dead after OWNERLESS_SECONDS (a run killed between the two: it stayed for ever); one
    whose owner is unreadable (not this module's) or in another PID namespace (whose pids say
    nothing here) counts as alive: left alone."""
    try:
        with open(os.path.join(folder, "owner")) as file:
            owner = json.load(file)
    except FileNotFoundError:
        try:
            return time.time() - os.stat(folder).st_mtime > OWNERLESS_SECONDS
        except OSError:
            return False
    except (OSError, ValueError):
        return False
    try:
        if owner["pid_namespace"] != os.stat("/proc/self/ns/pid").st_ino:
            return False
        return start_time(int(owner["pid"])) != owner["start"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def namespaces_of(tag):
    names = [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]
    return [name for name in names if re.fullmatch(rf"bbbr{tag}|bbnode{tag}-\d+", name)]


def remove_stale_clusters():
    """Removes what killed runs of this module left: the namespaces of each cluster folder whose
    owner has died (those named with the tag the folder claims), then the folder."""
    with contextlib.suppress(FileNotFoundError):
        for tag in os.listdir(RUN_DIR):
            folder = os.path.join(RUN_DIR, tag)
            if not re.fullmatch(r"\d+-[0-9a-f]{8}", tag) or not owner_died(folder):
                continue
            if all([remove_namespace(name) for name in namespaces_of(tag)]):
                shutil.rmtree(folder, ignore_errors=True)


def is_this_namespace(name):
    """Whether namespace `name` is the one this process runs in (the host's, for the driver):
    a name attached to it must not have its processes killed."""
    try:
        named = os.stat(f"/run/netns/{name}")
    except OSError:
        return False
    own = os.stat("/proc/self/ns/net")
    return (named.st_dev, named.st_ino) == (own.st_dev, own.st_ino)


def kill_processes_in(name, rounds=20):
    """SIGKILLs whatever runs in namespace `name` (torchrun's workers have sessions of their
    own: ending torchrun does not end them), again until none is left (one may have forked
    meanwhile) or `rounds` have passed; whether none is left."""
    for _ in range(rounds):
        try:
            pids = sh("ip", "netns", "pids", name).split()
        except (RuntimeError, subprocess.TimeoutExpired):
            return False
        if not pids:
            return True
        for pid in pids:
            with_signal(int(pid), signal.SIGKILL)
        time.sleep(0.05)
    return False


def remove_namespace(name):
    """Kills what runs in namespace `name`, then deletes it; whether it is gone. One whose
    processes do not all end is kept (deleted, it would hide them from every later run), as is
    the host's own under this name; both are reported on stderr."""
    if is_this_namespace(name):
        print(f"emulated_cluster: {name} names this process's own network namespace: left alone",
              file=sys.stderr)
        return False
    if not kill_processes_in(name):
        print(f"emulated_cluster: processes still run in namespace {name}: kept for the next "
              "run to remove", file=sys.stderr)
        return False
    try:
        sh("ip", "netns", "del", name)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        print(f"emulated_cluster: {error}", file=sys.stderr)
        return False
    return True


# Found once here: looked up in the forked child (preexec_fn) of a threaded driver, dlopen
# could wait forever on a lock another thread held at the fork. (Linux's; None elsewhere.)
PRCTL = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)


def die_with_parent():
    """For a node's command (preexec_fn): SIGKILL when the driver's thread that started it ends,
    also by SIGKILL; the PID namespace then ends the rest of the node's processes. A failure
    fails the start (Popen raises) rather than leave a node that could outlive the driver."""
    PR_SET_PDEATHSIG = 1
    if PRCTL is None or PRCTL(PR_SET_PDEATHSIG, int(signal.SIGKILL)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def children_of(pid):
    """The pids of `pid`'s children (a node's unshare has one: the node's command)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as file:
            return [int(child) for child in file.read().split()]
    except (OSError, ValueError):
        return []


def with_signal(pid, signum):
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


@dataclasses.dataclass(frozen=True)
class Node:
    index: int
    namespace: str
    hostname: str
    address: str
    port: str  # the bridge's end of the node's link


class EmulatedCluster:
    """A context manager: `with EmulatedCluster(2, rate="1gbit") as cluster: cluster.run(...)`."""

    def __init__(self, nodes, rate=None, loopback_hostname=False):
        if not 1 <= nodes <= 200:
            raise ValueError(f"nodes must be 1 to 200 (one /24 of addresses), got {nodes}")
        self.rate_bits = parse_rate(rate) if rate else None
        self.rate = rate.strip().lower() if rate else None  # as tc takes it
        self.loopback_hostname = loopback_hostname
        self.nodes_count = nodes
        self.folder = None  # /run/torch_bigbatch/<tag>, claimed in __enter__
        self.bridge = None
        self.nodes = []
        self.processes = []
        self._created = []  # the namespaces made, in order
        self._previous_handlers = {}
        self._deferring = False  # a signal now waits until the cluster is built or removed
        self._deferred_signal = None

    def __enter__(self):
        try:
            if threading.current_thread() is threading.main_thread():
                for signum in SIGNALS:
                    previous = signal.getsignal(signum)
                    if previous is signal.SIG_IGN:  # nohup: the run outlives its terminal
                        continue
                    self._previous_handlers[signum] = previous
                    signal.signal(signum, self._on_signal)
            remove_stale_clusters()
            self._claim_tag()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info):
        self.close()

    def _on_signal(self, signum, frame):
        if self._deferring:  # raised once the step under way is done (see _deferring_signals)
            self._deferred_signal = self._deferred_signal or signum
            return
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")  # unwinds to close()

    @contextlib.contextmanager
    def _deferring_signals(self):
        """A step a signal must not cut in two (a namespace made and not yet recorded)."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        signum, self._deferred_signal = self._deferred_signal, None
        if signum is not None:
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    def _claim_tag(self):
        """Makes this cluster's folder under a fresh tag (the driver's pid, for a reader, and a
        random part: a process may build several clusters), its owner written into it; the
        namespaces take their names from the tag."""
        os.makedirs(RUN_DIR, mode=0o700, exist_ok=True)
        for _ in range(10):
            tag = f"{os.getpid()}-{secrets.token_hex(4)}"
            try:
                with self._deferring_signals():  # made and recorded (close() removes it)
                    os.mkdir(os.path.join(RUN_DIR, tag))
                    self.folder = os.path.join(RUN_DIR, tag)
            except FileExistsError:
                continue
            break
        else:
            raise RuntimeError(f"no free cluster folder in {RUN_DIR} after 10 tries")
        with open(os.path.join(self.folder, "owner.new"), "w") as file:
            json.dump(this_owner(), file)
        os.rename(os.path.join(self.folder, "owner.new"), os.path.join(self.folder, "owner"))
        self.bridge = f"bbbr{tag}"
        # torchrun ranks the nodes by their names' order: node10 came before node2.
        digits = len(str(self.nodes_count - 1))
        self.nodes = [Node(i, f"bbnode{tag}-{i}", f"node{i:0{digits}d}", f"{SUBNET}.{i + 1}",
                           f"p{i}") for i in range(self.nodes_count)]

    def _add_namespace(self, name):
        # Recorded only once made (a name that exists already is not this cluster's), and
        # made and recorded before a signal unwinds to close().
        with self._deferring_signals():
            sh("ip", "netns", "add", name)
            self._created.append(name)

    def _build(self):
        self._add_namespace(self.bridge)
        sh("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.bridge, "link", "set", "br0", "up")
        for node in self.nodes:
            self._add_namespace(node.namespace)
            self._write_hosts(node)
            # Created in the bridge's namespace, its peer born in the node's: never on the host.
            sh("ip", "-n", self.bridge, "link", "add", node.port, "type", "veth", "peer", "name",
               "eth0", "netns", node.namespace)
            sh("ip", "-n", self.bridge, "link", "set", node.port, "master", "br0", "up")
            sh("ip", "-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", "eth0")
            sh("ip", "-n", node.namespace, "link", "set", "eth0", "up")
            sh("ip", "-n", node.namespace, "link", "set", "lo", "up")
            if self.rate_bits:  # the node's sending side, and its receiving side (the port's)
                self._limit(node.namespace, "eth0")
                self._limit(self.bridge, node.port)

    def _limit(self, namespace, device):
        # A bucket of two of the veth's 64 KiB GSO packets (smaller, tbf would cut them into
        # MTU-sized ones, whose headers would then count at low rates and not at high ones), or
        # 1 ms of traffic at high rates. Not more: a message within the bucket crosses at the
        # host's speed, and at 4 ms of traffic (500 KB at 1 Gbit/s, the bucket until
        # 2026-11-28) a 400 KB message took 0.4-1.4 ms instead of 3.2, and the demo job's
        # 311 KB gradient bucket never met the limit (tbf's overlimits stayed 0).
        burst = max(int(self.rate_bits / 8 * 0.001), 128 << 10)
        sh("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
           "rate", self.rate, "burst", str(burst), "latency", "50ms")

    def _write_hosts(self, node):
        lines = ["127.0.0.1 localhost"]
        if self.loopback_hostname:
            lines.append(f"127.0.1.1 {node.hostname}")
        lines += [f"{other.address} {other.hostname}" for other in self.nodes]
        with open(self._hosts_file(node), "w") as file:
            file.write("\n".join(lines) + "\n")

    def _hosts_file(self, node):
        return os.path.join(self.folder, f"hosts-{node.index}")

    def close(self):
        """Ends every process in the nodes (SIGTERM, then SIGKILL after 5 s), deletes the
        namespaces and hosts files. Safe to call twice, and from any thread (the signal handlers
        are put back from the main thread only). A signal of SIGNALS that arrives meanwhile (a
        second Ctrl-C) is raised once everything is removed."""
        self._deferring = True
        try:
            self._remove_everything()
        finally:
            self._deferring = False
            if threading.current_thread() is threading.main_thread():
                for signum, handler in self._previous_handlers.items():
                    signal.signal(signum, handler)
                self._previous_handlers.clear()
            signum, self._deferred_signal = self._deferred_signal, None
        if signum is not None:
            raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    def _remove_everything(self):
        for process in self.processes:
            if process.poll() is None:  # the command (torchrun then ends its workers)
                for pid in children_of(process.pid) or [process.pid]:
                    with_signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # killed with the rest of its namespace below
        # SIGKILLs whatever still runs in them; one that cannot be removed keeps the folder,
        # whose owner's end then tells a later run to remove it. Then those of this cluster's
        # tag that were never recorded: an `ip netns add` that timed out may have made one.
        removed = all([remove_namespace(name) for name in reversed(self._created)])
        try:
            unrecorded = [name for name in namespaces_of(os.path.basename(self.folder))
                          if name not in self._created] if self.folder else []
            removed = all([remove_namespace(name) for name in unrecorded]) and removed
        except (RuntimeError, subprocess.TimeoutExpired):  # `ip netns list` failed: kept
            removed = False
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        self.processes.clear()
        self._created.clear()
        if removed and self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def command(self, node, argv):
        """argv as run in `node`: its network namespace, its hostname, its /etc/hosts, and a PID
        namespace whose first process it is (unshare's child): when unshare ends (with the
        driver: die_with_parent) that process is killed, and with it every process of the
        namespace, which no signal from inside can end (torchrun's workers, in sessions of
        their own, included)."""
        return ["ip", "netns", "exec", node.namespace, "unshare", "--uts", "--mount", "--pid",
                "--kill-child", "sh", "-c",
                'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"',
                node.hostname, self._hosts_file(node), *argv]

    def start(self, node, argv, log_path, env=None):
        """Starts argv in `node` with stdout and stderr to log_path; close() ends it, and so
        does the end of the thread that called start() (the driver's main thread, usually)."""
        with open(log_path, "w") as log:
            process = subprocess.Popen(self.command(node, argv), stdout=log,
                                       stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                       preexec_fn=die_with_parent)
        self.processes.append(process)
        return process

    def run(self, argv_of_node, timeout, env=None):
        """Runs argv_of_node(node) in every node at once; returns [(returncode, output)] by
        node. Once a node has failed (exited non-zero) the others get FAILED_NODE_GRACE seconds
        to end (their own collectives' timeouts may be long), then are ended (a negative code).
        Past `timeout` seconds with no node failed, the processes are ended and TimeoutError
        names the nodes still running, with every node's output."""
        with tempfile.TemporaryDirectory() as folder:
            logs = [os.path.join(folder, f"{node.hostname}.log") for node in self.nodes]
            processes = [self.start(node, argv_of_node(node), log, env)
                         for node, log in zip(self.nodes, logs)]
            deadline = time.monotonic() + timeout
            failed = False
            try:
                while time.monotonic() < deadline and None in [p.poll() for p in processes]:
                    if not failed and any(p.returncode not in (None, 0) for p in processes):
                        failed = True
                        deadline = min(deadline, time.monotonic() + FAILED_NODE_GRACE)
                    time.sleep(0.1)
            except BaseException:  # a signal: the logs go with the folder, their ends first
                print(format_outputs(self.nodes, [read_text(log)[-2000:] for log in logs]),
                      file=sys.stderr)
                raise
            failed = failed or any(p.poll() not in (None, 0) for p in processes)
            late = [node.hostname for node, process in zip(self.nodes, processes)
                    if process.poll() is None]
            for node, process in zip(self.nodes, processes):  # nothing outlives run()
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=5)
                if late:  # what the command started (torchrun's workers) too
                    kill_processes_in(node.namespace)
            outputs = [read_text(log) for log in logs]
        if late and not failed:
            raise TimeoutError(f"{late} still running after {timeout} s\n"
                               + format_outputs(self.nodes, outputs))
        return [(process.returncode, output) for process, output in zip(processes, outputs)]

    def set_link(self, node, up):
        """Takes the node's link down or up at the bridge (as a switch port or a cable would):
        the node keeps its address and routes, and its packets go nowhere."""
        sh("ip", "-n", self.bridge, "link", "set", node.port, "up" if up else "down")

    def link_bytes(self, node):
        """(sent, received) bytes of the node's eth0 so far."""
        [link] = json.loads(sh("ip", "-n", node.namespace, "-s", "-j", "link", "show", "eth0"))
        return link["stats64"]["tx"]["bytes"], link["stats64"]["rx"]["bytes"]

    def torchrun(self, node, script_args, nproc_per_node, run_id="bbcluster", port=RDZV_PORT,
                 max_restarts=0):
        """The torchrun line of `node`: a c10d rendezvous hosted at node 0's name."""
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(self.nodes)),
                "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{self.nodes[0].hostname}:{port}", "--rdzv-id", run_id,
                "--max-restarts", str(max_restarts), *script_args]


def read_text(path):
    with open(path, errors="replace") as file:
        return file.read()


def refuse_a_rate_on_one_node(parser, nodes, rates):
    """One node's ranks talk over its loopback, where no rate applies: a measurement "at
    1gbit" would run unlimited."""
    if nodes == 1 and any(rate != "none" for rate in rates):
        parser.error("a rate limits the links between nodes: it needs --nodes 2 or more")


def exit_code(codes):
    """The run's exit code from its nodes': the first node that failed by itself (its code)
    before one the run ended (a signal's number; a killed bystander's 9 hid the cause)."""
    failed_codes = [code for code in codes if code > 0]
    signalled = [-code for code in codes if code < 0]
    return (failed_codes or signalled or [0])[0]


def check_every_node_succeeded(cluster, results, what):
    """RuntimeError with each node's end (one node's long traceback could hide another's)
    unless every node exited 0: a result printed before a failure is no result."""
    if any(code != 0 for code, _ in results):
        raise RuntimeError(f"{what} failed (exit codes {[code for code, _ in results]}):\n"
                           + format_outputs(cluster.nodes, [text[-4000:] for _, text in results]))


def format_outputs(nodes, outputs):
    return "\n".join(f"--- {node.hostname} ({node.address}) ---\n{output}"
                     for node, output in zip(nodes, outputs))


def unsupported_reason():
    """Why this machine cannot emulate a cluster (None when it can): no root, no tools, or a
    kernel that makes no network namespace. What fails after that is a fault of this module,
    not of the machine: its callers fail rather than skip."""
    if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "emulating a cluster needs root (network namespaces)"
    for tool in ("ip", "tc", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"emulating a cluster needs the {tool!r} command (iproute2, util-linux)"
    probe = f"bbprobe{os.getpid()}-{secrets.token_hex(4)}"
    try:
        sh("ip", "netns", "add", probe)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        return f"this machine cannot make network namespaces: {error}"
    finally:  # (a failed add may have made it)
        if probe in sh("ip", "netns", "list").split():
            sh("ip", "netns", "del", probe)
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--rate", type=rate_argument, default="none",
                        help='each node\'s link rate, e.g. "1gbit" (default: none)')
    parser.add_argument("--loopback-hostname", action="store_true",
                        help="each node's name resolves to 127.0.1.1 on itself (Debian's hosts)")
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    parser.add_argument("script", help="the training script and its arguments")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("emulating a cluster needs root (network namespaces)")
    if not 1 <= args.nodes <= 200 or args.nproc_per_node < 1 or args.max_restarts < 0 \
            or not 0 < args.timeout < math.inf:
        parser.error("--nodes is 1 to 200, --nproc-per-node 1 or more, --max-restarts 0 or "
                     "more, --timeout a finite number of seconds above 0")
    refuse_a_rate_on_one_node(parser, args.nodes, [args.rate])
    print(f"{args.script} on {args.nodes} emulated nodes x {args.nproc_per_node} processes; "
          "each node's output follows when the job ends", flush=True)
    with EmulatedCluster(args.nodes, rate=None if args.rate == "none" else args.rate,
                         loopback_hostname=args.loopback_hostname) as cluster:
        results = cluster.run(lambda node: cluster.torchrun(
            node, [args.script, *args.script_args], args.nproc_per_node,
            max_restarts=args.max_restarts), timeout=args.timeout, env=node_environment())
    print(format_outputs(cluster.nodes, [output for _, output in results]))
    sys.exit(exit_code([code for code, _ in results]))


if __name__ == "__main__":
    main()
