"""The dispatcher: aggregates a model's requests into batches and fans them out."""
