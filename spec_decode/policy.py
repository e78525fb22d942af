"""Graceful degradation: turn speculation off for a step when it no longer pays.

Two rules, both off by default (``EngineConfig.plugin_options["spec_decode"]`` keys ``min_acceptance`` and
``max_batch_size``; CLI ``--spec-min-acceptance`` and ``--spec-max-batch-size``):
- the batch is large: a step that runs more than ``max_batch_size`` sequences is compute-bound already, and the
  K extra positions per sequence cost more than the tokens they save;
- acceptance is low: while the recent acceptance rate (an exponential moving average over verified steps) is below
  ``min_acceptance``, speculation stays off except for one probe step every ``probe_every`` steps, which keeps the
  estimate fresh so that speculation comes back when the text becomes predictable again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.errors import ConfigError

ON = "on"
OFF_BATCH = "off-large-batch"
OFF_ACCEPTANCE = "off-low-acceptance"
STATES = (ON, OFF_BATCH, OFF_ACCEPTANCE)


@dataclass
class SpecPolicy:
    min_acceptance: float = 0.0  # 0 disables the rule
    max_batch_size: int = 0  # 0 disables the rule
    probe_every: int = 8
    smoothing: float = 0.2  # weight of the newest step in the moving average
    warmup_rounds: int = 8  # verified sequence-rounds before the acceptance rule may act
    acceptance: float | None = None  # the moving average; None until a step verified drafts
    rounds: int = 0
    _since_probe: int = 0

    @classmethod
    def from_options(cls, plugin_options: dict[str, Any]) -> SpecPolicy:
        """Read ``min_acceptance``, ``max_batch_size`` and ``probe_every`` from ``plugin_options["spec_decode"]``."""
        options = plugin_options.get("spec_decode", {}) if isinstance(plugin_options, dict) else {}
        min_acc = options.get("min_acceptance", 0.0)
        max_batch = options.get("max_batch_size", 0)
        probe_every = options.get("probe_every", 8)
        if not isinstance(min_acc, (int, float)) or isinstance(min_acc, bool) or not 0.0 <= min_acc <= 1.0:
            raise ConfigError(f"spec-min-acceptance must be a number in [0, 1] (0 disables it), got {min_acc!r}")
        if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 0:
            raise ConfigError(f"spec-max-batch-size must be an integer >= 0 (0 disables it), got {max_batch!r}")
        if not isinstance(probe_every, int) or isinstance(probe_every, bool) or probe_every < 1:
            raise ConfigError(f"spec_decode probe_every must be a positive integer, got {probe_every!r}")
        return cls(float(min_acc), max_batch, probe_every)

    def decide(self, num_seqs: int) -> str:
        """The state of this step: ON, OFF_BATCH or OFF_ACCEPTANCE."""
        if self.max_batch_size and num_seqs > self.max_batch_size:
            return OFF_BATCH
        low = (self.min_acceptance > 0 and self.acceptance is not None and self.rounds >= self.warmup_rounds
               and self.acceptance < self.min_acceptance)
        if not low:
            self._since_probe = 0
            return ON
        self._since_probe += 1
        if self._since_probe >= self.probe_every:
            self._since_probe = 0
            return ON  # a probe
        return OFF_ACCEPTANCE

    def observe(self, proposed: int, accepted: int, rounds: int) -> None:
        """Feed one step's verification: drafts proposed and accepted over ``rounds`` sequences."""
        if proposed == 0:
            return
        rate = accepted / proposed
        self.acceptance = rate if self.acceptance is None else (
            self.smoothing * rate + (1 - self.smoothing) * self.acceptance)
        self.rounds += rounds
