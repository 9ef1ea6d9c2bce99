"""What the model trains on: text corpora and their tokenizer (``corpus``) and the micro-batches every
stage derives from (seed, step, replica, index) on its own (``batches``). Below the pipeline, which
feeds them in; above the models, whose loss convention (ignored labels) the batches follow."""
from __future__ import annotations
