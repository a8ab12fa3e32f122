"""One escaping helper per output format, used by every renderer for text that comes from data.

Phase names, hostnames, trigger reasons, kernel names and file names are written by the
user's program (or by whoever produced a trace): they may hold ``[bold]`` (rich markup),
``|`` and newlines (markdown tables) or ``</script>`` (HTML). Static text written by
stepscope is not escaped; everything interpolated from a run or a trace goes through here.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

# "#" only starts a heading at the beginning of a line; inside text ("ProfilerStep#4") it is
# harmless, and cells never start a line.
_MD_SPECIAL = re.compile(r"([\\`*\[\]<>|!~]|^#)")
# An underscore only starts or ends emphasis at a word boundary (``grad_sync`` is safe).
_MD_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
_NEWLINES = re.compile(r"[\r\n\u2028\u2029\x0b\x0c\x85]+")


def one_line(value: Any) -> str:
    """``str(value)`` with every line break (and tab) turned into one space."""
    return _NEWLINES.sub(" ", str(value)).replace("\t", " ")


def rich(value: Any) -> str:
    """Data for a rich markup string: ``[`` cannot open a tag (``[/]`` prints as text)."""
    from rich.markup import escape

    return escape(str(value))


def md(value: Any) -> str:
    """Data for markdown text or a table cell: one line, no markup, ``|`` cannot split a cell."""
    text = _MD_SPECIAL.sub(r"\\\1", one_line(value))
    return _MD_UNDERSCORE.sub(r"\\_", text)


def md_code(value: Any) -> str:
    """Data as an inline code span (file names, kernel names), safe inside a table cell."""
    text = one_line(value).replace("|", "\\|")
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def html_text(value: Any) -> str:
    """Data for HTML text or a quoted attribute value."""
    import html

    return html.escape(str(value), quote=True)


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, ±inf) replaced by ``None``: valid JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def write_json(obj: Any, fp: Any, indent: int = 2) -> None:
    """``obj`` as JSON on ``fp`` plus a newline; non-finite numbers become null (always valid)."""
    json.dump(finite(obj), fp, indent=indent, allow_nan=False)
    fp.write("\n")


_SCRIPT_UNSAFE = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
                  "\u2029": "\\u2029"}


def json_for_script(obj: Any) -> str:
    """JSON text that is safe inside ``<script type="application/json">``.

    ``<``, ``>`` and ``&`` are written as ``\\u`` escapes, so no ``</script>`` or ``<!--``
    in the data can end the element; U+2028/9 are escaped for old JavaScript parsers. The
    page reads it back with ``JSON.parse(el.textContent)``.
    """
    text = json.dumps(finite(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return re.sub("[<>&\u2028\u2029]", lambda m: _SCRIPT_UNSAFE[m.group(0)], text)
