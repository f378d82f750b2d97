"""Moved to :mod:`lambdanet.tasks.classification.data`; this import path works until 0.4 (with a warning)."""

from lambdanet.helpers import moved_module

moved_module(__name__, "lambdanet.tasks.classification.data")
