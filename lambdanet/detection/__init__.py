"""Moved to :mod:`lambdanet.tasks.detection` (this path and its modules are removed in lambdanet 0.4)."""

from lambdanet.helpers import moved_module

moved_module(__name__, "lambdanet.tasks.detection", globals(), renamed={"trainer": "lambdanet.tasks.detection.task"})
