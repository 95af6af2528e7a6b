"""The ``sglang:`` config section (no torch, no SGLang: read by ``rlcore check`` and ``rlcore plugins``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import ConfigError
from rlcore_enginekit.serving import LOOPBACK, check_bind_host

MODES = ("server", "engine")
PAUSE_MODES = ("abort", "retract", "in_place")
SELECTORS = ("all", "target", "draft")
KEEP_TOGETHER = ("auto", "none", "layer")
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
#: ``launch_server`` flags rlcore sets itself, and the setting each comes from
OWNED_LAUNCH_FLAGS = {"--model-path": "the trainer's policy directory", "--host": "sglang.host",
                      "--port": "sglang.port", "--weight-version": "rlcore's weight versions"}


@dataclass
class SGLangSettings:
    """How rlcore reaches SGLang and how it moves weights into it.

    * ``mode``: ``server`` talks HTTP to ``url``, or to a server this plugin launches from the
      policy directory when ``url`` is empty; ``engine`` runs ``sglang.Engine`` in this process.
    * ``launch_args``: extra ``python -m sglang.launch_server`` flags (``--tp-size 2``,
      ``--mem-fraction-static 0.6``); the same flags build the in-process Engine's ServerArgs.
      The plugin adds ``--model-path``, ``--host``, ``--port``, ``--weight-version``, and
      ``--enable-memory-saver`` / ``--enable-return-routed-experts`` / the speculative flags
      below when they apply.
    * ``host`` / ``port``: where a server this plugin launches listens. ``host`` is loopback
      (``127.0.0.1``) by default: SGLang's weight-update, memory and pause routes have no
      authentication unless the server runs with an API key, so only this machine may reach
      them. ``0.0.0.0`` exposes them to every host that can reach this one; do that only on a
      network you trust, with ``--api-key KEY`` in ``launch_args`` and ``SGLANG_API_KEY=KEY``
      in rlcore's environment (its client sends that key).
    * ``load_policy_on_start``: with ``url`` (a server rlcore did not launch), load the trainer's
      initial policy directory into it at start (the server must be able to read that path), so
      it serves exactly weight version 0; ``false`` trusts that it already serves those weights
      and only stamps the version.
    * ``python``: the interpreter that runs the launched server (SGLang's own environment);
      empty = this interpreter.
    * ``speculative_*``: speculative decoding (MTP: ``speculative_algorithm: NEXTN``); empty or
      0 leaves the flag out so SGLang's default applies.
    * ``pause_mode``: how in-flight requests are treated when the trainer pauses generation
      before a weight push (SGLang's ``/pause_generation`` modes).
    * ``selector``: which runners a push updates (``all`` = target and speculative draft);
      servers older than 0.5.21 know only ``all`` and ``target``.
    * ``keep_together``: ``layer`` never splits one decoder layer's tensors across buckets (what
      a server without the begin/end weight-update session, SGLang < 0.5.21, needs for fused
      weights); ``auto`` picks ``layer`` for such servers and ``none`` otherwise.
    * ``verify_skip``: substrings of engine tensor names SGLang's weights checker must ignore
      (engine-only tensors that no HF checkpoint carries, e.g. ``k_scale``); SGLang >= 0.5.21.
    * ``nccl_*``: the trainer-side end of ``sglang-nccl``'s group (the trainer is rank 0 and
      hosts the rendezvous at ``nccl_master_address:nccl_master_port``; port 0 = a free one).
    * ``disk_dir``: where ``sglang-disk`` writes versions; it must be readable by the server
      (empty = ``<output>/sglang_sync``).
    * ``release_for_training``: SGLang memory tags (``kv_cache``, ``weights``, ``cuda_graph``)
      released after every rollout, so a colocated trainer has that GPU memory while it trains;
      the next push brings the weights back (its new values overwrite them) and the KV cache
      after it. Empty = SGLang keeps its memory (core still frees the KV cache around pushes).
      Needs ``enable_memory_saver``. Generating again without a push in between needs the
      released weights' contents: SGLang keeps them only with ``--enable-weights-cpu-backup``.
    """

    mode: str = "server"
    url: str = ""
    load_policy_on_start: bool = True
    host: str = LOOPBACK
    port: int = 30000
    launch_args: list[str] = field(default_factory=list)
    python: str = ""
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 1800.0
    enable_memory_saver: bool = True
    speculative_algorithm: str = ""
    speculative_draft_model_path: str = ""
    speculative_num_steps: int = 0
    speculative_eagle_topk: int = 0
    speculative_num_draft_tokens: int = 0
    pause_mode: str = "abort"
    selector: str = "all"
    keep_together: str = "auto"
    verify_skip: list[str] = field(default_factory=list)
    nccl_master_address: str = "127.0.0.1"
    nccl_master_port: int = 0
    nccl_group_name: str = "rlcore_weight_sync"
    nccl_backend: str = "nccl"
    disk_dir: str = ""
    release_for_training: list[str] = field(default_factory=list)


def drafts_from_policy(s: Any) -> bool:
    """Whether the speculative draft is the policy's own MTP layers (NEXTN/EAGLE without a separate
    draft checkpoint): then every push must reach SGLang's draft runner too."""
    return bool(s.speculative_algorithm) and not s.speculative_draft_model_path


