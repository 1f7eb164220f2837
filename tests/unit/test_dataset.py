"""Prompt data files: jsonl/parquet reading, row slicing, errors naming file and line, PromptDataset."""

import json
import logging
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clawrl.data.dataset import DatasetError, PromptDataset, read_rows, split_slice
from clawrl.data.sample import Sample, Status
from clawrl.models.tiny import build_tiny_tokenizer

ROWS = [{"input": f"prompt {i}", "label": str(i), "metadata": {"id": i}} for i in range(6)]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def jsonl(tmp_path):
    return _jsonl(tmp_path / "data.jsonl", ROWS)


@pytest.fixture
def parquet(tmp_path):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    return path


# ------------------------------------------------------------------------------------------------------------
# read_rows
# ------------------------------------------------------------------------------------------------------------
def test_read_jsonl_and_parquet(jsonl, parquet):
    assert read_rows(str(jsonl)) == ROWS
    assert read_rows(str(parquet)) == ROWS


def test_blank_jsonl_lines_are_not_rows(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text('{"input": "a"}\n\n   \n{"input": "b"}\n\n')
    assert read_rows(str(path)) == [{"input": "a"}, {"input": "b"}]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize(
    ("spec", "indices"),
    [
        ("@[1:3]", [1, 2]),
        ("@[:2]", [0, 1]),
        ("@[4:]", [4, 5]),
        ("@[-2:]", [4, 5]),
        ("@[-4:-1]", [2, 3, 4]),
        ("@[:-5]", [0]),
        ("@[:]", [0, 1, 2, 3, 4, 5]),
        ("@[10:]", []),
        ("@[ 2 : 3 ]", [2]),
    ],
)
def test_row_slicing(fmt, spec, indices, jsonl, parquet):
    path = jsonl if fmt == "jsonl" else parquet
    assert read_rows(f"{path}{spec}") == [ROWS[i] for i in indices]


def test_split_slice():
    assert split_slice("a/b@c.jsonl") == ("a/b@c.jsonl", slice(None))
    assert split_slice("x.jsonl@[-3:]") == ("x.jsonl", slice(-3, None))
    for bad, word in [
        ("x.jsonl@[a:2]", "start 'a'"),
        ("x.jsonl@[1:2.5]", "stop '2.5'"),
        ("x.jsonl@[1:2:3]", "bad row slice"),
    ]:
        with pytest.raises(DatasetError, match=rf"x\.jsonl.*{word}"):
            split_slice(bad)


def test_malformed_json_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input": "a"}\n\n{"input": "b",}\n{"input": "c"}\n')
    with pytest.raises(
        DatasetError, match=rf"^{re.escape(str(path))} line 3: malformed JSON \(Expecting property name"
    ):
        read_rows(str(path))


def test_non_object_line_names_file_and_line(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"input": "a"}\n["input", "b"]\n')
    with pytest.raises(
        DatasetError, match=rf"^{re.escape(str(path))} line 2: expected a JSON object, got list$"
    ):
        read_rows(f"{path}@[:1]")  # the whole file is validated, not only the selected rows


def test_unknown_suffix_and_missing_file(tmp_path):
    csv = tmp_path / "data.csv"
    csv.write_text("input\nx\n")
    with pytest.raises(
        DatasetError,
        match=rf"^{re.escape(str(csv))}: unsupported prompt data suffix '.csv'; expected .jsonl or .parquet",
    ):
        read_rows(str(csv))
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(missing))}: prompt data file not found$"):
        read_rows(f"{missing}@[:3]")
    assert issubclass(DatasetError, ValueError)


def test_corrupt_parquet_names_file(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))}: cannot read parquet file"):
        read_rows(str(path))


# ------------------------------------------------------------------------------------------------------------
# PromptDataset: keys and errors
# ------------------------------------------------------------------------------------------------------------
def test_plain_prompts_labels_metadata(jsonl):
    dataset = PromptDataset(f"{jsonl}@[1:3]", None, label_key="label")
    assert len(dataset) == 2
    first = dataset[0]
    assert isinstance(first, Sample) and first.status is Status.PENDING
    assert (first.prompt, first.label, first.metadata) == ("prompt 1", "1", {"id": 1})
    assert (first.index, first.group_index, first.tokens) == (None, None, [])
    assert PromptDataset(str(jsonl), None)[0].label is None  # no --label-key: no label


def test_custom_keys_and_tools_from_json_string(tmp_path):
    rows = [
        {"question": "q0", "answer": 5, "info": {"src": "a"}, "functions": json.dumps(TOOLS)},
        {"question": [{"role": "user", "content": "q1"}], "answer": 6, "functions": TOOLS},
        {"question": "q2", "answer": 7, "info": '{"src": "c"}'},
    ]
    path = _jsonl(tmp_path / "keys.jsonl", rows)
    dataset = PromptDataset(
        str(path), None, input_key="question", label_key="answer", metadata_key="info", tool_key="functions"
    )
    assert [s.prompt for s in dataset.samples] == ["q0", [{"role": "user", "content": "q1"}], "q2"]
    assert [s.label for s in dataset.samples] == [5, 6, 7]
    assert [s.metadata for s in dataset.samples] == [
        {"src": "a", "tools": TOOLS},
        {"tools": TOOLS},
        {"src": "c"},
    ]


