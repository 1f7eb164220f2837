"""`--rm-type remote_rm`: score a sample with an HTTP reward service at `--rm-url`.

Protocol: POST a JSON object `{"prompt": ..., "response": ..., "label": ...}`; the JSON body of the reply is
the reward (a number, or a dict from which `--reward-key` picks the training value).

Failure handling: connection errors, timeouts, 5xx and 429 replies are retried with exponential backoff plus
jitter (`min(backoff_base_s * 2**k, backoff_cap_s) + U(0, jitter_s)` seconds), at most `max_attempts` tries
and never past `deadline_s` (default 120 s) from the first try; then one `RemoteRewardError` names the URL,
the attempt count and the last failure. Any other 4xx means the request itself is wrong: no retry, the error
carries the status and the start of the body. One `httpx.AsyncClient` (connection pool) is shared per event
loop.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from clawrl.engine.http.client import KEEPALIVE_EXPIRY_S


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
    """Connection pool size of the shared client."""
    _loop: Any = field(default=None, repr=False)
    _http: httpx.AsyncClient | None = field(default=None, repr=False)

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
            # wait_for bounds the whole request; httpx's own timeout only bounds each network phase.
            response = await asyncio.wait_for(
                self._client().post(self.url, json=payload, timeout=remaining_s), remaining_s
            )
        except (httpx.TransportError, asyncio.TimeoutError) as e:
            raise _Retryable(f"{type(e).__name__}: {e}".rstrip(": ")) from None
        if response.status_code >= 500 or response.status_code == 429:
            raise _Retryable(f"HTTP {response.status_code}: {response.text[:200]!r}")
        if response.status_code >= 400:
            raise RemoteRewardError(
                f"remote reward model --rm-url {self.url} rejected the request (not retried): "
                f"HTTP {response.status_code}: {response.text[:500]!r}"
            )
        return self._parse(response)

    def _parse(self, response: httpx.Response) -> float | dict[str, Any]:
        try:
            body = response.json()
        except json.JSONDecodeError:
            body = None
        if isinstance(body, dict):
            return body
        if isinstance(body, (int, float)) and not isinstance(body, bool):
            return float(body)
        raise RemoteRewardError(
            f"remote reward model --rm-url {self.url} returned {response.text[:200]!r}; "
            "expected a JSON number or object"
        )

    def _client(self) -> httpx.AsyncClient:
        """The shared client, bound to the running event loop (an AsyncClient cannot cross event loops)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:
            limits = httpx.Limits(  # idle connections dropped before the server closes them (client.py)
                max_connections=self.max_connections,
                max_keepalive_connections=self.max_connections,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            )
            self._loop, self._http = loop, httpx.AsyncClient(limits=limits)
        return self._http

    async def aclose(self) -> None:
        """Close the shared client (call from the event loop that used it)."""
        if self._http is not None and self._loop is asyncio.get_running_loop():
            await self._http.aclose()
        self._loop, self._http = None, None


async def remote_rm(sample, *, url: str, **kw) -> float | dict[str, Any]:
    """One-off remote reward with default retry settings; prefer a shared `RemoteRewardModel` in a loop."""
    model = RemoteRewardModel(url=url)
    try:
        return await model(sample)
    finally:
        await model.aclose()
