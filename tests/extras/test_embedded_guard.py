"""The embedded server corrects mongoeco's commit failpoints only on the mongoeco versions the suite ran on.

Outside them (faked through the version lookup; mongoeco itself is untouched) it leaves
mongoeco's handler as it ships and says so once at INFO.
"""

from __future__ import annotations

import logging

import pytest

from lily_mongo import embedded
from lily_mongo._versions import installed_version

handlers = pytest.importorskip("mongoeco.wire._executor_handlers")
Handlers = handlers.WireSpecialCommandHandlers


@pytest.fixture
def shipped(monkeypatch: pytest.MonkeyPatch) -> object:
    """mongoeco's own commit handler, put back after the test whatever it did."""
    original = Handlers.__dict__["_handle_commit_transaction"]
    monkeypatch.setattr(Handlers, "_handle_commit_transaction", original)
    return original


def test_on_the_tested_mongoeco_commits_consult_the_failpoints(shipped: object) -> None:
    assert embedded.TESTED_MONGOECO.covers(installed_version("mongoeco"))
    assert embedded._patch_commit_failpoints() is True
    patched = Handlers.__dict__["_handle_commit_transaction"]
    assert patched is not shipped
    assert getattr(patched, "_lily_failpoints", False)


def test_on_another_mongoeco_the_handler_stays_as_shipped_and_it_is_said_once(
    shipped: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(embedded, "installed_version", lambda name: "5.0.0")
    caplog.set_level(logging.INFO, logger="lily_mongo")
    assert embedded._patch_commit_failpoints() is False
    assert Handlers.__dict__["_handle_commit_transaction"] is shipped
    said = [r for r in caplog.records if r.name == "lily_mongo"]
    assert len(said) == 1
    assert said[0].levelno == logging.INFO
    assert "mongoeco 5.0.0 as it ships" in said[0].getMessage()
