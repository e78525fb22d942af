"""Sequence classifiers and reward models (HF's ``*ForSequenceClassification``: the backbone and a ``score`` head at
the last token) through the embedding path: each embedding request's vector equals transformers'
``AutoModelForSequenceClassification`` ``.logits`` (whole prompts, batched, chunked prefills, other poolers), the
number of labels follows PretrainedConfig's rule, generation and vector options are refused, and ``infer embed``
prints the logits with the labels' names."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from infer.core.classification import num_labels, read_id2label
from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import CheckpointError, InvalidRequestError
from infer.core.pooling import PoolingParams
from infer.core.request import FinishReason, SamplingParams

PROMPTS = [[5 + i, 9, 11 * i % 900 + 3] * (i + 3) for i in range(3)]  # 9, 12 and 15 tokens
NAMES = {0: "negative", 1: "neutral", 2: "positive"}
# (fixture checkpoint, architecture, labels): a reward model (1 label), HF's default classifier (2: its config.json
# names no labels), a named 3-label classifier
CASES = {
    "llama-reward": ("llama", "LlamaForSequenceClassification", 1),
    "llama-2": ("llama", "LlamaForSequenceClassification", 2),
    "llama-3": ("llama", "LlamaForSequenceClassification", 3),
    "qwen3-reward": ("qwen3", "Qwen3ForSequenceClassification", 1),
    "qwen3-3": ("qwen3", "Qwen3ForSequenceClassification", 3),
}
OTHERS = {  # the other registered twins, one prompt each
    "mistral": ("mistral", "MistralForSequenceClassification", 3),
    "qwen2": ("qwen2", "Qwen2ForSequenceClassification", 1),
    "phi3": ("phi3", "Phi3ForSequenceClassification", 3),
    "gemma2": ("gemma2", "Gemma2ForSequenceClassification", 3),
    "gemma3": ("gemma3", "Gemma3TextForSequenceClassification", 3),
}


@pytest.fixture(scope="module")
def classifier(checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
               ) -> Callable[[str, str, int], Path]:
    """A *ForSequenceClassification checkpoint: the fixture model's backbone and a random score head of ``labels``
    outputs (drawn at a scale that gives logits of order 1), saved by transformers, with the fixture's tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    made: dict[tuple[str, str, int], Path] = {}

    def make(source: str, architecture: str, labels: int) -> Path:
        if (key := (source, architecture, labels)) in made:
            return made[key]
        src = checkpoint(source)
        config = AutoConfig.from_pretrained(src)
        config.architectures = [architecture]
        config.id2label = {i: NAMES[i] for i in range(labels)} if labels == 3 else None
        config.num_labels = labels
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(labels)
            model = AutoModelForSequenceClassification.from_pretrained(src, config=config, dtype=torch.float32)
            with torch.no_grad():
                model.score.weight.normal_(0, 0.5)
        assert type(model).__name__ == architecture
        out = tmp_path_factory.mktemp(architecture)
        model.save_pretrained(out)
        for file in src.iterdir():
            if file.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(file, out / file.name)
        made[key] = out
        return out

    return make


