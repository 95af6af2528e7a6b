"""The install check of scripts/gpu/vllm_026_install.sh: vLLM starts a tiny engine on the GPU.

A tiny Qwen2 is created locally (random weights, no hub, no tokenizer: prompts are token ids);
greedy generation with log-probs, ``sleep(level=1)`` (weights to host memory, KV cache dropped:
the GPU memory freed is measured), ``wake_up()``, and the same tokens again. A stuck start dumps
every thread's stack after ``--dump-after`` seconds (with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
the engine runs in this process, so its threads are among them).
"""

import argparse
import faulthandler
import sys
import tempfile
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--dump-after", type=float, default=120.0)
args = ap.parse_args()
faulthandler.dump_traceback_later(args.dump_after, repeat=True, file=sys.stderr)

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

d = tempfile.mkdtemp(prefix="tiny-qwen2-")
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False)
Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
from vllm import LLM, SamplingParams  # noqa: E402

t = time.perf_counter()
llm = LLM(model=d, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.3,
          max_model_len=256, enable_sleep_mode=True, seed=0)
print(f"[check] engine up in {time.perf_counter() - t:.1f} s", flush=True)
sp = SamplingParams(max_tokens=16, temperature=0, logprobs=0, detokenize=False)
prompts = [{"prompt_token_ids": [3, 5, 7, 11]}, {"prompt_token_ids": [13, 17]}]
outs = llm.generate(prompts, sp, use_tqdm=False)
first = [list(o.outputs[0].token_ids) for o in outs]
assert all(len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids) for o in outs), "log-probs missing"
free0 = torch.cuda.mem_get_info()[0]
llm.sleep(level=1)
freed = torch.cuda.mem_get_info()[0] - free0
llm.wake_up()
again = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
assert again == first, f"tokens after wake-up differ: {first} vs {again}"
faulthandler.cancel_dump_traceback_later()
print(f"[check] vLLM generated {sum(map(len, first))} tokens with log-probs; sleep(level=1) freed "
      f"{freed / 2**30:.1f} GiB; woke and generated the same tokens: OK", flush=True)
