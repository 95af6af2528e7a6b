"""The trainer's rank strategies (rlcore.parallel.strategy) and its pass-metric reducer
(rlcore.pass_metrics): metrics reduce by what each is declared (a sum, a mean over micro-batches,
a mean over loss tokens), the same over micro-batches and over ranks; the strategy is picked by
the engine's declared capabilities; on two real gloo ranks the data-parallel strategy splits the
micro-batches and reduces log-probs, gradients and metrics to what one process computes, and the
model-parallel strategy saves and restores each rank's shard (engine and critic), refusing
another layout."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from rlcore.errors import CheckpointError, ConfigError
from rlcore.pass_metrics import PassMetrics
from rlcore.ranks import Ranks
from rlcore.stack import load_stack
from rlcore.types import Cap

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"


# ------------------------------------------------------------------------------- reducer --

def _micro_batch(m: PassMetrics, loss: float, clip_sum: float, tokens: float, plugin: float | None) -> None:
    m.add_sum("loss", loss)
    m.add_token_sums({"clipfrac": clip_sum}, tokens)
    if plugin is not None:
        m.add_mean("mtp/acc", plugin)


def test_each_metric_reduces_as_declared():
    m = PassMetrics()
    _micro_batch(m, 0.5, 3.0, 10, 0.2)
    _micro_batch(m, 0.25, 1.0, 30, None)  # the plugin reported nothing for this micro-batch
    _micro_batch(m, 0.25, 0.0, 0, 0.6)
    # a plugin metric whose name starts with "loss/" is still a mean: never classified by name
    m.add_mean("loss/mine", 2.0)
    m.add_mean("loss/mine", 4.0)
    assert m.result() == {"loss": 1.0, "clipfrac": 4.0 / 40, "mtp/acc": pytest.approx(0.4), "loss/mine": 3.0}
    with pytest.raises(ValueError, match="'loss' is reported as a mean and as a sum"):
        m.add_mean("loss", 1.0)


def test_a_pass_without_loss_tokens_divides_by_one():
    m = PassMetrics()
    m.add_token_sums({"entropy": 0.0}, 0)
    assert m.result() == {"entropy": 0.0}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(-10, 10), st.floats(0, 50), st.integers(0, 60),
                          st.one_of(st.none(), st.floats(0, 1))), min_size=1, max_size=12),
       st.integers(1, 4), st.data())
def test_ranks_combined_equal_one_pass_over_all_micro_batches(mbs, world, data):
    """Any split of the micro-batches over ranks (some ranks get none) combines to the one-process result."""
    one = PassMetrics()
    for mb in mbs:
        _micro_batch(one, *mb)
    owners = data.draw(st.lists(st.integers(0, world - 1), min_size=len(mbs), max_size=len(mbs)))
    parts = [PassMetrics() for _ in range(world)]
    for mb, r in zip(mbs, owners, strict=True):
        _micro_batch(parts[r], *mb)
    got, want = PassMetrics.combine(parts).result(), one.result()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-12, abs=1e-12), k


def test_ranks_that_declare_a_metric_differently_are_refused():
    a, b = PassMetrics(), PassMetrics()
    a.add_sum("x", 1.0)
    b.add_mean("x", 1.0)
    with pytest.raises(ValueError, match="'x' is reported as a mean by one rank and as a sum by another"):
        PassMetrics.combine([a, b])


# ------------------------------------------------------------------ picked by capability --

def test_the_strategy_follows_the_engines_capabilities():
    from rlcore.parallel.data_parallel import DataParallel
    from rlcore.parallel.model_parallel import ModelParallel
    from rlcore.parallel.worker import strategy_for

    stack = load_stack(str(EXAMPLE))
    two = Ranks(rank=0, world=2)
    assert Cap.DATA_PARALLEL in stack.engine.capabilities
    assert type(strategy_for(stack, two)) is DataParallel

    def engine(caps: set[str], layout: dict | None = None):
        cfg = OmegaConf.create({"cluster": {"trainer": dict({"dp": 1, "tp": 1, "ep": 1, "pp": 1}, **(layout or {}))}})
        return replace(stack, engine=replace(stack.engine, name="thirdparty", capabilities=frozenset(caps)), config=cfg)

    # an engine of another name that shards itself: model parallel (no name decides)
    assert type(strategy_for(engine({Cap.TENSOR_PARALLEL}), two)) is ModelParallel
    assert type(strategy_for(engine({Cap.EXPERT_PARALLEL, Cap.MOE}), two)) is ModelParallel
    # both kinds declared: model parallel, splitting the samples over the engine's data-parallel
    # replicas (which the engine names once built: its layout may come from its own settings)
    both = {Cap.DATA_PARALLEL, Cap.TENSOR_PARALLEL}
    for layout in ({}, {"tp": 2}, {"dp": 2, "tp": 2}):
        picked = strategy_for(engine(both, layout), two)
        assert type(picked) is ModelParallel and picked.splits_samples, layout
    assert not strategy_for(engine({Cap.TENSOR_PARALLEL}), two).splits_samples
    assert type(strategy_for(engine({Cap.PIPELINE_PARALLEL}, {"pp": 2}), two)) is ModelParallel
    with pytest.raises(ConfigError, match="engine 'thirdparty' .* cannot run on 2 trainer ranks: it declares none of "
                                          "the capabilities data_parallel, tensor_parallel") as err:
        strategy_for(engine({Cap.MOE}), two)
    assert err.value.key == "engine.name"
    with pytest.raises(ConfigError, match="split by cluster.trainer.ep: it declares none of the capabilities "
                                          "tensor_parallel, expert_parallel"):
        strategy_for(engine({Cap.DATA_PARALLEL}, {"ep": 2}), two)


# ----------------------------------------------------------------- two real gloo ranks --

def _share(batch, rank: int):
    """Rank ``rank``'s micro-batches of two, computed here without a process group."""
    from rlcore.parallel.data_parallel import shard_bounds

    start, stop = shard_bounds(batch.num_seqs, rank, 2)
    return batch.select_seqs(start, stop).micro_batches(12)


