"""`--rm-type remote_rm`: score a sample with an HTTP reward service at `--rm-url`.

Protocol: POST a JSON object `{"prompt": ..., "response": ..., "label": ...}`; the JSON body of the reply is
the reward (a number, or a dict from which `--reward-key` picks the training value).

Failure handling: connection errors, timeouts, 5xx and 429 replies are retried with exponential backoff plus
jitter (`min(backoff_base_s * 2**k, backoff_cap_s) + U(0, jitter_s)` seconds), at most `max_attempts` tries
and never past `deadline_s` (default 120 s) from the first try; then one `RemoteRewardError` names the URL,
the attempt count and the last failure. Any other 4xx means the request itself is wrong: no retry, the error
carries the status and the start of the body. One aiohttp session (at most `max_connections` connections) is
shared per event loop: aiohttp rather than httpx for the reason the engine client uses it (a rollout's samples
finish together, and httpx's client CPU per call was ~6x aiohttp's; clawrl/engine/http/client.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from clawrl import fast_json
from clawrl.engine.http.client import KEEPALIVE_EXPIRY_S, shared_ssl_context


class RemoteRewardError(RuntimeError):
    """The reward service at --rm-url gave no usable reward; the message names the URL and the cause."""


class _Retryable(Exception):
    """One failed attempt that may succeed if tried again."""


@dataclass(kw_only=True)
class RemoteRewardModel:
    """A client for one reward URL; call it like a reward function: `await rm(sample)`."""

    url: str
    """The `--rm-url` endpoint (full URL, POSTed to as is)."""
    deadline_s: float = 120.0
    """Overall time budget for one sample, retries included."""
    max_attempts: int = 10
    """Tries per sample before giving up."""
    backoff_base_s: float = 1.0
    """First retry waits about this long; each later one twice as long."""
    backoff_cap_s: float = 30.0
    """Upper bound of one backoff wait (before jitter)."""
    jitter_s: float = 1.0
    """Uniform random extra wait, so that many failing samples do not retry in lockstep."""
    max_connections: int = 64
    """Most connections the shared session opens at once (more calls wait for one)."""
    _loop: Any = field(default=None, repr=False)
    _http: aiohttp.ClientSession | None = field(default=None, repr=False)

    async def __call__(self, sample, **kw) -> float | dict[str, Any]:
        payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
        return await self.post(payload)

    async def post(self, payload: dict[str, Any]) -> float | dict[str, Any]:
        """POST `payload` with retries; the parsed reward."""
        start = time.monotonic()
        last_failure = "no attempt made"
        attempt = 0
        while attempt < self.max_attempts:
            remaining = self.deadline_s - (time.monotonic() - start)
            if remaining <= 0:
                break
            attempt += 1
            try:
                return await self._attempt(payload, remaining)
            except _Retryable as e:
                last_failure = str(e)
            if attempt == self.max_attempts:
                break
            wait = min(self.backoff_base_s * 2 ** (attempt - 1), self.backoff_cap_s) + random.uniform(
                0, self.jitter_s
            )
            await asyncio.sleep(max(0.0, min(wait, self.deadline_s - (time.monotonic() - start))))
        elapsed = time.monotonic() - start
        raise RemoteRewardError(
            f"remote reward model --rm-url {self.url} gave no reward after {attempt} attempt(s) in {elapsed:.1f} s "
            f"(deadline {self.deadline_s:g} s, max {self.max_attempts} attempts); last failure: {last_failure}"
        )

    async def _attempt(self, payload: dict[str, Any], remaining_s: float) -> float | dict[str, Any]:
        try:
            async with self._client().post(
                self.url, data=fast_json.dumps(payload), headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=remaining_s),
            ) as response:  # fmt: skip
                status, content = response.status, await response.read()
        except (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError) as e:  # a retry cannot help
            raise RemoteRewardError(f"--rm-url {self.url!r} is not a usable http(s) URL: {e}") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as e:
            raise _Retryable(f"{type(e).__name__}: {e}".rstrip(": ")) from None
        text = content.decode(errors="replace")
        if status >= 500 or status == 429:
            raise _Retryable(f"HTTP {status}: {text[:200]!r}")
        if status >= 400:
            raise RemoteRewardError(
                f"remote reward model --rm-url {self.url} rejected the request (not retried): "
                f"HTTP {status}: {text[:500]!r}"
            )
        return self._parse(text)

    def _parse(self, text: str) -> float | dict[str, Any]:
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            body = None
        if isinstance(body, dict):
            return body
        if isinstance(body, (int, float)) and not isinstance(body, bool):
            return float(body)
        raise RemoteRewardError(
            f"remote reward model --rm-url {self.url} returned {text[:200]!r}; expected a JSON number or object"
        )

    def _client(self) -> aiohttp.ClientSession:
        """The shared session, bound to the running event loop (a session cannot cross event loops)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop or self._http.closed:
            connector = aiohttp.TCPConnector(  # idle connections dropped before the server closes them
                limit=self.max_connections, keepalive_timeout=KEEPALIVE_EXPIRY_S, ssl=shared_ssl_context()
            )
            self._loop, self._http = loop, aiohttp.ClientSession(connector=connector)
        return self._http

    async def aclose(self) -> None:
        """Close the shared client (call from the event loop that used it)."""
        if self._http is not None and self._loop is asyncio.get_running_loop():
            await self._http.close()
        self._loop, self._http = None, None


async def remote_rm(sample, *, url: str, **kw) -> float | dict[str, Any]:
    """One-off remote reward with default retry settings; prefer a shared `RemoteRewardModel` in a loop."""
    model = RemoteRewardModel(url=url)
    try:
        return await model(sample)
    finally:
        await model.aclose()
