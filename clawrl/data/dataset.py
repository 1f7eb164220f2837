"""Prompt datasets: jsonl / parquet rows -> Sample prototypes (prompt, label, metadata, tools).

`read_rows("data.jsonl@[10:-5]")` reads a file and slices its rows (Python slice semantics, negative and open
bounds allowed). Unlike slime, which skips unparsable lines, every problem here is one `DatasetError` naming
the file and the 1-based line (jsonl) or row (parquet): a training run must not silently lose prompts.

`PromptDataset` turns rows into `Sample` prototypes the way slime's `--input-key / --label-key /
--metadata-key / --tool-key / --apply-chat-template / --rollout-max-prompt-len` flags describe: with the chat
template on, a string prompt becomes one user message, a message-list prompt is used as is, tools are passed
to the template, and the rendered text (with the generation prompt) is the prompt the engine receives.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawrl.data.chat import ChatTemplateError, encode_text, render_chat
from clawrl.data.sample import Sample

logger = logging.getLogger(__name__)

_SLICE_RE = re.compile(r"^(?P<path>.+)@\[(?P<start>[^:\]]*):(?P<stop>[^:\]]*)\]$")
SUFFIXES = (".jsonl", ".parquet")


class DatasetError(ValueError):
    """A prompt data file (or one of its rows) cannot be used; the message names the file and line/row."""


@dataclass(kw_only=True)
class Row:
    """One dataset row and where it came from."""

    data: dict[str, Any]
    """The row's fields."""
    where: str
    """Location for error messages: '<file> line <n>' (jsonl) or '<file> row <n>' (parquet), 1-based."""


# ------------------------------------------------------------------------------------------------------------
# Reading files
# ------------------------------------------------------------------------------------------------------------
def split_slice(spec: str) -> tuple[str, slice]:
    """'file@[start:end]' -> ('file', slice(start, end)); a plain path -> (path, slice(None))."""
    match = _SLICE_RE.match(spec)
    if match is None:
        if "@[" in spec:
            raise DatasetError(
                f"{spec}: bad row slice; expected 'file@[start:end]' with integer or empty bounds"
            )
        return spec, slice(None)
    bounds = []
    for name in ("start", "stop"):
        text = match[name].strip()
        if text and not re.fullmatch(r"-?\d+", text):
            raise DatasetError(f"{spec}: row slice {name} {text!r} is not an integer")
        bounds.append(int(text) if text else None)
    return match["path"], slice(*bounds)


def read_located_rows(spec: str) -> list[Row]:
    """Rows of a jsonl/parquet file (optionally sliced with '@[start:end]'), each with its location."""
    path_text, row_slice = split_slice(str(spec))
    path = Path(path_text)
    if path.suffix not in SUFFIXES:
        raise DatasetError(
            f"{path}: unsupported prompt data suffix {path.suffix!r}; expected .jsonl or .parquet"
        )
    if not path.is_file():
        raise DatasetError(f"{path}: prompt data file not found")
    rows = _read_jsonl(path) if path.suffix == ".jsonl" else _read_parquet(path)
    return rows[row_slice]


def read_rows(spec: str) -> list[dict[str, Any]]:
    """The rows (dicts) of a jsonl/parquet file, optionally sliced with 'file@[start:end]'."""
    return [row.data for row in read_located_rows(spec)]


def _read_jsonl(path: Path) -> list[Row]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():  # blank lines (e.g. a trailing one) carry no row
                continue
            where = f"{path} line {line_no}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: malformed JSON ({exc.msg} at column {exc.colno})") from None
            if not isinstance(data, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(data).__name__}")
            rows.append(Row(data=data, where=where))
    return rows


