"""The devices and links the planner prices, with each figure's source.

NOTE: [hardware table]
Every bandwidth and FLOP rate is the vendor's datasheet peak; the latencies are NCCL's own
cost model's; the achieved compute rate is ``mfu`` by hardware and GEMM size (NOTE: [GEMM
efficiency]; NOTE: [cost model] in fxtp/planner/costs.py). Each is the user's to override:
``dataclasses.replace(HARDWARE["h100"], mfu=0.35)``.

- Dense BF16 tensor-core peak (without the 2:4 sparsity the datasheets also quote, which
  training does not use): A100 SXM 312 TFLOP/s (NVIDIA A100 Tensor Core GPU datasheet,
  "BF16 Tensor Core 312 TFLOPS | 624 TFLOPS*", * with sparsity); H100 SXM and H200 SXM
  989 TFLOP/s (NVIDIA H100 Tensor Core GPU datasheet, "BF16 Tensor Core 1,979 teraFLOPS*",
  * with sparsity; NVIDIA H200 datasheet, the same figure).
- Memory: A100 80GB HBM2e, H100 SXM 80GB HBM3, H200 141GB HBM3e (the datasheets). fxtp reads
  the "GB" as GiB, the unit PyTorch's allocator reports (an H100 80GB shows 81559 MiB in
  ``nvidia-smi``); ``fxtp.plan`` takes the budget from its caller, this is only a default.
- NVLink, per GPU and direction (the datasheets give both directions together): A100 NVLink 3,
  600 GB/s -> 300 GB/s; H100 and H200 NVLink 4, 900 GB/s -> 450 GB/s.
- Between nodes, one InfiniBand NIC per GPU, as in NVIDIA's DGX systems: DGX A100 has eight
  ConnectX-6 HDR 200 Gb/s (25 GB/s per GPU and direction), DGX H100/H200 eight ConnectX-7
  NDR 400 Gb/s (50 GB/s) (NVIDIA DGX A100 and DGX H100 datasheets). A group spanning nodes
  gets one NIC per member on a node (NOTE: [collective time] in fxtp/planner/comm.py).
- Collective latency (NOTE: [collective time]): NCCL's ring/Simple figures in
  ``src/graph/tuning.cc`` (NVIDIA/nccl): ``baseLat`` 8.4 us a collective, ``hwLat`` 3.4 us a
  step over NVLink and 14.0 us a step over the network. The same for every device in the
  table: NCCL's table does not tell them apart.
- ``mfu``, by hardware: the fraction of the dense peak a step's FLOPs (recomputation counted)
  run at with large GEMMs, from the largest published run on that device whose layout the
  planner cannot express (pipeline parallelism), so it is not one of the published runs the
  planner is compared with (docs/plan_command.md, "Published runs"): A100 0.52, Narayanan et
  al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", table 1, the 1T model: 163 TFLOP/s per GPU, 52% of peak, their FLOPs counting
  the recomputed forward); H100 0.47, Megatron-LM's README ("up to 47% Model FLOP Utilization
  (MFU) on H100 clusters", 2B-462B models, TP, PP and DP communication overlapped); H200 the
  H100's (the same tensor cores; no report of its own). Meta reports 38-43% for Llama-3-405B
  on 8K-16K H100s (Dubey et al. 2024, "The Llama 3 Herd of Models", table 4).

NOTE: [GEMM efficiency]
A GEMM whose output has few tiles runs slower than the peak by wave quantization: cuBLAS
splits the ``m x n`` output into tiles, one thread block each, and runs them in waves of one
tile per SM; the last wave is partly empty (NVIDIA Deep Learning Performance Guide, "Matrix
Multiplication Background", sections "Dimension Quantization Effects" and "Wave
Quantization", its example tile 256 x 128). :func:`gemm_efficiency` is ``mfu`` times the
filled share of the waves, ``tiles / (waves x sms)``, with 256 x 128 tiles and the SM count of
the device (A100 108, H100 SXM and H200 132 SMs: the NVIDIA A100 and H100 architecture
whitepapers); ``sms = 0`` (a device of the user's) turns it off. Small per-rank shards (high
``tp``, one short sequence) lose most; a 8192-token micro-batch against a 14336-wide MLP
loses 3%. Not modelled: tile shapes cuBLAS picks other than 256 x 128, memory-bound GEMMs
(the shapes priced here are compute-bound on the roofline: their arithmetic intensity, in the
hundreds of FLOPs a byte, is above the datasheets' peak over HBM bandwidth).

NOTE: [runtime reserve]
What a training process holds besides the tensors the cost model prices: the CUDA context
(the driver's and the kernels' images, a few hundred MiB a process), NCCL's buffers (per
communicator and peer, ``NCCL_BUFFSIZE``, 4 MiB a channel by default, NCCL's environment
variables documentation; a process holds a tp and a dp communicator), and the caching
allocator's fragmentation (memory "reserved but unallocated", which PyTorch's out-of-memory
message reports; docs "CUDA semantics", memory management). None of them is predictable from
the model, so the planner keeps a share of ``device_memory`` for them: by default 10%, the
share vLLM leaves for the same things (its ``gpu_memory_utilization`` defaults to 0.9, vLLM's
engine arguments). ``fxtp.plan(..., reserve=)`` / ``fxtp plan --reserve`` sets bytes or another
share; "fits" means the predicted peak fits ``device_memory`` less the reserve.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Optional, Union

from fxtp.core.errors import FxtpConfigError

__all__ = ["Hardware", "HostCosts", "HARDWARE", "DEFAULT_RESERVE", "doubts", "gemm_efficiency", "pooled", "resolve_hardware", "reserve_bytes",
           "tp_fitted_on_cpu"]

GiB = 1 << 30
DEFAULT_RESERVE = 0.10  # of device_memory, kept for the runtime (NOTE: [runtime reserve])


@dataclass(frozen=True)
class HostCosts:
    """Seconds the host spends per op, byte, tensor and unit (NOTE: [host time] in fxtp/planner/host.py).

    Attributes:
        op, op_backward: seconds per dispatched forward op, in forward and in its backward.
        op_byte, op_backward_byte: seconds per byte a forward op writes, in forward and backward.
        optimizer_tensor, optimizer_dtensor, optimizer_sharded: seconds per parameter tensor of an
            optimizer step (``zero_grad``, a loop setting each gradient to None, is not timed): a
            plain tensor, FSDP2's DTensor shard, and fxtp's ``ShardedParameter`` (a
            tensor-parallel shard at dp 1, its ops through ``__torch_function__``; 0: priced as a
            plain one).
        optimizer_element: seconds per parameter element of an optimizer step.
        fsdp_unit, fsdp_tensor: seconds of FSDP2's own work per unit and per its parameter
            tensors, for each of its collectives.
        asynchronous: the host runs ahead of the device (CUDA); False: the host computes (CPU).
    """

    op: float = 0.0
    op_backward: float = 0.0
    op_byte: float = 0.0
    op_backward_byte: float = 0.0
    optimizer_tensor: float = 0.0
    optimizer_dtensor: float = 0.0
    optimizer_element: float = 0.0
    optimizer_sharded: float = 0.0
    fsdp_unit: float = 0.0
    fsdp_tensor: float = 0.0
    asynchronous: bool = True


@dataclass(frozen=True)
class CalibrationRun:
    """How a calibration ran, which its doubts weigh (NOTE: [calibration] in fxtp/planner/calibration.py).

    Attributes:
        seconds: its wall time; ``load``: the host's 1-minute load average at its end
            (``os.getloadavg``); ``cores``: the host's; ``ranks``: the CPU ranks that calibrated
            (their own load; 0 for GPU ranks, which wait on their devices).
        model_s: seconds of one training forward and backward of the model's own program at
            each tp degree, summed, as the calibration timed them (0: none timed; NOTE:
            [collectives in the model] in fxtp/planner/calibration.py); :func:`pooled` ranks
            calibrations by it where no price of theirs is given.
    """

    seconds: float
    load: float
    cores: int
    ranks: int
    model_s: float = 0.0


@dataclass(frozen=True)
class Hardware:
    """One kind of device and its links (NOTE: [hardware table]).

    Attributes:
        name: what the plan prints, e.g. ``"H100-80GB SXM"``.
        peak_flops: dense BF16 tensor-core peak, FLOP/s.
        memory_bytes: device memory, bytes (a default; ``fxtp.plan`` takes ``device_memory``).
        intra_node_bw: NVLink bandwidth per GPU and direction, bytes/s.
        inter_node_bw: network bandwidth per GPU and direction (one NIC per GPU), bytes/s.
        devices_per_node: GPUs one NVLink domain holds (8 in a DGX/HGX node).
        mfu: the fraction of ``peak_flops`` a step's FLOPs (recomputation included) run at
            with large GEMMs (NOTE: [hardware table]).
        sms: streaming multiprocessors, for wave quantization (NOTE: [GEMM efficiency]);
            0 turns it off.
        collective_latency: seconds a collective costs whatever its size (NCCL ``baseLat``).
        nvlink_step_latency: seconds a ring step inside a node adds (NCCL ``hwLat`` NVLink).
        network_step_latency: seconds a ring step across nodes adds (NCCL ``hwLat`` NET).
        achieved_flops: measured FLOP/s per device at the model's own GEMMs, ``((tp, rate), ...)``
            (NOTE: [calibration] in fxtp/planner/calibration.py); a degree listed here replaces
            ``peak_flops`` at the efficiency by hardware and GEMM size (NOTE: [cost model] in
            fxtp/planner/costs.py), a degree not listed keeps it. Empty for the datasheet table.
        collectives: measured ``((kind, ranks, latency_s, bus_bytes_per_s), ...)``; a collective
            of a listed kind and group size is timed with them (NOTE: [collective time] in
            fxtp/planner/comm.py); a kind ``"tp:all_gather"`` (``"dp:..."``) only a
            tensor-parallel (data-parallel) group's. Empty for the datasheet table.
        overlap_fsdp: FSDP2's collectives run beside compute (separate CUDA streams, NOTE:
            [fsdp overlap]); False prices them all as exposed (a CPU: one stream).
        compute_bytes: bytes of an activation and of a gathered parameter element in the dtype
            the step computes in: 2 (bf16, NOTE: [mixed precision]); a CPU calibration measures
            and prices fp32, 4.
        host: seconds the host spends per op, tensor and FSDP2 unit (NOTE: [host time] in
            fxtp/planner/host.py); not priced (zeros) unless a calibration on CPU ranks measured them.
        collective_wait: measured ``((ranks, after_s, per_s), ...)``: on CPU ranks that share
            cores, a collective over ``ranks`` ranks also waits ``per_s`` seconds per second of
            compute since its group's last collective beyond the ``after_s`` seconds its
            ``collectives`` figures were measured after (NOTE: [collective wait] in
            fxtp/planner/comm.py). Empty: none (GPUs, the datasheet table).
        doubts: what a calibration found suspect in its own figures, a sentence each (a
            host busy with other jobs: NOTE: [calibration] in fxtp/planner/calibration.py);
            the plan prints them. ``calibration``: how it ran (None: not calibrated).
    """

    name: str
    peak_flops: float
    memory_bytes: int
    intra_node_bw: float
    inter_node_bw: float
    devices_per_node: int = 8
    mfu: float = 0.5
    collective_latency: float = 8.4e-6
    nvlink_step_latency: float = 3.4e-6
    network_step_latency: float = 14.0e-6
    sms: int = 0
    achieved_flops: tuple[tuple[int, float], ...] = ()
    collectives: tuple[tuple[str, int, float, float], ...] = ()
    overlap_fsdp: bool = True
    compute_bytes: int = 2
    host: HostCosts = HostCosts()
    collective_wait: tuple[tuple[int, float, float], ...] = ()
    doubts: tuple[str, ...] = ()
    calibration: Optional[CalibrationRun] = None

    def __post_init__(self) -> None:
        for field in ("peak_flops", "memory_bytes", "intra_node_bw", "inter_node_bw", "devices_per_node"):
            if not getattr(self, field) > 0:
                raise FxtpConfigError(f"Hardware {self.name!r}: {field} must be > 0, got {getattr(self, field)!r}")
        if not 0 < self.mfu <= 1:
            raise FxtpConfigError(f"Hardware {self.name!r}: mfu must be in (0, 1], got {self.mfu!r}")
        if isinstance(self.sms, bool) or not isinstance(self.sms, int) or self.sms < 0:
            raise FxtpConfigError(f"Hardware {self.name!r}: sms must be an int >= 0, got {self.sms!r}")
        for field in ("collective_latency", "nvlink_step_latency", "network_step_latency"):
            if not getattr(self, field) >= 0:
                raise FxtpConfigError(f"Hardware {self.name!r}: {field} must be >= 0 seconds, got {getattr(self, field)!r}")
        if any(not rate > 0 for _, rate in self.achieved_flops) or any(not (lat >= 0 and bw > 0) for *_, lat, bw in self.collectives):
            raise FxtpConfigError(f"Hardware {self.name!r}: achieved_flops must be > 0 and collectives' latency >= 0, "
                                  f"bandwidth > 0, got {self.achieved_flops!r}, {self.collectives!r}")
        if any(not (after >= 0 and per >= 0) for _, after, per in self.collective_wait):
            raise FxtpConfigError(f"Hardware {self.name!r}: collective_wait's seconds must be >= 0, got {self.collective_wait!r}")

    def collective(self, kind: str, ranks: int, role: str = "") -> "tuple[float, float] | None":
        """The measured ``(latency_s, bus_bytes_per_s)`` of ``kind`` over ``ranks`` ranks, or None:
        the entry for the group's ``role`` (``"tp:all_gather"``) if there is one, else ``kind``'s."""
        for name in ((f"{role}:{kind}",) if role else ()) + (kind,):
            found = [(lat, bw) for k, n, lat, bw in self.collectives if k == name and n == ranks]
            if found:
                return found[0]
        return None

    def has_role(self, role: str, ranks: Optional[int] = None) -> bool:
        """Are there entries for ``role``'s groups (``"tp:all_reduce"``...), of ``ranks`` ranks
        (any size where None): figures measured in context (NOTE: [collectives in the model] in
        fxtp/planner/calibration.py; a measured Hardware's)?"""
        return any(kind.startswith(f"{role}:") and ranks in (None, n) for kind, n, _, _ in self.collectives)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


HARDWARE: dict[str, Hardware] = {
    "a100": Hardware("A100-80GB SXM", 312e12, 80 * GiB, 300e9, 25e9, mfu=0.52, sms=108),
    "h100": Hardware("H100-80GB SXM", 989e12, 80 * GiB, 450e9, 50e9, mfu=0.47, sms=132),
    "h200": Hardware("H200-141GB SXM", 989e12, 141 * GiB, 450e9, 50e9, mfu=0.47, sms=132),
}

TILE_M, TILE_N = 256, 128  # cuBLAS's large tile (NOTE: [GEMM efficiency])


def gemm_efficiency(hw: Hardware, m: int, n: int) -> float:
    """The fraction of ``hw.peak_flops`` an ``(m, k) @ (k, n)`` GEMM runs at: ``hw.mfu`` times
    the filled share of its waves of tiles (NOTE: [GEMM efficiency]); ``hw.mfu`` when
    ``hw.sms`` is 0.

    Args:
        m: output rows (tokens of a micro-batch on the rank).
        n: output columns (a weight's columns on the rank).
    """
    if hw.sms <= 0 or m <= 0 or n <= 0:
        return hw.mfu
    tiles = -(-m // TILE_M) * -(-n // TILE_N)
    waves = -(-tiles // hw.sms)
    return hw.mfu * tiles / (waves * hw.sms)


def resolve_hardware(hardware: Union[str, Hardware]) -> Hardware:
    """A :class:`Hardware` from a table name (``"h100"``, any case) or a ``Hardware`` as is.

    Raises:
        FxtpConfigError: an unknown name (the message lists the table's).
    """
    if isinstance(hardware, Hardware):
        return hardware
    if isinstance(hardware, str) and hardware.lower() in HARDWARE:
        return HARDWARE[hardware.lower()]
    raise FxtpConfigError(
        f"hardware {hardware!r} is not in the table ({', '.join(HARDWARE)}); "
        "fix: pass one of those, or a fxtp.planner.Hardware with your figures"
    )


def reserve_bytes(reserve: Union[int, float, None], device_memory: int) -> int:
    """The bytes of ``device_memory`` kept for the runtime (NOTE: [runtime reserve]):
    ``None`` the default share, a float in ``[0, 1)`` that share, an int that many bytes.

    Raises:
        FxtpConfigError: a negative reserve, a share of 1 or more, or one that leaves nothing.
    """
    share = DEFAULT_RESERVE if reserve is None else reserve
    if isinstance(share, bool) or not isinstance(share, (int, float)) or share < 0 or (isinstance(share, float) and share >= 1):
        raise FxtpConfigError(f"reserve must be bytes (an int >= 0) or a share of device_memory in [0, 1), got {reserve!r}")
    held = int(device_memory * share) if isinstance(share, float) else share
    if held >= device_memory:
        raise FxtpConfigError(f"reserve {held / 2**30:.1f} GiB leaves nothing of device_memory {device_memory / 2**30:.1f} GiB. "
                              "fix: a smaller reserve (a share: reserve=0.1 in Python, --reserve 10% on the command line) "
                              "or more device memory")
    return held


_SUSPECT_RATE = 3  # a degree's GEMM rate this many times under the other degrees' median (NOTE: [calibration] in fxtp/planner/calibration.py)


def tp_fitted_on_cpu(hw: Hardware) -> bool:
    """Did a calibration on CPU ranks price the tensor-parallel groups' collectives with its fit
    after synthetic work alone, not timed inside the model (NOTE: [collectives in the model] in
    fxtp/planner/calibration.py: a model without weights, a config.json's on ``meta``)?"""
    run = hw.calibration
    return (run is not None and run.ranks > 0 and run.model_s == 0 and any(n > 1 for _, n, _, _ in hw.collectives)
            and not hw.has_role("tp"))


def doubts(hw: Hardware) -> tuple[str, ...]:
    """What a calibrated ``hw``'s own figures, and how its calibration ran (``hw.calibration``),
    say is suspect (NOTE: [calibration] in fxtp/planner/calibration.py), a sentence each."""
    out = []
    rates = dict(hw.achieved_flops)
    for tp, rate in rates.items():
        others = [r for t, r in rates.items() if t != tp]
        if others and rate * _SUSPECT_RATE < statistics.median(others):
            out.append(f"the tp {tp} GEMMs ran at {rate / 1e9:.2f} GFLOP/s, under a third of the other degrees' "
                       f"{statistics.median(others) / 1e9:.2f}")
    free = [f"{kind} over {n} ranks" for kind, n, latency, _ in hw.collectives if latency == 0]
    if free:
        out.append(f"{', '.join(free)} came out with no latency (the larger payload's time left none)")
    host = hw.host
    if not host.asynchronous and hw.collectives and host.fsdp_unit == host.fsdp_tensor == 0:
        out.append("FSDP2's own host work came out as none (its run no slower than the unsharded one)")
    if not host.asynchronous and hw.achieved_flops and (host.op == 0 or host.op_backward == 0):
        out.append("a dispatched op came out as free")
    # NOTE: [collectives in the model]: a program that took no longer than its priced compute (and its
    # FSDP2 host work) leaves its groups the fit after synthetic work
    in_model = hw.calibration is not None and hw.calibration.model_s > 0
    sizes = {n for _, n, _, _ in hw.collectives}
    unpriced = sorted(n for n in sizes if in_model and not hw.has_role("dp", n))
    if unpriced:
        out.append(f"FSDP2 inside the model took no longer than its compute and priced host work over {unpriced} ranks: "
                   f"those dp groups are priced from the fit after synthetic work")
    unpriced_tp = sorted(tp for tp, _ in hw.achieved_flops if tp > 1 and in_model and not hw.has_role("tp", tp))
    if unpriced_tp:
        out.append(f"the model's tp program over {unpriced_tp} ranks took no longer than its priced compute: those tp "
                   f"groups are priced from the fit after synthetic work")
    run = hw.calibration
    if run is not None and run.load - run.ranks > run.cores:  # other jobs' share of the cores: the load less the ranks'
        out.append(f"the load average was {run.load:.1f} on {run.cores} cores ({run.ranks} of it the ranks' own at most)")
    if run is not None and run.seconds > 60:
        out.append(f"it took {run.seconds:.0f} s (31-37 s at the ranks' own load on 2 cores for hidden-128 and -256 Llamas)")
    return tuple(out)


def pooled(found: list[Hardware], prices: Optional[list[float]] = None) -> Hardware:
    """One :class:`Hardware` from calibrations of the same ranks: of those that ran
    (``calibration`` set; all where none did), the one whose price of the same work
    (``prices``, one per calibration: ``fxtp.planner.measure`` gives the geometric mean of each
    one's prices of every tp x dp layout) is the median, else the one whose timing of the
    model's own programs is (``CalibrationRun.model_s``); then its wall time; of two, the higher
    price (a calibration that measured an op as free prices every row under the others), else
    the lower model_s. Its figures are kept together; the least memory, the longest run and the
    highest load of them all; its doubts are those of these figures (NOTE: [predicted against
    measured] in fxtp/planner/measurement.py, 2).

    Raises:
        ValueError: ``found`` is empty, or ``prices`` is not one per calibration.
    """
    if not found or (prices is not None and len(prices) != len(found)):
        raise ValueError(f"pooled() needs at least one calibration and a price for each: {len(found)}, {prices}")
    if len(found) == 1:
        return found[0]
    ran = [i for i, h in enumerate(found) if h.calibration is not None]
    pool = ran or list(range(len(found)))

    def rank(i: int) -> tuple[float, float]:
        run = found[i].calibration
        return (prices[i] if prices is not None else run.model_s if run else 0.0, run.seconds if run else 0.0)

    chosen = found[sorted(pool, key=rank)[len(pool) // 2 if prices is not None else (len(pool) - 1) // 2]]
    runs = [found[i].calibration for i in ran]
    run = dataclasses.replace(chosen.calibration, seconds=max(r.seconds for r in runs),
                              load=max(r.load for r in runs)) if runs and chosen.calibration else None
    out = dataclasses.replace(chosen, memory_bytes=min(h.memory_bytes for h in found), calibration=run)
    return dataclasses.replace(out, doubts=doubts(out))
