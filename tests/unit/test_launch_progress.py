"""`EncoderPool.launch` shows its start-up on stderr where the caller has not set up logging (a
start takes tens of seconds, and Python shows nothing below WARNING without a handler), stays
quiet with `progress=False`, and leaves logging the caller set up as it is. Without a cluster:
the launch itself is stood in by one that logs as the real one does."""

from __future__ import annotations

import logging

import pytest

from vitpool.pool import encoder_pool, launcher
from vitpool.pool.encoder_pool import EncoderPool

JOINED_LINE = "Ray cluster at 10.0.0.1:6379 (from RAY_ADDRESS)"
READY_LINE = "encoder actor 0 ready on cuda:0 in 5.3 s (27 budgets, 0 disabled) [1/1]"


class Stopped(Exception):
    """Ends the stand-in launch once it has logged (no pool handle is built)."""


def logging_launch(*args):
    logging.getLogger("vitpool.pool.cluster").info(JOINED_LINE)
    logging.getLogger("vitpool.pool.launcher").info(READY_LINE)
    logging.getLogger("vitpool.pool.launcher").debug("not shown: below INFO")
    raise Stopped


@pytest.fixture
def unconfigured_logging(monkeypatch, request):
    """Call it first in the test: logging as in a script that never configured it. (pytest puts
    its own handler on the root logger as the test starts, after the fixtures.)"""
    monkeypatch.setattr(encoder_pool, "launch_pool", logging_launch)
    library = logging.getLogger("vitpool")
    level = library.level
    request.addfinalizer(lambda: library.setLevel(level))

    def unconfigured() -> logging.Logger:
        monkeypatch.setattr(logging.getLogger(), "handlers", [])
        monkeypatch.setattr(library, "handlers", [])
        library.setLevel(logging.NOTSET)
        return library

    return unconfigured


def launch(**arguments) -> None:
    with pytest.raises(Stopped):
        EncoderPool.launch(device="cpu", **arguments)


def test_launch_shows_its_progress_on_stderr_by_default_and_then_leaves_logging_as_it_was(
    unconfigured_logging, capsys
):
    library = unconfigured_logging()
    launch()
    assert capsys.readouterr().err.splitlines() == [f"vitpool: {JOINED_LINE}", f"vitpool: {READY_LINE}"]
    assert library.handlers == [] and library.level == logging.NOTSET


def test_launch_is_quiet_when_asked(unconfigured_logging, capsys):
    unconfigured_logging()
    launch(progress=False)
    assert capsys.readouterr().err == ""


CONFIGURED = [
    # (what the caller configured) each leaves vitpool's lines to the caller's own logging
    "a handler on the root logger",  # logging.basicConfig(...)
    "a handler on vitpool's logger",  # as the command line's own progress lines
    "a level on vitpool's logger",  # logging.getLogger("vitpool").setLevel(logging.WARNING): quiet
]


@pytest.mark.parametrize("configured", CONFIGURED)
def test_logging_the_caller_set_up_is_used_as_it_is(unconfigured_logging, capsys, configured):
    library = unconfigured_logging()
    own = logging.NullHandler()
    if configured == "a handler on the root logger":
        logging.getLogger().handlers.append(own)
    elif configured == "a handler on vitpool's logger":
        library.handlers.append(own)
    else:
        library.setLevel(logging.WARNING)
    launch()
    assert capsys.readouterr().err == ""
    assert library.handlers == ([own] if configured == "a handler on vitpool's logger" else [])


def test_progress_handler_is_removed_when_the_launch_fails(unconfigured_logging):
    library = unconfigured_logging()
    with pytest.raises(RuntimeError), launcher.progress_on_stderr(True):
        assert len(library.handlers) == 1 and library.level == logging.INFO
        raise RuntimeError("an actor failed to start")
    assert library.handlers == [] and library.level == logging.NOTSET
