"""Prompts from dataset files (``data.train_files``, rlcore.datasets): each format read as the
peers write it (verl's Parquet, TRL's JSON lines and ``datasets`` directories), the answer and
every other column in ``meta``, the seeded epoch order and its exact position at any step, the
overlong rule, chat templates on the tiny tokenizer, one-line errors naming the key, and a real
run (with ``--resume``) on the tiny CPU model from a JSONL file."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from rlcore.datasets import TINY_CHAT_TEMPLATE, DatasetPrompts, build_task
from rlcore.datasets.source import dataset_vocab, load_rows
from rlcore.engines.tiny import make_tokenizer
from rlcore.errors import ConfigError
from rlcore.stack import load_config, load_stack

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.yaml")
VERL_ROWS = [{
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "system", "content": "think step by step"}, {"role": "user", "content": f"what is {a} + 1 ?"}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": str(a + 1)},
    "extra_info": {"split": "train", "index": a},
} for a in range(6)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def cfg(*overrides: str):
    return load_config(TINY, list(overrides))[0]


def tiny_tokenizer(rows) -> object:
    return make_tokenizer(dataset_vocab(rows), chat_template=TINY_CHAT_TEMPLATE)


# ------------------------------------------------------------------------------ formats --

def test_verl_parquet_reads_as_it_is(tmp_path):
    """verl: chat messages in ``prompt``, the answer at ``reward_model.ground_truth`` (a dotted
    key), ``data_source``/``extra_info``/... passed to the reward in ``meta``."""
    path = write_parquet(tmp_path / "train.parquet", VERL_ROWS)
    task = build_task(cfg(f"data.train_files={path}", "data.answer_key=reward_model.ground_truth"))
    rows = task.source.rows
    assert len(rows) == 6 and rows[2].prompt == VERL_ROWS[2]["prompt"]
    meta = rows[2].meta
    assert meta["answer"] == "3" and meta["data_source"] == "openai/gsm8k" and meta["ability"] == "math"
    assert meta["extra_info"] == {"split": "train", "index": 2}
    assert meta["reward_model"] == {"style": "rule", "ground_truth": "3"} and "prompt" not in meta
    task.source.prepare(tiny_tokenizer(rows), limit=None)
    assert task.source.prompt(0).text.startswith("<|system|> think step by step <|user|> what is ")
    assert task.source.prompt(0).text.endswith(" <|assistant|>")


def test_trl_jsonl_plain_and_conversational(tmp_path):
    """TRL: a ``prompt`` column, a plain string or a conversation; the answer in ``solution``."""
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "2 + 2 =", "solution": "4"}])
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "3 + 3 ="}],
                                                  "solution": "6", "id": 7}])
    task = build_task(cfg(f"data.train_files=[{plain},{chat}]", "data.answer_key=solution"))
    rows = task.source.rows
    assert [r.meta for r in rows] == [{"solution": "4", "answer": "4"}, {"solution": "6", "id": 7, "answer": "6"}]
    task.source.prepare(tiny_tokenizer(rows), limit=None)
    assert task.source.texts == ["2 + 2 =", "<|user|> 3 + 3 = <|assistant|>"]


def test_saved_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"prompt": "a b", "answer": "c", "data_source": "toy"}] * 3).save_to_disk(
        str(tmp_path / "ds"))
    rows = build_task(cfg(f"data.train_files={tmp_path / 'ds'}")).source.rows
    assert len(rows) == 3 and rows[0].prompt == "a b" and rows[0].meta == {"answer": "c", "data_source": "toy"}


def test_answer_key_empty_means_no_answer(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "x", "tests": ["assert f()"]}])
    assert build_task(cfg(f"data.train_files={path}", "data.answer_key=")).source.rows[0].meta == {
        "tests": ["assert f()"]}


def test_tiny_vocabulary_covers_the_rendered_text_and_answers(tmp_path):
    """Every word of every rendered prompt (the template's role markers too) and every answer is
    one token of the tiny tokenizer: nothing becomes <unk>."""
    rows = [*load_rows([str(write_parquet(tmp_path / "v.parquet", VERL_ROWS))], "data.train_files", "prompt",
                       "reward_model.ground_truth"),
            *load_rows([str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "tabs\tand\nnew lines", "answer": 12}]))],
                       "data.train_files", "prompt", "answer")]
    tok = tiny_tokenizer(rows)
    source = DatasetPrompts(rows, 0, ["x"]).prepare(tok, limit=None)
    texts = source.texts + [str(r.meta["answer"]) for r in rows]
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in {i for row in ids for i in row}
    assert tok.convert_ids_to_tokens(ids[0]) == source.texts[0].split()  # one token a word
    assert {"<|system|>", "<|user|>", "<|assistant|>", "12", "tabs"} <= set(tok.get_vocab())


# -------------------------------------------------------------------------------- order --

def _source(n: int, seed: int = 0) -> DatasetPrompts:
    rows = load_rows_plain(n)
    return DatasetPrompts(rows, seed, ["mem"]).prepare(make_tokenizer([str(i) for i in range(n)]), limit=None)


def load_rows_plain(n: int):
    from rlcore.datasets.source import DataRow

    return [DataRow(str(i), {"answer": str(i)}, f"row {i}") for i in range(n)]


def test_shuffle_follows_the_seed_and_each_epoch_is_a_new_permutation():
    a, b, c = _source(10, seed=1), _source(10, seed=1), _source(10, seed=2)
    steps = [a.indices(s, 0, 5) for s in range(6)]  # 3 epochs of 10 rows
    assert steps == [b.indices(s, 0, 5) for s in range(6)]
    assert steps != [c.indices(s, 0, 5) for s in range(6)]
    epochs = [steps[0] + steps[1], steps[2] + steps[3], steps[4] + steps[5]]
    assert all(sorted(e) == list(range(10)) for e in epochs)  # every row once an epoch
    assert len({tuple(e) for e in epochs}) == 3 and epochs[0] != list(range(10))


def test_epoch_wrap_with_a_step_crossing_the_boundary():
    s = _source(5)
    first, second = s.indices(0, 0, 3), s.indices(1, 0, 3)  # positions 0-2, then 3,4 | epoch 1's 0
    assert s.position(1, 3) == (0, 3) and s.position(2, 3) == (1, 1)
    assert sorted(first + second[:2]) == list(range(5)) and second[2] == s._order(1)[0]
    assert len(s.indices(0, 0, 12)) == 12  # a round larger than the dataset spans epochs
    assert Counter(s.indices(0, 0, 10)) == Counter({i: 2 for i in range(5)})


def test_the_position_is_exact_at_any_step_however_many_rounds_came_before():
    """The prompts are a function of (seed, step, round): a fresh source (a resumed run) gives
    step 7 what the one that served steps 0-6, with extra dynamic-sampling rounds, gives."""
    served = _source(13)
    for step in range(7):
        served.indices(step, 0, 4)
        for round_ in range(1, 1 + step % 3):  # dynamic sampling: a varying number of extra rounds
            extra = served.indices(step, round_, 4)
            assert len(set(extra)) == 4  # drawn without replacement
    resumed = _source(13)
    assert [p.text for p in resumed.prompts(7, 0, 4)] == [p.text for p in served.prompts(7, 0, 4)]
    assert resumed.indices(7, 2, 4) == served.indices(7, 2, 4)
    assert served.indices(7, 1, 4) != served.indices(7, 2, 4)


# ----------------------------------------------------------------------------- overlong --

def _long_rows(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "long.jsonl", [{"prompt": " ".join(["w"] * n), "answer": "w"} for n in (3, 9, 4, 12)])


def test_overlong_prompts_are_filtered_and_counted(tmp_path):
    task = build_task(cfg(f"data.train_files={_long_rows(tmp_path)}"))
    source = task.source.prepare(make_tokenizer(task.vocab), limit=8)
    assert source.filtered == 2 and source.longest == 4 and len(source.kept) == 2
    assert "2 prompts from" in source.summary(8) and "2 longer than 8 tokens filtered" in source.summary(8)
    assert {p.text for p in source.prompts(0, 0, 6)} == {"w w w", "w w w w"}


def test_overlong_error_names_the_row(tmp_path):
    path = _long_rows(tmp_path)
    task = build_task(cfg(f"data.train_files={path}", "data.overlong=error"))
    with pytest.raises(ConfigError, match=rf"^data.overlong: the prompt of row 1 of {path} is 9 tokens, more than "
                                          rf"the 8 ") as e:
        task.source.prepare(make_tokenizer(task.vocab), limit=8, overlong="error")
    assert e.value.key == "data.overlong"


def test_check_filters_against_the_tiny_context(tmp_path, capsys):
    """``rlcore check``: the tiny model's 512 positions minus rollout.max_new_tokens."""
    from rlcore.cli import main

    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": " ".join(["w"] * n), "answer": "w"} for n in (3, 509, 508)])
    assert main(["check", TINY, f"data.train_files={path}", "rollout.max_new_tokens=4"]) == 0
    assert f"data: 2 prompts from {path}; 1 longer than 508 tokens filtered (data.overlong)" in capsys.readouterr().out
    assert main(["check", TINY, f"data.train_files={path}", "rollout.max_new_tokens=4", "data.overlong=error"]) == 2
    assert "rlcore: error: data.overlong: the prompt of row 1 of" in capsys.readouterr().err


# ------------------------------------------------------------------------------- errors --

def _check_error(*overrides: str) -> ConfigError:
    from rlcore.preflight import preflight

    with pytest.raises(ConfigError) as e:
        preflight(load_stack(TINY, list(overrides)))
    assert "\n" not in str(e.value)
    return e.value


def test_one_line_errors_name_the_key(tmp_path):
    verl = write_parquet(tmp_path / "train.parquet", VERL_ROWS)
    e = _check_error(f"data.train_files={tmp_path / 'nope.parquet'}")
    assert (e.key, str(e)) == ("data.train_files",
                               f"data.train_files: {tmp_path / 'nope.parquet'}: no such file or directory")
    e = _check_error(f"data.train_files={verl}", "data.answer_key=reward_model.truth")
    assert e.key == "data.answer_key" and str(e).startswith(
        f"data.answer_key: 'reward_model.truth' not in {verl} (columns: data_source, prompt, ability, reward_model, "
        f"extra_info)")
    e = _check_error(f"data.train_files={verl}")  # answer_key's default, 'answer', is not a verl column
    assert e.key == "data.answer_key" and str(e).startswith(f"data.answer_key: 'answer' not in {verl} (columns: ")
    e = _check_error(f"data.train_files={verl}", "data.prompt_key=question")
    assert str(e).startswith(f"data.prompt_key: 'question' not in {verl} (columns: data_source, prompt, ")
    (tmp_path / "t.csv").write_text("prompt\nx\n")
    assert _check_error(f"data.train_files={tmp_path / 't.csv'}").key == "data.train_files"
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": "1"}, {"prompt": 5, "answer": "1"}])
    e = _check_error(f"data.train_files={bad}")
    assert e.key == "data.prompt_key" and f"the prompt of row 1 of {bad} is '5'" in str(e)
    gap = write_jsonl(tmp_path / "gap.jsonl", [{"prompt": "ok", "answer": "1"}, {"prompt": "x"}])
    assert f"'answer' not in row 1 of {gap} (its columns: prompt)" in str(_check_error(f"data.train_files={gap}"))
    e = _check_error(f"data.train_files={verl}", "data.answer_key=reward_model.ground_truth",
                     f"data.val_files={tmp_path / 'val.jsonl'}")
    assert (e.key, str(e)) == ("data.val_files", f"data.val_files: {tmp_path / 'val.jsonl'}: no such file or directory")


def test_config_errors_of_the_data_keys(tmp_path):
    with pytest.raises(ConfigError, match="data.overlong"):
        cfg("data.overlong=truncate")
    with pytest.raises(ConfigError, match="^data.val_files: validation files need data.train_files"):
        cfg(f"data.val_files={tmp_path / 'v.jsonl'}")


def test_a_conversation_needs_a_chat_template(tmp_path):
    """With a model directory whose tokenizer has no chat template, the one row is refused."""
    from rlcore.datasets.source import render

    with pytest.raises(ConfigError, match=r"^data.prompt_key: the prompt of row 0 of f is a conversation, and the "
                                          r"tokenizer has no chat template"):
        render([{"role": "user", "content": "hi"}], make_tokenizer(["hi"]), "row 0 of f")


def test_a_datasetdict_directory_names_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "a", "answer": "b"}])}).save_to_disk(
        str(tmp_path / "dd"))
    e = _check_error(f"data.train_files={tmp_path / 'dd'}")
    assert str(e) == f"data.train_files: {tmp_path / 'dd'} is a DatasetDict; name one split's directory (train)"