def draft_sync_problem(s: Any, sync_name: str | None) -> tuple[str, str] | None:
    """``(key, message)`` when ``sync_name`` / ``sglang.selector`` would leave a policy-derived
    draft at its start weights, else None."""
    if not drafts_from_policy(s):
        return None
    if sync_name == "sglang-nccl":
        return ("sync.name", "sync.name 'sglang-nccl' with sglang.speculative_algorithm "
                f"{s.speculative_algorithm!r} and no separate draft model: SGLang's "
                "update_weights_from_distributed loads only the target runner (sgl-project/sglang#27718), so the "
                "MTP draft would keep its start weights and acceptance would collapse without an error; use "
                "sync.name 'sglang-tensor' or 'sglang-disk' (both update the draft runner too)")
    if s.selector == "target":
        return ("sglang.selector", "sglang.selector 'target' with sglang.speculative_algorithm "
                f"{s.speculative_algorithm!r} and no separate draft model: pushes would skip the MTP draft, which "
                "then proposes from its start weights; use selector 'all'")
    return None


def sglang_speculation(section: Any) -> tuple[str, int | None]:
    """(algorithm, eagle top-k) an SGLang server would run with, from ``sglang.speculative_*`` and
    ``sglang.launch_args`` (``--flag value`` or ``--flag=value``); top-k None = not given, so
    SGLang chooses it by architecture (0.5.23's ``_auto_choose_speculative_params``: 4 for Llama
    and Grok, 1 for the others; older releases chose 4 for most)."""
    algo = str(getattr(section, "speculative_algorithm", None) or "")
    topk = int(getattr(section, "speculative_eagle_topk", None) or 0) or None
    args = [str(a) for a in (getattr(section, "launch_args", None) or [])]
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        if flag == "--speculative-algorithm":
            algo = value
        elif flag == "--speculative-eagle-topk":
            try:
                topk = int(value)
            except ValueError:
                raise ConfigError(f"sglang.launch_args: --speculative-eagle-topk {value!r} is not an integer",
                                  key="sglang.launch_args") from None
    return algo.strip().upper(), topk


def routed_experts_refusal(section: Any) -> str | None:
    """Why this server cannot return the experts it routed each token to (``rollout.return_routed_experts``,
    what MoE routing replay's R3 replays), or None: any speculative decoding, from the settings or
    ``launch_args``. rlcore-sglang refuses the pair when the server starts too; this says it at config time."""
    algo, topk = sglang_speculation(section)
    if not algo:
        return None
    if algo == "NGRAM":
        why = "with NGRAM SGLang returns all-zero routes (sglang #37949)"
    elif topk is None:
        why = ("speculative_eagle_topk is not set, so SGLang chooses it by architecture (4 for Llama and Grok, "
               "and for most architectures before 0.5.23); with eagle top-k > 1 SGLang returns the routes of the "
               "wrong KV slots (sglang #37949), and even with top-k 1 its routed-experts capturer does not count "
               "the speculative verify tokens (its own FIXME, sglang #16379)")
    elif topk > 1:
        why = f"with speculative_eagle_topk={topk} > 1 SGLang returns the routes of the wrong KV slots (sglang #37949)"
    else:
        why = ("even with speculative_eagle_topk=1 SGLang's routed-experts capturer does not count the speculative "
               "verify tokens (its own FIXME, sglang #16379), so rlcore-sglang refuses routed experts with any "
               "speculative decoding when the server starts")
    return (f"rollout.return_routed_experts asks SGLang for the experts it routed each token to (what replay.mode R3 "
            f"replays), but the server runs speculative decoding ({algo}): {why}. Turn speculative decoding off "
            f"(sglang.speculative_algorithm and launch_args), or set rollout.return_routed_experts: false "
            f"(replay.mode: R2 records the trainer's own routes instead)")


