"""The one text table every command prints (`agentic_common.text_table`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentic_common import text_table

CELL = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12)


@given(
    st.integers(1, 6).flatmap(
        lambda n: st.tuples(
            st.lists(CELL, min_size=n, max_size=n),
            st.lists(st.lists(CELL, min_size=n, max_size=n), max_size=8),
            st.text("lr", min_size=n, max_size=n),
        )
    )
)
def test_every_cell_sits_in_its_column(table: tuple[list[str], list[list[str]], str]) -> None:
    head, rows, align = table
    lines = text_table(head, rows, align=align).split("\n")
    assert len(lines) == 2 + len(rows)
    widths = [len(dashes) for dashes in lines[1].split("  ")]
    starts = [sum(widths[:i]) + 2 * i for i in range(len(widths))]
    for line, cells in zip(lines[:1] + lines[2:], [head, *rows], strict=True):
        assert line == line.rstrip()
        for i, cell in enumerate(cells):
            text = line[starts[i] : starts[i] + widths[i]]
            assert (text.ljust(widths[i]) if align[i] == "l" else text).strip() == cell
            assert text.startswith(cell) if align[i] == "l" else text.endswith(cell)


def test_units_none_and_no_header() -> None:
    text = text_table(["policy", "TTFT"], [["sticky", 0.5], ["random", None]], units=["", "s"])
    assert text.split("\n") == [
        "policy  TTFT",
        "           s",
        "------  ----",
        "sticky   0.5",
        "random     -",
    ]
    assert text_table(["a", "b"], [["x", "y"]], header=False, indent="  ") == "  x  y"


def test_a_ragged_row_or_a_bad_alignment_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="2 columns"):
        text_table(["a", "b"], [["x"]])
    with pytest.raises(ValueError, match="align"):
        text_table(["a", "b"], [], align="lc")
