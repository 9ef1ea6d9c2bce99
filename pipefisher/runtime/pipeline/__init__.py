"""Running a pipeline step: the engine's forward and backward calls with their point-to-point transfers
(``engine``), a device's stage copies for Chimera and interleaving (``copies``), what the runtime's labels
are (``labels``) and which copies and K-FAC modules each device holds (``layout``), whether a schedule
fits this run (``checks``, on top of :mod:`pipefisher.rules`), and the executor, where a schedule's label
becomes a call (``executor``). No optimizer state here: that is the training layer's."""
from __future__ import annotations
