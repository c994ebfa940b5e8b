"""`--dist loadgroup` under pytest 9.2: pytest-xdist 3.8 groups a test by an "@group" suffix that
it writes to item._nodeid, which pytest 9.2 no longer reads (its id lives in item._id); the tests
of one xdist_group then ran on both workers at once, silently (pytest-dev/pytest-xdist#1386).
This writes the same suffix where pytest 9.2 keeps the id. conftest.py loads it; drop it with a
pytest-xdist that fixes #1386."""
import dataclasses

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
  if not hasattr(config, "workerinput") or not config.getvalue("loadgroup"):
    return  # only an xdist worker under --dist loadgroup sends ids to the scheduler
  for item in items:
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})
    node_id = getattr(item, "_id", None)
    suffix = "@" + "_".join(names)
    if names and node_id is not None and not str(node_id).endswith(suffix):
      grouped = dataclasses.replace(node_id)  # a frozen NodeId: its string is cached once
      object.__setattr__(grouped, "_str_cache", f"{node_id}{suffix}")
      item._id = grouped  # pylint: disable=protected-access
