"""The benchmark (not shipped in the wheel). Run its parts from the project root, as modules:

- ``python -m bench.run``: the HTTP benchmark (README: "Performance");
- ``python -m bench.inprocess``: the guard's cost called in process, no HTTP;
- ``python -m bench.store_floor``: the store alone against raw asyncpg.

``bench.pgwire`` (round trips counted on the Postgres wire) is shared with the tests.
"""