def check_settings(s: Any, config: Any = None) -> None:
    """Value checks omegaconf's types cannot express; errors name the key. With the whole
    ``config``, also the combinations that would leave a policy-derived draft stale."""
    choices = {
        "mode": MODES,
        "pause_mode": PAUSE_MODES,
        "selector": SELECTORS,
        "keep_together": KEEP_TOGETHER,
    }
    for key, allowed in choices.items():
        value = getattr(s, key)
        if value not in allowed:
            raise ConfigError(
                f"bad value for config key 'sglang.{key}': {value!r}; choose one of: {', '.join(allowed)}",
                key=f"sglang.{key}",
            )
    if s.url and s.mode == "engine":
        raise ConfigError(
            "sglang.url is set but sglang.mode is 'engine' (an in-process Engine has no URL); "
            "use mode 'server' to reach a running server",
            key="sglang.url",
        )
    if s.url and not s.url.startswith(("http://", "https://")):
        raise ConfigError(f"bad value for config key 'sglang.url': {s.url!r} must start with http:// or https://",
                          key="sglang.url")
    clash = [a for a in s.launch_args if str(a).split("=", 1)[0] in OWNED_LAUNCH_FLAGS]
    if clash:
        flag = str(clash[0]).split("=", 1)[0]
        raise ConfigError(f"sglang.launch_args sets {flag}, which rlcore sets itself (from "
                          f"{OWNED_LAUNCH_FLAGS[flag]}); remove it from launch_args", key="sglang.launch_args")
    check_bind_host(s.host, "sglang.host")
    if not 0 < s.port < 65536:
        raise ConfigError(f"bad value for config key 'sglang.port': {s.port}; expected a TCP port in 1..65535",
                          key="sglang.port")
    for key in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens", "nccl_master_port"):
        if getattr(s, key) < 0:
            raise ConfigError(f"bad value for config key 'sglang.{key}': must be >= 0", key=f"sglang.{key}")
    if not s.speculative_algorithm and (s.speculative_draft_model_path or s.speculative_num_steps
                                        or s.speculative_eagle_topk or s.speculative_num_draft_tokens):
        raise ConfigError(
            "sglang.speculative_* options are set but sglang.speculative_algorithm is empty; set it "
            "(e.g. NEXTN for MTP, EAGLE3) or clear the other speculative options",
            key="sglang.speculative_algorithm",
        )
    tags = [str(t) for t in s.release_for_training]
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise ConfigError(f"bad value for config key 'sglang.release_for_training': {unknown}; SGLang releases "
                          f"memory by the tags {', '.join(MEMORY_TAGS)}", key="sglang.release_for_training")
    if tags and not s.enable_memory_saver:
        raise ConfigError("sglang.release_for_training needs sglang.enable_memory_saver: true (SGLang releases "
                          "memory only when started with --enable-memory-saver)", key="sglang.release_for_training")
    sync = getattr(config, "sync", None) if config is not None else None
    problem = draft_sync_problem(s, getattr(sync, "name", None))
    if problem is not None:
        raise ConfigError(problem[1], key=problem[0])
    rollout = getattr(config, "rollout", None) if config is not None else None
    if rollout is not None and str(rollout.backend) == "sglang" and bool(rollout.return_routed_experts):
        why = routed_experts_refusal(s)
        if why is not None:
            raise ConfigError(why, key="sglang.speculative_eagle_topk")
