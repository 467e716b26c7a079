"""check_architecture.py on small source trees that keep or break each claim, and on this repository.

    ../../.venv/bin/python -m pytest -q tests/test_architecture_claims.py
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "check_architecture.py"
REPOSITORY = SCRIPT.parents[2]


def check(root: Path) -> tuple[int, list[str]]:
    p = subprocess.run([sys.executable, str(SCRIPT), "--root", str(root)], capture_output=True, text=True, check=False)
    assert p.returncode in (0, 1), p.stderr
    return p.returncode, p.stdout.splitlines()


def tree(root: Path, files: dict[str, str]) -> Path:
    for crate in ("common/codec/src", "common/src", "server/src", "host/src"):
        (root / crate).mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_this_repository_keeps_every_claim() -> None:
    code, lines = check(REPOSITORY)
    assert code == 0, "\n".join(lines)
    assert lines[-1].endswith(" files") and " claims hold in " in lines[-1]


@pytest.mark.parametrize(
    ("path", "line", "claim"),
    [
        ("server/src/stream.rs", "let (tx, rx) = mpsc::unbounded_channel();", "every channel is bounded"),
        ("server/src/infer.rs", 'return Err(Status::internal("oops"));', "the only status map"),
        ("server/src/infer.rs", 'return Err(tonic::Status::new(Code::Internal, "oops"));', "the only status map"),
        ("common/src/wire.rs", 'println!("sent {n} bytes");', "binaries print"),
        ("host/src/run.rs", 'eprintln!("retrying");', "binaries print"),
        ("common/codec/src/seal.rs", "fn open() -> anyhow::Result<()> { Ok(()) }", "anyhow only in binaries"),
    ],
)
def test_a_breach_is_named_with_its_file_line_and_claim(tmp_path: Path, path: str, line: str, claim: str) -> None:
    code, lines = check(tree(tmp_path, {path: f"//! A module.\n\nfn f() {{\n    {line}\n}}\n"}))
    assert code == 1
    assert lines[0].startswith(f"{path}:4: ") and claim in lines[0], lines


def test_binaries_tests_comments_and_allowed_files_may_hold_the_patterns(tmp_path: Path) -> None:
    files = {
        "host/src/main.rs": 'fn main() -> anyhow::Result<()> { println!("hi"); Ok(()) }\n',
        "host/src/bin/bench.rs": 'fn main() { eprintln!("hi"); }\n',
        "server/src/error.rs": "fn map(e: E) -> Status { Status::new(code(&e), e.to_string()) }\n",
        "host/src/client/mod.rs": "fn f() { let (tx, rx) = mpsc::unbounded_channel(); }\n",
        "host/src/plan.rs": """\
            // println!("a comment is not code")
            fn plan() {}

            #[cfg(test)]
            mod tests {
                fn t() { println!("a test may print"); let _ = mpsc::unbounded_channel::<u8>(); }
            }
            """,
        "server/src/unsent.rs": """\
            impl Q {
                #[cfg(test)]
                fn queued(&self) -> usize { 0 }
            }
            fn after() { println!("still library code"); }
            """,
    }
    code, lines = check(tree(tmp_path, files))
    assert code == 1
    assert [line.split(": ")[0] for line in lines[:-1]] == ["server/src/unsent.rs:5"], lines
    # The Status rule covers the server only: the host builds no statuses, but a bench may.
    code, lines = check(tree(tmp_path, {"server/src/unsent.rs": "fn after() {}\n"}))
    assert code == 0, lines
