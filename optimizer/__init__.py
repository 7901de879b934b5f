"""The Packrat optimizer: measured latency profiles and the solver that splits cores and batch.

``profile`` holds what was measured (``L[t, b]`` per model and machine);
``solving`` turns a profile, a core budget ``T`` and a batch ``B`` into the
configuration of instances with the lowest predicted latency.
"""
from __future__ import annotations
