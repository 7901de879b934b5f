"""``make bench-peers``: packrat-mq against TorchServe (see ``benchmarks/bench_peers.py``).

``ts_handler`` runs inside TorchServe's own environment (numpy and torch only);
the other modules run in the project's.
"""
