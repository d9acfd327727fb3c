"""Reading text documents from files, for calibration and for evaluation alike.

One reader so that `--calib-data` and `validate --eval-data` accept the same files: a `.txt`
(documents separated by blank lines), a `.jsonl` (one `{"text": ...}` per line), a `.json`
(a list of such records, or `{"text": [...]}`) or a `.parquet` file with a `text` column.
Anything else is read as plain text. The small built-in set of prose, code and dialogue ships
in the package (`mpsconvert/data/builtin.jsonl`).
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import DataError
from .extras import require
from .untrusted import parse_json

BUILTIN = Path(__file__).parents[1] / "data" / "builtin.jsonl"
READABLE = (".parquet", ".jsonl", ".json", ".txt")


def _texts_from_records(records, where: str) -> list[str]:
    out = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise DataError(
                f"{where}: record {i + 1} has no string field 'text'",
                "give one JSON object per line with a 'text' field",
            )
        out.append(rec["text"])
    return out


def read_documents(path: Path) -> list[str]:
    """The documents in one file, by its extension (anything unknown is read as plain text).

    Raises:
        DataError: the file cannot be read, is not UTF-8, or its records have no 'text'.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            pq = require("pyarrow.parquet", "data", f"reading {path.name} (parquet)")

            table = pq.read_table(path)
            if "text" not in table.column_names:
                raise DataError(
                    f"{path}: parquet file has no 'text' column (columns: {', '.join(table.column_names)})",
                    "use a dataset with a 'text' column",
                )
            return [t for t in table.column("text").to_pylist() if isinstance(t, str)]
        raw = path.read_text(encoding="utf-8")
        if suffix == ".jsonl":
            records = []
            for n, line in enumerate(raw.splitlines(), 1):
                if line.strip():
                    records.append(
                        parse_json(
                            line,
                            what=f"{path}:{n}",
                            error=DataError,
                            expect=None,
                            fix="give one JSON object per line with a 'text' field",
                        )
                    )
            return _texts_from_records(records, str(path))
        if suffix == ".json":
            body = parse_json(
                raw, what=str(path), error=DataError, expect=None, fix="give a list of objects with a 'text' field"
            )
            if isinstance(body, dict) and isinstance(body.get("text"), list):
                return [t for t in body["text"] if isinstance(t, str)]
            if not isinstance(body, list):
                raise DataError(
                    f"{path}: JSON is not a list of records", "give a list of objects with a 'text' field, or JSONL"
                )
            return _texts_from_records(body, str(path))
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text", "convert it to UTF-8") from e
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}", "check the path") from e
    return [d for d in re.split(r"\n\s*\n", raw)]
