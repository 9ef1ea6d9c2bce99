"""The model, as pipeline stages: what a stage builder is (``model.builder``) and how every stage copy is
made and checked (``builders``), the built-in BERT-style model (``bert``) and Hugging Face transformers
models (``hf``). Stages know nothing about pipelines or schedules; the layers above run them."""
from __future__ import annotations
