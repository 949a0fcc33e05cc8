"""The embedded server's corrections (``lily_mongo._embedded``) are made only on the mongoeco versions the
suite ran on; outside them (faked through the version lookup) the server runs mongoeco as it ships and
says so once at INFO (docs/emulator.md)."""

from __future__ import annotations

import logging

import pytest

from lily_mongo import embedded
from lily_mongo._versions import installed_version

pytest.importorskip("mongoeco")


def test_on_the_tested_mongoeco_the_corrections_are_made() -> None:
    assert embedded.TESTED_MONGOECO.covers(installed_version("mongoeco"))
    assert embedded._corrections() is True


def test_on_another_mongoeco_the_server_runs_as_shipped_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(embedded, "installed_version", lambda name: "5.0.0")
    caplog.set_level(logging.INFO, logger="lily_mongo")
    assert embedded._corrections() is False
    said = [r for r in caplog.records if r.name == "lily_mongo"]
    assert len(said) == 1
    assert said[0].levelno == logging.INFO
    assert "mongoeco 5.0.0 as it ships" in said[0].getMessage()
    assert "write conflicts are global" in said[0].getMessage()
