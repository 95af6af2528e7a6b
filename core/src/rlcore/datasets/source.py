"""Prompts from dataset files (``data.train_files``): the rows read (:mod:`rlcore.datasets.files`),
rendered (a conversational prompt through the tokenizer's chat template), measured against the
model's context (``data.overlong``), and handed out in a seeded, epoch-wise shuffled order that
is a function of the step alone.

The order: the kept rows form an endless stream of epochs, each a new permutation seeded by
``training.seed`` and the epoch's number. Round 0 of step ``s`` takes stream positions
``s*B .. s*B+B-1`` (``B``: the prompts per round, :func:`rlcore.sampling_rounds.round_prompts`),
so every epoch shows each row once and a resumed run (or the rollout producer ahead of the
trainer, or ReMax asking the step's prompts again) gets exactly the same prompts at the same step.
The extra rounds of DAPO's dynamic sampling (round ``r`` >= 1) draw ``B`` rows without
replacement from a permutation seeded by the seed, the step and the round: they do not move the
stream, so the position stays exact however many rounds a step took.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from rlcore.datasets.files import columns, file_list, lookup, missing, read_rows
from rlcore.errors import ConfigError, one_line
from rlcore.tasks import Task, TaskPrompt

#: the chat template a tiny model's tokenizer gets (rlcore.engines.tiny): each message as its
#: role's marker word and its content, then the assistant's marker; every word of it is split at
#: whitespace, so the vocabulary built from rendered prompts holds the markers too
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass
class DataRow:
    """One row: its prompt (a str, or a list of ``{role, content}`` messages) and what the reward
    gets as ``meta`` (every other column, the answer under ``"answer"``); ``where`` names it."""

    prompt: Any
    meta: dict[str, Any]
    where: str


def load_rows(paths: list[str], files_key: str, prompt_key: str, answer_key: str) -> list[DataRow]:
    """Every row of ``paths``, each with its prompt and meta; a file without the prompt key or
    the answer key (``answer_key`` empty: no answer) is refused naming the key and the columns."""
    out: list[DataRow] = []
    for path in paths:
        rows = read_rows(path, files_key)
        for i, row in enumerate(rows):
            where = f"row {i} of {path}"
            prompt = lookup(row, prompt_key)
            if missing(prompt):
                raise ConfigError(_missing_key("data.prompt_key", prompt_key, path, rows, i), key="data.prompt_key")
            check_prompt(prompt, where)
            meta = {k: v for k, v in row.items() if k != prompt_key}
            if answer_key:
                answer = lookup(row, answer_key)
                if missing(answer):
                    raise ConfigError(_missing_key("data.answer_key", answer_key, path, rows, i) +
                                      "; set data.answer_key to the answer's column (a dotted path reads a nested "
                                      "field), or '' for none", key="data.answer_key")
                meta["answer"] = answer
            out.append(DataRow(prompt, meta, where))
    return out


def _missing_key(key: str, name: str, path: str, rows: list[dict[str, Any]], i: int) -> str:
    if i == 0:
        return f"{key}: {name!r} not in {path} (columns: {columns(rows)})"
    return f"{key}: {name!r} not in row {i} of {path} (its columns: {', '.join(map(str, rows[i]))})"


def check_prompt(prompt: Any, where: str) -> None:
    """A prompt is a str or a non-empty list of ``{role, content}`` messages."""
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in prompt):
        return
    raise ConfigError(f"data.prompt_key: the prompt of {where} is {str(prompt)[:80]!r}; a prompt is a string or a "
                      f"list of chat messages {{role, content}}", key="data.prompt_key")


def render(prompt: Any, tokenizer: Any, where: str) -> str:
    """A plain prompt as it is; a conversation through ``tokenizer.apply_chat_template``."""
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"data.prompt_key: the prompt of {where} is a conversation, and the tokenizer has no chat "
                          f"template to render it (set tokenizer.chat_template in the model directory)",
                          key="data.prompt_key")
    try:
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - whatever the template raises
        raise ConfigError(f"data.prompt_key: the prompt of {where} does not render through the chat template: "
                          f"{type(exc).__name__}: {one_line(exc, 200)}", key="data.prompt_key") from exc
    return text if isinstance(text, str) else str(text)


@dataclass
class DatasetPrompts:
    """The rows of a file set, ready once :meth:`prepare` has rendered and measured them."""

    rows: list[DataRow]
    seed: int
    files: list[str]
    texts: list[str] = field(default_factory=list)  #: the kept rows' rendered prompts
    kept: list[int] = field(default_factory=list)  #: indices into ``rows``
    filtered: int = 0  #: rows dropped as longer than the context
    longest: int = 0  #: the longest kept prompt, in tokens
    _orders: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def prepare(self, tokenizer: Any, limit: int | None, overlong: str = "filter") -> DatasetPrompts:
        """Render every row with ``tokenizer`` and keep those of at most ``limit`` tokens
        (``None``: no limit); ``overlong`` ``error`` refuses the first longer one instead."""
        texts = [render(r.prompt, tokenizer, r.where) for r in self.rows]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        self.texts, self.kept, self.filtered, self.longest, self._orders = [], [], 0, 0, {}
        for i, (text, row_ids) in enumerate(zip(texts, ids, strict=True)):
            if limit is not None and len(row_ids) > limit:
                if overlong == "error":
                    raise ConfigError(f"data.overlong: the prompt of {self.rows[i].where} is {len(row_ids)} tokens, "
                                      f"more than the {limit} the context leaves (the model's positions minus "
                                      f"rollout.max_new_tokens); set data.overlong=filter to drop such rows",
                                      key="data.overlong")
                self.filtered += 1
                continue
            self.kept.append(i)
            self.texts.append(text)
            self.longest = max(self.longest, len(row_ids))
        if not self.kept:
            raise ConfigError(f"data.overlong: every one of the {len(self.rows)} prompts of {', '.join(self.files)} is "
                              f"longer than the {limit} tokens the context leaves", key="data.overlong")
        return self

    def summary(self, limit: int | None) -> str:
        dropped = f"; {self.filtered} longer than {limit} tokens filtered (data.overlong)" if self.filtered else ""
        return f"data: {len(self.kept)} prompts from {', '.join(self.files)}{dropped}"

    def _order(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s permutation of the kept rows (this epoch's and the one before stay
        cached; the rollout producer's thread and the trainer's may both ask: each builds its own)."""
        cached = self._orders.get(epoch)
        if cached is not None:
            return cached
        order = list(range(len(self.kept)))
        random.Random(f"rlcore.datasets:{self.seed}:{epoch}").shuffle(order)
        keep = {e: o for e, o in list(self._orders.items()) if e == epoch - 1}
        self._orders = {**keep, epoch: order}
        return order

    def position(self, step: int, count: int) -> tuple[int, int]:
        """(epoch, index in it) of the first prompt of round 0 of ``step``."""
        return divmod(step * count, len(self.kept))

    def indices(self, step: int, round_: int, count: int) -> list[int]:
        """Which kept rows round ``round_`` of ``step`` gets (see the module docstring)."""
        n = len(self.kept)
        if round_ == 0:
            return [self._order(p // n)[p % n] for p in range(step * count, (step + 1) * count)]
        rng = random.Random(f"rlcore.datasets:{self.seed}:{step}:{round_}")
        out: list[int] = []
        while len(out) < count:
            out += rng.sample(range(n), min(n, count - len(out)))
        return out

    def prompts(self, step: int, round_: int, count: int) -> list[TaskPrompt]:
        return [self.prompt(i) for i in self.indices(step, round_, count)]

    def prompt(self, k: int) -> TaskPrompt:
        return TaskPrompt(self.texts[k], dict(self.rows[self.kept[k]].meta))


@dataclass
class DatasetTask(Task):
    """The :class:`~rlcore.tasks.Task` of a run on ``data.train_files``: ``vocab`` holds the words
    of the prompts (rendered with :data:`TINY_CHAT_TEMPLATE`) and answers for a tiny model's
    tokenizer; the trainer takes each step's prompts from ``source`` by step and round."""

    source: DatasetPrompts | None = None
    val: DatasetPrompts | None = None
    chat_template: str | None = None


def data_files(cfg: Any) -> bool:
    """Whether the run reads its prompts from files."""
    return bool(file_list(cfg.data.train_files, "data.train_files"))


def build_task(cfg: Any) -> DatasetTask:
    """The files of ``cfg.data`` read and checked; for a tiny model (no ``engine.model.path``),
    the vocabulary of the rendered prompts and the answers, and the tiny chat template."""
    d = cfg.data
    seed = int(cfg.training.seed)
    keys = (str(d.prompt_key), str(d.answer_key or ""))
    train_paths = file_list(d.train_files, "data.train_files")
    source = DatasetPrompts(load_rows(train_paths, "data.train_files", *keys), seed, train_paths)
    val_paths = file_list(d.val_files, "data.val_files")
    val = DatasetPrompts(load_rows(val_paths, "data.val_files", *keys), seed, val_paths) if val_paths else None
    tiny = not cfg.engine.model.path
    vocab = dataset_vocab(source.rows + (val.rows if val else [])) if tiny else []

    def make(rng: random.Random, count: int) -> list[TaskPrompt]:  # a Task's own interface: rows at random
        if not source.kept:
            raise ConfigError("data.train_files: the prompts are not rendered yet (DatasetPrompts.prepare)",
                              key="data.train_files")
        return [source.prompt(rng.randrange(len(source.kept))) for _ in range(count)]

    return DatasetTask(f"files {', '.join(train_paths)}", vocab, make, "prompts from data.train_files",
                       source=source, val=val, chat_template=TINY_CHAT_TEMPLATE if tiny else None)


def dataset_vocab(rows: list[DataRow]) -> list[str]:
    """Every word of the rows' prompts rendered with :data:`TINY_CHAT_TEMPLATE` and of their
    answers, split as the tiny tokenizer's whitespace pre-tokenizer splits them, in first-seen order."""
    from rlcore.engines.tiny import make_tokenizer

    tok = make_tokenizer([], chat_template=TINY_CHAT_TEMPLATE)
    pre = tok.backend_tokenizer.pre_tokenizer
    words: dict[str, None] = {}
    for r in rows:
        texts = [render(r.prompt, tok, r.where)]
        if "answer" in r.meta and r.meta["answer"] is not None:
            texts.append(str(r.meta["answer"]))
        for text in texts:
            for w, _ in pre.pre_tokenize_str(text):
                if not any(ch.isspace() for ch in w):  # python's whitespace is wider than the splitter's
                    words.setdefault(w, None)
    return list(words)


def context_limit(cfg: Any, max_positions: int | None) -> int | None:
    """The most prompt tokens the context leaves: the model's positions minus ``rollout.max_new_tokens``."""
    return None if not max_positions else int(max_positions) - int(cfg.rollout.max_new_tokens)


def engine_positions(engine: Any) -> int | None:
    """The model's positions as its transformers config says (``None`` when the engine has none)."""
    config = getattr(getattr(engine, "model", None), "config", None)
    config = getattr(config, "text_config", None) or config
    positions = getattr(config, "max_position_embeddings", None)
    return positions if isinstance(positions, int) and positions > 0 else None
