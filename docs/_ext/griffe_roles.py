"""Griffe extension: xopt's docstrings, written with Sphinx roles, read as Markdown.

``:func:`name``` and the other roles become code spans, and ``>>>`` example lines become
``pycon`` code blocks (in Markdown they would be nested block quotes). Nothing else is
changed.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|obj|exc|const):`~?([^`]+)`")


def _markdown(text: str) -> str:
    text = _ROLE.sub(r"`\1`", text)
    out, block = [], []

    def flush():
        if block:
            indent = block[0][: len(block[0]) - len(block[0].lstrip())]
            out.extend([f"{indent}```pycon", *block, f"{indent}```"])
            block.clear()

    for line in text.split("\n"):
        if line.lstrip().startswith((">>>", "... ")) and (block or line.lstrip()
                                                          .startswith(">>>")):
            block.append(line)
        else:
            flush()
            out.append(line)
    flush()
    return "\n".join(out)


class SphinxRolesToMarkdown(griffe.Extension):
    def on_object(self, *, obj, **kwargs) -> None:  # noqa: ARG002  (once the tree is built)
        if obj.docstring is not None:
            obj.docstring.value = _markdown(obj.docstring.value)
