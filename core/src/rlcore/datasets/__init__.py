"""Prompts from dataset files: ``data.train_files`` / ``data.val_files`` (JSON lines, Parquet,
``datasets`` save_to_disk directories), rendered through the tokenizer's chat template, shuffled
by ``training.seed`` epoch by epoch (docs/data.md). :mod:`rlcore.datasets.files` reads the files,
:mod:`rlcore.datasets.source` turns their rows into each step's prompts."""

from rlcore.datasets.source import (
    TINY_CHAT_TEMPLATE,
    DatasetPrompts,
    DatasetTask,
    build_task,
    context_limit,
    data_files,
    engine_positions,
)

__all__ = ["TINY_CHAT_TEMPLATE", "DatasetPrompts", "DatasetTask", "build_task", "context_limit", "data_files",
           "engine_positions"]
