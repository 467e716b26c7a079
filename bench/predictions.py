"""What `bench/chaos` and `deploy/check` read of a host run's `predictions.jsonl` (one JSON
record a line): the answers by request id, and how many lines are written so far."""

import json
from pathlib import Path


def read_answers(path):
    """(answers by id, ids answered more than once, ids answered with an error)."""
    answers, duplicated, errors = {}, set(), set()
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        rid = rec["request_id"]
        if rid in answers or rid in errors:
            duplicated.add(rid)
        if "error" in rec:
            errors.add(rid)
        else:
            answers[rid] = rec["top_k"]
    return answers, duplicated, errors


def lines_written(path):
    """The records written to `path` so far (0 before the file exists)."""
    try:
        return Path(path).read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0
