"""The function guard (Once): queue consumers, jobs and agent tools."""
