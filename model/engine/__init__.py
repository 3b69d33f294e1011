"""The inference engine (paper 3.1, 3.4, 4.5): everything needed to decode with an MTP model.

=================  ========================================================================
module             what it holds
=================  ========================================================================
``loading``        a source (embedded default, local dir, GGUF, hub id) -> ``LoadedModel``
``loaded_model``   ``LoadedModel``: prompts, one forward pass, the teacher (adapter off)
``adapter_format`` the on-disk MTP checkpoint format (one writer, one reader)
``strategies``     the strategy vocabulary and ``resolve_strategy``
``decoding``       ``Decoder``: propose, accept, trim, commit; ``PassRecord``
``fast_weights``   packing a model's weights for the fast forward pass
``fast_forward``   the fast forward pass; ``kv_cache``: its preallocated KV cache
``scoring``        an answer's log-likelihood under the teacher
``text``           untrusted text kept literal, token bytes, UTF-8 state
``precision``      which dtype a device computes natively
=================  ========================================================================

It imports nothing from :mod:`model.training` or :mod:`model.evaluation`.
"""
