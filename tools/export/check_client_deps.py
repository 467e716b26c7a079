#!/usr/bin/env python3
"""Checks that the client library links none of the crates a program embedding it should not get.

    python3 tools/export/check_client_deps.py [--package cleave-client]

`cleave-client` is the link to a server and nothing else: neither it nor anything it depends
on (normal dependencies, as a program embedding it links them) may pull in a plotting, table,
progress-bar, tokenizer or CLI crate. Reads `cargo tree`; prints each such crate with the path
that brings it in and exits 1, or prints `cleave-client links none of N crates` and exits 0.
Pure standard library.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

# Crate name -> what kind of crate it is.
FORBIDDEN = {
    "plotters": "plotting",
    "plotters-svg": "plotting",
    "plotters-backend": "plotting",
    "comfy-table": "table",
    "tabled": "table",
    "prettytable-rs": "table",
    "cli-table": "table",
    "indicatif": "progress-bar",
    "pbr": "progress-bar",
    "tokenizers": "tokenizer",
    "clap": "CLI",
    "clap_builder": "CLI",
    "structopt": "CLI",
    "argh": "CLI",
}


def dependencies(package: str) -> list[str]:
    """Every crate in `package`'s normal dependency tree, each once."""
    out = subprocess.run(
        ["cargo", "tree", "-p", package, "-e", "normal", "--prefix", "none", "--format", "{p}", "--no-dedupe"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return sorted({line.split()[0] for line in out.splitlines() if line.strip()})


def path_to(package: str, crate: str) -> str:
    """The chain of crates that brings `crate` in (`cargo tree --invert`)."""
    out = subprocess.run(
        ["cargo", "tree", "-p", package, "-e", "normal", "--invert", crate, "--prefix", "depth", "--format", "{p}"],
        check=False,
        capture_output=True,
        text=True,
    ).stdout
    chain = [line.lstrip("0123456789").split()[0] for line in out.splitlines() if line.strip()]
    return " <- ".join(chain) if chain else crate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default="cleave-client")
    args = parser.parse_args()
    crates = dependencies(args.package)
    found = [c for c in crates if c in FORBIDDEN]
    for crate in found:
        print(f"{args.package} links {crate}, a {FORBIDDEN[crate]} crate: {path_to(args.package, crate)}")
    if found:
        return 1
    kinds = ", ".join(dict.fromkeys(FORBIDDEN.values()))
    print(f"{args.package} links none of {len(FORBIDDEN)} crates ({kinds}) among its {len(crates)} dependencies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
