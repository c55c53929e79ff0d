"""Plain-text and Markdown tables, as the command line prints them."""

from __future__ import annotations


def table(rows: list[list[str]], header: list[str]) -> str:
    """Columns padded to their widest cell, a dashed rule under the header."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]

    def line(cells: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def markdown_table(rows: list[list[str]], header: list[str]) -> str:
    """A GitHub-flavoured Markdown table (``|`` in a cell escaped)."""

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header))] + [line(r) for r in rows])
