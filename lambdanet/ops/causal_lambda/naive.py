"""App. B.2's masked lambdas as defined, one query position at a time (``Theta(n^2)``; the reference of the tests)."""

from lambdanet.functional.causal import causal_lambda_reference as naive_causal_lambda

__all__ = ["naive_causal_lambda"]
