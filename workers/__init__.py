"""Worker side: where instances may run (topology), which cores each gets
(allocation), and the processes that serve sub-batches on them.

Threads are set by the parent, before torch is imported: the supervisor
allocates cores, puts :func:`workers.allocation.thread_env` into the child's
environment, and the child pins itself with
:func:`workers.allocation.pin_current_process` before it loads a model.
"""
