"""Beyond one process: tensor parallelism (torch.distributed) and data-parallel replicas (Ray).

    plan.py            which heads / MLP columns / vocabulary rows each rank holds; the checks
                       that refuse a split (a size that does not divide the heads or the MLP)
    weights.py         which rows / columns of each checkpoint tensor a rank keeps (Llama's
                       names as they stream; our names after a family's own layout change)
    layers.py          the pass that makes a built model tensor-parallel (vocabulary-parallel
                       embedding and LM head, all-reduce after o/down); float, run-time
                       quantized or quantized-checkpoint layers
    process_group.py   gloo on CPU, NCCL on CUDA; torchrun's RANK / WORLD_SIZE / MASTER_ADDR
    executor.py        rank 0 keeps the scheduler and the sampler; ranks 1..N-1 (spawned, or
                       torchrun's) mirror its model calls from a small per-call message
    workers.py         those local ranks as processes: spawned, or forked from a forkserver
                       (LLMSERVE_WORKER_MULTIPROC_METHOD)
    data_parallel.py   ``llmserve serve --data-parallel-size N``: N engine replicas as Ray
                       actors behind one endpoint, a longest-prefix router, restarts
    replica.py         one replica's Ray actor and server-side slot, the model-less engine
                       view the HTTP layer reads, the Ray connection

How to run across machines, and what N devices buy: docs/distributed.md.
"""
