"""Byte-level language models as a task of the engine: corpora (:mod:`~lambdanet.lm.corpus`), training,
evaluation in bits per byte and sampling (:mod:`~lambdanet.lm.task`). The models are registered in
:mod:`lambdanet.models.lm` (``list_models(task="lm")``)."""

from lambdanet.lm.corpus import Corpus, load_corpus
from lambdanet.lm.task import LMConfig, evaluate_bits_per_byte, load_lm, sample, train_lm

__all__ = ["Corpus", "load_corpus", "LMConfig", "train_lm", "evaluate_bits_per_byte", "load_lm", "sample"]
