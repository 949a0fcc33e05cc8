"""``lily-mongo asyncapi TARGET --outbox module:outbox``: a standalone Outbox's declarations in the document."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lily_mongo._cli.app import main

SERVICE = """
from pymongo import AsyncMongoClient
from lily_mongo import Consumer, Json, Outbox, queue

client = AsyncMongoClient("mongodb://127.0.0.1:27017/", connect=False)

@queue("payments.requested", version=1)
async def on_payment(payment: Json[dict]) -> None:
    pass

consumer = Consumer(amqp_url="amqp://guest:guest@127.0.0.1/", name="payments", mongo_client=client, database="shop")
consumer.include(on_payment)
outbox = Outbox(client, "shop", name="web")
outbox.sends("payments.settled", version=1)
"""


def run(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.argv", ["lily-mongo", *argv])
    with pytest.raises(SystemExit) as done:
        main()
    out = capsys.readouterr()
    return int(done.value.code or 0), out.out, out.err


def test_the_outboxs_declarations_join_the_consumers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "paysvc.py").write_text(SERVICE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run(
        ["asyncapi", "paysvc:consumer", "--outbox", "paysvc:outbox", "--format", "json"], monkeypatch, capsys
    )
    assert code == 0, err
    operations = json.loads(out)["operations"]
    assert operations["send.payments.settled"]["action"] == "send"
    assert any(op["action"] == "receive" for op in operations.values())
    code, _, err = run(["asyncapi", "paysvc:consumer", "--outbox", "paysvc:consumer"], monkeypatch, capsys)
    assert code == 2
    assert "--outbox: paysvc:consumer is not a lily_mongo.Outbox (got Consumer)" in err
