"""The planner's collective timing (NOTE: [collective time]) and FSDP2 overlap per unit (NOTE:
[fsdp overlap]) against hand-computed values from their sources; no model, no process group."""

from __future__ import annotations

import dataclasses

import pytest

from fxtp.planner import HARDWARE
from fxtp.planner.comm import Group, Unit, collective_wait, fsdp_exposed, ring_latency, ring_time

H100 = HARDWARE["h100"]
US = 1e-6


def test_ring_time_is_nccls_alpha_beta_model():
    # NCCL src/graph/tuning.cc, ring/Simple: baseLat 8.4 us + (steps - inter) x 3.4 us (NVLink)
    # + inter x 14 us (NET); bytes sent = steps / n of the payload, at the bus bandwidth.
    tp8 = Group.tp(8, 8)
    assert (tp8.ranks, tp8.per_node, tp8.nodes) == (8, 8, 1)
    assert ring_latency("all_reduce", tp8, H100) == pytest.approx((8.4 + 14 * 3.4) * US)
    assert ring_time("all_reduce", 2**30, tp8, H100) == pytest.approx((8.4 + 14 * 3.4) * US + 2**30 * 14 / 8 / 450e9)
    assert ring_time("all_gather", 2**30, tp8, H100) == pytest.approx((8.4 + 7 * 3.4) * US + 2**30 * 7 / 8 / 450e9)
    # the dp group of tp 2 on 64 devices: every 2nd rank, 4 per node on 8 nodes, 4 NICs a node
    dp32 = Group.dp(2, 32, 8)
    assert (dp32.ranks, dp32.per_node, dp32.nodes) == (32, 4, 8)
    assert ring_time("reduce_scatter", 1e9, dp32, H100) == pytest.approx((8.4 + 24 * 3.4 + 7 * 14) * US + 1e9 * 31 / 32 / 200e9)
    assert ring_latency("all_reduce", dp32, H100) == pytest.approx((8.4 + (62 - 16) * 3.4 + 16 * 14) * US)
    # tp 8's dp group: one rank a node, one NIC; tp 1's: 8 a node, NVLink-bound is never reached (8 x 50 < 450)
    assert ring_time("all_gather", 1e9, Group.dp(8, 8, 8), H100) == pytest.approx((8.4 + 7 * 14) * US + 1e9 * 7 / 8 / 50e9)
    assert ring_time("all_gather", 1e9, Group.dp(1, 64, 8), H100) == pytest.approx((8.4 + 56 * 3.4 + 7 * 14) * US + 1e9 * 63 / 64 / 400e9)
    assert ring_time("all_reduce", 1e9, Group.tp(1, 8), H100) == 0.0
    # a faster network is priced: the figures are the user's
    fast = dataclasses.replace(H100, inter_node_bw=100e9, network_step_latency=0.0)
    assert ring_time("all_gather", 1e9, Group.dp(8, 8, 8), fast) == pytest.approx((8.4 + 7 * 0) * US + 1e9 * 7 / 8 / 100e9)


def test_a_collective_waits_for_the_compute_since_its_groups_last_one():
    # NOTE: [collective wait]: per_s x max(0, compute - count x after_s), for the group's size only
    cpu = dataclasses.replace(H100, collective_wait=((2, 2e-3, 0.25), (4, 1e-3, 0.5)))
    assert collective_wait(Group.tp(4, 8), 0.050, 10, cpu) == pytest.approx(0.5 * (0.050 - 10 * 1e-3))
    assert collective_wait(Group.dp(2, 2, 8), 0.050, 8, cpu) == pytest.approx(0.25 * (0.050 - 8 * 2e-3))
    assert collective_wait(Group.tp(4, 8), 0.005, 10, cpu) == 0.0  # no more compute than the calibration's
    assert collective_wait(Group.tp(8, 8), 0.050, 10, cpu) == 0.0  # a size not measured
    assert collective_wait(Group.tp(4, 8), 0.050, 0, cpu) == 0.0  # no collective
    assert collective_wait(Group.tp(4, 8), 0.050, 10, H100) == 0.0  # the table: GPUs wait on their devices


