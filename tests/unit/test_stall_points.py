"""Stall points: only the listed names hang; an unknown name is refused before anything starts."""

import threading
import time

import pytest

from clawrl import stall_points
from clawrl.cli.preflight import _stall_points
from clawrl.config.errors import ConfigError


def test_listed_point_hangs_and_others_return(monkeypatch):
    monkeypatch.setenv("CLAWRL_STALL_AT", " trainer.save , engine.start")
    monkeypatch.setattr(stall_points, "STALL_S", 0.3)
    assert stall_points.requested() == ["trainer.save", "engine.start"]
    started = time.monotonic()
    stall_points.stall_point("trainer.init")
    assert time.monotonic() - started < 0.05
    done = threading.Event()
    thread = threading.Thread(target=lambda: (stall_points.stall_point("engine.start"), done.set()))
    thread.start()
    assert not done.wait(0.15)  # still stalled
    thread.join(2)
    assert done.is_set()


def test_unset_means_no_stall(monkeypatch):
    monkeypatch.delenv("CLAWRL_STALL_AT", raising=False)
    assert stall_points.requested() == [] and stall_points.unknown() == []
    _stall_points()  # nothing to refuse


def test_unknown_name_is_one_error_naming_it_and_the_known_points(monkeypatch):
    monkeypatch.setenv("CLAWRL_STALL_AT", "trainer.save,trainer.sav")
    with pytest.raises(ConfigError) as error:
        _stall_points()
    message = str(error.value)
    assert message.startswith("CLAWRL_STALL_AT: unknown stall point 'trainer.sav'; known: engine.start, ")
    assert "trainer.save" in message
