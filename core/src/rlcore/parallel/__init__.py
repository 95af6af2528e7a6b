"""Trainer ranks in several processes, whatever started them: the rank strategies the trainer
takes (:mod:`.strategy`: one process, the default; :mod:`.data_parallel`: samples split, gradients
summed; :mod:`.model_parallel`: an engine's shards, same samples on every rank), the rank
process's entry (:mod:`.worker`: join torch.distributed, build the stack, pick the strategy by the
engine's capabilities, train) and the push's memory measurement (:mod:`.push_memory`). A launcher
(``cluster.backend``: rlcore-ray's, or a test's own processes) starts the processes and calls
:func:`rlcore.parallel.worker.run_rank` in each."""
