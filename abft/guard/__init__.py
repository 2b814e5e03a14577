"""The training-step guard: ``step`` (``StepGuard``: one verdict a step, rerun to tell a
transient fault from a persistent one, skip or halt) and ``ledger`` (strikes per device, kept
across restarts; quarantine)."""
