"""markdown_links: the links and anchors of a Markdown file, for tools/check-citations and
tools/doxygen-markdown-filter.

Only what the handouts use: inline links `[text](target)`, reference links `[text][label]`
with their `[label]: target` definitions, images, and explicit anchors (`<a id="x"></a>`
before a heading, or Doxygen's `{#x}` after it). Code is not prose:
links inside fenced code blocks and `inline code` are examples, not links.
"""

import re
from dataclasses import dataclass
from urllib.parse import unquote

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
# A code span ends at its closing backticks, and never runs past a paragraph (a blank line).
INLINE_CODE = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.DOTALL)
# [text](target "title"): the text may hold one level of brackets and span lines.
INLINE_LINK = re.compile(
    r"!?\[(?P<text>(?:[^\[\]]|\[[^\[\]]*\])*)\]"
    r"\(\s*<?(?P<target>[^)\s>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFERENCE_LINK = re.compile(r"!?\[(?P<text>(?:[^\[\]]|\[[^\[\]]*\])*)\]\[(?P<label>[^\[\]]*)\]")
DEFINITION = re.compile(r"^ {0,3}\[(?P<label>[^\[\]]+)\]:[ \t]*<?(?P<target>[^\s>]+)>?.*$",
                        re.MULTILINE)
EXPLICIT_ANCHOR = re.compile(r"<a\s+(?:id|name)\s*=\s*\"(?P<id>[^\"]+)\"|\{#(?P<label>[\w-]+)\}")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:|^//")


@dataclass
class Link:
    """One link of a file: its text, its target as written, and where it stands."""
    text: str
    target: str
    line: int
    start: int  # offset in the masked text
    end: int

    @property
    def is_relative(self):
        """A path inside the tree (or an anchor of this file), not a URL or a Doxygen @ref."""
        return bool(self.target) and not SCHEME.match(self.target) and \
            not self.target.startswith("@")

    @property
    def path(self):
        """The file part of the target, decoded ("" for an anchor of this file)."""
        return unquote(self.target.split("#", 1)[0])

    @property
    def anchor(self):
        """The part after '#', or None."""
        return self.target.split("#", 1)[1] if "#" in self.target else None


def mask_code(text):
    """`text` with fenced code blocks and inline code blanked out (newlines kept), so that
    offsets and line numbers still match the file."""
    lines = text.splitlines(keepends=True)
    out = []
    fence = None
    for line in lines:
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)[0] * len(match.group(1))
            out.append(_blank(line))
        elif fence is not None:
            if line.strip().startswith(fence) and line.strip().strip(fence[0]) == "":
                fence = None
            out.append(_blank(line))
        else:
            out.append(line)
    masked = "".join(out)
    return INLINE_CODE.sub(lambda m: _blank(m.group(0)), masked)


def _blank(text):
    return re.sub(r"[^\n]", " ", text)


def line_of(text, offset):
    """The 1-based line number of `offset` in `text`."""
    return text.count("\n", 0, offset) + 1


def links(text):
    """Every link of Markdown `text` outside code, in order of appearance."""
    masked = mask_code(text)
    definitions = {m.group("label").strip().lower(): m.group("target")
                   for m in DEFINITION.finditer(masked)}
    found = []
    for match in INLINE_LINK.finditer(masked):
        found.append(Link(match.group("text"), match.group("target"),
                          line_of(masked, match.start()), match.start(), match.end()))
    taken = [(link.start, link.end) for link in found]
    for match in REFERENCE_LINK.finditer(masked):
        if any(start <= match.start() < end for start, end in taken):
            continue
        label = (match.group("label") or match.group("text")).strip().lower()
        if label in definitions:
            found.append(Link(match.group("text"), definitions[label],
                              line_of(masked, match.start()), match.start(), match.end()))
    for match in DEFINITION.finditer(masked):
        found.append(Link("", match.group("target"), line_of(masked, match.start()),
                          match.start(), match.end()))
    return sorted(found, key=lambda link: link.start)


def explicit_anchors(text):
    """The anchors Doxygen and GitHub both know: `<a id="x">`, `<a name="x">` and `{#x}`."""
    masked = mask_code(text)
    return {m.group("id") or m.group("label") for m in EXPLICIT_ANCHOR.finditer(masked)}
