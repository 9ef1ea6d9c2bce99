"""What the scheduling path shows a person: reports (``report``), pictures (``plot``) and trace files
for a trace viewer (``trace``). Above the policies; nothing below reads them.
"""
from __future__ import annotations
