"""Conformance suites: one per provider hook. A plugin's tests subclass the suite of each
provider it registers and supply a fixture; pytest then runs every check below against it.

.. code-block:: python

    from rlcore.testing.conformance import ForwardFnConformance

    class TestMyHead(ForwardFnConformance):
        capabilities = MY_SPEC.capabilities
        factory_path = "my_plugin.head:MyHead"       # for the 2-process tensor-parallel check

        @pytest.fixture
        def forward_fn(self):
            return MyHead()

Checks that depend on a capability run only when the provider declares it (a provider that does
not declare a capability does not have it, and core refuses configs that need it).
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rlcore.errors import RolloutError, WeightSyncError
from rlcore.testing.contracts import assert_close
from rlcore.types import Cap, HeadInput, Prompt, SamplingSettings, VocabShard

__all__ = [
    "EngineConformance", "ForwardFnConformance", "PROMPTS", "RolloutBackendConformance",
    "WeightSyncConformance", "failing_stream", "float64_head", "float64_sum_pi_squared", "hf_export",
]

# --------------------------------------------------------------------------------------------
# forward_fn
# --------------------------------------------------------------------------------------------


def float64_head(hidden, weight, labels, vocab_size, temperature, mask):
    """The exact semantics: log-softmax over the real vocabulary in float64."""
    z = hidden.double() @ weight[:vocab_size].double().t()
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
        z = z / temperature.double()[:, None]
    else:
        z = z / float(temperature)
    lp = torch.log_softmax(z, -1)
    safe = torch.where(mask, labels, torch.zeros_like(labels))
    logp = lp.gather(1, safe[:, None]).squeeze(1) * mask
    ent = -(lp.exp() * lp).sum(-1) * mask
    return logp, ent


def float64_sum_pi_squared(hidden, weight, vocab_size, temperature, mask):
    """``Σ_v π(v)²`` per token in float64 over the real vocabulary (0 where masked)."""
    z = hidden.double() @ weight[:vocab_size].double().t()
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
        z = z / temperature.double()[:, None]
    else:
        z = z / float(temperature)
    return (torch.softmax(z, -1) ** 2).sum(-1) * mask


def _head_inputs(seed: int, T: int = 37, H: int = 32, V: int = 50, rows: int = 64, dtype=torch.float32,
                 mask_frac: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(dtype)
    weight = (torch.randn(rows, H, generator=g) * 0.5)
    weight[V:] = 3.0  # padding rows with large logits: included by mistake, they dominate
    weight = weight.to(dtype)
    labels = torch.randint(0, V, (T,), generator=g)
    mask = torch.rand(T, generator=g) > mask_frac
    labels = torch.where(mask, labels, torch.full_like(labels, -100))  # garbage where masked
    g1 = torch.randn(T, generator=g)
    g2 = torch.randn(T, generator=g)
    return hidden, weight, labels, mask, g1, g2, V


class ForwardFnConformance:
    """Checks for a forward_fn. Subclass and provide a ``forward_fn`` fixture."""

    #: the capabilities the provider declares (``spec.capabilities``)
    capabilities: frozenset = frozenset()
    #: ``"module:callable"`` returning the forward_fn in a fresh process (vocab-parallel check)
    factory_path: str | None = None
    #: tolerance against float64 for fp32 inputs
    atol: float = 2e-5
    #: relative error bound against float64 for bf16 inputs (None: bf16 not checked)
    bf16_rel_error: float | None = 1e-3

    @pytest.fixture
    def forward_fn(self):  # pragma: no cover - must be overridden
        pytest.fail("subclass ForwardFnConformance and provide a `forward_fn` fixture")

    def _run(self, fn, hidden, weight, labels, mask, temperature=1.0, vocab_size=None, grad=True):
        h = hidden.clone().requires_grad_(grad)
        w = weight.clone().requires_grad_(grad)
        vs = vocab_size if vocab_size is not None else weight.shape[0]
        out = fn(HeadInput(hidden=h, weight=w, labels=labels, vocab=VocabShard.full(vs, rows=weight.shape[0]),
                           loss_mask=mask, temperature=temperature))
        return out, h, w

    def test_forward_matches_float64(self, forward_fn):
        hidden, weight, labels, mask, _, _, V = _head_inputs(1)
        out, _, _ = self._run(forward_fn, hidden, weight, labels, mask, vocab_size=V, grad=False)
        ref_lp, ref_ent = float64_head(hidden, weight, labels, V, 1.0, mask)
        assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (hidden.shape[0],), (
            f"forward_fn: HeadOutput.logprobs must be float32 [T]={hidden.shape[0]}, got "
            f"{out.logprobs.dtype} {tuple(out.logprobs.shape)}")
        assert_close(out.logprobs.double(), ref_lp, "forward_fn: log-probs must match the float64 log-softmax "
                     "over the real vocabulary (padding rows excluded)", atol=self.atol, rtol=0)
        if Cap.ENTROPY in self.capabilities:
            assert out.entropy is not None and out.entropy.dtype == torch.float32, (
                "forward_fn declares 'entropy' but HeadOutput.entropy is not a float32 tensor")
            assert_close(out.entropy.double(), ref_ent, "forward_fn (capability 'entropy'): entropy must match "
                         "float64 over the real vocabulary", atol=self.atol, rtol=0)

    def test_gradients_match_float64(self, forward_fn):
        hidden, weight, labels, mask, g1, g2, V = _head_inputs(2)
        out, h, w = self._run(forward_fn, hidden, weight, labels, mask, vocab_size=V)
        loss = (out.logprobs * g1).sum()
        h64 = hidden.double().requires_grad_()
        w64 = weight.double().requires_grad_()
        ref_lp, ref_ent = float64_head(h64, w64, labels, V, 1.0, mask)
        ref = (ref_lp * g1).sum()
        if Cap.ENTROPY in self.capabilities:
            loss = loss + (out.entropy * g2).sum()
            ref = ref + (ref_ent * g2).sum()
        loss.backward()
        ref.backward()
        assert_close(h.grad.double(), h64.grad, "forward_fn backward: the gradient w.r.t. the hidden states must "
                     "match float64", atol=self.atol * 10, rtol=1e-4)
        assert_close(w.grad.double(), w64.grad, "forward_fn backward: the gradient w.r.t. the LM-head weight must "
                     "match float64", atol=self.atol * 10, rtol=1e-4)
        assert torch.all(w.grad[V:] == 0), "padding vocab rows must get no gradient"
        assert torch.all(h.grad[~mask] == 0), "masked tokens must get no gradient"

    def test_masked_positions_are_zero(self, forward_fn):
        hidden, weight, labels, mask, _, _, V = _head_inputs(3)
        out, _, _ = self._run(forward_fn, hidden, weight, labels, mask, vocab_size=V, grad=False)
        assert torch.all(out.logprobs[~mask] == 0), "forward_fn: log-probs of masked tokens (loss_mask False) must be 0"
        if out.entropy is not None:
            assert torch.all(out.entropy[~mask] == 0), "forward_fn: entropy of masked tokens must be 0"

    def test_everything_masked(self, forward_fn):
        hidden, weight, labels, mask, _, _, V = _head_inputs(4)
        mask = torch.zeros_like(mask)
        out, h, w = self._run(forward_fn, hidden, weight, labels, mask, vocab_size=V)
        assert torch.all(out.logprobs == 0), "forward_fn: with every token masked, every log-prob must be 0"
        out.logprobs.sum().backward()  # must not raise

    def test_scalar_temperature(self, forward_fn):
        hidden, weight, labels, mask, _, _, V = _head_inputs(5)
        out, _, _ = self._run(forward_fn, hidden, weight, labels, mask, temperature=0.7, vocab_size=V, grad=False)
        ref_lp, ref_ent = float64_head(hidden, weight, labels, V, 0.7, mask)
        assert_close(out.logprobs.double(), ref_lp, "forward_fn: log-probs at temperature 0.7 must be those of "
                     "logits / 0.7 (float64 reference)", atol=self.atol, rtol=0)
        if Cap.ENTROPY in self.capabilities:
            assert_close(out.entropy.double(), ref_ent, "forward_fn (capability 'entropy'): entropy at temperature "
                         "0.7 must be that of logits / 0.7", atol=self.atol, rtol=0)

    def test_per_token_temperature(self, forward_fn):
        if Cap.PER_TOKEN_TEMPERATURE not in self.capabilities:
            pytest.skip("provider does not declare per_token_temperature")
        hidden, weight, labels, mask, _, _, V = _head_inputs(6)
        temp = torch.rand(hidden.shape[0], generator=torch.Generator().manual_seed(6)) + 0.5
        out, _, _ = self._run(forward_fn, hidden, weight, labels, mask, temperature=temp, vocab_size=V, grad=False)
        ref_lp, _ = float64_head(hidden, weight, labels, V, temp, mask)
        assert_close(out.logprobs.double(), ref_lp, "forward_fn (capability 'per_token_temperature'): log-probs "
                     "with a [T] temperature must divide each token's logits by its own", atol=self.atol, rtol=0)

    def test_bf16_inputs(self, forward_fn):
        if self.bf16_rel_error is None:
            pytest.skip("bf16 accuracy not checked for this provider")
        hidden, weight, labels, mask, _, _, V = _head_inputs(7, dtype=torch.bfloat16)
        out, _, _ = self._run(forward_fn, hidden, weight, labels, mask, vocab_size=V, grad=False)
        ref_lp, _ = float64_head(hidden, weight, labels, V, 1.0, mask)  # same bf16-rounded inputs
        rel = (out.logprobs.double() - ref_lp).norm() / ref_lp.norm()
        assert rel < self.bf16_rel_error, (f"forward_fn: bf16 inputs: relative error of the log-probs against "
                                           f"float64 {float(rel):.2e} >= {self.bf16_rel_error}")

    @pytest.mark.parametrize("peaked", [False, True])
    def test_sum_pi_squared_matches_float64(self, forward_fn, peaked):
        """``Σπ²`` of a head declaring ``sum_pi_squared``; ``peaked``: logits scaled ×30 (a
        distribution near one-hot, Σπ² near 1: a head that shifts by anything but the max
        overflows or loses it). Tolerance: Σπ² = Σ e^{2(z_v − lse)}, so a logit error δ moves it
        by at most a factor e^{±4δ}, and ``atol`` bounds δ for the log-probs: ``rtol = 4·atol``."""
        if Cap.SUM_PI_SQUARED not in self.capabilities:
            pytest.skip("provider does not declare sum_pi_squared")
        hidden, weight, labels, mask, _, _, V = _head_inputs(8)
        if peaked:
            hidden = hidden * 30
        temps = [0.7]
        if Cap.PER_TOKEN_TEMPERATURE in self.capabilities:
            temps.append(torch.rand(hidden.shape[0], generator=torch.Generator().manual_seed(8)) + 0.5)
        for temp in temps:
            h = hidden.clone().requires_grad_()
            out = forward_fn(HeadInput(hidden=h, weight=weight, labels=labels,
                                       vocab=VocabShard.full(V, rows=weight.shape[0]), loss_mask=mask,
                                       temperature=temp, compute_sum_pi_squared=True))
            sq = out.sum_pi_squared
            assert sq is not None and sq.dtype == torch.float32 and sq.shape == (hidden.shape[0],), (
                "forward_fn declares 'sum_pi_squared' but HeadOutput.sum_pi_squared is not a float32 [T] tensor "
                "when HeadInput.compute_sum_pi_squared is set")
            assert not sq.requires_grad, "forward_fn: HeadOutput.sum_pi_squared must carry no gradient"
            ref = float64_sum_pi_squared(hidden, weight, V, temp, mask)
            kind = "per-token temperature" if isinstance(temp, torch.Tensor) else f"temperature {temp}"
            assert_close(sq.double(), ref, f"forward_fn (capability 'sum_pi_squared'): Σπ² at {kind}"
                         f"{', peaked logits' if peaked else ''} must match the float64 softmax over the real "
                         f"vocabulary (padding rows excluded), 0 where masked", atol=1e-7, rtol=4 * self.atol)
            assert torch.all(sq[~mask] == 0), "forward_fn: Σπ² of masked tokens must be 0"
        plain = forward_fn(HeadInput(hidden=hidden, weight=weight, labels=labels,
                                     vocab=VocabShard.full(V, rows=weight.shape[0]), loss_mask=mask))
        assert plain.sum_pi_squared is None, "forward_fn: Σπ² must be None unless compute_sum_pi_squared is set"

    @pytest.mark.parametrize("sequence_parallel", [False, True])
    def test_vocab_parallel_matches_unsharded(self, sequence_parallel):
        # builds its head in two fresh processes from factory_path (not from the fixture)
        if Cap.VOCAB_PARALLEL not in self.capabilities:
            pytest.skip("provider does not declare vocab_parallel")
        if sequence_parallel and Cap.SEQUENCE_PARALLEL not in self.capabilities:
            pytest.skip("provider does not declare sequence_parallel")
        assert self.factory_path, "a vocab_parallel provider must set factory_path for the 2-process check"
        run_tensor_parallel_check(self.factory_path, world=2, sequence_parallel=sequence_parallel, atol=self.atol,
                                  sum_pi_squared=Cap.SUM_PI_SQUARED in self.capabilities)


def _load_factory(path: str) -> Callable[[], Any]:
    mod, name = path.split(":", 1)
    return getattr(importlib.import_module(mod), name)


def _tp_worker(rank: int, world: int, init_file: str, factory_path: str, sequence_parallel: bool, atol: float,
               sum_sq: bool = False) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn = _load_factory(factory_path)()
        T = 40  # divisible by the world size for sequence parallelism
        hidden, weight, labels, mask, g1, g2, V = _head_inputs(11, T=T, rows=64)
        per = weight.shape[0] // world
        w_local = weight[rank * per:(rank + 1) * per].clone().requires_grad_()
        h_full = hidden.clone().requires_grad_()
        h_in = h_full.chunk(world, dim=0)[rank] if sequence_parallel else h_full
        vocab = VocabShard(rank * per, (rank + 1) * per, V, group=dist.group.WORLD)
        out = fn(HeadInput(hidden=h_in, weight=w_local, labels=labels, vocab=vocab, loss_mask=mask,
                           temperature=0.9, sequence_parallel=sequence_parallel, compute_sum_pi_squared=sum_sq))
        loss = (out.logprobs * g1).sum() + ((out.entropy * g2).sum() if out.entropy is not None else 0.0)
        loss.backward()
        h64 = hidden.double().requires_grad_()
        w64 = weight.double().requires_grad_()
        ref_lp, ref_ent = float64_head(h64, w64, labels, V, 0.9, mask)
        ref = (ref_lp * g1).sum() + ((ref_ent * g2).sum() if out.entropy is not None else 0.0)
        ref.backward()
        where = f"forward_fn (capability 'vocab_parallel'{', sequence_parallel' if sequence_parallel else ''}), rank {rank} of {world}"
        assert_close(out.logprobs.double(), ref_lp.detach(), f"{where}: log-probs over a sharded vocabulary must "
                     f"equal the unsharded float64 ones", atol=atol, rtol=0)
        if out.entropy is not None:
            assert_close(out.entropy.double(), ref_ent.detach(), f"{where}: entropy over a sharded vocabulary must "
                         f"equal the unsharded float64 one", atol=atol, rtol=0)
        if sum_sq:  # the sum over the whole vocabulary, shifted by the global max (module docstring of heads)
            assert out.sum_pi_squared is not None, f"{where}: Σπ² asked for and not returned"
            assert_close(out.sum_pi_squared.double(), float64_sum_pi_squared(hidden, weight, V, 0.9, mask),
                         f"{where}: Σπ² over a sharded vocabulary must equal the unsharded float64 one", atol=1e-7,
                         rtol=4 * atol)
        assert_close(w_local.grad.double(), w64.grad[rank * per:(rank + 1) * per], f"{where}: the gradient of this "
                     f"rank's weight shard must equal its rows of the float64 gradient", atol=atol * 10, rtol=1e-4)
        ref_h = h64.grad
        got_h = h_full.grad.double()
        if sequence_parallel:
            rows = ref_h.chunk(world, dim=0)[rank]
            assert_close(got_h.chunk(world, dim=0)[rank], rows, f"{where}: the gradient of this rank's hidden-state "
                         f"rows must equal float64's", atol=atol * 10, rtol=1e-4)
        else:
            assert_close(got_h, ref_h, f"{where}: the hidden-state gradient (summed over the vocabulary shards) "
                         f"must equal float64's", atol=atol * 10, rtol=1e-4)
    finally:
        dist.destroy_process_group()


def run_tensor_parallel_check(factory_path: str, world: int = 2, sequence_parallel: bool = False, atol: float = 2e-5,
                              sum_pi_squared: bool = False) -> None:
    """Shard the vocab over ``world`` gloo processes and compare every output and gradient with
    the unsharded float64 result (raises in the parent if any rank disagrees); ``sum_pi_squared``:
    also ask for Σπ² and compare it."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "store")
        mp.spawn(_tp_worker, args=(world, init_file, factory_path, sequence_parallel, atol, sum_pi_squared),
                 nprocs=world, join=True)


