"""zero_ext inside the training libraries people already use.

Each module imports its library lazily, so ``import zero_ext`` never needs them:

- ``zero_ext.integrations.transformers``: ``ZeroExtTrainer``, a Hugging Face
  ``Trainer`` that wraps, clips, saves and resumes through zero_ext;
- ``zero_ext.integrations.accelerate``: ``prepare(accelerator, model,
  optimizer, ...)`` for ``accelerate`` training loops;
- ``zero_ext.integrations.lightning``: ``ZeroExtStrategy``, a Lightning strategy.
"""
