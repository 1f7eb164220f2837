"""Chat rendering, multi-turn loss masks and the prefix-stability check, on the tiny offline tokenizer."""

import copy

import pytest

from clawrl.data.chat import (
    ChatTemplateError,
    check_prefix_stable,
    encode_text,
    render_chat,
    tokenize_conversation,
)
from clawrl.models.tiny import build_tiny_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "<think>Use the tool.</think>", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"celsius": 20}'},
    {"role": "assistant", "content": "It is 20 degrees."},
    {"role": "user", "content": "Thanks! And 3 + 5?"},
    {"role": "assistant", "content": "3 + 5 = 8"},
]
# The trained spans, written out by hand: each assistant body and its <|im_end|>, nothing before or after.
ASSISTANT_SPANS = [
    '<think>Use the tool.</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call><|im_end|>",
    "It is 20 degrees.<|im_end|>",
    "3 + 5 = 8<|im_end|>",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _with_template(tokenizer, template):
    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other


def _spans(ids, mask):
    """Contiguous runs of mask==1 as (start, stop) pairs."""
    spans, start = [], None
    for pos, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = pos
        elif not bit and start is not None:
            spans.append((start, pos))
            start = None
    return spans


def test_loss_mask_on_multi_turn_tool_conversation(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CONVERSATION, TOOLS)
    full_text = render_chat(tokenizer, CONVERSATION, TOOLS)
    assert ids == encode_text(tokenizer, full_text) and len(mask) == len(ids)
    spans = _spans(ids, mask)
    assert [tokenizer.decode(ids[a:b]) for a, b in spans] == ASSISTANT_SPANS
    # Exact positions: each span starts right after the text preceding that assistant body in the render.
    for (start, stop), span_text in zip(spans, ASSISTANT_SPANS, strict=True):
        before = full_text[: full_text.index(span_text)]
        assert before.endswith("<|im_start|>assistant\n")
        assert start == len(encode_text(tokenizer, before))
        assert stop - start == len(encode_text(tokenizer, span_text))
        assert ids[stop - 1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert (
            tokenizer.decode(ids[stop : stop + 1]) == "\n" and mask[stop] == 0
        )  # ChatML's newline: not trained
    assert sum(mask) == sum(len(encode_text(tokenizer, s)) for s in ASSISTANT_SPANS)


def test_loss_mask_without_tools_and_last_turn_from_user(tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    ids, mask = tokenize_conversation(tokenizer, messages)
    text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    assert ids == encode_text(tokenizer, text)
    start = len(encode_text(tokenizer, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"))
    stop = start + len(encode_text(tokenizer, "Hello<|im_end|>"))
    assert mask == [0] * start + [1] * (stop - start) + [0] * (len(ids) - stop)


def test_check_prefix_stable_accepts_tiny_template(tokenizer):
    ids = check_prefix_stable(tokenizer, CONVERSATION, TOOLS)
    assert ids == encode_text(tokenizer, render_chat(tokenizer, CONVERSATION, TOOLS))


# A template in the style of reasoning models that drop the <think> block of every assistant turn but the
# last: the render of [user, assistant] keeps the reasoning, the render with a later turn removes it.
STRIP_THINK_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- set content = m.content -%}"
    "{%- if m.role == 'assistant' and not loop.last and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1] -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def test_check_prefix_stable_rejects_think_stripping_template(tokenizer):
    stripping = _with_template(tokenizer, STRIP_THINK_TEMPLATE)
    messages = [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "<think>add</think>4"},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "<think>add</think>6"},
    ]
    pos = len(encode_text(tokenizer, "<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n"))
    message = (
        r"chat template is not prefix-stable: rendering messages\[:2\] \(add_generation_prompt=False\) gives "
        rf"\d+ tokens that differ from the whole conversation \(\d+ tokens\) at token {pos}: "
    )
    with pytest.raises(ChatTemplateError, match=message) as exc:
        check_prefix_stable(stripping, messages)
    # Both sides' text around the difference, with '|' at the first differing token.
    assert "<|im_start|>assistant\\n|<think>add</think>4'" in str(exc.value)
    assert "<|im_start|>assistant\\n|4<|im_end|>" in str(exc.value)
    with pytest.raises(ChatTemplateError, match=message):
        tokenize_conversation(stripping, messages)
    # A single exchange has nothing earlier to strip: accepted.
    check_prefix_stable(stripping, messages[:2])


def test_check_prefix_stable_rejects_generation_prompt_mismatch(tokenizer):
    # The generation prompt opens an empty think block that rendered assistant turns do not contain.
    template = STRIP_THINK_TEMPLATE.replace(
        "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think></think>'"
    )
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(ChatTemplateError, match=r"messages\[:1\] \(add_generation_prompt=True\)"):
        check_prefix_stable(_with_template(tokenizer, template), messages)


def test_bad_conversations(tokenizer):
    with pytest.raises(ChatTemplateError, match="the conversation has no messages"):
        tokenize_conversation(tokenizer, [])
    with pytest.raises(ChatTemplateError, match=r"messages\[1\] must be a dict with a 'role'"):
        check_prefix_stable(tokenizer, [{"role": "user", "content": "x"}, {"content": "y"}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\] is an assistant message"):
        tokenize_conversation(tokenizer, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="unknown chat role: robot"):
        render_chat(tokenizer, [{"role": "robot", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        render_chat(_with_template(tokenizer, None), [{"role": "user", "content": "x"}])


def test_render_chat_passes_template_kwargs(tokenizer):
    template = "{{- greeting + messages[0].content -}}{%- if add_generation_prompt -%}!{%- endif -%}"
    other = _with_template(tokenizer, template)
    text = render_chat(
        other,
        [{"role": "user", "content": "Ann"}],
        add_generation_prompt=True,
        chat_template_kwargs={"greeting": "Hi "},
    )
    assert text == "Hi Ann!"
