"""Every command's ``--help`` at 80 and 120 columns: sentences not broken mid-line, no ``<bool>`` type for
a flag, defaults whole, and ``--version`` accepted after any subcommand."""

from __future__ import annotations

import re

import pytest

from lily_mongo._cli.app import main
from lily_mongo._cli.helptext import reflow

COMMANDS = [(), ("run",), ("relay",), ("dlq", "list"), ("dlq", "replay"), ("inbox", "stats"), ("demo",), ("asyncapi",)]


def help_of(
    args: tuple[str, ...], width: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> str:
    monkeypatch.setenv("COLUMNS", str(width))
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setattr("sys.argv", ["lily-mongo", *args, "--help"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("width", [80, 120])
@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a) or "lily-mongo")
def test_help_reads_as_sentences_with_whole_defaults_and_no_bool_type(
    args: tuple[str, ...], width: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = help_of(args, width, monkeypatch, capsys)
    assert "<bool>" not in text, text
    assert "…" not in text, text  # nothing cut: no default, no help text ends in an ellipsis
    lines = [line.rstrip() for line in text.splitlines()]
    # Outside the panels, a line that ends short of the width ends its paragraph (a blank line follows).
    for n, line in enumerate(lines[:-1]):
        if not line.strip() or line.strip()[0] in "│╭╰" or line.lstrip().startswith("Usage:"):
            continue
        if len(line) < width - 25:
            assert not lines[n + 1].strip(), f"broken mid-paragraph:\n{line}\n{text}"
    for url in ("amqp://guest:guest@127.0.0.1:5672/", "mongodb://127.0.0.1:27017/"):
        if url[:10] in text:
            assert url in text, text


def test_paragraphs_are_reflowed_and_kept_apart() -> None:
    assert reflow("one\ntwo\n  three\n\nfour\nfive") == "one two three\n\nfour five"


@pytest.mark.parametrize("args", [("--version",), ("run", "--version"), ("dlq", "list", "--version")])
def test_version_is_accepted_on_every_subcommand(
    args: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lily_mongo import cli

    monkeypatch.setattr("sys.argv", ["lily-mongo", *args])
    cli.main()
    assert re.fullmatch(r"lily-mongo \d+\.\d+\.\d+\S*\n", capsys.readouterr().out)