def test_tp_collectives_timed_in_the_model_price_its_activation_all_reduce_and_wait_for_no_one():
    # NOTE: [collectives in the model]: each kind's fitted figure scaled by its own factor, so that
    # one collective of the model's activation, of any kind (sequence parallelism's all_gathers and
    # reduce_scatters too), costs what one collective took inside the model
    from fxtp.planner.comm import fitted_time, ring_time, with_tp_collectives

    fitted = [("all_reduce", 4, 1e-3, 1e9), ("all_gather", 4, 2e-3, 2e9), ("reduce_scatter", 4, 4e-3, 4e9),
              ("all_reduce", 2, 7e-3, 1e9)]
    tp = with_tp_collectives(fitted, 4, 5e-3, 10**6)  # 5 ms each; fitted: 1 ms + 1 MB x 6 / 4 / 1 GB/s = 2.5 ms
    assert tp[0] == ("tp:all_reduce", 4, pytest.approx(2e-3), pytest.approx(5e8))
    assert [kind for kind, *_ in tp] == ["tp:all_reduce", "tp:all_gather", "tp:reduce_scatter"]
    for (kind, n, lat, bw), (_, _, fit_lat, fit_bw) in zip(tp, fitted):
        assert n == 4 and fitted_time(kind[3:], 10**6, 4, lat, bw) == pytest.approx(5e-3), kind
        assert lat / fit_lat == pytest.approx(fit_bw / bw) and lat > fit_lat, kind  # the fit's two terms, one factor
    assert ring_time("all_gather", 10**6, Group.tp(4, 8), dataclasses.replace(H100, collectives=tuple(fitted + tp))) \
        == pytest.approx(5e-3)  # sequence parallelism's, through the tp group
    assert with_tp_collectives(fitted, 4, 0.0, 10**6) == []  # the model issued none
    cpu = dataclasses.replace(H100, collectives=tuple(fitted + tp), collective_wait=((4, 1e-3, 0.5),))
    assert ring_time("all_reduce", 10**6, Group.tp(4, 8), cpu) == pytest.approx(5e-3)
    assert ring_time("all_reduce", 10**6, Group(4, 4, "dp"), cpu) == pytest.approx(2.5e-3)  # FSDP2's keep the fit
    assert collective_wait(Group.tp(4, 8), 0.050, 10, cpu) == 0.0  # its waits are in the figure
    assert collective_wait(Group(4, 4, "dp"), 0.050, 10, cpu) == pytest.approx(0.5 * (0.050 - 10 * 1e-3))


