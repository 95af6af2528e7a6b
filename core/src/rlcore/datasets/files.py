"""Reading the rows of prompt files from local paths: JSON lines (``.jsonl``, ``.json``: one
object a line), Parquet (``.parquet``, through pyarrow) and ``datasets`` ``save_to_disk``
directories (through ``datasets.load_from_disk``, imported only for such a directory). Every
problem is a one-line :class:`~rlcore.errors.ConfigError` naming the config key (``data.train_files``,
``data.prompt_key``, ...) and the file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlcore.errors import ConfigError, one_line

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
_MISSING = object()
OVERLONG_CHOICES = ("filter", "error")  #: data.overlong


def check_data_files(cfg: Any) -> None:
    """Config-time checks of the ``data`` keys of files (no file is opened here: rlcore.preflight)."""
    d = cfg.data
    train = file_list(d.train_files, "data.train_files")
    val = file_list(d.val_files, "data.val_files")
    if val and not train:
        raise ConfigError("data.val_files: validation files need data.train_files (a task function makes its own "
                          "prompts)", key="data.val_files")
    if train and not str(d.prompt_key or "").strip():
        raise ConfigError("bad value for config key 'data.prompt_key': empty; name the prompt's column",
                          key="data.prompt_key")


def file_list(value: Any, key: str) -> list[str]:
    """``data.train_files`` / ``data.val_files`` as a list of paths: a path, a list of paths, or
    empty (``None``, ``""``, ``[]``: no files)."""
    if value is None or value == "":
        return []
    if isinstance(value, (str, Path)):
        return [str(value)]
    if isinstance(value, Sequence) and all(isinstance(v, (str, Path)) and str(v) for v in value):
        return [str(v) for v in value]
    try:  # an omegaconf ListConfig
        from omegaconf import ListConfig, OmegaConf

        if isinstance(value, ListConfig):
            return file_list(OmegaConf.to_container(value), key)
    except ImportError:  # pragma: no cover - omegaconf is a dependency of core
        pass
    raise ConfigError(f"bad value for config key {key!r}: {value!r}; give a path or a list of paths", key=key)


def read_rows(path: str, key: str) -> list[dict[str, Any]]:
    """The rows of one file (or ``save_to_disk`` directory) as dicts; ``key`` names the config key."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{key}: {path}: no such file or directory", key=key)
    if p.is_dir():
        rows = _read_saved_dataset(p, key)
    elif p.suffix.lower() in JSON_SUFFIXES:
        rows = _read_json_lines(p, key)
    elif p.suffix.lower() in PARQUET_SUFFIXES:
        rows = _read_parquet(p, key)
    else:
        raise ConfigError(f"{key}: {path}: unknown format {p.suffix or '(no suffix)'!r}; rlcore reads .jsonl/.json "
                          f"(JSON lines), .parquet and datasets save_to_disk directories", key=key)
    if not rows:
        raise ConfigError(f"{key}: {path} holds no rows", key=key)
    return rows


def _read_json_lines(p: Path, key: str) -> list[dict[str, Any]]:
    rows = []
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}: cannot read {p}: {one_line(exc)}", key=key) from exc
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"{key}: {p} line {n} is not JSON (one object a line): {one_line(exc, 120)}",
                              key=key) from exc
        if not isinstance(row, dict):
            raise ConfigError(f"{key}: {p} line {n} is a {type(row).__name__}, not a JSON object", key=key)
        rows.append(row)
    return rows


def _read_parquet(p: Path, key: str) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError(f"{key}: reading {p} needs pyarrow: pip install pyarrow (or rlcore[data])", key=key) from exc
    try:
        return pq.read_table(p).to_pylist()
    except Exception as exc:  # noqa: BLE001 - whatever pyarrow raises for a damaged file
        raise ConfigError(f"{key}: cannot read {p} as Parquet: {type(exc).__name__}: {one_line(exc, 200)}",
                          key=key) from exc


def _read_saved_dataset(p: Path, key: str) -> list[dict[str, Any]]:
    if (p / "dataset_dict.json").exists():
        splits = sorted(d.name for d in p.iterdir() if d.is_dir())
        raise ConfigError(f"{key}: {p} is a DatasetDict; name one split's directory ({', '.join(splits)})", key=key)
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError(f"{key}: reading the datasets directory {p} needs the datasets package: pip install "
                          f"datasets (or rlcore[data])", key=key) from exc
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as exc:  # noqa: BLE001 - not a save_to_disk directory, damaged
        raise ConfigError(f"{key}: cannot read {p} with datasets.load_from_disk: {type(exc).__name__}: "
                          f"{one_line(exc, 200)}", key=key) from exc
    return ds.to_list()


def lookup(row: dict[str, Any], dotted: str) -> Any:
    """``row[dotted]``, else the nested value at the dotted path (``reward_model.ground_truth``);
    a sentinel (:data:`_MISSING`) when absent."""
    if dotted in row:
        return row[dotted]
    node: Any = row
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def missing(value: Any) -> bool:
    return value is _MISSING


def columns(rows: list[dict[str, Any]]) -> str:
    """The first row's columns, for error messages."""
    return ", ".join(map(str, rows[0])) if rows else "none"
