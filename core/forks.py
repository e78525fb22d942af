"""n > 1: a request's other sequences fork from its first one when that samples its first token, sharing the
prompt's KV blocks by reference (copy-on-write), and each draws its own sample of the same logits row."""
from __future__ import annotations

from collections.abc import Callable

from .interfaces import Scheduler, SchedulerOutput
from .request import FinishReason, Sequence


class PendingForks:
    """The sequences still to fork, by request id."""

    def __init__(self) -> None:
        self.children: dict[str, list[Sequence]] = {}

    def __bool__(self) -> bool:
        return bool(self.children)

    def add(self, request_id: str, children: list[Sequence]) -> None:
        self.children[request_id] = children

    def drop(self, request_id: str) -> None:
        self.children.pop(request_id, None)

    def due_in(self, out: SchedulerOutput) -> bool:
        """Whether the first sequence of a request with children samples its first token in this step."""
        return any(item.seq.request_id in self.children
                   and item.seq.num_computed_tokens + item.num_new_tokens == item.seq.num_tokens
                   for item in out.scheduled)

    def take_due(self, seqs: list[Sequence], rows: list[int]) -> list[tuple[Sequence, Sequence]]:
        """The (parent, child) pairs of the parents in ``seqs`` that sample their first token now. Extends
        ``seqs`` and ``rows`` in place with each child and its parent's logits row."""
        forks: list[tuple[Sequence, Sequence]] = []
        if not self.children:
            return forks
        for parent, row in zip(list(seqs), list(rows)):
            if parent.num_output_tokens == 0 and (children := self.children.pop(parent.request_id, None)):
                for child in children:
                    forks.append((parent, child))
                    seqs.append(child)
                    rows.append(row)
        return forks


def start_forks(scheduler: Scheduler, finish: Callable[[Sequence, FinishReason], None], out: SchedulerOutput,
                forks: list[tuple[Sequence, Sequence]], sampled: dict[int, list[int]], now: float) -> None:
    """Fork each child from its parent (before ``Scheduler.update``, which may finish and free a parent) and give
    it its own sampled token, taken out of ``sampled``."""
    if not forks:
        return
    computed = {item.seq.seq_id: item.num_new_tokens for item in out.scheduled}
    for parent, child in forks:
        scheduler.fork(parent, child)
        child.num_computed_tokens += computed[parent.seq_id]
        child.append_token(sampled.pop(child.seq_id)[0], now)
        if (reason := child.check_stop_token()) is not None:
            finish(child, reason)
