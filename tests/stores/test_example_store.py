"""The "Writing a store" page: its store is examples/dict_store.py, and it passes the contract.

The page's two blocks are read from the docs (tests.project.docs_text): the first must be the
example file as it is, the second (a user's test module) runs here as printed, so
pytest collects its ``TestDictStore`` from this module.
"""

from __future__ import annotations

import re
from pathlib import Path

from asgi_idempotency.stores.registry import kind_of, open_store
from examples.dict_store import DictStore
from tests.project.docs_text import ROOT

PAGE = ROOT / "docs" / "guide" / "writing-a-store.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)


def test_the_page_shows_the_example_file_as_it_is() -> None:
    assert BLOCKS[0] == Path(ROOT / "examples" / "dict_store.py").read_text(encoding="utf-8")


def test_the_example_registers_itself_for_its_urls() -> None:
    kind = kind_of("dict://")
    assert kind.name == "dict"
    assert isinstance(open_store("dict://"), DictStore)


# The page's test module, run as printed: defines TestDictStore(StoreContract).
exec(compile(BLOCKS[1], str(PAGE), "exec"))
