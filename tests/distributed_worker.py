"""One rank of tests/cpu/test_distributed.py: ``python tests/distributed_worker.py RESULTS``
(cupy_rmsnorm importable) under RANK, WORLD_SIZE (2), MASTER_ADDR and MASTER_PORT: the gloo backend, on the CPU.

Each check compares what the ranks compute on their shards with the single-process result of
the whole arrays (every rank computes that too, from the same seeded inputs). Rank 0 writes
{check: "ok" or the failure's traceback} to RESULTS as JSON; a check fails when it fails on
either rank.
"""

import copy
import json
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode

import cupy_rmsnorm as rn
from cupy_rmsnorm.torch import RMSNorm

CHECKS = {}
ROW_PLACEMENTS = (Shard(0), Shard(1), Replicate())


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def seeded(*shape, dtype=torch.float32, seed=0):
    """The same tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def dt(t, mesh, placement):
    return distribute_tensor(t, mesh, [placement])


def gathered(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def bits_equal(got, want, what):
    """``got`` (a DTensor, gathered) equal to the tensor ``want`` bit for bit."""
    got = gathered(got)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape, want.dtype, want.shape)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[want.element_size()]
    assert torch.equal(got.contiguous().view(as_int), want.contiguous().view(as_int)), \
        f"{what}: not bit for bit, largest difference {(got.float() - want.float()).abs().max()}"


def shard_bits_equal(got, want, what):
    """DTensor ``got``'s local shard equal to its part of ``want`` bit for bit (gloo gathers no FP8)."""
    (p,) = got.placements
    part = want.chunk(dist.get_world_size(), p.dim)[dist.get_rank()] if isinstance(p, Shard) else want
    bits_equal(got.to_local(), part, what)


