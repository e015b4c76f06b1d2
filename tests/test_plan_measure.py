"""``fxtp.planner.calibrate`` and ``fxtp.planner.measure`` (issue 34, items 1 and 2) on 4 real
gloo ranks: a tiny Llama (hidden 128, 2 blocks, 4 heads) at 8 x 64 tokens a step, its three
meshes (tp 4, dp 4, dp 2 x tp 2) planned with a calibration of the same ranks and run with
``fxtp.compile`` on the tp group and FSDP2 per block on dp (NOTE: [calibration] in
fxtp/planner/calibration.py, NOTE: [predicted against measured] in fxtp/planner/measurement.py).

The calibrations and the runs happen once for the module (the ranks' session pool); the tests
read them. Peak memory within 10% is asserted on every run; step time within 15% and the
measured order of the meshes equal to the predicted one only where ``FXTP_TIMING_BOUNDS=1`` (a
host whose cores are the ranks' own): on the shared 2-core CI host the same step varies by more
than that from run to run (see docs/plan_command.md, "Calibration and measurement").
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings

import pytest
from _cores import cores_alone
from _helpers import without_collective_log

from fxtp.cli.main import main

pytest.importorskip("transformers")

BATCH, SEQ = 8, 64
TIMING_BOUNDS = os.environ.get("FXTP_TIMING_BOUNDS") == "1"


def _model():
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                                      use_cache=False)
    return transformers.LlamaForCausalLM(config)


_BLOCK = 4 * 128 * 128 + 3 * 128 * 344 + 2 * 128  # a block's parameters: attention, MLP, norms


def _calibrate_and_measure() -> dict:
    """On each rank: the measurement (one calibration, a timed step per layout; the defaults, 3
    calibrations and 9 steps, where the timing bounds are asserted; their pooling is tested
    without ranks, tests/test_plan_pool.py) and the measured Hardware's prediction of each row
    (the re-plan's figures, as the plan prices them)."""
    from fxtp.planner.measurement import measure_on_ranks

    # timed as a user's loop runs: the pool's CollectiveLog, a dispatch mode, would run Python at
    # every op of the calibration and the steps (and dispatch each functional collective again)
    timed_as_a_user = without_collective_log() if TIMING_BOUNDS else contextlib.nullcontext()
    with warnings.catch_warnings(record=True) as seen, timed_as_a_user:
        warnings.simplefilter("always")
        m = measure_on_ranks(_model(), batch=BATCH, seq=SEQ, **({} if TIMING_BOUNDS else {"steps": 1, "calibrations": 1}))
    return {"measurement": m, "warned": [str(w.message) for w in seen]}


def _priced_again(m) -> list:
    """Each row measured, priced with the measured Hardware as ``fxtp.plan`` prices it (the
    re-plan's own estimate where it has the row, else the cost model's)."""
    from fxtp.planner.costs import Workload, estimate
    from fxtp.planner.model import TransformerShape
    from fxtp.planner.params import parameter_shapes, repeated_blocks
    from fxtp.planner.search import _inputs

    priced = {e.choice: e for e in [m.replan.chosen] + [a.estimate for a in m.replan.alternatives]}
    if all(e.choice in priced for e, _ in m.rows):
        return [priced[e.choice] for e, _ in m.rows]
    model, hw = _model(), m.measured_hardware  # a row the re-plan did not price as such (another micro-batch)
    shape = TransformerShape.of(model, repeated_blocks(model).fqn)
    params = parameter_shapes(model, tuple(sorted({e.choice.tp for e, _ in m.rows})), *_inputs(model, None, None))
    work = Workload(BATCH, SEQ, True, "adamw", 4, activation_bytes=hw.compute_bytes, gather_bytes=hw.compute_bytes)
    return [estimate(e.choice, shape, params[e.choice.tp], hw, work) for e, _ in m.rows]


@pytest.fixture(scope="module")
def measured(rank_pools):
    with cores_alone() as waited:  # no test of the other xdist worker beside the timed ranks
        start = time.perf_counter()
        result = rank_pools(4).run(_calibrate_and_measure)[0]
    result["again"] = _priced_again(result["measurement"])
    print(f"\ncalibrate and measure on 4 gloo ranks: {time.perf_counter() - start:.1f} s (after {waited:.1f} s for the "
          f"cores)\n{result['measurement']}")
    return result


def test_calibration_measures_every_degree_and_group(measured):
    """A rate for each tp degree of 4 ranks, a latency and bandwidth for each collective kind
    over groups of 2 and 4 (fitted, and in tp and dp groups inside the model), the host's memory
    shared by the ranks; each calibration within a minute."""
    m = measured["measurement"]
    hw = m.hardware
    assert [tp for tp, _ in hw.achieved_flops] == [1, 2, 4], hw
    assert all(1e8 < rate < 1e13 for _, rate in hw.achieved_flops), hw  # FLOP/s of one CPU thread
    # each kind fitted, and the tp and dp groups' timed inside the model (NOTE: [collectives in the model])
    assert sorted((kind, n) for kind, n, _, _ in hw.collectives) == sorted(
        (role + kind, n) for role in ("", "tp:", "dp:") for kind in ("all_reduce", "all_gather", "reduce_scatter")
        for n in (2, 4)), hw
    assert all(0 <= lat < 1.0 and bw > 1e6 for _, _, lat, bw in hw.collectives), hw
    for n in (2, 4):  # one activation all_reduce of a dp 4 / n rank's micro-batch: a few ms here
        lat, bw = hw.collective("all_reduce", n, "tp")
        assert 1e-5 < lat + BATCH * n // 4 * SEQ * 128 * 4 * 2 * (n - 1) / n / bw < 0.1, hw
        lat, bw = hw.collective("all_gather", n, "dp")  # FSDP2's gather of a block (fp32), with its host work
        assert hw.collective("all_gather", n) != (lat, bw) and 1e-5 < lat + 4 * _BLOCK * (n - 1) / n / bw < 0.2, hw
    # NOTE: [collective wait]: after half a block of work, and the wait a second of work more adds
    assert [n for n, _, _ in hw.collective_wait] == [2, 4] and all(0 < after < 0.1 and 0 <= per < 10
                                                                   for _, after, per in hw.collective_wait), hw
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    assert 0 < hw.memory_bytes <= total // 4
    assert (hw.compute_bytes, hw.overlap_fsdp) == (4, False)  # fp32, one stream on a CPU
    host = hw.host  # NOTE: [host time]: a dispatched op costs microseconds, an optimizer tensor more
    assert not host.asynchronous and 1e-7 < host.op < 1e-2 and 1e-7 < host.op_backward < 1e-2, host
    assert 0 < host.optimizer_tensor < host.optimizer_dtensor < 1.0 and host.optimizer_element < 1e-6, host
    assert host.optimizer_tensor < host.optimizer_sharded < 1.0, host  # fxtp's ShardedParameter: through __torch_function__
    assert m.calibrate_s / m.calibrations < 60, m.calibrate_s  # a calibration a round


def test_measure_runs_each_mesh_and_prices_it_again(measured):
    """The three meshes ran (each term measured, the peak by glibc's heap, within 10% of the
    prediction), the plan printed is the one whose rows ran, priced by one of the calibrations,
    each of whose prices is printed; re-planned with the measured figures, the cost model
    reproduces each mesh's measured compute, tp and exposed FSDP seconds. A term measured under
    the host seconds priced in it (a loaded host) keeps the prediction, and the output says so,
    as it says each swapped pair."""
    from fxtp.planner.measurement import _rows

    m = measured["measurement"]
    assert [(e.choice.tp, e.choice.dp) for e, _ in m.rows] == [(1, 4), (2, 2), (4, 1)]
    assert [e for e, _ in m.rows] == _rows(m.plan)  # the printed plan's rows, as it priced them
    calibrations = 3 if TIMING_BOUNDS else 1  # each one's prices printed where more than one ran
    assert m.calibrations == calibrations and [len(p) for p in m.prices] == ([calibrations] * 3 if calibrations > 1 else [])
    assert ("calibrations priced a step at: " in str(m)) == (calibrations > 1) and m.to_dict()["prices"] == [list(p) for p in m.prices]
    for (e, got), again in zip(m.rows, measured["again"]):
        assert got["total"] > 0 and got["compute"] > 0 and got["peak"] > 0, got
        # peak memory within 10% (issue 34, item 2): glibc's heap, steady from run to run, unlike the
        # times; not under sequence parallelism, which a calibration's noise picks at times and whose
        # peak at this size is under-predicted (tp 4: 5.4 MiB predicted, 5.8 ran, 2026-12-07, docs/plan_command.md)
        assert e.choice.sequence_parallel or got["peak"] / e.peak == pytest.approx(1, abs=0.10), (e.choice, got, e.peak)
        assert (got["tp_comm"] > 0) == (e.choice.tp > 1) and (got["fsdp_exposed"] > 0) == (e.choice.dp > 1), got
        host = {"compute": e.step["compute"] - e.step["gemm"], "tp_comm": 0.0, "fsdp_exposed": e.step["fsdp_host"]}
        for term in ("compute", "tp_comm", "fsdp_exposed"):
            if got[term] > host[term] or not host[term]:
                assert again.step[term] == pytest.approx(got[term], rel=1e-6, abs=1e-9), (e.choice, term)
            else:
                assert again.step[term] == pytest.approx(e.step[term]), (e.choice, term)
                assert f"measured {term.replace('_', ' ')} " in str(m), str(m)
    # the re-plan is at least as fast, priced with the measured figures, as every row that ran
    assert m.replan.fits and m.replan.chosen.step["total"] <= min(a.step["total"] for a in measured["again"]) * (1 + 1e-9)
    text = str(m)
    assert "measured / predicted" in text and ("the choice changes" in text or "the choice does not change" in text)
    assert all(line in text for line in m.swapped()) and ("(the order differs)" in text) == bool(m.swapped()), text
    waits = [e.step["tp_wait"] + e.step["fsdp_wait"] for e, _ in m.rows]  # NOTE: [collective wait], said as priced
    assert [row["predicted"]["waits"] for row in m.to_dict()["rows"]] == waits
    assert ("waiting for peers on shared cores" in text) == any(waits), text
    assert "(pp pinned by --measure, which runs tp x FSDP2 layouts, no pipeline)" in str(m.plan)
    # nothing on any rank about what the layouts never do (clip under FSDP2), nor FSDP2's warning of
    # a view returned by its module (fxtp's gathered logits are contiguous, as the model's)
    assert not [w for w in measured["warned"] if "fully_shard" in w or "view tensor" in w], measured["warned"]


@pytest.mark.skipif(not TIMING_BOUNDS, reason="timing bounds need cores the ranks do not share "
                    "with other jobs: FXTP_TIMING_BOUNDS=1 asserts them")
def test_predicted_step_time_within_15_percent_and_the_order_kept(measured):
    m = measured["measurement"]
    for e, got in m.rows:
        assert got["total"] / e.step["total"] == pytest.approx(1, abs=0.15), (e.choice, got["total"], e.step["total"])
    assert m.order(measured=True) == m.order(measured=False)


@pytest.mark.parametrize("in_model", [False, True], ids=["fitted", "tp-in-model"])
def test_the_measured_hardware_prices_each_row_as_measured(in_model):
    """No ranks: rows of dp 4, dp 2 x tp 2 and tp 4, the last two with sequence parallelism
    (their tp collectives are all_gathers and reduce_scatters, as FSDP2's; dp 2 x tp 2's two
    groups both have 2 ranks), each term measured at its own factor of the prediction: priced
    again with the measured Hardware, every term is the measured one. With the tp groups'
    collectives timed inside the model (NOTE: [collectives in the model]) the tp groups wait
    for no one beyond them, and the measured Hardware replaces those entries."""
    import torch

    from fxtp.planner import Hardware
    from fxtp.planner.costs import Choice, Workload, estimate
    from fxtp.planner.hardware import HostCosts
    from fxtp.planner.measurement import measured_hardware, unreproduced
    from fxtp.planner.parallel_plan import fmt_time
    from fxtp.planner.model import TransformerShape
    from fxtp.planner.params import parameter_shapes, repeated_blocks

    model = _model()
    shape = TransformerShape.of(model, repeated_blocks(model).fqn)
    params = parameter_shapes(model, (1, 2, 4), (torch.zeros(1, SEQ, dtype=torch.long),), {})
    hw = Hardware("calibrated", 1e10, 2**30, 1e9, 1e9, devices_per_node=4, mfu=1.0, overlap_fsdp=False, compute_bytes=4,
                  achieved_flops=((1, 1e10), (2, 9e9), (4, 8e9)),
                  collectives=tuple((role + kind, n, lat, 1e9) for role, lat in ((("", 1e-4),) + ((("tp:", 3e-4),) if in_model else ()))
                                    for kind in ("all_reduce", "all_gather", "reduce_scatter") for n in (2, 4)),
                  host=HostCosts(op=2e-5, op_backward=2e-5, optimizer_tensor=1e-4, fsdp_unit=1e-4,
                                 asynchronous=False),  # kept as priced
                  collective_wait=((2, 1e-4, 0.3), (4, 1e-4, 0.4)))  # in the measured collectives' figures
    work = Workload(BATCH, SEQ, True, "adamw", 4, activation_bytes=4, gather_bytes=4)
    rows = []
    for i, c in enumerate([Choice(1, 4, False, None, 2, 1), Choice(2, 2, True, None, 4, 1), Choice(4, 1, True, None, 8, 1)]):
        e = estimate(c, shape, params[c.tp], hw, work)
        rows.append((e, {"compute": e.step["compute"] * (1.5 + i), "tp_comm": e.step["tp_comm"] * (2.5 + i),
                         "fsdp_exposed": e.step["fsdp_exposed"] * (0.5 + i)}))
    again = measured_hardware(hw, tuple(rows))
    assert all(e.step["gemm"] < e.step["compute"] for e, _ in rows)  # the host's seconds are in the compute
    assert [e.step["fsdp_host"] > 0 for e, _ in rows] == [True, True, False]  # and FSDP2's in its term, at dp > 1
    tp_waits = not in_model
    assert [(e.step["tp_wait"] > 0, e.step["fsdp_wait"] > 0) for e, _ in rows] == [(False, True), (tp_waits, True), (tp_waits, False)]
    assert again.collective_wait == ()
    named = [(kind, n) for kind, n, _, _ in again.collectives]
    assert len(named) == len(set(named)) == len(hw.collectives) + (12 if not in_model else 6), named  # tp's replaced, dp's added
    for e, m in rows:
        priced = estimate(e.choice, shape, params[e.choice.tp], again, work)
        for term in ("compute", "tp_comm", "fsdp_exposed"):
            assert priced.step[term] == pytest.approx(m[term], rel=1e-9), (e.choice, term)
    assert unreproduced(tuple(rows)) == []
    # a loaded run's dp 4 compute under the host seconds priced in it: the prediction's kept, and said
    e, m = rows[0]
    low = dict(m, compute=0.5 * (e.step["compute"] - e.step["gemm"]))
    kept = measured_hardware(hw, ((e, low),))
    assert estimate(e.choice, shape, params[1], kept, work).step["compute"] == pytest.approx(e.step["compute"], rel=1e-9)
    assert [line.split(" is under")[0] for line in unreproduced(((e, low),))] == [
        f"tp 1 x dp 4: measured compute {fmt_time(low['compute'])}"]


def test_a_collective_dispatched_inside_itself_is_issued_once():
    """No ranks: ``profiled`` counts the outermost events (NOTE: [collectives in the model]): a
    functional collective a mode dispatches again inside itself, as in the tests' rank pool, is
    one collective; its wait is none; two apart are two."""
    from fxtp.local_ranks import _outermost

    op, again, wait, later = (0.0, 5.0, True), (1.0, 4.0, True), (6.0, 9.0, False), (10.0, 11.0, True)
    assert _outermost([op, again, wait, later]) == 2
    assert _outermost([later, wait, again, op]) == 2  # in any order
    assert _outermost([op, (2.0, 7.0, True)]) == 1  # one overlapping another is not issued apart


def test_a_calibration_says_which_of_its_figures_it_doubts():
    """No ranks (NOTE: [calibration]): figures a busy host gave (a degree's GEMMs at a tenth of the
    others', an all_reduce with no latency, FSDP2 free, other jobs' load, 234 s) are each named,
    and the plan prints them with a fix; a quiet host's figures give none."""
    import dataclasses

    import fxtp
    from fxtp.planner import Hardware
    from fxtp.planner.hardware import doubts
    from fxtp.planner.hardware import CalibrationRun, HostCosts

    host = HostCosts(op=2e-5, op_backward=2e-5, optimizer_tensor=6e-5, fsdp_unit=1e-3, fsdp_tensor=8e-5, asynchronous=False)
    quiet = Hardware("calibrated 4 x CPU (gloo)", 3e10, 2**30, 1e9, 1e9, devices_per_node=4, mfu=1.0, overlap_fsdp=False,
                     compute_bytes=4, achieved_flops=((1, 3e10), (2, 2.6e10), (4, 2.4e10)),
                     collectives=(("all_reduce", 2, 3e-3, 8e8), ("all_reduce", 4, 5e-3, 1e9)), host=host,
                     calibration=CalibrationRun(31.0, 5.5, 2, 4))
    assert doubts(quiet) == ()
    busy = dataclasses.replace(quiet, achieved_flops=((1, 3e10), (2, 2.35e9), (4, 2.4e10)),
                               collectives=(("all_reduce", 2, 0.0, 8e8), ("all_reduce", 4, 5e-3, 1e9)),
                               host=dataclasses.replace(host, fsdp_unit=0.0, fsdp_tensor=0.0),
                               calibration=CalibrationRun(234.0, 12.0, 2, 4))
    said = doubts(busy)
    assert said == ("the tp 2 GEMMs ran at 2.35 GFLOP/s, under a third of the other degrees' 27.00",
                    "all_reduce over 2 ranks came out with no latency (the larger payload's time left none)",
                    "FSDP2's own host work came out as none (its run no slower than the unsharded one)",
                    "the load average was 12.0 on 2 cores (4 of it the ranks' own at most)",
                    "it took 234 s (31-37 s at the ranks' own load on 2 cores for hidden-128 and -256 Llamas)"), said
    text = str(fxtp.plan(_model(), 4, device_memory=2**30, batch=BATCH, seq=SEQ,
                         hardware=dataclasses.replace(busy, doubts=said)))
    assert (f"calibration doubts its figures: {'; '.join(said)}. fix: calibrate again on an idler host (a load average "
            "under 6: its 2 cores and the 4 ranks' own), or compare two calibrations") in text
    # calibrated without the model's weights (a config.json on meta): its tp collectives are the fit, and it says so
    without = "calibrated without the model's weights: its tensor-parallel collectives and FSDP2's are the fit after synthetic work"
    assert without in text
    in_model = dataclasses.replace(quiet, collectives=quiet.collectives + (("tp:all_reduce", 4, 6e-3, 1e9),))
    assert without not in str(fxtp.plan(_model(), 4, device_memory=2**30, batch=BATCH, seq=SEQ, hardware=in_model))


def test_calibrate_and_measure_usage(capsys):
    """They time a training step of --batch x --seq: both are needed; --device-memory is needed
    only without them."""
    base = ["plan", "llama", "--devices", "4"]
    for argv, message in [(base + ["--calibrate", "--batch", "8"], "--calibrate times a training step of --batch x --seq "
                           "tokens: give --seq "),
                          (base + ["--measure"], "--measure times a training step of --batch x --seq tokens: give --batch "
                           "and --seq "),
                          (base + ["--measure", "--batch", "8", "--seq", "16", "--inference"], "drop --inference"),
                          (base + ["--batch", "8", "--seq", "16"], "--device-memory")]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, argv


def test_host_time_adds_to_a_cpus_compute_and_hides_behind_a_gpus():
    """No ranks (NOTE: [host time]): a tiny Llama's counted ops priced at 100 us each (50 us a
    backward op, 1 ms an optimizer tensor): on a CPU they add to the GEMMs' seconds, as
    ``ops x op`` per micro-batch plus the optimizer's tensors; on a GPU the larger of the two."""
    import dataclasses

    import torch

    from fxtp.planner import Hardware
    from fxtp.planner.costs import Choice, Workload, estimate
    from fxtp.planner.hardware import HostCosts
    from fxtp.planner.model import TransformerShape
    from fxtp.planner.params import parameter_shapes, repeated_blocks

    model = _model()
    shape = TransformerShape.of(model, repeated_blocks(model).fqn)
    params = parameter_shapes(model, (1, 2), (torch.zeros(1, SEQ, dtype=torch.long),), {})
    ops = params[1].ops
    assert ops is not None and ops.block[0] > 20 and ops.other[0] > 10 and 0 < ops.sharded_share < 1, ops
    host = HostCosts(op=1e-4, op_backward=5e-5, optimizer_tensor=1e-3, asynchronous=False)
    cpu = Hardware("cpu", 1e10, 2**30, 1e9, 1e9, devices_per_node=4, mfu=1.0, overlap_fsdp=False, compute_bytes=4,
                   achieved_flops=((1, 1e10), (2, 1e10)), host=host)
    work = Workload(BATCH, SEQ, True, "adamw", 4, activation_bytes=4, gather_bytes=4)
    choice = Choice(2, 1, False, None, BATCH, 2)  # 2 micro-batches of 8 sequences on tp 2
    plain = estimate(choice, shape, params[2], dataclasses.replace(cpu, host=HostCosts()), work)
    priced = estimate(choice, shape, params[2], cpu, work)
    forward_ops = shape.layers * ops.block[0] + ops.other[0]
    tensors = len(params[2].other) + params[2].n_blocks * len(params[2].block)
    host_s = 2 * forward_ops * (1e-4 + ops.backward_ops * 5e-5) + tensors * 1e-3
    assert priced.step["gemm"] == pytest.approx(plain.step["compute"]) == pytest.approx(plain.step["gemm"])
    assert priced.step["compute"] == pytest.approx(plain.step["compute"] + host_s, rel=1e-9)
    gpu = estimate(choice, shape, params[2], dataclasses.replace(cpu, host=dataclasses.replace(host, asynchronous=True)), work)
    assert gpu.step["compute"] == pytest.approx(max(plain.step["compute"], host_s), rel=1e-9)
    # at tp 2, dp 1 the shards are fxtp's ShardedParameters: each block's 7 projections, the embedding
    # and the head (not the norms), priced at optimizer_sharded
    assert params[2].sharded_tensors() == 2 * 7 + 2 and params[1].sharded_tensors() == 0
    sharded = estimate(choice, shape, params[2], dataclasses.replace(cpu, host=dataclasses.replace(
        host, optimizer_sharded=3e-3)), work)
    assert sharded.step["compute"] - priced.step["compute"] == pytest.approx(16 * (3e-3 - 1e-3), rel=1e-9)


def test_pipeline_ranks_share_the_host_time_of_the_whole_model():
    """No ranks (NOTE: [host time], NOTE: [pipeline costs]): a pipelined row pays its ranks'
    host seconds too (before, none: a CPU-calibrated plan picked pp 2 at half tp 1 x dp 4's
    step). Cut into 2 pipeline ranks, each prices its own blocks' ops, the last the ops outside
    the blocks, each its own parameter tensors: the two add up to the whole model's host time;
    a pipelined row's compute is its slowest rank's GEMMs plus that rank's host seconds; the
    ops a checkpointed block dispatches again are its recompute."""
    import dataclasses

    import torch

    from fxtp.planner import Hardware
    from fxtp.planner.costs import Choice, Workload, estimate
    from fxtp.planner.hardware import HostCosts
    from fxtp.planner.model import TransformerShape
    from fxtp.planner.params import parameter_shapes, repeated_blocks
    from fxtp.planner.pipeline_costs import _rank_host, estimate_pipeline

    model = _model()
    shape = TransformerShape.of(model, repeated_blocks(model).fqn)
    params = parameter_shapes(model, (1,), (torch.zeros(1, SEQ, dtype=torch.long),), {})[1]
    host = HostCosts(op=1e-4, op_backward=5e-5, op_byte=1e-9, optimizer_tensor=1e-3, optimizer_element=1e-8,
                     asynchronous=False)
    cpu = Hardware("cpu", 1e10, 2**30, 1e9, 1e9, devices_per_node=4, mfu=1.0, overlap_fsdp=False, compute_bytes=4,
                   achieved_flops=((1, 1e10),), host=host)
    work = Workload(BATCH, SEQ, True, "adamw", 4, activation_bytes=4, gather_bytes=4)
    assert shape.layers == 2
    choice = Choice(1, 1, False, None, BATCH // 2, 2, pp=2, schedule="1F1B")
    first = _rank_host(choice, params, cpu, work, 1, True, False)
    last = _rank_host(choice, params, cpu, work, 1, False, True)
    whole = estimate(dataclasses.replace(choice, pp=1, schedule=None), shape, params, cpu, work)
    whole_host = whole.step["compute"] - whole.step["gemm"]
    assert first["compute"] + last["compute"] + first["optimizer"] + last["optimizer"] == pytest.approx(whole_host)
    assert 0 < first["compute"] < last["compute"]  # the head's and the loss's ops are the last rank's
    piped = estimate_pipeline(choice, shape, params, cpu, work)
    assert piped.stages == (1, 1)
    assert piped.step["compute"] == pytest.approx(piped.step["gemm"] + last["compute"] + last["optimizer"])
    unpriced = estimate_pipeline(choice, shape, params, dataclasses.replace(cpu, host=HostCosts()), work)
    assert piped.step["total"] - unpriced.step["total"] >= last["compute"] > 0
    # selective checkpointing recomputes no matmul, but its blocks' ops dispatch again: shown as recompute
    for row in (estimate(dataclasses.replace(choice, pp=1, schedule=None, activation_checkpointing="selective"),
                         shape, params, cpu, work),
                estimate_pipeline(dataclasses.replace(choice, activation_checkpointing="selective"), shape, params, cpu, work)):
        others = whole_host if row.choice.pp == 1 else last["compute"] + last["optimizer"]
        redo = row.step["compute"] - row.step["gemm"] - others
        assert row.step["recompute"] == pytest.approx(redo) and redo > 0
    # FSDP2 under pipelining: each unit's all_gather and reduce_scatter once a step
    dp2 = _rank_host(dataclasses.replace(choice, dp=2), params, dataclasses.replace(
        cpu, host=dataclasses.replace(host, fsdp_unit=1e-3, fsdp_tensor=1e-4)), work, 1, False, True)
    units = (len(params.block), len(params.other) - params.before)
    assert dp2["fsdp"] == pytest.approx(sum(2 * (1e-3 + n * 1e-4) for n in units))


def test_collectives_wait_for_the_compute_between_them():
    """No ranks (NOTE: [collective wait]): with a calibration's waits, each group's collectives
    add ``per_s x max(0, compute between them - count x after_s)`` a micro-batch: tp 4's at 2
    micro-batches (count: the blocks' and the outside collectives, the loss's 3 included), dp
    4's (FSDP2's root 2 and 3 a block), a pipelined tp 2's on each pipeline rank; in the tp and
    FSDP terms and the step, and nothing without waits."""
    import dataclasses

    import torch

    from fxtp.planner import Hardware
    from fxtp.planner.costs import Choice, Workload, _host, estimate, tp_comm
    from fxtp.planner.hardware import HostCosts
    from fxtp.planner.model import TransformerShape
    from fxtp.planner.params import parameter_shapes, repeated_blocks
    from fxtp.planner.pipeline_costs import estimate_pipeline

    model = _model()
    shape = TransformerShape.of(model, repeated_blocks(model).fqn)
    params = parameter_shapes(model, (1, 2, 4), (torch.zeros(1, SEQ, dtype=torch.long),), {})
    plain = Hardware("cpu", 1e9, 2**30, 1e9, 1e9, devices_per_node=4, mfu=1.0, overlap_fsdp=False, compute_bytes=4,
                     achieved_flops=((1, 1e9), (2, 1e9), (4, 1e9)),
                     collectives=tuple((k, n, 1e-3, 1e9) for k in ("all_reduce", "all_gather", "reduce_scatter") for n in (2, 4)),
                     host=HostCosts(op=2e-5, op_backward=2e-5, optimizer_tensor=1e-4, asynchronous=False))
    after, per = 1e-4, 0.4
    waiting = dataclasses.replace(plain, collective_wait=((2, after, per), (4, after, per)))
    work = Workload(BATCH, SEQ, True, "adamw", 4, activation_bytes=4, gather_bytes=4)
    for choice in (Choice(4, 1, False, None, BATCH // 2, 2), Choice(1, 4, False, None, BATCH // 8, 2)):
        e, none = (estimate(choice, shape, params[choice.tp], hw, work) for hw in (waiting, plain))
        between = (e.step["compute"] - _host(choice, shape, params[choice.tp], waiting, work)["optimizer"]) / 2
        comm = tp_comm(choice, shape, params[choice.tp], waiting, work, e.rate)
        count = shape.layers * comm.block_count + comm.outside_count if choice.tp > 1 else 2 + 3 * shape.layers
        wait = 2 * per * (between - count * after)
        term = "tp_comm" if choice.tp > 1 else "fsdp_exposed"
        assert wait > 0 and e.step["tp_wait" if choice.tp > 1 else "fsdp_wait"] == pytest.approx(wait), choice
        assert e.step[term] - none.step[term] == pytest.approx(wait) and none.step["tp_wait"] == none.step["fsdp_wait"] == 0
        assert e.step["total"] - none.step["total"] == pytest.approx(wait)
    assert tp_comm(Choice(4, 1, False, None, 4, 2), shape, params[4], waiting, work, 1e9).outside_count >= 3  # the loss's
    piped = Choice(2, 1, False, None, BATCH // 2, 2, pp=2, schedule="1F1B")
    e, none = (estimate_pipeline(piped, shape, params[2], hw, work) for hw in (waiting, plain))
    assert e.step["tp_wait"] > 0 and e.step["tp_comm"] - none.step["tp_comm"] == pytest.approx(e.step["tp_wait"])
