"""torch.distributed on the CPU: the registered ops on DTensors, SequenceParallel norms and FSDP2.

Two processes on the gloo backend (tests/distributed_worker.py, started once for the module,
bounded in time) run every check and report each one; the tests here read the reports. Here
in one process: every registered op has a sharding strategy, declared without importing
torch.distributed.tensor, and the CPU path leaves a parameter's storage resizable (FSDP2
frees unsharded parameters by resizing their storage). Skips where torch, torch.distributed
or gloo is missing.
"""

import json
import os
import socket
import subprocess
import sys

import pytest
from helpers import child_env

torch = pytest.importorskip("torch", reason="distributed tests: torch is not installed")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("distributed tests: this torch has no torch.distributed with the gloo backend",
                allow_module_level=True)

import cupy_rmsnorm as rn  # noqa: E402
import cupy_rmsnorm.torch  # noqa: E402,F401  (registers the ops)

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "distributed_worker.py")
CHECKS = ["forward_ops", "in_place_ops", "quant_ops", "qk_norm_rope_forward_and_backward",
          "backward_through_autograd", "layer_norm_ops", "sequence_parallel_model", "fsdp2_model"]
TIMEOUT_S = 120
OPS = ["rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_inplace", "rms_norm_backward",
       "fused_add_rms_norm_backward", "rms_norm_quant", "fused_add_rms_norm_quant",
       "fused_add_rms_norm_quant_inplace", "rms_norm_gated", "rms_norm_gated_backward", "qk_norm_rope",
       "qk_norm_rope_inplace", "qk_norm_rope_backward", "layer_norm", "fused_add_layer_norm",
       "fused_add_layer_norm_inplace", "layer_norm_modulate", "layer_norm_backward", "fused_add_layer_norm_backward",
       "layer_norm_modulate_backward"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """{check: "ok" or its failure} from two ranks of the worker."""
    folder = tmp_path_factory.mktemp("distributed")
    results = folder / "results.json"
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
                    OMP_NUM_THREADS="1")     # two ranks on the cores the other tests leave
    ranks = [subprocess.Popen([sys.executable, WORKER, str(results)], env=dict(env, RANK=str(rank)), cwd=folder,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outputs = []
    try:
        for rank in ranks:
            outputs.append(rank.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for rank in ranks:
            rank.kill()
        pytest.fail(f"the two ranks did not finish in {TIMEOUT_S} s")
    finally:
        for rank in ranks:
            rank.wait()
    if not results.exists():
        pytest.fail("the ranks wrote no results:\n" + "\n".join(o[-3000:] for o in outputs))
    return json.loads(results.read_text())


def test_the_worker_runs_these_checks(reports):
    assert sorted(reports) == sorted(CHECKS)


@pytest.mark.parametrize("name", CHECKS)
def test_on_two_ranks(reports, name):
    assert reports[name] == "ok", reports[name]


def test_every_registered_op_has_a_sharding_strategy():
    code = ("import sys, torch, cupy_rmsnorm.torch\n"
            "assert 'torch.distributed.tensor' not in sys.modules, 'binding imported torch.distributed.tensor'\n"
            "from torch.distributed.tensor import DTensor\n"     # the declarations register now
            "funcs = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs\n"
            "ops = torch.ops.cupy_rmsnorm\n"
            "print(sorted(name for name in ops if getattr(ops, name).default in funcs))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(sorted(OPS))
    assert sorted(torch.ops.cupy_rmsnorm) == sorted(OPS)


def test_a_declaration_names_every_output():
    from cupy_rmsnorm._distributed import ROWS, shard_rows
    with pytest.raises(ValueError, match="outputs must give one role per output"):
        shard_rows(torch.ops.cupy_rmsnorm.fused_add_rms_norm, rows=("x",), outputs=(ROWS,))


def calls_on_cpu_tensors(weight):
    """Every family's public call, on CPU tensors and ``weight`` (float32, 32 wide)."""
    x, other = torch.randn(4, 32), torch.randn(4, 32)
    q, k = torch.randn(3, 2, 32), torch.randn(3, 1, 32)
    cos_sin = dict(cos=torch.randn(3, 32), sin=torch.randn(3, 32))
    return [rn.rms_norm(x, weight), rn.fused_add_rms_norm(x, other, weight), rn.rms_norm_gated(x, other, weight),
            rn.rms_norm_quant(x, weight), rn.rms_norm_backward(other, x, weight),
            rn.qk_norm_rope(q, k, weight, weight, **cos_sin)]


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad", "autograd"])
def test_the_cpu_path_leaves_the_weight_resizable(requires_grad):
    weight = torch.randn(32, requires_grad=requires_grad)
    results = calls_on_cpu_tensors(weight)
    memory = {weight.untyped_storage().data_ptr()}
    for result in results:
        for t in result if isinstance(result, tuple) else (result,):
            assert t.untyped_storage().data_ptr() not in memory, "a result shares the weight's memory"
    # FSDP2 frees an unsharded parameter so, after the forward (Tensor.numpy() would forbid it)
    weight.untyped_storage().resize_(0)
