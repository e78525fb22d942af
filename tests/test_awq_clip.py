"""AWQ's weight clipping (quant/awq_clip.py): per (output row, input group), the clamp of the grid that gives that
group's partial output the least error on the calibration rows, checked against a direct loop over the grid, and
what it does to a model (``infer quantize --method awq --clip/--no-clip``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from infer.cli.main import main
from infer.quant import awq
from infer.quant.awq_clip import clip_, clips, quantized_error, search_clip


def partial_error(x: torch.Tensor, w: torch.Tensor, m: float, row: int, group: int, size: int) -> float:
    """One (row, group)'s error by the docstring's formula, for clamp ``m``: the row quantized whole with that group
    clamped (RTN works group by group, so the other groups do not matter)."""
    cols = slice(group * size, (group + 1) * size)
    clamped = w[row: row + 1].repeat(8, 1)  # RTN takes 8 rows at least (AWQ packs 8 outputs)
    clamped[:, cols] = clamped[:, cols].clamp(-m, m)
    quantized = awq.fake_quantize_rtn(clamped, size)
    return float((x[:, cols] @ (quantized[0, cols] - w[row, cols])).pow(2).mean())


def test_each_group_gets_the_grid_clamp_of_least_error() -> None:
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(96, 64, generator=g), torch.randn(24, 64, generator=g)
    w[3, 5], x[:, 5] = 9.0, x[:, 5] * 0.01  # an outlier weight on a quiet input: its group's range is wasted on it
    m = search_clip(x, w, 32, max_elements=96 * 2 * 8)  # output rows in chunks of 8 (96 rows, 2 groups)
    assert m.shape == (24, 2)
    for row in range(24):
        for group in range(2):
            full = float(w[row, group * 32:(group + 1) * 32].abs().max())
            grid = [full * (1 - i / 20) for i in range(10)]
            errors = [partial_error(x, w, c, row, group, 32) for c in grid]
            assert float(m[row, group]) == pytest.approx(grid[errors.index(min(errors))], rel=1e-6), (row, group)
    assert float(m[3, 0]) < 9.0  # the outlier is clipped


def test_a_tie_keeps_the_least_clipping() -> None:
    """Where clamps tie on error (here a group whose calibration inputs are all zero: every clamp errs 0), the first
    of the grid wins, as in AutoAWQ's strict ``err < min_errs``: the weight stays as it is."""
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(64, 64, generator=g), torch.randn(8, 64, generator=g)
    x[:, 32:] = 0
    m = search_clip(x, w, 32)
    assert torch.equal(m[:, 1], w[:, 32:].abs().amax(dim=-1))


def test_clipping_never_raises_a_groups_error_and_clamps_in_place() -> None:
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(64, 128, generator=g), torch.randn(16, 128, generator=g) ** 3  # heavy tails
    m = search_clip(x, w, 64)
    clipped = w.clone()
    clip_(clipped, m, 64)
    bound = m.repeat_interleave(64, 1)
    assert torch.equal(clipped, torch.maximum(torch.minimum(w, bound), -bound))
    assert (clipped != w).any()
    for row in range(16):
        for group in range(2):
            cols = slice(group * 64, (group + 1) * 64)
            def error(weight: torch.Tensor) -> float:
                q = awq.fake_quantize_rtn(weight, 64)[row, cols]
                return float((x[:, cols] @ (q - w[row, cols])).pow(2).mean())
            assert error(clipped) <= error(w) * (1 + 1e-6)
    assert quantized_error([(x, w, clipped)], 64) < quantized_error([(x, w, w)], 64)


def test_q_and_k_are_not_clipped() -> None:
    assert not clips("self_attn.q_proj") and not clips("self_attn.k_proj") and not clips("self_attn.qkv_proj")
    assert clips("self_attn.v_proj") and clips("mlp.down_proj") and clips("mlp.shared_expert.up_proj")


