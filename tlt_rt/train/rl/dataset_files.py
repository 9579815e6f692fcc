"""Dataset files as problems: .jsonl, .json (a list of objects) or .parquet question/answer records, with
verl's and TRL's layouts loading as they are."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tlt_rt.train.rl.tasks import Problem

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


class DatasetError(ValueError):
    """A dataset file that cannot be turned into problems; the message names the file and the place."""


def reference_answer(raw: Any) -> str:
    """A dataset answer as a reference string: GSM8K's "...\\n#### 1,234" becomes "1234"."""
    if isinstance(raw, bool):
        return str(raw)
    if isinstance(raw, float) and raw.is_integer():
        return str(int(raw))
    text = str(raw)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    text = text.strip()
    # Commas are thousands separators only when what remains is a number; "x, y" keeps its comma.
    plain = text.replace(",", "")
    return plain if _NUMBER.fullmatch(plain) else text


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise DatasetError(
            f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}, line {line}); "
            "re-encode it as UTF-8, e.g. iconv -f latin1 -t utf-8"
        ) from e


def _read_records(path: Path) -> list[tuple[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        records = []
        for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append((f"line {lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}: line {lineno} is not valid JSON: {e.msg}") from e
        return records
    if suffix == ".json":
        try:
            data = json.loads(_read_text(path))
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from e
        if not isinstance(data, list):
            raise DatasetError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        return [(f"record {i}", rec) for i, rec in enumerate(data)]
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional (tlt_rt[data]), needed only for .parquet
        except ImportError as e:
            raise DatasetError(f"{path}: reading parquet needs pyarrow: pip install pyarrow (or tlt_rt[data])") from e
        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError family: name the file
            raise DatasetError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
        return [(f"row {i}", rec) for i, rec in enumerate(table.to_pylist())]
    raise DatasetError(f"{path}: unsupported dataset format {suffix!r}; use .jsonl, .json or .parquet")


# the defaults' fallbacks: verl's parquet (`prompt` messages, `reward_model.ground_truth`) and TRL's
# (`prompt`, with `solution` / `ground_truth` / `answer` columns)
QUESTION_FALLBACKS = ("prompt",)
ANSWER_FALLBACKS = ("reward_model.ground_truth", "solution", "ground_truth")


def _get(record: dict, name: str) -> Any:
    """`record[name]`, or for a dotted name the nested value (`reward_model.ground_truth`); None if absent."""
    if name in record:
        return record[name]
    value: Any = record
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _first(record: dict, names: Sequence[str]) -> tuple[str, Any]:
    for name in names:
        value = _get(record, name)
        if value is not None:
            return name, value
    return names[0], None


def _chat(value: Any) -> list[dict[str, str]] | None:
    """A chat message list ([{role, content}, ...]) as plain dicts, or None when `value` is not one."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in value):  # fmt: skip
        return None
    return [{"role": m["role"], "content": m["content"]} for m in value]


def load_dataset_file(
    path: str | Path, question_field: str = "question", answer_field: str = "answer"
) -> list[Problem]:
    """Problems from a .jsonl, .json (a list of objects) or .parquet file of question/answer records.

    The question may be text or a chat message list; with the default field names, verl's and TRL's
    layouts load as they are (see QUESTION_FALLBACKS / ANSWER_FALLBACKS)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    records = _read_records(path)
    if not records:
        raise DatasetError(f"{path}: the dataset is empty")
    q_names = [question_field, *(QUESTION_FALLBACKS if question_field == "question" else ())]
    a_names = [answer_field, *(ANSWER_FALLBACKS if answer_field == "answer" else ())]
    problems = []
    for index, (where, record) in enumerate(records):
        if not isinstance(record, dict):
            raise DatasetError(f"{path}, {where}: expected an object, got {type(record).__name__}")
        (q_name, question), (_, raw) = _first(record, q_names), _first(record, a_names)
        for names, value in ((q_names, question), (a_names, raw)):
            if value is None:
                keys = ", ".join(sorted(map(str, record))) or "none"
                also = f" (also tried {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
                raise DatasetError(f"{path}, {where}: missing field {names[0]!r}; available keys: {keys}{also}")
        messages = _chat(question)
        if messages is not None:
            users = [m["content"] for m in messages if m["role"] == "user"]
            question = users[-1] if users else messages[-1]["content"]
        elif not isinstance(question, str):
            raise DatasetError(f"{path}, {where}: field {q_name!r} must be text or a list of chat messages "
                               f"({{'role': ..., 'content': ...}}), got {type(question).__name__}")  # fmt: skip
        meta = {"source": str(path), "index": index, "raw_answer": raw}
        problems.append(Problem(question=question, answer=reference_answer(raw), meta=meta, messages=messages))
    return problems