def hf_logits(path: Path, prompt: list[int]) -> list[float]:
    """transformers' AutoModelForSequenceClassification on the checkpoint: the reference."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().tolist()


def hf_references(path: Path, prompts: list[list[int]]) -> list[list[float]]:
    return [hf_logits(path, prompt) for prompt in prompts]


@pytest.mark.parametrize("case", CASES)
def test_each_prompts_logits_equal_transformers(classifier, case: str) -> None:
    path = classifier(*CASES[case])
    labels = CASES[case][2]
    want = hf_references(path, PROMPTS)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    assert engine.loaded.model.spec.num_labels == labels and not engine.loaded.model.spec.has_lm_head
    for prompt, expected in zip(PROMPTS, want):  # one request per forward pass, no padding anywhere
        out = engine.embed([prompt])[0]
        assert out.finished and [c.finish_reason for c in out.outputs] == [FinishReason.STOP]
        assert len(out.embedding) == labels
        assert out.embedding == pytest.approx(expected, abs=1e-5)
    assert engine.embeddings.live == 0 and engine.kv.stats().used_blocks == 0


def test_pads_that_end_a_prompt_are_not_pooled_as_transformers_pools(classifier, tmp_path: Path) -> None:
    """transformers pools the rightmost token that is not config.json's pad_token_id: prompts that end in pads (a
    reward model whose template closes with its pad token), with a pad inside too, and of pads alone score as there
    (another pooler reads the pads as tokens)."""
    folder = tmp_path / "padded"
    shutil.copytree(classifier(*CASES["llama-3"]), folder)
    config = json.loads((folder / "config.json").read_text())
    pad = config["pad_token_id"] = 7  # an ordinary token of the prompts below
    (folder / "config.json").write_text(json.dumps(config))
    prompts = [PROMPTS[0] + [pad] * 3, PROMPTS[1][:4] + [pad] + PROMPTS[1][4:] + [pad], [pad] * 4, PROMPTS[2]]
    engine = Engine(EngineConfig(model=str(folder), device="cpu", num_kv_blocks=64))
    outs = engine.embed(prompts)
    for prompt, out in zip(prompts, outs):
        assert out.embedding == pytest.approx(hf_logits(folder, prompt), abs=1e-5)
    assert [len(out.prompt_token_ids) for out in outs] == [len(PROMPTS[0]), len(PROMPTS[1]) + 1, 1, len(PROMPTS[2])]
    mean = engine.embed([prompts[0]], PoolingParams(pooling="mean"))[0]
    assert len(mean.prompt_token_ids) == len(prompts[0])


@pytest.mark.parametrize("case", OTHERS)
def test_every_registered_twin_computes_transformers_logits(classifier, case: str) -> None:
    path = classifier(*OTHERS[case])
    out = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64)).embed([PROMPTS[2]])[0]
    assert out.embedding == pytest.approx(hf_logits(path, PROMPTS[2]), abs=1e-5)


@pytest.mark.parametrize("case", ["llama-3", "qwen3-reward"])
def test_batched_and_chunked_requests_equal_transformers_beside_a_generating_engine(classifier, checkpoint,
                                                                                    hf_greedy, case: str) -> None:
    """Every prompt in the same steps (whole, and in 5-token chunks that split them across steps), each engine's
    steps interleaved with those of a generation engine on the fixture's causal model, whose tokens stay HF's."""
    path = classifier(*CASES[case])
    want = hf_references(path, PROMPTS)
    source = checkpoint(CASES[case][0])
    for options in ({}, {"scheduler": "chunked-prefill", "max_num_batched_tokens": 5}):
        engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, **options))
        generator = Engine(EngineConfig(model=str(source), device="cpu", num_kv_blocks=64))
        ids = [engine.add_request(prompt, PoolingParams()) for prompt in PROMPTS]
        generated = generator.add_request(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        outs, finished_at, tokens, step = {}, [], [], 0
        while engine.has_unfinished() or generator.has_unfinished():
            for out in engine.step():
                outs[out.request_id] = out
                finished_at.append(step)
                assert out.finished  # one output per embedding: when its prompt is done
            for out in generator.step():
                if out.request_id == generated:
                    tokens += out.outputs[0].token_ids
            step += 1
        # whole: every prompt in the first step; chunked: 5 tokens a step, in order, each done in the step that
        # computes its last token
        ends = [sum(map(len, PROMPTS[: i + 1])) for i in range(len(PROMPTS))]
        assert finished_at == ([-(-end // 5) - 1 for end in ends] if options else [0, 0, 0])
        for request_id, expected in zip(ids, want):
            assert outs[request_id].embedding == pytest.approx(expected, abs=1e-5)
        assert tokens == hf_greedy(source, PROMPTS[0], 6)


@pytest.mark.gpu
def test_logits_on_cuda_equal_transformers(classifier) -> None:
    """The CUDA defaults (triton attention, CUDA graphs, async scheduling), in float32: the logits stay on the
    device until the output reads them back."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    path = classifier(*CASES["qwen3-3"])
    engine = Engine(EngineConfig(model=str(path), device="cuda", dtype="float32", num_kv_blocks=64))
    for out, expected in zip(engine.embed(PROMPTS), hf_references(path, PROMPTS)):
        assert out.embedding == pytest.approx(expected, abs=1e-4)


def test_other_poolers_apply_the_head_to_their_vector(classifier) -> None:
    """pooling="mean" (not what HF computes): the score head over the mean of the final hidden states."""
    from transformers import AutoModelForSequenceClassification

    path = classifier(*CASES["llama-3"])
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    outs = engine.embed(PROMPTS[:2], PoolingParams(pooling="mean", normalize=False))
    for out, prompt in zip(outs, PROMPTS):
        with torch.no_grad():
            states = hf.model(torch.tensor([prompt])).last_hidden_state[0]
            want = hf.score(states.mean(0)).tolist()
        assert out.embedding == pytest.approx(want, abs=1e-5)


