"""Byte-level language models as a task of the engine: options and recipes (:mod:`~lambdanet.tasks.lm.config`),
corpora (:mod:`~lambdanet.tasks.lm.data`), training, evaluation in bits per byte and sampling
(:mod:`~lambdanet.tasks.lm.task`). The models are registered in :mod:`lambdanet.models.lm_zoo`
(``list_models(task="lm")``)."""

from lambdanet.tasks.lm.config import LMConfig
from lambdanet.tasks.lm.data import Corpus, load_corpus
from lambdanet.tasks.lm.task import evaluate_bits_per_byte, load_lm, sample, train_lm

__all__ = ["Corpus", "load_corpus", "LMConfig", "train_lm", "evaluate_bits_per_byte", "load_lm", "sample"]
