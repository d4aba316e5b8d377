"""Collective communication between the ranks of one engine core (tensor and pipeline groups).

`parallel_state` owns the process groups and the collectives the model calls; with nothing
initialized (the `uni` executor) every group has one rank and every collective is the
identity. `shm_allreduce` is the TP group's all-reduce between ranks on one host,
`cpu_binding` the cores each rank's threads run on, `shm_broadcast` the executor's
shared-memory message queue.
"""
