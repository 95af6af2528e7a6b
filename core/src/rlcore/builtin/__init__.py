"""Core's built-in plugins. Each is a plugin module registered through an entry point of the
``rlcore`` distribution (core/pyproject.toml), exactly like an external plugin, and always
active; :func:`rlcore.discovery.core_entry_points` lists them. Modules here import nothing
heavy: their factories do."""
