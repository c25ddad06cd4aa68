"""Data sets as every role reads them (tauflow.media.data_rows): files, folders, Hugging Face save_to_disk
folders, the column mapping, and chats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tauflow.media import data_rows, read_rows

ROWS = [
    {"question": "2+2?", "solution": "4 #### 4", "idx": "a", "tests": ["assert f(1) == 2"], "level": 3},
    {"question": "3+3?", "solution": "6 #### 6", "idx": "b", "tests": [], "level": 1},
]
GSM8K = {"id_column": "idx", "prompt_column": "question", "answer_column": "solution"}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_column_mapping_names_the_prompt_id_answer_and_metadata(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    rows = data_rows(path, {**GSM8K, "metadata_columns": {"tests": "tests", "difficulty": "level"}})
    assert [r.prompt_id for r in rows] == ["a", "b"]
    assert rows[0].text == "2+2?" and rows[0].messages is None and rows[0].token_ids is None
    # strings as they are; anything else as JSON (a list of tests reaches the reward intact)
    assert rows[0].metadata == {"answer": "4 #### 4", "tests": '["assert f(1) == 2"]', "difficulty": "3"}
    with pytest.raises(ValueError, match="row 0 has none of 'prompt', 'messages'"):
        data_rows(path)  # the default columns are not there


def test_parquet_folders_and_save_to_disk_read_alike(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    want = data_rows(write_jsonl(tmp_path / "d.jsonl", ROWS), GSM8K)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    assert data_rows(tmp_path / "d.parquet", GSM8K) == want
    folder = tmp_path / "shards"
    folder.mkdir()
    write_jsonl(folder / "part-0.jsonl", ROWS[:1])
    pq.write_table(pa.Table.from_pylist(ROWS[1:]), folder / "part-1.parquet")
    assert data_rows(folder, GSM8K) == want
    # what users have: a Hugging Face data set saved with save_to_disk, alone or as a DatasetDict
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"))
    assert data_rows(tmp_path / "hf", GSM8K) == want
    split = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[1:])}
    )
    split.save_to_disk(str(tmp_path / "hfdict"))
    assert data_rows(tmp_path / "hfdict", GSM8K) == want
    assert data_rows(tmp_path / "hfdict", {**GSM8K, "split": "test"}) == want[1:]
    with pytest.raises(ValueError, match="no split 'validation'; its splits: train, test"):
        read_rows(tmp_path / "hfdict", "validation")


def test_chats_and_the_chat_template_setting(tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "2+2?"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": chat, "answer": "4"}, {"prompt": "3+3?", "answer": "6"}])
    auto = data_rows(path)
    assert auto[0].messages == chat and auto[1].text == "3+3?"
    always = data_rows(path, {"chat_template": "always", "system_prompt": "Answer briefly."})
    system = {"role": "system", "content": "Answer briefly."}
    assert always[0].messages == [system, *chat]
    assert always[1].messages == [system, {"role": "user", "content": "3+3?"}] and always[1].text is None
    with pytest.raises(ValueError, match="row 0: a chat .* but chat_template is never"):
        data_rows(path, {"chat_template": "never"})
    # a chat stored as a JSON string (a Parquet column of text) reads the same
    path = write_jsonl(tmp_path / "s.jsonl", [{"messages": json.dumps(chat), "answer": "4"}])
    assert data_rows(path)[0].messages == chat


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ([], "must be a non-empty list"),
        ([{"role": "user"}], r"messages\[0\] must be an object with string 'role' and 'content'"),
        ([{"role": "user", "content": 3}], r"messages\[0\] must be an object"),
        ([{"role": "wizard", "content": "x"}], r"messages\[0\].role must be one of system, user, assistant, tool"),
        ([{"role": "user", "content": "x"}] * 257, "257 messages, at most 256"),
    ],
)
def test_bad_chats_are_refused_naming_the_message(tmp_path: Path, messages: list, problem: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}])
    with pytest.raises(ValueError, match=problem):
        data_rows(path)
