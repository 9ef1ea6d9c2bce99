"""Starting training: workers as this process or as local child processes (``local``), the child's entry
point (``child``), and the whole profile-pack-check-train loop in one call (``driver``). The top of the
runtime; the CLI and the library API (:mod:`pipefisher.runtime.api`) stand on it."""
from __future__ import annotations
