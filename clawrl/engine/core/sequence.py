"""Sequence: one sample being generated (a request with n > 1 has n of them), and its stop rules.

No torch here. A sequence's tokens are `prompt_token_ids + output_token_ids`. The first `num_computed_tokens`
of them have their K/V in the cache, in the blocks listed by `block_table` (block i holds positions
[i * block_size, (i + 1) * block_size)).

`stop_reason` applies SGLang's stop rules after each sampled token (engine.py calls it); stop strings are
found by the sequence's `IncrementalDetokenizer`, the output text of one sample grown as tokens arrive. The
request layer (request.py) streams text deltas with the same decoder, so both see the same text.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # Only an annotation here: request.py imports this module (for the detokenizer) at run time.
    from clawrl.engine.core.request import SamplingParams

PENDING_TOKEN = -1
"""Placeholder output token of the engine's overlap schedule: sampled on the device, not yet copied back.
The model runner feeds the real id to the next step on the device; the engine overwrites it when it arrives."""


class SequenceStatus(enum.Enum):
    """Where a sequence is: in the waiting queue, in the running batch, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(kw_only=True, eq=False, slots=True)
class Sequence:
    """One sample of one request, with its KV-cache bookkeeping. Slotted: the engine reads a few fields of
    every running sequence several times per step, and slots keep those reads short and the objects compact."""

    seq_id: int
    """Engine-wide unique id, increasing with arrival (FCFS order)."""
    request_id: str
    """Id of the request this sample belongs to."""
    index: int = 0
    """Sample index within the request, 0..n-1."""
    prompt_token_ids: list[int]
    """Prompt token ids."""
    params: SamplingParams
    """The request's sampling parameters."""
    output_token_ids: list[int] = field(default_factory=list)
    """Generated token ids so far."""
    output_logprobs: list[float] = field(default_factory=list)
    """Logprob of each generated token (see sampler.py for the definition)."""
    status: SequenceStatus = SequenceStatus.WAITING
    """Queue state."""
    block_table: list[int] = field(default_factory=list)
    """KV-cache block ids holding this sequence's positions, in order."""
    num_computed_tokens: int = 0
    """Leading tokens whose K/V are in the cache (from the prefix cache or computed)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission (reported as cached_tokens)."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of the leading full blocks, computed under `hash_namespace`."""
    hash_namespace: str = ""
    """Namespace (weight version, and request id when prefix caching is off) of `block_hashes`."""
    leader: Sequence | None = None
    """For samples 1..n-1 of a request: sample 0, whose prompt blocks they wait for and share."""
    finish_reason: dict | None = None
    """SGLang-style finish reason once finished: {"type": "stop" | "length" | "abort", ...}."""
    num_preemptions: int = 0
    """How often this sequence was preempted (its K/V dropped and later recomputed)."""
    sampler_state: Any = None
    """The sequence's sampling seed (int): its noise is a hash of it and the token count (sampler.py)."""
    detokenizer: IncrementalDetokenizer | None = None
    """Incremental detokenizer, only for sequences with stop strings."""
    max_output_tokens: int = 0
    """Output count at which a length stop is due: max_new_tokens, or fewer when the context ends first. Set by
    the engine; with it and `stop_token_set` the engine skips the full stop rules for a token that cannot stop
    the sequence (0: every token goes through them)."""
    stop_token_set: frozenset[int] = frozenset()
    """Token ids that stop this sequence: EOS ids and stop_token_ids, empty with ignore_eos. Set by the engine."""
    score_only: bool = False
    """max_new_tokens=0 with prompt logprobs: the prompt is computed for its logprobs, the sampled token dropped."""
    reports_logprobs: bool = False
    """Top or prompt logprobs asked for: the runner fills the two fields below, the engine reports them."""
    prompt_logprobs: list | None = None
    """Prompt positions logprob_start_len.. (sample 0 only): (logprob or None, top list or None) each, filled
    by the runner chunk by chunk; None when not asked for."""
    step_top_logprobs: list | None = None
    """The step's top (logprob, token id) pairs of the sampled position, set by the runner (top_logprobs_num)."""
    quiet: bool = False
    """A sample of a request that wants only its final result (a non-streaming /generate): the engine reports
    its tokens when it finishes, and before the weight version changes, instead of one output per step."""
    num_reported: int = 0
    """Quiet sequences: leading output tokens already reported."""

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """True once the sequence is done (stopped, truncated or aborted)."""
        return self.status is SequenceStatus.FINISHED

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list when avoidable."""
        num_prompt = len(self.prompt_token_ids)
        end = self.num_tokens if end is None else end
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]


def stop_reason(seq: Sequence, token: int, *, eos_token_ids: set[int], context_length: int) -> dict | None:
    """Finish reason of `seq` after `token` was appended, or None if it goes on: SGLang's rules, in SGLang's order.

    1. max_new_tokens reached                      -> {"type": "length", "length": max_new_tokens}
    2. EOS or a stop_token_id (unless ignore_eos)  -> {"type": "stop", "matched": token id}
    3. a stop string in the decoded output         -> {"type": "stop", "matched": the string}
    4. the context length reached                  -> {"type": "length", "length": tokens generated}

    As in SGLang, ignore_eos also disables stop_token_ids; stop strings still apply. Before min_new_tokens
    tokens only rules 1 and 4 apply (the sampler also masks EOS and stop tokens until then). The stopping token stays
    in the output ids (trimming the text is the text layer's job, see `no_stop_trim`).
    """
    params = seq.params
    if seq.num_output_tokens >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    may_stop = seq.num_output_tokens >= params.min_new_tokens
    if may_stop and not params.ignore_eos and (token in params.stop_token_ids or token in eos_token_ids):
        return {"type": "stop", "matched": token}
    if seq.detokenizer is not None:
        # Fed every token (not only when other rules pass) so its text stays complete.
        matched = seq.detokenizer.append(token)
        if matched is not None and may_stop:
            return {"type": "stop", "matched": matched}
    if seq.num_tokens >= context_length:
        return {"type": "length", "length": seq.num_output_tokens}
    return None


# ---------------------------------------------------------------------------------------------------
# the text of a sample

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context of the first output token (a leading space decodes as in the full text).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """The output text of one sequence, grown as tokens arrive.

    Decoding token by token does not work for byte-level BPE (a character can span tokens, and a token's
    leading space depends on what precedes it). So the text grows by decoding a short window: the text of
    ids[prefix:] minus the text of ids[prefix:read] is what the newest tokens add, unless it ends in U+FFFD
    (an incomplete UTF-8 character), in which case it waits for more tokens. The window restarts wherever
    the text was complete, so each token costs O(window), not O(sequence).

    Two users: the engine core calls `append` per token to find stop strings (stop_reason); the request
    layer calls `push` to get text deltas that are safe to send, holding back a suffix that could start a
    stop string (a matched stop string is trimmed unless no_stop_trim, and sent text cannot be taken back).
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int] | None = None, *, skip_special_tokens: bool = True,
        stop: list[str] | None = None, no_stop_trim: bool = False,
    ) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.no_stop_trim = no_stop_trim
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        # Window ids: prompt context, then output tokens.
        self._ids: list[int] = list((prompt_token_ids or [])[-_PROMPT_CONTEXT_TOKENS:])
        self.text = ""  # output text decoded so far (complete characters only, untrimmed)
        self.num_sent_chars = 0
        self.final_text: str | None = None
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    # -- the core: stop strings ---------------------------------------------------------------------------

    def append(self, token_id: int) -> str | None:
        """Add one output token; returns the first stop string whose match ends in the text it added."""
        self._ids.append(token_id)
        num_added = self._decode(final=False)
        return self._find_stop(num_added) if num_added else None

    def _find_stop(self, num_added: int) -> str | None:
        # Only matches that end inside the new text are new; earlier ones were checked before.
        start = max(0, len(self.text) - num_added - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = self.text.find(stop, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return None if best is None else best[1]

    # -- the request layer: text deltas -------------------------------------------------------------------

    def push(self, token_ids: list[int], finish_reason: dict | None = None) -> str:
        """Add new tokens; with finish_reason (the sequence ended) flush everything and trim the stop."""
        if self.final_text is not None:
            return ""
        if finish_reason is not None and self._drops_last_token(token_ids, finish_reason):
            # A matched stop token is not part of the text (SGLang trims it unless no_stop_trim).
            token_ids = token_ids[:-1]
        self._ids.extend(token_ids)
        if finish_reason is None:
            self._decode(final=False)
            return self._send_up_to(self._safe_end())
        self._decode(final=True)
        self.final_text = self.text[: self._trim_point(finish_reason)]
        return self._send_up_to(len(self.final_text))

    def _drops_last_token(self, token_ids: list[int], finish_reason: dict) -> bool:
        matched = finish_reason.get("matched")
        return (
            not self.no_stop_trim
            and finish_reason.get("type") == "stop"
            and isinstance(matched, int)
            and bool(token_ids)
            and token_ids[-1] == matched
        )

    def _decode(self, *, final: bool) -> int:
        """Decode the window's new tokens into `text`; returns how many characters were added."""
        if self._read_offset == len(self._ids):
            return 0
        known = self._detok(self._ids[self._prefix_offset : self._read_offset])
        window = self._detok(self._ids[self._prefix_offset :])
        if len(window) > len(known) and (final or not window.endswith(_REPLACEMENT_CHAR)):
            self.text += window[len(known) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return len(window) - len(known)
        if final:
            self._read_offset = len(self._ids)
        return 0

    def _detok(self, token_ids: list[int]) -> str:
        if not token_ids or self.tokenizer is None:  # a model directory without tokenizer: ids only
            return ""
        # transformers' `decode` checks every id in Python (to_py_obj) before calling `_decode`; these ids
        # are a list of ints already, and that check was 80% of the decode's time: 256 answers' texts
        # at the end of a rollout are built on the engine server's event loop, one after another.
        decode = getattr(self.tokenizer, "_decode", None) or self.tokenizer.decode
        return decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _safe_end(self) -> int:
        """End of the text that can be sent: before any complete stop string (the core finishes the
        sequence on it, but that news may come with a later step) and before a possible partial one."""
        end = len(self.text) - self._stop_prefix_len()
        if not self.no_stop_trim:
            for stop in self.stop:
                found = self.text.find(stop, max(0, self.num_sent_chars - len(stop) + 1))
                if found >= 0:
                    end = min(end, found)
        return end

    def _stop_prefix_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        if self.no_stop_trim or not self.stop:
            return 0
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _trim_point(self, finish_reason: dict) -> int:
        matched = finish_reason.get("matched")
        if self.no_stop_trim or finish_reason.get("type") != "stop" or not isinstance(matched, str):
            return len(self.text)
        # The core stops at the first occurrence; text from the stop string on is dropped.
        found = self.text.find(matched, 0)
        return len(self.text) if found < 0 else found

    def _send_up_to(self, end: int) -> str:
        if end <= self.num_sent_chars:
            return ""
        delta = self.text[self.num_sent_chars : end]
        self.num_sent_chars = end
        return delta
