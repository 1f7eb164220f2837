"""PromptSource: groups with shared group_index, epochs, deterministic shuffle, exact resume."""

import json
import random

import pytest

from clawrl.data.dataset import PromptDataset
from clawrl.data.source import PromptSource

NUM_PROMPTS = 5


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"input": f"p{i}", "label": str(i), "metadata": {"tags": [i]}} for i in range(NUM_PROMPTS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return PromptDataset(str(path), None, label_key="label")


def _prompts(groups):
    return [group[0].prompt for group in groups]


def test_groups_share_group_index_and_have_consecutive_indices(dataset):
    source = PromptSource(dataset)
    groups = source.get_groups(3, 4)
    assert [[(s.group_index, s.index) for s in g] for g in groups] == [
        [(0, 0), (0, 1), (0, 2), (0, 3)],
        [(1, 4), (1, 5), (1, 6), (1, 7)],
        [(2, 8), (2, 9), (2, 10), (2, 11)],
    ]
    assert _prompts(groups) == ["p0", "p1", "p2"]
    assert all(s.prompt == g[0].prompt and s.label == g[0].label for g in groups for s in g)
    nxt = source.get_groups(1, 2)
    assert [(s.group_index, s.index, s.prompt) for s in nxt[0]] == [(3, 12, "p3"), (3, 13, "p3")]
    assert source.get_groups(0, 2) == []


def test_copies_are_independent_of_each_other_and_of_the_dataset(dataset):
    group = PromptSource(dataset).get_groups(1, 2)[0]
    group[0].metadata["tags"].append("x")
    group[0].tokens.append(7)
    assert group[1].metadata == {"tags": [0]} and group[1].tokens == []
    assert dataset[0].metadata == {"tags": [0]} and dataset[0].index is None


def test_wrap_around_without_shuffle(dataset):
    source = PromptSource(dataset)
    assert len(source) == NUM_PROMPTS and source.epoch == 0
    assert _prompts(source.get_groups(5, 1)) == ["p0", "p1", "p2", "p3", "p4"]
    assert source.epoch == 0  # the epoch turns when the next prompt is handed out
    assert _prompts(source.get_groups(7, 1)) == ["p0", "p1", "p2", "p3", "p4", "p0", "p1"]
    assert source.epoch == 2
    assert source.state_dict() == {
        "epoch": 2,
        "offset": 2,
        "next_group_index": 12,
        "next_sample_index": 12,
        "num_prompts": NUM_PROMPTS,
    }


def test_shuffle_is_a_per_epoch_permutation_seeded_by_seed_plus_epoch(dataset):
    source = PromptSource(dataset, shuffle=True, seed=7)
    epochs = [_prompts(source.get_groups(NUM_PROMPTS, 1)) for _ in range(3)]
    for epoch, prompts in enumerate(epochs):
        order = list(range(NUM_PROMPTS))
        random.Random(7 + epoch).shuffle(order)  # slime's rule: random.seed(seed + epoch) permutation
        assert prompts == [f"p{i}" for i in order]
        assert sorted(prompts) == [f"p{i}" for i in range(NUM_PROMPTS)]
    assert len({tuple(p) for p in epochs}) > 1  # epochs are reshuffled, not repeated
    again = PromptSource(dataset, shuffle=True, seed=7)
    assert [_prompts(again.get_groups(NUM_PROMPTS, 1)) for _ in range(3)] == epochs
    other_seed = PromptSource(dataset, shuffle=True, seed=8)
    assert [_prompts(other_seed.get_groups(NUM_PROMPTS, 1)) for _ in range(3)] != epochs


@pytest.mark.parametrize("shuffle", [False, True])
def test_resume_gives_exactly_the_following_samples(dataset, shuffle):
    original = PromptSource(dataset, shuffle=shuffle, seed=3)
    original.get_groups(4, 3)
    state = json.loads(json.dumps(original.state_dict()))  # plain types survive a JSON round trip
    expected = [[s.to_dict() for s in g] for g in original.get_groups(9, 3)]  # crosses two epoch boundaries

    resumed = PromptSource(dataset, shuffle=shuffle, seed=3)
    resumed.get_groups(1, 1)  # its own position is overwritten by the loaded state
    resumed.load_state_dict(state)
    assert resumed.epoch == 0
    assert [[s.to_dict() for s in g] for g in resumed.get_groups(9, 3)] == expected
    assert resumed.state_dict() == original.state_dict()
    assert expected[0][0]["index"] == 12 and expected[0][0]["group_index"] == 4


def test_bad_state_and_arguments(dataset, tmp_path):
    source = PromptSource(dataset)
    with pytest.raises(ValueError, match=r"state is missing \['next_sample_index'\]"):
        source.load_state_dict({"epoch": 0, "offset": 0, "next_group_index": 0, "num_prompts": NUM_PROMPTS})
    state = {**source.state_dict(), "num_prompts": 9}
    with pytest.raises(ValueError, match=r"saved for 9 prompts but .*prompts\.jsonl now has 5"):
        source.load_state_dict(state)
    with pytest.raises(ValueError, match=r"offset=6 is outside 0\.\.5"):
        source.load_state_dict({**source.state_dict(), "offset": 6})
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 1"):
        source.get_groups(1, 0)

    path = tmp_path / "long.jsonl"
    path.write_text('{"input": "123456789"}\n')
    from clawrl.models.tiny import build_tiny_tokenizer

    empty = PromptDataset(str(path), build_tiny_tokenizer(), max_prompt_len=3)
    with pytest.raises(ValueError, match=r"long\.jsonl: no prompts left"):
        PromptSource(empty)
