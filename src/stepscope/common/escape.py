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
    """``str(value)`` with every line break (and tab) turned into one space, and every other
    control character shown as text (:func:`term`): safe in a table cell of any format."""
    return term(_NEWLINES.sub(" ", str(value)))


# Every code point of Unicode's categories Cc (C0 and C1 controls, DEL: ESC starts CSI/OSC
# sequences that clear the screen, set the window title or make hyperlinks; BEL, backspace and
# CR rewrite what was printed; 0x9b is a one-byte CSI), Cf (format characters: the bidi
# embeddings, overrides and isolates U+202A-E/U+2066-9 and marks U+200E/F, U+061C that make text
# read other than it is; zero-width U+200B-D, U+2060-4, U+FEFF, the soft hyphen U+00AD and the
# tag characters U+E0020-7F that hide text), Cs (lone surrogates, which no encoder accepts), Zl
# and Zp (U+2028/9, line breaks to some readers). Written out as ranges so that importing this
# module stays cheap; ``tests/unit/common/test_escape.py`` checks them against ``unicodedata``.
_UNSAFE_RANGES = (
    "\x00-\x1f\x7f-\x9f\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e"
    "\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u206f\ud800-\udfff\ufeff\ufff9-\ufffb"
    "\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0001\U000e0020-\U000e007f"
)
# The line feed is left to each escaper (it only starts a line; :func:`one_line` folds it).
_TERM_UNSAFE = re.compile(f"(?!\n)[{_UNSAFE_RANGES}]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _visible(m: re.Match[str]) -> str:
    c = ord(m.group(0))
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" if c < 0x10000 else f"\\U{c:08x}"


def name(value: str) -> str:
    """A name given to the API (phase, counter, host, run id) that every encoder accepts: each
    lone surrogate (``os.fsdecode(b"\\xff")`` is ``"\\udcff"``) written out as the text
    ``\\udcff``. Everything else is kept as given; the escapers below make it safe to show."""
    if value.isascii():  # the usual case, one C call
        return value
    return _SURROGATE.sub(_visible, value)


def term(value: Any) -> str:
    """Data for a terminal: every control character shown as text (``\\x1b``), never obeyed.

    The one terminal escaper: plain ``print`` to a terminal uses it directly; rich output
    goes through :func:`rich`, which applies it first. A tab becomes a space; a line feed
    stays (it only starts a line; :func:`one_line` folds it where one line is needed).
    """
    return _TERM_UNSAFE.sub(_visible, str(value).replace("\t", " "))


def rich(value: Any) -> str:
    """Data for a rich markup string: inert for the terminal (:func:`term`), and ``[`` cannot
    open a tag (``[bold]``, ``[/]`` and ``[link=...]`` print as text)."""
    from rich.markup import escape  # lazy: keeps rich out of ``import stepscope``

    return escape(term(value))


def plot(value: Any) -> str:
    """Data for a matplotlib label or title: one line, written out like :func:`one_line`, and
    ``$`` cannot start mathtext; a leading ``_`` cannot hide a legend entry."""
    text = one_line(value).replace("$", r"\$")
    return " " + text if text.startswith("_") else text


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

    return html.escape(term(value), quote=True)


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


def shown(obj: Any) -> Any:
    """``obj`` with every string in it (keys too) made inert for a reader that shows it as
    text (:func:`term`): a page's data, Perfetto's slice names. Numbers and structure are kept."""
    if isinstance(obj, str):
        return term(obj)
    if isinstance(obj, dict):
        return {shown(k): shown(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [shown(v) for v in obj]
    return obj


_SCRIPT_UNSAFE = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
                  "\u2029": "\\u2029"}


def json_for_script(obj: Any) -> str:
    """JSON text that is safe inside ``<script type="application/json">``.

    ``<``, ``>`` and ``&`` are written as ``\\u`` escapes, so no ``</script>`` or ``<!--``
    in the data can end the element; U+2028/9 are escaped for old JavaScript parsers, and
    every control or format character in a string is written out (:func:`shown`). The
    page reads it back with ``JSON.parse(el.textContent)``.
    """
    text = json.dumps(shown(finite(obj)), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return re.sub("[<>&\u2028\u2029]", lambda m: _SCRIPT_UNSAFE[m.group(0)], text)
