"""The "torus" process-group backend: the hierarchical 2D-torus allreduce of Mikami et al. 2018.

``import torch_bigbatch`` registers it; then ``torch.distributed.init_process_group("torus")``
under torchrun gives DDP a 2D-torus allreduce with no other change. The C++ backend
(csrc/torus) composes process groups built here from the store torch hands us: Gloo for CPU
tensors, NCCL for CUDA tensors (or Gloo's CUDA collectives: TorusOptions.cuda_engine), each as
the whole group, this rank's row (twice: one group per row phase) and its column.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import hashlib
import ipaddress
import json
import math
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist

from .. import _C
from .._checks import is_int
from .cost_model.alpha_beta import default_segment_bytes

ENV_SHAPE = "TORCH_BIGBATCH_TORUS"
ENV_ALGORITHM = "TORCH_BIGBATCH_TORUS_ALGORITHM"
ENV_TABLE = "TORCH_BIGBATCH_TORUS_TABLE"
ENV_CUDA_ENGINE = "TORCH_BIGBATCH_TORUS_CUDA_ENGINE"


# At exit, before the interpreter finalizes, the torus's threads end what they hold of Python's
# (a callback, a Work's tensors); one that takes the GIL later aborts the process. Bounded:
# calls still in flight may never end.
atexit.register(_C.torus_threads_wait_until_idle, 5.0)

ALGORITHMS = ("auto", "torus", "flat")
CUDA_ENGINES = ("nccl", "gloo")


# The other segment sizes that "auto" tries, each where it cuts a buffer into another number of
# segments: on the CPU, 32 MiB (on one host fewer segments cost less local work and fewer
# messages) and 2 MiB (more segments, for links that pipeline better); on GPUs, NCCL's kernels
# overlap better with more, smaller segments. Measured on the CPU, forced torus against Gloo,
# 2, 4, 8 and 16 MiB segments taking turns in one run: on one machine as 4x4 at 16 / 64 MiB
# 0.69 / 0.69x, 0.77 / 0.89x, 0.81 / 1.05x, 0.90 / 1.05x (2x2: 0.83-0.90x with 2 MiB,
# 0.87-0.98x with 8 MiB); across 2 emulated nodes x 2 on unlimited links at 4 / 16 / 64 MiB
# 0.85 / 0.91 / 0.88x, 1.08 / 1.08 / 1.09x, 1.02 / 1.17 / 1.31x, 1.09 / 1.11 / 1.09x, and at
# 1 Gbit/s 1.23-1.47x with every size (the link decides there; the spread is between runs).
ALTERNATIVE_SEGMENT_BYTES = {"cpu": (32 << 20, 2 << 20), "cuda": (4 << 20,)}


@dataclasses.dataclass
class TorusOptions:
    """Options of a torus process group: ``init_process_group("torus", pg_options=...)``.

    shape: (X, Y) or "XxY": X ranks per row (usually the GPUs of a node), Y rows. None: the
        TORCH_BIGBATCH_TORUS environment variable for groups of the world's size, else X =
        LOCAL_WORLD_SIZE when it is above 1 and divides the group size, else the factorization
        nearest a square.
    algorithm: what an allreduce runs. "torus": the 2D torus (in its one-shot form on CPU
        tensors up to 256 KiB); "flat": one allreduce of the whole
        group (Gloo's or NCCL's own); "auto": measured per device type and size class (each
        power of two of bytes): the first calls of a class try the flat allreduce and the torus
        (with other segment sizes where that matters, and on CPU tensors up to 256 KiB also in
        its one-shot form, two whole-buffer exchanges), the ranks agree on the least of their
        times (that of the rank that issues last, which waits for nobody), and the class runs
        the fastest from then on, flat unless a torus beats it by 5% (a log line on rank 0 says
        which; torus_algorithm_table() lists them). None (default): the
        TORCH_BIGBATCH_TORUS_ALGORITHM environment variable, else "auto". The algorithms may
        differ in the last bits of a float sum, and in MIN and MAX over a NaN (the torus keeps
        it, Gloo's own allreduce may not): a run that must repeat bit for bit fixes the
        algorithm or pins a table (README, "The torus backend").
    torus_max_bytes: with "auto", a fixed rule instead of measuring: the torus for buffers of at
        most this many bytes, the flat allreduce above (refused with another algorithm).
    table: with "auto", classes whose choice is pinned rather than measured: the rows of
        torus_algorithm_table() (a list of dicts, or the path of a JSON file of one, as
        save_torus_algorithm_table writes); rows without an algorithm are measured. A row with a
        shape pins groups of that shape only: a table given here for another shape is refused,
        TORCH_BIGBATCH_TORUS_TABLE's rows of another shape are left out (every torus group
        that runs "auto" without torus_max_bytes, subgroups too, reads it). None (default):
        the TORCH_BIGBATCH_TORUS_TABLE environment variable (a path), else none.
    cuda_engine: what moves CUDA tensors: "nccl", or "gloo" (Gloo's CUDA collectives, which
        copy through host memory and block the caller until each phase has run: far slower,
        and no CUDA graph can capture them, but several ranks may share one GPU, which NCCL
        refuses: how the torus's CUDA pipeline runs on a machine with one GPU). None
        (default): the TORCH_BIGBATCH_TORUS_CUDA_ENGINE environment variable, else "nccl".
    segment_bytes: large buffers are cut into segments of this size, and the phases of
        consecutive segments overlap. None (default): cost_model.alpha_beta's
        cpu_segment_bytes(group size) for CPU tensors (2 MiB per rank, from 8 to 16 MiB:
        measured on one host and across emulated nodes), its DEFAULT_SEGMENT_BYTES for CUDA
        tensors (16 MiB, the cost model's; not measured on GPUs); "auto" also tries
        ALTERNATIVE_SEGMENT_BYTES, which a segment_bytes given here turns off.
    """

    shape: tuple[int, int] | str | None = None
    algorithm: str | None = None
    torus_max_bytes: int | None = None
    segment_bytes: int | None = None
    table: list | str | None = None
    cuda_engine: str | None = None
    # The table's rows as parsed (the table itself stays as given, so that the options can be
    # copied), and whether it came from TORCH_BIGBATCH_TORUS_TABLE (it then applies to the
    # groups of the shape it was measured in only).
    _pinned: list = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _table_from_environment: bool = dataclasses.field(default=False, init=False, repr=False,
                                                      compare=False)

    def __post_init__(self):
        algorithm_given = self.algorithm is not None
        if self.algorithm is None:
            self.algorithm = os.environ.get(ENV_ALGORITHM) or "auto"
        algorithm_from = "" if algorithm_given or not os.environ.get(ENV_ALGORITHM) \
            else f" (from {ENV_ALGORITHM})"
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got "
                             f"{self.algorithm!r}{algorithm_from}")
        engine_from = "" if self.cuda_engine is not None else f" (from {ENV_CUDA_ENGINE})"
        if self.cuda_engine is None:
            self.cuda_engine = os.environ.get(ENV_CUDA_ENGINE) or "nccl"
        if self.cuda_engine not in CUDA_ENGINES:
            raise ValueError(f"cuda_engine must be one of {', '.join(CUDA_ENGINES)}, got "
                             f"{self.cuda_engine!r}{engine_from}")
        if self.segment_bytes is not None and not (is_int(self.segment_bytes)
                                                   and 0 < self.segment_bytes < 2**63):
            raise ValueError(f"segment_bytes must be a positive int64, got "
                             f"{self.segment_bytes!r}")
        if self.torus_max_bytes is not None:
            if not (is_int(self.torus_max_bytes) and 0 <= self.torus_max_bytes < 2**63):
                raise ValueError("torus_max_bytes must be an int64 >= 0 or None, got "
                                 f"{self.torus_max_bytes!r}")
            if self.algorithm != "auto":  # it would be ignored
                raise ValueError(f"torus_max_bytes applies to algorithm 'auto', not to "
                                 f"{self.algorithm!r}{algorithm_from}")
        if self.shape is not None:
            parse_shape(self.shape)  # a bad shape is named here, not when a group is built
        # The environment's table pins what "auto" would measure: a group with a fixed
        # algorithm or torus_max_bytes neither reads it nor is refused for it.
        self._table_from_environment = (self.table is None and bool(os.environ.get(ENV_TABLE))
                                        and self.algorithm == "auto"
                                        and self.torus_max_bytes is None)
        table = os.environ.get(ENV_TABLE) if self._table_from_environment else self.table
        self._pinned = None
        if table is not None:
            self._pinned = _pinned_rows(table)
            if self.algorithm != "auto":
                raise ValueError("a pinned table applies to algorithm 'auto', not to "
                                 f"{self.algorithm!r}{algorithm_from}")
            if self.torus_max_bytes is not None:
                raise ValueError("a pinned table and torus_max_bytes both fix what 'auto' "
                                 "would measure: give one of them")


def _pinned_rows(table):
    """(device, size class, algorithm, segment_bytes, one_shot, shape) of each row of `table`
    (rows as torus_algorithm_table() returns them, or a JSON file of them) that names an
    algorithm; shape: the "XxY" the row was measured in, or None where the row does not say."""
    where = "the table"
    if isinstance(table, (str, os.PathLike)):
        where = f"the table {os.fspath(table)}"
        try:
            with open(table) as file:
                table = json.load(file)
        except (OSError, ValueError) as error:
            raise ValueError(f"{where} cannot be read as JSON: {error}") from error
    if not isinstance(table, list):
        raise ValueError(f"{where} must be a list of rows, got {type(table).__name__}")
    pinned = []
    for row in table:
        try:
            device, max_bytes, algorithm = row["device"], row["max_bytes"], row["algorithm"]
            segment_bytes, one_shot = row.get("segment_bytes"), row.get("one_shot", False)
            min_bytes, shape = row.get("min_bytes"), row.get("shape")
        except (TypeError, KeyError, AttributeError) as error:
            raise ValueError(f"{where}: a row needs device, max_bytes and algorithm; got "
                             f"{row!r}") from error
        if algorithm is None:
            continue
        # A size class is (max_bytes / 2, max_bytes] for a power of two, as the table lists it:
        # another bound would pin sizes its row does not name.
        size_class = max_bytes.bit_length() - 1 if is_int(max_bytes) and max_bytes > 0 else -1
        if device not in ("cpu", "cuda") or algorithm not in ("flat", "torus") \
                or not 0 <= size_class <= _C.torus_max_size_class \
                or max_bytes != 1 << size_class \
                or min_bytes not in (None, 0 if size_class == 0 else max_bytes // 2 + 1) \
                or not (segment_bytes is None
                        or is_int(segment_bytes) and 0 < segment_bytes < 2**63) \
                or not isinstance(one_shot, bool) \
                or (algorithm == "torus" and segment_bytes is None and not one_shot) \
                or (one_shot and device != "cpu"):
            raise ValueError(
                f"{where}: device must be cpu or cuda, algorithm flat or torus (with a positive "
                f"int64 segment_bytes, or one_shot true on cpu), max_bytes a power of two up "
                f"to 2**{_C.torus_max_size_class} (a size class: min_bytes, if given, "
                f"max_bytes / 2 + 1), one_shot true or false; got "
                f"{row!r}")
        if one_shot and max_bytes > _C.torus_one_shot_max_bytes:
            # Refused here, not by the backend: that is after the groups are built, and a rank
            # 0 that hosts the store could leave while the others still build theirs.
            raise ValueError(f"{where}: the one-shot torus runs buffers of up to "
                             f"{_C.torus_one_shot_max_bytes} bytes, got it pinned for "
                             f"{device} allreduces of up to {max_bytes} bytes: {row!r}")
        if shape is not None:
            shape = "x".join(map(str, parse_shape(shape)))
        for earlier in pinned:  # rows that would pin one group's class twice
            same_group = None in (earlier[5], shape) or earlier[5] == shape
            if earlier[:2] == (device, size_class) and same_group:
                raise ValueError(f"{where} pins {device} allreduces of up to {max_bytes} bytes "
                                 "twice")
        pinned.append((device, size_class, algorithm, segment_bytes or 0, one_shot, shape))
    return pinned


def _pinned_for(options, columns, rows):
    """The rows of options' table that a group of this shape takes, as the C++ tuner takes
    them. A row measured in another shape: refused for a table given to the group, left out
    (measured anew) for TORCH_BIGBATCH_TORUS_TABLE's, which every torus group reads."""
    shape = f"{columns}x{rows}"
    pinned = []
    for *choice, measured_in in options._pinned or []:
        if measured_in in (None, shape):
            pinned.append(tuple(choice))
        elif not options._table_from_environment:
            raise ValueError(f"the pinned table was measured in a {measured_in} torus; this "
                             f"group is {shape} (a row's choice holds for its shape only: "
                             "measure this group, or drop the rows' shape to pin them anyway)")
    return pinned


def parse_shape(spec) -> tuple[int, int]:
    """(X, Y) from "XxY" or a pair of positive integers."""
    if isinstance(spec, str):
        parts = spec.lower().replace("×", "x").split("x")
        if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
            raise ValueError(f'a torus shape is "XxY", for example "4x2"; got {spec!r}')
        spec = tuple(int(part) for part in parts)
    if not (isinstance(spec, (tuple, list)) and len(spec) == 2 and all(map(is_int, spec))):
        raise ValueError(f'a torus shape is "XxY" or a pair of ints (X, Y); got {spec!r}')
    columns, rows = spec
    if columns < 1 or rows < 1:
        raise ValueError(f"a torus shape needs positive sides, got {columns}x{rows}")
    return int(columns), int(rows)


def resolve_shape(size: int, shape=None, world_size: int | None = None) -> tuple[int, int]:
    """The (X, Y) of a group of `size` ranks; see TorusOptions.shape for the rules."""
    shape_from = ""
    if shape is None and size == (world_size or size):
        shape = os.environ.get(ENV_SHAPE) or None
        shape_from = f" (from {ENV_SHAPE})"
    if shape is not None:
        try:
            columns, rows = parse_shape(shape)
        except ValueError as error:
            raise ValueError(f"{error}{shape_from}") from None
        if columns * rows != size:
            raise ValueError(
                f"torus shape {columns}x{rows} ({columns * rows} ranks){shape_from} does not "
                f"match the group size {size}")
        return columns, rows
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if 1 < local <= size and size % local == 0:
        return local, size // local
    columns = max(d for d in range(1, math.isqrt(size) + 1) if size % d == 0)
    return columns, size // columns


def _tuning(options, device, group_size):
    """What the C++ tuner takes for one device type: (mode, torus_max_bytes, segment_bytes,
    alternative_segment_bytes)."""
    segment = options.segment_bytes or default_segment_bytes(device, group_size)
    alternatives = [] if options.segment_bytes else list(ALTERNATIVE_SEGMENT_BYTES[device])
    if options.algorithm in ("torus", "flat"):
        return options.algorithm, 0, segment, []
    if options.torus_max_bytes is not None:
        return "limit", options.torus_max_bytes, segment, []
    return "measure", 0, segment, alternatives


def _route_source(host):
    """The local address this host sends from towards `host` (a UDP connect sends nothing)."""
    family, kind, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def _is_loopback(address):
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def _rendezvous_host(store):
    """The host of the TCPStore under `store`'s prefixes (an init_method URL's, or torchrun's
    MASTER_ADDR), else MASTER_ADDR, else None. The store's first: Gloo ignores a MASTER_ADDR
    left in the environment where a URL names the rendezvous, and routing towards it failed
    (an unknown name) or chose the wrong network."""
    for _ in range(16):  # prefixes nest a few deep
        if isinstance(store, dist.TCPStore):
            return store.host
        store = getattr(store, "underlying_store", None)
        if store is None:
            break
    return os.environ.get("MASTER_ADDR") or None


def _agree_on_route(store, rank, size):
    """The rendezvous host this rank's Gloo device routes towards (None: GLOO_SOCKET_IFNAME
    names the interfaces, or there is no host), once every rank has a route to its own. A rank
    without one (an unknown name in MASTER_ADDR) that raised alone left the others waiting in
    Gloo's rendezvous for the whole timeout: all fail at once, naming the ranks and hosts."""
    host = None if os.environ.get("GLOO_SOCKET_IFNAME") else _rendezvous_host(store)
    problem = None
    if host:
        try:
            _route_source(host)
        except OSError as error:
            problem = f"no route to {host!r} ({error})"
    verdict = _compare(store, rank, size, "route", problem or "routed")
    if verdict != "agreed":
        raise RuntimeError(f"torus: not every rank can reach the rendezvous host ({verdict}); "
                           "fix MASTER_ADDR, or set GLOO_SOCKET_IFNAME to the interface of the "
                           "network the ranks share (for example eth0) on every rank")
    return host


def _gloo_address(store, host, rank, size):
    """The address this rank's Gloo device binds: the one routed towards `host` (the
    rendezvous host); on that host, where the route is a loopback one (its own name resolves to
    127.0.1.1 on Debian), the one routed towards a member that published a non-loopback address.
    torch's default, the address of the hostname, would be that loopback address too."""
    address = _route_source(host)
    store.set(f"torch_bigbatch/address/{rank}", address)
    if _is_loopback(address):
        for member in range(size):  # blocks until each member has published, as Gloo would
            other = store.get(f"torch_bigbatch/address/{member}").decode()
            if not _is_loopback(other):
                return _route_source(other)
    return address


def _gloo_devices(store, host, rank, size):
    """The Gloo device of this rank's torus groups, and where it binds: GLOO_SOCKET_IFNAME's
    interfaces when it is set (as torch's "gloo"), else the address from which this rank reaches
    the others (see _gloo_address; `host` from _agree_on_route). One device for all of them:
    each device runs an event-loop thread, and with one per group (five) the loops' wake-ups
    cost CPU time (as 4x4 on a 2-core machine, sharing one took the forced torus from
    0.62-0.70x to 0.73-0.80x Gloo at 16-64 MiB and its CPU time from 1.49-1.66x to 1.28-1.39x
    Gloo's). A Gloo device serves any number of contexts (Caffe2 shared one among all of its
    Gloo worlds)."""
    interfaces = os.environ.get("GLOO_SOCKET_IFNAME")
    if interfaces:
        return ([dist.ProcessGroupGloo.create_device(interface=name)
                 for name in interfaces.split(",")], f"interface {interfaces}")
    if host:
        where = _gloo_address(store, host, rank, size)
        return [dist.ProcessGroupGloo.create_device(hostname=where)], where
    # No rendezvous host to route to (a file:// URL): the hostname's address.
    return [dist.ProcessGroupGloo.create_default_device()], "the address of the hostname"


def _gloo_group(binding, store, rank, size, timeout, threads):
    """A Gloo group on `binding`: _gloo_devices' devices and where they bind."""
    options = dist.ProcessGroupGloo._Options()
    options._devices, where = binding
    options._threads = threads
    options._timeout = timeout
    try:
        return dist.ProcessGroupGloo(store, rank, size, options)
    except RuntimeError as error:
        raise RuntimeError(
            f"{error}\nThe torus's Gloo group bound {where}. If the ranks cannot reach each "
            "other there, set GLOO_SOCKET_IFNAME to the interface of the network the nodes share "
            "(for example eth0) on every node.") from error


def _nccl_group(store, rank, size, timeout, threads):
    options = dist.ProcessGroupNCCL.Options()  # NCCL sizes its own threads
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


def _engines(make_group, store, prefix, rank, columns, rows, timeout, ordered_on_host=False):
    """The whole group, the row (once per row phase) and the column of `rank`, each from its own
    PrefixStore. Every rank builds them in the same order, so Gloo's connection rendezvous
    (which blocks until the group's members arrive) cannot deadlock. `ordered_on_host`: the
    groups' Works on CUDA tensors order the caller's stream only once they have run (Gloo's)."""
    x, y = rank % columns, rank // columns

    def group(name, group_rank, group_size, threads=1):
        return make_group(dist.PrefixStore(f"{prefix}/{name}/", store), group_rank, group_size,
                          timeout, threads)

    whole = group("whole", rank, columns * rows, threads=2)
    row_scatter = group(f"row{y}/scatter", x, columns) if columns > 1 else None
    column = group(f"column{x}", y, rows) if rows > 1 else None
    row_gather = group(f"row{y}/gather", x, columns) if columns > 1 else None
    return _C.TorusEngines(whole, row_scatter, column, row_gather, ordered_on_host=ordered_on_host)


def _compare(store, rank, size, key, spec):
    """Every rank's `spec` (a string) against rank 0's: "agreed", or rank 0's and those of the
    ranks that differ from it. Rank 0 returns only once every rank has read the verdict: it
    often hosts the store, and a rank 0 that raised and exited first would leave the others a
    lost connection instead of the message."""
    store.set(f"{key}/{rank}", spec)
    if rank == 0:
        specs = [store.get(f"{key}/{other}").decode() for other in range(size)]
        differing = [f"rank {other} {spec}" for other, spec in enumerate(specs)
                     if spec != specs[0]]
        store.set(f"{key}/verdict", "; ".join([f"rank 0 {specs[0]}"] + differing)
                  if differing else "agreed")
    verdict = store.get(f"{key}/verdict").decode()
    if store.add(f"{key}/read", 1) == size:
        store.set(f"{key}/read by all", "")
    if rank == 0:
        store.wait([f"{key}/read by all"])
    return verdict


def _attempt_store(store, rank, size, timeout):
    """`store` under a prefix that no earlier attempt of the job wrote, the same on every rank.

    torchrun's rendezvous keeps its store across a job's restarts, and a failed attempt's keys
    would send Gloo to dead ports (pytorch/pytorch#135712). TORCHELASTIC_RESTART_COUNT does not
    name an attempt: a restart for a membership change (a node replaced) keeps it, and a new
    node's agent counts from 0 where the others count on. So rank 0 draws the attempt's name
    and hands it to each rank under a key named by that rank's own fresh nonce: what an earlier
    attempt left there is under nonces no live rank asked for. Rank 0 welcomes each nonce it
    reads until the rank acknowledges under the new name (a nonce read first may be stale)."""
    name = os.urandom(16).hex()
    if rank == 0:
        _welcome_ranks(store, name, size, timeout)
    else:
        nonce = os.urandom(16).hex()
        store.set(f"torus/hello/{rank}", nonce)
        name = store.get(f"torus/welcome/{nonce}").decode()
        store.set(f"torus/{name}/joined/{rank}", "")
    return dist.PrefixStore(f"torus/{name}/", store)


def _welcome_ranks(store, name, size, timeout):
    """Rank 0's side of _attempt_store: hands `name` to every nonce ranks 1.. size-1 post until
    each has joined under it."""
    welcomed, waiting = set(), set(range(1, size))
    deadline, pause = time.monotonic() + timeout.total_seconds(), 0.001
    while waiting:
        for other in sorted(waiting):
            if store.check([f"torus/hello/{other}"]):
                nonce = store.get(f"torus/hello/{other}").decode()
                if nonce not in welcomed:
                    store.set(f"torus/welcome/{nonce}", name)
                    welcomed.add(nonce)
            if store.check([f"torus/{name}/joined/{other}"]):
                waiting.discard(other)
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"torus group: ranks {sorted(waiting)} of {size} did not join "
                               f"within the timeout ({timeout.total_seconds():g} s)")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def _agree_on_shape(store, rank, size, resolve):
    """The shape from `resolve()`, checked against every rank's. Ranks that disagree on the
    shape (say, TORCH_BIGBATCH_TORUS or LOCAL_WORLD_SIZE set differently) all fail at once with
    a message that names the shapes, instead of at the first collective's timeout."""
    try:
        shape, problem = resolve(), None
    except ValueError as error:
        shape, problem = None, error
    spec = "x".join(map(str, shape)) if shape else f"none ({problem})"
    verdict = _compare(store, rank, size, "shape", spec)
    if problem is not None:
        raise problem
    if verdict != "agreed":
        raise ValueError(f"the ranks of a torus group disagree on its shape ({verdict}): set "
                         "TORCH_BIGBATCH_TORUS, TorusOptions.shape or LOCAL_WORLD_SIZE alike "
                         "on every rank")
    return shape


def _agree_on_settings(store, rank, size, options, pinned, refused=None):
    """Ranks whose algorithm, segments or pinned table (`pinned`: the rows this group takes;
    `refused`: why this rank could not take its table, or its options from the environment,
    `options` then None) differ would post different messages (one the flat allreduce, another
    the torus's phases; segments of other lengths): they all fail at once, naming what each
    passed."""
    table = "none"
    if refused is not None:
        table = "refused"
    elif pinned:
        table = hashlib.sha1(json.dumps(pinned).encode()).hexdigest()[:12]
    spec = ("options=refused" if options is None else
            f"algorithm={options.algorithm} torus_max_bytes={options.torus_max_bytes} "
            f"segment_bytes={options.segment_bytes} table={table} "
            f"cuda_engine={options.cuda_engine}")
    verdict = _compare(store, rank, size, "settings", spec)
    if refused is not None:
        raise refused
    if verdict != "agreed":
        raise ValueError(f"the ranks of a torus group disagree on its settings ({verdict}): "
                         "pass the same TorusOptions and set TORCH_BIGBATCH_TORUS_ALGORITHM, "
                         "TORCH_BIGBATCH_TORUS_TABLE and TORCH_BIGBATCH_TORUS_CUDA_ENGINE alike "
                         "on every rank")


def create_torus_backend(backend_options, pg_options=None):
    """The creator torch.distributed calls for backend "torus" (extended API)."""
    if pg_options is not None and not isinstance(pg_options, TorusOptions):
        raise TypeError(
            f"pg_options of the torus backend must be a TorusOptions, got "
            f"{type(pg_options).__name__}")
    # The default options read the environment, which may be bad on one rank only: that rank's
    # refusal is raised after the comparisons, so the others learn of it at once. Given ones
    # are checked again (a copy runs __post_init__): fields set after construction, as torch's
    # own Options are set, were used unchecked, and a table set so was never parsed.
    try:
        options, refused = dataclasses.replace(pg_options or TorusOptions()), None
    except ValueError as error:
        options, refused = None, error
    store, rank, size = backend_options.store, backend_options.group_rank, backend_options.group_size
    timeout = backend_options.timeout
    world = dist.get_world_size() if dist.is_initialized() else size
    store = _attempt_store(store, rank, size, timeout)
    columns, rows = _agree_on_shape(store, rank, size, lambda: resolve_shape(
        size, options.shape if options else None, world))
    pinned = []
    if options is not None:
        try:
            pinned = _pinned_for(options, columns, rows)
        except ValueError as error:  # raised after the comparison: the others learn of it too
            refused = error
    _agree_on_settings(store, rank, size, options, pinned, refused)
    host = _agree_on_route(store, rank, size)
    binding = _gloo_devices(dist.PrefixStore("cpu/", store), host, rank, size)
    cpu = _engines(functools.partial(_gloo_group, binding), store, "cpu", rank, columns, rows,
                   timeout)
    cuda = None
    # A build without its CUDA half (TORCH_BIGBATCH_CPU_ONLY=1) has none of the pipelines' CUDA
    # glue (events, capture checks): CUDA tensors are refused with a message, not half-run.
    if _C.WITH_CUDA and torch.cuda.is_available():
        if options.cuda_engine == "gloo":
            cuda = _engines(functools.partial(_gloo_group, binding), store, "cuda", rank,
                            columns, rows, timeout, ordered_on_host=True)
        elif dist.is_nccl_available():
            cuda = _engines(_nccl_group, store, "cuda", rank, columns, rows, timeout)
    # The tuner's own group: it agrees on the times of classes measured on the host from a
    # thread of its own, which must not cross the callers' collectives on the whole group.
    cpu_tuning = _tuning(options, "cpu", size)
    tuner = None
    if size > 1 and cpu_tuning[0] == "measure":
        tuner = _gloo_group(binding, dist.PrefixStore("cpu/tuner/", store), rank, size, timeout,
                            1)
    ranks = getattr(backend_options, "global_ranks_in_group", None) or range(size)
    return _C.TorusBackend(rank, size, columns, rows, cpu, cuda, cpu_tuning,
                           _tuning(options, "cuda", size), pinned, timeout,
                           f"{_describe_ranks(ranks)} as {columns}x{rows}", tuner)


def _describe_ranks(ranks):
    """"ranks 0-7" for a run of consecutive ranks, else "ranks 0, 2, 5" (global ranks)."""
    ranks = list(ranks)
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _torus_backend(group):
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("this rank is not a member of the group (new_group returns "
                         "GroupMember.NON_GROUP_MEMBER on the ranks it leaves out)")
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = group._get_backend(torch.device("cpu"))
    backend = getattr(backend, "wrapped_pg", backend)  # TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper
    if not isinstance(backend, _C.TorusBackend):
        raise ValueError(f"the group runs backend {dist.get_backend(group)!r}, not 'torus'")
    return backend


def torus_shape(group=None) -> tuple[int, int]:
    """(X, Y) of a process group of backend "torus" (default: the default group)."""
    return _torus_backend(group).shape


def torus_algorithm(nbytes, group=None, device="cpu") -> str:
    """What an allreduce of `nbytes` bytes on `device` tensors runs in this torus group now:
    "torus", "flat" (the whole group's own allreduce), or "measuring" (its size class is still
    in its trials under algorithm "auto")."""
    backend = _torus_backend(group)
    if not (is_int(nbytes) and 0 <= nbytes < 2**62):
        raise ValueError(f"nbytes must be an int in [0, 2**62), got {nbytes!r}")
    device = torch.device(device).type
    if device not in ("cpu", "cuda"):
        raise ValueError(f"the torus runs cpu and cuda tensors, got device {device!r}")
    chosen = backend.chosen_algorithm(device, nbytes)  # (raises where no engine runs `device`)
    if dist.get_world_size(group) == 1:
        return "flat"
    return chosen["algorithm"] or "measuring"


def torus_algorithm_table(group=None) -> list[dict]:
    """The algorithm of each size class this torus group has measured or pinned, per device
    type: rows of {device, min_bytes, max_bytes, source ("measured", "pinned" or "measuring"),
    algorithm, segment_bytes, one_shot, candidates: [{algorithm, segment_bytes, one_shot,
    seconds}, ...] (each candidate's median time over its timed calls, the least of the
    ranks'), shape ("XxY": the group's, where the choice holds)}. one_shot: the torus in its
    form of two whole-buffer exchanges (CPU tensors up to 256 KiB; segment_bytes None).
    TorusOptions(table=...) takes these rows back. A group that measures nothing (algorithm
    "torus" or "flat", or torus_max_bytes) has an empty table: torus_algorithm() says what a
    size runs there."""
    backend = _torus_backend(group)
    shape = "x".join(map(str, backend.shape))
    return [{**row, "shape": shape} for row in backend.algorithm_table()]


def save_torus_algorithm_table(path, group=None):
    """Writes torus_algorithm_table() to `path` as JSON, for TorusOptions(table=path) or
    TORCH_BIGBATCH_TORUS_TABLE=path in a later run. Call it on one rank (on a shared folder,
    ranks that all wrote it raced), then dist.barrier() before others read it. The file is
    written whole: a temporary file beside it, renamed over it (a reader never sees half)."""
    rows = torus_algorithm_table(group)
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                         suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(rows, file, indent=1)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def torus_allreduce_counts(group=None) -> dict[str, int]:
    """Allreduces this torus group has run, per device type and algorithm:
    {"cpu torus": 12, "cpu flat": 3, ...} (a group of one rank, ReduceOp.PREMUL_SUM and
    sparse tensors take the flat allreduce outside these counts)."""
    return _torus_backend(group).allreduce_counts()


def register() -> None:
    dist.Backend.register_backend("torus", create_torus_backend, extended_api=True,
                                  devices=["cpu", "cuda"])
