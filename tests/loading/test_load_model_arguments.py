"""``load_model``'s Python arguments are checked by type at the door, each error naming the argument.

``num_resident="8"`` raised a TypeError from deep inside the build, ``8.0`` another, and ``True`` was
taken as 1; the errors there named CLI flags (``--num-resident``) a Python caller never typed.
Checked before the model directory is read (``model_path`` is a directory that does not exist).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagedexperts import load_model
from pagedexperts.loading.loader import check_arguments

MISSING = "/nonexistent/model"  # reaching the directory raises FileNotFoundError, not TypeError


@pytest.mark.parametrize("kwargs,takes", [
    (dict(num_resident="8"), "num_resident takes int or None, not str"),
    (dict(num_resident=8.0), "num_resident takes int or None, not float"),
    (dict(num_resident=True), "num_resident takes int or None, not bool"),
    (dict(host_memory_gb="2"), "host_memory_gb takes float or None, not str"),
    (dict(host_memory_gb=False), "host_memory_gb takes float or None, not bool"),
    (dict(prefetch=1), "prefetch takes bool, not int"),
    (dict(dtype=16), "dtype takes str or None, not int"),
    (dict(device=0), "device takes str, not int"),
    (dict(check_independence="no"), "check_independence takes bool, not str"),
])
def test_a_value_of_another_type_is_refused_naming_the_argument(kwargs, takes):
    with pytest.raises(TypeError) as err:
        load_model(MISSING, **kwargs)
    name, value = next(iter(kwargs.items()))
    assert str(err.value) == f"load_model({name}={value!r}): {takes}" and "--" not in str(err.value)


def test_an_unknown_keyword_lists_the_arguments():
    with pytest.raises(TypeError, match=r"unknown keyword arguments \['num_resdent'\]; it takes model_path, "
                                        r"check_independence and .*num_resident"):
        load_model(MISSING, num_resdent=8)


def test_a_model_path_of_another_type_is_refused():
    with pytest.raises(TypeError, match=r"load_model\(model_path=123\): model_path takes str or Path or None, not int"):
        load_model(123)


@pytest.mark.parametrize("kwargs", [dict(num_resident=8), dict(num_resident=np.int64(8)), dict(num_resident=None),
                                    dict(host_memory_gb=2), dict(host_memory_gb=1.5), dict(prefetch=True)])
def test_the_types_each_argument_takes_pass(kwargs):
    check_arguments(Path(MISSING), True, kwargs)
    with pytest.raises(FileNotFoundError):  # on to the directory
        load_model(MISSING, **kwargs)
