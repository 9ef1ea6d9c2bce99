"""Pipeline-parallel training in torch, with K-FAC in the pipeline's bubbles, in layers from the bottom up.

``job`` (the run config, this process's place in the job, torch.distributed set-up), ``models`` (stage
builders: the built-in BERT, Hugging Face models), ``data`` (corpora and micro-batches), ``pipeline``
(the engine that runs forwards and backwards, a device's stage copies, the checks that a schedule fits
this run, and the executor where a label becomes a call), ``train`` (a worker's step, the update rule,
optimizers, checkpoints, profiling, recording and the closed loop: where training state lives), and
``launch`` (starting workers, the one-call driver). :mod:`pipefisher.runtime.api` is the library API.
Each layer imports only the layers below it. This package and :mod:`pipefisher.kfac` are the only
parts of pipefisher that import torch; import them only where a command actually trains.
"""
from __future__ import annotations