def close(got, want, what):
    """Within float32 rounding: sums added in another order (partial sums of the shards)."""
    torch.testing.assert_close(gathered(got), want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def with_weight(module, weight):
    with torch.no_grad():
        module.weight.copy_(weight)
    return module


# -- the ops on DTensors: each rank's shard, equal to the whole arrays' result -------------------

@check
def forward_ops(mesh):
    x, residual, gate = (seeded(4, 6, 32, dtype=torch.bfloat16, seed=s) for s in (0, 1, 2))
    weight = seeded(32, seed=3)
    w = dt(weight, mesh, Replicate())
    for p in ROW_PLACEMENTS:
        y = rn.rms_norm(dt(x, mesh, p), w)
        assert isinstance(y, DTensor) and y.placements == (p,), y.placements
        bits_equal(y, rn.rms_norm(x, weight), f"rms_norm on {p}")
        bits_equal(torch.ops.cupy_rmsnorm.rms_norm(dt(x, mesh, p), w, 1e-6, 0.0, "llama"),
                   rn.rms_norm(x, weight, casting_mode="llama"), f"the registered rms_norm on {p}")
        # the residual comes replicated: DTensor hands the op its rows
        got = rn.fused_add_rms_norm(dt(x, mesh, p), dt(residual, mesh, Replicate()), w)
        want = rn.fused_add_rms_norm(x, residual, weight)
        for g, v, name in zip(got, want, ("out", "residual_out")):
            assert g.placements == (p,), g.placements
            bits_equal(g, v, f"fused_add_rms_norm's {name} on {p}")
        got = rn.rms_norm_gated(dt(x, mesh, p), dt(gate, mesh, p), w, group_size=8, norm_before_gate=False)
        bits_equal(got, rn.rms_norm_gated(x, gate, weight, group_size=8, norm_before_gate=False),
                   f"rms_norm_gated on {p}")


@check
def in_place_ops(mesh):
    x, residual = (seeded(4, 6, 32, dtype=torch.bfloat16, seed=s) for s in (0, 1))
    weight = seeded(32, seed=3)
    want = rn.fused_add_rms_norm(x, residual, weight)
    for p in ROW_PLACEMENTS:
        dx, dr = dt(x.clone(), mesh, p), dt(residual.clone(), mesh, p)   # (a replicated DTensor may hold them)
        memory = dx.to_local().data_ptr(), dr.to_local().data_ptr()
        got = rn.fused_add_rms_norm(dx, dr, dt(weight, mesh, Replicate()), out=dx, residual_out=dr)
        assert got[0] is dx and got[1] is dr and dx.placements == dr.placements == (p,)
        assert (dx.to_local().data_ptr(), dr.to_local().data_ptr()) == memory   # written where they were
        bits_equal(dx, want[0], f"in place out on {p}")
        bits_equal(dr, want[1], f"in place residual_out on {p}")
    dx, dr = dt(x, mesh, Shard(0)), dt(residual, mesh, Replicate())
    try:
        rn.fused_add_rms_norm(dx, dr, dt(weight, mesh, Replicate()), out=dx, residual_out=dr)
    except RuntimeError as e:     # DTensor's wrapping of the strategy's ValueError
        assert "residual must have x's placements" in str(e), e
    else:
        raise AssertionError("in place on differently placed x and residual did not raise")


@check
def quant_ops(mesh):
    x, residual = (seeded(6, 256, seed=s) for s in (0, 1))
    weight = seeded(256, seed=3)
    w = dt(weight, mesh, Replicate())
    scale = torch.tensor([0.02])
    for p in (Shard(0), Replicate()):
        for kwargs in (dict(), dict(group_size=128), dict(scale=scale), dict(quant_dtype="int8")):
            given = {k: dt(v, mesh, Replicate()) if k == "scale" else v for k, v in kwargs.items()}
            q, scales = rn.rms_norm_quant(dt(x, mesh, p), w, **given)
            want_q, want_scales = rn.rms_norm_quant(x, weight, **kwargs)
            shard_bits_equal(q, want_q, f"rms_norm_quant's q, {kwargs} on {p}")
            bits_equal(scales, want_scales, f"rms_norm_quant's scales, {kwargs} on {p}")
            if p == Shard(0) and "group_size" in kwargs:    # each rank's scales: its rows' padded layout
                local = scales.to_local()
                assert local.stride() == (1, 4), local.stride()
            q, summed, scales = rn.fused_add_rms_norm_quant(dt(x, mesh, p), dt(residual, mesh, p), w, **given)
            want = rn.fused_add_rms_norm_quant(x, residual, weight, **kwargs)
            shard_bits_equal(q, want[0], f"fused_add_rms_norm_quant's q, {kwargs} on {p}")
            bits_equal(summed, want[1], f"fused_add_rms_norm_quant's residual_out, {kwargs} on {p}")
            bits_equal(scales, want[2], f"fused_add_rms_norm_quant's scales, {kwargs} on {p}")
        want = rn.fused_add_rms_norm_quant(x, residual, weight)
        dr = dt(residual.clone(), mesh, p)      # (a replicated DTensor may hold the very tensor)
        q, _, scales = rn.fused_add_rms_norm_quant(dt(x, mesh, p), dr, w, residual_out=dr)
        shard_bits_equal(q, want[0], f"fused_add_rms_norm_quant in place: q on {p}")
        bits_equal(dr, want[1], f"fused_add_rms_norm_quant in place: the residual on {p}")


def qk_inputs(angles):
    q, k = seeded(6, 4, 16, seed=0), seeded(6, 2, 16, seed=1)
    q_weight, k_weight = seeded(16, seed=2), seeded(16, seed=3)
    if angles == "cache":
        table = dict(positions=torch.arange(6) * 3 % 11, cos_sin_cache=seeded(11, 8, seed=4))
    else:       # per token and channel, (tokens, rotary_dim)
        table = dict(cos=seeded(6, 8, seed=5), sin=seeded(6, 8, seed=6))
    return q, k, q_weight, k_weight, table


@check
def qk_norm_rope_forward_and_backward(mesh):
    for angles in ("cache", "cos_sin"):
        q, k, q_weight, k_weight, table = qk_inputs(angles)
        dq_out, dk_out = seeded(*q.shape, seed=7), seeded(*k.shape, seed=8)
        want = rn.qk_norm_rope(q, k, q_weight, k_weight, **table)
        want_grads = rn.qk_norm_rope_backward(dq_out, dk_out, q, k, q_weight, k_weight, **table)
        for p in (Shard(0), Shard(1), Replicate()):      # tokens, heads, neither
            dq, dk = dt(q, mesh, p).requires_grad_(), dt(k, mesh, p).requires_grad_()
            dqw, dkw = (dt(t, mesh, Replicate()).requires_grad_() for t in (q_weight, k_weight))
            d_table = {name: dt(t, mesh, Replicate()) for name, t in table.items()}
            q_out, k_out = rn.qk_norm_rope(dq, dk, dqw, dkw, **d_table)
            bits_equal(q_out, want[0], f"qk_norm_rope's q ({angles}) on {p}")
            bits_equal(k_out, want[1], f"qk_norm_rope's k ({angles}) on {p}")
            loss = (q_out * dt(dq_out, mesh, p)).sum() + (k_out * dt(dk_out, mesh, p)).sum()
            loss.full_tensor().backward()
            bits_equal(dq.grad, want_grads[0], f"dq ({angles}) on {p}")
            bits_equal(dk.grad, want_grads[1], f"dk ({angles}) on {p}")
            for got, v, name in ((dqw.grad, want_grads[2], "dq_weight"), (dkw.grad, want_grads[3], "dk_weight")):
                assert got.placements[0].is_partial() != (p == Replicate()), got.placements
                close(got, v, f"{name} ({angles}) on {p}")
            in_q, in_k = dt(q.clone(), mesh, p), dt(k.clone(), mesh, p)
            rn.qk_norm_rope(in_q, in_k, dqw.detach(), dkw.detach(), out_q=in_q, out_k=in_k, **d_table)
            bits_equal(in_q, want[0], f"qk_norm_rope in place ({angles}) on {p}")


@check
def backward_through_autograd(mesh):
    """dx on the rows' shards bit for bit; dweight a partial sum over the shards, reduced: bit for
    bit the sum of the shards' single-process dweights, within rounding of the whole batch's."""
    x, residual, gate, dy = (seeded(4, 6, 32, seed=s) for s in (0, 1, 2, 4))
    weight = seeded(32, seed=3)
    for p in (Shard(0), Shard(1)):
        halves = list(zip(*(t.chunk(2, dim=p.dim) for t in (x, residual, gate, dy))))
        for op in ("rms_norm", "fused_add_rms_norm", "rms_norm_gated"):
            def run(x, residual, gate, weight):
                if op == "rms_norm":
                    return rn.rms_norm(x, weight)
                if op == "rms_norm_gated":
                    return rn.rms_norm_gated(x, gate, weight, group_size=16)
                y, summed = rn.fused_add_rms_norm(x, residual, weight)
                return y + summed * 0.5

            def grads(x, residual, gate, dy, weight):
                leaves = [t.detach().clone().requires_grad_() for t in (x, residual, gate, weight)]
                loss = (run(*leaves) * dy).sum()
                (gathered(loss) if isinstance(loss, DTensor) else loss).backward()
                return [t.grad for t in leaves]

            want = grads(x, residual, gate, dy, weight)
            got = grads(*(dt(t, mesh, p) for t in (x, residual, gate, dy)), dt(weight, mesh, Replicate()))
            used = {"rms_norm": (0,), "fused_add_rms_norm": (0, 1), "rms_norm_gated": (0, 2)}[op]
            for i in used:
                assert got[i].placements == (p,), got[i].placements
                bits_equal(got[i], want[i], f"{op}: the gradient of input {i} on {p}")
            assert got[3].placements[0].is_partial(), got[3].placements
            shard_sum = sum(grads(*half, weight)[3] for half in halves)
            bits_equal(got[3], shard_sum, f"{op}: dweight on {p}, against the shards' single-process sum")
            close(got[3], want[3], f"{op}: dweight on {p}, against the whole batch's")
        # the registered backward op on its own
        dx, dweight = rn.rms_norm_backward(dt(dy, mesh, p), dt(x, mesh, p), dt(weight, mesh, Replicate()))
        want_dx, want_dweight = rn.rms_norm_backward(dy, x, weight)
        bits_equal(dx, want_dx, f"rms_norm_backward's dx on {p}")
        close(dweight, want_dweight, f"rms_norm_backward's dweight on {p}")


@check
def layer_norm_ops(mesh):
    """LayerNorm on shards: the forward bit for bit; adaLN's (B, 1, D) shift and scale split with
    the rows on dim 0, replicated on dim 1, their gradients sharded or partial sums accordingly."""
    x, residual, dy = (seeded(4, 6, 32, seed=s) for s in (0, 1, 4))
    weight, bias = seeded(32, seed=3), seeded(32, seed=5)
    shift, scale = seeded(4, 1, 32, seed=6), seeded(4, 1, 32, seed=7)
    w, b = dt(weight, mesh, Replicate()), dt(bias, mesh, Replicate())
    for p in ROW_PLACEMENTS:
        bits_equal(rn.layer_norm(dt(x, mesh, p), w, b), rn.layer_norm(x, weight, bias), f"layer_norm on {p}")
        got = rn.fused_add_layer_norm(dt(x, mesh, p), dt(residual, mesh, p), w, b)
        for g, v in zip(got, rn.fused_add_layer_norm(x, residual, weight, bias)):
            bits_equal(g, v, f"fused_add_layer_norm on {p}")
        table = Shard(0) if p == Shard(0) else Replicate()
        got = rn.layer_norm_modulate(dt(x, mesh, p), dt(shift, mesh, table), dt(scale, mesh, table), weight=w, bias=b)
        bits_equal(got, rn.layer_norm_modulate(x, shift, scale, weight=weight, bias=bias), f"modulate on {p}")
        if p == Replicate():
            continue
        got = rn.layer_norm_modulate_backward(dt(dy, mesh, p), dt(x, mesh, p), dt(shift, mesh, table),
                                              dt(scale, mesh, table), weight=w, bias=b)
        want = rn.layer_norm_modulate_backward(dy, x, shift, scale, weight=weight, bias=bias)
        bits_equal(got[0], want[0], f"modulate dx on {p}")
        for g, v, name in zip(got[1:], want[1:], ("dshift", "dscale", "dweight", "dbias")):
            if name in ("dshift", "dscale") and p == Shard(0):
                assert g.placements == (Shard(0),), (name, g.placements)
                bits_equal(g, v, f"modulate {name} on {p}")
            else:
                assert g.placements[0].is_partial(), (name, g.placements)
                close(g, v, f"modulate {name} on {p}")


# -- models: a 2-layer model of the library's modules, with SequenceParallel norms, and with FSDP2 --

class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x):
        return x + self.down(nn.functional.silu(self.up(self.norm(x))))


