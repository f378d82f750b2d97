"""The tasks of the engine, one folder each and laid out alike (docs/architecture.md): ``config.py`` (the
:class:`~lambdanet.engine.config.RunConfig` subclass and its recipes), ``data.py``, ``task.py`` (the
:class:`~lambdanet.engine.task.Task`) and what is particular to the task.

* :mod:`lambdanet.tasks.classification`: image classification (``lambdanet train``);
* :mod:`lambdanet.tasks.lm`: byte-level language models (``lambdanet lm train``);
* :mod:`lambdanet.tasks.detection`: detection and instance segmentation (``lambdanet detect``)."""
