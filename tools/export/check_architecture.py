#!/usr/bin/env python3
"""Checks the claims of ARCHITECTURE.md that a search of the Rust sources can check.

    python3 tools/export/check_architecture.py [--root DIR]

Each rule is a claim, a pattern that breaks it, and the files allowed to hold the pattern
(each with why). Library code is every `src/` of the crates below, less `main.rs` and `src/bin/`
(binaries) and less test code (from `#[cfg(test)]` to the end of the file, where this project
keeps its test modules); comment lines are skipped. Prints every breach as
`path:line: claim: the line` and exits 1, or prints `N claims hold in M files` and exits 0.
Pure standard library.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

CRATES = ("client/src", "common/codec/src", "common/src", "common/tables/src", "server/src", "host/src")


@dataclass(frozen=True)
class Rule:
    claim: str
    pattern: re.Pattern[str]
    # Where the rule applies: paths relative to the root that start with one of these.
    scope: tuple[str, ...] = CRATES
    # Files that may hold the pattern, each with the reason it is allowed.
    allowed: dict[str, str] = field(default_factory=dict)


RULES = (
    Rule(
        "every channel is bounded",
        re.compile(r"\bunbounded_channel\b"),
        allowed={
            "client/src/infer.rs": "a request's frames: its callers bound the requests queued (the host by in-flight tokens)",
            "host/src/client/mod.rs": "the prefix thread's outcomes: at most `in_flight` requests",
            "server/src/lib.rs": "device events: a few per device failure or restart",
        },
    ),
    # `Status::from(RequestError)` goes through the map; any other constructor bypasses it.
    Rule(
        "server::error::status_code is the only status map",
        re.compile(r"\bStatus::(?!from\b)[a-z_]+\s*\("),
        scope=("server/src",),
        allowed={"server/src/error.rs": "the map itself"},
    ),
    Rule("libraries return, binaries print", re.compile(r"\b(e?println|e?print|dbg)!\s*\(")),
    Rule("anyhow only in binaries", re.compile(r"\banyhow\b")),
)


def library_lines(path: Path) -> list[tuple[int, str]]:
    """The numbered lines of `path` that are library code: before its test module (a
    top-level `#[cfg(test)]` on a `mod`), no comments."""
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = []
    for number, line in enumerate(lines, start=1):
        following = lines[number] if number < len(lines) else ""
        if line.startswith("#[cfg(test)]") and TEST_MODULE.match(following):
            break
        if not line.strip().startswith("//"):
            kept.append((number, line))
    return kept


TEST_MODULE = re.compile(r"(pub(\([a-z]+\))? )?mod ")


def library_files(root: Path) -> list[Path]:
    files = []
    for crate in CRATES:
        for path in sorted((root / crate).rglob("*.rs")):
            relative = path.relative_to(root / crate)
            if relative.parts[0] == "bin" or relative.name == "main.rs":
                continue
            files.append(path)
    return files


def breaches(root: Path) -> tuple[list[str], int]:
    found = []
    files = library_files(root)
    for path in files:
        name = path.relative_to(root).as_posix()
        rules = [r for r in RULES if name.startswith(r.scope) and name not in r.allowed]
        for number, line in library_lines(path) if rules else []:
            for rule in rules:
                if rule.pattern.search(line):
                    found.append(f"{name}:{number}: {rule.claim}: {line.strip()}")
    return found, len(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
    args = parser.parse_args(argv)
    found, files = breaches(args.root)
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} breaches of ARCHITECTURE.md's claims (allow a file in {Path(__file__).name} with its reason)")
        return 1
    print(f"{len(RULES)} claims hold in {files} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
