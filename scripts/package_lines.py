"""Lines of ``lambdanet/**/*.py`` at git revisions, as committed and as the project's formatter lays them out.

Since issue 27 the package is ``ruff format``-ed, which puts each argument of a long signature or call on its own
line; counts taken before and after that are compared like for like by formatting both the same way (the
project's ``[tool.ruff]`` settings, from pyproject.toml in the working tree).

    python scripts/package_lines.py ad52166 b6b8421 542c7f5 HEAD

prints, per revision, the lines as committed and the lines once formatted."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True).stdout


def _lines(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): len(p.read_text().splitlines()) for p in sorted(folder.rglob("*.py"))}


def count(rev: str) -> tuple[dict[str, int], dict[str, int]]:
    """``({module: lines as committed}, {module: lines once formatted})`` of ``lambdanet/`` at ``rev``."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = _git("archive", "--format=tar", rev, "lambdanet")
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        committed = _lines(Path(tmp))
        ruff = Path(sys.executable).with_name("ruff")
        subprocess.run(
            [str(ruff), "format", "--quiet", "--config", str(ROOT / "pyproject.toml"), tmp],
            check=True,
            cwd=tmp,
        )
        return committed, _lines(Path(tmp))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="+", help="git revisions, oldest first")
    args = parser.parse_args(argv)
    print("| revision | lines as committed | lines formatted |")
    print("|---|---:|---:|")
    for rev in args.revs:
        committed, formatted = count(rev)
        name = _git("rev-parse", "--short", rev).decode().strip()
        print(f"| {name} | {sum(committed.values()):,} | {sum(formatted.values()):,} |")


if __name__ == "__main__":
    main()