@pytest.mark.parametrize("dp", [2, 4])
def test_fsdp_timed_in_the_model_is_what_the_planner_prices_for_that_program(dp):
    # NOTE: [collectives in the model]: the dp entries price FSDP2 on the timed units (3 blocks of 2
    # tensors, the root's 3) at the seconds timed, with its host work, through the planner's own pricing
    from fxtp.planner.comm import with_dp_collectives
    from fxtp.planner.costs import Choice, Workload, estimate
    from fxtp.planner.hardware import HostCosts
    from fxtp.planner.host import host_seconds
    from fxtp.planner.model import TransformerShape
    from fxtp.planner.params import ParamShapes

    embed, norm, head, block = ((1000, 64), 2), ((64,), 2), ((1000, 64), 2), ((64, 64), 2)
    params = ParamShapes(1, (embed, norm, head), (block, block), 3, 2, before=1)
    shape = TransformerShape(hidden=64, layers=3, heads=4, kv_heads=4, intermediate=128, vocab=1000, gated_mlp=False,
                             flash=True, matmul_params=3 * 2 * 64 * 64 + 64 * 1000, block_params=2 * 64 * 64)
    units = [(2 * 64 * 64, 2)] * 3 + [(2 * 1000 * 64 + 64, 3)]  # (elements, tensors)
    fitted = [(kind, n, 1e-3 * n, 1e9) for n in (2, 4) for kind in ("all_reduce", "all_gather", "reduce_scatter")]
    host = HostCosts(fsdp_unit=1e-4, fsdp_tensor=1e-5, asynchronous=False)
    host_s = host_seconds(host, None, layers=3, tokens=0, tp=1, dp=dp, checkpointing=None, micro_batches=1, tensors=0,
                          elements=0, units=tuple(t for _, t in units))["fsdp"]
    dp_entries = with_dp_collectives(fitted, dp, 0.2 - host_s, [e for e, _ in units])
    assert [(kind, n) for kind, n, _, _ in dp_entries] == [("dp:all_reduce", dp), ("dp:all_gather", dp),
                                                           ("dp:reduce_scatter", dp)]
    factor = dp_entries[0][2] / (1e-3 * dp)
    assert factor > 1 and all(lat / bw == pytest.approx(factor ** 2 * 1e-3 * dp / 1e9) for _, _, lat, bw in dp_entries)
    cpu = dataclasses.replace(H100, collectives=tuple(fitted + dp_entries), collective_wait=((dp, 1e-3, 0.5),), host=host,
                              overlap_fsdp=False, compute_bytes=4)
    e = estimate(Choice(1, dp, False, None, 1, 1), shape, params, cpu, Workload(dp, 16, True, "sgd", 4, 4, gather_bytes=4))
    assert e.step["fsdp_host"] == pytest.approx(host_s) and e.step["fsdp_wait"] == 0.0  # its waits are in the figure
    assert e.step["fsdp_comm"] == pytest.approx(0.2)
    assert with_dp_collectives(fitted, dp, 0.0, [e for e, _ in units]) == []  # FSDP2's host work took it all



def test_a_calibration_with_weights_but_no_fsdp_timed_in_the_model_says_so():
    # NOTE: [collectives in the model]: a program that took no longer than its priced compute (and
    # FSDP2's host work) leaves its groups on the fit after synthetic work; the doubts name them
    from fxtp.planner.hardware import CalibrationRun, doubts

    kinds = ("all_reduce", "all_gather", "reduce_scatter")
    fitted = tuple((kind, n, 1e-3, 1e9) for n in (2, 4) for kind in kinds)
    tp = tuple((f"tp:{kind}", n, 2e-3, 1e9) for n in (2, 4) for kind in kinds)
    run = CalibrationRun(40.0, 1.0, 2, 4, 0.5)  # the model's own programs timed (model_s > 0)
    cpu = dataclasses.replace(H100, collectives=fitted + tp + (("dp:all_gather", 4, 2e-3, 1e9),), calibration=run,
                              achieved_flops=((1, 1e10), (2, 1e10), (4, 1e10)))
    assert doubts(cpu) == ("FSDP2 inside the model took no longer than its compute and priced host work over [2] ranks: "
                           "those dp groups are priced from the fit after synthetic work",)
    dp = (("dp:all_gather", 2, 2e-3, 1e9), ("dp:all_gather", 4, 2e-3, 1e9))
    assert doubts(dataclasses.replace(cpu, collectives=fitted + tp + dp)) == ()
    assert doubts(dataclasses.replace(cpu, collectives=fitted + tp[:3] + dp)) == (
        "the model's tp program over [4] ranks took no longer than its priced compute: those tp groups are priced from "
        "the fit after synthetic work",)
    assert doubts(dataclasses.replace(cpu, collectives=fitted + dp)) != ()  # every tp degree on the fit: still said
    meta = dataclasses.replace(cpu, collectives=fitted, calibration=dataclasses.replace(run, model_s=0.0))
    assert doubts(meta) == ()  # no weights: the plan's own line says so
    from fxtp.planner.hardware import tp_fitted_on_cpu

    assert tp_fitted_on_cpu(meta) and not tp_fitted_on_cpu(dataclasses.replace(cpu, collectives=fitted + dp))


