"""The alpha-beta cost of allreduce algorithms, from one node to thousands of GPUs: the math.

This module imports only the standard library (no torch, no compiled extension), so the
model runs and is tested anywhere. A message of b bytes over one link takes
alpha + b / bandwidth. A ring of m members moves (m - 1)/m of the buffer per rank in m - 1
steps for a reduce-scatter or an allgather, and twice that for an allreduce (Thakur et al.
2005; Patarasuk and Yuan 2009). Each step of a ring waits for its slowest hop, so a ring that
leaves the node pays the inter-node alpha and the inter-node bandwidth that one ring gets
there. Algorithms, for p = nodes * gpus_per_node:

  ring           one flat ring of p ranks (NCCL's rings use every NIC of a node together);
  tree           NCCL's double binary tree between the nodes, a chain inside each node:
                 2 log2(nodes) steps on the network, about the ring's bandwidth (tree_time);
  hierarchical   Goyal et al. 2017, section 4: reduce to one GPU per node, a ring allreduce
                 between the nodes' leaders (one NIC each), a broadcast in the node;
  torus          Mikami et al. 2018: X x Y grid, reduce-scatter along the rows, allreduce of
                 the 1/X slices along the columns (the X columns of a node share its NICs),
                 allgather along the rows;
  pipelined      torch_bigbatch's torus: the buffer cut into segments whose phases overlap,
                 the rows' links busy with one segment while the columns carry another
                 (at the segment size the model finds best).

The model leaves out the time to sum (it is folded into the bandwidth term when calibrated)
and contention beyond the NICs' shares.
"""

from __future__ import annotations

import dataclasses
import math

RESNET50_PARAMETERS = 25_557_032  # torchvision's resnet50 (a test counts bb.models.resnet50())
RESNET50_GRADIENT_BYTES = 4 * RESNET50_PARAMETERS  # fp32 gradients: 102.2 MB
# The torus backend's default segments, kept here so that the model runs without torch:
# DEFAULT_SEGMENT_BYTES for CUDA tensors (TorusOptions.segment_bytes; a test checks they agree).
DEFAULT_SEGMENT_BYTES = 16 << 20


def cpu_segment_bytes(group_size):
    """The torus backend's default segment of CPU tensors in a group of `group_size` ranks: 2
    MiB per rank, from 8 to 16 MiB. A larger group cuts a segment into more, smaller messages,
    and on one host the per-message work (the loopback's transmit path, event-loop wake-ups) is
    what the torus spends beyond Gloo. Measured, 8 against 16 MiB segments taking turns in one
    run (forced torus / Gloo at 16 and 64 MiB, 7 rounds, three runs on this 2-core machine):
    with 8 or 16 ranks 16 MiB was ahead or level in every cell, in time and CPU time (4x4:
    0.80-0.88x and 1.00-1.05x against 0.89-0.94x and 1.10-1.13x, CPU 1.10-1.21 against 1.02-1.08
    at 16 MiB; 8x1: 0.99x against 1.10-1.14x); with 4 ranks neither led on one host (2x2), and 8
    MiB led across two emulated nodes of two (1.17 and 1.31x against 1.11 and 1.09x)."""
    return min(max(group_size * (2 << 20), 8 << 20), 16 << 20)


def default_segment_bytes(device, group_size):
    """The torus backend's default segment for tensors of `device` ("cpu" or "cuda")."""
    return cpu_segment_bytes(group_size) if device == "cpu" else DEFAULT_SEGMENT_BYTES


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

    def path_bandwidth(self, nodes):
        """Bandwidth of a path through every rank (a ring, or a tree and its chains): NVLink
        on one node; across nodes, the slower of NVLink and a node's NICs together (NCCL runs
        one ring or tree per NIC)."""
        if nodes == 1:
            return self.intra_bandwidth
        return min(self.intra_bandwidth, self.inter_bandwidth)


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
    nodes = check_ranks(hardware, ranks)
    alpha = hardware.intra_alpha if nodes == 1 else hardware.inter_alpha
    return ring_allreduce(ranks, nbytes, alpha, hardware.path_bandwidth(nodes))


def tree_time(hardware, ranks, nbytes):
    """NCCL's double binary tree (Sanders, Speck and Traff 2009; NCCL 2.4, Jeaugey 2019).

    Two complementary binary trees over the N nodes (each node is an inner node of at most
    one and a leaf of the other) each reduce half of the buffer up to their root and
    broadcast it back down, pipelined in small chunks; inside a node the G GPUs form a chain
    (NCCL runs the tree between nodes and a chain in the node). With B the path bandwidth
    (NVLink on one node, else the slower of NVLink and a node's NICs together):

        T = 2 (G - 1) alpha_intra + 2 floor(log2 N) alpha_inter + 2 n / B

    Latency: a chunk climbs the chain and the floor(log2 N) levels of the tree, then comes
    back down; NCCL's tuner counts the same steps. Bandwidth: as an inner node a rank gets
    n/2 from each of two children and sends n/2 up, then gets n/2 and sends it to both
    children; as a leaf of the other tree it sends n/2 and gets n/2: 2n bytes each way per
    rank (per node on its NICs, per GPU along the chain), where a ring moves 2(p-1)/p n.
    So the tree's bandwidth term is p/(p-1) times the ring's, as in NCCL's tuner (algorithm
    bandwidth busBw / 2 for the tree, busBw p / (2(p-1)) for the ring).

    Assumptions: chunks are small against n, so the pipeline's fill and drain are left out,
    and several are in flight, so each level's latency is paid once, not once per chunk;
    NCCL's empirical derating of the tree (x0.92 and a per-size correction in its tuner) and
    contention beyond the NICs are left out.
    """
    nodes = check_ranks(hardware, ranks)
    if ranks == 1:
        return 0.0
    chain = min(ranks, hardware.gpus_per_node)
    levels = nodes.bit_length() - 1  # floor(log2 N): the depth of a binary tree of N nodes
    latency = 2 * (chain - 1) * hardware.intra_alpha + 2 * levels * hardware.inter_alpha
    return latency + 2 * nbytes / hardware.path_bandwidth(nodes)


