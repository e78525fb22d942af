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
from typing import TYPE_CHECKING

from ..core.plugin_options import PluginOption, read_plugin_options

if TYPE_CHECKING:
    from ..core.config import EngineConfig

ON = "on"
OFF_BATCH = "off-large-batch"
OFF_ACCEPTANCE = "off-low-acceptance"
STATES = (ON, OFF_BATCH, OFF_ACCEPTANCE)

SPEC_DECODE_OPTIONS = {  # read by the SpecDecoder whatever the proposer; round_graphs by the draft-model one
    "min_acceptance": PluginOption(0.0, "turn speculation off while the recent acceptance rate is below this (0: "
                                   "never)", minimum=0, maximum=1, flag="--spec-min-acceptance"),
    "max_batch_size": PluginOption(0, "turn speculation off in steps that run more sequences than this (0: no "
                                   "limit)", minimum=0, flag="--spec-max-batch-size"),
    "probe_every": PluginOption(8, "while acceptance is low, speculate in one step of this many to re-measure it",
                                minimum=1),
    "structured": PluginOption(False, "speculate for structured-output requests too, their drafts verified under the "
                               "grammar's masks (off: on the CPU it paid for a JSON schema, not for a regex, "
                               "docs/PERF.md; the jump-forward proposer's requests speculate whatever it says)"),
    "guided": PluginOption(True, "with spec_decode.structured, a proposer that can (the draft model) drafts under "
                           "the grammar's masks, reading each draft step's tokens back; a round with such a "
                           "sequence is not replayed as a graph (off: one read per round, drafts the grammar "
                           "refuses cut at verification)"),
    "round_graphs": PluginOption(True, "with CUDA graphs, replay a draft-model round of greedy drafts as one graph "
                                 "instead of K forward passes"),
}


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
    def from_config(cls, config: EngineConfig) -> SpecPolicy:
        """The policy of ``config.plugin_options["spec_decode"]`` (see :data:`SPEC_DECODE_OPTIONS`)."""
        options = read_plugin_options(config, "spec_decode", SPEC_DECODE_OPTIONS)
        return cls(options["min_acceptance"], options["max_batch_size"], options["probe_every"])

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
