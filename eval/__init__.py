"""The detection-coverage evaluation (installed as ``abft.eval``; ``abft eval``): paired
replicas of one deterministic training run, faults injected into one, compared submodule by
submodule and step by step, alarms cross-checked against the mismatches, and the report."""
