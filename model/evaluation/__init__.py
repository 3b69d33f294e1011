"""Measuring MTP decoding (paper 4.5): ``gsm8k`` (problems, prompts, answer extraction), ``accuracy``
(accuracy, effective k and quality under the teacher per strategy), ``speed`` (wall-clock against HF
``generate``, width curves, bandwidth) and ``lm_eval_model`` (the lm-eval-harness model ``mtp``). Uses
:mod:`model.engine`; never :mod:`model.training`.
"""
