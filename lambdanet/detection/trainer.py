"""Moved to :mod:`lambdanet.tasks.detection.task` (this path is removed in lambdanet 0.4)."""

from lambdanet.helpers import moved_module

moved_module(__name__, "lambdanet.tasks.detection.task")
