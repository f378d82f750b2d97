"""The papers' table citations, checked against the papers' own text.

``lambdanet.models.paper_tables.PAPER_ROWS`` says which table each reproduced row comes from; the README,
BENCHMARKS.md, docs/*.md and ``model_info(name).paper`` cite tables too. These tests read the tables from
the paper texts in ``shared/papers`` (next to the repository; skipped where it is absent) rather than from
anything in the package: a table's text is its body and caption, i.e. what lies between the previous
caption and the end of its own ("Table 14: ..." in the LambdaNetworks text, "Table A2. ..." in HaloNet's).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

import lambdanet
from lambdanet.models.paper_tables import PAPER_ROWS

REPO = Path(__file__).resolve().parents[1]
LAMBDA_TABLES = {str(n) for n in range(1, 21)}  # LambdaNetworks Tables 1-20
HALONET_TABLES = {"1", "2", "3", "4", "5", "6", "A1", "A2"}


def _papers_dir() -> Path | None:
    for path in (Path(__file__).resolve().parents[2] / "shared" / "papers", Path("/work/shared/papers")):
        if (path / "lambdanetworks-paper-pdf-text.txt").is_file() and (path / "halonet-paper.txt").is_file():
            return path
    return None


@cache
def _tables(paper: str) -> dict[str, str]:
    """``{table id: body and caption text}`` of ``"lambda"`` (LambdaNetworks) or ``"halonet"``."""
    papers = _papers_dir()
    if papers is None:
        pytest.skip("the paper texts (shared/papers) are not next to the repository")
    if paper == "lambda":
        text = (papers / "lambdanetworks-paper-pdf-text.txt").read_text(encoding="utf-8")
        caption = re.compile(r"^Table (\d+): ", re.MULTILINE)
    else:
        text = (papers / "halonet-paper.txt").read_text(encoding="utf-8")
        caption = re.compile(r"^Table (A?\d+)\. ", re.MULTILINE)
    tables, start = {}, 0
    for m in caption.finditer(text):
        if m.group(1) in tables:  # a wrapped prose line that starts with "Table N." is not a caption
            continue
        end = text.find("\n\n", m.start())
        end = len(text) if end < 0 else end
        tables[m.group(1)] = text[start:end]
        start = end
    return tables


def _table_text(table: str) -> str:
    """The text of a ``PaperRow.table`` (``"14"``, ``"HaloNet A2"``)."""
    if table.startswith("HaloNet "):
        return _tables("halonet")[table.removeprefix("HaloNet ").removeprefix("Table ")]
    return _tables("lambda")[table]


def _numbers(text: str) -> set[float]:
    return {float(x) for x in re.findall(r"(?<![\d.])\d+(?:\.\d+)?", text)}


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text).replace("->", "→")


def _names_row(text: str, label: str) -> bool:
    """The row's label, or the label without its trailing parenthesis, in the table's text."""
    bare = re.sub(r"\s*\([^()]*\)$", "", label)
    return any(_squash(s) in _squash(text) for s in (label, bare) if s)


def test_paper_texts_have_every_table():
    assert set(_tables("lambda")) == LAMBDA_TABLES
    assert set(_tables("halonet")) == HALONET_TABLES


@pytest.mark.parametrize("row", PAPER_ROWS, ids=lambda r: f"T{r.table}-{r.row}".replace(" ", "_"))
def test_paper_row_is_in_the_table_it_cites(row):
    text = _table_text(row.table)
    numbers = _numbers(text)
    if row.params_m is not None:
        assert row.params_m in numbers, f"Table {row.table} does not report {row.params_m}M ({row.row})"
    if row.flops_g is not None:  # Table 17 prints MFLOPs
        assert row.flops_g in numbers or round(row.flops_g * 1000, 6) in numbers, (
            f"Table {row.table} does not report {row.flops_g} GFLOPs ({row.row})")
    if row.table == "9":  # "|k| |h| |u| Params" columns: the row reads "8 2 1 14.8 ..."
        lk = row.kwargs["layer_kwargs"]
        line = f"{lk['dim_k']} {lk['heads']} {lk['dim_u']} {row.params_m}"
        assert re.search(rf"^{re.escape(line)}\b", text, re.MULTILINE), f"Table 9 has no row {line!r}"
    elif row.table != "10":  # Table 10 marks content / position with X and ×
        assert _names_row(text, row.row), f"Table {row.table} does not name {row.row!r}"


# ------------------------------------------------------------------------------------ citations in the docs
_ID = r"A?\d+(?!\w|\.\d)"  # "14", "A2"; not "42M" or "1.5"
_CITE = re.compile(rf"(HaloNet )?\bTables? ({_ID})((?:\s*(?:-|–|,|and)\s*{_ID})*)")


def _cited_tables(text: str) -> list[tuple[str, str]]:
    """``[(paper, table id)]`` for every "Table N" / "Tables N-M, K" in ``text``; "HaloNet Table N" is
    HaloNet's, every other one LambdaNetworks'. A range "N-M" yields every table from N to M."""
    out = []
    for m in _CITE.finditer(text):
        paper = "halonet" if m.group(1) else "lambda"
        ids = [m.group(2)] + re.findall(r"A?\d+", m.group(3))
        seps = re.findall(r"-|–|,|and", m.group(3))
        out.append((paper, ids[0]))
        for sep, prev, cur in zip(seps, ids, ids[1:]):
            if sep in "-–" and prev.isdigit() and cur.isdigit():
                out.extend((paper, str(n)) for n in range(int(prev) + 1, int(cur) + 1))
            else:
                out.append((paper, cur))
    return out


def _doc_files() -> list[Path]:
    return [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: p.name)
def test_docs_cite_tables_that_exist(path):
    cited = _cited_tables(path.read_text(encoding="utf-8"))
    wrong = [(p, t) for p, t in cited if t not in (LAMBDA_TABLES if p == "lambda" else HALONET_TABLES)]
    assert not wrong, f"{path.name} cites tables the papers do not have: {wrong}"


def test_citation_parser():
    assert _cited_tables("Tables 14-15, 17 and HaloNet A2; HaloNet Table 5; Table 18's") == [
        ("lambda", "14"), ("lambda", "15"), ("lambda", "17"), ("halonet", "5"), ("lambda", "18")]
    assert _cited_tables("Tables 3, 9, 10 and 13") == [("lambda", t) for t in ("3", "9", "10", "13")]
    assert _cited_tables("(Table 15, 42M); Table 10: 5.0") == [("lambda", "15"), ("lambda", "10")]


def _rows(table: str, model: str) -> list:
    return [r for r in PAPER_ROWS if r.table == table and r.model == model]


def _check_lambda_citation(table: str, model: str, kwargs: dict, where: str) -> None:
    """A LambdaNetworks ``table`` cited for ``create_model(model, **kwargs)``: a PAPER_ROWS row of that table
    with this call where PAPER_ROWS covers the table, else the table's text lists the model's depth
    (Table 18: "LambdaResNet-152"; Tables 19-20: a row starting with the depth)."""
    if any(r.table == table for r in PAPER_ROWS):
        rows = [r for r in _rows(table, model) if r.kwargs == kwargs]
        assert rows, f"{where}: Table {table} has no row create_model({model!r}, **{kwargs}) in PAPER_ROWS"
        return
    depth = re.search(r"(\d+)", model)
    assert depth, f"{where}: cites Table {table}, which PAPER_ROWS does not cover, for {model!r}"
    text, d = _table_text(table), depth.group(1)
    assert re.search(rf"LambdaResNet-{d}\b|^{d} ", text, re.MULTILINE), (
        f"{where}: Table {table} does not list depth {d}")


_NOT_ARCHITECTURE = {"num_classes", "pretrained", "features_only", "in_chans"}


@pytest.mark.parametrize("path", [REPO / "README.md", REPO / "docs" / "models.md"], ids=lambda p: p.name)
def test_model_zoo_citations_agree_with_paper_rows(path):
    """Lines ``create_model("name", ...)  # ... Table N ...``: each cited table has the call as a row, and
    a ``51.4M`` in the comment is that row's parameter count."""
    checked = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        code, _, comment = line.partition("#")
        if "create_model(" not in code or "Table" not in comment:
            continue
        call = ast.parse(code.split("=", 1)[1].strip()).body[0].value
        model = ast.literal_eval(call.args[0])
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg not in _NOT_ARCHITECTURE}
        cited = _cited_tables(comment)
        listed = {r.table for r in PAPER_ROWS if r.model == model and r.kwargs == kwargs}
        assert not listed or listed & {t for _, t in cited}, (
            f"{path.name}: {line.strip()} cites none of the tables PAPER_ROWS lists it in ({sorted(listed)})")
        for paper, table in cited:
            assert paper == "lambda", f"{path.name}: {line.strip()}"
            _check_lambda_citation(table, model, kwargs, f"{path.name}: {line.strip()}")
            for params in re.findall(rf"Table {table}'s (\d+(?:\.\d+)?)M", comment):
                assert any(r.params_m == float(params) for r in _rows(table, model)), line
            checked += 1
    assert checked >= 2, f"{path.name}: expected the model-zoo lines that cite Tables 13, 14 and 18"


@pytest.mark.parametrize("name", [n for n in lambdanet.list_models(task="image") if not lambdanet.model_info(n).small])
def test_model_info_cites_tables_that_list_the_model(name):
    """``model_info(name).paper`` cites only tables that list the model (compact CPU variants, ``small``, are
    not in the papers and are left out)."""
    paper = lambdanet.model_info(name).paper
    for which, table in _cited_tables(paper):
        if which == "halonet":
            assert _rows(f"HaloNet {table}", name), f"{name}: HaloNet Table {table} has no row for it"
        else:
            _check_lambda_citation(table, name, {}, f"{name}: {paper!r}")
    for params in re.findall(r"\((\d+\.\d+)M\)", paper):
        assert any(r.params_m == float(params) for r in PAPER_ROWS if r.model == name), (name, paper)
