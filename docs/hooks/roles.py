"""A mkdocs hook: the docstrings' Sphinx cross-reference roles shown as plain code in the API pages.

The docstrings name things the Sphinx way (``:class:`~pipefisher.cost.objective.Candidate```), which reads
well in the source and in ``help()``; mkdocstrings renders them literally (``:class:`` and all). This
keeps the name as code and drops the role, and a leading ``~`` keeps only the last dotted part, as
Sphinx does.
"""
from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|exc|obj):<code>(~?)([^<]+)</code>")


def plain(html: str) -> str:
    return ROLE.sub(lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>", html)


def on_page_content(html: str, **kwargs: Any) -> str:
    return plain(html)
