"""The speculative loop: flags -> config, the decode loop, proposers, verification, sampling, adaptive k and its calibration, metrics."""
