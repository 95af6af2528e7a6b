"""The plugin-author kit.

* :mod:`rlcore.testing.pytest_plugin` (auto-loaded by pytest through rlcore's ``pytest11`` entry
  point): fixtures ``rlcore_plugin_manager`` (fresh, no entry-point autoload, built-ins
  registered), ``rlcore_bare_plugin_manager`` (nothing registered), ``register_plugin``
  (temporary registration that always unregisters), ``rlcore_config`` (a run config validated
  as :func:`rlcore.stack.load_config` does, registered plugins' sections and algorithms
  included), ``tiny_model_dirs`` (tiny dense and MoE HF model directories created locally).
* :mod:`rlcore.testing.conformance`: one suite per provider hook — ``ForwardFnConformance``,
  ``RolloutBackendConformance``, ``WeightSyncConformance``, ``EngineConformance``, and
  :mod:`rlcore.testing.algorithm_conformance` ``AlgorithmConformance``. A plugin's own tests
  subclass the one for each provider it registers; a failed check names the contract that broke
  (:func:`rlcore.testing.contracts.assert_close`).
* :mod:`rlcore.testing.models`: helpers that create tiny models and compute what HF
  transformers says (greedy tokens, log-probs) to compare against.
* :mod:`rlcore.testing.imports`: ``modules_loaded_by(statements, watched)``, which heavy
  modules a plugin module's import pulls in (checked in a fresh interpreter).
"""