def test_generation_and_vector_options_are_refused(classifier) -> None:
    path = classifier(*CASES["qwen3-3"])
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    refused = r"^this checkpoint is a sequence classifier \(3 labels, no LM head\): send embedding requests"
    with pytest.raises(InvalidRequestError, match=refused):
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match=refused):
        engine.check_request(PROMPTS[0])
    for params in (PoolingParams(normalize=True), PoolingParams(dimensions=2), PoolingParams(dimensions=64)):
        with pytest.raises(InvalidRequestError, match="sequence classifier: its embedding is the label logits, "
                                                      "which are neither normalized nor cut"):
            engine.add_request(PROMPTS[0], params)
    assert not engine.has_unfinished()


CONFIGS = [  # config.json fields of the labels, as transformers' PretrainedConfig reads them
    {}, {"num_labels": 1}, {"num_labels": 5}, {"id2label": {"0": "a", "1": "b", "2": "c"}},
    {"id2label": {"0": "a", "1": "b"}, "num_labels": 2},
    {"id2label": {"0": "only"}, "num_labels": 3},  # num_labels wins, the names become LABEL_i (transformers warns)
    {"id2label": {"0": "a", "1": "b"}, "num_labels": 1},
    {"id2label": None, "num_labels": 4}, {"id2label": {"0": "a", "2": "c"}},
]


@pytest.mark.parametrize("fields", CONFIGS)
def test_the_labels_follow_transformers(fields: dict, tmp_path: Path) -> None:
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **fields}))
    reference = AutoConfig.from_pretrained(tmp_path)
    assert num_labels(fields) == reference.num_labels
    assert read_id2label(tmp_path) == {str(index): name for index, name in reference.id2label.items()}


@pytest.mark.parametrize("fields", [{"num_labels": 0}, {"num_labels": "3"}, {"id2label": ["a", "b"]},
                                    {"id2label": {}}, {"id2label": {"first": "a"}}])
def test_a_malformed_label_field_is_refused(fields: dict) -> None:
    with pytest.raises(CheckpointError, match="config.json has (num_labels|id2label) = "):
        num_labels(fields)


def test_infer_embed_prints_the_logits_and_the_labels(classifier) -> None:
    from click.testing import CliRunner
    from transformers import AutoTokenizer

    from infer.cli.main import main

    texts = ["def add(a, b):", "import os"]
    for case, labels in (("llama-3", {"0": "negative", "1": "neutral", "2": "positive"}), ("llama-reward", None)):
        path = classifier(*CASES[case])
        ids = [AutoTokenizer.from_pretrained(path)(text)["input_ids"] for text in texts]
        result = CliRunner().invoke(main, ["--model", str(path), "--device", "cpu", "--num-kv-blocks", "64", "embed",
                                           *texts])
        assert result.exit_code == 0, result.output
        lines = [json.loads(line) for line in result.stdout.splitlines()]
        assert [line["prompt_tokens"] for line in lines] == [len(i) for i in ids]
        for line, prompt in zip(lines, ids):
            assert line["embedding"] == pytest.approx(hf_logits(path, prompt), abs=1e-5)
            # a one-label reward model's config.json names LABEL_0, as transformers writes it
            assert line["labels"] == (labels or {"0": "LABEL_0"})
    refused = CliRunner().invoke(main, ["--model", str(classifier(*CASES["llama-2"])), "--device", "cpu", "embed",
                                        "--normalize", "x"])
    assert refused.exit_code != 0 and "neither normalized nor cut" in refused.output


