"""Pipeline-parallel training in torch, with K-FAC and a profiler that writes timeline files.

This package and :mod:`pipefisher.kfac` are the only parts of pipefisher that import torch; import
them only where a command actually trains.
"""
from __future__ import annotations