# --------------------------------------------------------------------------------------------
# rollout_backend
# --------------------------------------------------------------------------------------------

PROMPTS = [[3, 4, 5, 13], [7, 7, 13], [10, 9, 8, 7, 6, 13]]


class RolloutBackendConformance:
    """Checks for a rollout backend. Subclass and provide a class-scoped ``backend_factory``
    fixture returning a callable that creates an *unstarted* backend (engines are slow to start:
    the suite starts one per model and reuses it)."""

    capabilities: frozenset = frozenset()
    #: greedy log-probs tolerance against transformers (float32)
    atol: float = 1e-4
    max_new_tokens: int = 6

    @pytest.fixture(scope="class")
    @classmethod
    def backend_factory(cls):  # pragma: no cover - must be overridden
        pytest.fail("subclass RolloutBackendConformance and provide a class-scoped `backend_factory` fixture")

    @pytest.fixture(scope="class")
    @classmethod
    def dense_backend(cls, backend_factory, tiny_model_dirs):
        b = backend_factory()
        b.start(str(tiny_model_dirs["dense_a"]), version=3)
        yield b
        b.shutdown()

    @pytest.fixture(scope="class")
    @classmethod
    def hf_dense(cls, tiny_model_dirs):
        from rlcore.testing.models import hf_model

        return hf_model(tiny_model_dirs["dense_a"])

    def _prompts(self):
        return [Prompt(ids=p, index=i) for i, p in enumerate(PROMPTS)]

    def test_runtime_capabilities_are_declared(self, dense_backend):
        extra = dense_backend.capabilities() - frozenset(self.capabilities)
        assert not extra, f"runtime capabilities not declared by the spec: {sorted(extra)}"

    def test_n_samples_per_prompt_in_order(self, dense_backend):
        params = SamplingSettings(n=3, temperature=1.0, max_new_tokens=self.max_new_tokens, seed=1)
        samples = dense_backend.generate(self._prompts(), params)
        assert len(samples) == 3 * len(PROMPTS)
        for i, s in enumerate(samples):
            assert s.prompt_index == i // 3
            assert list(s.prompt_ids) == PROMPTS[i // 3]
            assert 1 <= len(s.response_ids) <= self.max_new_tokens
            assert s.logprobs.dtype == torch.float32 and s.logprobs.shape == s.response_ids.shape
            assert torch.isfinite(s.logprobs).all() and (s.logprobs <= 1e-6).all()
            assert s.weight_version == dense_backend.weight_version == 3

    def test_greedy_matches_transformers(self, dense_backend, hf_dense):
        from rlcore.testing.models import hf_greedy

        params = SamplingSettings(n=1, temperature=0.0, max_new_tokens=self.max_new_tokens)
        for s in dense_backend.generate(self._prompts(), params):
            ref = hf_greedy(hf_dense, s.prompt_ids, self.max_new_tokens, eos=None)
            n = len(s.response_ids)
            assert s.response_ids.tolist() == ref.tokens[:n], (
                f"rollout_backend: greedy tokens for prompt {list(s.prompt_ids)} must be transformers' "
                f"{ref.tokens[:n]}, got {s.response_ids.tolist()}")
            assert_close(s.logprobs, torch.tensor(ref.logprobs[:n]), f"rollout_backend: greedy behaviour log-probs "
                         f"for prompt {list(s.prompt_ids)} must match transformers'", atol=self.atol, rtol=0)

    def test_sampled_logprobs_are_processed_logprobs(self, dense_backend, hf_dense):
        from rlcore.testing.models import hf_token_logprobs

        params = SamplingSettings(n=2, temperature=0.7, max_new_tokens=self.max_new_tokens, seed=5)
        for s in dense_backend.generate(self._prompts(), params):
            ref = hf_token_logprobs(hf_dense, s.prompt_ids, s.response_ids.tolist(), temperature=0.7)
            assert_close(s.logprobs, torch.tensor(ref), f"rollout_backend: sampled log-probs for prompt "
                         f"{list(s.prompt_ids)} must be the processed (temperature-scaled) distribution's, as transformers computes them",
                         atol=self.atol, rtol=0)

    def test_seed_reproduces_samples(self, dense_backend):
        params = SamplingSettings(n=2, temperature=1.0, max_new_tokens=self.max_new_tokens, seed=123)
        a = dense_backend.generate(self._prompts(), params)
        b = dense_backend.generate(self._prompts(), params)
        assert [s.response_ids.tolist() for s in a] == [s.response_ids.tolist() for s in b]

    def test_stop_token_ends_sample(self, dense_backend):
        greedy = dense_backend.generate(self._prompts()[:1], SamplingSettings(n=1, temperature=0.0, max_new_tokens=4))
        first = int(greedy[0].response_ids[0])
        params = SamplingSettings(n=1, temperature=0.0, max_new_tokens=4, stop_token_ids=(first,))
        s = dense_backend.generate(self._prompts()[:1], params)[0]
        assert s.response_ids.tolist() == [first]
        assert s.finish_reason == "stop"

    def test_pause_blocks_generation(self, dense_backend):
        if Cap.PAUSE not in dense_backend.capabilities():
            pytest.skip("backend cannot pause")
        dense_backend.pause()
        try:
            with pytest.raises(RolloutError):
                dense_backend.generate(self._prompts()[:1], SamplingSettings(max_new_tokens=2))
        finally:
            dense_backend.resume()
        assert dense_backend.generate(self._prompts()[:1], SamplingSettings(max_new_tokens=2))

    def test_kv_cache_release_and_resume(self, dense_backend):
        if Cap.RELEASE_KV_CACHE not in dense_backend.capabilities():
            pytest.skip("backend cannot release its KV cache on this platform")
        params = SamplingSettings(n=1, temperature=0.0, max_new_tokens=4)
        before = [s.response_ids.tolist() for s in dense_backend.generate(self._prompts(), params)]
        dense_backend.pause()
        dense_backend.release_memory(frozenset({"kv_cache"}))
        dense_backend.resume_memory(frozenset({"kv_cache"}))
        dense_backend.resume()
        after = [s.response_ids.tolist() for s in dense_backend.generate(self._prompts(), params)]
        assert before == after

    def test_routed_experts(self, backend_factory, tiny_model_dirs):
        if Cap.ROUTED_EXPERTS not in self.capabilities:
            pytest.skip("backend does not declare routed_experts")
        b = backend_factory()
        b.start(str(tiny_model_dirs["moe_a"]), version=0)
        try:
            if Cap.ROUTED_EXPERTS not in b.capabilities():
                pytest.skip("routed experts not available at runtime on this platform")
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(str(tiny_model_dirs["moe_a"]))
            params = SamplingSettings(n=1, temperature=0.0, max_new_tokens=4, return_routed_experts=True)
            for s in b.generate(self._prompts(), params):
                r = s.routed_experts
                assert r is not None
                assert tuple(r.shape) == (len(s.prompt_ids) + len(s.response_ids) - 1, cfg.num_hidden_layers,
                                          cfg.num_experts_per_tok)
                assert int(r.min()) >= 0 and int(r.max()) < cfg.num_experts
        finally:
            b.shutdown()


# --------------------------------------------------------------------------------------------
# weight_sync
# --------------------------------------------------------------------------------------------


def hf_export(model_dir) -> list[tuple[str, torch.Tensor]]:
    """The HF-named tensors of a model directory, as an engine's export stream would give them."""
    from rlcore.engines.hf import HFEngine

    return list(HFEngine.from_pretrained(model_dir).export_hf_weights())


def failing_stream(weights, fail_after: int):
    for i, item in enumerate(weights):
        if i == fail_after:
            raise RuntimeError("simulated trainer failure in the middle of a push")
        yield item


class WeightSyncConformance:
    """Checks for a weight sync. Subclass and provide class-scoped fixtures ``sync_factory``
    (returns a :class:`~rlcore.types.WeightSync`) and ``backend_factory`` (returns an unstarted
    backend the sync can feed)."""

    capabilities: frozenset = frozenset()
    atol: float = 1e-4
    #: also push MoE models (experts, routers)
    check_moe: bool = True

    @pytest.fixture(scope="class")
    @classmethod
    def sync_factory(cls):  # pragma: no cover
        pytest.fail("provide a class-scoped `sync_factory` fixture")

    @pytest.fixture(scope="class")
    @classmethod
    def backend_factory(cls):  # pragma: no cover
        pytest.fail("provide a class-scoped `backend_factory` fixture")

    @pytest.fixture(scope="class")
    @classmethod
    def target(cls, backend_factory, tiny_model_dirs):
        b = backend_factory()
        b.start(str(tiny_model_dirs["dense_a"]), version=0)
        yield b
        b.shutdown()

    @pytest.fixture(scope="class")
    @classmethod
    def sync(cls, sync_factory):
        s = sync_factory()
        yield s
        s.close()

    def _assert_serves(self, backend, model_dir, atol):
        from rlcore.testing.models import hf_greedy, hf_model

        hf = hf_model(model_dir)
        params = SamplingSettings(n=1, temperature=0.0, max_new_tokens=5)
        prompts = [Prompt(ids=p, index=i) for i, p in enumerate(PROMPTS)]
        worst = 0.0
        for s in backend.generate(prompts, params):
            ref = hf_greedy(hf, s.prompt_ids, 5)
            n = len(s.response_ids)
            assert s.response_ids.tolist() == ref.tokens[:n], "greedy tokens differ from transformers on the pushed weights"
            diff = (s.logprobs - torch.tensor(ref.logprobs[:n])).abs().max()
            worst = max(worst, float(diff))
        assert worst <= atol, f"log-probs differ from transformers by {worst:.2e} > {atol}"
        return worst

    def test_push_serves_new_weights(self, sync, target, tiny_model_dirs):
        report = sync.push(hf_export(tiny_model_dirs["dense_b"]), target, 1)
        assert report.version == 1 and target.weight_version == 1
        assert report.num_tensors > 0 and report.bytes > 0
        if Cap.VERIFIED in self.capabilities:
            assert report.verified and report.checked == report.num_tensors
        self._assert_serves(target, tiny_model_dirs["dense_b"], self.atol)

    def test_push_back_and_version(self, sync, target, tiny_model_dirs):
        sync.push(hf_export(tiny_model_dirs["dense_a"]), target, 2)
        assert target.weight_version == 2
        self._assert_serves(target, tiny_model_dirs["dense_a"], self.atol)

    def test_failed_push_raises_and_says_which_version(self, sync, target, tiny_model_dirs):
        before = target.weight_version
        weights = hf_export(tiny_model_dirs["dense_b"])
        with pytest.raises(WeightSyncError) as info:
            sync.push(failing_stream(weights, fail_after=len(weights) // 2), target, before + 1)
        if Cap.ATOMIC in self.capabilities:
            assert info.value.receiver_version == before
            assert target.weight_version == before
            self._assert_serves(target, tiny_model_dirs["dense_a"], self.atol)
        else:
            # a non-atomic sync must say it no longer knows what the receiver holds
            assert info.value.receiver_version in (None, before)

    def test_moe_push(self, sync_factory, backend_factory, tiny_model_dirs):
        if not self.check_moe:
            pytest.skip("MoE pushes not checked for this sync")
        b = backend_factory()
        b.start(str(tiny_model_dirs["moe_a"]), version=0)
        s = sync_factory()
        try:
            s.push(hf_export(tiny_model_dirs["moe_b"]), b, 1)
            self._assert_serves(b, tiny_model_dirs["moe_b"], self.atol)
        finally:
            s.close()
            b.shutdown()


# --------------------------------------------------------------------------------------------
# engine
# --------------------------------------------------------------------------------------------


class EngineConformance:
    """Checks for a training engine. Subclass and provide a class-scoped ``engine_factory``
    fixture: ``engine_factory(model_dir) -> TrainingEngine`` loading that HF directory."""

    atol: float = 1e-4

    @pytest.fixture(scope="class")
    @classmethod
    def engine_factory(cls):  # pragma: no cover
        pytest.fail("provide a class-scoped `engine_factory` fixture")

    def _batch(self, seqs):
        from rlcore.batch import PackedBatch

        return PackedBatch.pack(seqs, [1] * len(seqs))

    def _logprobs(self, engine, batch, **kw):
        from rlcore.heads import reference_logprobs

        out = engine.forward(batch, **kw)
        hw = engine.head()
        head = reference_logprobs(HeadInput(hidden=out.hidden, weight=hw.weight, labels=batch.labels(), vocab=hw.vocab,
                                            loss_mask=batch.loss_mask))
        return out, head.logprobs

    @pytest.mark.parametrize("model", ["dense_a", "moe_a"])
    def test_logprobs_match_transformers(self, engine_factory, tiny_model_dirs, model):
        from rlcore.testing.models import hf_model, hf_token_logprobs

        engine = engine_factory(tiny_model_dirs[model])
        hf = hf_model(tiny_model_dirs[model])
        seqs = PROMPTS
        batch = self._batch(seqs)
        with torch.no_grad():
            _, lp = self._logprobs(engine, batch)
        for seq, got in zip(seqs, batch.unpack(lp.cpu()), strict=True):
            ref = hf_token_logprobs(hf, seq[:1], seq[1:])
            assert_close(got[:-1], torch.tensor(ref), f"engine ({model}): log-probs must match transformers' on "
                         f"the same checkpoint", atol=self.atol, rtol=0)

    def test_export_matches_checkpoint(self, engine_factory, tiny_model_dirs):
        from safetensors.torch import load_file

        engine = engine_factory(tiny_model_dirs["moe_a"])
        saved = {}
        for f in sorted(tiny_model_dirs["moe_a"].glob("*.safetensors")):
            saved.update(load_file(str(f)))
        exported = dict(engine.export_hf_weights())
        missing = set(saved) - set(exported) - {"lm_head.weight"}
        assert not missing, f"export lacks {sorted(missing)[:5]}"
        for name, t in exported.items():
            assert name in saved, f"exported {name!r} is not a checkpoint name"
            assert torch.equal(t.detach().cpu().to(saved[name].dtype), saved[name]), name

    def test_routes_recorded_and_replayed(self, engine_factory, tiny_model_dirs):
        from rlcore.types import RouterDecision

        engine = engine_factory(tiny_model_dirs["moe_a"])
        layout = engine.info.route_layout
        assert layout is not None
        batch = self._batch(PROMPTS)
        with torch.no_grad():
            out, lp = self._logprobs(engine, batch, record_routes=True)
        routes = out.routes
        assert routes is not None and routes.dtype == torch.int16
        assert tuple(routes.shape) == (batch.num_tokens, layout.num_routed, layout.topk)

        def replay(call):
            return RouterDecision(indices=routes[:, call.routed_index].long())

        with torch.no_grad():
            out2, lp2 = self._logprobs(engine, batch, router=replay, record_routes=True)
        assert torch.equal(out2.routes, routes)
        assert_close(lp2, lp, "engine (capability 'router_hook'): replaying the recorded routes must give "
                     "bit-identical log-probs", atol=0, rtol=0)

        shifted = (routes.long() + 1) % layout.num_experts

        def other(call):
            return RouterDecision(indices=shifted[:, call.routed_index])

        with torch.no_grad():
            out3, lp3 = self._logprobs(engine, batch, router=other, record_routes=True)
        assert torch.equal(out3.routes.long(), shifted)
        assert not torch.allclose(lp3, lp)

    def test_micro_batches_give_the_same_hidden_states(self, engine_factory, tiny_model_dirs):
        engine = engine_factory(tiny_model_dirs["dense_a"])
        batch = self._batch(PROMPTS)
        with torch.no_grad():
            whole = engine.forward(batch).hidden
            parts = [engine.forward(mb).hidden for mb in batch.micro_batches(6)]
        assert_close(torch.cat(parts), whole, "engine: hidden states must not depend on how the packed batch is "
                     "split into micro-batches", atol=1e-5, rtol=1e-5)