def test_the_written_error_without_clipping_is_the_searchs_error() -> None:
    """quantized_error on the folded weights and rows (W * s, x / s) is the search's error at its alpha: the same
    output difference, so the report's clipped_error compares with error and rtn_error."""
    from infer.quant.calibrate import search_scale

    g = torch.Generator().manual_seed(9)
    stat = torch.rand(64, generator=g) * 3 + 0.1
    x, w = torch.randn(80, 64, generator=g) * stat, torch.randn(24, 64, generator=g)
    found = search_scale(x, stat, [w], 32, grid=8)
    s = found.scales
    assert quantized_error([(x / s, w * s, w * s)], 32) == pytest.approx(found.error, rel=1e-4)


def test_quantize_clips_by_default_and_reports_it(tiny_model: Path, tmp_path: Path) -> None:
    common = [str(tiny_model), "--num-samples", "4", "--seq-len", "32", "--device", "cpu", "--group-size", "32"]
    clipped = CliRunner().invoke(main, ["quantize", common[0], str(tmp_path / "a"), *common[1:]])
    assert clipped.exit_code == 0, clipped.output
    assert "clipped / RTN error" in clipped.output
    groups = json.loads((tmp_path / "a" / "awq_calibration.json").read_text())["groups"]
    assert all(r["clipped_error"] is not None for r in groups)
    assert sum(r["clipped_error"] for r in groups) < sum(r["error"] for r in groups)
    plain = CliRunner().invoke(main, ["quantize", common[0], str(tmp_path / "b"), "--no-clip", *common[1:]])
    assert plain.exit_code == 0, plain.output
    assert "clipped / RTN error" not in plain.output
    report = json.loads((tmp_path / "b" / "awq_calibration.json").read_text())
    assert report["options"]["clip"] is False and all(r["clipped_error"] is None for r in report["groups"])
    refused = CliRunner().invoke(main, ["quantize", common[0], str(tmp_path / "c"), "--method", "gptq", "--clip",
                                        *common[1:]])
    assert refused.exit_code == 2 and "--clip/--no-clip applies to --method awq only" in refused.output


