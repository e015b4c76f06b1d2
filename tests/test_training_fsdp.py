"""FSDP2 on the data-parallel dim of a dp 2 x tp 2 mesh beside fxtp, as a user's loop writes it,
on real gloo ranks (world size 4: the smallest dp x tp), against the single-device model.

* grouped-query attention whose one kv head is held by both tensor-parallel ranks (NOTE:
  [grouped shards]): ``pm.clip_grad_norm_`` counts the shared head once (its owner's rows of
  FSDP2's block), fp32, 3 clipped SGD steps;
* ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: bf16
  forward on a graph captured for bf16 (NOTE: [low-precision graphs] in
  fxtp/runtime/variants.py), fp32 shards as master weights, 3 clipped SGD steps within bf16
  tolerance;
* ``to_dtensor_parameters(pm, mesh["tp"])`` before ``fully_shard`` (NOTE: [DTensor parameters
  for FSDP2]): torch's own ``clip_grad_norm_`` on the 2-D DTensors, 3 clipped SGD steps, and
  a grouped kv layout refused.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from cases import Attention

import fxtp

X = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))


def _loop(mixed_precision: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = Attention(32, 4, 1, repeat="enable_gqa")  # 1 kv head, 2 tp ranks: both hold it
    local = X.chunk(2)[mesh["dp"].get_local_rank()]
    # dynamic capture: a graph for the bf16 parameters is made at the first call (NOTE:
    # [low-precision graphs]); a static compile keeps one graph and refuses them
    pm = fxtp.compile(copy.deepcopy(ref), 2, (local,), group=mesh["tp"], dynamic=mixed_precision)
    grouped = pm.placements["k.weight"].overlaps
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    fully_shard(pm, mesh=mesh["dp"], **({"mp_policy": policy} if policy else {}))
    # SGD: linear in the gradients. Adam would scale noise up to lr-sized steps: bf16's, and the key
    # bias's gradient, zero up to rounding (softmax ignores a shift)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.5, momentum=0.9), torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    tol = {"rtol": 2e-2, "atol": 2e-2} if mixed_precision else {}
    dtypes, norms = set(), []
    for step in range(3):
        out = pm(local)
        dtypes.add(out.dtype)
        (out.float() ** 2).mean().backward()  # FSDP2 averages over dp: the global batch's mean
        want = ref(X)
        (want ** 2).mean().backward()
        torch.testing.assert_close(out.float(), want.chunk(2)[mesh["dp"].get_local_rank()], **tol, msg=f"step {step}")
        got, expected = pm.clip_grad_norm_(0.05), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert float(expected) > 0.05  # it clips
        torch.testing.assert_close(got, expected, **tol, msg=f"step {step} norm")
        norms.append(float(got))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    full = pm.full_state_dict()
    for key, value in ref.state_dict().items():
        assert full[key].dtype == torch.float32, key  # the shards stay the fp32 master weights
        torch.testing.assert_close(full[key], value, **tol, msg=lambda m, key=key: f"{key}: {m}")
    return {"grouped": grouped, "dtypes": dtypes, "norms": norms, "notes": pm.report.shape_notes}


def _torch_clipping_on_dtensors() -> dict:
    """``to_dtensor_parameters`` before ``fully_shard``: torch's ``clip_grad_norm_`` on FSDP2's
    2-D DTensors is the single device's norm, without fxtp's warning; 3 clipped SGD steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from fxtp.runtime.clipping import FsdpClippingWarning
    from fxtp.runtime.dtensor_params import to_dtensor_parameters

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    local = X.chunk(2)[mesh["dp"].get_local_rank()]
    torch.manual_seed(0)
    ref = Attention(32, 4, 2)  # 2 kv heads: every sharded parameter one even segment
    pm = fxtp.compile(copy.deepcopy(ref), 2, (local,), group=mesh["tp"], dynamic=False)
    to_dtensor_parameters(pm, mesh["tp"])
    fully_shard(pm, mesh=mesh["dp"])
    meshes = {p.device_mesh.ndim for p in pm.parameters()}
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.5, momentum=0.9), torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    norms = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", FsdpClippingWarning)
        for step in range(3):
            (pm(local) ** 2).mean().backward()
            (ref(X) ** 2).mean().backward()
            got = torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.05)
            got = got.full_tensor() if isinstance(got, DTensor) else got
            torch.testing.assert_close(got, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05), msg=f"step {step}")
            norms.append(float(got))
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
    for fqn, p in pm.named_parameters():  # a 2-D DTensor's full tensor is the whole parameter
        torch.testing.assert_close(p.detach().full_tensor(), ref.get_parameter(fqn).detach(), msg=lambda m, fqn=fqn: f"{fqn}: {m}")
    grouped = fxtp.compile(Attention(32, 4, 1, repeat="enable_gqa"), 2, (local,), group=mesh["tp"], dynamic=False)
    with pytest.raises(fxtp.FxtpConfigError, match="'k.weight'.*pm.clip_grad_norm_"):
        to_dtensor_parameters(grouped, mesh["tp"])
    return {"meshes": meshes, "norms": norms}


def _all() -> tuple[dict, dict, dict]:
    return _loop(False), _loop(True), _torch_clipping_on_dtensors()


def test_fsdp2_x_tp_clipping_and_bf16_mixed_precision(rank_pools):
    """dp 2 x tp 2: exact clipping with a kv head shared by the tp ranks; FSDP2's bf16 mixed
    precision trains like the single device within bf16 tolerance; torch's own clipping on
    DTensor parameters is exact; every rank clips alike."""
    results = rank_pools(4).run(_all)
    assert all(r[2]["meshes"] == {2} for r in results)
    assert all(r[2]["norms"] == results[0][2]["norms"] for r in results)
    for fp32, bf16, _ in results:
        assert fp32["grouped"] and fp32["dtypes"] == {torch.float32} and not fp32["notes"]
        assert bf16["dtypes"] == {torch.bfloat16}
        assert any("parameters in torch.bfloat16" in note for note in bf16["notes"]), bf16["notes"]
    for key in (0, 1):
        assert all(r[key]["norms"] == results[0][key]["norms"] for r in results)
