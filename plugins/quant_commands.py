"""The `quantize` command: calibrated AWQ (quant/calibrate.py) written as an AutoAWQ GEMM checkpoint."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..core.hookspecs import CommandFactory, hookimpl
from ..core.registry import Register


@click.command("quantize")
@click.argument("model", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--method", type=click.Choice(["awq"]), default="awq", show_default=True,
              help="Quantization method (AWQ: int4 weights, fp16 group scales and zero points).")
@click.option("--calib", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Calibration text: one text per line, or JSONL ({\"text\": ...} per line) [default: the Python "
                   "standard library's sources].")
@click.option("--group-size", type=int, default=None,
              help="Input rows per scale: 32, 64, 128 or -1 (one group over the whole input) [default: the "
                   "largest of 128, 64, 32 that divides every layer's input size, else -1].")
@click.option("--bits", type=int, default=4, show_default=True, help="Weight bits (AWQ GEMM supports 4).")
@click.option("--num-samples", type=int, default=64, show_default=True, help="Calibration samples.")
@click.option("--seq-len", type=int, default=512, show_default=True, help="Tokens per calibration sample.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.pass_context
def quantize(ctx: click.Context, model: Path, out: Path, method: str, calib: Path | None, group_size: int | None,
             bits: int, num_samples: int, seq_len: int, device: str) -> None:
    """Quantize the unquantized checkpoint MODEL with calibrated AWQ and write it to OUT (a new folder).

    OUT is an AutoAWQ GEMM checkpoint (config.json quantization_config, tokenizer files copied) that infer and
    other AWQ loaders read: `infer --model OUT generate ...`.
    """
    from ..cli.options import refuse_engine_options
    from ..quant.calibrate import AwqCalibrationConfig, calibrate_awq, check_request
    from ..quant.calib_data import read_texts

    refuse_engine_options(ctx, "quantize", " (it takes its own --device, after the command: infer quantize MODEL "
                          "OUT --device cuda)")

    config = AwqCalibrationConfig(group_size=group_size, bits=bits, num_samples=num_samples, seq_len=seq_len,
                                  device=device)
    _, config = check_request(model, out, config)  # every bad-input check before the model loads
    texts = read_texts(calib) if calib is not None else None
    with _ProgressBar() as progress:  # errors: the group prints them (a ConfigError as a usage error)
        reports = calibrate_awq(model, out, config, texts, progress)
    _print_summary(reports)
    click.echo(f"wrote the AWQ checkpoint {out} (int4, group {config.group_size}); run it with `infer --model {out} "
               "generate ...`")


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
    """One row per linear group: the mean alpha chosen and the output error relative to plain RTN."""
    from rich.console import Console
    from rich.table import Table

    table = Table("group", "mean alpha", "error / RTN error", title="AWQ scale search (calibration rows)")
    for name in dict.fromkeys(r.group for r in reports):
        rows = [r for r in reports if r.group == name]
        ratio = sum(r.error for r in rows) / max(sum(r.rtn_error for r in rows), 1e-30)
        table.add_row(name, f"{sum(r.alpha for r in rows) / len(rows):.2f}", f"{ratio:.3f}")
    Console(stderr=True).print(table)


def quantize_command() -> click.Command:
    return quantize


@hookimpl
def register_commands(register: Register[CommandFactory]) -> None:
    register("quantize", quantize_command)
