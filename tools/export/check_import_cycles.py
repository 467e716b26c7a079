#!/usr/bin/env python3
"""Finds import cycles between source files (Python modules and Rust module files) and between
the top-level modules of each Rust crate.

The architecture rule: no import circles between files, nor between a crate's modules. When
file A needs file B, B must not need A back, directly or through other files; dependencies then
form layers that can be read, tested and changed from the bottom up, and a circle is a sign that
a shared piece lives in the wrong file (move it into the file that owns it, or into a small new
file both import). The same holds one level up: when module `a` (all of src/a.rs or src/a/)
needs module `b`, `b` must not need `a` back, or no part of either can be used without the
other; shared vocabulary then belongs in a small module both import.

    python3 tools/export/check_import_cycles.py --python tools/export/cleave_export \\
        --rust common/src --rust host/src --rust server/src --rust common/codec/src

prints every file cycle as `cycle: a.rs -> b.rs -> a.rs` (paths relative to the repository) and
every module cycle as `module cycle: host: a -> b -> a` (the crate's directory, then its top-level
modules), then `no import cycles in N files` or `K import cycle(s) among ...`, and for Rust `no
module cycles among ...` or `K module cycle(s) among ...`; exits 1 when there is a cycle of
either kind, else 0. `--why` also prints the line behind every edge of every cycle (for a module
cycle, every line of every file of one module that refers to the other). Pure standard library.

What counts as an edge from file A to file B:

* Python (`--python DIR`: a package, or a directory of modules and packages): A imports B,
  absolutely (`import pkg.b`, `from pkg import b`, `from pkg.b import x`) or relatively
  (`from . import b`, `from .b import x`, `from .. import b`), anywhere in A, including inside
  functions and `if TYPE_CHECKING:` blocks, and `importlib.import_module("pkg.b")` with a literal
  name. The edge goes to the most specific module file that exists: `from pkg import b` is an
  edge to pkg/b.py when that file exists and to pkg/__init__.py otherwise. Importing pkg.b also
  runs pkg/__init__.py, but that implied edge is not counted (every package whose __init__
  re-exports a submodule would otherwise be a circle). Only modules under the given directories
  count; the standard library and third-party packages are ignored.

* Rust (`--rust DIR`: a crate's src directory): A refers to `crate::b::..`, `super::b..` or `self::b..`,
  in a `use` (groups `use crate::{a, b::c}` included) or as a path anywhere in the code. The
  path is mapped to the longest module prefix that has a file: `crate::a::b::c` is src/a/b.rs or
  src/a/b/mod.rs if one exists, else src/a.rs or src/a/mod.rs, else lib.rs (items of the crate
  root, and of inline modules such as `mod pb { ... }`, belong to the file that holds them).
  For src/a/b.rs the module path is a::b, so its `super::x` is a::x; `super` inside an inline
  `mod m { ... }` is the file itself. `mod x;` / `pub mod x;` declarations are not edges (a
  parent declaring its children is not a dependency on them); only uses and paths are. Comments
  (doc links included) and string literals are ignored, and so are `#[cfg(test)]` inline modules
  and uses (test code is not architecture). Every file in src/bin/ is a crate root of its own.
  A `use` and a path that starts with the name of a child module (`use trainable::X`,
  `pub use payload::Y`, `planning::measure(..)` in the parent) are edges too: re-exporting a
  child's item makes the parent depend on the child (`--ignore-reexports` leaves out top-level
  `pub use`). A reference to a name that a file binds with `use` (`crate::Bundle`, where lib.rs
  has `pub use bundle::Bundle`) goes to the file that defines it, not to the one re-exporting it.

Module edges (Rust only) are the file edges seen from higher up: every file belongs to its crate's
top-level module (src/a.rs, src/a/mod.rs and everything under src/a/ are module `a`; a file that
`#[path = "x.rs"] mod a;` declares is module `a` too), and an edge from a file of module `a` to a
file of module `b` is an edge a -> b. Since references through a re-export already go to the
file that defines the item, `crate::Y` or `crate::facade::Y` (where lib.rs or facade.rs has `pub
use b::Y`) is an edge to `b`, the module that owns Y. The crate root (lib.rs, main.rs, a binary's
file) is a node of its own that may depend on anything (it declares and re-exports the modules):
its edges are left out, so it is never in a module cycle. Each binary of src/bin/ with modules of
its own is checked as a crate of its own (`host bin/x`). Not followed: glob imports of the
crate's own modules (`use crate::a::*` is an edge to `a`, but not the names reached through it).

Edges from a file (or module) to itself are ignored. For each group of files that reach each other
(a strongly connected component), every edge inside the group is reported through the shortest
cycle that contains it, so fixing all the reported edges' circles fixes the group.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# The graph


@dataclass
class Graph:
    files: set[Path] = field(default_factory=set)
    # edges[a][b]: where a refers to b, as (line number, source line) pairs.
    edges: dict[Path, dict[Path, list[tuple[int, str]]]] = field(default_factory=dict)

    def add_file(self, path: Path) -> None:
        self.files.add(path)
        self.edges.setdefault(path, {})

    def add_edge(self, a: Path, b: Path, line: int, text: str) -> None:
        if a == b:
            return
        where = self.edges.setdefault(a, {}).setdefault(b, [])
        if (line, text.strip()) not in where:
            where.append((line, text.strip()))


def _skip_dir(name: str) -> bool:
    return name.startswith(".") or name in ("__pycache__", "target", "node_modules")


def _walk(root: Path, suffix: str) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _skip_dir(d))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(suffix))
    return out


# ---------------------------------------------------------------------------------------------
# Python


def _package_prefix(directory: Path) -> list[str]:
    """Dotted-name parts of `directory` if it is a package (walking up while parents are too)."""
    parts: list[str] = []
    d = directory
    while (d / "__init__.py").is_file():
        parts.insert(0, d.name)
        if d.parent == d:
            break
        d = d.parent
    return parts


def python_modules(directory: Path) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is_package) for every .py file under `directory`."""
    directory = directory.resolve()
    prefix = _package_prefix(directory)
    modules = {}
    for path in _walk(directory, ".py"):
        parts = list(path.relative_to(directory).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        name = ".".join(prefix + parts)
        if name:
            modules[name] = (path, is_package)
    return modules


def _longest_module(name: str, modules: dict[str, tuple[Path, bool]]) -> Path | None:
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        hit = modules.get(".".join(parts[:n]))
        if hit:
            return hit[0]
    return None


def _is_import_module_call(node: ast.Call) -> bool:
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return name in ("import_module", "__import__")


def python_edges(graph: Graph, modules: dict[str, tuple[Path, bool]]) -> None:
    for name, (path, is_package) in sorted(modules.items()):
        graph.add_file(path)
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        tree = ast.parse(source, filename=str(path))
        package = name.split(".") if is_package else name.split(".")[:-1]

        def edge(target: str, node: ast.AST) -> None:
            hit = _longest_module(target, modules)
            if hit is not None:
                line = getattr(node, "lineno", 0)
                graph.add_edge(path, hit, line, lines[line - 1] if 0 < line <= len(lines) else "")

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    edge(alias.name, node)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    if node.level - 1 > len(package) or not package:
                        continue  # a relative import outside any scanned package
                    base_parts = package[: len(package) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}" if base else alias.name
                    edge(sub if alias.name != "*" and sub in modules else base, node)
            elif isinstance(node, ast.Call) and _is_import_module_call(node):
                if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                    if not node.args[0].value.startswith("."):
                        edge(node.args[0].value, node)


# ---------------------------------------------------------------------------------------------
# Rust


def rust_tokens(text: str) -> list[tuple[str, int]]:
    """(token, line) pairs: identifiers and keywords, `::`, and single punctuation characters.
    Comments, string, byte-string, raw-string and char literals are dropped; lifetimes too."""
    tokens: list[tuple[str, int]] = []
    i, n, line = 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    line += text[i] == "\n"
                    i += 1
        elif c.isalpha() or c == "_":
            j = i
            while j < n and (text[j].isalnum() or text[j] == "_"):
                j += 1
            word = text[i:j]
            # Raw strings (r"..", r#".."#, br"..", cr"..") and prefixed strings (b"..", c"..").
            if word in ("r", "br", "cr") and j < n and text[j] in "#\"":
                k = j
                while k < n and text[k] == "#":
                    k += 1
                if k < n and text[k] == '"':
                    end = text.find('"' + "#" * (k - j), k + 1)
                    end = n if end < 0 else end + 1 + (k - j)
                    line += text.count("\n", i, end)
                    i = end
                    continue
            if word in ("b", "c") and j < n and text[j] in "\"'":
                i = j  # the literal itself is skipped next round
                continue
            if word == "r" and text.startswith("#", j) and j + 1 < n and (text[j + 1].isalpha() or text[j + 1] == "_"):
                i = j + 1  # a raw identifier r#name: keep the name
                continue
            tokens.append((word, line))
            i = j
        elif c.isdigit():
            j = i
            while j < n and (text[j].isalnum() or text[j] in "_."):
                if text[j] == "." and not (j + 1 < n and text[j + 1].isdigit()):
                    break
                j += 1
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            line += text.count("\n", i, j)
            i = j + 1
        elif c == "'":
            if i + 1 < n and text[i + 1] == "\\":  # '\n', '\'', '\u{..}'
                j = text.find("'", i + 3)
                i = n if j < 0 else j + 1
            elif i + 2 < n and text[i + 2] == "'":  # 'x'
                i += 3
            else:  # a lifetime or label: 'a
                i += 1
                while i < n and (text[i].isalnum() or text[i] == "_"):
                    i += 1
        elif text.startswith("::", i):
            tokens.append(("::", line))
            i += 2
        else:
            tokens.append((c, line))
            i += 1
    return tokens


def _is_ident(tok: str) -> bool:
    return tok[:1].isalpha() or tok[:1] == "_"


Token = tuple[str, int]
UsePath = tuple[list[str], "str | None"]


def _parse_use_tree(tokens: list[Token], i: int, prefix: list[str]) -> tuple[list[UsePath], int]:
    """Parses a path (or a `use` tree) from tokens[i], continuing `prefix`: `a::b`, `a::{b, c::d}`,
    `a::*`, `a as b`. Returns (path, name it binds) pairs, the name None for a glob, and the index
    after the tree."""
    out: list[UsePath] = []
    path = list(prefix)
    n = len(tokens)
    while i < n:
        tok = tokens[i][0]
        if tok == "{":
            i += 1
            while i < n and tokens[i][0] != "}":
                if tokens[i][0] == ",":
                    i += 1
                elif tokens[i][0] == "self":
                    name = path[-1] if path else None
                    i += 1
                    if i + 1 < n and tokens[i][0] == "as":
                        name, i = tokens[i + 1][0], i + 2
                    out.append((list(path), name))
                else:
                    sub, j = _parse_use_tree(tokens, i, path)
                    out.extend(sub)
                    i = max(j, i + 1)
            return out, i + 1
        if tok == "*":
            return [(path, None)], i + 1
        if _is_ident(tok):
            path.append(tok)
            i += 1
            if i + 1 < n and tokens[i][0] == "::" and tokens[i + 1][0] != "<":
                i += 1
                continue
            name = tok
            if i + 1 < n and tokens[i][0] == "as":
                name, i = tokens[i + 1][0], i + 2
            return [(path, name)], i
        break
    return [(path, None)], i


def _skip_block(tokens: list[Token], i: int) -> int:
    """From tokens[i] == "{", the index after the matching "}"."""
    depth = 0
    while i < len(tokens):
        if tokens[i][0] == "{":
            depth += 1
        elif tokens[i][0] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i


def _skip_cfg_test(tokens: list[Token], i: int) -> int | None:
    """At `#[cfg(test)]`: the index after the test-only inline module or `use` it marks (other
    attributes and a visibility may come between), or None when it marks something else."""
    want = ["#", "[", "cfg", "(", "test", ")", "]"]
    if [t for t, _ in tokens[i : i + len(want)]] != want:
        return None
    j, n = i + len(want), len(tokens)
    while j + 1 < n and tokens[j][0] == "#" and tokens[j + 1][0] == "[":
        depth = 0
        while j < n:
            depth += {"[": 1, "]": -1}.get(tokens[j][0], 0)
            j += 1
            if depth == 0 and tokens[j - 1][0] == "]":
                break
    if j < n and tokens[j][0] == "pub":
        j += 1
        if j < n and tokens[j][0] == "(":
            while j < n and tokens[j][0] != ")":
                j += 1
            j += 1
    if j + 2 < n and tokens[j][0] == "mod" and _is_ident(tokens[j + 1][0]) and tokens[j + 2][0] == "{":
        return _skip_block(tokens, j + 2)
    if j < n and tokens[j][0] == "use":
        while j < n and tokens[j][0] != ";":
            j += 1
        return j + 1
    return None


_RELATIVE_HEADS = ("crate", "super", "self")


@dataclass
class RustFile:
    # Crate-relative module paths the file refers to, with their lines and whether the reference
    # is a `pub use` (a re-export) at the top of the file.
    refs: list[tuple[list[str], int, bool]] = field(default_factory=list)
    # Names its top-level `use` declarations bind, and the crate-relative path each stands for
    # (None: something outside the crate, such as `use std::fmt` or `pub use other_crate::X`).
    bindings: dict[str, list[str] | None] = field(default_factory=dict)


def rust_references(text: str, module: list[str], is_module=lambda path: False) -> RustFile:
    """What the file whose module path is `module` refers to: every `use` and every path that
    starts with `crate::`, `super::`, `self::` or a child module's name (`is_module(path)` says
    whether a module path has a file). `mod x;` declarations are not references."""
    tokens = rust_tokens(text)
    out = RustFile()
    inline: list[tuple[str, int]] = []  # inline modules we are in: (name, brace depth inside)
    depth = 0

    def absolute(path: list[str], current: list[str]) -> list[str] | None:
        if not path:
            return None
        if path[0] == "crate":
            return path[1:]
        if path[0] == "self":
            return current + path[1:]
        if path[0] == "super":
            k = 0
            while k < len(path) and path[k] == "super":
                k += 1
            return current[: len(current) - k] + path[k:] if k <= len(current) else None
        if is_module(tuple(current + path[:1])):
            return current + path
        return None

    i, n = 0, len(tokens)
    while i < n:
        tok, line = tokens[i]
        prev = tokens[i - 1][0] if i else ""
        current = module + [name for name, _ in inline]
        if tok == "#":
            after = _skip_cfg_test(tokens, i)
            if after is not None:
                i = after
                continue
        if tok == "mod" and i + 2 < n and _is_ident(tokens[i + 1][0]) and tokens[i + 2][0] == "{":
            depth += 1
            inline.append((tokens[i + 1][0], depth))
            i += 3
            continue
        if tok == "{":
            depth += 1
        elif tok == "}":
            if inline and inline[-1][1] == depth:
                inline.pop()
            depth -= 1
        elif tok == "use" and prev != "::":
            reexport = depth == 0 and not inline and (prev == "pub" or (prev == ")" and "pub" in [t for t, _ in tokens[max(0, i - 5) : i]]))
            j = i + 1
            if j < n and tokens[j][0] == "::":
                j += 1  # `use ::name`: always another crate
                paths, j = _parse_use_tree(tokens, j, [])
                paths = [([], name) for _, name in paths]
            else:
                paths, j = _parse_use_tree(tokens, j, [])
            for path, name in paths:
                target = absolute(path, current)
                if target is not None:
                    out.refs.append((target, line, reexport))
                if depth == 0 and not inline and name not in (None, "_"):
                    out.bindings[name] = target
            i = max(j, i + 1)
            continue
        elif (
            _is_ident(tok)
            and i + 2 < n
            and tokens[i + 1][0] == "::"
            and tokens[i + 2][0] != "<"
            and prev not in ("::", ".", "in")
            and (tok in _RELATIVE_HEADS or is_module(tuple(current + [tok])))
        ):
            paths, j = _parse_use_tree(tokens, i, [])
            for path, _ in paths:
                target = absolute(path, current)
                if target is not None:
                    out.refs.append((target, line, False))
            i = max(j, i + 1)
            continue
        i += 1
    return out


@dataclass
class RustCrate:
    base: Path  # where `crate::a` is base/a.rs or base/a/mod.rs
    root: Path  # the crate root file (lib.rs, main.rs, bin/x.rs)
    modules: dict[tuple[str, ...], Path]

    def file_of(self, path: list[str]) -> tuple[Path, list[str]]:
        """The file of the longest prefix of `path` that has one, and the rest of the path."""
        for n in range(len(path), -1, -1):
            hit = self.modules.get(tuple(path[:n]))
            if hit is not None:
                return hit, path[n:]
        return self.root, path


def _src_directory(src: Path) -> Path:
    src = src.resolve()
    if not (src / "lib.rs").exists() and not (src / "main.rs").exists() and (src / "src").is_dir():
        src = src / "src"  # a crate directory was given
    return src


def rust_crates(src: Path) -> list[tuple[RustCrate, list[tuple[Path, list[str]]]]]:
    """The crates under a src directory, each with its files and their module paths."""
    src = _src_directory(src)
    groups: dict[tuple[Path, Path], list[tuple[Path, list[str]]]] = {}
    lib = src / "lib.rs" if (src / "lib.rs").exists() else src / "main.rs"
    for path in _walk(src, ".rs"):
        rel = path.relative_to(src).parts
        if rel[0] == "bin" and len(rel) == 2:  # src/bin/x.rs: a crate of its own
            base, root, parts = src / "bin", path, []
        elif rel[0] == "bin" and len(rel) > 2:  # src/bin/x/main.rs and its modules
            base, root = src / "bin" / rel[1], src / "bin" / rel[1] / "main.rs"
            parts = list(path.relative_to(base).with_suffix("").parts)
        elif rel == ("main.rs",) and lib != path:  # main.rs next to lib.rs: its own crate
            base, root, parts = src, path, []
        else:
            base, root = src, lib
            parts = list(path.relative_to(src).with_suffix("").parts)
        if parts and parts[-1] == "mod":
            parts.pop()
        if path == root or parts in (["lib"], ["main"]):
            parts = []
        groups.setdefault((base, root), []).append((path, parts))
    crates = []
    for (base, root), files in sorted(groups.items()):
        files, renamed = _apply_path_attributes(files)
        # A file named by `#[path]` may share its module with the file at the usual place
        # (`no_loopback.rs` standing in for `loopback.rs` under a cfg): paths go to that one.
        modules = {tuple(parts): path for path, parts in files if parts and path not in renamed}
        for path, parts in files:
            if parts:
                modules.setdefault(tuple(parts), path)
        modules[()] = root
        crates.append((RustCrate(base, root, modules), files))
    return crates


_PATH_ATTRIBUTE = re.compile(
    r'#\[\s*path\s*=\s*"([^"]+)"\s*\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;'
)


def _apply_path_attributes(files: list[tuple[Path, list[str]]]) -> tuple[list[tuple[Path, list[str]]], set[Path]]:
    """Gives a file that a `#[path = "x.rs"] mod name;` declares the module path it has in the
    crate (the declaring module's, plus `name`) instead of the one its place suggests; also
    returns the files so renamed."""
    module_of = {path: parts for path, parts in files}
    renamed: dict[Path, list[str]] = {}
    for path, parts in files:
        for target, name in _PATH_ATTRIBUTE.findall(path.read_text(encoding="utf-8")):
            file = (path.parent / target).resolve()
            if file in module_of:
                renamed[file] = parts + [name]
    return [(path, renamed.get(path, parts)) for path, parts in files], set(renamed)


CRATE_ROOT = "crate"  # the module-graph node of lib.rs / main.rs (a keyword: no module has it)


@dataclass
class ModuleGraph:
    """The top-level modules of one crate (`src/a.rs`, `src/a/mod.rs` and everything under
    `src/a/` are module `a`; the crate root is CRATE_ROOT) and the edges between them."""

    crate: str  # how the crate is named in the output: its directory, and `bin/x` for a binary
    modules: set[str] = field(default_factory=set)
    # edges[a][b]: where module a refers to module b, as (file, line number, source line).
    edges: dict[str, dict[str, list[tuple[Path, int, str]]]] = field(default_factory=dict)

    def add_module(self, name: str) -> None:
        self.modules.add(name)
        self.edges.setdefault(name, {})

    def add_edge(self, a: str, b: str, file: Path, line: int, text: str) -> None:
        # The crate root may depend on anything (it declares and re-exports the modules): its
        # edges are not part of the graph, so it is never in a cycle.
        if a == b or a == CRATE_ROOT:
            return
        where = self.edges.setdefault(a, {}).setdefault(b, [])
        if (file, line, text.strip()) not in where:
            where.append((file, line, text.strip()))


def _crate_name(src: Path, crate: RustCrate) -> str:
    name = src.parent.name if src.name == "src" else src.name
    if crate.root.parent == src and crate.root.name in ("lib.rs", "main.rs"):
        return name
    return f"{name} {crate.root.relative_to(src).with_suffix('').as_posix()}"


def rust_edges(graph: Graph, src: Path, reexports: bool = True) -> list[ModuleGraph]:
    """Edges between the files of the crates under `src`, and between each crate's top-level
    modules (returned, a graph a crate). A reference to a name that a file brings in with `use`
    (`crate::Bundle` where lib.rs has `pub use bundle::Bundle`) is followed to the file that
    defines it; the `use` itself is an edge of the file that has it, unless it is a top-level
    `pub use` and `reexports` is False."""
    src = _src_directory(src)
    module_graphs = []
    for crate, files in rust_crates(src):
        modules = ModuleGraph(_crate_name(src, crate))
        top = {path: module[0] if module else CRATE_ROOT for path, module in files}
        for name in top.values():
            modules.add_module(name)
        if len(modules.modules) > 1:  # a binary of one file has no modules to check
            module_graphs.append(modules)
        parsed: dict[Path, RustFile] = {}
        lines: dict[Path, list[str]] = {}
        for path, module in files:
            graph.add_file(path)
            text = path.read_text(encoding="utf-8")
            lines[path] = text.splitlines()
            parsed[path] = rust_references(text, module, lambda p: p in crate.modules)

        def resolve(path: list[str]) -> Path | None:
            seen = set()
            while True:
                file, rest = crate.file_of(path)
                if not rest or (file, rest[0]) in seen or rest[0] not in parsed[file].bindings:
                    return file
                seen.add((file, rest[0]))
                target = parsed[file].bindings[rest[0]]
                if target is None:
                    return None  # an item of another crate, re-exported
                path = target + rest[1:]

        for path, _ in files:
            for segments, line, is_reexport in parsed[path].refs:
                if is_reexport and not reexports:
                    continue
                target = resolve(segments)
                if target is not None:
                    text = lines[path][line - 1] if 0 < line <= len(lines[path]) else ""
                    graph.add_edge(path, target, line, text)
                    modules.add_edge(top[path], top[target], path, line, text)
    return module_graphs


# ---------------------------------------------------------------------------------------------
# Cycles


def strongly_connected(graph: Graph | ModuleGraph) -> list[list[Path]]:
    """Tarjan's algorithm, iterative; components of more than one file, each sorted."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    on_stack: set[Path] = set()
    stack: list[Path] = []
    out: list[list[Path]] = []
    counter = 0
    for start in sorted(graph.edges):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.edges.get(start, {}))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.edges.get(child, {})))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return sorted(out)


def _shortest_path(graph: Graph | ModuleGraph, start: Path, goal: Path, allowed: set[Path]) -> list[Path] | None:
    previous: dict[Path, Path | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            path = []
            step: Path | None = node
            while step is not None:
                path.append(step)
                step = previous[step]
            return path[::-1]
        for child in sorted(graph.edges.get(node, {})):
            if child in allowed and child not in previous:
                previous[child] = node
                queue.append(child)
    return None


def find_cycles(graph: Graph | ModuleGraph) -> list[list[Path]]:
    """For every edge inside a strongly connected component, the shortest cycle through it
    (first file repeated at the end), without duplicates (a cycle is the same from any start).
    The same for a ModuleGraph, whose nodes are module names instead of files."""
    cycles: dict[tuple[Path, ...], list[Path]] = {}
    for component in strongly_connected(graph):
        members = set(component)
        for a in component:
            for b in sorted(graph.edges.get(a, {})):
                if b not in members:
                    continue
                back = _shortest_path(graph, b, a, members)
                if back is None:
                    continue
                cycle = [a] + back[:-1]
                k = cycle.index(min(cycle))
                key = tuple(cycle[k:] + cycle[:k])
                cycles.setdefault(key, list(key) + [key[0]])
    return sorted(cycles.values(), key=lambda c: (c[0], len(c), c))


# ---------------------------------------------------------------------------------------------


def _repository_root(start: Path) -> Path:
    for d in [start, *start.parents]:
        if (d / ".git").exists():
            return d
    return start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", action="append", default=[], type=Path, metavar="DIR",
                   help="a Python package (or a directory of modules) to check; repeatable")
    p.add_argument("--rust", action="append", default=[], type=Path, metavar="DIR",
                   help="a Rust crate's src directory to check; repeatable")
    p.add_argument("--root", type=Path, default=None,
                   help="print paths relative to this directory (default: the git repository around the current one)")
    p.add_argument("--why", action="store_true", help="also print the line behind every edge of every cycle")
    p.add_argument("--ignore-reexports", action="store_true",
                   help="Rust: a top-level `pub use` is not an edge of the file that has it (a facade such as lib.rs "
                        "re-exporting its submodules); references through it still go to the defining file")
    a = p.parse_args(argv)
    if not a.python and not a.rust:
        p.error("give at least one --python or --rust directory")
    for d in a.python + a.rust:
        if not d.is_dir():
            p.error(f"not a directory: {d}")
    root = (a.root or _repository_root(Path.cwd())).resolve()

    def show(path: Path) -> str:
        try:
            return path.relative_to(root).as_posix()
        except ValueError:
            return str(path)

    graph = Graph()
    modules: dict[str, tuple[Path, bool]] = {}
    for d in a.python:
        modules.update(python_modules(d))
    python_edges(graph, modules)
    module_graphs: list[ModuleGraph] = []
    for d in a.rust:
        module_graphs += rust_edges(graph, d, reexports=not a.ignore_reexports)

    cycles = find_cycles(graph)
    for cycle in cycles:
        print("cycle: " + " -> ".join(show(f) for f in cycle))
        if a.why:
            for x, y in zip(cycle, cycle[1:]):
                for line, text in graph.edges[x][y]:
                    print(f"    {show(x)}:{line}: {text}")
    module_cycles = 0
    for crate in module_graphs:
        for cycle in find_cycles(crate):
            module_cycles += 1
            print(f"module cycle: {crate.crate}: " + " -> ".join(cycle))
            if a.why:
                for x, y in zip(cycle, cycle[1:]):
                    for file, line, text in crate.edges[x][y]:
                        print(f"    {x} -> {y}: {show(file)}:{line}: {text}")
    if cycles:
        involved = {f for c in cycles for f in c}
        print(f"{len(cycles)} import cycle(s) among {len(involved)} of {len(graph.files)} files")
    else:
        print(f"no import cycles in {len(graph.files)} files")
    if module_graphs:
        count = sum(len(m.modules - {CRATE_ROOT}) for m in module_graphs)
        among = f"the {count} top-level modules of {len(module_graphs)} crate(s)"
        print(f"{module_cycles} module cycle(s) among {among}" if module_cycles else f"no module cycles among {among}")
    return 1 if cycles or module_cycles else 0


if __name__ == "__main__":
    sys.exit(main())