def test_fsdp_exposes_what_the_previous_unit_does_not_hide():
    # forward: AG_0, then max(0, AG_i - F_{i-1}); backward: AG_last, then
    # max(0, AG_{j-1} + RS_{j+1} - B_j) while unit j runs its backward, then RS_0.
    embed, block, head = Unit(1.0, 2.0, 0.0, 0.0), Unit(3.0, 6.0, 4.0, 8.0), Unit(1.0, 2.0, 2.0, 4.0)
    units = [embed, block, block, head]
    forward = 1.0 + max(0, 3 - 0) + max(0, 3 - 4) + max(0, 1 - 4)
    # B_head hides AG_block; B_block AG_block + RS_head, then AG_embed + RS_block; the embedding hides nothing
    backward = 1.0 + max(0, 3 + 0 - 4) + max(0, 3 + 2 - 8) + max(0, 1 + 6 - 8) + max(0, 0 + 6 - 0) + 2.0
    assert (forward, backward) == (4.0, 9.0)
    assert fsdp_exposed(units) == pytest.approx(forward + backward)
    # with compute to spare, only the first all_gathers and the last reduce_scatters show
    slow = [embed] + [dataclasses.replace(block, forward=100.0, backward=200.0)] * 3 + [head]
    assert fsdp_exposed(slow) == pytest.approx(1.0 + 3.0 + 1.0 + 6.0 + 2.0)
    assert fsdp_exposed([]) == 0.0


def test_fsdp_units_split_the_compute_and_gather_each_units_shard():
    # torchtitan's units: the embedding (before the blocks), each block, the final norm with the head
    from fxtp.planner.costs import Choice, Workload, _fsdp_units
    from fxtp.planner.model import TransformerShape
    from fxtp.planner.params import ParamShapes

    embed, norm, head, block = ((1000, 64), 2), ((64,), 2), ((1000, 64), 2), ((64, 64), 2)
    params = ParamShapes(1, (embed, norm, head), (block, block), 3, 2, before=1)
    shape = TransformerShape(hidden=64, layers=3, heads=4, kv_heads=4, intermediate=128, vocab=1000, gated_mlp=False,
                             flash=True, matmul_params=3 * 2 * 64 * 64 + 64 * 1000, block_params=2 * 64 * 64)
    work = Workload(8, 16, True, "adamw", 8)
    for ac in (None, "selective", "blocks"):
        choice = Choice(1, 8, False, ac, 1, 1)
        units = _fsdp_units(choice, shape, params, H100, work, compute=1.0)
        assert len(units) == 1 + 3 + 1 and units[0].forward == units[0].backward == 0.0
        assert sum(u.forward + u.backward for u in units) == pytest.approx(1.0)  # the micro-batch's compute, split by FLOPs
        group = Group.dp(1, 8, 8)
        assert units[1].all_gather == pytest.approx(ring_time("all_gather", 2 * 2 * 64 * 64, group, H100))  # bf16
        assert units[1].reduce_scatter == pytest.approx(ring_time("reduce_scatter", 4 * 2 * 64 * 64, group, H100))  # fp32
        assert units[-1].all_gather == pytest.approx(ring_time("all_gather", 2 * (64 + 64 * 1000), group, H100))
    assert units[1].backward == pytest.approx(3 * units[1].forward)  # "blocks": backward and the recomputed forward


def test_calibrating_a_model_without_blocks_raises_fxtp_error_before_any_rank_starts():
    # a rank's error would come back as torch's ProcessRaisedException, one traceback a rank
    import torch

    from fxtp.core.errors import FxtpConfigError
    from fxtp.planner import calibrate

    with pytest.raises(FxtpConfigError, match="found no stack of blocks in Sequential"):
        calibrate(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2, batch=2, seq=4)