@pytest.mark.parametrize(
    ("row", "kwargs", "message"),
    [
        ({"prompt": "x"}, {}, r"line 2: missing key 'input' \(--input-key\); the row has keys \['prompt'\]"),
        ({"input": "x"}, {"label_key": "label"}, r"line 2: missing key 'label' \(--label-key\)"),
        ({"input": 3}, {}, r"line 2: 'input' \(--input-key\) must be a string or a list of"),
        (
            {"input": [{"content": "no role"}]},
            {},
            r"line 2: 'input' \(--input-key\) must be a string or a list",
        ),
        ({"input": "x", "metadata": [1]}, {}, r"line 2: 'metadata' \(--metadata-key\) must be an object"),
        (
            {"input": "x", "metadata": "{oops"},
            {},
            r"line 2: 'metadata' \(--metadata-key\) is a string but not valid JSON",
        ),
        ({"input": "x", "tools": "[{"}, {}, r"line 2: 'tools' \(--tool-key\) is a string but not valid JSON"),
        (
            {"input": "x", "tools": {"name": "f"}},
            {},
            r"line 2: 'tools' \(--tool-key\) must be a list of tool objects",
        ),
    ],
)
def test_row_errors_name_file_and_line(tmp_path, row, kwargs, message):
    path = _jsonl(tmp_path / "rows.jsonl", [{"input": "fine", "label": "1"}, row])
    with pytest.raises(DatasetError, match=f"^{re.escape(str(path))} {message}"):
        PromptDataset(str(path), None, **kwargs)


def test_parquet_row_errors_name_row_number(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"input": "a", "label": "1"}, {"input": "b", "label": None}]), path)
    assert [s.label for s in PromptDataset(str(path), None, label_key="label")] == ["1", None]
    with pytest.raises(
        DatasetError, match=rf"^{re.escape(str(path))} row 1: missing key 'answer' \(--label-key\)"
    ):
        PromptDataset(str(path), None, label_key="answer")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(path))} row 2: missing key 'answer'"):
        PromptDataset(f"{path}@[1:]", None, label_key="answer")  # row numbers count from the file start


def test_template_and_length_filter_need_a_tokenizer(jsonl):
    with pytest.raises(ValueError, match="need a tokenizer"):
        PromptDataset(str(jsonl), None, apply_chat_template=True)
    with pytest.raises(ValueError, match="need a tokenizer"):
        PromptDataset(str(jsonl), None, max_prompt_len=10)


# ------------------------------------------------------------------------------------------------------------
# PromptDataset: chat template and --rollout-max-prompt-len
# ------------------------------------------------------------------------------------------------------------
def test_chat_template_rendering(tmp_path, tokenizer):
    rows = [
        {"input": "What is 3 + 5?"},
        {"input": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        {"input": "Add 2 and 2.", "tools": json.dumps(TOOLS)},
    ]
    path = _jsonl(tmp_path / "chat.jsonl", rows)
    dataset = PromptDataset(str(path), tokenizer, apply_chat_template=True)
    prompts = [s.prompt for s in dataset.samples]
    assert prompts[0] == "<|im_start|>user\nWhat is 3 + 5?<|im_end|>\n<|im_start|>assistant\n"
    assert (
        prompts[1]
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    tool_json = '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}'
    assert prompts[2].startswith(
        f"<|im_start|>system\n# Tools\n\nYou can call the functions described by these JSON schemas:\n<tools>\n{tool_json}\n</tools>"
    )
    assert prompts[2].endswith("<|im_start|>user\nAdd 2 and 2.<|im_end|>\n<|im_start|>assistant\n")
    assert dataset[2].metadata == {"tools": TOOLS}


def test_chat_template_kwargs_reach_the_template(tmp_path, tokenizer):
    import copy

    custom = copy.deepcopy(tokenizer)
    custom.chat_template = "{{- style + ': ' + messages[-1].content -}}"
    path = _jsonl(tmp_path / "kw.jsonl", [{"input": "hello"}])
    dataset = PromptDataset(
        str(path), custom, apply_chat_template=True, chat_template_kwargs={"style": "terse"}
    )
    assert dataset[0].prompt == "terse: hello"


def test_max_prompt_len_filters_in_order(tmp_path, tokenizer, caplog):
    # Digits are single tokens and never merge, so "1234" is exactly 4 tokens.
    rows = [{"input": "12"}, {"input": "123456"}, {"input": "1234"}, {"input": "12345"}, {"input": "1"}]
    path = _jsonl(tmp_path / "lens.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="clawrl.data.dataset"):
        dataset = PromptDataset(str(path), tokenizer, max_prompt_len=4)
    assert [s.prompt for s in dataset.samples] == ["12", "1234", "1"]
    assert dataset.num_dropped == 2
    assert f"{path}: dropped 2 of 5 prompts longer than 4 tokens (--rollout-max-prompt-len)" in caplog.text


def test_max_prompt_len_counts_rendered_template_tokens(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "chatlen.jsonl", [{"input": "1"}, {"input": "12"}])
    # "<|im_start|>user\n1<|im_end|>\n<|im_start|>assistant\n" = 9 tokens: im_start, user, \n, 1, im_end, \n,
    # im_start, assistant, \n; the second prompt has one digit more.
    assert [
        len(PromptDataset(str(path), tokenizer, apply_chat_template=True, max_prompt_len=n))
        for n in (8, 9, 10)
    ] == [0, 1, 2]


def test_message_list_prompts_are_not_length_filtered_without_template(tmp_path, tokenizer, caplog):
    path = _jsonl(
        tmp_path / "msgs.jsonl", [{"input": [{"role": "user", "content": "1234567"}]}, {"input": "123"}]
    )
    with caplog.at_level(logging.WARNING, logger="clawrl.data.dataset"):
        dataset = PromptDataset(str(path), tokenizer, max_prompt_len=2)
    assert [s.prompt for s in dataset.samples] == [[{"role": "user", "content": "1234567"}]]
    assert (dataset.num_dropped, dataset.num_unmeasured) == (1, 1)
    assert "1 message-list prompts were not length-filtered" in caplog.text
