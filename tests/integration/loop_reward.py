"""A reward for loop tests that varies between samples of a random tiny model (gsm8k would give all zeros).

Used as `--custom-rm-path tests/integration/loop_reward.py:reward`.
"""


async def reward(sample, **kwargs) -> float:
    """Share of distinct tokens in the response: differs between samples, so advantages are non-zero."""
    response = sample.tokens[len(sample.tokens) - sample.response_length :]
    return len(set(response)) / max(len(response), 1)
