"""StepOutput: what one engine step reports for one sample of one request (re-exported by engine.py).

An immutable record (a NamedTuple, read by attribute like the other records): the engine builds one per running
sequence every step, and a tuple is the cheapest record Python can build (see `Engine._apply_tokens`, which
builds it positionally in field order).
"""

from __future__ import annotations

from typing import NamedTuple


class StepOutput(NamedTuple):
    """What one step produced for one sample of one request."""

    request_id: str
    """Request id given to add_request."""
    index: int
    """Sample index 0..n-1."""
    token_ids: list[int]
    """New tokens produced in this step (one, or none for an abort or max_new_tokens=0)."""
    logprobs: list[float]
    """Logprob of each new token under the temperature-scaled distribution (sampler.py)."""
    finished: bool
    """True on the sample's last output."""
    finish_reason: dict | None
    """{"type": "stop", "matched": id | str} | {"type": "length", "length": n} | {"type": "abort"}."""
    weight_version: str
    """Weight version that produced these tokens."""
    prompt_tokens: int
    """Prompt length."""
    cached_tokens: int
    """Prompt tokens served from the prefix cache."""
