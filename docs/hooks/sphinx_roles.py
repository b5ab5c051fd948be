"""mkdocs hook: the API reference's docstrings are written for Sphinx (``:func:`x```, ``:class:`~a.B```), which
mkdocstrings renders as the role's raw name before the code (":func:x"). Each role becomes the code alone, a
``~`` target its last component, as Sphinx shows it."""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|data|attr|obj|exc|const|term|ref):<code>(~?)([^<]*)</code>")


def _shown(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def on_page_content(html: str, **kwargs) -> str:
    return ROLE.sub(_shown, html)