def _batch():
    from rlcore.batch import PackedBatch

    g = torch.Generator().manual_seed(3)
    lens = [7, 5, 9, 4, 6]
    seqs = [torch.randint(1, 50, (n,), generator=g) for n in lens]
    return PackedBatch.pack(seqs, [2] * len(lens))


class _Engine:
    """A linear model standing in for an engine: state_dict / parameters / a per-rank layout."""

    def __init__(self, rank: int):
        torch.manual_seed(rank)  # each rank its own values, as model-parallel shards are
        self.model = torch.nn.Linear(4, 3)

    def parameters(self):
        return self.model.parameters()

    def state_dict(self):
        return {"model": self.model.state_dict()}

    def parallel_layout(self):
        return {"tp": 2, "ep": 1, "pp": 1, "rank": 99}


def _ranks_main(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from rlcore.parallel.data_parallel import DataParallel
    from rlcore.parallel.model_parallel import ModelParallel
    from rlcore.ranks import TorchRanks
    from rlcore.run_output import load_checkpoint

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ranks = TorchRanks()
    batch = _batch()
    result: dict = {}

    dp = DataParallel(ranks)
    mbs = dp.micro_batches(batch, 12)
    result["seqs"] = [int(mb.num_seqs) for mb in mbs]
    logprobs = torch.zeros(batch.num_tokens)
    metrics = PassMetrics()
    for mb in mbs:
        start = mb.token_offset - batch.token_offset
        logprobs[start: start + mb.num_tokens] = torch.arange(start, start + mb.num_tokens, dtype=torch.float32)
        _micro_batch(metrics, float(mb.num_tokens), float(mb.num_loss_tokens) / 2, mb.num_loss_tokens, 1.0 + rank)
    dp.reduce_logprobs(logprobs)
    result["logprobs"] = logprobs.tolist()
    result["metrics"] = dp.reduce_metrics(metrics).result()
    engine = _Engine(rank)
    for p in engine.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    dp.reduce_gradients(engine.parameters())
    result["grads"] = [float(p.grad.flatten()[0]) for p in engine.parameters()]

    mp_ = ModelParallel(ranks)
    mp_.built(engine, None)
    critic = {"head": torch.full((2,), float(rank))}
    mp_.save_checkpoint(Path(out), lambda: {"engine": engine.state_dict(), "critic": critic},
                        {"step": 0, "version": 1}, {"step": 0, "version": 1, "config": {}}, keep=0)
    state, record, _ = load_checkpoint(Path(out))
    mine = mp_.rank_state(Path(out), state, record)
    result["restored_critic"] = mine["critic"]["head"].tolist()
    result["restored_equal"] = all(torch.equal(v, engine.state_dict()["model"][k])
                                   for k, v in mine["engine"]["model"].items())
    result["record_layout"] = record["shards"]["layout"]
    other = ModelParallel(ranks)
    other.layout = dict(mp_.layout, tp=1)
    try:
        other.rank_state(Path(out), state, record)
    except CheckpointError as exc:
        result["refused"] = str(exc)
    # a dimension the checkpoint did not record (dp, vpp: added later) is 1 there
    newer = ModelParallel(ranks)
    newer.layout = dict(mp_.layout, dp=1, vpp=1)
    result["newer_loads"] = "engine" in newer.rank_state(Path(out), state, record)
    dist.barrier()
    dist.destroy_process_group()
    Path(out, f"result_{rank}.json").write_text(json.dumps(result))


def test_two_gloo_ranks_reduce_and_shard_as_one_process_would(tmp_path, gloo_ranks):
    from rlcore.parallel.strategy import RankStrategy

    gloo_ranks(_ranks_main, str(tmp_path), timeout=120).check()
    res = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in range(2)]

    batch = _batch()
    one = RankStrategy()  # one process: every micro-batch
    # the two ranks' micro-batches cover the five sequences once, split 3 + 2
    assert sum(res[0]["seqs"]) == 3 and sum(res[1]["seqs"]) == 2
    assert sum(mb.num_seqs for mb in one.micro_batches(batch, 12)) == 5
    # every rank filled its own rows: after the all-reduce both hold every row
    assert res[0]["logprobs"] == res[1]["logprobs"] == [float(i) for i in range(batch.num_tokens)]
    # metrics: the same on both ranks, and those of one pass over all micro-batches
    whole = PassMetrics()
    for r in range(2):
        for mb in _share(batch, r):
            _micro_batch(whole, float(mb.num_tokens), float(mb.num_loss_tokens) / 2, mb.num_loss_tokens, 1.0 + r)
    assert res[0]["metrics"] == res[1]["metrics"]
    assert res[0]["metrics"] == pytest.approx(whole.result(), rel=1e-12)
    assert res[0]["metrics"]["loss"] == batch.num_tokens and res[0]["metrics"]["clipfrac"] == 0.5
    assert res[0]["grads"] == res[1]["grads"] == [3.0, 3.0]  # summed, not averaged

    # model parallel: each rank its own shard (engine and critic), restored as saved
    for r in range(2):
        assert res[r]["restored_critic"] == [float(r), float(r)]
        assert res[r]["restored_equal"] is True
        assert "tp: 2 in the checkpoint, 1 now" in res[r]["refused"]
        assert res[r]["newer_loads"] is True
    assert res[0]["record_layout"] == {"tp": 2, "ep": 1, "pp": 1, "world": 2}
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt")) == [
        "step-00000000.pt", "step-00000000.rank_0-of-2.pt", "step-00000000.rank_1-of-2.pt"]
