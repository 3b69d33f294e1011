"""Online self-distillation (paper 3.3, 4.1-4.4): turning a causal LM into an MTP model.

``config`` (every knob, once), ``data`` (rows -> token sequences), ``layout`` (MTP regions and the
blocked attention mask), ``objective`` (the student-forced loss on a batch), ``trainer`` (the run:
steps, checkpoints, exports), ``self_answers`` (the base model's own answers as training text) and
``heldout`` (scoring adapters on held-out answers). Uses :mod:`model.engine`; never
:mod:`model.evaluation`.
"""
