"""Adapters from other protocols and frameworks onto the guard (MCP tools, ...)."""