def test_duo_scaling_takes_the_best_of_the_documented_candidates_or_keeps_rtn() -> None:
    """With duo scaling each alpha's scales are x^a / (w^(1 - a) + 1e-4), w per input the mean over the rows of |w|
    over its group's largest |w| (AutoAWQ's w_mean, computed here from that definition), normalised as without;
    plain RTN is the baseline, kept with alpha None when no candidate beats it."""
    from infer.quant.calibrate import search_scale

    g = torch.Generator().manual_seed(11)
    x = torch.randn(200, 64, generator=g)
    x[:, [3, 30]] *= 15
    weights = [torch.randn(16, 64, generator=g), torch.randn(8, 64, generator=g)]
    stat = x.abs().mean(dim=0)
    found = search_scale(x, stat, weights, 32, grid=10, duo=True)
    w = torch.cat(weights).abs()
    w_mean = torch.stack([w[:, i] / w[:, (i // 32) * 32:(i // 32 + 1) * 32].amax(dim=1) for i in range(64)], 1).mean(0)

    def candidate(alpha: float) -> torch.Tensor:
        s = (stat.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        return s / (s.max() * s.min()).sqrt()

    def error(s: torch.Tensor) -> float:
        full = torch.cat(weights)
        return float((x @ (awq.fake_quantize_rtn(full * s, 32) / s).t() - x @ full.t()).pow(2).mean())

    errors = {i / 10: error(candidate(i / 10)) for i in range(11)}
    best = min(errors, key=errors.get)
    assert found.alpha == best and torch.allclose(found.scales, candidate(best), rtol=1e-4)
    assert found.error == pytest.approx(errors[best], rel=1e-4) and found.error < found.rtn_error
    on_grid = torch.randint(0, 16, (16, 64), generator=g).float()
    on_grid[:, ::32], on_grid[:, 1::32] = 0, 15  # every group spans 0..15: RTN at scale 1/8 is exact ...
    kept = search_scale(torch.randn(200, 64, generator=g), stat, [on_grid / 8], 32, grid=10, duo=True)
    # ... so every candidate, none of them s = 1 (the weights' w and the stat vary by channel), does worse
    assert kept.alpha is None and torch.equal(kept.scales, torch.ones(64)) and kept.error == kept.rtn_error


def test_duo_scaling_is_on_by_default_and_a_flag_of_awq(tiny_model: Path, tmp_path: Path) -> None:
    common = [str(tiny_model), "--num-samples", "4", "--seq-len", "32", "--device", "cpu", "--group-size", "32"]
    result = CliRunner().invoke(main, ["quantize", common[0], str(tmp_path / "a"), "--no-duo-scaling", "--no-clip",
                                       *common[1:]])
    assert result.exit_code == 0, result.output
    options = json.loads((tmp_path / "a" / "awq_calibration.json").read_text())["options"]
    assert options["duo_scaling"] is False and options["clip"] is False
    from infer.quant.calibrate import AwqCalibrationConfig

    assert AwqCalibrationConfig().duo_scaling is True
    refused = CliRunner().invoke(main, ["quantize", common[0], str(tmp_path / "b"), "--method", "gptq",
                                        "--no-duo-scaling", *common[1:]])
    assert refused.exit_code == 2 and "--duo-scaling/--no-duo-scaling applies to --method awq only" in refused.output


def test_without_duo_scaling_a_kept_rtn_reports_alpha_0() -> None:
    """Without duo scaling alpha 0 is s = 1, plain RTN itself: the tie goes to alpha 0 (None is duo's RTN)."""
    from infer.quant.calibrate import search_scale

    g = torch.Generator().manual_seed(5)
    on_grid = torch.randint(0, 16, (16, 64), generator=g).float()
    on_grid[:, ::32], on_grid[:, 1::32] = 0, 15  # RTN at scale 1/8 is exact: no alpha above 0 beats it
    x = torch.randn(200, 64, generator=g)
    kept = search_scale(x, x.abs().mean(dim=0), [on_grid / 8], 32, grid=10)
    assert kept.alpha == 0 and torch.equal(kept.scales, torch.ones(64)) and kept.error == kept.rtn_error


def test_the_error_through_a_head_is_measured_on_its_outputs() -> None:
    """With ``head``, quantized_error is the mean squared difference of ``head`` of the RTN-quantized parts' outputs,
    side by side, and ``head`` of the reference weights' outputs (the docstring's formula, computed here)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(40, 64, generator=g)
    references = [torch.randn(16, 64, generator=g) for _ in range(2)]
    weights = [w.clamp(-1.5, 1.5) for w in references]  # clipped copies, as written

    def head(y: torch.Tensor) -> torch.Tensor:
        gate, up = y.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    ours = head(torch.cat([x @ awq.fake_quantize_rtn(w, 32).t() for w in weights], dim=-1))
    theirs = head(torch.cat([x @ w.t() for w in references], dim=-1))
    expected = float((ours - theirs).pow(2).mean())
    parts = [(x, reference, weight) for reference, weight in zip(references, weights, strict=True)]
    assert quantized_error(parts, 32, head) == pytest.approx(expected, rel=1e-5)


def test_quantize_leaves_q_and_k_unclipped(tiny_model: Path, tmp_path: Path) -> None:
    """As AutoAWQ's auto_clip (which skips q and k): the written q_proj and k_proj (or fused qkv_proj) tensors are
    those of the same calibration without clipping, while some clipped linear's differ."""
    from safetensors.torch import load_file

    common = [str(tiny_model), "--num-samples", "4", "--seq-len", "32", "--device", "cpu", "--group-size", "32"]
    written = {}
    for folder, flags in (("a", []), ("b", ["--no-clip"])):
        result = CliRunner().invoke(main, ["quantize", common[0], str(tmp_path / folder), *flags, *common[1:]])
        assert result.exit_code == 0, result.output
        files = sorted((tmp_path / folder).glob("*.safetensors"))
        written[folder] = {k: v for f in files for k, v in load_file(f).items()}
    unclipped = [k for k in written["a"] if any(f".{n}." in k for n in ("q_proj", "k_proj", "qkv_proj"))]
    assert unclipped and all(torch.equal(written["a"][k], written["b"][k]) for k in unclipped)
    assert any(not torch.equal(written["a"][k], written["b"][k]) for k in written["a"] if ".mlp." in k)
