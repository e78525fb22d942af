"""The `quantize` command: calibrated AWQ (quant/calibrate.py) written as an AutoAWQ GEMM checkpoint, or GPTQ
(quant/gptq_calibrate.py) written as a GPTQ one."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click

from ..core.hookspecs import CommandFactory, hookimpl
from ..core.registry import Register


@click.command("quantize")
@click.argument("model", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--method", type=click.Choice(["awq", "gptq"]), default="awq", show_default=True,
              help="Quantization method: awq (activation-aware scales, then round-to-nearest; fp16 group scales and "
                   "zero points; an AutoAWQ GEMM checkpoint) or gptq (each column's rounding error spread over the "
                   "columns after it; fp16 group scales, symmetric or not; a GPTQ checkpoint).")
@click.option("--calib", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Calibration text: one text per line, or JSONL ({\"text\": ...} per line) [default: the Python "
                   "standard library's sources].")
@click.option("--group-size", type=int, default=None,
              help="Input rows per scale: 32, 64, 128 or -1 (one group over the whole input) [default: the "
                   "largest of 128, 64, 32 that divides every layer's input size, else -1].")
@click.option("--bits", type=int, default=4, show_default=True,
              help="Weight bits: 4 (awq, gptq) or 8 (gptq; run by the W8A16 kernels).")
@click.option("--num-samples", type=int, default=64, show_default=True, help="Calibration samples.")
@click.option("--seq-len", type=int, default=512, show_default=True, help="Tokens per calibration sample.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--act-order/--no-act-order", default=None,
              help="gptq: quantize each layer's columns by decreasing activation energy (desc_act), usually more "
                   "accurate; the layer's input is then permuted at run time [default: off].")
@click.option("--damp", type=float, default=None,
              help="gptq: dampening added to the Hessian's diagonal, as a fraction of its mean [default: 0.01].")
@click.option("--clip/--no-clip", default=None,
              help="awq: clamp each group of weights to the range that lowers its output error on the calibration "
                   "rows, as AutoAWQ does (q_proj and k_proj excepted) [default: --clip].")
@click.option("--duo-scaling/--no-duo-scaling", default=None,
              help="awq: search scales from the activations and the weights, x^a / w^(1 - a), as AutoAWQ and "
                   "llm-compressor do, else from the activations alone, x^a [default: --duo-scaling].")
@click.option("--sym/--asym", default=None,
              help="gptq: symmetric groups (one fixed zero point) or each group's own zero point, usually a little "
                   "more accurate [default: --sym].")
@click.pass_context
def quantize(ctx: click.Context, model: Path, out: Path, method: str, calib: Path | None, group_size: int | None,
             bits: int, num_samples: int, seq_len: int, device: str, act_order: bool | None,
             damp: float | None, clip: bool | None, duo_scaling: bool | None, sym: bool | None) -> None:
    """Quantize the unquantized checkpoint MODEL with calibrated AWQ or GPTQ and write it to OUT (a new folder).

    OUT is an AutoAWQ GEMM checkpoint (awq) or a GPTQ one (gptq: v1 format, 4 or 8 bits, symmetric or not), with its
    config.json quantization_config and MODEL's tokenizer files, that infer and other loaders read:
    `infer --model OUT generate ...`.
    """
    from ..cli.options import refuse_engine_options
    from ..quant.calib_data import read_texts
    from ..quant.calib_job import check_request
    from ..quant.calibrate import AwqCalibrationConfig, calibrate_awq
    from ..quant.gptq_calibrate import GptqCalibrationConfig, calibrate_gptq

    refuse_engine_options(ctx, "quantize", " (it takes its own --device, after the command: infer quantize MODEL "
                          "OUT --device cuda)")
    gptq_only = (("--act-order", act_order), ("--damp", damp), ("--sym/--asym", sym))
    if method != "gptq" and (given := [name for name, value in gptq_only if value is not None]):
        raise click.UsageError(f"{' and '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --method gptq only")
    awq_only = (("--clip/--no-clip", clip), ("--duo-scaling/--no-duo-scaling", duo_scaling))
    if method != "awq" and (given := [name for name, value in awq_only if value is not None]):
        raise click.UsageError(f"{' and '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --method awq only")
    common = dict(group_size=group_size, bits=bits, num_samples=num_samples, seq_len=seq_len, device=device)
    config: AwqCalibrationConfig | GptqCalibrationConfig = \
        AwqCalibrationConfig(**common, clip=clip is not False, duo_scaling=duo_scaling is not False) \
        if method == "awq" else \
        GptqCalibrationConfig(**common, act_order=bool(act_order), damp=0.01 if damp is None else damp,
                              sym=sym is not False)
    _, config = check_request(model, out, config)  # every bad-input check before the model loads
    texts = read_texts(calib) if calib is not None else None
    with _ProgressBar() as progress:  # errors: the group prints them (a ConfigError as a usage error)
        if isinstance(config, GptqCalibrationConfig):
            _print_gptq_summary(calibrate_gptq(model, out, config, texts, progress))
        else:
            _print_summary(calibrate_awq(model, out, config, texts, progress))
    click.echo(f"wrote the {method.upper()} checkpoint {out} (int{config.bits}, group {config.group_size}); run it "
               f"with `infer --model {out} generate ...`")


class _ProgressBar:
    """A rich progress bar on stderr with one task per calibration phase; called as ``(phase, done, total)``."""

    def __enter__(self) -> _ProgressBar:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(stderr=True))
        self.tasks: dict[str, Any] = {}
        self.progress.__enter__()
        return self

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase not in self.tasks:
            self.tasks[phase] = self.progress.add_task(phase, total=total)
        self.progress.update(self.tasks[phase], completed=done, total=total)

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)  # type: ignore[arg-type]


def _print_summary(reports: list[Any]) -> None:
    """One row per linear group: the mean alpha chosen (and how many kept plain RTN, no alpha beating it) and the
    output error relative to plain RTN, with the scales alone and, where weights were clipped, as written."""
    from rich.console import Console
    from rich.table import Table

    clipped = all(r.clipped_error is not None for r in reports)
    table = Table("group", "mean alpha", "error / RTN error", *(("clipped / RTN error",) if clipped else ()),
                  title="AWQ scale search (calibration rows)")
    for name in dict.fromkeys(r.group for r in reports):
        rows = [r for r in reports if r.group == name]
        rtn = max(sum(r.rtn_error for r in rows), 1e-30)
        written = (f"{sum(r.clipped_error for r in rows) / rtn:.3f}",) if clipped else ()
        alphas = [r.alpha for r in rows if r.alpha is not None]  # None: plain RTN kept
        alpha = (f"{sum(alphas) / len(alphas):.2f}" if alphas else "-") + \
            (f" ({len(rows) - len(alphas)} RTN)" if len(alphas) < len(rows) else "")
        table.add_row(name, alpha, f"{sum(r.error for r in rows) / rtn:.3f}", *written)
    Console(stderr=True).print(table)


def gptq_summary(reports: list[Any]) -> list[tuple[str, float, float]]:
    """Per linear kind (a mixture's experts' projections as one kind, ``experts.*``): the mean over layers (and
    experts) of GPTQ's relative output error on the calibration inputs, and RTN's."""
    kinds: dict[str, list[Any]] = {}
    for r in reports:
        kinds.setdefault(re.sub(r"\.experts\.\d+\.", ".experts.*.", r.linear), []).append(r)
    return [(kind, sum(r.error for r in rows) / len(rows), sum(r.rtn_error for r in rows) / len(rows))
            for kind, rows in kinds.items()]


def _print_gptq_summary(reports: list[Any]) -> None:
    """One row per linear kind: GPTQ's output error on the calibration inputs, relative to the output, and RTN's."""
    from rich.console import Console
    from rich.table import Table

    table = Table("linear", "GPTQ error", "RTN error", "GPTQ / RTN", title="GPTQ (relative output error on the "
                  "calibration inputs, mean over layers and experts)")
    for kind, error, rtn in gptq_summary(reports):
        table.add_row(kind, f"{error:.2e}", f"{rtn:.2e}", f"{error / max(rtn, 1e-30):.3f}")
    Console(stderr=True).print(table)


def quantize_command() -> click.Command:
    return quantize


@hookimpl
def register_commands(register: Register[CommandFactory]) -> None:
    register("quantize", quantize_command)
