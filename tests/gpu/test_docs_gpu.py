"""The README's and docs' Python blocks marked ``<!-- gpu -->`` run on the GPU."""

import sys
import types

import pytest
from helpers import doc_blocks, torch_cuda_missing

GPU_BLOCKS = [b for b in doc_blocks() if b[2] == "python" and b[3]]
reason = torch_cuda_missing()


@pytest.mark.skipif(reason is not None, reason=f"docs GPU blocks: {reason}")
@pytest.mark.parametrize("name,line,lang,gpu,code", GPU_BLOCKS, ids=[f"{b[0]}:{b[1]}" for b in GPU_BLOCKS])
def test_gpu_block_runs(name, line, lang, gpu, code, free_gpu_memory):
    # a real module: torch.compile imports the module of the code it compiles
    module = types.ModuleType("docs_block")
    sys.modules[module.__name__] = module
    try:
        exec(compile(code, f"{name}:{line}", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]


def test_there_are_gpu_blocks():
    assert GPU_BLOCKS
