from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from environments.datasets import (
    DatasetValidationError,
    builtin_names,
    inspect_file,
    load_rows,
    resolve,
)
from environments.registry import ContractError

ROOT = Path(__file__).resolve().parents[2]


def test_it_ships_valid_builtin_datasets_in_train_and_test_splits() -> None:
    assert builtin_names() == [
        "arith_test",
        "arith_train",
        "geometry_test",
        "geometry_train",
        "word_test",
        "word_train",
    ]
    geometry = {
        split: load_rows(resolve(f"builtin:geometry_{split}"), "geometry")
        for split in ("train", "test")
    }
    assert (len(geometry["train"]), len(geometry["test"])) == (512, 128)
    for prefix in ("arith", "word"):
        train = load_rows(resolve(f"builtin:{prefix}_train"), "math")
        test = load_rows(resolve(f"builtin:{prefix}_test"), "math_code")
        assert len(train) == 2000 and len(test) == 300
        assert not {r["question"] for r in train} & {r["question"] for r in test}
        assert all(r["answer"].lstrip("-").replace("/", "").isdigit() for r in train)


def test_it_regenerates_the_committed_datasets_exactly() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_datasets.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_it_reports_the_first_bad_jsonl_rows_by_number_column_and_reason(tmp_path: Path) -> None:
    lines = [
        json.dumps({"question": "What is 1+1?", "answer": "2"}),
        json.dumps({"question": "", "answer": "2"}),
        "{not json",
        json.dumps({"question": "Q", "answer": True}),
        json.dumps(["a", "list"]),
        json.dumps({"answer": 3}),
        json.dumps({"question": "ok", "answer": 4.5}),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DatasetValidationError) as err:
        load_rows(path, "math")
    errors = err.value.as_list()
    assert errors[0] == {"row": 2, "column": "question", "reason": "empty"}
    assert errors[1]["row"] == 3 and errors[1]["reason"].startswith("not valid JSON")
    assert errors[2] == {"row": 4, "column": "answer", "reason": "expected str or number, got bool"}
    assert errors[3] == {"row": 5, "column": None, "reason": "expected a JSON object, got list"}
    assert errors[4] == {"row": 6, "column": "question", "reason": "missing"}
    assert err.value.bad_rows == 5
    assert "row 2, column 'question': empty" in str(err.value)


def test_it_checks_the_optional_context_column_only_where_a_row_has_one(tmp_path: Path) -> None:
    turns = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]
    lines = [
        {"question": "What is 1+1?", "answer": "2"},
        {"question": "And 2+2?", "answer": "4", "context": turns},
        {"question": "And 3+3?", "answer": "6", "context": None},
        {"question": "Q", "answer": "1", "context": "earlier"},
        {"question": "Q", "answer": "1", "context": turns[:1]},
    ]
    path = tmp_path / "context.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in lines))
    with pytest.raises(DatasetValidationError) as err:
        load_rows(path, "math")
    errors = err.value.as_list()
    assert [(e["row"], e["column"]) for e in errors] == [(4, "context"), (5, "context")]
    assert errors[0]["reason"] == "expected list, got str"
    assert "end with an assistant turn" in errors[1]["reason"]
    path.write_text("".join(json.dumps(row) + "\n" for row in lines[:3]))
    assert [r.get("context") for r in load_rows(path, "math")] == [None, turns, None]


def test_an_sft_completion_is_optional_text(tmp_path: Path) -> None:
    lines = [
        {"question": "Your move?", "answer": "bet", "completion": "[bet]"},
        {"question": "Your move?", "answer": "bet", "completion": " "},
        {"question": "Your move?", "answer": "bet", "completion": ["[bet]"]},
    ]
    path = tmp_path / "completion.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in lines))
    with pytest.raises(DatasetValidationError) as err:
        load_rows(path, "math")
    assert [(e["row"], e["column"], e["reason"]) for e in err.value.as_list()] == [
        (2, "completion", "empty"),
        (3, "completion", "expected str, got list"),
    ]


