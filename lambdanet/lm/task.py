"""Moved to :mod:`lambdanet.tasks.lm.task`; this import path is kept for one release."""

from lambdanet.helpers import moved_module

moved_module(__name__, "lambdanet.tasks.lm.task")
