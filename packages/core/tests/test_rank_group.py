"""ferryman.cluster.rank_group without Ray actors: the rank builder is named as "module:function"
and a bad name fails before any actor starts, naming it. (The group itself runs in
trainer-fsdp's test_ray_group.py and trainer-megatron's test_megatron_ray_group.py.)"""

from __future__ import annotations

import os.path

import pytest

from ferryman.cluster.rank_group import resolve


def test_resolve_names_a_function_of_a_module():
    assert resolve("os.path:join") is os.path.join


@pytest.mark.parametrize("bad, says", [
    ("os.path.join", "expected 'module:function'"),
    (":join", "expected 'module:function'"),
    ("os.path:", "expected 'module:function'"),
    ("ferryman_no_such_module:build", "No module named 'ferryman_no_such_module'"),
    ("os.path:no_such_function", "no_such_function"),
])
def test_a_bad_builder_name_is_a_clear_error(bad, says):
    with pytest.raises(ValueError, match=says) as info:
        resolve(bad)
    assert repr(bad) in str(info.value)  # the message names what was given