def _read_parquet(path: Path) -> list[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: cannot read parquet file: {exc}") from None
    return [Row(data=data, where=f"{path} row {i}") for i, data in enumerate(table.to_pylist(), start=1)]


# ------------------------------------------------------------------------------------------------------------
# Prompt dataset
# ------------------------------------------------------------------------------------------------------------
class PromptDataset:
    """Sample prototypes (prompt, label, metadata) from a prompt data file, in file order.

    `samples[i].prompt` is what the engine gets: the rendered chat text when `apply_chat_template`, else the
    row's prompt unchanged (string, or message list). Prompts with more than `max_prompt_len` tokens are
    dropped (order preserved; `num_dropped` counts them).
    """

    def __init__(
        self,
        path: str,
        tokenizer: Any,
        *,
        input_key: str = "input",
        label_key: str | None = None,
        metadata_key: str = "metadata",
        tool_key: str = "tools",
        apply_chat_template: bool = False,
        max_prompt_len: int | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if (apply_chat_template or max_prompt_len is not None) and tokenizer is None:
            raise ValueError("--apply-chat-template and --rollout-max-prompt-len need a tokenizer")
        if max_prompt_len is not None and max_prompt_len < 1:
            raise ValueError(f"--rollout-max-prompt-len must be >= 1, got {max_prompt_len}")
        self.path = path
        self.tokenizer = tokenizer
        self.input_key, self.label_key = input_key, label_key
        self.metadata_key, self.tool_key = metadata_key, tool_key
        self.apply_chat_template = apply_chat_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.max_prompt_len = max_prompt_len
        self.num_dropped = 0  # prompts removed by max_prompt_len
        # message-list prompts kept unchecked: without the chat template they have no text to count
        self.num_unmeasured = 0
        self.samples: list[Sample] = [
            s for s in map(self._make_sample, read_located_rows(path)) if self._keep(s)
        ]
        self._log_filtering()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]

    # --------------------------------------------------------------------------------------------------------
    def _make_sample(self, row: Row) -> Sample:
        messages_or_text = self._prompt(row)
        metadata = self._metadata(row)
        tools = self._tools(row)
        if tools is not None:
            metadata["tools"] = tools
        prompt: str | list[dict[str, Any]] = messages_or_text
        if self.apply_chat_template:
            messages = messages_or_text
            if isinstance(messages, str):
                messages = [{"role": "user", "content": messages}]
            try:
                prompt = render_chat(
                    self.tokenizer,
                    messages,
                    tools,
                    add_generation_prompt=True,
                    chat_template_kwargs=self.chat_template_kwargs,
                )
            except ChatTemplateError as exc:
                raise DatasetError(f"{row.where}: {exc}") from None
        label = None if self.label_key is None else self._required(row, self.label_key, "--label-key")
        return Sample(prompt=prompt, label=label, metadata=metadata)

    def _required(self, row: Row, key: str, flag: str) -> Any:
        if key not in row.data:
            raise DatasetError(
                f"{row.where}: missing key {key!r} ({flag}); the row has keys {sorted(row.data)}"
            )
        return row.data[key]

    def _prompt(self, row: Row) -> str | list[dict[str, Any]]:
        prompt = self._required(row, self.input_key, "--input-key")
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
            return [dict(m) for m in prompt]
        raise DatasetError(
            f"{row.where}: {self.input_key!r} (--input-key) must be a string or a list of "
            f"{{'role': ..., 'content': ...}} messages, got {prompt!r:.100}"
        )

    def _metadata(self, row: Row) -> dict[str, Any]:
        metadata = row.data.get(self.metadata_key)
        if metadata is None:
            return {}
        if isinstance(metadata, str):  # some exporters store nested objects as JSON text
            metadata = self._parse_json(row, metadata, self.metadata_key, "--metadata-key")
        if not isinstance(metadata, dict):
            raise DatasetError(
                f"{row.where}: {self.metadata_key!r} (--metadata-key) must be an object, got {metadata!r:.100}"
            )
        return dict(metadata)

    def _tools(self, row: Row) -> list[dict[str, Any]] | None:
        tools = row.data.get(self.tool_key)
        if tools is None:
            return None
        if isinstance(tools, str):
            tools = self._parse_json(row, tools, self.tool_key, "--tool-key")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise DatasetError(
                f"{row.where}: {self.tool_key!r} (--tool-key) must be a list of tool objects, got {tools!r:.100}"
            )
        return tools

    @staticmethod
    def _parse_json(row: Row, text: str, key: str, flag: str) -> Any:
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(
                f"{row.where}: {key!r} ({flag}) is a string but not valid JSON: {exc.msg}"
            ) from None

    def _keep(self, sample: Sample) -> bool:
        """False for a prompt longer than `max_prompt_len` tokens (counted without added special tokens)."""
        if self.max_prompt_len is None:
            return True
        if not isinstance(sample.prompt, str):  # as slime: a message list is only measurable once rendered
            self.num_unmeasured += 1
            return True
        if len(encode_text(self.tokenizer, sample.prompt)) > self.max_prompt_len:
            self.num_dropped += 1
            return False
        return True

    def _log_filtering(self) -> None:
        if self.max_prompt_len is None:
            return
        logger.info(
            "%s: dropped %d of %d prompts longer than %d tokens (--rollout-max-prompt-len)",
            self.path,
            self.num_dropped,
            self.num_dropped + len(self.samples),
            self.max_prompt_len,
        )
        if self.num_unmeasured:
            logger.warning(
                "%s: %d message-list prompts were not length-filtered (they are only rendered with "
                "--apply-chat-template)",
                self.path,
                self.num_unmeasured,
            )