class TwoLayers(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        torch.manual_seed(0)      # the same parameters on every rank
        self.layers = nn.ModuleList(Block(hidden) for _ in range(2))
        self.final = RMSNorm(hidden)
        for norm in (self.layers[0].norm, self.layers[1].norm, self.final):
            with_weight(norm, torch.rand(hidden) + 0.5)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.final(x)


def loss_of(out, target):
    return ((out - target) ** 2).mean()


def named_grads(model):
    return {name: gathered(p.grad) for name, p in model.named_parameters()}


@check
def sequence_parallel_model(mesh):
    """Norms on sequence shards (SequenceParallel), MLPs column- then row-parallel: the norms run
    on each rank's rows with no communication, the first bit for bit; the row-parallel
    projection adds partial sums across ranks, so later values, the loss and the gradients
    match the single process within float32 rounding."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    x, target = seeded(2, 8, 32, seed=0), seeded(2, 8, 32, seed=1)
    reference = TwoLayers()
    model = copy.deepcopy(reference)
    plan = {"final": SequenceParallel()}
    for i in range(2):
        plan.update({f"layers.{i}.norm": SequenceParallel(), f"layers.{i}.up": ColwiseParallel(input_layouts=Shard(1)),
                     f"layers.{i}.down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    parallelize_module(model, mesh, plan)
    sharded_x = dt(x, mesh, Shard(1))
    with CommDebugMode() as comm:
        first = model.layers[0].norm(sharded_x)
    assert comm.get_total_counts() == 0, comm.get_comm_counts()
    assert first.placements == (Shard(1),) and first.to_local().shape == (2, 4, 32), first.to_local().shape
    bits_equal(first, reference.layers[0].norm(x), "the first norm's output")

    loss = loss_of(model(sharded_x), dt(target, mesh, Shard(1)))
    want = loss_of(reference(x), target)
    loss.full_tensor().backward()
    want.backward()
    close(loss.full_tensor(), want.detach(), "the loss")
    want_grads = named_grads(reference)
    for name, grad in named_grads(model).items():
        close(grad, want_grads[name], f"{name}'s gradient")


@check
def fsdp2_model(mesh):
    """fully_shard over the model: each rank trains on half the batch with the unsharded
    parameters FSDP2 gathers (and frees after each layer: nothing of the library may pin their
    storage). Each rank's loss is the single process's on that half bit for bit, and the
    gradients (the mean of the two halves', reduce-scattered) are bit for bit the single
    process's mean of the halves' gradients: a sum of two and a halving round alike in any
    order. Against the whole batch at once, within float32 rounding (other sums)."""
    from torch.distributed.fsdp import fully_shard
    x, target = seeded(4, 8, 32, seed=0), seeded(4, 8, 32, seed=1)
    rank = dist.get_rank()
    reference = TwoLayers()
    model = copy.deepcopy(reference)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    halves = list(zip(x.chunk(2), target.chunk(2)))
    loss = loss_of(model(halves[rank][0]), halves[rank][1])
    loss.backward()
    half_losses, half_grads = [], []
    for hx, ht in halves:
        reference.zero_grad()
        half_losses.append(loss_of(reference(hx), ht))
        half_losses[-1].backward()
        half_grads.append(named_grads(reference))
    bits_equal(loss.detach(), half_losses[rank].detach(), "this rank's loss")
    reference.zero_grad()
    loss_of(reference(x), target).backward()
    whole = named_grads(reference)
    for name, grad in named_grads(model).items():
        assert isinstance(model.get_parameter(name), DTensor)
        bits_equal(grad, (half_grads[0][name] + half_grads[1][name]) / 2, f"{name}'s gradient")
        close(grad, whole[name], f"{name}'s gradient against the whole batch's")
    optimizer.step()      # and it trains: a second step runs on the updated shards
    optimizer.zero_grad()
    loss_of(model(halves[rank][0]), halves[rank][1]).backward()


def main(results_path):
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for name, fn in CHECKS.items():
        try:
            fn(mesh)
            failure = ""
        except Exception:
            failure = f"rank {dist.get_rank()}: {traceback.format_exc()}"
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, failure)
        results[name] = "\n".join(f for f in outcomes if f) or "ok"
    if dist.get_rank() == 0:
        with open(results_path, "w", encoding="utf-8") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
