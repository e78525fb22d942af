"""CUDA-graph decode (and prefill) replays equal eager steps (GPU only)."""
from __future__ import annotations

import pytest
import torch

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.request import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_graph_decode_equals_eager(name, checkpoint):
    if not torch.cuda.is_available():
        pytest.fail("pytest -m gpu needs a CUDA device")
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i, 9, 11 * i % 900 + 3] * (i + 1) for i in range(11)]  # 11 decodes: a padded graph size
    outputs = {}
    for graphs in (False, True):
        engine = Engine(EngineConfig(model=str(checkpoint(name)), device="cuda", dtype="float32",
                                     attention="triton", cuda_graphs=graphs, max_num_seqs=16, num_kv_blocks=256))
        assert (engine.runner.graphs is not None) == graphs
        outputs[graphs] = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
        if graphs:  # the default: the prefill step (198 tokens) replays the mixed graph of 256
            assert engine.runner.mixed_graphs is not None and engine.runner.mixed_graphs.replays > 0
    assert outputs[True] == outputs[False]
