"""The built-in rewards of rlcore.scoring: math-verify's equivalence (boxed, last number, fractions
and decimals), exact match with its normalisation, the boxed and regex format rewards, the choice
of reward by ``data_source`` (``data.reward_by_source``, a reward factory), and math-verify called
through rlcore's reward path (a worker thread, where its signal-based timeout cannot run)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from rlcore import scoring
from rlcore.cli import main
from rlcore.config import DataConfig, training_fingerprint
from rlcore.errors import ConfigError, RewardError
from rlcore.preflight import load_reward
from rlcore.rewards import RewardCalls
from rlcore.run_output import read_metrics
from rlcore.scoring import (
    boxed_format_reward,
    by_data_source_reward,
    exact_match_last_line_reward,
    exact_match_last_word_reward,
    exact_match_reward,
    math_verify_reward,
    normalize_answer,
    regex_reward,
    regex_reward_for,
)
from rlcore.stack import load_config
from rlcore.tasks import RewardInput, load_callable, resolve_reward

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.yaml")

pytest.importorskip("math_verify", reason="rlcore[math] (math-verify) is not installed")


def x(response: str, **meta) -> RewardInput:
    return RewardInput(prompt_text="q", response_text=response, prompt_ids=[1], response_ids=[2], meta=meta)


# ---------------------------------------------------------------------------- math-verify --

@pytest.mark.parametrize("response, answer", [
    ("so the answer is \\boxed{\\frac{1}{2}}.", "0.5"),  # boxed LaTeX fraction against a decimal
    ("\\boxed{0.5}", "1/2"),
    ("\\boxed{\\frac12}", "\\frac{1}{2}"),
    ("It is 1/2", "0.5"),  # no boxed: the last expression
    ("First 3 apples, then 4 more: 7", "7"),  # no boxed: the last number
    ("#### 72", "72"),  # GSM8K's answer line
    ("The total is $1,234$.", "1234"),  # a thousands separator
    ("I get 3.0", "3"),
    ("\\boxed{x = 5}", "5"),
    ("answer: 12. I checked it twice, 3 times", "12"),  # the "answer:" anchor beats the last number
    ("\\boxed{7}", 7),  # a dataset column of ints
    ("\\boxed{7}", ["6", "7"]),  # several accepted answers
])
def test_math_verify_accepts_equivalent_answers(response, answer):
    assert math_verify_reward(x(response, answer=answer)) == 1.0


@pytest.mark.parametrize("response, answer", [
    ("\\boxed{\\frac{1}{3}}", "0.5"),
    ("#### 73", "72"),
    ("12 and then 13", "12"),  # the last number, not the first
    ("the answer is \\boxed{5} and 5 + 1 = 6", "6"),  # boxed beats the last number
    ("\\boxed{5} or maybe \\boxed{6}", "6"),  # hedged boxed answers are read together (a set)
    ("no number here", "1"),
    ("", "1"),
    ("\\boxed{}", "1"),
])
def test_math_verify_scores_wrong_or_missing_answers_0(response, answer):
    assert math_verify_reward(x(response, answer=answer)) == 0.0


def test_math_verify_without_an_answer_names_the_meta_key():
    with pytest.raises(KeyError) as err:
        math_verify_reward(x("\\boxed{1}", question="what?"))
    msg = str(err.value)
    assert "rlcore.scoring:math_verify_reward needs meta['answer'] and it is missing" in msg, msg
    assert "'question'" in msg, "the meta keys there are are named"
    with pytest.raises(KeyError, match="it is None"):
        math_verify_reward(x("\\boxed{1}", answer=None))


def test_without_math_verify_the_error_names_the_extra(monkeypatch):
    monkeypatch.setattr(scoring, "_math_verify", None)
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'rlcore\[math\]'"):
        math_verify_reward(x("\\boxed{1}", answer="1"))


def test_math_verify_off_the_main_thread_runs_without_signals():
    got, errors = [], []

    def score() -> None:
        try:
            got.append(math_verify_reward(x("\\boxed{\\frac{2}{4}}", answer="0.5")))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=score)
    t.start()
    t.join(60)
    assert not errors and got == [1.0], errors


@pytest.mark.parametrize("timeout", [60, 0])  # a worker thread (the default), the caller's (main) thread
def test_math_verify_through_rlcores_reward_calls(timeout):
    calls = RewardCalls(math_verify_reward, "rlcore.scoring:math_verify_reward", timeout)
    inputs = [x("\\boxed{\\frac{1}{2}}", answer="0.5"), x("so 0.25", answer="1/4"), x("\\boxed{3}", answer="4")]
    assert calls.score(inputs, lambda i: f"sample {i} of step 0") == [1.0, 1.0, 0.0]


def test_a_missing_answer_through_rlcores_reward_calls_is_a_reward_error():
    calls = RewardCalls(math_verify_reward, "rlcore.scoring:math_verify_reward", 60)
    with pytest.raises(RewardError) as err:
        calls.score([x("\\boxed{1}")], lambda i: f"sample {i} of step 0")
    assert "raised MetaKeyError: rlcore.scoring:math_verify_reward needs meta['answer']" in str(err.value)


# ---------------------------------------------------------------------------- exact match --

def test_normalize_answer():
    assert normalize_answer("  The \n Answer.  ") == "the answer"
    assert normalize_answer("3.5") == "3.5" and normalize_answer("Paris..") == "paris."  # one period only
    assert normalize_answer(42) == "42"


@pytest.mark.parametrize("response, answer, want", [
    ("Paris", "Paris", 1.0),
    ("  paris. ", "Paris", 1.0),
    ("PARIS", "paris.", 1.0),
    ("New   York", "new york", 1.0),
    ("Paris, France", "Paris", 0.0),
    ("It is Paris", "Paris", 0.0),  # the whole response
    ("", "Paris", 0.0),
    ("Lyon", ["Paris", "lyon"], 1.0),
])
def test_exact_match(response, answer, want):
    assert exact_match_reward(x(response, answer=answer)) == want


def test_exact_match_last_line_and_last_word():
    text = "Let me think.\nThe capital is Paris.\n\nParis.\n  "
    assert exact_match_last_line_reward(x(text, answer="paris")) == 1.0
    assert exact_match_last_line_reward(x("paris\nno wait, Lyon", answer="paris")) == 0.0
    assert exact_match_last_word_reward(x("so the capital is Paris.", answer="paris")) == 1.0
    assert exact_match_last_word_reward(x("Paris is the capital", answer="paris")) == 0.0
    assert exact_match_last_line_reward(x("", answer="paris")) == 0.0
    assert exact_match_last_word_reward(x("   ", answer="paris")) == 0.0
    with pytest.raises(KeyError, match="exact_match_reward needs meta\\['answer'\\]"):
        exact_match_reward(x("Paris"))


# --------------------------------------------------------------------------------- format --

@pytest.mark.parametrize("response, want", [
    ("so \\boxed{42}", 1.0),
    ("\\boxed{\\frac{1}{2}} done", 1.0),  # nested braces
    ("\\boxed {x}", 1.0),
    ("\\boxed{}", 0.0),
    ("\\boxed{  }", 0.0),
    ("\\boxed{3", 0.0),  # never closed
    ("boxed{3}", 0.0),
    ("42", 0.0),
])
def test_boxed_format(response, want):
    assert boxed_format_reward(x(response)) == want


def test_regex_reward_default_and_per_row_pattern():
    good = "<think>2 and 2\nmake 4</think>\n<answer>4</answer>"
    assert regex_reward(x(good)) == 1.0
    assert regex_reward(x("<answer>4</answer>")) == 0.0  # no reasoning
    assert regex_reward(x(good + " and more")) == 0.0  # text after the answer
    assert regex_reward(x("The answer: 7", format_pattern=r"answer: \d+$")) == 1.0
    assert regex_reward(x("The answer: seven", format_pattern=r"answer: \d+$")) == 0.0
    with pytest.raises(ValueError, match="format_pattern.*not a valid regular expression"):
        regex_reward(x("a", format_pattern="(unclosed"))


def test_regex_reward_for_a_pattern_of_ones_own():
    tag = regex_reward_for(r"<answer>\s*\d+\s*</answer>")
    assert tag(x("think... <answer> 12 </answer>")) == 1.0 and tag(x("<answer>twelve</answer>")) == 0.0
    with pytest.raises(Exception):  # noqa: B017 - re.error: a bad pattern fails where it is made
        regex_reward_for("(")


# ------------------------------------------------------------------------ by data source --

def data_cfg(table: dict[str, str]):
    cfg = OmegaConf.structured(DataConfig)
    return OmegaConf.merge(cfg, {"reward": "rlcore.scoring:by_data_source_reward", "reward_by_source": table})


def dispatcher(table: dict[str, str]):
    return resolve_reward(load_callable("rlcore.scoring:by_data_source_reward", "data.reward"), data_cfg(table))


def test_by_data_source_picks_each_rows_reward():
    score = dispatcher({"openai/gsm8k": "rlcore.scoring:math_verify_reward",
                        "trivia": "rlcore.scoring:exact_match_last_line_reward",
                        "fmt": "rlcore.scoring:boxed_format_reward"})
    assert score(x("#### 0.5", answer="1/2", data_source="openai/gsm8k")) == 1.0
    assert score(x("hmm\nParis", answer="paris", data_source="trivia")) == 1.0
    assert score(x("#### 1/2", answer="0.5", data_source="trivia")) == 0.0  # exact match, not math
    assert score(x("\\boxed{9}", data_source="fmt")) == 1.0
    calls = RewardCalls(score, "rlcore.scoring:by_data_source_reward", 60)
    assert calls.score([x("\\boxed{1/2}", answer="0.5", data_source="openai/gsm8k")], str) == [1.0]


def test_by_data_source_errors_name_the_key_and_the_source():
    score = dispatcher({"gsm8k": "rlcore.scoring:math_verify_reward", "math": "rlcore.scoring:math_verify_reward"})
    with pytest.raises(KeyError) as err:
        score(x("\\boxed{1}", answer="1", data_source="aime"))
    msg = str(err.value)
    assert "data.reward_by_source has no entry for data_source 'aime'" in msg, msg
    assert "data.reward_by_source.aime: module:function" in msg and "'gsm8k', 'math'" in msg, msg
    with pytest.raises(KeyError, match="meta has no 'data_source'"):
        score(x("\\boxed{1}", answer="1"))
    calls = RewardCalls(score, "rlcore.scoring:by_data_source_reward", 60)
    with pytest.raises(RewardError, match="raised MetaKeyError: data.reward_by_source has no entry for "
                                          "data_source 'aime'"):
        calls.score([x("\\boxed{1}", answer="1", data_source="aime")], lambda i: f"sample {i} of step 0")


def test_by_data_source_table_is_checked_when_built():
    with pytest.raises(ConfigError, match="data.reward_by_source is empty") as err:
        dispatcher({})
    assert err.value.key == "data.reward_by_source"
    with pytest.raises(ConfigError, match="data.reward_by_source.b: cannot import module 'no_such_module'") as err:
        dispatcher({"a": "rlcore.scoring:exact_match_reward", "b": "no_such_module:f"})
    assert err.value.key == "data.reward_by_source.b"
    with pytest.raises(ConfigError, match="data.reward_by_source.a: 'rlcore.scoring' must be 'module:function'"):
        dispatcher({"a": "rlcore.scoring"})
    with pytest.raises(ConfigError, match="data.reward_by_source.a: .* cannot be called with one RewardInput"):
        dispatcher({"a": "rlcore.tasks:make_prompts"})
    with pytest.raises(ConfigError, match="the dispatcher itself"):
        dispatcher({"a": "rlcore.scoring:by_data_source_reward"})
    with pytest.raises(TypeError, match="is a reward factory"):
        by_data_source_reward(x("1", answer="1", data_source="a"))


def test_reward_by_source_in_the_config_and_rlcore_check(capsys):
    cfg, _ = load_config(TINY, ["data.reward=rlcore.scoring:by_data_source_reward",
                                "data.reward_by_source.succ=rlcore.scoring:exact_match_last_word_reward"])
    assert dict(cfg.data.reward_by_source) == {"succ": "rlcore.scoring:exact_match_last_word_reward"}
    assert callable(load_reward(cfg))  # preflight builds the dispatcher
    assert training_fingerprint(load_config(TINY)[0]) == training_fingerprint(
        load_config(TINY, ["data.reward_by_source={}"])[0]), "the empty default leaves old fingerprints as they are"
    assert main(["check", TINY, "data.reward=rlcore.scoring:by_data_source_reward",
                 "data.reward_by_source.succ=nope:f"]) == 2
    err = capsys.readouterr().err
    assert "data.reward_by_source.succ: cannot import module 'nope'" in err, err


TASK = """
from rlcore.tasks import successor, TaskPrompt, Task

def with_source(data):
    base = successor(data)
    def make(rng, count):
        return [TaskPrompt(p.text, {**p.meta, "data_source": "succ"}) for p in base.make_prompts(rng, count)]
    return Task("succ_with_source", base.vocab, make)
"""


def test_a_run_scores_through_the_dispatcher(tmp_path, monkeypatch):
    (tmp_path / "sourced_task.py").write_text(TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    try:
        assert main(["train", TINY, "--output", str(out), "--overwrite", "training.steps=1", "rollout.n=4",
                     "data.prompts_per_step=4", "output.plot=false", "output.tensorboard=false",
                     "output.progress=false", "data.task=sourced_task:with_source",
                     "data.reward=rlcore.scoring:by_data_source_reward",
                     "data.reward_by_source.succ=rlcore.scoring:exact_match_last_word_reward"]) == 0
    finally:
        sys.modules.pop("sourced_task", None)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0] and 0.0 <= rows[0]["reward_mean"] <= 1.0
