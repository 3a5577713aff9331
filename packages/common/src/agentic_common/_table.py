"""The one plain-text table every command of the project prints (`agentic-state watch`,
`agentic-router replay / demo / bench / analyze / plugins`).

Plain text only: no colour and no escape codes, so a table reads the same on a
terminal, in a log file and through `grep` or `head`. Columns are as wide as
their widest cell; text columns align left, number columns right.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["text_table"]

GAP = "  "


def text_table(
    head: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    align: str | None = None,
    units: Sequence[str] | None = None,
    rule: bool = True,
    header: bool = True,
    indent: str = "",
) -> str:
    """`rows` under `head` as aligned text, one line per row (no trailing spaces).

    align: one letter per column, `l` (left) or `r` (right); default: left for the
    first column, right for the others. units: an optional second header line
    (e.g. `s` under a time column). rule: a line of dashes under the header.
    header: False prints the rows only (`head` still gives the column count).
    Cells are turned into text with `str`; None shows as `-`.
    """
    n = len(head)
    cells = [["-" if c is None else str(c) for c in row] for row in rows]
    for row in cells:
        if len(row) != n:
            raise ValueError(f"a row has {len(row)} cells for {n} columns: {row!r}")
    align = align or "l" + "r" * (n - 1)
    if len(align) != n or set(align) - {"l", "r"}:
        raise ValueError(f"align must be {n} letters l or r, got {align!r}")
    heads = [list(head), *([list(units)] if units is not None else [])]
    widths = [max(len(r[i]) for r in (*heads, *cells)) for i in range(n)]

    def line(row: Sequence[str]) -> str:
        text = GAP.join(
            c.ljust(w) if a == "l" else c.rjust(w)
            for c, w, a in zip(row, widths, align, strict=True)
        )
        return (indent + text).rstrip()

    out = [line(r) for r in heads] if header else []
    if rule and header:
        out.append(line(["-" * w for w in widths]))
    out += [line(r) for r in cells]
    return "\n".join(out)
