"""Moved to :mod:`lambdanet.tasks.classification`; this import path works until 0.4 (with a warning)."""

from lambdanet.helpers import moved_module

moved_module(
    __name__, "lambdanet.tasks.classification", globals(), renamed={"trainer": "lambdanet.tasks.classification.task"}
)
