"""The dispatcher of a model: aggregates its requests into batches (``aggregation``),
splits each among the instances (``partitioning``) and fans the sub-batches out
(``dispatcher``); ``orphans`` answers requests sent to models no one serves."""
