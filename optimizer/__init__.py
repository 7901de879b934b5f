"""The Packrat optimizer: what one instance costs, and which instances to run.

``planning`` holds measured profiles (``L[t, b]`` per model and machine) and
the solver that turns a profile, a core budget ``T`` and a batch ``B`` into
the configuration with the lowest predicted latency; ``profiling`` measures
profiles; ``calibration`` serves the best candidates for real to pick one.
"""
