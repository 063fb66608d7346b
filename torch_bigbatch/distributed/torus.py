"""The "torus" process-group backend: the hierarchical 2D-torus allreduce of Mikami et al. 2018.

``import torch_bigbatch`` registers it; then ``torch.distributed.init_process_group("torus")``
under torchrun gives DDP a 2D-torus allreduce with no other change. The C++ backend
(csrc/torus) composes process groups built here from the store torch hands us: Gloo for CPU
tensors, NCCL for CUDA tensors, each as the whole group, this rank's row (twice: one group per
row phase) and its column.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import socket

import torch
import torch.distributed as dist

from .. import _C

ENV_SHAPE = "TORCH_BIGBATCH_TORUS"


@dataclasses.dataclass
class TorusOptions:
    """Options of a torus process group: ``init_process_group("torus", pg_options=...)``.

    shape: (X, Y) or "XxY": X ranks per row (usually the GPUs of a node), Y rows. None: the
        TORCH_BIGBATCH_TORUS environment variable for groups of the world's size, else X =
        LOCAL_WORLD_SIZE when it divides the group size, else the factorization nearest a square.
    segment_bytes: large buffers are cut into segments of this size, and the three phases of
        consecutive segments overlap.
    flat_threshold_bytes: buffers smaller than this take one allreduce of the whole group.
    """

    shape: tuple[int, int] | str | None = None
    segment_bytes: int = 16 << 20
    flat_threshold_bytes: int = 0

    def __post_init__(self):
        if self.segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be positive, got {self.segment_bytes}")
        if self.flat_threshold_bytes < 0:
            raise ValueError(
                f"flat_threshold_bytes must be non-negative, got {self.flat_threshold_bytes}")


def parse_shape(spec) -> tuple[int, int]:
    """(X, Y) from "XxY" or a pair of positive integers."""
    if isinstance(spec, str):
        parts = spec.lower().replace("×", "x").split("x")
        if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
            raise ValueError(f'a torus shape is "XxY", for example "4x2"; got {spec!r}')
        spec = tuple(int(part) for part in parts)
    columns, rows = spec
    if columns < 1 or rows < 1:
        raise ValueError(f"a torus shape needs positive sides, got {columns}x{rows}")
    return int(columns), int(rows)


def resolve_shape(size: int, shape=None, world_size: int | None = None) -> tuple[int, int]:
    """The (X, Y) of a group of `size` ranks; see TorusOptions.shape for the rules."""
    if shape is None and size == (world_size or size):
        shape = os.environ.get(ENV_SHAPE) or None
    if shape is not None:
        columns, rows = parse_shape(shape)
        if columns * rows != size:
            raise ValueError(
                f"torus shape {columns}x{rows} ({columns * rows} ranks) does not match the "
                f"group size {size}")
        return columns, rows
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if 1 < local <= size and size % local == 0:
        return local, size // local
    columns = max(d for d in range(1, math.isqrt(size) + 1) if size % d == 0)
    return columns, size // columns


def _route_source(host):
    """The local address this host sends from towards `host` (a UDP connect sends nothing)."""
    family, kind, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def _is_loopback(address):
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def _gloo_address(store, rank, size):
    """The address this rank's Gloo device binds: the one routed towards MASTER_ADDR (the
    rendezvous host); on that host, where the route is a loopback one (its own name resolves to
    127.0.1.1 on Debian), the one routed towards a member that published a non-loopback address.
    torch's default, the address of the hostname, would be that loopback address too."""
    address = _route_source(os.environ["MASTER_ADDR"])
    store.set(f"torch_bigbatch/address/{rank}", address)
    if _is_loopback(address):
        for member in range(size):  # blocks until each member has published, as Gloo would
            other = store.get(f"torch_bigbatch/address/{member}").decode()
            if not _is_loopback(other):
                return _route_source(other)
    return address


def _gloo_group(store, rank, size, timeout, threads):
    """A Gloo group on GLOO_SOCKET_IFNAME's interfaces when it is set (as torch's "gloo"),
    else on the address from which this rank reaches the others (see _gloo_address)."""
    options = dist.ProcessGroupGloo._Options()
    interfaces = os.environ.get("GLOO_SOCKET_IFNAME")
    if interfaces:
        where = f"interface {interfaces}"
        options._devices = [dist.ProcessGroupGloo.create_device(interface=name)
                            for name in interfaces.split(",")]
    elif os.environ.get("MASTER_ADDR"):
        where = _gloo_address(store, rank, size)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=where)]
    else:  # no rendezvous host to route to (an init_method URL): the hostname's address
        where = "the address of the hostname"
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
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


def _engines(make_group, store, prefix, rank, columns, rows, timeout):
    """The whole group, the row (once per row phase) and the column of `rank`, each from its
    own PrefixStore. Every rank builds them in the same order, so Gloo's connection
    rendezvous (which blocks until the group's members arrive) cannot deadlock."""
    x, y = rank % columns, rank // columns

    def group(name, group_rank, group_size, threads=1):
        return make_group(dist.PrefixStore(f"{prefix}/{name}/", store), group_rank, group_size,
                          timeout, threads)

    whole = group("whole", rank, columns * rows, threads=2)
    row_scatter = group(f"row{y}/scatter", x, columns) if columns > 1 else None
    column = group(f"column{x}", y, rows) if rows > 1 else None
    row_gather = group(f"row{y}/gather", x, columns) if columns > 1 else None
    return _C.TorusEngines(whole, row_scatter, column, row_gather)


def create_torus_backend(backend_options, pg_options=None):
    """The creator torch.distributed calls for backend "torus" (extended API)."""
    options = pg_options if pg_options is not None else TorusOptions()
    if not isinstance(options, TorusOptions):
        raise TypeError(
            f"pg_options of the torus backend must be a TorusOptions, got {type(options).__name__}")
    store, rank, size = backend_options.store, backend_options.group_rank, backend_options.group_size
    timeout = backend_options.timeout
    world = dist.get_world_size() if dist.is_initialized() else size
    columns, rows = resolve_shape(size, options.shape, world)
    cpu = _engines(_gloo_group, store, "torus/cpu", rank, columns, rows, timeout)
    cuda = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        cuda = _engines(_nccl_group, store, "torus/cuda", rank, columns, rows, timeout)
    return _C.TorusBackend(rank, size, columns, rows, cpu, cuda, options.segment_bytes,
                           options.flat_threshold_bytes, timeout)


def torus_shape(group=None) -> tuple[int, int]:
    """(X, Y) of a process group of backend "torus" (default: the default group)."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = group._get_backend(torch.device("cpu"))
    if not isinstance(backend, _C.TorusBackend):
        raise ValueError(
            f"torus_shape: the group runs backend {dist.get_backend(group)!r}, not 'torus'")
    return backend.shape


def register() -> None:
    dist.Backend.register_backend("torus", create_torus_backend, extended_api=True,
                                  devices=["cpu", "cuda"])
