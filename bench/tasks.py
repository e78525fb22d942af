"""``infer bench --task``: which options each task takes, checked before any model loads (exit status 2)."""
from __future__ import annotations

import click
from click.core import ParameterSource

from ..cli.options import SAMPLING_DEFAULTS, sampling_option
from ..core.pooling import PoolingParams
from .arms import ArmSpec
from .hf_embed import HF_POOLERS
from .workloads import FileEntry

GENERATION_ONLY = ("output_len", *SAMPLING_DEFAULTS, "sampling_seed")  # bench parameters an embedding ignores
EXPLICIT = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


def task_pooling(ctx: click.Context, task: str, pooling: str | None, dimensions: int | None,
                 normalize: bool | None, specs: list[ArmSpec]) -> PoolingParams:
    """The embedding requests' PoolingParams of ``--task embed`` (defaults under ``--task generate``, whose file
    lines may embed). Refuses the embedding options with --task generate, the generation options given explicitly
    with --task embed, and an HF arm that cannot compute the embeddings."""
    from ..cli.main import option_error
    from ..core.errors import InvalidRequestError

    if task == "generate":
        given = [name for name, value in (("--pooling", pooling), ("--dimensions", dimensions),
                                          ("--normalize/--no-normalize", normalize)) if value is not None]
        if given:
            raise click.UsageError(f"{', '.join(given)} shape embedding requests: add --task embed (or give a "
                                   "--workload file line \"embed\": {\"pooling\": ..., \"dimensions\": ...})")
        return PoolingParams()
    if given := [_option_name(ctx, name) for name in GENERATION_ONLY if ctx.get_parameter_source(name) in EXPLICIT]:
        raise click.UsageError(f"--task embed: {', '.join(given)} apply to generated tokens, and an embedding "
                               "request generates none (it ends when its prompt is computed); drop them")
    try:
        params = PoolingParams(pooling, normalize, dimensions)
    except InvalidRequestError as exc:
        raise option_error(exc, ctx) from None
    check_hf_embeddings(specs, "--task embed")
    if params.pooling is not None and params.pooling not in HF_POOLERS and any(spec.is_hf for spec in specs):
        raise click.UsageError(f"the HF baseline pools {' or '.join(HF_POOLERS)} only, not {params.pooling!r}: drop "
                               "the hf arms or pass --pooling last or mean")
    if params.pooling is not None and any(spec.is_openai for spec in specs):
        raise click.UsageError(f"OpenAI's /embeddings cannot choose a pooler ({params.pooling!r}): a server pools as "
                               "its model says; drop --pooling or the openai arms")
    return params


def check_hf_embeddings(specs: list[ArmSpec], why: str) -> None:
    """Refuse hf:cb beside embedding requests: transformers' continuous batching only generates."""
    if cb := [spec.text for spec in specs if spec.hf_mode == "cb"]:
        raise click.UsageError(f"{why}: transformers' continuous batching ({', '.join(cb)}) generates and does not "
                               "embed; use the hf arm (padded AutoModel batches) for embedding requests")


def check_embedding_lines(entries: list[FileEntry], specs: list[ArmSpec]) -> None:
    """A file whose lines embed refuses hf:cb (a pooler the HF baseline lacks is a bad line, once it loads)."""
    if embedding := [entry for entry in entries if entry.pooling is not None]:
        check_hf_embeddings(specs, f"line {embedding[0].line} of the file is an embedding request")


def _option_name(ctx: click.Context, name: str) -> str:
    if name in SAMPLING_DEFAULTS:
        return sampling_option(name)
    return next(param.opts[0] for param in ctx.command.params if param.name == name)