# --------------------------------------------------------------------------------- runs --

REWARD = '''
import json, os
from rlcore.tasks import RewardInput

def logged(x: RewardInput) -> float:
    with open(os.environ["PROMPT_LOG"], "a") as f:
        f.write(json.dumps([x.prompt_text, x.meta["answer"], x.meta["data_source"]]) + "\\n")
    words = x.response_text.split()
    return 1.0 if words and words[0] == x.meta["answer"] else 0.0
'''


def test_train_and_resume_from_a_jsonl_file(tmp_path, monkeypatch):
    """A real run on the tiny CPU model from a JSONL file of conversations: 2 steps, then
    ``--resume`` to 3; the reward sees the rendered prompts and the rows' columns, and every step
    (the resumed one too) trains on exactly the prompts the seeded order puts there."""
    from rlcore.cli import main

    rows = [{"prompt": [{"role": "user", "content": f"next after {i}"}], "answer": str(i + 1), "data_source": "toy"}
            for i in range(5)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    (tmp_path / "logreward.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PROMPT_LOG", str(tmp_path / "prompts.log"))
    out = tmp_path / "run"
    args = [TINY, "--output", str(out), f"data.train_files={path}", "data.reward=logreward:logged", "rollout.n=2",
            "data.prompts_per_step=2", "output.plot=false", "output.tensorboard=false", "output.progress=false",
            "output.export_hf=never", "output.checkpoint_every=1", "engine.model.tiny.hidden_size=32",
            "engine.model.tiny.head_dim=16", "engine.model.tiny.intermediate_size=32"]
    assert main(["train", *args, "training.steps=2"]) == 0
    assert main(["train", *args, "--resume", "training.steps=3"]) == 0
    logged = [json.loads(line) for line in (tmp_path / "prompts.log").read_text().splitlines()]
    assert len(logged) == 3 * 2 * 2 and {tuple(x[1:]) for x in logged} <= {(str(i + 1), "toy") for i in range(5)}
    expected = build_task(cfg(f"data.train_files={path}")).source
    expected.prepare(tiny_tokenizer(expected.rows),
                     limit=None)
    for step in range(3):
        want = Counter(p.text for p in expected.prompts(step, 0, 2) for _ in range(2))
        assert Counter(x[0] for x in logged[step * 4:(step + 1) * 4]) == want, step
    assert logged[0][0].startswith("<|user|> next after ") and logged[0][0].endswith(" <|assistant|>")
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
