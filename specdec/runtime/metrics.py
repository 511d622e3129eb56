"""Per-step and per-run counters of a decoding loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specdec.runtime.packed import SeqWork


@dataclass
class StepRecord:
    """One target call. ``rows`` is read from the backend's own counter, not re-derived."""

    batch_size: int  # sequences in the pack
    rows: int  # token rows the target processed
    real_rows: int  # rows that are real tokens (prompt, last token, drafts)
    prefill_rows: int  # prompt rows among them
    draft_tokens: int
    accepted_draft_tokens: int
    seconds: float
    draft_seconds: float = 0.0
    active: int | None = None  # sequences with real tokens (vanilla's finished samples only pad)

    @property
    def padded_rows(self) -> int:
        return self.rows - self.real_rows

    @classmethod
    def of(
        cls,
        work: Sequence[SeqWork],
        *,
        batch_size: int,
        rows: int,
        seconds: float,
        draft_seconds: float = 0.0,
        active: int | None = None,
    ) -> StepRecord:
        """The record of a target call over ``work``, its counts derived from what each item says it is (one
        derivation, whether the step ran whole or one sequence at a time after a failure)."""
        return cls(
            batch_size=batch_size,
            rows=rows,
            real_rows=sum(w.real_tokens for w in work),
            prefill_rows=sum(w.prompt_tokens for w in work),
            draft_tokens=sum(w.drafts for w in work),
            accepted_draft_tokens=0,
            seconds=seconds,
            draft_seconds=draft_seconds,
            active=active,
        )


@dataclass
class RunMetrics:
    """Totals for one run of a decoding loop."""

    method: str
    steps: list[StepRecord] = field(default_factory=list)
    wall_seconds: float = 0.0
    generated_tokens: int = 0
    requests: int = 0

    @property
    def target_calls(self) -> int:
        return len(self.steps)

    @property
    def decode_seconds(self) -> float:
        """Time of steps without prompt rows (plus their drafting): the decoding phase."""
        return sum(s.seconds + s.draft_seconds for s in self.steps if s.prefill_rows == 0)

    def summary(self) -> dict[str, Any]:
        """The run as a JSON record: its method's name and its counts and rates (numbers)."""
        rows = sum(s.rows for s in self.steps)
        real = sum(s.real_rows for s in self.steps)
        drafts = sum(s.draft_tokens for s in self.steps)
        accepted = sum(s.accepted_draft_tokens for s in self.steps)
        decode_steps = [s for s in self.steps if s.prefill_rows == 0]
        seq_steps = sum(s.batch_size if s.active is None else s.active for s in decode_steps)
        return {
            "method": self.method,
            "requests": self.requests,
            "generated_tokens": self.generated_tokens,
            "wall_seconds": round(self.wall_seconds, 4),
            "tokens_per_second": round(self.generated_tokens / self.wall_seconds, 3) if self.wall_seconds else 0.0,
            "target_calls": self.target_calls,
            "target_rows": rows,
            "target_rows_real": real,
            "target_rows_padded": rows - real,
            "padded_fraction": round((rows - real) / rows, 4) if rows else 0.0,
            "draft_tokens": drafts,
            "accepted_draft_tokens": accepted,
            "acceptance_rate": round(accepted / drafts, 4) if drafts else 0.0,
            "mean_accepted_length": round(1 + accepted / seq_steps, 4) if seq_steps else 0.0,
            "mean_batch_size": round(sum(s.batch_size for s in self.steps) / len(self.steps), 3) if self.steps else 0.0,
            "draft_seconds": round(sum(s.draft_seconds for s in self.steps), 4),
        }
