"""rlcore-example-plugin: see README.md."""