def hierarchical_time(hardware, ranks, nbytes):
    """Reduce in the node (reduce-scatter + gather), a ring between the nodes' leaders, a
    broadcast in the node (scatter + allgather)."""
    nodes = check_ranks(hardware, ranks)
    local = min(ranks, hardware.gpus_per_node)
    in_node = 4 * ring_phase(local, nbytes, hardware.intra_alpha, hardware.intra_bandwidth)
    leaders = ring_allreduce(nodes, nbytes, hardware.inter_alpha, hardware.flow_bandwidth(1))
    return in_node + leaders


def torus_links(hardware, ranks, columns=None):
    """(X, Y, the rows' (alpha, bandwidth), the columns' (alpha, bandwidth)) of the X x Y torus,
    X = `columns` (default: the GPUs of a node). On one node any X dividing the ranks; across
    nodes X must divide a node or be whole nodes."""
    check_ranks(hardware, ranks)
    columns = columns or min(ranks, hardware.gpus_per_node)
    node = hardware.gpus_per_node
    one_node = ranks <= node
    if ranks % columns or not (one_node or node % columns == 0 or columns % node == 0):
        raise ValueError(f"a torus row of {columns} must divide {ranks} ranks and, across "
                         f"nodes, divide or be whole nodes of {node}")
    intra = (hardware.intra_alpha, hardware.intra_bandwidth)
    if columns <= node:  # a row inside a node; the node's `columns` columns share its NICs
        row, column_flows = intra, columns
    else:  # a row over several nodes: one flow per node; every column leaves the node
        row, column_flows = (hardware.inter_alpha, hardware.flow_bandwidth(1)), node
    column = intra if one_node else (hardware.inter_alpha, hardware.flow_bandwidth(column_flows))
    return columns, ranks // columns, row, column


def torus_phases(hardware, ranks, nbytes, columns=None):
    """(row reduce-scatter, column allreduce, row allgather) seconds of the X x Y torus."""
    columns, rows, row, column = torus_links(hardware, ranks, columns)
    scatter = ring_phase(columns, nbytes, *row)
    return scatter, ring_allreduce(rows, nbytes / columns, *column), scatter


def one_shot_time(hardware, ranks, nbytes, columns=None):
    """The torus backend's one-shot form (CPU buffers up to 256 KiB): an allgather of every
    member's whole buffer along the row, each member sums them, then an allgather of the row's
    sums along the column: X - 1 + Y - 1 steps (half the four phases' steps), each of the
    whole buffer."""
    columns, rows, row, column = torus_links(hardware, ranks, columns)
    return ring_phase(columns, columns * nbytes, *row) + ring_phase(rows, rows * nbytes, *column)


def torus_time(hardware, ranks, nbytes, columns=None):
    return sum(torus_phases(hardware, ranks, nbytes, columns))


def pipelined_time(hardware, ranks, nbytes, columns=None, segment_bytes=DEFAULT_SEGMENT_BYTES):
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
               if ranks % x == 0 and (ranks <= node or node % x == 0 or x % node == 0)]
    return min(choices, key=lambda x: torus_time(hardware, ranks, nbytes, x))


MODELS = {"ring": ring_time, "tree": tree_time, "hierarchical": hierarchical_time,
          "torus": torus_time, "pipelined": tuned_pipelined_time}
ALGORITHMS = tuple(MODELS)


def allreduce_time(algorithm, hardware, ranks, nbytes=RESNET50_GRADIENT_BYTES):
    if algorithm not in MODELS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    return MODELS[algorithm](hardware, ranks, nbytes)


def scaling_efficiency(compute_seconds, allreduce_seconds):
    """Throughput of p GPUs over p times one GPU's, when the allreduce does not overlap the
    backward pass (the worst case; DDP hides part of it behind the backward)."""
    return compute_seconds / (compute_seconds + allreduce_seconds)


def projection(hardware, gpu_counts, nbytes=RESNET50_GRADIENT_BYTES, compute_ms=None):
    """Rows of allreduce milliseconds and scaling efficiency per algorithm and GPU count,
    the best torus row length, and how the fastest torus compares with NCCL's tree."""
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
        # Above 1, the torus (pipelined at X = a node, or at the best X) beats the tree.
        fastest_torus_ms = min(row["pipelined_ms"], row["best_torus_ms"])
        row["torus_speedup_over_tree"] = row["tree_ms"] / fastest_torus_ms \
            if fastest_torus_ms else 1.0  # one GPU: neither communicates
        rows.append(row)
    return rows