def test_it_caps_the_number_of_reported_errors(tmp_path: Path) -> None:
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"question": "q"}) + "\n" for _ in range(100)))
    report = inspect_file(path, "math", max_errors=3)
    assert [e.row for e in report.errors] == [1, 2, 3]
    assert report.bad_rows == 100 and report.rows == 100
    assert not report.ok


def test_it_reads_and_validates_parquet(tmp_path: Path) -> None:
    good = tmp_path / "good.parquet"
    pq.write_table(
        pa.table(
            {
                "question": ["What is 2+2?", "What is 3+3?"],
                "answer": ["4", "6"],
                "source": ["a", "b"],
            }
        ),
        good,
    )
    rows = load_rows(good, "math")
    assert rows[1] == {"question": "What is 3+3?", "answer": "6", "source": "b"}
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["q1", None], "answer": [1, 2]}), bad)
    with pytest.raises(DatasetValidationError) as err:
        load_rows(bad, "math")
    assert err.value.as_list() == [{"row": 2, "column": "question", "reason": "missing"}]


def test_it_refuses_corrupt_empty_and_unknown_files(tmp_path: Path) -> None:
    corrupt = tmp_path / "x.parquet"
    corrupt.write_bytes(b"PAR1 not really")
    assert "not a readable Parquet file" in inspect_file(corrupt, "math").errors[0].reason
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DatasetValidationError, match="no rows"):
        load_rows(empty, "math")
    with pytest.raises(DatasetValidationError, match="unknown file type"):
        load_rows(tmp_path / "data.csv", "math")
    with pytest.raises(DatasetValidationError, match="unknown built-in dataset"):
        resolve("builtin:nope")


def test_it_reports_row_count_and_checksum(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": 1}) + "\n")
    report = inspect_file(path, "math_code")
    assert report.ok and report.rows == 1
    assert report.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert report.columns == ["answer", "question"]


def test_it_refuses_datasets_for_generator_envs(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": 1}) + "\n")
    with pytest.raises(ContractError, match="generator environment"):
        inspect_file(path, "bandit")


def test_it_refuses_rows_it_could_not_store_faithfully(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "\n".join(
            [
                '{"question": "x", "answer": NaN}',
                '{"question": "\\ud800", "answer": "1"}',
                '{"question": "x", "answer": "1", "context": [{"role": "user", "content": '
                '"\\udfff"}]}',
                '{"question": "x", "answer": -Infinity}',
                '{"question": ' + "[" * 100_000 + "]" * 100_000 + ', "answer": "1"}',
                '{"question": "x", "answer": 1' + "0" * 5000 + "}",
                '{"\\ud800": 1, "question": "x", "answer": "1"}',
                '{"question": "What is 1+1?", "answer": 2.5}',
            ]
        )
        + "\n"
    )
    report = inspect_file(path, "math")
    assert [(e.row, e.column, e.reason) for e in report.errors] == [
        (1, "answer", "NaN is not allowed: numbers must be finite"),
        (2, "question", "surrogate characters are not allowed (a lone \\ud800-\\udfff escape)"),
        (3, "context", "surrogate characters are not allowed (a lone \\ud800-\\udfff escape)"),
        (4, "answer", "-Infinity is not allowed: numbers must be finite"),
        (5, None, "not valid JSON: nested too deeply"),
        (6, None, "not valid JSON: a number has more than 4300 digits"),
        (
            7,
            None,
            "a column name: surrogate characters are not allowed (a lone \\ud800-\\udfff escape)",
        ),
    ]
    assert report.rows == 8 and report.bad_rows == 7


def test_it_refuses_non_finite_numbers_in_parquet(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"question": ["q1", "q2"], "answer": [1.0, float("inf")]}), path)
    with pytest.raises(DatasetValidationError) as err:
        load_rows(path, "math")
    assert err.value.as_list() == [
        {"row": 2, "column": "answer", "reason": "Infinity is not allowed: numbers must be finite"}
    ]
