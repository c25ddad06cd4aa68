"""The tokens file's errors: each names the file, line and column of the entry, and none quotes the file —
a token in the wrong place (a YAML error's excerpt, a token where a name belongs) never reaches a log."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tauflow.queue.tokens import MAX_FILE_BYTES, TokensError, TokenTable, parse_tokens

SECRET = "s3cr3t-" + "x" * 20  # the token that must not appear in any error


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (f"- {SECRET}\n", "must hold `client_name: token` lines, not a YAML sequence"),
        ("agent: short\n", "tokens.yaml, line 1, column 8: a token must be a string of 16 to 1024 characters"),
        ("agent: 'with space in it, long enough'\n", "line 1, column 8: a token must be"),
        (f"agent: {'t' * 1025}\n", "line 1, column 8: a token must be a string of 16 to 1024"),
        (f"'bad name!': {SECRET}\n", "line 1, column 1: a client name must be 1-64 letters"),
        (f"unknown: {SECRET}\n", "line 1, column 1: a client name must be"),
        (f"ok: {SECRET}\n{SECRET}!: agent\n", "line 2, column 1: a client name must be"),
        (f"{SECRET}: agent\n", "line 1, column 30: a token must be"),  # swapped: the name is the token
        (f"one: {SECRET}\ntwo: {SECRET}\n", "tokens.yaml: lines 1 and 2 share a token"),
        (f"one: {SECRET}\none: {SECRET}-other\n", "tokens.yaml: lines 1 and 2 name the same client"),
        ("agent: [not, a, string]\n", "line 1, column 8: a token must be"),
        ("agent: 1234567890123456789\n", "line 1, column 8: a token must be"),  # a number, not a string
        # YAML errors: where, never what (PyYAML's own message quotes the line)
        (f"agent: {SECRET}\nother: [{SECRET}\n", "tokens.yaml, line 3, column 1: does not parse as YAML"),
        (f"agent: {SECRET}\n\t{SECRET}\n", "line 2, column 1: does not parse as YAML"),
        (f'agent: "{SECRET}\\q"\n', "line 1, column "),
        (f"agent: *{SECRET}\n", "line 1, column 8: does not parse as YAML"),
    ],
)
def test_a_bad_tokens_file_is_refused_with_its_line_and_never_its_text(text: str, words: str) -> None:
    with pytest.raises(TokensError) as e:
        parse_tokens(text, "tokens.yaml")
    message = str(e.value)
    assert words in message
    assert SECRET not in message and "x" * 20 not in message and "t" * 20 not in message
    # nor a chained PyYAML error quoting the line (a traceback at log.level=DEBUG would print it)
    assert e.value.__cause__ is None and (e.value.__suppress_context__ or e.value.__context__ is None)


def test_a_good_file_parses() -> None:
    table = parse_tokens(f"# clients\nagent-a: {SECRET}\n'agent-b': \"{SECRET}-b\"\n", "tokens.yaml")
    assert sorted(table.values()) == ["agent-a", "agent-b"]
    assert parse_tokens("", "tokens.yaml") == {}


def test_the_file_is_bounded_and_must_be_text(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text(f"agent: {SECRET}\n" + "#" * MAX_FILE_BYTES)
    with pytest.raises(TokensError, match="larger than"):
        TokenTable(big)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(f"agent: {SECRET}\n".encode() + b"\xff\xfe")
    with pytest.raises(TokensError, match=r"not UTF-8 text \(byte 35\)"):
        TokenTable(binary)


def test_a_bad_edit_is_logged_without_its_text(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(f"agent: {SECRET}\n")
    now = [0.0]
    table = TokenTable(path, reload_interval_s=1.0, clock=lambda: now[0])
    other = "o" * 24
    path.write_text(f"agent: {SECRET}\nnew: [{other}\n")  # a YAML error on the line with a new token
    now[0] = 2.0
    with caplog.at_level(logging.ERROR, logger="tauflow.queue.tokens"):
        assert table.lookup(SECRET) == "agent"  # the tokens in force stay
    [record] = [r for r in caplog.records if "not reloaded" in r.getMessage()]
    logged = caplog.text + str(record.__dict__)
    assert "line 3, column 1" in logged and other not in logged and SECRET not in logged
