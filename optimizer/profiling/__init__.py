"""The profiler: measures a model's latency ``L[t, b]`` on this machine the way it is served.

``options`` says what to measure and where the profile goes; ``scheduler``
walks the (threads, batch) grid and decides what to time and what to skip;
``child`` is the pinned process per thread count that loads the model as a
worker does and times it; ``statistics`` decides when a timing is precise
enough; ``jobs`` runs the same profiler as RQ jobs on other nodes. The result
is an :class:`optimizer.planning.profile.Profile`.
"""
