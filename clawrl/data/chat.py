"""Chat rendering with a tokenizer's chat template, multi-turn loss masks, and the prefix-stability check.

A multi-turn sample is trained on the tokens the policy produced (assistant turns) and not on the tokens the
environment produced (system, user, tool results, role headers). Instead of knowing each template's syntax,
`tokenize_conversation` renders growing prefixes of the conversation and diffs their tokens:

    tokens(render(messages[:i], add_generation_prompt=True))   -> everything before assistant turn i's body
    tokens(render(messages[:i + 1]))                            -> ... up to the end of assistant turn i

so it works for any template whose renders of a prefix are token-prefixes of the render of the whole — the
same property an agent rollout relies on when it appends turns token by token. `check_prefix_stable` verifies
that property and names the first token where it breaks (templates that drop earlier `<think>` blocks, or
that merge consecutive tool turns, fail it).

    ids, mask = tokenize_conversation(tokenizer, messages, tools)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Tokens that close a turn in common templates; the end-of-turn token is trained on, anything the template
# prints after it (ChatML's "\n") is not, since the policy never generates it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


class ChatTemplateError(ValueError):
    """A conversation cannot be rendered, or the template is not prefix-stable for it."""


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The text of `messages` (and `tools`) under the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(f"tokenizer {type(tokenizer).__name__} has no chat template")
    kwargs = dict(chat_template_kwargs or {})
    if tools:
        kwargs["tools"] = list(tools)
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as exc:  # jinja errors and transformers' own checks: re-raise with the conversation size
        raise ChatTemplateError(f"chat template failed on {len(messages)} message(s): {exc}") from exc
    assert isinstance(text, str), type(text)
    return text


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of already-rendered text (the template wrote any BOS/special tokens itself)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_prefix_stable(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Raise ChatTemplateError unless every rendered prefix of `messages` is a token-prefix of the whole.

    A prefix that is followed by an assistant message is rendered with add_generation_prompt=True (that is
    what the engine saw before generating the reply). Returns the token ids of the whole conversation.
    """
    renders = _PrefixRenders(tokenizer, messages, tools, chat_template_kwargs)
    renders.check_all()
    return renders.full_ids


def tokenize_conversation(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """(token_ids, loss_mask) of a whole conversation: 1 on assistant bodies and their end-of-turn token.

    Role headers, system/user/tool turns and text after an assistant's end-of-turn token get 0. Raises
    ChatTemplateError (naming the first differing token) when the template is not prefix-stable.
    """
    if messages and isinstance(messages[0], dict) and messages[0].get("role") == "assistant":
        raise ChatTemplateError(
            "messages[0] is an assistant message: the conversation needs a prompt before it"
        )
    renders = _PrefixRenders(tokenizer, messages, tools, chat_template_kwargs)
    renders.check_all()
    full_ids = renders.full_ids
    end_ids = end_of_turn_ids(tokenizer)
    loss_mask = [0] * len(full_ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = len(renders.checked_ids(i, prompted=True))
        stop = len(renders.checked_ids(i + 1, prompted=False))
        stop = _trim_after_end_of_turn(full_ids, start, stop, end_ids)
        loss_mask[start:stop] = [1] * (stop - start)
    return full_ids, loss_mask


# ------------------------------------------------------------------------------------------------------------
class _PrefixRenders:
    """Token ids of rendered conversation prefixes, each checked to be a token-prefix of the whole."""

    def __init__(
        self, tokenizer: Any, messages: Sequence[dict[str, Any]], tools, chat_template_kwargs
    ) -> None:
        _check_messages(messages)
        self.tokenizer = tokenizer
        self.messages = messages
        self.tools = tools
        self.kwargs = chat_template_kwargs
        self.full_ids = self._ids(len(messages), prompted=False)
        self._cache: dict[tuple[int, bool], list[int]] = {(len(messages), False): self.full_ids}

    def check_all(self) -> None:
        """Check every prefix the way a rollout builds it: with the generation prompt before assistant turns."""
        for end in range(1, len(self.messages)):
            self.checked_ids(end, prompted=self.messages[end].get("role") == "assistant")

    def _ids(self, end: int, *, prompted: bool) -> list[int]:
        text = render_chat(
            self.tokenizer,
            self.messages[:end],
            self.tools,
            add_generation_prompt=prompted,
            chat_template_kwargs=self.kwargs,
        )
        return encode_text(self.tokenizer, text)

    def checked_ids(self, end: int, *, prompted: bool) -> list[int]:
        """Token ids of render(messages[:end]); ChatTemplateError if they are not a prefix of the whole."""
        if (end, prompted) in self._cache:
            return self._cache[end, prompted]
        ids = self._ids(end, prompted=prompted)
        pos = next((i for i, (a, b) in enumerate(zip(ids, self.full_ids, strict=False)) if a != b), None)
        if pos is None and len(ids) <= len(self.full_ids):
            self._cache[end, prompted] = ids
            return ids
        pos = min(len(ids), len(self.full_ids)) if pos is None else pos
        got = ids[pos] if pos < len(ids) else "<end>"
        want = self.full_ids[pos] if pos < len(self.full_ids) else "<end>"
        raise ChatTemplateError(
            f"chat template is not prefix-stable: rendering messages[:{end}] (add_generation_prompt={prompted}) "
            f"gives {len(ids)} tokens that differ from the whole conversation ({len(self.full_ids)} tokens) at "
            f"token {pos}: id {got} vs id {want}; prefix there {self._context(ids, pos)}, "
            f"whole there {self._context(self.full_ids, pos)}"
        )

    def _context(self, ids: list[int], pos: int) -> str:
        """Decoded text around token `pos`, marked with '|' at the differing token."""
        before = self.tokenizer.decode(ids[max(0, pos - 6) : pos])
        return repr(before + "|" + self.tokenizer.decode(ids[pos : pos + 6]))


def _check_messages(messages: Sequence[dict[str, Any]]) -> None:
    if not messages:
        raise ChatTemplateError("the conversation has no messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ChatTemplateError(f"messages[{i}] must be a dict with a 'role', got {message!r:.80}")


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """Token ids that end a turn for this tokenizer: its EOS and the common chat templates' end markers."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    ids.update(vocab[token] for token in END_OF_TURN_TOKENS if token in vocab)
    return ids


def _trim_after_end_of_turn(ids: list[int], start: int, stop: int, end_ids: set[int]) -> int:
    """New `stop`: just past the last end-of-turn token in ids[start:stop] (unchanged if there is none)."""
    for pos in range(stop - 1, start - 1, -1):
        if ids[pos] in end_ids:
            return pos + 1
    return stop
