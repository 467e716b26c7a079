"""check_import_cycles.py on tiny Python packages and Rust src trees, with and without a cycle.

    ../../.venv/bin/python -m pytest -q tests/test_import_cycles.py
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "check_import_cycles.py"


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def check(root: Path, *args: str) -> tuple[int, list[str]]:
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *args], capture_output=True, text=True, cwd=root, check=False
    )
    assert p.returncode in (0, 1), p.stderr
    return p.returncode, p.stdout.splitlines()


def cycles(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("cycle: ")]


def module_cycles(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("module cycle: ")]


# ---------------------------------------------------------------------------------------------
# Python

PACKAGE = {
    "pkg/__init__.py": '"""A package."""\n\nclass Error(Exception):\n    pass\n',
    "pkg/a.py": """
        from pkg import Error, b

        def f():
            return b.g()
        """,
    # A relative import inside a function: still an edge (b -> a).
    "pkg/b.py": """
        def g():
            from .a import f
            return f
        """,
    "pkg/c.py": """
        import pkg.a
        from . import b
        import os, json
        """,
    "pkg/sub/__init__.py": "",
    "pkg/sub/d.py": "from ..c import pkg\nfrom .. import Error\n",
}


def test_python_cycle_through_a_lazy_relative_import(tmp_path):
    write(tmp_path, PACKAGE)
    rc, lines = check(tmp_path, "--python", "pkg")
    assert rc == 1
    assert cycles(lines) == ["cycle: pkg/a.py -> pkg/b.py -> pkg/a.py"]


def test_python_without_a_cycle(tmp_path):
    write(tmp_path, {**PACKAGE, "pkg/b.py": "def g():\n    return 1\n"})
    rc, lines = check(tmp_path, "--python", "pkg")
    assert (rc, lines) == (0, ["no import cycles in 6 files"])


def test_python_cycle_through_the_package_init(tmp_path):
    # Importing pkg.core runs pkg/__init__.py, but that alone is no edge; importing a name from
    # the package in the module that __init__ imports is a circle.
    files = {"pkg/__init__.py": "from pkg.core import Error\n", "pkg/core.py": "from pkg import helpers\n", "pkg/helpers.py": ""}
    write(tmp_path, files)
    assert check(tmp_path, "--python", "pkg") == (0, ["no import cycles in 3 files"])
    write(tmp_path, {"pkg/core.py": "from pkg import helpers, VERSION\n"})
    rc, lines = check(tmp_path, "--python", "pkg")
    assert (rc, cycles(lines)) == (1, ["cycle: pkg/__init__.py -> pkg/core.py -> pkg/__init__.py"])


# ---------------------------------------------------------------------------------------------
# Rust

CRATE = {
    "src/lib.rs": """
        //! The crate. Doc links such as [`crate::a::A`] are not imports.
        pub mod a;
        pub mod b;
        pub mod net;

        pub mod pb {
            pub struct Message;
        }

        #[cfg(test)]
        mod tests {
            use super::*;
            use crate::net::conn::Conn;
        }
        """,
    "src/a.rs": """
        use crate::b::S;
        use crate::net::conn::Conn;
        use crate::pb::Message;

        pub struct A(pub Conn, pub Message);
        """,
    "src/b.rs": """
        // crate::a::A in a comment, and in strings, is not a reference.
        /* nested /* block */ crate::a::A */
        pub const S: &str = "crate::a::A";
        pub const R: &str = r#"super::a::A"#;
        pub fn first<'a>(s: &'a str) -> char { s.chars().next().unwrap_or('\\'') }

        #[cfg(test)]
        mod tests {
            use super::*;
            use crate::net::conn::Conn;
        }
        """,
    "src/net/mod.rs": "pub mod conn;\n",
    # super::super from src/net/conn.rs is the crate root: super::super::a is src/a.rs.
    "src/net/conn.rs": """
        pub struct Conn;

        impl Conn {
            pub fn a(&self) -> Option<super::super::a::A> { None }
        }
        """,
}


def test_rust_cycle_found_exactly(tmp_path):
    write(tmp_path, CRATE)
    rc, lines = check(tmp_path, "--rust", "src")
    assert rc == 1
    assert cycles(lines) == ["cycle: src/a.rs -> src/net/conn.rs -> src/a.rs"]


def test_rust_without_a_cycle(tmp_path):
    write(tmp_path, {**CRATE, "src/net/conn.rs": "pub struct Conn;\n"})
    rc, lines = check(tmp_path, "--rust", "src")
    assert (rc, lines) == (0, ["no import cycles in 5 files", "no module cycles among the 3 top-level modules of 1 crate(s)"])


def test_rust_group_use_and_paths_anywhere(tmp_path):
    write(tmp_path, {
        **CRATE,
        "src/net/conn.rs": "pub struct Conn;\n",
        "src/b.rs": "pub struct B;\n",
        "src/net/mod.rs": "pub mod conn;\nuse crate::{b::B, pb};\n",
        "src/a.rs": "pub struct A;\npub fn f() -> usize { std::mem::size_of::<crate::net::conn::Conn>() }\n",
    })
    assert check(tmp_path, "--rust", "src")[0] == 0
    # b.rs -> net/mod.rs (a path in an expression) closes net/mod.rs -> b.rs (a use group).
    write(tmp_path, {"src/b.rs": "pub struct B;\nfn g() { let _ = crate::net::conn::Conn; }\n"})
    assert cycles(check(tmp_path, "--rust", "src")[1]) == []  # to net/conn.rs, not net/mod.rs
    write(tmp_path, {"src/b.rs": "pub struct B;\nfn g() { let _ = crate::net::helper(); }\n"})
    assert cycles(check(tmp_path, "--rust", "src")[1]) == ["cycle: src/b.rs -> src/net/mod.rs -> src/b.rs"]


def test_rust_reexports_are_followed_to_the_defining_file(tmp_path):
    # a.rs names B through lib.rs's `pub use`: the edge goes to b.rs, not to lib.rs.
    write(tmp_path, {
        "src/lib.rs": "mod a;\nmod b;\npub use b::B;\n",
        "src/a.rs": "pub struct A;\npub fn f(_: crate::B) {}\n",
        "src/b.rs": "pub struct B;\npub fn g(_: crate::a::A) {}\n",
    })
    for extra in ([], ["--ignore-reexports"]):
        rc, lines = check(tmp_path, "--rust", "src", *extra)
        assert (rc, cycles(lines)) == (1, ["cycle: src/a.rs -> src/b.rs -> src/a.rs"])


def test_rust_parent_using_its_child_is_an_edge_but_declaring_it_is_not(tmp_path):
    write(tmp_path, {
        "src/lib.rs": "pub mod training;\n",
        "src/training/mod.rs": "mod trainable;\n\npub struct TrainError;\n",
        "src/training/trainable.rs": "use super::TrainError;\npub struct Stages;\n",
    })
    assert check(tmp_path, "--rust", "src") == (
        0,
        ["no import cycles in 3 files", "no module cycles among the 1 top-level modules of 1 crate(s)"],
    )
    write(tmp_path, {"src/training/mod.rs": "mod trainable;\npub use trainable::Stages;\npub struct TrainError;\n"})
    rc, lines = check(tmp_path, "--rust", "src")
    assert (rc, cycles(lines)) == (1, ["cycle: src/training/mod.rs -> src/training/trainable.rs -> src/training/mod.rs"])
    assert check(tmp_path, "--rust", "src", "--ignore-reexports")[0] == 0


def test_python_and_rust_together_and_why(tmp_path):
    write(tmp_path, PACKAGE)
    write(tmp_path, CRATE)
    rc, lines = check(tmp_path, "--python", "pkg", "--rust", "src", "--why")
    assert rc == 1
    assert cycles(lines) == ["cycle: pkg/a.py -> pkg/b.py -> pkg/a.py", "cycle: src/a.rs -> src/net/conn.rs -> src/a.rs"]
    assert "    src/a.rs:3: use crate::net::conn::Conn;" in lines
    assert "    pkg/b.py:3: from .a import f" in lines
    # a.rs -> net/conn.rs -> a.rs is also a cycle of the modules `a` and `net`.
    assert module_cycles(lines) == [f"module cycle: {tmp_path.name}: a -> net -> a"]
    assert "    net -> a: src/net/conn.rs:5: pub fn a(&self) -> Option<super::super::a::A> { None }" in lines
    assert lines[-2:] == ["2 import cycle(s) among 4 of 11 files", "1 module cycle(s) among the 3 top-level modules of 1 crate(s)"]


# ---------------------------------------------------------------------------------------------
# Rust modules: files collapsed to their crate's top-level modules

# No two files need each other, but the modules `planning` and `report` do: planning/plan.rs
# uses report.rs, report.rs uses planning/auto_split.rs. `config` names Objective through
# planning's `pub use` (an edge to planning/planner.rs); lib.rs depends on everything.
MODULES = {
    "host/src/lib.rs": """
        pub mod config;
        pub mod planning;
        pub mod report;
        #[cfg(feature = "x")]
        pub mod loopback;
        #[cfg(not(feature = "x"))]
        #[path = "no_loopback.rs"]
        mod loopback;

        pub use planning::plan::plan;
        pub fn version() -> u32 { report::VERSION }
        """,
    "host/src/config.rs": "pub struct EdgeConfig { pub objective: crate::planning::Objective }\n",
    "host/src/planning/mod.rs": "pub mod auto_split;\npub mod plan;\npub mod planner;\npub use planner::Objective;\n",
    "host/src/planning/planner.rs": "pub enum Objective { Latency }\n",
    "host/src/planning/auto_split.rs": "pub struct Planned;\n",
    "host/src/planning/plan.rs": """
        use crate::planning::auto_split::Planned;
        use crate::report::median;

        pub fn plan(_: Planned) -> f64 { median() }
        """,
    "host/src/report.rs": """
        use crate::planning::auto_split::Planned;

        pub const VERSION: u32 = 1;
        pub fn median() -> f64 { 0.0 }
        pub struct Summary(pub Option<Planned>);
        """,
    "host/src/loopback.rs": "pub struct LoopbackServer;\n",
    "host/src/no_loopback.rs": "pub struct LoopbackServer;\npub fn refuse(_: &crate::config::EdgeConfig) {}\n",
}


def test_rust_module_cycle_without_a_file_cycle(tmp_path):
    write(tmp_path, MODULES)
    rc, lines = check(tmp_path, "--rust", "host/src", "--why")
    assert rc == 1
    assert cycles(lines) == []
    assert module_cycles(lines) == ["module cycle: host: planning -> report -> planning"]
    assert "    planning -> report: host/src/planning/plan.rs:3: use crate::report::median;" in lines
    assert "    report -> planning: host/src/report.rs:2: use crate::planning::auto_split::Planned;" in lines
    assert lines[-2:] == ["no import cycles in 9 files", "1 module cycle(s) among the 4 top-level modules of 1 crate(s)"]


def test_rust_module_cycle_broken_by_moving_the_shared_piece(tmp_path):
    # median moves into planning (which report already uses): one way, planning -> report gone.
    files = {
        **MODULES,
        "host/src/planning/plan.rs": "pub fn plan() -> f64 { median() }\npub fn median() -> f64 { 0.0 }\n",
        "host/src/report.rs": "use crate::planning::auto_split::Planned;\npub struct Summary(pub Option<Planned>);\n",
    }
    write(tmp_path, files)
    assert check(tmp_path, "--rust", "host/src") == (
        0,
        ["no import cycles in 9 files", "no module cycles among the 4 top-level modules of 1 crate(s)"],
    )


def test_rust_module_edges_follow_reexports_to_the_owning_module(tmp_path):
    # report names Objective through lib.rs's `pub use` (then through config's): the edge goes
    # to planning, which owns it, and closes planning -> report (plan.rs uses report's median).
    write(tmp_path, {**MODULES, "host/src/report.rs": "pub fn median() -> f64 { 0.0 }\npub fn f(_: crate::Objective) {}\n"})
    write(tmp_path, {"host/src/lib.rs": "pub mod config;\npub mod planning;\npub mod report;\npub use planning::Objective;\n"})
    rc, lines = check(tmp_path, "--rust", "host/src", "--why")
    assert (rc, cycles(lines), module_cycles(lines)) == (1, [], ["module cycle: host: planning -> report -> planning"])
    assert "    report -> planning: host/src/report.rs:2: pub fn f(_: crate::Objective) {}" in lines
    write(tmp_path, {
        "host/src/config.rs": "pub use crate::planning::planner::Objective;\npub struct EdgeConfig;\n",
        "host/src/report.rs": "pub fn median() -> f64 { 0.0 }\npub fn f(_: crate::config::Objective) {}\n",
    })
    rc, lines = check(tmp_path, "--rust", "host/src", "--why")
    assert (rc, module_cycles(lines)) == (1, ["module cycle: host: planning -> report -> planning"])
    assert "    report -> planning: host/src/report.rs:2: pub fn f(_: crate::config::Objective) {}" in lines
    # A re-export is an edge of the module that has it: config -> planning, and planning using
    # config back is a cycle.
    write(tmp_path, {"host/src/planning/auto_split.rs": "pub struct Planned(pub crate::config::EdgeConfig);\n"})
    assert "module cycle: host: config -> planning -> config" in module_cycles(check(tmp_path, "--rust", "host/src")[1])
    # Without the reference through the re-exports, and without planning's use of config: none.
    write(tmp_path, {
        "host/src/report.rs": "pub fn median() -> f64 { 0.0 }\n",
        "host/src/planning/auto_split.rs": "pub struct Planned;\n",
    })
    assert check(tmp_path, "--rust", "host/src")[0] == 0


def test_rust_module_of_a_path_attribute_file_and_the_crate_root(tmp_path):
    # no_loopback.rs is module `loopback` (lib.rs's `#[path]`): its use of config and config's
    # use of loopback make a cycle. lib.rs using report while report uses nothing is no cycle,
    # nor is a module naming an item of lib.rs.
    write(tmp_path, MODULES)
    write(tmp_path, {
        "host/src/planning/plan.rs": "pub fn plan() -> u32 { crate::version() }\n",
        "host/src/config.rs": "pub struct EdgeConfig(pub crate::planning::Objective, pub crate::loopback::LoopbackServer);\n",
    })
    rc, lines = check(tmp_path, "--rust", "host/src")
    assert rc == 1
    assert module_cycles(lines) == ["module cycle: host: config -> loopback -> config"]
