"""What makes a schedule valid, in one place: its format (the grammar is :mod:`pipefisher.schedule.format`,
checked here), the dependency rules, the room rule, the sync groups' shared order, and waits that deadlock.

Every check of a schedule calls these rules: ``pipefisher validate``, the packers' self-checks, the
driver, the reports and the runtime (which adds only what depends on the model it runs). Plain Python:
no torch, no policy; :func:`validate` is the one entry point.
"""
from __future__ import annotations

from pipefisher.rules.validation import validate, validate_node
from pipefisher.rules.violations import Violation
from pipefisher.schedule.format import ScheduleData, check_schedule_data

__all__ = ["ScheduleData", "Violation", "check_schedule_data", "validate", "validate_node"]
