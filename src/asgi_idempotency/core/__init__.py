"""The rules and the one execution core: lifecycle, lease, keys, canonical JSON, errors."""
