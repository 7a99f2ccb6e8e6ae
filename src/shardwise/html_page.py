"""Self-contained HTML pages and the figures drawn for them: what `shardwise report` and `plan/estimate
--report` share.

A page has no script and no links, so it opens offline: its PNGs are embedded as data URIs. Every text
that goes in is escaped here (`escape`, `table`, `embedded_png`, `page`). `figure_class()` is matplotlib's
Figure, drawn on its own Agg canvas without pyplot (the process's backend, a notebook's say, is left
alone), or a ShardwiseError naming the extra to install (matplotlib is the `report` extra).
"""

from __future__ import annotations

import base64
import html
from typing import Any, Iterable

from .errors import ShardwiseError

MISSING_MATPLOTLIB = ("the plots need matplotlib, which is not installed: pip install 'shardwise[report]' "
                      "(or pip install 'matplotlib>=3.7')")


def figure_class() -> Any:
    """matplotlib's Figure class, or a ShardwiseError naming the extra to install."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ShardwiseError(MISSING_MATPLOTLIB) from exc
    return Figure


def escape(text: Any) -> str:
    """`text` as page text: its markup characters escaped (quotes too, so it may stand in an attribute)."""
    return html.escape(str(text))


def table(header: Iterable[Any], rows: Iterable[Iterable[Any]], table_id: str = "") -> str:
    """An HTML table of the cells as given, escaped."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    ident = f' id="{escape(table_id)}"' if table_id else ""
    return f"<table{ident}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def embedded_png(png: bytes, alt: str, caption: str, image_id: str = "") -> str:
    """A <figure> whose <img> holds the PNG itself (a data URI), with its caption."""
    data = base64.b64encode(png).decode("ascii")
    ident = f'id="{escape(image_id)}" ' if image_id else ""
    return (f'<figure><img {ident}alt="{escape(alt)}" title="{escape(alt)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{escape(caption)}</figcaption></figure>")


def page(title: str, style: str, body: str) -> str:
    """The whole page: `title` (escaped), the CSS `style` and the `body` markup as given."""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{style}</style></head><body>\n{body}\n</body></html>\n")
