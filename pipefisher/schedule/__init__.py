"""What a packed schedule is made of, the first step of the scheduling path: profiled timelines
(``timeline``), the packing problem they pose (``problem``), the label grammar and the schedule data's
format (``format``), what a policy returns (``packed``) and schedule files with their metadata
(``file``). The rules check these, the costs measure them, the policies produce them.
"""
from __future__ import annotations