def test_a_multimodal_gemma3_classifier_serves_its_text_model(checkpoint, tmp_path: Path) -> None:
    """Gemma3ForSequenceClassification (the multimodal model's: its text tensors under model.language_model.*, the
    vision tower left out), given text: transformers' logits."""
    from transformers import (Gemma3Config, Gemma3ForSequenceClassification, Gemma3TextConfig,
                              SiglipVisionConfig)

    text = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=1024, query_pre_attn_scalar=24,
                            sliding_window=8, sliding_window_pattern=2, max_position_embeddings=1024, pad_token_id=0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = Gemma3ForSequenceClassification(Gemma3Config(text_config=text, vision_config=vision,
                                                          mm_tokens_per_image=4, num_labels=3)).eval()
        with torch.no_grad():
            for name, param in hf.named_parameters():
                if "norm" in name or name == "score.weight":
                    param.normal_(0, 0.5)
    hf.save_pretrained(str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint("gemma3") / name, tmp_path / name)
    outs = Engine(EngineConfig(model=str(tmp_path), device="cpu", num_kv_blocks=64)).embed(PROMPTS)
    for out, prompt in zip(outs, PROMPTS):
        with torch.no_grad():
            want = hf(input_ids=torch.tensor([prompt])).logits[0].tolist()
        assert out.embedding == pytest.approx(want, abs=1e-5)


def test_a_classifier_that_ships_an_lm_head_stays_a_classifier(classifier, checkpoint, tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """An lm_head.weight beside the score head is ignored, as transformers ignores it; the load says what the
    model is, and warns of nothing (HF's own class for the model_type)."""
    import logging

    from safetensors.torch import load_file, save_file

    path = shutil.copytree(classifier(*CASES["llama-3"]), tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    head = load_file(str(checkpoint("llama") / "model.safetensors"))["lm_head.weight"]
    save_file({**tensors, "lm_head.weight": head}, str(path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="infer"):
        engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    assert "LlamaForSequenceClassification is a sequence classifier with 3 labels" in caplog.text
    assert not [r for r in caplog.records if r.name == "infer" and r.levelno >= logging.WARNING]
    assert not engine.loaded.model.spec.has_lm_head
    assert engine.embed([PROMPTS[1]])[0].embedding == pytest.approx(hf_logits(path, PROMPTS[1]), abs=1e-5)


def test_the_servers_model_info_says_a_classifier_serves_embed_alone_and_names_its_labels(classifier,
                                                                                          tiny_model) -> None:
    """GetModelInfo's answer (read once before the server's worker starts): `generates` and `labels`."""
    from infer.server.app import describe_engine

    engine = Engine(EngineConfig(model=str(classifier(*CASES["llama-3"])), device="cpu", num_kv_blocks=16))
    info = describe_engine(engine)
    assert (info.generates, list(info.labels)) == (False, ["negative", "neutral", "positive"])
    reward = describe_engine(Engine(EngineConfig(model=str(classifier(*CASES["llama-reward"])), device="cpu",
                                                 num_kv_blocks=16)))
    assert (reward.generates, list(reward.labels)) == (False, ["LABEL_0"])
    plain = describe_engine(Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=16)))
    assert (plain.generates, list(plain.labels)) == (True, [])


@pytest.mark.parametrize("pooling", [PoolingParams(), PoolingParams(pooling="mean")])
def test_the_bench_hf_arm_scores_a_classifier_as_the_engine_does(classifier, pooling: PoolingParams) -> None:
    """`infer bench --task embed` on a classifier: the HF arm (padded batches of 2, right padding and the mask)
    gives the engine's label logits, not its backbone's hidden states."""
    from infer.bench.arms import ArmSpec, parse_arms
    from infer.bench.hf import HFArm
    from infer.bench.runner import EngineArm
    from infer.bench.session import make_workloads
    from infer.bench.workloads import WorkloadSpec
    from infer.cli.options import EngineArgs
    from infer.core.plugins import PluginManager

    path = classifier(*CASES["llama-3"])
    [spec] = parse_arms([], EngineArgs.from_kwargs({"model": str(path), "device": "cpu", "num_kv_blocks": 64}))
    infer_arm = EngineArm(spec, PluginManager.from_entry_points(), "embed")
    hf_arm = HFArm(ArmSpec("B", "hf", hf_mode="static"), path, 2, "cpu", "float32", task="embed")
    work = WorkloadSpec("random", num_requests=5, input_len=14, len_sigma=0.6, task="embed", pooling=pooling)
    [round_] = make_workloads(work, range(1), [infer_arm, hf_arm], None)
    mine, theirs = infer_arm.run(round_, lambda: None), hf_arm.run(round_, lambda: None)
    for a, b in zip(mine.requests, theirs.requests):
        assert len(a.embedding) == len(b.embedding) == 3
        assert b.embedding == pytest.approx(a.embedding, abs=1e-4)
    with pytest.raises(InvalidRequestError, match="neither normalized nor cut"):
        hf_arm.check_embedding([5, 6], PoolingParams(dimensions=2))
