"""The processes of a node: the supervisor that owns them and their cores
(``supervisor``, ``allocation``), how a model-running process is started
(``launch``) and becomes a ready instance (``runtime``), and the worker loop
that serves sub-batches (``worker``)."""
