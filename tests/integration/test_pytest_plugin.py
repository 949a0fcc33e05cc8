"""The pytest plugin's fixtures, as a user's test suite sees them (run by pytest in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

USER_TESTS = """
import uuid
from lily_mongo import Consumer, Json, MongoScope, queue
from lily_mongo.testing import TestConsumer

@queue("notes", version=1, handler_id="notes.v1")
async def save(note: Json[dict], mongo: MongoScope) -> None:
    await mongo.database["notes"].insert_one({"text": note["text"]}, session=mongo.session)

def make(client, database):
    consumer = Consumer(amqp_url="amqp://127.0.0.1:1/", name="notes", mongo_client=client, database=database)
    consumer.include(save)
    return consumer

async def test_a_fresh_database_per_test_a(lily_mongo_client, lily_mongo_database):
    async with TestConsumer(make(lily_mongo_client, lily_mongo_database)) as tc:
        assert (await tc.publish_json("notes", {"text": "a"}, version=1)).outcome == "acked"
        assert await tc.database["notes"].count_documents({}) == 1

async def test_a_fresh_database_per_test_b(lily_mongo_client, lily_mongo_database):
    assert await lily_mongo_client[lily_mongo_database]["notes"].count_documents({}) == 0
"""


def test_the_plugin_gives_a_server_for_the_session_and_a_fresh_database_per_test(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(textwrap.dedent(USER_TESTS))
    env = {k: v for k, v in os.environ.items() if k != "LILY_MONGO_URI"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout
