"""Seconds of one ring collective (alpha-beta), and the FSDP2 communication compute does not hide.

NOTE: [collective time]
One collective over ``n`` ranks on ``k`` of them per node (``N = n / k`` nodes) takes
``latency + sent / bus_bw`` seconds, NCCL's own cost model for its ring algorithm
(``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime`` in NVIDIA/nccl ``src/graph/tuning.cc``,
Simple protocol, the one NCCL picks for the MB-sized payloads priced here):

- ``sent``: what a rank sends, ``steps / n`` of the payload (the all_reduce's tensor, the
  all_gather's output, the reduce_scatter's input): ``steps = 2 (n-1)`` for an all_reduce,
  ``n-1`` for an all_gather or reduce_scatter (Patarasuk and Yuan 2009; nccl-tests
  ``doc/PERFORMANCE.md``: "bus bandwidth" is the payload over time times ``2 (n-1)/n``,
  resp. ``(n-1)/n``, so it compares to a link's peak whatever ``n``).
- ``latency``: ``base + (steps - inter) x nvlink_step + inter x network_step``, with
  ``inter = 2 N`` node crossings for an all_reduce and ``N - 1`` for the others when
  ``N > 1`` (0 in a node). NCCL's table: ``baseLat`` ring Simple 8.4 us, ``hwLat`` ring
  Simple NVLink 3.4 us and NET 14.0 us a step (the :class:`~fxtp.planner.hardware.Hardware`
  fields ``collective_latency``, ``nvlink_step_latency``, ``network_step_latency``).
- A calibrated :class:`~fxtp.planner.hardware.Hardware` (``fxtp.planner.calibrate``) carries
  a measured ``latency`` and ``bus_bw`` per kind and group size, fitted to this same formula
  on the local ranks; they replace the table's for those groups (a kind written
  ``"tp:all_gather"`` times only a tensor-parallel group's, ``"dp:..."`` a data-parallel one's).
- ``bus_bw``: NVLink's per-direction bandwidth inside a node. A group spanning nodes is
  limited by the network: its ``k`` ranks on a node run ``k`` rings, each through the NIC of
  its GPU (DGX H100: one ConnectX-7 per GPU; NCCL's ring bandwidth is ``nChannels x
  bwInter`` once a ring spans more than 2 nodes, ``tuning.cc``), so ``min(nvlink, k x nic)``.
  With ``tp`` inside a node, a dp group has ``k = devices_per_node / tp`` ranks per node: each
  GPU's FSDP traffic goes through its own NIC, and a node's ``tp`` dp groups share none.

NOTE: [fsdp overlap]
FSDP2 runs its collectives on their own streams and prefetches: each unit's all_gather is
issued while the unit before it computes (forward: implicit prefetch as the CPU runs ahead;
backward: ``fully_shard``'s default prefetch of the next unit in backward order), and a unit's
reduce_scatter runs while the unit after it, in backward order, computes (Zhao et al. 2023,
"PyTorch FSDP", section 3.3 "communication optimizations"; torch.distributed.fsdp
``fully_shard`` docs, "prefetching"). Per micro-batch, over the units in forward order
(torchtitan wraps the embedding, each block, and the final norm with the head):

- forward: the first unit's all_gather is exposed; unit ``i``'s is hidden behind unit
  ``i-1``'s forward up to ``max(0, AG_i - F_{i-1})``;
- backward (``reshard_after_forward=True``, so every unit is gathered again): the last unit's
  all_gather is exposed; while unit ``j`` runs its backward (recomputation included), unit
  ``j-1``'s all_gather and unit ``j+1``'s reduce_scatter share the links:
  ``max(0, AG_{j-1} + RS_{j+1} - B_j)``; the first unit's reduce_scatter, and unit 1's that
  the embedding's near-zero backward cannot hide, are exposed.
- under pipeline parallelism (``regather=False``, NOTE: [pipeline costs] in
  fxtp/planner/pipeline_costs.py) a unit is gathered once a step and kept: no backward
  all_gather, only the reduce_scatters behind the backward.

NOTE: [point-to-point time]
One NCCL send/recv of ``payload`` bytes between two ranks is one step of its ring:
``collective_latency`` plus one hop's (``nvlink_step_latency`` inside a node,
``network_step_latency`` across nodes), and the bytes over that link (NVLink's per-direction
bandwidth, or the GPU's own NIC), from the same table as NOTE: [collective time].

NOTE: [collective wait]
Ranks that share a host's cores (CPU ranks, more ranks than cores) do not compute at the same
pace: the scheduler runs some longer than others between two collectives, and a collective
waits for its group's peer that ran least. That wait grows with the compute since the group's
last collective. On this project's 2-core host, a 4-rank all_reduce of 256 KB cost 6.0 ms
after 1.8 ms of work, 6.4-6.8 ms after 3.4 ms and 8.2 ms after 7.6 ms (2026-12-06, load
average 0.1), where a tp 4 step's activation all_reduces, half a block's forward apart, took
6.7 ms and the calibration priced 4.6. A calibration on CPU ranks (NOTE: [calibration] in
fxtp/planner/calibration.py) times each group size's collectives after ``after_s`` seconds of
work, and the all_reduce again after 4 times it: the seconds of wait a second of compute
adds, ``per_s`` (``Hardware.collective_wait``). A step's collectives over a group of ``n``
ranks, ``count`` of them a micro-batch, with ``compute`` seconds of it between them, add
``per_s x max(0, compute - count x after_s)``: each waits for the compute since its group's
last collective (on average ``compute / count``) beyond the ``after_s`` already in its
figures (a calibration with the model's weights times the tp groups' collectives inside the
model instead, NOTE: [collectives in the model] in fxtp/planner/calibration.py: those hold
their waits, and add none). ``count`` is what the cost model prices (``TpComm.block_count`` and
``outside_count``, FSDP2's 3 a block and the root's 2 as ``_fsdp_serial`` prices them); a
tp run issues as many (tests/test_plan_run.py counts them). A GPU rank waits on its own device, not on a shared
core: no such term.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxtp.planner.hardware import Hardware

KINDS = ("all_reduce", "all_gather", "reduce_scatter")  # the collectives a calibration fits

__all__ = ["KINDS", "Group", "Unit", "collective_wait", "fitted_time", "fsdp_exposed", "p2p_time", "ring_latency", "ring_time",
           "with_dp_collectives", "with_tp_collectives"]


@dataclass(frozen=True)
class Group:
    """A process group: ``ranks`` ranks, ``per_node`` of them on each node they span; ``role``
    ``"tp"`` or ``"dp"`` (a measured Hardware may time a role's collectives apart, NOTE:
    [predicted against measured] in fxtp/planner/measurement.py)."""

    ranks: int
    per_node: int
    role: str = ""

    @property
    def nodes(self) -> int:
        return -(-self.ranks // self.per_node)

    @classmethod
    def tp(cls, tp: int, devices_per_node: int) -> "Group":
        """The tensor-parallel group: ``tp`` consecutive ranks (the mesh's inner dim)."""
        return cls(tp, min(tp, devices_per_node), "tp")

    @classmethod
    def dp(cls, tp: int, dp: int, devices_per_node: int) -> "Group":
        """The data-parallel group of one tp rank: every ``tp``-th rank (the mesh's outer dim)."""
        return cls(dp, max(1, min(dp, devices_per_node // tp)), "dp")


@dataclass(frozen=True)
class Unit:
    """One FSDP unit on one device, per micro-batch: its collectives' and compute's seconds."""

    all_gather: float
    reduce_scatter: float
    forward: float
    backward: float


def _bus_bandwidth(group: Group, hw: Hardware) -> float:
    if group.nodes == 1:
        return hw.intra_node_bw
    return min(hw.intra_node_bw, group.per_node * hw.inter_node_bw)


def ring_time(kind: str, payload: float, group: Group, hw: Hardware) -> float:
    """Seconds of one NCCL ring collective (NOTE: [collective time]).

    Args:
        kind: ``"all_reduce"``, ``"all_gather"`` or ``"reduce_scatter"``.
        payload: bytes: the all_reduce's tensor, the all_gather's output, the reduce_scatter's input.
        group: the ranks and their placement on nodes.
        hw: the latencies and bandwidths.

    Returns:
        Seconds; 0 for a group of one rank.
    """
    n = group.ranks
    if n <= 1:
        return 0.0
    measured = hw.collective(kind, n, group.role)  # NOTE: [calibration] in fxtp/planner/calibration.py
    if measured is not None:
        return fitted_time(kind, payload, n, *measured)
    nodes = group.nodes
    if kind == "all_reduce":
        steps, inter = 2 * (n - 1), (2 * nodes if nodes > 1 else 0)
    else:
        steps, inter = n - 1, nodes - 1
    inter = min(inter, steps)
    latency = hw.collective_latency + (steps - inter) * hw.nvlink_step_latency + inter * hw.network_step_latency
    return latency + payload * steps / n / _bus_bandwidth(group, hw)


def fitted_time(kind: str, payload: float, n: int, latency_s: float, bus_bytes_per_s: float) -> float:
    """Seconds of ``kind`` over ``n`` ranks at ``payload`` bytes from a measured ``(latency_s,
    bus_bytes_per_s)`` (NOTE: [collective time]: ``latency + payload x steps / n / bus_bw``)."""
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return latency_s + payload * steps / n / bus_bytes_per_s


def with_tp_collectives(collectives: list[tuple[str, int, float, float]], n: int, seconds: float,
                        payload: int) -> list[tuple[str, int, float, float]]:
    """The tp role's entries over ``n`` ranks (``"tp:all_reduce"`` ...): each kind's fitted
    ``(latency_s, bus_bytes_per_s)`` in ``collectives`` scaled so that one collective of
    ``payload`` bytes (the model's activation) costs ``seconds``, what one of the model's tp
    collectives took in it (NOTE: [collectives in the model]); none where ``seconds`` is 0.
    Sequence parallelism's all_gathers and reduce_scatters of that payload cost what its
    all_reduces do: on ranks sharing cores a collective's time is mostly the wait for its
    peers, once per collective, and an all_gather's factor taken from the all_reduce's fit made
    it noisier than the step (NOTE: [collectives in the model], 2026-12-07)."""
    fitted = {kind: (lat, bw) for kind, ranks, lat, bw in collectives if ranks == n}
    if not seconds or "all_reduce" not in fitted:
        return []
    factors = {kind: seconds / fitted_time(kind, payload, n, *fitted[kind]) for kind in KINDS if kind in fitted}
    return [(f"tp:{kind}", n, fitted[kind][0] * factors[kind], fitted[kind][1] / factors[kind]) for kind in factors]


def with_dp_collectives(collectives: list[tuple[str, int, float, float]], n: int, seconds: float,
                        units: list[int]) -> list[tuple[str, int, float, float]]:
    """The dp role's entries over ``n`` ranks (``"dp:all_gather"`` ...): each kind's fitted
    ``(latency_s, bus_bytes_per_s)`` in ``collectives`` scaled by one factor, so that FSDP2's
    collectives on units of ``units`` elements (fp32; the blocks', then the root's) cost
    ``seconds`` (FSDP2's share of what the model's program took beyond its compute, less its
    host work; NOTE: [collectives in the model]
    in fxtp/planner/calibration.py): each block's all_gather in forward and again in backward
    and its reduce_scatter, the root's one all_gather and one reduce_scatter, as
    ``fxtp.planner.costs`` prices them; none where ``seconds`` is not positive."""
    fitted = {kind: (lat, bw) for kind, ranks, lat, bw in collectives if ranks == n}
    if seconds <= 0 or not units or any(kind not in fitted for kind in KINDS):
        return []
    *blocks, root = units

    def wire(kind: str, elements: int) -> float:
        return fitted_time(kind, 4 * elements, n, *fitted[kind])

    priced = sum(2 * wire("all_gather", e) + wire("reduce_scatter", e) for e in blocks) + wire("all_gather", root) \
        + wire("reduce_scatter", root)
    factor = seconds / priced
    return [(f"dp:{kind}", n, fitted[kind][0] * factor, fitted[kind][1] / factor) for kind in KINDS]


def ring_latency(kind: str, group: Group, hw: Hardware) -> float:
    """The latency term alone of :func:`ring_time` (a zero-byte collective)."""
    return ring_time(kind, 0.0, group, hw)


def collective_wait(group: Group, compute: float, count: int, hw: Hardware) -> float:
    """Seconds ``count`` collectives over ``group`` wait for its peers, beyond their
    :func:`ring_time`, with ``compute`` seconds of a rank's compute between them (NOTE:
    [collective wait]); 0 where ``hw`` measured no wait for the group's size (GPUs, the table),
    and for a group whose role has its own entries: measured in context, waits and all (a
    calibration's tp groups timed inside the model, NOTE: [collectives in the model] in
    fxtp/planner/calibration.py; a measured Hardware's, which keeps no waits anyway)."""
    if group.role and hw.has_role(group.role, group.ranks):
        return 0.0
    for ranks, after_s, per_s in hw.collective_wait:
        if ranks == group.ranks and count > 0:
            return per_s * max(0.0, compute - count * after_s)
    return 0.0


def p2p_time(payload: float, across_nodes: bool, hw: Hardware) -> float:
    """Seconds of one point-to-point send of ``payload`` bytes (NOTE: [point-to-point time])."""
    if across_nodes:
        return hw.collective_latency + hw.network_step_latency + payload / hw.inter_node_bw
    return hw.collective_latency + hw.nvlink_step_latency + payload / hw.intra_node_bw


def fsdp_exposed(units: list[Unit], regather: bool = True) -> float:
    """Seconds of FSDP2 communication compute does not hide in one micro-batch (NOTE: [fsdp overlap]).

    Args:
        units: the FSDP units in forward order.
        regather: the units are gathered again for backward (``reshard_after_forward=True``);
            False: gathered once and kept (under pipeline parallelism).
    """
    if not units:
        return 0.0
    exposed = units[0].all_gather
    for before, unit in zip(units, units[1:]):
        exposed += max(0.0, unit.all_gather - before.forward)
    exposed += units[-1].all_gather if regather else 0.0
    for j in range(len(units) - 1, -1, -1):
        gather = units[j - 1].all_gather if j > 0 and regather else 0.0
        scatter = units[j + 1].reduce_scatter if j + 1 < len(units) else 0.0
        exposed += max(0.0, gather + scatter - units[j].backward)
    return exposed + units[0].reduce_scatter
