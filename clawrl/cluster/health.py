"""EngineHealthMonitor: a driver thread that checks every engine with a real one-token generation while
rollouts run (`--use-fault-tolerance`), and hands a dead or hung engine to a recovery callback.

    monitor = EngineHealthMonitor(lambda: pool.urls, recover, interval_s=30, timeout_s=30, first_wait_s=0)
    monitor.start()
    monitor.resume()     # a rollout or eval starts (re-arms the first wait)
    monitor.pause()      # engines about to be released / weights synced: waits for a running check or recovery
    monitor.stop()

An engine fails when `/health_generate` errors or does not answer within `timeout_s` (a hung server keeps its
socket open, so only the deadline catches it). `recover(index, reason)` runs in this thread, with the monitor
holding its lock, so `pause()` returns only once the replacement serves the current weights.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from clawrl.engine.http.client import EngineClient, EngineClientError

logger = logging.getLogger(__name__)


class EngineHealthMonitor:
    """Checks engines one after the other every `interval_s` while resumed."""

    def __init__(self, urls: Callable[[], list[str]], recover: Callable[[int, str], None], *,
                 interval_s: float, timeout_s: float, first_wait_s: float) -> None:  # fmt: skip
        self.urls, self.recover = urls, recover
        self.interval_s, self.timeout_s, self.first_wait_s = interval_s, timeout_s, first_wait_s
        self._resumed = threading.Event()
        self._stopped = threading.Event()
        self._busy = threading.Lock()
        self._epoch = 0  # bumped by every resume/pause, so a round started before a pause is abandoned
        self._thread = threading.Thread(target=self._loop, name="clawrl-health-monitor", daemon=True)
        self.error: BaseException | None = None
        """A recovery that failed; the loop re-raises it at its next step."""

    def start(self) -> None:
        self._thread.start()

    def resume(self) -> None:
        self._epoch += 1
        self._resumed.set()

    def pause(self) -> None:
        self._epoch += 1
        self._resumed.clear()
        with self._busy:  # a check or recovery in progress finishes first
            pass

    def stop(self) -> None:
        self._stopped.set()
        self._resumed.set()
        self._thread.join(self.timeout_s + self.interval_s + 5)

    def _loop(self) -> None:
        while not self._stopped.is_set():
            self._resumed.wait()
            epoch = self._epoch
            if self._stopped.wait(self.first_wait_s) or epoch != self._epoch:
                continue
            while self._resumed.is_set() and not self._stopped.is_set() and epoch == self._epoch:
                self._round(epoch)
                self._stopped.wait(self.interval_s)

    def _round(self, epoch: int) -> None:
        with self._busy:
            for index, url in enumerate(self.urls()):
                if epoch != self._epoch or self._stopped.is_set():
                    return
                reason = self.check(url)
                if reason is None or epoch != self._epoch:
                    continue
                try:
                    self._replace(index, url, reason)
                except BaseException as error:  # noqa: BLE001 (handed to the loop, which raises it)
                    logger.error("recovery of engine %d failed: %s", index, error)
                    self.error = error

    def _replace(self, index: int, url: str, reason: str) -> None:
        logger.warning("engine %d (%s) failed its health check: %s; replacing it", index, url, reason)
        self.recover(index, reason)

    def check_now(self) -> int:
        """Check every engine now, in the caller's thread, and recover the failed ones (errors propagate);
        returns how many were replaced. Used before a weight sync, which needs every engine alive."""
        replaced = 0
        with self._busy:
            for index, url in enumerate(self.urls()):
                reason = self.check(url)
                if reason is not None:
                    self._replace(index, url, reason)
                    replaced += 1
        return replaced

    def check(self, url: str) -> str | None:
        """None if the engine generated a token within the deadline, else why not."""
        started = time.monotonic()
        try:
            with EngineClient(url, timeout=self.timeout_s) as client:
                client.health_generate(timeout=self.timeout_s)
        except EngineClientError as error:
            return f"{error} (after {time.monotonic() - started:.1f} s)"
        except Exception as error:  # noqa: BLE001 (any transport failure means the engine is unusable)
            return f"{type(error).__name__}: {error}"
        return None
