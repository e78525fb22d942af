"""Sequence classifiers (HF's ``*ForSequenceClassification``: reward models, classifiers): how many labels their
score head has and what config.json names them, read as transformers' PretrainedConfig reads them. The model maps a
pooled hidden state to the label logits (``Model.label_logits``); embedding requests return them (core/pooling.py)."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from .errors import CheckpointError

log = logging.getLogger("infer")
DEFAULT_NUM_LABELS = 2  # PretrainedConfig's, when config.json has neither id2label nor num_labels


def id2label(raw: dict[str, Any]) -> dict[int, str]:
    """The labels of config.json ``raw`` (index -> name), as transformers' PretrainedConfig reads them: ``num_labels``
    where given (``id2label`` kept only if it has that many entries, else LABEL_0, LABEL_1...), else ``id2label``,
    else two labels. CheckpointError for a field of the wrong type, or no label at all."""
    named, count = raw.get("id2label"), raw.get("num_labels")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise CheckpointError(f"config.json has num_labels = {count!r}; it should be a positive integer, the score "
                              "head's number of outputs (or leave it out and list the labels in id2label)")
    if named is not None:
        try:
            if not isinstance(named, dict) or not named:
                raise ValueError("not a non-empty object")
            named = {int(index): str(name) for index, name in named.items()}
        except ValueError:
            raise CheckpointError(f"config.json has id2label = {named!r}; it should be an object mapping each label's "
                                  'index to its name, e.g. {"0": "negative", "1": "positive"}') from None
    if count is None and named is None:
        count = DEFAULT_NUM_LABELS
    if count is not None and (named is None or len(named) != count):
        if named is not None:
            log.warning("config.json has num_labels %d but %d labels in id2label: the score head has %d outputs, "
                        "named LABEL_0... (as transformers reads it)", count, len(named), count)
        named = {index: f"LABEL_{index}" for index in range(count)}
    return named


def num_labels(raw: dict[str, Any]) -> int:
    """The number of outputs of the score head of config.json ``raw`` (``id2label``'s rule)."""
    return len(id2label(raw))


def read_pad_token_id(folder: str | os.PathLike[str]) -> int | None:
    """``folder``'s config.json ``pad_token_id`` (its text config's, for a multimodal one), which a classifier's
    pooling skips at the prompt's end as transformers does; None when it has none (or no readable config)."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    text = raw.get("text_config", raw) if isinstance(raw, dict) else None
    pad = text.get("pad_token_id") if isinstance(text, dict) else None
    return pad if isinstance(pad, int) and not isinstance(pad, bool) else None


def without_trailing_pads(ids: list[int], pad_token_id: int | None) -> list[int]:
    """The prompt a classifier pools at its last token: transformers pools the rightmost token that is not
    ``pad_token_id`` (the first, if all are), and with causal attention that token's hidden state does not depend
    on the pads after it, so they are left out."""
    end = len(ids)
    while pad_token_id is not None and end > 1 and ids[end - 1] == pad_token_id:
        end -= 1
    return ids[:end]


def read_id2label(folder: Path) -> dict[str, str] | None:
    """``folder``'s config.json labels (``id2label``'s rule; the index as a string, as JSON has it); None for a
    folder without a readable config.json (a plugin model's)."""
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return {str(index): name for index, name in id2label(raw).items()} if isinstance(raw, dict) else None
