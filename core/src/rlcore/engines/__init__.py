"""Training engines and what every engine shares. ``hf`` (transformers) lives here; other
engines are plugins (``megatron``: the ``rlcore-megatron`` distribution) and use the shared
pieces: router-decision checks (:mod:`.routing`), HF checkpoint names (:mod:`.hf_names`) and the
tiny-model builder (:mod:`.tiny`)."""
