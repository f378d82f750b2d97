"""The one training engine every task runs on (docs/architecture.md): the run configuration base, the run
state (checkpoint and ``--resume``), the loop, the optimizer and schedule, DDP, the run directory, logs."""
