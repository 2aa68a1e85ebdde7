"""Adapters of the guards to other frameworks: broker consumer presets, for now.

Each module imports its optional package (the extra of the same name) when it is
imported itself; importing this package imports none of them.
"""
