"""Built-in plugin ``reference``: the reference forward_fn (chunked fp32 head)."""

from rlcore import PLUGIN_API, hookimpl
from rlcore.types import Cap, ForwardFnSpec

__all__ = ["PLUGIN_API", "forward_fn"]


def _build(ctx):
    from rlcore.heads import ReferenceHead

    return ReferenceHead(chunk_tokens=int(ctx.config.forward.chunk_tokens))


@hookimpl
def forward_fn():
    yield ForwardFnSpec(
        name="reference",
        factory=_build,
        capabilities={Cap.ENTROPY, Cap.PER_TOKEN_TEMPERATURE, Cap.VOCAB_PARALLEL, Cap.SEQUENCE_PARALLEL,
                      Cap.MASK_SKIPS_COMPUTE, Cap.SUM_PI_SQUARED},
        description="chunked fp32 log-prob/entropy head in plain torch (the reference semantics)",
    )
