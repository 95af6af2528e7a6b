"""Trainer ranks in several processes, whatever started them: data parallelism (samples split,
gradients summed), model parallelism (an engine's shards, same samples on every rank), the rank
process's entry (:mod:`.worker`: join torch.distributed, build the stack, train) and the push's
memory measurement. A launcher (``cluster.backend``: rlcore-ray's, or a test's own processes)
starts the processes and calls :func:`rlcore.parallel.worker.run_rank` in each."""
