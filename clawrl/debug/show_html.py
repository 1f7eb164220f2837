"""The HTML page of `clawrl debug show --html OUT`: every sample's tokens, one span per token, coloured by
loss mask and, where a train dump holds the trainer's log-probs, by |trainer log-prob - rollout log-prob|.

    write_html("page.html", shown, "run/details/tokenizer", max_samples=4)

The page is self-contained (inline CSS, no scripts). Each token is decoded on its own with the tokenizer;
without one (or when it cannot be loaded) the page shows token ids. Hovering a token shows its position,
id, loss mask and the two log-probs. Colour scale of the mismatch: log10 from 1e-4 (white) to 1 (red);
a healthy fp32 run sits at the white end, bf16 around 1e-2, a template or weight mismatch near 1.
"""

from __future__ import annotations

import html
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from clawrl.data.sample import Sample
from clawrl.debug.shown import Shown, logprob_diff, prompt_text, reward_value

logger = logging.getLogger(__name__)

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h2 { border-bottom: 2px solid #888; margin-top: 2em; } h3 { margin-bottom: .3em; font-size: 1em; }
.meta { color: #555; font-size: .9em; } .text { white-space: pre-wrap; background: #f6f6f6; padding: .4em; }
.toks { font-family: ui-monospace, monospace; font-size: .85em; line-height: 1.9; white-space: pre-wrap; }
.toks span { border-radius: 2px; padding: 0 1px; margin: 0 1px 0 0; }
.p { color: #888; } .m0 { background: #dde3ea; color: #667; font-style: italic; }
.m1 { border-bottom: 2px solid #2a9d3a; }
.legend span { display: inline-block; padding: 0 .5em; margin-right: .3em; }
"""


def write_html(out, shown: list[Shown], tokenizer: str | None, *, max_samples: int | None) -> Path:
    """Write the page for `shown` to `out`; `max_samples` per dump (None: all). Returns the path."""
    decode = load_decoder(tokenizer)
    body = [_legend(decode is not None, tokenizer)]
    for item in shown:
        body.append(_dump_section(item, decode, max_samples))
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>clawrl rollout dumps</title>"
        f"<style>{_CSS}</style></head><body><h1>clawrl rollout dumps</h1>{''.join(body)}</body></html>"
    )
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def load_decoder(tokenizer: str | None) -> Callable[[int], str] | None:
    """A one-token decoder, or None (with a warning) when no tokenizer is given or it cannot be loaded."""
    if not tokenizer:
        logger.warning("no tokenizer (--tokenizer PATH): the page shows token ids")
        return None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    except Exception as err:  # any loader failure leaves a useful page of ids
        logger.warning("cannot load tokenizer %s (%s): the page shows token ids", tokenizer, err)
        return None
    return lambda token_id: tok.decode([token_id])


def mismatch_colour(diff: float) -> str:
    """Background for |logp diff|: log10 scale, 1e-4 and below white, 1 and above full red."""
    level = 0.0 if diff <= 1e-4 else min(1.0, (math.log10(diff) + 4.0) / 4.0)
    return f"rgba(220,38,38,{level:.2f})"


def _legend(has_tokenizer: bool, tokenizer: str | None) -> str:
    scale = "".join(
        f"<span style='background:{mismatch_colour(v)}'>{v:g}</span>" for v in (1e-4, 1e-3, 1e-2, 1e-1, 1.0)
    )
    source = f"decoded with {html.escape(str(tokenizer))}" if has_tokenizer else "token ids (no tokenizer)"
    return (
        "<div class='legend'><p><span class='p'>prompt token</span> <span class='m1'>trained (loss mask 1)</span>"
        " <span class='m0'>not trained (loss mask 0)</span></p>"
        f"<p>|trainer log-prob - rollout log-prob| (when a train dump is present): {scale}</p>"
        f"<p class='meta'>Tokens: {source}. Hover a token for its numbers.</p></div>"
    )


def _dump_section(item: Shown, decode: Callable[[int], str] | None, max_samples: int | None) -> str:
    dump = item.dump
    title = f"rollout {dump.rollout_id} ({dump.category}) · {len(dump.samples)} samples"
    parts = [f"<h2>{html.escape(title)}</h2><p class='meta'>{html.escape(str(dump.path))}</p>"]
    count = len(dump.samples) if max_samples is None else min(max_samples, len(dump.samples))
    for pos in range(count):
        parts.append(_sample_section(pos, dump.samples[pos], item.records.get(pos), decode))
    if count < len(dump.samples):
        parts.append(f"<p class='meta'>{len(dump.samples) - count} more samples not shown</p>")
    return "".join(parts)


def _sample_section(pos: int, sample: Sample, record: dict | None, decode) -> str:
    reward = reward_value(sample, None)
    status = getattr(sample.status, "value", sample.status)
    head = (
        f"[{pos}] index {sample.index} · reward {reward if reward is not None else sample.reward!r} · {status}"
        f" · {sample.response_length} response tokens"
    )
    return (
        f"<h3>{html.escape(head)}</h3>"
        f"<div class='text'><b>prompt</b>\n{html.escape(prompt_text(sample.prompt))}</div>"
        f"<div class='toks'>{_token_spans(sample, record, decode)}</div>"
    )


def _token_spans(sample: Sample, record: dict | None, decode) -> str:
    num_prompt = len(sample.tokens) - sample.response_length
    mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
    rollout = sample.rollout_log_probs
    trained = _floats(record.get("log_probs")) if record is not None else None
    diff = logprob_diff(record) if record is not None else None
    spans = []
    for i, token_id in enumerate(sample.tokens):
        text = decode(token_id) if decode is not None else f"[{token_id}]"
        if i < num_prompt:
            spans.append(f"<span class='p' title='prompt {i} · id {token_id}'>{html.escape(text)}</span>")
            continue
        r = i - num_prompt
        title = [f"response {r}", f"id {token_id}", f"loss mask {mask[r]}"]
        if rollout is not None:
            title.append(f"rollout logp {rollout[r]:.6g}")
        style = ""
        if trained is not None and diff is not None:
            title += [f"trainer logp {trained[r]:.6g}", f"|diff| {diff[r].item():.3g}"]
            style = f" style='background:{mismatch_colour(diff[r].item())}'"
        cls = "m1" if mask[r] else "m0"
        label = html.escape(" · ".join(title), quote=True)
        spans.append(f"<span class='{cls}'{style} title='{label}'>{html.escape(text)}</span>")
    return "".join(spans)


def _floats(value: Any) -> list[float] | None:
    return value.float().tolist() if isinstance(value, torch.Tensor) else None
