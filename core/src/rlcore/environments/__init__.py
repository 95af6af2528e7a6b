"""Multi-turn rollouts (issue 29; docs/agents.md): the conversation loop core runs around an
``environment`` provider (:mod:`rlcore.environments.conversation`), the bounded tool calls
(:mod:`rlcore.environments.tools`) and core's environments (:mod:`rlcore.environments.standard`:
``single_turn``, ``tools``). The code-execution tool ``python`` and its sandbox are rlcore-sandbox's."""
