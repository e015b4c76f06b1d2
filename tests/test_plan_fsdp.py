"""``fxtp.plan``'s predicted FSDP2 bytes per step against a run (issue 25, item 6): dp 2 x tp 2
on real gloo ranks (world size 4: the smallest dp x tp), a tiny Llama (2 blocks, hidden 64).

The planner prices torchtitan's units (each block, then the root): every parameter gathered in
forward, gathered again in backward (``reshard_after_forward=True``) and reduce_scattered once
(NOTE: [cost model] in fxtp/planner/costs.py). The bytes do not depend on how the parameters
are grouped into units, only on that. A ``ParallelModule`` runs one graph over all its
parameters and never calls its blocks' ``forward``: per-block units are gathered once before
the graph and held through backward (NOTE: [FSDP2 units inside a ParallelModule] in
fxtp/runtime/fsdp.py), not the bytes priced here; the run wraps the root alone with ``reshard_after_forward=True`` (FSDP2 otherwise keeps the root gathered
after forward), which gathers and scatters each parameter as often as the per-block units do.

The run's FSDP2 collectives are counted by ``Fsdp2Collectives`` (tests/_helpers.py), a
``TorchDispatchMode`` on the c10d ops FSDP2 issues, whose call counts are checked against torch's own ``CommDebugMode`` (which counts c10d collectives, not their bytes).
The planner prices bf16 gathers and fp32 scatters (NOTE: [mixed precision]); this CPU run has no
``MixedPrecisionPolicy`` (fp32 gathers), so the prediction is asked with ``gather_bytes=4``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.debug import CommDebugMode

from _helpers import Fsdp2Collectives


def _run() -> dict:
    """One rank of dp 2 x tp 2: the planner's FSDP2 bytes for that mesh, and the bytes and calls
    of the second step (the first makes FSDP2's lazy state), per-block units then the root."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fxtp
    from fxtp.planner import HARDWARE
    from fxtp.planner.costs import Choice, Workload, estimate
    from fxtp.planner.model import TransformerShape
    from fxtp.planner.params import parameter_shapes, repeated_blocks

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    local = ids.chunk(2)[mesh["dp"].get_local_rank()]
    shape = TransformerShape.of(model, repeated_blocks(model).fqn)
    params = parameter_shapes(model, (2,), (local,), {})[2]
    work = Workload(4, 16, True, "sgd", 2, activation_bytes=4, gather_bytes=4)  # fp32 gathers: no MixedPrecisionPolicy
    predicted = estimate(Choice(2, 2, False, None, 2, 1), shape, params, HARDWARE["h100"], work).comm_bytes["fsdp"]
    pm = fxtp.compile(model, 2, (local,), example_kwargs={"labels": local}, group=mesh["tp"], dynamic=False)
    fully_shard(pm, mesh=mesh["dp"], reshard_after_forward=True)
    pm(local, labels=local).loss.backward()
    with CommDebugMode() as comm, Fsdp2Collectives() as counted:
        pm(local, labels=local).loss.backward()
    debug = {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items() if str(op).startswith("c10d.")}
    return {"predicted": predicted, "sent": dict(counted.sent), "calls": dict(counted.calls), "debug": debug,
            "held": sum(p.to_local().numel() for p in pm.parameters())}


def test_fsdp2_bytes_per_step_equal_the_run(rank_pools):
    """dp 2 x tp 2: the bytes FSDP2's all_gathers (forward and again in backward) and
    reduce_scatter send per step equal the planner's ``comm_bytes["fsdp"]``; the collective
    counts equal ``CommDebugMode``'s (FSDP2 issues no other c10d collective)."""
    for rank in rank_pools(4).run(_run):
        assert rank["calls"] == rank["debug"] == {"_allgather_base_": 2, "_reduce_scatter_base_": 1}, rank
        # fp32: 4 B gathered twice and scattered once per element a dp rank holds, sent (dp-1)/dp of it
        assert rank["sent"]["_allgather_base_"] == 2 * rank["sent"]["_reduce_scatter_base_"] == 2 * 4 * rank["held"], rank
        assert rank["predicted"] == sum(rank["sent"].values()), rank
