"""Adapters of the guards to other frameworks and protocols: broker consumer presets, MCP tools.

Each module imports its optional package (the extra of the same name) when it is
imported itself; importing this package imports none of them.
"""
