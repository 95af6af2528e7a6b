"""Core's built-in plugins. Each is a plugin module registered through an entry point of the
``rlcore`` distribution, exactly like an external plugin (and always active). Modules here
import nothing heavy: their factories do."""

#: entry-point name -> module (mirrors core/pyproject.toml, for managers without autoload)
BUILTIN_PLUGINS = {
    "reference": "rlcore.builtin.reference",
    "local": "rlcore.builtin.local",
    "inproc": "rlcore.builtin.inproc",
    "disk": "rlcore.builtin.disk",
    "hf": "rlcore.builtin.hf",
    "megatron": "rlcore.builtin.megatron",
    "algorithms": "rlcore.builtin.algorithms",
}
