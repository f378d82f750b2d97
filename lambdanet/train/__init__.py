"""Moved to :mod:`lambdanet.tasks.classification`; this import path is kept for one release."""

from lambdanet.helpers import moved_module

moved_module(
    __name__, "lambdanet.tasks.classification", globals(), renamed={"trainer": "lambdanet.tasks.classification.task"}
)
